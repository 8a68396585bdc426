// SPDX-License-Identifier: GPL-2.0
//! A registered accelerator: its callbacks (behind the `DeviceOps` trait), its memory pool
//! of frames (allocated centrally here, never by the driver), its contexts and its counters.
//!
//! Lifetime of the driver behind a device: every callback is made inside a *callback
//! section* ([`Device::ops`]), an SRCU read-side section of the device that is refused once
//! the device is `gone`. Unregistration sets `gone` and waits for every section
//! ([`Device::quiesce`]); only then does it destroy the contexts, and only then does
//! `gmem_dev_unregister` return. So no callback runs after unregistration returned and none
//! runs on a context after its `ctx_destroy` (contexts are destroyed either inside a section
//! by the space that owns them, after removing them from the device's list, or by `quiesce`
//! after the last section ended). The `Device` object itself is refcounted (`Arc`) and may
//! outlive the driver: spaces and reverse maps hold it; nothing reaches the driver through it
//! after `gone`.
//!
//! Lock order: `Device::frames` is a leaf (taken under a block lock; nothing is
//! called under it). `Device::ctxs` is taken under `Space::ctxs` (or alone) and only the
//! driver's `ctx_create` is called under it. Driver callbacks are never called under a
//! spinlock.

use crate::abi::GMEM_MAX_CHANNELS;
use crate::abi::{GmemCopy, GmemDevOps, GmemDevProps, GmemPte, GMEM_DEV_CAP_MAP_2M, GMEM_DRIVER_ABI_VERSION};
use crate::obj::dmem::{self, Charge, Limit};
use crate::obj::dpriv::Pagemap;
use crate::obj::region::{Region, BLOCK_BYTES, BLOCK_PAGES};
use crate::policy::bits::{self, BlockBits};
use crate::policy::evict::{self as order, Clock, F_CLEAN, F_LENT, F_PINNED, F_REF, F_USED};
use crate::policy::frames::{FrameMap, CHUNK_FRAMES};
use crate::policy::paths;
use crate::policy::prefetch::{ahead_of_stream, behind_stream, pick_stream, stream_fresh_ns, Accuracy, DOWN_MOVES};
use core::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use kernel::{
    bindings,
    error::VTABLE_DEFAULT_ERROR,
    ffi::{c_int, c_void},
    new_condvar, new_mutex, new_srcu,
    prelude::*,
    sync::{srcu, Arc, CondVar, Mutex, SetOnce, Srcu},
    workqueue::{impl_has_work, new_work, Work},
};

/// Frame flag kept by the core only: filled by prefetch, not yet known to be used.
pub(crate) const F_PREFETCHED: u8 = 0x40;
/// Frame flag kept by the core only: spared once by eviction because its page prefers this
/// device (PREFERRED_LOC) or was prefetched and not touched yet; cleared when the page
/// faults or migrates again.
pub(crate) const F_SPARED: u8 = 0x80;
/// Frame flag kept by the core only: the frame holds a page of ordinary process memory
/// migrated here (a device-private page, obj/dpriv.rs); it has no region owner.
pub(crate) const F_SYSMEM: u8 = 0x20;

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
    /// Prepares an allocation-free `map` of `GMEM_PTE_SYSMEM` entries in the range;
    /// `EFAULT` if the driver cannot map process memory.
    fn map_prepare(&self, ctx: Ctx, va: u64, npages: u64) -> Result;
    /// Removes the entries of `npages` pages from `va`.
    fn unmap(&self, ctx: Ctx, va: u64, npages: u64);
    /// Flushes device TLBs for the range.
    fn tlb_invalidate(&self, ctx: Ctx, va: u64, npages: u64);
    /// Copies pages (direction `GMEM_COPY_*`); `peer` is the destination device for D2D.
    fn copy(&self, dir: u32, pages: &[GmemCopy], peer: Option<&Self>) -> Result;
    /// Copy channels the device runs at once (0: synchronous copies only).
    fn channels(&self) -> u32;
    /// Starts the same copy on channel `chan` (`< channels()`); `fence` is signalled when
    /// it is done. `Err` means refused: nothing copied, `fence` never signalled.
    ///
    /// # Safety
    /// `pages`, the pages and frames it names, and `fence` must stay valid and owned by the
    /// caller until `fence` is signalled (the caller waits for it before it lets go).
    unsafe fn copy_async(
        &self,
        chan: u32,
        dir: u32,
        pages: &[GmemCopy],
        peer: Option<&Self>,
        fence: &crate::obj::fence::Fence,
    ) -> Result;
    /// Completes now the copies of channel `chan` whose data has landed (the driver's
    /// `copy_poll`; nothing without one).
    fn copy_poll(&self, chan: u32);
    /// Whether the driver has `copy_poll` (a waiter polls only then).
    fn can_poll(&self) -> bool;
    /// The host-visible page behind a frame, if the device can expose it to the CPU.
    fn frame_page(&self, _frame: u64) -> Option<*mut bindings::page> {
        build_error!(VTABLE_DEFAULT_ERROR)
    }
    /// Tests and clears the device's accessed bits of the pages from `va` that `bits`
    /// selects (bit k: the page at `va + k * 4096`, up to 512 pages); on return bit k is
    /// set if and only if page k was selected and the device touched it. A device without
    /// accessed bits answers 0 for every page.
    fn test_clear_accessed(&self, ctx: Ctx, va: u64, bits: &mut BlockBits);
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
    /// `GMEM_DEV_CAP_*` the driver declared (only known bits).
    caps: u32,
    /// Copy channels (`0..=GMEM_MAX_CHANNELS`; nonzero only with `copy_async`).
    channels: u32,
    /// A callback returned a value the API does not allow (reported once per device).
    misbehaved: AtomicBool,
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
        if p.caps & !GMEM_DEV_CAP_MAP_2M != 0 {
            return Err(EINVAL);
        }
        if p.nr_channels > GMEM_MAX_CHANNELS || (p.nr_channels != 0 && o.copy_async.is_none()) {
            return Err(EINVAL);
        }
        // INVARIANT: checked above; lifetime by the caller's contract.
        let d = CDriver { ops, drv: p.drv, caps: p.caps, channels: p.nr_channels, misbehaved: AtomicBool::new(false) };
        Ok((d, p.nr_frames))
    }

    /// The driver maps a whole 2 MiB block with one `GMEM_PTE_2M` entry when asked to.
    pub(crate) fn maps_2m(&self) -> bool {
        self.caps & GMEM_DEV_CAP_MAP_2M != 0
    }

    /// Whether two devices are served by the same driver (peer copies need that).
    pub(crate) fn same_driver(&self, other: &CDriver) -> bool {
        core::ptr::eq(self.ops, other.ops)
    }

    fn ops(&self) -> &GmemDevOps {
        // SAFETY: valid until unregister by the type invariant; `self` does not outlive it.
        unsafe { &*self.ops }
    }
}

/// A C driver callback's result. 0 is success; anything else refuses (driver-api.rst: "a
/// non-zero return"), a negative errno as itself and any other value (positive, or below
/// `-MAX_ERRNO`) as `EIO`. The header asks for 0 or a negative errno; a positive value
/// taken for success would make gmem wait forever for the fence of a `copy_async` the
/// driver refused, or commit pages a `copy` did not fill. (Also the result a driver
/// signals a fence with.)
pub(crate) fn driver_result(r: c_int) -> Result {
    match r {
        0 => Ok(()),
        -4095..=-1 => Err(Error::from_errno(r)),
        _ => Err(EIO),
    }
}

impl CDriver {
    /// [`driver_result`] of callback `what`, reporting a value outside the API once for
    /// this device.
    fn result(&self, what: &str, r: c_int) -> Result {
        let res = driver_result(r);
        // Outside the API: refused with an error that is not `r` itself.
        if res.is_err_and(|e| e.to_errno() != r) {
            if !self.misbehaved.swap(true, Ordering::Relaxed) {
                pr_warn!("the driver's {} returned {}, not 0 or a negative errno: taken as -EIO\n", what, r);
            }
        }
        res
    }
}

#[vtable]
impl DeviceOps for CDriver {
    fn ctx_create(&self) -> Result<Ctx> {
        let f = self.ops().ctx_create.ok_or(EINVAL)?;
        let mut ctx = core::ptr::null_mut();
        // SAFETY: mandatory callback (type invariant), called with the driver's `drv` and a
        // valid out-pointer.
        self.result("ctx_create", unsafe { f(self.drv, &mut ctx) })?;
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
        self.result("map", unsafe { f(self.drv, ctx.0, ptes.as_ptr(), n) })
    }

