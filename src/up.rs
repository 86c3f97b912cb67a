//! `bulkhead up`: one command for a local deployment. Starts the workers the configuration
//! lists — by default (`deploy/local/gateway.toml`) a prefill worker and a decode worker that
//! names it, or a single colocated worker — as children (this same binary) on free loopback
//! ports, waits for their ready lines, then runs the gateway in this process with their
//! addresses filled in. Ctrl-C or SIGTERM stops everything; the children are also killed if
//! this process goes away first.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};
use bulkhead_gateway::tenants::ConfigFile;
use bulkhead_gateway::{BoundGateway, Config, GatewayError, Prepared};
use bulkhead_worker::serve::ClusterToken;
use bulkhead_worker::serve::tls::{Authority, ListenerFiles, TlsFiles, TlsSettings};
use bulkhead_worker::serve::{cluster_token, secret_file};
use tokio::process::{Child, Command};

use crate::child;
use crate::model_path::ModelArgs;
use crate::signals::{self, Signals};
use crate::telemetry::Service;

/// The default configuration, built into the binary. Its policy set and compile cache are
/// paths relative to the working directory (`policies/local.toml`, `plugins/dist/`): `up`
/// runs from the repository root, after `scripts/build-plugins` (`scripts/run` does both).
const DEFAULT_CONFIG: &str = include_str!("../deploy/local/gateway.toml");
/// The cluster token's file in the data directory (owner-only; rewritten at every start).
const CLUSTER_TOKEN_FILE: &str = "cluster-token";
/// With `--tls` or `--https`: the directory in the data directory for the CA and each
/// process's certificate and key (made anew at every start).
const TLS_DIR: &str = "tls";
/// The configuration `up` serves with — its workers' addresses and the cluster's token and
/// TLS files filled in — in the data directory, for `bulkhead preflight --config` (rewritten
/// at every start).
const SERVING_CONFIG_FILE: &str = "up-gateway.toml";
/// Locked in the data directory for as long as `up` runs.
const UP_LOCK_FILE: &str = "up.lock";
/// How long the worker may take to load the model and bind.
const WORKER_START_LIMIT: Duration = Duration::from_secs(120);
/// How long the worker gets to stop after SIGTERM before it is killed.
const WORKER_STOP_LIMIT: Duration = Duration::from_secs(10);

/// Environment variables, one per flag.
pub mod env {
    pub const PORT: &str = "BULKHEAD_PORT";
    pub const ADMIN_PORT: &str = "BULKHEAD_ADMIN_PORT";
    pub const UP_CONFIG: &str = "BULKHEAD_UP_CONFIG";
    pub const PREFILL_KV_TOKENS: &str = "BULKHEAD_PREFILL_KV_TOKENS";
    pub const DECODE_KV_TOKENS: &str = "BULKHEAD_DECODE_KV_TOKENS";
    pub const TLS: &str = "BULKHEAD_UP_TLS";
    pub const HTTPS: &str = "BULKHEAD_UP_HTTPS";
}

/// What `up` starts, from the configuration's workers.
enum Layout {
    /// One `both` worker (index in the configuration).
    Colocated(usize),
    /// A prefill worker and the decode worker that names it (indices).
    Split { prefill: usize, decode: usize },
}

