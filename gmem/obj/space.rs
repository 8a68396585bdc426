// SPDX-License-Identifier: GPL-2.0
//! Address space: one per process (per `mm`) that opened `/dev/gmem`. It holds the
//! process's regions, found by address in O(log n) through a maple tree, and one device
//! context (device page table) per device that touched the space. Several devices may be
//! attached to one space at once.
//!
//! Lock order: `SPACES` and the maple tree's internal lock are leaves; `Space::ctxs` and
//! `Space::thrash` are taken under a block lock (see Documentation/design.rst);
//! `Space::mirror` is taken by MMU-notifier callbacks (see obj/mirror.rs), and the leaves
//! `Space::sysmem_advice` and `Space::thrash` by the unmap watch's
//! ([`Space::forget_unmapped`]).

use crate::obj::device::{Ctx, Device};
use crate::obj::devices::MAX_DEVICES;
use crate::obj::mirror::{self, MirrorState, Notifier, UnmapWatch, CHUNK_BYTES};
use crate::obj::region::{Region, ADVICE_RUNS, BLOCK_BYTES, PAGE_SIZE};
use crate::policy::range::{AdviceMap, PageRange};
use crate::policy::thrash::{RecentMoves, ThrashTable, Verdict};
use core::mem::ManuallyDrop;
use core::ops::Deref;
use core::sync::atomic::{AtomicU64, Ordering};
use kernel::{
    maple_tree::MapleTree,
    mm::{Mm, MmWithUser},
    new_mutex,
    prelude::*,
    rbtree::{RBTree, RBTreeNode},
    sync::{aref::ARef, global_lock, Arc, Mutex},
};

extern "C" {
    /// `atomic_read(&mm->mm_users)` (gmem_export.c).
    fn gmem_mm_users(mm: *mut core::ffi::c_void) -> core::ffi::c_int;
}

/// Per-space counters.
#[derive(Default)]
pub(crate) struct SpaceStats {
    pub(crate) cpu_faults: AtomicU64,
    pub(crate) dev_faults: AtomicU64,
    /// CPU page-table zaps by the block executor (one per run of consecutive pages).
    pub(crate) cpu_zaps: AtomicU64,
    /// Block-lock acquisitions (`Region::lock`).
    pub(crate) block_locks: AtomicU64,
    /// Pages brought home by read-ahead for the CPU (`mech/readahead.rs`).
    pub(crate) home_ahead: AtomicU64,
}

/// A device's context in a space, with the device it belongs to.
type CtxSlot = Option<(Arc<Device>, Ctx)>;

