// SPDX-License-Identifier: GPL-2.0
//! Scheduling points for long loops: every loop whose length a user or driver controls
//! (teardown of a huge region, advice over a huge range, evacuation, debugfs census) calls
//! [`cond_resched`] per chunk, and the ones that run on behalf of a process stop on a fatal
//! signal ([`fatal_signal_pending`]). Both are C macros/inlines, wrapped in gmem_export.c.

extern "C" {
    fn gmem_cond_resched();
    fn gmem_fatal_signal_pending() -> bool;
}

/// Lets other tasks run if this one has used up its slice. Must not be called in atomic
/// context (no spinlock held); sleeping locks may be held.
pub(crate) fn cond_resched() {
    // SAFETY: process context by the function's contract; no arguments.
    unsafe { gmem_cond_resched() }
}

/// True if the current task has been sent SIGKILL (it is exiting): work done on its behalf
/// should stop as soon as the state allows.
pub(crate) fn fatal_signal_pending() -> bool {
    // SAFETY: reads the current task's pending signals; no arguments.
    unsafe { gmem_fatal_signal_pending() }
}

/// The monotonic clock, in nanoseconds.
pub(crate) fn now_ns() -> u64 {
    // SAFETY: reading the monotonic clock has no preconditions.
    unsafe { kernel::bindings::ktime_get() as u64 }
}
