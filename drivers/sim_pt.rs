// SPDX-License-Identifier: GPL-2.0
//! The simulated device's page table: one per context (GMEM address space). Two levels:
//! a sorted directory of 2 MiB blocks, each a 512-entry leaf of PTEs or one 2 MiB entry
//! (`GMEM_PTE_2M`; the leaf stays allocated under it, so splitting never allocates).
//!
//! PTE encoding: 0 = invalid; bit 0 valid, bit 1 writable, bit 2 remote host page, bit 3
//! accessed (set by every device access, tested and cleared by gmem). A frame
//! PTE holds `frame << 12`; a remote PTE holds the `struct page` pointer (`map` refuses one
//! that is not 16-byte aligned, so the four flag bits are free; `struct page` is 64 bytes
//! on our kernels).
//!
//! Every device access translates and touches memory under `SimCtx::pt`, and `unmap` takes
//! the same lock: once the core's unmap returns, no access to the old page is in flight.
//! Callbacks go first: a kernel waits before its next access while one is waiting for the
//! lock (`SimCtx::manage`, `SimCtx::access`).
//!
//! Nothing is allocated under `SimCtx::pt`: gmem's MMU notifier unmaps (so takes this lock)
//! from inside memory reclaim, so an allocation that reclaims under it could wait for
//! itself. Leaves and directory room are allocated first, without the lock
//! ([`SimCtx::prepare`]), and installed under it; `set` finds them there (leaves are freed
//! only with the context). This is also what `map_prepare` is for `GMEM_PTE_SYSMEM` entries,
//! whose `map` runs under gmem's notifier lock.

use crate::sim_mem::{Mapped, Pool};
use core::sync::atomic::{AtomicU32, Ordering};
use kernel::{
    bindings, new_mutex,
    prelude::*,
    sync::{Mutex, MutexGuard},
};

pub(crate) const PTE_VALID: u64 = 1;
pub(crate) const PTE_WRITE: u64 = 2;
pub(crate) const PTE_HOST: u64 = 4;
pub(crate) const PTE_ACCESSED: u64 = 8;
/// The flag bits: a host page's pointer must have them clear (16-byte aligned) to be stored.
pub(crate) const PTE_FLAGS: u64 = 0xf;
const LEAF: usize = 512;

/// What a valid PTE points at.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Target {
    Frame(u64),
    Host(*mut bindings::page),
}

pub(crate) fn decode(pte: u64) -> Option<(Target, bool)> {
    if pte & PTE_VALID == 0 {
        return None;
    }
    let w = pte & PTE_WRITE != 0;
    if pte & PTE_HOST != 0 {
        Some((Target::Host((pte & !PTE_FLAGS) as *mut bindings::page), w))
    } else {
        Some((Target::Frame(pte >> 12), w))
    }
}

pub(crate) fn encode(t: Target, writable: bool) -> u64 {
    let base = match t {
        Target::Frame(f) => f << 12,
        Target::Host(p) => p as u64 | PTE_HOST,
    };
    base | PTE_VALID | if writable { PTE_WRITE } else { 0 }
}

/// One 2 MiB block of the page table: either 512 entries of 4 KiB, or one 2 MiB entry
/// (`huge` valid, frame-aligned to 512). The 4 KiB table stays allocated under a 2 MiB
/// entry, so that splitting one never allocates (`unmap` cannot fail); meanwhile it holds
/// only each page's accessed bit, so that gmem's replacement still sees which pages of
/// the block the device used (one bit for all 512 would let the first test clear it for
/// the others).
struct Leaf {
    ptes: KBox<[u64; LEAF]>,
    /// 0, or the 2 MiB entry (encoded like a frame PTE of its first frame).
    huge: u64,
}

impl Leaf {
    /// The 4 KiB entry of page `k` of the block, whichever way it is mapped.
    fn get(&self, k: usize) -> u64 {
        if self.huge & PTE_VALID != 0 {
            // Page k of a 2 MiB entry is frame `base + k`; flags are the entry's, the
            // accessed bit the page's own.
            ((self.huge & !PTE_ACCESSED) + ((k as u64) << 12)) | (self.ptes[k] & PTE_ACCESSED)
        } else {
            self.ptes[k]
        }
    }
}

