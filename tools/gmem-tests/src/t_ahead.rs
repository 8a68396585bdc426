// SPDX-License-Identifier: GPL-2.0
//! Overlap across blocks: read-ahead (a device streaming through a region gets its next
//! block fetched while it computes on the current one) and PREFETCH in lanes (several
//! blocks of one advice at once). Both must move exactly the data a serial run moves,
//! report the first error of any lane, and leave nothing running behind the call or behind
//! the region's teardown.

use crate::harness::{all_at, open, space_stat, words, TestResult};
use crate::t_overcommit::{control, control_refused, counter};
use crate::{ensure, expect_errno, ok};
use libgmem::sim::checksum;
use libgmem::{q_loc, GMEM_ADV_PREFETCH, GMEM_LOC_DEVICE, GMEM_LOC_HOST};

const BLOCK: usize = 2 << 20;

fn pattern(i: usize, seed: u32) -> u32 {
    (i as u32).wrapping_mul(2_654_435_761) ^ seed
}

/// Polls `f` until it holds (read-ahead finishes in the background), for up to 2 s.
fn eventually(mut f: impl FnMut() -> bool) -> bool {
    for _ in 0..200 {
        if f() {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    false
}

/// Runs `f(on, seed)` with read-ahead on (the first seed), then off (the second), and
/// switches it back on whatever happens.
fn on_and_off(seeds: [u32; 2], f: impl Fn(bool, u32) -> TestResult) -> TestResult {
    for (on, seed) in [(true, seeds[0]), (false, seeds[1])] {
        control(if on { "readahead=1" } else { "readahead=0" })?;
        let res = f(on, seed);
        control("readahead=1")?;
        res?;
    }
    Ok(())
}

/// A device checksum over 8 MiB of host data: with read-ahead on, blocks after the first
/// arrive ahead of the device (counted), the device reads exactly what the CPU wrote, and
/// every block ends on the device; with `readahead=0` none is read ahead and the result is
/// the same.
fn stream_reads_the_next_block_ahead() -> TestResult {
    let (g, s) = open()?;
    const LEN: usize = 4 * BLOCK;
    on_and_off([0x0a11_0000, 0x0b22_0000], |on, seed| {
        let (r, all) = cpu_written(&g, LEN + BLOCK, seed)?;
        let a = r.addr.next_multiple_of(BLOCK as u64);
        let first = ((a - r.addr) / 4) as usize;
        let want = &all[first..first + LEN / 4];
        let ra0 = counter(0, "prefetch.readahead")?;
        let o = ok!(s.checksum(a, LEN as u64));
        ensure!(o.result == checksum(want), "readahead={}: the device read other data", u8::from(on));
        // The last read-ahead may still be running: it is of a block past the range
        // (the region's tail), so wait for the counter to settle first.
        let ra = if on {
            ensure!(
                eventually(|| counter(0, "prefetch.readahead").is_ok_and(|c| c - ra0 >= 512)),
                "a 4-block stream read no block ahead"
            );
            counter(0, "prefetch.readahead")? - ra0
        } else {
            counter(0, "prefetch.readahead")? - ra0
        };
        if !on {
            ensure!(ra == 0, "readahead=0 still read {ra} pages ahead");
        }
        let q = ok!(g.query(a, LEN / 4096));
        ensure!(q.iter().all(|&w| q_loc(w) == GMEM_LOC_DEVICE), "a streamed page is not on the device");
        let w = words(&r);
        ensure!(w[first..first + LEN / 4] == *want, "the CPU reads other data than it wrote");
        Ok(())
    })
}

/// Read-ahead follows a device's streams in two regions at once, one chain each: after the
/// device's faults in one region and then in another, debugfs lists a stream in each (with
/// one chain per device, the second fault took the first's place); AXPY over both then
/// reads and writes exactly the right data, and a freed region's stream is forgotten.
fn readahead_follows_two_regions_at_once() -> TestResult {
    let (g, s) = open()?;
    let (x, xs) = cpu_written(&g, 6 << 20, 0x0c33_0000)?;
    let (y, ys) = cpu_written(&g, 6 << 20, 0x0d44_0000)?;
    let streams = || libgmem::debugfs::section_words(0, "streams").ok_or("no streams line for dev0".to_string());
    let follows = |w: &[String], a: u64| w.iter().any(|s| s.starts_with(&format!("{a:#x}@")));
    ok!(s.checksum(x.addr, 1 << 20));
    ok!(s.checksum(y.addr, 1 << 20));
    let w = streams()?;
    ensure!(
        follows(&w, x.addr) && follows(&w, y.addr),
        "streams {w:?}: not one in each of {:#x} and {:#x}",
        x.addr,
        y.addr
    );
    ok!(s.axpy(x.addr, y.addr, 6 << 20, 3));
    let want: Vec<u32> = xs.iter().zip(&ys).map(|(&a, &b)| a.wrapping_mul(3).wrapping_add(b)).collect();
    ensure!(ok!(s.checksum(y.addr, 6 << 20)).result == checksum(&want), "the device's AXPY result is wrong");
    ensure!(words(&y)[..] == want[..], "the CPU reads another AXPY result");
    ensure!(words(&x)[..] == xs[..], "x changed");
    let xa = x.addr;
    drop(x);
    let w = streams()?;
    ensure!(!follows(&w, xa), "streams {w:?}: the freed region {xa:#x} is still followed");
    Ok(())
}

/// A region of `len` bytes plus a block, its first whole block at `a`, written by the device
/// from there (`FILL`: word `i` is `seed + i`) and checked to be all on the device. Returns
/// the region, `a`, and the index of `a`'s word in the region.
fn device_written<'g>(
    g: &'g libgmem::Gmem,
    s: &libgmem::sim::Sim,
    len: usize,
    seed: u32,
) -> Result<(libgmem::Region<'g>, u64, usize), String> {
    let r = ok!(g.alloc((len + BLOCK) as u64));
    let a = r.addr.next_multiple_of(BLOCK as u64);
    let first = ((a - r.addr) / 4) as usize;
    ok!(s.fill(a, len as u64, seed));
    let q = ok!(g.query(a, len / 4096));
    ensure!(q.iter().all(|&x| q_loc(x) == GMEM_LOC_DEVICE), "the device's writes are not on the device");
    Ok((r, a, first))
}

/// The CPU reading back 8 MiB the device wrote: with read-ahead on, blocks after the first
/// come home ahead of the CPU (counted in the space's `home_ahead`), each block costs the
/// CPU a few faults at most (map-around maps a block brought home at once), and the CPU
/// reads exactly what the device wrote; with `readahead=0` nothing comes home ahead.
fn cpu_stream_reads_home_ahead() -> TestResult {
    let (g, s) = open()?;
    const LEN: usize = 4 * BLOCK;
    on_and_off([0x0c33_0000, 0x0d44_0000], |on, seed| {
        let (r, a, first) = device_written(&g, &s, LEN, seed)?;
        let pages = r.pages() as u64;
        let (ahead0, faults0) = (space_stat(pages, "home_ahead")?, space_stat(pages, "cpu_faults")?);
        let w = words(&r);
        let bad = (0..LEN / 4).find(|&i| w[first + i] != seed.wrapping_add(i as u32));
        ensure!(bad.is_none(), "readahead={}: the CPU reads other data at word {bad:?}", u8::from(on));
        let ahead = space_stat(pages, "home_ahead")? - ahead0;
        let faults = space_stat(pages, "cpu_faults")? - faults0;
        if on {
            ensure!(ahead >= 512, "a 4-block stream home read {ahead} pages ahead");
            ensure!(faults <= 64, "{faults} CPU faults for 4 blocks");
        } else {
            ensure!(ahead == 0, "readahead=0 still read {ahead} pages home ahead");
        }
        let q = ok!(g.query(a, LEN / 4096));
        ensure!(q.iter().all(|&w| q_loc(w) == GMEM_LOC_HOST), "a page read by the CPU is not home");
        Ok(())
    })
}

/// Sequential fault-around, with read-ahead off so that only the faults themselves move
/// pages: a lone CPU read in the middle of device-written data brings little of its block
/// home (the page before it is not home: the density rule decides), while the CPU reading
/// 4 blocks in order takes 5 faults: two in the first block (the second finds the page
/// before it home and mapped, and brings the rest of the block) and one in each block
/// after it (its first page follows a streamed block); the density rule needed a dozen
/// or more per block. Every word reads back as the device wrote it.
fn cpu_sequential_fault_around() -> TestResult {
    let (g, s) = open()?;
    const LEN: usize = 4 * BLOCK;
    const PAGES: usize = BLOCK / 4096;
    let seed = 0x0e55_0000u32;
    control("readahead=0")?;
    let res = (|| -> TestResult {
        let (r, a, first) = device_written(&g, &s, LEN, seed)?;
        let pages = r.pages() as u64;
        let w = words(&r);
        // A lone read of page 300 of the first block.
        let lone = 300 * 1024;
        ensure!(w[first + lone] == seed.wrapping_add(lone as u32), "the lone read got other data");
        let q = ok!(g.query(a, PAGES));
        let home = q.iter().filter(|&&x| q_loc(x) == GMEM_LOC_HOST).count();
        ensure!(home <= PAGES / 4, "a lone read brought {home} pages of its block home");
        let faults0 = space_stat(pages, "cpu_faults")?;
        let bad = (0..LEN / 4).find(|&i| w[first + i] != seed.wrapping_add(i as u32));
        ensure!(bad.is_none(), "the CPU reads other data at word {bad:?}");
        let faults = space_stat(pages, "cpu_faults")? - faults0;
        ensure!(faults <= 5, "{faults} CPU faults to read 4 blocks in order");
        let q = ok!(g.query(a, LEN / 4096));
        ensure!(q.iter().all(|&x| q_loc(x) == GMEM_LOC_HOST), "a page read by the CPU is not home");
        Ok(())
    })();
    control("readahead=1")?;
    res
}

/// Read-ahead racing with the region's end: streams over the head of a region and frees
/// it at once, many times, while the read-ahead of the next block may be queued or
/// running; then the same with the process exiting instead. Nothing may crash or leak (the
/// judge watches the console), and the device is left with every frame free.
fn readahead_races_free_and_exit() -> TestResult {
    let (g, s) = open()?;
    let used0 = counter(0, "used")?;
    for k in 0..16u32 {
        let (r, _) = cpu_written(&g, 4 * BLOCK, k)?;
        // The first whole block: its fault reads the second ahead.
        let a = r.addr.next_multiple_of(BLOCK as u64);
        ok!(s.checksum(a, BLOCK as u64));
        if k % 2 == 1 {
            // The way back: the device writes the blocks, the CPU reads the first one, so
            // the next ones are read home ahead while the region goes.
            ok!(s.fill(r.addr, r.len as u64, k));
            let w = words(&r);
            let off = ((a - r.addr) / 4) as usize;
            ensure!(w[off] == k.wrapping_add(off as u32), "round {k}: the CPU reads other data");
        }
        drop(r);
    }
    for k in 0..4u32 {
        let code = crate::harness::child_exit(|| {
            let Ok((g, s)) = open() else { return 2 };
            let Ok(r) = g.alloc((4 * BLOCK) as u64) else { return 3 };
            for (i, w) in words(&r).iter_mut().enumerate() {
                *w = pattern(i, k);
            }
            let a = r.addr.next_multiple_of(BLOCK as u64);
            if s.checksum(a, BLOCK as u64).is_err() {
                return 4;
            }
            // Odd rounds: the CPU reads back what the device wrote (read home ahead).
            if k % 2 == 1 && (s.fill(r.addr, r.len as u64, k).is_err() || words(&r)[0] != k) {
                return 5;
            }
            // Exit with the read-ahead in flight (the region is torn down by exit_mmap).
            std::mem::forget(r);
            0
        });
        ensure!(code == 0, "child {k} failed with {code}");
    }
    ensure!(
        eventually(|| counter(0, "used").is_ok_and(|u| u <= used0)),
        "frames still used after every region is gone: {} (before: {used0})",
        counter(0, "used")?
    );
    Ok(())
}

/// A fresh region of `len` bytes written by the CPU with `seed`'s pattern, and its data.
fn cpu_written(g: &libgmem::Gmem, len: usize, seed: u32) -> Result<(libgmem::Region<'_>, Vec<u32>), String> {
    let r = ok!(g.alloc(len as u64));
    let want: Vec<u32> = (0..r.len / 4).map(|i| pattern(i, seed)).collect();
    words(&r).copy_from_slice(&want);
    Ok((r, want))
}

/// A region from [`cpu_written`], then PREFETCHed to device 0: every page must be on the
/// device and read the same from the device (with no fault) and from the CPU. Returns the
/// region and its data. `what` names the setting.
fn prefetched<'g>(
    g: &'g libgmem::Gmem,
    s: &libgmem::sim::Sim,
    len: usize,
    seed: u32,
    what: &str,
) -> Result<(libgmem::Region<'g>, Vec<u32>), String> {
    let (r, want) = cpu_written(g, len, seed)?;
    ok!(r.advise(GMEM_ADV_PREFETCH, 0));
    let q = ok!(g.query(r.addr, len / 4096));
    ensure!(q.iter().all(|&w| q_loc(w) == GMEM_LOC_DEVICE), "{what}: a page was not prefetched");
    let o = ok!(s.checksum(r.addr, len as u64));
    ensure!(o.faults == 0, "{what}: {} device faults after PREFETCH", o.faults);
    ensure!(o.result == checksum(&want), "{what}: the device reads other data");
    ensure!(words(&r)[..] == want[..], "{what}: the CPU reads other data");
    Ok((r, want))
}

