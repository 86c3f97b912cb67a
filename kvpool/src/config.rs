//! The pool's configuration.

use std::num::NonZeroU32;

/// Tokens per page when nothing else is said.
pub const DEFAULT_PAGE_TOKENS: NonZeroU32 = NonZeroU32::new(16).expect("16 is not zero");

/// What happens to a page's bytes when it is released, before it can be allocated again.
///
/// The logical pool only sequences it: with anything but [`Scrub::None`] a released page waits
/// in the scrub queue until the physical layer has scrubbed it (see
/// [`PagePool::scrub_pending`](crate::PagePool::scrub_pending)).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Scrub {
    /// Released pages go straight back to the free list; their bytes stay as they were.
    None,
    /// Released pages are zero-filled before reuse.
    Zero,
    /// Released pages are filled with a recognisable canary pattern before reuse, so that a
    /// stale read shows up as canary bytes instead of another request's data.
    Canary,
}

impl Scrub {
    /// Whether released pages must pass through the scrub queue.
    #[must_use]
    pub const fn is_deferred(self) -> bool {
        !matches!(self, Self::None)
    }
}

/// Shape and policy of one page pool.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct PoolConfig {
    /// Number of physical pages; fixed for the pool's life. Page ids run `0..pages`.
    pub pages: NonZeroU32,
    /// Token slots per page (the KV of this many tokens fits one page).
    pub page_tokens: NonZeroU32,
    /// What happens to a page's bytes on release.
    pub scrub: Scrub,
}

impl PoolConfig {
    /// A pool of `pages` pages of [`DEFAULT_PAGE_TOKENS`] tokens each.
    #[must_use]
    pub const fn new(pages: NonZeroU32, scrub: Scrub) -> Self {
        Self {
            pages,
            page_tokens: DEFAULT_PAGE_TOKENS,
            scrub,
        }
    }

    /// Tokens the whole pool can hold: `pages * page_tokens` (cannot overflow: both are `u32`).
    #[must_use]
    pub const fn capacity_tokens(&self) -> u64 {
        self.pages.get() as u64 * self.page_tokens.get() as u64
    }

    /// Pages needed for `tokens` tokens: `ceil(tokens / page_tokens)`.
    #[must_use]
    pub const fn pages_for(&self, tokens: u64) -> u64 {
        tokens.div_ceil(self.page_tokens.get() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(pages: u32, page_tokens: u32) -> PoolConfig {
        PoolConfig {
            pages: NonZeroU32::new(pages).expect("test pages are not zero"),
            page_tokens: NonZeroU32::new(page_tokens).expect("test page size is not zero"),
            scrub: Scrub::None,
        }
    }

    #[test]
    fn capacity_is_pages_times_page_tokens_without_overflow() {
        assert_eq!(config(10, 16).capacity_tokens(), 160);
        assert_eq!(
            config(u32::MAX, u32::MAX).capacity_tokens(),
            u64::from(u32::MAX) * u64::from(u32::MAX)
        );
    }

    #[test]
    fn pages_for_rounds_up_to_whole_pages() {
        let c = config(10, 16);
        assert_eq!(c.pages_for(0), 0);
        assert_eq!(c.pages_for(1), 1);
        assert_eq!(c.pages_for(16), 1);
        assert_eq!(c.pages_for(17), 2);
        assert_eq!(c.pages_for(u64::MAX), u64::MAX.div_ceil(16));
    }

    #[test]
    fn default_page_size_is_sixteen_tokens() {
        let c = PoolConfig::new(NonZeroU32::MIN, Scrub::Zero);
        assert_eq!(c.page_tokens.get(), 16);
    }
}
