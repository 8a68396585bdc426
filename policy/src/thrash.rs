// SPDX-License-Identifier: GPL-2.0
//! Thrashing detection (like NVIDIA UVM's): pages that keep migrating are first throttled,
//! then pinned where they are and mapped remotely for a while.
//!
//! A [`ThrashTable`] tracks up to `N` pages (keyed by page address) in a fixed array. A
//! page's moves form a burst while each one follows the previous one within
//! `ThrashParams::window_ns` (UVM's "lapse"); a longer pause starts a new burst. From the
//! `moves`-th move of a burst on, every move is answered with [`Verdict::Throttle`]; the
//! `throttles_to_pin`-th throttle of a burst becomes [`Verdict::PinRemote`] instead, after
//! which the page counts as pinned-remote for `pin_ns` and its counters restart. A page
//! with no entry (never seen, or dropped from the table) is not thrashing.
//!
//! Invariants: at most `N` entries are in use (a new page replaces the least recently
//! updated entry once the table is full); a page has at most one entry; a page whose moves
//! are always more than `window_ns` apart is never throttled; `events` counts the
//! Throttle/PinRemote verdicts given. All time arithmetic saturates, so a clock that goes
//! backwards or huge parameters cannot overflow (a move "before" the previous one counts as
//! immediately after it).
#![allow(dead_code, unreachable_pub)]

/// What to do with the next migration request of a page.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Verdict {
    /// Migrate normally.
    Migrate,
    /// The page is thrashing: delay the migration (or map remotely once).
    Throttle,
    /// Keep the page where it is and map it remotely until the pin expires.
    PinRemote,
}

/// Tunables of [`ThrashTable`].
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct ThrashParams {
    /// Longest pause between two moves of one burst.
    pub window_ns: u64,
    /// Moves within a burst from which on the page is throttled (0 reads as 1).
    pub moves: u32,
    /// Throttles within a burst that pin the page remotely (0 reads as 1).
    pub throttles_to_pin: u32,
    /// How long a remote pin lasts.
    pub pin_ns: u64,
}

impl ThrashParams {
    /// UVM-like defaults: 500 µs window, 3 moves, 10 throttles, pin for 300 windows.
    pub const DEFAULT: ThrashParams =
        ThrashParams { window_ns: 500_000, moves: 3, throttles_to_pin: 10, pin_ns: 150_000_000 };
}

impl Default for ThrashParams {
    fn default() -> Self {
        ThrashParams::DEFAULT
    }
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    used: bool,
    page: u64,
    /// Time of the last update (last move): the LRU key and the burst clock.
    last_ns: u64,
    /// Moves in the current burst.
    moves: u32,
    /// Throttles in the current burst.
    throttles: u32,
    /// Pinned-remote while `now < pin_until`.
    pin_until: u64,
}

impl Entry {
    const EMPTY: Entry = Entry { used: false, page: 0, last_ns: 0, moves: 0, throttles: 0, pin_until: 0 };
}

/// Fixed-capacity thrashing table (see the module documentation).
#[derive(Clone, Debug)]
pub struct ThrashTable<const N: usize> {
    e: [Entry; N],
    events: u64,
    /// No entry is pinned-remote at or after this time: the latest `pin_until` set since
    /// entries were last forgotten (then the latest of those left); an upper bound once an
    /// entry is replaced. A fault's pages ask [`ThrashTable::pinned`] one by one, and
    /// before this bound the table of stale entries was scanned for each of them.
    pin_horizon: u64,
}

impl<const N: usize> ThrashTable<N> {
    /// An empty table.
    pub const fn new() -> Self {
        ThrashTable { e: [Entry::EMPTY; N], events: 0, pin_horizon: 0 }
    }

    /// Whether any page may be pinned-remote at `now_ns` (false: none is).
    pub fn any_pinned(&self, now_ns: u64) -> bool {
        now_ns < self.pin_horizon
    }

    fn find(&self, page: u64) -> Option<usize> {
        self.e.iter().position(|x| x.used && x.page == page)
    }

    /// The slot for a new page: a free one, else the least recently updated (lowest index
    /// on ties). `None` only if `N == 0`.
    fn victim(&self) -> Option<usize> {
        if let Some(i) = self.e.iter().position(|x| !x.used) {
            return Some(i);
        }
        // `min_by_key` returns the first of equal minima.
        self.e.iter().enumerate().min_by_key(|(_, x)| x.last_ns).map(|(i, _)| i)
    }

