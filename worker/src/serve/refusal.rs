//! Admission refusals and KV reservations as they cross the wire between decode and prefill
//! workers: one conversion each way, so a prefill worker's refusal reaches the client as if
//! decode had made it (same code, same numbers).

use bulkhead_handoff::{Reservation, SessionNonce};
use bulkhead_kvpool::{PageId, PageRef, Tag};

use super::error::ValidationError;
use super::proto::{self, Refusal, RefusalReason};
use crate::engine::SubmitError;

/// The wire form of an admission refusal.
pub fn to_refusal(e: &SubmitError) -> Refusal {
    let detail = e.to_string();
    match *e {
        SubmitError::ContextLengthExceeded {
            requested,
            limit,
            prompt,
            max_new,
        } => Refusal {
            reason: RefusalReason::RefusalContextLengthExceeded.into(),
            requested,
            limit,
            prompt: prompt as u64,
            max_new: max_new as u64,
            detail,
        },
        SubmitError::QueueFull { capacity } => Refusal {
            reason: RefusalReason::RefusalQueueFull.into(),
            limit: capacity as u64,
            detail,
            ..Refusal::default()
        },
        SubmitError::EmptyPrompt
        | SubmitError::NoNewTokens
        | SubmitError::TokenOutOfRange { .. }
        | SubmitError::DuplicateId(_)
        | SubmitError::ReservationMismatch(_)
        | SubmitError::Invalid(_) => Refusal {
            reason: RefusalReason::RefusalInvalid.into(),
            detail,
            ..Refusal::default()
        },
    }
}

/// The most of a peer's refusal detail relayed (to the log and the caller's status).
const MAX_DETAIL_BYTES: usize = 300;

/// The refusal a peer sent, as this worker's own admission error; its free text bounded and
/// escaped, as all text a peer wrote (it reaches this worker's log and its caller).
pub fn from_refusal(r: &Refusal) -> SubmitError {
    let clamp = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
    match RefusalReason::try_from(r.reason) {
        Ok(RefusalReason::RefusalContextLengthExceeded) => SubmitError::ContextLengthExceeded {
            requested: r.requested,
            limit: r.limit,
            prompt: clamp(r.prompt),
            max_new: clamp(r.max_new),
        },
        Ok(RefusalReason::RefusalQueueFull) => SubmitError::QueueFull {
            capacity: clamp(r.limit),
        },
        Ok(RefusalReason::RefusalInvalid | RefusalReason::Unspecified) | Err(_) => {
            SubmitError::Invalid(crate::printable::printable(&r.detail, MAX_DETAIL_BYTES))
        }
    }
}

pub fn to_proto_reservation(r: &Reservation) -> proto::KvReservation {
    proto::KvReservation {
        nonce: r.nonce.0.to_vec(),
        pages: r
            .pages
            .iter()
            .map(|p| proto::ReservedPage {
                page: p.page.get(),
                tag: p.tag.get(),
            })
            .collect(),
        prompt_tokens: r.prompt_tokens,
        cached_tokens: r.cached_tokens,
        page_tokens: r.page_tokens,
        token_bytes: r.token_bytes,
    }
}

/// A reservation from a decode worker, checked for shape (the engine checks it against the
/// prompt and the KV layout).
pub fn from_proto_reservation(r: &proto::KvReservation) -> Result<Reservation, ValidationError> {
    let nonce: [u8; 16] =
        r.nonce
            .as_slice()
            .try_into()
            .map_err(|_| ValidationError::Reservation {
                reason: format!("the nonce has {} bytes, not 16", r.nonce.len()),
            })?;
    Ok(Reservation {
        nonce: SessionNonce(nonce),
        pages: r
            .pages
            .iter()
            .map(|p| PageRef {
                page: PageId::new(p.page),
                tag: Tag::new(p.tag),
            })
            .collect(),
        prompt_tokens: r.prompt_tokens,
        cached_tokens: r.cached_tokens,
        page_tokens: r.page_tokens,
        token_bytes: r.token_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_refusal_survives_the_wire() {
        for e in [
            SubmitError::ContextLengthExceeded {
                requested: 900,
                limit: 512,
                prompt: 800,
                max_new: 100,
            },
            SubmitError::QueueFull { capacity: 7 },
        ] {
            assert_eq!(from_refusal(&to_refusal(&e)), e);
        }
        let relayed = from_refusal(&to_refusal(&SubmitError::EmptyPrompt));
        assert_eq!(relayed, SubmitError::Invalid("the prompt is empty".into()));
        // A peer's own words, bounded and unable to forge a log line.
        let forged = Refusal {
            reason: RefusalReason::RefusalInvalid.into(),
            detail: format!("no\nINFO forged{}", "x".repeat(1 << 20)),
            ..Refusal::default()
        };
        let SubmitError::Invalid(detail) = from_refusal(&forged) else {
            panic!("invalid");
        };
        assert!(detail.len() <= MAX_DETAIL_BYTES + 8, "{}", detail.len());
        assert!(detail.starts_with("no\\nINFO forged"), "{detail}");
    }

    #[test]
    fn reservations_survive_the_wire_and_bad_nonces_are_refused() {
        let r = Reservation {
            nonce: SessionNonce([9; 16]),
            pages: vec![PageRef {
                page: PageId::new(4),
                tag: Tag::new(77),
            }],
            prompt_tokens: 40,
            cached_tokens: 32,
            page_tokens: 16,
            token_bytes: 64,
        };
        assert_eq!(
            from_proto_reservation(&to_proto_reservation(&r)).unwrap(),
            r
        );
        let mut bad = to_proto_reservation(&r);
        bad.nonce.pop();
        assert!(from_proto_reservation(&bad).is_err());
    }
}
