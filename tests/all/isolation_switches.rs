//! The isolation suite with checks turned off (test builds only: `--features check-switches`;
//! every process reads `BULKHEAD_TEST_SWITCHES`, see bulkhead-checks).
//!
//! - One layer off at a time: the incident (crate::isolation) is still refused, by the next
//!   layer, and no oracle finds anything.
//! - Every check off: the incident's prompt still cannot leak — no pool can place it, so it
//!   waits until its transfer deadline fails it (a finding, asserted precisely below).
//! - The incident's own bug put back in prefill (a refused prompt becomes a one-page
//!   placeholder that claims the whole prompt): the handoff verification stops it; with the
//!   verification and the other checks off, decode attends over another tenant's KV and the
//!   oracles detect the leak — proof that they can fail.
//! - A frame prefill drops, over a page another tenant's request wrote (released pages kept as
//!   they were: `--scrub none`): the handoff verification refuses the transfer; with it off,
//!   the engine's check of what it reads does — the page is the reader's own allocation, under
//!   its own tag, so the tags alone cannot tell, but its slots were never written for it (I2,
//!   `worker/src/engine/written.rs`); with both off, decode attends over the other tenant's KV
//!   and solo equality sees it.

use std::time::{Duration, Instant};

use crate::cluster::{Cluster, Spec, VERBOSE_LOG, preflight};
use crate::isolation::{
    SWITCH_STRINGS, assert_refused_by, baseline, binary_contains, completion, incident_traffic,
    long_prompt, one_prompt_from_two_tenants, oracle_findings, over_pool, record_of,
    start_with_reference,
};
use crate::oracles::{
    Exchange, Ledger, Pool, Reference, TENANT_A, TENANT_B, TENANT_C, assert_clean, canary,
    tenant_c_toml,
};
use crate::policies::{abandon, guard_and_ledger};
use crate::up::{KEY_A, TempDir, bounded, wait_records};
use crate::worker_grpc::{metric, metric_sum};

const SWITCHES: &str = "BULKHEAD_TEST_SWITCHES";

#[test]
fn the_test_build_holds_the_switches() {
    // The twin of isolation::the_production_binary_holds_no_switch_that_could_turn_a_check_off:
    // the same search finds them in this build.
    for needle in SWITCH_STRINGS {
        assert!(binary_contains(needle), "the test build lacks {needle:?}");
    }
    assert_eq!(SWITCH_STRINGS[0], SWITCHES);
}

/// The incident with `check` off alone: A's prompt over the prefill pool and A's prompt over
/// both pools are refused with 400 `context_length_exceeded` by `layers` (in that order), the
/// other tenants are served, and every oracle holds.
///
/// A worker whose integrity check is off gets no traffic at all while the gateway's routing
/// checks are on (a_worker_with_its_tag_check_off_gets_no_traffic); to see the layers after the
/// routing at work without it, those are off too.
fn with_one_check_off(check: &'static str, layers: [&'static str; 2]) {
    bounded(move || {
        let integrity_off = matches!(check, "handoff-verification" | "tag-check");
        let switches = if integrity_off {
            format!("{check},routing-checks")
        } else {
            check.to_owned()
        };
        let (cluster, mut reference) = start_with_reference(&[(SWITCHES, &switches)], None);
        let baseline = baseline(&cluster);
        let ledger = Ledger::default();
        let a_canary = canary(&TENANT_A);
        let refused = incident_traffic(cluster.api(), &ledger, &a_canary, &over_pool(&a_canary));
        for (e, layer) in refused.iter().zip(layers) {
            assert_refused_by(&cluster, e, layer);
        }
        assert_clean(&oracle_findings(
            &cluster,
            baseline,
            [0, 0],
            &ledger,
            &mut reference,
        ));
        // The process whose check is off says so loudly.
        let loud = match check {
            "gateway-limit" => 0,
            "prefill-admission" => 1,
            _ => 2,
        };
        let (name, log) = &cluster.logs()[loud];
        assert!(
            log.contains("ISOLATION CHECK TURNED OFF") && log.contains(check),
            "the {name} log does not say that {check} is off"
        );
        // The deployment check sees a worker whose integrity checks are off (the gateway, its
        // routing checks off, served the other tenants through it).
        let (passed, report) = preflight(&cluster.config);
        assert_eq!(passed, !integrity_off, "{report}");
        if integrity_off {
            assert!(
                report.contains("FAIL local-decode") && report.contains("integrity checks on"),
                "{report}"
            );
        }
    });
}

