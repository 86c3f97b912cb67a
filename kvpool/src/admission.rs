//! Admission: the proof that a request fits the whole pool, and the "not now" answer.
//!
//! [`PagePool::admit`](crate::PagePool::admit) is the only way to make an [`Admissible`], and
//! [`PagePool::reserve`](crate::PagePool::reserve) accepts nothing else: a request that does
//! not fit the pool is a [`Rejected`](crate::Rejected) value and can never reach allocation.

use std::fmt;

use crate::ids::RequestId;

/// Identity of one pool, so that an [`Admissible`] from one pool is never reserved in another.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct PoolIdentity(pub(crate) u64);

/// A request that fits the whole pool; not yet holding anything.
///
/// Only [`PagePool::admit`](crate::PagePool::admit) makes one, and it is not `Clone`: one
/// admission reserves at most once.
pub struct Admissible {
    /// The pool that admitted it; only that pool reserves it.
    pub(crate) pool: PoolIdentity,
    /// The request the pages will belong to.
    pub(crate) owner: RequestId,
    /// Tokens asked for; `tokens <= capacity_tokens` of the admitting pool (except from
    /// `admit_unchecked`, in test builds only).
    pub(crate) tokens: u64,
    /// `ceil(tokens / page_tokens)`; at most the admitting pool's page count, except from
    /// `admit_unchecked` (then `reserve` never succeeds).
    pub(crate) pages: u32,
}

impl Admissible {
    /// The request the pages will belong to.
    #[must_use]
    pub const fn owner(&self) -> RequestId {
        self.owner
    }

    /// Tokens the request was admitted for.
    #[must_use]
    pub const fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Pages a reservation for it will hold.
    #[must_use]
    pub const fn pages(&self) -> u32 {
        self.pages
    }
}

impl fmt::Debug for Admissible {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Admissible")
            .field("owner", &self.owner)
            .field("tokens", &self.tokens)
            .field("pages", &self.pages)
            .finish_non_exhaustive()
    }
}

/// The pool has too few free pages right now; the admission is handed back untouched so the
/// caller can wait (bounded) and retry, or answer 429/503.
#[derive(Debug)]
pub struct NotNow(pub Admissible);

impl NotNow {
    /// The admission, to retry later.
    #[must_use]
    pub fn into_inner(self) -> Admissible {
        self.0
    }

    /// The admission, by reference.
    #[must_use]
    pub const fn admissible(&self) -> &Admissible {
        &self.0
    }
}

impl fmt::Display for NotNow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} needs {} free KV pages and the pool has fewer right now; retry later",
            self.0.owner, self.0.pages
        )
    }
}

impl std::error::Error for NotNow {}

#[cfg(test)]
mod tests {
    use crate::config::Scrub;
    use crate::ids::RequestId;
    use crate::test_support::{pool, reserve};

    #[test]
    fn a_refused_reservation_says_who_waits_for_how_many_pages() {
        let pool = pool(4, Scrub::None);
        let _held = reserve(&pool, 1, 48);
        let admissible = pool.admit(RequestId::new(2), 40).expect("fits the pool");
        assert_eq!(
            format!("{admissible:?}"),
            "Admissible { owner: RequestId(2), tokens: 40, pages: 3, .. }"
        );
        let not_now = pool.reserve(admissible).expect_err("one page is free");
        assert_eq!(
            not_now.to_string(),
            "request 2 needs 3 free KV pages and the pool has fewer right now; retry later"
        );
    }
}
