//! `bulkhead bench gateway`: the gateway's own overhead, not the model's. One run measures, with
//! the same client load (N keep-alive connections in a closed loop, or paced to a rate; a fixed
//! window, every request's latency recorded), each target in front of the same instant
//! OpenAI-compatible upstream (the load target, its own process):
//!
//! ```text
//!                        ┌──────────────────────────────┐
//!   load generator ──────┤ direct (the baseline)        ├──► load target
//!   (this process,       │ bulkhead gateway, policies off│    (`bench load-target`,
//!    N connections)      │ bulkhead gateway, policies on │     answers at once)
//!                        │ nginx (proxy_pass)            │
//!                        │ LiteLLM proxy                 │
//!                        └──────────────────────────────┘
//! ```
//!
//! Every target is a real process on a loopback socket, started once and kept running; each run
//! measures every target once, in an order that rotates from run to run. Reported: per target
//! the medians over runs of requests/s, p50 and p99; the latency added over the direct
//! baseline; the ratios to nginx and to LiteLLM; the policy chain's cost (on against off).
//! Paired figures are medians of each run's pair. A table on stderr, one JSON object on stdout.
//!
//! The gateway does its whole request path: authentication, tenant limits, chat template and
//! tokenization, admission, the policy chain, the upstream call (a streamed `/v1/completions`,
//! as for any OpenAI-compatible upstream) and an audit record per request (group commit, and in
//! one more target durable: each response waits for its record's fsync). nginx and
//! LiteLLM pass the client's chat request through, and so does the pass-through floor: the
//! gateway's serving threads, hyper's server and a hyper client, and nothing else. The
//! gateway's CPU per request over the floor's is what the gateway's own work costs; the
//! floor's over nginx's is what the serving stack costs.

mod cpu;
mod load;
pub mod load_target;
pub mod pass_through;
mod report;
mod targets;

use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use serde_json::{Map, Value, json};

pub use load_target::LoadTargetArgs;
pub use pass_through::PassThroughArgs;

use super::median;
use super::policies::PolicySetArgs;
use crate::child;
use load::{Load, Sample};
use report::{Figures, Results};
use targets::{Kind, Setup, Started, Target};

#[derive(Debug, clap::Args)]
pub struct GatewayArgs {
    /// Connections the load keeps open; each sends its next request as soon as the last one
    /// is answered.
    #[arg(long, default_value_t = 32)]
    connections: usize,
    /// Seconds measured per target per run.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Seconds of load before each measurement, not counted.
    #[arg(long, default_value_t = 0.5)]
    warmup_seconds: f64,
    /// Repetitions; each measures every target once; medians are reported.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Paced load: requests per second in all, spread evenly over the connections (each
    /// still has at most one request in flight), instead of a closed loop. Every target then
    /// answers the same load, so their CPU per request compares the work each does for a
    /// request at equal load; requests/s ratios say nothing and the throughput goals are not
    /// judged.
    #[arg(long)]
    rate: Option<f64>,
    /// Streamed chat completions (SSE) instead of whole ones.
    #[arg(long)]
    stream: bool,
    /// Over TLS: every target that can (Bulkhead's, the pass-through floor, nginx) listens on
    /// TLS with a certificate from a fresh CA, and the load connects over TLS 1.3 (once per
    /// connection: the connections are kept alive). The load target and LiteLLM are skipped.
    #[arg(long)]
    tls: bool,
    /// The targets to measure (comma-separated).
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = Kind::ALL)]
    targets: Vec<Kind>,
    /// GGUF whose tokenizer and chat template the gateway applies [default: the model fetched
    /// by scripts/fetch-model]
    #[arg(long, env = crate::model_path::MODEL_ENV)]
    model: Option<PathBuf>,
    #[command(flatten)]
    policy_set: PolicySetArgs,
    /// The nginx binary [default: nginx on PATH, else /usr/sbin/nginx]
    #[arg(long)]
    nginx: Option<PathBuf>,
    /// LiteLLM proxy's `litellm` [default: $BULKHEAD_LITELLM_VENV/bin/litellm, else
    /// ~/.cache/bulkhead/litellm-venv/bin/litellm, where scripts/bench-gateway-peers puts it]
    #[arg(long)]
    litellm: Option<PathBuf>,
    /// Threads of the load generator.
    #[arg(long, default_value_t = NonZeroUsize::MIN)]
    client_threads: NonZeroUsize,
    /// Threads of the load target.
    #[arg(long, default_value_t = NonZeroUsize::MIN)]
    target_threads: NonZeroUsize,
    /// Threads of the gateway's runtime, and nginx's worker processes [default: one per CPU,
    /// as `bulkhead gateway` runs]
    #[arg(long)]
    gateway_threads: Option<NonZeroUsize>,
}

