// SPDX-License-Identifier: GPL-2.0
//! gmemctl: GMEM's state for people, like `nvidia-smi` and `numastat` are for GPUs and NUMA
//! nodes. It reads gmem.ko's debugfs files (`devices`, `spaces`, `regions`; see
//! Documentation/user-api.rst) and prints tables, or JSON with `--json`.

use clap::{Parser, Subcommand};
use libgmem::debugfs::{self, Place, RegionMap, SpaceLine};
use serde::Serialize;
use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};

/// Inspect GMEM, the unified CPU/accelerator memory manager.
///
/// gmemctl reads what gmem.ko publishes under /sys/kernel/debug/gmem (debugfs must be
/// mounted, and reading it needs root). Every command prints a table, or one JSON document
/// with --json (one per refresh for `top`).
#[derive(Parser)]
#[command(name = "gmemctl", version, about, long_about)]
struct Cli {
    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Devices (capacity, use, pinned, migration and eviction counters) and, per process,
    /// where its GMEM pages are.
    Status,
    /// The residency map of every GMEM region of one process.
    ///
    /// One line per region: its address and size, a bar of WIDTH cells (each shows where
    /// most of its pages are: `.` nowhere yet, `h` host, `0`-`f` a device, `L` lost), and
    /// the page counts per place.
    Regions {
        /// The process id.
        pid: i32,
        /// Cells of the residency bar.
        #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u16).range(1..=1024))]
        width: u16,
    },
    /// A live summary of gmem's trace events (tracefs events/gmem): per interval and device,
    /// fault batches and pages with their mean service time, pages migrated each way,
    /// prefetched and evicted, thrashing verdicts, and CPU faults and unregistrations.
    ///
    /// The events are switched on while it runs and off when it ends (also on Ctrl-C).
    /// It reads the shared trace buffer: run one at a time.
    Trace {
        /// Seconds per summary.
        #[arg(long, default_value_t = 1.0)]
        interval: f64,
        /// Stop after this many summaries (default: run until interrupted).
        #[arg(long)]
        iterations: Option<u64>,
    },
    /// A refreshing view of `status`, with rates per second of faults and migrations.
    Top {
        /// Seconds between refreshes.
        #[arg(long, default_value_t = 1.0)]
        interval: f64,
        /// Stop after this many refreshes (default: run until interrupted).
        #[arg(long)]
        iterations: Option<u64>,
    },
}

/// One device, as `status` shows it.
#[derive(Serialize)]
struct DeviceStatus {
    id: u32,
    frames: u64,
    used: u64,
    pinned: u64,
    alive: bool,
    /// Every counter of the `devices` file (`faults.pages`, `migrated.h2d`, ...).
    counters: BTreeMap<String, u64>,
}

/// One process, as `status` shows it.
#[derive(Serialize)]
struct ProcessStatus {
    pid: i32,
    space: u64,
    regions: u64,
    pages: u64,
    nowhere: u64,
    host: u64,
    lost: u64,
    /// Pages per device id.
    devices: BTreeMap<u32, u64>,
}

#[derive(Serialize)]
struct Status {
    devices: Vec<DeviceStatus>,
    processes: Vec<ProcessStatus>,
}

fn read_status() -> Result<Status, String> {
    let counters = debugfs::counters().map_err(|e| format!("{}: {e}", debugfs::DEVICES))?;
    let spaces = debugfs::spaces().map_err(|e| format!("{}: {e}", debugfs::SPACES))?;
    let devices = counters
        .into_iter()
        .map(|(id, c)| DeviceStatus {
            id,
            frames: c.get("frames").copied().unwrap_or(0),
            used: c.get("used").copied().unwrap_or(0),
            pinned: c.get("pinned").copied().unwrap_or(0),
            alive: c.get("alive") == Some(&1),
            counters: c,
        })
        .collect();
    Ok(Status { devices, processes: spaces.iter().map(process).collect() })
}

fn process(s: &SpaceLine) -> ProcessStatus {
    let f = |k: &str| s.fields.get(k).copied().unwrap_or(0);
    let devices = s
        .fields
        .iter()
        .filter_map(|(k, v)| Some((k.strip_prefix("dev")?.parse::<u32>().ok()?, *v)))
        .filter(|(_, v)| *v != 0)
        .collect();
    ProcessStatus {
        pid: s.pid,
        space: s.id,
        regions: f("regions"),
        pages: f("pages"),
        nowhere: f("none"),
        host: f("host"),
        lost: f("lost"),
        devices,
    }
}

