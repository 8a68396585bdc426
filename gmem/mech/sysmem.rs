// SPDX-License-Identifier: GPL-2.0
//! Device faults on ordinary process memory: addresses of a device fault batch that are
//! in no GMEM region (`malloc`, stack, file mappings). Block (2 MiB) by block: snapshot the
//! block with `hmm_range_fault` (faulting in the pages the device touched, as the CPU would;
//! reading the other present pages of the same VMA), let the driver prepare its page
//! table, then map the snapshot remotely under the mirror lock if no invalidation came in
//! between, else take a new one. Pages the device did not ask for but the process maps are
//! mapped too, read-only, unless a device maps them already (fault-around). obj/mirror.rs
//! explains the coherence.

use crate::exec::dpriv;
use crate::exec::mirror::{self, Mapping};
use crate::mech::evict::{self, Why};
use crate::obj::device::{DevStats, Device};
use crate::obj::devices;
use crate::obj::dpriv::{MigBuf, Pagemap};
use crate::obj::mirror::{pfn_file_page, pfn_present, Mapped, Notifier, BLOCK_PAGES, REQ_LOOK, REQ_READ, REQ_WRITE};
use crate::obj::region::{adv, block_base, BLOCK_BYTES};
use crate::obj::space::Space;
use crate::obj::{sched, trace, tune};
use crate::policy::batch;
use crate::policy::page_state::{sysmem_query_word, SysLoc, Target};
use crate::policy::thrash::Verdict;
use core::sync::atomic::{AtomicBool, Ordering};
use kernel::{ffi::c_ulong, prelude::*, rbtree::RBTreeNode, sync::Arc};

/// Snapshots one block may take before the fault gives up with `EBUSY` (each stale one
/// means an invalidation of the process's memory raced with it).
const MAX_SNAPSHOTS: u32 = 64;

/// Services `addrs` (sorted page addresses of `space`, none in a region) for `dev`.
pub(crate) fn device_fault(dev: &Arc<Device>, space: &Space, addrs: &[u64], write: bool) -> Result {
    if addrs.is_empty() {
        return Ok(());
    }
    if !dev.maps_sysmem() {
        return Err(EFAULT);
    }
    DevStats::add(&dev.stats.mirror_faults, addrs.len() as u64);
    // The address space must stay (its page tables are walked); fails once it is exiting.
    let _mm = space.mm_user().ok_or(EFAULT)?;
    let ctx = space.ctx(dev)?;
    let mut pfns = KBox::new([0 as c_ulong; BLOCK_PAGES], GFP_KERNEL)?;
    let mut req = KBox::new([0u8; BLOCK_PAGES], GFP_KERNEL)?;
    let mut ptes = KVec::with_capacity(BLOCK_PAGES, GFP_KERNEL)?;
    let mut node: Option<RBTreeNode<u64, Mapped>> = None;
    let mut buf: Option<MigBuf> = None;
    for block in batch::by_block(addrs) {
        let Some(&a0) = block.first() else { continue };
        let base = block_base(usize::try_from(a0).map_err(|_| EFAULT)?) as u64;
        // The notifier of the block's chunk (blocks never straddle chunks).
        let notifier = space.notifier(a0, write)?;
        // PREFERRED_LOC of this device: the block's advised pages move into its memory
        // first (best effort: what cannot move, or finds no room, is mapped remotely),
        // unless they are all there already.
        if dev.maps_sysmem() {
            let runs = fetch_runs(space, dev, base, block)?;
            let moved = |req: &mut _, pfns: &mut _| {
                dev.dpriv().is_some_and(|pm| all_moved(pm, &notifier, base, block, &runs, req, pfns))
            };
            if !runs.is_empty() && !moved(&mut req, &mut pfns) && !bouncing(dev, space, base) {
                if buf.is_none() {
                    buf = Some(MigBuf::new()?);
                }
                if let Some(b) = buf.as_mut() {
                    for &(lo, hi) in runs.iter() {
                        // Errors leave the pages on the host, where the mapping below finds
                        // them (and reports what really is wrong with the range).
                        let _ = migrate_range(dev, space, b, lo, hi, true);
                    }
                }
            }
        }
        req.fill(0);
        for &a in block {
            let k = ((a - base) / 4096) as usize;
            if let Some(r) = req.get_mut(k) {
                *r = if write { REQ_WRITE } else { REQ_READ };
            }
        }
        let mut snapshots = 0;
        // Each round serves the requested pages of one VMA; a block over several VMAs takes
        // several rounds.
        while req.iter().any(|&r| r != 0) {
            snapshots += 1;
            if snapshots > MAX_SNAPSHOTS {
                return Err(EBUSY);
            }
            if sched::fatal_signal_pending() {
                return Err(EINTR);
            }
            let snap = notifier.fault(dev.dpriv(), base, &req, &mut pfns)?;
            mirror::prepare(dev, ctx, base + snap.first as u64 * 4096, snap.count)?;
            if node.is_none() {
                // Charged to the faulting process's memory cgroup, as its page tables are.
                node = Some(RBTreeNode::new(base / BLOCK_BYTES as u64, Mapped::default(), GFP_KERNEL_ACCOUNT)?);
            }
            match mirror::map_snapshot(dev, ctx, space, &notifier, base, &snap, &pfns, &req, &mut ptes, &mut node)? {
                Mapping::Done => req[snap.first..snap.first + snap.count].fill(0),
                Mapping::Again => {}
                Mapping::Unshare => {
                    dpriv::to_host(dev, space, base + snap.first as u64 * 4096, snap.count)?;
                }
            }
        }
    }
    Ok(())
}

