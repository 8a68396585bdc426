// SPDX-License-Identifier: GPL-2.0
/*
 * C side of gmem's device-private memory (gmem/obj/dpriv.rs, gmem/exec/dpriv.rs): one
 * MEMORY_DEVICE_PRIVATE pagemap per device, whose struct page number k stands for frame k
 * of the device's pool, and the migrate_vma_*() / migrate_device_*() plumbing that moves
 * ordinary process memory into those frames and back. The Rust side owns the frames (it
 * allocates them from the pool every GMEM region uses, and does every copy through the
 * driver); this file only wraps what bindgen cannot reach (the embedded pagemap, the
 * migrate pfn encoding, inline page helpers) and the pagemap's two callbacks.
 *
 * Invariants the Rust side relies on:
 * - gmem_dpriv_new() returns a pagemap whose pages are all free; gmem_dpriv_bind() sets the
 *   owner the callbacks report to before any page is handed out, and gmem_dpriv_free()
 *   returns only once every page was freed (memunmap_pages() waits for that), so no
 *   callback runs after it.
 * - gmem_dpriv_released() is called once per page going free, possibly in atomic context
 *   (the last reference can be dropped under a page-table lock).
 * - gmem_dpriv_copy_back() is called in process context with the device pages it names
 *   locked and unmapped (they cannot be freed or change meanwhile).
 * - Between a successful gmem_dpriv_collect() and gmem_dpriv_commit(), the mmap read lock
 *   of the mm is held and the collected pages are locked and unmapped.
 */
#include <linux/hmm.h>
#include <linux/highmem.h>
#include <linux/ioport.h>
#include <linux/memremap.h>
#include <linux/migrate.h>
#include <linux/mm.h>
#include <linux/mmap_lock.h>
#include <linux/pagemap.h>
#include <linux/slab.h>

/* Pages of one migration batch: a 2 MiB block. */
#define GMEM_DPRIV_BATCH 512

/* gmem/exec/dpriv.rs */
void gmem_dpriv_released(const void *owner, unsigned long frame);
int gmem_dpriv_copy_back(const void *owner, const u64 *frames, struct page **pages, unsigned long n);
/* gmem/gmem_mirror.c */
int gmem_mirror_vma_ok(struct vm_area_struct *vma, bool write);
int gmem_mirror_vma_home_ok(struct vm_area_struct *vma);

struct gmem_dpriv {
	struct dev_pagemap pgmap;
	unsigned long base_pfn;
	unsigned long nframes;
	const void *owner;
};

static struct gmem_dpriv *gmem_dpriv_of(struct page *page)
{
	return container_of(page_pgmap(page), struct gmem_dpriv, pgmap);
}

static void gmem_dpriv_folio_free(struct folio *folio)
{
	struct gmem_dpriv *d = gmem_dpriv_of(&folio->page);

	gmem_dpriv_released(d->owner, folio_pfn(folio) - d->base_pfn);
}

/* Device pages selected in @src, and host pages for them: a back-migration batch. */
struct gmem_dpriv_back {
	unsigned long src[GMEM_DPRIV_BATCH];
	unsigned long dst[GMEM_DPRIV_BATCH];
	u64 frames[GMEM_DPRIV_BATCH];
	struct page *pages[GMEM_DPRIV_BATCH];
};

/*
 * Whether migrate_vma_setup() can move nothing of @vma to a device: it refuses hugetlb,
 * DAX and VM_SPECIAL mappings (-EINVAL), and shared mappings hold only file or shmem
 * pages, which it would collect and unmap only for the move to fail at the end. Their
 * pages stay on the host, mapped remotely.
 */
static bool gmem_dpriv_unmovable(struct vm_area_struct *vma)
{
	return is_vm_hugetlb_page(vma) || (vma->vm_flags & (VM_SPECIAL | VM_SHARED)) || vma_is_dax(vma);
}

/* How many pages of a migration moved: selected, given a destination, not refused. */
static long gmem_dpriv_moved(const unsigned long *src, const unsigned long *dst, unsigned long n)
{
	unsigned long i;
	long moved = 0;

	for (i = 0; i < n; i++)
		moved += dst[i] && (src[i] & MIGRATE_PFN_MIGRATE);
	return moved;
}

/*
 * Takes the mmap read lock of @mm and returns the VMA of @start if gmem mirrors it, with
 * *@end the end of [@start, @start + @npages pages) clipped to it; else an ERR_PTR (-EFAULT:
 * no such VMA) with the lock released. The caller holds a user reference on @mm. @home: for
 * a move back to host memory, which grants no access, the VMA need not be readable any
 * more (its pages may have moved to a device before an mprotect(PROT_NONE)).
 */
