// SPDX-License-Identifier: GPL-2.0
//! gmem-demo: a short walk through GMEM to read on the console (`make run`). One allocation
//! is used by the CPU and two simulated devices at the same address; each step prints one
//! line (what it did, what it observed, where the pages are per the residency oracle) and
//! checks what it prints. The last line is `GMEM-DEMO ok`, or `GMEM-DEMO FAILED: <reason>`
//! with exit status 1.

use libgmem::sim::{checksum, Sim};
use libgmem::*;
use std::collections::BTreeMap;

/// 1024 pages: well below the 4096 frames of each simulated device.
const SIZE: u64 = 4 << 20;

type Res<T> = std::result::Result<T, String>;

/// A kernel errno, with what was being done.
fn ck<T>(r: libgmem::Result<T>, what: &str) -> Res<T> {
    r.map_err(|e| format!("{what}: {e}"))
}

fn ensure(ok: bool, why: impl FnOnce() -> String) -> Res<()> {
    if ok {
        Ok(())
    } else {
        Err(why())
    }
}

/// Runs `f` on the region's memory as u32 words (CPU accesses fault pages home).
fn with_words<T>(r: &Region<'_>, f: impl FnOnce(&mut [u32]) -> T) -> T {
    // SAFETY: GMEM maps [addr, addr+len) read/write and page-aligned until the region is
    // freed; the slice lives only during `f`, and device kernels run only inside ioctls.
    f(unsafe { std::slice::from_raw_parts_mut(r.as_ptr().cast::<u32>(), r.len / 4) })
}

/// Pages per location ("device0 1024", "host 12, none 1012"), then the notable flags.
fn summary(states: &[u32]) -> String {
    let mut locs = BTreeMap::<String, usize>::new();
    let mut flags = [("pinned", GMEM_Q_PINNED, 0), ("duplicated", GMEM_Q_DUP, 0), ("remote-mapped", GMEM_Q_REMOTE, 0)];
    for &w in states {
        let loc = match q_loc(w) {
            GMEM_LOC_NONE => "none".to_string(),
            GMEM_LOC_HOST => "host".to_string(),
            GMEM_LOC_DEVICE => format!("device{}", q_dev(w)),
            l => format!("location{l}?"),
        };
        *locs.entry(loc).or_default() += 1;
        for (_, bit, n) in flags.iter_mut() {
            *n += usize::from(w & *bit != 0);
        }
    }
    let mut parts: Vec<String> = locs.iter().map(|(l, n)| format!("{l} {n}")).collect();
    parts.extend(flags.iter().filter(|f| f.2 > 0).map(|(name, _, n)| format!("{name} {n}")));
    parts.join(", ")
}

/// Queries the oracle, prints the step's line and returns the states for checking.
fn step(n: u32, said: String, r: &Region<'_>) -> Res<Vec<u32>> {
    let q = ck(r.query(), "QUERY")?;
    println!("{n}. {said} -> pages now: {}", summary(&q));
    Ok(q)
}

/// Every page is at `loc` (on device `dev` for GMEM_LOC_DEVICE).
fn all_at(q: &[u32], loc: u32, dev: i32, what: &str) -> Res<()> {
    let bad = q.iter().position(|&w| q_loc(w) != loc || (loc == GMEM_LOC_DEVICE && q_dev(w) != dev as u32));
    ensure(bad.is_none(), || format!("{what}: page {} has state {:#x}", bad.unwrap_or(0), q[bad.unwrap_or(0)]))
}

fn eq(got: u64, want: u64) -> &'static str {
    if got == want {
        "=="
    } else {
        "!="
    }
}

