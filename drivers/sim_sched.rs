// SPDX-License-Identifier: GPL-2.0
//! Scheduling points of a long launch. The Rust tree of 7.3 wraps `signal_pending()`
//! (`Task::signal_pending`) and `might_sleep()`, but neither `fatal_signal_pending()` nor
//! `cond_resched()`: both are static inlines without a Rust helper. These are the two small
//! wrappers the kernels use between chunks (`sim_kernels::checkpoint`).

use kernel::bindings;

/// C's `fatal_signal_pending(current)`: the task has been sent SIGKILL, or a signal whose
/// default action kills the whole thread group (the kernel queues those as SIGKILL on every
/// thread, see `complete_signal()`). The task will never return to user space, so nothing
/// it computes from here on can be seen.
pub(crate) fn fatal_signal_pending() -> bool {
    let task = kernel::current!();
    // `task_sigpending()`, through its safe wrapper: the cheap test, almost always false.
    if !task.signal_pending() {
        return false;
    }
    // SAFETY: `task` is the current task, alive for this call. `pending` is a plain
    // integer field inside it: bindgen's offset of `task_struct::pending` lies within
    // bindgen's `size_of::<task_struct>()`, and gmem.ko (whose symbols this module needs, so
    // it is loaded) refuses to load unless that size equals C's. Other CPUs add signals to
    // the word under `siglock`; like C's `__fatal_signal_pending()` we read it without the
    // lock. The read is volatile (C's `READ_ONCE`) so it is a single load; a stale value is
    // re-read at the next chunk. (Regression test: `sim_launch_is_killable` in gmem-tests,
    // which a wrong offset would fail.)
    let word = unsafe { core::ptr::addr_of!((*task.as_ptr()).pending.signal.sig[0]).read_volatile() };
    word & (1 << (bindings::SIGKILL - 1)) != 0
}

/// C's `cond_resched()`: lets other tasks run if this one should yield. Must be called in
/// process context with no spinlock held (the kernels call it between chunks, with no lock).
pub(crate) fn cond_resched() {
    // A debugging check that we may sleep here (DEBUG_ATOMIC_SLEEP), and a voluntary
    // preemption point on PREEMPT_VOLUNTARY kernels.
    kernel::task::might_sleep();
    // Fully preemptible kernels (PREEMPT, PREEMPT_LAZY without PREEMPT_DYNAMIC) define
    // `cond_resched()` as nothing and have no `__cond_resched`; the others export it.
    #[cfg(any(not(CONFIG_PREEMPTION), CONFIG_PREEMPT_DYNAMIC))]
    // SAFETY: `__cond_resched()` may schedule; our caller is in process context and holds
    // no spinlock (documented contract of this function).
    unsafe {
        bindings::__cond_resched();
    }
}
