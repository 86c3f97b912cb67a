//! Each final audit record as an OpenTelemetry log record (issue 6's optional export).
//!
//! The record's own JSON names are the attributes (they follow `gen_ai.*`, `http.*` and
//! `error.type` where OpenTelemetry has a name; `bulkhead.*` otherwise). Nested objects are
//! flattened with dots (`bulkhead.admission.layer`, `bulkhead.workers.decode`,
//! `bulkhead.kv.integrity.result`); the policy decisions stay a list of maps. The prompt and
//! completion text — present only for tenants that opted in to content capture — never leave
//! the tenant's own log: only their SHA-256 digests are exported. The log record carries the
//! request's trace and span id, so a trace and its audit record find each other, and the
//! record's place in its tenant's chain with its line's SHA-256, so the collector holds an
//! anchor for every record the log took.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bulkhead_audit::{AuditRecord, Seq, Sha256Digest};
use opentelemetry::logs::{AnyValue, LogRecord as _, Logger as _, LoggerProvider as _, Severity};
use opentelemetry::trace::{SpanContext, TraceContextExt as _};
use opentelemetry::{Key, StringValue};
use opentelemetry_sdk::logs::{SdkLogger, SdkLoggerProvider};
use serde_json::Value;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

/// The log records' event name.
pub const EVENT_NAME: &str = "bulkhead.audit.record";

/// The attribute of the record's place in its tenant's chain.
const SEQ: &str = "bulkhead.audit.seq";

/// The attribute of the SHA-256 of the record's line in the log.
const SHA256: &str = "bulkhead.audit.sha256";

/// Exports final audit records as log records; a cheap `Clone`. Emitting queues the record
/// for the SDK's export thread and never blocks.
#[derive(Debug, Clone)]
pub struct AuditExport {
    logger: SdkLogger,
}

impl AuditExport {
    pub(crate) fn new(provider: &SdkLoggerProvider) -> AuditExport {
        AuditExport {
            logger: provider.logger("bulkhead.audit"),
        }
    }

    /// Emits `record`, tied to `trace` (its request's) when it has one, with its place in its
    /// tenant's chain and its line's SHA-256 when the log holds it durably (`bulkhead.audit.seq`,
    /// `bulkhead.audit.sha256`): the collector's copy is then an anchor that shows the log
    /// rolled back (`bulkhead audit verify --anchor`).
    pub fn export(
        &self,
        record: AuditRecord,
        trace: &RecordTrace,
        place: Option<(Seq, Sha256Digest)>,
    ) {
        let mut log = self.logger.create_log_record();
        log.set_event_name(EVENT_NAME);
        log.set_timestamp(UNIX_EPOCH + Duration::from_millis(record.time_unix_ms));
        log.set_observed_timestamp(SystemTime::now());
        let severity = severity(record.status);
        log.set_severity_number(severity);
        log.set_severity_text(severity.name());
        log.set_body(AnyValue::from(format!(
            "{} {} {}",
            record.request_id, record.route, record.status
        )));
        log.add_attributes(attributes(record));
        if let Some((seq, line_sha256)) = place {
            log.add_attributes([
                (
                    Key::from_static_str(SEQ),
                    AnyValue::from(i64::try_from(seq.0).unwrap_or(i64::MAX)),
                ),
                (
                    Key::from_static_str(SHA256),
                    AnyValue::from(line_sha256.to_string()),
                ),
            ]);
        }
        let sc = &trace.0;
        if sc.is_valid() {
            log.set_trace_context(sc.trace_id(), sc.span_id(), Some(sc.trace_flags()));
        }
        self.logger.emit(log);
    }
}

/// The trace a record is exported in: its request span's, taken when the request ends (a copy
/// of its ids, not the span, which a record waiting to be durable would keep open).
#[derive(Debug, Clone)]
pub struct RecordTrace(SpanContext);

impl RecordTrace {
    /// The trace of `span`.
    pub fn of(span: &Span) -> RecordTrace {
        RecordTrace(span.context().span().span_context().clone())
    }

    /// No trace (a folded record, a request no service ran).
    pub fn none() -> RecordTrace {
        RecordTrace(SpanContext::empty_context())
    }
}

/// Served: INFO; refused by a rule or abandoned by its client (4xx): WARN; failed (5xx): ERROR.
fn severity(status: u16) -> Severity {
    match status {
        500.. => Severity::Error,
        400..=499 => Severity::Warn,
        _ => Severity::Info,
    }
}

/// The record's attributes: its JSON fields, flattened; never the content fields (dropped
/// here, not copied).
pub fn attributes(mut record: AuditRecord) -> Vec<(Key, AnyValue)> {
    record.prompt = None;
    record.completion = None;
    let mut out = Vec::new();
    // A record always serializes: every field is a string, number, enum or list of them.
    if let Ok(json) = serde_json::to_value(&record) {
        flatten(String::new(), json, &mut out);
    }
    out
}

fn flatten(name: String, value: Value, out: &mut Vec<(Key, AnyValue)>) {
    match value {
        Value::Null => {}
        Value::Object(fields) => {
            for (k, v) in fields {
                let name = if name.is_empty() {
                    k
                } else {
                    format!("{name}.{k}")
                };
                flatten(name, v, out);
            }
        }
        other => {
            if let Some(v) = any(other) {
                out.push((Key::from(name), v));
            }
        }
    }
}

