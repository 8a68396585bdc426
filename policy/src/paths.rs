// SPDX-License-Identifier: GPL-2.0
//! Multi-path host→device transfers: how much of one large host→device copy to route
//! through an idle peer device instead of the destination's own host link.
//!
//! The route through a peer has two stages, in chunks of [`CHUNK_PAGES`]: the peer's host
//! link carries a chunk from host memory into staging frames of the peer, then the peer's
//! device link carries it on to the destination's frames. Stage 2 of a chunk starts once its
//! stage 1 is done, so the two stages overlap from the second chunk on; the direct part runs
//! on the destination's host link meanwhile. Each link carries one transfer at a time.
//!
//! The split is chosen to finish soonest: of every split in whole chunks that the peer has
//! staging room for, the one with the smallest modelled time `max(direct, via peer)`, taken
//! only when it beats the direct path alone by [`MIN_GAIN_PCT`] percent (staging has costs
//! the model leaves out: the peer's frames, a second driver call per chunk). Links the
//! driver did not report (bandwidth 0) are unknown, so nothing is routed over them.
#![allow(dead_code, unreachable_pub)]

/// Pages per stage of the route through a peer (256 KiB).
pub const CHUNK_PAGES: usize = 64;

/// A route through a peer is taken only if it saves at least this share of the time.
pub const MIN_GAIN_PCT: u64 = 10;

/// A device's link bandwidths as its driver reported them, MB/s (10^6 bytes per second);
/// 0 is "not reported".
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Links {
    /// Host memory to the device.
    pub h2d: u64,
    /// The device to host memory.
    pub d2h: u64,
    /// The device to a peer device.
    pub d2d: u64,
}

/// Nanoseconds to move `pages` 4 KiB pages at `mbps` MB/s (`u64::MAX` for an unknown link).
pub fn transfer_ns(pages: u64, mbps: u64) -> u64 {
    if mbps == 0 {
        return u64::MAX;
    }
    pages.saturating_mul(4096).saturating_mul(1000) / mbps
}

/// Modelled time of `n` host→device pages of which `via` (a multiple of [`CHUNK_PAGES`],
/// at most `n`) go through a peer with links `peer` and the rest direct over `dst`.
pub fn split_ns(n: usize, via: usize, dst: Links, peer: Links) -> u64 {
    let direct = transfer_ns(n.saturating_sub(via) as u64, dst.h2d);
    let direct = if via >= n { 0 } else { direct };
    if via == 0 {
        return direct;
    }
    let (s1, s2) = (peer.h2d, peer.d2d);
    if s1 == 0 || s2 == 0 {
        return u64::MAX;
    }
    // The slower stage sets the pace; the faster one adds one chunk (the pipeline's fill
    // or drain).
    let (slow, fast) = if s1 <= s2 { (s1, s2) } else { (s2, s1) };
    let staged = transfer_ns(via as u64, slow).saturating_add(transfer_ns(CHUNK_PAGES as u64, fast));
    core::cmp::max(direct, staged)
}

/// How many of `n` host→device pages to route through a peer with links `peer` and `room`
/// free staging frames, the destination's links being `dst`: a multiple of
/// [`CHUNK_PAGES`], at most `n` and `room`; 0 for the direct path alone.
pub fn via_peer(n: usize, dst: Links, peer: Links, room: usize) -> usize {
    if dst.h2d == 0 || peer.h2d == 0 || peer.d2d == 0 {
        return 0;
    }
    let alone = split_ns(n, 0, dst, peer);
    let most = core::cmp::min(n, room) / CHUNK_PAGES;
    let mut best = (alone, 0);
    for m in 1..=most {
        let via = m * CHUNK_PAGES;
        let t = split_ns(n, via, dst, peer);
        if t < best.0 {
            best = (t, via);
        }
    }
    // Worth it only with a clear gain: best <= alone * (100 - MIN_GAIN_PCT) / 100.
    let bar = (alone / 100).saturating_mul(100 - MIN_GAIN_PCT);
    if best.0 <= bar {
        best.1
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOST: u64 = 1000;

    fn links(h2d: u64, d2d: u64) -> Links {
        Links { h2d, d2h: h2d, d2d }
    }

    #[test]
    fn nothing_is_routed_over_unknown_links_or_without_room() {
        assert_eq!(via_peer(512, links(0, 0), links(HOST, 4 * HOST), 4096), 0);
        assert_eq!(via_peer(512, links(HOST, 0), links(0, 4 * HOST), 4096), 0);
        assert_eq!(via_peer(512, links(HOST, 0), links(HOST, 0), 4096), 0);
        assert_eq!(via_peer(512, links(HOST, 0), links(HOST, 4 * HOST), 63), 0);
        // Too small to split into two chunks' worth of gain.
        assert_eq!(via_peer(64, links(HOST, 0), links(HOST, 4 * HOST), 4096), 0);
    }

    #[test]
    fn equal_host_links_and_a_fast_peer_link_split_about_half() {
        let v = via_peer(512, links(HOST, 0), links(HOST, 4 * HOST), 4096);
        assert_eq!(v % CHUNK_PAGES, 0);
        assert!((192..=256).contains(&v), "{v}");
        let t = split_ns(512, v, links(HOST, 0), links(HOST, 4 * HOST));
        // Close to half the direct time (one chunk of stage 2 more).
        assert!(t * 100 <= transfer_ns(512, HOST) * 60, "{t}");
        // Room bounds it.
        assert_eq!(via_peer(512, links(HOST, 0), links(HOST, 4 * HOST), 130), 128);
    }

    #[test]
    fn a_slow_peer_link_is_not_worth_it() {
        // The peer's device link at a tenth of the host link: the route cannot help much.
        assert_eq!(via_peer(512, links(HOST, 0), links(HOST, HOST / 20), 4096), 0);
    }
}
