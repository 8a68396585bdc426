// SPDX-License-Identifier: GPL-2.0
//! The C sample driver's user API (`include/uapi/linux/gmem_csample.h`): run kernels on
//! `/dev/gmem_csampleN`.

use crate::sim::Outcome;
use crate::{argsz, ioctl_raw, Result};
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;

pub const OP_FILL: u32 = 1;
pub const OP_CHECKSUM: u32 = 2;
pub const OP_GATHER: u32 = 3;

/// `struct gmem_csample_run`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct CsRun {
    pub argsz: u32,
    pub op: u32,
    pub addr: u64,
    pub len: u64,
    pub value: u32,
    pub reserved: u32,
    pub addrs: u64,
    pub out: u64,
    pub count: u64,
    pub result: u64,
    pub faults: u64,
    pub batches: u64,
}

/// `struct gmem_csample_info`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct CsInfo {
    pub argsz: u32,
    pub gmem_id: i32,
    pub nr_frames: u64,
    pub ptes: u64,
    pub copies: u64,
}

const fn ioc(dir: u64, nr: u64, size: usize) -> u64 {
    (dir << 30) | ((size as u64) << 16) | ((b'C' as u64) << 8) | nr
}
pub const GMEM_CSAMPLE_IOC_RUN: u64 = ioc(3, 0x01, std::mem::size_of::<CsRun>());
pub const GMEM_CSAMPLE_IOC_INFO: u64 = ioc(3, 0x02, std::mem::size_of::<CsInfo>());
pub const GMEM_CSAMPLE_IOC_UNPLUG: u64 = ioc(0, 0x03, 0);

/// An open C sample device.
pub struct CSample {
    file: File,
}

impl CSample {
    pub fn open(n: usize) -> std::io::Result<CSample> {
        Ok(CSample { file: OpenOptions::new().read(true).write(true).open(format!("/dev/gmem_csample{n}"))? })
    }

    pub fn run_raw(&self, r: &mut CsRun) -> Result<()> {
        // SAFETY: `CsRun` is the argument of GMEM_CSAMPLE_IOC_RUN.
        unsafe { ioctl_raw(self.file.as_raw_fd(), GMEM_CSAMPLE_IOC_RUN, r) }.map(|_| ())
    }

    fn run(&self, mut r: CsRun) -> Result<Outcome> {
        r.argsz = argsz::<CsRun>();
        self.run_raw(&mut r)?;
        Ok(Outcome { result: r.result, faults: r.faults, batches: r.batches })
    }

    /// a[i] = value + i over `len` bytes.
    pub fn fill(&self, addr: u64, len: u64, value: u32) -> Result<Outcome> {
        self.run(CsRun { op: OP_FILL, addr, len, value, ..Default::default() })
    }

    pub fn checksum(&self, addr: u64, len: u64) -> Result<Outcome> {
        self.run(CsRun { op: OP_CHECKSUM, addr, len, ..Default::default() })
    }

    /// Reads the word at each of `addrs` (multiples of 4, duplicates allowed).
    pub fn gather(&self, addrs: &[u64]) -> Result<(Vec<u32>, Outcome)> {
        let mut out = vec![0u32; addrs.len()];
        let o = self.run(CsRun {
            op: OP_GATHER,
            addrs: addrs.as_ptr() as u64,
            out: out.as_mut_ptr() as u64,
            count: addrs.len() as u64,
            ..Default::default()
        })?;
        Ok((out, o))
    }

    pub fn info(&self) -> Result<CsInfo> {
        let mut i = CsInfo { argsz: argsz::<CsInfo>(), ..Default::default() };
        // SAFETY: `CsInfo` is the argument of GMEM_CSAMPLE_IOC_INFO.
        unsafe { ioctl_raw(self.file.as_raw_fd(), GMEM_CSAMPLE_IOC_INFO, &mut i) }?;
        Ok(i)
    }

    /// Hot-unplugs the device.
    pub fn unplug(&self) -> Result<()> {
        crate::ioctl_none(self.file.as_raw_fd(), GMEM_CSAMPLE_IOC_UNPLUG).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn structs_match_the_header() {
        assert_eq!(std::mem::size_of::<CsRun>(), 80);
        assert_eq!(std::mem::size_of::<CsInfo>(), 32);
        assert_eq!(GMEM_CSAMPLE_IOC_UNPLUG, 0x4303);
    }
}
