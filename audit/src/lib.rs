//! Per-tenant, tamper-evident audit logs (invariants I5 and I6).
//!
//! Every request that reaches the gateway gets exactly one final [`AuditRecord`] in its
//! tenant's log. Each tenant's log is an append-only chain of JSON Lines segments under a data
//! directory (layout in [`layout`]): every line carries its `seq` and `prev`, the link to the
//! previous line (its exact bytes' SHA-256, or in a keyed log the MAC that line carries, an
//! HMAC-SHA256 under the operator's [`ChainKey`] of the rest of it), so editing, deleting or
//! reordering a record breaks the chain;
//! a per-tenant head file names the last durable record, so cutting the tail without rewriting
//! the head is caught too; the roster (`DIR/TENANTS`) lists every tenant whose log began, so a
//! tenant's log deleted whole is caught as well.
//!
//! - [`AuditLog`] writes: group commit, [`Durability`] per log, segment rotation, crash
//!   recovery on [`AuditLog::open`] (a torn last line, and complete lines after the head that
//!   do not chain on from it, are cut off and reported as a [`Recovery`]; a line that chains is
//!   never dropped). A log whose head is missing, or names a record the log no longer holds
//!   as recorded, is not resumed: appending to it would make the chain `verify` refuses pass
//!   again.
//! - [`read()`] pages through one tenant's records; only a [`TenantId`] names a directory, and
//!   its grammar admits no path tricks (I6).
//! - [`verify()`] checks every chain and reports each tenant's first problem by file and line.
//!
//! Tamper-evident, not tamper-proof. Unkeyed (the default), the chain and its head sit beside each
//! other and anyone can recompute them, so someone who can write the directory can rewrite it
//! unseen: edit a record and recompute every later hash and the head, append lines that chain
//! (recovery even adopts them), cut the tail and write a head naming the new last line, or delete a
//! tenant's log and strike it off the roster. Keyed ([`Config::key`], the gateway's `[audit]
//! key_file`), every line carries its own MAC (the link to it), a first record's `prev` is a MAC of
//! its tenant, and the head and roster carry a seal over what they state (see [`ChainKey`]), so
//! each of those needs the key: `verify` with the key reports them, and recovery cuts off a line
//! past the head whose MAC does not verify instead of resuming from it. Each line vouching for
//! itself also covers what no head names: the last line of the log, the lines a crash left past a
//! stale head, and the records after a head put back from an older copy cannot be replaced without
//! the key. A log says whether it is keyed (its roster's and heads' seals): it opens only with its
//! key, an unkeyed one only without a key, and `verify` without the key reports a keyed log as
//! such, never as passed. What the key does not close: a rollback of the whole directory, or of a
//! tenant's directory with its head, or of the roster, to an older copy still verifies (every file
//! in it was sealed with the key once); whoever holds the key can still rewrite anything; and
//! deleting the directory whole leaves nothing to check. That takes a copy outside it (the
//! OpenTelemetry export of each record, or the digests a reader keeps: [`Stored::digest`]).
//!
//! Elsewhere: the gateway's use of it and the HTTP read API (`bulkhead-gateway`'s `trail`), the
//! export of each record as an OpenTelemetry log record (`bulkhead-telemetry`'s `audit`).
//! Not here yet: retention.
#![warn(missing_docs)]

mod chain;
mod error;
mod hash;
pub mod layout;
mod line;
mod log;
mod log_id;
mod read;
mod record;
mod roster;
mod tenant;
mod verify;

pub use chain::{ChainKey, KeyError, KeyId, LineProblem, MIN_KEY_LEN, SealProblem};
pub use error::AuditError;
pub use hash::Sha256Digest;
pub use line::Seq;
pub use log::{AuditLog, Config, Durability, Receipt, Recovery};
pub use read::{Limit, Page, Stored, read};
pub use record::{
    Admission, AdmissionOutcome, AuditRecord, Directive, DisconnectPhase, Dropped, Folded, Hold,
    Integrity, Label, Layer, PolicyDecision, StatusCount, Verdict, WorkerPair,
};
pub use tenant::{MAX_TENANT_LEN, TenantId, TenantIdError};
pub use verify::{Anchor, Problem, Reason, Report, TenantReport, verify, verify_anchored};
