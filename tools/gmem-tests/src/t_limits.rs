// SPDX-License-Identifier: GPL-2.0
//! Limits a hostile or careless process must not get past: a huge ALLOC fails with ENOMEM
//! instead of OOM-killing bystanders (issue item 4); a prefetch larger than the device
//! evicts and succeeds instead of failing spuriously (item 9); a killed process's queued
//! prefetches stop promptly (item 10).

use crate::harness::{kill_and_reap, open, parked_child, Test, TestResult};
use crate::t_overcommit::counter;
use crate::{ensure, expect_errno, ok};
use libgmem::*;
use std::time::{Duration, Instant};

/// Issue item 4: ALLOCs whose per-page metadata cannot fit (512 GiB: 2 GiB of metadata in a
/// 2 GiB guest; 1 TiB) fail with ENOMEM, and a bystander process that holds 32 MiB of its
/// own memory is still alive afterwards (before the fix the global OOM killer picked it).
fn huge_alloc_fails_without_oom_kill() -> TestResult {
    let (bystander, _) = parked_child(|| {
        let mut v = vec![0u8; 32 << 20];
        for i in (0..v.len()).step_by(4096) {
            v[i] = 1;
        }
        std::hint::black_box(&v);
        true
    })?;
    let g = Gmem::open().map_err(|e| e.to_string())?;
    let r512 = g.alloc_raw(512 << 30, GMEM_NO_DEVICE);
    let r1t = g.alloc_raw(GMEM_MAX_ALLOC, GMEM_NO_DEVICE);
    let mut status = 0;
    // SAFETY: non-blocking check of our own child.
    let gone = unsafe { libc::waitpid(bystander, &mut status, libc::WNOHANG) };
    if gone == 0 {
        status = kill_and_reap(bystander);
    }
    ensure!(gone == 0, "the bystander died during the huge ALLOCs (status {status:#x})");
    expect_errno!(r512, libc::ENOMEM);
    expect_errno!(r1t, libc::ENOMEM);
    // Ordinary ALLOCs still work afterwards, and their metadata is there.
    let r = ok!(g.alloc(64 << 20));
    ensure!(ok!(r.query()).iter().all(|w| q_loc(*w) == GMEM_LOC_NONE), "fresh region not empty");
    Ok(())
}

/// Issue item 9: PREFETCH of 4x the device's memory with nothing pinned must succeed, both
/// synchronously and as an ASYNC fence (eviction makes room as it goes; ENOMEM is only for
/// "nothing can be evicted").
fn prefetch_larger_than_device_succeeds() -> TestResult {
    let (g, s) = open()?;
    let cap = ok!(s.info()).nr_frames * 4096;
    let r = ok!(g.alloc(4 * cap));
    ok!(r.advise(GMEM_ADV_PREFETCH, 0));
    let on_dev = ok!(r.query()).iter().filter(|w| q_loc(**w) == GMEM_LOC_DEVICE && q_dev(**w) == 0).count() as u64;
    ensure!(on_dev > 0 && on_dev <= cap / 4096, "after PREFETCH: {on_dev} pages on device 0");
    let r2 = ok!(g.alloc(4 * cap));
    let f = ok!(g.advise(r2.addr, r2.len as u64, GMEM_ADV_PREFETCH, 0, GMEM_ADVF_ASYNC));
    ok!(g.wait(f));
    let tail = ok!(r2.query());
    ensure!(tail.last().is_some_and(|w| q_loc(*w) == GMEM_LOC_DEVICE), "ASYNC PREFETCH did not reach the end of the range");
    Ok(())
}

