// SPDX-License-Identifier: GPL-2.0
//! Bit sets over the pages of a 2 MiB block (bit `k` of word `k / 64`: page `k`), and the
//! runs of consecutive set bits in them: how the mirror of ordinary memory records what a
//! device maps, and unmaps it run by run; how eviction and the executor ask a driver for
//! a block's accessed bits.
// Compiled into gmem.ko too (`gmem/policy.rs`), which uses only part of it.
#![allow(dead_code, unreachable_pub)]

use super::prefetch::BLOCK_PAGES;

/// A bit per page of a 2 MiB block.
pub type BlockBits = [u64; BLOCK_PAGES / 64];

/// Sets bit `k` of `b` (nothing beyond its end).
pub fn set(b: &mut [u64], k: usize) {
    if let Some(w) = b.get_mut(k / 64) {
        *w |= 1 << (k % 64);
    }
}

/// The set bits of `b`, in order.
pub fn ones(b: &[u64]) -> impl Iterator<Item = usize> + '_ {
    b.iter().enumerate().flat_map(|(w, &word)| {
        let mut left = word;
        core::iter::from_fn(move || {
            if left == 0 {
                return None;
            }
            let k = left.trailing_zeros() as usize;
            left &= left - 1;
            Some(w * 64 + k)
        })
    })
}

/// How many bits of `b` are set.
pub fn count(b: &[u64]) -> u64 {
    b.iter().map(|w| u64::from(w.count_ones())).sum()
}

/// Whether bit `k` of `b` is set (`false` beyond its end).
pub fn test(b: &[u64], k: usize) -> bool {
    b.get(k / 64).is_some_and(|w| w & (1 << (k % 64)) != 0)
}

/// The runs `(first, end)` of consecutive set bits of `b` within bits `lo..hi`, in order.
pub fn runs(b: &[u64], lo: usize, hi: usize) -> Runs<'_> {
    Runs { b, k: lo, hi }
}

/// Iterator of [`runs`].
pub struct Runs<'a> {
    b: &'a [u64],
    k: usize,
    hi: usize,
}

impl Iterator for Runs<'_> {
    type Item = (usize, usize);

    fn next(&mut self) -> Option<(usize, usize)> {
        while self.k < self.hi && !test(self.b, self.k) {
            self.k += 1;
        }
        if self.k >= self.hi {
            return None;
        }
        let first = self.k;
        while self.k < self.hi && test(self.b, self.k) {
            self.k += 1;
        }
        Some((first, self.k))
    }
}

/// Clears bits `lo..hi` of `b`.
pub fn clear(b: &mut [u64], lo: usize, hi: usize) {
    for k in lo..hi {
        if let Some(w) = b.get_mut(k / 64) {
            *w &= !(1 << (k % 64));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::vec::Vec;

    #[test]
    fn runs_within_bounds() {
        let mut b = [0u64; 8];
        for k in [0, 1, 2, 63, 64, 65, 200, 511] {
            b[k / 64] |= 1 << (k % 64);
        }
        let all: Vec<_> = runs(&b, 0, 512).collect();
        assert_eq!(all, [(0, 3), (63, 66), (200, 201), (511, 512)]);
        // Clipped to the bounds: a run cut at either end.
        let some: Vec<_> = runs(&b, 1, 64).collect();
        assert_eq!(some, [(1, 3), (63, 64)]);
        assert_eq!(runs(&b, 3, 63).next(), None);
        assert!(test(&b, 65) && !test(&b, 66) && !test(&b, 600));
        clear(&mut b, 0, 65);
        assert_eq!(runs(&b, 0, 512).collect::<Vec<_>>(), [(65, 66), (200, 201), (511, 512)]);
    }

    #[test]
    fn set_ones_count() {
        let mut b: BlockBits = [0; 8];
        for k in [511, 0, 64, 63, 65, 600] {
            set(&mut b, k);
        }
        // 600 lies beyond the block: not set anywhere.
        assert_eq!(ones(&b).collect::<Vec<_>>(), [0, 63, 64, 65, 511]);
        assert_eq!(count(&b), 5);
        assert!(ones(&[0u64; 8]).next().is_none());
        assert!(test(&b, 65) && !test(&b, 66));
    }
}
