/* SPDX-License-Identifier: GPL-2.0 */
/*
 * GMEM driver API: how an accelerator driver plugs into gmem.ko.
 *
 * Documentation/driver-api.rst is the driver author's guide; this header is the reference.
 * Every item carries a kernel-doc comment (scripts/check-kdoc.py checks that, and that
 * scripts/kernel-doc -Wall has nothing to say about it).
 */
#ifndef _LINUX_GMEM_H
#define _LINUX_GMEM_H

#include <linux/types.h>

/**
 * DOC: Overview
 *
 * A driver registers a device with a table of callbacks (&struct gmem_dev_ops) and the
 * size of its memory pool in 4 KiB frames (&struct gmem_dev_props). The core owns
 * placement: it allocates frames, decides what moves where, and drives the driver's page
 * table and copy engine through the callbacks. The driver reports device page faults in
 * batches with gmem_dev_fault(), inside a reference on the faulting process's space
 * (gmem_space_get_current()) and its context (gmem_space_ctx()).
 *
 * Contract of every callback: it may sleep; it is never called with a spinlock held (but
 * usually with gmem mutexes held, and on the fault and advice paths with the space's mmap
 * lock); it must not call back into gmem. No callback is made with a context after ctx_destroy() of that context started,
 * and none at all after gmem_dev_unregister() returned. For a device with
 * &gmem_dev_ops.map_prepare, @unmap and @tlb_invalidate are also called by gmem's MMU
 * notifier, from any task that changes the process's page tables, memory reclaim included:
 * they must not allocate memory that may reclaim, and the driver must not allocate that way
 * while it holds a lock they take.
 */

/**
 * define GMEM_DRIVER_ABI_VERSION - version of this API, for &gmem_dev_props.abi_version
 *
 * 2: the ops gained @test_clear_accessed; 3: 2 MiB device mappings (&gmem_pte.flags,
 * &gmem_dev_props.caps); 4: asynchronous copies (&gmem_dev_ops.copy_async,
 * &gmem_dev_props.nr_channels, gmem_fence_signal()); 5: process memory outside GMEM
 * regions (&gmem_dev_ops.map_prepare, %GMEM_PTE_SYSMEM); 6: %GMEM_PTE_SYSMEM entries may
 * name a frame (process memory migrated to the device); 7: the ops gained
 * @test_clear_accessed_range; 8: the ops gained @copy_poll, and gmem_fence_expect().
 * &struct gmem_dev_ops has no size
 * field: the version stands for its length, so any growth of the table bumps it.
 * Registration refuses other versions.
 */
#define GMEM_DRIVER_ABI_VERSION 8

struct page;
struct gmem_dev;
struct gmem_space;
struct gmem_fence;

/**
 * define GMEM_ACCESS_READ - a device fault on a read (gmem_dev_fault() @access)
 */
#define GMEM_ACCESS_READ	1u
/**
 * define GMEM_ACCESS_WRITE - a device fault on a write: a read-only mapping is not enough
 */
#define GMEM_ACCESS_WRITE	2u

/**
 * define GMEM_PROT_READ - &gmem_pte.prot: the device may read through the entry (always set)
 */
#define GMEM_PROT_READ		1u
/**
 * define GMEM_PROT_WRITE - &gmem_pte.prot: the device may also write through the entry
 *
 * A clean page (whose host copy is still valid) is mapped without it, so that the device's
 * first write faults and gmem learns the page is dirty.
 */
#define GMEM_PROT_WRITE		2u

/**
 * define GMEM_PTE_2M - &gmem_pte.flags: one entry for the 512 pages of a 2 MiB block
 *
 * Sent only to a device that declared %GMEM_DEV_CAP_MAP_2M.
 */
#define GMEM_PTE_2M		1u