impl Layout {
    fn of(workers: &[bulkhead_gateway::config::WorkerConfig]) -> anyhow::Result<Layout> {
        use bulkhead_gateway::config::{Protocol, WorkerRole};
        if let Some(w) = workers
            .iter()
            .find(|w| !matches!(w.protocol, Protocol::Bulkhead))
        {
            bail!(
                "bulkhead up starts Bulkhead workers; worker {:?} is an OpenAI-compatible \
                 server (run `bulkhead gateway --config` to front it)",
                w.name
            );
        }
        let roles: Vec<WorkerRole> = workers.iter().map(|w| w.role).collect();
        match roles.as_slice() {
            [WorkerRole::Both] => Ok(Layout::Colocated(0)),
            [WorkerRole::Prefill, WorkerRole::Decode] => Ok(Layout::Split {
                prefill: 0,
                decode: 1,
            }),
            [WorkerRole::Decode, WorkerRole::Prefill] => Ok(Layout::Split {
                prefill: 1,
                decode: 0,
            }),
            other => {
                let roles: Vec<&str> = other.iter().map(|r| r.name()).collect();
                bail!(
                    "bulkhead up starts one colocated worker or one prefill + one decode worker; \
                     the configuration lists {}",
                    roles.join(", ")
                )
            }
        }
    }
}

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// The API port on 127.0.0.1 (0: any free port; the bound one is printed) [default: the
    /// configuration's: 8080 in the built-in one]
    #[arg(long, env = env::PORT)]
    port: Option<u16>,
    /// The admin port on 127.0.0.1 [default: the configuration's]
    #[arg(long, env = env::ADMIN_PORT)]
    admin_port: Option<u16>,
    /// Every worker's KV pool in tokens [default: the worker's default pool]
    #[arg(long, env = crate::worker::env::KV_TOKENS, value_parser = clap::value_parser!(u64).range(1..))]
    kv_tokens: Option<u64>,
    /// The prefill worker's KV pool in tokens, apart from the decode worker's (reproduce the
    /// incident: a prefill pool smaller than the context, and watch it being refused).
    #[arg(long, env = env::PREFILL_KV_TOKENS, value_parser = clap::value_parser!(u64).range(1..))]
    prefill_kv_tokens: Option<u64>,
    /// The decode worker's KV pool in tokens.
    #[arg(long, env = env::DECODE_KV_TOKENS, value_parser = clap::value_parser!(u64).range(1..))]
    decode_kv_tokens: Option<u64>,
    /// A gateway configuration to use instead of deploy/local/gateway.toml: it lists one
    /// `both` worker, or one prefill and one decode worker, whose addresses are filled in
    /// with those of the workers `up` starts.
    #[arg(long, env = env::UP_CONFIG)]
    config: Option<PathBuf>,
    /// Mutual TLS between the gateway and the workers and on the KV data plane, as across
    /// hosts: a fresh CA and a certificate per process for 127.0.0.1, in DATA_DIR/tls, at
    /// every start.
    #[arg(long, env = env::TLS)]
    tls: bool,
    /// The API and admin ports take only TLS (HTTPS), with a certificate for 127.0.0.1 and
    /// localhost from a fresh CA in DATA_DIR/tls (clients trust DATA_DIR/tls/ca.pem), at every
    /// start. With --tls, the same CA.
    #[arg(long, env = env::HTTPS)]
    https: bool,
    #[command(flatten)]
    data_dir: crate::data_dir::DataDir,
    #[command(flatten)]
    threads: crate::runtime::Threads,
    #[command(flatten)]
    otlp: crate::telemetry::OtlpArgs,
}

