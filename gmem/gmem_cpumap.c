// SPDX-License-Identifier: GPL-2.0
/*
 * CPU mappings of GMEM host pages (gmem/mech/fault.rs): special PTEs only.
 *
 * GMEM refuses get_user_pages on its memory (the VMA is VM_IO; Documentation/design.rst,
 * "Pinned I/O"). The slow GUP path checks the VMA, but GUP-fast walks the page tables
 * without it and takes a reference on any present PTE that is not special: a page mapped
 * with vm_insert_page() could be pinned (vmsplice, O_DIRECT) and then keep a host page
 * that GMEM drops or replaces when the data moves. A special PTE makes GUP-fast fall back
 * to the slow path, which refuses the VMA.
 *
 * A special PTE holds no reference on its page and puts it in no rmap or RSS counter:
 * GMEM zaps every CPU mapping of a host page (zap_vma_range, under the page's block lock)
 * before it frees or replaces the page, and the page's own reference is GMEM's.
 */
#include <linux/mm.h>
#include <linux/pgtable.h>

struct gmem_cpumap_run {
	struct mm_struct *mm;
	struct page **pages;
	pgprot_t prot;
	unsigned long next;
};

/* One page of the run at @addr, whose PTE @pte the caller holds locked. */
static int gmem_cpumap_one(pte_t *pte, unsigned long addr, void *data)
{
	struct gmem_cpumap_run *r = data;
	struct page *page = r->pages[r->next];

	if (!pte_none(ptep_get(pte)))
		return -EBUSY;
	set_pte_at(r->mm, addr, pte, pte_mkspecial(pfn_pte(page_to_pfn(page), r->prot)));
	r->next++;
	return 0;
}

long gmem_cpumap_insert(struct vm_area_struct *vma, unsigned long addr, struct page **pages,
			unsigned long n);
/*
 * Maps @pages (@n of them) at @addr onwards in @vma, a GMEM VMA, with the VMA's
 * protection: one page-table walk, each page table's lock taken once. Called by a CPU
 * fault (under the mmap read lock: without ->map_pages, a fault under the per-VMA lock
 * is retried under it) that holds the pages' block lock. Stops at the first
 * address already mapped. Returns how many pages it mapped (from the first), or a negative
 * errno if it mapped none and could not allocate a page table.
 */
long gmem_cpumap_insert(struct vm_area_struct *vma, unsigned long addr, struct page **pages,
			unsigned long n)
{
	struct gmem_cpumap_run r = {
		.mm = vma->vm_mm, .pages = pages, .prot = vma->vm_page_prot, .next = 0,
	};
	int err;

	if (!n)
		return 0;
	if (addr < vma->vm_start || addr >= vma->vm_end || n > (vma->vm_end - addr) >> PAGE_SHIFT)
		return -EINVAL;
	err = apply_to_page_range(vma->vm_mm, addr, n << PAGE_SHIFT, gmem_cpumap_one, &r);
	if (err && err != -EBUSY && !r.next)
		return err;
	return r.next;
}

vm_fault_t gmem_cpumap_fault(struct vm_fault *vmf, struct page *page);
/*
 * Maps @page at the faulting address of @vmf with the VMA's protection, as a special PTE:
 * vmf_insert_mixed() makes one on every architecture with pte_special, which GMEM
 * requires. (A write to a PTE the VMA's protection left read-only is upgraded by the
 * kernel's write-protect fault, as for any shared mapping without pfn_mkwrite.)
 */
vm_fault_t gmem_cpumap_fault(struct vm_fault *vmf, struct page *page)
{
	BUILD_BUG_ON(!IS_ENABLED(CONFIG_ARCH_HAS_PTE_SPECIAL));
	return vmf_insert_mixed(vmf->vma, vmf->address & PAGE_MASK, page_to_pfn(page));
}
