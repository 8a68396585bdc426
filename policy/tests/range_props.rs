// SPDX-License-Identifier: GPL-2.0
//! Property tests of `range`: rounding against a byte-level definition, and `AdviceMap`
//! against a naive per-page array.

use gmem_policy::range::{alloc_size, inward, outward, AdviceMap, PageRange, RangeError};
use proptest::prelude::*;

const PAGES: u64 = 48;
const CAP: usize = 6;

/// Minimal number of runs representing `pages` (maximal equal nonzero stretches).
fn canonical_runs(pages: &[u32]) -> usize {
    let mut n = 0;
    let mut prev = 0;
    for &b in pages {
        if b != 0 && b != prev {
            n += 1;
        }
        prev = b;
    }
    n
}

#[derive(Clone, Copy, Debug)]
struct Op {
    set: bool,
    first: u64,
    count: u64,
    bits: u32,
}

fn op() -> impl Strategy<Value = Op> {
    (any::<bool>(), 0..PAGES, 0..PAGES / 2, 1u32..16).prop_map(|(set, first, count, bits)| Op {
        set,
        first,
        count,
        bits,
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn advice_map_matches_per_page_model(ops in prop::collection::vec(op(), 0..40)) {
        let mut map = AdviceMap::<CAP>::new();
        // Large enough for every generated range (first < PAGES, count < PAGES / 2).
        let mut model = [0u32; 2 * PAGES as usize];
        for o in ops {
            let mut next = model;
            for p in o.first..o.first + o.count {
                let b = &mut next[p as usize];
                *b = if o.set { *b | o.bits } else { *b & !o.bits };
            }
            let before = map;
            let r = PageRange { first: o.first, count: o.count };
            let res = if o.set { map.set(r, o.bits) } else { map.clear(r, o.bits) };
            let need = canonical_runs(&next);
            if need <= CAP {
                prop_assert!(res.is_ok(), "Full although {} runs suffice", need);
                model = next;
            } else {
                prop_assert!(res.is_err(), "needs {} runs but succeeded", need);
                prop_assert_eq!(map, before, "failed update changed the map");
            }
            prop_assert_eq!(map.runs(), canonical_runs(&model), "runs not minimal");
            for p in 0..2 * PAGES + 2 {
                prop_assert_eq!(map.get(p), model.get(p as usize).copied().unwrap_or(0));
            }
        }
    }

    #[test]
    fn rounding_matches_byte_definition(
        start_pg in 0u64..1 << 40, size_pg in 1u64..64, off in 0u64..64 * 4096, len in 0u64..70 * 4096
    ) {
        let (start, size) = (start_pg * 4096, size_pg * 4096);
        let addr = start + off;
        let (o, i) = (outward(start, size, addr, len), inward(start, size, addr, len));
        if len == 0 {
            prop_assert_eq!((o, i), (Err(RangeError::Empty), Err(RangeError::Empty)));
        } else if off + len > size {
            prop_assert_eq!((o, i), (Err(RangeError::OutOfRegion), Err(RangeError::OutOfRegion)));
        } else {
            let (o, i) = (o.map_err(|e| TestCaseError::fail(format!("{e:?}")))?,
                          i.map_err(|e| TestCaseError::fail(format!("{e:?}")))?);
            // Page p (bytes [p*4096, (p+1)*4096)) is in `outward` iff it intersects the
            // range, and in `inward` iff it is contained in it.
            for p in 0..size_pg {
                let (lo, hi) = (p * 4096, (p + 1) * 4096);
                let touches = lo < off + len && off < hi;
                let covered = off <= lo && hi <= off + len;
                prop_assert_eq!(o.first <= p && p < o.first + o.count, touches, "outward page {}", p);
                prop_assert_eq!(i.first <= p && p < i.first + i.count, covered, "inward page {}", p);
            }
        }
    }

    #[test]
    fn huge_inputs_never_overflow(start in any::<u64>(), size in any::<u64>(), addr in any::<u64>(), len in any::<u64>()) {
        // No panic, and any success lies inside the region.
        for r in [outward(start, size, addr, len), inward(start, size, addr, len)].into_iter().flatten() {
            let end_pg = r.first.checked_add(r.count);
            prop_assert!(end_pg.is_some_and(|e| e <= size / 4096));
        }
        if let Ok(p) = alloc_size(size, len) {
            prop_assert!(size != 0 && size % 4096 == 0 && size <= len && p == size / 4096);
        }
    }
}
