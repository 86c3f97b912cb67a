//! The API's audit trail: exactly one final record per request that reaches the gateway
//! (invariant I5), in its tenant's hash-chained log — or, with no tenant to charge
//! (unauthenticated), in the gateway's own log under the reserved id [`GATEWAY_LOG`].
//!
//! ```text
//!  request ─▶ audited (outermost layer): a Trail in the request's extensions
//!    ─▶ auth ─▶ account (tenant, key id, route) ─▶ handler (model, prompt hash, admission,
//!       workers, policy decisions, tokens, integrity)
//!    ─▶ response: finished by `audited` (a durable-mode response waits for its fsync, a
//!       group-commit one while the fsyncs are behind), or by the SSE stream just before its
//!       `[DONE]`. A request dropped before either — its client left — is recorded on drop
//!       with the phase it was in.
//! ```
//!
//! Each final record also ends the request's span (its outcome recorded on it) and, when audit
//! log export is on, goes out as an OpenTelemetry log record in the same trace.
//!
//! While the log cannot write, [`OnAuditFailure::Refuse`] turns every new request away with
//! 503 `audit_unavailable` rather than serve it unaudited; health says why. So that requests
//! with no tenant to charge, and a tenant's requests that ended before a prompt of theirs was
//! counted (refused at the door by its limits, a listing, an unknown route, a malformed body),
//! cannot fill the disk every log shares, each log has a budget for them past which they are
//! counted in folded records ([`fold`]).

mod draft;
mod exports;
mod fold;
mod layer;
mod read;
mod syncer;
#[cfg(test)]
mod tests;
mod unserved;

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use bulkhead_audit::{AuditError, AuditLog, AuditRecord, ChainKey, Recovery, Seq, TenantId};
use bulkhead_telemetry::{AuditExport, RecordTrace};
use tracing::Span;

pub use draft::{
    CLIENT_CLOSED, CLIENT_CLOSED_TYPE, CLOSED_UNANSWERED, GATEWAY_SHUTDOWN_TYPE, Trail,
};
pub use layer::{account, audited};
pub use read::{AuditPage, admin_read, tenant_read};
pub use unserved::Watch;

use crate::config::{AuditSettings, Durability, OnAuditFailure};
use crate::metrics::Metrics;
use crate::serving::Witness;

/// The log of requests with no tenant to charge (no or an unknown key). Configured tenant ids
/// cannot start with `_`, so no tenant can own it or read it.
pub const GATEWAY_LOG: &str = "_gateway";

/// The route recorded for a request that matched none.
pub const UNMATCHED_ROUTE: &str = "unmatched";

/// The error class recorded for a request hyper could not parse (and answered itself).
pub const UNPARSED_TYPE: &str = "malformed_http";

/// The error class recorded for plain HTTP sent to a port that takes only TLS.
pub const HTTPS_REQUIRED_TYPE: &str = "https_required";

/// How often unflushed records are written and fsynced together (group commit).
const GROUP_COMMIT_INTERVAL: Duration = Duration::from_millis(5);

/// How far group commit's flushes may fall behind before answers wait for their records as in
/// durable mode (a disk slower than the traffic, many tenants' files to fsync, small segments
/// rotating): a crash then loses at most the answers of about this long, not a backlog that
/// grows without bound.
pub const GROUP_COMMIT_MAX_LAG: Duration = Duration::from_millis(50);

