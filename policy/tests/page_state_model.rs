// SPDX-License-Identifier: GPL-2.0
//! Model check of `page_state::transition`: random event sequences on one page, with every
//! returned action applied, in the documented order, to a tiny model of where data lives
//! (host page, owner frames, duplicate frames, CPU and device mappings). Each access reads
//! or writes through the mapping the fault installed, so stale or lost data is caught.

use gmem_policy::page_state::{transition, Copy, Event, Loc, PageState, Refused, Target};
use proptest::prelude::*;

const NDEV: usize = 16;
/// Contents of freshly allocated, not yet initialised memory.
const GARBAGE: u64 = u64::MAX;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Via {
    Frame,
    Remote,
}

#[derive(Debug)]
struct Model {
    st: PageState,
    host: Option<u64>,
    owner: [Option<u64>; NDEV],
    dup: [Option<u64>; NDEV],
    /// CPU mapping: Some(writable).
    cpu: Option<bool>,
    /// Device mappings: Some((what, writable)).
    dmap: [Option<(Via, bool)>; NDEV],
    /// The page's current contents (0 when never written or discarded).
    expected: u64,
    next: u64,
    frames_alloc: u64,
    frames_freed: u64,
}

fn bits(mask: u16) -> impl Iterator<Item = usize> {
    (0..NDEV).filter(move |d| mask & (1 << d) != 0)
}

impl Model {
    fn new() -> Self {
        Model {
            st: PageState::EMPTY,
            host: None,
            owner: [None; NDEV],
            dup: [None; NDEV],
            cpu: None,
            dmap: [None; NDEV],
            expected: 0,
            next: 1,
            frames_alloc: 0,
            frames_freed: 0,
        }
    }

    fn apply(&mut self, e: Event) -> Result<(), TestCaseError> {
        let pre = self.st;
        let (st, a) = match transition(pre, e) {
            Ok(r) => r,
            Err(r) => return self.check_refusal(e, r),
        };
        // 1. 2.
        if a.alloc_host && self.host.is_none() {
            self.host = Some(GARBAGE);
        }
        let mut newf: Option<(usize, u64)> = None;
        if let Some(d) = a.alloc_frame {
            newf = Some((usize::from(d), GARBAGE));
            self.frames_alloc += 1;
        }
        // 3.
        let mut fill_new = |d: u8, v: u64| -> Result<(), TestCaseError> {
            match &mut newf {
                Some((nd, slot)) if *nd == usize::from(d) => {
                    *slot = v;
                    Ok(())
                }
                _ => Err(TestCaseError::fail(format!("copy into unallocated frame on {d}"))),
            }
        };
        match a.copy {
            Copy::None => {}
            Copy::ZeroHost => {
                prop_assert!(self.host.is_some(), "ZeroHost without host page");
                self.host = Some(0);
            }
            Copy::ZeroDev(d) => fill_new(d, 0)?,
            Copy::H2D(d) => {
                let v = self.host.ok_or_else(|| TestCaseError::fail("H2D without host"))?;
                fill_new(d, v)?;
            }
            Copy::D2H(o) => {
                let v = self.owner[usize::from(o)]
                    .ok_or_else(|| TestCaseError::fail("D2H from a non-owner"))?;
                prop_assert!(self.host.is_some(), "D2H without host page");
                self.host = Some(v);
            }
            Copy::D2D { from, to } => {
                let v = self.owner[usize::from(from)]
                    .ok_or_else(|| TestCaseError::fail("D2D from a non-owner"))?;
                fill_new(to, v)?;
            }
        }
        // 4. 5.
        if a.zap_cpu {
            self.cpu = None;
        }
        for d in bits(a.unmap_dev) {
            self.dmap[d] = None;
        }
        // 6. 6b. 7.
        if let Some(o) = a.free_frame {
            prop_assert!(self.owner[usize::from(o)].take().is_some(), "free of absent frame");
            self.frames_freed += 1;
        }
        for d in bits(a.free_dup_frames) {
            prop_assert!(self.dup[d].take().is_some(), "free of absent dup frame {}", d);
            self.frames_freed += 1;
        }
        if a.free_host {
            prop_assert!(self.host.take().is_some(), "free of absent host page");
        }
        // The new frame becomes the owner frame or a duplicate, as the new state says.
        if let Some((d, v)) = newf {
            let slot = if st.loc() == Loc::Device(d as u8) {
                &mut self.owner[d]
            } else if st.dup_mask() & (1 << d) != 0 {
                &mut self.dup[d]
            } else {
                return Err(TestCaseError::fail("allocated frame is neither owner nor dup"));
            };
            prop_assert!(slot.is_none(), "frame leaked on device {}", d);
            *slot = Some(v);
        }
        // 8. 9.
        if let Some(m) = a.map_dev {
            let d = usize::from(m.dev);
            if m.remote_host {
                prop_assert!(self.host.is_some(), "remote map without host page");
                self.dmap[d] = Some((Via::Remote, m.writable));
            } else {
                prop_assert!(self.owner[d].is_some() || self.dup[d].is_some(), "map w/o frame");
                self.dmap[d] = Some((Via::Frame, m.writable));
            }
        }
        prop_assert_eq!(a.map_cpu, matches!(e, Event::CpuFault { .. }));
        if let Event::CpuFault { write } = e {
            prop_assert!(self.host.is_some(), "map_cpu without host page");
            // The glue's rule: writable if the fault was a write or no duplicates exist.
            self.cpu = Some(write || st.dup_mask() == 0);
        }
        self.st = st;

        // The access itself, through the mapping just installed.
        match e {
            Event::CpuFault { write } => self.access_cpu(write)?,
            Event::DevFault { dev, write, .. } => self.access_dev(usize::from(dev), write)?,
            Event::DontNeed | Event::Free => self.expected = 0,
            _ => {}
        }
        if let Loc::Device(o) = pre.loc() {
            if pre.pinned() && !matches!(e, Event::Unpin | Event::DeviceGone { .. } | Event::Free) {
                prop_assert_eq!((st.loc(), st.pinned()), (Loc::Device(o), true));
            }
        }
        self.check()
    }

