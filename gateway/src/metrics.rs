//! The gateway's Prometheus metrics: requests by tenant and status, tokens in and out, request
//! latency and time to first token by tenant (histograms, fed by each request's final audit
//! record); the effective context limit and worker health are read from [`Workers`] when
//! rendered.
//!
//! Every thread that records keeps counters of its own (a serving thread never takes a lock
//! that another thread takes on every request, and its counters' cache lines stay on its
//! core); rendering sums them. A thread's counters outlive it (a later thread may take them
//! over), so no count is lost when a thread ends.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use bulkhead_worker::serve::tls::Handshakes;
use thread_local::ThreadLocal;

use crate::histogram::Scale;
use crate::tenant::TenantId;
use crate::tenants::TenantSet;
use crate::workers::{Health, WorkerReport, Workers};

/// Request latencies: counted in microseconds (whole milliseconds put a 5.9 ms request at
/// or under 5 ms), bucketed from 1 ms to 5 minutes.
struct Latency;

impl Scale for Latency {
    const BOUNDS: &'static [u64] = &[
        1_000,
        2_500,
        5_000,
        10_000,
        25_000,
        50_000,
        100_000,
        250_000,
        500_000,
        1_000_000,
        2_500_000,
        5_000_000,
        10_000_000,
        30_000_000,
        60_000_000,
        300_000_000,
    ];
    const PER_SECOND: u64 = 1_000_000;
}

type Histogram = crate::histogram::Histogram<Latency>;

#[derive(Debug, Default)]
struct Counters {
    /// tenant → HTTP status → requests.
    requests: BTreeMap<TenantId, BTreeMap<u16, u64>>,
    /// Requests refused before a tenant was known (401).
    unauthenticated: u64,
    /// HTTP status → requests with no tenant to charge that ended for another reason than
    /// their key (a bad Host, HTTP the server could not parse, plain HTTP to a TLS port, a
    /// client gone before its key was read).
    untenanted: BTreeMap<u16, u64>,
    /// Requests refused unread while the audit log could not write (503).
    audit_refused: u64,
    /// tenant → its completed generations' tokens.
    tokens: BTreeMap<TenantId, Tokens>,
    /// tenant → streams that ended with an error event after a 200.
    stream_errors: BTreeMap<TenantId, u64>,
    /// tenant → arrival to end of every request.
    duration: BTreeMap<TenantId, Histogram>,
    /// tenant → arrival to first token of every request that produced one.
    ttft: BTreeMap<TenantId, Histogram>,
}

/// A completed generation's tokens (its usage), or a tenant's sum of them.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Tokens {
    /// Prompt tokens, the cached ones included.
    pub prompt: u64,
    /// Prompt tokens whose KV was read from the tenant's prefix cache.
    pub cached: u64,
    /// Generated tokens.
    pub completion: u64,
}

impl std::ops::AddAssign for Tokens {
    fn add_assign(&mut self, other: Tokens) {
        self.prompt += other.prompt;
        self.cached += other.cached;
        self.completion += other.completion;
    }
}

/// `tenant`'s entry of `map`, made on first use (the id is copied only then).
fn of<'m, V: Default>(map: &'m mut BTreeMap<TenantId, V>, tenant: &TenantId) -> &'m mut V {
    if !map.contains_key(tenant) {
        map.insert(tenant.clone(), V::default());
    }
    map.get_mut(tenant).expect("inserted above")
}

impl Counters {
    /// Keeps the series of the tenants `keep` says.
    fn retain(&mut self, keep: impl Fn(&TenantId) -> bool) {
        self.requests.retain(|t, _| keep(t));
        self.tokens.retain(|t, _| keep(t));
        self.stream_errors.retain(|t, _| keep(t));
        self.duration.retain(|t, _| keep(t));
        self.ttft.retain(|t, _| keep(t));
    }