#[pin_data(PinnedDrop)]
pub(crate) struct Space {
    pub(crate) id: u64,
    /// Thread-group id of the process that opened the space (for log messages).
    pub(crate) pid: i32,
    mm: ARef<Mm>,
    /// Regions by address range `[start, end]`.
    #[pin]
    regions: MapleTree<Arc<Region>>,
    /// Device contexts by device id.
    #[pin]
    ctxs: Mutex<[CtxSlot; MAX_DEVICES]>,
    /// Recently migrated pages, for thrashing detection (a leaf lock).
    #[pin]
    pub(crate) thrash: Mutex<Thrash>,
    /// The space's asynchronous prefetches (fences), run one at a time in the order queued
    /// by one worker ([`Space::queue_serial`]). Besides bounding the work queued for one
    /// process (however many fences it queues, through however many files, it takes one
    /// of gmem's workers, and never parks others on a lock), this is what lets an exiting
    /// process's address space go: a fence holds the mm's users only within a chunk, and
    /// with one fence at a time there are moments when no fence holds them, so the last
    /// `mmput` (and `exit_mmap`) happens and later chunks fail. A leaf: no job runs
    /// under it.
    #[pin]
    serial: Mutex<Serial>,
    /// What devices map of the process's ordinary memory (obj/mirror.rs).
    #[pin]
    pub(crate) mirror: Mutex<MirrorState>,
    /// The MMU interval notifiers that keep `mirror` coherent, by chunk of
    /// `mirror::CHUNK_BYTES`: registered on the first device fault outside the regions in
    /// their chunk, removed first thing when the space is dropped. A leaf lock: only tree
    /// operations under it (registration, which may take the mmap lock, happens outside).
    #[pin]
    notifiers: Mutex<RBTree<u64, Arc<Notifier>>>,
    /// Advice on ordinary process memory (PREFERRED_LOC, ACCESSED_BY; bits as a region's,
    /// `region::adv`), by absolute page number: set only on mapped pages, after `unmaps`
    /// is registered, and forgotten when they are unmapped ([`Space::forget_unmapped`]). A
    /// leaf lock, taken under the mmap lock by both.
    #[pin]
    pub(crate) sysmem_advice: Mutex<AdviceMap<ADVICE_RUNS>>,
    /// The unmap watch (obj/mirror.rs), registered with the first advice on ordinary
    /// memory and removed first thing when the space is dropped. A leaf lock: only the
    /// option is swapped under it (registration, which takes the mmap lock, and removal,
    /// which waits for callbacks, happen outside).
    #[pin]
    unmaps: Mutex<Option<UnmapWatch>>,
    /// References on the address space's users that gmem's workers hold (read-ahead in
    /// both directions and on every device, PREFETCH lanes): changed only together with
    /// taking or dropping one, under this lock, so that workers taking turns never keep an
    /// exiting process's address space alive between them ([`Space::mm_for_worker`]).
    /// Nothing is taken under it except what the last `mmput` does, which takes none of
    /// gmem's locks that a worker could hold.
    #[pin]
    workers_mm: Mutex<usize>,
    pub(crate) stats: SpaceStats,
}

/// A reference on a space's address-space users held by a gmem worker
/// ([`Space::mm_for_worker`]); given back, and uncounted, when dropped.
pub(crate) struct WorkerMm<'a> {
    space: &'a Space,
    /// Dropped only in `drop`, under `Space::workers_mm`.
    mm: ManuallyDrop<ARef<MmWithUser>>,
}

impl Deref for WorkerMm<'_> {
    type Target = MmWithUser;

    fn deref(&self) -> &MmWithUser {
        &self.mm
    }
}

impl Drop for WorkerMm<'_> {
    fn drop(&mut self) {
        let mut held = self.space.workers_mm.lock();
        // If this was the last reference (the process exited meanwhile), the address
        // space's teardown runs here.
        // SAFETY: `mm` is dropped here only, once, and nothing uses it afterwards.
        unsafe { ManuallyDrop::drop(&mut self.mm) };
        *held = held.saturating_sub(1);
    }
}

/// Pages tracked per space for thrashing detection.
pub(crate) const THRASH_ENTRIES: usize = 128;

/// Thrashing state of a space: a cheap filter of first moves, then the table of pages that
/// moved again (both pure policy code, `policy/src/thrash.rs`).
#[derive(Default)]
pub(crate) struct Thrash {
    pub(crate) recent: RecentMoves<1024>,
    pub(crate) table: ThrashTable<THRASH_ENTRIES>,
}

impl Thrash {
    /// Records a move of what lives at `va` (a page of a region, or a block of ordinary
    /// memory) at `now` and says what to do with the next one: tracked only once it moved
    /// again within a while (`RecentMoves`), then by the table's verdicts.
    pub(crate) fn moved(&mut self, va: u64, now: u64) -> Verdict {
        if !self.recent.seen_again(va) {
            return Verdict::Migrate;
        }
        self.table.on_move(va, now, &crate::obj::tune::thrash_params())
    }

    /// Forgets the moves of the pages in `[start, end)` (a freed region).
    pub(crate) fn forget(&mut self, start: u64, end: u64) {
        self.recent.forget_range(start, end);
        self.table.forget_range(start, end);
    }
}

