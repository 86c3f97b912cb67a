//! The shared pool handle.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::admission::{Admissible, NotNow, PoolIdentity};
use crate::config::PoolConfig;
use crate::error::{InvariantViolation, Rejected, TagMismatch};
use crate::ids::{PageId, PageRef, RequestId, Tag};
use crate::lifecycle::{After, Prefix, Reservation};
use crate::prefix::Scope;
use crate::state::{Hold, PoolState, PoolStats, Target};

/// Source of pool identities; only used to tell pools apart.
static NEXT_POOL: AtomicU64 = AtomicU64::new(0);

/// A cheap, cloneable handle to one page pool.
///
/// All clones share one [`PoolState`] behind a mutex. Lifecycle objects hold a clone so that
/// dropping them can return their pages. No method panics for any argument, and a panic
/// elsewhere while the lock was held (the mutex is then poisoned) does not wedge the pool:
/// every transition leaves the state consistent before it can run caller code, so the lock is
/// recovered as is.
#[derive(Clone)]
pub struct PagePool {
    shared: Arc<Shared>,
}

struct Shared {
    /// A copy of the configuration, readable without the lock; never changes.
    config: PoolConfig,
    /// Distinguishes this pool's admissions from any other pool's.
    identity: PoolIdentity,
    /// The state; see [`PoolState`] for its invariants.
    state: Mutex<PoolState>,
}

impl PagePool {
    /// A pool whose pages are all free.
    #[must_use]
    pub fn new(config: PoolConfig) -> Self {
        Self {
            shared: Arc::new(Shared {
                config,
                identity: PoolIdentity(NEXT_POOL.fetch_add(1, Ordering::Relaxed)),
                state: Mutex::new(PoolState::new(config)),
            }),
        }
    }

    /// The pool's configuration.
    #[must_use]
    pub fn config(&self) -> &PoolConfig {
        &self.shared.config
    }

    /// Pages needed for `tokens` tokens: `ceil(tokens / page_tokens)`.
    #[must_use]
    pub fn pages_for(&self, tokens: u64) -> u64 {
        self.shared.config.pages_for(tokens)
    }

    /// Decides, before anything is allocated, whether `tokens` tokens for `owner` can ever fit
    /// this pool: they must fit its whole capacity. Pure: changes nothing.
    ///
    /// # Errors
    ///
    /// [`Rejected::ContextLengthExceeded`] with the requested and the pool's total tokens if
    /// the request needs more pages than the pool has.
    pub fn admit(&self, owner: RequestId, tokens: u64) -> Result<Admissible, Rejected> {
        let config = &self.shared.config;
        match u32::try_from(config.pages_for(tokens)) {
            Ok(pages) if pages <= config.pages.get() => Ok(Admissible {
                pool: self.shared.identity,
                owner,
                tokens,
                pages,
            }),
            _ => Err(Rejected::ContextLengthExceeded {
                requested_tokens: tokens,
                capacity_tokens: config.capacity_tokens(),
            }),
        }
    }

    /// TEST BUILDS ONLY (feature `check-switches`): an admission that skips the capacity
    /// check, as if admission were off. A request larger than the pool gets an [`Admissible`]
    /// that [`PagePool::reserve`] can never satisfy: it comes back as [`NotNow`] forever,
    /// because a reservation takes every page it needs or none.
    #[cfg(feature = "check-switches")]
    #[must_use]
    pub fn admit_unchecked(&self, owner: RequestId, tokens: u64) -> Admissible {
        let config = &self.shared.config;
        Admissible {
            pool: self.shared.identity,
            owner,
            tokens,
            pages: u32::try_from(config.pages_for(tokens)).unwrap_or(u32::MAX),
        }
    }

    /// Reserves the pages of an admitted request now, each with a fresh tag, from the front of
    /// the free list.
    ///
    /// # Errors
    ///
    /// [`NotNow`] holding the admission, with nothing changed, if fewer pages are free than it
    /// needs. An admission made by another pool is never reserved here: it always comes back
    /// as `NotNow`.
    pub fn reserve(&self, admissible: Admissible) -> Result<Reservation, NotNow> {
        self.reserve_pages(admissible, 0, None)
    }

