// SPDX-License-Identifier: GPL-2.0
//! Region: one GMEM allocation (one VMA) and the residency of each of its pages.
//!
//! Per touched page the region keeps exactly 16 bytes: the packed page state (4, see
//! `policy/src/page_state.rs`), the owner's frame number (4) and the host page (8, `None`
//! when no host copy exists), in zero-filled arrays (`meta.rs`) allocated per **block** on
//! first touch. A block is the part of the region inside one 2 MiB-aligned virtual block
//! (512 pages; the first and last may be shorter), so the blocks of device fault batches,
//! density prefetch, fault-around and eviction neighbourhoods are exactly these. Duplicates
//! on non-owner devices live per block, in one frame array per device that holds any
//! (`Dups`). Advice is kept per range
//! in a small interval map (`policy/src/range.rs`).
//!
//! **Locking.** Each block has its own lock (`Block::pages`), so work on different blocks
//! of one region — faults from two threads, or from two devices — runs in parallel. The
//! block directory (`Region::dir`) and the advice map (`Region::advice`) are leaf locks,
//! held only to look up or create a block and to read or change advice. No code holds two
//! block locks at once.
//!
//! Lock order: mmap lock -> `Block::pages` -> (`Region::advice` | `Region::dir` |
//! `Space::thrash`) and `Space::ctxs` -> `Device::frames`.
//!
//! **Lifetimes.** A block is created once and never removed before its region is dropped;
//! lookups hand out `Arc<Block>` references. A torn-down region (`dead`) keeps its blocks
//! (empty) until the last reference to the region goes.

use crate::obj::host_page::HostPage;
use crate::obj::meta::Meta;
use crate::obj::space::Space;
use crate::policy::page_state::{dev_bit, PageState, MAX_DEVICES};
use crate::policy::range::{AdviceMap, PageRange};
use core::sync::atomic::{AtomicBool, Ordering};
use kernel::{
    new_mutex,
    prelude::*,
    sync::{Arc, Mutex},
};

pub(crate) const PAGE_SIZE: usize = 4096;

/// Advice bits kept in the region's advice map.
pub(crate) mod adv {
    // Bits 0..16: bit d set = device d maps host pages remotely (ACCESSED_BY).
    pub(crate) const READ_MOSTLY: u32 = 1 << 16;
    /// Bits 20..25: preferred location, 0 = none, `d + 1` = device d, `PREF_HOST` = host.
    pub(crate) const PREF_SHIFT: u32 = 20;
    pub(crate) const PREF_MASK: u32 = 0x1f << PREF_SHIFT;
    pub(crate) const PREF_HOST: u32 = 31;

    pub(crate) fn preferred(bits: u32) -> Option<crate::policy::page_state::Target> {
        use crate::policy::page_state::Target;
        match (bits & PREF_MASK) >> PREF_SHIFT {
            0 => None,
            PREF_HOST => Some(Target::Host),
            d => Some(Target::Device((d - 1) as u8)),
        }
    }

    /// Forgets the advice in `map` that names device `d`: its ACCESSED_BY bit and a
    /// PREFERRED_LOC of it (the device unregistered; one registered later under the same
    /// id must not inherit them).
    pub(crate) fn forget_device(map: &mut super::AdviceMap<{ super::ADVICE_RUNS }>, d: usize) {
        let Some(d) = u32::try_from(d).ok().filter(|_| d < super::MAX_DEVICES) else { return };
        let (bit, pref) = (1u32 << d, (d + 1) << PREF_SHIFT);
        // Never `Full`: unadvised pages stay unadvised.
        let _ = map.update_all(|b| {
            let b = b & !bit;
            if b & PREF_MASK == pref {
                b & !PREF_MASK
            } else {
                b
            }
        });
    }
}

/// Runs of distinct advice one region may carry.
pub(crate) const ADVICE_RUNS: usize = 32;

