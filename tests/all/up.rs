//! The `bulkhead up` harness of the end-to-end tests: the real binary (gateway in process,
//! workers as its children), the real model, plain HTTP over loopback.
//!
//! Each test starts its own `bulkhead up` on free loopback ports, runs under a time limit, and
//! stops it on the way out (the worker children die with it).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use bulkhead_worker::serve::cluster_token::{self, ClusterToken};
use bulkhead_worker::serve::proto::{HealthRequest, HealthResponse, PoolPages};
use bulkhead_worker::serve::tls::{self, ClusterTls, TlsFiles};

/// Upper bound for any one test, startup included.
pub const TEST_LIMIT: Duration = Duration::from_secs(240);
/// Upper bound for `bulkhead up` to load the model and bind.
pub const STARTUP_LIMIT: Duration = Duration::from_secs(90);
/// Upper bound for one HTTP exchange.
pub const HTTP_LIMIT: Duration = Duration::from_secs(60);

pub const KEY_A: &str = "sk-demo-tenant-a";
pub const KEY_B: &str = "sk-demo-tenant-b";
pub const ADMIN: &str = "sk-demo-admin";
pub const KEY_LIMITED: &str = "sk-test-limited";
pub const KEY_SERIAL: &str = "sk-test-serial";
/// A tenant of 20 tokens a minute.
pub const KEY_METERED: &str = "sk-test-metered";

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn sha256_hex(key: &str) -> String {
    bulkhead_gateway::keys::KeyHash::of(key).to_hex()
}

/// The default configuration with `replace`'s edits, plus two tenants with tight limits and
/// `extra` (TOML tables placed before the worker tables).
pub(crate) fn test_config(dir: &std::path::Path, replace: &[(&str, &str)], extra: &str) -> PathBuf {
    let mut text = std::fs::read_to_string(repo().join("deploy/local/gateway.toml"))
        .expect("deploy/local/gateway.toml");
    for (from, to) in replace {
        assert!(text.contains(from), "the default config has no {from:?}");
        text = text.replace(from, to);
    }
    // Move the worker table last so the appended tenants are not inside it.
    let (head, worker) = text
        .split_once("\n[[workers]]")
        .map(|(h, w)| (h.to_owned(), format!("\n[[workers]]{w}")))
        .expect("the default config has a worker");
    text = head;
    for (id, key, concurrent, rpm, tpm) in [
        ("tenant-limited", KEY_LIMITED, 8, 2, 1_000_000),
        ("tenant-serial", KEY_SERIAL, 1, 600, 1_000_000),
        ("tenant-metered", KEY_METERED, 8, 600, 20),
    ] {
        text.push_str(&format!(
            "\n[[tenants]]\nid = \"{id}\"\nkey_sha256 = [\"{}\"]\nmax_context = 8192\n\
             max_concurrent = {concurrent}\nrequests_per_minute = {rpm}\ntokens_per_minute = {tpm}\n",
            sha256_hex(key)
        ));
    }
    text.push_str(extra);
    text.push_str(&worker);
    let path = dir.join("gateway.toml");
    std::fs::write(&path, text).expect("writes the test config");
    path
}

/// The default configuration with its listeners on free ports and its workers replaced by one
/// colocated worker `one` at `grpc` (`http://host:port`), written in `dir`.
pub(crate) fn colocated_config(dir: &std::path::Path, grpc: &str) -> PathBuf {
    let text = std::fs::read_to_string(repo().join("deploy/local/gateway.toml"))
        .expect("the default config")
        .replace("127.0.0.1:8080", "127.0.0.1:0")
        .replace("127.0.0.1:9090", "127.0.0.1:0");
    let (head, _) = text.split_once("\n[[workers]]").expect("a worker table");
    let path = dir.join("colocated.toml");
    let one = format!("{head}\n[[workers]]\nname = \"one\"\ngrpc = \"{grpc}\"\nrole = \"both\"\n");
    std::fs::write(&path, one).expect("writes the config");
    path
}

