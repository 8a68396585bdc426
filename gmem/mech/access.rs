// SPDX-License-Identifier: GPL-2.0
//! Access to GMEM memory by another task's kernel path: ptrace (PEEKDATA/POKEDATA) and
//! `/proc/PID/mem`, through the VMA's `.access` callback.
//!
//! The GUP decision (Documentation/design.rst, "Pinned I/O"): GMEM VMAs are `VM_IO`, so
//! `get_user_pages` and long-term pins refuse them (`EFAULT`): O_DIRECT, io_uring fixed
//! buffers, vmsplice, RDMA registration and `process_vm_readv` cannot take a reference on
//! a host page that GMEM may drop or replace when the page migrates. `access_remote_vm`
//! falls back to `.access` when GUP refuses, so debuggers still read and write the right
//! data: like a CPU access, it brings the page home (copying from a device if needed) and
//! copies through the kernel mapping of the host page, under the page's block lock.

use crate::exec::migrate::{self, Env};
use crate::obj::region::{Region, PAGE_SIZE};
use kernel::{prelude::*, sync::Arc};

/// Copies up to `len` bytes at `addr` (never past the end of its page) between the
/// region's memory and the kernel buffer `buf`; returns the byte count.
///
/// # Safety
/// `buf` must be valid for `len` bytes of reads (write) or writes (read).
pub(crate) unsafe fn access(region: &Arc<Region>, addr: usize, buf: *mut u8, len: usize, write: bool) -> Result<usize> {
    let i = region.index(addr).ok_or(EFAULT)?;
    let off = addr % PAGE_SIZE;
    let n = core::cmp::min(len, PAGE_SIZE - off);
    let block = region.block(i)?;
    let mut p = region.lock(&block);
    if region.is_dead() {
        return Err(EFAULT);
    }
    // The same transition as a CPU fault (duplicates collapse: the host copy becomes the
    // only one). A page pinned on a device, or lost, is refused as it is for the CPU.
    let (next, a) = crate::mech::fault::cpu_transition(p.state(i), write).map_err(migrate::refusal_errno)?;
    migrate::apply(&Env::access(region, None), &mut p, i, next, &a)?;
    let page = p.host(i).ok_or(EFAULT)?;
    let m = page.map();
    // SAFETY: the mapping covers the page and `off + n <= PAGE_SIZE`; `buf` is valid for
    // `n <= len` bytes by the caller's contract; the page is held under its block lock.
    unsafe {
        if write {
            core::ptr::copy_nonoverlapping(buf.cast_const(), m.ptr().add(off), n);
        } else {
            core::ptr::copy_nonoverlapping(m.ptr().add(off).cast_const(), buf, n);
        }
    }
    Ok(n)
}