/// Issue item 10: a process queues 64 ASYNC prefetches of 24 MiB (each would evict the one
/// before: far more work than the test could wait for) and is SIGKILLed. Once it is
/// reaped, at most a few chunks of work may still run on its behalf, and all of its frames
/// come back.
fn killed_process_stops_prefetching() -> TestResult {
    let (_, s) = open()?;
    let nframes = ok!(s.info()).nr_frames;
    let free_before = nframes - counter(0, "used")?;
    let (pid, ready) = parked_child(|| {
        let queued = (|| {
            let g = Gmem::open().ok()?;
            let r = g.alloc(24 << 20).ok()?;
            for _ in 0..64 {
                g.advise(r.addr, r.len as u64, GMEM_ADV_PREFETCH, 0, GMEM_ADVF_ASYNC).ok()?;
                g.advise(r.addr, r.len as u64, GMEM_ADV_PREFETCH, 1, GMEM_ADVF_ASYNC).ok()?;
            }
            r.leak();
            std::mem::forget(g);
            Some(())
        })();
        queued.is_some()
    })?;
    std::thread::sleep(Duration::from_millis(200));
    kill_and_reap(pid);
    ensure!(ready, "the child could not queue its prefetches");
    let at_reap = counter(0, "prefetch.pages")? + counter(1, "prefetch.pages")?;
    // Bounded wait for the frames to come back (the queued fences fail at their next chunk).
    let t = Instant::now();
    while nframes - counter(0, "used")? < free_before && t.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let after = counter(0, "prefetch.pages")? + counter(1, "prefetch.pages")?;
    let free_after = nframes - counter(0, "used")?;
    ensure!(free_after >= free_before, "frames of the killed process still used: {} free of {free_before}", free_after);
    // One chunk (512 pages) per device may be in flight when the process dies; before the
    // fix, hundreds of thousands of pages were migrated for a dead process.
    ensure!(after - at_reap <= 4 * 512, "{} pages prefetched for a process already reaped", after - at_reap);
    Ok(())
}

/// Issue item 8: advice over a huge range is killable. DONTNEED over millions of pages
/// takes a while however cheap each page is. The test picks a region size (doubling from
/// 1 GiB, at most 64 GiB) whose whole DONTNEED takes at least a second here (the baseline,
/// timed in the same run), then SIGKILLs a process looping on that call a tenth of that
/// time in, and requires it to be reaped within a quarter of it. Before the advice loop
/// checked for fatal signals, the kill waited for the call to finish (0.9 of it).
fn long_advice_stops_on_sigkill() -> TestResult {
    let g = Gmem::open().map_err(|e| e.to_string())?;
    let (mut len, mut full) = (1u64 << 30, Duration::ZERO);
    while len <= 64 << 30 {
        let r = ok!(g.alloc(len));
        let t = Instant::now();
        ok!(r.advise(GMEM_ADV_DONTNEED, GMEM_NO_DEVICE));
        full = t.elapsed();
        if full >= Duration::from_secs(1) {
            break;
        }
        len *= 2;
    }
    ensure!(full >= Duration::from_secs(1), "DONTNEED over 64 GiB took only {full:?}: too short to judge");
    let (mut me, mut peer) = crate::harness::Link::pair()?;
    // SAFETY: fork; the child loops on the call until it is killed.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        drop(me);
        if let Ok(g) = Gmem::open() {
            if let Ok(r) = g.alloc(len) {
                peer.signal();
                loop {
                    let _ = r.advise(GMEM_ADV_DONTNEED, GMEM_NO_DEVICE);
                }
            }
        }
        // SAFETY: leaving the forked child.
        unsafe { libc::_exit(1) };
    }
    drop(peer);
    let ready = me.wait();
    ensure!(ready, "child could not allocate the region");
    std::thread::sleep(full / 10);
    let t = Instant::now();
    kill_and_reap(pid);
    let reap = t.elapsed();
    println!("GMEM-INFO long_advice_stops_on_sigkill: DONTNEED of {} GiB takes {full:?}; reaped {reap:?} after SIGKILL", len >> 30);
    ensure!(reap <= full / 4, "reaped {reap:?} after SIGKILL; one whole DONTNEED takes {full:?}");
    Ok(())
}