fn run() -> Res<()> {
    let g = Gmem::open().map_err(|e| format!("open /dev/gmem: {e}"))?;
    let v = ck(g.version(), "VERSION")?;
    let s0 = Sim::open(0).map_err(|e| format!("open /dev/gmem_sim0: {e}"))?;
    let s1 = Sim::open(1).map_err(|e| format!("open /dev/gmem_sim1: {e}"))?;
    let (d0, d1) = (ck(s0.info(), "sim0 INFO")?.gmem_id, ck(s1.info(), "sim1 INFO")?.gmem_id);
    println!(
        "GMEM demo: uapi v{}, {} devices; /dev/gmem_sim0 is device {d0}, /dev/gmem_sim1 is device {d1}",
        v.version, v.nr_devices
    );
    ensure(d0 >= 0 && d1 >= 0 && d0 != d1, || format!("bad device ids {d0} {d1}"))?;

    let r = ck(g.alloc(SIZE), "ALLOC 4 MiB")?;
    let (len, np) = (r.len as u64, r.pages() as u64);
    let q = step(1, format!("allocate 4 MiB through /dev/gmem: addr {:#x}, nothing allocated yet", r.addr), &r)?;
    all_at(&q, GMEM_LOC_NONE, 0, "fresh region")?;

    let sum = with_words(&r, |w| {
        for (i, x) in w.iter_mut().enumerate() {
            *x = (i as u32).wrapping_mul(2_654_435_761) ^ 0x5eed;
        }
        checksum(w)
    });
    let q = step(2, format!("CPU writes a pattern, checksum {sum:#x}"), &r)?;
    all_at(&q, GMEM_LOC_HOST, 0, "after CPU writes")?;

    let (pre0, ra0) = (prefetched(d0), read_ahead(d0));
    let o = ck(s0.checksum(r.addr, len), "device 0 CHECKSUM")?;
    let pre = prefetched(d0).zip(pre0).map(|(a, b)| a - b);
    let ra = read_ahead(d0).zip(ra0).map(|(a, b)| a - b);
    let said = format!(
        "device {d0} checksums it: {:#x} {} CPU's {sum:#x} ({} device faults in {} batches, {} pages prefetched with them)",
        o.result,
        eq(o.result, sum),
        o.faults,
        o.batches,
        pre.map_or("?".into(), |p| p.to_string())
    );
    let q = step(3, said, &r)?;
    ensure(o.result == sum, || "device 0 checksum differs from the CPU's".into())?;
    // Every page arrived by its own fault, by density prefetch with a neighbour's, or by
    // read-ahead. A read-ahead block is left unmapped, so the device's first touch of it
    // still faults (only to map it; one fault may map the whole block with a 2 MiB entry):
    // pages fetched by faults and density prefetch are at most the region, and with the
    // read-ahead ones at least it.
    if let (Some(p), Some(ra)) = (pre, ra) {
        let fetched = (o.faults + p).saturating_sub(ra);
        ensure(fetched <= np && o.faults + p >= np, || {
            format!("{} faults + {p} prefetched ({ra} of them read ahead) for {np} pages", o.faults)
        })?;
    } else {
        ensure(o.faults >= 1 && o.faults <= np, || format!("{} device faults for {np} pages", o.faults))?;
    }
    all_at(&q, GMEM_LOC_DEVICE, d0, "after device 0 read")?;

    let back = with_words(&r, |w| checksum(w));
    let q = step(4, format!("CPU reads it back: checksum {back:#x} {} before; pages migrate home", eq(back, sum)), &r)?;
    ensure(back == sum, || "CPU read-back differs".into())?;
    all_at(&q, GMEM_LOC_HOST, 0, "after CPU read-back")?;

    ck(r.advise(GMEM_ADV_PREFETCH, d1), "PREFETCH to device 1")?;
    let o = ck(s1.checksum(r.addr, len), "device 1 CHECKSUM")?;
    let q = step(
        5,
        format!(
            "PREFETCH to device {d1}; it checksums {:#x} {} CPU's with {} faults",
            o.result,
            eq(o.result, sum),
            o.faults
        ),
        &r,
    )?;
    ensure(o.result == sum && o.faults == 0, || {
        format!("after PREFETCH: checksum {:#x}, {} faults", o.result, o.faults)
    })?;
    all_at(&q, GMEM_LOC_DEVICE, d1, "after PREFETCH")?;

    ck(r.advise(GMEM_ADV_READ_MOSTLY, GMEM_NO_DEVICE), "READ_MOSTLY")?;
    let o = ck(s0.checksum(r.addr, len), "device 0 CHECKSUM")?;
    let mut one = [0u32; 1];
    let mut qa = GmemQuery {
        argsz: argsz::<GmemQuery>(),
        addr: r.addr,
        npages: 1,
        states: one.as_mut_ptr() as u64,
        ..Default::default()
    };
    ck(g.ioctl(GMEM_IOC_QUERY, &mut qa), "QUERY page 0")?;
    let said = format!("READ_MOSTLY, then device {d0} reads: {:#x} {} CPU's; device {d1} keeps the data, read-only copies (page 0: device mask {:#x})", o.result, eq(o.result, sum), qa.dup_mask);
    let q = step(6, said, &r)?;
    ensure(o.result == sum, || "device 0 checksum differs with READ_MOSTLY".into())?;
    ensure(qa.dup_mask == 1u64 << d0, || format!("page 0 dup_mask {:#x}", qa.dup_mask))?;
    all_at(&q, GMEM_LOC_DEVICE, d1, "owner with duplicates")?;
    ensure(q.iter().all(|w| w & GMEM_Q_DUP != 0), || "pages without duplicates".into())?;

    ck(s0.fill(r.addr, len, 1000), "device 0 FILL")?;
    let want = checksum(&(0..len as u32 / 4).map(|i| 1000 + i).collect::<Vec<u32>>());
    let o = ck(s0.checksum(r.addr, len), "device 0 CHECKSUM")?;
    let q = step(
        7,
        format!(
            "device {d0} writes (FILL 1000+i): the write drops the copies; checksum {:#x} {} expected",
            o.result,
            eq(o.result, want)
        ),
        &r,
    )?;
    ensure(o.result == want, || "device 0 checksum after FILL differs".into())?;
    all_at(&q, GMEM_LOC_DEVICE, d0, "after device 0 write")?;
    ensure(q.iter().all(|w| w & GMEM_Q_DUP == 0), || "duplicates survived a write".into())?;

    ck(r.advise(GMEM_ADV_PIN, d1), "PIN on device 1")?;
    let refused = r.advise(GMEM_ADV_DONTNEED, GMEM_NO_DEVICE);
    let o = ck(s1.checksum(r.addr, len), "device 1 CHECKSUM")?;
    let said = format!(
        "PIN on device {d1}: DONTNEED refused ({}), checksum {:#x} {} expected, {} faults",
        refused.map_or_else(|e| e.to_string(), |_| "accepted!".into()),
        o.result,
        eq(o.result, want),
        o.faults
    );
    let q = step(8, said, &r)?;
    ensure(refused == Err(Errno(libc::EBUSY)), || format!("DONTNEED on pinned pages: {refused:?}"))?;
    ensure(o.result == want && o.faults == 0, || "pinned data or faults wrong".into())?;
    all_at(&q, GMEM_LOC_DEVICE, d1, "after PIN")?;
    ensure(q.iter().all(|w| w & GMEM_Q_PINNED != 0), || "pages not pinned".into())?;
    gmemctl_view(d1)?;

    ck(r.advise(GMEM_ADV_UNPIN, GMEM_NO_DEVICE), "UNPIN")?;
    ck(r.advise(GMEM_ADV_DONTNEED, GMEM_NO_DEVICE), "DONTNEED")?;
    let q = ck(r.query(), "QUERY")?;
    all_at(&q, GMEM_LOC_NONE, 0, "after DONTNEED")?;
    let o = ck(s0.checksum(r.addr, len), "device 0 CHECKSUM")?;
    let zeros = checksum(&vec![0u32; r.len / 4]);
    let cpu_zero = with_words(&r, |w| w.iter().all(|&x| x == 0));
    println!(
        "9. UNPIN, DONTNEED discards the data (pages: {}); device {d0} checksum {:#x} {} that of zeros, CPU reads {}",
        summary(&q),
        o.result,
        eq(o.result, zeros),
        if cpu_zero { "zeros" } else { "NON-ZERO data" }
    );
    ensure(o.result == zeros && cpu_zero, || "data survived DONTNEED".into())?;

    let addr = r.leak();
    ck(g.free_raw(addr), "FREE")?;
    let gone = g.query(addr, 1);
    println!(
        "10. free: QUERY of the address now says {}",
        gone.as_ref().map_or_else(|e| e.to_string(), |_| "it still exists!".into())
    );
    ensure(gone == Err(Errno(libc::ENOENT)), || format!("QUERY after FREE: {gone:?}"))
}

