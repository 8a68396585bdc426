// SPDX-License-Identifier: GPL-2.0
//! gmem_sim: a simulated accelerator. It plugs into gmem.ko exactly as a real driver would,
//! through the safe Rust binding of the driver API (`include/rust/gmem.rs`, over
//! `include/linux/gmem.h`), and is honest about what a device is:
//! - its own memory: a pool of frames (`sim_mem.rs`), capacity set by `mem_mib`;
//! - its own page table per address space (`sim_pt.rs`), driven only by gmem's callbacks;
//! - copy engines moving pages host<->frame and frame<->peer frame, over links whose
//!   bandwidth and latency can be modelled (`sim_link.rs`): `copy_channels` channels per
//!   device that run on the sim's own workqueue beside everything else (`sim_chan.rs`,
//!   the `copy_async` callback), or with 0 channels synchronously in gmem's thread (the
//!   `copy` callback);
//! - kernels (`sim_kernels.rs`) that access memory only through that page table and report
//!   misses to gmem in batches, then replay.
//!
//! Userspace launches kernels through `/dev/gmem_simN` (`include/uapi/linux/gmem_sim.h`),
//! and can hot-unplug a device (`GMEM_SIM_IOC_UNPLUG`).
//!
//! Nothing here is `unsafe` for gmem's sake (that is all in the binding). What is left:
//! touching memory pages (`sim_mem.rs`, and `sim_pt::PageTable::access_pages`, which maps
//! what an entry points at), the `FromBytes`/`AsBytes` marker impls of the ioctl argument
//! structs (plain integers, no padding), and the init of the global device list.
//!
//! Lock order: a context's `pt` lock is a leaf; the driver never calls into gmem with it
//! held, and gmem never holds a spinlock when it calls us. `SIMS` is taken only at open and
//! module load/unload, never with `pt` held. `SimDevice::model` (a link model change, or an
//! unplug) is taken first: under it the driver calls into gmem (`set_links`, unregistration),
//! whose callbacks never take it.

use core::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use kernel::{
    faux,
    fs::File,
    ioctl::{_IO, _IOW, _IOWR},
    miscdevice::{MiscDevice, MiscDeviceOptions, MiscDeviceRegistration},
    new_mutex,
    page::Page,
    prelude::*,
    sync::{global_lock, Arc, Mutex},
    transmute::{AsBytes, FromBytes},
    uaccess::{UserPtr, UserSlice},
};

#[path = "../include/rust/gmem.rs"]
mod gmem;
mod sim_chan;
mod sim_kernels;
mod sim_link;
mod sim_mem;
mod sim_pt;

use gmem::{CopyJob, Frame, Pte, Registration, Space, Submission, Target};
use sim_kernels::{Launch, Runner};
use sim_mem::Pool;
use sim_pt::{encode, SimCtx};

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
        link_h2d_mbps: u64 {
            default: 0,
            description: "Modelled host->device bandwidth, MB/s (0: unlimited)",
        },
        link_d2h_mbps: u64 {
            default: 0,
            description: "Modelled device->host bandwidth, MB/s (0: unlimited)",
        },
        link_d2d_mbps: u64 {
            default: 0,
            description: "Modelled device->peer bandwidth, MB/s (0: unlimited)",
        },
        link_latency_ns: u64 {
            default: 0,
            description: "Modelled latency of each copy-engine call, ns",
        },
        copy_channels: u32 {
            default: 2,
            description: "Copy channels per device, run on workers (0: synchronous copies; up to 16)",
        },
    },
}

const MAX_SIM_DEVICES: usize = 8;
const NAMES: [&CStr; MAX_SIM_DEVICES] =
    [c"gmem_sim0", c"gmem_sim1", c"gmem_sim2", c"gmem_sim3", c"gmem_sim4", c"gmem_sim5", c"gmem_sim6", c"gmem_sim7"];

