// SPDX-License-Identifier: GPL-2.0
//! Measurement plumbing: the monotonic clock, median/min/max, GMEM's debugfs (control,
//! per-device counters, per-space metadata), and the kernel's HMM test driver
//! (`lib/test_hmm_uapi.h`, structs defined here from the header's description).

use crate::json::{Json, JsonExt};
use std::collections::BTreeMap;

/// Seconds on CLOCK_MONOTONIC.
pub fn now() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Median with its spread over the repetitions.
#[derive(Clone, Copy, Debug)]
pub struct Stat {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub n: usize,
}

impl Stat {
    pub fn of(v: &[f64]) -> Option<Stat> {
        let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
        if s.is_empty() {
            return None;
        }
        s.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let n = s.len();
        let median = if n % 2 == 1 { s[n / 2] } else { (s[n / 2 - 1] + s[n / 2]) / 2.0 };
        Some(Stat { median, min: s[0], max: s[n - 1], n })
    }

    pub fn json(&self) -> Json {
        Json::obj().with("median", self.median).with("min", self.min).with("max", self.max).with("n", self.n)
    }
}

/// `Stat::of(v)` as JSON (null when nothing was measured).
pub fn stat_json(v: &[f64]) -> Json {
    Stat::of(v).map_or(Json::Null, |s| s.json())
}

/// Writes `msg` into the ftrace buffer (`trace_marker`) when the guest traces the run
/// (`make bench BENCH_TRACE=1`); nothing otherwise. Also starts and stops the profile of
/// `prof=NAME` (prof.rs). Call it outside timed spans.
pub fn trace_mark(msg: &str) {
    let _ = std::fs::write("/sys/kernel/tracing/trace_marker", msg);
    crate::prof::mark(msg);
}

/// The scheduler's totals over every CPU, from `/proc/schedstat` (the guest kernel has
/// `CONFIG_SCHEDSTATS`): nanoseconds tasks other than idle ran, nanoseconds runnable
/// tasks waited for a CPU, and how many times a task got a CPU. The kernel adds a task's
/// run time when it leaves its CPU, so a difference over a short window is off by what
/// the tasks running at either end had run since they last got their CPU.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SchedTotals {
    pub run_ns: u64,
    pub wait_ns: u64,
    pub arrivals: u64,
}

pub fn sched_totals() -> Option<SchedTotals> {
    parse_schedstat(&std::fs::read_to_string("/proc/schedstat").ok()?)
}

/// [`sched_totals`] after a 1 ms sleep, which makes the calling thread leave its CPU and
/// so brings its own run time into the totals.
pub fn settled_sched_totals() -> Option<SchedTotals> {
    std::thread::sleep(std::time::Duration::from_millis(1));
    sched_totals()
}

/// Sums the `cpuN` lines of a `/proc/schedstat` text (version 17: after the name come
/// yld_count, 0, sched_count, sched_goidle, ttwu_count, ttwu_local, rq_cpu_time,
/// run_delay, pcount). `None` for another version or no CPU line.
fn parse_schedstat(text: &str) -> Option<SchedTotals> {
    let mut lines = text.lines();
    if lines.next()?.trim() != "version 17" {
        return None;
    }
    let mut t = SchedTotals::default();
    let mut cpus = 0;
    for l in lines {
        let mut w = l.split_whitespace();
        if !w.next().is_some_and(|n| n.starts_with("cpu")) {
            continue;
        }
        let f: Vec<u64> = w.map(str::parse).collect::<Result<_, _>>().ok()?;
        t.run_ns = t.run_ns.checked_add(*f.get(6)?)?;
        t.wait_ns = t.wait_ns.checked_add(*f.get(7)?)?;
        t.arrivals = t.arrivals.checked_add(*f.get(8)?)?;
        cpus += 1;
    }
    (cpus > 0).then_some(t)
}

const CONTROL: &str = "/sys/kernel/debug/gmem/control";

pub fn control(cmd: &str) -> Result<(), String> {
    std::fs::write(CONTROL, cmd).map_err(|e| format!("write '{cmd}' to {CONTROL}: {e}"))
}

