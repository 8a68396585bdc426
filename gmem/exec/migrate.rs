// SPDX-License-Identifier: GPL-2.0
//! Migration: carries out the [`Actions`] that the page-state machine
//! (`policy/src/page_state.rs`) decided for one page. Every fault, advice and teardown path
//! ends here, with the block's lock held.
//!
//! Order of work (deliberately not the field order of `Actions`): allocate first (so a
//! failure changes nothing), then revoke every mapping of the old copy (CPU and devices),
//! then copy, then free what the old placement held, then commit the new state, then map.
//! Revoking before copying means no processor can write the old copy after it was read.
//! A batch in parts ([`pipelined`]) goes through this order twice before its copies
//! complete: for its first part, then, while that part is on the link, for the rest.

use crate::abi::{GmemCopy, GmemPte, GMEM_COPY_D2D, GMEM_COPY_D2H, GMEM_COPY_H2D, GMEM_COPY_ZERO};
use crate::abi::{GMEM_PROT_READ, GMEM_PROT_WRITE, GMEM_PTE_2M};
use crate::exec::multipath;
use crate::obj::device::{self as devmod, CDriver, DevStats, Device, DeviceOps, FrameOp, Ops, Owner, F_PREFETCHED};
use crate::obj::devices;
use crate::obj::dmem::{self, Charge, Limit};
use crate::obj::fence::Fence;
use crate::obj::host_page::HostPage;
use crate::obj::region::{devices_in, Pages, Region, PAGE_SIZE};
use crate::obj::space::Space;
use crate::obj::trace::{self, Laps, Phase};
use crate::obj::tune;
use crate::policy::bits;
use crate::policy::evict::{F_CLEAN, F_LENT, F_PINNED, F_REF};
use crate::policy::frames::CHUNK_FRAMES;
use crate::policy::page_state::{dev_bit, Actions, Copy, Loc, PageState, Refused, MAX_DEVICES};
use crate::policy::paths::CHUNK_PAGES;
use core::cell::OnceCell;
use core::sync::atomic::Ordering::Relaxed;
use kernel::{mm::virt::VmaRef, prelude::*, sync::Arc};

/// Where a page's mappings live besides the region itself.
pub(crate) struct Env<'a> {
    pub(crate) region: &'a Arc<Region>,
    /// The region's VMA, with the mmap lock held, when CPU mappings may have to be zapped.
    pub(crate) vma: Option<&'a VmaRef>,
    /// The transition is an access (fault, prefetch, pin): the page becomes hot and stops
    /// being a parked victim. Eviction and write-back are not accesses.
    pub(crate) access: bool,
    /// Called once a batch's copies have all been started (before they are waited for),
    /// under the block lock: read-ahead hands on to its next block there, so that blocks
    /// reach the link in order while this one's commit overlaps the next one's copies.
    pub(crate) started: Option<&'a dyn Fn()>,
    /// Called once the batch's first copy is started, under the block lock: for a batch in
    /// parts, right after its first part's driver call (before the other parts are
    /// allocated and revoked; not if that call failed); for a batch copied whole, just
    /// before its copies are started (as `started`). A PREFETCH queues its helper lanes
    /// there (`moves.rs`).
    pub(crate) head_started: Option<&'a dyn Fn()>,
}

impl<'a> Env<'a> {
    pub(crate) fn access(region: &'a Arc<Region>, vma: Option<&'a VmaRef>) -> Self {
        Env { region, vma, access: true, started: None, head_started: None }
    }

    /// As [`Env::access`], calling `started` once the copies are started.
    pub(crate) fn access_then(region: &'a Arc<Region>, vma: Option<&'a VmaRef>, started: &'a dyn Fn()) -> Self {
        Env { region, vma, access: true, started: Some(started), head_started: None }
    }

    pub(crate) fn background(region: &'a Arc<Region>) -> Self {
        Env { region, vma: None, access: false, started: None, head_started: None }
    }

    /// As [`Env::background`], calling `started` once the copies are started.
    pub(crate) fn background_then(region: &'a Arc<Region>, started: &'a dyn Fn()) -> Self {
        Env { region, vma: None, access: false, started: Some(started), head_started: None }
    }

    /// This environment, calling `f` once the batch's first copy is started (if `Some`).
    pub(crate) fn head_then(self, f: Option<&'a dyn Fn()>) -> Self {
        Env { head_started: f, ..self }
    }
}

/// The errno of a refused transition for advice and device faults: a lost page fails with
/// `EIO` (its data is gone), a pinned one with `EBUSY`. (CPU faults get SIGBUS for both.)
pub(crate) fn refusal_errno(r: Refused) -> Error {
    match r {
        Refused::Lost => EIO,
        _ => EBUSY,
    }
}

fn device(id: u8) -> Result<Arc<Device>> {
    devices::get(id as usize).ok_or(ENODEV)
}

fn host_ptr(p: &Pages, i: usize) -> Result<*mut kernel::bindings::page> {
    p.host(i).map(|pg| pg.as_ptr()).ok_or(EINVAL)
}

/// One page's transition, as the executor receives it: page `i` goes from `prev` (its
/// state when the caller decided, under the same block lock) to `next` by the actions `a`.
#[derive(Clone, Copy)]
pub(crate) struct Step {
    pub(crate) i: usize,
    pub(crate) prev: PageState,
    pub(crate) next: PageState,
    pub(crate) a: Actions,
}

/// What [`apply_batch`] did: the first `done` steps were committed (the others left
/// untouched); `res` is the error that stopped the rest, or, with every step committed,
/// a failure to install the new device mappings (the pages are valid, merely unmapped).
/// When `res` is `ENOSPC` because the owner's dmem cgroup is at its limit on a device
/// (rather than the device being full), `limit` is that cgroup's pool: eviction must then
/// free frames charged within it.
pub(crate) struct Outcome {
    pub(crate) done: usize,
    pub(crate) res: Result,
    pub(crate) limit: Option<Limit>,
}

impl Outcome {
    fn failed(e: Error) -> Self {
        Outcome { done: 0, res: Err(e), limit: None }
    }
}

/// What step 1 allocated for one page.
#[derive(Clone, Copy, Default)]
struct Fresh {
    host: bool,
    frame: Option<(u8, u32)>,
}

/// The devices a batch touches, each looked up in the registry once, on first use. A cell
/// is set at most once and never cleared, so a device got from it stays for as long as the
/// `Devs` (copies in flight hold callback sections borrowed from it while the executor goes
/// on looking devices up).
struct Devs([OnceCell<Arc<Device>>; MAX_DEVICES]);

impl Devs {
    fn new() -> Self {
        Devs(Default::default())
    }

    fn get(&self, id: u8) -> Result<&Arc<Device>> {
        let cell = self.0.get(id as usize).ok_or(ENODEV)?;
        if cell.get().is_none() {
            let _ = cell.set(device(id)?);
        }
        cell.get().ok_or(ENODEV)
    }

    /// Keeps `dev` (found by other means: a route's peer) for the batch; its id.
    fn keep(&self, dev: Arc<Device>) -> Result<u8> {
        let id = u8::try_from(dev.id).map_err(|_| EINVAL)?;
        let cell = self.0.get(id as usize).ok_or(ENODEV)?;
        let _ = cell.set(dev);
        Ok(id)
    }
}

/// Frames handed out to a batch: charged to the owner's dmem cgroup and taken from each
/// device's pool in one go (one pool lock per device and batch), then given to the steps
/// in order; what is left goes back. A device whose charges stopped at a cgroup limit
/// keeps that limit, for the caller's eviction.
struct FrameSupply {
    frames: [KVec<u32>; MAX_DEVICES],
    limits: [Option<Limit>; MAX_DEVICES],
    /// Why a device got no frames at all, if not for being full (`ENOSPC`): its charges
    /// could not be had (`ENOMEM`). Not a reason to evict.
    failed: [Option<Error>; MAX_DEVICES],
}

