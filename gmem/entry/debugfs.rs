// SPDX-License-Identifier: GPL-2.0
//! Observability: `/sys/kernel/debug/gmem/`.
//! - `devices`: per device — capacity, frames in use/pinned/lent, watermarks; faults
//!   (batches, pages, frame allocations, waits for eviction); pages migrated each way;
//!   evictions (to host, to a peer, clean drops, background, write-backs, evacuations);
//!   prefetch (pages, used, wasted) and thrashing events.
//! - `control`: the tunables of `tune.rs` (read: current values; write: `key=value`).
//! - `spaces`: per address space — regions, CPU and device faults, current residency
//!   (pages nowhere / on host / on each device, pinned, duplicated) and metadata bytes per
//!   managed page.
//! - `regions`: per region of every space — its start, size and a run-length residency
//!   map (`map=d0:512,h:256,-:256`: runs of pages on device 0, on the host, nowhere; `l`
//!   lost). `gmemctl regions PID` draws it.
//!
//! Everything is read from the live objects at read time; nothing is cached here.

use crate::obj::device::Device;
use crate::obj::devices::{self, MAX_DEVICES};
use crate::obj::region::{Pages, Region, PAGE_SIZE};
use crate::obj::space;
use crate::policy::page_state::Loc;
use core::fmt;
use core::sync::atomic::Ordering::Relaxed;
use kernel::{
    debugfs::{Dir, File},
    prelude::*,
    uaccess::UserSliceReader,
};

#[pin_data]
pub(crate) struct Debugfs {
    #[pin]
    devices: File<()>,
    #[pin]
    spaces: File<()>,
    #[pin]
    control: File<()>,
    #[pin]
    regions: File<()>,
    _dir: Dir,
}

fn show_control(_: &(), f: &mut fmt::Formatter<'_>) -> fmt::Result {
    crate::entry::control::show(f)?;
    for d in devices::all().iter() {
        writeln!(f, "dev={} low={} high={}", d.id, d.low(), d.high())?;
    }
    Ok(())
}

fn write_control(_: &(), r: &mut UserSliceReader) -> Result {
    let mut buf = [0u8; 256];
    let n = r.len();
    if n == 0 || n > buf.len() {
        return Err(EINVAL);
    }
    r.read_slice(&mut buf[..n])?;
    let text = core::str::from_utf8(&buf[..n]).map_err(|_| EINVAL)?;
    crate::entry::control::apply(text)
}

impl Debugfs {
    pub(crate) fn new() -> impl PinInit<Self, Error> {
        let dir = Dir::new(c"gmem");
        try_pin_init!(Debugfs {
            devices <- dir.read_callback_file(c"devices", (), &show_devices),
            spaces <- dir.read_callback_file(c"spaces", (), &show_spaces),
            control <- dir.read_write_callback_file(c"control", (), &show_control, &write_control),
            regions <- dir.read_callback_file(c"regions", (), &show_regions),
            _dir: dir,
        })
    }
}

