// SPDX-License-Identifier: GPL-2.0
//! Ordinary process memory migrated into device memory (issue 11): PREFETCH moves
//! anonymous pages into frames of `/dev/gmem_sim0` as device-private pages
//! (`gmem/obj/dpriv.rs`), a CPU touch brings them back, and they share the device's one
//! pool and eviction with GMEM regions. Scenarios after `hmm-tests.c` (migrate, then read
//! back by the CPU; exit with pages on the device; fork after migration).

use crate::harness::{child_exit, open, Test, TestResult};
use crate::t_sysmem::Anon;
use crate::{ensure, expect_errno, ok};
use libgmem::debugfs;
use libgmem::sim::{checksum, Sim};
use libgmem::{Gmem, GMEM_ADV_PREFETCH, GMEM_HOST, GMEM_LOC_DEVICE, GMEM_LOC_HOST, GMEM_LOC_NONE, GMEM_Q_CPU_MAPPED};

const PAGE: usize = 4096;

fn gmem_id(s: &Sim) -> Result<u32, String> {
    Ok(ok!(s.info()).gmem_id as u32)
}

/// A counter of the device's `sysmem:` line in debugfs (`frames`, `in`, `out`, `evicted`).
fn sysmem(dev: u32, key: &str) -> Result<u64, String> {
    debugfs::counter(dev, &format!("sysmem.{key}")).ok_or_else(|| format!("no sysmem.{key} for device {dev}"))
}

