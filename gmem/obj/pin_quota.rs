// SPDX-License-Identifier: GPL-2.0
//! PIN quota: pages pinned on a device are charged to the owning process's `pinned_vm`
//! against its `RLIMIT_MEMLOCK`, the convention of long-term pins elsewhere in the kernel
//! (RDMA's `ib_umem_get`): without `CAP_IPC_LOCK`, a PIN that would take `pinned_vm` past
//! the limit fails with `ENOMEM` (as mlock does). `account_locked_vm()` is not used: it
//! takes the mmap write lock, and pins also end under the mmap lock (munmap, exit).
//!
//! Who charges and who uncharges:
//! - a PIN charges every page of its range not pinned yet, up front, before any page moves
//!   (`moves::move_pages`), and gives back what it did not pin in the end;
//! - every transition that clears a page's pin (UNPIN, device unregistration, FREE, loss)
//!   uncharges that page at its commit point (`migrate::apply`).
//!
//! So `pinned_vm` holds exactly this process's pinned GMEM pages plus, transiently, the
//! unused part of a PIN in progress.

use kernel::{mm::Mm, prelude::*};

extern "C" {
    fn gmem_pin_charge(mm: *mut core::ffi::c_void, npages: u64) -> bool;
    fn gmem_pin_uncharge(mm: *mut core::ffi::c_void, npages: u64);
}

/// Charges `npages` pinned pages to `mm`, checked against the calling task's
/// `RLIMIT_MEMLOCK` (unless it has `CAP_IPC_LOCK`); `ENOMEM` past the limit.
pub(crate) fn charge(mm: &Mm, npages: u64) -> Result {
    // SAFETY: `mm` is a live mm (the reference keeps it allocated); process context.
    if unsafe { gmem_pin_charge(mm.as_raw().cast(), npages) } {
        Ok(())
    } else {
        Err(ENOMEM)
    }
}

/// Gives back `npages` charged by [`charge`].
pub(crate) fn uncharge(mm: &Mm, npages: u64) {
    if npages != 0 {
        // SAFETY: as above; an atomic subtraction.
        unsafe { gmem_pin_uncharge(mm.as_raw().cast(), npages) }
    }
}
