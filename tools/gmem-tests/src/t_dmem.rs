// SPDX-License-Identifier: GPL-2.0
//! Device memory in the dmem cgroup controller: each simulated device is a region
//! (`gmem/gmemN` in `dmem.capacity`), frames are charged to the cgroup of the process owning
//! the page, a cgroup at its `dmem.max` evicts its own pages (never another cgroup's),
//! `dmem.current` equals the frames in use, PIN
//! counts, a lowered limit reclaims, and everything returns to zero when the processes go.

use crate::harness::{open, sh, words, Link, TestResult};
use crate::t_overcommit::control;
use crate::{ensure, ok};
use libgmem::sim::checksum;
use libgmem::GMEM_ADV_PIN;

const ROOT: &str = "/sys/fs/cgroup";
const REGION: &str = "gmem/gmem0";

/// Creates the cgroup `name` (mounting cgroup2 and enabling the dmem controller first);
/// removes a leftover of an earlier run. Returns its directory.
fn dmemcg(name: &str) -> Result<String, String> {
    sh(&format!("grep -q ' {ROOT} ' /proc/mounts || mount -t cgroup2 none {ROOT}"))?;
    sh(&format!("echo +dmem > {ROOT}/cgroup.subtree_control"))?;
    let dir = format!("{ROOT}/{name}");
    let _ = std::fs::remove_dir(&dir);
    std::fs::create_dir(&dir).map_err(|e| format!("mkdir {dir}: {e}"))?;
    Ok(dir)
}

/// The value of region `gmem/gmem0` in a dmem file (`current`, `peak`, `max`, `capacity`);
/// `max` reads as `u64::MAX`.
fn dmem_value(file: &str) -> Result<u64, String> {
    let t = std::fs::read_to_string(file).map_err(|e| format!("{file}: {e}"))?;
    let v = t
        .lines()
        .find_map(|l| l.strip_prefix(REGION)?.strip_prefix(' '))
        .ok_or(format!("{file} has no {REGION}:\n{t}"))?;
    if v.trim() == "max" {
        return Ok(u64::MAX);
    }
    v.trim().parse().map_err(|e| format!("{file}: {v:?}: {e}"))
}

fn current(cg: &str) -> Result<u64, String> {
    dmem_value(&format!("{cg}/dmem.current"))
}

