//! `bulkhead gateway`: the OpenAI-compatible gateway on its own, from a config file;
//! `bulkhead preflight`, the deployment check of the workers a config file lists; and
//! `bulkhead hash-key`, which prints the digest a config file stores for a key.

use std::io::{BufRead, Write as _};
use std::path::PathBuf;

use anyhow::Context;
use bulkhead_gateway::keys::KeyHash;
use bulkhead_gateway::preflight;
use bulkhead_gateway::tenants::ConfigFile;
use bulkhead_gateway::{BoundGateway, Config};

use crate::signals::{self, Signals};
use crate::telemetry::Service;

/// Environment variables, one per flag.
pub mod env {
    pub const CONFIG: &str = "BULKHEAD_GATEWAY_CONFIG";
}

/// What reaches the workers: `bulkhead preflight`'s flags, and the gateway's.
#[derive(Debug, clap::Args)]
pub struct WorkersArgs {
    /// The gateway's TOML configuration (see deploy/local/gateway.toml).
    #[arg(long, env = env::CONFIG)]
    config: PathBuf,
    /// The deployment's mutual TLS towards the workers; given, it replaces `[cluster]`'s
    /// `tls_*` (the same flags and variables as `bulkhead worker`'s).
    #[command(flatten)]
    tls: crate::tls_args::TlsArgs,
}

impl WorkersArgs {
    /// The configuration file, with the cluster TLS flags in place of its `tls_*` when given.
    fn config(&self) -> anyhow::Result<(Config, ConfigFile)> {
        let (mut config, file) = ConfigFile::load(&self.config)
            .with_context(|| format!("invalid configuration {}", self.config.display()))?;
        config.cluster.tls = self.tls.over(config.cluster.tls.take())?;
        Ok((config, file))
    }
}

#[derive(Debug, clap::Args)]
pub struct PreflightArgs {
    #[command(flatten)]
    workers: WorkersArgs,
    /// A worker that does not answer is a warning, not a failure: for a deployment's gate
    /// (Kubernetes' init container), where workers come and go and the gateway routes only to
    /// those that answer and pass. A worker that answers and fails a check still fails.
    #[arg(long)]
    unreachable_warns: bool,
}

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    workers: WorkersArgs,
    #[command(flatten)]
    data_dir: crate::data_dir::DataDir,
    #[command(flatten)]
    threads: crate::runtime::Threads,
    #[command(flatten)]
    otlp: crate::telemetry::OtlpArgs,
    #[command(flatten)]
    listen_tls: crate::tls_args::ListenTlsArgs,
}

impl Args {
    /// The configuration file, with the TLS flags in place of its `tls_*` when given.
    fn config(&self) -> anyhow::Result<(Config, ConfigFile)> {
        let (mut config, file) = self.workers.config()?;
        config.listen.tls = self.listen_tls.over(config.listen.tls.take())?;
        Ok((config, file))
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let (config, file) = args.config()?;
    let export = crate::telemetry::gateway_export(&args.otlp, &config.telemetry)?;
    // Dropped last, after the runtime: exports what is still queued.
    let telemetry = crate::telemetry::install("info", export.map(|o| (Service::Gateway, o)))?;
    let audit_export = telemetry.audit_export();
    let data_dir = args.data_dir.path()?;
    crate::runtime::main()?.block_on(async move {
        let gateway = BoundGateway::bind(config, Some(file), &data_dir, audit_export)
            .await?
            .serving_threads(args.threads.count());
        let (api, admin) = (gateway.api_addr()?, gateway.admin_addr()?);
        tracing::info!(%api, %admin, "gateway serving");
        println!("bulkhead gateway ready api={api} admin={admin}");
        let mut signals = Signals::listen();
        let cut = gateway.cutter();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let mut serving = tokio::spawn(gateway.serve(async move {
            let _ = stopped.await;
        }));
        tokio::select! {
            ended = &mut serving => ended.context("the gateway failed")?,
            () = signals.next() => {
                let _ = stop.send(());
                signals::drain(&mut serving, &mut signals, cut).await?;
            }
        }
        tracing::info!("gateway stopped");
        anyhow::Ok(())
    })
}

/// `bulkhead preflight`: prints each worker's facts and every check (the policy set's too,
/// when the configuration has one); fails if any check does.
pub fn preflight(args: PreflightArgs) -> anyhow::Result<()> {
    let (config, _) = args.workers.config()?;
    let cluster = config.cluster_access()?;
    let (answers, servers) = crate::runtime::main()?.block_on(async {
        let resolver = bulkhead_gateway::discovery::SystemResolver;
        tokio::join!(
            preflight::ask(&config, &cluster, &resolver),
            preflight::probe_servers(&config)
        )
    });
    let mut checks = preflight::checks(&answers);
    checks.extend(preflight::server_checks(&servers));
    if let Some(settings) = config.policies.clone() {
        checks.push(preflight::policy_set(settings));
    }
    if args.unreachable_warns {
        preflight::unreachable_warns(&mut checks);
    }
    let (report, passed) = preflight::render(&answers, &servers, &checks);
    print!("{report}");
    let failed = checks.iter().filter(|c| !c.pass && !c.advisory).count();
    anyhow::ensure!(
        passed,
        "preflight: {failed} check(s) failed; do not route traffic to these workers"
    );
    match checks.iter().filter(|c| !c.pass).count() {
        0 => println!("\npreflight: every check passed"),
        warned => println!("\npreflight: every check passed; {warned} warning(s) above"),
    }
    Ok(())
}

/// Reads one key per line on stdin (so it stays out of shell history and `ps`) and prints
/// each one's SHA-256 hex digest, as `key_sha256` and `token_sha256` hold them, and the key id
/// that audit records name it by.
pub fn hash_key() -> anyhow::Result<()> {
    const STRONG_KEY_CHARS: usize = 32;
    let mut out = std::io::stdout().lock();
    let mut hashed = 0;
    for (n, line) in std::io::stdin().lock().lines().enumerate() {
        let line = line.context("reading stdin")?;
        let key = line.trim();
        if !key.is_empty() {
            // A digest without salt: a short key is found by trying keys against it, by
            // anyone who reads the configuration.
            if key.chars().count() < STRONG_KEY_CHARS {
                eprintln!(
                    "warning: the key on line {} has {} characters: a key this short can be \
                     guessed from its digest; use {STRONG_KEY_CHARS} or more random ones \
                     (openssl rand -hex 32)",
                    n + 1,
                    key.chars().count()
                );
            }
            let hash = KeyHash::of(key);
            writeln!(out, "{} key_id={}", hash.to_hex(), hash.id()).context("writing stdout")?;
            hashed += 1;
        }
    }
    out.flush().context("writing stdout")?;
    anyhow::ensure!(
        hashed > 0,
        "no key on stdin: give one per line (echo \"$KEY\" | bulkhead hash-key)"
    );
    Ok(())
}
