// SPDX-License-Identifier: GPL-2.0
//! Kernels of the simulated device. They touch memory only through the device page table
//! of the launching process's context. A miss (no PTE, or a read-only PTE on a write) goes
//! into the fault buffer; a full buffer, or the end of a chunk, is reported to gmem as one
//! batch (`gmem_dev_fault`), then the access is replayed — as a GPU's fault buffer and
//! replay work.

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
/// Bytes a streaming kernel faults in and computes on at a time (one fault buffer's worth).
const WINDOW: u64 = (FAULT_BUFFER * PAGE_SIZE) as u64;
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

impl Launch {
    pub(crate) fn check(&self) -> Result {
        let two = matches!(self.kernel, K_COPY | K_AXPY);
        let known = matches!(self.kernel, K_FILL | K_CHECKSUM | K_COPY | K_AXPY | K_TOUCH);
        let flags_ok = self.flags & !F_WRITE == 0 && (self.flags == 0 || self.kernel == K_TOUCH);
        if !known || !flags_ok || self.len == 0 || self.len % 4 != 0 || self.a % 4 != 0 || (two && self.b % 4 != 0) {
            return Err(EINVAL);
        }
        self.a.checked_add(self.len).ok_or(EOVERFLOW)?;
        if two {
            self.b.checked_add(self.len).ok_or(EOVERFLOW)?;
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
        self.out.faults += buf.addrs.len() as u64;
        self.out.batches += 1;
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
        // may be unmapped again under us (eviction), so the passes are bounded.
        for _pass in 0..MAX_REPLAYS * 64 {
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
                    pt.touch(va & !0xfff);
                }
                if let (Some((v, _)), Some(Xlate::Hit(_))) = (va2, &p2) {
                    pt.touch(v & !0xfff);
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
            self.ensure(core::iter::once(va & !0xfff), write)?;
            if let Some((v, w)) = va2 {
                self.ensure(core::iter::once(v & !0xfff), w)?;
            }
        }
        Err(EIO)
    }

    /// Pre-faults a whole range in batches (the common case: streaming kernels).
    fn prefault(&mut self, start: u64, len: u64, write: bool) -> Result {
        let first = start & !0xfff;
        let end = start + len;
        // Chunks of the fault buffer's size keep each batch within bounds.
        let mut chunk_start = first;
        while chunk_start < end {
            let chunk_end = core::cmp::min(end, chunk_start + (FAULT_BUFFER * PAGE_SIZE) as u64);
            self.ensure((chunk_start..chunk_end).step_by(PAGE_SIZE), write)?;
            chunk_start = chunk_end;
        }
        Ok(())
    }

    pub(crate) fn run(&mut self, l: &Launch) -> Result {
        match l.kernel {
            K_FILL => self.stream(l.a, l.len, None, |i, w, _| *w = l.value.wrapping_add(i as u32)),
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
            if off % WINDOW == 0 {
                // Like a GPU working through its grid: fault in the next window in batches,
                // compute on it, move on (never the whole range up front: over capacity that
                // would evict the window's own pages before they are used).
                let w = core::cmp::min(WINDOW, len - off);
                if let Some(s) = src {
                    self.prefault(s + off, w, false)?;
                }
                self.prefault(dst + off, w, true)?;
            }
            let d = dst + off;
            let mut seg = core::cmp::min(len - off, PAGE_SIZE as u64 - (d & 0xfff));
            if let Some(s) = src {
                seg = core::cmp::min(seg, PAGE_SIZE as u64 - ((s + off) & 0xfff));
            }
            let words = (seg / 4) as usize;
            let base = off / 4;
            let (do_, so) = ((d & 0xfff) as usize, src.map(|s| ((s + off) & 0xfff) as usize));
            self.access(d, true, src.map(|s| (s + off, false)), |pd, ps, scratch| {
                // Read the source first (it may alias the destination page).
                if let (Some(ps), Some(so)) = (ps, so) {
                    for (k, slot) in scratch.iter_mut().enumerate().take(words) {
                        // SAFETY: `so + 4k + 4 <= PAGE_SIZE` by the segment bound.
                        *slot = unsafe { ps.add(so + 4 * k).cast::<u32>().read_unaligned() };
                    }
                }
                for k in 0..words {
                    // SAFETY: `do_ + 4k + 4 <= PAGE_SIZE` by the segment bound.
                    let p = unsafe { pd.add(do_ + 4 * k).cast::<u32>() };
                    // SAFETY: as above.
                    let mut w = unsafe { p.read_unaligned() };
                    f(base + k as u64, &mut w, if ps.is_some() { scratch[k] } else { 0 });
                    // SAFETY: as above.
                    unsafe { p.write_unaligned(w) };
                }
            })?;
            off += seg;
        }
        Ok(())
    }

    fn read_stream(&mut self, src: u64, len: u64, mut f: impl FnMut(u32)) -> Result {
        let mut off = 0u64;
        while off < len {
            if off % WINDOW == 0 {
                self.prefault(src + off, core::cmp::min(WINDOW, len - off), false)?;
            }
            let s = src + off;
            let seg = core::cmp::min(len - off, PAGE_SIZE as u64 - (s & 0xfff));
            let (so, words) = ((s & 0xfff) as usize, (seg / 4) as usize);
            self.access(s, false, None, |ps, _, _| {
                for k in 0..words {
                    // SAFETY: `so + 4k + 4 <= PAGE_SIZE` by the segment bound.
                    f(unsafe { ps.add(so + 4 * k).cast::<u32>().read_unaligned() });
                }
            })?;
            off += seg;
        }
        Ok(())
    }

    fn touch(&mut self, l: &Launch) -> Result {
        let first = l.a & !0xfff;
        let npages = ((l.a + l.len - first) + 0xfff) / 0x1000;
        let write = l.flags & F_WRITE != 0;
        let mut x = l.seed | 1;
        let mut done = 0u64;
        let mut batch = KVec::with_capacity(FAULT_BUFFER, GFP_KERNEL)?;
        while done < l.count {
            batch.clear();
            while batch.len() < FAULT_BUFFER && done + (batch.len() as u64) < l.count {
                // 64-bit LCG (Knuth's MMIX constants).
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                batch.push(first + ((x >> 33) % npages) * PAGE_SIZE as u64, GFP_KERNEL)?;
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
            done += batch.len() as u64;
        }
        Ok(())
    }
}
