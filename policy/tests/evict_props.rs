// SPDX-License-Identifier: GPL-2.0
//! Property tests of `evict`: `Clock::select` against a direct reference implementation
//! (which remembers chosen frames in a side array) and against the documented guarantees;
//! watermark and reclaim bounds.

use gmem_policy::evict::*;
use proptest::prelude::*;

fn evictable(f: u8) -> bool {
    f & F_USED != 0 && f & F_PINNED == 0
}

/// The documented algorithm, written plainly.
fn reference(flags: &mut [u8], hand: &mut u64, max: usize) -> Vec<u64> {
    let all = vec![true; flags.len()];
    reference_where(flags, hand, max, &all)
}

/// The documented algorithm restricted to the frames `elig` marks (`Clock::select_where`).
fn reference_where(flags: &mut [u8], hand: &mut u64, max: usize, elig: &[bool]) -> Vec<u64> {
    let n = flags.len();
    if *hand >= n as u64 {
        *hand = 0;
    }
    let mut out = Vec::new();
    let mut chosen = vec![false; n];
    for want_clean in [true, false] {
        for i in 0..n {
            let f = flags[i];
            if out.len() < max && evictable(f) && f & F_LENT != 0 && (f & F_CLEAN != 0) == want_clean && elig[i] {
                out.push(i as u64);
                chosen[i] = true;
            }
        }
    }
    if out.len() == max {
        return out;
    }
    let mut h = *hand as usize;
    for _ in 0..2 * n {
        if out.len() == max {
            break;
        }
        let i = h;
        h = (h + 1) % n;
        let f = flags[i];
        if !evictable(f) || chosen[i] || !elig[i] {
            continue;
        }
        if f & F_REF != 0 {
            flags[i] &= !F_REF;
        } else {
            out.push(i as u64);
            chosen[i] = true;
        }
    }
    *hand = h as u64;
    out
}

fn flags() -> impl Strategy<Value = Vec<u8>> {
    let flag = prop_oneof![
        6 => Just(F_USED),
        6 => Just(F_USED | F_REF),
        1 => Just(0u8),
        1 => 0u8..32,
        1 => Just(F_USED | F_PINNED),
        2 => Just(F_USED | F_LENT),
        2 => Just(F_USED | F_LENT | F_CLEAN),
        1 => Just(F_USED | F_CLEAN | F_REF),
    ];
    prop::collection::vec(flag, 0..200)
}

