// SPDX-License-Identifier: GPL-2.0
//! The simulated accelerator's user API (`include/uapi/linux/gmem_sim.h`): launch kernels
//! on `/dev/gmem_simN` and read their results.

use crate::{argsz, ioctl_raw, Errno, Result};
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;

pub const K_FILL: u32 = 1;
pub const K_CHECKSUM: u32 = 2;
pub const K_COPY: u32 = 3;
pub const K_AXPY: u32 = 4;
pub const K_TOUCH: u32 = 5;
pub const K_GATHER: u32 = 6;
pub const F_WRITE: u32 = 1;

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct SimLaunch {
    pub argsz: u32,
    pub kernel: u32,
    pub flags: u32,
    pub value: u32,
    pub a: u64,
    pub b: u64,
    pub len: u64,
    pub seed: u64,
    pub count: u64,
    pub result: u64,
    pub faults: u64,
    pub batches: u64,
    pub reserved: [u64; 2],
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct SimInfo {
    pub argsz: u32,
    pub gmem_id: i32,
    pub nr_frames: u64,
    pub ptes: u64,
    pub copies: u64,
    pub tlb_flushes: u64,
    /// Valid 2 MiB entries (`ptes` counts 4 KiB ones).
    pub ptes_2m: u64,
    /// 2 MiB entries split into 4 KiB ones so far.
    pub splits_2m: u64,
    /// Copy channels (0: synchronous copies).
    pub channels: u32,
    pub pad: u32,
    /// Copy calls started on a channel, and pages its workers copied.
    pub async_calls: u64,
    pub async_pages: u64,
    /// Copies started and not yet completed, now and at most so far.
    pub inflight: u64,
    pub max_inflight: u64,
    /// Copies gmem's polling completed (driver API `copy_poll`) before the channel's timer.
    pub polled: u64,
}

const fn iowr_s(nr: u64, size: usize) -> u64 {
    (3u64 << 30) | ((size as u64) << 16) | ((b'S' as u64) << 8) | nr
}
/// `struct gmem_sim_fail_copy`: fault injection (see the header).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct SimFailCopy {
    pub argsz: u32,
    pub err: u32,
    pub after: u64,
    pub skip: u64,
    pub reserved: u64,
}

pub const GMEM_SIM_IOC_LAUNCH: u64 = iowr_s(0x01, std::mem::size_of::<SimLaunch>());
pub const GMEM_SIM_IOC_INFO: u64 = iowr_s(0x02, std::mem::size_of::<SimInfo>());
/// `_IOW('S', 0x03, struct gmem_sim_fail_copy)`.
pub const GMEM_SIM_IOC_FAIL_COPY: u64 =
    (1u64 << 30) | ((std::mem::size_of::<SimFailCopy>() as u64) << 16) | ((b'S' as u64) << 8) | 0x03;

/// `_IO('S', 0x04)`: hot-unplug the device.
pub const GMEM_SIM_IOC_UNPLUG: u64 = ((b'S' as u64) << 8) | 0x04;

/// Paths of the link model (`GMEM_SIM_PATH_*`), the indices of [`SimLink`]'s arrays.
pub const PATH_H2D: usize = 0;
pub const PATH_D2H: usize = 1;
pub const PATH_D2D: usize = 2;
/// `GMEM_SIM_LINK_SET`.
pub const LINK_SET: u32 = 1;

/// `struct gmem_sim_link`: the link model and its accounting (see the header).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct SimLink {
    pub argsz: u32,
    pub flags: u32,
    /// MB/s per path (0: unlimited).
    pub mbps: [u64; 3],
    pub latency_ns: u64,
    pub bytes: [u64; 3],
    pub busy_ns: [u64; 3],
    pub reserved: [u64; 2],
}

pub const GMEM_SIM_IOC_LINK: u64 = iowr_s(0x05, std::mem::size_of::<SimLink>());

