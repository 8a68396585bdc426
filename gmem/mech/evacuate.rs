// SPDX-License-Identifier: GPL-2.0
//! Device unregistration's evacuation: every page that involves the device, in every
//! space, goes to the host, in passes with backoff; the last pass marks what still cannot
//! be saved as lost.

use crate::exec::migrate::{apply, Env};
use crate::obj::device::{DevStats, Device};
use crate::obj::region::{self, Region};
use crate::obj::space;
use crate::policy::page_state::Loc;
use kernel::{prelude::*, sync::Arc};

/// Pauses between evacuation passes that left pages behind (host memory short): reclaim
/// and other processes' frees get time to make room before the next pass.
const EVACUATION_BACKOFF_MS: [u32; 4] = [10, 50, 200, 1000];

/// One pass over every region of every space; returns the pages still involving `dev`.
/// With `lose`, a page whose data cannot be saved becomes lost instead of staying behind.
/// Regions created after the space list was taken cannot hold anything of `dev` (it is
/// dead, and `migrate::apply` checks that under the block lock); a region that leaves its
/// space's tree during the pass was torn down completely before it left (`teardown`).
fn evacuation_pass(dev: &Device, lose: bool) -> Result<u64> {
    // Pairs with the fence in `chardev::forget_dead_preference`: either this pass finds a
    // region created meanwhile, or its creator sees the device dead.
    core::sync::atomic::fence(core::sync::atomic::Ordering::SeqCst);
    let spaces = space::all()?;
    let mut left = 0;
    for s in spaces.iter() {
        let (mut from, mut lost) = (0, 0);
        // Advice naming the device goes with it. None can be set after this: advice checks
        // that its device is alive under the same lock (`advise::still_alive`), and a
        // region ALLOC makes meanwhile checks its preferred device once it is in the tree.
        region::adv::forget_device(&mut s.sysmem_advice.lock(), dev.id);
        while let Some(r) = s.next_region(from) {
            from = r.end();
            region::adv::forget_device(&mut r.advice.lock(), dev.id);
            let e = evacuate(&r, dev, lose);
            left += e.left;
            lost += e.lost;
        }
        if lost > 0 {
            pr_err!(
                "device {}: lost {} pages of process {} (space {}): host memory exhausted\n",
                dev.id,
                lost,
                s.pid,
                s.id
            );
        }
    }
    Ok(left)
}

/// Moves every page involving `dev` to the host, retrying passes with backoff; the last
/// pass marks what still cannot be saved as lost.
pub(crate) fn evacuate_device(dev: &Device) {
    for (pass, ms) in EVACUATION_BACKOFF_MS.iter().enumerate() {
        match evacuation_pass(dev, false) {
            Ok(0) => return,
            Ok(left) => pr_warn!("device {}: evacuation pass {}: {} pages left, retrying\n", dev.id, pass, left),
            Err(_) => pr_warn!("device {}: evacuation pass {}: out of memory, retrying\n", dev.id, pass),
        }
        kernel::time::delay::fsleep(kernel::time::Delta::from_millis(i64::from(*ms)));
    }
    // The space list itself needs memory; keep trying (each try sleeps) rather than leave
    // pages behind unaccounted.
    while evacuation_pass(dev, true).is_err() {
        pr_warn!("device {}: cannot list spaces for the last evacuation pass, retrying\n", dev.id);
        kernel::time::delay::fsleep(kernel::time::Delta::from_millis(100));
    }
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
    let env = Env::background(region);
    let d = dev.id as u8;
    let mut moved = 0u64;
    // Once a host page could not be had for this region (its process's memory cgroup or
    // the host is full), the region's other pages that need one are not tried again in
    // this pass: each try would reclaim in vain. Pages that need no allocation still move.
    let mut host_short = false;
    let mut from = 0;
    while let Some(block) = region.next_block(from) {
        let mut p = region.lock(&block);
        let range = p.range();
        from = range.end;
        // A region being torn down is evacuated too: teardown marks it dead first and
        // then empties its blocks one at a time, so blocks it has not reached yet still
        // hold device pages. Each block is emptied by whichever of the two takes its lock
        // first; the other finds nothing of the device there.
        for i in range {
            let s = p.state(i);
            let involved = s.loc() == Loc::Device(d) || (s.dup_mask() | s.remote_mask()) & (1 << d) != 0;
            if !involved {
                continue;
            }
            let saved = match transition(s, Event::DeviceGone { dev: d }) {
                Ok((_, a)) if host_short && a.alloc_host && p.host(i).is_none() => Err(ENOMEM),
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
            match transition(s, Event::Lose).map_err(|_| EINVAL).and_then(|(next, a)| apply(&env, &mut p, i, next, &a))
            {
                Ok(()) => out.lost += 1,
                Err(_) => out.left += 1,
            }
        }
        drop(p);
        crate::obj::sched::cond_resched();
    }
    DevStats::add(&dev.stats.evacuated, moved);
    DevStats::add(&dev.stats.lost, out.lost);
    out
}
