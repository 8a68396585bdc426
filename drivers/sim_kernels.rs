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

use crate::gmem::{sched, Access, Session};
use crate::sim_mem::{Mapped, PAGE_SIZE};
use crate::sim_pt::SimCtx;
use crate::SimDev;
use kernel::{
    prelude::*,
    uaccess::{UserPtr, UserSlice},
};

pub(crate) const K_FILL: u32 = 1;
pub(crate) const K_CHECKSUM: u32 = 2;
pub(crate) const K_COPY: u32 = 3;
pub(crate) const K_AXPY: u32 = 4;
pub(crate) const K_TOUCH: u32 = 5;
pub(crate) const K_GATHER: u32 = 6;
pub(crate) const F_WRITE: u32 = 1;

/// Entries of the fault buffer (UVM's batch size).
pub(crate) const FAULT_BUFFER: usize = 256;
/// Most addresses of one GATHER launch (what `gmem_dev_fault` takes in one batch).
pub(crate) const MAX_GATHER: u64 = 4096;
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
fn checkpoint(session: &Session<'_, SimDev>) -> Result {
    if sched::fatal_signal_pending() {
        return Err(EINTR);
    }
    // The device is being unplugged: end the launch (like a GPU's channel teardown).
    if session.revoked() {
        return Err(ENODEV);
    }
    sched::cond_resched();
    Ok(())
}

