// SPDX-License-Identifier: GPL-2.0
//! gmem's trace events (`events/gmem/` in tracefs, defined in `gmem/gmem_trace.h`): safe
//! functions over the C wrappers of `gmem_trace.c`. Each takes plain integers, so any
//! caller may emit; an event that is off costs one call and a static-key test.

use kernel::ffi::c_int;

extern "C" {
    fn gmem_trace_dev_fault(dev: c_int, space: u64, pages: u32, ns: u64, err: c_int);
    fn gmem_trace_cpu_fault(space: u64, addr: u64, write: bool, from: c_int, pages: u32, err: c_int);
    fn gmem_trace_migrate(dir: u32, dev: c_int, peer: c_int, pages: u32);
    fn gmem_trace_batch(pages: u32, alloc: u64, revoke: u64, copy: u64, commit: u64, map: u64);
    fn gmem_trace_prefetch(dev: c_int, pages: u32);
    fn gmem_trace_evict(dev: c_int, to_host: u32, to_peer: u32, clean: u32);
    fn gmem_trace_thrash(dev: c_int, held: u32, throttle: bool);
    fn gmem_trace_unregister(dev: c_int, contexts: u32, evacuated: u64, lost: u64);
}

/// Device ids are below 16; anything else is shown as -1.
fn id(dev: usize) -> c_int {
    c_int::try_from(dev).unwrap_or(-1)
}

/// Counts for a `u32` field (saturating: a trace field, never an error).
fn n32(n: impl TryInto<u32>) -> u32 {
    n.try_into().unwrap_or(u32::MAX)
}

/// A device fault batch: `pages` unique pages, `ns` of service, result `err` (0 or -errno).
pub(crate) fn dev_fault(dev: usize, space: u64, pages: usize, ns: u64, err: c_int) {
    // SAFETY: the C wrapper takes plain values and only records them (the same holds for
    // every function here).
    unsafe { gmem_trace_dev_fault(id(dev), space, n32(pages), ns, err) }
}

/// A CPU fault at `addr`; `from` is the device the page was on, if any; `pages` the batch
/// moved (the page and its fault-around).
pub(crate) fn cpu_fault(space: u64, addr: usize, write: bool, from: Option<u8>, pages: usize, err: c_int) {
    let from = from.map_or(-1, c_int::from);
    // SAFETY: see `dev_fault`.
    unsafe { gmem_trace_cpu_fault(space, addr as u64, write, from, n32(pages), err) }
}

/// One copy-engine call: `dir` is `GMEM_COPY_*`, run by `dev`'s engine, `peer` for D2D.
pub(crate) fn migrate(dir: u32, dev: usize, peer: Option<usize>, pages: usize) {
    // SAFETY: see `dev_fault`.
    unsafe { gmem_trace_migrate(dir, id(dev), peer.map_or(-1, id), n32(pages)) }
}

/// The phases of an executor batch, in the order [`batch`] reports them.
#[derive(Clone, Copy)]
pub(crate) enum Phase {
    Alloc = 0,
    Revoke = 1,
    Copy = 2,
    Commit = 3,
    Map = 4,
}

/// Where an executor batch's time goes: each [`Laps::lap`] adds the time since the last
/// one to a phase.
pub(crate) struct Laps {
    last: u64,
    ns: [u64; 5],
}

impl Laps {
    pub(crate) fn start() -> Laps {
        Laps { last: crate::obj::sched::now_ns(), ns: [0; 5] }
    }

    /// The time since the last lap (or the start) was spent in `phase`.
    pub(crate) fn lap(&mut self, phase: Phase) {
        let now = crate::obj::sched::now_ns();
        let slot = &mut self.ns[phase as usize];
        *slot = slot.saturating_add(now.saturating_sub(self.last));
        self.last = now;
    }
}

/// An executor batch that committed `pages` pages, with its phases' times.
pub(crate) fn batch(pages: usize, laps: &Laps) {
    let t = &laps.ns;
    // SAFETY: see `dev_fault`.
    unsafe { gmem_trace_batch(n32(pages), t[0], t[1], t[2], t[3], t[4]) }
}

/// Pages density prefetch moved to `dev`.
pub(crate) fn prefetch(dev: usize, pages: u64) {
    // SAFETY: see `dev_fault`.
    unsafe { gmem_trace_prefetch(id(dev), n32(pages)) }
}

/// One eviction batch of `dev`: victims sent home, parked on a peer, dropped clean.
pub(crate) fn evict(dev: usize, to_host: u32, to_peer: u32, clean: u32) {
    // SAFETY: see `dev_fault`.
    unsafe { gmem_trace_evict(id(dev), to_host, to_peer, clean) }
}

/// The thrashing detector held back `held` pages of a batch on `dev` (and throttled).
pub(crate) fn thrash(dev: usize, held: u64, throttle: bool) {
    // SAFETY: see `dev_fault`.
    unsafe { gmem_trace_thrash(id(dev), n32(held), throttle) }
}

/// `dev` left: contexts destroyed, pages evacuated, pages lost.
pub(crate) fn unregister(dev: usize, contexts: usize, evacuated: u64, lost: u64) {
    // SAFETY: see `dev_fault`.
    unsafe { gmem_trace_unregister(id(dev), n32(contexts), evacuated, lost) }
}
