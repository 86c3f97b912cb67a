//! The kinds of upstream a route can lead to, behind one interface: Bulkhead workers (gRPC
//! `Generate`) and OpenAI-compatible HTTP servers ([`openai`]). Both take the gateway's token
//! ids and answer with the worker protocol's tokens and `Done`, or a status coded like the
//! worker protocol's errors.

pub mod openai;

use std::sync::Arc;

use bulkhead_worker::serve::proto::{GenerateRequest, GenerateResponse, WorkerClient};
use tonic::transport::Channel;
use tonic::{Status, Streaming};

pub use openai::{OpenAiClient, SseStream};

/// A client for one upstream; a cheap `Clone`.
#[derive(Debug, Clone)]
pub enum Upstream {
    /// A Bulkhead worker.
    Grpc(WorkerClient<Channel>),
    /// An OpenAI-compatible HTTP server.
    OpenAi(Arc<OpenAiClient>),
}

/// A generation in progress on either kind of upstream.
#[derive(Debug)]
pub enum UpstreamStream {
    Grpc(Streaming<GenerateResponse>),
    OpenAi(SseStream),
}

impl Upstream {
    /// Starts a generation.
    pub async fn generate(&self, request: GenerateRequest) -> Result<UpstreamStream, Status> {
        match self {
            Upstream::Grpc(client) => {
                let mut client = client.clone();
                Ok(UpstreamStream::Grpc(
                    client.generate(request).await?.into_inner(),
                ))
            }
            Upstream::OpenAi(client) => Ok(UpstreamStream::OpenAi(client.generate(request).await?)),
        }
    }
}

impl UpstreamStream {
    /// The next token or `Done`; `None` once the stream ended.
    pub async fn message(&mut self) -> Result<Option<GenerateResponse>, Status> {
        match self {
            UpstreamStream::Grpc(s) => s.message().await,
            UpstreamStream::OpenAi(s) => s.message().await,
        }
    }
}
