//! The engine's two sides of a KV handoff.
//!
//! Decode: a request's pages are reserved, named to a prefill worker, and filled by frames
//! that [`Inbound`] admits one by one; only a verified transfer commits the pages to the
//! request. A transfer the request no longer wants (client gone, timeout, prefill failure)
//! keeps its pages out of circulation until no frame of it can still land:
//!
//! ```text
//!  Reservation ──manifest verified──▶ Allocation (the request decodes)
//!      │ └──────manifest fails─────▶ quarantine
//!      ├──Closed (aborted/failed)──▶ free (nothing more can arrive)
//!      └──cancel / timeout─────────▶ Releasing ──Closed──▶ free
//!                                        └──release timeout──▶ quarantine
//!
//!  quarantine (a transfer's) ──transport closed or Closed──▶ + reclaim_after ──▶ (scrub) ──▶ free
//! ```
//!
//! A quarantined transfer's pages come back only once nothing of its session can arrive any
//! more: a live peer that is merely slow keeps them out of circulation for as long as its
//! connection stays open. A session no frame of which ever arrived has no connection whose end
//! would say so (its prefill worker stopped or died while computing, or the client left before
//! the reservation was named to it): its quarantine is reclaimed after the grace period
//! straight away. That is safe because this worker writes every frame itself, and only those
//! of sessions still in transfer; a transport whose peer writes remotely would need the
//! peer's own word instead.
//!
//! Prefill: the request's own pages are computed as usual; after the prompt, the engine reads
//! the KV out page by page into frames addressed to decode's reservation and hands them over
//! as an [`Outbound`], which keeps the source pages until it is closed.

use std::ops::Range;
use std::time::Instant;

use bulkhead_handoff::{
    CheckedFrame, DropReason, Frame, Inbound, Manifest, Reservation as Target, SessionNonce,
};
use bulkhead_kvpool::{
    Allocation, PageId, PagePool, PageRef, Prefix, Quarantined, Releasing, Reservation, Tag,
};

use super::request::Request;
use super::written::Written;
use crate::kv::{KvMemory, SlotError};

/// A decode-side transfer in progress.
#[derive(Debug)]
pub(super) struct Transfer {
    pub request: Request,
    pub pages: Reservation,
    /// The cached pages of the tenant's prefix cache the prompt starts with, which the
    /// transfer does not fill; read-only, they head the request's page table.
    pub prefix: Option<Prefix>,
    pub inbound: Inbound,
    pub deadline: Instant,
    /// The most prompt tokens the prefill worker said it computed since it started (its
    /// progress, for any request).
    pub prefill_computed: u64,
    /// Whether a frame of the session reached this worker's data plane: until one does, no
    /// data connection carries the session, so none closes to say its peer is gone.
    pub heard: bool,
}

/// Pages of an abandoned transfer, waiting for the prefill side's `Closed`.
#[derive(Debug)]
pub(super) struct Draining {
    pub pages: Releasing,
    /// When the transfer was abandoned (for the abort-acknowledgement latency).
    pub since: Instant,
    pub deadline: Instant,
    /// [`Transfer::heard`] when it was abandoned.
    pub heard: bool,
}

/// Pages of a quarantined transfer (no drain acknowledgement in time, or a failed
/// verification), waiting until nothing of the session can arrive any more: its transport
/// closed (or its `Closed` came late), and then a grace period passed.
#[derive(Debug)]
pub(super) struct Suspect {
    pub pages: Quarantined,
    /// `Some` once the peer is known gone: when the pages come back.
    pub reclaim_at: Option<Instant>,
}

impl Suspect {
    pub fn new(pages: Quarantined) -> Suspect {
        Suspect {
            pages,
            reclaim_at: None,
        }
    }

    /// The session's transport is gone; the first such news sets the time.
    pub fn peer_gone(&mut self, at: Instant) {
        self.reclaim_at.get_or_insert(at);
    }
}

/// The pool's tag of `page` if the page is held by a live reservation or allocation.
pub(super) fn live_tag(pool: &PagePool, page: PageId) -> Option<Tag> {
    let tag = pool.current_tag(page)?;
    pool.verify(&[PageRef { page, tag }]).ok().map(|()| tag)
}

/// The slots of a page that hold `tokens` (absolute positions within one page).
fn slots(tokens: &Range<u32>, page_tokens: u32) -> Range<usize> {
    (tokens.start % page_tokens) as usize..((tokens.end - 1) % page_tokens + 1) as usize
}

