//! The trail in process: every entry of the error table, a success and an abandoned request
//! each leave exactly one record; a broken log turns requests away.

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Extension, Path};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use bulkhead_audit::{AuditRecord, DisconnectPhase, Seq, TenantId};
use http::{Request, StatusCode};
use tower::ServiceExt as _;

use super::{CLIENT_CLOSED_TYPE, GATEWAY_LOG, GATEWAY_SHUTDOWN_TYPE, Recorder, Trail, audited};
use crate::api::validate::RequestError;
use crate::api::{ApiError, Endpoint, mapping};
use crate::config::{AuditSettings, Durability, OnAuditFailure};
use crate::limits::LimitError;
use crate::metrics::Metrics;
use crate::scratch::Scratch;
use crate::tenants::ServedFile;

/// Every error of the API's table, by index.
fn table() -> Vec<ApiError> {
    vec![
        ApiError::InvalidApiKey,
        RequestError::EmptyMessages.into(),
        ApiError::BodyTooLarge { limit: 1 },
        ApiError::ModelNotFound {
            asked: "a".into(),
            served: "b".into(),
        },
        ApiError::Prompt {
            reason: "r".into(),
            param: "prompt",
        },
        ApiError::too_long(),
        ApiError::WorkerContextLengthExceeded {
            message: "m".into(),
            endpoint: Endpoint::Chat,
        },
        ApiError::WorkerInvalidRequest {
            message: "m".into(),
        },
        LimitError::Concurrency {
            tenant: TenantId::new("t").expect("valid"),
            limit: 1,
        }
        .into(),
        ApiError::WorkerBusy {
            retry_after_secs: 1,
        },
        ApiError::NoHealthyWorker,
        ApiError::WorkerUnavailable,
        ApiError::KvIntegrity,
        ApiError::Timeout { secs: 1 },
        ApiError::NotFound,
        ApiError::AuditUnavailable,
        ApiError::PolicyDenied {
            plugin: "p".into(),
            status: 403,
            message: "m".into(),
        },
        ApiError::PolicyFailed,
        ApiError::PolicyBusy,
        ApiError::TemplateBusy,
        ApiError::Internal,
        ApiError::BodyTimeout { secs: 1 },
    ]
}

async fn fail(Path(i): Path<usize>, Extension(trail): Extension<Trail>) -> Response {
    let e = table().swap_remove(i);
    trail.failed(&e, None);
    e.into_response()
}

async fn ok() -> &'static str {
    "fine"
}

fn app(recorder: &Recorder) -> Router {
    Router::new()
        .route("/fail/{i}", get(fail))
        .route("/ok", get(ok))
        .layer(middleware::from_fn_with_state(recorder.clone(), audited))
}

async fn call(app: &Router, path: &str) -> Response {
    let request = Request::get(path)
        .header(http::header::HOST, "t")
        .body(Body::empty())
        .expect("request");
    app.clone().oneshot(request).await.expect("infallible")
}

fn records(recorder: &Recorder) -> Vec<AuditRecord> {
    recorder.flush().expect("flush");
    let gateway = TenantId::new(GATEWAY_LOG).expect("valid");
    recorder
        .read(&gateway, Seq(0), 1000)
        .expect("read")
        .into_iter()
        .map(|s| s.record)
        .collect()
}

/// A recorder over `dir` with these settings.
fn open(dir: &Scratch, durability: Durability, on_failure: OnAuditFailure) -> Recorder {
    open_with(
        dir,
        AuditSettings {
            durability,
            on_failure,
            ..AuditSettings::default()
        },
    )
}

fn open_with(dir: &Scratch, settings: AuditSettings) -> Recorder {
    Recorder::open(&dir.0, settings, None, Metrics::default(), None)
        .expect("opens")
        .0
}

/// A recorder whose gateway log takes `per_minute` records of its own a minute.
fn with_budget(dir: &Scratch, per_minute: u64) -> Recorder {
    open_with(
        dir,
        AuditSettings {
            gateway_records_per_minute: per_minute,
            ..AuditSettings::default()
        },
    )
}

/// `n` requests without a key (401), and their request ids.
async fn unauthenticated(app: &Router, n: usize) -> Vec<String> {
    let mut ids = Vec::new();
    for _ in 0..n {
        let r = call(app, "/fail/0").await;
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
        ids.push(
            r.headers()["x-request-id"]
                .to_str()
                .expect("ascii")
                .to_owned(),
        );
    }
    ids
}

