// SPDX-License-Identifier: GPL-2.0
//! gmem_sim: a simulated accelerator. It plugs into gmem.ko exactly as a real driver would,
//! through the C driver ABI of `include/linux/gmem.h`, and is honest about what a device is:
//! - its own memory: a pool of frames (`sim_mem.rs`), capacity set by `mem_mib`;
//! - its own page table per address space (`sim_pt.rs`), driven only by gmem's callbacks;
//! - a copy engine (the `copy` callback) moving pages host<->frame and frame<->peer frame;
//! - kernels (`sim_kernels.rs`) that access memory only through that page table and report
//!   misses to gmem in batches, then replay.
//! Userspace launches kernels through `/dev/gmem_simN` (`include/uapi/linux/gmem_sim.h`).
//!
//! Lock order: a context's `pt` lock is a leaf; the driver never calls into gmem with it
//! held, and gmem never holds a spinlock when it calls us.

use core::sync::atomic::{AtomicBool, AtomicI32, AtomicPtr, AtomicU32, AtomicU64, Ordering};
use kernel::{
    bindings, faux,
    ffi::{c_int, c_void},
    fs::File,
    ioctl::{_IOW, _IOWR},
    miscdevice::{MiscDevice, MiscDeviceOptions, MiscDeviceRegistration},
    prelude::*,
    sync::{global_lock, Arc},
    transmute::{AsBytes, FromBytes},
    uaccess::{UserPtr, UserSlice},
};

#[path = "../include/rust/gmem_abi.rs"]
mod abi;
mod sim_kernels;
mod sim_mem;
mod sim_pt;
mod sim_sched;

use abi::*;
use sim_kernels::{Launch, Runner};
use sim_mem::Pool;
use sim_pt::{encode, SimCtx, Target};

/// Pages of one 2 MiB page-table entry.
const HUGE_PAGES: u64 = 512;

extern "C" {
    fn gmem_dev_register(ops: *const GmemDevOps, props: *const GmemDevProps) -> *mut GmemDevHandle;
    fn gmem_dev_unregister(dev: *mut GmemDevHandle);
    fn gmem_dev_id(dev: *const GmemDevHandle) -> c_int;
    fn gmem_space_get_current() -> *mut GmemSpaceHandle;
    fn gmem_space_put(space: *mut GmemSpaceHandle);
    fn gmem_space_ctx(dev: *mut GmemDevHandle, space: *mut GmemSpaceHandle) -> *mut c_void;
    fn gmem_dev_fault(dev: *mut GmemDevHandle, space: *mut GmemSpaceHandle, addrs: *const u64, n: u32, access: u32) -> c_int;
}

module! {
    type: SimModule,
    name: "gmem_sim",
    authors: ["GMEM developers"],
    description: "Simulated accelerator for GMEM",
    license: "GPL",
    params: {
        nr_devices: u32 {
            default: 1,
            description: "Number of simulated devices (1..8)",
        },
        mem_mib: u32 {
            default: 64,
            description: "Device memory per device, MiB (1..4096)",
        },
        map_2m: bool {
            default: true,
            description: "Map whole 2 MiB blocks with one page-table entry",
        },
    },
}

const MAX_SIM_DEVICES: usize = 8;
const NAMES: [&CStr; MAX_SIM_DEVICES] =
    [c"gmem_sim0", c"gmem_sim1", c"gmem_sim2", c"gmem_sim3", c"gmem_sim4", c"gmem_sim5", c"gmem_sim6", c"gmem_sim7"];

/// One simulated device.
pub(crate) struct SimDev {
    index: usize,
    pub(crate) pool: Pool,
    /// gmem's handle, set once registered.
    handle: AtomicPtr<GmemDevHandle>,
    /// Minor of `/dev/gmem_simN`, to find the device at open.
    minor: AtomicI32,
    /// Valid 4 KiB and 2 MiB entries over all contexts, and 2 MiB entries split so far.
    ptes: AtomicU64,
    ptes_2m: AtomicU64,
    splits_2m: AtomicU64,
    copies: AtomicU64,
    tlb_flushes: AtomicU64,
    faults: AtomicU64,
    /// Fault injection (`GMEM_SIM_IOC_FAIL_COPY`): the next copy call of more than this many
    /// pages copies this many, then fails with `-fail_err`; `NO_FAILURE` when not armed.
    fail_after: AtomicU64,
    fail_err: AtomicU32,
    /// Set once `gmem_dev_unregister` returned: gmem promises no callback after that, and
    /// the sim checks it (a callback then is logged and WARNs, which fails the test run).
    unregistered: AtomicBool,
}

