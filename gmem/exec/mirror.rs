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
use crate::obj::mirror::{
    self, count, BlockBits, DevMirror, Mapped, MirrorPage, MirrorState, Notifier, Snapshot, BLOCK_PAGES, REQ_WRITE,
};
use crate::obj::region::BLOCK_BYTES;
use crate::obj::space::Space;
use crate::policy::bits;
use kernel::{
    ffi::{c_ulong, c_void},
    prelude::*,
    rbtree::{RBTree, RBTreeNode},
    sync::Arc,
};

const PAGE: u64 = 4096;

/// Makes `dev`'s `map` of `GMEM_PTE_SYSMEM` entries in `npages` pages from `va`
/// allocation-free. No lock held (the driver may reclaim).
pub(crate) fn prepare(dev: &Device, ctx: Ctx, va: u64, npages: usize) -> Result {
    let ops = dev.ops().ok_or(ENODEV)?;
    ops.map_prepare(ctx, va, npages as u64)
}

/// What [`map_snapshot`] did.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mapping {
    /// The snapshot's pages are mapped.
    Done,
    /// The snapshot went stale or the driver needs `prepare` again: take a new one.
    Again,
    /// The device asked to write a page migrated to it whose CPU entry is read-only: bring
    /// the block's pages back to the host (the write then faults them in as the CPU would),
    /// and take a new snapshot.
    Unshare,
}

