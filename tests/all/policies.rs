//! Policy plugins end to end: `bulkhead up` with the real built-in components (built by
//! scripts/build-plugins) on the real model — a denial, a clamp, labels, and the abort guard
//! holding an abandoned request until its first token.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::cluster::{Cluster, Spec};
use crate::up::{
    ADMIN, KEY_A, KEY_B, KEY_LIMITED, KEY_METERED, Options, QUEUED_BEHIND, TempDir, Up,
    a_long_answer_holding_decode, bounded, exchange, header, http, json, metric, open, repo,
    wait_records,
};

/// The control tenant of `Up` (its `abort-guard` may hold nothing).
const KEY_CONTROL: &str = KEY_LIMITED;

pub(crate) fn component(name: &str) -> (PathBuf, String) {
    let path = repo().join("plugins/dist").join(format!("{name}.wasm"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}. Build the policy plugins first: scripts/build-plugins",
            path.display()
        )
    });
    let digest = bulkhead_gateway::policy::Digest::of(&bytes).to_string();
    (path, digest)
}

/// `[plugins.NAME]` for the built plugin `name`, its component and its schema pinned.
fn pinned(name: &str) -> String {
    let (path, digest) = component(name);
    let schema = std::fs::read(path.with_extension("schema.json")).expect("reads its schema");
    let schema = bulkhead_gateway::policy::Digest::of(&schema);
    format!(
        "[plugins.{name}]\ncomponent = {:?}\nsha256 = \"{digest}\"\nschema_sha256 = \"{schema}\"\n",
        path.display().to_string()
    )
}

/// The three built-ins; tenant-a is labelled with `tier`.
fn policy_set(dir: &Path, tier: &str) -> PathBuf {
    let mut text = String::new();
    for name in ["length-limit", "tenant-tag", "abort-guard"] {
        text.push_str(&pinned(name));
    }
    text.push_str(&format!(
        r#"
[[chain]]
plugin = "tenant-tag"
config = {{ echo = ["tier"], tenants = {{ tenant-a = {{ tier = "{tier}" }}, tenant-metered = {{ tier = "bronze" }} }} }}

[[chain]]
plugin = "length-limit"
config = {{ tenants = {{ tenant-b = {{ max_prompt_tokens = 10 }} }}, routes = {{ "/v1/completions" = {{ max_total_tokens = 24 }} }} }}

[[chain]]
plugin = "abort-guard"
tenants = ["tenant-a"]
config = {{ max_held_per_tenant = 4 }}

[[chain]]
plugin = "abort-guard"
tenants = ["tenant-limited"]
config = {{ max_held_per_tenant = 0 }}
"#,
    ));
    let path = dir.join("policies.toml");
    std::fs::write(&path, text).expect("writes the policy set");
    path
}

/// `bulkhead up` with the policy set file `file`. Its hold limit is longer than the default
/// 30 s: a held prefill of the long prompt below took more than 30 s on a loaded CI machine,
/// and the limit then cut it before its first token.
fn with_policies(file: &Path) -> Up {
    let set = format!("file = {:?}", file.display().to_string());
    Up::launch(Options {
        replace: &[
            ("file = \"policies/local.toml\"", &set),
            (
                "hold_limit_secs = 30",
                &format!("hold_limit_secs = {HOLD_LIMIT_SECS}"),
            ),
        ],
        ..Options::default()
    })
}

/// The test gateway's hold limit; [`wait_for`] waits a little longer.
const HOLD_LIMIT_SECS: u64 = 100;

/// Sends a streaming chat request (keep-alive, so the gateway sees the socket close), waits
/// for the response head, then goes away.
pub(crate) fn abandon(addr: &str, key: &str, body: &str) {
    let mut s = open(addr, key, "/v1/chat/completions", body);
    let mut head = [0u8; 12];
    s.read_exact(&mut head).expect("the response starts");
    if !head.starts_with(b"HTTP/1.1 200") {
        let mut rest = String::new();
        let _ = s.read_to_string(&mut rest);
        panic!("{}{rest}", String::from_utf8_lossy(&head));
    }
    drop(s);
}

