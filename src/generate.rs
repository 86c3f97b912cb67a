//! `bulkhead generate`: one prompt, the completion on stdout (like llama.cpp's CLI).

use std::io::Write;
use std::sync::mpsc;

use anyhow::{Context, bail};
use bulkhead_kvpool::{RequestId, Scope};
use bulkhead_worker::chat::Message;
use bulkhead_worker::engine::{Engine, EngineConfig, Event, KvBudget, Request};
use bulkhead_worker::sampling::SamplingParams;

use crate::model_path::ModelArgs;

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt text.
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    /// Maximum tokens to generate.
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    /// Random seed [default: random]
    #[arg(long)]
    seed: Option<u64>,
    /// Stop when this text is generated (repeatable).
    #[arg(long)]
    stop: Vec<String>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    args.model.init_threads()?;
    let (loaded, _) = args.model.load()?;
    let prompt = if args.chat {
        let chat = loaded
            .chat
            .as_ref()
            .map_err(|e| anyhow::anyhow!("--chat: {e}"))?;
        chat.encode(
            &loaded.tokenizer,
            &[Message::new("user", &args.prompt)],
            true,
        )?
    } else {
        loaded.tokenizer.encode_prompt(&args.prompt)?
    };
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_k: Some(args.top_k),
        top_p: args.top_p,
        seed: args.seed.unwrap_or_else(rand::random),
    }
    .validate()?;
    // The pool holds this one request, never more than the model's context: a model file
    // that declares a context of millions does not size a pool of millions.
    let context = loaded.model.config().context_length as u64;
    let needed = (prompt.len() as u64).saturating_add(args.max_tokens as u64);
    let config = EngineConfig {
        kv: KvBudget::Tokens(needed.clamp(1, context.max(1))),
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(loaded.model, loaded.tokenizer, config)?;
    let (tx, rx) = mpsc::channel();
    let request = Request {
        id: RequestId::new(1),
        tenant: Scope::new("local"),
        prompt,
        max_new_tokens: args.max_tokens,
        sampling,
        stop: args.stop,
        ignore_eos: false,
        sink: Box::new(tx),
    };
    engine
        .submit(request)
        .map_err(|(e, _)| e)
        .context("request refused")?;
    let mut out = std::io::stdout().lock();
    while engine.has_work() {
        engine.step();
        for event in rx.try_iter() {
            match event {
                Event::Started => {}
                Event::Token { text, .. } => out.write_all(text.as_bytes())?,
                Event::Done { text_tail, .. } => {
                    writeln!(out, "{text_tail}")?;
                }
                Event::Failed(e) => bail!("generation failed: {e}"),
                Event::Reserved(_) | Event::Prefilled(_) => {
                    bail!("a colocated request got a transfer event")
                }
            }
            out.flush()?;
        }
    }
    Ok(())
}
