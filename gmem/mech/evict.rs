// SPDX-License-Identifier: GPL-2.0
//! Eviction: device memory as a cache in front of host memory.
//!
//! - Order: CLOCK over frames (`policy/src/evict.rs`), fed by faults and prefetches (set
//!   the referenced bit) and by the driver's accessed bits (second chance, except in
//!   blocks the device's stream has gone past). Pinned frames are never chosen; frames
//!   parked by peers go first. Victims in front of the device's stream give way to the
//!   pages of a block it has gone past (`evict_behind`).
//! - A victim leaves with its 2 MiB neighbourhood: the hand's victims of one 2 MiB block
//!   of a region, and every other page of that block on the same device, not pinned and
//!   not referenced, go in the same batch (one block lock).
//! - Where it goes: to a peer device with spare frames (HUVM's harvesting; the lender keeps
//!   its high watermark free, so its own allocations win), else to host memory. Clean
//!   pages (valid host copy) are dropped without a copy.
//! - When: on demand from the fault path (counted as a *fault wait*), and ahead of need
//!   (*pre-eviction*): in the background between the low and high watermarks, and by a
//!   read-ahead worker for the block it is about to read (`Why::Ahead`, while prefetch pays
//!   on the device). A lender whose own use has eaten into its reserve (fewer than `high`
//!   frames free) also writes parked victims back to host in the background, so that it
//!   can drop them instantly; not before (`policy::evict::write_back_lent`): a parked page
//!   costs a copy out and a copy back, as a trip through the host does, and an early
//!   write-back would add a third.
//! - Whose: when the device is full, any frame its dmem cgroup does not protect; when a
//!   cgroup is at its `dmem.max` (a fault or advice of its process, or the controller's
//!   reclaim callback when the limit is lowered), only frames charged within that cgroup:
//!   it evicts its own pages and never takes another cgroup's frames. `dmem.min` always
//!   protects, `dmem.low` until nothing else is left.
//!
//! Lock order: `Device::evict_lock` -> a block's pages (`Block::pages`) -> `Space::ctxs` -> `Device::frames`.
//! Eviction never runs with a block lock held by its caller. A pass gives `evict_lock` up
//! while a batch of its victims copies (it keeps that block's lock) and takes it again
//! for its next block, once the block lock is released: several batches of one device's
//! victims may be in flight, as its copy channels allow, and the choosing stays one at a
//! time. While batches copy, a block that is held is skipped (try-locked), never waited
//! for under `evict_lock`.

use crate::exec::dpriv;
use crate::exec::migrate::Step;
use crate::exec::migrate::{self, Env};
use crate::obj::device::{Ctx, DevStats, Device, DeviceOps, Owner, Promise, F_PREFETCHED, F_SPARED};
use crate::obj::dmem::Limit;
use crate::obj::region::{adv, ADVICE_RUNS};
use crate::obj::region::{block_base, Region, BLOCK_BYTES};
use crate::obj::{devices, sched, trace, tune};
use crate::policy::bits::{self, BlockBits};
use crate::policy::evict::{reclaim_target, write_back_lent, F_REF};
use crate::policy::page_state::Target;
use crate::policy::page_state::{dev_bit, transition, Actions, Copy, Event, Loc};
use crate::policy::prefetch::passed_blocks;
use crate::policy::range::AdviceMap;
use core::sync::atomic::Ordering::Relaxed;
use kernel::mm::Mm;
use kernel::{
    prelude::*,
    sync::{Arc, MutexGuard},
    workqueue::WorkItem,
};

/// A pass's turn at choosing victims: its hold of `Device::evict_lock`, which it gives up
/// while a batch of its victims copies (the lock counts the frames of such batches).
struct Turn<'a> {
    dev: &'a Device,
    /// `None` while the batch copies.
    guard: Option<MutexGuard<'a, u64>>,
    /// Frames of that batch, counted under the lock.
    batch: u64,
}

impl<'a> Turn<'a> {
    fn take(dev: &'a Device) -> Turn<'a> {
        Turn { dev, guard: Some(dev.evict_lock.lock()), batch: 0 }
    }

    /// Frames of the device's batches copying now (with the lock held; 0 otherwise).
    fn copying(&self) -> u64 {
        self.guard.as_deref().copied().unwrap_or(0)
    }

    /// Gives the lock up while a batch of `n` frames copies, counting them there.
    fn give_up(&mut self, n: u64) {
        if let Some(mut g) = self.guard.take() {
            if *g > 0 {
                DevStats::add(&self.dev.stats.evict_overlaps, 1);
            }
            *g = g.saturating_add(n);
            self.batch = n;
        }
    }

    /// Holds the lock again (if given up), and ends the batch's count: whoever waits for
    /// frames (`pass`, `wait_for_copies`) is told. Before each use of what the lock protects.
    fn retake(&mut self) -> &mut MutexGuard<'a, u64> {
        let dev = self.dev;
        let g = self.guard.get_or_insert_with(|| dev.evict_lock.lock());
        if self.batch > 0 {
            **g = g.saturating_sub(self.batch);
            self.batch = 0;
            dev.evict_done.notify_all();
        }
        g
    }
}

impl Drop for Turn<'_> {
    /// A batch's count ends with its pass, whatever way the pass left.
    fn drop(&mut self) {
        if self.batch > 0 {
            self.retake();
        }
    }
}

