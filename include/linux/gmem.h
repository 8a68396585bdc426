/* SPDX-License-Identifier: GPL-2.0 */
/*
 * GMEM driver API: how an accelerator driver plugs into gmem.ko.
 *
 * A driver registers a device with a table of callbacks (struct gmem_dev_ops) and the size of
 * its memory pool in 4 KiB frames. The core owns placement: it allocates frames, decides what
 * moves where, and drives the driver's page table and copy engine through the callbacks.
 * The driver reports device page faults in batches with gmem_dev_fault().
 *
 * Contract of every callback: it may sleep, it is never called with a spinlock held, and it
 * must not call back into gmem (no gmem_dev_fault() from inside a callback). No callback is
 * made with a context after ctx_destroy() of that context started, and none at all after
 * gmem_dev_unregister() returned.
 * See Documentation/driver-api.rst.
 */
#ifndef _LINUX_GMEM_H
#define _LINUX_GMEM_H

#include <linux/types.h>

#define GMEM_DRIVER_ABI_VERSION 3	/* 2: ops gained test_clear_accessed; 3: 2 MiB PTEs */

struct page;
struct gmem_dev;	/* a registered device (opaque, owned by gmem.ko) */
struct gmem_space;	/* one process's GMEM address space (opaque, refcounted) */

/* Access kind of a device fault. */
#define GMEM_ACCESS_READ	1u
#define GMEM_ACCESS_WRITE	2u

/* Protection of a device PTE. */
#define GMEM_PROT_READ		1u
#define GMEM_PROT_WRITE		2u

/* Flags of a device PTE. */
#define GMEM_PTE_2M		1u	/* one entry for 512 pages (needs GMEM_DEV_CAP_MAP_2M) */

/*
 * One device page-table entry to install. If @host is non-NULL the device maps that host page
 * remotely (over the link, no migration) and @frame is ignored; otherwise @frame is a frame
 * index of this device's pool.
 *
 * With GMEM_PTE_2M in @flags (only sent to a device that declared GMEM_DEV_CAP_MAP_2M) the
 * entry maps the 2 MiB at @va (2 MiB-aligned) to the 512 frames @frame .. @frame + 511
 * (@frame a multiple of 512), all with @prot; @host is NULL. It replaces whatever 4 KiB
 * entries the range had. The core sends one only when every page of the 2 MiB is resident
 * on the device in exactly those frames.
 */
struct gmem_pte {
	__u64 va;
	__u64 frame;
	struct page *host;
	__u32 prot;
	__u32 flags;		/* GMEM_PTE_* (was padding before ABI 3: zero) */
};

/* Copy directions. */
#define GMEM_COPY_H2D		0u	/* host page -> frame */
#define GMEM_COPY_D2H		1u	/* frame -> host page */
#define GMEM_COPY_D2D		2u	/* frame -> peer_frame on the peer device */
#define GMEM_COPY_ZERO		3u	/* zero-fill frame (host unused) */

struct gmem_copy {
	struct page *host;	/* H2D source / D2H destination */
	__u64 frame;		/* this device's frame */
	__u64 peer_frame;	/* D2D destination frame on the peer device */
};

