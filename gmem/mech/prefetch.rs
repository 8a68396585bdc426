// SPDX-License-Identifier: GPL-2.0
//! Prefetch on fault: after a device fault batch touched a 2 MiB block, fetch the block's
//! other pages too when the density rule (`policy/src/prefetch.rs`, UVM's: a power-of-two
//! subregion more than `prefetch_pct`% resident-or-faulted is fetched whole) says so.
//! Switch off with `prefetch=0` in `/sys/kernel/debug/gmem/control` (for measuring).
//! Under oversubscription, while prefetch is not paying, the resident pages stop counting
//! (`policy::prefetch::resident_pages`; overcommit.rst "Density prefetch").
//!
//! Prefetched frames carry `F_PREFETCHED` until the page is touched or a move away from the
//! device settles it (by the device's accessed bit: used or wasted, debugfs counters; once,
//! even if the move then fails).
//! Prefetch is speculative: it never evicts, it stops when the device is full (read-ahead
//! workers may make room before they fetch: `readahead.rs`).

use crate::exec::migrate::{self, Env, Step};
use crate::obj::device::{DevStats, Device, F_PREFETCHED};
use crate::obj::region::{block_base, Pages, Region, ADVICE_RUNS, PAGE_SIZE};
use crate::obj::{sched, trace, tune};
use crate::policy::page_state::{transition, Actions, ByState, Event, Loc, PageState, Target};
use crate::policy::prefetch::{
    density, density_counting, read_ahead, resident_pages, sequential, Resident, BLOCK_PAGES,
};
use crate::policy::range::AdviceMap;
use core::sync::atomic::Ordering::Relaxed;
use kernel::{mm::virt::VmaRef, prelude::*, sync::Arc};

/// Runs density prefetch for the 2 MiB block at `block_va` (aligned down if it is not) of
/// `r` after a fault batch that touched the pages in `faulted` (bitmap over the block's
/// 512 pages). Returns whether the block is now wholly resident on the device
/// (`policy::prefetch::read_ahead`: the caller may read the next block ahead).
pub(crate) fn on_fault(
    dev: &Arc<Device>,
    r: &Arc<Region>,
    vma: Option<&VmaRef>,
    block_va: usize,
    faulted: &[u64; 8],
) -> bool {
    let d = dev.id as u8;
    // The pairing of block pages with region pages below needs the block's own start.
    let block_va = block_base(block_va);
    let Some(first) = r.index(core::cmp::max(block_va, r.start)) else { return false };
    let Ok(block) = r.block(first) else { return false };
    let mut p = r.lock(&block);
    if r.is_dead() || !dev.alive() {
        return false;
    }
    let advice = *r.advice.lock();
    // The block's pages in the region, as (page of the block, region index): the block
    // (`p`) holds exactly these, from the region's first page in it (`first`) on.
    let k0 = r.start.saturating_sub(block_va) / PAGE_SIZE;
    let range = p.range();
    let pages = || (k0..BLOCK_PAGES).zip(range.clone());
    let bit = |k: usize| (k / 64, 1u64 << (k % 64));
    let (mut resident, mut valid) = ([0u64; 8], [0u64; 8]);
    for (k, j) in pages() {
        let (w, b) = bit(k);
        valid[w] |= b;
        if p.state(j).loc() == Loc::Device(d) {
            resident[w] |= b;
        }
    }
    // Under oversubscription, while prefetch is not paying, only the faulted pages make a
    // subregion dense, but for a probe now and then (`resident_pages`).
    let now = sched::now_ns();
    let settled_ago = now.saturating_sub(dev.prefetch_settled_ns());
    let rule = resident_pages(dev.frames_free_hint(), dev.high(), dev.prefetch_pays(), settled_ago);
    if rule == Resident::Probe {
        // The next probe comes a stale period later at the earliest.
        dev.prefetch_settled_at(now);
    }
    let pct = tune::PREFETCH_PCT.load(Relaxed);
    let extra = density_counting(&resident, faulted, &valid, pct, BLOCK_PAGES, rule.counted());
    if extra.iter().all(|&w| w == 0) {
        // Nothing to fetch (a marker fault in a block read ahead, say): the residency
        // above already holds the fault batch's pages.
        return read_ahead(&resident, &valid);
    }
    let Ok(mut steps) = KVec::<Step>::with_capacity(BLOCK_PAGES, GFP_KERNEL) else { return false };
    let mut stepper = Stepper::new(d);
    for (k, j) in pages() {
        let (w, b) = bit(k);
        if extra[w] & b == 0 {
            continue;
        }
        if let Some(st) = stepper.step(&p, &advice, j) {
            // Capacity reserved above.
            let _ = steps.push(st, GFP_NOWAIT);
        }
    }
    speculate(&Env::access(r, vma), dev, &mut p, &steps);
    // Residency now: what was there, the fault batch's pages (unless they were mapped
    // remotely), what the batch above fetched.
    for (k, j) in pages() {
        if p.state(j).loc() == Loc::Device(d) {
            let (w, b) = bit(k);
            resident[w] |= b;
        }
    }
    read_ahead(&resident, &valid)
}

