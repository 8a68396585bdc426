// SPDX-License-Identifier: GPL-2.0
//! Coalescing of a batch of device fault addresses.
//!
//! A device reports faults in batches with arbitrary order and duplicates. [`coalesce`]
//! turns the batch, in place and without allocating, into the sorted list of distinct page
//! addresses; [`by_block`] then splits it into runs inside one 2 MiB block, so the glue can
//! take each block's lock once and handle its pages together.
//!
//! Invariants: after `n = coalesce(a)`, `a[..n]` is strictly increasing, every element is
//! page aligned, and the set `a[..n]` equals the set of page-aligned inputs. `by_block`
//! yields non-empty, consecutive sub-slices that together are the whole input, each lying in
//! one block; on sorted input no two of them share a block.
#![allow(dead_code, unreachable_pub)]

/// log2 of the block size (2 MiB) used by [`by_block`].
pub const BLOCK_SHIFT: u32 = 21;
const PAGE_MASK: u64 = (1 << 12) - 1;

/// Page-aligns every address, sorts ascending and removes duplicates, in place. Returns the
/// new length (the unique prefix); the rest of the slice is unspecified.
pub fn coalesce(addrs: &mut [u64]) -> usize {
    for a in addrs.iter_mut() {
        *a &= !PAGE_MASK;
    }
    addrs.sort_unstable();
    // Compact in place: `addrs[..n]` is the unique prefix of `addrs[..i]`, and `n <= i`, so
    // every index below is in bounds.
    let mut n: usize = 0;
    for i in 0..addrs.len() {
        let a = addrs[i];
        if n == 0 || addrs[n - 1] != a {
            addrs[n] = a;
            n += 1;
        }
    }
    n
}

/// Splits a sorted slice into maximal runs that lie in the same 2 MiB block.
pub fn by_block(addrs: &[u64]) -> BlockIter<'_> {
    BlockIter { rest: addrs }
}

/// Iterator of [`by_block`].
#[derive(Clone, Debug)]
pub struct BlockIter<'a> {
    rest: &'a [u64],
}

impl<'a> Iterator for BlockIter<'a> {
    type Item = &'a [u64];

    fn next(&mut self) -> Option<&'a [u64]> {
        let block = self.rest.first()? >> BLOCK_SHIFT;
        let n = self.rest.iter().position(|a| a >> BLOCK_SHIFT != block).unwrap_or(self.rest.len());
        let (run, rest) = self.rest.split_at(n);
        self.rest = rest;
        Some(run)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coalesce_aligns_sorts_dedups() {
        let mut a = [0x5123, 0x1000, 0x5fff, 0x1001, 0x0, u64::MAX];
        let n = coalesce(&mut a);
        assert_eq!(&a[..n], &[0x0, 0x1000, 0x5000, !0xfff]);
        let mut e: [u64; 0] = [];
        assert_eq!(coalesce(&mut e), 0);
    }

    #[test]
    fn blocks_split_at_2mib() {
        let b = 1u64 << BLOCK_SHIFT;
        let a = [0, 0x1000, b - 0x1000, b, 3 * b, 3 * b + 0x5000];
        let mut it = by_block(&a);
        assert_eq!(it.next(), Some(&a[..3]));
        assert_eq!(it.next(), Some(&a[3..4]));
        assert_eq!(it.next(), Some(&a[4..]));
        assert_eq!(it.next(), None);
        assert_eq!(by_block(&[]).count(), 0);
    }
}
