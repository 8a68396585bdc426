// SPDX-License-Identifier: GPL-2.0
//! Property tests of `prefetch`: `density` against a per-page reference of UVM's rule
//! (largest dense subregion per faulted page) and its documented bounds; `sequential`
//! and `Stride` against direct references.

use gmem_policy::prefetch::{chain_next, chain_start, density, density_counting, sequential, Stride, BLOCK_PAGES};
use proptest::prelude::*;

type Bm = [u64; 8];

fn get(m: &Bm, p: usize) -> bool {
    m[p / 64] & (1 << (p % 64)) != 0
}

fn count(m: &Bm) -> usize {
    m.iter().map(|w| w.count_ones() as usize).sum()
}

/// UVM's rule, page by page: for each faulted page, the largest aligned power-of-two
/// subregion (2..=512 pages) in which more than `t`% of the valid pages are populated.
fn reference(r: &Bm, f: &Bm, v: &Bm, t: u32) -> Bm {
    let t = t.clamp(1, 100) as usize;
    let mut out = [0u64; 8];
    for p in (0..BLOCK_PAGES).filter(|&p| get(f, p)) {
        let mut best = None;
        let mut size = 2;
        while size <= BLOCK_PAGES {
            let start = p / size * size;
            let sub = start..start + size;
            let nvalid = sub.clone().filter(|&q| get(v, q)).count();
            let pop = sub.clone().filter(|&q| get(v, q) && (get(r, q) || get(f, q))).count();
            if nvalid > 0 && pop * 100 > t * nvalid {
                best = Some(sub);
            }
            size *= 2;
        }
        for q in best.into_iter().flatten() {
            if get(v, q) && !get(r, q) && !get(f, q) {
                out[q / 64] |= 1 << (q % 64);
            }
        }
    }
    out
}

fn word() -> impl Strategy<Value = u64> {
    prop_oneof![
        1 => Just(0u64),
        1 => Just(u64::MAX),
        2 => any::<u64>(),
        2 => (any::<u64>(), any::<u64>()).prop_map(|(a, b)| a & b),
        2 => (any::<u64>(), any::<u64>()).prop_map(|(a, b)| a | b),
        1 => (0u32..64).prop_map(|n| u64::MAX.checked_shr(n).unwrap_or(0)),
    ]
}

fn bitmap() -> impl Strategy<Value = Bm> {
    prop::array::uniform8(word())
}

/// Sparse fault batches are the common case.
fn faults() -> impl Strategy<Value = Bm> {
    prop_oneof![
        bitmap(),
        prop::collection::vec(0usize..BLOCK_PAGES, 0..6).prop_map(|ps| {
            let mut m = [0u64; 8];
            for p in ps {
                m[p / 64] |= 1 << (p % 64);
            }
            m
        }),
    ]
}

