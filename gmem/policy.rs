// SPDX-License-Identifier: GPL-2.0
//! The pure policy code of `policy/` (`no_std`, host-tested by `cargo test`), compiled into
//! the module unchanged. The kernel glue applies its decisions; it decides nothing itself.

#[path = "../policy/src/batch.rs"]
pub(crate) mod batch;
#[path = "../policy/src/frames.rs"]
pub(crate) mod frames;
#[path = "../policy/src/page_state.rs"]
pub(crate) mod page_state;
#[path = "../policy/src/range.rs"]
pub(crate) mod range;