/// The byte runs of block `base` that a fault of `dev` on `block` (its requested page
/// addresses) moves into the device's memory: where PREFERRED_LOC is `dev` and ACCESSED_BY
/// does not name it; none unless a requested page is such.
fn fetch_runs(space: &Space, dev: &Device, base: u64, block: &[u64]) -> Result<KVec<(u64, u64)>> {
    let mut runs = KVec::new();
    let fetch = |bits: u32| adv::preferred(bits) == Some(Target::Device(dev.id as u8)) && bits & (1u32 << dev.id) == 0;
    let m = *space.sysmem_advice.lock();
    if m.runs() == 0 || !block.iter().any(|&a| fetch(m.get(a / 4096))) {
        return Ok(runs);
    }
    let mut run: Option<u64> = None;
    for k in 0..=BLOCK_PAGES as u64 {
        let a = base + k * 4096;
        let on = k < BLOCK_PAGES as u64 && fetch(m.get(a / 4096));
        match (run, on) {
            (None, true) => run = Some(a),
            (Some(lo), false) => {
                runs.push((lo, a), GFP_KERNEL)?;
                run = None;
            }
            _ => {}
        }
    }
    Ok(runs)
}

/// Whether every page the fault asks for (`block`, addresses of block `base`) that lies in
/// `runs` is on `pm`'s device already, or is a page that never moves (page cache, shmem): a
/// look at the page tables, VMA by VMA, faulting nothing in. Then migrating would move
/// nothing and only invalidate the block (which unmaps the device's entries of it too).
/// Uses `req` and `pfns` as scratch. A walk that fails says no.
fn all_moved(
    pm: &Pagemap,
    notifier: &Notifier,
    base: u64,
    block: &[u64],
    runs: &[(u64, u64)],
    req: &mut [u8; BLOCK_PAGES],
    pfns: &mut [c_ulong; BLOCK_PAGES],
) -> bool {
    req.fill(0);
    for &a in block.iter().filter(|&&a| runs.iter().any(|&(lo, hi)| lo <= a && a < hi)) {
        if let Some(r) = req.get_mut(((a - base) / 4096) as usize) {
            *r = REQ_LOOK;
        }
    }
    while req.iter().any(|&r| r != 0) {
        let Ok(snap) = notifier.fault(Some(pm), base, req, pfns) else { return false };
        let walked = snap.first..snap.first + snap.count;
        if !walked.clone().all(|k| req[k] == 0 || pm.frame_of(pfns[k]).is_some() || pfn_file_page(pfns[k])) {
            return false;
        }
        // The walk covers the first page asked for (its VMA's clip): each round progresses.
        req[walked].fill(0);
    }
    true
}

/// Whether the block at `base` keeps bouncing between `dev` and the CPU (moved to the
/// device again and again within the thrashing window, `mech/fault.rs`): the same table
/// and verdicts as GMEM regions' pages, keyed by the block's address; then the fault maps
/// it remotely instead of moving it. Records this move otherwise.
fn bouncing(dev: &Device, space: &Space, base: u64) -> bool {
    if !tune::THRASH.load(Ordering::Relaxed) {
        return false;
    }
    let now = sched::now_ns();
    let v = {
        let mut t = space.thrash.lock();
        if t.table.pinned(base, now) {
            Verdict::PinRemote
        } else {
            t.moved(base, now)
        }
    };
    if matches!(v, Verdict::Migrate) {
        return false;
    }
    DevStats::add(&dev.stats.thrash_events, 1);
    trace::thrash(dev.id, 1, matches!(v, Verdict::Throttle));
    true
}

