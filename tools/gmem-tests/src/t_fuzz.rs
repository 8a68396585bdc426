// SPDX-License-Identifier: GPL-2.0
//! Fuzz: several processes, each with several threads, issue random and half-valid calls on
//! `/dev/gmem` and `/dev/gmem_sim0..1` for `FUZZ_SECS` of wall time: every ioctl with random
//! sizes, flags, reserved words, `argsz`, devices, advice, fence ids and hostile addresses
//! (NULL, kernel, misaligned, non-canonical, the last page below 2^64), every sim kernel
//! with random arguments, interleaved with mmap/munmap/mprotect/mremap of `/dev/gmem`, CPU
//! accesses, fork (the child makes a few calls, then exits or is killed), close/reopen and
//! process exit (clean, or `_exit` with threads inside the kernel, or SIGKILL).
//!
//! Every call is judged: calls with a wrong static field (argsz, reserved, flags, unknown
//! advice or kernel, a range that cannot fit) must fail with exactly the documented errno;
//! well-formed calls on the thread's own regions may fail only with the documented
//! contention errors (ENOMEM, EIO, ...); any result must be one the API documents. Each
//! thread also keeps a private region whose contents it models word by word and checks
//! after device kernels, prefetches, DONTNEED, pins and CPU accesses, while the other
//! threads and processes evict its pages. Afterwards (all fuzz processes reaped) every device
//! frame must be free and the module must still move data correctly.
//!
//! The fuzzer's own memory is never handed to the kernel as an output buffer except the
//! dedicated scratch buffers (ioctl argument block, QUERY output); pointers the kernel may
//! write through are otherwise GMEM regions of the calling thread, or addresses where
//! nothing of the process is mapped. Destructive calls (FREE, munmap, mprotect, mremap,
//! MAP_FIXED, PIN) only name the calling thread's own regions. The seed is printed (`GMEM-FUZZ seed=`); the
//! kernel command line parameter `gmem_fuzz_seed=N` (an environment variable of /init)
//! replays it (up to thread interleaving).

use crate::harness::{Test, TestResult};
use crate::{ensure, ok};
use libgmem::sim::{
    SimInfo, SimLaunch, GMEM_SIM_IOC_INFO, GMEM_SIM_IOC_LAUNCH, K_AXPY, K_CHECKSUM, K_COPY, K_FILL, K_TOUCH,
};
use libgmem::*;
use std::fmt::Write as _;
use std::result::Result;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Wall time of the fuzz phase. The rest of the test (grace period, reaping, draining, the
/// final checks) is bounded separately and stays well inside the harness's 240 s alarm,
/// also on the debug kernel: the fuzz is bounded by time, never by a number of calls.
pub const FUZZ_SECS: u64 = 60;
/// ALLOC and mmap sizes above 64 GiB, up to `GMEM_MAX_ALLOC` (1 TiB). They must fail with
/// ENOMEM (per-page metadata, gmem/obj/meta.rs) or succeed, never OOM-kill (the judge fails
/// the run on any OOM kill). (Sizes beyond 1 TiB, which must give E2BIG/EINVAL, are
/// always fuzzed.)
const HUGE_SIZES: bool = true;
/// Fuzz processes alive at any time (each is replaced when it exits or is killed).
const PROCS: usize = 2;
/// Threads per fuzz process (all share its GMEM space).
const THREADS: usize = 3;
/// Devices the guest loads (`gmem_sim nr_devices=2`).
const NDEV: usize = 2;
/// After the deadline: how long fuzz processes get to stop on their own before SIGKILL.
const GRACE: Duration = Duration::from_secs(15);
/// A killed process must be reaped within this (a launch checks for fatal signals).
const REAP: Duration = Duration::from_secs(30);
/// After every fuzz process is gone: how long asynchronous work may take to free frames.
const DRAIN: Duration = Duration::from_secs(20);
/// Largest range a data-moving call covers (launch length, PREFETCH/PIN length): once the
/// device size (the guest's devices have 16 MiB).
const MAX_MOVE: u64 = 16 << 20;
/// Bytes of small/medium regions a thread keeps (big ones are freed after a few calls).
const THREAD_BUDGET: u64 = 48 << 20;
/// Failure messages one process sends (more are only counted).
const MAX_MESSAGES: u32 = 8;

const PAGE: u64 = 4096;
const QUERY_MAX: u64 = GMEM_QUERY_MAX;
/// Words of the QUERY scratch buffer.
const SCRATCH_WORDS: usize = 1 << 14;

// Counters, in the shared page.
const C_CALLS: usize = 0;
const C_GMEM: usize = 1;
const C_SIM: usize = 2;
const C_MMAP: usize = 3;
const C_CPU: usize = 4;
const C_FORK: usize = 5;
const C_REOPEN: usize = 6;
const C_PROCS: usize = 7;
const C_KILLED: usize = 8;
const C_SOFT: usize = 9;
const C_ERRORS: usize = 10;
const C_VERIFY: usize = 11;
const C_EXIT: usize = 12;
const C_ALLOC_HUGE: usize = 13;
/// Milliseconds spent in each kind of step (to see where the time goes).
const C_MS: usize = 16;
const MS_KINDS: [&str; 13] =
    ["alloc", "free", "advise", "wait", "query", "ver", "launch", "info", "mmap", "cpu", "verify", "fork", "reopen"];
const NCOUNTERS: usize = C_MS + MS_KINDS.len();
const COUNTER_NAMES: [(usize, &str); 14] = [
    (C_CALLS, "calls"),
    (C_GMEM, "ioctl_gmem"),
    (C_SIM, "ioctl_sim"),
    (C_MMAP, "mmap"),
    (C_CPU, "cpu"),
    (C_FORK, "fork"),
    (C_REOPEN, "reopen"),
    (C_VERIFY, "verify"),
    (C_PROCS, "procs"),
    (C_EXIT, "exit_early"),
    (C_KILLED, "killed"),
    (C_ALLOC_HUGE, "huge_alloc_ok"),
    (C_SOFT, "soft_errors"),
    (C_ERRORS, "errors"),
];

/// State shared by the test process and every fuzz process: an anonymous shared page.
#[repr(C)]
struct Shared {
    stop: AtomicU32,
    n: [AtomicU64; NCOUNTERS],
}

impl Shared {
    fn add(&self, c: usize, v: u64) {
        self.n[c].fetch_add(v, Relaxed);
    }
    fn get(&self, c: usize) -> u64 {
        self.n[c].load(Relaxed)
    }
}

/// splitmix64: small, fast, good enough to pick fuzz inputs. (A `Cell`, so that a choice
/// can draw inside the argument list of another: `rng.pick(&[0, rng.next()])`.)
struct Rng(std::cell::Cell<u64>);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(std::cell::Cell::new(seed))
    }
    fn next(&self) -> u64 {
        let s = self.0.get().wrapping_add(0x9e37_79b9_7f4a_7c15);
        self.0.set(s);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (0 if n == 0).
    fn below(&self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
    /// Uniform in `lo..=hi`.
    fn range(&self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            lo
        } else {
            lo + self.below(hi - lo + 1)
        }
    }
    fn chance(&self, pct: u64) -> bool {
        self.below(100) < pct
    }
    fn pick<T: Copy>(&self, xs: &[T]) -> T {
        xs[self.below(xs.len() as u64) as usize]
    }
    /// Log-uniform in `lo..=hi` (lo >= 1): small values as often as big ones per octave.
    fn log(&self, lo: u64, hi: u64) -> u64 {
        let (a, b) = (63 - lo.leading_zeros() as u64, 63 - hi.leading_zeros() as u64);
        let e = self.range(a, b);
        let v = (1u64 << e) | self.below(1u64 << e);
        v.clamp(lo, hi)
    }
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// What a call may return: success, and/or a set of errnos.
#[derive(Clone, Copy)]
struct Expect {
    ok: bool,
    errs: u128,
}

fn bit(e: i32) -> u128 {
    if (0..128).contains(&e) {
        1u128 << e
    } else {
        0
    }
}

impl Expect {
    fn only(e: i32) -> Expect {
        Expect { ok: false, errs: bit(e) }
    }
    fn errs(es: &[i32]) -> Expect {
        Expect { ok: false, errs: es.iter().fold(0, |m, &e| m | bit(e)) }
    }
    fn ok_or(es: &[i32]) -> Expect {
        Expect { ok: true, ..Expect::errs(es) }
    }
    fn or(mut self, es: &[i32]) -> Expect {
        self.errs |= Expect::errs(es).errs;
        self
    }
    fn allows(&self, r: Result<i64, i32>) -> bool {
        match r {
            Ok(_) => self.ok,
            Err(e) => bit(e) & self.errs != 0,
        }
    }
    fn show(&self) -> String {
        let mut s = String::new();
        if self.ok {
            s.push_str("ok");
        }
        for e in 0..128 {
            if self.errs & bit(e) != 0 {
                let _ = write!(s, "{}{}", if s.is_empty() { "" } else { "|" }, ename(e));
            }
        }
        s
    }
}

fn ename(e: i32) -> String {
    let n = match e {
        libc::EPERM => "EPERM",
        libc::ENOENT => "ENOENT",
        libc::EINTR => "EINTR",
        libc::EIO => "EIO",
        libc::E2BIG => "E2BIG",
        libc::EBADF => "EBADF",
        libc::ENOMEM => "ENOMEM",
        libc::EACCES => "EACCES",
        libc::EFAULT => "EFAULT",
        libc::EBUSY => "EBUSY",
        libc::EEXIST => "EEXIST",
        libc::EXDEV => "EXDEV",
        libc::ENODEV => "ENODEV",
        libc::EINVAL => "EINVAL",
        libc::ENOTTY => "ENOTTY",
        libc::ENOSPC => "ENOSPC",
        libc::EOVERFLOW => "EOVERFLOW",
        _ => return format!("errno{e}"),
    };
    n.to_string()
}

fn show_result(r: Result<i64, i32>) -> String {
    match r {
        Ok(v) => format!("ok({v:#x})"),
        Err(e) => ename(e),
    }
}

// Documented errnos of each call (Documentation/user-api.rst), for calls whose outcome
// depends on what other threads did in between.
const ADVISE_ERRS: [i32; 10] = [
    libc::ENODEV,
    libc::ENOENT,
    libc::EOVERFLOW,
    libc::EBUSY,
    libc::E2BIG,
    libc::EFAULT,
    libc::ENOSPC,
    libc::ENOMEM,
    libc::EXDEV,
    libc::EINVAL,
];
/// What an asynchronous prefetch may report through WAIT.
const FENCE_ERRS: [i32; 6] = [libc::EBUSY, libc::ENOMEM, libc::ENODEV, libc::EFAULT, libc::ENOENT, libc::EXDEV];

// Hostile addresses: nothing of the process is ever mapped there.
const HOSTILE: [u64; 16] = [
    0,
    1,
    8,
    0xfff,
    0x1000,
    0x2004,
    0x0000_8000_0000_0000, // first non-canonical
    0x0000_8000_0000_1000,
    0xffff_8880_0000_0000, // direct map
    0xffff_ffff_8100_0000, // kernel text
    0xffff_ffff_ff60_0000, // vsyscall page
    0xffff_ffff_fff0_0000, // last MiB
    0xffff_ffff_ffff_0000,
    0xffff_ffff_ffff_e000,
    0xffff_ffff_ffff_f000, // last page
    0xffff_ffff_ffff_fee4,
];

/// A hostile address (for arguments the kernel only reads, or that name a range).
fn hostile(rng: &Rng) -> u64 {
    match rng.below(10) {
        0 => u64::MAX - 3 - (rng.below(64) << 2),
        1 => 0xffff_ffff_fff0_0000 + (rng.below(1 << 18) << 2), // anywhere in the last MiB
        2 => rng.next() | (1 << 63),
        3 => 0x0000_8000_0000_0000 + (rng.below(1 << 40) << 2),
        _ => rng.pick(&HOSTILE),
    }
}

/// A region of the calling thread.
#[derive(Clone, Copy, Debug)]
struct Region {
    addr: u64,
    len: u64,
    prot: i32,
    /// VM_MAYWRITE: false for a mapping of an O_RDONLY fd.
    maywrite: bool,
    /// A PIN was asked on part of it and not undone by a full UNPIN: CPU access may SIGBUS.
    pinned: bool,
    /// Calls left before a big region is freed (0: not big).
    ttl: u32,
}

impl Region {
    fn end(&self) -> u64 {
        self.addr + self.len
    }
    fn cpu_ok(&self) -> bool {
        !self.pinned && self.prot & libc::PROT_READ != 0
    }
}

/// Per fuzz process.
struct Proc<'s> {
    shared: &'s Shared,
    errfd: i32,
    stop: AtomicBool,
    deadline: Instant,
    /// Regions of every thread of this process, for calls that cannot hurt their owner
    /// (device kernels, QUERY, PREFETCH and hints, DONTNEED). Entries may be stale.
    published: Mutex<Vec<(u64, u64)>>,
    messages: AtomicU32,
}

impl Proc<'_> {
    fn done(&self) -> bool {
        self.stop.load(Relaxed) || self.shared.stop.load(Relaxed) != 0 || Instant::now() >= self.deadline
    }

    fn fail(&self, msg: &str) {
        self.shared.add(C_ERRORS, 1);
        if self.messages.fetch_add(1, Relaxed) < MAX_MESSAGES {
            let mut m = msg.replace('\n', " ");
            m.truncate(600);
            m.push('\n');
            // SAFETY: writing a buffer we own to our pipe (non-blocking: a full pipe drops it).
            unsafe { libc::write(self.errfd, m.as_ptr().cast(), m.len()) };
        }
    }

    fn publish(&self, addr: u64, len: u64) {
        if let Ok(mut p) = self.published.lock() {
            p.push((addr, len));
        }
    }

    fn unpublish(&self, addr: u64) {
        if let Ok(mut p) = self.published.lock() {
            p.retain(|e| e.0 != addr);
        }
    }

    fn any_published(&self, rng: &Rng) -> Option<(u64, u64)> {
        let p = self.published.lock().ok()?;
        if p.is_empty() {
            None
        } else {
            Some(p[rng.below(p.len() as u64) as usize])
        }
    }
}

