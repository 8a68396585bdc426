// SPDX-License-Identifier: GPL-2.0
//! Migration: carries out the [`Actions`] that the page-state machine
//! (`policy/src/page_state.rs`) decided for one page. Every fault, advice and teardown path
//! ends here, with the region's page lock held.
//!
//! Order of work (deliberately not the field order of `Actions`): allocate first (so a
//! failure changes nothing), then revoke every mapping of the old copy (CPU and devices),
//! then copy, then free what the old placement held, then commit the new state, then map.
//! Revoking before copying means no processor can write the old copy after it was read.

use crate::abi::{GmemCopy, GmemPte, GMEM_COPY_D2D, GMEM_COPY_D2H, GMEM_COPY_H2D, GMEM_COPY_ZERO};
use crate::abi::{GMEM_PROT_READ, GMEM_PROT_WRITE};
use crate::device::{self as devmod, DevStats, Device, DeviceOps, Owner, F_PREFETCHED};
use crate::policy::evict::{F_CLEAN, F_LENT, F_PINNED, F_REF};
use crate::policy::page_state::{Actions, Copy, Loc, PageState, Refused};
use crate::region::{devices_in, Pages, Region, PAGE_SIZE};
use crate::registry;
use crate::host_page::HostPage;
use kernel::{mm::virt::VmaRef, prelude::*, sync::Arc};

/// Where a page's mappings live besides the region itself.
pub(crate) struct Env<'a> {
    pub(crate) region: &'a Arc<Region>,
    /// The region's VMA, with the mmap lock held, when CPU mappings may have to be zapped.
    pub(crate) vma: Option<&'a VmaRef>,
    /// The transition is an access (fault, prefetch, pin): the page becomes hot and stops
    /// being a parked victim. Eviction and write-back are not accesses.
    pub(crate) access: bool,
}

impl<'a> Env<'a> {
    pub(crate) fn access(region: &'a Arc<Region>, vma: Option<&'a VmaRef>) -> Self {
        Env { region, vma, access: true }
    }

    pub(crate) fn background(region: &'a Arc<Region>) -> Self {
        Env { region, vma: None, access: false }
    }
}

/// The errno of a refused transition for advice and device faults: a lost page fails with
/// `EIO` (its data is gone), a pinned one with `EBUSY`. (CPU faults get SIGBUS for both.)
pub(crate) fn refusal_errno(r: Refused) -> Error {
    match r {
        Refused::Lost => EIO,
        _ => EBUSY,
    }
}

/// Counts a prefetched frame as used or wasted, once.
fn settle_prefetch(dev: &Device, used: bool) {
    let c = if used { &dev.stats.prefetch_used } else { &dev.stats.prefetch_wasted };
    DevStats::add(c, 1);
}

fn device(id: u8) -> Result<Arc<Device>> {
    registry::get(id as usize).ok_or(ENODEV)
}

fn host_ptr(p: &Pages, i: usize) -> Result<*mut kernel::bindings::page> {
    p.host[i].as_ref().map(|pg| pg.as_ptr()).ok_or(EINVAL)
}

/// Frees what step 1/2 allocated when a later step fails.
fn undo(p: &mut Pages, i: usize, new_host: bool, new_frame: &Option<(Arc<Device>, u32)>) {
    if new_host {
        p.host[i] = None;
    }
    if let Some((d, f)) = new_frame {
        d.free_frame(*f);
    }
}

