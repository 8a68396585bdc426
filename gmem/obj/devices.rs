// SPDX-License-Identifier: GPL-2.0
//! The table of registered devices: id -> device. Ids are small integers, lowest free
//! first; they are what the user API calls a device.
//!
//! Lookups take no lock: each slot holds a raw `Arc<Device>` reference (from
//! `Arc::into_raw`), read under RCU by [`get`] and [`all`], which take their own reference
//! inside the read-side section. Writers (registration and unregistration: rare) serialise
//! on `TABLE`, a leaf lock. [`remove`] clears the slot, waits for a grace period
//! (`synchronize_rcu`), and only then gives the table's reference back: a reader that saw
//! the old pointer finished its read-side section before that, holding its own reference
//! if it wanted one. So the hot path (the executor looks devices up per batch) takes no
//! global mutex.

use crate::obj::device::{CDriver, Device};
use core::sync::atomic::{AtomicPtr, Ordering};
use kernel::{
    prelude::*,
    sync::{global_lock, rcu, Arc, ArcBorrow},
};

/// Most devices registered at once (device ids are `0..MAX_DEVICES`).
pub(crate) const MAX_DEVICES: usize = crate::policy::page_state::MAX_DEVICES;

/// # Invariants
/// A non-null slot holds one `Arc<Device>` reference owned by the table, created by
/// `Arc::into_raw` in [`insert`] and given back by [`remove`] after a grace period.
static SLOTS: [AtomicPtr<Device>; MAX_DEVICES] = [const { AtomicPtr::new(core::ptr::null_mut()) }; MAX_DEVICES];

global_lock! {
    // SAFETY: initialised by `init()` in module init before any use.
    unsafe(uninit) static TABLE: Mutex<()> = ();
}

/// Must be called once at module load, before the C ABI can be reached.
pub(crate) fn init() {
    // SAFETY: called exactly once from module init.
    unsafe { TABLE.init() };
}

/// A new reference to the device in `slot`, if any.
fn load(slot: &AtomicPtr<Device>, _rcu: &rcu::Guard) -> Option<Arc<Device>> {
    let p = slot.load(Ordering::Acquire);
    if p.is_null() {
        return None;
    }
    // SAFETY: by the invariant `p` came from `Arc::into_raw`; the table's reference is
    // dropped only after a grace period that started after the slot was cleared, and we
    // are inside a read-side section that began before, so the device is alive here.
    Some(unsafe { ArcBorrow::from_raw(p) }.into())
}

/// The device with id `id`.
pub(crate) fn get(id: usize) -> Option<Arc<Device>> {
    let g = rcu::read_lock();
    load(SLOTS.get(id)?, &g)
}

/// Every registered device.
pub(crate) fn all() -> KVec<Arc<Device>> {
    let mut v = KVec::new();
    if v.reserve(MAX_DEVICES, GFP_KERNEL).is_err() {
        return v;
    }
    let g = rcu::read_lock();
    for d in SLOTS.iter().filter_map(|s| load(s, &g)) {
        // Room for every slot was reserved above.
        let _ = v.push_within_capacity(d);
    }
    v
}

/// Number of registered devices (not counting one that is unregistering).
pub(crate) fn count() -> usize {
    all().iter().filter(|d| d.alive()).count()
}

/// Picks the lowest free id and stores a new device; `EBUSY` when all ids are taken.
pub(crate) fn insert(drv: CDriver, nr_frames: u64) -> Result<Arc<Device>> {
    let _w = TABLE.lock();
    let id = SLOTS.iter().position(|s| s.load(Ordering::Relaxed).is_null()).ok_or(EBUSY)?;
    let dev = Device::new(id, drv, nr_frames)?;
    // INVARIANT: the table's reference, published with release ordering.
    SLOTS[id].store(Arc::into_raw(dev.clone()).cast_mut(), Ordering::Release);
    Ok(dev)
}

