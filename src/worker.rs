//! `bulkhead worker`: serve the model over gRPC, with metrics on an admin HTTP port.

use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use bulkhead_kvpool::Scrub;
use bulkhead_worker::engine::{EngineConfig, KvBudget};
use bulkhead_worker::serve::kv_advertise::KvAdvertise;
use bulkhead_worker::serve::kvplane::{DEFAULT_PEER_TIMEOUT, SendFault};
use bulkhead_worker::serve::tls::Part;
use bulkhead_worker::serve::transport::{KvTransport, TransportConfig};
use bulkhead_worker::serve::{BoundWorker, ClusterTls, RoleConfig, ServeConfig, SharedToken};

use bulkhead_telemetry::Otlp;

use crate::model_path::ModelArgs;
use crate::telemetry::Service;

/// Environment variables, one per flag (`--listen` ↔ `BULKHEAD_LISTEN`, …).
pub mod env {
    pub const ROLE: &str = "BULKHEAD_ROLE";
    pub const LISTEN: &str = "BULKHEAD_LISTEN";
    pub const ADMIN_LISTEN: &str = "BULKHEAD_ADMIN_LISTEN";
    pub const KV_MEMORY: &str = "BULKHEAD_KV_MEMORY";
    pub const KV_TOKENS: &str = "BULKHEAD_KV_TOKENS";
    pub const CONTEXT_LENGTH: &str = "BULKHEAD_CONTEXT_LENGTH";
    pub const PAGE_TOKENS: &str = "BULKHEAD_PAGE_TOKENS";
    pub const MAX_BATCH_TOKENS: &str = "BULKHEAD_MAX_BATCH_TOKENS";
    pub const MAX_RUNNING: &str = "BULKHEAD_MAX_RUNNING";
    pub const QUEUE_CAPACITY: &str = "BULKHEAD_QUEUE_CAPACITY";
    pub const QUEUE_TIMEOUT_MS: &str = "BULKHEAD_QUEUE_TIMEOUT_MS";
    pub const SCRUB: &str = "BULKHEAD_SCRUB";
    pub const PREFIX_CACHE: &str = "BULKHEAD_PREFIX_CACHE";
    pub const PREFILL: &str = "BULKHEAD_PREFILL";
    pub const KV_LISTEN: &str = "BULKHEAD_KV_LISTEN";
    pub const KV_ADVERTISE: &str = "BULKHEAD_KV_ADVERTISE";
    pub const TRANSFER_BATCH_BYTES: &str = "BULKHEAD_TRANSFER_BATCH_BYTES";
    pub const TRANSFER_TIMEOUT_MS: &str = "BULKHEAD_TRANSFER_TIMEOUT_MS";
    pub const RELEASE_TIMEOUT_MS: &str = "BULKHEAD_RELEASE_TIMEOUT_MS";
    pub const RECLAIM_AFTER_MS: &str = "BULKHEAD_RECLAIM_AFTER_MS";
    pub const KV_PEER_TIMEOUT_MS: &str = "BULKHEAD_KV_PEER_TIMEOUT_MS";
    pub const TRANSFER_FLOOR: &str = "BULKHEAD_TRANSFER_FLOOR";
    pub const KV_TRANSPORT: &str = "BULKHEAD_KV_TRANSPORT";
    pub const RDMA_DEVICE: &str = "BULKHEAD_RDMA_DEVICE";
    pub const CLUSTER_TOKEN_FILE: &str = "BULKHEAD_CLUSTER_TOKEN_FILE";

    /// What `bulkhead up` sets by flag for the workers it starts (their addresses, roles,
    /// pools in tokens, peers and cluster token); its workers take the rest (`BULKHEAD_SCRUB`,
    /// …, and `BULKHEAD_KV_MEMORY` when up sizes no pool) from its environment.
    pub const SET_BY_UP: [&str; 8] = [
        ROLE,
        LISTEN,
        ADMIN_LISTEN,
        KV_TOKENS,
        PREFILL,
        KV_LISTEN,
        KV_ADVERTISE,
        CLUSTER_TOKEN_FILE,
    ];
}

