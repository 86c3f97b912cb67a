//! `bulkhead worker` end to end: the real binary, the real model, a tonic client.
//!
//! Every test starts its own worker on free loopback ports (`--listen 127.0.0.1:0`; the worker
//! prints the bound addresses), runs under a time limit, and kills the worker on the way out.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use bulkhead_worker::serve::proto::{
    self, ChatMessage, ChatPrompt, GenerateRequest, HealthRequest, InfoRequest, Item, Prompt,
    TokenPrompt, WorkerClient, error_code,
};
use tonic::transport::Channel;

use crate::up::TempDir;

/// Upper bound for any one test, startup included.
const TEST_LIMIT: Duration = Duration::from_secs(180);
/// Upper bound for a worker to load the model and bind its ports.
const STARTUP_LIMIT: Duration = Duration::from_secs(60);

pub(crate) fn model_path() -> PathBuf {
    let path = match std::env::var_os("BULKHEAD_MODEL") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(std::env::var_os("HOME").expect("HOME is set"))
            .join(".cache/bulkhead/models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    };
    assert!(
        path.is_file(),
        "the test model {} is missing: run scripts/fetch-model (or set BULKHEAD_MODEL)",
        path.display()
    );
    path
}

/// Where a worker process runs: in a network namespace or this one, bound to an address, and
/// reached by the tests at an address.
pub(crate) struct Place<'a> {
    /// `ip netns exec` this namespace (`None`: the test's own).
    pub netns: Option<&'a str>,
    /// The IP the worker binds its gRPC and admin ports to.
    pub bind: &'a str,
    /// Where the test reaches a worker bound to the unspecified address.
    pub reach: IpAddr,
}

impl Place<'_> {
    pub(crate) const LOCAL: Place<'static> = Place {
        netns: None,
        bind: "127.0.0.1",
        reach: IpAddr::V4(Ipv4Addr::LOCALHOST),
    };
}

fn command(args: &[&str]) -> Command {
    command_in(&Place::LOCAL, &model_path(), args)
}

/// `bulkhead worker --model MODEL` at `place` with `args`; gRPC and admin on free ports of the
/// place's bind address unless `args` name a `--listen` address.
fn command_in(place: &Place<'_>, model: &Path, args: &[&str]) -> Command {
    let mut cmd = match place.netns {
        None => Command::new(env!("CARGO_BIN_EXE_bulkhead")),
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, env!("CARGO_BIN_EXE_bulkhead")]);
            c
        }
    };
    let (listen, admin) = (format!("{}:0", place.bind), format!("{}:0", place.bind));
    cmd.arg("worker")
        .arg("--model")
        .arg(model)
        .args(["--threads", "1", "--admin-listen", &admin]);
    if !args.contains(&"--listen") {
        cmd.args(["--listen", &listen]);
    }
    cmd.args(args)
        .env_remove("BULKHEAD_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// A running worker; killed when dropped (the scale tests start theirs through it too).
pub(crate) struct Worker {
    pub child: Child,
    pub grpc: SocketAddr,
    pub admin: SocketAddr,
    /// Decode role: the KV data-plane listener.
    pub kv: Option<SocketAddr>,
    pub stderr: Arc<Mutex<String>>,
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Collects a child's stderr in the background, for failure messages.
pub(crate) fn collect(stream: impl Read + Send + 'static) -> Arc<Mutex<String>> {
    let text = Arc::new(Mutex::new(String::new()));
    let sink = text.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stream).lines().map_while(Result::ok) {
            if let Ok(mut t) = sink.lock() {
                t.push_str(&line);
                t.push('\n');
            }
        }
    });
    text
}

pub(crate) fn text_of(s: &Mutex<String>) -> String {
    s.lock().map(|t| t.clone()).unwrap_or_default()
}

/// Waits (bounded) until `needle` shows up in collected output; returns all of it.
async fn wait_for_text(s: &Mutex<String>, needle: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !text_of(s).contains(needle) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    text_of(s)
}

impl Worker {
    /// Starts `bulkhead worker` with `args` and waits for its ready line.
    pub(crate) fn start(args: &[&str]) -> Worker {
        Worker::start_in(&Place::LOCAL, args)
    }

    /// Starts `bulkhead worker` with `args` at `place` and waits for its ready line.
    pub(crate) fn start_in(place: &Place<'_>, args: &[&str]) -> Worker {
        Worker::start_with(place, args, &[])
    }

    /// [`Worker::start_in`], with `env` added to the worker's environment.
    pub(crate) fn start_with(place: &Place<'_>, args: &[&str], env: &[(&str, &str)]) -> Worker {
        let mut command = command_in(place, &model_path(), args);
        Worker::ready(command.envs(env.iter().copied()), place)
    }

    /// Starts `bulkhead worker` on the model file `model` with `args`, and waits for its ready
    /// line.
    pub(crate) fn start_on(model: &Path, args: &[&str]) -> Worker {
        Worker::ready(&mut command_in(&Place::LOCAL, model, args), &Place::LOCAL)
    }

    /// Runs `command` and waits for its ready line.
    fn ready(command: &mut Command, place: &Place<'_>) -> Worker {
        let mut child = command.spawn().expect("the bulkhead binary starts");
        let stdout = child.stdout.take().expect("stdout is piped");
        let stderr = collect(child.stderr.take().expect("stderr is piped"));
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(rest) = line.strip_prefix("bulkhead worker ready ") {
                    let _ = tx.send(rest.to_owned());
                }
            }
        });
        let mut worker = Worker {
            child,
            grpc: SocketAddr::from(([0, 0, 0, 0], 0)),
            admin: SocketAddr::from(([0, 0, 0, 0], 0)),
            kv: None,
            stderr,
        };
        let ready = match rx.recv_timeout(STARTUP_LIMIT) {
            Ok(line) => line,
            Err(e) => panic!(
                "the worker did not report ready ({e}); stderr:\n{}",
                text_of(&worker.stderr)
            ),
        };
        for field in ready.split_whitespace() {
            let (key, value) = field.split_once('=').expect("key=value");
            let mut addr: SocketAddr = value.parse().expect("an address");
            if addr.ip().is_unspecified() {
                addr.set_ip(place.reach);
            }
            match key {
                "grpc" => worker.grpc = addr,
                "admin" => worker.admin = addr,
                "kv" => worker.kv = Some(addr),
                other => panic!("unexpected field {other} in the ready line"),
            }
        }
        worker
    }

    pub(crate) async fn client(&self) -> WorkerClient<Channel> {
        WorkerClient::connect(format!("http://{}", self.grpc))
            .await
            .expect("connects to the worker")
    }

    /// A plain HTTP/1.1 GET on the admin port: (status line, body).
    /// The worker's `/metrics` text.
    pub(crate) fn metrics(&self) -> String {
        let (status, body) = self.admin_get("/metrics");
        assert!(status.contains(" 200 "), "{status}");
        body
    }

    pub(crate) fn admin_get(&self, path: &str) -> (String, String) {
        let mut s = TcpStream::connect(self.admin).expect("connects to the admin port");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("sets a timeout");
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
        )
        .expect("sends the request");
        let mut response = String::new();
        s.read_to_string(&mut response).expect("reads the response");
        let (head, body) = response.split_once("\r\n\r\n").expect("a head and a body");
        let status = head.lines().next().unwrap_or_default().to_owned();
        (status, body.to_owned())
    }
}

