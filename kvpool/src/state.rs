//! The pool's synchronous state: per-page states and tags, the free list, the scrub queue.
//!
//! Every transition here is driven by a lifecycle object ([`Reservation`](crate::Reservation),
//! [`Allocation`](crate::Allocation), [`Releasing`](crate::Releasing)) that proves by its type
//! which state its pages are in; the transitions re-check that proof against the recorded
//! per-page state (a `debug_assert` in test builds) and never move a page they cannot prove
//! the caller holds. Invariant I1 — each page is free, waiting for a scrub, quarantined, or held
//! by exactly one lifecycle object of one owner — is checked as a whole by
//! [`PoolState::check_invariants`].

use std::collections::VecDeque;

use crate::config::PoolConfig;
use crate::error::{Found, InvariantViolation, TagMismatch};
use crate::ids::{PageId, PageRef, RequestId, Tag};
use crate::prefix::{Inserted, PrefixIndex, Scope};

/// Which lifecycle object holds a page.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Hold {
    /// A [`Reservation`](crate::Reservation).
    Reserved,
    /// An [`Allocation`](crate::Allocation).
    Owned,
    /// A [`Releasing`](crate::Releasing).
    Releasing,
}

/// Where a transition sends held pages.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Target {
    /// To another lifecycle object of the same owner.
    Hold(Hold),
    /// Back towards the free list (through the scrub queue if the pool scrubs).
    Release,
    /// Out of service until an operator releases the quarantine.
    Quarantine,
}

/// The recorded state of one physical page.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum PageState {
    /// On the free list, allocatable.
    Free,
    /// Held by a `Reservation` of `owner`: KV is being written into it.
    Reserved { owner: RequestId },
    /// Held by an `Allocation` of `owner`: a running request reads and writes it.
    Owned { owner: RequestId },
    /// Held by a `Releasing` of `owner`: the request ended but a transfer may still land.
    Releasing { owner: RequestId },
    /// Out of service: someone may still write it, or its contents are suspect.
    Quarantined,
    /// Released, waiting in the scrub queue for the physical layer to scrub it.
    PendingScrub,
    /// Kept in the prefix cache: its KV is read-only, read by any number of requests of its
    /// scope, and named by exactly one entry of the [`PrefixIndex`].
    Cached,
}

impl PageState {
    const fn held(hold: Hold, owner: RequestId) -> Self {
        match hold {
            Hold::Reserved => Self::Reserved { owner },
            Hold::Owned => Self::Owned { owner },
            Hold::Releasing => Self::Releasing { owner },
        }
    }

    /// Held by a reservation or an allocation, or cached: page tables naming it with its tag
    /// are valid.
    const fn is_live(self) -> bool {
        matches!(
            self,
            Self::Reserved { .. } | Self::Owned { .. } | Self::Cached
        )
    }

    const fn name(self) -> &'static str {
        match self {
            Self::Free => "free",
            Self::Reserved { .. } => "reserved",
            Self::Owned { .. } => "owned",
            Self::Releasing { .. } => "releasing",
            Self::Quarantined => "quarantined",
            Self::PendingScrub => "pending scrub",
            Self::Cached => "cached",
        }
    }
}

/// Page counts by state. `total` is the sum of the others.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct PoolStats {
    /// Pages in the pool.
    pub total: u32,
    /// Pages on the free list, allocatable now.
    pub free: u32,
    /// Pages held by reservations.
    pub reserved: u32,
    /// Pages held by allocations.
    pub owned: u32,
    /// Pages held by `Releasing` objects (not reusable until drained).
    pub releasing: u32,
    /// Pages out of service until [`PagePool::release_quarantine`](crate::PagePool::release_quarantine).
    pub quarantined: u32,
    /// Released pages waiting for [`PagePool::scrub_pending`](crate::PagePool::scrub_pending).
    pub pending_scrub: u32,
    /// Pages in the prefix cache (given back by [`PagePool::evict`](crate::PagePool::evict)
    /// when nobody reads them).
    pub cached: u32,
}

impl PoolStats {
    fn count_mut(&mut self, state: PageState) -> &mut u32 {
        match state {
            PageState::Free => &mut self.free,
            PageState::Reserved { .. } => &mut self.reserved,
            PageState::Owned { .. } => &mut self.owned,
            PageState::Releasing { .. } => &mut self.releasing,
            PageState::Quarantined => &mut self.quarantined,
            PageState::PendingScrub => &mut self.pending_scrub,
            PageState::Cached => &mut self.cached,
        }
    }

