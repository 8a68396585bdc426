// SPDX-License-Identifier: GPL-2.0
//! Per-page residency state machine of GMEM.
//!
//! Each GMEM page has one [`PageState`] (32 bits). [`transition`] maps a state and an
//! [`Event`] to the next state plus the [`Actions`] the kernel glue must perform, in the
//! order of the fields of [`Actions`]. The function is pure: on `Err` nothing changes, and on
//! `Ok` the glue either performs every action or (if an allocation in step 1/2 fails) none
//! and keeps the old state. Allocations come first for exactly that reason.
//!
//! Invariants kept by every transition (property-tested in `tests/page_state_model.rs`):
//! - One authoritative location: `Loc::None` (the page reads zeros, nothing is
//!   allocated), `Loc::Host` (the host page) or `Loc::Device(o)` (the frame of the single
//!   owner `o`); or none at all in `Loc::Lost` (see below). Data is never lost except by
//!   `DontNeed`/`Free`, which ask for it, or by `Lose`, which the glue uses only when a
//!   device goes away and the data of a page on it cannot be saved (no host page can be
//!   allocated, or the device's copy fails).
//! - `Loc::Lost` holds nothing: no host page, no frame, no duplicate, no mapping, no flag
//!   (`Lose` releases all of it, like `Free`, but remembers that the data is gone).
//!   Every access to it (CPU or device fault, prefetch, pin) is refused with
//!   [`Refused::Lost`], so the glue never installs a mapping for it; `DontNeed`/`Free`
//!   turn it back into `Loc::None` (reads zeros again), every other event leaves it alone.
//! - On `Loc::Host` the page is clean (`!dirty`), `host_valid`, never pinned; only there
//!   can devices map it remotely (`remote_mask`).
//! - On `Loc::Device(o)` the CPU does not map the page and either `dirty && !host_valid`
//!   (the owner frame is the only copy; the host page has been released) or
//!   `!dirty && host_valid` ("clean": the host page holds the same data as the owner frame).
//!   A read migration from the host keeps the host page (clean), so that leaving the device
//!   later (CPU fault, `Evict`, `Prefetch` to host, `DeviceGone`) needs no copy; a device
//!   write turns the page dirty and releases the host page; `WriteBack` copies a dirty page
//!   home and makes it clean again. Migrations between devices (`D2D`, `EvictTo`) keep the
//!   clean/dirty status and the host page.
//! - A page evicted to a peer (`EvictTo`) is *parked* there: its owner is the peer, which
//!   does not use it. A device read fault on a parked page, or a PREFETCH of it to a
//!   device (read-ahead included; not a pin), copies it over and keeps the
//!   peer's frame as a read-only duplicate ([`Actions::owner_to_dup`]): a backing copy, as
//!   the host page of a clean page is one. Evicting the page to that peer again promotes
//!   the duplicate back to owner without a copy ([`Actions::dup_to_owner`]); a write drops
//!   it as it drops any duplicate. So a page that goes out, comes back to be read and goes
//!   out again crosses the peer link twice, not three times. Any use of the page by its
//!   owner (fault, prefetch or pin there) ends the parking.
//! - A device maps the owner frame writable only while the page is dirty and has no
//!   duplicates: every `map_dev` of a device frame in a clean state or in a state with
//!   duplicates is read-only, and the transitions that make a page clean (`WriteBack`)
//!   revoke the owner mapping. Hence the owner frame is never written while clean: a write
//!   faults first, and that fault dirties the page.
//! - Duplicates (`dup_mask`, READ_MOSTLY) are read-only copies of the current data on
//!   devices other than the owner. While any exist, every mapping of the page is read-only:
//!   creating the first duplicate revokes the CPU mapping, the remote mappings and the
//!   owner's device mapping, and any write fault drops all duplicates first. Consequently
//!   the glue, when it performs `map_cpu`, must map the host page writable only if the fault
//!   was a write or the new state has `dup_mask() == 0`.
//! - A device is never both a duplicate holder and a remote mapper.
//!
//! Packing (the raw bits are private; `query_word` is the user-visible encoding): bits
//! 30-31 are the location tag (0 none, 1 host, 2 device, 3 lost). Device layout: bits 0-15 dup
//! mask, 16-19 owner, 20 pinned, 21 dirty, 22 host_valid, 23 parked. Host layout: bits 0-25 hold one
//! base-3 digit per device (0 nothing, 1 duplicate, 2 remote mapping; 3^16 < 2^26), which is
//! how 16 devices' duplicate *and* remote masks fit in 32 bits, and bit 26 is cpu_mapped.
//! `Loc::None` is all zeros; `Loc::Lost` is tag 3 with every other bit zero (and any value
//! with tag 3 decodes as the one lost state, whatever its other bits).
#![allow(dead_code, unreachable_pub)]

/// Maximum number of devices; device ids are `0..MAX_DEVICES`.
pub const MAX_DEVICES: usize = 16;

const TAG_SHIFT: u32 = 30;
const TAG_HOST: u32 = 1;
const TAG_DEV: u32 = 2;
const TAG_LOST: u32 = 3;
// Host layout.
const H_TRITS: u32 = (1 << 26) - 1;
const H_CPU_MAPPED: u32 = 1 << 26;
// Device layout.
const D_DUP: u32 = 0xffff;
const D_OWNER_SHIFT: u32 = 16;
const D_PINNED: u32 = 1 << 20;
const D_DIRTY: u32 = 1 << 21;
const D_HOST_VALID: u32 = 1 << 22;
const D_PARKED: u32 = 1 << 23;

/// User-visible query word bits (`GMEM_Q_*` in `include/uapi/linux/gmem.h`).
pub const Q_LOC_NONE: u32 = 0;
/// Location field value: host.
pub const Q_LOC_HOST: u32 = 1;
/// Location field value: device (owner id in bits 8-15).
pub const Q_LOC_DEVICE: u32 = 2;
/// Location field value: lost (the data could not be saved when its device went away; no
/// other bit is set).
pub const Q_LOC_LOST: u32 = 3;
/// `GMEM_Q_PINNED`.
pub const Q_PINNED: u32 = 1 << 16;
/// `GMEM_Q_DIRTY`.
pub const Q_DIRTY: u32 = 1 << 17;
/// `GMEM_Q_DUP`.
pub const Q_DUP: u32 = 1 << 18;
/// `GMEM_Q_REMOTE`.
pub const Q_REMOTE: u32 = 1 << 19;
/// `GMEM_Q_CPU_MAPPED`.
pub const Q_CPU_MAPPED: u32 = 1 << 20;

/// Where a page of ordinary process memory (outside the GMEM regions, which gmem mirrors
/// but does not own) is, as a walk of the process's page tables finds it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum SysLoc {
    /// Never touched (or discarded): nothing mapped.
    None,
    /// A host page the process maps.
    Host,
    /// Migrated to this device (a device-private page of it).
    Device(u8),
}

/// The QUERY word of a page of ordinary process memory: on the host and CPU-mapped where
/// the process maps a host page, on device `d` where it was migrated there, never touched
/// otherwise; `remote` if a device maps the host page remotely.
pub fn sysmem_query_word(at: SysLoc, remote: bool) -> u32 {
    match at {
        SysLoc::None => Q_LOC_NONE,
        // A device maps only pages the process maps: without one there is nothing to map.
        SysLoc::Host => Q_LOC_HOST | Q_CPU_MAPPED | if remote { Q_REMOTE } else { 0 },
        // The device that holds it maps it locally; no CPU mapping exists meanwhile.
        SysLoc::Device(d) => Q_LOC_DEVICE | (u32::from(d) << 8),
    }
}

/// Packed per-page state, 32 bits (layout in the module documentation).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct PageState(u32);

/// Where the authoritative copy of a page lives.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Loc {
    /// Never populated or discarded: reads zeros, nothing allocated.
    None,
    /// The host page.
    Host,
    /// A frame of this owner device.
    Device(u8),
    /// The data could not be saved when its device went away: nothing is allocated
    /// anywhere and nothing maps the page; accesses are refused ([`Refused::Lost`]) until
    /// `DontNeed`/`Free` discard it.
    Lost,
}

/// Destination of a prefetch.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Target {
    /// Host memory.
    Host,
    /// A device's memory.
    Device(u8),
}