const MIB_PAGES: f64 = 256.0;

fn print_status(st: &Status, rates: Option<&BTreeMap<u32, [f64; 3]>>, out: &mut impl Write) -> std::io::Result<()> {
    writeln!(out, "GMEM devices")?;
    write!(
        out,
        "{:>4} {:>10} {:>10} {:>6} {:>10} {:>12} {:>12} {:>12} {:>12} {:>6}",
        "dev", "MiB", "used MiB", "used%", "pinned", "faults", "h2d", "d2h", "d2d", "alive"
    )?;
    writeln!(
        out,
        "{}",
        if rates.is_some() { format!(" {:>10} {:>10} {:>10}", "faults/s", "h2d/s", "d2h/s") } else { String::new() }
    )?;
    for d in &st.devices {
        let c = |k: &str| d.counters.get(k).copied().unwrap_or(0);
        let pct = if d.frames == 0 { 0.0 } else { 100.0 * d.used as f64 / d.frames as f64 };
        write!(
            out,
            "{:>4} {:>10.1} {:>10.1} {:>5.1}% {:>10} {:>12} {:>12} {:>12} {:>12} {:>6}",
            d.id,
            d.frames as f64 / MIB_PAGES,
            d.used as f64 / MIB_PAGES,
            pct,
            d.pinned,
            c("faults.pages"),
            c("migrated.h2d"),
            c("migrated.d2h"),
            c("migrated.d2d"),
            if d.alive { "yes" } else { "no" }
        )?;
        match rates.and_then(|r| r.get(&d.id)) {
            Some(r) => writeln!(out, " {:>10.0} {:>10.0} {:>10.0}", r[0], r[1], r[2])?,
            None => writeln!(out)?,
        }
    }
    writeln!(out, "\nGMEM processes (pages)")?;
    let ids: Vec<u32> = st.devices.iter().map(|d| d.id).collect();
    write!(out, "{:>8} {:>8} {:>10} {:>10} {:>10}", "pid", "regions", "pages", "nowhere", "host")?;
    for id in &ids {
        write!(out, " {:>10}", format!("dev{id}"))?;
    }
    writeln!(out, " {:>8}", "lost")?;
    for p in &st.processes {
        write!(out, "{:>8} {:>8} {:>10} {:>10} {:>10}", p.pid, p.regions, p.pages, p.nowhere, p.host)?;
        for id in &ids {
            write!(out, " {:>10}", p.devices.get(id).copied().unwrap_or(0))?;
        }
        writeln!(out, " {:>8}", p.lost)?;
    }
    Ok(())
}

/// One region, as `regions` shows it.
#[derive(Serialize)]
struct RegionStatus {
    start: String,
    pages: u64,
    /// The runs of pages in address order: place (`-`, `h`, `l`, `dN`) and length.
    runs: Vec<(String, u64)>,
    /// Pages per place.
    totals: BTreeMap<String, u64>,
    /// The residency bar (see `gmemctl regions --help`).
    bar: String,
}

fn cell_char(p: Place) -> char {
    match p {
        Place::Nowhere => '.',
        Place::Host => 'h',
        Place::Lost => 'L',
        Place::Device(d) => char::from_digit(d % 16, 16).unwrap_or('?'),
    }
}

/// `width` cells over the region; each shows the place holding most of its pages.
fn bar(r: &RegionMap, width: u64) -> String {
    let cells = width.min(r.pages.max(1));
    let mut out = String::new();
    let (mut run, mut left) = (0usize, r.runs.first().map_or(0, |x| x.1));
    for c in 0..cells {
        // Pages [lo, hi) of the region fall in cell c.
        let (lo, hi) = (r.pages * c / cells, r.pages * (c + 1) / cells);
        let mut count: BTreeMap<Place, u64> = BTreeMap::new();
        let mut need = hi - lo;
        while need > 0 && run < r.runs.len() {
            let take = need.min(left);
            *count.entry(r.runs[run].0).or_default() += take;
            need -= take;
            left -= take;
            if left == 0 {
                run += 1;
                left = r.runs.get(run).map_or(0, |x| x.1);
            }
        }
        let top = count.iter().max_by_key(|(p, n)| (**n, std::cmp::Reverse(**p))).map_or(Place::Nowhere, |(p, _)| *p);
        out.push(cell_char(top));
    }
    out
}

