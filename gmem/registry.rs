// SPDX-License-Identifier: GPL-2.0
//! Device registry: accelerator drivers register and unregister here through the C ABI of
//! `include/linux/gmem.h` (exported by gmem_export.c). Ids are small integers, lowest free
//! first; they are what the user API calls a device.
//!
//! Lock order: `REGISTRY` is a leaf; no driver callback and no other lock under it.
//!
//! Unregistration (what `gmem_dev_unregister` guarantees, Documentation/driver-api.rst):
//! 1. `kill`: nothing new is placed on the device, no context is created on it.
//! 2. Evacuate every page that involves it, in every space, to the host; passes that meet
//!    errors (host memory short) are retried with backoff, and only the last pass gives up
//!    on a page, which then becomes *lost* (holds nothing; accesses fail; counted, logged).
//! 3. `quiesce`: refuse new callback sections, wait for the running ones, destroy every
//!    context of the device (also those of spaces only a driver still references).
//! 4. Forget the id — only if no frame of the device is in use any more. Otherwise (a bug:
//!    some page was missed) the id stays reserved by the dead device forever, so that no
//!    page state can ever resolve to a new device under the old id.
//! No callback of the device runs after it returns.

use crate::abi::{GmemDevHandle, GmemDevOps, GmemDevProps};
use crate::device::{CDriver, Device};
use crate::{migrate, space};
use kernel::{
    ffi::c_int,
    prelude::*,
    sync::{global_lock, Arc},
};

/// Most devices registered at once (device ids are `0..MAX_DEVICES`).
pub(crate) const MAX_DEVICES: usize = crate::policy::page_state::MAX_DEVICES;

struct Registry {
    devices: [Option<Arc<Device>>; MAX_DEVICES],
}

global_lock! {
    // SAFETY: initialised by `init()` in module init before any use.
    unsafe(uninit) static REGISTRY: Mutex<Registry> = Registry { devices: [const { None }; MAX_DEVICES] };
}

/// Must be called once at module load, before the C ABI can be reached.
pub(crate) fn init() {
    // SAFETY: called exactly once from module init.
    unsafe { REGISTRY.init() };
}

/// Number of registered devices (not counting one that is unregistering).
pub(crate) fn count() -> usize {
    REGISTRY.lock().devices.iter().flatten().filter(|d| d.alive()).count()
}

/// The device with id `id`.
pub(crate) fn get(id: usize) -> Option<Arc<Device>> {
    REGISTRY.lock().devices.get(id)?.clone()
}

/// Every registered device.
pub(crate) fn all() -> KVec<Arc<Device>> {
    let reg = REGISTRY.lock();
    let mut v = KVec::new();
    for d in reg.devices.iter().flatten() {
        if v.push(d.clone(), GFP_KERNEL).is_err() {
            break;
        }
    }
    v
}

/// Picks the lowest free id and stores a new device; `EBUSY` when all ids are taken.
fn insert(drv: CDriver, nr_frames: u64) -> Result<Arc<Device>> {
    let mut reg = REGISTRY.lock();
    let id = reg.devices.iter().position(|d| d.is_none()).ok_or(EBUSY)?;
    let dev = Device::new(id, drv, nr_frames)?;
    reg.devices[id] = Some(dev.clone());
    Ok(dev)
}

fn remove(id: usize) -> Option<Arc<Device>> {
    REGISTRY.lock().devices.get_mut(id)?.take()
}

/// Pauses between evacuation passes that left pages behind (host memory short): reclaim
/// and other processes' frees get time to make room before the next pass.
const EVACUATION_BACKOFF_MS: [u32; 4] = [10, 50, 200, 1000];

