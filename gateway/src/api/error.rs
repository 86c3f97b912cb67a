//! Every way an API request can fail, and the one table that turns each into an HTTP status
//! and OpenAI's error JSON (`{"error": {"message", "type", "param", "code"}}`).
//!
//! Conversions have no side effects. Internal details (a worker's internal error, transport
//! failures) are logged where they happen and never sent to the client.

use std::time::Duration;

use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode, header};
use serde_json::json;

use crate::admission::ContextLengthExceeded;
use crate::limits::{LimitError, retry_after};
use crate::policy::{Fault, Refusal, Refused, SLOT_WAIT};
use crate::trail::{CLIENT_CLOSED, CLIENT_CLOSED_TYPE, GATEWAY_SHUTDOWN_TYPE};

use super::Endpoint;
use super::validate::RequestError;

/// Why an API request failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ApiError {
    /// No `Authorization: Bearer` key, or one that is not configured.
    #[error("invalid API key: send `Authorization: Bearer <key>` with a key this gateway knows")]
    InvalidApiKey,
    /// The body does not parse or breaks a rule.
    #[error(transparent)]
    InvalidRequest(#[from] RequestError),
    /// The body is larger than the configured limit.
    #[error("the request body is larger than {limit} bytes")]
    BodyTooLarge { limit: usize },
    /// The request body broke off or was malformed (its chunked encoding, a connection
    /// error) before it was whole.
    #[error("the request body could not be read: {reason}")]
    BodyUnreadable { reason: String },
    /// The client ended its side of the connection (closed it, or half-closed it) before its
    /// request body was whole: it left. Recorded as such; a half-closed client that still
    /// reads gets this status.
    #[error("the client closed the connection before its request body was whole")]
    ClientClosedBody,
    /// The request body did not arrive in time (a client that trickles it, or stops).
    #[error("the request body did not arrive within {secs} s")]
    BodyTimeout { secs: u64 },
    /// The request asked for a model that is not served.
    #[error("the model {asked:?} is not served here; GET /v1/models lists {served:?}")]
    ModelNotFound { asked: String, served: String },
    /// The prompt cannot be turned into tokens: no chat template, the template refused the
    /// messages, or the text does not tokenize.
    #[error("{reason}")]
    Prompt {
        reason: String,
        /// The field that holds it: `messages` or `prompt`.
        param: &'static str,
    },
    /// Gateway admission refused the request, on `endpoint`, as too long.
    #[error("{exceeded}")]
    ContextLengthExceeded {
        exceeded: ContextLengthExceeded,
        endpoint: Endpoint,
    },
    /// The worker's own admission refused it as too long (the gateway's check passed).
    #[error("{message}")]
    WorkerContextLengthExceeded { message: String, endpoint: Endpoint },
    /// The worker refused a field the gateway passed on.
    #[error("{message}")]
    WorkerInvalidRequest { message: String },
    /// The tenant is over one of its limits.
    #[error(transparent)]
    TenantLimit(#[from] LimitError),
    /// The worker's admission queue is full (or an upstream said it is over its rate).
    #[error("the worker is busy; retry in {retry_after_secs} s")]
    WorkerBusy { retry_after_secs: u64 },
    /// The gateway is shutting down and its drain timeout passed with the request unfinished.
    #[error("the gateway is shutting down; the request was cut before it finished")]
    GatewayShutdown,
    /// No worker can take the request (none healthy, none registered yet).
    #[error("no healthy worker can serve this request now; retry later")]
    NoHealthyWorker,
    /// The worker failed or vanished while serving the request.
    #[error("the worker did not complete this request; retry later")]
    WorkerUnavailable,
    /// A KV cache integrity check failed: the output is discarded, never retried into a 200.
    #[error("KV cache integrity check failed; the request's output was discarded")]
    KvIntegrity,
    /// The request did not finish within the configured time.
    #[error("the request did not complete within {secs} s")]
    Timeout { secs: u64 },
    /// The body came with a `Content-Encoding` this server does not decode.
    #[error("the request body has Content-Encoding {coding:?}; send it uncompressed (identity)")]
    UnsupportedEncoding { coding: String },
    /// An HTTP/1.1 request without a `Host` header, or any with more than one.
    #[error("the request must carry exactly one Host header (it has {count})")]
    BadHost { count: usize },
    /// Plain HTTP sent to a port that takes only TLS.
    #[error("this port takes only HTTPS: send the request over TLS (an https:// URL)")]
    HttpsRequired,
    /// No such API path.
    #[error(
        "unknown path; this server serves /v1/chat/completions, /v1/completions, /v1/models and /v1/audit"
    )]
    NotFound,
    /// The admin listener was asked for the audit log of a tenant that neither is configured
    /// nor has a log.
    #[error(
        "no audit log for tenant {tenant:?}: it is not configured and has no records (GET /tenants lists the configured ones)"
    )]
    NoAuditLog { tenant: String },
    /// A served path asked with a method it does not answer.
    #[error(
        "method not allowed: POST /v1/chat/completions and /v1/completions, GET /v1/models and /v1/audit"
    )]
    MethodNotAllowed,
    /// The audit log cannot write, and the gateway refuses to serve unaudited traffic.
    #[error("the audit log is unavailable; no request is served unaudited. Retry later")]
    AuditUnavailable,
    /// A policy plugin refused the request (`status` is the plugin's 4xx).
    #[error("{message}")]
    PolicyDenied {
        plugin: String,
        status: u16,
        message: String,
    },
    /// A policy plugin failed (trapped, timed out, exceeded its memory or answered garbage)
    /// and its binding fails closed; details are in the gateway's log.
    #[error("a policy check failed, so the request was refused")]
    PolicyFailed,
    /// The request's policies found no free instance slot in time: the sandbox is full (a
    /// capacity limit like a full queue, not a plugin's failure; refused whatever the
    /// bindings' fail-open says).
    #[error("the policy sandbox is busy; retry later")]
    PolicyBusy,
    /// The chat template's sandbox could not render the request's prompt through no fault
    /// of the template's or the request's (other renderings held it, or its helper could not
    /// start): capacity, worth another try.
    #[error("the chat template's sandbox is busy; retry later")]
    TemplateBusy,
    /// A bug; details are in the gateway's or the worker's log.
    #[error("internal error")]
    Internal,
}