/// One simulated device: what gmem's callbacks run on.
pub(crate) struct SimDev {
    index: usize,
    pub(crate) pool: Pool,
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
    /// Calls long enough to fail that are let through first (each takes one).
    fail_skip: AtomicU64,
    /// The link model (`GMEM_SIM_IOC_LINK`, module parameters `link_*`).
    links: sim_link::Links,
    /// The copy channels (`copy_channels`) and what they did.
    channels: sim_chan::Channels,
    pub(crate) chan: sim_chan::ChanStats,
    /// Set once gmem's unregistration returned: gmem promises no callback after that, and
    /// the sim checks it (a callback then is logged and WARNs, which fails the test run).
    /// The `SimDev` outlives its registration (the module keeps a reference) for this.
    unregistered: AtomicBool,
}

impl SimDev {
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

    /// Every callback starts here: a callback after unregistration is a gmem bug.
    fn live(&self) -> &Self {
        if self.unregistered.load(Ordering::Acquire) {
            pr_err!("gmem_sim{}: callback after gmem_dev_unregister returned\n", self.index);
            kernel::warn_on!(true);
        }
        self
    }

    /// Runs one batch of copies on the copy engine (in the caller's thread: gmem's for a
    /// synchronous copy, a channel's worker for an asynchronous one).
    pub(crate) fn run_copy(&self, job: CopyJob<'_, Self>) -> Result {
        let plan = self.plan_copy(&job, 0);
        self.run_planned(job, plan)
    }

    /// What the engine will do with `job`, decided when it takes the job: how many pages it
    /// copies (an armed failure fires once, in the middle of the first call long enough for
    /// it once `fail_skip` such calls went through) and the link time it books, from `not_before` (see `sim_link::Links::book`)
    /// or now, behind what the link carries already. A copy after unregistration, even one
    /// queued on a channel, is a gmem bug.
    pub(crate) fn plan_copy(&self, job: &CopyJob<'_, Self>, not_before: u64) -> CopyPlan {
        let n = match job {
            CopyJob::ToDevice(c) | CopyJob::ToHost(c) => c.len(),
            CopyJob::ToPeer(_, c) | CopyJob::Zero(c) => c.len(),
        };
        let armed = self.live().fail_after.load(Ordering::Acquire);
        // A call long enough to fail goes through whole while skips are left (taking one).
        let fires = armed < n as u64
            && self.fail_skip.fetch_update(Ordering::AcqRel, Ordering::Relaxed, |s| s.checked_sub(1)).is_err()
            && self.fail_after.compare_exchange(armed, NO_FAILURE, Ordering::AcqRel, Ordering::Relaxed).is_ok();
        // `armed < n` when it fires, so the cut fits a usize.
        let todo = if fires { armed as usize } else { n };
        let bytes = (todo as u64).saturating_mul(gmem::PAGE_SIZE);
        let path = match job {
            CopyJob::ToDevice(_) => Some(sim_link::Path::H2D),
            CopyJob::ToHost(_) => Some(sim_link::Path::D2H),
            CopyJob::ToPeer(..) => Some(sim_link::Path::D2D),
            // Device memory is not a link.
            CopyJob::Zero(_) => None,
        };
        let booking = path.and_then(|p| self.links.book(p, bytes, not_before));
        CopyPlan { todo, fires, booking }
    }

    /// Carries out `job` as `plan` says: the data move while the booked link time runs,
    /// and the call returns when both are done.
    pub(crate) fn run_planned(&self, job: CopyJob<'_, Self>, plan: CopyPlan) -> Result {
        let r = self.move_data(job, &plan);
        if let Some(b) = plan.booking {
            self.links.wait(b);
        }
        r
    }

