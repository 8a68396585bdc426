// SPDX-License-Identifier: GPL-2.0
//! The simulated device's memory: a pool of frames (real pages owned by the driver), the
//! copy engine's page copies, and a scoped CPU mapping of a page with bounds-checked word
//! access. This file (and `sim_pt::PageTable::access_pages`, which decides which page may be
//! mapped) is where the driver touches memory; everything above it is safe code.

use crate::gmem;
use core::marker::PhantomData;
use kernel::{bindings, page::Page, prelude::*};

pub(crate) const PAGE_SIZE: usize = 4096;

/// A page mapped into the kernel's address space, lent to a closure (`Mapped::with`).
///
/// # Invariants
/// `addr` is `kmap_local_page(page)` of a page that stays allocated while the mapping
/// exists. Only `with` creates one, and it unmaps it when the closure returns: mappings
/// nest and are undone in reverse order, as kmap_local needs, and none escapes.
pub(crate) struct Mapped<'g> {
    addr: *mut u8,
    _page: PhantomData<&'g ()>,
}

impl Mapped<'_> {
    /// Maps `page`, runs `f` on it, unmaps it.
    ///
    /// # Safety
    /// `page` must be a valid page that stays allocated during the call.
    pub(crate) unsafe fn with<R>(page: *mut bindings::page, f: impl FnOnce(&Mapped<'_>) -> R) -> R {
        // SAFETY: `page` is valid by the caller's contract.
        let addr = unsafe { bindings::kmap_local_page(page) }.cast::<u8>();
        // INVARIANT: mapped just now, unmapped by the drop below, after `f` returned (and
        // `f` only borrows it).
        let m = Mapped { addr, _page: PhantomData };
        f(&m)
    }

    /// The word at byte offset `off` (any alignment); `EINVAL` past the page.
    pub(crate) fn read_u32(&self, off: usize) -> Result<u32> {
        let mut w = [0u32];
        self.read_words(off, &mut w)?;
        Ok(w[0])
    }

    /// Reads `out.len()` words from byte offset `off` (any alignment); `EINVAL` past the
    /// page.
    pub(crate) fn read_words(&self, off: usize, out: &mut [u32]) -> Result {
        let n = span(off, out.len())?;
        // SAFETY: `[off, off + n)` lies inside the mapped page (checked; type invariant),
        // and `out` is `n` bytes of our own memory, distinct from the page. The device's
        // memory may be written by another launch at the same time (as on real hardware);
        // a raw copy of plain integers is what a device load is.
        unsafe { core::ptr::copy_nonoverlapping(self.addr.add(off), out.as_mut_ptr().cast::<u8>(), n) };
        Ok(())
    }

    /// Calls `f` on each of the `words` words from byte offset `off` (any alignment), in
    /// order, as a device's compute unit streams them from its memory: no copy in between.
    /// `EINVAL` past the page.
    pub(crate) fn each_word(&self, off: usize, words: usize, mut f: impl FnMut(u32)) -> Result {
        span(off, words)?;
        // Four words per load where it can (the loop's own instructions cost as much as the
        // computation under TCG), then the rest one by one.
        let quads = words / 4;
        for q in 0..quads {
            // SAFETY: the 16 bytes at `off + 16 q` lie in the `words` words from `off`
            // (`4 q + 3 < words`), inside the mapped page (`span`; type invariant); an
            // unaligned read of plain integers, as in `read_words` (another launch may write
            // the page meanwhile, as on hardware).
            let w = unsafe { core::ptr::read_unaligned(self.addr.add(off + 16 * q).cast::<[u32; 4]>()) };
            // (Four calls, not a loop over `w`: the compiler keeps these in registers.)
            f(w[0]);
            f(w[1]);
            f(w[2]);
            f(w[3]);
        }
        for k in 4 * quads..words {
            // SAFETY: as above, for the word `k < words`.
            let w = unsafe { core::ptr::read_unaligned(self.addr.add(off + 4 * k).cast::<u32>()) };
            f(w);
        }
        Ok(())
    }

    /// Writes the words of `src` at byte offset `off` (any alignment); `EINVAL` past the
    /// page.
    pub(crate) fn write_words(&self, off: usize, src: &[u32]) -> Result {
        let n = span(off, src.len())?;
        // SAFETY: as in `read_words`; the caller's page-table entry allows writes.
        unsafe { core::ptr::copy_nonoverlapping(src.as_ptr().cast::<u8>(), self.addr.add(off), n) };
        Ok(())
    }

    /// Stores `v` at byte offset `off` (any alignment); `EINVAL` past the page.
    pub(crate) fn write_u32(&self, off: usize, v: u32) -> Result {
        self.write_words(off, &[v])
    }
}

