// SPDX-License-Identifier: GPL-2.0
//! Processes: isolation, fork, exit with pages on the device, and driver unregistration
//! (rmmod of the simulated device) with data resident on it.

use crate::harness::{child_exit, child_signal, open, sh, words, Test, TestResult};
use crate::{ensure, expect_errno, ok};
use libgmem::sim::Sim;
use libgmem::*;

fn processes_are_isolated() -> TestResult {
    let (g, _) = open()?;
    let r = ok!(g.alloc(1 << 20));
    words(&r)[0] = 0xabcd;
    let addr = r.addr;
    let code = child_exit(|| {
        // Another process (its own open) cannot reach the parent's region...
        let Ok(g2) = Gmem::open() else { return 10 };
        if g2.query(addr, 1) != Err(Errno(libc::ENOENT)) {
            return 11;
        }
        if g2.free_raw(addr) != Err(Errno(libc::ENOENT)) {
            return 12;
        }
        if g2.advise(addr, 4096, GMEM_ADV_DONTNEED, GMEM_NO_DEVICE, 0) != Err(Errno(libc::ENOENT)) {
            return 13;
        }
        // ...nor through its device: the address is not in the child's space.
        if let Ok(s) = Sim::open(0) {
            if s.checksum(addr, 4096).map(|_| ()) != Err(Errno(libc::EFAULT)) {
                return 14;
            }
        }
        0
    });
    ensure!(code == 0, "child could reach the parent's region (code {code})");
    ensure!(words(&r)[0] == 0xabcd, "parent data changed");
    Ok(())
}

fn fork_child_does_not_inherit() -> TestResult {
    let (g, s) = open()?;
    let r = ok!(g.alloc(1 << 20));
    ok!(s.fill(r.addr, r.len as u64, 3));
    let addr = r.addr;
    let sig = child_signal(|| {
        // SAFETY: deliberately touching the parent's region in a forked child (VM_DONTCOPY:
        // no mapping there).
        unsafe { std::ptr::read_volatile(addr as *const u32) };
    });
    ensure!(sig == Some(libc::SIGSEGV), "child access: {:?}", sig);
    // The inherited fd belongs to the parent's space: ioctls from the child are refused.
    let fd = g.fd();
    let code = child_exit(|| {
        let mut q = GmemQuery { argsz: argsz::<GmemQuery>(), addr, npages: 1, ..Default::default() };
        let mut st = [0u32; 1];
        q.states = st.as_mut_ptr() as u64;
        // SAFETY: QUERY with its argument struct.
        match unsafe { ioctl_raw(fd, GMEM_IOC_QUERY, &mut q) } {
            Err(Errno(e)) if e == libc::EPERM => 0,
            _ => 1,
        }
    });
    ensure!(code == 0, "inherited fd usable by the child");
    ensure!(words(&r)[7] == 10, "parent data wrong after fork");
    Ok(())
}

fn exit_with_pages_on_device() -> TestResult {
    let (_, s) = open()?;
    let i0 = ok!(s.info());
    let before = (i0.ptes, i0.ptes_2m);
    let code = child_exit(|| {
        let Ok((g, s)) = open() else { return 10 };
        let Ok(r) = g.alloc(1 << 20) else { return 11 };
        if s.fill(r.addr, r.len as u64, 1).is_err() {
            return 12;
        }
        r.leak();
        0 // exit without FREE: the kernel tears the region down
    });
    ensure!(code == 0, "child failed: {code}");
    let i1 = ok!(s.info());
    ensure!((i1.ptes, i1.ptes_2m) == before, "device PTEs left after child exit");
    Ok(())
}

/// Must run last of the tests that use the devices: it reloads the driver.
fn driver_unregister_evacuates() -> TestResult {
    let g = Gmem::open().map_err(|e| e.to_string())?;
    let r2 = ok!(g.alloc(1 << 20));
    let r = {
        let s0 = Sim::open(0).map_err(|e| e.to_string())?;
        let s1 = Sim::open(1).map_err(|e| e.to_string())?;
        ok!(r2.advise(GMEM_ADV_PIN, 1));
        ok!(s1.fill(r2.addr, r2.len as u64, 200));
        // Twice device 0's memory: victims are parked on device 1 and the background
        // worker (pre-eviction, write-back of parked victims) is busy when the driver goes.
        let cap = ok!(s0.info()).nr_frames * 4096;
        let r = ok!(g.alloc(2 * cap));
        ok!(s0.fill(r.addr, r.len as u64, 100));
        let q = ok!(r.query());
        ensure!(q.iter().any(|w| q_loc(*w) == GMEM_LOC_DEVICE), "nothing on a device before rmmod");
        r
    };
    sh("rmmod gmem_sim")?;
    let q = ok!(r.query());
    crate::harness::all_at(&q, GMEM_LOC_HOST, 0)?;
    crate::harness::all_at(&ok!(r2.query()), GMEM_LOC_HOST, 0)?;
    let v = ok!(g.version());
    ensure!(v.nr_devices == 0, "devices still registered: {}", v.nr_devices);
    let w = words(&r);
    for (i, &x) in w.iter().enumerate() {
        ensure!(x == 100u32.wrapping_add(i as u32), "word {i} lost in evacuation: {x}");
    }
    let w2 = words(&r2);
    for (i, &x) in w2.iter().enumerate() {
        ensure!(x == 200 + i as u32, "pinned word {i} lost in evacuation: {x}");
    }
    sh("insmod /lib/gmem/gmem_sim.ko nr_devices=2 mem_mib=16")?;
    let s0 = Sim::open(0).map_err(|e| e.to_string())?;
    let o = ok!(s0.checksum(r.addr, r.len as u64));
    let expect: Vec<u32> = (0..r.len as u32 / 4).map(|i| 100u32.wrapping_add(i)).collect();
    ensure!(o.result == libgmem::sim::checksum(&expect), "re-registered device reads wrong data");
    expect_errno!(g.free_raw(r.addr + 1), libc::EINVAL);
    Ok(())
}

pub fn tests() -> Vec<Test> {
    vec![
        Test { name: "processes_are_isolated", f: processes_are_isolated },
        Test { name: "fork_child_does_not_inherit", f: fork_child_does_not_inherit },
        Test { name: "exit_with_pages_on_device", f: exit_with_pages_on_device },
        Test { name: "driver_unregister_evacuates", f: driver_unregister_evacuates },
    ]
}