/// A flood of requests with no tenant to charge costs the disk one record per window past the
/// gateway log's budget, and every request is still counted: its own record, or its place in
/// a folded one. (Without the budget — one past the flood — each has its own record.)
#[tokio::test]
async fn requests_with_no_tenant_past_the_budget_are_folded_and_each_is_counted_once() {
    let dir = Scratch::new("trail");
    let recorder = with_budget(&dir, 5);
    let ids = unauthenticated(&app(&recorder), 40).await;
    let got = records(&recorder);
    let own: Vec<&str> = got
        .iter()
        .filter(|r| r.folded.is_none())
        .map(|r| r.request_id.as_str())
        .collect();
    assert_eq!(own, ids[..5], "the budget's five, each alone");
    let folded: Vec<&bulkhead_audit::Folded> =
        got.iter().filter_map(|r| r.folded.as_ref()).collect();
    assert!(!folded.is_empty() && folded.len() < 35, "{folded:#?}");
    assert_eq!(folded.iter().map(|f| f.requests).sum::<u64>(), 35);
    assert_eq!(folded[0].first_request_id, ids[5]);
    assert_eq!(folded[folded.len() - 1].last_request_id, ids[39]);
    for (f, record) in folded.iter().zip(got.iter().filter(|r| r.folded.is_some())) {
        assert_eq!(f.statuses.len(), 1, "{f:#?}");
        assert_eq!(
            (f.statuses[0].status, f.statuses[0].requests),
            (401, f.requests)
        );
        assert_eq!(record.status, 0);
        assert!(record.prompt_sha256.is_none() && record.key_id.is_empty());
    }

    let dir = Scratch::new("trail");
    let unbounded = with_budget(&dir, 1000);
    unauthenticated(&app(&unbounded), 40).await;
    let got = records(&unbounded);
    assert_eq!(got.len(), 40);
    assert!(got.iter().all(|r| r.folded.is_none()));
}

/// The gateway log's budget is its own: a tenant's requests dropped before their key was
/// read count against the tenant's budget (here far from spent: each has its record), not the
/// gateway's; and the gateway log's folded record goes out once its window has passed, though
/// the next records are another log's.
#[tokio::test]
async fn the_gateway_logs_budget_is_its_own_and_its_folded_record_goes_out_in_time() {
    use hyper::service::Service as _;
    use hyper_util::service::TowerToHyperService;

    let dir = Scratch::new("trail");
    let recorder = with_budget(&dir, 1);
    let app = app(&recorder);
    unauthenticated(&app, 3).await;
    tokio::time::sleep(super::fold::WINDOW).await;
    let watch = super::Watch::new(TowerToHyperService::new(app), recorder.clone(), tenants());
    for _ in 0..3 {
        let request = Request::builder()
            .header(http::header::HOST, "t")
            .uri("/v1/chat/completions")
            .header(http::header::AUTHORIZATION, "Bearer sk-a")
            .body(Body::empty())
            .expect("a request");
        drop(watch.call(request));
    }
    let gateway = TenantId::new(GATEWAY_LOG).expect("valid");
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let folded = loop {
        let read = recorder.read(&gateway, Seq(0), 10).expect("reads");
        if let Some(f) = read.iter().find_map(|s| s.record.folded.clone()) {
            break f;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no folded record: {read:#?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(folded.requests, 2);
    let tenant = TenantId::new("tenant-a").expect("valid");
    recorder.flush().expect("flush");
    let mine = recorder.read(&tenant, Seq(0), 10).expect("reads");
    assert_eq!(mine.len(), 3, "{mine:#?}");
    assert!(mine.iter().all(|s| s.record.folded.is_none()));
}

/// A flood that stops leaves its folded record on disk a window later, though no other
/// record comes to carry it out (it once waited for the next request, however late).
#[tokio::test]
async fn a_folded_record_is_written_once_its_window_has_passed_with_no_record_after_it() {
    let dir = Scratch::new("trail");
    let recorder = with_budget(&dir, 1);
    let ids = unauthenticated(&app(&recorder), 4).await;
    let gateway = TenantId::new(GATEWAY_LOG).expect("valid");
    let started = std::time::Instant::now();
    let folded = loop {
        let read = recorder.read(&gateway, Seq(0), 10).expect("reads");
        if let Some(f) = read.iter().find_map(|s| s.record.folded.clone()) {
            break f;
        }
        assert!(
            started.elapsed() < 5 * super::fold::WINDOW,
            "no folded record: {read:#?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(folded.requests, 3);
    assert_eq!(folded.first_request_id, ids[1]);
    assert_eq!(folded.last_request_id, ids[3]);
}

#[tokio::test]
async fn every_entry_of_the_error_table_leaves_exactly_one_record() {
    let dir = Scratch::new("trail");
    let recorder = open(&dir, Durability::Durable, OnAuditFailure::Refuse);
    let app = app(&recorder);
    let n = table().len();
    let mut ids = Vec::new();
    for i in 0..n {
        let r = call(&app, &format!("/fail/{i}")).await;
        let expected = mapping(&table()[i]);
        assert_eq!(r.status(), expected.status, "{i}");
        ids.push(
            r.headers()["x-request-id"]
                .to_str()
                .expect("ascii")
                .to_owned(),
        );
    }
    assert_eq!(call(&app, "/ok").await.status(), StatusCode::OK);
    let got = records(&recorder);
    assert_eq!(got.len(), n + 1, "one record per request, no more");
    for (i, (record, id)) in got.iter().zip(&ids).enumerate() {
        let expected = mapping(&table()[i]);
        assert_eq!(&record.request_id, id, "{i}");
        assert_eq!(record.status, expected.status.as_u16(), "{i}");
        assert_eq!(
            record.error_type.as_deref(),
            Some(expected.code.unwrap_or(expected.kind)),
            "{i}"
        );
        assert_eq!(record.route, "/fail/{i}");
    }
    let last = got.last().expect("the success");
    assert_eq!((last.status, last.error_type.as_deref()), (200, None));
    assert_eq!(last.disconnect, None);
    // The table's admission errors name their outcome and the gateway layer.
    let too_long = &got[5];
    let admission = too_long.admission.expect("an admission decision");
    assert_eq!(
        admission.outcome,
        bulkhead_audit::AdmissionOutcome::Rejected
    );
    assert_eq!(admission.layer, bulkhead_audit::Layer::Gateway);
    assert!(matches!(
        got[12].integrity,
        bulkhead_audit::Integrity::Failed { .. }
    ));
}

/// A handler that never answers: the client gives up first.
async fn hang(Extension(trail): Extension<Trail>) -> Response {
    trail.model("m");
    std::future::pending::<Response>().await
}

#[tokio::test]
async fn a_request_abandoned_by_its_client_is_recorded_once_with_its_phase() {
    let dir = Scratch::new("trail");
    let recorder = open(&dir, Durability::Durable, OnAuditFailure::Refuse);
    let app = Router::new()
        .route("/hang", get(hang))
        .layer(middleware::from_fn_with_state(recorder.clone(), audited));
    let pending = call(&app, "/hang");
    // The server drops the request's future when the client leaves; so does this timeout.
    assert!(
        tokio::time::timeout(Duration::from_millis(100), pending)
            .await
            .is_err()
    );
    let got = records(&recorder);
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].status, super::CLIENT_CLOSED);
    assert_eq!(got[0].disconnect, Some(DisconnectPhase::BeforeAdmission));
    assert_eq!(got[0].model, "m");
}

async fn panics(Extension(trail): Extension<Trail>) -> Response {
    trail.model("m");
    panic!("a bug in the handler");
}

/// A request whose handler panicked (a gateway bug) is recorded as the gateway's failure, not
/// as its client leaving.
#[tokio::test]
async fn a_request_whose_handler_panicked_is_recorded_as_an_internal_error() {
    let dir = Scratch::new("trail");
    let recorder = open(&dir, Durability::Group, OnAuditFailure::Refuse);
    let app = Router::new()
        .route("/panic", get(panics))
        .layer(middleware::from_fn_with_state(recorder.clone(), audited));
    let ran = tokio::spawn(async move { call(&app, "/panic").await }).await;
    assert!(ran.expect_err("it panicked").is_panic());
    let got = records(&recorder);
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].status, 500);
    assert_eq!(got[0].error_type.as_deref(), Some("internal_error"));
    assert_eq!(got[0].disconnect, None, "its client did not leave");
}

/// A request shutdown cut and then dropped before it answered (its grace spent) never sent
/// its client the 503 it was to have: its record says the connection closed unanswered.
#[tokio::test]
async fn a_request_dropped_unanswered_by_shutdown_is_recorded_as_closed_unanswered() {
    use crate::serving::Witness as _;

    let dir = Scratch::new("trail");
    let recorder = open(&dir, Durability::Group, OnAuditFailure::Refuse);
    let reached = std::sync::Arc::new(tokio::sync::Notify::new());
    let handler = {
        let reached = reached.clone();
        move |trail: Extension<Trail>| async move {
            reached.notify_one();
            hang(trail).await
        }
    };
    let app = Router::new()
        .route("/hang", get(handler))
        .layer(middleware::from_fn_with_state(recorder.clone(), audited));
    let mut pending = Box::pin(call(&app, "/hang"));
    // Run until the handler waits, then cut, then drop it unanswered.
    tokio::select! {
        _ = &mut pending => panic!("the handler never answers"),
        () = reached.notified() => {}
    }
    recorder.cut();
    drop(pending);
    let got = records(&recorder);
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].status, super::draft::CLOSED_UNANSWERED);
    assert_eq!(
        got[0].error_type.as_deref(),
        Some(super::GATEWAY_SHUTDOWN_TYPE)
    );
    assert_eq!(got[0].disconnect, None, "its client did not leave");
}

