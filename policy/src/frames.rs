// SPDX-License-Identifier: GPL-2.0
//! Device frame allocator over a caller-provided bitmap.
//!
//! A device's memory pool is `nframes` frames of 4 KiB. The kernel keeps the bitmap (one bit
//! per frame, set = in use), the next-fit cursor and the used count in its device structure
//! and wraps a short-lived [`FrameMap`] view around them while it holds the device lock; the
//! view itself owns nothing. A fresh bitmap must be zero (all free) with `used == 0`.
//!
//! Invariants: only bits `< nframes` are ever set; `used` equals the number of set bits
//! (as long as the caller's initial value was right); a failed `free` changes nothing;
//! `alloc` finds a free frame whenever one exists (next-fit from the cursor, wrapping).
#![allow(dead_code, unreachable_pub)]

/// Frames of one 2 MiB device page: a block mapped with one entry uses a naturally
/// aligned run of this many frames.
pub const CHUNK_FRAMES: u64 = 512;

/// Why a frame could not be freed (the map is unchanged).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum FrameError {
    /// The frame number is `>= nframes`.
    OutOfRange,
    /// The frame is not allocated (double free).
    NotAllocated,
}

/// Allocator view over a bitmap, a cursor and a used count kept by the caller.
#[derive(Debug)]
pub struct FrameMap<'a> {
    bits: &'a mut [u64],
    cursor: &'a mut u64,
    used: &'a mut u64,
    nframes: u64,
}

impl<'a> FrameMap<'a> {
    /// Number of `u64` words needed for `nframes` frames (`usize::MAX` if unrepresentable,
    /// which no slice can satisfy).
    pub fn words_for(nframes: u64) -> usize {
        usize::try_from(nframes.div_ceil(64)).unwrap_or(usize::MAX)
    }

    /// Wraps the caller's state. `None` if `bits` is too short or `used > nframes`. Does not
    /// clear the bitmap; an out-of-range cursor restarts at 0.
    pub fn new(bits: &'a mut [u64], cursor: &'a mut u64, used: &'a mut u64, nframes: u64) -> Option<Self> {
        if bits.len() < Self::words_for(nframes) || *used > nframes {
            return None;
        }
        if *cursor >= nframes {
            *cursor = 0;
        }
        Some(FrameMap { bits, cursor, used, nframes })
    }

    /// Word index and bit mask of frame `f` (`None` if out of range).
    fn locate(&self, f: u64) -> Option<(usize, u64)> {
        if f >= self.nframes {
            return None;
        }
        Some((usize::try_from(f / 64).ok()?, 1u64 << (f % 64)))
    }

    /// Lowest free frame in `[lo, hi)` (`hi <= nframes`).
    fn find_free(&self, lo: u64, hi: u64) -> Option<u64> {
        let mut f = lo;
        while f < hi {
            let word = self.bits.get(usize::try_from(f / 64).ok()?)?;
            // Free bits of this word at or above f's bit.
            let free = !word & (u64::MAX << (f % 64));
            let base = f - f % 64;
            if free != 0 {
                let hit = base + u64::from(free.trailing_zeros());
                return (hit < hi).then_some(hit);
            }
            f = base.checked_add(64)?;
        }
        None
    }

    /// Allocates one frame, next-fit from the cursor. `None` if every frame is in use.
    pub fn alloc(&mut self) -> Option<u64> {
        if *self.used >= self.nframes {
            return None;
        }
        let c = *self.cursor;
        let f = self.find_free(c, self.nframes).or_else(|| self.find_free(0, c))?;
        let (w, m) = self.locate(f)?;
        let word = self.bits.get_mut(w)?;
        *word |= m;
        *self.used = self.used.saturating_add(1);
        *self.cursor = if f + 1 < self.nframes { f + 1 } else { 0 };
        Some(f)
    }

    /// Fills `out` with free frames (not necessarily contiguous); returns how many were
    /// filled, which is `out.len()` whenever that many frames are free.
    pub fn alloc_many(&mut self, out: &mut [u64]) -> usize {
        let mut n = 0;
        for slot in out.iter_mut() {
            match self.alloc() {
                Some(f) => *slot = f,
                None => break,
            }
            n += 1;
        }
        n
    }

    /// Takes frame `f` if it is free; `false` (nothing changes) if it is in use or out of
    /// range. Placement hint of the block allocator: a page's frame at a chosen address.
    pub fn alloc_at(&mut self, f: u64) -> bool {
        let Some((w, m)) = self.locate(f) else { return false };
        let Some(word) = self.bits.get_mut(w) else { return false };
        if *word & m != 0 {
            return false;
        }
        *word |= m;
        *self.used = self.used.saturating_add(1);
        true
    }

    /// First frame of a free, naturally aligned run of `CHUNK_FRAMES` frames (one 2 MiB
    /// device page), searched next-fit from the cursor and wrapping; `None` if there is none.
    /// Nothing is taken: the caller places pages in it with [`FrameMap::alloc_at`].
    pub fn free_chunk(&self) -> Option<u64> {
        const WORDS: u64 = CHUNK_FRAMES / 64;
        let chunks = self.nframes / CHUNK_FRAMES;
        if chunks == 0 {
            return None;
        }
        let start = (*self.cursor / CHUNK_FRAMES) % chunks;
        (0..chunks).map(|k| (start + k) % chunks).find_map(|c| {
            let w0 = usize::try_from(c * WORDS).ok()?;
            let words = self.bits.get(w0..w0.checked_add(WORDS as usize)?)?;
            words.iter().all(|w| *w == 0).then_some(c * CHUNK_FRAMES)
        })
    }

