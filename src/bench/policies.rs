//! `bulkhead bench policies`: the per-request cost of a policy set's `on-request` chain (every
//! call in a fresh instance, as the gateway runs it), against no policies, as one JSON object,
//! with each binding's plugin and whether its calls start from a snapshot.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use bulkhead_gateway::policy::{Policies, PolicySettings, Refusal, RequestFacts, SandboxSettings};
use serde_json::json;

use super::nearest_rank_us;

/// A policy set and its compiled-component cache, as the benches take them.
#[derive(Debug, clap::Args)]
pub struct PolicySetArgs {
    /// The policy set (plugins built by scripts/build-plugins).
    #[arg(long, default_value = "policies/local.toml")]
    pub policies: PathBuf,
    /// Where compiled components are cached.
    #[arg(long, default_value = "plugins/dist/cache")]
    pub cache_dir: PathBuf,
}

#[derive(Debug, clap::Args)]
pub struct PoliciesArgs {
    #[command(flatten)]
    set: PolicySetArgs,
    /// Requests through the chain.
    #[arg(long, default_value_t = 5000)]
    requests: usize,
}

async fn measure(policies: &Policies, requests: usize) -> anyhow::Result<Vec<Duration>> {
    let headers = http::HeaderMap::new();
    let mut times = Vec::with_capacity(requests);
    for i in 0..requests {
        let id = format!("chatcmpl-bench-{i}");
        let tenant = if i % 2 == 0 { "tenant-a" } else { "tenant-b" };
        let t0 = Instant::now();
        let r = policies
            .on_request(RequestFacts {
                id: &id,
                tenant,
                model: "bench",
                route: "/v1/chat/completions",
                headers: &headers,
                prompt_tokens: 100,
                max_tokens: 256,
            })
            .await;
        times.push(t0.elapsed());
        r.map_err(|e| match &e.refusal {
            Refusal::Denied {
                plugin, message, ..
            } => anyhow::anyhow!(
                "policy {plugin} denied the benchmark's request ({tenant}, 100 prompt tokens, 256 max \
                 tokens on /v1/chat/completions): {message}; the benchmark measures a chain \
                 that lets its requests through"
            ),
            failed @ Refusal::Failed { .. } => {
                anyhow::anyhow!("the chain failed the benchmark's request: {failed}")
            }
        })?;
    }
    times.sort();
    Ok(times)
}

pub fn run(args: PoliciesArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.requests > 0, "--requests must be at least 1");
    let t0 = Instant::now();
    let PolicySetArgs {
        policies: file,
        cache_dir,
    } = args.set;
    let policies = Policies::load(PolicySettings {
        file: file.clone(),
        sandbox: SandboxSettings {
            cache_dir: Some(cache_dir),
            ..SandboxSettings::default()
        },
        watch_interval: None,
        hold_limit: Duration::from_secs(1),
        max_held_per_tenant: 16,
    })
    .with_context(|| format!("loading {}", file.display()))?;
    let load_ms = t0.elapsed().as_secs_f64() * 1e3;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (on, off) = runtime.block_on(async {
        // Warm up (first instantiations fault in the pool's pages).
        measure(&policies, 100.min(args.requests)).await?;
        let on = measure(&policies, args.requests).await?;
        let off = measure(&Policies::disabled(), args.requests).await?;
        anyhow::Ok((on, off))
    })?;
    let chain = policies.current().summary();
    let out = json!({
        "policies": file.display().to_string(),
        "bindings": chain
            .iter()
            .map(|b| json!({"plugin": b.plugin, "snapshot": b.snapshot}))
            .collect::<Vec<_>>(),
        "load_ms": load_ms,
        "requests": args.requests,
        "chain_us": {"p50": nearest_rank_us(&on, 0.5), "p99": nearest_rank_us(&on, 0.99)},
        "no_policies_us": {"p50": nearest_rank_us(&off, 0.5), "p99": nearest_rank_us(&off, 0.99)},
    });
    println!("{out}");
    Ok(())
}
