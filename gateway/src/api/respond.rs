//! Turning the worker's token stream into OpenAI's responses: one JSON body, or SSE chunks
//! ending in `data: [DONE]` (with a usage chunk first when asked). A failure after the 200
//! becomes an error event and the stream ends: the client never waits on a dead worker.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use bulkhead_audit::Layer;
use bulkhead_worker::serve::proto::{Done, GenerateResponse, Item};
use http::header::CONTENT_TYPE;
use tokio::time::Instant;
use tracing::Instrument as _;

use crate::limits::RequestPermit;
use crate::metrics::{Metrics, Tokens};
use crate::policy::{Charge, Progress, RequestPolicy};
use crate::tenant::Tenant;
use crate::trail::{ShutdownSignal, Trail};
use crate::upstreams::Leg;
use crate::workers::Route;

use super::Endpoint;
use super::error::ApiError;
use super::upstream::{WorkerFailure, finish_reason, from_status, span_failed};
use super::validate::Stream;
use super::wire::Head;

/// A request routed and called; holds the tenant's permit and the route until it ends.
/// Dropping it ends the request's policies: `on-response-end`, or — when it did not reach
/// the end, i.e. the client went away — the chain's disconnect directive, which may keep
/// waiting on `upstream` for a while before dropping it (see [`crate::policy`]).
#[derive(Debug)]
pub struct Started {
    pub endpoint: Endpoint,
    pub id: String,
    pub created: u64,
    pub model: String,
    pub stream_mode: Option<Stream>,
    pub tenant: Arc<Tenant>,
    /// Its tokens-per-minute charge (prompt + max tokens) is settled to what it used. `None`
    /// only once handed to the policies at drop: an abandoned request keeps its tenant's
    /// concurrency slot while its stream is held.
    pub permit: Option<RequestPermit>,
    /// The prompt's tokens, as admitted.
    pub prompt_tokens: u32,
    /// The most tokens the request may generate, as admitted (after the policies' clamp): a
    /// worker that sends more is broken.
    pub max_tokens: u32,
    pub route: Route,
    pub metrics: Metrics,
    /// The call until the worker answers ([`Started::answer`]), then its stream. `None` once
    /// the call failed, or once handed to the policies at drop.
    pub upstream: Option<Leg>,
    /// How far the stream got.
    pub progress: Progress,
    /// `None` only once finished at drop.
    pub policy: Option<RequestPolicy>,
    pub trail: Trail,
    /// The upstream call's client span: open while the upstream stream is read.
    pub upstream_span: tracing::Span,
    /// The longest the worker may stay silent ([`crate::config::HttpLimits::stream_idle_timeout`]).
    pub idle: std::time::Duration,
    /// Shutdown's cut: the request ends with an error its client sees.
    pub shutdown: ShutdownSignal,
    /// What the worker reported of its prompt computation.
    pub computed: ComputedTokens,
    /// The request's deadline and its length in seconds, once its call was answered.
    pub deadline: Option<(Instant, u64)>,
}

/// The highest count of prompt tokens computed a worker reported: only a rise is news, so a
/// worker that repeats itself cannot hold a request past its silence timeout.
#[derive(Debug, Default)]
pub struct ComputedTokens(u64);

impl ComputedTokens {
    /// Whether `count` is above every count before it.
    fn rose(&mut self, count: u64) -> bool {
        let rose = count > self.0;
        self.0 = self.0.max(count);
        rose
    }
}

impl Drop for Started {
    fn drop(&mut self) {
        if let (Some(policy), Some(permit)) = (self.policy.take(), self.permit.take()) {
            let charge = Charge {
                permit,
                prompt_tokens: self.prompt_tokens,
                max_tokens: self.max_tokens,
                claim: self.route.take_claim(),
            };
            policy.finish(
                self.upstream.take(),
                self.progress,
                self.trail.clone(),
                charge,
                self.endpoint,
            );
        }
    }
}

/// The counts a request's `Done` is held to: the client's usage, the tenant's charge and the
/// audit record take them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Counts {
    /// The prompt's tokens, as the gateway tokenized and admitted it.
    pub(crate) prompt_tokens: u32,
    pub(crate) max_tokens: u32,
}

