//! `bulkhead bench prefix`: what the per-tenant prefix cache saves on a chat workload — every
//! request starts with one long shared system prompt and ends with its own short question —
//! as time to first token with the cache off and on, side by side in one run (medians over
//! every request, paired ratio). Each run starts from an empty cache: a run's questions are
//! the last run's again, and only the shared prompt is there to be read. `--prompts-out` hands the same prompts to the llama.cpp peer
//! (scripts/bench-prefix-vs-llamacpp).

use anyhow::Context;
use bulkhead_worker::engine::{Engine, EngineConfig, KvBudget};
use serde_json::json;

use super::engine::{Bench, TEXT};
use super::median;
use crate::model_path::ModelArgs;

#[derive(Debug, clap::Args)]
pub struct PrefixArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Tokens of the system prompt every request starts with.
    #[arg(long, default_value_t = 448)]
    shared_tokens: usize,
    /// Tokens of each request's own question after it.
    #[arg(long, default_value_t = 32)]
    question_tokens: usize,
    /// Requests per run, one at a time, each with another question.
    #[arg(long, default_value_t = 8)]
    requests: usize,
    /// Repetitions, each from an empty cache; the medians are over every request of every
    /// run.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Also write the prompts, as token ids in the order they were measured, to this JSON
    /// file (`{"prompts": [[…], …]}`): the llama.cpp peer measures the very same ones
    /// (scripts/bench-prefix-vs-llamacpp).
    #[arg(long)]
    prompts_out: Option<std::path::PathBuf>,
}

pub fn run(args: PrefixArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.runs > 0 && args.requests > 0,
        "--runs and --requests must be at least 1"
    );
    anyhow::ensure!(
        args.question_tokens > 0,
        "--question-tokens must be at least 1"
    );
    let threads = args.model.init_threads()?;
    let start = |prefix_cache| -> anyhow::Result<Bench> {
        let (loaded, _) = args.model.load()?;
        let config = EngineConfig {
            kv: KvBudget::Tokens(4 * (args.shared_tokens + args.question_tokens) as u64 + 64),
            max_batch_tokens: (args.shared_tokens + args.question_tokens).max(64),
            prefix_cache,
            ..EngineConfig::default()
        };
        Ok(Bench::new(Engine::new(
            loaded.model,
            loaded.tokenizer,
            config,
        )?))
    };
    let mut sides = vec![start(false)?, start(true)?];
    let text = TEXT
        .repeat(1 + (args.shared_tokens + args.question_tokens * args.requests) * 6 / TEXT.len());
    let all = sides[0].engine.tokenizer().encode(&text, false)?;
    let shared = all
        .get(..args.shared_tokens)
        .context("benchmark text too short")?;
    let questions: Vec<Vec<u32>> = (0..args.requests)
        .map(|i| {
            let at = args.shared_tokens + i * args.question_tokens;
            let question = all
                .get(at..at + args.question_tokens)
                .context("benchmark text too short")?;
            Ok([shared, question].concat())
        })
        .collect::<anyhow::Result<_>>()?;
    if let Some(path) = &args.prompts_out {
        let measured: Vec<&Vec<u32>> = (0..args.runs).flat_map(|_| &questions).collect();
        std::fs::write(path, json!({ "prompts": measured }).to_string())
            .with_context(|| format!("writing the prompts to {}", path.display()))?;
    }
    // Seconds to the first token, per side (0: cache off, 1: on), every request of every run;
    // the sides alternate request by request so that a slow phase of the machine hits both.
    let mut ttft = [Vec::new(), Vec::new()];
    let (mut cached, mut prompted) = (0, 0);
    for run in 0..args.runs {
        if run > 0 {
            // The cache as the last run left it holds every question of this run whole: both
            // sides start afresh (alike, so neither alone pays a fresh engine's first request),
            // the old engines gone before the new ones load.
            let stats = sides[1].engine.prefix_stats();
            (cached, prompted) = (cached + stats.cached_tokens, prompted + stats.prompt_tokens);
            sides.clear();
            sides = vec![start(false)?, start(true)?];
        }
        for prompt in &questions {
            for (side, bench) in sides.iter_mut().enumerate() {
                ttft[side].push(bench.prefill(prompt)?.0);
            }
        }
    }
    let ratios: Vec<f64> = ttft[0]
        .iter()
        .zip(&ttft[1])
        .map(|(off, on)| off / on)
        .collect();
    let stats = sides[1].engine.prefix_stats();
    let (cached, prompted) = (cached + stats.cached_tokens, prompted + stats.prompt_tokens);
    let ms = |v: &[f64]| median(v.iter().map(|s| s * 1e3).collect());
    let out = json!({
        "threads": threads,
        "shared_tokens": args.shared_tokens,
        "question_tokens": args.question_tokens,
        "requests": args.requests,
        "runs": args.runs,
        "ttft_ms_cache_off": ms(&ttft[0]),
        "ttft_ms_cache_on": ms(&ttft[1]),
        "ttft_off_over_on": median(ratios),
        "prompt_tokens_read_from_cache_pct": cached as f64 * 100.0 / prompted.max(1) as f64,
    });
    println!("{out}");
    Ok(())
}
