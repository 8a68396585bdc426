// SPDX-License-Identifier: GPL-2.0
//! Fault paths. Where does a fault go?
//! - CPU fault: `vm_fault` (the VMA's `.fault`, raw `vm_operations_struct`) -> `cpu_fault`.
//! - Device fault: the driver calls `gmem_dev_fault()` with a batch -> `device_fault`.
//!
//! Both end in the block executor with the block's lock held. Also here: the other VMA
//! callbacks (open/close/may_split/mremap) that tie a region's life to its VMA.

use crate::exec::migrate::{self, Env};
use crate::mech::evict::{self, Why};
use crate::mech::{prefetch, readahead, sysmem, thrash};
use crate::obj::device::{DevStats, Device};
use crate::obj::region::{adv, block_base, Pages, Region, ADVICE_RUNS, BLOCK_BYTES, BLOCK_PAGES};
use crate::obj::space::{Space, Thrash};
use crate::obj::{sched, trace, tune};
use crate::policy::batch;
use crate::policy::page_state::{transition, Actions, Event, Loc, PageState, Refused, Target};
use crate::policy::range::AdviceMap;
use core::sync::atomic::Ordering::Relaxed;
use kernel::{
    bindings,
    ffi::{c_long, c_ulong, c_void},
    prelude::*,
    sync::Arc,
};

/// The transition of a CPU access to a page in state `s` (a fault, or ptrace's `.access`).
/// The CPU always maps GMEM pages writable, so it does not share read-only duplicates with
/// devices: any CPU access collapses them like a write.
pub(crate) fn cpu_transition(s: PageState, write: bool) -> core::result::Result<(PageState, Actions), Refused> {
    transition(s, Event::CpuFault { write: write || s.dup_mask() != 0 })
}