/// The switches as the module's defaults set them (read once, before any change), as a
/// control-file command that restores them.
pub fn defaults() -> &'static str {
    static D: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    D.get_or_init(|| {
        // Every switch of the line (each word is `key=value`).
        let line = control_settings();
        let words: Vec<&str> = line.split_whitespace().filter(|w| w.contains('=')).collect();
        if words.is_empty() {
            "prefetch=1 prefetch_pct=51 preevict=1 peer=1 thrash=1 readahead=1 lanes=3 head=128 multipath=1 poll=100"
                .to_string()
        } else {
            words.join(" ")
        }
    })
}

/// Restores the default switches.
pub fn restore() -> Result<(), String> {
    control(defaults())
}

/// The first line of the control file (the switches).
pub fn control_settings() -> String {
    std::fs::read_to_string(CONTROL).ok().and_then(|s| s.lines().next().map(str::to_string)).unwrap_or_default()
}

/// Watermarks `(low, high)` of GMEM device `dev`, from the control file.
pub fn watermarks(dev: i32) -> Option<(u64, u64)> {
    let text = std::fs::read_to_string(CONTROL).ok()?;
    for line in text.lines() {
        let kv: BTreeMap<&str, &str> = line.split_whitespace().filter_map(|w| w.split_once('=')).collect();
        if kv.get("dev") == Some(&dev.to_string().as_str()) {
            return Some((kv.get("low")?.parse().ok()?, kv.get("high")?.parse().ok()?));
        }
    }
    None
}

pub use libgmem::debugfs::Counters;

/// Counters of every device (`libgmem::debugfs`); empty if debugfs is not readable.
pub fn counters() -> Counters {
    libgmem::debugfs::counters().unwrap_or_default()
}

/// `after - before` per device and counter (gauges such as `used` and
/// `prefetch.accuracy_pct` are left out).
pub fn delta(before: &Counters, after: &Counters) -> Counters {
    let mut out = Counters::new();
    for (d, a) in after {
        let b = before.get(d);
        let m = out.entry(*d).or_default();
        for (k, v) in a {
            if !k.contains('.') || k.ends_with("_pct") {
                continue;
            }
            let old = b.and_then(|b| b.get(k)).copied().unwrap_or(0);
            m.insert(k.clone(), v.saturating_sub(old));
        }
    }
    out
}

pub fn get(c: &Counters, dev: u32, key: &str) -> u64 {
    c.get(&dev).and_then(|m| m.get(key)).copied().unwrap_or(0)
}

pub fn counters_json(c: &Counters) -> Json {
    let mut o = Json::obj();
    for (d, m) in c {
        let mut dj = Json::obj();
        for (k, v) in m {
            dj.set(k, *v);
        }
        o.set(&format!("dev{d}"), dj);
    }
    o
}

/// This process's space counters `(block_locks, cpu_zaps)` (zeros if it has no space yet).
pub fn own_space() -> (u64, u64) {
    let pid = std::process::id().to_string();
    let num = |m: &BTreeMap<String, String>, k: &str| m.get(k).and_then(|v| v.parse().ok()).unwrap_or(0);
    spaces().iter().find(|m| m.get("pid") == Some(&pid)).map_or((0, 0), |m| (num(m, "block_locks"), num(m, "cpu_zaps")))
}

/// One line of `/sys/kernel/debug/gmem/spaces`, as `key -> value` (numbers kept as text).
pub fn spaces() -> Vec<BTreeMap<String, String>> {
    let text = std::fs::read_to_string("/sys/kernel/debug/gmem/spaces").unwrap_or_default();
    text.lines()
        .map(|l| {
            l.split_whitespace()
                .filter_map(|w| w.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())))
                .collect()
        })
        .collect()
}

/// An anonymous private mapping, unmapped on drop.
pub struct Anon {
    pub ptr: *mut u8,
    pub len: usize,
}

