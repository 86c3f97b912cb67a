//! Page lifecycles: one type per state, transitions consume `self`, `Drop` returns the pages.
//!
//! ```text
//!  free ── reserve() ──▶ Reservation ── commit() ──▶ Allocation ── drop / release() ──▶ (scrub) ─▶ free
//!                         │  │  │                     │  │
//!                         │  │  │                     │  └─ quarantine() ─▶ quarantined
//!                         │  │  │                     └─ begin_release() ────────────┐
//!                         │  │  └─ begin_release() ──────────────────────────────────┴─▶ Releasing ─┬─ drained() ─▶ (scrub) ─▶ free
//!                         │  │                                                                      ├─ timed_out() / drop ─▶ quarantined
//!                         │  │                                                                      └─ quarantine() ─▶ quarantined
//!                         │  └─ drop / release() ─▶ (scrub) ─▶ free
//!                         └─ quarantine() ─▶ quarantined
//!
//!  quarantined ── Quarantined::reclaim() (the writer is known gone) ─▶ (scrub) ─▶ free
//!              └─ PagePool::release_quarantine() (operator action) ──▶ (scrub) ─▶ free
//!  (scrub): the scrub queue, emptied by PagePool::scrub_pending(); skipped with Scrub::None
//! ```
//!
//! - [`Reservation`]: pages reserved for a request whose KV is being written (local prefill or
//!   a remote transfer). Its page table verifies.
//! - [`Allocation`]: committed pages of a running request. Its page table verifies.
//! - [`Releasing`]: the request ended but a transfer may still land, so the pages are not
//!   reusable yet and its page table no longer verifies. Only a positive drain
//!   ([`Releasing::drained`]) frees them; a timeout or a drop (we never learned the drain
//!   finished) quarantines them.
//!
//! - [`Quarantined`]: the pages of one quarantine, to give them back once whoever might still
//!   write them is known gone. Dropping it leaves them quarantined.
//!
//! None of these types is `Clone`, and each holds its pages exclusively: the pool records every
//! held page as belonging to exactly one of them (invariant I1).

use std::fmt;
use std::mem;

use crate::admission::PoolIdentity;
use crate::ids::{PageRef, RequestId};
use crate::pool::PagePool;
use crate::prefix::Scope;
use crate::state::{Hold, Target};

/// What every lifecycle object holds.
struct Held {
    /// The pool the pages belong to.
    pool: PagePool,
    /// The request owning the pages; the pool records each of `pages` under this owner.
    owner: RequestId,
    /// Tokens the request was admitted for; `pages.len() * page_tokens >= tokens` while pages
    /// are held.
    tokens: u64,
    /// The page table: exactly the pages the pool records as held by this object, with their
    /// current tags. Empty once moved on to the next state (then `Drop` does nothing), or for a
    /// request admitted with zero tokens.
    pages: Vec<PageRef>,
    /// The cached pages the pages were reserved after, if they were
    /// ([`PagePool::reserve_after`]).
    after: Option<After>,
}

/// The prefix a reservation was made after: its pool, its scope and its pages. Only with
/// this very prefix may the pages join the cache ([`Allocation::keep_prompt`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct After {
    pool: PoolIdentity,
    scope: Scope,
    pages: Vec<PageRef>,
}

impl Held {
    /// Moves the pages from `from` to `to` in the pool and takes them out of `self`, leaving it
    /// empty so that its `Drop` does nothing.
    fn move_out(&mut self, from: Hold, to: Target) -> Self {
        let pages = mem::take(&mut self.pages);
        self.pool.transition(self.owner, &pages, from, to);
        Self {
            pool: self.pool.clone(),
            owner: self.owner,
            tokens: self.tokens,
            pages,
            after: self.after.clone(),
        }
    }

    fn capacity_tokens(&self) -> u64 {
        let pages = u64::try_from(self.pages.len()).unwrap_or(u64::MAX);
        pages.saturating_mul(u64::from(self.pool.config().page_tokens.get()))
    }

