// SPDX-License-Identifier: GPL-2.0
//! The block executor (`gmem/exec/migrate.rs`, `apply_batch`): a batch of pages moves with one
//! driver call per kind of work, and a copy that fails half way through a batch leaves
//! every page of it valid, with its data.

use crate::harness::{all_at, open, space_stat, words, Test, TestResult};
use crate::t_overcommit::{control, with_control};
use crate::{ensure, expect_errno, ok};
use libgmem::sim::checksum;
use libgmem::*;

const BLOCK: u64 = 2 << 20;

fn pattern(w: &mut [u32], seed: u32) -> u64 {
    for (i, x) in w.iter_mut().enumerate() {
        *x = seed.wrapping_add(i as u32).wrapping_mul(2654435761);
    }
    checksum(w)
}

/// A 2 MiB PREFETCH moves in batches: host -> device and, after the device wrote every
/// page, back, each with a handful of TLB flushes rather than one per page.
fn prefetch_moves_a_block_in_few_calls() -> TestResult {
    let (g, s) = open()?;
    let r = ok!(g.alloc(BLOCK));
    pattern(words(&r), 3);
    let before = ok!(s.info());
    ok!(r.advise(GMEM_ADV_PREFETCH, 0));
    all_at(&ok!(r.query()), GMEM_LOC_DEVICE, 0)?;
    let mid = ok!(s.info());
    // The device writes every page (so the way back must copy), untimed and uncounted.
    ok!(s.fill(r.addr, BLOCK, 5));
    let want: Vec<u32> = (0..(BLOCK / 4) as u32).map(|i| 5u32.wrapping_add(i)).collect();
    let filled = ok!(s.info());
    ok!(r.advise(GMEM_ADV_PREFETCH, GMEM_HOST));
    all_at(&ok!(r.query()), GMEM_LOC_HOST, 0)?;
    let after = ok!(s.info());
    let pages = BLOCK / 4096;
    let (there, back) = (mid.copies - before.copies, after.copies - filled.copies);
    ensure!(there == pages && back == pages, "copied {there} and {back} pages, expected {pages} each");
    // Device -> host revokes the device's 512 mappings: one run per batch, revoked in two
    // goes (the first part's, before its copy starts, then the others'), so two flushes
    // (four if the advice's 512-page chunks straddle the range), where a per-page executor
    // made 512.
    let flushes = after.tlb_flushes - filled.tlb_flushes;
    ensure!(flushes <= 4, "{flushes} TLB flushes for one 2 MiB block");
    ensure!(checksum(words(&r)) == checksum(&want), "data changed by the round trip");
    Ok(())
}

/// The copy engine fails after 100 pages of a 512-page batch (within its first part, 128
/// pages; t_chan.rs fails a later part), in each direction and from each path (PREFETCH,
/// device faults): the call fails with the driver's error, and every page is still where
/// it was, with its data, and moves fine afterwards. The moves cover
/// one 2 MiB-aligned block inside a 4 MiB region, so that each is exactly one executor
/// batch (the executor never batches across blocks, and ALLOC's address need not be
/// 2 MiB-aligned).
fn copy_failure_mid_batch_keeps_every_page() -> TestResult {
    let (g, s) = open()?;
    let r = ok!(g.alloc(2 * BLOCK));
    pattern(words(&r), 11);
    let (a, len) = (r.addr.next_multiple_of(BLOCK), BLOCK);
    let first = ((a - r.addr) / 4) as usize;
    let window = |r: &Region<'_>| words(r)[first..first + (len / 4) as usize].to_vec();
    let sum = checksum(&window(&r));
    let pages = (len / 4096) as usize;

    // Host -> device by PREFETCH.
    ok!(s.fail_copy(100, libc::EIO as u32));
    expect_errno!(g.advise(a, len, GMEM_ADV_PREFETCH, 0, 0), libc::EIO);
    for (i, &w) in ok!(g.query(a, pages)).iter().enumerate() {
        ensure!(q_loc(w) == GMEM_LOC_HOST, "prefetch failed, page {i} in state {w:#x}");
    }
    ensure!(checksum(&window(&r)) == sum, "data changed by a failed prefetch");

    // Host -> device by device faults: the launch fails, the data is intact. The sim
    // reports 256 faults at a time (within the block: more than 100). Density prefetch is
    // off meanwhile: it would take the armed failure and, being only a bet, not report it.
    crate::t_overcommit::control("prefetch=0")?;
    let faulted = (|| -> TestResult {
        ok!(s.fail_copy(100, libc::EIO as u32));
        expect_errno!(s.checksum(a, len), libc::EIO);
        Ok(())
    })();
    crate::t_overcommit::control("prefetch=1")?;
    faulted?;
    ensure!(checksum(&window(&r)) == sum, "data changed by a failed fault migration");
    let o = ok!(s.checksum(a, len));
    ensure!(o.result == sum, "device reads wrong data after the failure");

    // Device -> host by PREFETCH: the dirty device copy stays authoritative.
    ok!(s.fill(a, len, 77));
    let want: Vec<u32> = (0..(len / 4) as u32).map(|i| 77u32.wrapping_add(i)).collect();
    let sum2 = checksum(&want);
    all_at(&ok!(g.query(a, pages)), GMEM_LOC_DEVICE, 0)?;
    ok!(s.fail_copy(100, libc::EIO as u32));
    expect_errno!(g.advise(a, len, GMEM_ADV_PREFETCH, GMEM_HOST, 0), libc::EIO);
    all_at(&ok!(g.query(a, pages)), GMEM_LOC_DEVICE, 0)?;
    let o = ok!(s.checksum(a, len));
    ensure!(o.result == sum2, "device data wrong after a failed write-back");
    ensure!(checksum(&window(&r)) == sum2, "CPU reads wrong data after a failed write-back");
    all_at(&ok!(g.query(a, pages)), GMEM_LOC_HOST, 0)?;
    Ok(())
}

