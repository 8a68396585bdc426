// SPDX-License-Identifier: GPL-2.0
//! Device registry: accelerator drivers register and unregister here through the C ABI of
//! `include/linux/gmem.h` (exported by gmem_export.c).
//!
//! Lock order: `REGISTRY` is a leaf lock; no driver callback runs under it.

use crate::abi::{GmemDevHandle, GmemDevOps, GmemDevProps, GmemSpaceHandle, GMEM_DRIVER_ABI_VERSION};
use kernel::{
    ffi::{c_int, c_void},
    prelude::*,
    sync::{global_lock, Arc},
};

/// Most devices registered at once (device ids are `0..MAX_DEVICES`).
pub(crate) const MAX_DEVICES: usize = 16;

/// A registered device.
///
/// # Invariants
/// `ops` points to the driver's ops table, which the driver keeps alive and unchanged until
/// `gmem_dev_unregister` returns; `drv` is the driver's opaque pointer from its props.
pub(crate) struct Device {
    pub(crate) id: usize,
    pub(crate) nr_frames: u64,
    ops: *const GmemDevOps,
    drv: *mut c_void,
}

// SAFETY: the ops table is immutable and its callbacks may be called from any thread (driver
// API contract); `drv` is only passed back to those callbacks.
unsafe impl Send for Device {}
// SAFETY: as above; `Device` has no interior mutability of its own.
unsafe impl Sync for Device {}

struct Registry {
    devices: [Option<Arc<Device>>; MAX_DEVICES],
}

global_lock! {
    // SAFETY: initialised in module init before any use (`init`), see `GmemModule::init`.
    unsafe(uninit) static REGISTRY: Mutex<Registry> = Registry { devices: [const { None }; MAX_DEVICES] };
}

/// Must be called once at module load, before the C ABI can be reached.
pub(crate) fn init() {
    // SAFETY: called exactly once from module init.
    unsafe { REGISTRY.init() };
}

/// Number of registered devices.
pub(crate) fn count() -> usize {
    REGISTRY.lock().devices.iter().filter(|d| d.is_some()).count()
}

/// Picks the lowest free id and stores the device; `EBUSY` when all ids are taken.
fn insert(ops: *const GmemDevOps, drv: *mut c_void, nr_frames: u64) -> Result<Arc<Device>> {
    let mut reg = REGISTRY.lock();
    let id = reg.devices.iter().position(|d| d.is_none()).ok_or(EBUSY)?;
    let dev = Arc::new(Device { id, nr_frames, ops, drv }, GFP_KERNEL)?;
    reg.devices[id] = Some(dev.clone());
    Ok(dev)
}

fn remove(id: usize) -> Option<Arc<Device>> {
    REGISTRY.lock().devices.get_mut(id)?.take()
}

/// Validates the driver's tables (mandatory ops present, ABI version and sizes known).
///
/// # Safety
/// `ops` and `props` must be null or valid for reads.
unsafe fn validate(ops: *const GmemDevOps, props: *const GmemDevProps) -> Result<(u64, *mut c_void)> {
    if ops.is_null() || props.is_null() {
        return Err(EINVAL);
    }
    // SAFETY: non-null and valid for reads by the caller's contract.
    let (o, p) = unsafe { (&*ops, &*props) };
    if p.abi_version != GMEM_DRIVER_ABI_VERSION || p.size as usize != core::mem::size_of::<GmemDevProps>() {
        return Err(EINVAL);
    }
    let complete = o.ctx_create.is_some()
        && o.ctx_destroy.is_some()
        && o.map.is_some()
        && o.unmap.is_some()
        && o.tlb_invalidate.is_some()
        && o.copy.is_some();
    if !complete || p.nr_frames == 0 {
        return Err(EINVAL);
    }
    Ok((p.nr_frames, p.drv))
}

