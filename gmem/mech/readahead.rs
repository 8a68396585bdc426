// SPDX-License-Identifier: GPL-2.0
//! Read-ahead: a device streaming through a region gets its next 2 MiB block fetched in
//! the background while it computes on the current one, so that its copies overlap the
//! device's work instead of following it. The CPU gets the same on its way back
//! ([`home_after`], at the end of this file).
//!
//! - When: a device fault batch left its block wholly resident on the device
//!   (`policy::prefetch::read_ahead`; the density rule, `prefetch.rs`, fetched the rest),
//!   or starts a stream: it covers a quarter of a block or more, and then fetches the
//!   rest of its block with its own pages while the device has a block's frames free
//!   above its low watermark (`fault::device_fault`), and asks as soon as
//!   that batch's copies are on the link (`Env::started`), so that the next block's
//!   copies follow them without a gap and never go in front of them. A fault over
//!   several blocks asks for its last block only (or, if only an earlier one qualified,
//!   once it has fetched them all). Never for a reader taken to move down (two moves
//!   down in a row between the blocks it asked in, `Stream::downs`): it has read the
//!   blocks after its own.
//! - One chain per stream, in stream order: the next block of the same region is queued
//!   on gmem's workqueue, and its worker, once *its* copies are started, hands on to the
//!   block after it (`hand_on`: the stream's token, `Stream::token`, passes with it). So
//!   a stream's blocks reach the link in the order the device needs them, each one's
//!   allocation overlaps the copies of the one before, and its commit the copies of the
//!   one after. (Before, three lanes each took a block at once; under TCG whichever
//!   lane's worker got a CPU first put its copies on the link first, and a trace of PL
//!   showed the device waiting 12 ms for the block it needed behind a later one.)
//! - Streams: a device follows up to `device::STREAMS` regions at once
//!   (`Device::streams`), as a kernel that reads two arrays and writes a third streams
//!   through three. A fault asks in its region's stream, or takes the place of a free
//!   stream or of the one whose reader asked longest ago (`Device::stream_for`); the
//!   chain of a stream whose place was taken stops at its next hand-on. (With one chain
//!   per device, two regions' faults took the chain from each other: PS, an AXPY over two
//!   regions, ran at 0.36 of the link with read-ahead on and 0.29 without; with four
//!   streams, 0.375 against 0.332 over 12 alternating boots.)
//! - What: every page of the block that advice leaves alone, by the PREFETCH
//!   transition, in one executor batch. With pre-eviction on and while prefetch pays on
//!   the device, a worker first frees the frames its block needs beyond the device's low
//!   watermark (`room_target`: the stream has come to the device's end; it evicts as the
//!   background worker would, while the device computes); the batch then stops where the
//!   device is full, like density prefetch.
//! - The marker: read-ahead pages are mapped on the device as they arrive, except the
//!   block's first one (none in the region's last block: nothing to read after it).
//!   The device's first touch of the block faults on it (one page, no copy; the block
//!   then takes its 2 MiB entry), and that fault asks for read-ahead
//!   again, as the page cache's `PG_readahead` mark does for files. (With the whole block
//!   unmapped, that fault mapped up to 256 pages: 0.7-3.8 ms of the device's time per
//!   block in a trace of PL, part of it waiting for the block's lock; the one-page
//!   faults took 0.5-1.2 ms.)
//! - How far: up to [`DEPTH`] blocks past the block of the fault that last asked
//!   (`Stream::at`); two only, while the device lacks room above its high
//!   watermark for three, or for the blocks the region has left if fewer (`device_depth`:
//!   under pressure a block far ahead is the likeliest to be evicted unused). The chain goes on by itself while that holds, so the link does
//!   not wait for the device's next fault; where it stopped is kept
//!   (`Stream::ahead_to`), and the next fault that asks starts it again from there.
//!
//! Lifetimes: the work item owns references to the device and the region. The region's
//! teardown marks it dead under each block's lock, and the device's unregistration marks
//! it dead before it evacuates; the worker checks both under the block lock and then does
//! nothing (and makes no room for a device that is going away). It takes the mm only
//! through `Space::mm_for_worker` (no fetch for an exiting process: nobody but gmem's
//! workers uses its address space; the workers' own references are counted exactly, so
//! that workers taking turns do not keep it alive) and the mmap lock itself, in the fault
//! paths' order (mmap lock, then the block lock); it runs on gmem's workqueue, which
//! module unload drains.
//! The token is always given back: every worker hands on exactly once (when its copies
//! start, or when its fetch ends without any), by queueing the next worker or by clearing
//! the token; a fault that found it taken only moved `Stream::at`, which whoever clears it
//! (a worker, or a fault whose chain did not start) checks again (`give_back`). The
//! hand-on runs under the block lock and takes none.
//! Switch off with `readahead=0` in `/sys/kernel/debug/gmem/control`.