/**
 * define GMEM_PTE_SYSMEM - &gmem_pte.flags: the entry maps ordinary process memory
 *
 * The page belongs to an anonymous or file mapping of the process, not to a GMEM region:
 * either @host (a host page, mapped remotely) or, with @host NULL, frame @frame, which a
 * page of the process migrated to (gmem owns it as a device-private page of the device,
 * and a CPU access moves it back). The kernel may free, migrate or swap such a page at any
 * time, and gmem's MMU notifier unmaps the entry (@unmap, @tlb_invalidate) before it does. So gmem calls @map with such entries
 * under a lock that this notifier takes, and the notifier can run inside memory reclaim:
 * @map must not allocate memory that may reclaim for them. If it needs memory it returns
 * -EAGAIN (entries it installed before may stay), and gmem calls
 * &gmem_dev_ops.map_prepare for the range without the lock and tries again. Only sent to
 * a device that has @map_prepare.
 */
#define GMEM_PTE_SYSMEM		2u

/**
 * struct gmem_pte - one device page-table entry to install
 * @va: device virtual address (the process's address), page aligned; 2 MiB aligned with
 *      %GMEM_PTE_2M
 * @frame: frame index in this device's pool (when @host is NULL); with %GMEM_PTE_2M the
 *         first of 512 frames, a multiple of 512
 * @host: if non-NULL, map this host page remotely (over the link, no migration) and
 *        ignore @frame; it stays allocated until an unmap of @va returned
 * @prot: %GMEM_PROT_READ, or %GMEM_PROT_READ | %GMEM_PROT_WRITE
 * @flags: 0, %GMEM_PTE_2M (was padding before ABI 3), or %GMEM_PTE_SYSMEM
 *
 * With %GMEM_PTE_2M the entry maps the 2 MiB at @va to frames @frame .. @frame + 511,
 * all with @prot, @host NULL, replacing whatever 4 KiB entries the range had. The core
 * sends one only when every page of the block is resident on the device in exactly
 * those frames.
 */
struct gmem_pte {
	__u64 va;
	__u64 frame;
	struct page *host;
	__u32 prot;
	__u32 flags;
};

/**
 * define GMEM_COPY_H2D - copy direction: host page &gmem_copy.host -> frame &gmem_copy.frame
 */
#define GMEM_COPY_H2D		0u
/**
 * define GMEM_COPY_D2H - copy direction: frame &gmem_copy.frame -> host page &gmem_copy.host
 *
 * The whole host page must be written: gmem does not clear it first.
 */
#define GMEM_COPY_D2H		1u
/**
 * define GMEM_COPY_D2D - copy direction: frame &gmem_copy.frame -> &gmem_copy.peer_frame
 * of the peer device (another device registered with the same ops table)
 */
#define GMEM_COPY_D2D		2u
/**
 * define GMEM_COPY_ZERO - copy direction: zero-fill frame &gmem_copy.frame (host unused)
 */
#define GMEM_COPY_ZERO		3u

/**
 * struct gmem_copy - one page of a copy batch
 * @host: source of %GMEM_COPY_H2D, destination of %GMEM_COPY_D2H; NULL otherwise
 * @frame: a frame of the device whose @copy op is called
 * @peer_frame: destination frame on the peer device (%GMEM_COPY_D2D only)
 *
 * gmem owns every page and frame named here for the duration of the call; source and
 * destination never overlap.
 */
struct gmem_copy {
	struct page *host;
	__u64 frame;
	__u64 peer_frame;
};