fn valid() -> impl Strategy<Value = Bm> {
    prop_oneof![
        Just([u64::MAX; 8]),
        (1usize..=BLOCK_PAGES).prop_map(|end| {
            let mut m = [0u64; 8];
            for p in 0..end {
                m[p / 64] |= 1 << (p % 64);
            }
            m
        }),
        bitmap(),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn density_bounds_and_reference(
        r in bitmap(), f in faults(), v in valid(),
        t in prop_oneof![8 => 1u32..=100, 1 => Just(51u32), 1 => any::<u32>()],
        max in prop_oneof![Just(BLOCK_PAGES), 0usize..600],
    ) {
        let got = density(&r, &f, &v, t, max);
        for i in 0..8 {
            prop_assert_eq!(got[i] & !v[i], 0, "outside valid");
            prop_assert_eq!(got[i] & (r[i] | f[i]), 0, "already there");
        }
        prop_assert!(count(&got) <= max);
        let full = density(&r, &f, &v, t, BLOCK_PAGES);
        prop_assert_eq!(full, reference(&r, &f, &v, t));
        // A cap keeps a subset of the uncapped answer, as much of it as allowed.
        for i in 0..8 {
            prop_assert_eq!(got[i] & !full[i], 0);
        }
        prop_assert_eq!(count(&got), max.min(count(&full)));
        if t >= 100 {
            prop_assert_eq!(got, [0u64; 8]);
        }
    }

    /// A 64-page subregion that is at least 52% resident or faulted (with a fault in it)
    /// ends up complete under UVM's threshold of 51%.
    #[test]
    fn dense_64_page_subregion_is_completed(
        mut r in bitmap(), mut f in faults(), mut v in valid(),
        s in 0usize..8, pop in any::<u64>().prop_filter("at least 34 of 64", |p| p.count_ones() >= 34),
        split in any::<u64>(), extra in any::<u64>(),
    ) {
        v[s] = pop | extra;
        f[s] = (pop & split) | (pop & pop.wrapping_neg());
        r[s] = pop & !f[s];
        for i in 0..8 {
            r[i] &= v[i];
            f[i] &= v[i];
        }
        let got = density(&r, &f, &v, 51, BLOCK_PAGES);
        prop_assert_eq!((got[s] | r[s] | f[s]) & v[s], v[s]);
    }

    /// A block whose every valid page is resident or faulted has nothing to prefetch,
    /// whatever the rule counts (the early return for a block with no candidates).
    #[test]
    fn nothing_absent_prefetches_nothing(
        r in bitmap(), f in faults(), v in valid(), t in any::<u32>(),
        max in prop_oneof![Just(BLOCK_PAGES), 0usize..600], counted in any::<bool>(),
    ) {
        let mut r = r;
        for i in 0..8 {
            r[i] |= v[i] & !f[i];
        }
        prop_assert_eq!(density_counting(&r, &f, &v, t, max, counted), [0u64; 8]);
        prop_assert_eq!(reference(&r, &f, &v, t), [0u64; 8]);
    }

    #[test]
    fn threshold_100_prefetches_nothing(r in bitmap(), f in faults(), v in valid()) {
        prop_assert_eq!(density(&r, &f, &v, 100, BLOCK_PAGES), [0u64; 8]);
    }

    #[test]
    fn stride_matches_reference(
        pages in prop::collection::vec(prop_oneof![0u64..20, any::<u64>()], 0..40)
    ) {
        let mut s = Stride::new();
        for (i, &p) in pages.iter().enumerate() {
            let got = s.record(p);
            let want = if i >= 2 {
                let (a, b, c) = (pages[i - 2] as i128, pages[i - 1] as i128, p as i128);
                let (d1, d2) = (b - a, c - b);
                (d1 == d2 && d1 != 0).then(|| i64::try_from(d1).ok()).flatten()
            } else {
                None
            };
            prop_assert_eq!(got, want);
        }
    }

    #[test]
    fn arithmetic_sequences_are_detected(start in 0u64..1 << 40, d in -1000i64..1000, n in 3usize..20) {
        prop_assume!(d != 0);
        let mut s = Stride::new();
        for k in 0..n {
            let p = (start as i64 + d * k as i64 + 1_000_000) as u64;
            let got = s.record(p);
            prop_assert_eq!(got, if k >= 2 { Some(d) } else { None });
        }
    }

    #[test]
    fn sequential_matches_reference(
        r in bitmap(),
        m in bitmap(),
        v in bitmap(),
        k in 0usize..BLOCK_PAGES,
        after in any::<bool>(),
    ) {
        let streaming = if k == 0 { after } else { get(&v, k - 1) && get(&m, k - 1) };
        let want = streaming.then(|| {
            let mut m = [0u64; 8];
            for q in (k + 1..BLOCK_PAGES).filter(|&q| get(&v, q) && !get(&r, q)) {
                m[q / 64] |= 1 << (q % 64);
            }
            m
        });
        prop_assert_eq!(sequential(&r, &m, &v, k, after), want);
    }
}

/// Read-ahead's chain against a reader streaming forward through `blocks` blocks: the
/// protocol of `gmem/mech/readahead.rs` (one token; a fault asks with `chain_start` when
/// the token is free, a worker hands on with `chain_next`), driven by random events.
#[derive(Debug, Clone)]
enum Ev {
    /// The reader moves on by this many blocks and faults there (asks).
    Fault(usize),
    /// The token holder's copies started: it hands on.
    HandOn,
    /// The device's room changes the depth (2 or 3).
    Depth(usize),
}

const MAX_DEPTH: usize = 3;

struct Chain {
    blocks: usize,
    at: usize,
    depth: usize,
    /// The block whose worker holds the token.
    holder: Option<usize>,
    to: Option<usize>,
    queued: Vec<usize>,
}

impl Chain {
    fn queue(&mut self, b: usize) -> bool {
        if b >= self.blocks {
            return false;
        }
        // Each block at most once in a forward pass, never behind or beyond the reader's
        // depth when queued.
        assert!(!self.queued.contains(&b), "block {b} queued twice: {:?}", self.queued);
        assert!(b > self.at && b - self.at <= MAX_DEPTH, "block {b} queued with the reader at {}", self.at);
        self.queued.push(b);
        self.holder = Some(b);
        self.to = Some(b + 1);
        true
    }

    fn ask(&mut self) {
        if self.holder.is_some() {
            return;
        }
        if let Some(s) = chain_start(self.at + 1, self.at, self.to, self.depth, MAX_DEPTH) {
            self.queue(s);
        }
    }

    fn hand_on(&mut self) {
        let Some(done) = self.holder.take() else { return };
        if let Some(n) = chain_next(done, self.at, self.depth) {
            self.queue(n);
        }
    }
}

fn chain_event() -> impl Strategy<Value = Ev> {
    prop_oneof![
        2 => (0usize..3).prop_map(Ev::Fault),
        3 => Just(Ev::HandOn),
        1 => (2usize..=3).prop_map(Ev::Depth),
    ]
}

proptest! {
    /// No block is queued twice or outside the reader's depth, and once the chain has run
    /// out after a fault, every block within the depth of that fault is queued.
    #[test]
    fn chain_queues_each_block_once_and_covers_the_depth(
        blocks in 4usize..40,
        evs in prop::collection::vec(chain_event(), 0..120),
    ) {
        let mut c = Chain { blocks, at: 0, depth: MAX_DEPTH, holder: None, to: None, queued: Vec::new() };
        c.ask();
        for ev in evs {
            match ev {
                Ev::Fault(k) => {
                    c.at = (c.at + k).min(blocks - 1);
                    c.ask();
                }
                Ev::HandOn => c.hand_on(),
                Ev::Depth(d) => c.depth = d,
            }
        }
        // Quiesce: a fault at the reader's block, then hand-ons until the token is free.
        c.ask();
        while c.holder.is_some() {
            c.hand_on();
        }
        for b in c.at + 1..=(c.at + c.depth).min(blocks - 1) {
            prop_assert!(c.queued.contains(&b), "block {} not queued; reader at {}, queued {:?}", b, c.at, c.queued);
        }
    }
}
