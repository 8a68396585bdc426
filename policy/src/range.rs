// SPDX-License-Identifier: GPL-2.0
//! User range validation and rounding, and the per-region advice interval map.
//!
//! `outward`/`inward` turn a user byte range `[addr, addr + len)` into page indices relative
//! to a region `[start, start + size)`: the byte range itself must lie inside the region, and
//! every sum is checked, so no input can overflow. `outward` covers every page the range
//! touches (advice), `inward` only the pages it covers entirely (DONTNEED: a partly covered
//! page keeps its data).
//!
//! [`AdviceMap`] invariants: its runs are sorted, non-overlapping, non-empty, carry nonzero
//! bits (gaps mean 0), and two touching runs never carry equal bits, so the representation
//! of a given per-page function is unique and `runs()` is minimal. An update that would need
//! more than `N` runs fails with [`Full`] and leaves the map unchanged.
#![allow(dead_code, unreachable_pub)]

/// log2 of the page size.
pub const PAGE_SHIFT: u32 = 12;
/// Page size in bytes.
pub const PAGE_SIZE: u64 = 4096;
const PAGE_MASK: u64 = PAGE_SIZE - 1;

/// Pages `[first, first + count)`, indices relative to the region start.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct PageRange {
    /// First page index.
    pub first: u64,
    /// Number of pages.
    pub count: u64,
}

/// Why a range or size is invalid.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum RangeError {
    /// Zero length / size.
    Empty,
    /// An end address overflows, or a size exceeds the maximum.
    Overflow,
    /// The range is not inside the region.
    OutOfRegion,
    /// The region or size is not page aligned.
    Unaligned,
}

/// Checks the region and the byte range; returns the region-relative byte bounds
/// `(addr - start, addr + len - start)`.
fn relative(start: u64, size: u64, addr: u64, len: u64) -> Result<(u64, u64), RangeError> {
    if start & PAGE_MASK != 0 || size & PAGE_MASK != 0 {
        return Err(RangeError::Unaligned);
    }
    if len == 0 {
        return Err(RangeError::Empty);
    }
    let end = addr.checked_add(len).ok_or(RangeError::Overflow)?;
    let region_end = start.checked_add(size).ok_or(RangeError::Overflow)?;
    if addr < start || end > region_end {
        return Err(RangeError::OutOfRegion);
    }
    // addr >= start and end <= region_end were just checked.
    Ok((addr - start, end - start))
}

/// `[addr, addr + len)` widened outward to page bounds; it must lie within the region
/// `[start, start + size)` (`start`, `size` page aligned, else `Unaligned`). `len == 0` is
/// `Empty`.
pub fn outward(start: u64, size: u64, addr: u64, len: u64) -> Result<PageRange, RangeError> {
    let (lo, hi) = relative(start, size, addr, len)?;
    let first = lo >> PAGE_SHIFT;
    // hi <= size, which is page aligned, so rounding up cannot overflow (checked anyway).
    let last = hi.checked_add(PAGE_MASK).ok_or(RangeError::Overflow)? >> PAGE_SHIFT;
    Ok(PageRange { first, count: last - first })
}

/// `[addr, addr + len)` narrowed inward to the pages it covers entirely; the count may be 0
/// (`Ok` with `count == 0`). Same errors as [`outward`], including `Empty` for `len == 0`.
pub fn inward(start: u64, size: u64, addr: u64, len: u64) -> Result<PageRange, RangeError> {
    let (lo, hi) = relative(start, size, addr, len)?;
    let first = lo.checked_add(PAGE_MASK).ok_or(RangeError::Overflow)? >> PAGE_SHIFT;
    let last = hi >> PAGE_SHIFT;
    Ok(PageRange { first, count: last.saturating_sub(first) })
}

/// Validates an allocation size: nonzero (else `Empty`), a multiple of `PAGE_SIZE` (else
/// `Unaligned`), at most `max` (else `Overflow`). Returns the number of pages.
pub fn alloc_size(size: u64, max: u64) -> Result<u64, RangeError> {
    if size == 0 {
        Err(RangeError::Empty)
    } else if size & PAGE_MASK != 0 {
        Err(RangeError::Unaligned)
    } else if size > max {
        Err(RangeError::Overflow)
    } else {
        Ok(size >> PAGE_SHIFT)
    }
}