    /// Records a migration of `page` at `now_ns` and says what to do with the next
    /// migration request of it. A page that is still pinned-remote answers
    /// [`Verdict::PinRemote`] without changing its pin.
    pub fn on_move(&mut self, page: u64, now_ns: u64, p: &ThrashParams) -> Verdict {
        let i = match self.find(page) {
            Some(i) => i,
            None => match self.victim() {
                Some(i) => {
                    self.e[i] = Entry { used: true, page, last_ns: now_ns, ..Entry::EMPTY };
                    i
                }
                None => return Verdict::Migrate,
            },
        };
        let x = &mut self.e[i];
        if now_ns < x.pin_until {
            x.last_ns = x.last_ns.max(now_ns);
            self.events = self.events.saturating_add(1);
            return Verdict::PinRemote;
        }
        if x.moves == 0 || now_ns.saturating_sub(x.last_ns) > p.window_ns {
            // New burst (also right after a pin expired).
            x.moves = 0;
            x.throttles = 0;
        }
        x.pin_until = 0;
        x.last_ns = x.last_ns.max(now_ns);
        x.moves = x.moves.saturating_add(1);
        if x.moves < p.moves.max(1) {
            return Verdict::Migrate;
        }
        x.throttles = x.throttles.saturating_add(1);
        self.events = self.events.saturating_add(1);
        if x.throttles < p.throttles_to_pin.max(1) {
            return Verdict::Throttle;
        }
        x.pin_until = now_ns.saturating_add(p.pin_ns);
        self.pin_horizon = self.pin_horizon.max(x.pin_until);
        x.moves = 0;
        x.throttles = 0;
        Verdict::PinRemote
    }

    /// Whether `page` is pinned-remote at `now_ns` (pin not expired).
    pub fn pinned(&self, page: u64, now_ns: u64) -> bool {
        self.any_pinned(now_ns) && self.find(page).is_some_and(|i| now_ns < self.e[i].pin_until)
    }

    /// Number of Throttle and PinRemote verdicts given.
    pub fn events(&self) -> u64 {
        self.events
    }

    /// Number of pages tracked (at most `N`).
    pub fn len(&self) -> usize {
        self.e.iter().filter(|x| x.used).count()
    }

    /// No page is tracked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether `page` has an entry.
    pub fn contains(&self, page: u64) -> bool {
        self.find(page).is_some()
    }

    /// Drops the entry of `page`.
    pub fn forget(&mut self, page: u64) {
        if let Some(i) = self.find(page) {
            self.e[i] = Entry::EMPTY;
            self.settle_horizon();
        }
    }

    /// Drops the entries of the pages in `[start, end)` (a freed region: what is mapped
    /// there later starts with no history).
    pub fn forget_range(&mut self, start: u64, end: u64) {
        for x in self.e.iter_mut().filter(|x| x.used && (start..end).contains(&x.page)) {
            *x = Entry::EMPTY;
        }
        self.settle_horizon();
    }

    /// The pin horizon of the entries left (after some were forgotten: a freed region's
    /// pins would otherwise keep every later fault on the slow path until they expired).
    fn settle_horizon(&mut self) {
        self.pin_horizon = self.e.iter().filter(|x| x.used).map(|x| x.pin_until).max().unwrap_or(0);
    }
}

impl<const N: usize> Default for ThrashTable<N> {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: ThrashParams = ThrashParams::DEFAULT;
    const US: u64 = 1000;

    #[test]
    fn fast_mover_is_throttled_then_pinned_then_released() {
        let mut t: ThrashTable<4> = ThrashTable::new();
        let mut now = 0;
        let mut v = std::vec::Vec::new();
        for _ in 0..12 {
            v.push(t.on_move(0x1000, now, &P));
            now += 100 * US;
        }
        use Verdict::*;
        assert_eq!(v[..3], [Migrate, Migrate, Throttle]);
        assert!(v[3..11].iter().all(|&x| x == Throttle));
        assert_eq!(v[11], PinRemote, "the 10th throttle pins");
        assert_eq!(t.events(), 10);
        let pinned_at = now - 100 * US;
        assert!(t.pinned(0x1000, pinned_at));
        assert!(t.pinned(0x1000, pinned_at + P.pin_ns - 1));
        assert!(!t.pinned(0x1000, pinned_at + P.pin_ns));
        // While pinned, moves are answered with PinRemote.
        assert_eq!(t.on_move(0x1000, pinned_at + 1, &P), PinRemote);
        assert_eq!(t.events(), 11);
        // After expiry the page starts over.
        let later = pinned_at + P.pin_ns;
        assert_eq!(t.on_move(0x1000, later, &P), Migrate);
        assert!(!t.pinned(0x1000, later));
    }