/// The audit log as the API uses it; a cheap `Clone`.
#[derive(Debug, Clone)]
pub struct Recorder {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// Shared with the fsync thread, which holds it weakly.
    log: Arc<AuditLog>,
    settings: AuditSettings,
    gateway: TenantId,
    /// Records that could not be written (served anyway under `on_failure = "serve"`, or
    /// abandoned requests).
    lost: AtomicU64,
    /// Every final record's latency feeds the request-duration and TTFT histograms.
    metrics: Metrics,
    /// Every final record is also exported as a log record once durable, when configured.
    exports: Option<Arc<exports::Exports>>,
    /// The thread whose fsyncs responses wait for: every one in durable mode, in group commit
    /// those appended while the flushes are behind.
    syncer: syncer::Syncer,
    /// The logs' budgets, and the folded records past them (locked for foldable records only).
    folds: Mutex<fold::Folds>,
    /// Shutdown is cutting the requests still in flight: a request dropped unfinished from
    /// here on was cut, not left by its client; one still answering ends with an error.
    cutting: tokio::sync::watch::Sender<bool>,
}

impl Recorder {
    /// Opens (or creates) the audit log in `dir`, resuming every chain; what recovery repaired
    /// is returned for the caller to log. With `key` (read from `settings.key_file`), the log
    /// is keyed. With `export`, every final record is also exported as an OpenTelemetry log
    /// record.
    pub fn open(
        dir: &Path,
        settings: AuditSettings,
        key: Option<ChainKey>,
        metrics: Metrics,
        export: Option<AuditExport>,
    ) -> Result<(Recorder, Vec<Recovery>), AuditError> {
        let interval = Some(GROUP_COMMIT_INTERVAL);
        Self::open_flushing(dir, settings, key, metrics, export, interval)
    }

    /// [`Recorder::open`] with the background flush every `interval` (`None`: only the fsync
    /// thread's flushes, which the tests of group commit's bound use).
    fn open_flushing(
        dir: &Path,
        settings: AuditSettings,
        key: Option<ChainKey>,
        metrics: Metrics,
        export: Option<AuditExport>,
        interval: Option<Duration>,
    ) -> Result<(Recorder, Vec<Recovery>), AuditError> {
        let mut config = bulkhead_audit::Config::new(dir);
        config.segment_bytes = settings.segment_bytes;
        // Appends never block a request on disk; a response that waits (durable mode, or group
        // commit behind) waits for its own record in `commit`, so concurrent requests share one
        // fsync.
        config.durability = bulkhead_audit::Durability::Batched;
        config.flush_interval = interval;
        config.key = key;
        let (log, recoveries) = AuditLog::open(config)?;
        let gateway = TenantId::new(GATEWAY_LOG).map_err(|e| AuditError::Poisoned {
            reason: format!("the gateway log's id: {e}"),
        })?;
        let log = Arc::new(log);
        let weak = Arc::downgrade(&log);
        let exports = export.map(|e| Arc::new(exports::Exports::new(e)));
        let (hook, read) = (exports.clone(), weak.clone());
        let syncer = syncer::Syncer::start(
            move || weak.upgrade().map(|l| l.flush()),
            move |flush| {
                if let (Some(exports), Some(log)) = (&hook, read.upgrade()) {
                    exports.flushed(flush, |tenant, seq| log.is_durable(tenant, seq));
                }
            },
        )
        .map_err(|e| AuditError::Poisoned {
            reason: format!("starting the audit fsync thread: {e}"),
        })?;
        let folds = fold::Folds::new(
            gateway.clone(),
            settings.gateway_records_per_minute,
            settings.unread_records_per_minute,
        );
        let inner = Arc::new(Inner {
            log,
            settings,
            folds: Mutex::new(folds),
            cutting: tokio::sync::watch::Sender::new(false),
            gateway,
            lost: AtomicU64::new(0),
            metrics,
            exports,
            syncer,
        });
        Ok((Recorder { inner }, recoveries))
    }

    /// A new request's trail; `span` is the request's span.
    pub fn trail(&self, request_id: String, span: Span) -> Trail {
        Trail::new(self.clone(), request_id, span)
    }

    fn gateway_tenant(&self) -> &TenantId {
        &self.inner.gateway
    }

    /// Whether a request dropped now was cut by shutdown ([`Witness::cut`]).
    fn cutting(&self) -> bool {
        *self.inner.cutting.borrow()
    }

