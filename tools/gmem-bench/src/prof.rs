// SPDX-License-Identifier: GPL-2.0
//! A sampling CPU profile of chosen benchmark runs (`prof=NAME`): where the guest's CPUs
//! spend the time of every run whose trace mark (`GMEM-PL start KIND REP`, `GMEM-P4 start
//! NAME REP`) contains NAME, summed over those runs.
//!
//! One `perf_event_open` cpu-clock event per CPU, system-wide, kernel only, sampling the
//! instruction pointer, the task and the kernel call chain every `PERIOD_NS` of CPU time
//! (idle included: its samples are the idle task's). The events are enabled at a run's
//! start mark and disabled at its end mark, and their ring buffers are read then, outside
//! the timed span (each holds a whole run: `RING_PAGES`; a `LOST` record is counted). At
//! the end, `report` prints the samples resolved against `/proc/kallsyms`:
//! `GMEM-PROF self` lines, per symbol and task (trailing `:N`/`/N` of kworker names cut),
//! `GMEM-PROF incl` lines (the time of each of gmem's and the simulated driver's functions
//! with everything it called, from the call chains), and `GMEM-PROF spin` lines: for
//! samples in a lock's spin or slow path, the first frame of the call chain outside the
//! locking code. The guest kernel unwinds by guessing, so call chains can hold stale
//! addresses: a spin's first frame is usually, not always, the caller (the next ones tell
//! which), and an inclusive time can count a function that was not on the stack (an upper
//! bound).
//!
//! Diagnostics only: sampling costs guest CPU (under TCG, about 1 % at 4 kHz), so never
//! read timings of a profiled run as results.

use std::collections::HashMap;
use std::sync::Mutex;

/// Sampling period: 250 us of CPU time (4 kHz per CPU).
const PERIOD_NS: u64 = 250_000;
/// Data pages of each ring buffer (a power of two): 4 MiB, a 2 s run at 2 kB per sample.
const RING_PAGES: usize = 1024;
const PAGE: usize = 4096;
/// Frames of a spin's call chain shown (the first outside the locking code and the next).
const CALLERS: usize = 3;

/// `struct perf_event_attr` up to `PERF_ATTR_SIZE_VER1` (72 bytes; the kernel takes older
/// sizes and zero-extends them).
#[repr(C)]
#[derive(Default)]
struct Attr {
    type_: u32,
    size: u32,
    config: u64,
    sample_period: u64,
    sample_type: u64,
    read_format: u64,
    flags: u64,
    wakeup_events: u32,
    bp_type: u32,
    config1: u64,
    config2: u64,
}

const PERF_TYPE_SOFTWARE: u32 = 1;
const PERF_COUNT_SW_CPU_CLOCK: u64 = 0;
const SAMPLE_IP: u64 = 1;
const SAMPLE_TID: u64 = 2;
const SAMPLE_CALLCHAIN: u64 = 1 << 5;
const FLAG_DISABLED: u64 = 1;
const FLAG_EXCLUDE_USER: u64 = 1 << 4;
const FLAG_EXCLUDE_HV: u64 = 1 << 6;
const IOC_ENABLE: libc::Ioctl = 0x2400;
const IOC_DISABLE: libc::Ioctl = 0x2401;
const RECORD_LOST: u32 = 2;
const RECORD_SAMPLE: u32 = 9;
/// Call-chain entries at or above this are context markers, not addresses.
const CONTEXT_MAX: u64 = (-4095i64) as u64;
/// Offsets of `data_head` and `data_tail` in `struct perf_event_mmap_page`.
const DATA_HEAD: usize = 1024;
const DATA_TAIL: usize = 1032;

struct Ring {
    fd: i32,
    base: *mut u8,
}

// SAFETY: the mapping is only touched under `STATE`'s lock.
unsafe impl Send for Ring {}

struct Sample {
    ip: u64,
    tid: u32,
    chain: Vec<u64>,
}

