// SPDX-License-Identifier: GPL-2.0
//! Fault paths. Where does a fault go?
//! - CPU fault: `vm_fault` (the VMA's `.fault`, raw `vm_operations_struct`) -> `cpu_fault`.
//! - Device fault: the driver calls `gmem_dev_fault()` with a batch -> `device_fault`.
//!
//! Both end in the block executor with the block's lock held. Also here: the other VMA
//! callbacks (open/close/may_split/mremap) that tie a region's life to its VMA.

use crate::abi::{GmemDevHandle, GmemSpaceHandle, GMEM_ACCESS_READ, GMEM_ACCESS_WRITE};
use crate::device::{DevStats, Device};
use crate::migrate::{self, Env};
use crate::policy::batch;
use crate::evict::{self, Why};
use crate::policy::page_state::{transition, Actions, Copy, Event, Loc, PageState, Refused, Target};
use crate::policy::thrash::{ThrashParams, Verdict};
use crate::{prefetch, tune};
use core::sync::atomic::Ordering::Relaxed;
use crate::region::{adv, Pages, Region, ADVICE_RUNS};
use crate::policy::range::AdviceMap;
use crate::space::{self, Space, Thrash};
use kernel::{
    bindings,
    ffi::{c_int, c_ulong, c_void},
    prelude::*,
    sync::{Arc, ArcBorrow},
};

/// Largest batch a driver may report at once.
pub(crate) const MAX_BATCH: u32 = 4096;

/// The VMA callbacks of every GMEM region.
pub(crate) static VM_OPS: bindings::vm_operations_struct = bindings::vm_operations_struct {
    open: Some(vm_open),
    close: Some(vm_close),
    may_split: Some(vm_may_split),
    mremap: Some(vm_mremap),
    fault: Some(vm_fault),
    access: Some(vm_access),
    // SAFETY: all-zero is a valid `vm_operations_struct` (every other callback absent).
    ..unsafe { core::mem::zeroed() }
};

/// The region of a GMEM VMA.
///
/// # Safety
/// `vma` must be a live GMEM VMA: `vm_private_data` holds an `Arc<Region>` reference
/// (taken in mmap or `vm_open`, given back in `vm_close`).
unsafe fn region_of<'a>(vma: *mut bindings::vm_area_struct) -> ArcBorrow<'a, Region> {
    // SAFETY: by the function's contract.
    unsafe { ArcBorrow::from_raw((*vma).vm_private_data.cast::<Region>().cast_const()) }
}

/// Stores a region reference in a VMA being set up.
///
/// # Safety
/// `vma` must be a VMA under construction by our mmap handler.
pub(crate) unsafe fn attach(vma: *mut bindings::vm_area_struct, region: Arc<Region>) {
    // SAFETY: the VMA is being set up under the mmap write lock; we own these fields.
    unsafe {
        (*vma).vm_ops = &VM_OPS;
        (*vma).vm_private_data = Arc::into_raw(region).cast_mut().cast::<c_void>();
    }
}

/// A copy of a VMA (split is refused, but mremap copies before it asks us): one more ref.
unsafe extern "C" fn vm_open(vma: *mut bindings::vm_area_struct) {
    // SAFETY: `vma` is a copy of a GMEM VMA, so it carries the original's pointer.
    let r: Arc<Region> = unsafe { region_of(vma) }.into();
    core::mem::forget(r);
}

/// The VMA goes away: drop its reference; if it is the region's own VMA, free the region.
unsafe extern "C" fn vm_close(vma: *mut bindings::vm_area_struct) {
    // SAFETY: `vma` is a GMEM VMA; this gives back the reference taken for it.
    let region = unsafe { Arc::<Region>::from_raw((*vma).vm_private_data.cast::<Region>().cast_const()) };
    // SAFETY: `vma` is valid during the callback.
    let start = unsafe { kernel::mm::virt::VmaRef::from_raw(vma) }.start();
    if start == region.start {
        migrate::teardown(&region);
    }
}

/// Partial munmap/mprotect splits are refused: a region lives and dies whole.
unsafe extern "C" fn vm_may_split(_vma: *mut bindings::vm_area_struct, _addr: c_ulong) -> c_int {
    EINVAL.to_errno()
}