/// What a worker process does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Role {
    /// Prefill and decode in one process.
    Both,
    /// Prompt forward passes for decode workers; KV pages out.
    Prefill,
    /// Generation; KV pages in from the prefill worker (--prefill).
    Decode,
}

impl Role {
    fn name(self) -> &'static str {
        match self {
            Role::Both => "both",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// `--prefill`, checked: an http:// or https:// address with a host, or why not (a worker
/// given a typo would otherwise start and fail every request).
fn prefill_address(given: &str) -> anyhow::Result<String> {
    // Quoted without what a URL may carry in secret, should an operator have put a credential
    // there: it would be logged at every failed probe.
    let shown = bulkhead_telemetry::redacted_url(given);
    let uri: http::Uri = given
        .parse()
        .with_context(|| format!("--prefill {shown:?} is not an address (http://host:port)"))?;
    anyhow::ensure!(
        matches!(uri.scheme_str(), Some("http" | "https")) && uri.host().is_some(),
        "--prefill {shown:?} is not an http:// or https:// address of a prefill worker"
    );
    anyhow::ensure!(
        !uri.authority().is_some_and(|a| a.as_str().contains('@')) && uri.query().is_none(),
        "--prefill {shown:?}: no credentials or query in the address (the cluster token is \
         --cluster-token-file)"
    );
    Ok(given.to_owned())
}

/// The KV data plane between prefill and decode workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KvTransportArg {
    /// Frames over TCP.
    Tcp,
    /// RDMA through ibverbs (builds with `--features rdma`; checked at startup).
    Rdma,
}

/// What released KV pages are filled with before reuse.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ScrubArg {
    None,
    Zero,
    Canary,
}

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long, env = env::ROLE, value_enum, default_value_t = Role::Both)]
    role: Role,
    /// gRPC address (port 0: any free port; the bound one is printed).
    #[arg(long, env = env::LISTEN, default_value = "127.0.0.1:50051")]
    listen: SocketAddr,
    /// Admin HTTP address for /metrics and /healthz.
    #[arg(long, env = env::ADMIN_LISTEN, default_value = "127.0.0.1:9091")]
    admin_listen: SocketAddr,
    /// KV pool memory: bytes, or with a unit (512MiB, 1GiB, 2GB) [default: 512MiB]
    #[arg(long, env = env::KV_MEMORY, value_parser = parse_bytes, conflicts_with = "kv_tokens")]
    kv_memory: Option<u64>,
    /// KV pool capacity in tokens (rounded up to whole pages), instead of --kv-memory.
    #[arg(long, env = env::KV_TOKENS, value_parser = clap::value_parser!(u64).range(1..))]
    kv_tokens: Option<u64>,
    /// Context length to serve; must fit the pool [default: min(model, pool)]
    #[arg(long, env = env::CONTEXT_LENGTH)]
    context_length: Option<usize>,
    /// Tokens per KV page.
    #[arg(long, env = env::PAGE_TOKENS, default_value_t = bulkhead_kvpool::DEFAULT_PAGE_TOKENS)]
    page_tokens: NonZeroU32,
    /// Tokens processed per step: one per decoding request, the rest for prompts (chunked
    /// prefill), which always get at least a quarter of it.
    #[arg(long, env = env::MAX_BATCH_TOKENS, default_value_t = EngineConfig::default().max_batch_tokens)]
    max_batch_tokens: usize,
    /// Requests generating at once (decode role: with those whose KV is being received).
    #[arg(long, env = env::MAX_RUNNING, default_value_t = EngineConfig::default().max_running)]
    max_running: usize,
    /// Admitted requests that may wait for pages; more get RESOURCE_EXHAUSTED.
    #[arg(long, env = env::QUEUE_CAPACITY, default_value_t = EngineConfig::default().queue_capacity)]
    queue_capacity: usize,
    /// Colocated and decode roles: how long an admitted request may wait for KV pages before
    /// it is refused as busy (RESOURCE_EXHAUSTED, a 429 at the gateway) (milliseconds). Keep it
    /// below the gateway's stream_idle_timeout_secs, which a wait without a word runs out.
    #[arg(long, env = env::QUEUE_TIMEOUT_MS, default_value_t = EngineConfig::default().queue_timeout.as_millis() as u64)]
    queue_timeout_ms: u64,
    /// What released KV pages are filled with before reuse.
    #[arg(long, env = env::SCRUB, value_enum, default_value_t = ScrubArg::Zero)]
    scrub: ScrubArg,
    /// Keep the whole pages of each prompt's KV in its tenant's prefix cache, so a later
    /// prompt of the same tenant that starts with the same tokens computes only the rest
    /// (prefill and both roles) or is sent only the rest (decode role). Never shared between
    /// tenants; cached pages are evicted, least recently used first, when a reservation needs
    /// them.
    #[arg(long, env = env::PREFIX_CACHE, default_value_t = true, action = clap::ArgAction::Set)]
    prefix_cache: bool,
    /// Decode role: the prefill worker's gRPC address (http://host:port).
    #[arg(long, env = env::PREFILL, required_if_eq("role", "decode"))]
    prefill: Option<String>,
    /// Decode role: the KV data-plane listener prefill workers send pages to.
    #[arg(long, env = env::KV_LISTEN, default_value = "127.0.0.1:50061")]
    kv_listen: SocketAddr,
    /// Decode role: the address prefill workers send pages to, when it is not --kv-listen's
    /// (listening on 0.0.0.0 in a pod: the pod's IP, alone for --kv-listen's port, or with a
    /// port) [default: the bound address]
    #[arg(long, env = env::KV_ADVERTISE)]
    kv_advertise: Option<KvAdvertise>,
    /// Prefill role: bytes written per batch; aborts are honoured between batches.
    #[arg(long, env = env::TRANSFER_BATCH_BYTES, value_parser = parse_bytes, default_value = "4MiB")]
    transfer_batch_bytes: u64,
    /// Decode role: how long a reservation waits for its prefill worker's next sign of
    /// progress — more prompt tokens computed, of this prompt or of those queued before it,
    /// then the KV — (milliseconds).
    #[arg(long, env = env::TRANSFER_TIMEOUT_MS, value_parser = at_least_one_ms(), default_value_t = 30_000)]
    transfer_timeout_ms: u64,
    /// The slowest KV transfer rate tolerated, bytes per second (100MB: 100 MB/s). Decode
    /// role: a transfer's deadline is --transfer-timeout-ms plus its bytes at this rate;
    /// prefill role: a send's is --kv-peer-timeout-ms plus its bytes at this rate.
    #[arg(long, env = env::TRANSFER_FLOOR, value_parser = parse_bytes, default_value = "100MB")]
    transfer_floor: u64,
    /// Decode role: how long an abandoned transfer's pages wait for the drain acknowledgement
    /// before they are quarantined (milliseconds).
    #[arg(long, env = env::RELEASE_TIMEOUT_MS, value_parser = at_least_one_ms(), default_value_t = 10_000)]
    release_timeout_ms: u64,
    /// Decode role: how long after a quarantined transfer's peer is known gone (its data
    /// connection closed) its pages are scrubbed and reused; every role: how long the pages
    /// of a request that failed its own integrity check (a page tag, a canary) stay
    /// quarantined before the same (milliseconds).
    #[arg(long, env = env::RECLAIM_AFTER_MS, default_value_t = 2_000)]
    reclaim_after_ms: u64,
    /// Prefill and decode roles: how long a KV data-plane peer that vanished (a dead host, a
    /// partition without a reset) can hold a connection: bytes it leaves unacknowledged this
    /// long, or keepalive probes unanswered from a third of it on, close the connection
    /// (milliseconds). Decode role: a connection on which no message of a session decode is
    /// receiving came for this long is closed too; a frame a peer begins must be whole within
    /// this and a page's time at --transfer-floor.
    /// Decode role: also bounds its gRPC calls to its prefill worker the same way (connects,
    /// and HTTP/2 pings every third of it).
    #[arg(long, env = env::KV_PEER_TIMEOUT_MS, value_parser = at_least_one_ms(), default_value_t = DEFAULT_PEER_TIMEOUT.as_millis() as u64)]
    kv_peer_timeout_ms: u64,
    /// Fault injection for tests (prefill role): stop sending a transfer once this many frames
    /// are written and hold the connection open, like a live but stuck peer.
    #[arg(long, hide = true)]
    fault_stall_after_frames: Option<u32>,
    /// KV data plane: tcp, or rdma (needs a build with --features rdma and an RDMA device;
    /// checked before the model is loaded).
    #[arg(long, env = env::KV_TRANSPORT, value_enum, default_value_t = KvTransportArg::Tcp)]
    kv_transport: KvTransportArg,
    /// With --kv-transport rdma: the RDMA device's verbs name (e.g. mlx5_0) [default: the
    /// first device]
    #[arg(long, env = env::RDMA_DEVICE)]
    rdma_device: Option<String>,
    /// A file holding the deployment's shared secret (at least 32 printable characters, not
    /// starting with #; more than one, one per line, during a rotation): the
    /// worker then answers only gRPC calls that present it, and presents it to its prefill
    /// worker. Without it, anyone who reaches the gRPC port can run requests past the gateway.
    #[arg(long, env = env::CLUSTER_TOKEN_FILE)]
    cluster_token_file: Option<PathBuf>,
    #[command(flatten)]
    tls: crate::tls_args::TlsArgs,
    #[command(flatten)]
    otlp: crate::telemetry::OtlpArgs,
}

