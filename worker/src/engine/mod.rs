//! The engine: admission, the paged KV pool, continuous batching and sampling, as synchronous
//! state driven by [`Engine::step`] (and, on a decode worker, [`Engine::deliver`] for KV
//! transfer messages). Serving wraps it in a thread; tests and the CLI drive it directly.
//!
//! A request's life:
//!
//! ```text
//! submit ─▶ validated ─▶ pool.admit ──Rejected──▶ SubmitError (nothing allocated)
//!                            │
//!                       Admissible ─▶ waiting (bounded; in order within a tenant)
//!                                        │ pool.reserve (new tags)
//!            ┌───────────────────────────┼──────────────────────────────┐
//!        colocated                    decode role                  prefill role
//!   prefill here in chunks   Event::Reserved → a prefill      prefill here, sample the
//!            │               worker fills the pages; only a    first token, Event::Prefilled
//!            │               verified transfer commits them    (frames for decode's pages;
//!            ▼                           ▼                      source pages held by it)
//!        decode one token per step, stream text, stop
//!            │
//!  done / cancelled: the Allocation drops (pages scrubbed, then free) — with the prefix
//!  cache on, the whole pages of its computed prompt stay in its tenant's cache instead;
//!  failed integrity: quarantined
//! ```
//!
//! With the prefix cache on, a request whose prompt starts with whole pages its own tenant's
//! requests computed reads those pages ([`Prefix`]) and reserves and computes only the rest;
//! on a decode worker the pages are those its tenant's earlier transfers filled, and the
//! reservation it names to prefill covers only the rest, so only the rest is sent. When pages
//! are short, cached pages nobody reads are evicted to make room.
//!
//! Pages for the whole request (prompt + max new tokens) are reserved before it runs, so a
//! running request never waits for memory and nothing is ever preempted or truncated.

mod host_memory;
mod receiving;
mod request;
mod shares;
mod stats;
mod stops;
mod switched;
#[cfg(test)]
mod tests;
mod transfer;
mod written;

use std::collections::{HashMap, HashSet, VecDeque};
use std::num::NonZeroU32;
use std::time::{Duration, Instant};

use bulkhead_checks::Check;
use bulkhead_handoff::{CloseReason, IntegrityFailure, Received, SessionNonce};
use bulkhead_kernels::attention::{TagCheck, TagView};
use bulkhead_kvpool::{
    Admissible, Allocation, NotNow, PagePool, PageRef, PoolConfig, Prefix, Quarantined, RequestId,
    Reservation, Scope, Scrub,
};

pub use receiving::LiveSessions;
pub use request::{Delivery, Event, EventSink, Failure, FinishReason, Request, SubmitError, Usage};
pub use stats::{
    ABORT_ACK_BUCKETS, DROP_LABELS, FrameDrops, Histogram, PrefixStats, TransferStats,
};
pub use stops::{StopScan, StopWatch};
pub use transfer::{NotWritten, Outbound, write_frame};

use crate::kv::KvMemory;
use crate::model::{Model, SeqResult, SeqStep};
use crate::sampling::Sampler;
use crate::tokenizer::{Detokenizer, TokenId, Tokenizer};
use receiving::Tracked;
use transfer::{Draining, Suspect, Transfer, live_tag};
pub use written::Written;

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
    /// Tokens processed per step: one per decoding request, the rest for prompts (chunked
    /// prefill), which always get at least a quarter of it.
    pub max_batch_tokens: usize,
    /// Requests running at once (on a decode worker, with those whose KV is on its way).
    pub max_running: usize,
    /// Admitted requests waiting for pages; more are refused with `QueueFull`.
    pub queue_capacity: usize,
    /// How long a request to decode here (colocated or decode role) may wait for its pages;
    /// then it fails as refused for load ([`Failure::QueueTimedOut`]), so a caller's silence
    /// timeout — which such a wait would otherwise run out, as a hung worker's does — never
    /// takes a busy worker for a dead one. A prefill worker's queue is bounded by its decode
    /// worker's transfer deadline instead.
    pub queue_timeout: Duration,
    /// Decode role: how long a reservation waits for the prefill worker's next sign of
    /// progress — that it computed more prompt tokens, of this prompt or of those queued before
    /// it ([`Engine::prefill_progress`]), or, after the last, the KV's arrival — …
    pub transfer_timeout: Duration,
    /// … plus the prompt's KV bytes at this rate: a transfer slower than the floor fails.
    pub transfer_floor_bytes_per_s: u64,
    /// Decode role: how long an abandoned transfer's pages wait for the prefill side's drain
    /// acknowledgement before they are quarantined.
    pub release_timeout: Duration,
    /// Decode role: how long after a quarantined transfer's peer is known gone (its transport
    /// closed, or its `Closed` came late) its pages are scrubbed and reused; every role: how
    /// long the pages of a request that failed its own integrity check stay quarantined.
    pub reclaim_after: Duration,
    /// Keep the whole pages of every prompt computed here in its tenant's prefix cache, and
    /// start each prompt from the longest cached run of its own tenant's pages. A decode
    /// worker keeps the pages of the prompts it received instead, so that a transfer carries
    /// only what its tenant's cache does not already hold.
    pub prefix_cache: bool,
}

impl EngineConfig {
    /// Decode role: when a transfer of `tokens` of `token_bytes` each (the prompt's tokens
    /// after decode's cached prefix), waiting from now, fails — the transfer timeout for the
    /// prefill worker's next sign of progress, plus the KV's bytes at the floor rate.
    fn transfer_deadline(&self, tokens: u32, token_bytes: u64) -> Instant {
        let bytes = u64::from(tokens) * token_bytes;
        Instant::now()
            + self.transfer_timeout
            + Duration::from_secs_f64(bytes as f64 / self.transfer_floor_bytes_per_s as f64)
    }
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
            queue_timeout: Duration::from_secs(60),
            transfer_timeout: Duration::from_secs(30),
            transfer_floor_bytes_per_s: 100_000_000,
            release_timeout: Duration::from_secs(10),
            reclaim_after: Duration::from_secs(2),
            prefix_cache: false,
        }
    }
}

/// Why the engine cannot start with this configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StartupError {
    #[error(
        "the KV budget holds no page: a page of {page_tokens} tokens takes {page_bytes} bytes; \
         raise --kv-memory (or --kv-tokens)"
    )]
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
    #[error(
        "the KV pool needs {bytes} bytes of host memory, but only {available} are available: \
         lower --kv-memory (or --kv-tokens)"
    )]
    PoolExceedsMemory { bytes: u64, available: u64 },
    #[error(
        "--context-length {requested} exceeds the model's own context of {model_context} tokens"
    )]
    ContextExceedsModel {
        requested: usize,
        model_context: usize,
    },
    #[error("cannot allocate the KV pool ({bytes} bytes) on {device}: {error}")]
    Device {
        device: String,
        bytes: u64,
        error: bulkhead_kernels::DeviceError,
    },
}

