//! The KV handoff between a prefill worker and a decode worker, as pure logic.
//!
//! Decode reserves the destination pages and names them to prefill as a [`Reservation`]: a
//! fresh random [`SessionNonce`], the (page, tag) of every page the prompt's KV will fill, the
//! prompt's token count, and how many of its first tokens decode already holds (its tenant's
//! prefix cache: nothing of them is sent). Prefill streams one [`Frame`] per page, each carrying the nonce,
//! the page's index in the reservation, its tag, the token range it holds, and a checksum over
//! all of that and the bytes. It ends with a [`Manifest`] and then [`Message::Closed`]: on an
//! ordered transport nothing of the session can follow `Closed`, so it doubles as the drain
//! acknowledgement that lets decode reuse pages of an aborted transfer.
//!
//! ```text
//!  decode                                   prefill
//!    │ admit, reserve pages (new tags)
//!    │── Reservation{nonce, [(page, tag)], tokens, cached} ──▶ admit (or reject: nothing sent)
//!    │                                              compute KV, sample first token
//!    │◀── Frame{nonce, index, tag, tokens, checksum, bytes} × pages (bounded batches)
//!    │◀── Manifest{nonce, tokens, pages, digest, first token}
//!    │◀── Closed{nonce}                 (also after an abort: the drain acknowledgement)
//!    │ Inbound::finish: every page written exactly once, checksums, digest, count, tags
//!    ▼ commit (pages become the request's) or fail: kv_integrity_error, pages quarantined
//! ```
//!
//! [`Inbound`] is decode's side: it decides for every frame whether its bytes may be written
//! and where, and whether the finished transfer may be committed. The wire codec lives in
//! [`codec`]; it never panics on any input.

pub mod codec;
mod inbound;
mod message;

pub use inbound::{Committed, DropReason, Inbound, IntegrityFailure, Write};
pub use message::{
    CheckedFrame, CloseReason, Frame, FrameHeader, Manifest, Message, Received, Reservation,
    SessionNonce, frame_checksum,
};