/// Why an arrived frame was not written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotWritten {
    #[error(transparent)]
    Dropped(#[from] DropReason),
    /// `Inbound` checked the range and length, so this is a bug.
    #[error("an accepted frame does not fit its page: {0}")]
    Slots(#[from] SlotError),
}

/// Decode's one way to take a frame: `inbound` admits it (session, index, reserved tag, the
/// page still live with that tag per `current_tag`, token range, length, exactly once, the
/// checksum verdict), then its bytes are copied into their slots of the page.
pub fn write_frame(
    inbound: &mut Inbound,
    kv: &mut KvMemory,
    written: &mut Written,
    frame: &CheckedFrame,
    current_tag: impl FnOnce(PageId) -> Option<Tag>,
) -> Result<(), NotWritten> {
    let w = inbound.accept(frame, current_tag)?;
    let pt = inbound.reservation().page_tokens;
    let slots = slots(&w.tokens, pt);
    kv.write_slots(w.page, slots.clone(), frame.bytes())?;
    written.record(w.page, w.tag, slots);
    Ok(())
}

/// The reservation decode names to prefill for `pages`, covering the prompt's tokens from
/// `cached_tokens` (whole pages decode holds already) to `prompt_tokens`.
pub(super) fn target(
    nonce: SessionNonce,
    pages: &[PageRef],
    prompt_tokens: u32,
    cached_tokens: u32,
    page_tokens: u32,
    token_bytes: u32,
) -> Target {
    let mut target = Target {
        nonce,
        pages: Vec::new(),
        prompt_tokens,
        cached_tokens,
        page_tokens,
        token_bytes,
    };
    let n = target.pages_needed().unwrap_or_default();
    target.pages = pages.iter().take(n).copied().collect();
    target
}

/// What a prefill worker reads a prompt's KV from: the request's page table (its cached
/// prefix's pages, then its own) and what holds those pages.
#[derive(Debug)]
pub(super) struct Source {
    pub table: Vec<PageRef>,
    pub pages: Allocation,
    pub prefix: Option<Prefix>,
    /// The whole prompt, to keep its pages in the prefix cache when the transfer is over.
    pub prompt: Vec<u32>,
}

/// What a prefill worker sends for one request: every page's frame, the manifest, and the
/// source pages, held until the transfer is closed (dropping the `Outbound` closes it).
#[derive(Debug)]
pub struct Outbound {
    pub frames: Vec<Frame>,
    pub manifest: Manifest,
    /// Boxed: an `Outbound` travels in every engine event's enum.
    source: Box<Source>,
}

impl Outbound {
    /// Reads the prompt's KV out of `source` into frames for `target`: the pages after those
    /// decode holds already.
    pub(super) fn build(
        kv: &KvMemory,
        source: Source,
        target: &Target,
        first_token: u32,
    ) -> Result<Outbound, SlotError> {
        let pt = target.page_tokens;
        let skipped = (target.cached_tokens / pt) as usize;
        let sources = source.table.iter().skip(skipped);
        let mut frames = Vec::with_capacity(target.pages.len());
        for (index, (dst, src)) in target.pages.iter().zip(sources).enumerate() {
            let index = index as u32;
            let Some(tokens) = target.page_range(index) else {
                break;
            };
            let bytes = kv.read_slots(src.page, slots(&tokens, pt))?;
            frames.push(Frame::new(target.nonce, index, dst.tag, tokens, bytes));
        }
        let manifest = Manifest::new(
            target.nonce,
            target.prompt_tokens,
            first_token,
            frames.iter().map(|f| f.header.checksum),
        );
        Ok(Outbound {
            frames,
            manifest,
            source: Box::new(source),
        })
    }

    pub fn nonce(&self) -> SessionNonce {
        self.manifest.nonce
    }

    /// Prompt tokens the frames carry: those after decode's cached prefix.
    pub fn sent_tokens(&self) -> u32 {
        let tokens = self.frames.iter().map(|f| &f.header.tokens);
        tokens.map(|t| t.end.saturating_sub(t.start)).sum()
    }

    /// Prompt tokens whose KV was read from the prefix cache instead of computed.
    pub fn cached_tokens(&self) -> usize {
        self.source.prefix.as_ref().map_or(0, Prefix::tokens)
    }

    /// The transfer is over (sent, or abandoned and acknowledged): the prompt's whole pages go
    /// to the tenant's prefix cache (with the cache on), the rest of the source is released.
    pub fn close(self) {
        let Source {
            pages,
            prefix,
            prompt,
            ..
        } = *self.source;
        retire(pages, prefix, &prompt);
    }
}

/// A request's pages once nothing can write them: with the prefix cache on (`prefix` is
/// `Some`), the whole pages of `computed` — the prompt tokens whose KV is in the pages — go
/// to the tenant's cache; the rest are released.
pub(super) fn retire(pages: Allocation, prefix: Option<Prefix>, computed: &[u32]) {
    match prefix {
        Some(prefix) => {
            pages.keep_prompt(prefix, computed);
        }
        None => pages.release(),
    }
}
