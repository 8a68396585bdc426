// SPDX-License-Identifier: GPL-2.0
//! Eviction: device memory as a cache in front of host memory.
//!
//! - Order: CLOCK over frames (`policy/src/evict.rs`), fed by faults and prefetches (set
//!   the referenced bit) and by the driver's accessed bits (second chance). Pinned frames
//!   are never chosen; frames parked by peers go first.
//! - A victim leaves with its 2 MiB neighbourhood: every page of the same region in the
//!   same 2 MiB block, on the same device, not pinned and not referenced, goes in the
//!   same pass (one region lock).
//! - Where it goes: to a peer device with spare frames (HUVM's harvesting; the lender keeps
//!   its high watermark free, so its own allocations win), else to host memory. Clean
//!   pages (valid host copy) are dropped without a copy.
//! - When: on demand from the fault path (counted as a *fault wait*), and in the
//!   background between the low and high watermarks (*pre-eviction*). The background pass
//!   also writes parked victims back to host so that the lender can drop them instantly.
//!
//! Lock order: `Device::evict_lock` -> region pages -> `Space::ctxs` -> `Device::frames`.
//! Eviction never runs with a region lock held by its caller.

use crate::device::{DevStats, Device, DeviceOps, Owner};
use crate::migrate::{self, Env};
use crate::policy::evict::{reclaim_target, F_REF};
use crate::policy::page_state::{transition, Event, Loc};
use crate::region::{Region, PAGE_SIZE};
use crate::{registry, tune};
use core::sync::atomic::Ordering::Relaxed;
use kernel::sync::Arc;

/// Why frames are being freed (for the counters).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Why {
    /// A fault (or prefetch) found the pool full and waits for this.
    Fault,
    /// The background worker keeps the pool between its watermarks.
    Background,
}

/// A peer that can take a victim without touching its own reserve.
fn peer_for(dev: &Device) -> Option<Arc<Device>> {
    if !tune::PEER.load(Relaxed) {
        return None;
    }
    registry::all()
        .into_iter()
        .filter(|p| p.id != dev.id && p.alive() && p.drv.same_driver(&dev.drv) && p.frames_free() > p.high() + 1)
        .max_by_key(|p| p.frames_free())
}

/// Evicts one page (index `i` of `region`, held on `dev`); returns pages freed on `dev`.
fn evict_page(dev: &Device, region: &Arc<Region>, p: &mut crate::region::Pages, i: usize, peer: &Option<Arc<Device>>) -> usize {
    let d = dev.id as u8;
    let s = p.state(i);
    let env = Env::background(region);
    if s.loc() != Loc::Device(d) {
        // A read-only duplicate held on `dev`: just drop it.
        if s.dup_mask() & (1 << d) == 0 {
            return 0;
        }
        return match transition(s, Event::DeviceGone { dev: d }) {
            Ok((next, a)) if migrate::apply(&env, p, i, next, &a).is_ok() => {
                DevStats::add(&dev.stats.evicted_clean, 1);
                1
            }
            _ => 0,
        };
    }
    if s.pinned() {
        return 0;
    }
    let clean = s.host_valid() && !s.dirty();
    if let (Some(peer), false) = (peer, clean) {
        if let Ok((next, a)) = transition(s, Event::EvictTo { dev: peer.id as u8 }) {
            if migrate::apply(&env, p, i, next, &a).is_ok() {
                DevStats::add(&dev.stats.evicted_to_peer, 1);
                // Park it: the lender reclaims parked frames first.
                peer.set_owner(p.frame[i], Owner { region: region.clone(), page: i as u32 }, crate::policy::evict::F_LENT, 0);
                // Its host copy is made in the background, so the lender can drop it later.
                crate::device::kick_always(peer);
                return 1;
            }
        }
    }
    match transition(s, Event::Evict) {
        Ok((next, a)) if migrate::apply(&env, p, i, next, &a).is_ok() => {
            let c = if clean { &dev.stats.evicted_clean } else { &dev.stats.evicted_to_host };
            DevStats::add(c, 1);
            1
        }
        _ => 0,
    }
}