/// Duplicates of a block's pages on devices that are not their owner (read-only copies of
/// READ_MOSTLY pages, and the backing copies that pages read back from where they were
/// parked leave there): the duplicate's frame by (page of the block, device). One array of
/// a frame per page for each device that holds duplicates in the block, made before the
/// first is recorded and freed once empty (by the next batch): O(1) per lookup, insertion
/// and removal, no allocation per duplicate; 2 KiB per device that holds any in the
/// block, whatever the block's length (a short block at a region's end too). (Before, one
/// red-black tree node per duplicate, allocated and freed one by one: in P4's 2x stream,
/// where half the region is parked on the peer and comes back, eviction's commit cost
/// 3.2 us per page returned to its backing copy against 1.3 us per page written back to
/// the host.)
///
/// An insertion happens after the transition's allocations, at a point where it must not
/// fail, so the arrays of the devices it may name are made first ([`Dups::reserve`]).
pub(crate) struct Dups {
    /// (device, frame of each page's duplicate there or [`NO_DUP`], how many it holds).
    arrays: KVec<(u8, KVec<u32>, usize)>,
    /// Duplicates in all.
    len: usize,
}

/// No duplicate (frame numbers are below `u32::MAX`: `Device::new`).
const NO_DUP: u32 = u32::MAX;

impl Dups {
    fn new() -> Self {
        Dups { arrays: KVec::new(), len: 0 }
    }

    /// Where in `arrays` the array of device `dev` is, if it has one.
    fn slot(&self, dev: u8) -> Option<usize> {
        self.arrays.iter().position(|a| a.0 == dev)
    }

    /// Makes the arrays of the devices in the bit mask `devs` that have none yet, so that
    /// [`Dups::insert`]s naming them need no allocation, and frees the empty arrays of the
    /// others. (Arrays are freed only here, at the start of a batch, never by a removal:
    /// the batch's commit may empty a device's array and then record a duplicate there.)
    fn reserve(&mut self, devs: u16) -> Result {
        self.arrays.retain(|a| a.2 != 0 || devs & dev_bit(a.0) != 0);
        for d in devices_in(devs) {
            if self.slot(d).is_none() {
                self.add(d, GFP_KERNEL_ACCOUNT)?;
            }
        }
        Ok(())
    }

    /// A new, empty array for `dev`.
    fn add(&mut self, dev: u8, gfp: kernel::alloc::Flags) -> Result<usize> {
        let mut frames = KVec::with_capacity(BLOCK_PAGES, gfp)?;
        frames.extend_with(BLOCK_PAGES, NO_DUP, gfp)?;
        self.arrays.push((dev, frames, 0), gfp)?;
        Ok(self.arrays.len() - 1)
    }

    /// Records `frame` as `dev`'s duplicate of page `k` of the block (replacing any). Uses
    /// the device's array (or, if the caller did not reserve it, allocates one without
    /// sleeping and returns `ENOMEM` on failure); `EINVAL` for a page outside the block or
    /// a frame no device has.
    fn insert(&mut self, k: usize, dev: u8, frame: u32) -> Result {
        if k >= BLOCK_PAGES || frame == NO_DUP {
            return Err(EINVAL);
        }
        let a = match self.slot(dev) {
            Some(a) => a,
            None => self.add(dev, GFP_NOWAIT)?,
        };
        let (_, frames, n) = &mut self.arrays[a];
        if core::mem::replace(&mut frames[k], frame) == NO_DUP {
            *n += 1;
            self.len += 1;
        }
        Ok(())
    }

    /// Forgets `dev`'s duplicate of page `k` and returns its frame (an array left empty
    /// stays until the next [`Dups::reserve`]).
    fn remove(&mut self, k: usize, dev: u8) -> Option<u32> {
        let a = self.slot(dev)?;
        let (_, frames, n) = &mut self.arrays[a];
        let f = core::mem::replace(frames.get_mut(k)?, NO_DUP);
        if f == NO_DUP {
            return None;
        }
        *n -= 1;
        self.len -= 1;
        Some(f)
    }

    fn get(&self, k: usize, dev: u8) -> Option<u32> {
        self.arrays.get(self.slot(dev)?)?.1.get(k).copied().filter(|&f| f != NO_DUP)
    }

    /// Bytes allocated (the arrays).
    fn bytes(&self) -> usize {
        self.arrays.capacity() * core::mem::size_of::<(u8, KVec<u32>, usize)>()
            + self.arrays.iter().map(|a| a.1.capacity() * core::mem::size_of::<u32>()).sum::<usize>()
    }
}