#[test]
fn without_the_gateway_limit_prefill_and_decode_admission_refuse_the_incident() {
    // Over prefill's pool only: decode admits it (it fits decode's pool), prefill refuses it.
    // Over both: decode refuses it and prefill never hears of it.
    with_one_check_off("gateway-limit", ["prefill", "decode"]);
}

#[test]
fn without_decode_admission_the_gateway_refuses_the_incident() {
    with_one_check_off("decode-admission", ["gateway", "gateway"]);
}

#[test]
fn without_prefill_admission_the_gateway_refuses_the_incident() {
    with_one_check_off("prefill-admission", ["gateway", "gateway"]);
}

#[test]
fn without_the_handoff_verification_the_gateway_refuses_the_incident() {
    with_one_check_off("handoff-verification", ["gateway", "gateway"]);
}

#[test]
fn without_the_tag_check_the_gateway_refuses_the_incident() {
    with_one_check_off("tag-check", ["gateway", "gateway"]);
}

#[test]
fn a_worker_with_its_tag_check_off_gets_no_traffic() {
    bounded(|| {
        // The gateway's routing checks on: it reads decode's Info, sees its page tags off, and
        // routes nothing to it. (With the routing checks off too, the same worker serves every
        // tenant: without_the_tag_check_the_gateway_refuses_the_incident.)
        let cluster = Cluster::start(Spec {
            env: &[(SWITCHES, "tag-check")],
            decode_unroutable: true,
            ..Spec::default()
        });
        let report = cluster.gateway.wait_judged("local-decode");
        let reason = report["unroutable_reason"].as_str().unwrap_or_default();
        assert!(
            reason.contains("integrity checks on") && reason.contains("page tags OFF"),
            "{report:#}"
        );
        let ledger = Ledger::default();
        for tenant in [TENANT_A, TENANT_B] {
            let (path, body, c) = crate::isolation::fitting(tenant).swap_remove(0);
            let e = ledger.send(cluster.api(), tenant, path, &body, &[&c]);
            e.assert_failed(503, "service_unavailable");
        }
        // Neither worker heard of a request.
        for worker in [&cluster.prefill, &cluster.decode] {
            let m = worker.metrics();
            assert_eq!(metric_sum(&m, "bulkhead_requests_total"), 0.0, "{m}");
            assert_eq!(
                metric(&m, "bulkhead_prompt_tokens_computed_total"),
                0.0,
                "{m}"
            );
        }
    });
}

#[test]
fn without_the_prefix_scope_a_tenant_reads_another_tenants_cached_prompt() {
    bounded(|| {
        let [a, b] = one_prompt_from_two_tenants(&[(SWITCHES, "prefix-scope")]);
        assert!(
            a.prefill >= 64.0 && a.decode == a.prefill,
            "tenant A's repeat read its own cached pages: {a:?}"
        );
        // One cache for every tenant on each worker: B's prompt is served from A's pages, and
        // how fast it is served tells B what A sent — what the scope prevents
        // (isolation::a_prompt_reads_…); on decode, B's request attends over A's KV.
        assert_eq!(b, a, "tenant B read tenant A's cached pages");
    });
}

