//! Random sequences of pool operations against an independent model of who holds what.
//!
//! The model tracks, without looking at the pool, which owner holds each page, which pages are
//! quarantined or waiting for a scrub, the order of the free list, and the last tag each page
//! carried. After every operation the pool must agree with it, and:
//!
//! - `check_invariants` holds (I1 as the pool sees it);
//! - no page is handed to a new owner while the model says someone holds it (I1 as the user
//!   sees it);
//! - every reservation gives a page a tag strictly greater than any tag it had before;
//! - live tables verify; no entry of a releasing or retired holder's table verifies again
//!   (stale-read guard);
//! - reclaiming a quarantine returns exactly its pages still quarantined under its tags (not
//!   those an operator released meanwhile, which may serve another owner now);
//! - once everything is dropped, the quarantine released and the scrub queue drained, every
//!   page is free again (pages always come back).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::num::NonZeroU32;

use bulkhead_kvpool::{
    Allocation, PageId, PagePool, PageRef, PoolConfig, Quarantined, Rejected, Releasing, RequestId,
    Reservation, Scrub, Tag,
};
use proptest::prelude::*;

use crate::take;

#[derive(Clone, Debug)]
enum Op {
    Reserve { tokens: u64 },
    Commit(usize),
    DropReservation(usize),
    ReservationBeginRelease(usize),
    ReservationQuarantine(usize),
    DropAllocation(usize),
    AllocationBeginRelease(usize),
    AllocationQuarantine(usize),
    Drained(usize),
    TimedOut(usize),
    DropReleasing(usize),
    ReleasingQuarantine(usize),
    Reclaim(usize),
    ForgetQuarantine(usize),
    ScrubPending,
    ReleaseQuarantine,
}

fn op(max_tokens: u64) -> impl Strategy<Value = Op> {
    let i = any::<usize>;
    prop_oneof![
        4 => (0..=max_tokens).prop_map(|tokens| Op::Reserve { tokens }),
        2 => i().prop_map(Op::Commit),
        1 => i().prop_map(Op::DropReservation),
        1 => i().prop_map(Op::ReservationBeginRelease),
        1 => i().prop_map(Op::ReservationQuarantine),
        1 => i().prop_map(Op::DropAllocation),
        1 => i().prop_map(Op::AllocationBeginRelease),
        1 => i().prop_map(Op::AllocationQuarantine),
        1 => i().prop_map(Op::Drained),
        1 => i().prop_map(Op::TimedOut),
        1 => i().prop_map(Op::DropReleasing),
        1 => i().prop_map(Op::ReleasingQuarantine),
        2 => i().prop_map(Op::Reclaim),
        1 => i().prop_map(Op::ForgetQuarantine),
        1 => Just(Op::ScrubPending),
        1 => Just(Op::ReleaseQuarantine),
    ]
}

fn scrub() -> impl Strategy<Value = Scrub> {
    prop_oneof![Just(Scrub::None), Just(Scrub::Zero), Just(Scrub::Canary)]
}

fn case() -> impl Strategy<Value = (PoolConfig, Vec<Op>)> {
    (1u32..=8, 1u32..=4, scrub()).prop_flat_map(|(pages, page_tokens, scrub)| {
        let config = PoolConfig {
            pages: NonZeroU32::new(pages).expect("at least one page"),
            page_tokens: NonZeroU32::new(page_tokens).expect("at least one token"),
            scrub,
        };
        // Up to a little over the capacity, so that some requests are rejected.
        let max_tokens = config.capacity_tokens() + u64::from(page_tokens) * 2;
        (Just(config), prop::collection::vec(op(max_tokens), 1..80))
    })
}

/// Where released pages go in the model.
enum Dest {
    Release,
    Quarantine,
}