/// Pages per block (one 2 MiB virtual block of 4 KiB pages).
pub(crate) const BLOCK_PAGES: usize = 512;

/// Bytes of one block (2 MiB).
pub(crate) const BLOCK_BYTES: usize = BLOCK_PAGES * PAGE_SIZE;
/// Read-ahead lanes per stream (`mech/readahead.rs`): blocks in flight at once, and how
/// many blocks read-ahead runs ahead of its reader.
pub(crate) const AHEAD_LANES: usize = 3;

/// The start of the 2 MiB-aligned block of virtual memory that holds `va`.
pub(crate) fn block_base(va: usize) -> usize {
    va & !(BLOCK_BYTES - 1)
}

/// Blocks per directory leaf (a leaf covers 128 MiB and costs 512 bytes once touched; a
/// 1 TiB region has 8,192 directory slots of 24 bytes).
const LEAF_BLOCKS: usize = 64;

/// The per-page data of one block, under the block's lock. Pages are named by their index
/// in the region; indices outside the block read as empty and are never written.
pub(crate) struct Pages {
    /// Region index of the block's first page.
    base: usize,
    state: Meta<u32>,
    frame: Meta<u32>,
    host: Meta<Option<HostPage>>,
    dups: Dups,
}

impl Pages {
    /// The block's pages as region indices.
    pub(crate) fn range(&self) -> core::ops::Range<usize> {
        self.base..self.base + self.state.len()
    }

    pub(crate) fn contains(&self, i: usize) -> bool {
        self.range().contains(&i)
    }

    fn at(&self, i: usize) -> Option<usize> {
        i.checked_sub(self.base).filter(|&k| k < self.state.len())
    }

    pub(crate) fn state(&self, i: usize) -> PageState {
        PageState::from_bits(self.at(i).and_then(|k| self.state.get(k)).copied().unwrap_or(0))
    }

    /// The owner device's frame of page `i` (meaningful while the page is on a device).
    pub(crate) fn frame(&self, i: usize) -> u32 {
        self.at(i).and_then(|k| self.frame.get(k)).copied().unwrap_or(0)
    }

    /// The host page of page `i`, if it has one.
    pub(crate) fn host(&self, i: usize) -> Option<&HostPage> {
        self.at(i).and_then(|k| self.host.get(k)?.as_ref())
    }

    pub(crate) fn set_state(&mut self, i: usize, bits: u32) {
        if let Some(s) = self.at(i).and_then(|k| self.state.get_mut(k)) {
            *s = bits;
        }
    }

    pub(crate) fn set_frame(&mut self, i: usize, frame: u32) {
        if let Some(f) = self.at(i).and_then(|k| self.frame.get_mut(k)) {
            *f = frame;
        }
    }

    /// Replaces page `i`'s host page, returning the old one (or, for an index outside the
    /// block, handing `page` back).
    pub(crate) fn set_host(&mut self, i: usize, page: Option<HostPage>) -> Option<HostPage> {
        match self.at(i).and_then(|k| self.host.get_mut(k)) {
            Some(h) => core::mem::replace(h, page),
            None => page,
        }
    }

    pub(crate) fn take_dup(&mut self, page: usize, dev: u8) -> Option<u32> {
        self.dups.remove(self.at(page)?, dev)
    }

    pub(crate) fn dup_frame(&self, page: usize, dev: u8) -> Option<u32> {
        self.dups.get(self.at(page)?, dev)
    }

    /// Makes the duplicate arrays of the devices in the mask `devs` (see [`Dups::reserve`]).
    pub(crate) fn reserve_dups(&mut self, devs: u16) -> Result {
        self.dups.reserve(devs)
    }

    /// Records `frame` as `dev`'s duplicate of page `page` (see [`Dups::insert`]).
    pub(crate) fn insert_dup(&mut self, page: usize, dev: u8, frame: u32) -> Result {
        let k = self.at(page).ok_or(EINVAL)?;
        self.dups.insert(k, dev, frame)
    }

