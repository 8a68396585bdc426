// SPDX-License-Identifier: GPL-2.0
//! Advice (`GMEM_IOC_ADVISE`): hints kept in the region's advice map (preferred location,
//! accessed-by, read-mostly) and actions applied page by page (prefetch, pin, unpin,
//! dontneed). PREFETCH may run asynchronously on gmem's workqueue (`wq.rs`), returning a fence.
//!
//! Rounding: the byte range is widened outward to page bounds, except DONTNEED, which is
//! narrowed inward so that a partly covered page keeps its data. The range must lie within
//! one region. Lock order as in the fault paths: mmap lock -> region pages.

use crate::exec::migrate::{self, Env};
use crate::obj::devices;
use crate::obj::region::{adv, Region};
use crate::obj::space::Space;
use crate::policy::page_state::{transition, Event, PageState, Target};
use crate::policy::range::{self, PageRange, RangeError};
use core::sync::atomic::{AtomicBool, Ordering};
use kernel::{
    new_mutex,
    prelude::*,
    sync::{Arc, Completion, Mutex},
    workqueue::{impl_has_work, new_work, Work, WorkItem},
};

pub(crate) const PREFETCH: u32 = 1;
pub(crate) const PREFERRED_LOC: u32 = 2;
pub(crate) const UNSET_PREFERRED_LOC: u32 = 3;
pub(crate) const ACCESSED_BY: u32 = 4;
pub(crate) const UNSET_ACCESSED_BY: u32 = 5;
pub(crate) const READ_MOSTLY: u32 = 6;
pub(crate) const UNSET_READ_MOSTLY: u32 = 7;
pub(crate) const PIN: u32 = 8;
pub(crate) const UNPIN: u32 = 9;
pub(crate) const DONTNEED: u32 = 10;
pub(crate) const FLAG_ASYNC: u32 = 1;
pub(crate) const NO_DEVICE: i32 = -1;
pub(crate) const HOST: i32 = -2;

/// A validated advice request.
#[derive(Clone, Copy)]
pub(crate) struct Advice {
    pub(crate) advice: u32,
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) dev: i32,
}

fn range_errno(e: RangeError) -> Error {
    match e {
        RangeError::Overflow => EOVERFLOW,
        _ => EINVAL,
    }
}

/// A registered device id from the user's `dev` field.
fn device_id(dev: i32) -> Result<u8> {
    let id = usize::try_from(dev).map_err(|_| EINVAL)?;
    devices::get(id).filter(|d| d.alive()).ok_or(ENODEV)?;
    u8::try_from(id).map_err(|_| EINVAL)
}

/// Checks everything that does not need the region; returns the target of moving advice.
pub(crate) fn validate(a: &Advice, flags: u32) -> Result {
    if flags & !FLAG_ASYNC != 0 || (flags & FLAG_ASYNC != 0 && a.advice != PREFETCH) {
        return Err(EINVAL);
    }
    match a.advice {
        PREFETCH | PREFERRED_LOC if a.dev == HOST => Ok(()),
        PREFETCH | PREFERRED_LOC | ACCESSED_BY | UNSET_ACCESSED_BY | PIN => device_id(a.dev).map(|_| ()),
        UNSET_PREFERRED_LOC | READ_MOSTLY | UNSET_READ_MOSTLY | UNPIN | DONTNEED => Ok(()),
        _ => Err(EINVAL),
    }
}

/// The region and page range an advice applies to.
fn locate(space: &Space, a: &Advice) -> Result<(Arc<Region>, PageRange)> {
    let addr = usize::try_from(a.addr).map_err(|_| EINVAL)?;
    let region = space.region_at(addr).ok_or(ENOENT)?;
    let (start, size) = (region.start as u64, region.len() as u64);
    let r = if a.advice == DONTNEED {
        range::inward(start, size, a.addr, a.len)
    } else {
        range::outward(start, size, a.addr, a.len)
    }
    .map_err(range_errno)?;
    Ok((region, r))
}

/// Applies advice `a` in `space` (the caller checked `validate`).
pub(crate) fn advise(space: &Space, a: &Advice) -> Result {
    advise_until(space, a, &|| false)
}