/// Waits until the device holds `want` frames of process memory (frames come back to the
/// pool from a work item after their pages were freed).
fn wait_frames(dev: u32, want: u64) -> TestResult {
    for _ in 0..300 {
        if sysmem(dev, "frames")? == want {
            return Ok(());
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    Err(format!("device {dev} holds {} frames of process memory, expected {want}", sysmem(dev, "frames")?))
}

/// This process's files, device 0's gmem id and the frames it holds of process memory
/// now, and a fresh buffer of `pages` pages without THP (migration moves base pages).
fn setup(pages: usize) -> Result<(Gmem, Sim, u32, u64, Anon), String> {
    let (g, s) = open()?;
    let d = gmem_id(&s)?;
    let frames0 = sysmem(d, "frames")?;
    let m = Anon::new(pages * PAGE, libc::PROT_READ | libc::PROT_WRITE)?;
    // SAFETY: our own mapping.
    ensure!(unsafe { libc::madvise(m.addr as *mut libc::c_void, m.len, libc::MADV_NOHUGEPAGE) } == 0, "madvise");
    Ok((g, s, d, frames0, m))
}

/// [`setup`] with the buffer written by the CPU (`pattern(seed, i)`) and moved to the
/// device by PREFETCH (checked with QUERY).
fn migrated(pages: usize, seed: u32) -> Result<(Gmem, Sim, u32, u64, Anon), String> {
    let (g, s, d, frames0, m) = setup(pages)?;
    m.words().iter_mut().enumerate().for_each(|(i, x)| *x = pattern(seed, i));
    ok!(g.advise(m.addr, m.len as u64, GMEM_ADV_PREFETCH, d as i32, 0));
    let q = ok!(g.query(m.addr, pages));
    ensure!(q.iter().all(|&x| x == GMEM_LOC_DEVICE | (d << 8)), "not on the device after PREFETCH: {q:x?}");
    Ok((g, s, d, frames0, m))
}

fn pattern(seed: u32, i: usize) -> u32 {
    (i as u32).wrapping_mul(2_654_435_761) ^ seed
}

/// A buffer migrated to the device and read back by the CPU: after PREFETCH it is on the
/// device (QUERY), the device reads and writes it there without faults on reads and
/// without host pages, and the CPU's first touch brings the device's data back.
fn dpriv_buffer_migrated_and_read_back() -> TestResult {
    let (g, s, d, frames0, m) = setup(64)?;
    let (in0, out0) = (sysmem(d, "in")?, sysmem(d, "out")?);
    let w = m.words();
    for (i, x) in w.iter_mut().enumerate() {
        *x = pattern(0x1234, i);
    }
    let want: Vec<u32> = w.to_vec();
    ok!(g.advise(m.addr, m.len as u64, GMEM_ADV_PREFETCH, d as i32, 0));
    let q = ok!(g.query(m.addr, 64));
    ensure!(q.iter().all(|&x| x == GMEM_LOC_DEVICE | (d << 8)), "after PREFETCH: {q:x?}");
    ensure!(sysmem(d, "frames")? == frames0 + 64, "frames held: {}", sysmem(d, "frames")?);
    ensure!(sysmem(d, "in")? >= in0 + 64, "pages in: {}", sysmem(d, "in")?);
    // The device reads its own memory: PREFETCH mapped it, nothing faults.
    let o = ok!(s.checksum(m.addr, m.len as u64));
    ensure!(o.result == checksum(&want), "device checksum {:#x} != {:#x}", o.result, checksum(&want));
    ensure!(o.faults == 0, "{} faults on migrated memory", o.faults);
    // It writes there too (write faults upgrade its entries; the pages stay).
    ok!(s.fill(m.addr, m.len as u64, 0x5000));
    let q = ok!(g.query(m.addr, 64));
    ensure!(q.iter().all(|&x| x == GMEM_LOC_DEVICE | (d << 8)), "after a device FILL: {q:x?}");
    // The CPU reads: the device's data comes back.
    for (i, &x) in w.iter().enumerate() {
        ensure!(x == 0x5000 + i as u32, "word {i}: CPU reads {x:#x} after the device's fill");
    }
    let q = ok!(g.query(m.addr, 64));
    ensure!(q.iter().all(|&x| x == GMEM_LOC_HOST | GMEM_Q_CPU_MAPPED), "after the CPU read: {q:x?}");
    ensure!(sysmem(d, "out")? >= out0 + 64, "pages out: {}", sysmem(d, "out")?);
    wait_frames(d, frames0)?;
    // PREFETCH there and to the host again: back where it was, data kept.
    ok!(g.advise(m.addr, m.len as u64, GMEM_ADV_PREFETCH, d as i32, 0));
    ensure!(sysmem(d, "frames")? == frames0 + 64, "second PREFETCH: {} frames", sysmem(d, "frames")?);
    ok!(g.advise(m.addr, m.len as u64, GMEM_ADV_PREFETCH, GMEM_HOST, 0));
    let q = ok!(g.query(m.addr, 64));
    ensure!(q.iter().all(|&x| x == GMEM_LOC_HOST | GMEM_Q_CPU_MAPPED), "after PREFETCH to the host: {q:x?}");
    wait_frames(d, frames0)?;
    ensure!(w.iter().enumerate().all(|(i, &x)| x == 0x5000 + i as u32), "data changed on the second trip");
    Ok(())
}

/// Pages on the device of a mapping made inaccessible since (`PROT_NONE`) still come home
/// by PREFETCH: moving them grants no access, and the device's frames are freed. (Before,
/// the move home asked for a readable mapping as a move to the device does: `ENOENT`.)
fn dpriv_prefetch_home_of_an_inaccessible_mapping() -> TestResult {
    let (g, _s, d, frames0, m) = migrated(64, 0x77)?;
    let prot = |p: i32| {
        // SAFETY: our own mapping.
        ensure!(unsafe { libc::mprotect(m.addr as *mut libc::c_void, m.len, p) } == 0, "mprotect");
        Ok(())
    };
    prot(libc::PROT_NONE)?;
    ok!(g.advise(m.addr, m.len as u64, GMEM_ADV_PREFETCH, GMEM_HOST, 0));
    wait_frames(d, frames0)?;
    prot(libc::PROT_READ | libc::PROT_WRITE)?;
    let q = ok!(g.query(m.addr, 64));
    ensure!(q.iter().all(|&x| x & 0xff == GMEM_LOC_HOST), "after PREFETCH to the host: {q:x?}");
    ensure!(m.words().iter().enumerate().all(|(i, &x)| x == pattern(0x77, i)), "data changed");
    Ok(())
}

/// A PREFETCH home whose copy fails returns the copy's error, and the pages stay on the
/// device with their data; the next PREFETCH home brings them back. (Before, the error was
/// dropped: the PREFETCH returned 0 with every page still on the device.)
fn dpriv_failed_copy_home_is_an_error() -> TestResult {
    let (g, s, d, frames0, m) = migrated(64, 0x3c)?;
    // Any copy call fails (the range may span two blocks: two calls).
    ok!(s.fail_copy(0, libc::EIO as u32));
    expect_errno!(g.advise(m.addr, m.len as u64, GMEM_ADV_PREFETCH, GMEM_HOST, 0), libc::EIO);
    let q = ok!(g.query(m.addr, 64));
    ensure!(q.iter().all(|&x| x == GMEM_LOC_DEVICE | (d << 8)), "after the failed PREFETCH home: {q:x?}");
    ok!(g.advise(m.addr, m.len as u64, GMEM_ADV_PREFETCH, GMEM_HOST, 0));
    let q = ok!(g.query(m.addr, 64));
    ensure!(q.iter().all(|&x| x & 0xff == GMEM_LOC_HOST), "after PREFETCH home: {q:x?}");
    wait_frames(d, frames0)?;
    ensure!(m.words().iter().enumerate().all(|(i, &x)| x == pattern(0x3c, i)), "data changed");
    Ok(())
}

/// Never-touched memory migrates as zeros without host pages; the CPU then reads zeros.
fn dpriv_untouched_memory_moves_as_zeros() -> TestResult {
    let (g, s, d, frames0, m) = setup(32)?;
    ensure!(ok!(g.query(m.addr, 32)).iter().all(|&x| x == GMEM_LOC_NONE), "fresh memory touched");
    ok!(g.advise(m.addr, m.len as u64, GMEM_ADV_PREFETCH, d as i32, 0));
    ensure!(sysmem(d, "frames")? == frames0 + 32, "frames held: {}", sysmem(d, "frames")?);
    let o = ok!(s.checksum(m.addr, m.len as u64));
    ensure!(o.result == checksum(&[0u32; 32 * PAGE / 4]), "device reads non-zero data");
    ensure!(m.words().iter().all(|&x| x == 0), "CPU reads non-zero data");
    wait_frames(d, frames0)?;
    Ok(())
}

/// A process exits with its buffer on the device: every frame comes back to the pool.
fn dpriv_process_exits_with_buffer_on_device() -> TestResult {
    let (_g, s) = open()?;
    let d = gmem_id(&s)?;
    let frames0 = sysmem(d, "frames")?;
    let used0 = debugfs::counter(d, "used").ok_or("no used counter")?;
    let code = child_exit(|| {
        let Ok((g2, _s2)) = open() else { return 10 };
        let Ok(m) = Anon::new(128 * PAGE, libc::PROT_READ | libc::PROT_WRITE) else { return 11 };
        m.words().iter_mut().enumerate().for_each(|(i, x)| *x = i as u32);
        if g2.advise(m.addr, m.len as u64, GMEM_ADV_PREFETCH, d as i32, 0).is_err() {
            return 12;
        }
        if sysmem(d, "frames").ok() != Some(frames0 + 128) {
            return 13;
        }
        std::mem::forget(m);
        // SAFETY: exits without unmapping anything or closing the device.
        unsafe { libc::_exit(0) }
    });
    ensure!(code == 0, "child failed with {code}");
    wait_frames(d, frames0)?;
    let used = debugfs::counter(d, "used").ok_or("no used counter")?;
    ensure!(used == used0, "device frames used {used}, {used0} before the child");
    Ok(())
}

/// fork after migration: the pages are shared copy-on-write; the child's CPU read brings
/// them back for both, and each process then keeps its own writes.
fn dpriv_fork_after_migration() -> TestResult {
    let (_g, s, d, frames0, m) = migrated(16, 7)?;
    let w = m.words();
    let code = child_exit(|| {
        let w = m.words();
        if !w.iter().enumerate().all(|(i, &x)| x == pattern(7, i)) {
            return 20;
        }
        w.iter_mut().for_each(|x| *x = 0xc1);
        0
    });
    ensure!(code == 0, "child failed with {code}");
    ensure!(w.iter().enumerate().all(|(i, &x)| x == pattern(7, i)), "the parent sees the child's writes");
    let o = ok!(s.checksum(m.addr, m.len as u64));
    ensure!(o.result == checksum(w), "device checksum disagrees with the parent");
    drop(m);
    wait_frames(d, frames0)?;
    Ok(())
}

/// fork after migration, then the *device* writes in the parent while the child still
/// shares the pages: the parent's device-private entries are read-only (COW), so the write
/// brings the block back (for both processes) and breaks COW as a CPU write would. The
/// child keeps the old data, the parent sees the device's.
fn dpriv_device_write_after_fork_breaks_cow() -> TestResult {
    let (g, s, d, frames0, m) = migrated(16, 9)?;
    let w = m.words();
    let mut fds = [0i32; 2];
    // SAFETY: a pipe into our own array.
    ensure!(unsafe { libc::pipe(fds.as_mut_ptr()) } == 0, "pipe");
    // SAFETY: the child only reads the pipe and its memory, then exits.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let mut b = [0u8; 1];
        // SAFETY: our pipe and buffer.
        let got = unsafe { libc::read(fds[0], b.as_mut_ptr().cast(), 1) };
        let ok = got == 1 && m.words().iter().enumerate().all(|(i, &x)| x == pattern(9, i));
        // SAFETY: leaving the forked child.
        unsafe { libc::_exit(if ok { 0 } else { 30 }) };
    }
    ensure!(pid > 0, "fork failed");
    let res = (|| -> TestResult {
        let q = ok!(g.query(m.addr, 16));
        ensure!(q.iter().all(|&x| x == GMEM_LOC_DEVICE | (d << 8)), "not on the device after fork: {q:x?}");
        let out0 = sysmem(d, "out")?;
        ok!(s.fill(m.addr, m.len as u64, 0x4400));
        // The device's write brought the shared pages back (it could not write them there).
        ensure!(sysmem(d, "out")? >= out0 + 16, "{} pages came back for the write", sysmem(d, "out")? - out0);
        ensure!(w.iter().enumerate().all(|(i, &x)| x == 0x4400 + i as u32), "the parent misses the device's fill");
        Ok(())
    })();
    // SAFETY: our pipe; the child waits for this byte.
    unsafe {
        libc::write(fds[1], [1u8].as_ptr().cast(), 1);
        libc::close(fds[0]);
        libc::close(fds[1]);
    }
    let mut status = 0;
    // SAFETY: our child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    res?;
    ensure!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "the child saw the parent's device write");
    drop(m);
    wait_frames(d, frames0)
}

