// SPDX-License-Identifier: GPL-2.0
//! gmem-bench: GMEM's benchmark suite (run by `make bench` inside the QEMU guest).
//!
//! Every figure is the median of N timed repetitions (CLOCK_MONOTONIC) with its min/max,
//! and every ratio is against a baseline measured in the same run: on TCG absolute numbers
//! mean nothing. Progress goes to stderr (`GMEM-BENCH progress <id> i/n ...`); the result
//! is ONE line on stdout, `GMEM-BENCH-JSON {...}`, which scripts/bench.py turns into
//! tables. Exit status: 0 when every benchmark ran and checked its data, 1 when one failed
//! (its entry is null and the reason is in "errors"), 2 when the JSON did not validate.
//!
//! usage: gmem-bench [--smoke | --quick | --full] [reps=N] [only=P1+P4+...] [link=MBPS] [p4=NAME]
//!                   [prof=NAME] [ab=KEY=VALUE]
//!        gmem-bench copyprobe   (30 timings of each CPU copy style: TCG's memcpy is bimodal)
//! (words may also be comma-separated, as in the kernel command line `gmembench=quick,only=P4`)
//! Documentation/benchmarks.rst describes every benchmark and how to read the results.

mod benches;
mod json;
mod prof;
mod sys;

use benches::{progress, Bench, P4Config};
use json::{Json, JsonExt};
use libgmem::sim::Sim;
use libgmem::Gmem;

struct Args {
    mode: &'static str,
    reps: Option<usize>,
    only: Option<Vec<String>>,
    /// `link=MBPS`: the host link of the link-model runs at this bandwidth instead of a
    /// quarter of the measured copy baseline (for A/B runs whose baselines differ).
    link: Option<u64>,
    /// `p4=NAME`: P4 runs only the configurations whose name contains NAME (for A/B runs
    /// and traces of one configuration, e.g. `p4=link`).
    p4: Option<String>,
    /// `prof=NAME`: a sampling CPU profile of the runs whose trace mark contains NAME
    /// (prof.rs; a diagnostic, printed as `GMEM-PROF` lines).
    prof: Option<String>,
    /// `ab=KEY=VALUE`: PL also runs every kind with this control setting, alternating with
    /// the defaults within each repetition (a comparison free of the host's drift between
    /// boots; a diagnostic, reported as `link.ab`); so does P4's link configuration (as
    /// `link_preevict1_prefetch1_ab`, P4's configurations in reverse order on odd
    /// repetitions).
    ab: Option<String>,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args { mode: "full", reps: None, only: None, link: None, p4: None, prof: None, ab: None };
    let words: Vec<String> = std::env::args()
        .skip(1)
        .flat_map(|s| s.split([',', ' ']).map(str::to_string).collect::<Vec<_>>())
        .filter(|s| !s.is_empty())
        .collect();
    for w in words {
        let w = w.trim_start_matches('-');
        match w.split_once('=') {
            None if w == "smoke" => a.mode = "smoke",
            None if w == "quick" => a.mode = "quick",
            None if w == "full" => a.mode = "full",
            Some(("reps", n)) => a.reps = Some(n.parse().map_err(|_| format!("bad reps '{n}'"))?),
            Some(("only", l)) => a.only = Some(l.split('+').map(|s| s.to_ascii_uppercase()).collect()),
            Some(("link", m)) => {
                a.link = Some(m.parse().ok().filter(|&m| m >= 10).ok_or(format!("bad link '{m}' (MB/s, >= 10)"))?)
            }
            Some(("p4", n)) => a.p4 = Some(n.to_string()),
            Some(("prof", n)) => a.prof = Some(n.to_string()),
            Some(("ab", c)) if c.contains('=') => a.ab = Some(c.to_string()),
            None if w == "copyprobe" => a.mode = "copyprobe",
            _ => {
                return Err(format!(
                "unknown argument '{w}' (usage: gmem-bench [--smoke|--quick|--full] [reps=N] [only=P1+P4] [link=MBPS] [p4=NAME] [prof=NAME] [ab=KEY=VALUE])"
            ))
            }
        }
    }
    Ok(a)
}

fn uname() -> String {
    // SAFETY: uname fills the struct we pass.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::uname(&mut u) } != 0 {
        return String::new();
    }
    // SAFETY: the release field is NUL-terminated.
    unsafe { std::ffi::CStr::from_ptr(u.release.as_ptr()) }.to_string_lossy().into_owned()
}