impl Anon {
    pub fn new(len: usize, huge: bool) -> Result<Anon, String> {
        // SAFETY: a fresh anonymous mapping; we own it until drop.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(format!("mmap {len}: {}", std::io::Error::last_os_error()));
        }
        if !huge {
            // SAFETY: advice on our own mapping. THP would change what a "page" is.
            unsafe { libc::madvise(p, len, libc::MADV_NOHUGEPAGE) };
        }
        Ok(Anon { ptr: p.cast(), len })
    }

    #[allow(clippy::mut_from_ref)]
    pub fn words(&self) -> &mut [u32] {
        // SAFETY: mapped read/write for `len` bytes while `self` lives.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.cast::<u32>(), self.len / 4) }
    }

    #[allow(clippy::mut_from_ref)]
    pub fn bytes(&self) -> &mut [u8] {
        // SAFETY: as above.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Anon {
    fn drop(&mut self) {
        // SAFETY: our mapping.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// A file in /tmp (tmpfs in the guest) holding a copy of some bytes, removed on drop: its
/// `pread` into a user buffer is the kernel's own copy routine (copy_to_user).
pub struct TmpFile {
    fd: i32,
    len: usize,
    path: std::ffi::CString,
}

impl TmpFile {
    pub fn with(data: &[u8]) -> Result<TmpFile, String> {
        let path = std::ffi::CString::new(format!("/tmp/gmem-bench.{}", std::process::id())).unwrap();
        // SAFETY: NUL-terminated path; plain open/write/close of our own file.
        let fd =
            unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CREAT | libc::O_TRUNC | libc::O_CLOEXEC, 0o600) };
        if fd < 0 {
            return Err(format!("open {path:?}: {}", std::io::Error::last_os_error()));
        }
        let f = TmpFile { fd, len: data.len(), path };
        let mut off = 0;
        while off < data.len() {
            // SAFETY: writes from within `data`.
            let n = unsafe { libc::write(fd, data[off..].as_ptr().cast(), data.len() - off) };
            if n <= 0 {
                return Err(format!("write tmp file: {}", std::io::Error::last_os_error()));
            }
            off += n as usize;
        }
        Ok(f)
    }

    pub fn read_into(&self, buf: &mut [u8]) -> Result<(), String> {
        let mut off = 0;
        while off < self.len.min(buf.len()) {
            // SAFETY: reads into `buf` within its length.
            let n = unsafe {
                libc::pread(self.fd, buf[off..].as_mut_ptr().cast(), self.len.min(buf.len()) - off, off as i64)
            };
            if n <= 0 {
                return Err(format!("pread tmp file: {}", std::io::Error::last_os_error()));
            }
            off += n as usize;
        }
        Ok(())
    }
}

impl Drop for TmpFile {
    fn drop(&mut self) {
        // SAFETY: our descriptor and path.
        unsafe {
            libc::close(self.fd);
            libc::unlink(self.path.as_ptr());
        }
    }
}

/// `struct hmm_dmirror_cmd` of `lib/test_hmm_uapi.h`.
#[repr(C)]
#[derive(Default, Debug)]
pub struct HmmCmd {
    pub addr: u64,
    pub ptr: u64,
    pub npages: u64,
    pub cpages: u64,
    pub faults: u64,
}

const fn iowr(ty: u8, nr: u64, size: usize) -> u64 {
    (3u64 << 30) | ((size as u64) << 16) | ((ty as u64) << 8) | nr
}
pub const HMM_DMIRROR_READ: u64 = iowr(b'H', 0x00, std::mem::size_of::<HmmCmd>());
pub const HMM_DMIRROR_MIGRATE_TO_DEV: u64 = iowr(b'H', 0x02, std::mem::size_of::<HmmCmd>());

/// `/dev/hmm_dmirror0`, the kernel's HMM test device (device-private memory).
pub struct Dmirror {
    fd: i32,
}