/// Why frames are being freed (for the counters).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Why {
    /// A device fault found the pool full and waits for this.
    Fault,
    /// PREFETCH or PIN advice found the pool full.
    Advice,
    /// The background worker keeps the pool between its watermarks.
    Background,
    /// The dmem controller lowered a cgroup's limit below its use (reclaim callback).
    Reclaim,
    /// A read-ahead worker makes room for the block it is about to read: `want` is how many
    /// frames it wants free, rechecked under the evictor lock (another read-ahead or the
    /// background worker may have freed them meanwhile; frames of batches still copying
    /// are not counted: they are other lanes'). Counted as pre-eviction; never takes
    /// frames that `dmem.low` protects, since this is a bet, not a need.
    Ahead,
}

/// A peer that can take a victim without touching its own reserve.
fn peer_for(dev: &Device) -> Option<Arc<Device>> {
    if !tune::PEER.load(Relaxed) {
        return None;
    }
    devices::all()
        .into_iter()
        .filter(|p| p.id != dev.id && p.alive() && p.same_driver(dev))
        .map(|p| (p.park_room(), p))
        .filter(|(room, _)| *room > 0)
        .max_by_key(|(room, _)| *room)
        .map(|(_, p)| p)
}

/// The eviction step of page `i` of `region`, held on `dev`: a read-only duplicate is
/// dropped; a dirty owner page goes back without a copy to a live device of `holders`
/// that has a duplicate of it (the backing copy of a page read back from where it was
/// parked), else is parked on the peer while `peer_room` lasts (then decremented);
/// anything else goes to the host (a clean page without a copy). `None` for a pinned page
/// or one `dev` no longer holds.
fn evict_step(
    dev: &Device,
    p: &crate::obj::region::Pages,
    i: usize,
    peer: &Option<Arc<Device>>,
    peer_room: &mut u64,
    holders: u16,
) -> Option<Step> {
    let d = dev.id as u8;
    let s = p.state(i);
    let ev = if s.loc() != Loc::Device(d) {
        if s.dup_mask() & (1 << d) == 0 {
            return None;
        }
        Event::DeviceGone { dev: d }
    } else if s.pinned() {
        return None;
    } else {
        let clean = s.host_valid() && !s.dirty();
        let backed = s.dup_mask() & holders;
        match peer {
            _ if !clean && backed != 0 => Event::EvictTo { dev: backed.trailing_zeros() as u8 },
            Some(peer) if !clean && *peer_room > 0 => {
                *peer_room -= 1;
                Event::EvictTo { dev: peer.id as u8 }
            }
            _ => Event::Evict,
        }
    };
    let (next, a) = transition(s, ev).ok()?;
    Some(Step { i, prev: s, next, a })
}

/// Counts an evicted page by where it went, in the device's counters and in `tally`
/// (to host, to a peer, clean: the batch's trace event). Returns whether it was copied
/// to `peer` (the executor has marked its frame there lent: the lender reclaims parked
/// frames first).
fn note_evicted(dev: &Device, peer: &Option<Arc<Device>>, st: &Step, tally: &mut [u32; 3]) -> bool {
    let (c, k, parked) = match st.a.copy {
        _ if st.prev.loc() != Loc::Device(dev.id as u8) => (&dev.stats.evicted_clean, 2, false),
        // Back to the duplicate it left where it was parked before: no copy.
        _ if st.a.dup_to_owner.is_some() => (&dev.stats.evicted_to_peer, 1, false),
        // The executor marked the frame lent (the page is parked).
        Copy::D2D { to, .. } => (&dev.stats.evicted_to_peer, 1, peer.as_ref().is_some_and(|peer| peer.id as u8 == to)),
        Copy::None => (&dev.stats.evicted_clean, 2, false),
        _ => (&dev.stats.evicted_to_host, 0, false),
    };
    DevStats::add(c, 1);
    tally[k] = tally[k].saturating_add(1);
    parked
}

/// Evicts the pages `idx` of `region` (held on `dev`) as one executor batch; returns
/// pages freed on `dev`, or `ENOMEM` when host memory (or the memory cgroup) is exhausted:
/// then nothing more can be evicted to the host and the caller stops.
fn evict_pages(
    dev: &Device,
    region: &Arc<Region>,
    p: &mut crate::obj::region::Pages,
    idx: &[usize],
    peer: &Option<Arc<Device>>,
) -> Result<usize> {
    // Devices whose duplicates may take pages back without a copy: live, of the same
    // driver. A device that dies after this look loses its duplicates under the block
    // lock held here, so a promotion never targets one it has already dropped.
    // With `peer=0` nothing is parked, this way either.
    let peers = if tune::PEER.load(Relaxed) { devices::all() } else { KVec::new() };
    let holders = peers
        .into_iter()
        .filter(|h| h.id != dev.id && h.alive() && h.same_driver(dev))
        .fold(0u16, |m, h| m | u8::try_from(h.id).map_or(0, dev_bit));
    let mut steps: KVec<Step> = KVec::with_capacity(idx.len(), GFP_KERNEL)?;
    // The lender's reserve is respected for the whole batch: its own allocations win. The
    // room is promised to this batch until its frames there are allocated, so that other
    // batches planning meanwhile (this device's, whose batches copy side by side, or other
    // devices') do not count the same frames; what the plan does not park is given back.
    let mut promise = peer.as_ref().filter(|peer| peer.alive()).map(|peer| peer.promise_parking(idx.len() as u64));
    let mut peer_room = promise.as_ref().map_or(0, Promise::n);
    for &i in idx {
        if let Some(st) = evict_step(dev, p, i, peer, &mut peer_room, holders) {
            steps.push(st, GFP_KERNEL)?;
        }
    }
    if let Some(pr) = promise.as_mut() {
        // `evict_step` took one of `n` for each page it parks.
        pr.keep(pr.n().saturating_sub(peer_room));
    }
    // Given back once the batch's copies are started (every frame it takes on the peer is
    // allocated by then and counts as used), or when the batch ends without copies.
    let promise = core::cell::Cell::new(promise);
    let allocated = || drop(promise.take());
    let env = Env::background_then(region, &allocated);
    let (mut freed, mut from, mut parked, mut host_full) = (0, 0, false, false);
    let mut tally = [0u32; 3];
    // First as planned; if a step fails (the peer filled up meanwhile, say), it and the
    // rest go to the host in a second batch.
    for with_peer in [true, false] {
        if !with_peer {
            let mut none = 0;
            for k in from..steps.len() {
                if let Some(st) = evict_step(dev, p, steps[k].i, &None, &mut none, holders) {
                    steps[k] = st;
                }
            }
        }
        let out = migrate::apply_batch(&env, p, &steps[from..]);
        for st in &steps[from..from + out.done] {
            parked |= note_evicted(dev, peer, st, &mut tally);
        }
        freed += out.done;
        from += out.done;
        match out.res {
            Err(e) if e == ENOMEM => {
                host_full = true;
                break;
            }
            Err(_) if with_peer && from < steps.len() => continue,
            _ => break,
        }
    }
    drop(promise.take());
    if tally != [0; 3] {
        trace::evict(dev.id, tally[0], tally[1], tally[2]);
    }
    if let (true, Some(peer)) = (parked, peer) {
        if write_back_lent(peer.frames_free(), peer.high()) {
            // The lender is short itself: it makes host copies of parked pages.
            crate::obj::device::kick_always(peer);
        }
    }
    // Out of host memory: nothing more can be evicted to the host.
    if host_full {
        return Err(ENOMEM);
    }
    Ok(freed)
}