/// A batch in parts whose later allocation stops before its next copy: the steps it made
/// (here clean pages, which need no copy home) are committed with the first part, and every
/// device frame they leave is freed. A write-back of one block: 32 dirty device pages (the
/// first part, `head=32`), 384 clean ones (prefetched from the host), 96 dirty ones; the
/// host page of the first of those fails (`fail_host=33`, as a memory cgroup at its limit
/// would). Before the fix, the first part's and the clean pages' frame updates had room for
/// the larger of the two only: 32 frees were dropped and their frames leaked.
fn host_alloc_failure_after_first_part_frees_every_frame() -> TestResult {
    // Only this advice moves pages meanwhile.
    with_control(
        "preevict=0 peer=0 prefetch=0 readahead=0 head=32",
        "fail_host=0 preevict=1 peer=1 prefetch=1 readahead=1 head=128",
        || {
            let (g, s) = open()?;
            let used0 = crate::t_overcommit::counter(0, "used")?;
            let r = ok!(g.alloc(2 * BLOCK));
            let a = r.addr.next_multiple_of(BLOCK);
            let first = ((a - r.addr) / 4) as usize;
            let pg = 4096u64;
            let (clean, tail) = (a + 32 * pg, a + 416 * pg);
            // What the CPU must read back in the end (computed here: a CPU read now would bring
            // device pages home): the device's words at both ends, the CPU's in the middle.
            let mut want: Vec<u32> = (0..512 * 1024u32).map(|i| 1000u32.wrapping_add(i)).collect();
            for (i, x) in want[416 * 1024..].iter_mut().enumerate() {
                *x = 2000u32.wrapping_add(i as u32);
            }
            pattern(&mut want[32 * 1024..416 * 1024], 5);
            // The clean middle: written by the CPU, prefetched (the host copy stays valid).
            words(&r)[first + 32 * 1024..first + 416 * 1024].copy_from_slice(&want[32 * 1024..416 * 1024]);
            ok!(g.advise(clean, 384 * pg, GMEM_ADV_PREFETCH, 0, 0));
            // The dirty ends: written by the device.
            ok!(s.fill(a, 32 * pg, 1000));
            ok!(s.fill(tail, 96 * pg, 2000));
            let q = ok!(g.query(a, 512));
            all_at(&q, GMEM_LOC_DEVICE, 0)?;
            let dirty = q.iter().map(|w| w & GMEM_Q_DIRTY != 0).collect::<Vec<_>>();
            ensure!(
                dirty[..32].iter().chain(&dirty[416..]).all(|&d| d) && !dirty[32..416].iter().any(|&d| d),
                "layout"
            );
            control("fail_host=33")?;
            let moved = g.advise(a, BLOCK, GMEM_ADV_PREFETCH, GMEM_HOST, 0);
            control("fail_host=0")?;
            expect_errno!(moved, libc::ENOMEM);
            let q = ok!(g.query(a, 512));
            all_at(&q[..416], GMEM_LOC_HOST, 0)?;
            all_at(&q[416..], GMEM_LOC_DEVICE, 0)?;
            // Exactly the 96 pages still there hold frames: none leaked.
            let used = crate::t_overcommit::counter(0, "used")?;
            ensure!(used == used0 + 96, "{} frames in use for 96 pages on the device", used - used0);
            ok!(g.advise(a, BLOCK, GMEM_ADV_PREFETCH, GMEM_HOST, 0));
            ensure!(words(&r)[first..first + 512 * 1024] == want[..], "the CPU reads other data");
            drop(r);
            let used = crate::t_overcommit::counter(0, "used")?;
            ensure!(used == used0, "{} frames still in use after the region went", used - used0);
            Ok(())
        },
    )
}