/// More process memory than the device holds: migration makes room by evicting earlier
/// migrated pages (the pool's one eviction), and every page reads back intact.
fn dpriv_eviction_shares_the_pool() -> TestResult {
    let (g, s) = open()?;
    let d = gmem_id(&s)?;
    let frames = ok!(s.info()).nr_frames as usize;
    let ev0 = sysmem(d, "evicted")?;
    let n = frames + frames / 2;
    let m = Anon::new(n * PAGE, libc::PROT_READ | libc::PROT_WRITE)?;
    let w = m.words();
    w.iter_mut().enumerate().for_each(|(i, x)| *x = pattern(0x99, i));
    ok!(g.advise(m.addr, m.len as u64, GMEM_ADV_PREFETCH, d as i32, 0));
    let ev = sysmem(d, "evicted")?;
    ensure!(ev > ev0, "{n} pages on a device of {frames} frames evicted nothing");
    let q = ok!(g.query(m.addr, n));
    let on_dev = q.iter().filter(|&&x| x == GMEM_LOC_DEVICE | (d << 8)).count();
    ensure!(on_dev > 0 && on_dev <= frames, "{on_dev} of {n} pages on a device of {frames} frames");
    // Migration evicted no more than it needed: one block's worth of slack at most.
    ensure!(ev - ev0 <= (n - frames + 512) as u64, "{} pages evicted to migrate {n} into {frames}", ev - ev0);
    // Region memory and process memory share the pool: a region prefetch of the whole
    // device evicts the latter.
    let r = ok!(g.alloc(frames as u64 * PAGE as u64));
    ok!(g.advise(r.addr, r.len as u64, GMEM_ADV_PREFETCH, d as i32, 0));
    ensure!(sysmem(d, "evicted")? > ev, "a region's prefetch evicted no process memory");
    ensure!(w.iter().enumerate().all(|(i, &x)| x == pattern(0x99, i)), "data lost through eviction");
    // Pages that eviction brought back move again like any other.
    drop(r);
    let q = ok!(g.query(m.addr, 64));
    ensure!(q.iter().all(|&x| x == GMEM_LOC_HOST | GMEM_Q_CPU_MAPPED), "after eviction: {q:x?}");
    let in0 = sysmem(d, "in")?;
    ok!(g.advise(m.addr, 64 * PAGE as u64, GMEM_ADV_PREFETCH, d as i32, 0));
    ensure!(sysmem(d, "in")? == in0 + 64, "{} of 64 evicted pages moved again", sysmem(d, "in")? - in0);
    Ok(())
}