/// Applies the transition `p.state(i) -> next` whose actions are `a`.
///
/// On error before the commit point the page keeps its old state and nothing allocated is
/// kept (mappings may have been revoked: they come back on the next fault).
pub(crate) fn apply(env: &Env<'_>, p: &mut Pages, i: usize, next: PageState, a: &Actions) -> Result {
    let region = env.region;
    let space = &region.space;
    let va = region.va(i);
    let old_frame = p.frame[i];

    // 1. Host page (zeroed, charged to the process's memcg).
    let mut new_host = false;
    if a.alloc_host && p.host[i].is_none() {
        // A page a D2H copy fills whole needs no zeroing first.
        p.host[i] = Some(HostPage::alloc(space.mm(), !matches!(a.copy, Copy::D2H(_)))?);
        new_host = true;
    }
    // 2. Device frame; a frame that becomes a duplicate needs room in the side list.
    let mut new_frame = None;
    if let Some(d) = a.alloc_frame {
        // A device that started unregistering takes nothing new. Evacuation marks it dead
        // first and then takes every region lock, so checking here, under the region lock,
        // cannot miss it.
        let r = device(d).and_then(|dev| if dev.alive() { Ok(dev) } else { Err(ENODEV) }).and_then(|dev| {
            if next.loc() != Loc::Device(d) {
                p.dups.reserve()?;
            }
            let f = dev.alloc_frame()?;
            Ok((dev, f))
        });
        match r {
            Ok(nf) => new_frame = Some(nf),
            Err(e) => {
                undo(p, i, new_host, &None);
                return Err(e);
            }
        }
    }

    // 4. Revoke the CPU mapping, 5. then device mappings (before the copy, see above).
    if a.zap_cpu {
        if let Some(vma) = env.vma {
            vma.zap_vma_range(va as usize, PAGE_SIZE);
        }
    }
    let old_loc = p.state(i).loc();
    for d in devices_in(a.unmap_dev) {
        let Ok(dev) = device(d) else { continue };
        // A device that is gone has no page table left to unmap from.
        let (Some(ops), Some(ctx)) = (dev.ops(), space.ctx_if_any(&dev)) else { continue };
        if old_loc == Loc::Device(d) && a.free_frame == Some(d) && dev.flags(old_frame) & F_PREFETCHED != 0 {
            // A prefetched page leaves: did the device ever touch it?
            settle_prefetch(&dev, ops.test_clear_accessed(ctx, va).unwrap_or(false));
        }
        ops.unmap(ctx, va, 1);
        ops.tlb_invalidate(ctx, va, 1);
    }

    // 3. Data.
    let nf = new_frame.as_ref().map(|(_, f)| u64::from(*f)).unwrap_or(0);
    let r = match a.copy {
        Copy::None => Ok(()),
        Copy::ZeroHost => {
            if !new_host {
                if let Some(pg) = p.host[i].as_ref() {
                    pg.zero();
                }
            }
            Ok(())
        }
        Copy::ZeroDev(d) => device(d).and_then(|dev| {
            DevStats::add(&dev.stats.pages_zeroed, 1);
            let c = GmemCopy { host: core::ptr::null_mut(), frame: nf, peer_frame: 0 };
            dev.ops().ok_or(ENODEV)?.copy(GMEM_COPY_ZERO, &[c], None)
        }),
        Copy::H2D(d) => device(d).and_then(|dev| {
            DevStats::add(&dev.stats.pages_h2d, 1);
            let c = GmemCopy { host: host_ptr(p, i)?, frame: nf, peer_frame: 0 };
            dev.ops().ok_or(ENODEV)?.copy(GMEM_COPY_H2D, &[c], None)
        }),
        Copy::D2H(o) => device(o).and_then(|dev| {
            DevStats::add(&dev.stats.pages_d2h, 1);
            let c = GmemCopy { host: host_ptr(p, i)?, frame: u64::from(old_frame), peer_frame: 0 };
            dev.ops().ok_or(ENODEV)?.copy(GMEM_COPY_D2H, &[c], None)
        }),
        Copy::D2D { from, to } => device(from).and_then(|src| {
            let dst = device(to)?;
            if !src.same_driver(&dst) {
                // Peer copies need one driver on both ends; the state machine's caller
                // only offers peers of the same driver (see `evict::peer_for`).
                return Err(EXDEV);
            }
            DevStats::add(&src.stats.pages_d2d, 1);
            let c = GmemCopy { host: core::ptr::null_mut(), frame: u64::from(old_frame), peer_frame: nf };
            let (s, d) = (src.ops().ok_or(ENODEV)?, dst.ops().ok_or(ENODEV)?);
            s.copy(GMEM_COPY_D2D, &[c], Some(&*d))
        }),
    };
    if let Err(e) = r {
        undo(p, i, new_host, &new_frame);
        return Err(e);
    }

    // 6. Release the old placement.
    if let Some(o) = a.free_frame {
        if let Ok(dev) = device(o) {
            dev.free_frame(old_frame);
        }
    }
    for d in devices_in(a.free_dup_frames) {
        if let Some(f) = p.take_dup(i, d) {
            if let Ok(dev) = device(d) {
                dev.free_frame(f);
            }
        }
    }
    let who = Owner { region: env.region.clone(), page: i as u32 };
    if let Some((dev, f)) = new_frame {
        if next.loc() == Loc::Device(dev.id as u8) {
            p.frame[i] = f;
        } else {
            // The tree node was reserved in step 2, so this cannot fail.
            let _ = p.dups.insert(i, dev.id as u8, f);
            dev.set_owner(f, who.clone(), F_CLEAN | F_REF, 0);
        }
        devmod::kick(&dev);
    }
    // The owner frame's replacement flags follow the page's state.
    if let Loc::Device(d) = next.loc() {
        if let Ok(dev) = device(d) {
            let f = p.frame[i];
            let old = dev.flags(f);
            if env.access && old & F_PREFETCHED != 0 && a.free_frame != Some(d) {
                settle_prefetch(&dev, true);
            }
            let mut set = if next.pinned() { F_PINNED } else { 0 };
            if next.host_valid() && !next.dirty() {
                set |= F_CLEAN;
            }
            let keep = if env.access { 0 } else { F_LENT | F_REF | F_PREFETCHED };
            dev.set_owner(f, who, set | if env.access { F_REF } else { 0 }, keep);
        }
    }
    // 7.
    if a.free_host {
        p.host[i] = None;
    }
    // Commit. A pin that ends gives its page back to the process's pin quota.
    if p.state(i).pinned() && !next.pinned() {
        crate::pin_quota::uncharge(space.mm(), 1);
    }
    p.state[i] = next.bits();

    // 8. Device mapping (a failure here leaves a consistent, merely unmapped page).
    if let Some(m) = a.map_dev {
        let dev = device(m.dev)?;
        if !dev.alive() {
            return Err(ENODEV);
        }
        let ops = dev.ops().ok_or(ENODEV)?;
        let ctx = space.ctx(&dev)?;
        let prot = GMEM_PROT_READ | if m.writable { GMEM_PROT_WRITE } else { 0 };
        let pte = if m.remote_host {
            DevStats::add(&dev.stats.remote_maps, 1);
            GmemPte { va, frame: 0, host: host_ptr(p, i)?, prot, pad: 0 }
        } else {
            let frame = if next.loc() == Loc::Device(m.dev) {
                p.frame[i]
            } else {
                p.dup_frame(i, m.dev).ok_or(EINVAL)?
            };
            GmemPte { va, frame: u64::from(frame), host: core::ptr::null_mut(), prot, pad: 0 }
        };
        ops.map(ctx, &[pte])?;
    }
    Ok(())
}

