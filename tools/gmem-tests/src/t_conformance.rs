// SPDX-License-Identifier: GPL-2.0
//! The driver conformance suite: what every GMEM driver must get right, run against each
//! driver through a small adapter ([`Accel`]: fill, checksum and gather kernels run on the
//! device, its info, hot-unplug). A new driver joins by implementing [`Accel`] for its
//! user API and adding one line per scenario to `tests()`.
//!
//! Scenarios, each checked on data (never only "it did not fail"):
//! - `registers`: gmem lists the device with the capacity the driver declared;
//! - `upload` (H2D copy + map): the device reads what the CPU wrote;
//! - `zero` (ZERO copy): a page first touched by the device reads as zeros;
//! - `download` (D2H copy + unmap + TLB): the CPU reads what the device wrote, and the
//!   device's page tables are empty once the region is freed;
//! - `peer` (D2D copy): a second device of the driver reads what the first wrote;
//! - `overcommit` (eviction: D2H/D2D, unmap, TLB under pressure): a region twice the
//!   device's memory, written and read back by the device, then by the CPU;
//! - `fault_batch`: a batch of faults with duplicates and addresses anywhere in their
//!   pages, in scrambled order, over several 2 MiB blocks;
//! - `unplug_under_load`: the device is hot-unplugged while two processes run kernels
//!   on it; every launch ends cleanly (done, or ENODEV), each process then reads exactly
//!   its own data on the CPU, nothing stays on the device, the other device keeps
//!   working, and the driver unloads with no frame left in use.

use crate::harness::{sh, words, Link, Test, TestResult};
use crate::{ensure, ok};
use libgmem::csample::CSample;
use libgmem::debugfs;
use libgmem::sim::{checksum, Outcome, Sim};
use libgmem::*;

/// What the suite needs of a driver's device (its own user API, adapted).
pub trait Accel {
    /// gmem's id of the device.
    fn gmem_id(&self) -> Result<u32>;
    /// Capacity in frames, as the driver reports it.
    fn nr_frames(&self) -> Result<u64>;
    /// Valid entries in the device's page tables (all contexts).
    fn ptes(&self) -> Result<u64>;
    /// Device writes `a[i] = value + i` over `len` bytes at `addr`.
    fn fill(&self, addr: u64, len: u64, value: u32) -> Result<Outcome>;
    /// Device computes FNV-1a over the words of `[addr, addr + len)`.
    fn checksum(&self, addr: u64, len: u64) -> Result<Outcome>;
    /// Device reads the word at each address, all faulted in as one batch.
    fn gather(&self, addrs: &[u64]) -> Result<Vec<u32>>;
    /// Hot-unplug.
    fn unplug(&self) -> Result<()>;
}

impl Accel for Sim {
    fn gmem_id(&self) -> Result<u32> {
        Ok(self.info()?.gmem_id as u32)
    }
    fn nr_frames(&self) -> Result<u64> {
        Ok(self.info()?.nr_frames)
    }
    fn ptes(&self) -> Result<u64> {
        let i = self.info()?;
        Ok(i.ptes + i.ptes_2m)
    }
    fn fill(&self, addr: u64, len: u64, value: u32) -> Result<Outcome> {
        Sim::fill(self, addr, len, value)
    }
    fn checksum(&self, addr: u64, len: u64) -> Result<Outcome> {
        Sim::checksum(self, addr, len)
    }
    fn gather(&self, addrs: &[u64]) -> Result<Vec<u32>> {
        Ok(Sim::gather(self, addrs)?.0)
    }
    fn unplug(&self) -> Result<()> {
        Sim::unplug(self)
    }
}

impl Accel for CSample {
    fn gmem_id(&self) -> Result<u32> {
        Ok(self.info()?.gmem_id as u32)
    }
    fn nr_frames(&self) -> Result<u64> {
        Ok(self.info()?.nr_frames)
    }
    fn ptes(&self) -> Result<u64> {
        Ok(self.info()?.ptes)
    }
    fn fill(&self, addr: u64, len: u64, value: u32) -> Result<Outcome> {
        CSample::fill(self, addr, len, value)
    }
    fn checksum(&self, addr: u64, len: u64) -> Result<Outcome> {
        CSample::checksum(self, addr, len)
    }
    fn gather(&self, addrs: &[u64]) -> Result<Vec<u32>> {
        Ok(CSample::gather(self, addrs)?.0)
    }
    fn unplug(&self) -> Result<()> {
        CSample::unplug(self)
    }
}

