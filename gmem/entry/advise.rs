// SPDX-License-Identifier: GPL-2.0
//! Advice (`GMEM_IOC_ADVISE`): hints kept in the region's advice map (preferred location,
//! accessed-by, read-mostly) and actions applied page by page (prefetch, pin, unpin,
//! dontneed). PREFETCH may run asynchronously on gmem's workqueue (`wq.rs`), returning a fence.
//!
//! Rounding: the byte range is widened outward to page bounds, except DONTNEED, which is
//! narrowed inward so that a partly covered page keeps its data. The range must lie within
//! one region. Lock order as in the fault paths: mmap lock -> region pages.

use crate::mech::{moves, sysmem};
use crate::obj::device::Device;
use crate::obj::devices;
use crate::obj::done::Done;
use crate::obj::mirror;
use crate::obj::region::{adv, Region, ADVICE_RUNS};
use crate::obj::space::{SerialJob, Space};
use crate::policy::page_state::{Event, Target};
use crate::policy::range::{self, AdviceMap, PageRange, RangeError};
use core::sync::atomic::{AtomicBool, Ordering};
use kernel::{
    new_mutex,
    prelude::*,
    sync::{Arc, Mutex},
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

/// The live device the user's `dev` field names (`EINVAL` for a negative one).
fn device(dev: i32) -> Result<Arc<Device>> {
    let id = usize::try_from(dev).map_err(|_| EINVAL)?;
    devices::get(id).filter(|d| d.alive()).ok_or(ENODEV)
}

/// A registered device id from the user's `dev` field.
fn device_id(dev: i32) -> Result<u8> {
    u8::try_from(device(dev)?.id).map_err(|_| EINVAL)
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
    advise_until(space, a, None)
}

/// [`advise`], stopping early with `EINTR` once `cancel` is set (every lane of a moving
/// advice sees it, see `moves.rs`).
fn advise_until(space: &Space, a: &Advice, cancel: Option<&Arc<AtomicBool>>) -> Result {
    if let Some((start, end)) = sysmem_range(space, a)? {
        // No mapping there (or none gmem mirrors): the range is in no region and no memory.
        return sysmem_advise(space, a, start, end, cancel).map_err(sysmem::no_mapping_is_enoent);
    }
    let (region, r) = locate(space, a)?;
    let (first, count) = (r.first as usize, r.count as usize);
    if count == 0 {
        return Ok(());
    }
    if let Some(res) = location_hint(&region.advice, &[r], a, || device(a.dev)) {
        return res;
    }
    match a.advice {
        READ_MOSTLY => hint(&region.advice, &[r], true, adv::READ_MOSTLY, None),
        UNSET_READ_MOSTLY => hint(&region.advice, &[r], false, adv::READ_MOSTLY, None),
        PREFETCH | PIN | UNPIN | DONTNEED => {
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
            moves::move_pages(&region, first, count, event, target, cancel)
        }
        _ => Err(EINVAL),
    }
}

/// Fails with `ENODEV` if `dev` (the device advice names) is no longer alive. Called with
/// the advice map locked: a device's unregistration marks it dead before its evacuation
/// forgets the advice naming it (`region::adv::forget_device`, under the same lock), so
/// advice set after the check is forgotten, and advice checked after it is refused.
fn still_alive(dev: Option<&Device>) -> Result {
    match dev {
        Some(d) if !d.alive() => Err(ENODEV),
        _ => Ok(()),
    }
}

/// Sets (or clears) advice `bits` over the ranges `rs` in `map` (for a set naming a
/// device, `dev`: see [`still_alive`]): all or nothing (`E2BIG` if the map has no room
/// for the runs).
fn hint(map: &Mutex<AdviceMap<ADVICE_RUNS>>, rs: &[PageRange], set: bool, bits: u32, dev: Option<&Device>) -> Result {
    let mut cur = map.lock();
    still_alive(dev)?;
    let mut m = *cur;
    for &r in rs {
        let res = if set { m.set(r, bits) } else { m.clear(r, bits) };
        res.map_err(|_| E2BIG)?;
    }
    *cur = m;
    Ok(())
}

/// Replaces the preferred location of the ranges `rs` in `map` by `v` (`region::adv`
/// encoding; `dev` the device it names, if any: see [`still_alive`]): all or nothing
/// (`E2BIG` if the map has no room for the runs).
fn prefer(map: &Mutex<AdviceMap<ADVICE_RUNS>>, rs: &[PageRange], v: u32, dev: Option<&Device>) -> Result {
    let mut cur = map.lock();
    still_alive(dev)?;
    let mut m = *cur;
    for &r in rs {
        m.clear(r, adv::PREF_MASK).map_err(|_| E2BIG)?;
        m.set(r, v << adv::PREF_SHIFT).map_err(|_| E2BIG)?;
    }
    *cur = m;
    Ok(())
}

/// The location hints of `a` (PREFERRED_LOC, ACCESSED_BY and their unsets) over the ranges
/// `rs` in `map`, a region's advice or the space's for ordinary memory: the same bits for
/// both. `dev` checks the device `a` names for setting them and returns it. `None` for
/// any other advice.
fn location_hint(
    map: &Mutex<AdviceMap<ADVICE_RUNS>>,
    rs: &[PageRange],
    a: &Advice,
    dev: impl Fn() -> Result<Arc<Device>>,
) -> Option<Result> {
    // Device ids are below `MAX_DEVICES` (16).
    let id = |d: &Device| u32::try_from(d.id).map_err(|_| EINVAL);
    Some(match a.advice {
        PREFERRED_LOC if a.dev == HOST => prefer(map, rs, adv::PREF_HOST, None),
        PREFERRED_LOC => dev().and_then(|d| prefer(map, rs, id(&d)? + 1, Some(&d))),
        UNSET_PREFERRED_LOC => hint(map, rs, false, adv::PREF_MASK, None),
        ACCESSED_BY => dev().and_then(|d| hint(map, rs, true, 1u32 << id(&d)?, Some(&d))),
        UNSET_ACCESSED_BY => device_id(a.dev).and_then(|d| hint(map, rs, false, 1u32 << d, None)),
        _ => return None,
    })
}

/// The device `a` names, for advice on ordinary process memory: `EOPNOTSUPP` for one whose
/// driver has no `map_prepare` (it cannot map the process's own pages).
fn sysmem_dev(a: &Advice) -> Result<Arc<Device>> {
    let dev = device(a.dev)?;
    if dev.maps_sysmem() {
        Ok(dev)
    } else {
        Err(EOPNOTSUPP)
    }
}

/// Advice on ordinary process memory, `[start, end)` (page aligned, its first page in no
/// region but in a mapping gmem mirrors): a PREFETCH to a device migrates what can move
/// into its memory and maps the range there, one to the host brings migrated pages back;
/// PREFERRED_LOC and ACCESSED_BY are recorded for the space (on the range's mapped parts,
/// [`sysmem_hint`]) and steer its device faults there (mech/sysmem.rs).
fn sysmem_advise(space: &Space, a: &Advice, start: u64, end: u64, cancel: Option<&Arc<AtomicBool>>) -> Result {
    let dev = || sysmem_dev(a);
    if matches!(a.advice, PREFERRED_LOC | ACCESSED_BY) {
        return sysmem_hint(space, a, start, end);
    }
    // Unsets: over the whole range (there is advice only where mappings are).
    let r = PageRange { first: start / 4096, count: (end - start) / 4096 };
    if let Some(res) = location_hint(&space.sysmem_advice, &[r], a, dev) {
        return res;
    }
    match a.advice {
        PREFETCH if a.dev == HOST => sysmem::prefetch_host(space, start, end, cancel),
        PREFETCH => sysmem::prefetch(&dev()?, space, start, end, cancel),
        // READ_MOSTLY, PIN, UNPIN, DONTNEED: regions only.
        _ => Err(ENOENT),
    }
}

/// PREFERRED_LOC or ACCESSED_BY of ordinary memory, `[start, end)`: set on the parts of the
/// range that mappings cover, as mbind sets a policy on VMAs, so that the advice ends with
/// the mapping and a later mapping at the same addresses (or in a hole of the range) does
/// not get it. The space's unmap watch is registered first, so the munmap of an advised
/// part always reaches `Space::forget_unmapped`; the advice goes on under the mmap read
/// lock, where nothing can be mapped or unmapped.
fn sysmem_hint(space: &Space, a: &Advice, start: u64, end: u64) -> Result {
    let mm = space.mm_user().ok_or(EFAULT)?;
    space.watch_unmaps(&mm)?;
    // More parts than the map has runs could never all be advised.
    mirror::with_mapped(&mm, start, end, ADVICE_RUNS, |parts| {
        let mut rs = KVec::new();
        rs.reserve(parts.len(), GFP_KERNEL)?;
        for &(lo, hi) in parts {
            // Capacity reserved above.
            let _ = rs.push_within_capacity(PageRange { first: lo / 4096, count: (hi - lo) / 4096 });
        }
        // (Always `Some` for these two.)
        location_hint(&space.sysmem_advice, &rs, a, || sysmem_dev(a)).unwrap_or(Err(EINVAL))
    })?
}

/// An asynchronous PREFETCH: run on gmem's workqueue, waited for with GMEM_IOC_WAIT.
#[pin_data]
pub(crate) struct Fence {
    pub(crate) id: u64,
    space: Arc<Space>,
    advice: Advice,
    /// Set when the file that queued the fence is closed: the prefetch stops at its next
    /// chunk (nobody can wait for it any more). Shared with the prefetch's helper lanes.
    cancelled: Arc<AtomicBool>,
    #[pin]
    result: Mutex<Option<i32>>,
    #[pin]
    done: Done,
    #[pin]
    work: Work<Fence>,
}

impl_has_work! {
    impl HasWork<Self> for Fence { self.work }
}

impl WorkItem for Fence {
    type Pointer = Arc<Fence>;

    /// The work item of the fence that found no worker running its space's fences: it
    /// runs them all, this one among them, one at a time in the order queued.
    fn run(this: Arc<Fence>) {
        this.space.run_serial();
    }
}

impl SerialJob for Fence {
    fn run_job(&self) {
        let r = match advise_until(&self.space, &self.advice, Some(&self.cancelled)) {
            Ok(()) => 0,
            Err(e) => e.to_errno(),
        };
        self.finish(r);
    }
}

impl Fence {
    /// Starts `advice` in the background.
    pub(crate) fn start(id: u64, space: Arc<Space>, advice: Advice) -> Result<Arc<Fence>> {
        let cancelled = Arc::new(AtomicBool::new(false), GFP_KERNEL)?;
        let f = Arc::pin_init(
            pin_init!(Fence {
                id,
                space,
                advice,
                cancelled,
                result <- new_mutex!(None, "gmem_fence_result"),
                done <- Done::new(),
                work <- new_work!("gmem_fence_work"),
            }),
            GFP_KERNEL,
        )?;
        let q = crate::obj::wq::get().ok_or(ENODEV)?;
        if f.space.queue_serial(f.clone())? {
            // A fresh work item cannot be queued already.
            let _ = q.enqueue(f.clone());
        }
        Ok(f)
    }

    /// Asks a queued or running prefetch to stop at its next chunk. One that has not
    /// started is taken off its space's queue and completes at once (`ECANCELED`), so
    /// that whoever waits for it does not wait behind the fences queued before it
    /// (through the process's other files too).
    pub(crate) fn cancel(self: &Arc<Self>) {
        self.cancelled.store(true, Ordering::Release);
        if let Some(job) = self.space.unqueue_serial(Arc::as_ptr(self).cast()) {
            self.finish(ECANCELED.to_errno());
            // The queue's reference, dropped with no lock held.
            drop(job);
        }
    }

    /// Records the fence's result (0 or a negative errno) and wakes its waiters: once, by
    /// whichever took the job off the space's queue (its run, or a cancel before it).
    fn finish(&self, r: i32) {
        *self.result.lock() = Some(r);
        self.done.complete_all();
    }

    /// Waits for completion; returns the prefetch's result.
    pub(crate) fn wait(&self) -> Result {
        self.done.wait();
        self.result()
    }

    /// [`Fence::wait`] for the task that asked (`GMEM_IOC_WAIT`), which a fatal signal ends
    /// early: the prefetch is then cancelled and waited for (it stops at its next chunk: at
    /// most a block per lane), and the result is `EINTR`. Without this, a killed process
    /// would sleep until its prefetch (and every fence queued before it) ran to the end: a
    /// task blocked in the ioctl still uses the address space, so the lanes would not stop
    /// for the process's exit either.
    pub(crate) fn wait_killable(self: &Arc<Self>) -> Result {
        if self.done.wait_killable() {
            return self.result();
        }
        self.cancel();
        self.done.wait();
        Err(EINTR)
    }

    /// The result of a completed prefetch.
    fn result(&self) -> Result {
        match (*self.result.lock()).unwrap_or(EIO.to_errno()) {
            0 => Ok(()),
            e => Err(Error::from_errno(e)),
        }
    }
}

/// Validates the range of an advice without applying it (ASYNC requests fail early).
pub(crate) fn check_range(space: &Space, a: &Advice) -> Result {
    // Ordinary memory: its first page was found mapped (the rest is checked as the
    // prefetch goes).
    match sysmem_range(space, a)? {
        // A device that cannot map it fails here, not at the WAIT.
        Some(_) if a.advice == PREFETCH && a.dev != HOST => sysmem_dev(a).map(|_| ()),
        Some(_) => Ok(()),
        None => locate(space, a).map(|_| ()),
    }
}

/// The page-aligned byte range of advice that ordinary process memory takes (PREFETCH,
/// PREFERRED_LOC, ACCESSED_BY and their unsets) whose first page is in no region
/// (mech/sysmem.rs); `None` for any other advice or range, which needs a region.
fn sysmem_range(space: &Space, a: &Advice) -> Result<Option<(u64, u64)>> {
    let addr = usize::try_from(a.addr).map_err(|_| EINVAL)?;
    let takes = matches!(a.advice, PREFETCH | PREFERRED_LOC | UNSET_PREFERRED_LOC | ACCESSED_BY | UNSET_ACCESSED_BY);
    if !takes || space.region_at(addr).is_some() {
        return Ok(None);
    }
    // In no region and no mapping: ENOENT, before anything about the range (as for an
    // address in no region before).
    // The process is exiting: as for a region (EFAULT).
    let _mm = space.mm_user().ok_or(EFAULT)?;
    let page = a.addr & !0xfff;
    let found = if a.advice == PREFETCH && a.dev == HOST {
        mirror::check_home(space.mm(), page)
    } else {
        mirror::check(space.mm(), page, false)
    };
    found.map_err(sysmem::no_mapping_is_enoent)?;
    // Widened outward to pages, as for a region, within the whole address space.
    let r = range::outward(0, !0xfff, a.addr, a.len).map_err(range_errno)?;
    let start = r.first.checked_mul(4096).ok_or(EOVERFLOW)?;
    let end = r.first.checked_add(r.count).and_then(|e| e.checked_mul(4096)).ok_or(EOVERFLOW)?;
    Ok(Some((start, end)))
}