/// Something that happens to one page.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Event {
    /// CPU page fault.
    CpuFault { write: bool },
    /// Device page fault with the advice in force for the page and device.
    DevFault { dev: u8, write: bool, read_mostly: bool, accessed_by: bool },
    /// Move the data; a page moved to a device is mapped there (never on the CPU).
    Prefetch { to: Target },
    /// Migrate to `dev` (if not there) and pin.
    Pin { dev: u8 },
    /// Clear the pin.
    Unpin,
    /// Discard the data everywhere (refused while pinned).
    DontNeed,
    /// Owner device -> host (refused if pinned); no copy if the page is clean.
    Evict,
    /// The device is unregistering: it must hold nothing of the page afterwards.
    DeviceGone { dev: u8 },
    /// The region is freed: release everything.
    Free,
    /// Background cleaning: copy a dirty device page to a new host page and keep both
    /// (the page becomes clean; the owner's mapping is revoked, the next device write
    /// faults). A no-op on anything else; never refused.
    WriteBack,
    /// Eviction to a peer: move the page from its owner to a spare frame of `dev`, mapped by
    /// nobody, and mark it parked; if `dev` holds a duplicate, that frame becomes the owner
    /// frame without a copy (refused while pinned; a no-op if not on a device or already on
    /// `dev`).
    EvictTo { dev: u8 },
    /// The data of a device page could not be saved when its device went away: release
    /// everything the page holds (pin ignored) and make it `Loc::Lost`. A no-op anywhere but
    /// on a device; never refused.
    Lose,
}

/// Data movement or zero fill into the newly allocated place (step 3).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub enum Copy {
    /// Nothing to move.
    #[default]
    None,
    /// Zero the host page.
    ZeroHost,
    /// Zero the new frame on this device.
    ZeroDev(u8),
    /// Host page -> new frame on this device.
    H2D(u8),
    /// Frame of this (owner) device -> host page.
    D2H(u8),
    /// Owner's frame on `from` -> new frame on `to`.
    D2D { from: u8, to: u8 },
}

/// One device page-table entry to install (step 8).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct DevMap {
    /// Device whose page table gets the entry.
    pub dev: u8,
    /// Map writable.
    pub writable: bool,
    /// Map the host page remotely instead of the device's own frame.
    pub remote_host: bool,
}

/// What the kernel glue must do, performed in field order.
///
/// If `alloc_frame == Some(d)` while `d` is also in `free_dup_frames` (a duplicate holder
/// becomes the owner), the new frame is distinct from `d`'s duplicate frame, which is
/// released in step 6b. A newly allocated frame becomes the owner frame if the new state is
/// `Loc::Device(d)`, else `d`'s duplicate frame.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct Actions {
    /// 1. Allocate a host page (if none exists).
    pub alloc_host: bool,
    /// 2. Allocate a frame on this device.
    pub alloc_frame: Option<u8>,
    /// 3. Data movement / zero fill into the new place.
    pub copy: Copy,
    /// 4. Revoke the CPU mapping.
    pub zap_cpu: bool,
    /// 5. Device page-table entries to remove (mask of devices).
    pub unmap_dev: u16,
    /// 6. Release the frame of the device that owned the page before.
    pub free_frame: Option<u8>,
    /// 6a. The frame of the device that owned the page before becomes that device's
    ///     duplicate frame (instead of being released).
    pub owner_to_dup: Option<u8>,
    /// 6b. Release duplicate frames on these devices.
    pub free_dup_frames: u16,
    /// 6c. This device's duplicate frame becomes the owner frame (no allocation, no copy).
    pub dup_to_owner: Option<u8>,
    /// 7. Release the host page.
    pub free_host: bool,
    /// 8. Install a device PTE.
    pub map_dev: Option<DevMap>,
    /// 9. The CPU fault handler inserts the host page (only for `CpuFault`); writable only if
    ///    the fault was a write or the new state has no duplicates.
    pub map_cpu: bool,
}

/// Why a transition was refused (the state is unchanged).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Refused {
    /// Device id `>= MAX_DEVICES`.
    BadDevice,
    /// The page is pinned on its device and the event would move or discard it (for a CPU
    /// fault the glue may map the device frame for the CPU instead).
    Pinned,
    /// The page is pinned on another device.
    PinnedElsewhere,
    /// The page is lost ([`Loc::Lost`]): the CPU gets SIGBUS, a device -EIO.
    Lost,
}

/// Unpacked view of a state; the transition logic works on this.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Fields {
    loc: Loc,
    pinned: bool,
    dirty: bool,
    host_valid: bool,
    cpu_mapped: bool,
    dup: u16,
    remote: u16,
    /// On a device: the owner is a peer that holds the page for another device
    /// (`EvictTo`), not a user of it.
    parked: bool,
}

impl Fields {
    const NONE: Fields = Fields {
        loc: Loc::None,
        pinned: false,
        dirty: false,
        host_valid: false,
        cpu_mapped: false,
        dup: 0,
        remote: 0,
        parked: false,
    };
    /// The authoritative copy is the (clean) host page.
    const HOST: Fields = Fields { loc: Loc::Host, host_valid: true, ..Fields::NONE };
    /// The data is gone; nothing else can be true of the page.
    const LOST: Fields = Fields { loc: Loc::Lost, ..Fields::NONE };

    /// Packs into the layout described in the module documentation. Normalises: fields that
    /// cannot exist at a location are dropped.
    fn pack(self) -> PageState {
        match self.loc {
            Loc::None => PageState::EMPTY,
            Loc::Host => {
                // One base-3 digit per device, device 0 least significant. The value is at
                // most 3^16 - 1, so neither the multiplication nor the addition overflows.
                let mut t: u32 = 0;
                // From the highest device with a digit (leading zero digits add nothing).
                let mut i = (u16::BITS - (self.dup | self.remote).leading_zeros()) as usize;
                while i > 0 {
                    i -= 1;
                    let b = 1u16 << i;
                    let digit = if self.dup & b != 0 {
                        1
                    } else if self.remote & b != 0 {
                        2
                    } else {
                        0
                    };
                    t = t * 3 + digit;
                }
                let cpu = if self.cpu_mapped { H_CPU_MAPPED } else { 0 };
                PageState((TAG_HOST << TAG_SHIFT) | t | cpu)
            }
            Loc::Device(o) => {
                let o = o & 0xf;
                let mut v = (TAG_DEV << TAG_SHIFT) | (u32::from(o) << D_OWNER_SHIFT);
                v |= u32::from(self.dup & !dev_bit(o));
                v |= if self.pinned { D_PINNED } else { 0 };
                v |= if self.dirty { D_DIRTY } else { 0 };
                v |= if self.host_valid { D_HOST_VALID } else { 0 };
                v |= if self.parked { D_PARKED } else { 0 };
                PageState(v)
            }
            Loc::Lost => PageState(TAG_LOST << TAG_SHIFT),
        }
    }
}

/// Mask bit of device `d` in a device mask (`u16`; 0 for an invalid id, which callers
/// have rejected already).
pub fn dev_bit(d: u8) -> u16 {
    1u16.checked_shl(u32::from(d)).unwrap_or(0)
}

impl PageState {
    /// Never populated.
    pub const EMPTY: PageState = PageState(0);

    /// Rebuilds a state from [`PageState::bits`]. Any value is accepted (tag 0 reads as
    /// `Loc::None` and tag 3 as `Loc::Lost` whatever the other bits); no accessor panics.
    pub const fn from_bits(b: u32) -> PageState {
        PageState(b)
    }

    /// The raw packed bits (for storage, e.g. in an array of `u32`).
    pub const fn bits(self) -> u32 {
        self.0
    }

    /// The location tag (`TAG_*`).
    fn tag(self) -> u32 {
        self.0 >> TAG_SHIFT
    }