impl SimDev {
    fn handle(&self) -> *mut GmemDevHandle {
        self.handle.load(Ordering::Acquire)
    }

    /// Moves the device-wide entry counters by one page table's change (4 KiB entries,
    /// 2 MiB entries, splits: before and after).
    fn count_ptes(&self, before: (u64, u64, u64), after: (u64, u64, u64)) {
        self.ptes.fetch_add(after.0.wrapping_sub(before.0), Ordering::Relaxed);
        self.ptes_2m.fetch_add(after.1.wrapping_sub(before.1), Ordering::Relaxed);
        self.splits_2m.fetch_add(after.2.wrapping_sub(before.2), Ordering::Relaxed);
    }

    pub(crate) fn count_faults(&self, n: u64) {
        self.faults.fetch_add(n, Ordering::Relaxed);
    }

    /// Reports a batch of faults to gmem (no lock of ours held).
    pub(crate) fn fault(&self, space: *mut GmemSpaceHandle, addrs: &[u64], access: u32) -> Result {
        let n = u32::try_from(addrs.len()).map_err(|_| EINVAL)?;
        // SAFETY: our live registration, the caller's space reference, a valid buffer.
        kernel::error::to_result(unsafe { gmem_dev_fault(self.handle(), space, addrs.as_ptr(), n, access) })
    }
}

/// The driver's `drv` pointer back to its device.
///
/// # Safety
/// `drv` must be the `drv` of one of our registrations (a live `SimDev`).
unsafe fn sim<'a>(drv: *mut c_void) -> &'a SimDev {
    // SAFETY: by the function's contract.
    let dev = unsafe { &*drv.cast::<SimDev>() };
    if dev.unregistered.load(Ordering::Acquire) {
        pr_err!("gmem_sim{}: callback after gmem_dev_unregister returned\n", dev.index);
        kernel::warn_on!(true);
    }
    dev
}

/// # Safety
/// `ctx` must come from `ctx_create` and not be destroyed.
unsafe fn ctx_of<'a>(ctx: *mut c_void) -> &'a SimCtx {
    // SAFETY: by the function's contract.
    unsafe { &*ctx.cast::<SimCtx>() }
}

unsafe extern "C" fn op_ctx_create(drv: *mut c_void, ctx: *mut *mut c_void) -> c_int {
    // SAFETY: gmem passes our `drv` (checked for use after unregistration).
    let _ = unsafe { sim(drv) };
    match SimCtx::new() {
        Ok(c) => {
            // SAFETY: the context is never moved out of its box; `op_ctx_destroy` rebuilds
            // the pinned box. `ctx` is a valid out-pointer (driver API).
            unsafe { *ctx = KBox::into_raw(Pin::into_inner_unchecked(c)).cast() };
            0
        }
        Err(e) => e.to_errno(),
    }
}

unsafe extern "C" fn op_ctx_destroy(drv: *mut c_void, ctx: *mut c_void) {
    // SAFETY: `ctx` came from `op_ctx_create` and gmem destroys it once.
    let c = unsafe { KBox::from_raw(ctx.cast::<SimCtx>()) };
    let (valid, huge) = {
        let pt = c.pt.lock();
        (pt.valid, pt.huge)
    };
    // SAFETY: gmem passes our `drv`.
    let dev = unsafe { sim(drv) };
    dev.ptes.fetch_sub(valid, Ordering::Relaxed);
    dev.ptes_2m.fetch_sub(huge, Ordering::Relaxed);
}