    /// Reserves the pages of an admitted request that `prefix` does not hold: its first
    /// `prefix.pages().len()` pages are the cached ones, so the reservation holds the rest,
    /// for the tokens after them.
    ///
    /// # Errors
    ///
    /// As [`PagePool::reserve`]; a prefix found in another pool is never reserved after
    /// either.
    pub fn reserve_after(
        &self,
        admissible: Admissible,
        prefix: &Prefix,
    ) -> Result<Reservation, NotNow> {
        if !Arc::ptr_eq(&prefix.pool().shared, &self.shared) {
            return Err(NotNow(admissible));
        }
        let cached = u32::try_from(prefix.pages().len()).unwrap_or(u32::MAX);
        self.reserve_pages(admissible, cached, Some(prefix.after()))
    }

    fn reserve_pages(
        &self,
        admissible: Admissible,
        cached: u32,
        after: Option<After>,
    ) -> Result<Reservation, NotNow> {
        if admissible.pool != self.shared.identity {
            return Err(NotNow(admissible));
        }
        let pages = admissible.pages.saturating_sub(cached);
        let reserved = self.lock().reserve(admissible.owner, pages);
        let cached_tokens = u64::from(cached) * u64::from(self.shared.config.page_tokens.get());
        match reserved {
            Some(pages) => Ok(Reservation::new(
                self.clone(),
                admissible.owner,
                admissible.tokens.saturating_sub(cached_tokens),
                pages,
                after,
            )),
            None => Err(NotNow(admissible)),
        }
    }

    /// Prefix cache: the cached pages of `scope` that hold `prompt`'s first whole pages, as
    /// many as are cached in a row from the first, at most `max_pages`. They are read — never
    /// evicted — until the returned [`Prefix`] is dropped; it is empty when nothing matched.
    pub fn cached_prefix(&self, scope: &Scope, prompt: &[u32], max_pages: usize) -> Prefix {
        let page_tokens = self.shared.config.page_tokens.get() as usize;
        let chunks = prompt.chunks_exact(page_tokens).take(max_pages);
        let pages = self.lock().find_prefix(scope, chunks);
        Prefix::new(self.clone(), scope.clone(), pages)
    }

    /// Prefix cache: gives up to `pages` cached pages that no request reads back towards the
    /// free list (through the scrub queue if the pool scrubs), least recently used first.
    /// Returns how many.
    pub fn evict(&self, pages: u32) -> u32 {
        self.lock().evict(pages)
    }

    /// Prefix cache: makes `pages` pages free as [`PagePool::evict`] does when the cache can
    /// give that many, and evicts nothing when it cannot: a request the eviction would still
    /// leave short empties no other tenant's cache. Returns how many.
    pub fn make_room(&self, pages: u32) -> u32 {
        self.lock().make_room(pages)
    }

    /// Takes a reader off each of `pages` (a [`Prefix`] being dropped).
    pub(crate) fn unread(&self, pages: &[PageRef]) {
        self.lock().unread(pages);
    }

    /// Distrusts a cached page and those after it; see [`crate::Prefix::distrust_from`].
    pub(crate) fn distrust(&self, page: PageRef) -> u32 {
        self.lock().distrust(page)
    }

    /// Moves an allocation's pages into the prefix cache; see [`PoolState::cache`].
    pub(crate) fn cache(
        &self,
        owner: RequestId,
        pages: &[PageRef],
        chunks: &[&[u32]],
        scope: &Scope,
        parent: Option<PageRef>,
    ) -> u32 {
        self.lock().cache(owner, pages, chunks, scope, parent)
    }

    /// The pool's identity (what an admission or a prefix of it carries).
    pub(crate) fn identity(&self) -> PoolIdentity {
        self.shared.identity
    }

    /// Pages on the free list (allocatable now).
    #[must_use]
    pub fn free_pages(&self) -> u32 {
        self.lock().stats().free
    }

    /// Pages in quarantine (never reused until [`PagePool::release_quarantine`]).
    #[must_use]
    pub fn quarantined_pages(&self) -> u32 {
        self.lock().stats().quarantined
    }