    fn fmt(&self, name: &str, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct(name)
            .field("owner", &self.owner)
            .field("tokens", &self.tokens)
            .field("pages", &self.pages)
            .finish_non_exhaustive()
    }
}

/// The read-only view every lifecycle type gives of the pages it holds.
macro_rules! held_accessors {
    ($ty:ident) => {
        impl $ty {
            /// The request the pages belong (or belonged) to.
            #[must_use]
            pub fn owner(&self) -> RequestId {
                self.0.owner
            }

            /// The page table, in reservation order (entry `i` holds tokens
            /// `i * page_tokens ..`); the attention kernel reads through it. Once released it
            /// no longer verifies: then it only serves to recognise late frames, to drop them.
            #[must_use]
            pub fn pages(&self) -> &[PageRef] {
                &self.0.pages
            }

            /// Tokens the request was admitted for (what a transfer must deliver).
            #[must_use]
            pub fn tokens(&self) -> u64 {
                self.0.tokens
            }

            /// Tokens the pages can hold (`pages().len() * page_tokens`, at least `tokens()`).
            #[must_use]
            pub fn capacity_tokens(&self) -> u64 {
                self.0.capacity_tokens()
            }
        }
    };
}

held_accessors!(Reservation);
held_accessors!(Allocation);
held_accessors!(Releasing);
held_accessors!(Quarantined);

/// Pages reserved for a request whose KV is being written. Dropping it releases the pages.
#[must_use = "dropping a Reservation releases its pages"]
pub struct Reservation(Held);

impl Reservation {
    pub(crate) fn new(
        pool: PagePool,
        owner: RequestId,
        tokens: u64,
        pages: Vec<PageRef>,
        after: Option<After>,
    ) -> Self {
        Self(Held {
            pool,
            owner,
            tokens,
            pages,
            after,
        })
    }

    /// The KV is complete and verified: the request now runs on these pages, same tags.
    pub fn commit(mut self) -> Allocation {
        Allocation(self.0.move_out(Hold::Reserved, Target::Hold(Hold::Owned)))
    }

    /// The request ends while a peer may still write the pages: hold them until it drains.
    pub fn begin_release(mut self) -> Releasing {
        Releasing(
            self.0
                .move_out(Hold::Reserved, Target::Hold(Hold::Releasing)),
        )
    }

    /// Nothing can write the pages any more: release them now (same as dropping).
    pub fn release(self) {}

    /// The pages' contents are suspect: take them out of service until an operator releases the
    /// quarantine.
    pub fn quarantine(mut self) -> Quarantined {
        Quarantined(self.0.move_out(Hold::Reserved, Target::Quarantine))
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.0.move_out(Hold::Reserved, Target::Release);
    }
}

impl fmt::Debug for Reservation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt("Reservation", f)
    }
}

/// Committed pages of a running request. Dropping it releases the pages.
#[must_use = "dropping an Allocation releases its pages"]
pub struct Allocation(Held);

impl Allocation {
    /// The request ends while a peer may still write the pages: hold them until it drains.
    pub fn begin_release(mut self) -> Releasing {
        Releasing(self.0.move_out(Hold::Owned, Target::Hold(Hold::Releasing)))
    }

    /// The request ended and nothing can write the pages: release them now (same as dropping).
    pub fn release(self) {}