impl FrameSupply {
    /// Frames for `steps`; those of a whole block go to the aligned chunk `chunk` names for
    /// the device, if any.
    fn new(devs: &Devs, space: &Space, p: &Pages, steps: &[Step], chunk: &dyn Fn(&Pages, u8) -> Option<u64>) -> Self {
        let mut want = [0usize; MAX_DEVICES];
        for st in steps {
            if let Some(d) = st.a.alloc_frame {
                if let Some(w) = want.get_mut(d as usize) {
                    *w += 1;
                }
            }
        }
        let mut sup =
            FrameSupply { frames: Default::default(), limits: Default::default(), failed: [None; MAX_DEVICES] };
        for (d, &w) in want.iter().enumerate() {
            if w == 0 {
                continue;
            }
            // A device that started unregistering takes nothing new. Evacuation marks it
            // dead first and then takes the lock of every block that exists then (this one
            // included: it was created before we locked it), so checking here cannot
            // miss it. A shortfall shows as ENOSPC/ENODEV per step (ENOMEM when the
            // charges could not be had).
            if let Ok(dev) = devs.get(d as u8) {
                if dev.alive() {
                    // Charges first: as many frames as the cgroup allows, and no more than
                    // the pool has free (so that a full device does not charge phantom
                    // frames); each frame takes one, the ones left are given back on drop.
                    let mut charges: KVec<Charge> = KVec::new();
                    let room = usize::try_from(dev.frames_free_hint()).unwrap_or(usize::MAX);
                    let limit = match dev.dmem.charge(space.mm(), core::cmp::min(w, room), &mut charges) {
                        Ok(limit) => limit,
                        Err(e) => {
                            sup.failed[d] = Some(e);
                            continue;
                        }
                    };
                    let r = p.range();
                    if dev.maps_2m() && r.len() == BATCH_PAGES {
                        // Place the block's pages in one aligned chunk where possible, so
                        // that the block can be mapped with one 2 MiB entry (`huge_entry`).
                        let offs = steps
                            .iter()
                            .filter(|st| st.a.alloc_frame == Some(d as u8))
                            // (Every step is a page of the block: `allocate` checks.)
                            .filter_map(|st| st.i.checked_sub(r.start).map(|o| o as u64));
                        let _ = dev.alloc_placed(chunk(p, d as u8), offs, &mut charges, &mut sup.frames[d]);
                    } else {
                        let _ = dev.alloc_frames(&mut charges, &mut sup.frames[d]);
                    }
                    // The cgroup is what stopped the batch only if every charge got its
                    // frame; otherwise the device is full, and eviction is device-wide.
                    if charges.is_empty() {
                        sup.limits[d] = limit;
                    }
                    // Handed out front to back.
                    sup.frames[d].reverse();
                }
            }
        }
        sup
    }

    /// The cgroup limit that left device `d` short, if that is what did.
    fn limit(&mut self, d: u8) -> Option<Limit> {
        self.limits.get_mut(d as usize).and_then(Option::take)
    }

    fn take(&mut self, devs: &Devs, d: u8) -> Result<u32> {
        let dev = devs.get(d)?;
        if !dev.alive() {
            return Err(ENODEV);
        }
        let failed = self.failed.get(d as usize).copied().flatten();
        self.frames.get_mut(d as usize).and_then(|v| v.pop()).ok_or(failed.unwrap_or(ENOSPC))
    }

    /// Gives every frame not handed out back to its device.
    fn give_back(&mut self, devs: &Devs) {
        for d in 0..MAX_DEVICES {
            while let Some(f) = self.frames[d].pop() {
                if let Ok(dev) = devs.get(d as u8) {
                    dev.free_frame(f);
                }
            }
        }
    }
}

/// Step 1 for `steps`: each step's host page and frame, into `fresh` (one per step, in the
/// same order), up to the first step that cannot have them (what that one got is freed).
/// A whole block's frames go to the aligned chunk `chunk` names for their device, if any.
/// Returns how many steps got theirs, the error that stopped the rest, and, when that was
/// a dmem cgroup's limit on a device rather than the device being full, that cgroup's pool.
fn allocate(
    devs: &Devs,
    space: &Space,
    p: &mut Pages,
    steps: &[Step],
    fresh: &mut [Fresh],
    chunk: &dyn Fn(&Pages, u8) -> Option<u64>,
) -> (usize, Result, Option<Limit>) {
    let mut supply = FrameSupply::new(devs, space, p, steps, chunk);
    let (mut n, mut stop, mut limit) = (0, Ok(()), None);
    for (st, slot) in steps.iter().zip(fresh.iter_mut()) {
        let i = st.i;
        let mut f = Fresh::default();
        // A batch is one block's (the caller locked it).
        if !p.contains(i) {
            stop = Err(EINVAL);
            break;
        }
        if st.a.alloc_host && p.host(i).is_none() {
            // A page a D2H copy fills whole needs no zeroing first.
            match HostPage::alloc(space.mm(), !matches!(st.a.copy, Copy::D2H(_))) {
                Ok(pg) => {
                    drop(p.set_host(i, Some(pg)));
                    f.host = true;
                }
                Err(e) => {
                    stop = Err(e);
                    break;
                }
            }
        }
        if let Some(d) = st.a.alloc_frame {
            match supply.take(devs, d) {
                Ok(fr) => f.frame = Some((d, fr)),
                Err(e) => {
                    undo(p, i, &f, devs);
                    if e == ENOSPC {
                        limit = supply.limit(d);
                    }
                    stop = Err(e);
                    break;
                }
            }
        }
        *slot = f;
        n += 1;
    }
    supply.give_back(devs);
    (n, stop, limit)
}

/// [`undo`] for every step of `steps` (`fresh` their allocations, in the same order).
fn undo_steps(p: &mut Pages, steps: &[Step], fresh: &[Fresh], devs: &Devs) {
    for (st, f) in steps.iter().zip(fresh.iter()) {
        undo(p, st.i, f, devs);
    }
}

/// Frees what step 1 allocated for one page when a later step fails.
fn undo(p: &mut Pages, i: usize, fresh: &Fresh, devs: &Devs) {
    if fresh.host {
        drop(p.set_host(i, None));
    }
    if let Some((d, f)) = fresh.frame {
        if let Ok(dev) = devs.get(d) {
            dev.free_frame(f);
        }
    }
}

/// Runs `f(first_page, count)` for each maximal run of consecutive page indices among
/// the steps that `pick` selects (steps are in ascending page order).
fn runs(steps: &[Step], pick: impl Fn(&Step) -> bool, mut f: impl FnMut(usize, usize)) {
    let mut cur: Option<(usize, usize)> = None;
    for st in steps.iter().filter(|st| pick(st)) {
        cur = match cur {
            Some((a, n)) if a + n == st.i => Some((a, n + 1)),
            Some((a, n)) => {
                f(a, n);
                Some((st.i, 1))
            }
            None => Some((st.i, 1)),
        };
    }
    if let Some((a, n)) = cur {
        f(a, n);
    }
}

/// Which copy batch a page joins: (direction, source device, destination device).
type CopyKey = (u32, u8, u8);

/// The driver call a copy joins; `None` for no copy or a host-side zero fill.
fn copy_key(c: Copy) -> Option<CopyKey> {
    Some(match c {
        Copy::None | Copy::ZeroHost => return None,
        Copy::ZeroDev(d) => (GMEM_COPY_ZERO, d, d),
        Copy::H2D(d) => (GMEM_COPY_H2D, d, d),
        Copy::D2H(o) => (GMEM_COPY_D2H, o, o),
        Copy::D2D { from, to } => (GMEM_COPY_D2D, from, to),
    })
}

/// The copy a step needs from the driver, as its batch key and its `gmem_copy` entry;
/// `None` for no copy or a host-side zero fill.
fn copy_entry(p: &Pages, st: &Step, fresh: &Fresh) -> Result<Option<(CopyKey, GmemCopy)>> {
    let Some(key) = copy_key(st.a.copy) else { return Ok(None) };
    let nf = fresh.frame.map(|(_, f)| u64::from(f)).unwrap_or(0);
    let old_frame = u64::from(p.frame(st.i));
    let null = core::ptr::null_mut();
    Ok(Some((
        key,
        match key.0 {
            GMEM_COPY_H2D => GmemCopy { host: host_ptr(p, st.i)?, frame: nf, peer_frame: 0 },
            GMEM_COPY_D2H => GmemCopy { host: host_ptr(p, st.i)?, frame: old_frame, peer_frame: 0 },
            GMEM_COPY_D2D => GmemCopy { host: null, frame: old_frame, peer_frame: nf },
            _ => GmemCopy { host: null, frame: nf, peer_frame: 0 },
        },
    )))
}