fn show_device(d: &Device, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    let s = &d.stats;
    let g = |c: &core::sync::atomic::AtomicU64| c.load(Relaxed);
    writeln!(
        f,
        "dev{} frames={} used={} pinned={} lent={} low={} high={} alive={}",
        d.id,
        d.nr_frames,
        d.frames_used(),
        d.frames_pinned(),
        d.frames_lent(),
        d.low(),
        d.high(),
        u8::from(d.alive())
    )?;
    writeln!(
        f,
        "  faults: batches={} pages={} allocs={} waits_for_eviction={} waits_for_transit={} waits_for_copies={}",
        g(&s.fault_batches),
        g(&s.faults),
        g(&s.fault_allocs),
        g(&s.fault_waits),
        g(&s.transit_waits),
        g(&s.copy_waits)
    )?;
    writeln!(
        f,
        "  migrated: h2d={} d2h={} d2d={} zeroed={} remote_maps={}",
        g(&s.pages_h2d),
        g(&s.pages_d2h),
        g(&s.pages_d2d),
        g(&s.pages_zeroed),
        g(&s.remote_maps)
    )?;
    writeln!(
        f,
        "  driver_calls: copy={} map={} unmap={} tlb={} map_2m={}",
        g(&s.copy_calls),
        g(&s.map_calls),
        g(&s.unmap_calls),
        g(&s.tlb_calls),
        g(&s.map_2m)
    )?;
    writeln!(f, "  locks: pool={}", g(&s.pool_locks))?;
    writeln!(f, "  mirror: faults={} mapped={}", g(&s.mirror_faults), g(&s.mirror_mapped))?;
    writeln!(
        f,
        "  sysmem: frames={} in={} out={} evicted={}",
        d.frames_sysmem(),
        g(&s.sysmem_in),
        g(&s.sysmem_out),
        g(&s.sysmem_evicted)
    )?;
    let l = d.links();
    writeln!(
        f,
        "  multipath: h2d_mbps={} d2h_mbps={} d2d_mbps={} batches={} direct_bytes={} peer_bytes={}",
        l.h2d,
        l.d2h,
        l.d2d,
        g(&s.mp_batches),
        g(&s.mp_direct).saturating_mul(PAGE_SIZE as u64),
        g(&s.mp_via_peer).saturating_mul(PAGE_SIZE as u64)
    )?;
    writeln!(
        f,
        "  evicted: to_host={} to_peer={} clean_dropped={} pre_evicted={} passed={} behind={} overlapped={} writebacks={} evacuated={} lost={}",
        g(&s.evicted_to_host),
        g(&s.evicted_to_peer),
        g(&s.evicted_clean),
        g(&s.pre_evicted),
        g(&s.evict_passed),
        g(&s.evict_behind),
        g(&s.evict_overlaps),
        g(&s.writebacks),
        g(&s.evacuated),
        g(&s.lost)
    )?;
    writeln!(
        f,
        "  prefetch: pages={} used={} wasted={} readahead={} thrash_events={} accuracy_pct={}",
        g(&s.prefetched),
        g(&s.prefetch_used),
        g(&s.prefetch_wasted),
        g(&s.readahead),
        g(&s.thrash_events),
        d.prefetch_accuracy_pct()
    )?;
    // The streams read-ahead follows: region start, the reader's block, the chain's front
    // ("-": a free place). Read without a lock: a snapshot, fields may be mid-update.
    write!(f, "  streams:")?;
    for st in &d.streams {
        match st.of.load(Relaxed) {
            0 => write!(f, " -")?,
            _ => write!(f, " {:#x}@{:#x}..{:#x}", st.va.load(Relaxed), st.at.load(Relaxed), st.ahead_to.load(Relaxed))?,
        }
    }
    writeln!(f)
}

fn show_devices(_: &(), f: &mut fmt::Formatter<'_>) -> fmt::Result {
    for d in devices::all().iter() {
        show_device(d, f)?;
    }
    Ok(())
}

/// Calls `f` on the page states of each touched block of `r`, in address order, with the
/// block's lock held (untouched blocks have no states), and yields the CPU between blocks.
fn touched_blocks(r: &Region, mut f: impl FnMut(&Pages) -> fmt::Result) -> fmt::Result {
    let mut next = 0;
    while let Some(block) = r.next_block(next) {
        let p = block.pages.lock();
        next = p.range().end;
        f(&p)?;
        drop(p);
        crate::obj::sched::cond_resched();
    }
    Ok(())
}

/// Residency of every page of a space.
#[derive(Default)]
struct Census {
    regions: usize,
    pages: usize,
    none: usize,
    host: usize,
    lost: usize,
    device: [usize; MAX_DEVICES],
    pinned: usize,
    duplicated: usize,
    metadata: usize,
}

