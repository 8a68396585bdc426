// SPDX-License-Identifier: GPL-2.0
//! gmem_sim: a simulated accelerator that plugs into gmem.ko exactly as a real driver would,
//! through the C driver ABI of `include/linux/gmem.h`.

use kernel::{
    faux,
    ffi::{c_int, c_void},
    prelude::*,
};

#[path = "../include/rust/gmem_abi.rs"]
mod abi;
use abi::*;

extern "C" {
    fn gmem_dev_register(ops: *const GmemDevOps, props: *const GmemDevProps) -> *mut GmemDevHandle;
    fn gmem_dev_unregister(dev: *mut GmemDevHandle);
    fn gmem_dev_id(dev: *const GmemDevHandle) -> c_int;
}

module! {
    type: SimModule,
    name: "gmem_sim",
    authors: ["GMEM developers"],
    description: "Simulated accelerator for GMEM",
    license: "GPL",
    params: {
        nr_devices: u32 {
            default: 1,
            description: "Number of simulated devices",
        },
        mem_mib: u32 {
            default: 64,
            description: "Device memory per device, MiB",
        },
    },
}

unsafe extern "C" fn ctx_create(_drv: *mut c_void, ctx: *mut *mut c_void) -> c_int {
    // SAFETY: gmem passes a valid out-pointer.
    unsafe { *ctx = core::ptr::null_mut() };
    0
}
unsafe extern "C" fn ctx_destroy(_drv: *mut c_void, _ctx: *mut c_void) {}
unsafe extern "C" fn map(_d: *mut c_void, _c: *mut c_void, _p: *const GmemPte, _n: u32) -> c_int {
    -(kernel::bindings::EOPNOTSUPP as c_int)
}
unsafe extern "C" fn unmap(_d: *mut c_void, _c: *mut c_void, _va: u64, _n: u64) {}
unsafe extern "C" fn tlb(_d: *mut c_void, _c: *mut c_void, _va: u64, _n: u64) {}
unsafe extern "C" fn copy(_d: *mut c_void, _dir: u32, _c: *const GmemCopy, _n: u32, _p: *mut c_void) -> c_int {
    -(kernel::bindings::EOPNOTSUPP as c_int)
}

static OPS: GmemDevOps = GmemDevOps {
    ctx_create: Some(ctx_create),
    ctx_destroy: Some(ctx_destroy),
    map: Some(map),
    unmap: Some(unmap),
    tlb_invalidate: Some(tlb),
    copy: Some(copy),
    frame_page: None,
};

struct SimModule {
    _faux: faux::Registration,
    handle: *mut GmemDevHandle,
}

// SAFETY: the handle is only used at module exit.
unsafe impl Send for SimModule {}
// SAFETY: as above.
unsafe impl Sync for SimModule {}

impl kernel::Module for SimModule {
    fn init(_module: &'static ThisModule) -> Result<Self> {
        let faux = faux::Registration::new(c"gmem_sim", None)?;
        let frames = u64::from(module_parameters::mem_mib.value()) * 256;
        let props = GmemDevProps {
            size: core::mem::size_of::<GmemDevProps>() as u32,
            abi_version: GMEM_DRIVER_ABI_VERSION,
            name: c"gmem_sim".as_char_ptr(),
            nr_frames: frames,
            drv: core::ptr::null_mut(),
        };
        // SAFETY: `OPS` is static; `props` is valid for the call.
        let handle = unsafe { gmem_dev_register(&OPS, &props) };
        let handle = kernel::error::from_err_ptr(handle)?;
        // SAFETY: `handle` is a live registration.
        let id = unsafe { gmem_dev_id(handle) };
        pr_info!("gmem_sim: device {} with {} MiB ({} devices requested)\n", id, module_parameters::mem_mib.value(), module_parameters::nr_devices.value());
        Ok(Self { _faux: faux, handle })
    }
}

impl Drop for SimModule {
    fn drop(&mut self) {
        // SAFETY: registered in init, unregistered exactly once here.
        unsafe { gmem_dev_unregister(self.handle) };
    }
}