#[test]
fn with_every_check_off_the_incident_prompt_is_never_placed_so_it_fails_instead_of_leaking() {
    bounded(|| {
        let (cluster, mut reference) = start_with_reference(&[(SWITCHES, "all")], None);
        let baseline = baseline(&cluster);
        let ledger = Ledger::default();
        let a_canary = canary(&TENANT_A);
        // Only the prompt over the prefill pool: decode reserves it (it fits decode's pool) and
        // asks prefill, whose pool can never hold it. (A prompt over decode's pool too would
        // wait at the head of decode's queue with no deadline at all.)
        let [mid, _] = over_pool(&a_canary);
        let api = cluster.api().to_owned();
        let started = Instant::now();
        let exchange = std::thread::scope(|s| {
            let a = s.spawn(|| ledger.send(&api, TENANT_A, "/v1/completions", &mid, &[&a_canary]));
            // While it waits: prefill has it queued and nothing running; decode holds its pages.
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let m = cluster.prefill.metrics();
                if metric(&m, "bulkhead_queue_depth") == 1.0 {
                    assert_eq!(metric(&m, "bulkhead_running_requests"), 0.0, "{m}");
                    let p = Pool::of(&cluster.prefill);
                    assert_eq!(p.available(), p.total(), "prefill placed nothing: {p:?}");
                    let d = Pool::of(&cluster.decode);
                    assert!(d.reserved > 0, "decode reserved the prompt: {d:?}");
                    break;
                }
                assert!(Instant::now() < deadline, "prefill never queued it:\n{m}");
                std::thread::sleep(Duration::from_millis(50));
            }
            a.join().expect("tenant A's client")
        });
        let took = started.elapsed();
        // No layer refused it, nothing computed it: it fails at decode's transfer deadline
        // (3 s, plus the prompt's bytes at the rate floor) with a 503, never a 200.
        exchange.assert_failed(503, "service_unavailable");
        assert!(
            took >= Duration::from_secs(3) && took < Duration::from_secs(15),
            "failed after {took:?}"
        );
        let record = record_of(&cluster, &exchange);
        assert_eq!(
            record["bulkhead.admission"]["outcome"], "admitted",
            "{record:#}"
        );
        // The pools come back whole (prefill's queue let go when decode gave up), and the other
        // tenants are served as before — once the gateway, which took the failure for a sick
        // worker and stopped routing to it, has checked it again (an availability cost of the
        // stall for every tenant).
        cluster.gateway.wait_until(&[("local-decode", true)]);
        std::thread::scope(|s| {
            for tenant in [TENANT_B, TENANT_C] {
                let (api, ledger) = (&api, &ledger);
                s.spawn(move || {
                    for (path, body, c) in crate::isolation::fitting(tenant).into_iter().take(1) {
                        let e = ledger.send(api, tenant, path, &body, &[&c]);
                        assert_eq!(e.status, 200, "{}: {}", tenant.id, e.response);
                    }
                });
            }
        });
        assert_clean(&oracle_findings(
            &cluster,
            baseline,
            [0, 0],
            &ledger,
            &mut reference,
        ));
    });
}

/// Tokens per KV page (the workers' default).
const PAGE: u64 = 16;
/// Prints the oracles' `findings` with `off` turned off (expected), and asserts that solo
/// equality caught tenant B's answer.
fn assert_solo_equality_caught_b(findings: &[String], off: &str) {
    eprintln!(
        "the oracles' findings with {off} off (expected):\n- {}",
        findings.join("\n- ")
    );
    assert!(
        findings
            .iter()
            .any(|f| f.starts_with("NOT SOLO-EQUAL: tenant-b")),
        "solo equality must catch B's answer: {findings:#?}"
    );
}

/// The decode pool of the placeholder scenarios: 8 pages, exactly one request's reservation,
/// so the second request gets the first one's pages, in the same order.
const DECODE_PAGES: u64 = 8;