/// One target row: `value op threshold`, met or not (null when not measured).
fn target(
    id: &str,
    short: &str,
    what: &str,
    value: Option<f64>,
    op: &str,
    threshold: f64,
    anchor: Option<f64>,
) -> Json {
    let met = value.map(|v| if op == ">=" { v >= threshold } else { v <= threshold });
    Json::obj()
        .with("id", id)
        .with("short", short)
        .with("what", what)
        .with("value", value)
        .with("op", op)
        .with("threshold", threshold)
        .with("met", met)
        .with("uvm_anchor", anchor)
}

/// `root.a.b.c` as a number, if present.
fn num(root: &Json, path: &[&str]) -> Option<f64> {
    let mut v = root;
    for k in path {
        v = v.get(k)?;
    }
    v.as_f64()
}

fn main() {
    let t_start = sys::now();
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("gmem-bench: {e}");
            std::process::exit(2);
        }
    };
    if args.mode == "copyprobe" {
        // Diagnostic: consecutive timings of each CPU copy style (TCG's speed is bimodal).
        let n = 12 << 20;
        for style in [0u8, 4, 1, 2] {
            let v = benches::copy_probe(n, style, 30);
            eprintln!(
                "GMEM-BENCH copyprobe style {style}: {}",
                v.iter().map(|t| format!("{:.1}", t * 1e3)).collect::<Vec<_>>().join(" ")
            );
        }
        return;
    }
    if let Some(n) = &args.prof {
        prof::init(n);
    }
    let mut out = Json::obj().with("schema", "gmem-bench/1").with("mode", args.mode);
    let mut errors: Vec<Json> = vec![];
    let code = match setup(&args) {
        Ok(mut b) => run(&mut b, &args, &mut out, &mut errors),
        Err(e) => {
            errors.push(Json::obj().with("bench", "setup").with("error", e));
            1
        }
    };
    out.set("errors", Json::Array(errors));
    out.set("total_s", sys::now() - t_start);
    let line = out.to_string();
    let code = match json::validate(&line) {
        Ok(()) => code,
        Err(e) => {
            eprintln!("gmem-bench: the JSON result does not validate: {e}");
            2
        }
    };
    prof::report();
    println!("GMEM-BENCH-JSON {line}");
    std::process::exit(code);
}

fn setup(args: &Args) -> Result<Bench, String> {
    let g = Gmem::open().map_err(|e| format!("open /dev/gmem: {e}"))?;
    let s0 = Sim::open(0).map_err(|e| format!("open /dev/gmem_sim0: {e}"))?;
    let s1 = Sim::open(1).ok();
    let i0 = s0.info().map_err(|e| format!("GMEM_SIM_IOC_INFO: {e}"))?;
    let cap = i0.nr_frames * 4096;
    let smoke = args.mode == "smoke";
    let reps = args.reps.unwrap_or(match args.mode {
        "smoke" => 1,
        "quick" => 3,
        _ => 9,
    });
    Ok(Bench {
        g,
        s0,
        s1,
        d0: i0.gmem_id,
        cap,
        reps: reps.max(1),
        warm: if smoke { 0 } else { 1 },
        smoke,
        size: if smoke { 64 * 4096 } else { (cap * 3 / 4) as usize },
        p3_pages: if smoke { 64 } else { 2048 },
        libc_memcpy_bw: None,
        link_override: args.link,
        ab: args.ab.clone(),
        survey_paired_mbs: None,
    })
}

