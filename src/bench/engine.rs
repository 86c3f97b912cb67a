//! `bulkhead bench engine`: prefill and decode throughput of the engine on one model, as one
//! JSON object on stdout. Medians over `--runs` repetitions.

use std::sync::mpsc;
use std::time::Instant;

use anyhow::{Context, bail};
use bulkhead_kernels::Simd;
use bulkhead_kernels::attention::TagCheck;
use bulkhead_kvpool::{RequestId, Scope};
use bulkhead_worker::engine::{Engine, EngineConfig, Event, KvBudget, Request};
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
    /// Requests decoding together, one measurement each (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,64")]
    decode_batches: Vec<usize>,
    /// Repetitions; the medians are reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// The KV pool's capacity in tokens (the context the engine serves):
    /// `scripts/bench-vs-llamacpp` gives llama.cpp the same `n_ctx`, so that peak memory
    /// compares like with like.
    /// [default: what the measurements need: the long prompt, or every request of the largest
    /// batch at once]
    #[arg(long)]
    kv_tokens: Option<u64>,
    /// Kernel level to use (`portable`, `avx2`, `avx512`) [default: the best this CPU has].
    #[arg(long)]
    simd: Option<String>,
}

/// Prose the benchmark prompts are cut from.
pub(super) const TEXT: &str = "The harbour woke before the town did. Fishing boats slid out past the breakwater \
    while the lamps along the quay were still lit, and the gulls followed them, crying over the \
    grey water. In the market hall, traders stacked crates of apples and pears, argued about the \
    price of salt, and drank coffee from chipped enamel mugs. ";

/// Tokens of the short prompts the decode measurements start from.
const DECODE_PROMPT: usize = 32;

/// Tokens per KV page: the engine's, which this bench does not change.
const PAGE_TOKENS: usize = bulkhead_kvpool::DEFAULT_PAGE_TOKENS.get() as usize;