    /// Moves one page's count from `from` to `to`. Saturating: a miscount is reported by
    /// `check_invariants`, never turned into a panic.
    fn shift(&mut self, from: PageState, to: PageState) {
        let c = self.count_mut(from);
        *c = c.saturating_sub(1);
        let c = self.count_mut(to);
        *c = c.saturating_add(1);
    }
}

/// The pool's state. Lives behind the [`PagePool`](crate::PagePool)'s mutex; only
/// [`PoolState::check_invariants`] and [`PoolState::stats`] are public, so every transition goes
/// through a lifecycle object.
#[derive(Debug)]
pub struct PoolState {
    /// The configuration; `states.len() == tags.len() == config.pages`.
    config: PoolConfig,
    /// Recorded state of each page, indexed by `PageId::index`.
    states: Vec<PageState>,
    /// Current tag of each page, indexed by `PageId::index`. All pairwise distinct, all below
    /// `next_tag`; a page's tag changes only when it is reserved, to `next_tag`.
    tags: Vec<Tag>,
    /// Exactly the pages in `PageState::Free`, each once, oldest release first (FIFO, so a
    /// freed page is reused as late as possible).
    free: VecDeque<PageId>,
    /// Exactly the pages in `PageState::PendingScrub`, each once, oldest release first.
    scrub: VecDeque<PageId>,
    /// The next tag to hand out; only grows. Starts after the pages' initial tags.
    next_tag: u64,
    /// Maintained counts; equal to a recount of `states`.
    stats: PoolStats,
    /// Exactly the pages in `PageState::Cached`, by scope, parent and tokens.
    prefix: PrefixIndex,
}

impl PoolState {
    /// A pool whose pages are all free, each with a distinct initial tag that no allocation
    /// will ever carry.
    #[must_use]
    pub fn new(config: PoolConfig) -> Self {
        let pages = config.pages.get();
        Self {
            config,
            states: vec![PageState::Free; pages as usize],
            tags: (1..=u64::from(pages)).map(Tag::new).collect(),
            free: (0..pages).map(PageId::new).collect(),
            scrub: VecDeque::new(),
            next_tag: u64::from(pages) + 1,
            stats: PoolStats {
                total: pages,
                free: pages,
                ..PoolStats::default()
            },
            prefix: PrefixIndex::default(),
        }
    }

    /// Page counts by state.
    #[must_use]
    pub const fn stats(&self) -> PoolStats {
        self.stats
    }

    pub(crate) fn current_tag(&self, page: PageId) -> Option<Tag> {
        self.tags.get(page.index()).copied()
    }

    pub(crate) fn tags(&self) -> &[Tag] {
        &self.tags
    }

    pub(crate) fn verify(&self, table: &[PageRef]) -> Result<(), TagMismatch> {
        for entry in table {
            let i = entry.page.index();
            let (Some(state), Some(&current)) = (self.states.get(i), self.tags.get(i)) else {
                return Err(mismatch(entry, Found::NoSuchPage));
            };
            if !state.is_live() {
                return Err(mismatch(entry, Found::NotLive { current }));
            }
            if current != entry.tag {
                return Err(mismatch(entry, Found::OtherTag(current)));
            }
        }
        Ok(())
    }

