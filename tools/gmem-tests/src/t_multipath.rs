// SPDX-License-Identifier: GPL-2.0
//! Multi-path host-to-device copies (`gmem/exec/multipath.rs`): with the links of both
//! simulated devices reported (host links equal, the peer link four times faster), a large
//! PREFETCH to device 0 sends part of each block through device 1 (host -> staging frames
//! of device 1 -> device 0). Every byte crosses exactly one route, the links count exactly
//! that, the data arrive intact, staging frames go back, `multipath=0` turns it off, and a
//! copy failing on the peer's stage fails the PREFETCH with its errno and keeps every page.

use crate::harness::{words, TestResult};
use crate::t_link::with_link;
use crate::t_overcommit::{control, counter};
use crate::{ensure, expect_errno, ok};
use libgmem::sim::{checksum, Sim, PATH_D2D, PATH_H2D};
use libgmem::{q_loc, Gmem, GMEM_ADV_PREFETCH, GMEM_LOC_DEVICE, GMEM_LOC_HOST};

const BLOCK: usize = 2 << 20;
const LEN: usize = 2 * BLOCK;
/// Host links of both devices and the peer link, MB/s: fast enough for a quick test, slow
/// enough that the route through the peer pays.
const HOST_MBPS: u64 = 400;
const PEER_MBPS: u64 = 4 * HOST_MBPS;

fn pattern(i: usize) -> u32 {
    (i as u32).wrapping_mul(0x9e37_79b9) ^ 0x0bad_cafe
}

/// Runs `f` on a region of `LEN` bytes at a 2 MiB boundary holding `pattern` (written by
/// the CPU), with both devices' links modelled; unmodelled again after.
fn with_two_paths(f: impl FnOnce(&Gmem, &Sim, &Sim, u64, &[u32]) -> TestResult) -> TestResult {
    let g = ok!(Gmem::open());
    let (s0, s1) = (ok!(Sim::open(0)), ok!(Sim::open(1)));
    let r = ok!(g.alloc((LEN + BLOCK) as u64));
    for (i, w) in words(&r).iter_mut().enumerate() {
        *w = pattern(i);
    }
    let a = r.addr.next_multiple_of(BLOCK as u64);
    let first = ((a - r.addr) / 4) as usize;
    let want: Vec<u32> = (first..first + LEN / 4).map(pattern).collect();
    let links = [HOST_MBPS, HOST_MBPS, PEER_MBPS];
    with_link(&s0, links, 0, || with_link(&s1, links, 0, || f(&g, &s0, &s1, a, &want)))?;
    let w = words(&r);
    ensure!(w[first..first + LEN / 4] == want[..], "the CPU reads other data than it wrote");
    Ok(())
}

/// Byte counters of the routes on device 0.
fn routed() -> Result<(u64, u64), String> {
    Ok((counter(0, "multipath.direct_bytes")?, counter(0, "multipath.peer_bytes")?))
}

