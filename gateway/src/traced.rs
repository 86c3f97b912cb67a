//! The request's span: the outermost middleware of the API. It continues the client's W3C
//! trace context (`traceparent`) when there is one, so the gateway's spans — and through the
//! gRPC metadata the workers' — join the caller's trace.
//!
//! ```text
//!  POST /v1/chat/completions  (server; bulkhead.request.id, tenant, model, tokens, status)
//!  ├─ auth            key → tenant
//!  ├─ tokenize        the worker's chat template and tokenizer
//!  ├─ admission       prompt + max tokens against the effective limit (again after a clamp)
//!  ├─ policy          the plugin chain
//!  ├─ route           least outstanding tokens
//!  ├─ bulkhead.worker.v1.Worker/Generate  (client; its context goes to the worker)
//!  └─ stream          the response to the client, JSON or SSE
//! ```
//!
//! No span holds tenant content: ids, token counts, statuses and error classes only (the
//! prompt's and completion's digests are in the audit record).

use axum::extract::{MatchedPath, Request};
use axum::middleware::Next;
use axum::response::Response;
use tracing::Instrument as _;
use tracing::field::Empty;

/// Runs the request inside its span and records the response's status on it. The trail
/// (inside) records the request's facts and outcome, and keeps the span open until the
/// audit record is sealed — after the last byte of a stream.
pub async fn traced(request: Request, next: Next) -> Response {
    let method = request.method().as_str();
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map(MatchedPath::as_str);
    let span = tracing::info_span!(
        "request",
        otel.name = Empty,
        otel.kind = "server",
        otel.status_code = Empty,
        http.request.method = method,
        http.route = route,
        http.response.status_code = Empty,
        bulkhead.request.id = Empty,
        bulkhead.tenant.id = Empty,
        gen_ai.request.model = Empty,
        gen_ai.usage.input_tokens = Empty,
        gen_ai.usage.output_tokens = Empty,
        error.type = Empty,
    );
    // The name is built only for a span someone records (no allocation otherwise).
    if !span.is_disabled() {
        match route {
            Some(route) => span.record("otel.name", format!("{method} {route}")),
            None => span.record("otel.name", method),
        };
    }
    bulkhead_telemetry::propagation::continue_trace(&span, request.headers());
    let response = next.run(request).instrument(span.clone()).await;
    let status = response.status();
    span.record("http.response.status_code", status.as_u16());
    if status.is_server_error() {
        span.record("otel.status_code", "ERROR");
    }
    response
}