unsafe extern "C" fn op_map(drv: *mut c_void, ctx: *mut c_void, ptes: *const GmemPte, n: u32) -> c_int {
    // SAFETY: gmem passes our `drv`, a live context and `n` valid entries.
    let (dev, c, ptes) = unsafe { (sim(drv), ctx_of(ctx), core::slice::from_raw_parts(ptes, n as usize)) };
    let mut pt = c.pt.lock();
    let before = (pt.valid, pt.huge, pt.splits);
    let mut r = 0;
    for p in ptes {
        if p.flags & !GMEM_PTE_2M != 0 {
            r = EINVAL.to_errno();
            break;
        }
        let huge = p.flags & GMEM_PTE_2M != 0;
        let t = if p.host.is_null() {
            // A 2 MiB entry needs 512 aligned frames of the pool and an aligned address.
            let last = if huge { p.frame.checked_add(HUGE_PAGES - 1) } else { Some(p.frame) };
            let aligned = !huge || (p.frame % HUGE_PAGES == 0 && p.va % (HUGE_PAGES << 12) == 0);
            if !aligned || last.is_none_or(|l| l >= dev.pool.len() as u64) {
                r = EINVAL.to_errno();
                break;
            }
            Target::Frame(p.frame)
        } else if huge {
            r = EINVAL.to_errno();
            break;
        } else {
            Target::Host(p.host)
        };
        let pte = encode(t, p.prot & GMEM_PROT_WRITE != 0);
        let set = if huge { pt.set_huge(p.va, pte) } else { pt.set(p.va, pte) };
        if let Err(e) = set {
            r = e.to_errno();
            break;
        }
    }
    // Entries set before a failure stay set: count them either way.
    dev.count_ptes(before, (pt.valid, pt.huge, pt.splits));
    r
}

unsafe extern "C" fn op_unmap(drv: *mut c_void, ctx: *mut c_void, va: u64, npages: u64) {
    // SAFETY: gmem passes our `drv` and a live context.
    let (dev, c) = unsafe { (sim(drv), ctx_of(ctx)) };
    let mut pt = c.pt.lock();
    let before = (pt.valid, pt.huge, pt.splits);
    pt.clear(va, npages);
    dev.count_ptes(before, (pt.valid, pt.huge, pt.splits));
}

unsafe extern "C" fn op_tlb(drv: *mut c_void, _ctx: *mut c_void, _va: u64, _npages: u64) {
    // The simulated device has no TLB beyond its page table (translations are not cached);
    // count the flushes so the benchmarks can see them.
    // SAFETY: gmem passes our `drv`.
    unsafe { sim(drv) }.tlb_flushes.fetch_add(1, Ordering::Relaxed);
}

unsafe extern "C" fn op_copy(drv: *mut c_void, dir: u32, c: *const GmemCopy, n: u32, peer: *mut c_void) -> c_int {
    // SAFETY: gmem passes our `drv` and `n` valid entries.
    let (dev, pairs) = unsafe { (sim(drv), core::slice::from_raw_parts(c, n as usize)) };
    // An armed failure fires once, in the middle of the first call long enough for it.
    let armed = dev.fail_after.load(Ordering::Acquire);
    let cut = (armed < u64::from(n) && dev.fail_after.compare_exchange(armed, NO_FAILURE, Ordering::AcqRel, Ordering::Relaxed).is_ok())
        .then_some(armed as usize);
    for (k, p) in pairs.iter().enumerate() {
        if Some(k) == cut {
            dev.copies.fetch_add(k as u64, Ordering::Relaxed);
            // `fail_err` is in 1..=4095 (checked when armed).
            return -(dev.fail_err.load(Ordering::Relaxed) as c_int);
        }
        let Some(frame) = dev.pool.frame(p.frame) else { return EINVAL.to_errno() };
        match dir {
            // SAFETY (all arms): frames are pages of our pool; host pages are owned by gmem
            // for the duration of the call; source and destination differ.
            GMEM_COPY_H2D if !p.host.is_null() => unsafe { sim_mem::copy_page(frame, p.host) },
            GMEM_COPY_D2H if !p.host.is_null() => unsafe { sim_mem::copy_page(p.host, frame) },
            GMEM_COPY_ZERO => unsafe { sim_mem::zero_page(frame) },
            GMEM_COPY_D2D if !peer.is_null() => {
                // SAFETY: gmem passes the peer device's `drv`, one of ours.
                let Some(dst) = unsafe { sim(peer) }.pool.frame(p.peer_frame) else { return EINVAL.to_errno() };
                // SAFETY: see above.
                unsafe { sim_mem::copy_page(dst, frame) }
            }
            _ => return EINVAL.to_errno(),
        }
    }
    dev.copies.fetch_add(u64::from(n), Ordering::Relaxed);
    0
}

