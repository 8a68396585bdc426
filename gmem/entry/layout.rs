// SPDX-License-Identifier: GPL-2.0
//! Load-time self-check: bindgen's struct layouts (and our hand-written ABI mirror) against
//! the C compiler's.
//!
//! Why: with `CONFIG_SCHEDSTATS=n`, bindgen dropped the alignment of an empty struct and
//! Rust's `task_struct` silently disagreed with C (`mm` at 864 instead of 912). Every offset
//! the module relies on is compared here; a mismatch refuses the module load with a loud
//! error instead of corrupting memory later.

use crate::abi;
use core::mem::{offset_of, size_of};
use kernel::{bindings, prelude::*};

extern "C" {
    static gmem_c_kernel_layout: [usize; KERNEL_LAYOUT.len()];
    static gmem_c_kernel_layout_len: usize;
    static gmem_c_abi_layout: [usize; abi::ABI_LAYOUT.len()];
    static gmem_c_abi_layout_len: usize;
}

const KERNEL_NAMES: [&str; 21] = [
    "sizeof(task_struct)",
    "task_struct.mm",
    "sizeof(mm_struct)",
    "sizeof(vm_area_struct)",
    "vm_area_struct.vm_mm",
    "vm_area_struct.vm_ops",
    "vm_area_struct.vm_private_data",
    "vm_area_struct.vm_pgoff",
    "sizeof(vm_operations_struct)",
    "vm_operations_struct.open",
    "vm_operations_struct.close",
    "vm_operations_struct.may_split",
    "vm_operations_struct.mremap",
    "vm_operations_struct.fault",
    "vm_operations_struct.access",
    "sizeof(vm_fault)",
    "vm_fault.vma",
    "vm_fault.address",
    "vm_fault.flags",
    "file.private_data",
    "sizeof(file)",
];

/// Rust's view, in the order of `gmem_c_kernel_layout[]` in gmem_export.c. Every field the
/// module reads or writes through bindgen's structs is here (the miscdevice abstraction
/// compiled into this module reads `file.private_data`); fields nobody uses are not.
const KERNEL_LAYOUT: [usize; 21] = [
    size_of::<bindings::task_struct>(),
    offset_of!(bindings::task_struct, mm),
    size_of::<bindings::mm_struct>(),
    size_of::<bindings::vm_area_struct>(),
    offset_of!(bindings::vm_area_struct, vm_mm),
    offset_of!(bindings::vm_area_struct, vm_ops),
    offset_of!(bindings::vm_area_struct, vm_private_data),
    offset_of!(bindings::vm_area_struct, vm_pgoff),
    size_of::<bindings::vm_operations_struct>(),
    offset_of!(bindings::vm_operations_struct, open),
    offset_of!(bindings::vm_operations_struct, close),
    offset_of!(bindings::vm_operations_struct, may_split),
    offset_of!(bindings::vm_operations_struct, mremap),
    offset_of!(bindings::vm_operations_struct, fault),
    offset_of!(bindings::vm_operations_struct, access),
    size_of::<bindings::vm_fault>(),
    offset_of!(bindings::vm_fault, __bindgen_anon_1) + offset_of!(bindings::vm_fault__bindgen_ty_1, vma),
    offset_of!(bindings::vm_fault, __bindgen_anon_1) + offset_of!(bindings::vm_fault__bindgen_ty_1, address),
    offset_of!(bindings::vm_fault, flags),
    offset_of!(bindings::file, private_data),
    size_of::<bindings::file>(),
];

/// Compares one table; returns the number of mismatches (each is logged).
fn compare(what: &str, rust: &[usize], c: &[usize], names: Option<&[&str]>) -> usize {
    let mut bad = 0;
    if rust.len() != c.len() {
        pr_err!("gmem: layout table {} has {} entries in Rust, {} in C\n", what, rust.len(), c.len());
        return 1;
    }
    for (i, (r, c)) in rust.iter().zip(c.iter()).enumerate() {
        if r != c {
            let name = names.and_then(|n| n.get(i)).copied().unwrap_or("?");
            pr_err!("gmem: LAYOUT MISMATCH {}[{}] {}: rust {} != C {}\n", what, i, name, r, c);
            bad += 1;
        }
    }
    bad
}

/// Number of mismatching entries over both tables (0 = the module may run).
pub(crate) fn mismatches() -> usize {
    // SAFETY: the C tables are immutable arrays defined in gmem_export.c with the lengths
    // given by their `_len` companions, which `compare` checks before indexing; the Rust
    // declarations use the same element type (unsigned long == usize on Linux).
    let (kl, kn, al, an) =
        unsafe { (&gmem_c_kernel_layout, gmem_c_kernel_layout_len, &gmem_c_abi_layout, gmem_c_abi_layout_len) };
    let k = compare("kernel", &KERNEL_LAYOUT, &kl[..kn.min(kl.len())], Some(&KERNEL_NAMES));
    let k = k + usize::from(kn != KERNEL_LAYOUT.len());
    let a = compare("abi", &abi::ABI_LAYOUT, &al[..an.min(al.len())], None);
    k + a + usize::from(an != abi::ABI_LAYOUT.len())
}

/// Refuses the module load on any mismatch.
pub(crate) fn check() -> Result {
    match mismatches() {
        0 => Ok(()),
        n => {
            pr_err!("gmem: {} struct layout mismatch(es) between bindgen and C: refusing to load\n", n);
            Err(EINVAL)
        }
    }
}

#[kunit_tests(gmem_layout)]
mod tests {
    use super::*;

    #[test]
    fn rust_and_c_layouts_agree() {
        assert_eq!(mismatches(), 0);
    }

    #[test]
    fn task_struct_mm_is_where_c_has_it() {
        // SAFETY: see `mismatches`.
        let c = unsafe { gmem_c_kernel_layout[1] };
        assert_eq!(offset_of!(bindings::task_struct, mm), c);
    }
}
