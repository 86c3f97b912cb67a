//! Newtype ids: pages, generation tags, owners, and page-table entries.
//!
//! None of these types has a sentinel value: "no page" is `Option<PageId>`, "no tag" is
//! `Option<Tag>`.

use std::fmt;

/// Index of one physical page of the KV pool.
///
/// Invariant: none by itself — a `PageId` is just a number. Whether it names a page of a given
/// pool (`index() < pages`) is checked by the pool on every use, never assumed.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct PageId(u32);

impl PageId {
    /// The page with index `index` (for example parsed from a transfer frame).
    #[must_use]
    pub const fn new(index: u32) -> Self {
        Self(index)
    }

    /// The page's index, for indexing per-page arrays (tags, physical slabs).
    #[must_use]
    pub const fn index(self) -> usize {
        // Lossless: `usize` is at least 32 bits on every target this crate supports (the
        // `const` assertion below refuses to build elsewhere).
        self.0 as usize
    }

    /// The raw index, for the wire.
    #[must_use]
    pub const fn get(self) -> u32 {
        self.0
    }
}

// `PageId::index` widens `u32` to `usize`; refuse to build where that would truncate.
const _: () = assert!(usize::BITS >= u32::BITS);

impl fmt::Display for PageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "page {}", self.0)
    }
}

/// Generation tag of a page.
///
/// Invariant (kept by the pool, not by this type): every allocation of a page gives it a tag
/// drawn from a per-pool counter that only grows, so a page's tags strictly increase over its
/// life and no two allocations in one pool ever share a tag. A page table entry whose tag no
/// longer equals the page's current tag is stale.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct Tag(u64);

impl Tag {
    /// A tag with this raw value (for example parsed from a transfer frame). Making a `Tag`
    /// grants nothing: it is only ever compared with the pool's current tag.
    #[must_use]
    pub const fn new(raw: u64) -> Self {
        Self(raw)
    }

    /// The raw value, for the wire and for logs.
    #[must_use]
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tag {}", self.0)
    }
}

/// The request that owns pages.
///
/// Invariant: none by itself; the pool records it per held page so that invariant checks and
/// logs can name the owner.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct RequestId(u64);

impl RequestId {
    /// The request with this raw id.
    #[must_use]
    pub const fn new(raw: u64) -> Self {
        Self(raw)
    }

    /// The raw id.
    #[must_use]
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "request {}", self.0)
    }
}

/// One entry of a page table: a page and the tag it must still carry when it is read or
/// written.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct PageRef {
    /// The physical page.
    pub page: PageId,
    /// The tag the page got when it was allocated to this table's owner; if the page's current
    /// tag differs, the page has been reallocated and this entry is stale.
    pub tag: Tag,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_their_raw_values() {
        let id = PageId::new(u32::MAX);
        assert_eq!(id.get(), u32::MAX);
        assert_eq!(id.index(), u32::MAX as usize);
        assert_eq!(Tag::new(u64::MAX).get(), u64::MAX);
        assert_eq!(RequestId::new(u64::MAX).get(), u64::MAX);
    }

    #[test]
    fn ids_display_for_humans() {
        assert_eq!(RequestId::new(7).to_string(), "request 7");
        assert_eq!(PageId::new(3).to_string(), "page 3");
        assert_eq!(Tag::new(9).to_string(), "tag 9");
    }
}