unsafe extern "C" fn op_frame_page(drv: *mut c_void, frame: u64) -> *mut bindings::page {
    // SAFETY: gmem passes our `drv`.
    unsafe { sim(drv) }.pool.frame(frame).unwrap_or(core::ptr::null_mut())
}

unsafe extern "C" fn op_test_clear_accessed(drv: *mut c_void, ctx: *mut c_void, va: u64) -> c_int {
    // SAFETY: gmem passes our `drv` (checked for use after unregistration).
    let _ = unsafe { sim(drv) };
    // SAFETY: gmem passes a live context of ours.
    c_int::from(unsafe { ctx_of(ctx) }.pt.lock().test_clear_accessed(va))
}

static OPS: GmemDevOps = GmemDevOps {
    ctx_create: Some(op_ctx_create),
    ctx_destroy: Some(op_ctx_destroy),
    map: Some(op_map),
    unmap: Some(op_unmap),
    tlb_invalidate: Some(op_tlb),
    copy: Some(op_copy),
    frame_page: Some(op_frame_page),
    test_clear_accessed: Some(op_test_clear_accessed),
};

global_lock! {
    // SAFETY: initialised in module init before any device node exists.
    unsafe(uninit) static SIMS: Mutex<KVec<Arc<SimDev>>> = KVec::new();
}

/// `struct gmem_sim_launch`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct LaunchArg {
    argsz: u32,
    kernel: u32,
    flags: u32,
    value: u32,
    a: u64,
    b: u64,
    len: u64,
    seed: u64,
    count: u64,
    result: u64,
    faults: u64,
    batches: u64,
    reserved: [u64; 2],
}
// SAFETY: integers only, no padding.
unsafe impl FromBytes for LaunchArg {}
// SAFETY: as above.
unsafe impl AsBytes for LaunchArg {}

/// `struct gmem_sim_info`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct InfoArg {
    argsz: u32,
    gmem_id: i32,
    nr_frames: u64,
    ptes: u64,
    copies: u64,
    tlb_flushes: u64,
    ptes_2m: u64,
    splits_2m: u64,
}
// SAFETY: integers only, no padding.
unsafe impl FromBytes for InfoArg {}
// SAFETY: as above.
unsafe impl AsBytes for InfoArg {}

/// `struct gmem_sim_fail_copy`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct FailCopyArg {
    argsz: u32,
    err: u32,
    after: u64,
    reserved: [u64; 2],
}
// SAFETY: integers only, no padding.
unsafe impl FromBytes for FailCopyArg {}
// SAFETY: as above.
unsafe impl AsBytes for FailCopyArg {}

const IOC_LAUNCH: u32 = _IOWR::<LaunchArg>(b'S' as u32, 0x01);
const IOC_INFO: u32 = _IOWR::<InfoArg>(b'S' as u32, 0x02);
const IOC_FAIL_COPY: u32 = _IOW::<FailCopyArg>(b'S' as u32, 0x03);
/// `fail_after` when no copy failure is armed.
const NO_FAILURE: u64 = u64::MAX;

/// One open of `/dev/gmem_simN`.
struct SimFile {
    dev: Arc<SimDev>,
}

/// The caller's GMEM space, put back on drop.
struct SpaceRef(*mut GmemSpaceHandle);

impl SpaceRef {
    fn current() -> Result<SpaceRef> {
        // SAFETY: plain C-ABI call in process context.
        let s = unsafe { gmem_space_get_current() };
        kernel::error::from_err_ptr(s).map(SpaceRef)
    }
}

impl Drop for SpaceRef {
    fn drop(&mut self) {
        // SAFETY: the reference taken in `current`, put once.
        unsafe { gmem_space_put(self.0) };
    }
}

