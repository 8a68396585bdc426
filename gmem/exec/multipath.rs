// SPDX-License-Identifier: GPL-2.0
//! Multi-path host-to-device copies: part of one large host-to-device copy of a batch goes
//! through an idle peer device of the same driver instead of the destination's own host
//! link, when the link bandwidths the drivers reported (`gmem_dev_set_links`) say that
//! finishes sooner (`policy/src/paths.rs` decides how much).
//!
//! The route has two stages per chunk of `paths::CHUNK_PAGES` pages: stage 1 copies host
//! pages into staging frames of the peer (a `GMEM_COPY_H2D` of the peer, on its channel 0),
//! stage 2 copies the staging frames on to the destination's frames (a `GMEM_COPY_D2D` of
//! the peer, on its channel 1). The executor starts every direct part and every stage 1 at
//! once, then starts each chunk's stage 2 as soon as that chunk's stage 1 completed, so the
//! two links of the peer and the destination's host link all carry data together
//! (`migrate::copy_batch`).
//!
//! **Staging frames** are frames of the peer's pool with no owner (eviction never picks a
//! frame without an owner), charged to the owner's dmem cgroup on the peer like any other
//! frame used on its behalf. Only frames above the peer's high watermark, less those
//! promised to eviction batches that park there, are used (as seen when the route is
//! chosen and again when its frames are taken), so a route does not make the peer evict.
//! They are taken only once the batch holds a callback section of the peer and has seen it
//! alive, and freed (by [`Staging`]'s drop) after every copy that names them completed and
//! before that section closes: so unregistration of the peer, which waits for its sections
//! (`Device::quiesce`) before it checks that no frame is used, never sees one.

use crate::abi::GmemCopy;
use crate::obj::device::{DevStats, Device, DeviceOps};
use crate::obj::devices;
use crate::obj::dmem::Charge;
use crate::obj::space::Space;
use crate::obj::tune;
use crate::policy::paths::{self, CHUNK_PAGES};
use core::sync::atomic::Ordering::Relaxed;
use kernel::{prelude::*, sync::Arc};

/// Frames `peer` has free above its high watermark, less what eviction batches were
/// promised to park there (a snapshot): what staging may take.
fn room(peer: &Device) -> usize {
    let free = peer.frames_free_hint().saturating_sub(peer.high()).saturating_sub(peer.promised());
    usize::try_from(free).unwrap_or(usize::MAX)
}

/// Chooses the peer (if any) through which to send part of a copy of `n` host pages to
/// `dst`, and how many pages: the registered device of `dst`'s driver with two copy
/// channels or more that the policy gives the largest share. Nothing is reserved yet.
pub(crate) fn pick(dst: &Device, n: usize) -> Option<(Arc<Device>, usize)> {
    if !tune::MULTIPATH.load(Relaxed) || n < 2 * CHUNK_PAGES {
        return None;
    }
    let to = dst.links();
    if to.h2d == 0 {
        return None;
    }
    let mut best: Option<(Arc<Device>, usize)> = None;
    for peer in devices::all().into_iter() {
        if peer.id == dst.id || !peer.alive() || !peer.same_driver(dst) {
            continue;
        }
        if peer.ops().map_or(0, |o| o.channels()) < 2 {
            continue;
        }
        let via = paths::via_peer(n, to, peer.links(), room(&peer));
        if via > best.as_ref().map_or(0, |b| b.1) {
            best = Some((peer, via));
        }
    }
    best
}

/// The staging frames of one route and the entries of its two stages.
///
/// # Invariants
/// `frames` are allocated on `peer` with no owner, one per entry of `stage1` and `stage2`
/// (entry `k` of both names frame `frames[k]`), and are freed when this is dropped.
pub(crate) struct Staging {
    peer: Arc<Device>,
    frames: KVec<u32>,
    pub(crate) stage1: KVec<GmemCopy>,
    pub(crate) stage2: KVec<GmemCopy>,
}

impl Staging {
    /// Staging for the last pages of `pages` (the entries of a host-to-device copy to
    /// another device): `want` of them or fewer, as many whole chunks as the peer has free
    /// frames for and the owner's dmem cgroup allows; `None` for none. The caller holds a
    /// callback section of `peer`.
    pub(crate) fn new(peer: &Arc<Device>, pages: &[GmemCopy], want: usize, space: &Space) -> Result<Option<Staging>> {
        if !peer.alive() {
            return Ok(None);
        }
        // The room again, now: another route (a second lane's) may have taken some of what
        // `pick` saw. (Still a snapshot: two routes allocating at the same instant can take
        // a little more than the room between them, at most one batch's worth each.)
        let want = core::cmp::min(core::cmp::min(want, pages.len()), room(peer));
        if want < CHUNK_PAGES {
            return Ok(None);
        }
        let mut charges: KVec<Charge> = KVec::new();
        peer.dmem.charge(space.mm(), want, &mut charges)?;
        let mut frames = KVec::new();
        peer.alloc_frames(&mut charges, &mut frames)?;
        // INVARIANT: from here on every frame in `frames` is freed on drop.
        let mut s = Staging { peer: peer.clone(), frames, stage1: KVec::new(), stage2: KVec::new() };
        // Whole chunks only; the rest goes back now.
        let keep = s.frames.len() / CHUNK_PAGES * CHUNK_PAGES;
        while s.frames.len() > keep {
            if let Some(f) = s.frames.pop() {
                s.peer.free_frame(f);
            }
        }
        if keep == 0 {
            return Ok(None);
        }
        s.stage1.reserve(keep, GFP_KERNEL)?;
        s.stage2.reserve(keep, GFP_KERNEL)?;
        let tail = pages.get(pages.len() - keep..).ok_or(EINVAL)?;
        for (c, &f) in tail.iter().zip(s.frames.iter()) {
            let f = u64::from(f);
            s.stage1.push(GmemCopy { host: c.host, frame: f, peer_frame: 0 }, GFP_NOWAIT)?;
            s.stage2.push(GmemCopy { host: core::ptr::null_mut(), frame: f, peer_frame: c.frame }, GFP_NOWAIT)?;
        }
        Ok(Some(s))
    }

    /// How many pages go through the peer.
    pub(crate) fn len(&self) -> usize {
        self.frames.len()
    }

    pub(crate) fn peer(&self) -> &Arc<Device> {
        &self.peer
    }

    /// Counts a route on the destination: `direct` pages went over its own link.
    pub(crate) fn count(&self, dst: &Device, direct: usize) {
        DevStats::add(&dst.stats.mp_batches, 1);
        DevStats::add(&dst.stats.mp_direct, direct as u64);
        DevStats::add(&dst.stats.mp_via_peer, self.len() as u64);
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        for &f in self.frames.iter() {
            self.peer.free_frame(f);
        }
    }
}
