// SPDX-License-Identifier: GPL-2.0
//! Thrashing bookkeeping of migrations: every path that moves pages of a region between
//! the host and devices (device and CPU faults, read-ahead home) records the moves in the
//! space's thrash table (`obj/space.rs`, policy in `policy/src/thrash.rs`), so that a page
//! bouncing between them is seen whichever path moves it.

use crate::exec::migrate;
use crate::obj::device::{DevStats, Device};
use crate::obj::region::Region;
use crate::obj::space::Space;
use crate::obj::{sched, trace, tune};
use crate::policy::page_state::{Copy, Loc};
use crate::policy::thrash::Verdict;
use core::sync::atomic::Ordering::Relaxed;

/// Records the migrations of the pages of `steps` that moved data (copies, not zero
/// fills) in the space's thrash table, under one acquisition of its lock per batch;
/// returns true to throttle.
pub(crate) fn record_moves(dev: Option<&Device>, space: &Space, r: &Region, steps: &[migrate::Step]) -> bool {
    if !tune::THRASH.load(Relaxed) {
        return false;
    }
    let moved = |st: &&migrate::Step| match dev {
        Some(_) => st.a.copy != Copy::None && !matches!(st.a.copy, Copy::ZeroDev(_)),
        None => {
            matches!(st.a.copy, Copy::D2H(_)) || (matches!(st.prev.loc(), Loc::Device(_)) && st.next.loc() == Loc::Host)
        }
    };
    let (mut hits, mut throttle) = (0u64, false);
    {
        let mut t = space.thrash.lock();
        let now = sched::now_ns();
        for st in steps.iter().filter(moved) {
            let v = t.moved(r.va(st.i), now);
            hits += u64::from(!matches!(v, Verdict::Migrate));
            throttle |= matches!(v, Verdict::Throttle);
        }
    }
    if let Some(dev) = dev {
        DevStats::add(&dev.stats.thrash_events, hits);
        if hits != 0 {
            trace::thrash(dev.id, hits, throttle);
        }
    }
    throttle
}
