// SPDX-License-Identifier: GPL-2.0
/*
 * C side of gmem.ko: exports the Rust core's C-ABI functions (include/linux/gmem.h) to other
 * modules, and records the C layout of the kernel and ABI structs the Rust code relies on,
 * so that gmem/entry/layout.rs can compare it with bindgen's view at load time.
 * This file has no module_init: the module's entry points are in gmem_main.rs.
 */
#include <linux/export.h>
#include <linux/module.h>
#include <linux/fs.h>
#include <linux/gfp.h>
#include <linux/mm.h>
#include <linux/mm_types.h>
#include <linux/overflow.h>
#include <linux/slab.h>
#include <linux/capability.h>
#include <linux/memcontrol.h>
#include <linux/sched/signal.h>
#include <linux/sched.h>
#include <linux/sched/mm.h>
#include <linux/sched/signal.h>
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
EXPORT_SYMBOL_GPL(gmem_fence_signal);
EXPORT_SYMBOL_GPL(gmem_fence_expect);
EXPORT_SYMBOL_GPL(gmem_dev_set_links);

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
 * How many users @mm's address space has (space.rs, mm_user_while_used): the caller holds
 * a reference on the struct. A racy snapshot, as any read of it is.
 */
int gmem_mm_users(struct mm_struct *mm);
int gmem_mm_users(struct mm_struct *mm)
{
	return atomic_read(&mm->mm_users);
}

/*
 * Host pages backing GMEM memory: charged to the memory cgroup of @mm (the process whose
 * data the page holds, whichever task allocates it: a fault of another process evicting,
 * a worker, an unregistering driver), and allowed to fail (no OOM kill) so that the access
 * needing the page can fail cleanly (host_page.rs). @mm must be kept alive by the caller
 * (mmgrab); its owner may have exited (then the root cgroup is charged).
 */
struct page *gmem_host_page_alloc(struct mm_struct *mm, bool zero);
struct page *gmem_host_page_alloc(struct mm_struct *mm, bool zero)
{
	gfp_t gfp = GFP_HIGHUSER | __GFP_ACCOUNT | __GFP_RETRY_MAYFAIL | __GFP_NOWARN |
		    (zero ? __GFP_ZERO : 0);
	struct mem_cgroup *memcg, *old;
	struct page *page;

	/* The common case, a process faulting its own pages, needs no remote charge. */
	if (mm == current->mm)
		return alloc_page(gfp);
	memcg = get_mem_cgroup_from_mm(mm);
	old = set_active_memcg(memcg);
	page = alloc_page(gfp);
	set_active_memcg(old);
	mem_cgroup_put(memcg);
	return page;
}

/*
 * Per-page metadata of a region (meta.rs): its size is chosen by the user, so it must fail
 * cleanly. Requests above a quarter of the memory available are refused outright (filling the
 * machine transiently would make *other* tasks' allocations invoke the OOM killer); the
 * rest may reclaim but never OOM-kill, are charged to the caller's memory cgroup, and fail
 * when the caller gets a fatal signal (vmalloc checks for one).
 */
void *gmem_meta_alloc(size_t n, size_t size);
void *gmem_meta_alloc(size_t n, size_t size)
{
	size_t bytes;

	if (check_mul_overflow(n, size, &bytes))
		return NULL;
	if ((long)(bytes >> PAGE_SHIFT) > si_mem_available() / 4)
		return NULL;
	return kvcalloc(n, size, GFP_KERNEL_ACCOUNT | __GFP_RETRY_MAYFAIL | __GFP_NOWARN);
}

/*
 * PIN quota (pin_quota.rs): pinned pages count in mm->pinned_vm against the caller's
 * RLIMIT_MEMLOCK, unless it has CAP_IPC_LOCK (as ib_umem_get() does for RDMA pins).
 */
bool gmem_pin_charge(struct mm_struct *mm, u64 npages);
bool gmem_pin_charge(struct mm_struct *mm, u64 npages)
{
	unsigned long limit = rlimit(RLIMIT_MEMLOCK) >> PAGE_SHIFT;
	s64 now = atomic64_add_return(npages, &mm->pinned_vm);

	if (now > 0 && (u64)now > limit && !capable(CAP_IPC_LOCK)) {
		atomic64_sub(npages, &mm->pinned_vm);
		return false;
	}
	return true;
}

void gmem_pin_uncharge(struct mm_struct *mm, u64 npages);
void gmem_pin_uncharge(struct mm_struct *mm, u64 npages)
{
	atomic64_sub(npages, &mm->pinned_vm);
}

/* cond_resched() and fatal_signal_pending() are macros / inlines (sched.rs). */
void gmem_cond_resched(void);
void gmem_cond_resched(void)
{
	cond_resched();
}

bool gmem_fatal_signal_pending(void);
bool gmem_fatal_signal_pending(void)
{
	return fatal_signal_pending(current);
}

/* Kernel structs, in the order of KERNEL_LAYOUT in gmem/entry/layout.rs. */
const unsigned long gmem_c_kernel_layout[] = {
	sizeof(struct task_struct),
	offsetof(struct task_struct, mm),
	sizeof(struct mm_struct),
	sizeof(struct vm_area_struct),
	offsetof(struct vm_area_struct, vm_mm),
	offsetof(struct vm_area_struct, vm_ops),
	offsetof(struct vm_area_struct, vm_private_data),
	offsetof(struct vm_area_struct, vm_pgoff),
	sizeof(struct vm_operations_struct),
	offsetof(struct vm_operations_struct, open),
	offsetof(struct vm_operations_struct, close),
	offsetof(struct vm_operations_struct, may_split),
	offsetof(struct vm_operations_struct, mremap),
	offsetof(struct vm_operations_struct, fault),
	offsetof(struct vm_operations_struct, access),
	sizeof(struct vm_fault),
	offsetof(struct vm_fault, vma),
	offsetof(struct vm_fault, address),
	offsetof(struct vm_fault, flags),
	offsetof(struct file, private_data),
	sizeof(struct file),
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
	offsetof(struct gmem_dev_props, caps),
	offsetof(struct gmem_pte, flags),
	offsetof(struct gmem_dev_ops, copy_async),
	offsetof(struct gmem_dev_props, nr_channels),
	offsetof(struct gmem_dev_ops, map_prepare),
	offsetof(struct gmem_dev_ops, test_clear_accessed_range),
	offsetof(struct gmem_dev_ops, copy_poll),
};
const unsigned long gmem_c_abi_layout_len = ARRAY_SIZE(gmem_c_abi_layout);
