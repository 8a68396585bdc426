// SPDX-License-Identifier: GPL-2.0
//! Ordinary process memory on the device (issue 11): kernels of `/dev/gmem_sim0` run on
//! `malloc`'d, `mmap`'d, stack and file-backed memory, which gmem mirrors through HMM
//! (`gmem/obj/mirror.rs`). The scenarios follow `tools/testing/selftests/mm/hmm-tests.c`:
//! data both ways, read-only mappings, munmap, fork with COW, file mappings, THP, exit,
//! and device access racing munmap.

use crate::harness::{my_space_stat, open, sh, vmstat, Test, TestResult};
use crate::{ensure, expect_errno, ok};
use libgmem::csample::CSample;
use libgmem::sim::{checksum, Sim};
use libgmem::{GMEM_ADVF_ASYNC, GMEM_ADV_PREFETCH, GMEM_HOST, GMEM_Q_REMOTE};
use std::os::unix::fs::FileExt;

const PAGE: usize = 4096;

/// An anonymous private mapping, unmapped on drop (unless forgotten).
pub(crate) struct Anon {
    pub(crate) addr: u64,
    pub(crate) len: usize,
}

impl Anon {
    pub(crate) fn new(len: usize, prot: i32) -> Result<Anon, String> {
        Anon::at(std::ptr::null_mut(), len, prot, 0)
    }

    pub(crate) fn at(hint: *mut libc::c_void, len: usize, prot: i32, extra: i32) -> Result<Anon, String> {
        // SAFETY: a fresh anonymous mapping (MAP_FIXED only over our own reservation).
        let p = unsafe { libc::mmap(hint, len, prot, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | extra, -1, 0) };
        if p == libc::MAP_FAILED {
            return Err(format!("mmap {len}: {}", std::io::Error::last_os_error()));
        }
        Ok(Anon { addr: p as u64, len })
    }

    pub(crate) fn words(&self) -> &'static mut [u32] {
        // SAFETY: mapped for `len` bytes while `self` lives; tests drop the slice first.
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut u32, self.len / 4) }
    }
}

impl Drop for Anon {
    fn drop(&mut self) {
        // SAFETY: our own mapping.
        unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len) };
    }
}

fn sim_ptes(s: &Sim) -> Result<u64, String> {
    Ok(s.info().map_err(|e| format!("INFO: {e}"))?.ptes)
}

