// SPDX-License-Identifier: GPL-2.0
//! Device unplug (rmmod of the simulated driver) while processes hold data on it, under
//! memory pressure and racing process exit. Each test reloads the driver, so these run last.
//! What is checked: no process ever reads another's data, no frame is freed twice, pages
//! that cannot be saved become *lost* (SIGBUS / EIO / QUERY says so) instead of pointing at
//! whatever the next device puts there, and no driver callback runs after unregistration
//! (the kernel log's unregister line, and KASAN on the debug kernel).

use crate::harness::{kill_and_reap, memcg, on_signal, parked_child, sh, words, Link, Test, TestResult};
use crate::{ensure, ok};
use libgmem::sim::Sim;
use libgmem::*;
use std::process::Command;

const INSMOD: &str = "insmod /lib/gmem/gmem_sim.ko nr_devices=2 mem_mib=16";

/// The kernel log since the last `take_log` (the console keeps everything; the ring is
/// cleared so that each scenario sees only its own lines).
fn take_log() -> std::result::Result<String, String> {
    let out = Command::new("dmesg").arg("-c").output().map_err(|e| format!("dmesg: {e}"))?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Whether the log says an unregistration left frames in use (a non-zero count: older
/// kernels logged "(0 frames still in use)" on every unregistration).
fn frames_left(log: &str) -> bool {
    log.lines().any(|l| {
        let Some(i) = l.find(" frames still in use") else { return false };
        l[..i].rsplit(|c: char| !c.is_ascii_digit()).next().and_then(|n| n.parse::<u64>().ok()).is_some_and(|n| n > 0)
    })
}

fn pattern(tag: u32, i: usize) -> u32 {
    tag.wrapping_add(i as u32)
}

/// Issue item 1: process A has 8 MiB of dirty data on device 0; the driver is removed by a
/// task in a memory cgroup far too small to hold A's data; the driver comes back and process
/// B fills 8 MiB of its own. A must read exactly its own data (host pages for A's data are
/// charged to A, not to the task that unplugs), and no frame is freed twice.
fn unplug_in_small_cgroup_keeps_data_and_identity() -> TestResult {
    let cg = memcg("gmem_rmmod")?;
    let _ = take_log()?;
    let g = Gmem::open().map_err(|e| e.to_string())?;
    let a = ok!(g.alloc(8 << 20));
    {
        let s0 = Sim::open(0).map_err(|e| e.to_string())?;
        ok!(s0.fill(a.addr, a.len as u64, 0xA000_0000));
        let q = ok!(a.query());
        ensure!(q.iter().all(|w| q_loc(*w) == GMEM_LOC_DEVICE && q_dev(*w) == 0), "A's data is not all on device 0");
    }
    sh(&format!("sh -c 'echo 2M > {cg}/memory.max && echo $$ > {cg}/cgroup.procs && exec rmmod gmem_sim'"))?;
    sh(INSMOD)?;
    let (mut me, mut peer) = Link::pair()?;
    // SAFETY: fork; the child only runs B's scenario and exits.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        drop(me);
        let code = (|| {
            let (Ok(g), Ok(s0)) = (Gmem::open(), Sim::open(0)) else { return 10 };
            let Ok(b) = g.alloc(8 << 20) else { return 11 };
            if s0.fill(b.addr, b.len as u64, 0xB000_0000).is_err() {
                return 12;
            }
            peer.signal();
            // Keep B's data on the device until A has looked.
            peer.wait();
            0
        })();
        // SAFETY: leaving the forked child.
        unsafe { libc::_exit(code) };
    }
    drop(peer);
    let b_ready = me.wait();
    let w = words(&a);
    let (mut foreign, mut wrong) = (0usize, 0usize);
    for (i, &x) in w.iter().enumerate() {
        if x != pattern(0xA000_0000, i) {
            wrong += 1;
            foreign += usize::from(x.wrapping_sub(0xB000_0000) < (8 << 20) / 4);
        }
    }
    me.signal();
    let mut status = 0;
    // SAFETY: reaping our child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    let _ = sh(&format!("rmdir {cg}"));
    let log = take_log()?;
    ensure!(b_ready, "process B failed before filling (status {status:#x})");
    ensure!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "process B failed: status {status:#x}");
    ensure!(foreign == 0, "A read B's data on {foreign} words");
    ensure!(wrong == 0, "A's data wrong on {wrong} words");
    ensure!(!log.contains("bad frame free"), "double frame free in the kernel log:\n{log}");
    ensure!(!frames_left(&log), "unregister left frames in use:\n{log}");
    Ok(())
}

