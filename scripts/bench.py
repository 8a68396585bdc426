#!/usr/bin/env python3
"""Turn a GMEM benchmark run into results: extracts the one `GMEM-BENCH-JSON {...}` line
that tools/gmem-bench printed on the guest console and writes

  <out>/results.json   the JSON, pretty-printed
  <out>/results.md     tables: medians, spreads, baselines, targets met / not met, UVM anchors
  <out>/ratios.png     bar chart of the key ratios against their targets (matplotlib)
  <out>/ratios.svg     the same chart as SVG

then prints results.md. Exits 1 if the JSON line is missing or invalid (the figures
themselves are never pass/fail). Python 3 standard library only.

usage: bench.py --console LOG [--out DIR] [--source FILE] [--smoke] [--quiet]
       bench.py --fingerprint > FILE
  --smoke        only check that the log holds a valid JSON result; write nothing
  --fingerprint  print which kernel-side sources are being measured (git HEAD, files that
                 differ from it, a hash of gmem/ drivers/ policy/ include/); `make bench`
                 records it right after building and passes it back with --source
"""
import argparse
import hashlib
import json
import math
import os
import subprocess
import re
import sys

MARK = "GMEM-BENCH-JSON "
# A kernel console message glued into another line: "[ seconds] text" up to its newline.
KMSG = re.compile(r"\[\s*\d+\.\d+\] [^\n]*\n")
SCHEMA = "gmem-bench/1"


SOURCE_DIRS = ("gmem", "drivers", "policy", "include")


def fingerprint(root="."):
    """Which kernel-side sources a run measures (read-only git queries)."""
    def git(*args):
        try:
            return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return ""
    h = hashlib.sha256()
    for top in SOURCE_DIRS:
        for dirpath, dirs, files in sorted(os.walk(os.path.join(root, top))):
            dirs.sort()
            for name in sorted(files):
                if name.endswith((".rs", ".c", ".h", "Kbuild")):
                    path = os.path.join(dirpath, name)
                    h.update(path.encode())
                    with open(path, "rb") as fh:
                        h.update(fh.read())
    changed = [line[3:] for line in git("status", "--porcelain", "--", *SOURCE_DIRS).splitlines() if line]
    return {"git_head": git("rev-parse", "--short", "HEAD").strip(), "changed_vs_head": changed,
            "sources_sha256": h.hexdigest()[:16], "host": host_state()}


def host_state():
    """How busy the (shared) host is: load average and QEMU guests running."""
    guests = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/comm") as fh:
                    guests += fh.read().startswith("qemu-system")
            except OSError:
                pass
    return {"loadavg_1m": os.getloadavg()[0], "cpus": os.cpu_count(), "qemu_guests": guests}


def extract(path):
    """The last JSON result in the console log, parsed; raises ValueError with a reason."""
    try:
        text = open(path, errors="replace").read()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e}")
    # The serial console can cut the (long) line with a kernel message ("[   79.49] msg")
    # that ends in a newline, after which the JSON goes on: take such messages out first.
    text = KMSG.sub("", text)
    found = None
    for line in text.splitlines():
        i = line.find(MARK)
        if i >= 0:
            found = line[i + len(MARK):].strip()
    if found is None:
        raise ValueError(f"no '{MARK.strip()}' line in {path} (did the guest run gmem-bench?)")
    try:
        d = json.loads(found)
    except json.JSONDecodeError as e:
        raise ValueError(f"the {MARK.strip()} line is not valid JSON: {e}")
    if not isinstance(d, dict) or d.get("schema") != SCHEMA:
        raise ValueError(f"unexpected JSON: schema is {d.get('schema') if isinstance(d, dict) else type(d)}")
    for key in ("mode", "env", "targets", "errors"):
        if key not in d:
            raise ValueError(f"JSON result lacks '{key}'")
    return d


def g(d, *path):
    for k in path:
        if not isinstance(d, dict) or d.get(k) is None:
            return None
        d = d[k]
    return d


def f(x, digits=3):
    """A number with `digits` significant digits; '—' for missing."""
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if x == 0 or not math.isfinite(x):
        return str(x)
    mag = math.floor(math.log10(abs(x)))
    dec = max(0, digits - 1 - mag)
    return f"{x:.{dec}f}"


def section(L, d, key, title):
    """Starts a results section; returns the benchmark's results (None if it did not run)."""
    L.append(f"## {title}")
    L.append("")
    return d.get(key)