/// CPU fault: bring the page to the host and map it. A page pinned on a device, a torn
/// down region or an address outside the region gets SIGBUS.
///
/// Fault-around: when the page comes from a device, the other device pages of its 2 MiB
/// block that the density rule picks (`prefetch::cpu_window`) come home in the same
/// executor batch and are mapped too, so a stream of CPU faults over device memory takes
/// a few batches per block instead of a fault per page. When the page is home already
/// (read ahead, evicted), the block's other unmapped host pages are mapped with it
/// (map-around, no copy). Pinned, lost and advised pages are left alone. A fault that
/// continues a stream (`prefetch::cpu_window`), or leaves its block with nothing on a
/// device, reads the next blocks home ahead of the CPU (`readahead::home_after`).
pub(crate) fn cpu_fault(
    region: &Arc<Region>,
    vmf: *mut bindings::vm_fault,
    addr: usize,
    write: bool,
) -> Result<bindings::vm_fault_t> {
    let i = region.index(addr).ok_or(EFAULT)?;
    let block = region.block(i)?;
    // The CPU moves on to the next block of a stream it read home: the blocks after this
    // one start coming home now, while this fault waits for its block (which a lane may
    // still be bringing home) and maps it.
    let block_va = block_base(addr);
    let after_stream = block_va.checked_sub(BLOCK_BYTES) == Some(region.cpu_at.load(Relaxed));
    // Whether this fault has queued the read-ahead home of the blocks after its own (once
    // per fault: a second call would find the lanes it took busy).
    let mut queued = false;
    if after_stream && tune::PREFETCH.load(Relaxed) {
        readahead::home_after(region, block_va);
        queued = true;
    }
    let mut p = region.lock(&block);
    if region.is_dead() {
        return Err(EFAULT);
    }
    let s = p.state(i);
    let (next, a) = cpu_transition(s, write).map_err(|_| EFAULT)?;
    Space::count(&region.space.stats.cpu_faults);
    let mut steps: KVec<migrate::Step> = KVec::new();
    let mut around: KVec<usize> = KVec::new();
    let home = s.loc() == Loc::Host;
    let mut stream = false;
    if tune::PREFETCH.load(Relaxed) {
        // Fault-around is a bet: if its bookkeeping cannot be had, the page comes alone.
        let _ = match s.loc() {
            Loc::Device(_) => prefetch::cpu_window(region, &p, i, after_stream, &mut around).map(|seq| stream = seq),
            Loc::Host => map_around(region, &p, i, &mut around),
            _ => Ok(()),
        };
    }
    if stream && !queued {
        // The CPU streams through the region: its next blocks start coming home now, while
        // this fault fetches the rest of its own block.
        readahead::home_after(region, block_va);
        queued = true;
    }
    for &j in around.iter() {
        let sj = p.state(j);
        // (`map_around` picked only pages that are home and may be mapped.)
        if !home && (!matches!(sj.loc(), Loc::Device(_)) || sj.pinned()) {
            continue;
        }
        if let Ok((nj, aj)) = cpu_transition(sj, false) {
            steps.push(migrate::Step { i: j, prev: sj, next: nj, a: aj }, GFP_KERNEL)?;
        }
    }
    let at = steps.iter().position(|st| st.i > i).unwrap_or(steps.len());
    let me = migrate::Step { i, prev: s, next, a };
    let mut one = [me];
    if !steps.is_empty() {
        steps.reserve(1, GFP_KERNEL)?;
        // Capacity reserved just above, and `at <= len`.
        steps.insert_within_capacity(at, me).map_err(|_| ENOMEM)?;
    }
    // A lone page (no fault-around) needs no allocation.
    let steps: &mut [migrate::Step] = if steps.is_empty() { &mut one } else { &mut steps };
    let env = Env::access(region, None);
    let mut out = migrate::apply_batch(&env, &mut p, steps);
    // Fault-around is a bet: when the batch failed before the faulting page (a copy error
    // of any page undoes the batch from its failed part on), the page comes alone, once.
    let mut lone = [me];
    let alone = out.done <= at && steps.len() > 1 && out.res.is_err();
    if alone {
        let s = p.state(i);
        let (next, a) = cpu_transition(s, write).map_err(|_| EFAULT)?;
        lone = [migrate::Step { i, prev: s, next, a }];
        out = migrate::apply_batch(&env, &mut p, &lone);
    }
    let (steps, at, a): (&[migrate::Step], usize, _) = if alone { (&lone, 0, lone[0].a) } else { (steps, at, a) };
    let from = match s.loc() {
        Loc::Device(d) => Some(d),
        _ => None,
    };
    let err = if out.done > at { 0 } else { out.res.as_ref().err().map_or(EFAULT.to_errno(), |e| e.to_errno()) };
    trace::cpu_fault(region.space.id, addr, write, from, out.done, err);
    if out.done <= at {
        // The faulting page was not moved (the batch stopped at or before it).
        return Err(out.res.err().unwrap_or(EFAULT));
    }
    // Throttling is the device side's job; the CPU side only records the moves.
    let _ = thrash::record_moves(None, &region.space, region, &steps[..out.done]);
    if !a.map_cpu {
        return Err(EFAULT);
    }
    // The CPU streams home through the region: bring its next block home meanwhile.
    let streamed = from.is_some() || steps.len() > 1;
    if !queued
        && streamed
        && tune::PREFETCH.load(Relaxed)
        && !p.range().any(|j| matches!(p.state(j).loc(), Loc::Device(_)))
    {
        readahead::home_after(region, block_va);
    }
    // SAFETY: `vmf` is the live fault descriptor of a GMEM VMA.
    let vma = unsafe { (*vmf).__bindgen_anon_1.vma };
    // Room for every page up front; without it, runs of one page.
    let mut run: KVec<*mut bindings::page> = KVec::new();
    let batched = run.reserve(out.done, GFP_KERNEL).is_ok();
    let mut at = 0;
    for st in steps[..out.done].iter().filter(|st| st.i != i && st.a.map_cpu) {
        let Some(pg) = p.host(st.i) else { continue };
        if !batched {
            insert_run(vma, region, st.i, &[pg.as_ptr()]);
            continue;
        }
        if !run.is_empty() && st.i != at + run.len() {
            insert_run(vma, region, at, &run);
            run.clear();
        }
        if run.is_empty() {
            at = st.i;
        }
        // Within the capacity reserved above (at most `out.done` pages).
        let _ = run.push_within_capacity(pg.as_ptr());
    }
    insert_run(vma, region, at, &run);
    let page = p.host(i).ok_or(EFAULT)?;
    // SAFETY: `vmf` is the live fault descriptor of a GMEM VMA (VM_MIXEDMAP); the page
    // belongs to the region, which zaps this mapping before it frees or replaces the page
    // (all under the block lock we hold).
    Ok(unsafe { gmem_cpumap_fault(vmf.cast(), page.as_ptr().cast()) })
}

