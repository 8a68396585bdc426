// SPDX-License-Identifier: GPL-2.0
//! Migration of ordinary process memory to a device and back (the pagemap is
//! obj/dpriv.rs). The copies go through the device's copy engine like every other
//! migration; the frames come from the device's one pool, charged to the process's dmem
//! cgroup, and are marked `F_SYSMEM`, so that eviction treats them like any other frame.
//!
//! - To the device ([`to_device`]): `migrate_vma_setup` collects a block's movable pages
//!   (anonymous private memory, pages shared copy-on-write after a fork included: the
//!   migration replaces every mapping of them; file pages and busy pages stay), gmem
//!   allocates a frame per page, the driver copies (or zero-fills never-touched pages), and
//!   `migrate_vma_pages` swaps the process's PTEs for device-private entries.
//! - Back to the host: a CPU access faults (`migrate_to_ram`, C side), which brings back
//!   the device's pages of that 2 MiB block in one batch; PREFETCH to the host
//!   ([`to_host`]); eviction and unregistration ([`evict`]) by frame, wherever the pages
//!   are mapped. Each calls [`gmem_dpriv_copy_back`] for the data.
//! - Frames come back to the pool when their device-private page is freed (after a
//!   migration back, or when the process unmaps or exits): the pagemap's callback
//!   ([`gmem_dpriv_released`]) may run in atomic context, so it only marks the frame and
//!   kicks the device's worker; `Device::drain_released` frees it.

use crate::abi::{GmemCopy, GMEM_COPY_D2H, GMEM_COPY_H2D, GMEM_COPY_ZERO};
use crate::obj::device::{kick_always, DevStats, Device, DeviceOps, F_SYSMEM};
use crate::obj::dpriv::{Collected, MigBuf, Source, BATCH};
use crate::obj::space::Space;
use crate::obj::trace;
use kernel::{
    bindings,
    ffi::{c_int, c_ulong, c_void},
    prelude::*,
    sync::{Arc, ArcBorrow},
    time::{delay::fsleep, Delta},
};

