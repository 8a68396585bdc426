// SPDX-License-Identifier: GPL-2.0
//! Every advice, checked against data and the residency oracle.

use crate::harness::{all_at, open, words, Test, TestResult};
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};

static SIGBUS_FD: AtomicI32 = AtomicI32::new(-1);
static SIGBUS_PAGE: AtomicU64 = AtomicU64::new(0);
static SIGBUS_ADDR: AtomicU64 = AtomicU64::new(0);

/// Records the faulting address and unpins the page (ioctl is a plain syscall, fine in a
/// handler), so the faulting access can be retried.
extern "C" fn on_sigbus(_sig: i32, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers.
    let a = unsafe { (*info).si_addr() } as u64;
    SIGBUS_ADDR.store(a, Ordering::SeqCst);
    let mut adv = GmemAdvise {
        argsz: argsz::<GmemAdvise>(),
        advice: GMEM_ADV_UNPIN,
        addr: SIGBUS_PAGE.load(Ordering::SeqCst),
        len: 4096,
        dev: GMEM_NO_DEVICE,
        ..Default::default()
    };
    // SAFETY: ADVISE with its argument struct on our /dev/gmem fd.
    let _ = unsafe { ioctl_raw(SIGBUS_FD.load(Ordering::SeqCst), GMEM_IOC_ADVISE, &mut adv) };
}

fn install_sigbus_handler() {
    // The handler only uses async-signal-safe operations.
    crate::harness::on_signal(libc::SIGBUS, on_sigbus as *const () as usize, true);
}
use crate::{ensure, expect_errno, ok};
use libgmem::sim::{checksum, Sim};
use libgmem::*;

const MIB: u64 = 1 << 20;

fn pattern(r: &Region<'_>, seed: u32) -> u64 {
    let w = words(r);
    for (i, x) in w.iter_mut().enumerate() {
        *x = seed.wrapping_add(i as u32).wrapping_mul(7);
    }
    checksum(w)
}

fn prefetch_to_device_and_back() -> TestResult {
    let (g, s) = open()?;
    let r = ok!(g.alloc(MIB));
    let sum = pattern(&r, 1);
    ok!(r.advise(GMEM_ADV_PREFETCH, 0));
    all_at(&ok!(r.query()), GMEM_LOC_DEVICE, 0)?;
    let o = ok!(s.checksum(r.addr, r.len as u64));
    ensure!(o.result == sum && o.faults == 0, "after prefetch: sum ok={} faults={}", o.result == sum, o.faults);
    ok!(r.advise(GMEM_ADV_PREFETCH, GMEM_HOST));
    all_at(&ok!(r.query()), GMEM_LOC_HOST, 0)?;
    ensure!(checksum(words(&r)) == sum, "data changed by prefetch round trip");
    Ok(())
}

fn async_prefetch_and_wait() -> TestResult {
    let (g, s) = open()?;
    let r = ok!(g.alloc(MIB));
    let sum = pattern(&r, 2);
    let f = ok!(g.advise(r.addr, r.len as u64, GMEM_ADV_PREFETCH, 0, GMEM_ADVF_ASYNC));
    ensure!(f != 0, "no fence returned");
    ok!(g.wait(f));
    all_at(&ok!(r.query()), GMEM_LOC_DEVICE, 0)?;
    ensure!(ok!(s.checksum(r.addr, r.len as u64)).result == sum, "data wrong after async prefetch");
    // A fence is waited for once.
    expect_errno!(g.wait(f), libc::ENOENT);
    // openEuler's QA found async prefetch hanging on tiny sizes: one byte must complete.
    let f = ok!(g.advise(r.addr + 10, 1, GMEM_ADV_PREFETCH, GMEM_HOST, GMEM_ADVF_ASYNC));
    ok!(g.wait(f));
    let q = ok!(r.query());
    ensure!(
        q_loc(q[0]) == GMEM_LOC_HOST && q_loc(q[1]) == GMEM_LOC_DEVICE,
        "1-byte prefetch moved {:#x} {:#x}",
        q[0],
        q[1]
    );
    // Fences left unwaited are completed at close (no hang, no leak).
    ok!(g.advise(r.addr, r.len as u64, GMEM_ADV_PREFETCH, GMEM_HOST, GMEM_ADVF_ASYNC));
    Ok(())
}