/// Makes the gateway log's first segment unwritable: a directory stands where the file goes.
fn break_gateway_log(dir: &std::path::Path) {
    let segment = dir.join(GATEWAY_LOG).join(format!("{:020}.jsonl", 0));
    std::fs::create_dir_all(segment).expect("blocks the segment");
}

#[tokio::test]
async fn a_broken_log_refuses_requests_rather_than_serve_them_unaudited() {
    let dir = Scratch::new("trail");
    let recorder = open(&dir, Durability::Durable, OnAuditFailure::Refuse);
    break_gateway_log(&dir.0);
    let app = app(&recorder);
    let r = call(&app, "/ok").await;
    assert_eq!(
        r.status(),
        StatusCode::SERVICE_UNAVAILABLE,
        "the answer waits for a record that cannot be written"
    );
    assert!(recorder.failure().is_some());
    assert!(recorder.refusing());
    let r = call(&app, "/ok").await;
    assert_eq!(
        r.status(),
        StatusCode::SERVICE_UNAVAILABLE,
        "refused up front"
    );
    assert_eq!(recorder.lost(), 1);
}

/// A log refusing records counts each request as its client was told: 503 for one whose
/// answer waited for its record, the status already sent for a stream, and one refused up
/// front (no tenant known yet) apart.
#[tokio::test]
async fn a_broken_log_counts_each_request_as_its_client_was_told() {
    let dir = Scratch::new("trail");
    let metrics = Metrics::default();
    let recorder = durable_refusing(&dir, &metrics);
    let tenant = TenantId::new("tenant-a").expect("valid");
    let segment = dir.0.join(tenant.as_str()).join(format!("{:020}.jsonl", 0));
    std::fs::create_dir_all(segment).expect("blocks the segment");
    let who = tenant_a();

    let answered = recorder.trail("req-answered".into(), tracing::Span::none());
    answered.authenticated(&who);
    assert_eq!(
        answered.finish(200, None).await,
        Err(ApiError::AuditUnavailable)
    );
    assert_eq!(metrics.requests_of(&tenant, 503), 1, "told 503");
    assert_eq!(metrics.requests_of(&tenant, 200), 0, "never told 200");

    let streamed = recorder.trail("req-streamed".into(), tracing::Span::none());
    streamed.authenticated(&who);
    streamed.responded(200);
    assert_eq!(
        streamed.finish(200, None).await,
        Err(ApiError::AuditUnavailable)
    );
    assert_eq!(metrics.requests_of(&tenant, 200), 1, "its head said 200");

    assert!(recorder.refusing());
    assert_eq!(metrics.audit_refused_count(), 0);
    let r = call(&app(&recorder), "/ok").await;
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        metrics.audit_refused_count(),
        1,
        "refused up front, counted"
    );
}

