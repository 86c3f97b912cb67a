//! `bulkhead bench`: benchmarks that print one JSON object on stdout, medians over `--runs`.

mod engine;
mod gateway;
mod policies;
mod prefix;
mod transfer;

use anyhow::Context;

#[derive(Debug, clap::Subcommand)]
pub enum What {
    /// Prefill and decode tokens/s of the engine.
    Engine(engine::EngineArgs),
    /// Time to first token of prompts that share a long system prompt, the tenant's prefix
    /// cache off and on.
    Prefix(prefix::PrefixArgs),
    /// KV handoff throughput over loopback against a raw socket copy, integrity checks on and
    /// off, and time to first token disaggregated against colocated.
    Transfer(transfer::TransferArgs),
    /// Per-request cost of a policy set's on-request chain (p50, p99 µs) against none.
    Policies(policies::PoliciesArgs),
    /// Requests/s and latency of the gateway in front of an instant OpenAI-compatible upstream,
    /// side by side with the upstream alone, nginx and LiteLLM proxy, policy chain on and off.
    Gateway(gateway::GatewayArgs),
    /// The gateway bench's load target: an instant OpenAI-compatible server (started by
    /// `bench gateway`).
    #[command(hide = true)]
    LoadTarget(gateway::LoadTargetArgs),
    /// The gateway bench's floor: the gateway's serving stack passing requests through
    /// untouched (started by `bench gateway`).
    #[command(hide = true)]
    PassThrough(gateway::PassThroughArgs),
}

pub fn run(what: What) -> anyhow::Result<()> {
    match what {
        What::Engine(args) => engine::run(args),
        What::Prefix(args) => prefix::run(args),
        What::Transfer(args) => transfer::run(args),
        What::Policies(args) => policies::run(args),
        What::Gateway(args) => gateway::run(args),
        What::LoadTarget(args) => gateway::load_target::run(args),
        What::PassThrough(args) => gateway::pass_through::run(args),
    }
}

/// The median of `v` (the upper one for an even count).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The process's peak resident set (VmHWM).
fn peak_rss_bytes() -> anyhow::Result<u64> {
    let status =
        std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let kb = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .context("no VmHWM in /proc/self/status")?;
    Ok(kb * 1024)
}
