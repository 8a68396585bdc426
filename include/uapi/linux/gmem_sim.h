/* SPDX-License-Identifier: GPL-2.0 WITH Linux-syscall-note */
/*
 * gmem_sim: the simulated accelerator's own user API (/dev/gmem_simN). Userspace launches
 * "kernels" on the device; they access memory only through the device's page table, raise
 * device faults to gmem in batches, and return results so tests can verify data.
 *
 * Data is handled as little-endian u32 words; a and b must be 4-byte aligned and len a
 * multiple of 4. The checksum is FNV-1a over words:
 *   h = 0xcbf29ce484222325; for each word w: h = (h ^ w) * 0x100000001b3 (mod 2^64)
 *
 * GMEM_SIM_IOC_LAUNCH errors (Documentation/user-api.rst has the full list):
 *   EINVAL     bad shape: argsz, reserved, kernel, flags; len 0; a, b or len not a
 *              multiple of 4
 *   EOVERFLOW  [a, a+len) (or [b, b+len)) rounded out to whole 4 KiB pages does not end
 *              below 2^64 (the last page of the 64-bit space is never a valid range)
 *   EFAULT     a page of a range is in no GMEM region of the caller (e.g. a kernel address)
 *   EINTR      the caller has a fatal signal pending; checked every 256 pages or TOUCH
 *              accesses (the dying caller never sees it). Launches are not restarted.
 * TOUCH's count is not bounded: a launch runs until it is done or its process is killed.
 */
#ifndef _UAPI_LINUX_GMEM_SIM_H
#define _UAPI_LINUX_GMEM_SIM_H

#include <linux/ioctl.h>
#include <linux/types.h>

#define GMEM_SIM_K_FILL		1	/* a[i] = value + i */
#define GMEM_SIM_K_CHECKSUM	2	/* result = checksum(a[0..len)) */
#define GMEM_SIM_K_COPY		3	/* b[i] = a[i]; partial overlap: unspecified */
#define GMEM_SIM_K_AXPY		4	/* b[i] = value * a[i] + b[i] (mod 2^32) */
#define GMEM_SIM_K_TOUCH	5	/* count random pages of [a, a+len): read word 0, or
					   with GMEM_SIM_F_WRITE increment it; result = sum read */
#define GMEM_SIM_K_GATHER	6	/* a: user pointer to count (1..4096) __u64 addresses
					   (multiples of 4, any order, duplicates allowed), b: user
					   pointer to count __u32 words, out[k] = word at addr[k];
					   len must be 0; the addresses reach gmem as they are (one
					   fault batch per 256); result = count */

#define GMEM_SIM_F_WRITE	(1u << 0)

struct gmem_sim_launch {
	__u32 argsz;		/* sizeof(struct gmem_sim_launch) */
	__u32 kernel;
	__u32 flags;
	__u32 value;
	__u64 a;
	__u64 b;
	__u64 len;		/* bytes */
	__u64 seed;		/* TOUCH */
	__u64 count;		/* TOUCH: accesses, any value (0: none) */
	__u64 result;		/* out */
	__u64 faults;		/* out: pages reported to gmem as device faults */
	__u64 batches;		/* out: fault batches reported */
	__u64 reserved[2];
};

struct gmem_sim_info {
	__u32 argsz;
	__s32 gmem_id;		/* out: the device id in the GMEM user API */
	__u64 nr_frames;	/* out: device memory, 4 KiB frames */
	__u64 ptes;		/* out: valid 4 KiB PTEs over all contexts */
	__u64 copies;		/* out: pages copied by the copy engine */
	__u64 tlb_flushes;	/* out */
	__u64 ptes_2m;		/* out: valid 2 MiB PTEs over all contexts */
	__u64 splits_2m;	/* out: 2 MiB PTEs split into 4 KiB ones so far */
	__u32 channels;		/* out: copy channels (module parameter copy_channels) */
	__u32 pad;
	__u64 async_calls;	/* out: copy calls started on a channel */
	__u64 async_pages;	/* out: pages the channels' workers copied */
	__u64 inflight;		/* out: copies started and not yet completed */
	__u64 max_inflight;	/* out: most copies in flight at once so far */
	__u64 polled;		/* out: copies completed by gmem's polling (copy_poll) */
};

