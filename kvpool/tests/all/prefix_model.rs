//! Random request sequences over the prefix cache against an independent record of what
//! every cached page holds.
//!
//! Prompts are drawn from two tokens, so prompts often share leading pages, and from three
//! scopes: two tenants, and the first tenant's requests under a cache salt. The record maps each (scope, tokens up to a page's end) that the test saw cached to
//! its page. After every operation:
//!
//! - `check_invariants` holds;
//! - a lookup finds exactly the longest run of recorded pages of its own scope that match
//!   the prompt page by page — never a page of another scope (I6), never a page holding other
//!   tokens — and those pages verify;
//! - a page that a running request reads is never evicted; making room evicts either as many
//!   unread pages as it was asked for, or none;
//! - a distrusted page (a reader failed on it) and every page after it are found by no
//!   lookup and continued by no kept prompt, and each leaves the cache once no running
//!   request reads it;
//! - once everything is dropped and the cache emptied, every page is free again.

use std::collections::HashMap;
use std::num::NonZeroU32;

use bulkhead_kvpool::{Allocation, PagePool, PageRef, PoolConfig, Prefix, RequestId, Scope, Scrub};
use proptest::prelude::*;

use crate::take;

const PAGE_TOKENS: u32 = 2;

#[derive(Clone, Debug)]
enum Op {
    Start {
        scope: usize,
        prompt: Vec<u32>,
        new: u64,
    },
    Finish(usize),
    Fail(usize),
    /// Request `.0` fails a KV integrity check at page `.1` of its table.
    Distrust(usize, usize),
    Abandon(usize),
    Evict(u32),
    MakeRoom(u32),
    Scrub,
}

fn op() -> impl Strategy<Value = Op> {
    let i = any::<usize>;
    prop_oneof![
        4 => (0..3usize, prop::collection::vec(0..2u32, 1..=8), 1..=3u64)
            .prop_map(|(scope, prompt, new)| Op::Start { scope, prompt, new }),
        3 => i().prop_map(Op::Finish),
        1 => i().prop_map(Op::Fail),
        2 => (i(), 0..4usize).prop_map(|(r, at)| Op::Distrust(r, at)),
        1 => i().prop_map(Op::Abandon),
        1 => (0..4u32).prop_map(Op::Evict),
        1 => (0..6u32).prop_map(Op::MakeRoom),
        1 => Just(Op::Scrub),
    ]
}

struct Running {
    scope: usize,
    prompt: Vec<u32>,
    prefix: Prefix,
    pages: Allocation,
}

struct Model {
    pool: PagePool,
    scopes: [Scope; 3],
    next_owner: u64,
    /// (scope, tokens from the prompt's start through the page's end) → the cached page.
    cached: HashMap<(usize, Vec<u32>), PageRef>,
    /// The same, for pages distrusted and still in the cache.
    distrusted: HashMap<(usize, Vec<u32>), PageRef>,
    running: Vec<Running>,
}

impl Model {
    fn new(pages: u32, scrub: Scrub) -> Model {
        Model {
            pool: PagePool::new(PoolConfig {
                pages: NonZeroU32::new(pages).expect("pages"),
                page_tokens: NonZeroU32::new(PAGE_TOKENS).expect("tokens"),
                scrub,
            }),
            scopes: [
                Scope::new("tenant-a"),
                Scope::new("tenant-b"),
                Scope::salted("tenant-a", "salt"),
            ],
            next_owner: 0,
            cached: HashMap::new(),
            distrusted: HashMap::new(),
            running: Vec::new(),
        }
    }

    /// The pages the record says hold `prompt`'s whole pages in `scope`, in a row from the
    /// first, at most `max`.
    fn expected(&self, scope: usize, prompt: &[u32], max: usize) -> Vec<PageRef> {
        let pt = PAGE_TOKENS as usize;
        (1..=max)
            .map_while(|k| {
                self.cached
                    .get(&(scope, prompt[..k * pt].to_vec()))
                    .copied()
            })
            .collect()
    }

