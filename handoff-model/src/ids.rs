//! Newtype ids of the model. All are `u8`: the model is small by construction, and small states
//! hash fast.

use std::fmt;

/// Index of a physical page of the decode worker's pool (`0..Config::decode_pages`).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct PageIdx(pub u8);

/// Generation tag of a page. Drawn from a pool-wide counter that only grows, so a page's tags
/// strictly increase over its life and no two allocations share one (as in `bulkhead-kvpool`).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct Tag(pub u8);

/// Nonce of one transfer session (one reservation of one attempt of one request). Fresh per
/// session: never reused within a run of the model. The bytes a session's prefill writes are
/// identified by this nonce.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct Nonce(pub u8);

/// Index of a client request in [`Config::requests`](crate::Config::requests). Each request
/// comes from a different tenant.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct ReqIdx(pub u8);

impl ReqIdx {
    /// The index, for indexing per-request vectors.
    #[must_use]
    pub const fn index(self) -> usize {
        self.0 as usize
    }
}

impl PageIdx {
    /// The index, for indexing per-page vectors.
    #[must_use]
    pub const fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for PageIdx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "p{}", self.0)
    }
}

impl fmt::Display for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "t{}", self.0)
    }
}

impl fmt::Display for Nonce {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "s{}", self.0)
    }
}

impl fmt::Display for ReqIdx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "R{}", self.0 + 1)
    }
}
