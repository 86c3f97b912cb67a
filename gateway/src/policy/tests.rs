//! The policy host against real components (plugins/dist/, built by scripts/build-plugins):
//! the built-ins, a policy in each other language (Python, JavaScript, C), a 0.1.0 plugin, and
//! hostile plugins for every limit.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::response::IntoResponse;
use http::{HeaderMap, HeaderName, HeaderValue};

use super::*;
use crate::api::Endpoint;
use crate::config::AuditSettings;
use crate::limits::Limiter;
use crate::metrics::Metrics;
use crate::scratch::Scratch;
use crate::tenant::{Tenant, TenantId, TenantLimits};
use crate::trail::{Recorder, Trail};

/// Where scripts/build-plugins puts the components.
fn dist() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../plugins/dist")
}

/// The component `name`, with its sha256; fails with what to run when it was not built.
fn component(name: &str) -> (PathBuf, Digest) {
    let path = dist().join(format!("{name}.wasm"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}. Build the policy plugins first: scripts/build-plugins",
            path.display()
        )
    });
    (path, Digest::of(&bytes))
}

/// `[plugins.NAME]` for the built component `name`, with extra fields.
fn plugin(name: &str, extra: &str) -> String {
    let (path, digest) = component(name);
    format!(
        "[plugins.{name:?}]\ncomponent = {:?}\nsha256 = \"{digest}\"\n{extra}\n",
        path.display().to_string()
    )
}

fn binding(name: &str, extra: &str) -> String {
    format!("[[chain]]\nplugin = \"{name}\"\n{extra}\n")
}

fn settings(file: &Path, cache: Option<PathBuf>) -> PolicySettings {
    PolicySettings {
        file: file.to_owned(),
        sandbox: SandboxSettings {
            instances: 8,
            max_memory_bytes: 128 << 20,
            cache_dir: cache,
            ..SandboxSettings::default()
        },
        watch_interval: None,
        hold_limit: Duration::from_secs(5),
        max_held_per_tenant: 16,
    }
}

fn write(dir: &Scratch, text: &str) -> PathBuf {
    let path = dir.0.join("policies.toml");
    std::fs::write(&path, text).expect("writes the policy file");
    path
}

/// The set `text`, written in `dir`, loaded in a sandbox of `instances` slots.
fn with_slots(dir: &Scratch, text: &str, instances: u32) -> Policies {
    let mut s = settings(&write(dir, text), None);
    s.sandbox.instances = instances;
    Policies::load(s).expect("the set loads")
}

/// A set of `length-limit` alone, its binding's lines `binding`, loaded.
fn length_limit_with(binding_lines: &str) -> Result<(Policies, Scratch), PolicyError> {
    load(&format!(
        "{}{}",
        plugin("length-limit", ""),
        binding("length-limit", binding_lines)
    ))
}

fn load(text: &str) -> Result<(Policies, Scratch), PolicyError> {
    let dir = Scratch::new("policy");
    let path = write(&dir, text);
    Policies::load(settings(&path, None)).map(|p| (p, dir))
}

fn loaded(text: &str) -> (Policies, Scratch) {
    load(text).unwrap_or_else(|e| panic!("the set loads: {e}"))
}

/// A trail whose record goes to an audit log in `dir` (written when the trail is dropped).
fn trail(dir: &Scratch) -> Trail {
    recorder(dir).trail("req-test".into(), tracing::Span::none())
}

/// An audit log in `dir`, with the default settings.
fn recorder(dir: &Scratch) -> Recorder {
    let (recorder, _) = Recorder::open(
        &dir.0.join("audit"),
        AuditSettings::default(),
        None,
        Metrics::default(),
        None,
    )
    .expect("opens the audit log");
    recorder
}

/// tenant-a, allowed `tokens_per_minute`, one request at a time.
fn tenant(tokens_per_minute: u64) -> Arc<Tenant> {
    let nz = |n| std::num::NonZeroU32::new(n).expect("nonzero");
    Arc::new(Tenant {
        id: TenantId::new("tenant-a").expect("valid"),
        limits: TenantLimits {
            max_context: nz(8192),
            max_concurrent: nz(1),
            requests_per_minute: nz(600),
            tokens_per_minute: std::num::NonZeroU64::new(tokens_per_minute).expect("nonzero"),
        },
        capture_content: false,
        reuse_id: false,
    })
}

/// A request's claim on a tenant of its own (with room to spare), for tests that do not look
/// at it.
fn charge() -> Charge {
    Charge {
        permit: Limiter::default().start(&tenant(1000)).expect("room"),
        prompt_tokens: 10,
        max_tokens: 100,
        claim: None,
    }
}

struct Ask<'a> {
    tenant: &'a str,
    model: &'a str,
    route: &'a str,
    prompt: u32,
    max: u32,
    headers: HeaderMap,
}

impl Default for Ask<'_> {
    fn default() -> Self {
        Ask {
            tenant: "tenant-a",
            model: "m",
            route: "/v1/chat/completions",
            prompt: 10,
            max: 100,
            headers: HeaderMap::new(),
        }
    }
}

async fn ask(p: &Policies, a: Ask<'_>) -> Result<RequestPolicy, Refused> {
    p.on_request(RequestFacts {
        id: "chatcmpl-test",
        tenant: a.tenant,
        model: a.model,
        route: a.route,
        headers: &a.headers,
        prompt_tokens: a.prompt,
        max_tokens: a.max,
    })
    .await
}

fn fault_of(r: Result<RequestPolicy, Refused>) -> Fault {
    match r {
        Err(Refused {
            refusal: Refusal::Failed { fault, .. },
            ..
        }) => fault,
        other => panic!("expected a failed policy, got {other:?}"),
    }
}

/// A set of the `hostile` test plugin alone: `limits` for its `[plugins]` entry,
/// `binding_extra` for its chain entry (its attack, and whatever else the binding says).
fn hostile(limits: &str, binding_extra: &str) -> (Policies, Scratch) {
    loaded(&format!(
        "{}{}",
        plugin("hostile", limits),
        binding("hostile", binding_extra),
    ))
}

/// `tenant-a`'s request carrying `headers` (appended in order: a name may come twice).
async fn ask_with(p: &Policies, headers: &[(&str, &str)]) -> Result<RequestPolicy, Refused> {
    let mut map = HeaderMap::new();
    for (name, value) in headers {
        map.append(
            HeaderName::from_bytes(name.as_bytes()).expect("a header name"),
            HeaderValue::from_bytes(value.as_bytes()).expect("a header value"),
        );
    }
    ask(
        p,
        Ask {
            headers: map,
            ..Ask::default()
        },
    )
    .await
}

fn denial_of(r: Result<RequestPolicy, Refused>) -> (u16, String) {
    match r {
        Err(Refused {
            refusal: Refusal::Denied {
                status, message, ..
            },
            ..
        }) => (status, message),
        other => panic!("expected a denial, got {other:?}"),
    }
}

const LIMITS: &str = "config = { max_prompt_tokens = 100, max_total_tokens = 150, \
                      tenants = { tenant-b = { max_prompt_tokens = 20 } } }";

#[tokio::test]
async fn length_limit_clamps_and_denies_per_tenant_and_tenant_tag_labels() {
    let (p, _dir) = loaded(&format!(
        "{}{}{}{}",
        plugin("length-limit", ""),
        plugin("tenant-tag", ""),
        binding(
            "tenant-tag",
            "config = { echo = [\"tier\"], tenants = { tenant-a = { tier = \"gold\" } } }"
        ),
        binding("length-limit", LIMITS),
    ));
    // Fits: unchanged.
    let ok = ask(&p, Ask::default()).await.expect("allowed");
    assert_eq!(ok.clamp(), None);
    assert!(ok.tags().contains(&("tenant".into(), "tenant-a".into())));
    assert!(ok.tags().contains(&("tier".into(), "gold".into())));
    let mut headers = HeaderMap::new();
    ok.add_headers(&mut headers);
    assert_eq!(headers["x-bulkhead-tier"], "gold");
    assert_eq!(ok.decisions().len(), 2);
    assert_eq!(ok.decisions()[1].plugin, "length-limit");
    assert_eq!(ok.decisions()[1].sha256, component("length-limit").1);
    // prompt + max over the total: clamped to what is left.
    let clamped = ask(
        &p,
        Ask {
            prompt: 50,
            max: 200,
            ..Ask::default()
        },
    )
    .await
    .expect("allowed");
    assert_eq!(clamped.clamp().map(|c| c.get()), Some(100));
    assert_eq!(
        clamped.decisions()[1].verdict,
        DecisionVerdict::Allow {
            clamped_to: Some(100),
            tags: Vec::new(),
            headers: Vec::new(),
        }
    );
    // A prompt over the limit: denied with 400; tenant-b's own limit is tighter.
    let (status, message) = denial_of(
        ask(
            &p,
            Ask {
                prompt: 120,
                ..Ask::default()
            },
        )
        .await,
    );
    assert_eq!(status, 400);
    assert!(message.contains("120"), "{message}");
    let (status, _) = denial_of(
        ask(
            &p,
            Ask {
                tenant: "tenant-b",
                prompt: 30,
                ..Ask::default()
            },
        )
        .await,
    );
    assert_eq!(status, 400);
    let mut metrics = String::new();
    p.render_metrics(&mut metrics, &|_| true);
    assert!(
        metrics.contains(
            "bulkhead_policy_decisions_total{plugin=\"length-limit\",verdict=\"mutate\"} 1"
        ),
        "{metrics}"
    );
    // Each plugin's four on-request calls were timed, every one within its deadline.
    for plugin in ["length-limit", "tenant-tag"] {
        let labels = format!("plugin=\"{plugin}\",hook=\"on-request\"");
        for line in [
            format!("bulkhead_policy_call_duration_seconds_count{{{labels}}} 4"),
            format!("bulkhead_policy_call_duration_seconds_bucket{{{labels},le=\"10\"}} 4"),
        ] {
            assert!(metrics.contains(&line), "no {line:?} in {metrics}");
        }
    }
}

#[tokio::test]
async fn bindings_apply_only_to_their_routes_and_tenants() {
    let (p, _dir) = loaded(&format!(
        "{}{}",
        plugin("length-limit", ""),
        binding(
            "length-limit",
            "routes = [\"/v1/completions\"]\ntenants = [\"tenant-b\"]\n\
             config = { max_prompt_tokens = 5 }"
        ),
    ));
    for (tenant, route, applies) in [
        ("tenant-b", "/v1/completions", true),
        ("tenant-a", "/v1/completions", false),
        ("tenant-b", "/v1/chat/completions", false),
    ] {
        let r = ask(
            &p,
            Ask {
                tenant,
                route,
                ..Ask::default()
            },
        )
        .await;
        assert_eq!(r.is_err(), applies, "{tenant} {route}");
    }
}