/// Maps on `dev` the pages of `snap` (block at `base`, HMM pfns `pfns`) that the process
/// maps: its host pages remotely, pages migrated to `dev` in their frames; writable where
/// the device asked to write (`req`) and the CPU mapping allows it, else read-only. `ptes`
/// (capacity `BLOCK_PAGES`) and `node` are allocated by the caller. `EFAULT` if a page the
/// device asked for is not one it can map (device memory of someone else).
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
    node: &mut Option<RBTreeNode<u64, Mapped>>,
) -> Result<Mapping> {
    let ops = dev.ops().ok_or(ENODEV)?;
    let Some(mut st) = notifier.lock_current(&space.mirror, snap)? else { return Ok(Mapping::Again) };
    // Checked under the mirror lock: unregistration kills the device before it forgets its
    // record (`forget_device`, which takes this lock), so nothing is recorded after that.
    if !dev.alive() {
        return Err(ENODEV);
    }
    ptes.clear();
    let block = base / BLOCK_BYTES as u64;
    let had = st.mapped_on(dev, block);
    let mut new = Mapped::default();
    for i in snap.first..snap.first + snap.count {
        let (w, bit) = (i / 64, 1u64 << (i % 64));
        // A map may only add rights (the driver API's rule): fault-around skips pages this
        // device maps already, and a read does not remap a page it maps writable (a write
        // fault of another thread of the device got there first).
        if (req[i] == 0 && had.pages[w] & bit != 0) || (req[i] != REQ_WRITE && had.writable[w] & bit != 0) {
            continue;
        }
        let (host, frame, writable) = if let Some(p) = MirrorPage::of(&st, pfns[i]) {
            let writable = p.writable;
            (Some(p), 0, writable)
        } else if let Some((f, writable)) = dev.dpriv().and_then(|pm| pm.frame_of(pfns[i])) {
            if req[i] == REQ_WRITE && !writable {
                return Ok(Mapping::Unshare);
            }
            (None, u64::from(f), writable)
        } else {
            if req[i] != 0 {
                return Err(EFAULT);
            }
            continue;
        };
        let write = req[i] == REQ_WRITE && writable;
        if write {
            if let Some(p) = &host {
                p.mark_dirty();
            }
            new.writable[w] |= bit;
        }
        let pte = GmemPte {
            va: base + i as u64 * PAGE,
            frame,
            host: host.map_or(core::ptr::null_mut(), |p| p.page.as_ptr()),
            prot: GMEM_PROT_READ | if write { GMEM_PROT_WRITE } else { 0 },
            flags: GMEM_PTE_SYSMEM,
        };
        // Within the capacity of `BLOCK_PAGES` the caller gave: no allocation.
        ptes.push_within_capacity(pte).map_err(|_| ENOMEM)?;
        new.pages[w] |= bit;
    }
    if ptes.is_empty() {
        return Ok(Mapping::Done);
    }
    // Recorded before the driver sees them: an entry installed by a `map` that then fails
    // is still unmapped by the next invalidation.
    let old = st.record(dev, ctx, block, &new, node)?;
    let r = ops.map(ctx, ptes);
    if r.is_err() {
        // The map may have installed some entries: remove all of this call's, and forget
        // them, so that the record never claims what the device does not map (a page
        // recorded writable would make its read faults map nothing).
        let n = st.devs.get_mut(dev.id).and_then(Option::as_mut).map_or(0, |m| {
            take_pages(&mut m.blocks, block, &new.pages, |va, n| {
                ops.unmap(ctx, va, n);
                ops.tlb_invalidate(ctx, va, n);
            })
        });
        st.mapped -= n;
    }
    drop(st);
    // The record of an earlier device with this id (it unregistered): dropped unlocked.
    drop(old);
    match r {
        Ok(()) => {
            DevStats::add(&dev.stats.mirror_mapped, ptes.len() as u64);
            Ok(Mapping::Done)
        }
        Err(e) if e == EAGAIN => Ok(Mapping::Again),
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
/// forgets it in the record. Runs under the mirror lock, allocates nothing. Returns the
/// pages unmapped.
fn unmap_range(st: &mut MirrorState, start: u64, end: u64) -> u64 {
    let mut unmapped = 0u64;
    for m in st.devs.iter_mut().flatten() {
        unmapped += unmap_dev(m, start, end);
    }
    st.mapped -= unmapped;
    st.invalidations += u64::from(unmapped != 0);
    unmapped
}

/// [`unmap_range`] for one device's entries.
fn unmap_dev(m: &mut DevMirror, start: u64, end: u64) -> u64 {
    // A device that unregistered refuses the section: its entries went with its contexts
    // (its record is normally gone already, `forget_device`).
    let ops = m.dev.ops();
    let ctx = m.ctx;
    take_runs(&mut m.blocks, start, end, |va, n| {
        if let Some(ops) = &ops {
            ops.unmap(ctx, va, n);
            ops.tlb_invalidate(ctx, va, n);
        }
    })
}

/// Takes the recorded pages of `[start, end)` (`end > start`) out of `blocks`, calling
/// `f(va, npages)` for each run of consecutive ones, and drops blocks left empty. Returns
/// how many pages it took. Allocates nothing.
fn take_runs(blocks: &mut RBTree<u64, Mapped>, start: u64, end: u64, mut f: impl FnMut(u64, u64)) -> u64 {
    let (first_block, last_block) = (start / BLOCK_BYTES as u64, (end - 1) / BLOCK_BYTES as u64);
    let mut taken = 0u64;
    let mut cursor = blocks.cursor_lower_bound_mut(&first_block);
    while let Some(mut c) = cursor {
        let (&block, mapped) = c.current_mut();
        if block > last_block {
            break;
        }
        let base = block * BLOCK_BYTES as u64;
        let (lo, hi) = pages_in(base, start, end);
        // Over a copy: the runs are cleared as they are taken.
        let pages = mapped.pages;
        for (r0, r1) in bits::runs(&pages, lo, hi) {
            bits::clear(&mut mapped.pages, r0, r1);
            bits::clear(&mut mapped.writable, r0, r1);
            f(base + r0 as u64 * PAGE, (r1 - r0) as u64);
            taken += (r1 - r0) as u64;
        }
        cursor = if count(&mapped.pages) == 0 {
            // Freeing a node is allowed here (no reclaim).
            let (next, node) = c.remove_current();
            drop(node);
            next
        } else {
            c.move_next()
        };
    }
    taken
}

/// Unregistration of `dev`: removes every mirror entry it has in `space` and forgets its
/// record there, while the driver still runs (before `Device::quiesce`). Afterwards no
/// invalidation of the space touches the device, and nothing of it stays recorded (which
/// would make every non-blocking invalidation of those ranges refuse).
pub(crate) fn forget_device(dev: &Device, space: &Space) {
    let gone = {
        let mut st = space.mirror.lock();
        let Some(slot) = st.devs.get_mut(dev.id) else { return };
        if !slot.as_ref().is_some_and(|m| core::ptr::eq(&*m.dev, dev)) {
            return;
        }
        let mut m = slot.take();
        let n = m.as_mut().map_or(0, |m| unmap_dev(m, 0, u64::MAX));
        st.mapped -= n;
        m
    };
    // The record (and its `Arc<Device>`) is dropped unlocked.
    drop(gone);
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

/// The unmap watch's callback (`gmem/gmem_mirror.c`): the process is unmapping `[start,
/// end)` (munmap, mremap moving it; the mmap lock is held, and sleeping is allowed), so the
/// space forgets what it remembers of those addresses (`Space::forget_unmapped`).
///
/// # Safety
/// `owner` is the `Space` the watch was registered for, alive until the watch is removed
/// (which waits for this call).
#[no_mangle]
unsafe extern "C" fn gmem_space_unmapped(owner: *const c_void, start: c_ulong, end: c_ulong) {
    // SAFETY: by the caller's contract.
    let space = unsafe { &*owner.cast::<Space>() };
    space.forget_unmapped(start as u64, end as u64);
}

/// Whether some device has a page of `[start, end)` mapped (a device that unregistered
/// has no entries left, whatever its record still says). A device that is unregistering
/// but not gone yet still counts: `unmap_range` would call its driver, which may sleep.
fn any_mapped(st: &mut MirrorState, start: u64, end: u64) -> bool {
    st.devs.iter_mut().flatten().filter(|m| !m.dev.is_gone()).any(|m| any_in(&mut m.blocks, start, end))
}

/// Takes the pages `pages` of block `block` out of `blocks` (those recorded), calling
/// `f(va, npages)` for each run of them; returns how many. Allocates nothing.
fn take_pages(blocks: &mut RBTree<u64, Mapped>, block: u64, pages: &BlockBits, mut f: impl FnMut(u64, u64)) -> u64 {
    let base = block * BLOCK_BYTES as u64;
    let mut taken = 0;
    for (r0, r1) in bits::runs(pages, 0, BLOCK_PAGES) {
        let (va, n) = (base + r0 as u64 * PAGE, (r1 - r0) as u64);
        f(va, n);
        taken += take_runs(blocks, va, va + n * PAGE, |_, _| {});
    }
    taken
}

/// Whether `blocks` records a page of `[start, end)` (`end > start`).
fn any_in(blocks: &mut RBTree<u64, Mapped>, start: u64, end: u64) -> bool {
    let (first_block, last_block) = (start / BLOCK_BYTES as u64, (end - 1) / BLOCK_BYTES as u64);
    // (A mutable cursor: the shared one cannot move.)
    let mut cursor = blocks.cursor_lower_bound_mut(&first_block);
    while let Some(c) = cursor {
        let (&block, mapped) = c.current();
        if block > last_block {
            return false;
        }
        let (lo, hi) = pages_in(block * BLOCK_BYTES as u64, start, end);
        if bits::runs(&mapped.pages, lo, hi).next().is_some() {
            return true;
        }
        cursor = c.move_next();
    }
    false
}

#[kunit_tests(gmem_mirror)]
mod tests {
    use super::*;

    fn blocks_with(blocks: &[u64]) -> RBTree<u64, Mapped> {
        let mut t = RBTree::new();
        let all = Mapped { pages: [u64::MAX; BLOCK_PAGES / 64], writable: [u64::MAX; BLOCK_PAGES / 64] };
        for &b in blocks {
            drop(t.insert(RBTreeNode::new(b, all, GFP_KERNEL).expect("node")));
        }
        t
    }

    #[test]
    fn invalidation_takes_exactly_its_range() {
        let mut t = blocks_with(&[3, 4, 9]);
        let b = BLOCK_BYTES as u64;
        // Nothing recorded below block 3 or between 4 and 9.
        assert!(!any_in(&mut t, 0, 3 * b));
        assert!(!any_in(&mut t, 5 * b, 9 * b));
        assert!(any_in(&mut t, 9 * b + 4096 * 511, 9 * b + 4096 * 512));
        // Pages 510..512 of block 3 and 0..2 of block 4: one run each.
        let mut runs = KVec::new();
        let n = take_runs(&mut t, 3 * b + 510 * 4096, 4 * b + 2 * 4096, |va, n| {
            runs.push((va, n), GFP_KERNEL).expect("push")
        });
        assert_eq!(n, 4);
        assert_eq!(&runs[..], &[(3 * b + 510 * 4096, 2), (4 * b, 2)]);
        assert!(!any_in(&mut t, 3 * b + 510 * 4096, 4 * b + 2 * 4096));
        assert!(any_in(&mut t, 3 * b + 509 * 4096, 3 * b + 510 * 4096));
        assert!(any_in(&mut t, 4 * b + 2 * 4096, 4 * b + 3 * 4096));
        // The writable bits go with the pages.
        assert_eq!(t.get(&4).map(|m| m.writable[0] & 3), Some(0));
        // An unaligned end covers its partial page.
        assert_eq!(take_runs(&mut t, 9 * b, 9 * b + 1, |_, _| {}), 1);
        assert!(!any_in(&mut t, 9 * b, 9 * b + 4096));
        // A whole block goes from the record; the others stay.
        assert_eq!(take_runs(&mut t, 4 * b, 5 * b, |_, _| {}), 510);
        assert!(t.get(&4).is_none());
        assert!(t.get(&3).is_some() && t.get(&9).is_some());
        assert_eq!(take_runs(&mut t, 0, u64::MAX, |_, _| {}), 510 + 511);
        assert!(t.is_empty());
    }
}
