//! The gateway's Prometheus metrics: requests by tenant and status, tokens in and out by
//! tenant; the effective context limit and worker health are read from [`Workers`] when
//! rendered.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, PoisonError};

use crate::tenant::{Tenant, TenantId};
use crate::workers::{Health, Workers};

#[derive(Debug, Default)]
struct Counters {
    /// (tenant, HTTP status) → requests.
    requests: BTreeMap<(TenantId, u16), u64>,
    /// Requests refused before a tenant was known (401).
    unauthenticated: u64,
    /// tenant → (prompt tokens, completion tokens).
    tokens: BTreeMap<TenantId, (u64, u64)>,
    /// tenant → streams that ended with an error event after a 200.
    stream_errors: BTreeMap<TenantId, u64>,
}

/// The counters; a cheap `Clone` handle.
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    counters: Arc<Mutex<Counters>>,
}

impl Metrics {
    fn with<R>(&self, f: impl FnOnce(&mut Counters) -> R) -> R {
        f(&mut self.counters.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// One finished request of `tenant` with `status`.
    pub fn request(&self, tenant: &TenantId, status: u16) {
        self.with(|c| *c.requests.entry((tenant.clone(), status)).or_default() += 1);
    }

    /// One request refused for its key.
    pub fn unauthenticated(&self) {
        self.with(|c| c.unauthenticated += 1);
    }

    /// Tokens of one completed generation.
    pub fn tokens(&self, tenant: &TenantId, prompt: u64, completion: u64) {
        self.with(|c| {
            let t = c.tokens.entry(tenant.clone()).or_default();
            t.0 += prompt;
            t.1 += completion;
        });
    }

    /// A stream that failed after its 200.
    pub fn stream_error(&self, tenant: &TenantId) {
        self.with(|c| *c.stream_errors.entry(tenant.clone()).or_default() += 1);
    }

    /// Requests counted for `tenant` with `status` (tests).
    pub fn requests_of(&self, tenant: &TenantId, status: u16) -> u64 {
        self.with(|c| {
            c.requests
                .get(&(tenant.clone(), status))
                .copied()
                .unwrap_or(0)
        })
    }

    /// The Prometheus text exposition.
    pub fn render(&self, tenants: &[Arc<Tenant>], workers: &Workers) -> String {
        let mut out = String::new();
        self.with(|c| {
            out.push_str(
                "# HELP bulkhead_gateway_requests_total API requests by tenant and HTTP status.\n\
                 # TYPE bulkhead_gateway_requests_total counter\n",
            );
            for ((tenant, status), n) in &c.requests {
                let _ = writeln!(
                    out,
                    "bulkhead_gateway_requests_total{{tenant=\"{tenant}\",status=\"{status}\"}} {n}"
                );
            }
            out.push_str(
                "# HELP bulkhead_gateway_unauthenticated_requests_total API requests refused for \
                 a missing or unknown key.\n\
                 # TYPE bulkhead_gateway_unauthenticated_requests_total counter\n",
            );
            let _ = writeln!(
                out,
                "bulkhead_gateway_unauthenticated_requests_total {}",
                c.unauthenticated
            );
            out.push_str(
                "# HELP bulkhead_gateway_tokens_in_total Prompt tokens by tenant.\n\
                 # TYPE bulkhead_gateway_tokens_in_total counter\n",
            );
            for (tenant, (prompt, _)) in &c.tokens {
                let _ = writeln!(
                    out,
                    "bulkhead_gateway_tokens_in_total{{tenant=\"{tenant}\"}} {prompt}"
                );
            }
            out.push_str(
                "# HELP bulkhead_gateway_tokens_out_total Generated tokens by tenant.\n\
                 # TYPE bulkhead_gateway_tokens_out_total counter\n",
            );
            for (tenant, (_, completion)) in &c.tokens {
                let _ = writeln!(
                    out,
                    "bulkhead_gateway_tokens_out_total{{tenant=\"{tenant}\"}} {completion}"
                );
            }
            out.push_str(
                "# HELP bulkhead_gateway_stream_errors_total Streams that ended with an error \
                 event.\n# TYPE bulkhead_gateway_stream_errors_total counter\n",
            );
            for (tenant, n) in &c.stream_errors {
                let _ = writeln!(
                    out,
                    "bulkhead_gateway_stream_errors_total{{tenant=\"{tenant}\"}} {n}"
                );
            }
        });
        out.push_str(
            "# HELP bulkhead_gateway_effective_context_tokens The longest prompt + max tokens \
             a tenant's request may take now (0: no routable worker).\n\
             # TYPE bulkhead_gateway_effective_context_tokens gauge\n",
        );
        for t in tenants {
            let limit = workers
                .effective_limit(t.limits.max_context)
                .map_or(0, |l| l.tokens);
            let _ = writeln!(
                out,
                "bulkhead_gateway_effective_context_tokens{{tenant=\"{}\"}} {limit}",
                t.id
            );
        }
        out.push_str(
            "# HELP bulkhead_gateway_worker_routable Whether the gateway routes to the worker.\n\
             # TYPE bulkhead_gateway_worker_routable gauge\n\
             # HELP bulkhead_gateway_worker_healthy Whether the worker's last Health said serving.\n\
             # TYPE bulkhead_gateway_worker_healthy gauge\n\
             # HELP bulkhead_gateway_worker_outstanding_tokens Prompt + max tokens of the \
             requests in flight on the worker.\n\
             # TYPE bulkhead_gateway_worker_outstanding_tokens gauge\n",
        );
        for w in workers.reports() {
            let name = w.name.replace(['"', '\\', '\n'], "_");
            let healthy = matches!(w.health, Health::Serving { .. });
            let _ = writeln!(
                out,
                "bulkhead_gateway_worker_routable{{worker=\"{name}\"}} {}\n\
                 bulkhead_gateway_worker_healthy{{worker=\"{name}\"}} {}\n\
                 bulkhead_gateway_worker_outstanding_tokens{{worker=\"{name}\"}} {}",
                u8::from(w.routable),
                u8::from(healthy),
                w.outstanding_tokens
            );
        }
        out
    }
}
