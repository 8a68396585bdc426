// SPDX-License-Identifier: GPL-2.0
//! gmem's own workqueue (async prefetch fences, pre-eviction, background write-back).
//! Created at load; destroyed at unload, which drains it, so no work item can run module
//! code after the module is gone (the system workqueues give no such guarantee).

use core::sync::atomic::{AtomicPtr, Ordering};
use kernel::{bindings, prelude::*, workqueue::Queue};

extern "C" {
    /// `alloc_workqueue("gmem", WQ_UNBOUND | WQ_MEM_RECLAIM, 0)` (a C macro; gmem_export.c).
    fn gmem_wq_alloc() -> *mut bindings::workqueue_struct;
}

static WQ: AtomicPtr<bindings::workqueue_struct> = AtomicPtr::new(core::ptr::null_mut());

/// Owns the queue: created first at module load, destroyed (drained) when the module —
/// or a failed load — drops it.
pub(crate) struct WqGuard(());

impl WqGuard {
    pub(crate) fn new() -> Result<WqGuard> {
        init()?;
        Ok(WqGuard(()))
    }
}

impl Drop for WqGuard {
    fn drop(&mut self) {
        exit();
    }
}

fn init() -> Result {
    // SAFETY: plain allocation call in process context.
    let q = unsafe { gmem_wq_alloc() };
    if q.is_null() {
        return Err(ENOMEM);
    }
    WQ.store(q, Ordering::Release);
    Ok(())
}

/// Drains and frees the queue (module exit, after every user is gone).
fn exit() {
    let q = WQ.swap(core::ptr::null_mut(), Ordering::AcqRel);
    if !q.is_null() {
        // SAFETY: `q` came from `gmem_wq_alloc` and is destroyed once.
        unsafe { bindings::destroy_workqueue(q) };
    }
}

/// The queue; `None` before init or after exit.
pub(crate) fn get() -> Option<&'static Queue> {
    let q = WQ.load(Ordering::Acquire);
    // SAFETY: `q` stays valid until `exit`, which runs only when nothing can enqueue.
    (!q.is_null()).then(|| unsafe { Queue::from_raw(q) })
}