/// Smallest share of a copy that is worth a channel of its own (256 KiB): a call of
/// fewer pages goes to one channel whole.
const CHUNK_MIN_PAGES: usize = 64;

/// How many parts a copy call of `n` pages is split into, one per channel: as many as
/// the device has channels, but no more than whole `CHUNK_MIN_PAGES` runs fit in `n`, and
/// at least one. The parts are consecutive runs of `ceil(n / parts)` pages (the last one
/// possibly shorter).
fn shares(n: usize, channels: u32) -> usize {
    core::cmp::max(1, core::cmp::min(channels as usize, n / CHUNK_MIN_PAGES))
}

/// The fences of the copies of one batch that the driver accepted. Dropping it waits for
/// every one not yet waited for, so no path out of `copy_batch` or `pipelined` (an early
/// error included) can free a fence, an entry array or a page while a copy still uses it.
struct InFlight(KVec<Pin<KBox<Fence>>>);

impl InFlight {
    /// Waits for every copy; the first error, if any.
    fn wait_all(&self) -> Result {
        let mut res = Ok(());
        for f in self.0.iter() {
            if let Err(e) = f.wait() {
                if res.is_ok() {
                    res = Err(e);
                }
            }
        }
        res
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let _ = self.wait_all();
    }
}

/// Step 3b: the entries of every copy the batch needs, grouped by (direction, source,
/// destination) in the order the groups first appear; host-side zero fills are done here,
/// in place.
fn copy_lists(p: &Pages, steps: &[Step], fresh: &[Fresh]) -> Result<KVec<(CopyKey, KVec<GmemCopy>)>> {
    let mut lists: KVec<(CopyKey, KVec<GmemCopy>)> = KVec::new();
    for (n, (st, f)) in steps.iter().zip(fresh.iter()).enumerate() {
        if st.a.copy == Copy::ZeroHost && !f.host {
            // A fresh host page comes zeroed; an existing one is cleared here.
            if let Some(pg) = p.host(st.i) {
                pg.zero();
            }
        }
        let Some((key, c)) = copy_entry(p, st, f)? else { continue };
        let k = match lists.iter().position(|(k, _)| *k == key) {
            Some(k) => k,
            None => {
                // Room for every entry of the key at once (one allocation, not one per
                // doubling: under TCG that took the copy list of a PREFETCH's first part
                // from a median of 57 us to 40 us, before its copy could start).
                let want = steps[n..].iter().filter(|s| copy_key(s.a.copy) == Some(key)).count();
                lists.push((key, KVec::with_capacity(want, GFP_KERNEL)?), GFP_KERNEL)?;
                lists.len() - 1
            }
        };
        lists[k].1.push(c, GFP_KERNEL)?;
    }
    Ok(lists)
}

/// Step 4 for a whole batch: one driver call per (direction, source, destination), split
/// over the source device's copy channels when it has them and the call is large
/// (`shares`); a large host-to-device copy may send its last pages through an idle peer
/// (`multipath.rs`). Every call is started before any is waited for, so the copies of one
/// batch (to and from different devices, the shares of one large fetch, the stages of a
/// route) run at once; a route's stage 2 of a chunk is started as soon as that chunk's stage
/// 1 completed. Then every started call is waited for, whatever failed, and the first error
/// is returned. No page, frame or entry of a copy is let go before its call completed
/// ([`InFlight`]).
///
/// One callback section per device involved (peers of routes included) is entered before
/// anything starts and held until every copy completed, so unregistration
/// (`Device::quiesce`) waits for them.
fn copy_batch(lists: &[(CopyKey, KVec<GmemCopy>)], devs: &Devs, space: &Space) -> Result {
    // Routes through a peer, chosen (and their peers looked up) before any section opens:
    // (list, peer, pages).
    let mut picks: KVec<(usize, u8, usize)> = KVec::new();
    for (k, ((dir, from, _), pages)) in lists.iter().enumerate() {
        if *dir != GMEM_COPY_H2D {
            continue;
        }
        if let Some((peer, via)) = multipath::pick(devs.get(*from)?, pages.len()) {
            let id = devs.keep(peer)?;
            picks.push((k, id, via), GFP_KERNEL)?;
        }
    }
    let mut sections: [Option<Ops<'_>>; MAX_DEVICES] = Default::default();
    for ((dir, from, to), _) in lists.iter() {
        for d in [*from, *to] {
            let slot = sections.get_mut(d as usize).ok_or(ENODEV)?;
            if slot.is_none() {
                *slot = Some(devs.get(d)?.ops().ok_or(ENODEV)?);
            }
        }
        if *dir == GMEM_COPY_D2D && !devs.get(*from)?.same_driver(devs.get(*to)?) {
            // Peer copies need one driver on both ends; the state machine's caller only
            // offers peers of the same driver (see `evict::peer_for`).
            return Err(EXDEV);
        }
    }
    // Staging on each route's peer, once inside its section (a peer that is going away is
    // simply not used). Declared after `sections`: freed before they close.
    let mut routes: KVec<(usize, multipath::Staging)> = KVec::new();
    for &(k, id, via) in picks.iter() {
        let (Ok(peer), Some(slot)) = (devs.get(id), sections.get_mut(id as usize)) else { continue };
        if slot.is_none() {
            *slot = peer.ops();
        }
        if slot.is_none() {
            continue;
        }
        if let Ok(Some(st)) = multipath::Staging::new(peer, &lists[k].1, via, space) {
            routes.push((k, st), GFP_KERNEL)?;
        }
    }
    let routed = |k: usize| routes.iter().find(|(r, _)| *r == k).map(|(_, st)| st);
    // Channels pay off only when there is something to overlap: a batch whose copies make
    // a single part (one CPU fault's page, a small fetch) is copied synchronously, in this
    // thread, sparing the hand-off to a channel's worker and back.
    let chans_of = |d: u8| sections.get(d as usize).and_then(Option::as_ref).map_or(0, |o| o.channels());
    let parts: usize = lists.iter().map(|((_, from, _), pages)| shares(pages.len(), chans_of(*from))).sum();
    let overlap = parts > 1 || !routes.is_empty();
    // Declared after `sections` and `routes`, so dropped (waited for) before they go.
    let mut flight = InFlight(KVec::new());
    // Stage 1 of every route first (fences at `stage1[k]..`), so that it is on the peer's
    // link while this thread copies or submits the direct parts.
    let mut stage1: KVec<usize> = KVec::new();
    let mut res = Ok(());
    for (_, st) in routes.iter() {
        stage1.push(flight.0.len(), GFP_KERNEL)?;
        let Some(pops) = sections.get(st.peer().id).and_then(Option::as_ref) else { return Err(ENODEV) };
        if let Err(e) = start_stage(&mut flight, st.peer(), pops, 0, GMEM_COPY_H2D, &st.stage1, None) {
            res = Err(e);
            break;
        }
    }
    'submit: for (k, ((dir, from, to), pages)) in lists.iter().enumerate() {
        if res.is_err() {
            break;
        }
        let (dir, from, to) = (*dir, *from, *to);
        // Both looked up and entered above.
        let (Ok(src), Some(Some(sops))) = (devs.get(from), sections.get(from as usize)) else {
            res = Err(ENODEV);
            break;
        };
        let dops = if dir == GMEM_COPY_D2D { sections.get(to as usize).and_then(Option::as_ref) } else { None };
        let peer = dops.map(|o| &**o);
        // A routed copy's last pages are the route's.
        let pages = match routed(k) {
            Some(st) => {
                let direct = pages.len().saturating_sub(st.len());
                st.count(src, direct);
                &pages[..direct]
            }
            None => &pages[..],
        };
        if pages.is_empty() {
            continue;
        }
        DevStats::add(pages_stat(src, dir), pages.len() as u64);
        trace::migrate(dir, src.id, (dir == GMEM_COPY_D2D).then_some(usize::from(to)), pages.len());
        let chans = if overlap { sops.channels() } else { 0 };
        let per = pages.len().div_ceil(shares(pages.len(), chans));
        for part in pages.chunks(per) {
            DevStats::add(&src.stats.copy_calls, 1);
            if chans == 0 {
                // Synchronous: done (or failed) on return.
                if let Err(e) = sops.copy(dir, part, peer) {
                    res = Err(e);
                    break 'submit;
                }
                continue;
            }
            let chan = src.next_channel(chans);
            if let Err(e) = start(&mut flight, sops, chan, dir, part, peer) {
                res = Err(e);
                break 'submit;
            }
        }
    }
    // Stage 2 of each route, chunk by chunk as stage 1 delivers (stage 1 was started as
    // `stage1[r]`'s fences, one per chunk, in order). The chunks of a route whose stage 1
    // failed are not sent on; the batch fails with that error.
    for ((k, st), &first) in routes.iter().zip(stage1.iter()) {
        if res.is_err() {
            break;
        }
        let to = lists[*k].0 .1;
        let (Some(Some(pops)), Some(Some(dops))) = (sections.get(st.peer().id), sections.get(to as usize)) else {
            res = Err(ENODEV);
            break;
        };
        for (c, part) in st.stage2.chunks(CHUNK_PAGES).enumerate() {
            let waited = flight.0.get(first + c).map_or(Err(EINVAL), |f| f.wait());
            let r = waited.and_then(|()| start_stage(&mut flight, st.peer(), pops, 1, GMEM_COPY_D2D, part, Some(dops)));
            if let Err(e) = r {
                res = Err(e);
                break;
            }
        }
        trace::migrate(GMEM_COPY_D2D, st.peer().id, Some(usize::from(to)), st.len());
    }
    let waited = flight.wait_all();
    res.and(waited)
}

