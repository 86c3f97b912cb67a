//! Serving: the engine behind a gRPC API (`bulkhead.worker.v1.Worker`) and an admin HTTP port.
//!
//! ```text
//!  gRPC Generate/Info/Health ─▶ WorkerService ─┐ validate + tokenize (ValidGenerate)
//!                                              ▼
//!  admin /metrics /healthz ──────────────▶ EngineHandle ──commands──▶ engine thread (Engine)
//!                                              ▲                            │
//!                       GenerateStream ◀── events (per request) ◀───────────┘
//! ```
//!
//! Startup is two steps so a caller can report the bound addresses before traffic:
//! [`BoundWorker::bind`] loads the engine (measuring the KV pool and refusing a context longer
//! than it) and binds both ports; [`BoundWorker::serve`] runs until the shutdown future ends.

mod accepting;
mod actor;
mod admin;
pub mod cluster_token;
mod disagg;
mod error;
mod followed;
pub mod grpc_incoming;
pub mod info;
pub mod kv_advertise;
pub mod kvplane;
mod metrics;
mod progress;
pub mod proto;
mod refusal;
pub mod secret_file;
mod service;
mod spans;
mod tamper;
pub mod tls;
pub mod transport;
mod validate;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;

pub use actor::{CancelOnDrop, EngineHandle, EngineStats, EngineThread, Submission};
pub use cluster_token::{ClusterToken, SharedToken};
pub use disagg::PrefillPeer;
pub use error::{ServeError, ValidationError, codes, status};
pub use followed::RELOAD_EVERY;
pub use metrics::{Metrics, Outcome};
pub use service::{GenerateStream, ServiceRole, WorkerService};
pub use tls::ClusterTls;
pub use validate::{MAX_LABEL_BYTES, PromptSource, Prompter, ValidGenerate};

use crate::engine::{Capacity, Engine, EngineConfig, StartupError};
use crate::loader::LoadedModel;
use crate::tokenizer::{Tokenizer, TokenizerError};

/// Follows the cluster token's file and the TLS files, when there are any, for as long as it
/// runs (it never returns): a rotation or a renewal needs no restart.
pub async fn follow_secrets(token: Option<SharedToken>, tls: Option<ClusterTls>) -> Infallible {
    let token = async {
        if let Some(t) = token {
            t.follow(followed::RELOAD_EVERY).await;
        }
    };
    let tls = async {
        if let Some(t) = tls {
            t.follow(followed::RELOAD_EVERY).await;
        }
    };
    tokio::join!(token, tls);
    std::future::pending().await
}

/// The part a worker plays in serving.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RoleConfig {
    /// Prefill and decode in one process.
    Both,
    /// Prefill for decode workers; KV is written in batches of about `batch_bytes`. `fault`
    /// is for tests only.
    Prefill {
        batch_bytes: usize,
        fault: Option<kvplane::SendFault>,
    },
    /// Decode; prompts are prefilled by the worker at `prefill` (a gRPC URI), which sends the
    /// KV to this worker's data-plane listener at `kv_listen`, reached at `kv_advertise` (the
    /// listener's own address when `None`; a pod IP when it listens on 0.0.0.0).
    Decode {
        prefill: String,
        kv_listen: SocketAddr,
        kv_advertise: Option<kv_advertise::KvAdvertise>,
    },
}

/// What `bulkhead worker` serves and where.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub role: RoleConfig,
    /// The gRPC address; port 0 picks a free port.
    pub listen: SocketAddr,
    /// The admin HTTP address (`/metrics`, `/healthz`); port 0 picks a free port.
    pub admin_listen: SocketAddr,
    pub engine: EngineConfig,
    /// Prefill and decode roles: how long a data-plane peer that vanished can hold a
    /// connection (see [`kvplane::bound_peer`]).
    pub kv_peer_timeout: Duration,
    /// The deployment's shared secret: required on every gRPC call to this worker and
    /// presented on its own (see [`cluster_token`]), read again from its file while serving.
    /// `None` answers any caller.
    pub cluster_token: Option<SharedToken>,
    /// The deployment's mutual TLS, on the gRPC port, on decode's calls to prefill (whatever
    /// its URI's scheme says) and on the KV data plane (see [`tls`]). `None`: plain TCP.
    pub tls: Option<ClusterTls>,
}

