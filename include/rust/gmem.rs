// SPDX-License-Identifier: GPL-2.0
//! Safe Rust binding of the GMEM driver API (`include/linux/gmem.h`).
//!
//! Rust symbols cannot cross out-of-tree modules, so a Rust driver compiles this file in as
//! a module of its own crate:
//!
//! ```ignore
//! #[path = "../include/rust/gmem.rs"]
//! mod gmem;
//! ```
//!
//! A driver implements [`Driver`] (a `#[vtable]` trait: typed, safe callbacks, the optional
//! ones left out) for its per-device data, creates a [`Registration`] (registered on
//! creation, unplugged on drop), and runs device work inside a [`Session`]: the one place
//! where it may look up its context for an address space and report faults. Every `unsafe`
//! of the driver API is in this file; a driver built on it needs none for gmem.
//!
//! # Lifetimes
//! - The per-device data `T` is an `Arc<T>`; the registration holds a reference in a boxed
//!   `DrvCell` whose address is gmem's `drv` pointer, so every callback finds it alive: gmem
//!   makes no callback after `gmem_dev_unregister` returns, which happens before the
//!   registration drops the cell. Leaking a registration (`mem::forget`, a reference
//!   cycle) would leave the device registered after the module is gone: don't.
//! - A context (`T::Context`) is boxed by [`Driver::ctx_create`] and given back to
//!   [`Driver::ctx_destroy`]; gmem destroys it when its space dies or the device is
//!   unregistered. A [`Session`] holds a [`Space`] reference (the space cannot die) and
//!   blocks [`Registration::unplug`] (the device cannot be unregistered), so the context it
//!   hands out lives as long as the session.
//! - The gmem device handle is used only while the registration is live and not unplugged:
//!   [`Registration::unplug`] first refuses new sessions, waits for the open ones, and only
//!   then unregisters (this is the quiescing gmem asks of drivers before unregistration).
//!
//! # Lock order
//! `Gate::state` is a leaf: it is never held across a call into gmem or into the driver
//! (`unplug` drops it around `gmem_dev_unregister`). `unplug` must not be called by a
//! thread that has a session of the same registration open (it would wait for itself).
#![allow(dead_code, unreachable_pub)]

/// The `#[repr(C)]` mirror of `include/linux/gmem.h` (shared with gmem.ko, which checks
/// its layout against the C compiler's at load time).
#[path = "gmem_abi.rs"]
pub mod abi;

use abi::*;
use core::{
    any::TypeId,
    marker::PhantomData,
    ptr::NonNull,
    sync::atomic::{AtomicBool, Ordering},
};
use kernel::{
    bindings,
    error::{from_err_ptr, to_result, VTABLE_DEFAULT_ERROR},
    ffi::{c_int, c_void},
    new_condvar, new_mutex,
    prelude::*,
    sync::{Arc, CondVar, Mutex},
};

/// Bytes of a device page (and of a frame).
pub const PAGE_SIZE: u64 = 4096;
/// Pages under one 2 MiB entry.
pub const HUGE_PAGES: u64 = 512;

/// A frame of the device's own memory pool: an index in `0..nr_frames`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Frame(u64);

impl Frame {
    /// The frame's index in the pool.
    pub fn index(self) -> u64 {
        self.0
    }
}

/// A host page gmem hands to the driver: the source or destination of a copy, or the
/// target of a remote mapping.
///
/// # Invariants
/// Points to a `struct page`. gmem keeps it allocated for the duration of a copy call, and
/// for a mapped page until the `unmap` covering its address returned; touching its memory
/// is the driver's business (and its own `unsafe`, within those bounds).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct HostPage(NonNull<bindings::page>);

impl HostPage {
    fn new(p: *mut bindings::page) -> Option<Self> {
        NonNull::new(p).map(HostPage)
    }

    /// The `struct page` pointer.
    pub fn as_ptr(self) -> *mut bindings::page {
        self.0.as_ptr()
    }
}

// SAFETY: a page pointer is a plain token; gmem lends the page to whichever thread runs the
// callback, and every access to the page's memory is the driver's own (documented) duty.
unsafe impl Send for HostPage {}
// SAFETY: as above; `HostPage` itself is immutable.
unsafe impl Sync for HostPage {}

/// What a page-table entry maps.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Target {
    /// One frame of the device's pool.
    Frame(Frame),
    /// 512 frames from this one (a multiple of 512), mapping the 2 MiB at the entry's
    /// address (2 MiB aligned). Only sent to drivers that set [`Options::map_2m`].
    Huge(Frame),
    /// A host page, mapped remotely (device accesses go over the link).
    Host(HostPage),
}

/// One entry gmem asks the driver to install (`struct gmem_pte`, checked).
///
/// # Invariants
/// The flags hold no unknown bit; a `GMEM_PTE_2M` entry has no host page, a 2 MiB-aligned
/// address and a frame that is a multiple of 512; a `GMEM_PTE_SYSMEM` entry is not
/// `GMEM_PTE_2M` (checked by the `map` trampoline before the driver sees the entry).
#[repr(transparent)]
pub struct Pte(GmemPte);

impl Pte {
    /// The device virtual address (page aligned).
    pub fn va(&self) -> u64 {
        self.0.va
    }

    /// Whether the device may write through the entry (else read only).
    pub fn writable(&self) -> bool {
        self.0.prot & GMEM_PROT_WRITE != 0
    }

    /// What the entry maps.
    pub fn target(&self) -> Target {
        match HostPage::new(self.0.host) {
            Some(h) => Target::Host(h),
            None if self.0.flags & GMEM_PTE_2M != 0 => Target::Huge(Frame(self.0.frame)),
            None => Target::Frame(Frame(self.0.frame)),
        }
    }