/// A running `bulkhead up`; stopped when dropped.
pub struct Up {
    pub child: Child,
    pub api: String,
    pub admin: String,
    pub worker: String,
    pub worker_pid: u32,
    /// The prefill worker's gRPC address and process, when `up` started one.
    pub prefill: Option<String>,
    pub prefill_pid: Option<u32>,
    /// The gateway's data directory (the audit log is in `audit/`).
    pub data_dir: PathBuf,
    /// The gateway's configuration file (`POST /tenants/reload` reads it again).
    pub config: PathBuf,
    /// Started with `--tls`: the workers take only mutual TLS.
    pub tls: bool,
    _dir: TempDir,
}

/// How to start a `bulkhead up` beyond the defaults.
/// Where `bulkhead up` listens.
#[derive(Default)]
pub enum Ports {
    /// Free ones the kernel picks (`--port 0 --admin-port 0`).
    #[default]
    Free,
    /// The configuration's (no flag).
    Configured,
}

#[derive(Default)]
pub struct Options<'a> {
    /// Extra command-line arguments.
    pub args: &'a [&'a str],
    /// Extra TOML tables for the gateway's configuration.
    pub toml: &'a str,
    /// Text replacements in the default configuration (e.g. a setting's value).
    pub replace: &'a [(&'a str, &'a str)],
    /// A data directory to use (kept after the test); a fresh scratch one otherwise.
    pub data_dir: Option<PathBuf>,
    /// Extra environment variables of `bulkhead up` (its workers inherit them).
    pub env: &'a [(&'a str, &'a str)],
    /// The API and admin ports.
    pub ports: Ports,
    /// `bulkhead up` in a process group of its own, as a shell starts a command (a terminal's
    /// Ctrl-C goes to the whole group: [`Up::interrupt_group`]); it dies with the test.
    pub own_group: bool,
}