    /// Takes `n` pages from the front of the free list for `owner`, giving each a fresh tag.
    /// `None`, with nothing changed, if fewer than `n` pages are free (or, after 2^64
    /// allocations, if the tag counter is spent).
    pub(crate) fn reserve(&mut self, owner: RequestId, n: u32) -> Option<Vec<PageRef>> {
        if self.free.len() < n as usize {
            return None;
        }
        self.next_tag.checked_add(u64::from(n))?;
        let mut table = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let page = self.free.pop_front()?;
            let i = page.index();
            let (Some(state), Some(tag)) = (self.states.get_mut(i), self.tags.get_mut(i)) else {
                debug_assert!(false, "{page} on the free list is out of range");
                continue;
            };
            debug_assert_eq!(*state, PageState::Free, "{page} on the free list");
            let to = PageState::Reserved { owner };
            self.stats.shift(*state, to);
            *state = to;
            *tag = Tag::new(self.next_tag);
            self.next_tag += 1;
            table.push(PageRef { page, tag: *tag });
        }
        Some(table)
    }

    /// Moves pages held by `owner` in `from` to `to`. A page whose recorded state or tag does
    /// not match is left where it is (and fails a `debug_assert`): leaking a page is safe,
    /// freeing one someone else holds is not.
    pub(crate) fn transition(
        &mut self,
        owner: RequestId,
        pages: &[PageRef],
        from: Hold,
        to: Target,
    ) {
        let expected = PageState::held(from, owner);
        for entry in pages {
            if !self.is_in(*entry, expected) {
                continue;
            }
            match to {
                Target::Hold(hold) => self.set(entry.page, expected, PageState::held(hold, owner)),
                Target::Quarantine => self.set(entry.page, expected, PageState::Quarantined),
                Target::Release => self.release_page(entry.page, expected),
            }
        }
    }

    /// Whether `entry`'s page is in state `expected` with the entry's tag; a `debug_assert`
    /// fails when it is not (the caller's proof of holding it was wrong).
    fn is_in(&self, entry: PageRef, expected: PageState) -> bool {
        let i = entry.page.index();
        let (Some(&state), Some(&tag)) = (self.states.get(i), self.tags.get(i)) else {
            debug_assert!(false, "{} out of range", entry.page);
            return false;
        };
        let holds = state == expected && tag == entry.tag;
        debug_assert!(
            holds,
            "{} is {state:?} with {tag}, expected {expected:?} with {}",
            entry.page, entry.tag
        );
        holds
    }

    /// Records `page`, now in `from`, as being in `to`.
    fn set(&mut self, page: PageId, from: PageState, to: PageState) {
        if let Some(state) = self.states.get_mut(page.index()) {
            self.stats.shift(from, to);
            *state = to;
        }
    }

    /// Sends `page`, now in `from`, towards the free list: into the scrub queue if the pool
    /// scrubs, else straight onto the free list.
    fn release_page(&mut self, page: PageId, from: PageState) {
        let next = if self.config.scrub.is_deferred() {
            self.scrub.push_back(page);
            PageState::PendingScrub
        } else {
            self.free.push_back(page);
            PageState::Free
        };
        self.set(page, from, next);
    }

    /// Prefix cache: the pages of `scope` that hold `chunks` in order from the scope's root,
    /// as far as they are cached; each gains a reader until [`PoolState::unread`].
    pub(crate) fn find_prefix<'a>(
        &mut self,
        scope: &Scope,
        chunks: impl Iterator<Item = &'a [u32]>,
    ) -> Vec<PageRef> {
        self.prefix.find(scope, chunks)
    }

    /// Prefix cache: takes one reader off each of `pages`; the distrusted pages nobody reads
    /// any more leave the cache.
    pub(crate) fn unread(&mut self, pages: &[PageRef]) {
        self.prefix.unread(pages);
        let swept = self.prefix.sweep();
        self.release_cached(&swept);
    }

    /// Prefix cache: distrusts `page` and every cached page after it (see
    /// [`crate::Prefix::distrust_from`]); those nobody reads leave the cache now. Returns how
    /// many pages were newly distrusted.
    pub(crate) fn distrust(&mut self, page: PageRef) -> u32 {
        let distrusted = self.prefix.distrust(page);
        let swept = self.prefix.sweep();
        self.release_cached(&swept);
        distrusted
    }

    /// Releases pages taken out of the prefix index (towards the free list, through the scrub
    /// queue if the pool scrubs).
    fn release_cached(&mut self, pages: &[PageRef]) {
        for entry in pages {
            if self.is_in(*entry, PageState::Cached) {
                self.release_page(entry.page, PageState::Cached);
            }
        }
    }

    /// Moves the pages `owner` holds in an allocation into the prefix cache of `scope`: page
    /// `i` holds `chunks[i]`, the first of them right after `parent` (a cached page of
    /// `scope`, or the root). A page whose tokens are cached already after the same parent
    /// (another request of the scope computed them) is released and the chain goes on from
    /// the cached one; once the chain cannot go on (its parent is not cached), and past the
    /// chunks, pages are released. Returns how many pages were cached.
    pub(crate) fn cache(
        &mut self,
        owner: RequestId,
        pages: &[PageRef],
        chunks: &[&[u32]],
        scope: &Scope,
        parent: Option<PageRef>,
    ) -> u32 {
        let owned = PageState::held(Hold::Owned, owner);
        let mut parent = Some(parent);
        let mut cached = 0;
        for (i, entry) in pages.iter().enumerate() {
            if !self.is_in(*entry, owned) {
                // Not the owner's (an invariant broken elsewhere): what comes after it was
                // computed after its tokens, so it must never be cached after its parent.
                parent = None;
                continue;
            }
            let inserted = match (parent, chunks.get(i)) {
                (Some(after), Some(tokens)) => self.prefix.insert(scope, after, tokens, *entry),
                _ => None,
            };
            match inserted {
                Some(Inserted::Cached) => {
                    self.set(entry.page, owned, PageState::Cached);
                    cached += 1;
                    parent = Some(Some(*entry));
                }
                Some(Inserted::Present(page)) => {
                    self.release_page(entry.page, owned);
                    parent = Some(Some(page));
                }
                None => {
                    self.release_page(entry.page, owned);
                    parent = None;
                }
            }
        }
        cached
    }

    /// Takes up to `n` cached pages that nobody reads out of the prefix cache, least recently
    /// used first, towards the free list (through the scrub queue if the pool scrubs).
    /// Returns how many.
    pub(crate) fn evict(&mut self, n: u32) -> u32 {
        let pages = self.prefix.evict(n);
        self.release_cached(&pages);
        u32::try_from(pages.len()).unwrap_or(u32::MAX)
    }

    /// Evicts `n` cached pages as [`PoolState::evict`] does when that many can go, and none
    /// otherwise. Returns how many.
    pub(crate) fn make_room(&mut self, n: u32) -> u32 {
        if self.prefix.victims(n).len() < n as usize {
            return 0;
        }
        self.evict(n)
    }

    /// Calls `f` for each page waiting for a scrub, oldest first, then frees it. A page leaves
    /// the queue only after `f` returned for it, so if `f` panics that page and the rest stay
    /// queued.
    pub(crate) fn scrub_pending(&mut self, mut f: impl FnMut(PageId)) {
        while let Some(&page) = self.scrub.front() {
            f(page);
            self.scrub.pop_front();
            if let Some(state) = self.states.get_mut(page.index()) {
                debug_assert_eq!(*state, PageState::PendingScrub, "{page} in the scrub queue");
                self.stats.shift(*state, PageState::Free);
                *state = PageState::Free;
                self.free.push_back(page);
            }
        }
    }

    /// Returns every quarantined page towards the free list (through the scrub queue if the
    /// pool scrubs), in page order. Returns how many.
    pub(crate) fn release_quarantine(&mut self) -> u32 {
        let quarantined: Vec<PageRef> = (0..self.states.len())
            .filter(|&i| self.states[i] == PageState::Quarantined)
            .filter_map(|i| {
                let page = PageId::new(u32::try_from(i).ok()?);
                Some(PageRef {
                    page,
                    tag: self.tags[i],
                })
            })
            .collect();
        self.reclaim(&quarantined)
    }

    /// Returns the quarantined pages of `pages` towards the free list (through the scrub queue
    /// if the pool scrubs). A page counts only if it is still quarantined with the entry's tag:
    /// a page that left the quarantine since (and was perhaps reserved again, with a new tag)
    /// is left alone. Returns how many pages left quarantine.
    pub(crate) fn reclaim(&mut self, pages: &[PageRef]) -> u32 {
        let mut released = 0;
        for entry in pages {
            let i = entry.page.index();
            let (Some(&state), Some(&tag)) = (self.states.get(i), self.tags.get(i)) else {
                continue;
            };
            if state != PageState::Quarantined || tag != entry.tag {
                continue;
            }
            self.release_page(entry.page, state);
            released += 1;
        }
        released
    }

    /// Checks the whole state against its invariants: one state and one tag per page; the free
    /// list and the scrub queue hold exactly the pages in their states, each once; maintained
    /// counts equal a recount; the prefix index names exactly the cached pages, with their
    /// tags, each chain whole within one scope; tags pairwise distinct and below the counter.
    ///
    /// # Errors
    ///
    /// The first violation found. Any error is a bug in this crate.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        let pages = self.config.pages.get() as usize;
        if self.states.len() != pages || self.tags.len() != pages {
            return Err(InvariantViolation::PageArrays {
                pages,
                states: self.states.len(),
                tags: self.tags.len(),
            });
        }
        let in_free = self.check_queue(&self.free, PageState::Free, "free")?;
        let in_scrub = self.check_queue(&self.scrub, PageState::PendingScrub, "scrub")?;

        let mut counted = PoolStats {
            total: self.config.pages.get(),
            ..PoolStats::default()
        };
        for (i, &state) in self.states.iter().enumerate() {
            let page = PageId::new(u32::try_from(i).unwrap_or(u32::MAX));
            let queued = match state {
                PageState::Free => in_free.get(i).copied(),
                PageState::PendingScrub => in_scrub.get(i).copied(),
                _ => None,
            };
            if queued == Some(false) {
                return Err(InvariantViolation::MissingFromQueue {
                    page,
                    state: state.name(),
                });
            }
            *counted.count_mut(state) += 1;
        }
        for (counter, recorded, counted) in [
            ("total", self.stats.total, counted.total),
            ("free", self.stats.free, counted.free),
            ("reserved", self.stats.reserved, counted.reserved),
            ("owned", self.stats.owned, counted.owned),
            ("releasing", self.stats.releasing, counted.releasing),
            ("quarantined", self.stats.quarantined, counted.quarantined),
            (
                "pending scrub",
                self.stats.pending_scrub,
                counted.pending_scrub,
            ),
            ("cached", self.stats.cached, counted.cached),
        ] {
            if recorded != counted {
                return Err(InvariantViolation::Count {
                    counter,
                    recorded,
                    counted,
                });
            }
        }

        if self.prefix.len() != self.stats.cached as usize {
            return Err(InvariantViolation::Count {
                counter: "prefix index",
                recorded: u32::try_from(self.prefix.len()).unwrap_or(u32::MAX),
                counted: self.stats.cached,
            });
        }
        self.prefix.check(|entry| {
            let i = entry.page.index();
            self.states.get(i) == Some(&PageState::Cached) && self.tags.get(i) == Some(&entry.tag)
        })?;

        let mut by_tag: Vec<(Tag, usize)> =
            self.tags.iter().copied().zip(0..self.tags.len()).collect();
        by_tag.sort_unstable();
        for pair in by_tag.windows(2) {
            if let [(a, first), (b, second)] = *pair
                && a == b
            {
                return Err(InvariantViolation::TagShared {
                    first: PageId::new(u32::try_from(first).unwrap_or(u32::MAX)),
                    second: PageId::new(u32::try_from(second).unwrap_or(u32::MAX)),
                    tag: a,
                });
            }
        }
        if let Some(&(tag, i)) = by_tag.last()
            && tag.get() >= self.next_tag
        {
            return Err(InvariantViolation::TagAhead {
                page: PageId::new(u32::try_from(i).unwrap_or(u32::MAX)),
                tag,
                next: self.next_tag,
            });
        }
        Ok(())
    }

    /// Checks that `queue` holds only in-range pages in state `want`, each once; returns which
    /// pages it holds.
    fn check_queue(
        &self,
        queue: &VecDeque<PageId>,
        want: PageState,
        name: &'static str,
    ) -> Result<Vec<bool>, InvariantViolation> {
        let mut seen = vec![false; self.states.len()];
        for &page in queue {
            let i = page.index();
            match self.states.get(i) {
                Some(&state) if state == want => {}
                Some(&state) => {
                    return Err(InvariantViolation::QueuedInWrongState {
                        page,
                        queue: name,
                        state: state.name(),
                    });
                }
                None => {
                    return Err(InvariantViolation::QueuedInWrongState {
                        page,
                        queue: name,
                        state: "out of range",
                    });
                }
            }
            if let Some(slot) = seen.get_mut(i) {
                if *slot {
                    return Err(InvariantViolation::QueuedTwice { page, queue: name });
                }
                *slot = true;
            }
        }
        Ok(seen)
    }
}

