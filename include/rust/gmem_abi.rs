// SPDX-License-Identifier: GPL-2.0
//! Rust mirror of `include/linux/gmem.h`, the C driver ABI of gmem.ko.
//!
//! Shared (by `#[path]`) by gmem.ko and the Rust drivers. gmem.ko checks at load time that
//! every size and offset here equals the C compiler's (see `gmem/entry/layout.rs`).
#![allow(dead_code, unreachable_pub)]

use kernel::bindings;
use kernel::ffi::{c_char, c_int, c_void};

pub const GMEM_DRIVER_ABI_VERSION: u32 = 8;
pub const GMEM_ACCESS_READ: u32 = 1;
pub const GMEM_ACCESS_WRITE: u32 = 2;
pub const GMEM_PROT_READ: u32 = 1;
pub const GMEM_PROT_WRITE: u32 = 2;
pub const GMEM_COPY_H2D: u32 = 0;
pub const GMEM_COPY_D2H: u32 = 1;
pub const GMEM_COPY_D2D: u32 = 2;
pub const GMEM_COPY_ZERO: u32 = 3;
pub const GMEM_PTE_2M: u32 = 1;
/// `GMEM_PTE_SYSMEM`: a remote entry of ordinary process memory, mapped under gmem's
/// MMU-notifier lock (the driver's `map` must not allocate with reclaim for it).
pub const GMEM_PTE_SYSMEM: u32 = 2;
pub const GMEM_DEV_CAP_MAP_2M: u32 = 1;
pub const GMEM_MAX_CHANNELS: u32 = 16;

/// Opaque handle of a registered device (really `gmem::device::Device`).
#[repr(C)]
pub struct GmemDevHandle {
    _private: [u8; 0],
}

/// Opaque handle of an address space (really `gmem::space::Space`).
#[repr(C)]
pub struct GmemSpaceHandle {
    _private: [u8; 0],
}

/// Opaque fence of an asynchronous copy (really `gmem::fence::Fence`).
#[repr(C)]
pub struct GmemFenceHandle {
    _private: [u8; 0],
}

/// `struct gmem_pte`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct GmemPte {
    pub va: u64,
    pub frame: u64,
    pub host: *mut bindings::page,
    pub prot: u32,
    pub flags: u32,
}

/// `struct gmem_copy`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct GmemCopy {
    pub host: *mut bindings::page,
    pub frame: u64,
    pub peer_frame: u64,
}

/// `struct gmem_dev_ops`.
#[repr(C)]
pub struct GmemDevOps {
    pub ctx_create: Option<unsafe extern "C" fn(drv: *mut c_void, ctx: *mut *mut c_void) -> c_int>,
    pub ctx_destroy: Option<unsafe extern "C" fn(drv: *mut c_void, ctx: *mut c_void)>,
    pub map: Option<unsafe extern "C" fn(drv: *mut c_void, ctx: *mut c_void, ptes: *const GmemPte, n: u32) -> c_int>,
    pub unmap: Option<unsafe extern "C" fn(drv: *mut c_void, ctx: *mut c_void, va: u64, npages: u64)>,
    pub tlb_invalidate: Option<unsafe extern "C" fn(drv: *mut c_void, ctx: *mut c_void, va: u64, npages: u64)>,
    pub copy: Option<
        unsafe extern "C" fn(drv: *mut c_void, dir: u32, c: *const GmemCopy, n: u32, peer_drv: *mut c_void) -> c_int,
    >,
    pub frame_page: Option<unsafe extern "C" fn(drv: *mut c_void, frame: u64) -> *mut bindings::page>,
    pub test_clear_accessed: Option<unsafe extern "C" fn(drv: *mut c_void, ctx: *mut c_void, va: u64) -> c_int>,
    pub copy_async: Option<
        unsafe extern "C" fn(
            drv: *mut c_void,
            chan: u32,
            dir: u32,
            c: *const GmemCopy,
            n: u32,
            peer_drv: *mut c_void,
            fence: *mut GmemFenceHandle,
        ) -> c_int,
    >,
    pub map_prepare: Option<unsafe extern "C" fn(drv: *mut c_void, ctx: *mut c_void, va: u64, npages: u64) -> c_int>,
    pub test_clear_accessed_range:
        Option<unsafe extern "C" fn(drv: *mut c_void, ctx: *mut c_void, va: u64, npages: u32, bits: *mut u64) -> c_int>,
    pub copy_poll: Option<unsafe extern "C" fn(drv: *mut c_void, chan: u32)>,
}

/// `struct gmem_dev_props`.
#[repr(C)]
pub struct GmemDevProps {
    pub size: u32,
    pub abi_version: u32,
    pub name: *const c_char,
    pub nr_frames: u64,
    pub drv: *mut c_void,
    pub caps: u32,
    pub nr_channels: u32,
}

/// Sizes and offsets of the structs above, in the order `gmem_c_abi_layout[]` lists them.
pub const ABI_LAYOUT: [usize; 17] = [
    core::mem::size_of::<GmemPte>(),
    core::mem::offset_of!(GmemPte, prot),
    core::mem::size_of::<GmemCopy>(),
    core::mem::offset_of!(GmemCopy, peer_frame),
    core::mem::size_of::<GmemDevOps>(),
    core::mem::offset_of!(GmemDevOps, copy),
    core::mem::offset_of!(GmemDevOps, frame_page),
    core::mem::offset_of!(GmemDevOps, test_clear_accessed),
    core::mem::size_of::<GmemDevProps>(),
    core::mem::offset_of!(GmemDevProps, drv),
    core::mem::offset_of!(GmemDevProps, caps),
    core::mem::offset_of!(GmemPte, flags),
    core::mem::offset_of!(GmemDevOps, copy_async),
    core::mem::offset_of!(GmemDevProps, nr_channels),
    core::mem::offset_of!(GmemDevOps, map_prepare),
    core::mem::offset_of!(GmemDevOps, test_clear_accessed_range),
    core::mem::offset_of!(GmemDevOps, copy_poll),
];