/// A page-aligned anonymous PROT_NONE reservation with a GMEM mapping of `len` in its middle:
/// nothing that runs past the ends of another region can reach it.
fn guarded_region(fd: i32, len: u64) -> Option<u64> {
    const GUARD: u64 = 2 << 20;
    // SAFETY: a fresh anonymous reservation, then a fixed mapping inside it (our memory).
    unsafe {
        let base = libc::mmap(
            std::ptr::null_mut(),
            (len + 2 * GUARD) as usize,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        );
        if base == libc::MAP_FAILED {
            return None;
        }
        let addr = base as u64 + GUARD;
        let m = libc::mmap(
            addr as *mut libc::c_void,
            len as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_FIXED,
            fd,
            0,
        );
        (m as u64 == addr).then_some(addr)
    }
}

fn open_rw(path: &str) -> Option<std::fs::File> {
    std::fs::OpenOptions::new().read(true).write(true).open(path).ok()
}

fn sim_path(d: usize) -> String {
    format!("/dev/gmem_sim{d}")
}

/// Where an ioctl's argument block lives.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ArgAt {
    /// The thread's argument buffer, at this byte offset (misaligned if not 0).
    Buf(usize),
    /// The thread's private argument region (a GMEM region), at this byte offset.
    Gmem(u64),
    /// A read-only page: the kernel can read the block but not write it back.
    ReadOnly,
    /// An address where nothing is mapped, or a kernel address.
    Bad(u64),
}

/// The private region whose contents a thread models and checks.
struct Verify {
    addr: u64,
    words: usize,
    model: Vec<u32>,
    known: bool,
    pinned: bool,
    /// The last operations on the region (word range, what), printed with a mismatch.
    hist: std::collections::VecDeque<(usize, usize, String)>,
}

impl Verify {
    fn log(&mut self, w0: usize, n: usize, what: String) {
        if self.hist.len() == 64 {
            self.hist.pop_front();
        }
        self.hist.push_back((w0, w0 + n, what));
    }

    /// The logged operations whose range covers word `w`'s page, oldest first.
    fn history_of(&self, w: usize) -> String {
        let (lo, hi) = (w / 1024 * 1024, w / 1024 * 1024 + 1024);
        let mut out = String::new();
        for (a, b, what) in &self.hist {
            if *a < hi && *b > lo {
                let _ = write!(out, "[{what} {a}+{}] ", b - a);
            }
        }
        out
    }
}

struct Worker<'p, 's> {
    p: &'p Proc<'s>,
    rng: Rng,
    g: Option<Gmem>,
    ro: Option<std::fs::File>,
    sims: Vec<Option<std::fs::File>>,
    /// Outstanding fences of `g`; `hidden` more were created without us learning the id.
    fences: Vec<u64>,
    hidden: usize,
    last_fence: u64,
    waited: Vec<u64>,
    regions: Vec<Region>,
    scratch: Vec<u32>,
    arg: Box<[u64; 16]>,
    argreg: u64,
    ro_page: u64,
    memfd: i32,
    v: Verify,
}

/// Bytes of the private argument region.
const ARGREG: u64 = 4 * PAGE;
/// Bytes of the private verified region.
const VERIFY_BYTES: u64 = 256 * PAGE;

fn as_bytes<T: Copy>(v: &T) -> &[u8] {
    // SAFETY: the uapi structs are plain integers without padding.
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), std::mem::size_of::<T>()) }
}

fn from_bytes<T: Copy + Default>(b: &[u8]) -> T {
    let mut v = T::default();
    let n = std::mem::size_of::<T>().min(b.len());
    // SAFETY: `v` is plain data of at least `n` bytes; any bytes are a valid value.
    unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), (&mut v as *mut T).cast::<u8>(), n) };
    v
}

/// `_IOWR(magic, nr, size)`.
fn iowr(magic: u8, nr: u64, size: u64) -> u64 {
    (3u64 << 30) | ((size & 0x3fff) << 16) | ((magic as u64) << 8) | (nr & 0xff)
}