/// Calls `f(p, npages)` for the rest `[p, stop)` of `[a, stop)` (page aligned, within one
/// 2 MiB block) until it is covered: `f` returns how many pages from `p` it dealt with (its
/// VMA's clip; at least one is taken, so each call progresses), or `None` to stop early.
fn by_vma(a: u64, stop: u64, mut f: impl FnMut(u64, usize) -> Result<Option<usize>>) -> Result {
    let mut p = a;
    while p < stop {
        let Some(covered) = f(p, ((stop - p) / 4096) as usize)? else { break };
        p += core::cmp::max(covered, 1) as u64 * 4096;
    }
    Ok(())
}

/// Moves what can move of `[a, stop)` (page aligned, within one 2 MiB block) into `dev`'s
/// memory, VMA by VMA, after making room by eviction if its pool is short. `holes`: step
/// over pages in no mapping (a fault's advised run may cross one) instead of failing.
fn migrate_range(dev: &Arc<Device>, space: &Space, buf: &mut MigBuf, a: u64, stop: u64, holes: bool) -> Result {
    by_vma(a, stop, |p, n| {
        if dev.frames_free_hint() < n as u64 {
            evict::make_room(dev, n, Why::Advice, None);
        }
        match dpriv::to_device(dev, space, buf, p, n) {
            Err(e) if holes && e == EFAULT => Ok(Some(1)),
            r => r.map(|(_, covered)| Some(covered)),
        }
    })
}

/// For the ioctls (QUERY, ADVISE), which name an address in no region and no mapping
/// `ENOENT`: the mirror's `EFAULT` (no mapping gmem mirrors there) becomes that.
pub(crate) fn no_mapping_is_enoent(e: Error) -> Error {
    if e == EFAULT {
        ENOENT
    } else {
        e
    }
}

/// QUERY of `n` pages from `addr` (page aligned), none of them in a region: one state word
/// per page (`policy::page_state::sysmem_query_word`): on the host if the process maps a
/// page there (and whether a device maps it), on a device if it was migrated there.
/// Nothing is faulted in. `ENOENT` if a page lies in no mapping gmem mirrors.
pub(crate) fn query(space: &Space, addr: u64, n: usize) -> Result<KVVec<u32>> {
    let _mm = space.mm_user().ok_or(ENOENT)?;
    let mut out = KVVec::with_capacity(n, GFP_KERNEL)?;
    let mut pfns = KBox::new([0 as c_ulong; BLOCK_PAGES], GFP_KERNEL)?;
    let mut dpfns = KBox::new([0 as c_ulong; BLOCK_PAGES], GFP_KERNEL)?;
    let mut req = KBox::new([0u8; BLOCK_PAGES], GFP_KERNEL)?;
    // Devices holding migrated process memory (of some process): only their pages can
    // be device-private here.
    let holders = holders()?;
    // A range that wraps the address space is in no mapping.
    let end = (n as u64).checked_mul(4096).and_then(|b| addr.checked_add(b)).ok_or(ENOENT)?;
    let mut a = addr;
    while a < end {
        let base = block_base(usize::try_from(a).map_err(|_| ENOENT)?) as u64;
        let (k0, k1) = (((a - base) / 4096) as usize, core::cmp::min(BLOCK_PAGES as u64, (end - base) / 4096) as usize);
        let notifier = space.notifier(a, false).map_err(no_mapping_is_enoent)?;
        req.fill(0);
        req[k0..k1].fill(REQ_LOOK);
        let mut k = k0;
        // One walk per VMA the pages lie in (and one more per device holding process memory).
        while k < k1 {
            let snap = notifier.fault(None, base, &req, &mut pfns).map_err(no_mapping_is_enoent)?;
            if k < snap.first || k >= snap.first + snap.count {
                // The walk (of the VMA of the first page asked for) missed that page.
                return Err(ENOENT);
            }
            let stop = core::cmp::min(k1, snap.first + snap.count);
            let mut at: KVec<SysLoc> = KVec::with_capacity(stop - k, GFP_KERNEL)?;
            for i in k..stop {
                at.push(if pfn_present(pfns[i]) { SysLoc::Host } else { SysLoc::None }, GFP_KERNEL)?;
            }
            for dev in holders.iter() {
                let Some(pm) = dev.dpriv() else { continue };
                notifier.fault(Some(pm), base, &req, &mut dpfns).map_err(no_mapping_is_enoent)?;
                for (i, loc) in (k..stop).zip(at.iter_mut()) {
                    if pm.frame_of(dpfns[i]).is_some() {
                        *loc = SysLoc::Device(dev.id as u8);
                    }
                }
            }
            let st = space.mirror.lock();
            for (i, &loc) in (k..stop).zip(at.iter()) {
                let w = sysmem_query_word(loc, st.any_maps(base / BLOCK_BYTES as u64, i));
                // Within the capacity of `n` words: nothing is allocated under the lock.
                out.push_within_capacity(w).map_err(|_| EINVAL)?;
            }
            drop(st);
            req[k..stop].fill(0);
            k = stop;
        }
        a = base + k1 as u64 * 4096;
    }
    Ok(out)
}

