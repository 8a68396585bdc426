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
    let mut a =
        GmemAlloc { argsz: argsz::<GmemAlloc>(), size: 4096, flags: 1, preferred_dev: -1, ..Default::default() };
    expect_errno!(g.ioctl(GMEM_IOC_ALLOC, &mut a), libc::EINVAL);
    let mut a = GmemAlloc {
        argsz: argsz::<GmemAlloc>(),
        size: 4096,
        preferred_dev: -1,
        reserved: [0, 1],
        ..Default::default()
    };
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
    // Outside any region and any mapping (a PREFETCH of ordinary memory is t_sysmem's).
    expect_errno!(g.advise(0x1000, 4096, GMEM_ADV_PREFETCH, 0, 0), libc::ENOENT);
    expect_errno!(g.advise(a + 16 * 4096, 4096, GMEM_ADV_DONTNEED, GMEM_NO_DEVICE, 0), libc::ENOENT);
    // At the very top of the address space: nothing mapped there, and no arithmetic wraps.
    expect_errno!(g.advise(0xffff_ffff_fff0_0000, 4096, GMEM_ADV_PREFETCH, 0, 0), libc::ENOENT);
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
    let mut q =
        GmemQuery { argsz: argsz::<GmemQuery>(), addr: r.addr, npages: GMEM_QUERY_MAX + 1, ..Default::default() };
    expect_errno!(g.ioctl(GMEM_IOC_QUERY, &mut q), libc::E2BIG);
    let mut q = GmemQuery { argsz: argsz::<GmemQuery>(), addr: r.addr, npages: 4, states: 16, ..Default::default() };
    expect_errno!(g.ioctl(GMEM_IOC_QUERY, &mut q), libc::EFAULT);
    // `dup_mask` is an output: an untouched first page has no duplicates, whatever the
    // caller passed in (it used to come back unchanged).
    let mut states = [0u32; 4];
    let mut q = GmemQuery {
        argsz: argsz::<GmemQuery>(),
        addr: r.addr,
        npages: 4,
        states: states.as_mut_ptr() as u64,
        dup_mask: 0xdead,
        ..Default::default()
    };
    ok!(g.ioctl(GMEM_IOC_QUERY, &mut q));
    ensure!(q.dup_mask == 0, "QUERY of an untouched page returned dup_mask {:#x}", q.dup_mask);
    Ok(())
}

/// An ASYNC PREFETCH whose argument can be read but not written back (read-only memory)
/// fails with `EFAULT` and leaves no fence behind: more of them than the limit of 256
/// outstanding fences, and a good one after them still gets its fence (it used to get
/// `EBUSY`: each failed call kept an unreachable fence until close).
fn advise_async_unwritable_argument_leaves_no_fence() -> TestResult {
    let (g, _) = open()?;
    let r = ok!(g.alloc(4096));
    words(&r)[0] = 7;
    // SAFETY: a fresh anonymous page, made read-only below and unmapped at the end.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    ensure!(p != libc::MAP_FAILED, "mmap failed");
    let arg = p as *mut GmemAdvise;
    let a = GmemAdvise {
        argsz: argsz::<GmemAdvise>(),
        advice: GMEM_ADV_PREFETCH,
        addr: r.addr,
        len: 4096,
        dev: 0,
        flags: GMEM_ADVF_ASYNC,
        ..Default::default()
    };
    let res = (|| -> TestResult {
        // SAFETY: the page is ours and writable until the mprotect.
        unsafe { arg.write(a) };
        // SAFETY: our own mapping.
        ensure!(unsafe { libc::mprotect(p, 4096, libc::PROT_READ) } == 0, "mprotect failed");
        for k in 0..300 {
            // SAFETY: the kernel reads the argument (readable) and fails to write it back;
            // nothing here writes through the pointer.
            match g.ioctl(GMEM_IOC_ADVISE, unsafe { &mut *arg }) {
                Err(Errno(libc::EFAULT)) => {}
                other => return Err(format!("call {k}: {other:?}, expected EFAULT")),
            }
        }
        let f = ok!(g.advise(r.addr, 4096, GMEM_ADV_PREFETCH, 0, GMEM_ADVF_ASYNC));
        ok!(g.wait(f));
        ensure!(words(&r)[0] == 7, "data changed");
        Ok(())
    })();
    // SAFETY: our own mapping, no reference into it left.
    unsafe { libc::munmap(p, 4096) };
    res
}