impl Args {
    /// The validated data-plane choice.
    fn transport(&self) -> anyhow::Result<TransportConfig> {
        match (self.kv_transport, &self.rdma_device) {
            (KvTransportArg::Tcp, None) => Ok(TransportConfig::Tcp),
            (KvTransportArg::Tcp, Some(_)) => {
                anyhow::bail!("--rdma-device needs --kv-transport rdma")
            }
            (KvTransportArg::Rdma, device) => Ok(TransportConfig::Rdma {
                device: device.clone(),
            }),
        }
    }

    /// The validated serving configuration.
    fn config(&self) -> anyhow::Result<ServeConfig> {
        anyhow::ensure!(
            self.prefill.is_none() || matches!(self.role, Role::Decode),
            "--prefill is for --role decode (a {} worker dials no prefill worker)",
            self.role.name()
        );
        anyhow::ensure!(
            self.kv_advertise.is_none() || matches!(self.role, Role::Decode),
            "--kv-advertise is for --role decode (a {} worker receives no KV pages)",
            self.role.name()
        );
        let role = match self.role {
            Role::Both => RoleConfig::Both,
            Role::Prefill => RoleConfig::Prefill {
                batch_bytes: usize::try_from(self.transfer_batch_bytes)
                    .context("--transfer-batch-bytes is too large")?,
                fault: self
                    .fault_stall_after_frames
                    .map(SendFault::StallAfterFrames),
            },
            Role::Decode => {
                // What prefill workers are told to send pages to: 0.0.0.0 would send them to
                // the prefill worker's own host, every transfer then failing at its timeout.
                let advertised = self
                    .kv_advertise
                    .map_or(self.kv_listen, |a| a.at(self.kv_listen));
                anyhow::ensure!(
                    !advertised.ip().is_unspecified(),
                    "prefill workers would be told to send KV pages to {advertised}: with \
                     --kv-listen on every interface, --kv-advertise must name this worker's \
                     address (its IP, or IP:port)"
                );
                RoleConfig::Decode {
                    prefill: prefill_address(
                        self.prefill
                            .as_deref()
                            .context("--role decode needs --prefill")?,
                    )?,
                    kv_listen: self.kv_listen,
                    kv_advertise: self.kv_advertise,
                }
            }
        };
        let kv = match (self.kv_memory, self.kv_tokens) {
            (_, Some(t)) => KvBudget::Tokens(t),
            (Some(b), None) => KvBudget::Bytes(b),
            (None, None) => EngineConfig::default().kv,
        };
        Ok(ServeConfig {
            role,
            listen: self.listen,
            admin_listen: self.admin_listen,
            engine: EngineConfig {
                kv,
                page_tokens: self.page_tokens,
                scrub: match self.scrub {
                    ScrubArg::None => Scrub::None,
                    ScrubArg::Zero => Scrub::Zero,
                    ScrubArg::Canary => Scrub::Canary,
                },
                context_length: self.context_length,
                max_batch_tokens: self.max_batch_tokens,
                max_running: self.max_running,
                queue_capacity: self.queue_capacity,
                queue_timeout: Duration::from_millis(self.queue_timeout_ms),
                transfer_timeout: Duration::from_millis(self.transfer_timeout_ms),
                transfer_floor_bytes_per_s: self.transfer_floor,
                release_timeout: Duration::from_millis(self.release_timeout_ms),
                reclaim_after: Duration::from_millis(self.reclaim_after_ms),
                prefix_cache: self.prefix_cache,
            },
            kv_peer_timeout: Duration::from_millis(self.kv_peer_timeout_ms),
            cluster_token: self
                .cluster_token_file
                .as_deref()
                .map(SharedToken::read)
                .transpose()?,
            tls: self.tls()?,
        })
    }