impl Counts {
    /// Why `d` cannot end this request, if it cannot: another prompt's length (a worker that
    /// computed a truncated or another prompt), more tokens than asked for, more of the prompt
    /// cached than it has, or — from a worker that sends every token as a message of its own,
    /// `sent` of them — another count than it sent.
    pub(crate) fn hold(self, d: &Done, sent: Option<u32>) -> Result<(), String> {
        if d.prompt_tokens != self.prompt_tokens {
            return Err(format!(
                "{} prompt tokens, where the gateway admitted {}",
                d.prompt_tokens, self.prompt_tokens
            ));
        }
        if d.completion_tokens > self.max_tokens {
            return Err(format!(
                "{} completion tokens, more than the {} asked for",
                d.completion_tokens, self.max_tokens
            ));
        }
        if d.cached_tokens > d.prompt_tokens {
            return Err(format!(
                "{} cached tokens of a {}-token prompt",
                d.cached_tokens, d.prompt_tokens
            ));
        }
        match sent {
            Some(sent) if sent != d.completion_tokens => Err(format!(
                "{} completion tokens, where it sent {sent}",
                d.completion_tokens
            )),
            _ => Ok(()),
        }
    }
}

/// Marks a streamed response: its stream commits the audit record itself, before `[DONE]`.
#[derive(Debug, Clone, Copy)]
pub struct Streamed;

/// One step of the worker's stream.
enum Step {
    Text(String),
    Done(Done),
}

impl Started {
    /// Waits for the worker's answer to the call, until `deadline`: its stream, or the error
    /// that fails the request (the call refused or failed, or not answered in time; the
    /// request's trail, span and charge say so).
    pub async fn answer(&mut self, deadline: Instant, secs: u64) -> Result<(), ApiError> {
        let Some(Leg::Calling(call)) = self.upstream.as_mut() else {
            return Ok(());
        };
        let called = Instant::now();
        self.deadline = Some((deadline, secs));
        // A call still unanswered when shutdown cuts (waiting for pages in the worker's
        // queue, or for its prefill worker) ends told, like a stream, not dropped unanswered.
        let answered = tokio::select! {
            answered = tokio::time::timeout_at(deadline, call) => Some(answered),
            () = self.shutdown.cut() => None,
        };
        self.upstream = None;
        let Some(answered) = answered else {
            return Err(self.failed(ApiError::GatewayShutdown, None));
        };
        match answered {
            Ok(Ok(stream)) => {
                self.route.answered();
                self.trail.worker_answered();
                self.upstream = Some(Leg::Streaming(stream));
                Ok(())
            }
            Ok(Err(status)) => {
                let failure = self.worker_failure(&status);
                if !failure.worker_down {
                    // A refusal is an answer: the worker is there.
                    self.route.answered();
                }
                self.progress.failed = true;
                Err(self.failed(failure.error, failure.refused_by))
            }
            Err(_) => {
                // Counted against the worker only when it had the request for at least half
                // the deadline: time the request spent before the call (its body, the
                // policies) is not the worker's.
                if (deadline - called).as_secs_f64() * 2.0 >= secs as f64 {
                    self.route.stalled(secs);
                }
                Err(self.timed_out(secs))
            }
        }
    }

    /// The next step, or the error that ends the request.
    async fn next(&mut self) -> Result<Step, ApiError> {
        let step = self.step().await;
        match &step {
            Ok(Step::Text(_)) => self.progress.tokens = self.progress.tokens.saturating_add(1),
            Ok(Step::Done(d)) => self.progress.usage = Some((d.prompt_tokens, d.completion_tokens)),
            Err(_) => self.progress.failed = true,
        }
        step
    }

