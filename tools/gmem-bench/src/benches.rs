// SPDX-License-Identifier: GPL-2.0
//! The benchmarks P1..P6 and the memcpy baseline. Every timed run also checks its data
//! (device checksums against the CPU's, CPU reads against the device's writes): a fast
//! wrong answer is an error, not a figure.

use crate::json::{Json, JsonExt};
use crate::sys::{self, counters, counters_json, delta, get, now, stat_json, Anon, Counters, Dmirror, Stat};
use libgmem::sim::{checksum, Sim, SimInfo, SimLink, PATH_D2D, PATH_D2H, PATH_H2D};
use libgmem::{Gmem, Region, GMEM_ADV_PREFERRED_LOC, GMEM_ADV_PREFETCH, GMEM_ADV_UNSET_PREFERRED_LOC, GMEM_HOST};

pub type R<T> = Result<T, String>;

/// Maps a libgmem error to a message naming the call.
macro_rules! t {
    ($e:expr) => {
        $e.map_err(|e| format!("{}: {}", stringify!($e), e))?
    };
}

/// `ensure!(cond, "fmt", ...)`: a data check failed.
macro_rules! ensure {
    ($c:expr, $($m:tt)+) => {
        if !$c {
            return Err(format!($($m)+));
        }
    };
}

pub const PAGE: usize = 4096;

/// One P4 configuration of the overcommit engine.
#[derive(Clone)]
pub struct P4Config {
    pub name: String,
    /// Words written to the control file before the runs.
    pub control: String,
    /// Device watermarks (low, high) in frames, if not the defaults.
    pub watermarks: Option<(u64, u64)>,
    pub factors: Vec<f64>,
    pub touch: bool,
    /// Not one of the two configurations the brief asks for: run to explain them.
    pub diagnostic: bool,
    /// Runs with the link model on (host links at `link_mbps`, peer links at 4x): the
    /// streaming rows then report their transfer floor and time / floor (issue 10).
    pub link: bool,
}

/// Mandatory bytes over (device-to-host, host-to-device) for the P4 stream (FILL, then
/// CHECKSUM, in address order) of `region` bytes on a device of `cap` bytes, without a
/// peer tier: past capacity, FILL's overflow must be written back; CHECKSUM must fetch
/// what is not resident and, to make room, write back dirty pages it evicts; the best any
/// policy can do re-fetches at most `cap` of what it evicted. Per direction: the overflow
/// plus min(cap, overflow) bytes.
pub fn stream_floor_bytes(region: u64, cap: u64) -> (u64, u64) {
    let over = region.saturating_sub(cap);
    let b = over + over.min(cap);
    (b, b)
}

/// Seconds the transfer floor takes: the two host paths run at once (a full-duplex
/// link), each at `mbps` MB/s.
pub fn transfer_floor_s((d2h, h2d): (u64, u64), mbps: u64) -> f64 {
    d2h.max(h2d) as f64 / (mbps as f64 * 1e6)
}

pub fn progress(id: &str, i: usize, n: usize, what: &str) {
    eprintln!("GMEM-BENCH progress {id} {i}/{n} {what}");
}

/// The word the CPU writes at index `i` (seeded so runs differ).
fn pattern(i: usize, seed: u32) -> u32 {
    (i as u32).wrapping_mul(0x9e37_79b1).wrapping_add(seed)
}

fn cpu_write(w: &mut [u32], seed: u32) {
    for (i, x) in w.iter_mut().enumerate() {
        *x = pattern(i, seed);
    }
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

fn checksum_of(n: usize, f: impl Fn(usize) -> u32) -> u64 {
    let mut h = FNV_OFFSET;
    for i in 0..n {
        h = (h ^ u64::from(f(i))).wrapping_mul(FNV_PRIME);
    }
    h
}

fn words<'a>(r: &Region<'a>) -> &'a mut [u32] {
    // SAFETY: the region is mapped read/write for its length while it lives; callers drop
    // the slice before the region.
    unsafe { std::slice::from_raw_parts_mut(r.as_ptr().cast::<u32>(), r.len / 4) }
}

/// Reads word 0 of every page (volatile: each read is a real access, hence a fault if
/// the page is elsewhere); returns how many pages did not hold `expect(page)`.
fn touch_pages(base: *const u32, npages: usize, expect: impl Fn(usize) -> u32) -> usize {
    let mut bad = 0;
    for p in 0..npages {
        // SAFETY: `base` maps `npages` pages.
        let v = unsafe { std::ptr::read_volatile(base.add(p * PAGE / 4)) };
        bad += (v != expect(p)) as usize;
    }
    bad
}

/// One CPU copy of `n` bytes: 0 and 4 = one memcpy (THP allowed / not), 1 = one memcpy
/// per 4 KiB page (as the migration paths copy), 2 = an explicit SSE2 load/store loop.
/// (3, the kernel's copy_to_user, is `CopyBase::time` with a file.)
///
/// # Safety
/// `src` and `dst` must be distinct mappings of at least `n` bytes, `n` a multiple of 64.
unsafe fn copy(style: u8, src: *const u8, dst: *mut u8, n: usize) {
    match style {
        // SAFETY: distinct mappings of at least `n` bytes (the function's contract).
        0 | 3 | 4 => unsafe { std::ptr::copy_nonoverlapping(src, dst, n) },
        1 => {
            for off in (0..n).step_by(PAGE) {
                // SAFETY: within both mappings.
                unsafe { std::ptr::copy_nonoverlapping(src.add(off), dst.add(off), PAGE.min(n - off)) };
            }
        }
        _ => {
            use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_storeu_si128};
            let (s, d) = (src.cast::<__m128i>(), dst.cast::<__m128i>());
            for i in (0..n / 16).step_by(4) {
                // SAFETY: SSE2 is baseline on x86_64; 4 x 16 bytes within both mappings.
                unsafe {
                    let (a, b, c, e) = (
                        _mm_loadu_si128(s.add(i)),
                        _mm_loadu_si128(s.add(i + 1)),
                        _mm_loadu_si128(s.add(i + 2)),
                        _mm_loadu_si128(s.add(i + 3)),
                    );
                    _mm_storeu_si128(d.add(i), a);
                    _mm_storeu_si128(d.add(i + 1), b);
                    _mm_storeu_si128(d.add(i + 2), c);
                    _mm_storeu_si128(d.add(i + 3), e);
                }
            }
        }
    }
}

/// `count` consecutive timings (seconds) of one copy style over `n` bytes.
pub fn copy_probe(n: usize, style: u8, count: usize) -> Vec<f64> {
    let Ok(b) = CopyBase::new(n, style) else { return vec![] };
    (0..count).filter_map(|_| b.time(None).ok()).collect()
}

fn info(s: &Sim) -> SimInfo {
    s.info().unwrap_or_default()
}

fn round_pages(x: f64) -> usize {
    ((x / PAGE as f64).round() as usize).max(1) * PAGE
}

/// The per-device counters a run moved, summarised: `runs` is the number of runs the
/// delta covers (to report per-run figures).
fn overcommit_summary(d: &Counters, dev: u32) -> Json {
    let allocs = get(d, dev, "faults.allocs");
    let waits = get(d, dev, "faults.waits_for_eviction");
    let (pf, used, wasted) =
        (get(d, dev, "prefetch.pages"), get(d, dev, "prefetch.used"), get(d, dev, "prefetch.wasted"));
    let (to_host, to_peer, clean) =
        (get(d, dev, "evicted.to_host"), get(d, dev, "evicted.to_peer"), get(d, dev, "evicted.clean_dropped"));
    let ratio = |a: u64, b: u64| if b == 0 { Json::Null } else { crate::json::num(a as f64 / b as f64) };
    Json::obj()
        .with("fault_pages", get(d, dev, "faults.pages"))
        .with("fault_batches", get(d, dev, "faults.batches"))
        .with("fault_allocs", allocs)
        .with("waits_for_eviction", waits)
        .with("waits_fraction", ratio(waits, allocs))
        .with("evicted_to_host", to_host)
        .with("evicted_to_peer", to_peer)
        .with("evicted_clean_dropped", clean)
        .with("pre_evicted", get(d, dev, "evicted.pre_evicted"))
        .with("writebacks", get(d, dev, "evicted.writebacks"))
        .with("prefetch_pages", pf)
        .with("prefetch_used", used)
        .with("prefetch_wasted", wasted)
        .with("prefetch_accuracy", ratio(used, used + wasted))
        .with("thrash_events", get(d, dev, "prefetch.thrash_events"))
        .with("h2d", get(d, dev, "migrated.h2d"))
        .with("d2h", get(d, dev, "migrated.d2h"))
        .with("d2d", get(d, dev, "migrated.d2d"))
        .with("zeroed", get(d, dev, "migrated.zeroed"))
}

pub struct Bench {
    pub g: Gmem,
    pub s0: Sim,
    pub s1: Option<Sim>,
    /// GMEM device id of sim0.
    pub d0: i32,
    /// Bytes of device memory of sim0.
    pub cap: u64,
    pub reps: usize,
    /// Untimed runs before the timed ones (first-use costs: contexts, page tables).
    pub warm: usize,
    pub smoke: bool,
    /// Bytes for P1/P2 and the copy baseline.
    pub size: usize,
    /// Pages for P3.
    pub p3_pages: usize,
    /// Bytes/s of plain libc memcpy (a second, less conservative denominator).
    pub libc_memcpy_bw: Option<f64>,
    /// MB/s of the survey's paired baseline (median), once the survey has run.
    pub survey_paired_mbs: Option<f64>,
    /// The host link bandwidth (MB/s) the link-model runs use instead of a quarter of the
    /// measured baseline (`link=MBPS`).
    pub link_override: Option<u64>,
    /// A control setting PL also runs every kind with (`ab=KEY=VALUE`).
    pub ab: Option<String>,
}

/// One CPU copy style (see `copy`) on buffers of its own, timed on demand.
struct CopyBase {
    src: Anon,
    dst: Anon,
    style: u8,
    n: usize,
}

impl CopyBase {
    fn new(n: usize, style: u8) -> R<CopyBase> {
        let (src, dst) = (Anon::new(n, style == 0)?, Anon::new(n, style == 0)?);
        cpu_write(src.words(), 1);
        dst.bytes().fill(0xee);
        Ok(CopyBase { src, dst, style, n })
    }