/// With every instance slot taken, a request whose bindings all fail open goes through
/// unchanged (each decision saying `busy`); one with a fail-closed binding is refused, as a
/// full sandbox (a retryable 429), not as a failing plugin (a 500).
#[tokio::test]
async fn no_free_instance_slot_fails_closed_whatever_the_bindings_say() {
    for fail_open in [true, false] {
        let dir = Scratch::new("policy");
        let text = format!(
            "{}{}",
            plugin("hostile", "timeout_ms = 3000"),
            binding(
                "hostile",
                &format!("fail_open = {fail_open}\nconfig = {{ attack = \"sleep\" }}")
            ),
        );
        let p = with_slots(&dir, &text, 1);
        let holder = p.clone();
        let held = tokio::spawn(async move { ask(&holder, Ask::default()).await.is_ok() });
        tokio::time::sleep(Duration::from_millis(200)).await;
        // Fail-open or not: a tenant that fills the sandbox does not get past its own
        // policies (its fail-open ones were skipped), it is asked to retry.
        let refused = ask(&p, Ask::default())
            .await
            .expect_err("refused for want of a slot");
        assert_eq!(fault_of(Err(refused.clone())), Fault::Busy, "{fail_open}");
        let response = crate::api::ApiError::from(refused).into_response();
        assert_eq!(response.status(), http::StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(response.headers()[http::header::RETRY_AFTER], "1");
        // Both waits are counted for the tenant: the first granted at once, the second given
        // up after the slot wait (over 1 s), and counted as busy.
        let mut metrics = String::new();
        p.render_metrics(&mut metrics, &|_| true);
        let waits = "bulkhead_policy_slot_wait_seconds";
        for line in [
            "bulkhead_policy_busy_total{tenant=\"tenant-a\"} 1".to_owned(),
            format!("{waits}_count{{tenant=\"tenant-a\"}} 2"),
            format!("{waits}_bucket{{tenant=\"tenant-a\",le=\"0.25\"}} 1"),
            format!("{waits}_bucket{{tenant=\"tenant-a\",le=\"10\"}} 2"),
        ] {
            assert!(metrics.contains(&line), "no {line:?} in {metrics}");
        }
        // A tenant no longer configured has none of these series.
        let mut without = String::new();
        p.render_metrics(&mut without, &|tenant| tenant != "tenant-a");
        assert!(!without.contains("tenant=\"tenant-a\""), "{without}");
        held.abort();
    }
}

/// Tenant A floods the gateway with requests whose plugin runs to its deadline, more than the
/// sandbox has slots for; tenant B's request, asking after A's queue formed, gets the first
/// slot freed instead of waiting behind all of A's (first come, first served, B would wait
/// three of A's deadlines, past the slot wait, and fail: `slots::tests` shows that order).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_flooding_the_sandbox_does_not_keep_its_slots_from_another_tenant() {
    let dir = Scratch::new("policy");
    let text = format!(
        "{}{}{}{}",
        plugin("hostile", "timeout_ms = 500"),
        plugin("length-limit", ""),
        binding(
            "hostile",
            "tenants = [\"tenant-a\"]\nfail_open = true\nconfig = { attack = \"sleep\" }"
        ),
        binding("length-limit", LIMITS),
    );
    let p = with_slots(&dir, &text, 2);
    let t0 = Instant::now();
    let flood: Vec<_> = (0..8)
        .map(|_| {
            let p = p.clone();
            // Allowed (fail-open at its deadline) or, late in the queue, refused for want of
            // a slot (length-limit fails closed): either way, done at that time.
            tokio::spawn(async move {
                let _ = ask(&p, Ask::default()).await;
                t0.elapsed()
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let b = ask(
        &p,
        Ask {
            tenant: "tenant-b",
            ..Ask::default()
        },
    )
    .await;
    let b_done = t0.elapsed();
    let b = b.unwrap_or_else(|r| panic!("tenant B was refused after {b_done:?}: {r:?}"));
    assert_eq!(b.decisions().len(), 1, "only length-limit applies to B");
    assert!(
        b_done < Duration::from_millis(900),
        "B waited {b_done:?}: behind A's queue, not for the first slot freed"
    );
    let mut a_done = Vec::new();
    for a in flood {
        a_done.push(a.await.expect("ran"));
    }
    assert!(
        a_done.iter().filter(|&&t| t > b_done).count() >= 4,
        "most of A's queue was still waiting when B was served: {a_done:?}, B {b_done:?}"
    );
}

/// A reload while calls hold every instance slot waits for one: it is not refused (as a
/// plugin refusing its configuration), and the call that holds the slot is not failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_while_every_instance_slot_is_busy_waits_for_one() {
    let dir = Scratch::new("policy");
    let text = format!(
        "{}{}",
        plugin("hostile", "timeout_ms = 1500"),
        binding(
            "hostile",
            "fail_open = true\nconfig = { attack = \"sleep\" }"
        ),
    );
    let p = with_slots(&dir, &text, 1);
    let holder = p.clone();
    let held = tokio::spawn(async move { ask(&holder, Ask::default()).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let reloading = p.clone();
    let reloaded = tokio::task::spawn_blocking(move || reloading.reload())
        .await
        .expect("the reload ran");
    reloaded.expect("the reload waited for the slot");
    let allowed = held.await.expect("the call ran").expect("fail-open");
    assert_eq!(
        allowed.decisions()[0].verdict,
        DecisionVerdict::Fault {
            fault: "timeout",
            fail_open: true
        },
        "the held call ran to its own deadline, not out of slots"
    );
}

#[tokio::test]
async fn an_infinite_loop_is_stopped_at_its_deadline_and_fails_closed() {
    let (p, _dir) = hostile("timeout_ms = 50", "config = { attack = \"loop\" }");
    let t0 = Instant::now();
    assert_eq!(fault_of(ask(&p, Ask::default()).await), Fault::Timeout);
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
}

/// A guest waiting in a host call (a 5 s WASI sleep) runs no code, so no epoch deadline can
/// stop it; the call's timeout does.
#[tokio::test]
async fn a_plugin_parked_in_a_host_call_is_cut_off_at_its_deadline() {
    let (p, _dir) = hostile("timeout_ms = 50", "config = { attack = \"sleep\" }");
    let t0 = Instant::now();
    assert_eq!(fault_of(ask(&p, Ask::default()).await), Fault::Timeout);
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
}

/// Plugin calls run on the async worker that asked for them, so a spinning guest must yield:
/// on a runtime with a single thread, another request's task still runs while the loop spins
/// towards its deadline.
#[tokio::test(flavor = "current_thread")]
async fn a_spinning_plugin_yields_its_thread_to_other_requests_until_its_deadline() {
    let (p, _dir) = hostile("timeout_ms = 600", "config = { attack = \"loop\" }");
    let t0 = Instant::now();
    let other = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(20)).await;
        t0.elapsed()
    });
    assert_eq!(fault_of(ask(&p, Ask::default()).await), Fault::Timeout);
    let spun = t0.elapsed();
    let waited = other.await.expect("the other task ran");
    assert!(spun >= Duration::from_millis(600), "{spun:?}");
    assert!(
        waited < Duration::from_millis(300),
        "the other task waited {waited:?} for a thread the plugin held for {spun:?}"
    );
}

/// The set where tenant-a's requests spin in `hostile` to their deadline and tenant-b's count
/// to `rounds` (both `timeout_ms`), in a sandbox with a slot for every call of the tests.
fn hogs_and_a_counter(dir: &Scratch, timeout_ms: u64, rounds: u64) -> Policies {
    let text = format!(
        "{}{}{}",
        plugin("hostile", &format!("timeout_ms = {timeout_ms}")),
        binding(
            "hostile",
            "tenants = [\"tenant-a\"]\nconfig = { attack = \"loop\" }"
        ),
        binding(
            "hostile",
            &format!(
                "tenants = [\"tenant-b\"]\nconfig = {{ attack = \"busy\", rounds = {rounds} }}"
            )
        ),
    );
    with_slots(dir, &text, 32)
}

/// tenant-b's call, and how long it took.
async fn counted(p: &Policies) -> (Result<RequestPolicy, Refused>, Duration) {
    let t0 = Instant::now();
    let b = ask(
        p,
        Ask {
            tenant: "tenant-b",
            ..Ask::default()
        },
    )
    .await;
    (b, t0.elapsed())
}

/// A call yields its thread at every epoch tick, and the thread serves other calls meanwhile:
/// a deadline counted in wall time would charge one tenant's call for the turns of another's
/// spinning ones, and fail it closed. Tenant B's call needs a tenth of its deadline; 24 of
/// tenant A's spin beside it on the one thread, one after another, so it takes more than its
/// deadline in wall time (within the allowance for waiting turns) — and is still allowed, while
/// every one of A's is cut off.
#[tokio::test(flavor = "current_thread")]
async fn a_call_is_charged_its_own_time_not_the_turns_of_other_tenants_spinning_calls() {
    const TIMEOUT: Duration = Duration::from_millis(100);
    let dir = Scratch::new("policy");
    // How far B counts in a tenth of the deadline, on this machine, alone (its fastest of
    // three: a busy machine slows a probe, and a count too short for a few epoch ticks would
    // end at B's first turn).
    let probe = 20_000_000;
    let alone = hogs_and_a_counter(&dir, 1000, probe);
    let mut took = Duration::MAX;
    for _ in 0..3 {
        let (counted_alone, t) = counted(&alone).await;
        counted_alone.expect("B's count alone is allowed");
        took = took.min(t);
    }
    let rounds = (probe as f64 * (TIMEOUT.as_secs_f64() / 10.0) / took.as_secs_f64()) as u64;
    let p = hogs_and_a_counter(&dir, TIMEOUT.as_millis() as u64, rounds.max(1));
    // On a machine busy with other tests the hogs may take fewer turns while B runs: then B
    // did not wait past its deadline, and the case is tried again (B is never refused).
    for _ in 0..5 {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let hogs: Vec<_> = (0..24)
            .map(|_| {
                let (p, stop) = (p.clone(), stop.clone());
                tokio::spawn(async move {
                    let mut faults = Vec::new();
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        faults.push(fault_of(ask(&p, Ask::default()).await));
                    }
                    faults
                })
            })
            .collect();
        // Every hog is spinning before B starts.
        tokio::task::yield_now().await;
        let (b, b_took) = counted(&p).await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let b = b.unwrap_or_else(|r| panic!("B was refused after {b_took:?}: {r:?}"));
        assert_eq!(b.decisions().len(), 1);
        for hog in hogs {
            let faults = hog.await.expect("ran");
            assert!(!faults.is_empty());
            assert!(faults.iter().all(|f| *f == Fault::Timeout), "{faults:?}");
        }
        if b_took > TIMEOUT {
            return;
        }
    }
    panic!(
        "B always took less than its deadline: the hogs never held the thread while it waited \
         for its turns"
    );
}

/// Calls spinning side by side on one thread are each charged their own turns, yet end once
/// their deadline and the allowance for waiting turns have gone by in wall time: a tenant's
/// flood holds instance slots, and its requests, for a bounded time (charged time alone, these
/// thirty would take thirty deadlines).
#[tokio::test(flavor = "current_thread")]
async fn spinning_calls_side_by_side_end_by_their_deadline_and_the_allowance() {
    const TIMEOUT: Duration = Duration::from_millis(50);
    let dir = Scratch::new("policy");
    let p = hogs_and_a_counter(&dir, TIMEOUT.as_millis() as u64, 1);
    let t0 = Instant::now();
    let hogs: Vec<_> = (0..30)
        .map(|_| {
            let p = p.clone();
            tokio::spawn(async move { (fault_of(ask(&p, Ask::default()).await), t0.elapsed()) })
        })
        .collect();
    // The deadline and the allowance are 550 ms; thirty deadlines, 1.5 s.
    assert_eq!(
        TIMEOUT + super::call_clock::TURN_ALLOWANCE,
        Duration::from_millis(550)
    );
    for hog in hogs {
        let (fault, took) = hog.await.expect("ran");
        assert_eq!(fault, Fault::Timeout);
        assert!(
            took < Duration::from_millis(1000),
            "a spinning call took {took:?}"
        );
    }
}

/// A plugin asking the host to log a thousand lines at every call gets a few per call, and all
/// its calls together a few a second: a tenant's request rate does not become the log's.
#[tokio::test]
async fn a_plugin_flooding_the_log_is_held_to_its_lines_a_second() {
    let (p, _dir) = hostile("", "config = { attack = \"log-flood\" }");
    for _ in 0..5 {
        ask(&p, Ask::default()).await.expect("allows");
    }
    // Five calls' lines are more than the second's budget of tenant-a: its next line is
    // dropped (without the budget in `host.log`, the budget would be untouched and write it),
    // while another tenant's is written.
    let set = p.current();
    let log = &set.bindings[0].plugin.log;
    assert!(
        !log.admit(Some("tenant-a"), Instant::now()).write,
        "{log:?}"
    );
    assert!(log.admit(Some("tenant-b"), Instant::now()).write, "{log:?}");
}

/// WASI 0.2's clocks and random source are linked for guests whose standard library needs
/// them; they read as a stopped clock and a constant, so no call can tell itself from another
/// or time anything in the gateway's process.
#[tokio::test]
async fn a_plugin_reads_no_clock_and_no_randomness() {
    let (p, _dir) = hostile("", "config = { attack = \"observe\" }");
    let first = ask(&p, Ask::default()).await.expect("allows");
    let second = ask(&p, Ask::default()).await.expect("allows");
    let wall = ("wall-clock-ns".to_owned(), "0".to_owned());
    assert!(first.tags().contains(&wall), "{:?}", first.tags());
    assert_eq!(
        first.tags(),
        second.tags(),
        "the same randomness in both calls"
    );
}

#[tokio::test]
async fn a_memory_bomb_hits_its_memory_limit_and_fails_closed() {
    let (p, _dir) = hostile(
        "memory_mib = 8\ntimeout_ms = 2000",
        "config = { attack = \"memory\" }",
    );
    assert_eq!(fault_of(ask(&p, Ask::default()).await), Fault::Memory);
    // The binding's own limit is the one that stops it: 10 MiB fits under 16, not under 8
    // (the sandbox's own cap is 128 MiB here).
    let held = |memory_mib: u32| {
        hostile(
            &format!("memory_mib = {memory_mib}\ntimeout_ms = 2000"),
            "config = { attack = \"memory\", mib = 10 }",
        )
    };
    let (p, _dir) = held(16);
    let allowed = ask(&p, Ask::default()).await.expect("10 MiB under 16");
    assert_eq!(tag(&allowed, "held-mib"), "10");
    let (p, _dir) = held(8);
    assert_eq!(fault_of(ask(&p, Ask::default()).await), Fault::Memory);
}

/// A trap refuses the request unless the binding fails open; the metrics and the audit record
/// tell the two apart (a fault let through is a policy not applied).
#[tokio::test]
async fn a_trap_fails_closed_unless_the_binding_is_fail_open() {
    let decided = |p: &Policies, verdict: &str| {
        let mut metrics = String::new();
        p.render_metrics(&mut metrics, &|_| true);
        metrics.contains(&format!(
            "bulkhead_policy_decisions_total{{plugin=\"hostile\",verdict=\"{verdict}\"}} 1"
        ))
    };
    let (p, _dir) = hostile("", "config = { attack = \"trap\" }");
    let fault = fault_of(ask(&p, Ask::default()).await);
    // The trap itself, on one line: not wasmtime's backtrace of the guest's frames before it.
    assert!(
        matches!(&fault, Fault::Trap(t) if t.starts_with("wasm trap: ") && !t.contains("backtrace")),
        "{fault:?}"
    );
    assert!(decided(&p, "error") && !decided(&p, "error_open"));
    let (p, _dir) = hostile("", "fail_open = true\nconfig = { attack = \"trap\" }");
    let allowed = ask(&p, Ask::default())
        .await
        .expect("fail-open lets it through");
    let decision = &allowed.decisions()[0];
    assert_eq!(
        decision.verdict,
        DecisionVerdict::Fault {
            fault: "trap",
            fail_open: true
        }
    );
    assert!(decided(&p, "error_open") && !decided(&p, "error"));
    assert_eq!(
        serde_json::to_value(bulkhead_audit::PolicyDecision::from(decision)).expect("serializes")["verdict"],
        serde_json::json!({"kind": "error", "fault": "trap", "fail_open": true})
    );
}

/// A `tenant-tag` configuration whose answers the gateway would refuse at every request (a
/// label named as a header or tag the gateway keeps, more labels than it takes) is refused
/// at load: it loaded, and every request then failed with 500 `policy_error`.
#[test]
fn a_tenant_tag_configuration_that_would_fail_every_request_is_refused() {
    let labels = |n: usize, from: usize| -> String {
        (from..from + n)
            .map(|i| format!("l{i} = \"v\""))
            .collect::<Vec<_>>()
            .join(", ")
    };
    for config in [
        "config = { echo = [\"tenant\"], default = { tenant = \"x\" } }".to_owned(),
        "config = { default = { tenant = \"tenant-b\" } }".to_owned(),
        "config = { echo = [\"clamped_max_tokens\"] }".to_owned(),
        format!("config = {{ default = {{ {} }} }}", labels(32, 0)),
        format!(
            "config = {{ echo = [{}] }}",
            (0..17)
                .map(|i| format!("\"l{i}\""))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        // 20 and 20: each within bounds, 40 together.
        format!(
            "config = {{ default = {{ {} }}, tenants = {{ tenant-a = {{ {} }} }} }}",
            labels(20, 0),
            labels(20, 100)
        ),
    ] {
        let e = load(&format!(
            "{}{}",
            plugin("tenant-tag", ""),
            binding("tenant-tag", &config)
        ))
        .expect_err(&config);
        assert!(
            matches!(
                &e,
                PolicyError::Load(
                    LoadError::InvalidConfig { .. }
                        | LoadError::Configure {
                            fault: Fault::Refused(_),
                            ..
                        }
                )
            ),
            "{config}: {e}"
        );
    }
    // Within bounds, overlapping: 31 distinct labels, the most beside the tenant tag.
    load(&format!(
        "{}{}",
        plugin("tenant-tag", ""),
        binding(
            "tenant-tag",
            &format!(
                "config = {{ default = {{ {} }}, tenants = {{ tenant-a = {{ {} }} }} }}",
                labels(20, 0),
                labels(21, 10)
            )
        )
    ))
    .expect("loads");
}

/// A plugin that refuses its configuration (here one its schema allows) is refused by its
/// own reason, said once, not as an invalid answer.
#[test]
fn a_configuration_the_plugin_refuses_is_refused_with_its_reason() {
    let dir = Scratch::new("policy");
    let (hostile, digest) = component("hostile");
    std::fs::copy(&hostile, dir.0.join("hostile.wasm")).expect("copies the component");
    std::fs::write(dir.0.join("hostile.schema.json"), "{}").expect("a schema allowing all");
    let path = write(
        &dir,
        &format!(
            "[plugins.hostile]\ncomponent = \"hostile.wasm\"\nsha256 = \"{digest}\"\n{}",
            binding("hostile", "config = { attack = \"nope\" }")
        ),
    );
    let e = Policies::load(settings(&path, None)).expect_err("refused by the plugin");
    let text = e.to_string();
    assert!(
        matches!(
            &e,
            PolicyError::Load(LoadError::Configure {
                fault: Fault::Refused(_),
                ..
            })
        ),
        "{e:?}"
    );
    assert!(
        text.starts_with(
            "chain[0] (hostile): configuring the plugin failed: it refused its configuration: "
        ),
        "{text}"
    );
    assert!(
        text.contains("nope") && !text.contains("invalid answer"),
        "{text}"
    );
}

#[tokio::test]
async fn garbage_answers_fail_closed() {
    for attack in ["bad-status", "bad-header"] {
        let (p, _dir) = hostile("", &format!("config = {{ attack = \"{attack}\" }}"));
        assert!(
            matches!(fault_of(ask(&p, Ask::default()).await), Fault::Garbage(_)),
            "{attack}"
        );
    }
}

/// An answer bigger than the gateway copies out of a call (an 8 MiB header, within the
/// plugin's own memory limit) fails closed before it is copied.
#[tokio::test]
async fn an_answer_over_the_copy_limit_fails_closed() {
    let (p, _dir) = hostile("memory_mib = 64", "config = { attack = \"big-header\" }");
    let fault = fault_of(ask(&p, Ask::default()).await);
    assert!(matches!(fault, Fault::Trap(_)), "{fault:?}");
}

/// The host offers `bulkhead:policy@0.1.1`; this plugin was built against 0.1.0 (before
/// `host.gateway-version`) and must load and act unchanged.
#[tokio::test]
async fn a_plugin_built_against_0_1_0_works_in_the_0_1_1_host() {
    let wit = include_str!("../../../wit/policy.wit");
    assert!(wit.contains("package bulkhead:policy@0.1.1;"));
    let (path, _) = component("compat-0.1.0");
    let bytes = std::fs::read(path).expect("reads");
    let imports = |name: &[u8]| bytes.windows(name.len()).any(|w| w == name);
    assert!(imports(b"bulkhead:policy/host@0.1.0"));
    assert!(!imports(b"bulkhead:policy/host@0.1.1"));
    let (p, _dir) = loaded(&format!(
        "{}{}",
        plugin("compat-0.1.0", ""),
        binding("compat-0.1.0", "headers = [\"x-compat\"]"),
    ));
    ask(&p, Ask::default()).await.expect("allowed");
    let (status, _) = denial_of(ask_with(&p, &[("x-compat", "deny")]).await);
    assert_eq!(status, 418);
}

/// The built-ins are bare components: they import the policy world and no WASI, so a call
/// builds no WASI context and instantiates one core module (scripts/build-plugins). The hostile
/// plugin, built for wasm32-wasip2 for its clock, shows what the check sees otherwise.
#[test]
fn the_built_ins_import_no_wasi() {
    let engine = wasmtime::Engine::default();
    let wasi_imports = |name: &str| {
        let (path, _) = component(name);
        let component = wasmtime::component::Component::from_file(&engine, path).expect(name);
        component
            .component_type()
            .imports(&engine)
            .map(|(import, _)| import.to_owned())
            .filter(|import| import.starts_with("wasi:"))
            .collect::<Vec<_>>()
    };
    for name in ["length-limit", "tenant-tag", "abort-guard"] {
        assert_eq!(wasi_imports(name), Vec::<String>::new(), "{name}");
    }
    assert!(!wasi_imports("hostile").is_empty());
}

/// The value of tag `key` of an allowed request.
fn tag(allowed: &RequestPolicy, key: &str) -> String {
    let tags = allowed.tags();
    tags.iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.clone())
        .unwrap_or_else(|| panic!("no tag {key}: {tags:?}"))
}

/// What a plugin is shown of a one-token request of `tenant`, straight to its hook.
fn request_view(tenant: &str) -> bindings::RequestView {
    bindings::RequestView {
        request_id: format!("req-{tenant}"),
        tenant: tenant.into(),
        model: "m".into(),
        route: "/v1/chat/completions".into(),
        prompt_tokens: 1,
        max_tokens: 1,
        headers: Vec::new(),
    }
}

#[tokio::test]
async fn every_call_starts_configured_in_a_fresh_instance_and_carries_nothing_over() {
    let (p, _dir) = loaded(&format!(
        "{}{}",
        plugin("carry-over", ""),
        binding("carry-over", "config = { label = \"gold\" }"),
    ));
    assert!(
        p.current().summary()[0].snapshot,
        "a plugin that imports only the world is snapshotted"
    );
    // Through the gateway's path: each request meets an instance that has seen nothing, but
    // is configured (the label comes from the configuration).
    for tenant in ["tenant-a", "tenant-b", "tenant-a", "tenant-b"] {
        let allowed = ask(
            &p,
            Ask {
                tenant,
                ..Ask::default()
            },
        )
        .await
        .expect("allowed");
        assert_eq!(tag(&allowed, "previous"), "none", "{tenant}");
        assert_eq!(tag(&allowed, "calls"), "1", "{tenant}");
        assert_eq!(tag(&allowed, "label"), "gold", "{tenant}");
    }
    // What it prevents: the same plugin, snapshot and configuration, with two tenants'
    // requests in one instance, hands tenant-a's identity to tenant-b's request.
    let set = p.current();
    let b = &set.bindings[0];
    let verdicts = b
        .plugin
        .on_requests_in_one_instance(
            &b.configured,
            &[request_view("tenant-a"), request_view("tenant-b")],
        )
        .await
        .expect("both calls answer");
    let bindings::Verdict::Allow(second) = &verdicts[1] else {
        panic!("allowed: {verdicts:?}");
    };
    assert!(
        second
            .tags
            .iter()
            .any(|t| t.key == "previous" && t.value == "tenant-a"),
        "{second:?}"
    );
}

#[tokio::test]
async fn a_binding_whose_snapshot_cannot_be_taken_configures_at_every_call_and_acts() {
    let sandbox = sandbox::Sandbox::new(SandboxSettings::default()).expect("a sandbox");
    let (path, digest) = component("carry-over");
    let bytes = std::fs::read(path).expect("reads");
    let (pre, _) = sandbox.prepare(&bytes, &digest).expect("compiles");
    let limits = CallLimits {
        memory_bytes: 16 << 20,
        timeout: Duration::from_secs(5),
    };
    let loaded = plugin::Loaded::new(
        "carry-over".into(),
        digest,
        None,
        pre.clone(),
        limits,
        sandbox,
    );
    let config = r#"{"label":"gold"}"#;
    // Wizer's reads of the configured state fail: the binding is configured per call.
    let unreadable = snapshot::Snapshotter::with_unreadable_state(&pre, &bytes);
    let (hooks, configured) = loaded
        .configure(config, Some(&unreadable))
        .expect("the plugin accepts its configuration");
    assert_eq!(hooks, bindings::Hooks::ON_REQUEST);
    assert!(
        matches!(&configured, plugin::Configured::PerCall(c) if &**c == config),
        "{configured:?}"
    );
    // And it acts, configured at the call, in a fresh instance each time.
    for tenant in ["tenant-a", "tenant-b"] {
        let verdict = loaded
            .on_request(&configured, &request_view(tenant))
            .await
            .expect("answers");
        let bindings::Verdict::Allow(m) = verdict else {
            panic!("allowed: {verdict:?}");
        };
        let tags: Vec<(&str, &str)> = m
            .tags
            .iter()
            .map(|t| (t.key.as_str(), t.value.as_str()))
            .collect();
        assert_eq!(
            tags,
            [("previous", "none"), ("calls", "1"), ("label", "gold")]
        );
    }
}

#[tokio::test]
async fn plugins_that_import_only_the_world_are_snapshotted_and_wasi_guests_configure_per_call() {
    let names = [
        "length-limit",
        "tenant-tag",
        "abort-guard",
        "compat-0.1.0",
        "hostile",
    ];
    let mut text = String::new();
    for name in names {
        text += &plugin(name, "");
    }
    text += &binding("length-limit", LIMITS);
    text += &binding("tenant-tag", "");
    text += &binding("abort-guard", "config = { max_held_per_tenant = 2 }");
    text += &binding("compat-0.1.0", "");
    text += &binding(
        "hostile",
        "config = { attack = \"trap\" }\nfail_open = true",
    );
    let (p, _dir) = loaded(&text);
    let snapshot: Vec<(String, bool)> = p
        .current()
        .summary()
        .into_iter()
        .map(|b| (b.plugin, b.snapshot))
        .collect();
    let expected: Vec<(String, bool)> = names
        .iter()
        .map(|&n| (n.to_owned(), n != "hostile"))
        .collect();
    assert_eq!(snapshot, expected);
    // Both kinds act: the snapshotted chain allows and tags, and the per-call hostile
    // plugin still traps (configured at its call: its attack came from the configuration).
    let allowed = ask(&p, Ask::default()).await.expect("allowed");
    assert_eq!(tag(&allowed, "tenant"), "tenant-a");
    let faults: Vec<_> = allowed
        .decisions()
        .iter()
        .filter(|d| matches!(d.verdict, DecisionVerdict::Fault { .. }))
        .map(|d| d.plugin.clone())
        .collect();
    assert_eq!(faults, ["hostile"]);
}

#[tokio::test]
async fn a_python_policy_loads_and_acts() {
    let dir = Scratch::new("policy");
    // header-gate under `binding_lines`, written in `dir`.
    let header_gate = |binding_lines: &str| {
        write(
            &dir,
            &format!(
                "{}{}",
                plugin("header-gate", "timeout_ms = 1000\nmemory_mib = 64"),
                binding("header-gate", binding_lines),
            ),
        )
    };
    let path = header_gate(
        "headers = [\"x-project\"]\nfail_open = true\nconfig = { header = \"x-project\", \
         tenants = [\"tenant-b\"], status = 412, tag = \"project\" }",
    );
    // The compile cache beside the components, as the default deployment does: a second
    // run of this test skips the seconds-long compile.
    let p = Policies::load(settings(&path, Some(dist().join("cache")))).expect("loads");
    // componentize-py's --stub-wasi leaves it importing only the world: snapshotted.
    assert!(p.current().summary()[0].snapshot);
    let (status, message) = denial_of(
        ask(
            &p,
            Ask {
                tenant: "tenant-b",
                ..Ask::default()
            },
        )
        .await,
    );
    assert_eq!(status, 412);
    assert!(message.contains("x-project"), "{message}");
    let mut headers = HeaderMap::new();
    headers.insert("x-project", "apollo".parse().expect("value"));
    let ok = ask(
        &p,
        Ask {
            tenant: "tenant-b",
            headers,
            ..Ask::default()
        },
    )
    .await
    .expect("allowed");
    assert_eq!(ok.tags(), &[("project".to_owned(), "apollo".to_owned())]);
    // The client's value would make an invalid tag, or a proxy appended a second one: refused
    // by the plugin itself. Passed on as a tag, the gateway would take the answer for a fault,
    // and this fail-open binding would let the request through unchecked.
    let long = "z".repeat(1000);
    for values in [
        vec![long.as_str()],
        vec!["\u{202e}zeus"],
        vec!["apollo", "zeus"],
    ] {
        let mut headers = HeaderMap::new();
        for v in &values {
            let value = HeaderValue::from_bytes(v.as_bytes()).expect("HTTP allows the bytes");
            headers.append("x-project", value);
        }
        let (status, message) = denial_of(
            ask(
                &p,
                Ask {
                    tenant: "tenant-b",
                    headers,
                    ..Ask::default()
                },
            )
            .await,
        );
        assert_eq!(status, 412, "{values:?}");
        assert!(message.len() < 200, "{message}");
    }
    // Its schema keeps it from writing the tenant's tag.
    let bad = header_gate(
        "headers = [\"x-project\"]\nconfig = { header = \"x-project\", tag = \"tenant\" }",
    );
    let e =
        Policies::load(settings(&bad, Some(dist().join("cache")))).expect_err("the tenant's tag");
    assert!(
        matches!(&e, PolicyError::Load(LoadError::InvalidConfig { errors, .. }) if errors.contains("/tag")),
        "{e}"
    );
}

#[tokio::test]
async fn a_javascript_policy_loads_and_acts() {
    let dir = Scratch::new("policy");
    let path = write(
        &dir,
        &format!(
            "{}{}",
            plugin("model-gate", "timeout_ms = 1000\nmemory_mib = 64"),
            binding(
                "model-gate",
                "headers = [\"x-client\"]\nconfig = { models = [\"big-*\", \"legacy\"], \
                 header = \"x-client\", values = [\"scraper\"], status = 451 }"
            ),
        ),
    );
    // Cached compiles, as for the Python policy: the component is about 12 MB.
    let p = Policies::load(settings(&path, Some(dist().join("cache")))).expect("loads");
    assert!(
        p.current().summary()[0].snapshot,
        "imports only the world: snapshotted"
    );
    let ok = ask(
        &p,
        Ask {
            model: "small-1",
            ..Ask::default()
        },
    )
    .await
    .expect("an unlisted model is allowed");
    assert_eq!(ok.clamp(), None);
    assert!(ok.tags().is_empty());
    // A listed model, by prefix and exactly: the configured status, the plugin's reason.
    for model in ["big-70b", "legacy"] {
        let (status, message) = denial_of(
            ask(
                &p,
                Ask {
                    model,
                    ..Ask::default()
                },
            )
            .await,
        );
        assert_eq!(status, 451);
        assert_eq!(message, format!("model {model} is not available"));
    }
    // A listed header value, on an allowed model.
    let (status, message) = denial_of(ask_with(&p, &[("x-client", "scraper")]).await);
    assert_eq!(status, 451);
    assert!(message.contains("x-client"), "{message}");
    ask_with(&p, &[("x-client", "browser")])
        .await
        .expect("another header value is allowed");
    // A listed value behind another (a proxy appended it): every value counts.
    let both = [("x-client", "browser"), ("x-client", "scraper")];
    let (status, _) = denial_of(ask_with(&p, &both).await);
    assert_eq!(status, 451);
    // A configuration the schema accepts and the plugin refuses (its `configure` throws):
    // the set is refused with the plugin's reason.
    let path = write(
        &dir,
        &format!(
            "{}{}",
            plugin("model-gate", "timeout_ms = 1000\nmemory_mib = 64"),
            binding("model-gate", "config = { models = [\"a*b\"] }")
        ),
    );
    let e = Policies::load(settings(&path, Some(dist().join("cache"))))
        .expect_err("refused by the plugin");
    assert!(e.to_string().contains("a * may only end it"), "{e}");
}

#[tokio::test]
async fn a_c_policy_loads_and_acts() {
    let (p, _dir) = loaded(&format!(
        "{}{}",
        plugin("token-cap", ""),
        binding(
            "token-cap",
            "config = { default = 64, tenants = { tenant-b = 16 }, \
             header = \"x-bulkhead-token-cap\" }"
        ),
    ));
    assert!(
        p.current().summary()[0].snapshot,
        "imports only the world: snapshotted"
    );
    // Under the default cap: unchanged, no header.
    let ok = ask(
        &p,
        Ask {
            max: 50,
            ..Ask::default()
        },
    )
    .await
    .expect("allowed");
    assert_eq!(ok.clamp(), None);
    let mut headers = HeaderMap::new();
    ok.add_headers(&mut headers);
    assert!(headers.is_empty(), "{headers:?}");
    // Over it: clamped to the tenant's cap (listed, or the default), which the header states.
    for (tenant, cap) in [("tenant-b", 16), ("tenant-a", 64)] {
        let clamped = ask(
            &p,
            Ask {
                tenant,
                max: 100,
                ..Ask::default()
            },
        )
        .await
        .expect("allowed");
        assert_eq!(clamped.clamp().map(|c| c.get()), Some(cap));
        assert_eq!(
            clamped.decisions()[0].verdict,
            DecisionVerdict::Allow {
                clamped_to: Some(cap),
                tags: Vec::new(),
                headers: vec!["x-bulkhead-token-cap".to_owned()],
            }
        );
        let mut headers = HeaderMap::new();
        clamped.add_headers(&mut headers);
        assert_eq!(headers["x-bulkhead-token-cap"], cap.to_string());
    }
    // A header the gateway refuses from a plugin would fail every clamped request (and only
    // those: a smoke test passes): its schema refuses it when the set loads.
    for header in [
        "x-ratelimit-limit-tokens",
        "x-request-id",
        "x-bulkhead-clamped-max-tokens",
        "x-forwarded-for",
        "x-tenant-id",
    ] {
        assert!(
            super::verdict::gateway_owned(&HeaderName::from_static(header)),
            "{header}"
        );
        let set = format!(
            "{}{}",
            plugin("token-cap", ""),
            binding(
                "token-cap",
                &format!("config = {{ default = 8, header = \"{header}\" }}")
            )
        );
        let e = load(&set).expect_err("a header the gateway sets");
        assert!(
            matches!(&e, PolicyError::Load(LoadError::InvalidConfig { errors, .. }) if errors.contains("/header")),
            "{header}: {e}"
        );
    }
}

/// A per-route limit under a key that names no route would never apply.
#[test]
fn a_length_limit_for_a_route_that_does_not_exist_refuses_the_set() {
    let set = |route: &str| {
        format!(
            "{}{}",
            plugin("length-limit", ""),
            binding(
                "length-limit",
                &format!("config = {{ routes = {{ \"{route}\" = {{ max_total_tokens = 64 }} }} }}")
            )
        )
    };
    load(&set("/v1/completions")).expect("a route");
    for typo in ["/v1/completion", "/v1/completions/", "v1/chat/completions"] {
        let e = load(&set(typo)).expect_err("no such route");
        assert!(
            matches!(&e, PolicyError::Load(LoadError::InvalidConfig { errors, .. }) if errors.contains("/routes")),
            "{typo}: {e}"
        );
    }
}

/// A schema replaced by one that takes anything (`true`) passes a configuration the plugin's
/// own schema refuses, unless the set pins the schema too.
#[test]
fn a_pinned_schema_replaced_beside_its_component_refuses_the_set() {
    let dir = Scratch::new("schema-pin");
    let (built, digest) = component("length-limit");
    let (component, schema) = (dir.0.join("ll.wasm"), dir.0.join("ll.schema.json"));
    std::fs::copy(&built, &component).expect("copies the component");
    std::fs::copy(built.with_extension("schema.json"), &schema).expect("copies the schema");
    let own = Digest::of(&std::fs::read(&schema).expect("reads the schema"));
    let planted = binding(
        "length-limit",
        "config = { max_prompt_tokens = 10, planted = true }",
    );
    let set = |pin: &str| {
        format!(
            "[plugins.length-limit]\ncomponent = {:?}\nsha256 = \"{digest}\"\n{pin}\n{planted}",
            component.display().to_string()
        )
    };
    let pinned = format!("schema_sha256 = \"{own}\"");
    // Its own schema refuses the planted field, pinned or not.
    for pin in ["", pinned.as_str()] {
        let e = load(&set(pin)).expect_err("refused by the schema");
        assert!(
            matches!(&e, PolicyError::Load(LoadError::InvalidConfig { .. })),
            "{e}"
        );
    }
    // Unpinned, a set loads and says so (`GET /policies`' warnings); pinned, not.
    let plain = binding("length-limit", "config = { max_prompt_tokens = 10 }");
    let warned = |pin: &str| {
        let (p, _dir) = loaded(&format!(
            "[plugins.length-limit]\ncomponent = {:?}\nsha256 = \"{digest}\"\n{pin}\n{plain}",
            component.display().to_string()
        ));
        p.current().unpinned_schemas()
    };
    let warnings = warned("");
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("\"length-limit\": its schema is not pinned"));
    assert_eq!(warned(&pinned), Vec::<String>::new());
    std::fs::write(&schema, "true").expect("replaces the schema");
    // Unpinned, the replaced schema lets it through (the plugin itself may still refuse it).
    let unpinned = load(&set(""));
    assert!(
        !matches!(
            &unpinned,
            Err(PolicyError::Load(LoadError::InvalidConfig { .. }))
        ),
        "the replacement took anything"
    );
    let e = load(&set(&pinned)).expect_err("the pin holds");
    assert!(
        matches!(&e, PolicyError::Load(LoadError::SchemaPinMismatch { pinned: p, .. }) if *p == own),
        "{e}"
    );
    let e = load(&set("schema_sha256 = \"abc\"")).expect_err("not a digest");
    assert!(e.to_string().contains("schema_sha256"), "{e}");
}

