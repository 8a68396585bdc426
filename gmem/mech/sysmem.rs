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
use crate::obj::mirror::{BlockBits, BLOCK_PAGES, REQ_READ, REQ_WRITE};
use crate::obj::region::{block_base, BLOCK_BYTES};
use crate::obj::sched;
use crate::obj::space::Space;
use crate::policy::batch;
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
    let notifier = space.notifier()?;
    let ctx = space.ctx(dev)?;
    let mut pfns = KBox::new([0 as c_ulong; BLOCK_PAGES], GFP_KERNEL)?;
    let mut req = KBox::new([0u8; BLOCK_PAGES], GFP_KERNEL)?;
    let mut ptes = KVec::with_capacity(BLOCK_PAGES, GFP_KERNEL)?;
    let mut node: Option<RBTreeNode<u64, BlockBits>> = None;
    for block in batch::by_block(addrs) {
        let Some(&a0) = block.first() else { continue };
        let base = block_base(usize::try_from(a0).map_err(|_| EFAULT)?) as u64;
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
                node = Some(RBTreeNode::new(base / BLOCK_BYTES as u64, [0; BLOCK_PAGES / 64], GFP_KERNEL)?);
            }
            if mirror::map_snapshot(dev, ctx, space, notifier, base, &snap, &pfns, &req, &mut ptes, &mut node)? {
                req[snap.first..snap.first + snap.count].fill(0);
            }
        }
    }
    Ok(())
}