/// The test's own record of the pool, kept without asking the pool.
struct Model {
    pool: PagePool,
    total: u32,
    deferred: bool,
    next_owner: u64,
    /// The holder of every page held by a live object of this test.
    holder: HashMap<PageId, RequestId>,
    /// The free list, in the order pages must be handed out.
    free: VecDeque<PageId>,
    /// The scrub queue, in the order `scrub_pending` must report it.
    pending: VecDeque<PageId>,
    /// Quarantined pages, with the tag each was quarantined under.
    quarantined: BTreeMap<PageId, Tag>,
    /// The highest tag each page has carried in a table.
    last_tag: HashMap<PageId, Tag>,
    /// Tables of holders that left the live states; they must never verify again.
    retired: Vec<Vec<PageRef>>,
    reservations: Vec<Reservation>,
    allocations: Vec<Allocation>,
    releasing: Vec<Releasing>,
    /// Quarantine handles not yet reclaimed or dropped, with the table each was made from.
    quarantines: Vec<(Quarantined, Vec<PageRef>)>,
}

impl Model {
    fn new(config: PoolConfig) -> Self {
        Self {
            pool: PagePool::new(config),
            total: config.pages.get(),
            deferred: config.scrub != Scrub::None,
            next_owner: 0,
            holder: HashMap::new(),
            free: (0..config.pages.get()).map(PageId::new).collect(),
            pending: VecDeque::new(),
            quarantined: BTreeMap::new(),
            last_tag: HashMap::new(),
            retired: Vec::new(),
            reservations: Vec::new(),
            allocations: Vec::new(),
            releasing: Vec::new(),
            quarantines: Vec::new(),
        }
    }

    /// Pages leave their holder in the model, in table order.
    fn leave(&mut self, table: &[PageRef], dest: Dest) {
        for entry in table {
            assert!(
                self.holder.remove(&entry.page).is_some(),
                "{:?} was not held",
                entry.page
            );
            match dest {
                Dest::Release if self.deferred => self.pending.push_back(entry.page),
                Dest::Release => self.free.push_back(entry.page),
                Dest::Quarantine => {
                    assert!(self.quarantined.insert(entry.page, entry.tag).is_none());
                }
            }
        }
    }

    fn reserve(&mut self, tokens: u64) {
        self.next_owner += 1;
        let owner = RequestId::new(self.next_owner);
        let config = *self.pool.config();
        let admissible = match self.pool.admit(owner, tokens) {
            Ok(admissible) => admissible,
            Err(rejected) => {
                assert!(tokens > config.capacity_tokens());
                assert_eq!(
                    rejected,
                    Rejected::ContextLengthExceeded {
                        requested_tokens: tokens,
                        capacity_tokens: config.capacity_tokens(),
                    }
                );
                return;
            }
        };
        assert!(tokens <= config.capacity_tokens());
        let needed = usize::try_from(config.pages_for(tokens)).expect("small pool");
        match self.pool.reserve(admissible) {
            Err(not_now) => {
                assert!(self.free.len() < needed, "refused with enough free pages");
                assert_eq!(not_now.admissible().owner(), owner);
            }
            Ok(reservation) => {
                assert!(
                    self.free.len() >= needed,
                    "reserved pages that were not free"
                );
                assert_eq!(reservation.pages().len(), needed);
                assert_eq!(reservation.owner(), owner);
                for entry in reservation.pages() {
                    let expected = self.free.pop_front();
                    assert_eq!(Some(entry.page), expected, "free list is FIFO");
                    if let Some(previous) = self.holder.insert(entry.page, owner) {
                        panic!(
                            "{:?} handed to {owner} while {previous} holds it",
                            entry.page
                        );
                    }
                    if let Some(&last) = self.last_tag.get(&entry.page) {
                        assert!(entry.tag > last, "tag did not grow on reuse");
                    }
                    self.last_tag.insert(entry.page, entry.tag);
                }
                self.reservations.push(reservation);
            }
        }
    }

