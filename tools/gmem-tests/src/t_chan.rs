// SPDX-License-Identifier: GPL-2.0
//! Asynchronous copies (driver API `copy_async`, the sim's copy channels): gmem starts a
//! migration batch's copies on the device's channels, all before it waits for any, the
//! channels' workers run them, and the data arrive intact; a copy that fails on a channel
//! fails the migration with its errno and leaves every page of its part, and of the parts
//! after it, as it was (the parts before it stay committed).

use crate::harness::{all_at, open, words, TestResult};
use crate::{ensure, expect_errno, ok};
use libgmem::sim::{checksum, SimInfo};
use libgmem::{q_loc, GMEM_ADV_PREFETCH, GMEM_LOC_DEVICE, GMEM_LOC_HOST};

/// The sim's default: two channels per device.
const CHANNELS: u32 = 2;

fn pattern(i: usize) -> u32 {
    (i as u32).wrapping_mul(2_654_435_761) ^ 0x00c0_ffee
}

/// A 4 MiB PREFETCH of two whole, aligned 2 MiB blocks: each block's 512 pages go as a
/// first part of 128 pages and then one part per channel (192 pages each), the channels
/// taken in turn, all started before any is waited for, so copies are in flight at once; the workers copied every page, and nothing is left in
/// flight. (Aligned on purpose: a partial block's few pages would be a single part, which
/// gmem copies synchronously.)
fn prefetch_runs_on_every_channel_at_once() -> TestResult {
    let (g, s) = open()?;
    const BLOCK: usize = 2 << 20;
    const LEN: usize = 2 * BLOCK;
    let r = ok!(g.alloc((LEN + BLOCK) as u64));
    for (i, w) in words(&r).iter_mut().enumerate() {
        *w = pattern(i);
    }
    let a = r.addr.next_multiple_of(BLOCK as u64);
    let first = ((a - r.addr) / 4) as usize;
    let i0 = ok!(s.info());
    ensure!(i0.channels == CHANNELS, "the sim has {} copy channels, expected {CHANNELS}", i0.channels);
    ok!(g.advise(a, LEN as u64, GMEM_ADV_PREFETCH, 0, 0));
    let i1 = ok!(s.info());
    let d = |f: fn(&SimInfo) -> u64| f(&i1) - f(&i0);
    let pages = (LEN / 4096) as u64;
    ensure!(d(|i| i.async_pages) == pages, "the channels copied {} pages of {pages}", d(|i| i.async_pages));
    ensure!(d(|i| i.async_calls) == 6, "{} channel calls for two blocks on two channels", d(|i| i.async_calls));
    ensure!(i1.max_inflight >= 2, "at most {} copy in flight at once: the parts ran one by one", i1.max_inflight);
    ensure!(i1.inflight == 0, "{} copies still in flight after the PREFETCH returned", i1.inflight);
    let q = ok!(g.query(a, LEN / 4096));
    ensure!(q.iter().all(|&w| q_loc(w) == GMEM_LOC_DEVICE), "not every page reached the device");
    let want: Vec<u32> = (first..first + LEN / 4).map(pattern).collect();
    let o = ok!(s.checksum(a, LEN as u64));
    ensure!(o.result == checksum(&want), "the device reads other data than the host wrote");
    Ok(())
}

/// A channel's copy fails part way (fault injection after 100 pages of the fault batch's
/// first part, 128 pages): the device fault that needed it gets the errno (the launch
/// fails with EIO), the other parts' copies completed but are not committed, every page is still on the host with its
/// data, and the same launch then succeeds.
fn failed_channel_copy_fails_the_fault() -> TestResult {
    let (g, s) = open()?;
    const LEN: usize = 2 << 20;
    let r = ok!(g.alloc(2 * LEN as u64));
    for (i, w) in words(&r).iter_mut().enumerate() {
        *w = pattern(i);
    }
    // One whole, aligned block: one executor batch.
    let a = r.addr.next_multiple_of(LEN as u64);
    let first = ((a - r.addr) / 4) as usize;
    let want: Vec<u32> = (first..first + LEN / 4).map(pattern).collect();
    crate::t_overcommit::control("prefetch=0")?;
    let res = (|| -> TestResult {
        let i0 = ok!(s.info());
        ok!(s.fail_copy(100, libc::EIO as u32));
        expect_errno!(s.checksum(a, LEN as u64), libc::EIO);
        let i1 = ok!(s.info());
        ensure!(i1.async_calls > i0.async_calls, "the failed copy did not run on a channel");
        ensure!(i1.inflight == 0, "{} copies still in flight after the failure", i1.inflight);
        // The fault batch (256 pages) went as a first part of 128 pages, which copied 100
        // before the injected failure, and two of 64, copied whole. The channels count what
        // they moved.
        let moved = i1.async_pages - i0.async_pages;
        ensure!(moved == 100 + 64 + 64, "the channels report {moved} pages moved; 100 + 64 + 64 expected");
        let q = ok!(g.query(a, LEN / 4096));
        ensure!(q.iter().all(|&w| q_loc(w) == GMEM_LOC_HOST), "a page left the host although its batch failed");
        Ok(())
    })();
    let again = res.and_then(|()| {
        let o = ok!(s.checksum(a, LEN as u64));
        ensure!(o.result == checksum(&want), "the device reads wrong data after the failure");
        Ok(())
    });
    crate::t_overcommit::control("prefetch=1")?;
    again?;
    let w = words(&r);
    ensure!(w[first..first + LEN / 4] == want[..], "the CPU reads wrong data after the failure");
    Ok(())
}