    /// The TLS files, read and checked now for the part the role plays: a colocated worker
    /// calls no peer, so its certificate need not allow client authentication.
    fn tls(&self) -> anyhow::Result<Option<ClusterTls>> {
        let part = match self.role {
            Role::Both => Part::Serves,
            Role::Prefill | Role::Decode => Part::ServesAndCalls,
        };
        let settings = self.tls.over(None)?;
        Ok(settings.map(|s| s.load(part)).transpose()?)
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let role = args.role.name();
    let export = args.otlp.otlp_endpoint.clone().map(|endpoint| {
        let otlp = Otlp {
            endpoint,
            audit_logs: false,
        };
        (Service::Worker(role), otlp)
    });
    // Dropped last, after the runtime: exports what is still queued.
    let _telemetry = crate::telemetry::install("info", export)?;
    let config = args.config()?;
    // Before the model is loaded: a data plane this build or machine lacks fails the start now.
    let transport = KvTransport::open(&args.transport()?)?;
    if let KvTransport::Rdma(rdma) = &transport {
        tracing::warn!(
            device = rdma.device(),
            "RDMA device open; the RDMA KV data path is not implemented yet, KV pages travel over TCP"
        );
    }
    args.model.init_threads()?;
    let (loaded, _) = args.model.load()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("bulkhead-io")
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        // Held (an open RDMA device) until serving has ended.
        let _transport = transport;
        let worker = BoundWorker::bind(config, loaded).await?;
        let capacity = worker.capacity();
        let (grpc, admin) = (worker.grpc_addr()?, worker.admin_addr()?);
        let kv = match worker.kv_addr() {
            Some(addr) => format!(" kv={}", addr?),
            None => String::new(),
        };
        tracing::info!(
            %grpc,
            %admin,
            pool_tokens = capacity.pool_tokens,
            served_context = capacity.served_context,
            "worker serving"
        );
        // One machine-readable line on stdout for scripts and tests.
        println!("bulkhead worker ready grpc={grpc} admin={admin}{kv}");
        worker.serve(shutdown_signal()).await?;
        tracing::info!("worker stopped");
        anyhow::Ok(())
    })
}