    /// Whether the entry maps ordinary process memory (`GMEM_PTE_SYSMEM`): a host page of
    /// the process, or a frame that a page of it migrated to. `map` is then called under
    /// gmem's MMU-notifier lock, which memory reclaim takes, and must not allocate with
    /// reclaim; it returns `EAGAIN` instead (see [`Driver::map_prepare`]).
    pub fn sysmem(&self) -> bool {
        self.0.flags & GMEM_PTE_SYSMEM != 0
    }

    /// Whether the raw entry keeps the invariants above.
    fn valid(p: &GmemPte) -> bool {
        if p.flags & !(GMEM_PTE_2M | GMEM_PTE_SYSMEM) != 0 {
            return false;
        }
        if p.flags & GMEM_PTE_SYSMEM != 0 && p.flags & GMEM_PTE_2M != 0 {
            return false;
        }
        p.flags & GMEM_PTE_2M == 0
            || (p.host.is_null() && p.va % (HUGE_PAGES * PAGE_SIZE) == 0 && p.frame % HUGE_PAGES == 0)
    }
}

/// One page of a host-to-device or device-to-host copy.
///
/// # Invariants
/// `host` is not null (checked by the `copy` trampoline).
#[repr(transparent)]
pub struct HostCopy(GmemCopy);

impl HostCopy {
    /// The host page (source of an upload, destination of a download).
    pub fn host(&self) -> HostPage {
        // SAFETY: non-null by the type invariant.
        HostPage(unsafe { NonNull::new_unchecked(self.0.host) })
    }

    /// The frame of this device.
    pub fn frame(&self) -> Frame {
        Frame(self.0.frame)
    }
}

/// One page of a device-to-peer or zero-fill copy.
#[repr(transparent)]
pub struct FrameCopy(GmemCopy);

impl FrameCopy {
    /// The frame of this device (source of a peer copy, target of a zero fill).
    pub fn frame(&self) -> Frame {
        Frame(self.0.frame)
    }

    /// The destination frame on the peer device (peer copies only).
    pub fn peer_frame(&self) -> Frame {
        Frame(self.0.peer_frame)
    }
}

/// A batch of page copies gmem asks of the copy engine. Every page of a batch moves in the
/// same direction; gmem owns the pages involved for the duration of the call.
pub enum CopyJob<'a, T> {
    /// Host page to frame.
    ToDevice(&'a [HostCopy]),
    /// Frame to host page.
    ToHost(&'a [HostCopy]),
    /// Frame to a frame of `peer`, another device of the same driver.
    ToPeer(&'a T, &'a [FrameCopy]),
    /// Zero-fill frames.
    Zero(&'a [FrameCopy]),
}

/// An asynchronous copy gmem started on one of the device's channels
/// ([`Driver::copy_async`]). The driver runs it (on the channel's engine or worker), then
/// ends it with [`Submission::complete`]; one dropped without completing completes with
/// `EIO`. Until then gmem keeps every page and frame it names, and maps none of them.
///
/// # Invariants
/// `fence` is the live fence of a copy gmem handed over and that is not signalled yet; it
/// is signalled exactly once, when the submission is completed or dropped. Until then
/// `entries` holds `n` (> 0) entries that form a well-formed batch of direction `dir`
/// ([`Adapter::job`] accepted it), and they, the pages and frames they name and a peer
/// `drv` stay valid (gmem's contract for accepted copies).
pub struct Submission<T: Driver> {
    dir: u32,
    entries: *const GmemCopy,
    n: u32,
    peer: *mut c_void,
    fence: NonNull<GmemFenceHandle>,
    _t: PhantomData<fn() -> T>,
}

// SAFETY: what the pointers name is valid from any thread until the fence is signalled,
// and `gmem_fence_signal` may be called from any context.
unsafe impl<T: Driver> Send for Submission<T> {}

impl<T: Driver> Submission<T> {
    /// The copies to make.
    pub fn job(&self) -> CopyJob<'_, T> {
        // SAFETY: valid and well-formed until the fence is signalled, which consumes
        // `self` (type invariant).
        let job = unsafe { Adapter::<T>::job(self.dir, self.entries, self.n, self.peer) };
        // Checked well-formed at submission (type invariant): never `None`.
        job.unwrap_or(CopyJob::Zero(&[]))
    }

    /// Pages in the batch.
    pub fn len(&self) -> usize {
        self.n as usize
    }

    /// Tells gmem that the copy is expected to complete `left` from now, so that a waiter
    /// polls the channel ([`Driver::copy_poll`]) from shortly before then instead of
    /// sleeping until the completion wakes it. An estimate is enough.
    pub fn expect_in(&self, left: kernel::time::Delta) {
        // SAFETY: reads the monotonic clock; any context.
        let now = unsafe { bindings::ktime_get() };
        let at = now.saturating_add(left.as_nanos().max(0));
        // SAFETY: the live, unsignalled fence (type invariant).
        unsafe { gmem_fence_expect(self.fence.as_ptr(), at.max(0) as u64) };
    }

    /// Ends the copy: `Ok` once every page is at its destination (the driver no longer
    /// touches any of them), or the error that stopped it.
    pub fn complete(self, r: Result) {
        let err = match r {
            Ok(()) => 0,
            Err(e) => e.to_errno(),
        };
        let fence = self.fence;
        core::mem::forget(self);
        // SAFETY: the live, unsignalled fence (type invariant), signalled once: `self` is
        // forgotten, so `drop` does not signal it again.
        unsafe { gmem_fence_signal(fence.as_ptr(), err) };
    }
}

impl<T: Driver> Drop for Submission<T> {
    fn drop(&mut self) {
        // SAFETY: as in `complete`; this is the one signal.
        unsafe { gmem_fence_signal(self.fence.as_ptr(), EIO.to_errno()) };
    }
}

/// Kind of a device access, as reported in a fault.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Access {
    /// The device read.
    Read,
    /// The device wrote (a read-only mapping is not enough).
    Write,
}