/// Takes device `id` out of the table; returns the table's reference once no reader can
/// still be using the slot's old value.
pub(crate) fn remove(id: usize) -> Option<Arc<Device>> {
    let p = {
        let _w = TABLE.lock();
        SLOTS.get(id)?.swap(core::ptr::null_mut(), Ordering::AcqRel)
    };
    if p.is_null() {
        return None;
    }
    rcu::synchronize_rcu();
    // SAFETY: the table's reference (invariant), no longer reachable from the slot; every
    // reader that loaded it has left its read-side section (grace period above).
    Some(unsafe { Arc::from_raw(p) })
}

#[kunit_tests(gmem_devices)]
pub(crate) mod tests {
    use super::*;
    use crate::abi::{GmemCopy, GmemDevOps, GmemDevProps, GmemFenceHandle, GmemPte, GMEM_DRIVER_ABI_VERSION};
    use kernel::ffi::{c_int, c_void};

    fn props(nr_frames: u64) -> GmemDevProps {
        GmemDevProps {
            size: core::mem::size_of::<GmemDevProps>() as u32,
            abi_version: GMEM_DRIVER_ABI_VERSION,
            name: core::ptr::null(),
            nr_frames,
            drv: core::ptr::null_mut(),
            caps: 0,
            nr_channels: 0,
        }
    }

    const EMPTY_OPS: GmemDevOps = GmemDevOps {
        ctx_create: None,
        ctx_destroy: None,
        map: None,
        unmap: None,
        tlb_invalidate: None,
        copy: None,
        frame_page: None,
        test_clear_accessed: None,
        copy_async: None,
        map_prepare: None,
        test_clear_accessed_range: None,
        copy_poll: None,
    };

    #[test]
    fn register_rejects_null_and_incomplete_tables() {
        // SAFETY: null pointers are allowed by `CDriver::new`'s contract.
        assert_eq!(unsafe { CDriver::new(core::ptr::null(), core::ptr::null()) }.err(), Some(EINVAL));
        let p = props(16);
        // SAFETY: both point to live locals.
        assert_eq!(unsafe { CDriver::new(&EMPTY_OPS, &p) }.err(), Some(EINVAL));
    }

    /// A C driver's callbacks return 0 or a negative errno; any other value refuses, as
    /// `EIO`. Before, a positive return passed for success: a `copy_async` "refused" that
    /// way left gmem waiting for a fence nobody would signal, and a `copy` committed pages
    /// it had not filled.
    #[test]
    fn driver_results_other_than_zero_refuse() {
        use crate::abi::GMEM_COPY_H2D;
        use crate::obj::device::{driver_result, Ctx, DeviceOps};
        assert_eq!(driver_result(0), Ok(()));
        assert_eq!(driver_result(-12), Err(ENOMEM));
        assert_eq!(driver_result(1), Err(EIO));
        assert_eq!(driver_result(-5000), Err(EIO));
        // Every callback that returns an `int` returns a different value that is not 0.
        static OPS: GmemDevOps = GmemDevOps {
            ctx_create: Some(stub_ctx_create::<1>),
            map: Some(stub_map::<2>),
            map_prepare: Some(stub_range::<3>),
            copy: Some(stub_copy::<4>),
            copy_async: Some(stub_copy_async::<5>),
            ..STUB_OPS
        };
        let mut p = props(1);
        p.nr_channels = 1;
        // SAFETY: `OPS` is static and complete; `p` is a live local.
        let Ok((d, _)) = (unsafe { CDriver::new(&OPS, &p) }) else { panic!("complete static ops refused") };
        let ctx = Ctx(core::ptr::null_mut());
        assert_eq!(d.ctx_create().err(), Some(EIO));
        assert_eq!(d.map(ctx, &[]), Err(EIO));
        assert_eq!(d.map_prepare(Ctx(core::ptr::null_mut()), 0, 1), Err(EIO));
        assert_eq!(d.copy(GMEM_COPY_H2D, &[], None), Err(EIO));
        let Ok(fence) = crate::obj::fence::Fence::new(0) else { panic!("no memory for a fence") };
        // SAFETY: nothing is named by the copy; the refusal leaves nothing outstanding.
        assert_eq!(unsafe { d.copy_async(0, GMEM_COPY_H2D, &[], None, &fence) }, Err(EIO));
    }

