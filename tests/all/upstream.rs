//! An OpenAI-compatible HTTP upstream behind the gateway: gateway A fronts gateway B (a real
//! OpenAI-compatible server: `bulkhead up` with its workers) through `openai = …`. A
//! tokenizes, admits, limits and audits; B sees token ids only.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::cluster::{Gateway, preflight_with_env};
use crate::up::{
    ADMIN, KEY_A, KEY_B, Options, SILENCE_2S, TempDir, Up, bounded, http, json, sha256_hex,
    stream_under_way,
};

/// A `bulkhead gateway` fronting an upstream, and its configuration's directory.
struct Front {
    gateway: Gateway,
    /// Its configuration file.
    config: std::path::PathBuf,
    _dir: TempDir,
}

impl std::ops::Deref for Front {
    type Target = Gateway;

    fn deref(&self) -> &Gateway {
        &self.gateway
    }
}

impl Front {
    /// Fronts `upstream` (an OpenAI-compatible base URL serving `model`), authenticating to
    /// it with `upstream_key`; its own tenant is tenant-a (`KEY_A`), with `max_context`;
    /// `extra` is added to its configuration.
    fn start(
        upstream: &str,
        model: &str,
        upstream_key: &str,
        max_context: u32,
        tokens_per_minute: u64,
        extra: &str,
    ) -> Front {
        let dir = TempDir::new("gw-front");
        let model_file =
            std::env::var("BULKHEAD_MODEL").expect("BULKHEAD_MODEL (scripts/fetch-model)");
        let config = format!(
            "[listen]\napi = \"127.0.0.1:0\"\nadmin = \"127.0.0.1:0\"\n\
             [admin]\ntoken_sha256 = \"{admin}\"\n\
             [[tenants]]\nid = \"tenant-a\"\nkey_sha256 = [\"{a}\"]\nmax_context = {max_context}\n\
             max_concurrent = 4\nrequests_per_minute = 600\ntokens_per_minute = {tokens_per_minute}\n\
             [[workers]]\nname = \"upstream-b\"\nopenai = \"{upstream}\"\nrole = \"both\"\n\
             model = \"{model}\"\ncontext_length = 2048\ntokenizer = \"{model_file}\"\n\
             key_env = \"UPSTREAM_KEY\"\n{extra}",
            admin = sha256_hex(ADMIN),
            a = sha256_hex(KEY_A),
        );
        let path = dir.0.join("front.toml");
        std::fs::write(&path, config).expect("writes the config");
        let gateway = Gateway::start(
            &path,
            &dir.0.join("data"),
            &[("UPSTREAM_KEY", upstream_key)],
        );
        Front {
            gateway,
            config: path,
            _dir: dir,
        }
    }
}

impl Front {
    /// Fronts `back` (as its tenant-b), with tenant-a's `max_context` and `tokens_per_minute`;
    /// returns once the front sees the back healthy.
    fn before(back: &Up, max_context: u32, tokens_per_minute: u64) -> Front {
        let (_, models) = http(&back.api, "GET", "/v1/models", Some(KEY_B), &[], "");
        let model = json(&models)["data"][0]["id"]
            .as_str()
            .expect("a model")
            .to_owned();
        let front = Front::start(
            &format!("http://{}", back.api),
            &model,
            KEY_B,
            max_context,
            tokens_per_minute,
            "",
        );
        front.wait_healthy();
        front
    }

    /// Tenant-a's chat completion `body` through the front.
    fn chat(&self, body: &str) -> (u16, String) {
        http(
            &self.api,
            "POST",
            "/v1/chat/completions",
            Some(KEY_A),
            &[],
            body,
        )
    }
}

const CHAT: &str = r#"{"messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":12,"temperature":0}"#;