/// PREFETCH of 2-3 blocks (whole or partial) in three or two lanes moves every page with its
/// data, like one lane; a copy failure in any lane fails the advice with that errno, every page keeps its data (on
/// the device or still on the host), and no copy is left in flight when the call returns.
fn prefetch_lanes_are_exact_and_fail_cleanly() -> TestResult {
    let (g, s) = open()?;
    // A quarter of the sim's 16 MiB: no eviction part way.
    const LEN: usize = 2 * BLOCK;
    for lanes in [3, 2, 1] {
        control(&format!("lanes={lanes}"))?;
        let res = (|| -> TestResult {
            let (r, want) = prefetched(&g, &s, LEN, 0x1a4e_0000 | lanes, &format!("lanes={lanes}"))?;
            // Back on the host (the CPU read them), then a PREFETCH whose first copy call
            // of over 100 pages fails after 100: the advice fails with EIO, part way.
            ok!(s.fail_copy(100, libc::EIO as u32));
            expect_errno!(r.advise(GMEM_ADV_PREFETCH, 0), libc::EIO);
            let i = ok!(s.info());
            ensure!(i.inflight == 0, "lanes={lanes}: {} copies in flight after the advice failed", i.inflight);
            let q = ok!(g.query(r.addr, LEN / 4096));
            let on_dev = q.iter().filter(|&&w| q_loc(w) == GMEM_LOC_DEVICE).count();
            ensure!(
                q.iter().all(|&w| q_loc(w) == GMEM_LOC_DEVICE || q_loc(w) == GMEM_LOC_HOST),
                "lanes={lanes}: a page is neither on the device nor on the host"
            );
            ensure!(on_dev < LEN / 4096, "lanes={lanes}: every page moved although a copy failed");
            let o = ok!(s.checksum(r.addr, LEN as u64));
            ensure!(o.result == checksum(&want), "lanes={lanes}: the device reads other data after the failure");
            ensure!(words(&r)[..] == want[..], "lanes={lanes}: the CPU reads other data after the failure");
            Ok(())
        })();
        control("lanes=3")?; // the default
        res?;
    }
    Ok(())
}

