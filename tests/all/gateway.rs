//! `bulkhead up` end to end: the real binary (gateway in process, worker as its child), the
//! real model, plain HTTP and the official `openai` Python client.
//!
//! Each test starts its own `bulkhead up` on free loopback ports, runs under a time limit, and
//! stops it on the way out (the worker child dies with it).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use bulkhead_worker::serve::proto::{HealthRequest, WorkerClient};

/// Upper bound for any one test, startup included.
const TEST_LIMIT: Duration = Duration::from_secs(240);
/// Upper bound for `bulkhead up` to load the model and bind.
const STARTUP_LIMIT: Duration = Duration::from_secs(90);
/// Upper bound for one HTTP exchange.
const HTTP_LIMIT: Duration = Duration::from_secs(60);

pub(crate) const KEY_A: &str = "sk-demo-tenant-a";
pub(crate) const KEY_B: &str = "sk-demo-tenant-b";
pub(crate) const ADMIN: &str = "sk-demo-admin";
const KEY_LIMITED: &str = "sk-test-limited";
const KEY_SERIAL: &str = "sk-test-serial";

pub(crate) fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn sha256_hex(key: &str) -> String {
    bulkhead_gateway::keys::KeyHash::of(key).to_hex()
}

/// The default configuration plus two tenants with tight limits; `policies` replaces the
/// default policy set file.
fn test_config(dir: &std::path::Path, policies: Option<&std::path::Path>) -> PathBuf {
    let mut text = std::fs::read_to_string(repo().join("deploy/local/gateway.toml"))
        .expect("deploy/local/gateway.toml");
    if let Some(p) = policies {
        text = text.replace(
            "file = \"policies/local.toml\"",
            &format!("file = {:?}", p.display().to_string()),
        );
    }
    // Move the worker table last so the appended tenants are not inside it.
    let (head, worker) = text
        .split_once("\n[[workers]]")
        .map(|(h, w)| (h.to_owned(), format!("\n[[workers]]{w}")))
        .expect("the default config has a worker");
    text = head;
    for (id, key, concurrent, rpm) in [
        ("tenant-limited", KEY_LIMITED, 8, 2),
        ("tenant-serial", KEY_SERIAL, 1, 600),
    ] {
        text.push_str(&format!(
            "\n[[tenants]]\nid = \"{id}\"\nkey_sha256 = [\"{}\"]\nmax_context = 8192\n\
             max_concurrent = {concurrent}\nrequests_per_minute = {rpm}\ntokens_per_minute = 1000000\n",
            sha256_hex(key)
        ));
    }
    text.push_str(&worker);
    let path = dir.join("gateway.toml");
    std::fs::write(&path, text).expect("writes the test config");
    path
}

/// A running `bulkhead up`; stopped when dropped.
pub(crate) struct Up {
    child: Child,
    pub(crate) api: String,
    pub(crate) admin: String,
    worker: String,
    worker_pid: u32,
    _dir: TempDir,
}

impl Drop for Up {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        // The worker dies with its parent (PR_SET_PDEATHSIG); make sure anyway.
        let _ = Command::new("kill")
            .args(["-KILL", &self.worker_pid.to_string()])
            .status();
    }
}

/// A scratch directory removed on drop.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Up {
    fn start(extra: &[&str]) -> Up {
        Up::start_with_policies(extra, None)
    }

    /// `bulkhead up` with the policy set file `policies` instead of the default one.
    pub(crate) fn start_with_policies(extra: &[&str], policies: Option<&std::path::Path>) -> Up {
        let dir = std::env::temp_dir().join(format!(
            "bulkhead-gw-{}-{:x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let config = test_config(&dir, policies);
        let model = std::env::var_os("BULKHEAD_MODEL").map_or_else(
            || {
                PathBuf::from(std::env::var_os("HOME").expect("HOME"))
                    .join(".cache/bulkhead/models/SmolLM2-135M-Instruct.Q4_1.gguf")
            },
            PathBuf::from,
        );
        assert!(
            model.is_file(),
            "run scripts/fetch-model: {} is missing",
            model.display()
        );
        let mut child = Command::new(env!("CARGO_BIN_EXE_bulkhead"))
            .arg("up")
            .arg("--model")
            .arg(&model)
            .args(["--threads", "1", "--port", "0", "--admin-port", "0"])
            .arg("--config")
            .arg(&config)
            .args(extra)
            .env("BULKHEAD_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("bulkhead up starts");
        let stdout = child.stdout.take().expect("piped");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(rest) = line.strip_prefix("bulkhead up ready ") {
                    let _ = tx.send(rest.to_owned());
                }
            }
        });
        let mut up = Up {
            child,
            api: String::new(),
            admin: String::new(),
            worker: String::new(),
            worker_pid: 0,
            _dir: TempDir(dir),
        };
        let ready = rx
            .recv_timeout(STARTUP_LIMIT)
            .expect("bulkhead up reports ready");
        for field in ready.split_whitespace() {
            let (k, v) = field.split_once('=').expect("key=value");
            match k {
                "api" => up.api = v.trim_start_matches("http://").to_owned(),
                "admin" => up.admin = v.trim_start_matches("http://").to_owned(),
                // The worker requests are routed to: a colocated one, or the decode worker.
                "both" | "decode" => up.worker = v.to_owned(),
                "both_pid" | "decode_pid" => up.worker_pid = v.parse().expect("a pid"),
                "prefill" | "prefill_pid" => {}
                other => panic!("unexpected field {other}"),
            }
        }
        up
    }

    /// Waits (bounded) until the gateway routes to the worker.
    pub(crate) fn wait_routable(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let (status, _) = http(&self.admin, "GET", "/healthz", Some(ADMIN), &[], "");
            if status == 200 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the gateway never became healthy"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    pub(crate) fn metrics(&self) -> String {
        let (status, body) = http(&self.admin, "GET", "/metrics", Some(ADMIN), &[], "");
        assert_eq!(status, 200, "{body}");
        body
    }

    fn chat(&self, key: &str, headers: &[(&str, &str)], body: &str) -> (u16, String) {
        http(
            &self.api,
            "POST",
            "/v1/chat/completions",
            Some(key),
            headers,
            body,
        )
    }
}

