//! Prometheus metrics: counters kept here, gauges read from the engine, and the text
//! exposition format written by hand (one small function, unit-tested).

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::engine::{Failure, SubmitError, TransferStats};
use crate::model::SeqFailure;

use super::actor::EngineStats;
use super::error::{ServeError, ValidationError};
use super::grpc_incoming;

/// How a request ended, as counted in `bulkhead_requests_total{outcome=...}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// End of sequence or a stop sequence.
    Stop,
    /// `max_new_tokens` reached.
    Length,
    /// A prefill worker's: the prompt computed and its KV sent whole to the decode worker.
    Prefilled,
    /// The client went away before the end.
    Cancelled,
    RejectedContextLength,
    RejectedQueueFull,
    /// Waited for KV pages past the queue timeout.
    RejectedQueueTimeout,
    RejectedInvalid,
    FailedKvIntegrity,
    /// The prefill side of a transfer failed, closed early or timed out.
    FailedPrefill,
    FailedInternal,
}

impl Outcome {
    pub const ALL: [Outcome; 11] = [
        Outcome::Stop,
        Outcome::Length,
        Outcome::Prefilled,
        Outcome::Cancelled,
        Outcome::RejectedContextLength,
        Outcome::RejectedQueueFull,
        Outcome::RejectedQueueTimeout,
        Outcome::RejectedInvalid,
        Outcome::FailedKvIntegrity,
        Outcome::FailedPrefill,
        Outcome::FailedInternal,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Outcome::Stop => "stop",
            Outcome::Length => "length",
            Outcome::Prefilled => "prefilled",
            Outcome::Cancelled => "cancelled",
            Outcome::RejectedContextLength => "rejected_context_length",
            Outcome::RejectedQueueFull => "rejected_queue_full",
            Outcome::RejectedQueueTimeout => "rejected_queue_timeout",
            Outcome::RejectedInvalid => "rejected_invalid",
            Outcome::FailedKvIntegrity => "failed_kv_integrity",
            Outcome::FailedPrefill => "failed_prefill",
            Outcome::FailedInternal => "failed_internal",
        }
    }

    fn index(self) -> usize {
        self as usize
    }

    /// The outcome of a request that failed after admission.
    pub fn failed(f: &Failure) -> Outcome {
        match f {
            Failure::Forward(SeqFailure::Integrity(_))
            | Failure::Transfer(_)
            | Failure::PrefillIntegrity => Outcome::FailedKvIntegrity,
            Failure::Forward(SeqFailure::TokenOutOfRange { .. } | SeqFailure::Internal(_)) => {
                Outcome::FailedInternal
            }
            Failure::PrefillClosed(_) | Failure::TransferTimedOut(_) => Outcome::FailedPrefill,
            Failure::QueueTimedOut(_) => Outcome::RejectedQueueTimeout,
            // The pair disagreeing (see `error::status`): prefill failed this request.
            Failure::PrefillRejected(SubmitError::Invalid(_)) => Outcome::FailedPrefill,
            Failure::PrefillRejected(e) => Outcome::refused(&ServeError::Submit(e.clone())),
        }
    }

    /// The outcome of a request refused before or at submission.
    pub fn refused(e: &ServeError) -> Outcome {
        match e {
            ServeError::Invalid(ValidationError::ChatSandbox) => Outcome::FailedInternal,
            // Meant for another process (this one restarted since it was checked), or from a
            // decode worker of another model.
            ServeError::Invalid(_)
            | ServeError::OtherInstance { .. }
            | ServeError::OtherModel { .. } => Outcome::RejectedInvalid,
            ServeError::Submit(s) => match s {
                SubmitError::ContextLengthExceeded { .. } => Outcome::RejectedContextLength,
                SubmitError::QueueFull { .. } => Outcome::RejectedQueueFull,
                SubmitError::EmptyPrompt
                | SubmitError::NoNewTokens
                | SubmitError::TokenOutOfRange { .. }
                | SubmitError::ReservationMismatch(_)
                | SubmitError::Invalid(_) => Outcome::RejectedInvalid,
                SubmitError::DuplicateId(_) => Outcome::FailedInternal,
            },
            ServeError::Failed(f) => Outcome::failed(f),
            ServeError::EngineGone
            | ServeError::EngineStalled { .. }
            | ServeError::Internal { .. } => Outcome::FailedInternal,
            ServeError::PrefillUnavailable { .. } => Outcome::FailedPrefill,
        }
    }
}