/**
 * struct gmem_dev_ops - the callbacks of a device
 * @ctx_create: create the device page table ("context") of one address space and store
 *	it in *@ctx. Returns 0 or a negative errno (propagated to whoever needed it).
 * @ctx_destroy: destroy a context. Called once per context, when its space dies or at
 *	gmem_dev_unregister(); no callback uses it afterwards.
 * @map: install @n entries in @ctx. An existing entry is only ever replaced by one with
 *	the same target and more rights, or 4 KiB entries by a 2 MiB entry over the same
 *	frames (gmem unmaps before it points an address elsewhere). A 4 KiB entry inside a
 *	2 MiB one splits the 2 MiB entry first. Must not fail for valid input except with
 *	-ENOMEM (-EAGAIN for %GMEM_PTE_SYSMEM entries); entries installed before a failure
 *	may stay (gmem unmaps them like any other when the page moves). A call carries
 *	either only %GMEM_PTE_SYSMEM entries or none.
 * @unmap: remove the entries of [@va, @va + @npages * 4K) in @ctx; missing ones are
 *	ignored. A 2 MiB entry the range covers only in part is split (the pages outside
 *	stay mapped, same frames and protection). Cannot fail, so a driver that maps 2 MiB
 *	entries keeps what a split needs at hand.
 * @tlb_invalidate: called right after every @unmap with the same range: once it returns,
 *	no device access through the removed entries is in flight or can start.
 * @copy: copy @n pages in direction @dir (a GMEM_COPY_* value); @peer_drv is the
 *	peer's @drv for %GMEM_COPY_D2D, NULL otherwise. Synchronous: the data is at the
 *	destination on return 0. On error the migration is abandoned (the source stays
 *	valid) and the errno propagated. Used when the device declared no channel, and
 *	for a batch that comes to a single copy (nothing to overlap).
 * @map_prepare: optional: get ready, with memory reclaim allowed, for a @map of
 *	%GMEM_PTE_SYSMEM entries in [@va, @va + @npages * 4K) that allocates nothing (say,
 *	allocate the page-table levels of the range). 0 or -ENOMEM. What it prepared may be
 *	used up or freed again by any later @map or @unmap: gmem calls it again when @map
 *	answers -EAGAIN. A device without it is not offered process memory outside GMEM
 *	regions (gmem_dev_fault() fails such addresses with -EFAULT).
 * @copy_async: optional: start the same copy on copy channel @chan (0 ..
 *	&gmem_dev_props.nr_channels - 1) and return at once. Return 0 if the driver took
 *	the copy: it then calls gmem_fence_signal(@fence, err) exactly once, from any
 *	context, when the data is at the destination (err 0) or the copy failed (err < 0),
 *	and touches none of the pages, frames and entries named after that. A negative
 *	return refuses the copy: nothing was copied and @fence is not signalled (any other
 *	non-zero return is taken as -EIO: refused too). @c stays
 *	valid until the fence is signalled. See "Asynchronous copies" in
 *	Documentation/driver-api.rst for the ordering rules.
 * @frame_page: optional: the host-visible page behind a frame (kept valid while the
 *	device is registered), or NULL if the CPU cannot map it. Reserved: this version of
 *	the core does not call it.
 * @test_clear_accessed: optional: test and clear the device's accessed bit of the page
 *	at @va in @ctx; 1 if the device touched it since the last call, 0 if not or if
 *	unmapped. Pages under a 2 MiB entry answer one by one (hardware with one bit per
 *	2 MiB entry shadows it per page). Feeds replacement (second chance) and prefetch
 *	accounting; without it gmem sees only accesses that fault.
 * @test_clear_accessed_range: optional: the same for up to 512 pages at once: the
 *	@npages pages from @va (page aligned; the range may cross a 2 MiB boundary). On
 *	entry bit k of @bits (word k / 64, bit k % 64; (@npages + 63) / 64 words) selects
 *	page k; each selected page's bit is tested and cleared, and on return bit k is set
 *	if and only if page k was selected and touched. Pages not selected keep their
 *	accessed bits. 0, or a negative errno (gmem then reads every bit as 0). gmem uses
 *	it instead of @test_clear_accessed when both are there: one or two calls (one
 *	page-table lock each) per 2 MiB block eviction considers.
 * @copy_poll: optional: signal now, from the caller's thread, every copy of channel
 *	@chan whose data is at its destination and which the driver would otherwise
 *	signal later (from its completion interrupt, say); copies still running are left
 *	alone. gmem calls it while it waits for a copy whose fence the driver gave an
 *	expected completion time (gmem_fence_expect()), from shortly before that time on,
 *	instead of sleeping through the interrupt's latency and its own wake-up (this
 *	version: for the parts of a batch committed part by part). Must not sleep; may run
 *	concurrently with the channel's own completions (each copy is still signalled
 *	exactly once).
 *
 * Every callback gets the @drv of &struct gmem_dev_props first. Every callback may sleep,
 * is never called with a spinlock held, may run concurrently with any other (for other
 * pages, spaces and devices) and from any task, and must not call into gmem (but for
 * gmem_fence_signal() and gmem_fence_expect()). All but @frame_page, @test_clear_accessed,
 * @test_clear_accessed_range, @copy_async, @map_prepare and @copy_poll are mandatory.
 */
