//! OpenTelemetry end to end: a real `bulkhead up` (gateway, decode worker, prefill worker)
//! exporting over OTLP (HTTP/protobuf) to a collector this test runs, which decodes what
//! arrives with the OTLP protos.
//!
//! - One request with a trusted client's `traceparent` (`client_trace = "continue"`) is one
//!   trace: the gateway's spans under the client's span, the decode worker's under the
//!   gateway's upstream call, the prefill worker's under decode's `Prefill` call; no span
//!   carries the prompt or the completion. By default the client's span is a link of a trace
//!   of the gateway's own.
//! - Its audit record arrives as a log record with the request id, in the same trace.
//! - A collector that is gone, or that never answers, costs requests nothing.
//! - A flood of requests without a valid key reaches the collector folded, as the gateway's
//!   log holds it.

use std::collections::HashMap;
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::routing::post;
use opentelemetry_proto::tonic::collector::logs::v1::{
    ExportLogsServiceRequest, ExportLogsServiceResponse,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use prost::Message;

use crate::up::{KEY_A, Options, Up, bounded, exchange, header, http, json};

const PROMPT: &str = "What is 2+2?";
const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";
const GENERATE: &str = "bulkhead.worker.v1.Worker/Generate";
const PREFILL: &str = "bulkhead.worker.v1.Worker/Prefill";

/// Export often, so the test does not wait for the SDK's default 5 s batches.
const FAST_EXPORT: &[(&str, &str)] = &[
    ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ("OTEL_BLRP_SCHEDULE_DELAY", "100"),
];

/// One span as the collector received it, with its resource's identity.
#[derive(Debug, Clone)]
struct Span {
    service: String,
    /// A worker's `bulkhead.worker.role` resource attribute.
    role: Option<String>,
    name: String,
    kind: i32,
    trace_id: String,
    span_id: String,
    parent: String,
    /// Each link's `trace-span` ids.
    links: Vec<String>,
    attributes: HashMap<String, String>,
}

/// One log record as the collector received it.
#[derive(Debug, Clone)]
struct Log {
    service: String,
    event_name: String,
    trace_id: String,
    span_id: String,
    attributes: HashMap<String, String>,
}

#[derive(Debug, Default)]
struct Received {
    spans: Vec<Span>,
    logs: Vec<Log>,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn text(value: &Option<AnyValue>) -> String {
    match value.as_ref().and_then(|v| v.value.as_ref()) {
        Some(any_value::Value::StringValue(s)) => s.clone(),
        Some(any_value::Value::IntValue(i)) => i.to_string(),
        Some(any_value::Value::BoolValue(b)) => b.to_string(),
        Some(any_value::Value::DoubleValue(d)) => d.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

fn attributes(kvs: &[KeyValue]) -> HashMap<String, String> {
    kvs.iter()
        .map(|kv| (kv.key.clone(), text(&kv.value)))
        .collect()
}

async fn traces(State(received): State<Arc<Mutex<Received>>>, body: Bytes) -> Vec<u8> {
    let request = ExportTraceServiceRequest::decode(body).expect("OTLP spans");
    let mut received = received.lock().expect("lock");
    for rs in request.resource_spans {
        let resource = attributes(&rs.resource.map(|r| r.attributes).unwrap_or_default());
        for span in rs.scope_spans.into_iter().flat_map(|s| s.spans) {
            received.spans.push(Span {
                service: resource.get("service.name").cloned().unwrap_or_default(),
                role: resource.get("bulkhead.worker.role").cloned(),
                name: span.name,
                kind: span.kind,
                trace_id: hex(&span.trace_id),
                span_id: hex(&span.span_id),
                parent: hex(&span.parent_span_id),
                links: span
                    .links
                    .iter()
                    .map(|l| format!("{}-{}", hex(&l.trace_id), hex(&l.span_id)))
                    .collect(),
                attributes: attributes(&span.attributes),
            });
        }
    }
    ExportTraceServiceResponse::default().encode_to_vec()
}

async fn logs(State(received): State<Arc<Mutex<Received>>>, body: Bytes) -> Vec<u8> {
    let request = ExportLogsServiceRequest::decode(body).expect("OTLP logs");
    let mut received = received.lock().expect("lock");
    for rl in request.resource_logs {
        let resource = attributes(&rl.resource.map(|r| r.attributes).unwrap_or_default());
        for log in rl.scope_logs.into_iter().flat_map(|s| s.log_records) {
            received.logs.push(Log {
                service: resource.get("service.name").cloned().unwrap_or_default(),
                event_name: log.event_name,
                trace_id: hex(&log.trace_id),
                span_id: hex(&log.span_id),
                attributes: attributes(&log.attributes),
            });
        }
    }
    ExportLogsServiceResponse::default().encode_to_vec()
}

/// An OTLP/HTTP collector on a free loopback port; [`Collector::stop`] takes it down (the port
/// then refuses connections).
struct Collector {
    endpoint: String,
    received: Arc<Mutex<Received>>,
    runtime: tokio::runtime::Runtime,
}

impl Collector {
    fn start() -> Collector {
        let received = Arc::new(Mutex::new(Received::default()));
        let listener = TcpListener::bind("127.0.0.1:0").expect("binds");
        listener.set_nonblocking(true).expect("nonblocking");
        let endpoint = format!("http://{}", listener.local_addr().expect("addr"));
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let app = axum::Router::new()
            .route("/v1/traces", post(traces))
            .route("/v1/logs", post(logs))
            .with_state(received.clone());
        runtime.spawn(async move {
            let listener = tokio::net::TcpListener::from_std(listener).expect("tokio listener");
            axum::serve(listener, app).await.expect("serves");
        });
        Collector {
            endpoint,
            received,
            runtime,
        }
    }

    /// Waits (bounded) until `done` holds for what was received; returns a copy of it then.
    fn wait_for(&self, what: &str, done: impl Fn(&Received) -> bool) -> (Vec<Span>, Vec<Log>) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            {
                let r = self.received.lock().expect("lock");
                if done(&r) {
                    return (r.spans.clone(), r.logs.clone());
                }
                assert!(
                    Instant::now() < deadline,
                    "the collector never received {what}; it has {} spans: {:#?}",
                    r.spans.len(),
                    r.spans
                        .iter()
                        .map(|s| (&s.service, &s.name, &s.trace_id))
                        .collect::<Vec<_>>()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Closes the listener and every connection.
    fn stop(self) {
        self.runtime.shutdown_timeout(Duration::from_secs(1));
    }
}

fn telemetry_toml(endpoint: &str) -> String {
    format!("[telemetry]\notlp_endpoint = \"{endpoint}\"\naudit_logs = true\n")
}

fn chat_body(stream: bool) -> String {
    serde_json::json!({
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 6, "temperature": 0, "stream": stream,
    })
    .to_string()
}

/// A chat completion with the client's trace context; (status, request id, body).
fn traced_chat(up: &Up, stream: bool) -> (u16, String, String) {
    let traceparent = format!("00-{TRACE}-{CLIENT_SPAN}-01");
    let (status, head, body) = exchange(
        &up.api,
        "POST",
        "/v1/chat/completions",
        Some(KEY_A),
        &[("traceparent", &traceparent)],
        &chat_body(stream),
    );
    let id = header(&head, "x-request-id").unwrap_or_default().to_owned();
    (status, id, body)
}

/// The one span named `name` from `service` (and `role`), failing with the whole trace.
fn one<'a>(spans: &'a [Span], service: &str, role: Option<&str>, name: &str) -> &'a Span {
    let found: Vec<&Span> = spans
        .iter()
        .filter(|s| s.service == service && s.role.as_deref() == role && s.name == name)
        .collect();
    assert_eq!(found.len(), 1, "{service} {role:?} {name}: {spans:#?}");
    found[0]
}

fn children<'a>(spans: &'a [Span], parent: &Span) -> Vec<&'a str> {
    let mut names: Vec<&str> = spans
        .iter()
        .filter(|s| s.parent == parent.span_id)
        .map(|s| s.name.as_str())
        .collect();
    names.sort_unstable();
    names
}

#[test]
fn a_request_is_one_trace_through_gateway_decode_and_prefill_and_its_record_a_log_record() {
    bounded(|| {
        let collector = Collector::start();
        let toml = format!(
            "{}client_trace = \"continue\"\n",
            telemetry_toml(&collector.endpoint)
        );
        let up = Up::launch(Options {
            toml: &toml,
            env: FAST_EXPORT,
            ..Options::default()
        });
        up.wait_routable();
        let (status, request_id, body) = traced_chat(&up, false);
        assert_eq!(status, 200, "{body}");
        assert!(request_id.starts_with("req-"), "{request_id:?}");
        let completion = json(&body)["choices"][0]["message"]["content"]
            .as_str()
            .expect("a completion")
            .to_owned();

        // Every process's spans of the request, and the audit record's log record.
        let (all, logs) = collector.wait_for("the whole trace and the audit record", |r| {
            let names: Vec<&str> = r
                .spans
                .iter()
                .filter(|s| s.trace_id == TRACE)
                .map(|s| s.name.as_str())
                .collect();
            [
                "POST /v1/chat/completions",
                "kv_transfer",
                "decode",
                PREFILL,
            ]
            .iter()
            .all(|n| names.contains(n))
                && names.iter().filter(|n| **n == GENERATE).count() == 2
                && r.logs.iter().any(|l| l.trace_id == TRACE)
        });
        let spans: Vec<Span> = all.into_iter().filter(|s| s.trace_id == TRACE).collect();

        // The gateway: its request span is the client's span's child.
        let gw = "bulkhead-gateway";
        let root = one(&spans, gw, None, "POST /v1/chat/completions");
        assert_eq!(
            root.parent, CLIENT_SPAN,
            "the client's traceparent is honoured"
        );
        assert_eq!(root.kind, SpanKind::Server as i32);
        assert_eq!(root.attributes["bulkhead.request.id"], request_id);
        assert_eq!(root.attributes["bulkhead.tenant.id"], "tenant-a");
        assert_eq!(root.attributes["http.route"], "/v1/chat/completions");
        assert_eq!(root.attributes["http.response.status_code"], "200");
        assert!(
            root.attributes["gen_ai.usage.output_tokens"]
                .parse::<u32>()
                .expect("tokens")
                > 0
        );
        assert_eq!(
            children(&spans, root),
            [
                "admission",
                "auth",
                GENERATE,
                "policy",
                "route",
                "stream",
                "tokenize"
            ]
        );
        let upstream = one(&spans, gw, None, GENERATE);
        assert_eq!(upstream.kind, SpanKind::Client as i32);

        // The decode worker: under the gateway's call, and the caller of prefill.
        let w = "bulkhead-worker";
        let decode = one(&spans, w, Some("decode"), GENERATE);
        assert_eq!(decode.kind, SpanKind::Server as i32);
        assert_eq!(
            decode.parent, upstream.span_id,
            "gateway → decode over gRPC"
        );
        assert_eq!(decode.attributes["bulkhead.request.id"], request_id);
        assert_eq!(
            children(&spans, decode),
            ["admission", PREFILL, "decode", "validate"]
        );
        let call = one(&spans, w, Some("decode"), PREFILL);
        assert_eq!(call.kind, SpanKind::Client as i32);

        // The prefill worker: under decode's call.
        let prefill = one(&spans, w, Some("prefill"), PREFILL);
        assert_eq!(prefill.kind, SpanKind::Server as i32);
        assert_eq!(prefill.parent, call.span_id, "decode → prefill over gRPC");
        assert_eq!(
            children(&spans, prefill),
            ["admission", "kv_transfer", "prefill"]
        );
        let transfer = one(&spans, w, Some("prefill"), "kv_transfer");
        assert!(
            transfer.attributes["bulkhead.kv.frames"]
                .parse::<u32>()
                .expect("frames")
                > 0
        );
        assert_eq!(
            call.attributes["bulkhead.kv.bytes"], transfer.attributes["bulkhead.kv.bytes"],
            "decode heard what prefill sent"
        );

        // Tenant content never goes into a span.
        let content =
            |v: &str| v.contains(PROMPT) || (completion.len() > 3 && v.contains(&completion));
        for s in &spans {
            for (k, v) in &s.attributes {
                assert!(!content(v), "{} {k} = {v:?} holds tenant content", s.name);
            }
        }

        // The audit record as a log record: the request's id, in the request's span.
        let record = logs
            .iter()
            .find(|l| l.attributes.get("bulkhead.request.id") == Some(&request_id))
            .unwrap_or_else(|| panic!("no log record of {request_id}: {logs:#?}"));
        assert_eq!(record.service, gw);
        assert_eq!(record.event_name, "bulkhead.audit.record");
        assert_eq!(record.trace_id, TRACE);
        assert_eq!(record.span_id, root.span_id);
        assert_eq!(record.attributes["bulkhead.tenant.id"], "tenant-a");
        assert_eq!(record.attributes["http.response.status_code"], "200");
        assert_eq!(record.attributes["bulkhead.workers.decode"], "local-decode");
        assert_eq!(record.attributes["bulkhead.kv.integrity.result"], "passed");
        assert!(record.attributes.contains_key("bulkhead.prompt.sha256"));
        assert!(!record.attributes.contains_key("bulkhead.prompt.content"));
        // Its place in the tenant's chain and its line's SHA-256, as the tenant's own read of
        // the log gives them: the collector's copy is an anchor (`audit verify --anchor`).
        let (status, page) = http(&up.api, "GET", "/v1/audit?limit=1000", Some(KEY_A), &[], "");
        assert_eq!(status, 200, "{page}");
        let page = json(&page);
        let entry = page["data"]
            .as_array()
            .expect("data")
            .iter()
            .find(|e| e["record"]["bulkhead.request.id"] == request_id.as_str())
            .expect("the tenant reads its record");
        assert_eq!(
            record.attributes["bulkhead.audit.seq"],
            entry["seq"].to_string()
        );
        assert_eq!(record.attributes["bulkhead.audit.sha256"], entry["digest"]);

        // The collector goes away: requests go on, streamed or not.
        collector.stop();
        for stream in [false, true, false] {
            let (status, _, body) = traced_chat(&up, stream);
            assert_eq!(status, 200, "{body}");
        }
    });
}

/// The collector gets the records the log takes: a flood of requests without a valid key is a
/// record each within the gateway log's budget, then folded records — never a record each,
/// which would crowd the tenants' records out of the exporter's bounded queue.
#[test]
fn a_flood_without_a_valid_key_is_exported_folded_as_the_log_holds_it() {
    bounded(|| {
        const FLOOD: u64 = 40;
        const BUDGET: u64 = 3;
        let collector = Collector::start();
        let toml = telemetry_toml(&collector.endpoint);
        let budget = format!("gateway_records_per_minute = {BUDGET}");
        let up = Up::launch(Options {
            toml: &toml,
            env: FAST_EXPORT,
            replace: &[("gateway_records_per_minute = 3000", &budget)],
            ..Options::default()
        });
        up.wait_routable();
        let started = Instant::now();
        for _ in 0..FLOOD {
            assert_eq!(up.chat("sk-wrong", &[], &chat_body(false)).0, 401);
        }
        let windows = started.elapsed().as_secs() + 2;
        let (status, request_id, body) = traced_chat(&up, false);
        assert_eq!(status, 200, "{body}");
        // By default the client's traceparent is a link: the request's trace is the gateway's
        // own (a client, unauthenticated when it is read, cannot join another's trace).
        let mine = |s: &Span| {
            s.name == "POST /v1/chat/completions"
                && s.attributes.get("bulkhead.request.id") == Some(&request_id)
        };
        let (spans, _) = collector.wait_for("the request's span", |r| r.spans.iter().any(mine));
        let root = spans.iter().find(|s| mine(s)).expect("found above");
        assert_ne!(root.trace_id, TRACE, "{root:#?}");
        assert_eq!(root.parent, "", "{root:#?}");
        assert_eq!(root.links, [format!("{TRACE}-{CLIENT_SPAN}")], "{root:#?}");

        let gateway = |l: &&Log| {
            l.attributes.get("bulkhead.tenant.id").map(String::as_str) == Some("_gateway")
        };
        let folded = |l: &Log| -> u64 {
            l.attributes
                .get("bulkhead.folded.requests")
                .map_or(0, |n| n.parse().expect("a count"))
        };
        let (_, logs) = collector.wait_for("the flood, and the tenant's record", |r| {
            let flood: u64 = r
                .logs
                .iter()
                .filter(gateway)
                .map(|l| folded(l).max(1))
                .sum();
            flood == FLOOD
                && r.logs
                    .iter()
                    .any(|l| l.attributes.get("bulkhead.request.id") == Some(&request_id))
        });
        let (alone, folds): (Vec<&Log>, Vec<&Log>) =
            logs.iter().filter(gateway).partition(|l| folded(l) == 0);
        assert_eq!(alone.len() as u64, BUDGET, "{alone:#?}");
        assert!(
            !folds.is_empty() && folds.len() as u64 <= windows,
            "{} folded records for a flood of {windows} windows at most",
            folds.len()
        );
        // Each exported as the log holds it.
        let held = up.wait_records("_gateway", alone.len() + folds.len());
        assert_eq!(held.len(), alone.len() + folds.len());
    });
}

#[test]
fn a_collector_that_never_answers_delays_no_request() {
    bounded(|| {
        // Accepts connections and never answers: every export waits for its timeout (30 s).
        let silent = TcpListener::bind("127.0.0.1:0").expect("binds");
        let endpoint = format!("http://{}", silent.local_addr().expect("addr"));
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for conn in silent.incoming().map_while(Result::ok) {
                held.push(conn);
            }
        });
        let toml = telemetry_toml(&endpoint);
        let mut env = FAST_EXPORT.to_vec();
        env.push(("OTEL_EXPORTER_OTLP_TIMEOUT", "30000"));
        let up = Up::launch(Options {
            toml: &toml,
            env: &env,
            ..Options::default()
        });
        up.wait_routable();
        // Each request takes well under a second here; one that waited for an export would
        // wait for seconds (the SDK's flush timeout, or the export's 30 s).
        let started = Instant::now();
        for stream in [false, true, false, true] {
            let one = Instant::now();
            let (status, _, body) = traced_chat(&up, stream);
            assert_eq!(status, 200, "{body}");
            assert!(
                one.elapsed() < Duration::from_secs(8),
                "a request took {:?}: it waited for the collector",
                one.elapsed()
            );
        }
        assert!(
            started.elapsed() < Duration::from_secs(12),
            "four requests took {:?}: they waited for the collector",
            started.elapsed()
        );
        // Every request was audited all the same.
        assert_eq!(up.wait_records("tenant-a", 4).len(), 4);
    });
}
