//! One request's audit record in the making: filled in as the request goes, committed exactly
//! once — by [`Trail::finish`], or on drop when the request was abandoned (the client left).

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bulkhead_audit::{
    Admission, AdmissionOutcome, AuditRecord, DisconnectPhase, Hold, Integrity, Layer,
    PolicyDecision, Sha256Digest, WorkerPair,
};
use sha2::{Digest, Sha256};
use tracing::Span;

use crate::api::ApiError;
use crate::auth::Authenticated;
use crate::workers::Route;

use super::Recorder;

/// The status recorded for a request whose client left before any response was sent (the
/// convention of several proxies; no response carried it).
pub const CLIENT_CLOSED: u16 = 499;

/// The error class recorded for a request whose client left.
pub const CLIENT_CLOSED_TYPE: &str = "client_disconnected";

/// The error class recorded for a request still running when shutdown's drain timeout ended
/// (its status: the 503 its client was told, or [`CLOSED_UNANSWERED`]).
pub const GATEWAY_SHUTDOWN_TYPE: &str = "gateway_shutdown";

/// The status recorded for a request whose connection the gateway closed before any response
/// was sent: shutdown dropped it, its cut's grace spent before it could answer (nginx's
/// convention for a connection closed without a response; none carried it).
pub const CLOSED_UNANSWERED: u16 = 444;

/// A request's audit record in the making; a cheap `Clone` shared by the layers, the handler
/// and the response stream. The record is committed once, when the request ends.
#[derive(Debug, Clone)]
pub struct Trail(Arc<Mutex<Draft>>);

#[derive(Debug)]
struct Draft {
    recorder: Recorder,
    record: AuditRecord,
    arrived: Instant,
    /// From arrival to the first text sent, to the microsecond (the record keeps milliseconds).
    ttft: Option<Duration>,
    /// Where the request is, for the record of a client that leaves.
    phase: DisconnectPhase,
    /// Whether the request was routed to a decode worker with a prefill worker: its admission
    /// ends at prefill, and a completed request passed the KV handoff's checks.
    disaggregated: bool,
    capture: bool,
    completion: Option<Sha256>,
    completion_text: String,
    committed: bool,
    /// Whether the response's head went out before the record was committed (a stream):
    /// a record the log refuses then leaves the status the client saw as it was.
    head_sent: bool,
    /// The request's span: the record's facts are mirrored onto it, and it is let go when
    /// the record is sealed.
    span: Span,
}

fn lock(m: &Mutex<Draft>) -> MutexGuard<'_, Draft> {
    // Every update is a plain assignment: a panic elsewhere leaves a usable draft.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

