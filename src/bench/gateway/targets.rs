//! What the load is sent to, each a real process on a loopback socket in front of the same
//! load target: the load target itself, Bulkhead's gateway (policy chain off, and on, with
//! group-commit audit; and policies off with durable audit), the pass-through floor (the
//! gateway's serving stack doing nothing but proxying), nginx and LiteLLM proxy. Each is
//! started once, probed with one request, and kept running until the bench ends. A peer (nginx, LiteLLM) that is not installed or does not start is skipped,
//! with the reason; Bulkhead failing to start fails the bench. With TLS (`--tls`), every target
//! that can listens on TLS with the bench's certificate; the load target and LiteLLM cannot
//! and are skipped.

use std::net::{SocketAddr, TcpListener};
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use bulkhead_gateway::keys::KeyHash;
use bulkhead_worker::serve::tls::{Authority, ListenerFiles};
use tokio::process::{Child, Command};
use tokio::time::Instant;
use tokio_rustls::TlsConnector;

use super::cpu::ProcessTree;
use super::load::{self, Ask, Dial};
use super::load_target;
use super::pass_through;
use crate::child;

/// The bench tenant's API key (the gateway's tenant; LiteLLM's master key).
pub const KEY: &str = "sk-bench-tenant";
/// The gateway's admin token.
const ADMIN: &str = "sk-bench-admin";
/// How long a target may take to become ready.
const START_LIMIT: Duration = Duration::from_secs(120);
/// How long a target gets to stop after SIGTERM.
const STOP_LIMIT: Duration = Duration::from_secs(10);
/// The environment variable naming LiteLLM's virtual environment (as scripts/bench-gateway-peers
/// reads it).
pub const LITELLM_VENV_ENV: &str = "BULKHEAD_LITELLM_VENV";

/// The targets, in the order the report lists them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum Kind {
    /// The load target itself, no proxy: the baseline.
    Direct,
    /// Bulkhead's gateway without policy plugins (audit records fsynced in groups).
    Bulkhead,
    /// Bulkhead's gateway with the policy set (`--policies`).
    BulkheadPolicies,
    /// Bulkhead's gateway without policy plugins, every response waiting for its audit
    /// record's fsync.
    BulkheadDurable,
    /// The gateway's serving stack (its serving threads, hyper's server, a pooled hyper
    /// client) passing requests through untouched: the floor under the gateway's own work.
    PassThrough,
    /// nginx as a reverse proxy.
    Nginx,
    /// LiteLLM proxy.
    Litellm,
}

impl Kind {
    pub const ALL: [Kind; 7] = [
        Kind::Direct,
        Kind::Bulkhead,
        Kind::BulkheadPolicies,
        Kind::BulkheadDurable,
        Kind::PassThrough,
        Kind::Nginx,
        Kind::Litellm,
    ];

    /// The target's key in the JSON report.
    pub fn key(self) -> &'static str {
        match self {
            Kind::Direct => "direct",
            Kind::Bulkhead => "bulkhead_policies_off",
            Kind::BulkheadPolicies => "bulkhead_policies_on",
            Kind::BulkheadDurable => "bulkhead_audit_durable",
            Kind::PassThrough => "pass_through",
            Kind::Nginx => "nginx",
            Kind::Litellm => "litellm",
        }
    }

    /// The target's row label in the table.
    /// A peer measured beside Bulkhead (its failing is a skip, with the reason), not one of
    /// Bulkhead's own targets (its failing fails the bench).
    pub fn is_peer(self) -> bool {
        match self {
            Kind::Nginx | Kind::Litellm => true,
            Kind::Direct
            | Kind::Bulkhead
            | Kind::BulkheadPolicies
            | Kind::BulkheadDurable
            | Kind::PassThrough => false,
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Kind::Direct => "direct (no proxy)",
            Kind::Bulkhead => "bulkhead, policies off",
            Kind::BulkheadPolicies => "bulkhead, policies on",
            Kind::BulkheadDurable => "bulkhead, durable audit",
            Kind::PassThrough => "pass-through floor",
            Kind::Nginx => "nginx",
            Kind::Litellm => "litellm",
        }
    }
}

/// Whether the gateway's responses wait for their audit record's fsync.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Audit {
    /// Records fsynced in groups within a few milliseconds.
    Group,
    /// Every response waits for its record's fsync.
    Durable,
}

