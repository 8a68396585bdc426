// SPDX-License-Identifier: GPL-2.0
//! The simulated device's link model (`GMEM_SIM_IOC_LINK`): a modelled path counts exactly
//! the bytes gmem moved over it and its busy time (bytes / bandwidth + latency per call),
//! a transfer never completes faster than that time, and data arrive intact; bad input is
//! refused. Lower bounds only: a loaded host can make a transfer slower, never faster.

use crate::harness::{open, words, TestResult};
use crate::{ensure, expect_errno, ok};
use libgmem::sim::{checksum, Sim, SimLink, LINK_SET, PATH_D2H, PATH_H2D};
use libgmem::GMEM_ADV_PREFETCH;
use std::time::Instant;

/// Runs `f` with `sim`'s link model set to `mbps`/`latency_ns`, and unmodelled again after
/// (whatever `f` returns).
pub(crate) fn with_link(sim: &Sim, mbps: [u64; 3], latency_ns: u64, f: impl FnOnce() -> TestResult) -> TestResult {
    ok!(sim.set_link(mbps, latency_ns));
    let r = f();
    ok!(sim.set_link([0; 3], 0));
    r
}

fn delta(a: &SimLink, b: &SimLink, path: usize) -> (u64, u64) {
    (b.bytes[path] - a.bytes[path], b.busy_ns[path] - a.busy_ns[path])
}

fn paces_and_counts() -> TestResult {
    let (g, s) = open()?;
    const LEN: usize = 4 << 20;
    let r = ok!(g.alloc(LEN as u64));
    // Host data first, so that PREFETCH copies (a never-touched page is zero-filled on
    // the device instead).
    for (i, w) in words(&r).iter_mut().enumerate() {
        *w = i as u32 ^ 0x5a5a_0000;
    }
    // 100 MB/s in, 200 MB/s out: 4 MiB take 41.9 ms and 21.0 ms on the wire.
    with_link(&s, [100, 200, 0], 0, || {
        let l0 = ok!(s.link());
        ensure!(l0.mbps == [100, 200, 0] && l0.latency_ns == 0, "model not stored: {l0:?}");
        let t = Instant::now();
        ok!(r.advise(GMEM_ADV_PREFETCH, 0));
        let took = t.elapsed().as_nanos() as u64;
        let l1 = ok!(s.link());
        let (bytes, busy) = delta(&l0, &l1, PATH_H2D);
        ensure!(bytes == LEN as u64, "H2D carried {bytes} bytes for a {LEN}-byte prefetch");
        // 4096 B at 100 MB/s is exactly 40960 ns: no rounding per call.
        ensure!(busy == LEN as u64 * 1000 / 100, "H2D busy {busy} ns, model says {}", LEN as u64 * 10);
        ensure!(took >= busy, "the prefetch took {took} ns, less than the link's {busy} ns");
        // The device reads what crossed the link (the CPU would read its own host copy).
        let want: Vec<u32> = (0..LEN / 4).map(|i| i as u32 ^ 0x5a5a_0000).collect();
        let o = ok!(s.checksum(r.addr, LEN as u64));
        ensure!(o.result == checksum(&want), "data changed on the way through the modelled link");
        // Reading them back from the CPU dropped the device copies (they were clean): now
        // the device writes every page (dirty, host copies released), and the CPU reads
        // them back, every page crossing D2H once.
        ok!(r.advise(GMEM_ADV_PREFETCH, 0));
        ok!(s.fill(r.addr, LEN as u64, 0x77));
        let l1 = ok!(s.link());
        let t = Instant::now();
        let ok_words = words(&r).iter().zip(0u32..).all(|(&w, i)| w == 0x77u32.wrapping_add(i));
        let took = t.elapsed().as_nanos() as u64;
        ensure!(ok_words, "the device's data changed on the way back");
        let l2 = ok!(s.link());
        let (bytes, busy) = delta(&l1, &l2, PATH_D2H);
        ensure!(bytes == LEN as u64, "D2H carried {bytes} bytes for {LEN} bytes read back");
        ensure!(busy == LEN as u64 * 1000 / 200, "D2H busy {busy} ns, model says {}", LEN as u64 * 5);
        ensure!(took >= busy, "the read-back took {took} ns, less than the link's {busy} ns");
        Ok(())
    })
}

/// A latency per copy call, with unlimited bandwidth: the busy time is a whole number of
/// latencies (one per call), at least one, and the transfer waited for all of them.
fn latency_per_call() -> TestResult {
    let (g, s) = open()?;
    let r = ok!(g.alloc(64 * 4096));
    words(&r).fill(7);
    const LAT: u64 = 3_000_000;
    with_link(&s, [0; 3], LAT, || {
        let l0 = ok!(s.link());
        let t = Instant::now();
        ok!(r.advise(GMEM_ADV_PREFETCH, 0));
        let took = t.elapsed().as_nanos() as u64;
        let (bytes, busy) = delta(&l0, &ok!(s.link()), PATH_H2D);
        ensure!(bytes == 64 * 4096, "H2D carried {bytes} bytes");
        ensure!(busy >= LAT && busy % LAT == 0, "busy {busy} ns is not a whole number of {LAT} ns latencies");
        ensure!(took >= busy, "took {took} ns, less than {busy} ns of latency");
        Ok(())
    })
}