/// A PREFETCH whose range begins a few pages before a block boundary does not start with
/// that short first chunk (`moves::first_chunk_last` leaves it for last). The caller's
/// first batch, whose copy is the advice's first (its helpers are queued only once that
/// copy has started), is then the first whole block's first part: the trace's first
/// host-to-device copy of the advice is longer than the chunk. Every page still moves
/// once, with its data. The settings this relies on are set here: three lanes, first
/// parts of 128 pages, no multi-path routing (with a whole block in parts on the sim's
/// two channels, the caller's first copy is traced before its helpers are queued).
fn prefetch_does_not_start_with_a_short_chunk() -> TestResult {
    let (g, s) = open()?;
    let chans = ok!(s.info()).channels;
    ensure!(chans == 2, "the sim has {chans} copy channels, expected 2");
    control("lanes=3 head=128 multipath=0")?;
    let res = short_first_chunk_goes_later(&g, &s);
    control("multipath=1")?; // the default (lanes and head are at theirs)
    res
}

fn short_first_chunk_goes_later(g: &libgmem::Gmem, s: &libgmem::sim::Sim) -> TestResult {
    use libgmem::trace;
    const LEAD: usize = 16;
    let (r, all) = cpu_written(g, 4 * BLOCK, 0x1ead_0000)?;
    // The first block boundary at least LEAD pages into the region, and a range from LEAD
    // pages before it over two whole blocks (inside the region's four).
    let mut b = r.addr.next_multiple_of(BLOCK as u64);
    if b - r.addr < (LEAD * 4096) as u64 {
        b += BLOCK as u64;
    }
    let start = b - (LEAD * 4096) as u64;
    let len = LEAD * 4096 + 2 * BLOCK;
    trace::dir().map_err(|e| format!("tracefs: {e}"))?;
    trace::enable(false).map_err(|e| e.to_string())?;
    trace::clear().map_err(|e| e.to_string())?;
    trace::enable(true).map_err(|e| e.to_string())?;
    let res = g.advise(start, len as u64, GMEM_ADV_PREFETCH, 0, 0);
    trace::enable(false).map_err(|e| e.to_string())?;
    ok!(res);
    let h2d: Vec<i64> = ok!(trace::read())
        .iter()
        .filter(|e| e.name == "migrate" && e.text.get("dir").map(String::as_str) == Some("h2d"))
        .filter_map(|e| e.num.get("pages").copied())
        .collect();
    let first = h2d.first().copied().unwrap_or(0);
    ensure!(first > LEAD as i64, "the advice's first copy moved {first} pages: the short first chunk went first");
    let moved: i64 = h2d.iter().sum();
    ensure!(moved == (len / 4096) as i64, "{moved} pages crossed host to device, not {}", len / 4096);
    all_at(&ok!(g.query(start, len / 4096)), GMEM_LOC_DEVICE, 0)?;
    let k = ((start - r.addr) / 4) as usize;
    let want = &all[k..k + len / 4];
    ensure!(ok!(s.checksum(start, len as u64)).result == checksum(want), "the device reads other data");
    ensure!(words(&r)[..] == all[..], "the CPU reads other data");
    Ok(())
}