impl Audit {
    fn name(self) -> &'static str {
        match self {
            Audit::Group => "group",
            Audit::Durable => "durable",
        }
    }
}

/// Everything the targets are started from.
#[derive(Debug)]
pub struct Setup {
    /// The load target's address and process.
    pub upstream: SocketAddr,
    pub upstream_process: Option<ProcessTree>,
    /// The GGUF whose tokenizer and chat template the gateway uses.
    pub model: PathBuf,
    /// The policy set and the compiled-component cache (absolute paths).
    pub policies: PathBuf,
    pub cache_dir: PathBuf,
    /// Connections the load opens (the bench tenant's concurrency limit is above it).
    pub connections: usize,
    /// The gateway's runtime threads, and nginx's and LiteLLM's worker processes.
    pub threads: NonZeroUsize,
    pub nginx: Option<PathBuf>,
    pub litellm: Option<PathBuf>,
    pub scratch: PathBuf,
    /// Every target's listener takes TLS, and the load connects over it.
    pub tls: Option<BenchTls>,
}

/// The bench's TLS: the targets' certificate and key (for 127.0.0.1), and the load's client,
/// which trusts the CA that issued them.
#[derive(Clone)]
pub struct BenchTls {
    pub files: ListenerFiles,
    pub connector: TlsConnector,
}

impl std::fmt::Debug for BenchTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BenchTls")
            .field("files", &self.files)
            .finish_non_exhaustive()
    }
}

/// A fresh CA's certificate for 127.0.0.1 in `dir`, and a client trusting that CA that
/// offers HTTP/1.1.
pub fn bench_tls(dir: &Path) -> anyhow::Result<BenchTls> {
    let ca = Authority::new("bulkhead bench CA").context("making the bench's CA")?;
    let files = ca
        .write(dir, "bench", &["127.0.0.1".to_owned()])
        .context("writing the bench's certificate")?;
    Ok(BenchTls {
        files: files.into(),
        connector: ca.https_client()?,
    })
}

impl Setup {
    /// How the load reaches a target at `addr`.
    fn dial(&self, addr: SocketAddr) -> Dial {
        Dial {
            addr,
            tls: self.tls.as_ref().map(|t| t.connector.clone()),
        }
    }
}

/// A started target.
#[derive(Debug)]
pub struct Target {
    pub kind: Kind,
    pub dial: Dial,
    /// The request the load sends it (asking for the model it lists).
    pub ask: Arc<Ask>,
    /// The processes serving `addr`, metered while the load runs.
    pub meter: Option<ProcessTree>,
    /// The process behind it (the load target's process is the bench's to stop).
    child: Option<Child>,
}

impl Target {
    pub async fn stop(&mut self) {
        if let Some(c) = &mut self.child {
            child::stop(c, STOP_LIMIT, self.kind.label()).await;
        }
    }
}

/// A target started, or why not.
#[derive(Debug)]
pub enum Started {
    Ready(Box<Target>),
    Skipped(String),
}

/// Starts `kind` and probes it with the bench's request (`stream`: streamed), asking for the
/// first model it lists.
pub async fn start(kind: Kind, setup: &Setup, stream: bool) -> anyhow::Result<Started> {
    if setup.tls.is_some() && matches!(kind, Kind::Direct | Kind::Litellm) {
        return Ok(Started::Skipped("it does not listen on TLS here".into()));
    }
    let (addr, process) = match kind {
        Kind::Direct => (setup.upstream, None),
        Kind::Bulkhead => gateway(kind, setup, false, Audit::Group).await?,
        Kind::BulkheadPolicies => gateway(kind, setup, true, Audit::Group).await?,
        Kind::BulkheadDurable => gateway(kind, setup, false, Audit::Durable).await?,
        Kind::PassThrough => {
            let (c, addr) = pass_through(setup).await?;
            (addr, Some(c))
        }
        Kind::Nginx => match nginx(setup).await {
            Ok((addr, c)) => (addr, Some(c)),
            Err(e) => return Ok(Started::Skipped(format!("{e:#}"))),
        },
        Kind::Litellm => match litellm(setup).await {
            Ok((addr, c)) => (addr, Some(c)),
            Err(e) => return Ok(Started::Skipped(format!("{e:#}"))),
        },
    };
    let dial = setup.dial(addr);
    let probed = async {
        let model = listed_model(&dial).await?;
        let ask = Ask::chat(&model, Some(KEY.to_owned()), stream);
        load::probe(&dial, &ask).await?;
        anyhow::Ok(ask)
    };
    match probed.await {
        Ok(ask) => Ok(Started::Ready(Box::new(Target {
            kind,
            dial,
            ask: Arc::new(ask),
            meter: match &process {
                Some(c) => c.id().map(ProcessTree),
                None => setup.upstream_process,
            },
            child: process,
        }))),
        Err(e) => {
            if let Some(mut c) = process {
                child::stop(&mut c, STOP_LIMIT, kind.label()).await;
            }
            let why = format!(
                "{} does not answer the bench's request: {e:#}",
                kind.label()
            );
            if kind.is_peer() {
                Ok(Started::Skipped(why))
            } else {
                bail!(why)
            }
        }
    }
}