/// Applies `event` to every page of `pages` in `range` (advice and teardown paths).
/// Refused transitions are reported with `refused`; stops at the first execution error.
/// Never-touched pages are skipped without a transition when `event` leaves them alone.
pub(crate) fn apply_range(
    env: &Env<'_>,
    p: &mut Pages,
    first: usize,
    count: usize,
    event: crate::policy::page_state::Event,
    refused: Error,
) -> Result {
    use crate::policy::page_state::transition;
    let skip_empty = matches!(transition(PageState::EMPTY, event), Ok((n, a)) if n == PageState::EMPTY && a == Actions::default());
    for i in first..first.checked_add(count).ok_or(EINVAL)? {
        if (i - first) % crate::sched::CHUNK == 0 {
            crate::sched::cond_resched();
        }
        if skip_empty && p.state[i] == PageState::EMPTY.bits() {
            continue;
        }
        let s = p.state(i);
        let (next, a) = transition(s, event).map_err(|_| refused)?;
        if next != s || a != Actions::default() {
            apply(env, p, i, next, &a)?;
        }
    }
    Ok(())
}

/// Releases everything a region holds (VMA close: munmap, FREE, exit). Idempotent.
///
/// The region is marked dead and emptied under its page lock *before* it leaves its
/// space's tree: device evacuation walks the tree, so it either finds the region (and
/// serialises with this on the page lock) or finds it gone, already empty. No driver is
/// called after its unregistration returned (callbacks go through `Device::ops`).
pub(crate) fn teardown(region: &Arc<Region>) {
    use crate::policy::page_state::Event;
    {
        let mut p = region.pages.lock();
        if !p.dead {
            p.dead = true;
            let env = Env::background(region);
            if let Err(e) = apply_range(&env, &mut p, 0, region.npages, Event::Free, EINVAL) {
                pr_err!("teardown of region {:#x} failed: {:?}\n", region.start, e);
            }
        }
    }
    region.space.remove_region(region);
}