use crate::exec::migrate::{self, Env, Step};
use crate::mech::evict::{self, Why};
use crate::mech::{prefetch, thrash};
use crate::obj::device::{DevStats, Device, Stream};
use crate::obj::region::{Pages, Region, AHEAD_LANES, BLOCK_BYTES, BLOCK_PAGES};
use crate::obj::space::Space;
use crate::obj::{tune, wq};
use crate::policy::page_state::{transition, Event, Loc, Target};
use crate::policy::prefetch::{chain_next, chain_start, downs_after, lane_next};
use core::sync::atomic::{
    fence, AtomicBool,
    Ordering::{Acquire, Relaxed, Release, SeqCst},
};
use kernel::{
    mm::Mm,
    prelude::*,
    sync::Arc,
    workqueue::{impl_has_work, new_work, RawWorkItem, Work, WorkItem},
};

/// How many blocks read-ahead runs ahead of the block of its reader's last fault, at most
/// (also the number of lanes read-ahead home takes turns on).
pub(crate) const DEPTH: usize = AHEAD_LANES;

/// How far a device's read-ahead in `r` runs from the reader's block at `at`: [`DEPTH`]
/// blocks while the device has room above its high watermark for them, or for what is
/// left of the region after `at` if that is less, else two. On a device under pressure
/// every block fetched ahead takes frames that must be freed first, and a block fetched
/// far ahead is the likeliest to be evicted before it is used. (Counting only the blocks
/// the region still has: near its end, a region that fits read ahead two blocks only, as
/// if the device were short, and a trace of PL showed the device waiting for the last.)
fn device_depth(dev: &Device, r: &Region, at: usize) -> usize {
    let left = r.end().saturating_sub(at.saturating_add(BLOCK_BYTES)).div_ceil(BLOCK_BYTES);
    let room = (DEPTH.min(left) * BLOCK_PAGES) as u64;
    if dev.frames_free_hint() >= dev.high().saturating_add(room) {
        DEPTH
    } else {
        DEPTH.min(2)
    }
}

/// A region's identity for `Stream::of` (compared only, never dereferenced).
fn region_id(r: &Arc<Region>) -> usize {
    Device::stream_id(r)
}

/// The lane flag of the block at `block_va` among `lanes`.
fn lane(lanes: &[AtomicBool; AHEAD_LANES], block_va: usize) -> &AtomicBool {
    &lanes[(block_va / BLOCK_BYTES) % lanes.len()]
}

/// Queues, with `queue`, each of the `depth` (at most [`DEPTH`]) blocks after the one at
/// `block_va` whose lane is free (the lane is taken for it, and given back if `queue`
/// fails).
fn ahead(lanes: &[AtomicBool; AHEAD_LANES], block_va: usize, depth: usize, mut queue: impl FnMut(usize) -> bool) {
    for k in 1..=depth.min(DEPTH) {
        let Some(next) = k.checked_mul(BLOCK_BYTES).and_then(|d| block_va.checked_add(d)) else { return };
        let flag = lane(lanes, next);
        if flag.compare_exchange(false, true, Acquire, Relaxed).is_ok() && !queue(next) {
            flag.store(false, Release);
        }
    }
}