    fn time(&self, file: Option<&sys::TmpFile>) -> R<f64> {
        let t0 = now();
        match file {
            Some(f) => f.read_into(self.dst.bytes())?,
            // SAFETY: two distinct mappings of n bytes.
            None => unsafe { copy(self.style, self.src.ptr, self.dst.ptr, self.n) },
        }
        sys::keep(self.dst.ptr);
        Ok(now() - t0)
    }
}

/// The paired baseline of P1/P2: libc memcpy and the SSE2 loop; `time` is the faster.
struct PairedBase(CopyBase, CopyBase);

impl PairedBase {
    fn time(&self) -> R<f64> {
        Ok(self.0.time(None)?.min(self.1.time(None)?))
    }
}

/// What one figure accumulates over its timed repetitions.
#[derive(Default)]
struct Cell {
    /// Named per-repetition values (seconds, ratios, ...).
    v: std::collections::BTreeMap<&'static str, Vec<f64>>,
    /// Summed debugfs counter deltas of the timed runs.
    counters: Counters,
    /// Summed GMEM_SIM_IOC_INFO deltas (both devices) of the timed runs.
    copies: u64,
    tlb_flushes: u64,
    /// Summed deltas of this process's space counters (debugfs `spaces`).
    block_locks: u64,
    cpu_zaps: u64,
    /// Summed launch outcomes.
    faults: u64,
    batches: u64,
    runs: usize,
}

impl Cell {
    fn push(&mut self, k: &'static str, x: f64) {
        self.v.entry(k).or_default().push(x);
    }

    fn stat(&self, k: &str) -> Json {
        self.v.get(k).map_or(Json::Null, |v| stat_json(v))
    }

    /// An object with the stat of each of `keys`.
    fn stats(&self, keys: &[&str]) -> Json {
        keys.iter().fold(Json::obj(), |o, k| o.with(k, self.stat(k)))
    }

    fn median(&self, k: &str) -> Option<f64> {
        self.v.get(k).and_then(|v| Stat::of(v)).map(|s| s.median)
    }

    /// Per page of `pages` per run.
    fn per_page(&self, x: u64, pages: usize) -> f64 {
        x as f64 / self.runs.max(1) as f64 / pages as f64
    }

    /// The executor's work per migrated page (`pages` per run): driver calls, CPU zaps
    /// and lock acquisitions (block locks of this process's space, frame-pool locks of
    /// every device).
    fn work_per_page(&self, pages: usize) -> Json {
        let pool = all_devs(&self.counters, "locks.pool");
        Json::obj()
            .with("copy_calls", self.per_page(all_devs(&self.counters, "driver_calls.copy"), pages))
            .with("map_calls", self.per_page(all_devs(&self.counters, "driver_calls.map"), pages))
            .with("map_2m", self.per_page(all_devs(&self.counters, "driver_calls.map_2m"), pages))
            .with("tlb_flushes", self.per_page(self.tlb_flushes, pages))
            .with("cpu_zaps", self.per_page(self.cpu_zaps, pages))
            .with("block_locks", self.per_page(self.block_locks, pages))
            .with("pool_locks", self.per_page(pool, pages))
            .with("lock_acquisitions", self.per_page(self.block_locks + pool, pages))
    }
}

/// Pages moved over a link, every device: host to device, device to host, device to
/// device (zero fills excluded: they write device memory and cross no link).
fn transfers(c: &Counters) -> u64 {
    ["migrated.h2d", "migrated.d2h", "migrated.d2d"].iter().map(|k| all_devs(c, k)).sum()
}

/// A counter summed over every device.
fn all_devs(c: &Counters, key: &str) -> u64 {
    c.values().filter_map(|m| m.get(key)).sum()
}

fn add_counters(acc: &mut Counters, d: &Counters) {
    for (dev, m) in d {
        let a = acc.entry(*dev).or_default();
        for (k, v) in m {
            *a.entry(k.clone()).or_default() += v;
        }
    }
}

impl Bench {
    fn runs(&self) -> usize {
        self.warm + self.reps
    }

    fn sim_infos(&self) -> (SimInfo, SimInfo) {
        (info(&self.s0), self.s1.as_ref().map(info).unwrap_or_default())
    }

    /// Runs `f` (one repetition); if `timed`, adds the counters it moved to `cell`.
    fn counted<T>(&self, cell: &mut Cell, timed: bool, f: impl FnOnce() -> R<T>) -> R<T> {
        let (c0, (a0, b0), s0) = (counters(), self.sim_infos(), sys::own_space());
        let v = f()?;
        if timed {
            let (c1, (a1, b1), s1) = (counters(), self.sim_infos(), sys::own_space());
            add_counters(&mut cell.counters, &delta(&c0, &c1));
            cell.block_locks += s1.0.saturating_sub(s0.0);
            cell.cpu_zaps += s1.1.saturating_sub(s0.1);
            cell.copies += (a1.copies - a0.copies) + (b1.copies - b0.copies);
            cell.tlb_flushes += (a1.tlb_flushes - a0.tlb_flushes) + (b1.tlb_flushes - b0.tlb_flushes);
            cell.runs += 1;
        }
        Ok(v)
    }

    /// Baseline survey: CPU copies of the same byte count into an ordinary, already-populated
    /// anonymous buffer, in several styles (TCG's speed depends on the instructions: `rep
    /// movs`, which libc's memcpy uses, is slow and erratic there). The ratios of P1/P2 use
    /// a paired baseline (`paired_base`). Also the cost of a plain first-touch anonymous
    /// page fault, the floor under any CPU-fault-driven migration.
    pub fn baseline(&mut self) -> R<Json> {
        let n = self.size;
        let variants: [(&str, u8); 5] = [
            ("memcpy", 0),
            ("memcpy_nothp", 4),
            ("memcpy_per_4k_page", 1),
            ("sse2_loop", 2),
            ("kernel_copy_to_user", 3),
        ];
        let bases = variants.iter().map(|&(_, style)| CopyBase::new(n, style)).collect::<R<Vec<_>>>()?;
        let file = sys::TmpFile::with(bases[4].src.bytes())?;
        let mut times: Vec<Vec<f64>> = vec![vec![]; variants.len()];
        let (mut fault_ns, mut read_fault_ns) = (vec![], vec![]);
        // Interleaved: every repetition measures every variant.
        for rep in 0..self.runs() {
            progress("baseline", rep + 1, self.runs(), "CPU copies (5 styles), anonymous page faults");
            for (k, b) in bases.iter().enumerate() {
                let t = b.time((b.style == 3).then_some(&file))?;
                if rep >= self.warm {
                    times[k].push(t);
                }
            }
            let a = Anon::new(n, false)?;
            let t0 = now();
            for p in 0..n / PAGE {
                // SAFETY: within the mapping.
                unsafe { std::ptr::write_volatile(a.ptr.add(p * PAGE), 1u8) };
            }
            let t = now() - t0;
            // Read faults map the shared zero page: no allocation, no zeroing.
            let z = Anon::new(n, false)?;
            let t1 = now();
            let mut acc = 0u8;
            for p in 0..n / PAGE {
                // SAFETY: within the mapping.
                acc = acc.wrapping_add(unsafe { std::ptr::read_volatile(z.ptr.add(p * PAGE)) });
            }
            let tr = now() - t1;
            sys::keep(acc);
            if rep >= self.warm {
                fault_ns.push(t * 1e9 / (n / PAGE) as f64);
                read_fault_ns.push(tr * 1e9 / (n / PAGE) as f64);
            }
        }
        let mut out = Json::obj().with("bytes", n);
        for (k, (name, _)) in variants.iter().enumerate() {
            ensure!(bases[k].dst.words()[n / 4 - 1] == pattern(n / 4 - 1, 1), "{name} did not copy");
            let med = Stat::of(&times[k]).ok_or("no copy time")?.median;
            if *name == "memcpy" {
                self.libc_memcpy_bw = Some(n as f64 / med);
            }
            out.set(name, Json::obj().with("time_s", stat_json(&times[k])).with("bw_mbs", bw_stat(n, &times[k])));
        }
        // The denominator of the ratios: per repetition, the faster of libc memcpy and the
        // SSE2 loop, measured right before that repetition (see `paired_base`).
        let paired: Vec<f64> = times[0].iter().zip(&times[3]).map(|(a, b)| a.min(*b)).collect();
        self.survey_paired_mbs = Stat::of(&paired).map(|s| n as f64 / s.median / 1e6);
        out.set("used", "per repetition: the faster of memcpy and sse2_loop, timed right before it");
        out.set("paired", Json::obj().with("time_s", stat_json(&paired)).with("bw_mbs", bw_stat(n, &paired)));
        out.set(
            "what",
            "CPU copy into a populated anonymous buffer. libc memcpy (rep movsq) runs erratically on TCG, often 4x slower than an SSE2 loop; the kernel's own copies do not use rep movs here",
        );
        out.set("anon_fault_ns_per_page", stat_json(&fault_ns));
        out.set("anon_read_fault_ns_per_page", stat_json(&read_fault_ns));
        Ok(out)
    }

    /// The paired baseline of P1/P2: libc memcpy and the SSE2 loop over `size` bytes; its
    /// `time` is the faster of the two, timed now (the conservative denominator).
    fn paired_base(&self) -> R<PairedBase> {
        Ok(PairedBase(CopyBase::new(self.size, 0)?, CopyBase::new(self.size, 2)?))
    }

