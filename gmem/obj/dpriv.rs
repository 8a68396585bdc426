// SPDX-License-Identifier: GPL-2.0
//! A device's memory as the kernel's memory manager sees it: a `MEMORY_DEVICE_PRIVATE`
//! pagemap (C side `gmem/gmem_dpriv.c`) whose struct page `k` stands for frame `k` of the
//! device's pool. Ordinary process memory that migrates to the device (exec/dpriv.rs)
//! lands in frames of that one pool, next to the pages of GMEM regions, under the same
//! allocator, charges and eviction; the process's page tables then hold device-private
//! entries, and a CPU access brings the pages back through the pagemap's `migrate_to_ram`.
//!
//! Lifetime: the pagemap is created by the first migration to the device
//! (`Device::dpriv_or_create`, inside a placing section, for a driver that can map process
//! memory) and torn down by unregistration ([`Pagemap::teardown`]) after every page came
//! back: the C side waits until each page was freed, so no pagemap callback runs later.
//! Those callbacks reach the `Device` through the owner bound at creation; the
//! registration's reference keeps it alive until teardown returned. Users of the C object
//! on the Rust side: migrations to and from the device run inside the device's *placing*
//! section (`Device::placing`), which unregistration waits for after marking the device
//! dead; eviction runs under `Device::evict_lock`, which teardown takes to clear the pointer.

use core::ptr::NonNull;
use core::sync::atomic::{AtomicPtr, Ordering};
use kernel::{
    bindings,
    ffi::{c_int, c_long, c_ulong, c_void},
    mm::Mm,
    prelude::*,
};

/// Pages of one migration batch (a 2 MiB block); the C side's `GMEM_DPRIV_BATCH`.
pub(crate) const BATCH: usize = 512;

extern "C" {
    fn gmem_dpriv_new(nframes: c_ulong, base_pfn: *mut c_ulong) -> *mut c_void;
    fn gmem_dpriv_bind(d: *mut c_void, owner: *const c_void);
    fn gmem_dpriv_free(d: *mut c_void);
    fn gmem_dpriv_evict(d: *mut c_void, frames: *const u64, n: c_ulong, nofail: bool) -> c_long;
    fn gmem_dpriv_to_host(
        d: *mut c_void,
        mm: *mut c_void,
        start: c_ulong,
        npages: c_ulong,
        count: *mut c_ulong,
    ) -> c_long;
    fn gmem_dpriv_mig_new() -> *mut c_void;
    fn gmem_dpriv_mig_free(m: *mut c_void);
    fn gmem_dpriv_collect(
        m: *mut c_void,
        d: *mut c_void,
        mm: *mut c_void,
        start: c_ulong,
        npages: c_ulong,
        count: *mut c_ulong,
    ) -> c_int;
    fn gmem_dpriv_source(m: *mut c_void, i: c_ulong, page: *mut *mut c_void) -> c_int;
    fn gmem_dpriv_place(m: *mut c_void, i: c_ulong, frame: u64);
    fn gmem_dpriv_commit(m: *mut c_void) -> c_long;
    fn gmem_dpriv_frame(base_pfn: c_ulong, nframes: c_ulong, hmm_pfn: c_ulong, writable: *mut bool) -> c_ulong;
}

/// A device's device-private pagemap.
///
/// # Invariants
/// `ptr` is null (torn down) or a pagemap from `gmem_dpriv_new` not yet freed, of at least
/// `nframes` pages from pfn `base_pfn`; it is freed exactly once, by [`Pagemap::teardown`]
/// (or by drop, for one never bound).
pub(crate) struct Pagemap {
    ptr: AtomicPtr<c_void>,
    base_pfn: u64,
    nframes: u64,
}

// SAFETY: the C object is used from any thread; its state is the kernel's.
unsafe impl Send for Pagemap {}
// SAFETY: as above.
unsafe impl Sync for Pagemap {}

impl Pagemap {
    /// A pagemap with a page for each of `nframes` frames. May sleep.
    pub(crate) fn new(nframes: u64) -> Result<Pagemap> {
        let n = c_ulong::try_from(nframes).map_err(|_| EINVAL)?;
        let mut base: c_ulong = 0;
        // SAFETY: plain call; the C side checks `n`.
        let p = kernel::error::from_err_ptr(unsafe { gmem_dpriv_new(n, &mut base) })?;
        // INVARIANT: a live pagemap of `nframes` pages from `base`.
        Ok(Pagemap { ptr: AtomicPtr::new(p), base_pfn: base as u64, nframes })
    }

