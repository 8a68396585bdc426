// SPDX-License-Identifier: GPL-2.0
/*
 * C side of gmem.ko: exports the Rust core's C-ABI functions (include/linux/gmem.h) to other
 * modules, and records the C layout of the kernel and ABI structs the Rust code relies on,
 * so that gmem/layout.rs can compare it with bindgen's view at load time.
 * This file has no module_init: the module's entry points are in gmem_main.rs.
 */
#include <linux/export.h>
#include <linux/module.h>
#include <linux/fs.h>
#include <linux/gfp.h>
#include <linux/mm.h>
#include <linux/mm_types.h>
#include <linux/sched.h>
#include <linux/workqueue.h>
#include <linux/gmem.h>

/* mm_alloc() is exported for KUnit only; the region tests build a space on a fresh mm. */
MODULE_IMPORT_NS("EXPORTED_FOR_KUNIT_TESTING");

EXPORT_SYMBOL_GPL(gmem_dev_register);
EXPORT_SYMBOL_GPL(gmem_dev_unregister);
EXPORT_SYMBOL_GPL(gmem_dev_id);
EXPORT_SYMBOL_GPL(gmem_space_get_current);
EXPORT_SYMBOL_GPL(gmem_space_put);
EXPORT_SYMBOL_GPL(gmem_space_ctx);
EXPORT_SYMBOL_GPL(gmem_dev_fault);

/*
 * gmem's own workqueue (async prefetch fences, pre-eviction, background write-back):
 * destroy_workqueue() at module exit drains it, so no work item can run module code after
 * the module is gone. alloc_workqueue() is a macro, hence this wrapper.
 */
struct workqueue_struct *gmem_wq_alloc(void);
struct workqueue_struct *gmem_wq_alloc(void)
{
	return alloc_workqueue("gmem", WQ_UNBOUND | WQ_MEM_RECLAIM, 0);
}

/*
 * Host pages backing GMEM memory: charged to the caller's memory cgroup, and allowed to
 * fail (no OOM kill) so that the access needing the page can fail cleanly (host_page.rs).
 */
struct page *gmem_host_page_alloc(bool zero);
struct page *gmem_host_page_alloc(bool zero)
{
	return alloc_page(GFP_HIGHUSER | __GFP_ACCOUNT | __GFP_RETRY_MAYFAIL | __GFP_NOWARN |
			  (zero ? __GFP_ZERO : 0));
}

/* Kernel structs, in the order of KERNEL_LAYOUT in gmem/layout.rs. */
const unsigned long gmem_c_kernel_layout[] = {
	sizeof(struct task_struct),
	offsetof(struct task_struct, mm),
	sizeof(struct mm_struct),
	sizeof(struct vm_area_struct),
	offsetof(struct vm_area_struct, vm_mm),
	offsetof(struct vm_area_struct, vm_ops),
	offsetof(struct vm_area_struct, vm_private_data),
	offsetof(struct vm_area_struct, vm_file),
	sizeof(struct vm_operations_struct),
	offsetof(struct vm_operations_struct, fault),
	offsetof(struct vm_operations_struct, close),
	sizeof(struct vm_fault),
	offsetof(struct vm_fault, page),
	offsetof(struct file, private_data),
};
const unsigned long gmem_c_kernel_layout_len = ARRAY_SIZE(gmem_c_kernel_layout);

/* GMEM driver ABI, in the order of ABI_LAYOUT in include/rust/gmem_abi.rs. */
const unsigned long gmem_c_abi_layout[] = {
	sizeof(struct gmem_pte),
	offsetof(struct gmem_pte, prot),
	sizeof(struct gmem_copy),
	offsetof(struct gmem_copy, peer_frame),
	sizeof(struct gmem_dev_ops),
	offsetof(struct gmem_dev_ops, copy),
	offsetof(struct gmem_dev_ops, frame_page),
	offsetof(struct gmem_dev_ops, test_clear_accessed),
	sizeof(struct gmem_dev_props),
	offsetof(struct gmem_dev_props, drv),
};
const unsigned long gmem_c_abi_layout_len = ARRAY_SIZE(gmem_c_abi_layout);