/// The longest window, warm-up or pace between a connection's requests the bench takes (a
/// day): past it a figure would take longer than anyone waits, and far past it the clock
/// cannot hold the span.
const MAX_SPAN: Duration = Duration::from_secs(24 * 3600);

/// Whether `secs` is a span the bench takes.
fn within_span(secs: f64) -> bool {
    Duration::try_from_secs_f64(secs).is_ok_and(|d| d <= MAX_SPAN)
}

/// A directory for the targets' configurations, logs and audit data; removed when dropped.
#[derive(Debug)]
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> anyhow::Result<Scratch> {
        let dir =
            std::env::temp_dir().join(format!("bulkhead-bench-gateway-{}", std::process::id()));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        if in_memory(&dir) {
            eprintln!(
                "warning: {} is in memory (tmpfs): the audit log's fsyncs cost nothing there, so \
                 the durable and group-commit figures hold no durability cost (set TMPDIR to a \
                 directory on disk)",
                dir.display()
            );
        }
        Ok(Scratch(dir))
    }
}

/// Whether `dir` lies on a file system held in memory (tmpfs, ramfs), where fsync is free.
fn in_memory(dir: &std::path::Path) -> bool {
    use std::os::unix::ffi::OsStrExt as _;
    let Ok(path) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: statfs(2) reads a NUL-terminated path and fills the zeroed struct it is given.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(path.as_ptr(), &mut fs) } != 0 {
        return false;
    }
    // TMPFS_MAGIC and RAMFS_MAGIC (linux/magic.h).
    matches!(fs.f_type, 0x0102_1994 | 0x8584_58f6)
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn run(args: GatewayArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.runs > 0 && args.connections > 0,
        "--runs and --connections must be at least 1"
    );
    anyhow::ensure!(
        args.seconds > 0.0 && args.warmup_seconds >= 0.0,
        "--seconds must be positive and --warmup-seconds not negative"
    );
    for (flag, secs) in [
        ("--seconds", args.seconds),
        ("--warmup-seconds", args.warmup_seconds),
    ] {
        anyhow::ensure!(
            within_span(secs),
            "{flag} is out of range (at most {} s)",
            MAX_SPAN.as_secs()
        );
    }
    anyhow::ensure!(
        args.rate.is_none_or(|r| r > 0.0 && r.is_finite()),
        "--rate must be a positive number of requests per second"
    );
    anyhow::ensure!(
        args.rate
            .is_none_or(|r| within_span(args.connections as f64 / r)),
        "--rate is too low: each connection would wait over {} s between requests",
        MAX_SPAN.as_secs()
    );
    for (flag, path) in [("--nginx", &args.nginx), ("--litellm", &args.litellm)] {
        if let Some(path) = path {
            anyhow::ensure!(
                targets::first_executable([path.clone()]).is_some(),
                "{flag} {} is not an executable file",
                path.display()
            );
        }
    }
    if cfg!(debug_assertions) {
        eprintln!(
            "note: a debug build measures a slower gateway; quote figures of a release build"
        );
    }
    let kinds: Vec<Kind> = Kind::ALL
        .into_iter()
        .filter(|k| args.targets.contains(k))
        .collect();
    let scratch = Scratch::new()?;
    let setup = |upstream, upstream_process| -> anyhow::Result<Setup> {
        Ok(Setup {
            upstream,
            upstream_process,
            model: crate::model_path::resolve(args.model.as_deref())?,
            policies: std::path::absolute(&args.policy_set.policies)?,
            cache_dir: std::path::absolute(&args.policy_set.cache_dir)?,
            connections: args.connections,
            threads: gateway_threads(&args),
            nginx: targets::find_nginx(args.nginx.clone()),
            litellm: targets::find_litellm(args.litellm.clone()),
            scratch: scratch.0.clone(),
            tls: args
                .tls
                .then(|| targets::bench_tls(&scratch.0.join("tls")))
                .transpose()?,
        })
    };
    let results = crate::runtime::build(args.client_threads, "bench-load")?.block_on(async {
        // Ctrl-C or SIGTERM stops the bench as an error would: its targets stopped, its
        // scratch directory removed.
        let interrupted = crate::worker::shutdown_signal();
        tokio::pin!(interrupted);
        let (mut upstream, addr) = tokio::select! {
            started = targets::load_target(args.target_threads) => started?,
            () = &mut interrupted => bail!("interrupted"),
        };
        let setup = setup(addr, upstream.id().map(cpu::ProcessTree))?;
        let mut running = Vec::new();
        let mut results = Results {
            paced: args.rate.is_some(),
            ..Results::default()
        };
        let mut outcome = Ok(());
        for &kind in &kinds {
            eprintln!("starting {}", kind.label());
            let started = tokio::select! {
                started = targets::start(kind, &setup, args.stream) => started,
                () = &mut interrupted => Err(anyhow::anyhow!("interrupted")),
            };
            match started {
                Ok(Started::Ready(t)) => running.push(*t),
                Ok(Started::Skipped(why)) => {
                    eprintln!("skipping {}: {why}", kind.label());
                    results.skipped.push((kind, why));
                }
                Err(e) => {
                    outcome = Err(e);
                    break;
                }
            }
        }
        if outcome.is_ok() {
            outcome = tokio::select! {
                measured = measure(&args, &mut running, &mut results) => measured,
                () = &mut interrupted => Err(anyhow::anyhow!("interrupted")),
            };
        }
        for t in &mut running {
            t.stop().await;
        }
        child::stop(&mut upstream, Duration::from_secs(5), "load target").await;
        outcome.map(|()| results)
    })?;
    drop(scratch);
    if results.measured.is_empty() {
        bail!("no target was measured (every one was skipped or dropped)");
    }
    eprint!("\n{}", results.table());
    println!("{}", results.to_json(settings(&args)));
    Ok(())
}