    /// The data move of `job` as `plan` says, without waiting for its link time (a copy
    /// channel completes it when that ends: `sim_chan.rs`); the copy's result.
    pub(crate) fn move_data(&self, job: CopyJob<'_, Self>, plan: &CopyPlan) -> Result {
        let todo = plan.todo;
        let r = match job {
            CopyJob::ToDevice(c) => c.iter().take(todo).try_for_each(|e| self.pool.upload(e.frame().index(), e.host())),
            CopyJob::ToHost(c) => c.iter().take(todo).try_for_each(|e| self.pool.download(e.frame().index(), e.host())),
            CopyJob::ToPeer(peer, c) => c
                .iter()
                .take(todo)
                .try_for_each(|e| self.pool.to_peer(e.frame().index(), &peer.live().pool, e.peer_frame().index())),
            CopyJob::Zero(c) => c.iter().take(todo).try_for_each(|e| self.pool.zero(e.frame().index())),
        };
        r?;
        self.copies.fetch_add(todo as u64, Ordering::Relaxed);
        if plan.fires {
            // `fail_err` is in 1..=4095 (checked when armed).
            return Err(Error::from_errno(-(self.fail_err.load(Ordering::Relaxed) as i32)));
        }
        Ok(())
    }

    /// When `plan`'s link time ends, if it has any.
    pub(crate) fn landing_at(&self, plan: &CopyPlan) -> Option<kernel::time::Instant<kernel::time::Monotonic>> {
        plan.booking.as_ref().map(|b| self.links.instant(b))
    }

    /// Installs one entry in `pt` (frames checked against the pool).
    fn map_one(&self, pt: &mut sim_pt::PageTable, p: &Pte) -> Result {
        let in_pool = |f: Frame, n: u64| f.index().checked_add(n - 1).is_some_and(|l| l < self.pool.len() as u64);
        match p.target() {
            Target::Frame(f) if in_pool(f, 1) => pt.set(p.va(), encode(sim_pt::Target::Frame(f.index()), p.writable())),
            // Aligned (the binding checked): 512 frames of the pool from `f`.
            Target::Huge(f) if in_pool(f, HUGE_PAGES) => {
                pt.set_huge(p.va(), encode(sim_pt::Target::Frame(f.index()), p.writable()))
            }
            // The pointer's low bits hold the PTE flags (see `sim_pt`).
            Target::Host(h) if h.as_ptr() as u64 & sim_pt::PTE_FLAGS == 0 => {
                pt.set(p.va(), encode(sim_pt::Target::Host(h.as_ptr()), p.writable()))
            }
            _ => Err(EINVAL),
        }
    }
}

/// Pages of one 2 MiB page-table entry.
const HUGE_PAGES: u64 = gmem::HUGE_PAGES;

#[vtable]
impl gmem::Driver for SimDev {
    type Context = SimCtx;

    fn ctx_create(&self) -> Result<Pin<KBox<SimCtx>>> {
        self.live();
        SimCtx::new()
    }

    fn ctx_destroy(&self, ctx: Pin<KBox<SimCtx>>) {
        let pt = ctx.manage();
        self.live().ptes.fetch_sub(pt.valid, Ordering::Relaxed);
        self.ptes_2m.fetch_sub(pt.huge, Ordering::Relaxed);
    }

    fn map(&self, ctx: &SimCtx, ptes: &[Pte]) -> Result {
        // Leaves first, without the page-table lock (sim_pt.rs); entries of process memory
        // come under gmem's notifier lock after `map_prepare`, and may not allocate at all.
        let mut block = None;
        for p in ptes.iter().filter(|p| !p.sysmem()) {
            if block != Some(p.va() >> 21) {
                block = Some(p.va() >> 21);
                ctx.prepare(p.va(), 1)?;
            }
        }
        let mut pt = ctx.manage();
        let before = (pt.valid, pt.huge, pt.splits);
        let r = ptes.iter().try_for_each(|p| self.live().map_one(&mut pt, p));
        // Entries set before a failure stay set: count them either way.
        self.count_ptes(before, (pt.valid, pt.huge, pt.splits));
        r
    }

    fn map_prepare(&self, ctx: &SimCtx, va: u64, npages: u64) -> Result {
        self.live();
        ctx.prepare(va, npages)
    }

