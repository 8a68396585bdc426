// SPDX-License-Identifier: GPL-2.0
//! The device node and the version ioctl.

use crate::harness::{Test, TestResult};
use crate::{ensure, expect_errno, ok};
use libgmem::*;

fn open_and_version() -> TestResult {
    let g = Gmem::open().map_err(|e| format!("open /dev/gmem: {e}"))?;
    let v = ok!(g.version());
    ensure!(v.version == GMEM_UAPI_VERSION, "version {} != {}", v.version, GMEM_UAPI_VERSION);
    ensure!(v.nr_devices >= 1, "expected the simulated device to be registered, got {}", v.nr_devices);
    Ok(())
}

fn version_rejects_bad_argsz_and_reserved() -> TestResult {
    let g = Gmem::open().map_err(|e| format!("open: {e}"))?;
    let mut v = GmemVersion { argsz: 8, ..Default::default() };
    expect_errno!(g.ioctl(GMEM_IOC_VERSION, &mut v), libc::EINVAL);
    let mut v = GmemVersion { argsz: argsz::<GmemVersion>(), reserved: 1, ..Default::default() };
    expect_errno!(g.ioctl(GMEM_IOC_VERSION, &mut v), libc::EINVAL);
    Ok(())
}

fn unknown_ioctl_is_enotty() -> TestResult {
    let g = Gmem::open().map_err(|e| format!("open: {e}"))?;
    let mut v = GmemVersion::default();
    expect_errno!(g.ioctl(GMEM_IOC_VERSION + 0x7f, &mut v), libc::ENOTTY);
    // The device still answers afterwards.
    ok!(g.version());
    Ok(())
}

fn bad_user_pointer_is_efault() -> TestResult {
    let g = Gmem::open().map_err(|e| format!("open: {e}"))?;
    // SAFETY: deliberately passes an unmapped pointer; the kernel must return EFAULT.
    let r = unsafe { ioctl_raw(g.fd(), GMEM_IOC_VERSION, 16usize as *mut GmemVersion) };
    expect_errno!(r, libc::EFAULT);
    Ok(())
}

pub fn tests() -> Vec<Test> {
    vec![
        Test { name: "open_and_version", f: open_and_version },
        Test { name: "version_rejects_bad_argsz_and_reserved", f: version_rejects_bad_argsz_and_reserved },
        Test { name: "unknown_ioctl_is_enotty", f: unknown_ioctl_is_enotty },
        Test { name: "bad_user_pointer_is_efault", f: bad_user_pointer_is_efault },
    ]
}