#[test]
fn a_set_is_refused_for_a_wrong_pin_a_bad_config_or_a_credential_header() {
    let (path, digest) = component("length-limit");
    let wrong = Digest::of(b"something else");
    let set = format!(
        "[plugins.length-limit]\ncomponent = {:?}\nsha256 = \"{wrong}\"\n{}",
        path.display().to_string(),
        binding("length-limit", "")
    );
    let e = load(&set).expect_err("wrong pin");
    assert!(
        matches!(&e, PolicyError::Load(LoadError::PinMismatch { actual, .. }) if *actual == digest),
        "{e}"
    );
    let e =
        length_limit_with("config = { max_prompt_tokens = \"planted\" }").expect_err("bad config");
    // Where and why, never the value (the refusal reaches the log and the admin API).
    assert!(
        matches!(&e, PolicyError::Load(LoadError::InvalidConfig { errors, .. }) if errors.contains("max_prompt_tokens") && errors.contains("integer")),
        "{e}"
    );
    assert!(!e.to_string().contains("planted"), "{e}");
    let e = length_limit_with("headers = [\"authorization\"]").expect_err("credentials");
    assert!(
        matches!(e, PolicyError::Load(LoadError::Header { .. })),
        "{e}"
    );
    // Removed from every request before the chain: a rule on them would never fire.
    for header in ["x-tenant-tier", "x-bulkhead-project", "x-org-id"] {
        let e =
            length_limit_with(&format!("headers = [\"{header}\"]")).expect_err("a tenant claim");
        assert!(
            matches!(&e, PolicyError::Load(LoadError::Header { reason, .. }) if reason.contains("claim a tenant")),
            "{header}: {e}"
        );
    }
    let e = load(&binding("nowhere", "")).expect_err("unknown plugin");
    assert!(
        matches!(e, PolicyError::Load(LoadError::UnknownPlugin { .. })),
        "{e}"
    );
    // A name that would break a metrics label or a log line.
    let (path, digest) = component("length-limit");
    let e = load(&format!(
        "[plugins.\"a\\\"b\"]\ncomponent = {:?}\nsha256 = \"{digest}\"\n\n[[chain]]\nplugin = \"a\\\"b\"\n",
        path.display().to_string()
    ))
    .expect_err("a bad name");
    assert!(
        matches!(&e, PolicyError::Load(LoadError::BadName { plugin }) if plugin == "a\"b"),
        "{e}"
    );
}