/// A deployment whose decode pool is exactly one request's reservation and keeps what a
/// released page held: a prefill pool of `prefill_tokens`, a decode pool of 8 pages, released
/// pages not scrubbed (`--scrub none`: what a page held stays until it is written again) and no
/// prefix cache, so that the second request gets the first one's pages, in the same order; and
/// the test build's `switches` (faults injected, checks off).
fn reused_pages_cluster(prefill_tokens: &str, switches: &str) -> Cluster {
    let toml = tenant_c_toml();
    let decode_pool = (PAGE * DECODE_PAGES).to_string();
    Cluster::start(Spec {
        prefill: &["--kv-tokens", prefill_tokens],
        // The incident's decode worker: no prefix cache, so A's released pages are the next
        // reservation's, in A's order (with the cache, A's prompt pages stay in A's cache and
        // come back evicted in another order: B still reads stale KV, but not A's canary).
        decode: &[
            "--kv-tokens",
            &decode_pool,
            "--scrub",
            "none",
            "--prefix-cache",
            "false",
        ],
        env: &[("BULKHEAD_LOG", VERBOSE_LOG), (SWITCHES, switches)],
        toml: &toml,
        ..Spec::default()
    })
}

/// The placeholder scenario's deployment: a prefill pool of 64 tokens (4 pages), the incident's
/// bug injected into prefill and `checks` off, on [`reused_pages_cluster`]'s decode worker.
fn placeholder_cluster(checks: &str) -> Cluster {
    reused_pages_cluster("64", &format!("incident-placeholder,{checks}"))
}

/// Tenant A's request that fits: a prompt of A's canary, over and over (under prefill's 64
/// tokens), with enough new tokens that prompt + output take exactly every decode page. Then
/// tenant B's prompt over prefill's pool (under decode's), also taking exactly every page: its
/// reservation is A's pages, in A's order.
fn placeholder_traffic(cluster: &Cluster, ledger: &Ledger, reference: &Reference, a_canary: &str) {
    let pool = PAGE * DECODE_PAGES;
    let path = "/v1/completions";
    let a_prompt = format!("{a_canary} ").repeat(5);
    let a_tokens = reference.prompt_tokens(path, &completion(&a_prompt, 1, false));
    assert!(a_tokens <= 64, "A's prompt fits prefill's pool: {a_tokens}");
    let a_body = completion(&a_prompt, (pool - a_tokens) as u32, false);
    let a = ledger.send(cluster.api(), TENANT_A, path, &a_body, &[a_canary]);
    assert_eq!(a.status, 200, "{}", a.response);
    let b_canary = canary(&TENANT_B);
    let b_prompt = long_prompt(&b_canary, 80);
    let b_tokens = reference.prompt_tokens(path, &completion(&b_prompt, 1, false));
    assert!(
        (65..pool - 8).contains(&b_tokens),
        "B's prompt is over prefill's pool and leaves room to generate: {b_tokens}"
    );
    let b_body = completion(&b_prompt, (pool - b_tokens) as u32, false);
    ledger.send(cluster.api(), TENANT_B, path, &b_body, &[&b_canary]);
}

#[test]
fn the_incidents_placeholder_is_stopped_by_the_handoff_verification_and_its_pages_quarantined() {
    bounded(|| {
        // The gateway limit off, so B's prompt reaches prefill; every other check on.
        let (cluster, mut reference) = std::thread::scope(|s| {
            let r = s.spawn(Reference::start);
            (
                placeholder_cluster("gateway-limit"),
                r.join().expect("reference"),
            )
        });
        let baseline = baseline(&cluster);
        let ledger = Ledger::default();
        placeholder_traffic(&cluster, &ledger, &reference, &canary(&TENANT_A));
        let b = ledger.all().pop().expect("B's exchange");
        b.assert_failed(500, "kv_integrity_error");
        let record = record_of(&cluster, &b);
        assert_eq!(
            record["bulkhead.kv.integrity"]["result"], "failed",
            "{record:#}"
        );
        assert!(
            cluster.logs()[1]
                .1
                .contains("FAULT INJECTED (incident-placeholder)"),
            "prefill took the placeholder path"
        );
        // B's whole reservation is quarantined on decode, nothing else anywhere.
        assert_clean(&oracle_findings(
            &cluster,
            baseline,
            [0, DECODE_PAGES as u32],
            &ledger,
            &mut reference,
        ));
    });
}