pub fn run(mut args: Args) -> anyhow::Result<()> {
    // Tenants reloads read the file again (compared with it as read here, before the ports and
    // worker addresses below are filled in); the built-in configuration has no file.
    let (mut config, file, source) = match &args.config {
        Some(path) => ConfigFile::load_with_text(path)
            .map(|(config, file, text)| (config, Some(file), text))
            .with_context(|| format!("invalid configuration {}", path.display()))?,
        None => (
            Config::parse(DEFAULT_CONFIG).context("the built-in deploy/local/gateway.toml")?,
            None,
            DEFAULT_CONFIG.to_owned(),
        ),
    };
    let layout = Layout::of(&config.workers)?;
    if let Layout::Colocated(_) = layout {
        for (flag, given) in [
            ("--prefill-kv-tokens", args.prefill_kv_tokens),
            ("--decode-kv-tokens", args.decode_kv_tokens),
        ] {
            if given.is_some() {
                bail!(
                    "{flag} sizes a pool of a prefill + decode pair, but the configuration \
                     lists one colocated (both) worker: size its pool with --kv-tokens"
                );
            }
        }
    }
    if let Some(port) = args.port {
        config.listen.api.set_port(port);
    }
    if let Some(port) = args.admin_port {
        config.listen.admin.set_port(port);
    }
    let export = crate::telemetry::gateway_export(&args.otlp, &config.telemetry)?;
    // The workers export to the same collector as the gateway.
    args.otlp.otlp_endpoint = export.as_ref().map(|o| o.endpoint.clone());
    // Dropped last, after the runtime: exports what is still queued.
    let telemetry = crate::telemetry::install("info", export.map(|o| (Service::Gateway, o)))?;
    let audit_export = telemetry.audit_export();
    // Absolute: the paths written into the serving configuration are read from anywhere.
    let data_dir = std::path::absolute(args.data_dir.path()?).context("the data directory")?;
    // Before anything is written or started: a second `up` on this data directory would
    // replace the running one's token, certificates and configuration, and a busy port or a
    // policy set that does not load would show only after both models had loaded.
    let _running = hold(&data_dir)?;
    // Both ports held from here on, the two on one port failing here too, and the policy set
    // loaded once, for the gateway to serve with.
    let prepared = Prepared::new(&config).map_err(|e| match e {
        GatewayError::Bind { what, addr, .. } => anyhow::Error::new(e).context(format!(
            "the {what} address {addr} cannot be listened on (--port / --admin-port choose others)"
        )),
        GatewayError::Policy(_) => anyhow::Error::new(e).context(
            "the policy set does not load (run `bulkhead up` from the repository root, after \
             scripts/build-plugins)",
        ),
        e => e.into(),
    })?;
    // So are the audit log's key and lock (another gateway on this data directory).
    config.audit.chain_key()?;
    bulkhead_audit::AuditLog::check_unlocked(&bulkhead_gateway::audit_dir(&data_dir))
        .context("the audit log")?;
    // Once nothing else stands in the way (a download of the default model, the first time, is
    // not wasted on a busy data directory or port).
    let model = args.model.path_fetching()?;
    // A fresh cluster token each start: the workers answer only the gateway (and decode only
    // its prefill worker), never another process that finds their loopback ports.
    let token_file = data_dir.join(CLUSTER_TOKEN_FILE);
    write_cluster_token(&token_file)?;
    config.cluster.token_file = Some(token_file.clone());
    // With --tls or --https, a fresh CA each start, as for the token; each process (and the
    // gateway's listeners) gets its own certificate from it.
    let local_ca = if args.tls || args.https {
        Some(LocalTls::new(data_dir.join(TLS_DIR))?)
    } else {
        None
    };
    let tls = local_ca.as_ref().filter(|_| args.tls);
    if tls.is_none() && config.cluster.tls.is_some() {
        bail!(
            "the configuration's [cluster] tls_* name certificates for workers up does not \
             start: up starts its own, in plain text, or with --tls over TLS with certificates \
             it issues"
        );
    }
    if let Some(tls) = tls {
        config.cluster.tls = Some(TlsSettings {
            files: tls.issue("gateway")?,
            server_name: None,
        });
    }
    // How curl trusts the listeners' CA, when up made it.
    let mut cacert = String::new();
    if let Some(ca) = local_ca.as_ref().filter(|_| args.https) {
        config.listen.tls = Some(issued_listener(ca.issue("api")?, config.listen.tls.take()));
        cacert = format!("--cacert {} ", ca.dir.join("ca.pem").display());
    }
    let scheme = if config.listen.tls.is_some() {
        "https"
    } else {
        "http"
    };
    // The listeners' and the cluster's files, read by the gateway once both models have
    // loaded: checked before either starts.
    config.listener_tls()?;
    config.cluster_access()?;
    let secrets = Secrets {
        token_file: &token_file,
        tls,
    };

    crate::runtime::main()?.block_on(async move {
        let mut workers = Vec::new();
        match layout {
            Layout::Colocated(i) => {
                let w = start_worker(&args, &model, &secrets, &["--role", "both"], args.kv_tokens).await?;
                config.workers[i].endpoint = format!("http://{}", w.grpc);
                workers.push(w);
            }
            Layout::Split { prefill, decode } => {
                let p = start_worker(&args, &model, &secrets, &["--role", "prefill"], args.prefill_kv_tokens.or(args.kv_tokens))
                    .await?;
                let prefill_uri = format!("http://{}", p.grpc);
                let d_args = ["--role", "decode", "--prefill", &prefill_uri, "--kv-listen", "127.0.0.1:0"];
                let d = start_worker(&args, &model, &secrets, &d_args, args.decode_kv_tokens.or(args.kv_tokens)).await?;
                config.workers[prefill].endpoint = prefill_uri;
                config.workers[decode].endpoint = format!("http://{}", d.grpc);
                workers.push(p);
                workers.push(d);
            }
        }
        // Owner only: it holds the tenants' key hashes, as the file it copies.
        let serving_config = data_dir.join(SERVING_CONFIG_FILE);
        secret_file::write(&serving_config, serving(&source, &config)?.as_bytes())
            .with_context(|| format!("writing {}", serving_config.display()))?;
        let gateway = BoundGateway::bind_prepared(config, file, &data_dir, audit_export, prepared)
            .await?
            .serving_threads(args.threads.count());
        let (api, admin) = (gateway.api_addr()?, gateway.admin_addr()?);
        let listing: Vec<String> = workers
            .iter()
            .map(|w| format!("{role}={} {role}_pid={}", w.grpc, w.child.id().unwrap_or(0), role = w.role))
            .collect();
        println!("bulkhead up ready api={scheme}://{api} admin={scheme}://{admin} {}", listing.join(" "));
        println!(
            "\nBulkhead is serving an OpenAI-compatible API at {scheme}://{api}/v1\n\
             Try (the keys are demo-only):\n\n  \
             curl {cacert}{scheme}://{api}/v1/chat/completions \\\n    \
             -H 'Authorization: Bearer sk-demo-tenant-a' -H 'Content-Type: application/json' \\\n    \
             -d '{{\"messages\": [{{\"role\": \"user\", \"content\": \"What is 2+2?\"}}], \"max_tokens\": 32}}'\n\n\
             Metrics: curl {cacert}-H 'Authorization: Bearer sk-demo-admin' {scheme}://{admin}/metrics\n\
             Preflight: bulkhead preflight --config {}\n\
             Ctrl-C stops the gateway and the workers.",
            serving_config.display()
        );
        if let Some(tls) = secrets.tls {
            println!("Gateway and workers speak mutual TLS (CA and certificates in {}).", tls.dir.display());
        }

        let mut signals = Signals::listen();
        let cut = gateway.cutter();
        let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
        let mut serving = tokio::spawn(gateway.serve(async move {
            let _ = stop_rx.wait_for(|s| *s).await;
        }));
        let any_exit = futures_util::future::select_all(workers.iter_mut().map(|w| Box::pin(w.child.wait())));
        // What ended the run: a signal, a worker's exit, or the gateway's own end (a panic).
        let (worker_died, gateway_ended) = tokio::select! {
            () = signals.next() => (None, None),
            (status, index, _) = any_exit => (Some((index, status)), None),
            ended = &mut serving => (None, Some(ended)),
        };
        let _ = stop_tx.send(true);
        let gateway_stopped = gateway_ended.is_some();
        let (served, cut) = match gateway_ended {
            Some(ended) => (ended.context("the gateway failed"), false),
            None => match signals::drain(&mut serving, &mut signals, cut).await {
                Ok(cut) => (Ok(()), cut),
                Err(e) => (Err(e), false),
            },
        };
        // All at once: each may take its whole stop limit (a collector that never answers);
        // after a second signal, none.
        let limit = if cut { Duration::ZERO } else { WORKER_STOP_LIMIT };
        futures_util::future::join_all(workers.iter_mut().map(|w| async move {
            child::stop(&mut w.child, limit, &format!("{} worker", w.role)).await;
        }))
        .await;
        if let Some((index, status)) = worker_died {
            bail!("the {} worker exited ({status:?}); stopped everything", workers[index].role);
        }
        served?;
        if gateway_stopped {
            bail!("the gateway stopped serving; stopped everything");
        }
        eprintln!("bulkhead up: stopped");
        anyhow::Ok(())
    })
}