/// The error class of an error response (its OpenAI `code`, else its `type`), left in the
/// response's extensions for the audit record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ErrorType(pub &'static str);
impl From<Refused> for ApiError {
    fn from(refused: Refused) -> ApiError {
        match refused.refusal {
            Refusal::Denied {
                plugin,
                status,
                message,
            } => ApiError::PolicyDenied {
                plugin: plugin.to_string(),
                status,
                message,
            },
            Refusal::Failed {
                fault: Fault::Busy, ..
            } => ApiError::PolicyBusy,
            Refusal::Failed { .. } => ApiError::PolicyFailed,
        }
    }
}

/// HTTP status and OpenAI `type` / `code` of an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mapping {
    pub status: StatusCode,
    pub kind: &'static str,
    pub code: Option<&'static str>,
}

impl Mapping {
    /// The error class recorded in audit records and spans: the `code`, else the `type`.
    pub fn error_type(&self) -> &'static str {
        self.code.unwrap_or(self.kind)
    }
}

impl ApiError {
    /// This error's class (see [`Mapping::error_type`]).
    pub fn error_type(&self) -> &'static str {
        mapping(self).error_type()
    }
}

const INVALID_REQUEST: &str = "invalid_request_error";

/// The header by which OpenAI's SDKs are told whether to send a failed request again.
const SHOULD_RETRY: &str = "x-should-retry";

