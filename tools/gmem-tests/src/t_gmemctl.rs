// SPDX-License-Identifier: GPL-2.0
//! `gmemctl` against known states: what it prints (JSON and tables) must equal what the
//! test set up and what GMEM_IOC_QUERY reports for the same pages.

use crate::harness::{open, Test, TestResult};
use crate::{ensure, ok};
use libgmem::*;
use serde_json::Value;
use std::process::Command;

const GMEMCTL: &str = "/bin/gmemctl";

/// Runs gmemctl; its exit code and stdout.
fn gmemctl(args: &[&str]) -> std::result::Result<(i32, String), String> {
    let out = Command::new(GMEMCTL).args(args).output().map_err(|e| format!("{GMEMCTL}: {e}"))?;
    Ok((out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into_owned()))
}

fn json(args: &[&str]) -> std::result::Result<Value, String> {
    let (code, out) = gmemctl(args)?;
    ensure!(code == 0, "gmemctl {args:?} exited {code}");
    serde_json::from_str(&out).map_err(|e| format!("gmemctl {args:?}: not JSON ({e}): {out}"))
}

/// The run-length map of a region as QUERY sees it, in gmemctl's codes.
fn runs_from_query(states: &[u32]) -> Vec<(String, u64)> {
    let mut runs: Vec<(String, u64)> = Vec::new();
    for &s in states {
        let code = match q_loc(s) {
            GMEM_LOC_HOST => "h".to_string(),
            GMEM_LOC_DEVICE => format!("d{}", q_dev(s)),
            GMEM_LOC_LOST => "l".to_string(),
            _ => "-".to_string(),
        };
        match runs.last_mut() {
            Some((c, n)) if *c == code => *n += 1,
            _ => runs.push((code, 1)),
        }
    }
    runs
}

/// 1024 pages: 512 prefetched to device 0, 256 written by the CPU, 256 untouched.
fn known_state(g: &Gmem) -> std::result::Result<Region<'_>, String> {
    let r = ok!(g.alloc(1024 * 4096));
    ok!(g.advise(r.addr, 512 * 4096, GMEM_ADV_PREFETCH, 0, 0));
    for p in 512..768 {
        // SAFETY: inside the region, mapped read/write.
        unsafe { std::ptr::write_volatile((r.addr + p * 4096) as *mut u32, p as u32) };
    }
    Ok(r)
}

fn regions_map_equals_query() -> TestResult {
    let (g, _s) = open()?;
    let r = known_state(&g)?;
    let pid = std::process::id().to_string();
    let doc = json(&["regions", &pid, "--json", "--width", "8"])?;
    let start = format!("{:#x}", r.addr);
    let reg = doc["regions"].as_array().and_then(|a| a.iter().find(|x| x["start"] == start.as_str()));
    let Some(reg) = reg else { return Err(format!("region {start} missing: {doc}")) };
    let runs: Vec<(String, u64)> = serde_json::from_value(reg["runs"].clone()).map_err(|e| e.to_string())?;
    let want = runs_from_query(&ok!(r.query()));
    ensure!(runs == want, "gmemctl runs {runs:?}, QUERY {want:?}");
    ensure!(runs.first() == Some(&("d0".to_string(), 512)), "first run {:?}, expected 512 pages on d0", runs.first());
    ensure!(reg["pages"] == 1024 && reg["bar"] == "0000hh..", "pages {} bar {}", reg["pages"], reg["bar"]);
    // The table shows the same bar.
    let (code, text) = gmemctl(&["regions", &pid, "--width", "8"])?;
    ensure!(code == 0 && text.contains("[0000hh..]"), "table (exit {code}):\n{text}");
    Ok(())
}