// gmem_cpumap.c. (The kernel structs go as `void *`: bindgen's view of them is not FFI-safe
// to the lint.)
extern "C" {
    fn gmem_cpumap_insert(vma: *mut c_void, addr: c_ulong, pages: *const *mut c_void, n: c_ulong) -> c_long;
    fn gmem_cpumap_fault(vmf: *mut c_void, page: *mut c_void) -> bindings::vm_fault_t;
}

/// Maps the host pages `pages` of `region`, consecutive from page `first`, in the CPU
/// fault's `vma`, as special PTEs (gmem_cpumap.c: GUP-fast must not pin GMEM pages; one
/// page-table walk, one page-table lock per 2 MiB). A page that cannot be mapped now (its
/// address is mapped already, or a page table could not be allocated) faults later and is
/// mapped then; nothing is lost.
fn insert_run(vma: *mut bindings::vm_area_struct, region: &Region, first: usize, pages: &[*mut bindings::page]) {
    let mut done = 0;
    while done < pages.len() {
        let va = region.va(first + done) as c_ulong;
        let rest = &pages[done..];
        // SAFETY: the VMA is live and a GMEM VMA with the mmap read lock held by the fault
        // (without `map_pages`, the kernel retries a per-VMA-lock fault under it); the
        // range lies in the region, hence in the VMA (checked again in C); the pages
        // belong to the region, which zaps these mappings before it frees or replaces them
        // (under the block lock the caller holds). The C side only reads the array.
        let r = unsafe { gmem_cpumap_insert(vma.cast(), va, rest.as_ptr().cast(), rest.len() as c_ulong) };
        // `r` pages were mapped; the one after them (if any) failed and is skipped.
        let Ok(mapped) = usize::try_from(r) else { return };
        done += mapped + 1;
    }
}

/// The pages of page `i`'s block that are home but not mapped by the CPU (read ahead or
/// evicted), without duplicates or advice: a CPU fault on one maps them all.
fn map_around(r: &Region, p: &Pages, i: usize, out: &mut KVec<usize>) -> Result {
    let advice = *r.advice.lock();
    for j in p.range().filter(|&j| j != i) {
        let s = p.state(j);
        if s.loc() == Loc::Host && !s.cpu_mapped() && s.dup_mask() == 0 && advice.get(j as u64) == 0 {
            out.push(j, GFP_KERNEL)?;
        }
    }
    Ok(())
}

