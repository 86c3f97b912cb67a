//! Startup and serving: bind both listeners (so a caller can print the bound addresses before
//! traffic), read every worker once, then serve until shutdown.

use std::future::Future;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use bulkhead_telemetry::AuditExport;
use bulkhead_worker::serve::tls::ListenerTls;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;

use crate::admin::{self, AdminState};
use crate::api::{self, ApiState};
use crate::config::{Config, HttpLimits};
use crate::discovery::{self, SystemResolver, WorkerGroup};
use crate::limits::Limiter;
use crate::metrics::Metrics;
use crate::policy::{Policies, PolicyError};
use crate::serving::{self, Edge, Witness};
use crate::tenants::{ConfigFile, ServedFile, Tenants};
use crate::trail::{Recorder, Watch};
use crate::workers::{EndpointError, Workers};

/// The admin port's connections open at once: an operator's tools, never a crowd; a flood of
/// API connections never takes them (each listener has its own places).
const ADMIN_CONNECTIONS: std::num::NonZeroUsize = std::num::NonZeroUsize::MIN.saturating_add(63);

/// Where the gateway keeps its audit log in `data_dir`.
pub fn audit_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("audit")
}

/// Why the gateway could not start.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error("cannot listen on {addr} ({what}): {source}")]
    Bind {
        what: &'static str,
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error(transparent)]
    Endpoint(#[from] EndpointError),
    #[error("cannot open the audit log in {dir}: {source}")]
    Audit {
        dir: String,
        source: bulkhead_audit::AuditError,
    },
    #[error("policies: {0}")]
    Policy(#[from] PolicyError),
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error(transparent)]
    Tenants(#[from] crate::tenants::StartError),
}

/// What a gateway is made with before its audit log opens: both listeners bound, its policy
/// set loaded. `bulkhead up` makes it before it starts the workers, so that a busy port or a
/// set that does not load is said at once, and the ports stay its own while the models load
/// (checked and let go, another process could take one meanwhile).
#[derive(Debug)]
pub struct Prepared {
    api: std::net::TcpListener,
    admin: std::net::TcpListener,
    policies: Policies,
}

impl Prepared {
    /// Binds `config`'s two listeners and loads its policy set (blocking: compiles the
    /// components that are not cached).
    pub fn new(config: &Config) -> Result<Prepared, GatewayError> {
        let bind =
            |what, addr| listener(addr).map_err(|source| GatewayError::Bind { what, addr, source });
        let api = bind("API", config.listen.api)?;
        let admin = bind("admin", config.listen.admin)?;
        let policies = match config.policies.clone() {
            None => Policies::disabled(),
            Some(settings) => Policies::load(settings)?,
        };
        Ok(Prepared {
            api,
            admin,
            policies,
        })
    }
}

/// A listening socket at `addr`, as tokio's `TcpListener::bind` makes one: the address
/// reusable at once after a restart, a backlog of 1024, closed on exec (as every socket2
/// socket: the workers `up` starts do not hold it). Listening from here on: bound but not
/// listening, the port could be bound and listened on by another process that sets
/// `SO_REUSEADDR` too (Linux lets it then), and taken while the models load.
fn listener(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    Ok(socket.into())
}

/// A gateway with both listeners bound, not yet serving.
#[derive(Debug)]
pub struct BoundGateway {
    api: TcpListener,
    admin: TcpListener,
    api_router: Router,
    admin_router: Router,
    workers: Workers,
    metrics: Metrics,
    recorder: Recorder,
    policies: Policies,
    tenants: Tenants,
    refresh_interval: Duration,
    http: HttpLimits,
    /// Workers found through DNS, re-resolved every refresh interval.
    groups: Vec<WorkerGroup>,
    /// Threads serving API connections (see [`crate::serving`]).
    threads: NonZeroUsize,
    /// Both listeners' TLS, when they take only TLS connections.
    tls: Option<ListenerTls>,
}

impl BoundGateway {
    /// Opens the audit log in `data_dir/audit`, binds both listeners and builds the routers;
    /// contacts no worker yet. With `audit_export`, every audit record is also exported as an
    /// OpenTelemetry log record (see [`crate::config::TelemetrySettings`]). `file` is where
    /// `config` came from, which tenants reloads read again (`None`: they are refused).
    pub async fn bind(
        config: Config,
        file: Option<ConfigFile>,
        data_dir: &Path,
        audit_export: Option<AuditExport>,
    ) -> Result<BoundGateway, GatewayError> {
        // Compiling components takes a while: off the async threads.
        let (prepared, config) =
            tokio::task::spawn_blocking(move || (Prepared::new(&config), config))
                .await
                .map_err(|_| GatewayError::Policy(PolicyError::Disabled))?;
        Self::bind_prepared(config, file, data_dir, audit_export, prepared?).await
    }

    /// [`BoundGateway::bind`] on the listeners and policy set of `prepared`, made from `config`.
    pub async fn bind_prepared(
        config: Config,
        file: Option<ConfigFile>,
        data_dir: &Path,
        audit_export: Option<AuditExport>,
        prepared: Prepared,
    ) -> Result<BoundGateway, GatewayError> {
        let metrics = Metrics::default();
        let audit_dir = audit_dir(data_dir);
        let key = config.audit.chain_key()?;
        let settings = config.audit.clone();
        let (recorder, recoveries) =
            Recorder::open(&audit_dir, settings, key, metrics.clone(), audit_export).map_err(
                |source| GatewayError::Audit {
                    dir: audit_dir.display().to_string(),
                    source,
                },
            )?;
        for r in recoveries {
            tracing::warn!(recovery = ?r, "the audit log cut, set aside or listed what it could not resume (a crash's leftovers, or in a keyed log lines whose link does not verify; a set-aside file is reported by `bulkhead audit verify` until removed)");
        }
        let Prepared {
            api,
            admin,
            policies,
        } = prepared;
        let listening = |what, listener: std::net::TcpListener, addr| {
            listener
                .set_nonblocking(true)
                .and_then(|()| TcpListener::from_std(listener))
                .map_err(|source| GatewayError::Bind { what, addr, source })
        };
        let api = listening("API", api, config.listen.api)?;
        let admin = listening("admin", admin, config.listen.admin)?;
        let tls = config.listener_tls()?;
        if let Some(tls) = &tls {
            // Followed for as long as the runtime runs.
            tokio::spawn(tls.clone().follow(bulkhead_worker::serve::RELOAD_EVERY));
        }
        let cluster = config.cluster_access()?;
        // Followed for as long as the runtime runs.
        tokio::spawn(bulkhead_worker::serve::follow_secrets(
            cluster.token.clone(),
            cluster.tls.clone(),
        ));
        let cluster_tls = cluster.tls.clone();
        let workers = Workers::new(&config.workers, cluster)?;
        let tenants = Tenants::new(config.tenants, Limiter::default(), file);
        tenants.audited_by(recorder.clone(), ServedFile::in_dir(data_dir))?;
        for warning in admin::stray_tenants(&policies, &tenants) {
            tracing::warn!("policies: {warning}");
        }
        let api_router = api::router(ApiState {
            workers: workers.clone(),
            tenants: tenants.clone(),
            metrics: metrics.clone(),
            http: config.http,
            recorder: recorder.clone(),
            policies: policies.clone(),
            client_trace: config.telemetry.client_trace,
        });
        let admin_router = admin::router(
            AdminState {
                workers: workers.clone(),
                metrics: metrics.clone(),
                tenants: tenants.clone(),
                recorder: recorder.clone(),
                policies: policies.clone(),
                tls: tls.clone(),
                cluster_tls,
            },
            config.admin_token,
        );
        Ok(BoundGateway {
            api,
            admin,
            api_router,
            admin_router,
            workers,
            metrics,
            recorder,
            policies,
            tenants,
            refresh_interval: config.refresh_interval,
            http: config.http,
            groups: config.worker_groups,
            threads: NonZeroUsize::MIN,
            tls,
        })
    }

    /// Serves the API on `threads` threads (see [`crate::serving`]); default one.
    pub fn serving_threads(mut self, threads: NonZeroUsize) -> BoundGateway {
        self.threads = threads;
        self
    }

    pub fn api_addr(&self) -> std::io::Result<SocketAddr> {
        self.api.local_addr()
    }

    pub fn admin_addr(&self) -> std::io::Result<SocketAddr> {
        self.admin.local_addr()
    }

    /// The workers' registry (what `/workers` shows).
    pub fn workers(&self) -> &Workers {
        &self.workers
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// The policy plugins (what `/policies` shows).
    pub fn policies(&self) -> &Policies {
        &self.policies
    }

    /// What cuts the requests still running once the gateway drains, without waiting for the
    /// drain timeout: each tells its client (an error event ends a stream) and is recorded as
    /// cut by shutdown, as at the timeout, and the drain ends with the audit log flushed.
    pub fn cutter(&self) -> impl FnOnce() + Send + 'static {
        let recorder = self.recorder.clone();
        move || Witness::cut(&recorder)
    }

    /// The tenants, their keys and limits (what `/tenants` shows and reloads).
    pub fn tenants(&self) -> &Tenants {
        &self.tenants
    }

    /// Reads every worker once (so the first request finds the model registered when the
    /// workers are up), then serves until `shutdown` completes.
    pub async fn serve(self, shutdown: impl Future<Output = ()> + Send + 'static) {
        discovery::sync(&self.workers, &self.groups, &SystemResolver).await;
        self.workers.refresh().await;
        let refresh = self.workers.spawn_refresh(self.refresh_interval);
        let discover = (!self.groups.is_empty()).then(|| {
            discovery::spawn_sync(
                &self.workers,
                self.groups.clone(),
                SystemResolver,
                self.refresh_interval,
            )
        });
        let watch = self.policies.spawn_watch();
        let hangup = self.tenants.spawn_reload_on_hangup();
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            shutdown.await;
            let _ = stop_tx.send(true);
        });
        // Every API request is recorded, even one hyper drops before the router runs it.
        let api_service = Watch::new(
            TowerToHyperService::new(self.api_router),
            self.recorder.clone(),
            self.tenants.clone(),
        );
        // Requests still running when the drain timeout ends are recorded as cut by shutdown,
        // not as left by their clients; those hyper cannot parse, as such.
        let api = serving::serve(
            self.api,
            api_service,
            Edge {
                limits: self.http,
                tls: self.tls.clone(),
            },
            self.threads,
            stop_rx.clone(),
            Arc::new(ApiWitness {
                recorder: self.recorder.clone(),
                policies: self.policies.clone(),
            }),
        );
        let admin = serving::serve(
            self.admin,
            TowerToHyperService::new(self.admin_router),
            Edge {
                limits: HttpLimits {
                    max_connections: ADMIN_CONNECTIONS,
                    ..self.http
                },
                tls: self.tls,
            },
            NonZeroUsize::MIN,
            stop_rx,
            Arc::new(()),
        );
        tokio::join!(api, admin);
        refresh.abort();
        if let Some(d) = discover {
            d.abort();
        }
        if let Err(e) = self.recorder.flush() {
            tracing::error!(error = %e, "the audit log's last records could not be flushed");
        }
        if let Some(watch) = watch {
            watch.abort();
        }
        if let Some(hangup) = hangup {
            hangup.abort();
        }
    }
}

/// What the API listener tells of the requests it does not finish itself: the audit trail
/// records them, and shutdown waits for the ends the policies run after their connections
/// (held streams, `on-response-end`).
struct ApiWitness {
    recorder: Recorder,
    policies: Policies,
}

impl Witness for ApiWitness {
    fn cut(&self) {
        self.recorder.cut();
    }

    fn unparsed(&self, status: u16) {
        self.recorder.unparsed(status);
    }

    fn plain_http(&self) {
        self.recorder.plain_http();
    }

    fn settled(&self) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(self.policies.ended())
    }
}