#[test]
fn with_the_placeholder_put_back_and_the_checks_off_the_oracles_detect_the_leak() {
    bounded(|| {
        // Prefill admission stays on: the incident's bug lives in what it does with a refusal.
        let (cluster, mut reference) = std::thread::scope(|s| {
            let r = s.spawn(Reference::start);
            let off =
                "gateway-limit,routing-checks,decode-admission,handoff-verification,tag-check";
            (placeholder_cluster(off), r.join().expect("reference"))
        });
        let baseline = baseline(&cluster);
        let ledger = Ledger::default();
        // A fixed canary: greedy decoding over the same pages makes the run deterministic, and
        // with this one the model copies A's canary into B's answer (with another it may copy
        // only part of it, and solo equality alone would see the leak).
        let a_canary = "QXA65677683";
        placeholder_traffic(&cluster, &ledger, &reference, a_canary);
        let b = ledger.all().pop().expect("B's exchange");
        // The incident's symptom: HTTP 200, the right prompt_tokens, another tenant's data.
        assert_eq!(b.status, 200, "{}", b.response);
        let findings = oracle_findings(&cluster, baseline, [0, 0], &ledger, &mut reference);
        assert_solo_equality_caught_b(&findings, "the checks");
        assert!(
            findings
                .iter()
                .any(|f| f.starts_with("LEAK: tenant-b") && f.contains(a_canary)),
            "the canary oracle must find A's canary in B's answer: {findings:#?}"
        );
    });
}

/// A prompt of several pages from B while the prefill worker tampers with the second frame of
/// every transfer (`fault`): decode never commits it — 500 `kv_integrity_error`, its whole
/// reservation quarantined — and drops the frame for the reason `dropped` names, if any.
fn with_a_frame_fault(fault: &'static str, dropped: Option<&'static str>) {
    bounded(move || {
        let toml = tenant_c_toml();
        let (cluster, mut reference) = std::thread::scope(|s| {
            let r = s.spawn(Reference::start);
            let cluster = Cluster::start(Spec {
                prefill: &["--kv-tokens", "512"],
                decode: &["--kv-tokens", "512"],
                env: &[("BULKHEAD_LOG", VERBOSE_LOG), (SWITCHES, fault)],
                toml: &toml,
                ..Spec::default()
            });
            (cluster, r.join().expect("reference"))
        });
        let baseline = baseline(&cluster);
        let ledger = Ledger::default();
        let c = canary(&TENANT_B);
        let body = completion(&long_prompt(&c, 60), 8, false);
        let tokens = reference.prompt_tokens("/v1/completions", &body);
        assert!(tokens > PAGE, "the prompt spans pages: {tokens}");
        let pages = (tokens + 8).div_ceil(PAGE) as u32;
        let e = ledger.send(cluster.api(), TENANT_B, "/v1/completions", &body, &[&c]);
        e.assert_failed(500, "kv_integrity_error");
        let record = record_of(&cluster, &e);
        assert_eq!(
            record["bulkhead.kv.integrity"]["result"], "failed",
            "{record:#}"
        );
        let m = cluster.decode.metrics();
        assert_eq!(
            metric(&m, "bulkhead_kv_integrity_failures_total"),
            1.0,
            "{m}"
        );
        if let Some(reason) = dropped {
            let series = format!("bulkhead_kv_frames_dropped_total{{reason=\"{reason}\"}}");
            assert!(metric(&m, &series) >= 1.0, "{m}");
        }
        assert_clean(&oracle_findings(
            &cluster,
            baseline,
            [0, pages],
            &ledger,
            &mut reference,
        ));
    });
}

