// SPDX-License-Identifier: GPL-2.0
//! Host pages that back GMEM memory.
//!
//! Allocated by `gmem_host_page_alloc()` (gmem_export.c) with
//! `GFP_HIGHUSER | __GFP_ACCOUNT | __GFP_RETRY_MAYFAIL | __GFP_ZERO`: charged to the memory
//! cgroup of the process whose data the page holds (the space's `mm`, not whichever task
//! happens to allocate: an evicting fault of another process, a worker, an unregistering
//! driver), and allowed to fail instead of invoking the OOM killer. When the host (or the cgroup) is out of memory, the access that needed the
//! page fails cleanly — SIGBUS for a CPU fault, ENOMEM for a device kernel — and nothing
//! else is touched. (The Rust `Flags` of 7.3 cannot express `__GFP_RETRY_MAYFAIL`, hence C.)

use core::ptr::NonNull;
use kernel::{bindings, prelude::*};

extern "C" {
    /// Returns a `struct page *` (declared as `void *`: bindgen's `page` is not FFI-clean).
    fn gmem_host_page_alloc(mm: *mut core::ffi::c_void, zero: bool) -> *mut core::ffi::c_void;
}

/// An order-0 host page owned by a region (zeroed, or fully written before any use).
///
/// # Invariants
/// `self.0` was returned by `gmem_host_page_alloc` and is freed exactly once, by `Drop`.
/// `repr(transparent)` makes `Option<HostPage>` use the null niche (all zero bytes are
/// `None`), which `meta.rs` relies on for zero-filled arrays of host pages.
#[repr(transparent)]
pub(crate) struct HostPage(NonNull<bindings::page>);

// SAFETY: a page can be freed and accessed from any thread; ownership is unique.
unsafe impl Send for HostPage {}
// SAFETY: `HostPage` has no interior mutability; the data is accessed through raw mappings
// under the block lock.
unsafe impl Sync for HostPage {}

impl HostPage {
    /// A new page for data of `mm`'s process, charged to its memory cgroup, zeroed unless
    /// the caller is about to overwrite all of it (a D2H copy); or `ENOMEM` (host or memory
    /// cgroup limit).
    pub(crate) fn alloc(mm: &kernel::mm::Mm, zero: bool) -> Result<HostPage> {
        if crate::obj::tune::host_alloc_fails() {
            return Err(ENOMEM);
        }
        // SAFETY: plain allocation call, process or worker context; `mm` is a live mm (the
        // reference keeps it allocated for the call).
        let p = unsafe { gmem_host_page_alloc(mm.as_raw().cast(), zero) }.cast::<bindings::page>();
        // INVARIANT: from `gmem_host_page_alloc`.
        NonNull::new(p).map(HostPage).ok_or(ENOMEM)
    }

    pub(crate) fn as_ptr(&self) -> *mut bindings::page {
        self.0.as_ptr()
    }

    /// Fills the page with zeros.
    pub(crate) fn zero(&self) {
        let m = self.map();
        // SAFETY: the mapping covers one page.
        unsafe { core::ptr::write_bytes(m.ptr(), 0, kernel::page::PAGE_SIZE) };
    }

    /// The page mapped into the kernel's address space while the guard lives.
    pub(crate) fn map(&self) -> Mapped<'_> {
        // SAFETY: the page is valid (invariant) and outlives the guard (borrow).
        let addr = unsafe { bindings::kmap_local_page(self.as_ptr()) }.cast::<u8>();
        // INVARIANT: from `kmap_local_page` of a page the guard borrows.
        Mapped { addr, _page: core::marker::PhantomData }
    }
}

/// A local kernel mapping of a [`HostPage`].
///
/// # Invariants
/// `addr` is `kmap_local_page` of the borrowed page; guards are locals, dropped in reverse
/// order of creation, as kmap_local requires.
pub(crate) struct Mapped<'a> {
    addr: *mut u8,
    _page: core::marker::PhantomData<&'a HostPage>,
}

impl Mapped<'_> {
    /// Start of the page's `PAGE_SIZE` bytes.
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.addr
    }
}

impl Drop for Mapped<'_> {
    fn drop(&mut self) {
        // SAFETY: `addr` came from `kmap_local_page` (invariant).
        unsafe { bindings::kunmap_local(self.addr.cast()) };
    }
}

impl Drop for HostPage {
    fn drop(&mut self) {
        // SAFETY: allocated as order 0 by `gmem_host_page_alloc`, freed once (invariant).
        unsafe { bindings::__free_pages(self.as_ptr(), 0) };
    }
}
