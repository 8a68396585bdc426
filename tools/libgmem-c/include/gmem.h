/* SPDX-License-Identifier: GPL-2.0 */
/*
 * libgmem: GMEM managed memory for C, C++ and Python, in the vocabulary of CUDA's
 * managed memory (cudaMallocManaged, cudaMemPrefetchAsync, cudaMemAdvise, ...).
 *
 * Memory from gmem_malloc() is one pointer for the CPU and every GMEM device: pages move
 * on access, or ahead of it with gmem_prefetch(). The library opens /dev/gmem on first use
 * (one descriptor per process, shared by all threads) and is thread-safe.
 *
 * Errors: functions returning int give 0 on success or a negative errno (-EINVAL, -ENOMEM,
 * -ENODEV, ...: the errors of the ioctls in Documentation/user-api.rst); gmem_malloc()
 * returns NULL and sets errno. Link with -lgmem (pkg-config --libs libgmem).
 */
#ifndef GMEM_LIB_H
#define GMEM_LIB_H

#include <stddef.h>
#include <stdint.h>
#include <linux/gmem.h>		/* GMEM_ADV_*, GMEM_LOC_*, GMEM_Q_*, GMEM_HOST */

#ifdef __cplusplus
extern "C" {
#endif

/* Prefetch/advice destination meaning host memory (cudaCpuDeviceId). */
#define GMEM_CPU	GMEM_HOST

/* Managed allocation of @size bytes (rounded up to whole pages), zero-filled on first
 * touch. NULL with errno set (EINVAL for 0, ENOMEM, ENOENT without /dev/gmem). */
void *gmem_malloc(size_t size);
/* The same, with a preferred device (placement hint for first touch). */
void *gmem_malloc_on(size_t size, int dev);
/* Frees memory from gmem_malloc(): -ENOENT for a pointer that is not (or no longer) an
 * allocation, -EINVAL for one inside an allocation but not its start. */
int gmem_free(void *ptr);

/* Migrates [ptr, ptr + len) to @dev (a device id, or GMEM_CPU) and waits. Ordinary memory
 * (not from gmem_malloc: malloc, the stack) stays on the host and is mapped on @dev instead;
 * -ENOENT where nothing is mapped. */
int gmem_prefetch(const void *ptr, size_t len, int dev);
/* The same without waiting: *@fence receives a fence for gmem_wait(). */
int gmem_prefetch_async(const void *ptr, size_t len, int dev, uint64_t *fence);
/* Waits for a fence from an asynchronous call (0 once it completed). */
int gmem_wait(uint64_t fence);

/* Gives advice GMEM_ADV_* on [ptr, ptr + len) for @dev (cudaMemAdvise). */
int gmem_advise(const void *ptr, size_t len, int advice, int dev);

/* Residency of @npages pages from @ptr: one GMEM_LOC_* | GMEM_Q_* word per page (see
 * <linux/gmem.h>; gmem_loc() and gmem_dev() take it apart). */
int gmem_query(const void *ptr, size_t npages, uint32_t *states);
static inline unsigned int gmem_loc(uint32_t state) { return state & 0xff; }
static inline unsigned int gmem_dev(uint32_t state) { return (state >> 8) & 0xff; }

/* The library's /dev/gmem descriptor (opened on first use), or a negative errno. */
int gmem_fd(void);

#ifdef __cplusplus
}
#endif
#endif /* GMEM_LIB_H */