impl Dmirror {
    pub fn open() -> Result<Dmirror, String> {
        let path = c"/dev/hmm_dmirror0";
        // SAFETY: a NUL-terminated path.
        let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(format!("open /dev/hmm_dmirror0: {}", std::io::Error::last_os_error()));
        }
        Ok(Dmirror { fd })
    }

    fn cmd(&self, cmd: u64, name: &str, addr: u64, npages: u64, bounce: &Anon) -> Result<u64, String> {
        if bounce.len < (npages as usize) * 4096 {
            return Err(format!("{name}: bounce buffer too small"));
        }
        let mut c = HmmCmd { addr, ptr: bounce.ptr as u64, npages, ..Default::default() };
        // SAFETY: HmmCmd is the argument of these commands; `bounce` covers npages pages.
        let r = unsafe { libc::ioctl(self.fd, cmd as _, &mut c) };
        if r < 0 {
            return Err(format!("{name}: {}", std::io::Error::last_os_error()));
        }
        Ok(c.cpages)
    }

    /// HMM_DMIRROR_MIGRATE_TO_DEV of `npages` from `addr`; the driver copies what it
    /// migrated back into `bounce` (its own verification path). Returns pages migrated.
    pub fn migrate_to_dev(&self, addr: u64, npages: u64, bounce: &Anon) -> Result<u64, String> {
        self.cmd(HMM_DMIRROR_MIGRATE_TO_DEV, "HMM_DMIRROR_MIGRATE_TO_DEV", addr, npages, bounce)
    }

    /// HMM_DMIRROR_READ: the device reads `npages` through its mirror into `bounce`.
    pub fn read(&self, addr: u64, npages: u64, bounce: &Anon) -> Result<u64, String> {
        self.cmd(HMM_DMIRROR_READ, "HMM_DMIRROR_READ", addr, npages, bounce)
    }
}

impl Drop for Dmirror {
    fn drop(&mut self) {
        // SAFETY: our descriptor.
        unsafe { libc::close(self.fd) };
    }
}

/// Keeps the optimiser from dropping a computed value.
pub fn keep<T>(v: T) -> T {
    std::hint::black_box(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_devices_file() {
        let text = "dev0 frames=4096 used=10 pinned=0 lent=0 low=64 high=128 alive=1\n  faults: batches=2 pages=512 allocs=500 waits_for_eviction=3\n  prefetch: pages=7 used=5 wasted=1 thrash_events=0 accuracy_pct=80\ndev1 frames=4096 used=0\n  faults: batches=0 pages=0 allocs=0 waits_for_eviction=0\n";
        let c = libgmem::debugfs::parse(text);
        assert_eq!(get(&c, 0, "faults.pages"), 512);
        assert_eq!(get(&c, 0, "prefetch.pages"), 7);
        assert_eq!(get(&c, 0, "used"), 10);
        assert_eq!(get(&c, 1, "faults.allocs"), 0);
        let mut c2 = c.clone();
        c2.get_mut(&0).unwrap().insert("faults.pages".into(), 600);
        assert_eq!(get(&delta(&c, &c2), 0, "faults.pages"), 88);
        assert_eq!(get(&delta(&c, &c2), 0, "used"), 0);
        assert_eq!(get(&c, 0, "prefetch.accuracy_pct"), 80);
        assert!(!delta(&c, &c2)[&0].contains_key("prefetch.accuracy_pct"), "a gauge, not a counter");
    }

    #[test]
    fn ioctl_number_matches_the_header() {
        assert_eq!(std::mem::size_of::<HmmCmd>(), 40);
        assert_eq!(HMM_DMIRROR_MIGRATE_TO_DEV, 0xc028_4802);
    }

    #[test]
    fn median_and_spread() {
        let s = Stat::of(&[3.0, 1.0, 2.0, f64::NAN]).unwrap();
        assert_eq!((s.median, s.min, s.max, s.n), (2.0, 1.0, 3.0, 3));
        assert_eq!(Stat::of(&[1.0, 2.0]).unwrap().median, 1.5);
        assert!(Stat::of(&[]).is_none());
    }

    #[test]
    fn schedstat_sums_the_cpu_lines() {
        let text = "version 17\ntimestamp 4295\ncpu0 0 0 10 2 5 3 1000 200 7\ndomain0 MC 3 1 2 3\n\
                    cpu1 0 0 11 2 5 3 3000 50 9\ndomain0 MC 3 1 2 3\n";
        assert_eq!(parse_schedstat(text), Some(SchedTotals { run_ns: 4000, wait_ns: 250, arrivals: 16 }));
        assert_eq!(parse_schedstat(&text.replace("version 17", "version 16")), None);
        assert_eq!(parse_schedstat("version 17\ntimestamp 1\n"), None);
        assert_eq!(parse_schedstat("version 17\ncpu0 0 0 1 2\n"), None);
    }
}