impl<'p, 's> Worker<'p, 's> {
    fn new(p: &'p Proc<'s>, seed: u64, argreg: u64, verify: u64) -> Option<Self> {
        let g = Gmem::open().ok()?;
        let sims = (0..NDEV).map(|d| open_rw(&sim_path(d))).collect();
        // SAFETY: a fresh anonymous page (ours) and a fresh memfd.
        let (ro_page, memfd) = unsafe {
            let a = libc::mmap(
                std::ptr::null_mut(),
                PAGE as usize,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            if a == libc::MAP_FAILED {
                return None;
            }
            (a as u64, libc::memfd_create(c"gmem-fuzz".as_ptr(), libc::MFD_CLOEXEC))
        };
        let words = (VERIFY_BYTES / 4) as usize;
        Some(Worker {
            p,
            rng: Rng::new(seed),
            g: Some(g),
            ro: std::fs::OpenOptions::new().read(true).open("/dev/gmem").ok(),
            sims,
            fences: Vec::new(),
            hidden: 0,
            last_fence: 0,
            waited: Vec::new(),
            regions: Vec::new(),
            scratch: vec![0u32; SCRATCH_WORDS],
            arg: Box::new([0u64; 16]),
            argreg,
            ro_page,
            memfd,
            v: Verify {
                addr: verify,
                words,
                model: vec![0; words],
                known: true,
                pinned: false,
                hist: Default::default(),
            },
        })
    }

    fn gfd(&self) -> i32 {
        self.g.as_ref().map_or(-1, |g| g.fd())
    }

    fn sim_fd(&mut self) -> (usize, i32) {
        let d = self.rng.below(NDEV as u64) as usize;
        (d, self.sims[d].as_ref().map_or(-1, std::os::fd::AsRawFd::as_raw_fd))
    }

    fn fail(&self, msg: String) {
        self.p.fail(&msg);
    }

    fn soft(&self) {
        self.p.shared.add(C_SOFT, 1);
    }

    /// Judges one call.
    fn judge(&self, what: &dyn Fn() -> String, r: Result<i64, i32>, e: Expect) -> bool {
        if e.allows(r) {
            return true;
        }
        self.fail(format!("{}: got {}, expected {}", what(), show_result(r), e.show()));
        false
    }

    // ---- argument placement -------------------------------------------------------

    fn arg_at(&mut self) -> ArgAt {
        match self.rng.below(100) {
            0..=84 => ArgAt::Buf(0),
            85..=88 => ArgAt::Buf(self.rng.range(1, 7) as usize),
            89..=93 => ArgAt::Gmem(self.rng.below(ARGREG - 128)),
            94..=95 => ArgAt::ReadOnly,
            _ => ArgAt::Bad(self.rng.pick(&HOSTILE[..12])),
        }
    }

    /// Puts `bytes` where `at` says; returns the pointer to pass.
    fn place(&mut self, at: ArgAt, bytes: &[u8]) -> u64 {
        match at {
            ArgAt::Buf(off) => {
                // SAFETY: the argument buffer has 128 bytes; off <= 7 and bytes <= 96.
                unsafe {
                    let p = self.arg.as_mut_ptr().cast::<u8>().add(off);
                    std::ptr::copy_nonoverlapping(bytes.as_ptr(), p, bytes.len());
                    p as u64
                }
            }
            ArgAt::Gmem(off) => {
                if self.rng.chance(30) {
                    // Make the kernel's copy_from_user migrate the block home first.
                    let dev = self.rng.below(NDEV as u64) as i32;
                    let _ = self.advise_raw(self.argreg, ARGREG, GMEM_ADV_PREFETCH, dev, 0);
                }
                let p = self.argreg + off;
                // SAFETY: our private GMEM region, `off + bytes <= ARGREG`; never pinned.
                unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), p as *mut u8, bytes.len()) };
                p
            }
            ArgAt::ReadOnly => {
                // SAFETY: our own anonymous page, made writable for the copy only.
                unsafe {
                    libc::mprotect(
                        self.ro_page as *mut libc::c_void,
                        PAGE as usize,
                        libc::PROT_READ | libc::PROT_WRITE,
                    );
                    std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.ro_page as *mut u8, bytes.len());
                    libc::mprotect(self.ro_page as *mut libc::c_void, PAGE as usize, libc::PROT_READ);
                }
                self.ro_page
            }
            ArgAt::Bad(a) => a,
        }
    }

    /// Reads the block back after the call.
    fn fetch<T: Copy + Default>(&self, at: ArgAt, ptr: u64) -> T {
        match at {
            ArgAt::Buf(_) | ArgAt::Gmem(_) | ArgAt::ReadOnly => {
                let mut b = [0u8; 128];
                let n = std::mem::size_of::<T>();
                // SAFETY: `ptr` is one of our buffers (argument buffer, private region,
                // read-only page) with at least `n` readable bytes.
                unsafe { std::ptr::copy_nonoverlapping(ptr as *const u8, b.as_mut_ptr(), n) };
                from_bytes(&b[..n])
            }
            ArgAt::Bad(_) => T::default(),
        }
    }

    /// An ioctl whose block is `arg` placed at `at`. Returns the result and the block after.
    fn call<T: Copy + Default>(&mut self, fd: i32, cmd: u64, arg: &T, at: ArgAt) -> (Result<i64, i32>, T) {
        let ptr = self.place(at, as_bytes(arg));
        // SAFETY: `ptr` is a dedicated buffer of ours or a GMEM region of this thread (the
        // kernel writes at most `size_of::<T>()` bytes, which fit), or an address where
        // nothing of the process is mapped.
        let r = unsafe { libc::ioctl(fd, cmd as _, ptr as usize as *mut libc::c_void) };
        let r = if r < 0 { Err(errno()) } else { Ok(r as i64) };
        self.p.shared.add(C_CALLS, 1);
        (r, self.fetch(at, ptr))
    }

    /// Widens an expectation for an argument block that was not (fully) usable.
    fn at_expect(at: ArgAt, e: Expect, writes_back: bool) -> Expect {
        match at {
            ArgAt::Buf(_) => e,
            // Another call of ours may have moved the block; its content is what we wrote.
            ArgAt::Gmem(_) => e,
            ArgAt::ReadOnly => {
                let e = e.or(&[libc::EFAULT]);
                if writes_back {
                    Expect { ok: false, ..e }
                } else {
                    e
                }
            }
            ArgAt::Bad(_) => Expect::only(libc::EFAULT),
        }
    }

    // ---- regions --------------------------------------------------------------------

    fn own_bytes(&self) -> u64 {
        self.regions.iter().filter(|r| r.ttl == 0).map(|r| r.len).sum()
    }

    fn pick_region(&mut self) -> Option<Region> {
        if self.regions.is_empty() {
            return None;
        }
        let i = self.rng.below(self.regions.len() as u64) as usize;
        Some(self.regions[i])
    }

    fn add_region(&mut self, addr: u64, len: u64, prot: i32, maywrite: bool) {
        // Big regions live for a few calls; very big ones (their metadata is big) for one.
        let ttl = match len {
            l if l > 16 << 30 => 1,
            l if l > 64 << 20 => self.rng.range(1, 4) as u32,
            _ => 0,
        };
        self.regions.push(Region { addr, len, prot, maywrite, pinned: false, ttl });
        self.p.publish(addr, len);
    }

    fn drop_region(&mut self, addr: u64) {
        self.regions.retain(|r| r.addr != addr);
        self.p.unpublish(addr);
    }

    fn set_region(&mut self, r: Region) {
        if let Some(x) = self.regions.iter_mut().find(|x| x.addr == r.addr) {
            *x = r;
        }
    }

    /// A byte range `[a, a + len)` inside `r`, 4-aligned, at most `max` bytes.
    fn range_in(&mut self, r: &Region, max: u64, align4: bool) -> (u64, u64) {
        let words = r.len / 4;
        let w0 = if self.rng.chance(40) { 0 } else { self.rng.below(words) };
        let left = (words - w0) * 4;
        let len = if self.rng.chance(30) { left.min(max) } else { self.rng.log(4, left.max(4)).min(max) };
        let mut a = r.addr + w0 * 4;
        let mut len = len.max(4) & !3;
        if !align4 && self.rng.chance(20) {
            a += self.rng.below(4);
            len = len.saturating_sub(self.rng.below(4)).max(1);
        }
        (a, len)
    }

    /// A size for ALLOC/mmap: mostly valid and small, sometimes huge or malformed.
    fn gen_size(&mut self) -> u64 {
        match self.rng.below(100) {
            0..=59 => self.rng.range(1, 64) * PAGE,
            60..=79 => self.rng.range(65, 2048) * PAGE,
            80..=86 => self.rng.log(8 << 20, 1 << 30) & !(PAGE - 1),
            87..=88 => self.rng.log(1 << 30, 16 << 30) & !(PAGE - 1),
            89 if self.rng.chance(25) => self.rng.log(16 << 30, 64 << 30) & !(PAGE - 1),
            89 => self.rng.log(8 << 20, 1 << 30) & !(PAGE - 1),
            90..=93 if HUGE_SIZES => self.rng.pick(&[
                64 << 30,
                256 << 30,
                GMEM_MAX_ALLOC - PAGE,
                GMEM_MAX_ALLOC,
                self.rng.log(64 << 30, GMEM_MAX_ALLOC) & !(PAGE - 1),
            ]),
            _ => self.rng.pick(&[
                0,
                2,
                4095,
                4097,
                GMEM_MAX_ALLOC + PAGE,
                1 << 41,
                u64::MAX,
                u64::MAX - (PAGE - 1),
                1 << 63,
                self.rng.next(),
            ]),
        }
    }

    fn gen_dev(&mut self) -> i32 {
        match self.rng.below(100) {
            0..=79 => self.rng.below(NDEV as u64) as i32,
            80..=87 => GMEM_HOST,
            88..=91 => GMEM_NO_DEVICE,
            _ => self.rng.pick(&[NDEV as i32, 15, 255, 256, -3, i32::MIN, i32::MAX, self.rng.next() as i32]),
        }
    }

    // ---- /dev/gmem ioctls ------------------------------------------------------------------

    fn op_alloc(&mut self) {
        if self.own_bytes() > THREAD_BUDGET || self.regions.len() > 12 {
            return self.op_free();
        }
        let size = self.gen_size();
        let pref = match self.rng.below(100) {
            0..=59 => GMEM_NO_DEVICE,
            60..=89 => self.rng.below(NDEV as u64) as i32,
            90..=94 => GMEM_HOST,
            _ => self.rng.pick(&[NDEV as i32, 15, -3, i32::MIN, i32::MAX]),
        };
        let mut a = GmemAlloc { argsz: argsz::<GmemAlloc>(), size, preferred_dev: pref, ..Default::default() };
        let mut e = self.alloc_expect(&a);
        self.mutate_common(&mut a.argsz, &mut a.flags, &mut a.reserved0, &mut a.reserved);
        let mutated = a.argsz != argsz::<GmemAlloc>() || a.flags != 0 || a.reserved0 != 0 || a.reserved != [0; 2];
        if mutated {
            e = Expect::only(libc::EINVAL);
        }
        // An ALLOC's argument block never goes to a GMEM region: losing its output would
        // leak a region we cannot name.
        let at = match self.arg_at() {
            ArgAt::Gmem(_) => ArgAt::Buf(0),
            x => x,
        };
        let e = Self::at_expect(at, e, true);
        let fd = self.gfd();
        let (r, out) = self.call(fd, GMEM_IOC_ALLOC, &a, at);
        self.p.shared.add(C_GMEM, 1);
        if !self.judge(&|| format!("ALLOC size={size:#x} pref={pref} mutated={mutated}"), r, e) {
            if r.is_ok() && at != ArgAt::ReadOnly && out.addr != 0 {
                // Unexpected success: forget it safely (it is ours).
                // SAFETY: the kernel just mapped this range for us.
                unsafe { libc::munmap(out.addr as *mut libc::c_void, size as usize) };
            }
            return;
        }
        if r.is_ok() {
            if size > 64 << 30 {
                self.p.shared.add(C_ALLOC_HUGE, 1);
            }
            self.add_region(out.addr, size, libc::PROT_READ | libc::PROT_WRITE, true);
        } else if matches!(r, Err(libc::ENOMEM)) {
            self.soft();
        }
    }

    fn alloc_expect(&self, a: &GmemAlloc) -> Expect {
        let mut errs = Vec::new();
        if a.size == 0 || !a.size.is_multiple_of(PAGE) {
            errs.push(libc::EINVAL);
        } else if a.size > GMEM_MAX_ALLOC {
            errs.push(libc::E2BIG);
        }
        match a.preferred_dev {
            GMEM_NO_DEVICE | GMEM_HOST => {}
            d if d < 0 => errs.push(libc::EINVAL),
            d if d as usize >= NDEV => errs.push(libc::ENODEV),
            _ => {}
        }
        if !errs.is_empty() {
            return Expect::errs(&errs);
        }
        // Metadata and address space: large sizes may legitimately not fit.
        if a.size > 256 << 20 {
            Expect::ok_or(&[libc::ENOMEM])
        } else {
            Expect::ok_or(&[])
        }
    }

    /// Sometimes breaks argsz, flags or a reserved word; returns whether it did.
    fn mutate_common(&mut self, argsz: &mut u32, flags: &mut u32, r0: &mut u32, res: &mut [u64; 2]) -> bool {
        if !self.rng.chance(8) {
            return false;
        }
        match self.rng.below(4) {
            0 => {
                *argsz =
                    self.rng.pick(&[0, 1, 8, *argsz - 1, *argsz + 1, *argsz + 8, u32::MAX, self.rng.next() as u32 | 1])
            }
            1 => *flags |= 1 << self.rng.below(32) | 1,
            2 => *r0 = self.rng.next() as u32 | 1,
            _ => res[self.rng.below(2) as usize] = self.rng.next() | 1,
        }
        true
    }

    fn op_free(&mut self) {
        let (addr, e, own) = match self.rng.below(10) {
            0..=5 => match self.pick_region() {
                Some(r) => (r.addr, Expect::ok_or(&[]), Some(r)),
                None => return,
            },
            6..=7 => match self.pick_region() {
                Some(r) if r.len > PAGE => (r.addr + self.rng.range(1, r.len - 1), Expect::only(libc::EINVAL), None),
                _ => return,
            },
            _ => (hostile(&self.rng), Expect::only(libc::ENOENT), None),
        };
        let mut f = GmemFree { argsz: argsz::<GmemFree>(), addr, ..Default::default() };
        let mut dummy = 0u32;
        self.mutate_common(&mut f.argsz, &mut f.flags, &mut dummy, &mut f.reserved);
        let mutated = f.argsz != argsz::<GmemFree>() || f.flags != 0 || f.reserved != [0; 2];
        let e = if mutated { Expect::only(libc::EINVAL) } else { e };
        // The block of a FREE that would succeed stays in our buffer: we must know.
        let at = if own.is_some() && !mutated { ArgAt::Buf(0) } else { self.arg_at() };
        let e = Self::at_expect(at, e, false);
        let fd = self.gfd();
        let (r, _) = self.call(fd, GMEM_IOC_FREE, &f, at);
        self.p.shared.add(C_GMEM, 1);
        let maps = if e.allows(r) { String::new() } else { vma_at(addr) };
        self.judge(
            &|| format!("FREE addr={addr:#x} mutated={mutated} own={:?} vma: {maps}", own.map(|r| (r.addr, r.len))),
            r,
            e,
        );
        if r.is_ok() {
            if let Some(reg) = own {
                self.drop_region(reg.addr);
            }
        }
    }

    fn takes_dev(advice: u32) -> bool {
        matches!(
            advice,
            GMEM_ADV_PREFETCH
                | GMEM_ADV_PREFERRED_LOC
                | GMEM_ADV_ACCESSED_BY
                | GMEM_ADV_UNSET_ACCESSED_BY
                | GMEM_ADV_PIN
        )
    }

    /// The errno ADVISE must return for its static fields, if any.
    fn advise_static(advice: u32, dev: i32, flags: u32) -> Option<i32> {
        if flags & !GMEM_ADVF_ASYNC != 0 || (flags & GMEM_ADVF_ASYNC != 0 && advice != GMEM_ADV_PREFETCH) {
            return Some(libc::EINVAL);
        }
        if !(1..=10).contains(&advice) {
            return Some(libc::EINVAL);
        }
        if Self::takes_dev(advice) {
            if dev == GMEM_HOST && matches!(advice, GMEM_ADV_PREFETCH | GMEM_ADV_PREFERRED_LOC) {
                return None;
            }
            if dev < 0 {
                return Some(libc::EINVAL);
            }
            if dev as usize >= NDEV {
                return Some(libc::ENODEV);
            }
        }
        None
    }

    fn advise_raw(&mut self, addr: u64, len: u64, advice: u32, dev: i32, flags: u32) -> Result<i64, i32> {
        let a = GmemAdvise { argsz: argsz::<GmemAdvise>(), advice, addr, len, dev, flags, ..Default::default() };
        let fd = self.gfd();
        let mut b = a;
        // SAFETY: ADVISE with its argument struct, on our stack.
        let r = unsafe { libc::ioctl(fd, GMEM_IOC_ADVISE as _, &mut b as *mut GmemAdvise) };
        self.p.shared.add(C_CALLS, 1);
        self.p.shared.add(C_GMEM, 1);
        if r < 0 {
            Err(errno())
        } else {
            Ok(b.fence as i64)
        }
    }

    fn op_advise(&mut self) {
        let advice = if self.rng.chance(92) {
            self.rng.range(1, 10) as u32
        } else {
            self.rng.pick(&[0, 11, 12, 255, u32::MAX, self.rng.next() as u32])
        };
        let dev = self.gen_dev();
        let flags = match self.rng.below(100) {
            0..=64 => 0,
            65..=94 => GMEM_ADVF_ASYNC,
            _ => self.rng.next() as u32,
        };
        // Data-moving advice is bounded; a pin to 1 MiB, so that pins of all threads
        // together leave the devices room for everything else.
        let max = match advice {
            GMEM_ADV_PIN => 1 << 20,
            GMEM_ADV_PREFETCH => MAX_MOVE,
            _ => u64::MAX,
        };
        // The range: own region (valid), another thread's (not for PIN), an edge case, or
        // a hostile address.
        let mode = self.rng.below(100);
        let mut own: Option<Region> = None;
        let (addr, len, kind) = match mode {
            0..=54 => match self.pick_region() {
                Some(r) => {
                    own = Some(r);
                    let (a, l) = self.range_in(&r, max, false);
                    (a, l, 0)
                }
                None => (hostile(&self.rng), 4096, 3),
            },
            55..=69 if advice != GMEM_ADV_PIN => match self.p.any_published(&self.rng) {
                Some((a, l)) => {
                    let r = Region { addr: a, len: l, prot: 0, maywrite: false, pinned: false, ttl: 0 };
                    let (a, l) = self.range_in(&r, max, false);
                    (a, l, 1)
                }
                None => return,
            },
            55..=84 => match self.pick_region() {
                Some(r) => {
                    own = Some(r);
                    let (a, l) = match self.rng.below(5) {
                        0 => (r.addr, 0),
                        1 => (r.addr + self.rng.below(r.len), r.len + self.rng.range(1, 1 << 20)),
                        2 => (r.addr + self.rng.below(r.len), u64::MAX - self.rng.below(4096)),
                        3 => (r.addr + self.rng.below(r.len), u64::MAX - (r.addr - 1) + self.rng.below(4096)),
                        _ => (r.addr + r.len - 1, 2),
                    };
                    (a, l, 2)
                }
                None => return,
            },
            _ => (hostile(&self.rng), self.rng.pick(&[0, 4, 4096, 1 << 20, u64::MAX, self.rng.next()]), 3),
        };
        let mut a = GmemAdvise { argsz: argsz::<GmemAdvise>(), advice, addr, len, dev, flags, ..Default::default() };
        let mut dummy = 0u32;
        let mut f2 = 0u32;
        self.mutate_common(&mut a.argsz, &mut f2, &mut dummy, &mut a.reserved);
        // A flags mutation goes to the real flags word.
        a.flags |= f2;
        let mutated = a.argsz != argsz::<GmemAdvise>() || a.reserved != [0; 2];
        if advice == GMEM_ADV_PIN {
            if let Some(r) = own {
                // From now on a CPU access to this region may SIGBUS.
                let mut r2 = r;
                r2.pinned = true;
                self.set_region(r2);
            }
        }
        let e = if mutated {
            Expect::only(libc::EINVAL)
        } else if let Some(s) = Self::advise_static(a.advice, a.dev, a.flags) {
            Expect::only(s)
        } else {
            self.advise_range_expect(&a, own, kind)
        };
        let at = self.arg_at();
        let async_ok = a.flags == GMEM_ADVF_ASYNC && advice == GMEM_ADV_PREFETCH;
        let e = Self::at_expect(at, e, true);
        let fd = self.gfd();
        let (r, out) = self.call(fd, GMEM_IOC_ADVISE, &a, at);
        self.p.shared.add(C_GMEM, 1);
        let good = self.judge(
            &|| {
                format!(
                    "ADVISE advice={advice} addr={addr:#x} len={len:#x} dev={dev} flags={:#x} kind={kind} at={}",
                    a.flags,
                    at_name(at)
                )
            },
            r,
            e,
        );
        if async_ok {
            match (r, at) {
                (Ok(_), ArgAt::Buf(_)) | (Ok(_), ArgAt::Gmem(_)) => {
                    if good && (out.fence == 0 || out.fence <= self.last_fence) {
                        self.fail(format!("ASYNC fence {} after {}", out.fence, self.last_fence));
                    }
                    self.last_fence = self.last_fence.max(out.fence);
                    self.fences.push(out.fence);
                }
                (Err(libc::EFAULT), ArgAt::ReadOnly) => self.hidden += 1,
                _ => {}
            }
        }
        if r.is_ok() && advice == GMEM_ADV_UNPIN && flags == 0 {
            if let Some(reg) = own {
                if addr <= reg.addr && len >= reg.len && addr.checked_add(len).is_some_and(|e| e >= reg.end()) {
                    let mut r2 = reg;
                    r2.pinned = false;
                    self.set_region(r2);
                }
            }
        }
        if matches!(r, Err(libc::ENOMEM) | Err(libc::ENOSPC) | Err(libc::E2BIG)) {
            self.soft();
        }
    }

    /// ADVISE's expectation once the static fields are fine.
    fn advise_range_expect(&self, a: &GmemAdvise, own: Option<Region>, kind: u32) -> Expect {
        let loose = Expect::ok_or(&ADVISE_ERRS);
        match kind {
            3 => return Expect::only(libc::ENOENT),
            1 => return loose,
            _ => {}
        }
        let Some(r) = own else { return loose };
        if a.addr < r.addr || a.addr >= r.end() {
            // Not in the region we picked (an edge case naming the neighbour, or nothing).
            return loose;
        }
        let mut errs = Vec::new();
        if a.len == 0 {
            errs.push(libc::EINVAL);
        }
        match a.addr.checked_add(a.len) {
            None => errs.extend([libc::EOVERFLOW, libc::EINVAL]),
            Some(end) if end > r.end() => errs.push(libc::EINVAL),
            _ => {}
        }
        if !errs.is_empty() {
            return Expect::errs(&errs);
        }
        let busy: &[i32] = if r.pinned { &[libc::EBUSY] } else { &[] };
        if a.flags == GMEM_ADVF_ASYNC {
            if self.fences.len() + self.hidden >= 256 {
                return Expect::only(libc::EBUSY);
            }
            return Expect::ok_or(&[libc::ENOMEM]);
        }
        match a.advice {
            GMEM_ADV_PREFETCH => Expect::ok_or(&[libc::ENOMEM]).or(busy),
            GMEM_ADV_PIN => Expect::ok_or(&[libc::ENOSPC, libc::ENOMEM]).or(busy),
            GMEM_ADV_UNPIN => Expect::ok_or(&[]),
            GMEM_ADV_DONTNEED => Expect::ok_or(&[]).or(busy),
            _ => Expect::ok_or(&[libc::E2BIG]),
        }
    }

    fn op_wait(&mut self) {
        let (fence, mut e, known) = match self.rng.below(10) {
            0..=5 if !self.fences.is_empty() => {
                let i = self.rng.below(self.fences.len() as u64) as usize;
                (self.fences.swap_remove(i), Expect::ok_or(&FENCE_ERRS), true)
            }
            0..=6 if !self.waited.is_empty() => (self.rng.pick(&self.waited), Expect::only(libc::ENOENT), false),
            7 => {
                (self.rng.pick(&[0, u64::MAX, 1 << 40, self.rng.next() | (1 << 62)]), Expect::only(libc::ENOENT), false)
            }
            _ => {
                // A small id: may be an outstanding fence (of ours, or a hidden one).
                let id = self.rng.range(1, self.last_fence + 4);
                if let Some(i) = self.fences.iter().position(|&f| f == id) {
                    self.fences.swap_remove(i);
                    (id, Expect::ok_or(&FENCE_ERRS), true)
                } else if self.hidden > 0 || id > self.last_fence {
                    (id, Expect::ok_or(&FENCE_ERRS).or(&[libc::ENOENT]), false)
                } else {
                    (id, Expect::only(libc::ENOENT), false)
                }
            }
        };
        let mut w = GmemWait { argsz: argsz::<GmemWait>(), fence, ..Default::default() };
        let mut dummy = 0u32;
        self.mutate_common(&mut w.argsz, &mut w.flags, &mut dummy, &mut w.reserved);
        let mutated = w.argsz != argsz::<GmemWait>() || w.flags != 0 || w.reserved != [0; 2];
        if mutated {
            e = Expect::only(libc::EINVAL);
        }
        // A fence we mean to wait for is waited for through our own buffer.
        let at = if known { ArgAt::Buf(0) } else { self.arg_at() };
        let e = Self::at_expect(at, e, false);
        let fd = self.gfd();
        let (r, _) = self.call(fd, GMEM_IOC_WAIT, &w, at);
        self.p.shared.add(C_GMEM, 1);
        self.judge(&|| format!("WAIT fence={fence} mutated={mutated} known={known}"), r, e);
        if known && mutated {
            // Not waited for: still outstanding.
            self.fences.push(fence);
        } else if known {
            self.waited.push(fence);
            if self.waited.len() > 64 {
                self.waited.remove(0);
            }
        }
    }

    fn op_query(&mut self) {
        let mode = self.rng.below(100);
        let (addr, npages, own) = match mode {
            0..=59 => match self.pick_region() {
                Some(r) => {
                    let pages = r.len / PAGE;
                    let first = if self.rng.chance(50) { 0 } else { self.rng.below(pages) };
                    let n = match self.rng.below(10) {
                        0 => pages - first + 1,
                        1 => 0,
                        _ => self.rng.range(1, (pages - first).min(SCRATCH_WORDS as u64 - 1)),
                    };
                    (r.addr + first * PAGE + self.rng.below(PAGE), n, Some(r))
                }
                None => return,
            },
            60..=74 => match self.p.any_published(&self.rng) {
                Some((a, l)) => (a + self.rng.below(l), self.rng.range(1, (l / PAGE).max(1)), None),
                None => return,
            },
            _ => (
                hostile(&self.rng),
                self.rng.pick(&[0, 1, 16, QUERY_MAX, QUERY_MAX + 1, u64::MAX, self.rng.next()]),
                None,
            ),
        };
        // Where the states go: the kernel writes npages words there (if it gets that far).
        let bytes = npages.saturating_mul(4);
        let scratch_ok = bytes.saturating_add(4) <= (SCRATCH_WORDS as u64) * 4;
        let states_kind = self.rng.below(100);
        let (states, st_ok, st_name) = if states_kind < 70 && scratch_ok {
            let off = if self.rng.chance(10) { self.rng.range(1, 3) } else { 0 };
            (self.scratch.as_mut_ptr() as u64 + off, true, "scratch")
        } else if states_kind < 85 {
            // Into one of our own regions (a CPU fault from inside the ioctl), if it fits.
            match self.pick_region() {
                Some(r) if bytes <= r.len && r.prot & libc::PROT_WRITE != 0 => {
                    (r.addr + self.rng.below(r.len - bytes + 1), !r.pinned, "own region")
                }
                _ if bytes <= ARGREG => (self.argreg, true, "arg region"),
                _ => (0, false, "bad"),
            }
        } else {
            let bad = self.rng.pick(&[0, 8, 0xffff_8880_0000_0000, 0x0000_8000_0000_0000, u64::MAX - 3, self.ro_page]);
            (bad, false, "bad")
        };
        let mut q = GmemQuery { argsz: argsz::<GmemQuery>(), addr, npages, states, ..Default::default() };
        let mut dummy = 0u32;
        self.mutate_common(&mut q.argsz, &mut q.flags, &mut dummy, &mut q.reserved);
        let mutated = q.argsz != argsz::<GmemQuery>() || q.flags != 0 || q.reserved != [0; 2];
        let e = if mutated || npages == 0 {
            Expect::only(libc::EINVAL)
        } else if npages > QUERY_MAX {
            Expect::only(libc::E2BIG)
        } else if mode >= 75 {
            Expect::only(libc::ENOENT)
        } else if let Some(r) = own {
            let first = (addr - r.addr) / PAGE;
            if first + npages > r.len / PAGE {
                Expect::only(libc::EINVAL)
            } else if st_ok {
                Expect::ok_or(&[])
            } else {
                // A pinned own region as the output, or a bad pointer.
                Expect::ok_or(&[libc::EFAULT])
            }
        } else {
            Expect::ok_or(&[libc::ENOENT, libc::EINVAL, libc::EFAULT])
        };
        // A bad output pointer turns every success into EFAULT.
        let e = if st_name == "bad" && e.ok { Expect { ok: false, errs: e.errs | bit(libc::EFAULT) } } else { e };
        let at = match self.arg_at() {
            // The kernel may write `npages` words: keep such blocks where we know them.
            ArgAt::Gmem(_) if st_name != "scratch" => ArgAt::Buf(0),
            x => x,
        };
        let e = Self::at_expect(at, e, true);
        let fd = self.gfd();
        let (r, out) = self.call(fd, GMEM_IOC_QUERY, &q, at);
        self.p.shared.add(C_GMEM, 1);
        if !self.judge(&|| format!("QUERY addr={addr:#x} npages={npages:#x} states={st_name} mutated={mutated}"), r, e)
        {
            return;
        }
        if r.is_ok() && st_name == "scratch" && matches!(at, ArgAt::Buf(_) | ArgAt::Gmem(_)) {
            let off = (states - self.scratch.as_ptr() as u64) as usize;
            let mut bad = None;
            for i in 0..npages as usize {
                // SAFETY: inside the scratch buffer (checked above), written by the kernel.
                let w = unsafe {
                    std::ptr::read_unaligned((self.scratch.as_ptr() as *const u8).add(off + 4 * i).cast::<u32>())
                };
                if !state_word_sane(w) {
                    bad = Some((i, w));
                    break;
                }
            }
            if let Some((i, w)) = bad {
                self.fail(format!("QUERY addr={addr:#x}: page {i} has an impossible state word {w:#x}"));
            }
            if out.dup_mask >> NDEV != 0 {
                self.fail(format!("QUERY addr={addr:#x}: dup_mask {:#x} names no device", out.dup_mask));
            }
        }
    }

    fn op_version_or_unknown(&mut self) {
        let fd = self.gfd();
        if self.rng.chance(50) {
            let mut v = GmemVersion { argsz: argsz::<GmemVersion>(), ..Default::default() };
            let mut e = Expect::ok_or(&[]);
            if self.rng.chance(15) {
                if self.rng.chance(50) {
                    v.argsz = self.rng.next() as u32 | 1;
                } else {
                    v.reserved = self.rng.next() as u32 | 1;
                }
                e = Expect::only(libc::EINVAL);
            }
            let at = self.arg_at();
            let e = Self::at_expect(at, e, true);
            let (r, out) = self.call(fd, GMEM_IOC_VERSION, &v, at);
            self.p.shared.add(C_GMEM, 1);
            let judged_ok = self.judge(&|| "VERSION".to_string(), r, e) && r.is_ok();
            if judged_ok
                && matches!(at, ArgAt::Buf(_) | ArgAt::Gmem(_))
                && (out.version != GMEM_UAPI_VERSION || out.nr_devices as usize != NDEV)
            {
                self.fail(format!("VERSION: version {} nr_devices {}", out.version, out.nr_devices));
            }
        } else {
            // Unknown commands: other numbers of the 'G' and 'S' magic, or a known number
            // with another size; the driver never touches the argument.
            let magic = self.rng.pick(b"GS");
            let cmd = match self.rng.below(3) {
                0 => iowr(magic, self.rng.range(6, 255), self.rng.below(1 << 14)),
                1 => iowr(magic, self.rng.range(0, 5), self.rng.pick(&[0, 4, 40, 64, 100, 1 << 13])),
                _ => (self.rng.next() & 0xffff_00ff) | ((magic as u64) << 8) | 0x10,
            };
            let known = [
                GMEM_IOC_VERSION,
                GMEM_IOC_ALLOC,
                GMEM_IOC_FREE,
                GMEM_IOC_ADVISE,
                GMEM_IOC_WAIT,
                GMEM_IOC_QUERY,
                GMEM_SIM_IOC_LAUNCH,
                GMEM_SIM_IOC_INFO,
            ];
            if known.contains(&(cmd & 0xffff_ffff)) {
                return;
            }
            let (fd, what) = if magic == b'G' { (fd, "gmem") } else { (self.sim_fd().1, "sim") };
            let ptr = self.arg.as_mut_ptr() as u64;
            // SAFETY: an unknown command: the drivers return ENOTTY without touching the
            // argument, which is our buffer anyway.
            let r = unsafe { libc::ioctl(fd, cmd as _, ptr as usize as *mut libc::c_void) };
            let r = if r < 0 { Err(errno()) } else { Ok(r as i64) };
            self.p.shared.add(C_CALLS, 1);
            self.p.shared.add(if magic == b'G' { C_GMEM } else { C_SIM }, 1);
            self.judge(&|| format!("{what} ioctl cmd={cmd:#x}"), r, Expect::only(libc::ENOTTY));
        }
    }

    // ---- /dev/gmem_simN ----------------------------------------------------------------------

    fn op_info(&mut self) {
        let (d, fd) = self.sim_fd();
        let mut i = SimInfo { argsz: argsz::<SimInfo>(), ..Default::default() };
        let mut e = Expect::ok_or(&[]);
        if self.rng.chance(20) {
            i.argsz = self.rng.pick(&[0, 48, 64, u32::MAX]);
            e = Expect::only(libc::EINVAL);
        }
        let at = self.arg_at();
        let e = Self::at_expect(at, e, true);
        let (r, out) = self.call(fd, GMEM_SIM_IOC_INFO, &i, at);
        self.p.shared.add(C_SIM, 1);
        let judged_ok = self.judge(&|| format!("INFO sim{d}"), r, e) && r.is_ok();
        if judged_ok
            && matches!(at, ArgAt::Buf(_) | ArgAt::Gmem(_))
            && (out.gmem_id < 0 || out.gmem_id as usize >= NDEV || out.nr_frames == 0)
        {
            self.fail(format!("INFO sim{d}: gmem_id {} nr_frames {}", out.gmem_id, out.nr_frames));
        }
    }

    fn op_launch(&mut self) {
        let kernel = if self.rng.chance(94) {
            self.rng.range(1, 5) as u32
        } else {
            // Unknown kernels (6 is GATHER, whose address list the conformance suite tests).
            self.rng.pick(&[0, 7, 255, u32::MAX, self.rng.next() as u32 | 8])
        };
        let flags = match self.rng.below(100) {
            0..=89 if kernel == K_TOUCH => self.rng.pick(&[0, libgmem::sim::F_WRITE]),
            0..=94 => 0,
            _ => self.rng.pick(&[libgmem::sim::F_WRITE, 2, self.rng.next() as u32]),
        };
        let two = matches!(kernel, K_COPY | K_AXPY);
        let mode = self.rng.below(100);
        let mut pinned = false;
        let mut count = self.rng.pick(&[0, 1, 16, 256, 257, self.rng.range(1, 2048)]);
        let (a, b, len, kind) = match mode {
            // Own regions: a well-formed launch.
            0..=54 => {
                let Some(r) = self.pick_region() else { return };
                let (a, mut len) = self.range_in(&r, MAX_MOVE, true);
                let mut b = 0;
                pinned = r.pinned;
                if two {
                    let Some(r2) = self.pick_region() else { return };
                    pinned |= r2.pinned;
                    let (b2, len2) = self.range_in(&r2, len, true);
                    b = b2;
                    len = len.min(len2);
                }
                (a, b, len, 0)
            }
            // Regions of other threads (may be freed meanwhile).
            55..=69 => {
                let Some((pa, pl)) = self.p.any_published(&self.rng) else { return };
                let r = Region { addr: pa, len: pl, prot: 0, maywrite: false, pinned: false, ttl: 0 };
                let (a, len) = self.range_in(&r, MAX_MOVE, true);
                let b = if two { self.pick_region().map_or(a, |r2| r2.addr) } else { 0 };
                (a, b, len, 1)
            }
            // Past the end of an own region (not TOUCH: its random pages would reach far).
            70..=74 if kernel != K_TOUCH => {
                let Some(r) = self.pick_region() else { return };
                let a = (r.addr + self.rng.below(r.len)) & !3;
                let len = (r.end() - a + self.rng.range(4, 2 << 20)) & !3;
                let b = if two { r.addr } else { 0 };
                (a, b, len.min(MAX_MOVE), 2)
            }
            // Hostile.
            _ => {
                let a = hostile(&self.rng);
                let len = match self.rng.below(6) {
                    0 => 0u64.wrapping_sub(a) & !3,
                    1 => (0u64.wrapping_sub(a).wrapping_sub(4096)) & !3,
                    2 => 0xffff_ffff_ffff_f004,
                    _ => self.rng.pick(&[0, 4, 6, 4096, 0xf000, 1 << 20, u64::MAX - 3, self.rng.next() & !3]),
                };
                let b = if two {
                    match self.rng.below(3) {
                        0 => hostile(&self.rng),
                        _ => self.pick_region().map_or(0, |r| r.addr),
                    }
                } else {
                    0
                };
                if self.rng.chance(5) {
                    count = u64::MAX; // only ever reached with a range that fails first
                }
                (a, b, len, 3)
            }
        };
        if count == u64::MAX && kind != 3 {
            count = 1;
        }
        // A device kernel reaches whatever the process maps at an address, as the CPU does
        // (ordinary memory is mirrored). Where a launch may land outside this thread's own
        // regions (another thread's region freed meanwhile, past an own region's end), it
        // only reads: a write there would be this process scribbling on its own heap or
        // stacks, which no test of gmem's can check.
        let writes =
            matches!(kernel, K_FILL | K_COPY | K_AXPY) || (kernel == K_TOUCH && flags & libgmem::sim::F_WRITE != 0);
        let (kernel, flags, b) = if matches!(kind, 1 | 2) && writes { (K_CHECKSUM, 0, 0) } else { (kernel, flags, b) };
        let mut l = SimLaunch {
            argsz: argsz::<SimLaunch>(),
            kernel,
            flags,
            value: self.rng.next() as u32,
            a,
            b,
            len,
            seed: self.rng.next(),
            count,
            ..Default::default()
        };
        let mut mutated = false;
        if self.rng.chance(5) {
            mutated = true;
            if self.rng.chance(50) {
                l.argsz = self.rng.pick(&[0, 92, 100, u32::MAX]);
            } else {
                l.reserved[self.rng.below(2) as usize] = self.rng.next() | 1;
            }
        }
        if self.rng.chance(3) {
            // Misaligned.
            match self.rng.below(3) {
                0 => l.a |= self.rng.range(1, 3),
                1 => l.len |= self.rng.range(1, 3),
                _ => l.b |= self.rng.range(1, 3),
            }
        }
        let e = self.launch_expect(&l, mutated, kind, pinned);
        let at = self.arg_at();
        let e = Self::at_expect(at, e, true);
        let (d, fd) = self.sim_fd();
        let (r, _) = self.call(fd, GMEM_SIM_IOC_LAUNCH, &l, at);
        self.p.shared.add(C_SIM, 1);
        self.judge(
            &|| {
                format!(
                    "LAUNCH sim{d} kernel={} flags={:#x} a={:#x} b={:#x} len={:#x} count={:#x} kind={kind} at={}",
                    l.kernel,
                    l.flags,
                    l.a,
                    l.b,
                    l.len,
                    l.count,
                    at_name(at)
                )
            },
            r,
            e,
        );
        if matches!(r, Err(libc::ENOMEM) | Err(libc::EIO)) {
            self.soft();
        }
    }

    fn launch_expect(&self, l: &SimLaunch, mutated: bool, kind: u32, pinned: bool) -> Expect {
        let two = matches!(l.kernel, K_COPY | K_AXPY);
        let known = (K_FILL..=K_TOUCH).contains(&l.kernel);
        let flags_ok = l.flags & !libgmem::sim::F_WRITE == 0 && (l.flags == 0 || l.kernel == K_TOUCH);
        if mutated
            || !known
            || !flags_ok
            || l.len == 0
            || !l.len.is_multiple_of(4)
            || !l.a.is_multiple_of(4)
            || (two && !l.b.is_multiple_of(4))
        {
            return Expect::only(libc::EINVAL);
        }
        let fits = |s: u64| s.checked_add(l.len).and_then(|e| e.checked_add(PAGE - 1)).is_some();
        if !fits(l.a) || (two && !fits(l.b)) {
            return Expect::only(libc::EOVERFLOW);
        }
        if l.kernel == K_TOUCH && l.count == 0 {
            return Expect::ok_or(&[]);
        }
        match kind {
            0 => {
                let e = Expect::ok_or(&[libc::ENOMEM, libc::EIO]);
                if pinned {
                    e.or(&[libc::EBUSY])
                } else {
                    e
                }
            }
            // The source (or the only range) comes first: nothing is mapped there.
            3 => Expect::only(libc::EFAULT),
            _ => Expect::ok_or(&[libc::EFAULT, libc::ENOMEM, libc::EIO, libc::EBUSY]),
        }
    }

    // ---- mappings ------------------------------------------------------------------------------

    fn op_mmap(&mut self) {
        self.p.shared.add(C_MMAP, 1);
        self.p.shared.add(C_CALLS, 1);
        match self.rng.below(100) {
            0..=44 => self.mmap_new(),
            45..=59 => self.mmap_fixed(),
            60..=79 => self.munmap(),
            80..=89 => self.mprotect(),
            _ => self.mremap(),
        }
    }

    fn mmap_new(&mut self) {
        if self.own_bytes() > THREAD_BUDGET || self.regions.len() > 12 {
            return self.munmap();
        }
        let len = self.gen_size();
        let prot = self.rng.pick(&[
            libc::PROT_READ | libc::PROT_WRITE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::PROT_READ,
            libc::PROT_NONE,
            libc::PROT_WRITE,
            libc::PROT_READ | libc::PROT_WRITE | libc::PROT_EXEC,
        ]);
        let small = len <= 4 << 20;
        let flags = match self.rng.below(100) {
            0..=79 => libc::MAP_SHARED,
            80..=89 => libc::MAP_PRIVATE,
            90..=94 if small => libc::MAP_SHARED | libc::MAP_POPULATE,
            _ => libc::MAP_SHARED | libc::MAP_NORESERVE,
        };
        let off: i64 = if self.rng.chance(92) { 0 } else { self.rng.pick(&[4096, 1 << 20, i64::MAX & !4095, -4096]) };
        let fdk = self.rng.below(100);
        let (fd, fdname) = if fdk < 85 {
            (self.gfd(), "rw")
        } else if fdk < 95 {
            (self.ro.as_ref().map_or(-1, std::os::fd::AsRawFd::as_raw_fd), "ro")
        } else {
            (self.sim_fd().1, "sim")
        };
        let rounded = len.checked_add(PAGE - 1).map(|l| l & !(PAGE - 1));
        let mut errs = Vec::new();
        if len == 0 {
            errs.push(libc::EINVAL);
        }
        if fd < 0 {
            errs.push(libc::EBADF);
        }
        if prot & libc::PROT_EXEC != 0 {
            // A noexec /dev would refuse executable mappings.
            errs.push(libc::EPERM);
        }
        match rounded {
            None => errs.push(libc::ENOMEM),
            Some(r) if r > (1 << 47) => errs.extend([libc::ENOMEM, libc::EINVAL]),
            _ => {}
        }
        if off != 0 {
            errs.extend([libc::EINVAL, libc::EOVERFLOW]);
        }
        if fdname == "sim" {
            errs.push(libc::ENODEV);
        }
        if fdname == "ro" && flags & libc::MAP_SHARED != 0 && prot & libc::PROT_WRITE != 0 {
            errs.push(libc::EACCES);
        }
        if flags & libc::MAP_PRIVATE != 0 {
            errs.push(libc::EINVAL);
        }

        if rounded.is_some_and(|r| r > GMEM_MAX_ALLOC) {
            errs.push(libc::EINVAL);
        }
        let only_exec = errs == [libc::EPERM];
        // The kernel drops VM_SHARED from a MAP_SHARED mapping of an O_RDONLY file, and
        // gmem's mmap checks VM_SHARED: such a (read-only, shared) mapping gets EINVAL.
        // user-api.rst only promises EACCES for the writable case; accept both.
        let ro_shared = fdname == "ro" && flags & libc::MAP_SHARED != 0;
        let e = if ro_shared && errs.iter().all(|&e| e == libc::EPERM) {
            Expect::ok_or(&[libc::EINVAL, libc::EPERM])
        } else if ro_shared {
            Expect::errs(&errs).or(&[libc::EINVAL])
        } else if only_exec {
            Expect::ok_or(&[libc::EPERM])
        } else if !errs.is_empty() {
            Expect::errs(&errs)
        } else {
            Expect::ok_or(&[])
        };
        // Address space, the metadata, or the commit accounting of a private writable
        // mapping may run out before anything else is checked.
        let e = if len > 256 << 20 { e.or(&[libc::ENOMEM]) } else { e };
        // SAFETY: a new mapping at an address of the kernel's choice (no MAP_FIXED).
        let m = unsafe { libc::mmap(std::ptr::null_mut(), len as usize, prot, flags, fd, off) };
        let r = if m == libc::MAP_FAILED { Err(errno()) } else { Ok(m as i64) };
        let good =
            self.judge(&|| format!("mmap len={len:#x} prot={prot:#x} flags={flags:#x} off={off:#x} fd={fdname}"), r, e);
        if let Ok(addr) = r {
            let rl = rounded.unwrap_or(0);
            if good {
                if len > 64 << 30 {
                    self.p.shared.add(C_ALLOC_HUGE, 1);
                }
                self.add_region(addr as u64, rl, prot, fdname == "rw");
            } else {
                // SAFETY: the mapping the kernel just made for us.
                unsafe { libc::munmap(addr as *mut libc::c_void, rl as usize) };
            }
        }
    }

    /// MAP_FIXED over one of our regions: all of it (replaces it) or a part (refused).
    fn mmap_fixed(&mut self) {
        let Some(r) = self.pick_region() else { return };
        let whole = self.rng.chance(40) || r.len == PAGE;
        let (addr, len) = if whole {
            (r.addr, r.len)
        } else {
            let p0 = self.rng.below(r.len / PAGE - 1);
            let n = self.rng.range(1, r.len / PAGE - p0 - 1);
            (r.addr + p0 * PAGE, n * PAGE)
        };
        let noreplace = self.rng.chance(20);
        let flags = libc::MAP_SHARED | if noreplace { libc::MAP_FIXED_NOREPLACE } else { libc::MAP_FIXED };
        let e = if noreplace {
            Expect::only(libc::EEXIST)
        } else if whole {
            Expect::ok_or(&[libc::ENOMEM])
        } else {
            Expect::only(libc::EINVAL)
        };
        let prot = libc::PROT_READ | libc::PROT_WRITE;
        // SAFETY: MAP_FIXED only over a GMEM region of this thread.
        let m = unsafe { libc::mmap(addr as *mut libc::c_void, len as usize, prot, flags, self.gfd(), 0) };
        let res = if m == libc::MAP_FAILED { Err(errno()) } else { Ok(m as i64) };
        let good = self.judge(
            &|| {
                format!(
                    "mmap MAP_FIXED{} over {addr:#x}+{len:#x} of region {:#x}+{:#x}",
                    if noreplace { "_NOREPLACE" } else { "" },
                    r.addr,
                    r.len
                )
            },
            res,
            e,
        );
        match res {
            Ok(_) if good => {
                // The old region is gone; a new one took its place.
                self.drop_region(r.addr);
                self.add_region(addr, len, prot, true);
            }
            Ok(_) => {
                // A part replaced (refused by the API): our bookkeeping cannot follow.
                // SAFETY: the range is ours (the old region's).
                unsafe { libc::munmap(r.addr as *mut libc::c_void, r.len as usize) };
                self.drop_region(r.addr);
            }
            Err(libc::ENOMEM) if whole => {
                // The old mapping may be gone: find out.
                self.soft();
                if !self.region_alive(r.addr) {
                    self.drop_region(r.addr);
                }
            }
            Err(_) => self.check_intact(&r, "refused MAP_FIXED"),
        }
    }

    fn region_alive(&mut self, addr: u64) -> bool {
        let mut st = [0u32; 1];
        let mut q = GmemQuery {
            argsz: argsz::<GmemQuery>(),
            addr,
            npages: 1,
            states: st.as_mut_ptr() as u64,
            ..Default::default()
        };
        // SAFETY: QUERY of one page into our one-word buffer.
        unsafe { libc::ioctl(self.gfd(), GMEM_IOC_QUERY as _, &mut q as *mut GmemQuery) == 0 }
    }

    /// After a refused split: the region must still be there, whole.
    fn check_intact(&mut self, r: &Region, what: &str) {
        let pages = r.len / PAGE;
        let mut st = vec![0u32; pages.min(64) as usize];
        let first = pages - st.len() as u64;
        let mut q = GmemQuery {
            argsz: argsz::<GmemQuery>(),
            addr: r.addr + first * PAGE,
            npages: st.len() as u64,
            states: st.as_mut_ptr() as u64,
            ..Default::default()
        };
        // SAFETY: QUERY into our buffer of `npages` words.
        let ok = unsafe { libc::ioctl(self.gfd(), GMEM_IOC_QUERY as _, &mut q as *mut GmemQuery) } == 0;
        let e = errno();
        if !ok {
            self.fail(format!("{what}: region {:#x}+{:#x} no longer whole ({})", r.addr, r.len, ename(e)));
            self.drop_region(r.addr);
        }
    }

    fn munmap(&mut self) {
        let Some(r) = self.pick_region() else { return };
        let (addr, len, e, whole) = match self.rng.below(10) {
            0..=5 => (r.addr, r.len, Expect::ok_or(&[]), true),
            6..=7 if r.len > PAGE => {
                let p0 = self.rng.below(r.len / PAGE);
                let n = self.rng.range(1, r.len / PAGE - p0);
                if p0 == 0 && n == r.len / PAGE {
                    return;
                }
                (r.addr + p0 * PAGE, n * PAGE, Expect::only(libc::EINVAL), false)
            }
            8 => (r.addr + self.rng.range(1, PAGE - 1), PAGE, Expect::only(libc::EINVAL), false),
            _ => (r.addr, 0, Expect::only(libc::EINVAL), false),
        };
        // SAFETY: only (parts of) a GMEM region of this thread.
        let m = unsafe { libc::munmap(addr as *mut libc::c_void, len as usize) };
        let res = if m != 0 { Err(errno()) } else { Ok(0) };
        self.judge(&|| format!("munmap {addr:#x}+{len:#x} of region {:#x}+{:#x}", r.addr, r.len), res, e);
        if whole && res.is_ok() {
            self.drop_region(r.addr);
        } else if res.is_ok() {
            // A split the API refuses happened: drop the rest too, our map cannot follow.
            // SAFETY: the rest of our own region.
            unsafe { libc::munmap(r.addr as *mut libc::c_void, r.len as usize) };
            self.drop_region(r.addr);
        } else if !whole {
            self.check_intact(&r, "refused munmap");
        }
    }

    fn mprotect(&mut self) {
        let Some(r) = self.pick_region() else { return };
        let prot = self.rng.pick(&[
            libc::PROT_READ | libc::PROT_WRITE,
            libc::PROT_READ,
            libc::PROT_NONE,
            libc::PROT_READ | libc::PROT_WRITE,
        ]);
        let whole = self.rng.chance(60) || r.len == PAGE;
        let (addr, len) = if whole {
            (r.addr, r.len)
        } else {
            let p0 = self.rng.below(r.len / PAGE - 1);
            (r.addr + p0 * PAGE, PAGE)
        };
        let e = if !r.maywrite && prot & libc::PROT_WRITE != 0 {
            Expect::only(libc::EACCES)
        } else if whole {
            Expect::ok_or(&[])
        } else if prot == r.prot {
            // Nothing to change: no split needed.
            Expect::ok_or(&[libc::EINVAL])
        } else {
            Expect::only(libc::EINVAL)
        };
        // SAFETY: only a GMEM region of this thread.
        let m = unsafe { libc::mprotect(addr as *mut libc::c_void, len as usize, prot) };
        let res = if m != 0 { Err(errno()) } else { Ok(0) };
        self.judge(
            &|| format!("mprotect {addr:#x}+{len:#x} prot={prot:#x} of region {:#x}+{:#x}", r.addr, r.len),
            res,
            e,
        );
        if res.is_ok() {
            if whole {
                let mut r2 = r;
                r2.prot = prot;
                self.set_region(r2);
            } else if prot != r.prot {
                // SAFETY: our own region, which the API should not have split.
                unsafe { libc::munmap(r.addr as *mut libc::c_void, r.len as usize) };
                self.drop_region(r.addr);
            }
        } else if !whole {
            self.check_intact(&r, "refused mprotect");
        }
    }

    fn mremap(&mut self) {
        let Some(r) = self.pick_region() else { return };
        let k = self.rng.below(3);
        // SAFETY (all arms): mremap of a GMEM region of this thread; the move target is a
        // reservation we make for it.
        let (res, e, new_len) = unsafe {
            match k {
                0 => {
                    let m = libc::mremap(r.addr as *mut libc::c_void, r.len as usize, (r.len + PAGE) as usize, 0);
                    (m, Expect::only(libc::EFAULT), r.len + PAGE)
                }
                1 if r.len > PAGE => {
                    let m = libc::mremap(r.addr as *mut libc::c_void, r.len as usize, (r.len - PAGE) as usize, 0);
                    (m, Expect::only(libc::EINVAL), r.len - PAGE)
                }
                _ => {
                    let t = libc::mmap(
                        std::ptr::null_mut(),
                        r.len as usize,
                        libc::PROT_NONE,
                        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                        -1,
                        0,
                    );
                    if t == libc::MAP_FAILED {
                        return;
                    }
                    let m = libc::mremap(
                        r.addr as *mut libc::c_void,
                        r.len as usize,
                        r.len as usize,
                        libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                        t,
                    );
                    // The reservation is left behind either way: the kernel unmapped it
                    // for the move, and another thread may own that range by now.
                    (m, Expect::only(libc::EINVAL), r.len)
                }
            }
        };
        let res = if res == libc::MAP_FAILED { Err(errno()) } else { Ok(res as i64) };
        self.judge(&|| format!("mremap kind={k} of region {:#x}+{:#x}", r.addr, r.len), res, e);
        if let Ok(new) = res {
            // The API refuses this: unmap the region where it now is (exactly its new
            // extent: whatever was freed around it may belong to another thread already).
            // SAFETY: the kernel just (re)mapped our region there with that length.
            unsafe { libc::munmap(new as *mut libc::c_void, new_len as usize) };
            self.drop_region(r.addr);
            return;
        }
        self.check_intact(&r, "refused mremap");
    }

    // ---- CPU accesses ---------------------------------------------------------------------

    fn op_cpu(&mut self) {
        let Some(r) = self.pick_region() else { return };
        self.p.shared.add(C_CPU, 1);
        self.p.shared.add(C_CALLS, 1);
        let n = self.rng.range(1, 16);
        if r.cpu_ok() && self.rng.chance(80) {
            let write = r.prot & libc::PROT_WRITE != 0 && self.rng.chance(50);
            for _ in 0..n {
                let off = self.rng.below(r.len / 4) * 4;
                let p = (r.addr + off) as *mut u32;
                // SAFETY: a readable (and, to write, writable) GMEM region of this thread,
                // never pinned and never unmapped by another thread.
                unsafe {
                    if write {
                        std::ptr::write_volatile(p, self.rng.next() as u32);
                    } else {
                        std::ptr::read_volatile(p);
                    }
                }
            }
            return;
        }
        // Through the kernel (copy_to/from_user): a pinned page gives EFAULT, not SIGBUS.
        let len = (n * PAGE).min(r.len);
        let off = self.rng.below(r.len - len + 1) & !3;
        let to_region = self.rng.chance(50);
        // SAFETY: the kernel reads or writes `len` bytes of our own region through our memfd.
        let res = unsafe {
            if to_region {
                libc::ftruncate(self.memfd, len as i64);
                libc::pread(self.memfd, (r.addr + off) as *mut libc::c_void, len as usize, 0)
            } else {
                libc::pwrite(self.memfd, (r.addr + off) as *const libc::c_void, len as usize, 0)
            }
        };
        let res = if res < 0 { Err(errno()) } else { Ok(res as i64) };
        let writable = r.prot & libc::PROT_WRITE != 0;
        let e = if r.prot == libc::PROT_NONE || (to_region && !writable) {
            Expect::only(libc::EFAULT)
        } else if r.pinned || r.prot & libc::PROT_READ == 0 {
            // Pinned: EFAULT; write-only: x86 may or may not let the kernel read it.
            Expect::ok_or(&[libc::EFAULT])
        } else {
            Expect::ok_or(&[])
        };
        self.judge(
            &|| {
                format!(
                    "{} {len:#x} bytes at {:#x} (region prot {:#x}, pinned {})",
                    if to_region { "pread into" } else { "pwrite from" },
                    r.addr + off,
                    r.prot,
                    r.pinned
                )
            },
            res,
            e,
        );
    }

    // ---- fork, close/reopen --------------------------------------------------------------

    fn op_fork(&mut self) {
        self.p.shared.add(C_FORK, 1);
        self.p.shared.add(C_CALLS, 1);
        let gfd = self.gfd();
        let sfd = self.sim_fd().1;
        let hint = self.pick_region().map_or(0x1000, |r| r.addr);
        let seed = self.rng.next();
        let errfd = self.p.errfd;
        // SAFETY: getpid has no preconditions.
        let me = unsafe { libc::getpid() };
        // SAFETY: the child runs only `fork_child`, which allocates nothing (another thread
        // may hold the allocator's lock at fork time) and ends in `_exit`.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            fork_child(Rng::new(seed), gfd, sfd, hint, errfd, me);
        }
        if pid < 0 {
            self.fail(format!("fork: {}", ename(errno())));
            return;
        }
        let natural = self.rng.chance(50);
        let t = Instant::now();
        let wait_for = if natural { Duration::from_secs(2) } else { Duration::from_millis(self.rng.below(300)) };
        let mut status = 0;
        let mut done = false;
        while t.elapsed() < wait_for && !(natural && self.p.done()) {
            // SAFETY: waiting for our own child.
            if unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } == pid {
                done = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        if !done {
            // SAFETY: our own child.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            let k = Instant::now();
            loop {
                // SAFETY: as above.
                if unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } == pid {
                    break;
                }
                if k.elapsed() > REAP {
                    self.fail(format!("fork child {pid} not reaped {} s after SIGKILL", REAP.as_secs()));
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            self.p.shared.add(C_KILLED, 1);
        }
        let killed_by_us = !done && libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGKILL;
        let clean = libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0;
        if !killed_by_us && !clean {
            self.fail(format!("fork child ended with status {status:#x}"));
        }
    }

    fn op_reopen(&mut self) {
        self.p.shared.add(C_REOPEN, 1);
        self.p.shared.add(C_CALLS, 1);
        match self.rng.below(3) {
            0 => {
                // Closing the file waits for its fences; our regions keep their own files.
                self.g = None;
                self.fences.clear();
                self.hidden = 0;
                self.last_fence = 0;
                self.waited.clear();
                match Gmem::open() {
                    Ok(g) => self.g = Some(g),
                    Err(e) => {
                        self.fail(format!("reopen /dev/gmem: {e}"));
                        self.p.stop.store(true, Relaxed);
                    }
                }
            }
            1 => {
                let d = self.rng.below(NDEV as u64) as usize;
                self.sims[d] = None;
                self.sims[d] = open_rw(&sim_path(d));
                if self.sims[d].is_none() {
                    self.fail(format!("reopen {}", sim_path(d)));
                }
            }
            _ => {
                self.ro = None;
                self.ro = std::fs::OpenOptions::new().read(true).open("/dev/gmem").ok();
            }
        }
    }

    // ---- the private, verified region ------------------------------------------------------

    #[allow(clippy::too_many_arguments)]
    fn sim_launch(
        &mut self,
        d: usize,
        kernel: u32,
        flags: u32,
        value: u32,
        a: u64,
        b: u64,
        len: u64,
        seed: u64,
        count: u64,
    ) -> Result<SimLaunch, i32> {
        let fd = self.sims[d].as_ref().map_or(-1, std::os::fd::AsRawFd::as_raw_fd);
        let mut l = SimLaunch {
            argsz: argsz::<SimLaunch>(),
            kernel,
            flags,
            value,
            a,
            b,
            len,
            seed,
            count,
            ..Default::default()
        };
        // SAFETY: LAUNCH with its argument struct on our stack.
        let r = unsafe { libc::ioctl(fd, GMEM_SIM_IOC_LAUNCH as _, &mut l as *mut SimLaunch) };
        self.p.shared.add(C_CALLS, 1);
        self.p.shared.add(C_SIM, 1);
        if r < 0 {
            Err(errno())
        } else {
            Ok(l)
        }
    }

    /// A word range `[w0, w0 + n)` of the verified region.
    fn vrange(&mut self) -> (usize, usize) {
        let words = self.v.words as u64;
        if self.rng.chance(25) {
            return (0, words as usize);
        }
        let w0 = self.rng.below(words);
        let n = self.rng.log(1, words - w0);
        (w0 as usize, n as usize)
    }

    fn vaddr(&self, w: usize) -> u64 {
        self.v.addr + 4 * w as u64
    }

    fn op_verify(&mut self) {
        self.p.shared.add(C_VERIFY, 1);
        if !self.v.known {
            let v = self.rng.next() as u32;
            let d = self.rng.below(NDEV as u64) as usize;
            let (a, len) = (self.v.addr, VERIFY_BYTES);
            match self.sim_launch(d, K_FILL, 0, v, a, 0, len, 0, 0) {
                Ok(_) => {
                    for (i, m) in self.v.model.iter_mut().enumerate() {
                        *m = v.wrapping_add(i as u32);
                    }
                    self.v.known = true;
                }
                Err(libc::ENOMEM | libc::EIO) => self.soft(),
                Err(e) => self.fail(format!("verify: FILL of the private region: {}", ename(e))),
            }
            return;
        }
        let d = self.rng.below(NDEV as u64) as usize;
        let (w0, n) = self.vrange();
        let op = self.rng.below(10);
        match op {
            0 => {
                let v = self.rng.next() as u32;
                let r = self.sim_launch(d, K_FILL, 0, v, self.vaddr(w0), 0, 4 * n as u64, 0, 0);
                self.v.log(w0, n, format!("FILL dev{d} {}", show_result(r.map(|_| 0))));
                match r {
                    Ok(_) => {
                        for i in 0..n {
                            self.v.model[w0 + i] = v.wrapping_add(i as u32);
                        }
                    }
                    Err(e) => self.v_soft("FILL", e),
                }
            }
            1 => self.v_checksum(d, w0, n, "CHECKSUM"),
            2 => self.v_cpu_read(w0, n, "CPU read"),
            3 => {
                let mut x = self.rng.next();
                for i in w0..w0 + n {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                    let v = (x >> 32) as u32;
                    // SAFETY: our private region, never pinned outside `op 8`.
                    unsafe { std::ptr::write_volatile(self.vaddr(i) as *mut u32, v) };
                    self.v.model[i] = v;
                }
                self.v.log(w0, n, "CPU write".into());
            }
            4 => {
                let target = self.rng.pick(&[GMEM_HOST, 0, 1]);
                let asy = self.rng.chance(40);
                let r = self.advise_raw(
                    self.vaddr(w0),
                    4 * n as u64,
                    GMEM_ADV_PREFETCH,
                    target,
                    if asy { GMEM_ADVF_ASYNC } else { 0 },
                );
                let r = match r {
                    Ok(fence) if asy => {
                        let mut w = GmemWait { argsz: argsz::<GmemWait>(), fence: fence as u64, ..Default::default() };
                        // SAFETY: WAIT with its argument struct on our stack.
                        let x = unsafe { libc::ioctl(self.gfd(), GMEM_IOC_WAIT as _, &mut w as *mut GmemWait) };
                        if x < 0 {
                            Err(errno())
                        } else {
                            Ok(0)
                        }
                    }
                    r => r,
                };
                self.v.log(w0, n, format!("PREFETCH to {target} async {asy} {}", show_result(r.map(|_| 0))));
                match r {
                    Ok(_) => {}
                    Err(libc::ENOMEM) => self.soft(),
                    Err(libc::EBUSY) if self.fences.len() + self.hidden >= 256 && asy => {}
                    Err(e) => self.fail(format!("verify: PREFETCH to {target} (async {asy}): {}", ename(e))),
                }
                self.v_checksum(d, w0, n, "CHECKSUM after PREFETCH");
            }
            5 => {
                let (a, len) = (self.vaddr(w0), 4 * n as u64);
                let r = self.advise_raw(a, len, GMEM_ADV_DONTNEED, 0, 0);
                self.v.log(w0, n, format!("DONTNEED {}", show_result(r.map(|_| 0))));
                match r {
                    Ok(_) => {
                        // Narrowed inward to whole pages.
                        let first = a.div_ceil(PAGE) * PAGE;
                        let end = (a + len) / PAGE * PAGE;
                        let mut p = first;
                        while p < end {
                            let w = ((p - self.v.addr) / 4) as usize;
                            self.v.model[w..w + 1024].fill(0);
                            p += PAGE;
                        }
                    }
                    Err(e) => self.fail(format!("verify: DONTNEED: {}", ename(e))),
                }
                self.v_cpu_read(w0, n, "CPU read after DONTNEED");
            }
            6 => {
                if self.rng.chance(50) {
                    let v = self.rng.next() as u32;
                    let a = self.vaddr(w0);
                    let r = self.sim_launch(d, K_AXPY, 0, v, a, a, 4 * n as u64, 0, 0);
                    self.v.log(w0, n, format!("AXPY dev{d} {}", show_result(r.map(|_| 0))));
                    match r {
                        Ok(_) => {
                            for m in &mut self.v.model[w0..w0 + n] {
                                *m = v.wrapping_mul(*m).wrapping_add(*m);
                            }
                        }
                        Err(e) => self.v_soft("AXPY", e),
                    }
                } else {
                    // COPY [s, s + n) -> [w0, w0 + n). A partial overlap is allowed, but its
                    // result is unspecified (gmem_sim.h), so the model forgets the region
                    // then; mostly the source is chosen so that the two do not overlap.
                    let words = self.v.words;
                    let s = if self.rng.chance(90) {
                        let left = if w0 >= n { w0 - n + 1 } else { 0 };
                        let right = (words + 1).saturating_sub(w0 + 2 * n);
                        match self.rng.below((left + right) as u64) as usize {
                            _ if left + right == 0 => w0,
                            k if k < left => k,
                            k => w0 + n + (k - left),
                        }
                    } else {
                        self.rng.below((words - n + 1) as u64) as usize
                    };
                    let partial = s != w0 && s < w0 + n && w0 < s + n;
                    let r = self.sim_launch(d, K_COPY, 0, 0, self.vaddr(s), self.vaddr(w0), 4 * n as u64, 0, 0);
                    self.v.log(s, n, format!("COPY-src dev{d} to {w0} {}", show_result(r.map(|_| 0))));
                    self.v.log(w0, n, format!("COPY dev{d} from {s} {}", show_result(r.map(|_| 0))));
                    match r {
                        Ok(_) if partial => self.v.known = false,
                        Ok(_) => {
                            for i in 0..n {
                                self.v.model[w0 + i] = self.v.model[s + i];
                            }
                        }
                        Err(e) => self.v_soft("COPY", e),
                    }
                }
                self.v_checksum(1 - d, w0, n, "CHECKSUM after AXPY/COPY");
            }
            7 => {
                let (a, len) = (self.v.addr, VERIFY_BYTES);
                self.v.log(0, self.v.words, "READ_MOSTLY".into());
                if let Err(e) = self.advise_raw(a, len, GMEM_ADV_READ_MOSTLY, 0, 0) {
                    if e != libc::E2BIG {
                        self.fail(format!("verify: READ_MOSTLY: {}", ename(e)));
                    }
                }
                self.v_checksum(0, w0, n, "CHECKSUM dev0 READ_MOSTLY");
                self.v_checksum(1, w0, n, "CHECKSUM dev1 READ_MOSTLY");
                self.v_cpu_read(w0, n, "CPU read READ_MOSTLY");
                if let Err(e) = self.advise_raw(a, len, GMEM_ADV_UNSET_READ_MOSTLY, 0, 0) {
                    if e != libc::E2BIG {
                        self.fail(format!("verify: UNSET_READ_MOSTLY: {}", ename(e)));
                    }
                }
            }
            8 => self.v_pin(d, w0, n),
            _ => {
                // TOUCH with writes: predict the sum read and every increment.
                let count = self.rng.range(1, 600);
                let seed = self.rng.next();
                let (a, len) = (self.vaddr(w0), 4 * n as u64);
                let first = a & !(PAGE - 1);
                let npages = (a + len - first).div_ceil(PAGE);
                let r = self.sim_launch(d, K_TOUCH, libgmem::sim::F_WRITE, 0, a, 0, len, seed, count);
                self.v.log(w0, n, format!("TOUCH dev{d} x{count} {}", show_result(r.map(|_| 0))));
                match r {
                    Ok(l) => {
                        let mut x = seed | 1;
                        let mut sum = 0u64;
                        for _ in 0..count {
                            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                            let w = ((first + ((x >> 33) % npages) * PAGE - self.v.addr) / 4) as usize;
                            sum = sum.wrapping_add(u64::from(self.v.model[w]));
                            self.v.model[w] = self.v.model[w].wrapping_add(1);
                        }
                        if l.result != sum {
                            self.fail(format!(
                                "verify: TOUCH sum {:#x}, model {sum:#x} (count {count}, seed {seed:#x})",
                                l.result
                            ));
                            self.v.known = false;
                        }
                    }
                    Err(e) => self.v_soft("TOUCH", e),
                }
            }
        }
    }

    /// A launch on the private region failed: only contention errors are allowed, and the
    /// region's contents are then unknown (a kernel may have stopped half way).
    fn v_soft(&mut self, what: &str, e: i32) {
        if matches!(e, libc::ENOMEM | libc::EIO) {
            self.soft();
        } else {
            self.fail(format!("verify: {what} on the private region: {}", ename(e)));
        }
        self.v.known = false;
    }

    fn v_checksum(&mut self, d: usize, w0: usize, n: usize, what: &str) {
        if !self.v.known {
            return;
        }
        let r = self.sim_launch(d, K_CHECKSUM, 0, 0, self.vaddr(w0), 0, 4 * n as u64, 0, 0);
        self.v.log(w0, n, format!("CHECKSUM dev{d} {}", show_result(r.map(|_| 0))));
        match r {
            Ok(l) => {
                let want = libgmem::sim::checksum(&self.v.model[w0..w0 + n]);
                if l.result != want {
                    let got = self.first_mismatch(w0, n);
                    self.fail(format!(
                        "verify: {what} on dev{d} of words {w0}+{n}: {:#x}, model {want:#x}; CPU sees {got}",
                        l.result
                    ));
                    self.v.known = false;
                }
            }
            Err(libc::ENOMEM | libc::EIO) => self.soft(),
            Err(e) => self.fail(format!("verify: {what} on dev{d}: {}", ename(e))),
        }
    }

    fn first_mismatch(&self, w0: usize, n: usize) -> String {
        if self.v.pinned {
            return "nothing (pinned)".into();
        }
        // The residency of every page before the CPU reads them (reading moves them).
        let mut st = [0u32; 256];
        let mut q = GmemQuery {
            argsz: argsz::<GmemQuery>(),
            addr: self.v.addr,
            npages: 256,
            states: st.as_mut_ptr() as u64,
            ..Default::default()
        };
        // SAFETY: QUERY into our stack buffer of 256 words (the region has 256 pages).
        let queried = unsafe { libc::ioctl(self.gfd(), GMEM_IOC_QUERY as _, &mut q as *mut GmemQuery) } == 0;
        let mut first = None;
        let mut pages = Vec::new();
        let mut bad = 0;
        for i in w0..w0 + n {
            // SAFETY: our private region, not pinned.
            let w = unsafe { std::ptr::read_volatile(self.vaddr(i) as *const u32) };
            if w != self.v.model[i] {
                bad += 1;
                first.get_or_insert((i, w));
                if pages.last() != Some(&(i / 1024)) && pages.len() < 8 {
                    pages.push(i / 1024);
                }
            }
        }
        let Some((i, w)) = first else { return "the model's data".into() };
        let state = if queried { format!("{:#x}", st[i / 1024]) } else { "?".into() };
        format!(
            "word {i} = {w:#x}, model {:#x}; {bad} words differ, pages {pages:?}; page {} state {state}; history {}",
            self.v.model[i],
            i / 1024,
            self.v.history_of(i)
        )
    }

    fn v_cpu_read(&mut self, w0: usize, n: usize, what: &str) {
        if !self.v.known || self.v.pinned {
            return;
        }
        for i in w0..w0 + n {
            // SAFETY: our private region, not pinned.
            let w = unsafe { std::ptr::read_volatile(self.vaddr(i) as *const u32) };
            if w != self.v.model[i] {
                self.fail(format!(
                    "verify: {what}: word {i} (page {}) = {w:#x}, model {:#x}; history {}",
                    i / 1024,
                    self.v.model[i],
                    self.v.history_of(i)
                ));
                self.v.known = false;
                return;
            }
        }
    }

    fn v_pin(&mut self, d: usize, w0: usize, n: usize) {
        let n = n.min(64 * 1024); // at most 64 pages pinned
        let (a, len) = (self.vaddr(w0), 4 * n as u64);
        self.v.pinned = true;
        let r = self.advise_raw(a, len, GMEM_ADV_PIN, d as i32, 0);
        match r {
            Ok(_) => {
                // Another device may not touch pinned pages; the pinning one may.
                match self.sim_launch(1 - d, K_CHECKSUM, 0, 0, a, 0, len, 0, 0) {
                    Err(libc::EBUSY) => {}
                    x => self.fail(format!(
                        "verify: CHECKSUM on dev{} of pages pinned on dev{d}: {}",
                        1 - d,
                        show_result(x.map(|_| 0))
                    )),
                }
                self.v_checksum(d, w0, n, "CHECKSUM of pinned pages");
                // The CPU may not either: through the kernel that is EFAULT.
                // SAFETY: the kernel reads our region into our memfd.
                let x = unsafe { libc::pwrite(self.memfd, a as *const libc::c_void, 4, 0) };
                if x >= 0 || errno() != libc::EFAULT {
                    self.fail(format!("verify: kernel read of a pinned page: {x} ({})", ename(errno())));
                }
            }
            Err(libc::ENOSPC | libc::ENOMEM) => self.soft(),
            Err(e) => self.fail(format!("verify: PIN to dev{d}: {}", ename(e))),
        }
        match self.advise_raw(self.v.addr, VERIFY_BYTES, GMEM_ADV_UNPIN, 0, 0) {
            Ok(_) => self.v.pinned = false,
            Err(e) => self.fail(format!("verify: UNPIN: {}", ename(e))),
        }
        self.v_cpu_read(w0, n, "CPU read after UNPIN");
    }

    // ---- the loop -------------------------------------------------------------------------

    fn step(&mut self) {
        // Big regions live for a few calls only.
        if let Some(i) = self.regions.iter().position(|r| r.ttl == 1) {
            let r = self.regions[i];
            // SAFETY: our own region.
            unsafe { libc::munmap(r.addr as *mut libc::c_void, r.len as usize) };
            self.drop_region(r.addr);
        }
        for r in self.regions.iter_mut() {
            if r.ttl > 1 {
                r.ttl -= 1;
            }
        }
        let t = Instant::now();
        let kind = match self.rng.below(1000) {
            0..=129 => 0,
            130..=199 => 1,
            200..=369 => 2,
            370..=429 => 3,
            430..=509 => 4,
            510..=539 => 5,
            540..=749 => 6,
            750..=759 => 7,
            760..=829 => 8,
            830..=899 => 9,
            900..=979 => 10,
            980..=989 => 11,
            _ => 12,
        };
        match kind {
            0 => self.op_alloc(),
            1 => self.op_free(),
            2 => self.op_advise(),
            3 => self.op_wait(),
            4 => self.op_query(),
            5 => self.op_version_or_unknown(),
            6 => self.op_launch(),
            7 => self.op_info(),
            8 => self.op_mmap(),
            9 => self.op_cpu(),
            10 => self.op_verify(),
            11 => self.op_fork(),
            _ => self.op_reopen(),
        }
        self.p.shared.add(C_MS + kind, t.elapsed().as_millis() as u64);
    }

    fn run(&mut self) {
        while !self.p.done() {
            self.step();
        }
        // Leave half of the time with fences outstanding and regions mapped: exit cleans up.
        if self.rng.chance(50) {
            for f in std::mem::take(&mut self.fences) {
                let mut w = GmemWait { argsz: argsz::<GmemWait>(), fence: f, ..Default::default() };
                // SAFETY: WAIT with its argument struct on our stack.
                unsafe { libc::ioctl(self.gfd(), GMEM_IOC_WAIT as _, &mut w as *mut GmemWait) };
            }
        }
    }
}