/// The fences of one process run one at a time in the order queued, through all its open
/// files (user-api.rst): alternating PREFETCHes of one range to the device and home,
/// queued through two files, leave it where the last one sent it, data intact; and a
/// process queueing more fences than one file may hold (three files, 600 fences) gets
/// them all done.
fn async_fences_run_in_order_across_files() -> TestResult {
    let (g, s) = open()?;
    let g2 = Gmem::open().map_err(|e| e.to_string())?;
    let g3 = Gmem::open().map_err(|e| e.to_string())?;
    let r = ok!(g.alloc(MIB));
    let sum = pattern(&r, 9);
    for round in 0..3 {
        let mut fences = Vec::new();
        for k in 0..20 {
            // Even: to the device, through `g`; odd: home, through `g2`; the last is odd
            // in round 0 and even after.
            let (file, to) = if (k + round) % 2 == 0 { (&g, 0) } else { (&g2, GMEM_HOST) };
            let len = r.len as u64 >> (k % 3);
            fences.push((file, ok!(file.advise(r.addr, len, GMEM_ADV_PREFETCH, to, GMEM_ADVF_ASYNC))));
        }
        for (file, f) in fences {
            ok!(file.wait(f));
        }
        // The last fence (k = 19) moved the whole range ((19 % 3) = 1: half of it; the one
        // before, k = 18, the whole range the other way): so the first half is where k = 19
        // sent it, the second half where k = 18 did.
        let (last, before) =
            if (19 + round) % 2 == 0 { (GMEM_LOC_DEVICE, GMEM_LOC_HOST) } else { (GMEM_LOC_HOST, GMEM_LOC_DEVICE) };
        let q = ok!(r.query());
        let half = q.len() / 2;
        ensure!(
            q[..half].iter().all(|&w| q_loc(w) == last) && q[half..].iter().all(|&w| q_loc(w) == before),
            "round {round}: not where the last fences sent it: {:#x} .. {:#x}",
            q[0],
            q[q.len() - 1]
        );
    }
    ensure!(ok!(s.checksum(r.addr, r.len as u64)).result == sum, "data wrong after the fences");
    // More than one file's limit of 256, through three files: all complete.
    let mut fences = Vec::new();
    for k in 0..600 {
        let file = [&g, &g2, &g3][k % 3];
        let to = if k % 2 == 0 { 0 } else { GMEM_HOST };
        fences.push((
            file,
            ok!(file.advise(r.addr + (k as u64 % 256) * 4096, 4096, GMEM_ADV_PREFETCH, to, GMEM_ADVF_ASYNC)),
        ));
    }
    for (file, f) in fences {
        ok!(file.wait(f));
    }
    ensure!(checksum(words(&r)) == sum, "data wrong after 600 fences");
    Ok(())
}

/// Closing a file cancels its own fences without waiting behind those queued earlier
/// through the process's other files: with the link slow, the other file's fences are
/// still moving data when the close returns (before, the close waited for them all).
fn closing_a_file_does_not_wait_for_other_files_fences() -> TestResult {
    let (g, s) = open()?;
    let g2 = Gmem::open().map_err(|e| e.to_string())?;
    let r = ok!(g.alloc(MIB));
    let sum = pattern(&r, 12);
    let total = |l: &libgmem::sim::SimLink| l.bytes[libgmem::sim::PATH_H2D];
    crate::t_link::with_link(&s, [10, 10, 0], 0, || {
        let l0 = ok!(s.link());
        // Through `g`: the region to the device and back six times, 6 MiB to the device at
        // 10 MB/s (about 0.6 s; the way back copies nothing: the host kept its clean
        // pages); through `g2`, one more to the device behind them.
        let mut fences = Vec::new();
        for k in 0..12 {
            let to = if k % 2 == 0 { 0 } else { GMEM_HOST };
            fences.push(ok!(g.advise(r.addr, MIB, GMEM_ADV_PREFETCH, to, GMEM_ADVF_ASYNC)));
        }
        ok!(g2.advise(r.addr, MIB, GMEM_ADV_PREFETCH, 0, GMEM_ADVF_ASYNC));
        drop(g2);
        let moved = total(&ok!(s.link())) - total(&l0);
        ensure!(moved < 6 * MIB, "the close waited for the other file's fences: {moved} bytes moved by then");
        for f in fences {
            ok!(g.wait(f));
        }
        // Every fence of `g` ran in full (six times the region to the device); `g2`'s
        // never ran.
        let moved = total(&ok!(s.link())) - total(&l0);
        ensure!(moved == 6 * MIB, "{moved} bytes moved, not 6 MiB");
        Ok(())
    })?;
    all_at(&ok!(r.query()), GMEM_LOC_HOST, 0)?;
    ensure!(checksum(words(&r)) == sum, "data wrong after the fences");
    Ok(())
}