    fn unpack(self) -> Fields {
        let v = self.0;
        match self.tag() {
            TAG_HOST => {
                let (mut dup, mut remote) = (0u16, 0u16);
                let mut t = v & H_TRITS;
                // Digits past the last non-zero one are 0 (most host pages have none).
                let mut i = 0;
                while t != 0 && i < MAX_DEVICES {
                    match t % 3 {
                        1 => dup |= 1 << i,
                        2 => remote |= 1 << i,
                        _ => {}
                    }
                    t /= 3;
                    i += 1;
                }
                Fields { cpu_mapped: v & H_CPU_MAPPED != 0, dup, remote, ..Fields::HOST }
            }
            TAG_DEV => {
                // The mask keeps the owner below 16, so the cast is lossless.
                let o = ((v >> D_OWNER_SHIFT) & 0xf) as u8;
                Fields {
                    loc: Loc::Device(o),
                    pinned: v & D_PINNED != 0,
                    dirty: v & D_DIRTY != 0,
                    host_valid: v & D_HOST_VALID != 0,
                    cpu_mapped: false,
                    dup: (v & D_DUP) as u16 & !dev_bit(o),
                    remote: 0,
                    parked: v & D_PARKED != 0,
                }
            }
            // Nothing but the location survives a loss, so the other bits are ignored.
            TAG_LOST => Fields::LOST,
            _ => Fields::NONE,
        }
    }

    // The single-field accessors below read their bits straight from the packed word (the
    // executor and eviction call them for every page they look at); each gives what
    // `unpack` would (`accessors_agree_with_unpack`).

    /// Where the authoritative copy lives.
    pub fn loc(self) -> Loc {
        match self.tag() {
            TAG_HOST => Loc::Host,
            // The mask keeps the owner below 16, so the cast is lossless.
            TAG_DEV => Loc::Device(((self.0 >> D_OWNER_SHIFT) & 0xf) as u8),
            TAG_LOST => Loc::Lost,
            _ => Loc::None,
        }
    }
    /// Flag `b` of a state on a device (every device flag is false elsewhere).
    fn dev_flag(self, b: u32) -> bool {
        self.tag() == TAG_DEV && self.0 & b != 0
    }
    /// Never evicted from its device.
    pub fn pinned(self) -> bool {
        self.dev_flag(D_PINNED)
    }
    /// The owner device's copy is newer than any host copy.
    pub fn dirty(self) -> bool {
        self.dev_flag(D_DIRTY)
    }
    /// A host page exists and holds the current data.
    pub fn host_valid(self) -> bool {
        self.tag() == TAG_HOST || self.dev_flag(D_HOST_VALID)
    }
    /// The CPU page table maps the host page.
    pub fn cpu_mapped(self) -> bool {
        self.tag() == TAG_HOST && self.0 & H_CPU_MAPPED != 0
    }
    /// Parked on its owner device for another one (see the module documentation).
    pub fn parked(self) -> bool {
        self.dev_flag(D_PARKED)
    }
    /// Devices holding read-only duplicates (READ_MOSTLY, or the backing copy a parked
    /// page leaves on its peer).
    pub fn dup_mask(self) -> u16 {
        self.unpack().dup
    }
    /// Devices mapping the host page remotely (ACCESSED_BY).
    pub fn remote_mask(self) -> u16 {
        self.unpack().remote
    }

    /// The user-visible `GMEM_IOC_QUERY` word.
    pub fn query_word(self) -> u32 {
        let f = self.unpack();
        let mut w = match f.loc {
            Loc::None => Q_LOC_NONE,
            Loc::Host => Q_LOC_HOST,
            Loc::Device(o) => Q_LOC_DEVICE | (u32::from(o) << 8),
            // Every flag is false on a lost page (`unpack` normalises), so this is the word.
            Loc::Lost => Q_LOC_LOST,
        };
        let flags = [
            (f.pinned, Q_PINNED),
            (f.dirty, Q_DIRTY),
            (f.dup != 0, Q_DUP),
            (f.remote != 0, Q_REMOTE),
            (f.cpu_mapped, Q_CPU_MAPPED),
        ];
        for (set, q) in flags {
            if set {
                w |= q;
            }
        }
        w
    }
}

fn check_dev(d: u8) -> Result<(), Refused> {
    if usize::from(d) < MAX_DEVICES {
        Ok(())
    } else {
        Err(Refused::BadDevice)
    }
}

/// Drops every duplicate (a write is coming).
fn collapse(f: &mut Fields, a: &mut Actions) {
    a.unmap_dev |= f.dup;
    a.free_dup_frames |= f.dup;
    f.dup = 0;
}

/// On a device: the host page holds the current data too (see the module invariants).
fn clean(f: Fields) -> bool {
    f.host_valid && !f.dirty
}

/// A write to the owner's frame is coming: drop the duplicates and the host copy, which
/// would become stale.
fn make_dirty(f: Fields, a: &mut Actions) -> Fields {
    let mut n = f;
    collapse(&mut n, a);
    if n.host_valid {
        a.free_host = true;
        n.host_valid = false;
    }
    n.dirty = true;
    n
}

/// The mapping of `d`'s own frame for new device state `n`: writable only if the page is
/// dirty (no host copy to keep in sync) and no duplicates exist.
fn local_map(n: Fields, d: u8) -> Option<DevMap> {
    let writable = n.dirty && !n.host_valid && n.dup == 0;
    Some(DevMap { dev: d, writable, remote_host: false })
}

/// `Device(o)` -> `Host`: drop the owner frame and the duplicates, copying back first
/// unless the host page is current (clean). The CPU is not mapped afterwards; the pin is
/// gone.
fn dev_to_host(f: Fields, o: u8, a: &mut Actions) -> Fields {
    if !clean(f) {
        a.alloc_host = true;
        a.copy = Copy::D2H(o);
    }
    a.unmap_dev |= dev_bit(o) | f.dup;
    a.free_frame = Some(o);
    a.free_dup_frames |= f.dup;
    Fields::HOST
}

/// `Host` -> `Device(d)`: copy, revoke every mapping of the host page, keep the host page
/// (the new state is clean; a write makes it dirty with [`make_dirty`]).
fn host_to_dev(f: Fields, d: u8, a: &mut Actions) -> Fields {
    a.alloc_frame = Some(d);
    a.copy = Copy::H2D(d);
    a.zap_cpu = f.cpu_mapped;
    a.unmap_dev |= f.dup | f.remote;
    a.free_dup_frames |= f.dup;
    Fields { loc: Loc::Device(d), host_valid: true, ..Fields::NONE }
}

/// `Device(o)` -> `Device(d)`, `d != o`: the clean/dirty status and the host page stay.
fn dev_to_dev(f: Fields, o: u8, d: u8, a: &mut Actions) -> Fields {
    a.alloc_frame = Some(d);
    a.copy = Copy::D2D { from: o, to: d };
    a.unmap_dev |= dev_bit(o) | f.dup;
    a.free_frame = Some(o);
    a.free_dup_frames |= f.dup;
    Fields { loc: Loc::Device(d), dirty: f.dirty, host_valid: f.host_valid, ..Fields::NONE }
}

/// A read fault of `d` on a page parked on `o`: like [`dev_to_dev`], but `o`'s frame stays
/// as a read-only duplicate, so that evicting the page to `o` again needs no copy.
fn unpark(f: Fields, o: u8, d: u8, a: &mut Actions) -> Fields {
    a.alloc_frame = Some(d);
    a.copy = Copy::D2D { from: o, to: d };
    a.unmap_dev |= dev_bit(o);
    a.owner_to_dup = Some(o);
    Fields { loc: Loc::Device(d), dirty: f.dirty, host_valid: f.host_valid, dup: f.dup | dev_bit(o), ..Fields::NONE }
}

/// Eviction of a page owned by `o` to `h`, which holds a duplicate: the duplicate becomes
/// the (parked) owner frame, the other duplicates go, nothing is copied.
fn promote(f: Fields, o: u8, h: u8, a: &mut Actions) -> Fields {
    a.unmap_dev |= dev_bit(o) | f.dup;
    a.free_frame = Some(o);
    a.free_dup_frames |= f.dup & !dev_bit(h);
    a.dup_to_owner = Some(h);
    Fields { loc: Loc::Device(h), dirty: f.dirty, host_valid: f.host_valid, parked: true, ..Fields::NONE }
}

