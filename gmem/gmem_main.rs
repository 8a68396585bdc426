// SPDX-License-Identifier: GPL-2.0
//! GMEM: one virtual address space for the CPU and accelerators.
//!
//! Crate root of gmem.ko. Where things are:
//! - `chardev`  — `/dev/gmem`: the user API (ioctls) and the mmap contract
//! - `space`    — per-process address space: regions by address, device contexts
//! - `region`   — one allocation: per-page residency (16 bytes/page), advice
//! - `meta`     — failable zero-filled per-page metadata arrays
//! - `fault`    — where faults go: CPU `.fault` handler and `gmem_dev_fault()` batches
//! - `access`   — ptrace / /proc/PID/mem access (GMEM VMAs refuse GUP: VM_IO)
//! - `host_page`— host pages: memcg-charged, fail instead of OOM-killing
//! - `migrate`  — carries out the page-state machine's decisions (copy, map, unmap, free)
//! - `advise`   — GMEM_IOC_ADVISE: hints, prefetch/pin/dontneed, async fences
//! - `pin_quota`— PIN charged to RLIMIT_MEMLOCK (pinned_vm)
//! - `registry` — accelerator drivers register here (C ABI of `include/linux/gmem.h`)
//! - `device`   — a registered device: ops trait + C adapter, central frame allocator, rmap
//! - `evict`    — overcommit: replacement, 2 MiB victims, peer tier, pre-eviction worker
//! - `prefetch` — density prefetch on device faults
//! - `tune`     — run-time switches (debugfs `control`)
//! - `wq`       — gmem's own workqueue
//! - `sched`    — cond_resched / fatal-signal checks for long loops
//! - `policy`   — the pure `no_std` policy code of `policy/` (host-tested)
//! - `debugfs`  — counters and residency in /sys/kernel/debug/gmem
//! - `layout`   — load-time check that bindgen's struct layouts match C's
//!
//! Lock order: see Documentation/design.rst.

use kernel::{
    miscdevice::{MiscDeviceOptions, MiscDeviceRegistration},
    prelude::*,
};

#[path = "../include/rust/gmem_abi.rs"]
mod abi;
mod access;
mod advise;
mod chardev;
mod debugfs;
mod device;
mod evict;
mod fault;
mod host_page;
mod layout;
mod meta;
mod migrate;
mod pin_quota;
mod policy;
mod prefetch;
mod region;
mod registry;
mod sched;
mod space;
mod tune;
mod wq;

module! {
    type: GmemModule,
    name: "gmem",
    authors: ["GMEM developers"],
    description: "GMEM: unified CPU/accelerator virtual memory",
    license: "GPL",
}

#[pin_data(PinnedDrop)]
struct GmemModule {
    /// First field: created before anything can queue work, dropped first at unload.
    _wq: wq::WqGuard,
    #[pin]
    misc: MiscDeviceRegistration<chardev::GmemFile>,
    #[pin]
    debugfs: debugfs::Debugfs,
}

#[pinned_drop]
impl PinnedDrop for GmemModule {
    fn drop(self: Pin<&mut Self>) {
        // Open files and registered drivers pin the module, so nothing uses these now.
        space::exit();
    }
}

impl kernel::InPlaceModule for GmemModule {
    fn init(_module: &'static ThisModule) -> impl PinInit<Self, Error> {
        pin_init::pin_init_scope(|| {
            layout::check()?;
            registry::init();
            space::init();
            pr_info!("loaded (uapi v{})\n", chardev::UAPI_VERSION);
            Ok(try_pin_init!(Self {
                _wq: wq::WqGuard::new()?,
                misc <- MiscDeviceRegistration::register(MiscDeviceOptions { name: c"gmem" }),
                debugfs <- debugfs::Debugfs::new(),
            }))
        })
    }
}
