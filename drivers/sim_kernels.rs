// SPDX-License-Identifier: GPL-2.0
//! Kernels of the simulated device. They touch memory only through the device page table
//! of the launching process's context. A miss (no PTE, or a read-only PTE on a write) goes
//! into the fault buffer; a full buffer, or the end of a chunk, is reported to gmem as one
//! batch (`gmem_dev_fault`), then the access is replayed — as a GPU's fault buffer and
//! replay work.
//!
//! Every launch argument is user input: all arithmetic on addresses, lengths and counts is
//! checked (`Launch::check` proves the page-rounded end of each range fits below 2^64, and
//! the kernels still use checked operations on every offset they derive from it). Between
//! chunks (each pass of the fault buffer, so every 256 pages or TOUCH accesses) a kernel
//! stops with `EINTR` if the task has a fatal signal pending, and offers to reschedule.

use crate::abi::{GMEM_ACCESS_READ, GMEM_ACCESS_WRITE};
use crate::sim_mem::{Mapped, PAGE_SIZE};
use crate::sim_pt::{decode, SimCtx, Target};
use crate::SimDev;
use kernel::{bindings, prelude::*};

pub(crate) const K_FILL: u32 = 1;
pub(crate) const K_CHECKSUM: u32 = 2;
pub(crate) const K_COPY: u32 = 3;
pub(crate) const K_AXPY: u32 = 4;
pub(crate) const K_TOUCH: u32 = 5;
pub(crate) const F_WRITE: u32 = 1;

/// Entries of the fault buffer (UVM's batch size).
pub(crate) const FAULT_BUFFER: usize = 256;
/// `PAGE_SIZE` as a device address quantity.
const PAGE: u64 = PAGE_SIZE as u64;
/// Offset bits of a device address within its page.
const PAGE_OFFSET: u64 = PAGE - 1;
/// Bytes a streaming kernel faults in and computes on at a time (one fault buffer's worth).
const WINDOW: u64 = FAULT_BUFFER as u64 * PAGE;
/// Times one access is replayed before the kernel fails with EIO.
const MAX_REPLAYS: usize = 16;

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// A launch as the ioctl received it (validated by `Launch::check`).
pub(crate) struct Launch {
    pub(crate) kernel: u32,
    pub(crate) flags: u32,
    pub(crate) value: u32,
    pub(crate) a: u64,
    pub(crate) b: u64,
    pub(crate) len: u64,
    pub(crate) seed: u64,
    pub(crate) count: u64,
}

#[derive(Default)]
pub(crate) struct Outcome {
    pub(crate) result: u64,
    pub(crate) faults: u64,
    pub(crate) batches: u64,
}

/// The pages `[first, end)` (both page-aligned) that hold the bytes `[start, start + len)`.
/// `EOVERFLOW` unless the end rounded up to a page is below 2^64 (the last page of the
/// 64-bit space is never part of a valid range, so `end` is always representable).
pub(crate) fn page_span(start: u64, len: u64) -> Result<(u64, u64)> {
    let end = start.checked_add(len).and_then(|e| e.checked_add(PAGE_OFFSET)).ok_or(EOVERFLOW)?;
    Ok((start & !PAGE_OFFSET, end & !PAGE_OFFSET))
}

/// `x + y`, or `EOVERFLOW` (for offsets derived from user input).
fn add(x: u64, y: u64) -> Result<u64> {
    x.checked_add(y).ok_or(EOVERFLOW)
}

/// `x - y`, or `EOVERFLOW` (callers have `y <= x`; the check keeps it so if they change).
fn sub(x: u64, y: u64) -> Result<u64> {
    x.checked_sub(y).ok_or(EOVERFLOW)
}

/// The low 32 bits of `x`: FILL's `value + i` is defined mod 2^32 (see the uapi header).
fn low32(x: u64) -> u32 {
    u32::try_from(x & u64::from(u32::MAX)).unwrap_or(0)
}

/// Between chunks of a launch: ends it with `EINTR` if the task is being killed, and offers
/// the CPU to others (a launch can run for minutes; the lock-free point between two fault
/// buffers is where a real device driver would wait for the hardware).
fn checkpoint() -> Result {
    if crate::sim_sched::fatal_signal_pending() {
        return Err(EINTR);
    }
    crate::sim_sched::cond_resched();
    Ok(())
}