    /// What tells a request that shutdown cuts it.
    fn shutdown_signal(&self) -> ShutdownSignal {
        ShutdownSignal(self.inner.cutting.subscribe())
    }

    /// Why the log cannot write, while it cannot.
    pub fn failure(&self) -> Option<String> {
        self.inner.log.failure()
    }

    /// Whether new requests are refused now (the log is broken and the gateway is configured
    /// not to serve unaudited traffic).
    pub fn refusing(&self) -> bool {
        self.refuses_on_failure() && self.failure().is_some()
    }

    /// Whether a request whose record cannot be written is answered with 503.
    fn refuses_on_failure(&self) -> bool {
        self.inner.settings.on_failure == OnAuditFailure::Refuse
    }

    /// Records that could not be written since start: refused by the log, or accepted and
    /// then dropped by a failed write or fsync (in group commit, after their answers went out).
    pub fn lost(&self) -> u64 {
        self.inner.lost.load(Ordering::Relaxed) + self.inner.log.dropped()
    }

    /// A request ended: its latency goes to the histograms and its outcome onto its span. (It
    /// is counted by [`Recorder::count`], once what its client was told is known, and exported
    /// by [`Recorder::append`], as the log takes it.)
    fn ended(&self, record: &AuditRecord, span: &Span, total: Duration, ttft: Option<Duration>) {
        self.inner.metrics.latency(&record.tenant, total, ttft);
        span.record("gen_ai.usage.input_tokens", record.input_tokens);
        span.record("gen_ai.usage.output_tokens", record.output_tokens);
        if let Some(error) = &record.error_type {
            span.record("error.type", error.as_str());
        }
        if failed_after_head(record) {
            span.record("otel.status_code", "ERROR");
        }
    }

    /// Counts a request that ended by its tenant and the status its client was told; the
    /// gateway log's by status too, but for a refusal of its key (the authentication layer
    /// counts those as unauthenticated). The metrics count what the records say, whichever
    /// way the request ended: also one its client abandoned before the API ran it.
    fn count(&self, tenant: &TenantId, status: u16) {
        if *tenant != self.inner.gateway {
            self.inner.metrics.request(tenant, status);
        } else if status != 401 {
            self.inner.metrics.untenanted(status);
        }
    }

    /// The answer to a request that arrives while the log is broken and configured to refuse
    /// ([`Recorder::refusing`]): 503 `audit_unavailable`, counted, unread and unrecorded.
    pub fn refuse_unrecorded(&self) -> axum::response::Response {
        self.inner.metrics.audit_refused();
        axum::response::IntoResponse::into_response(crate::api::ApiError::AuditUnavailable)
    }

    /// Appends `record`; in durable mode, returns once it is fsynced, and in group commit too
    /// while the flushes are more than [`GROUP_COMMIT_MAX_LAG`] behind. A record the log
    /// refuses is counted lost here; one it accepts and then drops, by the log. A record past its
    /// log's budget is folded: nothing to wait for, its folded record comes later.
    async fn commit(&self, record: AuditRecord, span: &Span) -> Result<(), AuditError> {
        let records = self.to_append(record);
        // The record waited for: the last appended (the request's own, or a folded record
        // it carries out).
        let Some(tenant) = records.iter().flatten().last().map(|r| r.tenant.clone()) else {
            return Ok(());
        };
        let (behind, seq) = self.append(records, span)?;
        let wait = match self.inner.settings.durability {
            Durability::Durable => true,
            Durability::Group => behind > GROUP_COMMIT_MAX_LAG,
        };
        if !wait {
            return Ok(());
        }
        self.durable(&tenant, seq).await
    }

    /// Returns once `tenant`'s record `seq`, appended before this call, is durable; an error
    /// when it cannot be made so. A flush that fails on another tenant's records may have
    /// made this one durable before it: then it is (its client is told what the record says).
    async fn durable(&self, tenant: &TenantId, seq: Seq) -> Result<(), AuditError> {
        match self.inner.syncer.durable().await {
            Err(_) if self.inner.log.is_durable(tenant, seq) => Ok(()),
            flushed => flushed.inspect_err(|e| {
                tracing::error!(error = %e, "an audit record could not be made durable");
            }),
        }
    }