/// Copies a dirty device page home and keeps both copies (`Event::WriteBack`).
fn write_back(f: Fields, a: &mut Actions) -> Fields {
    match f.loc {
        Loc::Device(o) if !clean(f) => {
            a.alloc_host = true;
            a.copy = Copy::D2H(o);
            // Revoke the (maybe writable) owner mapping before the copy; the next device
            // access faults and gets a read-only one.
            a.unmap_dev = dev_bit(o);
            Fields { dirty: false, host_valid: true, ..f }
        }
        _ => f,
    }
}

/// Adds a read-only duplicate on `d` (not the owner, not yet a duplicate holder).
fn add_dup(f: Fields, d: u8, copy: Copy, a: &mut Actions) -> Fields {
    let mut n = f;
    a.alloc_frame = Some(d);
    a.copy = copy;
    if f.dup == 0 {
        // First duplicate: every mapping of the authoritative copy may be writable; revoke.
        match f.loc {
            Loc::Host => {
                a.zap_cpu = f.cpu_mapped;
                n.cpu_mapped = false;
                a.unmap_dev |= f.remote;
                n.remote = 0;
            }
            Loc::Device(o) => a.unmap_dev |= dev_bit(o),
            Loc::None | Loc::Lost => {}
        }
    }
    if n.remote & dev_bit(d) != 0 {
        // The duplicate replaces d's remote mapping.
        a.unmap_dev |= dev_bit(d);
        n.remote &= !dev_bit(d);
    }
    n.dup |= dev_bit(d);
    a.map_dev = Some(DevMap { dev: d, writable: false, remote_host: false });
    n
}

/// Releases everything the page holds (nothing for `Loc::None` and `Loc::Lost`).
fn release(f: Fields, a: &mut Actions) -> Fields {
    a.zap_cpu = f.cpu_mapped;
    a.unmap_dev = f.dup | f.remote;
    a.free_dup_frames = f.dup;
    if let Loc::Device(o) = f.loc {
        a.unmap_dev |= dev_bit(o);
        a.free_frame = Some(o);
    }
    a.free_host = f.loc == Loc::Host || f.host_valid;
    Fields::NONE
}

fn cpu_fault(f: Fields, write: bool, a: &mut Actions) -> Result<Fields, Refused> {
    let mut n = match f.loc {
        Loc::None => {
            a.alloc_host = true;
            a.copy = Copy::ZeroHost;
            Fields::HOST
        }
        Loc::Host => {
            let mut n = f;
            if write {
                // Remote mappers keep their mapping: they map this very page.
                collapse(&mut n, a);
            }
            n
        }
        Loc::Device(_) if f.pinned => return Err(Refused::Pinned),
        Loc::Device(o) => dev_to_host(f, o, a),
        Loc::Lost => return Err(Refused::Lost),
    };
    a.map_cpu = true;
    n.cpu_mapped = true;
    Ok(n)
}

fn dev_fault(
    f: Fields,
    d: u8,
    write: bool,
    read_mostly: bool,
    accessed_by: bool,
    a: &mut Actions,
) -> Result<Fields, Refused> {
    let remote = |writable| Some(DevMap { dev: d, writable, remote_host: true });
    let is_dup = f.dup & dev_bit(d) != 0;
    // Arms that map the host page remotely or a duplicate return directly; the others give
    // the state in which `d` owns the page.
    let n = match f.loc {
        Loc::Lost => return Err(Refused::Lost),
        Loc::None if accessed_by => {
            a.alloc_host = true;
            a.copy = Copy::ZeroHost;
            a.map_dev = remote(true);
            return Ok(Fields { remote: dev_bit(d), ..Fields::HOST });
        }
        Loc::None => {
            a.alloc_frame = Some(d);
            a.copy = Copy::ZeroDev(d);
            Fields { loc: Loc::Device(d), dirty: true, ..Fields::NONE }
        }
        Loc::Host if accessed_by => {
            let mut n = f;
            if write {
                collapse(&mut n, a);
            }
            if n.dup & dev_bit(d) != 0 {
                // The remote mapping replaces d's duplicate.
                a.unmap_dev |= dev_bit(d);
                a.free_dup_frames |= dev_bit(d);
                n.dup &= !dev_bit(d);
            }
            n.remote |= dev_bit(d);
            a.map_dev = remote(n.dup == 0);
            return Ok(n);
        }
        Loc::Host | Loc::Device(_) if is_dup && !write => {
            // Re-map the existing duplicate.
            a.map_dev = Some(DevMap { dev: d, writable: false, remote_host: false });
            return Ok(f);
        }
        Loc::Host if read_mostly && !write => return Ok(add_dup(f, d, Copy::H2D(d), a)),
        Loc::Host => host_to_dev(f, d, a),
        Loc::Device(o) if o == d => f,
        Loc::Device(_) if f.pinned => return Err(Refused::PinnedElsewhere),
        Loc::Device(o) if accessed_by => {
            // ACCESSED_BY maps the host page: bring the data home, then map it remotely.
            a.map_dev = remote(true);
            return Ok(Fields { remote: dev_bit(d), ..dev_to_host(f, o, a) });
        }
        Loc::Device(o) if read_mostly && !write => return Ok(add_dup(f, d, Copy::D2D { from: o, to: d }, a)),
        Loc::Device(o) if f.parked && !write => unpark(f, o, d, a),
        Loc::Device(o) => dev_to_dev(f, o, d, a),
    };
    // `n` is `Device(d)`: d maps its own frame, writable only once the page is dirty.
    let n = if write { make_dirty(n, a) } else { n };
    a.map_dev = local_map(n, d);
    Ok(n)
}

/// Moves the data to `to` without mapping it anywhere (no `map_dev`, no `map_cpu`): the
/// next access faults and only installs a mapping. A no-op if the data is already there.
/// Refused on a lost page: there is no data to move, and a zero fill would hide the loss.
///
/// With `unpark_it`, a page parked on a peer keeps its parked copy there (as a read fault
/// does): PREFETCH and read-ahead fetch what the device is about to read. A pin does not:
/// a pinned page never leaves, so a backing copy would only hold the peer's frame.
fn prefetch(f: Fields, to: Target, unpark_it: bool, a: &mut Actions) -> Result<Fields, Refused> {
    let n = match (f.loc, to) {
        (Loc::Lost, _) => return Err(Refused::Lost),
        (Loc::None, Target::Host) => {
            a.alloc_host = true;
            a.copy = Copy::ZeroHost;
            Fields::HOST
        }
        (Loc::None, Target::Device(d)) => {
            a.alloc_frame = Some(d);
            a.copy = Copy::ZeroDev(d);
            Fields { loc: Loc::Device(d), dirty: true, ..Fields::NONE }
        }
        (Loc::Host, Target::Host) => f,
        (Loc::Host, Target::Device(d)) => host_to_dev(f, d, a),
        (Loc::Device(o), Target::Device(d)) if o == d => f,
        (Loc::Device(_), _) if f.pinned => return Err(Refused::Pinned),
        (Loc::Device(o), Target::Host) => dev_to_host(f, o, a),
        (Loc::Device(o), Target::Device(d)) if unpark_it && f.parked && f.dup & dev_bit(d) == 0 => unpark(f, o, d, a),
        (Loc::Device(o), Target::Device(d)) => dev_to_dev(f, o, d, a),
    };
    // A page moved to a device is mapped there too, so the device does not fault on it.
    if let (Target::Device(d), true) = (to, n.loc != f.loc) {
        a.map_dev = local_map(n, d);
    }
    Ok(n)
}

/// `Device(o)` -> `Lost`: release what `Free` would (owner frame, duplicates, the host page
/// of a clean page, every device mapping; the CPU maps nothing on a device), pin or not.
/// Nothing else has data to lose.
fn lose(f: Fields, a: &mut Actions) -> Fields {
    match f.loc {
        Loc::Device(_) => {
            release(f, a);
            Fields::LOST
        }
        _ => f,
    }
}