/// A region's teardown whose block cannot have its batch's step list (`fail_teardown=`,
/// as a kernel short of memory: an OOM-killed process's exit) still releases every frame
/// of that block: it goes on in batches of at most eight pages kept on the stack. Before,
/// it logged the failure and kept the block's frames for good. The hook is armed for the
/// region's first block, or its second when the first is under 64 pages (regions need
/// not start on a block boundary), and the control file shows it consumed.
fn teardown_short_of_memory_frees_every_frame() -> TestResult {
    // Only this region moves pages meanwhile.
    with_control(
        "preevict=0 peer=0 prefetch=0 readahead=0",
        "fail_teardown=0 preevict=1 peer=1 prefetch=1 readahead=1",
        || {
            let (g, s) = open()?;
            let used0 = crate::t_overcommit::counter(0, "used")?;
            let r = ok!(g.alloc(2 * BLOCK));
            let pages = (2 * BLOCK / 4096) as usize;
            // Every page on the device (written there: device faults, zero-filled frames).
            ok!(s.fill(r.addr, 2 * BLOCK, 7));
            all_at(&ok!(g.query(r.addr, pages)), GMEM_LOC_DEVICE, 0)?;
            let used = crate::t_overcommit::counter(0, "used")?;
            ensure!(used == used0 + pages as u64, "{} frames in use for {pages} pages", used as i64 - used0 as i64);
            let first = (r.addr.next_multiple_of(BLOCK) - r.addr) / 4096;
            let nth = if first > 0 && first < 64 { 2 } else { 1 };
            let shown = || -> std::result::Result<bool, String> {
                Ok(crate::t_overcommit::control_text()?.lines().next().unwrap_or("").contains("fail_teardown="))
            };
            control(&format!("fail_teardown={nth}"))?;
            ensure!(shown()?, "fail_teardown={nth} is not shown while armed");
            drop(r);
            let consumed = !shown()?;
            control("fail_teardown=0")?;
            ensure!(consumed, "the teardown never reached its block {nth}: the hook was not consumed");
            let used = crate::t_overcommit::counter(0, "used")?;
            ensure!(used == used0, "{} frames still in use after the region went", used as i64 - used0 as i64);
            Ok(())
        },
    )
}

/// Bad fault-injection arguments are refused.
fn fail_copy_rejects_bad_arguments() -> TestResult {
    let (_g, s) = open()?;
    expect_errno!(s.fail_copy(1, 0), libc::EINVAL);
    expect_errno!(s.fail_copy(1, 4096), libc::EINVAL);
    expect_errno!(s.fail_copy(u64::MAX, libc::EIO as u32), libc::EINVAL);
    // Disarm by arming a count no call reaches.
    ok!(s.fail_copy(u64::MAX - 1, libc::EIO as u32));
    Ok(())
}