/// What `gmemctl` (the admin tool) shows at this point: the devices and processes, and
/// this process's residency map, which must be all on device `d1`.
fn gmemctl_view(d1: i32) -> Res<()> {
    let pid = std::process::id().to_string();
    let run = |args: &[&str]| -> Res<String> {
        let out =
            std::process::Command::new("/bin/gmemctl").args(args).output().map_err(|e| format!("gmemctl: {e}"))?;
        ensure(out.status.success(), || format!("gmemctl {args:?}: {}", out.status))?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let status = run(&["status"])?;
    let map = run(&["regions", &pid, "--width", "32"])?;
    println!("   `gmemctl status` and `gmemctl regions {pid}` now:");
    for l in status.lines().chain(map.lines()) {
        println!("   | {l}");
    }
    let bar = format!("[{}]", char::from_digit(d1.unsigned_abs() % 16, 16).unwrap_or('?').to_string().repeat(32));
    ensure(map.contains(&bar), || format!("gmemctl regions does not show every page on device {d1}"))
}

fn main() {
    match run() {
        Ok(()) => println!("GMEM-DEMO ok"),
        Err(why) => {
            println!("GMEM-DEMO FAILED: {why}");
            std::process::exit(1);
        }
    }
}

/// Device `dev`'s prefetched-pages counter (debugfs), if readable.
fn prefetched(dev: i32) -> Option<u64> {
    libgmem::debugfs::counter(u32::try_from(dev).ok()?, "prefetch.pages")
}

fn read_ahead(dev: i32) -> Option<u64> {
    libgmem::debugfs::counter(u32::try_from(dev).ok()?, "prefetch.readahead")
}