/// Computes the next state of a page and the actions that get it there.
pub fn transition(s: PageState, e: Event) -> Result<(PageState, Actions), Refused> {
    let f = s.unpack();
    let mut a = Actions::default();
    let n = match e {
        Event::CpuFault { write } => cpu_fault(f, write, &mut a)?,
        Event::DevFault { dev, write, read_mostly, accessed_by } => {
            check_dev(dev)?;
            dev_fault(f, dev, write, read_mostly, accessed_by, &mut a)?
        }
        Event::Prefetch { to } => {
            if let Target::Device(d) = to {
                check_dev(d)?;
            }
            prefetch(f, to, true, &mut a)?
        }
        Event::Pin { dev } => {
            check_dev(dev)?;
            if f.pinned && f.loc != Loc::Device(dev) {
                return Err(Refused::PinnedElsewhere);
            }
            // `prefetch` refuses a lost page (never pinned, so it gets past the check above).
            let mut n = prefetch(f, Target::Device(dev), false, &mut a)?;
            // A pinned page is its device's alone: other devices' duplicates (READ_MOSTLY,
            // or the backing copy a parked page left) go, so that their accesses are
            // refused as for any pinned page instead of reading a duplicate.
            collapse(&mut n, &mut a);
            Fields { pinned: true, ..n }
        }
        Event::Unpin => Fields { pinned: false, ..f },
        Event::DontNeed if f.pinned => return Err(Refused::Pinned),
        Event::DontNeed => release(f, &mut a),
        Event::Evict => match f.loc {
            Loc::Device(_) if f.pinned => return Err(Refused::Pinned),
            Loc::Device(o) => dev_to_host(f, o, &mut a),
            _ => f,
        },
        Event::DeviceGone { dev } => {
            check_dev(dev)?;
            match f.loc {
                // Like Evict, ignoring the pin.
                Loc::Device(o) if o == dev => dev_to_host(f, o, &mut a),
                _ => {
                    let b = dev_bit(dev);
                    let mut n = f;
                    a.unmap_dev = (f.dup | f.remote) & b;
                    a.free_dup_frames = f.dup & b;
                    n.dup &= !b;
                    n.remote &= !b;
                    n
                }
            }
        }
        Event::Free => release(f, &mut a),
        Event::WriteBack => write_back(f, &mut a),
        Event::EvictTo { dev } => {
            check_dev(dev)?;
            match f.loc {
                Loc::Device(_) if f.pinned => return Err(Refused::Pinned),
                // The peer's duplicate (left by `unpark`) takes over: no copy.
                Loc::Device(o) if o != dev && f.dup & dev_bit(dev) != 0 => promote(f, o, dev, &mut a),
                // Parked on the peer: nobody maps it until the next fault.
                Loc::Device(o) if o != dev => Fields { parked: true, ..dev_to_dev(f, o, dev, &mut a) },
                _ => f,
            }
        }
        Event::Lose => lose(f, &mut a),
    };
    // The owner using the page itself ends its parking.
    let n = match e {
        Event::DevFault { dev, .. } | Event::Pin { dev } | Event::Prefetch { to: Target::Device(dev) }
            if n.loc == Loc::Device(dev) =>
        {
            Fields { parked: false, ..n }
        }
        _ => n,
    };
    Ok((n.pack(), a))
}

/// A pure function of a page's state (a transition for one event), for many pages in
/// turn: a page in the state of the page asked about before it reuses that answer. A
/// block's pages are mostly in one state, and under TCG working a transition out again
/// for each of them was a measurable share of the executor's CPU (PREFETCH advice,
/// read-ahead, density prefetch).
pub struct ByState<T> {
    last: Option<(PageState, T)>,
}

impl<T: core::marker::Copy> ByState<T> {
    pub const fn new() -> Self {
        ByState { last: None }
    }

    /// `f(s)`, where `f` must be the same pure function of the state at every call: it is
    /// called only when `s` differs from the state of the call before.
    pub fn get(&mut self, s: PageState, f: impl FnOnce(PageState) -> T) -> T {
        match self.last {
            Some((ls, t)) if ls == s => t,
            _ => {
                let t = f(s);
                self.last = Some((s, t));
                t
            }
        }
    }
}

impl<T: core::marker::Copy> Default for ByState<T> {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn by_state_reuses_the_answer_for_a_repeated_state_only() {
        let (a, b) = (PageState::EMPTY, go(PageState::EMPTY, Event::CpuFault { write: true }).0);
        assert_ne!(a, b);
        let e = Event::Prefetch { to: Target::Device(1) };
        let mut memo = ByState::new();
        let mut calls = 0;
        for s in [a, a, b, b, b, a, b] {
            let got = memo.get(s, |s| {
                calls += 1;
                transition(s, e)
            });
            assert_eq!(got, transition(s, e));
        }
        // One call per run of equal states: a, b, a, b.
        assert_eq!(calls, 4);
    }

    fn go(s: PageState, e: Event) -> (PageState, Actions) {
        match transition(s, e) {
            Ok(r) => r,
            Err(r) => panic!("{e:?} on {s:?} refused: {r:?}"),
        }
    }

    fn dev_fault(dev: u8, write: bool) -> Event {
        Event::DevFault { dev, write, read_mostly: false, accessed_by: false }
    }

    #[test]
    fn sysmem_query_words() {
        assert_eq!(sysmem_query_word(SysLoc::None, false), Q_LOC_NONE);
        assert_eq!(sysmem_query_word(SysLoc::Host, false), Q_LOC_HOST | Q_CPU_MAPPED);
        assert_eq!(sysmem_query_word(SysLoc::Host, true), Q_LOC_HOST | Q_CPU_MAPPED | Q_REMOTE);
        assert_eq!(sysmem_query_word(SysLoc::Device(3), false), Q_LOC_DEVICE | (3 << 8));
        assert_eq!(sysmem_query_word(SysLoc::Device(3), true), Q_LOC_DEVICE | (3 << 8));
        // Nothing is mapped remotely where the process maps nothing.
        assert_eq!(sysmem_query_word(SysLoc::None, true), Q_LOC_NONE);
        // A host page of a GMEM region that the CPU maps reads the same way.
        let host = PageState::EMPTY;
        let (h, _) = go(host, Event::CpuFault { write: true });
        assert_eq!(h.query_word() & (0xff | Q_CPU_MAPPED), sysmem_query_word(SysLoc::Host, false));
    }

    fn read_mostly(dev: u8) -> Event {
        Event::DevFault { dev, write: false, read_mostly: true, accessed_by: false }
    }

    #[test]
    fn first_cpu_touch_zero_fills_host() {
        let (s, a) = go(PageState::EMPTY, Event::CpuFault { write: false });
        assert_eq!(s.loc(), Loc::Host);
        assert!(s.cpu_mapped() && s.host_valid() && !s.dirty());
        assert_eq!(a, Actions { alloc_host: true, copy: Copy::ZeroHost, map_cpu: true, ..Actions::default() });
        assert_eq!(s.query_word(), Q_LOC_HOST | Q_CPU_MAPPED);
    }

    #[test]
    fn first_device_touch_zero_fills_frame() {
        let (s, a) = go(PageState::EMPTY, dev_fault(3, false));
        assert_eq!(s.loc(), Loc::Device(3));
        assert!(s.dirty() && !s.host_valid());
        assert_eq!(a.alloc_frame, Some(3));
        assert_eq!(a.copy, Copy::ZeroDev(3));
        assert_eq!(a.map_dev, Some(DevMap { dev: 3, writable: true, remote_host: false }));
        assert_eq!(s.query_word(), Q_LOC_DEVICE | (3 << 8) | Q_DIRTY);
    }

    const RO: fn(u8) -> Option<DevMap> = |dev| Some(DevMap { dev, writable: false, remote_host: false });
    const RW: fn(u8) -> Option<DevMap> = |dev| Some(DevMap { dev, writable: true, remote_host: false });

    /// A host page the CPU has written (and still maps).
    fn host_page() -> PageState {
        go(PageState::EMPTY, Event::CpuFault { write: true }).0
    }

    #[test]
    fn read_migration_keeps_a_clean_host_copy() {
        let (s, a) = go(host_page(), dev_fault(1, false));
        assert_eq!(s.loc(), Loc::Device(1));
        assert!(s.host_valid() && !s.dirty() && !s.cpu_mapped());
        assert_eq!(
            a,
            Actions { alloc_frame: Some(1), copy: Copy::H2D(1), zap_cpu: true, map_dev: RO(1), ..Actions::default() }
        );
        assert_eq!(s.query_word(), Q_LOC_DEVICE | (1 << 8));
        // Leaving the device needs no copy: the host page is current.
        let (h, a) = go(s, Event::CpuFault { write: false });
        assert_eq!(h.loc(), Loc::Host);
        assert_eq!(a, Actions { unmap_dev: 1 << 1, free_frame: Some(1), map_cpu: true, ..Actions::default() });
    }