    fn unmap(&self, ctx: &SimCtx, va: u64, npages: u64) {
        let mut pt = ctx.manage();
        let before = (pt.valid, pt.huge, pt.splits);
        pt.clear(va, npages);
        self.live().count_ptes(before, (pt.valid, pt.huge, pt.splits));
    }

    fn tlb_invalidate(&self, _ctx: &SimCtx, _va: u64, _npages: u64) {
        // The simulated device has no TLB beyond its page table (translations are not
        // cached); count the flushes so the benchmarks can see them.
        self.live().tlb_flushes.fetch_add(1, Ordering::Relaxed);
    }

    fn copy(&self, job: CopyJob<'_, Self>) -> Result {
        self.run_copy(job)
    }

    fn copy_async(this: &Arc<Self>, channel: u32, sub: Submission<Self>) {
        this.live().channels.start(this, channel, sub);
    }

    fn copy_poll(&self, channel: u32) {
        self.live().channels.poll(channel);
    }

    fn frame_page(&self, frame: Frame) -> Option<&Page> {
        self.live().pool.frame_ref(frame.index())
    }

    fn test_clear_accessed(&self, ctx: &SimCtx, va: u64) -> bool {
        self.live();
        ctx.manage().test_clear_accessed(va)
    }

    fn test_clear_accessed_range(&self, ctx: &SimCtx, va: u64, bits: &mut [u64]) {
        self.live();
        // One acquisition of the lock every device access takes, for the whole range.
        ctx.manage().test_clear_accessed_range(va, bits)
    }
}

/// A registered simulated device, as open files see it.
#[pin_data]
struct SimDevice {
    reg: Registration<SimDev>,
    /// Address of its `/dev/gmem_simN` registration (0 until it exists), to find the
    /// device at open.
    misc: AtomicUsize,
    /// Held by a change of the link model, from the unplug check to gmem being told the
    /// new bandwidths, and by an unplug: two changes at once could otherwise leave a model
    /// mixed of both, or gmem told one model while the device keeps the other; a change
    /// could also pass the unplug check, change the model, and fail with `ENODEV`.
    #[pin]
    model: Mutex<()>,
}

global_lock! {
    // SAFETY: initialised in module init before any device node exists. (The one `unsafe`
    // of the driver that is not about memory: the 7.3 tree has no const-initialised mutex;
    // Binder declares its global context list the same way.)
    unsafe(uninit) static SIMS: Mutex<KVec<Arc<SimDevice>>> = KVec::new();
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
    channels: u32,
    pad: u32,
    async_calls: u64,
    async_pages: u64,
    inflight: u64,
    max_inflight: u64,
    polled: u64,
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
    skip: u64,
    reserved: u64,
}
// SAFETY: integers only, no padding.
unsafe impl FromBytes for FailCopyArg {}
// SAFETY: as above.
unsafe impl AsBytes for FailCopyArg {}

/// `struct gmem_sim_link`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct LinkArg {
    argsz: u32,
    flags: u32,
    mbps: [u64; 3],
    latency_ns: u64,
    bytes: [u64; 3],
    busy_ns: [u64; 3],
    reserved: [u64; 2],
}
// SAFETY: integers only, no padding.
unsafe impl FromBytes for LinkArg {}
// SAFETY: as above.
unsafe impl AsBytes for LinkArg {}

/// `GMEM_SIM_LINK_SET`: set the model from the argument.
const LINK_SET: u32 = 1;
const PATHS: [sim_link::Path; 3] = [sim_link::Path::H2D, sim_link::Path::D2H, sim_link::Path::D2D];

const IOC_LAUNCH: u32 = _IOWR::<LaunchArg>(b'S' as u32, 0x01);
const IOC_INFO: u32 = _IOWR::<InfoArg>(b'S' as u32, 0x02);
const IOC_FAIL_COPY: u32 = _IOW::<FailCopyArg>(b'S' as u32, 0x03);
const IOC_UNPLUG: u32 = _IO(b'S' as u32, 0x04);
const IOC_LINK: u32 = _IOWR::<LinkArg>(b'S' as u32, 0x05);
/// `fail_after` when no copy failure is armed.
const NO_FAILURE: u64 = u64::MAX;