/// The counter of pages that `dev`'s copy engine moves (or fills) in direction `dir`.
fn pages_stat(dev: &Device, dir: u32) -> &core::sync::atomic::AtomicU64 {
    match dir {
        GMEM_COPY_ZERO => &dev.stats.pages_zeroed,
        GMEM_COPY_H2D => &dev.stats.pages_h2d,
        GMEM_COPY_D2H => &dev.stats.pages_d2h,
        _ => &dev.stats.pages_d2d,
    }
}

/// Starts one asynchronous copy of `part` on channel `chan` of `ops`; its fence joins
/// `flight`.
fn start(
    flight: &mut InFlight,
    ops: &Ops<'_>,
    chan: u32,
    dir: u32,
    part: &[GmemCopy],
    peer: Option<&CDriver>,
) -> Result {
    flight.0.reserve(1, GFP_KERNEL)?;
    let fence = Fence::new(chan)?;
    // SAFETY: `part` lives in the caller's `lists` or a route's `Staging` (both kept until
    // `flight` waited: `copy_batch` and `pipelined` declare them first), the pages and
    // frames it names in the caller's batch (under the block lock) or the route's staging
    // frames (freed only after `flight` waited), and `fence` in `flight`, which waits for
    // it before any of them can go.
    unsafe { ops.copy_async(chan, dir, part, peer, &fence) }?;
    // Capacity reserved above.
    let _ = flight.0.push_within_capacity(fence);
    Ok(())
}

/// Starts a route's stage on the peer `dev` (channel `chan`, or channel 0 if it has only
/// one), one call per chunk, and counts it on the peer. Stage 1 goes on channel 0 and
/// stage 2 on channel 1, so that a chunk's stage 2 never queues behind later chunks' stage
/// 1 (a channel runs its calls in order).
fn start_stage(
    flight: &mut InFlight,
    dev: &Device,
    ops: &Ops<'_>,
    chan: u32,
    dir: u32,
    entries: &[GmemCopy],
    peer: Option<&Ops<'_>>,
) -> Result {
    let chan = if chan < ops.channels() { chan } else { 0 };
    let stat = if dir == GMEM_COPY_H2D { &dev.stats.pages_h2d } else { &dev.stats.pages_d2d };
    if dir == GMEM_COPY_H2D {
        trace::migrate(dir, dev.id, None, entries.len());
    }
    for part in entries.chunks(CHUNK_PAGES) {
        DevStats::add(&dev.stats.copy_calls, 1);
        start(flight, ops, chan, dir, part, peer.map(|o| &**o))?;
        DevStats::add(stat, part.len() as u64);
    }
    Ok(())
}

/// Applies the transition `p.state(i) -> next` whose actions are `a` (one page).
///
/// On error before the commit point the page keeps its old state and nothing allocated is
/// kept (mappings may have been revoked: they come back on the next fault).
pub(crate) fn apply(env: &Env<'_>, p: &mut Pages, i: usize, next: PageState, a: &Actions) -> Result {
    let prev = p.state(i);
    let out = apply_batch(env, p, &[Step { i, prev, next, a: *a }]);
    out.res
}

