// SPDX-License-Identifier: GPL-2.0
//! The mirror of ordinary process memory: what lets a device use an address of the process
//! that is not in a GMEM region (`malloc`, stack, file mappings). The kernel keeps owning
//! those pages; a device maps them remotely (`GMEM_PTE_SYSMEM`) only while the CPU page
//! tables map them the same way. Two objects per space make that hold:
//!
//! - [`Notifier`]s: MMU interval notifiers over the address space in chunks of
//!   [`CHUNK_BYTES`] (C side `gmem/gmem_mirror.c`), each registered on the first device
//!   fault in its chunk (`Space::notifier`). Every change the kernel makes to the process's
//!   page tables (munmap, mprotect, COW on fork, migration, compaction, THP split, swap-out,
//!   exit) calls the invalidate callback of the chunks it touches before the old pages can
//!   go; [`Notifier::fault`] snapshots pages with `hmm_range_fault`. Chunks keep the
//!   sequence a fault validates local: an invalidation elsewhere in the process (another
//!   thread's munmap, gmem's own CPU-PTE zaps of its regions) does not make it retry.
//! - [`MirrorState`] (`Space::mirror`, lock class `gmem_mirror`): per device, its context
//!   and which pages it maps (and which of them writable), per 2 MiB block. The invalidate
//!   callback takes it, records the new notifier sequence, and unmaps the range on every
//!   device (`exec/mirror.rs`); a device fault maps a snapshot only under it and only if no
//!   invalidation started since the snapshot ([`Notifier::lock_current`]). So no device
//!   entry outlives the CPU mapping it was made from, and every page a device maps stays
//!   allocated until the device's unmap returned (the driver API's promise for `host`).
//!
//! Lock order: `Space::mirror` is taken by the invalidate callback, which memory reclaim
//! can run, and which gmem's own CPU-PTE zaps run under a block lock (`Block::pages ->
//! Space::mirror`). So nothing is allocated with reclaim under it (the tree node and the
//! entry array of a fault are allocated before it is taken, and drivers prepare their page
//! tables with `map_prepare`), nothing that ranks with or before `Block::pages` is taken
//! under it, and the only locks taken under it are a device's callback section (SRCU) and
//! the driver's own page-table locks in `map`/`unmap`. Neither `mmap_lock` nor
//! `hmm_range_fault` is entered with it held.

use crate::obj::device::{Ctx, Device};
use crate::obj::devices::MAX_DEVICES;
use crate::obj::dpriv::Pagemap;
use crate::policy::bits;
use core::marker::PhantomData;
use core::ptr::NonNull;
use core::sync::atomic::{AtomicPtr, Ordering};
use kernel::{
    bindings,
    ffi::{c_int, c_ulong, c_void},
    mm::{Mm, MmWithUser},
    prelude::*,
    rbtree::{RBTree, RBTreeNode},
    sync::{Arc, Mutex, MutexGuard},
};

/// Pages of one 2 MiB block: the unit of a mirror fault and of the record.
pub(crate) const BLOCK_PAGES: usize = 512;
/// Bytes of address space one notifier covers (a multiple of 2 MiB).
pub(crate) const CHUNK_BYTES: u64 = 64 << 20;

extern "C" {
    fn gmem_mirror_new(mm: *mut c_void, owner: *const c_void, start: c_ulong, length: c_ulong) -> *mut c_void;
    fn gmem_mirror_free(m: *mut c_void);
    fn gmem_mirror_set_seq(mni: *mut c_void, cur_seq: c_ulong);
    fn gmem_mirror_check(mm: *mut c_void, addr: c_ulong, write: bool, home: bool) -> c_int;
    fn gmem_mirror_retry(m: *mut c_void, seq: c_ulong) -> bool;
    fn gmem_unmap_watch_new(mm: *mut c_void, owner: *const c_void) -> *mut c_void;
    fn gmem_unmap_watch_free(w: *mut c_void);
    fn gmem_mirror_next_mapped(
        mm: *mut c_void,
        addr: c_ulong,
        end: c_ulong,
        lo: *mut c_ulong,
        hi: *mut c_ulong,
    ) -> bool;
    fn gmem_mirror_fault(
        m: *mut c_void,
        owner: *mut c_void,
        start: c_ulong,
        req: *const u8,
        npages: c_ulong,
        pfns: *mut c_ulong,
        first: *mut c_ulong,
        count: *mut c_ulong,
        seq: *mut c_ulong,
    ) -> c_int;
    fn gmem_mirror_page(hmm_pfn: c_ulong, writable: *mut bool) -> *mut c_void;
    fn gmem_mirror_dirty(page: *mut c_void);
    fn gmem_mirror_page_file(hmm_pfn: c_ulong) -> bool;
}

