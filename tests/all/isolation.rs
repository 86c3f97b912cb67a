//! The isolation suite (issue 7): the real processes — a gateway, a prefill worker and a decode
//! worker (crate::cluster) — under the scenarios that leaked KV between tenants in other
//! engines, every one judged by the same oracles (crate::oracles): canaries, solo equality,
//! and accounting of pages and audit records.
//!
//! The incident (design.md): pools smaller than the model's context (prefill 256 tokens, decode
//! 512, the model 8192), prompts over them, and other tenants' traffic at the same time. The
//! scenarios that turn checks off need a test build (`--features check-switches`); see
//! `isolation_switches`.

use std::time::{Duration, Instant};

use serde_json::Value;

use crate::cluster::{Cluster, Placement, Spec, VERBOSE_LOG, preflight};
use crate::oracles::{
    Exchange, Ledger, Pool, Reference, TENANT_A, TENANT_B, TENANT_C, Tenant, assert_clean,
    audit_findings, canary, canary_findings, pool_findings, solo_findings, tenant_c_toml,
};
use crate::up::bounded;
use crate::worker_grpc::Worker;

/// The prefill worker's pool in the incident's deployment, in tokens.
pub(crate) const PREFILL_POOL: &str = "256";
/// The decode worker's pool: larger than prefill's, as in the incident.
pub(crate) const DECODE_POOL: &str = "512";

/// The incident's deployment: both pools far smaller than the model's 8192-token context, the
/// prefill pool the smaller one; a decode transfer deadline of 3 s; every process logging at
/// debug; `env` added to every process; the workers on loopback unless `placement` says.
pub(crate) fn incident_cluster(env: &[(&str, &str)], placement: Option<Placement<'_>>) -> Cluster {
    let toml = tenant_c_toml();
    let mut all_env = vec![("BULKHEAD_LOG", VERBOSE_LOG)];
    all_env.extend_from_slice(env);
    Cluster::start(Spec {
        prefill: &["--kv-tokens", PREFILL_POOL],
        decode: &["--kv-tokens", DECODE_POOL, "--transfer-timeout-ms", "3000"],
        env: &all_env,
        toml: &toml,
        placement,
        ..Spec::default()
    })
}

/// A `/v1/completions` body (greedy).
pub(crate) fn completion(prompt: &str, max_tokens: u32, stream: bool) -> String {
    serde_json::json!({
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    })
    .to_string()
}

/// A `/v1/chat/completions` body (greedy).
pub(crate) fn chat(content: &str, max_tokens: u32, stream: bool) -> String {
    serde_json::json!({
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    })
    .to_string()
}

/// A prompt of roughly `tokens` tokens (ten per sentence) that carries `canary`.
pub(crate) fn long_prompt(canary: &str, tokens: usize) -> String {
    let mut p = format!("Remember the code {canary}. ");
    while p.len() < tokens * 5 {
        p.push_str("The harbour town keeps every record in order. ");
    }
    p
}

/// A tenant's requests that fit every pool, each with its own canary: a chat, a streamed chat
/// and a streamed completion.
pub(crate) fn fitting(tenant: Tenant) -> Vec<(&'static str, String, String)> {
    (0..3)
        .map(|i| {
            let c = canary(&tenant);
            let (path, body) = match i {
                0 => (
                    "/v1/chat/completions",
                    chat(&format!("Repeat this code word: {c}"), 8, false),
                ),
                1 => (
                    "/v1/chat/completions",
                    chat(&format!("Say {c} twice."), 8, true),
                ),
                _ => (
                    "/v1/completions",
                    completion(&format!("The code word is {c}. The code word is"), 8, true),
                ),
            };
            (path, body, c)
        })
        .collect()
}

/// The over-pool prompts of the incident, sent by tenant A: one over the prefill pool only
/// (about 300 tokens: decode could hold it) and one over both pools (about 600 tokens).
pub(crate) fn over_pool(canary: &str) -> [String; 2] {
    [
        completion(&long_prompt(canary, 300), 8, false),
        completion(&long_prompt(canary, 600), 8, true),
    ]
}

/// Sends `over` (tenant A's) while tenants B and C send their fitting requests, all at once;
/// returns A's exchanges, in order.
pub(crate) fn incident_traffic(
    api: &str,
    ledger: &Ledger,
    a_canary: &str,
    over: &[String],
) -> Vec<Exchange> {
    std::thread::scope(|s| {
        let a = s.spawn(|| {
            over.iter()
                .map(|body| ledger.send(api, TENANT_A, "/v1/completions", body, &[a_canary]))
                .collect::<Vec<_>>()
        });
        for tenant in [TENANT_B, TENANT_C] {
            s.spawn(move || {
                for (path, body, c) in fitting(tenant) {
                    let e = ledger.send(api, tenant, path, &body, &[&c]);
                    assert_eq!(e.status, 200, "{}: {}", tenant.id, e.response);
                }
            });
        }
        a.join().expect("tenant A's client")
    })
}