/// [`advise`], stopping early with `EINTR` once `cancelled()` returns true.
fn advise_until(space: &Space, a: &Advice, cancelled: &dyn Fn() -> bool) -> Result {
    let (region, r) = locate(space, a)?;
    let (first, count) = (r.first as usize, r.count as usize);
    if count == 0 {
        return Ok(());
    }
    let hint = |set: bool, bits: u32| -> Result {
        let mut m = region.advice.lock();
        let res = if set { m.set(r, bits) } else { m.clear(r, bits) };
        res.map_err(|_| E2BIG)
    };
    match a.advice {
        PREFERRED_LOC => {
            let v = if a.dev == HOST { adv::PREF_HOST } else { u32::from(device_id(a.dev)?) + 1 };
            let mut cur = region.advice.lock();
            let mut m = *cur;
            m.clear(r, adv::PREF_MASK).map_err(|_| E2BIG)?;
            m.set(r, v << adv::PREF_SHIFT).map_err(|_| E2BIG)?;
            *cur = m;
            Ok(())
        }
        UNSET_PREFERRED_LOC => hint(false, adv::PREF_MASK),
        ACCESSED_BY => hint(true, 1 << device_id(a.dev)?),
        UNSET_ACCESSED_BY => hint(false, 1 << device_id(a.dev)?),
        READ_MOSTLY => hint(true, adv::READ_MOSTLY),
        UNSET_READ_MOSTLY => hint(false, adv::READ_MOSTLY),
        PREFETCH | PIN | UNPIN | DONTNEED => move_pages(space, &region, first, count, a, cancelled),
        _ => Err(EINVAL),
    }
}

/// The advice that move or discard data, with the mmap lock held for CPU zaps. A full
/// device is made room on (eviction) and the page retried.
///
/// The range is worked through in chunks of one block (up to 512 pages). Between chunks the mmap
/// lock and the reference on the address space's users are dropped, the task may be
/// rescheduled, and the work stops (`EINTR`) on a fatal signal or when `cancelled()` says so
/// (an asynchronous prefetch whose file is being closed). Not holding the mm's users
/// across chunks is what lets an exiting process's `exit_mmap` run (and tear the region
/// down) while a queued prefetch of it is still running: the prefetch then fails with
/// `EFAULT`/`ENOENT` at its next chunk instead of migrating pages for a dead process.
fn move_pages(
    space: &Space,
    region: &Arc<Region>,
    first: usize,
    count: usize,
    a: &Advice,
    cancelled: &dyn Fn() -> bool,
) -> Result {
    let (event, target) = match a.advice {
        PREFETCH if a.dev == HOST => (Event::Prefetch { to: Target::Host }, None),
        PREFETCH => {
            let d = device_id(a.dev)?;
            (Event::Prefetch { to: Target::Device(d) }, Some(d))
        }
        PIN => {
            let d = device_id(a.dev)?;
            (Event::Pin { dev: d }, Some(d))
        }
        UNPIN => (Event::Unpin, None),
        _ => (Event::DontNeed, None),
    };
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
                crate::obj::sched::cond_resched();
            }
            (end - first) as u64 - pinned
        };
        if newly + dev.frames_pinned() > dev.nr_frames {
            return Err(ENOSPC);
        }
        crate::obj::pin_quota::charge(space.mm(), newly)?;
        charged = newly;
    }
    let mut pinned = 0u64;
    let r = move_range(space, region, first, end, event, &dev, cancelled, &mut pinned);
    // What the PIN charged but did not pin (an error part way, or pages pinned by someone
    // else meanwhile) goes back; each page it did pin stays charged until its pin ends.
    crate::obj::pin_quota::uncharge(space.mm(), charged.saturating_sub(pinned));
    r
}

