// SPDX-License-Identifier: GPL-2.0
/*
 * C side of gmem's mirror of ordinary process memory (gmem/obj/mirror.rs): one MMU
 * interval notifier per space over the whole address space, and hmm_range_fault() on a
 * range of it. The Rust side owns the lock that orders device mappings against
 * invalidations and the record of what devices map; this file only wraps what bindgen
 * cannot reach (inline functions, the notifier's embedded struct, the HMM pfn encoding).
 *
 * Invariants the Rust side relies on:
 * - gmem_mirror_new() returns an object whose notifier is registered on @mm until
 *   gmem_mirror_free(); the invalidate callback then runs gmem_mirror_invalidate() with the
 *   @owner given at creation, and never after gmem_mirror_free() returned.
 * - gmem_mirror_fault() walks only a VMA gmem may mirror: readable, not VM_IO, VM_PFNMAP or
 *   VM_MIXEDMAP (GMEM regions are VM_MIXEDMAP; their pages are the core's, never mirrored).
 */
#include <linux/hmm.h>
#include <linux/jiffies.h>
#include <linux/mm.h>
#include <linux/mmu_notifier.h>
#include <linux/oom.h>
#include <linux/sched/mm.h>
#include <linux/slab.h>

/* gmem/obj/mirror.rs: drops the device entries of [start, end); false to refuse. */
bool gmem_mirror_invalidate(void *owner, struct mmu_interval_notifier *mni, unsigned long start,
			    unsigned long end, bool blockable, unsigned long cur_seq);

struct gmem_mirror {
	struct mmu_interval_notifier notifier;
	void *owner;
};

static bool gmem_mirror_cb(struct mmu_interval_notifier *mni, const struct mmu_notifier_range *range,
			   unsigned long cur_seq)
{
	struct gmem_mirror *m = container_of(mni, struct gmem_mirror, notifier);

	return gmem_mirror_invalidate(m->owner, mni, range->start, range->end,
				      mmu_notifier_range_blockable(range), cur_seq);
}

static const struct mmu_interval_notifier_ops gmem_mirror_ops = {
	.invalidate = gmem_mirror_cb,
};

struct gmem_mirror *gmem_mirror_new(struct mm_struct *mm, void *owner);
/*
 * A notifier over all of @mm's user addresses, reporting to @owner. Process context, no
 * mmap lock held (registration takes it). NULL or an ERR_PTR on failure.
 */
struct gmem_mirror *gmem_mirror_new(struct mm_struct *mm, void *owner)
{
	struct gmem_mirror *m = kzalloc(sizeof(*m), GFP_KERNEL_ACCOUNT);
	int ret;

	if (!m)
		return ERR_PTR(-ENOMEM);
	m->owner = owner;
	ret = mmu_interval_notifier_insert(&m->notifier, mm, 0, TASK_SIZE, &gmem_mirror_ops);
	if (ret) {
		kfree(m);
		return ERR_PTR(ret);
	}
	return m;
}

void gmem_mirror_free(struct gmem_mirror *m);
/* Unregisters and frees: waits for running callbacks; none runs afterwards. May sleep. */
void gmem_mirror_free(struct gmem_mirror *m)
{
	mmu_interval_notifier_remove(&m->notifier);
	kfree(m);
}

void gmem_mirror_set_seq(struct mmu_interval_notifier *mni, unsigned long cur_seq);
/* mmu_interval_set_seq(), for the invalidate callback, under the Rust mirror lock. */
void gmem_mirror_set_seq(struct mmu_interval_notifier *mni, unsigned long cur_seq)
{
	mmu_interval_set_seq(mni, cur_seq);
}

bool gmem_mirror_retry(struct gmem_mirror *m, unsigned long seq);
/* mmu_interval_read_retry(), under the Rust mirror lock: true if @seq went stale. */
bool gmem_mirror_retry(struct gmem_mirror *m, unsigned long seq)
{
	return mmu_interval_read_retry(&m->notifier, seq);
}

#define GMEM_MIRROR_NOT_MIRRORED (VM_IO | VM_PFNMAP | VM_MIXEDMAP)

int gmem_mirror_fault(struct gmem_mirror *m, unsigned long start, const u8 *req, unsigned long npages,
		      unsigned long *pfns, unsigned long *first, unsigned long *count, unsigned long *seq);
