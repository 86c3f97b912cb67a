//! The final audit record of one request.
//!
//! JSON field names follow OpenTelemetry's semantic conventions where one exists
//! (`gen_ai.*`, `http.*`, `error.type`); the rest are namespaced `bulkhead.*`.

use serde::{Deserialize, Serialize};

use crate::hash::Sha256Digest;
use crate::tenant::TenantId;

/// One request's final record. Every request that reached the gateway gets exactly one (I5).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditRecord {
    /// When the request ended, in milliseconds since the Unix epoch (UTC).
    #[serde(rename = "time_unix_ms")]
    pub time_unix_ms: u64,
    /// The gateway's request id (also sent to the workers).
    #[serde(rename = "bulkhead.request.id")]
    pub request_id: String,
    /// The tenant the request was charged to; always the tenant whose log holds the record.
    #[serde(rename = "bulkhead.tenant.id")]
    pub tenant: TenantId,
    /// The id of the API key that authenticated the request; never the key or its hash.
    #[serde(rename = "bulkhead.key.id")]
    pub key_id: String,
    /// The model the client asked for.
    #[serde(rename = "gen_ai.request.model")]
    pub model: String,
    /// The HTTP route template, e.g. `/v1/chat/completions`.
    #[serde(rename = "http.route")]
    pub route: String,
    /// Prompt tokens; `None` when the request ended before it was tokenized.
    #[serde(rename = "gen_ai.usage.input_tokens")]
    pub input_tokens: Option<u64>,
    /// Completion tokens sent to the client; `None` when generation never started.
    #[serde(rename = "gen_ai.usage.output_tokens")]
    pub output_tokens: Option<u64>,
    /// Each policy plugin's decision, in chain order (empty when none ran).
    #[serde(rename = "bulkhead.policy.decisions")]
    pub policy: Vec<PolicyDecision>,
    /// The admission outcome and the layer that decided it; `None` when the request ended
    /// before admission (auth, malformed body, policy deny).
    #[serde(rename = "bulkhead.admission")]
    pub admission: Option<Admission>,
    /// The workers that served the request; `None` when none was contacted.
    #[serde(rename = "bulkhead.workers")]
    pub workers: Option<WorkerPair>,
    /// The KV handoff's integrity checks.
    #[serde(rename = "bulkhead.kv.integrity")]
    pub integrity: Integrity,
    /// The HTTP status sent to the client.
    #[serde(rename = "http.response.status_code")]
    pub status: u16,
    /// The error class (OpenAI `code`, e.g. `context_length_exceeded`); `None` on success.
    #[serde(rename = "error.type")]
    pub error_type: Option<String>,
    /// Time to first token in milliseconds; `None` when no token was sent.
    #[serde(rename = "bulkhead.ttft_ms")]
    pub ttft_ms: Option<u64>,
    /// Time from the request's arrival to its end, in milliseconds.
    #[serde(rename = "bulkhead.duration_ms")]
    pub total_ms: u64,
    /// Where the client disconnected; `None` when it did not.
    #[serde(rename = "bulkhead.disconnect.phase")]
    pub disconnect: Option<DisconnectPhase>,
    /// What the gateway did with the worker's stream after the client left: the policies'
    /// disconnect directive and how far the stream got before it was dropped. `None` when the
    /// client stayed, or left before any worker stream was open.
    #[serde(
        rename = "bulkhead.disconnect.hold",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub hold: Option<Hold>,
    /// SHA-256 of the prompt as received (the request body's messages or prompt).
    #[serde(rename = "bulkhead.prompt.sha256")]
    pub prompt_sha256: Option<Sha256Digest>,
    /// SHA-256 of the completion text sent to the client.
    #[serde(rename = "bulkhead.completion.sha256")]
    pub completion_sha256: Option<Sha256Digest>,
    /// The prompt itself: only for tenants that opted in to content capture.
    #[serde(
        rename = "bulkhead.prompt.content",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub prompt: Option<String>,
    /// The completion itself: only for tenants that opted in to content capture.
    #[serde(
        rename = "bulkhead.completion.content",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub completion: Option<String>,
    /// Set on a record that stands for many requests rather than one: those with no tenant to
    /// charge past the gateway log's budget (the record's own request id names the first and
    /// last of them, its status is 0).
    #[serde(
        rename = "bulkhead.folded",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub folded: Option<Folded>,
}