/// The page loop of [`move_pages`]; counts the pages it pinned in `pinned`.
#[allow(clippy::too_many_arguments)]
fn move_range(
    space: &Space,
    region: &Arc<Region>,
    first: usize,
    end: usize,
    event: Event,
    dev: &Option<Arc<crate::obj::device::Device>>,
    cancelled: &dyn Fn() -> bool,
    pinned: &mut u64,
) -> Result {
    // Advice that leaves never-touched pages alone (DONTNEED, UNPIN) skips untouched
    // metadata blocks whole: on a terabyte region it must not walk every page.
    let skip_untouched =
        matches!(transition(PageState::EMPTY, event), Ok((n, a)) if n == PageState::EMPTY && a == Default::default());
    let mut i = first;
    while i < end {
        if crate::obj::sched::fatal_signal_pending() || cancelled() {
            return Err(EINTR);
        }
        if skip_untouched {
            match region.touched_from(i) {
                Some(t) if t < end => i = t,
                _ => return Ok(()),
            }
        }
        let mm = space.mm_user().ok_or(EFAULT)?;
        let mmap = mm.mmap_read_lock();
        let vma = mmap.vma_lookup(region.start).filter(|v| v.start() == region.start);
        // A chunk is the rest of page i's block: one block lock, one executor batch (or a
        // few, when the device fills up or a page refuses).
        let chunk_end = core::cmp::min(end, region.block_pages(i).end);
        // Eviction attempts for the current page; the budget is per page (refilled after
        // every batch that makes progress), so a long range does not run out of it.
        let mut retries = 0;
        let mut steps: KVec<migrate::Step> = KVec::with_capacity(migrate::BATCH_PAGES, GFP_KERNEL)?;
        // The block lock is taken once per chunk, and dropped only to evict.
        let block = region.block(i)?;
        let mut p = region.lock(&block);
        while i < chunk_end {
            if region.is_dead() {
                return Err(ENOENT);
            }
            steps.clear();
            let mut refusal = None;
            let mut j = i;
            while j < chunk_end && steps.len() < migrate::BATCH_PAGES {
                let s = p.state(j);
                match transition(s, event) {
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
            let out = migrate::apply_batch(&Env::access(region, vma), &mut p, &steps);
            for st in &steps[..out.done] {
                *pinned += u64::from(!st.prev.pinned() && st.next.pinned());
            }
            if let (Event::Prefetch { .. }, Some(dev)) = (event, dev) {
                crate::obj::device::DevStats::add(&dev.stats.prefetched, out.done as u64);
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
                        retries = if out.done > 0 { 1 } else { retries + 1 };
                        if retries > 64 {
                            return Err(ENOMEM);
                        }
                        let within =
                            out.limit.as_ref().map(|limit| crate::mech::evict::Within { limit, mm: Some(space.mm()) });
                        crate::mech::evict::make_room_for(&acts, 64, crate::mech::evict::Why::Advice, within)?;
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
        drop(p);
        drop(mmap);
        drop(mm);
        crate::obj::sched::cond_resched();
    }
    Ok(())
}

/// An asynchronous PREFETCH: run on gmem's workqueue, waited for with GMEM_IOC_WAIT.
#[pin_data]
pub(crate) struct Fence {
    pub(crate) id: u64,
    space: Arc<Space>,
    advice: Advice,
    /// Set when the file that queued the fence is closed: the prefetch stops at its next
    /// chunk (nobody can wait for it any more).
    cancelled: AtomicBool,
    #[pin]
    result: Mutex<Option<i32>>,
    #[pin]
    done: Completion,
    #[pin]
    work: Work<Fence>,
}

impl_has_work! {
    impl HasWork<Self> for Fence { self.work }
}

impl WorkItem for Fence {
    type Pointer = Arc<Fence>;

    fn run(this: Arc<Fence>) {
        // One fence of a space at a time (see `Space::fence_lock`).
        let _one = this.space.fence_lock.lock();
        let r = match advise_until(&this.space, &this.advice, &|| this.cancelled.load(Ordering::Acquire)) {
            Ok(()) => 0,
            Err(e) => e.to_errno(),
        };
        *this.result.lock() = Some(r);
        this.done.complete_all();
    }
}

impl Fence {
    /// Starts `advice` in the background.
    pub(crate) fn start(id: u64, space: Arc<Space>, advice: Advice) -> Result<Arc<Fence>> {
        let f = Arc::pin_init(
            pin_init!(Fence {
                id,
                space,
                advice,
                cancelled: AtomicBool::new(false),
                result <- new_mutex!(None, "gmem_fence_result"),
                done <- Completion::new(),
                work <- new_work!("gmem_fence_work"),
            }),
            GFP_KERNEL,
        )?;
        // A fresh work item cannot be queued already.
        let q = crate::obj::wq::get().ok_or(ENODEV)?;
        let _ = q.enqueue(f.clone());
        Ok(f)
    }

    /// Asks a queued or running prefetch to stop at its next chunk.
    pub(crate) fn cancel(&self) {
        self.cancelled.store(true, Ordering::Release);
    }

    /// Waits for completion; returns the prefetch's result.
    pub(crate) fn wait(&self) -> Result {
        self.done.wait_for_completion();
        match (*self.result.lock()).unwrap_or(EIO.to_errno()) {
            0 => Ok(()),
            e => Err(Error::from_errno(e)),
        }
    }
}

/// Validates the range of an advice without applying it (ASYNC requests fail early).
pub(crate) fn check_range(space: &Space, a: &Advice) -> Result {
    locate(space, a).map(|_| ())
}
