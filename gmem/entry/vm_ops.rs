// SPDX-License-Identifier: GPL-2.0
//! The VMA callbacks of every GMEM region (a raw `vm_operations_struct`): where a CPU
//! fault and a ptrace access enter, and what ties a region's life to its VMA
//! (open/close/may_split/mremap).

use crate::mech::{access, fault, teardown};
use crate::obj::region::Region;
use kernel::{
    bindings,
    ffi::{c_int, c_ulong, c_void},
    prelude::*,
    sync::{Arc, ArcBorrow},
};

/// The VMA callbacks of every GMEM region.
pub(crate) static VM_OPS: bindings::vm_operations_struct = bindings::vm_operations_struct {
    open: Some(vm_open),
    close: Some(vm_close),
    may_split: Some(vm_may_split),
    mremap: Some(vm_mremap),
    fault: Some(vm_fault),
    access: Some(vm_access),
    // SAFETY: all-zero is a valid `vm_operations_struct` (every other callback absent).
    ..unsafe { core::mem::zeroed() }
};

/// The region of a GMEM VMA.
///
/// # Safety
/// `vma` must be a live GMEM VMA: `vm_private_data` holds an `Arc<Region>` reference
/// (taken in mmap or `vm_open`, given back in `vm_close`).
unsafe fn region_of<'a>(vma: *mut bindings::vm_area_struct) -> ArcBorrow<'a, Region> {
    // SAFETY: by the function's contract.
    unsafe { ArcBorrow::from_raw((*vma).vm_private_data.cast::<Region>().cast_const()) }
}

/// Stores a region reference in a VMA being set up.
///
/// # Safety
/// `vma` must be a VMA under construction by our mmap handler.
pub(crate) unsafe fn attach(vma: *mut bindings::vm_area_struct, region: Arc<Region>) {
    // SAFETY: the VMA is being set up under the mmap write lock; we own these fields.
    unsafe {
        (*vma).vm_ops = &VM_OPS;
        (*vma).vm_private_data = Arc::into_raw(region).cast_mut().cast::<c_void>();
    }
}

/// A copy of a VMA (split is refused, but mremap copies before it asks us): one more ref.
///
/// # Safety
/// Called by the kernel only, through the `vm_operations_struct` of a GMEM VMA.
unsafe extern "C" fn vm_open(vma: *mut bindings::vm_area_struct) {
    // SAFETY: `vma` is a copy of a GMEM VMA, so it carries the original's pointer.
    let r: Arc<Region> = unsafe { region_of(vma) }.into();
    core::mem::forget(r);
}

/// The VMA goes away: drop its reference; if it is the region's own VMA, free the region.
///
/// # Safety
/// Called by the kernel only, through the `vm_operations_struct` of a GMEM VMA.
unsafe extern "C" fn vm_close(vma: *mut bindings::vm_area_struct) {
    // SAFETY: `vma` is a GMEM VMA; this gives back the reference taken for it.
    let region = unsafe { Arc::<Region>::from_raw((*vma).vm_private_data.cast::<Region>().cast_const()) };
    // SAFETY: `vma` is valid during the callback.
    let start = unsafe { kernel::mm::virt::VmaRef::from_raw(vma) }.start();
    if start == region.start {
        teardown::teardown(&region);
    }
}

/// Partial munmap/mprotect splits are refused: a region lives and dies whole.
///
/// # Safety
/// Called by the kernel only, through the `vm_operations_struct` of a GMEM VMA.
unsafe extern "C" fn vm_may_split(_vma: *mut bindings::vm_area_struct, _addr: c_ulong) -> c_int {
    EINVAL.to_errno()
}

/// ptrace / `/proc/PID/mem` access: GUP refuses GMEM VMAs (`VM_IO`), so the kernel asks
/// us (`access.rs`). Returns the bytes copied (within one page) or a negative errno.
///
/// # Safety
/// Called by the kernel only, through the `vm_operations_struct` of a GMEM VMA.
unsafe extern "C" fn vm_access(
    vma: *mut bindings::vm_area_struct,
    addr: c_ulong,
    buf: *mut c_void,
    len: c_int,
    write: c_int,
) -> c_int {
    let Ok(len) = usize::try_from(len) else { return EINVAL.to_errno() };
    // SAFETY: `vma` is a live GMEM VMA (these ops are only installed on ours).
    let region: Arc<Region> = unsafe { region_of(vma) }.into();
    // SAFETY: `access_remote_vm` passes a kernel buffer of `len` bytes.
    match unsafe { access::access(&region, addr, buf.cast(), len, write != 0) } {
        // At most one page: fits in a `c_int`.
        Ok(n) => n as c_int,
        Err(e) => e.to_errno(),
    }
}

/// Regions do not move.
///
/// # Safety
/// Called by the kernel only, through the `vm_operations_struct` of a GMEM VMA.
unsafe extern "C" fn vm_mremap(_vma: *mut bindings::vm_area_struct) -> c_int {
    EINVAL.to_errno()
}

/// A CPU page fault in a GMEM VMA (`fault.rs` does the work).
///
/// # Safety
/// Called by the kernel only, through the `vm_operations_struct` of a GMEM VMA.
unsafe extern "C" fn vm_fault(vmf: *mut bindings::vm_fault) -> bindings::vm_fault_t {
    // SAFETY: the kernel passes a valid fault descriptor for a GMEM VMA.
    let (vma, addr, flags) = unsafe { ((*vmf).__bindgen_anon_1.vma, (*vmf).__bindgen_anon_1.address, (*vmf).flags) };
    // SAFETY: the faulting VMA is a GMEM VMA (these ops are only installed on ours).
    let region = unsafe { region_of(vma) };
    let write = flags & bindings::fault_flag_FAULT_FLAG_WRITE != 0;
    let region: Arc<Region> = region.into();
    match fault::cpu_fault(&region, vmf, addr, write) {
        Ok(r) => r,
        // Out of host memory (or over the memory cgroup's limit) included: the access fails
        // cleanly with SIGBUS instead of killing something (see host_page.rs).
        Err(_) => bindings::vm_fault_reason_VM_FAULT_SIGBUS,
    }
}