/// The line of /proc/self/maps that holds `addr` (for failure messages).
fn vma_at(addr: u64) -> String {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    for l in maps.lines() {
        let Some((range, _)) = l.split_once(' ') else { continue };
        let Some((a, b)) = range.split_once('-') else { continue };
        let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) else { continue };
        if a <= addr && addr < b {
            return l.to_string();
        }
    }
    "none".into()
}

fn at_name(at: ArgAt) -> String {
    match at {
        ArgAt::Buf(o) => format!("buf+{o}"),
        ArgAt::Gmem(o) => format!("gmem+{o:#x}"),
        ArgAt::ReadOnly => "read-only page".into(),
        ArgAt::Bad(a) => format!("{a:#x}"),
    }
}

/// A QUERY word that the API can produce.
fn state_word_sane(w: u32) -> bool {
    let loc = q_loc(w);
    let dev_loc = loc == GMEM_LOC_DEVICE;
    loc <= GMEM_LOC_DEVICE
        && w >> 21 == 0
        && (!dev_loc || (q_dev(w) as usize) < NDEV)
        && (w & GMEM_Q_PINNED == 0 || dev_loc)
        && (w & GMEM_Q_DIRTY == 0 || dev_loc)
}

/// A fixed-size, allocation-free text buffer for the fork child's messages.
struct StackText {
    buf: [u8; 256],
    len: usize,
}