    fn map_prepare(&self, ctx: Ctx, va: u64, npages: u64) -> Result {
        let f = self.ops().map_prepare.ok_or(EFAULT)?;
        // SAFETY: optional callback present; `ctx` is a live context of this driver.
        self.result("map_prepare", unsafe { f(self.drv, ctx.0, va, npages) })
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
        self.result("copy", unsafe { f(self.drv, dir, pages.as_ptr(), n, peer) })
    }

    fn channels(&self) -> u32 {
        self.channels
    }

    unsafe fn copy_async(
        &self,
        chan: u32,
        dir: u32,
        pages: &[GmemCopy],
        peer: Option<&Self>,
        fence: &crate::obj::fence::Fence,
    ) -> Result {
        let f = self.ops().copy_async.ok_or(EINVAL)?;
        if chan >= self.channels {
            return Err(EINVAL);
        }
        let n = u32::try_from(pages.len()).map_err(|_| EINVAL)?;
        let peer = peer.map_or(core::ptr::null_mut(), |p| p.drv);
        // SAFETY: the callback is present; `pages` (n entries), what they name and `fence`
        // stay valid until the fence is signalled (the caller's contract).
        self.result("copy_async", unsafe { f(self.drv, chan, dir, pages.as_ptr(), n, peer, fence.as_handle()) })
    }

    fn can_poll(&self) -> bool {
        self.ops().copy_poll.is_some()
    }

    fn copy_poll(&self, chan: u32) {
        if let Some(f) = self.ops().copy_poll {
            if chan < self.channels {
                // SAFETY: optional callback present; `chan` is one of the device's channels.
                unsafe { f(self.drv, chan) }
            }
        }
    }

    fn frame_page(&self, frame: u64) -> Option<*mut bindings::page> {
        let f = self.ops().frame_page?;
        // SAFETY: optional callback present; `frame` is a frame of this device's pool.
        let p = unsafe { f(self.drv, frame) };
        (!p.is_null()).then_some(p)
    }

    fn test_clear_accessed(&self, ctx: Ctx, va: u64, bits: &mut BlockBits) {
        // Pages up to the last one selected (none: nothing to ask).
        let Some(npages) = bits::ones(bits).last().map(|k| k + 1) else { return };
        let o = self.ops();
        if let Some(f) = o.test_clear_accessed_range {
            // SAFETY: optional callback present; `ctx` is a live context of this driver;
            // `bits` holds a word per 64 of the `npages` (at most 512) pages and is ours
            // during the call.
            if unsafe { f(self.drv, ctx.0, va, npages as u32, bits.as_mut_ptr()) } < 0 {
                *bits = [0; 8];
            }
            return;
        }
        let Some(f) = o.test_clear_accessed else {
            *bits = [0; 8];
            return;
        };
        let asked = *bits;
        for k in bits::ones(&asked) {
            // SAFETY: optional callback present; `ctx` is a live context of this driver.
            if unsafe { f(self.drv, ctx.0, va + ((k as u64) << 12)) } <= 0 {
                bits::clear(bits, k, k + 1);
            }
        }
    }
}

/// How long a device's stream stays live after its last fault that asked for read-ahead
/// ([`Device::behind_reader`]), at least: 50 ms, several blocks' compute under TCG (P4's
/// device computes a 2 MiB block in about 7 ms). A stream that asks more slowly (a device
/// computing long on each block; the debug kernel's took about 90 ms a block) stays live
/// for four of its gaps between blocks, at most [`STREAM_FRESH_MAX_NS`] (a gap over a
/// quarter of that is a pause, not a pace: `policy::prefetch::stream_fresh_ns`).
pub(crate) const STREAM_FRESH_NS: u64 = 50_000_000;

/// The longest a slow stream stays live after its last ask: 1 s.
pub(crate) const STREAM_FRESH_MAX_NS: u64 = 1_000_000_000;

/// Streams of device faults read-ahead follows at once on one device, each with a chain of
/// its own (`mech/readahead.rs`): a kernel that reads two arrays and writes a third streams
/// through three regions together.
pub(crate) const STREAMS: usize = 4;

/// One stream of device faults that read-ahead follows, and its chain (`mech/readahead.rs`).
/// Its fields are read and written without a lock, with the ordering rules written there.
pub(crate) struct Stream {
    /// The chain's token: set while a read-ahead worker is queued or running that has yet
    /// to hand on to the next block; one chain per stream, so that the stream's blocks
    /// reach the link in its order.
    pub(crate) token: AtomicBool,
    /// The block after the last one the chain queued (in the region `of`): a chain started
    /// again goes on from there, not from blocks already fetched.
    pub(crate) ahead_to: AtomicUsize,
    /// The block (2 MiB-aligned address) of the device fault that last asked for a
    /// read-ahead in the stream: read-ahead keeps going while it is within
    /// `readahead::device_depth` blocks of it.
    pub(crate) at: AtomicUsize,
    /// The region of that fault, as an address compared for identity only (never
    /// dereferenced; 0: none): the chain goes on only for the region it is reading ahead
    /// in, not for another process's region at nearby addresses.
    pub(crate) of: AtomicUsize,
    /// When that fault asked (`sched::now_ns`): a stream whose device has not asked for a
    /// while has ended, or moved on to other work ([`Device::behind_reader`]), and its
    /// place is the first taken by a new one (`Device::stream_for`).
    pub(crate) asked_ns: AtomicU64,
    /// The time from the reader's last ask in one block to its first in the next, in the
    /// same region (0: none such yet): the stream's pace, which sets how long it stays
    /// live (`Stream::age`).
    pub(crate) gap_ns: AtomicU64,
    /// The reader's moves from one block to another in the same region that went down, in
    /// a row (0 for a stream new to this place: `policy::prefetch::downs_after`). From
    /// `DOWN_MOVES` on, the reader is taken to move down, and the eviction verdicts, which
    /// assume an upward reader, give none (`policy::prefetch::behind_stream`).
    pub(crate) downs: AtomicU32,
    /// The start address of the region `of` (debugfs only).
    pub(crate) va: AtomicUsize,
}

/// A stream as its eviction verdicts see it, for one block (`Device::stream_view`):
/// block numbers are addresses / 2 MiB.
struct StreamView {
    /// The block judged.
    block: usize,
    /// The reader's block (`Stream::at`) and its chain's front (`Stream::ahead_to`).
    at: usize,
    to: usize,
    /// How long ago the reader last asked, and how long the stream stays live (`Stream::age`).
    age_ns: u64,
    fresh_ns: u64,
    /// The reader is taken to move down (`Stream::downs`).
    down: bool,
}

impl Stream {
    /// How long ago the reader last asked, and how long the stream stays live after an
    /// ask at its pace (`policy::prefetch::stream_fresh_ns`).
    fn age(&self) -> (u64, u64) {
        let age = crate::obj::sched::now_ns().saturating_sub(self.asked_ns.load(Ordering::Relaxed));
        (age, stream_fresh_ns(self.gap_ns.load(Ordering::Relaxed), STREAM_FRESH_NS, STREAM_FRESH_MAX_NS))
    }

    /// Whether the reader is taken to be moving down: `DOWN_MOVES` moves down in a row.
    pub(crate) fn moving_down(&self) -> bool {
        self.downs.load(Ordering::Relaxed) >= DOWN_MOVES
    }

    const fn new() -> Stream {
        Stream {
            token: AtomicBool::new(false),
            ahead_to: AtomicUsize::new(0),
            at: AtomicUsize::new(0),
            of: AtomicUsize::new(0),
            asked_ns: AtomicU64::new(0),
            gap_ns: AtomicU64::new(0),
            downs: AtomicU32::new(0),
            va: AtomicUsize::new(0),
        }
    }
}