/// What a mirror fault asks for one page of a block (`gmem_mirror_fault`'s `req`; 0:
/// only look): fault it in for reading or writing, or look at it without faulting but
/// walk the VMA it is in (a residency query).
pub(crate) const REQ_READ: u8 = 1;
pub(crate) const REQ_WRITE: u8 = 2;
pub(crate) const REQ_LOOK: u8 = 3;

/// The MMU interval notifier of one space.
///
/// # Invariants
/// `ptr` is null (removed) or a `struct gmem_mirror` from `gmem_mirror_new` that has not
/// been freed; it is freed exactly once, by [`Notifier::remove`].
pub(crate) struct Notifier {
    ptr: AtomicPtr<c_void>,
}

// SAFETY: the C object is used from any thread; its mutable state is the kernel's
// (notifier sequence, read under the mirror lock or with `READ_ONCE`).
unsafe impl Send for Notifier {}
// SAFETY: as above.
unsafe impl Sync for Notifier {}

/// The unmap watch of one space (C side `gmem/gmem_mirror.c`): an MMU notifier over the
/// whole address space whose only work is to pass each unmap (munmap, mremap moving a
/// range) to `owner`'s `Space::forget_unmapped` (`gmem_space_unmapped` in exec/mirror.rs).
///
/// # Invariants
/// `ptr` is a `struct gmem_unmap_watch` from `gmem_unmap_watch_new`, freed only by the
/// drop, once.
pub(crate) struct UnmapWatch {
    ptr: NonNull<c_void>,
}

// SAFETY: the C object is only registered and freed, from any thread.
unsafe impl Send for UnmapWatch {}
// SAFETY: shared references do nothing with it.
unsafe impl Sync for UnmapWatch {}

impl UnmapWatch {
    /// Registers the unmap watch of `mm` for `owner`. Takes the mmap lock: call with no
    /// lock held.
    ///
    /// # Safety
    /// `owner` must be a `Space` that stays valid (and pinned) until the watch is dropped.
    pub(crate) unsafe fn new(mm: &MmWithUser, owner: *const c_void) -> Result<UnmapWatch> {
        // SAFETY: `mm` has users (the caller's reference) and no mmap lock is held; `owner`
        // outlives the watch (the caller's contract).
        let p = unsafe { gmem_unmap_watch_new(mm.as_raw().cast(), owner) };
        let p = kernel::error::from_err_ptr(p)?;
        // INVARIANT: a live object from `gmem_unmap_watch_new`.
        NonNull::new(p).map(|ptr| UnmapWatch { ptr }).ok_or(ENOMEM)
    }
}

impl Drop for UnmapWatch {
    /// Unregisters and frees the watch; waits for a running callback, none runs afterwards.
    /// May sleep.
    fn drop(&mut self) {
        // SAFETY: live and freed only here (type invariant).
        unsafe { gmem_unmap_watch_free(self.ptr.as_ptr()) };
    }
}

/// A snapshot of one block taken by [`Notifier::fault`]: pages `first .. first + count`
/// of the block were walked; valid while the notifier sequence `seq` is current.
pub(crate) struct Snapshot {
    pub(crate) first: usize,
    pub(crate) count: usize,
    seq: c_ulong,
}

impl Notifier {
    /// Registers a notifier over chunk `chunk` (of [`CHUNK_BYTES`]) of `mm`'s addresses,
    /// whose invalidations go to `owner`'s mirror (`gmem_mirror_invalidate` in
    /// exec/mirror.rs).
    ///
    /// # Safety
    /// `owner` must stay valid (and pinned) until [`Notifier::remove`] returned.
    pub(crate) unsafe fn new(mm: &Mm, owner: *const c_void, chunk: u64) -> Result<Notifier> {
        let start = chunk.checked_mul(CHUNK_BYTES).and_then(|s| c_ulong::try_from(s).ok()).ok_or(EFAULT)?;
        // SAFETY: `mm` is a live mm (the caller holds a reference); no mmap lock is held.
        // The C side refuses a chunk that wraps.
        let p = unsafe { gmem_mirror_new(mm.as_raw().cast(), owner, start, CHUNK_BYTES as c_ulong) };
        let p = kernel::error::from_err_ptr(p)?;
        // INVARIANT: a live object from `gmem_mirror_new`.
        Ok(Notifier { ptr: AtomicPtr::new(p) })
    }