/// A component that imports one empty instance named `import` (none when `None`) and
/// exports nothing: enough for the loader to judge what it was built against.
fn component_importing(import: Option<&str>) -> Vec<u8> {
    let mut component = wasm_encoder::Component::new();
    if let Some(name) = import {
        let mut types = wasm_encoder::ComponentTypeSection::new();
        types.instance(&wasm_encoder::InstanceType::new());
        let mut imports = wasm_encoder::ComponentImportSection::new();
        imports.import(name, wasm_encoder::ComponentTypeRef::Instance(0));
        component.section(&types).section(&imports);
    }
    component.finish()
}

/// Why the set of one binding of a plugin made of `bytes` (with an empty schema) is refused.
fn refusal_of(bytes: &[u8]) -> String {
    let dir = Scratch::new("policy");
    std::fs::write(dir.0.join("other.wasm"), bytes).expect("writes");
    std::fs::write(dir.0.join("other.schema.json"), "{}").expect("writes");
    let path = write(
        &dir,
        &format!(
            "[plugins.other]\ncomponent = \"other.wasm\"\nsha256 = \"{}\"\n{}",
            Digest::of(bytes),
            binding("other", "")
        ),
    );
    match Policies::load(settings(&path, None)) {
        Ok(_) => panic!("a set of a plugin that cannot be one loaded"),
        Err(e) => e.to_string(),
    }
}

