//! The policy host's counters and call durations, rendered into the gateway's `/metrics`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use super::chain::Hook;
use crate::histogram::{Histogram, Scale};

/// Plugin calls: microseconds, from 10 µs (a call from a snapshot) to 10 s (the longest
/// deadline a binding may set).
struct Micros;

impl Scale for Micros {
    const BOUNDS: &'static [u64] = &[
        10, 25, 50, 100, 250, 500, 1_000, 2_500, 10_000, 50_000, 250_000, 1_000_000, 10_000_000,
    ];
    const PER_SECOND: u64 = 1_000_000;
}

#[derive(Debug, Default)]
struct Counters {
    /// (plugin, verdict label) → decisions.
    decisions: BTreeMap<(Arc<str>, &'static str), u64>,
    /// (plugin, fault kind) → failed calls (any hook).
    faults: BTreeMap<(Arc<str>, &'static str), u64>,
    /// (plugin, hook) → how long its calls took, instantiation included, failed ones too.
    calls: BTreeMap<(Arc<str>, Hook), Histogram<Micros>>,
    /// directive → abandoned requests handled with it.
    abandoned: BTreeMap<&'static str, u64>,
    /// outcome → requests whose end the policies were told of.
    ends: BTreeMap<&'static str, u64>,
    /// When an abandoned request's stream was dropped (i.e. cancelled at the worker):
    /// "before_first_token", "after_first_token", "after_done".
    dropped: BTreeMap<&'static str, u64>,
    /// "ok" / "refused" → reloads.
    reloads: BTreeMap<&'static str, u64>,
    /// tenant → how long its calls (a request's chain, a disconnect or response-end hook)
    /// waited for an instance slot, granted or not.
    slot_waits: BTreeMap<String, Histogram<Micros>>,
    /// tenant → waits that ended without a slot (the sandbox was busy).
    busy: BTreeMap<String, u64>,
    /// tenant → abandoned requests dropped at once, the tenant holding as many as the gateway
    /// allows.
    over_hold_bound: BTreeMap<String, u64>,
}

/// A cheap `Clone` handle on the counters.
#[derive(Debug, Clone, Default)]
pub(super) struct Stats(Arc<Mutex<Counters>>);

impl Stats {
    fn with<R>(&self, f: impl FnOnce(&mut Counters) -> R) -> R {
        f(&mut self.0.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// An `on-request` call that took `took` and decided `verdict`.
    pub(super) fn decision(&self, plugin: &Arc<str>, verdict: &'static str, took: Duration) {
        self.with(|c| {
            *c.decisions.entry((plugin.clone(), verdict)).or_default() += 1;
            observe(c, plugin, Hook::Request, took);
        });
    }

    /// A call of another hook that took `took`.
    pub(super) fn call(&self, plugin: &Arc<str>, hook: Hook, took: Duration) {
        self.with(|c| observe(c, plugin, hook, took));
    }

    pub(super) fn fault(&self, plugin: &Arc<str>, kind: &'static str) {
        self.with(|c| *c.faults.entry((plugin.clone(), kind)).or_default() += 1);
    }

    /// A wait of `tenant`'s for an instance slot that took `took` and got one or not.
    pub(super) fn slot_wait(&self, tenant: &str, took: Duration, granted: bool) {
        self.with(|c| {
            per_tenant(&mut c.slot_waits, tenant, |h| h.observe(took));
            if !granted {
                per_tenant(&mut c.busy, tenant, |n| *n += 1);
            }
        });
    }

    pub(super) fn abandoned(&self, directive: &'static str) {
        self.with(|c| *c.abandoned.entry(directive).or_default() += 1);
    }

    /// An abandoned request of `tenant`'s dropped at once: the tenant held as many as the
    /// gateway allows.
    pub(super) fn over_hold_bound(&self, tenant: &str) {
        self.with(|c| per_tenant(&mut c.over_hold_bound, tenant, |n| *n += 1));
    }

    /// A request the chain let through ended with `outcome` (the word `on-response-end` gets).
    pub(super) fn ended(&self, outcome: &'static str) {
        self.with(|c| *c.ends.entry(outcome).or_default() += 1);
    }

    pub(super) fn dropped(&self, at: &'static str) {
        self.with(|c| *c.dropped.entry(at).or_default() += 1);
    }

    pub(super) fn reload(&self, ok: bool) {
        self.with(|c| {
            *c.reloads
                .entry(if ok { "ok" } else { "refused" })
                .or_default() += 1
        });
    }

    /// The counters in Prometheus text; the per-tenant ones of the tenants `keep` says (a
    /// tenant a reload removed leaves no series behind).
    pub(super) fn render(&self, out: &mut String, keep: &dyn Fn(&str) -> bool) {
        self.with(|c| {
            let mut family = |name: &str, help: &str, rows: Vec<(String, u64)>| {
                let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
                for (labels, n) in rows {
                    let _ = writeln!(out, "{name}{{{labels}}} {n}");
                }
            };
            family(
                "bulkhead_policy_decisions_total",
                "Policy decisions on requests by plugin and verdict (allow, mutate, deny, error: the audit \
                 record's words; error_open: a fault the request went on past, the policy not \
                 applied).",
                c.decisions
                    .iter()
                    .map(|((p, v), n)| (format!("plugin=\"{p}\",verdict=\"{v}\""), *n))
                    .collect(),
            );
            family(
                "bulkhead_policy_faults_total",
                "Policy plugin calls that trapped, timed out, exceeded memory, returned garbage or refused \
                 their configuration.",
                c.faults
                    .iter()
                    .map(|((p, k), n)| (format!("plugin=\"{p}\",kind=\"{k}\""), *n))
                    .collect(),
            );
            family(
                "bulkhead_policy_abandoned_total",
                "Requests whose client went away, by the directive applied.",
                c.abandoned
                    .iter()
                    .map(|(d, n)| (format!("directive=\"{d}\""), *n))
                    .collect(),
            );
            family(
                "bulkhead_policy_response_ends_total",
                "Requests the policy chain let through, by how they ended as on-response-end is \
                 told (completed, failed, client_disconnected).",
                c.ends
                    .iter()
                    .map(|(o, n)| (format!("outcome=\"{o}\""), *n))
                    .collect(),
            );
            family(
                "bulkhead_policy_abandoned_dropped_total",
                "Abandoned requests by when their worker stream was dropped (cancelling them).",
                c.dropped
                    .iter()
                    .map(|(at, n)| (format!("at=\"{at}\""), *n))
                    .collect(),
            );
            family(
                "bulkhead_policy_reloads_total",
                "Policy set reloads by result.",
                c.reloads
                    .iter()
                    .map(|(r, n)| (format!("result=\"{r}\""), *n))
                    .collect(),
            );
            family(
                "bulkhead_policy_busy_total",
                "Policy calls by tenant that found no free instance slot in time: a request's \
                 chain refused as policy_busy, or a disconnect or \
                 response-end hook not run.",
                c.busy
                    .iter()
                    .filter(|(t, _)| keep(t))
                    .map(|(t, n)| (format!("tenant=\"{t}\""), *n))
                    .collect(),
            );
            family(
                "bulkhead_policy_abandoned_over_hold_bound_total",
                "Abandoned requests by tenant dropped at once (counted as abort_now too), the \
                 policies not asked: the tenant already held [policies] max_held_per_tenant.",
                c.over_hold_bound
                    .iter()
                    .filter(|(t, _)| keep(t))
                    .map(|(t, n)| (format!("tenant=\"{t}\""), *n))
                    .collect(),
            );
            let name = "bulkhead_policy_slot_wait_seconds";
            let _ = writeln!(
                out,
                "# HELP {name} How long policy calls waited for an instance slot, by tenant \
                 (the slots are shared fairly between tenants).\n# TYPE {name} histogram"
            );
            for (tenant, h) in c.slot_waits.iter().filter(|(t, _)| keep(t)) {
                h.render(out, name, &format!("tenant=\"{tenant}\""));
            }
            let name = "bulkhead_policy_call_duration_seconds";
            let _ = writeln!(
                out,
                "# HELP {name} Policy plugin calls by plugin and hook, from instantiation to \
                 answer.\n# TYPE {name} histogram"
            );
            for ((plugin, hook), h) in &c.calls {
                h.render(
                    out,
                    name,
                    &format!("plugin=\"{plugin}\",hook=\"{}\"", hook.name()),
                );
            }
        });
    }
}

/// Applies `f` to `tenant`'s entry of `map`, made on its first use (tenants are configured: a
/// few keys; a request's lookup allocates nothing).
fn per_tenant<V: Default>(map: &mut BTreeMap<String, V>, tenant: &str, f: impl FnOnce(&mut V)) {
    if !map.contains_key(tenant) {
        map.insert(tenant.to_owned(), V::default());
    }
    map.get_mut(tenant).map(f);
}

fn observe(c: &mut Counters, plugin: &Arc<str>, hook: Hook, took: Duration) {
    c.calls
        .entry((plugin.clone(), hook))
        .or_default()
        .observe(took);
}