    async fn step(&mut self) -> Result<Step, ApiError> {
        let mut silent_until = Instant::now() + self.idle;
        loop {
            let Some(Leg::Streaming(upstream)) = self.upstream.as_mut() else {
                return Err(ApiError::Internal);
            };
            let silent_while_queued = !upstream.reports_progress();
            let tokens_are_messages = upstream.sends_each_token();
            let message = tokio::select! {
                message = tokio::time::timeout_at(silent_until, upstream.message()) => message,
                // Shutdown's drain timeout passed: the client is told, rather than cut off.
                () = self.shutdown.cut() => {
                    return Err(self.failed(ApiError::GatewayShutdown, None));
                }
            };
            let Ok(message) = message else {
                // An OpenAI-compatible server answers its headers before it schedules the
                // request (vLLM), and says nothing while it queues it: silence before its
                // first token is that queue, waited for as a call is — while its health checks
                // answer, until the request's deadline, a stall past it — not a stream that
                // broke mid-answer, which fails the request and unroutes the server for every
                // tenant until its next health check.
                if let (true, 0, Some((deadline, secs))) =
                    (silent_while_queued, self.progress.tokens, self.deadline)
                {
                    let now = Instant::now();
                    if now >= deadline {
                        self.route.stalled(secs);
                        return Err(self.timed_out(secs));
                    }
                    if (self.route.serving())() {
                        silent_until = (now + self.idle).min(deadline);
                        continue;
                    }
                }
                let secs = self.idle.as_secs();
                return Err(self.worker_down(&format!("sent nothing for {secs} s mid-request")));
            };
            match message {
                Ok(Some(GenerateResponse {
                    item: Some(Item::Token(_)),
                })) if self.progress.tokens >= self.max_tokens => {
                    // This request's answer is broken, not the worker's health: it stays routed.
                    // A 500, not a 503 a client would retry into the same broken answer.
                    let max = self.max_tokens;
                    tracing::warn!(worker = %self.route.worker, id = %self.id, max, "the worker sent more tokens than asked");
                    return Err(self.failed(ApiError::Internal, None));
                }
                Ok(Some(GenerateResponse {
                    item: Some(Item::Token(t)),
                })) => {
                    self.trail.text(&t.text);
                    return Ok(Step::Text(t.text));
                }
                Ok(Some(GenerateResponse {
                    item: Some(Item::Done(d)),
                })) => {
                    let sent = tokens_are_messages.then_some(self.progress.tokens);
                    if let Err(why) = self.counts().hold(&d, sent) {
                        // The counts go to the client's usage, the tenant's charge and the
                        // audit record: a worker whose counts are not this request's computed
                        // something else, and its answer is not given.
                        tracing::warn!(worker = %self.route.worker, id = %self.id, why, "the worker's counts are not the request's");
                        return Err(self.failed(ApiError::Internal, None));
                    }
                    self.trail.text(&d.text_tail);
                    self.trail.completed(d.prompt_tokens, d.completion_tokens);
                    self.finished(&d);
                    return Ok(Step::Done(d));
                }
                // The prompt's computation goes on: the silence timeout starts again — only
                // when the count rose, so a worker repeating itself cannot hold the request.
                Ok(Some(GenerateResponse {
                    item: Some(Item::Progress(p)),
                })) if self.computed.rose(p.computed_tokens) => {
                    silent_until = Instant::now() + self.idle;
                }
                // The prefill worker computed the prompt: the request is transferring. News
                // once, so it restarts the silence timeout once.
                Ok(Some(GenerateResponse {
                    item: Some(Item::PrefillDone(_)),
                })) if !self.progress.prefill_done && self.progress.tokens == 0 => {
                    self.progress.prefill_done = true;
                    self.trail.prefill_done();
                    silent_until = Instant::now() + self.idle;
                }
                Ok(Some(GenerateResponse {
                    item: None | Some(Item::Progress(_) | Item::PrefillDone(_)),
                })) => {}
                Ok(None) => return Err(self.worker_down("a stream ended without Done")),
                Err(status) => {
                    let failure = self.worker_failure(&status);
                    return Err(self.failed(failure.error, failure.refused_by));
                }
            }
        }
    }

    /// The worker broke its stream (`why`: it ended without `Done`, or went silent for
    /// [`Started::idle`]): the request failed, and the worker is not routed to until its
    /// health check answers again.
    fn worker_down(&mut self, why: &str) -> ApiError {
        tracing::warn!(worker = %self.route.worker, id = %self.id, why, "the worker failed mid-request");
        self.route.failed(why);
        self.failed(ApiError::WorkerUnavailable, None)
    }

    /// Records `error` as how the request ended, on its audit trail and its upstream span, and
    /// settles its tokens-per-minute charge to what it used ([`Progress::used_by_failure`]:
    /// the prompt and the tokens that came, which its record counts too, or nothing when the
    /// worker did nothing for it).
    fn failed(&mut self, error: ApiError, refused_by: Option<Layer>) -> ApiError {
        self.count_generated();
        if self.progress.tokens > 0 {
            self.trail.generated(self.progress.tokens);
        }
        let (prompt, completion) = self.progress.used_by_failure(self.prompt_tokens);
        self.set_used(u64::from(prompt) + u64::from(completion));
        self.trail.failed(&error, refused_by);
        span_failed(&self.upstream_span, &error);
        error
    }

