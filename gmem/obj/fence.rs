// SPDX-License-Identifier: GPL-2.0
//! Fences of asynchronous copies (driver API ABI 4: `copy_async`, `gmem_fence_signal`).
//!
//! The executor makes one fence per `copy_async` call, hands the driver its address as an
//! opaque `struct gmem_fence *`, and waits for it before it touches any page, frame or
//! entry the copy names (commit, map, free, undo). The driver signals it exactly once, from
//! any context, when the copy is done or failed.
//!
//! **Lifetime.** A fence is pinned in a box owned by the executor's batch. The batch waits
//! for every fence the driver accepted before it lets go of any, on every path (success,
//! copy failure, refused submission), so the driver's pointer is valid from the submission
//! until its `gmem_fence_signal` returns. That call stores the result and then completes the
//! `struct completion` with `complete()` (one waiter; unlike `complete_all()` it is allowed
//! in any interrupt context); the kernel's completion holds its wait-queue lock until
//! `complete()` is done with it, and the waiter takes the same lock before it returns, so
//! the box is freed only after the signal stopped touching it.
//!
//! **Polling** (ABI 8: `gmem_fence_expect`, `copy_poll`). A driver may say, before it
//! signals a fence, when it expects to (`expect`; the executor's pointer is valid then, as
//! for the signal). The waiter then sleeps on the completion only until `poll=` us before
//! that time (`gmem_completion_wait_until`, `gmem_fence.c`: an hrtimer of its own, since
//! completions time out in jiffies), and calls the driver's `copy_poll` for the copy's
//! channel until the fence is signalled or a while after that time
//! ([`Fence::wait_polled`]). A poll may signal this fence and other fences of the channel,
//! from the waiter's thread; each is still a `gmem_fence_signal`, and each fence's owner
//! still goes through the completion before its box goes, so the lifetime argument above
//! is unchanged.

use core::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use kernel::{bindings, prelude::*, types::Opaque};

extern "C" {
    fn gmem_completion_wait_until(x: *mut bindings::completion, until_ns: u64) -> bool;
}

/// How long after the expected completion a waiter polls before it sleeps until the
/// driver signals (a copy whose data has not landed yet, say).
const POLL_LATE_NS: u64 = 200_000;

/// When a waiter for a copy expected to complete at `eta` (`ktime_get_ns()`; 0: the driver
/// did not say) wakes to poll, `early_ns` before it (0: never), and until when it polls:
/// `None` for no polling.
fn poll_window(eta: u64, early_ns: u64) -> Option<(u64, u64)> {
    (eta != 0 && early_ns != 0).then(|| (eta.saturating_sub(early_ns), eta.saturating_add(POLL_LATE_NS)))
}

/// Not signalled yet (results are 0 or a negative errno).
const PENDING: i32 = 1;

/// The completion of one asynchronous copy.
///
/// # Invariants
/// `done` is an initialised `struct completion`, completed at most once (by `signal`) and
/// waited for at most once (by the first `wait`; `waited` records it).
#[pin_data]
pub(crate) struct Fence {
    #[pin]
    done: Opaque<bindings::completion>,
    /// `PENDING`, then the copy's result (0 or a negative errno), set once.
    state: AtomicI32,
    /// The waiter went through `done` (later waits only read `state`).
    waited: AtomicBool,
    /// The channel the copy was started on.
    chan: u32,
    /// When the driver expects the copy to complete (`ktime_get_ns()`; 0: not said).
    eta: AtomicU64,
}

// SAFETY: a completion may be completed and waited for from any thread.
unsafe impl Send for Fence {}
// SAFETY: as above; the other fields are atomics.
unsafe impl Sync for Fence {}

impl Fence {
    /// A fence nobody has signalled yet for a copy on channel `chan`, boxed where the
    /// driver can point at it.
    pub(crate) fn new(chan: u32) -> Result<Pin<KBox<Fence>>> {
        KBox::pin_init(
            pin_init!(Fence {
                // SAFETY: `slot` is valid for writing an uninitialised completion.
                done <- Opaque::ffi_init(|slot: *mut bindings::completion| unsafe {
                    bindings::init_completion(slot)
                }),
                state: AtomicI32::new(PENDING),
                waited: AtomicBool::new(false),
                chan,
                eta: AtomicU64::new(0),
            }),
            GFP_KERNEL,
        )
    }