// SAFETY: every field is thread-safe; the maple tree (whose Rust abstraction does not
// declare it) serialises all access through its internal `ma_lock` and stores `Arc<Region>`,
// which is `Send + Sync`.
unsafe impl Send for Space {}
// SAFETY: as above.
unsafe impl Sync for Space {}

struct SpaceEntry {
    space: Arc<Space>,
    files: usize,
}

struct Spaces {
    list: KVec<SpaceEntry>,
    next_id: u64,
}

global_lock! {
    // SAFETY: initialised by `init()` in module init before any use.
    unsafe(uninit) static SPACES: Mutex<Spaces> = Spaces { list: KVec::new(), next_id: 1 };
}

pub(crate) fn init() {
    // SAFETY: called exactly once from module init.
    unsafe { SPACES.init() };
}

/// Frees the list itself at module exit (statics are not dropped; no file is open then).
pub(crate) fn exit() {
    drop(core::mem::take(&mut SPACES.lock().list));
}

/// The space of `mm`, created on first open; every call must be paired with [`release`].
pub(crate) fn open(mm: &Mm) -> Result<Arc<Space>> {
    let mut s = SPACES.lock();
    if let Some(e) = s.list.iter_mut().find(|e| core::ptr::eq(e.space.mm.as_raw(), mm.as_raw())) {
        e.files += 1;
        return Ok(e.space.clone());
    }
    let id = s.next_id;
    let space = Arc::pin_init(
        try_pin_init!(Space {
            id,
            pid: kernel::current!().tgid(),
            mm: ARef::from(mm),
            regions <- MapleTree::new(),
            ctxs <- new_mutex!([const { None }; MAX_DEVICES], "gmem_space_ctxs"),
            thrash <- new_mutex!(Thrash { recent: RecentMoves::new(), table: ThrashTable::new() }, "gmem_space_thrash"),
            serial <- new_mutex!(Serial { queue: KVec::new(), running: false }, "gmem_space_serial"),
            mirror <- new_mutex!(MirrorState::new(), "gmem_mirror"),
            notifiers <- new_mutex!(RBTree::new(), "gmem_mirror_notifiers"),
            sysmem_advice <- new_mutex!(AdviceMap::new(), "gmem_sysmem_advice"),
            unmaps <- new_mutex!(None, "gmem_space_unmaps"),
            workers_mm <- new_mutex!(0, "gmem_space_workers_mm"),
            stats: SpaceStats::default(),
        }),
        GFP_KERNEL,
    )?;
    s.list.push(SpaceEntry { space: space.clone(), files: 1 }, GFP_KERNEL)?;
    s.next_id += 1;
    Ok(space)
}

/// Drops one open of `space`; the last one forgets it (the `Arc` may live on in drivers).
pub(crate) fn release(space: &Arc<Space>) {
    let mut s = SPACES.lock();
    if let Some(i) = s.list.iter().position(|e| Arc::ptr_eq(&e.space, space)) {
        s.list[i].files -= 1;
        if s.list[i].files == 0 {
            let _ = s.list.remove(i);
        }
    }
}

/// The space of the calling process, if it has opened `/dev/gmem`.
pub(crate) fn current() -> Option<Arc<Space>> {
    let task = kernel::current!();
    let mm = task.mm()?;
    let s = SPACES.lock();
    s.list.iter().find(|e| core::ptr::eq(e.space.mm.as_raw(), mm.as_raw())).map(|e| e.space.clone())
}

/// Every space (for device unregistration).
pub(crate) fn all() -> Result<KVec<Arc<Space>>> {
    let s = SPACES.lock();
    let mut v = KVec::with_capacity(s.list.len(), GFP_KERNEL)?;
    for e in s.list.iter() {
        v.push(e.space.clone(), GFP_KERNEL)?;
    }
    Ok(v)
}

