// SPDX-License-Identifier: GPL-2.0
//! Observability: `/sys/kernel/debug/gmem/`.
//! - `devices`: per device — capacity, frames in use, fault batches and faults, pages
//!   migrated each way (H2D, D2H, D2D, zero-filled), prefetched, evicted, remote maps.
//! - `spaces`: per address space — regions, CPU and device faults, current residency
//!   (pages nowhere / on host / on each device, pinned, duplicated) and metadata bytes per
//!   managed page.
//! Everything is read from the live objects at read time; nothing is cached here.

use crate::device::Device;
use crate::policy::page_state::Loc;
use crate::registry::{self, MAX_DEVICES};
use crate::space;
use core::fmt;
use core::sync::atomic::Ordering::Relaxed;
use kernel::{
    debugfs::{Dir, File},
    prelude::*,
};

#[pin_data]
pub(crate) struct Debugfs {
    #[pin]
    devices: File<()>,
    #[pin]
    spaces: File<()>,
    _dir: Dir,
}

impl Debugfs {
    pub(crate) fn new() -> impl PinInit<Self, Error> {
        let dir = Dir::new(c"gmem");
        try_pin_init!(Debugfs {
            devices <- dir.read_callback_file(c"devices", (), &show_devices),
            spaces <- dir.read_callback_file(c"spaces", (), &show_spaces),
            _dir: dir,
        })
    }
}

fn show_device(d: &Device, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    let s = &d.stats;
    writeln!(
        f,
        "dev{} frames={} used={} alive={} fault_batches={} faults={} h2d={} d2h={} d2d={} zeroed={} prefetched={} evicted={} remote_maps={}",
        d.id,
        d.nr_frames,
        d.frames_used(),
        d.alive() as u8,
        s.fault_batches.load(Relaxed),
        s.faults.load(Relaxed),
        s.pages_h2d.load(Relaxed),
        s.pages_d2h.load(Relaxed),
        s.pages_d2d.load(Relaxed),
        s.pages_zeroed.load(Relaxed),
        s.prefetched.load(Relaxed),
        s.evictions.load(Relaxed),
        s.remote_maps.load(Relaxed),
    )
}

fn show_devices(_: &(), f: &mut fmt::Formatter<'_>) -> fmt::Result {
    for d in registry::all().iter() {
        show_device(d, f)?;
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
            let p = r.pages.lock();
            for i in 0..r.npages {
                let st = p.state(i);
                match st.loc() {
                    Loc::None => c.none += 1,
                    Loc::Host => c.host += 1,
                    Loc::Device(d) => c.device[d as usize % MAX_DEVICES] += 1,
                }
                c.pinned += st.pinned() as usize;
                c.duplicated += (st.dup_mask() != 0) as usize;
            }
            c.pages += r.npages;
        }
        write!(
            f,
            "space{} regions={} pages={} cpu_faults={} dev_faults={} none={} host={}",
            s.id,
            c.regions,
            c.pages,
            s.stats.cpu_faults.load(Relaxed),
            s.stats.dev_faults.load(Relaxed),
            c.none,
            c.host
        )?;
        for (d, n) in c.device.iter().enumerate().filter(|(_, n)| **n != 0) {
            write!(f, " dev{}={}", d, n)?;
        }
        let per_page_x100 = if c.pages == 0 { 0 } else { c.metadata * 100 / c.pages };
        writeln!(
            f,
            " pinned={} duplicated={} metadata_bytes={} bytes_per_page={}.{:02}",
            c.pinned,
            c.duplicated,
            c.metadata,
            per_page_x100 / 100,
            per_page_x100 % 100
        )?;
    }
    Ok(())
}