    /// Bytes allocated for the block's pages.
    fn bytes(&self) -> usize {
        self.state.bytes() + self.frame.bytes() + self.host.bytes() + self.dups.bytes()
    }
}

/// One block of a region: its pages under their own lock.
#[pin_data]
pub(crate) struct Block {
    #[pin]
    pub(crate) pages: Mutex<Pages>,
}

impl Block {
    fn new(base: usize, len: usize) -> Result<Arc<Block>> {
        // All-zero metadata is "never touched" (`PageState::EMPTY`, frame 0, no host page);
        // failable, see meta.rs.
        const _: () = assert!(PageState::EMPTY.bits() == 0);
        let pages = Pages {
            base,
            state: Meta::zeroed(len)?,
            frame: Meta::zeroed(len)?,
            host: Meta::zeroed(len)?,
            dups: Dups::new(),
        };
        Arc::pin_init(
            try_pin_init!(Block {
                pages <- new_mutex!(pages, "gmem_block_pages"),
            }),
            GFP_KERNEL_ACCOUNT,
        )
    }
}

/// A directory leaf: the blocks of 128 MiB of the region, `None` until touched.
type Leaf = KVVec<Option<Arc<Block>>>;

/// The region's blocks: a two-level directory, filled on first touch.
struct Dir {
    slots: KVVec<Option<Leaf>>,
}

#[pin_data]
pub(crate) struct Region {
    pub(crate) start: usize,
    pub(crate) npages: usize,
    pub(crate) space: Arc<Space>,
    /// Set once the region is torn down: every later fault gets SIGBUS / EFAULT. Checked
    /// under a block lock; teardown sets it before it empties the blocks one by one.
    dead: AtomicBool,
    /// A read-ahead of this region's device pages to the host is queued or running
    /// (`mech/readahead.rs`), per lane: blocks go round the [`AHEAD_LANES`] lanes by their
    /// index, so that many consecutive blocks come home at once, one at a time per lane.
    pub(crate) homing_ahead: [AtomicBool; AHEAD_LANES],
    /// The block (2 MiB-aligned address) of the CPU fault that last streamed through the
    /// region (`usize::MAX`: none yet): read-ahead to the host keeps going while within
    /// `readahead::DEPTH` blocks of it, and a CPU fault on the first page of the block
    /// after it continues the stream (`prefetch::cpu_window`).
    pub(crate) cpu_at: core::sync::atomic::AtomicUsize,
    /// Page offset of `start` within its 2 MiB virtual block (blocks are VA-aligned).
    skew: usize,
    /// Advice per page range (a leaf lock).
    #[pin]
    pub(crate) advice: Mutex<AdviceMap<ADVICE_RUNS>>,
    /// The blocks (a leaf lock, held only to find or create one).
    #[pin]
    dir: Mutex<Dir>,
}

impl Region {
    /// A region of `npages` never-touched pages at `start`, with `initial_advice` (advice
    /// bits, e.g. ALLOC's preferred device) over all of it. Only the block directory is
    /// allocated (24 bytes per 128 MiB).
    pub(crate) fn new(space: Arc<Space>, start: usize, npages: usize, initial_advice: u32) -> Result<Arc<Region>> {
        let mut advice = AdviceMap::new();
        if initial_advice != 0 {
            advice.set(PageRange { first: 0, count: npages as u64 }, initial_advice).map_err(|_| EINVAL)?;
        }
        let skew = (start / PAGE_SIZE) % BLOCK_PAGES;
        let blocks = npages.checked_add(skew).ok_or(EINVAL)?.div_ceil(BLOCK_PAGES);
        let leaves = blocks.div_ceil(LEAF_BLOCKS);
        let mut slots = KVVec::with_capacity(leaves, GFP_KERNEL_ACCOUNT)?;
        for _ in 0..leaves {
            slots.push(None, GFP_KERNEL_ACCOUNT)?;
        }
        Arc::pin_init(
            try_pin_init!(Region {
                start,
                npages,
                space,
                dead: AtomicBool::new(false),
                homing_ahead: [const { AtomicBool::new(false) }; AHEAD_LANES],
                cpu_at: core::sync::atomic::AtomicUsize::new(usize::MAX),
                skew,
                advice <- new_mutex!(advice, "gmem_region_advice"),
                dir <- new_mutex!(Dir { slots }, "gmem_region_dir"),
            }),
            GFP_KERNEL,
        )
    }

