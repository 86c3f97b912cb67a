//! The `bulkhead.worker.v1.Worker` gRPC service over an [`EngineHandle`].

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tonic::codegen::tokio_stream::Stream;
use tonic::{Request, Response, Status};
use tracing::{Instrument as _, Span};

use crate::engine::{Event, FinishReason};
use crate::printable::printable;

use super::actor::{CancelOnDrop, EngineHandle, Events, Submission};
use super::disagg::{self, PrefillCall, PrefillPeer, PrefillStream};
use super::error::{ServeError, ValidationError, status};
use super::kvplane::SendOptions;
use super::metrics::{Metrics, Outcome};
use super::progress::Progress;
use super::proto::{self, Item};
use super::spans;
use super::validate::{MAX_LABEL_BYTES, Prompter, ValidGenerate};

/// The part this worker plays.
#[derive(Debug, Clone)]
pub enum ServiceRole {
    /// Prefill and decode in this process.
    Both,
    /// Serves `Prefill` for decode workers, writing their KV as `SendOptions` say.
    Prefill(SendOptions),
    /// Serves `Generate`; prompts are prefilled by the peer.
    Decode(PrefillPeer),
}

impl ServiceRole {
    fn name(&self) -> &'static str {
        match self {
            ServiceRole::Both => "both",
            ServiceRole::Prefill(_) => "prefill",
            ServiceRole::Decode(_) => "decode",
        }
    }
}

/// The gRPC service: validation and tokenization here, everything stateful in the engine thread.
#[derive(Debug, Clone)]
pub struct WorkerService {
    role: ServiceRole,
    engine: EngineHandle,
    prompter: Arc<Prompter>,
    /// Fixed at startup, without the tokenizer.
    info: Arc<proto::InfoResponse>,
    tokenizer: Arc<proto::TokenizerData>,
}

impl WorkerService {
    pub fn new(
        role: ServiceRole,
        engine: EngineHandle,
        prompter: Prompter,
        info: proto::InfoResponse,
        tokenizer: proto::TokenizerData,
    ) -> WorkerService {
        WorkerService {
            role,
            engine,
            prompter: Arc::new(prompter),
            info: Arc::new(info),
            tokenizer: Arc::new(tokenizer),
        }
    }

