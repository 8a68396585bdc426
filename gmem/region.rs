// SPDX-License-Identifier: GPL-2.0
//! Region: one GMEM allocation (one VMA) and the residency of each of its pages.
//!
//! Per touched page the region keeps exactly 16 bytes: the packed page state (4, see
//! `policy/src/page_state.rs`), the owner's frame number (4) and the host page (8, `None`
//! when no host copy exists), in zero-filled arrays allocated per 2 MiB block on first
//! touch, which fail cleanly (`meta.rs`): an untouched region costs almost nothing. Read-only
//! duplicates live in a tree keyed by (page, device).
//! Advice is kept per range in a small interval map (`policy/src/range.rs`).
//!
//! Lock order: mmap lock -> `Region::pages` -> `Space::ctxs` -> `Device::frames`.

use crate::policy::page_state::{PageState, MAX_DEVICES};
use crate::policy::range::{AdviceMap, PageRange};
use crate::space::Space;
use crate::host_page::HostPage;
use crate::meta::PageMeta;
use kernel::{
    new_mutex,
    prelude::*,
    rbtree::{RBTree, RBTreeNode, RBTreeNodeReservation},
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
}

/// Runs of distinct advice one region may carry.
pub(crate) const ADVICE_RUNS: usize = 32;

/// Read-only duplicates (READ_MOSTLY) of pages on devices that are not their owner: the
/// duplicate's frame by (page index, device). A red-black tree: O(log n) per lookup,
/// insertion and removal, no limit on the count, and teardown of n duplicates is
/// O(n log n).
///
/// An insertion happens after the transition's allocations, at a point where it must not
/// fail, so its node is reserved first ([`Dups::reserve`]), together with the frame.
pub(crate) struct Dups {
    tree: RBTree<(usize, u8), u32>,
    spare: KVec<RBTreeNodeReservation<(usize, u8), u32>>,
    len: usize,
}

impl Dups {
    fn new() -> Self {
        Dups { tree: RBTree::new(), spare: KVec::new(), len: 0 }
    }

    /// Makes sure the next `n` [`Dups::insert`]s need no allocation.
    pub(crate) fn reserve(&mut self, n: usize) -> Result {
        while self.spare.len() < n {
            self.spare.push(RBTreeNodeReservation::new(GFP_KERNEL_ACCOUNT)?, GFP_KERNEL_ACCOUNT)?;
        }
        Ok(())
    }

    /// Records `frame` as `dev`'s duplicate of `page`. Uses a reserved node (or, if the
    /// caller did not reserve, allocates without sleeping and returns `ENOMEM` on failure).
    pub(crate) fn insert(&mut self, page: usize, dev: u8, frame: u32) -> Result {
        let node = match self.spare.pop() {
            Some(r) => r.into_node((page, dev), frame),
            None => RBTreeNode::new((page, dev), frame, GFP_NOWAIT)?,
        };
        if self.tree.insert(node).is_none() {
            self.len += 1;
        }
        Ok(())
    }

    pub(crate) fn remove(&mut self, page: usize, dev: u8) -> Option<u32> {
        let f = self.tree.remove(&(page, dev))?;
        self.len -= 1;
        Some(f)
    }

    pub(crate) fn get(&self, page: usize, dev: u8) -> Option<u32> {
        self.tree.get(&(page, dev)).copied()
    }

    /// Approximate bytes used (one tree node per duplicate).
    pub(crate) fn bytes(&self) -> usize {
        (self.len + self.spare.len()) * core::mem::size_of::<RBTreeNode<(usize, u8), u32>>()
    }
}

/// The per-page arrays, under the region's lock.
pub(crate) struct Pages {
    /// Set once the region is torn down: every later fault gets SIGBUS / EFAULT.
    pub(crate) dead: bool,
    /// State, owner frame and host page of every page (lazily allocated).
    pub(crate) meta: PageMeta,
    pub(crate) dups: Dups,
    pub(crate) advice: AdviceMap<ADVICE_RUNS>,
}

impl Pages {
    pub(crate) fn state(&self, i: usize) -> PageState {
        PageState::from_bits(self.meta.state(i))
    }

    /// The owner device's frame of page `i` (meaningful while the page is on a device).
    pub(crate) fn frame(&self, i: usize) -> u32 {
        self.meta.frame(i)
    }

    /// The host page of page `i`, if it has one.
    pub(crate) fn host(&self, i: usize) -> Option<&HostPage> {
        self.meta.host(i)
    }

    pub(crate) fn take_dup(&mut self, page: usize, dev: u8) -> Option<u32> {
        self.dups.remove(page, dev)
    }

    pub(crate) fn dup_frame(&self, page: usize, dev: u8) -> Option<u32> {
        self.dups.get(page, dev)
    }
}

#[pin_data]
pub(crate) struct Region {
    pub(crate) start: usize,
    pub(crate) npages: usize,
    pub(crate) space: Arc<Space>,
    #[pin]
    pub(crate) pages: Mutex<Pages>,
}