fn region_status(r: &RegionMap, width: u64) -> RegionStatus {
    let mut totals = BTreeMap::new();
    for (p, n) in &r.runs {
        *totals.entry(p.code()).or_insert(0) += n;
    }
    RegionStatus {
        start: format!("{:#x}", r.start),
        pages: r.pages,
        runs: r.runs.iter().map(|(p, n)| (p.code(), *n)).collect(),
        totals,
        bar: bar(r, width),
    }
}

fn regions(pid: i32, width: u16, json: bool) -> Result<(), String> {
    let all = debugfs::regions().map_err(|e| format!("{}: {e}", debugfs::REGIONS))?;
    let mine: Vec<RegionStatus> =
        all.iter().filter(|r| r.pid == pid).map(|r| region_status(r, u64::from(width))).collect();
    if json {
        let doc = serde_json::json!({ "pid": pid, "regions": mine });
        println!("{doc}");
        return Ok(());
    }
    if mine.is_empty() {
        return Err(format!("process {pid} has no GMEM regions"));
    }
    println!("process {pid}: {} region(s)   (. nowhere, h host, 0-f device, L lost)", mine.len());
    for r in &mine {
        let totals: Vec<String> = r.totals.iter().map(|(k, v)| format!("{k} {v}")).collect();
        println!(
            "  {:>16} {:>10} pages ({:>8.1} MiB)  [{}]  {}",
            r.start,
            r.pages,
            r.pages as f64 / MIB_PAGES,
            r.bar,
            totals.join(", ")
        );
    }
    Ok(())
}

fn top(interval: f64, iterations: Option<u64>, json: bool) -> Result<(), String> {
    if !(interval.is_finite() && interval > 0.0) {
        return Err("--interval must be a positive number of seconds".into());
    }
    let tty = std::io::stdout().is_terminal();
    let mut prev: Option<Status> = None;
    let mut n = 0u64;
    loop {
        let st = read_status()?;
        let rates: Option<BTreeMap<u32, [f64; 3]>> = prev.as_ref().map(|p| {
            st.devices
                .iter()
                .map(|d| {
                    let old = p.devices.iter().find(|o| o.id == d.id);
                    let r = |k: &str| {
                        let now = d.counters.get(k).copied().unwrap_or(0);
                        let then = old.and_then(|o| o.counters.get(k)).copied().unwrap_or(now);
                        now.saturating_sub(then) as f64 / interval
                    };
                    (d.id, [r("faults.pages"), r("migrated.h2d"), r("migrated.d2h")])
                })
                .collect()
        });
        if json {
            println!("{}", serde_json::json!({ "status": st, "rates_per_s": rates }));
        } else {
            let mut out = std::io::stdout().lock();
            if tty {
                let _ = write!(out, "\x1b[H\x1b[2J");
            }
            print_status(&st, rates.as_ref(), &mut out).map_err(|e| e.to_string())?;
            let _ = writeln!(out);
        }
        n += 1;
        if iterations.is_some_and(|k| n >= k) {
            return Ok(());
        }
        prev = Some(st);
        std::thread::sleep(std::time::Duration::from_secs_f64(interval));
    }
}

/// One device's events in one interval.
#[derive(Serialize, Default)]
struct DevTrace {
    fault_batches: u64,
    fault_pages: i64,
    fault_mean_us: f64,
    h2d: i64,
    d2h: i64,
    d2d: i64,
    zeroed: i64,
    prefetched: i64,
    evicted_to_host: i64,
    evicted_to_peer: i64,
    evicted_clean: i64,
    thrash_held: i64,
}

/// One interval's summary.
#[derive(Serialize, Default)]
struct TraceSummary {
    seconds: f64,
    devices: BTreeMap<i64, DevTrace>,
    cpu_faults: u64,
    cpu_fault_pages: i64,
    /// (device, pages evacuated, pages lost) of each unregistration.
    unregistered: Vec<(i64, i64, i64)>,
}