/// The first model `GET /v1/models` lists at `dial`.
async fn listed_model(dial: &Dial) -> anyhow::Result<String> {
    let (status, body) = load::get(dial, "/v1/models", Some(KEY)).await?;
    let listed: serde_json::Value = serde_json::from_slice(&body)
        .with_context(|| format!("GET /v1/models answered {status} and no JSON"))?;
    listed["data"][0]["id"]
        .as_str()
        .map(str::to_owned)
        .with_context(|| format!("GET /v1/models answered {status} and lists no model"))
}

/// Starts the load target (`bulkhead bench load-target`) with `threads` threads.
pub async fn load_target(threads: NonZeroUsize) -> anyhow::Result<(Child, SocketAddr)> {
    let threads = threads.to_string();
    bench_process(
        &["load-target", "--threads", &threads],
        load_target::READY,
        "load target",
    )
    .await
}

/// Starts the pass-through floor (`bulkhead bench pass-through`) in front of the load target,
/// with the gateway's serving threads.
async fn pass_through(setup: &Setup) -> anyhow::Result<(Child, SocketAddr)> {
    let (upstream, threads) = (setup.upstream.to_string(), setup.threads.to_string());
    let mut args = vec![
        "pass-through".to_owned(),
        "--upstream".to_owned(),
        upstream,
        "--threads".to_owned(),
        threads,
    ];
    if let Some(tls) = &setup.tls {
        for (flag, path) in [
            ("--tls-cert", &tls.files.cert),
            ("--tls-key", &tls.files.key),
        ] {
            args.extend([flag.to_owned(), path.display().to_string()]);
        }
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    bench_process(&args, pass_through::READY, Kind::PassThrough.label()).await
}

/// Runs `bulkhead bench ARGS` and waits for its `ready` line, which names its `addr=`.
async fn bench_process(
    args: &[&str],
    ready: &str,
    what: &str,
) -> anyhow::Result<(Child, SocketAddr)> {
    let mut cmd = Command::new(std::env::current_exe().context("finding this executable")?);
    cmd.arg("bench").args(args);
    let mut c = spawn_reporting(cmd, what)?;
    let line = child::ready_line(&mut c, ready, START_LIMIT, what).await?;
    let addr = child::field(&line, "addr")
        .with_context(|| format!("the {what}'s ready line has no addr="))?
        .parse()
        .with_context(|| format!("the {what}'s address"))?;
    Ok((c, addr))
}

/// Spawns `cmd` with stdout piped (for its ready line), stderr passed through, tied to this
/// process's life.
fn spawn_reporting(mut cmd: Command, what: &str) -> anyhow::Result<Child> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
    child::die_with_parent(&mut cmd);
    cmd.spawn().with_context(|| format!("starting the {what}"))
}