/// The pools of both workers as the scenario starts.
pub(crate) fn baseline(cluster: &Cluster) -> [Pool; 2] {
    let b = [Pool::of(&cluster.prefill), Pool::of(&cluster.decode)];
    for p in &b {
        assert_eq!(p.available(), p.total(), "a fresh pool is all free: {p:?}");
    }
    b
}

/// Every oracle over the drained scenario: the findings, empty when isolation held.
/// `quarantined` is the pages each worker (prefill, decode) is expected to have quarantined.
pub(crate) fn oracle_findings(
    cluster: &Cluster,
    baseline: [Pool; 2],
    quarantined: [u32; 2],
    ledger: &Ledger,
    reference: &mut Reference,
) -> Vec<String> {
    let exchanges = ledger.all();
    let mut findings = pool_findings("prefill", &cluster.prefill, baseline[0], quarantined[0]);
    findings.extend(pool_findings(
        "decode",
        &cluster.decode,
        baseline[1],
        quarantined[1],
    ));
    let (audit, records) = audit_findings(&cluster.gateway.admin, &exchanges);
    findings.extend(audit);
    findings.extend(canary_findings(&exchanges, &cluster.logs(), &records));
    findings.extend(solo_findings(&exchanges, reference));
    findings
}

/// The prompt tokens a request read from a prefix cache: computed from it on the prefill
/// worker, not sent because it was there on the decode worker.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct CacheReads {
    pub prefill: f64,
    pub decode: f64,
}

/// Tenant A sends one long prompt twice, then tenant B sends the same prompt, on the
/// incident's cluster with `env`: what A's second request and B's read from the workers'
/// prefix caches. Every oracle must hold.
pub(crate) fn one_prompt_from_two_tenants(env: &[(&str, &str)]) -> [CacheReads; 2] {
    let mut env = env.to_vec();
    env.push(("BULKHEAD_PREFIX_CACHE", "true"));
    let (cluster, mut reference) = start_with_reference(&env, None);
    let baseline = baseline(&cluster);
    let ledger = Ledger::default();
    let body = completion(&long_prompt("in the harbour", 120), 8, false);
    let hits = || {
        let hits = |w: &Worker| {
            crate::worker_grpc::metric(&w.metrics(), "bulkhead_prefix_cache_hit_tokens_total")
        };
        CacheReads {
            prefill: hits(&cluster.prefill),
            decode: hits(&cluster.decode),
        }
    };
    let send = |tenant: Tenant| {
        let before = hits();
        let e = ledger.send(cluster.api(), tenant, "/v1/completions", &body, &[]);
        assert_eq!(e.status, 200, "{}: {}", tenant.id, e.response);
        let after = hits();
        let read = CacheReads {
            prefill: after.prefill - before.prefill,
            decode: after.decode - before.decode,
        };
        // The client is told, in OpenAI's field, through decode from prefill's answer.
        let usage: Value = serde_json::from_str(&e.response).expect("a JSON body");
        let told = &usage["usage"]["prompt_tokens_details"]["cached_tokens"];
        assert_eq!(told.as_f64(), Some(read.prefill), "{}", e.response);
        read
    };
    send(TENANT_A);
    let read = [send(TENANT_A), send(TENANT_B)];
    assert_clean(&oracle_findings(
        &cluster,
        baseline,
        [0, 0],
        &ledger,
        &mut reference,
    ));
    read
}

#[test]
fn a_prompt_reads_only_its_own_tenants_prefix_cache() {
    bounded(|| {
        let [a, b] = one_prompt_from_two_tenants(&[]);
        assert!(
            a.prefill >= 64.0,
            "tenant A's repeat read its own cached pages: {a:?}"
        );
        // Decode kept the pages A's first transfer filled: the repeat was sent only the rest.
        assert_eq!(a.decode, a.prefill, "{a:?}");
        let none = CacheReads {
            prefill: 0.0,
            decode: 0.0,
        };
        assert_eq!(b, none, "tenant B read tenant A's cached pages");
    });
}

