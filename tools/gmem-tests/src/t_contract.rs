// SPDX-License-Identifier: GPL-2.0
//! Behaviours the documentation promises that used to differ from it (issue item 11):
//! debugfs `control` refuses a write of only whitespace; an O_RDONLY fd can be mapped
//! read-only and shared; ADVISE whose own argument struct lies in the range it pins works.

use crate::harness::{child_signal, open, Test, TestResult};
use crate::t_overcommit::control_refused;
use crate::{ensure, ok};
use libgmem::*;

fn control_rejects_whitespace_only() -> TestResult {
    for text in [" ", "\n", " \t \n"] {
        control_refused(text)?;
    }
    Ok(())
}

fn readonly_fd_maps_read_only_shared() -> TestResult {
    let (g, s) = open()?;
    let ro = std::fs::File::open("/dev/gmem").map_err(|e| e.to_string())?;
    let fd = std::os::fd::AsRawFd::as_raw_fd(&ro);
    let len = 16 * 4096;
    // SAFETY: a new shared mapping of our own fd; unmapped below.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED, fd, 0) };
    ensure!(
        p != libc::MAP_FAILED,
        "mmap(PROT_READ, MAP_SHARED) of an O_RDONLY fd failed: {}",
        std::io::Error::last_os_error()
    );
    let addr = p as u64;
    // The device writes it; the CPU reads what the device wrote, and cannot write.
    ok!(s.fill(addr, len as u64, 40));
    // SAFETY: reading inside the mapping.
    let v = unsafe { std::ptr::read_volatile((addr + 4096 * 2 + 4) as *const u32) };
    let sig = child_signal(|| {
        // SAFETY: a deliberate write to a read-only mapping, in a child... which has no
        // mapping there (VM_DONTCOPY): SIGSEGV either way, and the parent's data is intact.
        unsafe { std::ptr::write_volatile(addr as *mut u32, 1) };
    });
    ok!(g.query(addr, 16));
    // SAFETY: unmapping what we mapped.
    unsafe { libc::munmap(p, len) };
    ensure!(v == 40 + 2 * 1024 + 1, "CPU read {v}, device wrote {}", 40 + 2 * 1024 + 1);
    ensure!(sig == Some(libc::SIGSEGV), "write in child: {sig:?}");
    Ok(())
}

fn pin_whose_argument_lies_in_the_pinned_range() -> TestResult {
    let (g, _s) = open()?;
    let r = ok!(g.alloc(8 * 4096));
    let arg = r.addr as *mut GmemAdvise;
    // SAFETY: the struct fits in the region's first page, which is mapped read/write.
    unsafe {
        arg.write(GmemAdvise {
            argsz: argsz::<GmemAdvise>(),
            advice: GMEM_ADV_PIN,
            addr: r.addr,
            len: r.len as u64,
            dev: 0,
            ..Default::default()
        })
    };
    // SAFETY: ADVISE with a pointer to its argument struct.
    let res = unsafe { ioctl_raw(g.fd(), GMEM_IOC_ADVISE, arg) };
    ensure!(res.is_ok(), "PIN with its argument inside the pinned range: {res:?}");
    let q = ok!(r.query());
    ensure!(q.iter().all(|w| q_loc(*w) == GMEM_LOC_DEVICE && w & GMEM_Q_PINNED != 0), "not every page pinned: {q:x?}");
    ok!(r.advise(GMEM_ADV_UNPIN, GMEM_NO_DEVICE));
    // SAFETY: the page is home again after the CPU touches it (unpinned).
    let back = unsafe { arg.read() };
    ensure!(
        back.fence == 0 && back.advice == GMEM_ADV_PIN,
        "argument struct after PIN: fence {} advice {}",
        back.fence,
        back.advice
    );
    Ok(())
}

pub fn tests() -> Vec<Test> {
    vec![
        Test { name: "control_rejects_whitespace_only", f: control_rejects_whitespace_only },
        Test { name: "readonly_fd_maps_read_only_shared", f: readonly_fd_maps_read_only_shared },
        Test { name: "pin_whose_argument_lies_in_the_pinned_range", f: pin_whose_argument_lies_in_the_pinned_range },
    ]
}