/// What eviction does with a resident page it considers.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Verdict {
    /// The device touched it: a second chance (marked referenced; a pending prefetch of
    /// it settles as used).
    Used,
    /// Spared once: marked referenced and spared.
    Spared,
    Evict,
    /// The device touched it, but its stream has gone past the block: no second chance,
    /// it goes (a pending prefetch of it settles as used).
    Passed,
}

/// Where a block lies for the device's stream, as eviction sees it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Place {
    /// In the read-ahead window (`Device::ahead_of_reader`), and this is pre-eviction.
    Ahead,
    /// Gone past by a live stream whose prefetches pay (`Device::behind_reader`).
    Behind,
    Elsewhere,
}

/// Whether page `i` of a region with `advice` prefers `dev` (PREFERRED_LOC): eviction
/// spares it once, and takes it neither without a second chance nor in place of the
/// hand's victims.
fn prefers(advice: &AdviceMap<ADVICE_RUNS>, i: usize, dev: &Device) -> bool {
    adv::preferred(advice.get(i as u64)) == Some(Target::Device(dev.id as u8))
}

/// The verdict on page `i` (owner frame on `dev`, with flags `fl`; `touched`: the
/// device's accessed bit, just tested and cleared; `place`: where its block lies for the
/// device's stream). A page gets a second chance if the device touched it since the last
/// look, unless its block is behind the stream (below); or, every time, if it was
/// prefetched, is ahead, unused yet, and prefetch pays on this device (two passes of the
/// hand took such blocks before the device came to them: P4's 2x stream wasted 500-700
/// prefetched pages per run, 2.05 transfers per page); or, once, if it prefers this
/// device, or it was prefetched, the device has not touched it yet and prefetch has been
/// paying on this device (`Device::prefetch_pays`; read-ahead evicted before use is a
/// wasted transfer and a fetch again: a trace of P4's 2x stream showed the hand, after a
/// sweep that cleared every reference bit, taking blocks just read ahead).
///
/// A page the device touched in a block its stream has gone past is `Passed` instead of
/// `Used`, unless it prefers this device: a stream reads each page once, so a second
/// chance only sends the hand round again. (In P4's 2x stream, read-ahead's room-making
/// passes swept the whole pool in 64-frame rounds that freed nothing, 0.6-9.5 ms each,
/// marking the pages the checksum had just read as referenced, while the device waited
/// for its next block.)
fn verdict(dev: &Device, advice: &AdviceMap<ADVICE_RUNS>, i: usize, fl: u8, touched: bool, place: Place) -> Verdict {
    let preferred = || prefers(advice, i, dev);
    if touched {
        return if place == Place::Behind && !preferred() { Verdict::Passed } else { Verdict::Used };
    }
    let preferred = preferred();
    let unused_prefetch = fl & F_PREFETCHED != 0 && dev.prefetch_pays();
    if unused_prefetch && place == Place::Ahead {
        return Verdict::Spared;
    }
    if (preferred || unused_prefetch) && fl & F_SPARED == 0 {
        Verdict::Spared
    } else {
        Verdict::Evict
    }
}

/// The decisions on one block's pages, each list with room reserved for every page
/// looked at before the accessed bits are read: nothing after the driver call can fail,
/// so no bit it cleared is lost.
struct Decisions {
    /// Pages to evict (room for a block's pages).
    evict: KVec<usize>,
    /// Frames the device touched that stay: a second chance (marked referenced).
    used: KVec<u32>,
    /// Frames the device touched behind its stream: no second chance (not marked); those
    /// of `Passed` pages leave, the others (past the caller's budget) stay unmarked.
    unmarked: KVec<u32>,
    /// Frames spared (marked referenced and spared).
    spared: KVec<u32>,
    /// `Passed` pages among `evict`.
    passed: u64,
}