    /// Decode role: follows which prefill process answers at the peer's address, for as long
    /// as the worker serves; the other roles have no peer to follow.
    pub fn follow_peer(&self) -> impl Future<Output = Infallible> + Send + 'static {
        let peer = match &self.role {
            ServiceRole::Decode(peer) => Some(peer.clone()),
            ServiceRole::Both | ServiceRole::Prefill(_) => None,
        };
        async move {
            match peer {
                Some(peer) => disagg::follow_peer(peer).await,
                None => std::future::pending().await,
            }
        }
    }

    fn refuse(&self, caller_id: &str, tenant: &str, e: ServeError) -> Status {
        // An engine failure was counted when the engine emitted it (a decode worker's queue
        // timeout, prefill's refusal, a transfer's failure before the stream).
        if !matches!(e, ServeError::Failed(_)) {
            self.engine.metrics().count(Outcome::refused(&e));
        }
        // Read before their bound was checked: a refusal for a label too long logs its start.
        let (caller_id, tenant) = (
            printable(caller_id, MAX_LABEL_BYTES),
            printable(tenant, MAX_LABEL_BYTES),
        );
        tracing::info!(caller_id, tenant, error = %e, "request refused");
        status(&e)
    }

    /// `Generate` up to the response stream: validation, admission and (decode) the prefill
    /// worker's acceptance. `span` is the call's; the stream keeps it until the request ends.
    async fn start(
        &self,
        request: proto::GenerateRequest,
        span: Span,
    ) -> Result<GenerateStream, Status> {
        let (caller_id, tenant) = (request.request_id.clone(), request.tenant.clone());
        // Served by the process the caller checked, or refused: one restarted at this address
        // (perhaps with another pool or model) is checked again before it is routed to.
        if !request.instance_id.is_empty() && request.instance_id != self.info.instance_id {
            let checked = printable(&request.instance_id, 128);
            return Err(self.refuse(&caller_id, &tenant, ServeError::OtherInstance { checked }));
        }
        let prompter = self.prompter.clone();
        let parsed = tokio::task::spawn_blocking(move || {
            ValidGenerate::parse(request, prompter.as_ref(), rand::random)
        })
        .instrument(tracing::info_span!("validate"))
        .await;
        let valid = match parsed {
            Ok(Ok(v)) => v,
            Ok(Err(e)) => return Err(self.refuse(&caller_id, &tenant, e.into())),
            Err(join) => {
                tracing::error!(error = %join, "the tokenizer task failed");
                let e = ServeError::Internal {
                    what: "tokenizer task",
                };
                return Err(self.refuse(&caller_id, &tenant, e));
            }
        };
        let prompt_tokens = valid.prompt.len();
        let max_new_tokens = valid.max_new_tokens;
        span.record("gen_ai.usage.input_tokens", prompt_tokens);
        span.record("gen_ai.request.max_tokens", max_new_tokens);
        let started = match &self.role {
            // Answered once the request leaves the queue, as a decode worker answers once its
            // pages are reserved: a request refused for load while it waits gets the refusal
            // as the call's answer, not after an answer that said it was taken.
            ServiceRole::Both => async {
                self.engine
                    .submit_unclaimed(Submission::Colocated, |id, sink| {
                        valid.into_request(id, sink)
                    })
                    .await?
                    .first("its start", |event| match event {
                        Event::Started => Ok(()),
                        other => Err(other),
                    })
                    .await
            }
            .instrument(tracing::info_span!("admission"))
            .await
            .map(|(events, guard, ())| (None, events, guard, None)),
            ServiceRole::Decode(peer) => disagg::start_remote_prefill(&self.engine, peer, valid)
                .await
                .map(|s| (s.early, s.events, s.guard, Some(s.call))),
            ServiceRole::Prefill(_) => Err(ValidationError::WrongRole {
                role: "prefill",
                call: "Generate",
            }
            .into()),
        };
        let (early, events, guard, prefill) =
            started.map_err(|e| self.refuse(&caller_id, &tenant, e))?;
        tracing::info!(
            request = %guard.id(),
            caller_id,
            tenant,
            prompt_tokens,
            max_new_tokens,
            "request admitted"
        );
        // Colocated, the prompt's forward pass runs here until the first token; a decode
        // worker's prefill ran on the prefill worker.
        let phase = match self.role {
            ServiceRole::Both => tracing::info_span!(parent: &span, "prefill"),
            ServiceRole::Decode(_) | ServiceRole::Prefill(_) => Span::none(),
        };
        let metrics = self.engine.metrics().clone();
        let progress = Progress::from(computed_tokens(prefill.as_ref(), &metrics));
        Ok(GenerateStream {
            early,
            events,
            guard,
            finished: false,
            prefill,
            metrics,
            progress,
            span,
            phase,
            decoding: false,
            prefill_told: false,
        })
    }
}

#[tonic::async_trait]
impl proto::Worker for WorkerService {
    type GenerateStream = GenerateStream;
    type PrefillStream = PrefillStream;

    async fn prefill(
        &self,
        request: Request<proto::PrefillRequest>,
    ) -> Result<Response<PrefillStream>, Status> {
        let span = {
            let r = request.get_ref();
            spans::server(
                "Prefill",
                self.role.name(),
                &r.request_id,
                &r.tenant,
                request.metadata(),
            )
        };
        span.record("gen_ai.usage.input_tokens", request.get_ref().prompt.len());
        match &self.role {
            ServiceRole::Prefill(options) => {
                let prefilling = disagg::prefill(
                    &self.engine,
                    request.into_inner(),
                    options.clone(),
                    &self.info,
                );
                prefilling
                    .instrument(span.clone())
                    .await
                    .inspect_err(|status| spans::failed(&span, status))
                    .map(Response::new)
            }
            ServiceRole::Both | ServiceRole::Decode(_) => {
                let e = ValidationError::WrongRole {
                    role: self.role.name(),
                    call: "Prefill",
                };
                Err(status(&e.into()))
            }
        }
    }