/// A request whose client leaves while its answer waits for its record's fsync is counted
/// all the same: its record is in the log.
#[tokio::test]
async fn a_request_left_while_its_record_is_fsynced_is_counted() {
    let dir = Scratch::new("trail");
    let metrics = Metrics::default();
    let recorder = durable_refusing(&dir, &metrics);
    let who = tenant_a();
    for i in 0..20 {
        let trail = recorder.trail(format!("req-{i}"), tracing::Span::none());
        trail.authenticated(&who);
        // Polled once (the record appended, the fsync asked for), then dropped.
        let _ = tokio::time::timeout(Duration::ZERO, trail.finish(200, None)).await;
    }
    recorder.flush().expect("flush");
    let tenant = TenantId::new("tenant-a").expect("valid");
    assert_eq!(
        recorder.read(&tenant, Seq(0), 100).expect("reads").len(),
        20
    );
    assert_eq!(
        metrics.requests_of(&tenant, 200),
        20,
        "one count per record"
    );
}

#[tokio::test]
async fn a_broken_log_configured_to_serve_keeps_serving_and_counts_what_it_lost() {
    let dir = Scratch::new("trail");
    let recorder = open(&dir, Durability::Durable, OnAuditFailure::Serve);
    break_gateway_log(&dir.0);
    let app = app(&recorder);
    assert_eq!(call(&app, "/ok").await.status(), StatusCode::OK);
    assert_eq!(call(&app, "/ok").await.status(), StatusCode::OK);
    assert!(recorder.failure().is_some());
    assert!(!recorder.refusing());
    assert_eq!(recorder.lost(), 2);
}

#[tokio::test]
async fn a_broken_log_in_group_commit_counts_the_records_its_flush_dropped() {
    // Group commit answers before the write: a record its flush then fails to write was
    // counted nowhere, and `/healthz` said nothing was lost.
    let dir = Scratch::new("trail");
    let recorder = open(&dir, Durability::Group, OnAuditFailure::Serve);
    break_gateway_log(&dir.0);
    let app = app(&recorder);
    assert_eq!(call(&app, "/ok").await.status(), StatusCode::OK);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while recorder.failure().is_none() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the flush never failed"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(recorder.lost(), 1);
    assert_eq!(call(&app, "/ok").await.status(), StatusCode::OK);
    assert_eq!(recorder.lost(), 2, "refused once the log stopped");
}

/// A flush writes its tenants one after another: one that fails on the gateway's log has
/// made the tenants' written before it durable, and their waiters are told so (each was told
/// 503 `audit_unavailable` while its record said 200). Which tenant a flush writes first is
/// the order of a hash map's: tried until tenant-a's came first.
#[tokio::test]
async fn a_record_a_failed_flush_made_durable_is_waited_for_as_durable() {
    let tenant_a = TenantId::new("tenant-a").expect("valid");
    let gateway = TenantId::new(GATEWAY_LOG).expect("valid");
    let mut written_first = 0;
    for _ in 0..32 {
        let dir = Scratch::new("trail");
        let settings = AuditSettings {
            durability: Durability::Durable,
            on_failure: OnAuditFailure::Refuse,
            ..AuditSettings::default()
        };
        // No background flush (and no export to ask for one): both records go in one flush.
        let recorder =
            Recorder::open_flushing(&dir.0, settings, None, Metrics::default(), None, None)
                .expect("opens")
                .0;
        break_gateway_log(&dir.0);
        let record = |tenant: &TenantId| {
            AuditRecord::new("r".to_owned(), tenant.clone(), "/v1/completions".to_owned())
        };
        let span = tracing::Span::none();
        let (_, seq) = recorder
            .append([None, Some(record(&tenant_a))], &span)
            .expect("taken");
        recorder
            .append([None, Some(record(&gateway))], &span)
            .expect("taken");
        let waited = recorder.durable(&tenant_a, seq).await;
        let read = recorder.read(&tenant_a, Seq(0), 10).expect("reads");
        assert!(recorder.failure().is_some(), "the flush failed");
        if read.is_empty() {
            assert!(waited.is_err(), "written after the failure: dropped");
        } else {
            assert!(
                waited.is_ok(),
                "durable, though its flush failed: {waited:?}"
            );
            written_first += 1;
        }
    }
    assert!(
        written_first > 0,
        "tenant-a's log came first in one flush at least"
    );
}