    /// P1: device-fault-driven host-to-device migration (prefetch off/on, and with thrashing
    /// detection off as a diagnostic), and explicit PREFETCH. All variants and the paired
    /// baseline run in every repetition, in turn.
    pub fn p1(&mut self) -> R<Json> {
        let n = self.size;
        let pages = n / PAGE;
        let seed = 0x11;
        let expect = checksum_of(n / 4, |i| pattern(i, seed));
        let variants = [
            ("on_demand_prefetch0", "prefetch=0 thrash=1", false),
            ("on_demand_prefetch1", "prefetch=1 thrash=1", false),
            ("on_demand_prefetch0_thrash0", "prefetch=0 thrash=0", false),
            ("on_demand_prefetch1_pct25", "prefetch=1 prefetch_pct=25 thrash=1", false),
            ("explicit_prefetch", "prefetch=1 thrash=1", true),
        ];
        let mut cells: Vec<Cell> = variants.iter().map(|_| Cell::default()).collect();
        let base = self.paired_base()?;
        let mut base_cell = Cell::default();
        for rep in 0..self.runs() {
            progress("P1", rep + 1, self.runs(), "baseline copy, faults prefetch=0/1, thrash=0, explicit PREFETCH");
            let timed = rep >= self.warm;
            let tb = base.time()?;
            if timed {
                base_cell.push("bw", n as f64 / tb / 1e6);
            }
            for (k, &(name, ctl, explicit)) in variants.iter().enumerate() {
                sys::restore()?;
                sys::control(ctl)?;
                let cell = &mut cells[k];
                let (t, tc, o) = self.counted(cell, timed, || {
                    let r = t!(self.g.alloc(n as u64));
                    cpu_write(words(&r), seed);
                    let t0 = now();
                    let o = if explicit {
                        t!(r.advise(GMEM_ADV_PREFETCH, self.d0));
                        None
                    } else {
                        Some(t!(self.s0.checksum(r.addr, n as u64)))
                    };
                    let t1 = now();
                    let o2 = t!(self.s0.checksum(r.addr, n as u64));
                    let t2 = now();
                    ensure!(
                        o.is_none_or(|o| o.result == expect) && o2.result == expect,
                        "P1 {name}: device checksum mismatch"
                    );
                    ensure!(!explicit || o2.faults == 0, "P1 {name}: {} pages faulted after PREFETCH", o2.faults);
                    Ok((t1 - t0, t2 - t1, o))
                })?;
                if timed {
                    cell.push("time_s", t);
                    cell.push("bw_mbs", n as f64 / t / 1e6);
                    cell.push("ratio", tb / t);
                    if let Some(bw) = self.libc_memcpy_bw {
                        cell.push("ratio_vs_libc_memcpy", n as f64 / t / bw);
                    }
                    if let Some(o) = o {
                        cell.push("compute_s", tc);
                        cell.push("ratio_net", tb / (t - tc));
                        cell.faults += o.faults;
                        cell.batches += o.batches;
                    }
                }
            }
        }
        sys::restore()?;
        let mut out = Json::obj().with("bytes", n);
        for (k, &(name, ctl, explicit)) in variants.iter().enumerate() {
            let c = &cells[k];
            let d0 = self.d0 as u32;
            let mut j = Json::obj()
                .with("control", ctl)
                .with("time_s", c.stat("time_s"))
                .with("bw_mbs", c.stat("bw_mbs"))
                .with("ratio", c.stat("ratio"))
                .with("ratio_vs_libc_memcpy", c.stat("ratio_vs_libc_memcpy"))
                .with("h2d_per_page", c.per_page(get(&c.counters, d0, "migrated.h2d"), pages))
                .with("prefetched_per_run", c.per_page(get(&c.counters, d0, "prefetch.pages"), 1))
                .with("pages_copied_per_page", c.per_page(c.copies, pages))
                .with("copy_calls_per_page", c.per_page(all_devs(&c.counters, "driver_calls.copy"), pages))
                .with("map_calls_per_page", c.per_page(all_devs(&c.counters, "driver_calls.map"), pages))
                .with("tlb_flushes_per_page", c.per_page(c.tlb_flushes, pages))
                .with("per_migrated_page", c.work_per_page(pages))
                .with("counters", counters_json(&c.counters));
            if !explicit {
                j.set("compute_s", c.stat("compute_s"));
                j.set("ratio_net", c.stat("ratio_net"));
                j.set("faults_per_run", c.per_page(c.faults, 1));
                j.set("batches_per_run", c.per_page(c.batches, 1));
                j.set(
                    "pages_per_batch",
                    if c.batches == 0 { Json::Null } else { crate::json::num(c.faults as f64 / c.batches as f64) },
                );
            }
            out.set(name, j);
        }
        out.set("paired_baseline_mbs", base_cell.stat("bw"));
        out.set("fault_cost_by_batch_size", self.fault_profile(seed)?);
        Ok(out)
    }

    /// Per-page cost of device-fault migration against the fault batch size: CHECKSUM
    /// launches over k host-resident pages each (one batch of k faults, prefetch=0), minus
    /// the same launches once the pages are resident (launch + compute).
    fn fault_profile(&self, seed: u32) -> R<Json> {
        sys::control("prefetch=0 thrash=1")?;
        let np = if self.smoke { 64 } else { 1024 };
        let ks: &[usize] = if self.smoke { &[1, 64] } else { &[1, 4, 16, 64, 256] };
        let mut cells: Vec<Cell> = ks.iter().map(|_| Cell::default()).collect();
        for rep in 0..self.runs() {
            progress("P1", rep + 1, self.runs(), "fault cost against batch size 1..256");
            for (j, &k) in ks.iter().enumerate() {
                let r = t!(self.g.alloc((np * PAGE) as u64));
                cpu_write(words(&r), seed);
                let (mut tf, mut tr) = (0.0, 0.0);
                for off in (0..np).step_by(k) {
                    let a = r.addr + (off * PAGE) as u64;
                    let t0 = now();
                    let o = t!(self.s0.checksum(a, (k * PAGE) as u64));
                    tf += now() - t0;
                    let w0 = off * PAGE / 4;
                    ensure!(
                        o.batches == 1 && o.faults == k as u64,
                        "fault profile: {} faults in {} batches for {k} pages",
                        o.faults,
                        o.batches
                    );
                    ensure!(
                        o.result == checksum_of(k * PAGE / 4, |i| pattern(w0 + i, seed)),
                        "fault profile: checksum mismatch"
                    );
                }
                for off in (0..np).step_by(k) {
                    let t0 = now();
                    let o = t!(self.s0.checksum(r.addr + (off * PAGE) as u64, (k * PAGE) as u64));
                    tr += now() - t0;
                    ensure!(o.faults == 0, "fault profile: resident pages faulted again");
                }
                drop(r);
                if rep >= self.warm {
                    cells[j].push("page", (tf - tr) * 1e9 / np as f64);
                    cells[j].push("batch", (tf - tr) * 1e9 / (np / k) as f64);
                }
            }
        }
        sys::restore()?;
        Ok(Json::Array(
            ks.iter()
                .zip(&cells)
                .map(|(&k, c)| {
                    Json::obj()
                        .with("batch_pages", k)
                        .with("migrate_ns_per_page", c.stat("page"))
                        .with("migrate_ns_per_batch", c.stat("batch"))
                })
                .collect(),
        ))
    }

    /// P1/P2 with the link model on (`GMEM_SIM_IOC_LINK`, `set_links`): the host links run
    /// at a quarter of the guest's paired copy bandwidth, measured first, so that the link and
    /// not the CPU copy is the floor (device memory faster than the link, as on real
    /// hardware). Each migration's throughput is judged against the modelled bandwidth:
    /// device faults (default prefetch) and explicit PREFETCH host-to-device, CPU faults
    /// device-to-host. The link's own accounting (bytes, busy time) is checked and kept.
    pub fn link(&mut self) -> R<Json> {
        let n = self.size;
        let np = n / PAGE;
        let seed = 0x51;
        let expect = checksum_of(n / 4, |i| pattern(i, seed));
        let (mbps, paired) = self.link_mbps()?;
        let kinds = ["device_faults", "explicit_prefetch", "cpu_faults"];
        // The defaults, and with `ab=` a second setting (its words joined by '+').
        let variants: Vec<Option<String>> =
            core::iter::once(None).chain(self.ab.as_ref().map(|c| Some(c.replace('+', " ")))).collect();
        let mut cells: Vec<Vec<Cell>> =
            variants.iter().map(|_| kinds.iter().map(|_| Cell::default()).collect()).collect();
        self.with_links(mbps, || {
            for rep in 0..self.runs() {
                progress("PL", rep + 1, self.runs(), "device faults, PREFETCH, CPU faults over a modelled link");
                let timed = rep >= self.warm;
                for (k, kind) in kinds.iter().enumerate() {
                    // Which setting goes first alternates between timed repetitions, so that
                    // drift within one cancels (with an odd count, one more has the defaults
                    // first).
                    let mut order: Vec<usize> = (0..variants.len()).collect();
                    if rep.saturating_sub(self.warm) % 2 == 1 {
                        order.reverse();
                    }
                    for v in order {
                        let mark = if v == 0 { kind.to_string() } else { format!("{kind}_ab") };
                        sys::restore()?;
                        // One link: PL judges each migration against sim0's host link alone (two
                        // paths at once are P8's).
                        sys::control("multipath=0")?;
                        if let Some(c) = &variants[v] {
                            sys::control(c)?;
                        }
                        let mut compute = None;
                        // The scheduler's figures of the run: (CPUs busy, waited in all, waited each).
                        let mut sched = None;
                        let (t, l0, l1) = self.counted(&mut cells[v][k], timed, || {
                            let r = t!(self.g.alloc(n as u64));
                            if k < 2 {
                                cpu_write(words(&r), seed);
                            } else {
                                // Written by the device (placed there by zero fills: no link).
                                t!(self.s0.fill(r.addr, n as u64, 0x5151));
                            }
                            // The kernel adds a task's run time to the totals when it leaves
                            // its CPU: a short sleep on either side of the run flushes this
                            // thread's (it computes, in the device's launches). The link's
                            // counters are read inside those sleeps.
                            let (s0, w0) = (sys::settled_sched_totals(), now());
                            let l0 = t!(self.s0.link());
                            sys::trace_mark(&format!("GMEM-PL start {mark} {rep}"));
                            let t0 = now();
                            match k {
                                0 => {
                                    let o = t!(self.s0.checksum(r.addr, n as u64));
                                    ensure!(o.result == expect, "link {mark}: device checksum mismatch");
                                }
                                1 => {
                                    t!(r.advise(GMEM_ADV_PREFETCH, self.d0));
                                }
                                _ => {
                                    let bad = touch_pages(r.as_ptr().cast(), np, |p| {
                                        0x5151u32.wrapping_add((p * PAGE / 4) as u32)
                                    });
                                    ensure!(bad == 0, "link {mark}: {bad} pages read wrong values");
                                }
                            }
                            let t = now() - t0;
                            sys::trace_mark(&format!("GMEM-PL end {mark} {rep}"));
                            let l1 = t!(self.s0.link());
                            let s1 = sys::settled_sched_totals();
                            let w = now() - w0;
                            if let (Some(a), Some(b)) = (s0, s1) {
                                // How much CPU the run had, and how long runnable tasks (the
                                // device's compute, copy workers, gmem's lanes) waited for one.
                                let waited = b.wait_ns.saturating_sub(a.wait_ns) as f64 / 1e9;
                                let arrivals = b.arrivals.saturating_sub(a.arrivals);
                                let each = (arrivals > 0).then(|| waited / arrivals as f64);
                                sched = Some((b.run_ns.saturating_sub(a.run_ns) as f64 / 1e9 / w, waited, each));
                            }
                            if k == 0 {
                                // The device's own work alone: the same checksum again, every
                                // page resident now (no fault, no migration; untimed above).
                                let t1 = now();
                                let o = t!(self.s0.checksum(r.addr, n as u64));
                                compute = Some(now() - t1);
                                ensure!(o.faults == 0 && o.result == expect, "link {mark}: resident checksum");
                            }
                            Ok((t, l0, l1))
                        })?;
                        let path = if k < 2 { PATH_H2D } else { PATH_D2H };
                        let moved = |a: &SimLink, b: &SimLink| {
                            (b.bytes[path] - a.bytes[path], b.busy_ns[path] - a.busy_ns[path])
                        };
                        let (bytes, busy) = moved(&l0, &l1);
                        ensure!(bytes >= n as u64, "link {mark}: the link carried {bytes} bytes for {n}");
                        // The model's own accounting: busy time is bytes / bandwidth (no latency set).
                        ensure!(
                            busy == bytes * 1000 / mbps || busy.abs_diff(bytes * 1000 / mbps) <= bytes / PAGE as u64,
                            "link {mark}: {busy} ns busy for {bytes} bytes at {mbps} MB/s"
                        );
                        if timed {
                            let c = &mut cells[v][k];
                            c.push("time_s", t);
                            c.push("bw_mbs", n as f64 / t / 1e6);
                            c.push("ratio", n as f64 / t / 1e6 / mbps as f64);
                            c.push("link_bytes_per_page", bytes as f64 / np as f64);
                            if let Some((busy, waited, each)) = sched {
                                c.push("cpus_busy", busy);
                                c.push("cpu_wait_s", waited);
                                if let Some(x) = each {
                                    c.push("cpu_wait_each_s", x);
                                }
                            }
                            if let Some(tc) = compute {
                                // The run cannot end before the slower of its link time and the
                                // device's own work: the floor of perfect overlap.
                                let floor = (n as f64 / (mbps as f64 * 1e6)).max(tc);
                                c.push("compute_s", tc);
                                c.push("time_over_floor", t / floor);
                            }
                        }
                    }
                }
            }
            Ok(())
        })?;
        let figures = |mut o: Json, cells: &[Cell]| {
            for (c, kind) in cells.iter().zip(kinds) {
                let f = c.stats(&[
                    "time_s",
                    "bw_mbs",
                    "ratio",
                    "link_bytes_per_page",
                    "compute_s",
                    "time_over_floor",
                    "cpus_busy",
                    "cpu_wait_s",
                    "cpu_wait_each_s",
                ]);
                o = o.with(kind, f.with("per_migrated_page", c.work_per_page(np)));
            }
            o
        };
        let head = Json::obj().with("bytes", n).with("link_mbs", mbps).with("paired_baseline_mbs", paired);
        let mut out = figures(head, &cells[0]);
        if let (Some(c), Some(ab)) = (&self.ab, cells.get(1)) {
            out = out.with("ab", figures(Json::obj().with("control", c.as_str()), ab));
        }
        Ok(out)
    }

