// SPDX-License-Identifier: GPL-2.0
//! GMEM: one virtual address space for the CPU and accelerators.
//!
//! Crate root of gmem.ko. Where things are:
//! - `chardev`  — `/dev/gmem`, the user API (ioctls), one open = one handle on the caller's space
//! - `registry` — accelerator drivers register here (C ABI of `include/linux/gmem.h`)
//! - `layout`   — load-time check that bindgen's struct layouts match C's
//!
//! Lock order: see Documentation/design.rst.

use kernel::{
    miscdevice::{MiscDeviceOptions, MiscDeviceRegistration},
    prelude::*,
};

#[path = "../include/rust/gmem_abi.rs"]
mod abi;
mod chardev;
mod layout;
mod registry;

module! {
    type: GmemModule,
    name: "gmem",
    authors: ["GMEM developers"],
    description: "GMEM: unified CPU/accelerator virtual memory",
    license: "GPL",
}

#[pin_data]
struct GmemModule {
    #[pin]
    misc: MiscDeviceRegistration<chardev::GmemFile>,
}

impl kernel::InPlaceModule for GmemModule {
    fn init(_module: &'static ThisModule) -> impl PinInit<Self, Error> {
        pin_init::pin_init_scope(|| {
            layout::check()?;
            registry::init();
            pr_info!("gmem: loaded (uapi v{})\n", chardev::UAPI_VERSION);
            Ok(try_pin_init!(Self {
                misc <- MiscDeviceRegistration::register(MiscDeviceOptions { name: c"gmem" }),
            }))
        })
    }
}