/// Fetches `steps` (PREFETCH transitions of the locked block `p` to `dev`) as one executor
/// batch; when the device (or host memory) runs out part way, the rest is simply not
/// fetched: speculative fetches (density prefetch, read-ahead) are only a bet, and this
/// never evicts (a read-ahead worker may make room before, with the block lock dropped:
/// `readahead::room_target`). Marks the frames `F_PREFETCHED` and counts them; returns
/// how many there are. `env` is an access to the block's region.
pub(crate) fn speculate(env: &Env<'_>, dev: &Device, p: &mut Pages, steps: &[Step]) -> u64 {
    let out = migrate::apply_batch(env, p, steps);
    mark(dev, p, &steps[..out.done])
}

/// The steps that fetch pages of a locked block to device `d` speculatively (density
/// prefetch, read-ahead, the rest of a stream's block), page by page: the PREFETCH
/// transition, mapped; none for a page that advice decides the placement of, or that is
/// there already (a transition without actions at most ends a parking: nothing to fetch).
/// A page in the state of the one asked about before it reuses that answer
/// (`ByState`; a profile of P4's 2x stream had put 9 ms of each run's worker CPU in
/// `transition` and the comparison of its actions, most of it for read-ahead's 512 pages
/// per block).
pub(crate) struct Stepper {
    d: u8,
    steps: ByState<Option<(PageState, Actions)>>,
}

impl Stepper {
    pub(crate) fn new(d: u8) -> Self {
        Stepper { d, steps: ByState::new() }
    }

    /// The step for page `i` of the locked block `p`, if any (see [`Stepper`]).
    pub(crate) fn step(&mut self, p: &Pages, advice: &AdviceMap<ADVICE_RUNS>, i: usize) -> Option<Step> {
        if advice.get(i as u64) != 0 {
            return None;
        }
        let s = p.state(i);
        let to = Target::Device(self.d);
        let t =
            self.steps.get(s, |s| transition(s, Event::Prefetch { to }).ok().filter(|(_, a)| *a != Actions::default()));
        t.map(|(next, a)| Step { i, prev: s, next, a })
    }
}

/// Marks the frames of the committed speculative `steps` that landed on `dev`
/// `F_PREFETCHED` (the executor recorded the owner; only the mark is added), counts and
/// traces them; returns how many there are.
pub(crate) fn mark<'a>(dev: &Device, p: &Pages, steps: impl IntoIterator<Item = &'a Step>) -> u64 {
    let mut n = 0u64;
    for st in steps {
        if st.next.loc() == Loc::Device(dev.id as u8) {
            dev.set_flags(p.frame(st.i), F_PREFETCHED);
            n += 1;
        }
    }
    DevStats::add(&dev.stats.prefetched, n);
    if n != 0 {
        trace::prefetch(dev.id, n);
    }
    n
}

/// CPU fault-around: the pages of page `i`'s 2 MiB block that a CPU fault on `i` brings
/// home along with it, with "resident" meaning on the host. A fault that continues a
/// stream (the page before it is home and mapped by the CPU, or it is the block's first
/// page and the CPU has just streamed through the previous block: `after_stream`, from
/// `Region::cpu_at`) takes the rest of the block (`policy::prefetch::sequential`); any
/// other, the density rule (UVM applies its prefetch to CPU faults too). Returns region
/// page indices, ascending, never `i` itself and never an advised page (advice decides
/// placement for those), and whether the fault continues a stream.
pub(crate) fn cpu_window(r: &Region, p: &Pages, i: usize, after_stream: bool, out: &mut KVec<usize>) -> Result<bool> {
    let block_va = block_base(r.va(i) as usize);
    let (mut resident, mut mapped, mut valid, mut faulted) = ([0u64; 8], [0u64; 8], [0u64; 8], [0u64; 8]);
    let k0 = (r.va(i) as usize - block_va) / PAGE_SIZE;
    faulted[k0 / 64] |= 1 << (k0 % 64);
    for k in 0..BLOCK_PAGES {
        if let Some(j) = r.index(block_va + k * PAGE_SIZE) {
            valid[k / 64] |= 1 << (k % 64);
            let s = p.state(j);
            if s.loc() == Loc::Host {
                resident[k / 64] |= 1 << (k % 64);
                if s.cpu_mapped() {
                    mapped[k / 64] |= 1 << (k % 64);
                }
            }
        }
    }
    let stream = sequential(&resident, &mapped, &valid, k0, after_stream);
    let extra =
        stream.unwrap_or_else(|| density(&resident, &faulted, &valid, tune::PREFETCH_PCT.load(Relaxed), BLOCK_PAGES));
    let advice = *r.advice.lock();
    for k in 0..BLOCK_PAGES {
        if extra[k / 64] & (1 << (k % 64)) == 0 {
            continue;
        }
        let Some(j) = r.index(block_va + k * PAGE_SIZE) else { continue };
        if advice.get(j as u64) == 0 {
            out.push(j, GFP_KERNEL)?;
        }
    }
    Ok(stream.is_some())
}