/// A CPU access to a lost page ends the process here with a code the parent recognises.
extern "C" fn sigbus_on_lost(_sig: i32) {
    // SAFETY: async-signal-safe exit.
    unsafe { libc::_exit(42) };
}

/// The data of a process whose own memory cgroup cannot hold it when its device goes away:
/// evacuation retries, then marks what it cannot save *lost* (no frame, no stale device
/// reference). QUERY shows LOST, a device access fails with EIO, a CPU access gets SIGBUS,
/// DONTNEED turns the page back into zeros, the saved pages hold their data, and the kernel
/// log and debugfs count the loss.
fn unplug_lost_pages_are_reported_not_reused() -> TestResult {
    let cg = memcg("gmem_lost")?;
    let _ = take_log()?;
    let (mut me, mut peer) = Link::pair()?;
    let cgp = cg.clone();
    // SAFETY: fork; the child runs process A's side and exits.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        drop(me);
        let code = (|| -> i32 {
            if std::fs::write(format!("{cgp}/cgroup.procs"), std::process::id().to_string()).is_err() {
                return 10;
            }
            let (Ok(g), Ok(s0)) = (Gmem::open(), Sim::open(0)) else { return 11 };
            let Ok(a) = g.alloc(8 << 20) else { return 12 };
            // Page tables for the CPU side exist before the squeeze (one touch per 2 MiB).
            for off in (0..a.len).step_by(2 << 20) {
                // SAFETY: writing inside our own mapped region.
                unsafe { std::ptr::write_volatile((a.addr as usize + off) as *mut u32, 0) };
            }
            if s0.fill(a.addr, a.len as u64, 0xC000_0000).is_err() {
                return 13;
            }
            drop(s0);
            // Written now (not zero: a zeroed allocation may be untouched mmap memory), so its
            // pages exist before the squeeze.
            let mut states = vec![u32::MAX; a.pages()];
            let mut q =
                GmemQuery { argsz: argsz::<GmemQuery>(), addr: a.addr, npages: a.pages() as u64, ..Default::default() };
            q.states = states.as_mut_ptr() as u64;
            on_signal(libc::SIGBUS, sigbus_on_lost as *const () as usize, false);
            // Everything needed at the limit is prepared now (a heap allocation there could
            // rightly invoke the memory cgroup's OOM killer).
            // The limit file is opened now: opening it at the limit would need a charged
            // `struct file`. Each write(2) sets the limit anew.
            let Ok(mut maxf) = std::fs::OpenOptions::new().write(true).open(format!("{cgp}/memory.max")) else {
                return 27;
            };
            // Room for about 1 MiB more than now: most of the 8 MiB cannot come home.
            let Ok(cur) = std::fs::read_to_string(format!("{cgp}/memory.current")) else { return 14 };
            let Ok(cur) = cur.trim().parse::<u64>() else { return 15 };
            if std::io::Write::write_all(&mut maxf, (cur + (1 << 20)).to_string().as_bytes()).is_err() {
                return 16;
            }
            peer.signal();
            // The parent removes the driver now (from outside the cgroup) and reloads it.
            if !peer.wait() {
                return 17;
            }
            if g.ioctl(GMEM_IOC_QUERY, &mut q).is_err() {
                return 18;
            }
            let _ = std::io::Write::write_all(&mut maxf, b"max");
            let lost: Vec<usize> = (0..states.len()).filter(|&i| q_loc(states[i]) == GMEM_LOC_LOST).collect();
            let host = states.iter().filter(|w| q_loc(**w) == GMEM_LOC_HOST).count();
            if lost.is_empty() || lost.len() + host != states.len() {
                eprintln!("after unplug: {} lost, {host} on the host, {} pages", lost.len(), states.len());
                return 19;
            }
            let w = words(&a);
            for i in 0..states.len() {
                if q_loc(states[i]) == GMEM_LOC_HOST && w[i * 1024 + 5] != pattern(0xC000_0000, i * 1024 + 5) {
                    eprintln!("saved page {i} holds {:#x}", w[i * 1024 + 5]);
                    return 20;
                }
            }
            // A device access to a lost page fails with EIO.
            let Ok(s0) = Sim::open(0) else { return 21 };
            let p = a.addr + lost[0] as u64 * 4096;
            if !matches!(s0.checksum(p, 4096), Err(Errno(e)) if e == libc::EIO) {
                return 22;
            }
            // DONTNEED makes it an ordinary, never-touched page again.
            if g.advise(p, 4096, GMEM_ADV_DONTNEED, GMEM_NO_DEVICE, 0).is_err() {
                return 23;
            }
            if !matches!(g.query(p, 1).as_deref(), Ok([w]) if q_loc(*w) == GMEM_LOC_NONE) || w[lost[0] * 1024] != 0 {
                return 24;
            }
            if lost.len() < 2 {
                return 25;
            }
            // Last: a CPU read of another lost page must raise SIGBUS (the handler exits 42).
            // SAFETY: reading our own mapped region; SIGBUS is handled above.
            let v = unsafe { std::ptr::read_volatile((a.addr as usize + lost[1] * 4096) as *const u32) };
            eprintln!("read {v:#x} from a lost page without SIGBUS");
            26
        })();
        // SAFETY: leaving the forked child.
        unsafe { libc::_exit(code) };
    }
    drop(peer);
    let ready = me.wait();
    let unplug = if ready { sh("rmmod gmem_sim").and_then(|_| sh(INSMOD)) } else { Ok(()) };
    let spaces = std::fs::read_to_string("/sys/kernel/debug/gmem/spaces").unwrap_or_default();
    me.signal();
    let mut status = 0;
    // SAFETY: reaping our child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    let _ = sh(&format!("rmdir {cg}"));
    let log = take_log()?;
    unplug?;
    let code = if libc::WIFEXITED(status) { libc::WEXITSTATUS(status) } else { 128 + libc::WTERMSIG(status) };
    ensure!(code == 42, "process A: exit code {code} (42 = every check passed, SIGBUS on the lost page)");
    let line = spaces.lines().find(|l| l.contains(&format!("pid={pid} "))).unwrap_or("");
    let lost_now: u64 = line.split_whitespace().find_map(|w| w.strip_prefix("lost=")?.parse().ok()).unwrap_or(0);
    ensure!(lost_now > 0, "debugfs does not show A's lost pages: {line:?}");
    ensure!(
        log.contains(&format!("of process {pid} ")) && log.contains("lost"),
        "no kernel log line names the loss:\n{log}"
    );
    ensure!(!log.contains("bad frame free") && !frames_left(&log), "frames mishandled:\n{log}");
    Ok(())
}