struct State {
    filter: String,
    rings: Vec<Ring>,
    on: bool,
    samples: Vec<Sample>,
    lost: u64,
    runs: u64,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

/// Profiles the runs whose mark contains `filter`; a message on stderr if the events
/// cannot be opened (no profile then; the benchmarks run as usual).
pub fn init(filter: &str) {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut rings = Vec::new();
    for cpu in 0..cpus {
        let attr = Attr {
            type_: PERF_TYPE_SOFTWARE,
            size: std::mem::size_of::<Attr>() as u32,
            config: PERF_COUNT_SW_CPU_CLOCK,
            sample_period: PERIOD_NS,
            sample_type: SAMPLE_IP | SAMPLE_TID | SAMPLE_CALLCHAIN,
            flags: FLAG_DISABLED | FLAG_EXCLUDE_USER | FLAG_EXCLUDE_HV,
            ..Default::default()
        };
        // SAFETY: perf_event_open reads `attr` (its size is in it); every CPU (pid -1).
        let fd = unsafe { libc::syscall(libc::SYS_perf_event_open, &attr as *const Attr, -1, cpu as i32, -1, 0) };
        if fd < 0 {
            eprintln!("GMEM-PROF perf_event_open cpu {cpu}: {}", std::io::Error::last_os_error());
            return;
        }
        let len = (RING_PAGES + 1) * PAGE;
        // SAFETY: a shared read-write mapping of the event's ring (metadata page + data).
        let base = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd as i32, 0)
        };
        if base == libc::MAP_FAILED {
            eprintln!("GMEM-PROF mmap cpu {cpu}: {}", std::io::Error::last_os_error());
            return;
        }
        rings.push(Ring { fd: fd as i32, base: base.cast() });
    }
    *STATE.lock().unwrap_or_else(|e| e.into_inner()) =
        Some(State { filter: filter.to_string(), rings, on: false, samples: Vec::new(), lost: 0, runs: 0 });
}

/// Follows a trace mark: `... start NAME REP` enables sampling if NAME matches, `... end`
/// disables it and reads the rings.
pub fn mark(msg: &str) {
    let mut g = STATE.lock().unwrap_or_else(|e| e.into_inner());
    let Some(st) = g.as_mut() else { return };
    let mut words = msg.split_whitespace().skip(1);
    match (words.next(), words.next()) {
        (Some("start"), Some(name)) if name.contains(st.filter.as_str()) && !st.on => {
            st.on = true;
            st.runs += 1;
            for r in &st.rings {
                // SAFETY: an ioctl without argument on our own event.
                unsafe { libc::ioctl(r.fd, IOC_ENABLE, 0) };
            }
        }
        (Some("end"), _) if st.on => {
            st.on = false;
            for r in &st.rings {
                // SAFETY: as above.
                unsafe { libc::ioctl(r.fd, IOC_DISABLE, 0) };
            }
            for k in 0..st.rings.len() {
                let (samples, lost) = drain(&st.rings[k]);
                st.samples.extend(samples);
                st.lost += lost;
            }
        }
        _ => {}
    }
}