/// PREFERRED_LOC of a device on ordinary memory: its faults move the pages into its memory
/// (block by block) instead of mapping them remotely; ACCESSED_BY of the same device wins
/// (remote mapping); unset, faults map remotely again. Advice that needs a region is ENOENT.
fn dpriv_preferred_location_migrates_on_fault() -> TestResult {
    use libgmem::{
        GMEM_ADV_ACCESSED_BY, GMEM_ADV_PREFERRED_LOC, GMEM_ADV_READ_MOSTLY, GMEM_ADV_UNSET_ACCESSED_BY,
        GMEM_ADV_UNSET_PREFERRED_LOC, GMEM_Q_REMOTE,
    };
    let (g, s, d, frames0, m) = setup(96)?;
    let w = m.words();
    w.iter_mut().enumerate().for_each(|(i, x)| *x = pattern(0x42, i));
    let want = checksum(w);
    let third = 32 * PAGE as u64;
    // First third: preferred here; second: preferred here but accessed-by; last: no advice.
    ok!(g.advise(m.addr, 2 * third, GMEM_ADV_PREFERRED_LOC, d as i32, 0));
    ok!(g.advise(m.addr + third, third, GMEM_ADV_ACCESSED_BY, d as i32, 0));
    let o = ok!(s.checksum(m.addr, m.len as u64));
    ensure!(o.result == want, "device checksum {:#x} != {want:#x}", o.result);
    let q = ok!(g.query(m.addr, 96));
    let host = GMEM_LOC_HOST | GMEM_Q_CPU_MAPPED | GMEM_Q_REMOTE;
    ensure!(q[..32].iter().all(|&x| x == GMEM_LOC_DEVICE | (d << 8)), "preferred pages: {:x?}", &q[..32]);
    ensure!(q[32..].iter().all(|&x| x == host), "accessed-by and unadvised pages: {:x?}", &q[32..]);
    ensure!(sysmem(d, "frames")? == frames0 + 32, "frames held: {}", sysmem(d, "frames")?);
    // The CPU takes them back; with the advice gone the device maps them remotely.
    ensure!(w.iter().enumerate().all(|(i, &x)| x == pattern(0x42, i)), "data changed");
    ok!(g.advise(m.addr, m.len as u64, GMEM_ADV_UNSET_PREFERRED_LOC, 0, 0));
    ok!(g.advise(m.addr, m.len as u64, GMEM_ADV_UNSET_ACCESSED_BY, d as i32, 0));
    ensure!(ok!(s.checksum(m.addr, m.len as u64)).result == want, "checksum after unset");
    ensure!(ok!(g.query(m.addr, 96)).iter().all(|&x| x == host), "unset advice still migrates");
    wait_frames(d, frames0)?;
    crate::expect_errno!(g.advise(m.addr, m.len as u64, GMEM_ADV_READ_MOSTLY, 0, 0), libc::ENOENT);
    crate::expect_errno!(g.advise(0x10000, 4096, GMEM_ADV_PREFERRED_LOC, d as i32, 0), libc::ENOENT);
    Ok(())
}

