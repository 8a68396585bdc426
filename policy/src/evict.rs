// SPDX-License-Identifier: GPL-2.0
//! Victim selection (CLOCK with a peer tier) and reclaim watermarks of a device pool.
//!
//! The kernel keeps one flag byte per device frame (`F_*`) and a clock hand in its device
//! structure and wraps a short-lived [`Clock`] view around them while it holds the device
//! lock. [`Clock::select`] picks victims in two tiers: first the frames holding victims that
//! other devices parked here (`F_LENT`, clean ones first: they are dropped without a copy),
//! then a CLOCK sweep over the rest that gives every referenced frame a second chance.
//!
//! Invariants: a victim is a used, unpinned frame (`F_USED` set, `F_PINNED` clear), no frame
//! is returned twice by one call, all `F_LENT` victims come before the others, and `select`
//! only clears `F_REF` bits of frames it passes over (a victim found on the second sweep
//! was passed over on the first; otherwise victims are untouched) and moves the hand
//! (always `< flags.len()`, or 0 for an empty pool). The sweep visits at most `2 * len`
//! frames, so it terminates, and when `out` is large enough it returns every used unpinned
//! frame (the first sweep clears the reference bits, the second collects the frames).
//! [`reclaim_target`] never exceeds the number of evictable frames.
#![allow(dead_code, unreachable_pub)]

/// The frame holds a page.
pub const F_USED: u8 = 1;
/// Referenced since the hand last passed (set on fault, prefetch or accessed bit).
pub const F_REF: u8 = 2;
/// Never a victim.
pub const F_PINNED: u8 = 4;
/// Holds a victim parked here by another device (peer tier): evicted first.
pub const F_LENT: u8 = 8;
/// The page has a valid host copy: eviction needs no copy.
pub const F_CLEAN: u8 = 16;

/// Whether a frame with flags `f` may be chosen at all.
fn evictable(f: u8) -> bool {
    f & (F_USED | F_PINNED) == F_USED
}

/// CLOCK view over the caller's flag array and hand.
#[derive(Debug)]
pub struct Clock<'a> {
    flags: &'a mut [u8],
    hand: &'a mut u64,
    /// Whether any frame may be `F_LENT` (if not, the lent tier's scan is skipped).
    lent: bool,
}

impl<'a> Clock<'a> {
    /// Wraps the caller's state; an out-of-range hand restarts at 0.
    pub fn new(flags: &'a mut [u8], hand: &'a mut u64) -> Self {
        if usize::try_from(*hand).map_or(true, |h| h >= flags.len()) {
            *hand = 0;
        }
        Clock { flags, hand, lent: true }
    }

    /// [`Clock::new`] for a caller that counts its `F_LENT` frames exactly (`lent`): with
    /// none, `select` skips the lent tier, two scans of the whole flag array per call that
    /// would find nothing (most pools lend nothing; a pool of 64 MiB is 16384 frames).
    pub fn with_lent(flags: &'a mut [u8], hand: &'a mut u64, lent: u64) -> Self {
        Clock { lent: lent > 0, ..Clock::new(flags, hand) }
    }

    /// Chooses up to `out.len()` victims into `out` and returns how many: first the
    /// `F_LENT` frames (clean ones first, in frame order), then a CLOCK sweep from the hand:
    /// unused and pinned frames are skipped, a referenced frame loses `F_REF` and is passed
    /// over once, an unreferenced used frame is a victim. At most two full sweeps. Victims
    /// keep `F_USED` (the kernel clears it when it frees them); only `F_REF` bits change.
    pub fn select(&mut self, out: &mut [u64]) -> usize {
        self.select_where(out, |_| true)
    }

    /// [`Clock::select`] over the frames `eligible` accepts only (the frames charged within
    /// a cgroup at its limit): the others are neither chosen nor passed over (their `F_REF`
    /// stays). `eligible` is asked about evictable frames only.
    pub fn select_where(&mut self, out: &mut [u64], mut eligible: impl FnMut(usize) -> bool) -> usize {
        let n = self.flags.len();
        let mut k = 0;
        // Tier 1: lent frames, clean before dirty.
        let tiers: &[bool] = if self.lent { &[true, false] } else { &[] };
        for &want_clean in tiers {
            for (i, &f) in self.flags.iter().enumerate() {
                if k == out.len() {
                    return k;
                }
                if evictable(f) && f & F_LENT != 0 && (f & F_CLEAN != 0) == want_clean && eligible(i) {
                    out[k] = i as u64;
                    k += 1;
                }
            }
        }
        // Every evictable lent frame is in out[..k]; the sweep skips them all.
        let first_sweep_start = k;
        // `hand < n` (see `new`), so this conversion is lossless.
        let mut h = usize::try_from(*self.hand).unwrap_or(0);
        // Frames chosen by the first sweep, in visiting order; the second sweep visits
        // frames in the same order, so `seen` walks along them to skip them.
        let mut first_sweep_end = k;
        let mut seen = first_sweep_start;
        for step in 0..n.saturating_mul(2) {
            if k == out.len() {
                break;
            }
            if step == n {
                first_sweep_end = k;
            }
            let i = h;
            h = if h + 1 == n { 0 } else { h + 1 };
            let f = self.flags[i];
            if !evictable(f) || f & F_LENT != 0 {
                continue;
            }
            if step >= n && seen < first_sweep_end && out[seen] == i as u64 {
                // Already chosen on the first sweep.
                seen += 1;
                continue;
            }
            if !eligible(i) {
                continue;
            }
            if f & F_REF != 0 {
                self.flags[i] = f & !F_REF;
                continue;
            }
            out[k] = i as u64;
            k += 1;
        }
        *self.hand = h as u64;
        k
    }
}