    /// PS (diagnostic): device faults with two streams at once, over the link model as in
    /// PL (host links at a quarter of the paired copy bandwidth, one path). The device runs
    /// AXPY, `y = 3 x + y`, over two fresh CPU-written regions of half PL's size each (both
    /// fit on the device): each window of the kernel faults in `x`'s pages, then `y`'s, so
    /// read-ahead has a stream in each region. Both regions cross the host-to-device link
    /// once: the floor is PL's bytes / bandwidth, or the device's own work on resident data
    /// (the same AXPY again, untimed above) if slower. The result is checked on the device.
    pub fn streams(&mut self) -> R<Json> {
        let n = self.size / 2;
        let np = n / PAGE;
        let (sx, sy, alpha) = (0x61u32, 0x62u32, 3u32);
        let expect = checksum_of(n / 4, |i| alpha.wrapping_mul(pattern(i, sx)).wrapping_add(pattern(i, sy)));
        let (mbps, paired) = self.link_mbps()?;
        let mut cell = Cell::default();
        self.with_links(mbps, || {
            for rep in 0..self.runs() {
                progress("PS", rep + 1, self.runs(), "AXPY over two regions by device faults, link model");
                let timed = rep >= self.warm;
                sys::restore()?;
                sys::control("multipath=0")?;
                let mut compute = 0.0;
                let (t, l0, l1) = self.counted(&mut cell, timed, || {
                    let x = t!(self.g.alloc(n as u64));
                    let y = t!(self.g.alloc(n as u64));
                    cpu_write(words(&x), sx);
                    cpu_write(words(&y), sy);
                    let l0 = t!(self.s0.link());
                    sys::trace_mark(&format!("GMEM-PS start axpy {rep}"));
                    let t0 = now();
                    t!(self.s0.axpy(x.addr, y.addr, n as u64, alpha));
                    let t = now() - t0;
                    sys::trace_mark(&format!("GMEM-PS end axpy {rep}"));
                    let l1 = t!(self.s0.link());
                    let o = t!(self.s0.checksum(y.addr, n as u64));
                    ensure!(o.result == expect, "PS: y wrong after AXPY on the device");
                    // The device's own work alone: every page resident now.
                    let t1 = now();
                    let o = t!(self.s0.axpy(x.addr, y.addr, n as u64, alpha));
                    compute = now() - t1;
                    ensure!(o.faults == 0, "PS: {} faults on resident data", o.faults);
                    Ok((t, l0, l1))
                })?;
                let bytes = l1.bytes[PATH_H2D] - l0.bytes[PATH_H2D];
                ensure!(bytes >= 2 * n as u64, "PS: the link carried {bytes} bytes for {}", 2 * n);
                if timed {
                    let link_s = 2.0 * n as f64 / (mbps as f64 * 1e6);
                    cell.push("time_s", t);
                    cell.push("ratio", 2.0 * n as f64 / t / 1e6 / mbps as f64);
                    cell.push("link_bytes_per_page", bytes as f64 / (2 * np) as f64);
                    cell.push("compute_s", compute);
                    cell.push("time_over_floor", t / link_s.max(compute));
                }
            }
            Ok(())
        })?;
        let f = cell.stats(&["time_s", "ratio", "link_bytes_per_page", "compute_s", "time_over_floor"]);
        Ok(Json::obj()
            .with("bytes_per_region", n)
            .with("link_mbs", mbps)
            .with("paired_baseline_mbs", paired)
            .with("axpy_device_faults", f.with("per_migrated_page", cell.work_per_page(2 * np))))
    }

    /// P8: host-to-device throughput over two paths at once (sim0's host link, and the route
    /// through the idle sim1: its host link into staging frames, then its peer link at 4x)
    /// against the direct path alone, with the link model on (host links at a sixteenth of
    /// the paired copy bandwidth). Each repetition times an explicit PREFETCH of a fresh,
    /// CPU-written region with `multipath=0` and with `multipath=1`, in alternating order,
    /// checks the data on the device after each, and reads from the links how many bytes each
    /// route carried (every byte crosses exactly one route: checked).
    pub fn p8(&mut self) -> R<Json> {
        let Some(s1) = &self.s1 else {
            return Ok(Json::obj().with("note", "needs two simulated devices"));
        };
        let n = self.size;
        let seed = 0x58;
        let expect = checksum_of(n / 4, |i| pattern(i, seed));
        // A sixteenth of the paired copy baseline (a quarter of PL's link): the simulated
        // engines copy with the guest CPU, and two paths need about 2.5 times one path's copy
        // work (the staged half is copied twice), which at PL's link speed is more than the
        // two vCPUs do in the link's time; here the links, as on real hardware, are the floor.
        let (quarter, paired) = self.link_mbps()?;
        let mbps = (quarter / 4).max(10);
        let names = ["direct", "two_paths"];
        let mut cells: Vec<Cell> = names.iter().map(|_| Cell::default()).collect();
        let mut speedup = Vec::new();
        self.with_links(mbps, || {
            for rep in 0..self.runs() {
                progress("P8", rep + 1, self.runs(), "PREFETCH over one path and over two");
                let timed = rep >= self.warm;
                let mut times = [0.0f64; 2];
                let order = if rep % 2 == 0 { [0, 1] } else { [1, 0] };
                for k in order {
                    sys::restore()?;
                    sys::control(if k == 0 { "multipath=0" } else { "multipath=1" })?;
                    let r = t!(self.g.alloc(n as u64));
                    cpu_write(words(&r), seed);
                    let (a0, b0) = (t!(self.s0.link()), t!(s1.link()));
                    let t0 = now();
                    t!(r.advise(GMEM_ADV_PREFETCH, self.d0));
                    let t = now() - t0;
                    let (a1, b1) = (t!(self.s0.link()), t!(s1.link()));
                    let o = t!(self.s0.checksum(r.addr, n as u64));
                    ensure!(o.result == expect, "P8 {}: device checksum mismatch", names[k]);
                    let on = |x: &SimLink, y: &SimLink, p: usize| y.bytes[p] - x.bytes[p];
                    let (direct, staged, passed) =
                        (on(&a0, &a1, PATH_H2D), on(&b0, &b1, PATH_H2D), on(&b0, &b1, PATH_D2D));
                    ensure!(
                        direct + passed == n as u64 && staged == passed,
                        "P8 {}: {direct} bytes direct, {staged} into the peer, {passed} on from it, for {n}",
                        names[k]
                    );
                    ensure!(k == 1 || passed == 0, "P8 direct: {passed} bytes went through the peer with multipath=0");
                    times[k] = t;
                    if timed {
                        let c = &mut cells[k];
                        c.push("time_s", t);
                        c.push("bw_mbs", n as f64 / t / 1e6);
                        c.push("ratio", n as f64 / t / 1e6 / mbps as f64);
                        c.push("via_peer_share", passed as f64 / n as f64);
                    }
                }
                if timed {
                    speedup.push(times[0] / times[1]);
                }
            }
            Ok(())
        })?;
        let mut out = Json::obj()
            .with("bytes", n)
            .with("link_mbs", mbps)
            .with("peer_link_mbs", mbps * 4)
            .with("paired_baseline_mbs", paired)
            .with("speedup", stat_json(&speedup));
        for (k, name) in names.iter().enumerate() {
            out = out.with(name, cells[k].stats(&["time_s", "bw_mbs", "ratio", "via_peer_share"]));
        }
        Ok(out)
    }