impl Launch {
    /// Validates the shape of a launch: `EINVAL` for unknown kernels or flags, a zero or
    /// unaligned length or address; `EOVERFLOW` if a range's page-rounded end does not fit
    /// below 2^64. After this, every page address a kernel derives is representable.
    pub(crate) fn check(&self) -> Result {
        let two = matches!(self.kernel, K_COPY | K_AXPY);
        let known = matches!(self.kernel, K_FILL | K_CHECKSUM | K_COPY | K_AXPY | K_TOUCH);
        let flags_ok = self.flags & !F_WRITE == 0 && (self.flags == 0 || self.kernel == K_TOUCH);
        if !known || !flags_ok || self.len == 0 || self.len % 4 != 0 || self.a % 4 != 0 || (two && self.b % 4 != 0) {
            return Err(EINVAL);
        }
        page_span(self.a, self.len)?;
        if two {
            page_span(self.b, self.len)?;
        }
        Ok(())
    }
}

/// The fault buffer: pending misses of one access kind.
struct FaultBuffer {
    addrs: KVec<u64>,
}

/// Runs kernels of one device in one context (the caller's address space).
pub(crate) struct Runner<'a> {
    pub(crate) dev: &'a SimDev,
    pub(crate) ctx: &'a SimCtx,
    pub(crate) space: *mut crate::abi::GmemSpaceHandle,
    pub(crate) out: Outcome,
    scratch: KVec<u32>,
}

/// Result of translating one page for an access.
enum Xlate {
    Hit(*mut bindings::page),
    Miss,
}

impl<'a> Runner<'a> {
    pub(crate) fn new(dev: &'a SimDev, ctx: &'a SimCtx, space: *mut crate::abi::GmemSpaceHandle) -> Result<Self> {
        let mut scratch = KVec::with_capacity(PAGE_SIZE / 4, GFP_KERNEL)?;
        for _ in 0..PAGE_SIZE / 4 {
            scratch.push(0u32, GFP_KERNEL)?;
        }
        Ok(Runner { dev, ctx, space, out: Outcome::default(), scratch })
    }

    fn xlate(pte: u64, write: bool, dev: &SimDev) -> Xlate {
        match decode(pte) {
            Some((_, false)) if write => Xlate::Miss,
            Some((Target::Frame(f), _)) => dev.pool.frame(f).map_or(Xlate::Miss, Xlate::Hit),
            Some((Target::Host(p), _)) => Xlate::Hit(p),
            None => Xlate::Miss,
        }
    }

    /// Reports a batch of misses to gmem.
    fn flush(&mut self, buf: &mut FaultBuffer, write: bool) -> Result {
        if buf.addrs.is_empty() {
            return Ok(());
        }
        let access = if write { GMEM_ACCESS_WRITE } else { GMEM_ACCESS_READ };
        // Counts of a launch that may run until it is killed: a wrap takes 2^64 faults, but
        // must not panic either.
        self.out.faults = self.out.faults.wrapping_add(buf.addrs.len() as u64);
        self.out.batches = self.out.batches.wrapping_add(1);
        self.dev.count_faults(buf.addrs.len() as u64);
        let r = self.dev.fault(self.space, &buf.addrs, access);
        buf.addrs.clear();
        r
    }

    /// Makes sure every page of `pages` (page-aligned addresses) is mapped for `write`,
    /// faulting the missing ones in batches of at most `FAULT_BUFFER`.
    fn ensure(&mut self, pages: impl Iterator<Item = u64> + Clone, write: bool) -> Result {
        let mut buf = FaultBuffer { addrs: KVec::with_capacity(FAULT_BUFFER, GFP_KERNEL)? };
        // A pass reports at most one buffer; more misses than that take more passes. Pages
        // may be unmapped again under us (eviction), so the passes are bounded. Every pass
        // starts at a checkpoint: this is the one loop every kernel goes through per chunk.
        for _pass in 0..MAX_REPLAYS * 64 {
            checkpoint()?;
            {
                let pt = self.ctx.pt.lock();
                for va in pages.clone() {
                    if let Xlate::Miss = Self::xlate(pt.lookup(va), write, self.dev) {
                        buf.addrs.push(va, GFP_KERNEL)?;
                        if buf.addrs.len() == FAULT_BUFFER {
                            break;
                        }
                    }
                }
            }
            let full = buf.addrs.len() == FAULT_BUFFER;
            self.flush(&mut buf, write)?;
            if !full {
                return Ok(());
            }
        }
        Err(EIO)
    }

