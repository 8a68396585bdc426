// SPDX-License-Identifier: GPL-2.0
//! Run-time tunables of the overcommit engine, set through `/sys/kernel/debug/gmem/control`
//! (one or more `key=value` words per write):
//! - `prefetch=0|1`        density prefetch on device faults (default 1)
//! - `prefetch_pct=1..100` density threshold in percent (default 51, as UVM)
//! - `preevict=0|1`        background pre-eviction between the watermarks (default 1)
//! - `peer=0|1`            park victims on peer devices with spare frames (default 1)
//! - `readahead=0|1`       read-ahead of the next block for a streaming device (default 1)
//! - `lanes=1..4`          blocks one PREFETCH advice works on at once (default 3)
//! - `head=16..256`        most pages in the first part of a batch in parts (default 128)
//! - `multipath=0|1`       route part of a large host-to-device copy through an idle peer
//!   when the links the drivers reported make that faster (default 1)
//! - `thrash=0|1`          thrashing detection and response (default 1)
//! - `thrash_window_us=N`  longest pause between moves of one burst (default 500, as UVM)
//! - `dev=N low=L high=H`  watermarks of device N, in frames
//! - `fail_host=N`         for tests: the N-th host page allocation from now fails with
//!   `ENOMEM`, once (0, the default: none); a memory cgroup at its limit, on cue
//! - `fail_teardown=N`     for tests: the N-th block torn down from now, in any region,
//!   cannot have its batch's step list (`ENOMEM`), once (0, the default: none); a kernel
//!   short of memory, as an OOM-killed process's exit may find it. Shown while armed.

use core::sync::atomic::{AtomicBool, AtomicU32};

pub(crate) static PREFETCH: AtomicBool = AtomicBool::new(true);
pub(crate) static PREFETCH_PCT: AtomicU32 = AtomicU32::new(51);
pub(crate) static PREEVICT: AtomicBool = AtomicBool::new(true);
pub(crate) static PEER: AtomicBool = AtomicBool::new(true);
pub(crate) static READAHEAD: AtomicBool = AtomicBool::new(true);
pub(crate) static MULTIPATH: AtomicBool = AtomicBool::new(true);
pub(crate) static LANES: AtomicU32 = AtomicU32::new(3);
/// Most lanes `lanes=` accepts.
pub(crate) const MAX_LANES: u32 = 4;
/// Copy entries in a batch's first part at most (`migrate::pipelined`): its copy starts
/// once its own pages are allocated and revoked, and the other parts' allocation and
/// revoke run while it is on the link.
pub(crate) static HEAD_PAGES: AtomicU32 = AtomicU32::new(128);
/// The range `head=` accepts. A batch runs in parts only if its copies make two shares or
/// more, so its first part (`min(head, ceil(copies / shares))`) is at most half of a
/// 512-page block: a larger `head` would act as 256.
pub(crate) const HEAD_MIN: u32 = 16;
pub(crate) const HEAD_MAX: u32 = 256;
/// `poll=N`: a waiter for a copy whose driver said when it should complete polls the
/// channel from `N` us before then (`Fence::wait_polled`; 0: never; default 100).
pub(crate) static POLL_US: AtomicU32 = AtomicU32::new(100);
/// Most `poll=` accepts: 10 ms.
pub(crate) const POLL_MAX_US: u32 = 10_000;
pub(crate) static THRASH: AtomicBool = AtomicBool::new(true);
pub(crate) static THRASH_WINDOW_US: AtomicU32 = AtomicU32::new(500);
/// `fail_host=`: host page allocations left until the one that fails (0: none).
pub(crate) static FAIL_HOST: AtomicU32 = AtomicU32::new(0);

/// `fail_teardown=`: teardown blocks left until the one whose step list fails (0: none).
pub(crate) static FAIL_TEARDOWN: AtomicU32 = AtomicU32::new(0);

/// Thrashing parameters: UVM's (3 moves within 500 us, pin after 10 throttles, for 300
/// windows), with the window tunable (`thrash_window_us`).
pub(crate) fn thrash_params() -> crate::policy::thrash::ThrashParams {
    let window_ns = u64::from(THRASH_WINDOW_US.load(core::sync::atomic::Ordering::Relaxed)) * 1000;
    crate::policy::thrash::ThrashParams { window_ns, moves: 3, throttles_to_pin: 10, pin_ns: window_ns * 300 }
}

/// Whether this host page allocation is the one `fail_host=` asked to fail (counting it).
pub(crate) fn host_alloc_fails() -> bool {
    use core::sync::atomic::Ordering::Relaxed;
    FAIL_HOST.fetch_update(Relaxed, Relaxed, |n| n.checked_sub(1)) == Ok(1)
}

/// Whether this teardown block's step list is the one `fail_teardown=` asked to fail
/// (counting it).
pub(crate) fn teardown_alloc_fails() -> bool {
    use core::sync::atomic::Ordering::Relaxed;
    FAIL_TEARDOWN.fetch_update(Relaxed, Relaxed, |n| n.checked_sub(1)) == Ok(1)
}
