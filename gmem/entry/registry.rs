// SPDX-License-Identifier: GPL-2.0
//! The driver C ABI of `include/linux/gmem.h` (exported by gmem_export.c): accelerator
//! drivers register and unregister devices here, get spaces and contexts
//! (`gmem_space_*`), and report device faults (`gmem_dev_fault`). Ids are small integers,
//! lowest free first; they are what the user API calls a device.
//!
//! The table of devices itself is `obj/devices.rs` (lookups under RCU, no lock).
//!
//! Unregistration (what `gmem_dev_unregister` guarantees, Documentation/driver-api.rst):
//! 1. `kill`: nothing new is placed on the device, no context is created on it.
//! 2. Evacuate every page that involves it, in every space, to the host; passes that meet
//!    errors (host memory short) are retried with backoff, and only the last pass gives up
//!    on a page, which then becomes *lost* (holds nothing; accesses fail; counted, logged).
//!    Then unmap its entries of ordinary process memory and forget them (exec/mirror.rs).
//! 3. `quiesce`: refuse new callback sections, wait for the running ones, destroy every
//!    context of the device (also those of spaces only a driver still references). An
//!    asynchronous copy keeps the callback sections of its devices (source and peer) open
//!    until its fence is signalled, so this also waits for every copy in flight.
//! 4. Unregister the device's dmem cgroup region (waiting for its reclaim callbacks).
//! 5. Forget the id — only if no frame of the device is in use any more. Otherwise (a bug:
//!    some page was missed) the id stays reserved by the dead device forever, so that no
//!    page state can ever resolve to a new device under the old id.
//!
//! No callback of the device runs after it returns.

use crate::abi::{GmemDevHandle, GmemDevOps, GmemDevProps, GmemSpaceHandle, GMEM_ACCESS_READ, GMEM_ACCESS_WRITE};
use crate::exec::{dpriv, mirror};
use crate::mech::{evacuate, fault};
use crate::obj::device::{CDriver, Device};
use crate::obj::devices;
use crate::obj::space::{self, Space};
use crate::obj::{sched, trace};
use crate::policy::batch;
use kernel::{
    ffi::c_int,
    prelude::*,
    sync::{Arc, ArcBorrow},
};