/// What one evacuation pass did in one region.
#[derive(Default)]
pub(crate) struct Evacuated {
    /// Pages that still involve the device (their move failed; retried by a later pass).
    pub(crate) left: u64,
    /// Pages whose data could not be saved and that are now `Lost`.
    pub(crate) lost: u64,
}

/// Moves everything `dev` holds in `region` to the host (device unregistration). A page
/// whose move fails stays as it is and is counted in `left`; with `lose`, it becomes
/// `Lost` instead (its frames and mappings are released; accesses fail from then on).
pub(crate) fn evacuate(region: &Arc<Region>, dev: &Device, lose: bool) -> Evacuated {
    use crate::policy::page_state::{transition, Event};
    let mut out = Evacuated::default();
    let mut p = region.pages.lock();
    if p.dead {
        return out;
    }
    let env = Env::background(region);
    let d = dev.id as u8;
    let mut moved = 0u64;
    // Once a host page could not be had for this region (its process's memory cgroup or
    // the host is full), the region's other pages that need one are not tried again in
    // this pass: each try would reclaim in vain. Pages that need no allocation still move.
    let mut host_short = false;
    for i in 0..region.npages {
        if i % crate::sched::CHUNK == 0 {
            crate::sched::cond_resched();
        }
        let s = p.state(i);
        let involved = s.loc() == Loc::Device(d) || (s.dup_mask() | s.remote_mask()) & (1 << d) != 0;
        if !involved {
            continue;
        }
        let saved = match transition(s, Event::DeviceGone { dev: d }) {
            Ok((_, a)) if host_short && a.alloc_host && p.host[i].is_none() => Err(ENOMEM),
            Ok((next, a)) => apply(&env, &mut p, i, next, &a),
            Err(_) => Err(EINVAL),
        };
        match saved {
            Ok(()) => {
                moved += 1;
                continue;
            }
            Err(e) if e == ENOMEM => host_short = true,
            Err(_) => {}
        }
        if !lose {
            out.left += 1;
            continue;
        }
        // `Lose` allocates and copies nothing, so it cannot fail for want of memory; it
        // releases the page's frames on every device and its mappings.
        match transition(s, Event::Lose).map_err(|_| EINVAL).and_then(|(next, a)| apply(&env, &mut p, i, next, &a)) {
            Ok(()) => out.lost += 1,
            Err(_) => out.left += 1,
        }
    }
    DevStats::add(&dev.stats.evacuated, moved);
    DevStats::add(&dev.stats.lost, out.lost);
    out
}