impl Decisions {
    fn new() -> Result<Decisions> {
        Ok(Decisions {
            evict: KVec::with_capacity(migrate::BATCH_PAGES, GFP_KERNEL)?,
            used: KVec::new(),
            unmarked: KVec::new(),
            spared: KVec::new(),
            passed: 0,
        })
    }

    /// Room for `n` more pages' verdicts.
    fn reserve(&mut self, n: usize) -> Result {
        self.used.reserve(n, GFP_KERNEL)?;
        self.unmarked.reserve(n, GFP_KERNEL)?;
        self.spared.reserve(n, GFP_KERNEL)?;
        Ok(())
    }

    /// Records verdict `v` on page `i` (frame `frame`). A page `evict` has no room for
    /// stays (it cannot happen: one block's pages at most); a touched one keeps its
    /// second chance then.
    fn keep(&mut self, v: Verdict, i: usize, frame: u32) {
        let _ = match v {
            Verdict::Used => self.used.push_within_capacity(frame).map_err(|_| ()),
            Verdict::Spared => self.spared.push_within_capacity(frame).map_err(|_| ()),
            Verdict::Evict => self.evict.push_within_capacity(i).map_err(|_| ()),
            Verdict::Passed => match self.evict.push_within_capacity(i) {
                Ok(()) => {
                    self.passed += 1;
                    self.unmarked.push_within_capacity(frame).map_err(|_| ())
                }
                Err(_) => self.used.push_within_capacity(frame).map_err(|_| ()),
            },
        };
    }

    /// Touched page `frame` past the caller's budget, with `v` its [`verdict`] (`Used` or
    /// `Passed`): it stays, with a second chance only if `Used`.
    fn keep_touched(&mut self, v: Verdict, frame: u32) {
        let list = if v == Verdict::Passed { &mut self.unmarked } else { &mut self.used };
        let _ = list.push_within_capacity(frame);
    }

    /// Applies the frames' marks (one pool lock for the touched ones, one for the spared)
    /// and counts the passed pages.
    fn mark(&self, dev: &Device) {
        dev.note_used(&self.used, &self.unmarked);
        dev.set_flags_of(&self.spared, F_REF | F_SPARED);
        DevStats::add(&dev.stats.evict_passed, self.passed);
    }
}

/// The device's accessed bits of the pages `pages` (indices in the block at `va`), tested
/// and cleared (one driver call if the driver has `test_clear_accessed_range`); all clear
/// without a context or a driver.
fn touched(dev: &Device, ctx: Option<Ctx>, va: u64, pages: impl Iterator<Item = usize>) -> BlockBits {
    let mut hit: BlockBits = [0; 8];
    for k in pages {
        bits::set(&mut hit, k);
    }
    match (ctx, dev.ops()) {
        (Some(c), Some(ops)) if hit != [0; 8] => ops.test_clear_accessed(c, va, &mut hit),
        _ => hit = [0; 8],
    }
    hit
}

/// Eviction within a dmem cgroup at its limit: the pool, and the process whose allocation
/// hit it (for a trial charge: has room appeared meanwhile?); none for the reclaim callback.
#[derive(Clone, Copy)]
pub(crate) struct Within<'a> {
    pub(crate) limit: &'a Limit,
    pub(crate) mm: Option<&'a Mm>,
}