impl std::fmt::Write for StackText {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let n = s.len().min(self.buf.len() - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
        self.len += n;
        Ok(())
    }
}

/// A raw ioctl for the fork child (no allocation anywhere on this path).
fn child_ioctl<T>(fd: i32, cmd: u64, arg: &mut T) -> Result<i64, i32> {
    // SAFETY: `arg` is the argument struct of `cmd`, on our stack.
    let r = unsafe { libc::ioctl(fd, cmd as _, arg as *mut T) };
    if r < 0 {
        Err(errno())
    } else {
        Ok(r as i64)
    }
}

/// The fork child: the inherited fds belong to the parent's space (EPERM, ENOENT, EINVAL),
/// then it opens its own and does a few calls; it exits, or hangs in a long launch until its
/// parent kills it. Nothing here allocates (the parent is multi-threaded).
fn fork_child(rng: Rng, gfd: i32, sfd: i32, hint: u64, errfd: i32, parent: i32) -> ! {
    fn report(errfd: i32, what: &str, got: Result<i64, i32>) -> ! {
        let mut t = StackText { buf: [0; 256], len: 0 };
        let _ = match got {
            Ok(v) => writeln!(t, "fork child: {what}: unexpected ok ({v})"),
            Err(e) => writeln!(t, "fork child: {what}: unexpected errno {e}"),
        };
        // SAFETY: our stack buffer to our pipe.
        unsafe {
            libc::write(errfd, t.buf.as_ptr().cast(), t.len);
            libc::_exit(1)
        }
    }
    // Die with the thread that forked us (its process may `_exit` or be killed).
    // SAFETY: prctl/getppid/_exit on ourselves.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
        if libc::getppid() != parent {
            libc::_exit(0);
        }
    }
    // The parent's fd: only VERSION works.
    let mut v = GmemVersion { argsz: argsz::<GmemVersion>(), ..Default::default() };
    if let r @ Err(_) = child_ioctl(gfd, GMEM_IOC_VERSION, &mut v) {
        report(errfd, "VERSION on the inherited fd", r);
    }
    let mut q = GmemQuery { argsz: argsz::<GmemQuery>(), addr: hint, npages: 1, ..Default::default() };
    match child_ioctl(gfd, GMEM_IOC_QUERY, &mut q) {
        Err(libc::EPERM) => {}
        r => report(errfd, "QUERY on the inherited fd", r),
    }
    let mut a = GmemAlloc { argsz: argsz::<GmemAlloc>(), size: 4096, preferred_dev: -1, ..Default::default() };
    match child_ioctl(gfd, GMEM_IOC_ALLOC, &mut a) {
        Err(libc::EPERM) => {}
        r => report(errfd, "ALLOC on the inherited fd", r),
    }
    match child_ioctl(gfd, iowr(b'G', 0x77, 8), &mut a) {
        Err(libc::EPERM) => {}
        r => report(errfd, "unknown ioctl on the inherited fd", r),
    }
    // SAFETY: mmap of the inherited fd at a place of the kernel's choice.
    let m = unsafe { libc::mmap(std::ptr::null_mut(), 4096, libc::PROT_READ, libc::MAP_SHARED, gfd, 0) };
    if m != libc::MAP_FAILED || errno() != libc::EINVAL {
        report(errfd, "mmap of the inherited fd", if m == libc::MAP_FAILED { Err(errno()) } else { Ok(0) });
    }
    // The parent's region is not mapped here, and this process has no space yet.
    let mut l =
        SimLaunch { argsz: argsz::<SimLaunch>(), kernel: K_CHECKSUM, a: hint & !3, len: 4096, ..Default::default() };
    match child_ioctl(sfd, GMEM_SIM_IOC_LAUNCH, &mut l) {
        Err(libc::ENOENT) | Err(libc::EFAULT) => {}
        r => report(errfd, "LAUNCH before opening /dev/gmem", r),
    }
    if rng.chance(20) {
        // SAFETY: plain exit.
        unsafe { libc::_exit(0) };
    }
    // Our own space.
    // SAFETY: open(2) of a constant path.
    let fd = unsafe { libc::open(c"/dev/gmem".as_ptr(), libc::O_RDWR) };
    if fd < 0 {
        report(errfd, "open /dev/gmem", Err(errno()));
    }
    let size = rng.range(1, 1024) * PAGE;
    let mut a =
        GmemAlloc { argsz: argsz::<GmemAlloc>(), size, preferred_dev: rng.pick(&[-1, 0, 1]), ..Default::default() };
    if let r @ Err(_) = child_ioctl(fd, GMEM_IOC_ALLOC, &mut a) {
        report(errfd, "ALLOC in the child", r);
    }
    // SAFETY: our fresh region, read/write.
    unsafe { std::ptr::write_volatile(a.addr as *mut u32, 7) };
    let mut l =
        SimLaunch { argsz: argsz::<SimLaunch>(), kernel: K_FILL, a: a.addr, len: size, value: 3, ..Default::default() };
    let filled = match child_ioctl(sfd, GMEM_SIM_IOC_LAUNCH, &mut l) {
        Ok(_) => true,
        Err(libc::ENOMEM) | Err(libc::EIO) => false,
        r => report(errfd, "FILL in the child", r),
    };
    // SAFETY: our region again (the device wrote it: word 0 is the fill's value).
    let w = unsafe { std::ptr::read_volatile(a.addr as *const u32) };
    if w != 3 && (filled || w != 7) {
        report(errfd, "CPU read-back after FILL", Ok(i64::from(w)));
    }
    let mut adv = GmemAdvise {
        argsz: argsz::<GmemAdvise>(),
        advice: GMEM_ADV_PREFETCH,
        addr: a.addr,
        len: size,
        dev: rng.pick(&[0, 1, GMEM_HOST]),
        flags: GMEM_ADVF_ASYNC,
        ..Default::default()
    };
    match child_ioctl(fd, GMEM_IOC_ADVISE, &mut adv) {
        Ok(_) => {}
        r => report(errfd, "ASYNC PREFETCH in the child", r),
    }
    match rng.below(3) {
        // Exit with a fence outstanding and pages on a device.
        // SAFETY: plain exit.
        0 => unsafe { libc::_exit(0) },
        // A launch that runs until the parent kills us.
        1 => {
            let mut l = SimLaunch {
                argsz: argsz::<SimLaunch>(),
                kernel: K_TOUCH,
                flags: libgmem::sim::F_WRITE,
                a: a.addr,
                len: size,
                count: u64::MAX,
                seed: rng.next(),
                ..Default::default()
            };
            let r = child_ioctl(sfd, GMEM_SIM_IOC_LAUNCH, &mut l);
            report(errfd, "TOUCH count=2^64-1 returned", r);
        }
        _ => {
            let mut l = SimLaunch {
                argsz: argsz::<SimLaunch>(),
                kernel: K_CHECKSUM,
                a: a.addr,
                len: size,
                ..Default::default()
            };
            let _ = child_ioctl(sfd, GMEM_SIM_IOC_LAUNCH, &mut l);
            // SAFETY: plain exit.
            unsafe { libc::_exit(0) }
        }
    }
}