struct gmem_dev_ops {
	int (*ctx_create)(void *drv, void **ctx);
	void (*ctx_destroy)(void *drv, void *ctx);
	int (*map)(void *drv, void *ctx, const struct gmem_pte *ptes, __u32 n);
	void (*unmap)(void *drv, void *ctx, __u64 va, __u64 npages);
	void (*tlb_invalidate)(void *drv, void *ctx, __u64 va, __u64 npages);
	int (*copy)(void *drv, __u32 dir, const struct gmem_copy *c, __u32 n, void *peer_drv);
	struct page *(*frame_page)(void *drv, __u64 frame);
	int (*test_clear_accessed)(void *drv, void *ctx, __u64 va);
	int (*copy_async)(void *drv, __u32 chan, __u32 dir, const struct gmem_copy *c, __u32 n,
			  void *peer_drv, struct gmem_fence *fence);
	int (*map_prepare)(void *drv, void *ctx, __u64 va, __u64 npages);
	int (*test_clear_accessed_range)(void *drv, void *ctx, __u64 va, __u32 npages, __u64 *bits);
	void (*copy_poll)(void *drv, __u32 chan);
};

/**
 * define GMEM_DEV_CAP_MAP_2M - &gmem_dev_props.caps: @map takes %GMEM_PTE_2M entries
 */
#define GMEM_DEV_CAP_MAP_2M	1u

/**
 * define GMEM_MAX_CHANNELS - most copy channels a device may declare
 */
#define GMEM_MAX_CHANNELS	16u

/**
 * struct gmem_dev_props - what a driver tells gmem about a device at registration
 * @size: sizeof(struct gmem_dev_props)
 * @abi_version: %GMEM_DRIVER_ABI_VERSION
 * @name: the device's name (read during the call only; not used by the core at this
 *        version)
 * @nr_frames: capacity of the device memory pool, in 4 KiB frames (1 .. U32_MAX)
 * @drv: opaque; passed back as the first argument of every callback
 * @caps: GMEM_DEV_CAP_* bits; unknown bits are refused
 * @nr_channels: copy channels that run at the same time (0 .. %GMEM_MAX_CHANNELS; was
 *               a reserved zero before ABI 4). 0 means synchronous copies only: gmem
 *               then never calls &gmem_dev_ops.copy_async. At least 1 needs @copy_async.
 */
struct gmem_dev_props {
	__u32 size;
	__u32 abi_version;
	const char *name;
	__u64 nr_frames;
	void *drv;
	__u32 caps;
	__u32 nr_channels;
};

/**
 * gmem_dev_register() - register a device
 * @ops: its callbacks; must stay valid and unchanged until gmem_dev_unregister() returned
 * @props: its properties; read during the call only
 *
 * Context: process context, may sleep. gmem.ko must be loaded (the symbol is its own).
 * Return: the device, or ERR_PTR(-EINVAL) for a bad @ops/@props (NULL, wrong size or
 * version, a mandatory op missing, @nr_frames out of range, unknown caps,
 * &gmem_dev_props.nr_channels above %GMEM_MAX_CHANNELS or nonzero without @copy_async),
 * ERR_PTR(-EBUSY) when 16 devices are registered, ERR_PTR(-ENOMEM).
 */
