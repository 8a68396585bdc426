// SPDX-License-Identifier: GPL-2.0
//! Moving advice: PREFETCH, PIN, UNPIN and DONTNEED applied to a page range of one region,
//! block by block, with the mmap lock held for CPU zaps. A full device is made room on
//! (eviction) and the page retried.
//!
//! The range is worked through in chunks of one block (up to 512 pages): one mmap lock,
//! one block lock, one executor batch (or a few, when the device fills up or a page
//! refuses). Between chunks the mmap lock and the reference on the address space's users
//! are dropped and the task may be rescheduled. Not holding the mm's users across chunks
//! is what lets an exiting process's `exit_mmap` run (and tear the region down) while a
//! queued prefetch of it is still running: the prefetch then fails with `EFAULT`/`ENOENT`
//! at its next chunk instead of migrating pages for a dead process.
//!
//! **Lanes.** A PREFETCH of more than one block runs in up to `lanes` lanes at once
//! (`tune::LANES`, default 3): the caller and helper work items on gmem's workqueue claim
//! blocks from one cursor, in address order, except that a short first chunk (the end of a
//! block, shorter than a batch's first part) is claimed last (`first_chunk_last`). While
//! one lane's copies are on the link, the others set up, commit and map their blocks, so
//! the link does not idle between blocks (a lane holds one block lock, never two: no lock
//! nesting). The caller's lane starts alone: the helpers are queued once its first copy is
//! started, so that the link starts as soon as one lane can start it. PIN, UNPIN and
//! DONTNEED stay in one lane (PIN counts what it pinned; the others are cheap).
//!
//! Stopping: every lane checks the shared `cancel` flag (set when the file of an
//! asynchronous prefetch is closed, as a killed process's is) before each block it claims;
//! the caller's lane also checks for a fatal signal (its own task's: a helper runs on a
//! kworker). A stop or the first error of any lane stops every lane (`EINTR` or that
//! error): a lane finishes the block it is in, claims no more and is done. So once the
//! owner is cancelled, at most one block per lane is still moved. A lane that must wait
//! for room inside its block (eviction, or frames in transit, which can take a fifth of a
//! second) checks the same reasons first and ends its block early instead. A process
//! that exits does not close the file at once (its mappings hold it until the address
//! space is torn down), so the lanes also stop when nobody but gmem's workers uses the
//! address space any more: each lane takes its reference for a block through
//! `Space::mm_for_worker`, which counts the references gmem's workers hold, exactly, and
//! gives it back under the same lock. Two lanes taking turns at `mmget_not_zero` would
//! otherwise keep a dead process's address space, and the file with it, alive between
//! them.
//!
//! Lifetimes: a helper owns a reference to the shared [`Lanes`], which owns the region; it
//! takes the mm only through `Space::mm_for_worker` and the mmap lock itself, per block, in the
//! fault paths' order. The caller holds no mmap or block lock while it waits for helpers (a
//! helper's mmap read lock could otherwise queue behind a writer that waits for the
//! caller's). It waits only for the helpers that are inside a block (`Lanes::busy`, under
//! `Lanes::state`): a helper the workqueue starts later finds nothing left to claim and
//! does nothing (or takes the chunk left for last, and counts as inside a block while it
//! is), so the caller never waits for the workqueue itself (which matters when
//! the caller is an asynchronous prefetch running on that same queue).

use crate::exec::migrate::{self, Env};
use crate::mech::evict::{self, Why, Within};
use crate::obj::device::{DevStats, Device};
use crate::obj::region::Region;
use crate::obj::{devices, pin_quota, sched, tune, wq};
use crate::policy::page_state::{transition, ByState, Event, PageState};
use core::sync::atomic::{
    AtomicBool,
    Ordering::{Acquire, Relaxed},
};
use kernel::{
    mm::MmWithUser,
    new_condvar, new_mutex,
    prelude::*,
    sync::{Arc, CondVar, Mutex},
    workqueue::{impl_has_work, new_work, Work, WorkItem},
};