/// CPU fault-around: reading a device-resident region page by page brings whole windows
/// home per fault (far fewer faults than pages), at unaligned region edges too, never
/// moves pinned pages, and leaves advised (READ_MOSTLY, duplicated) pages to their own
/// faults; every word read is right.
fn fault_around_edges_pinned_and_duplicated() -> TestResult {
    let (g, s) = open()?;
    let s1 = libgmem::sim::Sim::open(1).map_err(|e| e.to_string())?;
    // 3 MiB + 3 pages: the region's ends are not 2 MiB-aligned in general.
    let len = (3 << 20) + 3 * 4096;
    let pages = len / 4096;
    let r = ok!(g.alloc(len));
    ok!(s.fill(r.addr, len, 1000));
    let pinned = 10..20u64;
    ok!(g.advise(r.addr + pinned.start * 4096, (pinned.end - pinned.start) * 4096, GMEM_ADV_PIN, 0, 0));
    let dup = 100..110u64;
    ok!(g.advise(r.addr + dup.start * 4096, (dup.end - dup.start) * 4096, GMEM_ADV_READ_MOSTLY, 0, 0));
    ok!(s1.checksum(r.addr + dup.start * 4096, (dup.end - dup.start) * 4096));
    let before = space_stat(pages, "cpu_faults")?;
    let w = words(&r);
    let mut read = 0u64;
    for p in 0..pages {
        if pinned.contains(&p) {
            continue;
        }
        for k in [0usize, 1023] {
            let i = p as usize * 1024 + k;
            // SAFETY: within the region; volatile so that every page is really touched.
            let v = unsafe { std::ptr::read_volatile(&w[i]) };
            ensure!(v == 1000u32.wrapping_add(i as u32), "page {p} word {k}: {v:#x}");
        }
        read += 1;
    }
    let faults = space_stat(pages, "cpu_faults")? - before;
    ensure!(faults * 4 <= read, "{faults} CPU faults for {read} pages read: no fault-around");
    let st = ok!(r.query());
    for (p, &q) in st.iter().enumerate() {
        let p = p as u64;
        if pinned.contains(&p) {
            ensure!(
                q_loc(q) == GMEM_LOC_DEVICE && q_dev(q) == 0 && q & GMEM_Q_PINNED != 0,
                "pinned page {p} moved: {q:#x}"
            );
        } else {
            ensure!(q_loc(q) == GMEM_LOC_HOST, "page {p} not home after the CPU read it: {q:#x}");
        }
    }
    ok!(g.advise(r.addr + pinned.start * 4096, (pinned.end - pinned.start) * 4096, GMEM_ADV_UNPIN, 0, 0));
    let o = ok!(s.checksum(r.addr, len));
    let want: Vec<u32> = (0..(len / 4) as u32).map(|i| 1000u32.wrapping_add(i)).collect();
    ensure!(o.result == checksum(&want), "device checksum after the CPU pass is wrong");
    Ok(())
}

static SIGBUS_SEEN: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Counts the SIGBUS and returns: the access is made again.
extern "C" fn count_sigbus(_sig: i32) {
    SIGBUS_SEEN.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
}

/// A CPU fault's fault-around is a bet: when the copy home of its batch fails, the faulting
/// page comes home alone and the access goes on. (Before, a failed copy of any page of the
/// batch failed the access: SIGBUS.) The CPU reads page 99 of a block the device wrote
/// (it comes alone), then page 100, which continues a stream and takes the rest of the
/// block with it; the next copy call of more than one page fails.
fn cpu_fault_around_failure_does_not_fail_the_access() -> TestResult {
    // Read-ahead off from the start: the device's (after the fill) and the CPU's (home)
    // workers would take the armed failure first. (CI's debug kernel once saw a worker
    // still at work from the fill, and page 101 came home.)
    control("readahead=0")?;
    let res = fault_around_failure_with_readahead_off();
    control("readahead=1")?;
    res
}