/// Moves the movable pages of `npages` pages from `start` (at most a 2 MiB block's worth,
/// clipped to the VMA there) of `space` to `dev`, as many as its pool has free frames for
/// (the caller makes room first) and its dmem cgroup allows. Returns how many moved, and
/// how many pages the clipped range has (`npages` for a device without device-private
/// pages, which moves none). `EFAULT` if no mapping gmem mirrors is at `start`, `ENODEV`
/// if the device is going away.
pub(crate) fn to_device(
    dev: &Arc<Device>,
    space: &Space,
    buf: &mut MigBuf,
    start: u64,
    npages: usize,
) -> Result<(usize, usize)> {
    if !dev.maps_sysmem() {
        return Ok((0, npages));
    }
    // Inside it, the pagemap stays and unregistration's evacuation waits for this.
    let _placing = dev.placing().ok_or(ENODEV)?;
    let Some(pm) = dev.dpriv_or_create() else { return Ok((0, npages)) };
    let ops = dev.ops().ok_or(ENODEV)?;
    let mm = space.mm_user().ok_or(EFAULT)?;
    dev.drain_released();
    let mut moving: KVec<(usize, *mut bindings::page)> = KVec::with_capacity(BATCH, GFP_KERNEL)?;
    let mut h2d: KVec<GmemCopy> = KVec::with_capacity(BATCH, GFP_KERNEL)?;
    let mut zero: KVec<GmemCopy> = KVec::with_capacity(BATCH, GFP_KERNEL)?;
    let mut frames = KVec::with_capacity(BATCH, GFP_KERNEL)?;
    let mut charges = KVec::new();
    // From here to the commit, the block's pages are locked and the mmap lock held.
    let mut mig = match buf.collect(pm, &mm, start, npages)? {
        Collected::Migration(m) => m,
        Collected::Unmovable(covered) => return Ok((0, covered)),
    };
    let covered = mig.count;
    for i in 0..mig.count {
        let p = match mig.source(i) {
            Source::Stays => continue,
            Source::Page(p) => p.as_ptr(),
            Source::Zero => core::ptr::null_mut(),
        };
        // Capacity `BATCH` >= `count`.
        moving.push_within_capacity((i, p)).map_err(|_| ENOMEM)?;
    }
    if moving.is_empty() {
        return Ok((mig.commit(), covered));
    }
    // Fewer charges than pages when the cgroup is at its limit: the rest stays.
    let _limit = dev.dmem.charge(space.mm(), moving.len(), &mut charges)?;
    dev.alloc_frames(&mut charges, &mut frames)?;
    drop(charges);
    for (&(_, p), &f) in moving.iter().zip(frames.iter()) {
        let c = GmemCopy { host: p, frame: u64::from(f), peer_frame: 0 };
        let list = if p.is_null() { &mut zero } else { &mut h2d };
        list.push_within_capacity(c).map_err(|_| ENOMEM)?;
    }
    let copied = [(GMEM_COPY_H2D, &h2d), (GMEM_COPY_ZERO, &zero)]
        .into_iter()
        .filter(|(_, l)| !l.is_empty())
        .try_for_each(|(dir, l)| {
            DevStats::add(&dev.stats.copy_calls, 1);
            ops.copy(dir, l, None)?;
            trace::migrate(dir, dev.id, None, l.len());
            Ok(())
        });
    if let Err(e) = copied {
        // Nothing placed: the pages stay on the host, the frames go back.
        drop(mig);
        frames.iter().for_each(|&f| {
            dev.free_frame(f);
        });
        return Err(e);
    }
    DevStats::add(&dev.stats.pages_h2d, h2d.len() as u64);
    DevStats::add(&dev.stats.pages_zeroed, zero.len() as u64);
    for (&(i, _), &f) in moving.iter().zip(frames.iter()) {
        mig.place(i, f);
    }
    // Marked once their pages are set up (and locked until the commit, so that an evictor
    // skips them until then): from the commit on, eviction may pick them.
    dev.set_flags_of(&frames, F_SYSMEM);
    // Pages the kernel then finds changed stay; their frames come back through the pagemap.
    let moved = mig.commit();
    DevStats::add(&dev.stats.sysmem_in, moved as u64);
    Ok((moved, covered))
}

/// Moves `dev`'s pages of `npages` pages from `start` (at most a 2 MiB block's worth,
/// clipped to the VMA there) of `space` back to host memory. Returns how many moved and
/// how many pages the clipped range has (as [`to_device`]).
pub(crate) fn to_host(dev: &Device, space: &Space, start: u64, npages: usize) -> Result<(usize, usize)> {
    let _placing = dev.placing().ok_or(ENODEV)?;
    let Some(pm) = dev.dpriv() else { return Ok((0, npages)) };
    let mm = space.mm_user().ok_or(EFAULT)?;
    let r = pm.to_host(&mm, start, npages)?;
    dev.drain_released();
    Ok(r)
}

/// Moves the pages held by `frames` (frames of `dev` marked `F_SYSMEM`; others are skipped)
/// back to host memory, in batches, and returns how many moved: their frames are free
/// (back in the pool, whoever drained them: the device's worker may have been first).
/// The caller holds `dev.evict_lock` (which keeps the pagemap's teardown away). `nofail`:
/// for unregistration, host pages are allocated without failing.
pub(crate) fn evict(dev: &Device, frames: &[u64], nofail: bool) -> usize {
    let Some(pm) = dev.dpriv() else { return 0 };
    let mut moved = 0;
    for chunk in frames.chunks(BATCH) {
        match pm.evict(chunk, nofail) {
            Ok(n) => moved += n,
            Err(e) => pr_warn!("device {}: eviction of process memory failed ({:?})\n", dev.id, e),
        }
    }
    DevStats::add(&dev.stats.sysmem_evicted, moved as u64);
    dev.drain_released();
    moved
}