    /// Appends the record of a request nobody waits on (its client left, or hyper answered
    /// it) without waiting for it to be durable.
    fn append_unawaited(&self, record: AuditRecord, span: &Span) {
        let _ = self.append(self.to_append(record), span);
    }

    /// What the log is to take for `record`, in order ([`fold::Folds::admit`]): for a
    /// foldable record, its log's folded record once due, then `record` unless its log's
    /// budget folded it; any other goes as it is, without the lock (its log's folded record
    /// goes out with the log's next foldable record, or by its timer).
    fn to_append(&self, record: AuditRecord) -> fold::Appends {
        if !fold::foldable(&record, &self.inner.gateway) {
            return [None, Some(record)];
        }
        let now = Instant::now();
        let admitted = self.with_folds(|folds| folds.admit(record, now));
        if let Some(log) = admitted.opened {
            self.write_folded_when_due(log);
        }
        admitted.appends
    }

    /// Writes the folded record that has just started collecting in `log` once its window has
    /// passed, should no foldable record of that log come by then to carry it out: a flood
    /// that stops is on disk a window later, not whenever the next request comes. (Outside a
    /// runtime, as in some tests, only the log's next foldable record or shutdown writes it.)
    fn write_folded_when_due(&self, log: TenantId) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let inner = Arc::downgrade(&self.inner);
        runtime.spawn(async move {
            tokio::time::sleep(fold::WINDOW).await;
            let Some(inner) = inner.upgrade() else {
                return;
            };
            let recorder = Recorder { inner };
            let due = recorder.with_folds(|folds| folds.due(&log, Instant::now()));
            let _ = recorder.append([due, None], &Span::none());
        });
    }

    /// Runs `f` on the logs' budgets and folded records.
    fn with_folds<T>(&self, f: impl FnOnce(&mut fold::Folds) -> T) -> T {
        f(&mut self
            .inner
            .folds
            .lock()
            .unwrap_or_else(PoisonError::into_inner))
    }

    /// Appends `records`; one the log refuses is counted lost. With export on, each it takes
    /// is exported once durable (with its place in the chain: an anchor), one it refuses at
    /// once (with none) — the request's own record tied to the trace of `span`, its request's;
    /// a folded one to none. So the collector gets what the log holds: a flood of requests
    /// without a valid key, one record a window past the gateway log's budget, where a record
    /// each would crowd the tenants' out of the exporter's queue. The result is the
    /// last one's: the record that holds the request being committed (its own, or the folded
    /// one), and how far behind the flushes were when it was appended.
    fn append(&self, records: fold::Appends, span: &Span) -> Result<(Duration, Seq), AuditError> {
        let [folded, own] = records;
        let mut result = Ok((Duration::ZERO, Seq(0)));
        for (record, span) in [(folded, &Span::none()), (own, span)] {
            let Some(record) = record else { continue };
            let appended = self.inner.log.append(&record.tenant, &record);
            if let Err(e) = &appended {
                self.inner.lost.fetch_add(1, Ordering::Relaxed);
                tracing::error!(error = %e, "an audit record could not be written");
            }
            if let Some(exports) = &self.inner.exports {
                let trace = RecordTrace::of(span);
                match &appended {
                    Ok(r) => {
                        // Queued before the flush is asked for: the flush that takes the record
                        // finds it queued when it ends.
                        let ticket = self.inner.syncer.ticket();
                        exports.when_durable(ticket, record, trace, (r.seq, r.line_sha256));
                        self.inner.syncer.kick();
                    }
                    Err(_) => exports.refused(record, &trace),
                }
            }
            result = appended.map(|r| (r.behind, r.seq));
        }
        result
    }

    /// Whether the audit log holds a chain for `tenant` (the gateway's own log always counts).
    pub fn holds(&self, tenant: &TenantId) -> bool {
        tenant.as_str() == GATEWAY_LOG || self.inner.log.holds(tenant)
    }

    /// Up to `limit` durable records of `tenant` from `since` on.
    #[cfg(test)]
    pub fn read(
        &self,
        tenant: &TenantId,
        since: Seq,
        limit: usize,
    ) -> Result<Vec<bulkhead_audit::Stored>, AuditError> {
        self.inner.log.read(tenant, since, limit)
    }

    /// The durable records of `tenant` from `since` on within `limit`, and whether more follow.
    pub fn read_page(
        &self,
        tenant: &TenantId,
        since: Seq,
        limit: bulkhead_audit::Limit,
    ) -> Result<bulkhead_audit::Page, AuditError> {
        self.inner.log.read_page(tenant, since, limit)
    }

    /// Writes the folded records being collected and makes every record so far durable
    /// (shutdown).
    pub fn flush(&self) -> Result<(), AuditError> {
        for folded in self.with_folds(fold::Folds::drain) {
            let _ = self.append([Some(folded), None], &Span::none());
        }
        let flushed = self.inner.log.flush();
        if let Some(exports) = &self.inner.exports {
            let log = &self.inner.log;
            exports.flushed(u64::MAX, |tenant, seq| log.is_durable(tenant, seq));
        }
        flushed
    }
}