/// The one error table of the API (design.md, "Errors → HTTP").
pub fn mapping(err: &ApiError) -> Mapping {
    let m = |status, kind, code| Mapping { status, kind, code };
    match err {
        ApiError::InvalidApiKey => m(
            StatusCode::UNAUTHORIZED,
            INVALID_REQUEST,
            Some("invalid_api_key"),
        ),
        ApiError::InvalidRequest(_)
        | ApiError::Prompt { .. }
        | ApiError::WorkerInvalidRequest { .. } => {
            m(StatusCode::BAD_REQUEST, INVALID_REQUEST, None)
        }
        ApiError::BodyTooLarge { .. } => m(StatusCode::PAYLOAD_TOO_LARGE, INVALID_REQUEST, None),
        ApiError::BodyUnreadable { .. } => m(StatusCode::BAD_REQUEST, INVALID_REQUEST, None),
        ApiError::ClientClosedBody => m(
            StatusCode::from_u16(CLIENT_CLOSED).expect("499 is a status code"),
            INVALID_REQUEST,
            Some(CLIENT_CLOSED_TYPE),
        ),
        ApiError::ModelNotFound { .. } => m(
            StatusCode::NOT_FOUND,
            INVALID_REQUEST,
            Some("model_not_found"),
        ),
        ApiError::ContextLengthExceeded { .. } | ApiError::WorkerContextLengthExceeded { .. } => m(
            StatusCode::BAD_REQUEST,
            INVALID_REQUEST,
            Some("context_length_exceeded"),
        ),
        // Not a rate: the request is too large for the tenant's limit, whenever it is sent.
        ApiError::TenantLimit(LimitError::OverWholeBudget { .. }) => m(
            StatusCode::BAD_REQUEST,
            INVALID_REQUEST,
            Some("request_too_large"),
        ),
        // The type names the tenant's limit, as OpenAI's `requests` and `tokens` do: a client
        // can tell a wait for a slot from a wait for the minute's budget.
        ApiError::TenantLimit(limit) => m(
            StatusCode::TOO_MANY_REQUESTS,
            match limit {
                LimitError::Concurrency { .. } => "concurrent_requests",
                LimitError::RequestsPerMinute { .. } => "requests",
                LimitError::TokensPerMinute { .. } | LimitError::OverWholeBudget { .. } => "tokens",
            },
            Some("rate_limit_exceeded"),
        ),
        ApiError::WorkerBusy { .. } => m(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_exceeded",
            Some("rate_limit_exceeded"),
        ),
        ApiError::GatewayShutdown => m(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            Some(GATEWAY_SHUTDOWN_TYPE),
        ),
        ApiError::NoHealthyWorker | ApiError::WorkerUnavailable => m(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            Some("service_unavailable"),
        ),
        ApiError::KvIntegrity => m(
            StatusCode::INTERNAL_SERVER_ERROR,
            "kv_integrity_error",
            Some("kv_integrity_error"),
        ),
        // The client was slow: its body did not arrive.
        ApiError::BodyTimeout { .. } => m(
            StatusCode::REQUEST_TIMEOUT,
            INVALID_REQUEST,
            Some("timeout"),
        ),
        // The gateway's side was slow (a queue, a worker or an upstream that did not answer
        // in time): not the client's fault.
        ApiError::Timeout { .. } => m(StatusCode::GATEWAY_TIMEOUT, "server_error", Some("timeout")),
        ApiError::NotFound => m(StatusCode::NOT_FOUND, INVALID_REQUEST, Some("not_found")),
        ApiError::UnsupportedEncoding { .. } => m(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            INVALID_REQUEST,
            Some("unsupported_content_encoding"),
        ),
        ApiError::BadHost { .. } => m(StatusCode::BAD_REQUEST, INVALID_REQUEST, Some("bad_host")),
        ApiError::NoAuditLog { .. } => m(
            StatusCode::NOT_FOUND,
            INVALID_REQUEST,
            Some("tenant_not_found"),
        ),
        ApiError::HttpsRequired => m(
            StatusCode::BAD_REQUEST,
            INVALID_REQUEST,
            Some("https_required"),
        ),
        ApiError::MethodNotAllowed => m(
            StatusCode::METHOD_NOT_ALLOWED,
            INVALID_REQUEST,
            Some("method_not_allowed"),
        ),
        ApiError::AuditUnavailable => m(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            Some("audit_unavailable"),
        ),
        ApiError::PolicyDenied { status, .. } => m(
            StatusCode::from_u16(*status)
                .ok()
                .filter(StatusCode::is_client_error)
                .unwrap_or(StatusCode::FORBIDDEN),
            "policy_denied",
            Some("policy_denied"),
        ),
        ApiError::PolicyFailed => m(
            StatusCode::INTERNAL_SERVER_ERROR,
            "policy_error",
            Some("policy_error"),
        ),
        ApiError::PolicyBusy => m(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_exceeded",
            Some("policy_busy"),
        ),
        ApiError::TemplateBusy => m(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            Some("template_busy"),
        ),
        ApiError::Internal => m(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            Some("internal_error"),
        ),
    }
}

