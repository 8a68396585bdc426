// SPDX-License-Identifier: GPL-2.0
//! The simulated device's links: host->device, device->host and device->peer, each with a
//! bandwidth (MB/s, 10^6 bytes per second; 0 = unlimited) and one latency per copy call.
//!
//! A copy-engine call reserves its path for `latency + bytes / bandwidth`, from the earliest
//! time the path is free for that long and, for a call on a copy channel, the channel's
//! earlier calls are done (the reservation is made when gmem starts the call:
//! `sim_chan.rs`); it moves the data, and returns (or, on a channel, completes: from the
//! channel's timer) only when its reservation ends. A path carries one transfer at a time:
//! concurrent calls queue on it. But a call that must wait for its channel (busy with a
//! transfer on another path) holds no place on this one meanwhile: a call on an idle
//! channel goes before it if it fits in the gap ([`Booked::fit`]), as a real link carries
//! whichever engine's data is ready. Before, a path was booked up to its last reservation's
//! end, so an eviction's write-back queued on a channel held back every later fetch on the
//! other channels too. So a transfer takes at least what the modelled link allows, and the
//! data copy itself (a `memcpy` on the guest CPU) overlaps with the modelled time instead of
//! adding to it. Device memory has no model: a zero fill is not a transfer. Every path
//! counts its bytes and its modelled busy time, which `GMEM_SIM_IOC_LINK` reports.
//!
//! With every bandwidth and the latency at 0 (the default, and `make check`'s setting),
//! nothing is reserved or waited for: today's unmodelled behaviour.
//!
//! Bounds: a model is accepted only with each bandwidth 0 or at least `MIN_MBPS` and the
//! latency at most `MAX_LATENCY_NS` (so one 2 MiB call waits at most about a fifth of a
//! second plus the latency), and a waiting copy sleeps in short steps and stops waiting when
//! its task is being killed (the data have been moved already; only the pacing is cut).
//! Setting a model drops the queue of the old one: later transfers start from now.

use core::sync::atomic::{AtomicU64, Ordering};
use kernel::prelude::*;
use kernel::sync::SpinLock;
use kernel::time::{Instant, Monotonic};

/// Slowest modelled bandwidth accepted, MB/s (0 is unlimited).
pub(crate) const MIN_MBPS: u64 = 10;
/// Largest modelled latency accepted per copy call, ns (1 s).
pub(crate) const MAX_LATENCY_NS: u64 = 1_000_000_000;
/// Longest single sleep while waiting, ns (between them the wait checks for SIGKILL).
const STEP_NS: u64 = 10_000_000;

/// How long before a reservation ends [`Links::wait`] stops sleeping and spins: about the
/// median lateness of a sleep's timer in the TCG guest (54-95 us, benchmarks.rst), which a
/// synchronous copy (one CPU fault's page: 4.5 us on a 900 MB/s link) otherwise returned
/// that much after its link time, as no engine's completion is late. The same as gmem's
/// default `poll=` for the channels' copies.
const SPIN_NS: u64 = 100_000;

/// Whether a model is within the bounds above.
pub(crate) fn valid(mbps: &[u64; 3], latency_ns: u64) -> bool {
    mbps.iter().all(|&m| m == 0 || m >= MIN_MBPS) && latency_ns <= MAX_LATENCY_NS
}

/// A path of the link model.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Path {
    H2D = 0,
    D2H = 1,
    D2D = 2,
}

/// Nanoseconds a transfer of `bytes` occupies a path of `mbps` MB/s with `latency_ns` per
/// call (saturating; 0 bandwidth: latency only).
pub(crate) fn transfer_ns(bytes: u64, mbps: u64, latency_ns: u64) -> u64 {
    let wire = match (mbps, bytes.checked_mul(1000)) {
        (0, _) => 0,
        (m, Some(b)) => b.div_ceil(m),
        // Beyond 2^64 / 1000 bytes: whole microseconds are precise enough.
        (m, None) => (bytes / m).saturating_mul(1000),
    };
    latency_ns.saturating_add(wire)
}

/// Reservations a path keeps apart; beyond them a new one goes after the last.
const SLOTS: usize = 32;