pub(super) fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl Trail {
    /// A draft charged to the gateway's own log until [`Trail::authenticated`] names a tenant.
    pub(super) fn new(recorder: Recorder, request_id: String, span: Span) -> Trail {
        span.record("bulkhead.request.id", request_id.as_str());
        let record = AuditRecord::new(
            request_id,
            recorder.gateway_tenant().clone(),
            super::UNMATCHED_ROUTE.to_owned(),
        );
        Trail(Arc::new(Mutex::new(Draft {
            recorder,
            record,
            arrived: Instant::now(),
            ttft: None,
            phase: DisconnectPhase::BeforeAdmission,
            disaggregated: false,
            capture: false,
            completion: None,
            completion_text: String::new(),
            committed: false,
            head_sent: false,
            span,
        })))
    }

    fn with<T>(&self, f: impl FnOnce(&mut Draft) -> T) -> T {
        f(&mut lock(&self.0))
    }

    /// The gateway's id of this request (also sent to the workers and in the response).
    pub fn request_id(&self) -> String {
        self.with(|d| d.record.request_id.clone())
    }

    /// The request is the tenant's: its record goes to the tenant's log.
    pub fn authenticated(&self, who: &Authenticated) {
        self.with(|d| {
            d.record.tenant = who.tenant.id.clone();
            d.span.record("bulkhead.tenant.id", who.tenant.id.as_str());
            d.record.key_id = who.key_id.to_string();
            d.capture = who.tenant.capture_content;
        });
    }

    /// The route template the request matched.
    pub fn route(&self, route: &str) {
        self.with(|d| d.record.route = route.to_owned());
    }

    /// The model the request asked for (or the served one when it named none).
    pub fn model(&self, model: &str) {
        self.with(|d| {
            d.record.model = model.to_owned();
            d.span.record("gen_ai.request.model", model);
        });
    }

    /// The prompt as received and its token count: hashed, and kept only for tenants that
    /// opted in to content capture.
    pub fn prompt(&self, text: &str, tokens: usize) {
        let digest = Sha256Digest::of(text.as_bytes());
        self.with(|d| {
            d.record.prompt_sha256 = Some(digest);
            d.record.input_tokens = Some(tokens as u64);
            if d.capture {
                d.record.prompt = Some(text.to_owned());
            }
        });
    }

    /// The policy plugins' decisions, in chain order.
    pub fn policy(&self, decisions: Vec<PolicyDecision>) {
        self.with(|d| d.record.policy = decisions);
    }

    /// Gateway admission passed and the request goes to `route`'s workers.
    pub fn routed(&self, route: &Route) {
        self.with(|d| {
            d.record.admission = Some(Admission {
                outcome: AdmissionOutcome::Admitted,
                layer: Layer::Gateway,
            });
            d.record.workers = Some(WorkerPair {
                prefill: route.prefill.clone(),
                decode: route.worker.clone(),
            });
            d.disaggregated = route.prefill.is_some();
            d.phase = DisconnectPhase::Queued;
        });
    }

    /// The worker took the request (answered its call with a stream): prefill runs.
    pub fn worker_answered(&self) {
        self.with(|d| d.phase = DisconnectPhase::Prefill);
    }

    /// The decode worker said its prefill worker computed the prompt: the KV is on its way.
    pub fn prefill_done(&self) {
        self.with(|d| {
            if d.phase == DisconnectPhase::Prefill {
                d.phase = DisconnectPhase::BeforeFirstToken;
            }
        });
    }

    /// Text sent to the client. The first one means every admission layer passed, and the KV
    /// handoff's checks.
    pub fn text(&self, text: &str) {
        self.with(|d| {
            if d.ttft.is_none() {
                let ttft = d.arrived.elapsed();
                d.ttft = Some(ttft);
                d.record.ttft_ms = Some(millis(ttft));
                d.phase = DisconnectPhase::Decode;
                d.admitted_by_workers();
                d.completion = Some(Sha256::new());
            }
            if let Some(h) = &mut d.completion {
                h.update(text.as_bytes());
            }
            if d.capture {
                d.completion_text.push_str(text);
            }
        });
    }

    /// The worker completed the request: its usage.
    pub fn completed(&self, prompt_tokens: u32, completion_tokens: u32) {
        self.text("");
        self.with(|d| d.record.input_tokens = Some(u64::from(prompt_tokens)));
        self.generated(completion_tokens);
    }

    /// The tokens the worker generated for the request: all of them once it completed, or
    /// those that came before it failed or was dropped — what the tenant is charged (some
    /// read only while the request was held, after its client left).
    pub fn generated(&self, completion_tokens: u32) {
        self.with(|d| {
            d.record.output_tokens = Some(u64::from(completion_tokens));
            if completion_tokens > 0 {
                // Also one read only while held, after its client left: the workers admitted
                // it all the same.
                d.admitted_by_workers();
            }
        });
    }

    /// The request failed with `error`; `refused_by` names the worker admission layer that
    /// refused it, when one did.
    pub fn failed(&self, error: &ApiError, refused_by: Option<Layer>) {
        let outcome = match error {
            ApiError::ContextLengthExceeded { .. }
            | ApiError::WorkerContextLengthExceeded { .. } => Some(AdmissionOutcome::Rejected),
            ApiError::TenantLimit(_) | ApiError::WorkerBusy { .. } | ApiError::NoHealthyWorker => {
                Some(AdmissionOutcome::Unavailable)
            }
            _ => None,
        };
        self.with(|d| {
            // A worker layer's refusal, recorded where it was seen, is the decision; the
            // handler's later report of the same error does not know the layer.
            let decided = d
                .record
                .admission
                .is_some_and(|a| a.outcome != AdmissionOutcome::Admitted);
            if let Some(outcome) = outcome.filter(|_| !decided) {
                d.record.admission = Some(Admission {
                    outcome,
                    layer: refused_by.unwrap_or(Layer::Gateway),
                });
            }
            if *error == ApiError::ClientClosedBody {
                d.record.disconnect = Some(d.phase);
            }
            if *error == ApiError::KvIntegrity {
                d.record.integrity = Integrity::Failed {
                    reason: "a worker's KV integrity check failed (decode's verification of \
                             the handoff, or a worker's check of its own pages)"
                        .into(),
                };
            }
        });
    }

    /// Ends the request with the response's status and error class, and commits the record
    /// (durably before returning, when so configured). Only the first call commits. Fails with
    /// `audit_unavailable` when the record could not be written and the gateway is configured
    /// to refuse rather than answer unaudited.
    pub async fn finish(&self, status: u16, error_type: Option<&str>) -> Result<(), ApiError> {
        let (recorder, record, span, head_sent) = {
            let mut d = lock(&self.0);
            if d.committed {
                return Ok(());
            }
            d.record.status = status;
            d.record.error_type = error_type.map(str::to_owned);
            let (record, span) = d.seal();
            (d.recorder.clone(), record, span, d.head_sent)
        };
        if !recorder.refuses_on_failure() {
            recorder.count(&record.tenant, record.status);
            let _ = recorder.commit(record, &span).await;
            return Ok(());
        }
        // Counted once the commit's outcome is known: a response not started yet whose
        // record the log refuses is answered 503 instead. Counted as recorded should the wait
        // be dropped (its client left, shutdown's cut): the record is the log's all the same.
        let mut count = CountOnDrop {
            recorder: recorder.clone(),
            tenant: record.tenant.clone(),
            status: record.status,
        };
        let committed = recorder.commit(record, &span).await;
        if committed.is_err() && !head_sent {
            count.status = crate::api::mapping(&ApiError::AuditUnavailable)
                .status
                .as_u16();
        }
        drop(count);
        committed.map_err(|_| ApiError::AuditUnavailable)
    }

    /// The client left and the worker's stream was held as the policies directed, then
    /// dropped (recorded when the last holder of the trail lets go).
    pub fn held(&self, hold: Hold) {
        self.with(|d| d.record.hold = Some(hold));
    }

    /// Whether shutdown is cutting the requests still in flight: a request that ends
    /// unfinished now was cut, not left by its client.
    pub fn cut_by_shutdown(&self) -> bool {
        self.with(|d| d.recorder.cutting())
    }

    /// What tells this request that shutdown cuts it (take it once, wait on it at each step).
    pub fn shutdown_signal(&self) -> super::ShutdownSignal {
        self.with(|d| d.recorder.shutdown_signal())
    }

    /// The status the response carries, for a request whose end is recorded elsewhere (a
    /// stream, or on drop).
    pub fn responded(&self, status: u16) {
        self.with(|d| {
            d.record.status = status;
            d.head_sent = true;
        });
    }
}