static struct vm_area_struct *gmem_dpriv_vma(struct mm_struct *mm, unsigned long start, unsigned long npages,
					     unsigned long *end, bool home)
{
	struct vm_area_struct *vma;
	int ret = mmap_read_lock_killable(mm);

	if (ret)
		return ERR_PTR(ret);
	vma = vma_lookup(mm, start);
	ret = home ? gmem_mirror_vma_home_ok(vma) : gmem_mirror_vma_ok(vma, false);
	if (ret) {
		mmap_read_unlock(mm);
		return ERR_PTR(ret);
	}
	*end = min(start + (npages << PAGE_SHIFT), vma->vm_end);
	return vma;
}

/* Whether the migration entry @src is a page of this device, selected to move. */
static bool gmem_dpriv_selected(struct gmem_dpriv *d, unsigned long src)
{
	struct page *sp = migrate_pfn_to_page(src);

	return sp && (src & MIGRATE_PFN_MIGRATE) && page_pgmap(sp) == &d->pgmap;
}

/*
 * Fills @b->dst[0..@n) for the device pages @b->src selects: a new locked host page each
 * (placed for @vma at @start + i pages if @vma is given; allocated with __GFP_NOFAIL if
 * @nofail), holding the frame's data copied by the driver. A page that gets no host page,
 * or whose copy failed, gets dst 0 and stays on the device. Returns how many were filled,
 * or the copy's negative errno if it failed (none is filled then).
 */
static long gmem_dpriv_fill_back(struct gmem_dpriv *d, struct gmem_dpriv_back *b, unsigned long n,
				 struct vm_area_struct *vma, unsigned long start, bool nofail)
{
	unsigned long i, k = 0;
	int err;

	for (i = 0; i < n; i++) {
		struct page *sp = migrate_pfn_to_page(b->src[i]);
		struct page *hp;

		b->dst[i] = 0;
		if (!gmem_dpriv_selected(d, b->src[i]))
			continue;
		hp = vma ? alloc_page_vma(GFP_HIGHUSER_MOVABLE, vma, start + (i << PAGE_SHIFT)) :
			   alloc_page(GFP_HIGHUSER_MOVABLE | (nofail ? __GFP_NOFAIL : 0));
		if (!hp)
			continue;
		lock_page(hp);
		b->dst[i] = migrate_pfn(page_to_pfn(hp));
		b->frames[k] = page_to_pfn(sp) - d->base_pfn;
		b->pages[k++] = hp;
	}
	err = k ? gmem_dpriv_copy_back(d->owner, b->frames, b->pages, k) : 0;
	if (err) {
		for (i = 0; i < n; i++) {
			struct page *hp = migrate_pfn_to_page(b->dst[i]);

			if (hp) {
				unlock_page(hp);
				put_page(hp);
				b->dst[i] = 0;
			}
		}
		return err;
	}
	return k;
}

/*
 * A CPU access to a page of this device: brings back the device's pages of the faulting
 * 2 MiB block (within the VMA) in one batch. Called with the mmap read lock held and
 * vmf->page locked.
 */
static vm_fault_t gmem_dpriv_migrate_to_ram(struct vm_fault *vmf)
{
	struct gmem_dpriv *d = gmem_dpriv_of(vmf->page);
	struct vm_area_struct *vma = vmf->vma;
	unsigned long block = ALIGN_DOWN(vmf->address, PMD_SIZE);
	struct migrate_vma args = {
		.vma = vma,
		.start = max(block, vma->vm_start),
		.end = min(block + PMD_SIZE, vma->vm_end),
		.pgmap_owner = d,
		.flags = MIGRATE_VMA_SELECT_DEVICE_PRIVATE,
		.fault_page = vmf->page,
	};
	unsigned long at = (ALIGN_DOWN(vmf->address, PAGE_SIZE) - args.start) >> PAGE_SHIFT;
	struct gmem_dpriv_back *b;
	vm_fault_t ret = 0;
	long filled;

	b = kvmalloc(sizeof(*b), GFP_KERNEL);
	if (!b)
		return VM_FAULT_OOM;
	args.src = b->src;
	args.dst = b->dst;
	if (migrate_vma_setup(&args)) {
		kvfree(b);
		return VM_FAULT_SIGBUS;
	}
	filled = gmem_dpriv_fill_back(d, b, args.npages, vma, args.start, false);
	/*
	 * The faulting page was selected but could not come back (its data stays on the
	 * device): no host page was free, or the copy failed. A copy that failed for lack of
	 * memory is an OOM, one the driver asks to retry (EAGAIN, EBUSY) is retried by the
	 * access faulting again; any other failure ends the access (SIGBUS).
	 */
	if ((b->src[at] & MIGRATE_PFN_MIGRATE) && !b->dst[at]) {
		if (filled >= 0 || filled == -ENOMEM)
			ret = VM_FAULT_OOM;
		else if (filled == -EAGAIN || filled == -EBUSY)
			ret = 0;
		else
			ret = VM_FAULT_SIGBUS;
	}
	migrate_vma_pages(&args);
	migrate_vma_finalize(&args);
	kvfree(b);
	return ret;
}