/// One HTTP/1.1 exchange (Connection: close): (status, body).
pub(crate) fn http(
    addr: &str,
    method: &str,
    path: &str,
    key: Option<&str>,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String) {
    let mut s = send(addr, method, path, key, headers, body);
    let mut raw = String::new();
    s.read_to_string(&mut raw).expect("reads the response");
    parse_response(&raw)
}

fn send(
    addr: &str,
    method: &str,
    path: &str,
    key: Option<&str>,
    headers: &[(&str, &str)],
    body: &str,
) -> TcpStream {
    let mut s = TcpStream::connect(addr).expect("connects");
    s.set_read_timeout(Some(HTTP_LIMIT)).expect("timeout");
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    if let Some(k) = key {
        req.push_str(&format!("Authorization: Bearer {k}\r\n"));
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).expect("sends");
    s
}

fn parse_response(raw: &str) -> (u16, String) {
    let status = raw
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((raw, ""));
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(body)
    } else {
        body.to_owned()
    };
    (status, body)
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        body = rest[n..].trim_start_matches("\r\n");
    }
    out
}

pub(crate) fn json(body: &str) -> serde_json::Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
}

pub(crate) fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
        .unwrap_or(0)
}

/// Runs `f` on its own thread and fails the test if it takes longer than [`TEST_LIMIT`].
pub(crate) fn bounded(f: impl FnOnce() + Send + 'static) {
    let (tx, rx) = mpsc::channel();
    let handle = std::thread::spawn(move || {
        f();
        let _ = tx.send(());
    });
    match rx.recv_timeout(TEST_LIMIT) {
        Ok(()) => handle.join().expect("the test body"),
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            if let Err(p) = handle.join() {
                std::panic::resume_unwind(p);
            }
        }
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("the test ran past {TEST_LIMIT:?}"),
    }
}

fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("BULKHEAD_PYTHON") {
        return PathBuf::from(p);
    }
    let venv = repo().join(".venv/bin/python");
    assert!(
        venv.is_file(),
        "{} is missing: run scripts/setup (it installs the openai client)",
        venv.display()
    );
    venv
}

const QUESTION: &str =
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

        // Over the limit: 400 before any worker is contacted; no page was ever reserved.
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let health = || {
            runtime.block_on(async {
                let mut c = WorkerClient::connect(format!("http://{}", up.worker))
                    .await
                    .expect("connects to the worker");
                c.health(HealthRequest {})
                    .await
                    .expect("health")
                    .into_inner()
                    .pool
                    .expect("pool")
            })
        };
        let before = health();
        let long = format!(
            r#"{{"messages":[{{"role":"user","content":"{}"}}],"max_tokens":16}}"#,
            "hello ".repeat(9000)
        );
        let (status, body) = up.chat(KEY_A, &[], &long);
        assert_eq!(status, 400, "{body}");
        assert_eq!(json(&body)["error"]["code"], "context_length_exceeded");
        let (status, body) = up.chat(
            KEY_A,
            &[],
            r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":100000}"#,
        );
        assert_eq!(status, 400, "max_tokens alone over the limit: {body}");
        assert_eq!(json(&body)["error"]["code"], "context_length_exceeded");
        let after = health();
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

        // Over requests per minute (2): the third request in a row gets 429.
        let tiny = r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":1}"#;
        for _ in 0..2 {
            let (status, body) = up.chat(KEY_LIMITED, &[], tiny);
            assert_eq!(status, 200, "{body}");
        }
        let (status, body) = up.chat(KEY_LIMITED, &[], tiny);
        assert_eq!(status, 429, "{body}");
        assert_eq!(json(&body)["error"]["code"], "rate_limit_exceeded");

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
fn a_worker_dying_mid_stream_ends_the_stream_with_an_error_event() {
    bounded(|| {
        let up = Up::start(&["--kv-tokens", "4096"]);
        up.wait_routable();
        let body = r#"{"messages":[{"role":"user","content":"Tell me a long story."}],"max_tokens":2000,"stream":true,"temperature":0}"#;
        let mut s = send(
            &up.api,
            "POST",
            "/v1/chat/completions",
            Some(KEY_A),
            &[],
            body,
        );
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        while !String::from_utf8_lossy(&seen).contains("data:") {
            let n = s.read(&mut buf).expect("the stream starts");
            assert!(n > 0, "the stream ended before the kill");
            seen.extend_from_slice(&buf[..n]);
        }
        let killed = Command::new("kill")
            .args(["-KILL", &up.worker_pid.to_string()])
            .status()
            .expect("kill runs");
        assert!(killed.success());
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
    });
}
