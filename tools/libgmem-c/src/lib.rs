// SPDX-License-Identifier: GPL-2.0
//! libgmem for C: the functions of `include/gmem.h`, built as `libgmem.so` and `libgmem.a`
//! on top of the `libgmem` crate. One `/dev/gmem` descriptor per process, opened on first
//! use and shared by all threads (the kernel serialises per space; nothing here keeps
//! mutable state besides that descriptor).

use libgmem::{Errno, Gmem, GMEM_ADVF_ASYNC, GMEM_ADV_PREFETCH, GMEM_PAGE_SIZE};
use std::ffi::{c_int, c_void};
use std::sync::OnceLock;

static GMEM: OnceLock<Gmem> = OnceLock::new();

/// The process's descriptor, opened on first use (a failed open is retried next time).
fn gmem() -> Result<&'static Gmem, c_int> {
    if let Some(g) = GMEM.get() {
        return Ok(g);
    }
    let g = Gmem::open().map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))?;
    // A racing thread may have won: its descriptor is kept, ours closed on drop.
    Ok(GMEM.get_or_init(|| g))
}

/// 0, or the negative errno (the C convention of `gmem.h`).
fn ret(r: Result<(), c_int>) -> c_int {
    match r {
        Ok(()) => 0,
        Err(e) => -e,
    }
}

fn errno(e: Errno) -> c_int {
    e.0
}

/// Page-rounded length, or EINVAL for 0 / overflow.
fn pages_len(size: usize) -> Result<u64, c_int> {
    let p = GMEM_PAGE_SIZE as usize;
    if size == 0 {
        return Err(libc::EINVAL);
    }
    size.checked_add(p - 1).map(|s| (s / p * p) as u64).ok_or(libc::EINVAL)
}

fn malloc_on(size: usize, dev: c_int) -> *mut c_void {
    let r = pages_len(size).and_then(|len| gmem()?.alloc_raw(len, dev).map_err(errno));
    match r {
        Ok(addr) => addr as *mut c_void,
        Err(e) => {
            // SAFETY: `__errno_location` is this thread's errno.
            unsafe { *libc::__errno_location() = e };
            std::ptr::null_mut()
        }
    }
}

/// `gmem_malloc()`.
#[no_mangle]
pub extern "C" fn gmem_malloc(size: usize) -> *mut c_void {
    malloc_on(size, libgmem::GMEM_NO_DEVICE)
}

/// `gmem_malloc_on()`.
#[no_mangle]
pub extern "C" fn gmem_malloc_on(size: usize, dev: c_int) -> *mut c_void {
    malloc_on(size, dev)
}

/// `gmem_free()`.
#[no_mangle]
pub extern "C" fn gmem_free(ptr: *mut c_void) -> c_int {
    ret(gmem().and_then(|g| g.free_raw(ptr as u64).map_err(errno)))
}

fn advise(ptr: *const c_void, len: usize, advice: c_int, dev: c_int, flags: u32) -> Result<u64, c_int> {
    let advice = u32::try_from(advice).map_err(|_| libc::EINVAL)?;
    gmem()?.advise(ptr as u64, len as u64, advice, dev, flags).map_err(errno)
}

/// `gmem_prefetch()`.
#[no_mangle]
pub extern "C" fn gmem_prefetch(ptr: *const c_void, len: usize, dev: c_int) -> c_int {
    ret(advise(ptr, len, GMEM_ADV_PREFETCH as c_int, dev, 0).map(|_| ()))
}

/// `gmem_prefetch_async()`.
///
/// # Safety
/// `fence` must be null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn gmem_prefetch_async(ptr: *const c_void, len: usize, dev: c_int, fence: *mut u64) -> c_int {
    if fence.is_null() {
        return -libc::EINVAL;
    }
    ret(advise(ptr, len, GMEM_ADV_PREFETCH as c_int, dev, GMEM_ADVF_ASYNC).map(|f| {
        // SAFETY: non-null and writable by the caller's contract.
        unsafe { fence.write(f) }
    }))
}

/// `gmem_wait()`.
#[no_mangle]
pub extern "C" fn gmem_wait(fence: u64) -> c_int {
    ret(gmem().and_then(|g| g.wait(fence).map_err(errno)))
}

/// `gmem_advise()`.
#[no_mangle]
pub extern "C" fn gmem_advise(ptr: *const c_void, len: usize, advice: c_int, dev: c_int) -> c_int {
    ret(advise(ptr, len, advice, dev, 0).map(|_| ()))
}

/// `gmem_query()`.
///
/// # Safety
/// `states` must be null or valid for `npages` writes.
#[no_mangle]
pub unsafe extern "C" fn gmem_query(ptr: *const c_void, npages: usize, states: *mut u32) -> c_int {
    if states.is_null() || npages == 0 {
        return -libc::EINVAL;
    }
    ret(gmem().and_then(|g| g.query(ptr as u64, npages).map_err(errno)).map(|v| {
        // SAFETY: `v` has `npages` words; `states` is valid for that many writes.
        unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), states, npages) }
    }))
}

/// `gmem_fd()`.
#[no_mangle]
pub extern "C" fn gmem_fd() -> c_int {
    gmem().map_or_else(|e| -e, Gmem::fd)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_round_up_to_pages_and_refuse_zero_and_overflow() {
        assert_eq!(pages_len(1), Ok(4096));
        assert_eq!(pages_len(4096), Ok(4096));
        assert_eq!(pages_len(4097), Ok(8192));
        assert_eq!(pages_len(0), Err(libc::EINVAL));
        assert_eq!(pages_len(usize::MAX), Err(libc::EINVAL));
    }

    #[test]
    fn errors_are_negative_errnos() {
        assert_eq!(ret(Err(libc::ENODEV)), -libc::ENODEV);
        assert_eq!(ret(Ok(())), 0);
        // SAFETY: a null fence is refused before anything is written.
        assert_eq!(unsafe { gmem_prefetch_async(std::ptr::null(), 4096, 0, std::ptr::null_mut()) }, -libc::EINVAL);
        // SAFETY: as above, for the state buffer.
        assert_eq!(unsafe { gmem_query(std::ptr::null(), 1, std::ptr::null_mut()) }, -libc::EINVAL);
    }
}