    async fn generate(
        &self,
        request: Request<proto::GenerateRequest>,
    ) -> Result<Response<GenerateStream>, Status> {
        let span = {
            let r = request.get_ref();
            spans::server(
                "Generate",
                self.role.name(),
                &r.request_id,
                &r.tenant,
                request.metadata(),
            )
        };
        self.start(request.into_inner(), span.clone())
            .instrument(span.clone())
            .await
            .inspect_err(|status| spans::failed(&span, status))
            .map(Response::new)
    }

    async fn info(
        &self,
        request: Request<proto::InfoRequest>,
    ) -> Result<Response<proto::InfoResponse>, Status> {
        let mut info = proto::InfoResponse::clone(&self.info);
        if let ServiceRole::Decode(peer) = &self.role {
            info.prefill_peer = Some(peer.seen.report());
        }
        if request.into_inner().include_tokenizer {
            info.tokenizer = Some(proto::TokenizerData::clone(&self.tokenizer));
        }
        Ok(Response::new(info))
    }

    async fn health(
        &self,
        _request: Request<proto::HealthRequest>,
    ) -> Result<Response<proto::HealthResponse>, Status> {
        let response = match self.engine.stats().await {
            Ok(stats) => proto::HealthResponse {
                status: proto::ServingStatus::Serving.into(),
                pool: Some(proto::PoolPages {
                    total: stats.pool.total,
                    free: stats.pool.free,
                    reserved: stats.pool.reserved,
                    owned: stats.pool.owned,
                    releasing: stats.pool.releasing,
                    quarantined: stats.pool.quarantined,
                    pending_scrub: stats.pool.pending_scrub,
                    cached: stats.pool.cached,
                }),
                queue_depth: saturate(stats.waiting),
                running: saturate(stats.running),
            },
            Err(_) => proto::HealthResponse {
                status: proto::ServingStatus::NotServing.into(),
                ..proto::HealthResponse::default()
            },
        };
        Ok(Response::new(response))
    }
}