    fn raw(&self) -> Result<NonNull<c_void>> {
        NonNull::new(self.ptr.load(Ordering::Acquire)).ok_or(EFAULT)
    }

    /// Unregisters and frees the notifier; waits for running invalidations, none runs
    /// afterwards. Idempotent. May sleep; not under the mirror lock.
    pub(crate) fn remove(&self) {
        let p = self.ptr.swap(core::ptr::null_mut(), Ordering::AcqRel);
        if !p.is_null() {
            // SAFETY: the one swap that saw it non-null frees it (type invariant).
            unsafe { gmem_mirror_free(p) };
        }
    }

    /// Snapshots the block at `start` (2 MiB aligned): faults in the pages `req` asks for
    /// (at least one) as a CPU access would, and reads the others that are present, within
    /// the VMA of the first requested page. Fills `pfns` (HMM pfns, 0 outside the walked
    /// pages). Device-private pages of `own` (a device's pagemap) are reported as they are
    /// ([`Pagemap::frame_of`] decodes them); those of other devices come back to the host if
    /// requested, else read as absent. Takes the mmap lock itself: call with no lock held.
    pub(crate) fn fault(
        &self,
        own: Option<&Pagemap>,
        start: u64,
        req: &[u8; BLOCK_PAGES],
        pfns: &mut [c_ulong; BLOCK_PAGES],
    ) -> Result<Snapshot> {
        let m = self.raw()?;
        let start = c_ulong::try_from(start).map_err(|_| EFAULT)?;
        let (mut first, mut count, mut seq): (c_ulong, c_ulong, c_ulong) = (0, 0, 0);
        // SAFETY: `m` is live (type invariant; only `remove`, at space teardown, frees it,
        // and the caller holds the space); the arrays have `BLOCK_PAGES` entries; the
        // pagemap pointer is only compared with pages' owners (`dev_private_owner`), never
        // dereferenced.
        let r = unsafe {
            gmem_mirror_fault(
                m.as_ptr(),
                own.and_then(Pagemap::raw).map_or(core::ptr::null_mut(), |p| p.as_ptr()),
                start,
                req.as_ptr(),
                BLOCK_PAGES as c_ulong,
                pfns.as_mut_ptr(),
                &mut first,
                &mut count,
                &mut seq,
            )
        };
        kernel::error::to_result(r)?;
        if first.checked_add(count).is_none_or(|e| e > BLOCK_PAGES) {
            return Err(EINVAL);
        }
        Ok(Snapshot { first, count, seq })
    }

    /// The mirror lock, if no invalidation started since `snap` was taken; `None` (lock
    /// released) if the snapshot went stale.
    pub(crate) fn lock_current<'a>(
        &self,
        state: &'a Mutex<MirrorState>,
        snap: &Snapshot,
    ) -> Result<Option<MutexGuard<'a, MirrorState>>> {
        let m = self.raw()?;
        let g = state.lock();
        // SAFETY: `m` is live (as in `fault`); called under the lock the invalidate callback
        // takes before it sets the sequence (mmu_interval_read_retry's rule).
        let stale = unsafe { gmem_mirror_retry(m.as_ptr(), snap.seq) };
        Ok((!stale).then_some(g))
    }
}

impl Drop for Notifier {
    fn drop(&mut self) {
        self.remove();
    }
}

/// `Ok` if `addr` lies in a mapping of `mm` that gmem mirrors for this access, else the
/// errno of a fault there. Takes the mmap read lock: call with no lock held, and with a
/// user reference on `mm`.
pub(crate) fn check(mm: &Mm, addr: u64, write: bool) -> Result {
    check_vma(mm, addr, write, false)
}

/// [`check`] for a move of pages back to host memory, which grants no access: the mapping
/// need not be readable (pages that moved to a device before an `mprotect(PROT_NONE)`).
pub(crate) fn check_home(mm: &Mm, addr: u64) -> Result {
    check_vma(mm, addr, false, true)
}

fn check_vma(mm: &Mm, addr: u64, write: bool, home: bool) -> Result {
    let addr = c_ulong::try_from(addr).map_err(|_| EFAULT)?;
    // SAFETY: `mm` is live and has users (the caller's reference); no lock is held.
    kernel::error::to_result(unsafe { gmem_mirror_check(mm.as_raw().cast(), addr, write, home) })
}