static const struct dev_pagemap_ops gmem_dpriv_ops = {
	.folio_free = gmem_dpriv_folio_free,
	.migrate_to_ram = gmem_dpriv_migrate_to_ram,
};

struct gmem_dpriv *gmem_dpriv_new(unsigned long nframes, unsigned long *base_pfn);
/*
 * A device-private pagemap of at least @nframes pages (page k: frame k), its first pfn in
 * *@base_pfn. No owner yet (gmem_dpriv_bind()). An ERR_PTR on failure. May sleep.
 */
struct gmem_dpriv *gmem_dpriv_new(unsigned long nframes, unsigned long *base_pfn)
{
	struct gmem_dpriv *d;
	struct resource *res;
	void *p;

	if (!nframes || nframes > (ULONG_MAX >> PAGE_SHIFT) / 2)
		return ERR_PTR(-EINVAL);
	d = kzalloc(sizeof(*d), GFP_KERNEL);
	if (!d)
		return ERR_PTR(-ENOMEM);
	/*
	 * The region comes rounded up to a whole section (GFR_DEFAULT_ALIGN), which memory
	 * hotplug requires; the pages past @nframes are never handed out (every user checks
	 * against d->nframes).
	 */
	res = request_free_mem_region(&iomem_resource, nframes << PAGE_SHIFT, "gmem");
	if (IS_ERR_OR_NULL(res)) {
		kfree(d);
		return res ? ERR_CAST(res) : ERR_PTR(-ENOMEM);
	}
	d->pgmap.type = MEMORY_DEVICE_PRIVATE;
	d->pgmap.range.start = res->start;
	d->pgmap.range.end = res->end;
	d->pgmap.nr_range = 1;
	d->pgmap.ops = &gmem_dpriv_ops;
	d->pgmap.owner = d;
	p = memremap_pages(&d->pgmap, numa_node_id());
	if (IS_ERR_OR_NULL(p)) {
		release_mem_region(res->start, resource_size(res));
		kfree(d);
		return p ? ERR_CAST(p) : ERR_PTR(-ENOMEM);
	}
	d->base_pfn = res->start >> PAGE_SHIFT;
	d->nframes = nframes;
	*base_pfn = d->base_pfn;
	return d;
}

void gmem_dpriv_bind(struct gmem_dpriv *d, const void *owner);
/* Sets the owner the callbacks report to; before any page is handed out. */
void gmem_dpriv_bind(struct gmem_dpriv *d, const void *owner)
{
	d->owner = owner;
}

void gmem_dpriv_free(struct gmem_dpriv *d);
/* Waits until every page of @d is free, then removes the pagemap. May sleep. */
void gmem_dpriv_free(struct gmem_dpriv *d)
{
	resource_size_t start = d->pgmap.range.start, len = range_len(&d->pgmap.range);

	memunmap_pages(&d->pgmap);
	release_mem_region(start, len);
	kfree(d);
}

long gmem_dpriv_evict(struct gmem_dpriv *d, const u64 *frames, unsigned long n, bool nofail);
/*
 * Moves the pages of frames @frames[0..@n) (at most a batch; any that hold no page are
 * skipped) back to host memory, wherever they are mapped; with @nofail the host pages are
 * allocated with __GFP_NOFAIL (unregistration: the frames must empty). Returns how many
 * moved, or -ENOMEM. Process context, no mmap lock needed.
 */
long gmem_dpriv_evict(struct gmem_dpriv *d, const u64 *frames, unsigned long n, bool nofail)
{
	struct gmem_dpriv_back *b;
	unsigned long i;
	long moved;

	if (n > GMEM_DPRIV_BATCH)
		return -EINVAL;
	b = kvmalloc(sizeof(*b), GFP_KERNEL);
	if (!b)
		return -ENOMEM;
	for (i = 0; i < n; i++) {
		if (frames[i] >= d->nframes) {
			kvfree(b);
			return -EINVAL;
		}
		b->src[i] = d->base_pfn + frames[i];
	}
	migrate_device_pfns(b->src, n);
	gmem_dpriv_fill_back(d, b, n, NULL, 0, nofail);
	migrate_device_pages(b->src, b->dst, n);
	moved = gmem_dpriv_moved(b->src, b->dst, n);
	migrate_device_finalize(b->src, b->dst, n);
	kvfree(b);
	return moved;
}