fn any(value: Value) -> Option<AnyValue> {
    Some(match value {
        Value::Null => return None,
        Value::Bool(b) => AnyValue::Boolean(b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => AnyValue::Int(i),
            None => AnyValue::Double(n.as_f64()?),
        },
        Value::String(s) => AnyValue::String(StringValue::from(s)),
        Value::Array(items) => {
            AnyValue::ListAny(Box::new(items.into_iter().filter_map(any).collect()))
        }
        Value::Object(fields) => AnyValue::Map(Box::new(
            fields
                .into_iter()
                .filter_map(|(k, v)| Some((Key::from(k), any(v)?)))
                .collect(),
        )),
    })
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use bulkhead_audit::{
        Admission, AdmissionOutcome, Integrity, Layer, PolicyDecision, Sha256Digest, TenantId,
        Verdict, WorkerPair,
    };

    use super::*;

    fn record() -> AuditRecord {
        AuditRecord {
            time_unix_ms: 1_700_000_000_123,
            request_id: "req-0123".into(),
            tenant: TenantId::new("tenant-a").expect("valid"),
            key_id: "k-1".into(),
            model: "smollm2".into(),
            route: "/v1/chat/completions".into(),
            input_tokens: Some(31),
            output_tokens: Some(4),
            policy: vec![PolicyDecision {
                plugin: "length-limit".into(),
                digest: Sha256Digest::of(b"component"),
                verdict: Verdict::Deny { status: 403 },
                tags: Vec::new(),
            }],
            admission: Some(Admission {
                outcome: AdmissionOutcome::Admitted,
                layer: Layer::Prefill,
            }),
            workers: Some(WorkerPair {
                prefill: Some("local-prefill".into()),
                decode: "local-decode".into(),
            }),
            integrity: Integrity::Passed,
            status: 200,
            error_type: None,
            ttft_ms: Some(12),
            total_ms: 40,
            disconnect: None,
            hold: None,
            prompt_sha256: Some(Sha256Digest::of(b"the prompt")),
            completion_sha256: Some(Sha256Digest::of(b"the completion")),
            prompt: Some("the prompt".into()),
            completion: Some("the completion".into()),
            folded: None,
        }
    }

    fn by_name(record: AuditRecord) -> HashMap<String, AnyValue> {
        attributes(record)
            .into_iter()
            .map(|(k, v)| (k.as_str().to_owned(), v))
            .collect()
    }

    fn string(s: &str) -> AnyValue {
        AnyValue::String(s.to_owned().into())
    }

    #[test]
    fn the_records_own_names_are_the_attributes_flattened() {
        let a = by_name(record());
        assert_eq!(a["bulkhead.request.id"], string("req-0123"));
        assert_eq!(a["bulkhead.tenant.id"], string("tenant-a"));
        assert_eq!(a["gen_ai.request.model"], string("smollm2"));
        assert_eq!(a["gen_ai.usage.input_tokens"], AnyValue::Int(31));
        assert_eq!(a["gen_ai.usage.output_tokens"], AnyValue::Int(4));
        assert_eq!(a["http.route"], string("/v1/chat/completions"));
        assert_eq!(a["http.response.status_code"], AnyValue::Int(200));
        assert_eq!(a["bulkhead.admission.outcome"], string("admitted"));
        assert_eq!(a["bulkhead.admission.layer"], string("prefill"));
        assert_eq!(a["bulkhead.workers.decode"], string("local-decode"));
        assert_eq!(a["bulkhead.workers.prefill"], string("local-prefill"));
        assert_eq!(a["bulkhead.kv.integrity.result"], string("passed"));
        assert_eq!(
            a["bulkhead.prompt.sha256"],
            string(&Sha256Digest::of(b"the prompt").to_string())
        );
        // Absent values are absent, not empty.
        assert!(!a.contains_key("error.type"));
        assert!(!a.contains_key("bulkhead.disconnect.phase"));
        let AnyValue::ListAny(decisions) = &a["bulkhead.policy.decisions"] else {
            panic!("a list: {:?}", a["bulkhead.policy.decisions"]);
        };
        let AnyValue::Map(first) = &decisions[0] else {
            panic!("a map: {decisions:?}");
        };
        assert_eq!(first[&Key::from("plugin")], string("length-limit"));
        let AnyValue::Map(verdict) = &first[&Key::from("verdict")] else {
            panic!("a map: {first:?}");
        };
        assert_eq!(verdict[&Key::from("status")], AnyValue::Int(403));
    }

    #[test]
    fn captured_content_is_never_exported() {
        let a = by_name(record());
        assert!(!a.contains_key("bulkhead.prompt.content"));
        assert!(!a.contains_key("bulkhead.completion.content"));
        let all = format!("{a:?}");
        assert!(!all.contains("the prompt"), "{all}");
        assert!(!all.contains("the completion"), "{all}");
    }

    #[test]
    fn severity_follows_the_status_class() {
        assert_eq!(severity(200), Severity::Info);
        assert_eq!(severity(403), Severity::Warn);
        assert_eq!(severity(499), Severity::Warn);
        assert_eq!(severity(500), Severity::Error);
        assert_eq!(severity(503), Severity::Error);
    }
}