/// A process killed while it waits for its asynchronous prefetch (GMEM_IOC_WAIT) exits
/// without waiting for the prefetch to finish: the prefetch stops at its next chunk (a
/// block per lane at most). With the link slow (10 MB/s: 12 MiB take 1.26 s on it), a
/// child queues a PREFETCH of 12 MiB, tells the parent, waits for it, and is killed once
/// it sleeps there. Before, the wait ignored the kill and the whole region crossed the
/// link before the child could exit: a task inside the ioctl still uses the address
/// space, so the lanes did not stop for the exit either.
fn a_killed_waiter_stops_its_prefetch() -> TestResult {
    let (_g, s) = open()?;
    const LEN: u64 = 12 * MIB;
    let h2d = |l: &libgmem::sim::SimLink| l.bytes[libgmem::sim::PATH_H2D];
    crate::t_link::with_link(&s, [10, 10, 0], 0, || {
        let l0 = ok!(s.link());
        let mut fds = [0i32; 2];
        // SAFETY: pipe writes two descriptors into the array.
        ensure!(unsafe { libc::pipe(fds.as_mut_ptr()) } == 0, "pipe failed");
        // SAFETY: the child only runs the block below and exits.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let code = (|| {
                let Ok(g) = Gmem::open() else { return 1 };
                let Ok(r) = g.alloc(LEN) else { return 2 };
                // Host data, so that the prefetch copies every page over the link.
                pattern(&r, 21);
                let Ok(f) = g.advise(r.addr, LEN, GMEM_ADV_PREFETCH, 0, GMEM_ADVF_ASYNC) else { return 3 };
                // SAFETY: one byte from a live buffer to the pipe.
                unsafe { libc::write(fds[1], b"w".as_ptr().cast(), 1) };
                let _ = g.wait(f);
                4
            })();
            // SAFETY: ends the child without running the parent's destructors.
            unsafe { libc::_exit(code) };
        }
        // SAFETY: the parent's copy of the write end: a child that exits without writing
        // ends the read below.
        unsafe { libc::close(fds[1]) };
        let mut b = 0u8;
        // SAFETY: one byte into a live buffer, from the pipe.
        let got = unsafe { libc::read(fds[0], (&raw mut b).cast(), 1) };
        // SAFETY: our own descriptor.
        unsafe { libc::close(fds[0]) };
        if got == 1 {
            // Killed once it sleeps in the WAIT (state D; up to 2 s), so that the kill
            // lands there and not before it.
            let asleep = || {
                std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .ok()
                    .and_then(|st| st.rsplit_once(") ").map(|(_, rest)| rest.starts_with('D')))
                    .unwrap_or(false)
            };
            for _ in 0..2000 {
                if asleep() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            // SAFETY: our own child.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        let mut status = 0;
        // SAFETY: waits for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        ensure!(
            libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGKILL,
            "the child was not killed in its wait (status {status:#x}: exit code 1-3 is a failed setup, 4 a wait that returned)"
        );
        // Once the child is reaped, its prefetch has stopped: at most what crossed before
        // the kill (a few milliseconds at 10 MB/s) and one 2 MiB block in each of the
        // three lanes.
        let moved = h2d(&ok!(s.link())) - h2d(&l0);
        ensure!(moved < 9 * MIB, "the killed waiter's prefetch ran on: {moved} of {LEN} bytes moved");
        Ok(())
    })
}