pub(crate) struct PageTable {
    /// (2 MiB block number, leaf), sorted by block.
    dir: KVec<(u64, Leaf)>,
    /// Valid 4 KiB entries.
    pub(crate) valid: u64,
    /// Valid 2 MiB entries.
    pub(crate) huge: u64,
    /// 2 MiB entries split into 4 KiB ones (a page of the block was unmapped or remapped).
    pub(crate) splits: u64,
}

/// The page the entry `pte` points at for an access (`write` needs a writable entry), if
/// any: a frame of `pool` or a remote host page.
#[inline(always)]
fn target_page(pte: u64, write: bool, pool: &Pool) -> Option<*mut bindings::page> {
    match decode(pte)? {
        (_, false) if write => None,
        (Target::Frame(f), _) => pool.frame(f),
        (Target::Host(p), _) => Some(p),
    }
}

impl PageTable {
    fn leaf(&self, block: u64) -> Option<&Leaf> {
        let i = self.dir.binary_search_by_key(&block, |e| e.0).ok()?;
        Some(&self.dir[i].1)
    }

    pub(crate) fn lookup(&self, va: u64) -> u64 {
        self.leaf(va >> 21).map_or(0, |l| l.get(((va >> 12) as usize) % LEAF))
    }

    /// The page `va` translates to for an access (`write` needs a writable entry), if any:
    /// a frame of `pool` or a remote host page.
    fn resolve(&self, va: u64, write: bool, pool: &Pool) -> Option<*mut bindings::page> {
        target_page(self.lookup(va), write, pool)
    }

    /// Whether a device access to `va` hits (else it faults).
    pub(crate) fn present(&self, va: u64, write: bool, pool: &Pool) -> bool {
        self.resolve(va, write, pool).is_some()
    }

    /// One device access's walk for the page at `va` (`write` needs a writable entry): on a
    /// hit, marks the page accessed and returns the page it translates to.
    #[inline(always)]
    fn hit(&mut self, va: u64, write: bool, pool: &Pool) -> Option<*mut bindings::page> {
        let l = self.leaf_mut(va)?;
        let k = ((va >> 12) as usize) % LEAF;
        let page = target_page(l.get(k), write, pool)?;
        // The page's own slot: its entry, or under a 2 MiB entry its shadow.
        l.ptes[k] |= PTE_ACCESSED;
        Some(page)
    }

    /// A device access to the page at `a.0` and, if given, the page at `b.0` (each with
    /// whether it writes), one walk per page: every page that hits is marked accessed, and
    /// if both hit, `f` runs on them (mapped for the call, the page-table lock held while
    /// `self` is borrowed). `None` on a miss of either, without running `f`.
    #[inline(always)]
    pub(crate) fn access_pages<R>(
        &mut self,
        a: (u64, bool),
        b: Option<(u64, bool)>,
        pool: &Pool,
        f: impl FnOnce(&Mapped<'_>, Option<&Mapped<'_>>) -> R,
    ) -> Option<R> {
        let p1 = self.hit(a.0, a.1, pool);
        let p2 = b.map(|(v, w)| self.hit(v, w, pool));
        let p1 = p1?;
        // Why the pages stay allocated during `f`: a frame is a page of the device's pool,
        // which outlives every context; a host page stays allocated until the unmap of its
        // address returned (gmem's contract), and unmap takes the lock under which `self`
        // is borrowed for the whole call.
        match p2 {
            // SAFETY: `p1` stays allocated during the call (above).
            None => Some(unsafe { Mapped::with(p1, |m1| f(m1, None)) }),
            Some(p2) => {
                let p2 = p2?;
                // SAFETY: `p1` and `p2` stay allocated during the call (above).
                Some(unsafe { Mapped::with(p1, |m1| Mapped::with(p2, |m2| f(m1, Some(m2)))) })
            }
        }
    }

    fn leaf_mut(&mut self, va: u64) -> Option<&mut Leaf> {
        let i = self.dir.binary_search_by_key(&(va >> 21), |e| e.0).ok()?;
        Some(&mut self.dir[i].1)
    }

