// SPDX-License-Identifier: GPL-2.0
//! Device memory in the dmem cgroup controller: each device is a region of it, each frame
//! in use one page-sized charge to the dmem cgroup of the process owning the page it holds
//! (`gmem_dmem.c` has the C side and says whom exactly).
//!
//! Who charges and who uncharges (so that `dmem.current` is exact):
//! - the block executor charges every frame it allocates before taking it from the pool
//!   ([`Region::charge`], then `Device::alloc_*` pairs each frame with one [`Charge`]);
//! - the frame's [`Charge`] lives in the pool's bookkeeping beside the frame and is dropped
//!   (uncharging) when the frame is freed, whatever frees it; frames allocated without a
//!   charge (KUnit) hold an empty one. A batch's frames are charged in one call (the
//!   kernel's `dmem_cgroup_try_charge_task_many`, `scripts/kernel-patches/0002-*`) and the
//!   charges of the frames a batch's commit (or a drain of released device-private pages)
//!   frees are given back together ([`give_back`]); frames freed one at a time uncharge
//!   on drop. Each frame still holds exactly one charge of its own.
//!
//! Lifetimes: a [`Charge`] holds the references `dmem_cgroup_try_charge_task` (or its
//! batched form, one per frame) took (the pool and its cgroup), so it may outlive the
//! region and the cgroup's removal; the same holds for an owned [`Limit`]. The region is
//! unregistered once ([`Region::unregister`], at device unregistration, or on drop), which
//! also waits for running reclaim callbacks.

use core::ptr::NonNull;
use core::sync::atomic::{AtomicPtr, Ordering};
use kernel::{
    ffi::{c_int, c_void},
    mm::Mm,
    prelude::*,
};

/// `struct dmem_cgroup_region` and `struct dmem_cgroup_pool_state` (opaque).
#[repr(C)]
pub(crate) struct RawRegion {
    _p: [u8; 0],
}
#[repr(C)]
pub(crate) struct RawPool {
    _p: [u8; 0],
}

extern "C" {
    fn gmem_dmem_register(id: usize, frames: u64) -> *mut RawRegion;
    fn gmem_dmem_unregister(region: *mut RawRegion);
    fn gmem_dmem_charge(
        region: *mut RawRegion,
        mm: *mut c_void,
        n: u32,
        pools: *mut *mut RawPool,
        limit: *mut *mut RawPool,
        err: *mut c_int,
    ) -> u32;
    fn gmem_dmem_uncharge(pool: *mut RawPool);
    fn gmem_dmem_uncharge_many(pool: *mut RawPool, n: u32);
    fn gmem_dmem_evictable(limit: *mut RawPool, pool: *mut RawPool, ignore_low: bool) -> bool;
    fn gmem_dmem_pool_put(pool: *mut RawPool);
}

/// A device's dmem region.
///
/// # Invariants
/// `ptr` is null (no dmem controller, registration failed, or unregistered) or a region
/// from `gmem_dmem_register` that is unregistered exactly once, by whoever swaps it out.
pub(crate) struct Region {
    ptr: AtomicPtr<RawRegion>,
}

// SAFETY: the region is used through dmem's thread-safe API only.
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

impl Region {
    /// Registers device `id` (`frames` frames) as region `gmem/gmem<id>`. Without a dmem
    /// controller, or if registration fails, the device simply is not charged (logged).
    pub(crate) fn new(id: usize, frames: u64) -> Region {
        // SAFETY: process context; the name is formatted by the C side.
        let p = unsafe { gmem_dmem_register(id, frames) };
        let p = if kernel::error::from_err_ptr(p).is_err() {
            pr_warn!("device {}: no dmem cgroup region; its memory is not charged\n", id);
            core::ptr::null_mut()
        } else {
            p
        };
        // INVARIANT: a fresh region (or null), unregistered by `unregister` below.
        Region { ptr: AtomicPtr::new(p) }
    }