/// Device fault: services a coalesced, sorted batch of page addresses of `space` for
/// `dev`, block (2 MiB) by block: the pages of one block and region go to the block
/// executor together, under the block's lock; after each block, density prefetch may fetch
/// more of it.
pub(crate) fn device_fault(dev: &Arc<Device>, space: &Space, addrs: &[u64], write: bool) -> Result {
    let mm = space.mm_user().ok_or(EFAULT)?;
    let mmap = mm.mmap_read_lock();
    DevStats::add(&dev.stats.fault_batches, 1);
    DevStats::add(&dev.stats.faults, addrs.len() as u64);
    let d = u8::try_from(dev.id).map_err(|_| EINVAL)?;
    // The region of the previous address and its VMA: looked up again only when the batch
    // crosses into another region.
    let mut cur: Option<(Arc<Region>, Option<&kernel::mm::virt::VmaRef>)> = None;
    let mut idx: KVec<usize> = KVec::with_capacity(migrate::BATCH_PAGES, GFP_KERNEL)?;
    // Waits for frames in transit, over the whole fault (`evict::make_room_for`).
    let mut waits = 0;
    // Addresses in no region: ordinary process memory, served after the regions' pages,
    // without the mmap lock (mech/sysmem.rs).
    let mut others: KVec<u64> = KVec::new();
    // Read-ahead is asked for by the fault's last block, or else, at the end, after the
    // last block that would have asked (`pending`; the density rule's request waits there
    // too, which for the last block is right away): asked for by an earlier block, it
    // queued its blocks on the link in front of the later blocks this fault still fetches
    // (the next one among them).
    let mut pending: Option<(Arc<Region>, usize)> = None;
    // The block this fault last streamed by the quarter rule, if it was the last one it
    // fetched (a stream continues from it into the next block).
    let mut streamed: Option<(Arc<Region>, usize)> = None;
    let mut blocks = batch::by_block(addrs).peekable();
    while let Some(block) = blocks.next() {
        let last = blocks.peek().is_none();
        let mut faulted = [0u64; 8];
        // The fault's batch took the rest of this block (the stream rule below): no
        // density rule.
        let mut own_ahead = false;
        let mut rest = block;
        while let Some(&a0) = rest.first() {
            let a0 = usize::try_from(a0).map_err(|_| EFAULT)?;
            let (r, vma) = match cur.take() {
                Some((r, v)) if r.index(a0).is_some() => (r, v),
                _ => {
                    let Some(r) = space.region_at(a0) else {
                        others.push(a0 as u64, GFP_KERNEL)?;
                        rest = &rest[1..];
                        continue;
                    };
                    let v = mmap.vma_lookup(r.start).filter(|v| v.start() == r.start);
                    (r, v)
                }
            };
            // The pages of this block that lie in region `r`.
            idx.clear();
            let mut taken = 0;
            for &a in rest {
                let Some(i) = usize::try_from(a).ok().and_then(|a| r.index(a)) else { break };
                idx.push(i, GFP_KERNEL)?;
                let k = (a as usize >> 12) & 511;
                faulted[k / 64] |= 1 << (k % 64);
                taken += 1;
            }
            // A batch that covers a quarter of a block or more starts a stream: it fetches
            // the rest of its block with its own pages (the device is about to touch it),
            // and, if this is the fault's last block, read-ahead of the next blocks starts
            // as soon as this batch's copies are on the link (its first block's copies
            // then follow them), not once they are done (else: `pending`, below). So does
            // a batch of any size in the block right after one that this fault streamed
            // by the quarter rule (not one it continued, nor one the density rule chose,
            // so that a fault strided by 2 MiB does not take whole blocks), while the
            // device has the frames for the rest (the guard of `fault_pages`; without it
            // the block is left to read-ahead, which makes room first): the stream goes on
            // into it. (A device's first fault over a region that does not start on a
            // block boundary covers the region's short first block and a few pages of the
            // next; a trace of PL showed those pages fetched alone, the rest of their
            // block by the density rule in a batch of its own, and read-ahead starting
            // only after both: the link idle for 2.7 ms of the first 8.)
            let continues = streamed
                .as_ref()
                .is_some_and(|(sr, sva)| Arc::ptr_eq(sr, &r) && sva.checked_add(BLOCK_BYTES) == Some(block_base(a0)))
                && rest_fits(dev);
            let quarter = taken >= BLOCK_PAGES / 4;
            let stream = (quarter || continues) && tune::PREFETCH.load(Relaxed);
            let asked = core::cell::Cell::new(false);
            let ask = || {
                if !asked.replace(true) {
                    readahead::after(dev, &r, block_base(a0));
                }
            };
            // The fault's next block is the next one of this region and will be streamed,
            // by the rules above: this block streams by the quarter rule and the device has
            // the frames for the next (`rest_fits`), or the next block's own pages in this
            // region are a quarter of a block. Then read-ahead starts at exactly that block
            // (`readahead::after_next`, even where an earlier chain stopped further on) as
            // soon as this batch's copies are on the link, so that a worker sets up its
            // batch while this one is copied; nothing goes on the link before it, and this
            // fault then finds it fetched, or in flight under its block lock. (A trace of
            // PL's first fault: its second block's batch started 1.9 ms after the first
            // block's copies ended, the link idle meanwhile, and the fault took 13.4 ms.)
            let next_in_stream = tune::PREFETCH.load(Relaxed)
                && blocks.peek().is_some_and(|b| {
                    let in_r = |a: &u64| usize::try_from(*a).is_ok_and(|a| r.index(a).is_some());
                    let adjacent = b.first().filter(|a| in_r(a)).is_some_and(|&n| {
                        block_base(a0).checked_add(BLOCK_BYTES) == usize::try_from(n).ok().map(block_base)
                    });
                    adjacent && ((quarter && rest_fits(dev)) || b.iter().filter(|a| in_r(a)).count() >= BLOCK_PAGES / 4)
                });
            let ask_next = || {
                if !asked.replace(true) {
                    readahead::after_next(dev, &r, block_base(a0));
                }
            };
            let started: Option<&dyn Fn()> =
                if next_in_stream { Some(&ask_next) } else { (stream && last).then_some(&ask) };
            fault_pages(dev, space, (&r, vma), &idx, (write, d), (stream, started), &mut waits)?;
            streamed = (stream && quarter).then(|| (r.clone(), block_base(a0)));
            if stream {
                // The batch took the rest of the block: nothing for the density rule.
                own_ahead = true;
                if last {
                    ask();
                    pending = None;
                } else {
                    pending = Some((r.clone(), block_base(a0)));
                }
            }
            rest = &rest[taken..];
            cur = Some((r, vma));
        }
        if let (Some((r, vma)), Some(&first)) = (&cur, block.first()) {
            if tune::PREFETCH.load(Relaxed) && !own_ahead {
                let block_va = block_base(first as usize);
                if prefetch::on_fault(dev, r, *vma, block_va, &faulted) {
                    // The device streams through the region: fetch its next block while
                    // it computes on this one.
                    pending = Some((r.clone(), block_va));
                }
            }
        }
    }
    if let Some((r, block_va)) = &pending {
        readahead::after(dev, r, *block_va);
    }
    drop(mmap);
    drop(mm);
    sysmem::device_fault(dev, space, &others, write)
}