    /// The slot holding `va`'s accessed bit (its 4 KiB entry, or under a 2 MiB entry the
    /// page's shadow slot) and whether `va` is mapped at all.
    fn acc_slot(&mut self, va: u64) -> Option<(&mut u64, bool)> {
        let l = self.leaf_mut(va)?;
        let huge = l.huge & PTE_VALID != 0;
        let s = &mut l.ptes[((va >> 12) as usize) % LEAF];
        let mapped = huge || *s & PTE_VALID != 0;
        Some((s, mapped))
    }

    /// Marks a valid PTE accessed (the device just used it).
    #[cfg(CONFIG_KUNIT = "y")]
    pub(crate) fn touch(&mut self, va: u64) {
        if let Some((s, true)) = self.acc_slot(va) {
            *s |= PTE_ACCESSED;
        }
    }

    /// Tests and clears the page's accessed bit (per 4 KiB page, under a 2 MiB entry too).
    pub(crate) fn test_clear_accessed(&mut self, va: u64) -> bool {
        match self.acc_slot(va) {
            Some((s, _)) if *s & PTE_ACCESSED != 0 => {
                *s &= !PTE_ACCESSED;
                true
            }
            _ => false,
        }
    }

    /// [`PageTable::test_clear_accessed`] for the pages from `va` that `bits` selects (bit
    /// k of word k / 64: the page at `va + k * 4096`); leaves bit k set if and only if page
    /// k was selected and accessed. Pages past the end of the address space read as not
    /// accessed.
    pub(crate) fn test_clear_accessed_range(&mut self, va: u64, bits: &mut [u64]) {
        for (w, word) in bits.iter_mut().enumerate() {
            let (mut left, mut out) = (*word, 0u64);
            while left != 0 {
                let b = left.trailing_zeros();
                left &= left - 1;
                let page = va.checked_add(((w as u64) * 64 + u64::from(b)) << 12);
                if page.is_some_and(|v| self.test_clear_accessed(v)) {
                    out |= 1 << b;
                }
            }
            *word = out;
        }
    }

    /// How many of the blocks `first..=last` have no leaf.
    fn missing(&self, first: u64, last: u64) -> usize {
        (first..=last).filter(|&b| self.leaf(b).is_none()).count()
    }

    /// Installs `leaves` for the blocks of `first..=last` that still have none, in
    /// directory room already reserved (`spare`: a directory with more capacity, used if the
    /// current one has too little). Allocates nothing; the leaves and the directory not used
    /// are left in the arguments for the caller to free after the lock. `false` if some
    /// block is still missing (the room or the leaves ran short: prepare again).
    fn install(
        &mut self,
        first: u64,
        last: u64,
        leaves: &mut KVec<KBox<[u64; LEAF]>>,
        spare: &mut KVec<(u64, Leaf)>,
    ) -> bool {
        let need = self.missing(first, last);
        if self.dir.capacity() - self.dir.len() < need {
            if spare.capacity() < self.dir.len() + need {
                return false;
            }
            spare.clear();
            for e in self.dir.drain_all() {
                // Within capacity (checked above): no allocation.
                if spare.push_within_capacity(e).is_err() {
                    return false;
                }
            }
            core::mem::swap(&mut self.dir, spare);
        }
        for block in first..=last {
            if let Err(i) = self.dir.binary_search_by_key(&block, |e| e.0) {
                let Some(ptes) = leaves.pop() else { return false };
                if self.dir.insert_within_capacity(i, (block, Leaf { ptes, huge: 0 })).is_err() {
                    return false;
                }
            }
        }
        true
    }

    /// Turns a 2 MiB entry into its 512 4 KiB entries (same frames, flags, accessed bit).
    fn split(l: &mut Leaf, valid: &mut u64, huge: &mut u64, splits: &mut u64) {
        if l.huge & PTE_VALID == 0 {
            return;
        }
        for k in 0..LEAF {
            l.ptes[k] = l.get(k);
        }
        l.huge = 0;
        *valid += LEAF as u64;
        *huge -= 1;
        *splits += 1;
    }

