// SPDX-License-Identifier: GPL-2.0
//! Region teardown (VMA close: munmap, FREE, exit).

use crate::exec::migrate::{apply_range, Env};
use crate::obj::region::Region;
use kernel::{prelude::*, sync::Arc};

/// Releases everything a region holds (VMA close: munmap, FREE, exit). Idempotent.
///
/// The region is marked dead, then emptied block by block under each block's lock,
/// *before* it leaves its space's tree: device evacuation walks the tree, so it either
/// finds the region (and serialises with this on the block locks) or finds it gone,
/// already empty. A fault that locks a block after teardown passed it sees `dead`; one
/// that got there first is undone when teardown reaches the block. No driver is called
/// after its unregistration returned (callbacks go through `Device::ops`).
pub(crate) fn teardown(region: &Arc<Region>) {
    use crate::policy::page_state::Event;
    if !region.mark_dead() {
        let env = Env::background(region);
        let mut from = 0;
        while let Some(block) = region.next_block(from) {
            let mut p = region.lock(&block);
            from = p.range().end;
            let r = p.range();
            if let Err(e) = apply_range(&env, &mut p, r.start, r.end, Event::Free, EINVAL) {
                pr_err!("teardown of region {:#x} failed: {:?}\n", region.start, e);
            }
            drop(p);
            crate::obj::sched::cond_resched();
        }
    }
    region.space.remove_region(region);
    // What is mapped here later starts with no thrashing history of this region's pages.
    let (start, end) = (region.start as u64, region.end() as u64);
    region.space.thrash.lock().forget(start, end);
    // A device streaming through the region stops following it (`Device::behind_reader`).
    // Device by device: `devices::all` allocates, and could come back empty.
    for dev in (0..crate::obj::devices::MAX_DEVICES).filter_map(crate::obj::devices::get) {
        dev.forget_stream(region);
    }
}
