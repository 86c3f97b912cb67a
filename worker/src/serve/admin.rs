//! The admin HTTP port: `/metrics` (Prometheus text), `/healthz` (the engine runs: liveness)
//! and `/readyz` (the deployment check, invariant I7: the pages in service hold the whole
//! context this worker serves; quarantined pages are out of service, so a worker whose
//! quarantine has eaten into a full-context request's pages stops being ready).

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use super::actor::{EngineHandle, EngineStats};
use super::tls::{ClusterTls, render_expiry};

/// What the admin routes read.
#[derive(Clone)]
struct Admin {
    engine: EngineHandle,
    /// The deployment's mutual TLS, when on: its certificate's expiry is a metric.
    tls: Option<ClusterTls>,
}

/// The admin routes over `engine` (and the worker's TLS, `tls`).
pub fn router(engine: EngineHandle, tls: Option<ClusterTls>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(Admin { engine, tls })
}

/// Always answered: with the engine gone or stuck in one step, its gauges are left out and
/// `bulkhead_engine_up` says 0, while the counters kept beside it (requests by outcome, gRPC
/// connections) are what tells an operator what happened.
async fn metrics(State(Admin { engine, tls }): State<Admin>) -> Response {
    let stats = engine.stats().await.ok();
    let mut text = engine.metrics().render(stats.as_ref());
    if let Some(tls) = tls {
        render_expiry(&mut text, &[("cluster", tls.validity())]);
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

async fn healthz(State(Admin { engine, .. }): State<Admin>) -> Response {
    match engine.stats().await {
        Ok(_) => (StatusCode::OK, "ok\n").into_response(),
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, format!("{e}\n")).into_response(),
    }
}

async fn readyz(State(Admin { engine, .. }): State<Admin>) -> Response {
    match engine.stats().await {
        Ok(stats) => match readiness(&stats) {
            Ok(ready) => (StatusCode::OK, format!("ready: {ready}\n")).into_response(),
            Err(not) => (
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not ready: {not}\n"),
            )
                .into_response(),
        },
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {e}\n")).into_response(),
    }
}

/// The tokens the pages in service hold against the context this worker serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "{in_service_tokens} tokens in service ({quarantined_pages} pages quarantined) for a served \
     context of {served_context} tokens"
)]
pub struct PoolCoverage {
    pub in_service_tokens: u64,
    pub quarantined_pages: u32,
    pub served_context: u64,
}

/// `Ok` when the pages in service hold the served context; `Err` (not ready) otherwise.
pub fn readiness(stats: &EngineStats) -> Result<PoolCoverage, PoolCoverage> {
    let in_service_pages = stats.pool.total.saturating_sub(stats.pool.quarantined);
    let coverage = PoolCoverage {
        in_service_tokens: u64::from(in_service_pages)
            .saturating_mul(u64::from(stats.capacity.page_tokens)),
        quarantined_pages: stats.pool.quarantined,
        served_context: stats.capacity.served_context as u64,
    };
    if coverage.in_service_tokens >= coverage.served_context {
        Ok(coverage)
    } else {
        Err(coverage)
    }
}

#[cfg(test)]
mod tests {
    use bulkhead_kvpool::PoolStats;

    use super::*;
    use crate::engine::{Capacity, PrefixStats, TransferStats};

    /// 10 pages of 16 tokens serving `served_context`, `quarantined` of them out of service.
    fn stats(served_context: usize, quarantined: u32) -> EngineStats {
        EngineStats {
            pool: PoolStats {
                total: 10,
                free: 10 - quarantined,
                quarantined,
                ..PoolStats::default()
            },
            waiting: 0,
            running: 0,
            transfers: TransferStats::default(),
            prefix: PrefixStats::default(),
            capacity: Capacity {
                token_bytes: 256,
                pool_pages: 10,
                page_tokens: 16,
                pool_tokens: 160,
                page_bytes: 4096,
                model_context: 8192,
                served_context,
            },
        }
    }

    #[test]
    fn a_pool_that_holds_the_served_context_is_ready() {
        assert!(readiness(&stats(160, 0)).is_ok());
        assert!(readiness(&stats(128, 2)).is_ok());
    }

    #[test]
    fn a_pool_smaller_than_the_served_context_is_not_ready() {
        // The incident's shape: more context served than the pool holds.
        let not = readiness(&stats(1024, 0)).expect_err("160 tokens < 1024");
        assert_eq!(not.in_service_tokens, 160);
        assert!(not.to_string().contains("served context of 1024"), "{not}");
        // Quarantine takes pages out of service: a full-context request no longer fits.
        let not = readiness(&stats(160, 1)).expect_err("144 tokens < 160");
        assert_eq!((not.in_service_tokens, not.quarantined_pages), (144, 1));
    }
}
