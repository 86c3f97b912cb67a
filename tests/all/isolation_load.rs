//! The isolation suite under load and faults (issue 7): asymmetric pools exhausted by several
//! tenants at once, clients that leave at each phase of a request (with and without the abort
//! guard), workers killed mid-request and restarted under load, and a bounded soak with random
//! aborts whose worker memory must stay flat. Every scenario ends with the same oracles
//! (crate::oracles) over everything it sent.
//!
//! Faults in the KV frames themselves: a corrupted, dropped or duplicated frame and a frame
//! under a forged nonce or a stale tag, between real processes, need a test build to inject
//! them (`isolation_switches.rs`); a late frame of an aborted transfer and the same faults
//! message by message in one process (`worker/tests/all/disaggregation.rs`,
//! `handoff/src/inbound.rs`); a stuck and then dead peer, a transfer dropped before its KV
//! exists (`transfer_faults.rs`); a paced (rate-limited) link — delay, loss and reordering
//! where the kernel has netem — and a partition between workers in network namespaces
//! (`netns.rs`).
//!
//! A gap this suite found (I5): a client that closes its socket the instant it has sent a
//! request sometimes left no audit record at all (in one soak 4 of 5 such requests). hyper
//! dispatches a request as soon as it has read it and keeps reading; when the close is in that
//! read, it drops the request's future before polling it — before the API made its trail. The
//! gateway now notes every request when hyper hands it over and records one dropped unpolled
//! (`gateway/src/trail/unserved.rs`); `a_client_that_closes_at_once_still_gets_one_audit_record`
//! is the regression test.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::cluster::{Cluster, Spec, VERBOSE_LOG};
use crate::isolation::{
    assert_refused_by, baseline, chat, completion, fitting, long_prompt, oracle_findings,
};
use crate::oracles::{
    Leave, Ledger, Pool, Reference, TENANT_A, TENANT_B, TENANT_C, Tenant, assert_clean, canary,
    tenant_c_toml,
};
use crate::up::{TempDir, bounded, metric};
use crate::worker_grpc::{Worker, metric as worker_metric};

/// Starts a cluster with these pools (tokens) and `extra` gateway configuration, and the solo
/// reference, at once.
fn start(prefill_pool: &str, decode_pool: &str, replace: &[(&str, &str)]) -> (Cluster, Reference) {
    let toml = tenant_c_toml();
    std::thread::scope(|s| {
        let reference = s.spawn(Reference::start);
        let cluster = Cluster::start(Spec {
            prefill: &["--kv-tokens", prefill_pool],
            decode: &["--kv-tokens", decode_pool],
            env: &[("BULKHEAD_LOG", VERBOSE_LOG)],
            replace,
            toml: &toml,
            ..Spec::default()
        });
        (cluster, reference.join().expect("the reference starts"))
    })
}

/// Sets its flag when dropped: background loops stop even when the test panics.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// The highest value `series` reaches on `worker` while `f` runs (sampled every 20 ms).
fn peak_while<T>(worker: &Worker, series: &str, f: impl FnOnce() -> T) -> (T, f64) {
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        let sampler = s.spawn(|| {
            let mut peak = 0f64;
            while !done.load(Ordering::Relaxed) {
                peak = peak.max(worker_metric(&worker.metrics(), series));
                std::thread::sleep(Duration::from_millis(20));
            }
            peak
        });
        let out = {
            let _stop = StopOnDrop(&done);
            f()
        };
        (out, sampler.join().expect("the sampler"))
    })
}