    pub(crate) fn len(&self) -> usize {
        self.npages * PAGE_SIZE
    }

    pub(crate) fn end(&self) -> usize {
        self.start + self.len()
    }

    pub(crate) fn va(&self, page: usize) -> u64 {
        (self.start + page * PAGE_SIZE) as u64
    }

    pub(crate) fn index(&self, addr: usize) -> Option<usize> {
        (addr >= self.start && addr < self.end()).then(|| (addr - self.start) / PAGE_SIZE)
    }

    pub(crate) fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    /// Marks the region torn down (before its blocks are emptied); returns whether it was
    /// already.
    pub(crate) fn mark_dead(&self) -> bool {
        self.dead.swap(true, Ordering::AcqRel)
    }

    /// The block number of page `i`.
    fn block_no(&self, i: usize) -> usize {
        (i + self.skew) / BLOCK_PAGES
    }

    /// The region pages of block `b`.
    fn block_range(&self, b: usize) -> core::ops::Range<usize> {
        let first = (b * BLOCK_PAGES).saturating_sub(self.skew);
        let end = core::cmp::min(self.npages, ((b + 1) * BLOCK_PAGES).saturating_sub(self.skew));
        first..end
    }

    /// The pages of the block of page `i` (whether or not the block exists yet).
    pub(crate) fn block_pages(&self, i: usize) -> core::ops::Range<usize> {
        self.block_range(self.block_no(i))
    }

    /// The block of page `i`, if it was ever touched.
    pub(crate) fn block_if_any(&self, i: usize) -> Option<Arc<Block>> {
        if i >= self.npages {
            return None;
        }
        let b = self.block_no(i);
        let d = self.dir.lock();
        d.slots.get(b / LEAF_BLOCKS)?.as_ref()?.get(b % LEAF_BLOCKS)?.clone()
    }

