// SPDX-License-Identifier: GPL-2.0
//! A registered accelerator: its callbacks (behind the `DeviceOps` trait), its memory pool
//! of frames (allocated centrally here, never by the driver) and its counters.
//!
//! Lock order: `Device::frames` is a leaf (taken under a region's page lock; nothing is
//! called under it). Driver callbacks are never called under a spinlock.

use crate::abi::{GmemCopy, GmemDevOps, GmemDevProps, GmemPte, GMEM_DRIVER_ABI_VERSION};
use crate::policy::frames::FrameMap;
use core::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use kernel::{
    bindings,
    error::{to_result, VTABLE_DEFAULT_ERROR},
    ffi::c_void,
    new_mutex,
    prelude::*,
    sync::{Arc, Mutex},
};

/// A device page table ("context") as the driver handed it out; opaque to the core.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ctx(pub(crate) *mut c_void);

// SAFETY: a context is an opaque token that the driver accepts from any thread.
unsafe impl Send for Ctx {}
// SAFETY: as above; the core never dereferences it.
unsafe impl Sync for Ctx {}

/// What the core asks of a device driver. The C vtable of `include/linux/gmem.h` is
/// adapted to it by [`CDriver`]; the contract of each method is the one documented there.
#[vtable]
pub(crate) trait DeviceOps: Send + Sync {
    /// Creates the device page table of one address space.
    fn ctx_create(&self) -> Result<Ctx>;
    /// Destroys a context; no entry of it is used afterwards.
    fn ctx_destroy(&self, ctx: Ctx);
    /// Installs page-table entries.
    fn map(&self, ctx: Ctx, ptes: &[GmemPte]) -> Result;
    /// Removes the entries of `npages` pages from `va`.
    fn unmap(&self, ctx: Ctx, va: u64, npages: u64);
    /// Flushes device TLBs for the range.
    fn tlb_invalidate(&self, ctx: Ctx, va: u64, npages: u64);
    /// Copies pages (direction `GMEM_COPY_*`); `peer` is the destination device for D2D.
    fn copy(&self, dir: u32, pages: &[GmemCopy], peer: Option<&Self>) -> Result;
    /// The host-visible page behind a frame, if the device can expose it to the CPU.
    fn frame_page(&self, _frame: u64) -> Option<*mut bindings::page> {
        build_error!(VTABLE_DEFAULT_ERROR)
    }
}

/// A C driver's vtable.
///
/// # Invariants
/// `ops` points to a `GmemDevOps` whose mandatory callbacks are all non-null and which stays
/// valid and unchanged until `gmem_dev_unregister` returns (driver API contract); `drv` is
/// the driver's opaque pointer, only ever passed back to those callbacks.
pub(crate) struct CDriver {
    ops: *const GmemDevOps,
    drv: *mut c_void,
}

// SAFETY: by the driver API contract the callbacks may be called from any thread.
unsafe impl Send for CDriver {}
// SAFETY: as above; `CDriver` itself is immutable.
unsafe impl Sync for CDriver {}

impl CDriver {
    /// Validates a driver's tables; returns the adapter and the pool size in frames.
    ///
    /// # Safety
    /// `ops` and `props` must each be null or valid for reads, and `ops` must stay valid
    /// until the device is unregistered.
    pub(crate) unsafe fn new(ops: *const GmemDevOps, props: *const GmemDevProps) -> Result<(Self, u64)> {
        if ops.is_null() || props.is_null() {
            return Err(EINVAL);
        }
        // SAFETY: non-null and valid for reads by the caller's contract.
        let (o, p) = unsafe { (&*ops, &*props) };
        if p.abi_version != GMEM_DRIVER_ABI_VERSION || p.size as usize != core::mem::size_of::<GmemDevProps>() {
            return Err(EINVAL);
        }
        let complete = o.ctx_create.is_some()
            && o.ctx_destroy.is_some()
            && o.map.is_some()
            && o.unmap.is_some()
            && o.tlb_invalidate.is_some()
            && o.copy.is_some();
        if !complete || p.nr_frames == 0 || p.nr_frames > u64::from(u32::MAX) {
            return Err(EINVAL);
        }
        // INVARIANT: checked above; lifetime by the caller's contract.
        Ok((CDriver { ops, drv: p.drv }, p.nr_frames))
    }

    fn ops(&self) -> &GmemDevOps {
        // SAFETY: valid until unregister by the type invariant; `self` does not outlive it.
        unsafe { &*self.ops }
    }
}

#[vtable]
impl DeviceOps for CDriver {
    fn ctx_create(&self) -> Result<Ctx> {
        let f = self.ops().ctx_create.ok_or(EINVAL)?;
        let mut ctx = core::ptr::null_mut();
        // SAFETY: mandatory callback (type invariant), called with the driver's `drv` and a
        // valid out-pointer.
        to_result(unsafe { f(self.drv, &mut ctx) })?;
        Ok(Ctx(ctx))
    }