    /// Before Done, the tokens that came, as the upstream's text counts them where its
    /// messages do not (an OpenAI-compatible server's chunk may hold several) and it is short
    /// enough to count on this thread; a longer one is counted by its messages. (A client that
    /// leaves has its stream's text counted in full, off this thread: `policy::abandon`.)
    fn count_generated(&mut self) {
        if self.progress.usage.is_some() {
            return;
        }
        if let Some(Leg::Streaming(upstream)) = &self.upstream
            && let Some(n) = upstream.generated_now()
        {
            self.progress.tokens = n;
        }
    }

    /// What the worker's error `status` means for the request. The worker's trouble is logged
    /// (the client hears only "internal error" of a broken answer), and a worker down is not
    /// routed to until its health check answers again.
    fn worker_failure(&mut self, status: &tonic::Status) -> WorkerFailure {
        let failure = from_status(status, self.endpoint);
        if failure.worker_down {
            tracing::warn!(worker = %self.route.worker, id = %self.id, %status, "the worker failed a request");
            self.route.failed(status.message());
        } else if matches!(failure.error, ApiError::Internal) {
            tracing::warn!(worker = %self.route.worker, id = %self.id, %status, "the worker broke a request's answer");
        }
        failure
    }

    /// The gateway gives up on the request at its deadline: it failed.
    fn timed_out(&mut self, secs: u64) -> ApiError {
        self.progress.failed = true;
        self.failed(ApiError::Timeout { secs }, None)
    }

    /// What the request's `Done` must say.
    fn counts(&self) -> Counts {
        Counts {
            prompt_tokens: self.prompt_tokens,
            max_tokens: self.max_tokens,
        }
    }

    fn finished(&mut self, d: &Done) {
        self.metrics.tokens(
            &self.tenant.id,
            Tokens {
                prompt: u64::from(d.prompt_tokens),
                cached: u64::from(d.cached_tokens),
                completion: u64::from(d.completion_tokens),
            },
        );
        self.set_used(u64::from(d.prompt_tokens) + u64::from(d.completion_tokens));
    }

    fn set_used(&mut self, used: u64) {
        if let Some(permit) = self.permit.as_mut() {
            permit.set_used(used);
        }
    }

    fn head(&self) -> Head<'_> {
        Head {
            endpoint: self.endpoint,
            id: &self.id,
            created: self.created,
            model: &self.model,
        }
    }

    /// One streamed chunk: a text delta, or (with `finish`) the closing one.
    fn chunk(&self, text: Option<&str>, finish: Option<&str>, first: bool) -> Event {
        let with_usage = self.stream_mode.is_some_and(|s| s.include_usage);
        Event::default().data(self.head().chunk(text, finish, first, with_usage))
    }
}

/// The response for a started request: JSON (bounded by `deadline`) or SSE. The policies'
/// headers are the caller's to add, as on the errors before it started.
pub async fn respond(started: Started, deadline: Instant, secs: u64) -> Response {
    let sse = started.stream_mode.is_some();
    let span = tracing::info_span!("stream", bulkhead.stream = if sse { "sse" } else { "json" });
    if sse {
        stream(started, span)
    } else {
        match collect(started, deadline, secs).instrument(span).await {
            Err(e) => e.into_response(),
            Ok(body) => ([(CONTENT_TYPE, "application/json")], body).into_response(),
        }
    }
}

/// The whole answer, read until the worker's `Done` or `deadline`. A request the gateway gives
/// up on at its deadline failed: its policies hear so, and its stream is cancelled; it was not
/// abandoned by its client, whose disconnect directive could hold it on.
async fn collect(mut started: Started, deadline: Instant, secs: u64) -> Result<String, ApiError> {
    let mut text = String::new();
    loop {
        let step = match tokio::time::timeout_at(deadline, started.next()).await {
            Ok(step) => step?,
            Err(_) => return Err(started.timed_out(secs)),
        };
        match step {
            Step::Text(t) => text.push_str(&t),
            Step::Done(d) => {
                text.push_str(&d.text_tail);
                let finish = finish_reason(d.finish_reason);
                let body = started.head().whole(&text, &d, finish);
                // Committed here, while the request's end is still to be told: an answer whose
                // record cannot be made durable is not sent (503), and did not complete.
                if let Err(e) = started.trail.finish(200, None).await {
                    started.progress.failed = true;
                    return Err(e);
                }
                return Ok(body);
            }
        }
    }
}