/// Evicts the victims `seeds` (frames the hand chose, with the pages they hold, all in one
/// 2 MiB block of one region) and the cold rest of their block (with `limit`, only frames
/// charged within it) as one batch; returns frames freed, `None` if the block is held
/// (by a batch in flight, whose commit may free or keep these frames: the caller counts
/// them in transit) or its region is being torn down (which frees them), or `ENOMEM`
/// (with the count so far lost to the caller's early stop) when the host is full. Called with `turn` held; gives it up before the batch copies
/// (the caller takes it back: [`Turn::retake`]).
///
/// The block's pages are looked at in two rounds, the seeds then the rest of the block
/// (also when every seed stays: see below), each with one acquisition of the pool lock
/// for the frames' flags and one driver call for the accessed bits (not one per page: the
/// device's page-table lock is the one its compute takes for every access, and a profile
/// of P4's 2x stream found the evictor spinning on it a fifth of its time). A page past
/// what the caller needs had its accessed bit cleared too: if set, it is kept as the
/// frame's referenced bit (behind the device's stream, only its pending prefetch settles
/// as used).
fn evict_victims(
    dev: &Device,
    seeds: &[(u32, &Owner)],
    peer: &Option<Arc<Device>>,
    budget: usize,
    limit: Option<&Limit>,
    keep_ahead: bool,
    turn: &mut Turn<'_>,
) -> Result<Option<usize>> {
    let Some((_, head)) = seeds.first() else { return Ok(Some(0)) };
    let region = &head.region;
    // A page that holds a frame has a block.
    let Some(blk) = region.block_if_any(head.page as usize) else { return Ok(Some(0)) };
    // While batches copy, a held block is not waited for under `evict_lock`: the hand
    // meets the frames of a block another pass is evicting right after the victims it
    // took there. With none copying, its holder is a fault's or a read-ahead's batch,
    // which commits within milliseconds: waited for, as it always was.
    let mut p = if turn.copying() > 0 {
        let Some(p) = region.try_lock(&blk) else { return Ok(None) };
        p
    } else {
        region.lock(&blk)
    };
    if region.is_dead() {
        // Its teardown frees these frames (it marked the region dead, and frees block by
        // block): in transit, as a held block's are, so that a caller that needs room
        // waits for them rather than failing. (Lent frames are the first victims of every
        // round: a dead region's could otherwise fill every round of a pass, which then
        // freed nothing and ended with ENOMEM while the device had cold frames.)
        return Ok(None);
    }
    let advice = *region.advice.lock();
    let d = dev.id as u8;
    // The device's context for this region's space, looked up once for the whole batch.
    let ctx = region.space.ctx_if_any(dev);
    let (first, last) = (p.range().start, p.range().end);
    let va = region.va(first);
    // Read ahead of the device's stream and not used yet: pre-eviction leaves it alone.
    // Left behind by the device's stream: what it touched goes without a second chance.
    let place = match usize::try_from(va).map(block_base) {
        Ok(b) if keep_ahead && dev.ahead_of_reader(region, b, dev.nr_frames / 2) => Place::Ahead,
        Ok(b) if dev.prefetch_pays() && dev.behind_reader(region, b) => Place::Behind,
        _ => Place::Elsewhere,
    };
    // The seeds that still hold their frame here, as owner or as a duplicate (a seed
    // per page at most).
    let mut picked: KVec<(usize, u32, bool)> = KVec::with_capacity(seeds.len(), GFP_KERNEL)?;
    let mut seen: BlockBits = [0; 8];
    for &(frame, w) in seeds {
        let i = w.page as usize;
        // The caller groups by block, so every seed lies in this one (checked anyway).
        if !Arc::ptr_eq(&w.region, region) || !(first..last).contains(&i) || bits::test(&seen, i - first) {
            continue;
        }
        let s = p.state(i);
        let owner = s.loc() == Loc::Device(d) && p.frame(i) == frame;
        if !owner && p.dup_frame(i, d) != Some(frame) {
            continue;
        }
        bits::set(&mut seen, i - first);
        picked.push((i, frame, owner), GFP_KERNEL)?;
    }
    let mut dec = Decisions::new()?;
    let owned = |x: &&(usize, u32, bool)| x.2;
    let mut fls = KVec::new();
    fls.extend_with(picked.iter().filter(owned).count(), None, GFP_KERNEL)?;
    dev.flags_of(picked.iter().filter(owned).map(|x| x.1), None, &mut fls);
    dec.reserve(picked.len())?;
    let hit = touched(dev, ctx, va, picked.iter().filter(owned).map(|x| x.0 - first));
    let mut fl = fls.iter();
    for &(i, frame, owner) in picked.iter() {
        let v = if owner {
            let f = fl.next().copied().flatten().unwrap_or(0);
            verdict(dev, &advice, i, f, bits::test(&hit, i - first), place)
        } else {
            Verdict::Evict
        };
        dec.keep(v, i, frame);
    }
    // The cold rest of the block goes along, while the caller still needs frames: pages
    // owned here, not pinned, evictable within `limit`, not referenced. Its touched pages
    // are marked (one driver call) even when every seed stayed, so the hand passes them
    // on the pool's flags alone: when the pool holds only pages the device just wrote
    // (P4's 2x stream as its read begins), the sweep costs a round per block, not one per
    // 64 frames (traced: 8-10 rounds and 5.2-5.9 ms under `evict_lock` instead of 64
    // rounds and 8.3-12.8 ms, while a device fault waited for the lock).
    let room = budget.max(dec.evict.len());
    if dec.evict.len() < room {
        let (rest, fls) = owned_pages(dev, &p, |j| bits::test(&seen, j - first), Some(limit))?;
        dec.reserve(rest.len())?;
        let cold = |k: usize| fls.get(k).copied().flatten().filter(|fl| fl & F_REF == 0);
        let hit = touched(dev, ctx, va, (0..rest.len()).filter(|&k| cold(k).is_some()).map(|k| rest[k].0 - first));
        for (k, &(j, fj)) in rest.iter().enumerate() {
            let Some(fl) = cold(k) else { continue };
            let t = bits::test(&hit, j - first);
            if dec.evict.len() < room {
                dec.keep(verdict(dev, &advice, j, fl, t, place), j, fj);
            } else if t {
                dec.keep_touched(verdict(dev, &advice, j, fl, true, place), fj);
            }
        }
    }
    dec.mark(dev);
    let mut idx = dec.evict;
    if idx.is_empty() {
        return Ok(Some(0));
    }
    // In page order, as the executor wants.
    idx.sort_unstable();
    // The choosing is done; the copies run without `evict_lock`, so that the next pass
    // (a read-ahead's, a fault's) chooses while these are on the link. The block lock
    // held keeps these pages to this batch.
    turn.give_up(idx.len() as u64);
    evict_pages(dev, region, &mut p, &idx, peer).map(Some)
}

/// Pages of a block with their frames, and the frames' flags ([`owned_pages`]).
type OwnedPages = (KVec<(usize, u32)>, KVec<Option<u8>>);

/// The pages of block `p` that `dev` holds as owner, not pinned, but for those `skip`
/// names, each with its frame; and the frames' flags under one acquisition of the pool
/// lock (`Device::flags_of` with `evictable`: `None` for a frame that eviction may not
/// take).
fn owned_pages(
    dev: &Device,
    p: &crate::obj::region::Pages,
    skip: impl Fn(usize) -> bool,
    evictable: Option<Option<&Limit>>,
) -> Result<OwnedPages> {
    let d = dev.id as u8;
    let r = p.range();
    let mut pages: KVec<(usize, u32)> = KVec::with_capacity(r.len(), GFP_KERNEL)?;
    for j in r {
        let s = p.state(j);
        if !skip(j) && s.loc() == Loc::Device(d) && !s.pinned() {
            pages.push((j, p.frame(j)), GFP_KERNEL)?;
        }
    }
    let mut fls = KVec::new();
    fls.extend_with(pages.len(), None, GFP_KERNEL)?;
    dev.flags_of(pages.iter().map(|x| x.1), evictable, &mut fls);
    Ok((pages, fls))
}