/// One open of `/dev/gmem_simN`.
struct SimFile {
    dev: Arc<SimDevice>,
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
        let space = Space::current()?;
        // The session keeps the device registered and our context for the space alive
        // until the launch ends (an unplug waits for it, and ends it early: `ENODEV`).
        let session = self.dev.reg.session(&space)?;
        let mut runner = Runner::new(self.dev.reg.data(), &session)?;
        let res = runner.run(&launch);
        l.result = runner.out.result;
        l.faults = runner.out.faults;
        l.batches = runner.out.batches;
        res?;
        w.write(&l)
    }

    /// Arms a one-shot copy-engine failure (fault injection for the tests).
    fn fail_copy(&self, arg: usize) -> Result {
        let f: FailCopyArg =
            UserSlice::new(UserPtr::from_addr(arg), core::mem::size_of::<FailCopyArg>()).reader().read()?;
        if f.argsz as usize != core::mem::size_of::<FailCopyArg>()
            || f.reserved != 0
            || f.err == 0
            || f.err > 4095
            || f.after == NO_FAILURE
        {
            return Err(EINVAL);
        }
        let d = self.dev.reg.data();
        d.fail_err.store(f.err, Ordering::Relaxed);
        d.fail_skip.store(f.skip, Ordering::Relaxed);
        d.fail_after.store(f.after, Ordering::Release);
        Ok(())
    }

    fn info(&self, arg: usize) -> Result {
        let (mut r, mut w) = UserSlice::new(UserPtr::from_addr(arg), core::mem::size_of::<InfoArg>()).reader_writer();
        let mut i: InfoArg = r.read()?;
        if i.argsz as usize != core::mem::size_of::<InfoArg>() {
            return Err(EINVAL);
        }
        let d = self.dev.reg.data();
        i.gmem_id = self.dev.reg.id();
        i.nr_frames = d.pool.len() as u64;
        i.ptes = d.ptes.load(Ordering::Relaxed);
        i.copies = d.copies.load(Ordering::Relaxed);
        i.tlb_flushes = d.tlb_flushes.load(Ordering::Relaxed);
        i.ptes_2m = d.ptes_2m.load(Ordering::Relaxed);
        i.splits_2m = d.splits_2m.load(Ordering::Relaxed);
        i.channels = d.channels.len();
        i.async_calls = d.chan.async_calls.load(Ordering::Relaxed);
        i.async_pages = d.chan.async_pages.load(Ordering::Relaxed);
        i.inflight = d.chan.inflight.load(Ordering::Relaxed);
        i.max_inflight = d.chan.max_inflight.load(Ordering::Relaxed);
        i.polled = d.chan.polled.load(Ordering::Relaxed);
        w.write(&i)
    }

    /// Reads, and with `GMEM_SIM_LINK_SET` first sets, the device's link model; reports
    /// the bytes and modelled busy time of each path.
    fn link(&self, arg: usize) -> Result {
        let (mut r, mut w) = UserSlice::new(UserPtr::from_addr(arg), core::mem::size_of::<LinkArg>()).reader_writer();
        let mut l: LinkArg = r.read()?;
        if l.argsz as usize != core::mem::size_of::<LinkArg>() || l.flags & !LINK_SET != 0 || l.reserved != [0; 2] {
            return Err(EINVAL);
        }
        let links = &self.dev.reg.data().links;
        {
            // Read under the lock too: a reply holds one whole model.
            let _model = self.dev.model.lock();
            if l.flags & LINK_SET != 0 {
                if !sim_link::valid(&l.mbps, l.latency_ns) {
                    return Err(EINVAL);
                }
                // An unplugged device's links are no longer gmem's to know: refused before
                // anything changes (an unplug cannot start before `report_links`: it takes
                // the same lock).
                if self.dev.reg.is_unplugged() {
                    return Err(ENODEV);
                }
                // The channels' queues first, then the paths: a copy started in between
                // books from now, among the old paths' reservations, which `set` then drops.
                self.dev.reg.data().channels.reset_bookings();
                links.set(l.mbps, l.latency_ns);
                report_links(&self.dev.reg)?;
            }
            for (k, p) in PATHS.iter().enumerate() {
                let s = links.stats(*p);
                (l.mbps[k], l.bytes[k], l.busy_ns[k]) = (s.mbps, s.bytes, s.busy_ns);
            }
            l.latency_ns = links.latency_ns();
        }
        // Without the lock: the struct may lie in a GMEM region and fault.
        w.write(&l)
    }

    /// Hot-unplug (as a PCI remove would): running launches end with `ENODEV`, gmem saves
    /// every page to the host, later launches get `ENODEV`. The node stays until unload.
    fn unplug(&self) -> Result {
        let _model = self.dev.model.lock();
        if !self.dev.reg.unplug() {
            return Err(ENODEV);
        }
        self.dev.reg.data().unregistered.store(true, Ordering::Release);
        pr_info!("gmem_sim{}: unplugged\n", self.dev.reg.data().index);
        Ok(())
    }
}