/// Evicts the victim `frame` and its cold 2 MiB neighbours; returns frames freed.
fn evict_victim(dev: &Device, frame: u32, who: &Owner, peer: &Option<Arc<Device>>) -> usize {
    let region = &who.region;
    let i = who.page as usize;
    let mut p = region.pages.lock();
    if p.dead || i >= region.npages {
        return 0;
    }
    let d = dev.id as u8;
    let s = p.state(i);
    let still_ours = (s.loc() == Loc::Device(d) && p.frame[i] == frame) || p.dup_frame(i, d) == Some(frame);
    if !still_ours {
        return 0;
    }
    // The device's accessed bit gives a used page a second chance.
    let ctx = region.space.ctx_if_any(dev);
    let used = |va: u64| ctx.and_then(|c| dev.drv.test_clear_accessed(c, va)).unwrap_or(false);
    // So does PREFERRED_LOC naming this device (once per CLOCK pass).
    let preferred_here = crate::region::adv::preferred(p.advice.get(i as u64)) == Some(crate::policy::page_state::Target::Device(d));
    if s.loc() == Loc::Device(d) && (used(region.va(i)) || (preferred_here && dev.flags(frame) & crate::device::F_PREFERRED_SPARED == 0)) {
        dev.reference(frame);
        if preferred_here {
            dev.set_owner(frame, who.clone(), crate::device::F_PREFERRED_SPARED, 0xff);
        }
        return 0;
    }
    let mut freed = evict_page(dev, region, &mut p, i, peer);
    // The rest of its 2 MiB block in this region, if cold.
    let pages_per_block = (1usize << 21) / PAGE_SIZE;
    let va = region.va(i) as usize;
    let block = va & !((1usize << 21) - 1);
    let first = block.saturating_sub(region.start) / PAGE_SIZE;
    let first = if block < region.start { 0 } else { first };
    let last = core::cmp::min(region.npages, first + pages_per_block);
    for j in first..last {
        if j == i {
            continue;
        }
        let sj = p.state(j);
        if sj.loc() != Loc::Device(d) || sj.pinned() || dev.flags(p.frame[j]) & F_REF != 0 || used(region.va(j)) {
            continue;
        }
        freed += evict_page(dev, region, &mut p, j, peer);
    }
    freed
}

/// Frees at least `want` frames on `dev` if that many are evictable; returns frames freed.
/// Must be called with no region lock held.
pub(crate) fn make_room(dev: &Arc<Device>, want: usize, why: Why) -> usize {
    let _one = dev.evict_lock.lock();
    if why == Why::Fault {
        DevStats::add(&dev.stats.fault_waits, 1);
        // Another evictor may have made room while we waited for the lock.
        if dev.frames_free() as usize >= want {
            return want;
        }
    }
    let peer = peer_for(dev);
    let mut freed = 0;
    // Used pages get a second chance (their referenced or accessed bit is cleared as the
    // hand passes), so finding victims can take two sweeps over the pool.
    const BATCH: usize = 64;
    let rounds = 2 * (dev.nr_frames as usize / BATCH) + 2;
    for _round in 0..rounds {
        if freed >= want {
            break;
        }
        let Ok(victims) = dev.victims(BATCH.min(want - freed).max(8)) else { break };
        if victims.is_empty() {
            break;
        }
        for (f, who) in victims.iter() {
            freed += evict_victim(dev, *f, who, &peer);
        }
    }
    if why == Why::Background {
        DevStats::add(&dev.stats.pre_evicted, freed as u64);
    }
    freed
}

/// Writes parked victims back to host, so that the lender can later drop them instantly.
fn write_back_parked(dev: &Device) {
    let Ok(list) = dev.lent_dirty(64) else { return };
    for (f, who) in list.iter() {
        let region = &who.region;
        let i = who.page as usize;
        let mut p = region.pages.lock();
        if p.dead || i >= region.npages {
            continue;
        }
        let s = p.state(i);
        if s.loc() != Loc::Device(dev.id as u8) || p.frame[i] != *f {
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
    if !dev.alive() {
        return;
    }
    write_back_parked(dev);
    if !tune::PREEVICT.load(Relaxed) {
        return;
    }
    let target = reclaim_target(dev.frames_free(), dev.low(), dev.high(), dev.nr_frames);
    if target > 0 {
        make_room(dev, target as usize, Why::Background);
    }
}