    /// Adds `other`'s counts to these.
    fn add(&mut self, other: &Counters) {
        for (tenant, statuses) in &other.requests {
            let mine = of(&mut self.requests, tenant);
            for (status, n) in statuses {
                *mine.entry(*status).or_default() += n;
            }
        }
        self.unauthenticated += other.unauthenticated;
        for (status, n) in &other.untenanted {
            *self.untenanted.entry(*status).or_default() += n;
        }
        self.audit_refused += other.audit_refused;
        for (tenant, tokens) in &other.tokens {
            *of(&mut self.tokens, tenant) += *tokens;
        }
        for (tenant, n) in &other.stream_errors {
            *of(&mut self.stream_errors, tenant) += n;
        }
        for (mine, theirs) in [
            (&mut self.duration, &other.duration),
            (&mut self.ttft, &other.ttft),
        ] {
            for (tenant, h) in theirs {
                of(mine, tenant).add(h);
            }
        }
    }
}

/// The counters; a cheap `Clone` handle.
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    /// Each recording thread's own counters.
    counters: Arc<ThreadLocal<Mutex<Counters>>>,
}

fn lock(m: &Mutex<Counters>) -> MutexGuard<'_, Counters> {
    // Every update is a few additions: a panic mid-way leaves usable counts.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Writes a metric family's `HELP` and `TYPE` lines.
fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

impl Metrics {
    /// Runs `f` on this thread's counters.
    fn with<R>(&self, f: impl FnOnce(&mut Counters) -> R) -> R {
        f(&mut lock(self.counters.get_or_default()))
    }

    /// Every thread's counters, summed.
    fn total(&self) -> Counters {
        let mut total = Counters::default();
        for counters in self.counters.iter() {
            total.add(&lock(counters));
        }
        total
    }

    /// One finished request of `tenant` with `status`.
    pub fn request(&self, tenant: &TenantId, status: u16) {
        self.with(|c| *of(&mut c.requests, tenant).entry(status).or_default() += 1);
    }

    /// One request refused for its key.
    pub fn unauthenticated(&self) {
        self.with(|c| c.unauthenticated += 1);
    }

    /// One request with no tenant to charge, ended with `status` for another reason than its
    /// key.
    pub fn untenanted(&self, status: u16) {
        self.with(|c| *c.untenanted.entry(status).or_default() += 1);
    }

    /// One request refused unread while the audit log could not write.
    pub fn audit_refused(&self) {
        self.with(|c| c.audit_refused += 1);
    }

    /// Tokens of one completed generation.
    pub fn tokens(&self, tenant: &TenantId, tokens: Tokens) {
        self.with(|c| *of(&mut c.tokens, tenant) += tokens);
    }

    /// A stream that failed after its 200.
    pub fn stream_error(&self, tenant: &TenantId) {
        self.with(|c| *of(&mut c.stream_errors, tenant) += 1);
    }

    /// One ended request's latency, and its time to first token when it produced one.
    pub fn latency(&self, tenant: &TenantId, total: Duration, ttft: Option<Duration>) {
        self.with(|c| {
            of(&mut c.duration, tenant).observe(total);
            if let Some(ttft) = ttft {
                of(&mut c.ttft, tenant).observe(ttft);
            }
        });
    }

    /// Requests counted for `tenant` with `status` (tests).
    pub fn requests_of(&self, tenant: &TenantId, status: u16) -> u64 {
        let total = self.total();
        total
            .requests
            .get(tenant)
            .and_then(|s| s.get(&status))
            .copied()
            .unwrap_or(0)
    }

    /// Requests with no tenant to charge counted with `status` (tests).
    #[cfg(test)]
    pub fn untenanted_of(&self, status: u16) -> u64 {
        self.total().untenanted.get(&status).copied().unwrap_or(0)
    }

    /// Requests refused unread while the audit log could not write (tests).
    #[cfg(test)]
    pub fn audit_refused_count(&self) -> u64 {
        self.total().audit_refused
    }

