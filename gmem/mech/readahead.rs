// SPDX-License-Identifier: GPL-2.0
//! Read-ahead: a device streaming through a region gets its next 2 MiB block fetched in
//! the background while it computes on the current one, so that its copies overlap the
//! device's work instead of following it.
//!
//! - When: a device fault batch left its block wholly resident on the device
//!   (`policy::prefetch::read_ahead`; the density rule, `prefetch.rs`, fetched the rest).
//!   The next block of the same region is then queued on gmem's workqueue. One read-ahead
//!   per device is queued or running at a time (`Device::reading_ahead`); a fault that
//!   finds one busy starts none.
//! - What: every page of the next block that advice leaves alone, by the PREFETCH
//!   transition, in one executor batch. Like density prefetch it is a bet: it never
//!   evicts, and stops where the device is full.
//! - The marker: read-ahead pages are *not* mapped on the device. The device's first
//!   touch of the block faults, finds the pages resident (the fault only maps them), and
//!   that fault reads the following block ahead, so a stream keeps one block in flight
//!   ahead of the device, as the page cache's `PG_readahead` mark does for files.
//!
//! Lifetimes: the work item owns references to the device and the region. The region's
//! teardown marks it dead under each block's lock, and the device's unregistration marks
//! it dead before it evacuates; the worker checks both under the block lock and then does
//! nothing. It takes the mm only through `Space::mm_user_while_used` (no fetch for an
//! exiting process: nobody else uses its address space) and
//! the mmap lock itself, in the fault paths' order (mmap lock, then the block lock); it
//! runs on gmem's workqueue, which module unload drains.
//! Switch off with `readahead=0` in `/sys/kernel/debug/gmem/control`.

use crate::exec::migrate::Step;
use crate::mech::prefetch;
use crate::obj::device::{DevStats, Device};
use crate::obj::region::{Region, BLOCK_BYTES, BLOCK_PAGES};
use crate::obj::{tune, wq};
use crate::policy::page_state::{transition, Actions, Event, Target};
use core::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use kernel::{
    prelude::*,
    sync::Arc,
    workqueue::{impl_has_work, new_work, Work, WorkItem},
};

/// One queued read-ahead: the block at `block_va` of `region`, for `dev`.
#[pin_data]
pub(crate) struct ReadAhead {
    dev: Arc<Device>,
    region: Arc<Region>,
    block_va: usize,
    #[pin]
    work: Work<ReadAhead>,
}

impl_has_work! {
    impl HasWork<Self> for ReadAhead { self.work }
}

impl WorkItem for ReadAhead {
    type Pointer = Arc<ReadAhead>;

    fn run(this: Arc<ReadAhead>) {
        this.fetch();
        this.dev.reading_ahead.store(false, Release);
    }
}

/// Queues a read-ahead of the block after the one at `block_va` (2 MiB aligned) of `r` for
/// `dev`, if that block lies in `r`, read-ahead is on, and `dev` has none queued already.
pub(crate) fn after(dev: &Arc<Device>, r: &Arc<Region>, block_va: usize) {
    if !tune::READAHEAD.load(Relaxed) || !dev.alive() {
        return;
    }
    let Some(next) = block_va.checked_add(BLOCK_BYTES) else { return };
    if r.index(next).is_none() {
        return;
    }
    if dev.reading_ahead.compare_exchange(false, true, Acquire, Relaxed).is_err() {
        return;
    }
    let item = Arc::pin_init(
        pin_init!(ReadAhead { dev: dev.clone(), region: r.clone(), block_va: next, work <- new_work!("gmem_readahead") }),
        GFP_KERNEL,
    );
    match (item, wq::get()) {
        // A fresh work item cannot be queued already.
        (Ok(item), Some(q)) => {
            let _ = q.enqueue(item);
        }
        _ => dev.reading_ahead.store(false, Release),
    }
}

impl ReadAhead {
    fn fetch(&self) {
        let (dev, r) = (&self.dev, &self.region);
        let d = dev.id as u8;
        // Not for a process that is exiting (nobody else uses its address space).
        let Some(mm) = r.space.mm_user_while_used(0) else { return };
        let mmap = mm.mmap_read_lock();
        let vma = mmap.vma_lookup(r.start).filter(|v| v.start() == r.start);
        let Some(first) = r.index(self.block_va) else { return };
        let Ok(block) = r.block(first) else { return };
        let mut p = r.lock(&block);
        if r.is_dead() || !dev.alive() {
            return;
        }
        let advice = *r.advice.lock();
        let Ok(mut steps) = KVec::<Step>::with_capacity(BLOCK_PAGES, GFP_KERNEL) else { return };
        for i in p.range() {
            // Advice decides placement for advised pages; leave them alone.
            if advice.get(i as u64) != 0 {
                continue;
            }
            let s = p.state(i);
            let Ok((next, mut a)) = transition(s, Event::Prefetch { to: Target::Device(d) }) else { continue };
            if next == s && a == Actions::default() {
                continue;
            }
            // Unmapped: the device's first touch faults (without a copy) and reads further
            // ahead (the module documentation's marker).
            a.map_dev = None;
            // Capacity reserved above.
            let _ = steps.push(Step { i, prev: s, next, a }, GFP_NOWAIT);
        }
        let n = prefetch::speculate(dev, r, vma, &mut p, &steps);
        DevStats::add(&dev.stats.readahead, n);
    }
}