    #[test]
    fn write_fault_on_clean_page_dirties_it_and_drops_the_host_copy() {
        let (s, _) = go(host_page(), dev_fault(1, false));
        let (w, a) = go(s, dev_fault(1, true));
        assert_eq!(w.loc(), Loc::Device(1));
        assert!(w.dirty() && !w.host_valid());
        assert_eq!(a, Actions { free_host: true, map_dev: RW(1), ..Actions::default() });
        // A read fault on the dirty page maps it writable again (nothing to keep in sync).
        let (_, a) = go(w, dev_fault(1, false));
        assert_eq!(a.map_dev, RW(1));
        // Leaving a dirty page copies it home.
        let (h, a) = go(w, Event::CpuFault { write: false });
        assert_eq!(h.loc(), Loc::Host);
        assert_eq!((a.alloc_host, a.copy, a.free_frame), (true, Copy::D2H(1), Some(1)));
    }

    #[test]
    fn write_migration_from_host_frees_the_host_page() {
        let (s, a) = go(host_page(), dev_fault(2, true));
        assert!(s.dirty() && !s.host_valid());
        assert!(a.zap_cpu && a.free_host);
        assert_eq!((a.copy, a.map_dev), (Copy::H2D(2), RW(2)));
        let (z, a) = go(PageState::EMPTY, dev_fault(2, false));
        assert!(z.dirty() && !z.host_valid(), "nothing on the host to keep");
        assert_eq!(a.map_dev, RW(2));
    }

    #[test]
    fn clean_shortcut_for_evict_prefetch_and_device_gone() {
        let (s, _) = go(host_page(), dev_fault(3, false));
        let shortcut = Actions { unmap_dev: 1 << 3, free_frame: Some(3), ..Actions::default() };
        for e in [Event::Evict, Event::Prefetch { to: Target::Host }, Event::DeviceGone { dev: 3 }] {
            let (h, a) = go(s, e);
            assert_eq!((h.loc(), h.host_valid(), h.cpu_mapped()), (Loc::Host, true, false));
            assert_eq!(a, shortcut, "{e:?}");
        }
        // A clean pinned page keeps its pin; DeviceGone still needs no copy.
        let (p, _) = go(s, Event::Pin { dev: 3 });
        assert!(p.pinned() && !p.dirty() && p.host_valid());
        assert_eq!(transition(p, Event::Evict), Err(Refused::Pinned));
        assert_eq!(go(p, Event::DeviceGone { dev: 3 }).1, shortcut);
    }

    #[test]
    fn prefetch_and_pin_from_host_are_clean_and_read_only() {
        let (s, a) = go(host_page(), Event::Prefetch { to: Target::Device(4) });
        assert!(!s.dirty() && s.host_valid());
        assert_eq!(a.map_dev, RO(4));
        assert!(!a.free_host && a.zap_cpu);
        let (p, a) = go(host_page(), Event::Pin { dev: 5 });
        assert!(p.pinned() && !p.dirty() && p.host_valid());
        assert_eq!(a.map_dev, RO(5));
        assert!(!a.free_host);
    }

    #[test]
    fn device_to_device_keeps_the_clean_status() {
        let (s, _) = go(host_page(), dev_fault(0, false));
        let (t, a) = go(s, dev_fault(1, false));
        assert!(t.loc() == Loc::Device(1) && t.host_valid() && !t.dirty());
        assert_eq!((a.copy, a.map_dev, a.free_host), (Copy::D2D { from: 0, to: 1 }, RO(1), false));
        // A write migration of a clean page drops the host copy.
        let (w, a) = go(s, dev_fault(1, true));
        assert!(w.dirty() && !w.host_valid());
        assert_eq!((a.copy, a.map_dev, a.free_host), (Copy::D2D { from: 0, to: 1 }, RW(1), true));
        // A dirty page stays dirty.
        let (d, _) = go(PageState::EMPTY, dev_fault(0, true));
        let (t, a) = go(d, dev_fault(1, false));
        assert!(t.dirty() && !t.host_valid());
        assert_eq!(a.map_dev, RW(1));
    }

    #[test]
    fn write_back_cleans_a_dirty_page_and_revokes_its_mapping() {
        let (d, _) = go(PageState::EMPTY, Event::Pin { dev: 6 });
        let (c, a) = go(d, Event::WriteBack);
        assert_eq!((c.loc(), c.pinned(), c.dirty(), c.host_valid()), (Loc::Device(6), true, false, true));
        assert_eq!(a, Actions { alloc_host: true, copy: Copy::D2H(6), unmap_dev: 1 << 6, ..Actions::default() });
        // The next access maps read-only; a write dirties it again.
        assert_eq!(go(c, dev_fault(6, false)).1.map_dev, RO(6));
        assert!(go(c, dev_fault(6, true)).0.dirty());
        // No-op on a clean page, on the host and on an empty page.
        for s in [c, host_page(), PageState::EMPTY] {
            assert_eq!(go(s, Event::WriteBack), (s, Actions::default()));
        }
    }

    #[test]
    fn write_back_keeps_duplicates() {
        let (d, _) = go(PageState::EMPTY, dev_fault(0, true));
        let (d, _) = go(d, read_mostly(1));
        let (c, a) = go(d, Event::WriteBack);
        assert_eq!(c.dup_mask(), 1 << 1);
        assert_eq!(a.free_dup_frames, 0);
        assert_eq!(go(c, dev_fault(0, false)).1.map_dev, RO(0));
    }

    #[test]
    fn a_parked_page_read_back_keeps_its_peer_copy_and_goes_back_without_one() {
        let (d, _) = go(PageState::EMPTY, dev_fault(0, true));
        let (p, _) = go(d, Event::EvictTo { dev: 2 });
        // Read back: copied, the peer's frame stays as a read-only duplicate.
        let (b, a) = go(p, dev_fault(0, false));
        assert_eq!((b.loc(), b.dirty(), b.dup_mask(), b.parked()), (Loc::Device(0), true, 1 << 2, false));
        assert_eq!(
            a,
            Actions {
                alloc_frame: Some(0),
                copy: Copy::D2D { from: 2, to: 0 },
                unmap_dev: 1 << 2,
                owner_to_dup: Some(2),
                map_dev: RO(0),
                ..Actions::default()
            }
        );
        // Out again: the duplicate is promoted, nothing is copied.
        let (q, a) = go(b, Event::EvictTo { dev: 2 });
        assert_eq!((q.loc(), q.dirty(), q.dup_mask(), q.parked()), (Loc::Device(2), true, 0, true));
        assert_eq!(
            a,
            Actions {
                unmap_dev: (1 << 0) | (1 << 2),
                free_frame: Some(0),
                dup_to_owner: Some(2),
                ..Actions::default()
            }
        );
        // A write after the read drops the peer copy; a write fault on the parked page
        // moves it without keeping one.
        let (w, a) = go(b, dev_fault(0, true));
        assert_eq!((w.dup_mask(), a.free_dup_frames, a.map_dev), (0, 1 << 2, RW(0)));
        let (w, a) = go(p, dev_fault(0, true));
        assert_eq!((w.dup_mask(), a.owner_to_dup, a.free_frame), (0, None, Some(2)));
        // A pin of the page read back drops the peer copy (no other device reads a pinned
        // page), and the peer's access is then refused.
        let (q, a) = go(b, Event::Pin { dev: 0 });
        assert_eq!((q.dup_mask(), a.free_dup_frames, a.unmap_dev & (1 << 2)), (0, 1 << 2, 1 << 2));
        assert_eq!(transition(q, dev_fault(2, false)), Err(Refused::PinnedElsewhere));
        // PREFETCH (and read-ahead) keeps the peer copy too; a pin does not.
        let (f, a) = go(p, Event::Prefetch { to: Target::Device(0) });
        assert_eq!((f.loc(), f.dup_mask(), a.owner_to_dup, a.map_dev), (Loc::Device(0), 1 << 2, Some(2), RO(0)));
        let (f, a) = go(p, Event::Pin { dev: 0 });
        assert_eq!((f.loc(), f.dup_mask(), a.owner_to_dup, a.free_frame), (Loc::Device(0), 0, None, Some(2)));
        // The peer using the page itself ends the parking (then a read elsewhere moves it).
        let (u, _) = go(p, dev_fault(2, false));
        assert!(!u.parked());
        assert_eq!(go(u, dev_fault(0, false)).1.owner_to_dup, None);
    }