/// Per-device counters (debugfs `gmem/devices`).
#[derive(Default)]
pub(crate) struct DevStats {
    /// Device faults on ordinary process memory (addresses) and the pages of it mapped
    /// (fault-around included): obj/mirror.rs.
    pub(crate) mirror_faults: AtomicU64,
    pub(crate) mirror_mapped: AtomicU64,
    /// Pages of ordinary process memory migrated to the device (obj/dpriv.rs), and back:
    /// by CPU faults or PREFETCH to the host, and by eviction or unregistration.
    pub(crate) sysmem_in: AtomicU64,
    pub(crate) sysmem_out: AtomicU64,
    pub(crate) sysmem_evicted: AtomicU64,
    pub(crate) fault_batches: AtomicU64,
    pub(crate) faults: AtomicU64,
    pub(crate) pages_h2d: AtomicU64,
    pub(crate) pages_d2h: AtomicU64,
    pub(crate) pages_d2d: AtomicU64,
    pub(crate) pages_zeroed: AtomicU64,
    pub(crate) prefetched: AtomicU64,
    pub(crate) evacuated: AtomicU64,
    /// Pages whose data could not be saved when the device went away (now `Lost`).
    pub(crate) lost: AtomicU64,
    pub(crate) remote_maps: AtomicU64,
    /// Victims sent to host memory / parked on a peer device / dropped (clean or duplicate).
    pub(crate) evicted_to_host: AtomicU64,
    pub(crate) evicted_to_peer: AtomicU64,
    pub(crate) evicted_clean: AtomicU64,
    /// Frames freed by the background worker; times a fault had to evict first.
    pub(crate) pre_evicted: AtomicU64,
    /// Touched pages chosen for eviction without a second chance, counted when chosen:
    /// the device's stream had gone past their block (`evict.rs`, `Verdict::Passed`).
    pub(crate) evict_passed: AtomicU64,
    /// Pages evicted from a block the device's stream had gone past in place of the
    /// hand's victims in front of it (`evict.rs`, `evict_behind`).
    pub(crate) evict_behind: AtomicU64,
    pub(crate) fault_waits: AtomicU64,
    /// Times a fault, advice or cgroup reclaim waited for one of the eviction batches
    /// copying at the time (other passes') to end, instead of evicting more or polling for
    /// frames in transit (`evict.rs`: `pass`, `wait_for_copies`).
    pub(crate) copy_waits: AtomicU64,
    /// Eviction batches that began copying while another of the device's was copying.
    pub(crate) evict_overlaps: AtomicU64,
    /// Times eviction found only frames in transit (of batches in flight) and its caller
    /// waited for them to commit (`evict::make_room_for`).
    pub(crate) transit_waits: AtomicU64,
    /// Allocations on the fault path (denominator of `fault_waits`).
    pub(crate) fault_allocs: AtomicU64,
    /// Parked victims written back to the host in the background.
    pub(crate) writebacks: AtomicU64,
    pub(crate) prefetch_used: AtomicU64,
    pub(crate) prefetch_wasted: AtomicU64,
    /// Pages fetched by read-ahead (`mech/readahead.rs`; also counted in `prefetched`).
    pub(crate) readahead: AtomicU64,
    pub(crate) thrash_events: AtomicU64,
    /// Host-to-device copies with a route through a peer (`exec/multipath.rs`): batches,
    /// pages that went direct, pages that went through the peer (counted on the
    /// destination; the peer counts the staged pages in `pages_h2d` and `pages_d2d`).
    pub(crate) mp_batches: AtomicU64,
    pub(crate) mp_direct: AtomicU64,
    pub(crate) mp_via_peer: AtomicU64,
    /// Driver calls made by the block executor: `copy`, `map`, and `unmap` (each followed
    /// by one `tlb_invalidate`); per migrated page they show the batching.
    pub(crate) copy_calls: AtomicU64,
    pub(crate) map_calls: AtomicU64,
    /// 2 MiB entries sent (`GMEM_PTE_2M`, each in a `map` call of its own).
    pub(crate) map_2m: AtomicU64,
    /// `tlb_invalidate` calls.
    pub(crate) tlb_calls: AtomicU64,
    /// Acquisitions of the frame-pool lock (`Device::pool`).
    pub(crate) pool_locks: AtomicU64,
    pub(crate) unmap_calls: AtomicU64,
}

impl DevStats {
    pub(crate) fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }
}

/// One frame update of a batch's commit ([`Device::commit_frames`]).
pub(crate) enum FrameOp {
    /// Return the frame to the pool.
    Free(u32),
    /// Record `who` (taken) as the frame's holder; flags become `(old & keep) | set`;
    /// `settle`: count the frame if it was still marked prefetched.
    Own { frame: u32, who: Option<Owner>, set: u8, keep: u8, settle: bool },
    /// Done: the holder it replaced and the charge of a freed frame, held only to be let
    /// go without the pool lock (the charges of a batch's ops together,
    /// [`FrameOp::take_charge`] and [`dmem::give_back`]; the holders on drop).
    #[allow(dead_code)]
    Dropped(Option<Owner>, Charge),
}

impl FrameOp {
    /// The charge of a `Dropped` op, taken out (none for the others), for
    /// [`dmem::give_back`].
    pub(crate) fn take_charge(&mut self) -> Charge {
        match self {
            FrameOp::Dropped(_, c) => c.take(),
            _ => Charge::NONE,
        }
    }
}

/// Who holds a frame: a page of a region (as owner or read-only duplicate).
#[derive(Clone)]
pub(crate) struct Owner {
    pub(crate) region: Arc<Region>,
    pub(crate) page: u32,
}

/// Eviction candidates: frames with who holds them (`None`: process memory, `F_SYSMEM`).
pub(crate) type Victims = KVec<(u32, Option<Owner>)>;

/// The frame pool's bookkeeping; [`FrameMap`] and [`Clock`] (pure policy code) work on it.
struct FramePool {
    bits: KVVec<u64>,
    cursor: u64,
    used: u64,
    /// Replacement flags per frame (`policy::evict::F_*`, plus `F_PREFETCHED`).
    flags: KVVec<u8>,
    /// Reverse map: frame -> page.
    owner: KVVec<Option<Owner>>,
    /// Each used frame's dmem cgroup charge (`obj/dmem.rs`); empty for free frames.
    charges: KVVec<Charge>,
    hand: u64,
    /// Frames with `F_PINNED` / `F_LENT` / `F_SYSMEM` set, kept by [`FramePool::recount`]
    /// (never rescanned).
    pinned: u64,
    lent: u64,
    sysmem: u64,
}

impl FramePool {
    /// Keeps the pinned/lent/sysmem counts right when a frame's flags go from `old` to `new`.
    /// Most changes touch none of those bits (a page committed, a referenced bit), and
    /// return at once: a P4 profile had put 14 ms of each 2x run's worker CPU here.
    fn recount(counts: [&mut u64; 3], old: u8, new: u8) {
        if (old ^ new) & (F_PINNED | F_LENT | F_SYSMEM) == 0 {
            return;
        }
        let [pinned, lent, sysmem] = counts;
        for (bit, n) in [(F_PINNED, pinned), (F_LENT, lent), (F_SYSMEM, sysmem)] {
            match (old & bit != 0, new & bit != 0) {
                (false, true) => *n += 1,
                (true, false) => *n = n.saturating_sub(1),
                _ => {}
            }
        }
    }
}

/// The locked frame pool; publishes `used` to [`Device::frames_free_hint`] on release.
struct PoolGuard<'a> {
    g: kernel::sync::MutexGuard<'a, FramePool>,
    hint: &'a AtomicU64,
}

impl core::ops::Deref for PoolGuard<'_> {
    type Target = FramePool;

    fn deref(&self) -> &FramePool {
        &self.g
    }
}

impl core::ops::DerefMut for PoolGuard<'_> {
    fn deref_mut(&mut self) -> &mut FramePool {
        &mut self.g
    }
}

impl Drop for PoolGuard<'_> {
    fn drop(&mut self) {
        self.hint.store(self.g.used, Ordering::Relaxed);
    }
}

/// A callback section of one device: the driver may be called through it.
///
/// # Invariants
/// Created inside the SRCU read section `_section` of `dev`, after `dev.gone` was seen
/// false in it. `Device::quiesce` sets `gone` before it waits for every section, so the
/// driver's vtable, its `drv` and every context in `dev.ctxs` stay valid while this lives.
pub(crate) struct Ops<'a> {
    drv: &'a CDriver,
    _section: srcu::Guard<'a>,
}

impl core::ops::Deref for Ops<'_> {
    type Target = CDriver;

    fn deref(&self) -> &CDriver {
        self.drv
    }
}