#[test]
fn a_decode_pool_smaller_than_prefills_is_exhausted_by_three_tenants_and_each_is_served_exactly() {
    bounded(|| {
        // The other asymmetry: decode holds 192 tokens (12 pages), prefill 512.
        let (cluster, mut reference) = start("512", "192", &[]);
        let baseline = baseline(&cluster);
        let ledger = Ledger::default();
        let a_canary = canary(&TENANT_A);
        // Over decode's pool but not prefill's: the limit is decode's.
        let over = ledger.send(
            cluster.api(),
            TENANT_A,
            "/v1/completions",
            &completion(&long_prompt(&a_canary, 300), 8, false),
            &[&a_canary],
        );
        assert_refused_by(&cluster, &over, "gateway");
        assert!(
            over.response.contains("the limit is 192"),
            "{}",
            over.response
        );
        // Nine requests at once need about three times the pool: most wait for pages.
        let ((), peak) = peak_while(&cluster.decode, "bulkhead_queue_depth", || {
            std::thread::scope(|s| {
                for tenant in [TENANT_A, TENANT_B, TENANT_C] {
                    for (path, body, c) in fitting(tenant) {
                        let (api, ledger) = (cluster.api(), &ledger);
                        s.spawn(move || {
                            let e = ledger.send(api, tenant, path, &body, &[&c]);
                            assert_eq!(e.status, 200, "{}: {}", tenant.id, e.response);
                        });
                    }
                }
            });
        });
        assert!(peak >= 1.0, "the decode pool was never exhausted");
        assert_clean(&oracle_findings(
            &cluster,
            baseline,
            [0, 0],
            &ledger,
            &mut reference,
        ));
    });
}

/// A policy set of the built-in plugins in which only tenant-a and tenant-b have the abort
/// guard: tenant-c's abandoned requests are cancelled at once.
fn guard_for_a_and_b_only(dir: &Path) -> String {
    let (path, digest) = crate::policies::component("abort-guard");
    let text = format!(
        "[plugins.abort-guard]\ncomponent = {:?}\nsha256 = \"{digest}\"\n\n\
         [[chain]]\nplugin = \"abort-guard\"\ntenants = [\"tenant-a\", \"tenant-b\"]\n\
         config = {{ max_held_per_tenant = 8 }}\n",
        path.display().to_string()
    );
    let file = dir.join("policies.toml");
    std::fs::write(&file, text).expect("writes the policy set");
    format!("file = {:?}", file.display().to_string())
}

/// A gateway metric's value.
fn gateway_metric(cluster: &Cluster, series: &str) -> u64 {
    metric(&cluster.gateway_metrics(), series)
}