/// The registered devices that hold process memory migrated to them.
fn holders() -> Result<KVec<Arc<Device>>> {
    let mut out = KVec::new();
    for dev in devices::all() {
        if dev.dpriv().is_some() && dev.frames_sysmem() > 0 {
            out.push(dev, GFP_KERNEL)?;
        }
    }
    Ok(out)
}

/// The pages `[a, stop)` of one 2 MiB block as page addresses (`stop` page aligned).
fn page_addrs(a: u64, stop: u64, out: &mut KVec<u64>) -> Result {
    out.clear();
    let mut p = a;
    while p < stop {
        out.push(p, GFP_KERNEL)?;
        // `stop` is page aligned and above `p`: this stays at most `stop`.
        p += 4096;
    }
    Ok(())
}

/// Calls `f(a, stop)` for each piece of `[start, end)` (page aligned) within one 2 MiB
/// block, stopping with `EINTR` once `cancel` is set or a fatal signal is pending.
fn by_block(start: u64, end: u64, cancel: Option<&Arc<AtomicBool>>, mut f: impl FnMut(u64, u64) -> Result) -> Result {
    let mut a = start;
    while a < end {
        if cancel.is_some_and(|c| c.load(Ordering::Acquire)) || sched::fatal_signal_pending() {
            return Err(EINTR);
        }
        // The end of `a`'s block, or `end` (a block at the top of the address space has no
        // end that fits: the range stops at `end` there).
        let block_end = (block_base(usize::try_from(a).map_err(|_| EFAULT)?) as u64).checked_add(BLOCK_BYTES as u64);
        let stop = block_end.map_or(end, |b| core::cmp::min(end, b));
        f(a, stop)?;
        sched::cond_resched();
        a = stop;
    }
    Ok(())
}

/// PREFETCH of `[start, end)` (page aligned, in no region) to `dev`, block by block:
/// migrates what can move into the device's memory (anonymous private pages, including
/// never-touched ones, which cost no host page), making room by eviction as a GMEM region's
/// prefetch does, then maps every page of the range on the device (the rest remotely, as
/// device read faults would). Stops with `EINTR` once `cancel` is set.
pub(crate) fn prefetch(
    dev: &Arc<Device>,
    space: &Space,
    start: u64,
    end: u64,
    cancel: Option<&Arc<AtomicBool>>,
) -> Result {
    let mut addrs = KVec::with_capacity(BLOCK_PAGES, GFP_KERNEL)?;
    let mut buf = if dev.maps_sysmem() { Some(MigBuf::new()?) } else { None };
    by_block(start, end, cancel, |a, stop| {
        if let Some(buf) = buf.as_mut() {
            migrate_range(dev, space, buf, a, stop, false)?;
        }
        page_addrs(a, stop, &mut addrs)?;
        device_fault(dev, space, &addrs, false)
    })
}

/// PREFETCH of `[start, end)` (page aligned, in no region) to the host: brings back every
/// page migrated to a device. Stops with `EINTR` once `cancel` is set.
pub(crate) fn prefetch_host(space: &Space, start: u64, end: u64, cancel: Option<&Arc<AtomicBool>>) -> Result {
    let holders = holders()?;
    if holders.is_empty() {
        return Ok(());
    }
    by_block(start, end, cancel, |a, stop| {
        // One that is unregistering gives its pages back itself.
        for dev in holders.iter().filter(|d| d.alive()) {
            by_vma(a, stop, |p, n| match dpriv::to_host(dev, space, p, n) {
                Err(e) if e == ENODEV => Ok(None),
                r => r.map(|(_, covered)| Some(covered)),
            })?;
        }
        Ok(())
    })
}
