//! The kinds of upstream a route can lead to, behind one interface: Bulkhead workers (gRPC
//! `Generate`) and OpenAI-compatible HTTP servers ([`openai`]). Both take the gateway's token
//! ids and answer with the worker protocol's tokens and `Done`, or a status coded like the
//! worker protocol's errors.

pub mod openai;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bulkhead_telemetry::{WORKER_RPC_SERVICE, propagation};
use bulkhead_worker::serve::cluster_token;
use bulkhead_worker::serve::proto::error_code_status;
use bulkhead_worker::serve::proto::{GenerateRequest, GenerateResponse};
use tonic::{Code, Status, Streaming};
use tracing::field::Empty;
use tracing::{Instrument as _, Span};

use crate::workers::ServedModel;

pub use openai::{OpenAiClient, SseStream, TokenCounter};

/// A client for one upstream; a cheap `Clone`.
#[derive(Debug, Clone)]
pub enum Upstream {
    /// A Bulkhead worker.
    Grpc(cluster_token::Client),
    /// An OpenAI-compatible HTTP server.
    OpenAi(Arc<OpenAiClient>),
}

/// A generation call not answered yet (on a busy worker, the request waits in its queue):
/// owned, so a request whose client left can still be held by it (see [`crate::policy`]).
pub type Call = Pin<Box<dyn Future<Output = Result<UpstreamStream, Status>> + Send>>;

/// The upstream side of a request: its call until the worker answers, then its stream.
#[expect(
    clippy::large_enum_variant,
    reason = "one per request, in place of the stream it becomes; boxing would allocate per request"
)]
pub enum Leg {
    Calling(Call),
    Streaming(UpstreamStream),
}

impl std::fmt::Debug for Leg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Leg::Calling(_) => f.write_str("Calling"),
            Leg::Streaming(s) => f.debug_tuple("Streaming").field(s).finish(),
        }
    }
}

/// A generation in progress on either kind of upstream.
#[derive(Debug)]
pub enum UpstreamStream {
    Grpc(Streaming<GenerateResponse>),
    OpenAi(SseStream),
}

impl Upstream {
    /// The client span of a generation on `worker` (named after the call, as OpenTelemetry's
    /// RPC and HTTP conventions have it); it lasts as long as the generation's stream.
    pub fn span(&self, worker: &str) -> Span {
        match self {
            Upstream::Grpc(_) => tracing::info_span!(
                "upstream",
                otel.name = format!("{WORKER_RPC_SERVICE}/Generate"),
                otel.kind = "client",
                rpc.system = "grpc",
                rpc.service = WORKER_RPC_SERVICE,
                rpc.method = "Generate",
                bulkhead.worker = worker,
                error.type = Empty,
                otel.status_code = Empty,
            ),
            Upstream::OpenAi(_) => tracing::info_span!(
                "upstream",
                otel.name = "POST /v1/completions",
                otel.kind = "client",
                http.request.method = "POST",
                bulkhead.worker = worker,
                error.type = Empty,
                otel.status_code = Empty,
            ),
        }
    }

    /// [`Upstream::generate`] as an owned call. A worker that takes it late may be queueing
    /// it: while `serving()` says its health checks answer, the call waits on (a queue's wait
    /// is bounded by the request's deadline, not by `idle`); one that has not taken it `idle`
    /// after its health checks stopped answering (stopped, or cut off without a reset) fails
    /// it as unavailable, as one that goes silent mid-answer does: without this, a request
    /// would wait for its whole request timeout and the worker would stay routed to.
    pub fn call(
        &self,
        request: GenerateRequest,
        span: &Span,
        model: &Arc<ServedModel>,
        idle: Duration,
        serving: impl Fn() -> bool + Send + 'static,
    ) -> Call {
        let (upstream, span, model) = (self.clone(), span.clone(), model.clone());
        Box::pin(async move {
            let generating = upstream.generate(request, &span, &model);
            tokio::pin!(generating);
            loop {
                match tokio::time::timeout(idle, &mut generating)
                    .instrument(span.clone())
                    .await
                {
                    Ok(answer) => return answer,
                    Err(_) if serving() => {}
                    Err(_) => {
                        return Err(Status::unavailable(
                            "the worker did not take the request, and its health checks stopped \
                             answering",
                        ));
                    }
                }
            }
        })
    }

    /// Starts a generation, passing `span`'s trace context on (gRPC metadata or HTTP headers).
    /// An OpenAI-compatible upstream that sends no usage has its completion counted with
    /// `model`'s tokenizer.
    async fn generate(
        &self,
        request: GenerateRequest,
        span: &Span,
        model: &Arc<ServedModel>,
    ) -> Result<UpstreamStream, Status> {
        match self {
            Upstream::Grpc(client) => {
                let mut client = client.clone();
                let mut request = tonic::Request::new(request);
                propagation::inject(span, request.metadata_mut().as_mut());
                Ok(UpstreamStream::Grpc(
                    client.generate(request).await?.into_inner(),
                ))
            }
            Upstream::OpenAi(client) => {
                let mut headers = http::HeaderMap::new();
                propagation::inject(span, &mut headers);
                let model = model.clone();
                let longest = model.tokenizer.longest_token_text();
                let counter = TokenCounter::new(longest, move |text| {
                    let ids = model.tokenizer.encode(text, false).ok()?;
                    u32::try_from(ids.len()).ok()
                });
                Ok(UpstreamStream::OpenAi(
                    client.generate(request, headers, counter).await?,
                ))
            }
        }
    }
}

impl UpstreamStream {
    /// Whether the worker reports its prompt's progress while it computes (a Bulkhead worker
    /// does, every half second); an OpenAI-compatible server says nothing before its first
    /// token, queued or computing.
    pub fn reports_progress(&self) -> bool {
        matches!(self, UpstreamStream::Grpc(_))
    }

    /// Whether the worker sends every token it generates as a message of its own (a Bulkhead
    /// worker does, its end-of-sequence token too); an OpenAI-compatible server's chunk may
    /// hold several, or none.
    pub fn sends_each_token(&self) -> bool {
        matches!(self, UpstreamStream::Grpc(_))
    }

    /// The next token or `Done`; `None` once the stream ended.
    pub async fn message(&mut self) -> Result<Option<GenerateResponse>, Status> {
        match self {
            UpstreamStream::Grpc(s) => s.message().await,
            UpstreamStream::OpenAi(s) => s.message().await,
        }
    }

    /// The completion tokens of the text received so far, when its messages do not say:
    /// an OpenAI-compatible server's chunk may hold several tokens (a stream interval, a
    /// speculative decoder), so a request that ends before `Done` is counted by its text, not
    /// its chunks. `None` for a Bulkhead worker, whose every token is a message of its own.
    pub fn generated(&self) -> Option<impl Future<Output = u32> + Send + 'static> {
        match self {
            UpstreamStream::Grpc(_) => None,
            UpstreamStream::OpenAi(s) => Some(s.generated()),
        }
    }

    /// [`UpstreamStream::generated`] where it can be counted on this thread now (a short
    /// text); `None` where it cannot, or need not be.
    pub fn generated_now(&self) -> Option<u32> {
        match self {
            UpstreamStream::Grpc(_) => None,
            UpstreamStream::OpenAi(s) => s.generated_now(),
        }
    }
}

/// The status of an answer the upstream broke (this request's: the worker or server stays
/// routed to).
pub(crate) fn broken(why: &str) -> Status {
    error_code_status(Code::Internal, why.to_owned(), "internal_error")
}