    /// Page counts by state.
    #[must_use]
    pub fn stats(&self) -> PoolStats {
        self.lock().stats()
    }

    /// The current tag of `page`, or `None` if the pool has no such page.
    ///
    /// A page keeps its tag from one reservation to the next, so a tag alone does not say the
    /// page is live; [`PagePool::verify`] checks both.
    #[must_use]
    pub fn current_tag(&self, page: PageId) -> Option<Tag> {
        self.lock().current_tag(page)
    }

    /// Checks a page table: every entry must name a page of this pool that is held by a live
    /// reservation or allocation and still carries the entry's tag. Tags are unique within a
    /// pool, so a match identifies the one allocation the table was made for.
    ///
    /// # Errors
    ///
    /// [`TagMismatch`] for the first entry that fails, saying what the pool found there.
    pub fn verify(&self, table: &[PageRef]) -> Result<(), TagMismatch> {
        self.lock().verify(table)
    }

    /// Locks the pool once and lets `f` read every page's current tag, indexed by
    /// [`PageId::index`]. `f` runs with the pool locked: it must not call this pool.
    ///
    /// Comparing a table's tags with these proves no page was reallocated since the table was
    /// made; that the table's owner is still live is proved by the caller holding its
    /// [`Allocation`](crate::Allocation).
    pub fn with_tags<R>(&self, f: impl FnOnce(&[Tag]) -> R) -> R {
        f(self.lock().tags())
    }

    /// Calls `f` for every released page waiting for its scrub (oldest first) and then makes it
    /// free. With [`Scrub::None`](crate::Scrub::None) nothing ever waits. `f` runs with the pool
    /// locked: it must scrub the page's bytes and must not call this pool. If `f` panics, the
    /// page it was scrubbing and the ones after it stay queued.
    pub fn scrub_pending(&self, f: impl FnMut(PageId)) {
        self.lock().scrub_pending(f);
    }

    /// Operator action: returns every quarantined page towards the free list, through the
    /// scrub queue if the pool scrubs. Returns how many pages left quarantine.
    pub fn release_quarantine(&self) -> u32 {
        self.lock().release_quarantine()
    }

    /// Returns the pages of one quarantine towards the free list; see
    /// [`Quarantined::reclaim`](crate::Quarantined::reclaim).
    pub(crate) fn reclaim(&self, pages: &[PageRef]) -> u32 {
        self.lock().reclaim(pages)
    }