fn saturate(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// One request's response stream. Dropping it before the end (the client went away) cancels
/// the request in the engine, which frees its pages.
#[derive(Debug)]
pub struct GenerateStream {
    /// An event that arrived before the stream started (see [`disagg::RemoteStart`]).
    early: Option<Event>,
    events: Events,
    guard: CancelOnDrop,
    /// The final item (`Done` or an error) was sent.
    finished: bool,
    /// Decode role: the prefill call; dropping it (with this stream) aborts the transfer. Its
    /// answer says how much of the prompt prefill read from its prefix cache.
    prefill: Option<PrefillCall>,
    /// This worker's counters: colocated, its count of prompt tokens computed is the progress.
    metrics: Arc<Metrics>,
    /// Until the first token: the caller's progress reports.
    progress: Progress,
    /// The `Generate` call's span, open until the stream ends.
    span: Span,
    /// The step under way: `prefill` (colocated, until the first token), then `decode`.
    phase: Span,
    /// The first token was seen: `phase` is the decode span.
    decoding: bool,
    /// Decode role: the caller was told that prefill computed the prompt ([`Item::PrefillDone`]).
    prefill_told: bool,
}

impl Stream for GenerateStream {
    type Item = Result<proto::GenerateResponse, Status>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.finished {
            return Poll::Ready(None);
        }
        let event = match this.early.take() {
            Some(early) => Some(early),
            None => match this.events.poll_recv(cx) {
                Poll::Pending => return this.poll_progress(cx),
                Poll::Ready(e) => e,
            },
        };
        if matches!(event, Some(Event::Token { .. } | Event::Done { .. })) && !this.decoding {
            // Prefill computed the prompt before its first token came: the caller hears so
            // first, also when the token overtook prefill's word of it.
            if this.prefill.is_some() && !this.prefill_told {
                this.early = event;
                return Poll::Ready(Some(Ok(this.prefill_told())));
            }
            this.decoding = true;
            this.phase = tracing::info_span!(parent: &this.span, "decode");
        }
        let item = match event {
            Some(Event::Token { token, text }) => Ok(Item::Token(proto::Token { id: token, text })),
            Some(Event::Done {
                reason,
                mut usage,
                text_tail,
            }) => {
                // Decode role: the prompt's cached part is prefill's to say (a part: a peer
                // that says more is not believed past the prompt, which the client and the
                // tenant's metering read).
                if let Some(call) = this.prefill.as_mut() {
                    match call.poll_cached_tokens(cx) {
                        Poll::Ready(n) => {
                            usage.cached_tokens = (n as usize).min(usage.prompt_tokens);
                        }
                        Poll::Pending => {
                            this.early = Some(Event::Done {
                                reason,
                                usage,
                                text_tail,
                            });
                            return Poll::Pending;
                        }
                    }
                }
                this.span
                    .record("gen_ai.usage.output_tokens", usage.completion_tokens);
                this.finish();
                Ok(Item::Done(proto::Done {
                    finish_reason: match reason {
                        FinishReason::Stop => proto::FinishReason::Stop,
                        FinishReason::Length => proto::FinishReason::Length,
                    }
                    .into(),
                    prompt_tokens: saturate(usage.prompt_tokens),
                    completion_tokens: saturate(usage.completion_tokens),
                    text_tail,
                    cached_tokens: saturate(usage.cached_tokens),
                }))
            }
            Some(Event::Failed(failure)) => {
                this.finish();
                tracing::error!(request = %this.guard.id(), error = %failure, "request failed");
                Err(status(&ServeError::Failed(failure)))
            }
            Some(Event::Started | Event::Reserved(_) | Event::Prefilled(_)) => {
                // A start or a reservation is consumed before the stream starts; prefill events
                // belong to the Prefill call.
                this.finish();
                tracing::error!(request = %this.guard.id(), "transfer event on a colocated request");
                Err(status(&ServeError::Internal { what: "engine" }))
            }
            None => {
                // The engine dropped the request without a final event: it is shutting down.
                this.finish();
                Err(status(&ServeError::EngineGone))
            }
        };
        if let Err(status) = &item {
            spans::failed(&this.span, status);
        }
        Poll::Ready(Some(
            item.map(|item| proto::GenerateResponse { item: Some(item) }),
        ))
    }
}

/// The progress of the computation a request waits on before its first token: the prefill
/// worker's count as it last reported it (decode), else this worker's prompts and answers.
fn computed_tokens(prefill: Option<&PrefillCall>, metrics: &Metrics) -> u64 {
    prefill.map_or_else(|| metrics.computed_tokens(), PrefillCall::computed_tokens)
}

impl GenerateStream {
    /// Before the first token: that prefill computed the prompt (decode, once), else a
    /// progress report when one is due ([`Progress`]).
    fn poll_progress(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<proto::GenerateResponse, Status>>> {
        if self.decoding {
            return Poll::Pending;
        }
        if let Some(Poll::Ready(())) = self.prefill.as_mut().map(|call| call.poll_computed(cx))
            && !self.prefill_told
        {
            return Poll::Ready(Some(Ok(self.prefill_told())));
        }
        let (prefill, metrics) = (self.prefill.as_ref(), &self.metrics);
        self.progress
            .poll_report(cx, || computed_tokens(prefill, metrics))
            .map(|computed_tokens| {
                let progress = proto::PromptProgress { computed_tokens };
                Some(Ok(proto::GenerateResponse {
                    item: Some(Item::Progress(progress)),
                }))
            })
    }

    /// [`Item::PrefillDone`], once.
    fn prefill_told(&mut self) -> proto::GenerateResponse {
        self.prefill_told = true;
        proto::GenerateResponse {
            item: Some(Item::PrefillDone(proto::PrefillDone {})),
        }
    }

    fn finish(&mut self) {
        self.finished = true;
        self.guard.disarm();
        self.phase = Span::none();
    }
}