/// Work a space runs one item at a time, in the order queued ([`Space::queue_serial`]):
/// its asynchronous prefetches.
pub(crate) trait SerialJob: Send + Sync {
    /// Runs the job, on a worker of gmem's workqueue, with nothing held.
    fn run_job(&self);
}

/// A space's queued [`SerialJob`]s, and whether a worker is running them.
///
/// Lifetimes: a queued job may hold the space (a fence does); the cycle lasts until the
/// job is taken off the queue, to run (the worker that runs the queue runs it to the end)
/// or cancelled before it started ([`Space::unqueue_serial`]).
pub(crate) struct Serial {
    queue: KVec<Arc<dyn SerialJob>>,
    running: bool,
}

impl Space {
    /// Queues `job` behind the space's other serial jobs. Returns true if no worker is
    /// running them: the caller must then call [`Space::run_serial`] from a worker of its
    /// own (queued on gmem's workqueue), or the queue stalls.
    pub(crate) fn queue_serial(&self, job: Arc<dyn SerialJob>) -> Result<bool> {
        let mut s = self.serial.lock();
        s.queue.push(job, GFP_KERNEL)?;
        Ok(!core::mem::replace(&mut s.running, true))
    }

    /// Takes the job at `job` (compared by address) off the queue if it has not started,
    /// and returns it (for the caller to drop: it may hold the last reference to the
    /// space, which must not go under the space's own lock). `None` once it has started
    /// or run.
    pub(crate) fn unqueue_serial(&self, job: *const ()) -> Option<Arc<dyn SerialJob>> {
        let mut s = self.serial.lock();
        let k = s.queue.iter().position(|j| core::ptr::eq(Arc::as_ptr(j).cast::<()>(), job))?;
        s.queue.remove(k).ok()
    }

    /// Runs the space's serial jobs in the order queued until none is left (the next
    /// [`Space::queue_serial`] then asks for a worker again).
    pub(crate) fn run_serial(&self) {
        loop {
            let job = {
                let mut s = self.serial.lock();
                match s.queue.remove(0) {
                    Ok(job) => job,
                    // Empty.
                    Err(_) => {
                        s.running = false;
                        return;
                    }
                }
            };
            job.run_job();
        }
    }

    /// True if the calling task runs in this space's `mm`.
    pub(crate) fn is_current(&self) -> bool {
        let task = kernel::current!();
        task.mm().is_some_and(|mm| core::ptr::eq(mm.as_raw(), self.mm.as_raw()))
    }

    pub(crate) fn mm(&self) -> &Mm {
        &self.mm
    }

    /// A reference on the address space's users, or `None` if the process is exiting.
    pub(crate) fn mm_user(&self) -> Option<ARef<MmWithUser>> {
        self.mm.mmget_not_zero()
    }

    /// [`Space::mm_user`] for gmem's own workers: the reference is kept only if the
    /// address space is still used by someone besides it and the `held` references that
    /// the caller's fellow workers hold (the process itself, normally). A process that
    /// dropped its address space (it is exiting) is not kept alive by workers taking turns
    /// at it; whoever lets go of the last reference runs the address space's teardown.
    fn mm_user_while_used(&self, held: usize) -> Option<ARef<MmWithUser>> {
        let m = self.mm.mmget_not_zero()?;
        // SAFETY: `as_raw` is a live `mm_struct` (this space holds a reference on the struct,
        // and `m` one on its users).
        let users = unsafe { gmem_mm_users(self.mm.as_raw().cast()) };
        let ours = held.saturating_add(1);
        (usize::try_from(users).unwrap_or(0) > ours).then_some(m)
    }