fn fault_around_failure_with_readahead_off() -> TestResult {
    let (g, s) = open()?;
    let r = ok!(g.alloc(2 * BLOCK));
    let a = r.addr.next_multiple_of(BLOCK);
    ok!(s.fill(a, BLOCK, 500));
    let w = words(&r);
    let word = |p: usize| ((a - r.addr) / 4) as usize + p * 1024;
    let want = |p: usize| 500u32.wrapping_add((p * 1024) as u32);
    // SAFETY: within the region; volatile, so that the page is really touched.
    let v = unsafe { std::ptr::read_volatile(&w[word(99)]) };
    ensure!(v == want(99), "page 99 reads {v:#x}");
    let q = ok!(g.query(a, 512));
    ensure!(q_loc(q[99]) == GMEM_LOC_HOST && q_loc(q[100]) == GMEM_LOC_DEVICE, "{:#x} {:#x}", q[99], q[100]);
    SIGBUS_SEEN.store(0, std::sync::atomic::Ordering::SeqCst);
    crate::harness::on_signal(libc::SIGBUS, count_sigbus as *const () as usize, false);
    let armed = s.fail_copy(1, libc::EIO as u32);
    // SAFETY: as above.
    let v = armed.is_ok().then(|| unsafe { std::ptr::read_volatile(&w[word(100)]) });
    crate::harness::on_signal(libc::SIGBUS, libc::SIG_DFL, false);
    ok!(armed);
    let seen = SIGBUS_SEEN.load(std::sync::atomic::Ordering::SeqCst);
    ensure!(seen == 0, "the access got SIGBUS {seen} time(s)");
    ensure!(v == Some(want(100)), "page 100 reads {v:x?}");
    // The batch did take the failure: the rest of the block is still on the device.
    let q = ok!(g.query(a, 512));
    ensure!(q_loc(q[100]) == GMEM_LOC_HOST, "page 100 not home: {:#x}", q[100]);
    ensure!(q_loc(q[101]) == GMEM_LOC_DEVICE, "page 101 came home: no fault-around batch failed ({:#x})", q[101]);
    Ok(())
}

/// Two threads fault disjoint halves of one region at once, on one device and on two;
/// every round's data is verified by the CPU and by the devices.
fn concurrent_faults_on_one_region() -> TestResult {
    let (g, _) = open()?;
    let len: u64 = 8 << 20;
    let r = ok!(g.alloc(len));
    let half = len / 2;
    for (round, devs) in [(0u32, [0usize, 0]), (1, [0, 1]), (2, [1, 0])] {
        let results: Vec<TestResult> = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..2u64)
                .map(|t| {
                    let d = devs[t as usize];
                    let base = r.addr + t * half;
                    sc.spawn(move || -> TestResult {
                        let s = libgmem::sim::Sim::open(d).map_err(|e| e.to_string())?;
                        let v = 7000 * (round + 1) + t as u32;
                        ok!(s.fill(base, half, v));
                        let want: Vec<u32> = (0..(half / 4) as u32).map(|i| v.wrapping_add(i)).collect();
                        let o = ok!(s.checksum(base, half));
                        ensure!(o.result == checksum(&want), "round {round} thread {t} dev{d}: checksum");
                        Ok(())
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("thread panicked".into()))).collect()
        });
        for x in results {
            x?;
        }
        let w = words(&r);
        for t in 0..2u64 {
            let v = 7000 * (round + 1) + t as u32;
            let first = (t * half / 4) as usize;
            for k in 0..(half / 4) as usize {
                ensure!(
                    w[first + k] == v.wrapping_add(k as u32),
                    "round {round}: word {} is {:#x}",
                    first + k,
                    w[first + k]
                );
            }
        }
    }
    Ok(())
}

/// 2 MiB device mappings: a block that arrives whole is mapped with one entry; one page
/// leaving it splits the entry (the other 511 stay mapped, with their data); the block is
/// mapped whole again once all of it is back, dirty alike; freeing it leaves no entry.
/// Read-ahead is off: the device's writes over the block would read the region's other
/// block ahead, whose entries the counts below would see.
fn two_mib_mapping_splits_when_a_page_leaves() -> TestResult {
    control("readahead=0")?;
    let res = two_mib_mapping_splits();
    control("readahead=1")?;
    res
}