/// ptrace / `/proc/PID/mem` access: GUP refuses GMEM VMAs (`VM_IO`), so the kernel asks
/// us (`access.rs`). Returns the bytes copied (within one page) or a negative errno.
unsafe extern "C" fn vm_access(vma: *mut bindings::vm_area_struct, addr: c_ulong, buf: *mut c_void, len: c_int, write: c_int) -> c_int {
    let Ok(len) = usize::try_from(len) else { return EINVAL.to_errno() };
    // SAFETY: `vma` is a live GMEM VMA (these ops are only installed on ours).
    let region: Arc<Region> = unsafe { region_of(vma) }.into();
    // SAFETY: `access_remote_vm` passes a kernel buffer of `len` bytes.
    match unsafe { crate::access::access(&region, addr as usize, buf.cast(), len, write != 0) } {
        // At most one page: fits in a `c_int`.
        Ok(n) => n as c_int,
        Err(e) => e.to_errno(),
    }
}

/// Regions do not move.
unsafe extern "C" fn vm_mremap(_vma: *mut bindings::vm_area_struct) -> c_int {
    EINVAL.to_errno()
}

unsafe extern "C" fn vm_fault(vmf: *mut bindings::vm_fault) -> bindings::vm_fault_t {
    // SAFETY: the kernel passes a valid fault descriptor for a GMEM VMA.
    let (vma, addr, flags) = unsafe { ((*vmf).__bindgen_anon_1.vma, (*vmf).__bindgen_anon_1.address, (*vmf).flags) };
    // SAFETY: the faulting VMA is a GMEM VMA (these ops are only installed on ours).
    let region = unsafe { region_of(vma) };
    let write = flags & bindings::fault_flag_FAULT_FLAG_WRITE != 0;
    let region: Arc<Region> = region.into();
    match cpu_fault(&region, vmf, addr as usize, write) {
        Ok(r) => r,
        // Out of host memory (or over the memory cgroup's limit) included: the access fails
        // cleanly with SIGBUS instead of killing something (see host_page.rs).
        Err(_) => bindings::vm_fault_reason_VM_FAULT_SIGBUS,
    }
}

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
/// a few batches per block instead of a fault per page. Pinned, lost and advised pages
/// are left alone.
fn cpu_fault(region: &Arc<Region>, vmf: *mut bindings::vm_fault, addr: usize, write: bool) -> Result<bindings::vm_fault_t> {
    let i = region.index(addr).ok_or(EFAULT)?;
    let block = region.block(i)?;
    let mut p = region.lock(&block);
    if region.is_dead() {
        return Err(EFAULT);
    }
    let s = p.state(i);
    let (next, a) = cpu_transition(s, write).map_err(|_| EFAULT)?;
    Space::count(&region.space.stats.cpu_faults);
    let mut steps: KVec<migrate::Step> = KVec::new();
    let mut around: KVec<usize> = KVec::new();
    if matches!(s.loc(), Loc::Device(_)) && tune::PREFETCH.load(Relaxed) {
        // Fault-around is a bet: if its bookkeeping cannot be had, the page comes alone.
        let _ = prefetch::cpu_window(region, &p, i, &mut around);
    }
    for &j in around.iter() {
        let sj = p.state(j);
        if !matches!(sj.loc(), Loc::Device(_)) || sj.pinned() {
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
    let out = migrate::apply_batch(&Env::access(region, None), &mut p, steps);
    if out.done <= at {
        // The faulting page was not moved (the batch stopped at or before it).
        return Err(out.res.err().unwrap_or(EFAULT));
    }
    // Throttling is the device side's job; the CPU side only records the moves.
    let _ = record_moves(None, &region.space, region, &steps[..out.done]);
    if !a.map_cpu {
        return Err(EFAULT);
    }
    // SAFETY: `vmf` is the live fault descriptor of a GMEM VMA.
    let vma = unsafe { (*vmf).__bindgen_anon_1.vma };
    for st in steps[..out.done].iter().filter(|st| st.i != i && st.a.map_cpu) {
        let Some(pg) = p.host(st.i) else { continue };
        // A page that cannot be mapped now (its state says mapped) faults later and is
        // mapped then; nothing is lost.
        // SAFETY: the VMA is live and VM_MIXEDMAP (set at mmap) with the mmap or VMA lock
        // held by the fault; the page belongs to the region, which keeps it until it zaps
        // this mapping (under the block lock we hold).
        let _ = unsafe { bindings::vm_insert_page(vma, region.va(st.i) as c_ulong, pg.as_ptr()) };
    }
    let page = p.host(i).ok_or(EFAULT)?;
    // SAFETY: `vmf` is the live fault descriptor; the page belongs to the region, which
    // keeps it until it zaps this mapping (all under the block lock we hold).
    Ok(unsafe { bindings::vmf_insert_page_mkwrite(vmf, page.as_ptr(), true) })
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
    for block in batch::by_block(addrs) {
        let mut faulted = [0u64; 8];
        let mut rest = block;
        while let Some(&a0) = rest.first() {
            let a0 = usize::try_from(a0).map_err(|_| EFAULT)?;
            let (r, vma) = match cur.take() {
                Some((r, v)) if r.index(a0).is_some() => (r, v),
                _ => {
                    let r = space.region_at(a0).ok_or(EFAULT)?;
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
            fault_pages(dev, space, &r, vma, &idx, write, d)?;
            rest = &rest[taken..];
            cur = Some((r, vma));
        }
        if let (Some((r, vma)), Some(&first)) = (&cur, block.first()) {
            if tune::PREFETCH.load(Relaxed) {
                prefetch::on_fault(dev, r, *vma, (first as usize) & !((1 << 21) - 1), &faulted);
            }
        }
    }
    Ok(())
}

/// Thrashing parameters: UVM's (3 moves within 500 us, pin after 10 throttles, for 300
/// windows), with the window tunable (`thrash_window_us`).
fn thrash_params() -> ThrashParams {
    let window_ns = u64::from(tune::THRASH_WINDOW_US.load(Relaxed)) * 1000;
    ThrashParams { window_ns, moves: 3, throttles_to_pin: 10, pin_ns: window_ns * 300 }
}

pub(crate) fn now_ns() -> u64 {
    // SAFETY: reading the monotonic clock has no preconditions.
    unsafe { bindings::ktime_get() as u64 }
}

/// Records the migrations of the pages of `steps` that moved data (copies, not zero
/// fills) in the space's thrash table, under one acquisition of its lock per batch;
/// returns true to throttle.
pub(crate) fn record_moves(dev: Option<&Device>, space: &Space, r: &Region, steps: &[migrate::Step]) -> bool {
    if !tune::THRASH.load(Relaxed) {
        return false;
    }
    let moved = |st: &&migrate::Step| match dev {
        Some(_) => st.a.copy != Copy::None && !matches!(st.a.copy, Copy::ZeroDev(_)),
        None => matches!(st.a.copy, Copy::D2H(_)) || (matches!(st.prev.loc(), Loc::Device(_)) && st.next.loc() == Loc::Host),
    };
    let (mut hits, mut throttle) = (0u64, false);
    {
        let mut t = space.thrash.lock();
        let now = now_ns();
        for st in steps.iter().filter(moved) {
            let va = r.va(st.i);
            if !t.recent.seen_again(va) {
                // First move of this page in a while: nothing to track.
                continue;
            }
            let v = t.table.on_move(va, now, &thrash_params());
            hits += u64::from(!matches!(v, Verdict::Migrate));
            throttle |= matches!(v, Verdict::Throttle);
        }
    }
    if let Some(dev) = dev {
        DevStats::add(&dev.stats.thrash_events, hits);
    }
    throttle
}

/// The transition of a device access by `d` to page `i` of `r`, with the advice in force
/// (and a page that kept bouncing treated as accessed-by: it stays on the host, mapped
/// remotely, for a while).
fn dev_fault_step(
    r: &Region,
    p: &Pages,
    advice: &AdviceMap<ADVICE_RUNS>,
    thrash: Option<&Thrash>,
    i: usize,
    write: bool,
    d: u8,
) -> core::result::Result<Option<migrate::Step>, Refused> {
    let bits = advice.get(i as u64);
    let s = p.state(i);
    let mut accessed_by = bits & (1 << d) != 0 || adv::preferred(bits) == Some(Target::Host);
    if !accessed_by && s.loc() == Loc::Host && thrash.is_some_and(|t| !t.table.is_empty() && t.table.pinned(r.va(i), now_ns())) {
        accessed_by = true;
    }
    let ev = Event::DevFault { dev: d, write, read_mostly: bits & adv::READ_MOSTLY != 0, accessed_by };
    let (next, a) = transition(s, ev)?;
    Ok((next != s || a != Actions::default()).then_some(migrate::Step { i, prev: s, next, a }))
}

/// The pages `idx` (ascending, of one block of `r`) of a device fault, as executor
/// batches; evicts and retries while the device is full.
fn fault_pages(
    dev: &Arc<Device>,
    space: &Space,
    r: &Arc<Region>,
    vma: Option<&kernel::mm::virt::VmaRef>,
    idx: &[usize],
    write: bool,
    d: u8,
) -> Result {
    let mut steps: KVec<migrate::Step> = KVec::with_capacity(idx.len(), GFP_KERNEL)?;
    let Some(&i0) = idx.first() else { return Ok(()) };
    let block = r.block(i0)?;
    let mut next_page = 0;
    let mut attempts = 0;
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
        let mut refusal = None;
        // The thrash table is consulted for the whole batch under one acquisition of its
        // lock (a leaf), dropped before the executor runs.
        let thrash = if tune::THRASH.load(Relaxed) { Some(space.thrash.lock()) } else { None };
        for &i in &idx[next_page..] {
            match dev_fault_step(r, &p, &advice, thrash.as_deref(), i, write, d) {
                Ok(Some(st)) => steps.push(st, GFP_KERNEL)?,
                Ok(None) => {}
                Err(e) => {
                    refusal = Some(migrate::refusal_errno(e));
                    break;
                }
            }
        }
        drop(thrash);
        let out = migrate::apply_batch(&Env::access(r, vma), &mut p, &steps);
        let done = &steps[..out.done];
        Space::add(&space.stats.dev_faults, done.len() as u64);
        let allocs = done.iter().filter(|st| st.a.alloc_frame.is_some()).count();
        DevStats::add(&dev.stats.fault_allocs, allocs as u64);
        let throttle = record_moves(Some(dev), space, r, done);
        if out.done < steps.len() {
            let stuck = steps[out.done];
            match out.res {
                Err(e) if e == ENOSPC => {
                    // The device is full: evict (without the block lock), then retry from the
                    // first page that did not get a frame.
                    drop(p);
                    attempts = if out.done > 0 { 1 } else { attempts + 1 };
                    if attempts > 32 {
                        return Err(ENOMEM);
                    }
                    next_page = idx.iter().position(|&i| i == stuck.i).unwrap_or(idx.len());
                    let want = (steps.len() - out.done).clamp(32, migrate::BATCH_PAGES);
                    evict::make_room_for(&stuck.a, want, Why::Fault)?;
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

/// Borrows the device behind a C handle as an `Arc`.
///
/// # Safety
/// `dev` must be a live handle from `gmem_dev_register`.
pub(crate) unsafe fn device_of(dev: *mut GmemDevHandle) -> Arc<Device> {
    // SAFETY: a live handle is an `Arc<Device>` reference held by the driver.
    unsafe { ArcBorrow::from_raw(dev.cast::<Device>().cast_const()) }.into()
}

/// `gmem_dev_fault()` of the C ABI.
///
/// # Safety
/// `dev` and `space` must be live handles; `addrs` must be valid for `n` reads.
#[no_mangle]
pub(crate) unsafe extern "C" fn gmem_dev_fault(
    dev: *mut GmemDevHandle,
    space: *mut GmemSpaceHandle,
    addrs: *const u64,
    n: u32,
    access: u32,
) -> c_int {
    let valid_access = access & !(GMEM_ACCESS_READ | GMEM_ACCESS_WRITE) == 0 && access != 0;
    if dev.is_null() || space.is_null() || addrs.is_null() || n == 0 || n > MAX_BATCH || !valid_access {
        return EINVAL.to_errno();
    }
    let r = (|| -> Result {
        let mut v = KVec::with_capacity(n as usize, GFP_KERNEL)?;
        // SAFETY: `addrs` is valid for `n` reads by the caller's contract.
        let src = unsafe { core::slice::from_raw_parts(addrs, n as usize) };
        v.extend_from_slice(src, GFP_KERNEL)?;
        let k = batch::coalesce(&mut v);
        // SAFETY: live handles by the caller's contract.
        let (dev, space) = unsafe { (device_of(dev), space::from_handle(space)) };
        device_fault(&dev, space, &v[..k], access & GMEM_ACCESS_WRITE != 0)
    })();
    match r {
        Ok(()) => 0,
        Err(e) => e.to_errno(),
    }
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

    #[test]
    fn dev_fault_rejects_bad_arguments() {
        let a = [0u64];
        // SAFETY: null handles are rejected before any use.
        let r = unsafe { gmem_dev_fault(core::ptr::null_mut(), core::ptr::null_mut(), a.as_ptr(), 1, 1) };
        assert_eq!(r, EINVAL.to_errno());
        // SAFETY: as above; n == 0 and bad access are rejected first too.
        let r = unsafe { gmem_dev_fault(core::ptr::null_mut(), core::ptr::null_mut(), a.as_ptr(), 0, 1) };
        assert_eq!(r, EINVAL.to_errno());
    }
}