/// The worker's counters; shared by the service, the engine thread's sinks and `/metrics`.
#[derive(Debug, Default)]
pub struct Metrics {
    requests: [AtomicU64; Outcome::ALL.len()],
    generated_tokens: AtomicU64,
    /// Prefill role: transfers being written to decode workers, and their prompt tokens.
    sending: AtomicU64,
    sending_tokens: AtomicU64,
    /// Prompt tokens the engine computed, as of its last step.
    computed_prompt_tokens: AtomicU64,
    /// The gRPC server's connections.
    grpc_connections: Arc<grpc_incoming::Counts>,
}

/// One transfer being sent (prefill role), counted in the in-flight gauges until dropped.
#[derive(Debug)]
pub struct Sending<'a> {
    metrics: &'a Metrics,
    tokens: u64,
}

impl Drop for Sending<'_> {
    fn drop(&mut self) {
        self.metrics.sending.fetch_sub(1, Ordering::Relaxed);
        self.metrics
            .sending_tokens
            .fetch_sub(self.tokens, Ordering::Relaxed);
    }
}

impl Metrics {
    /// Counts a transfer of `tokens` prompt tokens as in flight on the sending side until the
    /// returned guard drops.
    pub fn sending(&self, tokens: u64) -> Sending<'_> {
        self.sending.fetch_add(1, Ordering::Relaxed);
        self.sending_tokens.fetch_add(tokens, Ordering::Relaxed);
        Sending {
            metrics: self,
            tokens,
        }
    }

    /// Where the gRPC server counts its connections.
    pub fn grpc_connections(&self) -> &Arc<grpc_incoming::Counts> {
        &self.grpc_connections
    }

    pub fn count(&self, outcome: Outcome) {
        self.requests[outcome.index()].fetch_add(1, Ordering::Relaxed);
    }

    pub fn add_generated(&self, tokens: u64) {
        self.generated_tokens.fetch_add(tokens, Ordering::Relaxed);
    }

    pub fn requests(&self, outcome: Outcome) -> u64 {
        self.requests[outcome.index()].load(Ordering::Relaxed)
    }

    /// The engine thread's count after each step.
    pub fn set_computed_prompt_tokens(&self, tokens: u64) {
        self.computed_prompt_tokens.store(tokens, Ordering::Relaxed);
    }

    /// Prompt tokens the engine computed since it started, as of its last step: rises while
    /// it computes any prompt.
    pub fn computed_prompt_tokens(&self) -> u64 {
        self.computed_prompt_tokens.load(Ordering::Relaxed)
    }

    /// Tokens the engine computed since it started, prompt and generated: rises while it does
    /// any work, a started request's prompt included (whose chunks share each step with the
    /// prompts and answers beside it).
    pub fn computed_tokens(&self) -> u64 {
        self.computed_prompt_tokens()
            .saturating_add(self.generated_tokens())
    }

    pub fn generated_tokens(&self) -> u64 {
        self.generated_tokens.load(Ordering::Relaxed)
    }

    /// The Prometheus text exposition of these counters and of `stats`, the engine's, when it
    /// answered: gone or stuck in one step, its gauges are left out, and the counters kept here
    /// are what tells an operator what happened.
    pub fn render(&self, stats: Option<&EngineStats>) -> String {
        let mut out = String::new();
        let name = "bulkhead_engine_up";
        family(
            &mut out,
            name,
            "gauge",
            "1 while the engine thread answers; 0 once it is gone or stuck in one step (its gauges are left out then).",
        );
        let _ = writeln!(out, "{name} {}", u8::from(stats.is_some()));
        if let Some(stats) = stats {
            self.render_engine(&mut out, stats);
        }
        let (open, over_bound, out_of_time, evicted) = self.grpc_connections.get();
        let name = "bulkhead_grpc_connections";
        family(&mut out, name, "gauge", "gRPC connections open.");
        let _ = writeln!(out, "{name} {open}");
        let name = "bulkhead_grpc_connections_closed_total";
        family(
            &mut out,
            name,
            "counter",
            "gRPC connections the worker closed: over its bound on open ones, with no call presenting the cluster token in time, or for a newer connection while none had.",
        );
        let _ = writeln!(out, "{name}{{reason=\"over_bound\"}} {over_bound}");
        let _ = writeln!(out, "{name}{{reason=\"no_call_in_time\"}} {out_of_time}");
        let _ = writeln!(out, "{name}{{reason=\"unvouched_evicted\"}} {evicted}");
        family(
            &mut out,
            "bulkhead_requests_total",
            "counter",
            "Requests by how they ended.",
        );
        for o in Outcome::ALL {
            let _ = writeln!(
                out,
                "bulkhead_requests_total{{outcome=\"{}\"}} {}",
                o.label(),
                self.requests(o)
            );
        }
        for (name, help, value) in [
            (
                "bulkhead_generated_tokens_total",
                "Tokens generated, including those of requests cancelled later.",
                self.generated_tokens(),
            ),
            (
                "bulkhead_prompt_tokens_computed_total",
                "Prompt tokens computed (the prefix cache's hits not included).",
                self.computed_prompt_tokens(),
            ),
        ] {
            family(&mut out, name, "counter", help);
            let _ = writeln!(out, "{name} {value}");
        }
        out
    }

    /// What the engine reports: its pool, capacity and queue, the KV handoff, the prefix cache.
    fn render_engine(&self, out: &mut String, stats: &EngineStats) {
        let p = &stats.pool;
        family(
            out,
            "bulkhead_kv_pool_pages",
            "gauge",
            "KV pool pages by state.",
        );
        for (state, n) in [
            ("free", p.free),
            ("reserved", p.reserved),
            ("owned", p.owned),
            ("releasing", p.releasing),
            ("quarantined", p.quarantined),
            ("pending_scrub", p.pending_scrub),
            ("cached", p.cached),
        ] {
            let _ = writeln!(out, "bulkhead_kv_pool_pages{{state=\"{state}\"}} {n}");
        }
        let c = &stats.capacity;
        for (name, help, value) in [
            (
                "bulkhead_kv_pool_capacity_tokens",
                "Tokens the KV pool holds, as measured at startup.",
                c.pool_tokens,
            ),
            (
                "bulkhead_kv_pool_page_tokens",
                "Tokens per KV page.",
                u64::from(c.page_tokens),
            ),
            (
                "bulkhead_served_context_tokens",
                "The longest prompt plus new tokens this worker serves.",
                c.served_context as u64,
            ),
            (
                "bulkhead_queue_depth",
                "Requests admitted and waiting for pages.",
                stats.waiting as u64,
            ),
            (
                "bulkhead_running_requests",
                "Requests generating now, with (decode role) those whose prompt's KV is on its way: each holds a place of --max-running.",
                stats.running as u64,
            ),
        ] {
            family(out, name, "gauge", help);
            let _ = writeln!(out, "{name} {value}");
        }
        self.render_transfers(out, &stats.transfers);
        for (name, help, value) in [
            (
                "bulkhead_prefix_cache_prompt_tokens_total",
                "Prompt tokens of the requests that looked their prompt up in the tenant's prefix cache.",
                stats.prefix.prompt_tokens,
            ),
            (
                "bulkhead_prefix_cache_hit_tokens_total",
                "Prompt tokens whose KV was read from the tenant's prefix cache instead of computed.",
                stats.prefix.cached_tokens,
            ),
            (
                "bulkhead_prefix_cache_distrusted_pages_total",
                "Cached pages taken out of the prefix cache because a request that read them failed a KV integrity check on them.",
                stats.prefix.distrusted_pages,
            ),
        ] {
            family(out, name, "counter", help);
            let _ = writeln!(out, "{name} {value}");
        }
    }

    /// The KV handoff: counters, per-side gauges, the abort-acknowledgement histogram.
    fn render_transfers(&self, out: &mut String, t: &TransferStats) {
        for (name, help, value) in [
            (
                "bulkhead_kv_frames_written_total",
                "KV transfer frames verified and written (decode role).",
                t.frames_written,
            ),
            (
                "bulkhead_kv_integrity_failures_total",
                "KV transfers that failed verification; their pages were quarantined.",
                t.integrity_failures,
            ),
            (
                "bulkhead_kv_drain_timeouts_total",
                "Abandoned transfers quarantined because no drain acknowledgement came.",
                t.drain_timeouts,
            ),
            (
                "bulkhead_kv_teardown_drains_total",
                "Abandoned transfers whose pages came back because their call or connection ended, without a drain acknowledgement.",
                t.teardown_drains,
            ),
            (
                "bulkhead_kv_reclaimed_pages_total",
                "Quarantined pages scrubbed and reused: a transfer's once its peer was known gone, a failed request's after --reclaim-after-ms.",
                t.reclaimed_pages,
            ),
        ] {
            family(out, name, "counter", help);
            let _ = writeln!(out, "{name} {value}");
        }
        family(
            out,
            "bulkhead_kv_frames_dropped_total",
            "counter",
            "KV transfer frames dropped (decode role), by reason.",
        );
        for (reason, n) in t.frames_dropped.iter() {
            let _ = writeln!(
                out,
                "bulkhead_kv_frames_dropped_total{{reason=\"{reason}\"}} {n}"
            );
        }
        let sending = self.sending.load(Ordering::Relaxed);
        let sending_tokens = self.sending_tokens.load(Ordering::Relaxed);
        for (name, help, receive, send) in [
            (
                "bulkhead_kv_transfers_in_flight",
                "KV transfers in flight: receive = decode waiting for or receiving KV, send = prefill writing it.",
                t.transfers_in_flight,
                sending,
            ),
            (
                "bulkhead_kv_in_flight_tokens",
                "Prompt tokens the KV transfers in flight carry, by side.",
                t.in_flight_tokens,
                sending_tokens,
            ),
        ] {
            family(out, name, "gauge", help);
            let _ = writeln!(out, "{name}{{side=\"receive\"}} {receive}");
            let _ = writeln!(out, "{name}{{side=\"send\"}} {send}");
        }
        for (name, help, value) in [
            (
                "bulkhead_kv_reserved_tokens",
                "Tokens of the KV pages requests reserved of their own, for a transfer or running (the cached prefix pages they read, and the pages of transfers draining, are not counted).",
                t.reserved_tokens,
            ),
            (
                "bulkhead_kv_quarantined_sessions",
                "Quarantined transfers waiting for their peer to be known gone.",
                t.quarantined_sessions,
            ),
        ] {
            family(out, name, "gauge", help);
            let _ = writeln!(out, "{name} {value}");
        }
        let name = "bulkhead_kv_abort_ack_seconds";
        family(
            out,
            name,
            "histogram",
            "From abandoning a KV transfer (cancel, timeout) to the peer's drain acknowledgement (decode role).",
        );
        let h = &t.abort_ack;
        for (le, n) in h.cumulative() {
            let _ = writeln!(out, "{name}_bucket{{le=\"{le}\"}} {n}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", h.count());
        let _ = writeln!(out, "{name}_sum {}", h.sum_seconds());
        let _ = writeln!(out, "{name}_count {}", h.count());
    }
}

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

