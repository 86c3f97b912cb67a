//! The engine: admission, the paged KV pool, continuous batching and sampling, as synchronous
//! state driven by [`Engine::step`]. Serving wraps it in a thread (see `crate::serve`); tests
//! and the CLI drive it directly.
//!
//! A request's life:
//!
//! ```text
//! submit ─▶ validated ─▶ pool.admit ──Rejected──▶ SubmitError (nothing allocated)
//!                            │
//!                       Admissible ─▶ waiting (bounded FIFO)
//!                                        │ pool.reserve (pages for prompt + max_new, new tags)
//!                                        ▼
//!                                     running: prefill in chunks ─▶ decode one token per step
//!                                        │
//!               done / failed / cancelled: the Allocation drops (pages scrubbed, then free),
//!               or is quarantined on an integrity failure
//! ```
//!
//! Pages for the whole request (prompt + max new tokens) are reserved before it runs, so a
//! running request never waits for memory and nothing is ever preempted or truncated.

mod request;
mod stops;

use std::collections::{HashSet, VecDeque};
use std::num::NonZeroU32;

use bulkhead_kernels::attention::{TagCheck, TagView};
use bulkhead_kvpool::{Admissible, Allocation, PagePool, PoolConfig, RequestId, Scrub};

pub use request::{Delivery, Event, EventSink, FinishReason, Request, SubmitError, Usage};
pub use stops::{StopScan, StopWatch};

use crate::kv::KvMemory;
use crate::model::{Model, SeqStep};
use crate::sampling::Sampler;
use crate::tokenizer::{Detokenizer, TokenId, Tokenizer};

/// How much memory the KV pool gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvBudget {
    /// A memory budget in bytes; the pool holds as many whole pages as fit.
    Bytes(u64),
    /// A capacity in tokens, rounded up to whole pages.
    Tokens(u64),
}

/// Engine settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineConfig {
    pub kv: KvBudget,
    pub page_tokens: NonZeroU32,
    pub scrub: Scrub,
    /// The context length to serve; must not exceed the pool. `None`: min(model, pool).
    pub context_length: Option<usize>,
    /// Prompt tokens processed per step across all prefilling requests (chunked prefill).
    pub max_batch_tokens: usize,
    /// Requests running at once.
    pub max_running: usize,
    /// Admitted requests waiting for pages; more are refused with `QueueFull`.
    pub queue_capacity: usize,
}

impl Default for EngineConfig {
    fn default() -> EngineConfig {
        EngineConfig {
            kv: KvBudget::Bytes(512 << 20),
            page_tokens: bulkhead_kvpool::DEFAULT_PAGE_TOKENS,
            scrub: Scrub::Zero,
            context_length: None,
            max_batch_tokens: 512,
            max_running: 64,
            queue_capacity: 256,
        }
    }
}

/// Why the engine cannot start with this configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StartupError {
    #[error("the KV budget holds no page: a page of {page_tokens} tokens takes {page_bytes} bytes")]
    NoPages { page_tokens: u32, page_bytes: u64 },
    #[error("the KV pool is too large: {pages} pages")]
    TooManyPages { pages: u64 },
    #[error(
        "--context-length {requested} exceeds the KV pool's {pool_tokens} tokens; \
         raise --kv-memory to at least {needed_bytes} bytes (or --kv-tokens to {requested}), \
         or lower --context-length"
    )]
    ContextExceedsPool {
        requested: usize,
        pool_tokens: u64,
        needed_bytes: u64,
    },
    #[error("{what} must be at least 1")]
    Zero { what: &'static str },
}

/// Sizes of the pool and the served context, as measured at startup (invariant I7).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacity {
    pub pool_pages: u32,
    pub page_tokens: u32,
    /// `pool_pages * page_tokens`.
    pub pool_tokens: u64,
    pub page_bytes: u64,
    /// The model's own context length.
    pub model_context: usize,
    /// What this engine serves: never more than `pool_tokens` nor `model_context`.
    pub served_context: usize,
}

#[derive(Debug)]
struct Waiting {
    request: Request,
    admissible: Admissible,
}