/// An [`AdviceMap`] update would need more runs than its capacity.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Full;

/// One run of pages `[first, end)` with nonzero advice bits.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Run {
    first: u64,
    end: u64,
    bits: u32,
}

impl Run {
    const ZERO: Run = Run { first: 0, end: 0, bits: 0 };
}

/// Fixed-capacity map from page index to `u32` advice bits, as at most `N` runs (invariants
/// in the module documentation). Updates build the new run list in an `N`-entry scratch
/// array on the stack (24 bytes per entry): keep `N` small in the kernel.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct AdviceMap<const N: usize> {
    runs: [Run; N],
    len: usize,
}

/// Appends runs to a scratch array, dropping zero bits and merging equal touching runs.
struct Builder<const N: usize> {
    runs: [Run; N],
    len: usize,
}

impl<const N: usize> Builder<N> {
    fn push(&mut self, first: u64, end: u64, bits: u32) -> Result<(), Full> {
        if first >= end || bits == 0 {
            return Ok(());
        }
        if let Some(prev) = self.len.checked_sub(1).and_then(|i| self.runs.get_mut(i)) {
            if prev.end == first && prev.bits == bits {
                prev.end = end;
                return Ok(());
            }
        }
        let slot = self.runs.get_mut(self.len).ok_or(Full)?;
        *slot = Run { first, end, bits };
        self.len += 1;
        Ok(())
    }
}

impl<const N: usize> Default for AdviceMap<N> {
    fn default() -> Self {
        Self::new()
    }
}

impl<const N: usize> AdviceMap<N> {
    /// An empty map: every page has advice 0.
    pub const fn new() -> Self {
        AdviceMap { runs: [Run::ZERO; N], len: 0 }
    }

    fn live(&self) -> &[Run] {
        self.runs.get(..self.len).unwrap_or(&[])
    }

    /// Replaces the bits `b` of every page in `r` by `op(b)`.
    fn update(&mut self, r: PageRange, op: impl Fn(u32) -> u32) -> Result<(), Full> {
        // A range reaching past u64::MAX pages is clamped (no real region is that large).
        let (lo, hi) = (r.first, r.first.saturating_add(r.count));
        if lo >= hi {
            return Ok(());
        }
        let mut out = Builder::<N> { runs: [Run::ZERO; N], len: 0 };
        // Position up to which the result has been emitted.
        let mut pos = lo;
        for run in self.live() {
            // Part before the range: unchanged.
            out.push(run.first, run.end.min(lo), run.bits)?;
            // Gap inside the range before this run.
            out.push(pos, run.first.min(hi), op(0))?;
            // Overlap with the range.
            let (a, b) = (run.first.max(lo), run.end.min(hi));
            out.push(a, b, op(run.bits))?;
            pos = pos.max(b);
            // Part after the range: unchanged. If it exists, `pos == hi` already (the gap or
            // the overlap reached `hi`), so the output stays sorted.
            out.push(run.first.max(hi), run.end, run.bits)?;
        }
        // Trailing gap inside the range (empty if a run reached past `hi`).
        out.push(pos, hi, op(0))?;
        self.runs = out.runs;
        self.len = out.len;
        Ok(())
    }

    /// ORs `bits` into every page of `r`.
    pub fn set(&mut self, r: PageRange, bits: u32) -> Result<(), Full> {
        self.update(r, |b| b | bits)
    }

    /// Clears `bits` in every page of `r`.
    pub fn clear(&mut self, r: PageRange, bits: u32) -> Result<(), Full> {
        self.update(r, |b| b & !bits)
    }

    /// Replaces the bits `b` of every page by `op(b)`, where `op` leaves unadvised pages
    /// unadvised (`op(0) == 0`; otherwise nothing changes and the result is `Err(Full)`).
    /// It never needs more runs than the map holds: runs only merge or go.
    pub fn update_all(&mut self, op: impl Fn(u32) -> u32) -> Result<(), Full> {
        if op(0) != 0 {
            return Err(Full);
        }
        self.update(PageRange { first: 0, count: u64::MAX }, op)
    }