fn hand() -> impl Strategy<Value = u64> {
    prop_oneof![0u64..250, any::<u64>()]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Eviction within a cgroup: only eligible frames are chosen, ineligible ones keep
    /// their flags (no second chance consumed on someone else's frame), and the choice is
    /// the reference algorithm's over the eligible frames.
    #[test]
    fn select_where_takes_eligible_frames_only(
        orig in flags(), h0 in hand(), max in 0usize..260, seed in any::<u64>()
    ) {
        let elig: Vec<bool> = (0..orig.len()).map(|i| (seed >> (i % 64)) & 1 == 1).collect();
        let (mut f, mut h) = (orig.clone(), h0);
        let (mut rf, mut rh) = (orig.clone(), h0);
        let mut out = vec![0u64; max];
        let k = Clock::new(&mut f, &mut h).select_where(&mut out, |i| elig[i]);
        let want = reference_where(&mut rf, &mut rh, max, &elig);
        prop_assert_eq!(&out[..k], &want[..]);
        prop_assert_eq!(&f, &rf);
        prop_assert_eq!(h, rh);
        for &v in &out[..k] {
            prop_assert!(elig[v as usize]);
        }
        for i in 0..orig.len() {
            if !elig[i] {
                prop_assert_eq!(f[i], orig[i]);
            }
        }
    }

    /// With an exact count of its lent frames, the view that may skip the lent tier
    /// chooses exactly what the plain one does, and leaves the same flags and hand.
    #[test]
    fn counted_lent_view_selects_the_same(
        orig in flags(), h0 in hand(), max in 0usize..260, no_lent in any::<bool>()
    ) {
        // Half the cases without any lent frame: the tier is skipped there.
        let orig: Vec<u8> = if no_lent { orig.iter().map(|f| f & !F_LENT).collect() } else { orig };
        let lent = orig.iter().filter(|&&f| f & F_LENT != 0).count() as u64;
        let (mut f, mut h) = (orig.clone(), h0);
        let (mut cf, mut ch) = (orig.clone(), h0);
        let mut out = vec![0u64; max];
        let mut cout = vec![0u64; max];
        let k = Clock::new(&mut f, &mut h).select(&mut out);
        let ck = Clock::with_lent(&mut cf, &mut ch, lent).select(&mut cout);
        prop_assert_eq!(&out[..k], &cout[..ck]);
        prop_assert_eq!(&f, &cf);
        prop_assert_eq!(h, ch);
    }

    #[test]
    fn select_matches_reference_and_guarantees(
        orig in flags(), h0 in hand(), max in 0usize..260, rounds in 1usize..4
    ) {
        let (mut f, mut h) = (orig.clone(), h0);
        let (mut rf, mut rh) = (orig.clone(), h0);
        for _ in 0..rounds {
            let before = f.clone();
            let mut out = vec![0u64; max];
            let k = Clock::new(&mut f, &mut h).select(&mut out);
            let want = reference(&mut rf, &mut rh, max);
            prop_assert_eq!(&out[..k], &want[..]);
            prop_assert_eq!(&f, &rf);
            prop_assert_eq!(h, rh);

            // The documented guarantees, independently of the reference.
            let victims = &out[..k];
            let n_evictable = before.iter().filter(|&&x| evictable(x)).count();
            prop_assert_eq!(k, max.min(n_evictable), "two sweeps find every evictable frame");
            prop_assert!(h < before.len().max(1) as u64);
            let mut seen = vec![false; before.len()];
            let mut tier = 0; // 0: lent clean, 1: lent dirty, 2: others
            for &v in victims {
                let v = v as usize;
                prop_assert!(evictable(before[v]), "victim {} not evictable", v);
                prop_assert!(!seen[v], "duplicate victim {}", v);
                seen[v] = true;
                let t = match (before[v] & F_LENT != 0, before[v] & F_CLEAN != 0) {
                    (true, true) => 0,
                    (true, false) => 1,
                    _ => 2,
                };
                prop_assert!(t >= tier, "lent frames (clean first) come first");
                tier = t;
            }
            for i in 0..before.len() {
                prop_assert_eq!(f[i] | F_REF, before[i] | F_REF, "non-REF bit changed");
                if seen[i] && before[i] & F_LENT != 0 {
                    prop_assert_eq!(f[i], before[i], "lent victim modified");
                }
                if f[i] != before[i] {
                    prop_assert!(evictable(before[i]), "REF cleared on a skipped frame");
                }
            }
            // Without room to spare, the lent tier alone can fill `out`.
            let n_lent = before.iter().filter(|&&x| evictable(x) && x & F_LENT != 0).count();
            prop_assert_eq!(victims.iter().filter(|&&v| before[v as usize] & F_LENT != 0).count(),
                max.min(n_lent));
            // The kernel frees the victims.
            for &v in victims {
                f[v as usize] = 0;
                rf[v as usize] = 0;
            }
        }
    }

    #[test]
    fn large_out_returns_every_unpinned_used_frame(orig in flags(), h0 in hand()) {
        let mut f = orig.clone();
        let mut h = h0;
        let mut out = vec![0u64; orig.len() + 1];
        let k = Clock::new(&mut f, &mut h).select(&mut out);
        let mut got: Vec<u64> = out[..k].to_vec();
        got.sort_unstable();
        let want: Vec<u64> = (0..orig.len() as u64).filter(|&i| evictable(orig[i as usize])).collect();
        prop_assert_eq!(got, want);
    }

    #[test]
    fn reclaim_target_bounds(free in any::<u64>(), low in any::<u64>(), high in any::<u64>(),
                             ev in any::<u64>()) {
        let t = reclaim_target(free, low, high, ev);
        prop_assert!(t <= ev);
        if free >= low {
            prop_assert_eq!(t, 0);
        } else {
            let goal = high.max(low);
            prop_assert!(free + t <= goal, "never above the high watermark");
            prop_assert_eq!(free + t == goal, t < ev || ev == goal - free);
        }
    }

    /// Batches that take promises one after another (each as much as it wants, up to the
    /// room left) never promise, together, more than the lender has above `high + 1`, and
    /// all of them get all they want while their wants together fit in that.
    #[test]
    fn promises_never_reach_into_the_reserve(free in 0u64..5000, high in 0u64..3000,
                                             wants in proptest::collection::vec(0u64..2000, 0..8)) {
        let above = free.saturating_sub(high + 1);
        let (mut promised, mut wanted) = (0u64, 0u64);
        for w in wants {
            promised += w.min(park_room(free, high, promised));
            wanted += w;
            prop_assert!(promised <= above);
            if wanted <= above {
                prop_assert_eq!(promised, wanted);
            } else {
                prop_assert_eq!(promised, above);
            }
        }
    }

    #[test]
    fn watermark_bounds(n in prop_oneof![0u64..2000, any::<u64>()]) {
        let (low, high) = default_watermarks(n);
        prop_assert!(low <= high && high <= n / 2 && low <= n / 4);
        prop_assert!(low >= 8.min(n / 4));
        if n >= 512 {
            prop_assert_eq!((low, high), (n / 64, 2 * (n / 64)));
        }
        let (l2, _) = default_watermarks(n.saturating_add(1));
        prop_assert!(l2 >= low, "monotonic");
    }
}