/// Blocks behind the reader that [`evict_behind`] looks at, nearest first.
const BEHIND_LOOK: usize = 8;

/// In place of the hand's victims `seeds` (frames of one block of one region), when that
/// block lies in front of the reader of the device's live stream in the region, a reader
/// not taken to move down (`Device::reader_before`), and prefetch pays on the device: the
/// pages on `dev` of the nearest block the stream has gone past
/// (`policy::prefetch::passed_blocks`), at most `budget` of them, go as one batch. The
/// stream reaches the hand's victims before it comes back, if ever, to a block behind it.
/// (The hand alone, in P4's 2x stream, evicted the half that the checksum reads second
/// while it read the first, then fetched it all again: 16 MiB more over the host link,
/// with the device waiting at the end.) Pages
/// that prefer the device, are pinned, or are protected by their cgroup's `dmem.min`
/// stay; the unmap settles the pending prefetches of the others by the device's accessed
/// bits (`migrate::revoke`). `None` when this does not apply (also within a dmem cgroup's
/// limit), or no such block has evictable pages: the hand's victims go then (also after
/// a batch here that freed nothing). If a block behind was held while eviction batches
/// copied and none had evictable pages, `Ok(None)`: in transit, as [`evict_victims`] says
/// of a held block (a caller that needs the room waits for the batches copying, and the
/// hand's victims stay). Called as [`evict_victims`] is, with `turn` held; gives it up before
/// the batch copies.
fn evict_behind(
    dev: &Device,
    seeds: &[(u32, &Owner)],
    peer: &Option<Arc<Device>>,
    budget: usize,
    limit: Option<&Limit>,
    turn: &mut Turn<'_>,
) -> Option<Result<Option<usize>>> {
    if limit.is_some() || budget == 0 || !dev.prefetch_pays() {
        return None;
    }
    let (_, head) = seeds.first()?;
    let region = &head.region;
    let va = usize::try_from(region.va(head.page as usize)).ok()?;
    let at = dev.reader_before(region, block_base(va))?;
    // Whether a block behind was held while eviction batches copied (most likely by one
    // of them, whose frames come free when its copies end; as for `evict_victims`, a
    // block held with none copying is not waited for).
    let mut held = false;
    for b in passed_blocks(at, BEHIND_LOOK) {
        let Some(lo) = b.checked_mul(BLOCK_BYTES) else { break };
        // Below the region's start: so are the rest.
        if lo.saturating_add(BLOCK_BYTES) <= region.start {
            break;
        }
        let Some(blk) = region.index(lo.max(region.start)).and_then(|i| region.block_if_any(i)) else { continue };
        let Some(mut p) = region.try_lock(&blk) else {
            held |= turn.copying() > 0;
            continue;
        };
        if region.is_dead() {
            return None;
        }
        let advice = *region.advice.lock();
        // Pages that do not prefer the device, whose frames the device-wide pressure may
        // take: not protected by their cgroup's `dmem.min` (as for the rest of a victim's
        // block).
        let Ok((cand, fls)) = owned_pages(dev, &p, |j| prefers(&advice, j, dev), Some(None)) else { return None };
        let mut idx: KVec<usize> = KVec::with_capacity(cand.len(), GFP_KERNEL).ok()?;
        for (&(j, _), fl) in cand.iter().zip(fls.iter()) {
            if fl.is_some() && idx.len() < budget {
                let _ = idx.push_within_capacity(j);
            }
        }
        if idx.is_empty() {
            continue;
        }
        DevStats::add(&dev.stats.evict_behind, idx.len() as u64);
        turn.give_up(idx.len() as u64);
        return Some(evict_pages(dev, region, &mut p, &idx, peer).map(Some));
    }
    // Frames behind the stream on their way out: waited for as in transit, not replaced
    // by what the stream reads next.
    held.then_some(Ok(None))
}

/// Frees at least `want` frames on `dev` if that many are evictable — `within` a dmem
/// cgroup pool, frames charged within it only; returns frames freed (0: nothing evictable,
/// host memory exhausted, every victim's block held by a batch in flight while eviction
/// batches copied, or the task is being killed), or `want` when someone else made the
/// room meanwhile. Must be called with no block lock held.
pub(crate) fn make_room(dev: &Arc<Device>, want: usize, why: Why, within: Option<Within<'_>>) -> usize {
    let done = pass(dev, want, why, within);
    // A need whose victims all lay in blocks held while eviction batches copied tries
    // once more when one has ended (the cgroup controller would take 0 for "nothing
    // left"); not for a task being killed.
    if done.freed == 0
        && done.in_transit
        && matches!(why, Why::Reclaim | Why::Advice)
        && !sched::fatal_signal_pending()
        && wait_for_copies(dev)
    {
        return pass(dev, want, why, within).freed;
    }
    done.freed
}

/// What one eviction pass did.
struct Pass {
    /// Frames freed (or `want`: someone else made the room meanwhile).
    freed: usize,
    /// Whether the hand met frames in transit: held, without an owner yet, by a batch in
    /// flight (a read-ahead worker's, another fault's), which become evictable when it
    /// commits; or in a block a batch in flight held while eviction batches copied (another
    /// pass's eviction, a fault's): a later pass looks at them when the hand comes round.
    /// Also set, with nothing freed, when a task being killed stopped before evicting.
    in_transit: bool,
}