/// A lane's worker is done with the block at `block_va`: while `go_on()` holds, it queues
/// with `queue` the lane's next block for the reader last seen at `at()`
/// (`policy::prefetch::lane_next`: the lane's first block after both, within `depth`), and
/// otherwise gives the lane back. A fault that asked meanwhile found the lane taken and
/// only moved the reader on (`home_after`): once the lane is free, the reader is looked
/// up again, and if it moved, the lane is taken again (unless that fault's own request
/// took it) and the choice made again from there.
fn lane_done(
    lanes: &[AtomicBool; AHEAD_LANES],
    block_va: usize,
    depth: usize,
    at: impl Fn() -> usize,
    go_on: impl Fn() -> bool,
    mut queue: impl FnMut(usize) -> bool,
) {
    let flag = lane(lanes, block_va);
    let mut seen = at();
    loop {
        let next = lane_next(block_va / BLOCK_BYTES, seen / BLOCK_BYTES, lanes.len(), depth)
            .and_then(|b| b.checked_mul(BLOCK_BYTES));
        if next.is_some_and(|next| go_on() && queue(next)) {
            return;
        }
        flag.store(false, Release);
        // Pairs with the fence in `home_after`: either its fault finds the lane free, or
        // this sees its `cpu_at` (a store then a load on each side, which may otherwise
        // pass each other).
        fence(SeqCst);
        let now = at();
        if now == seen || flag.compare_exchange(false, true, Acquire, Relaxed).is_err() {
            return;
        }
        seen = now;
    }
}

/// One queued read-ahead: the block at `block_va` of `region`, for `dev`'s stream `k`.
#[pin_data]
pub(crate) struct ReadAhead {
    dev: Arc<Device>,
    region: Arc<Region>,
    k: usize,
    block_va: usize,
    #[pin]
    work: Work<ReadAhead>,
}

impl_has_work! {
    impl HasWork<Self> for ReadAhead { self.work }
}

impl WorkItem for ReadAhead {
    type Pointer = Arc<ReadAhead>;

    /// Fetches the block, handing the chain on to the next block once the block's copies
    /// are started (or once the fetch is over, if it started none).
    fn run(this: Arc<ReadAhead>) {
        let handed = core::cell::Cell::new(false);
        let hand_on = || {
            if !handed.replace(true) {
                hand_on(&this.dev, this.k, &this.region, this.block_va);
            }
        };
        this.fetch(&hand_on);
        hand_on();
    }
}

/// The worker of stream `k`'s chain for the block at `done` of `r` hands the token on: it
/// queues the next block (`policy::prefetch::chain_next`) if read-ahead is on, the device
/// and region live, `r` is still the stream's region (its place may have gone to another
/// stream; another process may stream at nearby addresses) and the block lies within the
/// depth; else it gives the token back. A fault that asked meanwhile found the token taken
/// and only moved `Stream::at` on: if it did, the chain is tried again from there.
fn hand_on(dev: &Arc<Device>, k: usize, r: &Arc<Region>, done: usize) {
    let st = &dev.streams[k];
    let mut at = st.at.load(Relaxed);
    loop {
        let go_on = tune::READAHEAD.load(Relaxed) && dev.alive() && !r.is_dead() && st.of.load(Relaxed) == region_id(r);
        let next = chain_next(done / BLOCK_BYTES, at / BLOCK_BYTES, device_depth(dev, r, at))
            .and_then(|b| b.checked_mul(BLOCK_BYTES));
        if let Some(next) = next.filter(|_| go_on) {
            if queue(dev, k, r, next) {
                return;
            }
        }
        match give_back(st, r, at) {
            Some(now) => at = now,
            None => return,
        }
    }
}

