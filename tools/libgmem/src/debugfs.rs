// SPDX-License-Identifier: GPL-2.0
//! GMEM's debugfs counters (`/sys/kernel/debug/gmem/devices`), parsed once for every tool.
//!
//! Keys are `section.name` (`faults.allocs`, `evicted.to_peer`, `prefetch.pages`, ...); the
//! header line's keys have no section (`frames`, `used`, ...).

use std::collections::BTreeMap;

pub const DEVICES: &str = "/sys/kernel/debug/gmem/devices";

/// Counters by device id, then key.
pub type Counters = BTreeMap<u32, BTreeMap<String, u64>>;

/// Reads and parses the devices file.
pub fn counters() -> std::io::Result<Counters> {
    Ok(parse(&std::fs::read_to_string(DEVICES)?))
}

/// One counter of one device, if the file and the counter exist.
pub fn counter(dev: u32, key: &str) -> Option<u64> {
    counters().ok()?.get(&dev)?.get(key).copied()
}

pub fn parse(text: &str) -> Counters {
    let mut out = Counters::new();
    let mut dev = None;
    for line in text.lines() {
        let mut words = line.split_whitespace();
        let Some(first) = words.next() else { continue };
        let section = if !line.starts_with(' ') {
            dev = first.strip_prefix("dev").and_then(|d| d.parse::<u32>().ok());
            String::new()
        } else {
            format!("{}.", first.trim_end_matches(':'))
        };
        let Some(d) = dev else { continue };
        let m = out.entry(d).or_default();
        for w in line.split_whitespace() {
            if let Some((k, v)) = w.split_once('=') {
                if let Ok(v) = v.parse::<u64>() {
                    m.insert(format!("{section}{k}"), v);
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sections_qualify_keys_per_device() {
        let t = "dev0 frames=4096 used=3 alive=1\n  faults: batches=2 pages=512\n  evicted: to_host=1 to_peer=7\ndev1 frames=8\n  evicted: to_peer=9\n";
        let c = parse(t);
        assert_eq!(c[&0]["frames"], 4096);
        assert_eq!(c[&0]["faults.pages"], 512);
        assert_eq!(c[&0]["evicted.to_peer"], 7);
        assert_eq!(c[&1]["evicted.to_peer"], 9);
        assert!(!c[&1].contains_key("faults.pages"));
    }
}