struct gmem_dev_ops {
	/* Create/destroy the device page table ("context") of one address space. */
	int (*ctx_create)(void *drv, void **ctx);
	void (*ctx_destroy)(void *drv, void *ctx);
	/*
	 * Install @n PTEs in @ctx. Must not fail for valid input except with -ENOMEM. A 4 KiB
	 * entry inside a 2 MiB one splits the 2 MiB entry first (see unmap).
	 */
	int (*map)(void *drv, void *ctx, const struct gmem_pte *ptes, __u32 n);
	/*
	 * Remove the PTEs of [va, va + npages * 4K) in @ctx; unmapped pages are ignored. A
	 * 2 MiB entry the range covers only in part is split: the pages outside the range stay
	 * mapped, each with its 4 KiB entry (same frame, same protection). Cannot fail, so a
	 * driver that maps 2 MiB entries keeps what a split needs (e.g. the leaf table) ready.
	 */
	void (*unmap)(void *drv, void *ctx, __u64 va, __u64 npages);
	/* Make earlier unmaps visible to the device (flush its TLBs). */
	void (*tlb_invalidate)(void *drv, void *ctx, __u64 va, __u64 npages);
	/* Copy @n pages in direction @dir; @peer_drv is the peer's drv for D2D. Synchronous. */
	int (*copy)(void *drv, __u32 dir, const struct gmem_copy *c, __u32 n, void *peer_drv);
	/* Optional: the host-visible page behind a frame, for CPU remote mapping (NULL: none). */
	struct page *(*frame_page)(void *drv, __u64 frame);
	/*
	 * Optional: test and clear the device's accessed bit of the PTE at @va in @ctx.
	 * Returns 1 if the device touched the page since the last call, 0 if not (or unmapped).
	 * Pages under a 2 MiB entry are asked about one by one and must answer for
	 * themselves: hardware with one bit per 2 MiB entry must shadow it per page (else
	 * the first test would clear it for all 512 and the rest would look unused).
	 * Feeds gmem's replacement order (second chance) and prefetch accounting.
	 */
	int (*test_clear_accessed)(void *drv, void *ctx, __u64 va);
};

/* Capabilities a driver declares in gmem_dev_props.caps. */
#define GMEM_DEV_CAP_MAP_2M	1u	/* map takes GMEM_PTE_2M entries */

struct gmem_dev_props {
	__u32 size;		/* sizeof(struct gmem_dev_props) */
	__u32 abi_version;	/* GMEM_DRIVER_ABI_VERSION */
	const char *name;
	__u64 nr_frames;	/* capacity of the device memory pool, 4 KiB frames */
	void *drv;		/* passed back as first argument of every callback */
	__u32 caps;		/* GMEM_DEV_CAP_*; unknown bits are refused (-EINVAL) */
	__u32 __reserved;	/* zero */
};

/* Returns the device or an ERR_PTR(). Every op except frame_page is mandatory. */
struct gmem_dev *gmem_dev_register(const struct gmem_dev_ops *ops,
				   const struct gmem_dev_props *props);
/*
 * Marks the device dead, evacuates every page resident on it to host memory (retrying with
 * backoff; a page whose data still cannot be saved becomes "lost": SIGBUS/-EIO/QUERY
 * GMEM_LOC_LOST), waits for every callback of the device still running, destroys every
 * context of the device, then forgets the device. No callback is made after it returns.
 * Call it once, with no lock held that a callback takes, after the driver stopped calling
 * gmem_dev_fault() for the device.
 */
void gmem_dev_unregister(struct gmem_dev *dev);
/* Small integer id of the device (as used in the user API), >= 0. */
int gmem_dev_id(const struct gmem_dev *dev);

/* The GMEM space of the calling process, with a reference; ERR_PTR(-ENOENT) if none. */
struct gmem_space *gmem_space_get_current(void);
void gmem_space_put(struct gmem_space *space);
/*
 * The device's context (page table) for @space, created through ops->ctx_create on first
 * use. Valid while the caller holds its reference on @space. ERR_PTR(-ENODEV) if the device
 * is unregistering.
 */
void *gmem_space_ctx(struct gmem_dev *dev, struct gmem_space *space);

/*
 * Service a batch of device faults of @dev in @space: @n page addresses (any order,
 * duplicates allowed, at most 4096) with the access kind @access. On return 0, every address
 * is mapped in the device's context for @space with at least the access asked for.
 * Errors (the device must fail the kernel that faulted):
 *   -EFAULT  an address is not in a GMEM region of @space, or the process is exiting;
 *   -ENODEV  the device is unregistering;
 *   -EBUSY   the page is pinned on another device;
 *   -ENOMEM  no device frame could be freed (all pinned) or host memory ran out;
 *   -EIO     a page's data was lost when the device holding it was unregistered;
 *   -EXDEV   the page is on a device of another driver (no peer copy between drivers);
 *   -EINVAL  bad arguments; other negative values are the driver's own callback errors.
 */
int gmem_dev_fault(struct gmem_dev *dev, struct gmem_space *space,
		   const __u64 *addrs, __u32 n, __u32 access);

#endif /* _LINUX_GMEM_H */