/// The gateway's configuration: one tenant with limits the load cannot reach, the load target
/// as its one OpenAI-compatible upstream, the policy set if `policies`, and `audit`.
fn gateway_config(setup: &Setup, policies: bool, audit: Audit) -> String {
    let concurrency = setup.connections.saturating_mul(2).max(16);
    let mut text = format!(
        "[listen]\napi = \"127.0.0.1:0\"\nadmin = \"127.0.0.1:0\"\n\n\
         [admin]\ntoken_sha256 = \"{admin}\"\n\n\
         [audit]\ndurability = \"{durability}\"\non_failure = \"refuse\"\n\n\
         [[tenants]]\nid = \"bench\"\nkey_sha256 = [\"{key}\"]\nmax_context = 2048\n\
         max_concurrent = {concurrency}\nrequests_per_minute = {rpm}\ntokens_per_minute = {tpm}\n\n\
         [[workers]]\nname = \"load-target\"\nopenai = \"http://{upstream}\"\nrole = \"both\"\n\
         model = \"{model}\"\ncontext_length = 2048\ntokenizer = {tokenizer:?}\n",
        admin = KeyHash::of(ADMIN).to_hex(),
        durability = audit.name(),
        key = KeyHash::of(KEY).to_hex(),
        rpm = u32::MAX,
        tpm = u64::from(u32::MAX) * 1000,
        upstream = setup.upstream,
        model = load_target::MODEL,
        tokenizer = setup.model.display().to_string(),
    );
    if let Some(tls) = &setup.tls {
        let listen = format!(
            "admin = \"127.0.0.1:0\"\ntls_cert = {:?}\ntls_key = {:?}\n",
            tls.files.cert.display().to_string(),
            tls.files.key.display().to_string(),
        );
        text = text.replacen("admin = \"127.0.0.1:0\"\n", &listen, 1);
    }
    if policies {
        text.push_str(&format!(
            "\n[policies]\nfile = {:?}\ncache_dir = {:?}\nwatch_secs = 0\n",
            setup.policies.display().to_string(),
            setup.cache_dir.display().to_string(),
        ));
    }
    text
}

async fn gateway(
    kind: Kind,
    setup: &Setup,
    policies: bool,
    audit: Audit,
) -> anyhow::Result<(SocketAddr, Option<Child>)> {
    let dir = setup.scratch.join(kind.key());
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let config = dir.join("gateway.toml");
    std::fs::write(&config, gateway_config(setup, policies, audit))
        .with_context(|| format!("writing {}", config.display()))?;
    let mut cmd = Command::new(std::env::current_exe().context("finding this executable")?);
    cmd.arg("gateway")
        .arg("--config")
        .arg(&config)
        .arg("--data-dir")
        .arg(dir.join("data"))
        .arg("--serving-threads")
        .arg(setup.threads.to_string())
        .env("BULKHEAD_LOG", "warn");
    let what = kind.label();
    let mut c = spawn_reporting(cmd, what)?;
    let line = child::ready_line(&mut c, "bulkhead gateway ready ", START_LIMIT, what).await?;
    let addr = |key: &str| -> anyhow::Result<SocketAddr> {
        child::field(&line, key)
            .with_context(|| format!("the gateway's ready line has no {key}="))?
            .parse()
            .with_context(|| format!("the gateway's {key} address"))
    };
    let (api, admin) = (addr("api")?, addr("admin")?);
    // Routable once its health check has seen the upstream.
    let deadline = Instant::now() + START_LIMIT;
    let admin = setup.dial(admin);
    loop {
        let health = load::get(&admin, "/healthz", Some(ADMIN)).await;
        if matches!(&health, Ok((s, _)) if s.is_success()) {
            break;
        }
        if Instant::now() > deadline {
            bail!(
                "{what}: not healthy within {} s: {health:?}",
                START_LIMIT.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok((api, Some(c)))
}

/// A free loopback port for a peer that cannot report the one it bound.
fn free_port() -> anyhow::Result<SocketAddr> {
    let l = TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    l.local_addr().context("finding a free port")
}

/// The last lines of a peer's log, for the reason it is skipped.
fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(8)..].join("\n")
}

/// Spawns a peer with its output going to `log`, and waits until `GET /v1/models` through it
/// answers 200.
async fn peer(
    mut cmd: Command,
    what: &str,
    dial: &Dial,
    log: &Path,
    bearer: Option<&str>,
) -> anyhow::Result<Child> {
    let file = std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
    cmd.stdin(Stdio::null())
        .stdout(file.try_clone()?)
        .stderr(file)
        .kill_on_drop(true);
    child::die_with_parent(&mut cmd);
    let mut c = cmd.spawn().with_context(|| format!("starting {what}"))?;
    let deadline = Instant::now() + START_LIMIT;
    loop {
        if let Some(status) = c.try_wait()? {
            bail!(
                "{what} exited ({status}) before it answered:\n{}",
                log_tail(log)
            );
        }
        if matches!(load::get(dial, "/v1/models", bearer).await, Ok((s, _)) if s.is_success()) {
            return Ok(c);
        }
        if Instant::now() > deadline {
            child::stop(&mut c, STOP_LIMIT, what).await;
            bail!(
                "{what} did not answer within {} s:\n{}",
                START_LIMIT.as_secs(),
                log_tail(log)
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The first of `candidates` that is an executable file.
pub fn first_executable(candidates: impl IntoIterator<Item = PathBuf>) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    candidates.into_iter().find(|p| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    })
}

/// `--nginx`, else `nginx` on PATH, else Debian's /usr/sbin/nginx.
pub fn find_nginx(given: Option<PathBuf>) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let on_path = std::env::split_paths(&path).map(|d| d.join("nginx"));
    match given {
        Some(p) => first_executable([p]),
        None => first_executable(on_path.chain([PathBuf::from("/usr/sbin/nginx")])),
    }
}

/// `--litellm`, else the `litellm` of $BULKHEAD_LITELLM_VENV or
/// ~/.cache/bulkhead/litellm-venv (where scripts/bench-gateway-peers installs it).
pub fn find_litellm(given: Option<PathBuf>) -> Option<PathBuf> {
    let venv = std::env::var_os(LITELLM_VENV_ENV)
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/bulkhead/litellm-venv"))
        });
    first_executable(given.or_else(|| venv.map(|v| v.join("bin/litellm"))))
}

