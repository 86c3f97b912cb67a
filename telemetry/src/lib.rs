//! OpenTelemetry for Bulkhead's processes, in one place.
//!
//! ```text
//!  gateway / worker code ── tracing spans (no tenant content: ids, counts, hashes) ──┐
//!                                                                                    ▼
//!  install::Telemetry ── tracing subscriber ─┬─ fmt layer (stderr, BULKHEAD_LOG filter)
//!                                            └─ OpenTelemetry layer (bulkhead* spans only)
//!                                                 └▶ batch processor thread ─OTLP HTTP/protobuf─▶ collector
//!  gateway trail ── final audit record ─▶ audit::AuditExport ─▶ batch thread ─OTLP─▶ /v1/logs
//!
//!  client ─traceparent─▶ gateway ─gRPC metadata─▶ decode ─gRPC metadata─▶ prefill  (propagation)
//! ```
//!
//! Export is off unless an OTLP endpoint is configured. The spans of requests refused for
//! their key are held to a budget ([`unauthenticated`]): a flood of them, which anyone can
//! send, does not crowd the tenants' spans out of the exporter's queue. Spans and log records are queued in
//! memory and exported by the SDK's own threads, so a slow or absent collector costs a request
//! nothing: a full queue drops telemetry, never blocks or fails the request.
//!
//! The gateway and the workers only create `tracing` spans and use [`propagation`] to carry
//! the W3C trace context across HTTP and gRPC; the binary installs the SDK with
//! [`Telemetry::install`].

pub mod audit;
mod install;
pub mod propagation;
mod redact;
pub mod unauthenticated;

pub use audit::{AuditExport, RecordTrace};
pub use install::{Otlp, OtlpEndpoint, Settings, Telemetry, TelemetryError};
pub use opentelemetry::KeyValue;
pub use redact::redacted_url;

/// The resource attribute that names a worker's role: `both`, `prefill` or `decode`.
pub const WORKER_ROLE: &str = "bulkhead.worker.role";

/// `rpc.service` of the worker protocol's spans (gateway → worker, decode → prefill).
pub const WORKER_RPC_SERVICE: &str = "bulkhead.worker.v1.Worker";