/// Applies the moving `event` (PREFETCH to `target` or the host, PIN on `target`, UNPIN,
/// DONTNEED) to the pages `first..first + count` of `region`; stops early with `EINTR` on
/// a fatal signal or once `cancel` is set.
pub(crate) fn move_pages(
    region: &Arc<Region>,
    first: usize,
    count: usize,
    event: Event,
    target: Option<u8>,
    cancel: Option<&Arc<AtomicBool>>,
) -> Result {
    let space = &region.space;
    let end = first.checked_add(count).ok_or(EINVAL)?;
    let dev = target.and_then(|d| devices::get(d as usize));
    // Pages this PIN charged to the process's pin quota up front (`pin_quota.rs`).
    let mut charged = 0u64;
    if let (Event::Pin { .. }, Some(dev)) = (event, &dev) {
        // A pin must fit beside the other pins: refuse it up front rather than half way.
        // Every page of the range that is not pinned yet becomes a pinned frame of `d`.
        let newly = {
            // Pages of untouched blocks are not pinned; only touched blocks are walked.
            let mut pinned = 0u64;
            let mut from = first;
            while let Some(block) = region.next_block(from) {
                let p = region.lock(&block);
                let r = p.range();
                if r.start >= end {
                    break;
                }
                from = r.end;
                for i in core::cmp::max(r.start, first)..core::cmp::min(r.end, end) {
                    pinned += u64::from(p.state(i).pinned());
                }
                drop(p);
                sched::cond_resched();
            }
            (end - first) as u64 - pinned
        };
        if newly + dev.frames_pinned() > dev.nr_frames {
            return Err(ENOSPC);
        }
        pin_quota::charge(space.mm(), newly)?;
        charged = newly;
    }
    let lanes = tune::LANES.load(Relaxed).clamp(1, tune::MAX_LANES) as usize;
    let blocks = region.block_pages(first).end < end;
    if matches!(event, Event::Prefetch { .. }) && lanes > 1 && blocks {
        return in_lanes(region, first, end, event, dev, lanes - 1, cancel);
    }
    let mut pinned = 0u64;
    let r = move_range(region, first, end, event, &dev, cancel, &mut pinned);
    // What the PIN charged but did not pin (an error part way, or pages pinned by someone
    // else meanwhile) goes back; each page it did pin stays charged until its pin ends.
    pin_quota::uncharge(space.mm(), charged.saturating_sub(pinned));
    r
}

/// The page loop of [`move_pages`] in one lane; counts the pages it pinned in `pinned`.
fn move_range(
    region: &Arc<Region>,
    first: usize,
    end: usize,
    event: Event,
    dev: &Option<Arc<Device>>,
    cancel: Option<&Arc<AtomicBool>>,
    pinned: &mut u64,
) -> Result {
    // Advice that leaves never-touched pages alone (DONTNEED, UNPIN) skips untouched
    // metadata blocks whole: on a terabyte region it must not walk every page.
    let skip_untouched =
        matches!(transition(PageState::EMPTY, event), Ok((n, a)) if n == PageState::EMPTY && a == Default::default());
    let mut i = first;
    while i < end {
        stopped(cancel, true)?;
        if skip_untouched {
            match region.touched_from(i) {
                Some(t) if t < end => i = t,
                _ => return Ok(()),
            }
        }
        let chunk_end = core::cmp::min(end, region.block_pages(i).end);
        // Only while the process (anyone but gmem's workers) still uses the address space.
        let mm = region.space.mm_for_worker().ok_or(EFAULT)?;
        move_block(region, &mm, i, chunk_end, event, dev, pinned, &|| stopped(cancel, true), None)?;
        i = chunk_end;
        sched::cond_resched();
    }
    Ok(())
}

/// One chunk: the pages `first..chunk_end` of one block, under one mmap read lock and one
/// block lock (dropped only to evict). Each time it must wait for room, it first asks
/// `stop` (called without the block lock) whether its lane should end instead: a wait
/// for frames in transit can last a fifth of a second. `head_started` is called once each
/// batch's first copy is started (`Env::head_started`).
#[allow(clippy::too_many_arguments)]
fn move_block(
    region: &Arc<Region>,
    mm: &MmWithUser,
    first: usize,
    chunk_end: usize,
    event: Event,
    dev: &Option<Arc<Device>>,
    pinned: &mut u64,
    stop: &dyn Fn() -> Result,
    head_started: Option<&dyn Fn()>,
) -> Result {
    let space = &region.space;
    let mmap = mm.mmap_read_lock();
    let vma = mmap.vma_lookup(region.start).filter(|v| v.start() == region.start);
    // Eviction attempts for the current page; the budget is per page (refilled after
    // every batch that makes progress), so a long range does not run out of it.
    let mut retries = 0;
    let mut waits = 0;
    let mut steps: KVec<migrate::Step> = KVec::with_capacity(migrate::BATCH_PAGES, GFP_KERNEL)?;
    let block = region.block(first)?;
    let mut p = region.lock(&block);
    let mut i = first;
    while i < chunk_end {
        if region.is_dead() {
            return Err(ENOENT);
        }
        steps.clear();
        let mut refusal = None;
        let mut j = i;
        let mut transitions = ByState::new();
        while j < chunk_end && steps.len() < migrate::BATCH_PAGES {
            let s = p.state(j);
            match transitions.get(s, |s| transition(s, event)) {
                Err(r) => {
                    refusal = Some(migrate::refusal_errno(r));
                    break;
                }
                Ok((next, acts)) if next != s || acts != Default::default() => {
                    steps.push(migrate::Step { i: j, prev: s, next, a: acts }, GFP_KERNEL)?;
                }
                Ok(_) => {}
            }
            j += 1;
        }
        let out = migrate::apply_batch(&Env::access(region, vma).head_then(head_started), &mut p, &steps);
        for st in &steps[..out.done] {
            *pinned += u64::from(!st.prev.pinned() && st.next.pinned());
        }
        if let (Event::Prefetch { .. }, Some(dev)) = (event, dev) {
            DevStats::add(&dev.stats.prefetched, out.done as u64);
        }
        if out.done < steps.len() {
            // Steps from `steps[out.done]` on were not applied.
            i = steps[out.done].i;
            match out.res {
                Err(e) if e == ENOSPC => {
                    // The device is full, or the owner's dmem cgroup at its limit there: evict
                    // (within that cgroup; without the block lock), then retry.
                    let acts = steps[out.done].a;
                    drop(p);
                    stop()?;
                    retries = if out.done > 0 { 1 } else { retries + 1 };
                    if retries > 64 {
                        return Err(ENOMEM);
                    }
                    let within = out.limit.as_ref().map(|limit| Within { limit, mm: Some(space.mm()) });
                    if evict::make_room_for(&acts, 64, Why::Advice, within, &mut waits)? {
                        // It waited for frames in transit (another lane's batch, a
                        // fault's): not a failed round.
                        retries -= 1;
                    }
                    p = region.lock(&block);
                    continue;
                }
                Err(e) => return Err(e),
                Ok(()) => return Err(EINVAL),
            }
        }
        out.res?;
        retries = 0;
        i = j;
        if let Some(e) = refusal {
            return Err(e);
        }
    }
    Ok(())
}