/// The listeners' files once `up --https` issued their certificate: the certificate up's CA
/// issued, and the client CA the configuration's `[listen]` asks for, if it does (a flag that
/// renews a certificate must not drop the client check the file asks for, as `tls_args`).
fn issued_listener(issued: TlsFiles, file: Option<ListenerFiles>) -> ListenerFiles {
    ListenerFiles {
        client_ca: file.and_then(|f| f.client_ca),
        ..issued.into()
    }
}

struct Worker {
    child: Child,
    grpc: String,
    /// `both`, `prefill` or `decode`.
    role: String,
}

/// `source`, the configuration file `up` started from, with what `up` filled in from `config`:
/// the workers' addresses and the cluster's token and TLS files (its ports stay the file's:
/// preflight dials only the workers).
fn serving(source: &str, config: &Config) -> anyhow::Result<String> {
    let mut doc: toml::Table = toml::from_str(source).context("the configuration's TOML")?;
    let workers = doc
        .get_mut("workers")
        .and_then(toml::Value::as_array_mut)
        .context("the configuration lists no [[workers]]")?;
    for (table, worker) in workers.iter_mut().zip(&config.workers) {
        if let Some(table) = table.as_table_mut() {
            table.insert("grpc".into(), worker.endpoint.clone().into());
        }
    }
    let cluster = doc
        .entry("cluster")
        .or_insert_with(|| toml::Table::new().into());
    let cluster = cluster
        .as_table_mut()
        .context("the configuration's cluster is not a table")?;
    let path = |p: &std::path::Path| toml::Value::from(p.display().to_string());
    if let Some(token) = &config.cluster.token_file {
        cluster.insert("token_file".into(), path(token));
    }
    if let Some(tls) = &config.cluster.tls {
        cluster.insert("tls_ca".into(), path(&tls.files.ca));
        cluster.insert("tls_cert".into(), path(&tls.files.cert));
        cluster.insert("tls_key".into(), path(&tls.files.key));
        // The workers' certificates name the address dialled, not the file's name.
        match &tls.server_name {
            Some(name) => cluster.insert("tls_server_name".into(), name.clone().into()),
            None => cluster.remove("tls_server_name"),
        };
    }
    // The policy paths resolve against the directory up runs in, as the gateway's do.
    if let Some(policies) = doc.get_mut("policies").and_then(toml::Value::as_table_mut) {
        for key in ["file", "cache_dir"] {
            if let Some(relative) = policies.get(key).and_then(toml::Value::as_str) {
                let absolute = std::path::absolute(relative)
                    .with_context(|| format!("the policies' {key} {relative}"))?;
                policies.insert(key.into(), path(&absolute));
            }
        }
    }
    let text = toml::to_string(&doc).context("writing the serving configuration")?;
    Ok(format!(
        "# The configuration `bulkhead up` serves with, for `bulkhead preflight --config`: its\n\
         # workers' addresses and the cluster's token and TLS files filled in. The listeners\n\
         # are the file's it started from (not the ports bound, nor --https).\n{text}"
    ))
}

