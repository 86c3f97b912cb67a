//! The pool's error types: admission rejection, stale page tables, broken invariants.

use crate::ids::{PageId, Tag};

/// A request the pool will never be able to hold, decided before anything is allocated.
#[derive(Clone, Copy, PartialEq, Eq, Debug, thiserror::Error)]
pub enum Rejected {
    /// The request needs more KV-cache tokens than the whole pool holds, even when empty.
    #[error(
        "the request needs {requested_tokens} tokens of KV cache but this worker's whole pool \
         holds {capacity_tokens}; shorten the prompt or lower max_tokens to at most \
         {capacity_tokens} tokens in total"
    )]
    ContextLengthExceeded {
        /// Tokens the request asked for (prompt plus room to generate).
        requested_tokens: u64,
        /// Tokens the whole pool holds ([`PoolConfig::capacity_tokens`](crate::PoolConfig::capacity_tokens)).
        capacity_tokens: u64,
    },
}

/// What the pool holds at a page a page table expected to be live with a given tag.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Found {
    /// The page id is outside this pool.
    NoSuchPage,
    /// The page is not held by a live reservation or allocation (it is free, waiting for a
    /// scrub, quarantined, or being released); `current` is its last tag.
    NotLive {
        /// The page's current tag.
        current: Tag,
    },
    /// The page is live but carries another tag: it was reallocated since the table was made.
    OtherTag(Tag),
}

/// A page table entry that no longer matches the pool: reading or writing through it would
/// touch memory the table's owner does not own.
#[derive(Clone, Copy, PartialEq, Eq, Debug, thiserror::Error)]
#[error("stale KV page table: {page} was expected live with {expected}, found {found:?}")]
pub struct TagMismatch {
    /// The first page of the table that failed.
    pub page: PageId,
    /// The tag the table expected.
    pub expected: Tag,
    /// What the pool has there instead.
    pub found: Found,
}

/// A broken internal invariant, found by [`PoolState::check_invariants`](crate::PoolState::check_invariants).
///
/// Seeing one is always a bug in this crate; it exists so that tests (and a paranoid operator
/// endpoint) can ask without the pool panicking.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
pub enum InvariantViolation {
    /// The per-page arrays do not have one entry per configured page.
    #[error("per-page arrays have {states} states and {tags} tags for {pages} pages")]
    PageArrays {
        /// Configured pages.
        pages: usize,
        /// Length of the per-page state array.
        states: usize,
        /// Length of the per-page tag array.
        tags: usize,
    },
    /// A queue (free list or scrub queue) names a page that is not in that queue's state, or
    /// is out of range.
    #[error("{page} is in the {queue} queue but its state is {state}")]
    QueuedInWrongState {
        /// The page.
        page: PageId,
        /// `"free"` or `"scrub"`.
        queue: &'static str,
        /// The page's recorded state.
        state: &'static str,
    },
    /// A queue names the same page twice.
    #[error("{page} appears twice in the {queue} queue")]
    QueuedTwice {
        /// The page.
        page: PageId,
        /// `"free"` or `"scrub"`.
        queue: &'static str,
    },
    /// A page's state says it is queued but the queue does not hold it.
    #[error("{page} is {state} but missing from its queue")]
    MissingFromQueue {
        /// The page.
        page: PageId,
        /// The page's recorded state.
        state: &'static str,
    },
    /// A maintained counter disagrees with a recount of the per-page states.
    #[error("{counter} count is {recorded} but {counted} pages are in that state")]
    Count {
        /// Which counter.
        counter: &'static str,
        /// The maintained value.
        recorded: u32,
        /// The recount.
        counted: u32,
    },
    /// Two pages carry the same tag, so a tag would not identify one allocation.
    #[error("{first} and {second} both carry {tag}")]
    TagShared {
        /// One page.
        first: PageId,
        /// The other page.
        second: PageId,
        /// The shared tag.
        tag: Tag,
    },
    /// The prefix cache's index disagrees with itself or with the pages' states.
    #[error("prefix cache: {page} {problem}")]
    PrefixIndex {
        /// The page.
        page: PageId,
        /// What is wrong.
        problem: &'static str,
    },
    /// A page carries a tag the counter has not handed out yet (a later allocation could
    /// reuse it).
    #[error("{page} carries {tag} but the next tag to hand out is {next}")]
    TagAhead {
        /// The page.
        page: PageId,
        /// Its tag.
        tag: Tag,
        /// The counter's next value.
        next: u64,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rejection_message_names_both_numbers_and_what_to_do() {
        let msg = Rejected::ContextLengthExceeded {
            requested_tokens: 1_048_576,
            capacity_tokens: 681_280,
        }
        .to_string();
        assert!(msg.contains("1048576"), "{msg}");
        assert!(msg.contains("681280"), "{msg}");
        assert!(msg.contains("shorten the prompt"), "{msg}");
    }
}
