// SPDX-License-Identifier: GPL-2.0
//! Device entries of ordinary process memory (obj/mirror.rs): installs a snapshot's pages
//! on a device (`map_snapshot`) and removes them again when the kernel changes the process's
//! page tables (`gmem_mirror_invalidate`, the MMU notifier's callback). The only driver
//! calls of the mirror are here.
//!
//! Both run under `Space::mirror`, which memory reclaim takes through the notifier, so
//! neither allocates: the entry array and the record's tree node come from the caller,
//! and the driver's `map` of `GMEM_PTE_SYSMEM` entries is allocation-free after its
//! `map_prepare` (called here too, before the lock).

use crate::abi::{GmemPte, GMEM_PROT_READ, GMEM_PROT_WRITE, GMEM_PTE_SYSMEM};
use crate::obj::device::{Ctx, DevStats, Device, DeviceOps};
use crate::obj::mirror::{self, BlockBits, MirrorPage, MirrorState, Notifier, Snapshot, BLOCK_PAGES, REQ_WRITE};
use crate::obj::region::BLOCK_BYTES;
use crate::obj::space::Space;
use kernel::{
    ffi::{c_ulong, c_void},
    prelude::*,
    rbtree::RBTreeNode,
    sync::Arc,
};

const PAGE: u64 = 4096;

/// Makes `dev`'s `map` of `GMEM_PTE_SYSMEM` entries in `npages` pages from `va`
/// allocation-free. No lock held (the driver may reclaim).
pub(crate) fn prepare(dev: &Device, ctx: Ctx, va: u64, npages: usize) -> Result {
    let ops = dev.ops().ok_or(ENODEV)?;
    ops.map_prepare(ctx, va, npages as u64)
}

/// Maps on `dev` the pages of `snap` (block at `base`, HMM pfns `pfns`) that the process
/// maps: writable where the device asked to write (`req`) and the CPU mapping allows it,
/// else read-only. `ptes` (capacity `BLOCK_PAGES`) and `node` are allocated by the caller.
/// `Ok(false)` if the snapshot went stale or the driver needs `prepare` again: take a new
/// one. Returns the pages mapped through `mapped`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn map_snapshot(
    dev: &Arc<Device>,
    ctx: Ctx,
    space: &Space,
    notifier: &Notifier,
    base: u64,
    snap: &Snapshot,
    pfns: &[c_ulong; BLOCK_PAGES],
    req: &[u8; BLOCK_PAGES],
    ptes: &mut KVec<GmemPte>,
    node: &mut Option<RBTreeNode<u64, BlockBits>>,
) -> Result<bool> {
    let ops = dev.ops().ok_or(ENODEV)?;
    let Some(mut st) = notifier.lock_current(&space.mirror, snap)? else { return Ok(false) };
    ptes.clear();
    let mut bits: BlockBits = [0; BLOCK_PAGES / 64];
    let block = base / BLOCK_BYTES as u64;
    let had = st.blocks.get(&block).copied().unwrap_or([0; BLOCK_PAGES / 64]);
    for i in snap.first..snap.first + snap.count {
        // Fault-around never touches a page some device maps already: its entry there may
        // be writable, and a map may only add rights (the driver API's rule).
        if req[i] == 0 && had[i / 64] & (1 << (i % 64)) != 0 {
            continue;
        }
        let Some(p) = MirrorPage::of(&st, pfns[i]) else { continue };
        let write = req[i] == REQ_WRITE && p.writable;
        if write {
            p.mark_dirty();
        }
        let pte = GmemPte {
            va: base + i as u64 * PAGE,
            frame: 0,
            host: p.page.as_ptr(),
            prot: GMEM_PROT_READ | if write { GMEM_PROT_WRITE } else { 0 },
            flags: GMEM_PTE_SYSMEM,
        };
        // Within the capacity of `BLOCK_PAGES` the caller gave: no allocation.
        ptes.push_within_capacity(pte).map_err(|_| ENOMEM)?;
        bits[i / 64] |= 1 << (i % 64);
    }
    if ptes.is_empty() {
        return Ok(true);
    }
    // Recorded before the driver sees them: an entry installed by a `map` that then fails
    // is still unmapped by the next invalidation.
    st.record(dev, ctx, block, &bits, node)?;
    match ops.map(ctx, ptes) {
        Ok(()) => {
            DevStats::add(&dev.stats.mirror_mapped, ptes.len() as u64);
            Ok(true)
        }
        Err(e) if e == EAGAIN => Ok(false),
        Err(e) => Err(e),
    }
}

/// The pages `lo..hi` of the block at `base` that `[start, end)` covers (it overlaps the
/// block).
fn pages_in(base: u64, start: u64, end: u64) -> (usize, usize) {
    let lo = start.saturating_sub(base) / PAGE;
    let hi = core::cmp::min(BLOCK_PAGES as u64, (end - base).div_ceil(PAGE));
    (lo as usize, hi as usize)
}