/// Every figure is measured with the integrity checks on (the page-tag check in attention,
/// and XXH3 checksums of the prompt's KV pages as a prefill worker sends them) and off, in
/// the same run, interleaved, so their cost is read off one report.
pub fn run(args: EngineArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.runs > 0, "--runs must be at least 1");
    anyhow::ensure!(
        args.decode_batches.iter().all(|&b| b > 0),
        "--decode-batches must be at least 1 each"
    );
    if let Some(b) = args
        .decode_batches
        .iter()
        .enumerate()
        .find_map(|(i, b)| args.decode_batches[..i].contains(b).then_some(b))
    {
        anyhow::bail!("--decode-batches lists {b} twice");
    }
    // The decode rate is timed from every request's first token on: one token more at least.
    anyhow::ensure!(
        args.decode_tokens >= 2,
        "--decode-tokens must be at least 2 (the rate is timed after the first token)"
    );
    let threads = args.model.init_threads()?;
    let (mut loaded, path) = args.model.load()?;
    if let Some(name) = &args.simd {
        let simd = Simd::by_name(name).with_context(|| {
            let have: Vec<_> = Simd::available().iter().map(|s| s.name()).collect();
            format!("--simd {name}: this CPU offers {have:?}")
        })?;
        loaded.model.set_simd(simd);
    }
    let device = loaded.model.device().describe();
    let longest = args.decode_batches.iter().copied().max().unwrap_or(1);
    // About six characters a token: enough text for the long prompt and every decode prompt.
    let wanted = args.prefill_tokens.max(7 * longest + DECODE_PROMPT);
    let text = TEXT.repeat(1 + wanted * 6 / TEXT.len());
    let all = loaded.tokenizer.encode(&text, false)?;
    anyhow::ensure!(
        all.len() >= args.prefill_tokens && all.len() >= 7 * longest + DECODE_PROMPT,
        "benchmark text too short"
    );
    let long_prompt = all[..args.prefill_tokens].to_vec();
    // The pool must hold the long prompt and its first token, or every decode request of the
    // largest batch at once (pages are given back between measurements), in whole pages.
    let pages = |tokens: usize| tokens.div_ceil(PAGE_TOKENS) as u64;
    let needed = pages(args.prefill_tokens + 1)
        .max(pages(DECODE_PROMPT + args.decode_tokens) * longest as u64)
        * PAGE_TOKENS as u64;
    let kv_tokens = args.kv_tokens.unwrap_or(needed);
    anyhow::ensure!(
        kv_tokens >= needed,
        "--kv-tokens {kv_tokens} is too small for these measurements: they need {needed}"
    );
    let config = EngineConfig {
        kv: KvBudget::Tokens(kv_tokens),
        max_batch_tokens: args.prefill_tokens.max(64),
        max_running: longest.max(1),
        ..EngineConfig::default()
    };
    let mut bench = Bench::new(Engine::new(loaded.model, loaded.tokenizer, config)?);

    // Per check setting (0: on, 1: off), per run: prefill seconds, checksum seconds and the
    // decode rate of each batch size. Each run measures both settings back to back, in
    // alternating order so that neither side always runs first.
    let mut prefill = [Vec::new(), Vec::new()];
    let mut checksum = Vec::new();
    let mut decode: [Vec<Vec<f64>>; 2] = [
        vec![Vec::new(); args.decode_batches.len()],
        vec![Vec::new(); args.decode_batches.len()],
    ];
    for run in 0..args.runs {
        let order = if run % 2 == 0 {
            [TagCheck::On, TagCheck::Off]
        } else {
            [TagCheck::Off, TagCheck::On]
        };
        for check in order {
            bench.engine.set_tag_check(check);
            let side = usize::from(check == TagCheck::Off);
            let (seconds, pages) = bench.prefill(&long_prompt)?;
            prefill[side].push(seconds);
            // With the checks on, the prompt's KV is also read out and checksummed the way a
            // prefill worker frames it for decode.
            if check == TagCheck::On {
                checksum.push(bench.checksum(pages)?);
            }
            for (d, &batch) in decode[side].iter_mut().zip(&args.decode_batches) {
                let prompts: Vec<&[u32]> = (0..batch)
                    .map(|i| &all[i * 7..i * 7 + DECODE_PROMPT])
                    .collect();
                d.push(bench.decode(&prompts, args.decode_tokens)?);
            }
        }
    }
    bench.engine.set_tag_check(TagCheck::On);
    let tokens = long_prompt.len() as f64;
    let mut out = serde_json::Map::new();
    out.insert("model".into(), json!(path.display().to_string()));
    out.insert("device".into(), json!(device));
    out.insert("threads".into(), json!(threads));
    out.insert("simd".into(), json!(bench.engine.model().simd().name()));
    out.insert("runs".into(), json!(args.runs));
    out.insert("prefill_prompt_tokens".into(), json!(args.prefill_tokens));
    out.insert("decode_new_tokens".into(), json!(args.decode_tokens));
    out.insert("kv_tokens".into(), json!(kv_tokens));
    // The page-tag check on (the default) without the checksum: what the llama.cpp
    // comparison (`scripts/bench/summarize.py`) reads.
    let on_rates: Vec<f64> = prefill[0].iter().map(|s| tokens / s).collect();
    out.insert("prefill_tok_s".into(), json!(median(on_rates)));
    for (d, batch) in decode[0].iter().zip(&args.decode_batches) {
        out.insert(format!("decode_b{batch}_tok_s"), json!(median(d.clone())));
    }
    // Every integrity check on (tag check and the prompt's KV checksum) and off.
    let with_checksum: Vec<f64> = prefill[0]
        .iter()
        .zip(&checksum)
        .map(|(s, c)| tokens / (s + c))
        .collect();
    out.insert(
        "prefill_tok_s_checks_on".into(),
        json!(median(with_checksum)),
    );
    let off_rates: Vec<f64> = prefill[1].iter().map(|s| tokens / s).collect();
    out.insert("prefill_tok_s_checks_off".into(), json!(median(off_rates)));
    for (side, suffix) in [(0, "checks_on"), (1, "checks_off")] {
        for (d, batch) in decode[side].iter().zip(&args.decode_batches) {
            out.insert(
                format!("decode_b{batch}_tok_s_{suffix}"),
                json!(median(d.clone())),
            );
        }
    }
    // The tag check's cost, paired per run, at the first batch size.
    if let (Some(on), Some(off)) = (decode[0].first(), decode[1].first()) {
        let batch = args.decode_batches[0];
        out.insert(
            format!("decode_b{batch}_tag_check_off_tok_s"),
            json!(median(off.clone())),
        );
        out.insert(
            "tag_check_cost_pct".into(),
            json!(tag_check_cost_pct(on, off)),
        );
    }
    out.insert("peak_rss_bytes".into(), json!(peak_rss_bytes()?));
    println!("{}", serde_json::Value::Object(out));
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

/// An engine driven one request (or batch) at a time, as the benchmarks measure it.
pub(super) struct Bench {
    pub(super) engine: Engine,
    next_id: u64,
}

impl Bench {
    pub(super) fn new(engine: Engine) -> Bench {
        Bench { engine, next_id: 0 }
    }

    fn submit(&mut self, prompt: &[u32], max_new: usize) -> anyhow::Result<mpsc::Receiver<Event>> {
        let (tx, rx) = mpsc::channel();
        self.next_id += 1;
        let request = Request {
            id: RequestId::new(self.next_id),
            tenant: Scope::new("bench"),
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

    /// Seconds from submitting `prompt` to its first token, and the KV pages it used (as
    /// (page, tokens in it)) for the checksum measurement.
    pub(super) fn prefill(&mut self, prompt: &[u32]) -> anyhow::Result<(f64, usize)> {
        let rx = self.submit(prompt, 1)?;
        let start = Instant::now();
        drain(&mut self.engine, &[rx])?;
        let pages = prompt
            .len()
            .div_ceil(self.engine.capacity().page_tokens as usize);
        Ok((start.elapsed().as_secs_f64(), pages))
    }

    /// Seconds to read `pages` whole pages out of the engine's KV memory and checksum each as
    /// a transfer frame (what a prefill worker adds before sending).
    fn checksum(&self, pages: usize) -> anyhow::Result<f64> {
        let start = Instant::now();
        let total = self.engine.checksum_pages(pages)?;
        std::hint::black_box(total);
        Ok(start.elapsed().as_secs_f64())
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
                    // A request's start comes before its prompt is computed.
                    *f |= !matches!(e, Event::Started);
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
