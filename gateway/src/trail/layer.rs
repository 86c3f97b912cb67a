//! The two middleware of the trail: `audited` (outermost: one trail per request, committed
//! when the response is ready unless a stream takes that over) and `account` (inside auth:
//! the tenant and key id on the trail, the request in the tenant's metrics).

use axum::extract::{MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http::header::HOST;
use http::{HeaderValue, Version};

use crate::api::{ApiError, ErrorType, Streamed};
use crate::auth::Authenticated;
use crate::limits::Limiter;
use crate::metrics::Metrics;

use super::{CLIENT_CLOSED, Recorder, Trail};

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
        return ApiError::AuditUnavailable.into_response();
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

/// What [`account`] counts with: the metrics, and the limiter whose state it tells the client.
#[derive(Debug, Clone)]
pub struct Accounts {
    pub metrics: Metrics,
    pub limiter: Limiter,
}

/// Puts the authenticated tenant on the request's trail, counts the request in the tenant's
/// metrics by final status, and tells the client its per-minute limits' state
/// (`x-ratelimit-*`).
pub async fn account(State(accounts): State<Accounts>, request: Request, next: Next) -> Response {
    let who = request.extensions().get::<Authenticated>().cloned();
    if let (Some(trail), Some(who)) = (request.extensions().get::<Trail>(), &who) {
        trail.authenticated(who);
    }
    let Accounts { metrics, limiter } = accounts;
    let tenant = who.as_ref().map(|who| who.tenant.clone());
    let count = who.map(|who| Count {
        metrics,
        who: Some(who),
    });
    let mut response = next.run(request).await;
    if let Some(count) = count {
        count.status(response.status().as_u16());
    }
    if let Some(tenant) = tenant {
        limiter.rate_limits(&tenant).write(response.headers_mut());
    }
    response
}

/// A request's count in its tenant's metrics, made once: by the status of its response, or,
/// when the client left before there was one (the request's future is dropped and no status
/// ever comes), as 499 — as its audit record says.
struct Count {
    metrics: Metrics,
    /// `None` once counted.
    who: Option<Authenticated>,
}

impl Count {
    fn status(mut self, status: u16) {
        if let Some(who) = self.who.take() {
            self.metrics.request(&who.tenant.id, status);
        }
    }
}

impl Drop for Count {
    fn drop(&mut self) {
        if let Some(who) = self.who.take() {
            self.metrics.request(&who.tenant.id, CLIENT_CLOSED);
        }
    }
}