#[derive(Debug)]
struct Running {
    request: Request,
    pages: Allocation,
    /// Prompt tokens already prefilled.
    prefilled: usize,
    generated: Vec<TokenId>,
    sampler: Sampler,
    detok: Detokenizer,
    stops: StopWatch,
}

impl Running {
    fn in_prefill(&self) -> bool {
        self.prefilled < self.request.prompt.len()
    }

    /// Tokens in the KV cache.
    fn cached(&self) -> usize {
        self.prefilled + self.generated.len().saturating_sub(1)
    }
}

/// What a finished step did with one running request.
enum Outcome {
    Continue,
    Finished,
    Failed,
    Cancelled,
}

/// The engine state. Not thread-safe by design: one thread owns it.
#[derive(Debug)]
pub struct Engine {
    model: Model,
    tokenizer: Tokenizer,
    pool: PagePool,
    kv: KvMemory,
    config: EngineConfig,
    capacity: Capacity,
    tag_check: TagCheck,
    waiting: VecDeque<Waiting>,
    running: Vec<Running>,
}

impl Engine {
    pub fn new(
        model: Model,
        tokenizer: Tokenizer,
        config: EngineConfig,
    ) -> Result<Engine, StartupError> {
        for (what, v) in [
            ("max_batch_tokens", config.max_batch_tokens),
            ("max_running", config.max_running),
            ("queue_capacity", config.queue_capacity),
        ] {
            if v == 0 {
                return Err(StartupError::Zero { what });
            }
        }
        let page_tokens = config.page_tokens.get();
        let layout = model.kv_layout(page_tokens as usize);
        let page_bytes = layout.page_bytes() as u64;
        let pages = match config.kv {
            KvBudget::Bytes(b) => b / page_bytes,
            KvBudget::Tokens(t) => t.div_ceil(u64::from(page_tokens)),
        };
        let pages = u32::try_from(pages).map_err(|_| StartupError::TooManyPages { pages })?;
        let pages = NonZeroU32::new(pages).ok_or(StartupError::NoPages {
            page_tokens,
            page_bytes,
        })?;
        let pool_config = PoolConfig {
            pages,
            page_tokens: config.page_tokens,
            scrub: config.scrub,
        };
        let pool_tokens = pool_config.capacity_tokens();
        let model_context = model.config().context_length;
        let served_context = match config.context_length {
            Some(c) if c as u64 > pool_tokens => {
                return Err(StartupError::ContextExceedsPool {
                    requested: c,
                    pool_tokens,
                    needed_bytes: (c as u64).div_ceil(u64::from(page_tokens)) * page_bytes,
                });
            }
            Some(c) => c.min(model_context),
            None => model_context.min(pool_tokens as usize),
        };
        let capacity = Capacity {
            pool_pages: pages.get(),
            page_tokens,
            pool_tokens,
            page_bytes,
            model_context,
            served_context,
        };
        tracing::info!(
            pool_pages = capacity.pool_pages,
            pool_tokens = capacity.pool_tokens,
            page_bytes = capacity.page_bytes,
            model_context = capacity.model_context,
            served_context = capacity.served_context,
            "KV pool measured"
        );
        Ok(Engine {
            kv: KvMemory::new(layout, pages.get() as usize),
            pool: PagePool::new(pool_config),
            model,
            tokenizer,
            config,
            capacity,
            tag_check: TagCheck::On,
            waiting: VecDeque::new(),
            running: Vec::new(),
        })
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    pub fn capacity(&self) -> Capacity {
        self.capacity
    }

    pub fn pool(&self) -> &PagePool {
        &self.pool
    }

    /// Requests admitted but not yet running, and running.
    pub fn load(&self) -> (usize, usize) {
        (self.waiting.len(), self.running.len())
    }

    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Test hook: turn the attention kernel's page-tag check off to show what it prevents.
    #[doc(hidden)]
    pub fn set_tag_check(&mut self, check: TagCheck) {
        self.tag_check = check;
    }

    /// Validates and admits `request`, or refuses it before anything is allocated and hands it
    /// back with the reason.
    #[allow(
        clippy::result_large_err,
        reason = "a refused request goes back whole; submission is not a hot path"
    )]
    pub fn submit(&mut self, request: Request) -> Result<(), (SubmitError, Request)> {
        match self.admit(&request) {
            Ok(admissible) => {
                self.waiting.push_back(Waiting {
                    request,
                    admissible,
                });
                Ok(())
            }
            Err(e) => Err((e, request)),
        }
    }

    fn admit(&self, r: &Request) -> Result<Admissible, SubmitError> {
        if r.prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        if r.max_new_tokens == 0 {
            return Err(SubmitError::NoNewTokens);
        }
        let vocab = self.tokenizer.vocab_size().min(self.model.config().vocab);
        if let Some(&token) = r.prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(SubmitError::TokenOutOfRange { token, vocab });
        }
        if self.running.iter().any(|x| x.request.id == r.id)
            || self.waiting.iter().any(|x| x.request.id == r.id)
        {
            return Err(SubmitError::DuplicateId(r.id));
        }
        let requested = r.prompt.len() as u64 + r.max_new_tokens as u64;
        let exceeded = |limit| SubmitError::ContextLengthExceeded {
            requested,
            limit,
            prompt: r.prompt.len(),
            max_new: r.max_new_tokens,
        };
        if requested > self.capacity.served_context as u64 {
            return Err(exceeded(self.capacity.served_context as u64));
        }
        if self.waiting.len() >= self.config.queue_capacity {
            return Err(SubmitError::QueueFull {
                capacity: self.config.queue_capacity,
            });
        }
        // The pool's own check, independent of the served-context check above.
        self.pool.admit(r.id, requested).map_err(|e| match e {
            bulkhead_kvpool::Rejected::ContextLengthExceeded {
                capacity_tokens, ..
            } => exceeded(capacity_tokens),
        })
    }

    /// Cancels a request wherever it is; its pages go back to the pool.
    pub fn cancel(&mut self, id: RequestId) -> bool {
        let before = self.waiting.len() + self.running.len();
        self.waiting.retain(|w| w.request.id != id);
        self.running.retain(|r| r.request.id != id);
        before != self.waiting.len() + self.running.len()
    }

    /// Runs one scheduling step: scrub released pages, start waiting requests that fit, run one
    /// forward pass over every running request, and emit their events.
    pub fn step(&mut self) {
        let scrub = self.pool.config().scrub;
        let kv = &mut self.kv;
        self.pool.scrub_pending(|page| kv.scrub(page, scrub));
        self.start_waiting();
        if self.running.is_empty() {
            return;
        }

        // Decode first (one token each), then prefill chunks within the token budget.
        let mut budget = self.config.max_batch_tokens;
        let mut plan: Vec<(usize, usize)> = Vec::new(); // (running index, tokens this step)
        for (i, r) in self.running.iter().enumerate() {
            if !r.in_prefill() {
                plan.push((i, 1));
                budget = budget.saturating_sub(1);
            }
        }
        for (i, r) in self.running.iter().enumerate() {
            if r.in_prefill() && budget > 0 {
                let n = (r.request.prompt.len() - r.prefilled).min(budget);
                plan.push((i, n));
                budget -= n;
            }
        }
        let steps: Vec<SeqStep<'_>> = plan
            .iter()
            .map(|&(i, n)| {
                let r = &self.running[i];
                let (tokens, logits) = if r.in_prefill() {
                    let end = r.prefilled + n;
                    (
                        &r.request.prompt[r.prefilled..end],
                        end == r.request.prompt.len(),
                    )
                } else {
                    (&r.generated[r.generated.len() - 1..], true)
                };
                SeqStep {
                    tokens,
                    table: r.pages.pages(),
                    cached: r.cached(),
                    logits,
                }
            })
            .collect();
        let (model, kv, check) = (&self.model, &mut self.kv, self.tag_check);
        let canary = scrub == Scrub::Canary;
        let results = self.pool.with_tags(|tags| {
            model.forward(
                &steps,
                kv,
                TagView {
                    tags,
                    check,
                    canary,
                },
            )
        });
        drop(steps);

        let results = match results {
            Ok(r) => r,
            Err(e) => {
                // The weights were validated at load; this is a bug, not a request's fault.
                tracing::error!(error = %e, "forward pass shape error; failing the batch");
                plan.iter()
                    .map(|_| Err(crate::model::SeqFailure::Internal(e.to_string())))
                    .collect()
            }
        };
        let mut outcomes = Vec::with_capacity(plan.len());
        for (&(i, n), result) in plan.iter().zip(results) {
            outcomes.push((i, self.advance(i, n, result)));
        }
        // Remove finished requests, highest index first so indices stay valid.
        outcomes.sort_by_key(|&(i, _)| std::cmp::Reverse(i));
        for (i, outcome) in outcomes {
            if matches!(outcome, Outcome::Continue) {
                continue;
            }
            let r = self.running.swap_remove(i);
            match outcome {
                Outcome::Failed => r.pages.quarantine(),
                _ => r.pages.release(),
            }
        }
    }

    fn start_waiting(&mut self) {
        while self.running.len() < self.config.max_running {
            let Some(w) = self.waiting.pop_front() else {
                break;
            };
            match self.pool.reserve(w.admissible) {
                Ok(reservation) => {
                    let stops = StopWatch::new(w.request.stop.clone());
                    self.running.push(Running {
                        sampler: Sampler::new(w.request.sampling),
                        pages: reservation.commit(),
                        request: w.request,
                        prefilled: 0,
                        generated: Vec::new(),
                        detok: Detokenizer::default(),
                        stops,
                    });
                }
                Err(not_now) => {
                    self.waiting.push_front(Waiting {
                        request: w.request,
                        admissible: not_now.into_inner(),
                    });
                    break;
                }
            }
        }
    }

    /// Applies one forward result to running request `i`, which processed `n` tokens.
    fn advance(&mut self, i: usize, n: usize, result: crate::model::SeqResult) -> Outcome {
        let tokenizer = &self.tokenizer;
        let r = &mut self.running[i];
        let logits = match result {
            Err(failure) => {
                tracing::warn!(request = %r.request.id, error = %failure, "request failed");
                let _ = r.request.sink.emit(Event::Failed(failure));
                return Outcome::Failed;
            }
            Ok(logits) => logits,
        };
        if r.in_prefill() {
            r.prefilled += n;
        }
        let Some(logits) = logits else {
            return Outcome::Continue;
        };
        let token = r.sampler.sample(&logits);
        r.generated.push(token);
        let usage = Usage {
            prompt_tokens: r.request.prompt.len(),
            completion_tokens: r.generated.len(),
        };
        let (text, finish) = if tokenizer.is_stop(token) && !r.request.ignore_eos {
            (String::new(), Some(FinishReason::Stop))
        } else {
            match r.stops.push(&r.detok.push(tokenizer, token)) {
                StopScan::Stopped(text) => (text, Some(FinishReason::Stop)),
                StopScan::Continue(text) => {
                    let full = r.generated.len() >= r.request.max_new_tokens;
                    (text, full.then_some(FinishReason::Length))
                }
            }
        };
        if r.request.sink.emit(Event::Token { token, text }) == Delivery::Gone {
            return Outcome::Cancelled;
        }
        let Some(reason) = finish else {
            return Outcome::Continue;
        };
        let text_tail = if reason == FinishReason::Length {
            let tail = r.detok.finish();
            match r.stops.push(&tail) {
                StopScan::Stopped(t) => t,
                StopScan::Continue(t) => t + &r.stops.finish(),
            }
        } else {
            String::new()
        };
        let _ = r.request.sink.emit(Event::Done {
            reason,
            usage,
            text_tail,
        });
        Outcome::Finished
    }

    /// Ids of every request the engine holds (waiting or running).
    pub fn request_ids(&self) -> HashSet<RequestId> {
        self.waiting
            .iter()
            .map(|w| w.request.id)
            .chain(self.running.iter().map(|r| r.request.id))
            .collect()
    }
}