/// `EINTR` once `cancel` is set or, when `caller` (the lane runs in the task that asked),
/// a fatal signal is pending.
fn stopped(cancel: Option<&Arc<AtomicBool>>, caller: bool) -> Result {
    let cancelled = cancel.is_some_and(|c| c.load(Acquire));
    if cancelled || (caller && sched::fatal_signal_pending()) {
        return Err(EINTR);
    }
    Ok(())
}

/// What the lanes of one PREFETCH share, under [`Lanes::state`].
struct LaneState {
    /// The next page to claim in address order.
    cursor: usize,
    /// The chunk claimed once the cursor is at the end, if any: the range's short first
    /// chunk (`first_chunk_last`), which lies before the cursor.
    last: Option<(usize, usize)>,
    /// Helpers inside a block.
    busy: usize,
    /// Set on the first error (or a stop of the caller's): no more claims.
    stop: bool,
    /// The first error of any lane.
    err: Option<Error>,
}

/// One PREFETCH in lanes (see the module documentation).
#[pin_data]
struct Lanes {
    region: Arc<Region>,
    event: Event,
    dev: Option<Arc<Device>>,
    end: usize,
    /// The owner's cancellation, seen by every lane.
    cancel: Option<Arc<AtomicBool>>,
    #[pin]
    state: Mutex<LaneState>,
    /// Signalled when a helper leaves a block.
    #[pin]
    idle: CondVar,
}

impl Lanes {
    /// Claims the next chunk (the rest of the block at the cursor; once the cursor is at the
    /// end, the chunk left for last), or `None` when every page is claimed or the lanes
    /// stopped. A helper's claim counts it busy.
    fn claim(&self, helper: bool) -> Option<(usize, usize)> {
        let mut st = self.state.lock();
        if st.stop {
            return None;
        }
        let (i, e) = if st.cursor < self.end {
            let i = st.cursor;
            let e = core::cmp::min(self.end, self.region.block_pages(i).end);
            st.cursor = e;
            (i, e)
        } else {
            st.last.take()?
        };
        st.busy += usize::from(helper);
        Some((i, e))
    }

    /// Records the outcome of a chunk (the first error stops every lane); a helper is no
    /// longer busy.
    fn done(&self, r: Result, helper: bool) {
        let mut st = self.state.lock();
        if let Err(e) = r {
            st.stop = true;
            st.err.get_or_insert(e);
        }
        if helper {
            st.busy -= 1;
            self.idle.notify_all();
        }
    }

    /// `EINTR` once this lane should end inside its block: the owner cancelled, the
    /// caller's task is being killed (in the caller's lane), or another lane stopped
    /// them all (the caller's kill, or an error). Takes [`Lanes::state`]: call it without
    /// a block lock.
    fn stopped(&self, helper: bool) -> Result {
        stopped(self.cancel.as_ref(), !helper)?;
        if self.state.lock().stop {
            return Err(EINTR);
        }
        Ok(())
    }