fn preferred_location_host_maps_remotely() -> TestResult {
    let (g, s) = open()?;
    let r = ok!(g.alloc(MIB));
    let sum = pattern(&r, 3);
    ok!(r.advise(GMEM_ADV_PREFERRED_LOC, GMEM_HOST));
    ensure!(ok!(s.checksum(r.addr, r.len as u64)).result == sum, "remote read wrong");
    let q = ok!(r.query());
    all_at(&q, GMEM_LOC_HOST, 0)?;
    ensure!(q.iter().all(|w| w & GMEM_Q_REMOTE != 0), "not remote-mapped: {:#x}", q[0]);
    // Hints steer later faults; existing remote mappings stay until the page moves.
    ok!(r.advise(GMEM_ADV_DONTNEED, 0));
    // The device writes through a remote mapping: the CPU sees it without migration.
    ok!(s.fill(r.addr, 4096, 77));
    ensure!(q_loc(ok!(g.query(r.addr, 1))[0]) == GMEM_LOC_HOST, "remote write migrated the page");
    ensure!(words(&r)[3] == 80, "remote write not visible to CPU");
    ok!(r.advise(GMEM_ADV_UNSET_PREFERRED_LOC, 0));
    ok!(s.fill(r.addr + 8192, 4096, 1));
    ensure!(q_loc(ok!(g.query(r.addr + 8192, 1))[0]) == GMEM_LOC_DEVICE, "unset preferred: still remote");
    Ok(())
}

fn accessed_by_maps_remotely() -> TestResult {
    let (g, s) = open()?;
    let r = ok!(g.alloc(MIB));
    let sum = pattern(&r, 4);
    ok!(g.advise(r.addr, 64 * 1024, GMEM_ADV_ACCESSED_BY, 0, 0));
    ensure!(ok!(s.checksum(r.addr, r.len as u64)).result == sum, "checksum wrong");
    let q = ok!(r.query());
    ensure!(q[..16].iter().all(|w| q_loc(*w) == GMEM_LOC_HOST && w & GMEM_Q_REMOTE != 0), "advised part not remote");
    ensure!(q[16..].iter().all(|w| q_loc(*w) == GMEM_LOC_DEVICE), "rest of region did not migrate (advice split)");
    Ok(())
}

fn read_mostly_duplicates_then_write_collapses() -> TestResult {
    let (g, s0) = open()?;
    let s1 = Sim::open(1).map_err(|e| format!("sim1: {e}"))?;
    let r = ok!(g.alloc(MIB));
    let sum = pattern(&r, 5);
    ok!(r.advise(GMEM_ADV_READ_MOSTLY, 0));
    ensure!(ok!(s0.checksum(r.addr, r.len as u64)).result == sum, "dev0 read wrong");
    ensure!(ok!(s1.checksum(r.addr, r.len as u64)).result == sum, "dev1 read wrong");
    let q = ok!(r.query());
    ensure!(q.iter().all(|w| w & GMEM_Q_DUP != 0), "no duplicates: {:#x}", q[0]);
    let mut qa = GmemQuery { argsz: argsz::<GmemQuery>(), addr: r.addr, npages: 1, ..Default::default() };
    let mut one = [0u32; 1];
    qa.states = one.as_mut_ptr() as u64;
    ok!(g.ioctl(GMEM_IOC_QUERY, &mut qa));
    ensure!(qa.dup_mask.count_ones() >= 1, "dup_mask {:#x}", qa.dup_mask);
    // Both devices read again: no faults (duplicates are resident).
    ensure!(ok!(s1.checksum(r.addr, r.len as u64)).faults == 0, "dev1 re-read faulted");
    // A write collapses the duplicates; every reader then sees the new data.
    ok!(s0.fill(r.addr, r.len as u64, 9));
    let q = ok!(r.query());
    ensure!(q.iter().all(|w| w & GMEM_Q_DUP == 0), "write did not collapse duplicates");
    let expect: Vec<u32> = (0..r.len as u32 / 4).map(|i| 9 + i).collect();
    ensure!(ok!(s1.checksum(r.addr, r.len as u64)).result == checksum(&expect), "stale duplicate read");
    ensure!(words(&r) == expect.as_slice(), "CPU sees stale data");
    Ok(())
}

