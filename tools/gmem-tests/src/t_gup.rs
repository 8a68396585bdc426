// SPDX-License-Identifier: GPL-2.0
//! Pinned I/O (issue item 5): GMEM memory refuses get_user_pages (VM_IO), so no DMA or pipe
//! buffer can keep a host page that GMEM later drops or replaces; ptrace and
//! /proc/PID/mem still read and write the right data through the VMA's `.access`.

use crate::harness::{open, words, Test, TestResult};
use crate::{ensure, ok};
use libgmem::sim::checksum;
use libgmem::*;
use std::os::unix::fs::FileExt;

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn gup_refused_remote_access_sees_device_data() -> TestResult {
    let (g, s) = open()?;
    let r = ok!(g.alloc(16 * 4096));
    ok!(s.fill(r.addr, r.len as u64, 0x5000));
    ensure!(ok!(r.query()).iter().all(|w| q_loc(*w) == GMEM_LOC_DEVICE), "fill did not leave the data on the device");

    // process_vm_readv pins with GUP: refused. (The guest kernel is built without
    // CROSS_MEMORY_ATTACH, where the call itself is ENOSYS; vmsplice below is the GUP check
    // that runs here either way.)
    let mut buf = [0u8; 4096];
    let local = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    let remote = libc::iovec { iov_base: r.addr as *mut libc::c_void, iov_len: 4096 };
    // SAFETY: both iovecs describe valid memory of this process.
    let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
    ensure!(
        n == -1 && matches!(errno(), libc::EFAULT | libc::ENOSYS),
        "process_vm_readv on GMEM memory: {n} (errno {})",
        errno()
    );

    // vmsplice would let a pipe hold the host page: refused.
    let (n, e) = vmsplice_page(r.addr + 4096)?;
    ensure!(n == -1 && e == libc::EFAULT, "vmsplice of GMEM memory: {n} (errno {e})");

    // /proc/self/mem (the ptrace path) reads the device's data: page 3, words 2 and 3.
    let mem = std::fs::OpenOptions::new().read(true).write(true).open("/proc/self/mem").map_err(|e| e.to_string())?;
    let mut w = [0u8; 8];
    mem.read_exact_at(&mut w, r.addr + 3 * 4096 + 8).map_err(|e| format!("read /proc/self/mem: {e}"))?;
    let got = [u32::from_le_bytes([w[0], w[1], w[2], w[3]]), u32::from_le_bytes([w[4], w[5], w[6], w[7]])];
    let want = [0x5000 + 3 * 1024 + 2, 0x5000 + 3 * 1024 + 3];
    ensure!(got == want, "/proc/self/mem read {got:x?}, device wrote {want:x?}");
    let q = ok!(r.query());
    ensure!(q_loc(q[3]) == GMEM_LOC_HOST, "page read through /proc/self/mem is not home: {:#x}", q[3]);

    // A write through it, across a page boundary (the kernel calls `.access` per page),
    // is what the device then reads.
    let poke = 0xdead_beef_u32.to_le_bytes();
    let at = r.addr + 6 * 4096 - 2;
    mem.write_all_at(&poke, at).map_err(|e| format!("write /proc/self/mem: {e}"))?;
    let mut expect: Vec<u32> = (0..r.len as u32 / 4).map(|i| 0x5000 + i).collect();
    let first = (6 * 4096 - 4) / 4;
    expect[first] = (expect[first] & 0x0000_ffff) | 0xbeef_0000;
    expect[first + 1] = (expect[first + 1] & 0xffff_0000) | 0xdead;
    let o = ok!(s.checksum(r.addr, r.len as u64));
    ensure!(o.result == checksum(&expect), "device does not see the /proc/self/mem write");
    ensure!(words(&r)[first] == expect[first] && words(&r)[first + 1] == expect[first + 1], "CPU does not see it");
    Ok(())
}

/// vmsplice of one page at `addr` into a fresh pipe: the call's result and errno.
fn vmsplice_page(addr: u64) -> std::result::Result<(isize, i32), String> {
    let mut fds = [0i32; 2];
    // SAFETY: pipe(2) into a local array.
    ensure!(unsafe { libc::pipe(fds.as_mut_ptr()) } == 0, "pipe failed");
    let iov = libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: 4096 };
    // SAFETY: the iovec describes our own mapped memory; the fds are ours.
    let n = unsafe { libc::vmsplice(fds[1], &iov, 1, 0) };
    let e = errno();
    // SAFETY: closing our own fds.
    unsafe {
        libc::close(fds[0]);
        libc::close(fds[1]);
    }
    Ok((n, e))
}

/// Pages the CPU has mapped (written, or only read) are refused to GUP too: GUP-fast walks
/// the page tables without looking at the VMA, so GMEM maps host pages with special PTEs
/// (it used to map them with normal ones, and vmsplice pinned them). An ordinary page is
/// the control: vmsplice takes it.
fn gup_fast_refused_on_cpu_mapped_pages() -> TestResult {
    let (g, _) = open()?;
    let r = ok!(g.alloc(16 * 4096));
    let w = words(&r);
    w[0] = 1; // page 0: written by the CPU
    let seen = w[1024 + 5]; // page 1: read only
    ensure!(seen == 0, "fresh page read {seen}");
    for (page, what) in [(0u64, "written"), (1, "read")] {
        let (n, e) = vmsplice_page(r.addr + page * 4096)?;
        ensure!(n == -1 && e == libc::EFAULT, "vmsplice of a GMEM page the CPU {what}: {n} (errno {e})");
    }
    let ordinary = vec![7u8; 2 * 4096];
    let a = (ordinary.as_ptr() as u64 + 4095) & !4095;
    let (n, e) = vmsplice_page(a)?;
    ensure!(n == 4096, "vmsplice of an ordinary page: {n} (errno {e})");
    // The CPU's data is intact and the pages still work.
    ensure!(w[0] == 1 && w[1024 + 5] == 0, "data changed");
    w[1024 + 5] = 3;
    ensure!(w[1024 + 5] == 3, "write after the refused pins lost");
    Ok(())
}

pub fn tests() -> Vec<Test> {
    vec![
        Test { name: "gup_refused_remote_access_sees_device_data", f: gup_refused_remote_access_sees_device_data },
        Test { name: "gup_fast_refused_on_cpu_mapped_pages", f: gup_fast_refused_on_cpu_mapped_pages },
    ]
}