def st(s, digits=3, scale=1.0):
    """`median (min–max)` of a stat object."""
    if not isinstance(s, dict) or s.get("median") is None:
        return "—"
    m, lo, hi = (s[k] * scale if s.get(k) is not None else None for k in ("median", "min", "max"))
    if s.get("n", 1) <= 1:
        return f(m, digits)
    return f"{f(m, digits)} ({f(lo, digits)}–{f(hi, digits)})"


def pct(x):
    return "—" if x is None else f"{100 * x:.1f}%"


def met(m):
    return "—" if m is None else ("**met**" if m else "**not met**")


def table(head, rows):
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def markdown(d):
    env = d.get("env", {})
    L = []
    L.append("# GMEM benchmark results")
    L.append("")
    L.append(f"Mode `{d['mode']}`, kernel {env.get('kernel')}, {env.get('cpus')} vCPUs (QEMU TCG), "
             f"{env.get('nr_devices')} simulated devices of {f((env.get('device_bytes') or 0) / 2**20)} MiB "
             f"({env.get('device_frames')} frames), {env.get('reps')} timed repetition(s) per figure "
             f"(P4: {env.get('p4_reps')}; +{env.get('warmup_runs')} warm-up run outside P4), whole run {f(d.get('total_s'))} s. "
             f"Defaults: `{env.get('control_defaults')}`.")
    L.append("")
    src = d.get("source")
    if src:
        ch = src.get("changed_vs_head") or []
        L.append(f"Kernel-side sources measured: commit `{src.get('git_head')}`"
                 + (f" plus uncommitted changes in {len(ch)} file(s) ({', '.join(ch)})" if ch else "")
                 + f"; hash of gmem/ drivers/ policy/ include/ `{src.get('sources_sha256')}`.")
        hb, ha = src.get("host") or {}, src.get("host_after") or {}
        if hb:
            L.append("")
            L.append(f"Host: {hb.get('cpus')} CPUs, shared; 1-minute load {f(hb.get('loadavg_1m'))} with "
                     f"{hb.get('qemu_guests')} QEMU guest(s) running before the run (this one not yet started), "
                     f"{f(ha.get('loadavg_1m'))} after. Other guests on the host slow this one down unevenly: "
                     f"that is what the spreads show, and why every ratio pairs measurements taken moments apart.")
        L.append("")
    L.append("Figures are `median (min–max)` over the repetitions. **QEMU TCG: absolute times are "
             "meaningless; only ratios against baselines measured in the same run matter.**")
    L.append("")
    # Targets.
    L.append("## Targets")
    L.append("")
    rows = []
    for t in d.get("targets", []):
        rows.append([t.get("id"), t.get("what"), f(t.get("value")), f"{t.get('op')} {f(t.get('threshold'))}",
                     met(t.get("met")), f(t.get("uvm_anchor"))])
    L.append(table(["", "figure", "measured (median)", "target", "", "UVM H200 anchor"], rows))
    L.append("")
    L.append("UVM anchors (NVIDIA UVM on H200, fraction of copy bandwidth): fault-driven H→D 0.19, "
             "D→H 0.14, explicit prefetch 0.90. Targets are goals, not test assertions.")
    L.append("")
    # Baseline + P1/P2.
    b = d.get("baseline")
    L.append("## Baseline and migration bandwidth (P1, P2)")
    L.append("")
    if b:
        env = d.get("env", {})
        L.append(f"Baseline survey: CPU copies of {f(b['bytes'] / 2**20)} MiB into a populated anonymous buffer "
                 f"(ms, MB/s; guest CPU flags: `{env.get('cpu_copy_flags')}`). libc memcpy (`rep movsq`) runs "
                 f"erratically under TCG; the kernel's own page copies do not use `rep movs` here. The denominator "
                 f"of every P1/P2 ratio is therefore paired: in each repetition, the faster of libc memcpy and the "
                 f"SSE2 loop, timed right before that repetition's runs (P1: "
                 f"{st(g(d, 'p1', 'paired_baseline_mbs'))} MB/s; the survey's paired value: "
                 f"{st(g(b, 'paired', 'bw_mbs'))} MB/s).")
        L.append("")
        rows = []
        for name, what in (("memcpy", "memcpy, THP allowed"), ("memcpy_nothp", "memcpy, MADV_NOHUGEPAGE"),
                           ("memcpy_per_4k_page", "memcpy per 4 KiB page, no THP"), ("sse2_loop", "SSE2 loop, no THP"),
                           ("kernel_copy_to_user", "kernel copy_to_user (pread of a tmpfs file), no THP")):
            v = b.get(name)
            if v:
                rows.append([what, st(v.get("time_s"), 3, 1e3), st(v.get("bw_mbs"))])
        L.append(table(["copy", "time ms", "MB/s"], rows))
        L.append("")
        if b.get("anon_fault_ns_per_page"):
            L.append(f"A first-touch anonymous write fault (a zero-filled 4 KiB page, no THP) costs "
                     f"{st(b.get('anon_fault_ns_per_page'))} ns per page on this guest, a read fault (the shared "
                     f"zero page: no allocation, no zeroing) {st(b.get('anon_read_fault_ns_per_page'))} ns: the "
                     f"floor under any CPU-fault-driven migration.")
            L.append("")
    rows = []
    p1 = d.get("p1") or {}
    for key, name in (("on_demand_prefetch0", "P1 device faults, prefetch=0"),
                      ("on_demand_prefetch1", "P1 device faults, prefetch=1 (default)"),
                      ("on_demand_prefetch0_thrash0", "P1 device faults, prefetch=0 thrash=0 (diagnostic)"),
                      ("on_demand_prefetch1_pct25", "P1 device faults, prefetch=1 prefetch_pct=25 (diagnostic)"),
                      ("explicit_prefetch", "P1 explicit PREFETCH")):
        r = p1.get(key)
        if not r:
            continue
        rows.append([name, st(r.get("time_s"), 3, 1e3), st(r.get("bw_mbs")), st(r.get("ratio")),
                     st(r.get("ratio_net")), st(r.get("ratio_vs_libc_memcpy")), f(r.get("pages_per_batch")),
                     f(r.get("prefetched_per_run")) if "prefetched_per_run" in r and key != "explicit_prefetch" else "—",
                     f(r.get("copy_calls_per_page")), f(r.get("tlb_flushes_per_page"))])
    p2 = d.get("p2")
    if p2:
        rows.append(["P2 CPU faults, device→host", st(p2.get("time_s"), 3, 1e3), st(p2.get("bw_mbs")),
                     st(p2.get("ratio")), "—", st(p2.get("ratio_vs_libc_memcpy")), "1 (CPU)", "—", "—", "—"])
    if rows:
        L.append(f"Region: {f((p1.get('bytes') or (p2 or {}).get('bytes') or 0) / 2**20)} MiB.")
        L.append("")
        L.append(table(["", "time ms", "MB/s", "/ baseline", "/ baseline, device compute excluded",
                        "/ libc memcpy", "pages per fault batch", "density-prefetched pages per run",
                        "copy calls per page", "TLB flushes per page"], rows))
        L.append("")
        L.append("`/ baseline` is against the paired baseline (targets are judged on it); "
                 "`device compute excluded`: the same run minus a second CHECKSUM over the now-resident region "
                 "(the simulated device computes on the guest CPU); `/ libc memcpy`: against the survey's "
                 "median libc memcpy, unpaired.")
        if p2 and p2.get("ns_per_page"):
            L.append(f"P2 costs {st(p2.get('ns_per_page'))} ns per page.")
        L.append("")
    # Executor work per migrated page (driver calls, zaps, lock acquisitions).
    work = [(name, r.get("per_migrated_page")) for name, r in (
        ("P1 device faults, prefetch=0", p1.get("on_demand_prefetch0")),
        ("P1 device faults, prefetch=1 (default)", p1.get("on_demand_prefetch1")),
        ("P1 explicit PREFETCH", p1.get("explicit_prefetch")),
        ("P2 CPU faults (incl. first-touch placement)", p2),
        ("P3 round trip, device writes", (d.get("p3") or {}).get("gmem_dirty"))) if r and r.get("per_migrated_page")]
    if work:
        keys = ("copy_calls", "map_calls", "map_2m", "tlb_flushes", "cpu_zaps", "block_locks", "pool_locks", "lock_acquisitions")
        L.append("Work per migrated page (counters of the timed runs / pages moved per run):")
        L.append("")
        L.append(table([""] + [k.replace("_", " ") for k in keys], [[n] + [f(w.get(k)) for k in keys] for n, w in work]))
        L.append("")
    prof = p1.get("fault_cost_by_batch_size")
    if prof:
        L.append("Device-fault migration cost against the fault batch size (prefetch=0; CHECKSUM launches over k "
                 "host-resident pages each, minus the same launches once resident):")
        L.append("")
        L.append(table(["pages per batch", "ns per page", "ns per batch"],
                       [[r["batch_pages"], st(r.get("migrate_ns_per_page")), st(r.get("migrate_ns_per_batch"))] for r in prof]))
        L.append("")
    # P1/P2 over the modelled link.
    lk = section(L, d, "link", "Migration over a modelled link (PL)")
    if lk:
        L.append(f"sim0's host links modelled at {lk.get('link_mbs')} MB/s each way (`GMEM_SIM_IOC_LINK`), a quarter "
                 f"of the paired copy baseline measured first ({f(lk.get('paired_baseline_mbs'))} MB/s), so that the "
                 f"link is the floor; {f((lk.get('bytes') or 0) / 2**20)} MiB per run.")
        L.append("")
        rows = []
        for key, name in (("device_faults", "H→D device faults (default prefetch)"),
                          ("explicit_prefetch", "H→D explicit PREFETCH"),
                          ("cpu_faults", "D→H CPU faults")):
            r = lk.get(key)
            if r:
                rows.append([name, st(r.get("time_s"), 3, 1e3), st(r.get("bw_mbs")), st(r.get("ratio")),
                             st(r.get("link_bytes_per_page"))])
        L.append(table(["", "time ms", "MB/s", "/ link bandwidth (= share of the time the link is busy)",
                        "link bytes per page"], rows))
        L.append("")
        L.append("The rest of the time is what does not overlap with the link: the executor's work "
                 "before and after each block's copies (allocation, commit, mapping), fault handling, "
                 "and the start of each stream before read-ahead runs ahead of it.")
        L.append("")
        df = lk.get("device_faults") or {}
        if df.get("compute_s"):
            L.append(f"Diagnostic: the device's checksum over the same data, already resident (no fault, no "
                     f"migration), took {st(df.get('compute_s'), 3, 1e3)} ms against "
                     f"{f((lk.get('bytes') or 0) / (lk.get('link_mbs') or 1) / 1e3, 3)} ms of link time. With "
                     f"perfect overlap the device-fault run takes the slower of the two; its time over that "
                     f"floor: {st(df.get('time_over_floor'))} (1.0 = perfect overlap). Under TCG the simulated "
                     f"device computes on the guest's CPUs, so its speed moves with the host's.")
            L.append("")
        cpu = [(name, lk.get(key) or {}) for key, name in
               (("device_faults", "device faults"), ("explicit_prefetch", "PREFETCH"), ("cpu_faults", "CPU faults"))]
        cpu = [(name, c) for name, c in cpu if c.get("cpus_busy")]
        if cpu:
            L.append("Diagnostic: the guest's CPUs during each run (/proc/schedstat): on average "
                     + "; ".join(f"{name} {st(c.get('cpus_busy'))} CPUs busy, runnable tasks waited "
                                 f"{st(c.get('cpu_wait_s'), 3, 1e3)} ms in all for a CPU, "
                                 f"{st(c.get('cpu_wait_each_s'), 3, 1e3)} ms each time one got it"
                                 for name, c in cpu)
                     + f" (the guest has {env.get('cpus')} vCPUs; a run that kept them all busy would be "
                       f"bound by the simulation's CPU work, not by the link).")
            L.append("")
    # Two streams over the modelled link (diagnostic).
    ps = section(L, d, "streams", "Two streams by device faults over a modelled link (PS, diagnostic)")
    if ps:
        r = ps.get("axpy_device_faults") or {}
        L.append(f"The device runs AXPY (`y = 3 x + y`) over two fresh CPU-written regions of "
                 f"{f((ps.get('bytes_per_region') or 0) / 2**20)} MiB each, brought by its faults, with sim0's host "
                 f"links at {ps.get('link_mbs')} MB/s as in PL. Each 1 MiB window of the kernel faults in `x`'s "
                 f"pages, then `y`'s: read-ahead sees a stream in each region. No target: it shows how well "
                 f"fault-driven migration overlaps with a device kernel that reads two arrays at once.")
        L.append("")
        L.append(table(["time ms", "both regions' bytes / time / link bandwidth", "device's own work ms",
                        "time / floor (the slower of link and own work)", "link bytes per page"],
                       [[st(r.get("time_s"), 3, 1e3), st(r.get("ratio")), st(r.get("compute_s"), 3, 1e3),
                         st(r.get("time_over_floor")), st(r.get("link_bytes_per_page"))]]))
        L.append("")
    # P3.
    p3 = section(L, d, "p3", "Per-page migrate-to-device + fault-back cost (P3)")
    if p3:
        hm = p3.get("hmm")
        rows = []
        for key, name in (("gmem", "GMEM, device reads (PREFETCH + CPU read fault)"),
                          ("gmem_dirty", "GMEM, device writes in between (untimed)"),
                          ("gmem_sysmem", "GMEM, anonymous memory (device-private pages)")):
            gm = p3.get(key)
            if gm:
                rows.append([name, st(gm.get("ns_per_page")), st(gm.get("to_device_ns_per_page")),
                             st(gm.get("back_ns_per_page")), "—",
                             f"{f(gm.get('h2d_per_page'))} / {f(gm.get('d2h_per_page'))}"])
        if hm:
            rows.append(["HMM dmirror (MIGRATE_TO_DEV + CPU read fault)", st(hm.get("ns_per_page")),
                         st(hm.get("to_device_ns_per_page")), st(hm.get("back_ns_per_page")),
                         st(hm.get("bounce_ns_per_page")), "1 / 1"])
        L.append(f"{p3.get('pages')} pages, ns per page:")
        L.append("")
        L.append(table(["", "total", "to device", "back to host", "driver's verification copy",
                        "copies H→D / D→H per page"], rows))
        L.append("")
        if hm:
            L.append(f"GMEM / HMM, device writes: {f(p3.get('ratio_dirty'))} raw, "
                     f"**{f(p3.get('ratio_dirty_vs_hmm_without_bounce'))}** against HMM without the bounce copy "
                     f"that MIGRATE_TO_DEV makes for its own verification (measured alone with HMM_DMIRROR_READ; "
                     f"the target is judged on this one). Device only reads: {f(p3.get('ratio'))} raw, "
                     f"{f(p3.get('ratio_vs_hmm_without_bounce'))} without the bounce copy. Anonymous "
                     f"memory (an `mmap`'d buffer moved to device-private pages by PREFETCH, as dmirror's): "
                     f"{f(p3.get('ratio_sysmem'))} raw, **{f(p3.get('ratio_sysmem_vs_hmm_without_bounce'))}** "
                     f"without the bounce copy.")
        else:
            L.append(f"HMM not measured: {p3.get('hmm_error')}")
        L.append("")
    # P4.
    p4 = section(L, d, "p4", "Oversubscription (P4)")
    if p4:
        L.append(f"Device capacity {f(p4['capacity_bytes'] / 2**20)} MiB; a peer device of the same size is "
                 f"the victim tier (`peer=1`). Streaming: {p4.get('stream_kernel')}. Random: {p4.get('touch_kernel')}.")
        L.append("")
        head = ["run", "size", "time (median, min–max)", "slowdown vs 0.5×", "fault waits / allocs",
                "evicted host / peer / clean", "pre-evicted", "prefetch pages / used / wasted (accuracy)",
                "thrash events", "fault pages / batches", "copies / transfers / TLB flushes per page"]
        for c in p4.get("configs", []):
            wm = c.get("watermarks")
            extra = f", watermarks low={wm['low']} high={wm['high']}" if wm else ""
            L.append(f"### `{c.get('control')}`{extra}" + (" (diagnostic)" if c.get("diagnostic") else ""))
            L.append("")
            rows = []
            for kind, unit in (("stream", " ns/B"), ("stream_chunked", " ns/B"), ("touch", " ns/touch")):
                for r in c.get(kind) or []:
                    s = r.get("dev0") or {}
                    rows.append([
                        f"{kind.replace('_', ' ')} {r.get('factor'):g}×", f"{f(r.get('bytes', 0) / 2**20)} MiB",
                        st(r.get("per_unit")) + unit,
                        f(r.get("slowdown")),
                        f"{s.get('waits_for_eviction')}/{s.get('fault_allocs')} = {pct(s.get('waits_fraction'))}",
                        f"{s.get('evicted_to_host')} / {s.get('evicted_to_peer')} / {s.get('evicted_clean_dropped')}",
                        s.get("pre_evicted"),
                        f"{s.get('prefetch_pages')} / {s.get('prefetch_used')} / {s.get('prefetch_wasted')} ({pct(s.get('prefetch_accuracy'))})",
                        s.get("thrash_events"),
                        f"{s.get('fault_pages')}/{s.get('fault_batches')}",
                        f"{f(r.get('copies_per_page'))} / {f(r.get('transfers_per_page'))} / {f(r.get('tlb_flushes_per_page'))}",
                    ])
            L.append(table(head, rows))
            L.append("")
            floors = [r for r in c.get("stream") or [] if r.get("floor_s")]
            if floors:
                L.append(f"Link model on ({p4.get('link_mbs')} MB/s host links, 4× that to the peer). "
                         f"Transfer floor: {p4.get('floor')}.")
                L.append("")
                L.append(table(["run", "floor (s)", "time / floor"], [
                    [f"stream {r.get('factor'):g}×", st(r.get("floor_s")), f(r.get("time_over_floor"))]
                    for r in floors]))
                L.append("")
                L.append("![time against oversubscription, with the floor](oversubscription.svg)")
                L.append("")
        runs = g(p4, "configs") and (p4["configs"][0].get("stream") or [{}])[0].get("runs")
        L.append(f"Counters are dev0 deltas summed over the {runs} runs of a row; copies and TLB flushes "
                 f"(GMEM_SIM_IOC_INFO, both devices) are per page of the region per run. Full per-device "
                 f"deltas, including the peer's write-backs, are in results.json.")
        L.append("")
    # P5.
    p5 = section(L, d, "p5", "Metadata (P5)")
    if p5:
        L.append(f"A {f(p5['region_bytes'] / 2**20)} MiB region ({p5['pages']} pages), untouched: "
                 f"{p5['metadata_bytes_untouched']} bytes of metadata = **{f(p5['bytes_per_untouched_page'])} bytes per "
                 f"4 KiB page**. After {f(p5['touched_bytes'] / 2**20)} MiB of it was touched: {p5['metadata_bytes_touched']} "
                 f"bytes = **{f(p5['bytes_per_touched_page'])} bytes per touched page** ({p5.get('source')}).")
        L.append("")
    # P6.
    p6 = section(L, d, "p6", "Two processes (P6)")
    if p6:
        L.append(f"{p6.get('kernel')}; {f(p6['bytes_per_process'] / 2**20)} MiB per process.")
        L.append("")
        L.append(table(["", "aggregate MB/s", "vs one process"], [
            ["one process", st(p6.get("single_mbs")), "1"],
            ["two processes, same device", st(p6.get("two_same_device_mbs")), f(p6.get("ratio_same_device"))],
            ["two processes, one device each", st(p6.get("two_devices_mbs")), f(p6.get("ratio_two_devices"))],
            ["CPU memcpy only, one process", st(p6.get("cpu_copy_single_mbs")), "1"],
            ["CPU memcpy only, two processes", st(p6.get("cpu_copy_two_mbs")), f(p6.get("ratio_cpu_copy"))],
        ]))
        L.append("")
    p7 = section(L, d, "p7", "Two threads, one region (P7)")
    if p7:
        L.append(f"{p7.get('kernel')}; {f(p7['bytes_per_half'] / 2**20)} MiB per half. One thread takes "
                 f"{st(p7.get('one_thread_s'), 3, 1e3)} ms for both halves.")
        L.append("")
        L.append(table(["", "speed-up over one thread"], [
            ["two threads, same device", st(p7.get("ratio_same_device_spread"))],
            ["two threads, one device each", st(p7.get("ratio_two_devices_spread"))],
        ]))
        L.append("")
    p8 = section(L, d, "p8", "Two paths at once (P8)")
    if p8 and p8.get("speedup"):
        L.append(f"Explicit PREFETCH of {f((p8.get('bytes') or 0) / 2**20)} MiB of host-written data to sim0, host links "
                 f"modelled at {p8.get('link_mbs')} MB/s (a sixteenth of the paired copy baseline, "
                 f"{f(p8.get('paired_baseline_mbs'))} MB/s), the peer link at {p8.get('peer_link_mbs')} MB/s. "
                 "`multipath=0`: sim0's host link alone; `multipath=1`: part of each block goes through the idle "
                 "sim1 (into staging frames over its host link, then on over its peer link). Both runs of a "
                 "repetition check the data on the device. (A sixteenth, not PL's quarter: the simulated engines copy "
                 "with the guest CPU, and the staged half is copied twice, so at PL's speed the two vCPUs, not the "
                 "links, would bound both runs.)")
        L.append("")
        rows = []
        for key, name in (("direct", "direct path only"), ("two_paths", "direct + via peer")):
            r = p8.get(key) or {}
            rows.append([name, st(r.get("time_s"), 3, 1e3), st(r.get("bw_mbs")), st(r.get("ratio")),
                         st(r.get("via_peer_share"))])
        L.append(table(["", "time ms", "MB/s", "/ one host link's bandwidth", "share of bytes via the peer"], rows))
        L.append("")
        L.append(f"Speed-up of two paths over one (per repetition, paired): **{st(p8.get('speedup'))}**.")
        L.append("")
    p9 = section(L, d, "p9", "Ordinary process memory on the device (P9)")
    if p9 and p9.get("malloc_read"):
        L.append(f"{f((p9.get('bytes') or 0) / 2**20)} MiB on sim0, device faults only (no link model). "
                 "`malloc`: a `Vec` of the benchmark process, which gmem mirrors (the device maps the "
                 "process's own pages remotely, no copy; the run checks that the copy engine moved nothing). "
                 "Migrated: the same `Vec` under PREFERRED_LOC of the device, whose faults move it into "
                 "device memory as device-private pages. "
                 "Region: a GMEM region, whose pages migrate to the device. Reads: CHECKSUM of CPU-written "
                 "data; writes: FILL of untouched memory. Data checked every run.")
        L.append("")
        rows = []
        for key, name in (("region_read", "GMEM region, read"), ("malloc_read", "malloc'd, read"),
                          ("migrate_read", "malloc'd, migrated, read"),
                          ("region_write", "GMEM region, write"), ("malloc_write", "malloc'd, write"),
                          ("migrate_write", "malloc'd, migrated, write")):
            r = p9.get(key) or {}
            rows.append([name, st(r.get("time_s"), 3, 1e3), st(r.get("bw_mbs")), st(r.get("ns_per_page"), 0),
                         st(r.get("batches"), 0)])
        L.append(table(["", "time ms", "MB/s", "ns per page", "fault batches"], rows))
        L.append("")
        L.append(f"Time on the region / time on malloc'd memory: remote mapping, reads "
                 f"**{f(p9.get('ratio_read'))}**, writes **{f(p9.get('ratio_write'))}**; migrated, reads "
                 f"**{f(p9.get('ratio_migrate_read'))}**, writes **{f(p9.get('ratio_migrate_write'))}** "
                 "(above 1: malloc'd memory is faster).")
        L.append("")
    errs = d.get("errors") or []
    L.append("## Errors")
    L.append("")
    L.append("none" if not errs else "\n".join(f"- {e.get('bench')}: {e.get('error')}" for e in errs))
    L.append("")
    return "\n".join(L)