/// The block executor: carries out `steps` (distinct pages of one region, in ascending
/// order, each decided on the page's current state) together, in the order of the module
/// documentation, with one driver call per kind of work rather than per page:
///
/// 1. allocation, front to back (host pages; frames from each device's pool in one go).
///    A step whose allocation fails ends the batch there: the steps before it proceed,
///    it and the rest are left untouched (the caller may evict and retry them);
/// 2. one CPU zap per run of consecutive pages;
/// 3. per device: one `unmap` and one `tlb_invalidate` per run of consecutive pages;
/// 4. one copy per (direction, source, destination), split over the device's copy
///    channels when it has them, all started before any is waited for (`copy_batch`); if
///    any fails, every step is undone once all have completed (each page keeps its old
///    state, its mappings revoked), except in a batch run in parts (below);
/// 5. per page: release the old placement and commit the new state;
/// 6. per device: one `map` with every new entry.
///
/// A batch whose copies are all one driver call and make several channel shares runs in
/// parts instead ([`pipelined`], [`share_plan`]): steps 1 to 4 for its first part, then,
/// while that part is on the link, for the others; steps 5 and 6 part by part, each part
/// committed and mapped as its copy completes, while the later parts are on the link; a
/// failed part leaves the parts before it committed (`Outcome::done`).
pub(crate) fn apply_batch(env: &Env<'_>, p: &mut Pages, steps: &[Step]) -> Outcome {
    // The CPU's mappings are revoked through the VMA, and they hold no page reference
    // (special PTEs, gmem_cpumap.c): a host page they map must not be freed before they
    // are gone. A caller that found no VMA for a live region runs while munmap is under
    // way (it detaches the VMA, then clears the page table entries, then closes the VMA,
    // which tears the region down): a batch that would revoke a CPU mapping is refused
    // then. Teardown (the region dead, its entries cleared) revokes nothing through a VMA.
    if env.vma.is_none() && !env.region.is_dead() && steps.iter().any(|st| st.a.zap_cpu) {
        return Outcome::failed(EFAULT);
    }
    let mut laps = Laps::start();
    let devs = Devs::new();
    // What step 1 allocated, per step: on the stack for small batches (a single CPU fault
    // allocates nothing here).
    const SMALL: usize = 8;
    let mut small = [Fresh::default(); SMALL];
    let mut big: KVec<Fresh> = KVec::new();
    if steps.len() > SMALL {
        if let Err(e) = big.extend_with(steps.len(), Fresh::default(), GFP_KERNEL) {
            return Outcome::failed(e.into());
        }
    }
    let fresh: &mut [Fresh] = if steps.len() > SMALL { &mut big } else { &mut small[..steps.len()] };
    // The devices that may get duplicates of this block's pages: their arrays are made now.
    let dup_devs = steps.iter().fold(0u16, |m, st| {
        let parked = st.a.owner_to_dup.map_or(0, dev_bit);
        let fresh = st.a.alloc_frame.filter(|&d| st.next.loc() != Loc::Device(d)).map_or(0, dev_bit);
        m | parked | fresh
    });
    if let Err(e) = p.reserve_dups(dup_devs) {
        return Outcome::failed(e);
    }
    let space = &env.region.space;

    // 1. Allocation: of every step, or, for a batch in parts, of the first part's; the
    // others' are allocated while its copy is on the link (`pipelined`).
    let plan = share_plan(steps, &devs);
    let head_end = plan.map_or(steps.len(), |pl| pl.head_end);
    let (nfresh, stop, limit) = allocate(&devs, space, p, &steps[..head_end], &mut fresh[..head_end], &chunk_of);
    // A first part that did not get everything ends the batch there, run as a batch of its
    // own size.
    let (steps, plan) = if nfresh == head_end {
        (steps, plan)
    } else {
        let s = &steps[..nfresh];
        (s, share_plan(s, &devs))
    };
    if nfresh == 0 {
        return Outcome { done: 0, res: stop, limit };
    }
    // Room for step 5's frame updates, so that nothing after the copy can fail; taken with
    // the other allocations, so that failing here still changes nothing.
    let mut ops: KVec<(u8, FrameOp)> = KVec::new();
    if let Err(e) = ops.reserve(frame_ops_all(&steps[..nfresh], &fresh[..nfresh]), GFP_KERNEL) {
        undo_steps(p, &steps[..nfresh], &fresh[..nfresh], &devs);
        return Outcome::failed(e.into());
    }

    laps.lap(Phase::Alloc);
    let mut kicked = 0u16;
    // Mappings go in with each part, unless the batch is a whole block (blocks are 2 MiB
    // aligned), which may take one 2 MiB entry at the end instead (`map_batch`).
    let whole = steps.len() == BATCH_PAGES;
    // `mapped`: the parts' map result, if each part was mapped with it.
    let (committed, res, mapped, rest) = match plan {
        Some(plan) => {
            pipelined(env, p, steps, (fresh, nfresh), &devs, plan, (&mut ops, &mut kicked, &mut laps), !whole)
        }
        None => {
            // Not in parts: every step was allocated above.
            let fresh = &fresh[..steps.len()];
            // 2.-3. Revoke every mapping, 4. copy everything, 5. commit everything.
            revoke(env, p, steps, &devs);
            laps.lap(Phase::Revoke);
            // Started within `copy_batch`, which waits for them too: told just before.
            for f in [env.started, env.head_started].into_iter().flatten() {
                f();
            }
            let copied = copy_lists(p, steps, fresh).and_then(|lists| copy_batch(&lists, &devs, space));
            if let Err(e) = copied {
                undo_steps(p, steps, fresh, &devs);
                return Outcome::failed(e);
            }
            laps.lap(Phase::Copy);
            commit_steps(env, p, steps, fresh, &devs, &mut ops, &mut kicked);
            laps.lap(Phase::Commit);
            (steps.len(), Ok(()), None, None)
        }
    };
    // What stopped the allocation: of the first part's, or of the others' (`pipelined`).
    let (stop, limit) = rest.unwrap_or((stop, limit));
    let steps = &steps[..committed];
    // The holders the updates replaced were dropped with each part's commit, without any
    // pool lock. They are all references to this region (the frames freed or re-owned
    // belonged to its pages; fresh frames had no holder), which the caller keeps alive:
    // none of them is the last one, so no region or space is torn down under the block lock.
    drop(ops);
    for d in devices_in(kicked) {
        if let Ok(dev) = devs.get(d) {
            devmod::kick(dev);
        }
    }

    // 6. Device mappings, unless each part's went in with it (a failure leaves consistent,
    // merely unmapped pages).
    let mapped = mapped.unwrap_or_else(|| map_steps(env, p, steps, &devs, true));
    laps.lap(Phase::Map);
    trace::batch(committed, &laps);
    // A failed copy stopped the rest; otherwise what stopped the allocation, if anything;
    // otherwise a failure to map.
    let (res, limit) = match res {
        Err(e) => (Err(e), None),
        Ok(()) => (stop.and(mapped), limit),
    };
    Outcome { done: committed, res, limit }
}

/// Steps 2 and 3 for `steps`: one CPU zap per run of consecutive pages, and per device one
/// `unmap` and one `tlb_invalidate` per run (a prefetched page that leaves a device is
/// settled as used or wasted first, by the device's accessed bit).
fn revoke(env: &Env<'_>, p: &Pages, steps: &[Step], devs: &Devs) {
    let space = &env.region.space;
    // 2. Revoke CPU mappings (before the copy, see the module documentation).
    if let Some(vma) = env.vma {
        runs(
            steps,
            |st| st.a.zap_cpu,
            |first, n| {
                vma.zap_vma_range(env.region.va(first) as usize, n * PAGE_SIZE);
                Space::count(&space.stats.cpu_zaps);
            },
        );
    }
    // 3. Revoke device mappings.
    let unmap_mask = steps.iter().fold(0u16, |m, st| m | st.a.unmap_dev);
    for d in devices_in(unmap_mask) {
        let Ok(dev) = devs.get(d) else { continue };
        // A device that is gone has no page table left to unmap from.
        let (Some(ops), Some(ctx)) = (dev.ops(), space.ctx_if_any(dev)) else { continue };
        // A prefetched page leaves: did the device ever touch it? The frames' flags are read
        // (and cleared: a page is settled once) under one pool lock; the driver is asked
        // after it (no callback under the pool lock), once for the block.
        let r0 = p.range().start;
        let leaving = |st: &&Step| {
            st.a.unmap_dev & (1 << d) != 0 && st.prev.loc() == Loc::Device(d) && st.a.free_frame == Some(d)
        };
        let asked = dev.take_prefetched(
            steps.iter().filter(leaving).filter_map(|st| st.i.checked_sub(r0).map(|o| (o, p.frame(st.i)))),
        );
        if asked != [0; 8] {
            let mut used_bits = asked;
            ops.test_clear_accessed(ctx, env.region.va(r0), &mut used_bits);
            // Settled page by page in page order, as before the bits came per block: the
            // accuracy estimate caps each update, so one update for the block would weigh
            // used and wasted pages differently.
            dev.settle_prefetched(bits::ones(&asked).map(|k| bits::test(&used_bits, k)));
        }
        runs(
            steps,
            |st| st.a.unmap_dev & (1 << d) != 0,
            |first, n| {
                let va = env.region.va(first);
                ops.unmap(ctx, va, n as u64);
                ops.tlb_invalidate(ctx, va, n as u64);
                DevStats::add(&dev.stats.unmap_calls, 1);
                DevStats::add(&dev.stats.tlb_calls, 1);
            },
        );
    }
}

/// Step 5 for `steps` (their copies complete): releases each page's old placement and
/// commits it, then applies the frame updates under one pool lock per device, and drops
/// the holders they replaced (after the lock; `ops` keeps its capacity).
fn commit_steps(
    env: &Env<'_>,
    p: &mut Pages,
    steps: &[Step],
    fresh: &[Fresh],
    devs: &Devs,
    ops: &mut KVec<(u8, FrameOp)>,
    kicked: &mut u16,
) {
    for (st, f) in steps.iter().zip(fresh.iter()) {
        commit(env, p, st, f, ops, kicked);
    }
    let touched = ops.iter().fold(0u16, |m, (d, _)| m | (1 << d));
    for d in devices_in(touched) {
        if let Ok(dev) = devs.get(d) {
            let used = dev.commit_frames(ops.iter_mut().filter(|(x, _)| *x == d).map(|(_, op)| op));
            dev.note_prefetch(used, 0);
        }
    }
    // The freed frames' charges, together (before the holders they replaced go).
    dmem::give_back(ops.iter_mut().map(|(_, op)| op.take_charge()));
    ops.clear();
}

/// How [`pipelined`] runs a batch: its copies' one driver call, `(direction, source,
/// destination)`, and where its first part ends.
#[derive(Clone, Copy)]
struct SharePlan {
    key: CopyKey,
    /// One past the step with the first part's last copy entry (the batch has copies
    /// after it).
    head_end: usize,
}