    fn check_refusal(&self, e: Event, r: Refused) -> Result<(), TestCaseError> {
        let bad_dev = match e {
            Event::DevFault { dev, .. } | Event::Pin { dev } | Event::DeviceGone { dev } => {
                usize::from(dev) >= NDEV
            }
            Event::Prefetch { to: Target::Device(d) } => usize::from(d) >= NDEV,
            _ => false,
        };
        prop_assert_eq!(r == Refused::BadDevice, bad_dev, "{:?} -> {:?}", e, r);
        if r != Refused::BadDevice {
            prop_assert!(self.st.pinned(), "refused {:?} on an unpinned page", e);
        }
        prop_assert!(!matches!(e, Event::Free | Event::Unpin), "Free/Unpin refused");
        Ok(())
    }

    fn access_cpu(&mut self, write: bool) -> Result<(), TestCaseError> {
        let writable = self.cpu.ok_or_else(|| TestCaseError::fail("CPU not mapped"))?;
        let v = self.host.ok_or_else(|| TestCaseError::fail("CPU maps no host page"))?;
        if write {
            prop_assert!(writable, "CPU write fault left a read-only mapping");
            self.expected = self.next;
            self.host = Some(self.next);
            self.next += 1;
        } else {
            prop_assert_eq!(v, self.expected, "CPU read stale data");
        }
        Ok(())
    }

    fn access_dev(&mut self, d: usize, write: bool) -> Result<(), TestCaseError> {
        let (via, writable) = self.dmap[d].ok_or_else(|| TestCaseError::fail("dev not mapped"))?;
        let slot = match via {
            Via::Remote => &mut self.host,
            Via::Frame if self.owner[d].is_some() => &mut self.owner[d],
            Via::Frame => {
                prop_assert!(!writable, "writable mapping of a duplicate");
                &mut self.dup[d]
            }
        };
        if write {
            prop_assert!(writable, "device write fault left a read-only mapping");
            *slot = Some(self.next);
            self.expected = self.next;
            self.next += 1;
        } else {
            prop_assert_eq!(*slot, Some(self.expected), "device {} read stale data", d);
        }
        Ok(())
    }