/// Drops CAP_IPC_LOCK from this process's effective and permitted sets (capset(2)).
fn drop_ipc_lock() -> bool {
    const VERSION_3: u32 = 0x2008_0522;
    const CAP_IPC_LOCK: u32 = 14;
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    let mut h = Header { version: VERSION_3, pid: 0 };
    let mut d = [Data::default(); 2];
    // SAFETY: capget/capset with a v3 header and two data words, as capget(2) documents.
    unsafe {
        if libc::syscall(libc::SYS_capget, &mut h as *mut Header, d.as_mut_ptr()) != 0 {
            return false;
        }
        d[0].effective &= !(1 << CAP_IPC_LOCK);
        d[0].permitted &= !(1 << CAP_IPC_LOCK);
        libc::syscall(libc::SYS_capset, &mut h as *mut Header, d.as_ptr()) == 0
    }
}

/// Issue item 7: PIN is charged to RLIMIT_MEMLOCK (without CAP_IPC_LOCK): past the limit
/// it fails with ENOMEM and pins nothing; UNPIN and FREE give the quota back.
fn pin_is_charged_to_memlock() -> TestResult {
    let code = crate::harness::child_exit(|| {
        let Ok((g, _s)) = open() else { return 10 };
        if !drop_ipc_lock() {
            return 11;
        }
        let lim = libc::rlimit { rlim_cur: 16 * 4096, rlim_max: 16 * 4096 };
        // SAFETY: setrlimit with a valid struct.
        if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &lim) } != 0 {
            return 12;
        }
        let Ok(r) = g.alloc(64 * 4096) else { return 13 };
        // 17 pages: one over the limit. Nothing may be pinned afterwards.
        if g.advise(r.addr, 17 * 4096, GMEM_ADV_PIN, 0, 0) != Err(Errno(libc::ENOMEM)) {
            return 14;
        }
        let Ok(q) = r.query() else { return 15 };
        if q.iter().any(|w| w & GMEM_Q_PINNED != 0) {
            return 16;
        }
        // 16 pages fit; a 17th does not, even one at a time.
        if g.advise(r.addr, 16 * 4096, GMEM_ADV_PIN, 0, 0).is_err() {
            return 17;
        }
        if g.advise(r.addr + 16 * 4096, 4096, GMEM_ADV_PIN, 0, 0) != Err(Errno(libc::ENOMEM)) {
            return 18;
        }
        // Pinning pinned pages again costs nothing.
        if g.advise(r.addr, 16 * 4096, GMEM_ADV_PIN, 0, 0).is_err() {
            return 19;
        }
        // UNPIN of 8 gives 8 back.
        if g.advise(r.addr, 8 * 4096, GMEM_ADV_UNPIN, GMEM_NO_DEVICE, 0).is_err() {
            return 20;
        }
        if g.advise(r.addr + 16 * 4096, 8 * 4096, GMEM_ADV_PIN, 0, 0).is_err() {
            return 21;
        }
        // FREE of a region with 16 pinned pages gives them all back.
        drop(r);
        let Ok(r2) = g.alloc(16 * 4096) else { return 22 };
        if g.advise(r2.addr, 16 * 4096, GMEM_ADV_PIN, 0, 0).is_err() {
            return 23;
        }
        0
    });
    ensure!(code == 0, "child failed with code {code}");
    Ok(())
}

pub fn tests() -> Vec<Test> {
    vec![
        Test { name: "huge_alloc_fails_without_oom_kill", f: huge_alloc_fails_without_oom_kill },
        Test { name: "prefetch_larger_than_device_succeeds", f: prefetch_larger_than_device_succeeds },
        Test { name: "killed_process_stops_prefetching", f: killed_process_stops_prefetching },
        Test { name: "pin_is_charged_to_memlock", f: pin_is_charged_to_memlock },
        Test { name: "long_advice_stops_on_sigkill", f: long_advice_stops_on_sigkill },
    ]
}
