// SPDX-License-Identifier: GPL-2.0
//! The simulated device's memory: a pool of frames (real pages owned by the driver), the
//! copy engine that moves pages between host and frames, and a scoped CPU mapping of a page.

use kernel::{bindings, page::Page, prelude::*};

pub(crate) const PAGE_SIZE: usize = 4096;

/// A page mapped into the kernel's address space for the guard's lifetime.
///
/// # Invariants
/// `addr` is `kmap_local_page(page)` of a page that stays allocated while the guard lives;
/// guards are dropped in reverse order of creation (they are locals), as kmap_local needs.
pub(crate) struct Mapped {
    addr: *mut u8,
}

impl Mapped {
    /// # Safety
    /// `page` must be a valid page that stays allocated while the guard lives.
    pub(crate) unsafe fn new(page: *mut bindings::page) -> Mapped {
        // SAFETY: `page` is valid by the caller's contract.
        let addr = unsafe { bindings::kmap_local_page(page) }.cast::<u8>();
        Mapped { addr }
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        self.addr
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: `addr` came from `kmap_local_page` (type invariant).
        unsafe { bindings::kunmap_local(self.addr.cast()) };
    }
}

/// Copies one page.
///
/// # Safety
/// Both pages must be valid and stay allocated during the call; they must differ.
pub(crate) unsafe fn copy_page(dst: *mut bindings::page, src: *mut bindings::page) {
    // SAFETY: valid pages by the caller's contract.
    let (s, d) = unsafe { (Mapped::new(src), Mapped::new(dst)) };
    // SAFETY: both mappings cover PAGE_SIZE bytes of distinct pages.
    unsafe { core::ptr::copy_nonoverlapping(s.ptr(), d.ptr(), PAGE_SIZE) };
}

/// Zero-fills one page.
///
/// # Safety
/// `page` must be valid and stay allocated during the call.
pub(crate) unsafe fn zero_page(page: *mut bindings::page) {
    // SAFETY: valid page by the caller's contract.
    let m = unsafe { Mapped::new(page) };
    // SAFETY: the mapping covers PAGE_SIZE bytes.
    unsafe { core::ptr::write_bytes(m.ptr(), 0, PAGE_SIZE) };
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

    /// The page behind frame `f`, if it exists.
    pub(crate) fn frame(&self, f: u64) -> Option<*mut bindings::page> {
        self.frames.get(usize::try_from(f).ok()?).map(|p| p.as_ptr())
    }
}