/// What keeps a component from being a plugin is said in its author's terms: built against
/// another version of the contract, importing what no plugin is offered, exporting no
/// policy, or a core module rather than a component; a missing file names its plugin.
#[test]
fn a_component_that_cannot_be_a_plugin_is_refused_saying_why() {
    for (import, says) in [
        (
            Some("bulkhead:policy/host@0.2.0"),
            "built against bulkhead:policy@0.2.0; this gateway offers bulkhead:policy@0.1.1",
        ),
        (
            Some("bulkhead:policy/host@1.0.0"),
            "built against bulkhead:policy@1.0.0",
        ),
        (
            Some("wasi:http/outgoing-handler@0.2.0"),
            "imports wasi:http/outgoing-handler@0.2.0, which the gateway does not offer",
        ),
        (None, "exports no bulkhead:policy/policy interface"),
    ] {
        let e = refusal_of(&component_importing(import));
        assert!(e.contains(says), "{import:?}: {e}");
        assert!(e.contains("plugin \"other\""), "{e}");
    }
    let e = refusal_of(b"\0asm\x01\0\0\0");
    assert!(
        e.contains("a core WebAssembly module, not a component"),
        "{e}"
    );

    let (path, digest) = component("length-limit");
    let dir = Scratch::new("policy");
    let moved = dir.0.join("length-limit.wasm");
    std::fs::copy(&path, &moved).expect("copies");
    let set = write(
        &dir,
        &format!(
            "[plugins.limit]\ncomponent = \"length-limit.wasm\"\nsha256 = \"{digest}\"\n{}",
            binding("limit", "")
        ),
    );
    let e = Policies::load(settings(&set, None)).expect_err("no schema beside it");
    assert!(
        matches!(&e, PolicyError::Load(LoadError::PluginFile { plugin, what: "schema", .. }) if plugin == "limit"),
        "{e}"
    );
}

/// An empty or truncated policy file is refused, not taken for a set of no policy (which
/// would turn every policy off); `chain = []` says so on purpose. A binding for the tenant
/// "", or for an empty list of tenants or routes, is refused: it matches nothing.
#[test]
fn an_empty_file_or_an_empty_tenant_name_is_refused() {
    for text in ["", "\n  \n", "[plugins]\n"] {
        let e = load(text).expect_err("an empty set file");
        assert!(
            matches!(e, PolicyError::Load(LoadError::NoChain { .. })),
            "{text:?}: {e}"
        );
    }
    let (none, _dir) = loaded("chain = []\n");
    assert!(none.current().bindings.is_empty());
    let e = length_limit_with("tenants = [\"tenant-a\", \"\"]").expect_err("an empty tenant");
    assert!(
        matches!(
            e,
            PolicyError::Load(LoadError::EmptyTenant { index: 0, .. })
        ),
        "{e}"
    );
    // An empty list of tenants or routes: a binding that never applies, turned off silently.
    for field in ["tenants", "routes"] {
        let e = length_limit_with(&format!("{field} = []")).expect_err("an empty list");
        assert!(
            matches!(&e, PolicyError::Load(LoadError::MatchesNothing { index: 0, field: f, .. }) if *f == field),
            "{field}: {e}"
        );
    }
}

