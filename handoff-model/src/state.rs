//! The model's state: decode's pool and transfer table, prefill's table, the network.

use crate::ids::{Nonce, PageIdx, ReqIdx, Tag};
use crate::net::{Network, Slot};

/// What a page's bytes are.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Contents {
    /// Zeroed.
    Zero,
    /// The bytes some session's prefill wrote.
    Bytes(Nonce),
}

/// Who holds a page, as decode's allocator records it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Holder {
    /// On the free list.
    Free,
    /// Set aside after a drain timeout or an integrity failure of this session; back to the
    /// free list (zeroed) only by a `Reclaim` once nothing of the session can arrive.
    Quarantined(Nonce),
    /// Held by one session's lifecycle object.
    Held(Nonce, Hold),
    /// In decode's prefix cache, as this tenant's copy of the shared first prompt page, read
    /// by `pins` open sessions; evictable (back to the free list, zeroed) only at 0 pins.
    Cached {
        /// Whose prompt it holds.
        tenant: u8,
        /// Open sessions reading it.
        pins: u8,
    },
}

/// The lifecycle object holding a page (as in `bulkhead-kvpool`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Hold {
    /// `Reservation`: the transfer is writing it.
    Reserved,
    /// `Allocation`: committed; the request attends over it.
    Running,
    /// `Releasing`: the request ended but a transfer may still land.
    Releasing,
}

/// One decode page.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct Page {
    /// Who holds it.
    pub holder: Holder,
    /// Its current tag; `None` until its first allocation.
    pub tag: Option<Tag>,
    /// What its bytes are.
    pub contents: Contents,
    /// How many times it has been allocated (ghost, for the "page reuse happens" check;
    /// saturates at 2).
    pub allocations: u8,
}

/// A client request, from decode's side.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct Request {
    /// Where it is.
    pub status: ReqStatus,
    /// Attempts started so far (each reservation is one attempt, with its own nonce).
    pub attempts: u8,
}

/// Where a request is, from decode's side.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum ReqStatus {
    /// Not admitted yet (or about to be retried).
    Waiting,
    /// Admitted; its transfer session has this nonce.
    InFlight(Nonce),
    /// Committed; attends over the pages of this session.
    Running(Nonce),
    /// Ended.
    Done(Outcome),
}

/// How a request (or one attempt of it) ended.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Outcome {
    /// Committed, generated, finished.
    Finished,
    /// Decode admission: more pages than the whole decode pool (400).
    RejectedByDecode,
    /// Prefill admission: more pages than the prefill pool (400).
    RejectedByPrefill,
    /// The transfer failed verification (500 `kv_integrity_error`).
    IntegrityFailure,
    /// The client went away.
    Aborted,
    /// The prefill peer is gone (503).
    PeerLost,
}

impl Outcome {
    /// Whether the client may retry this attempt.
    #[must_use]
    pub fn retryable(self) -> bool {
        matches!(
            self,
            Self::IntegrityFailure | Self::Aborted | Self::PeerLost
        )
    }
}

/// Phase of a decode transfer session.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Phase {
    /// Accepting frames.
    Transfer,
    /// Aborted; waiting for the drain ack (frames are dropped).
    Draining,
    /// Committed (frames are dropped).
    Running,
}

/// One entry of decode's transfer table.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct Session {
    /// The session's nonce (the table's key).
    pub nonce: Nonce,
    /// The request it serves.
    pub req: ReqIdx,
    /// The cached page the request reads as its prompt's first page, if the prefix cache had
    /// it; the reservation (`table`) then holds only the rest of the prompt.
    pub prefix: Option<PageIdx>,
    /// The reservation's pages and tags, in prompt order.
    pub table: Vec<Slot>,
    /// Frames accepted per table entry (saturates at 2: "more than once").
    pub written: Vec<u8>,
    /// Where the session is.
    pub phase: Phase,
}

/// What prefill knows about one session.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub enum PfSession {
    /// Computing and sending: `sent` of `table` so far.
    Sending {
        /// The pages to write (for a placeholder: only the first).
        table: Vec<Slot>,
        /// Frames sent so far.
        sent: u8,
    },
    /// Manifest sent; nothing more to send.
    Complete,
    /// Rejected at prefill admission.
    Rejected,
    /// Aborted and acknowledged (also a tombstone for an `Abort` that overtook its `Prefill`).
    Drained,
}

/// The whole model state.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct State {
    /// Decode's pool.
    pub pages: Vec<Page>,
    /// The next tag the pool hands out.
    pub next_tag: Tag,
    /// The next nonce decode hands out.
    pub next_nonce: Nonce,
    /// Every request's status, indexed by [`ReqIdx`].
    pub requests: Vec<Request>,
    /// Decode's transfer table, sorted by nonce.
    pub sessions: Vec<Session>,
    /// Prefill's table, sorted by nonce.
    pub prefill: Vec<(Nonce, PfSession)>,
    /// Whether the transport is still up (teardown is permanent).
    pub transport_up: bool,
    /// Messages in flight.
    pub net: Network,
    /// Duplications the network may still do.
    pub duplicates_left: u8,
    /// Corruptions the network may still do.
    pub corruptions_left: u8,
    /// Ghost: the first write of a session's bytes into a page that was not held by that
    /// session at that moment (I4).
    pub late_write: Option<(Nonce, PageIdx)>,
    /// Ghost: some quarantine was reclaimed (saturates at 1).
    pub reclaimed: bool,
    /// Ghost, kept only with the prefix cache on: the tenant of each session, by nonce, so the
    /// properties can tell whose bytes a cached page holds.
    pub tenant_of: Vec<u8>,
    /// Ghost: a request committed over a cached prefix page (saturates at 1).
    pub prefix_read: bool,
    /// Ghost: a cached page was evicted (saturates at 1).
    pub evicted: bool,
}

impl State {
    /// Decode's session with this nonce.
    #[must_use]
    pub fn session(&self, nonce: Nonce) -> Option<&Session> {
        self.sessions.iter().find(|s| s.nonce == nonce)
    }

    pub(crate) fn session_mut(&mut self, nonce: Nonce) -> Option<&mut Session> {
        self.sessions.iter_mut().find(|s| s.nonce == nonce)
    }

    /// The tenant whose session wrote `nonce`'s bytes (recorded only with the prefix cache on).
    #[must_use]
    pub fn tenant_of(&self, nonce: Nonce) -> Option<u8> {
        self.tenant_of.get(usize::from(nonce.0)).copied()
    }

    pub(crate) fn remove_session(&mut self, nonce: Nonce) -> Option<Session> {
        let at = self.sessions.iter().position(|s| s.nonce == nonce)?;
        Some(self.sessions.remove(at))
    }

    /// Prefill's record of this nonce.
    #[must_use]
    pub fn prefill_session(&self, nonce: Nonce) -> Option<&PfSession> {
        self.prefill
            .iter()
            .find_map(|(n, s)| (*n == nonce).then_some(s))
    }

    pub(crate) fn set_prefill_session(&mut self, nonce: Nonce, session: PfSession) {
        match self.prefill.iter_mut().find(|(n, _)| *n == nonce) {
            Some(entry) => entry.1 = session,
            None => {
                self.prefill.push((nonce, session));
                self.prefill.sort_by_key(|(n, _)| *n);
            }
        }
    }

    /// Pages on the free list.
    pub fn free_pages(&self) -> impl Iterator<Item = PageIdx> + '_ {
        self.pages
            .iter()
            .enumerate()
            .filter(|(_, p)| p.holder == Holder::Free)
            .filter_map(|(i, _)| u8::try_from(i).ok().map(PageIdx))
    }
}