struct gmem_dev *gmem_dev_register(const struct gmem_dev_ops *ops,
				   const struct gmem_dev_props *props);

/**
 * gmem_dev_unregister() - remove a device, saving its pages
 * @dev: a device from gmem_dev_register(), not yet unregistered
 *
 * Marks the device dead, evacuates every page resident on it to host memory (retrying
 * with backoff; a page whose data still cannot be saved becomes "lost": SIGBUS/-EIO/QUERY
 * GMEM_LOC_LOST), waits for every callback of the device still running and for every
 * asynchronous copy it accepted (as source or as peer) to be signalled, destroys every
 * context of the device, then forgets the device. The callbacks, and the signalling of
 * accepted copies, must keep working during the call.
 *
 * Context: process context, may sleep for long (evacuation). Call it once, with no lock
 * held that a callback takes, after the driver stopped calling gmem_dev_fault() and
 * using its contexts for the device (this is the driver's hot-unplug quiescing).
 * No callback is made after it returns; the driver may then free @drv and its memory.
 */
void gmem_dev_unregister(struct gmem_dev *dev);

/**
 * gmem_dev_id() - the device's id in the user API
 * @dev: a registered device
 *
 * Context: any.
 * Return: the small integer id (0..15) userspace uses to name the device.
 */
int gmem_dev_id(const struct gmem_dev *dev);

/**
 * gmem_space_get_current() - the GMEM space of the calling process, with a reference
 *
 * Context: process context.
 * Return: the space, or ERR_PTR(-ENOENT) if the process has no /dev/gmem open.
 */
struct gmem_space *gmem_space_get_current(void);

/**
 * gmem_space_put() - drop a space reference
 * @space: from gmem_space_get_current(); NULL and ERR_PTR values are ignored
 *
 * Dropping the last reference destroys the space and calls @ctx_destroy of every device
 * that has a context in it (so do not hold a lock that @ctx_destroy takes). It also removes
 * the space's MMU notifiers, which waits for every MMU-notifier callback running in the
 * system (through which gmem calls @unmap and @tlb_invalidate): so never call it from an
 * MMU-notifier callback, nor with a lock held that those callbacks take.
 *
 * Context: process context, may sleep.
 */
void gmem_space_put(struct gmem_space *space);

/**
 * gmem_space_ctx() - the device's context (page table) for a space
 * @dev: a registered device
 * @space: a space the caller holds a reference on
 *
 * Created through @ctx_create on first use. Valid while the caller holds its reference
 * on @space and the device is registered.
 *
 * Context: process context, may sleep.
 * Return: the context, ERR_PTR(-EINVAL) for NULL arguments, ERR_PTR(-ENODEV) if the
 * device is unregistering and has no context in @space yet, or the error of @ctx_create.
 */
void *gmem_space_ctx(struct gmem_dev *dev, struct gmem_space *space);