/// Reads every record of a ring and frees its space.
fn drain(r: &Ring) -> (Vec<Sample>, u64) {
    let size = RING_PAGES * PAGE;
    // SAFETY: `base` maps the metadata page and `size` bytes of data after it; the kernel
    // publishes `data_head` after the records (hence the acquire fence), we hand space back
    // through `data_tail`.
    let (head, tail) = unsafe {
        let head = std::ptr::read_volatile(r.base.add(DATA_HEAD) as *const u64);
        std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
        (head, std::ptr::read_volatile(r.base.add(DATA_TAIL) as *const u64))
    };
    // SAFETY: the data area, `size` bytes after the metadata page.
    let data = unsafe { std::slice::from_raw_parts(r.base.add(PAGE), size) };
    let byte = |at: u64| data[(at % size as u64) as usize];
    let word = |at: u64| u64::from_le_bytes(std::array::from_fn(|k| byte(at + k as u64)));
    let (mut out, mut lost, mut at) = (Vec::new(), 0, tail);
    while at + 8 <= head {
        let hdr = word(at);
        let (ty, len) = (hdr as u32, hdr >> 48);
        if len < 8 || at + len > head {
            break;
        }
        match ty {
            RECORD_SAMPLE if len >= 32 => {
                let ip = word(at + 8);
                let tid = (word(at + 16) >> 32) as u32;
                let nr = word(at + 24).min((len - 32) / 8);
                let chain = (0..nr).map(|k| word(at + 32 + 8 * k)).filter(|&a| a < CONTEXT_MAX).collect();
                out.push(Sample { ip, tid, chain });
            }
            RECORD_LOST if len >= 24 => lost += word(at + 16),
            _ => {}
        }
        at += len;
    }
    std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
    // SAFETY: as above; everything up to `head` was read.
    unsafe { std::ptr::write_volatile(r.base.add(DATA_TAIL) as *mut u64, head) };
    (out, lost)
}

/// Kernel text symbols, sorted by address.
fn kallsyms() -> Vec<(u64, String)> {
    let text = std::fs::read_to_string("/proc/kallsyms").unwrap_or_default();
    let mut v: Vec<(u64, String)> = text
        .lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            let addr = u64::from_str_radix(it.next()?, 16).ok()?;
            let kind = it.next()?;
            let name = it.next()?;
            matches!(kind, "t" | "T").then(|| (addr, demangle(name)))
        })
        .collect();
    v.sort();
    v
}

/// A Rust v0 symbol as the path of its identifiers (`gmem::mech::evict::pass`); other
/// names as they are.
fn demangle(name: &str) -> String {
    let Some(rest) = name.strip_prefix("_R") else { return name.to_string() };
    let b = rest.as_bytes();
    let (mut parts, mut k) = (Vec::new(), 0);
    while k < b.len() {
        if b[k].is_ascii_digit() && (k == 0 || !b[k - 1].is_ascii_digit()) {
            let start = k;
            while k < b.len() && b[k].is_ascii_digit() {
                k += 1;
            }
            let n: usize = rest[start..k].parse().unwrap_or(0);
            // `_` separates a length from an identifier starting with a digit or `_`.
            let from = if b.get(k) == Some(&b'_') { k + 1 } else { k };
            if n > 0 && from + n <= b.len() {
                let id = &rest[from..from + n];
                if id.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_') && !id.starts_with('_') {
                    parts.push(id);
                    k = from + n;
                    continue;
                }
            }
        } else {
            k += 1;
        }
    }
    // The crate's disambiguated name comes first (`Cs<hash>_4gmem`): keep what follows it.
    if parts.is_empty() {
        name.to_string()
    } else {
        parts.join("::")
    }
}

fn symbol(syms: &[(u64, String)], ip: u64) -> &str {
    match syms.partition_point(|(a, _)| *a <= ip) {
        0 => "?",
        i => &syms[i - 1].1,
    }
}

/// A task's name without its instance number (`kworker/u8:5` -> `kworker/u8`).
fn task(tid: u32, names: &mut HashMap<u32, String>) -> String {
    names
        .entry(tid)
        .or_insert_with(|| {
            if tid == 0 {
                return "idle".to_string();
            }
            let n = std::fs::read_to_string(format!("/proc/{tid}/comm")).unwrap_or_else(|_| "?".to_string());
            let n = n.trim();
            // A kworker's name also tells its last workqueue (`kworker/u8:5+gmem`).
            match n.split_once(':') {
                Some((k, _)) if n.starts_with("kworker") => k.to_string(),
                _ => n.trim_end_matches(|c: char| c.is_ascii_digit()).trim_end_matches('/').to_string(),
            }
        })
        .clone()
}