/// The bytes of `words` words from byte offset `off` of a page, if they lie inside it
/// (`EINVAL` otherwise).
fn span(off: usize, words: usize) -> Result<usize> {
    let n = words.checked_mul(4).ok_or(EINVAL)?;
    if off.checked_add(n).is_none_or(|e| e > PAGE_SIZE) {
        return Err(EINVAL);
    }
    Ok(n)
}

impl Drop for Mapped<'_> {
    fn drop(&mut self) {
        // SAFETY: `addr` came from `kmap_local_page` (type invariant).
        unsafe { bindings::kunmap_local(self.addr.cast()) };
    }
}

/// Copies one page.
///
/// # Safety
/// Both pages must be valid and stay allocated during the call; they must differ.
unsafe fn copy_page(dst: *mut bindings::page, src: *mut bindings::page) {
    // SAFETY: valid pages by the caller's contract (both calls).
    unsafe {
        Mapped::with(src, |s| {
            Mapped::with(dst, |d| {
                // SAFETY: both mappings cover PAGE_SIZE bytes of distinct pages.
                core::ptr::copy_nonoverlapping(s.addr, d.addr, PAGE_SIZE)
            })
        })
    }
}

/// Zero-fills one page.
///
/// # Safety
/// `page` must be valid and stay allocated during the call.
unsafe fn zero_page(page: *mut bindings::page) {
    // SAFETY: valid page by the caller's contract; the mapping covers PAGE_SIZE bytes.
    unsafe { Mapped::with(page, |m| core::ptr::write_bytes(m.addr, 0, PAGE_SIZE)) }
}

/// The device memory pool: `frames.len()` pages, indexed by frame number.
pub(crate) struct Pool {
    frames: KVVec<Page>,
}

impl Pool {
    pub(crate) fn new(nframes: usize) -> Result<Pool> {
        let mut frames = KVVec::with_capacity(nframes, GFP_KERNEL)?;
        for _ in 0..nframes {
            frames.push(Page::alloc_page(GFP_KERNEL | __GFP_ZERO)?, GFP_KERNEL)?;
        }
        Ok(Pool { frames })
    }

    pub(crate) fn len(&self) -> usize {
        self.frames.len()
    }

    /// The page behind frame `f`, if it exists. It stays allocated as long as the pool.
    pub(crate) fn frame(&self, f: u64) -> Option<*mut bindings::page> {
        self.frames.get(usize::try_from(f).ok()?).map(|p| p.as_ptr())
    }

    /// Frame `f` as a page the CPU can map (`Driver::frame_page`).
    pub(crate) fn frame_ref(&self, f: u64) -> Option<&Page> {
        self.frames.get(usize::try_from(f).ok()?)
    }

    /// Copies `src` into frame `f`. `EINVAL` for a frame outside the pool.
    pub(crate) fn upload(&self, f: u64, src: gmem::HostPage) -> Result {
        let dst = self.frame(f).ok_or(EINVAL)?;
        // SAFETY: the frame is a page of this pool; gmem keeps the host page allocated for
        // the copy call (`HostPage`'s invariant); a host page is never one of our frames.
        unsafe { copy_page(dst, src.as_ptr()) };
        Ok(())
    }

    /// Copies frame `f` into `dst`. `EINVAL` for a frame outside the pool.
    pub(crate) fn download(&self, f: u64, dst: gmem::HostPage) -> Result {
        let src = self.frame(f).ok_or(EINVAL)?;
        // SAFETY: as in `upload`.
        unsafe { copy_page(dst.as_ptr(), src) };
        Ok(())
    }

    /// Copies frame `f` into frame `pf` of `peer` (another device's pool).
    pub(crate) fn to_peer(&self, f: u64, peer: &Pool, pf: u64) -> Result {
        let (src, dst) = (self.frame(f).ok_or(EINVAL)?, peer.frame(pf).ok_or(EINVAL)?);
        if core::ptr::eq(self, peer) && f == pf {
            return Err(EINVAL);
        }
        // SAFETY: both are pages of live pools, and distinct (checked above).
        unsafe { copy_page(dst, src) };
        Ok(())
    }

    /// Zero-fills frame `f`.
    pub(crate) fn zero(&self, f: u64) -> Result {
        let p = self.frame(f).ok_or(EINVAL)?;
        // SAFETY: a page of this pool.
        unsafe { zero_page(p) };
        Ok(())
    }
}
