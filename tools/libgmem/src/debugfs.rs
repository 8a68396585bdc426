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

/// The words after `section:` on that section's line of device `dev` (e.g. `streams`: one
/// word per read-ahead stream), if the file and the line exist.
pub fn section_words(dev: u32, section: &str) -> Option<Vec<String>> {
    section_words_in(&std::fs::read_to_string(DEVICES).ok()?, dev, section)
}

pub fn section_words_in(text: &str, dev: u32, section: &str) -> Option<Vec<String>> {
    let mut cur = None;
    let head = format!("{section}:");
    for line in text.lines() {
        let mut words = line.split_whitespace();
        let Some(first) = words.next() else { continue };
        if !line.starts_with(' ') {
            cur = first.strip_prefix("dev").and_then(|d| d.parse::<u32>().ok());
        } else if cur == Some(dev) && first == head {
            return Some(words.map(str::to_string).collect());
        }
    }
    None
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

/// `/sys/kernel/debug/gmem/spaces`: one line per address space.
pub const SPACES: &str = "/sys/kernel/debug/gmem/spaces";
/// `/sys/kernel/debug/gmem/regions`: one line per region, with its residency map.
pub const REGIONS: &str = "/sys/kernel/debug/gmem/regions";

/// One address space (process) of the `spaces` file: its integer `key=value` fields
/// (`regions`, `pages`, `host`, `dev0`, `cpu_faults`, ...).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpaceLine {
    pub id: u64,
    pub pid: i32,
    pub fields: BTreeMap<String, u64>,
}

pub fn spaces() -> std::io::Result<Vec<SpaceLine>> {
    Ok(parse_spaces(&std::fs::read_to_string(SPACES)?))
}

/// The integer `key=value` words of a line (others, like `bytes_per_page=1.50`, skipped).
fn int_fields(line: &str) -> BTreeMap<String, u64> {
    line.split_whitespace()
        .filter_map(|w| w.split_once('='))
        .filter_map(|(k, v)| v.parse::<u64>().ok().map(|v| (k.to_string(), v)))
        .collect()
}

pub fn parse_spaces(text: &str) -> Vec<SpaceLine> {
    text.lines()
        .filter_map(|l| {
            let id = l.split_whitespace().next()?.strip_prefix("space")?.parse().ok()?;
            let pid = l.split_whitespace().find_map(|w| w.strip_prefix("pid="))?.parse().ok()?;
            Some(SpaceLine { id, pid, fields: int_fields(l) })
        })
        .collect()
}

/// Where a run of pages is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Place {
    /// Never touched (or discarded): no memory anywhere.
    Nowhere,
    Host,
    /// The data was lost when its device went away.
    Lost,
    Device(u32),
}

impl Place {
    /// The map's code: `-`, `h`, `l`, `dN`.
    pub fn code(self) -> String {
        match self {
            Place::Nowhere => "-".into(),
            Place::Host => "h".into(),
            Place::Lost => "l".into(),
            Place::Device(d) => format!("d{d}"),
        }
    }

    fn parse(code: &str) -> Option<Place> {
        match code {
            "-" => Some(Place::Nowhere),
            "h" => Some(Place::Host),
            "l" => Some(Place::Lost),
            _ => code.strip_prefix('d')?.parse().ok().map(Place::Device),
        }
    }
}

/// One region of the `regions` file: its runs of pages, in address order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionMap {
    pub space: u64,
    pub pid: i32,
    pub start: u64,
    pub pages: u64,
    pub runs: Vec<(Place, u64)>,
}

pub fn regions() -> std::io::Result<Vec<RegionMap>> {
    Ok(parse_regions(&std::fs::read_to_string(REGIONS)?))
}

pub fn parse_regions(text: &str) -> Vec<RegionMap> {
    text.lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            let space = w.next()?.strip_prefix("space")?.parse().ok()?;
            let (mut pid, mut start, mut pages, mut runs) = (None, None, None, None);
            for word in w {
                match word.split_once('=')? {
                    ("pid", v) => pid = v.parse().ok(),
                    ("start", v) => start = u64::from_str_radix(v.trim_start_matches("0x"), 16).ok(),
                    ("pages", v) => pages = v.parse().ok(),
                    ("map", v) => {
                        runs = v
                            .split(',')
                            .filter(|r| !r.is_empty())
                            .map(|r| {
                                let (c, n) = r.split_once(':')?;
                                Some((Place::parse(c)?, n.parse().ok()?))
                            })
                            .collect::<Option<Vec<_>>>()
                    }
                    _ => {}
                }
            }
            Some(RegionMap { space, pid: pid?, start: start?, pages: pages?, runs: runs? })
        })
        .collect()
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

    #[test]
    fn a_sections_words_are_found_for_its_device() {
        let t = "dev0 frames=8\n  streams: 0x1000@0x0..0x200000 -\n\ndev1 frames=8\n  streams: - -\n";
        assert_eq!(section_words_in(t, 0, "streams"), Some(vec!["0x1000@0x0..0x200000".into(), "-".into()]));
        assert_eq!(section_words_in(t, 1, "streams"), Some(vec!["-".into(), "-".into()]));
        assert_eq!(section_words_in(t, 2, "streams"), None);
        assert_eq!(section_words_in(t, 0, "faults"), None);
    }

    #[test]
    fn spaces_and_region_maps_parse() {
        let t = "space3 pid=77 regions=1 pages=1024 none=256 host=256 lost=0 dev0=512 pinned=0 bytes_per_page=1.50\n";
        let s = parse_spaces(t);
        assert_eq!((s[0].id, s[0].pid, s[0].fields["dev0"], s[0].fields.get("bytes_per_page")), (3, 77, 512, None));
        let r = parse_regions("space3 pid=77 start=0x7f0000000000 pages=1024 map=d0:512,h:256,-:256\nspace3 pid=77 start=0x10 pages=4 map=\n");
        assert_eq!(r[0].start, 0x7f00_0000_0000);
        assert_eq!(r[0].runs, vec![(Place::Device(0), 512), (Place::Host, 256), (Place::Nowhere, 256)]);
        assert!(r[1].runs.is_empty());
        assert!(parse_regions("space1 pid=1 start=0x0 pages=1 map=x9:1\n").is_empty());
    }
}
