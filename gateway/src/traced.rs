//! The request's span: the outermost middleware of the API. A client's W3C trace context
//! (`traceparent`) is linked to (`[telemetry] client_trace = "link"`, the default: the
//! request's trace is the gateway's own), or continued when sampled (`"continue"`: the
//! gateway's spans — and through the gRPC metadata the workers' — join the caller's trace).
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

use axum::extract::{MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::Response;
use bulkhead_telemetry::propagation;
use tracing::Instrument as _;

use crate::config::ClientTrace;
use tracing::field::Empty;

/// Runs the request inside its span and records the response's status on it. The trail
/// (inside) records the request's facts and outcome, and keeps the span open until the
/// audit record is sealed — after the last byte of a stream.
pub async fn traced(
    State(client_trace): State<ClientTrace>,
    request: Request,
    next: Next,
) -> Response {
    let method = method_name(request.method());
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
        let named = if method == OTHER { "HTTP" } else { method };
        match route {
            Some(route) => span.record("otel.name", format!("{named} {route}")),
            None => span.record("otel.name", named),
        };
    }
    match client_trace {
        ClientTrace::Link => propagation::link_client_trace(&span, request.headers()),
        ClientTrace::Continue => propagation::continue_client_trace(&span, request.headers()),
    }
    let response = next.run(request).instrument(span.clone()).await;
    let status = response.status();
    // As an integer: an unsigned field reaches OpenTelemetry from `tracing` as text.
    span.record("http.response.status_code", i64::from(status.as_u16()));
    if status.is_server_error() {
        span.record("otel.status_code", "ERROR");
    }
    response
}

/// What OpenTelemetry's HTTP conventions call a method outside the standard ones.
const OTHER: &str = "_OTHER";

/// The request's method as OpenTelemetry's HTTP conventions name it: one of the nine standard
/// methods, or `_OTHER` — a client's own method token (any token, before authentication) would
/// make each span's name and method its own, without bound.
fn method_name(method: &http::Method) -> &'static str {
    use http::Method;
    match *method {
        Method::GET => "GET",
        Method::HEAD => "HEAD",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::CONNECT => "CONNECT",
        Method::OPTIONS => "OPTIONS",
        Method::TRACE => "TRACE",
        Method::PATCH => "PATCH",
        _ => OTHER,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_method_outside_the_standard_ones_is_named_other() {
        assert_eq!(method_name(&http::Method::POST), "POST");
        assert_eq!(method_name(&http::Method::PATCH), "PATCH");
        let own = http::Method::from_bytes(b"ZZZ-abc123").expect("a token");
        assert_eq!(method_name(&own), OTHER);
    }
}