    /// P9: device faults on ordinary process memory (a `Vec`, i.e. musl `malloc`: gmem
    /// mirrors it and the device maps the process's pages remotely, zero copy; with
    /// PREFERRED_LOC of the device on it, the faults migrate the pages into device memory
    /// as device-private pages) against the same on a GMEM region (the pages migrate to
    /// the device). Reads: CHECKSUM of CPU-written data; writes: FILL of untouched memory.
    /// Paired per repetition.
    pub fn p9(&mut self) -> R<Json> {
        let n = self.size;
        let seed = 0x59;
        let expect = checksum_of(n / 4, |i| pattern(i, seed));
        let filled = checksum_of(n / 4, |i| seed.wrapping_add(i as u32));
        let names = ["region_read", "malloc_read", "region_write", "malloc_write", "migrate_read", "migrate_write"];
        let mut cells: Vec<Cell> = names.iter().map(|_| Cell::default()).collect();
        for rep in 0..self.runs() {
            progress("P9", rep + 1, self.runs(), "device faults: malloc'd memory vs a GMEM region");
            let timed = rep >= self.warm;
            let order: [usize; 6] = if rep % 2 == 0 { [0, 1, 4, 2, 3, 5] } else { [4, 1, 0, 5, 3, 2] };
            for k in order {
                sys::restore()?;
                let copies0 = info(&self.s0).copies;
                let (t, o) = match k {
                    0 | 2 => {
                        let r = t!(self.g.alloc(n as u64));
                        if k == 0 {
                            cpu_write(words(&r), seed);
                        }
                        let t0 = now();
                        let o = if k == 0 {
                            t!(self.s0.checksum(r.addr, n as u64))
                        } else {
                            t!(self.s0.fill(r.addr, n as u64, seed))
                        };
                        let t = now() - t0;
                        let sum = if k == 0 { o.result } else { t!(self.s0.checksum(r.addr, n as u64)).result };
                        ensure!(
                            sum == if k == 0 { expect } else { filled },
                            "P9 {}: device checksum mismatch",
                            names[k]
                        );
                        (t, o)
                    }
                    _ => {
                        let read = k == 1 || k == 4;
                        let migrate = k >= 4;
                        let mut v: Vec<u32> =
                            if read { (0..n / 4).map(|i| pattern(i, seed)).collect() } else { vec![0u32; n / 4] };
                        if migrate {
                            t!(self.g.advise(v.as_ptr() as u64, n as u64, GMEM_ADV_PREFERRED_LOC, self.d0, 0));
                        }
                        let t0 = now();
                        let o = if read {
                            t!(self.s0.checksum(v.as_ptr() as u64, n as u64))
                        } else {
                            t!(self.s0.fill(v.as_mut_ptr() as u64, n as u64, seed))
                        };
                        let t = now() - t0;
                        let copied = info(&self.s0).copies - copies0;
                        let sum = if read { o.result } else { checksum_of(n / 4, |i| v[i]) };
                        ensure!(sum == if read { expect } else { filled }, "P9 {}: data mismatch", names[k]);
                        if migrate {
                            // Most of the buffer moved (musl's heap may place its first page
                            // or two in a shared or busy page that stays).
                            ensure!(copied as usize >= n / 4096 / 2, "P9 {}: only {copied} pages migrated", names[k]);
                            t!(self.g.advise(v.as_ptr() as u64, n as u64, GMEM_ADV_UNSET_PREFERRED_LOC, 0, 0));
                        } else {
                            ensure!(copied == 0, "P9 {}: {copied} pages went through the copy engine", names[k]);
                        }
                        (t, o)
                    }
                };
                if timed {
                    let c = &mut cells[k];
                    c.push("time_s", t);
                    c.push("bw_mbs", n as f64 / t / 1e6);
                    c.push("ns_per_page", t * 1e9 / (n / 4096) as f64);
                    c.push("faults", o.faults as f64);
                    c.push("batches", o.batches as f64);
                }
            }
        }
        let mut out = Json::obj().with("bytes", n);
        for (k, name) in names.iter().enumerate() {
            out = out.with(name, cells[k].stats(&["time_s", "bw_mbs", "ns_per_page", "faults", "batches"]));
        }
        let ratio = |a: usize, b: usize| match (cells[a].median("time_s"), cells[b].median("time_s")) {
            (Some(x), Some(y)) if y > 0.0 => Json::from(x / y),
            _ => Json::Null,
        };
        Ok(out
            .with("ratio_read", ratio(0, 1))
            .with("ratio_write", ratio(2, 3))
            .with("ratio_migrate_read", ratio(0, 4))
            .with("ratio_migrate_write", ratio(2, 5))
            .with(
                "what",
                "ratio: time on a GMEM region / time on malloc'd memory, mapped remotely (ratio_read/write) \
                 or migrated by faults under PREFERRED_LOC (ratio_migrate_*); above 1: malloc'd memory is faster",
            ))
    }

    /// The modelled host link bandwidth (MB/s) of the link-model runs: a quarter of the
    /// guest's paired copy bandwidth (median of three, also returned), so that the link
    /// and not the CPU copy is the floor; at least the slowest model the driver accepts.
    /// The copy is bimodal under TCG: a slow sample would make a slow link and flatter
    /// every ratio against it, so the bandwidth is at least the survey's paired median.
    fn link_mbps(&self) -> R<(u64, f64)> {
        let n = self.size;
        let base = self.paired_base()?;
        let mut bws = Vec::new();
        for _ in 0..3 {
            bws.push(n as f64 / base.time()? / 1e6);
        }
        bws.sort_by(f64::total_cmp);
        let bw = bws[1].max(self.survey_paired_mbs.unwrap_or(0.0));
        Ok((self.link_override.unwrap_or(((bw / 4.0) as u64).max(10)), bw))
    }

    /// Runs `f` with the link model at `mbps` (`set_links`), then restores the defaults
    /// and switches the model off, whatever `f` returned.
    fn with_links(&self, mbps: u64, f: impl FnOnce() -> R<()>) -> R<()> {
        self.set_links(mbps)?;
        let run = f();
        sys::restore()?;
        self.set_links(0)?;
        run
    }

    /// Sets the link model of both devices: host links at `mbps`, the peer link at 4x
    /// (faster than the host link, as NVLink is); 0 switches it off.
    fn set_links(&self, mbps: u64) -> R<()> {
        let m = [mbps, mbps, mbps * 4];
        t!(self.s0.set_link(m, 0));
        if let Some(s1) = &self.s1 {
            t!(s1.set_link(m, 0));
        }
        Ok(())
    }

    /// P2: CPU-fault-driven device-to-host migration, paired with the baseline copy.
    pub fn p2(&mut self) -> R<Json> {
        let n = self.size;
        let np = n / PAGE;
        let value = 0x2222u32;
        let mut c = Cell::default();
        let base = self.paired_base()?;
        for rep in 0..self.runs() {
            progress("P2", rep + 1, self.runs(), "baseline copy, CPU reads device-resident pages");
            let timed = rep >= self.warm;
            let tb = base.time()?;
            if timed {
                c.push("baseline_bw", n as f64 / tb / 1e6);
            }
            let run = || -> R<f64> {
                let r = t!(self.g.alloc(n as u64));
                t!(self.s0.fill(r.addr, n as u64, value));
                let t0 = now();
                let bad = touch_pages(r.as_ptr().cast(), np, |p| value.wrapping_add((p * PAGE / 4) as u32));
                let t = now() - t0;
                ensure!(bad == 0, "P2: {bad} pages read wrong values");
                Ok(t)
            };
            let t = self.counted(&mut c, timed, run)?;
            // Diagnostic: the same without CPU fault-around (prefetch=0: one page per fault).
            sys::control("prefetch=0")?;
            let t1 = run();
            sys::control("prefetch=1")?;
            let t1 = t1?;
            if timed {
                c.push("ratio_no_fault_around", tb / t1);
                c.push("time_s", t);
                c.push("bw_mbs", n as f64 / t / 1e6);
                c.push("ratio", tb / t);
                c.push("ns_per_page", t * 1e9 / np as f64);
                if let Some(bw) = self.libc_memcpy_bw {
                    c.push("ratio_vs_libc_memcpy", n as f64 / t / bw);
                }
            }
        }
        Ok(Json::obj()
            .with("bytes", n)
            .with("time_s", c.stat("time_s"))
            .with("bw_mbs", c.stat("bw_mbs"))
            .with("ratio", c.stat("ratio"))
            .with("ratio_no_fault_around", c.stat("ratio_no_fault_around"))
            .with("ratio_vs_libc_memcpy", c.stat("ratio_vs_libc_memcpy"))
            .with("ns_per_page", c.stat("ns_per_page"))
            .with("paired_baseline_mbs", c.stat("baseline_bw"))
            .with("d2h_per_page", c.per_page(get(&c.counters, self.d0 as u32, "migrated.d2h"), np))
            // Includes placing the pages (the device's first-touch zero fill) before the reads.
            .with("per_migrated_page", c.work_per_page(np))
            .with("counters", counters_json(&c.counters)))
    }

    /// One GMEM round trip of P3: PREFETCH to the device, then the CPU reads every page.
    /// `dirty`: the device writes every page in between (untimed), so the way back copies.
    /// Returns (to-device seconds, back seconds).
    fn p3_gmem(&self, np: usize, seed: u32, dirty: bool) -> R<(f64, f64)> {
        let n = np * PAGE;
        let r = t!(self.g.alloc(n as u64));
        cpu_write(words(&r), seed);
        let t0 = now();
        t!(r.advise(GMEM_ADV_PREFETCH, self.d0));
        let t1 = now();
        let value = 0x3333u32;
        if dirty {
            t!(self.s0.fill(r.addr, n as u64, value));
        }
        let t2 = now();
        let bad = if dirty {
            touch_pages(r.as_ptr().cast(), np, |p| value.wrapping_add((p * PAGE / 4) as u32))
        } else {
            touch_pages(r.as_ptr().cast(), np, |p| pattern(p * PAGE / 4, seed))
        };
        let t3 = now();
        ensure!(bad == 0, "P3 gmem (dirty={dirty}): {bad} pages wrong after the round trip");
        Ok((t1 - t0, t3 - t2))
    }

