// SPDX-License-Identifier: GPL-2.0
//! Property tests of `thrash`: verdict sequences of single pages for random parameters,
//! table capacity and LRU replacement against a reference, event counting.

use gmem_policy::thrash::{ThrashParams, ThrashTable, Verdict};
use proptest::prelude::*;
use std::collections::BTreeMap;

fn params() -> impl Strategy<Value = ThrashParams> {
    (1u64..1_000_000, 1u32..6, 1u32..12, 0u64..10_000_000).prop_map(|(window_ns, moves, throttles_to_pin, pin_ns)| {
        ThrashParams { window_ns, moves, throttles_to_pin, pin_ns }
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    /// Moves always more than a window apart are never throttled (unless a single move
    /// counts as thrashing, `moves == 1`).
    #[test]
    fn slow_movers_are_never_throttled(
        mut p in params(), moves in 2u32..6,
        gaps in prop::collection::vec(1u64..1_000_000, 1..50), page in any::<u64>()
    ) {
        p.moves = moves;
        let mut t: ThrashTable<4> = ThrashTable::new();
        let mut now = 0u64;
        for g in gaps {
            prop_assert_eq!(t.on_move(page, now, &p), Verdict::Migrate);
            now += p.window_ns + g;
        }
        prop_assert_eq!(t.events(), 0);
    }

    /// A page moving faster than the window: `moves - 1` migrations, then throttles, then a
    /// remote pin that lasts exactly `pin_ns`, then the same again.
    #[test]
    fn fast_mover_sequence(p in params(), period_frac in 0u64..=100, page in any::<u64>()) {
        let period = p.window_ns * period_frac / 100;
        let mut t: ThrashTable<2> = ThrashTable::new();
        let mut now = 1u64;
        for _cycle in 0..2 {
            for k in 1..=(p.moves - 1 + p.throttles_to_pin) {
                let want = if k < p.moves {
                    Verdict::Migrate
                } else if k - p.moves + 1 < p.throttles_to_pin {
                    Verdict::Throttle
                } else {
                    Verdict::PinRemote
                };
                prop_assert_eq!(t.on_move(page, now, &p), want, "move {}", k);
                now += period;
            }
            let pinned_at = now - period;
            if p.pin_ns > 0 {
                prop_assert!(t.pinned(page, pinned_at));
                prop_assert!(t.pinned(page, pinned_at + p.pin_ns - 1));
            }
            prop_assert!(!t.pinned(page, pinned_at + p.pin_ns));
            now = pinned_at + p.pin_ns;
        }
        prop_assert_eq!(t.events(), 2 * u64::from(p.throttles_to_pin));
    }

    /// Random traffic on a few pages: at most N entries, LRU replacement (times strictly
    /// increase, so there are no ties), events count the non-Migrate verdicts, a page
    /// pinned-remote answers PinRemote.
    #[test]
    fn table_capacity_lru_and_events(
        p in params(),
        ops in prop::collection::vec((0u64..8, 1u64..400_000), 0..200),
    ) {
        const N: usize = 4;
        let mut t: ThrashTable<N> = ThrashTable::new();
        let mut last: BTreeMap<u64, u64> = BTreeMap::new(); // reference: page -> last update
        let mut now = 0u64;
        let mut events = 0u64;
        for (page, gap) in ops {
            now += gap;
            let was_pinned = t.pinned(page, now);
            let v = t.on_move(page, now, &p);
            if was_pinned {
                prop_assert_eq!(v, Verdict::PinRemote);
            }
            if v != Verdict::Migrate {
                events += 1;
            }
            if !last.contains_key(&page) && last.len() == N {
                let (&lru, _) = last.iter().min_by_key(|(_, &time)| time).unwrap();
                last.remove(&lru);
            }
            last.insert(page, now);
            prop_assert!(t.len() <= N);
            prop_assert_eq!(t.len(), last.len());
            for q in 0..8 {
                prop_assert_eq!(t.contains(q), last.contains_key(&q), "page {}", q);
            }
            prop_assert_eq!(t.events(), events);
            if v == Verdict::PinRemote && p.pin_ns > 0 {
                prop_assert!(t.pinned(page, now));
            }
        }
    }

    /// Time going backwards or standing still never panics and never un-pins early.
    #[test]
    fn arbitrary_times_do_not_panic(
        p in params(), ops in prop::collection::vec((0u64..4, any::<u64>()), 0..100)
    ) {
        let mut t: ThrashTable<3> = ThrashTable::new();
        for (page, now) in ops {
            let _ = t.on_move(page, now, &p);
            let _ = t.pinned(page, now);
            prop_assert!(t.len() <= 3);
        }
    }
}