/// A driver under test: how to load it and open its devices (it must have two).
pub struct Driver {
    module: &'static str,
    insmod: &'static str,
    open: fn(usize) -> std::io::Result<Box<dyn Accel>>,
}

const SIM: Driver = Driver {
    module: "gmem_sim",
    insmod: "insmod /lib/gmem/gmem_sim.ko nr_devices=2 mem_mib=16",
    open: |n| Ok(Box::new(Sim::open(n)?)),
};

const CSAMPLE: Driver = Driver {
    module: "gmem_csample",
    insmod: "insmod /lib/gmem/gmem_csample.ko nr_devices=2 mem_kib=2048",
    open: |n| Ok(Box::new(CSample::open(n)?)),
};

impl Driver {
    /// Loads the driver if it is not loaded; opens device `n`.
    fn dev(&self, n: usize) -> std::result::Result<Box<dyn Accel>, String> {
        if !std::path::Path::new(&format!("/sys/module/{}", self.module)).exists() {
            sh(self.insmod)?;
        }
        (self.open)(n).map_err(|e| format!("open device {n} of {}: {e}", self.module))
    }

    /// Unloads and loads the driver again; fails if gmem logged a frame left in use or a
    /// callback after unregistration.
    fn reload(&self) -> TestResult {
        let _ = std::process::Command::new("dmesg").arg("-c").output();
        sh(&format!("rmmod {}", self.module))?;
        let log = std::process::Command::new("dmesg").arg("-c").output().map_err(|e| e.to_string())?;
        let log = String::from_utf8_lossy(&log.stdout);
        ensure!(!log.contains("still in use") && !log.contains("callback after"), "unload of {}:\n{log}", self.module);
        sh(self.insmod)
    }
}

/// A pattern the CPU writes: word i of a region tagged `tag`.
fn pattern(tag: u32, i: usize) -> u32 {
    tag.wrapping_mul(0x9e37_79b9).wrapping_add(i as u32)
}

/// Sum of one counter over all devices.
fn total(key: &str) -> u64 {
    debugfs::counters().map(|c| c.values().filter_map(|m| m.get(key)).sum()).unwrap_or(0)
}

fn registers(d: &Driver) -> TestResult {
    let (a, b) = (d.dev(0)?, d.dev(1)?);
    let (ia, ib) = (ok!(a.gmem_id()), ok!(b.gmem_id()));
    ensure!(ia != ib, "both devices have gmem id {ia}");
    for (dev, id) in [(&a, ia), (&b, ib)] {
        let frames = ok!(dev.nr_frames());
        let listed = debugfs::counter(id, "frames");
        ensure!(listed == Some(frames), "gmem lists device {id} with {listed:?} frames, driver says {frames}");
        ensure!(debugfs::counter(id, "alive") == Some(1), "device {id} not alive in debugfs");
    }
    Ok(())
}

fn upload(d: &Driver) -> TestResult {
    let dev = d.dev(0)?;
    let g = Gmem::open().map_err(|e| e.to_string())?;
    let r = ok!(g.alloc(64 * 4096));
    let w = words(&r);
    for (i, x) in w.iter_mut().enumerate() {
        *x = pattern(1, i);
    }
    // The CPU's checksum first: reading the words later would bring the pages home.
    let want = checksum(w);
    let h2d = total("migrated.h2d");
    let got = ok!(dev.checksum(r.addr, r.len as u64)).result;
    crate::harness::all_at(&ok!(r.query()), GMEM_LOC_DEVICE, ok!(dev.gmem_id()))?;
    ensure!(got == want, "device checksum {got:#x}, CPU {want:#x}");
    ensure!(total("migrated.h2d") >= h2d + 64, "fewer than 64 pages uploaded");
    Ok(())
}