/// Whether a stream's fault may fetch the rest of its block: the device has a block's
/// frames free above its low watermark (an estimate).
fn rest_fits(dev: &Device) -> bool {
    dev.frames_free_hint() >= dev.low().saturating_add(BLOCK_PAGES as u64)
}

/// The transition of a device access by `d` to page `i` of `r`, with the advice in force
/// (and a page that kept bouncing treated as accessed-by: it stays on the host, mapped
/// remotely, for a while: `thrash`, if any page may be pinned, with the batch's time).
fn dev_fault_step(
    r: &Region,
    p: &Pages,
    advice: &AdviceMap<ADVICE_RUNS>,
    thrash: Option<(&Thrash, u64)>,
    i: usize,
    write: bool,
    d: u8,
) -> core::result::Result<Option<migrate::Step>, Refused> {
    let bits = advice.get(i as u64);
    let s = p.state(i);
    let mut accessed_by = bits & (1 << d) != 0 || adv::preferred(bits) == Some(Target::Host);
    if !accessed_by && s.loc() == Loc::Host && thrash.is_some_and(|(t, now)| t.table.pinned(r.va(i), now)) {
        accessed_by = true;
    }
    let ev = Event::DevFault { dev: d, write, read_mostly: bits & adv::READ_MOSTLY != 0, accessed_by };
    let (next, a) = transition(s, ev)?;
    Ok((next != s || a != Actions::default()).then_some(migrate::Step { i, prev: s, next, a }))
}