    /// Locks block `b` of this region for a fault, advice, migration or eviction, counting
    /// the acquisition (`block_locks` of the space in debugfs; the debugfs census itself
    /// takes the lock directly and is not counted).
    pub(crate) fn lock<'a>(&self, b: &'a Block) -> kernel::sync::MutexGuard<'a, Pages> {
        Space::count(&self.space.stats.block_locks);
        b.pages.lock()
    }

    /// [`Region::lock`] if the block is free now: `None` if someone holds it (a batch in
    /// flight: a fault's, a read-ahead's, another eviction's).
    pub(crate) fn try_lock<'a>(&self, b: &'a Block) -> Option<kernel::sync::MutexGuard<'a, Pages>> {
        let p = b.pages.try_lock()?;
        Space::count(&self.space.stats.block_locks);
        Some(p)
    }

    /// The block of page `i`, created on first use (`ENOMEM` if it cannot be; `EFAULT`
    /// past the end).
    pub(crate) fn block(&self, i: usize) -> Result<Arc<Block>> {
        if i >= self.npages {
            return Err(EFAULT);
        }
        if let Some(b) = self.block_if_any(i) {
            return Ok(b);
        }
        let b = self.block_no(i);
        let r = self.block_range(b);
        // Allocated without the directory lock; a racing creator may win, then ours goes.
        let new = Block::new(r.start, r.len())?;
        let blocks = (self.npages + self.skew).div_ceil(BLOCK_PAGES);
        let mut d = self.dir.lock();
        let slot = d.slots.get_mut(b / LEAF_BLOCKS).ok_or(EFAULT)?;
        if slot.is_none() {
            let n = core::cmp::min(LEAF_BLOCKS, blocks - b / LEAF_BLOCKS * LEAF_BLOCKS);
            let mut leaf = KVVec::with_capacity(n, GFP_KERNEL_ACCOUNT)?;
            for _ in 0..n {
                leaf.push(None, GFP_KERNEL_ACCOUNT)?;
            }
            *slot = Some(leaf);
        }
        let entry = slot.as_mut().and_then(|l| l.get_mut(b % LEAF_BLOCKS)).ok_or(EFAULT)?;
        Ok(entry.get_or_insert(new).clone())
    }

    /// The first existing block that holds page `i` or a later page, and the first page
    /// at or after `i` in it; one walk of the directory under its lock.
    fn first_block_from(&self, i: usize) -> Option<(usize, Arc<Block>)> {
        if i >= self.npages {
            return None;
        }
        let mut b = self.block_no(i);
        let blocks = (self.npages + self.skew).div_ceil(BLOCK_PAGES);
        let d = self.dir.lock();
        while b < blocks {
            let (l, k) = (b / LEAF_BLOCKS, b % LEAF_BLOCKS);
            match d.slots.get(l)? {
                None => b = (l + 1) * LEAF_BLOCKS,
                Some(leaf) => match leaf.get(k)? {
                    Some(block) => return Some((core::cmp::max(i, self.block_range(b).start), block.clone())),
                    None => b += 1,
                },
            }
        }
        None
    }

    /// The first page at or after `i` whose block exists (pages of untouched blocks are
    /// empty: walks over a region skip them with this).
    pub(crate) fn touched_from(&self, i: usize) -> Option<usize> {
        self.first_block_from(i).map(|(j, _)| j)
    }

    /// The existing blocks from page `i` on, one at a time: the next one after `from`.
    pub(crate) fn next_block(&self, from: usize) -> Option<Arc<Block>> {
        self.first_block_from(from).map(|(_, b)| b)
    }

    /// Bytes of per-page metadata this region uses (P5 of the benchmarks): the directory,
    /// its leaves and every block.
    pub(crate) fn metadata_bytes(&self) -> usize {
        let mut blocks: KVec<Arc<Block>> = KVec::new();
        let mut n = 0;
        {
            let d = self.dir.lock();
            n += d.slots.len() * core::mem::size_of::<Option<Leaf>>();
            for leaf in d.slots.iter().flatten() {
                n += leaf.len() * core::mem::size_of::<Option<Arc<Block>>>();
                for b in leaf.iter().flatten() {
                    if blocks.push(b.clone(), GFP_KERNEL).is_err() {
                        break;
                    }
                }
            }
        }
        for b in blocks.iter() {
            n += core::mem::size_of::<Block>() + b.pages.lock().bytes();
        }
        n
    }
}

/// Device ids whose bit is set in `mask`, lowest first: one step per set bit, so that an
/// empty mask (most pages' duplicate masks) costs one test. (Testing all 16 bits put 40 %
/// of the executor's commit loop in this iterator in a profile of P4's 2x stream.)
pub(crate) fn devices_in(mask: u16) -> impl Iterator<Item = u8> {
    // Bits at or above `MAX_DEVICES` name no device.
    const ALL: u16 = if MAX_DEVICES >= u16::BITS as usize { u16::MAX } else { (1 << MAX_DEVICES) - 1 };
    let mut m = mask & ALL;
    core::iter::from_fn(move || {
        let d = u8::try_from(m.trailing_zeros()).ok().filter(|_| m != 0)?;
        m &= m - 1;
        Some(d)
    })
}

#[kunit_tests(gmem_region)]
mod tests {
    use super::*;
    use crate::obj::space::tests::test_space;

    #[test]
    fn devices_in_lists_the_set_bits_in_order() {
        let ids = |m: u16| {
            let mut v = KVec::new();
            for d in devices_in(m) {
                v.push(d, GFP_KERNEL).expect("push");
            }
            v
        };
        assert!(ids(0).is_empty());
        assert_eq!(&ids(0b1010_0000_0000_0001)[..], &[0, 13, 15]);
        assert_eq!(&ids(dev_bit(7))[..], &[7]);
        let all = ids(u16::MAX);
        assert_eq!(all.len(), 16);
        assert!(all.iter().enumerate().all(|(k, &d)| usize::from(d) == k));
    }

