// SPDX-License-Identifier: GPL-2.0
/*
 * gmem_example: GMEM from C through the C library (libgmem, <gmem.h>); the simulated
 * device's kernels through its own uapi header. Allocates 1 MiB, writes it on the CPU,
 * checksums it on /dev/gmem_sim0, prefetches it to that device, fills it there and
 * verifies the result on the CPU.
 *   build: cc -I include/uapi $(pkg-config --cflags libgmem) -o gmem-example \
 *              tools/examples/gmem_example.c $(pkg-config --libs libgmem)
 * Prints "GMEM-UTEST ok c_example" or "GMEM-UTEST not ok c_example # <reason>".
 */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>
#include <gmem.h>
#include <linux/gmem_sim.h>

#define SIZE	(1u << 20)
#define NPAGES	(SIZE / GMEM_PAGE_SIZE)
#define NWORDS	(SIZE / 4)

static void fail(const char *why)
{
	printf("GMEM-UTEST not ok c_example # %s\n", why);
	exit(1);
}

static void fail_errno(const char *call)
{
	printf("GMEM-UTEST not ok c_example # %s: %s\n", call, strerror(errno));
	exit(1);
}

/* FNV-1a over u32 words, as the device's CHECKSUM kernel computes it (gmem_sim.h). */
static uint64_t fnv1a(const uint32_t *w, size_t n)
{
	uint64_t h = 0xcbf29ce484222325ULL;

	for (size_t i = 0; i < n; i++)
		h = (h ^ w[i]) * 0x100000001b3ULL;
	return h;
}

static void launch(int sim, struct gmem_sim_launch *l, __u32 kernel, __u64 a, __u32 value)
{
	memset(l, 0, sizeof(*l));
	l->argsz = sizeof(*l);
	l->kernel = kernel;
	l->a = a;
	l->len = SIZE;
	l->value = value;
	if (ioctl(sim, GMEM_SIM_IOC_LAUNCH, l))
		fail_errno("GMEM_SIM_IOC_LAUNCH");
}

int main(void)
{
	struct gmem_sim_info info = { .argsz = sizeof(info) };
	struct gmem_sim_launch l;
	static uint32_t states[NPAGES];
	int sim, r;

	uint32_t *w = gmem_malloc(SIZE);	/* cudaMallocManaged */
	if (!w)
		fail_errno("gmem_malloc");
	__u64 addr = (__u64)(uintptr_t)w;

	for (size_t i = 0; i < NWORDS; i++)	/* CPU touch: pages fault in on the host */
		w[i] = (uint32_t)i * 2654435761u;
	uint64_t sum = fnv1a(w, NWORDS);

	sim = open("/dev/gmem_sim0", O_RDWR | O_CLOEXEC);
	if (sim < 0)
		fail_errno("open /dev/gmem_sim0");
	if (ioctl(sim, GMEM_SIM_IOC_INFO, &info))
		fail_errno("GMEM_SIM_IOC_INFO");
	launch(sim, &l, GMEM_SIM_K_CHECKSUM, addr, 0);
	if (l.result != sum)
		fail("device checksum differs from the CPU's");
	if (fnv1a(w, NWORDS) != sum)	/* the CPU reads again: pages come home */
		fail("CPU read-back after the device read");

	r = gmem_prefetch(w, SIZE, info.gmem_id);	/* cudaMemPrefetchAsync + sync */
	if (r) {
		errno = -r;
		fail_errno("gmem_prefetch");
	}
	r = gmem_query(w, NPAGES, states);
	if (r) {
		errno = -r;
		fail_errno("gmem_query");
	}
	for (size_t p = 0; p < NPAGES; p++)
		if (gmem_loc(states[p]) != GMEM_LOC_DEVICE || gmem_dev(states[p]) != (unsigned int)info.gmem_id)
			fail("QUERY after PREFETCH: a page is not on the device");

	/* Prefetched pages are resident and mapped: reading them faults nothing. */
	launch(sim, &l, GMEM_SIM_K_CHECKSUM, addr, 0);
	if (l.faults != 0 || l.result != sum)
		fail("CHECKSUM after PREFETCH faulted or read wrong data");
	/* They are clean (the host copy is kept) and mapped read-only, so the first write to
	 * each page faults once to make it writable; no data moves for that. */
	launch(sim, &l, GMEM_SIM_K_FILL, addr, 7);
	for (size_t i = 0; i < NWORDS; i++)
		if (w[i] != 7 + (uint32_t)i)
			fail("CPU read of the device's FILL");

	r = gmem_free(w);
	if (r) {
		errno = -r;
		fail_errno("gmem_free");
	}
	close(sim);
	printf("GMEM-UTEST ok c_example\n");
	return 0;
}