impl SimFile {
    fn launch(&self, arg: usize) -> Result {
        let (mut r, mut w) = UserSlice::new(UserPtr::from_addr(arg), core::mem::size_of::<LaunchArg>()).reader_writer();
        let mut l: LaunchArg = r.read()?;
        if l.argsz as usize != core::mem::size_of::<LaunchArg>() || l.reserved != [0; 2] {
            return Err(EINVAL);
        }
        let launch = Launch {
            kernel: l.kernel,
            flags: l.flags,
            value: l.value,
            a: l.a,
            b: l.b,
            len: l.len,
            seed: l.seed,
            count: l.count,
        };
        launch.check()?;
        let space = SpaceRef::current()?;
        // SAFETY: our live registration and the space reference we hold.
        let ctx = kernel::error::from_err_ptr(unsafe { gmem_space_ctx(self.dev.handle(), space.0) })?;
        // SAFETY: the context stays alive while we hold the space reference (gmem destroys
        // contexts only when the space dies or this device unregisters).
        let ctx = unsafe { ctx_of(ctx) };
        let mut runner = Runner::new(&self.dev, ctx, space.0)?;
        let res = runner.run(&launch);
        l.result = runner.out.result;
        l.faults = runner.out.faults;
        l.batches = runner.out.batches;
        res?;
        w.write(&l)
    }

    /// Arms a one-shot copy-engine failure (fault injection for the tests).
    fn fail_copy(&self, arg: usize) -> Result {
        let f: FailCopyArg = UserSlice::new(UserPtr::from_addr(arg), core::mem::size_of::<FailCopyArg>()).reader().read()?;
        if f.argsz as usize != core::mem::size_of::<FailCopyArg>() || f.reserved != [0; 2] || f.err == 0 || f.err > 4095 || f.after == NO_FAILURE {
            return Err(EINVAL);
        }
        self.dev.fail_err.store(f.err, Ordering::Relaxed);
        self.dev.fail_after.store(f.after, Ordering::Release);
        Ok(())
    }

    fn info(&self, arg: usize) -> Result {
        let (mut r, mut w) = UserSlice::new(UserPtr::from_addr(arg), core::mem::size_of::<InfoArg>()).reader_writer();
        let mut i: InfoArg = r.read()?;
        if i.argsz as usize != core::mem::size_of::<InfoArg>() {
            return Err(EINVAL);
        }
        // SAFETY: our live registration.
        i.gmem_id = unsafe { gmem_dev_id(self.dev.handle()) };
        i.nr_frames = self.dev.pool.len() as u64;
        i.ptes = self.dev.ptes.load(Ordering::Relaxed);
        i.copies = self.dev.copies.load(Ordering::Relaxed);
        i.tlb_flushes = self.dev.tlb_flushes.load(Ordering::Relaxed);
        i.ptes_2m = self.dev.ptes_2m.load(Ordering::Relaxed);
        i.splits_2m = self.dev.splits_2m.load(Ordering::Relaxed);
        w.write(&i)
    }
}

#[vtable]
impl MiscDevice for SimFile {
    type Ptr = Pin<KBox<Self>>;

    fn open(_file: &File, misc: &MiscDeviceRegistration<Self>) -> Result<Pin<KBox<Self>>> {
        // SAFETY: the registration is live while it can be opened.
        let minor = unsafe { (*misc.as_raw()).minor };
        let dev = SIMS.lock().iter().find(|d| d.minor.load(Ordering::Acquire) == minor).cloned().ok_or(ENODEV)?;
        KBox::pin(SimFile { dev }, GFP_KERNEL).map_err(Into::into)
    }

    fn ioctl(me: Pin<&SimFile>, _file: &File, cmd: u32, arg: usize) -> Result<isize> {
        match cmd {
            IOC_LAUNCH => me.launch(arg),
            IOC_INFO => me.info(arg),
            IOC_FAIL_COPY => me.fail_copy(arg),
            _ => Err(ENOTTY),
        }
        .map(|()| 0)
    }
}

struct SimModule {
    regs: KVec<Pin<KBox<MiscDeviceRegistration<SimFile>>>>,
    devs: KVec<Arc<SimDev>>,
    _faux: faux::Registration,
}

