// SPDX-License-Identifier: GPL-2.0
//! Property tests of `batch` (against a BTreeSet) and `frames` (against a per-frame model).

use gmem_policy::batch::{by_block, coalesce, BLOCK_SHIFT};
use gmem_policy::frames::{FrameError, FrameMap, CHUNK_FRAMES};
use proptest::prelude::*;
use std::collections::BTreeSet;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn coalesce_is_sorted_unique_pages(mut v in prop::collection::vec(
        prop_oneof![0u64..1 << 24, any::<u64>()], 0..200)
    ) {
        let want: BTreeSet<u64> = v.iter().map(|a| a & !0xfff).collect();
        let n = coalesce(&mut v);
        prop_assert!(v[..n].iter().copied().eq(want.iter().copied()));

        let blocks: Vec<&[u64]> = by_block(&v[..n]).collect();
        prop_assert_eq!(blocks.concat(), v[..n].to_vec());
        for (i, b) in blocks.iter().enumerate() {
            prop_assert!(!b.is_empty());
            prop_assert!(b.iter().all(|a| a >> BLOCK_SHIFT == b[0] >> BLOCK_SHIFT));
            if let Some(next) = blocks.get(i + 1) {
                prop_assert!(next[0] >> BLOCK_SHIFT > b[0] >> BLOCK_SHIFT);
            }
        }
    }

    #[test]
    fn frame_map_matches_model(
        nframes in prop_oneof![1u64..200, 1000u64..1700],
        ops in prop::collection::vec((0u8..5, 0u64..1800, 0usize..40), 0..80)
    ) {
        let mut bits = vec![0u64; FrameMap::words_for(nframes)];
        let (mut cursor, mut used) = (0u64, 0u64);
        let mut model = vec![false; nframes as usize];
        for (kind, f, k) in ops {
            // A fresh view per operation, as the kernel builds one per lock acquisition.
            let mut m = FrameMap::new(&mut bits, &mut cursor, &mut used, nframes)
                .ok_or_else(|| TestCaseError::fail("new refused valid state"))?;
            let free_before = model.iter().filter(|u| !**u).count();
            match kind {
                0 => match m.alloc() {
                    Some(x) => {
                        prop_assert!(x < nframes && !model[x as usize], "bad alloc {}", x);
                        model[x as usize] = true;
                    }
                    None => prop_assert_eq!(free_before, 0),
                },
                1 => {
                    let mut out = vec![u64::MAX; k];
                    let got = m.alloc_many(&mut out);
                    prop_assert_eq!(got, k.min(free_before));
                    for &x in &out[..got] {
                        prop_assert!(x < nframes && !model[x as usize], "bad/duplicate {}", x);
                        model[x as usize] = true;
                    }
                }
                2 => {
                    let took = m.alloc_at(f);
                    let was_free = model.get(f as usize) == Some(&false);
                    prop_assert_eq!(took, was_free);
                    if took {
                        model[f as usize] = true;
                    }
                }
                3 => {
                    // The chunk found is aligned, whole and free; none is found only when
                    // no aligned run is entirely free.
                    let whole = nframes / CHUNK_FRAMES;
                    let free_run = |c: u64| (c * CHUNK_FRAMES..(c + 1) * CHUNK_FRAMES).all(|x| !model[x as usize]);
                    match m.free_chunk() {
                        Some(b) => {
                            prop_assert!(b % CHUNK_FRAMES == 0 && b / CHUNK_FRAMES < whole);
                            prop_assert!(free_run(b / CHUNK_FRAMES));
                        }
                        None => prop_assert!(!(0..whole).any(free_run)),
                    }
                }
                _ => {
                    let r = m.free(f);
                    let want = match model.get(f as usize) {
                        None => Err(FrameError::OutOfRange),
                        Some(false) => Err(FrameError::NotAllocated),
                        Some(true) => Ok(()),
                    };
                    prop_assert_eq!(r, want);
                    if r.is_ok() {
                        model[f as usize] = false;
                    }
                }
            }
            prop_assert_eq!(m.used(), model.iter().filter(|u| **u).count() as u64);
            for (i, &u) in model.iter().enumerate() {
                prop_assert_eq!(m.is_used(i as u64), u);
            }
            prop_assert!(!m.is_used(nframes));
        }
    }
}