#[test]
fn a_corrupted_frame_across_processes_fails_the_request_and_quarantines_its_pages() {
    with_a_frame_fault("corrupt-frame", Some("corrupt"));
}

#[test]
fn a_dropped_frame_across_processes_fails_the_request_and_quarantines_its_pages() {
    with_a_frame_fault("drop-frame", None);
}

#[test]
fn a_duplicated_frame_across_processes_fails_the_request_and_quarantines_its_pages() {
    with_a_frame_fault("duplicate-frame", Some("duplicate"));
}

#[test]
fn a_frame_under_a_forged_nonce_is_never_written_and_the_request_fails() {
    with_a_frame_fault("forged-nonce", Some("no_session"));
}

#[test]
fn a_frame_with_a_stale_tag_is_never_written_and_the_request_fails() {
    with_a_frame_fault("stale-tag", Some("tag_not_reserved"));
}

/// Tenant A's request of one page of prompt takes every page of the decode pool
/// ([`reused_pages_cluster`]); then B's prompt of several pages, also taking every page (A's,
/// in A's order), while prefill drops the second frame of every transfer of two frames or
/// more: B's alone. That page is B's reservation but still holds the KV A's request wrote into
/// it, and decode is told the transfer is complete. `switches` holds `drop-frame` and the
/// checks turned off. Returns B's exchange, the oracles' findings and decode's `/metrics`
/// after it.
fn a_dropped_frame_over_the_page_a_wrote(switches: &str) -> (Exchange, Vec<String>, String) {
    let (cluster, mut reference) = std::thread::scope(|s| {
        let r = s.spawn(Reference::start);
        (
            reused_pages_cluster("512", switches),
            r.join().expect("reference"),
        )
    });
    let baseline = baseline(&cluster);
    let ledger = Ledger::default();
    let path = "/v1/completions";
    let pool = PAGE * DECODE_PAGES;
    let a_canary = canary(&TENANT_A);
    let a_prompt = format!("The code is {a_canary}.");
    let a_tokens = reference.prompt_tokens(path, &completion(&a_prompt, 1, false));
    assert!(a_tokens <= PAGE, "A's transfer is one frame: {a_tokens}");
    let a_body = completion(&a_prompt, (pool - a_tokens) as u32, false);
    let a = ledger.send(cluster.api(), TENANT_A, path, &a_body, &[&a_canary]);
    assert_eq!(a.status, 200, "A's transfer loses no frame: {}", a.response);
    let b_canary = canary(&TENANT_B);
    let b_prompt = long_prompt(&b_canary, 40);
    let b_tokens = reference.prompt_tokens(path, &completion(&b_prompt, 1, false));
    assert!(
        (2 * PAGE + 1..pool - 8).contains(&b_tokens),
        "B's transfer is three frames or more and leaves room to generate: {b_tokens}"
    );
    let b_body = completion(&b_prompt, (pool - b_tokens) as u32, false);
    let b = ledger.send(cluster.api(), TENANT_B, path, &b_body, &[&b_canary]);
    let quarantined = if b.status == 200 {
        0
    } else {
        DECODE_PAGES as u32
    };
    let findings = oracle_findings(
        &cluster,
        baseline,
        [0, quarantined],
        &ledger,
        &mut reference,
    );
    (b, findings, cluster.decode.metrics())
}

/// [`a_dropped_frame_over_the_page_a_wrote`] with `switches`, refused: 500
/// `kv_integrity_error`, B's whole reservation quarantined, every oracle clean;
/// `failed_verification` transfers failed the handoff verification (0: another layer refused).
fn a_dropped_frame_is_refused(switches: &'static str, failed_verification: f64) {
    bounded(move || {
        let (b, findings, m) = a_dropped_frame_over_the_page_a_wrote(switches);
        b.assert_failed(500, "kv_integrity_error");
        assert_eq!(
            metric(&m, "bulkhead_kv_integrity_failures_total"),
            failed_verification,
            "{m}"
        );
        assert_clean(&findings);
    });
}