    /// Runs `f` on the mapped page at `va` (and `va2` if given) under the page-table lock,
    /// faulting and replaying until both are present.
    fn access<R>(
        &mut self,
        va: u64,
        write: bool,
        va2: Option<(u64, bool)>,
        mut f: impl FnMut(*mut u8, Option<*mut u8>, &mut [u32]) -> R,
    ) -> Result<R> {
        for _ in 0..MAX_REPLAYS {
            {
                let mut pt = self.ctx.pt.lock();
                let p1 = Self::xlate(pt.lookup(va), write, self.dev);
                let p2 = va2.map(|(v, w)| Self::xlate(pt.lookup(v), w, self.dev));
                if let Xlate::Hit(_) = p1 {
                    pt.touch(va & !PAGE_OFFSET);
                }
                if let (Some((v, _)), Some(Xlate::Hit(_))) = (va2, &p2) {
                    pt.touch(v & !PAGE_OFFSET);
                }
                match (p1, p2) {
                    (Xlate::Hit(a), None) => {
                        // SAFETY: the PTE maps a live page (frames are ours; host pages are
                        // not freed before the core unmaps them, which needs this lock).
                        let m = unsafe { Mapped::new(a) };
                        return Ok(f(m.ptr(), None, &mut self.scratch));
                    }
                    (Xlate::Hit(a), Some(Xlate::Hit(b))) => {
                        // SAFETY: as above, for both pages.
                        let (m1, m2) = unsafe { (Mapped::new(a), Mapped::new(b)) };
                        return Ok(f(m1.ptr(), Some(m2.ptr()), &mut self.scratch));
                    }
                    _ => {}
                }
            }
            self.ensure(core::iter::once(va & !PAGE_OFFSET), write)?;
            if let Some((v, w)) = va2 {
                self.ensure(core::iter::once(v & !PAGE_OFFSET), w)?;
            }
        }
        Err(EIO)
    }

    /// Pre-faults the pages of `[start, start + len)` in batches of at most `FAULT_BUFFER`.
    fn prefault(&mut self, start: u64, len: u64, write: bool) -> Result {
        let (mut chunk, end) = page_span(start, len)?;
        // Chunks of the fault buffer's size keep each batch within bounds; no chunk reaches
        // past `end` (a window near 2^64 is clipped, never computed past it).
        while chunk < end {
            let next = add(chunk, core::cmp::min(WINDOW, sub(end, chunk)?))?;
            self.ensure((chunk..next).step_by(PAGE_SIZE), write)?;
            chunk = next;
        }
        Ok(())
    }

    pub(crate) fn run(&mut self, l: &Launch) -> Result {
        match l.kernel {
            K_FILL => self.stream(l.a, l.len, None, |i, w, _| *w = l.value.wrapping_add(low32(i))),
            K_CHECKSUM => {
                let mut h = FNV_OFFSET;
                self.read_stream(l.a, l.len, |w| h = (h ^ u64::from(w)).wrapping_mul(FNV_PRIME))?;
                self.out.result = h;
                Ok(())
            }
            K_COPY | K_AXPY => {
                let axpy = l.kernel == K_AXPY;
                self.stream(l.b, l.len, Some(l.a), |_, y, x| {
                    *y = if axpy { l.value.wrapping_mul(x).wrapping_add(*y) } else { x }
                })
            }
            K_TOUCH => self.touch(l),
            _ => Err(EINVAL),
        }
    }

    /// Walks `[dst, dst+len)` word by word; `f(index, &mut dst_word, src_word)`, where the
    /// source is `[src, src+len)` if given (0 otherwise). Segments never cross a page of
    /// either range, so each segment is one locked access.
    fn stream(&mut self, dst: u64, len: u64, src: Option<u64>, mut f: impl FnMut(u64, &mut u32, u32)) -> Result {
        let mut off = 0u64;
        while off < len {
            let left = sub(len, off)?;
            let d = add(dst, off)?;
            let s = src.map(|s| add(s, off)).transpose()?;
            if off % WINDOW == 0 {
                // Like a GPU working through its grid: fault in the next window in batches,
                // compute on it, move on (never the whole range up front: over capacity that
                // would evict the window's own pages before they are used).
                let w = core::cmp::min(WINDOW, left);
                if let Some(s) = s {
                    self.prefault(s, w, false)?;
                }
                self.prefault(d, w, true)?;
            }
            let mut seg = core::cmp::min(left, sub(PAGE, d & PAGE_OFFSET)?);
            if let Some(s) = s {
                seg = core::cmp::min(seg, sub(PAGE, s & PAGE_OFFSET)?);
            }
            // `seg <= PAGE` and the offsets are below PAGE: these fit any usize, and the
            // words `k < words` at byte offsets `so`, `do_` stay within their pages.
            let words = usize::try_from(seg / 4).map_err(|_| EOVERFLOW)?;
            let do_ = usize::try_from(d & PAGE_OFFSET).map_err(|_| EOVERFLOW)?;
            let so = s.map(|s| usize::try_from(s & PAGE_OFFSET).map_err(|_| EOVERFLOW)).transpose()?;
            let base = off / 4;
            self.access(d, true, s.map(|s| (s, false)), |pd, ps, scratch| {
                // Read the source first (it may alias the destination page).
                if let (Some(ps), Some(so)) = (ps, so) {
                    // SAFETY: `so < PAGE_SIZE`: inside the mapped source page.
                    let src = unsafe { ps.add(so) }.cast::<u32>();
                    for (k, slot) in scratch.iter_mut().enumerate().take(words) {
                        // SAFETY: word `k < words` ends at `so + 4(k + 1) <= PAGE_SIZE` by the
                        // segment bound.
                        *slot = unsafe { src.add(k).read_unaligned() };
                    }
                }
                // SAFETY: `do_ < PAGE_SIZE`: inside the mapped destination page.
                let dst = unsafe { pd.add(do_) }.cast::<u32>();
                for k in 0..words {
                    // SAFETY: word `k < words` ends at `do_ + 4(k + 1) <= PAGE_SIZE` by the
                    // segment bound.
                    let p = unsafe { dst.add(k) };
                    // SAFETY: as above.
                    let mut w = unsafe { p.read_unaligned() };
                    // A word index below `len / 4`: cannot wrap.
                    f(base.wrapping_add(k as u64), &mut w, if ps.is_some() { scratch[k] } else { 0 });
                    // SAFETY: as above.
                    unsafe { p.write_unaligned(w) };
                }
            })?;
            off = add(off, seg)?;
        }
        Ok(())
    }

