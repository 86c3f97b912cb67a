//! A [`stateright`] model of Bulkhead's disaggregated prefill/decode KV handoff (design.md,
//! request path steps 6–13), checked exhaustively, breadth-first, up to a stated bound.
//!
//! The model mirrors the concepts of `bulkhead-kvpool` (page indices, generation tags that
//! change on every allocation, the Reservation → Allocation / Releasing lifecycle) but is a
//! separate abstract model: it does not depend on that crate, and a page's "contents" are
//! only *whose* bytes it holds.
//!
//! # The protocol
//!
//! ```text
//!  client        decode D (pool of P pages)                  network          prefill Pf
//!    │ Generate    │                                        (lose, reorder,      │
//!    ├────────────▶│ admission: pages > P → Rejected (400)   duplicate,         │
//!    │             │   (nothing reserved)                    corrupt a frame)   │
//!    │             │ reserve pages: fresh tags, nonce n                         │
//!    │             │─ Prefill(req, n, [(page, tag)…]) ────────────────────────▶│ admission:
//!    │             │◀──────────────────────────────────────────── Reject(n) ────┤  pages > Pf pool
//!    │             │   release at once (zeroed); 400                            │  → Reject, no frames
//!    │             │◀──────────────────── Frame(n, page, tag, checksum, bytes) ─┤ one per page
//!    │             │   write iff n is open and transferring, page ∈ n's table,  │
//!    │             │   tag = the page's current tag; else drop                  │
//!    │             │   bad checksum → quarantine, Abort(n), 500                 │
//!    │             │◀────────────────────────── Manifest(n, count, digest) ─────┤
//!    │             │   commit iff count = |table|, every page written exactly   │
//!    │             │   once, digest matches, no tag changed;                    │
//!    │             │   else quarantine, Abort(n), 500 kv_integrity_error        │
//!    │◀── tokens ──│ Running: attends over its pages   ◀── properties checked   │
//!    │             │ finish → pages free (zeroed)                               │
//!    │ abort ─────▶│ pages → Releasing, n → Draining (frames dropped)           │
//!    │             │─ Abort(n) ───────────────────────────────────────────────▶│ stop sending
//!    │             │◀──────────────────────────────────────────── DrainAck(n) ──┤
//!    │             │   Releasing → free (zeroed)                                │
//!    │             │ drain timeout: Releasing → quarantined (never free)        │
//!    │             │ transport teardown: nothing in flight, nothing can land:   │
//!    │             │   Reserved/Releasing → free; no later admission (503)      │
//! ```
//!
//! With decode's prefix cache on ([`Config::prefix_cache`]), admission first looks the prompt
//! up in the cache of the request's tenant: on a hit it pins the cached first page, reserves
//! only the rest, and the `Prefill` names only those pages; the pin goes when nothing reads
//! the page any more: at the client's abort (its session drains on without it, as decode drops
//! a transfer's prefix when it starts draining), or when the session closes otherwise (finish,
//! drain timeout, integrity failure, rejection, teardown). A finished request's first page, if
//! it computed it, stays cached for its tenant; the cache evicts (zeroes and frees) a page
//! only at zero pins.
//!
//! Freed pages are reallocated (with new tags) to later requests: page reuse is part of every
//! bound below.
//!
//! # Bound
//!
//! Every check visits all reachable states (BFS, one thread). Measured in a debug build with
//! this crate at `opt-level = 3`, on a 2-core development machine:
//!
//! | shape | decode / prefill pages | requests (pages, tenant) | attempts | dup / corrupt / teardown | Correct: states, time |
//! |---|---|---|---|---|---|
//! | [`Config::incident_shape`] | 3 / 2 | R1 2 a, R2 3 b, R3 4 c | 1 | 1 / 1 / 1 | 213,921 in ~2 s |
//! | [`Config::reuse_shape`] | 3 / 3 | R1 2 a, R2 2 b | 1 | 1 / 1 / 1 | 234,948 in ~3.5 s |
//! | [`Config::retry_shape`] | 3 / 3 | R1 2 a, R2 2 b | 2 | 0 / 0 / 0 | 1,677,912 in ~31 s |
//! | [`Config::prefix_shape`] (prefix cache on) | 3 / 3 | R1 2 a, R2 2 b, R3 2 a | 1 | 0 / 1 / 1 | 1,698,259 in ~29 s |
//!
//! Messages may be lost any number of times; "dup" and "corrupt" are budgets for the whole
//! run; teardown happens at most once and is permanent. Retries (attempts > 1) get a fresh
//! nonce and fresh tags. (Measured at this crate's version of 2026-12-03; the counts grew from
//! an earlier table's when quarantine reclaim was added.)
//!
//! # Properties
//!
//! See [`properties`]. Safety (`always`), which [`Variant::Correct`] keeps in every shape:
//!
//! 1. `no_foreign_bytes_read` — the mission: while a request attends over its pages (from
//!    commit until it finishes), every page of its reservation holds exactly that session's
//!    bytes, and the cached prefix page it reads holds bytes a session of its own tenant wrote:
//!    never zero, never anyone else's. `no_other_session_bytes_read` is the sharper half: never
//!    another session's bytes in its reservation, never another tenant's in its prefix.
//! 2. `i1_ownership` — each page is free, quarantined, cached, or held by exactly one session,
//!    and the allocator, the prefix cache and decode's transfer table agree about it (a cached
//!    page's pins are the open sessions reading it, and every such page is still cached).
//! 3. `i4_no_late_writes` — a session's bytes never land in a page after it left that session
//!    (a ghost variable records the first such write).
//!
//! Examples (`sometimes`), so the model is not vacuous: a request commits; a request is
//! rejected (incident shape only); a page is allocated twice; a quarantine is reclaimed; a
//! request commits over a cached prefix and a cached page is evicted (prefix shape).
//!
//! # Seeded bugs
//!
//! Each [`Variant`] other than `Correct` must yield a counterexample (the tests assert it).
//!
//! - [`Variant::Incident`] (incident shape; 574,491 states): prefill "rejects" R2 (3 pages,
//!   its pool holds 2) with a one-page placeholder, decode commits on any manifest, release
//!   does not zero. Trace (12 steps): R1 is reserved p0–p1, one frame of R1 lands in p0, the
//!   client aborts R1, Abort and DrainAck pass, p0–p1 go back to the free list still holding
//!   R1's bytes; R2 is reserved p0–p2, prefill sends one frame and a manifest for "1 page",
//!   the manifest arrives first, decode commits, and R2 attends over p0 holding R1's bytes
//!   (and p1, p2 holding nothing it wrote). Violates `no_foreign_bytes_read` and
//!   `no_other_session_bytes_read`.
//! - [`Variant::NoTagCheck`] (reuse shape; 770,691 states): decode writes a frame into the
//!   physical page it names, with no nonce, reservation or tag check. Trace (15 steps): the
//!   client aborts R1 while its frame for p0 (tag 1) is in flight; the DrainAck overtakes that
//!   frame, p0–p1 are freed and reserved again for R2 (tags 3, 4); R2's frame for p0 lands,
//!   then R1's late frame lands on top of it, then R2's second frame and manifest: coverage
//!   counts per nonce are perfect, decode commits, and R2 reads R1's bytes in p0. Violates
//!   `no_foreign_bytes_read`, `no_other_session_bytes_read`, `i4_no_late_writes`.
//! - [`Variant::EagerRelease`] (incident shape; 749,382 states): a client abort hands the
//!   pages back to the allocator at once, while the transfer engine keeps the session open
//!   until the drain ack. Trace (6 steps as printed; the duplication in it is idle): R1 is reserved
//!   p0–p1, the client aborts, p0–p1 are free, prefill receives the Prefill and sends its
//!   first frame, which still passes the nonce, reservation and tag checks (a free page keeps
//!   its tag until it is reallocated) and lands in free p0. Violates `i4_no_late_writes` and
//!   `i1_ownership` (a free page in an open session's table); reads stay clean here because
//!   pages are zeroed on reuse and re-tagged.
//! - [`Variant::UnscopedCache`] (prefix shape; the test stops at the first counterexample): decode's prefix cache looks a
//!   prompt up without its tenant. Trace (15 steps): R1 (tenant a) commits and finishes, its
//!   first page p0 stays cached; R2 (tenant b) finds it, reserves only p1, prefill fills p1,
//!   R2 commits and attends over p0 holding R1's bytes. Violates `no_foreign_bytes_read` and
//!   `no_other_session_bytes_read`: the tenant scope of the lookup is what stops it.
//! - [`Variant::UnpinnedPrefix`] (prefix shape; likewise): a cache hit does not pin
//!   the page. Trace (20 steps): R1 (a) finishes, p0 cached; R3 (a) is admitted over p0 and
//!   reserves p1; the cache evicts p0 (no pins); R2 (b) reserves p0 and p2, and its frame lands
//!   in p0; R3 commits and reads R2's bytes in p0. Violates `no_foreign_bytes_read`,
//!   `no_other_session_bytes_read` and `i1_ownership`: every frame passed the nonce, reservation
//!   and tag checks, so only the pin keeps a page under its readers.
//!
//! # What the model says about the design
//!
//! - With decode checking every frame against an open, transferring session, the tag
//!   comparison on frames never changes the outcome in these bounds (removing it leaves the
//!   Correct state counts and verdicts unchanged): the session phase check already drops
//!   late frames. The tag check is a second layer; it matters where a page table can outlive
//!   its allocation (as in `EagerRelease`, where the allocator and the transfer table
//!   disagree), and at read time in the attention kernel.
//! - The drain ack is what gates page *reuse*: without it (`EagerRelease`) a page can be
//!   written after it was freed.
//!
//! # Abstractions (what is not modelled)
//!
//! Tokens are whole pages; a page's bytes are just its writer's nonce (and, with the prefix
//! cache, its writer's tenant); a checksum is
//! ok/corrupt; the manifest digest is the list of (page, tag) the frames carried. Prefill's
//! pool is only a capacity check (no concurrent allocation, no source pages). Decode takes
//! the lowest-index free pages. A quarantine is reclaimed (zeroed, freed) once nothing of its
//! session is in flight and prefill sends no more. Admission that does not
//! fit *now* simply waits. A committed request's client abort is the same as finishing. There
//! is no reconnect after teardown and no transfer deadline: liveness is not checked, only
//! safety plus the examples above. The prefix cache holds at most one page per tenant (the
//! prompt's first, shared by every prompt), filled only when a request finishes (as decode's
//! cache is), and evicts any unpinned page at any moment; where a frame's KV sits within the
//! prompt is not modelled, so a prefill that ignores the cached count (placing its frames from
//! token 0) is left to `bulkhead-handoff`'s own tests.
#![warn(missing_docs)]

mod check;
mod config;
mod ids;
mod model;
mod net;
pub mod properties;
mod state;

pub use check::{Report, Trace, check, counterexample};
pub use config::{Config, Variant};
pub use ids::{Nonce, PageIdx, ReqIdx, Tag};
pub use model::{Action, HandoffModel};
pub use net::{Msg, Network, Slot};
pub use state::{
    Contents, Hold, Holder, Outcome, Page, PfSession, Phase, ReqStatus, Request, Session, State,
};
