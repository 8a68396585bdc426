// SPDX-License-Identifier: GPL-2.0
//! GMEM: one virtual address space for the CPU and accelerators.
//!
//! Crate root of gmem.ko. The modules are layered; each uses only its own layer and the
//! layers below it (`scripts/check-layers.sh`, run by `make check`, enforces it):
//!
//! - `entry`  — entry points: `/dev/gmem` ioctls and mmap (`chardev`, `advise`), the VMA
//!   callbacks (`vm_ops`), the driver C ABI (`registry`), debugfs (`debugfs`, `control`),
//!   the load-time layout check (`layout`)
//! - `mech`   — mechanisms: fault service (`fault`), ptrace access (`access`), density
//!   prefetch (`prefetch`), read-ahead (`readahead`), moving advice in lanes (`moves`),
//!   eviction and overcommit (`evict`), unregistration's evacuation (`evacuate`), region
//!   teardown (`teardown`)
//! - `exec`   — the block executor (`migrate`, with `multipath` for host-to-device copies
//!   routed in part through a peer): the only code that calls a driver's `copy`, `map`,
//!   `unmap` and `tlb_invalidate`
//! - `obj`    — objects: address spaces (`space`), regions and their blocks (`region`),
//!   devices and their frame pools (`device`), the device table (`devices`), host pages,
//!   per-page metadata, the pin quota, run-time switches (`tune`), gmem's workqueue, and
//!   the cond_resched helper. Object types refer to each other (a region's back pointer
//!   to its space, a frame's owner region); nothing here calls up into a mechanism.
//! - `policy` — the pure `no_std` policy code of `policy/` (host-tested)
//!
//! Lock order: see Documentation/design.rst.

use kernel::{
    miscdevice::{MiscDeviceOptions, MiscDeviceRegistration},
    prelude::*,
};

#[path = "../include/rust/gmem_abi.rs"]
mod abi;
mod policy;

/// Entry points (top layer).
mod entry {
    pub(crate) mod advise;
    pub(crate) mod cgroup;
    pub(crate) mod chardev;
    pub(crate) mod control;
    pub(crate) mod debugfs;
    pub(crate) mod layout;
    pub(crate) mod registry;
    pub(crate) mod sysfs;
    pub(crate) mod vm_ops;
}

/// Mechanisms: what faults, advice, eviction and unregistration do.
mod mech {
    pub(crate) mod access;
    pub(crate) mod evacuate;
    pub(crate) mod evict;
    pub(crate) mod fault;
    pub(crate) mod moves;
    pub(crate) mod prefetch;
    pub(crate) mod readahead;
    pub(crate) mod sysmem;
    pub(crate) mod teardown;
    pub(crate) mod thrash;
}

/// The block executor.
mod exec {
    pub(crate) mod dpriv;
    pub(crate) mod migrate;
    pub(crate) mod mirror;
    pub(crate) mod multipath;
}

/// Objects.
mod obj {
    pub(crate) mod device;
    pub(crate) mod devices;
    pub(crate) mod dmem;
    pub(crate) mod done;
    pub(crate) mod dpriv;
    pub(crate) mod fence;
    pub(crate) mod host_page;
    pub(crate) mod meta;
    pub(crate) mod mirror;
    pub(crate) mod pin_quota;
    pub(crate) mod region;
    pub(crate) mod sched;
    pub(crate) mod space;
    pub(crate) mod trace;
    pub(crate) mod tune;
    pub(crate) mod wq;
}

use entry::{chardev, debugfs, layout, sysfs};
use obj::{devices, space, wq};

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
    /// `/sys/class/gmem`: registered before any device can be, unregistered last.
    _sysfs: sysfs::ClassGuard,
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
            devices::init();
            space::init();
            pr_info!("loaded (uapi v{})\n", chardev::UAPI_VERSION);
            Ok(try_pin_init!(Self {
                _wq: wq::WqGuard::new()?,
                misc <- MiscDeviceRegistration::register(MiscDeviceOptions { name: c"gmem" }),
                debugfs <- debugfs::Debugfs::new(),
                _sysfs: sysfs::ClassGuard::new()?,
            }))
        })
    }
}