    /// Makes the pagemap's callbacks report to `owner` (a `Device`).
    ///
    /// # Safety
    /// Called once, before any page is handed out; `owner` stays valid until
    /// [`Pagemap::teardown`] returned.
    pub(crate) unsafe fn bind(&self, owner: *const c_void) {
        if let Some(p) = self.raw() {
            // SAFETY: live (type invariant); no page is out yet, so no callback reads it.
            unsafe { gmem_dpriv_bind(p.as_ptr(), owner) }
        }
    }

    /// The C object, unless torn down. Users hold what keeps teardown away (module doc).
    pub(crate) fn raw(&self) -> Option<NonNull<c_void>> {
        NonNull::new(self.ptr.load(Ordering::Acquire))
    }

    /// Waits until every page is free and removes the pagemap. Idempotent; may sleep
    /// (indefinitely, while a page still holds data: a process may keep one until it
    /// exits). The caller keeps placing and eviction away (module doc).
    pub(crate) fn teardown(&self) {
        let p = self.ptr.swap(core::ptr::null_mut(), Ordering::AcqRel);
        if !p.is_null() {
            // SAFETY: the one swap that saw it non-null frees it (type invariant).
            unsafe { gmem_dpriv_free(p) };
        }
    }

    /// Frames the pagemap covers.
    pub(crate) fn nframes(&self) -> u64 {
        self.nframes
    }

    /// The frame of this device an HMM pfn of a walk with this pagemap as device-private
    /// owner names (and whether the CPU entry allows writes), if it names one.
    pub(crate) fn frame_of(&self, hmm_pfn: c_ulong) -> Option<(u32, bool)> {
        let mut writable = false;
        // SAFETY: decodes bits against the pagemap's fixed range; nothing is dereferenced.
        let f = unsafe { gmem_dpriv_frame(self.base_pfn as c_ulong, self.nframes as c_ulong, hmm_pfn, &mut writable) };
        u32::try_from(f).ok().filter(|&f| u64::from(f) < self.nframes).map(|f| (f, writable))
    }

    /// Moves the pages held by `frames` (at most [`BATCH`]) back to host memory wherever
    /// they are mapped; frames holding none are skipped. `nofail`: host pages are allocated
    /// without failing (unregistration). Returns how many moved. The frames go free through
    /// the pagemap afterwards (`Device::drain_released`).
    pub(crate) fn evict(&self, frames: &[u64], nofail: bool) -> Result<usize> {
        let p = self.raw().ok_or(ENODEV)?;
        // SAFETY: live (the caller keeps teardown away); `frames` is valid for its length.
        let r = unsafe { gmem_dpriv_evict(p.as_ptr(), frames.as_ptr(), frames.len() as c_ulong, nofail) };
        kernel::error::to_result(i32::try_from(r.min(0)).unwrap_or(-(bindings::EINVAL as i32)))?;
        Ok(r as usize)
    }

    /// Moves this device's pages of `npages` pages from `start` (at most [`BATCH`], clipped
    /// to the VMA of `start`) back to host memory. Returns how many moved and how many
    /// pages the clipped range has; `EFAULT` if no mapping gmem mirrors is at `start`.
    /// Takes the mmap lock: no lock held.
    pub(crate) fn to_host(&self, mm: &Mm, start: u64, npages: usize) -> Result<(usize, usize)> {
        let p = self.raw().ok_or(ENODEV)?;
        let start = c_ulong::try_from(start).map_err(|_| EFAULT)?;
        let mut count: c_ulong = 0;
        // SAFETY: live (the caller keeps teardown away); `mm` has a user reference held by
        // the caller.
        let r = unsafe { gmem_dpriv_to_host(p.as_ptr(), mm.as_raw().cast(), start, npages as c_ulong, &mut count) };
        kernel::error::to_result(i32::try_from(r.min(0)).unwrap_or(-(bindings::EINVAL as i32)))?;
        Ok((r as usize, count as usize))
    }
}

impl Drop for Pagemap {
    fn drop(&mut self) {
        self.teardown();
    }
}

/// Room for one migration of process memory to a device ([`Migration`]).
///
/// # Invariants
/// `ptr` is a live object of `gmem_dpriv_mig_new`, freed by drop.
pub(crate) struct MigBuf {
    ptr: NonNull<c_void>,
}

impl MigBuf {
    pub(crate) fn new() -> Result<MigBuf> {
        // SAFETY: plain allocation.
        let p = unsafe { gmem_dpriv_mig_new() };
        // INVARIANT: live if non-null.
        Ok(MigBuf { ptr: NonNull::new(p).ok_or(ENOMEM)? })
    }