/**
 * gmem_dev_fault() - service a batch of device faults
 * @dev: the faulting device
 * @space: the space the faulting kernel runs in (a reference the caller holds)
 * @addrs: @n addresses of @space: any order, duplicates and any offset in a page allowed
 * @n: 1 .. 4096
 * @access: %GMEM_ACCESS_READ and/or %GMEM_ACCESS_WRITE, for the whole batch
 *
 * Migrates or maps every page named so that, on return 0, each is mapped in the device's
 * context for @space with at least the access asked for. An address outside the GMEM regions
 * of @space is served from the process's own mappings (anonymous memory, stack, private
 * or shared file mappings): its host page is faulted in as a CPU access would, and mapped
 * remotely (%GMEM_PTE_SYSMEM) until the kernel changes or frees it; only for a device
 * with &gmem_dev_ops.map_prepare. Concurrent CPU faults, other
 * devices, advice or eviction may revoke a mapping again before the device retries, so
 * the device must be able to fault again (replay).
 *
 * Context: process context, may sleep (it may evict other pages, in the calling task);
 * not from a callback, nor with the space's mmap lock or a lock a callback takes held.
 * Return: 0, or (the device must fail the kernel that faulted):
 * -EFAULT an address is neither in a GMEM region of @space nor in a readable mapping of
 * the process that gmem can mirror (not VM_IO/VM_PFNMAP/VM_MIXEDMAP, not memfd_secret),
 * or is one that no device can map (device memory), the device has no @map_prepare for
 * one outside the regions, the region was torn down concurrently, or the process is
 * exiting;
 * -EPERM a write to process memory the process may only read, or to a shadow stack
 * (outside GMEM regions);
 * -EINTR a fatal signal while faulting in process memory, or, on a full device,
 * instead of evicting or waiting for frames in transit for the calling task;
 * -ENODEV the device, or a device a page must be copied from or to, is unregistering;
 * -EBUSY the page is pinned on another device; or (process memory outside the regions)
 * the process kept changing that memory while it was faulted in (64 snapshots in a row
 * went stale, or a second without progress);
 * -ENOMEM no device frame could be freed (all pinned, eviction failed, or 32
 * evict-and-retry rounds did not get one) or host memory ran out;
 * -EIO a page's data was lost when the device holding it was unregistered;
 * -EXDEV a peer copy was needed between devices of different drivers;
 * -EINVAL bad arguments; other negative values are the driver's own callback errors.
 */
int gmem_dev_fault(struct gmem_dev *dev, struct gmem_space *space,
		   const __u64 *addrs, __u32 n, __u32 access);

/**
 * gmem_fence_signal() - complete an asynchronous copy
 * @fence: the fence gmem passed to &gmem_dev_ops.copy_async with the copy
 * @err: 0 if every page of the copy is at its destination, else a negative errno
 *
 * Called exactly once per copy the driver accepted. After it returns the fence may be
 * gone and gmem may map, free or reuse every page and frame the copy named: the driver
 * must be done with them (its DMA finished) before it signals.
 *
 * Context: any (process, softirq or hard interrupt); does not sleep.
 */
void gmem_fence_signal(struct gmem_fence *fence, int err);

/**
 * gmem_fence_expect() - say when an asynchronous copy is expected to complete
 * @fence: the fence gmem passed to &gmem_dev_ops.copy_async, not yet signalled
 * @ns: the CLOCK_MONOTONIC time (ktime_get_ns()) at which the driver expects to signal it
 *
 * Optional, for a driver with &gmem_dev_ops.copy_poll, called from within
 * &gmem_dev_ops.copy_async or later, before the fence is signalled (typically once the
 * copy has its place in the channel's queue). A waiter then sleeps until shortly before @ns and polls the
 * channel from then on. An estimate is enough: gmem only uses it to decide when to poll,
 * and the fence counts as done only when it is signalled.
 *
 * Context: any; does not sleep.
 */
void gmem_fence_expect(struct gmem_fence *fence, __u64 ns);

/**
 * gmem_dev_set_links() - report the bandwidth of a device's links
 * @dev: a device from gmem_dev_register(), not yet unregistered
 * @h2d_mbps: host memory to the device, MB/s (10^6 bytes per second); 0 if unknown
 * @d2h_mbps: the device to host memory, MB/s; 0 if unknown
 * @d2d_mbps: the device to a peer device of the same driver, MB/s; 0 if unknown
 *
 * Optional. gmem uses the figures to choose paths: a large host-to-device copy may be
 * routed in part through an idle peer (into staging frames of the peer on the peer's host
 * link, then on to the destination over the peer's device link) when the links say that
 * is faster. Every device starts with all links unknown, and nothing is routed over an
 * unknown link. May be called again whenever the figures change.
 *
 * Context: any; does not sleep.
 */
void gmem_dev_set_links(struct gmem_dev *dev, __u64 h2d_mbps, __u64 d2h_mbps, __u64 d2d_mbps);

#endif /* _LINUX_GMEM_H */