/// Calls `f` with the parts of `[start, end)` that mappings of `mm` cover, in address order
/// (touching mappings make one part), under the mmap read lock: nothing is mapped or
/// unmapped there until `f` returns. More than `most` parts: `E2BIG`, without calling `f`.
/// Call with no lock held and a user reference on `mm`.
pub(crate) fn with_mapped<R>(
    mm: &MmWithUser,
    start: u64,
    end: u64,
    most: usize,
    f: impl FnOnce(&[(u64, u64)]) -> R,
) -> Result<R> {
    let end = c_ulong::try_from(end).map_err(|_| EFAULT)?;
    let mut a = c_ulong::try_from(start).map_err(|_| EFAULT)?;
    let mut parts: KVec<(u64, u64)> = KVec::new();
    let lock = mm.mmap_read_lock();
    while a < end {
        let (mut lo, mut hi): (c_ulong, c_ulong) = (0, 0);
        // SAFETY: `mm` is live (the caller's reference), its mmap lock is held (`lock`), and
        // `lo`, `hi` are writable.
        if !unsafe { gmem_mirror_next_mapped(mm.as_raw().cast(), a, end, &mut lo, &mut hi) } {
            break;
        }
        let n = parts.len();
        match parts.last_mut() {
            Some(last) if last.1 == lo as u64 => last.1 = hi as u64,
            _ if n >= most => return Err(E2BIG),
            _ => parts.push((lo as u64, hi as u64), GFP_KERNEL)?,
        }
        // `hi > a`: the mapping found ends after `a`.
        a = hi;
    }
    let r = f(&parts);
    drop(lock);
    Ok(r)
}

/// Records `cur_seq` as the notifier's sequence: the invalidate callback does this under
/// the mirror lock before it unmaps anything.
///
/// # Safety
/// `mni` must be the notifier the callback was called for, and the mirror lock held.
pub(crate) unsafe fn set_seq(mni: *mut c_void, cur_seq: c_ulong) {
    // SAFETY: by the caller's contract.
    unsafe { gmem_mirror_set_seq(mni, cur_seq) }
}

/// A page of a snapshot a device may map.
///
/// # Invariants
/// A page mapped by the process at the time of a snapshot whose sequence is still
/// current: it stays allocated until the next invalidation of its address, which takes the
/// mirror lock. So it may be used only while that lock is held, and mapped on a device only
/// if recorded (so that the invalidation unmaps it) under the same hold.
pub(crate) struct MirrorPage<'g> {
    pub(crate) page: NonNull<bindings::page>,
    /// The CPU mapping allows writes.
    pub(crate) writable: bool,
    _lock: PhantomData<&'g MirrorState>,
}

impl<'g> MirrorPage<'g> {
    /// The page of HMM pfn `pfn` of `snap`, if it names one a device may map (present, not
    /// an error, not device memory). `state` is the guard from [`Notifier::lock_current`].
    pub(crate) fn of(_state: &'g MirrorState, pfn: c_ulong) -> Option<MirrorPage<'g>> {
        let mut writable = false;
        // SAFETY: decodes bits; the page pointer it returns is live by the guard's validity.
        let p = unsafe { gmem_mirror_page(pfn, &mut writable) }.cast::<bindings::page>();
        // INVARIANT: the snapshot is current under the guard `_state` borrows.
        NonNull::new(p).map(|page| MirrorPage { page, writable, _lock: PhantomData })
    }

    /// Marks the page dirty: a device is about to get a writable mapping of it, and device
    /// writes do not set the CPU's dirty bit.
    pub(crate) fn mark_dirty(&self) {
        // SAFETY: the page is live and mapped by the process (type invariant).
        unsafe { gmem_mirror_dirty(self.page.as_ptr().cast()) }
    }
}

/// Whether HMM pfn `pfn` of a snapshot names a page the process maps (its bits only: the
/// page itself is not touched, so no current sequence is needed, as for a residency query).
pub(crate) fn pfn_present(pfn: c_ulong) -> bool {
    let mut writable = false;
    // SAFETY: decodes bits and looks up the pfn's memory section (`pfn_to_online_page`);
    // only the zone of a struct page of online memory is read (a read racing with that
    // memory's removal is the race every walker of `pfn_to_online_page` accepts), and the
    // pointer returned is not dereferenced here.
    !unsafe { gmem_mirror_page(pfn, &mut writable) }.is_null()
}

/// Whether HMM pfn `pfn` of a snapshot names a host page that is not anonymous (page
/// cache, shmem): one that never moves to a device. A hint for policy (read without a
/// current sequence).
pub(crate) fn pfn_file_page(pfn: c_ulong) -> bool {
    // SAFETY: decodes bits and reads the folio flags of a page of online memory (checked
    // first); such a struct page stays while its memory is online, and a read racing with
    // the memory's removal is the race that every walker of `pfn_to_online_page` accepts.
    unsafe { gmem_mirror_page_file(pfn) }
}

/// Pages of one 2 MiB block, a bit each (bit `k` of word `k / 64`: page `k`), and how
/// many are set.
pub(crate) use crate::policy::bits::{count, BlockBits};

/// What one device maps of one 2 MiB block.
#[derive(Clone, Copy, Default)]
pub(crate) struct Mapped {
    pub(crate) pages: BlockBits,
    /// The subset mapped writable.
    pub(crate) writable: BlockBits,
}

/// The mirror entries of one device in one space.
pub(crate) struct DevMirror {
    pub(crate) dev: Arc<Device>,
    /// The context the entries are in. Used only inside a callback section of `dev`, which
    /// a device that unregistered (and destroyed its contexts) refuses.
    pub(crate) ctx: Ctx,
    /// By 2 MiB block number.
    pub(crate) blocks: RBTree<u64, Mapped>,
}

/// What devices map of the process's ordinary memory (see the module documentation).
pub(crate) struct MirrorState {
    /// By device id; a device's slot is taken out when it unregisters
    /// (`exec::mirror::forget_device`) or replaced when another device with that id maps.
    pub(crate) devs: [Option<DevMirror>; MAX_DEVICES],
    /// Pages currently mapped (summed over devices), and invalidations that unmapped some.
    pub(crate) mapped: u64,
    pub(crate) invalidations: u64,
}

impl MirrorState {
    pub(crate) fn new() -> MirrorState {
        MirrorState { devs: [const { None }; MAX_DEVICES], mapped: 0, invalidations: 0 }
    }