/// Gives the token of stream `st` back, its reader having been at `at` when the caller
/// decided. A fault that asked meanwhile found the token taken and only moved `Stream::at`
/// on: if one did, in `r`, the token is taken again and the reader's new position
/// returned, for the caller to try the chain from there. (A fault in another region that
/// took this stream's place meanwhile is not served: nothing here holds that region. Its
/// next ask is, with the token free.)
fn give_back(st: &Stream, r: &Arc<Region>, at: usize) -> Option<usize> {
    st.token.store(false, Release);
    // Pairs with the fence in `start_chain`: either that fault sees the token free, or
    // this sees its `at` and `of` (a store then a load on each side, which may otherwise
    // pass each other).
    fence(SeqCst);
    let now = st.at.load(Relaxed);
    // (A fault stores `at` before `of`: a position outside `r` is another region's even if
    // `of` still names `r`. One inside `r` from a region at the same addresses in another
    // process would only cost a read-ahead of `r` unused.)
    if now == at || st.of.load(Relaxed) != region_id(r) || r.index(core::cmp::max(now, r.start)).is_none() {
        return None;
    }
    st.token.compare_exchange(false, true, Acquire, Relaxed).ok()?;
    Some(now)
}

/// A device fault at the block at `block_va` (2 MiB aligned) of `r` asks for read-ahead:
/// the reader is recorded there, and unless a chain runs (it goes on from the new
/// position by itself), one starts at the next block, or where the last chain in this
/// region stopped if that is further on and within the depth.
pub(crate) fn after(dev: &Arc<Device>, r: &Arc<Region>, block_va: usize) {
    start_chain(dev, r, block_va, true);
}

/// [`after`], but a chain it starts starts at exactly the next block, not where the last
/// chain in this region stopped: for a fault that is about to fetch that very block
/// itself (`fault::device_fault`), which the chain must not overtake.
pub(crate) fn after_next(dev: &Arc<Device>, r: &Arc<Region>, block_va: usize) {
    start_chain(dev, r, block_va, false);
}

/// [`after`]; `resume`: start where the last chain in this region stopped, if further on.
fn start_chain(dev: &Arc<Device>, r: &Arc<Region>, block_va: usize, resume: bool) {
    if !tune::READAHEAD.load(Relaxed) || !dev.alive() {
        return;
    }
    // The region's stream, or the place of a free or the stalest one.
    let k = dev.stream_for(r);
    let st = &dev.streams[k];
    let was_at = st.at.swap(block_va, Relaxed);
    let now = crate::obj::sched::now_ns();
    let before = st.asked_ns.swap(now, Relaxed);
    st.va.store(r.start, Relaxed);
    let same = st.of.swap(region_id(r), Relaxed) == region_id(r);
    // The stream's pace: from its last ask in one block to its first in the next (several
    // asks in one block keep it); none for a stream new to this place. Racing asks may
    // store either's.
    // And its heading: the moves down in a row (the eviction verdicts assume an upward
    // reader, `Device::behind_reader`). Stored after `at`, without ordering, and racing
    // asks may count a move twice or not at all: an evictor may see a heading a move
    // late, a hint wrong for a few batches at worst.
    if !same || before == 0 {
        st.gap_ns.store(0, Relaxed);
        st.downs.store(0, Relaxed);
    } else if was_at != block_va {
        st.gap_ns.store(now.saturating_sub(before), Relaxed);
        st.downs.store(downs_after(st.downs.load(Relaxed), was_at, block_va), Relaxed);
    }
    // Pairs with the fence in `give_back` (see there), and with the one in
    // `Device::forget_stream`: either the region's teardown sees it named here and forgets
    // it, or this sees it dead (a later region at the same address must not inherit it).
    fence(SeqCst);
    if r.is_dead() {
        dev.forget_stream(r);
        return;
    }
    // A reader taken to move down reads next what lies below it, and read-ahead queues
    // upwards only, where it has been: no chain for it (one already running stops at its
    // next hand-on, past its depth from the reader).
    if st.moving_down() {
        return;
    }
    if st.token.compare_exchange(false, true, Acquire, Relaxed).is_err() {
        return;
    }
    let (mut block_va, mut resume) = (block_va, resume);
    loop {
        let to = (same && resume).then(|| st.ahead_to.load(Relaxed));
        // Where the last chain stopped in this region, unless that is stale
        // (`policy::prefetch::chain_start`), in block numbers.
        let at = block_va / BLOCK_BYTES;
        let start =
            chain_start(at.saturating_add(1), at, to.map(|t| t / BLOCK_BYTES), device_depth(dev, r, block_va), DEPTH)
                .and_then(|b| b.checked_mul(BLOCK_BYTES));
        if start.is_some_and(|start| queue(dev, k, r, start)) {
            return;
        }
        // A fault that asked since is served from where it asked, as `after_next` would
        // (which of the two it called is not known: the next block may be the one it is
        // about to fetch itself, which a chain resumed further on would leave behind).
        match give_back(st, r, block_va) {
            Some(now) => (block_va, resume) = (now, false),
            None => return,
        }
    }
}