impl ApiError {
    /// The `param` of the error JSON.
    pub fn param(&self) -> Option<String> {
        match self {
            ApiError::InvalidRequest(e) => e.param(),
            ApiError::ModelNotFound { .. } => Some("model".into()),
            ApiError::Prompt { param, .. } => Some((*param).into()),
            ApiError::UnsupportedEncoding { .. } => Some("Content-Encoding".into()),
            ApiError::ContextLengthExceeded { endpoint, .. }
            | ApiError::WorkerContextLengthExceeded { endpoint, .. } => {
                Some(endpoint.prompt_field().into())
            }
            ApiError::InvalidApiKey
            | ApiError::BodyTooLarge { .. }
            | ApiError::BodyUnreadable { .. }
            | ApiError::ClientClosedBody
            | ApiError::BodyTimeout { .. }
            | ApiError::WorkerInvalidRequest { .. }
            | ApiError::TenantLimit(_)
            | ApiError::WorkerBusy { .. }
            | ApiError::NoHealthyWorker
            | ApiError::GatewayShutdown
            | ApiError::WorkerUnavailable
            | ApiError::KvIntegrity
            | ApiError::Timeout { .. }
            | ApiError::NotFound
            | ApiError::NoAuditLog { .. }
            | ApiError::BadHost { .. }
            | ApiError::HttpsRequired
            | ApiError::MethodNotAllowed
            | ApiError::AuditUnavailable
            | ApiError::PolicyDenied { .. }
            | ApiError::PolicyFailed
            | ApiError::PolicyBusy
            | ApiError::TemplateBusy
            | ApiError::Internal => None,
        }
    }