/// The callbacks of a GMEM device. See Documentation/driver-api.rst for the exact contract
/// of each (context, may sleep, what must hold on return). In short: every callback may
/// sleep, none is called with a spinlock held, and none may call back into gmem.
#[vtable]
pub trait Driver: Send + Sync + Sized + 'static {
    /// A device page table: one per address space that used the device.
    type Context: Send + Sync;

    /// Creates the page table of one address space.
    fn ctx_create(&self) -> Result<Pin<KBox<Self::Context>>>;

    /// Destroys a context. No other callback uses it any more. The default drops it.
    fn ctx_destroy(&self, ctx: Pin<KBox<Self::Context>>) {
        drop(ctx)
    }

    /// Installs `ptes` (which replace what their addresses had). May fail only with
    /// `ENOMEM`, or `EINVAL` for an entry the device cannot map; entries installed before
    /// the failure may stay. A call whose entries are [`Pte::sysmem`] must not allocate
    /// memory that may reclaim: it fails with `EAGAIN` when it would need some.
    fn map(&self, ctx: &Self::Context, ptes: &[Pte]) -> Result;

    /// Optional: makes a later [`Driver::map`] of `sysmem` entries in the `npages` pages
    /// from `va` allocation-free (allocates what it will need, with reclaim allowed). A
    /// device without it gets no access to process memory outside GMEM regions.
    fn map_prepare(&self, _ctx: &Self::Context, _va: u64, _npages: u64) -> Result {
        build_error!(VTABLE_DEFAULT_ERROR)
    }

    /// Removes the entries of `npages` pages from `va`; unmapped pages are ignored. A 2 MiB
    /// entry the range covers in part is split (the rest stays mapped). Cannot fail.
    fn unmap(&self, ctx: &Self::Context, va: u64, npages: u64);

    /// Makes earlier unmaps of the range visible to the device (flushes its TLBs).
    fn tlb_invalidate(&self, ctx: &Self::Context, va: u64, npages: u64);

    /// Runs a batch of copies; returns when they are complete.
    fn copy(&self, job: CopyJob<'_, Self>) -> Result;

    /// Optional: starts a batch of copies on copy channel `channel` (below
    /// [`Options::channels`]) and returns at once; the driver ends it with
    /// [`Submission::complete`] when the data is at its destination or the copy failed.
    /// gmem calls it instead of [`Driver::copy`] when the device declared channels.
    fn copy_async(_this: &Arc<Self>, _channel: u32, _sub: Submission<Self>) {
        build_error!(VTABLE_DEFAULT_ERROR)
    }

    /// Optional: completes now, from the caller's thread, every copy of channel `channel`
    /// whose data is at its destination and which the driver would otherwise complete
    /// later (from its completion interrupt); copies still running are left alone. gmem
    /// calls it while it waits for a copy whose submission said when it is expected to
    /// complete ([`Submission::expect_in`]), from shortly before then. Must not sleep.
    fn copy_poll(&self, _channel: u32) {
        build_error!(VTABLE_DEFAULT_ERROR)
    }

    /// Optional: the host-visible page behind a frame, which the CPU may then map
    /// remotely. The page is borrowed from the device's data, which lives until the device
    /// is unregistered, so it stays valid as long as gmem may use it. (Reserved: this
    /// version of the core does not call it.)
    fn frame_page(&self, _frame: Frame) -> Option<&kernel::page::Page> {
        build_error!(VTABLE_DEFAULT_ERROR)
    }

    /// Optional: tests and clears the device's accessed bit of the page at `va`.
    fn test_clear_accessed(&self, _ctx: &Self::Context, _va: u64) -> bool {
        build_error!(VTABLE_DEFAULT_ERROR)
    }

    /// Optional: the same for the pages from `va` that `bits` selects (bit k: page k, the
    /// page at `va + k * 4096`; `bits` has a bit for each of the up to 512 pages): each
    /// selected page's accessed bit is tested and cleared, and on return bit k is set if
    /// and only if page k was selected and touched. gmem prefers it to
    /// [`Driver::test_clear_accessed`]: one or two calls per 2 MiB block.
    fn test_clear_accessed_range(&self, _ctx: &Self::Context, _va: u64, _bits: &mut [u64]) {
        build_error!(VTABLE_DEFAULT_ERROR)
    }
}

/// What gmem's `drv` pointer points at: the driver's data, tagged with its type. gmem tells
/// drivers apart by the address of their ops table, and Rust does not promise distinct
/// addresses for the constant tables of two driver types, so a peer copy checks the tag
/// before it treats the peer's `drv` as a `T`.
///
/// # Invariants
/// `type_id` is `TypeId::of::<T>()`, and it is the first field (`repr(C)`): it can be read
/// through a `DrvCell` of any type.
#[repr(C)]
struct DrvCell<T> {
    type_id: TypeId,
    data: Arc<T>,
}

/// The C vtable of a `Driver` and its trampolines.
struct Adapter<T>(PhantomData<T>);

