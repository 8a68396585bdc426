// SPDX-License-Identifier: GPL-2.0
//! Fault-driven prefetch: density within a 2 MiB block (like NVIDIA UVM) and a stride
//! detector.
//!
//! A block is [`BLOCK_PAGES`] pages; page sets are bitmaps of 8 `u64` words (page `i` is bit
//! `i % 64` of word `i / 64`). [`density`] considers, for every faulted page, the aligned
//! power-of-two subregions containing it, from 2 pages up to the whole block. A subregion is
//! "dense" when more than `threshold_pct` percent of its valid pages are resident or
//! faulted; the largest dense subregion of each faulted page is fetched whole. Because the
//! subregions of a page are nested, that union equals the union of all dense subregions
//! that contain a faulted page. When `max_pages` cuts the result short, pages of smaller
//! subregions (closer to the faults) win, then lower page numbers.
//!
//! Invariants: the result is a subset of `valid`, disjoint from `resident | faulted`, and
//! has at most `max_pages` pages; with `threshold_pct == 100` it is empty. Pure, no
//! allocation, bounded work (511 subregions).
//!
//! [`read_ahead`] decides when a device fault starts an asynchronous fetch of the *next*
//! block: once the faulted block is wholly resident, the device is streaming through it.
//!
//! [`sequential`] is the CPU's fault-around for a reader walking a block in order: the rest
//! of the block at once, instead of the density rule's doubling one fault at a time.
//!
//! [`Stride`] remembers the last three fault page numbers and reports a constant, non-zero
//! stride between them; differences that do not fit an `i64` never count as a stride.
//!
//! [`Accuracy`] is a device's running estimate of how much of what it prefetched the device
//! then used: eviction spares untouched prefetched pages, read-ahead evicts to make room,
//! and a device short of room counts its resident pages towards density
//! ([`resident_pages`]), only while it says prefetch pays.
#![allow(dead_code, unreachable_pub)]

/// Pages in a 2 MiB block.
pub const BLOCK_PAGES: usize = 512;

/// A running estimate of prefetch accuracy, in 1/[`Accuracy::ONE`]: each prefetched page
/// that settles moves it 1/2^[`Accuracy::SHIFT`] of the way towards one (used) or zero
/// (evicted unused), so it follows roughly the last `2^SHIFT` settled pages. It starts at
/// one: prefetch is trusted until it has been seen to fail.
///
/// Invariant: the value stays within `0..=ONE`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Accuracy(pub u32);

impl Accuracy {
    /// Full accuracy.
    pub const ONE: u32 = 1 << 16;
    /// Each settled page moves the estimate by 1/2^SHIFT of the distance.
    pub const SHIFT: u32 = 5;
    /// At least this share of prefetched pages used (one half): prefetch pays.
    pub const PAYS: u32 = Self::ONE / 2;

    /// The estimate after `used` pages settled as used and `wasted` as evicted unused
    /// (at most 64 of each are applied: beyond that the estimate has converged anyway).
    pub fn settle(self, used: u64, wasted: u64) -> Accuracy {
        let mut v = self.0.min(Self::ONE);
        for _ in 0..wasted.min(64) {
            v -= v >> Self::SHIFT;
        }
        for _ in 0..used.min(64) {
            v += (Self::ONE - v) >> Self::SHIFT;
        }
        Accuracy(v)
    }

    /// Whether prefetch has been paying lately.
    pub fn pays(self) -> bool {
        self.0 >= Self::PAYS
    }

    /// The estimate in percent, rounded down (0 to 100).
    pub fn percent(self) -> u32 {
        // At most ONE * 100 = 2^16 * 100: no overflow.
        self.0.min(Self::ONE) * 100 / Self::ONE
    }
}
/// Words of a block bitmap.
const WORDS: usize = BLOCK_PAGES / 64;

/// How long an accuracy estimate that no settled page has moved stays evidence: after
/// that, [`resident_pages`] lets one decision count the resident pages again (a probe), so
/// that prefetch gets new samples (hardly any come while resident pages do not count).
pub const ESTIMATE_STALE_NS: u64 = 100_000_000;

/// What [`density_counting`] does with a block's resident pages ([`resident_pages`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Resident {
    /// Counted as populated: UVM's rule.
    Count,
    /// Counted, as a probe of a stale estimate: the caller restarts the estimate's clock,
    /// so that the next probe comes [`ESTIMATE_STALE_NS`] later at the earliest.
    Probe,
    /// Not counted: only the faulted pages make a subregion dense.
    Ignore,
}

impl Resident {
    /// Whether the resident pages count as populated.
    pub fn counted(self) -> bool {
        self != Resident::Ignore
    }
}

/// What the density rule does with a block's resident pages on a device with `free`
/// frames and high watermark `high`, whose prefetch has been paying (`pays`,
/// [`Accuracy::pays`]) and whose estimate last moved `settled_ago` ns ago. Resident pages
/// mean something only while the device has room: under oversubscription pages are
/// evicted one by one, half-resident blocks are the norm, and almost any fault would tip
/// its block over the threshold. So they count (UVM's rule) on a device with a block's
/// frames above its high watermark (the level background eviction refills to) or while
/// prefetch pays; otherwise not, except for a probe once the estimate is older than
/// [`ESTIMATE_STALE_NS`].
pub fn resident_pages(free: u64, high: u64, pays: bool, settled_ago: u64) -> Resident {
    if pays || free >= high.saturating_add(BLOCK_PAGES as u64) {
        Resident::Count
    } else if settled_ago >= ESTIMATE_STALE_NS {
        Resident::Probe
    } else {
        Resident::Ignore
    }
}