    #[test]
    fn ids_are_reused_lowest_first_and_frames_are_central() {
        let before = count();
        let p = props(8);
        // SAFETY: the adapters are never called (no ops are used by `insert`/`remove`);
        // `CDriver::new` would refuse EMPTY_OPS, so build the devices via raw parts.
        let mk = || unsafe { CDriver::new(&EMPTY_OPS, &p) };
        assert!(mk().is_err());
        let a = Device::new(100, test_driver(), 8).expect("device");
        // The central frame allocator hands out every frame once, then ENOMEM.
        let mut got = KVec::new();
        for _ in 0..8 {
            got.push(a.alloc_frame().expect("frame"), GFP_KERNEL).expect("push");
        }
        assert_eq!(a.alloc_frame().err(), Some(ENOSPC));
        // Pinned and lent counts are kept as flags change, not recounted.
        a.set_flags(got[2], crate::policy::evict::F_PINNED | crate::policy::evict::F_LENT);
        a.set_flags(got[3], crate::policy::evict::F_PINNED);
        assert_eq!((a.frames_pinned(), a.frames_lent()), (2, 1));
        a.set_flags(got[3], crate::policy::evict::F_PINNED);
        assert_eq!(a.frames_pinned(), 2);
        a.free_frame(got[2]);
        assert_eq!((a.frames_pinned(), a.frames_lent()), (1, 0));
        a.free_frame(got[3]);
        assert_eq!((a.frames_pinned(), a.frames_lent()), (0, 0));
        // Next-fit from the wrapped cursor: the lower free frame first.
        assert_eq!(a.alloc_frame().ok(), Some(got[2]));
        assert_eq!(a.alloc_frame().ok(), Some(got[3]));
        assert_eq!(a.frames_used(), 8);
        let x = insert(test_driver(), 1).expect("insert x");
        let y = insert(test_driver(), 1).expect("insert y");
        assert_ne!(x.id, y.id);
        assert_eq!(count(), before + 2);
        let freed = x.id;
        drop(remove(x.id));
        let z = insert(test_driver(), 1).expect("insert z");
        assert_eq!(z.id, freed);
        drop(remove(y.id));
        drop(remove(z.id));
        assert_eq!(count(), before);
    }

    #[test]
    fn a_device_too_large_for_its_frame_arrays_is_refused_quietly() {
        // 2^28 frames (1 TiB): the owner array alone is over kvmalloc's INT_MAX bytes.
        // ENOMEM, and no allocator warning on the console (which the harness would fail).
        assert_eq!(Device::new(102, test_driver(), 1 << 28).err(), Some(ENOMEM));
    }

    #[test]
    fn parking_promises_share_the_room_above_the_reserve() {
        let a = Device::new(101, test_driver(), 64).expect("device");
        a.set_watermarks(4, 16);
        // 64 free, high 16: 47 frames may be parked.
        assert_eq!(a.park_room(), 47);
        let mut p1 = a.promise_parking(30);
        assert_eq!(p1.n(), 30);
        // A second batch planning meanwhile gets what is left, not the same frames.
        let p2 = a.promise_parking(30);
        assert_eq!((p2.n(), a.park_room()), (17, 0));
        assert_eq!(a.promise_parking(5).n(), 0);
        // The first batch parks 10: the other 20 come back.
        p1.keep(10);
        assert_eq!((p1.n(), a.park_room()), (10, 20));
        // Its 10 frames allocated, its promise ends: they count as used instead.
        let mut got = KVec::new();
        for _ in 0..10 {
            got.push(a.alloc_frame().expect("frame"), GFP_KERNEL).expect("push");
        }
        drop(p1);
        assert_eq!(a.park_room(), 20);
        drop(p2);
        assert_eq!(a.park_room(), 37);
        // The lender's own allocations ignore promises (its own win) and shrink the room.
        let p3 = a.promise_parking(100);
        assert_eq!(p3.n(), 37);
        for _ in 0..40 {
            got.push(a.alloc_frame().expect("frame"), GFP_KERNEL).expect("push");
        }
        assert_eq!(a.park_room(), 0);
        drop(p3);
        assert_eq!(a.park_room(), 0);
        for f in got {
            a.free_frame(f);
        }
        assert_eq!(a.park_room(), 47);
    }