    fn apply(&mut self, op: Op) {
        match op {
            Op::Reserve { tokens } => self.reserve(tokens),
            Op::Commit(i) => {
                if let Some(r) = take(&mut self.reservations, i) {
                    let table = r.pages().to_vec();
                    let a = r.commit();
                    assert_eq!(a.pages(), table.as_slice(), "commit keeps the table");
                    self.allocations.push(a);
                }
            }
            Op::DropReservation(i) => {
                if let Some(r) = take(&mut self.reservations, i) {
                    let table = r.pages().to_vec();
                    drop(r);
                    self.leave(&table, Dest::Release);
                    self.retired.push(table);
                }
            }
            Op::ReservationBeginRelease(i) => {
                if let Some(r) = take(&mut self.reservations, i) {
                    self.retired.push(r.pages().to_vec());
                    self.releasing.push(r.begin_release());
                }
            }
            Op::ReservationQuarantine(i) => {
                if let Some(r) = take(&mut self.reservations, i) {
                    let table = r.pages().to_vec();
                    let q = r.quarantine();
                    self.quarantined_as(q, &table);
                    self.retired.push(table);
                }
            }
            Op::DropAllocation(i) => {
                if let Some(a) = take(&mut self.allocations, i) {
                    let table = a.pages().to_vec();
                    drop(a);
                    self.leave(&table, Dest::Release);
                    self.retired.push(table);
                }
            }
            Op::AllocationBeginRelease(i) => {
                if let Some(a) = take(&mut self.allocations, i) {
                    self.retired.push(a.pages().to_vec());
                    self.releasing.push(a.begin_release());
                }
            }
            Op::AllocationQuarantine(i) => {
                if let Some(a) = take(&mut self.allocations, i) {
                    let table = a.pages().to_vec();
                    let q = a.quarantine();
                    self.quarantined_as(q, &table);
                    self.retired.push(table);
                }
            }
            Op::Drained(i) => {
                if let Some(r) = take(&mut self.releasing, i) {
                    let table = r.pages().to_vec();
                    r.drained();
                    self.leave(&table, Dest::Release);
                }
            }
            Op::TimedOut(i) => self.releasing_quarantined(i, Releasing::timed_out),
            Op::DropReleasing(i) => {
                if let Some(r) = take(&mut self.releasing, i) {
                    let table = r.pages().to_vec();
                    drop(r);
                    self.leave(&table, Dest::Quarantine);
                }
            }
            Op::ReleasingQuarantine(i) => self.releasing_quarantined(i, Releasing::quarantine),
            Op::Reclaim(i) => {
                if let Some((q, table)) = take(&mut self.quarantines, i) {
                    let mut expected = 0;
                    for entry in &table {
                        if self.quarantined.get(&entry.page) == Some(&entry.tag) {
                            self.quarantined.remove(&entry.page);
                            self.returned(entry.page);
                            expected += 1;
                        }
                    }
                    assert_eq!(q.reclaim(), expected, "reclaimed exactly its own pages");
                }
            }
            Op::ForgetQuarantine(i) => {
                take(&mut self.quarantines, i);
            }
            Op::ScrubPending => self.scrub(),
            Op::ReleaseQuarantine => {
                let released = self.pool.release_quarantine();
                assert_eq!(released as usize, self.quarantined.len());
                for page in std::mem::take(&mut self.quarantined).into_keys() {
                    self.returned(page);
                }
            }
        }
    }

    /// Releasing holder `i` (if any) goes into quarantine as `how` puts it there.
    fn releasing_quarantined(&mut self, i: usize, how: fn(Releasing) -> Quarantined) {
        if let Some(r) = take(&mut self.releasing, i) {
            let table = r.pages().to_vec();
            let q = how(r);
            self.quarantined_as(q, &table);
        }
    }

    /// The pages of `table` went into quarantine, held by `q`.
    fn quarantined_as(&mut self, q: Quarantined, table: &[PageRef]) {
        self.leave(table, Dest::Quarantine);
        self.quarantines.push((q, table.to_vec()));
    }