fn show_spaces(_: &(), f: &mut fmt::Formatter<'_>) -> fmt::Result {
    let Ok(spaces) = space::all() else { return writeln!(f, "out of memory") };
    for s in spaces.iter() {
        let mut c = Census::default();
        let mut from = 0;
        while let Some(r) = s.next_region(from) {
            from = r.end();
            c.regions += 1;
            c.metadata += r.metadata_bytes();
            // Pages of untouched blocks are all `Loc::None`; only touched blocks are walked.
            c.none += r.npages;
            touched_blocks(&r, |p| {
                for i in p.range() {
                    let st = p.state(i);
                    match st.loc() {
                        Loc::None => continue,
                        Loc::Host => c.host += 1,
                        Loc::Lost => c.lost += 1,
                        Loc::Device(d) => c.device[d as usize % MAX_DEVICES] += 1,
                    }
                    c.none -= 1;
                    c.pinned += usize::from(st.pinned());
                    c.duplicated += usize::from(st.dup_mask() != 0);
                }
                Ok(())
            })?;
            c.pages += r.npages;
        }
        write!(
            f,
            "space{} pid={} regions={} pages={} cpu_faults={} dev_faults={} cpu_zaps={} block_locks={} home_ahead={} none={} host={} lost={}",
            s.id,
            s.pid,
            c.regions,
            c.pages,
            s.stats.cpu_faults.load(Relaxed),
            s.stats.dev_faults.load(Relaxed),
            s.stats.cpu_zaps.load(Relaxed),
            s.stats.block_locks.load(Relaxed),
            s.stats.home_ahead.load(Relaxed),
            c.none,
            c.host,
            c.lost
        )?;
        for (d, n) in c.device.iter().enumerate().filter(|(_, n)| **n != 0) {
            write!(f, " dev{}={}", d, n)?;
        }
        let per_page_x100 = (c.metadata * 100).checked_div(c.pages).unwrap_or(0);
        // Copied out first: nothing is formatted under the mirror lock.
        let (mapped, invalidations) = {
            let m = s.mirror.lock();
            (m.mapped, m.invalidations)
        };
        writeln!(
            f,
            " pinned={} duplicated={} metadata_bytes={} bytes_per_page={}.{:02} mirror_mapped={} mirror_invalidations={}",
            c.pinned,
            c.duplicated,
            c.metadata,
            per_page_x100 / 100,
            per_page_x100 % 100,
            mapped,
            invalidations
        )?;
    }
    Ok(())
}

/// Where a page is, for the residency map of `regions`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Place {
    Nowhere,
    Host,
    Lost,
    Dev(u8),
}

impl Place {
    fn of(loc: Loc) -> Place {
        match loc {
            Loc::None => Place::Nowhere,
            Loc::Host => Place::Host,
            Loc::Lost => Place::Lost,
            Loc::Device(d) => Place::Dev(d),
        }
    }
}

/// A run-length residency map being written: `code:count` runs, comma separated.
struct Runs {
    cur: Option<(Place, usize)>,
    first: bool,
}

impl Runs {
    fn add(&mut self, f: &mut fmt::Formatter<'_>, p: Place, n: usize) -> fmt::Result {
        if n == 0 {
            return Ok(());
        }
        match &mut self.cur {
            Some((q, m)) if *q == p => *m += n,
            _ => {
                self.flush(f)?;
                self.cur = Some((p, n));
            }
        }
        Ok(())
    }

    fn flush(&mut self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some((p, n)) = self.cur.take() else { return Ok(()) };
        if !self.first {
            f.write_str(",")?;
        }
        self.first = false;
        match p {
            Place::Nowhere => write!(f, "-:{n}"),
            Place::Host => write!(f, "h:{n}"),
            Place::Lost => write!(f, "l:{n}"),
            Place::Dev(d) => write!(f, "d{d}:{n}"),
        }
    }
}

fn show_regions(_: &(), f: &mut fmt::Formatter<'_>) -> fmt::Result {
    let Ok(spaces) = space::all() else { return writeln!(f, "out of memory") };
    for s in spaces.iter() {
        let mut from = 0;
        while let Some(r) = s.next_region(from) {
            from = r.end();
            write!(f, "space{} pid={} start={:#x} pages={} map=", s.id, s.pid, r.start, r.npages)?;
            let mut runs = Runs { cur: None, first: true };
            // Untouched blocks have no page states: their pages (the gaps) are nowhere.
            let mut next = 0;
            touched_blocks(&r, |p| {
                let range = p.range();
                runs.add(f, Place::Nowhere, range.start.saturating_sub(next))?;
                for i in range.clone() {
                    runs.add(f, Place::of(p.state(i).loc()), 1)?;
                }
                next = range.end;
                Ok(())
            })?;
            runs.add(f, Place::Nowhere, r.npages.saturating_sub(next))?;
            runs.flush(f)?;
            writeln!(f)?;
        }
    }
    Ok(())
}
