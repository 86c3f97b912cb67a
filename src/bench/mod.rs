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

/// The median of `v`: for an even count, the mean of the two middle values (as Python's
/// `statistics.median`, which the peers' scripts use). `v` is not empty.
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let half = v.len() / 2;
    if v.len().is_multiple_of(2) {
        (v[half - 1] + v[half]) / 2.0
    } else {
        v[half]
    }
}

/// Microseconds at quantile `q` of `sorted` by nearest rank: the smallest value with at
/// least `q` of them at or below it. `None` when `sorted` is empty.
fn nearest_rank_us(sorted: &[std::time::Duration], q: f64) -> Option<f64> {
    let rank = (q * sorted.len() as f64).ceil() as usize;
    let at = rank.clamp(1, sorted.len().max(1)) - 1;
    sorted.get(at).map(|d| d.as_secs_f64() * 1e6)
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{median, nearest_rank_us};

    #[test]
    fn quantiles_are_nearest_rank() {
        let ten: Vec<Duration> = (1..=10).map(Duration::from_micros).collect();
        assert_eq!(nearest_rank_us(&ten, 0.5), Some(5.0));
        assert_eq!(nearest_rank_us(&ten, 0.99), Some(10.0));
        assert_eq!(nearest_rank_us(&ten, 0.0), Some(1.0));
        assert_eq!(nearest_rank_us(&ten[..1], 0.99), Some(1.0));
        assert_eq!(nearest_rank_us(&[], 0.5), None);
    }

    #[test]
    fn the_median_of_an_even_count_is_the_mean_of_the_middle_two() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(vec![0.5, 0.75]), 0.625);
        assert_eq!(median(vec![7.0]), 7.0);
    }
}