/// `gmem_dev_register()` of the C ABI.
///
/// # Safety
/// `ops` and `props` must be null or valid; `ops` must stay valid until unregister.
#[no_mangle]
pub(crate) unsafe extern "C" fn gmem_dev_register(
    ops: *const GmemDevOps,
    props: *const GmemDevProps,
) -> *mut GmemDevHandle {
    // SAFETY: forwarded caller contract.
    let r = unsafe { validate(ops, props) }.and_then(|(nr, drv)| insert(ops, drv, nr));
    match r {
        Ok(dev) => {
            pr_info!("gmem: device {} registered ({} frames)\n", dev.id, dev.nr_frames);
            Arc::into_raw(dev).cast_mut().cast()
        }
        Err(e) => e.to_ptr(),
    }
}

/// `gmem_dev_unregister()` of the C ABI.
///
/// # Safety
/// `dev` must be a handle returned by `gmem_dev_register` and not yet unregistered.
#[no_mangle]
pub(crate) unsafe extern "C" fn gmem_dev_unregister(dev: *mut GmemDevHandle) {
    // SAFETY: by the caller's contract the handle came from `Arc::into_raw` in register and
    // this is the one call that gives that reference back.
    let dev = unsafe { Arc::<Device>::from_raw(dev.cast::<Device>().cast_const()) };
    let id = dev.id;
    drop(remove(id));
    pr_info!("gmem: device {} unregistered\n", id);
}

/// `gmem_dev_id()` of the C ABI.
///
/// # Safety
/// `dev` must be a live handle from `gmem_dev_register`.
#[no_mangle]
pub(crate) unsafe extern "C" fn gmem_dev_id(dev: *const GmemDevHandle) -> c_int {
    // SAFETY: a live handle points to a `Device` kept alive by the registry's reference.
    unsafe { (*dev.cast::<Device>()).id as c_int }
}

/// `gmem_space_get_current()` of the C ABI.
#[no_mangle]
pub(crate) extern "C" fn gmem_space_get_current() -> *mut GmemSpaceHandle {
    ENOENT.to_ptr()
}

/// `gmem_space_put()` of the C ABI.
#[no_mangle]
pub(crate) extern "C" fn gmem_space_put(_space: *mut GmemSpaceHandle) {}

/// `gmem_dev_fault()` of the C ABI.
#[no_mangle]
pub(crate) extern "C" fn gmem_dev_fault(
    _dev: *mut GmemDevHandle,
    _space: *mut GmemSpaceHandle,
    _addrs: *const u64,
    _n: u32,
    _access: u32,
) -> c_int {
    EFAULT.to_errno()
}

#[kunit_tests(gmem_registry)]
mod tests {
    use super::*;

    #[test]
    fn register_rejects_null_and_incomplete_tables() {
        // SAFETY: null pointers are allowed by `validate`'s contract.
        assert_eq!(unsafe { validate(core::ptr::null(), core::ptr::null()) }.err(), Some(EINVAL));
        let ops = GmemDevOps {
            ctx_create: None,
            ctx_destroy: None,
            map: None,
            unmap: None,
            tlb_invalidate: None,
            copy: None,
            frame_page: None,
        };
        let props = GmemDevProps {
            size: core::mem::size_of::<GmemDevProps>() as u32,
            abi_version: GMEM_DRIVER_ABI_VERSION,
            name: core::ptr::null(),
            nr_frames: 16,
            drv: core::ptr::null_mut(),
        };
        // SAFETY: both point to live locals.
        assert_eq!(unsafe { validate(&ops, &props) }.err(), Some(EINVAL));
    }

    #[test]
    fn ids_are_reused_lowest_first() {
        let before = count();
        let a = insert(core::ptr::null(), core::ptr::null_mut(), 1).expect("insert a");
        let b = insert(core::ptr::null(), core::ptr::null_mut(), 1).expect("insert b");
        assert_ne!(a.id, b.id);
        assert_eq!(count(), before + 2);
        let freed = a.id;
        drop(remove(a.id));
        let c = insert(core::ptr::null(), core::ptr::null_mut(), 1).expect("insert c");
        assert_eq!(c.id, freed);
        drop(remove(b.id));
        drop(remove(c.id));
        assert_eq!(count(), before);
    }
}