fn prefetch_routes_part_through_the_peer() -> TestResult {
    with_two_paths(|g, s0, s1, a, want| {
        ensure!(counter(0, "multipath.h2d_mbps")? == HOST_MBPS, "gmem did not learn sim0's host link");
        ensure!(counter(1, "multipath.d2d_mbps")? == PEER_MBPS, "gmem did not learn sim1's peer link");
        let (d0, p0) = routed()?;
        let used1 = counter(1, "used")?;
        let (l0, m0) = (ok!(s0.link()), ok!(s1.link()));
        ok!(g.advise(a, LEN as u64, GMEM_ADV_PREFETCH, 0, 0));
        let (l1, m1) = (ok!(s0.link()), ok!(s1.link()));
        let (d1, p1) = routed()?;
        let (direct, peer) = (d1 - d0, p1 - p0);
        ensure!(peer > 0 && direct > 0, "direct {direct} and via-peer {peer} bytes: both paths should carry data");
        ensure!(direct + peer == LEN as u64, "{direct} + {peer} bytes routed for a {LEN}-byte prefetch");
        // Each route's bytes crossed exactly its links: sim0's host link the direct part,
        // sim1's host link and then its peer link the rest.
        let on = |a: &libgmem::sim::SimLink, b: &libgmem::sim::SimLink, p: usize| b.bytes[p] - a.bytes[p];
        ensure!(
            on(&l0, &l1, PATH_H2D) == direct,
            "sim0's host link carried {} bytes, {direct} went direct",
            on(&l0, &l1, PATH_H2D)
        );
        ensure!(
            on(&m0, &m1, PATH_H2D) == peer,
            "sim1's host link carried {} bytes, {peer} were staged",
            on(&m0, &m1, PATH_H2D)
        );
        ensure!(
            on(&m0, &m1, PATH_D2D) == peer,
            "sim1's peer link carried {} bytes, {peer} were staged",
            on(&m0, &m1, PATH_D2D)
        );
        ensure!(counter(1, "used")? == used1, "staging frames of device 1 were not given back");
        let q = ok!(g.query(a, LEN / 4096));
        ensure!(q.iter().all(|&w| q_loc(w) == GMEM_LOC_DEVICE), "not every page reached device 0");
        let o = ok!(s0.checksum(a, LEN as u64));
        ensure!(o.result == checksum(want), "device 0 reads other data than the host wrote");
        // Off: the same prefetch (after the pages went home) goes direct only.
        ok!(g.advise(a, LEN as u64, GMEM_ADV_PREFETCH, libgmem::GMEM_HOST, 0));
        control("multipath=0")?;
        let off = g.advise(a, LEN as u64, GMEM_ADV_PREFETCH, 0, 0).map_err(|e| format!("prefetch: {e}"));
        control("multipath=1")?;
        off?;
        ensure!(routed()?.1 == p1, "multipath=0, and still pages went through the peer");
        let o = ok!(s0.checksum(a, LEN as u64));
        ensure!(o.result == checksum(want), "device 0 reads other data after the direct prefetch");
        Ok(())
    })
}

/// The peer's stage-1 copy fails (fault injection on sim1's first copy call): the PREFETCH
/// fails with that errno, no page left the host, the staging frames are back, and the
/// same PREFETCH then succeeds with intact data.
fn a_failed_stage_fails_the_prefetch_cleanly() -> TestResult {
    with_two_paths(|g, s0, s1, a, want| {
        let used1 = counter(1, "used")?;
        ok!(s1.fail_copy(0, libc::EIO as u32));
        expect_errno!(g.advise(a, LEN as u64, GMEM_ADV_PREFETCH, 0, 0), libc::EIO);
        ensure!(counter(1, "used")? == used1, "staging frames of device 1 were not given back after the failure");
        // The block whose stage failed kept every page on the host; the other block (in
        // another lane) either completed or stopped before it started: whole blocks only.
        let q = ok!(g.query(a, LEN / 4096));
        let mut host_blocks = 0;
        for b in q.chunks(BLOCK / 4096) {
            let host = b.iter().all(|&w| q_loc(w) == GMEM_LOC_HOST);
            ensure!(host || b.iter().all(|&w| q_loc(w) == GMEM_LOC_DEVICE), "a block was left half moved");
            host_blocks += usize::from(host);
        }
        ensure!(host_blocks >= 1, "the PREFETCH failed, yet every block reached the device");
        ok!(g.advise(a, LEN as u64, GMEM_ADV_PREFETCH, 0, 0));
        let o = ok!(s0.checksum(a, LEN as u64));
        ensure!(o.result == checksum(want), "device 0 reads wrong data after the failure");
        Ok(())
    })
}

pub fn tests() -> Vec<crate::harness::Test> {
    use crate::harness::Test;
    vec![
        Test { name: "multipath_prefetch_routes_part_through_the_peer", f: prefetch_routes_part_through_the_peer },
        Test {
            name: "multipath_a_failed_stage_fails_the_prefetch_cleanly",
            f: a_failed_stage_fails_the_prefetch_cleanly,
        },
    ]
}
