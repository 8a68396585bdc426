// SPDX-License-Identifier: GPL-2.0
//! Model check of `page_state::transition`: random event sequences on one page, with every
//! returned action applied, in the documented order, to a tiny model of where data lives
//! (host page, owner frames, duplicate frames, CPU and device mappings, each memory with an
//! identity so that a mapping of a freed and reallocated page is caught). Besides the
//! events, the sequences contain plain accesses: an access whose mapping exists and allows
//! it goes straight to memory without a transition (as on real hardware); otherwise it
//! faults first. So stale or lost data, writes through mappings that should have been
//! revoked and a clean page whose host copy differs from its device copy are all caught.
//! The one sanctioned loss, `Event::Lose` on a device page, is recorded by the model: the
//! page must then hold no memory and no mapping and refuse every access until `DontNeed` or
//! `Free`, after which it reads zeros.

use gmem_policy::page_state::{
    transition, Actions, Copy, Event, Loc, PageState, Refused, Target, Q_LOC_DEVICE, Q_LOC_HOST, Q_LOC_LOST, Q_LOC_NONE,
};
use proptest::prelude::*;

const NDEV: usize = 16;
/// Contents of freshly allocated, not yet initialised memory.
const GARBAGE: u64 = u64::MAX;

/// A piece of memory: (identity, contents).
type Mem = Option<(u64, u64)>;

/// What a mapping points at (by identity).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Via {
    /// A frame on the mapping device (owner or duplicate frame).
    Frame(u64),
    /// The host page, remotely.
    Remote(u64),
}

/// One step of a random sequence.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Step {
    /// A policy event (faults included: spurious faults happen).
    Ev(Event),
    /// A CPU access: through the CPU mapping if it allows it, else after a CPU fault.
    Cpu { write: bool },
    /// A device access: through its mapping if it allows it, else after a device fault.
    Dev { dev: u8, write: bool, read_mostly: bool, accessed_by: bool },
}

#[derive(Debug)]
struct Model {
    st: PageState,
    host: Mem,
    owner: [Mem; NDEV],
    dup: [Mem; NDEV],
    /// CPU mapping: Some((host page id, writable)).
    cpu: Option<(u64, bool)>,
    /// Device mappings: Some((what, writable)).
    dmap: [Option<(Via, bool)>; NDEV],
    /// The page's current contents (0 when never written or discarded).
    expected: u64,
    /// `Lose` destroyed the data and nothing has discarded the page since.
    lost: bool,
    next: u64,
    ids: u64,
    frames_alloc: u64,
    frames_freed: u64,
}

fn bits(mask: u16) -> impl Iterator<Item = usize> {
    (0..NDEV).filter(move |d| mask & (1 << d) != 0)
}