    /// [`Space::mm_user_while_used`] for gmem's workers, counting the references they hold
    /// exactly: `None` if nobody but gmem's workers uses the address space.
    pub(crate) fn mm_for_worker(&self) -> Option<WorkerMm<'_>> {
        let mut held = self.workers_mm.lock();
        let mm = self.mm_user_while_used(*held)?;
        *held += 1;
        Some(WorkerMm { space: self, mm: ManuallyDrop::new(mm) })
    }

    /// The region containing `addr`.
    pub(crate) fn region_at(&self, addr: usize) -> Option<Arc<Region>> {
        let mut g = self.regions.lock();
        g.load(addr).map(Arc::from)
    }

    pub(crate) fn insert_region(&self, region: Arc<Region>) -> Result {
        let end = region.end() - 1;
        self.regions.insert_range(region.start..=end, region, GFP_KERNEL)?;
        Ok(())
    }

    /// Forgets the region that starts at `start` (if it is that region).
    pub(crate) fn remove_region(&self, region: &Region) {
        let mut g = self.regions.lock();
        let same = g.load(region.start).is_some_and(|r| core::ptr::eq(&*r, region));
        drop(g);
        if same {
            drop(self.regions.erase(region.start));
        }
    }

    /// The region after the one ending at `from` (iteration without holding any lock).
    pub(crate) fn next_region(&self, from: usize) -> Option<Arc<Region>> {
        let mut g = self.regions.lock();
        let mut mas = g.ma_state(from, usize::MAX);
        mas.find(usize::MAX).map(Arc::from)
    }

    /// The context of `dev` in this space, created on first use. A slot may still hold the
    /// context of an earlier device with the same id: that device destroyed it when it
    /// unregistered (`Device::quiesce`), and it is only overwritten here.
    pub(crate) fn ctx(&self, dev: &Arc<Device>) -> Result<Ctx> {
        let mut ctxs = self.ctxs.lock();
        let slot = ctxs.get_mut(dev.id).ok_or(EINVAL)?;
        if let Some((d, c)) = slot {
            if Arc::ptr_eq(d, dev) {
                return Ok(*c);
            }
        }
        let c = dev.create_ctx(self.id)?;
        *slot = Some((dev.clone(), c));
        Ok(c)
    }

    /// The MMU interval notifier of the chunk holding `addr`, registered on first use,
    /// which needs `addr` to be in a mapping gmem mirrors for this access (so that
    /// addresses the process does not map cost nothing: no notifier per chunk of them).
    /// Call with no lock held (this takes the mmap lock) and a user reference on the mm.
    pub(crate) fn notifier(&self, addr: u64, write: bool) -> Result<Arc<Notifier>> {
        let chunk = addr / CHUNK_BYTES;
        if let Some(n) = self.notifiers.lock().get(&chunk) {
            return Ok(n.clone());
        }
        // Checked and registered without `notifiers` held: both may take the mmap lock,
        // and `notifiers` is a leaf (the space's drop takes it, which can run under
        // `Device::evict_lock`, itself taken under the mmap lock).
        mirror::check(&self.mm, addr, write)?;
        // SAFETY: `self` is pinned (spaces live in `Arc`s) and outlives the notifier, which
        // `PinnedDrop` removes before anything else of the space goes.
        // Charged to the caller's memory cgroup (the process, for its own faults).
        let n =
            Arc::new(unsafe { Notifier::new(&self.mm, core::ptr::from_ref(self).cast(), chunk) }?, GFP_KERNEL_ACCOUNT)?;
        let node = RBTreeNode::new(chunk, n.clone(), GFP_KERNEL_ACCOUNT)?;
        let mut tree = self.notifiers.lock();
        if let Some(first) = tree.get(&chunk) {
            // Another fault registered the chunk meanwhile: use its notifier; ours is
            // removed when `n` and `node` drop (after the lock: removal may sleep).
            let first = first.clone();
            drop(tree);
            return Ok(first);
        }
        drop(tree.insert(node));
        Ok(n)
    }

    /// Registers the unmap watch if it is not yet: from its return on, every unmap of the
    /// process's memory reaches [`Space::forget_unmapped`]. Call with no lock held and a
    /// user reference on the mm (registration takes the mmap lock).
    pub(crate) fn watch_unmaps(&self, mm: &MmWithUser) -> Result {
        if self.unmaps.lock().is_some() {
            return Ok(());
        }
        // SAFETY: `self` is pinned (spaces live in `Arc`s) and outlives the watch, which
        // `PinnedDrop` drops before anything else of the space goes.
        let w = unsafe { UnmapWatch::new(mm, core::ptr::from_ref(self).cast()) }?;
        let mut slot = self.unmaps.lock();
        if slot.is_none() {
            *slot = Some(w);
            return Ok(());
        }
        // Another thread registered one meanwhile: ours is removed after the lock
        // (removal waits for callbacks).
        drop(slot);
        drop(w);
        Ok(())
    }

    /// Forgets what gmem remembers of `[start, end)`, which the process is unmapping (the
    /// unmap watch's callback, under the mmap lock): the advice on its pages, and the
    /// thrashing history of the addresses in it: region pages', and that of the 2 MiB
    /// blocks of ordinary memory it reaches into (keyed by the block's address,
    /// `mech/sysmem.rs`, which for the first block lies before `start`). A later mapping at
    /// these addresses is new memory and starts without either. Allocates nothing: both
    /// locks are leaves that the kernel's invalidation takes now (which memory reclaim
    /// enters too), so nothing may allocate under them.
    pub(crate) fn forget_unmapped(&self, start: u64, end: u64) {
        let page = PAGE_SIZE as u64;
        let first = start / page;
        let pages = PageRange { first, count: end.div_ceil(page).saturating_sub(first) };
        {
            let mut advice = self.sysmem_advice.lock();
            if advice.runs() != 0 {
                advice.forget(pages);
            }
        }
        let block = start & !(BLOCK_BYTES as u64 - 1);
        let mut t = self.thrash.lock();
        t.forget(start, end);
        if block < start {
            // Only the block's own key: region pages before `start` are not unmapped.
            t.forget(block, block + 1);
        }
    }

    /// The context of `dev` if one exists (no creation).
    pub(crate) fn ctx_if_any(&self, dev: &Device) -> Option<Ctx> {
        let ctxs = self.ctxs.lock();
        match ctxs.get(dev.id)? {
            Some((d, c)) if core::ptr::eq(&**d, dev) => Some(*c),
            _ => None,
        }
    }

    pub(crate) fn count(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }
}