/// The reservations of one path that have not ended: `(start, end)` in ns since the links'
/// epoch, disjoint, in order.
///
/// # Invariants
/// `n <= SLOTS`; `iv[..n]` is sorted by start, and each interval ends no later than the
/// next one starts.
#[derive(Clone, Copy, Default)]
pub(crate) struct Booked {
    iv: [(u64, u64); SLOTS],
    n: usize,
}

impl Booked {
    /// Reserves `dur` ns (at least 1) from the earliest instant, at `from` or `now` or
    /// later, at which no reservation holds the path for that long, and returns the
    /// reservation's end. Reservations ended by `now` are forgotten first. With `SLOTS`
    /// reservations kept, the new one goes after the last, which grows to cover it (the gap
    /// before it is lost, as every gap was before reservations were kept apart).
    pub(crate) fn fit(&mut self, now: u64, from: u64, dur: u64) -> u64 {
        let gone = self.iv[..self.n].iter().take_while(|&&(_, e)| e <= now).count();
        self.iv.copy_within(gone..self.n, 0);
        self.n -= gone;
        let mut t = core::cmp::max(now, from);
        if self.n == SLOTS {
            // No slot to keep it apart in (even if a gap fits it): after the last
            // reservation, which grows to cover it.
            let last = &mut self.iv[SLOTS - 1];
            last.1 = core::cmp::max(t, last.1).saturating_add(dur);
            return last.1;
        }
        // Where the new reservation goes: before the first that starts after it ends.
        let mut at = self.n;
        for (k, &(s, e)) in self.iv[..self.n].iter().enumerate() {
            if t.saturating_add(dur) <= s {
                at = k;
                break;
            }
            t = core::cmp::max(t, e);
        }
        let end = t.saturating_add(dur);
        self.iv.copy_within(at..self.n, at + 1);
        self.iv[at] = (t, end);
        self.n += 1;
        end
    }

    /// Forgets every reservation (a new model).
    fn clear(&mut self) {
        self.n = 0;
    }
}

struct PathState {
    mbps: AtomicU64,
    bytes: AtomicU64,
    busy_ns: AtomicU64,
    /// The reservations not yet ended (a leaf lock: taken by [`Links::book`] and
    /// [`Links::set`] alone, under a channel's queue lock at most).
    booked: Pin<KBox<SpinLock<Booked>>>,
}

/// What `GMEM_SIM_IOC_LINK` reports of one path.
#[derive(Clone, Copy, Default)]
pub(crate) struct PathStats {
    pub(crate) mbps: u64,
    pub(crate) bytes: u64,
    pub(crate) busy_ns: u64,
}

/// The three paths of one device.
pub(crate) struct Links {
    paths: [PathState; 3],
    latency_ns: AtomicU64,
    epoch: Instant<Monotonic>,
}

impl Links {
    pub(crate) fn new(mbps: [u64; 3], latency_ns: u64) -> Result<Self> {
        let path = |m: u64| -> Result<PathState> {
            Ok(PathState {
                mbps: AtomicU64::new(m),
                bytes: AtomicU64::new(0),
                busy_ns: AtomicU64::new(0),
                booked: KBox::pin_init(
                    kernel::new_spinlock!(Booked::default(), "gmem_sim::Links::booked"),
                    GFP_KERNEL,
                )?,
            })
        };
        Ok(Links {
            paths: [path(mbps[0])?, path(mbps[1])?, path(mbps[2])?],
            latency_ns: AtomicU64::new(latency_ns),
            epoch: Instant::now(),
        })
    }

    /// Nanoseconds since the model was made.
    fn now(&self) -> u64 {
        u64::try_from((Instant::<Monotonic>::now() - self.epoch).as_nanos()).unwrap_or(0)
    }

    /// Sets the model (bandwidths per path, latency per call; the caller checked them with
    /// [`valid`]). Transfers already booked keep their times; later ones no longer queue
    /// behind them.
    pub(crate) fn set(&self, mbps: [u64; 3], latency_ns: u64) {
        for (p, m) in self.paths.iter().zip(mbps) {
            p.mbps.store(m, Ordering::Relaxed);
            p.booked.lock().clear();
        }
        self.latency_ns.store(latency_ns, Ordering::Relaxed);
    }

    pub(crate) fn latency_ns(&self) -> u64 {
        self.latency_ns.load(Ordering::Relaxed)
    }

