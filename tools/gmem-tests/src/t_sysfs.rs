// SPDX-License-Identifier: GPL-2.0
//! `/sys/class/gmem/gmemN` (Documentation/ABI/testing/sysfs-class-gmem): every attribute
//! equals its debugfs counterpart, the watermarks are writable with the same checks as
//! debugfs `control`, and a node lives exactly as long as its device.

use crate::harness::{open, sh, Test, TestResult};
use crate::{ensure, ok};
use libgmem::csample::CSample;
use libgmem::debugfs;

fn node(id: u32) -> String {
    format!("/sys/class/gmem/gmem{id}")
}

fn read(id: u32, attr: &str) -> Result<u64, String> {
    let p = format!("{}/{attr}", node(id));
    let t = std::fs::read_to_string(&p).map_err(|e| format!("{p}: {e}"))?;
    t.trim().parse().map_err(|e| format!("{p}: {t:?}: {e}"))
}

/// sysfs attribute -> debugfs `devices` key.
const PAIRS: &[(&str, &str)] = &[
    ("frames", "frames"),
    ("used", "used"),
    ("pinned", "pinned"),
    ("lent", "lent"),
    ("alive", "alive"),
    ("watermark_low", "low"),
    ("watermark_high", "high"),
    ("stats/fault_batches", "faults.batches"),
    ("stats/faults", "faults.pages"),
    ("stats/pages_h2d", "migrated.h2d"),
    ("stats/pages_d2h", "migrated.d2h"),
    ("stats/pages_d2d", "migrated.d2d"),
    ("stats/pages_zeroed", "migrated.zeroed"),
    ("stats/prefetched", "prefetch.pages"),
    ("stats/evicted_to_host", "evicted.to_host"),
    ("stats/evicted_to_peer", "evicted.to_peer"),
    ("stats/evicted_clean", "evicted.clean_dropped"),
    ("stats/pre_evicted", "evicted.pre_evicted"),
    ("stats/writebacks", "evicted.writebacks"),
    ("stats/evacuated", "evicted.evacuated"),
    ("stats/lost", "evicted.lost"),
    ("stats/thrash_events", "prefetch.thrash_events"),
];

fn sysfs_matches_debugfs() -> TestResult {
    let (g, s) = open()?;
    // Some activity first, so that the counters are not all zero.
    let r = ok!(g.alloc(64 * 4096));
    ok!(s.fill(r.addr, r.len as u64, 5));
    drop(r);
    let c = debugfs::counters().map_err(|e| e.to_string())?;
    for id in [0u32, 1] {
        let dc = c.get(&id).ok_or(format!("debugfs has no device {id}"))?;
        for (attr, key) in PAIRS {
            let want = dc.get(*key).copied().ok_or(format!("debugfs has no {key}"))?;
            let got = read(id, attr)?;
            ensure!(got == want, "gmem{id}/{attr} = {got}, debugfs {key} = {want}");
        }
    }
    ensure!(read(0, "frames")? == ok!(s.info()).nr_frames, "frames differs from the driver's");
    ensure!(read(0, "stats/faults")? > 0, "no faults counted after a device fill");
    Ok(())
}

fn write(id: u32, attr: &str, v: &str) -> std::io::Result<()> {
    std::fs::write(format!("{}/{attr}", node(id)), v)
}

fn watermarks_are_writable_and_checked() -> TestResult {
    let (low, high, frames) = (read(1, "watermark_low")?, read(1, "watermark_high")?, read(1, "frames")?);
    let r = (|| -> TestResult {
        write(1, "watermark_high", &(high + 8).to_string()).map_err(|e| e.to_string())?;
        ensure!(read(1, "watermark_high")? == high + 8, "watermark_high not stored");
        let ctl = crate::t_overcommit::control_text()?;
        ensure!(ctl.contains(&format!("dev=1 low={low} high={}", high + 8)), "control does not show it:\n{ctl}");
        for (attr, v) in [
            ("watermark_low", (high + 9).to_string()),
            ("watermark_high", (frames + 1).to_string()),
            ("watermark_low", "x".into()),
            ("frames", "1".into()),
        ] {
            match write(1, attr, &v) {
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL) | Some(libc::EACCES)) => {}
                other => {
                    return Err(format!(
                        "writing {v:?} to {attr}: {other:?}, expected EINVAL (EACCES for a read-only file)"
                    ))
                }
            }
        }
        ensure!(read(1, "watermark_low")? == low, "a refused write changed watermark_low");
        Ok(())
    })();
    // Put the defaults back whatever happened.
    let _ = write(1, "watermark_high", &high.to_string());
    r
}

fn node_lives_with_its_device() -> TestResult {
    if !std::path::Path::new("/sys/module/gmem_csample").exists() {
        sh("insmod /lib/gmem/gmem_csample.ko nr_devices=1 mem_kib=1024")?;
    }
    let r = (|| -> TestResult {
        let cs = CSample::open(0).map_err(|e| e.to_string())?;
        let id = ok!(cs.info()).gmem_id as u32;
        ensure!(
            read(id, "frames")? == 256 && read(id, "alive")? == 1,
            "gmem{id}: frames {:?} alive {:?}",
            read(id, "frames"),
            read(id, "alive")
        );
        ok!(cs.unplug());
        ensure!(!std::path::Path::new(&node(id)).exists(), "{} still exists after unplug", node(id));
        Ok(())
    })();
    sh("rmmod gmem_csample")?;
    r
}

pub fn tests() -> Vec<Test> {
    vec![
        Test { name: "sysfs_matches_debugfs", f: sysfs_matches_debugfs },
        Test { name: "sysfs_watermarks_are_writable_and_checked", f: watermarks_are_writable_and_checked },
        Test { name: "sysfs_node_lives_with_its_device", f: node_lives_with_its_device },
    ]
}