/// Iterations of the kill-vs-rmmod race (issue item 2 asks for at least 50).
const RACE_ITERATIONS: usize = 50;

/// Issue item 2: a process with device-resident pages is SIGKILLed while the driver is being
/// removed. Unregistration must find every page (teardown empties a region before it leaves
/// the tree), destroy every context only after the last callback, and free every frame.
fn kill_races_rmmod() -> TestResult {
    let raced = race_kill_and_rmmod();
    // Whatever happened, the driver is back with its usual parameters for what follows.
    let _ = sh("rmmod gmem_sim 2>/dev/null");
    sh(INSMOD)?;
    raced?;
    let g = Gmem::open().map_err(|e| e.to_string())?;
    ensure!(ok!(g.version()).nr_devices == 2, "devices not back after the race");
    // The reloaded device works: data written by it reads back on the CPU.
    let r = ok!(g.alloc(1 << 20));
    ok!(Sim::open(0).map_err(|e| Errno(e.raw_os_error().unwrap_or(libc::EIO))).and_then(|s| s.fill(
        r.addr,
        r.len as u64,
        9
    )));
    ensure!(words(&r).iter().enumerate().all(|(i, &x)| x == pattern(9, i)), "reloaded device wrote wrong data");
    Ok(())
}

fn race_kill_and_rmmod() -> TestResult {
    let _ = take_log()?;
    sh("rmmod gmem_sim")?;
    let small = "insmod /lib/gmem/gmem_sim.ko nr_devices=2 mem_mib=4";
    for it in 0..RACE_ITERATIONS {
        sh(small)?;
        let (pid, ready) = parked_child(|| {
            let filled = (|| {
                let g = Gmem::open().ok()?;
                let (r, r2) = (g.alloc(2 << 20).ok()?, g.alloc(1 << 20).ok()?);
                let (s0, s1) = (Sim::open(0).ok()?, Sim::open(1).ok()?);
                s0.fill(r.addr, r.len as u64, it as u32).ok()?;
                s1.fill(r2.addr, r2.len as u64, 7).ok()?;
                r.leak();
                r2.leak();
                // The sim files close now, so nothing pins the driver: its removal races the
                // teardown of this process's regions in exit_mmap.
                drop((s0, s1));
                std::mem::forget(g);
                Some(())
            })();
            filled.is_some()
        })?;
        // SIGKILL, and rmmod races the child's exit.
        // SAFETY: signalling our own child.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        let rm = sh("rmmod gmem_sim");
        kill_and_reap(pid);
        ensure!(ready, "iteration {it}: child failed to fill device memory");
        ensure!(rm.is_ok(), "iteration {it}: rmmod never succeeded");
        let log = take_log()?;
        ensure!(
            !frames_left(&log) && !log.contains("bad frame free"),
            "iteration {it}: unregister raced teardown:\n{log}"
        );
    }
    Ok(())
}

