//! The worker's spans (OpenTelemetry, through `tracing`): one server span per call that
//! continues the caller's trace from the gRPC metadata, and the steps of a request under it.
//!
//! ```text
//!  gateway ─▶ bulkhead.worker.v1.Worker/Generate   (server; colocated or decode worker)
//!             ├─ validate      tokenize and check the request
//!             ├─ admission     engine admission (decode: and the page reservation)
//!             ├─ bulkhead.worker.v1.Worker/Prefill (client; decode only: its context goes on)
//!             │    └─▶ bulkhead.worker.v1.Worker/Prefill   (server; the prefill worker)
//!             │         ├─ admission     admission into the prefill worker's own pool
//!             │         ├─ prefill       the prompt's forward pass
//!             │         └─ kv_transfer   pages to decode's data plane (frames, bytes)
//!             ├─ prefill       colocated only: admitted → first token
//!             └─ decode        first token → done
//! ```
//!
//! Ids, roles, token counts, sizes and error classes only: never a prompt or its text.

use tonic::Status;
use tonic::metadata::MetadataMap;
use tracing::Span;
use tracing::field::Empty;

use bulkhead_telemetry::{WORKER_RPC_SERVICE, propagation};

use super::proto;
use super::validate::MAX_LABEL_BYTES;
use crate::printable::printable;

/// The server span of a worker call, continuing the caller's trace (`traceparent` in its
/// metadata). `method`: `Generate` or `Prefill`.
pub fn server(
    method: &'static str,
    role: &'static str,
    request_id: &str,
    tenant: &str,
    metadata: &MetadataMap,
) -> Span {
    let span = tracing::info_span!(
        "rpc",
        otel.name = format!("{WORKER_RPC_SERVICE}/{method}"),
        otel.kind = "server",
        otel.status_code = Empty,
        rpc.system = "grpc",
        rpc.service = WORKER_RPC_SERVICE,
        rpc.method = method,
        bulkhead.worker.role = role,
        // The caller's labels, before their bound is checked: a long one is cut here (it
        // would be logged and exported whole with every event of the call).
        bulkhead.request.id = printable(request_id, MAX_LABEL_BYTES),
        bulkhead.tenant.id = printable(tenant, MAX_LABEL_BYTES),
        gen_ai.usage.input_tokens = Empty,
        gen_ai.request.max_tokens = Empty,
        gen_ai.usage.output_tokens = Empty,
        error.type = Empty,
    );
    propagation::continue_trace(&span, metadata.as_ref());
    span
}

/// The client span of decode's `Prefill` call; its context goes into `metadata`.
pub fn prefill_call(metadata: &mut MetadataMap) -> Span {
    let span = tracing::info_span!(
        "rpc",
        otel.name = format!("{WORKER_RPC_SERVICE}/Prefill"),
        otel.kind = "client",
        otel.status_code = Empty,
        rpc.system = "grpc",
        rpc.service = WORKER_RPC_SERVICE,
        rpc.method = "Prefill",
        bulkhead.kv.frames = Empty,
        bulkhead.kv.bytes = Empty,
        error.type = Empty,
    );
    propagation::inject(&span, metadata.as_mut());
    span
}

/// Marks `span` failed with the worker protocol's code of `status` (its `bulkhead-error-code`,
/// `unknown` without one).
pub fn failed(span: &Span, status: &Status) {
    span.record("error.type", proto::error_code(status).unwrap_or("unknown"));
    span.record("otel.status_code", "ERROR");
}