fn refuses_bad_input() -> TestResult {
    let (_g, s) = open()?;
    let before = ok!(s.link());
    let good = || SimLink { argsz: std::mem::size_of::<SimLink>() as u32, ..Default::default() };
    expect_errno!(s.link_raw(&mut SimLink { argsz: 8, ..good() }), libc::EINVAL);
    expect_errno!(s.link_raw(&mut SimLink { flags: 2, ..good() }), libc::EINVAL);
    expect_errno!(
        s.link_raw(&mut SimLink { flags: LINK_SET, reserved: [0, 1], mbps: [20; 3], ..good() }),
        libc::EINVAL
    );
    // Out of bounds: a bandwidth below 10 MB/s (but not 0), a latency above 1 s.
    expect_errno!(s.link_raw(&mut SimLink { flags: LINK_SET, mbps: [9, 0, 0], ..good() }), libc::EINVAL);
    expect_errno!(s.link_raw(&mut SimLink { flags: LINK_SET, latency_ns: 1_000_000_001, ..good() }), libc::EINVAL);
    expect_errno!(s.link_raw(&mut SimLink { flags: LINK_SET, mbps: [u64::MAX, 0, 1], ..good() }), libc::EINVAL);
    // Refused calls changed nothing; a read without SET changes nothing either.
    let l = ok!(s.link_raw(&mut SimLink { mbps: [50; 3], latency_ns: 5, ..good() }));
    ensure!(
        l.mbps == before.mbps && l.latency_ns == before.latency_ns,
        "model changed by refused calls or without GMEM_SIM_LINK_SET: {before:?} -> {l:?}"
    );
    Ok(())
}

/// Two threads changing the model at once, through two files: every reply holds one whole
/// model (bandwidths and latency of the same call), and once both are done, gmem knows
/// the bandwidths the device keeps (debugfs `multipath.*_mbps`, what the driver reported).
/// Before, nothing serialised the changes: a reply, or the model itself, could mix both,
/// and gmem could be told one model while the device kept the other.
fn concurrent_changes_leave_one_model() -> TestResult {
    const A: ([u64; 3], u64) = ([100, 200, 400], 1000);
    const B: ([u64; 3], u64) = ([300, 600, 1200], 2000);
    let whole = |l: &SimLink| (l.mbps, l.latency_ns) == A || (l.mbps, l.latency_ns) == B;
    let (_g, s) = open()?;
    // Both threads start their calls together.
    let go = std::sync::Barrier::new(2);
    let r = std::thread::scope(|sc| {
        let run = |m: ([u64; 3], u64)| {
            let go = &go;
            sc.spawn(move || -> TestResult {
                let s = Sim::open(0).map_err(|e| format!("open /dev/gmem_sim0: {e}"))?;
                go.wait();
                for k in 0..20000 {
                    let l = ok!(s.set_link(m.0, m.1));
                    ensure!(whole(&l), "reply {k} mixes two models: {:?}, latency {}", l.mbps, l.latency_ns);
                }
                Ok(())
            })
        };
        let (a, b) = (run(A), run(B));
        let ra = a.join().map_err(|_| "thread A panicked".to_string())?;
        let rb = b.join().map_err(|_| "thread B panicked".to_string())?;
        ra.and(rb)
    });
    let check = || -> TestResult {
        r?;
        let l = ok!(s.link());
        ensure!(whole(&l), "the model mixes two: {:?}, latency {}", l.mbps, l.latency_ns);
        for (k, key) in ["multipath.h2d_mbps", "multipath.d2h_mbps", "multipath.d2d_mbps"].iter().enumerate() {
            let told = crate::t_overcommit::counter(0, key)?;
            ensure!(told == l.mbps[k], "gmem was told {key}={told}, the device models {}", l.mbps[k]);
        }
        Ok(())
    };
    let res = check();
    ok!(s.set_link([0; 3], 0));
    res
}

pub fn tests() -> Vec<crate::harness::Test> {
    use crate::harness::Test;
    vec![
        Test { name: "link_model_paces_and_counts", f: paces_and_counts },
        Test { name: "link_model_latency_per_call", f: latency_per_call },
        Test { name: "link_model_refuses_bad_input", f: refuses_bad_input },
        Test { name: "link_model_concurrent_changes_leave_one_model", f: concurrent_changes_leave_one_model },
    ]
}