/// Whether a device fault batch that leaves the device holding `resident` of the block's
/// `valid` pages should start reading the next block ahead: when the block is wholly
/// resident (the density rule fetched the rest, or it was there already) and has any valid
/// page at all. A block that stays partly resident (random access, or a full device) does
/// not start a read-ahead: the next block would be a guess, not a stream.
pub fn read_ahead(resident: &[u64; WORDS], valid: &[u64; WORDS]) -> bool {
    valid.iter().any(|&w| w != 0) && valid.iter().zip(resident).all(|(&v, &r)| v & !r == 0)
}

/// Whether block `next` lies at most `depth` blocks after block `at` (blocks are numbered
/// by address / 2 MiB).
pub fn within_depth(next: usize, at: usize, depth: usize) -> bool {
    next > at && next - at <= depth
}

/// Read-ahead's chain (`gmem/mech/readahead.rs`): the block its worker fetches after
/// block `done`, for a reader last seen at block `at`, reading ahead `depth` blocks: the
/// next one, or the reader's next if the reader has gone past the chain; `None` beyond the
/// depth (the chain stops; a later fault starts it again).
pub fn chain_next(done: usize, at: usize, depth: usize) -> Option<usize> {
    let next = done.max(at).checked_add(1)?;
    within_depth(next, at, depth).then_some(next)
}

/// Read-ahead home's lanes (`gmem/mech/readahead.rs`): `lanes` lanes take turns on
/// consecutive blocks (block `b` on lane `b % lanes`). The block the lane that fetched
/// block `done` fetches next, for a reader last seen at block `at`, reading ahead `depth`
/// blocks: the lane's first block after both `done` and `at` (normally `done + lanes`; a
/// reader that went past the lane takes it to the lane's block in the reader's window);
/// `None` if that lies beyond the depth (the lane stops; a later fault starts it again).
pub fn lane_next(done: usize, at: usize, lanes: usize, depth: usize) -> Option<usize> {
    if lanes == 0 {
        return None;
    }
    let from = done.max(at).checked_add(1)?;
    // From `from` up to the lane's residue (both below `lanes`).
    let step = (done % lanes + lanes - from % lanes) % lanes;
    let next = from.checked_add(step)?;
    within_depth(next, at, depth).then_some(next)
}

/// Where a chain asked for by a fault at block `at` starts: at `from` (normally `at + 1`),
/// or at `to`, the block after the last one the chain queued in the same stream (`None`:
/// another region), if that is further on: the blocks before it were queued already.
/// `None` if the start lies beyond `depth` (a later fault starts it). A `to` further on
/// than any chain of this stream can have gone (`max_depth` blocks past a reader that was
/// at or before `at`, plus one) is from an earlier pass over the region, and ignored.
pub fn chain_start(from: usize, at: usize, to: Option<usize>, depth: usize, max_depth: usize) -> Option<usize> {
    let reach = at.checked_add(max_depth).and_then(|r| r.checked_add(1));
    let start = match to {
        Some(to) if to > from && reach.is_some_and(|reach| to <= reach) => to,
        _ => from,
    };
    within_depth(start, at, depth).then_some(start)
}

/// Whether a device's stream has gone past block `block` (blocks numbered by address /
/// 2 MiB, as for [`chain_start`]): its reader's last fault that asked for read-ahead was
/// at block `at`, `age_ns` ago, and its chain has queued blocks up to `to` (one past the
/// last); `down`: the reader is taken to move down ([`DOWN_MOVES`] moves down in a row
/// between blocks, [`downs_after`]).
/// Gone past: the block lies at least two blocks before the reader's (the block right
/// behind it may still be read, as a stencil's halo is), the chain has run ahead of the
/// reader, and the ask is younger than `fresh_ns` (a stream that stopped asking has ended
/// or moved on). Never true of a block in the read-ahead window `[at, to)`, nor for a
/// reader moving down: read-ahead follows upward readers, and below a downward reader
/// lies what it reads next, not what it has read.
pub fn behind_stream(block: usize, at: usize, to: usize, age_ns: u64, fresh_ns: u64, down: bool) -> bool {
    !down && to > at && age_ns < fresh_ns && block.checked_add(2).is_some_and(|e| e <= at)
}

/// Moves down in a row after which a stream's reader is taken to be moving down (the
/// `down` of [`behind_stream`] and [`ahead_of_stream`]): one alone is as likely an upward
/// stream's halo, a lagging thread's fault or a racing ask.
pub const DOWN_MOVES: u32 = 2;

/// A stream's count of moves down in a row once its reader moved from block `from` to
/// another block `to`: one more after a move down (saturating), none after a move up.
pub fn downs_after(downs: u32, from: usize, to: usize) -> u32 {
    if to < from {
        downs.saturating_add(1)
    } else {
        0
    }
}

/// How long a stream stays live after its reader's last ask for read-ahead, given the
/// time `gap_ns` between its asks in its last two blocks (0: not known): `fresh_ns`, or
/// four of its gaps for a stream that asks more slowly (a device computing long on each
/// block), at most `max_ns`. A gap over a quarter of `max_ns` is a pause between two
/// streams, not a pace: `fresh_ns` then. A stream that has not asked for that long has
/// ended or moved on.
pub fn stream_fresh_ns(gap_ns: u64, fresh_ns: u64, max_ns: u64) -> u64 {
    if gap_ns > max_ns / 4 {
        return fresh_ns;
    }
    gap_ns.saturating_mul(4).clamp(fresh_ns, core::cmp::max(fresh_ns, max_ns))
}