/// Completes on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    crate::signals::Signals::listen().next().await;
}

/// Bytes, plain or with a unit: `KiB MiB GiB TiB` (powers of 1024) or `kB KB MB GB TB`
/// (powers of 1000); `B` is optional.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit() && c != '_')
        .unwrap_or(s.len());
    let (digits, unit) = s.split_at(split);
    let digits: String = digits.chars().filter(|&c| c != '_').collect();
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("{s:?} is not a byte count like 536870912, 512MiB or 1GiB"))?;
    let scale: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "TiB" => 1 << 40,
        "kB" | "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        other => {
            return Err(format!(
                "unknown unit {other:?} in {s:?}; use B, KiB, MiB, GiB, TiB, kB, MB, GB or TB"
            ));
        }
    };
    n.checked_mul(scale)
        .ok_or_else(|| format!("{s:?} does not fit in 64 bits"))
}

/// A duration flag in milliseconds that must not be zero: a zero timeout fails every transfer
/// at once, and a zero `TCP_USER_TIMEOUT` means no bound at all to the kernel.
fn at_least_one_ms() -> clap::builder::RangedU64ValueParser<u64> {
    clap::value_parser!(u64).range(1..)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_sizes_parse_plain_and_with_units() {
        assert_eq!(parse_bytes("536870912"), Ok(536_870_912));
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("1GiB"), Ok(1 << 30));
        assert_eq!(parse_bytes("1 GiB"), Ok(1 << 30));
        assert_eq!(parse_bytes("2GB"), Ok(2_000_000_000));
        assert_eq!(parse_bytes("64KiB"), Ok(65_536));
        assert_eq!(parse_bytes("1_000B"), Ok(1_000));
    }

    #[test]
    fn bad_byte_sizes_say_what_is_accepted() {
        for bad in ["", "MiB", "1.5GiB", "1G", "-1", "1 parsec"] {
            assert!(parse_bytes(bad).is_err(), "{bad:?} was accepted");
        }
        assert!(parse_bytes("99999999999TiB").is_err());
    }

    #[test]
    fn roles_and_budgets_parse_into_the_serving_configuration() {
        use clap::Parser;

        #[derive(Debug, clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: Args,
        }
        let cli = Cli::try_parse_from(["x", "--role", "decode"]);
        let err = cli
            .expect_err("decode needs its prefill worker")
            .to_string();
        assert!(err.contains("--prefill"), "{err}");
        for flag in [
            "--kv-peer-timeout-ms",
            "--transfer-timeout-ms",
            "--release-timeout-ms",
        ] {
            let err = Cli::try_parse_from(["x", flag, "0"])
                .expect_err(flag)
                .to_string();
            assert!(err.contains(flag), "{err}");
            Cli::try_parse_from(["x", flag, "1"]).expect(flag);
        }
        for bad in [
            "notaurl",
            "p:1",
            "ftp://p:1",
            "http://",
            "http://u:sk-secret@p:1",
            "http://p:1/?token=sk-secret",
            "http://u:sk-secret@p:1/ x",
        ] {
            let cli =
                Cli::try_parse_from(["x", "--role", "decode", "--prefill", bad]).expect("parses");
            let err = format!("{:#}", cli.args.config().expect_err(bad));
            assert!(err.contains("--prefill"), "{bad}: {err}");
            assert!(!err.contains("sk-secret"), "{bad}: {err}");
        }
        let cli = Cli::try_parse_from(["x", "--role", "prefill", "--prefill", "http://p:1"])
            .expect("parses");
        assert!(cli.args.config().is_err(), "--prefill on a prefill worker");
        for role in ["prefill", "both"] {
            let cli = Cli::try_parse_from(["x", "--role", role, "--kv-advertise", "10.0.0.1"])
                .expect("parses");
            let err = cli.args.config().expect_err(role).to_string();
            assert!(err.contains("--kv-advertise is for --role decode"), "{err}");
        }
        let cli = Cli::try_parse_from(["x", "--role", "decode", "--prefill", "http://p:1"])
            .expect("parses");
        let role = cli.args.config().expect("valid").role;
        assert!(
            matches!(role, RoleConfig::Decode { ref prefill, .. } if prefill == "http://p:1"),
            "{role:?}"
        );
        // Listening everywhere, and telling prefill "everywhere": refused before it starts.
        for advertise in [
            &[][..],
            &["--kv-advertise", "0.0.0.0"],
            &["--kv-advertise", "[::]:7"],
        ] {
            let mut args = vec!["x", "--role", "decode", "--prefill", "http://p:1"];
            args.extend(["--kv-listen", "0.0.0.0:50061"]);
            args.extend_from_slice(advertise);
            let cli = Cli::try_parse_from(args).expect("parses");
            let err = cli.args.config().expect_err("unspecified").to_string();
            assert!(
                err.contains("--kv-advertise must name"),
                "{advertise:?}: {err}"
            );
        }
        let cli = Cli::try_parse_from([
            "x",
            "--role",
            "decode",
            "--prefill",
            "http://p:1",
            "--kv-listen",
            "0.0.0.0:50061",
            "--kv-advertise",
            "fd00::5",
        ])
        .expect("parses");
        let role = cli.args.config().expect("valid").role;
        assert!(
            matches!(role, RoleConfig::Decode { kv_advertise: Some(a), .. }
                if a == KvAdvertise::Ip("fd00::5".parse().expect("an IP"))),
            "{role:?}"
        );
        let cli = Cli::try_parse_from(["x", "--role", "prefill", "--transfer-batch-bytes", "1MiB"])
            .expect("parses");
        assert_eq!(
            cli.args.config().expect("valid").role,
            RoleConfig::Prefill {
                batch_bytes: 1 << 20,
                fault: None,
            }
        );
        let cli = Cli::try_parse_from(["x", "--kv-memory", "1GiB", "--kv-tokens", "5"]);
        assert!(cli.is_err(), "--kv-memory and --kv-tokens conflict");
        let cli = Cli::try_parse_from(["x", "--kv-memory", "64MiB"]).expect("parses");
        let config = cli.args.config().expect("valid");
        assert_eq!(config.engine.kv, KvBudget::Bytes(64 << 20));
    }

    #[test]
    fn the_kv_transport_is_tcp_unless_rdma_is_asked_for() {
        use clap::Parser;

        #[derive(Debug, clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: Args,
        }
        let transport = |argv: &[&str]| {
            let cli = Cli::try_parse_from(std::iter::once("x").chain(argv.iter().copied()))
                .map_err(|e| e.to_string())?;
            cli.args.transport().map_err(|e| e.to_string())
        };
        assert_eq!(transport(&[]), Ok(TransportConfig::Tcp));
        assert_eq!(
            transport(&["--kv-transport", "tcp"]),
            Ok(TransportConfig::Tcp)
        );
        assert_eq!(
            transport(&["--kv-transport", "rdma"]),
            Ok(TransportConfig::Rdma { device: None })
        );
        assert_eq!(
            transport(&["--kv-transport", "rdma", "--rdma-device", "mlx5_0"]),
            Ok(TransportConfig::Rdma {
                device: Some("mlx5_0".to_owned())
            })
        );
        let err = transport(&["--rdma-device", "mlx5_0"]).expect_err("tcp has no device");
        assert!(err.contains("--kv-transport rdma"), "{err}");
        let err = transport(&["--kv-transport", "infiniband"]).expect_err("unknown transport");
        assert!(err.contains("tcp") && err.contains("rdma"), "{err}");
    }
}