    #[test]
    fn evict_to_parks_the_page_on_a_peer_unmapped() {
        let (d, _) = go(PageState::EMPTY, dev_fault(0, true));
        let (d, _) = go(d, read_mostly(1));
        let (p, a) = go(d, Event::EvictTo { dev: 2 });
        assert_eq!((p.loc(), p.dirty(), p.dup_mask(), p.parked()), (Loc::Device(2), true, 0, true));
        assert_eq!(
            a,
            Actions {
                alloc_frame: Some(2),
                copy: Copy::D2D { from: 0, to: 2 },
                unmap_dev: (1 << 0) | (1 << 1),
                free_frame: Some(0),
                free_dup_frames: 1 << 1,
                ..Actions::default()
            }
        );
        // Clean pages stay clean (and keep the host page).
        let (c, _) = go(host_page(), dev_fault(1, false));
        let (p, a) = go(c, Event::EvictTo { dev: 3 });
        assert!(p.loc() == Loc::Device(3) && p.host_valid() && !p.dirty());
        assert!(a.map_dev.is_none() && !a.free_host);
        // No-ops, refusals.
        for s in [PageState::EMPTY, host_page(), p] {
            assert_eq!(go(s, Event::EvictTo { dev: 3 }), (s, Actions::default()));
        }
        let (pin, _) = go(c, Event::Pin { dev: 1 });
        assert_eq!(transition(pin, Event::EvictTo { dev: 3 }), Err(Refused::Pinned));
        assert_eq!(transition(c, Event::EvictTo { dev: 16 }), Err(Refused::BadDevice));
    }

    #[test]
    fn read_mostly_duplicates_then_write_collapses() {
        let (s, _) = go(PageState::EMPTY, Event::CpuFault { write: false });
        let (s, a) = go(s, read_mostly(2));
        assert_eq!(s.loc(), Loc::Host);
        assert_eq!(s.dup_mask(), 1 << 2);
        assert_eq!(a.copy, Copy::H2D(2));
        assert!(a.zap_cpu, "first duplicate revokes the (maybe writable) CPU mapping");
        assert_eq!(a.map_dev, Some(DevMap { dev: 2, writable: false, remote_host: false }));
        let (s, _) = go(s, read_mostly(5));
        assert_eq!(s.dup_mask(), (1 << 2) | (1 << 5));
        assert_ne!(s.query_word() & Q_DUP, 0);
        let (s, a) = go(s, Event::CpuFault { write: true });
        assert_eq!(s.dup_mask(), 0);
        assert_eq!(a.free_dup_frames, (1 << 2) | (1 << 5));
        assert_eq!(a.unmap_dev, (1 << 2) | (1 << 5));
    }

    #[test]
    fn duplicate_of_device_page_downgrades_owner() {
        let (s, _) = go(PageState::EMPTY, dev_fault(0, true));
        let (s, a) = go(s, read_mostly(1));
        assert_eq!(s.loc(), Loc::Device(0));
        assert_eq!(a.copy, Copy::D2D { from: 0, to: 1 });
        assert_eq!(a.unmap_dev, 1, "owner's writable PTE must go");
        let (_, a) = go(s, dev_fault(0, false));
        assert_eq!(a.map_dev, Some(DevMap { dev: 0, writable: false, remote_host: false }));
        // A write by the duplicate holder makes it the owner and drops every duplicate.
        let (s, a) = go(s, dev_fault(1, true));
        assert_eq!(s.loc(), Loc::Device(1));
        assert_eq!(s.dup_mask(), 0);
        assert_eq!(a.alloc_frame, Some(1));
        assert_eq!(a.free_frame, Some(0));
        assert_eq!(a.free_dup_frames, 1 << 1);
    }

    #[test]
    fn accessed_by_maps_host_remotely() {
        let e = Event::DevFault { dev: 4, write: true, read_mostly: false, accessed_by: true };
        let (s, a) = go(PageState::EMPTY, e);
        assert_eq!(s.loc(), Loc::Host);
        assert_eq!(s.remote_mask(), 1 << 4);
        assert_eq!(a.map_dev, Some(DevMap { dev: 4, writable: true, remote_host: true }));
        assert_eq!(s.query_word(), Q_LOC_HOST | Q_REMOTE);
        // CPU writes keep the remote mapping.
        let (s, a) = go(s, Event::CpuFault { write: true });
        assert_eq!(s.remote_mask(), 1 << 4);
        assert_eq!(a.unmap_dev, 0);
        // Migration to another device revokes it.
        let (s, a) = go(s, dev_fault(6, true));
        assert_eq!(s.remote_mask(), 0);
        assert_eq!(a.unmap_dev, 1 << 4);
    }

    #[test]
    fn pin_rules() {
        let (s, a) = go(PageState::EMPTY, Event::Pin { dev: 7 });
        assert_eq!((s.loc(), s.pinned()), (Loc::Device(7), true));
        assert_eq!(a.copy, Copy::ZeroDev(7));
        assert_eq!(a.map_dev, Some(DevMap { dev: 7, writable: true, remote_host: false }));
        assert_eq!(transition(s, Event::Evict), Err(Refused::Pinned));
        assert_eq!(transition(s, Event::DontNeed), Err(Refused::Pinned));
        assert_eq!(transition(s, Event::CpuFault { write: false }), Err(Refused::Pinned));
        assert_eq!(transition(s, dev_fault(2, false)), Err(Refused::PinnedElsewhere));
        assert_eq!(transition(s, Event::Pin { dev: 2 }), Err(Refused::PinnedElsewhere));
        assert_eq!(transition(s, Event::Prefetch { to: Target::Host }), Err(Refused::Pinned));
        assert_eq!(s.query_word(), Q_LOC_DEVICE | (7 << 8) | Q_PINNED | Q_DIRTY);
        let (u, a) = go(s, Event::Unpin);
        assert!(!u.pinned());
        assert_eq!(a, Actions::default());
        // DeviceGone ignores the pin and keeps the data.
        let (g, a) = go(s, Event::DeviceGone { dev: 7 });
        assert_eq!((g.loc(), g.pinned()), (Loc::Host, false));
        assert_eq!(a.copy, Copy::D2H(7));
    }

    #[test]
    fn bad_device_is_refused() {
        for e in [
            dev_fault(16, false),
            Event::Pin { dev: 200 },
            Event::Prefetch { to: Target::Device(16) },
            Event::DeviceGone { dev: 255 },
            Event::EvictTo { dev: 16 },
        ] {
            assert_eq!(transition(PageState::EMPTY, e), Err(Refused::BadDevice), "{e:?}");
        }
    }

    #[test]
    fn prefetch_to_a_device_maps_it_there() {
        let (h, _) = go(PageState::EMPTY, Event::CpuFault { write: true });
        let (s, a) = go(h, Event::Prefetch { to: Target::Device(2) });
        assert_eq!(s.loc(), Loc::Device(2));
        assert_eq!(a.map_dev, RO(2), "clean: read-only until the device writes");
        assert!(a.zap_cpu && !a.map_cpu);
        let (_, p) = go(PageState::EMPTY, Event::Pin { dev: 1 });
        assert_eq!(p.map_dev, Some(DevMap { dev: 1, writable: true, remote_host: false }));
    }

    #[test]
    fn prefetch_to_current_place_is_noop() {
        let (s, _) = go(PageState::EMPTY, dev_fault(9, true));
        assert_eq!(go(s, Event::Prefetch { to: Target::Device(9) }), (s, Actions::default()));
        let (h, a) = go(s, Event::Prefetch { to: Target::Host });
        assert_eq!(h.loc(), Loc::Host);
        assert!(!a.map_cpu && !h.cpu_mapped());
        assert_eq!(go(h, Event::Prefetch { to: Target::Host }), (h, Actions::default()));
    }