#[test]
fn the_gateway_fronts_an_openai_compatible_server_with_its_own_tenants_admission_and_audit() {
    bounded(|| {
        let back = Up::start(&[]);
        back.wait_routable();
        let front = Front::before(&back, 1024, 1_000_000);

        // Greedy: the answer through the front equals the answer straight from the back.
        let (status, direct) = back.chat(KEY_B, &[], CHAT);
        assert_eq!(status, 200, "{direct}");
        let (status, fronted) = front.chat(CHAT);
        assert_eq!(status, 200, "{fronted}");
        let text = |b: &str| {
            json(b)["choices"][0]["message"]["content"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        };
        assert!(!text(&direct).is_empty());
        assert_eq!(
            text(&fronted),
            text(&direct),
            "same tokens in, same tokens out"
        );
        assert_eq!(
            json(&fronted)["usage"]["completion_tokens"],
            json(&direct)["usage"]["completion_tokens"]
        );
        // Preflight probes the server as the gateway's health check does, and says what it
        // cannot check; the key its configuration names must be in the environment.
        let key = std::path::Path::new(KEY_B);
        let (passed, report) = preflight_with_env(&front.config, &[("UPSTREAM_KEY", key)]);
        assert!(passed, "{report}");
        assert!(report.contains("PASS upstream-b"), "{report}");
        assert!(
            report.contains("reachable: GET /v1/models lists"),
            "{report}"
        );
        assert!(report.contains("WARN upstream-b"), "{report}");
        assert!(report.contains("2048"), "the configured context: {report}");
        let (passed, report) = preflight_with_env(&front.config, &[]);
        assert!(!passed, "{report}");
        assert!(
            report.contains("UPSTREAM_KEY, which is not set"),
            "{report}"
        );
        // Streaming through the front ends with [DONE].
        let stream = CHAT.replace("\"temperature\":0", "\"temperature\":0,\"stream\":true");
        let (status, body) = front.chat(&stream);
        assert_eq!(status, 200);
        assert!(body.contains("[DONE]"), "{body}");
        // A stop string the answer's last token begins but never completes: the back holds
        // that token's text back (all but its first character) and sends it with its finish,
        // which the front takes as the answer's end, not as one token more than asked for.
        let streamed = stream.replace("\"max_tokens\":12", "\"max_tokens\":6");
        let (status, body) = back.chat(KEY_B, &[], &streamed);
        assert_eq!(status, 200, "{body}");
        let pieces: Vec<String> = body
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .filter_map(|d| {
                json(d)["choices"][0]["delta"]["content"]
                    .as_str()
                    .map(str::to_owned)
            })
            .filter(|t| !t.is_empty())
            .collect();
        let last = pieces
            .iter()
            .position(|p| p.chars().count() >= 2)
            .unwrap_or_else(|| panic!("a token of two characters or more: {pieces:?}"));
        let asked = CHAT.replace("\"max_tokens\":12", &format!("\"max_tokens\":{}", last + 1));
        let held: String = pieces[last].chars().skip(1).collect();
        let stop = serde_json::to_string(&format!("{held}~~~~")).expect("a JSON string");
        let stopped = format!("{},\"stop\":[{stop}]}}", &asked[..asked.len() - 1]);
        let (status, body) = front.chat(&stopped);
        assert_eq!(status, 200, "{stopped}: {body}");
        assert_eq!(text(&body), pieces[..=last].concat(), "{body}");
        assert_eq!(
            json(&body)["choices"][0]["finish_reason"],
            "length",
            "{body}"
        );

        // The front's own admission (tenant max_context 1024) refuses before the back is asked.
        let (_, before) = http(
            &back.admin,
            "GET",
            "/audit/tenant-b?limit=1000",
            Some(ADMIN),
            &[],
            "",
        );
        let before = json(&before)["data"].as_array().map_or(0, Vec::len);
        let long = r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":2000}"#;
        let (status, body) = front.chat(long);
        assert_eq!(status, 400, "{body}");
        assert_eq!(json(&body)["error"]["code"], "context_length_exceeded");
        let (_, after) = http(
            &back.admin,
            "GET",
            "/audit/tenant-b?limit=1000",
            Some(ADMIN),
            &[],
            "",
        );
        let after = json(&after)["data"].as_array().map_or(0, Vec::len);
        assert_eq!(after, before, "the upstream never saw the refused request");

        // The front's audit log names the upstream.
        let (_, audit) = http(&front.api, "GET", "/v1/audit", Some(KEY_A), &[], "");
        let records = json(&audit)["data"].as_array().cloned().unwrap_or_default();
        assert_eq!(records.len(), 4, "{audit}");
        assert_eq!(
            records[0]["record"]["bulkhead.workers"]["decode"],
            "upstream-b"
        );

        // The upstream goes away: a clear 503, not a hang.
        drop(back);
        let (status, body) = front.chat(CHAT);
        assert_eq!(status, 503, "{body}");
    });
}

/// A request the upstream refuses (429: its tenant is over its requests per minute) costs the
/// front's tenant none of its tokens per minute: each refusal is the upstream's, never the
/// front's own limit reached by charges for work that was never done.
#[test]
fn requests_the_upstream_refuses_are_not_charged_to_the_tenants_tokens_per_minute() {
    bounded(|| {
        let back = Up::launch(Options {
            replace: &[("requests_per_minute = 600", "requests_per_minute = 1")],
            ..Options::default()
        });
        back.wait_routable();
        // Each request charges its prompt and max_tokens (about 50): six would spend 300.
        let front = Front::before(&back, 1024, 300);
        for i in 0..8 {
            let (status, body) = front.chat(CHAT);
            if status == 200 {
                continue; // the back's one request of this minute
            }
            assert_eq!(status, 429, "request {i}: {body}");
            let message = json(&body)["error"]["message"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            assert!(
                message.contains("worker is busy"),
                "request {i} was refused by the front's own limit: {body}"
            );
        }
        // The back's Retry-After (the rest of its minute) reaches the front's client, not a
        // guess of the front's.
        let (status, head, body) = crate::up::exchange(
            &front.api,
            "POST",
            "/v1/chat/completions",
            Some(KEY_A),
            &[],
            CHAT,
        );
        assert_eq!(status, 429, "{body}");
        let wait: u64 = crate::up::header(&head, "retry-after")
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no Retry-After: {head}"));
        assert!((2..=60).contains(&wait), "{head}");
        // Each refusal's record names the upstream as the layer that refused, not the front's
        // own admission (which admitted it).
        let records = crate::up::wait_records(&front.admin, "tenant-a", 9);
        let refused: Vec<&serde_json::Value> = records
            .iter()
            .filter(|r| r["http.response.status_code"] == 429)
            .collect();
        assert!(refused.len() >= 7, "{records:#?}");
        for r in refused {
            assert_eq!(
                r["bulkhead.admission"],
                serde_json::json!({"outcome": "unavailable", "layer": "decode"}),
                "{r:#}"
            );
        }
    });
}

/// A request that fails mid-stream is charged what it used — its prompt and the tokens that
/// came — not its whole `max_tokens`: a client whose stream broke can ask again at once.
#[test]
fn a_request_failed_mid_stream_is_charged_only_the_tokens_it_used() {
    bounded(|| {
        // The back fails a request whose worker goes silent for 2 s.
        let back = Up::launch(Options {
            args: &["--kv-tokens", "4096"],
            replace: &[SILENCE_2S],
            ..Options::default()
        });
        back.wait_routable();
        // 1200 tokens a minute (20 a second): each request below charges about 1040.
        let front = Front::before(&back, 2048, 1200);
        let story = r#"{"messages":[{"role":"user","content":"Tell me a long story."}],"max_tokens":1000,"stream":true,"temperature":0}"#;
        let (mut s, _) = stream_under_way(&front.api, KEY_A, story);
        back.signal_worker("-STOP");
        let mut rest = String::new();
        let _ = s.read_to_string(&mut rest);
        back.signal_worker("-CONT");
        assert!(
            rest.contains("service_unavailable") && !rest.contains("[DONE]"),
            "the stream fails:\n{rest}"
        );
        back.wait_routable();
        front.wait_healthy();
        // Charged in full, the failed request would leave too little of the minute's 1200 for
        // this one (about 40 prompt tokens + 1000) for the next 40 s: 429 from the front.
        let (status, body) = front.chat(
            r#"{"messages":[{"role":"user","content":"What is 2+2?"}],"max_tokens":1000,"temperature":0}"#,
        );
        assert_eq!(status, 200, "{body}");
    });
}

/// `bulkhead bench load-target`: an OpenAI-compatible server that answers every request with
/// the same five pieces ("The answer is 4."), whatever its `max_tokens`. Killed when dropped.
struct LoadTarget {
    child: Child,
    url: String,
}

impl LoadTarget {
    fn start() -> LoadTarget {
        let mut child = Command::new(env!("CARGO_BIN_EXE_bulkhead"))
            .args(["bench", "load-target"])
            .stdout(Stdio::piped())
            .spawn()
            .expect("the load target starts");
        let mut line = String::new();
        let stdout = child.stdout.take().expect("piped");
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("reads its ready line");
        let addr = line.trim().rsplit_once("addr=").expect("a ready line").1;
        let url = format!("http://{addr}");
        LoadTarget { child, url }
    }
}

impl Drop for LoadTarget {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One chat completion of three tokens through the official client with its default retries
/// (`argv`: base URL, key); prints the status of the error it raises.
const ONE_CHAT_WITH_DEFAULT_RETRIES: &str = "
import sys, openai
client = openai.OpenAI(base_url=sys.argv[1], api_key=sys.argv[2])
try:
    model = client.models.list().data[0].id
    client.chat.completions.create(model=model, max_tokens=3,
        messages=[{'role': 'user', 'content': 'What is 2+2?'}])
    sys.exit('served')
except openai.APIStatusError as e:
    print(e.status_code)
";

/// An upstream that sends more tokens than the request asked for (one that ignores
/// `max_tokens`) fails the request — 500, or an error event and no `[DONE]` — instead of
/// streaming on for as long as it likes; within the request's `max_tokens` it is served.
#[test]
fn an_upstream_that_sends_more_tokens_than_asked_fails_the_request() {
    bounded(|| {
        let url = overlong_upstream("bench");
        let front = Front::start(&url, "bench", "unused", 2048, 1_000_000, "");
        front.wait_healthy();
        let chat = |max_tokens: u32, stream: bool| {
            front.chat(&format!(
                r#"{{"messages":[{{"role":"user","content":"What is 2+2?"}}],"max_tokens":{max_tokens},"stream":{stream}}}"#
            ))
        };
        let (status, body) = chat(16, false);
        assert_eq!(status, 200, "{body}");
        assert_eq!(
            json(&body)["choices"][0]["message"]["content"],
            "The answer is 4."
        );
        let (status, body) = chat(3, false);
        assert_eq!(status, 500, "five pieces for three tokens: {body}");
        // The official client, with its default retries (two more for a 5xx unless told not
        // to), sends it once: asked again, the server breaks the answer again.
        let failed = || {
            let (_, text) = http(&front.admin, "GET", "/metrics", Some(ADMIN), &[], "");
            text.lines()
                .filter(|l| {
                    l.starts_with("bulkhead_gateway_requests_total{")
                        && l.contains("status=\"500\"")
                })
                .filter_map(|l| l.rsplit_once(' ')?.1.parse::<u64>().ok())
                .sum::<u64>()
        };
        let before = failed();
        let out = Command::new(crate::up::python())
            .args(["-c", ONE_CHAT_WITH_DEFAULT_RETRIES])
            .arg(format!("http://{}/v1", front.api))
            .arg(KEY_A)
            .output()
            .expect("python runs");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.trim() == "500",
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(failed() - before, 1, "the client asked once");
        // Only the request failed: the upstream is still routed to.
        let (status, body) = chat(16, false);
        assert_eq!(status, 200, "{body}");
        let (status, body) = chat(3, true);
        assert_eq!(status, 200, "{body}");
        assert!(
            body.contains("internal_error") && !body.contains("[DONE]"),
            "the stream fails:\n{body}"
        );
    });
}

/// The bench's load target keeps to `max_tokens` as a model server does: fewer tokens than
/// its answer, finished for `length`, through the gateway. A request without `max_tokens`
/// gets the default (512) only as far as the tenant's minute of tokens (300) leaves beside its
/// prompt: served, not refused as too large for the budget at every try.
#[test]
fn the_load_target_answers_within_max_tokens_and_the_default_fits_the_tenants_minute() {
    bounded(|| {
        let target = LoadTarget::start();
        let front = Front::start(&target.url, "bench", "unused", 2048, 300, "");
        front.wait_healthy();
        // First, while the whole minute is there (the charge is settled to what it used).
        let (status, body) =
            front.chat(r#"{"messages":[{"role":"user","content":"What is 2+2?"}]}"#);
        assert_eq!(status, 200, "{body}");
        assert_eq!(
            json(&body)["choices"][0]["message"]["content"],
            "The answer is 4."
        );
        let (status, body) =
            front.chat(r#"{"messages":[{"role":"user","content":"What is 2+2?"}],"max_tokens":3}"#);
        assert_eq!(status, 200, "{body}");
        let answer = json(&body);
        assert_eq!(answer["choices"][0]["message"]["content"], "The answer is");
        assert_eq!(answer["choices"][0]["finish_reason"], "length");
        assert_eq!(answer["usage"]["completion_tokens"], 3);
    });
}

/// An OpenAI-compatible server that lists `model` and passes every health check, and answers
/// each other request with what `answer` makes of its body: an HTTP response, written in the
/// pieces given, [`QUEUED`] apart (the connection closed after the last when there are
/// several), or `None` to take it and never answer (a hung server, or one queueing without
/// end).
fn scripted_upstream(model: &str, answer: fn(&str) -> Option<Vec<String>>) -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("binds");
    let url = format!("http://{}", listener.local_addr().expect("an address"));
    let models = format!(r#"{{"object":"list","data":[{{"id":"{model}","object":"model"}}]}}"#);
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let models = models.clone();
            std::thread::spawn(move || {
                let mut reader = BufReader::new(&conn);
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 {
                        return;
                    }
                    let mut length = 0;
                    loop {
                        let mut header = String::new();
                        if reader.read_line(&mut header).unwrap_or(0) == 0 {
                            return;
                        }
                        if header.trim().is_empty() {
                            break;
                        }
                        if let Some((name, value)) = header.split_once(':')
                            && name.eq_ignore_ascii_case("content-length")
                        {
                            length = value.trim().parse().unwrap_or(0);
                        }
                    }
                    let mut body = vec![0; length];
                    if reader.read_exact(&mut body).is_err() {
                        return;
                    }
                    let response = if line.starts_with("GET /v1/models") {
                        Some(vec![format!(
                            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{models}",
                            models.len()
                        )])
                    } else {
                        answer(&String::from_utf8_lossy(&body))
                    };
                    let Some(response) = response else {
                        // Taken, never answered: held until the gateway gives up on it.
                        let _ = reader.read_to_end(&mut Vec::new());
                        return;
                    };
                    for (i, piece) in response.iter().enumerate() {
                        if i > 0 {
                            std::thread::sleep(QUEUED);
                        }
                        if (&conn).write_all(piece.as_bytes()).is_err() {
                            return;
                        }
                    }
                    if response.len() > 1 {
                        return;
                    }
                }
            });
        }
    });
    url
}

/// An upstream that takes every completion request and never answers it.
fn hung_upstream(model: &str) -> String {
    scripted_upstream(model, |_| None)
}

/// An upstream that answers every completion with the same five tokens, whatever its
/// `max_tokens` says (the gateway calls `/v1/completions` with the prompt's token ids).
fn overlong_upstream(model: &str) -> String {
    scripted_upstream(model, |body| {
        const PIECES: [&str; 5] = ["The", " answer", " is", " 4", "."];
        let usage = r#"{"prompt_tokens":8,"completion_tokens":5,"total_tokens":13}"#;
        let (kind, body) = if body.contains(r#""stream":true"#) {
            let chunk = |text: &str, finish: &str| {
                format!(
                    "data: {{\"id\":\"c\",\"object\":\"text_completion\",\"created\":0,\"model\":\"m\",\"choices\":[{{\"index\":0,\"text\":\"{text}\",\"finish_reason\":{finish}}}]}}\n\n"
                )
            };
            let mut events: String = PIECES.iter().map(|p| chunk(p, "null")).collect();
            events.push_str(&chunk("", r#""stop""#));
            events.push_str("data: [DONE]\n\n");
            ("text/event-stream", events)
        } else {
            let whole = format!(
                r#"{{"id":"c","object":"text_completion","created":0,"model":"m","choices":[{{"index":0,"text":"{}","finish_reason":"stop"}}],"usage":{usage}}}"#,
                PIECES.concat()
            );
            ("application/json", whole)
        };
        Some(vec![format!(
            "HTTP/1.1 200 OK\r\ncontent-type: {kind}\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )])
    })
}

/// How long [`queueing_upstream`] keeps a request in its queue: longer than the silence
/// timeout of [`a_request_queued_by_an_upstream_after_its_headers_is_waited_for`]'s gateway.
const QUEUED: Duration = Duration::from_secs(3);

/// An upstream that answers a streamed completion's headers at once and its tokens only
/// after [`QUEUED`], as vLLM does with a request in its scheduler's queue.
fn queueing_upstream(model: &str) -> String {
    scripted_upstream(model, |body| {
        assert!(
            body.contains(r#""stream":true"#),
            "the gateway streams: {body}"
        );
        let chunk = |text: &str, finish: &str| {
            format!(
                "data: {{\"id\":\"c\",\"object\":\"text_completion\",\"created\":0,\"model\":\"m\",\"choices\":[{{\"index\":0,\"text\":\"{text}\",\"finish_reason\":{finish}}}]}}\n\n"
            )
        };
        Some(vec![
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
                .to_owned(),
            format!(
                "{}{}data: [DONE]\n\n",
                chunk("Queued", "null"),
                chunk(" long", r#""stop""#)
            ),
        ])
    })
}

/// A server that sends its headers and then queues the request (vLLM with every sequence slot
/// taken) is still taking it: its silence is the call's wait, not a stream that stopped
/// mid-answer — which failed the request (503) and left the server unrouted for every tenant
/// until its next health check.
#[test]
fn a_request_queued_by_an_upstream_after_its_headers_is_waited_for() {
    bounded(|| {
        let url = queueing_upstream("queueing");
        let front = Front::start(
            &url,
            "queueing",
            "unused",
            2048,
            1_000_000,
            "[http]\nstream_idle_timeout_secs = 1\n",
        );
        front.wait_healthy();
        for stream in [false, true] {
            let body = format!(
                r#"{{"messages":[{{"role":"user","content":"Hi"}}],"max_tokens":4,"stream":{stream}}}"#
            );
            let started = Instant::now();
            let (status, answer) = front.chat(&body);
            assert_eq!(status, 200, "stream {stream}: {answer}");
            assert!(
                answer.contains("Queued") && answer.contains(" long"),
                "{answer}"
            );
            assert!(!answer.contains("error"), "{answer}");
            assert!(started.elapsed() >= QUEUED, "it waited in the queue");
        }
        let (_, workers) = http(&front.admin, "GET", "/workers", Some(ADMIN), &[], "");
        let workers = json(&workers);
        assert!(
            workers["workers"][0]["unroutable"].is_null(),
            "still routed: {workers}"
        );
    });
}

/// An upstream that passes its health checks but leaves every request unanswered: each of the
/// first three waits out the request deadline (504); then the upstream is ejected, so the
/// next request is refused at once (503) instead of waiting too, and `/workers` says why.
#[test]
fn an_upstream_that_leaves_requests_unanswered_is_ejected_after_three_in_a_row() {
    bounded(|| {
        let url = hung_upstream("hung");
        let front = Front::start(
            &url,
            "hung",
            "unused",
            2048,
            1_000_000,
            "[http]\nrequest_timeout_secs = 2\n",
        );
        front.wait_healthy();
        let ask = || front.chat(r#"{"messages":[{"role":"user","content":"Hi"}],"max_tokens":4}"#);
        for _ in 0..3 {
            let (status, body) = ask();
            assert_eq!(status, 504, "{body}");
        }
        let started = Instant::now();
        let (status, body) = ask();
        assert_eq!(status, 503, "ejected: {body}");
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "refused at once"
        );
        let (_, workers) = http(&front.admin, "GET", "/workers", Some(ADMIN), &[], "");
        let workers = json(&workers);
        let reason = &workers["workers"][0]["unroutable"];
        assert_eq!(reason["reason"], "stalled", "{workers}");
        assert_eq!(reason["in_a_row"], 3, "{workers}");
        assert_eq!(
            workers["workers"][0]["health"]["status"], "serving",
            "{workers}"
        );
    });
}
