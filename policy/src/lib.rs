// SPDX-License-Identifier: GPL-2.0
//! GMEM placement policy: the pure, allocation-free decisions of the GMEM kernel module.
//!
//! Every module here uses only `core` so the kernel module can include the files directly
//! (`#[path = "../policy/src/<file>.rs"] mod <file>;`); this crate exists to unit- and
//! property-test them on the host (`cargo test -p gmem-policy`).
#![no_std]

#[cfg(test)]
extern crate std;

pub mod batch;
pub mod bits;
pub mod evict;
pub mod frames;
pub mod page_state;
pub mod paths;
pub mod prefetch;
pub mod range;
pub mod thrash;