fn run(b: &mut Bench, args: &Args, out: &mut Json, errors: &mut Vec<Json>) -> i32 {
    let want = |id: &str| args.only.as_ref().is_none_or(|l| l.iter().any(|x| x == id) || id == "BASELINE");
    let version = b.g.version().ok();
    // Remember the module's defaults before any change (restored between benchmarks).
    let _ = sys::defaults();
    out.set(
        "env",
        Json::obj()
            .with("kernel", sys_kernel())
            .with("cpus", num_cpus())
            .with("nr_devices", version.map(|v| v.nr_devices as u64))
            .with("device_frames", b.cap / 4096)
            .with("device_bytes", b.cap)
            .with("cpu_copy_flags", cpu_copy_flags())
            .with("test_hmm_loaded", std::path::Path::new("/sys/module/test_hmm").exists())
            .with("control_defaults", sys::control_settings())
            .with("reps", b.reps)
            .with("p4_reps", b.reps.min(5))
            .with("warmup_runs", b.warm)
            .with("clock", "CLOCK_MONOTONIC")
            .with("note", "QEMU TCG: absolute times are meaningless; only ratios within this run are"),
    );
    let smoke = b.smoke;
    let cap = b.cap;
    // P4 takes most of the run time: at most 5 repetitions there.
    let p4_reps = b.reps.min(5);
    let (mut configs, touch_factors, touch_count) = p4_plan(smoke);
    // With ab=, the judged link configuration runs a second time per repetition with that
    // setting (a diagnostic configuration named `..._ab`), in the order that alternates.
    if let Some(ab) = &args.ab {
        if let Some(c) = configs.iter().find(|c| c.link && !c.diagnostic).cloned() {
            let control = format!("{} {}", c.control, ab.replace('+', " "));
            configs.push(P4Config { name: format!("{}_ab", c.name), control, diagnostic: true, ..c });
        }
    }
    if let Some(n) = &args.p4 {
        configs.retain(|c| c.name.contains(n.as_str()));
    }
    type Job<'a> = (&'a str, &'a str, Box<dyn FnOnce(&mut Bench) -> Result<Json, String> + 'a>);
    let jobs: Vec<Job> = vec![
        ("BASELINE", "baseline", Box::new(|b: &mut Bench| b.baseline())),
        ("P1", "p1", Box::new(|b: &mut Bench| b.p1())),
        ("P2", "p2", Box::new(|b: &mut Bench| b.p2())),
        ("PL", "link", Box::new(|b: &mut Bench| b.link())),
        ("PS", "streams", Box::new(|b: &mut Bench| b.streams())),
        ("P3", "p3", Box::new(|b: &mut Bench| b.p3())),
        ("P4", "p4", Box::new(move |b: &mut Bench| b.p4(&configs, &touch_factors, touch_count, p4_reps))),
        ("P5", "p5", Box::new(move |b: &mut Bench| b.p5(if smoke { 64 << 20 } else { 1 << 40 }))),
        ("P6", "p6", Box::new(move |b: &mut Bench| b.p6(if smoke { 64 * 4096 } else { (cap / 4) as usize }))),
        ("P7", "p7", Box::new(move |b: &mut Bench| b.p7(if smoke { 64 * 4096 } else { (cap / 4) as usize }))),
        ("P8", "p8", Box::new(|b: &mut Bench| b.p8())),
        ("P9", "p9", Box::new(|b: &mut Bench| b.p9())),
    ];
    let mut failed = false;
    for (id, key, f) in jobs {
        if !want(id) {
            continue;
        }
        let t0 = sys::now();
        match f(b) {
            Ok(mut j) => {
                j.set("elapsed_s", sys::now() - t0);
                out.set(key, j);
            }
            Err(e) => {
                eprintln!("GMEM-BENCH error {id}: {e}");
                errors.push(Json::obj().with("bench", id).with("error", e));
                out.set(key, Json::Null);
                failed = true;
                // Leave the switches as the next benchmark expects them.
                sys::restore().ok();
            }
        }
    }
    progress("done", 1, 1, "all benchmarks");
    out.set("targets", targets(out));
    out.set(
        "uvm_anchor",
        Json::obj()
            .with(
                "source",
                "NVIDIA UVM on H200, fraction of cudaMemcpy bandwidth (reference figures given with the task)",
            )
            .with("h2d_fault", 0.19)
            .with("d2h_fault", 0.14)
            .with("explicit_prefetch", 0.90),
    );
    i32::from(failed)
}