/// Where an SSE stream is.
struct Streamer {
    started: Started,
    queue: VecDeque<Event>,
    first: bool,
    ended: bool,
    /// The stream's span: open until the stream is dropped.
    _span: tracing::Span,
}

/// An error event.
fn error_event(e: &ApiError) -> Event {
    Event::default().data(e.body().to_string())
}

fn stream(started: Started, span: tracing::Span) -> Response {
    let state = Streamer {
        started,
        queue: VecDeque::new(),
        first: true,
        ended: false,
        _span: span,
    };
    let events = futures_util::stream::unfold(state, |mut s| async move {
        loop {
            if let Some(e) = s.queue.pop_front() {
                return Some((Ok::<Event, Infallible>(e), s));
            }
            if s.ended {
                return None;
            }
            match s.started.next().await {
                Ok(Step::Text(t)) => {
                    if !t.is_empty() || s.first {
                        s.queue.push_back(s.started.chunk(Some(&t), None, s.first));
                        s.first = false;
                    }
                }
                Ok(Step::Done(d)) => {
                    // The text held back to the end goes in the closing chunk, not one of its
                    // own: a client counting content chunks (a gateway in front of this one)
                    // never counts more than the tokens asked for.
                    let tail = (!d.text_tail.is_empty() || s.first).then_some(d.text_tail.as_str());
                    let finish = finish_reason(d.finish_reason);
                    s.queue
                        .push_back(s.started.chunk(tail, Some(finish), s.first));
                    s.first = false;
                    if s.started.stream_mode.is_some_and(|m| m.include_usage) {
                        let usage = s.started.head().usage_chunk(&d);
                        s.queue.push_back(Event::default().data(usage));
                    }
                    // `[DONE]` only once the record is committed (durable, in durable mode).
                    match s.started.trail.finish(200, None).await {
                        Ok(()) => s.queue.push_back(Event::default().data("[DONE]")),
                        Err(e) => {
                            s.started.progress.failed = true;
                            s.started.metrics.stream_error(&s.started.tenant.id);
                            s.queue.push_back(error_event(&e));
                        }
                    }
                    s.ended = true;
                }
                Err(e) => {
                    s.started.metrics.stream_error(&s.started.tenant.id);
                    let recorded = s.started.trail.finish(200, Some(e.error_type())).await;
                    s.queue.push_back(error_event(&recorded.err().unwrap_or(e)));
                    s.ended = true;
                }
            }
        }
    });
    // Comments while the worker is silent (prefill): a client that went away is noticed on
    // the next write, so the policies' disconnect directive runs during prefill too.
    let mut response = Sse::new(events)
        .keep_alive(KeepAlive::new().interval(SSE_KEEP_ALIVE))
        .into_response();
    response.extensions_mut().insert(Streamed);
    response
}

/// How often an idle SSE stream sends a comment.
const SSE_KEEP_ALIVE: std::time::Duration = std::time::Duration::from_secs(1);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_rising_count_of_computed_tokens_is_news() {
        let mut c = ComputedTokens::default();
        let heard: Vec<bool> = [0, 16, 16, 8, 32, 31, 33].map(|n| c.rose(n)).to_vec();
        assert_eq!(heard, [false, true, false, false, true, false, true]);
    }

    #[test]
    fn a_done_is_held_to_the_admitted_prompt_the_asked_length_and_the_tokens_sent() {
        let counts = Counts {
            prompt_tokens: 20,
            max_tokens: 8,
        };
        let done = |prompt_tokens, completion_tokens, cached_tokens| Done {
            prompt_tokens,
            completion_tokens,
            cached_tokens,
            ..Done::default()
        };
        assert_eq!(counts.hold(&done(20, 8, 20), Some(8)), Ok(()));
        assert_eq!(
            counts.hold(&done(20, 3, 0), None),
            Ok(()),
            "chunks not counted"
        );
        for (d, sent) in [
            (done(19, 3, 0), Some(3)),
            (done(21, 3, 0), None),
            (done(20, 9, 0), Some(9)),
            (done(20, 3, 21), Some(3)),
            (done(20, 3, 0), Some(4)),
            (done(20, 4, 0), Some(3)),
        ] {
            assert!(
                counts.hold(&d, sent).is_err(),
                "{d:?} after {sent:?} tokens"
            );
        }
    }
}