/// Group commit answers before its record is durable only while the flushes keep up: once
/// the oldest record not yet durable has waited past the bound, an answer waits for its own
/// (and every one before it), so a crash cannot lose a backlog that grows without end.
#[tokio::test]
async fn group_commit_waits_for_its_record_once_the_flushes_fall_behind() {
    let dir = Scratch::new("trail");
    let settings = AuditSettings {
        durability: Durability::Group,
        ..AuditSettings::default()
    };
    // No background flush: nothing is durable until someone waits for it.
    let recorder = Recorder::open_flushing(&dir.0, settings, None, Metrics::default(), None, None)
        .expect("opens")
        .0;
    let gateway = TenantId::new(GATEWAY_LOG).expect("valid");
    let durable = || recorder.read(&gateway, Seq(0), 100).expect("reads").len();
    let app = app(&recorder);
    assert_eq!(call(&app, "/ok").await.status(), StatusCode::OK);
    assert_eq!(durable(), 0, "answered first, its record not yet durable");
    tokio::time::sleep(super::GROUP_COMMIT_MAX_LAG + Duration::from_millis(20)).await;
    assert_eq!(call(&app, "/ok").await.status(), StatusCode::OK);
    assert_eq!(
        durable(),
        2,
        "the flushes fell behind: the answer waited for both"
    );
    assert_eq!(call(&app, "/ok").await.status(), StatusCode::OK);
    assert_eq!(durable(), 2, "caught up: answered first again");
}

/// Answered before their fsync (`group_commit_waits_for_its_record_once_the_flushes_fall_behind`
/// shows the order), the records still all reach the log, chained.
#[tokio::test]
async fn group_commit_records_every_answered_request_durably_and_verifiably() {
    let dir = Scratch::new("trail");
    let recorder = open(&dir, Durability::Group, OnAuditFailure::Refuse);
    let app = app(&recorder);
    for _ in 0..5 {
        assert_eq!(call(&app, "/ok").await.status(), StatusCode::OK);
    }
    // The background group commit makes them durable within a few milliseconds.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let gateway = TenantId::new(GATEWAY_LOG).expect("valid");
    assert_eq!(
        recorder.read(&gateway, Seq(0), 100).expect("reads").len(),
        5
    );
    let report = bulkhead_audit::verify(&dir.0, None, None);
    assert!(report.passed(), "{report}");
}

/// A configuration whose one tenant, `owner`, has the key `sk-a`.
fn config_text(owner: &str) -> String {
    let key = crate::keys::KeyHash::of("sk-a").to_hex();
    format!(
        "[listen]\napi = \"127.0.0.1:8080\"\nadmin = \"127.0.0.1:9090\"\n\
         [admin]\ntoken_sha256 = \"{}\"\n\
         [[tenants]]\nid = \"{owner}\"\nkey_sha256 = [\"{key}\"]\nmax_context = 2048\n\
         max_concurrent = 2\nrequests_per_minute = 60\ntokens_per_minute = 100000\n\
         [[workers]]\nname = \"w\"\ngrpc = \"127.0.0.1:50051\"\nrole = \"both\"\n",
        crate::keys::KeyHash::of("admin").to_hex()
    )
}

/// The tenants of the `Watch` test: `tenant-a`, whose key is `sk-a`.
fn tenants() -> crate::tenants::Tenants {
    let config = crate::Config::parse(&config_text("tenant-a")).expect("a valid configuration");
    crate::tenants::Tenants::new(config.tenants, crate::limits::Limiter::default(), None)
}

/// `tenant-a` as its key `sk-a` authenticates it.
fn tenant_a() -> crate::auth::Authenticated {
    let mut headers = http::HeaderMap::new();
    headers.insert(
        http::header::AUTHORIZATION,
        http::HeaderValue::from_static("Bearer sk-a"),
    );
    crate::auth::authenticate(&mut headers, tenants().current().keyring()).expect("sk-a")
}

/// A recorder over `dir` in durable mode that refuses to serve unrecorded, counting in
/// `metrics`.
fn durable_refusing(dir: &Scratch, metrics: &Metrics) -> Recorder {
    let settings = AuditSettings {
        durability: Durability::Durable,
        on_failure: OnAuditFailure::Refuse,
        ..AuditSettings::default()
    };
    Recorder::open(&dir.0, settings, None, metrics.clone(), None)
        .expect("opens")
        .0
}

/// A request with no tenant to charge that ended for another reason than its key is counted
/// by its status: a request with two Hosts (400 bad_host), one hyper could not parse, plain
/// HTTP to a TLS port. They were in no metric at all.
#[tokio::test]
async fn requests_with_no_tenant_are_counted_by_their_status() {
    let dir = Scratch::new("trail");
    let metrics = Metrics::default();
    let recorder = durable_refusing(&dir, &metrics);
    let request = Request::get("/ok")
        .header(http::header::HOST, "a")
        .header(http::header::HOST, "b")
        .body(Body::empty())
        .expect("request");
    let r = app(&recorder).oneshot(request).await.expect("infallible");
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    crate::serving::Witness::unparsed(&recorder, 431);
    crate::serving::Witness::plain_http(&recorder);
    assert_eq!(metrics.untenanted_of(400), 2, "bad_host and https_required");
    assert_eq!(metrics.untenanted_of(431), 1, "unparsed");
}