/// Queues the read-ahead of the block at `block_va` of `r` for `dev`'s stream `k` (the
/// caller holds the stream's token, which the item takes over) and records it as the
/// chain's last; false if that block lies outside `r` or the item could not be queued.
fn queue(dev: &Arc<Device>, k: usize, r: &Arc<Region>, block_va: usize) -> bool {
    if r.index(block_va).is_none() {
        return false;
    }
    // Recorded before the item can run and hand on (which records the block after it):
    // never overwritten by an older value. (If the item cannot be queued, the next
    // request starts one block further on than it might: read-ahead only.)
    dev.streams[k].ahead_to.store(block_va.saturating_add(BLOCK_BYTES), Relaxed);
    enqueue(Arc::pin_init(
        pin_init!(ReadAhead { dev: dev.clone(), region: r.clone(), k, block_va, work <- new_work!("gmem_readahead") }),
        GFP_KERNEL,
    ))
}

/// Queues a freshly made work item on gmem's workqueue; false if it could not be made or
/// there is no queue.
fn enqueue<T>(item: Result<Arc<T>>) -> bool
where
    Arc<T>: RawWorkItem<0> + Send + 'static,
{
    match (item, wq::get()) {
        // A fresh work item cannot be queued already.
        (Ok(item), Some(q)) => {
            let _ = q.enqueue(item);
            true
        }
        _ => false,
    }
}

impl ReadAhead {
    /// Fetches the block; `started` is called once its copies are started.
    fn fetch(&self, started: &dyn Fn()) {
        let (dev, r) = (&self.dev, &self.region);
        let d = dev.id as u8;
        // Not for a process that is exiting (nobody else uses its address space).
        let Some(mm) = r.space.mm_for_worker() else { return };
        let mmap = mm.mmap_read_lock();
        let vma = mmap.vma_lookup(r.start).filter(|v| v.start() == r.start);
        let Some(first) = r.index(self.block_va) else { return };
        let Ok(block) = r.block(first) else { return };
        let Ok(mut steps) = KVec::<Step>::with_capacity(BLOCK_PAGES, GFP_KERNEL) else { return };
        let mut p = r.lock(&block);
        if r.is_dead() || !dev.alive() {
            return;
        }
        let frames = plan(r, &p, d, &mut steps);
        if let Some(target) = room_target(dev, frames, &mm) {
            // Room first, with the block lock dropped; then the block as it is now.
            drop(p);
            evict::make_room(dev, target, Why::Ahead, None);
            p = r.lock(&block);
            if r.is_dead() || !dev.alive() {
                return;
            }
            plan(r, &p, d, &mut steps);
        }
        let n = prefetch::speculate(&Env::access_then(r, vma, started), dev, &mut p, &steps);
        DevStats::add(&dev.stats.readahead, n);
    }
}