/// Counts a request whose commit is under way when dropped: as `status`, whether the commit
/// ended (and set the status its client was told) or its future was dropped.
struct CountOnDrop {
    recorder: super::Recorder,
    tenant: bulkhead_audit::TenantId,
    status: u16,
}

impl Drop for CountOnDrop {
    fn drop(&mut self) {
        self.recorder.count(&self.tenant, self.status);
    }
}

impl Draft {
    /// The worker sent something of the request: every admission layer passed (the last, the
    /// prefill worker's when disaggregated), and a disaggregated one passed the KV handoff's
    /// checks, as decode sends nothing of a request before it verified the transfer (design
    /// step 10).
    fn admitted_by_workers(&mut self) {
        self.record.admission = Some(Admission {
            outcome: AdmissionOutcome::Admitted,
            layer: if self.disaggregated {
                Layer::Prefill
            } else {
                Layer::Decode
            },
        });
        // A failure already found stays found: tokens counted again after it (the end of a
        // request whose answer was not sent) do not make it a pass.
        if self.disaggregated && self.record.integrity == Integrity::NotChecked {
            self.record.integrity = Integrity::Passed;
        }
    }

    /// The final record and the request's span; the draft is committed from here on.
    fn seal(&mut self) -> (AuditRecord, Span) {
        self.committed = true;
        self.record.time_unix_ms = now_unix_ms();
        let total = self.arrived.elapsed();
        self.record.total_ms = millis(total);
        self.record.completion_sha256 = self
            .completion
            .take()
            .map(|h| Sha256Digest(h.finalize().into()));
        if self.capture && self.record.completion_sha256.is_some() {
            self.record.completion = Some(std::mem::take(&mut self.completion_text));
        }
        let span = std::mem::replace(&mut self.span, Span::none());
        self.recorder.ended(&self.record, &span, total, self.ttft);
        (self.record.clone(), span)
    }
}

