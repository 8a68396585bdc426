// SPDX-License-Identifier: GPL-2.0
//! The pure policy code of `policy/` (`no_std`, host-tested by `cargo test`), compiled into
//! the module unchanged. The kernel glue applies its decisions; it decides nothing itself.

#[path = "../policy/src/batch.rs"]
pub(crate) mod batch;
#[path = "../policy/src/bits.rs"]
pub(crate) mod bits;
#[path = "../policy/src/evict.rs"]
pub(crate) mod evict;
#[path = "../policy/src/frames.rs"]
pub(crate) mod frames;
#[path = "../policy/src/page_state.rs"]
pub(crate) mod page_state;
#[path = "../policy/src/paths.rs"]
pub(crate) mod paths;
#[path = "../policy/src/prefetch.rs"]
pub(crate) mod prefetch;
#[path = "../policy/src/range.rs"]
pub(crate) mod range;
#[path = "../policy/src/thrash.rs"]
pub(crate) mod thrash;

/// The state machine as the kernel compiled it (the host runs the full property tests).
#[kernel::prelude::kunit_tests(gmem_page_state)]
mod tests {
    use super::page_state::*;

    fn go(s: PageState, e: Event) -> (PageState, Actions) {
        match transition(s, e) {
            Ok(r) => r,
            Err(_) => panic!("transition refused"),
        }
    }

    #[test]
    fn host_device_round_trip() {
        let (h, a) = go(PageState::EMPTY, Event::CpuFault { write: true });
        assert!(a.alloc_host && a.map_cpu && h.loc() == Loc::Host);
        let ev = Event::DevFault { dev: 1, write: false, read_mostly: false, accessed_by: false };
        // A read migration keeps the host copy: the page is clean, mapped read-only.
        let (d, a) = go(h, ev);
        assert_eq!(d.loc(), Loc::Device(1));
        assert_eq!(a.copy, Copy::H2D(1));
        assert!(a.zap_cpu && !a.free_host && a.alloc_frame == Some(1));
        assert!(d.host_valid() && !d.dirty());
        assert_eq!(a.map_dev.map(|m| m.writable), Some(false));
        // Coming back clean needs no copy.
        let (back, a) = go(d, Event::CpuFault { write: false });
        assert_eq!(back.loc(), Loc::Host);
        assert_eq!(a.copy, Copy::None);
        assert_eq!(a.free_frame, Some(1));
        assert_eq!(back.query_word() & 0xff, Q_LOC_HOST);
        // A device write makes it dirty (host copy released); coming back then copies.
        let wr = Event::DevFault { dev: 1, write: true, read_mostly: false, accessed_by: false };
        let (w, a) = go(d, wr);
        assert!(w.dirty() && !w.host_valid() && a.free_host);
        let (_, a) = go(w, Event::CpuFault { write: false });
        assert_eq!(a.copy, Copy::D2H(1));
    }

    #[test]
    fn pinned_and_bad_device_are_refused() {
        let (p, _) = go(PageState::EMPTY, Event::Pin { dev: 0 });
        assert_eq!(transition(p, Event::Evict).err(), Some(Refused::Pinned));
        assert_eq!(transition(p, Event::CpuFault { write: false }).err(), Some(Refused::Pinned));
        let ev = Event::DevFault { dev: MAX_DEVICES as u8, write: false, read_mostly: false, accessed_by: false };
        assert_eq!(transition(PageState::EMPTY, ev).err(), Some(Refused::BadDevice));
        let (g, a) = go(p, Event::DeviceGone { dev: 0 });
        assert_eq!(g.loc(), Loc::Host);
        assert_eq!(a.copy, Copy::D2H(0));
    }

    #[test]
    fn read_mostly_duplicates_collapse_on_write() {
        let (h, _) = go(PageState::EMPTY, Event::CpuFault { write: true });
        let rd = |d| Event::DevFault { dev: d, write: false, read_mostly: true, accessed_by: false };
        let (s, _) = go(h, rd(0));
        let (s, _) = go(s, rd(1));
        assert_eq!(s.dup_mask(), 0b11);
        let (w, a) = go(s, Event::DevFault { dev: 0, write: true, read_mostly: true, accessed_by: false });
        assert_eq!(w.dup_mask(), 0);
        assert_ne!(a.unmap_dev & 0b10, 0);
    }
}