    fn ctx_destroy(&self, ctx: Ctx) {
        if let Some(f) = self.ops().ctx_destroy {
            // SAFETY: `ctx` came from this driver's `ctx_create` and is destroyed once.
            unsafe { f(self.drv, ctx.0) }
        }
    }

    fn map(&self, ctx: Ctx, ptes: &[GmemPte]) -> Result {
        let f = self.ops().map.ok_or(EINVAL)?;
        let n = u32::try_from(ptes.len()).map_err(|_| EINVAL)?;
        // SAFETY: `ptes` is valid for `n` reads for the duration of the call.
        to_result(unsafe { f(self.drv, ctx.0, ptes.as_ptr(), n) })
    }

    fn unmap(&self, ctx: Ctx, va: u64, npages: u64) {
        if let Some(f) = self.ops().unmap {
            // SAFETY: mandatory callback with a context of this driver.
            unsafe { f(self.drv, ctx.0, va, npages) }
        }
    }

    fn tlb_invalidate(&self, ctx: Ctx, va: u64, npages: u64) {
        if let Some(f) = self.ops().tlb_invalidate {
            // SAFETY: mandatory callback with a context of this driver.
            unsafe { f(self.drv, ctx.0, va, npages) }
        }
    }

    fn copy(&self, dir: u32, pages: &[GmemCopy], peer: Option<&Self>) -> Result {
        let f = self.ops().copy.ok_or(EINVAL)?;
        let n = u32::try_from(pages.len()).map_err(|_| EINVAL)?;
        let peer = peer.map_or(core::ptr::null_mut(), |p| p.drv);
        // SAFETY: `pages` is valid for `n` reads; host pages and frames in it are owned by
        // the core for the duration of the call.
        to_result(unsafe { f(self.drv, dir, pages.as_ptr(), n, peer) })
    }

    fn frame_page(&self, frame: u64) -> Option<*mut bindings::page> {
        let f = self.ops().frame_page?;
        // SAFETY: optional callback present; `frame` is a frame of this device's pool.
        let p = unsafe { f(self.drv, frame) };
        (!p.is_null()).then_some(p)
    }
}

/// Per-device counters (debugfs `gmem/devN`).
#[derive(Default)]
pub(crate) struct DevStats {
    pub(crate) fault_batches: AtomicU64,
    pub(crate) faults: AtomicU64,
    pub(crate) pages_h2d: AtomicU64,
    pub(crate) pages_d2h: AtomicU64,
    pub(crate) pages_d2d: AtomicU64,
    pub(crate) pages_zeroed: AtomicU64,
    pub(crate) prefetched: AtomicU64,
    pub(crate) evictions: AtomicU64,
    pub(crate) remote_maps: AtomicU64,
}

impl DevStats {
    pub(crate) fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }
}

/// The frame pool's bookkeeping; [`FrameMap`] (pure policy code) works on it.
struct FramePool {
    bits: KVVec<u64>,
    cursor: u64,
    used: u64,
}

/// A registered device.
#[pin_data]
pub(crate) struct Device {
    pub(crate) id: usize,
    pub(crate) nr_frames: u64,
    pub(crate) drv: CDriver,
    alive: AtomicBool,
    #[pin]
    frames: Mutex<FramePool>,
    pub(crate) stats: DevStats,
}

impl Device {
    pub(crate) fn new(id: usize, drv: CDriver, nr_frames: u64) -> Result<Arc<Device>> {
        let words = FrameMap::words_for(nr_frames);
        let mut bits = KVVec::with_capacity(words, GFP_KERNEL)?;
        for _ in 0..words {
            bits.push(0u64, GFP_KERNEL)?;
        }
        Arc::pin_init(
            try_pin_init!(Device {
                id,
                nr_frames,
                drv,
                alive: AtomicBool::new(true),
                frames <- new_mutex!(FramePool { bits, cursor: 0, used: 0 }, "gmem_device_frames"),
                stats: DevStats::default(),
            }),
            GFP_KERNEL,
        )
    }

    /// False once unregistering started: no new work may be started on the device.
    pub(crate) fn alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    pub(crate) fn kill(&self) {
        self.alive.store(false, Ordering::Release);
    }

    /// One free frame, or `ENOMEM` when the pool is exhausted.
    pub(crate) fn alloc_frame(&self) -> Result<u32> {
        let mut pool = self.frames.lock();
        let FramePool { bits, cursor, used } = &mut *pool;
        let mut map = FrameMap::new(bits, cursor, used, self.nr_frames).ok_or(EINVAL)?;
        let f = map.alloc().ok_or(ENOMEM)?;
        u32::try_from(f).map_err(|_| EINVAL)
    }

    pub(crate) fn free_frame(&self, frame: u32) {
        let mut pool = self.frames.lock();
        let FramePool { bits, cursor, used } = &mut *pool;
        let ok = FrameMap::new(bits, cursor, used, self.nr_frames).map(|mut m| m.free(u64::from(frame)).is_ok());
        if ok != Some(true) {
            pr_err!("device {}: bad frame free {}\n", self.id, frame);
        }
    }

    pub(crate) fn frames_used(&self) -> u64 {
        self.frames.lock().used
    }
}