    /// Checks the pool's internal invariants (see [`PoolState::check_invariants`]).
    ///
    /// # Errors
    ///
    /// The first violation found; any error is a bug in this crate.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.lock().check_invariants()
    }

    /// Moves pages held by a lifecycle object; used only by the lifecycle types.
    pub(crate) fn transition(&self, owner: RequestId, pages: &[PageRef], from: Hold, to: Target) {
        if pages.is_empty() {
            return;
        }
        self.lock().transition(owner, pages, from, to);
    }

    /// The state, recovering from poisoning: no transition runs caller code half-way, so a
    /// poisoned state is still consistent.
    fn lock(&self) -> MutexGuard<'_, PoolState> {
        self.shared
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// Shows the configuration only: formatting must not take the lock (it may be held by the
/// caller, for example inside [`PagePool::with_tags`]).
impl fmt::Debug for PagePool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PagePool")
            .field("config", &self.shared.config)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use std::panic::{AssertUnwindSafe, catch_unwind};

    use super::*;
    use crate::config::Scrub;
    use crate::error::Found;
    use crate::test_support::{pool, reserve};

    #[test]
    fn a_prompt_larger_than_the_pool_is_rejected_before_any_allocation() {
        let pool = pool(4, Scrub::None);
        let rejected = pool
            .admit(RequestId::new(1), 65)
            .expect_err("65 tokens need 5 pages of 16");
        assert_eq!(
            rejected,
            Rejected::ContextLengthExceeded {
                requested_tokens: 65,
                capacity_tokens: 64,
            }
        );
        assert_eq!(pool.stats().free, 4, "admission allocates nothing");
        let huge = pool.admit(RequestId::new(2), u64::MAX);
        assert!(matches!(
            huge,
            Err(Rejected::ContextLengthExceeded {
                requested_tokens: u64::MAX,
                capacity_tokens: 64
            })
        ));
    }

    /// Why the incident cannot happen here even with admission off: a reservation takes every
    /// page it needs or none, so a request larger than the pool is never placed at all.
    #[cfg(feature = "check-switches")]
    #[test]
    fn without_admission_a_request_larger_than_the_pool_is_never_reserved_even_when_all_is_free() {
        let pool = pool(4, Scrub::None);
        let mut admissible = pool.admit_unchecked(RequestId::new(1), 65);
        assert_eq!(admissible.pages(), 5);
        for _ in 0..3 {
            let not_now = pool.reserve(admissible).expect_err("5 pages never fit 4");
            admissible = not_now.into_inner();
            assert_eq!(pool.free_pages(), 4, "nothing was taken");
        }
        pool.check_invariants().expect("invariants hold");
    }

    #[test]
    fn a_prompt_that_fills_the_whole_pool_is_admitted() {
        let pool = pool(4, Scrub::None);
        assert_eq!((pool.pages_for(64), pool.pages_for(65)), (4, 5));
        let admissible = pool.admit(RequestId::new(1), 64).expect("exactly fits");
        assert_eq!(admissible.pages(), 4);
        assert_eq!(pool.stats().free, 4, "admission allocates nothing");
        let reservation = pool.reserve(admissible).expect("all pages are free");
        assert_eq!(reservation.pages().len(), 4);
        assert_eq!(pool.free_pages(), 0);
    }

    #[test]
    fn reserve_hands_the_admission_back_when_pages_are_short_and_succeeds_after_a_release() {
        let pool = pool(4, Scrub::None);
        let first = reserve(&pool, 1, 48);
        let admissible = pool.admit(RequestId::new(2), 32).expect("fits the pool");
        let not_now = pool.reserve(admissible).expect_err("only one page is free");
        assert_eq!(pool.free_pages(), 1, "a refused reservation takes nothing");
        let admissible = not_now.into_inner();
        assert_eq!(admissible.owner(), RequestId::new(2));
        assert_eq!(admissible.tokens(), 32);
        drop(first);
        let second = pool.reserve(admissible).expect("pages came back");
        assert_eq!(second.pages().len(), 2);
        pool.check_invariants().expect("invariants hold");
    }

    #[test]
    fn an_admission_from_another_pool_is_never_reserved() {
        let big = pool(8, Scrub::None);
        let small = pool(2, Scrub::None);
        let admissible = big
            .admit(RequestId::new(1), 128)
            .expect("fits the big pool");
        let not_now = small.reserve(admissible).expect_err("foreign admission");
        assert_eq!(not_now.admissible().pages(), 8);
        assert_eq!(small.free_pages(), 2);
    }

    #[test]
    fn a_page_table_of_a_live_reservation_or_allocation_verifies() {
        let pool = pool(4, Scrub::None);
        let reservation = reserve(&pool, 1, 20);
        pool.verify(reservation.pages()).expect("live reservation");
        let allocation = reservation.commit();
        pool.verify(allocation.pages()).expect("live allocation");
        let table = allocation.pages().to_vec();
        let ok = pool.with_tags(|tags| {
            table
                .iter()
                .all(|entry| tags.get(entry.page.index()) == Some(&entry.tag))
        });
        assert!(ok);
    }

    #[test]
    fn a_stale_page_table_fails_verify_after_its_pages_go_to_another_owner() {
        let pool = pool(2, Scrub::None);
        let victim = reserve(&pool, 1, 32).commit();
        let stale = victim.pages().to_vec();
        drop(victim);
        let err = pool.verify(&stale).expect_err("pages were released");
        assert!(matches!(err.found, Found::NotLive { .. }), "{err:?}");

        let other = reserve(&pool, 2, 32).commit();
        let err = pool.verify(&stale).expect_err("pages were reallocated");
        assert_eq!(err.page, stale[0].page);
        assert_eq!(err.expected, stale[0].tag);
        assert_eq!(err.found, Found::OtherTag(other.pages()[0].tag));
        assert!(other.pages()[0].tag > stale[0].tag);
        let kernel_sees_stale = pool.with_tags(|tags| {
            stale
                .iter()
                .any(|entry| tags.get(entry.page.index()) == Some(&entry.tag))
        });
        assert!(!kernel_sees_stale, "the kernel's tag check fails too");
    }

    #[test]
    fn an_out_of_range_page_is_a_mismatch_not_a_panic() {
        let pool = pool(2, Scrub::None);
        let entry = PageRef {
            page: PageId::new(u32::MAX),
            tag: Tag::new(1),
        };
        assert_eq!(pool.current_tag(entry.page), None);
        let err = pool.verify(&[entry]).expect_err("no such page");
        assert_eq!(err.found, Found::NoSuchPage);
    }

    #[test]
    fn a_free_page_never_verifies_even_with_its_current_tag() {
        let pool = pool(2, Scrub::None);
        let page = PageId::new(0);
        let tag = pool.current_tag(page).expect("page 0 exists");
        let err = pool.verify(&[PageRef { page, tag }]).expect_err("free");
        assert_eq!(err.found, Found::NotLive { current: tag });
    }

    #[test]
    fn every_reservation_tags_its_pages_above_every_earlier_tag() {
        let pool = pool(3, Scrub::None);
        let mut highest = pool.with_tags(|tags| tags.iter().copied().max());
        for owner in 0..10 {
            let reservation = reserve(&pool, owner, 40);
            for entry in reservation.pages() {
                assert!(Some(entry.tag) > highest, "{entry:?} after {highest:?}");
                assert_eq!(pool.current_tag(entry.page), Some(entry.tag));
            }
            highest = reservation.pages().iter().map(|e| e.tag).max();
        }
    }

    #[test]
    fn a_freed_page_goes_to_the_back_of_the_free_list() {
        let pool = pool(3, Scrub::None);
        let first = reserve(&pool, 1, 1);
        let freed = first.pages()[0].page;
        drop(first);
        let next = reserve(&pool, 2, 16 * 2);
        assert!(
            next.pages().iter().all(|e| e.page != freed),
            "the two pages never used go first"
        );
        let last = reserve(&pool, 3, 1);
        assert_eq!(last.pages()[0].page, freed);
    }

    #[test]
    fn a_panic_while_the_lock_is_held_does_not_wedge_the_pool() {
        let pool = pool(2, Scrub::None);
        let held = reserve(&pool, 1, 16);
        let result = catch_unwind(AssertUnwindSafe(|| {
            pool.with_tags(|_| panic!("kernel bug"));
        }));
        assert!(result.is_err());
        assert_eq!(pool.free_pages(), 1);
        drop(held);
        assert_eq!(pool.free_pages(), 2);
        pool.check_invariants()
            .expect("invariants hold after poisoning");
    }

    #[test]
    fn the_handle_reports_a_broken_invariant() {
        let pool = pool(2, Scrub::None);
        pool.check_invariants().expect("a fresh pool is consistent");
        pool.lock().miscount_for_test();
        assert!(matches!(
            pool.check_invariants(),
            Err(InvariantViolation::Count {
                counter: "quarantined",
                ..
            })
        ));
    }

    #[test]
    fn debug_shows_the_configuration_without_taking_the_lock() {
        let pool = pool(3, Scrub::Canary);
        // Formatting while the lock is held would deadlock if `Debug` took it.
        let shown = pool.with_tags(|_| format!("{pool:?}"));
        assert_eq!(
            shown,
            "PagePool { config: PoolConfig { pages: 3, page_tokens: 16, scrub: Canary }, .. }"
        );
    }

    #[test]
    fn a_zero_token_admission_holds_no_pages() {
        let pool = pool(1, Scrub::Zero);
        let reservation = reserve(&pool, 1, 0);
        assert!(reservation.pages().is_empty());
        reservation.commit().begin_release().timed_out();
        assert_eq!(pool.stats().quarantined, 0);
        assert_eq!(pool.free_pages(), 1);
    }
}