#[test]
fn a_dropped_frame_over_another_tenants_page_is_stopped_by_the_handoff_verification() {
    a_dropped_frame_is_refused("drop-frame", 1.0);
}

#[test]
fn without_the_handoff_verification_a_dropped_frame_is_stopped_by_the_check_of_what_is_read() {
    // The transfer commits, unverified; the first step that would read the page fails.
    a_dropped_frame_is_refused("drop-frame,handoff-verification,routing-checks", 0.0);
}

#[test]
fn without_the_verification_and_the_tag_check_a_dropped_frame_leaves_b_attending_over_as_kv() {
    bounded(|| {
        let (b, findings, m) = a_dropped_frame_over_the_page_a_wrote(
            "drop-frame,handoff-verification,tag-check,routing-checks",
        );
        // The incident's symptom again: HTTP 200 for an answer computed over A's KV.
        assert_eq!(b.status, 200, "{}", b.response);
        assert_eq!(
            metric(&m, "bulkhead_kv_integrity_failures_total"),
            0.0,
            "{m}"
        );
        assert_solo_equality_caught_b(&findings, "the verification and the tag check");
    });
}

/// A request held after its client left (`abort-guard`: until prefill is done) whose KV
/// handoff then fails its checks (prefill corrupts the second frame of every transfer): the
/// hold ends with the worker's failure, and the record says so — the client left, the stream
/// was held and failed with `kv_integrity_error`, the handoff's integrity `failed` — never as
/// a handoff that was not checked.
#[test]
fn a_held_request_whose_handoff_fails_its_checks_is_recorded_so() {
    bounded(|| {
        let dir = TempDir::new("held-integrity");
        let set = guard_and_ledger(
            &dir.0,
            "config = { on_disconnect = \"abort-now\", phases = [] }",
        );
        let cluster = Cluster::start(Spec {
            env: &[(SWITCHES, "corrupt-frame")],
            replace: &[
                ("file = \"policies/local.toml\"", &set),
                // A long prefill on a loaded machine can outlast the default 30 s.
                ("hold_limit_secs = 30", "hold_limit_secs = 150"),
            ],
            ..Spec::default()
        });
        // Long enough that its prefill outlasts the gateway noticing the client gone (at its
        // next keep-alive comment, within a second).
        let long = format!(
            r#"{{"messages":[{{"role":"user","content":"Summarize: {}"}}],"max_tokens":16,"stream":true,"temperature":0}}"#,
            "the quick brown fox jumps over the lazy dog. ".repeat(200)
        );
        abandon(cluster.api(), KEY_A, &long);
        let deadline = Instant::now() + Duration::from_secs(150);
        while metric(
            &cluster.decode.metrics(),
            "bulkhead_kv_integrity_failures_total",
        ) < 1.0
        {
            assert!(Instant::now() < deadline, "the handoff never failed");
            std::thread::sleep(Duration::from_millis(100));
        }
        let record = wait_records(&cluster.gateway.admin, "tenant-a", 1)
            .pop()
            .expect("its record");
        assert_eq!(record["error.type"], "client_disconnected", "{record:#}");
        assert_eq!(record["bulkhead.disconnect.phase"], "prefill", "{record:#}");
        let hold = &record["bulkhead.disconnect.hold"];
        assert_eq!(hold["directive"], "hold_until_prefill_done", "{record:#}");
        assert_eq!(hold["dropped"], "before_first_token", "{record:#}");
        assert_eq!(hold["failed"], "kv_integrity_error", "{record:#}");
        assert_eq!(
            record["bulkhead.kv.integrity"]["result"], "failed",
            "{record:#}"
        );
        assert!(record["gen_ai.usage.output_tokens"].is_null(), "{record:#}");
    });
}