/// Unmaps `[start, end)` on every device that maps process memory of the space, and
/// forgets it in the record. Runs under the mirror lock, allocates nothing.
fn unmap_range(st: &mut MirrorState, start: u64, end: u64) {
    let (first_block, last_block) = (start / BLOCK_BYTES as u64, (end - 1) / BLOCK_BYTES as u64);
    let mut unmapped = 0u64;
    let mut cursor = st.blocks.cursor_lower_bound_mut(&first_block);
    while let Some(mut c) = cursor {
        let (&block, bits) = c.current_mut();
        if block > last_block {
            break;
        }
        let base = block * BLOCK_BYTES as u64;
        let (lo, hi) = pages_in(base, start, end);
        let mut k = lo;
        while k < hi {
            if bits[k / 64] & (1 << (k % 64)) == 0 {
                k += 1;
                continue;
            }
            let run = k;
            while k < hi && bits[k / 64] & (1 << (k % 64)) != 0 {
                bits[k / 64] &= !(1 << (k % 64));
                k += 1;
            }
            let (va, n) = (base + run as u64 * PAGE, (k - run) as u64);
            for (dev, ctx) in st.devs.iter().flatten() {
                // A device that unregistered refuses the section: its entries went with it.
                if let Some(ops) = dev.ops() {
                    ops.unmap(*ctx, va, n);
                    ops.tlb_invalidate(*ctx, va, n);
                }
            }
            unmapped += n;
        }
        cursor = if bits.iter().all(|&w| w == 0) {
            // Freeing a node is allowed here (no reclaim).
            let (next, node) = c.remove_current();
            drop(node);
            next
        } else {
            c.move_next()
        };
    }
    st.mapped -= unmapped;
    st.invalidations += u64::from(unmapped != 0);
}

/// The invalidate callback of a space's notifier (called by `gmem/gmem_mirror.c`): before
/// the kernel changes or frees what `[start, end)` maps, every device entry of it goes.
///
/// # Safety
/// `owner` is the `Space` the notifier was created for, alive until the notifier is
/// removed (which waits for this call); `mni` is that notifier.
#[no_mangle]
unsafe extern "C" fn gmem_mirror_invalidate(
    owner: *const c_void,
    mni: *mut c_void,
    start: c_ulong,
    end: c_ulong,
    blockable: bool,
    cur_seq: c_ulong,
) -> bool {
    // SAFETY: by the caller's contract.
    let space = unsafe { &*owner.cast::<Space>() };
    let mut st = if blockable {
        space.mirror.lock()
    } else {
        match space.mirror.try_lock() {
            Some(g) => g,
            None => return false,
        }
    };
    let (start, end) = (start as u64, end as u64);
    if end <= start {
        return true;
    }
    // Driver callbacks may sleep: without permission to, refuse if there is work.
    if !blockable && any_mapped(&mut st, start, end) {
        return false;
    }
    // SAFETY: our notifier, under the mirror lock.
    unsafe { mirror::set_seq(mni, cur_seq) };
    unmap_range(&mut st, start, end);
    true
}

/// Whether some page of `[start, end)` is recorded as mapped.
fn any_mapped(st: &mut MirrorState, start: u64, end: u64) -> bool {
    let (first_block, last_block) = (start / BLOCK_BYTES as u64, (end - 1) / BLOCK_BYTES as u64);
    // (A mutable cursor: the shared one cannot move.)
    let mut cursor = st.blocks.cursor_lower_bound_mut(&first_block);
    while let Some(c) = cursor {
        let (&block, bits) = c.current();
        if block > last_block {
            return false;
        }
        let (lo, hi) = pages_in(block * BLOCK_BYTES as u64, start, end);
        if (lo..hi).any(|k| bits[k / 64] & (1 << (k % 64)) != 0) {
            return true;
        }
        cursor = c.move_next();
    }
    false
}

#[kunit_tests(gmem_mirror)]
mod tests {
    use super::*;

    fn state_with(blocks: &[(u64, BlockBits)]) -> MirrorState {
        let mut st = MirrorState::new();
        for &(b, bits) in blocks {
            let node = RBTreeNode::new(b, bits, GFP_KERNEL).expect("node");
            drop(st.blocks.insert(node));
            st.mapped += bits.iter().map(|w| u64::from(w.count_ones())).sum::<u64>();
        }
        st
    }

    #[test]
    fn invalidation_forgets_exactly_its_range() {
        let all = [u64::MAX; BLOCK_PAGES / 64];
        let mut st = state_with(&[(3, all), (4, all), (9, all)]);
        let b = BLOCK_BYTES as u64;
        // Nothing recorded below block 3 or between 4 and 9.
        assert!(!any_mapped(&mut st, 0, 3 * b));
        assert!(!any_mapped(&mut st, 5 * b, 9 * b));
        assert!(any_mapped(&mut st, 9 * b + 4096 * 511, 9 * b + 4096 * 512));
        // Pages 510..512 of block 3 and 0..2 of block 4: one run each.
        unmap_range(&mut st, 3 * b + 510 * 4096, 4 * b + 2 * 4096);
        assert_eq!(st.mapped, 3 * 512 - 4);
        assert!(!any_mapped(&mut st, 3 * b + 510 * 4096, 4 * b + 2 * 4096));
        assert!(any_mapped(&mut st, 3 * b + 509 * 4096, 3 * b + 510 * 4096));
        assert!(any_mapped(&mut st, 4 * b + 2 * 4096, 4 * b + 3 * 4096));
        // An unaligned end covers its partial page.
        unmap_range(&mut st, 9 * b, 9 * b + 1);
        assert!(!any_mapped(&mut st, 9 * b, 9 * b + 4096));
        // A whole block goes from the record; the others stay.
        unmap_range(&mut st, 4 * b, 5 * b);
        assert!(st.blocks.get(&4).is_none());
        assert!(st.blocks.get(&3).is_some() && st.blocks.get(&9).is_some());
        assert_eq!(st.mapped, 510 + 511);
        assert_eq!(st.invalidations, 3);
        unmap_range(&mut st, 0, u64::MAX);
        assert!(st.blocks.is_empty());
        assert_eq!(st.mapped, 0);
    }
}