/// On a device, the host page holds the current data too.
fn clean(s: PageState) -> bool {
    matches!(s.loc(), Loc::Device(_)) && s.host_valid() && !s.dirty()
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
            lost: false,
            next: 1,
            ids: 0,
            frames_alloc: 0,
            frames_freed: 0,
        }
    }

    fn fresh(&mut self) -> (u64, u64) {
        self.ids += 1;
        (self.ids, GARBAGE)
    }

    fn step(&mut self, s: Step) -> Result<(), TestCaseError> {
        match s {
            Step::Ev(e) => self.apply(e).map(|_| ()),
            Step::Cpu { write } => {
                if !matches!(self.cpu, Some((_, w)) if w || !write) {
                    let done = self.apply(Event::CpuFault { write })?;
                    // (`check_refusal` has checked that the refusal says why.)
                    prop_assert!(!self.lost || done.is_none(), "CPU access to a lost page");
                    return Ok(());
                }
                self.access_cpu(write)?;
                self.check()
            }
            Step::Dev { dev, write, read_mostly, accessed_by } => {
                let mapped = self.dmap.get(usize::from(dev)).copied().flatten();
                if !matches!(mapped, Some((_, w)) if w || !write) {
                    let e = Event::DevFault { dev, write, read_mostly, accessed_by };
                    let done = self.apply(e)?;
                    prop_assert!(!self.lost || done.is_none(), "device access to a lost page");
                    return Ok(());
                }
                self.access_dev(usize::from(dev), write)?;
                self.check()
            }
        }
    }

    /// Applies `e` (and, for a fault, the access that caused it); `None` if it was refused.
    fn apply(&mut self, e: Event) -> Result<Option<Actions>, TestCaseError> {
        let pre = self.st;
        let (st, a) = match transition(pre, e) {
            Ok(r) => r,
            Err(r) => return self.check_refusal(e, r).map(|_| None),
        };
        let was_lost = self.lost;
        if e == Event::Lose {
            if matches!(pre.loc(), Loc::Device(_)) {
                // Only releases: nothing is saved, nothing new is mapped.
                prop_assert_eq!(
                    (a.alloc_host, a.alloc_frame, a.copy, a.map_dev, a.map_cpu),
                    (false, None, Copy::None, None, false),
                    "Lose of {:?}",
                    pre
                );
                self.lost = true;
            } else {
                prop_assert_eq!((st, a), (pre, Actions::default()), "Lose off a device");
            }
        }
        if was_lost {
            // Whatever succeeds on a lost page releases nothing (it holds nothing); only
            // DontNeed/Free change it, into an empty page.
            let discard = matches!(e, Event::DontNeed | Event::Free);
            prop_assert_eq!(a, Actions::default(), "{:?} on a lost page", e);
            prop_assert_eq!(st, if discard { PageState::EMPTY } else { pre });
        }
        // 1. 2.
        if a.alloc_host && self.host.is_none() {
            self.host = Some(self.fresh());
        }
        let mut newf: Option<(usize, (u64, u64))> = None;
        if let Some(d) = a.alloc_frame {
            newf = Some((usize::from(d), self.fresh()));
            self.frames_alloc += 1;
        }
        // 3.
        let mut fill_new = |d: u8, v: u64| -> Result<(), TestCaseError> {
            match &mut newf {
                Some((nd, (_, slot))) if *nd == usize::from(d) => {
                    *slot = v;
                    Ok(())
                }
                _ => Err(TestCaseError::fail(format!("copy into unallocated frame on {d}"))),
            }
        };
        let owner_val = |o: u8, m: &Model| {
            m.owner[usize::from(o)].map(|(_, v)| v).ok_or_else(|| TestCaseError::fail("copy from a non-owner"))
        };
        match a.copy {
            Copy::None => {}
            Copy::ZeroHost => {
                let h = self.host.as_mut().ok_or_else(|| TestCaseError::fail("ZeroHost w/o host"))?;
                h.1 = 0;
            }
            Copy::ZeroDev(d) => fill_new(d, 0)?,
            Copy::H2D(d) => {
                let (_, v) = self.host.ok_or_else(|| TestCaseError::fail("H2D without host"))?;
                fill_new(d, v)?;
            }
            Copy::D2H(o) => {
                let v = owner_val(o, self)?;
                let h = self.host.as_mut().ok_or_else(|| TestCaseError::fail("D2H w/o host"))?;
                h.1 = v;
            }
            Copy::D2D { from, to } => {
                let v = owner_val(from, self)?;
                fill_new(to, v)?;
            }
        }
        // Leaving a device for the host copies exactly when the host copy is not current.
        if matches!(pre.loc(), Loc::Device(_)) && st.loc() == Loc::Host {
            if clean(pre) {
                prop_assert_eq!(a.copy, Copy::None, "clean page copied home");
                prop_assert!(!a.alloc_host);
            } else {
                prop_assert!(matches!(a.copy, Copy::D2H(_)), "dirty page not copied home");
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
        if let Some(o) = a.owner_to_dup {
            let o = usize::from(o);
            prop_assert!(a.free_frame.map(usize::from) != Some(o), "owner frame both freed and kept");
            prop_assert!(self.dup[o].is_none(), "owner frame kept over a duplicate on {}", o);
            self.dup[o] = self.owner[o].take();
            prop_assert!(self.dup[o].is_some(), "absent owner frame kept as a duplicate");
        }
        for d in bits(a.free_dup_frames) {
            prop_assert!(self.dup[d].take().is_some(), "free of absent dup frame {}", d);
            self.frames_freed += 1;
        }
        if let Some(h) = a.dup_to_owner {
            let h = usize::from(h);
            prop_assert!(a.free_dup_frames & (1 << h) == 0, "promoted duplicate also freed");
            prop_assert!(self.owner[h].is_none(), "duplicate promoted over an owner frame");
            self.owner[h] = self.dup[h].take();
            prop_assert!(self.owner[h].is_some(), "absent duplicate promoted");
        }
        if a.free_host {
            prop_assert!(self.host.take().is_some(), "free of absent host page");
        }
        // The new frame becomes the owner frame or a duplicate, as the new state says.
        if let Some((d, f)) = newf {
            let slot = if st.loc() == Loc::Device(d as u8) {
                &mut self.owner[d]
            } else if st.dup_mask() & (1 << d) != 0 {
                &mut self.dup[d]
            } else {
                return Err(TestCaseError::fail("allocated frame is neither owner nor dup"));
            };
            prop_assert!(slot.is_none(), "frame leaked on device {}", d);
            *slot = Some(f);
        }
        // 8. 9. (the glue maps the owner frame if the device owns the page, else its dup)
        if let Some(m) = a.map_dev {
            let d = usize::from(m.dev);
            let via = if m.remote_host {
                let (id, _) = self.host.ok_or_else(|| TestCaseError::fail("remote map w/o host"))?;
                Via::Remote(id)
            } else {
                let f = if st.loc() == Loc::Device(m.dev) { self.owner[d] } else { self.dup[d] };
                let (id, _) = f.ok_or_else(|| TestCaseError::fail("map without frame"))?;
                Via::Frame(id)
            };
            self.dmap[d] = Some((via, m.writable));
        }
        if matches!(e, Event::WriteBack | Event::EvictTo { .. }) {
            prop_assert!(a.map_dev.is_none(), "{:?} maps the page", e);
        }
        prop_assert_eq!(a.map_cpu, matches!(e, Event::CpuFault { .. }));
        if let Event::CpuFault { write } = e {
            let (id, _) = self.host.ok_or_else(|| TestCaseError::fail("map_cpu w/o host page"))?;
            // The glue's rule: writable if the fault was a write or no duplicates exist.
            self.cpu = Some((id, write || st.dup_mask() == 0));
        }
        self.st = st;

        // The access itself, through the mapping just installed.
        match e {
            Event::CpuFault { write } => self.access_cpu(write)?,
            Event::DevFault { dev, write, .. } => self.access_dev(usize::from(dev), write)?,
            Event::DontNeed | Event::Free => {
                self.expected = 0;
                self.lost = false;
            }
            _ => {}
        }
        if let (Event::Pin { .. }, Loc::Device(_)) = (e, st.loc()) {
            prop_assert_eq!(st.dup_mask(), 0, "a pinned page kept duplicates: {:?}", st);
        }
        if let Loc::Device(o) = pre.loc() {
            let unpins = matches!(e, Event::Unpin | Event::DeviceGone { .. } | Event::Free | Event::Lose);
            if pre.pinned() && !unpins {
                prop_assert_eq!((st.loc(), st.pinned()), (Loc::Device(o), true));
            }
        }
        self.check()?;
        Ok(Some(a))
    }

    fn check_refusal(&self, e: Event, r: Refused) -> Result<(), TestCaseError> {
        let bad_dev = match e {
            Event::DevFault { dev, .. } | Event::Pin { dev } | Event::DeviceGone { dev } | Event::EvictTo { dev } => {
                usize::from(dev) >= NDEV
            }
            Event::Prefetch { to: Target::Device(d) } => usize::from(d) >= NDEV,
            _ => false,
        };
        prop_assert_eq!(r == Refused::BadDevice, bad_dev, "{:?} -> {:?}", e, r);
        if r != Refused::BadDevice {
            // A lost page refuses accesses (and nothing else), and only a lost page says so.
            let lost = self.st.loc() == Loc::Lost;
            prop_assert_eq!(r == Refused::Lost, lost, "{:?} -> {:?} on {:?}", e, r, self.st);
            if lost {
                let access = matches!(
                    e,
                    Event::CpuFault { .. } | Event::DevFault { .. } | Event::Prefetch { .. } | Event::Pin { .. }
                );
                prop_assert!(access, "{:?} refused on a lost page", e);
            } else {
                prop_assert!(self.st.pinned(), "refused {:?} on an unpinned page", e);
            }
        }
        prop_assert!(
            !matches!(e, Event::Free | Event::Unpin | Event::WriteBack | Event::Lose),
            "Free/Unpin/WriteBack/Lose refused"
        );
        Ok(())
    }

    fn write_value(&mut self) -> u64 {
        let v = self.next;
        self.expected = v;
        self.next += 1;
        v
    }

    fn access_cpu(&mut self, write: bool) -> Result<(), TestCaseError> {
        let (id, writable) = self.cpu.ok_or_else(|| TestCaseError::fail("CPU not mapped"))?;
        prop_assert_eq!(self.host.map(|h| h.0), Some(id), "CPU maps a freed host page");
        if write {
            prop_assert!(writable, "CPU write through a read-only mapping");
            prop_assert!(self.st.loc() == Loc::Host && self.st.dup_mask() == 0);
            let v = self.write_value();
            self.host = Some((id, v));
        } else {
            prop_assert_eq!(self.host.map(|h| h.1), Some(self.expected), "CPU read stale data");
        }
        Ok(())
    }

    fn access_dev(&mut self, d: usize, write: bool) -> Result<(), TestCaseError> {
        let (via, writable) = self.dmap[d].ok_or_else(|| TestCaseError::fail("dev not mapped"))?;
        let s = self.st;
        let slot = match via {
            Via::Remote(id) => {
                prop_assert_eq!(self.host.map(|h| h.0), Some(id), "remote map of a freed page");
                &mut self.host
            }
            Via::Frame(id) if self.owner[d].map(|f| f.0) == Some(id) => {
                if writable {
                    // Writes to the owner frame only ever happen while it is the only copy.
                    prop_assert!(s.dirty() && !s.host_valid(), "writable map of a clean page");
                }
                &mut self.owner[d]
            }
            Via::Frame(id) if self.dup[d].map(|f| f.0) == Some(id) => {
                prop_assert!(!writable, "writable mapping of a duplicate");
                &mut self.dup[d]
            }
            Via::Frame(_) => return Err(TestCaseError::fail("device PTE to a freed frame")),
        };
        if write {
            prop_assert!(writable, "device write through a read-only mapping");
            prop_assert_eq!(s.dup_mask(), 0, "write next to duplicates");
            let (id, _) = slot.ok_or_else(|| TestCaseError::fail("no memory"))?;
            let v = self.next;
            *slot = Some((id, v));
            self.write_value();
        } else {
            prop_assert_eq!(slot.map(|m| m.1), Some(self.expected), "device {} read stale data", d);
        }
        Ok(())
    }

    /// State/model agreement after every successful transition or access.
    fn check(&self) -> Result<(), TestCaseError> {
        let s = self.st;
        let owners: Vec<usize> = (0..NDEV).filter(|&d| self.owner[d].is_some()).collect();
        let host_val = self.host.map(|h| h.1);
        prop_assert_eq!(s.loc() == Loc::Lost, self.lost, "lost state vs Lose: {:?}", s);
        match s.loc() {
            Loc::None => {
                prop_assert!(self.host.is_none() && owners.is_empty() && self.cpu.is_none());
                prop_assert_eq!(self.expected, 0, "discarded page must read zeros");
                prop_assert_eq!(s.dup_mask() | s.remote_mask(), 0);
            }
            Loc::Host => {
                prop_assert_eq!(host_val, Some(self.expected), "host copy lost");
                prop_assert!(owners.is_empty(), "second authoritative copy");
                prop_assert!(!s.pinned() && !s.dirty() && s.host_valid());
            }
            Loc::Device(o) => {
                prop_assert_eq!(owners, vec![usize::from(o)], "exactly one owner frame");
                let own = self.owner[usize::from(o)].map(|f| f.1);
                prop_assert_eq!(own, Some(self.expected), "data lost");
                prop_assert!(self.cpu.is_none() && !s.cpu_mapped() && s.remote_mask() == 0);
                prop_assert_eq!(self.host.is_some(), s.host_valid());
                prop_assert!(s.dirty() != s.host_valid(), "neither dirty nor clean: {:?}", s);
                if s.host_valid() {
                    prop_assert_eq!(host_val, own, "clean page: host copy differs");
                }
                prop_assert_eq!(s.dup_mask() & (1 << o), 0);
            }
            Loc::Lost => {
                prop_assert!(self.host.is_none() && owners.is_empty(), "lost page holds memory");
                prop_assert!(self.cpu.is_none(), "lost page mapped by the CPU");
                prop_assert!(self.dmap.iter().all(Option::is_none), "lost page mapped");
                prop_assert!(!s.pinned() && !s.dirty() && !s.host_valid() && !s.cpu_mapped());
                prop_assert_eq!(s.dup_mask() | s.remote_mask(), 0);
            }
        }
        prop_assert_eq!(s.cpu_mapped(), self.cpu.is_some());
        if let Some((id, _)) = self.cpu {
            prop_assert_eq!(self.host.map(|h| h.0), Some(id), "CPU maps a freed host page");
        }
        prop_assert_eq!(s.dup_mask() & s.remote_mask(), 0);
        for d in 0..NDEV {
            let is_dup = s.dup_mask() & (1 << d) != 0;
            prop_assert_eq!(self.dup[d].is_some(), is_dup, "dup frame on {} vs mask", d);
            if is_dup {
                prop_assert_eq!(self.dup[d].map(|f| f.1), Some(self.expected), "stale dup on {}", d);
            }
            let is_remote = s.remote_mask() & (1 << d) != 0;
            match self.dmap[d] {
                Some((Via::Remote(id), _)) => {
                    prop_assert!(is_remote, "unrecorded remote map");
                    prop_assert_eq!(self.host.map(|h| h.0), Some(id), "remote map of freed page");
                }
                Some((Via::Frame(id), w)) => {
                    let own = self.owner[d].map(|f| f.0) == Some(id);
                    let dup = self.dup[d].map(|f| f.0) == Some(id);
                    prop_assert!(own || dup, "PTE to a freed frame on {}", d);
                    if w {
                        prop_assert!(own && s.dirty() && !s.host_valid(), "writable PTE on {}", d);
                    }
                }
                None => prop_assert!(!is_remote, "remote bit without mapping"),
            }
            if matches!(self.dmap[d], Some((_, true))) {
                prop_assert_eq!(s.dup_mask(), 0, "writable device mapping next to duplicates");
            }
        }
        if matches!(self.cpu, Some((_, true))) {
            prop_assert_eq!(s.dup_mask(), 0, "writable CPU mapping next to duplicates");
        }
        // Query word agrees with the accessors.
        let w = s.query_word();
        let (loc, owner) = match s.loc() {
            Loc::None => (0, 0),
            Loc::Host => (1, 0),
            Loc::Device(o) => (2, u32::from(o)),
            Loc::Lost => (3, 0),
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
        2 => Just(Event::Evict),
        1 => dev().prop_map(|dev| Event::DeviceGone { dev }),
        2 => Just(Event::WriteBack),
        2 => dev().prop_map(|dev| Event::EvictTo { dev }),
        1 => Just(Event::Lose),
    ]
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => event().prop_map(Step::Ev),
        2 => any::<bool>().prop_map(|write| Step::Cpu { write }),
        4 => (dev(), any::<bool>(), any::<bool>(), any::<bool>()).prop_map(
            |(dev, write, read_mostly, accessed_by)| Step::Dev {
                dev,
                write,
                read_mostly,
                accessed_by
            }
        ),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    #[test]
    fn random_sequences_keep_data_and_balance_frames(
        steps in prop::collection::vec(step(), 0..80)
    ) {
        let mut m = Model::new();
        for s in steps {
            m.step(s)?;
        }
        // Evicting returns the right data, without a copy if the page was clean.
        m.apply(Event::Unpin)?;
        let pre = m.st;
        let a = m.apply(Event::Evict)?.ok_or_else(|| TestCaseError::fail("Evict refused"))?;
        if matches!(pre.loc(), Loc::Device(_)) {
            prop_assert_eq!(m.st.loc(), Loc::Host);
            prop_assert_eq!(m.host.map(|h| h.1), Some(m.expected), "evicted data wrong");
            prop_assert_eq!(a.copy == Copy::None, clean(pre));
        } else {
            prop_assert_eq!((m.st, a), (pre, Actions::default()));
        }
        m.apply(Event::Free)?;
        prop_assert_eq!(m.st, PageState::EMPTY);
        prop_assert_eq!(m.frames_alloc, m.frames_freed, "frame leak");
        prop_assert!(m.host.is_none() && m.cpu.is_none());
        prop_assert!(m.dmap.iter().all(Option::is_none), "device PTE left after Free");
    }

    /// Read-migrate, any mix of reads, clean evict: the host page was never touched.
    #[test]
    fn clean_round_trip_never_copies_home(
        devs in prop::collection::vec(0u8..4, 1..10), writer in any::<bool>()
    ) {
        let mut m = Model::new();
        m.step(Step::Cpu { write: true })?;
        let v = m.expected;
        for d in devs {
            m.step(Step::Dev { dev: d, write: false, read_mostly: false, accessed_by: false })?;
            prop_assert!(clean(m.st));
        }
        if writer {
            m.step(Step::Ev(Event::WriteBack))?;
            prop_assert!(clean(m.st), "WriteBack of a clean page changes nothing");
        }
        let a = m.apply(Event::Evict)?.ok_or_else(|| TestCaseError::fail("refused"))?;
        prop_assert_eq!(a.copy, Copy::None);
        prop_assert_eq!(m.host.map(|h| h.1), Some(v));
    }

    /// Any page state, moved onto `dev` (maybe written, duplicated, pinned) and lost there:
    /// every access is refused until DontNeed/Free, after which the page reads zeros and no
    /// frame has leaked.
    #[test]
    fn lost_page_refuses_access_until_discarded(
        prefix in prop::collection::vec(step(), 0..40),
        dev in 0u8..4,
        write in any::<bool>(),
        dups in prop::collection::vec(0u8..4, 0..3),
        pin in any::<bool>(),
        while_lost in prop::collection::vec(
            step().prop_filter("keeps the page lost", |s| {
                !matches!(s, Step::Ev(Event::DontNeed | Event::Free))
            }),
            0..20,
        ),
        free in any::<bool>(),
        reader in prop::option::of(0u8..4),
    ) {
        let mut m = Model::new();
        for s in prefix {
            m.step(s)?;
        }
        if m.lost {
            m.apply(Event::DontNeed)?;
        }
        m.apply(Event::Unpin)?;
        m.apply(Event::Prefetch { to: Target::Device(dev) })?;
        m.apply(Event::DevFault { dev, write, read_mostly: false, accessed_by: false })?;
        for d in dups.into_iter().filter(|&d| d != dev) {
            let e = Event::DevFault { dev: d, write: false, read_mostly: true, accessed_by: false };
            m.apply(e)?;
        }
        if pin {
            m.apply(Event::Pin { dev })?;
        }
        prop_assert_eq!(m.st.loc(), Loc::Device(dev));
        let a = m.apply(Event::Lose)?.ok_or_else(|| TestCaseError::fail("Lose refused"))?;
        prop_assert_eq!(a.free_frame, Some(dev));
        prop_assert!(m.lost && m.st.loc() == Loc::Lost);
        for s in while_lost {
            m.step(s)?;
            prop_assert_eq!(m.st.loc(), Loc::Lost);
        }
        for d in 0..NDEV as u8 {
            for (write, read_mostly, accessed_by) in [(false, false, false), (true, true, true)] {
                let e = Event::DevFault { dev: d, write, read_mostly, accessed_by };
                prop_assert_eq!(transition(m.st, e), Err(Refused::Lost));
            }
        }
        for write in [false, true] {
            prop_assert_eq!(transition(m.st, Event::CpuFault { write }), Err(Refused::Lost));
        }
        m.apply(if free { Event::Free } else { Event::DontNeed })?;
        prop_assert_eq!((m.st, m.lost), (PageState::EMPTY, false));
        // The next access zero-fills: the lost data does not come back.
        match reader {
            None => m.step(Step::Cpu { write: false })?,
            Some(d) => {
                m.step(Step::Dev { dev: d, write: false, read_mostly: false, accessed_by: false })?
            }
        }
        let read = match m.st.loc() {
            Loc::Host => m.host.map(|h| h.1),
            Loc::Device(o) => m.owner[usize::from(o)].map(|f| f.1),
            other => return Err(TestCaseError::fail(format!("read left the page {other:?}"))),
        };
        prop_assert_eq!(read, Some(0));
        m.apply(Event::Free)?;
        prop_assert_eq!(m.frames_alloc, m.frames_freed, "frame leak");
        prop_assert!(m.host.is_none() && m.cpu.is_none());
    }

    #[test]
    fn any_bits_decode_consistently(b in any::<u32>()) {
        let s = PageState::from_bits(b);
        let w = s.query_word();
        let loc = match s.loc() {
            Loc::None => Q_LOC_NONE,
            Loc::Host => Q_LOC_HOST,
            Loc::Device(o) => Q_LOC_DEVICE | (u32::from(o) << 8),
            Loc::Lost => Q_LOC_LOST,
        };
        prop_assert_eq!(w & 0xffff, loc);
        // The tag alone decides the location.
        prop_assert_eq!(b >> 30 == 3, s.loc() == Loc::Lost);
        prop_assert_eq!(s.dup_mask() & s.remote_mask(), 0);
        prop_assert!(!s.pinned() || matches!(s.loc(), Loc::Device(_)));
        // Free always succeeds and releases whatever the bits claim.
        let (e, a) = transition(s, Event::Free).map_err(|r| TestCaseError::fail(format!("{r:?}")))?;
        prop_assert_eq!(e, PageState::EMPTY);
        prop_assert_eq!(a.free_dup_frames, s.dup_mask());
    }

    /// Whatever else is set, tag 3 is the one lost state: no flag, no mask, no memory.
    #[test]
    fn tag_3_bits_decode_as_normalised_lost(low in 0u32..(1 << 30)) {
        let s = PageState::from_bits((3 << 30) | low);
        prop_assert_eq!(s.loc(), Loc::Lost);
        prop_assert_eq!(
            (s.pinned(), s.dirty(), s.host_valid(), s.cpu_mapped(), s.dup_mask(), s.remote_mask()),
            (false, false, false, false, 0, 0)
        );
        prop_assert_eq!(s.query_word(), Q_LOC_LOST);
        // Re-packed by a transition (a no-op here), only the tag remains.
        let (t, a) = transition(s, Event::Unpin)
            .map_err(|r| TestCaseError::fail(format!("{r:?}")))?;
        prop_assert_eq!((t.bits(), a), (3 << 30, Actions::default()));
        let (e, a) = transition(s, Event::Free)
            .map_err(|r| TestCaseError::fail(format!("{r:?}")))?;
        prop_assert_eq!((e, a), (PageState::EMPTY, Actions::default()));
    }
}