    pub(crate) fn stats(&self, path: Path) -> PathStats {
        let p = &self.paths[path as usize];
        PathStats {
            mbps: p.mbps.load(Ordering::Relaxed),
            bytes: p.bytes.load(Ordering::Relaxed),
            busy_ns: p.busy_ns.load(Ordering::Relaxed),
        }
    }

    /// Books a transfer of `bytes` on `path` from now, or from `not_before` (ns since the
    /// epoch, as [`Booking::end`]: a copy engine's queue that is busy until then) if later,
    /// at the first time the path is free for it ([`Booked::fit`]); returns the reservation
    /// to wait for, or `None` when the model is off for it.
    pub(crate) fn book(&self, path: Path, bytes: u64, not_before: u64) -> Option<Booking> {
        let p = &self.paths[path as usize];
        p.bytes.fetch_add(bytes, Ordering::Relaxed);
        let dur = transfer_ns(bytes, p.mbps.load(Ordering::Relaxed), self.latency_ns());
        if dur == 0 {
            return None;
        }
        // Saturating: with bounded models this cannot wrap in any realistic uptime.
        let _ = p.busy_ns.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| Some(b.saturating_add(dur)));
        let mut booked = p.booked.lock();
        // Read under the lock: bookings see the clock in the order they are made.
        let end = booked.fit(self.now(), not_before, dur);
        Some(Booking { end })
    }

    /// The instant `b`'s reservation ends (what a channel's completion timer is set to).
    pub(crate) fn instant(&self, b: &Booking) -> Instant<Monotonic> {
        self.epoch + kernel::time::Delta::from_nanos(i64::try_from(b.end).unwrap_or(i64::MAX))
    }

    /// Waits until `b`'s reservation ends (at once if the copy itself took longer): sleeps,
    /// in steps of at most 10 ms, until `SPIN_NS` before it ends, then spins (giving the
    /// CPU to a task that needs it); a task being killed stops waiting.
    pub(crate) fn wait(&self, b: Booking) {
        loop {
            let now = self.now();
            if now >= b.end || crate::gmem::sched::fatal_signal_pending() {
                return;
            }
            match b.end - now {
                left if left > SPIN_NS => sleep_exactly(core::cmp::min(left - SPIN_NS, STEP_NS)),
                _ => {
                    crate::gmem::sched::cond_resched();
                    core::hint::spin_loop();
                }
            }
        }
    }
}

/// Sleeps `ns` (rounded up to a microsecond), waking when they have passed rather than up
/// to a quarter later: `fsleep` gives its timer that much slack, and on an otherwise idle
/// guest the timer takes all of it, so every modelled copy completed late (a trace of PL
/// showed a copy channel woken 0.35 ms after a 1.4 ms booking ended). Process context only
/// (a channel's worker, or the caller of a synchronous copy).
fn sleep_exactly(ns: u64) {
    let us = usize::try_from(ns.div_ceil(1000)).unwrap_or(usize::MAX);
    // SAFETY: a plain sleep of the current task, which the callers above may do (process
    // context, no spinlock held); `min == max` asks for no slack.
    unsafe { kernel::bindings::usleep_range_state(us, us, kernel::bindings::TASK_UNINTERRUPTIBLE) };
}

/// A reserved transfer of these links, until `end` (ns since their epoch):
/// [`Links::wait`] returns when it ends.
pub(crate) struct Booking {
    end: u64,
}

impl Booking {
    /// When the reservation ends, ns since the links' epoch.
    pub(crate) fn end(&self) -> u64 {
        self.end
    }
}

#[kunit_tests(gmem_sim_link)]
mod tests {
    use super::*;

    #[test]
    fn transfer_time_follows_bandwidth_and_latency() {
        // 1 MiB at 1000 MB/s: 1048576 ns; plus 5 us of latency.
        assert_eq!(transfer_ns(1 << 20, 1000, 0), 1_048_576);
        assert_eq!(transfer_ns(1 << 20, 1000, 5000), 1_053_576);
        // Unlimited bandwidth: latency only; nothing at all: 0.
        assert_eq!(transfer_ns(1 << 20, 0, 700), 700);
        assert_eq!(transfer_ns(1 << 20, 0, 0), 0);
        // Rounded up, never 0 for a transfer on a modelled link.
        assert_eq!(transfer_ns(1, 3000, 0), 1);
        // Saturates instead of wrapping.
        assert_eq!(transfer_ns(u64::MAX, 1, u64::MAX), u64::MAX);
    }