/// A registered device.
#[pin_data]
pub(crate) struct Device {
    pub(crate) id: usize,
    pub(crate) nr_frames: u64,
    drv: CDriver,
    /// False once unregistering started: nothing new is placed on the device.
    alive: AtomicBool,
    /// The streams of device faults read-ahead follows (`mech/readahead.rs`), one chain
    /// each.
    pub(crate) streams: [Stream; STREAMS],
    /// Round-robin cursor over the copy channels (`next_channel`).
    chan_rr: AtomicU32,
    /// How much of what the device prefetched it used lately (`policy::prefetch::Accuracy`,
    /// updated as prefetched pages settle: [`Device::note_prefetch`]).
    prefetch_accuracy: AtomicU32,
    /// When a settled page last moved the estimate, or a probe restarted its clock
    /// (`sched::now_ns`; 0: never).
    prefetch_settled_ns: AtomicU64,
    /// Link bandwidths the driver reported (`gmem_dev_set_links`), MB/s, 0 unknown:
    /// host-to-device, device-to-host, device-to-peer.
    links: [AtomicU64; 3],
    /// True once unregistration quiesced the driver: no callback may be made any more.
    gone: AtomicBool,
    /// Callback sections (see the module documentation).
    #[pin]
    callbacks: Srcu,
    /// Every live context of this device, by the id of the space that owns it.
    #[pin]
    ctxs: Mutex<KVec<(u64, Ctx)>>,
    #[pin]
    frames: Mutex<FramePool>,
    /// `FramePool::used` as of the last release of the pool lock: a lock-free, possibly
    /// stale view for estimates ([`Device::frames_free_hint`]).
    used_hint: AtomicU64,
    /// One evictor at a time per device chooses victims (taken with no block lock held);
    /// it holds the number of frames in eviction batches copying without it (a pass gives
    /// the lock up while its batch copies: mech/evict.rs).
    #[pin]
    pub(crate) evict_lock: Mutex<u64>,
    /// Notified, under `evict_lock`, when an eviction batch that copied without it is over.
    #[pin]
    pub(crate) evict_done: CondVar,
    low: AtomicU64,
    high: AtomicU64,
    /// Frames promised to peers' eviction batches for parking here and not yet allocated
    /// by them ([`Device::promise_parking`]).
    promised: AtomicU64,
    /// The device's region of the dmem cgroup controller.
    pub(crate) dmem: dmem::Region,
    /// Its memory as device-private pages, for process memory migrated here (obj/dpriv.rs):
    /// created by the first migration to the device (its struct pages cost host memory,
    /// about 1.6% of the device's), only for a driver that can map process memory.
    dpriv: SetOnce<Pagemap>,
    /// Serialises the pagemap's creation; true once it failed (then process memory stays on
    /// the host, mapped remotely).
    #[pin]
    dpriv_failed: Mutex<bool>,
    /// Placing sections: a migration of process memory to the device runs inside one, begun
    /// only while the device is alive ([`Device::placing`]); unregistration waits for them
    /// after it marks the device dead, so that nothing lands on it after its evacuation.
    #[pin]
    placing: Srcu,
    /// Frames whose device-private page went free (a bit each), not yet back in the pool:
    /// the pagemap's callback may run in atomic context, where the pool lock cannot be
    /// taken ([`Device::drain_released`]).
    released: KVVec<AtomicU64>,
    released_n: AtomicU64,
    pub(crate) stats: DevStats,
    #[pin]
    work: Work<Device>,
}

impl_has_work! {
    impl HasWork<Self> for Device { self.work }
}

/// How a device's per-frame arrays are allocated. A driver may report any number of frames
/// up to `u32::MAX`: an array larger than kvmalloc takes (`INT_MAX` bytes) fails the
/// registration with `ENOMEM`, without the allocator's warning.
fn frame_arrays() -> kernel::alloc::Flags {
    GFP_KERNEL | kernel::alloc::flags::__GFP_NOWARN
}

fn filled<T: Clone>(n: usize, v: T) -> Result<KVVec<T>> {
    let mut out = KVVec::with_capacity(n, frame_arrays())?;
    for _ in 0..n {
        out.push(v.clone(), GFP_KERNEL)?;
    }
    Ok(out)
}