/// `GET /v1/audit` pages through the caller's records: `limit` at a time, `has_more` while
/// some are left, `next_since` where the next page starts.
#[tokio::test]
async fn a_tenant_reads_its_records_a_page_at_a_time() {
    let dir = Scratch::new("trail");
    let recorder = with_budget(&dir, 1000);
    let who = tenant_a();
    for i in 0..3 {
        let trail = recorder.trail(format!("req-{i}"), tracing::Span::none());
        trail.authenticated(&who);
        trail.finish(200, None).await.expect("recorded");
    }
    recorder.flush().expect("flush");
    let limiter = crate::limits::Limiter::default();
    let read = async |query: &str| {
        let permit = limiter.start(&who.tenant).expect("room");
        let response = super::tenant_read(
            axum::extract::State(recorder.clone()),
            Extension(who.clone()),
            axum::extract::RawQuery(Some(query.to_owned())),
            permit,
        )
        .await;
        assert_eq!(response.status(), StatusCode::OK);
        // The tenant's slot came back once the read was done.
        assert_eq!(limiter.in_flight(&who.tenant.id), 0);
        let body = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .expect("a body");
        let page: serde_json::Value = serde_json::from_slice(&body).expect("json");
        let ids: Vec<String> = page["data"]
            .as_array()
            .expect("data")
            .iter()
            .map(|r| {
                r["record"]["bulkhead.request.id"]
                    .as_str()
                    .expect("an id")
                    .to_owned()
            })
            .collect();
        (ids, page["has_more"].clone(), page["next_since"].clone())
    };
    let (ids, more, next) = read("limit=2").await;
    assert_eq!(ids, ["req-0", "req-1"]);
    assert_eq!(more, true);
    let (ids, more, _) = read(&format!("since={next}&limit=2")).await;
    assert_eq!(ids, ["req-2"]);
    assert_eq!(more, false);
    let (ids, more, _) = read("limit=3").await;
    assert_eq!(ids.len(), 3);
    assert_eq!(more, false, "exactly the limit left: no more");

    // The admin listener reads any tenant's log by its id, and refuses what is no id.
    let admin = async |tenant: &str| {
        let response = super::admin_read(
            axum::extract::State(recorder.clone()),
            axum::extract::State(tenants()),
            Ok(Path(tenant.to_owned())),
            axum::extract::RawQuery(None),
        )
        .await;
        let status = response.status();
        let body = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .expect("a body");
        (
            status,
            serde_json::from_slice::<serde_json::Value>(&body).expect("json"),
        )
    };
    let (status, page) = admin("tenant-a").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(page["tenant"], "tenant-a");
    assert_eq!(page["data"].as_array().map(Vec::len), Some(3), "{page}");
    let (status, error) = admin("../tenant-a").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(error["error"]["param"], "tenant", "{error}");
    // A name neither configured nor logged is no tenant: 404, not an empty page.
    let (status, error) = admin("tenant-z").await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{error}");
    assert_eq!(error["error"]["code"], "tenant_not_found", "{error}");
    // The gateway's own log is always there to read.
    let (status, page) = admin(GATEWAY_LOG).await;
    assert_eq!(status, StatusCode::OK, "{page}");
}

/// `tenant-a` (key `sk-a`) read from a configuration file that reloads re-read, and a
/// group-commit audit log, both in a fresh directory.
fn reloadable() -> (
    Scratch,
    std::path::PathBuf,
    crate::tenants::Tenants,
    Recorder,
) {
    let dir = Scratch::new("trail");
    let file = dir.0.join("gateway.toml");
    std::fs::write(&file, config_text("tenant-a")).expect("writes the configuration");
    let (config, loaded) = crate::tenants::ConfigFile::load(&file).expect("loads");
    let tenants = crate::tenants::Tenants::new(
        config.tenants,
        crate::limits::Limiter::default(),
        Some(loaded),
    );
    let recorder = open(&dir, Durability::Group, OnAuditFailure::Refuse);
    (dir, file, tenants, recorder)
}