/// The `head=` switch bounds the first part of a batch in parts (`migrate::share_plan`:
/// `min(head, ceil(copies / shares))`; with the sim's two channels a block's first part is
/// at most 256 pages).
/// - Sizes outside 16..256 are refused with EINVAL and change nothing.
/// - `head=16`: a PREFETCH of one aligned block whose second part fails after 20 pages
///   (the 16-page first part is too short to fail) keeps exactly the first 16 pages on the
///   device; `head=256`: the first part itself, 256 pages, fails after 200, and no page
///   moves (with the default 128, no copy of that block is longer than 200).
/// - With either size, a PREFETCH over two and a half blocks moves every page with its
///   data.
fn prefetch_head_sizes_are_exact() -> TestResult {
    let (g, s) = open()?;
    for bad in ["head=15", "head=257", "head=", "head=x"] {
        control_refused(bad)?;
    }
    let line = crate::t_overcommit::control_text()?;
    ensure!(line.split_whitespace().any(|w| w == "head=128"), "head changed by refused writes: {line}");
    let chans = ok!(s.info()).channels;
    ensure!(chans == 2, "the sim has {chans} copy channels, expected 2");
    // (size, the copy length that fails, pages of the aligned block left on the device)
    for (head, after, kept) in [(16u32, 20u64, 16usize), (256, 200, 0)] {
        control(&format!("head={head}"))?;
        let res = (|| -> TestResult {
            let what = format!("head={head}");
            let (r, all) = cpu_written(&g, 2 * BLOCK, 0x4ead_0000 | head)?;
            let a = r.addr.next_multiple_of(BLOCK as u64);
            let first = ((a - r.addr) / 4) as usize;
            let want = &all[first..first + BLOCK / 4];
            ok!(s.fail_copy_skipping(0, after, libc::EIO as u32));
            expect_errno!(g.advise(a, BLOCK as u64, GMEM_ADV_PREFETCH, 0, 0), libc::EIO);
            let q = ok!(g.query(a, BLOCK / 4096));
            all_at(&q[..kept], GMEM_LOC_DEVICE, 0).map_err(|e| format!("{what}: first part: {e}"))?;
            all_at(&q[kept..], GMEM_LOC_HOST, 0).map_err(|e| format!("{what}: later parts: {e}"))?;
            ensure!(ok!(s.checksum(a, BLOCK as u64)).result == checksum(want), "{what}: the device reads other data");
            ensure!(words(&r)[first..first + BLOCK / 4] == *want, "{what}: the CPU reads other data");
            drop(r);
            prefetched(&g, &s, 2 * BLOCK + BLOCK / 2, 0x4ead_1000 | head, &what).map(drop)
        })();
        control("head=128")?; // the default
        res?;
    }
    Ok(())
}

pub fn tests() -> Vec<crate::harness::Test> {
    use crate::harness::Test;
    vec![
        Test { name: "ahead_stream_reads_the_next_block_ahead", f: stream_reads_the_next_block_ahead },
        Test { name: "ahead_readahead_follows_two_regions_at_once", f: readahead_follows_two_regions_at_once },
        Test { name: "ahead_readahead_races_free_and_exit", f: readahead_races_free_and_exit },
        Test { name: "ahead_cpu_stream_reads_home_ahead", f: cpu_stream_reads_home_ahead },
        Test { name: "ahead_cpu_sequential_fault_around", f: cpu_sequential_fault_around },
        Test { name: "ahead_prefetch_lanes_are_exact_and_fail_cleanly", f: prefetch_lanes_are_exact_and_fail_cleanly },
        Test { name: "ahead_prefetch_head_sizes_are_exact", f: prefetch_head_sizes_are_exact },
        Test {
            name: "ahead_prefetch_does_not_start_with_a_short_chunk",
            f: prefetch_does_not_start_with_a_short_chunk,
        },
    ]
}