    /// Records the copy's result and wakes the waiter. A second signal of the same fence is
    /// a driver bug: it is reported (WARN) and otherwise ignored. A result that is not 0 or
    /// an errno counts as `EIO`.
    pub(crate) fn signal(&self, err: i32) {
        let r = crate::obj::device::driver_result(err).map_or_else(|e| e.to_errno(), |()| 0);
        if self.state.compare_exchange(PENDING, r, Ordering::AcqRel, Ordering::Acquire).is_err() {
            pr_err!("gmem_fence_signal: fence signalled twice\n");
            kernel::warn_on!(true);
            return;
        }
        // SAFETY: an initialised completion (type invariant), completed once: the state
        // moved from `PENDING` just now, which happens once.
        unsafe { bindings::complete(self.done.get()) };
    }

    /// Records when the driver expects the copy to complete (`gmem_fence_expect`).
    pub(crate) fn expect(&self, ns: u64) {
        self.eta.store(ns, Ordering::Relaxed);
    }

    /// [`Fence::wait`], but if the driver said when the copy should complete and can be
    /// polled (`poll` is its `copy_poll`), sleeps only until `poll=` us before then (or
    /// until signalled), then polls the copy's channel (at least once) until the fence is
    /// signalled or `POLL_LATE_NS` after that time, so that a copy that lands then is seen
    /// at once instead of after the driver's completion interrupt and this task's wake-up;
    /// then waits as `wait` does. Process context; sleeping locks may be held (the poll
    /// loop gives the CPU to a task that needs it).
    pub(crate) fn wait_polled(&self, poll: Option<&dyn Fn(u32)>) -> Result {
        let early_ns = u64::from(crate::obj::tune::POLL_US.load(Ordering::Relaxed)) * 1000;
        let plan = poll.zip(poll_window(self.eta.load(Ordering::Relaxed), early_ns));
        if let Some((poll, (wake, late))) = plan.filter(|_| !self.waited.load(Ordering::Acquire)) {
            let now = crate::obj::sched::now_ns;
            // SAFETY: an initialised completion (type invariant), not consumed here.
            let done = now() < wake && unsafe { gmem_completion_wait_until(self.done.get(), wake) };
            if !done {
                // At least one poll, however late the sleep ended.
                while !self.signalled() {
                    poll(self.chan);
                    if self.signalled() || now() >= late {
                        break;
                    }
                    // The channel's worker may need this CPU to land the copy.
                    crate::obj::sched::cond_resched();
                    core::hint::spin_loop();
                }
            }
        }
        self.wait()
    }

    /// Whether the fence was signalled (diagnostics; a waiter uses [`Fence::wait`]).
    pub(crate) fn signalled(&self) -> bool {
        self.state.load(Ordering::Acquire) != PENDING
    }

    /// Waits (uninterruptibly: the data must land before its pages may be reused) until
    /// the fence is signalled; returns the copy's result. Only the owner of the fence waits
    /// (`&self` is shared with the driver, which never waits), so the first call goes
    /// through the completion and later ones return the same result at once.
    pub(crate) fn wait(&self) -> Result {
        if !self.waited.swap(true, Ordering::AcqRel) {
            // SAFETY: an initialised completion, waited for once (type invariant).
            unsafe { bindings::wait_for_completion(self.done.get()) };
        }
        match self.state.load(Ordering::Acquire) {
            // Only if a second waiter came before the signal (gmem has one waiter per
            // fence): the copy is not done, and must not pass for done.
            PENDING => {
                pr_err!("gmem fence: a second waiter returned before the signal\n");
                kernel::warn_on!(true);
                Err(EIO)
            }
            r => kernel::error::to_result(r),
        }
    }

