// SPDX-License-Identifier: GPL-2.0
//! The simulated device's page table: one per context (GMEM address space). Two levels:
//! a sorted directory of 2 MiB blocks, each a 512-entry leaf of PTEs.
//!
//! PTE encoding: 0 = invalid; bit 0 valid, bit 1 writable, bit 2 remote host page, bit 3
//! accessed (set by every device access, tested and cleared by gmem). A frame
//! PTE holds `frame << 12`; a remote PTE holds the `struct page` pointer (64-byte aligned,
//! so the low bits are free).
//!
//! Every device access translates and touches memory under `SimCtx::pt`, and `unmap` takes
//! the same lock: once the core's unmap returns, no access to the old page is in flight.

use kernel::{bindings, new_mutex, prelude::*, sync::Mutex};

pub(crate) const PTE_VALID: u64 = 1;
pub(crate) const PTE_WRITE: u64 = 2;
pub(crate) const PTE_HOST: u64 = 4;
pub(crate) const PTE_ACCESSED: u64 = 8;
const LEAF: usize = 512;

/// What a valid PTE points at.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Target {
    Frame(u64),
    Host(*mut bindings::page),
}

pub(crate) fn decode(pte: u64) -> Option<(Target, bool)> {
    if pte & PTE_VALID == 0 {
        return None;
    }
    let w = pte & PTE_WRITE != 0;
    if pte & PTE_HOST != 0 {
        Some((Target::Host((pte & !0x3f) as *mut bindings::page), w))
    } else {
        Some((Target::Frame(pte >> 12), w))
    }
}

pub(crate) fn encode(t: Target, writable: bool) -> u64 {
    let base = match t {
        Target::Frame(f) => f << 12,
        Target::Host(p) => p as u64 | PTE_HOST,
    };
    base | PTE_VALID | if writable { PTE_WRITE } else { 0 }
}

pub(crate) struct PageTable {
    /// (2 MiB block number, leaf), sorted by block.
    dir: KVec<(u64, KBox<[u64; LEAF]>)>,
    pub(crate) valid: u64,
}

impl PageTable {
    fn leaf(&self, block: u64) -> Option<&[u64; LEAF]> {
        let i = self.dir.binary_search_by_key(&block, |e| e.0).ok()?;
        Some(&self.dir[i].1)
    }

    pub(crate) fn lookup(&self, va: u64) -> u64 {
        self.leaf(va >> 21).map_or(0, |l| l[((va >> 12) as usize) % LEAF])
    }

    fn slot_mut(&mut self, va: u64) -> Option<&mut u64> {
        let i = self.dir.binary_search_by_key(&(va >> 21), |e| e.0).ok()?;
        Some(&mut self.dir[i].1[((va >> 12) as usize) % LEAF])
    }

    /// Marks a valid PTE accessed (the device just used it).
    pub(crate) fn touch(&mut self, va: u64) {
        if let Some(s) = self.slot_mut(va) {
            if *s & PTE_VALID != 0 {
                *s |= PTE_ACCESSED;
            }
        }
    }

    /// Tests and clears the accessed bit.
    pub(crate) fn test_clear_accessed(&mut self, va: u64) -> bool {
        match self.slot_mut(va) {
            Some(s) if *s & PTE_ACCESSED != 0 => {
                *s &= !PTE_ACCESSED;
                true
            }
            _ => false,
        }
    }

    /// Sets one PTE, allocating its leaf if needed.
    pub(crate) fn set(&mut self, va: u64, pte: u64) -> Result {
        let block = va >> 21;
        let i = match self.dir.binary_search_by_key(&block, |e| e.0) {
            Ok(i) => i,
            Err(i) => {
                let leaf = KBox::new([0u64; LEAF], GFP_KERNEL)?;
                self.dir.reserve(1, GFP_KERNEL)?;
                self.dir.insert_within_capacity(i, (block, leaf)).map_err(|_| ENOMEM)?;
                i
            }
        };
        let slot = &mut self.dir[i].1[((va >> 12) as usize) % LEAF];
        if *slot & PTE_VALID == 0 && pte & PTE_VALID != 0 {
            self.valid += 1;
        }
        *slot = pte;
        Ok(())
    }

    /// Clears `npages` PTEs from `va`; returns how many were valid.
    pub(crate) fn clear(&mut self, va: u64, npages: u64) -> u64 {
        let mut n = 0;
        for p in 0..npages {
            let v = va + (p << 12);
            if let Ok(i) = self.dir.binary_search_by_key(&(v >> 21), |e| e.0) {
                let slot = &mut self.dir[i].1[((v >> 12) as usize) % LEAF];
                if *slot & PTE_VALID != 0 {
                    n += 1;
                }
                *slot = 0;
            }
        }
        self.valid -= n;
        n
    }
}

/// One device context: the page table of one address space on this device.
#[pin_data]
pub(crate) struct SimCtx {
    #[pin]
    pub(crate) pt: Mutex<PageTable>,
}

impl SimCtx {
    pub(crate) fn new() -> Result<Pin<KBox<SimCtx>>> {
        KBox::pin_init(
            pin_init!(SimCtx { pt <- new_mutex!(PageTable { dir: KVec::new(), valid: 0 }, "gmem_sim_pt") }),
            GFP_KERNEL,
        )
    }
}

#[kunit_tests(gmem_sim_pt)]
mod tests {
    use super::*;

    #[test]
    fn pte_encoding_round_trips() {
        assert_eq!(decode(0), None);
        assert_eq!(decode(encode(Target::Frame(77), true)), Some((Target::Frame(77), true)));
        let fake = 0x1234_5640 as *mut bindings::page;
        assert_eq!(decode(encode(Target::Host(fake), false)), Some((Target::Host(fake), false)));
    }

    #[test]
    fn set_lookup_clear_across_blocks() {
        let ctx = SimCtx::new().expect("ctx");
        let mut pt = ctx.pt.lock();
        pt.set(0x20_0000, encode(Target::Frame(1), true)).expect("set");
        pt.set(0x1000, encode(Target::Frame(2), false)).expect("set");
        pt.set(0x40_1000, encode(Target::Frame(3), true)).expect("set");
        assert_eq!(pt.valid, 3);
        assert_eq!(decode(pt.lookup(0x1000)), Some((Target::Frame(2), false)));
        assert_eq!(pt.lookup(0x2000), 0);
        assert_eq!(pt.clear(0x1000, 0x40_0000 >> 12), 2);
        assert_eq!(pt.valid, 1);
        assert_eq!(decode(pt.lookup(0x40_1000)), Some((Target::Frame(3), true)));
        // Accessed bit: set by a touch, reported and cleared once, invisible to decode.
        assert!(!pt.test_clear_accessed(0x40_1000));
        pt.touch(0x40_1000);
        assert_eq!(decode(pt.lookup(0x40_1000)), Some((Target::Frame(3), true)));
        assert!(pt.test_clear_accessed(0x40_1000));
        assert!(!pt.test_clear_accessed(0x40_1000));
    }
}