/// Issue 10: the driver is removed while asynchronous copies into it are in flight (a
/// PREFETCH of 8 MiB over a 20 MB/s modelled link, about 0.4 s, on the sim's channels).
/// Unregistration waits for every copy the device accepted before it destroys contexts
/// and returns: no callback or copy runs after it (the sim WARNs if one does), every frame
/// is freed, and every page reads back what the process wrote (the PREFETCH itself may
/// succeed or fail with ENODEV, depending on where the removal caught it).
fn rmmod_with_copies_in_flight() -> TestResult {
    let _ = take_log()?;
    sh("rmmod gmem_sim")?;
    sh(&format!("{INSMOD} link_h2d_mbps=20"))?;
    let res = (|| -> TestResult {
        let g = Gmem::open().map_err(|e| e.to_string())?;
        let r = ok!(g.alloc(8 << 20));
        for (i, w) in words(&r).iter_mut().enumerate() {
            *w = pattern(0x5eed_0000, i);
        }
        let prefetched = std::thread::scope(|sc| -> std::result::Result<std::result::Result<u64, Errno>, String> {
            let t = sc.spawn(|| r.advise(GMEM_ADV_PREFETCH, 0));
            // Wait (at most 5 s) until the channels have a copy in flight, then close the
            // node (an open one pins the module) and remove the driver.
            let mut seen = false;
            for _ in 0..500 {
                let s0 = Sim::open(0).map_err(|e| e.to_string())?;
                if ok!(s0.info()).inflight > 0 {
                    seen = true;
                    break;
                }
                drop(s0);
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            let rm = sh("rmmod gmem_sim");
            let joined = t.join().map_err(|_| "the PREFETCH thread panicked".to_string())?;
            ensure!(seen, "no copy was ever in flight on device 0's channels");
            rm?;
            Ok(joined)
        })?;
        match prefetched {
            Ok(_) | Err(Errno(libc::ENODEV)) => {}
            Err(e) => return Err(format!("PREFETCH during the removal failed with {e:?}")),
        }
        let bad = words(&r).iter().enumerate().filter(|&(i, &x)| x != pattern(0x5eed_0000, i)).count();
        ensure!(bad == 0, "{bad} words changed across the removal");
        let log = take_log()?;
        ensure!(
            !frames_left(&log) && !log.contains("callback after gmem_dev_unregister"),
            "unregistration with copies in flight:\n{log}"
        );
        Ok(())
    })();
    let _ = sh("rmmod gmem_sim 2>/dev/null");
    sh(INSMOD)?;
    res
}

/// A device that maps ordinary memory of a process is unplugged: its entries and their
/// record go with it (the space's `mirror_mapped` drops to 0 while the process lives on),
/// the process's data stays as it was, the memory can be unmapped afterwards, and the
/// device that comes back maps it again.
fn unplug_forgets_mirrored_memory() -> TestResult {
    let _ = take_log()?;
    let g = Gmem::open().map_err(|e| e.to_string())?;
    // A region of 13 pages names this space in debugfs.
    let _tag = ok!(g.alloc(13 * 4096));
    let m = crate::t_sysmem::Anon::new(64 * 4096, libc::PROT_READ | libc::PROT_WRITE)?;
    let (p, len, w) = (m.addr, m.len, m.words());
    let res = (|| -> TestResult {
        for d in 0..2 {
            let s = Sim::open(d).map_err(|e| e.to_string())?;
            ok!(s.fill(p, len as u64, 0x7000 * (d as u32 + 1)));
        }
        ensure!(crate::harness::space_stat(13, "mirror_mapped")? >= 64, "the devices mapped nothing");
        sh("rmmod gmem_sim")?;
        let left = crate::harness::space_stat(13, "mirror_mapped")?;
        ensure!(left == 0, "{left} pages still recorded as mapped after the devices were unplugged");
        ensure!(w.iter().enumerate().all(|(i, &x)| x == pattern(0xe000, i)), "the data changed across the unplug");
        sh(INSMOD)?;
        let s = Sim::open(0).map_err(|e| e.to_string())?;
        ok!(s.fill(p, len as u64, 0x9000));
        ensure!(w.iter().enumerate().all(|(i, &x)| x == pattern(0x9000, i)), "the new device's fill not seen");
        Ok(())
    })();
    drop(m);
    after_unplug(res, "callback after gmem_dev_unregister")
}

/// The end of an unplug scenario whose result is `res`: whatever step failed, the driver
/// is loaded again for the tests after this one (an insmod of a loaded module just fails),
/// and the kernel log must show every frame returned and no line with `bad`.
fn after_unplug(res: TestResult, bad: &str) -> TestResult {
    if res.is_err() {
        let _ = sh(&format!("{INSMOD} 2>/dev/null"));
    }
    let log = take_log()?;
    ensure!(!frames_left(&log) && !log.contains(bad), "unregistration:\n{log}");
    res
}

/// Issue 11: ordinary memory migrated into both devices (device-private pages) comes back
/// to the host when the driver goes, every frame is returned, and the devices that come
/// back can take it again.
fn unplug_brings_migrated_memory_back() -> TestResult {
    let _ = take_log()?;
    let g = Gmem::open().map_err(|e| e.to_string())?;
    let m = crate::t_sysmem::Anon::new(128 * 4096, libc::PROT_READ | libc::PROT_WRITE)?;
    let (p, len, w) = (m.addr, m.len, m.words());
    w.iter_mut().enumerate().for_each(|(i, x)| *x = pattern(0x3100, i));
    let res = (|| -> TestResult {
        for d in 0..2u64 {
            let id = Sim::open(d as usize).map_err(|e| e.to_string())?.info().map_err(|e| e.to_string())?.gmem_id;
            ok!(g.advise(p + d * 64 * 4096, 64 * 4096, GMEM_ADV_PREFETCH, id, 0));
        }
        let q = ok!(g.query(p, 128));
        ensure!(q.iter().all(|&x| x & 0xff == GMEM_LOC_DEVICE), "not migrated: {q:x?}");
        sh("rmmod gmem_sim")?;
        let q = ok!(g.query(p, 128));
        ensure!(q.iter().all(|&x| x & 0xff == GMEM_LOC_HOST), "after the unplug: {q:x?}");
        ensure!(w.iter().enumerate().all(|(i, &x)| x == pattern(0x3100, i)), "the data changed across the unplug");
        sh(INSMOD)?;
        let s = Sim::open(0).map_err(|e| e.to_string())?;
        let id = s.info().map_err(|e| e.to_string())?.gmem_id;
        ok!(g.advise(p, len as u64, GMEM_ADV_PREFETCH, id, 0));
        ok!(s.fill(p, len as u64, 0x9000));
        ensure!(w.iter().enumerate().all(|(i, &x)| x == pattern(0x9000, i)), "the new device's fill not seen");
        Ok(())
    })();
    drop(m);
    after_unplug(res, "will not move back")
}

/// `GMEM_SIM_IOC_LINK` with `GMEM_SIM_LINK_SET` on a device unplugged through
/// `GMEM_SIM_IOC_UNPLUG` fails with `ENODEV` and changes nothing; reading the model still
/// works. (It used to change the model and then fail.)
fn link_set_after_unplug_changes_nothing() -> TestResult {
    let r = (|| -> TestResult {
        let s = Sim::open(1).map_err(|e| e.to_string())?;
        let before = ok!(s.set_link([500, 600, 0], 0));
        ok!(s.unplug());
        match s.set_link([100, 100, 0], 0) {
            Err(Errno(libc::ENODEV)) => {}
            other => return Err(format!("LINK_SET after unplug: {other:?}, expected ENODEV")),
        }
        let after = ok!(s.link());
        ensure!(
            after.mbps == before.mbps,
            "model changed by a refused LINK_SET: {:?} -> {:?}",
            before.mbps,
            after.mbps
        );
        Ok(())
    })();
    let _ = sh("rmmod gmem_sim 2>/dev/null");
    sh(INSMOD)?;
    r
}

/// Ordinary memory migrated to a device whose memory is not a whole number of 2 MiB
/// (`mem_mib=1`: 256 frames): its device-private pagemap is set up without complaint
/// (memory hotplug takes whole subsections; the region is rounded up to a section), and
/// the data goes there and comes back intact.
fn dpriv_on_a_device_of_odd_size() -> TestResult {
    sh("rmmod gmem_sim")?;
    sh("insmod /lib/gmem/gmem_sim.ko nr_devices=1 mem_mib=1")?;
    let r = (|| -> TestResult {
        let g = Gmem::open().map_err(|e| e.to_string())?;
        let s = Sim::open(0).map_err(|e| e.to_string())?;
        let d = ok!(s.info()).gmem_id as u32;
        let m = crate::t_sysmem::Anon::new(16 * 4096, libc::PROT_READ | libc::PROT_WRITE)?;
        // SAFETY: our own mapping.
        ensure!(unsafe { libc::madvise(m.addr as *mut libc::c_void, m.len, libc::MADV_NOHUGEPAGE) } == 0, "madvise");
        m.words().iter_mut().enumerate().for_each(|(i, x)| *x = pattern(0x0dd0_0000, i));
        ok!(g.advise(m.addr, m.len as u64, GMEM_ADV_PREFETCH, d as i32, 0));
        let q = ok!(g.query(m.addr, 16));
        ensure!(q.iter().all(|&x| x == GMEM_LOC_DEVICE | (d << 8)), "not on the device after PREFETCH: {q:x?}");
        let bad = m.words().iter().enumerate().filter(|&(i, &x)| x != pattern(0x0dd0_0000, i)).count();
        ensure!(bad == 0, "{bad} words wrong after the CPU read them back");
        Ok(())
    })();
    sh("rmmod gmem_sim")?;
    sh(INSMOD)?;
    r
}

/// Advice naming a device is forgotten when the device unregisters: after the driver is
/// reloaded, the device registered under the same id faults a range that had ACCESSED_BY
/// for the old one into its own memory instead of mapping the host pages remotely (it
/// used to inherit the old device's advice, and UNSET_ACCESSED_BY for an id with no
/// device gave ENODEV).
fn advice_for_an_unregistered_device_is_forgotten() -> TestResult {
    let g = Gmem::open().map_err(|e| e.to_string())?;
    let r = ok!(g.alloc(16 * 4096));
    words(&r).iter_mut().enumerate().for_each(|(i, x)| *x = pattern(0xadd0_0000, i));
    let d1 = {
        let s1 = Sim::open(1).map_err(|e| e.to_string())?;
        let d1 = ok!(s1.info()).gmem_id as i32;
        ok!(g.advise(r.addr, r.len as u64, GMEM_ADV_ACCESSED_BY, d1, 0));
        // The advice works while the device is there: its read maps the host pages.
        ok!(s1.checksum(r.addr, 4096));
        let q = ok!(r.query());
        ensure!(q_loc(q[0]) == GMEM_LOC_HOST && q[0] & GMEM_Q_REMOTE != 0, "ACCESSED_BY not honoured: {:#x}", q[0]);
        d1
    };
    sh("rmmod gmem_sim")?;
    sh(INSMOD)?;
    let s1 = Sim::open(1).map_err(|e| e.to_string())?;
    ensure!(ok!(s1.info()).gmem_id as i32 == d1, "the reloaded device 1 has another id");
    ok!(s1.checksum(r.addr + 8 * 4096, 4096));
    let q = ok!(r.query());
    ensure!(
        q_loc(q[8]) == GMEM_LOC_DEVICE && q_dev(q[8]) == d1 as u32,
        "the new device {d1} inherited the old one's ACCESSED_BY: page 8 is {:#x}",
        q[8]
    );
    let bad = words(&r).iter().enumerate().filter(|&(i, &x)| x != pattern(0xadd0_0000, i)).count();
    ensure!(bad == 0, "{bad} words wrong");
    Ok(())
}

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "unplug_in_small_cgroup_keeps_data_and_identity",
            f: unplug_in_small_cgroup_keeps_data_and_identity,
        },
        Test { name: "unplug_lost_pages_are_reported_not_reused", f: unplug_lost_pages_are_reported_not_reused },
        Test { name: "kill_races_rmmod", f: kill_races_rmmod },
        Test { name: "rmmod_with_copies_in_flight", f: rmmod_with_copies_in_flight },
        Test { name: "unplug_forgets_mirrored_memory", f: unplug_forgets_mirrored_memory },
        Test { name: "unplug_brings_migrated_memory_back", f: unplug_brings_migrated_memory_back },
        Test { name: "link_set_after_unplug_changes_nothing", f: link_set_after_unplug_changes_nothing },
        Test { name: "dpriv_on_a_device_of_odd_size", f: dpriv_on_a_device_of_odd_size },
        Test {
            name: "advice_for_an_unregistered_device_is_forgotten",
            f: advice_for_an_unregistered_device_is_forgotten,
        },
    ]
}