/// A `Vec` buffer (musl malloc) read and written by the device: zero copy, data both ways.
fn sysmem_malloc_buffer_both_ways() -> TestResult {
    let (_g, s) = open()?;
    let n = 64 * PAGE / 4;
    let mut v: Vec<u32> = (0..n as u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
    let copies = ok!(s.info()).copies;
    let o = ok!(s.checksum(v.as_ptr() as u64, (n * 4) as u64));
    ensure!(o.result == checksum(&v), "device checksum {:#x} != CPU {:#x}", o.result, checksum(&v));
    ensure!(o.faults > 0, "the device read malloc'd memory without a fault");
    ok!(s.fill(v.as_mut_ptr() as u64, (n * 4) as u64, 0x7000));
    for (i, w) in v.iter().enumerate() {
        ensure!(*w == 0x7000 + i as u32, "word {i}: CPU sees {w:#x} after the device's fill");
    }
    // The CPU writes again; the device sees it (same pages, mapped remotely: no copies).
    v[5] = 0xdead_beef;
    let o = ok!(s.checksum(v.as_ptr() as u64, (n * 4) as u64));
    ensure!(o.result == checksum(&v), "device checksum after a CPU write is stale");
    ensure!(ok!(s.info()).copies == copies, "mirrored memory went through the copy engine");
    Ok(())
}

/// Read-only memory maps read-only: reads work, a device write fails with EPERM, also after
/// the device had it writable and the process took the write permission away.
fn sysmem_read_only_refuses_device_writes() -> TestResult {
    let (_g, s) = open()?;
    let m = Anon::new(16 * PAGE, libc::PROT_READ | libc::PROT_WRITE)?;
    let w = m.words();
    for (i, x) in w.iter_mut().enumerate() {
        *x = i as u32 ^ 0x5a5a;
    }
    // Writable first: the device fills half.
    ok!(s.fill(m.addr, 8 * PAGE as u64, 0x100));
    // SAFETY: our own mapping.
    ensure!(unsafe { libc::mprotect(m.addr as *mut libc::c_void, m.len, libc::PROT_READ) } == 0, "mprotect failed");
    let o = ok!(s.checksum(m.addr, m.len as u64));
    ensure!(o.result == checksum(w), "device reads of read-only memory disagree with the CPU");
    // The write entries went with mprotect: the device must fault and be refused.
    expect_errno!(s.fill(m.addr, PAGE as u64, 0x200), libc::EPERM);
    expect_errno!(s.fill(m.addr + 12 * PAGE as u64, PAGE as u64, 0x200), libc::EPERM);
    ensure!(w[0] == 0x100 && w[12 * 1024] == (12 * 1024) ^ 0x5a5a, "a refused device write changed memory");
    // PROT_NONE: not even reads.
    // SAFETY: as above.
    ensure!(unsafe { libc::mprotect(m.addr as *mut libc::c_void, m.len, libc::PROT_NONE) } == 0, "mprotect failed");
    expect_errno!(s.checksum(m.addr, PAGE as u64), libc::EFAULT);
    Ok(())
}

/// munmap while the device maps the pages: its entries go, later accesses get EFAULT, and
/// new memory at the same address is seen fresh.
fn sysmem_munmap_while_device_mapped() -> TestResult {
    let (_g, s) = open()?;
    let before = sim_ptes(&s)?;
    let m = Anon::new(32 * PAGE, libc::PROT_READ | libc::PROT_WRITE)?;
    ok!(s.fill(m.addr, m.len as u64, 0x900));
    ensure!(sim_ptes(&s)? >= before + 32, "the device did not map the 32 pages");
    let (addr, len) = (m.addr, m.len);
    drop(m);
    ensure!(sim_ptes(&s)? == before, "device entries left after munmap: {} (was {before})", sim_ptes(&s)?);
    expect_errno!(s.checksum(addr, len as u64), libc::EFAULT);
    // Fresh zero memory at the same address: the device must not see the old pages.
    let m = Anon::at(addr as *mut libc::c_void, len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_FIXED_NOREPLACE)?;
    let o = ok!(s.checksum(m.addr, m.len as u64));
    ensure!(o.result == checksum(&vec![0u32; len / 4]), "the device saw the unmapped pages' data");
    Ok(())
}

/// MADV_DONTNEED drops the pages: the device then reads zeros, as the CPU does.
fn sysmem_dontneed_drops_device_entries() -> TestResult {
    let (_g, s) = open()?;
    let m = Anon::new(16 * PAGE, libc::PROT_READ | libc::PROT_WRITE)?;
    ok!(s.fill(m.addr, m.len as u64, 1));
    // SAFETY: our own mapping.
    ensure!(unsafe { libc::madvise(m.addr as *mut libc::c_void, m.len, libc::MADV_DONTNEED) } == 0, "madvise");
    ensure!(m.words().iter().all(|&w| w == 0), "CPU sees data after MADV_DONTNEED");
    let o = ok!(s.checksum(m.addr, m.len as u64));
    ensure!(o.result == checksum(m.words()), "the device still reads the dropped pages");
    Ok(())
}

/// fork after the device mapped the parent's pages: COW gives each process its own data,
/// and each process's device writes land in its own copy only.
fn sysmem_fork_cow_each_process_keeps_its_data() -> TestResult {
    let (_g, s) = open()?;
    let m = Anon::new(16 * PAGE, libc::PROT_READ | libc::PROT_WRITE)?;
    let len = m.len as u64;
    ok!(s.fill(m.addr, len, 0xb000));
    let w = m.words();
    let addr = m.addr;
    let code = crate::harness::child_exit(|| {
        // The child: its own space and device context.
        let Ok((_g2, s2)) = open() else { return 10 };
        if w.iter().enumerate().any(|(i, &x)| x != 0xb000 + i as u32) {
            return 11;
        }
        if s2.fill(addr, len, 0xc000).is_err() {
            return 12;
        }
        if w.iter().enumerate().any(|(i, &x)| x != 0xc000 + i as u32) {
            return 13;
        }
        0
    });
    ensure!(code == 0, "child failed with {code} (11: saw wrong data at fork, 12: fill failed, 13: fill not seen)");
    ensure!(w.iter().enumerate().all(|(i, &x)| x == 0xb000 + i as u32), "the child's device writes reached the parent");
    let o = ok!(s.checksum(addr, len));
    ensure!(o.result == checksum(w), "the parent's device reads stale or foreign pages after fork");
    // The parent's device writes after fork break COW on the parent's side.
    ok!(s.fill(addr, len, 0xd000));
    ensure!(w.iter().enumerate().all(|(i, &x)| x == 0xd000 + i as u32), "parent's device fill after fork not seen");
    Ok(())
}

/// The stack, and private and shared file mappings.
fn sysmem_stack_and_file_mappings() -> TestResult {
    let (_g, s) = open()?;
    let mut stack = [7u32; 3 * PAGE / 4];
    ok!(s.fill(stack.as_mut_ptr() as u64, (stack.len() * 4) as u64, 0x400));
    ensure!(stack.iter().enumerate().all(|(i, &x)| x == 0x400 + i as u32), "device fill of the stack not seen");

    let path = "/tmp/gmem-sysmem-file";
    let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(path);
    let f = f.map_err(|e| format!("{path}: {e}"))?;
    let data: Vec<u8> = (0..8 * PAGE).map(|i| (i * 7 % 251) as u8).collect();
    f.write_all_at(&data, 0).map_err(|e| e.to_string())?;
    let _ = std::fs::remove_file(path);
    let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
    let words = |b: &[u8]| b.chunks(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect::<Vec<_>>();
    for shared in [false, true] {
        let flags = if shared { libc::MAP_SHARED } else { libc::MAP_PRIVATE };
        // SAFETY: maps our file; unmapped below.
        let p =
            unsafe { libc::mmap(std::ptr::null_mut(), data.len(), libc::PROT_READ | libc::PROT_WRITE, flags, fd, 0) };
        ensure!(p != libc::MAP_FAILED, "mmap of the file failed");
        let o = s.checksum(p as u64, data.len() as u64);
        let fill = s.fill(p as u64 + PAGE as u64, PAGE as u64, 0x600);
        // SAFETY: the mapping above, still mapped.
        let mem = unsafe { std::slice::from_raw_parts(p.cast::<u32>(), data.len() / 4) }.to_vec();
        // SAFETY: unmapping it.
        unsafe { libc::munmap(p, data.len()) };
        let o = ok!(o);
        ok!(fill);
        ensure!(o.result == checksum(&words(&data)), "device read of the file mapping (shared {shared}) is wrong");
        ensure!(mem[1024..2048].iter().enumerate().all(|(i, &x)| x == 0x600 + i as u32), "device write not seen");
        let mut back = vec![0u8; data.len()];
        f.read_exact_at(&mut back, 0).map_err(|e| e.to_string())?;
        let file_changed = back != data;
        ensure!(file_changed == shared, "file changed: {file_changed}, mapping shared: {shared}");
        if shared {
            ensure!(words(&back)[1024..2048] == mem[1024..2048], "the file does not hold the device's writes");
            f.write_all_at(&data, 0).map_err(|e| e.to_string())?;
        }
    }
    Ok(())
}

/// A 2 MiB THP-backed buffer: read and written by the device; a partial MADV_DONTNEED
/// (which splits the huge page) drops exactly the device entries of that part.
fn sysmem_thp_buffer() -> TestResult {
    let (_g, s) = open()?;
    let huge = 2 << 20;
    let r = Anon::new(2 * huge, libc::PROT_READ | libc::PROT_WRITE)?;
    let base = (r.addr as usize).next_multiple_of(huge);
    // SAFETY: inside our reservation.
    ensure!(unsafe { libc::madvise(base as *mut libc::c_void, huge, libc::MADV_HUGEPAGE) } == 0, "MADV_HUGEPAGE");
    // SAFETY: `base .. base + huge` lies in the reservation.
    let w = unsafe { std::slice::from_raw_parts_mut(base as *mut u32, huge / 4) };
    for (i, x) in w.iter_mut().enumerate() {
        *x = (i as u32).rotate_left(7);
    }
    let thp = std::fs::read_to_string("/proc/self/smaps_rollup")
        .ok()
        .and_then(|t| t.lines().find(|l| l.starts_with("AnonHugePages:")).map(str::to_owned))
        .unwrap_or_default();
    println!("# THP: {}", thp.trim());
    let o = ok!(s.checksum(base as u64, huge as u64));
    ensure!(o.result == checksum(w), "device checksum of the THP buffer is wrong");
    ok!(s.fill(base as u64, huge as u64, 0x10));
    ensure!(w.iter().enumerate().all(|(i, &x)| x == 0x10 + i as u32), "device fill of the THP buffer not seen");
    // SAFETY: the second half of the huge page.
    ensure!(
        unsafe { libc::madvise((base + huge / 2) as *mut libc::c_void, huge / 2, libc::MADV_DONTNEED) } == 0,
        "madvise"
    );
    let o = ok!(s.checksum(base as u64, huge as u64));
    ensure!(o.result == checksum(w), "device reads after the split disagree with the CPU");
    ensure!(w[huge / 8 - 1] == 0x10 + (huge / 8 - 1) as u32 && w[huge / 4 - 1] == 0, "split kept the wrong half");
    Ok(())
}

/// A process exits with device entries of its memory: they all go with it.
fn sysmem_exit_with_device_mappings() -> TestResult {
    let (_g, s) = open()?;
    let before = sim_ptes(&s)?;
    let code = crate::harness::child_exit(|| {
        let Ok((_g2, s2)) = open() else { return 10 };
        let Ok(m) = Anon::new(64 * PAGE, libc::PROT_READ | libc::PROT_WRITE) else { return 11 };
        if s2.fill(m.addr, m.len as u64, 3).is_err() {
            return 12;
        }
        std::mem::forget(m);
        // SAFETY: exits without unmapping anything or closing the device.
        unsafe { libc::_exit(0) }
    });
    ensure!(code == 0, "child failed with {code}");
    // The last reference to the child's space may be dropped a moment after its exit.
    for _ in 0..200 {
        if sim_ptes(&s)? == before {
            return Ok(());
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    Err(format!("device entries left after the child exited: {} (was {before})", sim_ptes(&s)?))
}

/// A device's write faults keep their writable entries: fault-around of later batches in
/// the same block must not map those pages read-only again (a map only adds rights), so a
/// second FILL faults nothing, with and without THP; and faults come in batches.
fn sysmem_refill_faults_nothing() -> TestResult {
    let (_g, s) = open()?;
    for huge in [false, true] {
        let m = Anon::new(4 << 20, libc::PROT_READ | libc::PROT_WRITE)?;
        let advice = if huge { libc::MADV_HUGEPAGE } else { libc::MADV_NOHUGEPAGE };
        // SAFETY: our own mapping.
        ensure!(unsafe { libc::madvise(m.addr as *mut libc::c_void, m.len, advice) } == 0, "madvise");
        let o = ok!(s.fill(m.addr, m.len as u64, 1));
        ensure!(
            o.faults == 1024 && o.batches <= 8,
            "first fill (THP {huge}): {} faults in {} batches",
            o.faults,
            o.batches
        );
        let o = ok!(s.checksum(m.addr, m.len as u64));
        ensure!(o.faults == 0, "a read after the fill faulted {} times (THP {huge})", o.faults);
        let o = ok!(s.fill(m.addr, m.len as u64, 2));
        ensure!(o.faults == 0, "a second fill faulted {} times (THP {huge}): entries lost their write right", o.faults);
        ensure!(m.words().iter().enumerate().all(|(i, &w)| w == 2 + i as u32), "second fill not seen (THP {huge})");
    }
    // A range that starts inside a page still faults in windows, not page by page (the sim
    // once prefaulted only when its offset met a multiple of the window, which an
    // unaligned start never does again).
    let m = Anon::new(4 << 20, libc::PROT_READ | libc::PROT_WRITE)?;
    let o = ok!(s.fill(m.addr + 0xc0, (4 << 20) - 0x100, 3));
    ensure!(o.faults == 1024 && o.batches <= 8, "unaligned fill: {} faults in {} batches", o.faults, o.batches);
    Ok(())
}

/// Device accesses race munmap/mmap of the same address: each launch either succeeds or
/// fails cleanly, the kernel stays quiet (the harness checks the console), and the
/// device entries all go at the end.
fn sysmem_device_access_races_munmap() -> TestResult {
    let (_g, s) = open()?;
    let before = sim_ptes(&s)?;
    let len = 64 * PAGE;
    let m = Anon::new(len, libc::PROT_READ | libc::PROT_WRITE)?;
    let addr = m.addr;
    std::mem::forget(m);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let remapper = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut rounds = 0u32;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) && rounds < 400 {
                // SAFETY: our own reservation at `addr`, replaced in place.
                unsafe {
                    libc::munmap(addr as *mut libc::c_void, len);
                    let p = libc::mmap(
                        addr as *mut libc::c_void,
                        len,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                        -1,
                        0,
                    );
                    if p != libc::MAP_FAILED {
                        std::ptr::write_volatile(p.cast::<u32>(), rounds);
                    }
                }
                rounds += 1;
                std::thread::yield_now();
            }
            rounds
        })
    };
    let (mut oks, mut faults) = (0u32, 0u32);
    for i in 0..200u32 {
        let r = if i % 2 == 0 { s.checksum(addr, len as u64) } else { s.fill(addr, len as u64, i) };
        match r {
            Ok(_) => oks += 1,
            // Unmapped when the device faulted (EFAULT); or the device's replays, or gmem's
            // snapshots, kept losing the race (EIO, EBUSY): clean refusals all.
            Err(libgmem::Errno(e)) if [libc::EFAULT, libc::EIO, libc::EBUSY].contains(&e) => faults += 1,
            Err(e) => {
                stop.store(true, std::sync::atomic::Ordering::Relaxed);
                let _ = remapper.join();
                return Err(format!("launch {i} during munmap races: {e}"));
            }
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let rounds = remapper.join().map_err(|_| "remapper panicked".to_string())?;
    println!("# {oks} launches ok, {faults} refused cleanly, {rounds} munmap+mmap rounds");
    // Whether any launch won the race depends on the guest's speed (none may, on the debug
    // kernel); once the mapping holds still, the device must use it again.
    ok!(s.fill(addr, len as u64, 0x55));
    // SAFETY: the mapping is ours and stays mapped until the munmap below.
    let w = unsafe { std::slice::from_raw_parts(addr as *const u32, len / 4) };
    ensure!(w.iter().enumerate().all(|(i, &x)| x == 0x55 + i as u32), "the final fill is not seen by the CPU");
    // SAFETY: our mapping.
    unsafe { libc::munmap(addr as *mut libc::c_void, len) };
    ensure!(sim_ptes(&s)? == before, "device entries left after the final munmap");
    Ok(())
}

/// QUERY on ordinary memory: never touched, on the host (CPU-mapped), mapped remotely by
/// a device; nothing faulted in by asking; a range running into unmapped space, or an
/// unmapped address, is ENOENT.
fn sysmem_query_reports_residency() -> TestResult {
    use libgmem::{GMEM_LOC_HOST, GMEM_LOC_NONE, GMEM_Q_CPU_MAPPED};
    let (g, s) = open()?;
    let host = GMEM_LOC_HOST | GMEM_Q_CPU_MAPPED;
    // Page 0 too is mapped on the device: fault-around maps the block's present pages.
    let want =
        [host | GMEM_Q_REMOTE, GMEM_LOC_NONE, GMEM_LOC_NONE, host | GMEM_Q_REMOTE, host | GMEM_Q_REMOTE, 0, 0, 0];
    // Fault-around is best effort: a page the kernel migrates meanwhile (compaction) is
    // skipped while its migration entry is in place, and unmapped from the device when its
    // migration unmaps it, whether that then succeeds or fails (the CPU entry comes back).
    // A miss is retried only if the kernel migrated pages or tried to, or an invalidation
    // unmapped device entries of this process, meanwhile.
    let moves = || -> Result<u64, String> {
        // `mirror_invalidations`: MMU-notifier invalidations that unmapped device entries
        // of this process's ordinary memory.
        Ok(vmstat("pgmigrate_success")? + vmstat("pgmigrate_fail")? + my_space_stat("mirror_invalidations")?)
    };
    let mut attempt = 0;
    let m = loop {
        attempt += 1;
        let moved = moves()?;
        let m = Anon::new(8 * PAGE, libc::PROT_READ | libc::PROT_WRITE)?;
        // Page by page: no large folio populates neighbours of a faulted page.
        // SAFETY: our own mapping.
        ensure!(unsafe { libc::madvise(m.addr as *mut libc::c_void, m.len, libc::MADV_NOHUGEPAGE) } == 0, "madvise");
        let q = ok!(g.query(m.addr, 8));
        ensure!(q.iter().all(|&w| w == GMEM_LOC_NONE), "untouched memory: {q:x?}");
        // Asking faulted nothing in.
        ensure!(ok!(g.query(m.addr, 8)).iter().all(|&w| w == GMEM_LOC_NONE), "QUERY faulted pages in");
        // Page 0 on the host, and page 3.
        m.words()[0] = 1;
        m.words()[3 * 1024] = 1;
        // Pages 3 and 4, by the device: only they are faulted in (page 4 populated).
        ok!(s.fill(m.addr + 3 * PAGE as u64, 2 * PAGE as u64, 9));
        let q = ok!(g.query(m.addr, 8));
        if q == want {
            break m;
        }
        let moved = moves()?.saturating_sub(moved);
        ensure!(
            moved != 0 && attempt < 3,
            "residency {q:x?}, expected {want:x?} ({moved} migrations, failed ones and invalidations meanwhile, attempt {attempt})"
        );
    };
    // From an unaligned address inside page 3, two pages.
    ensure!(ok!(g.query(m.addr + 3 * PAGE as u64 + 8, 2)) == want[3..5], "unaligned QUERY");
    // Past the end of the mapping (its neighbour is not guaranteed to be unmapped, so
    // make a hole first) and at an unmapped address.
    // SAFETY: the last page of our own mapping.
    ensure!(unsafe { libc::munmap((m.addr + 7 * PAGE as u64) as *mut libc::c_void, PAGE) } == 0, "munmap");
    expect_errno!(g.query(m.addr + 6 * PAGE as u64, 2), libc::ENOENT);
    expect_errno!(g.query(0x10000, 1), libc::ENOENT);
    // After munmap the device's entries are gone from the record too.
    ok!(s.fill(m.addr, PAGE as u64, 5));
    ensure!(ok!(g.query(m.addr, 1))[0] & GMEM_Q_REMOTE != 0, "device mapping not reported");
    // SAFETY: page 0 of our own mapping.
    ensure!(unsafe { libc::madvise(m.addr as *mut libc::c_void, PAGE, libc::MADV_DONTNEED) } == 0, "madvise");
    ensure!(ok!(g.query(m.addr, 1))[0] == GMEM_LOC_NONE, "dropped page still reported");
    Ok(())
}

/// PREFETCH of ordinary memory to a device puts it there ahead of use (t_dpriv.rs checks
/// the migration): the kernel that follows faults nothing (synchronously and through a
/// fence). Other advice still needs a region; unmapped memory is ENOENT.
fn sysmem_prefetch_maps_ahead() -> TestResult {
    let (g, s) = open()?;
    let m = Anon::new(48 * PAGE, libc::PROT_READ | libc::PROT_WRITE)?;
    for (i, w) in m.words().iter_mut().enumerate() {
        *w = (i as u32).wrapping_mul(40503);
    }
    // Not page aligned, as any PREFETCH may be: widened to whole pages.
    ok!(g.advise(m.addr + 100, 16 * PAGE as u64 - 200, GMEM_ADV_PREFETCH, 0, 0));
    let o = ok!(s.checksum(m.addr, 16 * PAGE as u64));
    ensure!(o.faults == 0, "{} faults after PREFETCH", o.faults);
    ensure!(o.result == checksum(&m.words()[..16 * 1024]), "checksum after PREFETCH");
    let half = m.addr + 16 * PAGE as u64;
    let fence = ok!(g.advise(half, 32 * PAGE as u64, GMEM_ADV_PREFETCH, 0, GMEM_ADVF_ASYNC));
    ok!(g.wait(fence));
    ensure!(ok!(s.checksum(half, 32 * PAGE as u64)).faults == 0, "faults after an asynchronous PREFETCH");
    ok!(g.advise(m.addr, m.len as u64, GMEM_ADV_PREFETCH, GMEM_HOST, 0));
    expect_errno!(g.advise(m.addr, m.len as u64, libgmem::GMEM_ADV_READ_MOSTLY, 0, 0), libc::ENOENT);
    expect_errno!(g.advise(0x10000, 4096, GMEM_ADV_PREFETCH, 0, 0), libc::ENOENT);
    expect_errno!(g.advise(0x10000, 4096, GMEM_ADV_PREFETCH, 0, GMEM_ADVF_ASYNC), libc::ENOENT);
    // The top 2 MiB block of user space (whose last page is not user space) works too.
    let top = 0x7fff_fffe_0000u64;
    match Anon::at(top as *mut libc::c_void, 16 * PAGE, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_FIXED_NOREPLACE) {
        Ok(t) => {
            ok!(s.fill(t.addr, t.len as u64, 0x77));
            ensure!(t.words().iter().enumerate().all(|(i, &w)| w == 0x77 + i as u32), "fill at the top not seen");
            ok!(g.advise(t.addr, t.len as u64, GMEM_ADV_PREFETCH, 0, 0));
            // Migrated there (anonymous memory moves into the device's memory).
            ensure!(ok!(g.query(t.addr, 16)).iter().all(|&w| w & 0xff == libgmem::GMEM_LOC_DEVICE), "QUERY at the top");
        }
        // Something of the process is there already (the stack without ASLR): nothing to
        // check at this address.
        Err(e) => println!("# top of user space not free: {e}"),
    }
    Ok(())
}

/// PREFETCH of ordinary memory to a device whose driver cannot map the process's own pages
/// (the C sample driver has no `map_prepare`) fails with `EOPNOTSUPP` at once, ASYNC too:
/// no fence is created (it used to fail only at the WAIT).
fn sysmem_prefetch_to_a_device_that_cannot_map_fails_at_once() -> TestResult {
    let loaded = std::path::Path::new("/sys/module/gmem_csample").exists();
    if !loaded {
        sh("insmod /lib/gmem/gmem_csample.ko nr_devices=1 mem_kib=1024")?;
    }
    let r = (|| -> TestResult {
        let cs = CSample::open(0).map_err(|e| e.to_string())?;
        let id = ok!(cs.info()).gmem_id as i32;
        let (g, _) = open()?;
        let m = Anon::new(PAGE, libc::PROT_READ | libc::PROT_WRITE)?;
        m.words()[0] = 1;
        expect_errno!(g.advise(m.addr, PAGE as u64, GMEM_ADV_PREFETCH, id, GMEM_ADVF_ASYNC), libc::EOPNOTSUPP);
        expect_errno!(g.advise(m.addr, PAGE as u64, GMEM_ADV_PREFETCH, id, 0), libc::EOPNOTSUPP);
        // To the host it is fine, ASYNC too.
        let f = ok!(g.advise(m.addr, PAGE as u64, GMEM_ADV_PREFETCH, GMEM_HOST, GMEM_ADVF_ASYNC));
        ok!(g.wait(f));
        ensure!(m.words()[0] == 1, "data changed");
        Ok(())
    })();
    if !loaded {
        sh("rmmod gmem_csample")?;
    }
    r
}

pub fn tests() -> Vec<Test> {
    vec![
        Test { name: "sysmem_malloc_buffer_both_ways", f: sysmem_malloc_buffer_both_ways },
        Test { name: "sysmem_read_only_refuses_device_writes", f: sysmem_read_only_refuses_device_writes },
        Test { name: "sysmem_munmap_while_device_mapped", f: sysmem_munmap_while_device_mapped },
        Test { name: "sysmem_dontneed_drops_device_entries", f: sysmem_dontneed_drops_device_entries },
        Test { name: "sysmem_fork_cow_each_process_keeps_its_data", f: sysmem_fork_cow_each_process_keeps_its_data },
        Test { name: "sysmem_stack_and_file_mappings", f: sysmem_stack_and_file_mappings },
        Test { name: "sysmem_thp_buffer", f: sysmem_thp_buffer },
        Test { name: "sysmem_exit_with_device_mappings", f: sysmem_exit_with_device_mappings },
        Test { name: "sysmem_device_access_races_munmap", f: sysmem_device_access_races_munmap },
        Test { name: "sysmem_refill_faults_nothing", f: sysmem_refill_faults_nothing },
        Test { name: "sysmem_query_reports_residency", f: sysmem_query_reports_residency },
        Test { name: "sysmem_prefetch_maps_ahead", f: sysmem_prefetch_maps_ahead },
        Test {
            name: "sysmem_prefetch_to_a_device_that_cannot_map_fails_at_once",
            f: sysmem_prefetch_to_a_device_that_cannot_map_fails_at_once,
        },
    ]
}