/*
 * Snapshots the pages of [@start, @start + @npages pages) that lie in the VMA of the first
 * requested page, faulting in the requested ones as a CPU access would. @req[i] is 0 (look,
 * do not fault), 1 (fault for reading) or 2 (fault for writing); at least one is nonzero.
 * On 0, pages [@first, @first + @count) of the range were walked: @pfns[i] holds their
 * HMM pfns (see gmem_mirror_page()), the others 0, and @seq the notifier sequence that a
 * later gmem_mirror_retry() validates. No mmap lock held on entry or return.
 *
 * Errors: -EFAULT no VMA, one gmem does not mirror, or the address space is going away;
 * -EPERM a write to a read-only mapping; -EBUSY invalidations kept racing for a second;
 * -EINTR a fatal signal; -ENOMEM.
 */
int gmem_mirror_fault(struct gmem_mirror *m, unsigned long start, const u8 *req, unsigned long npages,
		      unsigned long *pfns, unsigned long *first, unsigned long *count, unsigned long *seq)
{
	struct mm_struct *mm = m->notifier.mm;
	unsigned long deadline = jiffies + msecs_to_jiffies(HMM_RANGE_DEFAULT_TIMEOUT);
	unsigned long i, lo, hi, want;
	struct vm_area_struct *vma;
	struct hmm_range range = {
		.notifier = &m->notifier,
		.pfn_flags_mask = HMM_PFN_REQ_FAULT | HMM_PFN_REQ_WRITE,
	};
	int ret;

	for (want = 0; want < npages && !req[want]; want++)
		;
	if (want == npages || !PAGE_ALIGNED(start))
		return -EINVAL;
	/* Above user space: no VMA there, whatever the range. */
	if (start >= TASK_SIZE || (TASK_SIZE - start) >> PAGE_SHIFT < npages)
		return -EFAULT;
	for (;;) {
		if (time_after(jiffies, deadline))
			return -EBUSY;
		range.notifier_seq = mmu_interval_read_begin(&m->notifier);
		ret = mmap_read_lock_killable(mm);
		if (ret)
			return ret;
		if (check_stable_address_space(mm)) {
			mmap_read_unlock(mm);
			return -EFAULT;
		}
		vma = vma_lookup(mm, start + (want << PAGE_SHIFT));
		if (!vma || (vma->vm_flags & GMEM_MIRROR_NOT_MIRRORED) || !(vma->vm_flags & VM_READ)) {
			mmap_read_unlock(mm);
			return -EFAULT;
		}
		lo = vma->vm_start > start ? (vma->vm_start - start) >> PAGE_SHIFT : 0;
		hi = min(npages, (vma->vm_end - start) >> PAGE_SHIFT);
		memset(pfns, 0, npages * sizeof(*pfns));
		for (i = lo; i < hi; i++)
			pfns[i] = !req[i] ? 0 : req[i] == 1 ? HMM_PFN_REQ_FAULT :
				  HMM_PFN_REQ_FAULT | HMM_PFN_REQ_WRITE;
		range.start = start + (lo << PAGE_SHIFT);
		range.end = start + (hi << PAGE_SHIFT);
		range.hmm_pfns = pfns + lo;
		ret = hmm_range_fault(&range);
		mmap_read_unlock(mm);
		if (ret == -EBUSY)
			continue;
		if (ret)
			return ret;
		*first = lo;
		*count = hi - lo;
		*seq = range.notifier_seq;
		return 0;
	}
}

struct page *gmem_mirror_page(unsigned long hmm_pfn, bool *writable);
/*
 * The page an HMM pfn of gmem_mirror_fault() names, or NULL if it names none (not
 * present, error, or a device-private page). *@writable: the CPU mapping allows writes.
 * Valid to use only under the Rust mirror lock with the snapshot's sequence still current.
 */
struct page *gmem_mirror_page(unsigned long hmm_pfn, bool *writable)
{
	struct page *p;

	if (!(hmm_pfn & HMM_PFN_VALID) || (hmm_pfn & HMM_PFN_ERROR))
		return NULL;
	p = hmm_pfn_to_page(hmm_pfn);
	if (is_zone_device_page(p))
		return NULL;
	*writable = !!(hmm_pfn & HMM_PFN_WRITE);
	return p;
}

void gmem_mirror_dirty(struct page *page);
/*
 * Marks the folio of @page dirty: a device got a writable mapping of it, and device writes
 * do not set the CPU's dirty bit. @page is mapped by the process (the caller holds the
 * mirror lock with a current sequence), which keeps its mapping alive.
 */
void gmem_mirror_dirty(struct page *page)
{
	folio_mark_dirty(page_folio(page));
}