    #[test]
    fn free_releases_everything() {
        let (s, _) = go(PageState::EMPTY, Event::CpuFault { write: false });
        let (s, _) = go(s, read_mostly(1));
        let e = Event::DevFault { dev: 2, write: false, read_mostly: false, accessed_by: true };
        let (s, _) = go(s, e);
        let (s, a) = go(s, Event::Free);
        assert_eq!(s, PageState::EMPTY);
        assert!(a.free_host);
        assert_eq!(a.free_dup_frames, 1 << 1);
        assert_eq!(a.unmap_dev, (1 << 1) | (1 << 2));
    }

    #[test]
    fn host_packing_holds_all_sixteen_devices() {
        // Every device either a duplicate (even ids) or a remote mapper (odd ids).
        let f = Fields { dup: 0x5555, remote: 0xaaaa, cpu_mapped: true, ..Fields::HOST };
        let s = f.pack();
        assert_eq!(s.unpack(), f);
        assert_eq!(PageState::from_bits(s.bits()), s);
        let d = Fields { loc: Loc::Device(15), dirty: true, dup: 0x7ffe, pinned: true, ..Fields::NONE };
        let d = d.pack();
        assert_eq!((d.loc(), d.dup_mask(), d.pinned()), (Loc::Device(15), 0x7ffe, true));
    }

    #[test]
    fn garbage_bits_decode_without_panic() {
        for b in [u32::MAX, 0xc000_0000, 0x7fff_ffff, 0xbfff_ffff] {
            let s = PageState::from_bits(b);
            let w = s.query_word();
            assert!(w & 0xff <= Q_LOC_LOST, "{b:#x}");
            assert_eq!(s.dup_mask() & s.remote_mask(), 0);
        }
    }

    #[test]
    fn accessors_agree_with_unpack() {
        // Every tag, with low bits from a simple generator (garbage included): the direct
        // accessors give exactly the fields `unpack` decodes.
        let mut x: u32 = 0x9e37_79b9;
        for k in 0..40_000u32 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let b = ((k % 4) << TAG_SHIFT) | (x & ((1 << TAG_SHIFT) - 1));
            // A host state with any disjoint duplicate and remote masks round-trips.
            let (dup, remote) = ((x & 0xffff) as u16, (x >> 16) as u16);
            let f = Fields { dup: dup & !remote, remote, cpu_mapped: k % 2 == 0, ..Fields::HOST };
            assert_eq!(f.pack().unpack(), f, "{x:#x}");
            for b in [b, b & !H_TRITS, b & (TAG_SHIFT_MASK | 0xff)] {
                let s = PageState::from_bits(b);
                let f = s.unpack();
                assert_eq!(s.loc(), f.loc, "{b:#x}");
                assert_eq!(s.pinned(), f.pinned, "{b:#x}");
                assert_eq!(s.dirty(), f.dirty, "{b:#x}");
                assert_eq!(s.host_valid(), f.host_valid, "{b:#x}");
                assert_eq!(s.cpu_mapped(), f.cpu_mapped, "{b:#x}");
                assert_eq!(s.parked(), f.parked, "{b:#x}");
            }
        }
    }

    /// The tag bits of a packed state.
    const TAG_SHIFT_MASK: u32 = 3 << TAG_SHIFT;

    /// The one lost state, as `pack` writes it.
    fn lost() -> PageState {
        Fields::LOST.pack()
    }

    #[test]
    fn lost_packs_as_tag_3_alone_and_any_tag_3_decodes_normalised() {
        assert_eq!(lost().bits(), 3 << 30);
        // Fields that cannot exist on a lost page are dropped when packing.
        let f = Fields { dirty: true, pinned: true, dup: 0xffff, remote: 1, ..Fields::LOST };
        assert_eq!(f.pack(), lost());
        for b in [0xc000_0000, u32::MAX, 0xc07f_ffff, 0xc400_0001, 0xffff_0000] {
            let s = PageState::from_bits(b);
            assert_eq!(s.unpack(), Fields::LOST, "{b:#x}");
            assert_eq!(s.query_word(), Q_LOC_LOST, "{b:#x}");
            // Any transition re-packs it: tag 3, nothing else.
            assert_eq!(go(s, Event::Unpin).0.bits(), 3 << 30, "{b:#x}");
        }
    }

    #[test]
    fn losing_a_dirty_page_with_duplicates_or_a_pinned_one_releases_everything() {
        let (s, _) = go(PageState::EMPTY, dev_fault(2, true));
        let (s, _) = go(s, read_mostly(0));
        let (s, _) = go(s, read_mostly(5));
        assert_eq!(
            (s.loc(), s.dirty(), s.host_valid(), s.dup_mask()),
            (Loc::Device(2), true, false, (1 << 0) | (1 << 5))
        );
        let (l, a) = go(s, Event::Lose);
        assert_eq!(l, lost());
        assert_eq!(l.query_word(), Q_LOC_LOST);
        assert_eq!(
            a,
            Actions {
                unmap_dev: (1 << 2) | (1 << 0) | (1 << 5),
                free_frame: Some(2),
                free_dup_frames: (1 << 0) | (1 << 5),
                ..Actions::default()
            }
        );
        // Pinning drops the duplicates; losing the pinned page releases its frame.
        let (p, _) = go(s, Event::Pin { dev: 2 });
        assert_eq!((p.pinned(), p.dup_mask()), (true, 0));
        let (l, a) = go(p, Event::Lose);
        assert_eq!(l, lost());
        assert_eq!(a, Actions { unmap_dev: 1 << 2, free_frame: Some(2), ..Actions::default() });
    }

    #[test]
    fn losing_a_clean_page_frees_its_host_page_too() {
        let (c, _) = go(host_page(), dev_fault(1, false));
        assert!(c.host_valid() && !c.dirty());
        let (l, a) = go(c, Event::Lose);
        assert_eq!(l, lost());
        assert_eq!(a, Actions { unmap_dev: 1 << 1, free_frame: Some(1), free_host: true, ..Actions::default() });
    }

    #[test]
    fn lose_is_a_no_op_off_devices() {
        // A host page with a duplicate on 1 and a remote mapping on 2 keeps all of it.
        let (h, _) = go(host_page(), read_mostly(1));
        let e = Event::DevFault { dev: 2, write: false, read_mostly: false, accessed_by: true };
        let (h, _) = go(h, e);
        assert_eq!((h.dup_mask(), h.remote_mask()), (1 << 1, 1 << 2));
        for s in [PageState::EMPTY, host_page(), h, lost()] {
            assert_eq!(go(s, Event::Lose), (s, Actions::default()), "{s:?}");
        }
    }

    #[test]
    fn lost_page_refuses_every_access() {
        let s = lost();
        for e in [
            Event::CpuFault { write: false },
            Event::CpuFault { write: true },
            dev_fault(0, false),
            dev_fault(15, true),
            read_mostly(3),
            Event::DevFault { dev: 2, write: true, read_mostly: false, accessed_by: true },
            Event::DevFault { dev: 2, write: false, read_mostly: true, accessed_by: true },
            Event::Prefetch { to: Target::Host },
            Event::Prefetch { to: Target::Device(4) },
            Event::Pin { dev: 1 },
        ] {
            assert_eq!(transition(s, e), Err(Refused::Lost), "{e:?}");
        }
        // A bad device id is still reported as such.
        assert_eq!(transition(s, dev_fault(16, false)), Err(Refused::BadDevice));
        assert_eq!(transition(s, Event::Pin { dev: 16 }), Err(Refused::BadDevice));
    }

    #[test]
    fn lost_page_ignores_housekeeping_until_discarded() {
        let s = lost();
        for e in [
            Event::Unpin,
            Event::Evict,
            Event::EvictTo { dev: 1 },
            Event::WriteBack,
            Event::DeviceGone { dev: 0 },
            Event::Lose,
        ] {
            assert_eq!(go(s, e), (s, Actions::default()), "{e:?}");
        }
        // Nothing to release: discarding only forgets the loss, and the page reads zeros.
        for e in [Event::DontNeed, Event::Free] {
            assert_eq!(go(s, e), (PageState::EMPTY, Actions::default()), "{e:?}");
        }
    }
}
