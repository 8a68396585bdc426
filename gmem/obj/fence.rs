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

use core::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use kernel::{bindings, prelude::*, types::Opaque};

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
}

// SAFETY: a completion may be completed and waited for from any thread.
unsafe impl Send for Fence {}
// SAFETY: as above; the other fields are atomics.
unsafe impl Sync for Fence {}

impl Fence {
    /// A fence nobody has signalled yet, boxed where the driver can point at it.
    pub(crate) fn new() -> Result<Pin<KBox<Fence>>> {
        KBox::pin_init(
            pin_init!(Fence {
                // SAFETY: `slot` is valid for writing an uninitialised completion.
                done <- Opaque::ffi_init(|slot: *mut bindings::completion| unsafe {
                    bindings::init_completion(slot)
                }),
                state: AtomicI32::new(PENDING),
                waited: AtomicBool::new(false),
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
        let f = Fence::new().expect("fence");
        assert!(!f.signalled());
        f.signal(-5);
        assert!(f.signalled());
        assert_eq!(f.wait(), Err(EIO));
        // Waiting again returns the same result at once.
        assert_eq!(f.wait(), Err(EIO));
        let g = Fence::new().expect("fence");
        g.signal(0);
        assert_eq!(g.wait(), Ok(()));
        // Garbage from a driver counts as EIO.
        let h = Fence::new().expect("fence");
        h.signal(7);
        assert_eq!(h.wait(), Err(EIO));
    }
}
