//! The paged KV pool's pure logic: page ids, generation tags, admission, allocator, lifecycle.
//!
//! No async, no I/O, no physical memory: the physical layer owns the bytes and asks this crate
//! which pages it may touch. What this crate guarantees:
//!
//! - **Admission before allocation.** [`PagePool::admit`] rejects a request that cannot fit the
//!   whole pool ([`Rejected`]) before anything is allocated; [`PagePool::reserve`] accepts only
//!   the [`Admissible`] that `admit` returns, and hands it back in [`NotNow`] when the pages are
//!   not free yet.
//! - **I1 ownership.** Every page is free, waiting for a scrub, quarantined, or held by exactly
//!   one lifecycle object ([`Reservation`], [`Allocation`], [`Releasing`]) of one owner. The
//!   lifecycle types are not `Clone`, transitions consume `self`, and `Drop` gives the pages
//!   back (or quarantines them when a peer may still write). See [`lifecycle`] for the state
//!   diagram, [`PagePool::check_invariants`] for the check.
//! - **Stale-read guard.** Every reservation gives each of its pages a fresh [`Tag`], greater
//!   than every tag the pool handed out before. A page table ([`PageRef`]s) made for an
//!   earlier holder of a page fails [`PagePool::verify`] and the kernel's check through
//!   [`PagePool::with_tags`].
//! - **Prefix cache, per scope.** An allocation's whole prompt pages may be kept after its
//!   request ([`Allocation::keep_prompt`]) in its [`Scope`]'s cache; a later request of the
//!   same scope whose prompt starts with the same tokens reads them ([`PagePool::cached_prefix`],
//!   [`Prefix`]) and reserves only the rest ([`PagePool::reserve_after`]). A cached page keeps
//!   its tag, is read-only, is never found from another scope, and is evicted
//!   ([`PagePool::evict`]) only while nobody reads it. I1 with the cache: every page is free,
//!   waiting for a scrub, quarantined, cached once, or held by exactly one lifecycle object.
//! - **No premature reuse.** Freed pages join the back of a FIFO free list; with
//!   [`Scrub::Zero`] or [`Scrub::Canary`] they are not allocatable until the physical layer has
//!   scrubbed them ([`PagePool::scrub_pending`]).
#![warn(missing_docs)]

mod admission;
mod config;
mod error;
mod ids;
pub mod lifecycle;
mod pool;
mod prefix;
mod state;

pub use admission::{Admissible, NotNow};
pub use config::{DEFAULT_PAGE_TOKENS, PoolConfig, Scrub};
pub use error::{Found, InvariantViolation, Rejected, TagMismatch};
pub use ids::{PageId, PageRef, RequestId, Tag};
pub use lifecycle::{Allocation, Prefix, Quarantined, Releasing, Reservation};
pub use pool::PagePool;
pub use prefix::Scope;
pub use state::{PoolState, PoolStats};

#[cfg(test)]
mod test_support;