/// FNV-1a over little-endian u32 words: the device's CHECKSUM kernel, computed on the CPU.
pub fn checksum(words: &[u32]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &w in words {
        h = (h ^ u64::from(w)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// An open simulated device.
pub struct Sim {
    file: File,
}

/// What a kernel reported back.
#[derive(Debug, Clone, Copy, Default)]
pub struct Outcome {
    pub result: u64,
    pub faults: u64,
    pub batches: u64,
}

impl Sim {
    pub fn open(n: usize) -> std::io::Result<Sim> {
        Ok(Sim { file: OpenOptions::new().read(true).write(true).open(format!("/dev/gmem_sim{n}"))? })
    }

    pub fn launch_raw(&self, l: &mut SimLaunch) -> Result<()> {
        // SAFETY: `SimLaunch` is the argument of GMEM_SIM_IOC_LAUNCH.
        unsafe { ioctl_raw(self.file.as_raw_fd(), GMEM_SIM_IOC_LAUNCH, l) }.map(|_| ())
    }

    #[allow(clippy::too_many_arguments)]
    fn launch(
        &self,
        kernel: u32,
        flags: u32,
        value: u32,
        a: u64,
        b: u64,
        len: u64,
        seed: u64,
        count: u64,
    ) -> Result<Outcome> {
        let mut l = SimLaunch {
            argsz: argsz::<SimLaunch>(),
            kernel,
            flags,
            value,
            a,
            b,
            len,
            seed,
            count,
            ..Default::default()
        };
        self.launch_raw(&mut l)?;
        Ok(Outcome { result: l.result, faults: l.faults, batches: l.batches })
    }

    /// a[i] = value + i over `len` bytes.
    pub fn fill(&self, a: u64, len: u64, value: u32) -> Result<Outcome> {
        self.launch(K_FILL, 0, value, a, 0, len, 0, 0)
    }

    pub fn checksum(&self, a: u64, len: u64) -> Result<Outcome> {
        self.launch(K_CHECKSUM, 0, 0, a, 0, len, 0, 0)
    }

    pub fn copy(&self, src: u64, dst: u64, len: u64) -> Result<Outcome> {
        self.launch(K_COPY, 0, 0, src, dst, len, 0, 0)
    }

    /// y[i] = alpha * x[i] + y[i].
    pub fn axpy(&self, x: u64, y: u64, len: u64, alpha: u32) -> Result<Outcome> {
        self.launch(K_AXPY, 0, alpha, x, y, len, 0, 0)
    }

    pub fn touch(&self, a: u64, len: u64, count: u64, seed: u64, write: bool) -> Result<Outcome> {
        self.launch(K_TOUCH, if write { F_WRITE } else { 0 }, 0, a, 0, len, seed, count)
    }

    /// Reads the word at each of `addrs` (multiples of 4, any order, duplicates allowed):
    /// all of them reach gmem as they are, in one fault batch per 256.
    pub fn gather(&self, addrs: &[u64]) -> Result<(Vec<u32>, Outcome)> {
        let mut out = vec![0u32; addrs.len()];
        let o =
            self.launch(K_GATHER, 0, 0, addrs.as_ptr() as u64, out.as_mut_ptr() as u64, 0, 0, addrs.len() as u64)?;
        Ok((out, o))
    }

    /// Hot-unplugs the device: running launches end with ENODEV, gmem saves its pages.
    pub fn unplug(&self) -> Result<()> {
        crate::ioctl_none(self.file.as_raw_fd(), GMEM_SIM_IOC_UNPLUG).map(|_| ())
    }

    /// Arms a one-shot copy failure: the next copy call of more than `after` pages copies
    /// `after` of them, then fails with `err`.
    pub fn fail_copy(&self, after: u64, err: u32) -> Result<()> {
        self.fail_copy_skipping(0, after, err)
    }

    /// Like [`Sim::fail_copy`], but the first `skip` calls of more than `after` pages go
    /// through whole; the one after them fails.
    pub fn fail_copy_skipping(&self, skip: u64, after: u64, err: u32) -> Result<()> {
        let mut f = SimFailCopy { argsz: argsz::<SimFailCopy>(), err, after, skip, ..Default::default() };
        // SAFETY: `SimFailCopy` is the argument of GMEM_SIM_IOC_FAIL_COPY.
        unsafe { ioctl_raw(self.file.as_raw_fd(), GMEM_SIM_IOC_FAIL_COPY, &mut f) }.map(|_| ())
    }

    /// The link model and the bytes and modelled busy time of each path so far.
    pub fn link(&self) -> Result<SimLink> {
        self.link_raw(&mut SimLink { argsz: argsz::<SimLink>(), ..Default::default() })
    }

    /// Sets the link model (`mbps` per path, 0 unlimited; latency per copy call); returns
    /// the state after.
    pub fn set_link(&self, mbps: [u64; 3], latency_ns: u64) -> Result<SimLink> {
        self.link_raw(&mut SimLink {
            argsz: argsz::<SimLink>(),
            flags: LINK_SET,
            mbps,
            latency_ns,
            ..Default::default()
        })
    }

    /// GMEM_SIM_IOC_LINK with the argument as given (for the bad-input tests).
    pub fn link_raw(&self, l: &mut SimLink) -> Result<SimLink> {
        // SAFETY: `SimLink` is the argument of GMEM_SIM_IOC_LINK.
        unsafe { ioctl_raw(self.file.as_raw_fd(), GMEM_SIM_IOC_LINK, l) }?;
        Ok(*l)
    }

    pub fn info(&self) -> Result<SimInfo> {
        let mut i = SimInfo { argsz: argsz::<SimInfo>(), ..Default::default() };
        // SAFETY: `SimInfo` is the argument of GMEM_SIM_IOC_INFO.
        unsafe { ioctl_raw(self.file.as_raw_fd(), GMEM_SIM_IOC_INFO, &mut i) }?;
        Ok(i)
    }
}

impl From<std::io::Error> for Errno {
    fn from(e: std::io::Error) -> Errno {
        Errno(e.raw_os_error().unwrap_or(libc::EIO))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksum_is_order_sensitive_fnv1a() {
        assert_eq!(checksum(&[]), 0xcbf2_9ce4_8422_2325);
        assert_ne!(checksum(&[1, 2]), checksum(&[2, 1]));
        // One step by hand: (offset ^ 5) * prime.
        assert_eq!(checksum(&[5]), (0xcbf2_9ce4_8422_2325u64 ^ 5).wrapping_mul(0x100000001b3));
    }

    #[test]
    fn launch_struct_matches_the_header() {
        assert_eq!(std::mem::size_of::<SimLaunch>(), 96);
        // struct gmem_sim_info: 96 bytes up to max_inflight, then polled.
        assert_eq!(std::mem::size_of::<SimInfo>(), 104);
        assert_eq!(std::mem::offset_of!(SimInfo, polled), 96);
    }
}