    /// Unregisters the region (once; later calls do nothing). Waits for running reclaim
    /// callbacks, so none runs for this device afterwards. Charges still held stay valid.
    pub(crate) fn unregister(&self) {
        let p = self.ptr.swap(core::ptr::null_mut(), Ordering::AcqRel);
        if !p.is_null() {
            // SAFETY: swapped out, so this is the one unregistration (type invariant).
            unsafe { gmem_dmem_unregister(p) }
        }
    }

    /// Charges up to `n` frames to the dmem cgroup of `mm`'s owner, appending one
    /// [`Charge`] per frame to `out`. Fewer than `n` when a cgroup limit stops it: then
    /// the pool at its limit comes back, for eviction within it. An error that stops it
    /// (`ENOMEM`, for the cgroup's pool state) is returned, the charges made left in `out`
    /// (given back when the caller drops them). May sleep.
    pub(crate) fn charge(&self, mm: &Mm, n: usize, out: &mut KVec<Charge>) -> Result<Option<Limit>> {
        let p = self.ptr.load(Ordering::Acquire);
        if p.is_null() {
            // Not charged: empty charges, so that every frame still gets one.
            for _ in 0..n {
                out.push(Charge(None), GFP_KERNEL)?;
            }
            return Ok(None);
        }
        let n32 = u32::try_from(n).map_err(|_| EINVAL)?;
        let mut pools: KVec<*mut RawPool> = KVec::with_capacity(n, GFP_KERNEL)?;
        out.reserve(n, GFP_KERNEL)?;
        let (mut limit, mut err) = (core::ptr::null_mut(), 0);
        // SAFETY: `p` is registered (a concurrent `unregister` can only happen at device
        // unregistration, after evacuation and `quiesce`, when no executor allocates on the
        // device any more: a batch's frames are allocated before the device is marked dead,
        // staging frames only inside a callback section, which `quiesce` waits for); `mm`
        // is live; `pools` has room for `n` entries; `limit` and `err` are live locals.
        let k = unsafe { gmem_dmem_charge(p, mm.as_raw().cast(), n32, pools.as_mut_ptr(), &mut limit, &mut err) };
        let k = core::cmp::min(k as usize, n);
        // SAFETY: the first `k` entries were written by `gmem_dmem_charge`.
        unsafe { pools.inc_len(k) };
        for &pool in pools.iter() {
            // Room reserved above.
            let _ = out.push_within_capacity(Charge(NonNull::new(pool)));
        }
        // INVARIANT: a reference taken by `dmem_cgroup_try_charge_task` for us.
        let limit = NonNull::new(limit).map(|ptr| Limit { ptr, owned: true });
        if err != 0 {
            // (No limit comes with an error: `limit` is `None`, nothing to put.)
            return Err(Error::from_errno(err));
        }
        Ok(limit)
    }
}

impl Region {
    /// Whether the dmem cgroup of `mm`'s owner could take one more frame now (a trial
    /// charge, given back at once): an evictor for a cgroup at its limit asks this before
    /// and after its pass, since others may have made room meanwhile.
    pub(crate) fn has_room(&self, mm: &Mm) -> bool {
        let mut one = KVec::new();
        matches!(self.charge(mm, 1, &mut one), Ok(None)) && one.len() == 1
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        self.unregister();
    }
}

/// One frame's charge (or none).
///
/// # Invariants
/// A `Some` pool holds one page-sized charge (with its references) of
/// `dmem_cgroup_try_charge_task` or its batched form, given back exactly once: on drop, or
/// by [`give_back`], which takes it out of the `Charge` first.
pub(crate) struct Charge(Option<NonNull<RawPool>>);

// SAFETY: a charge is given back from any context with `dmem_cgroup_uncharge`.
unsafe impl Send for Charge {}
// SAFETY: shared references only compare the pointer.
unsafe impl Sync for Charge {}

impl Charge {
    /// No charge (a free frame, or one allocated without charging).
    pub(crate) const NONE: Charge = Charge(None);