    fn read_stream(&mut self, src: u64, len: u64, mut f: impl FnMut(u32)) -> Result {
        let mut off = 0u64;
        while off < len {
            let left = sub(len, off)?;
            let s = add(src, off)?;
            if off % WINDOW == 0 {
                self.prefault(s, core::cmp::min(WINDOW, left), false)?;
            }
            // The offset within the page is below PAGE: it fits any usize, and the words
            // `k < words` at byte offset `so` stay within the page.
            let seg = core::cmp::min(left, sub(PAGE, s & PAGE_OFFSET)?);
            let so = usize::try_from(s & PAGE_OFFSET).map_err(|_| EOVERFLOW)?;
            let words = usize::try_from(seg / 4).map_err(|_| EOVERFLOW)?;
            self.access(s, false, None, |ps, _, _| {
                // SAFETY: `so < PAGE_SIZE`: inside the mapped page.
                let src = unsafe { ps.add(so) }.cast::<u32>();
                for k in 0..words {
                    // SAFETY: word `k < words` ends at `so + 4(k + 1) <= PAGE_SIZE` by the
                    // segment bound.
                    f(unsafe { src.add(k).read_unaligned() });
                }
            })?;
            off = add(off, seg)?;
        }
        Ok(())
    }

    /// `count` accesses to pseudo-random pages; the count is unbounded (a launch may run
    /// until it is killed: `ensure` checks for a fatal signal every batch).
    fn touch(&mut self, l: &Launch) -> Result {
        let (first, end) = page_span(l.a, l.len)?;
        // `check` refused len == 0, so the span has at least one page.
        let npages = sub(end, first)? / PAGE;
        if npages == 0 {
            return Err(EINVAL);
        }
        let write = l.flags & F_WRITE != 0;
        let mut x = l.seed | 1;
        let mut done = 0u64;
        let mut batch = KVec::with_capacity(FAULT_BUFFER, GFP_KERNEL)?;
        while done < l.count {
            batch.clear();
            // `count - done` accesses are left; at most a buffer's worth per batch.
            let n = core::cmp::min(FAULT_BUFFER as u64, sub(l.count, done)?);
            for _ in 0..n {
                // 64-bit LCG (Knuth's MMIX constants).
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                // The page index is below `npages`, so the address is below `end`.
                let page = ((x >> 33) % npages).checked_mul(PAGE).ok_or(EOVERFLOW)?;
                batch.push(add(first, page)?, GFP_KERNEL)?;
            }
            self.ensure(batch.iter().copied(), write)?;
            for i in 0..batch.len() {
                let va = batch[i];
                let v = self.access(va, write, None, |p, _, _| {
                    let w = p.cast::<u32>();
                    // SAFETY: word 0 of a mapped page.
                    let v = unsafe { w.read() };
                    if write {
                        // SAFETY: as above, and the PTE is writable.
                        unsafe { w.write(v.wrapping_add(1)) };
                    }
                    v
                })?;
                self.out.result = self.out.result.wrapping_add(u64::from(v));
            }
            done = add(done, n)?;
        }
        Ok(())
    }
}