impl<T: Driver> Adapter<T> {
    /// One table per driver type: gmem tells drivers apart by this address (peer copies
    /// are offered only between devices with the same table).
    const OPS: GmemDevOps = GmemDevOps {
        ctx_create: Some(Self::ctx_create),
        ctx_destroy: Some(Self::ctx_destroy),
        map: Some(Self::map),
        unmap: Some(Self::unmap),
        tlb_invalidate: Some(Self::tlb_invalidate),
        copy: Some(Self::copy),
        frame_page: if T::HAS_FRAME_PAGE { Some(Self::frame_page) } else { None },
        test_clear_accessed: if T::HAS_TEST_CLEAR_ACCESSED { Some(Self::test_clear_accessed) } else { None },
        copy_async: if T::HAS_COPY_ASYNC { Some(Self::copy_async) } else { None },
        map_prepare: if T::HAS_MAP_PREPARE { Some(Self::map_prepare) } else { None },
        test_clear_accessed_range: if T::HAS_TEST_CLEAR_ACCESSED_RANGE {
            Some(Self::test_clear_accessed_range)
        } else {
            None
        },
        copy_poll: if T::HAS_COPY_POLL { Some(Self::copy_poll) } else { None },
    };
    /// The table as a `'static` reference (the constant is promoted; the compiler checks).
    const OPS_REF: &'static GmemDevOps = &Self::OPS;

    /// # Safety
    /// `drv` must be the `drv` of a live registration of `T` (what gmem passes).
    unsafe fn data<'a>(drv: *mut c_void) -> &'a T {
        // SAFETY: the registration passed its `DrvCell<T>` and keeps it until after
        // `gmem_dev_unregister` returned (module doc).
        unsafe { &(*drv.cast::<DrvCell<T>>()).data }
    }

    /// # Safety
    /// As for [`Adapter::data`].
    unsafe fn data_arc<'a>(drv: *mut c_void) -> &'a Arc<T> {
        // SAFETY: as for `data`.
        unsafe { &(*drv.cast::<DrvCell<T>>()).data }
    }

    /// The peer of a peer copy, if it is a `T` (else `None`: refuse the copy).
    ///
    /// # Safety
    /// `peer` must be the `drv` of a live device registered with this table, which this
    /// binding made: a `DrvCell` of some driver type.
    unsafe fn peer<'a>(peer: *mut c_void) -> Option<&'a T> {
        // SAFETY: a `DrvCell` of any type starts with its `TypeId` (type invariant).
        let tid = unsafe { peer.cast::<TypeId>().read() };
        // SAFETY: the tag says the cell is a `DrvCell<T>`, alive as for `data`.
        (tid == TypeId::of::<T>()).then(|| unsafe { Self::data(peer) })
    }

    /// # Safety
    /// `ctx` must come from `ctx_create` of `T` and not be destroyed.
    unsafe fn context<'a>(ctx: *mut c_void) -> &'a T::Context {
        // SAFETY: `ctx_create` made it from a `KBox<T::Context>`, freed only by `ctx_destroy`.
        unsafe { &*ctx.cast::<T::Context>() }
    }

    /// `gmem_dev_ops.ctx_create` of `T`.
    ///
    /// # Safety
    /// Called by gmem only, as `include/linux/gmem.h` documents: `drv` is a live registration
    /// of `T`, a context argument is one of its live contexts, arrays hold `n` valid entries.
    unsafe extern "C" fn ctx_create(drv: *mut c_void, ctx: *mut *mut c_void) -> c_int {
        // SAFETY: gmem passes our `drv`.
        match unsafe { Self::data(drv) }.ctx_create() {
            Ok(c) => {
                // SAFETY: the context is never moved out of its box (`ctx_destroy` rebuilds
                // the pinned box). `ctx` is a valid out-pointer (driver API).
                unsafe { *ctx = KBox::into_raw(Pin::into_inner_unchecked(c)).cast() };
                0
            }
            Err(e) => e.to_errno(),
        }
    }

    /// `gmem_dev_ops.ctx_destroy` of `T`.
    ///
    /// # Safety
    /// Called by gmem only, as `include/linux/gmem.h` documents: `drv` is a live registration
    /// of `T`, a context argument is one of its live contexts, arrays hold `n` valid entries.
    unsafe extern "C" fn ctx_destroy(drv: *mut c_void, ctx: *mut c_void) {
        // SAFETY: `ctx` came from `ctx_create` as a pinned box and gmem destroys it once; it
        // was pinned, so it is given back pinned.
        let c = unsafe { Pin::new_unchecked(KBox::from_raw(ctx.cast::<T::Context>())) };
        // SAFETY: gmem passes our `drv`.
        unsafe { Self::data(drv) }.ctx_destroy(c)
    }

    /// `gmem_dev_ops.map` of `T`.
    ///
    /// # Safety
    /// Called by gmem only, as `include/linux/gmem.h` documents: `drv` is a live registration
    /// of `T`, a context argument is one of its live contexts, arrays hold `n` valid entries.
    unsafe extern "C" fn map(drv: *mut c_void, ctx: *mut c_void, ptes: *const GmemPte, n: u32) -> c_int {
        if ptes.is_null() || n == 0 {
            return if n == 0 { 0 } else { EINVAL.to_errno() };
        }
        // SAFETY: gmem passes `n` entries valid for the call.
        let raw = unsafe { core::slice::from_raw_parts(ptes, n as usize) };
        if !raw.iter().all(Pte::valid) {
            return EINVAL.to_errno();
        }
        // SAFETY: `Pte` is a transparent wrapper of `GmemPte`, and every entry keeps its
        // invariants (checked just above).
        let typed = unsafe { core::slice::from_raw_parts(ptes.cast::<Pte>(), n as usize) };
        // SAFETY: gmem passes our `drv` and a live context of ours.
        let (d, c) = unsafe { (Self::data(drv), Self::context(ctx)) };
        match d.map(c, typed) {
            Ok(()) => 0,
            Err(e) => e.to_errno(),
        }
    }

    /// `gmem_dev_ops.map_prepare` of `T`.
    ///
    /// # Safety
    /// Called by gmem only, as `include/linux/gmem.h` documents: `drv` is a live registration
    /// of `T`, a context argument is one of its live contexts, arrays hold `n` valid entries.
    unsafe extern "C" fn map_prepare(drv: *mut c_void, ctx: *mut c_void, va: u64, npages: u64) -> c_int {
        // SAFETY: gmem passes our `drv` and a live context of ours.
        let (d, c) = unsafe { (Self::data(drv), Self::context(ctx)) };
        match d.map_prepare(c, va, npages) {
            Ok(()) => 0,
            Err(e) => e.to_errno(),
        }
    }