/// Unregistration: brings every page of process memory on `dev` back to the host (the
/// driver still runs; nothing new lands: the device is dead and its placing sections are
/// over), then tears the pagemap down. Pages that cannot move yet (busy) are retried.
///
/// A page whose copy back keeps failing keeps this waiting (its data exists only on the
/// device, and the process may still use it): it warns every 10 seconds.
pub(crate) fn evacuate(dev: &Device) {
    let Some(pm) = dev.dpriv() else { return };
    let mut frames: KVec<u64> = KVec::new();
    for round in 0u32.. {
        dev.drain_released();
        if dev.frames_sysmem() == 0 {
            break;
        }
        if round % 1000 == 999 {
            pr_warn!("device {}: {} pages of process memory will not move back yet\n", dev.id, dev.frames_sysmem());
        }
        frames.clear();
        if dev.sysmem_frames(&mut frames).is_ok() {
            let _one = dev.evict_lock.lock();
            evict(dev, &frames, true);
        }
        if round > 0 {
            // Busy pages (locked by someone else): let that finish.
            fsleep(Delta::from_millis(10));
        }
    }
    // Eviction uses the pagemap under this lock: none is in progress, none follows (no
    // frame holds process memory, and nothing places more). Every page is free now, so
    // the teardown does not wait.
    let _one = dev.evict_lock.lock();
    pm.teardown();
    dev.drain_released();
}

/// The pagemap's `folio_free`: frame `frame`'s device-private page went free. Any context.
///
/// # Safety
/// `owner` is the `Device` the pagemap was bound to, alive until its teardown returned
/// (which waits for every page's free).
#[no_mangle]
unsafe extern "C" fn gmem_dpriv_released(owner: *const c_void, frame: c_ulong) {
    // SAFETY: by the caller's contract the device is alive and in an `Arc` (the
    // registration's reference; `Device::dpriv_or_create` bound `Arc::as_ptr`).
    let dev = unsafe { ArcBorrow::from_raw(owner.cast::<Device>()) };
    dev.note_released(frame as u64);
    // Not the last reference (the registration holds one): dropping it here is fine.
    kick_always(&Arc::from(dev));
}

/// Copies `n` frames of the device to the host pages `pages` (device-to-host), for a
/// migration back. Returns 0 or a negative errno (nothing may be assumed copied).
///
/// # Safety
/// `owner` is as for [`gmem_dpriv_released`]; `frames` and `pages` are valid for `n`
/// entries, the frames hold locked device-private pages and the host pages are fresh and
/// locked (the C side's migration owns them for the call).
#[no_mangle]
unsafe extern "C" fn gmem_dpriv_copy_back(
    owner: *const c_void,
    frames: *const u64,
    pages: *const *mut bindings::page,
    n: c_ulong,
) -> c_int {
    // SAFETY: by the caller's contract.
    let dev = unsafe { &*owner.cast::<Device>() };
    // SAFETY: valid for `n` entries (caller's contract).
    let (frames, pages) = unsafe { (core::slice::from_raw_parts(frames, n), core::slice::from_raw_parts(pages, n)) };
    let r = (|| -> Result {
        let ops = dev.ops().ok_or(ENODEV)?;
        let mut list = KVec::with_capacity(n, GFP_KERNEL)?;
        for (&f, &p) in frames.iter().zip(pages.iter()) {
            list.push(GmemCopy { host: p, frame: f, peer_frame: 0 }, GFP_KERNEL)?;
        }
        DevStats::add(&dev.stats.copy_calls, 1);
        ops.copy(GMEM_COPY_D2H, &list, None)?;
        trace::migrate(GMEM_COPY_D2H, dev.id, None, n);
        DevStats::add(&dev.stats.pages_d2h, n as u64);
        DevStats::add(&dev.stats.sysmem_out, n as u64);
        Ok(())
    })();
    match r {
        Ok(()) => 0,
        Err(e) => e.to_errno(),
    }
}