    /// OpenAI's error object, as sent in a body or an SSE error event.
    pub fn body(&self) -> serde_json::Value {
        let Mapping { kind, code, .. } = mapping(self);
        json!({"error": {
            "message": self.to_string(),
            "type": kind,
            "param": self.param(),
            "code": code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let class = mapping(&self);
        let status = class.status;
        let mut response = (
            status,
            [(header::CONTENT_TYPE, "application/json")],
            self.body().to_string(),
        )
            .into_response();
        let wait = match &self {
            ApiError::TenantLimit(e) => retry_after(e),
            // About as long as the request waited for a slot.
            ApiError::PolicyBusy => Some(SLOT_WAIT),
            ApiError::WorkerBusy { retry_after_secs } => {
                Some(Duration::from_secs(*retry_after_secs))
            }
            // Routing is judged again every second or so (health, ejections' ends); a
            // rendering holds the template's sandbox for milliseconds.
            ApiError::NoHealthyWorker | ApiError::WorkerUnavailable | ApiError::TemplateBusy => {
                Some(Duration::from_secs(1))
            }
            _ => None,
        };
        if let Some(wait) = wait
            && let Ok(v) = HeaderValue::from_str(&wait.as_secs().to_string())
        {
            response.headers_mut().insert(header::RETRY_AFTER, v);
        }
        // A policy's refusal is its decision: asked again, the same (OpenAI's SDKs send a 409
        // twice more); its 429 is left to them, as a rate limit's.
        let denied = matches!(self, ApiError::PolicyDenied { .. })
            && status != StatusCode::TOO_MANY_REQUESTS;
        if status == StatusCode::INTERNAL_SERVER_ERROR
            || matches!(self, ApiError::Timeout { .. })
            || denied
        {
            // A 500 is a broken answer, a KV integrity failure or a failed policy: asked again,
            // the same. OpenAI's SDKs retry every 5xx twice unless told not to, which would
            // charge the tenant three times and hide a KV integrity failure behind a 200. A
            // request past the gateway's deadline (a queue's wait ends sooner, as a 429) ran
            // out of it: sent again, it takes the whole deadline again, twice.
            response
                .headers_mut()
                .insert(SHOULD_RETRY, HeaderValue::from_static("false"));
        }
        if status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if status.as_u16() == CLIENT_CLOSED {
            // No canonical phrase for 499 (nginx's code): hyper would write `<none>`. The
            // client's side is closed, so the connection ends here.
            response
                .extensions_mut()
                .insert(hyper::ext::ReasonPhrase::from_static(
                    b"Client Closed Request",
                ));
            response
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        response
            .extensions_mut()
            .insert(ErrorType(class.error_type()));
        response
    }
}

#[cfg(test)]
impl ApiError {
    /// Gateway admission's refusal of 6 prompt tokens and 4 to generate over a limit of 8, on
    /// the chat endpoint.
    pub(crate) fn too_long() -> ApiError {
        ApiError::ContextLengthExceeded {
            exceeded: ContextLengthExceeded {
                requested: 10,
                prompt_tokens: 6,
                max_new_tokens: 4,
                limit: 8,
            },
            endpoint: Endpoint::Chat,
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::tenant::TenantId;

    use super::*;

    fn check(err: ApiError, status: u16, kind: &str, code: Option<&str>) {
        let m = mapping(&err);
        assert_eq!(m.status.as_u16(), status, "{err:?}");
        assert_eq!(m.kind, kind, "{err:?}");
        assert_eq!(m.code, code, "{err:?}");
        let body = err.body();
        assert_eq!(body["error"]["type"], kind);
        assert_eq!(body["error"]["message"], err.to_string());
    }

    #[test]
    fn the_table_matches_the_design() {
        check(
            ApiError::InvalidApiKey,
            401,
            INVALID_REQUEST,
            Some("invalid_api_key"),
        );
        check(
            ApiError::too_long(),
            400,
            INVALID_REQUEST,
            Some("context_length_exceeded"),
        );
        check(
            ApiError::WorkerContextLengthExceeded {
                message: "x".into(),
                endpoint: Endpoint::Completion,
            },
            400,
            INVALID_REQUEST,
            Some("context_length_exceeded"),
        );
        check(
            RequestError::EmptyMessages.into(),
            400,
            INVALID_REQUEST,
            None,
        );
        check(
            LimitError::Concurrency {
                tenant: TenantId::new("t").expect("valid"),
                limit: 1,
            }
            .into(),
            429,
            "concurrent_requests",
            Some("rate_limit_exceeded"),
        );
        check(
            LimitError::RequestsPerMinute {
                tenant: TenantId::new("t").expect("valid"),
                limit: 1,
                retry_after_secs: 3,
            }
            .into(),
            429,
            "requests",
            Some("rate_limit_exceeded"),
        );
        check(
            ApiError::WorkerBusy {
                retry_after_secs: 1,
            },
            429,
            "rate_limit_exceeded",
            Some("rate_limit_exceeded"),
        );
        check(
            ApiError::GatewayShutdown,
            503,
            "service_unavailable",
            Some("gateway_shutdown"),
        );
        check(
            ApiError::NoHealthyWorker,
            503,
            "service_unavailable",
            Some("service_unavailable"),
        );
        check(
            ApiError::KvIntegrity,
            500,
            "kv_integrity_error",
            Some("kv_integrity_error"),
        );
        check(
            ApiError::AuditUnavailable,
            503,
            "service_unavailable",
            Some("audit_unavailable"),
        );
        check(
            ApiError::TemplateBusy,
            503,
            "service_unavailable",
            Some("template_busy"),
        );
        check(ApiError::NotFound, 404, INVALID_REQUEST, Some("not_found"));
        check(
            ApiError::UnsupportedEncoding {
                coding: "gzip".into(),
            },
            415,
            INVALID_REQUEST,
            Some("unsupported_content_encoding"),
        );
        check(
            ApiError::BadHost { count: 2 },
            400,
            INVALID_REQUEST,
            Some("bad_host"),
        );
        check(
            ApiError::NoAuditLog {
                tenant: "nobody".into(),
            },
            404,
            INVALID_REQUEST,
            Some("tenant_not_found"),
        );
        check(
            ApiError::ClientClosedBody,
            499,
            INVALID_REQUEST,
            Some("client_disconnected"),
        );
        check(
            ApiError::HttpsRequired,
            400,
            INVALID_REQUEST,
            Some("https_required"),
        );
        check(
            ApiError::BodyTimeout { secs: 30 },
            408,
            INVALID_REQUEST,
            Some("timeout"),
        );
        check(
            ApiError::Timeout { secs: 300 },
            504,
            "server_error",
            Some("timeout"),
        );
        check(
            ApiError::MethodNotAllowed,
            405,
            INVALID_REQUEST,
            Some("method_not_allowed"),
        );
        check(
            ApiError::PolicyDenied {
                plugin: "p".into(),
                status: 429,
                message: "m".into(),
            },
            429,
            "policy_denied",
            Some("policy_denied"),
        );
        check(
            ApiError::PolicyDenied {
                plugin: "p".into(),
                status: 200,
                message: "m".into(),
            },
            403,
            "policy_denied",
            Some("policy_denied"),
        );
        check(
            ApiError::PolicyFailed,
            500,
            "policy_error",
            Some("policy_error"),
        );
        check(
            ApiError::PolicyBusy,
            429,
            "rate_limit_exceeded",
            Some("policy_busy"),
        );
    }

    #[test]
    fn a_full_policy_sandbox_is_a_retryable_429_and_a_failing_plugin_a_500() {
        let failed = |fault| Refused {
            decisions: Vec::new(),
            refusal: Refusal::Failed {
                plugin: "p".into(),
                fault,
            },
        };
        let busy = ApiError::from(failed(Fault::Busy));
        assert_eq!(busy, ApiError::PolicyBusy);
        let r = busy.into_response();
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
        for fault in [Fault::Timeout, Fault::Memory, Fault::Trap("t".into())] {
            let e = ApiError::from(failed(fault));
            assert_eq!(e, ApiError::PolicyFailed);
            assert!(
                !e.into_response()
                    .headers()
                    .contains_key(header::RETRY_AFTER)
            );
        }
    }

    /// A 503 for want of a worker says when to try again (routing is judged again about every
    /// second); a 500 says nothing of the kind.
    #[test]
    fn no_worker_to_route_to_is_a_503_with_a_retry_after() {
        for e in [
            ApiError::NoHealthyWorker,
            ApiError::WorkerUnavailable,
            ApiError::TemplateBusy,
        ] {
            let r = e.into_response();
            assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
            assert_eq!(r.headers()[header::RETRY_AFTER], "1");
        }
        let r = ApiError::Internal.into_response();
        assert!(!r.headers().contains_key(header::RETRY_AFTER));
    }

    /// OpenAI's SDKs send a 5xx twice more unless `x-should-retry: false` says not to: a 500
    /// or the gateway's own 504 says it, a 503 or a 429 (worth another try) does not.
    #[test]
    fn a_500_or_504_tells_sdks_not_to_retry_and_a_503_or_429_leaves_them_to() {
        for e in [
            ApiError::Internal,
            ApiError::KvIntegrity,
            ApiError::PolicyFailed,
            ApiError::Timeout { secs: 300 },
        ] {
            let r = e.into_response();
            assert!(r.status().is_server_error() && r.status() != 503);
            assert_eq!(r.headers()[SHOULD_RETRY], "false");
        }
        for e in [
            ApiError::NoHealthyWorker,
            ApiError::PolicyBusy,
            ApiError::GatewayShutdown,
            ApiError::TemplateBusy,
        ] {
            assert!(!e.into_response().headers().contains_key(SHOULD_RETRY));
        }
    }

    /// A policy's refusal is not worth sending again, and OpenAI's SDKs send a 409 three
    /// times in all (each read, counted against the tenant's rate and audited); its 429 is
    /// left to them.
    #[test]
    fn a_policys_refusal_tells_sdks_not_to_retry_except_its_429() {
        let denied = |status| ApiError::PolicyDenied {
            plugin: "p".into(),
            status,
            message: "m".into(),
        };
        for status in [400, 403, 409, 422] {
            let r = denied(status).into_response();
            assert_eq!(r.status(), status);
            assert_eq!(r.headers()[SHOULD_RETRY], "false", "{status}");
        }
        let r = denied(429).into_response();
        assert!(!r.headers().contains_key(SHOULD_RETRY));
    }

    #[test]
    fn error_responses_name_their_class_for_the_audit_record() {
        let r = ApiError::KvIntegrity.into_response();
        assert_eq!(
            r.extensions().get::<ErrorType>(),
            Some(&ErrorType("kv_integrity_error"))
        );
        let r = ApiError::from(RequestError::EmptyMessages).into_response();
        assert_eq!(
            r.extensions().get::<ErrorType>(),
            Some(&ErrorType(INVALID_REQUEST))
        );
    }

    #[test]
    fn unauthorized_and_limited_responses_carry_their_headers() {
        let r = ApiError::InvalidApiKey.into_response();
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
        assert!(r.headers().contains_key(header::WWW_AUTHENTICATE));
        let r = ApiError::from(LimitError::RequestsPerMinute {
            tenant: TenantId::new("t").expect("valid"),
            limit: 1,
            retry_after_secs: 17,
        })
        .into_response();
        assert_eq!(r.headers()[header::RETRY_AFTER], "17");
        // Larger than the whole budget: no wait admits it, so no Retry-After and no 429.
        let r = ApiError::from(LimitError::OverWholeBudget {
            tenant: TenantId::new("t").expect("valid"),
            limit: 400,
            needed: 531,
        })
        .into_response();
        assert_eq!(r.status(), StatusCode::BAD_REQUEST);
        assert!(!r.headers().contains_key(header::RETRY_AFTER));
        assert_eq!(
            r.extensions().get::<ErrorType>(),
            Some(&ErrorType("request_too_large"))
        );
    }

    #[test]
    fn internal_errors_say_nothing_more() {
        assert_eq!(ApiError::Internal.to_string(), "internal error");
        assert_eq!(
            ApiError::WorkerUnavailable.body()["error"]["param"],
            serde_json::Value::Null
        );
    }
}