    /// `gmem_dev_ops.unmap` of `T`.
    ///
    /// # Safety
    /// Called by gmem only, as `include/linux/gmem.h` documents: `drv` is a live registration
    /// of `T`, a context argument is one of its live contexts, arrays hold `n` valid entries.
    unsafe extern "C" fn unmap(drv: *mut c_void, ctx: *mut c_void, va: u64, npages: u64) {
        // SAFETY: gmem passes our `drv` and a live context of ours.
        let (d, c) = unsafe { (Self::data(drv), Self::context(ctx)) };
        d.unmap(c, va, npages)
    }

    /// `gmem_dev_ops.tlb_invalidate` of `T`.
    ///
    /// # Safety
    /// Called by gmem only, as `include/linux/gmem.h` documents: `drv` is a live registration
    /// of `T`, a context argument is one of its live contexts, arrays hold `n` valid entries.
    unsafe extern "C" fn tlb_invalidate(drv: *mut c_void, ctx: *mut c_void, va: u64, npages: u64) {
        // SAFETY: gmem passes our `drv` and a live context of ours.
        let (d, c) = unsafe { (Self::data(drv), Self::context(ctx)) };
        d.tlb_invalidate(c, va, npages)
    }

    /// `gmem_dev_ops.copy` of `T`.
    ///
    /// # Safety
    /// Called by gmem only, as `include/linux/gmem.h` documents: `drv` is a live registration
    /// of `T`, a context argument is one of its live contexts, arrays hold `n` valid entries.
    unsafe extern "C" fn copy(drv: *mut c_void, dir: u32, c: *const GmemCopy, n: u32, peer: *mut c_void) -> c_int {
        if n == 0 {
            return 0;
        }
        // SAFETY: gmem passes `n` entries valid for the call, and for a peer copy the `drv`
        // of another live device whose callback section is held open for the whole copy.
        let Some(job) = (unsafe { Self::job(dir, c, n, peer) }) else { return EINVAL.to_errno() };
        // SAFETY: gmem passes our `drv`.
        match unsafe { Self::data(drv) }.copy(job) {
            Ok(()) => 0,
            Err(e) => e.to_errno(),
        }
    }

    /// The typed view of a copy batch; `None` if it is malformed (unknown direction, a
    /// missing host page, a peer that is not a `T`).
    ///
    /// # Safety
    /// `c` must be null or hold `n` entries, and `peer` be null or the `drv` of a live
    /// device registered with this table, all valid for `'a`.
    unsafe fn job<'a>(dir: u32, c: *const GmemCopy, n: u32, peer: *mut c_void) -> Option<CopyJob<'a, T>> {
        if c.is_null() {
            return None;
        }
        // SAFETY: `n` valid entries (the caller's contract).
        let raw = unsafe { core::slice::from_raw_parts(c, n as usize) };
        let host = || -> Option<&[HostCopy]> {
            // SAFETY: `HostCopy` is a transparent wrapper of `GmemCopy`; its invariant (a
            // host page in every entry) is checked first.
            raw.iter()
                .all(|e| !e.host.is_null())
                .then(|| unsafe { core::slice::from_raw_parts(c.cast::<HostCopy>(), raw.len()) })
        };
        // SAFETY: `FrameCopy` is a transparent wrapper of `GmemCopy` without invariants.
        let frames = unsafe { core::slice::from_raw_parts(c.cast::<FrameCopy>(), raw.len()) };
        match dir {
            GMEM_COPY_H2D => host().map(CopyJob::ToDevice),
            GMEM_COPY_D2H => host().map(CopyJob::ToHost),
            GMEM_COPY_ZERO => Some(CopyJob::Zero(frames)),
            // SAFETY: a live device of this table (the caller's contract).
            GMEM_COPY_D2D if !peer.is_null() => unsafe { Self::peer(peer) }.map(|p| CopyJob::ToPeer(p, frames)),
            _ => None,
        }
    }

    /// `gmem_dev_ops.copy_async` of `T`.
    ///
    /// # Safety
    /// Called by gmem only, as `include/linux/gmem.h` documents: `drv` is a live registration
    /// of `T`; `c` (`n` entries), what it names, a peer `drv` and `fence` stay valid until
    /// the fence is signalled.
    unsafe extern "C" fn copy_async(
        drv: *mut c_void,
        chan: u32,
        dir: u32,
        c: *const GmemCopy,
        n: u32,
        peer: *mut c_void,
        fence: *mut GmemFenceHandle,
    ) -> c_int {
        let Some(fence) = NonNull::new(fence) else { return EINVAL.to_errno() };
        // Checked now, so that the driver's worker only ever sees well-formed batches.
        // SAFETY: valid until the fence is signalled (gmem's contract), which is later.
        if n == 0 || unsafe { Self::job(dir, c, n, peer) }.is_none() {
            return EINVAL.to_errno();
        }
        // INVARIANT: an accepted copy's live fence and entries (returning 0 below accepts
        // it); the batch was checked well-formed just now.
        let sub = Submission { dir, entries: c, n, peer, fence, _t: PhantomData };
        // SAFETY: gmem passes our `drv`.
        T::copy_async(unsafe { Self::data_arc(drv) }, chan, sub);
        0
    }

    /// `gmem_dev_ops.copy_poll` of `T`.
    ///
    /// # Safety
    /// Called by gmem only, as `include/linux/gmem.h` documents: `drv` is a live registration
    /// of `T`.
    unsafe extern "C" fn copy_poll(drv: *mut c_void, chan: u32) {
        // SAFETY: gmem passes our `drv`.
        unsafe { Self::data(drv) }.copy_poll(chan)
    }

