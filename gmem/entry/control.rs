// SPDX-License-Identifier: GPL-2.0
//! The debugfs `control` file: parses `key=value` words into the run-time switches of
//! `obj/tune.rs` and the devices' watermarks.

use crate::obj::devices;
use crate::obj::tune::*;
use core::sync::atomic::Ordering::Relaxed;
use kernel::prelude::*;

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
            "prefetch" | "preevict" | "peer" | "thrash" | "readahead" | "multipath" => {
                flag(v)?;
            }
            "prefetch_pct" => {
                let p = num(v)?;
                if p == 0 || p > 100 {
                    return Err(EINVAL);
                }
            }
            "lanes" => {
                let n = num(v)?;
                if n == 0 || n > u64::from(MAX_LANES) {
                    return Err(EINVAL);
                }
            }
            "head" => {
                let n = num(v)?;
                if n < u64::from(HEAD_MIN) || n > u64::from(HEAD_MAX) {
                    return Err(EINVAL);
                }
            }
            "poll" => {
                if num(v)? > u64::from(POLL_MAX_US) {
                    return Err(EINVAL);
                }
            }
            "fail_host" | "fail_teardown" => {
                u32::try_from(num(v)?).map_err(|_| EINVAL)?;
            }
            "thrash_window_us" => {
                let w = num(v)?;
                if w == 0 || w > 10_000_000 {
                    return Err(EINVAL);
                }
            }
            "dev" => dev = Some(devices::get(num(v)? as usize).ok_or(ENODEV)?),
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
            "readahead" => READAHEAD.store(flag(v)?, Relaxed),
            "lanes" => LANES.store(num(v)? as u32, Relaxed),
            "head" => HEAD_PAGES.store(num(v)? as u32, Relaxed),
            "multipath" => MULTIPATH.store(flag(v)?, Relaxed),
            "poll" => POLL_US.store(num(v)? as u32, Relaxed),
            "prefetch_pct" => PREFETCH_PCT.store(num(v)? as u32, Relaxed),
            "thrash_window_us" => THRASH_WINDOW_US.store(num(v)? as u32, Relaxed),
            "fail_host" => FAIL_HOST.store(num(v)? as u32, Relaxed),
            "fail_teardown" => FAIL_TEARDOWN.store(num(v)? as u32, Relaxed),
            _ => {}
        }
    }
    Ok(())
}

/// The current settings, one line.
pub(crate) fn show(f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
    write!(
        f,
        "prefetch={} prefetch_pct={} preevict={} peer={} thrash={} thrash_window_us={} readahead={} lanes={} head={} multipath={} poll={}",
        u8::from(PREFETCH.load(Relaxed)),
        PREFETCH_PCT.load(Relaxed),
        u8::from(PREEVICT.load(Relaxed)),
        u8::from(PEER.load(Relaxed)),
        u8::from(THRASH.load(Relaxed)),
        THRASH_WINDOW_US.load(Relaxed),
        u8::from(READAHEAD.load(Relaxed)),
        LANES.load(Relaxed),
        HEAD_PAGES.load(Relaxed),
        u8::from(MULTIPATH.load(Relaxed)),
        POLL_US.load(Relaxed)
    )?;
    // A test's armed teardown failure, so that the test can see it was consumed.
    match FAIL_TEARDOWN.load(Relaxed) {
        0 => writeln!(f),
        n => writeln!(f, " fail_teardown={n}"),
    }
}