/// Whether block `block` lies in front of a device's live stream (as for
/// [`behind_stream`]: its reader at block `at`, its chain queued up to `to`, its last ask
/// `age_ns` ago, `down` if it is taken to move down): after the reader's block, while the
/// stream is fresh and its chain ahead, and never for a reader moving down (as for
/// [`behind_stream`]). The stream reaches such a block before it comes back, if ever, to
/// one it has gone past.
pub fn ahead_of_stream(block: usize, at: usize, to: usize, age_ns: u64, fresh_ns: u64, down: bool) -> bool {
    !down && to > at && age_ns < fresh_ns && block > at
}

/// The blocks a stream whose reader is at block `at` has gone past, nearest first, at most
/// `look` of them: from two before the reader's (the one right behind it may still be
/// read) back towards block 0.
pub fn passed_blocks(at: usize, look: usize) -> impl Iterator<Item = usize> {
    let end = at.saturating_sub(1);
    (end.saturating_sub(look)..end).rev()
}

/// Which of a device's read-ahead streams a fault in the region `id` (nonzero) takes, given
/// each stream's region (`0`: none yet) and when its reader last asked (ns): the stream
/// already in `id`; else the first that follows no region; else the one whose reader
/// asked longest ago (the first of those on a tie). `None` only for no streams.
pub fn pick_stream(streams: &[(usize, u64)], id: usize) -> Option<usize> {
    if let Some(k) = streams.iter().position(|&(of, _)| of == id) {
        return Some(k);
    }
    if let Some(k) = streams.iter().position(|&(of, _)| of == 0) {
        return Some(k);
    }
    // `min_by_key` keeps the first of equal keys.
    streams.iter().enumerate().min_by_key(|&(_, &(_, asked))| asked).map(|(k, _)| k)
}

/// Word range and in-word mask of the aligned subregion `[start, start + size)`, where
/// `size` is a power of two in `2..=512` and `start < 512` a multiple of it.
fn span(start: usize, size: usize) -> (core::ops::Range<usize>, u64) {
    let w0 = start / 64;
    if size >= 64 {
        (w0..(w0 + size / 64).min(WORDS), u64::MAX)
    } else {
        // size < 64 and start % size == 0, so the subregion lies within one word.
        (w0..w0 + 1, (u64::MAX >> (64 - size)) << (start % 64))
    }
}

/// The masks of the steps of a bit count by halves (SWAR): after step `k`, each field of
/// `2^(k+1)` bits of a word holds how many bits of it were set.
const SWAR: [u64; 6] = [
    0x5555_5555_5555_5555,
    0x3333_3333_3333_3333,
    0x0f0f_0f0f_0f0f_0f0f,
    0x00ff_00ff_00ff_00ff,
    0x0000_ffff_0000_ffff,
    0x0000_0000_ffff_ffff,
];

/// One step of the count: fields of `width` bits holding counts become fields of twice
/// the width holding the sums of their halves (`mask`: the low half of each new field).
fn widen(m: &mut [u64; WORDS], width: u32, mask: u64) {
    for w in m.iter_mut() {
        *w = (*w & mask) + ((*w >> width) & mask);
    }
}

/// Number of pages in the subregion `[start, start + size)` (as [`span`]) of a bitmap
/// counted up to fields of `size` bits (`size` < 64), or to one count per word.
fn count(c: &[u64; WORDS], start: usize, size: usize) -> u64 {
    if size >= 64 {
        span(start, size).0.filter_map(|i| c.get(i)).sum()
    } else {
        // `start` is a multiple of `size`: the field lies within one word.
        c.get(start / 64).map_or(0, |w| (w >> (start % 64)) & (u64::MAX >> (64 - size)))
    }
}

/// Adds to `acc` the pages of `add` in the subregion, at most `*budget` of them (lowest
/// first), and decrements the budget accordingly.
fn take(acc: &mut [u64; WORDS], add: &[u64; WORDS], start: usize, size: usize, budget: &mut usize) {
    let (r, mask) = span(start, size);
    for i in r {
        let (Some(&a), Some(slot)) = (add.get(i), acc.get_mut(i)) else { continue };
        let mut w = a & mask & !*slot;
        while w != 0 && *budget > 0 {
            let low = w & w.wrapping_neg();
            *slot |= low;
            w &= !low;
            *budget -= 1;
        }
    }
}

/// Pages to prefetch in addition to the faulted ones (see the module documentation).
/// `threshold_pct` is clamped to `1..=100` (UVM uses 51); `max_pages == 0` disables it.
pub fn density(
    resident: &[u64; 8],
    faulted: &[u64; 8],
    valid: &[u64; 8],
    threshold_pct: u32,
    max_pages: usize,
) -> [u64; 8] {
    density_counting(resident, faulted, valid, threshold_pct, max_pages, true)
}