    /// `gmem_dev_ops.frame_page` of `T`.
    ///
    /// # Safety
    /// Called by gmem only, as `include/linux/gmem.h` documents: `drv` is a live registration
    /// of `T`, a context argument is one of its live contexts, arrays hold `n` valid entries.
    unsafe extern "C" fn frame_page(drv: *mut c_void, frame: u64) -> *mut bindings::page {
        // SAFETY: gmem passes our `drv`.
        unsafe { Self::data(drv) }.frame_page(Frame(frame)).map_or(core::ptr::null_mut(), |p| p.as_ptr())
    }

    /// `gmem_dev_ops.test_clear_accessed` of `T`.
    ///
    /// # Safety
    /// Called by gmem only, as `include/linux/gmem.h` documents: `drv` is a live registration
    /// of `T`, a context argument is one of its live contexts, arrays hold `n` valid entries.
    unsafe extern "C" fn test_clear_accessed(drv: *mut c_void, ctx: *mut c_void, va: u64) -> c_int {
        // SAFETY: gmem passes our `drv` and a live context of ours.
        let (d, c) = unsafe { (Self::data(drv), Self::context(ctx)) };
        c_int::from(d.test_clear_accessed(c, va))
    }

    /// `gmem_dev_ops.test_clear_accessed_range` of `T`.
    ///
    /// # Safety
    /// Called by gmem only, as `include/linux/gmem.h` documents: `drv` is a live registration
    /// of `T`, a context argument is one of its live contexts, `bits` holds
    /// `(npages + 63) / 64` words that nothing else accesses during the call.
    unsafe extern "C" fn test_clear_accessed_range(
        drv: *mut c_void,
        ctx: *mut c_void,
        va: u64,
        npages: u32,
        bits: *mut u64,
    ) -> c_int {
        if npages > MAX_RANGE_PAGES || bits.is_null() {
            return EINVAL.to_errno();
        }
        // SAFETY: gmem passes our `drv` and a live context of ours.
        let (d, c) = unsafe { (Self::data(drv), Self::context(ctx)) };
        // SAFETY: `bits` holds a word per 64 pages, exclusively ours during the call (see
        // above); at most 8 words (checked).
        let words = unsafe { core::slice::from_raw_parts_mut(bits, npages.div_ceil(64) as usize) };
        // Bits past `npages` in the last word select nothing.
        if let Some(last) = words.last_mut() {
            if npages % 64 != 0 {
                *last &= (1u64 << (npages % 64)) - 1;
            }
        }
        d.test_clear_accessed_range(c, va, words);
        0
    }
}

/// Most pages one `test_clear_accessed_range` call covers (a 2 MiB block).
const MAX_RANGE_PAGES: u32 = 512;

// The C functions of gmem.ko this binding wraps (`include/linux/gmem.h`).
extern "C" {
    fn gmem_dev_register(ops: *const GmemDevOps, props: *const GmemDevProps) -> *mut GmemDevHandle;
    fn gmem_dev_unregister(dev: *mut GmemDevHandle);
    fn gmem_dev_id(dev: *const GmemDevHandle) -> c_int;
    fn gmem_space_get_current() -> *mut GmemSpaceHandle;
    fn gmem_space_put(space: *mut GmemSpaceHandle);
    fn gmem_space_ctx(dev: *mut GmemDevHandle, space: *mut GmemSpaceHandle) -> *mut c_void;
    fn gmem_fence_signal(fence: *mut GmemFenceHandle, err: c_int);
    fn gmem_fence_expect(fence: *mut GmemFenceHandle, ns: u64);
    fn gmem_dev_set_links(dev: *mut GmemDevHandle, h2d_mbps: u64, d2h_mbps: u64, d2d_mbps: u64);
    fn gmem_dev_fault(
        dev: *mut GmemDevHandle,
        space: *mut GmemSpaceHandle,
        addrs: *const u64,
        n: u32,
        access: u32,
    ) -> c_int;
}

/// How a device registers.
pub struct Options {
    /// Name shown in gmem's debugfs (and logs).
    pub name: &'static CStr,
    /// Capacity of the device's memory pool, in 4 KiB frames (`1..=u32::MAX`).
    pub nr_frames: u64,
    /// The driver maps whole 2 MiB blocks with one entry ([`Target::Huge`]).
    pub map_2m: bool,
    /// Copy channels that run at once (`0..=16`): with any, gmem starts copies with
    /// [`Driver::copy_async`] (which the driver must then have); with 0 it uses
    /// [`Driver::copy`].
    pub channels: u32,
}

/// A GMEM space (one process's GMEM address space), with a reference.
///
/// # Invariants
/// `0` is a space reference from `gmem_space_get_current`, put once on drop.
pub struct Space(NonNull<GmemSpaceHandle>);

impl Space {
    /// The calling process's space; `ENOENT` if it has none (never opened `/dev/gmem`).
    pub fn current() -> Result<Space> {
        // SAFETY: a plain call in process context.
        let s = from_err_ptr(unsafe { gmem_space_get_current() })?;
        // INVARIANT: a reference from `gmem_space_get_current`.
        NonNull::new(s).map(Space).ok_or(ENOENT)
    }
}

impl Drop for Space {
    fn drop(&mut self) {
        // SAFETY: the reference taken in `current`, put once (type invariant).
        unsafe { gmem_space_put(self.0.as_ptr()) };
    }
}

/// Where a registration is in its life.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Sessions may open.
    Open,
    /// Unplugging: no new session; waiting for the open ones.
    Closing,
    /// `gmem_dev_unregister` is running (the gate lock is not held meanwhile).
    Unregistering,
    /// `gmem_dev_unregister` returned.
    Unregistered,
}