impl Drop for Draft {
    fn drop(&mut self) {
        if self.committed {
            return;
        }
        // Nobody finished the request: its client left (the server dropped the handler or the
        // response stream; a held one's hold says so, however it ended, shutdown's cut too),
        // shutdown cut it, or the gateway failed while it held it (a panic unwinding through
        // its last holder: a bug, not the client). Recorded without waiting: there is no one
        // left to answer.
        let (kind, unanswered) = if std::thread::panicking() {
            let failed = crate::api::mapping(&ApiError::Internal);
            (failed.error_type(), failed.status.as_u16())
        } else if self.recorder.cutting() && self.record.hold.is_none() {
            // Told 503 it would have been, had it answered: it was dropped first.
            (GATEWAY_SHUTDOWN_TYPE, CLOSED_UNANSWERED)
        } else {
            self.record.disconnect = Some(self.phase);
            (CLIENT_CLOSED_TYPE, CLIENT_CLOSED)
        };
        if self.record.status == 0 {
            self.record.status = unanswered;
        }
        self.record.error_type = Some(kind.to_owned());
        let (record, span) = self.seal();
        self.recorder.count(&record.tenant, record.status);
        self.recorder.append_unawaited(record, &span);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;
    use crate::scratch::Scratch;

    /// A disaggregated request whose decode worker failed the KV check after tokens came
    /// (a JSON answer: its end counts the tokens again) is recorded as failing the check.
    #[test]
    fn tokens_counted_after_an_integrity_failure_do_not_make_it_a_pass() {
        let dir = Scratch::new("draft");
        let settings = crate::config::AuditSettings::default();
        let (recorder, _) =
            Recorder::open(&dir.0, settings, None, Metrics::default(), None).expect("opens");
        let trail = recorder.trail("req".into(), Span::none());
        lock(&trail.0).disaggregated = true;
        trail.generated(2);
        assert_eq!(lock(&trail.0).record.integrity, Integrity::Passed);
        trail.failed(&ApiError::KvIntegrity, None);
        trail.generated(2);
        assert!(
            matches!(lock(&trail.0).record.integrity, Integrity::Failed { .. }),
            "{:?}",
            lock(&trail.0).record.integrity
        );
    }
}
