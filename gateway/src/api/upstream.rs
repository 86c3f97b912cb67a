//! The hop to the worker: the Generate request the gateway sends (token ids, never text), and
//! what the worker's error statuses mean for the client.

use bulkhead_audit::Layer;
use bulkhead_worker::serve::proto::{
    self, GenerateRequest, Prompt, SamplingParams, TokenPrompt, error_code, prefill_at_fault,
    refused_by,
};

use crate::admission::Admitted;

use super::Endpoint;
use super::error::ApiError;
use super::validate::Sampling;

/// The longest wait a busy worker or upstream may ask a client for (an upstream's
/// `Retry-After` is passed on up to this).
const MAX_RETRY_AFTER_SECS: u64 = 3600;

/// What to generate, all decided by the gateway.
#[derive(Debug)]
pub struct Generate<'a> {
    pub request_id: &'a str,
    pub tenant: &'a str,
    pub prompt: Vec<u32>,
    pub admitted: Admitted,
    pub sampling: Sampling,
    pub stop: &'a [String],
    /// The client's `cache_salt`, if it sent one.
    pub cache_salt: Option<&'a str>,
    /// The instance of the worker process the route was checked against.
    pub instance_id: &'a str,
}

impl Generate<'_> {
    pub fn into_request(self) -> GenerateRequest {
        GenerateRequest {
            request_id: self.request_id.to_owned(),
            tenant: self.tenant.to_owned(),
            prompt: Some(Prompt::Tokens(TokenPrompt { ids: self.prompt })),
            max_new_tokens: self.admitted.max_new_tokens(),
            sampling: Some(SamplingParams {
                temperature: self.sampling.temperature,
                top_k: None,
                top_p: self.sampling.top_p,
                seed: self.sampling.seed,
            }),
            stop: self.stop.to_vec(),
            ignore_eos: false,
            cache_salt: self.cache_salt.unwrap_or_default().to_owned(),
            instance_id: self.instance_id.to_owned(),
        }
    }
}

/// How a worker's failure reaches the client, and whether it means the worker itself is in
/// trouble (transport failure, not serving) rather than this request.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerFailure {
    pub error: ApiError,
    pub worker_down: bool,
    /// The worker admission layer that refused the request, when one did.
    pub refused_by: Option<Layer>,
}

/// Maps a worker's status by its machine-readable code (the worker proto's table), for a
/// request on `endpoint`.
pub fn from_status(status: &tonic::Status, endpoint: Endpoint) -> WorkerFailure {
    let message = status.message().to_owned();
    let (error, worker_down) = match error_code(status) {
        Some("context_length_exceeded") => (
            ApiError::WorkerContextLengthExceeded { message, endpoint },
            false,
        ),
        Some("invalid_request_error") => (ApiError::WorkerInvalidRequest { message }, false),
        // A worker's full queue frees within about a second; an upstream may say how long.
        Some("rate_limit_exceeded") => (
            ApiError::WorkerBusy {
                retry_after_secs: proto::retry_after_secs(status)
                    .unwrap_or(1)
                    .clamp(1, MAX_RETRY_AFTER_SECS),
            },
            false,
        ),
        Some("kv_integrity_error") => (ApiError::KvIntegrity, false),
        Some("internal_error") => (ApiError::Internal, false),
        // A decode worker failed by its prefill worker is sound itself: marking it down would
        // take every decode worker behind one bad prefill worker out of routing in turn (a
        // prefill worker that stays down shows in decode's Info, which routing reads).
        Some("service_unavailable") => (ApiError::WorkerUnavailable, !prefill_at_fault(status)),
        // No code: the transport failed (the worker died or is unreachable), or a worker that
        // speaks another protocol; either way the request did not complete.
        Some(_) | None => (ApiError::WorkerUnavailable, true),
    };
    let refused_by = match refused_by(status) {
        Some("decode") => Some(Layer::Decode),
        Some("prefill") => Some(Layer::Prefill),
        _ => None,
    };
    WorkerFailure {
        error,
        worker_down,
        refused_by,
    }
}

/// Marks the upstream call's span failed with `error`'s class.
pub fn span_failed(span: &tracing::Span, error: &ApiError) {
    span.record("error.type", error.error_type());
    span.record("otel.status_code", "ERROR");
}

