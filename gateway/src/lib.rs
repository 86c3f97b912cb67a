//! Bulkhead's gateway: the OpenAI-compatible edge in front of the workers.
//!
//! ```text
//!  client ─HTTP─▶ auth (key → tenant) ─▶ api (validate, tokenize, admission, limits, route)
//!                                              │ Generate(token ids) over gRPC
//!                                              ▼
//!                                    workers (Info/Health refreshed; least outstanding tokens)
//!  every request ─▶ trail: one record in its tenant's hash-chained audit log (I5, I6)
//!  every request ─▶ traced: one span tree, continuing the client's trace (OpenTelemetry)
//!  operator ─HTTP─▶ admin (/healthz, /metrics, /workers, /audit/{tenant}, /policies,
//!                    /tenants; its own token); POST /tenants/reload swaps keys and limits
//! ```
//!
//! The tenant comes only from the authenticated key. The gateway tokenizes with the served
//! model's tokenizer and chat template, fetched from a worker's Info (the worker is their
//! source of truth), and refuses a request whose prompt + max tokens exceed the effective limit
//! (the minimum of the tenant's limit and every routable worker's served context and measured
//! pool) before any worker is contacted.

pub mod admin;
pub mod admission;
pub mod api;
pub mod auth;
pub mod config;
pub mod descriptors;
pub mod discovery;
mod histogram;
pub mod keys;
pub mod limits;
pub mod metrics;
pub mod policy;
pub mod preflight;
pub mod routing;
#[cfg(test)]
mod scratch;
pub mod server;
pub mod serving;
pub mod stalls;
pub mod tenant;
pub mod tenants;
mod toml_errors;
pub mod traced;
pub mod trail;
mod unread_body;
pub mod upstreams;
pub mod workers;
mod write_deadline;

pub use config::Config;
pub use server::{BoundGateway, GatewayError, Prepared, audit_dir};