    /// One round trip of P3 on ordinary memory (an anonymous mapping, as `malloc` returns):
    /// PREFETCH migrates it into the device as device-private pages, then the CPU reads
    /// every page (each fault brings its 2 MiB block back). Returns (to, back) seconds.
    fn p3_sysmem(&self, np: usize, seed: u32) -> R<(f64, f64)> {
        let n = np * PAGE;
        let a = Anon::new(n, false)?;
        cpu_write(a.words(), seed);
        let copies0 = info(&self.s0).copies;
        let t0 = now();
        t!(self.g.advise(a.ptr as u64, n as u64, GMEM_ADV_PREFETCH, self.d0, 0));
        let t1 = now();
        let moved = info(&self.s0).copies - copies0;
        let bad = touch_pages(a.ptr.cast(), np, |p| pattern(p * PAGE / 4, seed));
        let t2 = now();
        ensure!(moved == np as u64, "P3 sysmem: {moved} of {np} pages migrated");
        ensure!(bad == 0, "P3 sysmem: {bad} pages wrong after the round trip");
        Ok((t1 - t0, t2 - t1))
    }

    /// One HMM round trip of P3: MIGRATE_TO_DEV, HMM_DMIRROR_READ of the same pages (the
    /// driver's verification copy alone, timed apart), then the CPU reads every page.
    /// Returns (to-device seconds, bounce seconds, back seconds).
    fn p3_hmm(&self, dm: &Dmirror, np: usize, seed: u32) -> R<(f64, f64, f64)> {
        let n = np * PAGE;
        let a = Anon::new(n, false)?;
        let b = Anon::new(n, false)?;
        cpu_write(a.words(), seed);
        b.bytes().fill(0);
        let t0 = now();
        let moved = dm.migrate_to_dev(a.ptr as u64, np as u64, &b)?;
        let t1 = now();
        let read = dm.read(a.ptr as u64, np as u64, &b)?;
        let t2 = now();
        let bad = touch_pages(a.ptr.cast(), np, |p| pattern(p * PAGE / 4, seed));
        let t3 = now();
        ensure!(moved == np as u64, "HMM migrated {moved} of {np} pages");
        ensure!(read == np as u64, "HMM read back {read} of {np} pages");
        ensure!(bad == 0, "HMM: {bad} pages wrong after the round trip");
        ensure!(b.words()[PAGE / 4] == pattern(PAGE / 4, seed), "HMM bounce data wrong");
        Ok((t1 - t0, t2 - t1, t3 - t2))
    }

    /// P3: per-page cost of migrate-to-device plus CPU fault back, GMEM (a region, clean and
    /// dirty, and ordinary anonymous memory through device-private pages) vs HMM's dmirror;
    /// the three round trips alternate within every repetition and ratios are per
    /// repetition.
    pub fn p3(&mut self) -> R<Json> {
        const P3_RATIOS: [&str; 6] = [
            "ratio",
            "ratio_vs_hmm_without_bounce",
            "ratio_dirty",
            "ratio_dirty_vs_hmm_without_bounce",
            "ratio_sysmem",
            "ratio_sysmem_vs_hmm_without_bounce",
        ];
        let np = self.p3_pages;
        let seed = 0x33;
        let ns = |t: f64| t * 1e9 / np as f64;
        let dm = if !std::path::Path::new("/sys/module/test_hmm").exists() {
            Err("test_hmm is not loaded (only the bench guest loads it)".to_string())
        } else {
            Dmirror::open()
        };
        let (mut clean, mut dirty, mut hmm) = (Cell::default(), Cell::default(), Cell::default());
        let mut sysmem = Cell::default();
        let mut ratios = Cell::default();
        for rep in 0..self.runs() {
            progress("P3", rep + 1, self.runs(), "gmem clean, gmem dirty, hmm dmirror round trips");
            let timed = rep >= self.warm;
            let a = self.counted(&mut clean, timed, || self.p3_gmem(np, seed, false))?;
            let b = self.counted(&mut dirty, timed, || self.p3_gmem(np, seed, true))?;
            let m = self.counted(&mut sysmem, timed, || self.p3_sysmem(np, seed))?;
            let h = match &dm {
                Ok(dm) => Some(self.p3_hmm(dm, np, seed)?),
                Err(_) => None,
            };
            if !timed {
                continue;
            }
            for (c, (to, back)) in [(&mut clean, a), (&mut dirty, b), (&mut sysmem, m)] {
                c.push("to", ns(to));
                c.push("back", ns(back));
                c.push("total", ns(to + back));
            }
            if let Some((to, bounce, back)) = h {
                hmm.push("to", ns(to));
                hmm.push("back", ns(back));
                hmm.push("bounce", ns(bounce));
                hmm.push("total", ns(to + back));
                hmm.push("total_without_bounce", ns(to - bounce + back));
                ratios.push("ratio", (a.0 + a.1) / (to + back));
                ratios.push("ratio_vs_hmm_without_bounce", (a.0 + a.1) / (to - bounce + back));
                ratios.push("ratio_dirty", (b.0 + b.1) / (to + back));
                ratios.push("ratio_dirty_vs_hmm_without_bounce", (b.0 + b.1) / (to - bounce + back));
                ratios.push("ratio_sysmem", (m.0 + m.1) / (to + back));
                ratios.push("ratio_sysmem_vs_hmm_without_bounce", (m.0 + m.1) / (to - bounce + back));
            }
        }
        let mut out = Json::obj().with("pages", np);
        for (key, c) in [("gmem", &clean), ("gmem_dirty", &dirty), ("gmem_sysmem", &sysmem)] {
            out.set(
                key,
                Json::obj()
                    .with("ns_per_page", c.stat("total"))
                    .with("to_device_ns_per_page", c.stat("to"))
                    .with("back_ns_per_page", c.stat("back"))
                    .with("h2d_per_page", c.per_page(get(&c.counters, self.d0 as u32, "migrated.h2d"), np))
                    .with("d2h_per_page", c.per_page(get(&c.counters, self.d0 as u32, "migrated.d2h"), np))
                    .with("pages_copied_per_page", c.per_page(c.copies, np))
                    .with("copy_calls_per_page", c.per_page(all_devs(&c.counters, "driver_calls.copy"), np))
                    .with("tlb_flushes_per_page", c.per_page(c.tlb_flushes, np))
                    .with("per_migrated_page", c.work_per_page(np)),
            );
        }
        match dm {
            Ok(_) => {
                out.set(
                    "hmm",
                    Json::obj()
                        .with("device", "/dev/hmm_dmirror0 (device-private ZONE_DEVICE pages, migrate_vma)")
                        .with("ns_per_page", hmm.stat("total"))
                        .with("to_device_ns_per_page", hmm.stat("to"))
                        .with("back_ns_per_page", hmm.stat("back"))
                        .with("bounce_ns_per_page", hmm.stat("bounce"))
                        .with("ns_per_page_without_bounce", hmm.stat("total_without_bounce")),
                );
                out.set("hmm_error", Json::Null);
                for k in P3_RATIOS {
                    out.set(k, ratios.median(k));
                    out.set(&format!("{k}_spread"), ratios.stat(k));
                }
            }
            Err(e) => {
                out.set("hmm", Json::Null);
                out.set("hmm_error", e);
                for k in P3_RATIOS {
                    out.set(k, Json::Null);
                }
            }
        }
        Ok(out)
    }

    /// One P4 streaming run: FILL then CHECKSUM over `bytes` (both device kernels, timed).
    /// With `chunk`, each pass is issued as launches of `chunk` bytes in address order (as
    /// a GPU grid streams through memory) instead of one launch over the whole range.
    fn stream_once(&self, bytes: usize, value: u32, expect: &[u64], chunk: Option<usize>) -> R<f64> {
        let r = t!(self.g.alloc(bytes as u64));
        let t0 = now();
        match chunk {
            None => {
                t!(self.s0.fill(r.addr, bytes as u64, value));
                let o = t!(self.s0.checksum(r.addr, bytes as u64));
                ensure!(
                    o.result == expect[0],
                    "P4 stream {bytes} bytes: checksum mismatch (data lost under oversubscription)"
                );
            }
            Some(c) => {
                for off in (0..bytes).step_by(c) {
                    t!(self.s0.fill(r.addr + off as u64, c as u64, value.wrapping_add((off / 4) as u32)));
                }
                for (k, off) in (0..bytes).step_by(c).enumerate() {
                    let o = t!(self.s0.checksum(r.addr + off as u64, c as u64));
                    ensure!(o.result == expect[k], "P4 chunked stream {bytes} bytes: checksum mismatch at {off}");
                }
            }
        }
        Ok(now() - t0)
    }

    /// One P4 random run: FILL (untimed), then TOUCH `count` random pages (timed).
    fn touch_once(&self, bytes: usize, value: u32, count: u64, seed: u64) -> R<f64> {
        let r = t!(self.g.alloc(bytes as u64));
        t!(self.s0.fill(r.addr, bytes as u64, value));
        let np = (bytes / PAGE) as u64;
        let t0 = now();
        let o = t!(self.s0.touch(r.addr, bytes as u64, count, seed, false));
        let t = now() - t0;
        // The kernel's LCG (gmem_sim.h), to predict the sum of the words it read.
        let mut x = seed | 1;
        let mut sum = 0u64;
        for _ in 0..count {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let p = (x >> 33) % np;
            sum = sum.wrapping_add(u64::from(value.wrapping_add((p as usize * PAGE / 4) as u32)));
        }
        ensure!(o.result == sum, "P4 touch {bytes} bytes: read sum mismatch");
        Ok(t)
    }