/// Largest batch a driver may report at once.
pub(crate) const MAX_BATCH: u32 = 4096;

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
    let r = unsafe { CDriver::new(ops, props) }.and_then(|(drv, nr)| devices::insert(drv, nr));
    match r {
        Ok(dev) => {
            pr_info!("device {} registered ({} frames)\n", dev.id, dev.nr_frames);
            super::sysfs::add(dev.id);
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
    dev.kill();
    // The node goes first: no attribute reads a device that is being emptied.
    super::sysfs::remove(dev.id);
    // No migration of process memory lands on it any more (they run in placing sections,
    // begun only while it was alive)...
    dev.wait_placing();
    evacuate::evacuate_device(&dev);
    // ...so what it holds of process memory can all go back to the host now, with the
    // driver still running; then its device-private pagemap goes.
    dpriv::evacuate(&dev);
    // Its entries of ordinary process memory (nothing to save: the process owns those
    // pages) go while the driver still runs, and with them its record in each space.
    match space::all() {
        Ok(spaces) => spaces.iter().for_each(|s| mirror::forget_device(&dev, s)),
        Err(_) => pr_warn!("device {}: out of memory: process-memory entries left to ctx_destroy\n", dev.id),
    }
    let ctxs = dev.quiesce();
    // No frame is charged any more (evacuated); waits for a running reclaim callback.
    dev.dmem.unregister();
    let g = |c: &core::sync::atomic::AtomicU64| c.load(core::sync::atomic::Ordering::Relaxed);
    trace::unregister(dev.id, ctxs, g(&dev.stats.evacuated), g(&dev.stats.lost));
    let used = dev.frames_used();
    if used == 0 {
        drop(devices::remove(dev.id));
        pr_info!("device {} unregistered ({} contexts destroyed)\n", dev.id, ctxs);
    } else {
        // Some page still names this device: keep its id reserved (see the module doc).
        pr_err!("device {} unregistered with {} frames still in use; id {} stays reserved\n", dev.id, used, dev.id);
    }
}

/// `gmem_fence_signal()` of the C ABI: a driver completes an asynchronous copy.
///
/// # Safety
/// `fence` must be a fence gmem passed to `copy_async` for a copy the driver accepted and
/// has not signalled yet (the executor keeps it alive until then: `obj/fence.rs`).
#[no_mangle]
pub(crate) unsafe extern "C" fn gmem_fence_signal(fence: *mut crate::abi::GmemFenceHandle, err: c_int) {
    if fence.is_null() {
        pr_err!("gmem_fence_signal: NULL fence\n");
        kernel::warn_on!(true);
        return;
    }
    // SAFETY: a live fence by the caller's contract.
    unsafe { &*fence.cast::<crate::obj::fence::Fence>() }.signal(err);
}

/// `gmem_fence_expect()` of the C ABI: the driver says when a copy should complete.
///
/// # Safety
/// `fence` must be a fence gmem passed to `copy_async`, and the call made within that
/// `copy_async` or later but before the driver signals the fence (the executor keeps it
/// alive until it is signalled: `obj/fence.rs`).
#[no_mangle]
pub(crate) unsafe extern "C" fn gmem_fence_expect(fence: *mut crate::abi::GmemFenceHandle, ns: u64) {
    if fence.is_null() {
        return;
    }
    // SAFETY: a live fence by the caller's contract.
    unsafe { &*fence.cast::<crate::obj::fence::Fence>() }.expect(ns);
}

/// `gmem_dev_set_links()` of the C ABI: the driver reports its links' bandwidths.
///
/// # Safety
/// `dev` must be a live handle from `gmem_dev_register`.
#[no_mangle]
pub(crate) unsafe extern "C" fn gmem_dev_set_links(dev: *const GmemDevHandle, h2d: u64, d2h: u64, d2d: u64) {
    if dev.is_null() {
        pr_err!("gmem_dev_set_links: NULL device\n");
        return;
    }
    // SAFETY: a live handle points to a `Device` kept alive by the driver's reference.
    let dev = unsafe { &*dev.cast::<Device>() };
    dev.set_links(crate::policy::paths::Links { h2d, d2h, d2d });
}

/// `gmem_dev_id()` of the C ABI.
///
/// # Safety
/// `dev` must be a live handle from `gmem_dev_register`.
#[no_mangle]
pub(crate) unsafe extern "C" fn gmem_dev_id(dev: *const GmemDevHandle) -> c_int {
    // SAFETY: a live handle points to a `Device` kept alive by the driver's reference.
    unsafe { (*dev.cast::<Device>()).id as c_int }
}

/// `gmem_space_get_current()` of the C ABI.
#[no_mangle]
pub(crate) extern "C" fn gmem_space_get_current() -> *mut GmemSpaceHandle {
    match space::current() {
        Some(s) => Arc::into_raw(s).cast_mut().cast(),
        None => ENOENT.to_ptr(),
    }
}

/// `gmem_space_put()` of the C ABI.
///
/// # Safety
/// `space` must be a reference obtained from `gmem_space_get_current`, put once.
#[no_mangle]
pub(crate) unsafe extern "C" fn gmem_space_put(space: *mut GmemSpaceHandle) {
    if space.is_null() || kernel::error::from_err_ptr(space).is_err() {
        return;
    }
    // SAFETY: the handle came from `Arc::into_raw` in `gmem_space_get_current`, and the
    // caller gives this reference back exactly once.
    drop(unsafe { Arc::<Space>::from_raw(space.cast::<Space>().cast_const()) });
}

/// Borrows the space behind a C handle.
///
/// # Safety
/// `space` must be a live reference from `gmem_space_get_current`.
pub(crate) unsafe fn from_handle<'a>(space: *mut GmemSpaceHandle) -> &'a Space {
    // SAFETY: by the caller's contract the handle is a live `Arc<Space>` reference.
    unsafe { &*space.cast::<Space>().cast_const() }
}

/// `gmem_space_ctx()` of the C ABI.
///
/// # Safety
/// `dev` and `space` must be live handles.
#[no_mangle]
pub(crate) unsafe extern "C" fn gmem_space_ctx(
    dev: *mut crate::abi::GmemDevHandle,
    space: *mut GmemSpaceHandle,
) -> *mut kernel::ffi::c_void {
    if dev.is_null() || space.is_null() {
        return EINVAL.to_ptr();
    }
    // SAFETY: live handles by the caller's contract.
    let (dev, space) = unsafe { (device_of(dev), from_handle(space)) };
    match space.ctx(&dev) {
        Ok(c) => c.0,
        Err(e) => e.to_ptr(),
    }
}

/// Borrows the device behind a C handle as an `Arc`.
///
/// # Safety
/// `dev` must be a live handle from `gmem_dev_register`.
pub(crate) unsafe fn device_of(dev: *mut GmemDevHandle) -> Arc<Device> {
    // SAFETY: a live handle is an `Arc<Device>` reference held by the driver.
    unsafe { ArcBorrow::from_raw(dev.cast::<Device>().cast_const()) }.into()
}

/// `gmem_dev_fault()` of the C ABI.
///
/// # Safety
/// `dev` and `space` must be live handles; `addrs` must be valid for `n` reads.
#[no_mangle]
pub(crate) unsafe extern "C" fn gmem_dev_fault(
    dev: *mut GmemDevHandle,
    space: *mut GmemSpaceHandle,
    addrs: *const u64,
    n: u32,
    access: u32,
) -> c_int {
    let valid_access = access & !(GMEM_ACCESS_READ | GMEM_ACCESS_WRITE) == 0 && access != 0;
    if dev.is_null() || space.is_null() || addrs.is_null() || n == 0 || n > MAX_BATCH || !valid_access {
        return EINVAL.to_errno();
    }
    let r = (|| -> Result {
        let mut v = KVec::with_capacity(n as usize, GFP_KERNEL)?;
        // SAFETY: `addrs` is valid for `n` reads by the caller's contract.
        let src = unsafe { core::slice::from_raw_parts(addrs, n as usize) };
        v.extend_from_slice(src, GFP_KERNEL)?;
        let k = batch::coalesce(&mut v);
        // SAFETY: live handles by the caller's contract.
        let (dev, space) = unsafe { (device_of(dev), from_handle(space)) };
        let t0 = sched::now_ns();
        let r = fault::device_fault(&dev, space, &v[..k], access & GMEM_ACCESS_WRITE != 0);
        let err = r.as_ref().err().map_or(0, |e| e.to_errno());
        trace::dev_fault(dev.id, space.id, k, sched::now_ns().saturating_sub(t0), err);
        r
    })();
    match r {
        Ok(()) => 0,
        Err(e) => e.to_errno(),
    }
}

#[kunit_tests(gmem_driver_abi)]
mod tests {
    use super::*;

    #[test]
    fn dev_fault_rejects_bad_arguments() {
        let a = [0u64];
        // SAFETY: null handles are rejected before any use.
        let r = unsafe { gmem_dev_fault(core::ptr::null_mut(), core::ptr::null_mut(), a.as_ptr(), 1, 1) };
        assert_eq!(r, EINVAL.to_errno());
        // SAFETY: as above; n == 0 and bad access are rejected first too.
        let r = unsafe { gmem_dev_fault(core::ptr::null_mut(), core::ptr::null_mut(), a.as_ptr(), 0, 1) };
        assert_eq!(r, EINVAL.to_errno());
    }
}