    /// Sets one 4 KiB PTE (splitting a 2 MiB entry there); `EAGAIN` if its block has no
    /// leaf yet.
    pub(crate) fn set(&mut self, va: u64, pte: u64) -> Result {
        let (mut valid, mut huge, mut splits) = (self.valid, self.huge, self.splits);
        let l = self.leaf_mut(va).ok_or(EAGAIN)?;
        Self::split(l, &mut valid, &mut huge, &mut splits);
        let slot = &mut l.ptes[((va >> 12) as usize) % LEAF];
        match (*slot & PTE_VALID != 0, pte & PTE_VALID != 0) {
            (false, true) => valid += 1,
            (true, false) => valid -= 1,
            _ => {}
        }
        *slot = pte;
        (self.valid, self.huge, self.splits) = (valid, huge, splits);
        Ok(())
    }

    /// Maps the 2 MiB block at `va` (aligned) with one entry `pte` (a frame PTE of the first
    /// of 512 aligned frames), replacing the block's 4 KiB entries.
    pub(crate) fn set_huge(&mut self, va: u64, pte: u64) -> Result {
        let (mut valid, mut huge) = (self.valid, self.huge);
        let l = self.leaf_mut(va).ok_or(EAGAIN)?;
        for e in l.ptes.iter_mut() {
            if *e & PTE_VALID != 0 {
                valid -= 1;
            }
            // Only the accessed bit stays, as the page's shadow under the 2 MiB entry.
            *e &= PTE_ACCESSED;
        }
        if l.huge & PTE_VALID == 0 {
            huge += 1;
        }
        l.huge = pte;
        (self.valid, self.huge) = (valid, huge);
        Ok(())
    }

    /// Clears `npages` PTEs from `va`, splitting a 2 MiB entry the range covers in part;
    /// returns how many 4 KiB and how many 2 MiB entries were valid.
    pub(crate) fn clear(&mut self, va: u64, npages: u64) -> (u64, u64) {
        let (mut valid, mut huge, mut splits) = (self.valid, self.huge, self.splits);
        let (mut n4k, mut n2m) = (0, 0);
        let end = va.saturating_add(npages << 12);
        let mut v = va;
        while v < end {
            // The part of the range in v's block.
            let block_end = ((v >> 21) + 1) << 21;
            let stop = core::cmp::min(end, block_end);
            if let Ok(i) = self.dir.binary_search_by_key(&(v >> 21), |e| e.0) {
                let l = &mut self.dir[i].1;
                if l.huge & PTE_VALID != 0 && v & ((1 << 21) - 1) == 0 && stop == block_end {
                    l.huge = 0;
                    l.ptes.fill(0);
                    huge -= 1;
                    n2m += 1;
                } else {
                    Self::split(l, &mut valid, &mut huge, &mut splits);
                    let (a, b) = (((v >> 12) as usize) % LEAF, ((stop - v) >> 12) as usize);
                    for e in &mut l.ptes[a..a + b] {
                        if *e & PTE_VALID != 0 {
                            n4k += 1;
                            valid -= 1;
                        }
                        *e = 0;
                    }
                }
            }
            v = stop;
        }
        (self.valid, self.huge, self.splits) = (valid, huge, splits);
        (n4k, n2m)
    }
}

/// One device context: the page table of one address space on this device.
#[pin_data]
pub(crate) struct SimCtx {
    /// Kernels lock it for every access ([`SimCtx::access`]), gmem's callbacks for each
    /// call ([`SimCtx::manage`]).
    #[pin]
    pub(crate) pt: Mutex<PageTable>,
    /// Callbacks waiting for `pt`. While nonzero, a kernel waits before its next access:
    /// the device's walker yields to its driver, so that a callback is not starved by a
    /// kernel that drops `pt` after each page and takes it again at once (a mutex's
    /// spinning waiter rarely wins that race: a profile of P4 showed gmem's eviction
    /// spinning on `pt` for tens of milliseconds per run).
    waiting: AtomicU32,
}

impl SimCtx {
    pub(crate) fn new() -> Result<Pin<KBox<SimCtx>>> {
        KBox::pin_init(
            pin_init!(SimCtx {
                pt <- new_mutex!(PageTable { dir: KVec::new(), valid: 0, huge: 0, splits: 0 }, "gmem_sim_pt"),
                waiting: AtomicU32::new(0),
            }),
            GFP_KERNEL,
        )
    }

