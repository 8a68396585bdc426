// SPDX-License-Identifier: GPL-2.0
/*
 * gmem_lib_test: the C library (libgmem, <gmem.h>) exercised from C, in the guest.
 * Every check verifies data or an exact return value; one line per check:
 *   GMEM-UTEST ok c_lib_<name>   /   GMEM-UTEST not ok c_lib_<name> # <reason>
 * Needs gmem.ko and two devices (gmem_sim nr_devices=2).
 *   build: see the Makefile (`make user`): static, against libgmem.a.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <gmem.h>

static int failures;

static void check(int ok, const char *name, const char *why, long got)
{
	if (ok)
		printf("GMEM-UTEST ok c_lib_%s\n", name);
	else
		printf("GMEM-UTEST not ok c_lib_%s # %s (got %ld)\n", name, why, got);
	failures += !ok;
}

/* Pages of [p, p + len) all at @loc (and device @dev for GMEM_LOC_DEVICE)? -1: query failed. */
static long all_at(const void *p, size_t npages, unsigned int loc, unsigned int dev)
{
	static uint32_t st[1024];
	long bad = 0;
	int r = gmem_query(p, npages, st);

	if (r)
		return r;
	for (size_t i = 0; i < npages; i++)
		bad += gmem_loc(st[i]) != loc || (loc == GMEM_LOC_DEVICE && gmem_dev(st[i]) != dev);
	return bad;
}

int main(void)
{
	const size_t len = 3 * 1024 * 1024 + 1;	/* rounded up to 769 pages */
	const size_t npages = 769;
	uint32_t *w;
	uint64_t fence = 0;
	long bad, r;
	int x;

	check(gmem_fd() >= 0, "fd", "gmem_fd() did not open /dev/gmem", gmem_fd());

	errno = 0;
	check(gmem_malloc(0) == NULL && errno == EINVAL, "malloc_zero", "gmem_malloc(0) must fail with EINVAL", errno);

	w = gmem_malloc(len);
	check(w != NULL, "malloc", "gmem_malloc(3 MiB + 1) returned NULL", errno);
	if (!w)
		return 1;
	for (size_t i = 0; i < npages * 1024; i++)
		w[i] = (uint32_t)(i * 2654435761u);
	bad = all_at(w, npages, GMEM_LOC_HOST, 0);
	check(bad == 0, "written_on_host", "pages not on the host after CPU writes", bad);

	r = gmem_prefetch(w, npages * 4096, 0);
	bad = r ? r : all_at(w, npages, GMEM_LOC_DEVICE, 0);
	check(bad == 0, "prefetch", "gmem_prefetch to device 0 did not place every page there", bad);

	r = gmem_prefetch_async(w, npages * 4096, 1, &fence);
	if (!r)
		r = gmem_wait(fence);
	bad = r ? r : all_at(w, npages, GMEM_LOC_DEVICE, 1);
	check(bad == 0 && fence != 0, "prefetch_async", "async prefetch to device 1 + wait did not place every page there", bad);

	bad = 0;
	for (size_t i = 0; i < npages * 1024; i++)
		bad += w[i] != (uint32_t)(i * 2654435761u);
	check(bad == 0, "data_intact", "words wrong after two migrations", bad);

	r = gmem_prefetch(w, npages * 4096, GMEM_CPU);
	bad = r ? r : all_at(w, npages, GMEM_LOC_HOST, 0);
	check(bad == 0, "prefetch_cpu", "gmem_prefetch to GMEM_CPU did not bring every page home", bad);

	r = gmem_advise(w, 4096, GMEM_ADV_READ_MOSTLY, 0);
	check(r == 0, "advise", "READ_MOSTLY refused", r);
	r = gmem_advise(w, 4096, 99, 0);
	check(r == -EINVAL, "advise_unknown", "unknown advice must give -EINVAL", r);
	r = gmem_prefetch(w, 4096, 15);
	check(r == -ENODEV, "prefetch_nodev", "prefetch to device 15 must give -ENODEV", r);
	/* Ordinary memory is the device's too: PREFETCH maps it there (user-api.rst). */
	r = gmem_prefetch(&x, 4, 0);
	check(r == 0, "prefetch_not_gmem", "prefetch of a stack address failed", r);
	r = gmem_prefetch((void *)4096, 4, 0);
	check(r == -ENOENT, "prefetch_unmapped", "prefetch of an unmapped address must give -ENOENT", r);

	r = gmem_free((char *)w + 4096);
	check(r == -EINVAL, "free_inside", "free of a pointer inside an allocation must give -EINVAL", r);
	r = gmem_free(w);
	check(r == 0, "free", "gmem_free failed", r);
	r = gmem_free(w);
	check(r == -ENOENT, "free_twice", "a second gmem_free must give -ENOENT", r);
	return failures != 0;
}