/// [`make_room`], telling also whether frames in transit were met.
fn pass(dev: &Arc<Device>, want: usize, why: Why, within: Option<Within<'_>>) -> Pass {
    let mut turn = Turn::take(dev);
    dev.drain_released();
    let limit = within.map(|w| w.limit);
    // Another evictor may have made room while we waited for the lock: free frames, or for
    // a cgroup at its limit, room under its limit.
    let mut room = match within {
        None => dev.frames_free() as usize >= want,
        Some(Within { mm: Some(mm), .. }) => dev.dmem.has_room(mm),
        Some(_) => false,
    };
    let want = match why {
        Why::Ahead => want.saturating_sub(dev.frames_free() as usize),
        _ => want,
    };
    if why == Why::Ahead && want == 0 {
        return Pass { freed: 0, in_transit: false };
    }
    let need = !matches!(why, Why::Background | Why::Ahead);
    // A need that the batches copying now (other passes', without the lock) will meet
    // waits for them instead of evicting more: for frames, not for a pass of its own,
    // whose batch would share the link with theirs. At most `COPY_WAITS` batch ends
    // (read-ahead may take the frames and start new batches meanwhile). The wait is not
    // interruptible (a pending signal would turn the caller's retries into a spin) and
    // lasts one batch's copies; a task being killed then evicts nothing (its caller
    // returns `EINTR`).
    for _ in 0..COPY_WAITS {
        if !need || within.is_some() || room {
            break;
        }
        let g = turn.retake();
        let copying = **g;
        if copying == 0 || dev.frames_free().saturating_add(copying) < want as u64 {
            break;
        }
        await_batch_end(dev, g);
        if sched::fatal_signal_pending() {
            return Pass { freed: 0, in_transit: true };
        }
        room = dev.frames_free() as usize >= want;
    }
    if need && room {
        return Pass { freed: want, in_transit: false };
    }
    if why == Why::Fault {
        DevStats::add(&dev.stats.fault_waits, 1);
    }
    let peer = peer_for(dev);
    let mut freed = 0;
    let mut in_transit = false;
    // Used pages get a second chance (their referenced or accessed bit is cleared as the
    // hand passes), so finding victims can take two sweeps over the pool.
    const BATCH: usize = 64;
    let rounds = 2 * (dev.nr_frames as usize / BATCH) + 2;
    // `dmem.low` protects frames until nothing else is left (`dmem.min` always does).
    let mut ignore_low = false;
    'rounds: for _round in 0..rounds {
        if freed >= want {
            break;
        }
        let Ok((victims, transit)) = dev.victims(BATCH.min(want - freed).max(8), limit, ignore_low) else { break };
        in_transit |= transit > 0;
        if victims.is_empty() && transit > 0 {
            // The hand met only frames in transit: it has moved past them, and evictable
            // frames (unprotected ones first) may lie beyond.
            continue;
        }
        if victims.is_empty() {
            if !ignore_low && why != Why::Ahead {
                ignore_low = true;
                continue;
            }
            break;
        }
        // Frames of process memory (no region owner) leave together, through the pagemap.
        let mut sysmem: KVec<u64> = KVec::new();
        // The victims of one 2 MiB block leave together: one batch (one block lock, one
        // TLB flush, one copy per path) instead of one per page. The hand meets a block's
        // frames side by side while their neighbours are often still referenced, so
        // without this a background pass moved its target a page at a time.
        let mut owned: KVec<(u32, &Owner)> = KVec::new();
        for (f, who) in victims.iter() {
            let pushed = match who {
                Some(w) => owned.push((*f, w), GFP_KERNEL),
                None => sysmem.push(u64::from(*f), GFP_KERNEL),
            };
            if pushed.is_err() {
                break 'rounds;
            }
        }
        let block_of = |w: &Owner| (Arc::as_ptr(&w.region) as usize, w.region.block_pages(w.page as usize).start);
        owned.sort_unstable_by_key(|(_, w)| block_of(w));
        for seeds in owned.chunk_by(|(_, a), (_, b)| block_of(a) == block_of(b)) {
            // Faults take the whole cold 2 MiB neighbourhood (the stream moves on anyway);
            // the background worker, read-ahead and reclaim stay within their target.
            let budget = if matches!(why, Why::Background | Why::Reclaim | Why::Ahead) {
                want.saturating_sub(freed)
            } else {
                usize::MAX
            };
            // Pre-eviction (optional work) does not take read-ahead the device is about to
            // use; a fault, advice or a cgroup's reclaim, which need the room, may (once
            // spared, as any unused prefetch).
            let keep_ahead = matches!(why, Why::Background | Why::Ahead) && limit.is_none();
            // `turn` is held here: taken at the start, and back after every block.
            let done = match evict_behind(dev, seeds, &peer, budget, limit, &mut turn) {
                Some(Ok(Some(0))) | None => {
                    turn.retake();
                    evict_victims(dev, seeds, &peer, budget, limit, keep_ahead, &mut turn)
                }
                // What the stream has gone past is on its way out: the pass ends there
                // (its caller waits for those frames if it needs them) rather than have
                // the hand sweep on through frames the stream reads next.
                Some(Ok(None)) => {
                    in_transit = true;
                    break 'rounds;
                }
                Some(r) => r,
            };
            turn.retake();
            match done {
                Ok(Some(n)) => freed += n,
                Ok(None) => in_transit = true,
                // Host memory is exhausted: every further victim would fail the same way.
                Err(_) => break 'rounds,
            }
        }
        if !sysmem.is_empty() {
            // The pagemap is used under `evict_lock` (its teardown takes it): `turn` is
            // held here, as above.
            freed += dpriv::evict(dev, &sysmem, false);
        }
    }
    if matches!(why, Why::Background | Why::Ahead) {
        DevStats::add(&dev.stats.pre_evicted, freed as u64);
    }
    Pass { freed, in_transit }
}