fn two_mib_mapping_splits() -> TestResult {
    let (g, s) = open()?;
    let r = ok!(g.alloc(2 * BLOCK));
    let a = r.addr.next_multiple_of(BLOCK);
    let first = ((a - r.addr) / 4) as usize;
    let nw = (BLOCK / 4) as usize;
    let pages = (BLOCK / 4096) as usize;
    let sum = pattern(&mut words(&r)[first..first + nw], 21);
    let i0 = ok!(s.info());
    let delta =
        |i: &libgmem::sim::SimInfo| (i.ptes_2m.wrapping_sub(i0.ptes_2m) as i64, i.ptes.wrapping_sub(i0.ptes) as i64);

    // Host -> device in one batch: one 2 MiB entry, no 4 KiB ones; the device reads it
    // without a fault.
    ok!(g.advise(a, BLOCK, GMEM_ADV_PREFETCH, 0, 0));
    all_at(&ok!(g.query(a, pages)), GMEM_LOC_DEVICE, 0)?;
    let i1 = ok!(s.info());
    ensure!(
        delta(&i1) == (1, 0),
        "after a whole-block prefetch: (2 MiB, 4 KiB) entries {:?}, expected (1, 0)",
        delta(&i1)
    );
    let o = ok!(s.checksum(a, BLOCK));
    ensure!(o.result == sum && o.faults == 0, "device read {:#x} (want {sum:#x}) with {} faults", o.result, o.faults);

    // The device writes the block: the clean pages' read-only entry gives way to writable
    // ones, and once every page is dirty the block is one (writable) entry again.
    ok!(s.fill(a, BLOCK, 9));
    let i2 = ok!(s.info());
    ensure!(delta(&i2) == (1, 0), "after the device wrote every page: entries {:?}, expected (1, 0)", delta(&i2));
    ensure!(i2.splits_2m > i1.splits_2m, "the read-only entry was never split by a write");

    // One page goes home: the entry splits, the other 511 pages stay mapped.
    let leave = 5u64;
    ok!(g.advise(a + leave * 4096, 4096, GMEM_ADV_PREFETCH, GMEM_HOST, 0));
    let q = ok!(g.query(a, pages));
    ensure!(q_loc(q[leave as usize]) == GMEM_LOC_HOST, "page {leave} did not go home: {:#x}", q[leave as usize]);
    let i3 = ok!(s.info());
    ensure!(delta(&i3) == (0, 511), "after one page left: entries {:?}, expected (0, 511)", delta(&i3));
    ensure!(i3.splits_2m == i2.splits_2m + 1, "{} splits for one page leaving", i3.splits_2m - i2.splits_2m);
    let want: Vec<u32> = (0..nw as u32).map(|i| 9u32.wrapping_add(i)).collect();
    let sum9 = checksum(&want);
    // The device still reads all of it (511 pages through the split entries, one faults).
    let o = ok!(s.checksum(a, BLOCK));
    ensure!(o.result == sum9, "device read {:#x} after the split, want {sum9:#x}", o.result);
    ensure!(o.faults == 1, "{} device faults reading the split block, expected 1", o.faults);
    ensure!(checksum(&words(&r)[first..first + nw]) == sum9, "CPU reads wrong data after the split");

    // Written whole again (the page that came back is dirty like the rest): one entry.
    all_at(&ok!(g.query(a, pages)), GMEM_LOC_HOST, 0)?;
    ok!(g.advise(a, BLOCK, GMEM_ADV_PREFETCH, 0, 0));
    ok!(s.fill(a, BLOCK, 4));
    let i4 = ok!(s.info());
    ensure!(delta(&i4) == (1, 0), "after the block came back whole: entries {:?}, expected (1, 0)", delta(&i4));

    drop(r);
    let i5 = ok!(s.info());
    ensure!(delta(&i5) == (0, 0), "after FREE: entries {:?} left", delta(&i5));
    Ok(())
}

pub fn tests() -> Vec<Test> {
    vec![
        Test { name: "prefetch_moves_a_block_in_few_calls", f: prefetch_moves_a_block_in_few_calls },
        Test { name: "copy_failure_mid_batch_keeps_every_page", f: copy_failure_mid_batch_keeps_every_page },
        Test { name: "fail_copy_rejects_bad_arguments", f: fail_copy_rejects_bad_arguments },
        Test {
            name: "host_alloc_failure_after_first_part_frees_every_frame",
            f: host_alloc_failure_after_first_part_frees_every_frame,
        },
        Test { name: "fault_around_edges_pinned_and_duplicated", f: fault_around_edges_pinned_and_duplicated },
        Test { name: "teardown_short_of_memory_frees_every_frame", f: teardown_short_of_memory_frees_every_frame },
        Test {
            name: "cpu_fault_around_failure_does_not_fail_the_access",
            f: cpu_fault_around_failure_does_not_fail_the_access,
        },
        Test { name: "concurrent_faults_on_one_region", f: concurrent_faults_on_one_region },
        Test { name: "two_mib_mapping_splits_when_a_page_leaves", f: two_mib_mapping_splits_when_a_page_leaves },
    ]
}
