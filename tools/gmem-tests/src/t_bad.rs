// SPDX-License-Identifier: GPL-2.0
//! Bad input: every ioctl with zero, huge, overflowing, unaligned, unmapped, foreign and
//! already-freed arguments gets a clear errno, and the module keeps working afterwards.

use crate::harness::{open, words, Test, TestResult};
use crate::{ensure, expect_errno, ok};
use libgmem::sim::{checksum, SimLaunch};
use libgmem::*;

fn alloc_bad_arguments() -> TestResult {
    let (g, _) = open()?;
    expect_errno!(g.alloc_raw(0, GMEM_NO_DEVICE), libc::EINVAL);
    expect_errno!(g.alloc_raw(2, GMEM_NO_DEVICE), libc::EINVAL);
    expect_errno!(g.alloc_raw(4097, GMEM_NO_DEVICE), libc::EINVAL);
    expect_errno!(g.alloc_raw(GMEM_MAX_ALLOC + 4096, GMEM_NO_DEVICE), libc::E2BIG);
    expect_errno!(g.alloc_raw(u64::MAX, GMEM_NO_DEVICE), libc::EINVAL);
    expect_errno!(g.alloc_raw(u64::MAX - 4095, GMEM_NO_DEVICE), libc::E2BIG);
    expect_errno!(g.alloc_raw(4096, 15), libc::ENODEV);
    expect_errno!(g.alloc_raw(4096, -7), libc::EINVAL);
    let mut a = GmemAlloc { argsz: argsz::<GmemAlloc>(), size: 4096, flags: 1, preferred_dev: -1, ..Default::default() };
    expect_errno!(g.ioctl(GMEM_IOC_ALLOC, &mut a), libc::EINVAL);
    let mut a = GmemAlloc { argsz: argsz::<GmemAlloc>(), size: 4096, preferred_dev: -1, reserved: [0, 1], ..Default::default() };
    expect_errno!(g.ioctl(GMEM_IOC_ALLOC, &mut a), libc::EINVAL);
    let mut a = GmemAlloc { argsz: 8, size: 4096, preferred_dev: -1, ..Default::default() };
    expect_errno!(g.ioctl(GMEM_IOC_ALLOC, &mut a), libc::EINVAL);
    Ok(())
}

fn free_bad_arguments() -> TestResult {
    let (g, _) = open()?;
    let r = ok!(g.alloc(16 * 4096));
    words(&r)[0] = 1;
    expect_errno!(g.free_raw(r.addr + 4096), libc::EINVAL);
    expect_errno!(g.free_raw(r.addr + 2), libc::EINVAL);
    expect_errno!(g.free_raw(0), libc::ENOENT);
    expect_errno!(g.free_raw(u64::MAX), libc::ENOENT);
    let mut f = GmemFree { argsz: argsz::<GmemFree>(), addr: r.addr, flags: 2, ..Default::default() };
    expect_errno!(g.ioctl(GMEM_IOC_FREE, &mut f), libc::EINVAL);
    ensure!(words(&r)[0] == 1, "bad FREE changed the region");
    let addr = r.leak();
    ok!(g.free_raw(addr));
    expect_errno!(g.free_raw(addr), libc::ENOENT);
    Ok(())
}

