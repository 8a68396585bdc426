/* SPDX-License-Identifier: GPL-2.0 */
/*
 * gmem.ko's trace events (tracefs: events/gmem/). The Rust core emits them through the
 * wrappers of gmem_trace.c (gmem/obj/trace.rs); each event's fields are the same numbers
 * the debugfs/sysfs counters add up, so a trace of a workload sums to the counters' change.
 */
#undef TRACE_SYSTEM
#define TRACE_SYSTEM gmem

#if !defined(_GMEM_TRACE_H) || defined(TRACE_HEADER_MULTI_READ)
#define _GMEM_TRACE_H

#include <linux/tracepoint.h>

/* A device fault batch: unique pages named, service time, result (0 or -errno). */
TRACE_EVENT(gmem_dev_fault,
	TP_PROTO(int dev, u64 space, u32 pages, u64 ns, int err),
	TP_ARGS(dev, space, pages, ns, err),
	TP_STRUCT__entry(
		__field(int, dev)
		__field(u64, space)
		__field(u32, pages)
		__field(u64, ns)
		__field(int, err)
	),
	TP_fast_assign(
		__entry->dev = dev;
		__entry->space = space;
		__entry->pages = pages;
		__entry->ns = ns;
		__entry->err = err;
	),
	TP_printk("dev=%d space=%llu pages=%u ns=%llu err=%d",
		  __entry->dev, __entry->space, __entry->pages, __entry->ns, __entry->err)
);

/*
 * A CPU fault on a GMEM page that reached the executor: where the page was (-1 host or
 * nowhere, else a device), pages the batch moved (the page and its fault-around), result.
 */
TRACE_EVENT(gmem_cpu_fault,
	TP_PROTO(u64 space, u64 addr, bool write, int from, u32 pages, int err),
	TP_ARGS(space, addr, write, from, pages, err),
	TP_STRUCT__entry(
		__field(u64, space)
		__field(u64, addr)
		__field(bool, write)
		__field(int, from)
		__field(u32, pages)
		__field(int, err)
	),
	TP_fast_assign(
		__entry->space = space;
		__entry->addr = addr;
		__entry->write = write;
		__entry->from = from;
		__entry->pages = pages;
		__entry->err = err;
	),
	TP_printk("space=%llu addr=0x%llx write=%d from=%d pages=%u err=%d",
		  __entry->space, __entry->addr, __entry->write, __entry->from, __entry->pages,
		  __entry->err)
);

/* One copy-engine call: direction, the device whose engine ran, the peer (D2D), pages. */
TRACE_EVENT(gmem_migrate,
	TP_PROTO(u32 dir, int dev, int peer, u32 pages),
	TP_ARGS(dir, dev, peer, pages),
	TP_STRUCT__entry(
		__field(u32, dir)
		__field(int, dev)
		__field(int, peer)
		__field(u32, pages)
	),
	TP_fast_assign(
		__entry->dir = dir;
		__entry->dev = dev;
		__entry->peer = peer;
		__entry->pages = pages;
	),
	TP_printk("dir=%s dev=%d peer=%d pages=%u bytes=%llu",
		  __print_symbolic(__entry->dir, { 0, "h2d" }, { 1, "d2h" }, { 2, "d2d" }, { 3, "zero" }),
		  __entry->dev, __entry->peer, __entry->pages, (u64)__entry->pages * 4096)
);

/*
 * One executor batch (a block's steps): pages committed, and where its time went, ns:
 * allocation, revoking mappings, starting and waiting for copies, committing, mapping.
 */
TRACE_EVENT(gmem_batch,
	TP_PROTO(u32 pages, u64 alloc, u64 revoke, u64 copy, u64 commit, u64 map),
	TP_ARGS(pages, alloc, revoke, copy, commit, map),
	TP_STRUCT__entry(
		__field(u32, pages)
		__field(u64, alloc)
		__field(u64, revoke)
		__field(u64, copy)
		__field(u64, commit)
		__field(u64, map)
	),
	TP_fast_assign(
		__entry->pages = pages;
		__entry->alloc = alloc;
		__entry->revoke = revoke;
		__entry->copy = copy;
		__entry->commit = commit;
		__entry->map = map;
	),
	TP_printk("pages=%u alloc_ns=%llu revoke_ns=%llu copy_ns=%llu commit_ns=%llu map_ns=%llu",
		  __entry->pages, __entry->alloc, __entry->revoke, __entry->copy, __entry->commit,
		  __entry->map)
);

/* Pages density prefetch moved to a device after a fault batch. */
TRACE_EVENT(gmem_prefetch,
	TP_PROTO(int dev, u32 pages),
	TP_ARGS(dev, pages),
	TP_STRUCT__entry(
		__field(int, dev)
		__field(u32, pages)
	),
	TP_fast_assign(
		__entry->dev = dev;
		__entry->pages = pages;
	),
	TP_printk("dev=%d pages=%u", __entry->dev, __entry->pages)
);

/* One eviction batch of a device: victims by destination (dirty ones are copied). */
TRACE_EVENT(gmem_evict,
	TP_PROTO(int dev, u32 to_host, u32 to_peer, u32 clean),
	TP_ARGS(dev, to_host, to_peer, clean),
	TP_STRUCT__entry(
		__field(int, dev)
		__field(u32, to_host)
		__field(u32, to_peer)
		__field(u32, clean)
	),
	TP_fast_assign(
		__entry->dev = dev;
		__entry->to_host = to_host;
		__entry->to_peer = to_peer;
		__entry->clean = clean;
	),
	TP_printk("dev=%d to_host=%u to_peer=%u clean=%u",
		  __entry->dev, __entry->to_host, __entry->to_peer, __entry->clean)
);

/* The thrashing detector's verdicts on a fault batch: pages held back, throttled or not. */
TRACE_EVENT(gmem_thrash,
	TP_PROTO(int dev, u32 held, bool throttle),
	TP_ARGS(dev, held, throttle),
	TP_STRUCT__entry(
		__field(int, dev)
		__field(u32, held)
		__field(bool, throttle)
	),
	TP_fast_assign(
		__entry->dev = dev;
		__entry->held = held;
		__entry->throttle = throttle;
	),
	TP_printk("dev=%d held=%u throttle=%d", __entry->dev, __entry->held, __entry->throttle)
);

/* A device left: contexts destroyed, pages evacuated to the host, pages lost. */
TRACE_EVENT(gmem_unregister,
	TP_PROTO(int dev, u32 contexts, u64 evacuated, u64 lost),
	TP_ARGS(dev, contexts, evacuated, lost),
	TP_STRUCT__entry(
		__field(int, dev)
		__field(u32, contexts)
		__field(u64, evacuated)
		__field(u64, lost)
	),
	TP_fast_assign(
		__entry->dev = dev;
		__entry->contexts = contexts;
		__entry->evacuated = evacuated;
		__entry->lost = lost;
	),
	TP_printk("dev=%d contexts=%u evacuated=%llu lost=%llu",
		  __entry->dev, __entry->contexts, __entry->evacuated, __entry->lost)
);

#endif /* _GMEM_TRACE_H */

#undef TRACE_INCLUDE_PATH
#define TRACE_INCLUDE_PATH .
#undef TRACE_INCLUDE_FILE
#define TRACE_INCLUDE_FILE gmem_trace
#include <trace/define_trace.h>