/// The pages `idx` (ascending, of one block of `r`, in `vma`) of a device fault (`write`,
/// by device `d`), as executor batches; evicts and retries while the device is full,
/// counting its waits for frames in transit in the fault's `waits`.
///
/// With `rest` (the batch starts a stream), the first batch also fetches the rest of the
/// block (`prefetch::Stepper`), mapped, marked prefetched, if the device has a block's frames
/// free above its low watermark; `started` is called once its copies are on the link.
/// What stops a fetched-ahead page (the device full, a failed copy) only ends the
/// speculation: the faulted pages after it are fetched without it.
#[allow(clippy::too_many_arguments)]
fn fault_pages(
    dev: &Arc<Device>,
    space: &Space,
    (r, vma): (&Arc<Region>, Option<&kernel::mm::virt::VmaRef>),
    idx: &[usize],
    (write, d): (bool, u8),
    (rest, started): (bool, Option<&dyn Fn()>),
    waits: &mut u32,
) -> Result {
    let mut steps: KVec<migrate::Step> =
        KVec::with_capacity(if rest { BLOCK_PAGES.max(idx.len()) } else { idx.len() }, GFP_KERNEL)?;
    let Some(&i0) = idx.first() else { return Ok(()) };
    let block = r.block(i0)?;
    let mut next_page = 0;
    let mut attempts = 0;
    // Speculation never takes the frames the device keeps free (its low watermark): on a
    // full device, the fetched-ahead pages would be what the next eviction pass takes, and
    // under oversubscription (P4, 2x) they came back as extra transfers. Read-ahead makes
    // room first where that pays (`readahead::room_target`).
    let mut rest = rest && rest_fits(dev);
    while next_page < idx.len() {
        let mut p = r.lock(&block);
        if r.is_dead() {
            return Err(EFAULT);
        }
        let advice = *r.advice.lock();
        if !dev.alive() {
            return Err(ENODEV);
        }
        steps.clear();
        // Which steps of the batch are fetched ahead (bit `i - block start`).
        let mut ahead = [0u64; 8];
        let mut refusal = None;
        let b0 = p.range().start;
        // The thrash table is consulted for the whole batch under one acquisition of its
        // lock (a leaf), dropped before the executor runs, and at the batch's time: only
        // while some page may be pinned (per page, the table was scanned for each).
        let now = sched::now_ns();
        let thrash = tune::THRASH.load(Relaxed).then(|| space.thrash.lock()).filter(|t| t.table.any_pinned(now));
        let mut faulted = idx[next_page..].iter().peekable();
        let pages = if rest { p.range() } else { idx[next_page]..idx[idx.len() - 1] + 1 };
        let mut stepper = prefetch::Stepper::new(d);
        for i in pages {
            if faulted.next_if_eq(&&i).is_none() {
                if rest {
                    if let Some(st) = stepper.step(&p, &advice, i) {
                        ahead[(i - b0) / 64] |= 1 << ((i - b0) % 64);
                        // Never allocates under `Space::thrash`, which the unmap watch
                        // takes inside the kernel's invalidation: room for a step per page
                        // of the block (or per faulted page) is reserved above.
                        steps.push_within_capacity(st).map_err(|_| ENOMEM)?;
                    }
                }
                continue;
            }
            match dev_fault_step(r, &p, &advice, thrash.as_deref().map(|t| (t, now)), i, write, d) {
                // (As above: no allocation under `Space::thrash`.)
                Ok(Some(st)) => steps.push_within_capacity(st).map_err(|_| ENOMEM)?,
                Ok(None) => {}
                Err(e) => {
                    refusal = Some(migrate::refusal_errno(e));
                    break;
                }
            }
        }
        drop(thrash);
        let is_ahead = |st: &migrate::Step| ahead[(st.i - b0) / 64] & (1 << ((st.i - b0) % 64)) != 0;
        let env = match started {
            Some(f) => Env::access_then(r, vma, f),
            None => Env::access(r, vma),
        };
        let out = migrate::apply_batch(&env, &mut p, &steps);
        let done = &steps[..out.done];
        let mut own: KVec<migrate::Step> = KVec::new();
        let done = if ahead.iter().any(|&w| w != 0) {
            // The fetched-ahead pages are prefetches, not faults: marked and counted as
            // such, and left out of the fault's own counts and thrash records.
            prefetch::mark(dev, &p, done.iter().filter(|st| is_ahead(st)));
            own.reserve(done.len(), GFP_KERNEL)?;
            for st in done.iter().filter(|st| !is_ahead(st)) {
                // Capacity reserved above.
                let _ = own.push_within_capacity(*st);
            }
            &own[..]
        } else {
            done
        };
        Space::add(&space.stats.dev_faults, done.len() as u64);
        let allocs = done.iter().filter(|st| st.a.alloc_frame.is_some()).count();
        DevStats::add(&dev.stats.fault_allocs, allocs as u64);
        let throttle = thrash::record_moves(Some(dev), space, r, done);
        if out.done < steps.len() {
            let stuck = steps[out.done];
            if is_ahead(&stuck) {
                // Only the speculation stopped: the faulted pages after it go on without.
                drop(p);
                rest = false;
                next_page = idx.iter().position(|&i| i > stuck.i).unwrap_or(idx.len());
                continue;
            }
            match out.res {
                Err(e) if e == ENOSPC => {
                    // The device is full, or the owner's dmem cgroup at its limit there: evict
                    // (within that cgroup; without the block lock), then retry from the
                    // first page that did not get a frame.
                    drop(p);
                    attempts = if out.done > 0 { 1 } else { attempts + 1 };
                    if attempts > 32 {
                        return Err(ENOMEM);
                    }
                    next_page = idx.iter().position(|&i| i == stuck.i).unwrap_or(idx.len());
                    rest = false;
                    let want = (steps.len() - out.done).clamp(32, migrate::BATCH_PAGES);
                    let within = out.limit.as_ref().map(|limit| evict::Within { limit, mm: Some(space.mm()) });
                    if evict::make_room_for(&stuck.a, want, Why::Fault, within, waits)? {
                        // It waited for frames in transit: not a failed round.
                        attempts -= 1;
                    }
                    continue;
                }
                Err(_) if ahead.iter().any(|&w| w != 0) => {
                    // A copy failed in a batch with fetched-ahead pages, and the batch was
                    // undone from its failed part on (a batch not run in parts: whole),
                    // faulted pages included: they are fetched again without the
                    // speculation, whose failure must not fail the fault (its copies
                    // include every page of the block wherever it is: a page on another
                    // driver's device is refused, `EXDEV`). At most once: `rest` is off.
                    drop(p);
                    rest = false;
                    next_page = idx.iter().position(|&i| i >= stuck.i).unwrap_or(idx.len());
                    continue;
                }
                Err(e) => return Err(e),
                Ok(()) => return Err(EINVAL),
            }
        }
        drop(p);
        if throttle {
            // Let the other side make progress before these pages move again.
            kernel::time::delay::fsleep(kernel::time::Delta::from_micros(100));
        }
        out.res?;
        return refusal.map_or(Ok(()), Err);
    }
    Ok(())
}

#[kunit_tests(gmem_fault)]
mod tests {
    use super::*;

    #[test]
    fn batch_coalescing_sorts_aligns_and_dedups() {
        let mut v = [0x5003u64, 0x1000, 0x5fff, 0x1001, 0x20_0000, 0x3000];
        let k = batch::coalesce(&mut v);
        assert_eq!(&v[..k], &[0x1000, 0x3000, 0x5000, 0x20_0000]);
        let blocks: usize = batch::by_block(&v[..k]).count();
        assert_eq!(blocks, 2);
    }
}