/// The value of one series (`name` or `name{labels}`) in a Prometheus exposition.
pub(crate) fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(series)?
                .strip_prefix(' ')?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("{series} missing from /metrics:\n{text}"))
}

/// The sum of every labelled series of `family`.
pub(crate) fn metric_sum(text: &str, family: &str) -> f64 {
    let prefix = format!("{family}{{");
    text.lines()
        .filter(|l| l.starts_with(&prefix))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

pub(crate) async fn health(client: &mut WorkerClient<Channel>) -> proto::HealthResponse {
    client
        .health(HealthRequest {})
        .await
        .expect("health answers")
        .into_inner()
}

pub(crate) fn pool(h: &proto::HealthResponse) -> proto::PoolPages {
    h.pool.expect("health reports the pool")
}

/// Pages no request holds: free, waiting for their scrub, or in a tenant's prefix cache
/// (evicted as soon as a reservation needs them).
pub(crate) fn available(p: &proto::PoolPages) -> u32 {
    p.free + p.pending_scrub + p.cached
}

pub(crate) fn chat(content: &str, max_new_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        request_id: "test".into(),
        tenant: "tenant-a".into(),
        prompt: Some(Prompt::Chat(ChatPrompt {
            messages: vec![ChatMessage {
                role: "user".into(),
                content: content.into(),
            }],
        })),
        max_new_tokens,
        sampling: None,
        stop: Vec::new(),
        ignore_eos: false,
        cache_salt: String::new(),
        instance_id: String::new(),
    }
}

pub(crate) async fn bounded<F: std::future::Future<Output = ()>>(f: F) {
    tokio::time::timeout(TEST_LIMIT, f)
        .await
        .expect("the test finished within its time limit");
}

#[tokio::test]
async fn greedy_chat_generation_streams_the_answer_and_counts_usage() {
    bounded(async {
        let worker = Worker::start(&["--kv-tokens", "2048"]);
        let mut client = worker.client().await;
        let mut stream = client
            .generate(chat("What is 2+2?", 48))
            .await
            .expect("the request is admitted")
            .into_inner();
        let (mut text, mut tokens, mut done) = (String::new(), 0u32, None);
        while let Some(item) = stream.message().await.expect("no stream error") {
            assert!(done.is_none(), "nothing follows Done");
            match item.item.expect("every item has a body") {
                Item::Token(t) => {
                    tokens += 1;
                    text.push_str(&t.text);
                }
                Item::Done(d) => {
                    text.push_str(&d.text_tail);
                    done = Some(d);
                }
                Item::Progress(_) => assert_eq!(tokens, 0, "progress after the first token"),
                Item::PrefillDone(_) => panic!("a colocated worker has no prefill worker"),
            }
        }
        let done = done.expect("the stream ends with Done");
        assert!(text.contains('4'), "the answer to 2+2 has a 4: {text:?}");
        assert_eq!(done.completion_tokens, tokens, "usage counts every token");
        assert!(
            done.prompt_tokens > 5,
            "the chat template adds a system prompt"
        );
        assert_eq!(done.finish_reason(), proto::FinishReason::Stop, "{text:?}");
    })
    .await;
}

#[tokio::test]
async fn a_caller_hears_of_the_prompts_progress_until_its_first_token() {
    bounded(async {
        // 32 prompt tokens a step: a prompt of about 600 takes many steps, each one a report.
        let worker = Worker::start(&["--kv-tokens", "2048", "--max-batch-tokens", "32"]);
        let mut client = worker.client().await;
        let long = "Tell me about the history of the harbour town and its ships. ".repeat(45);
        let Run {
            progress, tokens, ..
        } = run_reporting(&mut client, chat(&long, 4))
            .await
            .expect("served");
        assert!(tokens >= 1, "{tokens}");
        assert!(progress.len() >= 2, "{progress:?}");
        assert!(progress.is_sorted_by(|a, b| a < b), "{progress:?}");
        let computed = metric(&worker.metrics(), "bulkhead_prompt_tokens_computed_total");
        assert!(
            progress.last().is_some_and(|&last| last as f64 <= computed),
            "{progress:?} against {computed}"
        );
        assert!(computed > 500.0, "{computed}");
    })
    .await;
}

/// A request queued behind an answer is answered once it starts, not while it waits: a
/// refusal while it waits is then the call's answer (see
/// `a_colocated_request_refused_in_the_queue_is_refused_as_the_calls_answer`), and a caller
/// that waits on the call knows it queued (a gateway tells a disconnect's policy so).
#[tokio::test]
async fn a_request_queued_behind_an_answer_is_answered_once_it_starts() {
    bounded(async {
        // One request runs at a time: the second waits in the queue while the first generates.
        let worker = Worker::start(&["--kv-tokens", "2048", "--max-running", "1"]);
        let mut running = under_way(&mut worker.client().await, counting(300)).await;
        let mut queued = worker.client().await;
        let call =
            tokio::spawn(async move { run_reporting(&mut queued, chat("Say hello.", 4)).await });
        wait_for_queue_depth(&worker, 1).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!call.is_finished(), "answered while its request waits");
        let mut ahead = 0;
        while running
            .message()
            .await
            .expect("the answer ahead runs")
            .is_some()
        {
            ahead += 1;
        }
        assert!(ahead > 100, "{ahead}");
        let Run { tokens, .. } = call
            .await
            .expect("joins")
            .expect("served after the answer ahead of it");
        assert!(tokens >= 1, "{tokens}");
    })
    .await;
}

