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
}

impl Variant {
    /// Every variant, for tests that loop.
    pub const ALL: [Self; 4] = [
        Self::Correct,
        Self::Incident,
        Self::NoTagCheck,
        Self::EagerRelease,
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
    /// Prompt length in pages of each request; request `i` is from tenant `i`.
    pub requests: Vec<u8>,
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
            max_attempts: 2,
            duplicates: 0,
            corruptions: 0,
            teardown: false,
        }
    }
}