impl Drop for Up {
    fn drop(&mut self) {
        // Already gone (a test waited for it): its pid may be another process's now.
        if let Ok(Some(_)) = self.child.try_wait() {
            return;
        }
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
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(what: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!(
            "bulkhead-{what}-{}-{:x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Up {
    pub fn start(args: &[&str]) -> Up {
        Up::launch(Options {
            args,
            ..Options::default()
        })
    }

    pub fn launch(options: Options<'_>) -> Up {
        let dir = TempDir::new("gw");
        let config = test_config(&dir.0, options.replace, options.toml);
        let data_dir = options.data_dir.unwrap_or_else(|| dir.0.join("data"));
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
        let ports: Vec<String> = match options.ports {
            Ports::Free => ["--port", "0", "--admin-port", "0"]
                .map(str::to_owned)
                .to_vec(),
            Ports::Configured => Vec::new(),
        };
        let mut command = Command::new(env!("CARGO_BIN_EXE_bulkhead"));
        if options.own_group {
            use std::os::unix::process::CommandExt as _;
            command.process_group(0);
            // SAFETY: runs in the forked child before exec and calls only prctl(2), which is
            // async-signal-safe.
            unsafe {
                command.pre_exec(|| {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) == -1 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let mut child = command
            .arg("up")
            .arg("--model")
            .arg(&model)
            .args(["--threads", "1"])
            .args(&ports)
            .arg("--config")
            .arg(&config)
            .arg("--data-dir")
            .arg(&data_dir)
            .args(options.args)
            .env("BULKHEAD_LOG", "warn")
            .envs(options.env.iter().copied())
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
            prefill: None,
            prefill_pid: None,
            data_dir,
            config,
            tls: options.args.contains(&"--tls"),
            _dir: dir,
        };
        let ready = rx
            .recv_timeout(STARTUP_LIMIT)
            .expect("bulkhead up reports ready");
        for field in ready.split_whitespace() {
            let (k, v) = field.split_once('=').expect("key=value");
            match k {
                "api" | "admin" => {
                    let (_, addr) = v.split_once("://").expect("a URL");
                    let field = if k == "api" {
                        &mut up.api
                    } else {
                        &mut up.admin
                    };
                    *field = addr.to_owned();
                }
                // The worker requests are routed to: a colocated one, or the decode worker.
                "both" | "decode" => up.worker = v.to_owned(),
                "both_pid" | "decode_pid" => up.worker_pid = v.parse().expect("a pid"),
                "prefill" => up.prefill = Some(v.to_owned()),
                "prefill_pid" => up.prefill_pid = Some(v.parse().expect("a pid")),
                other => panic!("unexpected field {other}"),
            }
        }
        up
    }

    /// Waits (bounded) until the gateway routes to the worker.
    pub fn wait_routable(&self) {
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

    /// Sends `signal` (`-KILL`, `-STOP`, `-CONT`, …) to the serving (decode) worker.
    pub fn signal_worker(&self, signal: &str) {
        self::signal(signal, self.worker_pid);
    }

    /// `tenant`'s requests in flight, from the admin listener.
    pub fn in_flight(&self, tenant: &str) -> u64 {
        let (status, body) = http(&self.admin, "GET", "/tenants", Some(ADMIN), &[], "");
        assert_eq!(status, 200, "{body}");
        let tenants: serde_json::Value = serde_json::from_str(&body).expect("JSON");
        tenants["tenants"]
            .as_array()
            .and_then(|ts| ts.iter().find(|t| t["id"] == tenant))
            .and_then(|t| t["in_flight"].as_u64())
            .unwrap_or_else(|| panic!("no {tenant} in {body}"))
    }

    /// Sends `signal` to the prefill worker `up` started.
    pub fn signal_prefill(&self, signal: &str) {
        let pid = self.prefill_pid.expect("up started a prefill worker");
        self::signal(signal, pid);
    }

    /// Sends `signal` to `bulkhead up` itself (`-TERM`: it stops the stack, as Ctrl-C does).
    pub fn signal_up(&self, signal: &str) {
        self::signal(signal, self.child.id());
    }

    /// A terminal's Ctrl-C: SIGINT to every process of `up`'s group (started with
    /// [`Options::own_group`]).
    pub fn interrupt_group(&self) {
        let sent = Command::new("kill")
            .args(["-INT", "--", &format!("-{}", self.child.id())])
            .status()
            .expect("kill runs");
        assert!(sent.success(), "kill -INT -{}", self.child.id());
    }

    /// The gateway's `/metrics`, checked to be well formed text exposition.
    pub fn metrics(&self) -> String {
        let (status, body) = http(&self.admin, "GET", "/metrics", Some(ADMIN), &[], "");
        assert_eq!(status, 200, "{body}");
        assert_families_grouped(&body);
        body
    }

    /// The serving worker's health over gRPC: its pool's page counts and running requests.
    pub fn health(&self) -> HealthResponse {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            self.worker_client(Some(self.cluster_token()))
                .await
                .health(HealthRequest {})
                .await
                .expect("health")
                .into_inner()
        })
    }

    /// The cluster token `bulkhead up` made for this start (its workers require it).
    pub fn cluster_token(&self) -> ClusterToken {
        ClusterToken::read(&self.data_dir.join("cluster-token")).expect("up wrote its token")
    }

    /// A client of the serving worker that presents `token` (over the TLS `up --tls` made,
    /// with the gateway's certificate).
    pub async fn worker_client(&self, token: Option<ClusterToken>) -> cluster_token::Client {
        let tls = self.tls.then(|| self.tls_of("gateway"));
        self.worker_client_over(token, tls.as_ref())
            .await
            .expect("connects to the worker")
    }

    /// A client of the serving worker that presents `token`, over `tls` (or plain TCP).
    pub async fn worker_client_over(
        &self,
        token: Option<ClusterToken>,
        tls: Option<&ClusterTls>,
    ) -> Result<cluster_token::Client, tonic::transport::Error> {
        let channel = tls::endpoint(&format!("http://{}", self.worker), tls)
            .expect("a URI")
            .connect()
            .await?;
        Ok(cluster_token::client(channel, token))
    }

    /// With `--tls`: the TLS of the process `up` called `name` (its certificate and key).
    pub fn tls_of(&self, name: &str) -> ClusterTls {
        let dir = self.data_dir.join("tls");
        ClusterTls::load(&TlsFiles {
            ca: dir.join("ca.pem"),
            cert: dir.join(format!("{name}.pem")),
            key: dir.join(format!("{name}.key")),
        })
        .expect("up --tls wrote its certificates")
    }

    /// The serving worker's pool pages.
    pub fn pool(&self) -> PoolPages {
        self.health().pool.expect("the worker reports its pool")
    }

    /// Waits (bounded) until the serving worker runs nothing and every page is available.
    pub fn wait_pool_drained(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let h = self.health();
            let pool = h.pool.expect("the worker reports its pool");
            if crate::worker_grpc::available(&pool) == pool.total && h.running == 0 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "pages still held: {pool:?}, {} running",
                h.running
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Every record of `tenant`, read through the admin listener.
    pub fn admin_records(&self, tenant: &str) -> Vec<serde_json::Value> {
        admin_records(&self.admin, tenant)
    }

    /// Waits (bounded) until `tenant` has `n` records; returns what it has then.
    pub fn wait_records(&self, tenant: &str, n: usize) -> Vec<serde_json::Value> {
        wait_records(&self.admin, tenant, n)
    }

    pub fn chat(&self, key: &str, headers: &[(&str, &str)], body: &str) -> (u16, String) {
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

/// Posts the streamed chat completion `body` to `api` as `key` and reads until its first data
/// event: the connection, and what was read.
pub fn stream_under_way(api: &str, key: &str, body: &str) -> (TcpStream, Vec<u8>) {
    let mut s = send(api, "POST", "/v1/chat/completions", Some(key), &[], body);
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("data:") {
        let n = s.read(&mut buf).expect("the stream starts");
        assert!(n > 0, "the stream ended before its first event");
        seen.extend_from_slice(&buf[..n]);
    }
    (s, seen)
}

/// One HTTP/1.1 exchange (Connection: close): (status, body).
pub fn http(
    addr: &str,
    method: &str,
    path: &str,
    key: Option<&str>,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String) {
    let (status, _, body) = exchange(addr, method, path, key, headers, body);
    (status, body)
}

/// One HTTP/1.1 exchange (Connection: close): (status, response head, body).
pub fn exchange(
    addr: &str,
    method: &str,
    path: &str,
    key: Option<&str>,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String, String) {
    let mut s = send(addr, method, path, key, headers, body);
    let mut raw = String::new();
    s.read_to_string(&mut raw).expect("reads the response");
    let (status, body) = parse_response(&raw);
    let head = raw.split_once("\r\n\r\n").map_or(raw.as_str(), |(h, _)| h);
    (status, head.to_owned(), body)
}

/// The value of header `name` in a response head.
pub fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

pub fn send(
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

/// The configuration's replacement that makes the gateway's silence timeout 2 s (from 120).
pub const SILENCE_2S: (&str, &str) = (
    "stream_idle_timeout_secs = 120",
    "stream_idle_timeout_secs = 2",
);

/// Tenant-b's answer (counting on, 900 tokens: seconds), under way until its connection is
/// dropped. With `--decode-kv-tokens 1024` it holds most of decode's pages, and a request of
/// [`QUEUED_BEHIND`] waits in decode's queue.
pub fn a_long_answer_holding_decode(up: &Up) -> TcpStream {
    let holder = r#"{"prompt":"1, 2, 3, 4, 5, 6, 7, 8, 9, 10,","max_tokens":900,"temperature":0,"stream":true}"#;
    let mut holding = open(&up.api, KEY_B, "/v1/completions", holder);
    let mut head = [0u8; 12];
    holding
        .read_exact(&mut head)
        .expect("the holder's answer starts");
    assert!(head.starts_with(b"HTTP/1.1 200"), "{head:?}");
    holding
}

/// A chat request too large for what [`a_long_answer_holding_decode`] leaves of decode's pool.
pub const QUEUED_BEHIND: &str =
    r#"{"messages":[{"role":"user","content":"Say hello."}],"max_tokens":400,"temperature":0}"#;

/// Sends `signal` to process `pid`.
fn signal(signal: &str, pid: u32) {
    let sent = Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .expect("kill runs");
    assert!(sent.success(), "kill {signal} {pid}");
}

/// Sends a POST with `key` on a keep-alive connection (so that the gateway sees the socket
/// close when the client leaves) and returns the connection, to read as far as the test likes.
pub fn open(addr: &str, key: &str, path: &str, body: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).expect("connects");
    s.set_read_timeout(Some(HTTP_LIMIT)).expect("timeout");
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: localhost\r\n\
         Authorization: Bearer {key}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("sends");
    s
}

/// A raw HTTP/1.1 response (complete or not): its status (0 before the status line) and its
/// body, de-chunked as far as whole chunks arrived.
pub fn parse_response(raw: &str) -> (u16, String) {
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

/// Every audit record of `tenant`, read through the gateway's admin listener at `admin`.
pub fn admin_records(admin: &str, tenant: &str) -> Vec<serde_json::Value> {
    let (status, body) = http(
        admin,
        "GET",
        &format!("/audit/{tenant}?limit=1000"),
        Some(ADMIN),
        &[],
        "",
    );
    assert_eq!(status, 200, "{body}");
    records(&json(&body))
}

/// Waits (bounded) until `tenant` has `n` audit records; returns what it has then.
pub fn wait_records(admin: &str, tenant: &str, n: usize) -> Vec<serde_json::Value> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let got = admin_records(admin, tenant);
        if got.len() >= n {
            return got;
        }
        assert!(
            Instant::now() < deadline,
            "{tenant}: {} of the {n} records awaited after 30 s: {got:#?}",
            got.len()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The records of a page of the audit API (`data[].record`).
pub fn records(page: &serde_json::Value) -> Vec<serde_json::Value> {
    page["data"]
        .as_array()
        .expect("data is a list")
        .iter()
        .map(|e| e["record"].clone())
        .collect()
}

pub fn json(body: &str) -> serde_json::Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
}

/// Every sample of a metric family follows its own `# TYPE` line, before the next family's,
/// as Prometheus's text format requires (a scrape whose families interleave is refused by
/// strict parsers, or read as the same family twice).
pub fn assert_families_grouped(text: &str) {
    let mut families: Vec<&str> = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let name = rest.split(' ').next().unwrap_or_default();
            assert!(!families.contains(&name), "{name} typed twice:\n{text}");
            families.push(name);
            continue;
        }
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let sample = line.split(['{', ' ']).next().unwrap_or_default();
        let current = families.last().copied().unwrap_or_default();
        let of_current = sample == current
            || ["_bucket", "_sum", "_count"]
                .iter()
                .any(|suffix| sample.strip_suffix(suffix) == Some(current));
        assert!(
            of_current,
            "{sample} outside its family (after {current}):\n{text}"
        );
    }
}

pub fn metric(text: &str, name: &str) -> u64 {
    // A series not yet counted is absent (0); its family must be there, or the name is wrong
    // and a count of 0 would show nothing.
    let series = name.split_once('{').map_or(name, |(f, _)| f);
    let family = |f: &str| text.contains(&format!("# TYPE {f} "));
    assert!(
        family(series)
            || ["_total", "_count", "_sum", "_bucket"]
                .iter()
                .any(|s| series.strip_suffix(s).is_some_and(family)),
        "no metric family for {series} in:\n{text}"
    );
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
        .unwrap_or(0)
}

/// Runs `f` on its own thread and fails the test if it takes longer than [`TEST_LIMIT`].
pub fn bounded(f: impl FnOnce() + Send + 'static) {
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

pub fn python() -> PathBuf {
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

/// `tenant`'s records as the files under `data` (a gateway's `--data-dir`) hold them.
pub fn on_disk(data: &Path, tenant: &str) -> Vec<serde_json::Value> {
    let dir = data.join("audit").join(tenant);
    let mut segments: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("an entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "jsonl"))
        .collect();
    segments.sort();
    segments
        .iter()
        .flat_map(|p| {
            let text = std::fs::read_to_string(p).expect("reads a segment");
            text.lines().map(json).collect::<Vec<_>>()
        })
        .collect()
}