    #[test]
    fn lookup_by_address_and_iteration() {
        let s = test_space();
        let a = Region::new(s.clone(), 0x10_0000, 4, 0).expect("a");
        let b = Region::new(s.clone(), 0x20_0000, 16, 0).expect("b");
        let c = Region::new(s.clone(), 0x20_0000 + 16 * PAGE_SIZE, 1, 0).expect("c");
        for r in [&a, &b, &c] {
            s.insert_region(r.clone()).expect("insert");
        }
        let at = |x: usize| s.region_at(x).map(|r| r.start);
        assert_eq!(at(0x10_0000), Some(0x10_0000));
        assert_eq!(at(0x10_0000 + 4 * PAGE_SIZE - 1), Some(0x10_0000));
        assert_eq!(at(0x10_0000 + 4 * PAGE_SIZE), None);
        assert_eq!(at(0x20_0000 + 16 * PAGE_SIZE), Some(c.start));
        assert_eq!(at(0xfff), None);
        // Overlapping insertion is refused.
        let d = Region::new(s.clone(), 0x20_1000, 1, 0).expect("d");
        assert!(s.insert_region(d).is_err());
        // Iteration in address order.
        let mut seen = KVec::new();
        let mut from = 0;
        while let Some(r) = s.next_region(from) {
            from = r.end();
            seen.push(r.start, GFP_KERNEL).expect("push");
        }
        assert_eq!(&seen[..], &[a.start, b.start, c.start]);
        s.remove_region(&b);
        assert_eq!(at(0x20_0000), None);
        assert_eq!(at(c.start), Some(c.start));
        s.remove_region(&a);
        s.remove_region(&c);
        assert!(s.next_region(0).is_none());
        crate::obj::space::release(&s);
    }

    /// A block's duplicates: one frame array per device that holds any, made by `reserve`
    /// and freed by a later `reserve` once empty (never by a removal: a batch may empty a
    /// device's array and record a duplicate there again). Every page of a block can have
    /// one on each device; a page outside the block or the no-duplicate frame is refused.
    #[test]
    fn duplicates_per_block_and_device() {
        let mut d = Dups::new();
        let one = core::mem::size_of::<u32>() * BLOCK_PAGES;
        assert_eq!(d.bytes(), 0);
        d.reserve(1 | 1 << 5).expect("reserve");
        assert!(d.bytes() >= 2 * one);
        for k in 0..BLOCK_PAGES {
            d.insert(k, 0, k as u32).expect("insert");
            if k % 2 == 0 {
                d.insert(k, 5, 10_000 + k as u32).expect("insert");
            }
        }
        assert_eq!(d.len, BLOCK_PAGES + BLOCK_PAGES / 2);
        // Replacing a duplicate does not count it twice.
        d.insert(7, 0, 77).expect("insert");
        assert_eq!(d.len, BLOCK_PAGES + BLOCK_PAGES / 2);
        assert_eq!(d.get(7, 0), Some(77));
        assert_eq!(d.get(8, 5), Some(10_008));
        assert_eq!(d.get(9, 5), None);
        assert_eq!(d.get(7, 4), None);
        assert_eq!(d.insert(BLOCK_PAGES, 0, 1), Err(EINVAL));
        assert_eq!(d.insert(3, 0, NO_DUP), Err(EINVAL));
        // A device nobody reserved for: allocated on the spot.
        d.insert(3, 9, 333).expect("insert without reserve");
        assert_eq!(d.get(3, 9), Some(333));
        let full = d.bytes();
        for k in 0..BLOCK_PAGES {
            assert_eq!(d.remove(k, 0), Some(if k == 7 { 77 } else { k as u32 }));
        }
        assert_eq!(d.remove(0, 0), None);
        // Emptied, but kept until the next reserve; then re-used without allocation.
        assert_eq!(d.bytes(), full);
        d.insert(1, 0, 11).expect("insert");
        assert_eq!(d.remove(1, 0), Some(11));
        d.reserve(1 << 5).expect("reserve");
        assert_eq!(d.bytes(), full - one);
        assert_eq!(d.get(8, 5), Some(10_008));
        assert_eq!(d.get(3, 9), Some(333));
        assert_eq!(d.len, BLOCK_PAGES / 2 + 1);
    }