/// nginx's configuration: a reverse proxy as one would deploy it in front of an LLM server
/// (HTTP/1.1 keep-alive to the upstream, no response buffering so streams flow, an access
/// log), with as many worker processes as the gateway has threads.
fn nginx_config(
    dir: &Path,
    listen: SocketAddr,
    upstream: SocketAddr,
    workers: NonZeroUsize,
    tls: Option<&ListenerFiles>,
) -> String {
    let d = dir.display();
    // With TLS: the same versions as the gateway's listeners, HTTP/1.1 (no `http2`).
    let ssl = tls.map_or(String::new(), |t| {
        format!(
            " ssl;\n    ssl_certificate {};\n    ssl_certificate_key {};\n\
             ssl_protocols TLSv1.2 TLSv1.3",
            t.cert.display(),
            t.key.display()
        )
    });
    format!(
        "worker_processes {workers};\ndaemon off;\npid {d}/nginx.pid;\nerror_log {d}/error.log warn;\n\
         events {{ worker_connections 4096; }}\n\
         http {{\n  access_log {d}/access.log;\n\
         client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n\
         fastcgi_temp_path {d}/fastcgi;\n  uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n\
         keepalive_requests 1000000;\n\
         upstream load_target {{ server {upstream}; keepalive 256; keepalive_requests 1000000; }}\n\
         server {{\n    listen {listen}{ssl};\n    location / {{\n\
         proxy_pass http://load_target;\n      proxy_http_version 1.1;\n\
         proxy_set_header Connection \"\";\n      proxy_buffering off;\n    }}\n  }}\n}}\n",
    )
}

async fn nginx(setup: &Setup) -> anyhow::Result<(SocketAddr, Child)> {
    let Some(bin) = setup.nginx.clone() else {
        bail!("nginx not found (scripts/bench-gateway-peers installs it, or pass --nginx PATH)");
    };
    let dir = setup.scratch.join("nginx");
    std::fs::create_dir_all(&dir)?;
    let addr = free_port()?;
    let conf = dir.join("nginx.conf");
    let tls = setup.tls.as_ref().map(|t| &t.files);
    std::fs::write(
        &conf,
        nginx_config(&dir, addr, setup.upstream, setup.threads, tls),
    )?;
    let mut cmd = Command::new(&bin);
    cmd.arg("-e")
        .arg(dir.join("error.log"))
        .arg("-p")
        .arg(&dir)
        .arg("-c")
        .arg(&conf);
    let c = peer(
        cmd,
        "nginx",
        &setup.dial(addr),
        &dir.join("nginx.out"),
        None,
    )
    .await?;
    Ok((addr, c))
}

/// LiteLLM proxy's configuration: the load target as an OpenAI-compatible model, the bench key
/// as the master key (so LiteLLM authenticates too).
fn litellm_config(upstream: SocketAddr) -> String {
    format!(
        "model_list:\n  - model_name: {model}\n    litellm_params:\n      model: openai/{model}\n\
         \x20     api_base: http://{upstream}/v1\n      api_key: sk-unused\n\
         general_settings:\n  master_key: {KEY}\n",
        model = load_target::MODEL,
    )
}