impl AuditRecord {
    /// The record of request `request_id` to `route`, charged to `tenant`, before anything
    /// else is known of it (no time, status 0, no tokens, nothing checked).
    #[must_use]
    pub fn new(request_id: String, tenant: TenantId, route: String) -> AuditRecord {
        AuditRecord {
            time_unix_ms: 0,
            request_id,
            tenant,
            key_id: String::new(),
            model: String::new(),
            route,
            input_tokens: None,
            output_tokens: None,
            policy: Vec::new(),
            admission: None,
            workers: None,
            integrity: Integrity::NotChecked,
            status: 0,
            error_type: None,
            ttft_ms: None,
            total_ms: 0,
            disconnect: None,
            hold: None,
            prompt_sha256: None,
            completion_sha256: None,
            prompt: None,
            completion: None,
            folded: None,
        }
    }
}

/// The requests one folded record stands for: each counted here instead of recorded alone.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Folded {
    /// How many requests.
    pub requests: u64,
    /// The first one's request id.
    pub first_request_id: String,
    /// The last one's request id.
    pub last_request_id: String,
    /// When the first one ended, in milliseconds since the Unix epoch (the record's
    /// `time_unix_ms` is when the last one did).
    pub since_unix_ms: u64,
    /// How many were answered with each HTTP status, by status.
    pub statuses: Vec<StatusCount>,
}

/// Requests answered with one HTTP status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusCount {
    /// The status.
    pub status: u16,
    /// How many requests got it.
    pub requests: u64,
}

/// One policy plugin's decision.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyDecision {
    /// The plugin's configured name.
    pub plugin: String,
    /// SHA-256 of the plugin's component bytes: which code decided.
    pub digest: Sha256Digest,
    /// What it decided.
    pub verdict: Verdict,
    /// The labels it attached to the request (tenant, tier, cost center…), in its order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<Label>,
}

/// A label a policy attached to a request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Label {
    /// What the label names, e.g. `tier`.
    pub key: String,
    /// Its value, e.g. `gold`.
    pub value: String,
}

/// A policy plugin's verdict.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Verdict {
    /// Allowed unchanged.
    Allow,
    /// Allowed with mutations (tags, clamped max tokens).
    Mutate,
    /// Denied with this HTTP status.
    Deny {
        /// The status the plugin chose.
        status: u16,
    },
    /// The plugin failed: it trapped, ran past its deadline or memory, answered garbage, or
    /// found no instance to run in.
    Error {
        /// How it failed (`trap`, `timeout`, `memory`, `invalid`, `busy`…); empty in records
        /// written before it was kept.
        #[serde(default, skip_serializing_if = "String::is_empty")]
        fault: String,
        /// Whether the request went on without it (its binding fails open): the policy was
        /// then not applied to this request.
        #[serde(default)]
        fail_open: bool,
    },
}

/// The admission outcome and the layer that decided it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Admission {
    /// Admitted or rejected.
    pub outcome: AdmissionOutcome,
    /// The layer whose decision this is: the last layer for an admitted request, the rejecting
    /// one otherwise.
    pub layer: Layer,
}

/// Admitted or rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdmissionOutcome {
    /// Every layer admitted the request.
    Admitted,
    /// Rejected as too long for the pool or context (4xx).
    Rejected,
    /// Could not be admitted now (429/503).
    Unavailable,
}

/// A layer that runs its own admission.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Layer {
    /// The gateway.
    Gateway,
    /// The decode worker.
    Decode,
    /// The prefill worker.
    Prefill,
}