/// A PREFETCH of one whole, aligned block is committed part by part, as each channel's
/// copy completes (`migrate::pipelined`): when the second part's copy fails (after 100 of
/// its 192 pages; the first part, 128 pages, a call long enough to fail, is let through),
/// the advice fails with the errno, the first part's pages are on the device and the
/// others' are still on the host (the third part's copy completed, but is not committed),
/// and every page holds its data, on the device and on the CPU.
fn later_part_failure_keeps_earlier_parts() -> TestResult {
    let (g, s) = open()?;
    const LEN: usize = 2 << 20;
    let pages = LEN / 4096;
    let r = ok!(g.alloc(2 * LEN as u64));
    for (i, w) in words(&r).iter_mut().enumerate() {
        *w = pattern(i);
    }
    let a = r.addr.next_multiple_of(LEN as u64);
    let first = ((a - r.addr) / 4) as usize;
    let want: Vec<u32> = (first..first + LEN / 4).map(pattern).collect();
    let i0 = ok!(s.info());
    // A first part of 128 pages, then one of 192 per channel.
    ensure!(i0.channels == CHANNELS, "the sim has {} copy channels, expected {CHANNELS}", i0.channels);
    ok!(s.fail_copy_skipping(1, 100, libc::EIO as u32));
    expect_errno!(g.advise(a, LEN as u64, GMEM_ADV_PREFETCH, 0, 0), libc::EIO);
    let i1 = ok!(s.info());
    ensure!(i1.inflight == 0, "{} copies still in flight after the failure", i1.inflight);
    let moved = i1.async_pages - i0.async_pages;
    ensure!(moved == 128 + 100 + 192, "the channels report {moved} pages moved; 128 + 100 + 192 expected");
    let q = ok!(g.query(a, pages));
    all_at(&q[..128], GMEM_LOC_DEVICE, 0).map_err(|e| format!("first part: {e}"))?;
    all_at(&q[128..], GMEM_LOC_HOST, 0).map_err(|e| format!("later parts: {e}"))?;
    // The device reads every page right (the second part faults over now), so does the CPU.
    let o = ok!(s.checksum(a, LEN as u64));
    ensure!(o.result == checksum(&want), "the device reads wrong data after the failure");
    let w = words(&r);
    ensure!(w[first..first + LEN / 4] == want[..], "the CPU reads wrong data after the failure");
    Ok(())
}

/// Runs `f` with gmem's `poll=` switch at `us` (0: waiters never poll), and at its
/// default (100) again after, whatever `f` returns.
fn with_poll(us: u32, f: impl FnOnce() -> TestResult) -> TestResult {
    crate::t_overcommit::with_control(&format!("poll={us}"), "poll=100", f)
}

/// The two failures above under a link model (200 MB/s on every path), with gmem's
/// `poll=` switch at `poll`; how many copies polling completed (the sim's `polled`).
fn failures_under_the_link_model(poll: u32) -> std::result::Result<u64, String> {
    let (_g, s) = open()?;
    let p0 = ok!(s.info()).polled;
    with_poll(poll, || {
        crate::t_link::with_link(&s, [200; 3], 0, || {
            failed_channel_copy_fails_the_fault().map_err(|e| format!("fault: {e}"))?;
            later_part_failure_keeps_earlier_parts().map_err(|e| format!("prefetch: {e}"))
        })
    })?;
    Ok(ok!(s.info()).polled - p0)
}

/// The two failures above under a link model, with polling off: the channels' data move
/// first and each copy completes when its link time ends, from the channel's timer (the
/// engine's completion interrupt), in interrupt context; the errno, the parts kept and the
/// data are as without the model.
fn failures_complete_from_the_channel_timer() -> TestResult {
    let polled = failures_under_the_link_model(0)?;
    ensure!(polled == 0, "{polled} copies completed by polling with poll=0");
    Ok(())
}