fn zero(d: &Driver) -> TestResult {
    let dev = d.dev(0)?;
    let g = Gmem::open().map_err(|e| e.to_string())?;
    let r = ok!(g.alloc(32 * 4096));
    let zeroed = total("migrated.zeroed");
    let got = ok!(dev.checksum(r.addr, r.len as u64)).result;
    ensure!(got == checksum(&vec![0u32; r.len / 4]), "fresh memory read by the device is not zero");
    ensure!(total("migrated.zeroed") >= zeroed + 32, "fewer than 32 frames zero-filled");
    Ok(())
}

fn download(d: &Driver) -> TestResult {
    let dev = d.dev(0)?;
    let g = Gmem::open().map_err(|e| e.to_string())?;
    let ptes0 = ok!(dev.ptes());
    {
        let r = ok!(g.alloc(48 * 4096));
        ok!(dev.fill(r.addr, r.len as u64, 7000));
        let w = words(&r);
        for (i, &x) in w.iter().enumerate() {
            ensure!(x == 7000 + i as u32, "word {i}: CPU reads {x}, device wrote {}", 7000 + i);
        }
        crate::harness::all_at(&ok!(r.query()), GMEM_LOC_HOST, 0)?;
    }
    // Freed: the device keeps no entry of it.
    let ptes = ok!(dev.ptes());
    ensure!(ptes == ptes0, "device page tables hold {ptes} entries after FREE, {ptes0} before");
    Ok(())
}

fn peer(d: &Driver) -> TestResult {
    let (a, b) = (d.dev(0)?, d.dev(1)?);
    let g = Gmem::open().map_err(|e| e.to_string())?;
    let r = ok!(g.alloc(40 * 4096));
    ok!(a.fill(r.addr, r.len as u64, 500));
    let d2d = total("migrated.d2d");
    let expect: Vec<u32> = (0..r.len / 4).map(|i| 500 + i as u32).collect();
    let got = ok!(b.checksum(r.addr, r.len as u64)).result;
    ensure!(got == checksum(&expect), "second device read {got:#x}, expected {:#x}", checksum(&expect));
    ensure!(total("migrated.d2d") >= d2d + 40, "pages did not move device to device");
    crate::harness::all_at(&ok!(r.query()), GMEM_LOC_DEVICE, ok!(b.gmem_id()))?;
    Ok(())
}

fn overcommit(d: &Driver) -> TestResult {
    let dev = d.dev(0)?;
    let g = Gmem::open().map_err(|e| e.to_string())?;
    let len = 2 * ok!(dev.nr_frames()) * 4096;
    let r = ok!(g.alloc(len));
    ok!(dev.fill(r.addr, len, 90));
    let expect: Vec<u32> = (0..r.len / 4).map(|i| 90u32.wrapping_add(i as u32)).collect();
    let got = ok!(dev.checksum(r.addr, len)).result;
    ensure!(
        got == checksum(&expect),
        "device read back {got:#x} over 2x its memory, expected {:#x}",
        checksum(&expect)
    );
    let w = words(&r);
    let bad = w.iter().zip(&expect).filter(|(x, y)| x != y).count();
    ensure!(bad == 0, "{bad} words wrong on the CPU after overcommit");
    Ok(())
}