/// [`density`], counting the resident pages as populated only if `count_resident`
/// ([`resident_pages`]); otherwise they count as unpopulated pages of their
/// subregions (only the faulted pages make a subregion dense). Resident pages are never
/// picked either way, nor charged to `max_pages`.
pub fn density_counting(
    resident: &[u64; 8],
    faulted: &[u64; 8],
    valid: &[u64; 8],
    threshold_pct: u32,
    max_pages: usize,
    count_resident: bool,
) -> [u64; 8] {
    let t = u64::from(threshold_pct.clamp(1, 100));
    // Populated pages counted against valid ones; candidates are the valid absent pages.
    let mut populated = [0u64; WORDS];
    let mut candidates = [0u64; WORDS];
    for i in 0..WORDS {
        let counted = if count_resident { resident[i] } else { 0 };
        populated[i] = (counted | faulted[i]) & valid[i];
        candidates[i] = valid[i] & !(resident[i] | faulted[i]);
    }
    let mut out = [0u64; WORDS];
    // Only candidates are ever picked: with none (a marker fault in a block read ahead, a
    // fault that completes its block), the tree has nothing to give.
    if candidates.iter().all(|&w| w == 0) {
        return out;
    }
    let mut budget = max_pages;
    // The valid, populated and faulted pages counted by subregion, one level of the tree
    // at a time (each level's counts the sums of the level's below: 6 steps over 8 words
    // per bitmap, instead of counting the bits of every subregion of every level).
    let mut counts = [*valid, populated, *faulted];
    let mut size = 2;
    let mut step = 0;
    while size <= BLOCK_PAGES && budget > 0 {
        if let Some(&mask) = SWAR.get(step) {
            for c in counts.iter_mut() {
                widen(c, 1 << step, mask);
            }
            step += 1;
        }
        let [nv, np, nf] = &counts;
        let mut start = 0;
        while start < BLOCK_PAGES && budget > 0 {
            let nvalid = count(nv, start, size);
            // Counts are at most 512 and t at most 100: no overflow.
            let dense = count(np, start, size) * 100 > t * nvalid;
            if dense && nvalid > 0 && count(nf, start, size) > 0 {
                take(&mut out, &candidates, start, size, &mut budget);
            }
            start += size;
        }
        size *= 2;
    }
    out
}

/// Sequential fault-around: the pages a fault on page `k` of a block brings along when it
/// continues a stream, or `None` when it does not. It continues one when the page before
/// `k` is valid and `mapped` by the reader (home and touched: a page merely resident, say
/// a never-touched host page beside device data, is no evidence of a stream), or when `k`
/// is the block's first page and the reader has just streamed through the previous block
/// (`after_stream`). The reader is then
/// walking the block in order, and every valid, non-resident page after `k`, to the block's
/// end, comes now, as the page cache's read-ahead window does: the density rule alone
/// would need about a dozen faults per block to get there (its subregions double one fault
/// at a time), each fault leaving the link idle. The result is a subset of `valid`,
/// disjoint from `resident`, and holds no page at or before `k`.
pub fn sequential(
    resident: &[u64; 8],
    mapped: &[u64; 8],
    valid: &[u64; 8],
    k: usize,
    after_stream: bool,
) -> Option<[u64; 8]> {
    let bit = |m: &[u64; 8], p: usize| m.get(p / 64).is_some_and(|w| w & (1 << (p % 64)) != 0);
    let streaming = match k.checked_sub(1) {
        Some(prev) => bit(valid, prev) && bit(mapped, prev),
        None => after_stream,
    };
    if !streaming || k >= BLOCK_PAGES {
        return None;
    }
    let mut out = [0u64; WORDS];
    for (w, slot) in out.iter_mut().enumerate() {
        // Pages after `k` in word `w`: all but its first `n`.
        let n = (k + 1).saturating_sub(w * 64);
        let after = if n >= 64 { 0 } else { u64::MAX << n };
        *slot = valid[w] & !resident[w] & after;
    }
    Some(out)
}

/// Stride detector over recent fault page numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stride {
    /// The last three pages, most recent last; `len` of them are valid (at the end).
    last: [u64; 3],
    len: u8,
}

/// `b - a` as an `i64`, if it fits.
fn diff(a: u64, b: u64) -> Option<i64> {
    if b >= a {
        i64::try_from(b - a).ok()
    } else {
        i64::try_from(a - b).ok().map(|d| -d)
    }
}

impl Stride {
    /// No history.
    pub const fn new() -> Self {
        Stride { last: [0; 3], len: 0 }
    }

    /// Records a fault at `page`; returns the stride if this and the two previous pages form
    /// an arithmetic sequence with a non-zero difference.
    pub fn record(&mut self, page: u64) -> Option<i64> {
        self.last = [self.last[1], self.last[2], page];
        if self.len < 3 {
            self.len += 1;
        }
        if self.len < 3 {
            return None;
        }
        let d1 = diff(self.last[0], self.last[1])?;
        let d2 = diff(self.last[1], self.last[2])?;
        (d1 == d2 && d1 != 0).then_some(d1)
    }

    /// Forgets the history.
    pub fn reset(&mut self) {
        *self = Stride::new();
    }
}

