//! Helpers shared by the unit tests of this crate.

use std::num::NonZeroU32;

use crate::config::{PoolConfig, Scrub};
use crate::ids::RequestId;
use crate::lifecycle::Reservation;
use crate::pool::PagePool;

/// A pool of `pages` pages of the default size.
pub fn pool(pages: u32, scrub: Scrub) -> PagePool {
    PagePool::new(PoolConfig::new(
        NonZeroU32::new(pages).expect("test pools have pages"),
        scrub,
    ))
}

/// Admits and reserves `tokens` for `owner`, expecting both to succeed.
pub fn reserve(pool: &PagePool, owner: u64, tokens: u64) -> Reservation {
    let admissible = pool
        .admit(RequestId::new(owner), tokens)
        .expect("fits the pool");
    pool.reserve(admissible).expect("pages are free")
}