fn fault_batch(d: &Driver) -> TestResult {
    let dev = d.dev(0)?;
    let g = Gmem::open().map_err(|e| e.to_string())?;
    // Three 2 MiB blocks (the region is 2 MiB aligned or not: either way several blocks).
    let pages = 3 * 512;
    let r = ok!(g.alloc(pages as u64 * 4096));
    let w = words(&r);
    for (i, x) in w.iter_mut().enumerate() {
        *x = pattern(3, i);
    }
    // 600 addresses: every 5th page, at an offset that walks through the page (word 0 to
    // the last word), each twice, in scrambled order.
    let mut addrs = Vec::new();
    for k in 0..300u64 {
        let page = (k * 5) % pages as u64;
        let word = (k * 97) % 1024;
        addrs.push(r.addr + page * 4096 + word * 4);
    }
    let n = addrs.len();
    addrs.extend_from_within(0..n);
    let mut x = 12345u64;
    for i in (1..addrs.len()).rev() {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        addrs.swap(i, (x >> 33) as usize % (i + 1));
    }
    let got = ok!(dev.gather(&addrs));
    for (a, v) in addrs.iter().zip(&got) {
        let i = ((a - r.addr) / 4) as usize;
        ensure!(*v == pattern(3, i), "address {a:#x}: device read {v:#x}, expected {:#x}", pattern(3, i));
    }
    // Every page named is on the device now (others may have come along, as prefetch).
    let q = ok!(r.query());
    let id = ok!(dev.gmem_id());
    let named_on_dev =
        (0..300).map(|k| (k * 5) % pages).filter(|&p| q_loc(q[p]) == GMEM_LOC_DEVICE && q_dev(q[p]) == id).count();
    ensure!(named_on_dev == 300, "{named_on_dev} of the 300 named pages are on the device");
    Ok(())
}

fn unplug_under_load(d: &Driver) -> TestResult {
    let dev = d.dev(0)?;
    let other = d.dev(1)?;
    let id = ok!(dev.gmem_id());
    let mut kids = Vec::new();
    for tag in [0xA0u32, 0xB0] {
        let (mut me, mut peer) = Link::pair()?;
        // SAFETY: fork; the child runs its scenario and exits.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            drop(me);
            let code = (|| {
                let Ok(dev) = d.dev(0) else { return 10 };
                let Ok(g) = Gmem::open() else { return 11 };
                let Ok(r) = g.alloc(512 * 4096) else { return 12 };
                if dev.fill(r.addr, r.len as u64, tag << 24).is_err() {
                    return 13;
                }
                peer.signal();
                // Read-only kernels until the device goes away: each ends cleanly.
                let expect: Vec<u32> = (0..r.len / 4).map(|i| (tag << 24) + i as u32).collect();
                let mut gone = false;
                for _ in 0..10_000 {
                    match dev.checksum(r.addr, r.len as u64) {
                        Ok(o) if o.result == checksum(&expect) => {}
                        Ok(_) => return 14,
                        Err(Errno(libc::ENODEV)) => {
                            gone = true;
                            break;
                        }
                        Err(_) => return 15,
                    }
                }
                if !gone {
                    return 16;
                }
                // Our own data, on the host, intact.
                let w = words(&r);
                if w.iter().enumerate().any(|(i, &x)| x != (tag << 24) + i as u32) {
                    return 17;
                }
                match r.query() {
                    Ok(q) if q.iter().all(|s| q_loc(*s) == GMEM_LOC_HOST) => 0,
                    _ => 18,
                }
            })();
            // SAFETY: leaving the forked child.
            unsafe { libc::_exit(code) };
        }
        drop(peer);
        ensure!(me.wait(), "child {tag:#x} failed before the unplug");
        kids.push(pid);
    }
    std::thread::sleep(std::time::Duration::from_millis(50));
    ok!(dev.unplug());
    let mut codes = Vec::new();
    for pid in kids {
        let mut st = 0;
        // SAFETY: reaping our own child.
        unsafe { libc::waitpid(pid, &mut st, 0) };
        codes.push(if libc::WIFEXITED(st) { libc::WEXITSTATUS(st) } else { 100 + st });
    }
    ensure!(codes.iter().all(|&c| c == 0), "children: {codes:?} (0 = clean)");
    // The device is gone for new work; gmem no longer lists it alive.
    let g = Gmem::open().map_err(|e| e.to_string())?;
    let r = ok!(g.alloc(16 * 4096));
    match dev.fill(r.addr, r.len as u64, 1) {
        Err(Errno(libc::ENODEV)) => {}
        other => return Err(format!("fill after unplug: {other:?}, expected ENODEV")),
    }
    ensure!(debugfs::counter(id, "alive") != Some(1), "gmem still lists device {id} alive");
    // The other device still works.
    ok!(other.fill(r.addr, r.len as u64, 3));
    let expect: Vec<u32> = (0..r.len / 4).map(|i| 3 + i as u32).collect();
    ensure!(ok!(other.checksum(r.addr, r.len as u64)).result == checksum(&expect), "other device read wrong data");
    drop((dev, other, r));
    d.reload()
}