/// P4's configurations: the two the suite is judged on, then diagnostic ones that
/// separate the effects (prefetch alone, pre-eviction with wider watermarks, no peer).
fn p4_plan(smoke: bool) -> (Vec<P4Config>, Vec<f64>, u64) {
    let cfg = |name: &str, control: &str, watermarks, factors: &[f64], touch, diagnostic| P4Config {
        name: name.into(),
        control: control.into(),
        watermarks,
        factors: factors.to_vec(),
        touch,
        diagnostic,
        link: false,
    };
    // The configuration judged against the transfer floor (issue 10): the default one with
    // the link model on.
    let linked = |factors: &[f64]| P4Config {
        link: true,
        ..cfg("link_preevict1_prefetch1", "preevict=1 prefetch=1 peer=1", None, factors, false, false)
    };
    if smoke {
        let f = [0.5, 1.5];
        return (
            vec![
                cfg("preevict1_prefetch1", "preevict=1 prefetch=1 peer=1", None, &f, true, false),
                cfg("preevict0_prefetch0", "preevict=0 prefetch=0 peer=1", None, &f, true, false),
                linked(&f),
            ],
            f.to_vec(),
            512,
        );
    }
    let all = [0.5, 1.0, 1.5, 2.0, 4.0];
    let two = [0.5, 2.0];
    (
        vec![
            cfg("preevict1_prefetch1", "preevict=1 prefetch=1 peer=1", None, &all, true, false),
            cfg("preevict0_prefetch0", "preevict=0 prefetch=0 peer=1", None, &all, true, false),
            cfg("preevict1_prefetch0", "preevict=1 prefetch=0 peer=1", None, &two, false, true),
            cfg("preevict0_prefetch1", "preevict=0 prefetch=1 peer=1", None, &two, false, true),
            cfg("preevict1_prefetch0_wm512", "preevict=1 prefetch=0 peer=1", Some((512, 1024)), &two, false, true),
            cfg("preevict0_prefetch0_peer0", "preevict=0 prefetch=0 peer=0", None, &two, false, true),
            linked(&all),
        ],
        vec![0.5, 2.0],
        8192,
    )
}