/// A request's view of shutdown's cut, taken once per request: waiting on it costs a poll,
/// not a subscription, at each step of a stream.
#[derive(Debug)]
pub struct ShutdownSignal(tokio::sync::watch::Receiver<bool>);

impl ShutdownSignal {
    /// Returns once shutdown starts cutting the requests still in flight (never before).
    pub async fn cut(&mut self) {
        if self.0.wait_for(|cut| *cut).await.is_err() {
            // The recorder is gone without a cut: nothing will cut this request.
            std::future::pending::<()>().await;
        }
    }
}

/// Whether `record`'s request failed by the gateway's or a worker's doing after its answer's
/// head went out with a success (a stream a worker, its KV handoff or shutdown ended): the
/// status sent says nothing of it, and its span is an error as a 5xx's is ([`crate::traced`]
/// marks those). A client that left is not the server's failure.
fn failed_after_head(record: &AuditRecord) -> bool {
    record.status < 400
        && record
            .error_type
            .as_deref()
            .is_some_and(|e| e != CLIENT_CLOSED_TYPE)
}

impl Witness for Recorder {
    /// Shutdown's drain timeout has passed: the requests still in flight are about to be
    /// dropped, each recorded as cut by shutdown ([`GATEWAY_SHUTDOWN_TYPE`]).
    fn cut(&self) {
        self.inner.cutting.send_replace(true);
    }

    /// A request hyper could not parse reached the gateway all the same: one record in the
    /// gateway's log (nothing of it was read, not even a key), through its budget.
    fn unparsed(&self, status: u16) {
        self.unserved(status, UNPARSED_TYPE);
    }

    /// Plain HTTP came to a TLS port: recorded like an unparsed request (nothing of it was
    /// read), answered 400.
    fn plain_http(&self) {
        self.unserved(400, HTTPS_REQUIRED_TYPE);
    }
}

impl Recorder {
    /// One record in the gateway's log, through its budget, of a request no service ran:
    /// answered `status`, for `error_type`.
    fn unserved(&self, status: u16, error_type: &str) {
        let record = AuditRecord {
            time_unix_ms: draft::now_unix_ms(),
            status,
            error_type: Some(error_type.to_owned()),
            ..AuditRecord::new(
                layer::request_id(),
                self.gateway_tenant().clone(),
                UNMATCHED_ROUTE.to_owned(),
            )
        };
        self.count(&record.tenant, record.status);
        self.append_unawaited(record, &Span::none());
    }
}
