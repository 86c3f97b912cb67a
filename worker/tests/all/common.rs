//! Shared test helpers: the real model, tiny random models, and a bare forward-pass session.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, OnceLock};

use bulkhead_kernels::attention::{TagCheck, TagView};
use bulkhead_kernels::{Device, DeviceError};
use bulkhead_kvpool::{Allocation, PagePool, PageRef, PoolConfig, RequestId, Scope, Scrub};
use bulkhead_worker::engine::{Engine, EngineConfig, Event, Failure, FinishReason, Request};
use bulkhead_worker::kv::KvMemory;
use bulkhead_worker::loader::LoadedModel;
use bulkhead_worker::model::{Model, SeqFailure, SeqStep};
use bulkhead_worker::sampling::SamplingParams;
use bulkhead_worker::tiny_model::TinySpec;
use bulkhead_worker::tokenizer::TokenId;

/// The real default model; tests that need it fail loudly when it was not fetched.
pub fn real_model_path() -> PathBuf {
    let path = std::env::var_os("BULKHEAD_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let home = std::env::var_os("HOME").expect("HOME");
            PathBuf::from(home).join(".cache/bulkhead/models/SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    assert!(
        path.is_file(),
        "{} is missing: run scripts/fetch-model",
        path.display()
    );
    path
}

/// The real model, loaded once per test binary.
pub fn real_model() -> Arc<LoadedModel> {
    static MODEL: OnceLock<Arc<LoadedModel>> = OnceLock::new();
    MODEL
        .get_or_init(|| {
            Arc::new(LoadedModel::open(&real_model_path()).expect("load the real model"))
        })
        .clone()
}

/// A fresh copy of the real model (engines own their model).
pub fn real_model_owned() -> LoadedModel {
    LoadedModel::open(&real_model_path()).expect("load the real model")
}

/// Writes `spec` to a unique temporary file and loads it.
pub fn tiny_model(spec: TinySpec) -> LoadedModel {
    let path = temp_path("tiny.gguf");
    spec.write(&path).expect("write tiny model");
    let loaded = LoadedModel::open(&path).expect("load tiny model");
    let _ = std::fs::remove_file(&path);
    loaded
}

/// As [`tiny_model`], on `dev`.
pub fn tiny_model_on(spec: TinySpec, dev: &Device) -> Result<LoadedModel, DeviceError> {
    let mut loaded = tiny_model(spec);
    loaded.model.to_device(dev)?;
    Ok(loaded)
}

pub fn temp_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "bulkhead-test-{}-{}-{name}",
        std::process::id(),
        rand::random::<u64>()
    ))
}

/// A bare forward-pass session over its own pool (in the memory of the model's device):
/// allocations and steps under the test's control, for checks below the engine.
pub struct Session<'m> {
    pub model: &'m Model,
    pub pool: PagePool,
    pub kv: KvMemory,
    pub check: TagCheck,
}

impl<'m> Session<'m> {
    pub fn new(model: &'m Model, pages: u32, scrub: Scrub) -> Session<'m> {
        let config = PoolConfig::new(pages.try_into().expect("pages > 0"), scrub);
        let layout = model.kv_layout(config.page_tokens.get() as usize);
        Session {
            model,
            pool: PagePool::new(config),
            kv: KvMemory::on(&model.device(), layout, pages as usize).expect("KV memory"),
            check: TagCheck::On,
        }
    }

    pub fn allocate(&self, owner: u64, tokens: usize) -> Allocation {
        let admissible = self
            .pool
            .admit(RequestId::new(owner), tokens as u64)
            .expect("fits the pool");
        self.pool.reserve(admissible).expect("free pages").commit()
    }

    /// Runs `tokens` at positions `cached..` of the sequence whose page table is `table`;
    /// returns the last logits.
    pub fn run(
        &mut self,
        table: &[PageRef],
        cached: usize,
        tokens: &[TokenId],
    ) -> Result<Vec<f32>, SeqFailure> {
        let scrub = self.pool.config().scrub;
        let kv = &mut self.kv;
        self.pool
            .scrub_pending(|p| kv.scrub(p, scrub).expect("scrub"));
        let step = SeqStep {
            tokens,
            table,
            cached,
            logits: true,
        };
        let (model, kv, check) = (self.model, &mut self.kv, self.check);
        let mut out = self
            .pool
            .with_tags(|tags| {
                model.forward(
                    &[step],
                    kv,
                    TagView {
                        tags,
                        check,
                        canary: scrub == Scrub::Canary,
                    },
                )
            })
            .expect("shapes");
        out.remove(0).map(|l| l.expect("logits asked for"))
    }
}

/// The outcome of one request run through an engine.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    pub tokens: Vec<TokenId>,
    pub text: String,
    /// `None` until the request's last event.
    pub finish: Option<Result<FinishReason, Failure>>,
}

pub fn request(id: u64, prompt: &[TokenId], max_new: usize, tx: mpsc::Sender<Event>) -> Request {
    Request {
        id: RequestId::new(id),
        tenant: Scope::new("test"),
        prompt: prompt.to_vec(),
        max_new_tokens: max_new,
        sampling: SamplingParams::GREEDY,
        stop: Vec::new(),
        ignore_eos: false,
        sink: Box::new(tx),
    }
}

/// Submits every request, steps the engine until idle, and returns each one's outcome.
pub fn run_all(engine: &mut Engine, requests: Vec<(Vec<TokenId>, usize)>) -> Vec<Outcome> {
    let mut rxs = Vec::new();
    for (i, (prompt, max_new)) in requests.into_iter().enumerate() {
        let (tx, rx) = mpsc::channel();
        engine
            .submit(request(1000 + i as u64, &prompt, max_new, tx))
            .map_err(|(e, _)| e)
            .expect("admitted");
        rxs.push(rx);
    }
    while engine.has_work() {
        engine.step();
    }
    rxs.into_iter().map(collect).collect()
}

/// Reads a finished request's events.
pub fn collect(rx: mpsc::Receiver<Event>) -> Outcome {
    let mut out = Outcome {
        tokens: Vec::new(),
        text: String::new(),
        finish: None,
    };
    for e in rx.try_iter() {
        match e {
            Event::Started => {}
            Event::Token { token, text } => {
                out.tokens.push(token);
                out.text.push_str(&text);
            }
            Event::Done {
                reason, text_tail, ..
            } => {
                out.text.push_str(&text_tail);
                out.finish = Some(Ok(reason));
            }
            Event::Failed(f) => out.finish = Some(Err(f)),
            Event::Reserved(_) | Event::Prefilled(_) => {
                panic!("a colocated request got a transfer event")
            }
        }
    }
    out
}

/// An engine over `loaded` with `config`.
pub fn engine(loaded: LoadedModel, config: EngineConfig) -> Engine {
    Engine::new(loaded.model, loaded.tokenizer, config).expect("engine starts")
}

/// The test fixtures: `BULKHEAD_FIXTURES` when set (a test binary run away from its source
/// tree, as scripts/gpu-check does), else this crate's `tests/fixtures`.
pub fn fixtures_dir() -> PathBuf {
    std::env::var_os("BULKHEAD_FIXTURES").map_or_else(
        || Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures")).to_owned(),
        PathBuf::from,
    )
}