#[cfg(test)]
mod tests {
    use bulkhead_kvpool::PoolStats;

    use super::*;
    use crate::engine::{Capacity, PrefixStats};

    fn stats() -> EngineStats {
        EngineStats {
            pool: PoolStats {
                total: 10,
                free: 6,
                reserved: 0,
                owned: 3,
                releasing: 0,
                quarantined: 1,
                pending_scrub: 0,
                cached: 0,
            },
            waiting: 2,
            running: 1,
            transfers: TransferStats {
                transfers_in_flight: 2,
                in_flight_tokens: 96,
                reserved_tokens: 300,
                ..TransferStats::default()
            },
            prefix: PrefixStats::default(),
            capacity: Capacity {
                token_bytes: 256,
                pool_pages: 10,
                page_tokens: 16,
                pool_tokens: 160,
                page_bytes: 4096,
                model_context: 8192,
                served_context: 160,
            },
        }
    }

    fn value(text: &str, series: &str) -> Option<u64> {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    #[test]
    fn exposition_has_every_series_with_its_value() {
        let m = Metrics::default();
        m.count(Outcome::Stop);
        m.count(Outcome::Stop);
        m.count(Outcome::RejectedContextLength);
        m.add_generated(7);
        let text = m.render(Some(&stats()));
        assert_eq!(
            value(&text, "bulkhead_kv_pool_pages{state=\"free\"}"),
            Some(6)
        );
        assert_eq!(
            value(&text, "bulkhead_kv_pool_pages{state=\"quarantined\"}"),
            Some(1)
        );
        assert_eq!(
            value(&text, "bulkhead_kv_pool_pages{state=\"pending_scrub\"}"),
            Some(0)
        );
        assert_eq!(value(&text, "bulkhead_kv_pool_capacity_tokens"), Some(160));
        assert_eq!(value(&text, "bulkhead_served_context_tokens"), Some(160));
        assert_eq!(value(&text, "bulkhead_queue_depth"), Some(2));
        assert_eq!(value(&text, "bulkhead_running_requests"), Some(1));
        assert_eq!(
            value(&text, "bulkhead_requests_total{outcome=\"stop\"}"),
            Some(2)
        );
        assert_eq!(
            value(
                &text,
                "bulkhead_requests_total{outcome=\"rejected_context_length\"}"
            ),
            Some(1)
        );
        assert_eq!(
            value(&text, "bulkhead_requests_total{outcome=\"cancelled\"}"),
            Some(0)
        );
        assert_eq!(value(&text, "bulkhead_generated_tokens_total"), Some(7));
        assert_eq!(
            value(&text, "bulkhead_prompt_tokens_computed_total"),
            Some(0)
        );
        m.set_computed_prompt_tokens(1234);
        let text = m.render(Some(&stats()));
        assert_eq!(
            value(&text, "bulkhead_prompt_tokens_computed_total"),
            Some(1234)
        );
    }

    #[test]
    fn a_queued_request_sees_progress_in_answers_as_in_prompts() {
        // A request queued for pages that answers hold gets them as the answers end: tokens
        // they generate are progress towards its turn, as a prompt computed ahead of it is.
        let m = Metrics::default();
        m.set_computed_prompt_tokens(30);
        let before = m.computed_tokens();
        m.add_generated(1);
        assert_eq!(m.computed_tokens(), before + 1);
        m.set_computed_prompt_tokens(46);
        assert_eq!(m.computed_tokens(), 47);
    }

    #[test]
    fn transfer_series_have_their_sides_reasons_and_buckets() {
        let m = Metrics::default();
        let sending = m.sending(40);
        let _other = m.sending(2);
        let text = m.render(Some(&stats()));
        let v = |s: &str| value(&text, s);
        assert_eq!(
            v("bulkhead_kv_transfers_in_flight{side=\"receive\"}"),
            Some(2)
        );
        assert_eq!(v("bulkhead_kv_transfers_in_flight{side=\"send\"}"), Some(2));
        assert_eq!(
            v("bulkhead_kv_in_flight_tokens{side=\"receive\"}"),
            Some(96)
        );
        assert_eq!(v("bulkhead_kv_in_flight_tokens{side=\"send\"}"), Some(42));
        assert_eq!(v("bulkhead_kv_reserved_tokens"), Some(300));
        assert_eq!(
            v("bulkhead_kv_frames_dropped_total{reason=\"corrupt\"}"),
            Some(0)
        );
        assert_eq!(
            v("bulkhead_kv_abort_ack_seconds_bucket{le=\"+Inf\"}"),
            Some(0)
        );
        assert_eq!(v("bulkhead_kv_abort_ack_seconds_count"), Some(0));
        drop(sending);
        let text = m.render(Some(&stats()));
        assert_eq!(
            value(&text, "bulkhead_kv_in_flight_tokens{side=\"send\"}"),
            Some(2)
        );
    }

    /// Each family is declared once, and its samples follow its declaration before the next
    /// family's (Prometheus's text format).
    #[test]
    fn every_family_is_declared_once_and_its_samples_follow_it() {
        for stats in [Some(stats()), None] {
            families_grouped(&Metrics::default().render(stats.as_ref()));
        }
    }

    /// With the engine gone or stuck, the counters kept beside it are still exposed (what
    /// tells an operator what happened), and the engine's gauges are left out: `/metrics`
    /// answered 503 and the scrape saw nothing.
    #[test]
    fn without_the_engine_the_counters_are_still_exposed() {
        let m = Metrics::default();
        m.count(Outcome::FailedInternal);
        let text = m.render(None);
        assert!(text.contains("bulkhead_engine_up 0\n"), "{text}");
        assert!(
            text.contains("bulkhead_requests_total{outcome=\"failed_internal\"} 1\n"),
            "{text}"
        );
        assert!(text.contains("bulkhead_grpc_connections 0\n"), "{text}");
        assert!(!text.contains("bulkhead_kv_pool_pages"), "{text}");
        let up = m.render(Some(&stats()));
        assert!(up.contains("bulkhead_engine_up 1\n") && up.contains("bulkhead_kv_pool_pages"));
    }

    /// Every family in `text` is declared once and its samples follow its declaration.
    fn families_grouped(text: &str) {
        let mut declared: Vec<&str> = Vec::new();
        for line in text.lines() {
            if let Some(family) = line.strip_prefix("# TYPE ") {
                let name = family.split(' ').next().unwrap_or_default();
                assert!(!declared.contains(&name), "{name} declared twice");
                declared.push(name);
            } else if !line.starts_with('#') && !line.is_empty() {
                let sample = line.split(['{', ' ']).next().unwrap_or_default();
                let current = declared.last().copied().unwrap_or_default();
                let of_current = ["", "_bucket", "_sum", "_count", "_total"]
                    .iter()
                    .any(|suffix| sample == format!("{current}{suffix}"));
                assert!(of_current, "{sample} follows {current}'s declaration");
            }
        }
        assert!(declared.len() >= 6, "{declared:?}");
    }

    /// The client hears 500 when the chat template's sandbox is unavailable: counted as the
    /// worker's failure, not as an invalid request.
    #[test]
    fn an_unavailable_template_sandbox_counts_as_an_internal_failure() {
        let sandbox = ServeError::Invalid(ValidationError::ChatSandbox);
        assert_eq!(Outcome::refused(&sandbox), Outcome::FailedInternal);
        let refused = ServeError::Invalid(ValidationError::ChatRender {
            reason: "roles must alternate".into(),
        });
        assert_eq!(Outcome::refused(&refused), Outcome::RejectedInvalid);
    }

    #[test]
    fn outcome_indices_match_all() {
        for (i, o) in Outcome::ALL.iter().enumerate() {
            assert_eq!(o.index(), i);
        }
    }
}