/// PREFERRED_LOC of a device, and the CPU keeps writing the same block: the moves are
/// seen as thrashing (the regions' policy, keyed by the block) and the block stays on the
/// host, mapped remotely, with every write kept.
fn dpriv_bouncing_block_stays_on_the_host() -> TestResult {
    crate::t_overcommit::with_slow_thrash_window(bounce)
}

fn bounce() -> TestResult {
    use libgmem::GMEM_ADV_UNSET_PREFERRED_LOC;
    let (g, s, d, frames0, m) = setup(16)?;
    bounce_until_remote(&g, &s, d, &m)?;
    ok!(g.advise(m.addr, m.len as u64, GMEM_ADV_UNSET_PREFERRED_LOC, 0, 0));
    drop(m);
    wait_frames(d, frames0)
}

/// With PREFERRED_LOC of device `d` on `m`, CPU and device take turns writing its first
/// page until thrashing leaves the block on the host, mapped remotely; checks the data
/// throughout.
fn bounce_until_remote(g: &Gmem, s: &Sim, d: u32, m: &Anon) -> TestResult {
    use libgmem::{GMEM_ADV_PREFERRED_LOC, GMEM_Q_REMOTE};
    let before = crate::t_overcommit::counter(d, "prefetch.thrash_events")?;
    ok!(g.advise(m.addr, m.len as u64, GMEM_ADV_PREFERRED_LOC, d as i32, 0));
    let w = m.words();
    let mut expect = 0u32;
    let mut remote = false;
    for round in 0..200 {
        w[0] = w[0].wrapping_add(1); // CPU write: the block comes home
        expect = expect.wrapping_add(1);
        ok!(s.touch(m.addr, 4096, 1, 1, true)); // device write: it moves out again
        expect = expect.wrapping_add(1);
        let q = ok!(g.query(m.addr, 1))[0];
        if q == GMEM_LOC_HOST | GMEM_Q_CPU_MAPPED | GMEM_Q_REMOTE {
            remote = true;
            ensure!(round > 1, "kept on the host after only {round} rounds");
            break;
        }
        ensure!(q == GMEM_LOC_DEVICE | (d << 8), "round {round}: page at {q:#x}");
    }
    let events = crate::t_overcommit::counter(d, "prefetch.thrash_events")? - before;
    ensure!(events > 0 && remote, "no thrashing seen in 200 bounces ({events} events)");
    ensure!(w[0] == expect, "data lost while bouncing: {} != {expect}", w[0]);
    Ok(())
}

/// A fresh anonymous mapping of `len` bytes at exactly `addr` (where one was just unmapped).
fn anon_at(addr: u64, len: usize) -> Result<Anon, String> {
    let m = Anon::at(addr as *mut libc::c_void, len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_FIXED_NOREPLACE)?;
    ensure!(m.addr == addr, "mapped at {:#x}, not at {addr:#x}", m.addr);
    // SAFETY: our own mapping.
    ensure!(unsafe { libc::madvise(m.addr as *mut libc::c_void, m.len, libc::MADV_NOHUGEPAGE) } == 0, "madvise");
    Ok(m)
}