    /// `pt` for a callback of gmem's: announced to the kernels, which let it in first.
    pub(crate) fn manage(&self) -> MutexGuard<'_, PageTable> {
        // A hint only (the mutex excludes): relaxed.
        self.waiting.fetch_add(1, Ordering::Relaxed);
        let g = self.pt.lock();
        self.waiting.fetch_sub(1, Ordering::Relaxed);
        g
    }

    /// `pt` for a kernel's access, after any callback that is waiting for it: the kernel
    /// yields its CPU up to `YIELDS` times while one waits, then queues on the lock like
    /// anyone (`yield` only gives way to tasks of its own priority, so a real-time kernel
    /// could otherwise spin for ever over a callback it keeps off the CPU).
    pub(crate) fn access(&self) -> MutexGuard<'_, PageTable> {
        const YIELDS: u32 = 64;
        for _ in 0..YIELDS {
            if self.waiting.load(Ordering::Relaxed) == 0 {
                break;
            }
            // SAFETY: `yield_` may be called from any task context that may sleep, as a
            // kernel's (an ioctl's) is.
            unsafe { bindings::yield_() };
        }
        self.pt.lock()
    }

    /// Makes sure every block of the `npages` pages from `va` has its leaf, allocating
    /// without the page-table lock (see the module documentation).
    pub(crate) fn prepare(&self, va: u64, npages: u64) -> Result {
        let end = npages.checked_mul(PAGE).and_then(|b| va.checked_add(b)).ok_or(EINVAL)?;
        if end <= va {
            return Ok(());
        }
        let (first, last) = (va >> 21, (end - 1) >> 21);
        // A few rounds at most: only a concurrent `prepare` of other blocks can make the
        // room measured without the lock fall short.
        for _ in 0..16 {
            let (need, len) = {
                let pt = self.manage();
                (pt.missing(first, last), pt.dir.len())
            };
            if need == 0 {
                return Ok(());
            }
            let mut leaves = KVec::with_capacity(need, GFP_KERNEL)?;
            for _ in 0..need {
                leaves.push(KBox::new([0u64; LEAF], GFP_KERNEL)?, GFP_KERNEL)?;
            }
            // Room for the directory to grow, with slack so that it is not copied per block.
            let mut spare = KVec::with_capacity(len + need + len / 2 + 8, GFP_KERNEL)?;
            let done = self.manage().install(first, last, &mut leaves, &mut spare);
            // `leaves` and `spare` (maybe the old directory) are freed here, unlocked.
            if done {
                return Ok(());
            }
        }
        Err(ENOMEM)
    }
}

const PAGE: u64 = 4096;

#[kunit_tests(gmem_sim_pt)]
mod tests {
    use super::*;

    #[test]
    fn pte_encoding_round_trips() {
        assert_eq!(decode(0), None);
        assert_eq!(decode(encode(Target::Frame(77), true)), Some((Target::Frame(77), true)));
        let fake = 0x1234_5640 as *mut bindings::page;
        assert_eq!(decode(encode(Target::Host(fake), false)), Some((Target::Host(fake), false)));
    }

    #[test]
    fn set_lookup_clear_across_blocks() {
        let ctx = SimCtx::new().expect("ctx");
        // Without a leaf, `set` asks for `prepare` (it allocates nothing itself).
        assert_eq!(ctx.pt.lock().set(0x20_0000, encode(Target::Frame(1), true)), Err(EAGAIN));
        ctx.prepare(0, 0x60_0000 >> 12).expect("prepare");
        let mut pt = ctx.pt.lock();
        pt.set(0x20_0000, encode(Target::Frame(1), true)).expect("set");
        pt.set(0x1000, encode(Target::Frame(2), false)).expect("set");
        pt.set(0x40_1000, encode(Target::Frame(3), true)).expect("set");
        assert_eq!(pt.valid, 3);
        assert_eq!(decode(pt.lookup(0x1000)), Some((Target::Frame(2), false)));
        assert_eq!(pt.lookup(0x2000), 0);
        assert_eq!(pt.clear(0x1000, 0x40_0000 >> 12), (2, 0));
        assert_eq!(pt.valid, 1);
        assert_eq!(decode(pt.lookup(0x40_1000)), Some((Target::Frame(3), true)));
        // Accessed bit: set by a touch, reported and cleared once, invisible to decode.
        assert!(!pt.test_clear_accessed(0x40_1000));
        pt.touch(0x40_1000);
        assert_eq!(decode(pt.lookup(0x40_1000)), Some((Target::Frame(3), true)));
        assert!(pt.test_clear_accessed(0x40_1000));
        assert!(!pt.test_clear_accessed(0x40_1000));
    }