/// Waits (bounded) until `ready` holds for `worker`'s metrics.
fn wait_metric(worker: &Worker, what: &str, ready: impl Fn(&str) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let m = worker.metrics();
        if ready(&m) {
            return;
        }
        assert!(Instant::now() < deadline, "never {what}:\n{m}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn clients_that_leave_at_every_phase_with_and_without_the_abort_guard_leave_no_page_and_one_record()
{
    bounded(|| {
        let dir = TempDir::new("aborts");
        let policies = guard_for_a_and_b_only(&dir.0);
        let (cluster, mut reference) = start(
            "512",
            "512",
            &[("file = \"policies/local.toml\"", &policies)],
        );
        let baseline = baseline(&cluster);
        let ledger = Ledger::default();
        let api = cluster.api();
        let guarded_and_not = [TENANT_B, TENANT_C];

        // Queued: tenant-a's long generation holds all of decode's pages; B's and C's requests
        // wait for pages, and their clients leave before any answer.
        let a_canary = canary(&TENANT_A);
        // Counting: it never stops on its own before its 440 tokens.
        let count: String = (1..=12).map(|i| format!("{i}, ")).collect();
        let hog = completion(&format!("{a_canary} counts: {count}"), 440, true);
        // Its client leaves once B's and C's have left (a fixed delay was outrun by a quick
        // machine, which finished all 440 tokens first).
        let others_left = AtomicBool::new(false);
        std::thread::scope(|s| {
            let hog = s.spawn(|| {
                let leave = Leave::When(&others_left);
                ledger.abandon(api, TENANT_A, "/v1/completions", &hog, &[&a_canary], leave)
            });
            wait_metric(&cluster.decode, "running the hog", |m| {
                worker_metric(m, "bulkhead_running_requests") >= 1.0
                    && worker_metric(m, "bulkhead_generated_tokens_total") >= 1.0
                    && worker_metric(m, "bulkhead_kv_reserved_tokens") >= 440.0
            });
            let ((), peak) = peak_while(&cluster.decode, "bulkhead_queue_depth", || {
                std::thread::scope(|s| {
                    for tenant in guarded_and_not {
                        let ledger = &ledger;
                        s.spawn(move || {
                            let c = canary(&tenant);
                            let body = chat(&format!("Spell {c} backwards."), 16, true);
                            let leave = Leave::After(Duration::from_millis(800));
                            let path = "/v1/chat/completions";
                            let e = ledger.abandon(api, tenant, path, &body, &[&c], leave);
                            // (The head may have come: decode accepted it, then it waited.)
                            assert!(e.abandoned && !e.response.contains("data:"), "{e:?}");
                        });
                    }
                });
            });
            others_left.store(true, Ordering::SeqCst);
            assert!(peak >= 2.0, "B's and C's requests waited for pages: {peak}");
            let hog = hog.join().expect("the hog");
            assert!(
                hog.abandoned,
                "the hog ended before its client left: {hog:?}"
            );
        });

        // During prefill (after the head, before the first token), and during decode (after two
        // events): B's guard holds the request until its first token, C's is cancelled at once.
        for tenant in guarded_and_not {
            let c = canary(&tenant);
            let long = completion(&long_prompt(&c, 200), 16, true);
            let e = ledger.abandon(
                api,
                tenant,
                "/v1/completions",
                &long,
                &[&c],
                Leave::AfterHead,
            );
            assert!(e.abandoned && e.status == 200, "{e:?}");
            let c = canary(&tenant);
            let body = chat(&format!("Tell a long story about {c}."), 64, true);
            let e = ledger.abandon(
                api,
                tenant,
                "/v1/chat/completions",
                &body,
                &[&c],
                Leave::AfterEvents(2),
            );
            assert!(e.abandoned && e.status == 200, "{e:?}");
        }
        // And a request that completes, for solo equality after all that.
        let c = canary(&TENANT_C);
        let e = ledger.send(
            api,
            TENANT_C,
            "/v1/chat/completions",
            &chat(&format!("Repeat: {c}"), 8, false),
            &[&c],
        );
        assert_eq!(e.status, 200, "{}", e.response);

        assert_clean(&oracle_findings(
            &cluster,
            baseline,
            [0, 0],
            &ledger,
            &mut reference,
        ));
        // B's request left during prefill was held to its first token; C's was dropped before
        // it. (The queued ones count too when their response head had come already.)
        let held = "bulkhead_policy_abandoned_total{directive=\"hold_until_prefill_done\"}";
        let early = "bulkhead_policy_abandoned_dropped_total{at=\"before_first_token\"}";
        assert!(
            gateway_metric(&cluster, held) >= 1,
            "B's guard held its request"
        );
        assert!(
            gateway_metric(&cluster, early) >= 1,
            "C's request was cancelled at once"
        );
    });
}

/// Sends `tenant`'s fitting requests over and over until `stop`; any outcome is recorded.
/// After a failure it waits a little, as a client would: while a worker is down the gateway
/// answers at once, and without a pause the tenant would spend its requests-per-minute limit.
fn keep_sending(api: &str, ledger: &Ledger, tenant: Tenant, stop: &AtomicBool) {
    let requests = fitting(tenant);
    for (path, body, c) in requests.iter().cycle() {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        if ledger.send(api, tenant, path, body, &[c]).status != 200 {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Sends `tenant`'s fitting requests until one is answered 200 (bounded): the deployment
/// serves again.
fn until_served(api: &str, ledger: &Ledger, tenant: Tenant) {
    let deadline = Instant::now() + Duration::from_secs(30);
    for (path, body, c) in fitting(tenant).iter().cycle() {
        if ledger.send(api, tenant, path, body, &[c]).status == 200 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{} is never served again",
            tenant.id
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

#[test]
fn workers_killed_mid_request_and_restarted_under_load_fail_cleanly_and_leak_nothing() {
    bounded(|| {
        let refresh = [("\n[listen]", "\nworker_refresh_secs = 1\n\n[listen]")];
        let (mut cluster, mut reference) = start("1024", "1024", &refresh);
        let ledger = Ledger::default();
        let stop = AtomicBool::new(false);
        let api = cluster.api().to_owned();
        let a_canary = canary(&TENANT_A);
        let long = completion(&long_prompt(&a_canary, 400), 8, false);
        let story = chat(&format!("Tell a long story about {a_canary}."), 200, true);
        std::thread::scope(|s| {
            let _stop = StopOnDrop(&stop);
            for tenant in [TENANT_B, TENANT_C] {
                let (api, ledger, stop) = (&api, &ledger, &stop);
                s.spawn(move || keep_sending(api, ledger, tenant, stop));
            }
            // The prefill worker dies while decode waits for A's KV (A's 400 prompt tokens are
            // in flight; B's and C's prompts are far shorter): A fails fast with a 503, and
            // decode gets every page back.
            let a = s.spawn(|| ledger.send(&api, TENANT_A, "/v1/completions", &long, &[&a_canary]));
            wait_metric(&cluster.decode, "A's transfer in flight", |m| {
                worker_metric(m, "bulkhead_kv_in_flight_tokens{side=\"receive\"}") >= 300.0
            });
            let killed = Instant::now();
            cluster.restart_prefill();
            let a = a.join().expect("A's client");
            assert_eq!(a.status, 503, "{}", a.response);
            assert!(killed.elapsed() < Duration::from_secs(30));

            // The decode worker dies while it generates A's long answer (its reservation is
            // far larger than B's or C's): the stream ends with an error event, never [DONE].
            until_served(&api, &ledger, TENANT_B);
            let a = s.spawn(|| {
                let leave = Leave::After(Duration::from_secs(30));
                ledger.abandon(
                    &api,
                    TENANT_A,
                    "/v1/chat/completions",
                    &story,
                    &[&a_canary],
                    leave,
                )
            });
            wait_metric(&cluster.decode, "generating A", |m| {
                worker_metric(m, "bulkhead_kv_reserved_tokens") >= 200.0
                    && worker_metric(m, "bulkhead_kv_transfers_in_flight{side=\"receive\"}") == 0.0
            });
            std::thread::sleep(Duration::from_millis(300));
            cluster.restart_decode();
            let a = a.join().expect("A's client");
            assert!(!a.abandoned, "the stream ended by itself: {a:?}");
            assert!(!a.response.contains("[DONE]"), "{}", a.response);
            // With an error event: a stream that just stops reads as a complete answer.
            assert_eq!(
                a.error_code().as_deref(),
                Some("service_unavailable"),
                "{}",
                a.response
            );
            stop.store(true, Ordering::Relaxed);
        });
        // Both tenants are served again by the restarted workers.
        until_served(&api, &ledger, TENANT_B);
        until_served(&api, &ledger, TENANT_C);
        // Every failure was clean: a 503, or an error event after the 200.
        for e in ledger.all() {
            let code = e.error_code();
            let clean = (e.status == 200 && code.is_none())
                || (matches!(e.status, 200 | 503)
                    && code.as_deref() == Some("service_unavailable"));
            assert!(
                clean,
                "{}: {} {code:?}: {}",
                e.tenant.id, e.status, e.response
            );
        }
        // The restarted workers are fresh; both end with every page back.
        let fresh = [Pool::of(&cluster.prefill), Pool::of(&cluster.decode)]
            .map(|p| Pool::all_free(p.total()));
        assert_clean(&oracle_findings(
            &cluster,
            fresh,
            [0, 0],
            &ledger,
            &mut reference,
        ));
    });
}

/// How long the soak runs after its warm-up (then it finishes the round it is in).
const SOAK: Duration = Duration::from_secs(25);

/// A worker process's resident memory, in KiB.
fn rss_kib(worker: &Worker) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", worker.child.id()))
        .expect("the worker's /proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

#[test]
fn a_bounded_mixed_soak_with_random_aborts_keeps_worker_memory_flat_and_leaks_nothing() {
    bounded(|| {
        let (cluster, mut reference) = start("1024", "1024", &[]);
        let baseline = baseline(&cluster);
        let ledger = Ledger::default();
        let api = cluster.api();
        // Each tenant: one canary, a few request shapes (short, long, streamed, chat), some of
        // them abandoned at a random point.
        let round = |tenant: Tenant, c: &str, rounds: usize| {
            for i in 0..rounds {
                let body = match i % 4 {
                    0 => chat(&format!("Repeat this code word: {c}"), 8, false),
                    1 => chat(&format!("Say {c} twice."), 12, true),
                    2 => completion(&format!("The code word is {c}. The code word is"), 8, true),
                    _ => completion(&long_prompt(c, 120), 16, true),
                };
                let path = if i % 4 < 2 {
                    "/v1/chat/completions"
                } else {
                    "/v1/completions"
                };
                if rand::random::<u8>().is_multiple_of(3) && i % 4 != 0 {
                    // After the head at the earliest: a client that closes the socket the moment
                    // it has sent the request may leave no audit record (see the module doc).
                    let leave = match rand::random::<u8>() % 3 {
                        0 => Leave::AfterHead,
                        n => Leave::AfterEvents(usize::from(n)),
                    };
                    ledger.abandon(api, tenant, path, &body, &[c], leave);
                } else {
                    let e = ledger.send(api, tenant, path, &body, &[c]);
                    assert_eq!(e.status, 200, "{}: {}", tenant.id, e.response);
                }
            }
        };
        let canaries = [TENANT_A, TENANT_B, TENANT_C].map(|t| (t, canary(&t)));
        let run = |rounds: usize| {
            std::thread::scope(|s| {
                for (t, c) in &canaries {
                    s.spawn(move || round(*t, c, rounds));
                }
            });
        };
        run(4); // warm-up: buffers, caches, the allocator's arenas
        let warm = [rss_kib(&cluster.prefill), rss_kib(&cluster.decode)];
        let started = Instant::now();
        while started.elapsed() < SOAK {
            run(4);
        }
        let took = started.elapsed();
        let after = [rss_kib(&cluster.prefill), rss_kib(&cluster.decode)];
        eprintln!(
            "soak: {} requests in {took:?}; worker RSS (prefill, decode) {warm:?} KiB after the \
             warm-up, {after:?} KiB at the end",
            ledger.all().len()
        );
        // A leak that matters here is KV: a page's frame is 360 KiB, and a request's transfer
        // holds tens of them, so a leak of one transfer per abort would grow a worker by
        // hundreds of MiB over the soak. The allocator's high-water mark (frames of several
        // transfers in flight at once) moves by up to ~17 MiB between runs: the bound leaves
        // room for that and none for a leaked transfer.
        for (name, (w, a)) in ["prefill", "decode"].iter().zip(warm.iter().zip(after)) {
            assert!(
                a <= w + 32 * 1024,
                "the {name} worker grew from {w} KiB to {a} KiB over {took:?} of soak"
            );
        }
        assert_clean(&oracle_findings(
            &cluster,
            baseline,
            [0, 0],
            &ledger,
            &mut reference,
        ));
    });
}

/// I5 for a client that closes its socket the moment it has sent a complete request (see the
/// module doc): each has exactly one record, in its tenant's log — abandoned, or answered to
/// nobody, whichever the gateway saw first.
#[test]
fn a_client_that_closes_at_once_still_gets_one_audit_record() {
    bounded(|| {
        let up = crate::up::Up::start(&[]);
        up.wait_routable();
        let body = chat("hi", 2, true);
        for _ in 0..3 {
            let before = up.admin_records(TENANT_A.id).len();
            for _ in 0..10 {
                drop(crate::up::open(
                    &up.api,
                    TENANT_A.key,
                    "/v1/chat/completions",
                    &body,
                ));
                std::thread::sleep(Duration::from_millis(50));
            }
            let records = up.wait_records(TENANT_A.id, before + 10);
            assert_eq!(records.len(), before + 10, "one record per request");
        }
    });
}
