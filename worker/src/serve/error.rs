//! Everything that can go wrong with one request, and the one table that turns it into a gRPC
//! status with a machine-readable code (the proto documents the same table).
//!
//! Conversions have no side effects: they log nothing. Internal details (integrity failures,
//! bugs) are logged where they happen and never sent to the client.

use tonic::metadata::MetadataValue;
use tonic::{Code, Status};

use crate::engine::{Failure, SubmitError};
use crate::model::SeqFailure;
use crate::sampling::SamplingError;

use super::proto::{FAULT_KEY, REFUSED_BY_KEY, error_code_status};

/// Why a `GenerateRequest` is malformed. One variant per rule; messages a caller can act on.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ValidationError {
    #[error("the request has no prompt: set one of tokens, text or chat")]
    MissingPrompt,
    #[error("{field} is {len} bytes long; the limit is {limit}")]
    FieldTooLong {
        field: &'static str,
        len: usize,
        limit: usize,
    },
    #[error("{count} stop sequences given; the limit is {limit}")]
    TooManyStops { count: usize, limit: usize },
    #[error("stop sequences must not be empty")]
    EmptyStop,
    #[error("chat prompt has no messages")]
    EmptyChat,
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    #[error("this model cannot render chat prompts: {reason}")]
    ChatUnavailable { reason: String },
    #[error("the chat template refused these messages: {reason}")]
    ChatRender { reason: String },
    /// The chat template's sandbox could not render (logged where it happened).
    #[error("the chat template's sandbox is unavailable")]
    ChatSandbox,
    #[error("the text cannot be tokenized: {reason}")]
    Tokenize { reason: String },
    #[error("the KV reservation is malformed: {reason}")]
    Reservation { reason: String },
    /// Decode names its data plane by address and port; anything else (a host name to resolve,
    /// text to log) is refused before it is dialled or logged.
    #[error("kv_address must be an IP address and port")]
    KvAddress,
    #[error("this worker's role is {role}; {call} is not served here")]
    WrongRole {
        role: &'static str,
        call: &'static str,
    },
}

/// One request's failure, wherever it happened.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ServeError {
    /// Malformed before reaching the engine.
    #[error(transparent)]
    Invalid(#[from] ValidationError),
    /// Refused by the engine's admission; nothing was allocated.
    #[error(transparent)]
    Submit(#[from] SubmitError),
    /// Failed after admission; the output so far must be discarded.
    #[error(transparent)]
    Failed(#[from] Failure),
    /// The engine thread is not running.
    #[error("the engine is not running")]
    EngineGone,
    /// The engine thread has been in one step for `secs`: stuck, not busy.
    #[error("the engine has not finished a step for {secs} s")]
    EngineStalled { secs: u64 },
    /// The prefill worker could not be reached or dropped the call.
    #[error("the prefill worker is unavailable: {reason}")]
    PrefillUnavailable { reason: String },
    /// A worker bug outside the engine; details are logged where it happens.
    #[error("internal error in the {what}")]
    Internal { what: &'static str },
    /// The caller checked another process at this address (this one restarted since).
    #[error(
        "this worker is not the process {checked} the caller checked (it restarted): check it again before routing here"
    )]
    OtherInstance { checked: String },
    /// Prefill role: the decode worker calling serves another model.
    #[error(
        "this prefill worker serves model {ours}, the decode worker calling it {theirs}: the prompt's KV would be another model's"
    )]
    OtherModel { ours: String, theirs: String },
}

/// The machine-readable codes, as sent in [`ERROR_CODE_KEY`].
pub mod codes {
    pub const CONTEXT_LENGTH_EXCEEDED: &str = "context_length_exceeded";
    pub const INVALID_REQUEST: &str = "invalid_request_error";
    pub const RATE_LIMIT_EXCEEDED: &str = "rate_limit_exceeded";
    pub const KV_INTEGRITY: &str = "kv_integrity_error";
    pub const INTERNAL: &str = "internal_error";
    pub const SERVICE_UNAVAILABLE: &str = "service_unavailable";
}