/// Waits (bounded) until the last refused reload of `p` says `what`.
async fn said(p: &Policies, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !p.last_error().is_some_and(|e| e.contains(what)) {
        assert!(
            Instant::now() < deadline,
            "never said {what:?}: {:?}",
            p.last_error()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A set of length-limit alone, prompts limited to `max` tokens.
fn prompt_limit(max: u32) -> String {
    format!(
        "{}{}",
        plugin("length-limit", ""),
        binding(
            "length-limit",
            &format!("config = {{ max_prompt_tokens = {max} }}")
        )
    )
}

/// [`prompt_limit`] of 5 written in `dir` and loaded, its file watched every `interval`
/// (the watcher not started yet).
fn watched(dir: &Scratch, interval: Duration) -> (PathBuf, Policies) {
    let path = write(dir, &prompt_limit(5));
    let mut s = settings(&path, None);
    s.watch_interval = Some(interval);
    (path.clone(), Policies::load(s).expect("loads"))
}

/// The watcher reloads a changed file; one emptied, or deleted, is a refused reload that
/// keeps the active set and says why; the file put back is loaded again.
#[tokio::test]
async fn the_watched_file_emptied_or_deleted_keeps_the_set_and_says_why() {
    let dir = Scratch::new("policy");
    let (path, p) = watched(&dir, Duration::from_millis(20));
    let watch = p.spawn_watch().expect("watching");
    let first = p.current();
    std::fs::write(&path, "").expect("truncates");
    said(&p, "has no chain").await;
    assert!(Arc::ptr_eq(&first, &p.current()), "the active set stays");
    std::fs::remove_file(&path).expect("deletes");
    said(&p, "cannot read").await;
    assert!(Arc::ptr_eq(&first, &p.current()), "the active set stays");
    write(&dir, &prompt_limit(500));
    let deadline = Instant::now() + Duration::from_secs(20);
    while p.last_error().is_some() {
        assert!(
            Instant::now() < deadline,
            "the file put back was never loaded"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!Arc::ptr_eq(&first, &p.current()));
    watch.abort();
}

/// The watcher takes a change once the file reads the same at two looks in a row: a file
/// read part-written (an editor truncates, then writes) is never loaded, however valid the
/// part, and a refused content is not tried again until it changes.
#[test]
fn the_watcher_takes_a_change_only_once_it_reads_the_same_twice() {
    let (a, b, c) = (
        Digest::of(b"a"),
        Digest::of(b"a part"),
        Digest::of(b"a whole"),
    );
    let mut s = super::handle::Settling::default();
    // The file as loaded: nothing to do.
    assert!(!s.settled(Some(a), Some(a)));
    // Read part-written, then whole: the part is never taken.
    assert!(!s.settled(Some(b), Some(a)), "first look at the part");
    assert!(!s.settled(Some(c), Some(a)), "the whole, first look");
    assert!(s.settled(Some(c), Some(a)), "the whole again: taken");
    // Once tried, not again until it changes.
    assert!(!s.settled(Some(c), Some(c)));
    assert!(!s.settled(Some(c), Some(c)));
    // Unreadable twice: a refused reload, said once.
    assert!(!s.settled(None, Some(c)));
    assert!(s.settled(None, Some(c)));
    assert!(!s.settled(None, None));
    // Changes at every look are never taken.
    for i in 0..10u8 {
        assert!(!s.settled(Some(Digest::of(&[i])), Some(c)), "{i}");
    }
}

/// A file changed, reloaded by an admin call, then put back before the watcher looked: the
/// watcher loads it again (it compared the file with what it had last seen itself, the same
/// content, and left the admin call's set running, different from the file, with nothing said).
#[tokio::test]
async fn the_watcher_compares_the_file_with_the_set_reloaded_last_whoever_reloaded_it() {
    // An attempt whose admin reload outlasts the watcher's interval shows nothing (the watcher
    // may have looked in between): tried again, and failed if none is quick enough.
    for attempt in 1..=3 {
        let dir = Scratch::new("policy");
        // Compiled once, into a cache: the admin call's reload below is quick even on a busy
        // machine.
        let mut s = settings(&write(&dir, &prompt_limit(5)), Some(dir.0.join("cache")));
        s.watch_interval = Some(Duration::from_secs(4));
        let p = Policies::load(s).expect("loads");
        let first = p.current().source();
        let watch = p.spawn_watch().expect("watching");
        // The watcher's first look, at once: the file as loaded.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let started = Instant::now();
        write(&dir, &prompt_limit(500));
        let admin = p.clone();
        tokio::task::spawn_blocking(move || admin.reload())
            .await
            .expect("joins")
            .expect("the admin call's reload");
        assert_ne!(p.current().source(), first);
        write(&dir, &prompt_limit(5));
        if started.elapsed() > Duration::from_millis(3500) {
            eprintln!(
                "attempt {attempt}: the admin reload took {:?}",
                started.elapsed()
            );
            watch.abort();
            continue;
        }
        let deadline = Instant::now() + Duration::from_secs(12);
        while p.current().source() != first {
            assert!(
                Instant::now() < deadline,
                "the file put back was never loaded: the running set is not the file's"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        watch.abort();
        return;
    }
    panic!("every attempt's admin reload outlasted the watcher's interval: nothing was shown");
}

/// The watcher's settled read of the file, overtaken by an admin reload of a later edit while
/// it waited for its turn, is not swapped in after that reload: the older file ran until the
/// watcher's next looks (and for good without a watcher, two admin calls crossing).
#[tokio::test]
async fn a_reload_that_read_an_older_file_never_replaces_a_later_ones_set() {
    let dir = Scratch::new("policy");
    let (path, p) = watched(&dir, Duration::from_secs(3600));
    write(&dir, &prompt_limit(50));
    let settled = load::read(&path);
    write(&dir, &prompt_limit(500));
    let admin = p.clone();
    let later = tokio::task::spawn_blocking(move || admin.reload())
        .await
        .expect("joins")
        .expect("the admin call's reload")
        .source();
    let watcher = p.clone();
    let swapped = tokio::task::spawn_blocking(move || watcher.reload_settled(settled))
        .await
        .expect("joins");
    assert!(swapped.is_none(), "the file reads otherwise now");
    assert_eq!(p.current().source(), later, "the later file's set stays");
}

#[tokio::test]
async fn a_bad_reload_keeps_the_old_set_and_says_why_and_in_flight_requests_keep_theirs() {
    let dir = Scratch::new("policy");
    let strict = format!(
        "{}{}",
        plugin("length-limit", ""),
        binding("length-limit", "config = { max_prompt_tokens = 5 }")
    );
    let path = write(&dir, &strict);
    let p = Policies::load(settings(&path, None)).expect("loads");
    let before = p.current();
    // A request in flight holds the set it started with.
    let in_flight = ask(
        &p,
        Ask {
            prompt: 1,
            ..Ask::default()
        },
    )
    .await
    .expect("allowed");
    // A bad set: refused, the old one stays and the reason is kept.
    write(
        &dir,
        &format!(
            "{}{}",
            plugin("length-limit", ""),
            binding("length-limit", "config = { max_prompt_tokens = -1 }")
        ),
    );
    let e = p.reload().expect_err("a bad set is refused");
    assert!(Arc::ptr_eq(&before, &p.current()));
    assert_eq!(p.last_error(), Some(e.to_string()));
    assert!(
        ask(&p, Ask::default()).await.is_err(),
        "the strict set is still active"
    );
    // A good set: swapped in whole.
    write(
        &dir,
        &format!(
            "{}{}",
            plugin("length-limit", ""),
            binding("length-limit", "config = { max_prompt_tokens = 500 }")
        ),
    );
    p.reload().expect("a good set loads");
    assert!(!Arc::ptr_eq(&before, &p.current()));
    assert_eq!(p.last_error(), None);
    ask(&p, Ask::default())
        .await
        .expect("the new set allows it");
    assert!(Arc::ptr_eq(&in_flight.set, &before));
}

/// A set of one length-limit binding in `dir`, loaded once with a compile cache of its own:
/// the set's file and the cache.
fn cached_length_limit(dir: &Scratch) -> (PathBuf, PathBuf) {
    let cache = dir.0.join("cache");
    let path = write(
        dir,
        &format!(
            "{}{}",
            plugin("length-limit", ""),
            binding("length-limit", "")
        ),
    );
    Policies::load(settings(&path, Some(cache.clone()))).expect("loads");
    (path, cache)
}

/// The files in the compile cache `dir`, sorted.
fn cache_entries(dir: &Path) -> Vec<PathBuf> {
    let mut e: Vec<_> = std::fs::read_dir(dir)
        .expect("the cache exists")
        .map(|e| e.expect("entry").path())
        .collect();
    e.sort();
    e
}

#[test]
fn the_compile_cache_is_written_and_a_corrupt_entry_is_never_trusted() {
    let dir = Scratch::new("policy");
    let (path, cache) = cached_length_limit(&dir);
    let entries = || cache_entries(&cache);
    // The plugin, the plugin instrumented for snapshots, and the binding's snapshot.
    let first = entries();
    assert_eq!(first.len(), 3, "{first:?}");
    let own = component("length-limit").1.to_string();
    let plugin_entry = first
        .iter()
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with(&own))
        })
        .unwrap_or_else(|| panic!("no entry for the plugin itself: {first:?}"));
    for entry in &first {
        std::fs::write(entry, b"not a compiled component").expect("corrupts it");
    }
    Policies::load(settings(&path, Some(cache.clone()))).expect("recompiles");
    assert_ne!(
        std::fs::read(plugin_entry).expect("rewritten"),
        b"not a compiled component"
    );
    // A snapshot of the same plugin and configuration is the same component: loading again
    // found every entry it wrote the first time, and none is corrupt now.
    assert_eq!(entries(), first);
    for entry in &first {
        assert_ne!(
            std::fs::read(entry).expect("rewritten"),
            b"not a compiled component"
        );
    }
}

/// An entry is native code tied to its component only by its name: one someone else could
/// have written (another valid entry copied over it, then left writable by others) is
/// compiled again, not run; a cache directory others can write is not used at all.
#[cfg(unix)]
#[test]
fn a_compile_cache_entry_others_can_write_is_never_trusted() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = Scratch::new("policy");
    let (path, cache) = cached_length_limit(&dir);
    let entries = cache_entries(&cache);
    let own = component("length-limit").1.to_string();
    let (mine, others): (Vec<_>, Vec<_>) = entries.iter().partition(|p| {
        p.file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with(&own))
    });
    let (plugin_entry, impostor) = (mine[0], others[0]);
    let mode = |p: &Path| std::fs::metadata(p).expect("entry").permissions().mode() & 0o777;
    assert_eq!(
        mode(plugin_entry),
        0o600,
        "written for the gateway's user alone"
    );
    // Another compiled component, sealed for the plugin (the seal is no secret): only the
    // entry's owner and mode keep it from being run as the pinned plugin.
    let digest = component("length-limit").1;
    let forged = super::cache::reseal(&std::fs::read(impostor).expect("the other entry"), &digest);
    let plant = |mode: u32| {
        std::fs::remove_file(plugin_entry).expect("removes the entry");
        std::fs::write(plugin_entry, &forged).expect("plants the forgery");
        std::fs::set_permissions(plugin_entry, std::fs::Permissions::from_mode(mode))
            .expect("sets its mode");
    };
    // Writable by anyone: compiled again, and the entry written anew.
    plant(0o666);
    let p = Policies::load(settings(&path, Some(cache.clone()))).expect("recompiles");
    assert_ne!(
        std::fs::read(plugin_entry).expect("rewritten"),
        forged,
        "a forged entry others could write was run as the pinned plugin"
    );
    assert_eq!(mode(plugin_entry), 0o600);
    drop(p);
    // The same forgery behind a symbolic link to a private file: not followed.
    let elsewhere = cache.join("elsewhere");
    std::fs::write(&elsewhere, &forged).expect("writes it");
    std::fs::set_permissions(&elsewhere, std::fs::Permissions::from_mode(0o600)).expect("mode");
    std::fs::remove_file(plugin_entry).expect("removes the entry");
    std::os::unix::fs::symlink(&elsewhere, plugin_entry).expect("links it");
    drop(Policies::load(settings(&path, Some(cache.clone()))).expect("recompiles"));
    let meta = std::fs::symlink_metadata(plugin_entry).expect("the entry");
    assert!(
        !meta.file_type().is_symlink(),
        "replaced by a file of its own"
    );
    assert_ne!(std::fs::read(plugin_entry).expect("rewritten"), forged);
    std::fs::remove_file(&elsewhere).expect("removes it");
    // The control: the same forgery, the gateway's own and private, is trusted — which is
    // why the check on owner and mode is what keeps it out above.
    plant(0o600);
    drop(Policies::load(settings(&path, Some(cache.clone()))));
    assert_eq!(std::fs::read(plugin_entry).expect("kept"), forged);
    // A cache directory others can write: nothing read from it or stored in it.
    std::fs::set_permissions(&cache, std::fs::Permissions::from_mode(0o777)).expect("opens it");
    for entry in cache_entries(&cache) {
        std::fs::remove_file(entry).expect("empties it");
    }
    Policies::load(settings(&path, Some(cache.clone()))).expect("compiles without it");
    assert_eq!(cache_entries(&cache), Vec::<PathBuf>::new());
    // A link to a private directory (a volume mounted elsewhere) is that directory's cache.
    std::fs::set_permissions(&cache, std::fs::Permissions::from_mode(0o700)).expect("closes it");
    let link = dir.0.join("cache-link");
    std::os::unix::fs::symlink(&cache, &link).expect("links it");
    Policies::load(settings(&path, Some(link))).expect("loads through the link");
    assert_eq!(
        cache_entries(&cache).len(),
        3,
        "written to the linked directory"
    );
    // A private directory under one anyone can write (and is not sticky, as `/tmp` is): they
    // could move it away and put their own in its place between a check and a read.
    let open = dir.0.join("open-parent");
    std::fs::create_dir(&open).expect("makes it");
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).expect("opens it");
    let under = open.join("cache");
    Policies::load(settings(&path, Some(under.clone()))).expect("compiles without it");
    assert_eq!(cache_entries(&under), Vec::<PathBuf>::new());
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o1777)).expect("sticky");
    Policies::load(settings(&path, Some(under.clone()))).expect("loads");
    assert_eq!(
        cache_entries(&under).len(),
        3,
        "a sticky parent holds still"
    );
}

#[test]
fn a_load_keeps_the_compile_cache_bounded_evicting_the_least_recently_used_never_its_own() {
    let dir = Scratch::new("policy");
    let (path, cache) = cached_length_limit(&dir);
    let own = cache_entries(&cache);
    let own_bytes: u64 = own
        .iter()
        .map(|p| std::fs::metadata(p).expect("entry").len())
        .sum();
    // What earlier configurations left: one used a day ago, one an hour ago.
    let day = Duration::from_secs(86_400);
    let stale = |name: &str, len: usize, ago: Duration| {
        let p = cache.join(format!(
            "{}-0000000000000000.cwasm",
            Digest::of(name.as_bytes())
        ));
        std::fs::write(&p, vec![0u8; len]).expect("writes");
        cache::backdate(&p, ago);
        p
    };
    let a_day_ago = stale("a day ago", 4 << 20, day);
    let an_hour_ago = stale("an hour ago", 64 << 10, Duration::from_secs(3600));
    // The set's own entries look older than both: only being read again by this load keeps
    // them off the front of the eviction order.
    for p in &own {
        cache::backdate(p, 2 * day);
    }
    let mut bounded = settings(&path, Some(cache.clone()));
    bounded.sandbox.cache_max_bytes = own_bytes + (64 << 10) + 4096;
    Policies::load(bounded).expect("loads from the cache");
    assert!(
        !a_day_ago.exists(),
        "the least recently used entry is evicted"
    );
    assert!(
        an_hour_ago.exists(),
        "the next one fits under the bound and stays"
    );
    for p in &own {
        assert!(p.exists(), "the loaded set's entry {} is kept", p.display());
    }
    // A bound below the set's own entries: everything else goes, the set's stay.
    let mut tiny = settings(&path, Some(cache.clone()));
    tiny.sandbox.cache_max_bytes = 0;
    Policies::load(tiny).expect("loads from the cache");
    assert!(!an_hour_ago.exists());
    assert!(own.iter().all(|p| p.exists()));
}

/// The client of `r` left, its worker's call or stream as `leg` and `progress` say, and `r`
/// charged [`charge`]: what the response's state does when it is dropped.
fn left(r: RequestPolicy, leg: Option<crate::upstreams::Leg>, progress: Progress, trail: Trail) {
    r.finish(leg, progress, trail, charge(), Endpoint::Chat);
}

/// A call the worker never answers (the request waits in its queue).
fn queued() -> crate::upstreams::Leg {
    crate::upstreams::Leg::Calling(Box::pin(std::future::pending()))
}

