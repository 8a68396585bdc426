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
unsafe impl ZeroIsEmpty for Option<crate::host_page::HostPage> {}

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

/// Pages per metadata block: one 2 MiB block of 4 KiB pages.
pub(crate) const BLOCK_PAGES: usize = 512;
/// Blocks per directory leaf (a leaf covers 128 MiB and costs 512 bytes once touched; a
/// 1 TiB region has 8,192 directory slots of 24 bytes).
const LEAF_BLOCKS: usize = 64;

/// The metadata of one block's pages: exactly 16 bytes per page (the last block of a
/// region may be shorter than [`BLOCK_PAGES`]).
struct Block {
    state: Meta<u32>,
    frame: Meta<u32>,
    host: Meta<Option<crate::host_page::HostPage>>,
}

impl Block {
    fn new(pages: usize) -> Result<KBox<Block>> {
        let b = Block { state: Meta::zeroed(pages)?, frame: Meta::zeroed(pages)?, host: Meta::zeroed(pages)? };
        Ok(KBox::new(b, GFP_KERNEL_ACCOUNT)?)
    }
}

/// A directory leaf: the blocks of 128 MiB of the region, `None` until touched.
type Leaf = KVVec<Option<KBox<Block>>>;

/// Per-page metadata of a region, allocated block by block on first touch ("lazy"): an
/// untouched region costs one directory slot per 128 MiB (24 bytes), a touched 128 MiB
/// adds a 512-byte leaf, and a touched block its 16 bytes per page. Pages of untouched blocks read as
/// empty (state 0 = `PageState::EMPTY`, frame 0, no host page).
///
/// Writers first make the page's block exist with [`PageMeta::ensure`] (which can fail);
/// the setters then cannot fail.
pub(crate) struct PageMeta {
    npages: usize,
    dir: KVVec<Option<Leaf>>,
}

impl PageMeta {
    /// The directory of an untouched region of `npages` pages.
    pub(crate) fn new(npages: usize) -> Result<Self> {
        let blocks = npages.div_ceil(BLOCK_PAGES);
        let leaves = blocks.div_ceil(LEAF_BLOCKS);
        let mut dir = KVVec::with_capacity(leaves, GFP_KERNEL_ACCOUNT)?;
        for _ in 0..leaves {
            dir.push(None, GFP_KERNEL_ACCOUNT)?;
        }
        Ok(PageMeta { npages, dir })
    }

    fn block(&self, i: usize) -> Option<&Block> {
        let b = i / BLOCK_PAGES;
        self.dir.get(b / LEAF_BLOCKS)?.as_ref()?.get(b % LEAF_BLOCKS)?.as_deref()
    }

    fn block_mut(&mut self, i: usize) -> Option<&mut Block> {
        let b = i / BLOCK_PAGES;
        self.dir.get_mut(b / LEAF_BLOCKS)?.as_mut()?.get_mut(b % LEAF_BLOCKS)?.as_deref_mut()
    }

    /// Makes the block of page `i` exist (`ENOMEM` if it cannot; `EINVAL` past the end).
    pub(crate) fn ensure(&mut self, i: usize) -> Result {
        if i >= self.npages {
            return Err(EINVAL);
        }
        if self.block(i).is_some() {
            return Ok(());
        }
        let b = i / BLOCK_PAGES;
        let (l, k) = (b / LEAF_BLOCKS, b % LEAF_BLOCKS);
        let blocks = self.npages.div_ceil(BLOCK_PAGES);
        let slot = self.dir.get_mut(l).ok_or(EINVAL)?;
        if slot.is_none() {
            let n = core::cmp::min(LEAF_BLOCKS, blocks - l * LEAF_BLOCKS);
            let mut leaf = KVVec::with_capacity(n, GFP_KERNEL_ACCOUNT)?;
            for _ in 0..n {
                leaf.push(None, GFP_KERNEL_ACCOUNT)?;
            }
            *slot = Some(leaf);
        }
        let pages = core::cmp::min(BLOCK_PAGES, self.npages - b * BLOCK_PAGES);
        let block = Block::new(pages)?;
        let entry = slot.as_mut().and_then(|leaf| leaf.get_mut(k)).ok_or(EINVAL)?;
        *entry = Some(block);
        Ok(())
    }