    /// P4: oversubscription. Every repetition runs every configuration, factor and kernel
    /// in turn; slowdowns are taken within a repetition (against the same configuration's
    /// 0.5x run of that repetition), then their median is reported.
    pub fn p4(&mut self, configs: &[P4Config], touch_factors: &[f64], touch_count: u64, reps: usize) -> R<Json> {
        let value = 0x4444u32;
        let chunk = 256 * PAGE;
        let mut expect_whole = std::collections::BTreeMap::new();
        let mut expect_chunks = std::collections::BTreeMap::new();
        for c in configs {
            for &f in &c.factors {
                let bytes = round_pages(self.cap as f64 * f);
                expect_whole
                    .entry(bytes)
                    .or_insert_with(|| vec![checksum_of(bytes / 4, |i| value.wrapping_add(i as u32))]);
                expect_chunks.entry(bytes).or_insert_with(|| {
                    (0..bytes)
                        .step_by(chunk)
                        .map(|off| checksum_of(chunk / 4, |i| value.wrapping_add((off / 4 + i) as u32)))
                        .collect::<Vec<u64>>()
                });
            }
        }
        const KINDS: [&str; 3] = ["stream", "stream_chunked", "touch"];
        let factors_of = |c: &P4Config, kind: &str| -> Vec<f64> {
            match kind {
                "touch" if c.touch => touch_factors.to_vec(),
                "touch" => vec![],
                // Under the link model only the whole-range stream is judged.
                "stream_chunked" if c.link => vec![],
                _ => c.factors.clone(),
            }
        };
        let link_mbps = if configs.iter().any(|c| c.link) { Some(self.link_mbps()?) } else { None };
        // cells[config][kind][factor]
        let mut cells: Vec<Vec<Vec<Cell>>> = configs
            .iter()
            .map(|c| KINDS.iter().map(|k| factors_of(c, k).iter().map(|_| Cell::default()).collect()).collect())
            .collect();
        let saved_wm = sys::watermarks(self.d0);
        // With `ab=` (main.rs adds the `_ab` configuration), every other repetition runs
        // the configurations in reverse order, so that neither setting always goes first.
        let ab = self.ab.is_some();
        for rep in 0..reps {
            let mut order: Vec<usize> = (0..configs.len()).collect();
            if ab && rep % 2 == 1 {
                order.reverse();
            }
            for ci in order {
                let c = &configs[ci];
                sys::restore()?;
                sys::control(&c.control)?;
                let mbps = link_mbps.filter(|_| c.link).map(|(m, _)| m);
                self.set_links(mbps.unwrap_or(0))?;
                if let Some((lo, hi)) = c.watermarks {
                    sys::control(&format!("dev={} low={lo} high={hi}", self.d0))?;
                }
                for (ki, kind) in KINDS.iter().enumerate() {
                    let mut base = None;
                    for (fi, f) in factors_of(c, kind).into_iter().enumerate() {
                        let bytes = round_pages(self.cap as f64 * f);
                        progress("P4", rep + 1, reps, &format!("{} {kind} {f}x ({} MiB)", c.name, bytes >> 20));
                        let cell = &mut cells[ci][ki][fi];
                        // Factor in hundredths: the timeline's run names are single words.
                        let mark = format!("{}_{kind}_{:.0} {rep}", c.name, f * 100.0);
                        sys::trace_mark(&format!("GMEM-P4 start {mark}"));
                        let (t, per) = match *kind {
                            "stream" => (
                                self.counted(cell, true, || {
                                    self.stream_once(bytes, value, &expect_whole[&bytes], None)
                                })?,
                                bytes as f64,
                            ),
                            "stream_chunked" => (
                                self.counted(cell, true, || {
                                    self.stream_once(bytes, value, &expect_chunks[&bytes], Some(chunk))
                                })?,
                                bytes as f64,
                            ),
                            _ => (
                                self.counted(cell, true, || {
                                    self.touch_once(bytes, value, touch_count, 7 + rep as u64)
                                })?,
                                touch_count as f64,
                            ),
                        };
                        sys::trace_mark(&format!("GMEM-P4 end {mark}"));
                        // Per byte (or per touch): sizes differ between factors.
                        let u = t * 1e9 / per;
                        cell.push("per_unit", u);
                        let b = *base.get_or_insert(u);
                        cell.push("slowdown", u / b);
                        if let (Some(m), "stream") = (mbps, *kind) {
                            // The floor: this repetition's fits-in-memory time per byte
                            // (the first factor, 0.5x) for the whole region, plus the
                            // mandatory transfers at the modelled bandwidth.
                            let floor = b * bytes as f64 / 1e9
                                + transfer_floor_s(stream_floor_bytes(bytes as u64, self.cap), m);
                            cell.push("floor_s", floor);
                            cell.push("time_over_floor", t / floor);
                        }
                    }
                }
                self.set_links(0)?;
                if let Some((lo, hi)) = saved_wm {
                    sys::control(&format!("dev={} low={lo} high={hi}", self.d0))?;
                }
            }
        }
        sys::restore()?;
        let mut cfgs = vec![];
        for (ci, c) in configs.iter().enumerate() {
            let mut j = Json::obj()
                .with("name", c.name.as_str())
                .with("control", c.control.as_str())
                .with("diagnostic", c.diagnostic);
            if let Some((lo, hi)) = c.watermarks {
                j.set("watermarks", Json::obj().with("low", lo).with("high", hi));
            }
            for (ki, kind) in KINDS.iter().enumerate() {
                let rows: Vec<Json> = factors_of(c, kind)
                    .into_iter()
                    .enumerate()
                    .map(|(fi, f)| {
                        let cell = &cells[ci][ki][fi];
                        let bytes = round_pages(self.cap as f64 * f);
                        let pages = bytes / PAGE;
                        let mut r = Json::obj()
                            .with("factor", f)
                            .with("bytes", bytes)
                            .with("runs", cell.runs)
                            .with("per_unit", cell.stat("per_unit"))
                            .with("slowdown", cell.median("slowdown"))
                            .with("slowdown_spread", cell.stat("slowdown"))
                            .with("dev0", overcommit_summary(&cell.counters, self.d0 as u32))
                            .with("copies_per_page", cell.per_page(cell.copies, pages))
                            .with("transfers_per_page", cell.per_page(transfers(&cell.counters), pages))
                            .with(
                                "copy_calls_per_page",
                                cell.per_page(all_devs(&cell.counters, "driver_calls.copy"), pages),
                            )
                            .with("tlb_flushes_per_page", cell.per_page(cell.tlb_flushes, pages))
                            .with("per_migrated_page", cell.work_per_page(pages))
                            .with_opt("floor_s", c.link.then(|| cell.stat("floor_s")))
                            .with_opt("time_over_floor", c.link.then(|| cell.median("time_over_floor")))
                            .with("counters", counters_json(&cell.counters));
                        if *kind == "touch" {
                            r.set("touches", touch_count);
                        }
                        r
                    })
                    .collect();
                j.set(kind, Json::Array(rows));
            }
            cfgs.push(j);
        }
        Ok(Json::obj()
            .with("capacity_bytes", self.cap)
            .with_opt("link_mbs", link_mbps.map(|(m, _)| m))
            .with("floor", "link configurations: the 0.5x run's time per byte (same repetition) times the region, plus max(write-back bytes, fetch bytes) / link bandwidth, those bytes being the overflow plus min(capacity, overflow) each way (no peer tier)")
            .with("stream_kernel", "FILL then CHECKSUM over a fresh region, each one launch over the whole range (both timed); time per byte of the region")
            .with("stream_chunked_kernel", "the same two passes issued as 1 MiB launches in address order; time per byte of the region")
            .with("touch_kernel", "FILL (untimed), then TOUCH reads of uniformly random pages (timed); time per touch")
            .with("configs", Json::Array(cfgs)))
    }

    /// P5: metadata bytes per page of a large region, untouched (lazy metadata: only the
    /// block directory exists), and per page of its touched part (16 MiB written by the
    /// CPU, 1 MiB of it prefetched to the device and back).
    pub fn p5(&mut self, bytes: u64) -> R<Json> {
        progress("P5", 1, 1, &format!("metadata of a {} MiB region", bytes >> 20));
        let r = t!(self.g.alloc(bytes));
        let np = (bytes / PAGE as u64).to_string();
        let meta = || -> R<u64> {
            let lines = sys::spaces();
            let line =
                lines.iter().find(|l| l.get("pages") == Some(&np) && l.get("regions").map(String::as_str) == Some("1"));
            let Some(l) = line else {
                return Err(format!("no space line with regions=1 pages={np} in /sys/kernel/debug/gmem/spaces"));
            };
            l.get("metadata_bytes").and_then(|v| v.parse().ok()).ok_or_else(|| "no metadata_bytes".to_string())
        };
        let untouched = meta()?;
        let touched_len = (16usize << 20).min(bytes as usize);
        cpu_write(&mut words(&r)[..touched_len / 4], 5);
        let small = (1usize << 20).min(touched_len) as u64;
        t!(self.g.advise(r.addr, small, GMEM_ADV_PREFETCH, self.d0, 0));
        t!(self.g.advise(r.addr, small, GMEM_ADV_PREFETCH, GMEM_HOST, 0));
        let touched = meta()?;
        drop(r);
        let pages = bytes / PAGE as u64;
        let tpages = (touched_len / PAGE) as u64;
        Ok(Json::obj()
            .with("region_bytes", bytes)
            .with("pages", pages)
            .with("metadata_bytes_untouched", untouched)
            .with("bytes_per_untouched_page", untouched as f64 / pages as f64)
            .with("touched_bytes", touched_len)
            .with("metadata_bytes_touched", touched)
            .with("bytes_per_touched_page", touched.saturating_sub(untouched) as f64 / tpages as f64)
            .with("source", "/sys/kernel/debug/gmem/spaces metadata_bytes="))
    }