/// The same with gmem polling the channels from 2 ms before each copy's link time ends
/// (`poll=2000`; the sim says when, driver API `gmem_fence_expect`): copies are completed
/// from gmem's waiting thread (`copy_poll`), and the errno, the parts kept and the data
/// are the same.
///
/// Only the parts waited for before the failure poll (two or three per round), each only
/// if the channel's worker moved its data by 200 us after its link time: up to three
/// rounds, so that a busy guest does not fail it; with a `copy_poll` that does nothing it
/// fails all three.
fn failures_complete_from_a_poll() -> TestResult {
    for _ in 0..3 {
        if failures_under_the_link_model(2000)? > 0 {
            return Ok(());
        }
    }
    Err("no copy completed by polling in three rounds with poll=2000".into())
}

/// A PREFETCH of four aligned blocks over a 100 MB/s link, with polling from 2 ms before
/// each copy's expected end and then with polling off: with it, gmem's waiters complete
/// copies themselves (the sim's `polled` grows), without it none; either way the PREFETCH
/// takes at least its link time, every page reaches the device with its data, and nothing
/// is left in flight.
fn polling_completes_copies_when_their_link_time_ends() -> TestResult {
    let (g, s) = open()?;
    const BLOCK: usize = 2 << 20;
    const LEN: usize = 4 * BLOCK;
    let run = |poll: u32| -> std::result::Result<u64, String> {
        let r = ok!(g.alloc((LEN + BLOCK) as u64));
        for (i, w) in words(&r).iter_mut().enumerate() {
            *w = pattern(i ^ poll as usize);
        }
        let a = r.addr.next_multiple_of(BLOCK as u64);
        let first = ((a - r.addr) / 4) as usize;
        let p0 = ok!(s.info()).polled;
        with_poll(poll, || {
            crate::t_link::with_link(&s, [100, 100, 0], 0, || {
                let t = std::time::Instant::now();
                ok!(g.advise(a, LEN as u64, GMEM_ADV_PREFETCH, 0, 0));
                // 8 MiB at 100 MB/s: 83.9 ms on the link; a poll completes no copy before
                // its link time ends.
                let took = t.elapsed().as_nanos() as u64;
                let floor = LEN as u64 * 10;
                ensure!(took >= floor, "poll={poll}: the PREFETCH took {took} ns, under its link time {floor} ns");
                Ok(())
            })
        })?;
        let i1 = ok!(s.info());
        ensure!(i1.inflight == 0, "poll={poll}: {} copies still in flight after the PREFETCH", i1.inflight);
        let q = ok!(g.query(a, LEN / 4096));
        ensure!(q.iter().all(|&w| q_loc(w) == GMEM_LOC_DEVICE), "poll={poll}: not every page reached the device");
        let want: Vec<u32> = (first..first + LEN / 4).map(|i| pattern(i ^ poll as usize)).collect();
        let o = ok!(s.checksum(a, LEN as u64));
        ensure!(o.result == checksum(&want), "poll={poll}: the device reads other data than the host wrote");
        Ok(i1.polled - p0)
    };
    // Out of range or malformed: refused, nothing changed.
    crate::t_overcommit::control_refused("poll=10001")?;
    crate::t_overcommit::control_refused("poll=-1")?;
    let line = crate::t_overcommit::control_text()?;
    ensure!(line.split_whitespace().any(|w| w == "poll=100"), "poll changed by refused writes: {line}");
    let polled = run(2000)?;
    ensure!(polled > 0, "poll=2000: no copy of the four blocks was completed by polling");
    let polled = run(0)?;
    ensure!(polled == 0, "poll=0: {polled} copies completed by polling");
    Ok(())
}

pub fn tests() -> Vec<crate::harness::Test> {
    use crate::harness::Test;
    vec![
        Test { name: "chan_prefetch_runs_on_every_channel_at_once", f: prefetch_runs_on_every_channel_at_once },
        Test { name: "chan_failed_channel_copy_fails_the_fault", f: failed_channel_copy_fails_the_fault },
        Test { name: "chan_later_part_failure_keeps_earlier_parts", f: later_part_failure_keeps_earlier_parts },
        Test { name: "chan_failures_complete_from_the_channel_timer", f: failures_complete_from_the_channel_timer },
        Test { name: "chan_failures_complete_from_a_poll", f: failures_complete_from_a_poll },
        Test {
            name: "chan_polling_completes_copies_when_their_link_time_ends",
            f: polling_completes_copies_when_their_link_time_ends,
        },
    ]
}
