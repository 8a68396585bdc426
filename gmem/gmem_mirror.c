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
 *   VM_MIXEDMAP (GMEM regions are VM_MIXEDMAP; their pages are the core's, never mirrored),
 *   not memfd_secret memory (which get_user_pages refuses too: its pages leave the kernel's
 *   direct map), and for writes not a shadow stack.
 */
#include <linux/fs.h>
#include <linux/hmm.h>
#include <linux/jiffies.h>
#include <linux/magic.h>
#include <linux/memory_hotplug.h>
#include <linux/mm.h>
#include <linux/mmu_notifier.h>
#include <linux/oom.h>
#include <linux/sched/mm.h>
#include <linux/slab.h>

/* gmem/exec/mirror.rs: drops the device entries of [start, end); false to refuse. */
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

struct gmem_mirror *gmem_mirror_new(struct mm_struct *mm, void *owner, unsigned long start,
				    unsigned long length);
/*
 * A notifier over [@start, @start + @length) of @mm, reporting to @owner. Process
 * context, no mmap lock held (the first registration on @mm takes it). An ERR_PTR on
 * failure.
 */
struct gmem_mirror *gmem_mirror_new(struct mm_struct *mm, void *owner, unsigned long start,
				    unsigned long length)
{
	struct gmem_mirror *m;
	int ret;

	if (!length || !PAGE_ALIGNED(start) || !PAGE_ALIGNED(length) || start + length < start)
		return ERR_PTR(-EINVAL);
	m = kzalloc(sizeof(*m), GFP_KERNEL_ACCOUNT);
	if (!m)
		return ERR_PTR(-ENOMEM);
	m->owner = owner;
	ret = mmu_interval_notifier_insert(&m->notifier, mm, start, length, &gmem_mirror_ops);
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

/* gmem/exec/mirror.rs: the process is unmapping [start, end); the space forgets them. */
void gmem_space_unmapped(void *owner, unsigned long start, unsigned long end);

/*
 * The unmap watch of a space: one (plain) MMU notifier over the whole address space,
 * registered on the first advice on ordinary memory, that tells the space which addresses
 * the process unmaps (munmap, mremap moving them; MMU_NOTIFY_UNMAP), so that their advice
 * and thrashing history go with them. Every other invalidation returns at once. An exiting
 * process's notifiers are released before its address space is unmapped, and the space
 * goes with the process.
 */
struct gmem_unmap_watch {
	struct mmu_notifier mn;
	void *owner;
};

static int gmem_unmap_watch_start(struct mmu_notifier *mn, const struct mmu_notifier_range *range)
{
	struct gmem_unmap_watch *w = container_of(mn, struct gmem_unmap_watch, mn);

	/*
	 * An unmap holds the mmap lock and may sleep (the OOM reaper, which may not, only
	 * clears: the check is defensive).
	 */
	if (range->event == MMU_NOTIFY_UNMAP && mmu_notifier_range_blockable(range) &&
	    range->end > range->start)
		gmem_space_unmapped(w->owner, range->start, range->end);
	return 0;
}

static const struct mmu_notifier_ops gmem_unmap_watch_ops = {
	.invalidate_range_start = gmem_unmap_watch_start,
};

struct gmem_unmap_watch *gmem_unmap_watch_new(struct mm_struct *mm, void *owner);
/*
 * Registers the unmap watch of @mm for @owner (the space). Process context, no mmap lock
 * held (registration takes it), a user reference on @mm. An ERR_PTR on failure.
 */
struct gmem_unmap_watch *gmem_unmap_watch_new(struct mm_struct *mm, void *owner)
{
	struct gmem_unmap_watch *w;
	int ret;

	w = kzalloc(sizeof(*w), GFP_KERNEL_ACCOUNT);
	if (!w)
		return ERR_PTR(-ENOMEM);
	w->owner = owner;
	w->mn.ops = &gmem_unmap_watch_ops;
	ret = mmu_notifier_register(&w->mn, mm);
	if (ret) {
		kfree(w);
		return ERR_PTR(ret);
	}
	return w;
}

void gmem_unmap_watch_free(struct gmem_unmap_watch *w);
/* Unregisters and frees: waits for running callbacks; none runs afterwards. May sleep. */
void gmem_unmap_watch_free(struct gmem_unmap_watch *w)
{
	mmu_notifier_unregister(&w->mn, w->mn.mm);
	kfree(w);
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

int gmem_mirror_vma_home_ok(struct vm_area_struct *vma);
/*
 * 0 if pages of @vma on a device may be moved back to host memory (gmem_dpriv.c), else
 * -EFAULT. A move home grants no access, so unlike gmem_mirror_vma_ok() this does not ask
 * for VM_READ: pages that moved before an mprotect(PROT_NONE) come home too.
 */
int gmem_mirror_vma_home_ok(struct vm_area_struct *vma)
{
	return !vma || (vma->vm_flags & GMEM_MIRROR_NOT_MIRRORED) ? -EFAULT : 0;
}

int gmem_mirror_vma_ok(struct vm_area_struct *vma, bool write);
/* 0 if gmem may mirror @vma for this access, else the errno of the fault (also gmem_dpriv.c). */
int gmem_mirror_vma_ok(struct vm_area_struct *vma, bool write)
{
	if (!vma || (vma->vm_flags & GMEM_MIRROR_NOT_MIRRORED) || !(vma->vm_flags & VM_READ))
		return -EFAULT;
	/* memfd_secret: recognised by its file system (vma_is_secretmem() is not exported). */
	if (vma->vm_file && file_inode(vma->vm_file)->i_sb->s_magic == SECRETMEM_MAGIC)
		return -EFAULT;
	if (write && (vma->vm_flags & VM_SHADOW_STACK))
		return -EPERM;
	return 0;
}

/* hmm_range_fault() of pages [@lo, @hi) of the block at @start, under the mmap lock. */
static int gmem_mirror_walk(struct hmm_range *range, unsigned long start, unsigned long *pfns,
			    unsigned long lo, unsigned long hi)
{
	range->start = start + (lo << PAGE_SHIFT);
	range->end = start + (hi << PAGE_SHIFT);
	range->hmm_pfns = pfns + lo;
	return hmm_range_fault(range);
}

int gmem_mirror_check(struct mm_struct *mm, unsigned long addr, bool write, bool home);
/*
 * 0 if @addr lies in a VMA of @mm that gmem mirrors for this access (@home: a move of its
 * pages back to host memory, gmem_mirror_vma_home_ok()), else the errno a fault there gets.
 * Takes the mmap read lock; the caller holds a user reference on @mm.
 */
int gmem_mirror_check(struct mm_struct *mm, unsigned long addr, bool write, bool home)
{
	struct vm_area_struct *vma;
	int ret;

	if (addr >= mm->task_size)
		return -EFAULT;
	ret = mmap_read_lock_killable(mm);
	if (ret)
		return ret;
	vma = vma_lookup(mm, addr);
	ret = home ? gmem_mirror_vma_home_ok(vma) : gmem_mirror_vma_ok(vma, write);
	mmap_read_unlock(mm);
	return ret;
}

bool gmem_mirror_next_mapped(struct mm_struct *mm, unsigned long addr, unsigned long end,
			     unsigned long *lo, unsigned long *hi);
/*
 * The first part of [@addr, @end) that a VMA of @mm maps, as [@lo, @hi): false if none does.
 * The caller holds the mmap lock.
 */
bool gmem_mirror_next_mapped(struct mm_struct *mm, unsigned long addr, unsigned long end,
			     unsigned long *lo, unsigned long *hi)
{
	struct vm_area_struct *vma;

	mmap_assert_locked(mm);
	if (addr >= end)
		return false;
	vma = find_vma(mm, addr);
	if (!vma || vma->vm_start >= end)
		return false;
	*lo = max(addr, vma->vm_start);
	*hi = min(end, vma->vm_end);
	return true;
}

int gmem_mirror_fault(struct gmem_mirror *m, void *owner, unsigned long start, const u8 *req,
		      unsigned long npages, unsigned long *pfns, unsigned long *first, unsigned long *count,
		      unsigned long *seq);
/*
 * Snapshots the pages of [@start, @start + @npages pages) that lie in the VMA of the first
 * requested page, faulting in the requested ones (and only those) as a CPU access would. @req[i] is 0 (look,
 * do not fault), 1 (fault for reading), 2 (fault for writing) or 3 (look, but start the walk
 * here if it is the first nonzero one); at least one is nonzero.
 * Device-private pages of @owner (a device's pagemap, gmem_dpriv.c, or NULL) are reported
 * as they are (gmem_dpriv_frame() decodes them); other device-private pages are faulted
 * back to host memory if requested, else reported absent.
 * On 0, pages [@first, @first + @count) of the range were walked: @pfns[i] holds their
 * HMM pfns (see gmem_mirror_page()), the others 0, and @seq the notifier sequence that a
 * later gmem_mirror_retry() validates. No mmap lock held on entry or return.
 *
 * Errors: -EFAULT no VMA, one gmem does not mirror, or the address space is going away;
 * -EPERM a write to a read-only mapping or a shadow stack; -EBUSY invalidations kept racing for a second;
 * -EINTR a fatal signal; -ENOMEM.
 */
int gmem_mirror_fault(struct gmem_mirror *m, void *owner, unsigned long start, const u8 *req,
		      unsigned long npages, unsigned long *pfns, unsigned long *first, unsigned long *count,
		      unsigned long *seq)
{
	struct mm_struct *mm = m->notifier.mm;
	unsigned long deadline = jiffies + msecs_to_jiffies(HMM_RANGE_DEFAULT_TIMEOUT);
	unsigned long i, lo, hi, want, reached = 0;
	bool write = false;
	struct vm_area_struct *vma;
	struct hmm_range range = {
		.notifier = &m->notifier,
		.pfn_flags_mask = HMM_PFN_REQ_FAULT | HMM_PFN_REQ_WRITE,
		.dev_private_owner = owner,
	};
	int ret;

	for (want = 0; want < npages && !req[want]; want++)
		;
	if (want == npages || !PAGE_ALIGNED(start))
		return -EINVAL;
	/*
	 * The first requested page above user space: no VMA there. (The mm's own limit:
	 * TASK_SIZE would be the calling task's, and any task may report a device fault.) The
	 * rest of the block may reach past it; the VMA clips the walk.
	 */
	if (npages > (ULONG_MAX - start) >> PAGE_SHIFT ||
	    start + (want << PAGE_SHIFT) >= mm->task_size)
		return -EFAULT;
	for (i = 0; i < npages; i++)
		write |= req[i] == 2;
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
		ret = gmem_mirror_vma_ok(vma, write);
		if (ret) {
			mmap_read_unlock(mm);
			return ret;
		}
		lo = vma->vm_start > start ? (vma->vm_start - start) >> PAGE_SHIFT : 0;
		hi = min(npages, (vma->vm_end - start) >> PAGE_SHIFT);
		/* First look at the whole clip, faulting nothing... */
		memset(pfns, 0, npages * sizeof(*pfns));
		ret = gmem_mirror_walk(&range, start, pfns, lo, hi);
		/*
		 * ...then fault in each run of requested pages on its own: hmm_range_fault()
		 * faults every page from the first one that needs it to the end of the range it
		 * walks, which over the clip would populate pages the device never touched.
		 */
		for (i = lo; i < hi && !ret; ) {
			unsigned long j = i;

			while (j < hi && (req[j] == 1 || req[j] == 2)) {
				pfns[j] = req[j] == 1 ? HMM_PFN_REQ_FAULT :
					  HMM_PFN_REQ_FAULT | HMM_PFN_REQ_WRITE;
				j++;
			}
			if (j > i)
				ret = gmem_mirror_walk(&range, start, pfns, i, j);
			i = j > i ? j : i + 1;
		}
		mmap_read_unlock(mm);
		if (ret == -EBUSY) {
			/*
			 * A run's fault (a COW break, say) made the next run's walk stale. The
			 * retry gets at least one run further (the faulted ones are present now):
			 * progress, so the time limit starts again.
			 */
			if (i > reached) {
				reached = i;
				deadline = jiffies + msecs_to_jiffies(HMM_RANGE_DEFAULT_TIMEOUT);
			}
			continue;
		}
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
 * present, error, or device memory). *@writable: the CPU mapping allows writes.
 * pfn_to_online_page() looks at the pfn's memory section first, and is NULL for device
 * memory (ZONE_DEVICE, device-private pages included) except in a section shared with
 * online memory while its pagemap is being torn down; a page it returns has a struct page
 * in place, whose zone is then checked too. The page is valid to use only under the Rust
 * mirror lock with the snapshot's sequence still current.
 */
struct page *gmem_mirror_page(unsigned long hmm_pfn, bool *writable)
{
	struct page *p;

	if (!(hmm_pfn & HMM_PFN_VALID) || (hmm_pfn & HMM_PFN_ERROR))
		return NULL;
	p = pfn_to_online_page(page_to_pfn(hmm_pfn_to_page(hmm_pfn)));
	if (!p || is_zone_device_page(p))
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

bool gmem_mirror_page_file(unsigned long hmm_pfn);
/*
 * Whether an HMM pfn names a host page that is not anonymous (a page-cache or shmem page:
 * one that can never move to a device). Reads the flags of the page's folio without
 * holding it: a hint for policy only. The page is of online memory (gmem_mirror_page),
 * whose struct pages go only when the memory is offlined and removed: a read racing with
 * that is the race every pfn walker of pfn_to_online_page() accepts.
 */
bool gmem_mirror_page_file(unsigned long hmm_pfn)
{
	bool writable;
	struct page *p = gmem_mirror_page(hmm_pfn, &writable);

	return p && !folio_test_anon(page_folio(p));
}
