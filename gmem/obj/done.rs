// SPDX-License-Identifier: GPL-2.0
//! A one-way "done" event that many may wait for, and whose waiter a fatal signal can
//! release early: the kernel's `struct completion`, completed with `complete_all()`.
//! (`kernel::sync::Completion` of the 7.3 tree has no killable wait.)

use kernel::{bindings, prelude::*, types::Opaque};

/// # Invariants
/// `inner` is an initialised `struct completion`; once completed (`complete_all`) it stays
/// completed.
#[pin_data]
pub(crate) struct Done {
    #[pin]
    inner: Opaque<bindings::completion>,
}

// SAFETY: a completion may be completed and waited for from any thread.
unsafe impl Send for Done {}
// SAFETY: as above: every operation goes through the completion's own lock.
unsafe impl Sync for Done {}

impl Done {
    pub(crate) fn new() -> impl PinInit<Self> {
        pin_init!(Done {
            // SAFETY: `slot` is valid for writing an uninitialised completion.
            inner <- Opaque::ffi_init(|slot: *mut bindings::completion| unsafe {
                bindings::init_completion(slot)
            }),
        })
    }

    /// Marks the event done and wakes every waiter, now and later (any context).
    pub(crate) fn complete_all(&self) {
        // SAFETY: an initialised completion (type invariant).
        unsafe { bindings::complete_all(self.inner.get()) };
    }

    /// Waits until the event is done (uninterruptibly).
    pub(crate) fn wait(&self) {
        // SAFETY: an initialised completion (type invariant); process context.
        unsafe { bindings::wait_for_completion(self.inner.get()) };
    }

    /// Waits until the event is done or the calling task gets a fatal signal; returns
    /// whether the event is done (`false`: killed first).
    pub(crate) fn wait_killable(&self) -> bool {
        // SAFETY: an initialised completion (type invariant); process context.
        unsafe { bindings::wait_for_completion_killable(self.inner.get()) == 0 }
    }
}