#[vtable]
impl MiscDevice for SimFile {
    type Ptr = Pin<KBox<Self>>;

    fn open(_file: &File, misc: &MiscDeviceRegistration<Self>) -> Result<Pin<KBox<Self>>> {
        let me = core::ptr::from_ref(misc) as usize;
        let dev = SIMS.lock().iter().find(|d| d.misc.load(Ordering::Acquire) == me).cloned().ok_or(ENODEV)?;
        KBox::pin(SimFile { dev }, GFP_KERNEL).map_err(Into::into)
    }

    fn ioctl(me: Pin<&SimFile>, _file: &File, cmd: u32, arg: usize) -> Result<isize> {
        match cmd {
            IOC_LAUNCH => me.launch(arg),
            IOC_INFO => me.info(arg),
            IOC_FAIL_COPY => me.fail_copy(arg),
            IOC_UNPLUG => me.unplug(),
            IOC_LINK => me.link(arg),
            _ => Err(ENOTTY),
        }
        .map(|()| 0)
    }
}

struct SimModule {
    regs: KVec<Pin<KBox<MiscDeviceRegistration<SimFile>>>>,
    devs: KVec<Arc<SimDevice>>,
    /// The devices' data, kept past their registrations (see `SimDev::unregistered`).
    data: KVec<Arc<SimDev>>,
    _faux: faux::Registration,
    /// The copy channels' workqueue: declared last, so dropped (drained) after every
    /// device is unregistered and its data released.
    wq: sim_chan::Wq,
}

/// A copy-engine call as the engine took it (`SimDev::plan_copy`).
pub(crate) struct CopyPlan {
    todo: usize,
    fires: bool,
    booking: Option<sim_link::Booking>,
}

impl CopyPlan {
    /// When its link time ends (`None`: no link time).
    pub(crate) fn ends(&self) -> Option<u64> {
        self.booking.as_ref().map(sim_link::Booking::end)
    }
}

/// Tells gmem the bandwidths of the device's modelled links (an unmodelled link, 0, is
/// reported as unknown: gmem then routes nothing over it), as a real driver would report
/// what it read from its bus.
fn report_links(reg: &Registration<SimDev>) -> Result {
    let l = &reg.data().links;
    let m = |p| l.stats(p).mbps;
    reg.set_links(m(sim_link::Path::H2D), m(sim_link::Path::D2H), m(sim_link::Path::D2D))
}