/// A tenant's log is its id's: a reload that adds an id whose log has records is refused (the
/// new holder would read them, and share the workers' prefix cache for the id) unless its
/// entry says `reuse_id`; one that adds a fresh id is not.
#[tokio::test]
async fn a_reload_that_adds_an_id_with_audit_records_is_refused_unless_vouched_for() {
    let (dir, file, tenants, recorder) = reloadable();
    tenants
        .audited_by(recorder.clone(), ServedFile::in_dir(&dir.0))
        .expect("a first start");
    let trail = recorder.trail("req-a".into(), tracing::Span::none());
    trail.authenticated(&tenant_a());
    trail.finish(200, None).await.expect("recorded");
    recorder.flush().expect("flush");
    let id = |s: &str| TenantId::new(s).expect("valid");
    // The key goes to a fresh id: nothing to say.
    std::fs::write(&file, config_text("tenant-b")).expect("gives the key to tenant-b");
    let fresh = tenants.reload().expect("reloads");
    assert_eq!((fresh.added, fresh.reused), (vec![id("tenant-b")], vec![]));
    let served = ServedFile::in_dir(&dir.0).read().expect("reads");
    assert_eq!(
        served,
        Some([id("tenant-b")].into()),
        "a reload rewrites the ids served"
    );
    // tenant-a's id comes back, to whoever holds the key now: it would read the old records.
    std::fs::write(&file, config_text("tenant-a")).expect("gives the id back");
    let refused = tenants.reload().expect_err("an id with records");
    assert!(
        matches!(&refused, crate::tenants::ReloadError::ReusedId(ids) if ids.0 == [id("tenant-a")]),
        "{refused}"
    );
    assert!(refused.to_string().contains("reuse_id"), "{refused}");
    assert!(
        tenants.current().get(&id("tenant-b")).is_some(),
        "unchanged"
    );
    // The operator vouches that it is the tenant that left them.
    let vouched = config_text("tenant-a").replace(
        "tokens_per_minute = 100000\n",
        "tokens_per_minute = 100000\nreuse_id = true\n",
    );
    std::fs::write(&file, vouched).expect("vouches for the id");
    let again = tenants.reload().expect("reloads");
    assert_eq!(again.reused, vec![id("tenant-a")]);
}

/// A reload whose ids served cannot be written down changes nothing: a restart would
/// otherwise compare its tenants with a set that was never the running one.
#[tokio::test]
async fn a_reload_that_cannot_write_the_ids_served_is_refused_and_changes_nothing() {
    let (_dir, file, tenants, recorder) = reloadable();
    let served_in = Scratch::new("served");
    tenants
        .audited_by(recorder, ServedFile::in_dir(&served_in.0))
        .expect("a first start");
    std::fs::remove_dir_all(&served_in.0).expect("removes the directory");
    std::fs::write(&file, config_text("tenant-b")).expect("gives the key to tenant-b");
    let refused = tenants.reload().expect_err("nowhere to write");
    assert!(
        matches!(refused, crate::tenants::ReloadError::Served(_)),
        "{refused}"
    );
    let id = TenantId::new("tenant-a").expect("valid");
    assert!(tenants.current().get(&id).is_some(), "unchanged");
}

/// A start is held to the same rule as a reload, against the ids served last from the data
/// directory (`tenants-served`, which starts and reloads rewrite): an id configured at start
/// that was not served last and whose log has records is refused unless vouched for. An id
/// removed by a reload, or between two runs, is otherwise given again by a restart unseen.
#[tokio::test]
async fn a_start_that_gives_an_id_with_audit_records_again_is_refused_unless_vouched_for() {
    let (dir, _file, tenants, recorder) = reloadable();
    let served = ServedFile::in_dir(&dir.0);
    let start = |owner: &str, vouched: bool| {
        let mut text = config_text(owner);
        if vouched {
            text = text.replace(
                "tokens_per_minute = 100000\n",
                "tokens_per_minute = 100000\nreuse_id = true\n",
            );
        }
        let config = crate::Config::parse(&text).expect("a valid configuration");
        crate::tenants::Tenants::new(config.tenants, crate::limits::Limiter::default(), None)
            .audited_by(recorder.clone(), served.clone())
    };
    let id = |s: &str| TenantId::new(s).expect("valid");
    let last_served = || served.read().expect("reads").expect("written");
    assert_eq!(
        tenants
            .audited_by(recorder.clone(), served.clone())
            .expect("a first start"),
        vec![]
    );
    let trail = recorder.trail("req-a".into(), tracing::Span::none());
    trail.authenticated(&tenant_a());
    trail.finish(200, None).await.expect("recorded");
    recorder.flush().expect("flush");
    // tenant-a served last: it starts again as it is.
    assert_eq!(start("tenant-a", false).expect("starts"), vec![]);
    // The next run serves tenant-b alone; then a run gives tenant-a's id again.
    assert_eq!(start("tenant-b", false).expect("starts"), vec![]);
    assert_eq!(last_served(), [id("tenant-b")].into());
    let refused = start("tenant-a", false).expect_err("an id with records, not served last");
    assert!(
        matches!(&refused, crate::tenants::StartError::ReusedId { ids, .. } if ids.0 == [id("tenant-a")]),
        "{refused}"
    );
    assert!(refused.to_string().contains("reuse_id"), "{refused}");
    assert_eq!(
        last_served(),
        [id("tenant-b")].into(),
        "a refused start writes nothing"
    );
    // A fresh id with no records starts; the operator vouches for the one coming back.
    assert_eq!(start("tenant-c", false).expect("starts"), vec![]);
    assert_eq!(
        start("tenant-a", true).expect("vouched"),
        vec![id("tenant-a")]
    );
    assert_eq!(start("tenant-a", false).expect("served last"), vec![]);
    // A directory that never had the file (a gateway before it) has nothing to compare with.
    std::fs::remove_file(dir.0.join("tenants-served")).expect("removes");
    start("tenant-b", false).expect("no file");
    start("tenant-a", false).expect_err("the file written again");
}