impl Device {
    pub(crate) fn new(id: usize, drv: CDriver, nr_frames: u64) -> Result<Arc<Device>> {
        let n = usize::try_from(nr_frames).map_err(|_| EINVAL)?;
        // The largest arrays first: a device too large fails before anything is taken.
        let mut owner = KVVec::with_capacity(n, frame_arrays())?;
        let mut charges = KVVec::with_capacity(n, frame_arrays())?;
        for _ in 0..n {
            owner.push(None, GFP_KERNEL)?;
            charges.push(Charge::NONE, GFP_KERNEL)?;
        }
        let bits = filled(FrameMap::words_for(nr_frames), 0u64)?;
        let flags = filled(n, 0u8)?;
        let (low, high) = order::default_watermarks(nr_frames);
        let region = dmem::Region::new(id, nr_frames);
        let mut rel = KVVec::with_capacity(FrameMap::words_for(nr_frames), frame_arrays())?;
        for _ in 0..FrameMap::words_for(nr_frames) {
            rel.push(AtomicU64::new(0), GFP_KERNEL)?;
        }
        Arc::pin_init(
            try_pin_init!(Device {
                id,
                nr_frames,
                drv,
                alive: AtomicBool::new(true),
                streams: [const { Stream::new() }; STREAMS],
                chan_rr: AtomicU32::new(0),
                prefetch_accuracy: AtomicU32::new(Accuracy::ONE),
                prefetch_settled_ns: AtomicU64::new(0),
                links: [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)],
                gone: AtomicBool::new(false),
                callbacks <- new_srcu!("gmem_device_callbacks"),
                ctxs <- new_mutex!(KVec::new(), "gmem_device_ctxs"),
                frames <- new_mutex!(
                    FramePool {
                        bits,
                        cursor: 0,
                        used: 0,
                        flags,
                        owner,
                        charges,
                        hand: 0,
                        pinned: 0,
                        lent: 0,
                        sysmem: 0
                    },
                    "gmem_device_frames"
                ),
                used_hint: AtomicU64::new(0),
                evict_lock <- new_mutex!(0, "gmem_device_evict"),
                evict_done <- new_condvar!("gmem_device_evict_done"),
                low: AtomicU64::new(low),
                high: AtomicU64::new(high),
                promised: AtomicU64::new(0),
                dmem: region,
                dpriv: SetOnce::new(),
                dpriv_failed <- new_mutex!(false, "gmem_device_dpriv"),
                placing <- new_srcu!("gmem_device_placing"),
                released: rel,
                released_n: AtomicU64::new(0),
                stats: DevStats::default(),
                work <- new_work!("gmem_device_preevict"),
            }),
            GFP_KERNEL,
        )
    }

    /// Its device-private pagemap, if a migration created it.
    pub(crate) fn dpriv(&self) -> Option<&Pagemap> {
        self.dpriv.as_ref()
    }

    /// Its device-private pagemap, created on first use; `None` for a driver that cannot map
    /// process memory, or once creating it failed (warned once). Call inside a placing
    /// section ([`Device::placing`]): unregistration tears the pagemap down after the last
    /// one, and none creates it later. May sleep.
    pub(crate) fn dpriv_or_create(self: &Arc<Self>) -> Option<&Pagemap> {
        if let Some(pm) = self.dpriv.as_ref() {
            return Some(pm);
        }
        if !self.maps_sysmem() {
            return None;
        }
        let mut failed = self.dpriv_failed.lock();
        // Created by the holder before us, or failed for good.
        if *failed || self.dpriv.as_ref().is_some() {
            return self.dpriv.as_ref();
        }
        match Pagemap::new(self.nr_frames) {
            Ok(pm) => {
                // SAFETY: no page of the new pagemap is out yet; the registration's reference
                // keeps the device alive until unregistration tore the pagemap down
                // (`gmem_dev_unregister`), which happens after every placing section.
                unsafe { pm.bind(Arc::as_ptr(self).cast()) };
                // The only creator (under the lock): it is stored.
                self.dpriv.populate(pm);
            }
            Err(e) => {
                pr_warn!("device {}: no device-private pages ({:?}): process memory stays on the host\n", self.id, e);
                *failed = true;
            }
        }
        self.dpriv.as_ref()
    }

    /// A placing section (see [`Device::placing`]'s field), if the device is alive.
    pub(crate) fn placing(&self) -> Option<srcu::Guard<'_>> {
        let g = self.placing.read_lock();
        self.alive().then_some(g)
    }

    /// Waits for every placing section that began while the device was alive.
    pub(crate) fn wait_placing(&self) {
        self.placing.synchronize();
    }

    /// The pagemap says the device-private page of `frame` went free (any context).
    pub(crate) fn note_released(&self, frame: u64) {
        let Some(w) = usize::try_from(frame / 64).ok().and_then(|i| self.released.get(i)) else { return };
        w.fetch_or(1 << (frame % 64), Ordering::AcqRel);
        self.released_n.fetch_add(1, Ordering::AcqRel);
    }

    /// Returns the frames of released device-private pages to the pool, 64 per acquisition
    /// of the pool lock ([`Device::commit_frames`]); returns how many.
    pub(crate) fn drain_released(&self) -> u64 {
        if self.released_n.load(Ordering::Acquire) == 0 {
            return 0;
        }
        let mut ops: KVec<FrameOp> = KVec::new();
        let mut n = 0u64;
        for (i, w) in self.released.iter().enumerate() {
            let mut bits = w.swap(0, Ordering::AcqRel);
            while bits != 0 {
                let b = u64::from(bits.trailing_zeros());
                bits &= bits - 1;
                // Frame numbers fit in 32 bits (checked at registration).
                let Ok(f) = u32::try_from(i as u64 * 64 + b) else { continue };
                n += 1;
                if ops.push(FrameOp::Free(f), GFP_KERNEL).is_err() {
                    // No memory for the batch: this one goes alone.
                    self.free_frame(f);
                }
            }
            if !ops.is_empty() {
                self.commit_frames(ops.iter_mut());
                // The charges (together) and owners it replaced go here, without the lock.
                dmem::give_back(ops.iter_mut().map(FrameOp::take_charge));
                ops.clear();
            }
        }
        self.released_n.fetch_sub(n, Ordering::AcqRel);
        n
    }

    /// Frames holding device-private pages of process memory.
    pub(crate) fn frames_sysmem(&self) -> u64 {
        self.pool().sysmem
    }

    /// Appends the frames marked `F_SYSMEM` to `out`.
    pub(crate) fn sysmem_frames(&self, out: &mut KVec<u64>) -> Result {
        let n = self.frames_sysmem() as usize;
        out.reserve(n, GFP_KERNEL)?;
        let pool = self.pool();
        for (f, fl) in pool.flags.iter().enumerate() {
            if fl & F_SYSMEM != 0 {
                // Within the reservation unless more were marked meanwhile: those wait.
                if out.push_within_capacity(f as u64).is_err() {
                    break;
                }
            }
        }
        Ok(())
    }

    /// Sets `set` in the flags of each of `frames` (one acquisition of the pool lock).
    pub(crate) fn set_flags_of(&self, frames: &[u32], set: u8) {
        if frames.is_empty() {
            return;
        }
        let mut pool = self.pool();
        let FramePool { flags, pinned, lent, sysmem, .. } = &mut *pool;
        for &frame in frames {
            if let Some(f) = flags.get_mut(frame as usize) {
                FramePool::recount([pinned, lent, sysmem], *f, *f | set);
                *f |= set;
            }
        }
    }

    /// False once unregistering started: no new work may be started on the device.
    pub(crate) fn alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    pub(crate) fn kill(&self) {
        self.alive.store(false, Ordering::Release);
    }

    /// The channel for the next copy call, round robin over `chans` (nonzero) channels,
    /// so that the calls of concurrent batches spread over them.
    pub(crate) fn next_channel(&self, chans: u32) -> u32 {
        // (`chans` is nonzero; were it not, channel 0 rather than a panic.)
        self.chan_rr.fetch_add(1, Ordering::Relaxed).checked_rem(chans).unwrap_or(0)
    }

    /// Records the link bandwidths the driver reported (MB/s, 0 unknown).
    pub(crate) fn set_links(&self, l: paths::Links) {
        for (slot, v) in self.links.iter().zip([l.h2d, l.d2h, l.d2d]) {
            slot.store(v, Ordering::Relaxed);
        }
    }

    /// The link bandwidths last reported (each read on its own: a concurrent report may
    /// mix old and new figures for a moment, which only skews one choice of path).
    pub(crate) fn links(&self) -> paths::Links {
        let g = |k: usize| self.links[k].load(Ordering::Relaxed);
        paths::Links { h2d: g(0), d2h: g(1), d2d: g(2) }
    }

    /// Whether the device's unregistration has marked it gone: its driver is called no
    /// more (`ops` refuses). Until then a device that is unregistering (no longer `alive`)
    /// may still be called.
    pub(crate) fn is_gone(&self) -> bool {
        self.gone.load(Ordering::Acquire)
    }

    /// Enters a callback section; `None` once the device is gone (the caller then skips the
    /// callback: the driver's state it would act on no longer exists).
    pub(crate) fn ops(&self) -> Option<Ops<'_>> {
        let section = self.callbacks.read_lock();
        if self.gone.load(Ordering::Acquire) {
            return None;
        }
        // INVARIANT: inside `section`, `gone` was false.
        Some(Ops { drv: &self.drv, _section: section })
    }

    /// Whether two devices are served by the same driver (peer copies need that).
    /// The driver takes 2 MiB entries (`GMEM_DEV_CAP_MAP_2M`).
    pub(crate) fn maps_2m(&self) -> bool {
        self.drv.maps_2m()
    }

    /// The driver can map ordinary process memory (it has `map_prepare`).
    pub(crate) fn maps_sysmem(&self) -> bool {
        self.drv.ops().map_prepare.is_some()
    }

    pub(crate) fn same_driver(&self, other: &Device) -> bool {
        self.drv.same_driver(&other.drv)
    }

    /// Creates the context of the space `space_id` and records it. Refused (`ENODEV`) once
    /// unregistration started.
    pub(crate) fn create_ctx(&self, space_id: u64) -> Result<Ctx> {
        let ops = self.ops().ok_or(ENODEV)?;
        // Checked inside the section: `quiesce` (after `kill`) waits for this section, and
        // finds the context in `ctxs` afterwards.
        if !self.alive() {
            return Err(ENODEV);
        }
        // Held across the creation, so that the reserved slot is still free for the push.
        let mut list = self.ctxs.lock();
        list.reserve(1, GFP_KERNEL)?;
        let c = ops.ctx_create()?;
        if list.push((space_id, c), GFP_NOWAIT).is_err() {
            // Cannot happen (room was reserved under this lock); never leak the context.
            drop(list);
            ops.ctx_destroy(c);
            return Err(ENOMEM);
        }
        Ok(c)
    }

    /// Destroys the context of the space `space_id` (the space is being freed). If
    /// unregistration got there first, it destroyed the context already.
    pub(crate) fn release_ctx(&self, space_id: u64) {
        let Some(ops) = self.ops() else { return };
        let taken = {
            let mut list = self.ctxs.lock();
            match list.iter().position(|(s, _)| *s == space_id) {
                Some(i) => list.remove(i).ok(),
                None => None,
            }
        };
        if let Some((_, c)) = taken {
            ops.ctx_destroy(c);
        }
    }

    /// Ends every use of the driver: refuses new callback sections, waits for the running
    /// ones, then destroys every remaining context. Returns the number destroyed.
    pub(crate) fn quiesce(&self) -> usize {
        self.kill();
        self.gone.store(true, Ordering::Release);
        self.callbacks.synchronize();
        let list = core::mem::take(&mut *self.ctxs.lock());
        for (_, c) in list.iter() {
            // No section can be running or start (`gone`), so this is the only caller.
            self.drv.ctx_destroy(*c);
        }
        list.len()
    }

    pub(crate) fn low(&self) -> u64 {
        self.low.load(Ordering::Relaxed)
    }

    pub(crate) fn high(&self) -> u64 {
        self.high.load(Ordering::Relaxed)
    }

    pub(crate) fn set_watermarks(&self, low: u64, high: u64) {
        self.low.store(low, Ordering::Relaxed);
        self.high.store(high, Ordering::Relaxed);
    }

    /// Frames that peers' eviction batches may still park here: what is free above the
    /// high watermark, less what other batches were promised and have not allocated yet
    /// (`policy::evict::park_room`).
    pub(crate) fn park_room(&self) -> u64 {
        order::park_room(self.frames_free(), self.high(), self.promised())
    }

    /// Frames promised to parking batches and not yet allocated by them.
    pub(crate) fn promised(&self) -> u64 {
        self.promised.load(Ordering::Acquire)
    }

    /// Promises up to `want` of [`Device::park_room`] to one eviction batch that parks pages
    /// here, until the promise is dropped (after the batch allocated its frames here, so
    /// that they count as used by then). Batches of several devices, or several batches of
    /// one, that plan at the same time so share the room above the reserve instead of
    /// each counting all of it. The lender's own allocations ignore promises: they win.
    pub(crate) fn promise_parking(&self, want: u64) -> Promise<'_> {
        // `frames_free` is read outside the exchange, which checks only `promised`: a batch
        // that allocated and gave its promise back meanwhile can leave this one counting
        // its frames free once, like an allocation of the lender's own right after.
        let mut seen = self.promised.load(Ordering::Acquire);
        loop {
            let n = core::cmp::min(want, order::park_room(self.frames_free(), self.high(), seen));
            if n == 0 {
                return Promise { dev: self, n: 0 };
            }
            // `n <= frames_free - seen`: the sum cannot wrap.
            match self.promised.compare_exchange_weak(seen, seen + n, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Promise { dev: self, n },
                Err(v) => seen = v,
            }
        }
    }

    /// The frame pool, locked; every acquisition is counted (`locks: pool=` in debugfs).
    fn pool(&self) -> PoolGuard<'_> {
        DevStats::add(&self.stats.pool_locks, 1);
        PoolGuard { g: self.frames.lock(), hint: &self.used_hint }
    }

    /// Free frames as of the last release of the pool lock, without taking it: an estimate
    /// (another task may allocate or free right after).
    pub(crate) fn frames_free_hint(&self) -> u64 {
        self.nr_frames.saturating_sub(self.used_hint.load(Ordering::Relaxed))
    }

    /// One free frame, or `ENOSPC` when the pool is exhausted (the caller may evict and
    /// retry). The frame starts used and referenced, with no owner yet, and uncharged: the
    /// executor allocates through `alloc_frames` / `alloc_placed` (KUnit uses this).
    pub(crate) fn alloc_frame(&self) -> Result<u32> {
        let mut pool = self.pool();
        let FramePool { bits, cursor, used, flags, .. } = &mut *pool;
        let mut map = FrameMap::new(bits, cursor, used, self.nr_frames).ok_or(EINVAL)?;
        let f = map.alloc().ok_or(ENOSPC)?;
        // A free frame's flags are 0 (every free clears them): no pinned/lent count moves.
        flags[f as usize] = F_USED | F_REF;
        u32::try_from(f).map_err(|_| EINVAL)
    }

    /// One frame per charge of `charges` (each frame takes one, the rest stay), chosen by
    /// `pick`, appended to `out` under one acquisition of the pool lock; returns how many
    /// (fewer when `pick` finds none). Each starts like `alloc_frame`'s.
    fn alloc_into(
        &self,
        charges: &mut KVec<Charge>,
        out: &mut KVec<u32>,
        mut pick: impl FnMut(&mut FrameMap<'_>) -> Option<u64>,
    ) -> Result<usize> {
        let want = charges.len();
        out.reserve(want, GFP_KERNEL)?;
        let mut pool = self.pool();
        let FramePool { bits, cursor, used, flags, charges: held, .. } = &mut *pool;
        let mut map = FrameMap::new(bits, cursor, used, self.nr_frames).ok_or(EINVAL)?;
        let mut got = 0;
        while got < want {
            let Some(f) = pick(&mut map) else { break };
            // A free frame's flags are 0 (every free clears them): no pinned/lent count moves.
            flags[f as usize] = F_USED | F_REF;
            // A free frame holds no charge (every free takes it), so nothing is replaced.
            if let (Some(slot), Some(c)) = (held.get_mut(f as usize), charges.pop()) {
                *slot = c;
            }
            // Frame numbers fit in 32 bits: `nr_frames <= u32::MAX` (checked at registration),
            // and the capacity was reserved above.
            out.push(f as u32, GFP_NOWAIT)?;
            got += 1;
        }
        Ok(got)
    }

    /// A free frame per charge of `charges` (each frame takes one) appended to `out` under
    /// one acquisition of the pool lock; returns how many (fewer when the pool runs out).
    /// Each starts like `alloc_frame`'s.
    pub(crate) fn alloc_frames(&self, charges: &mut KVec<Charge>, out: &mut KVec<u32>) -> Result<usize> {
        self.alloc_into(charges, out, |map| map.alloc())
    }

    /// Frames for pages at offsets `offs` (0..512, ascending) of one 2 MiB block, one per
    /// charge of `charges` (each frame takes one), appended to `out` under one acquisition
    /// of the pool lock: page `k` gets frame `base + k` of an
    /// aligned 512-frame chunk when that frame is free, any free frame otherwise. `base` is
    /// `hint` (where the block's other pages on this device are) or, without one, a wholly
    /// free chunk. A block whose pages all end up at `base + k` can be mapped with one
    /// 2 MiB entry. Returns how many (fewer when the pool runs out).
    pub(crate) fn alloc_placed(
        &self,
        hint: Option<u64>,
        offs: impl Iterator<Item = u64>,
        charges: &mut KVec<Charge>,
        out: &mut KVec<u32>,
    ) -> Result<usize> {
        let nr = self.nr_frames;
        let mut offs = offs.take(charges.len());
        // Chosen with the first frame, under the pool lock.
        let mut base: Option<Option<u64>> = None;
        self.alloc_into(charges, out, |map| {
            let k = offs.next()?;
            let b = *base.get_or_insert_with(|| {
                hint.filter(|b| b % CHUNK_FRAMES == 0 && b.saturating_add(CHUNK_FRAMES) <= nr)
                    .or_else(|| map.free_chunk())
            });
            let placed = b.and_then(|b| b.checked_add(k)).filter(|&f| k < CHUNK_FRAMES && map.alloc_at(f));
            placed.or_else(|| map.alloc())
        })
    }

    /// Which of the frames `frames` (each tagged with a bit index below 512) are still
    /// marked prefetched, as a bitmap, under one acquisition of the pool lock (none at all
    /// when `frames` is empty). The mark is cleared on the frames it reports: the caller
    /// settles each of them, once, even if the move it settles them for fails and is retried.
    pub(crate) fn take_prefetched(&self, frames: impl Iterator<Item = (usize, u32)>) -> BlockBits {
        let mut out: BlockBits = [0; 8];
        let mut frames = frames.peekable();
        if frames.peek().is_none() {
            return out;
        }
        let mut pool = self.pool();
        for (k, f) in frames {
            let Some(fl) = pool.flags.get_mut(f as usize) else { continue };
            if *fl & F_PREFETCHED != 0 {
                *fl &= !F_PREFETCHED;
                bits::set(&mut out, k);
            }
        }
        out
    }

    /// Returns a frame to the pool (and its charge to its cgroup). Returns its flags as
    /// they were (for accounting).
    pub(crate) fn free_frame(&self, frame: u32) -> u8 {
        let (old, fl, charge) = {
            let mut pool = self.pool();
            let FramePool { bits, cursor, used, flags, owner, charges, pinned, lent, sysmem, .. } = &mut *pool;
            let ok = FrameMap::new(bits, cursor, used, self.nr_frames).map(|mut m| m.free(u64::from(frame)).is_ok());
            if ok != Some(true) {
                pr_err!("device {}: bad frame free {}\n", self.id, frame);
                return 0;
            }
            let fl = core::mem::replace(&mut flags[frame as usize], 0);
            FramePool::recount([pinned, lent, sysmem], fl, 0);
            let charge = charges.get_mut(frame as usize).map(|c| core::mem::replace(c, Charge::NONE));
            (owner[frame as usize].take(), fl, charge)
        };
        // Dropped outside the lock: the last reference to a region may go here.
        drop(old);
        drop(charge);
        fl
    }

    /// A batch's frame bookkeeping under one acquisition of the pool lock, in order: a
    /// `Free` returns its frame to the pool, an `Own` records the frame's holder and flags
    /// (as [`Device::set_owner`]). The owners these replace are left in the ops (as
    /// `Dropped`), so that the caller drops them after the lock. Returns how many `Own`s
    /// with `settle` found their frame still marked prefetched (a prefetch that was used).
    pub(crate) fn commit_frames<'a>(&self, ops: impl Iterator<Item = &'a mut FrameOp>) -> u64 {
        let mut settled = 0;
        let mut pool = self.pool();
        let FramePool { bits, cursor, used, flags, owner, charges, pinned, lent, sysmem, .. } = &mut *pool;
        for op in ops {
            let (old, charge) = match op {
                FrameOp::Free(frame) => {
                    let f = *frame as usize;
                    let ok = FrameMap::new(bits, cursor, used, self.nr_frames).map(|mut m| m.free(f as u64).is_ok());
                    if ok != Some(true) {
                        pr_err!("device {}: bad frame free {}\n", self.id, f);
                        continue;
                    }
                    if let Some(fl) = flags.get_mut(f) {
                        FramePool::recount([pinned, lent, sysmem], *fl, 0);
                        *fl = 0;
                    }
                    let charge = charges.get_mut(f).map_or(Charge::NONE, |c| core::mem::replace(c, Charge::NONE));
                    (owner.get_mut(f).and_then(Option::take), charge)
                }
                FrameOp::Own { frame, who, set, keep, settle } => {
                    let f = *frame as usize;
                    let Some(fl) = flags.get_mut(f) else { continue };
                    if *settle && *fl & F_PREFETCHED != 0 {
                        settled += 1;
                    }
                    let new = (*fl & *keep) | *set | F_USED;
                    FramePool::recount([pinned, lent, sysmem], *fl, new);
                    *fl = new;
                    let old = match (owner.get_mut(f), who.take()) {
                        (Some(slot), Some(w)) => slot.replace(w),
                        _ => None,
                    };
                    (old, Charge::NONE)
                }
                FrameOp::Dropped(..) => continue,
            };
            *op = FrameOp::Dropped(old, charge);
        }
        settled
    }

    /// The device used the pages of `marked` and `unmarked` (accessed bits seen): a pending
    /// prefetch of one counts as used, and those of `marked` get a second chance (marked
    /// referenced). One acquisition of the pool lock (none for no frame).
    pub(crate) fn note_used(&self, marked: &[u32], unmarked: &[u32]) {
        if marked.is_empty() && unmarked.is_empty() {
            return;
        }
        let mut prefetched = 0;
        {
            let mut pool = self.pool();
            let frames = Iterator::chain(marked.iter().map(|&f| (f, F_REF)), unmarked.iter().map(|&f| (f, 0)));
            for (frame, referenced) in frames {
                if let Some(f) = pool.flags.get_mut(frame as usize) {
                    prefetched += u64::from(*f & F_PREFETCHED != 0);
                    *f = (*f | referenced) & !F_PREFETCHED;
                }
            }
        }
        // One page at a time, as the accuracy estimate wants (it caps each update).
        self.settle_prefetched((0..prefetched).map(|_| true));
    }

    /// Counts prefetched pages that settled: `used` by the device, `wasted` (evicted or
    /// moved away untouched); the counters, the accuracy estimate and its clock.
    pub(crate) fn note_prefetch(&self, used: u64, wasted: u64) {
        if self.settle(used, wasted) {
            self.prefetch_settled_at(crate::obj::sched::now_ns());
        }
    }

    /// [`Device::note_prefetch`] page by page (`true`: used), in order, reading the clock
    /// once.
    pub(crate) fn settle_prefetched(&self, pages: impl Iterator<Item = bool>) {
        let mut any = false;
        for used in pages {
            any |= self.settle(u64::from(used), u64::from(!used));
        }
        if any {
            self.prefetch_settled_at(crate::obj::sched::now_ns());
        }
    }

    /// The counters and the estimate of `note_prefetch`; whether anything settled.
    fn settle(&self, used: u64, wasted: u64) -> bool {
        if used == 0 && wasted == 0 {
            return false;
        }
        DevStats::add(&self.stats.prefetch_used, used);
        DevStats::add(&self.stats.prefetch_wasted, wasted);
        // The closure always returns `Some`: the update cannot fail.
        let _ = self
            .prefetch_accuracy
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| Some(Accuracy(v).settle(used, wasted).0));
        true
    }

    /// When the accuracy estimate last moved, or a probe restarted its clock
    /// (`sched::now_ns` time; 0 if never): `policy::prefetch::resident_pages`.
    pub(crate) fn prefetch_settled_ns(&self) -> u64 {
        self.prefetch_settled_ns.load(Ordering::Relaxed)
    }

    /// Restarts the estimate's clock at `now` (a settled page, or a probe).
    pub(crate) fn prefetch_settled_at(&self, now: u64) {
        self.prefetch_settled_ns.store(now, Ordering::Relaxed);
    }

    /// Whether prefetch has paid on this device lately (at least half of the pages it
    /// prefetched were used): eviction spares untouched prefetched pages, and read-ahead
    /// evicts to make room, only then. A random workload whose density prefetch and
    /// read-ahead mostly miss would otherwise keep its misses and evict for more of them.
    pub(crate) fn prefetch_pays(&self) -> bool {
        Accuracy(self.prefetch_accuracy.load(Ordering::Relaxed)).pays()
    }

    /// The running prefetch accuracy estimate, in percent (debugfs).
    pub(crate) fn prefetch_accuracy_pct(&self) -> u32 {
        Accuracy(self.prefetch_accuracy.load(Ordering::Relaxed)).percent()
    }

    /// A region's identity for [`Stream::of`] (compared only, never dereferenced).
    pub(crate) fn stream_id(r: &Arc<Region>) -> usize {
        Arc::as_ptr(r) as usize
    }

    /// The stream the device follows in `r`, if any.
    fn stream_in(&self, r: &Arc<Region>) -> Option<&Stream> {
        let id = Self::stream_id(r);
        self.streams.iter().find(|s| s.of.load(Ordering::Relaxed) == id)
    }

    /// The stream a fault in `r` asks read-ahead of: the one in `r`, else a free one, else
    /// the one whose reader asked longest ago (`policy::prefetch::pick_stream`). Read
    /// without a lock: two faults in a new region at once may take two streams, or one
    /// fault's stream be taken over by another's at once; read-ahead is a hint, and a
    /// chain goes on only while its stream names its region (`readahead::hand_on`).
    pub(crate) fn stream_for(&self, r: &Arc<Region>) -> usize {
        let mut seen = [(0usize, 0u64); STREAMS];
        for (v, s) in seen.iter_mut().zip(self.streams.iter()) {
            *v = (s.of.load(Ordering::Relaxed), s.asked_ns.load(Ordering::Relaxed));
        }
        pick_stream(&seen, Self::stream_id(r)).unwrap_or(0)
    }

    /// Whether the block at `block_va` of `r` lies in the read-ahead window of the device's
    /// stream in `r`: between the block its reader last read in (`Stream::at`) and its
    /// chain's front (`Stream::ahead_to`), a window of at most `max_frames` pages, unless
    /// the reader is taken to move down (`Stream::downs`). Read ahead and about to be used;
    /// above a reader moving down lies what it has read.
    pub(crate) fn ahead_of_reader(&self, r: &Arc<Region>, block_va: usize, max_frames: u64) -> bool {
        self.stream_in(r).is_some_and(|s| {
            let (at, to) = (s.at.load(Ordering::Relaxed), s.ahead_to.load(Ordering::Relaxed));
            let pages = (to.saturating_sub(at) / BLOCK_BYTES).saturating_mul(BLOCK_PAGES);
            !s.moving_down() && (at..to).contains(&block_va) && pages as u64 <= max_frames
        })
    }

    /// Whether the device's stream in `r` has gone past the block at `block_va`: a chain
    /// reads ahead in `r`, its reader's last fault that asked for read-ahead is still
    /// fresh (came less than [`STREAM_FRESH_NS`] ago, or four of the stream's gaps between
    /// blocks: `Stream::age`), and its block (`Stream::at`) lies at least two blocks further
    /// on (the block right behind the reader's may still be read, as a stencil's halo is),
    /// and the reader is not taken to move down (`Stream::downs`):
    /// `policy::prefetch::behind_stream`. A device streaming upwards reaches such a block
    /// again, if at all, only after every block in front of it. The fields are read one by
    /// one without a lock (a fault may move them meanwhile, even to another region; the
    /// heading is stored after the reader's block): the answer is a policy hint, wrong at
    /// worst for one eviction batch.
    pub(crate) fn behind_reader(&self, r: &Arc<Region>, block_va: usize) -> bool {
        self.stream_view(r, block_va).is_some_and(|v| behind_stream(v.block, v.at, v.to, v.age_ns, v.fresh_ns, v.down))
    }

    /// The block of the reader of the device's stream in `r` (its number: address / 2 MiB),
    /// if the block at `block_va` lies in front of it, the stream is live and its reader is
    /// not taken to move down (`policy::prefetch::ahead_of_stream`, on the same fields and
    /// with the same caveat as [`Device::behind_reader`]).
    pub(crate) fn reader_before(&self, r: &Arc<Region>, block_va: usize) -> Option<usize> {
        let v = self.stream_view(r, block_va)?;
        ahead_of_stream(v.block, v.at, v.to, v.age_ns, v.fresh_ns, v.down).then_some(v.at)
    }

    /// The device's stream in `r`, if it has one, as its verdicts on the block at
    /// `block_va` see it.
    fn stream_view(&self, r: &Arc<Region>, block_va: usize) -> Option<StreamView> {
        let s = self.stream_in(r)?;
        let (at, to) = (s.at.load(Ordering::Relaxed), s.ahead_to.load(Ordering::Relaxed));
        let (age_ns, fresh_ns) = s.age();
        Some(StreamView {
            block: block_va / BLOCK_BYTES,
            at: at / BLOCK_BYTES,
            to: to / BLOCK_BYTES,
            age_ns,
            fresh_ns,
            down: s.moving_down(),
        })
    }

    /// `r` is being torn down: no stream the device follows is in it any more. (A later
    /// `Region` allocated at the same address must not inherit its reader.)
    /// Called after `r` was marked dead; the fence pairs with the one in
    /// `readahead::start_chain`, which names the region and then checks that it is not
    /// dead (a store then a load on each side, which may otherwise pass each other).
    pub(crate) fn forget_stream(&self, r: &Arc<Region>) {
        core::sync::atomic::fence(Ordering::SeqCst);
        let id = Self::stream_id(r);
        for s in &self.streams {
            let _ = s.of.compare_exchange(id, 0, Ordering::Relaxed, Ordering::Relaxed);
        }
    }

    pub(crate) fn set_flags(&self, frame: u32, set: u8) {
        self.set_flags_of(&[frame], set);
    }

    /// The flags of `frames` into `out` (one slot each, in order), under one acquisition of
    /// the pool lock (none for no slot). With `evictable: Some(limit)`, `None` for a frame
    /// that may not go in an eviction for `limit` (its charge lies outside that pool) or,
    /// without one, for the full device (its cgroup's `dmem.min` protects it).
    pub(crate) fn flags_of(
        &self,
        frames: impl Iterator<Item = u32>,
        evictable: Option<Option<&Limit>>,
        out: &mut [Option<u8>],
    ) {
        if out.is_empty() {
            return;
        }
        let pool = self.pool();
        for (f, o) in frames.zip(out.iter_mut()) {
            let ok = evictable.is_none_or(|l| pool.charges.get(f as usize).is_some_and(|c| eligible(c, l, true)));
            *o = if ok { Some(pool.flags.get(f as usize).copied().unwrap_or(0)) } else { None };
        }
    }

    /// Up to `n` victims in replacement order, with who holds them: with a `limit`, only
    /// frames charged within that cgroup pool and not protected in it; without one (the
    /// device is full), only frames their cgroups' `dmem.min` does not protect. Either way
    /// `dmem.low` protects too, unless `ignore_low`.
    /// Frames of process memory (`F_SYSMEM`) come with no owner. Frames in transit (handed
    /// to a batch that has not committed yet: used, but no owner) cannot be taken; the
    /// second value counts those the hand chose.
    pub(crate) fn victims(&self, n: usize, limit: Option<&Limit>, ignore_low: bool) -> Result<(Victims, usize)> {
        let mut picked = [0u64; 64];
        let n = n.min(picked.len());
        let mut pool = self.pool();
        let FramePool { flags, hand, owner, charges, lent, .. } = &mut *pool;
        // Frames of one pool share the answer: the last one is remembered.
        let mut last: Option<(usize, bool)> = None;
        let mut test = |f: usize| {
            let Some(c) = charges.get(f) else { return false };
            if let Some((g, yes)) = last {
                if charges.get(g).is_some_and(|cg| Limit::same(cg, c)) {
                    return yes;
                }
            }
            let yes = eligible(c, limit, ignore_low);
            last = Some((f, yes));
            yes
        };
        // `lent` counts the `F_LENT` frames exactly (`FramePool::recount` on every change).
        let k = Clock::with_lent(flags, hand, *lent).select_where(&mut picked[..n], &mut test);
        let mut out = KVec::with_capacity(k, GFP_KERNEL)?;
        let mut in_transit = 0;
        for &f in &picked[..k] {
            match owner.get(f as usize).and_then(|o| o.clone()) {
                Some(o) => out.push((f as u32, Some(o)), GFP_KERNEL)?,
                None if flags.get(f as usize).is_some_and(|fl| fl & F_SYSMEM != 0) => {
                    out.push((f as u32, None), GFP_KERNEL)?
                }
                None => in_transit += 1,
            }
        }
        Ok((out, in_transit))
    }

    /// Frames holding victims parked here by peers that still need a host copy.
    pub(crate) fn lent_dirty(&self, n: usize) -> Result<KVec<(u32, Owner)>> {
        let pool = self.pool();
        let mut out = KVec::new();
        for (f, fl) in pool.flags.iter().enumerate() {
            if out.len() >= n {
                break;
            }
            if fl & (F_USED | F_LENT | F_CLEAN) == F_USED | F_LENT {
                if let Some(o) = pool.owner[f].clone() {
                    out.push((f as u32, o), GFP_KERNEL)?;
                }
            }
        }
        Ok(out)
    }

    pub(crate) fn frames_used(&self) -> u64 {
        self.pool().used
    }

    pub(crate) fn frames_free(&self) -> u64 {
        self.nr_frames - self.frames_used()
    }

    /// Frames pinned on the device.
    pub(crate) fn frames_pinned(&self) -> u64 {
        self.pool().pinned
    }

    /// Frames parked here by peers.
    pub(crate) fn frames_lent(&self) -> u64 {
        self.pool().lent
    }
}