/// What [`Registration::unplug`] waits on.
struct GateState {
    /// Open sessions.
    sessions: usize,
    phase: Phase,
}

#[pin_data]
struct Gate {
    #[pin]
    state: Mutex<GateState>,
    #[pin]
    idle: CondVar,
    /// Set when unplugging starts (read without the lock at every checkpoint).
    closed: AtomicBool,
}

/// A registered GMEM device. Unplugged (and unregistered) on drop.
///
/// # Invariants
/// `handle` is the live gmem handle of this registration until the phase is
/// `Unregistered`, and is used only while a session is open or by the one `unplug` that
/// unregisters; `cell` is what gmem's `drv` points at (it outlives the registration).
pub struct Registration<T: Driver> {
    handle: NonNull<GmemDevHandle>,
    id: i32,
    cell: KBox<DrvCell<T>>,
    gate: Pin<KBox<Gate>>,
}

// SAFETY: gmem's device functions may be called from any thread, and the rest is `Sync`
// state (`Arc<T>` with `T: Send + Sync`, a mutex).
unsafe impl<T: Driver> Send for Registration<T> {}
// SAFETY: as above; every `&self` method synchronises through the gate.
unsafe impl<T: Driver> Sync for Registration<T> {}

impl<T: Driver> Registration<T> {
    /// Registers a device whose callbacks run on `data`.
    pub fn new(opts: Options, data: Arc<T>) -> Result<Self> {
        let gate = KBox::pin_init(
            pin_init!(Gate {
                state <- new_mutex!(GateState { sessions: 0, phase: Phase::Open }, "gmem::Registration::gate"),
                idle <- new_condvar!("gmem::Registration::idle"),
                closed: AtomicBool::new(false),
            }),
            GFP_KERNEL,
        )?;
        // INVARIANT: tagged with `T`'s type id.
        let cell = KBox::new(DrvCell { type_id: TypeId::of::<T>(), data }, GFP_KERNEL)?;
        let props = GmemDevProps {
            size: core::mem::size_of::<GmemDevProps>() as u32,
            abi_version: GMEM_DRIVER_ABI_VERSION,
            name: opts.name.as_char_ptr(),
            nr_frames: opts.nr_frames,
            drv: core::ptr::from_ref::<DrvCell<T>>(&cell).cast_mut().cast(),
            caps: if opts.map_2m { GMEM_DEV_CAP_MAP_2M } else { 0 },
            nr_channels: opts.channels,
        };
        // SAFETY: `OPS_REF` is `'static` (checked by the compiler); `props` is valid for the
        // call and its `name` is `'static`; `drv` (the boxed cell) stays at its address
        // while the returned registration holds the box, which it does until after
        // unregistering.
        let h = from_err_ptr(unsafe { gmem_dev_register(Adapter::<T>::OPS_REF, &props) })?;
        let handle = NonNull::new(h).ok_or(EINVAL)?;
        // SAFETY: a live handle, just registered.
        let id = unsafe { gmem_dev_id(handle.as_ptr()) };
        // INVARIANT: live handle, gate open; `cell` is the `drv` just registered.
        Ok(Registration { handle, id, cell, gate })
    }

    /// The driver's per-device data.
    pub fn data(&self) -> &Arc<T> {
        &self.cell.data
    }

    /// gmem's id of the device (what the user API calls it). Stays readable after unplug.
    pub fn id(&self) -> i32 {
        self.id
    }

    /// Reports the bandwidth of the device's links in MB/s (host to device, device to host,
    /// device to a peer of the same driver; 0 = unknown), which gmem uses to choose paths
    /// (`gmem_dev_set_links`). `ENODEV` once unplugging started.
    pub fn set_links(&self, h2d_mbps: u64, d2h_mbps: u64, d2d_mbps: u64) -> Result {
        let s = self.gate.state.lock();
        if s.phase != Phase::Open {
            return Err(ENODEV);
        }
        // SAFETY: the handle is live: the gate is open, and `unplug` cannot unregister while
        // we hold the gate lock (it needs it to move the phase). The call does not sleep.
        unsafe { gmem_dev_set_links(self.handle.as_ptr(), h2d_mbps, d2h_mbps, d2d_mbps) };
        drop(s);
        Ok(())
    }

    /// Opens a session of device work in `space`: until it is dropped the device stays
    /// registered and the space's context stays alive. `ENODEV` once unplugging started.
    pub fn session<'a>(&'a self, space: &'a Space) -> Result<Session<'a, T>> {
        {
            let mut s = self.gate.state.lock();
            if s.phase != Phase::Open {
                return Err(ENODEV);
            }
            // Bounded by the number of threads in the kernel.
            s.sessions += 1;
        }
        // SAFETY: the handle is live (the gate was open, and the count just taken keeps
        // `unplug` waiting); `space` is a live reference.
        let c = from_err_ptr(unsafe { gmem_space_ctx(self.handle.as_ptr(), space.0.as_ptr()) });
        match c {
            // SAFETY: gmem returned a context of ours (made by `T::ctx_create`), which lives
            // while the space reference is held and the device is registered: both outlive
            // the session. INVARIANT: counted in the gate above.
            Ok(c) => Ok(Session { reg: self, space, ctx: unsafe { Adapter::<T>::context(c) } }),
            Err(e) => {
                self.leave();
                Err(e)
            }
        }
    }

    /// Gives back one session's count in the gate.
    fn leave(&self) {
        let mut s = self.gate.state.lock();
        s.sessions -= 1;
        if s.sessions == 0 {
            self.gate.idle.notify_all();
        }
    }