/// The audit record of `e` (its tenant's, through the admin listener).
pub(crate) fn record_of(cluster: &Cluster, e: &Exchange) -> Value {
    let id = e.request_id.as_deref().expect("a request id");
    crate::up::admin_records(&cluster.gateway.admin, e.tenant.id)
        .into_iter()
        .find(|r| r["bulkhead.request.id"] == id)
        .unwrap_or_else(|| panic!("no audit record for {id}"))
}

/// Asserts that `e` was refused with 400 `context_length_exceeded` by `layer`'s admission.
pub(crate) fn assert_refused_by(cluster: &Cluster, e: &Exchange, layer: &str) {
    e.assert_failed(400, "context_length_exceeded");
    let record = record_of(cluster, e);
    assert_eq!(
        record["bulkhead.admission"]["outcome"], "rejected",
        "{record:#}"
    );
    assert_eq!(record["bulkhead.admission"]["layer"], layer, "{record:#}");
    assert_eq!(
        record["bulkhead.kv.integrity"]["result"], "not_checked",
        "{record:#}"
    );
}

/// Starts the incident's cluster and the solo reference at once (each loads the model).
pub(crate) fn start_with_reference(
    env: &[(&str, &str)],
    placement: Option<Placement<'_>>,
) -> (Cluster, Reference) {
    std::thread::scope(|s| {
        let reference = s.spawn(Reference::start);
        let cluster = incident_cluster(env, placement);
        (cluster, reference.join().expect("the reference starts"))
    })
}

/// The incident with every check on, the workers at `placement`: A's prompts over the pools are
/// refused by the gateway (its limit is the prefill pool's 256), B's and C's requests are
/// served exactly as alone, and no oracle finds anything.
pub(crate) fn the_incident_at(placement: Option<Placement<'_>>) {
    let (cluster, mut reference) = start_with_reference(&[], placement);
    // Pools smaller than the model's context pass the deployment check (I7): each worker
    // serves no more than its pool holds.
    let (passed, report) = preflight(&cluster.config);
    assert!(passed, "{report}");
    assert!(
        report.contains("pool 256 tokens, served context 256"),
        "{report}"
    );
    // And it says the pair admits only prefill's 256 of decode's 512.
    assert!(
        report.contains("WARN") && report.contains("decode serves 512 tokens, prefill 256"),
        "{report}"
    );
    let baseline = baseline(&cluster);
    let ledger = Ledger::default();
    let a_canary = canary(&TENANT_A);
    let over = over_pool(&a_canary);
    // Over prefill's pool only, and over both pools.
    let tokens = over
        .each_ref()
        .map(|body| reference.prompt_tokens("/v1/completions", body));
    assert!((257..504).contains(&tokens[0]), "{tokens:?}");
    assert!(tokens[1] > 512, "{tokens:?}");
    let started = Instant::now();
    let refused = incident_traffic(cluster.api(), &ledger, &a_canary, &over);
    for e in &refused {
        assert_refused_by(&cluster, e, "gateway");
        let message = serde_json::from_str::<Value>(&e.response).expect("JSON")["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        assert!(
            message.contains("the limit is 256"),
            "the limit is the smaller pool's: {message}"
        );
    }
    assert!(started.elapsed() < Duration::from_secs(120));
    assert_clean(&oracle_findings(
        &cluster,
        baseline,
        [0, 0],
        &ledger,
        &mut reference,
    ));
}

#[test]
fn the_incident_is_refused_at_the_gateway_while_other_tenants_are_served_and_nothing_leaks() {
    bounded(|| the_incident_at(None));
}

/// Strings only the switches' code holds (bulkhead-checks' feature `switches`, the binary's
/// `check-switches`): the environment variable and what a process logs when it obeys it.
pub(crate) const SWITCH_STRINGS: [&str; 3] = [
    "BULKHEAD_TEST_SWITCHES",
    "ISOLATION CHECK TURNED OFF",
    "FAULT INJECTED",
];

/// Whether the `bulkhead` binary under test contains `needle`.
pub(crate) fn binary_contains(needle: &str) -> bool {
    let binary = std::fs::read(env!("CARGO_BIN_EXE_bulkhead")).expect("reads the binary");
    binary.windows(needle.len()).any(|w| w == needle.as_bytes())
}

/// A build without `check-switches` (every release) holds no switch: nothing in it reads the
/// variable, so no environment can turn a check off. (The test build's twin of this test,
/// `isolation_switches::the_test_build_holds_the_switches`, shows the search finds them.)
#[cfg(not(feature = "check-switches"))]
#[test]
fn the_production_binary_holds_no_switch_that_could_turn_a_check_off() {
    for needle in SWITCH_STRINGS {
        assert!(!binary_contains(needle), "the binary holds {needle:?}");
    }
}