    /// The request ended and nothing can write the pages: keep those its prompt filled whole
    /// in the prefix cache of `prefix`'s scope, and release the rest. `prefix` must be the one
    /// the allocation was reserved after ([`PagePool::reserve_after`]): `prompt` is the whole
    /// prompt, its first `prefix.tokens()` tokens are in the prefix's pages and page `i` of
    /// this allocation holds the `i`-th whole page of tokens after them. A page whose tokens
    /// another request of the scope cached first is released. Returns how many pages were
    /// cached. Given another prefix than that one — of another scope, pool or length — it
    /// caches nothing and releases every page: cached after it, the pages would be found by
    /// another tenant (I6), or at positions their KV was not computed for.
    pub fn keep_prompt(mut self, prefix: Prefix, prompt: &[u32]) -> u32 {
        if self.0.after.as_ref() != Some(&prefix.after()) {
            return 0;
        }
        let page_tokens = self.0.pool.config().page_tokens.get() as usize;
        let after = prompt.get(prefix.tokens()..).unwrap_or_default();
        let chunks: Vec<&[u32]> = after.chunks_exact(page_tokens).collect();
        let pages = mem::take(&mut self.0.pages);
        let parent = prefix.pages().last().copied();
        self.0
            .pool
            .cache(self.0.owner, &pages, &chunks, prefix.scope(), parent)
    }

    /// The pages' contents are suspect: take them out of service until an operator releases the
    /// quarantine.
    pub fn quarantine(mut self) -> Quarantined {
        Quarantined(self.0.move_out(Hold::Owned, Target::Quarantine))
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        self.0.move_out(Hold::Owned, Target::Release);
    }
}

impl fmt::Debug for Allocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt("Allocation", f)
    }
}

/// Cached pages a request reads: the first whole pages of its prompt, found in its scope's
/// prefix cache ([`PagePool::cached_prefix`]). While it is held they are never evicted;
/// dropping it lets them go (they stay cached until evicted). Its pages are read-only: the
/// request's own pages ([`PagePool::reserve_after`]) follow them in its page table.
#[must_use = "dropping a Prefix lets its pages be evicted"]
pub struct Prefix {
    pool: PagePool,
    scope: Scope,
    pages: Vec<PageRef>,
}

impl Prefix {
    pub(crate) fn new(pool: PagePool, scope: Scope, pages: Vec<PageRef>) -> Self {
        Self { pool, scope, pages }
    }

    pub(crate) fn pool(&self) -> &PagePool {
        &self.pool
    }

    /// What a reservation made after this prefix remembers of it.
    pub(crate) fn after(&self) -> After {
        After {
            pool: self.pool.identity(),
            scope: self.scope.clone(),
            pages: self.pages.clone(),
        }
    }

    /// The cached pages, in prompt order; they head the request's page table.
    #[must_use]
    pub fn pages(&self) -> &[PageRef] {
        &self.pages
    }

    /// Prompt tokens the pages hold (`pages().len() * page_tokens`).
    #[must_use]
    pub fn tokens(&self) -> usize {
        self.pages.len() * self.pool.config().page_tokens.get() as usize
    }

    /// The scope the pages were found in, and the request's pages will be kept in.
    #[must_use]
    pub fn scope(&self) -> &Scope {
        &self.scope
    }

    /// The request reading these pages failed a KV integrity check at page `index` of its page
    /// table. If that is one of these pages, it and every cached page after it are
    /// distrusted: no lookup finds them again, nothing is cached after them, and each leaves
    /// the cache (scrubbed as any evicted page) once its last reader lets it go. Kept, the page
    /// would fail every request of the scope whose prompt starts with its tokens. Returns how
    /// many pages were newly distrusted (none when `index` is past the prefix: the request's
    /// own pages failed).
    #[must_use = "a distrusted page is worth counting"]
    pub fn distrust_from(self, index: usize) -> u32 {
        self.pages
            .get(index)
            .map_or(0, |&page| self.pool.distrust(page))
    }
}

impl Drop for Prefix {
    fn drop(&mut self) {
        self.pool.unread(&self.pages);
    }
}

impl fmt::Debug for Prefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Prefix")
            .field("scope", &self.scope)
            .field("pages", &self.pages)
            .finish_non_exhaustive()
    }
}

