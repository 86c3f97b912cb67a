//! The audit log end to end (invariants I5, I6): every request through the real gateway leaves
//! exactly one record in its own tenant's log, each tenant reads only its own, the chain
//! verifies, and a `kill -9` under load loses nothing that was answered.

use std::collections::HashSet;
use std::io::Read;
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::gateway::QUESTION;
use crate::up::{
    ADMIN, KEY_A, KEY_B, Options, TempDir, Up, a_long_answer_holding_decode, bounded, exchange,
    header, http, json, on_disk, records, send,
};

/// `GET /v1/audit` with `key`: the records (`data`) of the page.
fn audit_page(up: &Up, key: &str, query: &str) -> Value {
    let (status, body) = http(
        &up.api,
        "GET",
        &format!("/v1/audit{query}"),
        Some(key),
        &[],
        "",
    );
    assert_eq!(status, 200, "{body}");
    json(&body)
}

/// `bulkhead audit verify DIR`: (passed, output).
fn verify(dir: &Path) -> (bool, String) {
    verify_with(dir, &[])
}

/// `bulkhead audit verify DIR ARGS…`: (passed, output).
fn verify_with(dir: &Path, args: &[&std::ffi::OsStr]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_bulkhead"))
        .args(["audit", "verify"])
        .arg(dir)
        .args(args)
        .output()
        .expect("bulkhead audit verify runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn every_request_leaves_one_record_in_its_tenants_log_that_only_it_can_read() {
    bounded(|| {
        let up = Up::start(&[]);
        up.wait_routable();
        let canary = format!("canary-{:016x}", rand::random::<u64>());

        // Tenant A: a completion, a stream, a malformed body, an over-long request, an unknown
        // model, an unknown path and a path asked with the wrong method.
        let (status, head, body) = exchange(
            &up.api,
            "POST",
            "/v1/chat/completions",
            Some(KEY_A),
            &[],
            QUESTION,
        );
        assert_eq!(status, 200, "{body}");
        let request_id = header(&head, "x-request-id")
            .expect("x-request-id")
            .to_owned();
        let response_id = json(&body)["id"].as_str().expect("id").to_owned();
        assert_eq!(
            response_id.trim_start_matches("chatcmpl-"),
            request_id.trim_start_matches("req-"),
            "the response's id is the request's"
        );
        let stream = r#"{"messages":[{"role":"user","content":"What is 2+2?"}],"max_tokens":8,"stream":true,"stream_options":{"include_usage":true}}"#;
        let (status, body) = up.chat(KEY_A, &[], stream);
        assert_eq!(status, 200);
        assert!(body.contains("[DONE]"), "{body}");
        assert_eq!(up.chat(KEY_A, &[], "{not json").0, 400);
        let long = format!(
            r#"{{"messages":[{{"role":"user","content":"{}"}}],"max_tokens":16}}"#,
            "hello ".repeat(9000)
        );
        assert_eq!(up.chat(KEY_A, &[], &long).0, 400);
        let other_model = r#"{"model":"gpt-9","messages":[{"role":"user","content":"hi"}]}"#;
        assert_eq!(up.chat(KEY_A, &[], other_model).0, 404);
        assert_eq!(
            http(&up.api, "GET", "/v1/nothing", Some(KEY_A), &[], "").0,
            404
        );
        let (status, body) = http(&up.api, "GET", "/v1/chat/completions", Some(KEY_A), &[], "");
        assert_eq!(status, 405, "{body}");
        assert_eq!(json(&body)["error"]["code"], "method_not_allowed", "{body}");
        // No tenant to charge: the gateway's own log.
        assert_eq!(up.chat("sk-wrong", &[], QUESTION).0, 401);
        assert_eq!(http(&up.api, "GET", "/v1/models", None, &[], "").0, 401);
        // Tenant B: a prompt carrying a canary, then a client that leaves mid-stream.
        let b_prompt = format!(
            r#"{{"messages":[{{"role":"user","content":"Repeat: {canary}"}}],"max_tokens":8}}"#
        );
        assert_eq!(up.chat(KEY_B, &[], &b_prompt).0, 200);
        let long_stream = r#"{"messages":[{"role":"user","content":"Tell me a long story."}],"max_tokens":400,"stream":true}"#;
        let mut s = send(
            &up.api,
            "POST",
            "/v1/chat/completions",
            Some(KEY_B),
            &[],
            long_stream,
        );
        let mut seen = Vec::new();
        let mut buf = [0u8; 1024];
        while !String::from_utf8_lossy(&seen).contains("data:") {
            let n = s.read(&mut buf).expect("the stream starts");
            assert!(n > 0, "the stream ended early");
            seen.extend_from_slice(&buf[..n]);
        }
        drop(s);

        // A's log: exactly its seven requests, in order, with their outcomes.
        let a = up.wait_records("tenant-a", 7);
        let outcome: Vec<(u64, Option<&str>)> = a
            .iter()
            .map(|r| {
                (
                    r["http.response.status_code"].as_u64().unwrap_or(0),
                    r["error.type"].as_str(),
                )
            })
            .collect();
        assert_eq!(
            outcome,
            [
                (200, None),
                (200, None),
                (400, Some("invalid_request_error")),
                (400, Some("context_length_exceeded")),
                (404, Some("model_not_found")),
                (404, Some("not_found")),
                (405, Some("method_not_allowed")),
            ],
            "{a:#?}"
        );
        let first = &a[0];
        assert_eq!(first["bulkhead.request.id"], request_id.as_str());
        assert_eq!(first["bulkhead.tenant.id"], "tenant-a");
        assert_eq!(
            first["bulkhead.key.id"],
            bulkhead_gateway::keys::KeyHash::of(KEY_A).id().as_str()
        );
        assert_eq!(first["http.route"], "/v1/chat/completions");
        assert_eq!(first["bulkhead.admission"]["outcome"], "admitted");
        assert_eq!(
            first["bulkhead.admission"]["layer"], "prefill",
            "disaggregated: prefill admits last"
        );
        assert_eq!(first["bulkhead.workers"]["decode"], "local-decode");
        assert_eq!(first["bulkhead.workers"]["prefill"], "local-prefill");
        assert_eq!(first["bulkhead.kv.integrity"]["result"], "passed");
        assert!(first["gen_ai.usage.output_tokens"].as_u64().unwrap_or(0) > 0);
        assert!(first["bulkhead.ttft_ms"].is_u64());
        assert!(first["bulkhead.completion.sha256"].is_string());
        assert!(
            first.get("bulkhead.prompt.content").is_none(),
            "no capture by default"
        );
        assert_eq!(a[3]["bulkhead.admission"]["outcome"], "rejected");
        assert_eq!(a[3]["bulkhead.admission"]["layer"], "gateway");
        assert_eq!(a[3]["bulkhead.kv.integrity"]["result"], "not_checked");

        // B's log: the canary's request (hashed, not stored) and the disconnect.
        let b = up.wait_records("tenant-b", 2);
        assert_eq!(b.len(), 2, "{b:#?}");
        assert_eq!(b[1]["bulkhead.disconnect.phase"], "decode", "{:#?}", b[1]);
        assert_eq!(b[1]["error.type"], "client_disconnected");
        assert!(
            b[1]["gen_ai.usage.output_tokens"].as_u64() >= Some(1),
            "the tokens that came are counted: {:#?}",
            b[1]
        );
        assert_eq!(b[1]["bulkhead.kv.integrity"]["result"], "passed");
        let all_a = serde_json::to_string(&a).expect("json");
        assert!(!all_a.contains(&canary), "B's canary in A's log");
        assert!(
            !serde_json::to_string(&b).expect("json").contains(&canary),
            "prompts are hashed, not stored, without capture"
        );
        let gateway = up.admin_records("_gateway");
        assert_eq!(gateway.len(), 2, "{gateway:#?}");
        assert!(
            gateway
                .iter()
                .all(|r| r["http.response.status_code"] == 401)
        );

        // Reading: a tenant sees only its own records, whatever it sends.
        let page = audit_page(&up, KEY_B, "");
        assert_eq!(page["tenant"], "tenant-b");
        assert!(records(&page).len() >= b.len(), "B's own records: {page}");
        assert!(
            records(&page)
                .iter()
                .all(|r| r["bulkhead.tenant.id"] == "tenant-b")
        );
        let (status, body) = http(
            &up.api,
            "GET",
            "/v1/audit?tenant=tenant-a",
            Some(KEY_B),
            &[],
            "",
        );
        assert_eq!(
            status, 400,
            "a tenant parameter is refused, not ignored: {body}"
        );
        assert!(!body.contains("tenant-a\":"), "{body}");
        for path in [
            "/v1/audit/../audit/tenant-a",
            "/v1/audit/tenant-a",
            "/v1/audit%2F..%2Ftenant-a",
        ] {
            let (status, body) = http(&up.api, "GET", path, Some(KEY_B), &[], "");
            assert_ne!(status, 200, "{path}: {body}");
            assert!(!body.contains(&request_id), "{path}: {body}");
        }
        // A cursor from A's pages names a place in B's own chain, nothing of A's.
        let a_cursor = audit_page(&up, KEY_A, "?limit=2")["next_since"]
            .as_u64()
            .expect("cursor");
        let page = audit_page(&up, KEY_B, &format!("?since={a_cursor}&limit=1000"));
        assert!(
            !records(&page).is_empty(),
            "B's chain reaches past it: {page}"
        );
        assert!(
            records(&page)
                .iter()
                .all(|r| r["bulkhead.tenant.id"] == "tenant-b")
        );
        let a_page = audit_page(&up, KEY_A, "?limit=3");
        assert_eq!(records(&a_page).len(), 3);
        assert_eq!(a_page["has_more"], true);
        // Each entry carries its line's digest, the anchor a tenant keeps: the same on a reread.
        let digests = |page: &Value| -> Vec<String> {
            page["data"]
                .as_array()
                .expect("data")
                .iter()
                .map(|e| e["digest"].as_str().expect("a digest").to_owned())
                .collect()
        };
        let first = digests(&a_page);
        assert!(
            first
                .iter()
                .all(|d| d.len() == 64 && d.bytes().all(|b| b.is_ascii_hexdigit())),
            "{first:?}"
        );
        assert_eq!(first.iter().collect::<HashSet<_>>().len(), 3, "{first:?}");
        assert_eq!(digests(&audit_page(&up, KEY_A, "?limit=3")), first);
        // The admin listener: any tenant with its token; never with a tenant's key, nor with
        // a second Authorization header after the token (which one counts would be up to
        // whatever sits in front).
        assert_eq!(
            http(&up.admin, "GET", "/audit/tenant-b", Some(KEY_A), &[], "").0,
            401
        );
        let junk = [("Authorization", "Bearer x")];
        assert_eq!(
            http(&up.admin, "GET", "/audit/tenant-b", Some(ADMIN), &junk, "").0,
            401
        );
        // Every admin route, read or reload, with no token or a tenant's key.
        for (method, path) in [
            ("GET", "/healthz"),
            ("GET", "/metrics"),
            ("GET", "/workers"),
            ("GET", "/policies"),
            ("POST", "/policies/reload"),
            ("GET", "/tenants"),
            ("POST", "/tenants/reload"),
        ] {
            for key in [None, Some(KEY_A)] {
                let (status, body) = http(&up.admin, method, path, key, &[], "");
                assert_eq!(status, 401, "{method} {path} with {key:?}: {body}");
            }
        }
        // A configured tenant with no records yet is an empty page; a name that is neither
        // configured nor logged is 404, not an empty page a typo would pass for.
        let (status, body) = http(
            &up.admin,
            "GET",
            "/audit/tenant-limited",
            Some(ADMIN),
            &[],
            "",
        );
        assert_eq!(
            (status, json(&body)["data"].as_array().map(Vec::len)),
            (200, Some(0)),
            "{body}"
        );
        let (status, body) = http(&up.admin, "GET", "/audit/tenant-z", Some(ADMIN), &[], "");
        assert_eq!(status, 404, "{body}");
        assert_eq!(json(&body)["error"]["code"], "tenant_not_found");
        assert_eq!(
            http(
                &up.admin,
                "GET",
                "/audit/..%2Ftenant-b",
                Some(ADMIN),
                &[],
                ""
            )
            .0,
            400
        );
        // A name that is not UTF-8: refused in the API's shape too.
        let (status, body) = http(&up.admin, "GET", "/audit/%FF", Some(ADMIN), &[], "");
        assert_eq!(status, 400, "{body}");
        assert_eq!(json(&body)["error"]["param"], "tenant", "{body}");

        // The chain verifies while the gateway runs, and holds the lines a tenant's page named
        // (anchors: what shows a log rolled back to an older copy); one past its end it lacks.
        let (passed, report) = verify(&up.data_dir);
        assert!(passed, "{report}");
        let anchors: Vec<String> = a_page["data"]
            .as_array()
            .expect("data")
            .iter()
            .map(|e| {
                format!(
                    "tenant-a:{}:{}",
                    e["seq"],
                    e["digest"].as_str().expect("a digest")
                )
            })
            .collect();
        let anchored = |anchors: &[String]| {
            let args: Vec<&std::ffi::OsStr> = anchors
                .iter()
                .flat_map(|a| ["--anchor".as_ref(), a.as_ref()])
                .collect();
            verify_with(&up.data_dir, &args)
        };
        let (passed, report) = anchored(&anchors);
        assert!(passed, "{report}");
        let past_the_end = format!("tenant-a:1000000:{}", first[0]);
        let (passed, report) = anchored(&[past_the_end]);
        assert!(!passed && report.contains("rolled back"), "{report}");

        // The log breaks: a directory stands where a tenant's first segment must go, so its
        // first record cannot be written. That request is refused with 503, every request
        // after it too, and health says why.
        let blocked = up
            .data_dir
            .join("audit/tenant-limited")
            .join(format!("{:020}.jsonl", 0));
        std::fs::create_dir_all(&blocked).expect("blocks the segment");
        let tiny = r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":1}"#;
        let ends = |outcome: &str| {
            let series = format!("bulkhead_policy_response_ends_total{{outcome=\"{outcome}\"}}");
            crate::up::metric(&up.metrics(), &series)
        };
        let (completed, failed) = (ends("completed"), ends("failed"));
        let (status, body) = up.chat(crate::up::KEY_LIMITED, &[], tiny);
        assert_eq!(status, 503, "{body}");
        assert_eq!(json(&body)["error"]["code"], "audit_unavailable");
        // The worker's answer was not sent: its policies hear that it failed (they heard it
        // completed, and the client got 503).
        assert_eq!((ends("completed"), ends("failed")), (completed, failed + 1));
        let (status, body) = up.chat(KEY_A, &[], tiny);
        assert_eq!(status, 503, "no traffic is served unaudited: {body}");
        let (status, body) = http(&up.admin, "GET", "/healthz", Some(ADMIN), &[], "");
        assert_eq!(status, 503, "{body}");
        let health = json(&body);
        assert_eq!(health["status"], "audit_unavailable");
        assert!(
            health["audit"]["failure"]
                .as_str()
                .is_some_and(|f| f.contains("tenant-limited")),
            "{body}"
        );
    });
}

/// With a keyed log (`[audit] key_file`): recovery resumes the keyed chain, and `bulkhead audit
/// verify` passes it with the key only.
#[test]
fn kill_9_under_load_loses_no_answered_request_and_the_chain_continues() {
    bounded(|| {
        let data = TempDir::new("audit-crash");
        let key_file = data.0.join("audit-key");
        std::fs::write(&key_file, "0123456789abcdef0123456789abcdef\n").expect("writes the key");
        let keyed = format!("[audit]\nkey_file = {:?}\n", key_file.display().to_string());
        let up = Up::launch(Options {
            data_dir: Some(data.0.clone()),
            replace: &[("[audit]\n", &keyed)],
            ..Options::default()
        });
        up.wait_routable();
        let answered = Arc::new(Mutex::new(Vec::<String>::new()));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let clients: Vec<_> = [KEY_A, KEY_B, KEY_A, KEY_B]
            .into_iter()
            .map(|key| {
                let (api, answered, stop) = (up.api.clone(), answered.clone(), stop.clone());
                std::thread::spawn(move || {
                    let tiny = r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":2}"#;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let Some((status, head)) = std::panic::catch_unwind(|| {
                            let (s, h, _) = exchange(
                                &api,
                                "POST",
                                "/v1/chat/completions",
                                Some(key),
                                &[],
                                tiny,
                            );
                            (s, h)
                        })
                        .ok() else {
                            return;
                        };
                        if status == 200
                            && let Some(id) = header(&head, "x-request-id")
                        {
                            answered.lock().expect("lock").push(id.to_owned());
                        }
                    }
                })
            })
            .collect();
        let deadline = Instant::now() + Duration::from_secs(60);
        while answered.lock().expect("lock").len() < 12 {
            assert!(Instant::now() < deadline, "too few requests were answered");
            std::thread::sleep(Duration::from_millis(20));
        }
        let killed = Command::new("kill")
            .args(["-KILL", &up.child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(killed.success());
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for c in clients {
            let _ = c.join();
        }
        drop(up);
        let answered: HashSet<String> = answered.lock().expect("lock").iter().cloned().collect();

        // Restart on the same data directory: recovery, then the chain continues.
        let up = Up::launch(Options {
            data_dir: Some(data.0.clone()),
            replace: &[("[audit]\n", &keyed)],
            ..Options::default()
        });
        up.wait_routable();
        let (status, head, _) = exchange(
            &up.api,
            "POST",
            "/v1/chat/completions",
            Some(KEY_A),
            &[],
            QUESTION,
        );
        assert_eq!(status, 200);
        let after = header(&head, "x-request-id").expect("id").to_owned();
        let mut recorded = HashSet::new();
        for tenant in ["tenant-a", "tenant-b"] {
            for r in up.admin_records(tenant) {
                recorded.insert(
                    r["bulkhead.request.id"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned(),
                );
            }
        }
        let missing: Vec<_> = answered.difference(&recorded).collect();
        assert!(
            missing.is_empty(),
            "answered in durable mode but not recorded: {missing:?}"
        );
        assert!(
            recorded.contains(&after),
            "the log continues after the crash"
        );
        drop(up);
        let (passed, report) = verify_with(&data.0, &["--key-file".as_ref(), key_file.as_ref()]);
        assert!(passed, "{report}");
        let (passed, report) = verify(&data.0);
        assert!(
            !passed && report.contains("keyed: pass --key-file"),
            "{report}"
        );
    });
}

#[test]
fn reading_the_audit_log_counts_against_the_tenants_request_limits() {
    bounded(|| {
        // Each demo tenant: two requests a minute. A read loads a page of records from disk, so
        // it is limited as a request is: a tenant cannot read the log faster than it may ask.
        let up = Up::launch(Options {
            replace: &[("requests_per_minute = 600", "requests_per_minute = 2")],
            ..Options::default()
        });
        up.wait_routable();
        for _ in 0..2 {
            audit_page(&up, KEY_A, "?since=0&limit=10");
        }
        let (status, body) = http(&up.api, "GET", "/v1/audit", Some(KEY_A), &[], "");
        assert_eq!(status, 429, "{body}");
        assert!(body.contains("rate_limit_exceeded"), "{body}");
        // Another tenant's budget is its own.
        audit_page(&up, KEY_B, "");
    });
}

#[test]
fn a_flood_of_requests_without_a_key_is_folded_past_the_gateway_logs_budget() {
    bounded(|| {
        // Ten records a minute of its own for the gateway log; thirty requests with a wrong
        // key: ten recorded alone, twenty counted in one folded record, written once its second
        // has passed though no request comes after the flood.
        let up = Up::launch(Options {
            replace: &[(
                "gateway_records_per_minute = 3000",
                "gateway_records_per_minute = 10",
            )],
            ..Options::default()
        });
        up.wait_routable();
        for _ in 0..30 {
            let (status, body) = http(&up.api, "GET", "/v1/models", Some("sk-wrong"), &[], "");
            assert_eq!(status, 401, "{body}");
        }
        let got = up.wait_records("_gateway", 11);
        assert_eq!(got.len(), 11, "{got:#?}");
        let folded = &got[10]["bulkhead.folded"];
        assert_eq!(folded["requests"], 20, "{folded:#}");
        assert_eq!(
            folded["statuses"],
            serde_json::json!([{"status": 401, "requests": 20}])
        );
        assert!(got[..10].iter().all(|r| r["bulkhead.folded"].is_null()));
        // The chain holds the folded record like any other.
        let (ok, report) = verify(&up.data_dir);
        assert!(ok, "{report}");
    });
}

#[test]
fn a_tenants_flood_of_requests_it_sends_no_prompt_in_is_folded_past_its_logs_budget() {
    bounded(|| {
        // Two requests a minute for each tenant, ten records a minute of its own for each
        // tenant's requests that end before a prompt is counted. Thirty model listings (not
        // limited: a gateway in front health-checks by them), two completions without a prompt
        // (400, within the limit) and three more (429, over it): ten recorded alone, the other
        // twenty-five counted in folded records of the tenant's log (before, a record each: a
        // tenant's flood cost the disk a record per request, fsynced in durable mode).
        let up = Up::launch(Options {
            replace: &[
                ("requests_per_minute = 600", "requests_per_minute = 2"),
                (
                    "unread_records_per_minute = 3000",
                    "unread_records_per_minute = 10",
                ),
            ],
            ..Options::default()
        });
        up.wait_routable();
        for _ in 0..30 {
            let (status, body) = http(&up.api, "GET", "/v1/models", Some(KEY_A), &[], "");
            assert_eq!(status, 200, "{body}");
        }
        for expected in [400, 400, 429, 429, 429] {
            let (status, body) = http(&up.api, "POST", "/v1/completions", Some(KEY_A), &[], "{}");
            assert_eq!(status, expected, "{body}");
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        let (own, folded) = loop {
            let got = up.admin_records("tenant-a");
            let (folded, own): (Vec<_>, Vec<_>) = got
                .into_iter()
                .partition(|r| !r["bulkhead.folded"].is_null());
            let counted: u64 = folded
                .iter()
                .map(|r| r["bulkhead.folded"]["requests"].as_u64().unwrap_or(0))
                .sum();
            if counted >= 25 || Instant::now() > deadline {
                break (own, folded);
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        assert_eq!(own.len(), 10, "{own:#?}");
        assert!(
            own.iter().all(|r| r["http.route"] == "/v1/models"),
            "{own:#?}"
        );
        let mut statuses = std::collections::BTreeMap::new();
        for f in &folded {
            assert_eq!(f["bulkhead.tenant.id"], "tenant-a");
            for s in f["bulkhead.folded"]["statuses"]
                .as_array()
                .expect("statuses")
            {
                *statuses
                    .entry(s["status"].as_u64().expect("a status"))
                    .or_insert(0) += s["requests"].as_u64().expect("a count");
            }
        }
        assert_eq!(
            statuses,
            [(200, 20), (400, 2), (429, 3)].into_iter().collect(),
            "{folded:#?}"
        );
        // The other tenant's budget is its own.
        let (status, body) = http(&up.api, "GET", "/v1/models", Some(KEY_B), &[], "");
        assert_eq!(status, 200, "{body}");
        let got = up.wait_records("tenant-b", 1);
        assert!(got[0]["bulkhead.folded"].is_null(), "{got:#?}");
        let (ok, report) = verify(&up.data_dir);
        assert!(ok, "{report}");
    });
}

#[test]
fn a_request_still_running_when_shutdown_has_drained_is_recorded_as_cut_by_it() {
    bounded(|| {
        // One second to drain; a long answer under way. The gateway stops, waits its second,
        // then cuts the stream: its client is told so in an error event (not a connection
        // dropped mid-body), and its record says so — not that the client left, which it
        // did not — and is on disk once the gateway has exited.
        let (data, up) = draining_in_a_second("audit-shutdown");
        let mut answer = a_long_answer_holding_decode(&up);
        drop(up);
        let mut rest = Vec::new();
        let _ = answer.read_to_end(&mut rest);
        let rest = String::from_utf8_lossy(&rest);
        let last = rest.lines().rev().find(|l| l.starts_with("data: "));
        assert!(
            last.is_some_and(|l| l.contains(r#""code":"gateway_shutdown""#)),
            "the stream's last event: {last:?}"
        );
        assert!(!rest.contains("[DONE]"), "{rest}");
        let records = on_disk(&data.0, "tenant-b");
        assert_eq!(records.len(), 1, "{records:#?}");
        let r = &records[0];
        assert_eq!(r["error.type"], "gateway_shutdown", "{r:#}");
        assert!(r["bulkhead.disconnect.phase"].is_null(), "{r:#}");
        // Cancelled at once, not held by the abort guard as if its client had left (a hold
        // could keep the gateway from exiting for the hold limit), and its tokens counted.
        assert!(r["bulkhead.disconnect.hold"].is_null(), "{r:#}");
        assert!(r["gen_ai.usage.output_tokens"].as_u64() >= Some(1), "{r:#}");
        let (ok, report) = verify(&data.0);
        assert!(ok, "{report}");
    });
}

/// A request whose worker has not answered its call yet when shutdown cuts (its decode worker
/// waits for a prefill worker that is stopped) is told 503 `gateway_shutdown` like any other
/// cut request: it was once left waiting until shutdown dropped its connection unanswered,
/// while its record said 503.
#[test]
fn a_request_whose_call_is_unanswered_when_shutdown_cuts_is_told_so() {
    bounded(|| {
        let (data, up) = draining_in_a_second("audit-shutdown-call");
        up.signal_prefill("-STOP");
        let mut waiting = crate::up::open(
            &up.api,
            KEY_A,
            "/v1/chat/completions",
            r#"{"messages":[{"role":"user","content":"Say hello."}],"max_tokens":4}"#,
        );
        // The gateway has it (its tenant's slot taken) before it is told to stop.
        while up.in_flight("tenant-a") == 0 {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        up.signal_up("-TERM");
        let mut told = String::new();
        let _ = waiting.read_to_string(&mut told);
        up.signal_prefill("-CONT");
        drop(up);
        assert_told_and_recorded_as_cut(&told, &data);
    });
}

/// A request whose body is still coming when shutdown cuts is told 503 `gateway_shutdown`
/// too, not cut off with its connection.
#[test]
fn a_request_whose_body_is_still_coming_when_shutdown_cuts_is_told_so() {
    bounded(|| {
        let (data, up) = draining_in_a_second("audit-shutdown-body");
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {KEY_A}\r\n\
             Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"messages\":"
        );
        let mut s = std::net::TcpStream::connect(&up.api).expect("connects");
        std::io::Write::write_all(&mut s, head.as_bytes()).expect("sends");
        // The gateway reads the body when it is told to stop.
        std::thread::sleep(std::time::Duration::from_millis(300));
        up.signal_up("-TERM");
        let mut told = String::new();
        let _ = s.read_to_string(&mut told);
        drop(up);
        assert_told_and_recorded_as_cut(&told, &data);
    });
}

/// `bulkhead up` on a data directory of its own, with one second to drain at shutdown; ready
/// to serve.
fn draining_in_a_second(what: &str) -> (TempDir, Up) {
    let data = TempDir::new(what);
    let up = Up::launch(Options {
        replace: &[("drain_timeout_secs = 10", "drain_timeout_secs = 1")],
        data_dir: Some(data.0.clone()),
        ..Options::default()
    });
    up.wait_routable();
    (data, up)
}

/// `told` (all a client read) is 503 `gateway_shutdown`, and the stack's data directory holds
/// one record of tenant-a's, saying the same.
fn assert_told_and_recorded_as_cut(told: &str, data: &TempDir) {
    let (status, body) = crate::up::parse_response(told);
    assert_eq!(status, 503, "{told}");
    assert!(body.contains(r#""code":"gateway_shutdown""#), "{told}");
    let records = on_disk(&data.0, "tenant-a");
    assert_eq!(records.len(), 1, "{records:#?}");
    assert_eq!(records[0]["http.response.status_code"], 503, "{records:#?}");
    assert_eq!(records[0]["error.type"], "gateway_shutdown", "{records:#?}");
}

/// A client that closes its connection before its request body is whole has left: its record
/// says so (499 `client_disconnected`, before admission), not that it sent a bad request —
/// whether it closed mid-body or sent a chunked body and no last chunk.
#[test]
fn a_client_that_closes_before_its_body_is_whole_is_recorded_as_gone() {
    bounded(|| {
        let up = Up::start(&[]);
        up.wait_routable();
        let head = |framing: &str| {
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {KEY_A}\r\n\
                 Content-Type: application/json\r\n{framing}\r\n\r\n"
            )
        };
        let cut = [
            head("Content-Length: 100") + r#"{"messages":"#,
            head("Transfer-Encoding: chunked") + "5\r\n{\"mes\r\n",
        ];
        for request in &cut {
            let mut s = std::net::TcpStream::connect(&up.api).expect("connects");
            std::io::Write::write_all(&mut s, request.as_bytes()).expect("sends");
            s.shutdown(std::net::Shutdown::Write)
                .expect("closes its side");
            let mut answer = String::new();
            let _ = s.read_to_string(&mut answer);
            // A half-closed client that still reads is told, in a well-formed status line.
            assert!(
                answer.starts_with("HTTP/1.1 499 Client Closed Request\r\n"),
                "{answer}"
            );
        }
        let got = up.wait_records("tenant-a", cut.len());
        for record in &got {
            assert_eq!(record["http.response.status_code"], 499, "{record:#}");
            assert_eq!(record["error.type"], "client_disconnected", "{record:#}");
            assert_eq!(
                record["bulkhead.disconnect.phase"], "before_admission",
                "{record:#}"
            );
        }
        // A whole (not streamed) answer whose client leaves while it is generated: no
        // response is ever made for it, and it is counted as its record says, 499.
        let waiting = crate::up::open(
            &up.api,
            KEY_A,
            "/v1/chat/completions",
            // Greedy, this runs to max_tokens: seconds of generation.
            r#"{"messages":[{"role":"user","content":"Repeat the word hello 3000 times."}],"max_tokens":1000,"temperature":0}"#,
        );
        std::thread::sleep(std::time::Duration::from_millis(300));
        drop(waiting);
        let got = up.wait_records("tenant-a", cut.len() + 1);
        let left = got.last().expect("its record");
        assert_eq!(left["http.response.status_code"], 499, "{left:#}");
        let m = up.metrics();
        assert_eq!(
            crate::up::metric(
                &m,
                r#"bulkhead_gateway_requests_total{tenant="tenant-a",status="499"}"#
            ),
            3,
            "{m}"
        );
    });
}

#[test]
fn a_request_the_http_server_cannot_parse_still_leaves_one_record() {
    bounded(|| {
        // hyper answers these itself, before any of the gateway's code runs: they reached the
        // gateway all the same, so each gets its record in the gateway's log (I5).
        let up = Up::start(&[]);
        up.wait_routable();
        let many_headers: String = (0..200).map(|i| format!("x-h{i}: v\r\n")).collect();
        let sent = [
            ("GARBAGE\r\n\r\n".to_owned(), 400),
            (
                format!("GET /v1/models HTTP/1.1\r\nHost: t\r\n{many_headers}\r\n"),
                431,
            ),
        ];
        for (request, status) in &sent {
            let mut s = std::net::TcpStream::connect(&up.api).expect("connects");
            std::io::Write::write_all(&mut s, request.as_bytes()).expect("sends");
            let mut answer = String::new();
            let _ = s.read_to_string(&mut answer);
            assert!(
                answer.starts_with(&format!("HTTP/1.1 {status}")),
                "{answer}"
            );
        }
        let got = up.wait_records("_gateway", sent.len());
        assert_eq!(got.len(), sent.len(), "{got:#?}");
        for (record, (_, status)) in got.iter().zip(&sent) {
            assert_eq!(record["http.response.status_code"], *status, "{record:#}");
            assert_eq!(record["error.type"], "malformed_http", "{record:#}");
            assert_eq!(record["http.route"], "unmatched", "{record:#}");
        }
    });
}