/// Whether a batch runs in parts ([`pipelined`]): every copy it needs is the same driver
/// call (one direction between the same devices, of the same driver), the source device
/// has copy channels and the copies make two shares or more (`shares`), and a host-to-device
/// copy would not be routed through a peer (`multipath::pick`; a route's two stages are
/// `copy_batch`'s). Any other batch is copied whole.
fn share_plan(steps: &[Step], devs: &Devs) -> Option<SharePlan> {
    let mut key = None;
    let mut n = 0usize;
    for k in steps.iter().filter_map(|st| copy_key(st.a.copy)) {
        if key.is_some_and(|x| x != k) {
            return None;
        }
        key = Some(k);
        n += 1;
    }
    let key = key?;
    let src = devs.get(key.1).ok()?;
    if key.0 == GMEM_COPY_D2D && !src.same_driver(devs.get(key.2).ok()?) {
        return None;
    }
    let parts = shares(n, src.ops()?.channels());
    if parts < 2 || (key.0 == GMEM_COPY_H2D && multipath::pick(src, n).is_some()) {
        return None;
    }
    // Two shares or more: `n >= 2 * CHUNK_MIN_PAGES`, and the first part leaves copies.
    let head = core::cmp::min(tune::HEAD_PAGES.load(Relaxed) as usize, n.div_ceil(parts));
    let mut copy_steps = steps.iter().enumerate().filter(|(_, st)| copy_key(st.a.copy).is_some());
    let head_end = copy_steps.nth(head.saturating_sub(1)).map_or(steps.len(), |(k, _)| k + 1);
    Some(SharePlan { key, head_end })
}

/// What stopped a batch's allocation (step 1): the error, and the dmem cgroup pool whose
/// limit it was, if it was one ([`Outcome::limit`]).
type AllocStop = (Result, Option<Limit>);

/// Steps 2 to 6 of a batch in parts (and step 1 for all but its first part, unless the
/// caller made it), so that the work after each copy overlaps the other
/// parts' copies instead of waiting for all of them. The first part (to `plan.head_end`)
/// has its mappings revoked and its copy started first; while it is on the link, the
/// other steps get their allocations (step 1, unless the caller made them: `fresh` holds
/// the first `allocated` steps'), their mappings are revoked, and they are started in
/// parts, as many as the channels and the copies left allow (`shares`), each on the next
/// channel. Then part by part, in order, its copy is waited for and its pages committed,
/// and mapped if `map_each` (while the parts after it are still on the link). A part is
/// the steps up to its last copy entry; the last part also takes the steps after it.
///
/// Ordering: a page's mappings are revoked before its copy starts and its state commits
/// after its copy completed, as for a whole batch; the block lock is held throughout, so
/// nobody sees a part committed while a later one is on the link. If the other steps'
/// allocation stops, the batch ends before the first step that did not get its own (the
/// allocation's error and cgroup pool are returned, as `apply_batch`'s first step would).
/// If a part fails to start, no later part is started; if a part's copy completes with an
/// error, no later part is committed (all were started by then). Once every started copy
/// completed, the parts before the failed one stay committed and the steps from it on are
/// undone (their mappings, if they were revoked, come back on the next fault). Returns
/// how many steps were committed, the error that stopped the rest, if `map_each` the
/// parts' first map error or `Ok` (`None` otherwise: the caller maps), and what stopped
/// the other steps' allocation, if this made it.
#[allow(clippy::too_many_arguments)]
fn pipelined(
    env: &Env<'_>,
    p: &mut Pages,
    steps: &[Step],
    (fresh, allocated): (&mut [Fresh], usize),
    devs: &Devs,
    plan: SharePlan,
    (ops, kicked, laps): (&mut KVec<(u8, FrameOp)>, &mut u16, &mut Laps),
    map_each: bool,
) -> (usize, Result, Option<Result>, Option<AllocStop>) {
    let (dir, from, to) = plan.key;
    let head_end = plan.head_end;
    let sections = devs.get(from).and_then(|src| {
        let sops = src.ops().ok_or(ENODEV)?;
        let dops = match dir {
            GMEM_COPY_D2D => Some(devs.get(to)?.ops().ok_or(ENODEV)?),
            _ => None,
        };
        Ok((src, sops, dops))
    });
    let (src, sops, dops) = match sections {
        Ok(s) => s,
        Err(e) => {
            undo_steps(p, &steps[..allocated], &fresh[..allocated], devs);
            return (0, Err(e), None, None);
        }
    };
    let peer = dops.as_deref();
    let chans = sops.channels();
    let stat = pages_stat(src, dir);
    // Part boundaries (one past each part's last step), and the copy entries of every part,
    // kept until every copy completed: declared before the fences, so dropped after them.
    // The first part and at most one per channel after it.
    let most = 1 + chans as usize;
    let mut ends: KVec<usize> = KVec::new();
    let mut lists: KVec<KVec<(CopyKey, KVec<GmemCopy>)>> = KVec::new();
    if ends.reserve(most, GFP_KERNEL).is_err() || lists.reserve(most, GFP_KERNEL).is_err() {
        undo_steps(p, &steps[..allocated], &fresh[..allocated], devs);
        return (0, Err(ENOMEM), None, None);
    }
    // Declared after `lists`: dropped (waited for) before it.
    let mut flight = InFlight(KVec::new());
    // Starts the copy of the part `part` (allocated as `made`) on the next channel, its
    // entries kept in `lists` (capacity reserved above; the entries' buffer does not move
    // when later parts are pushed).
    let mut start_part = |p: &Pages, part: &[Step], made: &[Fresh], flight: &mut InFlight| -> Result {
        let l = copy_lists(p, part, made)?;
        lists.push_within_capacity(l).map_err(|_| ENOMEM)?;
        let entries: &[GmemCopy] = lists.last().and_then(|l| l.first()).map_or(&[], |(_, e)| &e[..]);
        DevStats::add(stat, entries.len() as u64);
        DevStats::add(&src.stats.copy_calls, 1);
        trace::migrate(dir, src.id, (dir == GMEM_COPY_D2D).then_some(usize::from(to)), entries.len());
        start(flight, &sops, src.next_channel(chans), dir, entries, peer)
    };
    // The first part.
    revoke(env, p, &steps[..head_end], devs);
    laps.lap(Phase::Revoke);
    // At most `most` boundaries: reserved above.
    let _ = ends.push_within_capacity(head_end);
    let mut res = start_part(p, &steps[..head_end], &fresh[..head_end], &mut flight);
    if let Some(f) = env.head_started.filter(|_| res.is_ok()) {
        f();
    }
    // The others, while it is on the link.
    let mut made = allocated;
    let mut rest_alloc = None;
    if res.is_ok() && allocated < steps.len() {
        let (n, mut stop, mut limit) = {
            let (head, others) = fresh.split_at_mut(allocated);
            let head = (&steps[..allocated], &*head);
            // The first part's frames name the block's chunk on their device, before
            // they are committed.
            allocate(devs, &env.region.space, p, &steps[allocated..], others, &|p, d| {
                chunk_of(p, d).or_else(|| head_chunk(p, head.0, head.1, d))
            })
        };
        made = allocated + n;
        // Room for every frame update of the batch (`ops` is still empty): the parts are
        // committed one by one, reusing it, but when the allocation stops before the
        // first part's next copy, the steps it made are committed together with the first
        // part (`n == 0` below).
        if let Err(e) = ops.reserve(frame_ops_all(&steps[..made], &fresh[..made]), GFP_KERNEL) {
            undo_steps(p, &steps[allocated..made], &fresh[allocated..made], devs);
            made = allocated;
            (stop, limit) = (Err(e.into()), None);
        }
        rest_alloc = Some((stop, limit));
        laps.lap(Phase::Alloc);
    }
    if res.is_ok() {
        // The other parts: the copies left, shared between the channels.
        let rest = &steps[head_end..made];
        let n = rest.iter().filter(|st| copy_key(st.a.copy).is_some()).count();
        // Every other part's mappings at once: one CPU zap and one device TLB flush per
        // run, not per part.
        revoke(env, p, rest, devs);
        laps.lap(Phase::Revoke);
        if n == 0 {
            // Steps without a copy only: the allocation stopped soon after the first part
            // (its error says why; the first part has fewer copies than the batch). Nothing
            // of theirs is on the link: they are committed with the first part, and the
            // batch ends before the first step that did not get its own.
            if let Some(e) = ends.first_mut() {
                *e = made;
            }
        } else {
            let per = n.div_ceil(shares(n, chans));
            let mut copies = 0usize;
            for (k, st) in rest.iter().enumerate() {
                if copy_key(st.a.copy).is_some() {
                    copies += 1;
                    if copies % per == 0 || copies == n {
                        // At most `shares <= chans` boundaries here: reserved above.
                        let _ = ends.push_within_capacity(if copies == n { made } else { head_end + k + 1 });
                    }
                }
            }
            let mut begin = head_end;
            for &end in ends.iter().skip(1) {
                if let Err(e) = start_part(p, &steps[begin..end], &fresh[begin..end], &mut flight) {
                    res = Err(e);
                    break;
                }
                begin = end;
            }
        }
    }
    if let Some(f) = env.started {
        f();
    }
    // A 2 MiB entry would also map a page that a step of an earlier part leaves unmapped
    // (read-ahead's marker): only if every step maps.
    let all_map = steps.iter().all(|st| st.a.map_dev.is_some());
    // Commit every started part, in order, as its copy completes (polling the channel when
    // the driver can be polled: `Fence::wait_polled`); stop at the first that failed. A
    // part that failed to start (`res`) ends the started ones.
    let poll_chan = |c: u32| sops.copy_poll(c);
    let poll = sops.can_poll().then_some(&poll_chan as &dyn Fn(u32));
    let mut committed = 0;
    let mut waited = Ok(());
    let mut mapped = Ok(());
    for (k, &end) in ends.iter().enumerate().take(flight.0.len()) {
        if let Err(e) = flight.0.get(k).map_or(Err(EINVAL), |f| f.wait_polled(poll)) {
            waited = Err(e);
            break;
        }
        laps.lap(Phase::Copy);
        commit_steps(env, p, &steps[committed..end], &fresh[committed..end], devs, ops, kicked);
        laps.lap(Phase::Commit);
        if map_each {
            // A 2 MiB entry only once every part is committed: before that the block holds
            // frames that copies still in flight name.
            let m = map_steps(env, p, &steps[committed..end], devs, end == steps.len() && all_map);
            mapped = mapped.and(m);
            laps.lap(Phase::Map);
        }
        committed = end;
    }
    // Every started copy completes before its frames, pages or entries can go.
    let _ = flight.wait_all();
    drop(flight);
    undo_steps(p, &steps[committed..made], &fresh[committed..made], devs);
    // The earliest failure: a copy that completed with an error comes before a part that
    // failed to start (every started part came before it).
    (committed, waited.and(res), map_each.then_some(mapped), rest_alloc)
}

