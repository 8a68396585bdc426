// SPDX-License-Identifier: GPL-2.0
//! Device faults on ordinary process memory: addresses of a device fault batch that are
//! in no GMEM region (`malloc`, stack, file mappings). Block (2 MiB) by block: snapshot the
//! block with `hmm_range_fault` (faulting in the pages the device touched, as the CPU would;
//! reading the other present pages of the same VMA), let the driver prepare its page
//! table, then map the snapshot remotely under the mirror lock if no invalidation came in
//! between, else take a new one. Pages the device did not ask for but the process maps are
//! mapped too, read-only, unless a device maps them already (fault-around). obj/mirror.rs
//! explains the coherence.

use crate::exec::mirror;
use crate::obj::device::{DevStats, Device};
use crate::obj::mirror::{pfn_present, Mapped, BLOCK_PAGES, REQ_LOOK, REQ_READ, REQ_WRITE};
use crate::obj::region::{block_base, BLOCK_BYTES};
use crate::obj::sched;
use crate::obj::space::Space;
use crate::policy::batch;
use crate::policy::page_state::sysmem_query_word;
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
    for block in batch::by_block(addrs) {
        let Some(&a0) = block.first() else { continue };
        let base = block_base(usize::try_from(a0).map_err(|_| EFAULT)?) as u64;
        // The notifier of the block's chunk (blocks never straddle chunks).
        let notifier = space.notifier(a0, write)?;
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
            let snap = notifier.fault(base, &req, &mut pfns)?;
            mirror::prepare(dev, ctx, base + snap.first as u64 * 4096, snap.count)?;
            if node.is_none() {
                // Charged to the faulting process's memory cgroup, as its page tables are.
                node = Some(RBTreeNode::new(base / BLOCK_BYTES as u64, Mapped::default(), GFP_KERNEL_ACCOUNT)?);
            }
            if mirror::map_snapshot(dev, ctx, space, &notifier, base, &snap, &pfns, &req, &mut ptes, &mut node)? {
                req[snap.first..snap.first + snap.count].fill(0);
            }
        }
    }
    Ok(())
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
/// page there, and whether a device maps it. Nothing is faulted in. `ENOENT` if a page
/// lies in no mapping gmem mirrors.
pub(crate) fn query(space: &Space, addr: u64, n: usize) -> Result<KVVec<u32>> {
    let _mm = space.mm_user().ok_or(ENOENT)?;
    let mut out = KVVec::with_capacity(n, GFP_KERNEL)?;
    let mut pfns = KBox::new([0 as c_ulong; BLOCK_PAGES], GFP_KERNEL)?;
    let mut req = KBox::new([0u8; BLOCK_PAGES], GFP_KERNEL)?;
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
        // One walk per VMA the pages lie in.
        while k < k1 {
            let snap = notifier.fault(base, &req, &mut pfns).map_err(no_mapping_is_enoent)?;
            if k < snap.first || k >= snap.first + snap.count {
                // The walk (of the VMA of the first page asked for) missed that page.
                return Err(ENOENT);
            }
            let stop = core::cmp::min(k1, snap.first + snap.count);
            let st = space.mirror.lock();
            for i in k..stop {
                let present = pfn_present(pfns[i]);
                let w = sysmem_query_word(present, st.any_maps(base / BLOCK_BYTES as u64, i));
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

/// PREFETCH of `[start, end)` (page aligned, in no region) to `dev`: maps every page there
/// on the device now, as device read faults would (a page the process never touched is
/// faulted in as a CPU read would: the zero page), block by block, stopping with `EINTR`
/// once `cancel` is set. Pages stay on the host: nothing is migrated.
pub(crate) fn prefetch(
    dev: &Arc<Device>,
    space: &Space,
    start: u64,
    end: u64,
    cancel: Option<&Arc<core::sync::atomic::AtomicBool>>,
) -> Result {
    let mut addrs = KVec::with_capacity(BLOCK_PAGES, GFP_KERNEL)?;
    let mut a = start;
    while a < end {
        if cancel.is_some_and(|c| c.load(core::sync::atomic::Ordering::Acquire)) || sched::fatal_signal_pending() {
            return Err(EINTR);
        }
        // The end of `a`'s block, or `end` (a block at the top of the address space has no
        // end that fits: the range stops at `end` there).
        let block_end = (block_base(usize::try_from(a).map_err(|_| EFAULT)?) as u64).checked_add(BLOCK_BYTES as u64);
        let stop = block_end.map_or(end, |b| core::cmp::min(end, b));
        addrs.clear();
        let mut p = a;
        while p < stop {
            addrs.push(p, GFP_KERNEL)?;
            // `stop` is page aligned and above `p`: this stays at most `stop`.
            p += 4096;
        }
        device_fault(dev, space, &addrs, false)?;
        sched::cond_resched();
        a = stop;
    }
    Ok(())
}
