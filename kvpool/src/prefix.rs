//! The prefix cache's index: full pages of prompt KV kept after their request ended, so that a
//! later request of the same [`Scope`] (a tenant) whose prompt starts with the same tokens
//! reads them instead of computing them again.
//!
//! A cached page is keyed by its scope, the cached page before it (its parent, by page and
//! tag) and the exact tokens it holds. A lookup walks a prompt page by page from the scope's
//! root and stops at the first page that is not cached. Keys compare whole token lists, never
//! hashes, so two prompts share a page only when every token up to its end is equal; and the
//! scope is part of every key, so no lookup ever reaches another scope's pages (I6).
//!
//! Each entry counts the requests reading it (`readers`, held by
//! [`Prefix`](crate::Prefix) handles) and its cached children. Only a page nobody reads and
//! nothing continues — a leaf — can be evicted, least recently used first, so a chain is
//! always whole from its root.
//!
//! A page whose KV failed an integrity check when a request read it is *distrusted*, with
//! every cached page after it (their KV was computed attending to it): lookups stop before
//! them, nothing is cached after them, and each leaves the index once nobody reads it and
//! nothing continues it. Kept findable, the page would fail every request of its scope that
//! starts with the same tokens, for as long as they keep it recently used.

use std::cmp::Reverse;
use std::collections::hash_map::Entry as Slot;
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::fmt;
use std::sync::Arc;

use crate::error::InvariantViolation;
use crate::ids::{PageId, PageRef};

/// Whose cached prefixes a request may read, and whose it adds to: one tenant, or the part of
/// a tenant's cache its requests with one `cache_salt` share. Requests of different scopes
/// never share a cached page.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Scope {
    tenant: Arc<str>,
    /// `None`: the tenant's unsalted scope, which no salted request reads either.
    salt: Option<Arc<str>>,
}

impl Scope {
    /// The scope named `name` (a tenant id).
    #[must_use]
    pub fn new(name: &str) -> Self {
        Self {
            tenant: Arc::from(name),
            salt: None,
        }
    }

    /// Tenant `name`'s requests that carry `salt`; an empty salt is [`Scope::new`]'s scope.
    #[must_use]
    pub fn salted(name: &str, salt: &str) -> Self {
        Self {
            tenant: Arc::from(name),
            salt: (!salt.is_empty()).then(|| Arc::from(salt)),
        }
    }

    /// The scope's tenant.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.tenant
    }
}

impl fmt::Debug for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.salt {
            None => write!(f, "Scope({:?})", &*self.tenant),
            // The salt is the client's secret: never in a log line.
            Some(_) => write!(f, "Scope({:?}, salted)", &*self.tenant),
        }
    }
}

/// What identifies a cached page's contents: the scope, the page before it, and its tokens.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
struct Key {
    scope: Scope,
    parent: Option<PageRef>,
    tokens: Box<[u32]>,
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    page: PageRef,
    /// [`Prefix`](crate::Prefix) handles reading the page.
    readers: u32,
    /// Cached pages whose parent is this page.
    children: u32,
    /// When the page was last cached or found (the index's clock), for LRU eviction.
    used: u64,
    /// Its KV (or that of a page before it) failed an integrity check: never found again.
    distrusted: bool,
}

/// The index of cached pages. Lives in the pool's state, which keeps each page it names in
/// the `Cached` state.
#[derive(Debug, Default)]
pub(crate) struct PrefixIndex {
    entries: HashMap<Key, Entry>,
    /// The key of each cached page.
    keys: HashMap<PageId, Key>,
    clock: u64,
    /// The pages of the entries distrusted and not yet swept out: a sweep looks at these, not
    /// at every entry (it runs as each prefix's last reader leaves).
    distrusted: HashSet<PageId>,
}

/// What [`PrefixIndex::insert`] did with a page.
pub(crate) enum Inserted {
    /// The page is cached now.
    Cached,
    /// The same tokens after the same parent were already cached, in this page: the offered
    /// page is not needed.
    Present(PageRef),
}

