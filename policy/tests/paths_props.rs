// SPDX-License-Identifier: GPL-2.0
//! Property tests of `paths`: a route through a peer is always whole chunks within the
//! pages and the peer's room, is taken only over reported links, and never makes the
//! modelled transfer slower than the direct path alone (it saves at least `MIN_GAIN_PCT`).

use gmem_policy::paths::*;
use proptest::prelude::*;

fn links() -> impl Strategy<Value = Links> {
    (prop_oneof![Just(0u64), 10u64..200_000], prop_oneof![Just(0u64), 10u64..800_000]).prop_map(|(h2d, d2d)| Links {
        h2d,
        d2h: h2d,
        d2d,
    })
}

proptest! {
    #[test]
    fn a_split_is_whole_chunks_within_bounds_and_pays(
        n in 0usize..8192,
        dst in links(),
        peer in links(),
        room in 0usize..8192,
    ) {
        let v = via_peer(n, dst, peer, room);
        prop_assert_eq!(v % CHUNK_PAGES, 0);
        prop_assert!(v <= n && v <= room);
        if v > 0 {
            prop_assert!(dst.h2d != 0 && peer.h2d != 0 && peer.d2d != 0);
            let alone = split_ns(n, 0, dst, peer);
            let t = split_ns(n, v, dst, peer);
            prop_assert!(u128::from(t) * 100 <= u128::from(alone) * u128::from(100 - MIN_GAIN_PCT));
            // No whole-chunk split the room allows is faster.
            for m in 0..=(n.min(room) / CHUNK_PAGES) {
                prop_assert!(t <= split_ns(n, m * CHUNK_PAGES, dst, peer));
            }
        }
    }

    #[test]
    fn the_modelled_time_of_all_direct_is_bytes_over_bandwidth(pages in 0u64..1 << 20, mbps in 1u64..1 << 20) {
        let t = transfer_ns(pages, mbps);
        prop_assert_eq!(t, pages * 4096 * 1000 / mbps);
        prop_assert_eq!(transfer_ns(pages, 0), u64::MAX);
    }
}
