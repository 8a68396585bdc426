// SPDX-License-Identifier: GPL-2.0
/*
 * gmem.ko's trace events (gmem_trace.h), instantiated here, and one plain function per
 * event for the Rust core (gmem/obj/trace.rs): trace_*() are static inlines, and the 7.3
 * Rust tracepoint macro only reaches events of the kernel's own bindings. Each wrapper
 * costs a call and the event's static-key test when the event is off.
 */
#define CREATE_TRACE_POINTS
#include "gmem_trace.h"

#define GMEM_TRACE_FN(name, proto, args)	\
	void gmem_trace_##name(proto);		\
	void gmem_trace_##name(proto)		\
	{					\
		trace_gmem_##name(args);	\
	}

#define P(...) __VA_ARGS__
GMEM_TRACE_FN(dev_fault, P(int dev, u64 space, u32 pages, u64 ns, int err), P(dev, space, pages, ns, err))
GMEM_TRACE_FN(cpu_fault, P(u64 space, u64 addr, bool write, int from, u32 pages, int err),
	      P(space, addr, write, from, pages, err))
GMEM_TRACE_FN(migrate, P(u32 dir, int dev, int peer, u32 pages), P(dir, dev, peer, pages))
GMEM_TRACE_FN(batch, P(u32 pages, u64 alloc, u64 revoke, u64 copy, u64 commit, u64 map),
	      P(pages, alloc, revoke, copy, commit, map))
GMEM_TRACE_FN(prefetch, P(int dev, u32 pages), P(dev, pages))
GMEM_TRACE_FN(evict, P(int dev, u32 to_host, u32 to_peer, u32 clean), P(dev, to_host, to_peer, clean))
GMEM_TRACE_FN(thrash, P(int dev, u32 held, bool throttle), P(dev, held, throttle))
GMEM_TRACE_FN(unregister, P(int dev, u32 contexts, u64 evacuated, u64 lost), P(dev, contexts, evacuated, lost))