fn summarize(ev: &[libgmem::trace::Event], seconds: f64) -> TraceSummary {
    let mut s = TraceSummary { seconds, ..Default::default() };
    let mut fault_ns: BTreeMap<i64, i64> = BTreeMap::new();
    for e in ev {
        let n = |k: &str| e.num.get(k).copied().unwrap_or(0);
        if e.name == "cpu_fault" {
            s.cpu_faults += 1;
            s.cpu_fault_pages += n("pages");
            continue;
        }
        if e.name == "unregister" {
            s.unregistered.push((n("dev"), n("evacuated"), n("lost")));
            continue;
        }
        let d = s.devices.entry(n("dev")).or_default();
        match (e.name.as_str(), e.text.get("dir").map(String::as_str)) {
            ("dev_fault", _) => {
                d.fault_batches += 1;
                d.fault_pages += n("pages");
                *fault_ns.entry(n("dev")).or_default() += n("ns");
            }
            ("migrate", Some("h2d")) => d.h2d += n("pages"),
            ("migrate", Some("d2h")) => d.d2h += n("pages"),
            ("migrate", Some("d2d")) => d.d2d += n("pages"),
            ("migrate", Some("zero")) => d.zeroed += n("pages"),
            ("prefetch", _) => d.prefetched += n("pages"),
            ("evict", _) => {
                d.evicted_to_host += n("to_host");
                d.evicted_to_peer += n("to_peer");
                d.evicted_clean += n("clean");
            }
            ("thrash", _) => d.thrash_held += n("held"),
            _ => {}
        }
    }
    for (dev, ns) in fault_ns {
        if let Some(d) = s.devices.get_mut(&dev) {
            d.fault_mean_us = ns as f64 / 1000.0 / d.fault_batches.max(1) as f64;
        }
    }
    s
}

/// Set by SIGINT/SIGTERM: `trace` stops and switches the events off.
static STOP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn on_stop(_: libc::c_int) {
    STOP.store(true, std::sync::atomic::Ordering::Relaxed);
}

fn trace_summary(interval: f64, iterations: Option<u64>, json: bool) -> Result<(), String> {
    use libgmem::trace;
    if !(interval.is_finite() && interval > 0.0) {
        return Err("--interval must be a positive number of seconds".into());
    }
    trace::dir().map_err(|e| format!("tracefs: {e}"))?;
    // SAFETY: installing an async-signal-safe handler (one atomic store).
    unsafe {
        libc::signal(libc::SIGINT, on_stop as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_stop as *const () as libc::sighandler_t);
    }
    trace::clear().and_then(|_| trace::enable(true)).map_err(|e| format!("tracefs: {e}"))?;
    let r = (|| -> Result<(), String> {
        let mut n = 0u64;
        while !STOP.load(std::sync::atomic::Ordering::Relaxed) {
            // Sleep in slices so that Ctrl-C is noticed promptly.
            let t0 = std::time::Instant::now();
            while t0.elapsed().as_secs_f64() < interval && !STOP.load(std::sync::atomic::Ordering::Relaxed) {
                std::thread::sleep(
                    std::time::Duration::from_millis(50).min(std::time::Duration::from_secs_f64(interval)),
                );
            }
            let ev = trace::read().map_err(|e| e.to_string())?;
            trace::clear().map_err(|e| e.to_string())?;
            let s = summarize(&ev, t0.elapsed().as_secs_f64());
            if json {
                println!("{}", serde_json::to_string(&s).map_err(|e| e.to_string())?);
            } else {
                println!(
                    "{:.1} s: {} CPU faults ({} pages); unregistered {:?}",
                    s.seconds, s.cpu_faults, s.cpu_fault_pages, s.unregistered
                );
                println!(
                    "{:>4} {:>8} {:>8} {:>10} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}",
                    "dev",
                    "batches",
                    "pages",
                    "mean us",
                    "h2d",
                    "d2h",
                    "d2d",
                    "zeroed",
                    "prefetch",
                    "ev.host",
                    "ev.peer",
                    "thrash"
                );
                for (id, d) in &s.devices {
                    println!(
                        "{id:>4} {:>8} {:>8} {:>10.1} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}",
                        d.fault_batches,
                        d.fault_pages,
                        d.fault_mean_us,
                        d.h2d,
                        d.d2h,
                        d.d2d,
                        d.zeroed,
                        d.prefetched,
                        d.evicted_to_host,
                        d.evicted_to_peer,
                        d.thrash_held
                    );
                }
            }
            n += 1;
            if iterations.is_some_and(|k| n >= k) {
                break;
            }
        }
        Ok(())
    })();
    let off = trace::enable(false).map_err(|e| format!("tracefs: {e}"));
    r.and(off)
}