/// Unmaps `m` and maps fresh memory of the same size at its address.
fn remapped(m: Anon) -> Result<Anon, String> {
    let (addr, len) = (m.addr, m.len);
    drop(m);
    anon_at(addr, len)
}

/// PREFERRED_LOC of device `d` on `m`, then the device writes page `k` (one it has not
/// touched yet): it must move to the device (`what` says which memory).
fn moves_when_advised(g: &Gmem, s: &Sim, d: u32, m: &Anon, k: usize, what: &str) -> TestResult {
    use libgmem::GMEM_ADV_PREFERRED_LOC;
    ok!(g.advise(m.addr, m.len as u64, GMEM_ADV_PREFERRED_LOC, d as i32, 0));
    let q = device_write_after_cpu(g, s, m, k)?;
    ensure!(q == GMEM_LOC_DEVICE | (d << 8), "{what} did not move (query word {q:#x})");
    Ok(())
}

/// The device writes page `k` of `m` (after the CPU did); QUERY's word for it right after
/// (then the CPU reads the device's write, which brings a migrated page home).
fn device_write_after_cpu(g: &Gmem, s: &Sim, m: &Anon, k: usize) -> Result<u32, String> {
    let (addr, w) = (m.addr + (k * PAGE) as u64, k * PAGE / 4);
    m.words()[w] = 5;
    ok!(s.touch(addr, 4096, 1, 1, true));
    let q = ok!(g.query(addr, 1))[0];
    ensure!(m.words()[w] == 6, "the device's write is not there: {}", m.words()[w]);
    Ok(q)
}

/// Ordinary memory's advice ends with its mapping, as a VMA's policy does: PREFERRED_LOC
/// of the device on a buffer, the buffer unmapped (no device ever touched it), and new
/// memory mapped at the same address is mapped remotely by the device, not moved into its
/// memory. (Before, the advice was kept for the address range and the new memory moved.)
fn dpriv_unmapped_memory_leaves_no_advice() -> TestResult {
    use libgmem::{GMEM_ADV_PREFERRED_LOC, GMEM_Q_REMOTE};
    let (g, s, d, frames0, m) = setup(16)?;
    ok!(g.advise(m.addr, m.len as u64, GMEM_ADV_PREFERRED_LOC, d as i32, 0));
    let m = remapped(m)?;
    let q = device_write_after_cpu(&g, &s, &m, 0)?;
    ensure!(q == GMEM_LOC_HOST | GMEM_Q_CPU_MAPPED | GMEM_Q_REMOTE, "the new memory moved (query word {q:#x})");
    // The control: advised again, a page the device has not touched yet moves.
    moves_when_advised(&g, &s, d, &m, 8, "advised again, the memory")?;
    drop(m);
    wait_frames(d, frames0)
}

/// A block of ordinary memory left on the host by thrashing, then unmapped, leaves no
/// history: new memory at the same address with PREFERRED_LOC of the device moves to it
/// on the device's first write. (Before, the space's thrash table still held the old
/// block's pin, and the new memory stayed on the host, mapped remotely.)
fn dpriv_unmapped_memory_leaves_no_thrash_history() -> TestResult {
    crate::t_overcommit::with_slow_thrash_window(|| {
        let (g, s, d, frames0, m) = setup(16)?;
        bounce_until_remote(&g, &s, d, &m)?;
        let m = remapped(m)?;
        moves_when_advised(&g, &s, d, &m, 0, "the new memory, where the old was pinned,")?;
        drop(m);
        wait_frames(d, frames0)
    })
}

/// Advice on ordinary memory takes a run per mapped part: a range of 33 separate mappings
/// cannot be advised (`E2BIG`, as with more than 32 runs of a region), and nothing of it is
/// advised then; the same range with its holes filled can.
fn dpriv_advice_over_too_many_parts_is_e2big() -> TestResult {
    use libgmem::GMEM_ADV_PREFERRED_LOC;
    let (g, s, d, frames0, whole) = setup(65)?;
    let (addr, len) = (whole.addr, whole.len);
    // Every odd page unmapped: 33 mapped pages, none touching another.
    for k in (1..65).step_by(2) {
        // SAFETY: a page of our own mapping.
        ensure!(unsafe { libc::munmap((addr + (k * PAGE) as u64) as *mut libc::c_void, PAGE) } == 0, "munmap");
    }
    crate::expect_errno!(g.advise(addr, len as u64, GMEM_ADV_PREFERRED_LOC, d as i32, 0), libc::E2BIG);
    // Nothing was advised: the device maps the first page remotely.
    let first = Anon { addr, len: PAGE };
    let q = device_write_after_cpu(&g, &s, &first, 0)?;
    ensure!(q & 0xff == GMEM_LOC_HOST, "advised after E2BIG ({q:#x})");
    std::mem::forget(first);
    // Holes filled: one part, advised.
    for k in (1..65).step_by(2) {
        std::mem::forget(anon_at(addr + (k * PAGE) as u64, PAGE)?);
    }
    ok!(g.advise(addr, len as u64, GMEM_ADV_PREFERRED_LOC, d as i32, 0));
    drop(whole);
    wait_frames(d, frames0)
}

