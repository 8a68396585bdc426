// SPDX-License-Identifier: GPL-2.0
//! The dmem cgroup controller's call into gmem: when a cgroup's `dmem.max` on a device is
//! set below what it uses, the controller calls the region's reclaim callback
//! (`gmem_dmem.c`), which lands here and evicts that cgroup's frames.
//!
//! Lifetime: the controller calls the callback inside an SRCU section of its own, and
//! `dmem_cgroup_unregister_region` (called by `gmem_dev_unregister` before the device's id
//! can be reused) waits for every such section; so the id names the registered device the
//! region belongs to, or no device at all (then nothing is done).

use crate::mech::evict::{self, Why};
use crate::obj::devices;
use crate::obj::dmem::{Limit, RawPool};
use kernel::prelude::*;

/// Evicts up to `frames` frames of device `id` charged within `pool`; 0 if some were freed,
/// `-ENOSPC` if none could be, `-ENODEV` for a device that is going away (the controller's
/// contract for its reclaim callback: only `-ENOSPC` is retried).
#[no_mangle]
pub(crate) extern "C" fn gmem_dmem_reclaim_frames(id: usize, pool: *mut RawPool, frames: u64) -> c_int {
    // A device being unregistered has nothing left to evict (and its region is about to go).
    let Some(dev) = devices::get(id).filter(|d| d.alive()) else { return ENODEV.to_errno() };
    // SAFETY: `pool` is the callback's argument, live until it returns; the `Limit` is
    // dropped before that.
    let Some(limit) = (unsafe { Limit::borrowed(pool) }) else { return ENOSPC.to_errno() };
    let want = usize::try_from(frames).unwrap_or(usize::MAX);
    if evict::make_room(&dev, want, Why::Reclaim, Some(evict::Within { limit: &limit, mm: None })) == 0 {
        return ENOSPC.to_errno();
    }
    0
}