    /// Frees frame `f`. On error nothing changes.
    pub fn free(&mut self, f: u64) -> Result<(), FrameError> {
        let (w, m) = self.locate(f).ok_or(FrameError::OutOfRange)?;
        let word = self.bits.get_mut(w).ok_or(FrameError::OutOfRange)?;
        if *word & m == 0 {
            return Err(FrameError::NotAllocated);
        }
        *word &= !m;
        *self.used = self.used.saturating_sub(1);
        Ok(())
    }

    /// Whether frame `f` is allocated (`false` if out of range).
    pub fn is_used(&self, f: u64) -> bool {
        match self.locate(f) {
            Some((w, m)) => self.bits.get(w).is_some_and(|word| word & m != 0),
            None => false,
        }
    }

    /// Number of allocated frames.
    pub fn used(&self) -> u64 {
        *self.used
    }

    /// Capacity in frames.
    pub fn nframes(&self) -> u64 {
        self.nframes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_until_full_then_free() {
        let (mut bits, mut cur, mut used) = ([0u64; 2], 0, 0);
        let mut m = FrameMap::new(&mut bits, &mut cur, &mut used, 70).unwrap();
        for i in 0..70 {
            assert_eq!(m.alloc(), Some(i));
        }
        assert_eq!(m.alloc(), None, "frames >= nframes are never handed out");
        assert_eq!(m.used(), 70);
        assert_eq!(m.free(70), Err(FrameError::OutOfRange));
        assert_eq!(m.free(3), Ok(()));
        assert_eq!(m.free(3), Err(FrameError::NotAllocated));
        assert!(!m.is_used(3) && m.is_used(4));
        assert_eq!(m.alloc(), Some(3));
        assert_eq!(m.used(), 70);
    }

    #[test]
    fn next_fit_moves_on_and_wraps() {
        let (mut bits, mut cur, mut used) = ([0u64; 1], 0, 0);
        let mut m = FrameMap::new(&mut bits, &mut cur, &mut used, 8).unwrap();
        assert_eq!((m.alloc(), m.alloc()), (Some(0), Some(1)));
        m.free(0).unwrap();
        assert_eq!(m.alloc(), Some(2), "next-fit does not go back to 0 yet");
        let mut out = [0u64; 6];
        assert_eq!(m.alloc_many(&mut out), 6);
        assert_eq!(out, [3, 4, 5, 6, 7, 0]);
        // The view is gone; the state lives in the caller's storage.
        assert_eq!((bits[0], used, cur), (0xff, 8, 1));
    }

    #[test]
    fn fragmented_alloc_many() {
        let n = 1000u64;
        let (mut bits, mut cur, mut used) = ([0u64; 16], 0, 0);
        let mut m = FrameMap::new(&mut bits, &mut cur, &mut used, n).unwrap();
        let mut all = [0u64; 1000];
        assert_eq!(m.alloc_many(&mut all), 1000);
        for f in (0..n).step_by(2) {
            m.free(f).unwrap();
        }
        let mut half = [u64::MAX; 500];
        assert_eq!(m.alloc_many(&mut half), 500);
        half.sort_unstable();
        assert!(half.iter().copied().eq((0..n).step_by(2)));
        assert_eq!(m.used(), n);
        assert_eq!(m.alloc_many(&mut half[..1]), 0);
    }

    #[test]
    fn chunks_are_aligned_free_runs_and_alloc_at_places_pages() {
        let n = 3 * CHUNK_FRAMES + 100;
        let (mut bits, mut cur, mut used) = ([0u64; 30], 0, 0);
        let mut m = FrameMap::new(&mut bits, &mut cur, &mut used, n).unwrap();
        assert_eq!(m.free_chunk(), Some(0));
        assert!(m.alloc_at(5));
        assert!(!m.alloc_at(5), "a frame in use is not taken twice");
        assert!(!m.alloc_at(n), "out of range");
        assert_eq!(m.used(), 1);
        assert_eq!(m.free_chunk(), Some(CHUNK_FRAMES), "chunk 0 has a frame in use");
        assert!(m.alloc_at(2 * CHUNK_FRAMES - 1));
        assert_eq!(m.free_chunk(), Some(2 * CHUNK_FRAMES));
        assert!(m.alloc_at(2 * CHUNK_FRAMES + 300));
        assert_eq!(m.free_chunk(), None, "the 100 frames past the last whole chunk do not count");
        m.free(5).unwrap();
        assert_eq!(m.free_chunk(), Some(0));
        assert_eq!(m.used(), 2);
    }

    #[test]
    fn new_rejects_bad_input() {
        let (mut bits, mut cur, mut used) = ([0u64; 1], 99, 0);
        assert!(FrameMap::new(&mut bits, &mut cur, &mut used, 65).is_none());
        used = 65;
        assert!(FrameMap::new(&mut bits, &mut cur, &mut used, 64).is_none());
        used = 0;
        assert!(FrameMap::new(&mut bits, &mut cur, &mut used, 64).is_some());
        assert_eq!(cur, 0, "out-of-range cursor restarts");
        assert_eq!(FrameMap::words_for(0), 0);
        assert_eq!(FrameMap::words_for(129), 3);
    }
}