/// How many frames the background worker should free: 0 if `free >= low`, else enough to
/// reach `high` (read as at least `low`), capped by `evictable`.
pub fn reclaim_target(free: u64, low: u64, high: u64, evictable: u64) -> u64 {
    if free >= low {
        return 0;
    }
    high.max(low).saturating_sub(free).min(evictable)
}

/// Whether a lender (a device holding victims that peers parked on it) should write its
/// parked dirty pages back to the host now, with `free` frames free and watermark `high`:
/// only once its own use has eaten into the reserve that parking leaves it (`free <
/// high`), so that it can then drop them at once. Earlier it would only add copies: a
/// parked page costs a copy out and one back, as a write-back and a fetch would, and an
/// early write-back makes it three.
pub fn write_back_lent(free: u64, high: u64) -> bool {
    free < high
}

/// Frames a lender with `free` frames free and watermark `high` can still promise to
/// peers' eviction batches for parking, when `promised` are promised already and not yet
/// allocated: what is left above `high + 1` (parking never takes the lender's reserve, so
/// its own allocations win). Batches that plan side by side each take their share of
/// this, not all of it.
pub fn park_room(free: u64, high: u64, promised: u64) -> u64 {
    free.saturating_sub(high.saturating_add(1)).saturating_sub(promised)
}

/// Default watermarks `(low, high)` for a pool of `nframes` frames: `low = nframes / 64`
/// clamped to `8..=nframes / 4` (the upper bound wins for tiny pools), `high = 2 * low`
/// capped at `nframes / 2`.
pub fn default_watermarks(nframes: u64) -> (u64, u64) {
    let low = (nframes / 64).max(8).min(nframes / 4);
    let high = low.saturating_mul(2).min(nframes / 2);
    (low, high)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn promises_share_the_room_above_the_reserve() {
        // 100 free, high 20: 79 frames may be parked (one spare above the reserve).
        assert_eq!(park_room(100, 20, 0), 79);
        assert_eq!(park_room(100, 20, 60), 19);
        assert_eq!(park_room(100, 20, 79), 0);
        assert_eq!(park_room(100, 20, 500), 0);
        // Inside the reserve: nothing, whatever is promised.
        assert_eq!(park_room(21, 20, 0), 0);
        assert_eq!(park_room(5, 20, 0), 0);
        assert_eq!(park_room(u64::MAX, u64::MAX, 0), 0);
    }

    #[test]
    fn a_lender_writes_parked_pages_back_only_inside_its_reserve() {
        // Parking leaves the lender more than `high` free: no write-back then.
        assert!(!write_back_lent(129, 128));
        assert!(!write_back_lent(128, 128));
        assert!(write_back_lent(127, 128));
        assert!(write_back_lent(0, 128));
        assert!(!write_back_lent(0, 0));
    }

    fn select(flags: &mut [u8], hand: &mut u64, max: usize) -> std::vec::Vec<u64> {
        let mut out = std::vec![0u64; max];
        let k = Clock::new(flags, hand).select(&mut out);
        out.truncate(k);
        out
    }

    const U: u8 = F_USED;

    #[test]
    fn lent_frames_go_first_clean_before_dirty() {
        let mut f = [U, U | F_LENT, U | F_LENT | F_CLEAN, U | F_LENT | F_PINNED, F_LENT, U];
        let mut hand = 0;
        assert_eq!(select(&mut f, &mut hand, 2), [2, 1]);
        assert_eq!(hand, 0, "tier 1 does not move the hand");
        assert_eq!(select(&mut f, &mut hand, 10), [2, 1, 0, 5]);
    }

    #[test]
    fn referenced_frames_get_a_second_chance() {
        let mut f = [U | F_REF, U, U | F_REF, U | F_PINNED, 0];
        let mut hand = 0;
        assert_eq!(select(&mut f, &mut hand, 1), [1]);
        assert_eq!(hand, 2);
        assert_eq!(f[0], U, "passed over: reference bit cleared");
        assert_eq!(f[1], U, "victim untouched");
        // Next call starts at the hand: 2 loses its bit, 0 is a victim.
        assert_eq!(select(&mut f, &mut hand, 1), [0]);
        assert_eq!(hand, 1);
        assert_eq!(f[2], U);
        assert_eq!(f[3], U | F_PINNED);
    }

    #[test]
    fn two_sweeps_collect_every_frame_once() {
        let mut f = [U | F_REF, U, U | F_REF, U];
        let mut hand = 1;
        assert_eq!(select(&mut f, &mut hand, 8), [1, 3, 2, 0]);
    }

    #[test]
    fn degenerate_inputs() {
        let mut hand = 99;
        assert!(select(&mut [], &mut hand, 4).is_empty());
        assert_eq!(hand, 0);
        let mut f = [U];
        let mut hand = 7;
        assert!(select(&mut f, &mut hand, 0).is_empty());
        assert_eq!(hand, 0, "out-of-range hand reset");
        assert_eq!(select(&mut [F_PINNED | U, 0], &mut hand, 4), []);
    }

    #[test]
    fn watermarks() {
        assert_eq!(default_watermarks(0), (0, 0));
        assert_eq!(default_watermarks(16), (4, 8));
        assert_eq!(default_watermarks(64), (8, 16));
        assert_eq!(default_watermarks(1 << 20), (1 << 14, 1 << 15));
        assert_eq!(default_watermarks(u64::MAX), (u64::MAX / 64, u64::MAX / 64 * 2));
        assert_eq!(reclaim_target(10, 8, 16, 100), 0);
        assert_eq!(reclaim_target(3, 8, 16, 100), 13);
        assert_eq!(reclaim_target(3, 8, 16, 5), 5);
        assert_eq!(reclaim_target(3, 8, 4, 100), 5, "high below low reads as low");
    }
}