impl PrefixIndex {
    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// The cached pages that hold `chunks` in order after the scope's root, as far as they
    /// are cached; each found page gains a reader.
    pub(crate) fn find<'a>(
        &mut self,
        scope: &Scope,
        chunks: impl Iterator<Item = &'a [u32]>,
    ) -> Vec<PageRef> {
        let mut found = Vec::new();
        let mut parent = None;
        for tokens in chunks {
            let key = Key {
                scope: scope.clone(),
                parent,
                tokens: tokens.into(),
            };
            let now = self.tick();
            let Some(entry) = self.entries.get_mut(&key).filter(|e| !e.distrusted) else {
                break;
            };
            entry.readers += 1;
            entry.used = now;
            found.push(entry.page);
            parent = Some(entry.page);
        }
        found
    }

    /// Takes one reader off each of `pages` (those still cached with their tags).
    pub(crate) fn unread(&mut self, pages: &[PageRef]) {
        for page in pages {
            if let Some(entry) = self.entry_mut(*page) {
                debug_assert!(entry.readers > 0, "{page:?} read by nobody");
                entry.readers = entry.readers.saturating_sub(1);
            }
        }
    }

    fn entry_mut(&mut self, page: PageRef) -> Option<&mut Entry> {
        let key = self.keys.get(&page.page)?;
        self.entries.get_mut(key).filter(|e| e.page == page)
    }

    /// The entry of `page`, if it is cached with its tag.
    fn entry(&self, page: PageRef) -> Option<&Entry> {
        let key = self.keys.get(&page.page)?;
        self.entries.get(key).filter(|e| e.page == page)
    }

    /// Whether `page` is cached with its tag.
    pub(crate) fn holds(&self, page: PageRef) -> bool {
        self.entry(page).is_some()
    }

    /// Whether `page` is cached with its tag and trusted.
    fn trusts(&self, page: PageRef) -> bool {
        self.entry(page).is_some_and(|e| !e.distrusted)
    }

    /// Caches `page` as holding `tokens` after `parent` (a trusted cached page of the same
    /// scope, or the root). A parent that is not cached any more is refused: nothing could
    /// ever find the page; so is a distrusted one: the page was computed attending to suspect
    /// KV.
    pub(crate) fn insert(
        &mut self,
        scope: &Scope,
        parent: Option<PageRef>,
        tokens: &[u32],
        page: PageRef,
    ) -> Option<Inserted> {
        if let Some(p) = parent {
            let parent_scope = self.keys.get(&p.page).map(|k| &k.scope);
            if !self.trusts(p) || parent_scope != Some(scope) {
                return None;
            }
        }
        let key = Key {
            scope: scope.clone(),
            parent,
            tokens: tokens.into(),
        };
        let used = self.tick();
        match self.entries.entry(key) {
            Slot::Occupied(o) => return Some(Inserted::Present(o.get().page)),
            Slot::Vacant(v) => {
                self.keys.insert(page.page, v.key().clone());
                v.insert(Entry {
                    page,
                    readers: 0,
                    children: 0,
                    used,
                    distrusted: false,
                });
            }
        }
        if let Some(p) = parent.and_then(|p| self.entry_mut(p)) {
            p.children += 1;
        }
        Some(Inserted::Cached)
    }

    /// Takes up to `n` pages out of the index, least recently used leaves first (a parent
    /// whose last child goes becomes a leaf), never one that is read. Returns them.
    pub(crate) fn evict(&mut self, n: u32) -> Vec<PageRef> {
        let victims = self.victims(n);
        victims.into_iter().filter_map(|p| self.remove(p)).collect()
    }

    /// Takes `page` out of the index (its parent loses a child). Returns it with its tag.
    fn remove(&mut self, page: PageId) -> Option<PageRef> {
        let key = self.keys.remove(&page)?;
        let entry = self.entries.remove(&key)?;
        if entry.distrusted {
            self.distrusted.remove(&page);
        }
        if let Some(parent) = key.parent.and_then(|p| self.entry_mut(p)) {
            parent.children = parent.children.saturating_sub(1);
        }
        Some(entry.page)
    }

    /// Distrusts `page` (if it is cached with its tag) and every cached page after it. Returns
    /// how many pages were distrusted that were not already.
    pub(crate) fn distrust(&mut self, page: PageRef) -> u32 {
        if !self.holds(page) {
            return 0;
        }
        let mut children: HashMap<PageId, Vec<PageId>> = HashMap::new();
        for (key, entry) in &self.entries {
            if let Some(parent) = key.parent {
                children
                    .entry(parent.page)
                    .or_default()
                    .push(entry.page.page);
            }
        }
        let mut newly = 0;
        let mut todo = vec![page.page];
        while let Some(p) = todo.pop() {
            let entry = self.keys.get(&p).and_then(|k| self.entries.get_mut(k));
            if let Some(entry) = entry.filter(|e| !e.distrusted) {
                entry.distrusted = true;
                self.distrusted.insert(p);
                newly += 1;
            }
            todo.extend(children.remove(&p).unwrap_or_default());
        }
        newly
    }

    /// Takes the distrusted pages that nobody reads and nothing continues out of the index,
    /// leaves first. Returns them.
    pub(crate) fn sweep(&mut self) -> Vec<PageRef> {
        let ready = |index: &Self, p: &PageId| {
            (index.keys.get(p))
                .and_then(|key| index.entries.get(key))
                .is_some_and(|e| e.distrusted && e.readers == 0 && e.children == 0)
        };
        let mut todo: Vec<PageId> = (self.distrusted.iter())
            .filter(|p| ready(self, p))
            .copied()
            .collect();
        let mut swept = Vec::new();
        while let Some(p) = todo.pop() {
            let parent = self.keys.get(&p).and_then(|key| key.parent);
            swept.extend(self.remove(p));
            // Its parent may have lost its last child: a leaf now.
            if let Some(parent) = parent.filter(|parent| ready(self, &parent.page)) {
                todo.push(parent.page);
            }
        }
        swept
    }

    /// The pages [`PrefixIndex::evict`] would take for `n`, in its order: unread leaves, least
    /// recently used first, a parent once its last child is taken.
    pub(crate) fn victims(&self, n: u32) -> Vec<PageId> {
        let mut leaves: BinaryHeap<Reverse<(u64, PageId)>> = self
            .entries
            .values()
            .filter(|e| e.readers == 0 && e.children == 0)
            .map(|e| Reverse((e.used, e.page.page)))
            .collect();
        // Children left to each parent once its taken children are counted out.
        let mut children: HashMap<PageId, u32> = HashMap::new();
        let mut victims = Vec::new();
        while victims.len() < n as usize {
            let Some(Reverse((_, page))) = leaves.pop() else {
                break;
            };
            victims.push(page);
            let parent = (self.keys.get(&page))
                .and_then(|key| key.parent)
                .and_then(|p| Some((p, self.entries.get(self.keys.get(&p.page)?)?)))
                .filter(|(p, e)| e.page == *p);
            if let Some((p, e)) = parent {
                let left = children.entry(p.page).or_insert(e.children);
                *left = left.saturating_sub(1);
                if *left == 0 && e.readers == 0 {
                    leaves.push(Reverse((e.used, p.page)));
                }
            }
        }
        victims
    }

    /// Pages cached.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Checks the index against itself and the pool: `keys` and `entries` name the same
    /// pages, the pool has each entry's page `cached` with the entry's tag, every parent is
    /// cached in the same scope, every page after a distrusted one is distrusted, and every
    /// children and distrusted count equals a recount.
    pub(crate) fn check(&self, cached: impl Fn(PageRef) -> bool) -> Result<(), InvariantViolation> {
        let bad = |page: PageId, problem: &'static str| {
            Err(InvariantViolation::PrefixIndex { page, problem })
        };
        if self.keys.len() != self.entries.len() {
            let page = self.keys.keys().next().copied().unwrap_or(PageId::new(0));
            return bad(
                page,
                "indexed by page and by key a different number of times",
            );
        }
        let mut children: HashMap<PageId, u32> = HashMap::new();
        for (key, entry) in &self.entries {
            let page = entry.page.page;
            if self.keys.get(&page) != Some(key) {
                return bad(page, "not indexed by its page");
            }
            if !cached(entry.page) {
                return bad(page, "indexed but not cached with its tag in the pool");
            }
            if let Some(parent) = key.parent {
                let parent_key = self.keys.get(&parent.page);
                if !self.holds(parent) || parent_key.map(|k| &k.scope) != Some(&key.scope) {
                    return bad(page, "its parent is not cached in its scope");
                }
                if !entry.distrusted && !self.trusts(parent) {
                    return bad(page, "trusted after a distrusted parent");
                }
                *children.entry(parent.page).or_default() += 1;
            }
        }
        let distrusted: HashSet<PageId> = (self.entries.values())
            .filter(|e| e.distrusted)
            .map(|e| e.page.page)
            .collect();
        if distrusted != self.distrusted {
            let page = self.keys.keys().next().copied().unwrap_or(PageId::new(0));
            return bad(page, "distrusted pages miscounted");
        }
        for entry in self.entries.values() {
            let counted = children.get(&entry.page.page).copied().unwrap_or(0);
            if entry.children != counted {
                return bad(entry.page.page, "children miscounted");
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Scrub;
    use crate::ids::RequestId;
    use crate::lifecycle::{Allocation, Prefix};
    use crate::pool::PagePool;
    use crate::prefix::Scope;
    use crate::test_support::pool;

    /// Tokens `0..n` after `first` (pages of the default 16 tokens).
    fn prompt(first: u32, n: u32) -> Vec<u32> {
        (first..first + n).collect()
    }

    /// Runs `prompt` (with room for `new` tokens) in `scope` as a request would: reads its
    /// cached prefix, reserves the rest, commits.
    fn run(
        pool: &PagePool,
        owner: u64,
        scope: &Scope,
        prompt: &[u32],
        new: u64,
    ) -> (Prefix, Allocation) {
        let tokens = prompt.len() as u64 + new;
        let admissible = pool.admit(RequestId::new(owner), tokens).expect("fits");
        let prefix = pool.cached_prefix(scope, prompt, (prompt.len() - 1) / 16);
        let reservation = pool.reserve_after(admissible, &prefix).expect("pages free");
        (prefix, reservation.commit())
    }

    #[test]
    fn a_kept_prompt_is_found_by_its_scope_and_never_by_another() {
        let pool = pool(8, Scrub::None);
        let (a, b) = (Scope::new("tenant-a"), Scope::new("tenant-b"));
        let p = prompt(100, 40);
        let (prefix, allocation) = run(&pool, 1, &a, &p, 8);
        assert!(prefix.pages().is_empty(), "nothing cached yet");
        let kept: Vec<_> = allocation.pages()[..2].to_vec();
        assert_eq!(
            allocation.keep_prompt(prefix, &p),
            2,
            "two whole pages of 40 tokens"
        );
        let stats = pool.stats();
        assert_eq!((stats.cached, stats.free, stats.owned), (2, 6, 0));

        let found = pool.cached_prefix(&a, &p, 10);
        assert_eq!(found.pages(), kept.as_slice());
        assert_eq!(found.tokens(), 32);
        assert_eq!(pool.verify(found.pages()), Ok(()), "cached pages are live");
        let other = pool.cached_prefix(&b, &p, 10);
        assert!(other.pages().is_empty(), "another scope finds nothing");
        assert_eq!(
            pool.cached_prefix(&a, &p, 1).pages(),
            &kept[..1],
            "at most max_pages"
        );
        pool.check_invariants().expect("invariants hold");
    }

    /// A `cache_salt` splits a tenant's cache: only requests with the same salt share pages,
    /// an unsalted request reads no salted page (nor a salted one an unsalted page), and an
    /// empty salt is no salt.
    #[test]
    fn only_requests_of_one_tenant_with_the_same_salt_share_cached_pages() {
        let pool = pool(8, Scrub::None);
        let p = prompt(100, 40);
        let salted = Scope::salted("tenant-a", "s1");
        let (prefix, allocation) = run(&pool, 1, &salted, &p, 8);
        allocation.keep_prompt(prefix, &p);
        let found = |scope: &Scope| pool.cached_prefix(scope, &p, 10).tokens();
        assert_eq!(found(&Scope::salted("tenant-a", "s1")), 32, "the same salt");
        assert_eq!(found(&Scope::salted("tenant-a", "s2")), 0, "another salt");
        assert_eq!(found(&Scope::new("tenant-a")), 0, "no salt");
        assert_eq!(found(&Scope::salted("tenant-b", "s1")), 0, "another tenant");
        assert_eq!(Scope::salted("tenant-a", ""), Scope::new("tenant-a"));
        assert!(
            !format!("{salted:?}").contains("s1"),
            "the salt is not logged"
        );
    }

    #[test]
    fn a_prompt_that_differs_in_one_token_shares_only_the_pages_before_it() {
        let pool = pool(8, Scrub::None);
        let a = Scope::new("a");
        let p = prompt(0, 48);
        let (prefix, allocation) = run(&pool, 1, &a, &p, 1);
        allocation.keep_prompt(prefix, &p);
        let mut q = p.clone();
        q[20] = 999; // in the second page
        assert_eq!(pool.cached_prefix(&a, &q, 10).pages().len(), 1);
        q[3] = 999;
        assert!(pool.cached_prefix(&a, &q, 10).pages().is_empty());
    }

    #[test]
    fn a_request_after_a_prefix_reserves_only_the_rest_and_extends_the_chain() {
        let pool = pool(8, Scrub::None);
        let a = Scope::new("a");
        let p = prompt(0, 40);
        let (prefix, allocation) = run(&pool, 1, &a, &p, 1);
        allocation.keep_prompt(prefix, &p);

        // The same 32 tokens, then 30 more: two pages found, 62 + 10 tokens need 5 pages.
        let mut longer = p[..32].to_vec();
        longer.extend(500..530);
        let (prefix, allocation) = run(&pool, 2, &a, &longer, 10);
        assert_eq!(prefix.pages().len(), 2);
        assert_eq!(
            allocation.pages().len(),
            3,
            "5 pages in all, 2 of them cached"
        );
        assert_eq!(allocation.tokens(), 72 - 32);
        let own = allocation.pages()[0];
        assert_eq!(
            allocation.keep_prompt(prefix, &longer),
            1,
            "one more whole page"
        );
        assert_eq!(
            pool.cached_prefix(&a, &longer, 10).pages().last(),
            Some(&own)
        );
        assert_eq!(pool.stats().cached, 3);
        pool.check_invariants().expect("invariants hold");
    }

    /// An allocation keeps its prompt only after the very prefix it was reserved after:
    /// another scope's would cache a tenant's pages for another (I6), another pool's (whose
    /// pages and tags can be the same numbers) or a shorter one of the same scope would chain
    /// them at positions they were not computed for. Each is refused, and the pages released.
    #[test]
    fn a_prompt_is_kept_only_after_the_prefix_its_pages_were_reserved_after() {
        let (a, b) = (Scope::new("tenant-a"), Scope::new("tenant-b"));
        let p = prompt(0, 40);
        // Another scope.
        let pool_w = pool(8, Scrub::None);
        let (_, allocation) = run(&pool_w, 1, &a, &p, 8);
        let foreign = pool_w.cached_prefix(&b, &p, 2);
        assert_eq!(allocation.keep_prompt(foreign, &p), 0);
        assert_eq!(pool_w.stats().cached, 0);
        assert!(pool_w.cached_prefix(&b, &p, 2).pages().is_empty());
        // Another pool: both cache the same root page under the same scope, same numbers.
        let (pool_x, pool_y) = (pool(8, Scrub::None), pool(8, Scrub::None));
        for pool in [&pool_x, &pool_y] {
            let (prefix, allocation) = run(pool, 2, &a, &p[..17], 1);
            assert_eq!(allocation.keep_prompt(prefix, &p[..17]), 1);
        }
        let from_x = pool_x.cached_prefix(&a, &p, 2);
        let (prefix_y, allocation_y) = run(&pool_y, 3, &a, &p, 8);
        assert_eq!(from_x.pages(), prefix_y.pages(), "the same page and tag");
        assert_eq!(allocation_y.keep_prompt(from_x, &p), 0);
        drop(prefix_y);
        // A shorter prefix of the same scope and pool.
        let (_, allocation) = run(&pool_y, 4, &a, &p, 8);
        let shorter = pool_y.cached_prefix(&a, &p, 0);
        assert_eq!(allocation.keep_prompt(shorter, &p), 0);
        assert_eq!(pool_y.stats().cached, 1, "only the root cached at first");
        for pool in [&pool_w, &pool_x, &pool_y] {
            assert_eq!(pool.stats().owned, 0, "every page released");
            pool.check_invariants().expect("invariants hold");
        }
    }

    #[test]
    fn two_requests_that_computed_the_same_pages_cache_them_once() {
        let pool = pool(8, Scrub::None);
        let a = Scope::new("a");
        let p = prompt(0, 33);
        let first = run(&pool, 1, &a, &p, 1);
        let second = run(&pool, 2, &a, &p, 1);
        let kept = first.1.pages()[..2].to_vec();
        assert_eq!(first.1.keep_prompt(first.0, &p), 2);
        assert_eq!(second.1.keep_prompt(second.0, &p), 0, "already cached");
        let stats = pool.stats();
        assert_eq!((stats.cached, stats.free), (2, 6));
        assert_eq!(pool.cached_prefix(&a, &p, 10).pages(), kept.as_slice());
        pool.check_invariants().expect("invariants hold");
    }

    #[test]
    fn eviction_takes_unread_leaves_least_recently_used_first_and_never_a_read_page() {
        let pool = pool(8, Scrub::Zero);
        let a = Scope::new("a");
        let (old, new) = (prompt(0, 33), prompt(1000, 33));
        for (owner, p) in [(1, &old), (2, &new)] {
            let (prefix, allocation) = run(&pool, owner, &a, p, 1);
            allocation.keep_prompt(prefix, p);
        }
        pool.scrub_pending(|_| {});
        let reading = pool.cached_prefix(&a, &new, 10);
        assert_eq!(reading.pages().len(), 2);
        // `old` is least recently used and unread: its leaf goes first, then its root.
        assert_eq!(pool.evict(1), 1);
        assert_eq!(pool.cached_prefix(&a, &old, 10).pages().len(), 1);
        assert_eq!(pool.evict(8), 1, "the read chain stays");
        assert_eq!(pool.verify(reading.pages()), Ok(()));
        assert_eq!(
            pool.stats().pending_scrub,
            2,
            "evicted pages are scrubbed first"
        );
        let table = reading.pages().to_vec();
        drop(reading);
        assert_eq!(pool.evict(8), 2);
        pool.scrub_pending(|_| {});
        assert_eq!(pool.free_pages(), 8, "every page comes back");
        assert!(pool.verify(&table).is_err(), "an evicted page is not live");
        pool.check_invariants().expect("invariants hold");
    }

    /// Room is made only when enough can be: a request that eviction would still leave short
    /// takes nothing from the cache (it emptied other tenants' caches while it waited).
    #[test]
    fn making_room_evicts_all_it_needs_or_nothing() {
        let pool = pool(8, Scrub::Zero);
        let (a, b) = (Scope::new("a"), Scope::new("b"));
        let (old, new) = (prompt(0, 33), prompt(1000, 33));
        for (owner, scope, p) in [(1, &b, &old), (2, &a, &new)] {
            let (prefix, allocation) = run(&pool, owner, scope, p, 1);
            allocation.keep_prompt(prefix, p);
        }
        pool.scrub_pending(|_| {});
        let reading = pool.cached_prefix(&a, &new, 10);
        assert_eq!(pool.stats().cached, 4);
        // Only b's two pages are unread: three cannot be made.
        assert_eq!(pool.make_room(3), 0);
        assert_eq!(pool.stats().cached, 4, "nothing evicted");
        assert_eq!(pool.cached_prefix(&b, &old, 10).pages().len(), 2);
        assert_eq!(pool.make_room(2), 2, "leaf, then its parent");
        assert_eq!(pool.stats().cached, 2);
        assert_eq!(pool.verify(reading.pages()), Ok(()));
        pool.check_invariants().expect("invariants hold");
    }

    /// A page distrusted by a reader that failed on it is found by no later lookup, nor is any
    /// page after it; nothing is cached after it; it and the pages after it leave the cache as
    /// their last readers let them go, while the pages before it stay. Without it, every
    /// request of the scope with that prompt read the page again (and failed again).
    #[test]
    fn a_distrusted_page_and_those_after_it_leave_the_cache_once_unread() {
        let pool = pool(8, Scrub::Zero);
        let a = Scope::new("a");
        let p = prompt(0, 49);
        let (prefix, allocation) = run(&pool, 1, &a, &p, 1);
        assert_eq!(allocation.keep_prompt(prefix, &p), 3);
        // A second chain forks after the first page.
        let mut fork = p[..16].to_vec();
        fork.extend(500..517);
        let (prefix, allocation) = run(&pool, 2, &a, &fork, 1);
        assert_eq!(allocation.keep_prompt(prefix, &fork), 1);
        pool.scrub_pending(|_| {});
        assert_eq!(pool.stats().cached, 4);

        let failed = pool.cached_prefix(&a, &p, 10);
        let other_reader = pool.cached_prefix(&a, &p, 10);
        assert_eq!(failed.pages().len(), 3);
        let table = failed.pages().to_vec();
        assert_eq!(failed.distrust_from(1), 2, "the page and the one after it");
        assert_eq!(
            pool.cached_prefix(&a, &p, 10).pages(),
            &table[..1],
            "a lookup stops before the distrusted page"
        );
        assert_eq!(
            pool.cached_prefix(&a, &fork, 10).pages().len(),
            2,
            "the fork is kept"
        );
        assert_eq!(pool.stats().cached, 4, "still read");
        pool.check_invariants().expect("invariants hold");

        // A request that computed the same tokens again caches nothing at or after them.
        let (prefix, allocation) = run(&pool, 3, &a, &p, 1);
        assert_eq!(prefix.pages(), &table[..1]);
        assert_eq!(allocation.keep_prompt(prefix, &p), 0);

        drop(other_reader);
        let s = pool.stats();
        // The two distrusted pages, and the three request 3 computed.
        assert_eq!((s.cached, s.pending_scrub), (2, 5), "gone once unread");
        assert!(pool.verify(&table[1..]).is_err());
        pool.check_invariants().expect("invariants hold");
        // Now the same tokens can be cached again.
        pool.scrub_pending(|_| {});
        let (prefix, allocation) = run(&pool, 4, &a, &p, 1);
        assert_eq!(allocation.keep_prompt(prefix, &p), 2);
        assert_eq!(pool.cached_prefix(&a, &p, 10).pages().len(), 3);
        pool.check_invariants().expect("invariants hold");
    }

    /// A failure past the cached pages (in the request's own) distrusts none of them.
    #[test]
    fn a_failure_in_the_requests_own_pages_distrusts_no_cached_one() {
        let pool = pool(8, Scrub::None);
        let a = Scope::new("a");
        let p = prompt(0, 40);
        let (prefix, allocation) = run(&pool, 1, &a, &p, 1);
        allocation.keep_prompt(prefix, &p);
        let reading = pool.cached_prefix(&a, &p, 10);
        assert_eq!(reading.distrust_from(2), 0);
        assert_eq!(pool.cached_prefix(&a, &p, 10).pages().len(), 2);
        assert_eq!(pool.stats().cached, 2);
    }

    #[test]
    fn an_evicted_page_gets_a_new_tag_so_no_table_of_the_cache_reads_it_again() {
        let pool = pool(2, Scrub::None);
        let a = Scope::new("a");
        let p = prompt(0, 17);
        let (prefix, allocation) = run(&pool, 1, &a, &p, 1);
        allocation.keep_prompt(prefix, &p);
        let cached = pool.cached_prefix(&a, &p, 10).pages().to_vec();
        assert_eq!(pool.evict(1), 1);
        let (_, again) = run(&pool, 2, &Scope::new("b"), &prompt(7, 20), 1);
        assert!(again.pages().iter().any(|e| e.page == cached[0].page));
        assert!(pool.verify(&cached).is_err());
    }

    #[test]
    fn a_prefix_found_in_another_pool_is_never_reserved_after() {
        let (here, there) = (pool(4, Scrub::None), pool(4, Scrub::None));
        let a = Scope::new("a");
        let p = prompt(0, 33);
        let (prefix, allocation) = run(&there, 1, &a, &p, 1);
        allocation.keep_prompt(prefix, &p);
        let foreign = there.cached_prefix(&a, &p, 10);
        assert_eq!(foreign.pages().len(), 2);
        let admissible = here.admit(RequestId::new(2), 40).expect("fits");
        let refused = here
            .reserve_after(admissible, &foreign)
            .expect_err("another pool's pages");
        assert_eq!(refused.admissible().owner(), RequestId::new(2));
        assert_eq!(here.free_pages(), 4, "nothing reserved");
    }
}