    /// The charge, leaving none in its place.
    pub(crate) fn take(&mut self) -> Charge {
        Charge(self.0.take())
    }

    /// Whether the frame's cgroup protects it from an eviction that makes room on a full
    /// device (no cgroup limit involved): its use is within its effective `dmem.min`, or,
    /// unless `ignore_low`, its `dmem.low`. A frame without a charge is not protected.
    pub(crate) fn protected(&self, ignore_low: bool) -> bool {
        match self.0 {
            // SAFETY: the pool is live (type invariant); with no limit pool the query
            // measures protection against the root, reading under RCU only.
            Some(p) => !unsafe { gmem_dmem_evictable(core::ptr::null_mut(), p.as_ptr(), ignore_low) },
            None => false,
        }
    }
}

/// Gives back `charges` as dropping each of them would, with one call per run of charges
/// to the same pool (a batch frees frames charged together, mostly to one pool).
pub(crate) fn give_back(charges: impl IntoIterator<Item = Charge>) {
    // A run of `n` charges, each holding one reference to `pool`.
    let mut run: Option<(NonNull<RawPool>, u32)> = None;
    let flush = |(pool, n): (NonNull<RawPool>, u32)| {
        // SAFETY: `n` charges to `pool`, taken out of their `Charge`s below, so given back
        // once, here (type invariant of `Charge`).
        unsafe { gmem_dmem_uncharge_many(pool.as_ptr(), n) }
    };
    for mut c in charges {
        let Some(pool) = c.0.take() else { continue };
        match &mut run {
            // (The kernel takes at most `INT_MAX` at once.)
            Some((p, n)) if *p == pool && *n < i32::MAX as u32 => *n += 1,
            _ => {
                if let Some(done) = run.replace((pool, 1)) {
                    flush(done);
                }
            }
        }
    }
    if let Some(done) = run {
        flush(done);
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            // SAFETY: our charge, given back once (type invariant).
            unsafe { gmem_dmem_uncharge(p.as_ptr()) }
        }
    }
}

/// A dmem pool at its limit: eviction for it takes only frames charged within it.
///
/// # Invariants
/// `ptr` is a live pool: `owned` ones hold a reference put on drop; borrowed ones (the
/// reclaim callback's argument) are live for the callback, which the borrow cannot outlive
/// (see `entry::cgroup`).
pub(crate) struct Limit {
    ptr: NonNull<RawPool>,
    owned: bool,
}

// SAFETY: pool references are put from any context; queries are RCU-safe.
unsafe impl Send for Limit {}
// SAFETY: as above.
unsafe impl Sync for Limit {}

impl Limit {
    /// The pool the dmem controller passes to a reclaim callback, valid during it.
    ///
    /// # Safety
    /// `pool` must be that argument, and the `Limit` dropped before the callback returns.
    pub(crate) unsafe fn borrowed(pool: *mut RawPool) -> Option<Limit> {
        // INVARIANT: live for the callback by the caller's contract.
        NonNull::new(pool).map(|ptr| Limit { ptr, owned: false })
    }

    /// Whether a frame holding `charge` may be evicted to make room within this pool: it
    /// is charged to the pool or below it and not protected by `dmem.min` (nor by
    /// `dmem.low`, unless `ignore_low`).
    pub(crate) fn covers(&self, charge: &Charge, ignore_low: bool) -> bool {
        match charge.0 {
            // SAFETY: both pools are live (type invariants); the query only reads them
            // under RCU.
            Some(p) => unsafe { gmem_dmem_evictable(self.ptr.as_ptr(), p.as_ptr(), ignore_low) },
            None => false,
        }
    }

    /// Same pool (for caching `covers` answers).
    pub(crate) fn same(a: &Charge, b: &Charge) -> bool {
        a.0 == b.0
    }
}

impl Drop for Limit {
    fn drop(&mut self) {
        if self.owned {
            // SAFETY: the reference we hold (type invariant), put once.
            unsafe { gmem_dmem_pool_put(self.ptr.as_ptr()) }
        }
    }
}
