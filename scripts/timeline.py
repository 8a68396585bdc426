#!/usr/bin/env python3
"""Timeline of one PL or P4 run from a traced bench console (make bench BENCH_TRACE=1).

The guest prints its ftrace buffer between GMEM-TRACE-BEGIN and GMEM-TRACE-END: gmem's
events (device faults with their service time, copy-engine calls, density prefetch,
eviction), the scheduler's switches and wakeups, and gmem-bench's markers around each
timed PL or PS run ("GMEM-PL start <kind> <rep>", "GMEM-PL end ...") and each P4 run
("GMEM-P4 start <config>_<kind>_<factor x 100> <rep>"). Times print in ms from the run's
start.

usage: timeline.py --console LOG                       list the traced runs
       timeline.py --console LOG --run device_faults 2 [--sched]
       timeline.py --console LOG --run link_preevict1_prefetch1_stream_200 0
"""
import argparse
import re
import sys

LINE = re.compile(r"^\s*(?P<task>.+?)-(?P<pid>\d+)\s+\[(?P<cpu>\d+)\]\s+\S+\s+(?P<ts>\d+\.\d+):\s+"
                  r"(?P<event>\w+):\s*(?P<body>.*)$")
MARK = re.compile(r"GMEM-P[L4S] (start|end) (\w+) (\d+)")
SWITCH = re.compile(r"prev_comm=(\S+) .*prev_state=(\S+) ==> next_comm=(\S+)")


def events(path):
    """The trace's events as (seconds, task, cpu, event, body), in order."""
    with open(path, errors="replace") as f:
        text = f.read()
    if "GMEM-TRACE-BEGIN" not in text:
        sys.exit(f"{path}: no GMEM-TRACE-BEGIN (run make bench BENCH_TRACE=1)")
    body = text.split("GMEM-TRACE-BEGIN", 1)[1].split("GMEM-TRACE-END", 1)[0]
    out = []
    for line in body.splitlines():
        m = LINE.match(line)
        if m:
            out.append((float(m["ts"]), m["task"], int(m["cpu"]), m["event"], m["body"]))
    return out


def runs(evs):
    """{(kind, rep): (start, end)} from the benchmark's markers."""
    starts, spans = {}, {}
    for ts, _, _, ev, body in evs:
        m = MARK.search(body) if ev == "tracing_mark_write" else None
        if m and m[1] == "start":
            starts[(m[2], int(m[3]))] = ts
        elif m and (m[2], int(m[3])) in starts:
            spans[(m[2], int(m[3]))] = (starts[(m[2], int(m[3]))], ts)
    return spans


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--console", required=True)
    ap.add_argument("--run", nargs=2, metavar=("KIND", "REP"))
    ap.add_argument("--sched", action="store_true", help="also show context switches")
    a = ap.parse_args()
    evs = events(a.console)
    spans = runs(evs)
    if not a.run:
        for (kind, rep), (t0, t1) in sorted(spans.items()):
            print(f"{kind:18s} rep {rep:2d}: {(t1 - t0) * 1e3:8.3f} ms")
        return 0
    key = (a.run[0], int(a.run[1]))
    if key not in spans:
        sys.exit(f"no traced run {key}; runs: {sorted(spans)}")
    t0, t1 = spans[key]
    for ts, task, cpu, ev, body in evs:
        if not t0 <= ts <= t1 or ev == "sched_wakeup":
            continue
        at = (ts - t0) * 1e3
        if ev == "sched_switch":
            m = SWITCH.search(body)
            if a.sched and m:
                print(f"{at:9.3f} cpu{cpu}  switch {m[1]}({m[2]}) -> {m[3]}")
            continue
        if ev == "gmem_dev_fault":
            ns = re.search(r"ns=(\d+)", body)
            if ns:
                body += f"  (began at {at - int(ns[1]) / 1e6:.3f})"
        print(f"{at:9.3f} cpu{cpu}  {task}: {ev} {body}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