/// The gateway's threads (and nginx's workers).
fn gateway_threads(args: &GatewayArgs) -> NonZeroUsize {
    args.gateway_threads.unwrap_or_else(crate::runtime::per_cpu)
}

/// How the bench was run, for the report.
fn settings(args: &GatewayArgs) -> Map<String, Value> {
    let mut s = Map::new();
    s.insert(
        "build".into(),
        json!(if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        }),
    );
    s.insert("connections".into(), json!(args.connections));
    s.insert("seconds".into(), json!(args.seconds));
    s.insert("warmup_seconds".into(), json!(args.warmup_seconds));
    s.insert("runs".into(), json!(args.runs));
    s.insert("rate".into(), json!(args.rate));
    s.insert("stream".into(), json!(args.stream));
    s.insert("tls".into(), json!(args.tls));
    s.insert(
        "policies".into(),
        json!(args.policy_set.policies.display().to_string()),
    );
    s.insert("client_threads".into(), json!(args.client_threads));
    s.insert("load_target_threads".into(), json!(args.target_threads));
    s.insert("gateway_threads".into(), json!(gateway_threads(args)));
    s.insert(
        "scratch_in_memory".into(),
        json!(in_memory(&std::env::temp_dir())),
    );
    s
}

/// Below this share of the offered rate, a paced target is reported as not keeping up.
const PACE_SHORTFALL: f64 = 0.95;

