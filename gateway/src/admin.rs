//! The admin listener (its own port, its own bearer token): `/healthz`, `/metrics`
//! (Prometheus text), `/workers` (what each worker reported, and why it is or is not routed to),
//! `/audit/{tenant}` (any tenant's audit records, and `_gateway` for unauthenticated requests).

use std::sync::Arc;

use axum::Router;
use axum::extract::{FromRef, Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use http::StatusCode;
use http::header::{AUTHORIZATION, CONTENT_TYPE};
use serde_json::json;

use crate::keys::KeyHash;
use crate::metrics::Metrics;
use crate::tenant::Tenant;
use crate::trail::{self, Recorder};
use crate::workers::Workers;

/// What the admin handlers read.
#[derive(Debug, Clone)]
pub struct AdminState {
    pub workers: Workers,
    pub metrics: Metrics,
    pub tenants: Arc<Vec<Arc<Tenant>>>,
    pub recorder: Recorder,
}

impl FromRef<AdminState> for Recorder {
    fn from_ref(state: &AdminState) -> Recorder {
        state.recorder.clone()
    }
}

/// The admin router; every path needs `Authorization: Bearer <admin token>`.
pub fn router(state: AdminState, token: KeyHash) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .route("/workers", get(workers))
        .route("/audit/{tenant}", get(trail::admin_read))
        .with_state(state)
        .layer(middleware::from_fn_with_state(token, require_token))
}

async fn require_token(State(token): State<KeyHash>, request: Request, next: Next) -> Response {
    let given = request
        .headers()
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, key)| KeyHash::of(key.trim()));
    if given == Some(token) {
        next.run(request).await
    } else {
        (
            StatusCode::UNAUTHORIZED,
            [(CONTENT_TYPE, "application/json")],
            json!({"error": {"message": "the admin listener needs `Authorization: Bearer <admin token>`",
                             "type": "invalid_request_error", "param": null, "code": "invalid_api_key"}})
            .to_string(),
        )
            .into_response()
    }
}

async fn healthz(State(state): State<AdminState>) -> Response {
    let reports = state.workers.reports();
    let routable = reports.iter().filter(|w| w.routable).count();
    let model = state.workers.model().map(|m| m.name.clone());
    let audit_failure = state.recorder.failure();
    let (status, word) = if state.recorder.refusing() {
        (StatusCode::SERVICE_UNAVAILABLE, "audit_unavailable")
    } else if routable == 0 {
        (StatusCode::SERVICE_UNAVAILABLE, "no_routable_worker")
    } else {
        (StatusCode::OK, "ok")
    };
    let body = json!({
        "status": word,
        "model": model,
        "routable_workers": routable,
        "workers": reports.len(),
        "audit": {
            "ok": audit_failure.is_none(),
            "failure": audit_failure,
            "lost_records": state.recorder.lost(),
        },
    });
    (
        status,
        [(CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

async fn metrics(State(state): State<AdminState>) -> Response {
    (
        [(CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(&state.tenants, &state.workers),
    )
        .into_response()
}

async fn workers(State(state): State<AdminState>) -> Response {
    let body = json!({"workers": state.workers.reports()});
    ([(CONTENT_TYPE, "application/json")], body.to_string()).into_response()
}
