// SPDX-License-Identifier: GPL-2.0
//! Allocation, CPU <-> device data paths, residency after each step.

use crate::harness::{all_at, open, words, Test, TestResult};
use crate::{ensure, expect_errno, ok};
use libgmem::sim::checksum;
use libgmem::*;

const MIB: u64 = 1 << 20;

fn alloc_query_free() -> TestResult {
    let (g, _) = open()?;
    let r = ok!(g.alloc(MIB));
    ensure!(r.addr % 4096 == 0, "unaligned address {:#x}", r.addr);
    all_at(&ok!(r.query()), GMEM_LOC_NONE, 0)?;
    let w = words(&r);
    ensure!(w.iter().all(|&x| x == 0), "fresh memory not zero");
    all_at(&ok!(r.query()), GMEM_LOC_HOST, 0)?;
    w[5] = 42;
    let addr = r.addr;
    drop(r);
    expect_errno!(g.query(addr, 1), libc::ENOENT);
    // The address range is gone from the process too.
    let sig = crate::harness::child_signal(|| {
        // SAFETY: deliberately touching freed memory in a child: must fault.
        unsafe { std::ptr::read_volatile(addr as *const u32) };
    });
    ensure!(sig == Some(libc::SIGSEGV), "read after FREE: {:?}", sig);
    Ok(())
}

fn cpu_write_device_checksum() -> TestResult {
    let (g, s) = open()?;
    let r = ok!(g.alloc(MIB));
    let w = words(&r);
    for (i, x) in w.iter_mut().enumerate() {
        *x = (i as u32).wrapping_mul(2654435761);
    }
    // Computed before the device runs: reading `w` afterwards would migrate pages back.
    let expect = checksum(w);
    let o = ok!(s.checksum(r.addr, r.len as u64));
    ensure!(o.result == expect, "device checksum {:#x} != cpu {:#x}", o.result, expect);
    ensure!(o.faults == r.pages() as u64, "faults {} != pages {}", o.faults, r.pages());
    ensure!(o.batches >= 1 && o.batches <= o.faults, "batches {}", o.batches);
    all_at(&ok!(r.query()), GMEM_LOC_DEVICE, 0)?;
    // Resident now: a second run faults nothing.
    let o2 = ok!(s.checksum(r.addr, r.len as u64));
    ensure!(o2.faults == 0 && o2.result == o.result, "second run: {:?}", o2);
    Ok(())
}

fn device_write_cpu_read() -> TestResult {
    let (g, s) = open()?;
    let r = ok!(g.alloc(2 * MIB));
    ok!(s.fill(r.addr, r.len as u64, 1000));
    let q = ok!(r.query());
    all_at(&q, GMEM_LOC_DEVICE, 0)?;
    ensure!(q.iter().all(|w| w & GMEM_Q_DIRTY != 0), "device-written pages not dirty");
    let w = words(&r);
    for (i, &x) in w.iter().enumerate() {
        ensure!(x == 1000u32.wrapping_add(i as u32), "word {i} = {x}");
    }
    let q = ok!(r.query());
    all_at(&q, GMEM_LOC_HOST, 0)?;
    ensure!(q.iter().all(|w| w & GMEM_Q_CPU_MAPPED != 0), "pages not CPU-mapped after reads");
    Ok(())
}

fn partial_ranges_and_offsets() -> TestResult {
    let (g, s) = open()?;
    let r = ok!(g.alloc(64 * 1024));
    // A fill that starts and ends inside pages.
    ok!(s.fill(r.addr + 4092, 8200, 7));
    let w = words(&r);
    ensure!(w[1022] == 0 && w[1023] == 7 && w[1024] == 8, "head wrong: {} {} {}", w[1022], w[1023], w[1024]);
    let last = 1023 + 8200 / 4 - 1;
    ensure!(w[last] == 7 + (8200 / 4 - 1) as u32 && w[last + 1] == 0, "tail wrong");
    // COPY between different in-page offsets, verified by the CPU.
    ok!(s.copy(r.addr + 4092, r.addr + 40000, 8200));
    let w = words(&r);
    for k in 0..8200 / 4 {
        ensure!(w[10000 + k] == 7 + k as u32, "copy word {k} = {}", w[10000 + k]);
    }
    // CHECKSUMs that start and end inside pages, at every word offset modulo 16 bytes and
    // with word counts that are not multiples of four (the device reads four words at a
    // time where it can, then one by one), against the CPU's checksum of the same words.
    for (start, n) in [(4092u64, 8200u64), (4, 4), (8, 20), (12, 4100), (40000, 8196), (4096 * 3 - 4, 12)] {
        let (a, b) = ((start / 4) as usize, ((start + n) / 4) as usize);
        let o = ok!(s.checksum(r.addr + start, n));
        ensure!(o.result == checksum(&w[a..b]), "checksum of [{start}, +{n}) differs from the CPU's");
    }
    Ok(())
}

fn ping_pong_many_rounds() -> TestResult {
    let (g, s) = open()?;
    let r = ok!(g.alloc(256 * 1024));
    for round in 0..40u32 {
        let w = words(&r);
        for (i, x) in w.iter_mut().enumerate() {
            *x = round ^ i as u32;
        }
        let expect = checksum(words(&r));
        let o = ok!(s.checksum(r.addr, r.len as u64));
        ensure!(o.result == expect, "round {round}: device saw stale data");
        // The device updates in place: y = 3*y + y = 4y via axpy on itself.
        ok!(s.axpy(r.addr, r.addr, r.len as u64, 3));
        let w = words(&r);
        for (i, &x) in w.iter().enumerate() {
            ensure!(x == (round ^ i as u32).wrapping_mul(4), "round {round} word {i}: {x}");
        }
    }
    Ok(())
}