    /// The Prometheus text exposition: the per-tenant series of the tenants `keep` says.
    pub fn render(
        &self,
        tenants: &TenantSet,
        workers: &Workers,
        keep: &dyn Fn(&str) -> bool,
    ) -> String {
        let mut out = String::new();
        let mut total = self.total();
        total.retain(|t| keep(t.as_str()));
        render_counters(&mut out, &total);
        family(
            &mut out,
            "bulkhead_gateway_effective_context_tokens",
            "gauge",
            "The longest prompt + max tokens a tenant's request may take now (0: no routable \
             worker).",
        );
        for t in tenants.tenants() {
            let limit = workers
                .effective_limit(t.limits.max_context)
                .map_or(0, |l| l.tokens);
            let _ = writeln!(
                out,
                "bulkhead_gateway_effective_context_tokens{{tenant=\"{}\"}} {limit}",
                t.id
            );
        }
        let reports = workers.reports();
        let gauges: [(&str, &str, WorkerGauge); 3] = [
            (
                "bulkhead_gateway_worker_routable",
                "Whether the gateway routes to the worker.",
                |w| u64::from(w.routable),
            ),
            (
                "bulkhead_gateway_worker_healthy",
                "Whether the worker's last Health said serving.",
                |w| u64::from(matches!(w.health, Health::Serving { .. })),
            ),
            (
                "bulkhead_gateway_worker_outstanding_tokens",
                "Prompt + max tokens of the requests in flight on the worker.",
                |w| w.outstanding_tokens,
            ),
        ];
        // Each family's samples together, after its own HELP and TYPE (the text format
        // requires it: a scrape whose families interleave is refused or read as duplicates).
        for (name, help, value) in gauges {
            family(&mut out, name, "gauge", help);
            for w in &reports {
                let worker = label_value(&w.name);
                let _ = writeln!(out, "{name}{{worker=\"{worker}\"}} {}", value(w));
            }
        }
        out
    }
}