/// mremap moving advised memory away is an unmap of its old addresses: new memory mapped
/// there has no advice (and the moved memory keeps none either: advice stays with
/// addresses, and these are new ones).
fn dpriv_mremap_leaves_no_advice_behind() -> TestResult {
    use libgmem::{GMEM_ADV_PREFERRED_LOC, GMEM_Q_REMOTE};
    let (g, s, d, frames0, m) = setup(16)?;
    ok!(g.advise(m.addr, m.len as u64, GMEM_ADV_PREFERRED_LOC, d as i32, 0));
    let (old, len) = (m.addr, m.len);
    // The target: a mapping of our own that the move replaces.
    let moved = Anon::new(len, libc::PROT_READ | libc::PROT_WRITE)?;
    // SAFETY: moves our own mapping over our own mapping.
    let p = unsafe {
        libc::mremap(
            old as *mut libc::c_void,
            len,
            len,
            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
            moved.addr as *mut libc::c_void,
        )
    };
    ensure!(p as u64 == moved.addr, "mremap: {}", std::io::Error::last_os_error());
    // Its old addresses are unmapped now: the `Anon` there must not unmap them again.
    std::mem::forget(m);
    let fresh = anon_at(old, len)?;
    let remote = GMEM_LOC_HOST | GMEM_Q_CPU_MAPPED | GMEM_Q_REMOTE;
    let q = device_write_after_cpu(&g, &s, &fresh, 0)?;
    ensure!(q == remote, "new memory at the old addresses moved (query word {q:#x})");
    let q = device_write_after_cpu(&g, &s, &moved, 0)?;
    ensure!(q == remote, "the moved memory took the advice along (query word {q:#x})");
    // The control: advised again, a page the device has not touched yet moves.
    moves_when_advised(&g, &s, d, &fresh, 8, "advised again, the memory")?;
    drop(fresh);
    drop(moved);
    wait_frames(d, frames0)
}

/// Advice on ordinary memory covers the parts of its range that are mapped when it is
/// given, as mbind does: a range whose second half is a hole advises the first half only,
/// and memory mapped in the hole later is mapped remotely, not moved.
fn dpriv_advice_covers_only_mapped_memory() -> TestResult {
    use libgmem::{GMEM_ADV_PREFERRED_LOC, GMEM_Q_REMOTE};
    let (g, s, d, frames0, whole) = setup(32)?;
    let (addr, half) = (whole.addr, whole.len / 2);
    // Its halves are unmapped one by one: the first by `m`, the second now (the hole).
    std::mem::forget(whole);
    let m = Anon { addr, len: half };
    // SAFETY: the second half of our own mapping.
    ensure!(unsafe { libc::munmap((addr + half as u64) as *mut libc::c_void, half) } == 0, "munmap");
    ok!(g.advise(addr, 2 * half as u64, GMEM_ADV_PREFERRED_LOC, d as i32, 0));
    let hole = anon_at(addr + half as u64, half)?;
    let q = device_write_after_cpu(&g, &s, &hole, 0)?;
    ensure!(q == GMEM_LOC_HOST | GMEM_Q_CPU_MAPPED | GMEM_Q_REMOTE, "memory mapped after the advice moved ({q:#x})");
    let q = device_write_after_cpu(&g, &s, &m, 0)?;
    ensure!(q == GMEM_LOC_DEVICE | (d << 8), "the advised memory did not move ({q:#x})");
    drop(hole);
    drop(m);
    wait_frames(d, frames0)
}

