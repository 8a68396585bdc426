// SPDX-License-Identifier: GPL-2.0
//! libgmem: the `/dev/gmem` user API (`include/uapi/linux/gmem.h`) for Rust programs.
//!
//! `Gmem::open()` opens the device; `alloc` returns a [`Region`] whose memory the CPU and every
//! registered accelerator use at the same address. Errors are the kernel's errno values.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;

pub mod csample;
pub mod debugfs;
pub mod sim;
pub mod trace;
pub mod uapi;
pub use uapi::*;

/// An open `/dev/gmem`.
pub struct Gmem {
    file: File,
}

/// An errno from the kernel (positive value, e.g. `libc::EINVAL`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Errno(pub i32);

impl std::fmt::Display for Errno {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", io::Error::from_raw_os_error(self.0))
    }
}

pub type Result<T> = std::result::Result<T, Errno>;

fn last_errno() -> Errno {
    Errno(io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO))
}

/// Issues one ioctl whose argument is `*arg`.
///
/// # Safety
/// `T` must be the argument struct that `cmd` expects.
pub unsafe fn ioctl_raw<T>(fd: i32, cmd: u64, arg: *mut T) -> Result<i64> {
    // SAFETY: caller contract: `arg` matches `cmd`.
    let r = unsafe { libc::ioctl(fd, cmd as _, arg) };
    if r < 0 {
        Err(last_errno())
    } else {
        Ok(r as i64)
    }
}

/// An ioctl without argument (`_IO`), e.g. a hot-unplug request.
pub fn ioctl_none(fd: i32, cmd: u64) -> Result<i64> {
    // SAFETY: the command takes no argument; the third one is ignored.
    let r = unsafe { libc::ioctl(fd, cmd as _, 0usize) };
    if r < 0 {
        Err(last_errno())
    } else {
        Ok(r as i64)
    }
}

impl Gmem {
    pub fn open() -> io::Result<Gmem> {
        Ok(Gmem { file: OpenOptions::new().read(true).write(true).open("/dev/gmem")? })
    }

    pub fn fd(&self) -> i32 {
        self.file.as_raw_fd()
    }

    /// Any ioctl with a caller-built argument (tests use it for bad input).
    pub fn ioctl<T>(&self, cmd: u64, arg: &mut T) -> Result<i64> {
        // SAFETY: the uapi structs are plain data; the kernel validates argsz against `cmd`.
        unsafe { ioctl_raw(self.fd(), cmd, arg) }
    }

    pub fn version(&self) -> Result<GmemVersion> {
        let mut v = GmemVersion { argsz: argsz::<GmemVersion>(), ..Default::default() };
        self.ioctl(GMEM_IOC_VERSION, &mut v)?;
        Ok(v)
    }

    /// Allocates `size` bytes; `preferred_dev` is a device id or `GMEM_NO_DEVICE`.
    pub fn alloc_raw(&self, size: u64, preferred_dev: i32) -> Result<u64> {
        let mut a = GmemAlloc { argsz: argsz::<GmemAlloc>(), size, preferred_dev, ..Default::default() };
        self.ioctl(GMEM_IOC_ALLOC, &mut a)?;
        Ok(a.addr)
    }

    pub fn alloc(&self, size: u64) -> Result<Region<'_>> {
        let addr = self.alloc_raw(size, GMEM_NO_DEVICE)?;
        Ok(Region { gmem: self, addr, len: size as usize })
    }

    pub fn free_raw(&self, addr: u64) -> Result<()> {
        let mut f = GmemFree { argsz: argsz::<GmemFree>(), addr, ..Default::default() };
        self.ioctl(GMEM_IOC_FREE, &mut f).map(|_| ())
    }

    /// Gives advice; returns the fence for `GMEM_ADVF_ASYNC`.
    pub fn advise(&self, addr: u64, len: u64, advice: u32, dev: i32, flags: u32) -> Result<u64> {
        let mut a = GmemAdvise { argsz: argsz::<GmemAdvise>(), advice, addr, len, dev, flags, ..Default::default() };
        self.ioctl(GMEM_IOC_ADVISE, &mut a)?;
        Ok(a.fence)
    }

    pub fn wait(&self, fence: u64) -> Result<()> {
        let mut w = GmemWait { argsz: argsz::<GmemWait>(), fence, ..Default::default() };
        self.ioctl(GMEM_IOC_WAIT, &mut w).map(|_| ())
    }

    /// Residency oracle: one state word per page from `addr`.
    pub fn query(&self, addr: u64, npages: usize) -> Result<Vec<u32>> {
        let mut out = vec![0u32; npages];
        let mut q = GmemQuery {
            argsz: argsz::<GmemQuery>(),
            addr,
            npages: npages as u64,
            states: out.as_mut_ptr() as u64,
            ..Default::default()
        };
        self.ioctl(GMEM_IOC_QUERY, &mut q)?;
        Ok(out)
    }
}

/// A GMEM allocation; freed on drop unless [`Region::leak`] was called.
pub struct Region<'a> {
    gmem: &'a Gmem,
    pub addr: u64,
    pub len: usize,
}

impl Region<'_> {
    pub fn as_ptr(&self) -> *mut u8 {
        self.addr as *mut u8
    }

    /// The memory as a byte slice (touching it faults pages to the CPU).
    #[allow(clippy::mut_from_ref)]
    pub fn bytes(&self) -> &mut [u8] {
        // SAFETY: the kernel mapped [addr, addr+len) read/write for this process until FREE;
        // the region lives until drop, which frees it.
        unsafe { std::slice::from_raw_parts_mut(self.as_ptr(), self.len) }
    }

    pub fn pages(&self) -> usize {
        self.len / GMEM_PAGE_SIZE as usize
    }

    pub fn query(&self) -> Result<Vec<u32>> {
        self.gmem.query(self.addr, self.pages())
    }

    pub fn advise(&self, advice: u32, dev: i32) -> Result<u64> {
        self.gmem.advise(self.addr, self.len as u64, advice, dev, 0)
    }

    /// Forgets the region without freeing it (the kernel frees it at exit).
    pub fn leak(self) -> u64 {
        let a = self.addr;
        std::mem::forget(self);
        a
    }
}

impl Drop for Region<'_> {
    fn drop(&mut self) {
        let _ = self.gmem.free_raw(self.addr);
    }
}

pub fn argsz<T>() -> u32 {
    std::mem::size_of::<T>() as u32
}