    /// Drops all advice of the pages of `r` (their memory went away). This cannot fail:
    /// when clearing `r` alone would split a run and the map has no room for the extra
    /// run, the runs that `r` cuts are dropped whole. Their pages outside `r` lose their
    /// advice too, which is a hint, not data. Returns whether that happened.
    pub fn forget(&mut self, r: PageRange) -> bool {
        if self.update(r, |_| 0).is_ok() {
            return false;
        }
        // Widened to the runs holding the range's first and last pages: no run is split
        // any more, runs only go, so the update needs no room.
        let (lo, hi) = (r.first, r.first.saturating_add(r.count));
        let runs = self.live();
        let first = runs.iter().find(|run| run.first <= lo && lo < run.end).map_or(lo, |run| run.first);
        let end = runs.iter().find(|run| run.first < hi && hi <= run.end).map_or(hi, |run| run.end);
        let wide = PageRange { first, count: end - first };
        // Never `Full` (see above); if it were, the map would be left as it was.
        let _ = self.update(wide, |_| 0);
        true
    }

    /// The advice bits of `page`.
    pub fn get(&self, page: u64) -> u32 {
        let runs = self.live();
        let i = runs.partition_point(|run| run.end <= page);
        match runs.get(i) {
            Some(run) if run.first <= page => run.bits,
            _ => 0,
        }
    }