    pub(crate) fn state(&self, i: usize) -> u32 {
        self.block(i).and_then(|b| b.state.get(i % BLOCK_PAGES)).copied().unwrap_or(0)
    }

    pub(crate) fn frame(&self, i: usize) -> u32 {
        self.block(i).and_then(|b| b.frame.get(i % BLOCK_PAGES)).copied().unwrap_or(0)
    }

    pub(crate) fn host(&self, i: usize) -> Option<&crate::host_page::HostPage> {
        self.block(i).and_then(|b| b.host.get(i % BLOCK_PAGES)?.as_ref())
    }

    /// Sets page `i`'s state; its block must exist ([`PageMeta::ensure`]), except for
    /// the empty state, which untouched blocks already have.
    pub(crate) fn set_state(&mut self, i: usize, bits: u32) {
        match self.block_mut(i).and_then(|b| b.state.get_mut(i % BLOCK_PAGES)) {
            Some(s) => *s = bits,
            None if bits == 0 => {}
            None => pr_err!("page {i}: state set in a block that was never allocated\n"),
        }
    }

    /// Sets page `i`'s owner frame (block ensured, see [`PageMeta::set_state`]).
    pub(crate) fn set_frame(&mut self, i: usize, frame: u32) {
        match self.block_mut(i).and_then(|b| b.frame.get_mut(i % BLOCK_PAGES)) {
            Some(f) => *f = frame,
            None if frame == 0 => {}
            None => pr_err!("page {i}: frame set in a block that was never allocated\n"),
        }
    }

    /// Replaces page `i`'s host page, returning the old one (block ensured, see
    /// [`PageMeta::set_state`]; without a block, a new page is handed back unused).
    pub(crate) fn set_host(
        &mut self,
        i: usize,
        page: Option<crate::host_page::HostPage>,
    ) -> Option<crate::host_page::HostPage> {
        match self.block_mut(i).and_then(|b| b.host.get_mut(i % BLOCK_PAGES)) {
            Some(h) => core::mem::replace(h, page),
            None => {
                if page.is_some() {
                    pr_err!("page {i}: host page set in a block that was never allocated\n");
                }
                page
            }
        }
    }

    /// The first page at or after `i` whose block exists (pages of untouched blocks are
    /// empty: walks over a region skip them with this).
    pub(crate) fn touched_from(&self, i: usize) -> Option<usize> {
        if i >= self.npages {
            return None;
        }
        // Below: `i < npages`, and every block starts below `npages`.
        let mut b = i / BLOCK_PAGES;
        let blocks = self.npages.div_ceil(BLOCK_PAGES);
        while b < blocks {
            let (l, k) = (b / LEAF_BLOCKS, b % LEAF_BLOCKS);
            match self.dir.get(l)? {
                None => b = (l + 1) * LEAF_BLOCKS,
                Some(leaf) if leaf.get(k)?.is_some() => return Some(core::cmp::max(i, b * BLOCK_PAGES)),
                Some(_) => b += 1,
            }
        }
        None
    }

    /// Bytes allocated (directory, leaves and blocks).
    pub(crate) fn bytes(&self) -> usize {
        let slot = core::mem::size_of::<Option<Leaf>>();
        let mut n = self.dir.len() * slot;
        for leaf in self.dir.iter().flatten() {
            n += leaf.len() * core::mem::size_of::<Option<KBox<Block>>>();
            for b in leaf.iter().flatten() {
                n += core::mem::size_of::<Block>() + b.state.bytes() + b.frame.bytes() + b.host.bytes();
            }
        }
        n
    }
}