    /// Whether some device maps page `k` of block `block` (one that unregistered maps
    /// nothing, whatever its record still says).
    pub(crate) fn any_maps(&self, block: u64, k: usize) -> bool {
        self.devs
            .iter()
            .flatten()
            .filter(|m| m.dev.alive())
            .any(|m| m.blocks.get(&block).is_some_and(|b| bits::test(&b.pages, k)))
    }

    /// What `dev` maps of block `block`.
    pub(crate) fn mapped_on(&self, dev: &Device, block: u64) -> Mapped {
        match self.devs.get(dev.id) {
            Some(Some(m)) if core::ptr::eq(&*m.dev, dev) => m.blocks.get(&block).copied().unwrap_or_default(),
            _ => Mapped::default(),
        }
    }

    /// Records `new` in block `block` as mapped on `dev` (context `ctx`), using `node` if
    /// the block had no record yet: no allocation here (this runs under the mirror lock).
    /// Returns the record of an earlier device with the same id (unregistered), for the
    /// caller to drop after the lock.
    pub(crate) fn record(
        &mut self,
        dev: &Arc<Device>,
        ctx: Ctx,
        block: u64,
        new: &Mapped,
        node: &mut Option<RBTreeNode<u64, Mapped>>,
    ) -> Result<Option<DevMirror>> {
        let slot = self.devs.get_mut(dev.id).ok_or(EINVAL)?;
        let same = slot.as_ref().is_some_and(|m| Arc::ptr_eq(&m.dev, dev) && m.ctx == ctx);
        // Refused before anything changes: a failure after the slot's replacement would drop
        // the earlier device's record (and maybe its last reference) under the lock.
        let known = same && slot.as_ref().is_some_and(|m| m.blocks.get(&block).is_some());
        if !known && node.is_none() {
            return Err(ENOMEM);
        }
        let mut old = None;
        if !same {
            old = slot.replace(DevMirror { dev: dev.clone(), ctx, blocks: RBTree::new() });
            if let Some(o) = &old {
                self.mapped -= o.blocks.values().map(|m| count(&m.pages)).sum::<u64>();
            }
        }
        let m = slot.as_mut().ok_or(EINVAL)?;
        match m.blocks.get_mut(&block) {
            Some(have) => {
                let before = count(&have.pages);
                for k in 0..BLOCK_PAGES / 64 {
                    have.pages[k] |= new.pages[k];
                    // A page mapped again read-only (a read fault after an invalidation)
                    // is no longer writable; one mapped writable is.
                    have.writable[k] = (have.writable[k] & !new.pages[k]) | new.writable[k];
                }
                self.mapped += count(&have.pages) - before;
            }
            None => {
                let n = node.take().ok_or(ENOMEM)?.into_reservation().into_node(block, *new);
                drop(m.blocks.insert(n));
                self.mapped += count(&new.pages);
            }
        }
        Ok(old)
    }
}
