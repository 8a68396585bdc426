// SPDX-License-Identifier: GPL-2.0
//! gmem's trace events through tracefs (`events/gmem/`): switch them on and off, read and
//! clear the buffer, and parse the `gmem_*` lines into their `key=value` fields.

use std::collections::BTreeMap;
use std::path::Path;

/// The tracefs directory (mounted at /sys/kernel/tracing if it is not yet).
pub fn dir() -> std::io::Result<&'static str> {
    const T: &str = "/sys/kernel/tracing";
    if !Path::new(T).join("events").exists() {
        let st = std::process::Command::new("mount").args(["-t", "tracefs", "nodev", T]).status()?;
        if !st.success() || !Path::new(T).join("events/gmem").exists() {
            return Err(std::io::Error::new(std::io::ErrorKind::NotFound, "no tracefs with events/gmem"));
        }
    }
    Ok(T)
}

fn put(file: &str, v: &str) -> std::io::Result<()> {
    std::fs::write(format!("{}/{file}", dir()?), v)
}

/// Switches every gmem event on (`true`) or off, and tracing with it.
pub fn enable(on: bool) -> std::io::Result<()> {
    put("events/gmem/enable", if on { "1" } else { "0" })?;
    put("tracing_on", if on { "1" } else { "0" })
}

/// Empties the trace buffer.
pub fn clear() -> std::io::Result<()> {
    put("trace", "")
}

/// One recorded event: its name (`dev_fault`, `migrate`, ...) and fields. Numeric fields
/// are in `num`; others (`dir=h2d`) in `text`.
#[derive(Debug, Clone, Default)]
pub struct Event {
    pub name: String,
    pub num: BTreeMap<String, i64>,
    pub text: BTreeMap<String, String>,
}

/// The gmem events of the buffer (not consumed).
pub fn read() -> std::io::Result<Vec<Event>> {
    Ok(parse(&std::fs::read_to_string(format!("{}/trace", dir()?))?))
}

pub fn parse(text: &str) -> Vec<Event> {
    text.lines()
        .filter_map(|l| {
            let at = l.find(" gmem_")?;
            let rest = &l[at + 6..];
            let (name, fields) = rest.split_once(": ")?;
            let mut e = Event { name: name.to_string(), ..Default::default() };
            for w in fields.split_whitespace() {
                let (k, v) = w.split_once('=')?;
                match v.strip_prefix("0x").map_or_else(|| v.parse::<i64>().ok(), |h| i64::from_str_radix(h, 16).ok()) {
                    Some(n) => e.num.insert(k.to_string(), n),
                    None => e.text.insert(k.to_string(), v.to_string()).map(|_| 0),
                };
            }
            Some(e)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_gmem_lines_only() {
        let t = "# tracer: nop\n  gmem-tests-81  [001] .....  12.5: gmem_migrate: dir=h2d dev=0 peer=-1 pages=64 bytes=262144\n  x-1 [000] ..... 1.0: sched_switch: prev=a\n  gmem-tests-81 [001] ..... 12.6: gmem_cpu_fault: space=3 addr=0x7f00 write=1 from=-1 pages=1 err=0\n";
        let e = parse(t);
        assert_eq!(e.len(), 2);
        assert_eq!(
            (e[0].name.as_str(), e[0].text["dir"].as_str(), e[0].num["pages"], e[0].num["peer"]),
            ("migrate", "h2d", 64, -1)
        );
        assert_eq!((e[1].name.as_str(), e[1].num["addr"]), ("cpu_fault", 0x7f00));
    }
}