/// The gRPC status for `err`: the one error table of the worker's API.
pub fn status(err: &ServeError) -> Status {
    use codes::*;
    let (code, tag, message) = match err {
        ServeError::Invalid(
            e @ (ValidationError::MissingPrompt
            | ValidationError::FieldTooLong { .. }
            | ValidationError::TooManyStops { .. }
            | ValidationError::EmptyStop
            | ValidationError::EmptyChat
            | ValidationError::Sampling(_)
            | ValidationError::ChatUnavailable { .. }
            | ValidationError::ChatRender { .. }
            | ValidationError::Tokenize { .. }
            | ValidationError::Reservation { .. }
            | ValidationError::KvAddress
            | ValidationError::WrongRole { .. }),
        ) => (Code::InvalidArgument, INVALID_REQUEST, e.to_string()),
        ServeError::Submit(e) => match e {
            SubmitError::ContextLengthExceeded { .. } => (
                Code::InvalidArgument,
                CONTEXT_LENGTH_EXCEEDED,
                e.to_string(),
            ),
            SubmitError::QueueFull { .. } => {
                (Code::ResourceExhausted, RATE_LIMIT_EXCEEDED, e.to_string())
            }
            SubmitError::EmptyPrompt
            | SubmitError::NoNewTokens
            | SubmitError::TokenOutOfRange { .. }
            | SubmitError::ReservationMismatch(_)
            | SubmitError::Invalid(_) => (Code::InvalidArgument, INVALID_REQUEST, e.to_string()),
            // The worker assigns ids itself, so a duplicate is a worker bug.
            SubmitError::DuplicateId(_) => (Code::Internal, INTERNAL, "internal error".into()),
        },
        ServeError::Failed(f) => match f {
            // Decode checked the request itself before it asked prefill: prefill refusing it as
            // invalid (a reservation its pages cannot hold, a token its vocabulary lacks) is
            // the pair disagreeing — a deployment fault, never the client's mistake.
            Failure::PrefillRejected(SubmitError::Invalid(detail)) => (
                Code::Unavailable,
                SERVICE_UNAVAILABLE,
                format!(
                    "the prefill worker refused what this worker admitted (the pair disagree: \
                     `bulkhead preflight` says how): {detail}"
                ),
            ),
            // The prefill worker's admission answered for this one: same table, its layer.
            Failure::PrefillRejected(e) => {
                let mut s = status(&ServeError::Submit(e.clone()));
                s.metadata_mut()
                    .insert(REFUSED_BY_KEY, MetadataValue::from_static("prefill"));
                return s;
            }
            Failure::Forward(SeqFailure::Integrity(_))
            | Failure::Transfer(_)
            | Failure::PrefillIntegrity => (
                Code::Internal,
                KV_INTEGRITY,
                "KV cache integrity check failed; discard this request's output".into(),
            ),
            Failure::Forward(SeqFailure::TokenOutOfRange { .. } | SeqFailure::Internal(_)) => {
                (Code::Internal, INTERNAL, "internal error".into())
            }
            Failure::PrefillClosed(_) | Failure::TransferTimedOut(_) => (
                Code::Unavailable,
                SERVICE_UNAVAILABLE,
                "the prefill worker did not complete the request".into(),
            ),
            // Busy, not broken: retryable, and no reason to stop routing here.
            Failure::QueueTimedOut(_) => {
                (Code::ResourceExhausted, RATE_LIMIT_EXCEEDED, f.to_string())
            }
        },
        ServeError::Internal { .. } | ServeError::Invalid(ValidationError::ChatSandbox) => {
            (Code::Internal, INTERNAL, "internal error".into())
        }
        ServeError::PrefillUnavailable { .. } => (
            Code::Unavailable,
            SERVICE_UNAVAILABLE,
            "the prefill worker is unavailable".into(),
        ),
        ServeError::EngineGone | ServeError::EngineStalled { .. } => {
            (Code::Unavailable, SERVICE_UNAVAILABLE, err.to_string())
        }
        ServeError::OtherInstance { .. } | ServeError::OtherModel { .. } => (
            Code::FailedPrecondition,
            SERVICE_UNAVAILABLE,
            err.to_string(),
        ),
    };
    let mut status = error_code_status(code, message, tag);
    if let ServeError::Submit(
        SubmitError::ContextLengthExceeded { .. } | SubmitError::QueueFull { .. },
    )
    | ServeError::Failed(Failure::QueueTimedOut(_)) = err
    {
        // This worker's own admission: the decode layer (a colocated worker decodes too).
        status
            .metadata_mut()
            .insert(REFUSED_BY_KEY, MetadataValue::from_static("decode"));
    }
    if let ServeError::PrefillUnavailable { .. }
    | ServeError::Failed(Failure::PrefillClosed(_) | Failure::TransferTimedOut(_)) = err
    {
        // Decode's own admission and pages are sound: the gateway keeps routing to it (a
        // dead prefill worker shows in decode's Info, which routing reads).
        status
            .metadata_mut()
            .insert(FAULT_KEY, MetadataValue::from_static("prefill"));
    }
    status
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::metrics::Outcome;
    use crate::serve::proto::{error_code, prefill_at_fault, refused_by};

    fn check(err: ServeError, code: Code, tag: &str) {
        let s = status(&err);
        assert_eq!(s.code(), code, "{err}");
        assert_eq!(error_code(&s), Some(tag), "{err}");
    }

    #[test]
    fn over_length_prompts_are_invalid_argument_context_length_exceeded() {
        check(
            SubmitError::ContextLengthExceeded {
                requested: 10,
                limit: 5,
                prompt: 6,
                max_new: 4,
            }
            .into(),
            Code::InvalidArgument,
            codes::CONTEXT_LENGTH_EXCEEDED,
        );
    }

    #[test]
    fn a_full_queue_is_resource_exhausted() {
        check(
            SubmitError::QueueFull { capacity: 3 }.into(),
            Code::ResourceExhausted,
            codes::RATE_LIMIT_EXCEEDED,
        );
    }

    #[test]
    fn a_wait_for_pages_past_the_queue_timeout_is_resource_exhausted_from_decode() {
        let err: ServeError = Failure::QueueTimedOut(std::time::Duration::from_secs(60)).into();
        check(
            err.clone(),
            Code::ResourceExhausted,
            codes::RATE_LIMIT_EXCEEDED,
        );
        let s = status(&err);
        assert_eq!(
            s.metadata()
                .get(REFUSED_BY_KEY)
                .and_then(|v| v.to_str().ok()),
            Some("decode")
        );
    }

    #[test]
    fn malformed_requests_are_invalid_argument() {
        for e in [
            ServeError::from(ValidationError::MissingPrompt),
            SubmitError::EmptyPrompt.into(),
            SubmitError::NoNewTokens.into(),
            SubmitError::TokenOutOfRange { token: 9, vocab: 4 }.into(),
            ValidationError::Sampling(SamplingError::TopK).into(),
        ] {
            check(e, Code::InvalidArgument, codes::INVALID_REQUEST);
        }
    }

    #[test]
    fn internal_details_never_reach_the_client() {
        let s =
            status(&Failure::from(SeqFailure::Internal("secret page 7 of tenant b".into())).into());
        assert_eq!(s.code(), Code::Internal);
        assert_eq!(error_code(&s), Some(codes::INTERNAL));
        assert!(!s.message().contains("secret"), "{}", s.message());
    }

    #[test]
    fn refusals_name_the_admission_layer_that_refused() {
        let too_long = SubmitError::ContextLengthExceeded {
            requested: 10,
            limit: 5,
            prompt: 6,
            max_new: 4,
        };
        assert_eq!(
            refused_by(&status(&too_long.clone().into())),
            Some("decode")
        );
        let by_prefill = status(&Failure::PrefillRejected(too_long).into());
        assert_eq!(refused_by(&by_prefill), Some("prefill"));
        assert_eq!(
            error_code(&by_prefill),
            Some(codes::CONTEXT_LENGTH_EXCEEDED)
        );
        assert_eq!(refused_by(&status(&ServeError::EngineGone)), None);
    }

    /// A request decode admitted that prefill refuses as invalid is the pair's fault, not the
    /// client's: unavailable, where it was relayed as the client's invalid request (400).
    #[test]
    fn prefill_refusing_what_decode_admitted_is_unavailable_not_the_clients_error() {
        let mismatch =
            SubmitError::Invalid("the reservation's pages hold 16 tokens, not 32".into());
        let s = status(&Failure::PrefillRejected(mismatch.clone()).into());
        assert_eq!(s.code(), Code::Unavailable, "{s:?}");
        assert_eq!(error_code(&s), Some(codes::SERVICE_UNAVAILABLE));
        assert_eq!(refused_by(&s), None, "no admission refused it");
        assert!(s.message().contains("16 tokens"), "{s:?}");
        assert_eq!(
            Outcome::failed(&Failure::PrefillRejected(mismatch)),
            Outcome::FailedPrefill
        );
    }

    /// Only the prefill worker's failures say so: a router reading `bulkhead-fault` keeps the
    /// decode worker, and stops routing to one whose own engine failed.
    #[test]
    fn a_prefill_workers_failure_is_said_to_be_prefills_fault_and_decodes_own_is_not() {
        let secs = std::time::Duration::from_secs(5);
        for e in [
            ServeError::PrefillUnavailable {
                reason: "connection refused".into(),
            },
            Failure::PrefillClosed("the stream ended").into(),
            Failure::TransferTimedOut(secs).into(),
        ] {
            let s = status(&e);
            assert_eq!(error_code(&s), Some(codes::SERVICE_UNAVAILABLE), "{e}");
            assert!(prefill_at_fault(&s), "{e}");
            assert_eq!(refused_by(&s), None, "{e}: no admission refused it");
        }
        let mismatch = SubmitError::Invalid("the pair disagree".into());
        for e in [
            ServeError::EngineGone,
            ServeError::EngineStalled { secs: 9 },
            Failure::PrefillRejected(mismatch).into(),
            Failure::QueueTimedOut(secs).into(),
        ] {
            assert!(!prefill_at_fault(&status(&e)), "{e}");
        }
    }

    #[test]
    fn engine_gone_is_unavailable() {
        check(
            ServeError::EngineGone,
            Code::Unavailable,
            codes::SERVICE_UNAVAILABLE,
        );
    }
}