/*
 * Fault injection: the next copy-engine call on this device that moves more than @after
 * pages copies the first @after of them and then fails with -@err (one shot; arming again
 * replaces it). The first @skip such calls are let through whole (in the order the engine
 * takes them: on channels, the order they were started). A real copy engine can fail part
 * way (a bus or ECC error); this lets the tests check that gmem leaves every page of the
 * batch valid. EINVAL: bad argsz, nonzero reserved, @err not in 1..4095,
 * @after == 2^64 - 1.
 */
struct gmem_sim_fail_copy {
	__u32 argsz;		/* sizeof(struct gmem_sim_fail_copy) */
	__u32 err;		/* positive errno, e.g. EIO */
	__u64 after;		/* pages copied before the failure */
	__u64 skip;		/* calls long enough to fail that still succeed first */
	__u64 reserved;
};

/*
 * The link model: the bandwidth of each path (MB/s, 10^6 bytes per second; 0 unlimited)
 * and a latency per copy-engine call. A copy call takes at least latency + bytes /
 * bandwidth on its path, and calls on one path queue behind each other; zero fills are
 * device-local and not modelled. Module parameters link_{h2d,d2h,d2d}_mbps and
 * link_latency_ns set the initial model (all 0: unmodelled). The ioctl reports the model
 * and, per path, the bytes moved and the modelled busy time since the driver was loaded;
 * with GMEM_SIM_LINK_SET it first replaces the model (transfers under way keep their
 * times; later ones no longer queue behind them). Bytes are counted when a copy call
 * books its path. A waiting copy stops waiting when its task is being killed.
 * EINVAL: bad argsz, unknown flags, nonzero reserved; with GMEM_SIM_LINK_SET, a
 * bandwidth between 1 and 9 MB/s or a latency above 10^9 ns (1 s).
 */
#define GMEM_SIM_PATH_H2D	0	/* host -> this device */
#define GMEM_SIM_PATH_D2H	1	/* this device -> host */
#define GMEM_SIM_PATH_D2D	2	/* this device -> a peer device */
#define GMEM_SIM_LINK_SET	(1u << 0)

struct gmem_sim_link {
	__u32 argsz;		/* sizeof(struct gmem_sim_link) */
	__u32 flags;		/* GMEM_SIM_LINK_SET */
	__u64 mbps[3];		/* in (SET) / out: per GMEM_SIM_PATH_* */
	__u64 latency_ns;	/* in (SET) / out */
	__u64 bytes[3];		/* out: bytes moved per path */
	__u64 busy_ns[3];	/* out: modelled busy time per path */
	__u64 reserved[2];
};

#define GMEM_SIM_IOC_LAUNCH	_IOWR('S', 0x01, struct gmem_sim_launch)
#define GMEM_SIM_IOC_INFO	_IOWR('S', 0x02, struct gmem_sim_info)
#define GMEM_SIM_IOC_FAIL_COPY	_IOW('S', 0x03, struct gmem_sim_fail_copy)
/*
 * Hot-unplug the device (as a PCI remove would): running launches end with ENODEV at
 * their next chunk, gmem saves every page of the device to host memory, and later
 * launches fail with ENODEV. ENODEV if already unplugged. The driver must be reloaded to
 * get the device back.
 */
#define GMEM_SIM_IOC_UNPLUG	_IO('S', 0x04)
#define GMEM_SIM_IOC_LINK	_IOWR('S', 0x05, struct gmem_sim_link)

#endif /* _UAPI_LINUX_GMEM_SIM_H */