    /// # Safety
    /// Any arguments: nothing is dereferenced (a stub of the test tables, returning `R`).
    unsafe extern "C" fn stub_ctx_create<const R: c_int>(_d: *mut c_void, _c: *mut *mut c_void) -> c_int {
        R
    }
    /// # Safety
    /// As above.
    unsafe extern "C" fn stub_ctx_destroy(_d: *mut c_void, _c: *mut c_void) {}
    /// # Safety
    /// As above.
    unsafe extern "C" fn stub_map<const R: c_int>(
        _d: *mut c_void,
        _c: *mut c_void,
        _p: *const GmemPte,
        _n: u32,
    ) -> c_int {
        R
    }
    /// # Safety
    /// As above (`unmap`, `tlb_invalidate`).
    unsafe extern "C" fn stub_unmap(_d: *mut c_void, _c: *mut c_void, _v: u64, _n: u64) {}
    /// # Safety
    /// As above (`map_prepare`).
    unsafe extern "C" fn stub_range<const R: c_int>(_d: *mut c_void, _c: *mut c_void, _v: u64, _n: u64) -> c_int {
        R
    }
    /// # Safety
    /// As above.
    unsafe extern "C" fn stub_copy<const R: c_int>(
        _d: *mut c_void,
        _r: u32,
        _c: *const GmemCopy,
        _n: u32,
        _p: *mut c_void,
    ) -> c_int {
        R
    }
    /// # Safety
    /// As above: the fence is never signalled.
    unsafe extern "C" fn stub_copy_async<const R: c_int>(
        _d: *mut c_void,
        _ch: u32,
        _r: u32,
        _c: *const GmemCopy,
        _n: u32,
        _p: *mut c_void,
        _f: *mut GmemFenceHandle,
    ) -> c_int {
        R
    }

    /// Every mandatory callback, each succeeding.
    const STUB_OPS: GmemDevOps = GmemDevOps {
        ctx_create: Some(stub_ctx_create::<0>),
        ctx_destroy: Some(stub_ctx_destroy),
        map: Some(stub_map::<0>),
        unmap: Some(stub_unmap),
        tlb_invalidate: Some(stub_unmap),
        copy: Some(stub_copy::<0>),
        ..EMPTY_OPS
    };

    /// A driver whose callbacks all exist but are never called by these tests.
    pub(crate) fn test_driver() -> CDriver {
        static OPS: GmemDevOps = STUB_OPS;
        let mut p = props(1);
        // Capabilities: unknown bits are refused; so are copy channels without `copy_async`
        // and more channels than the API allows.
        p.caps = 2;
        // SAFETY: `OPS` is static and complete; `p` is a live local.
        assert_eq!(unsafe { CDriver::new(&OPS, &p) }.err(), Some(EINVAL));
        (p.caps, p.nr_channels) = (crate::abi::GMEM_DEV_CAP_MAP_2M, 1);
        // SAFETY: as above.
        assert_eq!(unsafe { CDriver::new(&OPS, &p) }.err(), Some(EINVAL));
        static ASYNC_OPS: GmemDevOps = GmemDevOps { copy_async: Some(stub_copy_async::<0>), ..STUB_OPS };
        p.nr_channels = crate::abi::GMEM_MAX_CHANNELS + 1;
        // SAFETY: as above.
        assert_eq!(unsafe { CDriver::new(&ASYNC_OPS, &p) }.err(), Some(EINVAL));
        p.nr_channels = crate::abi::GMEM_MAX_CHANNELS;
        // SAFETY: as above.
        let d = unsafe { CDriver::new(&ASYNC_OPS, &p) };
        assert_eq!(d.map(|(d, _)| crate::obj::device::DeviceOps::channels(&d)).ok(), Some(16));
        p.nr_channels = 0;
        // SAFETY: as above.
        match unsafe { CDriver::new(&OPS, &p) } {
            Ok((d, _)) => {
                assert!(d.maps_2m());
                d
            }
            Err(_) => panic!("complete static ops refused"),
        }
    }
}
