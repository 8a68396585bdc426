/* SPDX-License-Identifier: GPL-2.0 WITH Linux-syscall-note */
/*
 * GMEM user API: /dev/gmem ioctls. See Documentation/user-api.rst.
 *
 * Every argument struct starts with its own size (@argsz, set by the caller to
 * sizeof(struct ...)), so the ABI can grow; reserved fields must be zero; unknown flags or
 * advice values fail with -EINVAL.
 */
#ifndef _UAPI_LINUX_GMEM_H
#define _UAPI_LINUX_GMEM_H

#include <linux/ioctl.h>
#include <linux/types.h>

#define GMEM_UAPI_VERSION	1
#define GMEM_IOC_MAGIC		'G'
#define GMEM_PAGE_SIZE		4096ULL
#define GMEM_MAX_ALLOC		(1ULL << 40)	/* 1 TiB: larger sizes are refused */
#define GMEM_NO_DEVICE		(-1)
#define GMEM_HOST		(-2)	/* "device" id meaning host memory, for advice */

struct gmem_version {
	__u32 argsz;
	__u32 version;		/* out: GMEM_UAPI_VERSION */
	__u32 nr_devices;	/* out: registered devices */
	__u32 reserved;
};

/* GMEM_IOC_ALLOC: map a new region of @size bytes (multiple of 4 KiB). */
struct gmem_alloc {
	__u32 argsz;
	__u32 flags;		/* must be 0 */
	__u64 size;
	__s32 preferred_dev;	/* GMEM_NO_DEVICE or a device id */
	__u32 reserved0;
	__u64 addr;		/* out */
	__u64 reserved[2];
};

/* GMEM_IOC_FREE: unmap the whole region that starts at @addr. */
struct gmem_free {
	__u32 argsz;
	__u32 flags;		/* must be 0 */
	__u64 addr;
	__u64 reserved[2];
};

/* Advice values for GMEM_IOC_ADVISE. */
#define GMEM_ADV_PREFETCH		1	/* migrate [addr,len) to @dev (or GMEM_HOST) */
#define GMEM_ADV_PREFERRED_LOC		2	/* GMEM_HOST: devices map host pages remotely;
						   a device: its pages there are evicted last */
#define GMEM_ADV_UNSET_PREFERRED_LOC	3
#define GMEM_ADV_ACCESSED_BY		4	/* @dev maps host pages remotely, no migration */
#define GMEM_ADV_UNSET_ACCESSED_BY	5
#define GMEM_ADV_READ_MOSTLY		6	/* read faults duplicate; a write collapses */
#define GMEM_ADV_UNSET_READ_MOSTLY	7
#define GMEM_ADV_PIN			8	/* migrate to @dev and never evict */
#define GMEM_ADV_UNPIN			9
#define GMEM_ADV_DONTNEED		10	/* discard contents: next touch reads zeros */

#define GMEM_ADVF_ASYNC			(1u << 0)	/* PREFETCH only: returns @fence */

/*
 * GMEM_IOC_ADVISE. Rounding: [addr, addr+len) is widened outward to 4 KiB page bounds
 * except for DONTNEED, which is narrowed inward (a partly covered page keeps its data).
 * The range must lie within one region.
 */
struct gmem_advise {
	__u32 argsz;
	__u32 advice;
	__u64 addr;
	__u64 len;
	__s32 dev;		/* device id, or GMEM_HOST for PREFETCH to host */
	__u32 flags;
	__u64 fence;		/* out, with GMEM_ADVF_ASYNC */
	__u64 reserved[2];
};

/* GMEM_IOC_WAIT: wait for an ASYNC fence; returns its result (0 or -errno). */
struct gmem_wait {
	__u32 argsz;
	__u32 flags;		/* must be 0 */
	__u64 fence;
	__u64 reserved[2];
};

/* Per-page state word returned by GMEM_IOC_QUERY. */
#define GMEM_LOC_NONE		0	/* never touched: reads as zeros */
#define GMEM_LOC_HOST		1
#define GMEM_LOC_DEVICE		2
#define GMEM_LOC_LOST		3	/* data lost when its device was removed (host memory
					   exhausted): CPU access SIGBUS, device access -EIO,
					   until DONTNEED or FREE */
#define GMEM_Q_LOC(w)		((w) & 0xff)
#define GMEM_Q_DEV(w)		(((w) >> 8) & 0xff)	/* owner device if LOC_DEVICE */
#define GMEM_Q_PINNED		(1u << 16)
#define GMEM_Q_DIRTY		(1u << 17)	/* device copy newer than host copy */
#define GMEM_Q_DUP		(1u << 18)	/* read-only duplicates exist */
#define GMEM_Q_REMOTE		(1u << 19)	/* mapped remotely by a device */
#define GMEM_Q_CPU_MAPPED	(1u << 20)

/* GMEM_IOC_QUERY: the residency oracle; fills @npages u32 words at @states. */
struct gmem_query {
	__u32 argsz;
	__u32 flags;		/* must be 0 */
	__u64 addr;
	__u64 npages;		/* <= GMEM_QUERY_MAX */
	__u64 states;		/* user pointer to __u32[npages] */
	__u64 dup_mask;		/* out: devices holding duplicates of the first page */
	__u64 reserved[2];
};
#define GMEM_QUERY_MAX		(1u << 20)

#define GMEM_IOC_VERSION	_IOWR(GMEM_IOC_MAGIC, 0x00, struct gmem_version)
#define GMEM_IOC_ALLOC		_IOWR(GMEM_IOC_MAGIC, 0x01, struct gmem_alloc)
#define GMEM_IOC_FREE		_IOWR(GMEM_IOC_MAGIC, 0x02, struct gmem_free)
#define GMEM_IOC_ADVISE		_IOWR(GMEM_IOC_MAGIC, 0x03, struct gmem_advise)
#define GMEM_IOC_WAIT		_IOWR(GMEM_IOC_MAGIC, 0x04, struct gmem_wait)
#define GMEM_IOC_QUERY		_IOWR(GMEM_IOC_MAGIC, 0x05, struct gmem_query)

#endif /* _UAPI_LINUX_GMEM_H */