def plot(d, out):
    """Horizontal bars, one row per target, each on its own scale, with the target line and
    (where there is one) the UVM anchor; drawn with matplotlib, written as PNG and SVG."""
    import matplotlib
    matplotlib.use("Agg")  # no display: files only
    # Text stays text in the SVG, and both files are byte-for-byte reproducible.
    matplotlib.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "gmem"})
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    rows = list(d.get("targets", []))
    fig, axes = plt.subplots(len(rows) or 1, 1, figsize=(10, 0.62 * max(len(rows), 1) + 1.6), squeeze=False)
    fig.suptitle(f"GMEM key ratios vs targets ({d.get('mode')} run, QEMU TCG: only ratios matter)", fontsize=12)
    for ax, t in zip(axes[:, 0], rows):
        v, thr, anc = t.get("value"), t.get("threshold"), t.get("uvm_anchor")
        label = f"{t.get('id')} {t.get('short') or t.get('what')}"
        if len(label) > 52:
            label = label[:50] + "…"
        nums = [x for x in (v, thr, anc) if isinstance(x, (int, float))]
        ax.set_xlim(0, max(nums + [1e-9]) * 1.2)
        ax.set_yticks([0], [f"{label}\ntarget {t.get('op', '')} {f(thr)}"], fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
        if isinstance(v, (int, float)):
            colour = {True: "#2e8b57", False: "#c0392b"}.get(t.get("met"), "#999999")
            ax.barh([0], [v], height=0.6, color=colour)
            ax.text(v, 0, f" {f(v)}", va="center", fontsize=8)
        else:
            ax.text(0, 0, " not measured", va="center", fontsize=8, color="#999999")
        if isinstance(thr, (int, float)):
            ax.axvline(thr, color="black", linewidth=2)
        if isinstance(anc, (int, float)):
            ax.plot([anc], [0], marker="D", color="#2f6fdf", markersize=7, markeredgecolor="white")
        ax.set_ylim(-0.6, 0.6)
    fig.legend(handles=[Patch(color="#2e8b57", label="target met"), Patch(color="#c0392b", label="not met"),
                        Patch(color="#999999", label="not judged"),
                        Line2D([], [], color="black", linewidth=2, label="target"),
                        Line2D([], [], marker="D", color="#2f6fdf", linestyle="", label="UVM H200 anchor")],
               loc="lower center", ncol=5, fontsize=8, frameon=False)
    fig.text(0.01, 0.035, "P1/P2: bandwidth / memcpy (higher is better). P3: GMEM/HMM per-page cost, "
             "P4: slowdown, P5: bytes per page (lower is better). Each row has its own scale.", fontsize=7, color="#555555")
    fig.tight_layout(rect=(0, 0.07, 1, 0.97))
    paths = [os.path.join(out, "ratios.png"), os.path.join(out, "ratios.svg")]
    for p in paths:
        fig.savefig(p, dpi=110, metadata={"Date": None} if p.endswith(".svg") else {"Software": None})
    plt.close(fig)
    return paths


def plot_oversubscription(d, out):
    """P4 streaming time against the oversubscription ratio (link-model configuration), with
    the transfer floor computed in the same run drawn beside it: both medians, in seconds
    per run, min-max as error bars. Returns the files written (none without such rows)."""
    p4 = d.get("p4") or {}
    rows = []
    for c in p4.get("configs", []):
        rows = [r for r in c.get("stream") or [] if r.get("floor_s")]
        if rows:
            break
    if not rows:
        return []
    import matplotlib
    matplotlib.use("Agg")
    matplotlib.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "gmem"})
    import matplotlib.pyplot as plt
    xs = [r["factor"] for r in rows]

    def series(get):
        med, lo, hi = [], [], []
        for r in rows:
            m, a, b = get(r)
            med.append(m)
            lo.append(m - a)
            hi.append(b - m)
        return med, [lo, hi]

    # Time per run: the row's time per byte times its bytes.
    t, terr = series(lambda r: tuple(r["per_unit"][k] * r["bytes"] * 1e-9 for k in ("median", "min", "max")))
    fl, flerr = series(lambda r: tuple(r["floor_s"][k] for k in ("median", "min", "max")))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.errorbar(xs, t, yerr=terr, marker="o", capsize=3, color="#c0392b", label="measured streaming time")
    ax.errorbar(xs, fl, yerr=flerr, marker="s", capsize=3, color="#2f6fdf", linestyle="--",
                label="transfer floor (same run)")
    # Labelled with the row's time / floor (the median of the per-repetition ratios).
    for x, a, r in zip(xs, t, rows):
        if isinstance(r.get("time_over_floor"), (int, float)):
            ax.annotate(f"{r['time_over_floor']:.2f}×", (x, a), textcoords="offset points", xytext=(4, 6), fontsize=8)
    ax.set_xlabel("oversubscription (region / device memory)")
    ax.set_ylabel("seconds per FILL + CHECKSUM run")
    ax.set_xticks(xs, [f"{x:g}×" for x in xs])
    ax.set_title(f"P4 streaming with the link model on ({p4.get('link_mbs')} MB/s host links, peer 4×)\n"
                 f"{d.get('mode')} run, QEMU TCG: compare the two curves, not absolute times", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths = [os.path.join(out, "oversubscription.png"), os.path.join(out, "oversubscription.svg")]
    for p in paths:
        fig.savefig(p, dpi=110, metadata={"Date": None} if p.endswith(".svg") else {"Software": None})
    plt.close(fig)
    return paths


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--console", help="guest console log")
    ap.add_argument("--from-json", help="redraw tables and plots from a results.json written earlier")
    ap.add_argument("--source", help="fingerprint file written by --fingerprint at build time")
    ap.add_argument("--fingerprint", action="store_true", help="print the source fingerprint and exit")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--smoke", action="store_true", help="only validate the JSON result")
    ap.add_argument("--quiet", action="store_true", help="do not print the table")
    a = ap.parse_args()
    if a.fingerprint:
        print(json.dumps(fingerprint()))
        return 0
    if a.from_json:
        with open(a.from_json) as fh:
            d = json.load(fh)
    elif not a.console:
        ap.error("--console or --from-json is required")
    else:
        try:
            d = extract(a.console)
        except ValueError as e:
            print(f"bench.py: {e}", file=sys.stderr)
            return 1
    if a.smoke:
        print(f"bench.py: valid JSON result ({d['mode']} mode, {len(d.get('errors') or [])} errors)")
        return 0
    if a.source:
        try:
            src = json.load(open(a.source))
            if "host_after" not in src:
                # First use, right after the run: record how busy the host was then (kept
                # in the file, so that regenerating the tables later does not change it).
                src["host_after"] = host_state()
                with open(a.source, "w") as fh:
                    json.dump(src, fh)
            d["source"] = src
        except (OSError, ValueError) as e:
            print(f"bench.py: ignoring --source {a.source}: {e}", file=sys.stderr)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "results.json"), "w") as fh:
        json.dump(d, fh, indent=1)
        fh.write("\n")
    md = markdown(d)
    with open(os.path.join(a.out, "results.md"), "w") as fh:
        fh.write(md)
    plot(d, a.out)
    plot_oversubscription(d, a.out)
    if not a.quiet:
        print(md)
    print(f"[bench] wrote {a.out}/results.json, results.md, ratios.png, ratios.svg, oversubscription.png, "
          f"oversubscription.svg", file=sys.stderr)
    if d.get("errors"):
        print(f"bench.py: {len(d['errors'])} benchmark(s) failed, see 'Errors'", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