/// A device fault on a block some of whose other pages sit on another driver's device.
/// A fault batch of a quarter of a block or more fetches the rest of the block with its
/// own pages, and the pages on the other driver's device cannot come over (no copy
/// between drivers: `EXDEV`): that must only end the speculation, and the faulted pages
/// come over without it. Before, the refusal undid the whole batch and failed the fault,
/// every replay alike: the sim's kernel failed with `EIO`.
fn cross_driver_speculation_does_not_fail_a_fault() -> TestResult {
    const BLOCK: u64 = 2 << 20;
    let (sim, cs) = (SIM.dev(0)?, CSAMPLE.dev(0)?);
    let (sim_id, cs_id) = (ok!(sim.gmem_id()), ok!(cs.gmem_id()));
    let g = Gmem::open().map_err(|e| e.to_string())?;
    // Two blocks' worth: one whole 2 MiB block lies inside.
    let r = ok!(g.alloc(2 * BLOCK));
    let w = words(&r);
    for (i, x) in w.iter_mut().enumerate() {
        *x = pattern(7, i);
    }
    let want = checksum(w);
    let block = r.addr.next_multiple_of(BLOCK);
    // The block's second half on the other driver's device.
    ok!(g.advise(block + BLOCK / 2, BLOCK / 2, GMEM_ADV_PREFETCH, cs_id as i32, 0));
    // The sim's device reads the block's first quarter (one fault batch of 128 pages).
    let first = (block - r.addr) as usize / 4;
    let expect = checksum(&w[first..first + BLOCK as usize / 16]);
    let o = ok!(sim.checksum(block, BLOCK / 4));
    ensure!(o.result == expect, "the sim's device read wrong data");
    let q = ok!(g.query(block, 512));
    let at = |k: usize| (q_loc(q[k]), q_dev(q[k]));
    ensure!(
        (0..128).all(|k| at(k) == (GMEM_LOC_DEVICE, sim_id)),
        "the faulted pages are not on the sim's device: {:#x}",
        q[0]
    );
    ensure!((256..512).all(|k| at(k) == (GMEM_LOC_DEVICE, cs_id)), "the other driver's pages moved: {:#x}", q[256]);
    ensure!(checksum(words(&r)) == want, "data changed");
    Ok(())
}

macro_rules! suite {
    ($($name:ident => $scenario:ident($driver:ident);)*) => {
        $(fn $name() -> TestResult { $scenario(&$driver) })*
        pub fn tests() -> Vec<Test> {
            let mut v = vec![$(Test { name: stringify!($name), f: $name }),*];
            v.push(Test {
                name: "conformance_cross_driver_speculation_does_not_fail_a_fault",
                f: cross_driver_speculation_does_not_fail_a_fault,
            });
            v
        }
    };
}

suite! {
    conformance_registers_sim => registers(SIM);
    conformance_upload_sim => upload(SIM);
    conformance_zero_sim => zero(SIM);
    conformance_download_sim => download(SIM);
    conformance_peer_sim => peer(SIM);
    conformance_overcommit_sim => overcommit(SIM);
    conformance_fault_batch_sim => fault_batch(SIM);
    conformance_unplug_under_load_sim => unplug_under_load(SIM);
    conformance_registers_csample => registers(CSAMPLE);
    conformance_upload_csample => upload(CSAMPLE);
    conformance_zero_csample => zero(CSAMPLE);
    conformance_download_csample => download(CSAMPLE);
    conformance_peer_csample => peer(CSAMPLE);
    conformance_overcommit_csample => overcommit(CSAMPLE);
    conformance_fault_batch_csample => fault_batch(CSAMPLE);
    conformance_unplug_under_load_csample => unplug_under_load(CSAMPLE);
}