/// Why the worker could not start or stopped serving.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Engine(#[from] StartupError),
    #[error("building the request tokenizer: {0}")]
    Tokenizer(#[from] TokenizerError),
    #[error("cannot listen on {addr} ({what}): {source}")]
    Bind {
        what: &'static str,
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot start the engine thread: {0}")]
    Thread(std::io::Error),
    #[error("the gRPC server failed: {0}")]
    Grpc(#[from] tonic::transport::Error),
    #[error("the admin server failed: {0}")]
    Admin(std::io::Error),
    #[error("the prefill address {uri:?} is not a valid URI: {reason}")]
    PrefillUri { uri: String, reason: String },
}

/// A worker with its engine running and its ports bound, not yet serving.
#[derive(Debug)]
pub struct BoundWorker {
    grpc: TcpListener,
    admin: TcpListener,
    /// Decode role: the KV data-plane listener.
    kv: Option<TcpListener>,
    kv_peer_timeout: Duration,
    /// The slowest transfer rate allowed, bytes/s: a frame begun is given its time at it.
    kv_floor: u64,
    /// The most data connections open at once ([`kvplane::max_connections`]).
    kv_max_connections: usize,
    /// Required on every gRPC call.
    cluster_token: Option<SharedToken>,
    tls: Option<ClusterTls>,
    service: WorkerService,
    engine: EngineHandle,
    thread: EngineThread,
    capacity: Capacity,
}

/// How long shutdown waits for the engine thread to wind down.
const ENGINE_STOP_LIMIT: Duration = Duration::from_secs(10);

impl BoundWorker {
    /// Starts the engine on `loaded` and binds both ports.
    pub async fn bind(config: ServeConfig, loaded: LoadedModel) -> Result<BoundWorker, StartError> {
        let LoadedModel {
            model,
            tokenizer,
            chat,
        } = loaded;
        let model_id = info::model_id(&model.config().name, model.gguf());
        // The file's template, compiled or not: a gateway that cannot compile it either tells
        // its clients why, where one told of no template could only say it has none. One
        // longer than any template is taken is not sent (nor would Info fit a probe's limit),
        // nor one the file holds as another type than text: why is, instead.
        let sent = (model.gguf().get_str("tokenizer.chat_template").ok())
            .filter(|source| source.len() <= crate::chat::SOURCE_MAX);
        let chat_refused = match (sent, &chat) {
            (None, Err(e)) if !matches!(e, crate::chat::ChatError::NoTemplate) => e.to_string(),
            _ => String::new(),
        };
        let chat_source = sent.unwrap_or_default();
        let proto_role = match config.role {
            RoleConfig::Both => proto::Role::Both,
            RoleConfig::Prefill { .. } => proto::Role::Prefill,
            RoleConfig::Decode { .. } => proto::Role::Decode,
        };
        let mut info = info::describe(&model, &tokenizer, chat_source, model_id, proto_role);
        info.chat_template_refused = chat_refused;
        let tokenizer_data = info::tokenizer_data(model.gguf());
        // The service tokenizes off the engine thread, so it gets its own tokenizer.
        let prompter = Prompter {
            tokenizer: Tokenizer::from_gguf(model.gguf())?,
            chat: chat.map_err(|e| e.to_string()),
        };

        let layout = model.kv_layout(config.engine.page_tokens.get() as usize);
        let kv_floor = config.engine.transfer_floor_bytes_per_s;
        let engine = Engine::new(model, tokenizer, config.engine)?;
        let capacity = engine.capacity();
        let kv_max_connections = kvplane::max_connections(capacity.pool_pages);
        info::set_capacity(&mut info, capacity);
        let batch_bytes = match config.role {
            RoleConfig::Prefill { batch_bytes, .. } => Some(batch_bytes),
            RoleConfig::Both | RoleConfig::Decode { .. } => None,
        };
        info::set_handoff(&mut info, &engine, &layout, batch_bytes);

        let bind = |what, addr| async move {
            TcpListener::bind(addr)
                .await
                .map_err(|source| StartError::Bind { what, addr, source })
        };
        let grpc = bind("gRPC", config.listen).await?;
        let admin = bind("admin", config.admin_listen).await?;

        let (engine, thread) = EngineHandle::spawn(engine, Arc::new(Metrics::default()))
            .map_err(StartError::Thread)?;
        let (role, kv) = match config.role {
            RoleConfig::Both => (ServiceRole::Both, None),
            RoleConfig::Prefill { batch_bytes, fault } => {
                let options = kvplane::SendOptions {
                    batch_bytes,
                    peer_timeout: config.kv_peer_timeout,
                    floor_bytes_per_s: kv_floor,
                    fault,
                    tls: config.tls.clone(),
                };
                (ServiceRole::Prefill(options), None)
            }
            RoleConfig::Decode {
                prefill,
                kv_listen,
                kv_advertise,
            } => {
                let kv = bind("KV data", kv_listen).await?;
                let kv_address = kv.local_addr().map_err(|source| StartError::Bind {
                    what: "KV data",
                    addr: kv_listen,
                    source,
                })?;
                let seen = disagg::SeenPeer::new(&prefill);
                let endpoint = tls::endpoint(&prefill, config.tls.as_ref())
                    .map_err(|e| StartError::PrefillUri {
                        uri: prefill,
                        reason: e.to_string(),
                    })?
                    .alive_within(config.kv_peer_timeout);
                let client = cluster_token::shared_client(
                    endpoint.connect_lazy(),
                    config.cluster_token.clone(),
                );
                (
                    ServiceRole::Decode(PrefillPeer {
                        client,
                        kv_address: kv_advertise
                            .map_or(kv_address, |a| a.at(kv_address))
                            .to_string(),
                        seen,
                        model_id: info.model_id.clone(),
                    }),
                    Some(kv),
                )
            }
        };
        let service = WorkerService::new(role, engine.clone(), prompter, info, tokenizer_data);
        Ok(BoundWorker {
            grpc,
            admin,
            kv,
            kv_peer_timeout: config.kv_peer_timeout,
            kv_floor,
            kv_max_connections,
            cluster_token: config.cluster_token,
            tls: config.tls,
            service,
            engine,
            thread,
            capacity,
        })
    }

    /// The bound gRPC address.
    pub fn grpc_addr(&self) -> std::io::Result<SocketAddr> {
        self.grpc.local_addr()
    }

    /// Decode role: the bound KV data-plane address.
    pub fn kv_addr(&self) -> Option<std::io::Result<SocketAddr>> {
        self.kv.as_ref().map(TcpListener::local_addr)
    }

    /// The bound admin HTTP address.
    pub fn admin_addr(&self) -> std::io::Result<SocketAddr> {
        self.admin.local_addr()
    }

    /// The measured pool and the served context.
    pub fn capacity(&self) -> Capacity {
        self.capacity
    }

    /// Serves both ports until `shutdown` completes or either server fails.
    pub async fn serve(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), StartError> {
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            shutdown.await;
            let _ = stop_tx.send(true);
        });
        let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
            // An error means the sender is gone, which also means stop.
            let _ = rx.wait_for(|stop| *stop).await;
        };
        let kv = {
            let (listener, engine, stop) = (self.kv, self.engine.clone(), stopped(stop_rx.clone()));
            let (peer_timeout, tls) = (self.kv_peer_timeout, self.tls.clone());
            // No frame is longer than one of this worker's pages.
            let max_frame = u32::try_from(self.capacity.page_bytes).unwrap_or(u32::MAX);
            let limits = kvplane::Limits::new(peer_timeout, max_frame, self.kv_floor);
            let max_connections = self.kv_max_connections;
            async move {
                match listener {
                    Some(l) => tokio::select! {
                        never = kvplane::serve(l, engine, max_frame, limits, max_connections, tls) => match never {},
                        () = stop => (),
                    },
                    None => std::future::pending().await,
                }
            }
        };
        // The cluster token and the TLS files are followed for as long as the worker serves.
        let follows = follow_secrets(self.cluster_token.clone(), self.tls.clone());
        let peer = self.service.follow_peer();
        let (limits, counts) = (
            grpc_incoming::Limits::WORKER,
            self.engine.metrics().grpc_connections().clone(),
        );
        let admin = axum::serve(self.admin, admin::router(self.engine, self.tls.clone()))
            .with_graceful_shutdown(stopped(stop_rx.clone()));
        // A peer gone without a reset (a host lost, a partition) held its connection — and,
        // vouched for, one of the bounded places — for good: nothing is sent on an idle one.
        // Pinged every third of the peer timeout, it is closed when a ping goes unanswered.
        let ping = (self.kv_peer_timeout / 3).max(Duration::from_secs(1));
        let grpc = tonic::transport::Server::builder()
            .http2_keepalive_interval(Some(ping))
            .http2_keepalive_timeout(Some(ping))
            .add_service(proto::WorkerServer::with_interceptor(
                self.service,
                cluster_token::Requires(self.cluster_token),
            ));
        let grpc: Pin<Box<dyn Future<Output = Result<(), tonic::transport::Error>> + Send>> =
            match &self.tls {
                Some(tls) => Box::pin(grpc.serve_with_incoming_shutdown(
                    tls.grpc_incoming(self.grpc, limits, counts),
                    stopped(stop_rx),
                )),
                // Tokens stream one small message each: not held back for Nagle's algorithm
                // (a listener of one's own gets none of the builder's socket settings). The TLS
                // listener sets it as it accepts.
                None => Box::pin(grpc.serve_with_incoming_shutdown(
                    grpc_incoming::incoming(self.grpc, limits, counts, |socket| async move {
                        socket.set_nodelay(true).map(|()| socket)
                    }),
                    stopped(stop_rx),
                )),
            };
        let result = tokio::select! {
            r = grpc => r.map_err(StartError::from),
            r = admin => r.map_err(StartError::Admin),
            () = kv => Ok(()),
            never = follows => match never {},
            never = peer => match never {},
        };
        // Both servers (and so every handle but in-flight streams') are gone; the engine thread
        // ends once the last request is cancelled or done.
        let join = tokio::task::spawn_blocking(move || self.thread.join());
        if tokio::time::timeout(ENGINE_STOP_LIMIT, join).await.is_err() {
            tracing::warn!("the engine thread is still running at shutdown");
        }
        result
    }
}