/// `value` as a label value of the text format: backslash, double quote and line feed escaped
/// (replaced, `a"b` and `a\b` were one series, and the scrape was refused for duplicates).
fn label_value(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// A per-worker gauge's value, read from the worker's report.
type WorkerGauge = fn(&WorkerReport) -> u64;

/// The listeners' TLS handshakes by how they ended (see [`Handshakes`]).
pub fn render_handshakes(out: &mut String, h: Handshakes) {
    family(
        out,
        "bulkhead_gateway_tls_handshakes_total",
        "counter",
        "TLS handshakes on the API and admin ports by how they ended: completed, refused (by \
         TLS: no common version or protocol, the client's alert, its certificate), closed (by \
         the client first), timed_out.",
    );
    for (result, n) in [
        ("completed", h.completed),
        ("refused", h.refused),
        ("closed", h.closed),
        ("timed_out", h.timed_out),
    ] {
        let _ = writeln!(
            out,
            "bulkhead_gateway_tls_handshakes_total{{result=\"{result}\"}} {n}"
        );
    }
}

fn render_counters(out: &mut String, c: &Counters) {
    family(
        out,
        "bulkhead_gateway_requests_total",
        "counter",
        "API requests by tenant and HTTP status, as their audit records give them, counted \
         when they end (499: the client left before the answer's head; a stream it left after \
         counts under 200, its record saying so; 444: closed unanswered at shutdown; 503: \
         answered audit_unavailable when the log refused the record).",
    );
    for (tenant, statuses) in &c.requests {
        for (status, n) in statuses {
            let _ = writeln!(
                out,
                "bulkhead_gateway_requests_total{{tenant=\"{tenant}\",status=\"{status}\"}} {n}"
            );
        }
    }
    family(
        out,
        "bulkhead_gateway_unauthenticated_requests_total",
        "counter",
        "API requests refused for a missing or unknown key.",
    );
    let _ = writeln!(
        out,
        "bulkhead_gateway_unauthenticated_requests_total {}",
        c.unauthenticated
    );
    family(
        out,
        "bulkhead_gateway_untenanted_requests_total",
        "counter",
        "API requests with no tenant to charge that ended for another reason than their key, \
         by HTTP status (400: a bad Host, HTTP that could not be parsed, plain HTTP to a TLS \
         port; 499: a client gone before its key was read).",
    );
    for (status, n) in &c.untenanted {
        let _ = writeln!(
            out,
            "bulkhead_gateway_untenanted_requests_total{{status=\"{status}\"}} {n}"
        );
    }
    family(
        out,
        "bulkhead_gateway_audit_refused_requests_total",
        "counter",
        "API requests refused unread, no tenant known, while the audit log cannot write \
         (503 audit_unavailable, with on_failure = \"refuse\").",
    );
    let _ = writeln!(
        out,
        "bulkhead_gateway_audit_refused_requests_total {}",
        c.audit_refused
    );
    let per_tenant = [
        (
            "bulkhead_gateway_tokens_in_total",
            "Prompt tokens of completed requests, by tenant (their usage; a failed or \
             abandoned request's tokens are in its audit record and its tenant's charge).",
            c.tokens
                .iter()
                .map(|(t, v)| (t, v.prompt))
                .collect::<Vec<_>>(),
        ),
        (
            "bulkhead_gateway_tokens_cached_total",
            "Prompt tokens of completed requests whose KV was read from the tenant's own \
             prefix cache instead of computed, by tenant (part of tokens_in).",
            c.tokens.iter().map(|(t, v)| (t, v.cached)).collect(),
        ),
        (
            "bulkhead_gateway_tokens_out_total",
            "Generated tokens of completed requests, by tenant.",
            c.tokens.iter().map(|(t, v)| (t, v.completion)).collect(),
        ),
        (
            "bulkhead_gateway_stream_errors_total",
            "Streams that ended with an error event.",
            c.stream_errors.iter().map(|(t, n)| (t, *n)).collect(),
        ),
    ];
    for (name, help, values) in per_tenant {
        family(out, name, "counter", help);
        for (tenant, n) in values {
            let _ = writeln!(out, "{name}{{tenant=\"{tenant}\"}} {n}");
        }
    }
    for (name, help, histograms) in [
        (
            "bulkhead_gateway_request_duration_seconds",
            "Time from a request's arrival to its end, by tenant.",
            &c.duration,
        ),
        (
            "bulkhead_gateway_ttft_seconds",
            "Time from a request's arrival to its first token, by tenant.",
            &c.ttft,
        ),
    ] {
        family(out, name, "histogram", help);
        for (tenant, h) in histograms {
            h.render(out, name, &format!("tenant=\"{tenant}\""));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Worker names that differ only in a quote, a backslash or a line feed are two series:
    /// replaced by `_`, they were one, twice, and Prometheus refused the scrape.
    #[test]
    fn label_values_are_escaped_not_replaced() {
        let names = ["a\"b", "a\\b", "a\nb", "a_b"];
        let shown: Vec<String> = names.iter().map(|n| label_value(n)).collect();
        assert_eq!(shown, [r#"a\"b"#, r"a\\b", r"a\nb", "a_b"]);
        let distinct: std::collections::HashSet<&String> = shown.iter().collect();
        assert_eq!(distinct.len(), names.len());
    }

    #[test]
    fn histograms_are_cumulative_and_count_every_observation() {
        let m = Metrics::default();
        let t = TenantId::new("t").expect("valid");
        let ms = Duration::from_millis;
        m.latency(&t, ms(3), Some(ms(1)));
        m.latency(&t, ms(70), None);
        m.latency(&t, ms(1_000_000), None);
        // Not truncated to its 5 ms: above the 5 ms bound, and its share of the sum whole.
        m.latency(&t, Duration::from_micros(5_900), None);
        let mut out = String::new();
        render_counters(&mut out, &m.total());
        let line = |needle: &str| {
            out.lines()
                .find(|l| l.starts_with(needle))
                .unwrap_or_else(|| panic!("{needle} missing:\n{out}"))
                .rsplit(' ')
                .next()
                .map(str::to_owned)
                .unwrap_or_default()
        };
        let d = "bulkhead_gateway_request_duration_seconds";
        assert_eq!(
            line(&format!("{d}_bucket{{tenant=\"t\",le=\"0.005\"}}")),
            "1"
        );
        assert_eq!(
            line(&format!("{d}_bucket{{tenant=\"t\",le=\"0.01\"}}")),
            "2"
        );
        assert_eq!(line(&format!("{d}_bucket{{tenant=\"t\",le=\"0.1\"}}")), "3");
        assert_eq!(line(&format!("{d}_bucket{{tenant=\"t\",le=\"300\"}}")), "3");
        assert_eq!(
            line(&format!("{d}_bucket{{tenant=\"t\",le=\"+Inf\"}}")),
            "4"
        );
        assert_eq!(line(&format!("{d}_count{{tenant=\"t\"}}")), "4");
        assert_eq!(line(&format!("{d}_sum{{tenant=\"t\"}}")), "1000.0789");
        assert_eq!(
            line("bulkhead_gateway_ttft_seconds_bucket{tenant=\"t\",le=\"0.001\"}"),
            "1"
        );
        assert_eq!(
            line("bulkhead_gateway_ttft_seconds_count{tenant=\"t\"}"),
            "1"
        );
    }

    #[test]
    fn counts_recorded_on_every_thread_are_summed() {
        let m = Metrics::default();
        let (a, b) = (
            TenantId::new("a").expect("valid"),
            TenantId::new("b").expect("valid"),
        );
        let record = |m: &Metrics| {
            m.request(&a, 200);
            m.request(&b, 429);
            m.tokens(
                &a,
                Tokens {
                    prompt: 10,
                    cached: 4,
                    completion: 2,
                },
            );
            m.stream_error(&a);
            m.latency(
                &a,
                Duration::from_millis(70),
                Some(Duration::from_millis(3)),
            );
            m.unauthenticated();
            m.untenanted(400);
            m.audit_refused();
        };
        record(&m);
        std::thread::scope(|s| {
            for _ in 0..2 {
                s.spawn(|| record(&m));
            }
        });
        assert_eq!(m.requests_of(&a, 200), 3);
        assert_eq!(m.requests_of(&b, 429), 3);
        assert_eq!(m.requests_of(&b, 200), 0);
        // Without b (a reload removed it): none of its series.
        let mut without_b = m.total();
        without_b.retain(|t| t != &b);
        let mut out = String::new();
        render_counters(&mut out, &without_b);
        assert!(!out.contains("tenant=\"b\""), "{out}");
        let mut out = String::new();
        render_counters(&mut out, &m.total());
        for line in [
            "bulkhead_gateway_requests_total{tenant=\"a\",status=\"200\"} 3",
            "bulkhead_gateway_unauthenticated_requests_total 3",
            "bulkhead_gateway_untenanted_requests_total{status=\"400\"} 3",
            "bulkhead_gateway_audit_refused_requests_total 3",
            "bulkhead_gateway_tokens_in_total{tenant=\"a\"} 30",
            "bulkhead_gateway_tokens_cached_total{tenant=\"a\"} 12",
            "bulkhead_gateway_tokens_out_total{tenant=\"a\"} 6",
            "bulkhead_gateway_stream_errors_total{tenant=\"a\"} 3",
            "bulkhead_gateway_request_duration_seconds_bucket{tenant=\"a\",le=\"0.1\"} 3",
            "bulkhead_gateway_request_duration_seconds_sum{tenant=\"a\"} 0.21",
            "bulkhead_gateway_ttft_seconds_count{tenant=\"a\"} 3",
        ] {
            assert!(out.lines().any(|l| l == line), "{line} missing:\n{out}");
        }
    }
}