    /// P6: two processes streaming over their own regions (device faults) at once, vs one;
    /// and the same for plain CPU copies, the platform's own scaling on this host. Ratios
    /// are taken within each repetition.
    pub fn p6(&mut self, bytes: usize) -> R<Json> {
        let mut out = Json::obj().with("bytes_per_process", bytes).with(
            "kernel",
            "each process: CPU writes its region (untimed), then device CHECKSUM over it (H2D faults); wall time from a common start",
        );
        let two_devs = self.s1.is_some();
        let mut c = Cell::default();
        let cpu_passes = 4;
        for rep in 0..self.runs() {
            progress("P6", rep + 1, self.runs(), "1 vs 2 processes: on dev0, on dev0+dev1, CPU copies only");
            let a = run_procs(&[Work::Device(0)], bytes, rep as u32)?;
            let b = run_procs(&[Work::Device(0), Work::Device(0)], bytes, rep as u32)?;
            let s =
                if two_devs { Some(run_procs(&[Work::Device(0), Work::Device(1)], bytes, rep as u32)?) } else { None };
            let x = run_procs(&[Work::Cpu(cpu_passes)], bytes, rep as u32)?;
            let y = run_procs(&[Work::Cpu(cpu_passes), Work::Cpu(cpu_passes)], bytes, rep as u32)?;
            if rep >= self.warm {
                c.push("single", bytes as f64 / a / 1e6);
                c.push("same", 2.0 * bytes as f64 / b / 1e6);
                c.push("ratio_same", 2.0 * a / b);
                if let Some(s) = s {
                    c.push("split", 2.0 * bytes as f64 / s / 1e6);
                    c.push("ratio_split", 2.0 * a / s);
                }
                c.push("cpu1", (cpu_passes * bytes) as f64 / x / 1e6);
                c.push("cpu2", (2 * cpu_passes * bytes) as f64 / y / 1e6);
                c.push("ratio_cpu", 2.0 * x / y);
            }
        }
        out.set("single_mbs", c.stat("single"));
        out.set("two_same_device_mbs", c.stat("same"));
        out.set("two_devices_mbs", c.stat("split"));
        out.set("ratio_same_device", c.median("ratio_same"));
        out.set("ratio_same_device_spread", c.stat("ratio_same"));
        out.set("ratio_two_devices", c.median("ratio_split"));
        out.set("ratio_two_devices_spread", c.stat("ratio_split"));
        out.set("cpu_copy_single_mbs", c.stat("cpu1"));
        out.set("cpu_copy_two_mbs", c.stat("cpu2"));
        out.set("ratio_cpu_copy", c.median("ratio_cpu"));
        out.set("ratio_cpu_copy_spread", c.stat("ratio_cpu"));
        Ok(out)
    }
}

impl Bench {
    /// P7: one region of `2 * half` bytes (CPU-written, so every page faults from the
    /// host), device CHECKSUM over both halves: by one thread, one half after the other,
    /// vs two threads of this process, one half each, at once (both on device 0, or one on
    /// each device). Faults on different 2 MiB blocks of one region run in parallel only
    /// with per-block locks. Wall times; each repetition's ratio taken within it.
    pub fn p7(&mut self, half: usize) -> R<Json> {
        let two_devs = self.s1.is_some();
        let mut c = Cell::default();
        for rep in 0..self.runs() {
            progress("P7", rep + 1, self.runs(), "1 vs 2 threads faulting one region: dev0, dev0+dev1");
            let one = self.p7_run(half, &[0, 0], false, rep as u32)?;
            let same = self.p7_run(half, &[0, 0], true, rep as u32)?;
            let split = if two_devs { Some(self.p7_run(half, &[0, 1], true, rep as u32)?) } else { None };
            if rep >= self.warm {
                c.push("one_s", one);
                c.push("ratio_same", one / same);
                if let Some(t) = split {
                    c.push("ratio_split", one / t);
                }
            }
        }
        Ok(Json::obj()
            .with("bytes_per_half", half)
            .with("kernel", "region CPU-written (untimed), then device CHECKSUM of each half (H2D faults)")
            .with("one_thread_s", c.stat("one_s"))
            .with("ratio_same_device", c.median("ratio_same"))
            .with("ratio_same_device_spread", c.stat("ratio_same"))
            .with("ratio_two_devices", c.median("ratio_split"))
            .with("ratio_two_devices_spread", c.stat("ratio_split")))
    }

    /// One P7 measurement: halves on devices `devs[0]`, `devs[1]`; `parallel`: two threads.
    fn p7_run(&self, half: usize, devs: &[usize; 2], parallel: bool, seed: u32) -> R<f64> {
        let r = t!(self.g.alloc(2 * half as u64));
        cpu_write(words(&r), seed);
        let base = r.addr;
        let sims = [
            t!(Sim::open(devs[0]).map_err(libgmem::Errno::from)),
            t!(Sim::open(devs[1]).map_err(libgmem::Errno::from)),
        ];
        let half_sum = |k: usize| -> R<()> {
            t!(sims[k].checksum(base + (k * half) as u64, half as u64));
            Ok(())
        };
        let t0 = now();
        if parallel {
            let res: Vec<R<()>> = std::thread::scope(|sc| {
                let hs: Vec<_> = (0..2).map(|k| sc.spawn(move || half_sum(k))).collect();
                hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("P7 thread panicked".into()))).collect()
            });
            for x in res {
                x?;
            }
        } else {
            half_sum(0)?;
            half_sum(1)?;
        }
        Ok(now() - t0)
    }
}

fn bw_stat(bytes: usize, times: &[f64]) -> Json {
    stat_json(&times.iter().map(|t| bytes as f64 / t / 1e6).collect::<Vec<_>>())
}

/// What a P6 process does once started.
#[derive(Clone, Copy)]
enum Work {
    /// Device CHECKSUM over its CPU-written region on sim device N.
    Device(usize),
    /// N copy passes between two populated buffers of its own (no GMEM at all).
    Cpu(usize),
}

/// Forks one process per entry of `work`; each prepares its region, waits for a common
/// start, runs, and reports. Returns the wall time from the start to the last report.
fn run_procs(work: &[Work], bytes: usize, seed: u32) -> R<f64> {
    let mut kids = vec![];
    let pipe = || -> R<[i32; 2]> {
        let mut fds = [0i32; 2];
        // SAFETY: pipe(2) fills two descriptors.
        if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
            return Err("pipe failed".into());
        }
        Ok(fds)
    };
    for (k, &w) in work.iter().enumerate() {
        let (go, done) = (pipe()?, pipe()?);
        // SAFETY: fork; the child only runs `worker` and exits with _exit.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            return Err("fork failed".into());
        }
        if pid == 0 {
            // SAFETY: the child's ends.
            unsafe {
                libc::close(go[1]);
                libc::close(done[0]);
            }
            let code = worker(w, bytes, seed.wrapping_add(k as u32 * 7919), go[0], done[1]);
            // SAFETY: leave without running the parent's destructors.
            unsafe { libc::_exit(code) };
        }
        // SAFETY: the parent's ends.
        unsafe {
            libc::close(go[0]);
            libc::close(done[1]);
        }
        kids.push((pid, go[1], done[0]));
    }
    let read_byte = |fd: i32| -> u8 {
        let mut b = [0u8; 1];
        // SAFETY: one byte into a local buffer.
        let n = unsafe { libc::read(fd, b.as_mut_ptr().cast(), 1) };
        if n == 1 {
            b[0]
        } else {
            b'x'
        }
    };
    let mut ok = true;
    for &(_, _, done) in &kids {
        ok &= read_byte(done) == b'r';
    }
    let t0 = now();
    for &(_, go, _) in &kids {
        // SAFETY: one byte from a local buffer.
        unsafe { libc::write(go, b"g".as_ptr().cast(), 1) };
    }
    for &(_, _, done) in &kids {
        ok &= read_byte(done) == b'k';
    }
    let t = now() - t0;
    let mut codes = vec![];
    for (pid, go, done) in kids {
        let mut st = 0;
        // SAFETY: our own child and descriptors.
        unsafe {
            libc::close(go);
            libc::close(done);
            libc::waitpid(pid, &mut st, 0);
        }
        if !(libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 0) {
            codes.push(st);
        }
    }
    if !ok || !codes.is_empty() {
        return Err(format!("P6 worker failed (statuses {codes:?})"));
    }
    Ok(t)
}

/// A P6 process: 'r' when ready, waits for 'g', runs, 'k' when done and correct.
fn worker(w: Work, bytes: usize, seed: u32, go: i32, done: i32) -> i32 {
    let say = |c: u8| {
        // SAFETY: one byte from a local buffer.
        unsafe { libc::write(done, [c].as_ptr().cast(), 1) };
    };
    let wait_go = || -> R<()> {
        let mut b = [0u8; 1];
        // SAFETY: one byte into a local buffer.
        if unsafe { libc::read(go, b.as_mut_ptr().cast(), 1) } != 1 {
            return Err("no start".into());
        }
        Ok(())
    };
    let run = || -> R<()> {
        match w {
            Work::Device(dev) => {
                let g = Gmem::open().map_err(|e| e.to_string())?;
                let s = Sim::open(dev).map_err(|e| e.to_string())?;
                let r = t!(g.alloc(bytes as u64));
                cpu_write(words(&r), seed);
                let expect = checksum(words(&r));
                say(b'r');
                wait_go()?;
                let o = t!(s.checksum(r.addr, bytes as u64));
                ensure!(o.result == expect, "checksum mismatch");
            }
            Work::Cpu(passes) => {
                let (a, b) = (Anon::new(bytes, false)?, Anon::new(bytes, false)?);
                cpu_write(a.words(), seed);
                b.bytes().fill(1);
                say(b'r');
                wait_go()?;
                for _ in 0..passes {
                    // SAFETY: two distinct mappings of `bytes` bytes. The SSE2 loop: its
                    // speed on TCG is the steadiest of the copy styles.
                    unsafe { copy(2, a.ptr, b.ptr, bytes) };
                    sys::keep(b.ptr);
                }
                ensure!(b.words()[7] == pattern(7, seed), "copy wrong");
            }
        }
        Ok(())
    };
    match run() {
        Ok(()) => {
            say(b'k');
            0
        }
        Err(e) => {
            eprintln!("GMEM-BENCH P6 worker: {e}");
            say(b'x');
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_floor_is_one_write_back_and_one_fetch_per_page_at_2x() {
        let c = 16 << 20;
        // Fits: nothing to move.
        assert_eq!(stream_floor_bytes(c / 2, c), (0, 0));
        assert_eq!(stream_floor_bytes(c, c), (0, 0));
        // 1.5x: the overflow once each way, plus re-fetching what had to make room.
        assert_eq!(stream_floor_bytes(c * 3 / 2, c), (c, c));
        // 2x: every page written back once and fetched once.
        assert_eq!(stream_floor_bytes(2 * c, c), (2 * c, 2 * c));
        assert_eq!(stream_floor_bytes(4 * c, c), (4 * c, 4 * c));
        // 1 MB at 100 MB/s on both paths at once: 10 ms, not 20.
        assert!((transfer_floor_s((1_000_000, 1_000_000), 100) - 0.01).abs() < 1e-12);
    }
}