/// Frames of a lender promised to one eviction batch for parking ([`Device::promise_parking`]);
/// given back when dropped, or in part by [`Promise::keep`].
///
/// # Invariants
/// `n` frames of `dev.promised` are this promise's.
pub(crate) struct Promise<'a> {
    dev: &'a Device,
    n: u64,
}

impl Promise<'_> {
    /// Frames promised.
    pub(crate) fn n(&self) -> u64 {
        self.n
    }

    /// Keeps `k` of the frames promised (at most all of them) and gives the others back.
    pub(crate) fn keep(&mut self, k: u64) {
        let back = self.n.saturating_sub(k);
        // INVARIANT: `back <= n` of ours leave `promised` with us.
        self.dev.promised.fetch_sub(back, Ordering::AcqRel);
        self.n -= back;
    }
}

impl Drop for Promise<'_> {
    fn drop(&mut self) {
        self.keep(0);
    }
}

/// Whether a frame holding `charge` may be evicted for `limit` (see [`Device::victims`]).
fn eligible(charge: &Charge, limit: Option<&Limit>, ignore_low: bool) -> bool {
    match limit {
        Some(l) => l.covers(charge, ignore_low),
        None => !charge.protected(ignore_low),
    }
}

/// Queues the background worker if the device is below its low watermark.
pub(crate) fn kick(dev: &Arc<Device>) {
    if crate::obj::tune::PREEVICT.load(Ordering::Relaxed) && dev.frames_free() < dev.low() {
        kick_always(dev);
    }
}

/// Queues the background worker unconditionally (write-back of parked victims).
pub(crate) fn kick_always(dev: &Arc<Device>) {
    if dev.alive() {
        if let Some(q) = crate::obj::wq::get() {
            // Already queued is fine: one run serves every request.
            let _ = q.enqueue(dev.clone());
        }
    }
}