/// Pages of an ended request that a transfer may still write. Dropping it quarantines the
/// pages: without a drain acknowledgement they are never reused.
#[must_use = "dropping a Releasing quarantines its pages"]
pub struct Releasing(Held);

impl Releasing {
    /// The peer acknowledged that nothing more will be written (or the transport is torn
    /// down): release the pages.
    pub fn drained(mut self) {
        self.0.move_out(Hold::Releasing, Target::Release);
    }

    /// The drain did not finish in time: quarantine the pages.
    pub fn timed_out(mut self) -> Quarantined {
        Quarantined(self.0.move_out(Hold::Releasing, Target::Quarantine))
    }

    /// Same as [`Releasing::timed_out`], for callers that decide the pages are suspect.
    pub fn quarantine(self) -> Quarantined {
        self.timed_out()
    }
}

/// The pages of one quarantine (a transfer that never drained, or suspect contents), with the
/// tags they had when quarantined. The pool knows them only as quarantined; this handle lets
/// whoever knows that nothing can write them any more give them back. Dropping it leaves them
/// quarantined (until [`PagePool::release_quarantine`]).
pub struct Quarantined(Held);

impl Quarantined {
    /// Nothing can write these pages any more (the peer that might is known gone): return
    /// them towards the free list, through the scrub queue if the pool scrubs. Pages an
    /// operator already released are left alone. Returns how many pages left quarantine.
    pub fn reclaim(mut self) -> u32 {
        let pages = mem::take(&mut self.0.pages);
        self.0.pool.reclaim(&pages)
    }
}

impl fmt::Debug for Quarantined {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt("Quarantined", f)
    }
}

impl Drop for Releasing {
    fn drop(&mut self) {
        self.0.move_out(Hold::Releasing, Target::Quarantine);
    }
}