/// Whether a symbol is locking code (a spin, a slow path, or a lock's entry).
fn locking(s: &str) -> bool {
    ["spin_on_owner", "osq_lock", "queued_spin_lock_slowpath", "mutex_lock", "__mutex_lock", "_raw_spin_lock"]
        .iter()
        .any(|k| s.contains(k))
}

/// Prints the profile (nothing unless `init` succeeded).
pub fn report() {
    let g = STATE.lock().unwrap_or_else(|e| e.into_inner());
    let Some(st) = g.as_ref() else { return };
    let syms = kallsyms();
    let mut names = HashMap::new();
    let mut by_task: HashMap<String, u64> = HashMap::new();
    let mut selfs: HashMap<(String, String), u64> = HashMap::new();
    let mut spins: HashMap<(String, String, String), u64> = HashMap::new();
    let mut incl: HashMap<(String, String), u64> = HashMap::new();
    for s in &st.samples {
        let t = task(s.tid, &mut names);
        // Inclusive time of gmem's and the simulated driver's functions: every distinct one
        // on the sample's stack, once.
        let mut seen: Vec<&str> = Vec::new();
        for f in core::iter::once(s.ip).chain(s.chain.iter().skip(1).copied()).map(|a| symbol(&syms, a)) {
            if f.contains("gmem") && !seen.contains(&f) {
                seen.push(f);
                *incl.entry((t.clone(), f.to_string())).or_default() += 1;
            }
        }
        *by_task.entry(t.clone()).or_default() += 1;
        let sym = symbol(&syms, s.ip).to_string();
        if locking(&sym) {
            // The first few distinct frames outside the locking code.
            let mut callers: Vec<&str> = Vec::new();
            for c in s.chain.iter().skip(1).map(|&a| symbol(&syms, a)).filter(|c| !locking(c)) {
                if callers.len() == CALLERS {
                    break;
                }
                if !callers.contains(&c) {
                    callers.push(c);
                }
            }
            let caller = if callers.is_empty() { "?".to_string() } else { callers.join(" < ") };
            *spins.entry((t.clone(), sym.clone(), caller)).or_default() += 1;
        }
        *selfs.entry((t, sym)).or_default() += 1;
    }
    let total = st.samples.len() as u64;
    let ms = |n: u64| n as f64 * PERIOD_NS as f64 / 1e6 / st.runs.max(1) as f64;
    println!(
        "GMEM-PROF filter={} runs={} samples={} lost={} period_us={} (ms below: CPU time per run)",
        st.filter,
        st.runs,
        total,
        st.lost,
        PERIOD_NS / 1000
    );
    let mut tasks: Vec<_> = by_task.into_iter().collect();
    tasks.sort_by_key(|b| std::cmp::Reverse(b.1));
    for (t, n) in &tasks {
        println!("GMEM-PROF task {:8.1} ms  {t}", ms(*n));
    }
    let mut v: Vec<_> = selfs.into_iter().collect();
    v.sort_by_key(|b| std::cmp::Reverse(b.1));
    for ((t, sym), n) in v.iter().take(60) {
        println!("GMEM-PROF self {:8.1} ms  {t:14} {sym}", ms(*n));
    }
    let mut v: Vec<_> = incl.into_iter().collect();
    v.sort_by_key(|b| std::cmp::Reverse(b.1));
    for ((t, sym), n) in v.iter().take(50) {
        println!("GMEM-PROF incl {:8.1} ms  {t:14} {sym}", ms(*n));
    }
    let mut v: Vec<_> = spins.into_iter().collect();
    v.sort_by_key(|b| std::cmp::Reverse(b.1));
    for ((t, sym, caller), n) in v.iter().take(30) {
        println!("GMEM-PROF spin {:8.1} ms  {t:14} {sym} <- {caller}", ms(*n));
    }
}