    #[test]
    fn models_out_of_bounds_are_refused() {
        assert!(valid(&[0, 0, 0], 0));
        assert!(valid(&[MIN_MBPS, 100_000, 0], MAX_LATENCY_NS));
        assert!(!valid(&[MIN_MBPS - 1, 0, 0], 0));
        assert!(!valid(&[0, 0, 0], MAX_LATENCY_NS + 1));
    }

    #[test]
    fn reservations_queue_behind_each_other() {
        let mut b = Booked::default();
        // Idle path: starts now; a busy one: when the last reservation ends.
        assert_eq!(b.fit(100, 0, 10), 110);
        assert_eq!(b.fit(100, 0, 10), 120);
        assert_eq!(b.fit(100, 400, 10), 410);
        // Ended reservations are forgotten.
        assert_eq!(b.fit(5000, 0, 10), 5010);
        assert_eq!(b.n, 1);
        let l = Links::new([1000, 0, 0], 0).expect("links");
        let a = l.book(Path::H2D, 4096, 0).map(|b| b.end).unwrap_or(0);
        let b = l.book(Path::H2D, 4096, 0).map(|b| b.end).unwrap_or(0);
        // 4096 B at 1000 MB/s = 4096 ns each, back to back.
        // The second follows the first.
        assert!(b >= a + 4096);
        // An unlimited path books nothing.
        assert!(l.book(Path::D2H, 4096, 0).is_none());
        let s = l.stats(Path::H2D);
        assert_eq!((s.bytes, s.busy_ns), (8192, 8192));
        assert_eq!(l.stats(Path::D2H).bytes, 4096);
    }

    #[test]
    fn a_call_waiting_for_its_channel_leaves_the_gap_before_it() {
        let mut b = Booked::default();
        // A fetch queued on a channel busy until 1000 (with a write-back, another path).
        assert_eq!(b.fit(0, 1000, 100), 1100);
        // A fetch on an idle channel runs now, not after it; one that fills the rest of the
        // gap exactly too; the next one goes after both.
        assert_eq!(b.fit(0, 0, 100), 100);
        assert_eq!(b.fit(0, 0, 900), 1000);
        assert_eq!(b.fit(0, 0, 1), 1101);
        // Too long for a gap: after the reservation that closes it.
        let mut c = Booked::default();
        assert_eq!(c.fit(0, 500, 100), 600);
        assert_eq!(c.fit(0, 0, 501), 1101);
    }

    #[test]
    fn reservations_stay_disjoint_and_earliest() {
        // Pseudo-random calls (an LCG; the clock moves 75 ns per call on average, a call
        // books 50 on average, so the path is busy about two thirds of the time and gaps
        // open and fill): every reservation starts no earlier than its call and its
        // `from`, never overlaps another, and, while slots are left, starts at the earliest
        // such instant.
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut rnd = |m: u64| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (x >> 33) % m
        };
        let mut b = Booked::default();
        let (mut now, mut gaps) = (0u64, 0);
        for _ in 0..2000 {
            now += rnd(150);
            let (from, dur) = ((now + rnd(400)).saturating_sub(200), 1 + rnd(100));
            let before = b;
            let end = b.fit(now, from, dur);
            let start = end - dur;
            assert!(start >= now.max(from));
            assert!(b.n <= SLOTS);
            for w in b.iv[..b.n].windows(2) {
                assert!(w[0].0 < w[0].1 && w[0].1 <= w[1].0);
            }
            assert!(b.iv[..b.n].contains(&(start, end)) || b.n == SLOTS);
            if before.n < SLOTS {
                // Free itself, and the earliest: no instant before `start` (from `now`/`from`
                // on) is free for `dur` among the reservations that had not ended.
                let live = || before.iv[..before.n].iter().filter(|&&(_, e)| e > now);
                let free = |t: u64| live().all(|&(s, e)| t + dur <= s || t >= e);
                assert!(free(start));
                let mut cands = Iterator::chain(core::iter::once(now.max(from)), live().map(|&(_, e)| e));
                assert!(cands.all(|t| t >= start || t < now.max(from) || !free(t)));
                // Into a gap: before a reservation that had not ended.
                gaps += usize::from(live().any(|&(s, _)| s >= end));
            }
        }
        // The sequence exercises gap-filling (a `fit` that only appended would fail here).
        assert!(gaps > 50);
    }
}