impl SimModule {
    fn add_device(&mut self, index: usize, frames: usize) -> Result {
        let dev = Arc::new(
            SimDev {
                index,
                pool: Pool::new(frames)?,
                ptes: AtomicU64::new(0),
                ptes_2m: AtomicU64::new(0),
                splits_2m: AtomicU64::new(0),
                copies: AtomicU64::new(0),
                tlb_flushes: AtomicU64::new(0),
                faults: AtomicU64::new(0),
                fail_after: AtomicU64::new(NO_FAILURE),
                fail_err: AtomicU32::new(0),
                fail_skip: AtomicU64::new(0),
                links: sim_link::Links::new(
                    [
                        module_parameters::link_h2d_mbps.value(),
                        module_parameters::link_d2h_mbps.value(),
                        module_parameters::link_d2d_mbps.value(),
                    ],
                    module_parameters::link_latency_ns.value(),
                )?,
                unregistered: AtomicBool::new(false),
                channels: sim_chan::Channels::new(&self.wq, module_parameters::copy_channels.value())?,
                chan: sim_chan::ChanStats::default(),
            },
            GFP_KERNEL,
        )?;
        self.data.push(dev.clone(), GFP_KERNEL)?;
        let opts = gmem::Options {
            name: NAMES[index],
            nr_frames: frames as u64,
            map_2m: module_parameters::map_2m.value(),
            channels: dev.channels.len(),
        };
        let reg = Registration::new(opts, dev)?;
        report_links(&reg)?;
        pr_info!("gmem_sim{}: gmem device {}, {} frames\n", index, reg.id(), frames);
        let sd = Arc::pin_init(
            pin_init!(SimDevice {
                reg,
                misc: AtomicUsize::new(0),
                model <- new_mutex!((), "gmem_sim::SimDevice::model"),
            }),
            GFP_KERNEL,
        )?;
        self.devs.push(sd.clone(), GFP_KERNEL)?;
        SIMS.lock().push(sd, GFP_KERNEL)?;
        Ok(())
    }

    /// Creates `/dev/gmem_simN` of device `index` (once every device is registered, so
    /// that nothing can open a node while a later registration may still fail).
    fn add_node(&mut self, index: usize) -> Result {
        let misc =
            KBox::pin_init(MiscDeviceRegistration::register(MiscDeviceOptions { name: NAMES[index] }), GFP_KERNEL)?;
        let addr = core::ptr::from_ref(&*misc) as usize;
        self.regs.push(misc, GFP_KERNEL)?;
        if let Some(d) = self.devs.get(index) {
            d.misc.store(addr, Ordering::Release);
        }
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
        if module_parameters::copy_channels.value() > sim_chan::MAX_CHANNELS {
            return Err(EINVAL);
        }
        let link = [
            module_parameters::link_h2d_mbps.value(),
            module_parameters::link_d2h_mbps.value(),
            module_parameters::link_d2d_mbps.value(),
        ];
        if !sim_link::valid(&link, module_parameters::link_latency_ns.value()) {
            return Err(EINVAL);
        }
        // SAFETY: called once, before any device exists.
        unsafe { SIMS.init() };
        let mut m = SimModule {
            regs: KVec::new(),
            devs: KVec::new(),
            data: KVec::new(),
            _faux: faux::Registration::new(c"gmem_sim", None)?,
            wq: sim_chan::Wq::new()?,
        };
        // On failure `m` is dropped, which removes what was added.
        for i in 0..n {
            m.add_device(i, mib * 256)?;
        }
        for i in 0..n {
            m.add_node(i)?;
        }
        Ok(m)
    }
}

impl Drop for SimModule {
    fn drop(&mut self) {
        // No new opens (open files pin the module, so none exist now).
        self.regs.clear();
        // Statics are not dropped at unload: empty the list (its buffer too).
        drop(core::mem::take(&mut *SIMS.lock()));
        // The last references to the registrations: each unplugs (gmem evacuates every
        // page to the host and destroys our contexts first).
        self.devs.clear();
        for d in self.data.iter() {
            d.unregistered.store(true, Ordering::Release);
            pr_info!(
                "gmem_sim{}: removed ({} faults, {} pages copied)\n",
                d.index,
                d.faults.load(Ordering::Relaxed),
                d.copies.load(Ordering::Relaxed)
            );
        }
    }
}
