//! The two middleware of the trail: `audited` (outermost: one trail per request, committed
//! when the response is ready unless a stream takes that over) and `account` (inside auth:
//! the tenant and key id on the trail, the tenant's limits on the response).

use axum::extract::{MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http::header::HOST;
use http::{HeaderValue, Version};

use crate::api::{ApiError, ErrorType, Streamed};
use crate::auth::Authenticated;
use crate::limits::Limiter;

use super::{Recorder, Trail};

/// The response header that carries the request's id (the id in its audit record).
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// A fresh request id: 24 random hex digits after `req-`.
pub(super) fn request_id() -> String {
    format!(
        "req-{:016x}{:08x}",
        rand::random::<u64>(),
        rand::random::<u32>()
    )
}

/// Gives every request a [`Trail`] and commits it when the response is ready (a streamed
/// response commits it itself, before its `[DONE]`). While the log is broken and configured
/// to refuse, requests are turned away before anything else runs.
pub async fn audited(
    State(recorder): State<Recorder>,
    mut request: Request,
    next: Next,
) -> Response {
    if recorder.refusing() {
        return recorder.refuse_unrecorded();
    }
    let id = request_id();
    // Inside `traced`: the current span is the request's.
    let trail = recorder.trail(id.clone(), tracing::Span::current());
    if let Some(path) = request.extensions().get::<MatchedPath>() {
        trail.route(path.as_str());
    }
    request.extensions_mut().insert(trail.clone());
    // Exactly one Host (RFC 9112 §3.2; HTTP/1.0 may send none): with none or two, the host a
    // proxy in front routed by and the one seen here may differ.
    let hosts = request.headers().get_all(HOST).iter().count();
    let mut response = if hosts > 1 || (hosts == 0 && request.version() == Version::HTTP_11) {
        ApiError::BadHost { count: hosts }.into_response()
    } else {
        next.run(request).await
    };
    if let Ok(v) = HeaderValue::from_str(&id) {
        response.headers_mut().insert(REQUEST_ID_HEADER, v);
    }
    let status = response.status().as_u16();
    if response.extensions().get::<Streamed>().is_some() {
        trail.responded(status);
        return response;
    }
    let error_type = response.extensions().get::<ErrorType>().map(|e| e.0);
    match trail.finish(status, error_type).await {
        Ok(()) => response,
        Err(refused) => refused.into_response(),
    }
}

/// Puts the authenticated tenant on the request's trail (whose record counts the request in
/// the tenant's metrics, whichever way it ends) and tells the client its per-minute limits'
/// state (`x-ratelimit-*`).
pub async fn account(State(limiter): State<Limiter>, request: Request, next: Next) -> Response {
    let tenant = request.extensions().get::<Authenticated>().map(|who| {
        if let Some(trail) = request.extensions().get::<Trail>() {
            trail.authenticated(who);
        }
        who.tenant.clone()
    });
    let mut response = next.run(request).await;
    if let Some(tenant) = tenant {
        limiter.rate_limits(&tenant).write(response.headers_mut());
    }
    response
}