    fn apply(&mut self, op: Op) {
        let pt = PAGE_TOKENS as usize;
        match op {
            Op::Start { scope, prompt, new } => {
                self.next_owner += 1;
                let owner = RequestId::new(self.next_owner);
                let tokens = prompt.len() as u64 + new;
                let Ok(admissible) = self.pool.admit(owner, tokens) else {
                    return;
                };
                let max = (prompt.len() - 1) / pt;
                let prefix = self.pool.cached_prefix(&self.scopes[scope], &prompt, max);
                assert_eq!(
                    prefix.pages(),
                    self.expected(scope, &prompt, max).as_slice(),
                    "the lookup finds exactly its scope's matching pages"
                );
                assert_eq!(self.pool.verify(prefix.pages()), Ok(()));
                if let Ok(reservation) = self.pool.reserve_after(admissible, &prefix) {
                    let needed = tokens.div_ceil(PAGE_TOKENS.into()) as usize;
                    assert_eq!(reservation.pages().len() + prefix.pages().len(), needed);
                    self.running.push(Running {
                        scope,
                        prompt,
                        prefix,
                        pages: reservation.commit(),
                    });
                }
            }
            Op::Finish(i) => {
                let Some(r) = take(&mut self.running, i) else {
                    return;
                };
                let skip = r.prefix.pages().len();
                let own = r.pages.pages().to_vec();
                // What the record says is kept, apart from what the pool says: each whole
                // prompt page of its own whose tokens are not cached already, as long as the
                // chain goes on: not after a distrusted page, nor through one.
                let key = |end: usize| (r.scope, r.prompt[..end].to_vec());
                let after_distrusted = skip > 0 && self.distrusted.contains_key(&key(skip * pt));
                let expected = (0..own.len())
                    .map(|j| (skip + j + 1) * pt)
                    .take_while(|&end| !after_distrusted && end <= r.prompt.len())
                    .take_while(|&end| !self.distrusted.contains_key(&key(end)))
                    .filter(|&end| !self.cached.contains_key(&key(end)))
                    .count();
                let kept = r.pages.keep_prompt(r.prefix, &r.prompt);
                assert_eq!(kept as usize, expected, "whole new prompt pages are kept");
                let mut counted = 0;
                for (j, page) in own.iter().enumerate() {
                    let end = (skip + j + 1) * pt;
                    if self.pool.verify(&[*page]).is_err() {
                        continue;
                    }
                    assert!(
                        end <= r.prompt.len(),
                        "{page:?} cached but not a whole prompt page"
                    );
                    let key = (r.scope, r.prompt[..end].to_vec());
                    assert!(self.cached.insert(key, *page).is_none(), "cached twice");
                    counted += 1;
                }
                assert_eq!(kept, counted);
            }
            Op::Fail(i) => {
                if let Some(r) = take(&mut self.running, i) {
                    let _ = r.pages.quarantine();
                    self.pool.release_quarantine();
                }
            }
            Op::Distrust(i, at) => {
                // One of the requests that read a cached page.
                let reading: Vec<usize> = (0..self.running.len())
                    .filter(|&j| !self.running[j].prefix.pages().is_empty())
                    .collect();
                let Some(&j) = reading.get(i % reading.len().max(1)) else {
                    return;
                };
                let r = self.running.swap_remove(j);
                let at = at % (r.prefix.pages().len() + 1);
                let start = r
                    .prompt
                    .get(..(at + 1) * pt)
                    .filter(|_| at < r.prefix.pages().len());
                // The page at `at` and every cached page after it, in the record.
                let after: Vec<_> = (self.cached.keys())
                    .filter(|(scope, tokens)| {
                        start.is_some_and(|s| *scope == r.scope && tokens.starts_with(s))
                    })
                    .cloned()
                    .collect();
                let distrusted = r.prefix.distrust_from(at);
                assert_eq!(
                    distrusted as usize,
                    after.len(),
                    "the page and those after it"
                );
                for key in after {
                    let page = self.cached.remove(&key).expect("recorded");
                    self.distrusted.insert(key, page);
                }
                let _ = r.pages.quarantine();
                self.pool.release_quarantine();
            }
            Op::Abandon(i) => drop(take(&mut self.running, i)),
            Op::Evict(n) => {
                self.evicted(|pool| pool.evict(n));
            }
            Op::MakeRoom(n) => {
                let before = self.pool.stats();
                let free = before.free + before.pending_scrub;
                let evicted = self.evicted(|pool| pool.make_room(n));
                assert!(
                    evicted == 0 || evicted == n,
                    "made room for {evicted} of {n}"
                );
                if evicted == n {
                    let stats = self.pool.stats();
                    assert_eq!(stats.free + stats.pending_scrub, free + n);
                }
            }
            Op::Scrub => self.pool.scrub_pending(|_| {}),
        }
    }

    /// Runs `evict` on the pool, which returns how many cached pages it evicted: as many leave
    /// the record, and no page a running request reads is among them.
    fn evicted(&mut self, evict: impl FnOnce(&PagePool) -> u32) -> u32 {
        let before = self.cached.len() + self.distrusted.len();
        let evicted = evict(&self.pool);
        let pool = &self.pool;
        self.cached.retain(|_, page| pool.verify(&[*page]).is_ok());
        self.distrusted
            .retain(|_, page| pool.verify(&[*page]).is_ok());
        assert_eq!(
            before - self.cached.len() - self.distrusted.len(),
            evicted as usize
        );
        for r in &self.running {
            assert_eq!(
                self.pool.verify(r.prefix.pages()),
                Ok(()),
                "a read page was evicted"
            );
        }
        evicted
    }

    fn check(&mut self) {
        if let Err(violation) = self.pool.check_invariants() {
            panic!("{violation}");
        }
        let pool = &self.pool;
        self.distrusted
            .retain(|_, page| pool.verify(&[*page]).is_ok());
        for ((scope, tokens), page) in &self.distrusted {
            assert!(
                self.running.iter().any(|r| r.prefix.pages().contains(page)),
                "{page:?} distrusted, read by nobody, still cached"
            );
            let found = pool.cached_prefix(&self.scopes[*scope], tokens, usize::MAX);
            assert!(!found.pages().contains(page), "{page:?} distrusted, found");
        }
        assert_eq!(
            self.pool.stats().cached as usize,
            self.cached.len() + self.distrusted.len()
        );
    }

    fn finish(mut self) {
        self.running.clear();
        self.pool.evict(u32::MAX);
        self.pool.scrub_pending(|_| {});
        let stats = self.pool.stats();
        assert_eq!(stats.free, stats.total, "pages always come back");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn a_lookup_finds_only_its_scopes_pages_holding_exactly_its_tokens(
        pages in 4u32..=16,
        scrub in prop_oneof![Just(Scrub::None), Just(Scrub::Zero)],
        ops in prop::collection::vec(op(), 1..80),
    ) {
        let mut model = Model::new(pages, scrub);
        for op in ops {
            model.apply(op);
            model.check();
        }
        model.finish();
    }
}