/// OpenAI's `finish_reason` for the worker's.
pub fn finish_reason(reason: i32) -> &'static str {
    match proto::FinishReason::try_from(reason) {
        Ok(proto::FinishReason::Length) => "length",
        Ok(proto::FinishReason::ContentFilter) => "content_filter",
        Ok(proto::FinishReason::Stop | proto::FinishReason::Unspecified) | Err(_) => "stop",
    }
}

#[cfg(test)]
mod tests {
    use tonic::metadata::MetadataValue;
    use tonic::{Code, Status};

    use super::*;

    fn status(code: Code, tag: &'static str) -> Status {
        let mut s = Status::new(code, "m");
        s.metadata_mut()
            .insert(proto::ERROR_CODE_KEY, MetadataValue::from_static(tag));
        s
    }

    #[test]
    fn worker_codes_map_onto_the_api_table() {
        let too_long = status(Code::InvalidArgument, "context_length_exceeded");
        let f = from_status(&too_long, Endpoint::Chat);
        assert!(matches!(
            f.error,
            ApiError::WorkerContextLengthExceeded { .. }
        ));
        assert_eq!(f.error.param().as_deref(), Some("messages"));
        let f = from_status(&too_long, Endpoint::Completion);
        assert_eq!(f.error.param().as_deref(), Some("prompt"), "{:?}", f.error);
        assert!(!f.worker_down);
        assert_eq!(f.refused_by, None, "no layer named");
        let mut s = status(Code::InvalidArgument, "context_length_exceeded");
        s.metadata_mut()
            .insert(proto::REFUSED_BY_KEY, MetadataValue::from_static("prefill"));
        assert_eq!(
            from_status(&s, Endpoint::Chat).refused_by,
            Some(Layer::Prefill)
        );
        let f = from_status(
            &status(Code::ResourceExhausted, "rate_limit_exceeded"),
            Endpoint::Chat,
        );
        assert_eq!(
            f.error,
            ApiError::WorkerBusy {
                retry_after_secs: 1
            }
        );
        let mut said = status(Code::ResourceExhausted, "rate_limit_exceeded");
        said.metadata_mut()
            .insert(proto::RETRY_AFTER_KEY, MetadataValue::from_static("7"));
        assert_eq!(
            from_status(&said, Endpoint::Chat).error,
            ApiError::WorkerBusy {
                retry_after_secs: 7
            }
        );
        let f = from_status(
            &status(Code::Internal, "kv_integrity_error"),
            Endpoint::Chat,
        );
        assert_eq!(f.error, ApiError::KvIntegrity);
        let f = from_status(&status(Code::Internal, "internal_error"), Endpoint::Chat);
        assert_eq!(f.error, ApiError::Internal);
    }

    #[test]
    fn each_finish_reason_reads_as_openai_spells_it() {
        let reads = |r: proto::FinishReason| finish_reason(i32::from(r));
        assert_eq!(reads(proto::FinishReason::Stop), "stop");
        assert_eq!(reads(proto::FinishReason::Length), "length");
        assert_eq!(reads(proto::FinishReason::ContentFilter), "content_filter");
        assert_eq!(reads(proto::FinishReason::Unspecified), "stop");
    }

    #[test]
    fn a_dead_transport_is_unavailable_and_marks_the_worker() {
        let f = from_status(&Status::unavailable("connection reset"), Endpoint::Chat);
        assert_eq!(f.error, ApiError::WorkerUnavailable);
        assert!(f.worker_down);
        let f = from_status(&Status::unknown("h2 protocol error"), Endpoint::Chat);
        assert!(f.worker_down);
    }

    #[test]
    fn a_decode_worker_failed_by_its_prefill_worker_is_not_marked_down() {
        let own = status(Code::Unavailable, "service_unavailable");
        assert!(from_status(&own, Endpoint::Chat).worker_down);
        let mut prefills = own;
        prefills
            .metadata_mut()
            .insert(proto::FAULT_KEY, MetadataValue::from_static("prefill"));
        let f = from_status(&prefills, Endpoint::Chat);
        assert_eq!(f.error, ApiError::WorkerUnavailable);
        assert!(!f.worker_down);
    }
}