/// The read-ahead of the locked block `p` of `r` to device `d`, into `steps` (emptied
/// first, with room for the block's pages): every page that advice leaves alone, by the
/// PREFETCH transition, mapped as it arrives, except the first of them if the region goes
/// on after the block: the device's first touch of the block faults on that one (without
/// a copy) and reads further ahead (the module documentation's marker). The region's last
/// block has nothing further to read, and no marker: the device goes into each part of it
/// as soon as that part is mapped, instead of faulting on the marker and waiting for the
/// whole block's lock (the last 2.1 ms of a PL device-fault run in a trace, before the
/// device's last 2.8 ms of compute). Returns how many device frames it takes.
fn plan(r: &Region, p: &Pages, d: u8, steps: &mut KVec<Step>) -> u64 {
    let advice = *r.advice.lock();
    steps.clear();
    let mut frames = 0u64;
    let marker = p.range().end < r.npages;
    let mut stepper = prefetch::Stepper::new(d);
    for i in p.range() {
        let Some(mut st) = stepper.step(p, &advice, i) else { continue };
        if st.a.alloc_frame.is_some() {
            frames += 1;
        }
        if steps.is_empty() && marker {
            st.a.map_dev = None;
        }
        // Capacity for the block's pages reserved by the caller.
        let _ = steps.push(st, GFP_NOWAIT);
    }
    frames
}

/// Pre-eviction for a stream: how many frames `dev` should have free before a worker reads
/// ahead a block needing `frames` of them (those plus its low watermark), or `None` when
/// it has them already or the worker should not evict for them: pre-eviction is off, the
/// device is going away, prefetch has not been paying on it lately (a random workload
/// whose read-ahead mostly misses would evict for more misses), or the reader's dmem
/// cgroup has no room left on it (the fetch would fail on its limit anyway, after taking
/// other cgroups' frames). It then evicts as the background worker would, counted as
/// pre-evicted, on its worker, while the device computes (`Why::Ahead`). Without this,
/// under oversubscription read-ahead found at most the background worker's few frames (its
/// high watermark, 128 by default), read a block ahead only in part, and the device then
/// faulted on the rest and evicted for itself, on its critical path.
fn room_target(dev: &Device, frames: u64, mm: &Mm) -> Option<usize> {
    if frames == 0 || !tune::PREEVICT.load(Relaxed) || !dev.alive() || !dev.prefetch_pays() {
        return None;
    }
    let want = frames.saturating_add(dev.low());
    if dev.frames_free() >= want || !dev.dmem.has_room(mm) {
        return None;
    }
    usize::try_from(want).ok()
}

/// One queued read-ahead to the host: the device pages of the block at `block_va` of
/// `region` come home for the CPU.
///
/// - When: a CPU fault continues a stream (`prefetch::cpu_window`: queued before its own
///   batch), enters the block after the last streamed one (`Region::cpu_at`: queued before
///   it waits for its block's lock), or left its block with nothing on a device
///   (fault-around brought the rest home): the CPU streams through the region home, so
///   its next [`DEPTH`] blocks are brought home while the CPU works on this one,
///   each on its own lane (`Region::homing_ahead`: consecutive blocks on different lanes,
///   one block at a time per lane): while one lane allocates host pages or commits, the
///   others' copies keep the link busy.
/// - What: every unadvised, unpinned page of the next block held by a device, without a
///   duplicate, by the PREFETCH-to-host transition, in one executor batch. The pages come
///   home unmapped: the CPU's first touch of the block faults, maps the block's host pages
///   at once (`fault::cpu_fault`'s map-around) and reads the following block ahead.
/// - Lifetimes: the work item owns a reference to the region (and through it the space).
///   Teardown marks the region dead under each block's lock, which the worker checks
///   under the block lock; devices are reached only through the executor, which enters
///   their callback sections. It takes the mm only through `Space::mm_for_worker`
///   (nothing for an exiting process) and no mmap lock: a move home revokes no CPU
///   mapping (the CPU maps no device page), as eviction does not. gmem's workqueue is
///   drained at module unload.
#[pin_data]
pub(crate) struct HomeAhead {
    region: Arc<Region>,
    block_va: usize,
    #[pin]
    work: Work<HomeAhead>,
}