fn status_reports_devices_and_this_process() -> TestResult {
    let (g, s) = open()?;
    let r = known_state(&g)?;
    let doc = json(&["status", "--json"])?;
    let frames = ok!(s.info()).nr_frames;
    let devs = doc["devices"].as_array().ok_or("no devices array")?;
    let d0 = devs.iter().find(|d| d["id"] == 0).ok_or("device 0 missing")?;
    ensure!(d0["frames"] == frames && d0["alive"] == true, "device 0: {d0}");
    ensure!(
        d0["used"].as_u64().is_some_and(|u| u >= 512),
        "device 0 uses {} frames, 512 expected at least",
        d0["used"]
    );
    let me = doc["processes"].as_array().and_then(|a| a.iter().find(|p| p["pid"] == std::process::id()));
    let Some(me) = me else { return Err(format!("this process is missing: {doc}")) };
    ensure!(me["pages"] == 1024 && me["devices"]["0"] == 512 && me["host"] == 256, "this process: {me}");
    let (code, text) = gmemctl(&["status"])?;
    ensure!(
        code == 0 && text.contains("GMEM devices") && text.contains(&format!("{:>8}", std::process::id())),
        "table:\n{text}"
    );
    drop(r);
    Ok(())
}

fn top_refreshes_with_rates() -> TestResult {
    let (code, out) = gmemctl(&["top", "--iterations", "2", "--interval", "0.2", "--json"])?;
    ensure!(code == 0, "top exited {code}");
    let lines: Vec<Value> =
        out.lines().map(serde_json::from_str).collect::<std::result::Result<_, _>>().map_err(|e| e.to_string())?;
    ensure!(lines.len() == 2, "{} refreshes, 2 asked", lines.len());
    ensure!(
        lines[0]["rates_per_s"].is_null() && lines[1]["rates_per_s"].is_object(),
        "rates: {} / {}",
        lines[0]["rates_per_s"],
        lines[1]["rates_per_s"]
    );
    Ok(())
}

fn refuses_bad_input() -> TestResult {
    let (code, _) = gmemctl(&["regions", "not-a-pid"])?;
    ensure!(code == 2, "a bad pid argument: exit {code}, expected 2 (usage)");
    let (code, _) = gmemctl(&["regions", "2147483647"])?;
    ensure!(code == 1, "a process without regions: exit {code}, expected 1");
    let (code, out) = gmemctl(&["--help"])?;
    ensure!(code == 0 && out.contains("regions") && out.contains("--json"), "--help:\n{out}");
    Ok(())
}

fn trace_summarizes_a_workload() -> TestResult {
    let (g, s) = open()?;
    let child = Command::new(GMEMCTL)
        .args(["trace", "--iterations", "1", "--interval", "3", "--json"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    // Give it time to switch the events on, then run 128 pages through device 0.
    std::thread::sleep(std::time::Duration::from_millis(700));
    let r = ok!(g.alloc(128 * 4096));
    ok!(s.fill(r.addr, r.len as u64, 4));
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    ensure!(out.status.success(), "gmemctl trace: {}", out.status);
    let doc: Value = serde_json::from_slice(&out.stdout).map_err(|e| format!("not JSON ({e})"))?;
    let d0 = &doc["devices"]["0"];
    let moved = d0["zeroed"].as_i64().unwrap_or(0) + d0["h2d"].as_i64().unwrap_or(0);
    ensure!(d0["fault_batches"].as_u64().is_some_and(|b| b >= 1) && moved >= 128, "device 0 in the summary: {d0}");
    let on = std::fs::read_to_string("/sys/kernel/tracing/events/gmem/enable").map_err(|e| e.to_string())?;
    ensure!(on.trim() == "0", "gmemctl trace left the events on ({on:?})");
    Ok(())
}

pub fn tests() -> Vec<Test> {
    vec![
        Test { name: "gmemctl_trace_summarizes_a_workload", f: trace_summarizes_a_workload },
        Test { name: "gmemctl_regions_map_equals_query", f: regions_map_equals_query },
        Test { name: "gmemctl_status_reports_devices_and_this_process", f: status_reports_devices_and_this_process },
        Test { name: "gmemctl_top_refreshes_with_rates", f: top_refreshes_with_rates },
        Test { name: "gmemctl_refuses_bad_input", f: refuses_bad_input },
    ]
}