/// Takes `data_dir`'s lock for as long as the returned file is open, or says that another
/// `bulkhead up` holds it.
fn hold(data_dir: &std::path::Path) -> anyhow::Result<std::fs::File> {
    std::fs::create_dir_all(data_dir)
        .with_context(|| format!("creating {}", data_dir.display()))?;
    let path = data_dir.join(UP_LOCK_FILE);
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => bail!(
            "another `bulkhead up` is running on {} (stop it, or give this one another \
             --data-dir)",
            data_dir.display()
        ),
        // A file system without locks (NFS with no lock daemon): up runs, unguarded.
        Err(std::fs::TryLockError::Error(e)) => {
            eprintln!(
                "warning: cannot lock {} ({e}): a second `bulkhead up` on this data directory \
                 would not be refused",
                path.display()
            );
            Ok(file)
        }
    }
}

/// A fresh random cluster token, written to `path` readable by this user only.
fn write_cluster_token(path: &std::path::Path) -> anyhow::Result<()> {
    let (_, secret) = ClusterToken::generate();
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    cluster_token::write_file(path, &secret)
        .with_context(|| format!("writing the cluster token to {}", path.display()))
}

/// What the processes `up` starts share: the cluster token's file and, with `--tls`, the CA
/// that issues each process's certificate.
struct Secrets<'a> {
    token_file: &'a std::path::Path,
    tls: Option<&'a LocalTls>,
}

/// `up --tls`'s and `--https`'s CA, issuing certificates for 127.0.0.1 and localhost into
/// `dir`.
struct LocalTls {
    ca: Authority,
    dir: PathBuf,
}