    /// Collects the pages of `npages` pages from `start` (at most [`BATCH`]; clipped to the
    /// VMA of `start`: [`Migration::count`] pages) that can move to `pm`'s device: anonymous
    /// private memory, including pages never touched. They stay locked and unmapped, under
    /// the mmap read lock, until the returned [`Migration`] is committed (or dropped, which
    /// commits). [`Collected::Unmovable`] for a mapping none of whose pages can move
    /// (hugetlb, DAX, special or shared mappings), with the pages of the clipped range.
    /// `EFAULT` if no mapping gmem mirrors is at `start`.
    pub(crate) fn collect<'a>(
        &'a mut self,
        pm: &'a Pagemap,
        mm: &'a Mm,
        start: u64,
        npages: usize,
    ) -> Result<Collected<'a>> {
        let d = pm.raw().ok_or(ENODEV)?;
        let start = c_ulong::try_from(start).map_err(|_| EFAULT)?;
        let mut count: c_ulong = 0;
        // SAFETY: `self` live (invariant); `d` live (the caller keeps teardown away); `mm` has a
        // user reference held by the caller.
        let r = unsafe {
            gmem_dpriv_collect(self.ptr.as_ptr(), d.as_ptr(), mm.as_raw().cast(), start, npages as c_ulong, &mut count)
        };
        kernel::error::to_result(r)?;
        let count = core::cmp::min(count as usize, BATCH);
        if r == 1 {
            return Ok(Collected::Unmovable(count));
        }
        // INVARIANT: collected; the C side holds the lock until commit.
        Ok(Collected::Migration(Migration { buf: self, pm, _mm: mm, count, done: false }))
    }
}

impl Drop for MigBuf {
    fn drop(&mut self) {
        // SAFETY: live (invariant), freed once here; no `Migration` borrows it any more.
        unsafe { gmem_dpriv_mig_free(self.ptr.as_ptr()) }
    }
}

/// What [`MigBuf::collect`] found.
pub(crate) enum Collected<'a> {
    /// Pages to move (some may stay), locked.
    Migration(Migration<'a>),
    /// A mapping none of whose pages can move; this many pages of it lie in the range.
    Unmovable(usize),
}

/// A collected migration to a device: the mmap read lock of the process and the collected
/// pages' locks are held until [`Migration::commit`] (or drop).
///
/// # Invariants
/// `buf` holds a successful `gmem_dpriv_collect` of `count` pages of the mm `_mm` (which
/// the borrow keeps alive until the commit unlocks it) not yet committed (unless `done`).
pub(crate) struct Migration<'a> {
    buf: &'a mut MigBuf,
    pm: &'a Pagemap,
    _mm: &'a Mm,
    pub(crate) count: usize,
    done: bool,
}

/// What a collected page is.
pub(crate) enum Source {
    /// It stays where it is (not movable: shared, pinned, file-backed, busy).
    Stays,
    /// It moves; its data is in this host page.
    Page(NonNull<bindings::page>),
    /// It moves; never touched, so the device fills it with zeros.
    Zero,
}

impl Migration<'_> {
    /// Page `i` of the collected range.
    pub(crate) fn source(&self, i: usize) -> Source {
        let mut page: *mut c_void = core::ptr::null_mut();
        // SAFETY: collected and not committed (type invariant); the C side checks `i`.
        let moves = unsafe { gmem_dpriv_source(self.buf.ptr.as_ptr(), i as c_ulong, &mut page) };
        match (moves, NonNull::new(page.cast::<bindings::page>())) {
            (0, _) => Source::Stays,
            (_, Some(p)) => Source::Page(p),
            (_, None) => Source::Zero,
        }
    }

    /// Page `i` (one that moves) goes to `frame`, which holds its data now. From here on
    /// the frame is freed through the pagemap, whether or not the page moves.
    pub(crate) fn place(&mut self, i: usize, frame: u32) {
        if u64::from(frame) < self.pm.nframes() {
            // SAFETY: collected, not committed; the C side checks `i` and `frame`.
            unsafe { gmem_dpriv_place(self.buf.ptr.as_ptr(), i as c_ulong, u64::from(frame)) }
        }
    }

    /// Completes the migration and releases the locks; returns how many pages moved.
    pub(crate) fn commit(mut self) -> usize {
        self.finish()
    }

    fn finish(&mut self) -> usize {
        if self.done {
            return 0;
        }
        self.done = true;
        // SAFETY: collected and not committed (type invariant, `done` was false).
        let r = unsafe { gmem_dpriv_commit(self.buf.ptr.as_ptr()) };
        usize::try_from(r).unwrap_or(0)
    }
}

impl Drop for Migration<'_> {
    fn drop(&mut self) {
        self.finish();
    }
}