#[cfg(test)]
impl PoolState {
    /// Test hook: breaks the maintained counts, so that tests of the layers above can see a
    /// broken state reported.
    pub(crate) fn miscount_for_test(&mut self) {
        self.stats.quarantined += 1;
    }
}

fn mismatch(entry: &PageRef, found: Found) -> TagMismatch {
    TagMismatch {
        page: entry.page,
        expected: entry.tag,
        found,
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;
    use std::panic::{AssertUnwindSafe, catch_unwind};

    use super::*;
    use crate::config::Scrub;

    fn state(pages: u32, scrub: Scrub) -> PoolState {
        PoolState::new(PoolConfig::new(
            NonZeroU32::new(pages).expect("test pools have pages"),
            scrub,
        ))
    }

    #[test]
    fn a_new_pool_satisfies_its_invariants() {
        state(5, Scrub::Zero)
            .check_invariants()
            .expect("fresh pool is consistent");
    }

    #[test]
    fn the_checker_catches_a_page_freed_twice() {
        let mut s = state(3, Scrub::None);
        s.free.push_back(PageId::new(1));
        assert!(matches!(
            s.check_invariants(),
            Err(InvariantViolation::QueuedTwice { queue: "free", .. })
        ));
    }

    #[test]
    fn the_checker_catches_a_held_page_on_the_free_list() {
        let mut s = state(3, Scrub::None);
        let table = s.reserve(RequestId::new(1), 1).expect("a page is free");
        s.free.push_back(table[0].page);
        assert!(matches!(
            s.check_invariants(),
            Err(InvariantViolation::QueuedInWrongState {
                queue: "free",
                state: "reserved",
                ..
            })
        ));
    }

    #[test]
    fn the_checker_catches_a_free_page_lost_from_the_free_list() {
        let mut s = state(3, Scrub::None);
        s.free.pop_back();
        assert!(matches!(
            s.check_invariants(),
            Err(InvariantViolation::MissingFromQueue { state: "free", .. })
        ));
    }

    #[test]
    fn the_checker_catches_per_page_arrays_of_the_wrong_length() {
        let mut s = state(3, Scrub::None);
        s.tags.pop();
        assert_eq!(
            s.check_invariants(),
            Err(InvariantViolation::PageArrays {
                pages: 3,
                states: 3,
                tags: 2
            })
        );
    }

    #[test]
    fn the_checker_catches_a_released_page_lost_from_the_scrub_queue() {
        let mut s = state(3, Scrub::Zero);
        let owner = RequestId::new(1);
        let table = s.reserve(owner, 1).expect("a page is free");
        s.transition(owner, &table, Hold::Reserved, Target::Release);
        s.check_invariants()
            .expect("the page waits in the scrub queue");
        s.scrub.clear();
        assert_eq!(
            s.check_invariants(),
            Err(InvariantViolation::MissingFromQueue {
                page: table[0].page,
                state: "pending scrub",
            })
        );
    }

    /// I1: a transition moves only pages the caller holds in the stated hold with the stated
    /// tag. A mismatch trips the `debug_assert` in test builds and is skipped in release
    /// builds; either way the page stays with its holder.
    #[test]
    fn a_transition_never_moves_a_page_held_by_another_owner_or_with_another_tag() {
        let mut s = state(2, Scrub::None);
        let owner = RequestId::new(1);
        let table = s.reserve(owner, 1).expect("a page is free");
        let entry = table[0];
        let stale = PageRef {
            tag: Tag::new(entry.tag.get() - 1),
            ..entry
        };
        let attempts = [
            (RequestId::new(2), entry, Hold::Reserved),
            (owner, stale, Hold::Reserved),
            (owner, entry, Hold::Owned),
        ];
        for (who, page, from) in attempts {
            let moved = catch_unwind(AssertUnwindSafe(|| {
                s.transition(who, &[page], from, Target::Release);
            }));
            assert_eq!(
                moved.is_err(),
                cfg!(debug_assertions),
                "{who} {page:?} {from:?}"
            );
            assert_eq!(s.states[entry.page.index()], PageState::Reserved { owner });
            assert_eq!(s.stats().free, 1);
            s.check_invariants().expect("nothing moved");
        }
    }

    #[test]
    fn the_checker_catches_a_cached_page_that_left_the_cache_without_the_index() {
        let mut s = state(4, Scrub::None);
        let owner = RequestId::new(1);
        let table = s.reserve(owner, 2).expect("pages are free");
        s.transition(owner, &table, Hold::Reserved, Target::Hold(Hold::Owned));
        let tokens: Vec<u32> = (0..32).collect();
        let chunks: Vec<&[u32]> = tokens.chunks(16).collect();
        assert_eq!(s.cache(owner, &table, &chunks, &Scope::new("a"), None), 2);
        s.check_invariants().expect("both pages cached and indexed");
        s.set(table[1].page, PageState::Cached, PageState::Owned { owner });
        assert!(matches!(
            s.check_invariants(),
            Err(InvariantViolation::Count {
                counter: "prefix index",
                ..
            })
        ));
    }

    #[test]
    fn pages_kept_after_a_parent_that_is_no_longer_cached_are_released_not_cached() {
        let mut s = state(4, Scrub::None);
        let owner = RequestId::new(1);
        let table = s.reserve(owner, 2).expect("pages are free");
        s.transition(owner, &table, Hold::Reserved, Target::Hold(Hold::Owned));
        let tokens: Vec<u32> = (0..32).collect();
        let chunks: Vec<&[u32]> = tokens.chunks(16).collect();
        // A parent the index never held (an evicted page, by its old tag): no lookup could
        // reach what follows it.
        let gone = PageRef {
            page: PageId::new(3),
            tag: Tag::new(1),
        };
        let scope = Scope::new("a");
        assert_eq!(s.cache(owner, &table, &chunks, &scope, Some(gone)), 0);
        let stats = s.stats();
        assert_eq!((stats.cached, stats.free, stats.owned), (0, 4, 0));
        s.check_invariants().expect("every page released");
    }

    /// A page of the table the owner does not hold (a stale tag) breaks the chain: the page
    /// after it was computed after its tokens, and cached after the page before it, a lookup
    /// of a prompt without those tokens would read it (I2 within a tenant). The mismatch trips
    /// the `debug_assert` in test builds; what release builds do is checked by
    /// `cargo test --release -p bulkhead-kvpool`.
    #[test]
    fn a_page_the_owner_does_not_hold_ends_the_cached_chain() {
        let mut s = state(4, Scrub::None);
        let owner = RequestId::new(1);
        let mut table = s.reserve(owner, 3).expect("pages are free");
        s.transition(owner, &table, Hold::Reserved, Target::Hold(Hold::Owned));
        let held = table[1];
        table[1].tag = Tag::new(held.tag.get() - 1);
        let tokens: Vec<u32> = (0..48).collect();
        let chunks: Vec<&[u32]> = tokens.chunks(16).collect();
        let cached = catch_unwind(AssertUnwindSafe(|| {
            s.cache(owner, &table, &chunks, &Scope::new("a"), None)
        }));
        assert_eq!(cached.is_err(), cfg!(debug_assertions));
        let Ok(cached) = cached else { return };
        assert_eq!(cached, 1);
        let stats = s.stats();
        assert_eq!(
            (stats.cached, stats.owned, stats.free),
            (1, 1, 2),
            "the third page is released, the second left with its owner"
        );
        s.check_invariants().expect("consistent");
    }

    #[test]
    fn the_checker_catches_a_miscount() {
        let mut s = state(3, Scrub::None);
        s.stats.quarantined = 1;
        assert!(matches!(
            s.check_invariants(),
            Err(InvariantViolation::Count {
                counter: "quarantined",
                ..
            })
        ));
    }

    #[test]
    fn the_checker_catches_two_pages_with_one_tag() {
        let mut s = state(3, Scrub::None);
        s.tags[2] = s.tags[0];
        assert!(matches!(
            s.check_invariants(),
            Err(InvariantViolation::TagShared { .. })
        ));
    }

    #[test]
    fn the_checker_catches_a_tag_the_counter_would_hand_out_again() {
        let mut s = state(3, Scrub::None);
        s.tags[1] = Tag::new(s.next_tag);
        assert!(matches!(
            s.check_invariants(),
            Err(InvariantViolation::TagAhead { .. })
        ));
    }

    #[test]
    fn reserve_takes_nothing_when_pages_are_short() {
        let mut s = state(2, Scrub::None);
        assert!(s.reserve(RequestId::new(1), 3).is_none());
        assert_eq!(s.stats().free, 2);
        s.check_invariants().expect("unchanged");
    }

    #[test]
    fn reserve_takes_nothing_when_the_tag_counter_is_spent() {
        let mut s = state(2, Scrub::None);
        s.next_tag = u64::MAX;
        assert!(s.reserve(RequestId::new(1), 1).is_none());
        assert_eq!(s.stats().free, 2);
    }
}