    #[test]
    fn an_access_walks_once_marks_what_hit_and_runs_only_if_all_hit() {
        let pool = Pool::new(4).expect("pool");
        let ctx = SimCtx::new().expect("ctx");
        ctx.prepare(0, 0x40_0000 >> 12).expect("prepare");
        let mut pt = ctx.pt.lock();
        // Frame 1 writable at 0x1000, frame 2 read-only at 0x2000; 0x3000 unmapped; frame 9
        // (outside the pool) at 0x4000; frames 0-3 at 0x20_0000 under a 2 MiB entry.
        pt.set(0x1000, encode(Target::Frame(1), true)).expect("set");
        pt.set(0x2000, encode(Target::Frame(2), false)).expect("set");
        pt.set(0x4000, encode(Target::Frame(9), true)).expect("set");
        pt.set_huge(0x20_0000, encode(Target::Frame(0), true)).expect("huge");
        // A write through the writable entry lands in frame 1 and marks it accessed.
        let r = pt.access_pages((0x1000, true), None, &pool, |m, none| {
            assert!(none.is_none());
            m.write_u32(8, 0xabcd)
        });
        assert_eq!(r, Some(Ok(())));
        assert!(pt.test_clear_accessed(0x1000));
        // A write through a read-only entry, an unmapped page and a frame the pool does
        // not have all miss, and nothing runs.
        let mut ran = false;
        assert!(pt.access_pages((0x2000, true), None, &pool, |_, _| ran = true).is_none());
        assert!(pt.access_pages((0x3000, false), None, &pool, |_, _| ran = true).is_none());
        assert!(pt.access_pages((0x4000, false), None, &pool, |_, _| ran = true).is_none());
        assert!(!ran);
        assert!(!pt.test_clear_accessed(0x2000));
        // Two pages: the second misses, so nothing runs, but the first was accessed.
        assert!(pt.access_pages((0x1000, false), Some((0x3000, false)), &pool, |_, _| ran = true).is_none());
        assert!(!ran);
        assert!(pt.test_clear_accessed(0x1000));
        // Both hit: the source page and the destination (under the 2 MiB entry: page 1 of
        // the block is frame 1, written above) are read; each is marked in its own slot.
        let r = pt.access_pages((0x2000, false), Some((0x20_1000, true)), &pool, |src, dst| {
            let v = src.read_u32(0)?;
            dst.map_or(Err(EINVAL), |d| d.read_u32(8)).map(|w| (v, w))
        });
        assert_eq!(r, Some(Ok((0, 0xabcd))));
        assert!(pt.test_clear_accessed(0x2000));
        assert!(pt.test_clear_accessed(0x20_1000));
        assert!(!pt.test_clear_accessed(0x20_0000));
    }

    #[test]
    fn prepare_installs_leaves_without_allocating_under_the_lock() {
        let ctx = SimCtx::new().expect("ctx");
        // Blocks in two batches, the second interleaved with the first, so that the
        // directory grows (into the spare one) and keeps its order.
        for b in Iterator::chain((0..40u64).step_by(2), (1..40).step_by(2)) {
            ctx.prepare(b << 21, 1).expect("prepare");
        }
        ctx.prepare(0, 40 * 512).expect("prepare again: nothing missing");
        let mut pt = ctx.pt.lock();
        assert_eq!(pt.dir.len(), 40);
        assert!(pt.dir.windows(2).all(|w| w[0].0 < w[1].0));
        for b in 0..40u64 {
            pt.set((b << 21) + 0x3000, encode(Target::Frame(b), true)).expect("set");
        }
        assert_eq!(pt.valid, 40);
        assert_eq!(decode(pt.lookup((7 << 21) + 0x3000)), Some((Target::Frame(7), true)));
        drop(pt);
        // A range that wraps is refused.
        assert_eq!(ctx.prepare(u64::MAX - 0xfff, 2), Err(EINVAL));
    }