impl LocalTls {
    fn new(dir: PathBuf) -> anyhow::Result<LocalTls> {
        let ca = Authority::new("bulkhead up CA").context("making a CA for --tls")?;
        Ok(LocalTls { ca, dir })
    }

    /// The files of a certificate for the process called `name`.
    fn issue(&self, name: &str) -> anyhow::Result<TlsFiles> {
        self.ca
            .write(
                &self.dir,
                name,
                &["127.0.0.1".to_owned(), "localhost".to_owned()],
            )
            .with_context(|| format!("writing {name}'s certificate to {}", self.dir.display()))
    }
}

/// Starts `bulkhead worker` with `role_args`, a KV pool of `kv_tokens` and `secrets`, and
/// waits until it reports ready.
async fn start_worker(
    args: &Args,
    model: &std::path::Path,
    secrets: &Secrets<'_>,
    role_args: &[&str],
    kv_tokens: Option<u64>,
) -> anyhow::Result<Worker> {
    let role = role_args.get(1).copied().unwrap_or("both").to_owned();
    // `/proc/self/exe`: this very binary, even after its file was replaced or removed (a
    // rebuild while a model loads) — its path would start another version, or nothing.
    let mut cmd = Command::new("/proc/self/exe");
    cmd.arg("worker")
        .args(role_args)
        .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
        .arg("--model")
        .arg(model)
        .arg("--cluster-token-file")
        .arg(secrets.token_file);
    if let Some(tls) = secrets.tls {
        let files = tls.issue(&role)?;
        cmd.arg("--tls-ca").arg(files.ca);
        cmd.arg("--tls-cert").arg(files.cert);
        cmd.arg("--tls-key").arg(files.key);
    }
    if let Some(t) = kv_tokens {
        cmd.arg("--kv-tokens").arg(t.to_string());
    }
    if let Some(endpoint) = &args.otlp.otlp_endpoint {
        cmd.arg("--otlp-endpoint").arg(endpoint.to_string());
    }
    cmd.args(args.model.device_args());
    if let Some(t) = args.model.threads {
        cmd.arg("--threads").arg(t.to_string());
    }
    // What `up` sets by flag, never by what its own environment says for a worker (a
    // `BULKHEAD_KV_MEMORY` there conflicts with `--kv-tokens`; TLS files with no `--tls`).
    for var in crate::worker::env::SET_BY_UP
        .into_iter()
        .chain(crate::tls_args::env::CLUSTER)
    {
        cmd.env_remove(var);
    }
    // A pool sized in bytes stands, unless up sizes it in tokens.
    if kv_tokens.is_some() {
        cmd.env_remove(crate::worker::env::KV_MEMORY);
    }
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        // Its own process group: a terminal's Ctrl-C reaches `up` alone, which stops the
        // gateway first (its requests drain) and then the workers.
        .process_group(0);
    child::die_with_parent(&mut cmd);
    let what = format!("{role} worker");
    let mut child = cmd
        .spawn()
        .with_context(|| format!("starting the {what}"))?;
    let ready = child::ready_line(
        &mut child,
        "bulkhead worker ready ",
        WORKER_START_LIMIT,
        &what,
    )
    .await?;
    let grpc = child::field(&ready, "grpc")
        .context("the worker's ready line has no grpc= address")?
        .to_owned();
    Ok(Worker { child, grpc, role })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn https_keeps_the_client_ca_the_configuration_asks_for() {
        let issued = || TlsFiles {
            ca: "/d/tls/ca.pem".into(),
            cert: "/d/tls/api.pem".into(),
            key: "/d/tls/api.key".into(),
        };
        let file = ListenerFiles {
            cert: "/etc/old.pem".into(),
            key: "/etc/old.key".into(),
            client_ca: Some("/etc/clients.pem".into()),
        };
        let got = issued_listener(issued(), Some(file));
        assert_eq!(got.client_ca, Some("/etc/clients.pem".into()));
        assert_eq!(got.cert, std::path::PathBuf::from("/d/tls/api.pem"));
        assert_eq!(issued_listener(issued(), None).client_ca, None);
    }

    #[test]
    fn the_serving_configuration_names_the_workers_up_started_and_the_cluster_token() {
        let mut config = Config::parse(DEFAULT_CONFIG).expect("valid");
        config.workers[0].endpoint = "http://127.0.0.1:41001".into();
        config.workers[1].endpoint = "http://127.0.0.1:41002".into();
        config.cluster.token_file = Some("/data/cluster-token".into());
        let text = serving(DEFAULT_CONFIG, &config).expect("written");
        let served = Config::parse(&text).unwrap_or_else(|e| panic!("{e}:\n{text}"));
        let endpoints: Vec<&str> = served.workers.iter().map(|w| w.endpoint.as_str()).collect();
        assert_eq!(
            endpoints,
            ["http://127.0.0.1:41001", "http://127.0.0.1:41002"]
        );
        assert_eq!(served.cluster.token_file, config.cluster.token_file);
        assert_eq!(served.tenants.len(), config.tenants.len());
        // Read from anywhere: the policy set's path is absolute.
        let policies = served
            .policies
            .expect("the built-in configuration's policies");
        assert!(policies.file.is_absolute(), "{:?}", policies.file);
        assert!(policies.file.ends_with("policies/local.toml"));
    }

    #[test]
    fn up_refuses_a_worker_it_cannot_start_and_names_the_certificates_it_issued() {
        let openai = DEFAULT_CONFIG
            .replacen(
                "grpc = \"http://127.0.0.1:50052\"\nrole = \"prefill\"",
                "openai = \"http://127.0.0.1:8000\"\nrole = \"both\"\nmodel = \"m\"\n\
                 context_length = 8\ntokenizer = \"m.gguf\"",
                1,
            )
            .replacen(
                "[[workers]]\nname = \"local-decode\"\ngrpc = \"http://127.0.0.1:50051\"\n\
                 role = \"decode\"\nprefill = \"local-prefill\"",
                "",
                1,
            );
        let config = Config::parse(&openai).unwrap_or_else(|e| panic!("{e}:\n{openai}"));
        let e = Layout::of(&config.workers)
            .err()
            .expect("an OpenAI-compatible worker is refused");
        assert!(e.to_string().contains("an OpenAI-compatible server"), "{e}");

        let named = format!(
            "{DEFAULT_CONFIG}\n[cluster]\ntls_ca = \"/etc/ca.pem\"\ntls_cert = \"/etc/g.pem\"\n\
             tls_key = \"/etc/g.key\"\ntls_server_name = \"workers.internal\"\n"
        );
        let mut config = Config::parse(&named).unwrap_or_else(|e| panic!("{e}:\n{named}"));
        let asked = config
            .cluster
            .tls
            .as_ref()
            .and_then(|t| t.server_name.clone());
        assert_eq!(asked.as_deref(), Some("workers.internal"));
        config.cluster.tls = Some(TlsSettings {
            files: TlsFiles {
                ca: "/d/tls/ca.pem".into(),
                cert: "/d/tls/gateway.pem".into(),
                key: "/d/tls/gateway.key".into(),
            },
            server_name: None,
        });
        let text = serving(&named, &config).expect("written");
        let served = Config::parse(&text).unwrap_or_else(|e| panic!("{e}:\n{text}"));
        assert_eq!(served.cluster.tls, config.cluster.tls, "{text}");
    }

    #[test]
    fn the_built_in_configuration_is_valid_and_holds_no_clear_keys() {
        let config = Config::parse(DEFAULT_CONFIG).expect("valid");
        assert_eq!(config.tenants.len(), 2);
        assert!(
            matches!(Layout::of(&config.workers), Ok(Layout::Split { .. })),
            "prefill + decode by default"
        );
        // The demo keys are named in comments only; no setting holds a clear key.
        for line in DEFAULT_CONFIG.lines() {
            let setting = line.split('#').next().unwrap_or_default();
            assert!(!setting.contains("sk-"), "a clear key in a setting: {line}");
        }
        let a = config
            .tenants
            .keyring()
            .tenant(&bulkhead_gateway::keys::KeyHash::of("sk-demo-tenant-a"))
            .expect("tenant-a's demo key");
        assert_eq!(a.id.as_str(), "tenant-a");
        assert_eq!(
            config.admin_token,
            bulkhead_gateway::keys::KeyHash::of("sk-demo-admin")
        );
    }
}