impl Region {
    /// A region of `npages` never-touched pages at `start`, with `initial_advice` (advice
    /// bits, e.g. ALLOC's preferred device) over all of it.
    pub(crate) fn new(space: Arc<Space>, start: usize, npages: usize, initial_advice: u32) -> Result<Arc<Region>> {
        // All-zero metadata is "never touched" (`PageState::EMPTY`, frame 0, no host page):
        // untouched blocks need no allocation (meta.rs).
        const _: () = assert!(PageState::EMPTY.bits() == 0);
        let meta = PageMeta::new(npages)?;
        let mut advice = AdviceMap::new();
        if initial_advice != 0 {
            advice
                .set(PageRange { first: 0, count: npages as u64 }, initial_advice)
                .map_err(|_| EINVAL)?;
        }
        Arc::pin_init(
            try_pin_init!(Region {
                start,
                npages,
                space,
                pages <- new_mutex!(
                    Pages { dead: false, meta, dups: Dups::new(), advice },
                    "gmem_region_pages"
                ),
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

    /// Bytes of per-page metadata this region uses (P5 of the benchmarks).
    pub(crate) fn metadata_bytes(&self) -> usize {
        let p = self.pages.lock();
        p.meta.bytes() + p.dups.bytes()
    }
}

/// Device ids whose bit is set in `mask`.
pub(crate) fn devices_in(mask: u16) -> impl Iterator<Item = u8> {
    (0..MAX_DEVICES as u8).filter(move |d| mask & (1 << d) != 0)
}

#[kunit_tests(gmem_region)]
mod tests {
    use super::*;
    use crate::space::tests::test_space;

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
        crate::space::release(&s);
    }

    /// Issue item 6: duplicates used to live in one kmalloc'd vector that failed past
    /// 262,144 entries (4 MiB) and was searched linearly. The tree takes more than that,
    /// finds each by (page, device), and empties again.
    #[test]
    fn duplicates_scale_past_the_old_cap() {
        const N: usize = 300_000;
        let mut d = Dups::new();
        for i in 0..N {
            if i % crate::sched::CHUNK == 0 {
                crate::sched::cond_resched();
            }
            d.reserve(1).expect("reserve");
            d.insert(i / 3, (i % 3) as u8 * 5, i as u32).expect("insert");
        }
        assert_eq!(d.len, N);
        assert_eq!(d.get(N / 3 - 1, 10), Some(N as u32 - 1));
        assert_eq!(d.get(7, 5), Some(22));
        assert_eq!(d.get(7, 4), None);
        for i in 0..N {
            if i % crate::sched::CHUNK == 0 {
                crate::sched::cond_resched();
            }
            assert_eq!(d.remove(i / 3, (i % 3) as u8 * 5), Some(i as u32));
        }
        assert_eq!(d.len, 0);
        assert!(d.get(7, 5).is_none());
    }

    /// Issue 9: metadata is allocated per 2 MiB block on first touch. A 1 TiB region costs
    /// at most 1 MiB untouched; touching pages far apart costs one block (and one 128 MiB
    /// directory leaf) each; walks skip untouched blocks.
    #[test]
    fn lazy_metadata_of_a_terabyte() {
        use crate::meta::{PageMeta, BLOCK_PAGES};
        let npages = 1usize << 28; // 1 TiB of 4 KiB pages
        let mut m = PageMeta::new(npages).expect("directory");
        let untouched = m.bytes();
        assert!(untouched <= 1 << 20);
        assert_eq!(m.state(npages - 1), 0);
        assert!(m.host(12345).is_none());
        assert_eq!(m.touched_from(0), None);
        let far = npages - 3;
        m.ensure(far).expect("block");
        m.set_state(far, 7);
        m.set_frame(far, 99);
        assert_eq!((m.state(far), m.frame(far)), (7, 99));
        assert_eq!(m.state(far - 1), 0);
        // One block (16 bytes per page) and one leaf of 512 block slots.
        let touched = m.bytes() - untouched;
        assert!(touched >= BLOCK_PAGES * 16 && touched <= BLOCK_PAGES * 16 + 64 * 8 + 128);
        assert_eq!(m.touched_from(0), Some(far / BLOCK_PAGES * BLOCK_PAGES));
        assert_eq!(m.touched_from(far), Some(far));
        assert_eq!(m.touched_from(npages), None);
        assert!(m.ensure(npages).is_err());
    }

    #[test]
    fn advice_splits_a_region() {
        let s = test_space();
        let r = Region::new(s.clone(), 0x40_0000, 64, (3 + 1) << adv::PREF_SHIFT).expect("region");
        {
            let mut p = r.pages.lock();
            p.advice.set(PageRange { first: 10, count: 5 }, adv::READ_MOSTLY).expect("set");
            p.advice.clear(PageRange { first: 12, count: 1 }, adv::READ_MOSTLY).expect("clear");
            assert_eq!(p.advice.get(9) & adv::READ_MOSTLY, 0);
            assert_ne!(p.advice.get(10) & adv::READ_MOSTLY, 0);
            assert_eq!(p.advice.get(12) & adv::READ_MOSTLY, 0);
            assert_ne!(p.advice.get(14) & adv::READ_MOSTLY, 0);
            assert_eq!(p.advice.get(15) & adv::READ_MOSTLY, 0);
            assert_eq!(adv::preferred(p.advice.get(63)), Some(crate::policy::page_state::Target::Device(3)));
            assert_eq!(p.advice.runs(), 5);
        }
        assert_eq!(r.index(0x40_0000 + 5 * PAGE_SIZE + 7), Some(5));
        assert_eq!(r.index(0x40_0000 + 64 * PAGE_SIZE), None);
        // Untouched: only the directory (one slot).
        let untouched = r.metadata_bytes();
        assert!(untouched <= 64);
        // Touched: 16 bytes per page (state + frame + host page) plus the block's header
        // and its directory leaf.
        r.pages.lock().meta.ensure(5).expect("ensure");
        let touched = r.metadata_bytes();
        assert!(touched >= untouched + 64 * 16 && touched <= untouched + 64 * 16 + 128);
        assert_eq!(r.pages.lock().meta.touched_from(0), Some(0));
        assert_eq!(r.pages.lock().meta.touched_from(63), Some(63));
        crate::space::release(&s);
    }
}