/// A request dropped unpolled is recorded for the tenant its key named when it arrived: a
/// reload in between that gives the key to another tenant does not put the record (its
/// route, its time) in that tenant's log.
#[tokio::test]
async fn a_request_dropped_unpolled_is_recorded_for_the_tenant_it_arrived_as() {
    use hyper::service::Service as _;
    use hyper_util::service::TowerToHyperService;

    let (_dir, file, tenants, recorder) = reloadable();
    let watch = super::Watch::new(
        TowerToHyperService::new(app(&recorder)),
        recorder.clone(),
        tenants.clone(),
    );
    let request = Request::builder()
        .header(http::header::HOST, "t")
        .uri("/v1/chat/completions")
        .header(http::header::AUTHORIZATION, "Bearer sk-a")
        .body(Body::empty())
        .expect("a request");
    let arrived = watch.call(request);
    std::fs::write(&file, config_text("tenant-b")).expect("gives the key to tenant-b");
    tenants.reload().expect("reloads");
    drop(arrived);
    recorder.flush().expect("flush");
    let read = |id: &str| {
        recorder
            .read(&TenantId::new(id).expect("valid"), Seq(0), 100)
            .expect("reads")
            .len()
    };
    assert_eq!(read("tenant-a"), 1, "recorded as the tenant it arrived as");
    assert_eq!(read("tenant-b"), 0, "nothing in the key's new owner's log");
}

#[tokio::test]
async fn a_request_dropped_before_the_api_ran_it_is_recorded_once_in_its_tenants_log() {
    use hyper::service::Service as _;
    use hyper_util::service::TowerToHyperService;

    let dir = Scratch::new("trail");
    let metrics = Metrics::default();
    let recorder = Recorder::open(
        &dir.0,
        AuditSettings::default(),
        None,
        metrics.clone(),
        None,
    )
    .expect("opens")
    .0;
    let watch = super::Watch::new(
        TowerToHyperService::new(app(&recorder)),
        recorder.clone(),
        tenants(),
    );
    let request = |key: &str, path: &str| {
        Request::builder()
            .header(http::header::HOST, "t")
            .uri(path)
            .header(http::header::AUTHORIZATION, format!("Bearer {key}"))
            .body(Body::empty())
            .expect("a request")
    };
    // Handed over, then dropped unpolled (its client closed in the same read): one record each,
    // in the tenant's log for a valid key, in the gateway's for an unknown one.
    drop(watch.call(request("sk-a", "/v1/chat/completions")));
    drop(watch.call(request("sk-unknown", "/some/where")));
    // Two keys are none, as the API has it (401): not tenant-a's, whose key comes first.
    let mut two = request("sk-a", "/v1/completions");
    two.headers_mut().append(
        http::header::AUTHORIZATION,
        http::HeaderValue::from_static("Bearer sk-unknown"),
    );
    drop(watch.call(two));
    // Polled to the end: the API's trail records it, the watch adds nothing.
    let served = watch.call(request("sk-a", "/ok")).await.expect("served");
    assert_eq!(served.status(), StatusCode::OK);
    recorder.flush().expect("flush");
    let tenant = TenantId::new("tenant-a").expect("valid");
    let mine: Vec<AuditRecord> = recorder
        .read(&tenant, Seq(0), 100)
        .expect("reads")
        .into_iter()
        .map(|s| s.record)
        .collect();
    assert_eq!(mine.len(), 1, "{mine:#?}");
    assert_eq!(mine[0].route, "/v1/chat/completions");
    assert_eq!(mine[0].status, super::CLIENT_CLOSED);
    assert_eq!(mine[0].disconnect, Some(DisconnectPhase::BeforeAdmission));
    // Counted as its record says (the metrics once counted only what reached the API).
    assert_eq!(metrics.requests_of(&tenant, super::CLIENT_CLOSED), 1);
    let gateway = records(&recorder);
    assert_eq!(
        gateway.len(),
        3,
        "the unknown key's, the two keys' and the served one: {gateway:#?}"
    );
    assert_eq!(gateway[0].route, super::UNMATCHED_ROUTE);
    assert_eq!(gateway[1].route, "/v1/completions");
    assert_eq!(gateway[2].status, 200);
}

/// A request that failed after a successful head (a stream a worker, its handoff or shutdown
/// ended) makes its span an error, as a 5xx does: its span said 200 and nothing else. A client
/// that left, a refusal (4xx) and a success do not.
#[test]
fn a_failure_after_a_successful_head_is_the_servers_and_a_client_leaving_is_not() {
    let tenant = TenantId::new("t").expect("valid");
    let record = |status, error: Option<&str>| {
        let mut r = AuditRecord::new("r".to_owned(), tenant.clone(), "/v1/completions".to_owned());
        r.status = status;
        r.error_type = error.map(str::to_owned);
        r
    };
    assert!(super::failed_after_head(&record(
        200,
        Some("service_unavailable")
    )));
    assert!(super::failed_after_head(&record(
        200,
        Some(GATEWAY_SHUTDOWN_TYPE)
    )));
    assert!(!super::failed_after_head(&record(
        200,
        Some(CLIENT_CLOSED_TYPE)
    )));
    assert!(!super::failed_after_head(&record(200, None)));
    assert!(!super::failed_after_head(&record(
        429,
        Some("rate_limit_exceeded")
    )));
}