fn pin_unpin_and_capacity() -> TestResult {
    let (g, s) = open()?;
    let r = ok!(g.alloc(MIB));
    let sum = pattern(&r, 6);
    ok!(r.advise(GMEM_ADV_PIN, 0));
    let q = ok!(r.query());
    all_at(&q, GMEM_LOC_DEVICE, 0)?;
    ensure!(q.iter().all(|w| w & GMEM_Q_PINNED != 0), "not pinned");
    ensure!(ok!(s.checksum(r.addr, r.len as u64)).result == sum, "pinned data wrong");
    // A CPU access to a pinned device page fails cleanly with SIGBUS (documented). The
    // handler unpins the page, so the retried access then succeeds.
    let first = r.addr;
    SIGBUS_FD.store(g.fd(), Ordering::SeqCst);
    SIGBUS_PAGE.store(first, Ordering::SeqCst);
    install_sigbus_handler();
    // SAFETY: reading our own mapped region; a SIGBUS is handled above.
    let v = unsafe { std::ptr::read_volatile((first + 8) as *const u32) };
    ensure!(SIGBUS_ADDR.load(Ordering::SeqCst) == first + 8, "no SIGBUS at the pinned page");
    ensure!(v == 6u32.wrapping_add(2).wrapping_mul(7), "value after SIGBUS+unpin: {v}");
    ensure!(q_loc(ok!(g.query(r.addr, 1))[0]) == GMEM_LOC_HOST, "page 0 not home after unpin");
    ok!(r.advise(GMEM_ADV_PIN, 0));
    // DONTNEED and PREFETCH elsewhere are refused while pinned; data stays.
    expect_errno!(r.advise(GMEM_ADV_DONTNEED, 0), libc::EBUSY);
    expect_errno!(r.advise(GMEM_ADV_PREFETCH, GMEM_HOST), libc::EBUSY);
    ok!(r.advise(GMEM_ADV_UNPIN, 0));
    ensure!(checksum(words(&r)) == sum, "data after unpin");
    // A pin larger than the device is refused up front.
    let cap = ok!(s.info()).nr_frames * 4096;
    let big = ok!(g.alloc(cap + 4096 * 16));
    expect_errno!(big.advise(GMEM_ADV_PIN, 0), libc::ENOSPC);
    all_at(&ok!(big.query()), GMEM_LOC_NONE, 0)?;
    Ok(())
}

fn dontneed_reads_zeros_with_inward_rounding() -> TestResult {
    let (g, s) = open()?;
    let r = ok!(g.alloc(64 * 1024));
    pattern(&r, 7);
    ok!(s.fill(r.addr, 8 * 4096, 1)); // half the pages on the device
                                      // [100, 3*4096+100): only pages 1 and 2 are wholly inside.
    ok!(g.advise(r.addr + 100, 3 * 4096, GMEM_ADV_DONTNEED, GMEM_NO_DEVICE, 0));
    let q = ok!(r.query());
    ensure!(q_loc(q[0]) != GMEM_LOC_NONE && q_loc(q[3]) != GMEM_LOC_NONE, "partial pages discarded");
    ensure!(q_loc(q[1]) == GMEM_LOC_NONE && q_loc(q[2]) == GMEM_LOC_NONE, "pages 1,2 not discarded");
    let zeros = vec![0u32; 2048];
    ensure!(ok!(s.checksum(r.addr + 4096, 8192)).result == checksum(&zeros), "device reads non-zero");
    let w = words(&r);
    ensure!(w[1024..3072].iter().all(|&x| x == 0), "CPU reads non-zero after DONTNEED");
    ensure!(w[0] == 1 && w[3072] == 1 + 3072, "neighbouring data lost");
    Ok(())
}

pub fn tests() -> Vec<Test> {
    vec![
        Test { name: "prefetch_to_device_and_back", f: prefetch_to_device_and_back },
        Test { name: "async_prefetch_and_wait", f: async_prefetch_and_wait },
        Test { name: "async_fences_run_in_order_across_files", f: async_fences_run_in_order_across_files },
        Test {
            name: "closing_a_file_does_not_wait_for_other_files_fences",
            f: closing_a_file_does_not_wait_for_other_files_fences,
        },
        Test { name: "a_killed_waiter_stops_its_prefetch", f: a_killed_waiter_stops_its_prefetch },
        Test { name: "preferred_location_host_maps_remotely", f: preferred_location_host_maps_remotely },
        Test { name: "accessed_by_maps_remotely", f: accessed_by_maps_remotely },
        Test { name: "read_mostly_duplicates_then_write_collapses", f: read_mostly_duplicates_then_write_collapses },
        Test { name: "pin_unpin_and_capacity", f: pin_unpin_and_capacity },
        Test { name: "dontneed_reads_zeros_with_inward_rounding", f: dontneed_reads_zeros_with_inward_rounding },
    ]
}