    #[test]
    fn slow_mover_is_never_throttled() {
        let mut t: ThrashTable<2> = ThrashTable::new();
        for k in 0..100u64 {
            assert_eq!(t.on_move(7, k * (P.window_ns + 1), &P), Verdict::Migrate);
        }
        assert_eq!(t.events(), 0);
    }

    #[test]
    fn pause_resets_the_burst() {
        let mut t: ThrashTable<2> = ThrashTable::new();
        assert_eq!(t.on_move(1, 0, &P), Verdict::Migrate);
        assert_eq!(t.on_move(1, 10, &P), Verdict::Migrate);
        assert_eq!(t.on_move(1, 10 + P.window_ns + 1, &P), Verdict::Migrate);
        assert_eq!(t.on_move(1, 20 + P.window_ns, &P), Verdict::Migrate);
        assert_eq!(t.on_move(1, 30 + P.window_ns, &P), Verdict::Throttle);
    }

    #[test]
    fn a_freed_range_leaves_no_history() {
        // Pages 0x1000 and 0x2000 in the range, 0x9000 outside it; all three get pinned.
        let mut t: ThrashTable<4> = ThrashTable::new();
        let mut now = 0;
        for _ in 0..30 {
            for page in [0x1000, 0x2000, 0x9000] {
                t.on_move(page, now, &P);
            }
            now += 10 * US;
        }
        assert!(t.pinned(0x1000, now) && t.pinned(0x9000, now));
        t.forget_range(0x1000, 0x9000);
        assert!(!t.contains(0x1000) && !t.contains(0x2000));
        assert!(!t.pinned(0x1000, now));
        // The horizon follows what is left: with 0x9000 forgotten too, nothing may be pinned.
        assert!(t.any_pinned(now));
        let mut u = t.clone();
        u.forget(0x9000);
        assert!(!u.any_pinned(now));
        // A page mapped there later starts over: two moves, no verdict yet.
        assert_eq!(t.on_move(0x1000, now, &P), Verdict::Migrate);
        assert_eq!(t.on_move(0x1000, now + 1, &P), Verdict::Migrate);
        // Outside the range, kept.
        assert!(t.pinned(0x9000, now));
        let mut r = RecentMoves::<64>::new();
        for page in [0x1000, 0x2000, 0x9000] {
            r.seen_again(page);
        }
        r.forget_range(0x1000, 0x9000);
        assert!(!r.seen_again(0x1000) && !r.seen_again(0x2000));
        assert!(r.seen_again(0x9000));
    }

    /// Runs `ops` (page, time step, forget or move) on a table of `N` entries; after each,
    /// checks `pinned` against a scan of every entry for pages 0..6 and, when `exact`,
    /// `any_pinned` against whether any entry is pinned.
    fn check_pins<const N: usize>(
        ops: &[(u64, u64, bool)],
        exact: bool,
    ) -> Result<(), proptest::test_runner::TestCaseError> {
        let p = ThrashParams { window_ns: 100, moves: 2, throttles_to_pin: 2, pin_ns: 300 };
        let mut t: ThrashTable<N> = ThrashTable::new();
        let mut now = 0u64;
        for &(page, step, forget) in ops {
            now += step;
            if forget {
                t.forget_range(page, page + 2);
            } else {
                t.on_move(page, now, &p);
            }
            for q in 0..6u64 {
                let scan = t.e.iter().any(|x| x.used && x.page == q && now < x.pin_until);
                proptest::prop_assert_eq!(t.pinned(q, now), scan);
            }
            let any = t.e.iter().any(|x| x.used && now < x.pin_until);
            if exact {
                proptest::prop_assert_eq!(t.any_pinned(now), any);
            }
        }
        Ok(())
    }

