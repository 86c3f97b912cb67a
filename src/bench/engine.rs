//! `bulkhead bench engine`: prefill and decode throughput of the engine on one model, as one
//! JSON object on stdout. Medians over `--runs` repetitions.

use std::sync::mpsc;
use std::time::Instant;

use anyhow::{Context, bail};
use bulkhead_kernels::Simd;
use bulkhead_kernels::attention::TagCheck;
use bulkhead_kvpool::RequestId;
use bulkhead_worker::engine::{Engine, EngineConfig, Event, KvBudget, Request};
use bulkhead_worker::loader::LoadedModel;
use bulkhead_worker::sampling::SamplingParams;
use serde_json::json;

use super::{median, peak_rss_bytes};
use crate::model_path::ModelArgs;

#[derive(Debug, clap::Args)]
pub struct EngineArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt tokens for the prefill measurement.
    #[arg(long, default_value_t = 512)]
    prefill_tokens: usize,
    /// New tokens per request for the decode measurements.
    #[arg(long, default_value_t = 128)]
    decode_tokens: usize,
    /// Repetitions; the medians are reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Kernel level to use (`portable`, `avx2`, `avx512`) [default: the best this CPU has].
    #[arg(long)]
    simd: Option<String>,
}

/// Prose the benchmark prompts are cut from.
pub(super) const TEXT: &str = "The harbour woke before the town did. Fishing boats slid out past the breakwater \
    while the lamps along the quay were still lit, and the gulls followed them, crying over the \
    grey water. In the market hall, traders stacked crates of apples and pears, argued about the \
    price of salt, and drank coffee from chipped enamel mugs. ";

pub fn run(args: EngineArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.runs > 0, "--runs must be at least 1");
    let threads = args.model.init_threads()?;
    let path = args.model.path()?;
    let mut loaded = LoadedModel::open(&path)?;
    if let Some(name) = &args.simd {
        let simd = Simd::by_name(name).with_context(|| {
            let have: Vec<_> = Simd::available().iter().map(|s| s.name()).collect();
            format!("--simd {name}: this CPU offers {have:?}")
        })?;
        loaded.model.set_simd(simd);
    }
    let text = TEXT.repeat(1 + args.prefill_tokens * 6 / TEXT.len());
    let all = loaded.tokenizer.encode(&text, false)?;
    anyhow::ensure!(all.len() >= args.prefill_tokens, "benchmark text too short");
    let long_prompt = all[..args.prefill_tokens].to_vec();
    let config = EngineConfig {
        kv: KvBudget::Tokens(((args.prefill_tokens + args.decode_tokens) * 8 + 1024) as u64),
        max_batch_tokens: args.prefill_tokens.max(64),
        ..EngineConfig::default()
    };
    let mut bench = Bench {
        engine: Engine::new(loaded.model, loaded.tokenizer, config)?,
        next_id: 0,
    };

    let mut prefill = Vec::new();
    let mut decode_b1 = Vec::new();
    let mut decode_b1_unchecked = Vec::new();
    let mut decode_b8 = Vec::new();
    for run in 0..args.runs {
        prefill.push(bench.prefill(&long_prompt)?);
        // The page-tag check's cost: the same decode with the check on and off, back to back,
        // in alternating order so that neither side always runs first.
        for check in if run % 2 == 0 {
            [TagCheck::On, TagCheck::Off]
        } else {
            [TagCheck::Off, TagCheck::On]
        } {
            bench.engine.set_tag_check(check);
            let tok_s = bench.decode(&[&all[..32]], args.decode_tokens)?;
            match check {
                TagCheck::On => decode_b1.push(tok_s),
                TagCheck::Off => decode_b1_unchecked.push(tok_s),
            }
        }
        bench.engine.set_tag_check(TagCheck::On);
        let prompts: Vec<&[u32]> = (0..8).map(|i| &all[i * 7..i * 7 + 32]).collect();
        decode_b8.push(bench.decode(&prompts, args.decode_tokens)?);
    }
    let report = json!({
        "model": path.display().to_string(),
        "threads": threads,
        "simd": bench.engine.model().simd().name(),
        "runs": args.runs,
        "prefill_prompt_tokens": args.prefill_tokens,
        "decode_new_tokens": args.decode_tokens,
        "prefill_tok_s": median(prefill),
        "decode_b1_tok_s": median(decode_b1.clone()),
        "decode_b8_tok_s": median(decode_b8),
        "decode_b1_tag_check_off_tok_s": median(decode_b1_unchecked.clone()),
        "tag_check_cost_pct": tag_check_cost_pct(&decode_b1, &decode_b1_unchecked),
        "peak_rss_bytes": peak_rss_bytes()?,
    });
    println!("{report}");
    Ok(())
}

/// The tag check's cost in percent of decode throughput: the median over runs of each run's
/// paired (on, off) difference, so slow phases of a shared machine hit both sides alike.
fn tag_check_cost_pct(on: &[f64], off: &[f64]) -> f64 {
    median(
        on.iter()
            .zip(off)
            .map(|(on, off)| (off - on) / off * 100.0)
            .collect(),
    )
}

struct Bench {
    engine: Engine,
    next_id: u64,
}

impl Bench {
    fn submit(&mut self, prompt: &[u32], max_new: usize) -> anyhow::Result<mpsc::Receiver<Event>> {
        let (tx, rx) = mpsc::channel();
        self.next_id += 1;
        let request = Request {
            id: RequestId::new(self.next_id),
            prompt: prompt.to_vec(),
            max_new_tokens: max_new,
            sampling: SamplingParams::GREEDY,
            stop: Vec::new(),
            ignore_eos: true,
            sink: Box::new(tx),
        };
        self.engine
            .submit(request)
            .map_err(|(e, _)| e)
            .context("benchmark request refused")?;
        Ok(rx)
    }

    /// Prompt tokens per second until the first token.
    fn prefill(&mut self, prompt: &[u32]) -> anyhow::Result<f64> {
        let rx = self.submit(prompt, 1)?;
        let start = Instant::now();
        drain(&mut self.engine, &[rx])?;
        Ok(prompt.len() as f64 / start.elapsed().as_secs_f64())
    }

    /// Aggregate generated tokens per second across `prompts` decoding together, counted from
    /// the step after every prompt is prefilled.
    fn decode(&mut self, prompts: &[&[u32]], max_new: usize) -> anyhow::Result<f64> {
        let rxs = prompts
            .iter()
            .map(|p| self.submit(p, max_new))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let mut first = vec![false; rxs.len()];
        while first.iter().any(|f| !f) {
            self.engine.step();
            for (f, rx) in first.iter_mut().zip(&rxs) {
                for e in rx.try_iter() {
                    check(&e)?;
                    *f = true;
                }
            }
        }
        let start = Instant::now();
        let tokens = drain(&mut self.engine, &rxs)?;
        Ok(tokens as f64 / start.elapsed().as_secs_f64())
    }
}

/// Steps until the engine is idle; returns the tokens generated meanwhile.
fn drain(engine: &mut Engine, rxs: &[mpsc::Receiver<Event>]) -> anyhow::Result<usize> {
    let mut tokens = 0;
    while engine.has_work() {
        engine.step();
        for e in rxs.iter().flat_map(|rx| rx.try_iter()) {
            check(&e)?;
            tokens += usize::from(matches!(e, Event::Token { .. }));
        }
    }
    Ok(tokens)
}

fn check(e: &Event) -> anyhow::Result<()> {
    if let Event::Failed(f) = e {
        bail!("benchmark request failed: {f}");
    }
    Ok(())
}