fn sim_launch_bad_arguments() -> TestResult {
    let (g, s) = open()?;
    let r = ok!(g.alloc(16 * 4096));
    expect_errno!(s.checksum(r.addr, 0), libc::EINVAL);
    expect_errno!(s.checksum(r.addr + 2, 8), libc::EINVAL);
    expect_errno!(s.checksum(r.addr, 6), libc::EINVAL);
    expect_errno!(s.checksum(u64::MAX - 3, 8), libc::EOVERFLOW);
    // Outside any region and any readable mapping: the device kernel fails with the
    // fault's error. (Ordinary memory outside the regions is the device's too: t_sysmem.)
    expect_errno!(s.checksum(0x10000, 4096), libc::EFAULT);
    // A region with a PROT_NONE page right behind it: a range running past its end.
    // SAFETY: a fresh reservation of 17 pages, then /dev/gmem mapped over its first 16.
    let (base, region) = unsafe {
        let base = libc::mmap(
            std::ptr::null_mut(),
            17 * 4096,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        ensure!(base != libc::MAP_FAILED, "reservation failed");
        let fl = libc::MAP_SHARED | libc::MAP_FIXED;
        (base, libc::mmap(base, 16 * 4096, libc::PROT_READ | libc::PROT_WRITE, fl, g.fd(), 0))
    };
    ensure!(region == base, "mmap of /dev/gmem into the reservation failed");
    expect_errno!(s.checksum(base as u64 + 15 * 4096, 8192), libc::EFAULT);
    // SAFETY: our own mappings.
    unsafe { libc::munmap(base, 17 * 4096) };
    let mut l = SimLaunch { argsz: argsz::<SimLaunch>(), kernel: 42, a: r.addr, len: 4096, ..Default::default() };
    expect_errno!(s.launch_raw(&mut l), libc::EINVAL);
    Ok(())
}

/// One launch with explicit arguments (`count` and `seed` only matter for TOUCH).
fn launch(s: &libgmem::sim::Sim, kernel: u32, a: u64, b: u64, len: u64, count: u64) -> libgmem::Result<SimLaunch> {
    let mut l = SimLaunch { argsz: argsz::<SimLaunch>(), kernel, a, b, len, count, seed: 7, ..Default::default() };
    s.launch_raw(&mut l).map(|()| l)
}

/// Ranges at the top of the 64-bit space. Each of these panicked the guest (overflow in
/// the sim's kernels: the page-rounded end, or a 1 MiB prefault window computed past 2^64)
/// before the launch arguments were checked with page-rounded ends.
fn sim_launch_ranges_near_2_64() -> TestResult {
    use libgmem::sim::{K_AXPY, K_CHECKSUM, K_COPY, K_FILL, K_TOUCH};
    let (g, s) = open()?;
    let r = ok!(g.alloc(16 * 4096));
    ok!(s.fill(r.addr, r.len as u64, 5));
    // TOUCH over [0, 2^64 - 4092): its page count rounds past 2^64.
    expect_errno!(launch(&s, K_TOUCH, 0, 0, 0xFFFF_FFFF_FFFF_F004, 1), libc::EOVERFLOW);
    // The same up to the last page boundary fits: the random page is in no region.
    expect_errno!(launch(&s, K_TOUCH, 0, 0, 0xFFFF_FFFF_FFFF_F000, 1), libc::EFAULT);
    expect_errno!(launch(&s, K_TOUCH, 0xFFFF_FFFF_FFFF_0000, 0, 0xF000, 1000), libc::EFAULT);
    // FILL whose range fits but whose 1 MiB prefault window would not.
    expect_errno!(launch(&s, K_FILL, 0xFFFF_FFFF_FFFF_0000, 0, 0xF000, 0), libc::EFAULT);
    // Anywhere in the last MiB: a + len fits; in the last page, the rounded end does not.
    for kernel in [K_CHECKSUM, K_FILL, K_COPY, K_AXPY] {
        let other = r.addr;
        expect_errno!(launch(&s, kernel, 0xFFFF_FFFF_FFFF_FEE4, other, 4, 0), libc::EOVERFLOW);
        expect_errno!(launch(&s, kernel, 0xFFFF_FFFF_FFFF_F000, other, 4, 0), libc::EOVERFLOW);
        expect_errno!(launch(&s, kernel, 0xFFFF_FFFF_FFF0_0000, other, 4, 0), libc::EFAULT);
        expect_errno!(launch(&s, kernel, 0xFFFF_FFFF_FFFF_E000, other, 4096, 0), libc::EFAULT);
        expect_errno!(launch(&s, kernel, 0xFFFF_FFFF_FFFF_E000, other, 8192, 0), libc::EOVERFLOW);
    }
    // COPY's and AXPY's destination in the last MiB (the source is a valid region).
    for kernel in [K_COPY, K_AXPY] {
        expect_errno!(launch(&s, kernel, r.addr, 0xFFFF_FFFF_FFFF_FEE4, 4, 0), libc::EOVERFLOW);
        expect_errno!(launch(&s, kernel, r.addr, 0xFFFF_FFFF_FFF8_0000, 4096, 0), libc::EFAULT);
    }
    // A source in the last MiB fails before anything is written to the destination.
    expect_errno!(launch(&s, K_COPY, 0xFFFF_FFFF_FFF8_0000, r.addr, 4096, 0), libc::EFAULT);
    expect_errno!(launch(&s, K_COPY, u64::MAX - 3, r.addr, 4, 0), libc::EOVERFLOW);
    expect_errno!(launch(&s, K_FILL, 0, 0, u64::MAX - 3, 0), libc::EOVERFLOW);
    // Nothing above changed the region, and the device still works.
    let expect: Vec<u32> = (0..r.len as u32 / 4).map(|i| 5 + i).collect();
    ensure!(ok!(s.checksum(r.addr, r.len as u64)).result == checksum(&expect), "region changed by a refused launch");
    ensure!(words(&r) == expect.as_slice(), "CPU read-back wrong after hostile launches");
    Ok(())
}

/// Milliseconds since `t`.
fn ms_since(t: std::time::Instant) -> u128 {
    t.elapsed().as_millis()
}

/// Starts `launch` in a child, SIGKILLs it after 0.5 s and requires it to be reaped within
/// 30 s. Before launches checked for fatal signals, TOUCH with count 2^64-1 ran for hours
/// and a 1 GiB FILL for minutes, ignoring SIGKILL.
fn killed_within_bound(what: &str, launch: fn() -> i32) -> TestResult {
    // SAFETY: fork/kill/waitpid; the child only runs `launch` and exits.
    unsafe {
        let pid = libc::fork();
        if pid == 0 {
            // Not the harness's result pipe: a child that cannot be killed must not keep
            // the harness waiting for the end of this test's report.
            for fd in 3..1024 {
                libc::close(fd);
            }
            libc::_exit(launch());
        }
        std::thread::sleep(std::time::Duration::from_millis(500));
        let mut status = 0;
        if libc::waitpid(pid, &mut status, libc::WNOHANG) == pid {
            return Err(format!("{what}: the launch ended early (status {status:#x})"));
        }
        let t = std::time::Instant::now();
        libc::kill(pid, libc::SIGKILL);
        loop {
            if libc::waitpid(pid, &mut status, libc::WNOHANG) == pid {
                break;
            }
            if t.elapsed() > std::time::Duration::from_secs(30) {
                return Err(format!("{what}: not reaped 30 s after SIGKILL"));
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        ensure!(libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGKILL, "{what}: status {status:#x}");
        println!("GMEM-INFO {what}: reaped {} ms after SIGKILL", ms_since(t));
    }
    Ok(())
}

fn sim_launch_is_killable() -> TestResult {
    let i0 = ok!(ok!(libgmem::sim::Sim::open(0).map_err(libgmem::Errno::from)).info());
    let before = (i0.ptes, i0.ptes_2m);
    killed_within_bound("TOUCH count=2^64-1", || {
        let Ok((g, s)) = open() else { return 10 };
        let Ok(r) = g.alloc(64 * 4096) else { return 11 };
        let _ = s.touch(r.addr, r.len as u64, u64::MAX, 1, true);
        12 // the launch returned: it must not
    })?;
    killed_within_bound("FILL 1 GiB", || {
        let Ok((g, s)) = open() else { return 10 };
        let Ok(r) = g.alloc(1 << 30) else { return 11 };
        let _ = s.fill(r.addr, r.len as u64, 1);
        12
    })?;
    // The killed launches left no PTE behind, and the device works afterwards. The last
    // reference to a killed process's address space may be a gmem worker's (a read-ahead
    // or a prefetch lane holds it for the block it is on), which then runs the teardown
    // when it lets go: so the PTEs go at most one block's work after the reap.
    let (g, s) = open()?;
    let t = std::time::Instant::now();
    let mut i1 = ok!(s.info());
    while (i1.ptes, i1.ptes_2m) != before && t.elapsed() < std::time::Duration::from_secs(10) {
        std::thread::sleep(std::time::Duration::from_millis(20));
        i1 = ok!(s.info());
    }
    ensure!((i1.ptes, i1.ptes_2m) == before, "device PTEs left 10 s after the killed launches");
    let r = ok!(g.alloc(1 << 20));
    ok!(s.fill(r.addr, r.len as u64, 9));
    let expect: Vec<u32> = (0..r.len as u32 / 4).map(|i| 9 + i).collect();
    ensure!(ok!(s.checksum(r.addr, r.len as u64)).result == checksum(&expect), "checksum wrong after killed launches");
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
        Test {
            name: "advise_async_unwritable_argument_leaves_no_fence",
            f: advise_async_unwritable_argument_leaves_no_fence,
        },
        Test { name: "sim_launch_bad_arguments", f: sim_launch_bad_arguments },
        Test { name: "sim_launch_is_killable", f: sim_launch_is_killable },
        Test { name: "sim_launch_ranges_near_2_64", f: sim_launch_ranges_near_2_64 },
        Test { name: "still_works_after_bad_input", f: still_works_after_bad_input },
    ]
}