impl fmt::Debug for Releasing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt("Releasing", f)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::panic::{AssertUnwindSafe, catch_unwind};

    use super::*;
    use crate::config::Scrub;
    use crate::ids::PageId;
    use crate::state::PoolStats;
    use crate::test_support::{pool, reserve};

    fn page_set(pages: &[PageRef]) -> BTreeSet<PageId> {
        pages.iter().map(|e| e.page).collect()
    }

    #[test]
    fn pools_and_lifecycle_objects_can_move_between_threads() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<PagePool>();
        send_sync::<Reservation>();
        send_sync::<Allocation>();
        send_sync::<Releasing>();
    }

    #[test]
    fn every_lifecycle_object_shows_its_owner_tokens_and_page_table() {
        let pool = pool(4, Scrub::None);
        let reservation = reserve(&pool, 7, 20);
        let table = format!("{:?}", reservation.pages());
        let fields = format!("{{ owner: RequestId(7), tokens: 20, pages: {table}, .. }}");
        assert_eq!(format!("{reservation:?}"), format!("Reservation {fields}"));
        let allocation = reservation.commit();
        assert_eq!(format!("{allocation:?}"), format!("Allocation {fields}"));
        let releasing = allocation.begin_release();
        assert_eq!(format!("{releasing:?}"), format!("Releasing {fields}"));
        let quarantined = releasing.timed_out();
        assert_eq!(format!("{quarantined:?}"), format!("Quarantined {fields}"));
    }

    #[test]
    fn a_late_reclaim_never_frees_a_page_the_operator_already_released() {
        let pool = pool(2, Scrub::None);
        let quarantined = reserve(&pool, 1, 16).quarantine();
        assert_eq!(pool.release_quarantine(), 1);
        assert_eq!(pool.free_pages(), 2);
        // The page is free again with the tag it was quarantined with: the handle's reclaim
        // must not put it on the free list a second time.
        assert_eq!(quarantined.reclaim(), 0);
        assert_eq!(pool.free_pages(), 2);
        pool.check_invariants().expect("each page is free once");
    }

    #[test]
    fn dropping_an_allocation_returns_its_pages() {
        let pool = pool(4, Scrub::None);
        let allocation = reserve(&pool, 1, 50).commit();
        assert_eq!(pool.stats().owned, 4);
        drop(allocation);
        assert_eq!(pool.free_pages(), 4);
        pool.check_invariants().expect("invariants hold");
    }

    #[test]
    fn dropping_a_reservation_returns_its_pages() {
        let pool = pool(4, Scrub::None);
        let reservation = reserve(&pool, 1, 17);
        assert_eq!(pool.stats().reserved, 2);
        drop(reservation);
        assert_eq!(pool.free_pages(), 4);
        pool.check_invariants().expect("invariants hold");
    }

    #[test]
    fn commit_keeps_the_pages_and_their_tags() {
        let pool = pool(4, Scrub::None);
        let reservation = reserve(&pool, 7, 33);
        let table = reservation.pages().to_vec();
        let allocation = reservation.commit();
        assert_eq!(allocation.pages(), table.as_slice());
        assert_eq!(allocation.owner(), RequestId::new(7));
        assert_eq!(allocation.tokens(), 33);
        assert_eq!(allocation.capacity_tokens(), 48);
        let stats = pool.stats();
        assert_eq!((stats.reserved, stats.owned, stats.free), (0, 3, 1));
    }

    #[test]
    fn releasing_pages_are_not_reusable_until_drained() {
        for from_reservation in [true, false] {
            let pool = pool(2, Scrub::None);
            let reservation = reserve(&pool, 1, 32);
            let releasing = if from_reservation {
                reservation.begin_release()
            } else {
                reservation.commit().begin_release()
            };
            assert_eq!(pool.stats().releasing, 2);
            assert!(
                pool.verify(releasing.pages()).is_err(),
                "a releasing table is not live"
            );
            let admissible = pool.admit(RequestId::new(2), 1).expect("fits the pool");
            let admissible = pool
                .reserve(admissible)
                .expect_err("releasing pages are not free")
                .into_inner();
            releasing.drained();
            assert_eq!(pool.free_pages(), 2);
            assert!(pool.reserve(admissible).is_ok());
        }
    }

    #[test]
    fn a_releasing_that_is_dropped_or_times_out_quarantines_its_pages() {
        let pool = pool(4, Scrub::None);
        let dropped = reserve(&pool, 1, 16).commit().begin_release();
        let timed_out = reserve(&pool, 2, 32).begin_release();
        drop(dropped);
        timed_out.timed_out();
        assert_eq!(pool.quarantined_pages(), 3);
        assert_eq!(pool.free_pages(), 1);
        pool.check_invariants().expect("invariants hold");
    }

    #[test]
    fn a_quarantine_reclaimed_comes_back_through_the_scrub_and_only_its_own_pages() {
        let pool = pool(4, Scrub::Zero);
        let first = reserve(&pool, 1, 32).begin_release().timed_out();
        let second = reserve(&pool, 2, 16).quarantine();
        assert_eq!(pool.quarantined_pages(), 3);
        assert_eq!(first.reclaim(), 2);
        assert_eq!(pool.quarantined_pages(), 1);
        assert_eq!(
            pool.stats().pending_scrub,
            2,
            "reclaimed pages are scrubbed first"
        );
        let mut scrubbed = 0;
        pool.scrub_pending(|_| scrubbed += 1);
        assert_eq!((scrubbed, pool.free_pages()), (2, 3));
        // The operator released the second quarantine and the page was reserved again: a late
        // reclaim of the old quarantine must not free the new owner's page.
        let page = second.pages()[0];
        assert_eq!(pool.release_quarantine(), 1);
        pool.scrub_pending(|_| {});
        let again = reserve(&pool, 3, 64);
        assert!(again.pages().iter().any(|p| p.page == page.page));
        assert_eq!(second.reclaim(), 0);
        assert_eq!(pool.stats().reserved, 4);
        pool.check_invariants().expect("invariants hold");
    }

    #[test]
    fn quarantined_pages_are_never_reused_until_the_operator_releases_them() {
        let pool = pool(3, Scrub::None);
        reserve(&pool, 1, 16).quarantine();
        reserve(&pool, 2, 16).commit().quarantine();
        reserve(&pool, 3, 16).begin_release().quarantine();
        assert_eq!(pool.quarantined_pages(), 3);
        let admissible = pool.admit(RequestId::new(4), 1).expect("fits the pool");
        let admissible = pool
            .reserve(admissible)
            .expect_err("everything is quarantined")
            .into_inner();
        assert_eq!(pool.release_quarantine(), 3);
        assert_eq!(pool.quarantined_pages(), 0);
        assert!(pool.reserve(admissible).is_ok());
        pool.check_invariants().expect("invariants hold");
    }

    #[test]
    fn with_zero_scrub_released_pages_wait_for_the_scrub_and_f_sees_exactly_them() {
        let pool = pool(4, Scrub::Zero);
        let kept = reserve(&pool, 1, 16).commit();
        let released = reserve(&pool, 2, 32).commit();
        let released_pages = page_set(released.pages());
        drop(released);
        let stats = pool.stats();
        assert_eq!((stats.free, stats.pending_scrub), (1, 2));

        let admissible = pool.admit(RequestId::new(3), 32).expect("fits the pool");
        let admissible = pool
            .reserve(admissible)
            .expect_err("released pages are not scrubbed yet")
            .into_inner();

        let mut scrubbed = Vec::new();
        pool.scrub_pending(|page| scrubbed.push(page));
        assert_eq!(scrubbed.len(), 2, "each page scrubbed once");
        assert_eq!(
            scrubbed.iter().copied().collect::<BTreeSet<_>>(),
            released_pages
        );
        assert!(!scrubbed.iter().any(|p| kept.pages()[0].page == *p));
        assert_eq!(pool.free_pages(), 3);

        let again = pool.reserve(admissible).expect("scrubbed pages are free");
        assert_eq!(page_set(again.pages()).len(), 2);
        pool.scrub_pending(|page| panic!("{page} was not released"));
        pool.check_invariants().expect("invariants hold");
    }

    #[test]
    fn with_canary_scrub_drained_and_unquarantined_pages_are_scrubbed_too() {
        let pool = pool(2, Scrub::Canary);
        reserve(&pool, 1, 16).begin_release().drained();
        reserve(&pool, 2, 16).quarantine();
        assert_eq!(pool.release_quarantine(), 1);
        assert_eq!(
            pool.stats(),
            PoolStats {
                total: 2,
                pending_scrub: 2,
                ..PoolStats::default()
            }
        );
        let mut count = 0;
        pool.scrub_pending(|_| count += 1);
        assert_eq!(count, 2);
        assert_eq!(pool.free_pages(), 2);
    }

    #[test]
    fn with_no_scrub_released_pages_are_free_at_once() {
        let pool = pool(2, Scrub::None);
        drop(reserve(&pool, 1, 32));
        assert_eq!(pool.free_pages(), 2);
        pool.scrub_pending(|page| panic!("{page} needs no scrub"));
    }

    #[test]
    fn a_panicking_scrub_leaves_the_unscrubbed_pages_queued() {
        let pool = pool(3, Scrub::Zero);
        drop(reserve(&pool, 1, 48));
        let mut calls = 0;
        let result = catch_unwind(AssertUnwindSafe(|| {
            pool.scrub_pending(|_| {
                calls += 1;
                assert!(calls < 2, "the physical layer failed");
            });
        }));
        assert!(result.is_err());
        let stats = pool.stats();
        assert_eq!((stats.free, stats.pending_scrub), (1, 2));
        pool.check_invariants()
            .expect("invariants hold after a panic");
        pool.scrub_pending(|_| {});
        assert_eq!(pool.free_pages(), 3);
    }
}