long gmem_dpriv_to_host(struct gmem_dpriv *d, struct mm_struct *mm, unsigned long start, unsigned long npages,
			unsigned long *count);
/*
 * Moves this device's pages of [@start, @start + @npages pages) (at most a batch; clipped
 * to the VMA of @start, *@count: the pages of the clipped range) back to host memory.
 * Returns how many moved, or a negative errno (-EFAULT: no VMA gmem mirrors at @start; the
 * copy's errno, or -ENOMEM, when pages were selected and none came back). The caller
 * holds a user reference on @mm; takes its mmap read lock.
 */
long gmem_dpriv_to_host(struct gmem_dpriv *d, struct mm_struct *mm, unsigned long start, unsigned long npages,
			unsigned long *count)
{
	struct migrate_vma args = { .pgmap_owner = d, .flags = MIGRATE_VMA_SELECT_DEVICE_PRIVATE };
	struct gmem_dpriv_back *b;
	struct vm_area_struct *vma;
	unsigned long i, selected = 0;
	long moved = 0, filled;
	int ret;

	if (!npages || npages > GMEM_DPRIV_BATCH || !PAGE_ALIGNED(start))
		return -EINVAL;
	b = kvmalloc(sizeof(*b), GFP_KERNEL);
	if (!b)
		return -ENOMEM;
	vma = gmem_dpriv_vma(mm, start, npages, &args.end, true);
	if (IS_ERR(vma)) {
		kvfree(b);
		return PTR_ERR(vma);
	}
	args.vma = vma;
	args.start = start;
	args.src = b->src;
	args.dst = b->dst;
	*count = (args.end - args.start) >> PAGE_SHIFT;
	/* No page of such a mapping ever moved to a device. */
	if (gmem_dpriv_unmovable(vma))
		goto out;
	ret = migrate_vma_setup(&args);
	if (ret) {
		moved = ret;
		goto out;
	}
	for (i = 0; i < args.npages; i++)
		selected += gmem_dpriv_selected(d, b->src[i]);
	filled = gmem_dpriv_fill_back(d, b, args.npages, vma, args.start, false);
	migrate_vma_pages(&args);
	moved = gmem_dpriv_moved(b->src, b->dst, args.npages);
	migrate_vma_finalize(&args);
	/*
	 * Pages of this device were selected and none came back: the copy's errno, or -ENOMEM
	 * if none got a host page. (One the migration core refused at the last moment is no
	 * error: it is still there for the next attempt. Holes are selected too, in an
	 * anonymous mapping, but are no pages of ours.)
	 */
	if (!moved && selected && filled <= 0)
		moved = filled ? filled : -ENOMEM;
out:
	mmap_read_unlock(mm);
	kvfree(b);
	return moved;
}

/* A migration of process memory to the device in progress (driven by the Rust side). */
struct gmem_dpriv_mig {
	struct migrate_vma args;
	unsigned long src[GMEM_DPRIV_BATCH];
	unsigned long dst[GMEM_DPRIV_BATCH];
	struct gmem_dpriv *d;
	struct mm_struct *mm;
};

struct gmem_dpriv_mig *gmem_dpriv_mig_new(void);
/* Room for one migration batch; NULL without memory. */
struct gmem_dpriv_mig *gmem_dpriv_mig_new(void)
{
	return kvzalloc(sizeof(struct gmem_dpriv_mig), GFP_KERNEL);
}

void gmem_dpriv_mig_free(struct gmem_dpriv_mig *m);
void gmem_dpriv_mig_free(struct gmem_dpriv_mig *m)
{
	kvfree(m);
}

int gmem_dpriv_collect(struct gmem_dpriv_mig *m, struct gmem_dpriv *d, struct mm_struct *mm, unsigned long start,
		       unsigned long npages, unsigned long *count);
/*
 * Starts moving the pages of [@start, @start + @npages pages) (within one 2 MiB block,
 * clipped to the VMA of @start) to device @d: takes the mmap read lock of @mm (a user
 * reference held by the caller) and collects the pages that can move (anonymous private
 * memory, including never-touched pages), locked and unmapped. *@count: the pages of the
 * clipped range. On 0 the lock stays held until gmem_dpriv_commit(); on 1 (a mapping whose
 * pages cannot move: gmem_dpriv_unmovable()) and on an error nothing is held (-EFAULT: no
 * VMA gmem mirrors at @start).
 */