    /// The address handed to the driver.
    pub(crate) fn as_handle(&self) -> *mut crate::abi::GmemFenceHandle {
        core::ptr::from_ref(self).cast_mut().cast()
    }
}

#[kunit_tests(gmem_fence)]
mod tests {
    use super::*;

    #[test]
    fn a_fence_reports_its_result_once() {
        let f = Fence::new(0).expect("fence");
        assert!(!f.signalled());
        f.signal(-5);
        assert!(f.signalled());
        assert_eq!(f.wait(), Err(EIO));
        // Waiting again returns the same result at once.
        assert_eq!(f.wait(), Err(EIO));
        let g = Fence::new(0).expect("fence");
        g.signal(0);
        assert_eq!(g.wait(), Ok(()));
        // Garbage from a driver counts as EIO.
        let h = Fence::new(0).expect("fence");
        h.signal(7);
        assert_eq!(h.wait(), Err(EIO));
    }

    use crate::obj::sched::now_ns as now;

    #[test]
    fn a_polled_wait_sleeps_until_shortly_before_the_expected_end() {
        // The driver expects the copy on channel 3 to end 2 ms from now; its `copy_poll`
        // (the closure) completes it when called. The waiter's first poll comes no sooner
        // than `poll=` us before that time (a sleep's deadline never passes early), the
        // poll is for the copy's channel, and the copy's result is the wait's.
        let early = u64::from(crate::obj::tune::POLL_US.load(Ordering::Relaxed)) * 1000;
        // Polling is on by default.
        assert!(early > 0);
        for err in [0, -5] {
            let f = Fence::new(3).expect("fence");
            let eta = now() + 2_000_000;
            f.expect(eta);
            let polls = core::cell::Cell::new(0u32);
            let first = core::cell::Cell::new(0u64);
            let chan_seen = core::cell::Cell::new(u32::MAX);
            let poll = |chan: u32| {
                chan_seen.set(chan);
                if polls.replace(polls.get() + 1) == 0 {
                    first.set(now());
                }
                f.signal(err);
            };
            let want = if err == 0 { Ok(()) } else { Err(EIO) };
            assert_eq!(f.wait_polled(Some(&poll)), want);
            // Signalled by the first poll, so polled once, for the copy's channel, and not
            // before `poll=` us ahead of the expected end.
            assert_eq!(polls.get(), 1);
            assert_eq!(chan_seen.get(), 3);
            assert!(first.get() >= eta - early);
        }
    }

    #[test]
    fn a_polled_wait_does_not_poll_a_signalled_fence() {
        let polls = core::cell::Cell::new(0u32);
        let poll = |_chan: u32| polls.set(polls.get() + 1);
        // Signalled long before its expected end: the wait returns at once, unpolled.
        let f = Fence::new(0).expect("fence");
        let t0 = now();
        f.expect(t0 + 1_000_000_000);
        f.signal(0);
        assert_eq!(f.wait_polled(Some(&poll)), Ok(()));
        // It did not sleep towards an end the copy had already reached.
        assert!(now() - t0 < 500_000_000);
        // An estimate long past, the fence signalled: not polled either.
        let h = Fence::new(0).expect("fence");
        h.expect(1);
        h.signal(0);
        assert_eq!(h.wait_polled(Some(&poll)), Ok(()));
        assert_eq!(polls.get(), 0);
    }

    #[test]
    fn polling_needs_an_estimate_and_poll_on() {
        // No estimate from the driver, or `poll=0`: no polling at all.
        assert_eq!(poll_window(0, 100_000), None);
        assert_eq!(poll_window(5_000_000, 0), None);
        // Otherwise from `early_ns` before the expected end to `POLL_LATE_NS` after it,
        // without wrapping near either end of the clock.
        assert_eq!(poll_window(5_000_000, 100_000), Some((4_900_000, 5_000_000 + POLL_LATE_NS)));
        assert_eq!(poll_window(50, 100_000), Some((0, 50 + POLL_LATE_NS)));
        assert_eq!(poll_window(u64::MAX, 100_000), Some((u64::MAX - 100_000, u64::MAX)));
    }
}