    /// Hot-unplug: refuses new sessions, waits for the open ones to end, then unregisters
    /// the device (gmem evacuates its pages to the host and destroys its contexts). Open
    /// sessions see [`Session::revoked`] from the start, so long device work can stop early.
    /// Returns whether this call unregistered the device (`false`: another one did, and it
    /// has finished). Called by drop. Must not be called with a session of this
    /// registration open in the calling thread.
    pub fn unplug(&self) -> bool {
        let mut s = self.gate.state.lock();
        self.gate.closed.store(true, Ordering::Release);
        if s.phase == Phase::Open {
            s.phase = Phase::Closing;
        }
        loop {
            match s.phase {
                Phase::Unregistered => return false,
                Phase::Closing if s.sessions == 0 => break,
                _ => self.gate.idle.wait(&mut s),
            }
        }
        s.phase = Phase::Unregistering;
        drop(s);
        // SAFETY: the live handle (type invariant); only the caller that moved the phase to
        // `Unregistering` gets here, once; no session is open and none can open any more.
        // The gate lock is not held: callbacks run during the call.
        unsafe { gmem_dev_unregister(self.handle.as_ptr()) };
        let mut s = self.gate.state.lock();
        s.phase = Phase::Unregistered;
        self.gate.idle.notify_all();
        true
    }

    /// Whether the device was unplugged (or is being unplugged).
    pub fn is_unplugged(&self) -> bool {
        self.gate.closed.load(Ordering::Acquire)
    }
}

impl<T: Driver> Drop for Registration<T> {
    fn drop(&mut self) {
        self.unplug();
    }
}

/// Device work of one registration in one space (see [`Registration::session`]).
///
/// # Invariants
/// The session is counted in the registration's gate, so the device stays registered and
/// `ctx`, its context in `space`, stays alive.
pub struct Session<'a, T: Driver> {
    reg: &'a Registration<T>,
    space: &'a Space,
    ctx: &'a T::Context,
}

impl<'a, T: Driver> Session<'a, T> {
    /// The device's context (page table) for the session's space.
    pub fn context(&self) -> &T::Context {
        self.ctx
    }

    /// Whether the device is being unplugged: long work should end (with `ENODEV`).
    pub fn revoked(&self) -> bool {
        self.reg.gate.closed.load(Ordering::Acquire)
    }

    /// Reports a batch of device faults (at most 4096 addresses, any order, duplicates and
    /// unaligned addresses allowed) and returns once all are mapped with at least `access`
    /// (see `gmem_dev_fault()` in the C header for the errors).
    pub fn fault(&self, addrs: &[u64], access: Access) -> Result {
        let n = u32::try_from(addrs.len()).map_err(|_| EINVAL)?;
        let a = match access {
            Access::Read => GMEM_ACCESS_READ,
            Access::Write => GMEM_ACCESS_WRITE,
        };
        // SAFETY: the handle is live while the session is open (type invariant), the space
        // reference is held, and `addrs` is valid for `n` reads.
        to_result(unsafe { gmem_dev_fault(self.reg.handle.as_ptr(), self.space.0.as_ptr(), addrs.as_ptr(), n, a) })
    }
}

impl<T: Driver> Drop for Session<'_, T> {
    fn drop(&mut self) {
        self.reg.leave();
    }
}

/// Scheduling points for a driver's long device work (a launch that runs until it is
/// killed). The 7.3 Rust tree wraps `signal_pending()` and `might_sleep()` but not
/// `fatal_signal_pending()` nor `cond_resched()` (static inlines without a Rust helper);
/// these two wrappers keep the `unsafe` in this binding rather than in every driver.
pub mod sched {
    use kernel::bindings;

    /// C's `fatal_signal_pending(current)`: the task has been sent SIGKILL (or a signal
    /// whose default action kills the thread group, which the kernel queues as SIGKILL).
    /// It will never return to user space, so nothing it computes from here on is seen.
    pub fn fatal_signal_pending() -> bool {
        let task = kernel::current!();
        // `task_sigpending()`, through its safe wrapper: the cheap test, almost always false.
        if !task.signal_pending() {
            return false;
        }
        // SAFETY: `task` is the current task, alive for this call. `pending` is a plain
        // integer field inside it: bindgen's offset of `task_struct::pending` lies within
        // bindgen's `size_of::<task_struct>()`, and gmem.ko (whose symbols a gmem driver
        // needs, so it is loaded) refuses to load unless that size equals C's. Other CPUs
        // add signals to the word under `siglock`; like C's `__fatal_signal_pending()` this
        // reads it without the lock, as one volatile load (C's `READ_ONCE`); a stale value
        // is read again at the next scheduling point. (Regression test:
        // `sim_launch_is_killable` in gmem-tests, which a wrong offset would fail.)
        let word = unsafe { core::ptr::addr_of!((*task.as_ptr()).pending.signal.sig[0]).read_volatile() };
        word & (1 << (bindings::SIGKILL - 1)) != 0
    }

    /// C's `cond_resched()`: lets other tasks run if this one should yield. Call it in
    /// process context with no spinlock held.
    pub fn cond_resched() {
        // A debugging check that we may sleep here (DEBUG_ATOMIC_SLEEP), and a voluntary
        // preemption point on PREEMPT_VOLUNTARY kernels.
        kernel::task::might_sleep();
        // Fully preemptible kernels (PREEMPT, PREEMPT_LAZY without PREEMPT_DYNAMIC) define
        // `cond_resched()` as nothing and have no `__cond_resched`; the others export it.
        #[cfg(any(not(CONFIG_PREEMPTION), CONFIG_PREEMPT_DYNAMIC))]
        // SAFETY: `__cond_resched()` may schedule; the caller is in process context and
        // holds no spinlock (documented contract of this function).
        unsafe {
            bindings::__cond_resched();
        }
    }
}