int gmem_dpriv_collect(struct gmem_dpriv_mig *m, struct gmem_dpriv *d, struct mm_struct *mm, unsigned long start,
		       unsigned long npages, unsigned long *count)
{
	struct vm_area_struct *vma;
	unsigned long end;
	int ret;

	if (!npages || npages > GMEM_DPRIV_BATCH || !PAGE_ALIGNED(start))
		return -EINVAL;
	vma = gmem_dpriv_vma(mm, start, npages, &end, false);
	if (IS_ERR(vma))
		return PTR_ERR(vma);
	*count = (end - start) >> PAGE_SHIFT;
	if (gmem_dpriv_unmovable(vma)) {
		ret = 1;
		goto fail;
	}
	memset(&m->args, 0, sizeof(m->args));
	m->args.vma = vma;
	m->args.start = start;
	m->args.end = end;
	m->args.src = m->src;
	m->args.dst = m->dst;
	m->args.pgmap_owner = d;
	m->args.flags = MIGRATE_VMA_SELECT_SYSTEM;
	ret = migrate_vma_setup(&m->args);
	if (ret)
		goto fail;
	memset(m->dst, 0, sizeof(m->dst));
	m->d = d;
	m->mm = mm;
	return 0;
fail:
	mmap_read_unlock(mm);
	return ret;
}

int gmem_dpriv_source(struct gmem_dpriv_mig *m, unsigned long i, struct page **page);
/*
 * Whether page @i of a collected range moves (1) or stays (0); *@page: its host page, or
 * NULL for a page never touched (the device fills it with zeros). A file page (of a
 * private file mapping, not yet written) stays: only anonymous folios move.
 */
int gmem_dpriv_source(struct gmem_dpriv_mig *m, unsigned long i, struct page **page)
{
	struct page *p;

	if (i >= m->args.npages || !(m->src[i] & MIGRATE_PFN_MIGRATE))
		return 0;
	p = migrate_pfn_to_page(m->src[i]);
	if (p && !folio_test_anon(page_folio(p)))
		return 0;
	*page = p;
	return 1;
}

void gmem_dpriv_place(struct gmem_dpriv_mig *m, unsigned long i, u64 frame);
/*
 * Page @i (one gmem_dpriv_source() said moves) goes to frame @frame, which holds its data
 * now. The frame's page is handed out: from here on it is freed through the pagemap
 * (gmem_dpriv_released()), whether or not the migration completes.
 */
void gmem_dpriv_place(struct gmem_dpriv_mig *m, unsigned long i, u64 frame)
{
	struct page *dp;

	if (i >= m->args.npages || frame >= m->d->nframes || m->dst[i])
		return;
	dp = pfn_to_page(m->d->base_pfn + frame);
	zone_device_page_init(dp, &m->d->pgmap, 0);
	m->dst[i] = migrate_pfn(page_to_pfn(dp)) | (m->src[i] & MIGRATE_PFN_WRITE);
}

long gmem_dpriv_commit(struct gmem_dpriv_mig *m);
/*
 * Completes a collected migration: the placed pages move (unless the kernel finds them
 * changed), the others stay on the host. Drops the mmap lock. Returns how many moved.
 */
long gmem_dpriv_commit(struct gmem_dpriv_mig *m)
{
	long moved;

	migrate_vma_pages(&m->args);
	moved = gmem_dpriv_moved(m->src, m->dst, m->args.npages);
	migrate_vma_finalize(&m->args);
	mmap_read_unlock(m->mm);
	return moved;
}

unsigned long gmem_dpriv_frame(unsigned long base_pfn, unsigned long nframes, unsigned long hmm_pfn, bool *writable);
/*
 * The frame an HMM pfn names, for the pagemap of @nframes pages from @base_pfn (a page a
 * walk with that pagemap as device-private owner found), or ULONG_MAX if it names none of
 * them. *@writable: the CPU side's entry allows writes.
 */
unsigned long gmem_dpriv_frame(unsigned long base_pfn, unsigned long nframes, unsigned long hmm_pfn, bool *writable)
{
	unsigned long pfn;

	if (!(hmm_pfn & HMM_PFN_VALID) || (hmm_pfn & HMM_PFN_ERROR))
		return ULONG_MAX;
	pfn = page_to_pfn(hmm_pfn_to_page(hmm_pfn));
	if (pfn < base_pfn || pfn - base_pfn >= nframes)
		return ULONG_MAX;
	*writable = !!(hmm_pfn & HMM_PFN_WRITE);
	return pfn - base_pfn;
}
