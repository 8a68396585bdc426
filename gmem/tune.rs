// SPDX-License-Identifier: GPL-2.0
//! Run-time tunables of the overcommit engine, set through `/sys/kernel/debug/gmem/control`
//! (one or more `key=value` words per write):
//! - `prefetch=0|1`        density prefetch on device faults (default 1)
//! - `prefetch_pct=1..100` density threshold in percent (default 51, as UVM)
//! - `preevict=0|1`        background pre-eviction between the watermarks (default 1)
//! - `peer=0|1`            park victims on peer devices with spare frames (default 1)
//! - `thrash=0|1`          thrashing detection and response (default 1)
//! - `thrash_window_us=N`  longest pause between moves of one burst (default 500, as UVM)
//! - `dev=N low=L high=H`  watermarks of device N, in frames

use crate::registry;
use core::sync::atomic::{AtomicBool, AtomicU32, Ordering::Relaxed};
use kernel::prelude::*;

pub(crate) static PREFETCH: AtomicBool = AtomicBool::new(true);
pub(crate) static PREFETCH_PCT: AtomicU32 = AtomicU32::new(51);
pub(crate) static PREEVICT: AtomicBool = AtomicBool::new(true);
pub(crate) static PEER: AtomicBool = AtomicBool::new(true);
pub(crate) static THRASH: AtomicBool = AtomicBool::new(true);
pub(crate) static THRASH_WINDOW_US: AtomicU32 = AtomicU32::new(500);

fn flag(v: &str) -> Result<bool> {
    match v {
        "0" => Ok(false),
        "1" => Ok(true),
        _ => Err(EINVAL),
    }
}

fn num(v: &str) -> Result<u64> {
    v.parse::<u64>().map_err(|_| EINVAL)
}

/// Applies one write to the control file. All words are validated before any is applied.
pub(crate) fn apply(text: &str) -> Result {
    let mut dev = None;
    let (mut low, mut high) = (None, None);
    let mut sets: KVec<(&str, &str)> = KVec::new();
    if text.split_whitespace().next().is_none() {
        // Nothing to apply (empty or only whitespace): documented as EINVAL.
        return Err(EINVAL);
    }
    for word in text.split_whitespace() {
        let (k, v) = word.split_once('=').ok_or(EINVAL)?;
        match k {
            "prefetch" | "preevict" | "peer" | "thrash" => {
                flag(v)?;
            }
            "prefetch_pct" => {
                let p = num(v)?;
                if p == 0 || p > 100 {
                    return Err(EINVAL);
                }
            }
            "thrash_window_us" => {
                let w = num(v)?;
                if w == 0 || w > 10_000_000 {
                    return Err(EINVAL);
                }
            }
            "dev" => dev = Some(registry::get(num(v)? as usize).ok_or(ENODEV)?),
            "low" => low = Some(num(v)?),
            "high" => high = Some(num(v)?),
            _ => return Err(EINVAL),
        }
        sets.push((k, v), GFP_KERNEL)?;
    }
    if low.is_some() || high.is_some() {
        let d = dev.as_ref().ok_or(EINVAL)?;
        let (l, h) = (low.unwrap_or(d.low()), high.unwrap_or(d.high()));
        if l > h || h > d.nr_frames {
            return Err(EINVAL);
        }
        d.set_watermarks(l, h);
    }
    for (k, v) in sets.iter() {
        match *k {
            "prefetch" => PREFETCH.store(flag(v)?, Relaxed),
            "preevict" => PREEVICT.store(flag(v)?, Relaxed),
            "peer" => PEER.store(flag(v)?, Relaxed),
            "thrash" => THRASH.store(flag(v)?, Relaxed),
            "prefetch_pct" => PREFETCH_PCT.store(num(v)? as u32, Relaxed),
            "thrash_window_us" => THRASH_WINDOW_US.store(num(v)? as u32, Relaxed),
            _ => {}
        }
    }
    Ok(())
}

/// The current settings, one line.
pub(crate) fn show(f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
    writeln!(
        f,
        "prefetch={} prefetch_pct={} preevict={} peer={} thrash={} thrash_window_us={}",
        PREFETCH.load(Relaxed) as u8,
        PREFETCH_PCT.load(Relaxed),
        PREEVICT.load(Relaxed) as u8,
        PEER.load(Relaxed) as u8,
        THRASH.load(Relaxed) as u8,
        THRASH_WINDOW_US.load(Relaxed)
    )
}