/// One fuzz process: `THREADS` threads until `deadline` or the global stop; then it exits
/// cleanly, or `_exit`s with its threads still inside the kernel.
fn fuzz_process(seed: u64, shared: &Shared, errfd: i32, life: Duration) -> ! {
    let rng = Rng::new(seed);
    // SAFETY: prctl on ourselves: die with the test process if it dies (e.g. its alarm).
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    let fail = |m: String| -> ! {
        shared.add(C_ERRORS, 1);
        let m = format!("{m}\n");
        // SAFETY: our buffer to our pipe, then a plain exit.
        unsafe {
            libc::write(errfd, m.as_ptr().cast(), m.len());
            libc::_exit(1)
        }
    };
    let anchor = match Gmem::open() {
        Ok(g) => g,
        Err(e) => fail(format!("fuzz process: open /dev/gmem: {e}")),
    };
    // Private regions first (never freed), so that no address another thread names can
    // ever fall inside them.
    let mut private = Vec::new();
    for _ in 0..THREADS {
        let (Some(a), Some(v)) = (guarded_region(anchor.fd(), ARGREG), guarded_region(anchor.fd(), VERIFY_BYTES))
        else {
            fail("fuzz process: private regions".into())
        };
        private.push((a, v));
    }
    let p = Proc {
        shared,
        errfd,
        stop: AtomicBool::new(false),
        deadline: Instant::now() + life,
        published: Mutex::new(Vec::new()),
        messages: AtomicU32::new(0),
    };
    let exit_early = rng.chance(40);
    std::thread::scope(|s| {
        for (t, &(a, v)) in private.iter().enumerate() {
            let p = &p;
            let seed = rng.next() ^ t as u64;
            s.spawn(move || match Worker::new(p, seed, a, v) {
                Some(mut w) => w.run(),
                None => p.fail("fuzz thread: setup failed"),
            });
        }
        while !p.done() {
            std::thread::sleep(Duration::from_millis(20));
        }
        if exit_early {
            shared.add(C_EXIT, 1);
            // SAFETY: exit_group with the other threads inside gmem calls.
            unsafe { libc::_exit(0) };
        }
        p.stop.store(true, Relaxed);
    });
    drop(anchor);
    std::process::exit(0)
}