async fn abandoned_directives(p: &Policies) -> String {
    // The end of a request runs in a task: give it a moment.
    for _ in 0..100 {
        let mut m = String::new();
        p.render_metrics(&mut m, &|_| true);
        if m.contains("bulkhead_policy_abandoned_total{") {
            return m;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("no abandoned request was counted");
}

#[tokio::test]
async fn abort_guard_holds_an_abandoned_prefill_and_caps_what_a_tenant_holds() {
    let set = format!(
        "{}{}",
        plugin("abort-guard", ""),
        binding("abort-guard", "config = { max_held_per_tenant = 1 }")
    );
    // Abandoned before the first token: held until prefill is done.
    let (p, dir) = loaded(&set);
    let r = ask(&p, Ask::default()).await.expect("allowed");
    left(r, None, Progress::default(), trail(&dir));
    let m = abandoned_directives(&p).await;
    assert!(
        m.contains("directive=\"hold_until_prefill_done\"} 1"),
        "{m}"
    );
    assert!(
        m.contains(
            "bulkhead_policy_call_duration_seconds_count{plugin=\"abort-guard\",\
             hook=\"on-disconnect\"} 1"
        ),
        "{m}"
    );
    // Already decoding: nothing to protect, abort now.
    let (p, dir) = loaded(&set);
    let r = ask(&p, Ask::default()).await.expect("allowed");
    left(
        r,
        None,
        Progress {
            tokens: 3,
            ..Progress::default()
        },
        trail(&dir),
    );
    assert!(
        abandoned_directives(&p)
            .await
            .contains("directive=\"abort_now\"} 1")
    );
    // The tenant already holds its one: abort now.
    let (p, dir) = loaded(&set);
    let _held = p.hold("tenant-a", 1).expect("held");
    let r = ask(&p, Ask::default()).await.expect("allowed");
    left(r, None, Progress::default(), trail(&dir));
    assert!(
        abandoned_directives(&p)
            .await
            .contains("directive=\"abort_now\"} 1")
    );
}

/// A request's end waits for an instance slot longer than a call (nobody waits for it): on a
/// busy gateway an end that was not first in line ran out of a call's second and was dropped,
/// its usage unaccounted.
#[tokio::test]
async fn an_end_waits_for_an_instance_slot_longer_than_a_call() {
    let dir = Scratch::new("policy");
    let text = format!(
        "{}{}",
        plugin("abort-guard", ""),
        binding("abort-guard", "config = { max_held_per_tenant = 1 }")
    );
    let p = with_slots(&dir, &text, 1);
    let busy = p.slot("tenant-b", slots::Turn::Call).await;
    assert!(matches!(busy, Some(Ok(_))), "the one slot taken");
    let freed = async {
        tokio::time::sleep(SLOT_WAIT + Duration::from_millis(500)).await;
        drop(busy);
    };
    let (call, end, ()) = tokio::join!(
        p.slot("tenant-a", slots::Turn::Call),
        p.slot("tenant-a", slots::Turn::End),
        freed
    );
    assert!(matches!(call, Some(Err(Fault::Busy))), "{call:?}");
    assert!(matches!(end, Some(Ok(_))), "{end:?}");
}

/// A tenant's holds are counted once decided: requests still being decided (waiting for an
/// instance slot) or decided abort-now are not holds. A burst of disconnects — a decoding
/// request and a prefilling one leaving together while every slot is busy — pushed the count
/// while they waited, and the prefilling one was aborted mid-prefill over the bound of one.
#[tokio::test]
async fn a_tenants_holds_are_counted_once_decided_not_while_deciding() {
    let dir = Scratch::new("policy");
    let set = format!(
        "{}{}",
        plugin("abort-guard", ""),
        binding("abort-guard", "config = { max_held_per_tenant = 1 }")
    );
    let mut s = settings(&write(&dir, &set), None);
    s.sandbox.instances = 1;
    s.max_held_per_tenant = 1;
    let p = Policies::load(s).expect("the set loads");
    let busy = p.slot("tenant-b", slots::Turn::Call).await;
    assert!(matches!(busy, Some(Ok(_))), "the one slot taken");
    let decoding = ask(&p, Ask::default()).await.expect("allowed");
    let prefilling = ask(&p, Ask::default()).await.expect("allowed");
    let three = Progress {
        tokens: 3,
        ..Progress::default()
    };
    let audit = recorder(&dir);
    let trail = |id: &str| audit.trail(id.into(), tracing::Span::none());
    left(decoding, None, three, trail("decoding"));
    left(prefilling, None, Progress::default(), trail("prefilling"));
    // Both wait for the slot, then tenant-b's call ends.
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(busy);
    let mut m = String::new();
    for _ in 0..200 {
        m.clear();
        p.render_metrics(&mut m, &|_| true);
        if m.contains("directive=\"abort_now\"} 1")
            && m.contains("directive=\"hold_until_prefill_done\"} 1")
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(m.contains("directive=\"abort_now\"} 1"), "{m}");
    assert!(
        m.contains("directive=\"hold_until_prefill_done\"} 1"),
        "the prefilling one held: {m}"
    );
    assert!(!m.contains("over_hold_bound_total{"), "{m}");
}

/// A burst of a tenant's disconnects is decided one at a time once each has its slot: each
/// asks the plugins with what the tenant holds by then, so abort-guard's cap of one holds one
/// of sixteen prefilling requests that left together, on threads of their own (they were
/// asked with what the tenant held before the burst, and held as many as ran side by side).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_burst_of_disconnects_is_held_to_the_plugins_own_cap() {
    const BURST: usize = 16;
    let dir = Scratch::new("policy");
    let set = format!(
        "{}{}",
        plugin("abort-guard", ""),
        binding("abort-guard", "config = { max_held_per_tenant = 1 }")
    );
    let p = with_slots(&dir, &set, BURST as u32);
    // Side by side on threads, a burst's decisions overlap now and then: ten bursts.
    for burst in 0..10 {
        let mut busy = Vec::new();
        for _ in 0..BURST {
            let slot = p.slot("tenant-b", slots::Turn::Call).await;
            assert!(matches!(slot, Some(Ok(_))), "a slot taken");
            busy.push(slot);
        }
        let mut deciding = Vec::new();
        for _ in 0..BURST {
            let ending = ask(&p, Ask::default()).await.expect("allowed").ending();
            deciding.push(tokio::spawn(async move {
                ending
                    .decide(bindings::Phase::Prefilling, Progress::default(), 64)
                    .await
            }));
        }
        // Every one waits for a slot; then every slot comes free at once.
        tokio::time::sleep(Duration::from_millis(50)).await;
        drop(busy);
        let mut decided = Vec::new();
        for d in deciding {
            decided.push(d.await.expect("decided"));
        }
        let held = decided.iter().filter(|d| d.held.is_some()).count();
        assert_eq!(held, 1, "burst {burst}: one held");
        assert!(decided.iter().all(|d| !d.over_bound));
    }
}

/// Without policies, a client that leaves is dropped at once, as abort-now: no refusal at a
/// hold bound (there is none to reach) is counted or logged. Every disconnect was counted
/// over the bound, which an operator's alert on it would take for a tenant holding too much.
#[tokio::test]
async fn without_policies_a_disconnect_is_not_counted_over_the_hold_bound() {
    let p = Policies::disabled();
    let dir = Scratch::new("policy");
    let r = ask(&p, Ask::default()).await.expect("allowed");
    let progress = Progress {
        tokens: 3,
        ..Progress::default()
    };
    left(r, None, progress, trail(&dir));
    let m = abandoned_directives(&p).await;
    assert!(m.contains("directive=\"abort_now\"} 1"), "{m}");
    assert!(!m.contains("over_hold_bound_total{"), "{m}");
}

/// A tenant's burst of disconnects waits for its turns holding no instance slot: while one
/// decision runs (a plugin that spins to its deadline), the next waits for the turn, and
/// another tenant's call finds a slot at once. (Slots taken before the turn sat idle through
/// the turns: the other tenant waited for the running decision to end.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_disconnects_wait_for_their_turn_holding_no_slot() {
    let dir = Scratch::new("policy");
    let set = format!(
        "{}{}",
        plugin("hostile", "timeout_ms = 600"),
        binding(
            "hostile",
            "fail_open = true\nconfig = { attack = \"loop\" }"
        ),
    );
    let p = with_slots(&dir, &set, 3);
    let mut endings = Vec::new();
    for _ in 0..2 {
        endings.push(
            ask(&p, Ask::default())
                .await
                .expect("allowed: fail-open")
                .ending(),
        );
    }
    let busy = p.slot("tenant-c", slots::Turn::Call).await;
    assert!(matches!(busy, Some(Ok(_))), "a slot taken");
    let deciding: Vec<_> = endings
        .into_iter()
        .map(|ending| {
            tokio::spawn(async move {
                ending
                    .decide(bindings::Phase::Prefilling, Progress::default(), 64)
                    .await
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let asked = Instant::now();
    let slot = p.slot("tenant-b", slots::Turn::Call).await;
    assert!(matches!(slot, Some(Ok(_))), "a slot for tenant-b");
    assert!(
        asked.elapsed() < Duration::from_millis(250),
        "tenant-b waited {:?} for a slot",
        asked.elapsed()
    );
    drop((slot, busy));
    for d in deciding {
        d.await.expect("decided");
    }
}

/// abort-guard holding one abandoned request per tenant, and a tenant allowed 1000 tokens a
/// minute whose one request slot is taken by a request of prompt 10 + max tokens 990.
fn one_slot_charged_in_full() -> (Policies, Scratch, Arc<Tenant>, Limiter, Charge) {
    let (p, dir) = loaded(&format!(
        "{}{}",
        plugin("abort-guard", ""),
        binding("abort-guard", "config = { max_held_per_tenant = 1 }")
    ));
    let a = tenant(1000);
    let limiter = Limiter::default();
    let mut permit = limiter.start(&a).expect("the one slot");
    permit
        .charge_tokens(1000)
        .expect("prompt 10 + max tokens 990");
    let charge = Charge {
        permit,
        prompt_tokens: 10,
        max_tokens: 990,
        claim: None,
    };
    (p, dir, a, limiter, charge)
}

/// The tenant's slot once the abandoned request ended (bounded wait).
async fn slot_back(limiter: &Limiter, a: &Arc<Tenant>) -> crate::limits::RequestPermit {
    for _ in 0..100 {
        if limiter.in_flight(&a.id) == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    limiter.start(a).expect("the slot came back at the end")
}

/// A request whose client left before the worker answered its call (it waited in the
/// worker's queue) ran nothing: dropped at once (abort-guard: abort-now while queued), it is
/// charged nothing, and its policies hear it as queued and as having used nothing.
#[tokio::test]
async fn a_request_abandoned_before_its_call_was_answered_is_charged_nothing() {
    let (p, dir, a, limiter, charge) = one_slot_charged_in_full();
    let r = ask(&p, Ask::default()).await.expect("allowed");
    r.finish(
        Some(queued()),
        Progress::default(),
        trail(&dir),
        charge,
        Endpoint::Chat,
    );
    let m = abandoned_directives(&p).await;
    assert!(m.contains("directive=\"abort_now\"} 1"), "queued: {m}");
    let mut next = slot_back(&limiter, &a).await;
    next.charge_tokens(1000)
        .expect("all of the minute's 1000 are back: the prompt was never computed");
}

/// A request that failed before its first token is charged nothing before the worker said
/// it computed the prompt (a refusal), and its prompt after (prefill done, then the transfer
/// failed): that work was done, as it is charged for a client that leaves then.
#[tokio::test]
async fn a_failed_request_is_charged_its_prompt_once_the_worker_computed_it() {
    for (prefill_done, charged) in [(false, false), (true, true)] {
        let progress = Progress {
            failed: true,
            prefill_done,
            ..Progress::default()
        };
        let (p, dir, a, limiter, mut charge) = one_slot_charged_in_full();
        // A prompt of 500 (its tokens take 30 s to come back at 1000 a minute).
        (charge.prompt_tokens, charge.max_tokens) = (500, 500);
        let r = ask(&p, Ask::default()).await.expect("allowed");
        r.finish(None, progress, trail(&dir), charge, Endpoint::Chat);
        let mut next = slot_back(&limiter, &a).await;
        assert_eq!(next.charge_tokens(1000).is_err(), charged, "{progress:?}");
        if charged {
            next.charge_tokens(500)
                .expect("all but the prompt came back");
        }
    }
}

/// A request the worker answered whose answer was not sent (its record could not be made
/// durable, the client was told 503) ends in `on-response-end` as failed; one sent, completed.
#[tokio::test]
async fn an_answer_not_sent_ends_as_failed_and_one_sent_as_completed() {
    for (failed, outcome) in [(false, "completed"), (true, "failed")] {
        let (p, dir, _, _, charge) = one_slot_charged_in_full();
        let r = ask(&p, Ask::default()).await.expect("allowed");
        let progress = Progress {
            usage: Some((10, 3)),
            failed,
            ..Progress::default()
        };
        r.finish(None, progress, trail(&dir), charge, Endpoint::Chat);
        let mut m = String::new();
        p.render_metrics(&mut m, &|_| true);
        let series = format!("bulkhead_policy_response_ends_total{{outcome=\"{outcome}\"}} 1");
        assert!(m.contains(&series), "{m}");
    }
}

/// A held request whose worker's stream fails before the worker computed its prompt is
/// charged nothing, as had its client stayed (it was charged its prompt).
#[tokio::test]
async fn a_held_request_whose_stream_fails_is_charged_as_a_failure_is() {
    let (p, dir, a, limiter, charge) = one_slot_charged_in_full();
    let r = ask(&p, Ask::default()).await.expect("allowed");
    let stream = crate::upstreams::UpstreamStream::OpenAi(
        crate::upstreams::openai::tests::held_stream(&[], false),
    );
    r.finish(
        Some(crate::upstreams::Leg::Streaming(stream)),
        Progress::default(),
        trail(&dir),
        charge,
        Endpoint::Chat,
    );
    let m = abandoned_directives(&p).await;
    assert!(
        m.contains("directive=\"hold_until_prefill_done\"} 1"),
        "held: {m}"
    );
    let mut next = slot_back(&limiter, &a).await;
    next.charge_tokens(1000)
        .expect("all of the minute's 1000 are back: the prompt was never computed");
}

#[tokio::test]
async fn an_abandoned_request_keeps_its_slot_until_its_end_and_is_charged_what_it_used() {
    let (p, dir, a, limiter, charge) = one_slot_charged_in_full();
    let r = ask(&p, Ask::default()).await.expect("allowed");
    let progress = Progress {
        tokens: 3,
        ..Progress::default()
    };
    r.finish(None, progress, trail(&dir), charge, Endpoint::Chat);
    abandoned_directives(&p).await;
    let mut next = slot_back(&limiter, &a).await;
    // 13 used (prompt and the 3 tokens that came): 987 of the minute's 1000 are back.
    next.charge_tokens(987).expect("the unused 987 refunded");
    // The 13 used stay charged (the bucket refills 1000 a minute: 60 would take 3.6 s).
    assert!(
        next.charge_tokens(60).is_err(),
        "what it used stays charged"
    );
}

/// A held stream that sends more tokens than the request was admitted with (a broken
/// upstream) is recorded, and charged, as the admitted maximum: never more.
#[tokio::test]
async fn an_abandoned_request_is_never_counted_past_its_max_tokens() {
    let (p, dir) = loaded(&format!(
        "{}{}",
        plugin("abort-guard", ""),
        binding("abort-guard", "config = { max_held_per_tenant = 1 }")
    ));
    let recorder = recorder(&dir);
    let r = ask(&p, Ask::default()).await.expect("allowed");
    let progress = Progress {
        tokens: 5000,
        ..Progress::default()
    };
    let trail = recorder.trail("req-over".into(), tracing::Span::none());
    left(r, None, progress, trail);
    abandoned_directives(&p).await;
    let record = first_record(&recorder).await;
    assert_eq!(record.output_tokens, Some(100), "{record:?}");
}

/// The first record in `recorder`'s gateway log (bounded wait: an abandoned request's record
/// is written when its hold ends, in a task).
async fn first_record(recorder: &Recorder) -> bulkhead_audit::AuditRecord {
    let gateway = bulkhead_audit::TenantId::new(crate::trail::GATEWAY_LOG).expect("valid");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        recorder.flush().expect("flush");
        let read = recorder
            .read(&gateway, bulkhead_audit::Seq(0), 10)
            .expect("read");
        if let Some(stored) = read.into_iter().next() {
            return stored.record;
        }
        assert!(Instant::now() < deadline, "no record");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A policy set of `ledger` alone, holding a request abandoned in its worker's queue until
/// complete.
fn ledger_holding_the_queued() -> String {
    ledger_holding("queued")
}

/// A policy set of `ledger` alone, holding a request abandoned in `phase` until complete.
fn ledger_holding(phase: &str) -> String {
    format!(
        "{}{}",
        plugin("ledger", ""),
        binding(
            "ledger",
            &format!(
                "config = {{ on_disconnect = \"hold-until-complete\", phases = [\"{phase}\"] }}"
            )
        )
    )
}

/// `ledger` holding a request abandoned in its worker's queue until complete, a recorder in
/// the scratch directory, and such a request the chain allowed.
async fn held_while_queued() -> (Policies, Scratch, Recorder, RequestPolicy) {
    let (p, dir) = loaded(&ledger_holding_the_queued());
    let r = ask(&p, Ask::default()).await.expect("allowed");
    let recorder = recorder(&dir);
    (p, dir, recorder, r)
}

/// Requests abandoned while every instance slot is busy are dropped at the hold limit from
/// their disconnect, however long their decision waits: each waited its tenant's turn, then a
/// slot for up to a second, the worker computing on for them meanwhile, the last of a burst
/// of three dropped three seconds on.
#[tokio::test]
async fn an_abandoned_request_waiting_for_its_decision_is_dropped_at_the_hold_limit() {
    let dir = Scratch::new("policy");
    let mut s = settings(&write(&dir, &ledger_holding_the_queued()), None);
    s.sandbox.instances = 1;
    s.hold_limit = Duration::from_millis(300);
    let p = Policies::load(s).expect("the set loads");
    let recorder = recorder(&dir);
    let mut dropped = Vec::new();
    let mut requests = Vec::new();
    for _ in 0..3 {
        requests.push(ask(&p, Ask::default()).await.expect("allowed"));
    }
    // Every slot busy from here on.
    let busy = p.slot("tenant-b", slots::Turn::Call).await;
    assert!(matches!(busy, Some(Ok(_))), "the only slot");
    let started = Instant::now();
    for (i, r) in requests.into_iter().enumerate() {
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        dropped.push(rx);
        let call: crate::upstreams::Call = Box::pin(async move {
            let _held_until_dropped = tx;
            std::future::pending().await
        });
        left(
            r,
            Some(crate::upstreams::Leg::Calling(call)),
            Progress::default(),
            recorder.trail(format!("req-{i}"), tracing::Span::none()),
        );
    }
    for rx in dropped {
        tokio::time::timeout(Duration::from_secs(5), rx)
            .await
            .expect("dropped")
            .expect_err("never answered");
    }
    let took = started.elapsed();
    assert!(
        took < Duration::from_millis(900),
        "the hold limit of 300 ms held from the disconnects: {took:?}"
    );
    drop(busy);
}

/// A held stream cut at the hold's limit is charged and recorded by the tokens of the text it
/// sent, not its chunks: two chunks of three words are six tokens (counted inside the hold,
/// the count was dropped with it at the limit, and the record said two).
#[tokio::test]
async fn a_hold_cut_at_its_limit_counts_the_text_that_came() {
    let dir = Scratch::new("policy");
    let mut s = settings(&write(&dir, &ledger_holding("prefilling")), None);
    s.hold_limit = Duration::from_millis(300);
    let p = Policies::load(s).expect("the set loads");
    let recorder = recorder(&dir);
    let r = ask(&p, Ask::default()).await.expect("allowed");
    let stream = crate::upstreams::UpstreamStream::OpenAi(
        crate::upstreams::openai::tests::held_stream(&["a b c", " d e f"], true),
    );
    left(
        r,
        Some(crate::upstreams::Leg::Streaming(stream)),
        Progress::default(),
        recorder.trail("req-cut-at-limit".into(), tracing::Span::none()),
    );
    let record = first_record(&recorder).await;
    assert_eq!(record.output_tokens, Some(6), "{record:?}");
}

/// A held stream's `Done` is held to the request as a served one's is: one whose prompt is
/// not the one admitted fails the hold as a broken answer (recorded so), and is not charged
/// the worker's count.
#[tokio::test]
async fn a_held_streams_done_whose_counts_are_not_the_requests_fails_the_hold() {
    for (admitted, failed) in [(10, None), (11, Some("internal_error"))] {
        let (p, dir) = loaded(&ledger_holding("prefilling"));
        let recorder = recorder(&dir);
        let r = ask(&p, Ask::default()).await.expect("allowed");
        // The stream's Done says a prompt of 10.
        let stream = crate::upstreams::UpstreamStream::OpenAi(
            crate::upstreams::openai::tests::finished_stream(&["a b", " c"]),
        );
        let mut charge = charge();
        charge.prompt_tokens = admitted;
        r.finish(
            Some(crate::upstreams::Leg::Streaming(stream)),
            Progress::default(),
            recorder.trail("req-held-done".into(), tracing::Span::none()),
            charge,
            Endpoint::Chat,
        );
        let record = first_record(&recorder).await;
        let hold = record.hold.as_ref().expect("held");
        assert_eq!(
            hold.failed.as_deref(),
            failed,
            "admitted {admitted}: {record:?}"
        );
    }
}

/// A request held after its client left whose worker then refuses it (here its prefill
/// worker's admission, while it waited in the queue under a hold until complete) is recorded
/// with that refusal: the hold failed as the worker said, and the admission layer that
/// refused it, as had its client stayed.
#[tokio::test]
async fn a_held_request_the_worker_then_refuses_is_recorded_with_the_refusal() {
    let (_policies, _dir, recorder, r) = held_while_queued().await;
    let mut refusal = tonic::Status::invalid_argument("the prompt does not fit");
    for (key, value) in [
        (
            bulkhead_worker::serve::proto::ERROR_CODE_KEY,
            "context_length_exceeded",
        ),
        (bulkhead_worker::serve::proto::REFUSED_BY_KEY, "prefill"),
    ] {
        refusal
            .metadata_mut()
            .insert(key, value.parse().expect("ascii"));
    }
    let refused: crate::upstreams::Call = Box::pin(async move { Err(refusal) });
    let trail = recorder.trail("req-refused".into(), tracing::Span::none());
    left(
        r,
        Some(crate::upstreams::Leg::Calling(refused)),
        Progress::default(),
        trail,
    );
    let record = first_record(&recorder).await;
    let hold = record.hold.as_ref().expect("held");
    assert_eq!(hold.directive, bulkhead_audit::Directive::HoldUntilComplete);
    assert_eq!(hold.failed.as_deref(), Some("context_length_exceeded"));
    let admission = record.admission.expect("decided");
    assert_eq!(
        admission.outcome,
        bulkhead_audit::AdmissionOutcome::Rejected
    );
    assert_eq!(admission.layer, bulkhead_audit::Layer::Prefill);
    assert_eq!(record.error_type.as_deref(), Some("client_disconnected"));
}

/// Shutdown waits for a held request (its end runs in a task, counted), and its cut ends the
/// hold: the record says the client left and that shutdown ended its hold, and its
/// `on-response-end` has run when the wait ends.
#[tokio::test]
async fn shutdown_waits_for_a_hold_and_its_cut_ends_it_on_the_record() {
    let (p, _dir, recorder, r) = held_while_queued().await;
    left(
        r,
        Some(queued()),
        Progress::default(),
        recorder.trail("req-cut".into(), tracing::Span::none()),
    );
    assert!(
        tokio::time::timeout(Duration::from_millis(300), p.ended())
            .await
            .is_err(),
        "the hold runs, and shutdown would wait for it"
    );
    crate::serving::Witness::cut(&recorder);
    tokio::time::timeout(Duration::from_secs(10), p.ended())
        .await
        .expect("the cut ends the hold");
    let m = abandoned_directives(&p).await;
    assert!(
        m.contains(
            "bulkhead_policy_call_duration_seconds_count{plugin=\"ledger\",\
             hook=\"on-response-end\"} 1"
        ),
        "{m}"
    );
    let record = first_record(&recorder).await;
    assert_eq!(record.error_type.as_deref(), Some("client_disconnected"));
    assert!(record.disconnect.is_some(), "{record:?}");
    let hold = record.hold.as_ref().expect("held");
    assert_eq!(hold.directive, bulkhead_audit::Directive::HoldUntilComplete);
    assert_eq!(hold.failed.as_deref(), Some("gateway_shutdown"));
}

/// The gateway's own bound on what one tenant holds outranks the policies (and a failing
/// plugin's default): past it, a request whose client left is dropped at once although a
/// plugin asks to hold it.
#[tokio::test]
async fn past_the_gateways_bound_an_abandoned_request_is_not_held_whatever_a_plugin_says() {
    let dir = Scratch::new("policy");
    let path = write(&dir, &ledger_holding_the_queued());
    let p = Policies::load(PolicySettings {
        max_held_per_tenant: 1,
        ..settings(&path, None)
    })
    .expect("loads");
    let _held = p.hold("tenant-a", 1).expect("held");
    let r = ask(&p, Ask::default()).await.expect("allowed");
    left(r, Some(queued()), Progress::default(), trail(&dir));
    let m = abandoned_directives(&p).await;
    assert!(m.contains("directive=\"abort_now\"} 1"), "{m}");
    assert!(
        m.contains("bulkhead_policy_abandoned_over_hold_bound_total{tenant=\"tenant-a\"} 1"),
        "{m}"
    );
    assert!(
        !m.contains("hook=\"on-disconnect\""),
        "the policies were not asked (a slot wait would keep the worker busy): {m}"
    );
}