fn targets(out: &Json) -> Json {
    // A figure of the 2x row of a P4 configuration's run kind.
    let p4_at_2x = |cfg: &str, kind: &str, field: &str| -> Option<f64> {
        let Some(Json::Array(cfgs)) = out.get("p4").and_then(|p| p.get("configs")) else { return None };
        let c = cfgs.iter().find(|c| matches!(c.get("name"), Some(Json::String(n)) if n == cfg))?;
        let Some(Json::Array(rows)) = c.get(kind) else { return None };
        rows.iter().find(|r| r.get("factor").and_then(Json::as_f64) == Some(2.0))?.get(field)?.as_f64()
    };
    let p4_slowdown = |cfg: &str, kind: &str| p4_at_2x(cfg, kind, "slowdown");
    // Judged on the like-for-like case: data copied both ways (dirty), against HMM without
    // the verification copy its ioctl adds.
    let p3 = num(out, &["p3", "ratio_dirty_vs_hmm_without_bounce"]);
    let p3_clean = num(out, &["p3", "ratio_vs_hmm_without_bounce"]);
    Json::Array(vec![
        target(
            "P1",
            "H2D device faults, default",
            "fault-driven H2D, density prefetch on (default) / copy baseline",
            num(out, &["p1", "on_demand_prefetch1", "ratio", "median"]),
            ">=",
            0.6,
            Some(0.19),
        ),
        target(
            "P1",
            "H2D device faults, prefetch=0",
            "fault-driven H2D, prefetch=0 / copy baseline",
            num(out, &["p1", "on_demand_prefetch0", "ratio", "median"]),
            ">=",
            0.6,
            Some(0.19),
        ),
        target(
            "P1",
            "H2D explicit PREFETCH",
            "explicit PREFETCH H2D / copy baseline",
            num(out, &["p1", "explicit_prefetch", "ratio", "median"]),
            ">=",
            0.9,
            Some(0.90),
        ),
        target(
            "PL",
            "H2D device faults, link model",
            "fault-driven H2D over a modelled link (1/4 of the copy baseline) / link bandwidth",
            num(out, &["link", "device_faults", "ratio", "median"]),
            ">=",
            0.8,
            Some(0.19),
        ),
        target(
            "PL",
            "H2D PREFETCH, link model",
            "explicit PREFETCH H2D over a modelled link / link bandwidth",
            num(out, &["link", "explicit_prefetch", "ratio", "median"]),
            ">=",
            0.95,
            Some(0.90),
        ),
        target(
            "PL",
            "D2H CPU faults, link model",
            "CPU-fault-driven D2H over a modelled link / link bandwidth",
            num(out, &["link", "cpu_faults", "ratio", "median"]),
            ">=",
            0.8,
            Some(0.14),
        ),
        target(
            "P2",
            "D2H CPU faults",
            "CPU-fault-driven D2H / copy baseline",
            num(out, &["p2", "ratio", "median"]),
            ">=",
            0.5,
            Some(0.14),
        ),
        target(
            "P3",
            "GMEM/HMM, device writes",
            "GMEM / HMM per-page cost, to device + device writes + fault back",
            p3,
            "<=",
            0.5,
            None,
        ),
        target(
            "P3",
            "GMEM/HMM, device reads",
            "same, device only reads (GMEM keeps the host copy: no copy back)",
            p3_clean,
            "<=",
            0.5,
            None,
        ),
        target(
            "P4",
            "2x stream, default",
            "streaming slowdown at 2x oversubscription (preevict=1 prefetch=1)",
            p4_slowdown("preevict1_prefetch1", "stream"),
            "<=",
            1.5,
            None,
        ),
        target(
            "P4",
            "2x stream, preevict/prefetch off",
            "streaming slowdown at 2x oversubscription (preevict=0 prefetch=0)",
            p4_slowdown("preevict0_prefetch0", "stream"),
            "<=",
            1.5,
            None,
        ),
        target(
            "P4",
            "2x stream in 1 MiB launches, default",
            "same, kernels as 1 MiB launches (preevict=1 prefetch=1)",
            p4_slowdown("preevict1_prefetch1", "stream_chunked"),
            "<=",
            1.5,
            None,
        ),
        target(
            "P4",
            "2x stream in 1 MiB launches, off",
            "same, kernels as 1 MiB launches (preevict=0 prefetch=0)",
            p4_slowdown("preevict0_prefetch0", "stream_chunked"),
            "<=",
            1.5,
            None,
        ),
        target(
            "P4",
            "2x stream, link model, time / floor",
            "streaming time at 2x oversubscription / its transfer floor, link model on (preevict=1 prefetch=1)",
            p4_at_2x("link_preevict1_prefetch1", "stream", "time_over_floor"),
            "<=",
            1.2,
            None,
        ),
        target(
            "P4",
            "2x stream, transfers per page",
            "pages moved over a link (H2D, D2H, D2D; zero fills are not transfers) per page of the region, 2x streaming (preevict=1 prefetch=1); the floor is 2, one write-back and one fetch",
            p4_at_2x("preevict1_prefetch1", "stream", "transfers_per_page"),
            "<=",
            2.05,
            None,
        ),
        target(
            "P8",
            "H2D two paths / direct, link model",
            "H2D PREFETCH throughput over two paths (direct + via the idle peer, peer link 4x the host link) / over the direct path alone",
            num(out, &["p8", "speedup", "median"]),
            ">=",
            1.7,
            None,
        ),
        target(
            "P7",
            "2 threads, one region, one device",
            "two threads faulting disjoint halves of one region on one device / one thread doing both",
            num(out, &["p7", "ratio_same_device"]),
            ">=",
            1.7,
            None,
        ),
        target(
            "P7",
            "2 threads, one region, two devices",
            "the same, one device per thread",
            num(out, &["p7", "ratio_two_devices"]),
            ">=",
            1.7,
            None,
        ),
        target(
            "Streaming",
            "copy calls per page, device faults",
            "driver copy calls per migrated page, P1 device-fault streaming (default)",
            num(out, &["p1", "on_demand_prefetch1", "copy_calls_per_page"]),
            "<=",
            1.0 / 64.0,
            None,
        ),
        target(
            "Streaming",
            "TLB flushes per page, device faults",
            "device TLB flushes per migrated page, P1 device-fault streaming (default)",
            num(out, &["p1", "on_demand_prefetch1", "tlb_flushes_per_page"]),
            "<=",
            1.0 / 64.0,
            None,
        ),
        target(
            "P5",
            "metadata per untouched page",
            "metadata bytes per page of an untouched region (1 TiB)",
            num(out, &["p5", "bytes_per_untouched_page"]),
            "<=",
            1.0,
            None,
        ),
        target(
            "P5",
            "metadata per touched page",
            "metadata bytes per page of its touched part (16 MiB)",
            num(out, &["p5", "bytes_per_touched_page"]),
            "<=",
            16.0,
            None,
        ),
    ])
}

/// The x86 flags that decide how memcpy runs (`rep movsb` with erms/fsrm).
fn cpu_copy_flags() -> String {
    let text = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let flags = text.lines().find(|l| l.starts_with("flags")).unwrap_or("");
    ["erms", "fsrm", "avx2", "avx512f"]
        .iter()
        .filter(|f| flags.split_whitespace().any(|w| w == **f))
        .copied()
        .collect::<Vec<_>>()
        .join(" ")
}

fn sys_kernel() -> String {
    uname()
}

fn num_cpus() -> i64 {
    // SAFETY: sysconf has no preconditions.
    unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }
}