/// Waits (within the test's bound) until `worker` has `depth` requests waiting for pages.
async fn wait_for_queue_depth(worker: &Worker, depth: u32) {
    let mut client = worker.client().await;
    while health(&mut client).await.queue_depth != depth {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A colocated worker answers a call once its request leaves the queue: one refused there (no
/// pages came free within the queue timeout) gets the refusal as the call's answer, so that a
/// gateway can answer its client 429 before an answer starts, streamed or not. Answered at
/// once, it was refused mid-stream, and a streamed chat got 200 and then an error event.
#[tokio::test]
async fn a_colocated_request_refused_in_the_queue_is_refused_as_the_calls_answer() {
    bounded(async {
        let worker = Worker::start(&["--kv-tokens", "256", "--queue-timeout-ms", "500"]);
        let long = counting(200);
        let mut running = under_way(&mut worker.client().await, long.clone()).await;
        let started = Instant::now();
        let err = worker
            .client()
            .await
            .generate(long)
            .await
            .expect_err("no pages came free in time");
        assert!(
            started.elapsed() >= Duration::from_millis(500),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
        assert_eq!(error_code(&err), Some("rate_limit_exceeded"), "{err:?}");
        let next = running.message().await.expect("the first request runs on");
        assert!(next.is_some());
    })
    .await;
}

#[tokio::test]
async fn info_reports_the_measured_pool_and_served_context() {
    bounded(async {
        let worker = Worker::start(&["--kv-tokens", "2000"]);
        let mut client = worker.client().await;
        let info = client
            .info(InfoRequest {
                include_tokenizer: true,
            })
            .await
            .expect("info answers")
            .into_inner();
        assert_eq!(info.page_tokens, 16);
        assert_eq!(info.pool_pages, 125, "2000 tokens are 125 pages of 16");
        assert_eq!(info.pool_tokens, 2000);
        assert_eq!(info.model_context_length, 8192);
        assert_eq!(
            info.context_length,
            info.model_context_length.min(info.pool_tokens)
        );
        assert!(info.page_bytes > 0);
        assert_eq!(info.architecture, "llama");
        assert_eq!(info.vocab_size, 49152);
        assert_eq!((info.bos_token_id, info.eos_token_id), (Some(1), 2));
        assert!(info.chat_template.contains("im_start"));
        assert_eq!(info.role(), proto::Role::Both);
        let tokenizer = info.tokenizer.expect("the tokenizer was asked for");
        assert_eq!(tokenizer.model, "gpt2");
        assert_eq!(tokenizer.tokens.len(), 49152);
        assert_eq!(tokenizer.token_types.len(), 49152);
        assert_eq!(tokenizer.merges.len(), 48900);
        // A request names the process its caller checked: this one serves it, another at the
        // address (after a restart) refuses it as unavailable, so the caller checks again.
        let named = |instance: &str| GenerateRequest {
            instance_id: instance.into(),
            ..chat("Hi", 1)
        };
        let refused = client
            .generate(named("the-process-before-a-restart"))
            .await
            .expect_err("another process was checked");
        assert_eq!(
            refused.code(),
            tonic::Code::FailedPrecondition,
            "{refused:?}"
        );
        assert_eq!(
            refused
                .metadata()
                .get(proto::ERROR_CODE_KEY)
                .map(|v| v.as_bytes()),
            Some(&b"service_unavailable"[..])
        );
        client
            .generate(named(&info.instance_id))
            .await
            .expect("the process that was checked serves it");
    })
    .await;
}

#[tokio::test]
async fn a_context_longer_than_the_pool_refuses_to_start() {
    bounded(async {
        let mut child = command(&["--kv-tokens", "1024", "--context-length", "4096"])
            .spawn()
            .expect("the bulkhead binary starts");
        let stderr = collect(child.stderr.take().expect("stderr is piped"));
        let deadline = Instant::now() + STARTUP_LIMIT;
        let status = loop {
            if let Some(status) = child.try_wait().expect("waits on the child") {
                break status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("the worker started with a context longer than its pool");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert!(!status.success(), "the worker must exit non-zero");
        // The stderr reader may still be draining the pipe after exit.
        let text = wait_for_text(&stderr, "--kv-memory").await;
        assert!(text.contains("--kv-memory"), "stderr: {text}");
    })
    .await;
}

#[tokio::test]
async fn an_over_length_request_is_refused_before_any_page_is_taken() {
    bounded(async {
        let worker = Worker::start(&["--kv-tokens", "1024"]);
        let mut client = worker.client().await;
        let before = pool(&health(&mut client).await);
        assert_eq!(before.free, before.total);
        let request = GenerateRequest {
            request_id: "too-long".into(),
            tenant: "tenant-a".into(),
            prompt: Some(Prompt::Tokens(TokenPrompt {
                ids: vec![100; 1000],
            })),
            max_new_tokens: 100,
            ..GenerateRequest::default()
        };
        let err = client
            .generate(request)
            .await
            .expect_err("1000 + 100 tokens do not fit a 1024-token context");
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
        assert_eq!(error_code(&err), Some("context_length_exceeded"), "{err:?}");
        let after = health(&mut client).await;
        assert_eq!(after.status(), proto::ServingStatus::Serving);
        assert_eq!(pool(&after), before, "the pool is untouched");
        assert_eq!((after.queue_depth, after.running), (0, 0));
        let (_, metrics) = worker.admin_get("/metrics");
        assert!(
            metrics.contains("bulkhead_requests_total{outcome=\"rejected_context_length\"} 1"),
            "{metrics}"
        );
    })
    .await;
}

#[tokio::test]
async fn dropping_the_stream_returns_every_page_to_the_pool() {
    bounded(async {
        let worker = Worker::start(&["--kv-tokens", "2048"]);
        let mut client = worker.client().await;
        let mut stream = client
            .generate(counting(1000))
            .await
            .expect("the request is admitted")
            .into_inner();
        let first = stream.message().await.expect("no stream error");
        assert!(
            matches!(first.and_then(|r| r.item), Some(Item::Token(_))),
            "a token arrives first"
        );
        let during = pool(&health(&mut client).await);
        assert!(
            during.owned > 0 && during.free < during.total,
            "the running request holds pages: {during:?}"
        );
        drop(stream);

        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let h = health(&mut client).await;
            let p = pool(&h);
            if available(&p) == p.total && h.running == 0 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "pages still held after the client left: {h:?}\n{}",
                text_of(&worker.stderr)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let (_, metrics) = worker.admin_get("/metrics");
        assert!(
            metrics.contains("bulkhead_requests_total{outcome=\"cancelled\"} 1"),
            "{metrics}"
        );
    })
    .await;
}

#[tokio::test]
async fn the_admin_port_serves_metrics_and_health() {
    bounded(async {
        let worker = Worker::start(&["--kv-tokens", "2000"]);
        let (status, body) = worker.admin_get("/metrics");
        assert!(status.contains(" 200 "), "{status}");
        assert!(
            body.contains("bulkhead_kv_pool_capacity_tokens 2000"),
            "{body}"
        );
        assert!(
            body.contains("bulkhead_served_context_tokens 2000"),
            "{body}"
        );
        assert!(
            body.contains("bulkhead_kv_pool_pages{state=\"free\"} 125"),
            "{body}"
        );
        let (status, body) = worker.admin_get("/healthz");
        assert!(status.contains(" 200 "), "{status}");
        assert_eq!(body.trim(), "ok");
        let log = wait_for_text(&worker.stderr, "KV pool measured").await;
        assert!(
            log.contains("KV pool measured"),
            "info is logged by default: {log}"
        );
    })
    .await;
}

#[tokio::test]
async fn a_full_queue_is_resource_exhausted_with_rate_limit_exceeded() {
    bounded(async {
        let worker = Worker::start(&[
            "--kv-tokens",
            "2048",
            "--max-running",
            "1",
            "--queue-capacity",
            "1",
        ]);
        let mut client = worker.client().await;
        let long = counting(500);
        let _running = under_way(&mut client, long.clone()).await;
        // The second waits in the queue; its call is answered once it starts.
        let mut second = worker.client().await;
        let waiting = long.clone();
        let _waiting = tokio::spawn(async move { second.generate(waiting).await.map(|_| ()) });
        wait_for_queue_depth(&worker, 1).await;
        let err = client
            .generate(long)
            .await
            .expect_err("a third request finds the queue full");
        assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
        assert_eq!(error_code(&err), Some("rate_limit_exceeded"), "{err:?}");
    })
    .await;
}

/// Streams a request to the end: (text, completion tokens) or the error status.
pub(crate) async fn run_to_end(
    client: &mut WorkerClient<Channel>,
    request: GenerateRequest,
) -> Result<(String, u32), tonic::Status> {
    run_reporting(client, request)
        .await
        .map(|run| (run.text, run.tokens))
}

/// A request's stream, read to its end.
pub(crate) struct Run {
    /// The progress reports, all before the first token.
    pub progress: Vec<u64>,
    /// The worker said prefill computed the prompt (once, before the first token).
    pub prefill_done: bool,
    pub text: String,
    pub tokens: u32,
}

/// [`run_to_end`], with what came before the first token (none of it may come after).
pub(crate) async fn run_reporting(
    client: &mut WorkerClient<Channel>,
    request: GenerateRequest,
) -> Result<Run, tonic::Status> {
    let mut stream = client.generate(request).await?.into_inner();
    let mut run = Run {
        progress: Vec::new(),
        prefill_done: false,
        text: String::new(),
        tokens: 0,
    };
    while let Some(item) = stream.message().await? {
        match item.item.expect("every item has a body") {
            Item::Token(t) => {
                run.tokens += 1;
                run.text.push_str(&t.text);
            }
            Item::Done(d) => run.text.push_str(&d.text_tail),
            Item::Progress(p) => {
                assert_eq!(run.tokens, 0, "progress after the first token");
                run.progress.push(p.computed_tokens);
            }
            Item::PrefillDone(_) => {
                assert_eq!(run.tokens, 0, "prefill done after the first token");
                assert!(!run.prefill_done, "prefill done twice");
                run.prefill_done = true;
            }
        }
    }
    Ok(run)
}

/// Polls `worker` until every page is available again ([`available`]), within a bound.
pub(crate) async fn wait_all_pages_back(worker: &Worker) -> proto::PoolPages {
    let mut client = worker.client().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let p = pool(&health(&mut client).await);
        if available(&p) == p.total || Instant::now() > deadline {
            return p;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A prefill worker and a decode worker wired to it.
fn disaggregated(prefill_tokens: &str, decode_tokens: &str) -> (Worker, Worker) {
    let prefill = Worker::start(&["--role", "prefill", "--kv-tokens", prefill_tokens]);
    let decode = decode_for(&prefill, &["--kv-tokens", decode_tokens]);
    assert!(
        decode.kv.is_some(),
        "the decode worker reports its KV listener"
    );
    (prefill, decode)
}

#[tokio::test]
async fn prefill_and_decode_processes_answer_like_a_colocated_worker() {
    bounded(async {
        let (prefill, decode) = disaggregated("2048", "2048");
        let both = Worker::start(&["--kv-tokens", "2048"]);
        let request = chat("What is 2+2?", 24);
        let split = run_reporting(&mut decode.client().await, request.clone())
            .await
            .expect("disaggregated answer");
        let colocated = run_reporting(&mut both.client().await, request)
            .await
            .expect("colocated answer");
        assert!(split.text.contains('4'), "{}", split.text);
        assert_eq!(
            (&split.text, split.tokens),
            (&colocated.text, colocated.tokens),
            "greedy output does not depend on where prefill ran"
        );
        // Decode says when prefill computed the prompt (the request is transferring); a
        // colocated worker has nothing to say.
        assert!(split.prefill_done);
        assert!(!colocated.prefill_done);
        for w in [&prefill, &decode] {
            let p = wait_all_pages_back(w).await;
            assert_eq!(available(&p), p.total, "{p:?}");
            assert_eq!(p.quarantined, 0);
        }
        let metrics = decode.metrics();
        assert!(
            metric(&metrics, "bulkhead_kv_frames_written_total") >= 3.0,
            "the prompt's pages came over the data plane"
        );
        assert_eq!(
            metric_sum(&metrics, "bulkhead_kv_frames_dropped_total"),
            0.0
        );
        // Each counts the request as its part of it ended: decode's answer, prefill's KV sent.
        let served = |m: &str| {
            metric(m, "bulkhead_requests_total{outcome=\"stop\"}")
                + metric(m, "bulkhead_requests_total{outcome=\"length\"}")
        };
        assert_eq!(served(&metrics), 1.0, "{metrics}");
        let m = prefill.metrics();
        assert_eq!(
            metric(&m, "bulkhead_requests_total{outcome=\"prefilled\"}"),
            1.0,
            "{m}"
        );
        assert_eq!(served(&m), 0.0, "{m}");
        for (w, side) in [(&decode, "receive"), (&prefill, "send")] {
            let m = w.metrics();
            let in_flight = format!("bulkhead_kv_transfers_in_flight{{side=\"{side}\"}}");
            assert_eq!(metric(&m, &in_flight), 0.0, "{m}");
            let tokens = format!("bulkhead_kv_in_flight_tokens{{side=\"{side}\"}}");
            assert_eq!(metric(&m, &tokens), 0.0, "{m}");
        }
    })
    .await;
}

#[tokio::test]
async fn a_prompt_over_the_prefill_pool_is_refused_with_context_length_exceeded() {
    bounded(async {
        // Decode's pool fits the prompt, prefill's does not: the incident's asymmetry.
        let (prefill, decode) = disaggregated("64", "4096");
        let long = "Tell me everything about the history of the harbour town. ".repeat(8);
        let err = run_to_end(&mut decode.client().await, chat(&long, 16))
            .await
            .expect_err("prefill must refuse");
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
        assert_eq!(error_code(&err), Some("context_length_exceeded"), "{err:?}");
        // In the request's own numbers (16 to generate), not prefill's one token.
        assert!(
            err.message().contains(" + 16 to generate)"),
            "{}",
            err.message()
        );
        // Prefill counts its own refusal.
        let m = prefill.metrics();
        assert_eq!(
            metric(
                &m,
                "bulkhead_requests_total{outcome=\"rejected_context_length\"}"
            ),
            1.0,
            "{m}"
        );
        let p = wait_all_pages_back(&decode).await;
        assert_eq!(
            available(&p),
            p.total,
            "decode released its reservation: {p:?}"
        );
        let p = pool(&health(&mut prefill.client().await).await);
        assert_eq!(p.free, p.total, "prefill never allocated: {p:?}");
    })
    .await;
}

#[tokio::test]
async fn a_prefill_worker_killed_mid_request_fails_it_fast_and_decode_gets_its_pages_back() {
    bounded(async {
        let (mut prefill, decode) = disaggregated("8192", "8192");
        let long = "Describe the harbour, the boats, the market and the people in great detail. "
            .repeat(60);
        let mut client = decode.client().await;
        let request = tokio::spawn(async move { run_to_end(&mut client, chat(&long, 16)).await });
        // Wait until the prefill worker is computing the prompt, then kill it.
        let mut pc = prefill.client().await;
        let deadline = Instant::now() + Duration::from_secs(30);
        while health(&mut pc).await.running == 0 {
            assert!(Instant::now() < deadline, "prefill never started");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        prefill.child.kill().expect("kill the prefill worker");
        let killed_at = Instant::now();
        let err = request
            .await
            .expect("the client task")
            .expect_err("the request cannot succeed");
        assert!(
            killed_at.elapsed() < Duration::from_secs(5),
            "no leg waits on a dead peer: {:?}",
            killed_at.elapsed()
        );
        assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
        assert_eq!(error_code(&err), Some("service_unavailable"));
        let p = wait_all_pages_back(&decode).await;
        assert_eq!(available(&p), p.total, "{p:?}");
    })
    .await;
}

#[tokio::test]
async fn short_requests_whose_kv_commits_before_the_prefill_answer_is_read_still_succeed() {
    bounded(async {
        // A one-token answer to a short prompt: the KV can arrive and commit on decode before
        // the Prefill call's `Accepted` is read. That must not be an error (it was, at random).
        let (_prefill, decode) = disaggregated("2048", "2048");
        let mut client = decode.client().await;
        for i in 0..24 {
            let answer = run_to_end(&mut client, chat("Hi", 1)).await;
            assert!(answer.is_ok(), "request {i}: {answer:?}");
        }
    })
    .await;
}

#[tokio::test]
async fn health_answers_while_a_long_prefill_keeps_the_engine_busy() {
    bounded(async {
        let worker = Worker::start(&["--kv-tokens", "8192"]);
        let long = "Describe the harbour, the boats, the market and the people in great detail. "
            .repeat(60);
        let mut client = worker.client().await;
        let request = tokio::spawn(async move { run_to_end(&mut client, chat(&long, 1)).await });
        let mut probe = worker.client().await;
        let deadline = Instant::now() + Duration::from_secs(30);
        while health(&mut probe).await.running == 0 {
            assert!(Instant::now() < deadline, "the request never started");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // The engine thread is in the prompt's forward pass (seconds on one thread); health
        // must not wait for it, or the gateway marks a busy worker unhealthy.
        let mut answered_during_prefill = 0;
        while !request.is_finished() {
            let asked = Instant::now();
            let h = health(&mut probe).await;
            assert!(
                asked.elapsed() < Duration::from_secs(1),
                "health took {:?} while the engine was busy",
                asked.elapsed()
            );
            if h.running == 1 && !request.is_finished() {
                answered_during_prefill += 1;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(
            answered_during_prefill > 0,
            "the prefill was too short to probe"
        );
        request.await.expect("the client task").expect("the answer");
    })
    .await;
}

/// `bulkhead preflight` over deploy/local/gateway.toml with its workers' addresses replaced.
fn preflight(prefill: &Worker, decode: &Worker) -> (bool, String) {
    preflight_with(prefill, decode, "")
}

/// `bulkhead preflight` on the default configuration pointed at `prefill` and `decode`, with
/// `extra` TOML appended.
fn preflight_with(prefill: &Worker, decode: &Worker, extra: &str) -> (bool, String) {
    let base = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/local/gateway.toml"
    ))
    .expect("the default config");
    let config = base
        .replace(
            "http://127.0.0.1:50052",
            &format!("http://{}", prefill.grpc),
        )
        .replace("http://127.0.0.1:50051", &format!("http://{}", decode.grpc))
        + extra;
    let path = std::env::temp_dir().join(format!(
        "bulkhead-preflight-{}-{}.toml",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::write(&path, config).expect("write the config");
    let out = Command::new(env!("CARGO_BIN_EXE_bulkhead"))
        .args(["preflight", "--config"])
        .arg(&path)
        .output()
        .expect("preflight runs");
    let _ = std::fs::remove_file(&path);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[tokio::test]
async fn preflight_passes_a_sound_pair_and_fails_a_mismatched_one() {
    bounded(async {
        let (prefill, decode) = disaggregated("2048", "2048");
        let (ok, text) = preflight(&prefill, &decode);
        assert!(ok, "{text}");
        assert!(
            text.contains("PASS local-decode ↔ local-prefill")
                && text.contains("every check passed"),
            "{text}"
        );
        // No cluster token configured: said, without failing the check.
        assert!(
            text.contains("WARN local-decode")
                && text.contains("the gateway presents no cluster token"),
            "{text}"
        );

        // A prefill worker with another page size cannot fill decode's pages.
        let odd = odd_page_prefill();
        let (ok, text) = preflight(&odd, &decode);
        assert!(!ok, "{text}");
        assert!(
            text.contains("FAIL") && text.contains("same page size"),
            "{text}"
        );
        assert!(
            !text.contains("FAIL local-decode ↔ local-prefill       same model"),
            "{text}"
        );
    })
    .await;
}

/// Preflight compared a decode worker with the prefill worker its configuration names: one
/// started with another `--prefill` (here a prefill worker whose pool is a quarter of the
/// configured one's) passed every check while its requests occupied a pool nobody checked, and
/// the gateway admitted them against the configured one. The process it reaches is checked
/// now: preflight fails it, and the gateway routes nothing to it.
#[tokio::test]
async fn a_decode_worker_filled_by_another_prefill_worker_than_configured_fails_preflight() {
    bounded(async {
        let configured = Worker::start(&["--role", "prefill", "--kv-tokens", "2048"]);
        let (elsewhere, decode) = disaggregated("512", "2048");
        let (ok, text) = preflight(&configured, &decode);
        assert!(!ok, "{text}");
        let failed: Vec<&str> = text.lines().filter(|l| l.contains("FAIL")).collect();
        assert_eq!(failed.len(), 1, "{text}");
        assert!(
            failed[0].contains("local-decode")
                && failed[0].contains("dials a configured prefill worker")
                && failed[0].contains(&format!("http://{} answers as instance", elsewhere.grpc)),
            "{text}"
        );
        // The one it does reach, configured: every check passes.
        let (ok, text) = preflight(&elsewhere, &decode);
        assert!(ok, "{text}");

        let workers = not_routed(&configured, &decode, "", "preflight_fails").await;
        assert!(
            workers.contains("dials a configured prefill worker"),
            "{workers}"
        );
    })
    .await;
}

/// Asserts a worker's `/metrics` `m` counts `cancelled` requests cancelled and
/// `failed_prefill` failed for their prefill worker.
fn assert_cancelled_and_failed_prefill(m: &str, cancelled: f64, failed_prefill: f64) {
    let counted = |outcome: &str| {
        metric(
            m,
            &format!("bulkhead_requests_total{{outcome=\"{outcome}\"}}"),
        )
    };
    assert_eq!(
        (counted("cancelled"), counted("failed_prefill")),
        (cancelled, failed_prefill),
        "{m}"
    );
}

/// A decode worker whose Prefill call fails (its prefill worker is gone) counts the request
/// once, as a prefill failure: the reservation its failure gave back also counted it as
/// cancelled, so every prefill outage read as a cancel too.
#[tokio::test]
async fn a_prefill_call_that_fails_is_counted_once_as_a_prefill_failure() {
    bounded(async {
        let (mut prefill, decode) = disaggregated("2048", "2048");
        prefill.child.kill().expect("kill the prefill worker");
        let _ = prefill.child.wait();
        let mut client = decode.client().await;
        let err = run_to_end(&mut client, chat("Say hello.", 4))
            .await
            .expect_err("no prefill worker");
        assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
        // The reservation's cancel reaches the engine after the refusal.
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_cancelled_and_failed_prefill(&decode.metrics(), 0.0, 1.0);
        let p = wait_all_pages_back(&decode).await;
        assert_eq!(available(&p), p.total, "{p:?}");
    })
    .await;
}

/// A caller that leaves while its decode worker waits for the prefill worker's answer is a
/// cancel, not a prefill failure: decode cancels the request before it tears the session
/// down (the other way round, the engine failed it for the closed session first, and a
/// soak of client disconnects read as prefill failures).
#[tokio::test]
async fn a_caller_leaving_before_prefill_answers_is_counted_as_cancelled() {
    bounded(async {
        let (prefill, decode) = disaggregated("2048", "2048");
        let signal = |which: &str| {
            let sent = std::process::Command::new("kill")
                .args([which, &prefill.child.id().to_string()])
                .status()
                .expect("kill runs");
            assert!(sent.success(), "kill {which}");
        };
        // Stopped: the Prefill call is taken by the kernel and never answered.
        signal("-STOP");
        let mut client = decode.client().await;
        let waiting = tokio::spawn(async move { client.generate(chat("Say hello.", 4)).await });
        tokio::time::sleep(Duration::from_millis(500)).await;
        waiting.abort();
        let _ = waiting.await;
        let counted = |m: &str| {
            metric(m, "bulkhead_requests_total{outcome=\"cancelled\"}")
                + metric(m, "bulkhead_requests_total{outcome=\"failed_prefill\"}")
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while counted(&decode.metrics()) < 1.0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        signal("-CONT");
        assert_cancelled_and_failed_prefill(&decode.metrics(), 1.0, 0.0);
    })
    .await;
}

/// A request that generates `max_new_tokens` whatever the model would say (no end of sequence).
fn counting(max_new_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        ignore_eos: true,
        ..chat("Count from one to one thousand.", max_new_tokens)
    }
}

/// Starts `request` and waits for its first answer: it holds its pages from here on.
async fn under_way(
    client: &mut WorkerClient<Channel>,
    request: GenerateRequest,
) -> tonic::Streaming<proto::GenerateResponse> {
    let mut running = client
        .generate(request)
        .await
        .expect("the first request is admitted")
        .into_inner();
    let first = running.message().await.expect("no stream error");
    assert!(first.is_some(), "the first request runs");
    running
}

/// A decode worker whose prompts `prefill` fills, started with `args` besides.
/// A decode worker whose prefill worker cannot be reached starts (its prefill worker may come
/// later) and says so in its log once, not every second.
#[tokio::test]
async fn a_decode_worker_that_cannot_reach_its_prefill_worker_warns_once() {
    bounded(async {
        // A port nothing listens on.
        let dead = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port");
        let address = format!("http://{dead}");
        let decode = decode_at(&address, &[]);
        let warning = "cannot reach the prefill worker";
        let text = wait_for_text(&decode.stderr, warning).await;
        assert!(text.contains(warning), "{text}");
        assert!(text.contains(&address[7..]), "names the address: {text}");
        tokio::time::sleep(Duration::from_millis(2500)).await;
        let text = text_of(&decode.stderr);
        assert_eq!(text.matches(warning).count(), 1, "{text}");
    })
    .await;
}

pub(crate) fn decode_for(prefill: &Worker, args: &[&str]) -> Worker {
    decode_at(&format!("http://{}", prefill.grpc), args)
}

/// A decode worker whose prompts the prefill worker at `address` fills, started with `args`
/// besides.
pub(crate) fn decode_at(address: &str, args: &[&str]) -> Worker {
    let mut all = vec![
        "--role",
        "decode",
        "--prefill",
        address,
        "--kv-listen",
        "127.0.0.1:0",
    ];
    all.extend_from_slice(args);
    Worker::start(&all)
}

/// A decode worker dialing a prefill worker whose pages hold twice as many tokens: the pair
/// disagrees (preflight says so, and routing keeps the gateway away), and a caller that reaches
/// decode anyway is told the service is unavailable — never that its own request was invalid,
/// which relayed prefill's refusal of the reservation as the client's 400.
#[tokio::test]
async fn a_request_the_pair_cannot_serve_for_disagreeing_is_unavailable_not_invalid() {
    bounded(async {
        let odd = odd_page_prefill();
        let decode = decode_for(&odd, &["--kv-tokens", "2048"]);
        let err = run_to_end(&mut decode.client().await, chat("What is 2+2?", 4))
            .await
            .expect_err("the pair cannot serve it");
        assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
        assert_eq!(error_code(&err), Some("service_unavailable"), "{err:?}");
        assert!(err.message().contains("the pair disagree"), "{err:?}");
    })
    .await;
}

/// A prefill worker whose pages hold 32 tokens (decode's hold 16): the pair fails preflight.
fn odd_page_prefill() -> Worker {
    Worker::start(&[
        "--role",
        "prefill",
        "--kv-tokens",
        "2048",
        "--page-tokens",
        "32",
    ])
}

/// A prefill worker that requires a cluster token and a decode worker started without one
/// (it answers anyone), with the token file's directory and the gateway configuration's
/// `[cluster]` table naming that file.
fn half_protected_pair() -> (TempDir, String, Worker, Worker) {
    let dir = TempDir::new("token");
    let token = dir.0.join("cluster-token").display().to_string();
    bulkhead_worker::serve::cluster_token::write_file(
        std::path::Path::new(&token),
        "0123456789abcdef0123456789abcdef\n",
    )
    .expect("writes");
    let prefill = Worker::start(&[
        "--role",
        "prefill",
        "--kv-tokens",
        "2048",
        "--cluster-token-file",
        &token,
    ]);
    let decode = decode_for(&prefill, &["--kv-tokens", "2048"]);
    let cluster = format!("\n[cluster]\ntoken_file = {token:?}\n");
    (dir, cluster, prefill, decode)
}

#[tokio::test]
async fn preflight_fails_a_worker_that_answers_without_the_cluster_token() {
    bounded(async {
        let (_dir, with_token, prefill, decode) = half_protected_pair();
        // Its first probe of its prefill worker refused (logged once it is recorded).
        wait_for_text(&decode.stderr, "cannot reach the prefill worker").await;
        let (ok, text) = preflight_with(&prefill, &decode, &with_token);
        assert!(!ok, "{text}");
        assert!(
            text.contains("FAIL local-decode") && text.contains("requires the cluster token"),
            "{text}"
        );
        assert!(
            text.contains("PASS local-prefill                requires the cluster token"),
            "{text}"
        );
        // The decode worker, presenting none, is refused by its prefill worker: said with
        // the refusal, not only that it has not reached it.
        assert!(
            text.contains(&format!(
                "has not reached its prefill worker at http://{}: this worker answers only \
                 calls that present its cluster token",
                prefill.grpc
            )),
            "{text}"
        );
        // Without the token, the gateway's side cannot even ask the prefill worker.
        let (ok, text) = preflight(&prefill, &decode);
        assert!(!ok, "{text}");
        assert!(
            text.contains("local-prefill    prefill  unreachable")
                && text.contains("cluster token"),
            "{text}"
        );
    })
    .await;
}

#[tokio::test]
async fn a_request_waiting_for_decode_pages_past_the_queue_timeout_is_refused_as_busy() {
    bounded(async {
        // Decode holds one such request at a time; the second waits for its pages, past the
        // queue timeout, while the first generates.
        let prefill = Worker::start(&["--role", "prefill", "--kv-tokens", "4096"]);
        let decode = decode_for(
            &prefill,
            &["--kv-tokens", "256", "--queue-timeout-ms", "500"],
        );
        let long = counting(200);
        let mut running = under_way(&mut decode.client().await, long.clone()).await;
        let started = Instant::now();
        let err = run_to_end(&mut decode.client().await, long)
            .await
            .expect_err("no pages came free in time");
        assert!(
            started.elapsed() >= Duration::from_millis(500),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
        assert_eq!(error_code(&err), Some("rate_limit_exceeded"), "{err:?}");
        let (_, metrics) = decode.admin_get("/metrics");
        assert!(
            metrics.contains("bulkhead_requests_total{outcome=\"rejected_queue_timeout\"} 1"),
            "counted once: {metrics}"
        );
        let next = running.message().await.expect("the first request runs on");
        assert!(next.is_some());
    })
    .await;
}

#[tokio::test]
async fn a_prompt_over_the_decode_pool_is_refused_by_decode_without_touching_prefill() {
    bounded(async {
        // The other asymmetry: prefill could take the prompt, decode cannot hold prompt + output.
        let (prefill, decode) = disaggregated("4096", "64");
        let err = run_to_end(&mut decode.client().await, chat("What is 2+2?", 48))
            .await
            .expect_err("decode must refuse");
        assert_eq!(error_code(&err), Some("context_length_exceeded"), "{err:?}");
        let p = pool(&health(&mut prefill.client().await).await);
        assert_eq!(p.free, p.total, "prefill never heard of it: {p:?}");
        let (_, metrics) = prefill.admin_get("/metrics");
        assert!(
            metrics.contains("bulkhead_requests_total{outcome=\"rejected_context_length\"} 0"),
            "{metrics}"
        );
    })
    .await;
}

#[tokio::test]
async fn a_decode_worker_killed_mid_generation_leaves_prefill_with_every_page_back() {
    bounded(async {
        let (prefill, mut decode) = disaggregated("4096", "4096");
        let mut client = decode.client().await;
        let mut stream = client
            .generate(GenerateRequest {
                ignore_eos: true,
                ..chat("Tell me a long story.", 2000)
            })
            .await
            .expect("admitted")
            .into_inner();
        // Generation has started: the transfer is over and decode is producing tokens.
        stream
            .message()
            .await
            .expect("a first token")
            .expect("the stream is open");
        decode.child.kill().expect("kill the decode worker");
        let killed_at = Instant::now();
        loop {
            match tokio::time::timeout(Duration::from_secs(5), stream.message()).await {
                Ok(Ok(Some(_))) => continue,
                Ok(Ok(None)) => panic!("a killed worker's stream must not end cleanly"),
                Ok(Err(_)) => break,
                Err(_) => panic!("the client was left hanging"),
            }
        }
        assert!(killed_at.elapsed() < Duration::from_secs(5));
        let p = wait_all_pages_back(&prefill).await;
        assert_eq!(
            available(&p),
            p.total,
            "prefill released its source pages: {p:?}"
        );
        assert_eq!(p.quarantined, 0);
    })
    .await;
}

/// One HTTP/1.1 exchange with `Connection: close`: (status line, body).
fn http_request(addr: &str, method: &str, path: &str, token: &str, body: &str) -> (String, String) {
    let mut s = TcpStream::connect(addr).expect("connects");
    s.set_read_timeout(Some(Duration::from_secs(30)))
        .expect("sets a timeout");
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nAuthorization: Bearer {token}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("sends");
    let mut response = String::new();
    let _ = s.read_to_string(&mut response);
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    (
        head.lines().next().unwrap_or_default().to_owned(),
        body.to_owned(),
    )
}

/// A `bulkhead gateway` process on the default configuration in front of `prefill` and
/// `decode`, with `extra` TOML appended, its configuration and data directory (its audit log,
/// whose lock a gateway of another test must not meet) its own; killed when dropped.
struct GatewayBefore {
    child: std::process::Child,
    api: String,
    admin: String,
    _dir: TempDir,
}

impl GatewayBefore {
    fn start(prefill: &Worker, decode: &Worker, extra: &str) -> GatewayBefore {
        let base = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/deploy/local/gateway.toml"
        ))
        .expect("the default config");
        let config = base
            .replace("127.0.0.1:8080", "127.0.0.1:0")
            .replace("127.0.0.1:9090", "127.0.0.1:0")
            .replace(
                "http://127.0.0.1:50052",
                &format!("http://{}", prefill.grpc),
            )
            .replace("http://127.0.0.1:50051", &format!("http://{}", decode.grpc))
            + extra;
        let dir = TempDir::new("gateway-before");
        let path = dir.0.join("gateway.toml");
        std::fs::write(&path, config).expect("write the config");
        let mut child = Command::new(env!("CARGO_BIN_EXE_bulkhead"))
            .args(["gateway", "--config"])
            .arg(&path)
            .arg("--data-dir")
            .arg(dir.0.join("data"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("the gateway starts");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("piped"))
            .read_line(&mut line)
            .expect("a ready line");
        let field = |k: &str| {
            line.split_whitespace()
                .find_map(|f| f.strip_prefix(k))
                .map(str::to_owned)
                .expect("the ready line names it")
        };
        GatewayBefore {
            child,
            api: field("api="),
            admin: field("admin="),
            _dir: dir,
        }
    }

    /// A short chat request as tenant-a: (status line, body).
    fn ask(&self) -> (String, String) {
        let body = r#"{"messages":[{"role":"user","content":"What is 2+2?"}],"max_tokens":8}"#;
        http_request(
            &self.api,
            "POST",
            "/v1/chat/completions",
            "sk-demo-tenant-a",
            body,
        )
    }

    /// `/workers` once it contains `what` (or after 30 s).
    async fn workers_once(&self, what: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let (_, body) = http_request(&self.admin, "GET", "/workers", "sk-demo-admin", "");
            if body.contains(what) || Instant::now() > deadline {
                return body;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for GatewayBefore {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts a gateway (with `extra` configuration) before `prefill` and `decode`; once its
/// `/workers` names `reason`, a request gets 503. Returns `/workers`.
async fn not_routed(prefill: &Worker, decode: &Worker, extra: &str, reason: &str) -> String {
    let gateway = GatewayBefore::start(prefill, decode, extra);
    let workers = gateway.workers_once(reason).await;
    let (status, answer) = gateway.ask();
    assert!(workers.contains(reason), "{workers}");
    assert!(
        status.contains("503") && answer.contains("service_unavailable"),
        "{status} {answer}"
    );
    workers
}

#[tokio::test]
async fn the_gateway_does_not_route_to_a_pair_that_fails_preflight() {
    bounded(async {
        let decode_prefill = odd_page_prefill();
        let decode = decode_for(&decode_prefill, &["--kv-tokens", "2048"]);
        // The gateway has read both workers' Info: the decode worker is not routed to.
        let workers = not_routed(&decode_prefill, &decode, "", "preflight_fails").await;
        assert!(workers.contains("same page size"), "{workers}");
    })
    .await;
}

#[tokio::test]
async fn the_gateway_does_not_route_to_a_worker_that_answers_without_the_cluster_token() {
    bounded(async {
        let (_dir, with_token, prefill, decode) = half_protected_pair();
        let workers = not_routed(&prefill, &decode, &with_token, "answers_without_token").await;
        assert!(workers.contains("--cluster-token-file"), "{workers}");
    })
    .await;
}

/// A connection to a worker's gRPC port on which no call presents the cluster token is closed
/// once its ten seconds are up, so connections that never call cannot hold every place
/// (the gateway's included); a client whose calls present it keeps its connection past them.
#[tokio::test]
async fn a_grpc_connection_with_no_call_presenting_the_cluster_token_is_closed_in_time() {
    use bulkhead_worker::serve::cluster_token::{ClusterToken, Presents, SharedToken};
    use tokio::io::AsyncReadExt as _;
    bounded(async {
        let dir = TempDir::new("token");
        let secret = "0123456789abcdef0123456789abcdef\n";
        let token = dir.0.join("cluster-token");
        bulkhead_worker::serve::cluster_token::write_file(&token, secret).expect("writes");
        let worker = Worker::start(&[
            "--kv-tokens",
            "2048",
            "--cluster-token-file",
            &token.display().to_string(),
        ]);
        let mut silent = tokio::net::TcpStream::connect(worker.grpc)
            .await
            .expect("connects");
        let channel = Channel::from_shared(format!("http://{}", worker.grpc))
            .expect("a URI")
            .connect()
            .await
            .expect("connects");
        let presents = Presents(Some(SharedToken::fixed(
            ClusterToken::parse(secret).expect("a token"),
        )));
        let mut client = WorkerClient::with_interceptor(channel, presents);
        let info = || InfoRequest {
            include_tokenizer: false,
        };
        client.info(info()).await.expect("answered");
        let started = Instant::now();

        // The server says its HTTP/2 settings, then nothing until it closes.
        let mut said = Vec::new();
        let closed =
            tokio::time::timeout(Duration::from_secs(20), silent.read_to_end(&mut said)).await;
        assert!(closed.is_ok(), "still open after 20 s");
        assert!(
            started.elapsed() > Duration::from_secs(8),
            "{:?}",
            started.elapsed()
        );
        tokio::time::sleep(Duration::from_secs(12).saturating_sub(started.elapsed())).await;
        client.info(info()).await.expect("answered again");
        let metrics = worker.metrics();
        assert!(
            metrics
                .contains("bulkhead_grpc_connections_closed_total{reason=\"no_call_in_time\"} 1\n"),
            "only the silent connection closed: {metrics}"
        );
        assert!(
            metrics.contains("bulkhead_grpc_connections 1\n"),
            "the client's is open: {metrics}"
        );
    })
    .await;
}

/// A TCP proxy to one address that passes bytes both ways until [`Freezing::freeze`]: from then
/// on it passes nothing and keeps every socket open — a peer whose host froze or whose link was
/// cut, with no reset sent.
struct Freezing {
    addr: SocketAddr,
    frozen: tokio::sync::watch::Sender<bool>,
}

impl Freezing {
    async fn to(target: SocketAddr) -> Freezing {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("binds");
        let addr = listener.local_addr().expect("an address");
        let (frozen, watch) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let server = tokio::net::TcpStream::connect(target)
                    .await
                    .expect("connects");
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                tokio::spawn(Freezing::pass(client_read, server_write, watch.clone()));
                tokio::spawn(Freezing::pass(server_read, client_write, watch.clone()));
            }
        });
        Freezing { addr, frozen }
    }

    /// Copies `from` to `to` until frozen, then holds both open (until the test's runtime ends).
    async fn pass(
        mut from: tokio::net::tcp::OwnedReadHalf,
        mut to: tokio::net::tcp::OwnedWriteHalf,
        mut frozen: tokio::sync::watch::Receiver<bool>,
    ) {
        use futures_util::FutureExt as _;
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let mut buf = vec![0; 16 * 1024];
        loop {
            tokio::select! {
                biased;
                _ = frozen.wait_for(|f| *f).map(|_| ()) => break,
                read = from.read(&mut buf) => match read {
                    Ok(n) if n > 0 && to.write_all(&buf[..n]).await.is_ok() => {}
                    _ => return,
                },
            }
        }
        let _held = (from, to);
        std::future::pending::<()>().await;
    }

    fn freeze(&self) {
        self.frozen.send_replace(true);
    }
}

/// A connection whose peer stops answering without a reset (a host lost, a partition) is
/// closed once a ping of the worker's goes unanswered: vouched for, it would otherwise hold one
/// of the worker's bounded places for good.
#[tokio::test]
async fn a_grpc_connection_whose_peer_stops_answering_is_closed_after_an_unanswered_ping() {
    bounded(async {
        // Pings every second, each to be answered within a second.
        let worker = Worker::start(&["--kv-tokens", "2048", "--kv-peer-timeout-ms", "3000"]);
        let proxy = Freezing::to(worker.grpc).await;
        let channel = Channel::from_shared(format!("http://{}", proxy.addr))
            .expect("a URI")
            .connect()
            .await
            .expect("connects");
        let mut client = WorkerClient::new(channel);
        // Answered, so vouched for: the ten seconds of a silent connection no longer apply.
        health(&mut client).await;
        // Idle, answering pings, it stays open.
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(metric(&worker.metrics(), "bulkhead_grpc_connections"), 1.0);

        proxy.freeze();
        let frozen = Instant::now();
        while metric(&worker.metrics(), "bulkhead_grpc_connections") > 0.0 {
            assert!(
                frozen.elapsed() < Duration::from_secs(8),
                "a connection whose peer stopped answering is still open after {:?}",
                frozen.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let metrics = worker.metrics();
        assert_eq!(
            metric_sum(&metrics, "bulkhead_grpc_connections_closed_total"),
            0.0,
            "closed by its ping, not as unvouched or over the bound: {metrics}"
        );
    })
    .await;
}