async fn litellm(setup: &Setup) -> anyhow::Result<(SocketAddr, Child)> {
    let Some(bin) = setup.litellm.clone() else {
        bail!(
            "LiteLLM proxy not found (scripts/bench-gateway-peers installs it, or pass --litellm PATH)"
        );
    };
    let dir = setup.scratch.join("litellm");
    std::fs::create_dir_all(&dir)?;
    let addr = free_port()?;
    let conf = dir.join("litellm.yaml");
    std::fs::write(&conf, litellm_config(setup.upstream))?;
    let mut cmd = Command::new(&bin);
    cmd.arg("--config")
        .arg(&conf)
        .args(["--host", "127.0.0.1", "--port", &addr.port().to_string()])
        // As many worker processes as the gateway has serving threads and nginx workers.
        .args(["--num_workers", &setup.threads.to_string()])
        .current_dir(&dir)
        // No fetch of the model price list at start (there is no network to fetch it from).
        .env("LITELLM_LOCAL_MODEL_COST_MAP", "True");
    let c = peer(
        cmd,
        "LiteLLM",
        &setup.dial(addr),
        &dir.join("litellm.log"),
        Some(KEY),
    )
    .await?;
    Ok((addr, c))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup() -> Setup {
        Setup {
            upstream: "127.0.0.1:7".parse().expect("addr"),
            upstream_process: None,
            model: PathBuf::from("/models/m.gguf"),
            policies: PathBuf::from("/repo/policies/local.toml"),
            cache_dir: PathBuf::from("/repo/plugins/dist/cache"),
            connections: 64,
            threads: NonZeroUsize::MIN,
            nginx: None,
            litellm: None,
            scratch: PathBuf::from("/tmp/x"),
            tls: None,
        }
    }

    #[test]
    fn the_gateway_configuration_is_valid_and_its_limits_are_out_of_the_loads_reach() {
        for (policies, audit) in [
            (false, Audit::Group),
            (true, Audit::Group),
            (false, Audit::Durable),
        ] {
            let config =
                bulkhead_gateway::Config::parse(&gateway_config(&setup(), policies, audit))
                    .expect("a valid configuration");
            let tenant = config
                .tenants
                .keyring()
                .tenant(&KeyHash::of(KEY))
                .expect("the bench key names the tenant");
            assert!(tenant.limits.max_concurrent.get() as usize > setup().connections);
            assert_eq!(config.policies.is_some(), policies);
            assert_eq!(
                config.audit.durability == bulkhead_gateway::config::Durability::Durable,
                audit == Audit::Durable
            );
        }
    }

    #[test]
    fn a_missing_peer_is_not_found() {
        assert_eq!(find_nginx(Some(PathBuf::from("/nonexistent/nginx"))), None);
        assert_eq!(
            find_litellm(Some(PathBuf::from("/nonexistent/litellm"))),
            None
        );
    }

    /// With TLS, nginx listens with `ssl` on the bench's certificate and key, TLS 1.2 and 1.3
    /// (the gateway's versions); without, plain.
    #[test]
    fn nginx_listens_with_ssl_on_the_bench_certificate_only_over_tls() {
        let (dir, listen) = (Path::new("/tmp/n"), "127.0.0.1:9".parse().expect("addr"));
        let upstream = "127.0.0.1:7".parse().expect("addr");
        let two = NonZeroUsize::new(2).expect("2");
        let plain = nginx_config(dir, listen, upstream, two, None);
        assert!(plain.contains("listen 127.0.0.1:9;"), "{plain}");
        assert!(!plain.contains("ssl"), "{plain}");
        let files = ListenerFiles {
            cert: "/b/bench.pem".into(),
            key: "/b/bench.key".into(),
            client_ca: None,
        };
        let tls = nginx_config(dir, listen, upstream, two, Some(&files));
        for line in [
            "listen 127.0.0.1:9 ssl;",
            "ssl_certificate /b/bench.pem;",
            "ssl_certificate_key /b/bench.key;",
            "ssl_protocols TLSv1.2 TLSv1.3;",
        ] {
            assert!(tls.contains(line), "{line}: {tls}");
        }
    }
}