fn wait_for(up: &Up, series: &str, at_least: u64) -> String {
    let deadline = Instant::now() + Duration::from_secs(HOLD_LIMIT_SECS + 15);
    loop {
        let m = up.metrics();
        if metric(&m, series) >= at_least {
            return m;
        }
        assert!(
            Instant::now() < deadline,
            "{series} never reached {at_least}:\n{m}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn policies_deny_clamp_label_and_hold_an_abandoned_request_until_its_first_token() {
    bounded(|| {
        let dir = TempDir::new("policies");
        let up = with_policies(&policy_set(&dir.0, "gold"));
        up.wait_routable();

        // tenant-b's prompts are limited to 10 tokens (the chat template alone is more).
        let question = r#"{"messages":[{"role":"user","content":"What is 2+2?"}],"max_tokens":8,"temperature":0}"#;
        let (status, _, body) = exchange(
            &up.api,
            "POST",
            "/v1/chat/completions",
            Some(KEY_B),
            &[],
            question,
        );
        assert_eq!(status, 400, "{body}");
        assert_eq!(json(&body)["error"]["code"], "policy_denied", "{body}");
        // Its record names the plugin that refused, which code it was, and what came before.
        let record = up.wait_records("tenant-b", 1).pop().expect("its record");
        let decisions = &record["bulkhead.policy.decisions"];
        assert_eq!(decisions[0]["plugin"], "tenant-tag", "{record:#}");
        assert_eq!(decisions[0]["verdict"]["kind"], "mutate", "{record:#}");
        assert_eq!(decisions[1]["plugin"], "length-limit", "{record:#}");
        assert_eq!(
            decisions[1]["digest"],
            component("length-limit").1,
            "{record:#}"
        );
        assert_eq!(
            decisions[1]["verdict"],
            json!({"kind": "deny", "status": 400}),
            "{record:#}"
        );

        // tenant-a passes, labelled (the tier echoed as a header).
        let (status, head, body) = exchange(
            &up.api,
            "POST",
            "/v1/chat/completions",
            Some(KEY_A),
            &[],
            question,
        );
        assert_eq!(status, 200, "{body}");
        assert_eq!(header(&head, "x-bulkhead-tier"), Some("gold"), "{head}");
        // The labels are in its audit record, with the plugin that attached them.
        let record = up.wait_records("tenant-a", 1).pop().expect("its record");
        let tagged = &record["bulkhead.policy.decisions"][0];
        assert_eq!(tagged["plugin"], "tenant-tag", "{record:#}");
        assert_eq!(
            tagged["tags"],
            json!([{"key": "tenant", "value": "tenant-a"}, {"key": "tier", "value": "gold"}]),
            "{record:#}"
        );

        // /v1/completions: prompt + max tokens clamped to 24 in all, and the answer says so.
        let counting = r#"{"prompt":"1, 2, 3, 4, 5,","max_tokens":200,"temperature":0}"#;
        let (status, head, body) = exchange(
            &up.api,
            "POST",
            "/v1/completions",
            Some(KEY_A),
            &[],
            counting,
        );
        assert_eq!(status, 200, "{body}");
        let usage = &json(&body)["usage"];
        let total = usage["total_tokens"].as_u64().expect("usage");
        assert!(total <= 24, "clamped to 24 tokens in all: {usage}");
        assert!(usage["completion_tokens"].as_u64() > Some(1), "{usage}");
        let clamped = header(&head, "x-bulkhead-clamped-max-tokens");
        let prompt = usage["prompt_tokens"].as_u64().expect("usage");
        assert_eq!(
            clamped.and_then(|v| v.parse::<u64>().ok()),
            Some(24 - prompt),
            "{head}"
        );
        // Refused after the policies allowed it (its 24 tokens are past the tenant's 20 a
        // minute): the error still says what they did.
        let (status, head, body) = exchange(
            &up.api,
            "POST",
            "/v1/completions",
            Some(KEY_METERED),
            &[],
            counting,
        );
        assert_eq!(status, 400, "{body}");
        assert_eq!(json(&body)["error"]["code"], "request_too_large", "{body}");
        assert_eq!(header(&head, "x-bulkhead-tier"), Some("bronze"), "{head}");
        assert_eq!(
            header(&head, "x-bulkhead-clamped-max-tokens"),
            clamped,
            "{head}"
        );

        // A long prompt, abandoned during prefill. tenant-a's abort guard holds the stream
        // until the first token; the control tenant's cancels at once.
        let long = format!(
            r#"{{"messages":[{{"role":"user","content":"Summarize: {}"}}],"max_tokens":64,"stream":true,"temperature":0}}"#,
            "the quick brown fox jumps over the lazy dog. ".repeat(120)
        );
        abandon(&up.api, KEY_A, &long);
        let m = wait_for(
            &up,
            "bulkhead_policy_abandoned_dropped_total{at=\"after_first_token\"}",
            1,
        );
        assert_eq!(
            metric(
                &m,
                "bulkhead_policy_abandoned_total{directive=\"hold_until_prefill_done\"}"
            ),
            1,
            "{m}"
        );
        assert_eq!(
            metric(
                &m,
                "bulkhead_policy_abandoned_dropped_total{at=\"before_first_token\"}"
            ),
            0,
            "{m}"
        );
        // The worker then saw a clean cancel: every page is back, nothing runs.
        up.wait_pool_drained();
        let held = up.wait_records("tenant-a", 3);
        let record = held.last().expect("the abandoned request's record");
        assert_eq!(record["error.type"], "client_disconnected", "{record:#}");
        assert_eq!(record["bulkhead.disconnect.phase"], "prefill", "{record:#}");
        // The record is written once the hold ended, and says how the stream was held.
        let hold = &record["bulkhead.disconnect.hold"];
        assert_eq!(hold["directive"], "hold_until_prefill_done", "{record:#}");
        assert_eq!(hold["dropped"], "after_first_token", "{record:#}");
        // The one token the hold waited for came, after decode verified the KV handoff: the
        // record counts it (what the tenant is charged) and says the handoff passed.
        assert_eq!(record["gen_ai.usage.output_tokens"], 1, "{record:#}");
        assert_eq!(
            record["bulkhead.kv.integrity"]["result"], "passed",
            "{record:#}"
        );
        // Every admission layer let it through, the last the prefill worker's.
        assert_eq!(
            record["bulkhead.admission"]["layer"], "prefill",
            "{record:#}"
        );
        let before = up.admin_records("tenant-limited").len();
        abandon(&up.api, KEY_CONTROL, &long);
        let m = wait_for(
            &up,
            "bulkhead_policy_abandoned_dropped_total{at=\"before_first_token\"}",
            1,
        );
        assert_eq!(
            metric(
                &m,
                "bulkhead_policy_abandoned_total{directive=\"abort_now\"}"
            ),
            1,
            "{m}"
        );
        up.wait_pool_drained();
        let record = up
            .wait_records("tenant-limited", before + 1)
            .pop()
            .expect("its record");
        let hold = &record["bulkhead.disconnect.hold"];
        assert_eq!(hold["directive"], "abort_now", "{record:#}");
        assert_eq!(hold["dropped"], "before_first_token", "{record:#}");
        assert!(record["gen_ai.usage.output_tokens"].is_null(), "{record:#}");
        assert_eq!(
            record["bulkhead.kv.integrity"]["result"], "not_checked",
            "{record:#}"
        );

        // The set in force, as the admin listener reports it.
        let (status, body) = http(&up.admin, "GET", "/policies", Some(ADMIN), &[], "");
        assert_eq!(status, 200, "{body}");
        assert_eq!(
            json(&body)["chain"].as_array().map(Vec::len),
            Some(4),
            "{body}"
        );
        assert_eq!(json(&body)["warnings"], json!([]), "{body}");
    });
}

#[test]
fn a_reload_under_load_swaps_the_set_without_failing_a_request() {
    bounded(|| {
        let dir = TempDir::new("reload");
        let file = policy_set(&dir.0, "gold");
        let up = Arc::new(with_policies(&file));
        up.wait_routable();

        // Two clients keep sending; each answer's status and tier label is kept in order.
        let stop = Arc::new(AtomicBool::new(false));
        let clients: Vec<_> = (0..2)
            .map(|_| {
                let (up, stop) = (up.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut seen = Vec::new();
                    while !stop.load(Ordering::Relaxed) {
                        let (status, head, body) = exchange(
                            &up.api,
                            "POST",
                            "/v1/completions",
                            Some(KEY_A),
                            &[],
                            r#"{"prompt":"Hi","max_tokens":1,"temperature":0}"#,
                        );
                        seen.push((
                            status,
                            header(&head, "x-bulkhead-tier").map(str::to_owned),
                            body,
                        ));
                    }
                    seen
                })
            })
            .collect();

        let reload = || {
            let (status, body) = http(&up.admin, "POST", "/policies/reload", Some(ADMIN), &[], "");
            (status, json(&body))
        };
        for tier in ["t1", "t2", "t3"] {
            std::thread::sleep(Duration::from_millis(400));
            policy_set(&dir.0, tier);
            let (status, answer) = reload();
            assert_eq!(
                (status, &answer["reloaded"]),
                (200, &json!(true)),
                "{answer}"
            );
        }
        // A broken set (a wrong pin) is refused and the last good one stays.
        std::thread::sleep(Duration::from_millis(400));
        let text = std::fs::read_to_string(&file).expect("reads the set");
        let (_, digest) = component("tenant-tag");
        std::fs::write(&file, text.replace(&digest, &"0".repeat(64))).expect("breaks the set");
        let (status, refused) = reload();
        assert_eq!(status, 422, "{refused}");
        assert!(
            refused["error"]
                .as_str()
                .is_some_and(|e| e.contains("pins 0000")),
            "{refused}"
        );
        std::thread::sleep(Duration::from_millis(400));
        stop.store(true, Ordering::Relaxed);

        let seen: Vec<_> = clients
            .into_iter()
            .flat_map(|c| c.join().expect("a client"))
            .collect();
        let failed: Vec<_> = seen
            .iter()
            .filter(|(status, _, _)| *status != 200)
            .collect();
        assert!(
            failed.is_empty(),
            "{} of {} failed: {failed:?}",
            failed.len(),
            seen.len()
        );
        let tiers: std::collections::BTreeSet<_> = seen
            .iter()
            .filter_map(|(_, tier, _)| tier.as_deref())
            .collect();
        assert!(tiers.contains("gold") && tiers.contains("t3"), "{tiers:?}");
        assert!(
            seen.iter().all(|(_, tier, _)| tier.is_some()),
            "every answer was labelled by one complete set"
        );
        let (_, head, _) = exchange(
            &up.api,
            "POST",
            "/v1/completions",
            Some(KEY_A),
            &[],
            r#"{"prompt":"Hi","max_tokens":1,"temperature":0}"#,
        );
        assert_eq!(header(&head, "x-bulkhead-tier"), Some("t3"), "{head}");

        // A set naming a tenant the tenants file does not list loads (the tenant may come),
        // and says that binding applies to no one.
        let typo = text.replace("\"tenant-limited\"", "\"tenant-limted\"");
        assert_ne!(typo, text);
        std::fs::write(&file, typo).expect("writes the set");
        let (status, answer) = reload();
        assert_eq!(status, 200, "{answer}");
        let warnings = answer["policies"]["warnings"].to_string();
        assert!(
            warnings.contains(r#"tenant \"tenant-limted\" is not in the tenants file"#),
            "{answer}"
        );
    });
}

/// A whole (not streamed) answer that outlasts the gateway's request timeout: the client gets
/// 504, and the request counts as failed, not as abandoned by its client. The abort guard is
/// never asked for a directive (it could hold the worker's stream on after the 504), and the
/// worker's stream is cancelled.
#[test]
fn a_whole_answer_past_the_request_timeout_fails_and_is_not_held_as_abandoned() {
    bounded(|| {
        let up = Up::launch(Options {
            replace: &[("request_timeout_secs = 300", "request_timeout_secs = 3")],
            ..Options::default()
        });
        up.wait_routable();
        // Greedy, this prompt runs to max_tokens: about a thousand tokens, far past 3 s.
        let body = r#"{"messages":[{"role":"user","content":"Repeat the word hello 3000 times."}],"max_tokens":1000,"temperature":0}"#;
        let started = Instant::now();
        let (status, reply) = up.chat(KEY_A, &[], body);
        assert_eq!(status, 504, "{reply}");
        assert_eq!(json(&reply)["error"]["code"], "timeout", "{reply}");
        assert!(started.elapsed() < Duration::from_secs(30));
        // The worker started answering before the deadline (so the request had started).
        let m = up.metrics();
        assert_eq!(
            metric(
                &m,
                r#"bulkhead_gateway_ttft_seconds_count{tenant="tenant-a"}"#
            ),
            1,
            "{m}"
        );
        // Whatever a disconnect would have asked, it would have by now.
        std::thread::sleep(Duration::from_secs(2));
        let m = up.metrics();
        let calls = |hook: &str| {
            m.lines().any(|l| {
                l.starts_with("bulkhead_policy_call_duration_seconds_count")
                    && l.contains(&format!("hook=\"{hook}\""))
            })
        };
        assert!(calls("on-request"), "the chain's calls are counted:\n{m}");
        assert!(
            !calls("on-disconnect"),
            "no disconnect directive was asked for:\n{m}"
        );
        let records = up.wait_records("tenant-a", 1);
        let last = records.last().expect("a record");
        assert_eq!(last["http.response.status_code"], 504, "{last}");
        assert_eq!(last["error.type"], "timeout", "{last}");
        assert!(last["bulkhead.disconnect.phase"].is_null(), "{last}");
        assert!(last["bulkhead.disconnect.hold"].is_null(), "{last}");
    });
}

/// A request its client abandoned is still its tenant's while the abort guard holds its
/// stream: it keeps its concurrency slot until the stream is dropped, and is then charged its
/// prompt and the tokens that came, not its whole `max_tokens`.
#[test]
fn an_abandoned_request_keeps_its_slot_while_held_and_is_charged_what_it_used() {
    bounded(|| {
        // tenant-a: one request at a time, 4000 tokens a minute (about 67 a second).
        let up = Up::launch(Options {
            replace: &[
                ("max_concurrent = 8", "max_concurrent = 1"),
                ("tokens_per_minute = 1000000", "tokens_per_minute = 4000"),
            ],
            ..Options::default()
        });
        up.wait_routable();
        // About 1200 prompt tokens + 2500: charged about 3700 of the minute's 4000.
        let long = format!(
            r#"{{"messages":[{{"role":"user","content":"Summarize: {}"}}],"max_tokens":2500,"stream":true,"temperature":0}}"#,
            "the quick brown fox jumps over the lazy dog. ".repeat(120)
        );
        // The worker is stopped mid-prefill (the response head comes before the first token),
        // so the guard's hold lasts until the test lets it go on.
        let mut s = open(&up.api, KEY_A, "/v1/chat/completions", &long);
        let mut head = [0u8; 12];
        s.read_exact(&mut head).expect("the response starts");
        assert!(head.starts_with(b"HTTP/1.1 200"), "{head:?}");
        up.signal_worker("-STOP");
        drop(s);
        let m = wait_for(
            &up,
            "bulkhead_policy_abandoned_total{directive=\"hold_until_prefill_done\"}",
            1,
        );
        assert_eq!(
            metric(
                &m,
                "bulkhead_policy_abandoned_dropped_total{at=\"before_first_token\"}"
            ) + metric(
                &m,
                "bulkhead_policy_abandoned_dropped_total{at=\"after_first_token\"}"
            ),
            0,
            "still held:\n{m}"
        );
        // Held, it still takes tenant-a's one slot.
        let question = r#"{"messages":[{"role":"user","content":"What is 2+2?"}],"max_tokens":2000,"temperature":0}"#;
        let (status, body) = up.chat(KEY_A, &[], question);
        up.signal_worker("-CONT");
        assert_eq!(status, 429, "{body}");
        assert!(body.contains("in flight"), "{body}");
        // The hold ends (at the first token, or at the hold limit) and the slot comes back.
        let deadline = Instant::now() + Duration::from_secs(90);
        while up.in_flight("tenant-a") > 0 {
            assert!(Instant::now() < deadline, "the held request never let go");
            std::thread::sleep(Duration::from_millis(100));
        }
        // Charged in full, the abandoned request would leave about 300 of the minute's 4000:
        // this request (about 30 prompt tokens + 2000) would get 429 for most of a minute.
        let (status, body) = up.chat(KEY_A, &[], question);
        assert_eq!(status, 200, "{body}");
    });
}

/// A policy set of `abort-guard` (4 held a tenant) and then `ledger` bound as `ledger` says
/// (its binding's lines), written in `dir`: the configuration line that names it.
pub(crate) fn guard_and_ledger(dir: &Path, ledger: &str) -> String {
    let mut set = String::new();
    for name in ["abort-guard", "ledger"] {
        set.push_str(&pinned(name));
    }
    set.push_str(&format!(
        "\n[[chain]]\nplugin = \"abort-guard\"\nconfig = {{ max_held_per_tenant = 4 }}\n\n\
         [[chain]]\nplugin = \"ledger\"\n{ledger}\n"
    ));
    let file = dir.join("policies.toml");
    std::fs::write(&file, set).expect("writes the policy set");
    format!("file = {:?}", file.display().to_string())
}

/// A request whose client leaves while it waits in the worker's queue (the worker has not
/// answered its call) is still under its policies: `on-disconnect` hears the phase `queued`
/// and its directive is kept — here a hold until complete, so the worker runs it to the end —
/// and every request the chain let through ends in `on-response-end`, a refusal after the
/// chain (tokens per minute) as `failed`.
#[test]
fn a_request_abandoned_in_the_workers_queue_is_held_as_its_policies_say_and_every_end_is_heard() {
    bounded(|| {
        let dir = TempDir::new("ledger");
        let set = guard_and_ledger(
            &dir.0,
            "tenants = [\"tenant-a\"]\n\
             config = { on_disconnect = \"hold-until-complete\", phases = [\"queued\"] }",
        );
        let up = Up::launch(Options {
            args: &["--decode-kv-tokens", "1024"],
            replace: &[
                ("file = \"policies/local.toml\"", &set),
                // tenant-a's table comes first: 1000 tokens a minute.
                ("tokens_per_minute = 1000000", "tokens_per_minute = 1000"),
            ],
            ..Options::default()
        });
        up.wait_routable();
        let holding = a_long_answer_holding_decode(&up);
        // tenant-a's request waits in decode's queue, and its client leaves.
        let queued = open(&up.api, KEY_A, "/v1/chat/completions", QUEUED_BEHIND);
        std::thread::sleep(Duration::from_millis(1500));
        drop(queued);
        // abort-guard says abort-now for a queued request, ledger hold-until-complete (for a
        // queued one only: the hold shows the phase the plugins were told): the longer hold
        // is kept.
        let m = wait_for(
            &up,
            "bulkhead_policy_abandoned_total{directive=\"hold_until_complete\"}",
            1,
        );
        let disconnects = |plugin: &str| {
            format!(
                "bulkhead_policy_call_duration_seconds_count{{plugin=\"{plugin}\",hook=\"on-disconnect\"}}"
            )
        };
        assert_eq!(metric(&m, &disconnects("ledger")), 1, "{m}");
        assert_eq!(metric(&m, &disconnects("abort-guard")), 1, "{m}");
        // The holder goes (abort-guard alone: abort-now while decoding), its pages come back,
        // and the held request leaves the queue and runs to its end.
        drop(holding);
        let record = up.wait_records("tenant-a", 1).pop().expect("its record");
        assert_eq!(record["error.type"], "client_disconnected", "{record:#}");
        let hold = &record["bulkhead.disconnect.hold"];
        assert_eq!(hold["directive"], "hold_until_complete", "{record:#}");
        assert_eq!(hold["dropped"], "after_done", "{record:#}");
        // Over the minute's tokens (what the held request used is charged): refused after the
        // chain let it through, it ends in on-response-end too.
        let over = r#"{"messages":[{"role":"user","content":"Say hello."}],"max_tokens":960,"temperature":0}"#;
        let (status, body) = up.chat(KEY_A, &[], over);
        assert_eq!(status, 429, "{body}");
        let ends = "bulkhead_policy_call_duration_seconds_count{plugin=\"ledger\",hook=\"on-response-end\"}";
        let m = wait_for(&up, ends, 2);
        assert_eq!(
            metric(&m, ends),
            2,
            "the held request and the refused one:\n{m}"
        );
        up.wait_pool_drained();
    });
}

/// A disaggregated request whose client leaves while prefill's KV is on its way to decode is
/// in the phase `transferring` for its `on-disconnect` policies (here `ledger` holds only such
/// a request until complete) and `before_first_token` in its audit record. The transfer is
/// stuck (prefill stalls after one frame) until decode's transfer deadline fails it.
#[test]
fn a_client_gone_while_the_kv_transfers_is_told_to_policies_as_transferring() {
    bounded(|| {
        let dir = TempDir::new("transferring");
        let set = guard_and_ledger(
            &dir.0,
            "config = { on_disconnect = \"hold-until-complete\", phases = [\"transferring\"] }",
        );
        let cluster = Cluster::start(Spec {
            prefill: &[
                "--transfer-batch-bytes",
                "1",
                "--fault-stall-after-frames",
                "1",
            ],
            decode: &[
                "--transfer-timeout-ms",
                "8000",
                "--release-timeout-ms",
                "500",
            ],
            replace: &[("file = \"policies/local.toml\"", &set)],
            ..Spec::default()
        });
        let body = r#"{"messages":[{"role":"user","content":"Tell me about the harbour town and its ships."}],"max_tokens":8,"stream":true,"temperature":0}"#;
        let mut client = open(cluster.api(), KEY_A, "/v1/chat/completions", body);
        let mut head = [0u8; 12];
        client.read_exact(&mut head).expect("the response starts");
        assert!(head.starts_with(b"HTTP/1.1 200"), "{head:?}");
        // Stuck mid-transfer: decode receives, prefill said the prompt was computed. The
        // client goes.
        let deadline = Instant::now() + Duration::from_secs(90);
        while crate::worker_grpc::metric(
            &cluster.decode.metrics(),
            "bulkhead_kv_transfers_in_flight{side=\"receive\"}",
        ) < 1.0
        {
            assert!(Instant::now() < deadline, "no transfer under way");
            std::thread::sleep(Duration::from_millis(50));
        }
        // Time for decode's word to cross to the gateway on a loaded machine; the gateway
        // notices the client gone at its next keep-alive comment (within a second).
        std::thread::sleep(Duration::from_millis(2000));
        drop(client);

        let held = "bulkhead_policy_abandoned_total{directive=\"hold_until_complete\"}";
        let deadline = Instant::now() + Duration::from_secs(30);
        while metric(&cluster.gateway_metrics(), held) < 1 {
            assert!(
                Instant::now() < deadline,
                "ledger was not told transferring:\n{}",
                cluster.gateway_metrics()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        let record = wait_records(&cluster.gateway.admin, "tenant-a", 1)
            .pop()
            .expect("its record");
        assert_eq!(record["error.type"], "client_disconnected", "{record:#}");
        assert_eq!(
            record["bulkhead.disconnect.phase"], "before_first_token",
            "{record:#}"
        );
        let hold = &record["bulkhead.disconnect.hold"];
        assert_eq!(hold["directive"], "hold_until_complete", "{record:#}");
        assert_eq!(hold["dropped"], "before_first_token", "{record:#}");
        // The hold ended with decode's transfer deadline: the worker failed it, as it says.
        assert_eq!(hold["failed"], "service_unavailable", "{record:#}");
    });
}

/// Shutdown waits for a request held after its client left, up to its drain timeout, then
/// cuts the hold: the gateway exits cleanly, and the request's record, written before it
/// exits, says its client left, that shutdown ended its hold, and the tokens that came; its
/// `on-response-end` ran. (Before, shutdown dropped the hold: the record lost the hold and
/// the tokens, the tenant was refunded them, and `on-response-end` never ran.)
#[test]
fn shutdown_waits_for_a_held_request_then_cuts_it_and_records_how_far_it_got() {
    bounded(|| {
        let dir = TempDir::new("shutdown-hold");
        let set = guard_and_ledger(
            &dir.0,
            "config = { on_disconnect = \"hold-until-complete\", phases = [\"decoding\"] }",
        );
        let mut cluster = Cluster::start(Spec {
            replace: &[
                ("file = \"policies/local.toml\"", &set),
                ("drain_timeout_secs = 10", "drain_timeout_secs = 2"),
            ],
            env: &[("BULKHEAD_LOG", "warn,bulkhead_gateway::policy::host=info")],
            ..Spec::default()
        });
        // Counting on for 900 tokens (seconds of decode): left after its first events.
        let counting = r#"{"prompt":"1, 2, 3, 4, 5, 6, 7, 8, 9, 10,","max_tokens":900,"temperature":0,"stream":true}"#;
        let mut client = open(cluster.api(), KEY_A, "/v1/completions", counting);
        let mut seen = String::new();
        let mut buf = [0u8; 4096];
        while seen.matches("data:").count() < 3 {
            let n = client.read(&mut buf).expect("the answer streams");
            assert!(n > 0, "the answer ended early: {seen}");
            seen.push_str(&String::from_utf8_lossy(&buf[..n]));
        }
        drop(client);
        let held = "bulkhead_policy_abandoned_total{directive=\"hold_until_complete\"}";
        let deadline = Instant::now() + Duration::from_secs(30);
        while metric(&cluster.gateway_metrics(), held) < 1 {
            assert!(Instant::now() < deadline, "the request was not held");
            std::thread::sleep(Duration::from_millis(50));
        }
        let stopping = Instant::now();
        let sent = std::process::Command::new("kill")
            .args(["-TERM", &cluster.gateway.child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(sent.success());
        let (status, exited) = loop {
            if let Some(status) = cluster.gateway.child.try_wait().expect("waits") {
                break (status, stopping.elapsed());
            }
            assert!(
                stopping.elapsed() < Duration::from_secs(30),
                "the gateway did not exit"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(status.success(), "{status}");
        assert!(
            exited >= Duration::from_secs(2),
            "shutdown did not wait for the hold: {exited:?}"
        );
        let records = crate::up::on_disk(&cluster.data_dir(), "tenant-a");
        let record = records.last().expect("its record");
        assert_eq!(record["error.type"], "client_disconnected", "{record:#}");
        let hold = &record["bulkhead.disconnect.hold"];
        assert_eq!(hold["directive"], "hold_until_complete", "{record:#}");
        assert_eq!(hold["dropped"], "after_first_token", "{record:#}");
        assert_eq!(hold["failed"], "gateway_shutdown", "{record:#}");
        let came = record["gen_ai.usage.output_tokens"]
            .as_u64()
            .expect("the tokens that came");
        assert!(came >= 3, "{record:#}");
        let id = record["bulkhead.request.id"].as_str().expect("an id");
        let log = crate::worker_grpc::text_of(&cluster.gateway.log);
        assert!(
            log.contains(&format!("end {id} client-disconnected")),
            "on-response-end did not run:\n{log}"
        );
    });
}
