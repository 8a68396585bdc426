/* SPDX-License-Identifier: GPL-2.0 WITH Linux-syscall-note */
/*
 * gmem_csample: the C sample driver's own user API (/dev/gmem_csampleN). Like the
 * simulated accelerator it runs small "kernels" that touch memory only through the
 * device's page table and report misses to gmem; it exists to show (and test) that a C
 * driver needs nothing but <linux/gmem.h>.
 *
 * Words are little-endian u32; addr and len must be multiples of 4. CHECKSUM is FNV-1a
 * over words (see gmem_sim.h). Errors: EINVAL bad shape; EFAULT an address is in no GMEM
 * region of the caller; ENODEV the device was unplugged; EINTR fatal signal pending.
 */
#ifndef _UAPI_LINUX_GMEM_CSAMPLE_H
#define _UAPI_LINUX_GMEM_CSAMPLE_H

#include <linux/ioctl.h>
#include <linux/types.h>

#define GMEM_CSAMPLE_FILL	1	/* addr[i] = value + i over len bytes */
#define GMEM_CSAMPLE_CHECKSUM	2	/* result = checksum(addr[0..len)) */
#define GMEM_CSAMPLE_GATHER	3	/* out[k] = word at addrs[k], k < count (<= 4096) */

struct gmem_csample_run {
	__u32 argsz;		/* sizeof(struct gmem_csample_run) */
	__u32 op;		/* GMEM_CSAMPLE_* */
	__u64 addr;		/* FILL, CHECKSUM */
	__u64 len;		/* FILL, CHECKSUM: bytes */
	__u32 value;		/* FILL */
	__u32 reserved;		/* zero */
	__u64 addrs;		/* GATHER: user pointer to count __u64 addresses */
	__u64 out;		/* GATHER: user pointer to count __u32 words */
	__u64 count;		/* GATHER */
	__u64 result;		/* out: CHECKSUM's hash, GATHER's count */
	__u64 faults;		/* out: addresses reported to gmem */
	__u64 batches;		/* out: fault batches reported */
};

struct gmem_csample_info {
	__u32 argsz;		/* sizeof(struct gmem_csample_info) */
	__s32 gmem_id;		/* out: the device id in the GMEM user API */
	__u64 nr_frames;	/* out */
	__u64 ptes;		/* out: valid PTEs over all contexts */
	__u64 copies;		/* out: pages moved by the copy channel */
};

#define GMEM_CSAMPLE_IOC_RUN	_IOWR('C', 0x01, struct gmem_csample_run)
#define GMEM_CSAMPLE_IOC_INFO	_IOWR('C', 0x02, struct gmem_csample_info)
/* Hot-unplug: running kernels end with ENODEV, gmem saves the device's pages. */
#define GMEM_CSAMPLE_IOC_UNPLUG	_IO('C', 0x03)

#endif /* _UAPI_LINUX_GMEM_CSAMPLE_H */
