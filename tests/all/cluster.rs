//! Deployments of separate processes, as in production: `bulkhead gateway` processes, and a
//! [`Cluster`] of a prefill worker and a decode worker behind one gateway, each process with its
//! own flags and environment and its log captured (for the canary oracle and for failure
//! messages).
//!
//! Unlike `bulkhead up` (crate::up), each worker can be given flags of its own (pools, scrub,
//! timeouts, faults), killed, or restarted on its address while the gateway keeps running.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::IpAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::up::{ADMIN, STARTUP_LIMIT, TempDir, http, json, test_config};
use crate::worker_grpc::{Place, Worker, collect, text_of};

/// A `bulkhead gateway` process; killed when dropped.
pub(crate) struct Gateway {
    pub child: Child,
    pub api: String,
    pub admin: String,
    /// Its stderr (the log), as far as it got.
    pub log: Arc<Mutex<String>>,
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Gateway {
    /// Starts `bulkhead gateway --config CONFIG --data-dir DATA_DIR` with `env` added to the
    /// environment (`BULKHEAD_LOG` is `warn` unless `env` says otherwise), and waits for its
    /// ready line.
    pub(crate) fn start(config: &Path, data_dir: &Path, env: &[(&str, &str)]) -> Gateway {
        let mut child = Command::new(env!("CARGO_BIN_EXE_bulkhead"))
            .arg("gateway")
            .arg("--config")
            .arg(config)
            .arg("--data-dir")
            .arg(data_dir)
            .env("BULKHEAD_LOG", "warn")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("bulkhead gateway starts");
        let stdout = child.stdout.take().expect("piped");
        let log = collect(child.stderr.take().expect("piped"));
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(rest) = line.strip_prefix("bulkhead gateway ready ") {
                    let _ = tx.send(rest.to_owned());
                }
            }
        });
        let mut gateway = Gateway {
            child,
            api: String::new(),
            admin: String::new(),
            log,
        };
        let ready = rx.recv_timeout(STARTUP_LIMIT).unwrap_or_else(|e| {
            panic!(
                "the gateway did not report ready ({e}); its log:\n{}",
                text_of(&gateway.log)
            )
        });
        for field in ready.split_whitespace() {
            match field.split_once('=') {
                Some(("api", v)) => gateway.api = v.trim_start_matches("http://").to_owned(),
                Some(("admin", v)) => gateway.admin = v.trim_start_matches("http://").to_owned(),
                _ => panic!("unexpected field {field} in the ready line"),
            }
        }
        gateway
    }

    /// `/workers` as name → routable.
    pub(crate) fn routable(&self) -> HashMap<String, bool> {
        self.workers()
            .iter()
            .map(|w| {
                (
                    w["name"].as_str().unwrap_or_default().to_owned(),
                    w["routable"].as_bool().unwrap_or(false),
                )
            })
            .collect()
    }

    /// Waits (bounded) until `/workers` says exactly `want` about the workers it names.
    /// A gateway on `bulkhead up`'s configuration in front of the one colocated worker at
    /// `grpc` (an address), its data in `dir/data`; once it routes to the worker.
    pub(crate) fn in_front_of(dir: &Path, grpc: impl std::fmt::Display) -> Gateway {
        let config = crate::up::colocated_config(dir, &format!("http://{grpc}"));
        let gateway = Gateway::start(&config, &dir.join("data"), &[]);
        gateway.wait_until(&[("one", true)]);
        gateway
    }

    pub(crate) fn wait_until(&self, want: &[(&str, bool)]) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let now = self.routable();
            if want.iter().all(|(n, r)| now.get(*n) == Some(r)) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "want {want:?}, /workers: {now:?}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Waits (bounded) until the gateway has read `worker`'s Info and still does not route to
    /// it; its `/workers` entry.
    pub(crate) fn wait_judged(&self, worker: &str) -> Value {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let report = self.report(worker);
            if !report["info"].is_null() {
                assert_eq!(report["routable"], false, "{report:#}");
                return report;
            }
            assert!(Instant::now() < deadline, "never judged: {report:#}");
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// `worker`'s entry in `/workers`.
    pub(crate) fn report(&self, worker: &str) -> Value {
        let workers = self.workers();
        match workers.iter().find(|w| w["name"] == worker) {
            Some(w) => w.clone(),
            None => panic!("{worker} missing from /workers: {workers:?}"),
        }
    }

    /// `/workers`' entries.
    fn workers(&self) -> Vec<Value> {
        let (status, body) = http(&self.admin, "GET", "/workers", Some(ADMIN), &[], "");
        assert_eq!(status, 200, "{body}");
        match json(&body).get_mut("workers").map(Value::take) {
            Some(Value::Array(workers)) => workers,
            _ => panic!("/workers holds no list: {body}"),
        }
    }

    /// Waits (bounded) until the gateway's health check passes.
    pub(crate) fn wait_healthy(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while http(&self.admin, "GET", "/healthz", Some(ADMIN), &[], "").0 != 200 {
            assert!(
                Instant::now() < deadline,
                "the gateway never became healthy; its log:\n{}",
                text_of(&self.log)
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// `bulkhead preflight --config CONFIG`: (passed, report).
pub(crate) fn preflight(config: &Path) -> (bool, String) {
    preflight_with_env(config, &[])
}

/// `bulkhead preflight --config CONFIG` with the environment variables `env` set.
pub(crate) fn preflight_with_env(config: &Path, env: &[(&str, &Path)]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_bulkhead"))
        .arg("preflight")
        .arg("--config")
        .arg(config)
        .envs(env.iter().copied())
        .output()
        .expect("bulkhead preflight runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// How to start a [`Cluster`] beyond the defaults.
#[derive(Default, Clone, Copy)]
pub(crate) struct Spec<'a> {
    /// Extra flags of the prefill worker (after `--role prefill`).
    pub prefill: &'a [&'a str],
    /// Extra flags of the decode worker (after its role, prefill address and KV listener).
    pub decode: &'a [&'a str],
    /// Environment of every process (the gateway and both workers).
    pub env: &'a [(&'a str, &'a str)],
    /// Text replacements in the gateway's configuration (see `crate::up::Options::replace`).
    pub replace: &'a [(&'a str, &'a str)],
    /// Extra TOML tables for the gateway's configuration.
    pub toml: &'a str,
    /// Where the workers run: `None`, both on loopback.
    pub placement: Option<Placement<'a>>,
    /// The gateway is expected to keep the decode worker unroutable: the start waits until
    /// `/workers` has judged it so, instead of until it is routable and the gateway healthy.
    pub decode_unroutable: bool,
}

/// Workers each in a network namespace of its own (see crate::netns), the gateway in the test's.
#[derive(Clone, Copy)]
pub(crate) struct Placement<'a> {
    pub prefill: &'a Place<'a>,
    pub decode: &'a Place<'a>,
    /// The prefill worker's IP as the decode worker reaches it (across the workers' link).
    pub prefill_from_decode: IpAddr,
    /// The IP the decode worker's KV listener binds, reachable from the prefill worker.
    pub decode_kv: IpAddr,
}

/// A prefill worker and a decode worker (separate processes) behind a `bulkhead gateway`
/// configured like `bulkhead up`'s default (deploy/local/gateway.toml, the test tenants):
/// the workers are `local-prefill` and `local-decode`.
pub(crate) struct Cluster {
    pub gateway: Gateway,
    pub prefill: Worker,
    pub decode: Worker,
    /// The gateway's configuration file.
    pub config: std::path::PathBuf,
    prefill_args: Vec<String>,
    decode_args: Vec<String>,
    env: Vec<(String, String)>,
    dir: TempDir,
}

/// Every process's log level in a cluster: what the code logs at debug and above, without the
/// transport crates' chatter.
pub(crate) const VERBOSE_LOG: &str = "debug,h2=info,hyper=info,hyper_util=info,tonic=info,tower=info,\
     wasmtime=info,cranelift_codegen=info,reqwest=info";

impl Cluster {
    pub(crate) fn start(spec: Spec<'_>) -> Cluster {
        let env: Vec<(String, String)> = spec
            .env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let own = |args: &[&str]| args.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        let prefill_args = [&["--role", "prefill"][..], spec.prefill].concat();
        let decode_args = own(spec.decode);
        let (prefill, decode) = match spec.placement {
            None => {
                let prefill = spawn_worker(&Place::LOCAL, &own(&prefill_args), &env);
                let wiring = decode_role(&prefill, None, &decode_args);
                (prefill, spawn_worker(&Place::LOCAL, &wiring, &env))
            }
            Some(at) => {
                let prefill = spawn_worker(at.prefill, &own(&prefill_args), &env);
                let mut wiring: Vec<String> = [
                    "--role",
                    "decode",
                    "--prefill",
                    &format!("http://{}:{}", at.prefill_from_decode, prefill.grpc.port()),
                    "--kv-listen",
                    &format!("{}:0", at.decode_kv),
                ]
                .iter()
                .map(|s| (*s).to_owned())
                .collect();
                wiring.extend_from_slice(&decode_args);
                (prefill, spawn_worker(at.decode, &wiring, &env))
            }
        };
        let dir = TempDir::new("cluster");
        let prefill_uri = format!("http://{}", prefill.grpc);
        let decode_uri = format!("http://{}", decode.grpc);
        let mut replace = vec![
            ("127.0.0.1:8080", "127.0.0.1:0"),
            ("127.0.0.1:9090", "127.0.0.1:0"),
            ("http://127.0.0.1:50052", prefill_uri.as_str()),
            ("http://127.0.0.1:50051", decode_uri.as_str()),
        ];
        replace.extend_from_slice(spec.replace);
        let config = test_config(&dir.0, &replace, spec.toml);
        let gateway = Gateway::start(&config, &dir.0.join("data"), spec.env);
        if spec.decode_unroutable {
            gateway.wait_judged("local-decode");
        } else {
            gateway.wait_until(&[("local-decode", true)]);
            gateway.wait_healthy();
        }
        Cluster {
            gateway,
            prefill,
            decode,
            config,
            prefill_args: own(&prefill_args),
            decode_args,
            env,
            dir,
        }
    }

    /// The gateway's `--data-dir` (its audit log is under `audit/`).
    pub(crate) fn data_dir(&self) -> std::path::PathBuf {
        self.dir.0.join("data")
    }

    pub(crate) fn api(&self) -> &str {
        &self.gateway.api
    }

    /// The gateway's `/metrics`.
    pub(crate) fn gateway_metrics(&self) -> String {
        let (status, body) = http(&self.gateway.admin, "GET", "/metrics", Some(ADMIN), &[], "");
        assert_eq!(status, 200, "{body}");
        body
    }

    /// Every process's log so far, by name.
    pub(crate) fn logs(&self) -> Vec<(String, String)> {
        vec![
            ("gateway".to_owned(), text_of(&self.gateway.log)),
            ("prefill".to_owned(), text_of(&self.prefill.stderr)),
            ("decode".to_owned(), text_of(&self.decode.stderr)),
        ]
    }

    /// Kills the prefill worker (SIGKILL) and starts a new one with the same flags on the same
    /// gRPC address, so the gateway and the decode worker find it again (loopback clusters).
    pub(crate) fn restart_prefill(&mut self) {
        kill(&mut self.prefill);
        let listen = ["--listen".to_owned(), self.prefill.grpc.to_string()];
        let args = [&self.prefill_args[..], &listen[..]].concat();
        self.prefill = spawn_worker(&Place::LOCAL, &args, &self.env);
    }

    /// Kills the decode worker (SIGKILL) and starts a new one with the same flags on the same
    /// gRPC address (loopback clusters).
    pub(crate) fn restart_decode(&mut self) {
        kill(&mut self.decode);
        let args = decode_role(&self.prefill, Some(self.decode.grpc), &self.decode_args);
        self.decode = spawn_worker(&Place::LOCAL, &args, &self.env);
    }
}

/// Kills a worker and reaps it.
pub(crate) fn kill(worker: &mut Worker) {
    let _ = worker.child.kill();
    let _ = worker.child.wait();
}

/// The decode role's flags, wired to `prefill`, with `extra` after them (and, to restart it
/// where it was, its gRPC address).
fn decode_role(
    prefill: &Worker,
    listen: Option<std::net::SocketAddr>,
    extra: &[String],
) -> Vec<String> {
    let mut args: Vec<String> = [
        "--role",
        "decode",
        "--prefill",
        &format!("http://{}", prefill.grpc),
        "--kv-listen",
        "127.0.0.1:0",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    args.extend_from_slice(extra);
    if let Some(listen) = listen {
        args.extend(["--listen".to_owned(), listen.to_string()]);
    }
    args
}

fn spawn_worker(place: &Place<'_>, args: &[String], env: &[(String, String)]) -> Worker {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    Worker::start_with(place, &args, &env)
}