/// `dmem.current` once it is zero: the frames of an exited process are freed by its
/// teardown, which may still be finishing when `waitpid` returns. Fails after 20 s.
fn drained(cg: &str) -> TestResult {
    for _ in 0..200 {
        if current(cg)? == 0 {
            return Ok(());
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    Err(format!("{cg}: {} bytes still charged", current(cg)?))
}

fn set_max(cg: &str, bytes: u64) -> Result<(), String> {
    let f = format!("{cg}/dmem.max");
    std::fs::write(&f, format!("{REGION} {bytes}")).map_err(|e| format!("{f}: {e}"))
}

/// An attribute of device 0's sysfs node.
fn device_attr(attr: &str) -> Result<u64, String> {
    let f = format!("/sys/class/gmem/gmem0/{attr}");
    let t = std::fs::read_to_string(&f).map_err(|e| format!("{f}: {e}"))?;
    t.trim().parse().map_err(|e| format!("{f}: {t:?}: {e}"))
}

/// Bytes of device 0 in use.
fn device_used() -> Result<u64, String> {
    Ok(device_attr("used")? * 4096)
}

/// Waits (up to 20 s) until nothing is left on device 0 from earlier tests, whose
/// processes' teardown may still be finishing.
fn device_idle() -> TestResult {
    for _ in 0..200 {
        if device_used()? == 0 {
            return Ok(());
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    Err(format!("device 0 still holds {} bytes from earlier tests", device_used()?))
}

/// Forks a process that joins `cg`, allocates `len` bytes (pinning them on device 0 if
/// `pin`: exit code 13 when that fails), has device 0 FILL it from `value` (word `i` gets
/// `value + i`), then reports and waits; told to go on, it checks every word from the CPU
/// (the device, for pinned pages) and exits (code 0: data intact). Returns its pid and the
/// link to it.
fn worker(cg: &str, len: u64, value: u32, pin: bool) -> Result<(i32, Link), String> {
    let (me, mut peer) = Link::pair()?;
    // SAFETY: fork; the child only runs the closure below and exits.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        drop(me);
        let code = (|| -> i32 {
            if std::fs::write(format!("{cg}/cgroup.procs"), std::process::id().to_string()).is_err() {
                return 10;
            }
            let Ok((g, s)) = open() else { return 11 };
            let Ok(r) = g.alloc(len) else { return 12 };
            if pin {
                // Every page pinned on device 0: these frames can never be evicted.
                if r.advise(GMEM_ADV_PIN, 0).is_err() {
                    return 13;
                }
            }
            if let Err(e) = s.fill(r.addr, len, value) {
                eprintln!("dmem worker: FILL of {len} bytes: {e:?}");
                return 14;
            }
            peer.signal();
            if !peer.wait() {
                return 15;
            }
            if pin {
                // A pinned page cannot come to the CPU (its access would get SIGBUS): the
                // device checks it.
                let want: Vec<u32> = (0u32..).take(r.len / 4).map(|i| value.wrapping_add(i)).collect();
                match s.checksum(r.addr, len) {
                    Ok(o) if o.result == checksum(&want) => {}
                    _ => return 17,
                }
            } else if words(&r).iter().zip(0u32..).any(|(&w, i)| w != value.wrapping_add(i)) {
                return 16;
            }
            0
        })();
        // SAFETY: leaving the forked child.
        unsafe { libc::_exit(code) };
    }
    drop(peer);
    Ok((pid, me))
}

/// Lets a worker check its data and exit; returns its exit code.
fn finish(pid: i32, link: &mut Link) -> i32 {
    link.signal();
    let _ = link.wait();
    let mut status = 0;
    // SAFETY: reaping our own child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        128 + libc::WTERMSIG(status)
    }
}

/// Why a worker failed to report: its exit code (the numbers in [`worker`]).
fn failed(pid: i32, link: &mut Link, who: &str) -> String {
    format!("worker {who} failed before reporting: exit {}", finish(pid, link))
}

/// Runs `f` with the background evictor and the peer tier off (their moves would make the
/// counts drift between two reads), restoring them after.
fn quiet(f: impl FnOnce() -> TestResult) -> TestResult {
    control("preevict=0 peer=0")?;
    let r = f();
    control("preevict=1 peer=1")?;
    r
}

fn capacity_lists_every_device() -> TestResult {
    dmemcg("gmem_dmem_cap")?;
    let (_g, s) = open()?;
    let cap = dmem_value(&format!("{ROOT}/dmem.capacity"))?;
    ensure!(cap == ok!(s.info()).nr_frames * 4096, "dmem.capacity {cap} != device 0's memory");
    let all = std::fs::read_to_string(format!("{ROOT}/dmem.capacity")).map_err(|e| e.to_string())?;
    ensure!(all.contains("gmem/gmem1 "), "device 1 missing from dmem.capacity:\n{all}");
    Ok(())
}

/// Two cgroups share device 0, each limited to a quarter of it (so the device itself never
/// fills): each process writes three times its limit from the device. Each fill succeeds
/// by evicting at least twice its limit (so it held no more than its limit: the charge
/// counts every frame, below), the second one's pressure evicts only its own pages (the
/// first's charge does not move), `dmem.current` of the two adds up to exactly the device's
/// use, every word survives, and both counts return to zero.
fn two_cgroups_share_a_device() -> TestResult {
    let (a, b) = (dmemcg("gmem_dmem_a")?, dmemcg("gmem_dmem_b")?);
    let (_g, s) = open()?;
    let cap = ok!(s.info()).nr_frames * 4096;
    let limit = cap / 4;
    set_max(&a, limit)?;
    set_max(&b, limit)?;
    ensure!(dmem_value(&format!("{a}/dmem.max"))? == limit, "dmem.max not stored");
    quiet(|| {
        device_idle()?;
        // Each worker writes 3 * limit and holds at most limit: at least 2 * limit of its
        // pages must have been evicted (peer tier off: all to the host).
        let must_evict = 2 * limit / 4096;
        let ev0 = device_attr("stats/evicted_to_host")?;
        let (pa, mut la) = worker(&a, 3 * limit, 0xa5a5_0001, false)?;
        ensure!(la.wait(), "{}", failed(pa, &mut la, "A"));
        let ev1 = device_attr("stats/evicted_to_host")?;
        ensure!(ev1 - ev0 >= must_evict, "A's fill evicted {} pages, at least {must_evict} expected", ev1 - ev0);
        let a_held = current(&a)?;
        ensure!(a_held > 0, "A holds nothing on the device");
        let (pb, mut lb) = worker(&b, 3 * limit, 0xb5b5_0002, false)?;
        ensure!(lb.wait(), "{}", failed(pb, &mut lb, "B"));
        let b_held = current(&b)?;
        ensure!(b_held > 0, "B holds nothing on the device");
        let ev2 = device_attr("stats/evicted_to_host")?;
        ensure!(ev2 - ev1 >= must_evict, "B's fill evicted {} pages, at least {must_evict} expected", ev2 - ev1);
        ensure!(current(&a)? == a_held, "B's pressure moved A's charge: {a_held} -> {}", current(&a)?);
        let used = device_used()?;
        ensure!(a_held + b_held == used, "A {a_held} + B {b_held} != device use {used}");
        ensure!(finish(pa, &mut la) == 0, "worker A: data not intact");
        ensure!(finish(pb, &mut lb) == 0, "worker B: data not intact");
        drained(&a)?;
        drained(&b)
    })
}

/// Pinned frames are charged like any other and cannot be evicted: a PIN within the limit
/// holds its charge; a second process whose PIN exceeds its limit fails (ENOMEM from the
/// device kernel) and leaves no charge behind.
fn pins_count() -> TestResult {
    let cg = dmemcg("gmem_dmem_pin")?;
    let (_g, s) = open()?;
    let limit = ok!(s.info()).nr_frames * 4096 / 4;
    set_max(&cg, limit)?;
    quiet(|| {
        device_idle()?;
        let (p1, mut l1) = worker(&cg, limit / 2, 0x1111, true)?;
        ensure!(l1.wait(), "pinning worker failed");
        ensure!(current(&cg)? == limit / 2, "pinned {} bytes, charged {}", limit / 2, current(&cg)?);
        // Three quarters of the limit more, all pinned: cannot fit beside the first pin.
        let (p2, mut l2) = worker(&cg, limit / 4 * 3, 0x2222, true)?;
        let reported = l2.wait();
        let code = finish(p2, &mut l2);
        ensure!(!reported && code == 13, "a PIN past the cgroup's limit: worker exit {code} (13: PIN refused)");
        // The failed process is gone: only the first pin stays charged.
        let mut left = current(&cg)?;
        for _ in 0..200 {
            if left == limit / 2 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
            left = current(&cg)?;
        }
        ensure!(left == limit / 2, "after the failed PIN {left} bytes are charged, not {}", limit / 2);
        ensure!(finish(p1, &mut l1) == 0, "pinned data not intact");
        drained(&cg)
    })
}

/// Lowering `dmem.max` below what a cgroup holds makes gmem evict that cgroup's pages
/// (the controller's reclaim callback) down to the new limit; the data stays intact.
fn lowered_limit_reclaims() -> TestResult {
    let cg = dmemcg("gmem_dmem_low")?;
    let (_g, s) = open()?;
    let cap = ok!(s.info()).nr_frames * 4096;
    quiet(|| {
        device_idle()?;
        let (pid, mut link) = worker(&cg, cap / 4, 0x3333, false)?;
        ensure!(link.wait(), "worker failed");
        let held = current(&cg)?;
        ensure!(held == cap / 4, "holds {held}, wrote {}", cap / 4);
        set_max(&cg, cap / 16)?;
        let after = current(&cg)?;
        ensure!(after <= cap / 16, "still {after} bytes after lowering the limit to {}", cap / 16);
        ensure!(finish(pid, &mut link) == 0, "data not intact after reclaim");
        drained(&cg)
    })
}

/// `dmem.min` protects a cgroup's frames when the device itself is full: a process in a
/// protected cgroup holds a quarter of device 0, another (unprotected) streams twice the
/// device through it; the stream completes by evicting its own pages, the protected charge
/// does not move, and both keep their data. (Without the protection the protected pages,
/// cold since their fill, are the first victims.)
fn min_protects_on_a_full_device() -> TestResult {
    let (p, q) = (dmemcg("gmem_dmem_min")?, dmemcg("gmem_dmem_stream")?);
    let (_g, s) = open()?;
    let cap = ok!(s.info()).nr_frames * 4096;
    let f = format!("{p}/dmem.min");
    std::fs::write(&f, format!("{REGION} {}", cap / 2)).map_err(|e| format!("{f}: {e}"))?;
    quiet(|| {
        device_idle()?;
        let (pp, mut lp) = worker(&p, cap / 4, 0x6161, false)?;
        ensure!(lp.wait(), "protected worker failed");
        let held = current(&p)?;
        ensure!(held == cap / 4, "the protected cgroup holds {held}, wrote {}", cap / 4);
        let ev0 = device_attr("stats/evicted_to_host")?;
        let (pq, mut lq) = worker(&q, 2 * cap, 0x7171, false)?;
        ensure!(lq.wait(), "streaming worker failed");
        let evicted = device_attr("stats/evicted_to_host")? - ev0;
        ensure!(evicted * 4096 >= cap, "the stream evicted only {evicted} pages: the device never filled");
        ensure!(current(&p)? == held, "the stream evicted protected pages: {held} -> {}", current(&p)?);
        ensure!(finish(pq, &mut lq) == 0, "streamed data not intact");
        ensure!(finish(pp, &mut lp) == 0, "protected data not intact");
        drained(&p)?;
        drained(&q)
    })
}

pub fn tests() -> Vec<crate::harness::Test> {
    use crate::harness::Test;
    vec![
        Test { name: "dmem_capacity_lists_every_device", f: capacity_lists_every_device },
        Test { name: "dmem_two_cgroups_share_a_device", f: two_cgroups_share_a_device },
        Test { name: "dmem_pins_count", f: pins_count },
        Test { name: "dmem_lowered_limit_reclaims", f: lowered_limit_reclaims },
        Test { name: "dmem_min_protects_on_a_full_device", f: min_protects_on_a_full_device },
    ]
}