impl Default for Stride {
    fn default() -> Self {
        Stride::new()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn resident_pages_count_with_room_or_while_prefetch_pays_and_a_stale_estimate_probes() {
        use super::{resident_pages as rule, Resident, BLOCK_PAGES as B, ESTIMATE_STALE_NS as STALE};
        let b = B as u64;
        // Room for a block above the high watermark: UVM's rule, paying or not.
        assert_eq!(rule(128 + b, 128, false, 0), Resident::Count);
        assert_eq!(rule(u64::MAX, 128, false, 0), Resident::Count);
        // Short of it: counted while prefetch pays; otherwise not, but a stale estimate
        // probes.
        assert_eq!(rule(128 + b - 1, 128, true, 0), Resident::Count);
        assert_eq!(rule(128 + b - 1, 128, true, STALE), Resident::Count);
        assert_eq!(rule(128 + b - 1, 128, false, 0), Resident::Ignore);
        assert_eq!(rule(128 + b - 1, 128, false, STALE - 1), Resident::Ignore);
        assert_eq!(rule(128 + b - 1, 128, false, STALE), Resident::Probe);
        assert_eq!(rule(0, 0, false, 0), Resident::Ignore);
        // A watermark near the top cannot wrap into "room".
        assert_eq!(rule(u64::MAX - 1, u64::MAX, false, 0), Resident::Ignore);
        assert!(Resident::Count.counted() && Resident::Probe.counted() && !Resident::Ignore.counted());
    }

    #[test]
    fn without_resident_pages_only_faults_make_density_and_residents_are_never_picked() {
        use super::{density, density_counting, BLOCK_PAGES};
        let valid = [u64::MAX; 8];
        // Every other page resident (a half-resident block) and one fault.
        let resident = [0x5555_5555_5555_5555u64; 8];
        let mut faulted = [0u64; 8];
        faulted[3] = 1 << 1;
        // UVM's rule: the fault tips its 64-page subregion over 51 % (33 of 64; the block,
        // 257 of 512, stays under): the subregion's other 31 absent pages are fetched.
        let uvm = density(&resident, &faulted, &valid, 51, BLOCK_PAGES);
        assert_eq!(uvm.iter().map(|w| w.count_ones()).sum::<u32>(), 31);
        // Resident pages not counted: one fault in a pair with a resident page is half
        // of it, not more; nothing is fetched.
        assert_eq!(density_counting(&resident, &faulted, &valid, 51, BLOCK_PAGES, false), [0; 8]);
        // Two quads three-quarters faulted: the first's fourth page is resident, the
        // second's absent. A budget of one page goes to the absent one, not to the
        // resident page (which comes first).
        let mut res = [0u64; 8];
        res[0] = 0b0000_1000;
        let mut quads = [0u64; 8];
        quads[0] = 0b0111_0111;
        let got = density_counting(&res, &quads, &valid, 51, 1, false);
        assert_eq!(got[0], 0b1000_0000);
        assert!(got[1..].iter().all(|&w| w == 0));
    }

    #[test]
    fn chain_goes_on_within_depth_and_skips_to_the_reader() {
        // Next block, while within three of the reader at 10.
        assert_eq!(chain_next(10, 10, 3), Some(11));
        assert_eq!(chain_next(12, 10, 3), Some(13));
        assert_eq!(chain_next(13, 10, 3), None);
        // The reader went past the chain: on from the reader.
        assert_eq!(chain_next(4, 10, 3), Some(11));
        assert_eq!(chain_next(usize::MAX, 0, 3), None);
    }

    #[test]
    fn lane_goes_on_to_its_block_in_the_readers_window() {
        // Three lanes, reader at 10, depth 3: lane of 8 goes on to 11, of 10 to 13.
        assert_eq!(lane_next(8, 10, 3, 3), Some(11));
        assert_eq!(lane_next(10, 10, 3, 3), Some(13));
        // Lane of 11 would go to 14: beyond the depth.
        assert_eq!(lane_next(11, 10, 3, 3), None);
        // The reader jumped from the lane's block 2 to 20: the lane's block there is 23.
        assert_eq!(lane_next(2, 20, 3, 3), Some(23));
        assert_eq!(lane_next(1, 20, 3, 3), Some(22));
        // A reader never seen (`usize::MAX`), no lanes, overflow: nothing.
        assert_eq!(lane_next(2, usize::MAX, 3, 3), None);
        assert_eq!(lane_next(2, 1, 0, 3), None);
        assert_eq!(lane_next(usize::MAX, 0, 3, 3), None);
    }

    #[test]
    fn chain_starts_where_it_stopped_unless_stale() {
        // No earlier chain in this region: the next block.
        assert_eq!(chain_start(11, 10, None, 3, 3), Some(11));
        // It stopped at 13 (queued up to 12): on from there.
        assert_eq!(chain_start(11, 10, Some(13), 3, 3), Some(13));
        // Beyond the depth for now (under pressure, depth 2): nothing, not block 11 again.
        assert_eq!(chain_start(11, 10, Some(13), 2, 3), None);
        // Behind the reader, or from an earlier pass far on: the next block.
        assert_eq!(chain_start(11, 10, Some(9), 3, 3), Some(11));
        assert_eq!(chain_start(11, 10, Some(40), 3, 3), Some(11));
        // The furthest a chain of this stream can have gone is still honoured.
        assert_eq!(chain_start(11, 10, Some(14), 3, 3), None);
    }

    #[test]
    fn accuracy_follows_what_settles() {
        let mut a = super::Accuracy(super::Accuracy::ONE);
        assert!(a.pays());
        // A random workload: one page in five used.
        for _ in 0..100 {
            a = a.settle(1, 4);
        }
        assert!(!a.pays(), "{a:?}");
        // A stream: everything used again.
        for _ in 0..100 {
            a = a.settle(8, 0);
        }
        assert!(a.pays(), "{a:?}");
        assert!(a.0 <= super::Accuracy::ONE);
        assert_eq!(super::Accuracy(u32::MAX).settle(u64::MAX, 0).0, super::Accuracy::ONE);
        assert_eq!(super::Accuracy(0).settle(0, u64::MAX).0, 0);
    }

    #[test]
    fn accuracy_in_percent() {
        assert_eq!(super::Accuracy(super::Accuracy::ONE).percent(), 100);
        assert_eq!(super::Accuracy(super::Accuracy::PAYS).percent(), 50);
        assert_eq!(super::Accuracy(super::Accuracy::PAYS - 1).percent(), 49);
        assert_eq!(super::Accuracy(0).percent(), 0);
        assert_eq!(super::Accuracy(u32::MAX).percent(), 100);
    }

    proptest::proptest! {
        #[test]
        fn accuracy_stays_in_range(v in 0u32..=u32::MAX, used in 0u64..200, wasted in 0u64..200) {
            let a = super::Accuracy(v).settle(used, wasted);
            proptest::prop_assert!(a.0 <= super::Accuracy::ONE);
        }

        /// The lane's next block is on the lane, after both its last block and the reader's,
        /// within the depth, and the first such block; `None` only when there is none.
        #[test]
        fn lane_next_is_the_lanes_first_block_in_the_window(
            done in 0usize..200, at in 0usize..200, lanes in 1usize..6, depth in 0usize..8
        ) {
            let on_lane = |b: usize| b % lanes == done % lanes && b > done.max(at) && super::within_depth(b, at, depth);
            let first = (done.max(at) + 1..=at + depth).find(|&b| on_lane(b));
            proptest::prop_assert_eq!(super::lane_next(done, at, lanes, depth), first);
        }

        /// The stream picked is the region's own if it has one; else a free one if any;
        /// else one no other was asked for longer ago than.
        #[test]
        fn pick_stream_keeps_own_then_free_then_oldest(
            streams in proptest::collection::vec((0usize..6, 0u64..100), 1..6), id in 1usize..6
        ) {
            let k = super::pick_stream(&streams, id);
            proptest::prop_assert!(k.is_some());
            let k = k.unwrap_or(0);
            if streams.iter().any(|&(of, _)| of == id) {
                proptest::prop_assert_eq!(streams[k].0, id);
            } else if streams.iter().any(|&(of, _)| of == 0) {
                proptest::prop_assert_eq!(streams[k].0, 0);
            } else {
                proptest::prop_assert!(streams.iter().all(|&(_, a)| a >= streams[k].1));
            }
        }

        /// A block behind the stream is two or more blocks before the reader's, never in
        /// the read-ahead window, and only while the stream is fresh and its chain ahead.
        #[test]
        fn behind_the_stream_is_never_near_or_ahead_of_the_reader(
            block in 0usize..64, at in 0usize..64, to in 0usize..64, age in 0u64..200, fresh in 0u64..200
        ) {
            let behind = super::behind_stream(block, at, to, age, fresh, false);
            if behind {
                proptest::prop_assert!(block + 2 <= at && to > at && age < fresh);
                proptest::prop_assert!(!(at..to).contains(&block));
            } else {
                proptest::prop_assert!(block + 2 > at || to <= at || age >= fresh);
            }
        }
    }

    proptest::proptest! {
        /// In front of the stream is after the reader's block and never behind the stream;
        /// the blocks passed are behind it (for a live stream), nearest first, at most
        /// `look`, and every block behind within `look` of the nearest is among them.
        #[test]
        fn passed_blocks_lie_behind_and_ahead_lies_in_front(
            block in 0usize..64, at in 0usize..64, to in 0usize..64, age in 0u64..200, fresh in 0u64..200,
            look in 0usize..16, down in proptest::bool::ANY
        ) {
            let ahead = super::ahead_of_stream(block, at, to, age, fresh, down);
            proptest::prop_assert_eq!(ahead, !down && block > at && to > at && age < fresh);
            proptest::prop_assert!(!(ahead && super::behind_stream(block, at, to, age, fresh, down)));
            let passed: std::vec::Vec<usize> = super::passed_blocks(at, look).collect();
            proptest::prop_assert!(passed.len() <= look);
            proptest::prop_assert!(passed.windows(2).all(|w| w[0] == w[1] + 1));
            if let Some(&first) = passed.first() {
                proptest::prop_assert_eq!(first + 2, at);
            }
            for b in 0..at {
                let listed = passed.contains(&b);
                proptest::prop_assert_eq!(listed, b + 2 <= at && b + 2 + look > at, "block {}", b);
                if listed && to > at && age < fresh {
                    proptest::prop_assert!(super::behind_stream(b, at, to, age, fresh, false));
                }
            }
        }
    }

    proptest::proptest! {
        /// A reader moving down has no block behind it and none in front of it: whatever
        /// else holds, both verdicts are no.
        #[test]
        fn a_downward_reader_gets_no_verdict(
            block in 0usize..64, at in 0usize..64, to in 0usize..64, age in 0u64..200, fresh in 0u64..200
        ) {
            proptest::prop_assert!(!super::behind_stream(block, at, to, age, fresh, true));
            proptest::prop_assert!(!super::ahead_of_stream(block, at, to, age, fresh, true));
        }
    }

    #[test]
    fn downs_examples() {
        use super::{downs_after, DOWN_MOVES};
        // An upward stream with one block read behind (a halo, a lagging thread): never
        // taken for a downward one.
        let mut d = 0;
        for (from, to) in [(4, 5), (5, 4), (4, 6), (6, 5), (5, 7)] {
            d = downs_after(d, from, to);
            assert!(d < DOWN_MOVES, "{from} -> {to}");
        }
        // A downward sweep: from its second move down on.
        let d1 = downs_after(0, 10, 9);
        assert!(d1 < DOWN_MOVES);
        let d2 = downs_after(d1, 9, 8);
        assert!(d2 >= DOWN_MOVES && downs_after(d2, 8, 7) >= DOWN_MOVES);
        // One move up ends it; the count saturates.
        assert_eq!(downs_after(d2, 8, 12), 0);
        assert_eq!(downs_after(u32::MAX, 1, 0), u32::MAX);
    }

    #[test]
    fn stream_fresh_examples() {
        let (fresh, max) = (50, 1000);
        // Unknown or fast: the floor. Slow: four gaps, up to the cap.
        assert_eq!(super::stream_fresh_ns(0, fresh, max), 50);
        assert_eq!(super::stream_fresh_ns(10, fresh, max), 50);
        assert_eq!(super::stream_fresh_ns(90, fresh, max), 360);
        assert_eq!(super::stream_fresh_ns(250, fresh, max), 1000);
        // A pause longer than a quarter of the cap is no pace: the floor.
        assert_eq!(super::stream_fresh_ns(251, fresh, max), 50);
        assert_eq!(super::stream_fresh_ns(u64::MAX, fresh, max), 50);
        // A cap under the floor never undercuts the floor.
        assert_eq!(super::stream_fresh_ns(2, fresh, 10), 50);
    }

    #[test]
    fn passed_blocks_examples() {
        let v = |at, look| super::passed_blocks(at, look).collect::<std::vec::Vec<_>>();
        assert_eq!(v(10, 3), [8, 7, 6]);
        assert_eq!(v(3, 8), [1, 0]);
        assert!(v(1, 8).is_empty() && v(0, 8).is_empty() && v(10, 0).is_empty());
        assert_eq!(v(usize::MAX, 1), [usize::MAX - 2]);
        // Reader at block 10, chain queued up to 12: block 11 is in front, 10 is not.
        assert!(super::ahead_of_stream(11, 10, 12, 1, 50, false) && !super::ahead_of_stream(10, 10, 12, 1, 50, false));
        // A stale stream, or a chain not ahead of its reader: nothing is in front.
        assert!(
            !super::ahead_of_stream(11, 10, 12, 50, 50, false) && !super::ahead_of_stream(11, 10, 10, 1, 50, false)
        );
    }

    #[test]
    fn pick_stream_examples() {
        // Its own stream, even when another is free or older.
        assert_eq!(super::pick_stream(&[(0, 0), (7, 50), (9, 10)], 7), Some(1));
        // A free one next (the first free).
        assert_eq!(super::pick_stream(&[(3, 5), (0, 0), (0, 0)], 7), Some(1));
        // Else the one asked longest ago; the first on a tie.
        assert_eq!(super::pick_stream(&[(3, 50), (4, 20), (5, 20), (6, 90)], 7), Some(1));
        assert_eq!(super::pick_stream(&[], 7), None);
    }

    #[test]
    fn behind_the_stream_examples() {
        // Reader at block 10, chain queued up to 12, asked 1 ms ago, fresh for 50 ms.
        let (at, to, age, fresh) = (10, 12, 1_000_000, 50_000_000);
        assert!(super::behind_stream(0, at, to, age, fresh, false));
        assert!(super::behind_stream(8, at, to, age, fresh, false));
        // The block right behind the reader's, the reader's own and those read ahead: no.
        for b in 9..14 {
            assert!(!super::behind_stream(b, at, to, age, fresh, false), "block {b}");
        }
        // A stale stream, or a chain that has not run ahead of the reader: nothing is behind.
        assert!(!super::behind_stream(0, at, to, fresh, fresh, false));
        assert!(!super::behind_stream(0, at, at, age, fresh, false));
        // A reader whose last move went down: the same blocks are not behind it.
        assert!(!super::behind_stream(0, at, to, age, fresh, true));
        assert!(!super::behind_stream(8, at, to, age, fresh, true));
        // No block lies two before block 0 or 1; the largest block number does not wrap.
        assert!(!super::behind_stream(0, 1, 5, age, fresh, false));
        assert!(!super::behind_stream(usize::MAX, usize::MAX - 1, usize::MAX, age, fresh, false));
    }

    use super::*;

    #[test]
    fn read_ahead_follows_a_wholly_resident_block_only() {
        let all = [u64::MAX; 8];
        assert!(read_ahead(&all, &all));
        // The head of a region that starts mid-block: only its valid pages count.
        let tail = set(&(300..512).collect::<std::vec::Vec<_>>());
        assert!(read_ahead(&tail, &tail));
        let mut part = all;
        part[7] &= !(1 << 63);
        assert!(!read_ahead(&part, &all));
        assert!(!read_ahead(&[0; 8], &all));
        // No valid page: nothing streamed.
        assert!(!read_ahead(&all, &[0; 8]));
    }

    #[test]
    fn sequential_takes_the_rest_of_the_block_after_a_resident_page() {
        let all = [u64::MAX; 8];
        // Page 9 resident, fault on 10: 11..512 come along.
        let r = set(&[9]);
        assert_eq!(pages(&sequential(&r, &r, &all, 10, false).unwrap()), (11..512).collect::<std::vec::Vec<_>>());
        // Resident pages further on are not fetched again; invalid ones are not fetched.
        let r = set(&[9, 100, 200]);
        let mut v = all;
        v[7] = 0;
        let got = pages(&sequential(&r, &r, &v, 10, false).unwrap());
        assert_eq!(got, (11..448).filter(|&p| p != 100 && p != 200).collect::<std::vec::Vec<_>>());
        // Word edges: a fault on 63 starts at 64; on 64 (63 resident) at 65.
        assert_eq!(pages(&sequential(&set(&[62]), &set(&[62]), &all, 63, false).unwrap())[0], 64);
        assert_eq!(pages(&sequential(&set(&[63]), &set(&[63]), &all, 64, false).unwrap())[0], 65);
        // The last page: nothing after it, yet a stream.
        assert_eq!(sequential(&set(&[510]), &set(&[510]), &all, 511, false), Some([0; 8]));
    }

    #[test]
    fn sequential_needs_the_previous_page_or_block() {
        let all = [u64::MAX; 8];
        // Previous page not resident, or not valid: no stream.
        assert_eq!(sequential(&set(&[5]), &set(&[5]), &all, 10, false), None);
        // Resident but never mapped (never touched by the reader): no stream either.
        assert_eq!(sequential(&set(&[9]), &[0; 8], &all, 10, false), None);
        let mut v = all;
        v[0] &= !(1 << 9);
        assert_eq!(sequential(&set(&[9]), &set(&[9]), &v, 10, false), None);
        // The first page: only after the previous block was streamed.
        assert_eq!(sequential(&[0; 8], &[0; 8], &all, 0, false), None);
        assert_eq!(
            pages(&sequential(&[0; 8], &[0; 8], &all, 0, true).unwrap()),
            (1..512).collect::<std::vec::Vec<_>>()
        );
        // Out of the block.
        assert_eq!(sequential(&all, &all, &all, 512, true), None);
    }

    fn set(pages: &[usize]) -> [u64; 8] {
        let mut m = [0u64; 8];
        for &p in pages {
            m[p / 64] |= 1 << (p % 64);
        }
        m
    }

    fn pages(m: &[u64; 8]) -> std::vec::Vec<usize> {
        (0..BLOCK_PAGES).filter(|p| m[p / 64] & (1 << (p % 64)) != 0).collect()
    }

    const ALL: [u64; 8] = [u64::MAX; 8];

    #[test]
    fn pair_completes_when_half_plus_one() {
        // Page 4 faulted, 5 absent: 1/2 = 50% is not > 51%.
        assert_eq!(pages(&density(&[0; 8], &set(&[4]), &ALL, 51, 512)), []);
        // Pages 4 and 6 faulted, 5 resident: subregion 4..8 has 3/4 > 51%.
        let r = density(&set(&[5]), &set(&[4, 6]), &ALL, 51, 512);
        assert_eq!(pages(&r), [7]);
    }

    #[test]
    fn largest_dense_subregion_wins() {
        // 0..40 resident, fault at 40: 0..64 has 41/64 = 64% -> fetch 41..64; 0..128 has
        // 41/128 (no).
        let res: std::vec::Vec<usize> = (0..40).collect();
        let r = density(&set(&res), &set(&[40]), &ALL, 51, 512);
        assert_eq!(pages(&r), (41..64).collect::<std::vec::Vec<_>>());
        // The same with a cap: closest subregions first (40..48 is 1/8, not dense; 32..48
        // has 9/16 -> 41..48 first), then the rest of 0..64 in page order.
        let r = density(&set(&res), &set(&[40]), &ALL, 51, 10);
        assert_eq!(pages(&r), [41, 42, 43, 44, 45, 46, 47, 48, 49, 50]);
    }

    #[test]
    fn end_of_region_counts_valid_pages_only() {
        // The region ends at page 10. 8..16 is dense (its 2 valid pages are populated) but
        // 10..16 does not exist.
        let valid = set(&(0..10).collect::<std::vec::Vec<_>>());
        assert_eq!(density(&set(&[8]), &set(&[9]), &valid, 51, 512), [0; 8]);
        // 0..16 holds 6 of its 10 valid pages (60%, although only 6/16 of its size).
        let r = density(&set(&[4, 5, 6, 7, 8]), &set(&[9]), &valid, 51, 512);
        assert_eq!(pages(&r), [0, 1, 2, 3]);
    }

    #[test]
    fn disabled_and_saturated_thresholds() {
        let f = set(&[0, 1, 2]);
        assert_eq!(density(&[0; 8], &f, &ALL, 51, 0), [0; 8]);
        assert_eq!(density(&[0; 8], &f, &ALL, 100, 512), [0; 8]);
        assert_eq!(density(&[0; 8], &f, &ALL, 1000, 512), [0; 8]);
        // Threshold 0 reads as 1: one fault makes every subregion up to 64 pages dense
        // (1/64 > 1%), not 128 (1/128 < 1%).
        let r = density(&[0; 8], &set(&[300]), &ALL, 0, 512);
        assert_eq!(r, density(&[0; 8], &set(&[300]), &ALL, 1, 512));
        assert_eq!(pages(&r), (256..320).filter(|&p| p != 300).collect::<std::vec::Vec<_>>());
    }

    #[test]
    fn stride_detection() {
        let mut s = Stride::new();
        assert_eq!(s.record(10), None);
        assert_eq!(s.record(13), None);
        assert_eq!(s.record(16), Some(3));
        assert_eq!(s.record(19), Some(3));
        assert_eq!(s.record(19), None, "zero stride");
        assert_eq!(s.record(17), None);
        assert_eq!(s.record(15), Some(-2));
        s.reset();
        assert_eq!(s.record(15), None);
        let mut s = Stride::default();
        for p in [0, u64::MAX, 0] {
            assert_eq!(s.record(p), None, "difference beyond i64");
        }
        let mut s = Stride::new();
        assert_eq!([5, 5, 5].map(|p| s.record(p)), [None, None, None]);
    }
}