/// A transition's frame allocation found its device full, or (with `limit`) its owner's
/// dmem cgroup at its limit there: frees up to `want` frames (of that cgroup) so the
/// caller can retry. A pass that freed fewer than `want`, or none because others made
/// room meanwhile, still lets the caller retry. If the hand met only frames in transit
/// (held by a batch in flight, without an owner yet: they become evictable once that
/// batch commits; or in blocks held while eviction batches copied), it waits for them
/// and returns `true` (no progress: the caller does not count the round): for an
/// eviction batch to end while any copies, else for 1 ms, at most [`TRANSIT_WAITS`] times
/// in all, counted in `waits` (the caller's: per device fault, or per block of advice).
/// `ENOMEM` if nothing is evictable (all pinned, or the host is out of memory; for a
/// cgroup, none of its frames), or the waits are used up; `EINTR`, before anything else, if the current task is being killed
/// (a worker, which takes no signals, must check its own reason to stop). The caller must
/// have dropped its block lock.
pub(crate) fn make_room_for(
    a: &Actions,
    want: usize,
    why: Why,
    within: Option<Within<'_>>,
    waits: &mut u32,
) -> Result<bool> {
    // The faults and advice of a task that is being killed are for nothing: it neither
    // evicts (other processes' pages, maybe) nor waits.
    if sched::fatal_signal_pending() {
        return Err(EINTR);
    }
    let full = a.alloc_frame.and_then(|d| devices::get(d as usize)).ok_or(ENOMEM)?;
    let done = pass(&full, want, why, within);
    if done.freed > 0 {
        return Ok(false);
    }
    let room = match within {
        None => full.frames_free() > 0,
        Some(w) => w.mm.is_some_and(|mm| full.dmem.has_room(mm)),
    };
    if room {
        return Ok(false);
    }
    // The pass may have stopped for a kill: a killed task neither waits nor evicts.
    if sched::fatal_signal_pending() {
        return Err(EINTR);
    }
    if !done.in_transit || *waits >= TRANSIT_WAITS {
        return Err(ENOMEM);
    }
    *waits += 1;
    // Frames in blocks that eviction batches hold while they copy are free when those
    // end (at a slow link, a batch takes hundreds of milliseconds): waited for, as the
    // batch's pass was when it copied under `evict_lock`.
    if wait_for_copies(&full) {
        return Ok(true);
    }
    DevStats::add(&full.stats.transit_waits, 1);
    // A batch commits within about a millisecond of copying.
    kernel::time::delay::fsleep(kernel::time::Delta::from_millis(1));
    Ok(true)
}

/// Waits for one of `dev`'s eviction batches copying to end, if any is (counted in
/// `copy_waits`); whether it waited.
fn wait_for_copies(dev: &Device) -> bool {
    let mut g = dev.evict_lock.lock();
    if *g == 0 {
        return false;
    }
    await_batch_end(dev, &mut g);
    true
}

/// Waits, with `evict_lock` held as `g` (given up while waiting), for the end of one of
/// `dev`'s eviction batches copying; counted in `copy_waits`.
fn await_batch_end(dev: &Device, g: &mut MutexGuard<'_, u64>) {
    dev.evict_done.wait(g);
    DevStats::add(&dev.stats.copy_waits, 1);
}

/// How many ends of eviction batches copying one pass of a fault or advice waits for
/// before it evicts itself.
const COPY_WAITS: usize = 8;

/// How many times one operation (a device fault, or one block of advice) waits in
/// [`make_room_for`] for frames in transit before it gives up with `ENOMEM` (a batch
/// commits within milliseconds; a fifth of a second is far beyond. While eviction batches
/// copy, each wait lasts until one of them ends).
const TRANSIT_WAITS: u32 = 200;

/// Writes parked victims back to host, so that the lender can later drop them instantly;
/// only while the lender is short of frames itself (`write_back_lent`).
fn write_back_parked(dev: &Device) {
    if !write_back_lent(dev.frames_free(), dev.high()) {
        return;
    }
    let Ok(list) = dev.lent_dirty(64) else { return };
    for (f, who) in list.iter() {
        let region = &who.region;
        let i = who.page as usize;
        let Some(blk) = region.block_if_any(i) else { continue };
        let mut p = region.lock(&blk);
        if region.is_dead() {
            continue;
        }
        let s = p.state(i);
        if s.loc() != Loc::Device(dev.id as u8) || p.frame(i) != *f {
            continue;
        }
        if let Ok((next, a)) = transition(s, Event::WriteBack) {
            if migrate::apply(&Env::background(region), &mut p, i, next, &a).is_ok() {
                DevStats::add(&dev.stats.writebacks, 1);
            }
        }
    }
}

/// The background worker of one device (runs on gmem's workqueue).
pub(crate) fn background(dev: &Arc<Device>) {
    // Frames of freed device-private pages come back here (exec/dpriv.rs).
    dev.drain_released();
    if !dev.alive() {
        return;
    }
    write_back_parked(dev);
    if !tune::PREEVICT.load(Relaxed) {
        return;
    }
    let target = reclaim_target(dev.frames_free(), dev.low(), dev.high(), dev.nr_frames);
    if target > 0 {
        make_room(dev, target as usize, Why::Background, None);
    }
}

/// The device's background work item is its evictor.
impl WorkItem for Device {
    type Pointer = Arc<Device>;

    fn run(this: Arc<Device>) {
        background(&this);
    }
}