/// Sizes of the pool and the served context, as measured at startup (invariant I7).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacity {
    pub pool_pages: u32,
    pub page_tokens: u32,
    /// `pool_pages * page_tokens`.
    pub pool_tokens: u64,
    pub page_bytes: u64,
    /// Bytes of KV per token (all layers, K and V).
    pub token_bytes: u64,
    /// The model's own context length.
    pub model_context: usize,
    /// What this engine serves: never more than `pool_tokens` nor `model_context`.
    pub served_context: usize,
}

/// The part a request plays on this engine.
#[derive(Debug)]
enum Role {
    /// Prefill and decode here.
    Colocated,
    /// Decode here; the prompt's KV arrives from a prefill worker.
    Decode,
    /// Prefill here for a decode worker's reservation, then hand the KV over.
    PrefillFor(bulkhead_handoff::Reservation),
}

#[derive(Debug)]
struct Waiting {
    request: Request,
    admissible: Admissible,
    role: Role,
    /// When it fails if it still waits (`None` on a prefill worker).
    deadline: Option<Instant>,
    /// When it was admitted.
    since: Instant,
}

#[derive(Debug)]
struct Running {
    request: Request,
    pages: Allocation,
    /// The cached pages the prompt starts with, read-only; `None` without the prefix cache.
    prefix: Option<Prefix>,
    /// The page table the model reads through: the prefix's pages, then `pages`'.
    table: Vec<PageRef>,
    /// `Some` on a prefill worker: where the KV goes after the prompt.
    target: Option<bulkhead_handoff::Reservation>,
    /// Prompt tokens already in the pages.
    prefilled: usize,
    generated: Vec<TokenId>,
    sampler: Sampler,
    detok: Detokenizer,
    stops: StopWatch,
}

impl Running {
    fn new(
        request: Request,
        pages: Allocation,
        prefix: Option<Prefix>,
        target: Option<bulkhead_handoff::Reservation>,
    ) -> Running {
        let cached = prefix.as_ref().map(Prefix::pages).unwrap_or_default();
        Running {
            sampler: Sampler::new(request.sampling),
            stops: StopWatch::new(request.stop.clone()),
            table: [cached, pages.pages()].concat(),
            prefilled: prefix.as_ref().map_or(0, Prefix::tokens),
            request,
            pages,
            prefix,
            target,
            generated: Vec::new(),
            detok: Detokenizer::default(),
        }
    }

    fn in_prefill(&self) -> bool {
        self.prefilled < self.request.prompt.len()
    }

    /// Tokens in the KV cache.
    fn cached(&self) -> usize {
        self.prefilled + self.generated.len().saturating_sub(1)
    }

    /// Prompt tokens read from the prefix cache instead of computed.
    fn cached_prompt(&self) -> usize {
        self.prefix.as_ref().map_or(0, Prefix::tokens)
    }

    /// The request ended and nothing can write its pages: the whole pages of its prompt that
    /// are computed go to its tenant's prefix cache (with the cache on), the rest are released.
    fn retire(self) {
        let computed = &self.request.prompt[..self.prefilled];
        transfer::retire(self.pages, self.prefix, computed);
    }
}

/// What a finished step did with one running request.
enum Outcome {
    Continue,
    Finished,
    /// `suspect`: its pages' contents cannot be vouched for (a KV integrity failure): they
    /// are quarantined, and the cached prefix pages it read from the first page in doubt on
    /// are distrusted. Otherwise (a device fault, a token outside the vocabulary, logits that
    /// are not numbers) they are released, scrubbed as any released page.
    Failed {
        suspect: Option<InDoubt>,
    },
    Cancelled,
    /// Prefill role: the prompt is done and this is the first token; hand the KV over.
    HandOver(TokenId),
}

/// A request's failed KV integrity check.
#[derive(Debug)]
struct InDoubt {
    /// The first page of its table whose contents are in doubt, if any.
    page: Option<usize>,
}

/// The engine state. Not thread-safe by design: one thread owns it.
#[derive(Debug)]
pub struct Engine {
    model: Model,
    tokenizer: Tokenizer,
    pool: PagePool,
    kv: KvMemory,
    /// Which slots of each page were written for whom (checked with the tags).
    written: Written,
    config: EngineConfig,
    capacity: Capacity,
    tag_check: TagCheck,
    waiting: VecDeque<Waiting>,
    /// The last step left requests of `waiting` unstarted — without the pages they need (or
    /// behind one of their tenant's that had none), or with --max-running held by requests
    /// running and transfers on their way: until something changes (a command, a deadline, a
    /// page scrubbed or given back) no step can start them.
    waiting_blocked: bool,
    running: Vec<Running>,
    transfers: Tracked<Transfer>,
    draining: Tracked<Draining>,
    /// The sessions of `transfers` and `draining`, shared with the data plane.
    live: LiveSessions,
    /// Quarantined transfers, until their peer is known gone.
    suspects: HashMap<SessionNonce, Suspect>,
    /// Pages of requests that failed an integrity check of their own (a tag mismatch, a
    /// canary read), quarantined until the time beside them ([`EngineConfig::reclaim_after`]).
    failed_pages: Vec<(Instant, Quarantined)>,
    stats: TransferStats,
    prefix_stats: PrefixStats,
    /// Prompt tokens computed since the engine started.
    computed_prompt_tokens: u64,
}