    /// `page` left quarantine: towards the free list, through the scrub queue if the pool
    /// scrubs.
    fn returned(&mut self, page: PageId) {
        if self.deferred {
            self.pending.push_back(page);
        } else {
            self.free.push_back(page);
        }
    }

    fn scrub(&mut self) {
        let mut scrubbed = Vec::new();
        self.pool.scrub_pending(|page| scrubbed.push(page));
        let expected: Vec<PageId> = self.pending.drain(..).collect();
        assert_eq!(
            scrubbed, expected,
            "scrub_pending sees exactly the pending pages"
        );
        self.free.extend(expected);
    }

    /// The pool agrees with the model.
    fn check(&self) {
        if let Err(violation) = self.pool.check_invariants() {
            panic!("{violation}");
        }
        let count = |tables: &mut dyn Iterator<Item = &[PageRef]>| -> u32 {
            tables.map(|t| u32::try_from(t.len()).expect("small")).sum()
        };
        let reserved = count(&mut self.reservations.iter().map(Reservation::pages));
        let owned = count(&mut self.allocations.iter().map(Allocation::pages));
        let releasing = count(&mut self.releasing.iter().map(Releasing::pages));
        let stats = self.pool.stats();
        assert_eq!(stats.total, self.total);
        assert_eq!(stats.reserved, reserved);
        assert_eq!(stats.owned, owned);
        assert_eq!(stats.releasing, releasing);
        assert_eq!(stats.quarantined as usize, self.quarantined.len());
        assert_eq!(stats.pending_scrub as usize, self.pending.len());
        assert_eq!(stats.free as usize, self.free.len());
        assert_eq!(
            stats.free + reserved + owned + releasing + stats.quarantined + stats.pending_scrub,
            self.total,
            "every page is somewhere"
        );
        assert_eq!(self.pool.free_pages(), stats.free);
        assert_eq!(self.pool.quarantined_pages(), stats.quarantined);

        let owners = self
            .reservations
            .iter()
            .map(|r| (r.owner(), r.pages()))
            .chain(self.allocations.iter().map(|a| (a.owner(), a.pages())))
            .chain(self.releasing.iter().map(|r| (r.owner(), r.pages())));
        for (owner, table) in owners {
            for entry in table {
                assert_eq!(self.holder.get(&entry.page), Some(&owner));
            }
        }
        for r in &self.reservations {
            assert_eq!(self.pool.verify(r.pages()), Ok(()));
        }
        for a in &self.allocations {
            assert_eq!(self.pool.verify(a.pages()), Ok(()));
            let current = self.pool.with_tags(|tags| {
                a.pages()
                    .iter()
                    .all(|e| tags.get(e.page.index()) == Some(&e.tag))
            });
            assert!(current, "the kernel sees a live allocation's tags");
        }
        for entry in self.releasing.iter().flat_map(Releasing::pages) {
            assert!(
                self.pool.verify(&[*entry]).is_err(),
                "a releasing table's {entry:?} is live"
            );
        }
        for entry in self.retired.iter().flatten() {
            assert!(
                self.pool.verify(&[*entry]).is_err(),
                "a retired table's {entry:?} verifies"
            );
        }
    }

    /// Drops everything the test holds and drains the pool: every page must come back.
    fn finish(mut self) {
        self.reservations.clear();
        self.allocations.clear();
        self.releasing.clear();
        self.quarantines.clear();
        self.pool.release_quarantine();
        self.pool.scrub_pending(|_| {});
        assert_eq!(self.pool.free_pages(), self.total, "pages always come back");
        if let Err(violation) = self.pool.check_invariants() {
            panic!("{violation}");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_lifecycles_keep_every_page_with_at_most_one_owner((config, ops) in case()) {
        let mut model = Model::new(config);
        model.check();
        for op in ops {
            model.apply(op);
            model.check();
        }
        model.finish();
    }
}