    /// Issue 9: metadata is allocated per 2 MiB block on first touch. A 1 TiB region costs
    /// at most 1 MiB untouched; touching pages far apart costs one block (and one 128 MiB
    /// directory leaf) each; walks skip untouched blocks.
    #[test]
    fn lazy_metadata_of_a_terabyte() {
        let s = test_space();
        let npages = 1usize << 28; // 1 TiB of 4 KiB pages
                                   // Not 2 MiB-aligned: the first and last blocks are partial.
        let start = 0x100_0000_0000 + 3 * PAGE_SIZE;
        let r = Region::new(s.clone(), start, npages, 0).expect("region");
        let untouched = r.metadata_bytes();
        assert!(untouched <= 1 << 20);
        assert!(r.block_if_any(npages - 1).is_none());
        assert_eq!(r.touched_from(0), None);
        // Block 0 holds pages 0..509 (the region starts 3 pages into its 2 MiB block).
        assert_eq!(r.block_pages(0), 0..BLOCK_PAGES - 3);
        assert_eq!(r.block_pages(BLOCK_PAGES - 3), BLOCK_PAGES - 3..2 * BLOCK_PAGES - 3);
        assert_eq!(r.block_pages(npages - 1), npages - 3..npages);
        let far = npages - 2;
        {
            let b = r.block(far).expect("block");
            let mut p = b.pages.lock();
            assert_eq!(p.range(), npages - 3..npages);
            p.set_state(far, 7);
            p.set_frame(far, 99);
            assert_eq!((p.state(far).bits(), p.frame(far)), (7, 99));
            assert_eq!(p.state(far - 1).bits(), 0);
            // Outside the block: reads empty, writes nothing.
            p.set_state(far - 5, 9);
            assert_eq!(p.state(far - 5).bits(), 0);
        }
        // One block of 3 pages (16 bytes each, plus its header) and one leaf of 64 slots.
        let touched = r.metadata_bytes() - untouched;
        assert!((3 * 16..=3 * 16 + 64 * 8 + 256).contains(&touched));
        assert_eq!(r.touched_from(0), Some(npages - 3));
        assert_eq!(r.touched_from(far), Some(far));
        assert_eq!(r.touched_from(npages), None);
        assert!(r.block(npages).is_err());
        // The same block again.
        let b1 = r.block(far).expect("block");
        let b2 = r.block(npages - 3).expect("block");
        assert!(core::ptr::eq(&*b1, &*b2));
        crate::obj::space::release(&s);
    }

    #[test]
    fn advice_splits_a_region() {
        let s = test_space();
        let r = Region::new(s.clone(), 0x40_0000, 64, (3 + 1) << adv::PREF_SHIFT).expect("region");
        {
            let mut a = r.advice.lock();
            a.set(PageRange { first: 10, count: 5 }, adv::READ_MOSTLY).expect("set");
            a.clear(PageRange { first: 12, count: 1 }, adv::READ_MOSTLY).expect("clear");
            assert_eq!(a.get(9) & adv::READ_MOSTLY, 0);
            assert_ne!(a.get(10) & adv::READ_MOSTLY, 0);
            assert_eq!(a.get(12) & adv::READ_MOSTLY, 0);
            assert_ne!(a.get(14) & adv::READ_MOSTLY, 0);
            assert_eq!(a.get(15) & adv::READ_MOSTLY, 0);
            assert_eq!(adv::preferred(a.get(63)), Some(crate::policy::page_state::Target::Device(3)));
            assert_eq!(a.runs(), 5);
        }
        assert_eq!(r.index(0x40_0000 + 5 * PAGE_SIZE + 7), Some(5));
        assert_eq!(r.index(0x40_0000 + 64 * PAGE_SIZE), None);
        // Untouched: only the directory (one slot).
        let untouched = r.metadata_bytes();
        assert!(untouched <= 64);
        // Touched: 16 bytes per page (state + frame + host page) plus the block's header
        // and its directory leaf.
        drop(r.block(5).expect("block"));
        let touched = r.metadata_bytes();
        assert!(touched >= untouched + 64 * 16 && touched <= untouched + 64 * 16 + 256);
        assert_eq!(r.touched_from(0), Some(0));
        assert_eq!(r.touched_from(63), Some(63));
        crate::obj::space::release(&s);
    }
}