fn two_devices_one_space() -> TestResult {
    let (g, s0) = open()?;
    let s1 = libgmem::sim::Sim::open(1).map_err(|e| format!("sim1: {e}"))?;
    let r = ok!(g.alloc(MIB));
    ok!(s0.fill(r.addr, r.len as u64, 5));
    all_at(&ok!(r.query()), GMEM_LOC_DEVICE, 0)?;
    let id1 = ok!(s1.info()).gmem_id as u32;
    // Device 1 writes: pages migrate device to device.
    ok!(s1.axpy(r.addr, r.addr, r.len as u64, 1));
    all_at(&ok!(r.query()), GMEM_LOC_DEVICE, id1)?;
    let o = ok!(s0.checksum(r.addr, r.len as u64));
    let expect: Vec<u32> = (0..r.len as u32 / 4).map(|i| (5 + i) * 2).collect();
    ensure!(o.result == checksum(&expect), "device 0 read after device 1 wrote: mismatch");
    let w = words(&r);
    ensure!(w == expect.as_slice(), "CPU read after two devices: mismatch");
    Ok(())
}

fn munmap_with_pages_on_device() -> TestResult {
    let (g, s) = open()?;
    let i0 = ok!(s.info());
    let (before, before_2m) = (i0.ptes, i0.ptes_2m);
    let r = ok!(g.alloc(MIB));
    ok!(s.fill(r.addr, r.len as u64, 1));
    ensure!(ok!(s.info()).ptes == before + 256, "device PTEs not installed");
    // SAFETY: unmapping our own GMEM mapping; the region must be torn down.
    let rc = unsafe { libc::munmap(r.as_ptr().cast(), r.len) };
    ensure!(rc == 0, "munmap failed");
    let addr = r.leak();
    expect_errno!(g.query(addr, 1), libc::ENOENT);
    let i = ok!(s.info());
    ensure!(i.ptes == before && i.ptes_2m == before_2m, "device PTEs left after munmap");
    Ok(())
}

fn partial_munmap_and_mremap_refused() -> TestResult {
    let (g, _) = open()?;
    let r = ok!(g.alloc(MIB));
    words(&r)[0] = 9;
    // SAFETY: attempts to split our own mapping; the kernel must refuse.
    let rc = unsafe { libc::munmap(r.as_ptr().add(4096).cast(), 4096) };
    ensure!(rc == -1 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL), "partial munmap allowed");
    // SAFETY: attempts to move our own mapping; the kernel must refuse.
    let p = unsafe { libc::mremap(r.as_ptr().cast(), r.len, 2 * r.len, libc::MREMAP_MAYMOVE) };
    ensure!(p == libc::MAP_FAILED, "mremap allowed");
    ensure!(words(&r)[0] == 9, "data lost after refused munmap/mremap");
    all_at(&ok!(g.query(r.addr, 1)), GMEM_LOC_HOST, 0)?;
    Ok(())
}

fn mmap_contract() -> TestResult {
    let (g, s) = open()?;
    // A plain shared mmap of the fd at offset 0 is an allocation with default advice.
    // SAFETY: mapping /dev/gmem as documented.
    let p = unsafe {
        libc::mmap(std::ptr::null_mut(), 65536, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, g.fd(), 0)
    };
    ensure!(p != libc::MAP_FAILED, "mmap of /dev/gmem failed");
    ok!(s.fill(p as u64, 65536, 3));
    // SAFETY: the mapping is 64 KiB.
    ensure!(unsafe { *(p as *const u32).add(100) } == 103, "mmap region data wrong");
    ok!(g.free_raw(p as u64));
    // Private mappings and non-zero offsets are refused.
    // SAFETY: as above; must fail.
    let q = unsafe { libc::mmap(std::ptr::null_mut(), 4096, libc::PROT_READ, libc::MAP_PRIVATE, g.fd(), 0) };
    ensure!(q == libc::MAP_FAILED, "private mmap allowed");
    // SAFETY: as above; must fail.
    let q = unsafe { libc::mmap(std::ptr::null_mut(), 4096, libc::PROT_READ, libc::MAP_SHARED, g.fd(), 4096) };
    ensure!(q == libc::MAP_FAILED, "mmap at offset 4096 allowed");
    Ok(())
}

pub fn tests() -> Vec<Test> {
    vec![
        Test { name: "alloc_query_free", f: alloc_query_free },
        Test { name: "cpu_write_device_checksum", f: cpu_write_device_checksum },
        Test { name: "device_write_cpu_read", f: device_write_cpu_read },
        Test { name: "partial_ranges_and_offsets", f: partial_ranges_and_offsets },
        Test { name: "ping_pong_many_rounds", f: ping_pong_many_rounds },
        Test { name: "two_devices_one_space", f: two_devices_one_space },
        Test { name: "munmap_with_pages_on_device", f: munmap_with_pages_on_device },
        Test { name: "partial_munmap_and_mremap_refused", f: partial_munmap_and_mremap_refused },
        Test { name: "mmap_contract", f: mmap_contract },
    ]
}
