//! The storage layer's errors.

use std::io;
use std::path::PathBuf;

use crate::chain::SealProblem;
use crate::line::Seq;
use crate::tenant::TenantId;

/// What an operator can do about a tenant's log the gateway refuses to resume.
const AFRESH: &str = "The gateway does not start on it, and its records stay as found: start the gateway on a new data directory (unkeyed, the tenant's directory can instead be moved aside and its line struck from TENANTS; a keyed roster's seal takes the key)";

/// Why an audit log operation failed.
#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    /// A file system operation failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// Another process holds the data directory.
    #[error("{path} is locked by another writer")]
    Locked {
        /// The lock file.
        path: PathBuf,
    },
    /// A record was appended to a tenant other than its own.
    #[error("a record of tenant {record} cannot go to tenant {log}'s log")]
    TenantMismatch {
        /// The log appended to.
        log: TenantId,
        /// The tenant the record names.
        record: TenantId,
    },
    /// A complete line that must be read is not a valid record of this chain.
    #[error("{path}:{line}: {reason}; run `bulkhead audit verify`")]
    Corrupt {
        /// The segment.
        path: PathBuf,
        /// The 1-based line number.
        line: u64,
        /// Why, in words.
        reason: String,
    },
    /// The head names a record the log no longer has: acknowledged records are missing.
    #[error(
        "{tenant}: the head says record {head} is durable but the log does not end with it (records cut, or moved); `bulkhead audit verify` locates it"
    )]
    HeadAhead {
        /// The tenant.
        tenant: TenantId,
        /// The record the head names.
        head: Seq,
    },
    /// The record the head names is not in the log as the head recorded it: the log was
    /// modified after it was written.
    #[error(
        "{tenant}: the log's record {head} is not the one its head names: the log was modified; `bulkhead audit verify` locates it"
    )]
    HeadMismatch {
        /// The tenant.
        tenant: TenantId,
        /// The record the head names.
        head: Seq,
    },
    /// The tenant has records but no head: the head was deleted (a tenant's directory gets its
    /// head before its first line, so no crash leaves records without one). The gateway does
    /// not resume a chain it cannot check.
    #[error(
        "{tenant}: the log has records but no head file: deleted (no crash leaves records without one); `bulkhead audit verify` checks the chain. {AFRESH}"
    )]
    HeadMissing {
        /// The tenant.
        tenant: TenantId,
    },
    /// Keyed: past the head, a line that does not chain is followed by lines that carry the
    /// log's MAC. A crash leaves a torn or unreadable tail, and a failed write stops the log,
    /// so the gateway wrote those lines after the broken one: it was edited, or the head put
    /// back from an older copy. Cutting would destroy the records that show it.
    #[error(
        "{tenant}: line {line} of {path} does not follow the record before it, yet line {vouched} after it carries the log's MAC: the log was modified (or its head put back from an older copy); `bulkhead audit verify` locates it, and nothing was cut"
    )]
    VouchedPastBreak {
        /// The tenant.
        tenant: TenantId,
        /// The segment of the line that does not chain.
        path: PathBuf,
        /// That line, 1-based.
        line: u64,
        /// The first line after it with a valid MAC, 1-based.
        vouched: u64,
    },
    /// A keyed data directory's id (`LOG-ID`) cannot be used.
    #[error("{path}: {reason}; the key of this directory's seals is derived with it")]
    BadLogId {
        /// The id's file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The head says no record is durable yet, but more than a crash can leave stands behind
    /// it (a tenant's first record goes down alone with a head naming it).
    #[error(
        "{tenant}: the head says no record is written yet, but the log holds {records}: the head was rewritten (records may have been cut); `bulkhead audit verify` checks the chain. {AFRESH}"
    )]
    GenesisBehind {
        /// The tenant.
        tenant: TenantId,
        /// The records that chain on past the head.
        records: u64,
    },
    /// The data directory holds tenant logs but no roster: deleted, or a directory written
    /// before the roster existed.
    #[error(
        "{path} is missing, yet the directory holds tenant logs: the roster was deleted (with a tenant's log?), or the logs predate it; check them with `bulkhead audit verify`, then list their ids in it, one per line, to adopt them (`ls` the directory, without LOCK)"
    )]
    RosterMissing {
        /// The roster's path.
        path: PathBuf,
    },
    /// The roster has a line that is not a tenant id, or lists one twice.
    #[error("{path}: {reason}")]
    BadRoster {
        /// The roster's path.
        path: PathBuf,
        /// Why, in words.
        reason: String,
    },
    /// The roster lists a tenant whose directory is gone: its log was deleted.
    #[error(
        "{tenant}: the roster lists this tenant but its log directory is gone or emptied (deleted); `bulkhead audit verify` reports it, and only striking its line from TENANTS lets the gateway start without it (unkeyed; a keyed roster's seal takes the key, so a keyed log starts again on a new data directory)"
    )]
    TenantLogMissing {
        /// The tenant.
        tenant: TenantId,
    },
    /// A tenant directory with contents that the roster does not list: placed there, or the
    /// roster was edited.
    #[error(
        "{tenant}: a log directory the roster (TENANTS) does not list: placed there, or the roster was edited; `bulkhead audit verify` checks it"
    )]
    TenantUnlisted {
        /// The tenant.
        tenant: TenantId,
    },
    /// The log is keyed (`path`, a head or the roster, is sealed), and it is opened without a
    /// key.
    #[error(
        "{path} is sealed: this audit log is keyed (HMAC-SHA256), and no key was given; set `[audit] key_file` to the file holding the key it was written with"
    )]
    KeyedLog {
        /// The sealed file.
        path: PathBuf,
    },
    /// The log is unkeyed (`path`, a head or the roster, has no seal), and it is opened with a
    /// key: a keyed chain does not extend an unkeyed log, which anyone who can write it could
    /// have rewritten.
    #[error(
        "{path} has no seal: this audit log is unkeyed, and `[audit] key_file` is set; keyed logs start in a new data directory (keep this one, checked with `bulkhead audit verify`), or remove `key_file` to go on unkeyed"
    )]
    UnkeyedLog {
        /// The file without a seal.
        path: PathBuf,
    },
    /// The log was sealed with another key.
    #[error(
        "{path} was sealed with another key: the key in `[audit] key_file` does not match this audit log's"
    )]
    WrongKey {
        /// The sealed file.
        path: PathBuf,
    },
    /// A seal names this key and does not verify: the file was edited.
    #[error(
        "{path}: its seal does not verify under the key it names (this log's): the file was edited; `bulkhead audit verify --key-file` checks the log"
    )]
    SealBroken {
        /// The sealed file.
        path: PathBuf,
    },
    /// The head file cannot be read.
    #[error("{tenant}: {reason}")]
    BadHead {
        /// The tenant.
        tenant: TenantId,
        /// Why, in words.
        reason: String,
    },
    /// A record could not be encoded.
    #[error("cannot encode record: {0}")]
    Encode(#[from] serde_json::Error),
    /// An earlier write or fsync failed; nothing is appended until the log is reopened.
    #[error("the audit log stopped after a failed write ({reason}); reopen it to recover")]
    Poisoned {
        /// The first failure.
        reason: String,
    },
}

impl AuditError {
    /// `path`'s seal does not fit the key the log is opened with.
    pub(crate) fn seal(path: impl Into<PathBuf>, problem: SealProblem) -> Self {
        let path = path.into();
        match problem {
            SealProblem::Keyed => Self::KeyedLog { path },
            SealProblem::Unkeyed => Self::UnkeyedLog { path },
            SealProblem::WrongKey => Self::WrongKey { path },
            SealProblem::Broken => Self::SealBroken { path },
        }
    }
}

pub(crate) fn io_err(
    op: &'static str,
    path: impl Into<PathBuf>,
) -> impl FnOnce(io::Error) -> AuditError {
    let path = path.into();
    move |source| AuditError::Io { op, path, source }
}