    /// Runs chunks until none is left; a cancellation (or, in the caller's lane, a fatal
    /// signal) seen before a claim stops every lane. `first_copy` (the caller's lane: it
    /// queues the helpers, once) is called when a batch's first copy is started and after
    /// every chunk.
    fn work(&self, helper: bool, first_copy: Option<&dyn Fn()>) {
        let mut pinned = 0;
        loop {
            if let Err(e) = stopped(self.cancel.as_ref(), !helper) {
                self.done(Err(e), false);
                break;
            }
            let Some((i, e)) = self.claim(helper) else { break };
            // A reference for this block, if anyone but gmem's workers still uses the
            // address space (the process, normally).
            let r = match self.region.space.mm_for_worker() {
                Some(mm) => move_block(
                    &self.region,
                    &mm,
                    i,
                    e,
                    self.event,
                    &self.dev,
                    &mut pinned,
                    &|| self.stopped(helper),
                    first_copy,
                ),
                None => Err(EFAULT),
            };
            self.done(r, helper);
            // Once the caller's first block is done, its helpers are queued if its first
            // copy did not queue them (a block with nothing to copy); after an error, with
            // the lanes stopped, they claim nothing.
            if let Some(f) = first_copy {
                f();
            }
            sched::cond_resched();
        }
    }
}

/// A helper lane: a work item on gmem's workqueue.
#[pin_data]
struct Helper {
    lanes: Arc<Lanes>,
    #[pin]
    work: Work<Helper>,
}

impl_has_work! {
    impl HasWork<Self> for Helper { self.work }
}

impl WorkItem for Helper {
    type Pointer = Arc<Helper>;

    fn run(this: Arc<Helper>) {
        this.lanes.work(true, None);
    }
}

/// Where the lanes of a PREFETCH over `first..end` start claiming, and the chunk they
/// claim last, if any: the range's first chunk when it is only the end of a block, shorter
/// than a batch's first part (`tune::HEAD_PAGES`), and not the whole range. Claimed first,
/// such a chunk is the caller's first batch: its one short copy is over before the caller
/// has set up its next block or the helpers (queued once that copy started) their first,
/// and the link idles in between (traced: 0.2-0.5 ms after chunks of 4-38 pages).
/// Claimed once every other chunk has been, it is a short copy among the last ones on the
/// link.
fn first_chunk_last(region: &Region, first: usize, end: usize) -> (usize, Option<(usize, usize)>) {
    let lead_end = core::cmp::min(end, region.block_pages(first).end);
    let short = lead_end.saturating_sub(first) < tune::HEAD_PAGES.load(Relaxed) as usize;
    if short && lead_end < end {
        (lead_end, Some((first, lead_end)))
    } else {
        (first, None)
    }
}

/// A PREFETCH over `first..end` in the caller's lane and up to `helpers` helper lanes.
fn in_lanes(
    region: &Arc<Region>,
    first: usize,
    end: usize,
    event: Event,
    dev: Option<Arc<Device>>,
    helpers: usize,
    cancel: Option<&Arc<AtomicBool>>,
) -> Result {
    // A cancelled prefetch starts no helper.
    stopped(cancel, true)?;
    let (cursor, last) = first_chunk_last(region, first, end);
    let lanes = Arc::pin_init(
        pin_init!(Lanes {
            region: region.clone(),
            event,
            dev,
            end,
            cancel: cancel.cloned(),
            state <- new_mutex!(LaneState { cursor, last, busy: 0, stop: false, err: None }, "gmem_lanes_state"),
            idle <- new_condvar!("gmem_lanes_idle"),
        }),
        GFP_KERNEL,
    )?;
    // The helpers are queued once the caller's first copy is started (or its first block
    // is done, if that started none), not before its first block: queueing the first one
    // wakes the other vCPU, which took 65-75 us of the caller's time before its first copy
    // under TCG, and a helper's allocation and CPU zap then ran beside the caller's first
    // ones. The link starts sooner; the helpers' blocks follow the caller's on it (14 PL
    // boots: PREFETCH +0.006 of the link bandwidth, see benchmarks.rst).
    let queued = core::cell::Cell::new(false);
    let queue_helpers = || {
        if queued.replace(true) {
            return;
        }
        if let Some(q) = wq::get() {
            for _ in 0..helpers {
                // A helper that cannot be had leaves its share to the other lanes.
                let shared = lanes.clone();
                let Ok(h) = Arc::pin_init(
                    pin_init!(Helper { lanes: shared, work <- new_work!("gmem_lanes_helper") }),
                    GFP_KERNEL,
                ) else {
                    break;
                };
                // A fresh work item cannot be queued already.
                let _ = q.enqueue(h);
            }
        }
    };
    lanes.work(false, Some(&queue_helpers));
    // Every chunk is claimed (or the lanes stopped): wait for the helpers still in one.
    let mut st = lanes.state.lock();
    while st.busy > 0 {
        lanes.idle.wait(&mut st);
    }
    st.err.take().map_or(Ok(()), Err)
}
