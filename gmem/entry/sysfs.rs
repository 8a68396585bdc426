// SPDX-License-Identifier: GPL-2.0
//! `/sys/class/gmem/gmemN`: the values behind the sysfs attributes of `gmem_sysfs.c`
//! (Documentation/ABI/testing/sysfs-class-gmem), and safe wrappers of that file's node
//! management. The attribute index order is the one of `enum gmem_sysfs_attr` there.

use crate::obj::device::Device;
use crate::obj::devices;
use core::sync::atomic::Ordering::Relaxed;
use kernel::{
    ffi::{c_int, c_uint},
    prelude::*,
};

extern "C" {
    fn gmem_sysfs_init() -> c_int;
    fn gmem_sysfs_exit();
    fn gmem_sysfs_add(id: c_int) -> c_int;
    fn gmem_sysfs_remove(id: c_int);
}

/// The `gmem` class, registered for the guard's lifetime (the module's).
pub(crate) struct ClassGuard(());

impl ClassGuard {
    pub(crate) fn new() -> Result<ClassGuard> {
        // SAFETY: called once, at module init (the guard's `Drop` undoes it).
        kernel::error::to_result(unsafe { gmem_sysfs_init() })?;
        Ok(ClassGuard(()))
    }
}

impl Drop for ClassGuard {
    fn drop(&mut self) {
        // SAFETY: registered in `new`; every device node is gone (registered drivers pin
        // the module, and unregistration removes each node).
        unsafe { gmem_sysfs_exit() }
    }
}

/// Adds the node of a device just registered. A failure only costs the node (debugfs
/// still shows the device), so it is logged, not returned.
pub(crate) fn add(id: usize) {
    let Ok(id) = c_int::try_from(id) else { return };
    // SAFETY: the class is registered while devices can be registered (module lifetime).
    let err = unsafe { gmem_sysfs_add(id) };
    if err != 0 {
        pr_warn!("device {}: no sysfs node ({})\n", id, err);
    }
}

/// Removes the node of a device being unregistered; returns once no attribute call of it
/// is running.
pub(crate) fn remove(id: usize) {
    if let Ok(id) = c_int::try_from(id) {
        // SAFETY: plain call; a missing node is ignored.
        unsafe { gmem_sysfs_remove(id) }
    }
}

/// The value of attribute `attr` of device `d` (`None`: no such attribute).
fn value(d: &Device, attr: c_uint) -> Option<u64> {
    let s = &d.stats;
    let g = |c: &core::sync::atomic::AtomicU64| c.load(Relaxed);
    Some(match attr {
        0 => d.nr_frames,
        1 => d.frames_used(),
        2 => d.frames_pinned(),
        3 => d.frames_lent(),
        4 => u64::from(d.alive()),
        5 => d.low(),
        6 => d.high(),
        7 => g(&s.fault_batches),
        8 => g(&s.faults),
        9 => g(&s.pages_h2d),
        10 => g(&s.pages_d2h),
        11 => g(&s.pages_d2d),
        12 => g(&s.pages_zeroed),
        13 => g(&s.prefetched),
        14 => g(&s.evicted_to_host),
        15 => g(&s.evicted_to_peer),
        16 => g(&s.evicted_clean),
        17 => g(&s.pre_evicted),
        18 => g(&s.writebacks),
        19 => g(&s.evacuated),
        20 => g(&s.lost),
        21 => g(&s.thrash_events),
        _ => return None,
    })
}

/// Called by `gmem_sysfs.c` to show an attribute: 0 or a negative errno.
///
/// # Safety
/// `val` must be valid for a write.
#[no_mangle]
pub(crate) unsafe extern "C" fn gmem_sysfs_get(id: c_int, attr: c_uint, val: *mut u64) -> c_int {
    let Some(d) = usize::try_from(id).ok().and_then(devices::get) else { return ENODEV.to_errno() };
    match value(&d, attr) {
        Some(v) => {
            // SAFETY: by the function's contract.
            unsafe { val.write(v) };
            0
        }
        None => EINVAL.to_errno(),
    }
}

/// Called by `gmem_sysfs.c` to store a watermark (the only writable attributes): 0, or
/// `EINVAL` unless `low <= high <= frames` holds afterwards (as for debugfs `control`).
#[no_mangle]
pub(crate) extern "C" fn gmem_sysfs_set(id: c_int, attr: c_uint, v: u64) -> c_int {
    let Some(d) = usize::try_from(id).ok().and_then(devices::get) else { return ENODEV.to_errno() };
    let (low, high) = match attr {
        5 => (v, d.high()),
        6 => (d.low(), v),
        _ => return EINVAL.to_errno(),
    };
    if low > high || high > d.nr_frames {
        return EINVAL.to_errno();
    }
    d.set_watermarks(low, high);
    0
}