    proptest::proptest! {
        /// `pinned` (with its horizon) answers as a scan of every entry would. With room for
        /// every page (no entry replaced), `any_pinned` is exact: true only while a page is
        /// pinned, also after entries are forgotten.
        #[test]
        fn pins_answer_as_a_scan(ops in proptest::collection::vec((0u64..6, 0u64..60, proptest::bool::weighted(0.1)), 1..200)) {
            check_pins::<3>(&ops, false)?;
            check_pins::<6>(&ops, true)?;
        }
    }

    #[test]
    fn lru_replacement() {
        let mut t: ThrashTable<2> = ThrashTable::new();
        t.on_move(1, 0, &P);
        t.on_move(2, 10, &P);
        t.on_move(1, 20, &P); // 1 is now more recent than 2
        t.on_move(3, 30, &P);
        assert!(t.contains(1) && t.contains(3) && !t.contains(2));
        assert_eq!(t.len(), 2);
        t.forget(1);
        assert_eq!(t.len(), 1);
        let mut z: ThrashTable<0> = ThrashTable::default();
        assert_eq!(z.on_move(1, 0, &P), Verdict::Migrate);
        assert!(z.is_empty());
    }

    #[test]
    fn backwards_clock_and_extreme_params_do_not_overflow() {
        let mut t: ThrashTable<1> = ThrashTable::new();
        let p = ThrashParams { window_ns: u64::MAX, moves: 0, throttles_to_pin: 0, pin_ns: u64::MAX };
        assert_eq!(t.on_move(5, u64::MAX, &p), Verdict::PinRemote);
        assert!(t.pinned(5, u64::MAX - 1));
        let mut t: ThrashTable<1> = ThrashTable::new();
        t.on_move(5, 1000, &P);
        t.on_move(5, 10, &P);
        assert_eq!(t.on_move(5, 0, &P), Verdict::Throttle, "backwards steps are no pause");
    }
}

/// A direct-mapped memory of recently moved pages: the cheap first step of thrashing
/// detection. A page's first move only fills a slot; only a page seen again (its slot still
/// holds it) is worth the [`ThrashTable`]'s attention. Streaming workloads, whose pages
/// each move once, then never touch the table. `N` must be a power of two.
pub struct RecentMoves<const N: usize> {
    /// `page + 1` per slot; 0 = empty.
    slots: [u64; N],
}

impl<const N: usize> RecentMoves<N> {
    pub const fn new() -> Self {
        RecentMoves { slots: [0; N] }
    }

    fn slot(page: u64) -> usize {
        // Fibonacci hashing of the page number; N is a power of two.
        let h = (page >> 12).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        (h >> 32) as usize & (N.max(1) - 1)
    }

    /// Forgets the moves of the pages in `[start, end)` (see [`ThrashTable::forget_range`]).
    pub fn forget_range(&mut self, start: u64, end: u64) {
        for s in self.slots.iter_mut().filter(|s| **s != 0 && (start..end).contains(&(**s - 1))) {
            *s = 0;
        }
    }

    /// Records a move of `page`; true if the page was recorded before and not displaced.
    pub fn seen_again(&mut self, page: u64) -> bool {
        let i = Self::slot(page);
        let key = page.wrapping_add(1);
        match self.slots.get_mut(i) {
            Some(s) if *s == key => true,
            Some(s) => {
                *s = key;
                false
            }
            None => false,
        }
    }
}

impl<const N: usize> Default for RecentMoves<N> {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod recent_tests {
    use super::RecentMoves;

    #[test]
    fn first_move_is_filtered_second_passes() {
        let mut r = RecentMoves::<64>::new();
        assert!(!r.seen_again(0x1000));
        assert!(r.seen_again(0x1000));
        assert!(r.seen_again(0x1000));
        // Page 0 works too (slots store page + 1).
        assert!(!r.seen_again(0));
        assert!(r.seen_again(0));
    }

    #[test]
    fn a_stream_never_passes_the_filter() {
        let mut r = RecentMoves::<64>::new();
        let passed = (0..100_000u64).filter(|p| r.seen_again(p << 12)).count();
        assert_eq!(passed, 0);
    }

    #[test]
    fn a_displaced_page_starts_over() {
        let mut r = RecentMoves::<1>::new();
        assert!(!r.seen_again(0x1000));
        assert!(!r.seen_again(0x2000));
        assert!(!r.seen_again(0x1000));
    }
}
