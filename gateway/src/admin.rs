//! The admin listener (its own port, its own bearer token): `/healthz`, `/metrics`
//! (Prometheus text), `/workers` (what each worker reported, and why it is or is not routed to),
//! `/audit/{tenant}` (any tenant's audit records, and `_gateway` for unauthenticated requests).
//! `/policies` (the active policy set; `POST /policies/reload` loads the file again and swaps
//! it in only when valid). `/tenants` (ids, limits, key ids; `POST /tenants/reload` reads the
//! configuration file again and swaps its tenants in only when it is valid, see
//! [`crate::tenants`]).

use axum::Router;
use axum::extract::{FromRef, Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bulkhead_worker::serve::tls::{ClusterTls, ListenerTls, render_expiry};
use http::StatusCode;
use http::header::CONTENT_TYPE;
use serde_json::json;

use crate::keys::KeyHash;
use crate::metrics::Metrics;
use crate::policy::Policies;
use crate::tenants::{ReloadError, Tenants};
use crate::trail::{self, Recorder};
use crate::workers::Workers;

/// What the admin handlers read.
#[derive(Debug, Clone)]
pub struct AdminState {
    pub workers: Workers,
    pub metrics: Metrics,
    pub tenants: Tenants,
    pub recorder: Recorder,
    pub policies: Policies,
    /// The listeners' TLS, when on (its handshake counts and its certificate's expiry are
    /// metrics).
    pub tls: Option<ListenerTls>,
    /// The deployment's mutual TLS, when on (its certificate's expiry is a metric).
    pub cluster_tls: Option<ClusterTls>,
}

impl FromRef<AdminState> for Tenants {
    fn from_ref(state: &AdminState) -> Tenants {
        state.tenants.clone()
    }
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
        .route("/policies", get(policies))
        .route("/policies/reload", post(reload_policies))
        .route("/tenants", get(tenants))
        .route("/tenants/reload", post(reload_tenants))
        .with_state(state)
        .layer(middleware::from_fn_with_state(token, require_token))
}

async fn require_token(State(token): State<KeyHash>, request: Request, next: Next) -> Response {
    if crate::auth::bearer_key(request.headers()) == Some(token) {
        next.run(request).await
    } else {
        json_reply(
            StatusCode::UNAUTHORIZED,
            &json!({"error": {"message": "the admin listener needs `Authorization: Bearer <admin token>`",
                              "type": "invalid_request_error", "param": null, "code": "invalid_api_key"}}),
        )
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
    json_reply(status, &body)
}

async fn metrics(State(state): State<AdminState>) -> Response {
    let tenants = state.tenants.current();
    // A tenant a reload removed leaves no series behind (its counts are kept, should it come
    // back); the gateway log's stay.
    let configured: std::collections::HashSet<&str> =
        tenants.tenants().map(|t| t.id.as_str()).collect();
    let keep = |tenant: &str| configured.contains(tenant) || tenant == crate::trail::GATEWAY_LOG;
    let mut text = state.metrics.render(&tenants, &state.workers, &keep);
    state.policies.render_metrics(&mut text, &keep);
    if let Some(tls) = &state.tls {
        crate::metrics::render_handshakes(&mut text, tls.handshakes());
    }
    let certificates: Vec<_> = [
        state.tls.as_ref().map(|t| ("listen", t.validity())),
        state
            .cluster_tls
            .as_ref()
            .map(|t| ("cluster", t.validity())),
    ]
    .into_iter()
    .flatten()
    .collect();
    render_expiry(&mut text, &certificates);
    state.tenants.render_metrics(&mut text);
    ([(CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

async fn policies(State(state): State<AdminState>) -> Response {
    json_reply(StatusCode::OK, &policy_status(&state))
}

/// What `/policies` shows: the active set, the last refused reload, and a warning for every
/// tenant a binding names that the tenants file does not (the binding never applies to it:
/// a typo, or a tenant since removed) and for every plugin whose schema is not pinned.
fn policy_status(state: &AdminState) -> serde_json::Value {
    let mut status = state.policies.status();
    let mut warnings = stray_tenants(&state.policies, &state.tenants);
    warnings.extend(state.policies.current().unpinned_schemas());
    status["warnings"] = json!(warnings);
    status
}

/// A line for every tenant a binding of the active policy set names that `tenants` does not
/// list.
pub fn stray_tenants(policies: &Policies, tenants: &Tenants) -> Vec<String> {
    let set = tenants.current();
    let known: std::collections::HashSet<&str> = set.tenants().map(|t| t.id.as_str()).collect();
    policies
        .current()
        .summary()
        .into_iter()
        .enumerate()
        .flat_map(|(index, binding)| {
            let plugin = binding.plugin;
            binding
                .tenants
                .into_iter()
                .flatten()
                .filter(|t| !known.contains(t.as_str()))
                .map(move |t| {
                    format!(
                        "chain[{index}] ({plugin}): tenant {t:?} is not in the tenants file; \
                         the binding never applies to it"
                    )
                })
        })
        .collect()
}

/// 200 with the new set, or 422 with why it was refused (the previous set stays active).
async fn reload_policies(State(state): State<AdminState>) -> Response {
    let policies = state.policies.clone();
    let result = match off_thread(move || policies.reload().map(|_| ())).await {
        Ok(result) => result,
        Err(failed) => return failed,
    };
    let (status, body) = match result {
        Ok(()) => (
            StatusCode::OK,
            json!({"reloaded": true, "policies": policy_status(&state)}),
        ),
        Err(e) => (
            StatusCode::UNPROCESSABLE_ENTITY,
            json!({"reloaded": false, "error": e.to_string(), "policies": policy_status(&state)}),
        ),
    };
    json_reply(status, &body)
}

async fn tenants(State(state): State<AdminState>) -> Response {
    json_reply(StatusCode::OK, &state.tenants.status())
}

/// 200 with what changed (and the sections that need a restart), or why nothing did: 422 for
/// a file that does not validate, 409 with no file to read; the running set stays.
async fn reload_tenants(State(state): State<AdminState>) -> Response {
    let tenants = state.tenants.clone();
    let result = match off_thread(move || tenants.reload()).await {
        Ok(result) => result,
        Err(failed) => return failed,
    };
    let names = |ids: &[crate::tenant::TenantId]| -> Vec<String> {
        ids.iter().map(ToString::to_string).collect()
    };
    let (status, body) = match result {
        Ok(r) => (
            StatusCode::OK,
            json!({
                "reloaded": true,
                "added": names(&r.added),
                "removed": names(&r.removed),
                "changed": names(&r.changed),
                "restart_required": r.restart_required.iter().map(|s| s.name()).collect::<Vec<_>>(),
                "reused": names(&r.reused),
                "renamed": r.renamed.iter().map(|(from, to)| json!({"from": from.as_str(), "to": to.as_str()})).collect::<Vec<_>>(),
                "tenants": state.tenants.status(),
            }),
        ),
        Err(e) => {
            let status = match e {
                ReloadError::NoFile => StatusCode::CONFLICT,
                ReloadError::Invalid(_) | ReloadError::ReusedId(_) => {
                    StatusCode::UNPROCESSABLE_ENTITY
                }
                ReloadError::Served(_) => StatusCode::INTERNAL_SERVER_ERROR,
            };
            (
                status,
                json!({"reloaded": false, "error": e.to_string(), "tenants": state.tenants.status()}),
            )
        }
    };
    json_reply(status, &body)
}

/// Runs a reload (it reads files and may compile components) off the async threads; a task
/// that failed is answered 500.
async fn off_thread<T: Send + 'static>(
    reload: impl FnOnce() -> T + Send + 'static,
) -> Result<T, Response> {
    tokio::task::spawn_blocking(reload).await.map_err(|_| {
        json_reply(
            StatusCode::INTERNAL_SERVER_ERROR,
            &json!({"reloaded": false, "error": "the reload task failed"}),
        )
    })
}

/// `body` as a JSON response with `status`.
fn json_reply(status: StatusCode, body: &serde_json::Value) -> Response {
    (
        status,
        [(CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

async fn workers(State(state): State<AdminState>) -> Response {
    let workers = &state.workers;
    json_reply(
        StatusCode::OK,
        &json!({
            "access": workers.access(),
            "workers": workers.reports(),
            "groups": workers.lookups(),
        }),
    )
}