impl SimModule {
    fn add_device(&mut self, index: usize, frames: usize) -> Result {
        let dev = Arc::new(
            SimDev {
                index,
                pool: Pool::new(frames)?,
                handle: AtomicPtr::new(core::ptr::null_mut()),
                minor: AtomicI32::new(-1),
                ptes: AtomicU64::new(0),
                ptes_2m: AtomicU64::new(0),
                splits_2m: AtomicU64::new(0),
                copies: AtomicU64::new(0),
                tlb_flushes: AtomicU64::new(0),
                faults: AtomicU64::new(0),
                fail_after: AtomicU64::new(NO_FAILURE),
                fail_err: AtomicU32::new(0),
                unregistered: AtomicBool::new(false),
            },
            GFP_KERNEL,
        )?;
        let props = GmemDevProps {
            size: core::mem::size_of::<GmemDevProps>() as u32,
            abi_version: GMEM_DRIVER_ABI_VERSION,
            name: NAMES[index].as_char_ptr(),
            nr_frames: frames as u64,
            drv: (&*dev as *const SimDev).cast_mut().cast(),
            caps: if module_parameters::map_2m.value() { GMEM_DEV_CAP_MAP_2M } else { 0 },
            reserved: 0,
        };
        self.devs.reserve(1, GFP_KERNEL)?;
        SIMS.lock().push(dev.clone(), GFP_KERNEL)?;
        // SAFETY: `OPS` is static; `props` is valid for the call; `drv` (the `SimDev`) lives
        // in `self.devs` until after `gmem_dev_unregister` in `drop`.
        let handle = kernel::error::from_err_ptr(unsafe { gmem_dev_register(&OPS, &props) })?;
        dev.handle.store(handle, Ordering::Release);
        self.devs.push(dev.clone(), GFP_KERNEL)?;
        let reg = KBox::pin_init(MiscDeviceRegistration::register(MiscDeviceOptions { name: NAMES[index] }), GFP_KERNEL)?;
        // SAFETY: the registration is live.
        dev.minor.store(unsafe { (*reg.as_raw()).minor }, Ordering::Release);
        self.regs.push(reg, GFP_KERNEL)?;
        // SAFETY: live registration.
        let id = unsafe { gmem_dev_id(handle) };
        pr_info!("gmem_sim{}: gmem device {}, {} frames\n", dev.index, id, frames);
        Ok(())
    }
}

impl kernel::Module for SimModule {
    fn init(_module: &'static ThisModule) -> Result<Self> {
        let n = module_parameters::nr_devices.value() as usize;
        let mib = module_parameters::mem_mib.value() as usize;
        if n == 0 || n > MAX_SIM_DEVICES || mib == 0 || mib > 4096 {
            return Err(EINVAL);
        }
        // SAFETY: called once, before any device exists.
        unsafe { SIMS.init() };
        let mut m = SimModule { regs: KVec::new(), devs: KVec::new(), _faux: faux::Registration::new(c"gmem_sim", None)? };
        for i in 0..n {
            // On failure `m` is dropped, which unregisters what was registered.
            m.add_device(i, mib * 256)?;
        }
        Ok(m)
    }
}

impl Drop for SimModule {
    fn drop(&mut self) {
        // No new opens (open files pin the module, so none exist now).
        self.regs.clear();
        for d in self.devs.iter() {
            let h = d.handle.swap(core::ptr::null_mut(), Ordering::AcqRel);
            if !h.is_null() {
                // SAFETY: registered in `add_device`, unregistered exactly once here. gmem
                // evacuates every page to the host and destroys our contexts first.
                unsafe { gmem_dev_unregister(h) };
                d.unregistered.store(true, Ordering::Release);
            }
        }
        // Statics are not dropped at unload: free the list's buffer too.
        drop(core::mem::take(&mut *SIMS.lock()));
        for d in self.devs.iter() {
            pr_info!("gmem_sim{}: removed ({} faults, {} pages copied)\n", d.index, d.faults.load(Ordering::Relaxed), d.copies.load(Ordering::Relaxed));
        }
    }
}