/// The aligned chunk of device `d` that the steps `head` (allocated as `fresh`, not yet
/// committed) put the block `p`'s pages in, if they put one there at its place.
fn head_chunk(p: &Pages, head: &[Step], fresh: &[Fresh], d: u8) -> Option<u64> {
    let r = p.range();
    let (st, f) = head.iter().zip(fresh).find_map(|(st, f)| f.frame.filter(|&(x, _)| x == d).map(|(_, f)| (st, f)))?;
    u64::from(f).checked_sub(st.i.checked_sub(r.start)? as u64).filter(|b| b % CHUNK_FRAMES == 0)
}

/// [`frame_ops`] of every step of `steps` (`fresh` their allocations, in the same order).
fn frame_ops_all(steps: &[Step], fresh: &[Fresh]) -> usize {
    steps.iter().zip(fresh).map(|(st, f)| frame_ops(st, f)).sum()
}

/// Frame updates one step's commit makes: the old owner frame, its duplicates, and the
/// new or current frame(s) it records.
fn frame_ops(st: &Step, fresh: &Fresh) -> usize {
    usize::from(st.a.free_frame.is_some())
        + usize::from(st.a.owner_to_dup.is_some())
        + st.a.free_dup_frames.count_ones() as usize
        + usize::from(fresh.frame.is_some())
        + usize::from(matches!(st.next.loc(), Loc::Device(_)))
}

/// Step 5 for one page: queues the frees of the old frame and duplicates and the owner
/// updates in `ops` (tagged by device, applied per device after the loop under one pool
/// lock each), records the new frame, drops the host page, then commits the state.
fn commit(env: &Env<'_>, p: &mut Pages, st: &Step, fresh: &Fresh, ops: &mut KVec<(u8, FrameOp)>, kicked: &mut u16) {
    let (i, next, a) = (st.i, st.next, &st.a);
    // `ops` has room for every update of the batch (`frame_ops`), reserved before step 4;
    // an update without room would be lost (a frame never freed), so that is a bug.
    let mut queue = |d: u8, op: FrameOp| {
        kernel::warn_on!(ops.push_within_capacity((d, op)).is_err());
    };
    if let Some(o) = a.free_frame {
        queue(o, FrameOp::Free(p.frame(i)));
    }
    if let Some(o) = a.owner_to_dup {
        // The parked frame stays as a backing copy (same holder): clean, first to go when
        // its device needs room, still lent. The device's duplicate array was made before step 1.
        let f = p.frame(i);
        let _ = p.insert_dup(i, o, f);
        queue(o, FrameOp::Own { frame: f, who: None, set: F_CLEAN, keep: F_LENT, settle: false });
    }
    for d in devices_in(a.free_dup_frames) {
        if let Some(f) = p.take_dup(i, d) {
            queue(d, FrameOp::Free(f));
        }
    }
    if let Some(h) = a.dup_to_owner {
        if let Some(f) = p.take_dup(i, h) {
            p.set_frame(i, f);
        }
    }
    let who = || Some(Owner { region: env.region.clone(), page: i as u32 });
    if let Some((d, f)) = fresh.frame {
        if next.loc() == Loc::Device(d) {
            p.set_frame(i, f);
        } else {
            // The device's duplicate array was made before step 1, so this cannot fail.
            let _ = p.insert_dup(i, d, f);
            queue(d, FrameOp::Own { frame: f, who: who(), set: F_CLEAN | F_REF, keep: 0, settle: false });
        }
        *kicked |= 1 << d;
    }
    // The owner frame's replacement flags follow the page's state. An access settles a
    // pending prefetch of a frame that stays as used.
    if let Loc::Device(d) = next.loc() {
        let mut set = if next.pinned() { F_PINNED } else { 0 };
        if next.host_valid() && !next.dirty() {
            set |= F_CLEAN;
        }
        // A page parked here for another device: its lender reclaims it first.
        if next.parked() {
            set |= F_LENT;
        }
        let keep = if env.access { 0 } else { F_REF | F_PREFETCHED };
        let settle = env.access && a.free_frame != Some(d);
        queue(
            d,
            FrameOp::Own { frame: p.frame(i), who: who(), set: set | if env.access { F_REF } else { 0 }, keep, settle },
        );
    }
    if a.free_host {
        drop(p.set_host(i, None));
    }
    // A pin that ends gives its page back to the process's pin quota.
    if st.prev.pinned() && !next.pinned() {
        crate::obj::pin_quota::uncharge(env.region.space.mm(), 1);
    }
    p.set_state(i, next.bits());
}

/// The first frame of the aligned chunk where the whole block `p`'s pages on device `d`
/// sit or would sit (page `k` of the block at chunk frame `k`), judged by the first of its
/// pages owned by `d`; `None` if it has none, or that page is not where a chunk puts it.
fn chunk_of(p: &Pages, d: u8) -> Option<u64> {
    let r = p.range();
    let i = r.clone().find(|&i| p.state(i).loc() == Loc::Device(d))?;
    let (f, k) = (u64::from(p.frame(i)), (i - r.start) as u64);
    f.checked_sub(k).filter(|b| b % CHUNK_FRAMES == 0)
}