/// One pass over every region of every space; returns the pages still involving `dev`.
/// With `lose`, a page whose data cannot be saved becomes lost instead of staying behind.
/// Regions created after the space list was taken cannot hold anything of `dev` (it is
/// dead, and `migrate::apply` checks that under the block lock); a region that leaves its
/// space's tree during the pass was torn down completely before it left (`teardown`).
fn evacuation_pass(dev: &Device, lose: bool) -> Result<u64> {
    let spaces = space::all()?;
    let mut left = 0;
    for s in spaces.iter() {
        let (mut from, mut lost) = (0, 0);
        while let Some(r) = s.next_region(from) {
            from = r.end();
            let e = migrate::evacuate(&r, dev, lose);
            left += e.left;
            lost += e.lost;
        }
        if lost > 0 {
            pr_err!("device {}: lost {} pages of process {} (space {}): host memory exhausted\n", dev.id, lost, s.pid, s.id);
        }
    }
    Ok(left)
}

/// Moves every page involving `dev` to the host, retrying passes with backoff; the last
/// pass marks what still cannot be saved as lost.
fn evacuate(dev: &Device) {
    for (pass, ms) in EVACUATION_BACKOFF_MS.iter().enumerate() {
        match evacuation_pass(dev, false) {
            Ok(0) => return,
            Ok(left) => pr_warn!("device {}: evacuation pass {}: {} pages left, retrying\n", dev.id, pass, left),
            Err(_) => pr_warn!("device {}: evacuation pass {}: out of memory, retrying\n", dev.id, pass),
        }
        kernel::time::delay::fsleep(kernel::time::Delta::from_millis(i64::from(*ms)));
    }
    // The space list itself needs memory; keep trying (each try sleeps) rather than leave
    // pages behind unaccounted.
    while evacuation_pass(dev, true).is_err() {
        pr_warn!("device {}: cannot list spaces for the last evacuation pass, retrying\n", dev.id);
        kernel::time::delay::fsleep(kernel::time::Delta::from_millis(100));
    }
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
    let r = unsafe { CDriver::new(ops, props) }.and_then(|(drv, nr)| insert(drv, nr));
    match r {
        Ok(dev) => {
            pr_info!("device {} registered ({} frames)\n", dev.id, dev.nr_frames);
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
    evacuate(&dev);
    let ctxs = dev.quiesce();
    let used = dev.frames_used();
    if used == 0 {
        drop(remove(dev.id));
        pr_info!("device {} unregistered ({} contexts destroyed)\n", dev.id, ctxs);
    } else {
        // Some page still names this device: keep its id reserved (see the module doc).
        pr_err!("device {} unregistered with {} frames still in use; id {} stays reserved\n", dev.id, used, dev.id);
    }
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

#[kunit_tests(gmem_registry)]
mod tests {
    use super::*;
    use crate::abi::GMEM_DRIVER_ABI_VERSION;

    fn props(nr_frames: u64) -> GmemDevProps {
        GmemDevProps {
            size: core::mem::size_of::<GmemDevProps>() as u32,
            abi_version: GMEM_DRIVER_ABI_VERSION,
            name: core::ptr::null(),
            nr_frames,
            drv: core::ptr::null_mut(),
            caps: 0,
            reserved: 0,
        }
    }

    const EMPTY_OPS: GmemDevOps = GmemDevOps {
        ctx_create: None,
        ctx_destroy: None,
        map: None,
        unmap: None,
        tlb_invalidate: None,
        copy: None,
        frame_page: None,
        test_clear_accessed: None,
    };

    #[test]
    fn register_rejects_null_and_incomplete_tables() {
        // SAFETY: null pointers are allowed by `CDriver::new`'s contract.
        assert_eq!(unsafe { CDriver::new(core::ptr::null(), core::ptr::null()) }.err(), Some(EINVAL));
        let p = props(16);
        // SAFETY: both point to live locals.
        assert_eq!(unsafe { CDriver::new(&EMPTY_OPS, &p) }.err(), Some(EINVAL));
    }

    #[test]
    fn ids_are_reused_lowest_first_and_frames_are_central() {
        let before = count();
        let p = props(8);
        // SAFETY: the adapters are never called (no ops are used by `insert`/`remove`);
        // `CDriver::new` would refuse EMPTY_OPS, so build the devices via raw parts.
        let mk = || unsafe { CDriver::new(&EMPTY_OPS, &p) };
        assert!(mk().is_err());
        let a = Device::new(100, test_driver(), 8).expect("device");
        // The central frame allocator hands out every frame once, then ENOMEM.
        let mut got = KVec::new();
        for _ in 0..8 {
            got.push(a.alloc_frame().expect("frame"), GFP_KERNEL).expect("push");
        }
        assert_eq!(a.alloc_frame().err(), Some(ENOSPC));
        // Pinned and lent counts are kept as flags change, not recounted.
        a.set_flags(got[2], crate::policy::evict::F_PINNED | crate::policy::evict::F_LENT);
        a.set_flags(got[3], crate::policy::evict::F_PINNED);
        assert_eq!((a.frames_pinned(), a.frames_lent()), (2, 1));
        a.set_flags(got[3], crate::policy::evict::F_PINNED);
        assert_eq!(a.frames_pinned(), 2);
        a.free_frame(got[2]);
        assert_eq!((a.frames_pinned(), a.frames_lent()), (1, 0));
        a.free_frame(got[3]);
        assert_eq!((a.frames_pinned(), a.frames_lent()), (0, 0));
        // Next-fit from the wrapped cursor: the lower free frame first.
        assert_eq!(a.alloc_frame().ok(), Some(got[2]));
        assert_eq!(a.alloc_frame().ok(), Some(got[3]));
        assert_eq!(a.frames_used(), 8);
        let x = insert(test_driver(), 1).expect("insert x");
        let y = insert(test_driver(), 1).expect("insert y");
        assert_ne!(x.id, y.id);
        assert_eq!(count(), before + 2);
        let freed = x.id;
        drop(remove(x.id));
        let z = insert(test_driver(), 1).expect("insert z");
        assert_eq!(z.id, freed);
        drop(remove(y.id));
        drop(remove(z.id));
        assert_eq!(count(), before);
    }

    /// A driver whose callbacks all exist but are never called by these tests.
    fn test_driver() -> CDriver {
        use crate::abi::{GmemCopy, GmemPte};
        use kernel::ffi::c_void;
        unsafe extern "C" fn cc(_d: *mut c_void, _c: *mut *mut c_void) -> c_int {
            0
        }
        unsafe extern "C" fn cd(_d: *mut c_void, _c: *mut c_void) {}
        unsafe extern "C" fn m(_d: *mut c_void, _c: *mut c_void, _p: *const GmemPte, _n: u32) -> c_int {
            0
        }
        unsafe extern "C" fn u(_d: *mut c_void, _c: *mut c_void, _v: u64, _n: u64) {}
        unsafe extern "C" fn cp(_d: *mut c_void, _r: u32, _c: *const GmemCopy, _n: u32, _p: *mut c_void) -> c_int {
            0
        }
        static OPS: GmemDevOps = GmemDevOps {
            ctx_create: Some(cc),
            ctx_destroy: Some(cd),
            map: Some(m),
            unmap: Some(u),
            tlb_invalidate: Some(u),
            copy: Some(cp),
            frame_page: None,
        test_clear_accessed: None,
        };
        let mut p = props(1);
        // Capabilities: unknown bits and a nonzero reserved word are refused.
        p.caps = 2;
        // SAFETY (all three): `OPS` is static and complete; `p` is a live local.
        assert_eq!(unsafe { CDriver::new(&OPS, &p) }.err(), Some(EINVAL));
        (p.caps, p.reserved) = (crate::abi::GMEM_DEV_CAP_MAP_2M, 1);
        assert_eq!(unsafe { CDriver::new(&OPS, &p) }.err(), Some(EINVAL));
        p.reserved = 0;
        match unsafe { CDriver::new(&OPS, &p) } {
            Ok((d, _)) => {
                assert!(d.maps_2m());
                d
            }
            Err(_) => panic!("complete static ops refused"),
        }
    }
}