impl Launch {
    /// Validates the shape of a launch: `EINVAL` for unknown kernels or flags, a zero or
    /// unaligned length or address; `EOVERFLOW` if a range's page-rounded end does not fit
    /// below 2^64. After this, every page address a kernel derives is representable.
    pub(crate) fn check(&self) -> Result {
        if self.kernel == K_GATHER {
            // a: the address list (u64s), b: the result words (u32s), count: entries.
            let shape = self.flags == 0 && self.len == 0 && self.a % 8 == 0 && self.b % 4 == 0;
            if !shape || self.count == 0 || self.count > MAX_GATHER {
                return Err(EINVAL);
            }
            return Ok(());
        }
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
pub(crate) struct Runner<'a, 's> {
    dev: &'a SimDev,
    ctx: &'a SimCtx,
    session: &'a Session<'s, SimDev>,
    pub(crate) out: Outcome,
    scratch: Scratch,
}

/// The words of one page segment, as the device's registers would hold them: the source
/// and the destination are read whole, computed on, and the destination written back.
struct Scratch {
    src: KVec<u32>,
    dst: KVec<u32>,
}

impl Scratch {
    fn new() -> Result<Scratch> {
        let mut src = KVec::with_capacity(PAGE_SIZE / 4, GFP_KERNEL)?;
        let mut dst = KVec::with_capacity(PAGE_SIZE / 4, GFP_KERNEL)?;
        for _ in 0..PAGE_SIZE / 4 {
            src.push(0u32, GFP_KERNEL)?;
            dst.push(0u32, GFP_KERNEL)?;
        }
        Ok(Scratch { src, dst })
    }
}

impl<'a, 's> Runner<'a, 's> {
    pub(crate) fn new(dev: &'a SimDev, session: &'a Session<'s, SimDev>) -> Result<Self> {
        Ok(Runner { dev, ctx: session.context(), session, out: Outcome::default(), scratch: Scratch::new()? })
    }

    /// Reports a batch of misses to gmem.
    fn flush(&mut self, buf: &mut FaultBuffer, write: bool) -> Result {
        if buf.addrs.is_empty() {
            return Ok(());
        }
        let access = if write { Access::Write } else { Access::Read };
        // Counts of a launch that may run until it is killed: a wrap takes 2^64 faults, but
        // must not panic either.
        self.out.faults = self.out.faults.wrapping_add(buf.addrs.len() as u64);
        self.out.batches = self.out.batches.wrapping_add(1);
        self.dev.count_faults(buf.addrs.len() as u64);
        let r = self.session.fault(&buf.addrs, access);
        buf.addrs.clear();
        r
    }

    /// Makes sure every page of `pages` (addresses, reported to gmem as they are: a GATHER
    /// passes unaligned ones and duplicates) is mapped for `write`, faulting the missing
    /// ones in batches of at most `FAULT_BUFFER`.
    fn ensure(&mut self, pages: impl Iterator<Item = u64> + Clone, write: bool) -> Result {
        let mut buf = FaultBuffer { addrs: KVec::with_capacity(FAULT_BUFFER, GFP_KERNEL)? };
        // A pass reports at most one buffer; more misses than that take more passes. Pages
        // may be unmapped again under us (eviction), so the passes are bounded. Every pass
        // starts at a checkpoint: this is the one loop every kernel goes through per chunk.
        for _pass in 0..MAX_REPLAYS * 64 {
            checkpoint(self.session)?;
            {
                let pt = self.ctx.access();
                for va in pages.clone() {
                    if !pt.present(va, write, &self.dev.pool) {
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
        mut f: impl FnMut(&Mapped<'_>, Option<&Mapped<'_>>, &mut Scratch) -> Result<R>,
    ) -> Result<R> {
        let pool = &self.dev.pool;
        for _ in 0..MAX_REPLAYS {
            {
                let scratch = &mut self.scratch;
                let r = self.ctx.access().access_pages((va, write), va2, pool, |m1, m2| f(m1, m2, scratch));
                if let Some(r) = r {
                    return r;
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
            K_GATHER => self.gather(l),
            _ => Err(EINVAL),
        }
    }

    /// Walks `[dst, dst+len)` word by word; `f(index, &mut dst_word, src_word)`, where the
    /// source is `[src, src+len)` if given (0 otherwise). Segments never cross a page of
    /// either range, so each segment is one locked access.
    fn stream(&mut self, dst: u64, len: u64, src: Option<u64>, mut f: impl FnMut(u64, &mut u32, u32)) -> Result {
        let (mut off, mut window_end) = (0u64, 0u64);
        while off < len {
            let left = sub(len, off)?;
            let d = add(dst, off)?;
            let s = src.map(|s| add(s, off)).transpose()?;
            // (Not `off % WINDOW == 0`: segments end at page boundaries, so with an
            // unaligned start `off` never meets a multiple of the window again.)
            if off >= window_end {
                // Like a GPU working through its grid: fault in the next window in batches,
                // compute on it, move on (never the whole range up front: over capacity that
                // would evict the window's own pages before they are used).
                let w = core::cmp::min(WINDOW, left);
                window_end = add(off, w)?;
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
            self.access(d, true, s.map(|s| (s, false)), |pd, ps, sc| {
                let (src, dst) = (sc.src.get_mut(..words).ok_or(EINVAL)?, sc.dst.get_mut(..words).ok_or(EINVAL)?);
                // Read the source first (it may alias the destination page).
                if let (Some(ps), Some(so)) = (ps, so) {
                    ps.read_words(so, src)?;
                } else {
                    src.fill(0);
                }
                pd.read_words(do_, dst)?;
                for (k, (w, x)) in dst.iter_mut().zip(src.iter()).enumerate() {
                    // A word index below `len / 4`: cannot wrap.
                    f(base.wrapping_add(k as u64), w, *x);
                }
                pd.write_words(do_, dst)
            })?;
            off = add(off, seg)?;
        }
        Ok(())
    }

    fn read_stream(&mut self, src: u64, len: u64, mut f: impl FnMut(u32)) -> Result {
        let (mut off, mut window_end) = (0u64, 0u64);
        while off < len {
            let left = sub(len, off)?;
            let s = add(src, off)?;
            if off >= window_end {
                let w = core::cmp::min(WINDOW, left);
                window_end = add(off, w)?;
                self.prefault(s, w, false)?;
            }
            // The offset within the page is below PAGE: it fits any usize, and the words
            // `k < words` at byte offset `so` stay within the page.
            let seg = core::cmp::min(left, sub(PAGE, s & PAGE_OFFSET)?);
            let so = usize::try_from(s & PAGE_OFFSET).map_err(|_| EOVERFLOW)?;
            let words = usize::try_from(seg / 4).map_err(|_| EOVERFLOW)?;
            self.access(s, false, None, |ps, _, _| ps.each_word(so, words, &mut f))?;
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
                    let v = p.read_u32(0)?;
                    if write {
                        p.write_u32(0, v.wrapping_add(1))?;
                    }
                    Ok(v)
                })?;
                self.out.result = self.out.result.wrapping_add(u64::from(v));
            }
            done = add(done, n)?;
        }
        Ok(())
    }

    /// GATHER: reads the word at each of `count` addresses (any order, duplicates, any
    /// offset in a page that is a multiple of 4), all reported to gmem as they are in one
    /// fault batch per fault buffer, as a GPU's gather instruction would; writes the words
    /// to the user buffer `b`. `result` is the number of words read.
    fn gather(&mut self, l: &Launch) -> Result {
        // `check` bounds `count` by MAX_GATHER.
        let n = usize::try_from(l.count).map_err(|_| EINVAL)?;
        let mut addrs = KVec::with_capacity(n, GFP_KERNEL)?;
        let mut r = UserSlice::new(UserPtr::from_addr(usize::try_from(l.a).map_err(|_| EFAULT)?), n * 8).reader();
        for _ in 0..n {
            let a: u64 = r.read()?;
            if a % 4 != 0 {
                return Err(EINVAL);
            }
            addrs.push(a, GFP_KERNEL)?;
        }
        self.ensure(addrs.iter().copied(), false)?;
        let mut w = UserSlice::new(UserPtr::from_addr(usize::try_from(l.b).map_err(|_| EFAULT)?), n * 4).writer();
        for &a in addrs.iter() {
            // `a % 4 == 0`, so the word lies inside its page.
            let off = usize::try_from(a & PAGE_OFFSET).map_err(|_| EOVERFLOW)?;
            let v = self.access(a, false, None, |p, _, _| p.read_u32(off))?;
            w.write(&v)?;
        }
        self.out.result = l.count;
        Ok(())
    }
}