    /// Number of runs stored (runs with nonzero bits).
    pub fn runs(&self) -> usize {
        self.len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn update_all_rewrites_every_run_and_merges() {
        let mut m = AdviceMap::<4>::new();
        m.set(PageRange { first: 0, count: 10 }, 0b01).unwrap();
        m.set(PageRange { first: 10, count: 10 }, 0b11).unwrap();
        m.set(PageRange { first: 30, count: 5 }, 0b10).unwrap();
        assert_eq!(m.runs(), 3);
        // Clearing bit 1 everywhere: [0, 20) merges into one run, [30, 35) goes.
        m.update_all(|b| b & !0b10).unwrap();
        assert_eq!(m.runs(), 1);
        assert_eq!((m.get(0), m.get(19), m.get(20), m.get(30)), (0b01, 0b01, 0, 0));
        // An op that would advise unadvised pages is refused, and changes nothing.
        let before = m;
        assert_eq!(m.update_all(|b| b | 0b100), Err(Full));
        assert_eq!(m, before);
    }

    const MB: u64 = 1 << 20;

    #[test]
    fn outward_widens_and_inward_narrows() {
        let (s, z) = (16 * MB, 4 * MB);
        assert_eq!(outward(s, z, s + 100, 5000), Ok(PageRange { first: 0, count: 2 }));
        assert_eq!(inward(s, z, s + 100, 5000), Ok(PageRange { first: 1, count: 0 }));
        assert_eq!(inward(s, z, s + 100, 9000), Ok(PageRange { first: 1, count: 1 }));
        assert_eq!(outward(s, z, s + 4096, 4096), Ok(PageRange { first: 1, count: 1 }));
        assert_eq!(inward(s, z, s, z), Ok(PageRange { first: 0, count: 1024 }));
    }

    #[test]
    fn range_errors() {
        let (s, z) = (16 * MB, 4 * MB);
        assert_eq!(outward(s, z, s, 0), Err(RangeError::Empty));
        assert_eq!(inward(s, z, s, 0), Err(RangeError::Empty));
        assert_eq!(outward(s, z, s - 1, 2), Err(RangeError::OutOfRegion));
        assert_eq!(outward(s, z, s + z - 1, 2), Err(RangeError::OutOfRegion));
        assert_eq!(outward(s, z, u64::MAX, 2), Err(RangeError::Overflow));
        assert_eq!(outward(u64::MAX - 4095, 8192, u64::MAX - 4095, 1), Err(RangeError::Overflow));
        assert_eq!(outward(s + 1, z, s + 1, 1), Err(RangeError::Unaligned));
    }

    #[test]
    fn range_reaching_top_of_address_space() {
        let s = u64::MAX - 2 * PAGE_SIZE + 1;
        assert_eq!(outward(s, PAGE_SIZE, s + 5, 10), Ok(PageRange { first: 0, count: 1 }));
    }

    #[test]
    fn alloc_sizes() {
        assert_eq!(alloc_size(0, 1 << 40), Err(RangeError::Empty));
        assert_eq!(alloc_size(4097, 1 << 40), Err(RangeError::Unaligned));
        assert_eq!(alloc_size(1 << 41, 1 << 40), Err(RangeError::Overflow));
        assert_eq!(alloc_size(1 << 40, 1 << 40), Ok(1 << 28));
    }

    fn pr(first: u64, count: u64) -> PageRange {
        PageRange { first, count }
    }

    #[test]
    fn advice_splits_and_merges() {
        let mut m = AdviceMap::<4>::new();
        m.set(pr(10, 10), 1).unwrap();
        m.set(pr(14, 2), 2).unwrap();
        assert_eq!(m.runs(), 3);
        assert_eq!((m.get(13), m.get(14), m.get(15), m.get(16), m.get(20)), (1, 3, 3, 1, 0));
        m.clear(pr(0, 100), 2).unwrap();
        assert_eq!(m.runs(), 1, "equal neighbours merge back");
        m.set(pr(20, 5), 1).unwrap();
        assert_eq!(m.runs(), 1, "touching run with equal bits merges");
        assert_eq!(m.get(24), 1);
        m.clear(pr(0, 100), 1).unwrap();
        assert_eq!(m.runs(), 0);
    }

    #[test]
    fn advice_full_leaves_map_unchanged() {
        let mut m = AdviceMap::<2>::new();
        m.set(pr(0, 2), 1).unwrap();
        m.set(pr(4, 2), 1).unwrap();
        let before = m;
        assert_eq!(m.set(pr(8, 1), 1), Err(Full));
        assert_eq!(m, before);
        assert_eq!(m.clear(pr(1, 0), 1), Ok(()), "empty range is a no-op");
        assert_eq!(m.set(pr(u64::MAX - 1, 5), 4), Err(Full));
        assert_eq!(m, before);
    }

    #[test]
    fn forget_cuts_or_drops_whole_runs_when_full() {
        let mut m = AdviceMap::<2>::new();
        m.set(pr(0, 10), 1).unwrap();
        // Room for the split: only the range goes.
        assert!(!m.forget(pr(4, 2)));
        assert_eq!((m.get(3), m.get(4), m.get(5), m.get(6), m.runs()), (1, 0, 0, 1, 2));
        // No room for another split: the run the range cuts goes whole, the other stays.
        assert!(m.forget(pr(7, 1)));
        assert_eq!((m.get(0), m.get(3), m.get(6), m.get(9), m.runs()), (1, 1, 0, 0, 1));
        // Past every run, and empty: nothing to do.
        assert!(!m.forget(pr(100, 5)));
        assert!(!m.forget(pr(0, 0)));
        assert_eq!(m.runs(), 1);
    }

    proptest::proptest! {
        /// `forget` never fails, leaves no advice in its range, and changes a page outside
        /// it only when it reports dropping whole runs, and then only pages of a run that
        /// the range cut.
        #[test]
        fn forget_clears_its_range_and_only_cut_runs_beyond(
            sets in proptest::collection::vec((0u64..64, 1u64..16, 1u32..4), 0..12),
            lo in 0u64..80,
            n in 0u64..40,
        ) {
            let mut m = AdviceMap::<4>::new();
            for &(first, count, bits) in &sets {
                let _ = m.set(pr(first, count), bits);
            }
            let before = m;
            let widened = m.forget(pr(lo, n));
            for page in 0..100u64 {
                let inside = page >= lo && page < lo + n;
                if inside {
                    proptest::prop_assert_eq!(m.get(page), 0);
                } else if m.get(page) != before.get(page) {
                    proptest::prop_assert!(widened, "page {} changed", page);
                    proptest::prop_assert_eq!(m.get(page), 0);
                    // It lay in a run that reached into the range: every page from it to
                    // the range carried advice before.
                    let (a, b) = if page < lo { (page, lo) } else { (lo + n, page + 1) };
                    proptest::prop_assert!((a..b).all(|q| before.get(q) != 0));
                }
            }
        }
    }
}
