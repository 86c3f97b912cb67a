//! What a caller hands the engine, and what it gets back.

use bulkhead_kvpool::{RequestId, Scope};

use bulkhead_handoff::IntegrityFailure;

use super::transfer::Outbound;
use crate::model::SeqFailure;
use crate::sampling::SamplingParams;
use crate::tokenizer::TokenId;

/// A generation request, as the engine receives it (already tokenized).
#[derive(Debug)]
pub struct Request {
    pub id: RequestId,
    /// Whose request it is: the prefix cache it reads and adds to.
    pub tenant: Scope,
    pub prompt: Vec<TokenId>,
    /// At least 1.
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    /// Text that ends generation when produced; never included in the output.
    pub stop: Vec<String>,
    /// Keep generating past end-of-sequence tokens (benchmarks).
    pub ignore_eos: bool,
    /// Where the request's events go.
    pub sink: Box<dyn EventSink>,
}

/// Receives one request's events, in order; the last one is `Done` or `Failed`.
pub trait EventSink: Send + std::fmt::Debug {
    /// Delivers `event`; `Gone` means nobody listens any more and the request is cancelled.
    fn emit(&mut self, event: Event) -> Delivery;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    Delivered,
    Gone,
}

/// Token counts of a finished request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose KV came from the tenant's prefix cache instead of being computed.
    pub cached_tokens: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token or a stop sequence.
    Stop,
    /// `max_new_tokens` reached.
    Length,
}

#[derive(Debug)]
pub enum Event {
    /// A generated token and the text it completed (may be empty mid-character or while a
    /// stop sequence might be starting).
    Token { token: TokenId, text: String },
    Done {
        reason: FinishReason,
        usage: Usage,
        text_tail: String,
    },
    /// The request failed after admission; nothing it produced should be trusted.
    Failed(Failure),
    /// Colocated: the request left the queue, its pages reserved; its prompt is computed from
    /// here. Its first event: a worker answers the call then, so that a request refused while
    /// it waits (for load: no pages came free in time) is refused before its answer starts.
    Started,
    /// Decode role: the request's pages are reserved; a prefill worker must now fill them.
    Reserved(bulkhead_handoff::Reservation),
    /// Prefill role: the prompt's KV and first token, ready to send. The last event of the
    /// request on this worker; the transfer holds the source pages until it is closed.
    Prefilled(Outbound),
}

impl Event {
    /// The event's kind, for a log line: never its text, which is the tenant's.
    pub fn kind(&self) -> &'static str {
        match self {
            Event::Token { .. } => "token",
            Event::Done { .. } => "done",
            Event::Failed(_) => "failed",
            Event::Started => "started",
            Event::Reserved(_) => "reserved",
            Event::Prefilled(_) => "prefilled",
        }
    }
}

/// Why an admitted request failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Failure {
    #[error(transparent)]
    Forward(#[from] SeqFailure),
    #[error("KV transfer integrity: {0}")]
    Transfer(#[from] IntegrityFailure),
    #[error("the prefill worker refused the request: {0}")]
    PrefillRejected(SubmitError),
    #[error("the prefill worker closed the transfer without completing it ({0})")]
    PrefillClosed(&'static str),
    /// The prefill worker failed the transfer for its KV's integrity (its own check of the
    /// pages it computed): what it sent, if anything, is not to be trusted.
    #[error("the prefill worker's KV failed its integrity check")]
    PrefillIntegrity,
    #[error("the KV transfer made no progress within {0:?}")]
    TransferTimedOut(std::time::Duration),
    /// Waited for KV pages longer than the engine's queue timeout: refused for load, nothing
    /// was allocated.
    #[error("the worker is busy: no KV pages came free within {0:?}")]
    QueueTimedOut(std::time::Duration),
}

/// Why the engine refused a request at submission. Nothing was allocated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("max_new_tokens must be at least 1")]
    NoNewTokens,
    #[error("prompt token {token} is outside the vocabulary of {vocab}")]
    TokenOutOfRange { token: TokenId, vocab: usize },
    #[error(
        "this model's maximum context length is {limit} tokens; the request needs {requested} ({prompt} in the prompt + {max_new} to generate)"
    )]
    ContextLengthExceeded {
        requested: u64,
        limit: u64,
        prompt: usize,
        max_new: usize,
    },
    #[error("the request queue is full ({capacity} waiting); retry later")]
    QueueFull { capacity: usize },
    #[error("request id {0} is already in use")]
    DuplicateId(RequestId),
    #[error("the reservation does not match this worker: {0}")]
    ReservationMismatch(String),
    /// A peer's refusal of a malformed request, relayed (see `serve::refusal`).
    #[error("refused by the prefill worker: {0}")]
    Invalid(String),
}

impl EventSink for std::sync::mpsc::Sender<Event> {
    fn emit(&mut self, event: Event) -> Delivery {
        match self.send(event) {
            Ok(()) => Delivery::Delivered,
            Err(_) => Delivery::Gone,
        }
    }
}