fn fuzz() -> TestResult {
    let seed = std::env::var("gmem_fuzz_seed").ok().and_then(|s| s.parse::<u64>().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
    });
    println!("GMEM-FUZZ seed={seed} secs={FUZZ_SECS} procs={PROCS} threads={THREADS} huge_sizes={HUGE_SIZES}");
    let rng = Rng::new(seed);
    // SAFETY: a fresh shared anonymous page: zeroed memory is a valid `Shared` (atomics).
    let shared: &Shared = unsafe {
        let m = libc::mmap(
            std::ptr::null_mut(),
            PAGE as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        ensure!(m != libc::MAP_FAILED, "mmap of the shared page failed");
        &*(m as *const Shared)
    };
    let mut fds = [0i32; 2];
    // SAFETY: pipe2 into our array.
    ensure!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } == 0, "pipe2");
    let (rfd, wfd) = (fds[0], fds[1]);
    // SAFETY: fcntl on our own pipe ends: writers never block, the reader drains at will.
    unsafe {
        libc::fcntl(wfd, libc::F_SETFL, libc::O_NONBLOCK);
        libc::fcntl(rfd, libc::F_SETFL, libc::O_NONBLOCK);
    }
    let mut messages = String::new();
    let drain = |messages: &mut String| {
        let mut buf = [0u8; 4096];
        loop {
            // SAFETY: reading into our buffer.
            let n = unsafe { libc::read(rfd, buf.as_mut_ptr().cast(), buf.len()) };
            if n <= 0 {
                break;
            }
            messages.push_str(&String::from_utf8_lossy(&buf[..n as usize]));
        }
    };

    let start = Instant::now();
    let deadline = start + Duration::from_secs(FUZZ_SECS);
    // (pid, killed by us)
    let mut live: Vec<(i32, bool)> = Vec::new();
    let spawn = |rng: &Rng, live: &mut Vec<(i32, bool)>| {
        let left = deadline.saturating_duration_since(Instant::now());
        if left < Duration::from_secs(2) {
            return;
        }
        let life = Duration::from_millis(rng.range(5_000, 25_000)).min(left);
        let seed = rng.next();
        // SAFETY: this process is single-threaded; the child runs the fuzz process and exits.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            fuzz_process(seed, shared, wfd, life);
        }
        if pid > 0 {
            shared.add(C_PROCS, 1);
            live.push((pid, false));
        }
    };
    for _ in 0..PROCS {
        spawn(&rng, &mut live);
    }
    let mut unexpected = Vec::new();
    let reap = |live: &mut Vec<(i32, bool)>, unexpected: &mut Vec<String>| {
        live.retain(|&(pid, killed)| {
            let mut status = 0;
            // SAFETY: waiting for our own child.
            if unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } != pid {
                return true;
            }
            let ok = (libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0)
                || (killed && libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGKILL);
            if !ok {
                unexpected.push(format!(
                    "fuzz process {pid}: status {status:#x} (signal {})",
                    if libc::WIFSIGNALED(status) { libc::WTERMSIG(status) } else { 0 }
                ));
            }
            false
        });
    };
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
        reap(&mut live, &mut unexpected);
        while live.len() < PROCS && Instant::now() + Duration::from_secs(2) < deadline {
            spawn(&rng, &mut live);
            if live.len() < PROCS {
                break;
            }
        }
        // Now and then kill one mid-flight.
        if rng.below(400) == 0 {
            if let Some(e) = live.iter_mut().find(|e| !e.1) {
                // SAFETY: our own child.
                unsafe { libc::kill(e.0, libc::SIGKILL) };
                e.1 = true;
                shared.add(C_KILLED, 1);
            }
        }
        drain(&mut messages);
    }
    shared.stop.store(1, Relaxed);
    let t = Instant::now();
    while !live.is_empty() && t.elapsed() < GRACE {
        std::thread::sleep(Duration::from_millis(20));
        reap(&mut live, &mut unexpected);
    }
    for e in live.iter_mut() {
        // SAFETY: our own child.
        unsafe { libc::kill(e.0, libc::SIGKILL) };
        e.1 = true;
        shared.add(C_KILLED, 1);
    }
    let t = Instant::now();
    while !live.is_empty() && t.elapsed() < REAP {
        std::thread::sleep(Duration::from_millis(20));
        reap(&mut live, &mut unexpected);
    }
    drain(&mut messages);
    let fuzz_secs = start.elapsed().as_secs_f64();
    let mut line = String::from("GMEM-FUZZ");
    for (c, name) in COUNTER_NAMES {
        let _ = write!(line, " {name}={}", shared.get(c));
    }
    let _ = write!(line, " wall={fuzz_secs:.1}s");
    println!("{line}");
    let mut ms = String::from("GMEM-INFO fuzz thread-ms:");
    for (i, k) in MS_KINDS.iter().enumerate() {
        let _ = write!(ms, " {k}={}", shared.get(C_MS + i));
    }
    println!("{ms}");
    for m in messages.lines().take(20) {
        println!("GMEM-FUZZ-ERROR {m}");
    }
    ensure!(live.is_empty(), "fuzz processes {:?} not reaped {} s after SIGKILL", live, REAP.as_secs());
    ensure!(unexpected.is_empty(), "{}", unexpected.join("; "));
    ensure!(
        shared.get(C_ERRORS) == 0,
        "{} unexpected results, first: {}",
        shared.get(C_ERRORS),
        messages.lines().next().unwrap_or("(message lost)")
    );
    // A floor that only catches a fuzzer that did nothing (the debug kernel is ~10x slower).
    ensure!(shared.get(C_CALLS) > 200, "only {} calls in {FUZZ_SECS} s", shared.get(C_CALLS));
    after_fuzz()
}