impl Engine {
    pub fn new(
        model: Model,
        tokenizer: Tokenizer,
        config: EngineConfig,
    ) -> Result<Engine, StartupError> {
        for (what, v) in [
            ("--max-batch-tokens", config.max_batch_tokens),
            ("--max-running", config.max_running),
            ("--queue-capacity", config.queue_capacity),
            (
                "--queue-timeout-ms",
                usize::try_from(config.queue_timeout.as_millis()).unwrap_or(usize::MAX),
            ),
            (
                "--transfer-floor",
                usize::try_from(config.transfer_floor_bytes_per_s).unwrap_or(usize::MAX),
            ),
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
            Some(0) => {
                return Err(StartupError::Zero {
                    what: "--context-length",
                });
            }
            Some(c) if c > model_context => {
                return Err(StartupError::ContextExceedsModel {
                    requested: c,
                    model_context,
                });
            }
            Some(c) if c as u64 > pool_tokens => {
                return Err(StartupError::ContextExceedsPool {
                    requested: c,
                    pool_tokens,
                    needed_bytes: (c as u64).div_ceil(u64::from(page_tokens)) * page_bytes,
                });
            }
            Some(c) => c,
            None => model_context.min(pool_tokens as usize),
        };
        let capacity = Capacity {
            pool_pages: pages.get(),
            page_tokens,
            pool_tokens,
            page_bytes,
            token_bytes: layout.token_bytes() as u64,
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
        let device = model.device();
        let pool_bytes = u64::from(pages.get()) * page_bytes;
        if matches!(device, bulkhead_kernels::Device::Cpu(_))
            && let Some(available) = host_memory::available_bytes()
            && pool_bytes > available
        {
            return Err(StartupError::PoolExceedsMemory {
                bytes: pool_bytes,
                available,
            });
        }
        let kv = KvMemory::on(&device, layout, pages.get() as usize).map_err(|error| {
            StartupError::Device {
                device: device.describe(),
                bytes: u64::from(pages.get()) * page_bytes,
                error,
            }
        })?;
        let live = LiveSessions::default();
        Ok(Engine {
            written: Written::new(pages.get() as usize, layout.page_tokens),
            kv,
            pool: PagePool::new(pool_config),
            model,
            tokenizer,
            config,
            capacity,
            tag_check: if bulkhead_checks::enabled(Check::TagCheck) {
                TagCheck::On
            } else {
                tracing::warn!("CHECK TURNED OFF: attention reads pages without comparing tags");
                TagCheck::Off
            },
            waiting: VecDeque::new(),
            waiting_blocked: false,
            running: Vec::new(),
            transfers: Tracked::new(live.clone()),
            draining: Tracked::new(live.clone()),
            live,
            suspects: HashMap::new(),
            failed_pages: Vec::new(),
            stats: TransferStats::default(),
            prefix_stats: PrefixStats::default(),
            computed_prompt_tokens: 0,
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

    /// Benchmarks: reads pages `0..pages` of the KV memory whole and checksums each as a
    /// transfer frame does (XXH3-64 over the frame fields and the bytes); the checksums XORed.
    pub fn checksum_pages(&self, pages: usize) -> Result<u64, crate::kv::SlotError> {
        let pt = self.capacity.page_tokens;
        let mut acc = 0;
        for p in 0..pages.min(self.capacity.pool_pages as usize) {
            let page = p as u32;
            let bytes = self
                .kv
                .read_slots(bulkhead_kvpool::PageId::new(page), 0..pt as usize)?;
            acc ^= bulkhead_handoff::frame_checksum(
                &SessionNonce([0; 16]),
                page,
                bulkhead_kvpool::Tag::new(0),
                &(0..pt),
                &bytes,
            );
        }
        Ok(acc)
    }

    pub fn pool(&self) -> &PagePool {
        &self.pool
    }

    /// Decode role: the sessions whose frames the data plane still reads.
    pub fn live_sessions(&self) -> LiveSessions {
        self.live.clone()
    }

    /// The handoff's counters, and its gauges as of now.
    pub fn transfer_stats(&self) -> TransferStats {
        let transfers = self.transfers.values();
        TransferStats {
            transfers_in_flight: self.transfers.len() as u64,
            in_flight_tokens: transfers
                .map(|t| u64::from(t.inbound.reservation().sent_tokens()))
                .sum(),
            reserved_tokens: self
                .transfers
                .values()
                .map(|t| t.pages.tokens())
                .chain(self.running.iter().map(|r| r.pages.tokens()))
                .sum(),
            quarantined_sessions: self.suspects.len() as u64,
            ..self.stats
        }
    }

    /// The prefix cache's counters.
    pub fn prefix_stats(&self) -> PrefixStats {
        self.prefix_stats
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Whether attention checks page tags (always, outside tests).
    pub fn tag_check(&self) -> TagCheck {
        self.tag_check
    }

    /// Requests admitted but not yet running, and running (transfers in flight included).
    pub fn load(&self) -> (usize, usize) {
        (
            self.waiting.len(),
            self.running.len() + self.transfers.len(),
        )
    }

    /// Whether [`Engine::step`] has something to do.
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Whether another [`Engine::step`] now could move anything on: something runs, or a
    /// waiting request was not yet tried against the pool as it is. A caller that waits for
    /// commands (and [`Engine::next_deadline`]) when this is false does not spin while
    /// requests wait for pages only other events can free.
    pub fn can_progress(&self) -> bool {
        !self.running.is_empty() || (!self.waiting.is_empty() && !self.waiting_blocked)
    }

    /// The earliest transfer, drain, reclaim or queue deadline, if any: step the engine then
    /// to expire it.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.transfers
            .values()
            .map(|t| t.deadline)
            .chain(self.waiting.iter().filter_map(|w| w.deadline))
            .chain(self.draining.values().map(|d| d.deadline))
            .chain(self.suspects.values().filter_map(|s| s.reclaim_at))
            .chain(self.failed_pages.iter().map(|(at, _)| *at))
            .min()
    }

    /// Test and benchmark hook: turn the attention kernel's page-tag check off, to show what it
    /// prevents and what it costs.
    #[doc(hidden)]
    pub fn set_tag_check(&mut self, check: TagCheck) {
        self.tag_check = check;
    }

    /// Validates and admits a colocated request (prefill and decode here), or refuses it
    /// before anything is allocated and hands it back with the reason.
    #[allow(
        clippy::result_large_err,
        reason = "a refused request goes back whole; submission is not a hot path"
    )]
    pub fn submit(&mut self, request: Request) -> Result<(), (SubmitError, Request)> {
        self.enqueue(request, Role::Colocated)
    }

    /// Decode role: admits a request whose prompt KV a prefill worker will send. Once its
    /// pages are reserved the request's sink gets [`Event::Reserved`]; the transfer's messages
    /// go to [`Engine::deliver`].
    #[allow(
        clippy::result_large_err,
        reason = "a refused request goes back whole; submission is not a hot path"
    )]
    pub fn submit_decode(&mut self, request: Request) -> Result<(), (SubmitError, Request)> {
        self.enqueue(request, Role::Decode)
    }