    /// State/model agreement after every successful transition.
    fn check(&self) -> Result<(), TestCaseError> {
        let s = self.st;
        let owners: Vec<usize> = (0..NDEV).filter(|&d| self.owner[d].is_some()).collect();
        match s.loc() {
            Loc::None => {
                prop_assert!(self.host.is_none() && owners.is_empty() && self.cpu.is_none());
                prop_assert_eq!(self.expected, 0, "discarded page must read zeros");
                prop_assert_eq!(s.dup_mask() | s.remote_mask(), 0);
            }
            Loc::Host => {
                prop_assert_eq!(self.host, Some(self.expected), "host copy lost");
                prop_assert!(owners.is_empty(), "second authoritative copy");
                prop_assert!(!s.pinned() && !s.dirty() && s.host_valid());
            }
            Loc::Device(o) => {
                prop_assert_eq!(owners, vec![usize::from(o)], "exactly one owner frame");
                prop_assert_eq!(self.owner[usize::from(o)], Some(self.expected), "data lost");
                prop_assert!(self.cpu.is_none() && !s.cpu_mapped() && s.remote_mask() == 0);
                prop_assert_eq!(self.host.is_some(), s.host_valid());
                prop_assert_eq!(s.dup_mask() & (1 << o), 0);
            }
        }
        prop_assert_eq!(s.cpu_mapped(), self.cpu.is_some());
        prop_assert_eq!(s.dup_mask() & s.remote_mask(), 0);
        for d in 0..NDEV {
            let is_dup = s.dup_mask() & (1 << d) != 0;
            prop_assert_eq!(self.dup[d].is_some(), is_dup, "dup frame on {} vs mask", d);
            if is_dup {
                prop_assert_eq!(self.dup[d], Some(self.expected), "stale duplicate on {}", d);
            }
            let is_remote = s.remote_mask() & (1 << d) != 0;
            match self.dmap[d] {
                Some((Via::Remote, _)) => prop_assert!(is_remote, "unrecorded remote map"),
                Some((Via::Frame, _)) => {
                    prop_assert!(self.owner[d].is_some() || is_dup, "PTE to a freed frame")
                }
                None => prop_assert!(!is_remote, "remote bit without mapping"),
            }
            if matches!(self.dmap[d], Some((_, true))) {
                prop_assert_eq!(s.dup_mask(), 0, "writable device mapping next to duplicates");
            }
        }
        if self.cpu == Some(true) {
            prop_assert_eq!(s.dup_mask(), 0, "writable CPU mapping next to duplicates");
        }
        // Query word agrees with the accessors.
        let w = s.query_word();
        let (loc, owner) = match s.loc() {
            Loc::None => (0, 0),
            Loc::Host => (1, 0),
            Loc::Device(o) => (2, u32::from(o)),
        };
        prop_assert_eq!(w & 0xff, loc);
        prop_assert_eq!((w >> 8) & 0xff, owner);
        let flags = [s.pinned(), s.dirty(), s.dup_mask() != 0, s.remote_mask() != 0, s.cpu_mapped()];
        for (i, f) in flags.into_iter().enumerate() {
            prop_assert_eq!(w & (1 << (16 + i)) != 0, f);
        }
        prop_assert_eq!(w >> 21, 0);
        prop_assert_eq!(PageState::from_bits(s.bits()), s);
        Ok(())
    }
}

/// Mostly devices 0-3 so that events interact; sometimes a high or invalid id.
fn dev() -> impl Strategy<Value = u8> {
    prop_oneof![8 => 0u8..4, 1 => 4u8..16, 1 => 16u8..=255]
}

fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        4 => any::<bool>().prop_map(|write| Event::CpuFault { write }),
        8 => (dev(), any::<bool>(), any::<bool>(), any::<bool>()).prop_map(
            |(dev, write, read_mostly, accessed_by)| Event::DevFault {
                dev,
                write,
                read_mostly,
                accessed_by
            }
        ),
        2 => prop_oneof![Just(Target::Host), dev().prop_map(Target::Device)]
            .prop_map(|to| Event::Prefetch { to }),
        1 => dev().prop_map(|dev| Event::Pin { dev }),
        1 => Just(Event::Unpin),
        1 => Just(Event::DontNeed),
        1 => Just(Event::Evict),
        1 => dev().prop_map(|dev| Event::DeviceGone { dev }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn random_sequences_keep_data_and_balance_frames(
        events in prop::collection::vec(event(), 0..60)
    ) {
        let mut m = Model::new();
        for e in events {
            m.apply(e)?;
        }
        m.apply(Event::Free)?;
        prop_assert_eq!(m.st, PageState::EMPTY);
        prop_assert_eq!(m.frames_alloc, m.frames_freed, "frame leak");
        prop_assert!(m.host.is_none() && m.cpu.is_none());
        prop_assert!(m.dmap.iter().all(Option::is_none), "device PTE left after Free");
    }

    #[test]
    fn any_bits_decode_consistently(b in any::<u32>()) {
        let s = PageState::from_bits(b);
        let w = s.query_word();
        prop_assert!(w & 0xff <= 2);
        prop_assert_eq!(s.dup_mask() & s.remote_mask(), 0);
        prop_assert!(!s.pinned() || matches!(s.loc(), Loc::Device(_)));
        // Free always succeeds and releases whatever the bits claim.
        let (e, a) = transition(s, Event::Free).map_err(|r| TestCaseError::fail(format!("{r:?}")))?;
        prop_assert_eq!(e, PageState::EMPTY);
        prop_assert_eq!(a.free_dup_frames, s.dup_mask());
    }
}