/// Every fuzz process is gone: every frame must come back, and the module must still work.
fn after_fuzz() -> TestResult {
    let t = Instant::now();
    let mut last = String::new();
    loop {
        let c = libgmem::debugfs::counters().map_err(|e| format!("debugfs: {e}"))?;
        ensure!(c.len() == NDEV, "debugfs lists {} devices", c.len());
        let busy: Vec<String> = c
            .iter()
            .filter(|(_, m)| ["used", "pinned", "lent"].iter().any(|k| m.get(*k).copied().unwrap_or(0) != 0))
            .map(|(d, m)| {
                format!("dev{d} used={:?} pinned={:?} lent={:?}", m.get("used"), m.get("pinned"), m.get("lent"))
            })
            .collect();
        if busy.is_empty() {
            break;
        }
        last = busy.join(", ");
        ensure!(
            t.elapsed() < DRAIN,
            "frames still in use {} s after every fuzz process exited: {last}",
            DRAIN.as_secs()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    println!(
        "GMEM-INFO fuzz: all frames free after {} ms{}",
        t.elapsed().as_millis(),
        if last.is_empty() { String::new() } else { format!(" (was: {last})") }
    );
    for d in 0..NDEV {
        let s = libgmem::sim::Sim::open(d).map_err(|e| format!("open sim{d}: {e}"))?;
        let i = ok!(s.info());
        ensure!(
            i.ptes == 0 && i.ptes_2m == 0,
            "sim{d}: {} 4 KiB and {} 2 MiB PTEs left with no process using GMEM",
            i.ptes,
            i.ptes_2m
        );
    }
    let g = Gmem::open().map_err(|e| e.to_string())?;
    ensure!(ok!(g.version()).nr_devices as usize == NDEV, "devices missing after the fuzz");
    let s0 = libgmem::sim::Sim::open(0).map_err(|e| e.to_string())?;
    let s1 = libgmem::sim::Sim::open(1).map_err(|e| e.to_string())?;
    let r = ok!(g.alloc(4 << 20));
    ok!(s0.fill(r.addr, r.len as u64, 0x5eed));
    let expect: Vec<u32> = (0..r.len as u32 / 4).map(|i| 0x5eed + i).collect();
    ensure!(
        ok!(s1.checksum(r.addr, r.len as u64)).result == libgmem::sim::checksum(&expect),
        "checksum on dev1 after the fuzz"
    );
    let w = crate::harness::words(&r);
    ensure!(w == expect.as_slice(), "CPU read-back after the fuzz");
    drop(r);
    let c = libgmem::debugfs::counters().map_err(|e| format!("debugfs: {e}"))?;
    for (d, m) in &c {
        ensure!(m.get("used").copied().unwrap_or(0) == 0, "dev{d}: frames in use after FREE: {:?}", m.get("used"));
    }
    Ok(())
}

pub fn tests() -> Vec<Test> {
    vec![Test { name: "fuzz", f: fuzz }]
}