#[pinned_drop]
impl PinnedDrop for Space {
    fn drop(self: Pin<&mut Self>) {
        // First: after this no invalidate callback runs, so none can reach the contexts
        // released below (nor the space itself). Nobody uses the space any more (this is
        // its last reference): no device runs in it, so the entries left in its contexts
        // are never used before `ctx_destroy` drops them.
        let unmaps = self.unmaps.lock().take();
        drop(unmaps);
        let notifiers = core::mem::take(&mut *self.notifiers.lock());
        for n in notifiers.values() {
            n.remove();
        }
        let mut ctxs = self.ctxs.lock();
        for slot in ctxs.iter_mut() {
            if let Some((d, _)) = slot.take() {
                // Destroyed here unless its device unregistered first and destroyed it then.
                d.release_ctx(self.id);
            }
        }
    }
}

#[cfg(CONFIG_KUNIT)]
pub(crate) mod tests {
    use super::*;
    use kernel::bindings;

    /// A space on a fresh, empty `mm` (KUnit cases run in kthreads, which have none).
    /// The caller calls `release` on it when done.
    pub(crate) fn test_space() -> Arc<Space> {
        // SAFETY: `mm_alloc` returns a new mm with one user reference, or null.
        let raw = unsafe { bindings::mm_alloc() };
        assert!(!raw.is_null());
        // SAFETY: `raw` is a live mm; the space takes its own `mmgrab` reference.
        let s = open(unsafe { Mm::from_raw(raw) });
        // SAFETY: drops the user reference `mm_alloc` gave us.
        unsafe { bindings::mmput(raw) };
        match s {
            Ok(s) => s,
            Err(_) => panic!("space::open failed"),
        }
    }
}