fn main() {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Status => read_status().and_then(|st| {
            if cli.json {
                println!("{}", serde_json::to_string(&st).map_err(|e| e.to_string())?);
                Ok(())
            } else {
                print_status(&st, None, &mut std::io::stdout().lock()).map_err(|e| e.to_string())
            }
        }),
        Cmd::Regions { pid, width } => regions(pid, width, cli.json),
        Cmd::Top { interval, iterations } => top(interval, iterations, cli.json),
        Cmd::Trace { interval, iterations } => trace_summary(interval, iterations, cli.json),
    };
    if let Err(e) = r {
        eprintln!("gmemctl: {e}");
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(runs: &[(Place, u64)]) -> RegionMap {
        RegionMap { space: 1, pid: 1, start: 0, pages: runs.iter().map(|r| r.1).sum(), runs: runs.to_vec() }
    }

    #[test]
    fn bar_cells_show_the_majority_place() {
        let r = map(&[(Place::Device(0), 512), (Place::Host, 256), (Place::Nowhere, 256)]);
        assert_eq!(bar(&r, 8), "0000hh..");
        assert_eq!(bar(&r, 4), "00h.");
        // Fewer pages than cells: one cell per page.
        assert_eq!(bar(&map(&[(Place::Host, 1), (Place::Lost, 2)]), 64), "hLL");
        // A cell split 3:1 shows the 3.
        assert_eq!(bar(&map(&[(Place::Device(11), 3), (Place::Host, 1)]), 1), "b");
    }

    #[test]
    fn region_totals_and_runs_keep_codes() {
        let s = region_status(&map(&[(Place::Device(1), 2), (Place::Host, 1), (Place::Device(1), 1)]), 4);
        assert_eq!(s.totals["d1"], 3);
        assert_eq!(s.runs.len(), 3);
        assert_eq!(s.bar, "11h1");
    }

    #[test]
    fn trace_summary_adds_up_per_device() {
        let ev = libgmem::trace::parse(concat!(
            "t-1 [0] . 1.0: gmem_dev_fault: dev=0 space=1 pages=256 ns=2000 err=0\n",
            "t-1 [0] . 1.1: gmem_dev_fault: dev=0 space=1 pages=44 ns=4000 err=0\n",
            "t-1 [0] . 1.2: gmem_migrate: dir=zero dev=0 peer=-1 pages=300 bytes=1228800\n",
            "t-1 [0] . 1.3: gmem_migrate: dir=d2d dev=0 peer=1 pages=7 bytes=28672\n",
            "t-1 [0] . 1.4: gmem_evict: dev=1 to_host=3 to_peer=0 clean=2\n",
            "t-1 [0] . 1.5: gmem_cpu_fault: space=1 addr=0x10 write=0 from=0 pages=16 err=0\n",
            "t-1 [0] . 1.6: gmem_unregister: dev=1 contexts=1 evacuated=5 lost=0\n",
        ));
        let s = summarize(&ev, 1.0);
        let d0 = &s.devices[&0];
        assert_eq!((d0.fault_batches, d0.fault_pages, d0.zeroed, d0.d2d), (2, 300, 300, 7));
        assert!((d0.fault_mean_us - 3.0).abs() < 1e-9);
        assert_eq!((s.devices[&1].evicted_to_host, s.devices[&1].evicted_clean), (3, 2));
        assert_eq!((s.cpu_faults, s.cpu_fault_pages, s.unregistered.clone()), (1, 16, vec![(1, 5, 0)]));
    }

    #[test]
    fn cli_parses_and_refuses_bad_input() {
        assert!(Cli::try_parse_from(["gmemctl", "regions", "42", "--width", "16", "--json"]).is_ok());
        assert!(Cli::try_parse_from(["gmemctl", "regions", "x"]).is_err());
        assert!(Cli::try_parse_from(["gmemctl", "regions", "1", "--width", "0"]).is_err());
        assert!(Cli::try_parse_from(["gmemctl", "top", "--iterations", "2", "--interval", "0.5"]).is_ok());
        <Cli as clap::CommandFactory>::command().debug_assert();
    }
}