    /// Prefill role: admits a request to prefill for decode's `target` reservation. The sink
    /// gets [`Event::Prefilled`] (or a failure) and nothing else.
    #[allow(
        clippy::result_large_err,
        reason = "a refused request goes back whole; submission is not a hot path"
    )]
    pub fn submit_prefill(
        &mut self,
        request: Request,
        target: bulkhead_handoff::Reservation,
    ) -> Result<(), (SubmitError, Request)> {
        self.enqueue(request, Role::PrefillFor(target))
    }

    #[allow(
        clippy::result_large_err,
        reason = "a refused request goes back whole; submission is not a hot path"
    )]
    fn enqueue(&mut self, request: Request, role: Role) -> Result<(), (SubmitError, Request)> {
        let (request, admissible) = match self.admit(&request, &role) {
            Ok(admissible) => (request, admissible),
            Err(e) if matches!(role, Role::PrefillFor(_)) => {
                switched::prefill_refused(&self.pool, e, request)?
            }
            Err(e) => return Err((e, request)),
        };
        let since = Instant::now();
        let deadline = match role {
            Role::Colocated | Role::Decode => Some(since + self.config.queue_timeout),
            Role::PrefillFor(_) => None,
        };
        self.waiting.push_back(Waiting {
            request,
            admissible,
            role,
            deadline,
            since,
        });
        Ok(())
    }

    /// The token ids both the tokenizer and the model know.
    fn vocab(&self) -> usize {
        self.tokenizer.vocab_size().min(self.model.config().vocab)
    }

    fn admit(&self, r: &Request, role: &Role) -> Result<Admissible, SubmitError> {
        if r.prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        if r.max_new_tokens == 0 {
            return Err(SubmitError::NoNewTokens);
        }
        let vocab = self.vocab();
        if let Some(&token) = r.prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(SubmitError::TokenOutOfRange { token, vocab });
        }
        if self.request_ids().contains(&r.id) {
            return Err(SubmitError::DuplicateId(r.id));
        }
        // A prefill worker holds only the prompt; everything else holds prompt + new tokens.
        let (requested, check) = match role {
            Role::PrefillFor(target) => {
                self.check_target(r, target)?;
                (r.prompt.len() as u64, Check::PrefillAdmission)
            }
            Role::Colocated | Role::Decode => (
                r.prompt.len() as u64 + r.max_new_tokens as u64,
                Check::DecodeAdmission,
            ),
        };
        // Both capacity checks below are this layer's; only a test build can turn them off.
        let checked = bulkhead_checks::enabled(check);
        let exceeded = |limit| SubmitError::ContextLengthExceeded {
            requested,
            limit,
            prompt: r.prompt.len(),
            max_new: r.max_new_tokens,
        };
        if checked && requested > self.capacity.served_context as u64 {
            return Err(exceeded(self.capacity.served_context as u64));
        }
        if self.waiting.len() >= self.config.queue_capacity {
            return Err(SubmitError::QueueFull {
                capacity: self.config.queue_capacity,
            });
        }
        // The pool's own check, independent of the served-context check above.
        switched::pool_admit(&self.pool, r.id, requested, checked).map_err(|e| match e {
            bulkhead_kvpool::Rejected::ContextLengthExceeded {
                capacity_tokens, ..
            } => exceeded(capacity_tokens),
        })
    }

    /// A decode worker's reservation must describe exactly this prompt in this KV layout.
    fn check_target(
        &self,
        r: &Request,
        t: &bulkhead_handoff::Reservation,
    ) -> Result<(), SubmitError> {
        let c = &self.capacity;
        let mismatch = |what: String| Err(SubmitError::ReservationMismatch(what));
        if t.prompt_tokens as usize != r.prompt.len() {
            return mismatch(format!(
                "{} prompt tokens reserved, the prompt has {}",
                t.prompt_tokens,
                r.prompt.len()
            ));
        }
        if t.page_tokens != c.page_tokens || u64::from(t.token_bytes) != c.token_bytes {
            return mismatch(format!(
                "pages of {} tokens × {} bytes, this worker has {} × {}",
                t.page_tokens, t.token_bytes, c.page_tokens, c.token_bytes
            ));
        }
        if !t.cached_tokens.is_multiple_of(t.page_tokens) || t.cached_tokens >= t.prompt_tokens {
            return mismatch(format!(
                "{} cached tokens are not whole pages before the prompt's last token",
                t.cached_tokens
            ));
        }
        let want = t.pages_needed();
        if Some(t.pages.len()) != want {
            return mismatch(format!(
                "{} pages named, the prompt after its cached tokens needs {}",
                t.pages.len(),
                want.unwrap_or_default()
            ));
        }
        Ok(())
    }

    /// Cancels a request wherever it is. Its pages go back to the pool, except those of a
    /// transfer in flight, which wait for the prefill side's drain acknowledgement.
    pub fn cancel(&mut self, id: RequestId) -> bool {
        let before = self.waiting.len() + self.running.len() + self.transfers.len();
        self.waiting.retain(|w| w.request.id != id);
        self.running.retain(|r| r.request.id != id);
        let nonces: Vec<SessionNonce> = self
            .transfers
            .iter()
            .filter(|(_, t)| t.request.id == id)
            .map(|(n, _)| *n)
            .collect();
        for nonce in nonces {
            let _kept = self.live.keep(nonce);
            if let Some(t) = self.transfers.remove(&nonce) {
                self.start_draining(nonce, t);
            }
        }
        before != self.waiting.len() + self.running.len() + self.transfers.len()
    }

    fn start_draining(&mut self, nonce: SessionNonce, t: Transfer) {
        let deadline = Instant::now() + self.config.release_timeout;
        self.draining.insert(
            nonce,
            Draining {
                pages: t.pages.begin_release(),
                since: Instant::now(),
                deadline,
                heard: t.heard,
            },
        );
    }

    /// Decode role: one message of the data plane. Frames are written only into pages their
    /// session still holds with the tags it was given; a manifest commits or fails the
    /// transfer; `Closed` is the drain acknowledgement.
    ///
    /// Returns a frame's buffer once its bytes are written (or dropped), for reuse.
    pub fn deliver(&mut self, message: impl Into<Received>) -> Option<Vec<u8>> {
        let message = message.into();
        let nonce = message.nonce();
        match message {
            Received::Frame(frame) => {
                let Some(t) = self.transfers.get_mut(&nonce) else {
                    self.stats.frames_dropped.add("no_session");
                    return Some(frame.into_bytes());
                };
                t.heard = true;
                let pool = &self.pool;
                match write_frame(
                    &mut t.inbound,
                    &mut self.kv,
                    &mut self.written,
                    &frame,
                    |page| live_tag(pool, page),
                ) {
                    Ok(()) => self.stats.frames_written += 1,
                    Err(NotWritten::Dropped(reason)) => {
                        // Said once a session (the counter has every one): a peer that sends
                        // endless bad frames does not write a line for each, on this thread.
                        if t.inbound.dropped() == 1 {
                            tracing::warn!(session = %nonce, %reason, "KV frame dropped (later drops of this session are only counted)");
                        }
                        self.stats.frames_dropped.add(reason.label());
                    }
                    Err(e @ NotWritten::Slots(_)) => {
                        // Admitted as written, but its page holds something else: the
                        // transfer must never commit on it, and fails as one that did not
                        // deliver every page does (counted, audited as an integrity failure).
                        tracing::error!(session = %nonce, error = %e, "KV frame not written: transfer failed");
                        self.stats.frames_dropped.add("not_written");
                        if let Some(t) = self.transfers.remove(&nonce) {
                            let index = frame.header().index;
                            let failure = IntegrityFailure::PageNotWritten { index };
                            self.failed_verification(nonce, t, failure);
                        }
                    }
                }
                return Some(frame.into_bytes());
            }
            Received::Manifest(manifest) => {
                let mut t = self.transfers.remove(&nonce)?;
                let pool = &self.pool;
                let vocab = self.vocab();
                // Verified pages with a first token the model does not have: the peer is not
                // to be trusted with them either.
                let verified = t
                    .inbound
                    .finish(&manifest, |page| live_tag(pool, page))
                    .and_then(|done| match done.first_token {
                        token if token as usize >= vocab => {
                            Err(IntegrityFailure::FirstTokenOutOfRange { token, vocab })
                        }
                        _ => Ok(done),
                    });
                match verified {
                    Ok(done) => self.start_decoding(t, done.first_token),
                    Err(failure) => {
                        self.failed_verification(nonce, t, failure);
                    }
                }
            }
            Received::Closed { reason, .. } => {
                if let Some(d) = self.draining.remove(&nonce) {
                    self.stats.abort_ack.observe(d.since.elapsed());
                    d.pages.drained();
                } else if let Some(s) = self.suspects.get_mut(&nonce) {
                    // Nothing more of the session can arrive: its pages come back after the
                    // grace period.
                    s.peer_gone(Instant::now() + self.config.reclaim_after);
                } else if let Some(mut t) = self.transfers.remove(&nonce) {
                    // Closed before a manifest: nothing more of this session can arrive.
                    // Said complete without saying what it sent, or ended after something of
                    // it arrived damaged (a corrupted frame's length ends its connection at
                    // the next head): the handoff failed its verification (the incident's
                    // sign), counted and quarantined, not the peer its work.
                    let damage = match reason {
                        CloseReason::Complete => Some(IntegrityFailure::CompleteWithoutManifest),
                        CloseReason::Aborted | CloseReason::Failed => t.inbound.damage(),
                    };
                    if let Some(failure) = damage {
                        let back = Instant::now() + self.config.reclaim_after;
                        self.failed_verification(nonce, t, failure).peer_gone(back);
                        return None;
                    }
                    let why = match reason {
                        CloseReason::Complete | CloseReason::Failed => "prefill failed",
                        CloseReason::Aborted => "aborted",
                    };
                    let _ = t
                        .request
                        .sink
                        .emit(Event::Failed(Failure::PrefillClosed(why)));
                    t.pages.release();
                }
            }
        }
        None
    }

    /// Decode role: transfer `nonce` failed its verification: the request fails with
    /// `failure`, counted, and its pages are quarantined while its peer may still write them
    /// (the suspect session returned).
    fn failed_verification(
        &mut self,
        nonce: SessionNonce,
        mut t: Transfer,
        failure: IntegrityFailure,
    ) -> &mut Suspect {
        self.stats.integrity_failures += 1;
        tracing::warn!(session = %nonce, request = %t.request.id, %failure, "KV transfer failed verification");
        let _ = t.request.sink.emit(Event::Failed(failure.into()));
        self.suspects
            .entry(nonce)
            .insert_entry(Suspect::new(t.pages.quarantine()))
            .into_mut()
    }

    /// Decode role: the prefill worker refused the transfer `nonce` at its own admission, so
    /// nothing of it was or will be sent: the request fails with that reason and its pages
    /// are released at once.
    pub fn prefill_rejected(&mut self, nonce: SessionNonce, reason: SubmitError) {
        if let Some(mut t) = self.transfers.remove(&nonce) {
            let _ = t
                .request
                .sink
                .emit(Event::Failed(Failure::PrefillRejected(reason)));
            t.pages.release();
        } else if let Some(d) = self.draining.remove(&nonce) {
            self.stats.abort_ack.observe(d.since.elapsed());
            d.pages.drained();
        }
    }

    /// Decode role: the prefill worker filling transfer `nonce` has computed `computed` prompt
    /// tokens since it started, for any request — its own progress, whether on this prompt or
    /// on those it queued before it: the transfer's deadline starts again from now. Only a
    /// count above the last one counts, so a peer that stopped computing (stuck, or repeating
    /// itself) cannot hold the reservation past one transfer timeout more.
    pub fn prefill_progress(&mut self, nonce: SessionNonce, computed: u64) {
        let Some(t) = self.transfers.get_mut(&nonce) else {
            return;
        };
        if computed <= t.prefill_computed {
            return;
        }
        let sent_tokens = t.inbound.reservation().sent_tokens();
        t.prefill_computed = computed;
        t.deadline = self
            .config
            .transfer_deadline(sent_tokens, self.capacity.token_bytes);
    }

    /// Prompt tokens this engine computed since it started (prefix-cache hits not included).
    pub fn computed_prompt_tokens(&self) -> u64 {
        self.computed_prompt_tokens
    }

    /// Decode role: the data connection carrying `nonces` is gone, so no more of their frames
    /// can arrive; their transfers fail and abandoned ones count as drained.
    pub fn transport_closed(&mut self, nonces: &[SessionNonce]) {
        for nonce in nonces {
            // An abandoned transfer's pages are safe now — nothing more of it can arrive — but
            // no peer acknowledged its drain: counted apart, not timed as an acknowledgement
            // (during a prefill outage every withdrawn request ends here).
            if let Some(d) = self.draining.remove(nonce) {
                self.stats.teardown_drains += 1;
                d.pages.drained();
                continue;
            }
            let _ = self.deliver(Received::Closed {
                nonce: *nonce,
                reason: CloseReason::Failed,
            });
        }
    }

    /// Decode role: the prefill worker failed transfer `nonce` and said why (`failure`):
    /// nothing more of it will be sent. The request fails so, and its pages are released
    /// (scrubbed before reuse; a late frame finds no session). A transfer already abandoned or
    /// failed goes as when its data connection closes.
    pub fn prefill_failed(&mut self, nonce: SessionNonce, failure: Failure) {
        match self.transfers.remove(&nonce) {
            Some(mut t) => {
                tracing::warn!(session = %nonce, request = %t.request.id, %failure, "the prefill worker failed the transfer");
                let _ = t.request.sink.emit(Event::Failed(failure));
                t.pages.release();
            }
            None => self.transport_closed(&[nonce]),
        }
    }

    /// A verified transfer: the pages become the request's and it decodes from the first token.
    fn start_decoding(&mut self, t: Transfer, first_token: TokenId) {
        let mut r = Running::new(t.request, t.pages.commit(), t.prefix, None);
        r.prefilled = r.request.prompt.len();
        r.sampler = Sampler::resumed(r.request.sampling, 1);
        let outcome = accept_token(&self.tokenizer, &mut r, first_token);
        match outcome {
            Outcome::Continue => self.running.push(r),
            _ => r.retire(),
        }
    }

    /// Runs one scheduling step: expire deadlines, scrub released pages, start waiting
    /// requests that fit, fail those that waited too long, run one forward pass over every
    /// running request, emit events.
    pub fn step(&mut self) {
        let now = Instant::now();
        self.expire(now);
        self.scrub();
        self.start_waiting();
        self.expire_waiting(now);
        if self.running.is_empty() {
            return;
        }

        // Decode first (one token each), then prefill chunks within the token budget, shared
        // between tenants (see `shares`). Prompts get at least a quarter of the budget: with as
        // many requests decoding as the budget has tokens (--max-running at or past
        // --max-batch-tokens), they got none, and every prompt waited, its pages and place
        // held, until enough answers ended.
        let mut budget = self.config.max_batch_tokens;
        let mut plan: Vec<(usize, usize)> = Vec::new(); // (running index, tokens this step)
        for (i, r) in self.running.iter().enumerate() {
            if !r.in_prefill() {
                plan.push((i, 1));
                budget = budget.saturating_sub(1);
            }
        }
        let budget = budget.max(self.config.max_batch_tokens.div_ceil(4));
        let prefilling: Vec<(usize, (&str, usize))> = (self.running.iter().enumerate())
            .filter(|(_, r)| r.in_prefill())
            .map(|(i, r)| {
                let remaining = r.request.prompt.len() - r.prefilled;
                (i, (r.request.tenant.name(), remaining))
            })
            .collect();
        let wants: Vec<(&str, usize)> = prefilling.iter().map(|&(_, want)| want).collect();
        for (&(i, _), n) in prefilling
            .iter()
            .zip(shares::prefill_shares(&wants, budget))
        {
            if n > 0 {
                plan.push((i, n));
            }
        }
        // Each sequence reads only slots written for it (`written`): with the tag check on, one
        // that would read another fails here, before the step reads anything.
        let mut outcomes = Vec::with_capacity(plan.len());
        let mut unwritten = Vec::new();
        if self.tag_check == TagCheck::On {
            plan.retain(|&(i, _)| {
                let r = &self.running[i];
                let checked = self.written.check(&r.table, r.cached());
                checked.map_err(|e| unwritten.push((i, e))).is_ok()
            });
        }
        for (i, e) in unwritten {
            let failure = crate::model::SeqFailure::Integrity(e);
            outcomes.push((i, self.advance(i, 0, Err(failure))));
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
                    table: &r.table,
                    cached: r.cached(),
                    logits,
                }
            })
            .collect();
        let (model, kv, check) = (&self.model, &mut self.kv, self.tag_check);
        let canary = self.pool.config().scrub == Scrub::Canary;
        let results = match steps.is_empty() {
            true => Ok(Vec::new()),
            false => self.pool.with_tags(|tags| {
                model.forward(
                    &steps,
                    kv,
                    TagView {
                        tags,
                        check,
                        canary,
                    },
                )
            }),
        };
        drop(steps);

        let results = match results {
            Ok(r) => r,
            Err(e) => {
                // The weights were validated at load: a bug or a device fault, not a request's.
                tracing::error!(error = %e, "forward pass failed; failing the batch");
                plan.iter()
                    .map(|_| Err(crate::model::SeqFailure::Internal(e.to_string())))
                    .collect()
            }
        };
        for (&(i, n), result) in plan.iter().zip(results) {
            if result.is_ok() {
                let r = &self.running[i];
                self.written.record_run(&r.table, r.cached(), n);
            }
            outcomes.push((i, self.advance(i, n, result)));
        }
        // Remove finished requests, highest index first so indices stay valid, and in place so
        // the rest keep their order: prompts are computed first come, first served (moving the
        // last request into a finished one's place put the newest prompt first, and an early
        // one could wait behind every later arrival).
        outcomes.sort_by_key(|&(i, _)| std::cmp::Reverse(i));
        for (i, outcome) in outcomes {
            match outcome {
                Outcome::Continue => {}
                Outcome::HandOver(first_token) => {
                    let r = self.running.remove(i);
                    self.hand_over(r, first_token);
                }
                Outcome::Failed {
                    suspect: Some(InDoubt { page }),
                } => {
                    // Suspect contents, and nothing left that writes them (the request is
                    // gone, and there is no peer): out of service for a while — the pool's
                    // counters and the log show them —, then scrubbed and reused. Kept out for
                    // good, each such failure took pages from the pool until a restart, and a
                    // worker whose pool is its served context was never ready again.
                    let r = self.running.remove(i);
                    if let (Some(page), Some(prefix)) = (page, r.prefix) {
                        let distrusted = prefix.distrust_from(page);
                        self.prefix_stats.distrusted_pages += u64::from(distrusted);
                        if distrusted > 0 {
                            tracing::warn!(
                                request = %r.request.id,
                                pages = distrusted,
                                "cached prefix pages distrusted after the request's integrity \
                                 failure: no request reads them again"
                            );
                        }
                    }
                    let pages = r.pages.quarantine();
                    let back = Instant::now() + self.config.reclaim_after;
                    self.failed_pages.push((back, pages));
                }
                // Nothing of them goes to the prefix cache: the step that failed may have
                // written part of a page.
                Outcome::Failed { suspect: None } => self.running.remove(i).pages.release(),
                Outcome::Finished | Outcome::Cancelled => self.running.remove(i).retire(),
            }
        }
    }

    /// Fails the requests still waiting for pages at their deadline (after the step tried to
    /// start them): nothing was allocated for them.
    fn expire_waiting(&mut self, now: Instant) {
        let timeout = self.config.queue_timeout;
        let before = self.waiting.len();
        self.waiting.retain_mut(|w| {
            let late = w.deadline.is_some_and(|at| at <= now);
            if late {
                let _ = w
                    .request
                    .sink
                    .emit(Event::Failed(Failure::QueueTimedOut(timeout)));
            }
            !late
        });
        if self.waiting.len() < before {
            // The head that could not start may be gone: the next one is yet to be tried.
            self.waiting_blocked = false;
        }
    }

    /// Fails transfers past their deadline and quarantines abandoned pages whose drain
    /// acknowledgement never came.
    fn expire(&mut self, now: Instant) {
        let late: Vec<SessionNonce> = self
            .transfers
            .iter()
            .filter(|(_, t)| t.deadline <= now)
            .map(|(n, _)| *n)
            .collect();
        for nonce in late {
            let _kept = self.live.keep(nonce);
            if let Some(mut t) = self.transfers.remove(&nonce) {
                let _ = t.request.sink.emit(Event::Failed(Failure::TransferTimedOut(
                    self.config.transfer_timeout,
                )));
                self.start_draining(nonce, t);
            }
        }
        let stuck: Vec<SessionNonce> = self
            .draining
            .iter()
            .filter(|(_, d)| d.deadline <= now)
            .map(|(n, _)| *n)
            .collect();
        for nonce in stuck {
            if let Some(d) = self.draining.remove(&nonce) {
                tracing::warn!(session = %nonce, heard = d.heard, "no drain acknowledgement: pages quarantined");
                self.stats.drain_timeouts += 1;
                let mut suspect = Suspect::new(d.pages.timed_out());
                if !d.heard {
                    // No data connection carries the session (see the module's docs).
                    suspect.peer_gone(now + self.config.reclaim_after);
                }
                self.suspects.insert(nonce, suspect);
            }
        }
        let gone: Vec<SessionNonce> = self
            .suspects
            .iter()
            .filter(|(_, s)| s.reclaim_at.is_some_and(|at| at <= now))
            .map(|(n, _)| *n)
            .collect();
        for nonce in gone {
            if let Some(s) = self.suspects.remove(&nonce) {
                let pages = s.pages.reclaim();
                tracing::info!(session = %nonce, pages, "peer gone: quarantined pages reclaimed");
                self.stats.reclaimed_pages += u64::from(pages);
            }
        }
        let (due, kept) = std::mem::take(&mut self.failed_pages)
            .into_iter()
            .partition::<Vec<_>, _>(|(at, _)| *at <= now);
        self.failed_pages = kept;
        for (_, quarantined) in due {
            let pages = quarantined.reclaim();
            tracing::info!(
                pages,
                "the pages of a request that failed its integrity check reclaimed"
            );
            self.stats.reclaimed_pages += u64::from(pages);
        }
    }

    /// Starts waiting requests, in the order they came, while pages and --max-running allow.
    /// A request that cannot start yet holds back its own tenant's later ones (a tenant's
    /// requests start in order), not other tenants': one tenant's request for most of the pool
    /// made every other tenant wait behind it, pages free or not, past their queue timeout.
    /// Once it has waited a quarter of the queue timeout, it holds back every request after it
    /// too, so that the pages others give back come to it, and a stream of small requests
    /// cannot keep it waiting for good.
    fn start_waiting(&mut self) {
        let patience = self.config.queue_timeout / 4;
        let now = Instant::now();
        // Tenants (their salts aside) whose earliest waiting request could not start.
        let mut held_back: Vec<Scope> = Vec::new();
        // The fewest pages past its cached prefix that a request could not reserve this step:
        // a later one needing as many is not tried (a try scans the cache for room, under the
        // pool's lock, and the pool only loses pages as this step goes on).
        let mut short_at: Option<u32> = None;
        let mut next = 0;
        // A decode worker's transfers count: each becomes a running request once its KV is
        // verified, so leaving them out let a burst that fits the pool reserve all at once and
        // then decode as one batch far over --max-running. Held by transfers alone (nothing
        // running), a step could do nothing either: the engine waits for their ends, not
        // spinning.
        while self.running.len() + self.transfers.len() < self.config.max_running {
            let Some(w) = self.waiting.get(next) else {
                break;
            };
            if held_back
                .iter()
                .any(|t| t.name() == w.request.tenant.name())
            {
                next += 1;
                continue;
            }
            let Some(w) = self.waiting.remove(next) else {
                break;
            };
            let prefix = self.cached_prefix(&w);
            // Counted once the request starts (a decode request whose caller left as it was
            // reserved never does).
            let looked_up = prefix
                .as_ref()
                .map(|p| (w.request.prompt.len() as u64, p.tokens() as u64));
            let need = (w.admissible.pages())
                .saturating_sub(prefix.as_ref().map_or(0, |p| p.pages().len() as u32));
            let tried = if short_at.is_some_and(|short| need >= short) {
                Err(w.admissible)
            } else {
                self.reserve(w.admissible, prefix.as_ref())
                    .map_err(|not_now| {
                        short_at = Some(short_at.map_or(need, |short| short.min(need)));
                        not_now.into_inner()
                    })
            };
            let reservation = match tried {
                Ok(r) => r,
                Err(admissible) => {
                    let patient = now.saturating_duration_since(w.since) < patience;
                    held_back.push(w.request.tenant.clone());
                    self.waiting.insert(next, Waiting { admissible, ..w });
                    if !patient {
                        break;
                    }
                    next += 1;
                    continue;
                }
            };
            match w.role {
                Role::Colocated => {
                    let mut request = w.request;
                    if request.sink.emit(Event::Started) == Delivery::Gone {
                        continue; // the reservation drops: nothing was computed
                    }
                    let r = Running::new(request, reservation.commit(), prefix, None);
                    self.running.push(r);
                }
                Role::PrefillFor(target) => {
                    let r = Running::new(w.request, reservation.commit(), prefix, Some(target));
                    self.running.push(r);
                }
                Role::Decode => {
                    let mut request = w.request;
                    let nonce = SessionNonce(rand::random());
                    let c = &self.capacity;
                    let target = transfer::target(
                        nonce,
                        reservation.pages(),
                        request.prompt.len() as u32,
                        prefix.as_ref().map_or(0, |p| p.tokens() as u32),
                        c.page_tokens,
                        c.token_bytes as u32,
                    );
                    // Live before prefill hears of it: its first frame may come at once.
                    let _kept = self.live.keep(nonce);
                    if request.sink.emit(Event::Reserved(target.clone())) == Delivery::Gone {
                        continue; // the reservation drops: nothing was sent anywhere
                    }
                    let deadline = self
                        .config
                        .transfer_deadline(target.sent_tokens(), c.token_bytes);
                    let inbound = bulkhead_handoff::Inbound::new(target);
                    self.transfers.insert(
                        nonce,
                        Transfer {
                            request,
                            pages: reservation,
                            prefix,
                            inbound,
                            deadline,
                            prefill_computed: 0,
                            heard: false,
                        },
                    );
                }
            }
            if let Some((prompt, cached)) = looked_up {
                self.prefix_stats.prompt_tokens += prompt;
                self.prefix_stats.cached_tokens += cached;
            }
        }
        // Whatever still waits was tried against the pool as it is, or is held back behind a
        // request that was: until something changes, no step can start it.
        self.waiting_blocked = !self.waiting.is_empty();
    }

    /// Scrubs the released pages waiting for it, so they can be reserved again.
    fn scrub(&mut self) {
        let scrub = self.pool.config().scrub;
        let kv = &mut self.kv;
        self.pool.scrub_pending(|page| {
            if let Err(e) = kv.scrub(page, scrub) {
                // The page still goes back with a new tag, so no stale read can reach it
                // (I2); an unscrubbed page is a lost defence in depth, worth an operator's look.
                tracing::error!(%page, error = %e, "scrubbing a released KV page failed");
            }
        });
    }

    /// The cached pages a waiting request's prompt starts with, when the prefix cache is on:
    /// at most all but its last token, which must be computed for the first token's logits
    /// (on a decode worker: sent, with them). Looked up in the request's tenant's cache — or,
    /// in a test build with the `prefix-scope` check off, in one cache shared by every tenant.
    fn cached_prefix(&self, w: &Waiting) -> Option<Prefix> {
        if !self.config.prefix_cache {
            return None;
        }
        let scope = if bulkhead_checks::enabled(Check::PrefixScope) {
            w.request.tenant.clone()
        } else {
            Scope::new("")
        };
        let prompt = &w.request.prompt;
        let max_pages = (prompt.len() - 1) / self.capacity.page_tokens as usize;
        Some(self.pool.cached_prefix(&scope, prompt, max_pages))
    }

    /// Reserves a request's pages (after `prefix`'s, if any). Cached pages that no request
    /// reads make room when the free pages are short — only when they can make enough: a
    /// request that would still wait evicts nothing (it emptied other tenants' caches at every
    /// step it waited).
    fn reserve(
        &mut self,
        admissible: Admissible,
        prefix: Option<&Prefix>,
    ) -> Result<Reservation, NotNow> {
        let reserve = |pool: &PagePool, a| match prefix {
            Some(p) => pool.reserve_after(a, p),
            None => pool.reserve(a),
        };
        let not_now = match reserve(&self.pool, admissible) {
            Ok(r) => return Ok(r),
            Err(not_now) => not_now,
        };
        // Pages waiting for their scrub (a reservation whose caller left, dropped just now)
        // are free once scrubbed: counted before the cache is asked for the rest.
        self.scrub();
        let cached = prefix.map_or(0, |p| p.pages().len() as u32);
        let needed = not_now.admissible().pages().saturating_sub(cached);
        let short = needed.saturating_sub(self.pool.free_pages());
        if short > 0 && self.pool.make_room(short) == 0 {
            return Err(not_now);
        }
        self.scrub();
        reserve(&self.pool, not_now.into_inner())
    }

    /// Applies one forward result to running request `i`, which processed `n` tokens.
    fn advance(&mut self, i: usize, n: usize, result: SeqResult) -> Outcome {
        let r = &mut self.running[i];
        let logits = match result {
            Ok(Some(logits)) if logits.iter().any(|l| !l.is_finite()) => Err(
                crate::model::SeqFailure::Internal("the model's logits are not all finite".into()),
            ),
            other => other,
        };
        let logits = match logits {
            Err(failure) => {
                tracing::warn!(request = %r.request.id, error = %failure, "request failed");
                let page_tokens = self.pool.config().page_tokens.get() as usize;
                let suspect = match &failure {
                    crate::model::SeqFailure::Integrity(e) => Some(InDoubt {
                        page: e.suspect_page(page_tokens),
                    }),
                    _ => None,
                };
                let _ = r.request.sink.emit(Event::Failed(failure.into()));
                return Outcome::Failed { suspect };
            }
            Ok(logits) => logits,
        };
        if r.in_prefill() {
            r.prefilled += n;
            self.computed_prompt_tokens += n as u64;
        }
        let Some(logits) = logits else {
            return Outcome::Continue;
        };
        let token = r.sampler.sample(&logits);
        if r.target.is_some() {
            return Outcome::HandOver(token);
        }
        accept_token(&self.tokenizer, r, token)
    }

    /// Prefill role: the prompt is in the pages and the first token sampled; read the KV out
    /// for decode's reservation and hand it, with the source pages, to the request's sink.
    fn hand_over(&self, r: Running, first_token: TokenId) {
        let Running {
            mut request,
            pages,
            prefix,
            table,
            target,
            ..
        } = r;
        let Some(target) = target else { return };
        let source = transfer::Source {
            table,
            pages,
            prefix,
            prompt: std::mem::take(&mut request.prompt),
        };
        let event = match Outbound::build(&self.kv, source, &target, first_token) {
            Ok(outbound) => Event::Prefilled(outbound),
            Err(e) => {
                tracing::error!(error = %e, "reading the prompt's KV out failed");
                Event::Failed(crate::model::SeqFailure::Internal(e.to_string()).into())
            }
        };
        let _ = request.sink.emit(event);
    }

    /// Ids of every request the engine holds (waiting, running, or in transfer).
    pub fn request_ids(&self) -> HashSet<RequestId> {
        self.waiting
            .iter()
            .map(|w| w.request.id)
            .chain(self.running.iter().map(|r| r.request.id))
            .chain(self.transfers.values().map(|t| t.request.id))
            .collect()
    }
}

/// Records a sampled token: streams its text, checks stops and the length limit.
fn accept_token(tokenizer: &Tokenizer, r: &mut Running, token: TokenId) -> Outcome {
    r.generated.push(token);
    let usage = Usage {
        prompt_tokens: r.request.prompt.len(),
        completion_tokens: r.generated.len(),
        cached_tokens: r.cached_prompt(),
    };
    let eos = tokenizer.is_stop(token) && !r.request.ignore_eos;
    let (text, finish) = if eos {
        (String::new(), Some(FinishReason::Stop))
    } else {
        match r.stops.push(&r.detok.push(tokenizer, token)) {
            StopScan::Stopped { text, .. } => (text, Some(FinishReason::Stop)),
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
    // Text the stop watch held back (it could have begun a stop string) is the answer's,
    // unless a stop string ended it. Half a character the detokenizer holds (a length limit
    // cut the character) is no text: it goes with the request, never as U+FFFD.
    let text_tail = if eos || reason == FinishReason::Length {
        r.stops.finish()
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
