// SPDX-License-Identifier: GPL-2.0
//! gmem's trace events (events/gmem/ in tracefs): a workload traced from start to end
//! must give events whose fields add up exactly to what the counters moved by, and an
//! unplug must report the pages it evacuated.

use crate::harness::{open, sh, Test, TestResult};
use crate::{ensure, ok};
use libgmem::csample::CSample;
use libgmem::trace::{self, Event};
use libgmem::{debugfs, Gmem};

/// Sum of field `f` of the events named `name` that satisfy `keep`.
fn sum(ev: &[Event], name: &str, f: &str, keep: impl Fn(&Event) -> bool) -> i64 {
    ev.iter().filter(|e| e.name == name && keep(e)).map(|e| e.num.get(f).copied().unwrap_or(0)).sum()
}

fn delta(c0: &debugfs::Counters, c1: &debugfs::Counters, dev: u32, key: &str) -> i64 {
    let g = |c: &debugfs::Counters| c.get(&dev).and_then(|m| m.get(key)).copied().unwrap_or(0) as i64;
    g(c1) - g(c0)
}

fn my_cpu_faults() -> Result<i64, String> {
    Ok(crate::harness::my_space_stat("cpu_faults")? as i64)
}

fn events_add_up_to_the_counters() -> TestResult {
    let (g, s0) = open()?;
    let s1 = libgmem::sim::Sim::open(1).map_err(|e| e.to_string())?;
    trace::dir().map_err(|e| format!("tracefs: {e}"))?;
    trace::enable(false).map_err(|e| e.to_string())?;
    trace::clear().map_err(|e| e.to_string())?;
    trace::enable(true).map_err(|e| e.to_string())?;
    let (c0, f0) = (debugfs::counters().map_err(|e| e.to_string())?, my_cpu_faults()?);
    let r = (|| -> TestResult {
        let r = ok!(g.alloc(300 * 4096));
        ok!(s0.fill(r.addr, r.len as u64, 1)); // device faults; zero-filled frames
        ok!(s1.checksum(r.addr, r.len as u64)); // peer copies device 0 -> device 1
        let w = crate::harness::words(&r);
        let bad = w.iter().enumerate().filter(|(i, &x)| x != 1 + *i as u32).count(); // CPU faults, D2H
        ensure!(bad == 0, "{bad} words wrong");
        Ok(())
    })();
    let (c1, f1) = (debugfs::counters().map_err(|e| e.to_string())?, my_cpu_faults()?);
    trace::enable(false).map_err(|e| e.to_string())?;
    r?;
    let ev = trace::read().map_err(|e| e.to_string())?;
    for d in [0u32, 1] {
        let dev = |e: &Event| e.num.get("dev") == Some(&(d as i64));
        let checks = [
            ("dev_fault", "pages", "faults.pages", None),
            ("migrate", "pages", "migrated.h2d", Some("h2d")),
            ("migrate", "pages", "migrated.d2h", Some("d2h")),
            ("migrate", "pages", "migrated.d2d", Some("d2d")),
            ("migrate", "pages", "migrated.zeroed", Some("zero")),
            ("prefetch", "pages", "prefetch.pages", None),
            ("evict", "to_host", "evicted.to_host", None),
            ("evict", "to_peer", "evicted.to_peer", None),
            ("evict", "clean", "evicted.clean_dropped", None),
            ("thrash", "held", "prefetch.thrash_events", None),
        ];
        for (name, field, key, dir) in checks {
            let got = sum(&ev, name, field, |e| {
                dev(e) && dir.is_none_or(|x| e.text.get("dir").map(String::as_str) == Some(x))
            });
            let want = delta(&c0, &c1, d, key);
            ensure!(got == want, "device {d}: {name} {field} {dir:?} sums to {got}, counter {key} moved by {want}");
        }
        let batches = ev.iter().filter(|e| e.name == "dev_fault" && dev(e)).count() as i64;
        ensure!(batches == delta(&c0, &c1, d, "faults.batches"), "device {d}: {batches} dev_fault events");
    }
    let cpu = ev.iter().filter(|e| e.name == "cpu_fault").count() as i64;
    ensure!(cpu == f1 - f0, "{cpu} cpu_fault events, the space counted {}", f1 - f0);
    // The workload did each kind at least once, and nothing failed.
    for (name, dir) in [
        ("dev_fault", None),
        ("migrate", Some("zero")),
        ("migrate", Some("d2d")),
        ("migrate", Some("d2h")),
        ("cpu_fault", None),
    ] {
        let n = ev
            .iter()
            .filter(|e| e.name == name && dir.is_none_or(|x| e.text.get("dir").map(String::as_str) == Some(x)))
            .count();
        ensure!(n > 0, "no {name} {dir:?} event");
    }
    ensure!(ev.iter().all(|e| e.num.get("err").is_none_or(|&x| x == 0)), "an event reports an error");
    Ok(())
}

fn unplug_reports_what_it_evacuated() -> TestResult {
    if !std::path::Path::new("/sys/module/gmem_csample").exists() {
        sh("insmod /lib/gmem/gmem_csample.ko nr_devices=1 mem_kib=1024")?;
    }
    let r = (|| -> TestResult {
        let cs = CSample::open(0).map_err(|e| e.to_string())?;
        let id = ok!(cs.info()).gmem_id as i64;
        let g = Gmem::open().map_err(|e| e.to_string())?;
        let r = ok!(g.alloc(100 * 4096));
        ok!(cs.fill(r.addr, r.len as u64, 9));
        trace::clear().map_err(|e| e.to_string())?;
        trace::enable(true).map_err(|e| e.to_string())?;
        let u = cs.unplug();
        trace::enable(false).map_err(|e| e.to_string())?;
        ok!(u);
        let ev = trace::read().map_err(|e| e.to_string())?;
        let un: Vec<&Event> = ev.iter().filter(|e| e.name == "unregister").collect();
        ensure!(un.len() == 1, "{} unregister events", un.len());
        let e = un[0];
        ensure!(
            e.num["dev"] == id && e.num["evacuated"] == 100 && e.num["lost"] == 0 && e.num["contexts"] == 1,
            "unregister event {:?}",
            e.num
        );
        // The evacuation's copies are traced as well: 100 pages device -> host.
        let d2h = sum(&ev, "migrate", "pages", |e| {
            e.num.get("dev") == Some(&id) && e.text.get("dir").map(String::as_str) == Some("d2h")
        });
        ensure!(d2h == 100, "{d2h} pages traced device {id} -> host");
        Ok(())
    })();
    sh("rmmod gmem_csample")?;
    r
}

pub fn tests() -> Vec<Test> {
    vec![
        Test { name: "trace_events_add_up_to_the_counters", f: events_add_up_to_the_counters },
        Test { name: "trace_unplug_reports_what_it_evacuated", f: unplug_reports_what_it_evacuated },
    ]
}
