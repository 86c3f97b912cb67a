//! What is checked: the protocol variant and the bound.

/// Which protocol the model runs: the real one, or one with a seeded bug.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Variant {
    /// The protocol Bulkhead implements. Must satisfy every property.
    Correct,
    /// The incident: prefill "rejects" a prompt that does not fit its pool by replacing it with a
    /// one-page placeholder, decode commits on any manifest (it checks only "finished", not
    /// coverage), and release does not zero pages.
    Incident,
    /// Decode writes a frame's bytes into the physical page the frame names without checking
    /// the nonce, the reservation or the tag (a one-sided write with no guard). Per-session
    /// accounting still goes by nonce, so commits still check coverage.
    NoTagCheck,
    /// A client abort hands the pages back to the allocator at once (zeroed), while the
    /// transfer engine keeps the session open until the prefill's drain ack; nothing gates the
    /// pages' reuse on the transfer being closed.
    EagerRelease,
    /// Decode's prefix cache looks a prompt up without its tenant: a request may attend over a
    /// prefix page another tenant's request computed (I6 broken at the cache).
    UnscopedCache,
    /// A request reading a cached prefix page does not pin it: the cache may evict the page,
    /// and the pool hand it to another request, while the reader still attends over it.
    UnpinnedPrefix,
}

impl Variant {
    /// Every variant, for tests that loop.
    pub const ALL: [Self; 6] = [
        Self::Correct,
        Self::Incident,
        Self::NoTagCheck,
        Self::EagerRelease,
        Self::UnscopedCache,
        Self::UnpinnedPrefix,
    ];

    /// Prefill rejects by placeholder (one page) instead of an explicit `Reject`.
    pub(crate) fn rejects_by_placeholder(self) -> bool {
        self == Self::Incident
    }

    /// Decode checks coverage, tags, count and digest before committing.
    pub(crate) fn verifies_manifest(self) -> bool {
        self != Self::Incident
    }

    /// Pages are zeroed when they go back to the free list.
    pub(crate) fn zeroes_on_release(self) -> bool {
        self != Self::Incident
    }

    /// Decode checks nonce, reservation and tag before writing a frame's bytes.
    pub(crate) fn checks_frames(self) -> bool {
        self != Self::NoTagCheck
    }

    /// A client abort frees pages at once instead of moving them to `Releasing`.
    pub(crate) fn releases_eagerly(self) -> bool {
        self == Self::EagerRelease
    }

    /// The prefix cache finds only pages of the request's own tenant.
    pub(crate) fn scopes_cache_lookup(self) -> bool {
        self != Self::UnscopedCache
    }

    /// A request pins the cached prefix pages it reads until its session closes.
    pub(crate) fn pins_cached_prefix(self) -> bool {
        self != Self::UnpinnedPrefix
    }
}

/// The model's parameters, which are also its bound.
///
/// Invariant: every field is small; the state space grows roughly exponentially in
/// `decode_pages`, the number of requests and the budgets.
#[derive(Clone, Debug)]
pub struct Config {
    /// The protocol variant.
    pub variant: Variant,
    /// Pages in the decode worker's pool.
    pub decode_pages: u8,
    /// Pages in the prefill worker's pool (a prompt longer than this does not fit prefill).
    pub prefill_pages: u8,
    /// Prompt length in pages of each request.
    pub requests: Vec<u8>,
    /// The tenant of each request (as long as `requests`). Every prompt starts with the same page (a shared system prompt), so only the tenant tells
    /// whose cached copy of it a request may read.
    pub tenants: Vec<u8>,
    /// Whether decode keeps a per-tenant prefix cache: a finished request's first page (of a
    /// prompt longer than one page) stays cached for its tenant; a later request of that
    /// tenant reads it, pinned, instead of reserving and receiving it.
    pub prefix_cache: bool,
    /// Attempts per request: `1` means no retry after an abort or failure.
    pub max_attempts: u8,
    /// How many messages the network may duplicate in a whole run.
    pub duplicates: u8,
    /// How many frames the network may corrupt in a whole run.
    pub corruptions: u8,
    /// Whether the transport between decode and prefill may be torn down (once).
    pub teardown: bool,
}

impl Config {
    /// The main bound: decode pool 3 pages, prefill pool 2 pages; R1 needs 2 pages (fits
    /// both), R2 needs 3 (fits decode, not prefill: the incident's shape, and it can only be
    /// reserved once R1's pages are back, so it reuses them), R3 needs 4 (fits neither:
    /// rejected by decode admission). One duplicate, one corruption, one teardown, no retry.
    #[must_use]
    pub fn incident_shape(variant: Variant) -> Self {
        Self {
            variant,
            decode_pages: 3,
            prefill_pages: 2,
            requests: vec![2, 3, 4],
            tenants: vec![0, 1, 2],
            prefix_cache: false,
            max_attempts: 1,
            duplicates: 1,
            corruptions: 1,
            teardown: true,
        }
    }

    /// The reuse bound: decode pool 3 pages, prefill pool 3 pages; R1 and R2 both need 2 pages
    /// and both fit prefill, so both can commit, and whichever comes second can only be
    /// reserved on a page the first held. One duplicate, one corruption, one teardown, no
    /// retry.
    #[must_use]
    pub fn reuse_shape(variant: Variant) -> Self {
        Self {
            variant,
            decode_pages: 3,
            prefill_pages: 3,
            requests: vec![2, 2],
            tenants: vec![0, 1],
            prefix_cache: false,
            max_attempts: 1,
            duplicates: 1,
            corruptions: 1,
            teardown: true,
        }
    }

    /// The retry bound: as [`Config::reuse_shape`], but each request may be attempted twice
    /// (a retry after an abort or a failure gets a fresh nonce and fresh tags, possibly on the
    /// same pages as the attempt it replaces). No duplicate, corruption or teardown, to keep
    /// the state space small.
    #[must_use]
    pub fn retry_shape(variant: Variant) -> Self {
        Self {
            variant,
            decode_pages: 3,
            prefill_pages: 3,
            requests: vec![2, 2],
            tenants: vec![0, 1],
            prefix_cache: false,
            max_attempts: 2,
            duplicates: 0,
            corruptions: 0,
            teardown: false,
        }
    }

    /// The prefix-cache bound: decode pool 3 pages, prefill pool 3 pages, decode's prefix
    /// cache on; R1 and R3 are tenant 0's, R2 tenant 1's, each prompt 2 pages sharing its first.
    /// Once one request of a tenant finishes, its first page stays cached; the tenant's other
    /// request reads it and reserves one page; the other tenant's may not. Eviction happens
    /// whenever a cached page is unpinned, so a page that was cached is reused. No duplicate
    /// (it adds nothing the other shapes do not check, and doubles the space), one corruption,
    /// one teardown, no retry.
    #[must_use]
    pub fn prefix_shape(variant: Variant) -> Self {
        Self {
            variant,
            decode_pages: 3,
            prefill_pages: 3,
            requests: vec![2, 2, 2],
            tenants: vec![0, 1, 0],
            prefix_cache: true,
            max_attempts: 1,
            duplicates: 0,
            corruptions: 1,
            teardown: true,
        }
    }
}
