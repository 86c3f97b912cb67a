//! The admin HTTP port: `/metrics` (Prometheus text) and `/healthz`.

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use super::actor::EngineHandle;

/// The admin routes over `engine`.
pub fn router(engine: EngineHandle) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .with_state(engine)
}

async fn metrics(State(engine): State<EngineHandle>) -> Response {
    match engine.stats().await {
        Ok(stats) => (
            [(
                header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            engine.metrics().render(&stats),
        )
            .into_response(),
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            "the engine is not running\n",
        )
            .into_response(),
    }
}

async fn healthz(State(engine): State<EngineHandle>) -> Response {
    match engine.stats().await {
        Ok(_) => (StatusCode::OK, "ok\n").into_response(),
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            "the engine is not running\n",
        )
            .into_response(),
    }
}