impl_has_work! {
    impl HasWork<Self> for HomeAhead { self.work }
}

impl WorkItem for HomeAhead {
    type Pointer = Arc<HomeAhead>;

    fn run(this: Arc<HomeAhead>) {
        this.fetch();
        let r = &this.region;
        lane_done(
            &r.homing_ahead,
            this.block_va,
            DEPTH,
            || r.cpu_at.load(Relaxed),
            || tune::READAHEAD.load(Relaxed) && !r.is_dead(),
            |next| queue_home(r, next),
        );
    }
}

/// Queues read-ahead to the host of the [`DEPTH`] blocks after the one at `block_va`
/// (2 MiB aligned) of `r`, each if it lies in `r` and has been touched, read-ahead is on,
/// and its lane is free.
pub(crate) fn home_after(r: &Arc<Region>, block_va: usize) {
    // Recorded even with read-ahead off: CPU fault-around follows streams by it too.
    r.cpu_at.store(block_va, Relaxed);
    if !tune::READAHEAD.load(Relaxed) {
        return;
    }
    // Pairs with the fence in `lane_done` (see there).
    fence(SeqCst);
    ahead(&r.homing_ahead, block_va, DEPTH, |next| queue_home(r, next));
}

/// Queues the read-ahead to the host of the block at `block_va` of `r` (whose lane flag
/// the caller holds); false if that block lies outside `r`, was never
/// touched (it holds nothing on a device), or the item could not be queued.
fn queue_home(r: &Arc<Region>, block_va: usize) -> bool {
    let Some(first) = r.index(block_va) else { return false };
    if r.block_if_any(first).is_none() {
        return false;
    }
    enqueue(Arc::pin_init(
        pin_init!(HomeAhead { region: r.clone(), block_va, work <- new_work!("gmem_homeahead") }),
        GFP_KERNEL,
    ))
}

impl HomeAhead {
    fn fetch(&self) {
        let r = &self.region;
        // Not for a process that is exiting (nobody else uses its address space).
        let Some(_mm) = r.space.mm_for_worker() else { return };
        let Some(first) = r.index(self.block_va) else { return };
        let Some(block) = r.block_if_any(first) else { return };
        let mut p = r.lock(&block);
        if r.is_dead() {
            return;
        }
        let advice = *r.advice.lock();
        let Ok(mut steps) = KVec::<Step>::with_capacity(BLOCK_PAGES, GFP_KERNEL) else { return };
        for i in p.range() {
            let s = p.state(i);
            // Advice decides placement for advised pages; duplicates are devices' reads.
            if advice.get(i as u64) != 0 || !matches!(s.loc(), Loc::Device(_)) || s.dup_mask() != 0 {
                continue;
            }
            let Ok((next, a)) = transition(s, Event::Prefetch { to: Target::Host }) else { continue };
            // Capacity reserved above.
            let _ = steps.push(Step { i, prev: s, next, a }, GFP_NOWAIT);
        }
        if !steps.is_empty() {
            let out = migrate::apply_batch(&Env::background(r), &mut p, &steps);
            Space::add(&r.space.stats.home_ahead, out.done as u64);
            // Seen by thrashing detection as a CPU fault's moves are: a device that
            // keeps taking these pages back gets them mapped remotely instead.
            thrash::record_moves(None, &r.space, r, &steps[..out.done]);
        }
    }
}
