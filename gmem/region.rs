// SPDX-License-Identifier: GPL-2.0
//! Region: one GMEM allocation (one VMA) and the residency of each of its pages.
//!
//! Per page the region keeps exactly 16 bytes: the packed page state (4, see
//! `policy/src/page_state.rs`), the owner's frame number (4) and the host page (8, `None`
//! when no host copy exists). Read-only duplicates, which are rare, live in a side list.
//! Advice is kept per range in a small interval map (`policy/src/range.rs`).
//!
//! Lock order: mmap lock -> `Region::pages` -> `Space::ctxs` -> `Device::frames`.

use crate::policy::page_state::{PageState, MAX_DEVICES};
use crate::policy::range::{AdviceMap, PageRange};
use crate::space::Space;
use kernel::{new_mutex, page::Page, prelude::*, sync::{Arc, Mutex}};

pub(crate) const PAGE_SIZE: usize = 4096;

/// Advice bits kept in the region's advice map.
pub(crate) mod adv {
    /// Bits 0..16: devices that map host pages remotely (ACCESSED_BY).
    pub(crate) const ACCESSED_BY_MASK: u32 = 0xffff;
    pub(crate) const READ_MOSTLY: u32 = 1 << 16;
    /// Bits 20..25: preferred location, 0 = none, `d + 1` = device d, `PREF_HOST` = host.
    pub(crate) const PREF_SHIFT: u32 = 20;
    pub(crate) const PREF_MASK: u32 = 0x1f << PREF_SHIFT;
    pub(crate) const PREF_HOST: u32 = 31;

    pub(crate) fn preferred(bits: u32) -> Option<crate::policy::page_state::Target> {
        use crate::policy::page_state::Target;
        match (bits & PREF_MASK) >> PREF_SHIFT {
            0 => None,
            PREF_HOST => Some(Target::Host),
            d => Some(Target::Device((d - 1) as u8)),
        }
    }
}

/// Runs of distinct advice one region may carry.
pub(crate) const ADVICE_RUNS: usize = 32;

/// A read-only duplicate of a page on a device that is not its owner.
#[derive(Clone, Copy)]
pub(crate) struct Dup {
    pub(crate) page: usize,
    pub(crate) dev: u8,
    pub(crate) frame: u32,
}

/// The per-page arrays, under the region's lock.
pub(crate) struct Pages {
    /// Set once the region is torn down: every later fault gets SIGBUS / EFAULT.
    pub(crate) dead: bool,
    pub(crate) state: KVVec<u32>,
    pub(crate) frame: KVVec<u32>,
    pub(crate) host: KVVec<Option<Page>>,
    pub(crate) dups: KVec<Dup>,
    pub(crate) advice: AdviceMap<ADVICE_RUNS>,
}

impl Pages {
    pub(crate) fn state(&self, i: usize) -> PageState {
        PageState::from_bits(self.state[i])
    }

    pub(crate) fn take_dup(&mut self, page: usize, dev: u8) -> Option<u32> {
        let i = self.dups.iter().position(|d| d.page == page && d.dev == dev)?;
        Some(self.dups.remove(i).ok()?.frame)
    }

    pub(crate) fn dup_frame(&self, page: usize, dev: u8) -> Option<u32> {
        self.dups.iter().find(|d| d.page == page && d.dev == dev).map(|d| d.frame)
    }
}

#[pin_data]
pub(crate) struct Region {
    pub(crate) start: usize,
    pub(crate) npages: usize,
    pub(crate) space: Arc<Space>,
    #[pin]
    pub(crate) pages: Mutex<Pages>,
}

impl Region {
    /// A region of `npages` never-touched pages at `start`, with `preferred` as its
    /// initial preferred location (advice bits).
    pub(crate) fn new(space: Arc<Space>, start: usize, npages: usize, initial_advice: u32) -> Result<Arc<Region>> {
        let mut state = KVVec::with_capacity(npages, GFP_KERNEL_ACCOUNT)?;
        let mut frame = KVVec::with_capacity(npages, GFP_KERNEL_ACCOUNT)?;
        let mut host = KVVec::with_capacity(npages, GFP_KERNEL_ACCOUNT)?;
        for _ in 0..npages {
            state.push(PageState::EMPTY.bits(), GFP_KERNEL_ACCOUNT)?;
            frame.push(0u32, GFP_KERNEL_ACCOUNT)?;
            host.push(None, GFP_KERNEL_ACCOUNT)?;
        }
        let mut advice = AdviceMap::new();
        if initial_advice != 0 {
            advice
                .set(PageRange { first: 0, count: npages as u64 }, initial_advice)
                .map_err(|_| EINVAL)?;
        }
        Arc::pin_init(
            try_pin_init!(Region {
                start,
                npages,
                space,
                pages <- new_mutex!(
                    Pages { dead: false, state, frame, host, dups: KVec::new(), advice },
                    "gmem_region_pages"
                ),
            }),
            GFP_KERNEL,
        )
    }

    pub(crate) fn len(&self) -> usize {
        self.npages * PAGE_SIZE
    }

    pub(crate) fn end(&self) -> usize {
        self.start + self.len()
    }

    pub(crate) fn va(&self, page: usize) -> u64 {
        (self.start + page * PAGE_SIZE) as u64
    }

    pub(crate) fn index(&self, addr: usize) -> Option<usize> {
        (addr >= self.start && addr < self.end()).then(|| (addr - self.start) / PAGE_SIZE)
    }

    /// Bytes of per-page metadata this region uses (P5 of the benchmarks).
    pub(crate) fn metadata_bytes(&self) -> usize {
        let p = self.pages.lock();
        p.state.capacity() * 4
            + p.frame.capacity() * 4
            + p.host.capacity() * core::mem::size_of::<Option<Page>>()
            + p.dups.capacity() * core::mem::size_of::<Dup>()
    }
}

/// Device ids whose bit is set in `mask`.
pub(crate) fn devices_in(mask: u16) -> impl Iterator<Item = u8> {
    (0..MAX_DEVICES as u8).filter(move |d| mask & (1 << d) != 0)
}