fn advise_bad_arguments() -> TestResult {
    let (g, _) = open()?;
    let r = ok!(g.alloc(16 * 4096));
    let a = r.addr;
    expect_errno!(g.advise(a, 0, GMEM_ADV_PREFETCH, 0, 0), libc::EINVAL);
    // openEuler's QA: eager free with length -1 panicked. Here: a clear error.
    expect_errno!(g.advise(a, u64::MAX, GMEM_ADV_DONTNEED, GMEM_NO_DEVICE, 0), libc::EOVERFLOW);
    expect_errno!(g.advise(a, u64::MAX, GMEM_ADV_PREFETCH, 0, 0), libc::EOVERFLOW);
    expect_errno!(g.advise(a, 17 * 4096, GMEM_ADV_PREFETCH, 0, 0), libc::EINVAL);
    expect_errno!(g.advise(a + 16 * 4096, 4096, GMEM_ADV_PREFETCH, 0, 0), libc::ENOENT);
    expect_errno!(g.advise(0x1000, 4096, GMEM_ADV_PREFETCH, 0, 0), libc::ENOENT);
    expect_errno!(g.advise(a, 4096, 0, 0, 0), libc::EINVAL);
    expect_errno!(g.advise(a, 4096, 99, 0, 0), libc::EINVAL);
    expect_errno!(g.advise(a, 4096, GMEM_ADV_PREFETCH, 15, 0), libc::ENODEV);
    expect_errno!(g.advise(a, 4096, GMEM_ADV_PREFETCH, -5, 0), libc::EINVAL);
    expect_errno!(g.advise(a, 4096, GMEM_ADV_PIN, GMEM_HOST, 0), libc::EINVAL);
    expect_errno!(g.advise(a, 4096, GMEM_ADV_DONTNEED, 0, GMEM_ADVF_ASYNC), libc::EINVAL);
    expect_errno!(g.advise(a, 4096, GMEM_ADV_PREFETCH, 0, 0x80), libc::EINVAL);
    // ASYNC with a bad range fails synchronously; no fence is created.
    expect_errno!(g.advise(a, 99 * 4096, GMEM_ADV_PREFETCH, 0, GMEM_ADVF_ASYNC), libc::EINVAL);
    expect_errno!(g.wait(12345), libc::ENOENT);
    let mut w = GmemWait { argsz: argsz::<GmemWait>(), flags: 1, ..Default::default() };
    expect_errno!(g.ioctl(GMEM_IOC_WAIT, &mut w), libc::EINVAL);
    // DONTNEED of a range shorter than a page discards nothing (inward rounding).
    words(&r)[0] = 5;
    ok!(g.advise(a, 2, GMEM_ADV_DONTNEED, GMEM_NO_DEVICE, 0));
    ensure!(words(&r)[0] == 5, "size-2 DONTNEED discarded data");
    // After a freed region, advice gets ENOENT.
    let addr = r.leak();
    ok!(g.free_raw(addr));
    expect_errno!(g.advise(addr, 4096, GMEM_ADV_PREFETCH, 0, 0), libc::ENOENT);
    Ok(())
}

fn query_bad_arguments() -> TestResult {
    let (g, _) = open()?;
    let r = ok!(g.alloc(16 * 4096));
    expect_errno!(g.query(r.addr, 0), libc::EINVAL);
    expect_errno!(g.query(r.addr, 17), libc::EINVAL);
    expect_errno!(g.query(r.addr + 15 * 4096, 2), libc::EINVAL);
    expect_errno!(g.query(0x1000, 1), libc::ENOENT);
    let mut q = GmemQuery { argsz: argsz::<GmemQuery>(), addr: r.addr, npages: GMEM_QUERY_MAX + 1, ..Default::default() };
    expect_errno!(g.ioctl(GMEM_IOC_QUERY, &mut q), libc::E2BIG);
    let mut q = GmemQuery { argsz: argsz::<GmemQuery>(), addr: r.addr, npages: 4, states: 16, ..Default::default() };
    expect_errno!(g.ioctl(GMEM_IOC_QUERY, &mut q), libc::EFAULT);
    Ok(())
}

fn sim_launch_bad_arguments() -> TestResult {
    let (g, s) = open()?;
    let r = ok!(g.alloc(16 * 4096));
    expect_errno!(s.checksum(r.addr, 0), libc::EINVAL);
    expect_errno!(s.checksum(r.addr + 2, 8), libc::EINVAL);
    expect_errno!(s.checksum(r.addr, 6), libc::EINVAL);
    expect_errno!(s.checksum(u64::MAX - 3, 8), libc::EOVERFLOW);
    // Outside any region: the device kernel fails with the fault's error.
    expect_errno!(s.checksum(0x10000, 4096), libc::EFAULT);
    expect_errno!(s.checksum(r.addr + 15 * 4096, 8192), libc::EFAULT);
    let mut l = SimLaunch { argsz: argsz::<SimLaunch>(), kernel: 42, a: r.addr, len: 4096, ..Default::default() };
    expect_errno!(s.launch_raw(&mut l), libc::EINVAL);
    Ok(())
}

fn still_works_after_bad_input() -> TestResult {
    alloc_bad_arguments()?;
    advise_bad_arguments()?;
    let (g, s) = open()?;
    let r = ok!(g.alloc(1 << 20));
    ok!(s.fill(r.addr, r.len as u64, 11));
    let expect: Vec<u32> = (0..r.len as u32 / 4).map(|i| 11 + i).collect();
    ensure!(words(&r) == expect.as_slice(), "data wrong after bad-input storm");
    ensure!(ok!(s.checksum(r.addr, r.len as u64)).result == checksum(&expect), "checksum wrong");
    Ok(())
}

pub fn tests() -> Vec<Test> {
    vec![
        Test { name: "alloc_bad_arguments", f: alloc_bad_arguments },
        Test { name: "free_bad_arguments", f: free_bad_arguments },
        Test { name: "advise_bad_arguments", f: advise_bad_arguments },
        Test { name: "query_bad_arguments", f: query_bad_arguments },
        Test { name: "sim_launch_bad_arguments", f: sim_launch_bad_arguments },
        Test { name: "still_works_after_bad_input", f: still_works_after_bad_input },
    ]
}