    #[test]
    fn huge_entries_translate_split_and_clear() {
        let ctx = SimCtx::new().expect("ctx");
        ctx.prepare(0x1f_f000, 0x42_0000 >> 12).expect("prepare");
        let mut pt = ctx.pt.lock();
        // Two 4 KiB entries in the block are replaced by the 2 MiB one.
        pt.set(0x20_0000, encode(Target::Frame(9), true)).expect("set");
        pt.set(0x60_0000, encode(Target::Frame(7), true)).expect("set");
        pt.set_huge(0x20_0000, encode(Target::Frame(1024), false)).expect("huge");
        assert_eq!((pt.valid, pt.huge), (1, 1));
        assert_eq!(decode(pt.lookup(0x20_0000)), Some((Target::Frame(1024), false)));
        assert_eq!(decode(pt.lookup(0x3f_f000)), Some((Target::Frame(1535), false)));
        // Accessed bits stay per page under the 2 MiB entry, and survive a split.
        pt.touch(0x30_0000);
        pt.touch(0x20_4000);
        assert!(!pt.test_clear_accessed(0x20_1000));
        assert!(pt.test_clear_accessed(0x30_0000));
        assert!(!pt.test_clear_accessed(0x30_0000));
        assert_eq!(decode(pt.lookup(0x20_4000)), Some((Target::Frame(1028), false)));
        // Unmapping one page splits: the other 511 keep their frames.
        assert_eq!(pt.clear(0x20_5000, 1), (1, 0));
        assert_eq!((pt.valid, pt.huge, pt.splits), (1 + 511, 0, 1));
        assert_eq!(pt.lookup(0x20_5000), 0);
        assert_eq!(decode(pt.lookup(0x20_4000)), Some((Target::Frame(1028), false)));
        assert_eq!(decode(pt.lookup(0x20_6000)), Some((Target::Frame(1030), false)));
        // The accessed bit survives the split.
        assert!(pt.test_clear_accessed(0x20_4000));
        // Promotion again, then a 4 KiB map inside it splits it too.
        pt.set_huge(0x20_0000, encode(Target::Frame(1024), true)).expect("huge");
        assert_eq!((pt.valid, pt.huge), (1, 1));
        pt.set(0x20_1000, encode(Target::Frame(3), true)).expect("set");
        assert_eq!((pt.valid, pt.huge, pt.splits), (1 + 512, 0, 2));
        assert_eq!(decode(pt.lookup(0x20_1000)), Some((Target::Frame(3), true)));
        // Over a range that crosses into the next block, selected pages only: a touched
        // page not selected keeps its bit; an unmapped one reads 0.
        pt.touch(0x20_2000);
        pt.touch(0x20_3000);
        pt.touch(0x1f_f000);
        pt.touch(0x23_f000);
        // From 0x1f_e000: page 1 is 0x1f_f000 (no entry), page 4 is 0x20_2000 and page 65
        // 0x23_f000 (touched); page 5, 0x20_3000, is not selected.
        let mut bits = [(1 << 1) | (1 << 4), 1 << 1];
        pt.test_clear_accessed_range(0x1f_e000, &mut bits);
        assert_eq!(bits, [1 << 4, 1 << 1]);
        // Not selected: kept.
        assert!(pt.test_clear_accessed(0x20_3000));
        // Selected: cleared.
        assert!(!pt.test_clear_accessed(0x20_2000));
        // A whole-block clear removes a 2 MiB entry without splitting it.
        pt.set_huge(0x20_0000, encode(Target::Frame(1024), true)).expect("huge");
        pt.set(0x1f_f000, encode(Target::Frame(5), true)).expect("set");
        assert_eq!(pt.clear(0x1f_f000, 514), (1, 1));
        assert_eq!((pt.valid, pt.huge, pt.splits), (1, 0, 2));
        assert_eq!(decode(pt.lookup(0x60_0000)), Some((Target::Frame(7), true)));
    }
}