/// Memory no page of which can move stays on the host, mapped remotely, and PREFETCH of it
/// succeeds: shared anonymous memory (shmem) and a private file mapping not yet written
/// (its pages are the file's). Nothing goes through the copy engine.
fn dpriv_unmovable_memory_stays_and_maps() -> TestResult {
    use std::io::Write;
    let (g, s) = open()?;
    let d = gmem_id(&s)?;
    let in0 = sysmem(d, "in")?;
    // SAFETY: a fresh shared anonymous mapping, unmapped below.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            16 * PAGE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    ensure!(p != libc::MAP_FAILED, "mmap shared: {}", std::io::Error::last_os_error());
    // SAFETY: mapped for 16 pages until the munmap below.
    let w = unsafe { std::slice::from_raw_parts_mut(p.cast::<u32>(), 16 * PAGE / 4) };
    w.iter_mut().enumerate().for_each(|(i, x)| *x = pattern(3, i));
    let copies0 = ok!(s.info()).copies;
    let r = (|| -> TestResult {
        ok!(g.advise(p as u64, 16 * PAGE as u64, GMEM_ADV_PREFETCH, d as i32, 0));
        ensure!(ok!(s.checksum(p as u64, 16 * PAGE as u64)).result == checksum(w), "shared memory checksum");
        Ok(())
    })();
    // SAFETY: our mapping.
    unsafe { libc::munmap(p, 16 * PAGE) };
    r?;
    let path = "/tmp/gmem_dpriv_file";
    let mut f = std::fs::File::create(path).map_err(|e| e.to_string())?;
    let data: Vec<u8> = (0..16 * PAGE).map(|i| (i % 251) as u8).collect();
    f.write_all(&data).map_err(|e| e.to_string())?;
    let f = std::fs::File::open(path).map_err(|e| e.to_string())?;
    // SAFETY: a private read-only mapping of our file, unmapped below.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            16 * PAGE,
            libc::PROT_READ,
            libc::MAP_PRIVATE,
            std::os::fd::AsRawFd::as_raw_fd(&f),
            0,
        )
    };
    let _ = std::fs::remove_file(path);
    ensure!(p != libc::MAP_FAILED, "mmap file: {}", std::io::Error::last_os_error());
    let r = (|| -> TestResult {
        // SAFETY: mapped for 16 pages until the munmap below.
        let words = unsafe { std::slice::from_raw_parts(p.cast::<u32>(), 16 * PAGE / 4) };
        // Read by the CPU first: the page-cache pages are mapped, so a migration collects
        // them (and must leave them where they are).
        let sum = checksum(words);
        ok!(g.advise(p as u64, 16 * PAGE as u64, GMEM_ADV_PREFETCH, d as i32, 0));
        ensure!(ok!(s.checksum(p as u64, 16 * PAGE as u64)).result == sum, "file checksum");
        Ok(())
    })();
    // SAFETY: our mapping.
    unsafe { libc::munmap(p, 16 * PAGE) };
    r?;
    ensure!(sysmem(d, "in")? == in0, "{} pages of unmovable memory moved", sysmem(d, "in")? - in0);
    ensure!(ok!(s.info()).copies == copies0, "unmovable memory went through the copy engine");
    Ok(())
}

pub fn tests() -> Vec<Test> {
    vec![
        Test { name: "dpriv_buffer_migrated_and_read_back", f: dpriv_buffer_migrated_and_read_back },
        Test {
            name: "dpriv_prefetch_home_of_an_inaccessible_mapping",
            f: dpriv_prefetch_home_of_an_inaccessible_mapping,
        },
        Test { name: "dpriv_failed_copy_home_is_an_error", f: dpriv_failed_copy_home_is_an_error },
        Test { name: "dpriv_untouched_memory_moves_as_zeros", f: dpriv_untouched_memory_moves_as_zeros },
        Test { name: "dpriv_process_exits_with_buffer_on_device", f: dpriv_process_exits_with_buffer_on_device },
        Test { name: "dpriv_fork_after_migration", f: dpriv_fork_after_migration },
        Test { name: "dpriv_device_write_after_fork_breaks_cow", f: dpriv_device_write_after_fork_breaks_cow },
        Test { name: "dpriv_eviction_shares_the_pool", f: dpriv_eviction_shares_the_pool },
        Test { name: "dpriv_preferred_location_migrates_on_fault", f: dpriv_preferred_location_migrates_on_fault },
        Test { name: "dpriv_bouncing_block_stays_on_the_host", f: dpriv_bouncing_block_stays_on_the_host },
        Test { name: "dpriv_unmovable_memory_stays_and_maps", f: dpriv_unmovable_memory_stays_and_maps },
        Test { name: "dpriv_unmapped_memory_leaves_no_advice", f: dpriv_unmapped_memory_leaves_no_advice },
        Test {
            name: "dpriv_unmapped_memory_leaves_no_thrash_history",
            f: dpriv_unmapped_memory_leaves_no_thrash_history,
        },
        Test { name: "dpriv_advice_covers_only_mapped_memory", f: dpriv_advice_covers_only_mapped_memory },
        Test { name: "dpriv_mremap_leaves_no_advice_behind", f: dpriv_mremap_leaves_no_advice_behind },
        Test { name: "dpriv_advice_over_too_many_parts_is_e2big", f: dpriv_advice_over_too_many_parts_is_e2big },
    ]
}