/// The workers that served a request (the same one twice when colocated).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerPair {
    /// The prefill worker's id; `None` when prefill was never asked.
    pub prefill: Option<String>,
    /// The decode worker's id.
    pub decode: String,
}

/// The result of the KV handoff's integrity checks (manifest, checksums, tags).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "result")]
pub enum Integrity {
    /// No handoff happened (the request ended before it).
    NotChecked,
    /// Every check passed.
    Passed,
    /// A check failed (`kv_integrity_error`).
    Failed {
        /// Which check, in words.
        reason: String,
    },
}

/// An abandoned request's worker stream: held as the policies directed, then dropped.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hold {
    /// The longest hold any `on-disconnect` policy asked for.
    pub directive: Directive,
    /// How far the stream had got when the gateway dropped it (cancelling the request at
    /// the worker unless it was done).
    pub dropped: Dropped,
    /// How long the gateway held the stream after the client left, in milliseconds.
    pub held_ms: u64,
    /// Why the hold ended before its directive was met, as an error class: the worker's
    /// failure (e.g. `kv_integrity_error`: the handoff failed its checks while nobody was
    /// listening), or `gateway_shutdown` (shutdown's drain timeout cut it); `None` when it was
    /// met, or the hold limit ended it first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed: Option<String>,
}

/// A disconnect directive (the policy WIT's `directive`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Directive {
    /// Drop the stream at once.
    AbortNow,
    /// Hold until prefill is done (the gateway sees that as the first token).
    HoldUntilPrefillDone,
    /// Hold until the first token.
    HoldUntilFirstToken,
    /// Hold until the request completes.
    HoldUntilComplete,
}

impl Directive {
    /// The directive's name, as the record and the metrics write it.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Directive::AbortNow => "abort_now",
            Directive::HoldUntilPrefillDone => "hold_until_prefill_done",
            Directive::HoldUntilFirstToken => "hold_until_first_token",
            Directive::HoldUntilComplete => "hold_until_complete",
        }
    }
}

/// How far an abandoned request's worker stream had got when it was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Dropped {
    /// No token had come (the request was cancelled during prefill).
    BeforeFirstToken,
    /// After some tokens, before the end (the request was cancelled while decoding).
    AfterFirstToken,
    /// The request had completed.
    AfterDone,
}

impl Dropped {
    /// The name, as the record and the metrics write it.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Dropped::BeforeFirstToken => "before_first_token",
            Dropped::AfterFirstToken => "after_first_token",
            Dropped::AfterDone => "after_done",
        }
    }
}

/// Where in its life a request was when the client disconnected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DisconnectPhase {
    /// Before any worker was contacted.
    BeforeAdmission,
    /// Admitted by the gateway, its worker not answering yet: waiting in the worker's queue
    /// for pages, or on its way there.
    Queued,
    /// While the prompt was computed (colocated: until the first token).
    Prefill,
    /// After prefill computed the prompt, before the first token: its KV in flight to decode,
    /// or being verified there.
    BeforeFirstToken,
    /// While tokens were streaming.
    Decode,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hold_names_are_the_serialized_names() {
        for d in [
            Directive::AbortNow,
            Directive::HoldUntilPrefillDone,
            Directive::HoldUntilFirstToken,
            Directive::HoldUntilComplete,
        ] {
            assert_eq!(serde_json::to_value(d).expect("serializes"), d.name());
        }
        for d in [
            Dropped::BeforeFirstToken,
            Dropped::AfterFirstToken,
            Dropped::AfterDone,
        ] {
            assert_eq!(serde_json::to_value(d).expect("serializes"), d.name());
        }
    }

    /// A record written before a fault's kind and fail-open were kept still reads.
    #[test]
    fn an_error_verdict_without_its_fault_reads_as_failed_closed() {
        let old: Verdict = serde_json::from_str(r#"{"kind":"error"}"#).expect("reads");
        assert_eq!(
            old,
            Verdict::Error {
                fault: String::new(),
                fail_open: false
            }
        );
    }
}
