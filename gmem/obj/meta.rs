// SPDX-License-Identifier: GPL-2.0
//! Per-page metadata arrays of a region: one zero-filled allocation per array, sized by the
//! user (ALLOC), so it must fail cleanly: `gmem_meta_alloc()` (gmem_export.c) refuses
//! requests larger than a quarter of the memory the system has available (so that even a
//! few such requests racing each other cannot exhaust it), and otherwise uses
//! `kvcalloc` with `GFP_KERNEL_ACCOUNT | __GFP_RETRY_MAYFAIL | __GFP_NOWARN`: charged to the
//! caller's memory cgroup, never invoking the OOM killer, failing on a fatal signal
//! (vmalloc checks for one), and filled with zeros by the allocator (no per-element loop).
//! The Rust allocation flags of 7.3 cannot express `__GFP_RETRY_MAYFAIL`, hence C.

use core::ops::{Deref, DerefMut};
use core::ptr::NonNull;
use kernel::{bindings, prelude::*};

extern "C" {
    fn gmem_meta_alloc(n: usize, size: usize) -> *mut core::ffi::c_void;
}

/// Types whose all-zero bit pattern is a valid value (the "empty" one).
///
/// # Safety
/// Every byte of a value may be zero: the all-zero pattern is a valid `Self`.
pub(crate) unsafe trait ZeroIsEmpty: Sized {}

// SAFETY: zero is a valid integer.
unsafe impl ZeroIsEmpty for u32 {}
// SAFETY: `HostPage` is a `#[repr(transparent)]` wrapper of a `NonNull`, for which Rust
// guarantees that `Option<_>` uses the null niche: all zero bytes are `None`.
unsafe impl ZeroIsEmpty for Option<crate::obj::host_page::HostPage> {}

/// A fixed-length, zero-initialised array of per-page metadata.
///
/// # Invariants
/// `ptr` points to a `gmem_meta_alloc` allocation of `len` initialised elements of `T`,
/// owned by this value and freed once, by `Drop` (after dropping every element).
pub(crate) struct Meta<T: ZeroIsEmpty> {
    ptr: NonNull<T>,
    len: usize,
}

// SAFETY: `Meta` owns its elements like a `Vec`; sending it sends them.
unsafe impl<T: ZeroIsEmpty + Send> Send for Meta<T> {}
// SAFETY: shared access gives only `&[T]`.
unsafe impl<T: ZeroIsEmpty + Sync> Sync for Meta<T> {}

impl<T: ZeroIsEmpty> Meta<T> {
    /// `len` empty elements, or `ENOMEM` (too large for the memory available, over the
    /// memory cgroup's limit, or the caller was killed while allocating).
    pub(crate) fn zeroed(len: usize) -> Result<Self> {
        if len == 0 {
            return Ok(Meta { ptr: NonNull::dangling(), len: 0 });
        }
        // SAFETY: plain allocation call in process context; the helper checks `n * size`
        // for overflow (kvcalloc).
        let p = unsafe { gmem_meta_alloc(len, core::mem::size_of::<T>()) }.cast::<T>();
        let ptr = NonNull::new(p).ok_or(ENOMEM)?;
        // INVARIANT: `len` elements, zero-filled, which is a valid value by `ZeroIsEmpty`;
        // kvcalloc aligns to at least 8 bytes, enough for every `T` used here.
        Ok(Meta { ptr, len })
    }

    /// Bytes allocated.
    pub(crate) fn bytes(&self) -> usize {
        self.len * core::mem::size_of::<T>()
    }
}

impl<T: ZeroIsEmpty> Deref for Meta<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        // SAFETY: `len` initialised elements owned by `self` (type invariant).
        unsafe { core::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: ZeroIsEmpty> DerefMut for Meta<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as above, and `&mut self` gives exclusive access.
        unsafe { core::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: ZeroIsEmpty> Drop for Meta<T> {
    fn drop(&mut self) {
        if self.len == 0 {
            return;
        }
        // SAFETY: the elements are initialised and dropped once, here (type invariant).
        unsafe { core::ptr::drop_in_place(core::ptr::slice_from_raw_parts_mut(self.ptr.as_ptr(), self.len)) };
        // SAFETY: allocated by `gmem_meta_alloc` (kvcalloc), freed once.
        unsafe { bindings::kvfree(self.ptr.as_ptr().cast()) };
    }
}