/// One 2 MiB entry for the whole block `p` on device `d`, if it can have one: the block
/// is a whole aligned 2 MiB, and every page of it is owned by `d` in frame `base + k` of
/// one aligned chunk, with no duplicates, and all dirty (mapped writable) or all clean
/// (read-only). That is exactly the protection the page-state machine gives each page's
/// own mapping (a device maps its owner frame writable only while the page is dirty and
/// has no duplicates), so one entry grants no access that 512 would not.
fn huge_entry(env: &Env<'_>, p: &Pages) -> Option<(u8, GmemPte)> {
    let r = p.range();
    let va = env.region.va(r.start);
    if r.len() != BATCH_PAGES || va % (BATCH_PAGES * PAGE_SIZE) as u64 != 0 {
        return None;
    }
    let s0 = p.state(r.start);
    let Loc::Device(d) = s0.loc() else { return None };
    let base = p.frame(r.start);
    if u64::from(base) % CHUNK_FRAMES != 0 {
        return None;
    }
    let same = r.clone().zip(base..).all(|(i, f)| {
        let s = p.state(i);
        s.loc() == Loc::Device(d) && s.dup_mask() == 0 && s.dirty() == s0.dirty() && p.frame(i) == f
    });
    let prot = GMEM_PROT_READ | if s0.dirty() { GMEM_PROT_WRITE } else { 0 };
    same.then_some((d, GmemPte { va, frame: u64::from(base), host: core::ptr::null_mut(), prot, flags: GMEM_PTE_2M }))
}

/// Step 6 for `steps`: one `map_batch` per device that maps any of them (a 2 MiB entry
/// only if `huge` and every step maps); the first error.
fn map_steps(env: &Env<'_>, p: &Pages, steps: &[Step], devs: &Devs, huge: bool) -> Result {
    // Not over a page its step leaves unmapped (read-ahead's marker).
    let huge = huge && steps.iter().all(|st| st.a.map_dev.is_some());
    let map_mask = steps.iter().fold(0u16, |m, st| m | st.a.map_dev.map_or(0, |m| 1 << m.dev));
    let mut res = Ok(());
    for d in devices_in(map_mask) {
        if let Err(e) = map_batch(env, p, steps, d, devs, huge) {
            res = res.and(Err(e));
        }
    }
    res
}

/// Step 6 for device `d`: one `map` call with the entries of every step that maps on it,
/// or, if `huge`, with one 2 MiB entry for the whole block when the device takes those and
/// the block qualifies (`huge_entry`); the driver replaces the block's 4 KiB entries with it.
fn map_batch(env: &Env<'_>, p: &Pages, steps: &[Step], d: u8, devs: &Devs, huge: bool) -> Result {
    let dev = devs.get(d)?.clone();
    if !dev.alive() {
        return Err(ENODEV);
    }
    let ops = dev.ops().ok_or(ENODEV)?;
    let ctx = env.region.space.ctx(&dev)?;
    if huge && dev.maps_2m() {
        if let Some((_, pte)) = huge_entry(env, p).filter(|(o, _)| *o == d) {
            DevStats::add(&dev.stats.map_calls, 1);
            DevStats::add(&dev.stats.map_2m, 1);
            return ops.map(ctx, &[pte]);
        }
    }
    let mut ptes: KVec<GmemPte> = KVec::with_capacity(steps.len(), GFP_KERNEL)?;
    for st in steps {
        let Some(m) = st.a.map_dev.filter(|m| m.dev == d) else { continue };
        let va = env.region.va(st.i);
        let prot = GMEM_PROT_READ | if m.writable { GMEM_PROT_WRITE } else { 0 };
        let pte = if m.remote_host {
            DevStats::add(&dev.stats.remote_maps, 1);
            GmemPte { va, frame: 0, host: host_ptr(p, st.i)?, prot, flags: 0 }
        } else {
            let frame =
                if st.next.loc() == Loc::Device(d) { p.frame(st.i) } else { p.dup_frame(st.i, d).ok_or(EINVAL)? };
            GmemPte { va, frame: u64::from(frame), host: core::ptr::null_mut(), prot, flags: 0 }
        };
        ptes.push(pte, GFP_KERNEL)?;
    }
    DevStats::add(&dev.stats.map_calls, 1);
    ops.map(ctx, &ptes)
}

/// Most steps one executor batch takes: one 2 MiB block of 4 KiB pages.
pub(crate) const BATCH_PAGES: usize = 512;

/// Applies `event` to the pages of the locked block `p` within `first..end`, as one
/// executor batch (teardown). Refused transitions are reported with `refused` (the pages
/// before the refused one are done); stops at the first execution error. Never-touched
/// pages are skipped without a transition when `event` leaves them alone.
///
/// If that batch cannot have its memory (its step list: up to 512 steps, about 20 KiB; its
/// per-step records), the range is done in batches of at most [`SMALL_BATCH`] steps
/// instead, whose steps are on the stack and whose records take a few hundred bytes (more
/// with duplicates). A teardown that gives up here keeps the block's device frames and
/// host pages for good, and an OOM-killed process's exit may well find memory short.
pub(crate) fn apply_range(
    env: &Env<'_>,
    p: &mut Pages,
    first: usize,
    end: usize,
    event: crate::policy::page_state::Event,
    refused: Error,
) -> Result {
    let r = p.range();
    let (first, end) = (core::cmp::max(first, r.start), core::cmp::min(end, r.end));
    match range_in_batches(env, p, (first, end), event, refused, false) {
        // Walked again from the start: pages committed before the failure give no step
        // then (`step_for`), and a free never leaves a page half done.
        Err(e) if e == ENOMEM => range_in_batches(env, p, (first, end), event, refused, true),
        res => res,
    }
}

/// Steps of a batch of [`apply_range`]'s fallback.
const SMALL_BATCH: usize = 8;

/// The step that applies `event` to page `i` of the locked block `p`: `Ok(None)` if it
/// changes nothing, `Err(())` if the transition is refused.
fn step_for(p: &Pages, i: usize, event: crate::policy::page_state::Event) -> core::result::Result<Option<Step>, ()> {
    let s = p.state(i);
    let (next, a) = crate::policy::page_state::transition(s, event).map_err(|_| ())?;
    Ok((next != s || a != Actions::default()).then_some(Step { i, prev: s, next, a }))
}

/// [`apply_range`] over `first..end` as one batch whose steps are in an allocated list
/// (`fail_teardown=` makes that allocation fail, for tests), or, if `small`, in batches
/// of at most [`SMALL_BATCH`] steps kept on the stack.
fn range_in_batches(
    env: &Env<'_>,
    p: &mut Pages,
    (first, end): (usize, usize),
    event: crate::policy::page_state::Event,
    refused: Error,
    small: bool,
) -> Result {
    let mut list: KVec<Step> = KVec::new();
    if !small {
        if tune::teardown_alloc_fails() {
            return Err(ENOMEM);
        }
        list.reserve(end.saturating_sub(first), GFP_KERNEL)?;
    }
    let none = Step { i: 0, prev: PageState::EMPTY, next: PageState::EMPTY, a: Actions::default() };
    let mut stack = [none; SMALL_BATCH];
    let mut i = first;
    while i < end {
        let (mut n, mut refusal) = (0, None);
        while i < end && (!small || n < SMALL_BATCH) {
            match step_for(p, i, event) {
                Err(()) => {
                    refusal = Some(refused);
                    break;
                }
                Ok(None) => {}
                Ok(Some(st)) => {
                    if small {
                        stack[n] = st;
                    } else {
                        // Room reserved above for every page of the range.
                        list.push_within_capacity(st).map_err(|_| ENOMEM)?;
                    }
                    n += 1;
                }
            }
            i += 1;
        }
        let steps = if small { &stack[..n] } else { &list[..] };
        apply_batch(env, p, steps).res?;
        if let Some(e) = refusal {
            return Err(e);
        }
    }
    Ok(())
}