/// Every run measures every running target once, starting one target later each run. A peer
/// that answers nothing correctly in a run is dropped (skipped, with its first error); a
/// Bulkhead target or the baseline doing so fails the bench.
async fn measure(
    args: &GatewayArgs,
    running: &mut Vec<Target>,
    results: &mut Results,
) -> anyhow::Result<()> {
    let pace = args
        .rate
        .map(|rate| Duration::from_secs_f64(args.connections as f64 / rate));
    for run in 0..args.runs {
        let kinds: Vec<Kind> = running.iter().map(|t| t.kind).collect();
        for kind in turns(&kinds, run) {
            let Some(at) = running.iter().position(|t| t.kind == kind) else {
                continue;
            };
            let target = &running[at];
            let sample = load::drive(&Load {
                dial: target.dial.clone(),
                ask: target.ask.clone(),
                connections: args.connections,
                warmup: Duration::from_secs_f64(args.warmup_seconds),
                window: Duration::from_secs_f64(args.seconds),
                pace,
                meter: target.meter,
            })
            .await;
            let Some(figures) = figures(&sample) else {
                let why = format!(
                    "answered no request correctly in run {}: {}",
                    run + 1,
                    sample.first_error.as_deref().unwrap_or("no answer at all")
                );
                if !kind.is_peer() {
                    bail!("{} {why}", kind.label());
                }
                eprintln!("dropping {}: {why}", kind.label());
                let mut gone = running.remove(at);
                gone.stop().await;
                results.measured.retain(|(k, _)| *k != kind);
                results.skipped.push((kind, why));
                continue;
            };
            if let Some(rate) = args.rate.filter(|&r| figures.rps < r * PACE_SHORTFALL) {
                eprintln!(
                    "  {} answered {:.0} of the {rate:.0} requests/s offered: at its limit, \
                     this is a closed loop's figure",
                    kind.label(),
                    figures.rps
                );
            }
            eprintln!(
                "run {}/{} {:<24} {:>8.0} req/s  p50 {:>6.0} µs  p99 {:>6.0} µs  CPU {:>5} µs/req  errors {}",
                run + 1,
                args.runs,
                kind.label(),
                figures.rps,
                figures.p50_us,
                figures.p99_us,
                figures
                    .cpu_us
                    .map_or_else(|| "—".to_owned(), |c| format!("{c:.0}")),
                figures.errors
            );
            if let Some(e) = &sample.first_error {
                eprintln!("  first error: {e}");
            }
            match results.measured.iter_mut().find(|(k, _)| *k == kind) {
                Some((_, runs)) => runs.push(figures),
                None => results.measured.push((kind, vec![figures])),
            }
        }
    }
    // The report lists the targets in their fixed order.
    results
        .measured
        .sort_by_key(|(k, _)| Kind::ALL.iter().position(|a| a == k));
    Ok(())
}

/// The order run `run` measures `kinds` in: one later each run, and backwards every other
/// run, so that no target always follows the same one (the requests a target still had in
/// flight at its window's end, and their CPU, fall on the next one's warm-up). Fixed before
/// the run starts, so that a peer dropped in it leaves the others' turns as they were (each
/// measured once).
fn turns(kinds: &[Kind], run: usize) -> Vec<Kind> {
    let mut order: Vec<Kind> = (0..kinds.len())
        .map(|i| kinds[(run + i) % kinds.len()])
        .collect();
    if !run.is_multiple_of(2) {
        order.reverse();
    }
    order
}

/// A sample's figures; `None` if it holds no correct answer.
fn figures(sample: &Sample) -> Option<Figures> {
    Some(Figures {
        rps: sample.rps(),
        p50_us: sample.quantile_us(0.5)?,
        p99_us: sample.quantile_us(0.99)?,
        requests: sample.latencies.len(),
        errors: sample.errors,
        cpu_us: sample.cpu_us_per_request(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_on_tmpfs_is_in_memory_and_one_on_disk_is_not() {
        let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
        let kind = |at: &str| {
            mounts
                .lines()
                .filter_map(|l| {
                    let mut f = l.split_whitespace();
                    Some((f.nth(1)?, f.next()?))
                })
                .find(|(point, _)| *point == at)
                .map(|(_, kind)| kind.to_owned())
        };
        let mut checked = 0;
        for at in ["/dev/shm", "/proc", "/"] {
            if let Some(kind) = kind(at) {
                let expected = kind == "tmpfs" || kind == "ramfs";
                assert_eq!(
                    in_memory(std::path::Path::new(at)),
                    expected,
                    "{at}: {kind}"
                );
                checked += 1;
            }
        }
        assert!(checked > 0, "no mount point to check in /proc/mounts");
    }

    #[test]
    fn each_run_measures_each_once_and_every_target_follows_every_other() {
        let kinds = [Kind::Direct, Kind::Bulkhead, Kind::Nginx];
        assert_eq!(turns(&kinds, 0), kinds);
        assert_eq!(
            turns(&kinds, 1),
            [Kind::Direct, Kind::Nginx, Kind::Bulkhead]
        );
        assert_eq!(
            turns(&kinds, 2),
            [Kind::Nginx, Kind::Direct, Kind::Bulkhead]
        );
        let mut follows = std::collections::HashSet::new();
        for run in 0..4 {
            let order = turns(&kinds, run);
            let mut sorted = order.clone();
            sorted.sort_by_key(|k| kinds.iter().position(|a| a == k));
            assert_eq!(sorted, kinds, "run {run} measures each once");
            follows.extend(order.windows(2).map(|w| (w[0], w[1])));
        }
        assert_eq!(
            follows.len(),
            6,
            "every ordered pair in four runs: {follows:?}"
        );
    }
}
