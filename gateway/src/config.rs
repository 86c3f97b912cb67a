//! The gateway's configuration: a TOML file, parsed and validated at start into [`Config`].
//! Nothing downstream re-checks it, and nothing downstream reads the environment. A tenants
//! reload ([`crate::tenants`]) reads the file again through this same parser and applies only
//! its tenants.
//!
//! ```toml
//! [listen]
//! api = "127.0.0.1:8080"
//! admin = "127.0.0.1:9090"
//! tls_cert = "/run/tls/api.pem"     # optional, with tls_key: both listeners take only TLS
//! tls_key = "/run/tls/api.key"      # (1.2 or 1.3), with this certificate (chain) and key;
//!                                   # read again every 5 s, so a renewal needs no restart
//! tls_client_ca = "/run/tls/cl.pem" # optional: clients must also present a certificate
//!                                   # this CA signed (the API key still names the tenant)
//!
//! [admin]
//! token_sha256 = "…64 hex…"        # sha256 of the admin bearer token
//!
//! [http]                            # optional; these are the defaults
//! max_body_bytes = 1048576
//! request_timeout_secs = 300
//! header_timeout_secs = 10
//! body_timeout_secs = 30            # a request body not whole this long after its head: 408
//! write_stall_timeout_secs = 30     # a client that takes no byte of its answer this long is gone
//! stream_idle_timeout_secs = 120    # a worker silent this long mid-answer has failed it
//! drain_timeout_secs = 10           # at shutdown, requests still running this long are cut
//! max_connections = 10000           # API connections open at once; past it new ones wait in
//!                                   # the listen backlog (and at most what descriptors allow)
//! default_max_tokens = 512         # a chat completion's, when it names none
//! default_completion_max_tokens = 16  # a (legacy) completion's: OpenAI's default
//!
//! [audit]                           # optional; these are the defaults
//! durability = "durable"            # or "group": answer before the record's fsync
//! on_failure = "refuse"             # or "serve": keep serving while the log is broken
//! segment_bytes = 67108864
//! gateway_records_per_minute = 3000 # records of requests with no valid key, each; past that
//!                                   # they are counted in one folded record a second
//! unread_records_per_minute = 3000  # the same in each tenant's log, for its requests that
//!                                   # ended before a prompt was counted (over its limits,
//!                                   # GET /v1/models, an unknown route, a malformed body)
//! key_file = "/run/secrets/bulkhead-audit-key"  # optional: keyed logs (HMAC-SHA256 links,
//!                                   # sealed heads and roster); the file's first line is the
//!                                   # secret, 32 bytes at least. Read at start; a keyed log
//!                                   # opens only with its key, an unkeyed one only without
//!
//! [telemetry]                       # optional; OpenTelemetry export is off without it
//! otlp_endpoint = "http://127.0.0.1:4318"  # a collector (OTLP over HTTP/protobuf); spans go
//!                                   # to /v1/traces. OTEL_EXPORTER_OTLP_ENDPOINT overrides it
//! audit_logs = false                # also export each audit record as a log record (/v1/logs)
//! client_trace = "link"             # a client's traceparent: "link" (the request's trace is
//!                                   # the gateway's own, linked to the client's span) or
//!                                   # "continue" (its child, when sampled: clients you trust)
//!
//! [cluster]                         # optional; the workers' shared secret
//! token_file = "/run/secrets/bulkhead-cluster-token"  # presented on every call to a worker
//!                                   # (`bulkhead worker --cluster-token-file`, the same file)
//! tls_ca = "/run/tls/ca.pem"        # optional, all three or none: mutual TLS to every worker
//! tls_cert = "/run/tls/gateway.pem" # (`bulkhead worker --tls-ca --tls-cert --tls-key`): the
//! tls_key = "/run/tls/gateway.key"  # deployment's CA, the gateway's certificate and key
//!
//! [[tenants]]
//! id = "tenant-a"                   # a-z 0-9 - _; ids starting with '_' are reserved
//! key_sha256 = ["…64 hex…"]         # sha256 of each API key; never the key itself
//! max_context = 8192
//! max_concurrent = 4
//! requests_per_minute = 120
//! tokens_per_minute = 200000
//! capture_content = false           # store prompts and completions in the audit log
//! reuse_id = false                  # a reload or start may add this id though its audit log has records
//!
//! [[workers]]
//! name = "local"
//! grpc = "http://127.0.0.1:50051"  # with [cluster] tls_*, dialled over TLS whatever the
//! role = "both"                     # scheme (https:// only then)
//!
//! [[workers]]                       # an OpenAI-compatible HTTP server (vLLM, llama.cpp, …)
//! name = "vllm"
//! openai = "http://10.0.0.7:8000"
//! role = "both"
//! model = "smollm2"                 # the model name the server answers to (sent upstream;
//!                                   # clients name the model as /v1/models lists it, the
//!                                   # tokenizer GGUF's name)
//! context_length = 8192             # what it serves (the gateway admits against it)
//! tokenizer = "/models/m.gguf"      # the same model's GGUF: tokenizer and chat template
//! key_env = "VLLM_API_KEY"          # optional: the variable holding the server's key
//! cache_salt = true                 # each tenant's requests carry a salt of their own, so the
//!                                   # server's prefix cache is shared only within a tenant
//!                                   # (false for a server that refuses the field)
//! report_cached_tokens = false      # pass the server's count of cached prompt tokens on:
//!                                   # only for one known to keep its cache per salt (a
//!                                   # server that ignores the field shares it)
//! [policies]                        # optional: no policy plugins without it
//! file = "policies/local.toml"      # paths relative to the working directory
//! cache_dir = "plugins/dist/cache"  # compiled components (optional: compile at each load)
//! cache_max_mib = 1024              # the cache's bound, least recently used evicted first
//! watch_secs = 2                    # reload when the file changes (0: admin call only)
//! hold_limit_secs = 30              # longest an abandoned request is kept, deciding included
//! max_held_per_tenant = 16          # abandoned requests one tenant may have held at once
//! instances = 64                    # plugin instances alive at once (at most 10 000)
//! max_memory_mib = 256              # the most memory any plugin may be given
//! ```
//!
//! Instead of (or besides) `[[workers]]`, `[[worker_groups]]` name DNS names that resolve to
//! many workers (Kubernetes headless Services): see [`crate::discovery`].

use std::collections::HashSet;
use std::net::SocketAddr;
use std::num::{NonZeroU32, NonZeroU64, NonZeroUsize};
use std::path::{Path, PathBuf};
use std::time::Duration;

use bulkhead_audit::{ChainKey, KeyError};
use bulkhead_telemetry::{OtlpEndpoint, TelemetryError};
use bulkhead_worker::serve::cluster_token::{SharedToken, TokenError};
use bulkhead_worker::serve::tls::{
    self, ClusterTls, EndpointError, ListenerFiles, ListenerTls, Part, TlsError, TlsFiles,
    TlsSettings,
};
use serde::Deserialize;

use crate::discovery::{GroupError, RawWorkerGroup, WorkerGroup};
use crate::keys::{KeyHash, KeyHashError};
use crate::policy::{PolicySettings, SandboxSettings};
use crate::tenant::{Tenant, TenantId, TenantIdError, TenantLimits};
use crate::tenants::{TenantSet, TenantSetBuilder};
use crate::toml_errors::{self, TomlError};

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub listen: Listen,
    /// The admin listener's bearer token, hashed.
    pub admin_token: KeyHash,
    pub http: HttpLimits,
    pub audit: AuditSettings,
    /// The tenants, their limits and their keys (the only part a running gateway reloads:
    /// [`crate::tenants`]).
    pub tenants: TenantSet,
    /// Names are unique across workers and groups; at least one worker or group.
    pub workers: Vec<WorkerConfig>,
    /// Workers found through DNS, re-resolved every `refresh_interval`.
    pub worker_groups: Vec<WorkerGroup>,
    /// How often the gateway re-reads every worker's Info and Health.
    pub refresh_interval: Duration,
    /// Policy plugins; `None`: none run.
    pub policies: Option<PolicySettings>,
    /// OpenTelemetry export.
    pub telemetry: TelemetrySettings,
    /// How the gateway reaches its Bulkhead workers ([`Config::cluster_access`]).
    pub cluster: ClusterSettings,
}

/// Where the gateway's credentials towards its workers lie (`[cluster]`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClusterSettings {
    /// The file holding the secret presented on every gRPC call to a worker; `None`: calls
    /// carry none, and only workers without one answer them.
    pub token_file: Option<PathBuf>,
    /// The deployment's mutual TLS; `None`: calls go over plain TCP.
    pub tls: Option<TlsSettings>,
}

/// The gateway's credentials towards its Bulkhead workers, read and checked.
#[derive(Debug, Clone, Default)]
pub struct ClusterAccess {
    /// Presented on every call; read again from its file while the gateway serves.
    pub token: Option<SharedToken>,
    /// Every call goes over TLS, to workers the CA signed, presenting the gateway's certificate.
    pub tls: Option<ClusterTls>,
}

/// OpenTelemetry export: off unless a collector is named here or by the process's flags and
/// environment (which override this).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TelemetrySettings {
    /// The collector's base URL (OTLP over HTTP/protobuf).
    pub otlp_endpoint: Option<OtlpEndpoint>,
    /// Export each final audit record as an OpenTelemetry log record as well (it stays in the
    /// tenant's log either way; captured content is never exported).
    pub audit_logs: bool,
    /// What a client's `traceparent` does to its request's trace.
    pub client_trace: ClientTrace,
}

/// What a client's W3C `traceparent` does to its request's trace.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ClientTrace {
    /// The request's trace is the gateway's own, sampled as the gateway samples; its span
    /// links to the client's. A context read before authentication cannot put a request's
    /// spans into another tenant's trace, nor decide their sampling.
    #[default]
    Link,
    /// The request's span is the child of the client's, when the client's is sampled: for
    /// clients (a proxy in front) whose traces the operator trusts.
    Continue,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listen {
    pub api: SocketAddr,
    pub admin: SocketAddr,
    /// Both listeners take only TLS connections, with this certificate; `None`: plain HTTP.
    pub tls: Option<ListenerFiles>,
}

/// Limits of the HTTP edge, the same for every tenant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// Larger request bodies get 413 before they are parsed.
    pub max_body_bytes: usize,
    /// A request that has not produced its response (its headers, when streaming) by then gets
    /// 504 `timeout`.
    pub request_timeout: Duration,
    /// A client that has not sent its request headers by then is disconnected (slowloris).
    pub header_timeout: Duration,
    /// A request body not whole this long after its handler started reading it gets 408:
    /// a client that trickles its body does not hold its tenant's concurrency slot for the
    /// whole request timeout.
    pub body_timeout: Duration,
    /// A client that takes no byte of its response for this long (a stream it stopped reading,
    /// its socket still open) is disconnected, and its request ends as a client disconnect —
    /// rather than holding its tenant's concurrency slot and its route's outstanding tokens
    /// for as long as the socket stays open ([`crate::write_deadline`]).
    pub write_stall_timeout: Duration,
    /// A worker (or upstream) that sends nothing for this long once it has taken a request —
    /// not a progress report, not a token, not its end —, or has not taken it this long after
    /// its health checks stopped answering, has failed it: the client gets an error (an error
    /// event when streaming), never an endless wait behind keep-alive comments. Bulkhead
    /// workers report the prompt's progress until its first token, so against them it must
    /// cover one step of prompt computation; an OpenAI-compatible upstream says nothing before
    /// its first token, so against one it must cover the longest prefill.
    pub stream_idle_timeout: Duration,
    /// At shutdown, how long requests in flight get to finish; those still running then are
    /// cut, and recorded as `gateway_shutdown`.
    pub drain_timeout: Duration,
    /// The most connections the listener holds open at once; past it, new ones wait in the
    /// kernel's listen backlog until one closes. It is lowered to what the process's limit on
    /// open descriptors leaves ([`crate::descriptors::connection_room`]): descriptors run out,
    /// every accept, upstream connection and audit file would fail instead.
    pub max_connections: NonZeroUsize,
    /// `max_tokens` when a chat completion does not say (clamped to what is left of the
    /// limit, and of the tenant's minute of tokens beside the prompt).
    pub default_max_tokens: NonZeroU32,
    /// The same for a (legacy) completion: 16, as OpenAI's API and the servers that follow it
    /// (vLLM, SGLang) default it, so a client that names none gets the short continuation it
    /// expects, not a chat's answer.
    pub default_completion_max_tokens: NonZeroU32,
}

impl Default for HttpLimits {
    fn default() -> HttpLimits {
        HttpLimits {
            max_body_bytes: 1 << 20,
            request_timeout: Duration::from_secs(300),
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            write_stall_timeout: Duration::from_secs(30),
            stream_idle_timeout: Duration::from_secs(120),
            drain_timeout: Duration::from_secs(10),
            max_connections: NonZeroUsize::MIN.saturating_add(9_999),
            default_max_tokens: NonZeroU32::MIN.saturating_add(511),
            default_completion_max_tokens: NonZeroU32::MIN.saturating_add(15),
        }
    }
}

/// How the audit log trades latency for durability, what happens when it cannot write, and
/// whether it is keyed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditSettings {
    /// Whether a response waits until its record is fsynced.
    pub durability: Durability,
    /// What the gateway does while the audit log cannot write.
    pub on_failure: OnAuditFailure,
    /// Segment size before rotation.
    pub segment_bytes: u64,
    /// Requests with no tenant to charge that get a record of their own, per minute; past
    /// that, each is counted in a folded record (`trail::fold`).
    pub gateway_records_per_minute: u64,
    /// A tenant's requests that ended before a prompt of theirs was counted (refused by its
    /// limits, a model listing, an unknown route, a malformed body) that get a record of their
    /// own, per minute and tenant; past that, each is counted in a folded record.
    pub unread_records_per_minute: u64,
    /// The file whose first line is the key of a keyed log (`None`: unkeyed). Read by
    /// [`AuditSettings::chain_key`] where the log is opened, as the cluster token is.
    pub key_file: Option<PathBuf>,
}

impl AuditSettings {
    /// The key of a keyed log, read from `key_file` now; `None` without one.
    pub fn chain_key(&self) -> Result<Option<ChainKey>, ConfigError> {
        let Some(path) = &self.key_file else {
            return Ok(None);
        };
        ChainKey::read(path)
            .map(Some)
            .map_err(|source| ConfigError::AuditKey {
                path: path.display().to_string(),
                source,
            })
    }
}

impl Default for AuditSettings {
    fn default() -> AuditSettings {
        AuditSettings {
            durability: Durability::Durable,
            on_failure: OnAuditFailure::Refuse,
            segment_bytes: 64 << 20,
            gateway_records_per_minute: 3000,
            unread_records_per_minute: 3000,
            key_file: None,
        }
    }
}

/// Whether a response waits for its audit record to be durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Durability {
    /// Every response (and a stream's `[DONE]`) waits until its record is fsynced: nothing
    /// answered is ever missing from the log after a crash.
    Durable,
    /// Records are fsynced in groups within a few milliseconds; a crash can lose the records of
    /// the last moments' responses (never a durable one): while the fsyncs are more than
    /// 50 ms behind, responses wait for their records as in durable mode.
    Group,
}

/// What the gateway does while its audit log cannot write (disk full, I/O error).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnAuditFailure {
    /// Refuse new requests with 503 `audit_unavailable`: no unaudited traffic.
    Refuse,
    /// Keep serving, unaudited, and say so in health and metrics.
    Serve,
}

/// What a worker does. Requests are routed to `both` and `decode` workers; a decode worker
/// names the prefill worker that fills its pages, and both bound the context it serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkerRole {
    Both,
    Prefill,
    Decode,
}

impl WorkerRole {
    /// The role as configured and reported: `both`, `prefill` or `decode`.
    pub fn name(self) -> &'static str {
        match self {
            WorkerRole::Both => "both",
            WorkerRole::Prefill => "prefill",
            WorkerRole::Decode => "decode",
        }
    }
}

/// A configured worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerConfig {
    /// Unique; used in logs, metrics and `/workers`.
    pub name: String,
    /// `http://host:port` of its gRPC API, or of the OpenAI-compatible server.
    pub endpoint: String,
    pub role: WorkerRole,
    /// Decode workers only: the configured name of their prefill worker, or of a group of
    /// prefill workers ([`crate::discovery`]).
    pub prefill: Option<String>,
    pub protocol: Protocol,
    /// The `[[worker_groups]]` entry this worker was discovered through; `None` when listed.
    pub group: Option<String>,
}

/// How the gateway talks to a worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Protocol {
    /// A Bulkhead worker: gRPC, with Info, Health and the KV handoff's guarantees.
    Bulkhead,
    /// An OpenAI-compatible HTTP server: the gateway's tenants, limits, policies and audit in
    /// front of it; its KV pool is its own (not measured, not checked by preflight).
    OpenAi(OpenAiUpstream),
}

/// An OpenAI-compatible upstream's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenAiUpstream {
    /// The model name the server answers to (sent upstream; clients use the name the
    /// gateway serves, the tokenizer GGUF's).
    pub model: String,
    /// The longest prompt + max tokens it serves.
    pub context_length: NonZeroU32,
    /// A GGUF of the same model: the gateway tokenizes with its tokenizer and chat template.
    pub tokenizer: std::path::PathBuf,
    /// The environment variable that holds the server's API key, if it needs one.
    pub key_env: Option<String>,
    /// Each request carries its tenant's `cache_salt`, so that the server's prefix cache is
    /// shared only within a tenant (vLLM takes it). Off (`cache_salt = false`) for a server
    /// that refuses the field: its cache is then shared across tenants, and the gateway
    /// reports no cached prompt tokens.
    pub cache_salt: bool,
    /// Pass the server's count of cached prompt tokens on to the client
    /// (`report_cached_tokens = true`, only with `cache_salt`). Off by default: a server that
    /// ignores the salt instead of refusing it (vLLM answers an unknown field with a warning in
    /// its log) keeps one cache for every tenant, and its count would tell a tenant what other
    /// tenants' prompts began with. The gateway cannot tell such a server from one that keeps
    /// its cache per salt; the operator vouches for it.
    pub report_cached_tokens: bool,
}

/// Why the configuration is refused; every message names the place to fix.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{0}")]
    Toml(#[from] TomlError),
    #[error("cluster.token_file: {0}")]
    ClusterToken(#[from] TokenError),
    #[error("audit.key_file {path}: {source}")]
    AuditKey { path: String, source: KeyError },
    #[error("cluster: {0}")]
    ClusterTls(#[from] TlsError),
    #[error("listen: {0}")]
    ListenTls(TlsError),
    #[error("listen: tls_cert and tls_key go together (both or neither)")]
    PartialListenTls,
    #[error("listen: tls_client_ca needs tls_cert and tls_key")]
    ClientCaWithoutTls,
    #[error("cluster: tls_ca, tls_cert and tls_key go together (all three or none)")]
    PartialTls,
    #[error("cluster: tls_server_name needs tls_ca, tls_cert and tls_key")]
    ServerNameWithoutTls,
    #[error("admin.token_sha256: {0}")]
    AdminToken(KeyHashError),
    #[error(
        "admin.token_sha256 is also a key of tenant {tenant}: the admin token must be a secret of its own"
    )]
    AdminTokenIsTenantKey { tenant: String },
    #[error(transparent)]
    TenantId(#[from] TenantIdError),
    #[error("tenant {tenant:?}: ids starting with '_' are reserved for the gateway's own logs")]
    ReservedTenant { tenant: String },
    #[error("tenant {tenant:?} is defined twice")]
    DuplicateTenant { tenant: String },
    #[error("tenant {tenant:?} has no keys: give it at least one key_sha256")]
    NoKeys { tenant: String },
    #[error("tenant {tenant:?}, key_sha256[{index}]: {source}")]
    KeyHash {
        tenant: String,
        index: usize,
        source: KeyHashError,
    },
    #[error("a key of tenant {tenant:?} is also a key of tenant {other:?}; keys must be unique")]
    SharedKey { tenant: String, other: String },
    #[error("tenant {tenant:?} lists one key twice in key_sha256")]
    RepeatedKey { tenant: String },
    #[error("tenant {tenant:?}: {field} must be at least 1")]
    ZeroLimit { tenant: String, field: &'static str },
    #[error("no tenants: define at least one [[tenants]]")]
    NoTenants,
    #[error("no workers: define at least one [[workers]] or [[worker_groups]]")]
    NoWorkers,
    #[error("worker {name:?} is defined twice")]
    DuplicateWorker { name: String },
    #[error(
        "worker {name:?}: a name with '@' is a discovered worker group member's (group@address)"
    )]
    WorkerNameWithAt { name: String },
    #[error("a [[workers]] entry has an empty name")]
    WorkerNameEmpty,
    #[error("worker {name:?}: {field} = {endpoint:?} is not an address like {like}")]
    WorkerEndpoint {
        name: String,
        field: &'static str,
        endpoint: String,
        like: &'static str,
    },
    #[error("worker {name:?}: grpc = {endpoint:?}: {source}")]
    WorkerScheme {
        name: String,
        endpoint: String,
        source: EndpointError,
    },
    #[error("worker {name:?}: a decode worker must name its prefill worker (prefill = \"…\")")]
    DecodeWithoutPrefill { name: String },
    #[error(
        "worker {name:?}: prefill = {prefill:?} names no worker or worker group with role = \"prefill\""
    )]
    UnknownPrefill { name: String, prefill: String },
    #[error("worker {name:?}: only decode workers name a prefill worker")]
    PrefillOnNonDecode { name: String },
    #[error("{field} must be at least 1")]
    ZeroSetting { field: &'static str },
    #[error("{field} must be at most {MAX_TIMEOUT_SECS} (a week)")]
    TimeoutTooLong { field: &'static str },
    #[error("{field} must be at most {max}")]
    TooLarge { field: &'static str, max: u64 },
    #[error("worker {name:?}: give exactly one of grpc = \"…\" or openai = \"…\"")]
    WorkerProtocol { name: String },
    #[error(
        "worker {name:?}: an openai worker has role = \"both\" and needs model, context_length \
         (≥ 1) and tokenizer; {problem}"
    )]
    OpenAiWorker { name: String, problem: &'static str },
    #[error("worker {name:?}: {field} is only for openai workers")]
    OpenAiOnly { name: String, field: &'static str },
    #[error(transparent)]
    Group(#[from] GroupError),
    #[error("telemetry.otlp_endpoint: {0}")]
    Telemetry(#[from] TelemetryError),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    listen: RawListen,
    admin: RawAdmin,
    #[serde(default)]
    http: RawHttp,
    #[serde(default)]
    audit: RawAudit,
    #[serde(default)]
    tenants: Vec<RawTenant>,
    #[serde(default)]
    workers: Vec<RawWorker>,
    #[serde(default)]
    worker_groups: Vec<RawWorkerGroup>,
    #[serde(default = "default_refresh_secs")]
    worker_refresh_secs: u64,
    #[serde(default)]
    policies: Option<RawPolicies>,
    #[serde(default)]
    telemetry: RawTelemetry,
    #[serde(default)]
    cluster: RawCluster,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCluster {
    token_file: Option<PathBuf>,
    tls_ca: Option<PathBuf>,
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
    tls_server_name: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTelemetry {
    otlp_endpoint: Option<String>,
    #[serde(default)]
    audit_logs: bool,
    #[serde(default)]
    client_trace: ClientTrace,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPolicies {
    file: std::path::PathBuf,
    cache_dir: Option<std::path::PathBuf>,
    cache_max_mib: Option<u64>,
    watch_secs: Option<u64>,
    hold_limit_secs: Option<u64>,
    max_held_per_tenant: Option<u32>,
    instances: Option<u32>,
    max_memory_mib: Option<u32>,
}

fn default_refresh_secs() -> u64 {
    5
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawListen {
    api: SocketAddr,
    admin: SocketAddr,
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
    tls_client_ca: Option<PathBuf>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAdmin {
    token_sha256: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHttp {
    max_body_bytes: Option<usize>,
    request_timeout_secs: Option<u64>,
    header_timeout_secs: Option<u64>,
    body_timeout_secs: Option<u64>,
    write_stall_timeout_secs: Option<u64>,
    stream_idle_timeout_secs: Option<u64>,
    drain_timeout_secs: Option<u64>,
    max_connections: Option<usize>,
    default_max_tokens: Option<u32>,
    default_completion_max_tokens: Option<u32>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAudit {
    durability: Option<Durability>,
    on_failure: Option<OnAuditFailure>,
    segment_bytes: Option<u64>,
    gateway_records_per_minute: Option<u64>,
    unread_records_per_minute: Option<u64>,
    key_file: Option<PathBuf>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTenant {
    id: String,
    key_sha256: Vec<String>,
    max_context: u32,
    max_concurrent: u32,
    requests_per_minute: u32,
    tokens_per_minute: u64,
    #[serde(default)]
    capture_content: bool,
    #[serde(default)]
    reuse_id: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawWorker {
    name: String,
    #[serde(default)]
    grpc: Option<String>,
    #[serde(default)]
    openai: Option<String>,
    role: WorkerRole,
    /// Decode workers: the name of the prefill worker that fills their pages.
    #[serde(default)]
    prefill: Option<String>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    context_length: Option<u32>,
    #[serde(default)]
    tokenizer: Option<std::path::PathBuf>,
    #[serde(default)]
    key_env: Option<String>,
    #[serde(default)]
    cache_salt: Option<bool>,
    #[serde(default)]
    report_cached_tokens: Option<bool>,
}

impl Config {
    /// Reads and validates the file at `path`.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        Config::parse(&Config::read(path)?)
    }

    /// The text of the file at `path`.
    pub fn read(path: &Path) -> Result<String, ConfigError> {
        bulkhead_worker::regular_file::read_text(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })
    }

    /// Validates a configuration given as TOML text.
    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        let raw: RawConfig = toml_errors::parse(text)?;
        let admin_token =
            KeyHash::from_hex(&raw.admin.token_sha256).map_err(ConfigError::AdminToken)?;
        let http = http_limits(&raw.http)?;
        let audit = audit_settings(&raw.audit)?;
        let tenants = tenants(raw.tenants)?;
        if let Some(t) = tenants.keyring().tenant(&admin_token) {
            // Otherwise that tenant's key opens the admin listener: every tenant's audit log.
            return Err(ConfigError::AdminTokenIsTenantKey {
                tenant: t.id.to_string(),
            });
        }
        let (workers, worker_groups) = workers(raw.workers, raw.worker_groups)?;
        let refresh_interval = timeout(
            Some(raw.worker_refresh_secs),
            "worker_refresh_secs",
            Duration::ZERO,
        )?;
        Ok(Config {
            listen: listen(raw.listen)?,
            admin_token,
            http,
            audit,
            tenants,
            workers,
            worker_groups,
            refresh_interval,
            policies: raw.policies.map(policy_settings).transpose()?,
            telemetry: TelemetrySettings {
                otlp_endpoint: raw
                    .telemetry
                    .otlp_endpoint
                    .as_deref()
                    .map(str::parse)
                    .transpose()?,
                audit_logs: raw.telemetry.audit_logs,
                client_trace: raw.telemetry.client_trace,
            },
            cluster: cluster_settings(raw.cluster)?,
        })
    }

    /// The listeners' TLS, read from its files now (like the cluster's, below).
    pub fn listener_tls(&self) -> Result<Option<ListenerTls>, ConfigError> {
        let tls = self.listen.tls.as_ref().map(ListenerTls::load);
        tls.transpose().map_err(ConfigError::ListenTls)
    }

    /// The cluster token and TLS, read from their files now (secrets are mounted where the
    /// process runs, so checking a configuration elsewhere does not need them), once the
    /// `[cluster]` settings are final (flags may replace its TLS files): every `https://`
    /// worker is refused without TLS, as it would be where it is dialled.
    pub fn cluster_access(&self) -> Result<ClusterAccess, ConfigError> {
        let token = self.cluster.token_file.as_deref().map(SharedToken::read);
        let tls = self.cluster.tls.as_ref().map(|s| s.load(Part::Calls));
        let access = ClusterAccess {
            token: token.transpose()?,
            tls: tls.transpose()?,
        };
        let bulkhead = self
            .workers
            .iter()
            .filter(|w| w.protocol == Protocol::Bulkhead);
        for w in bulkhead {
            tls::endpoint(&w.endpoint, access.tls.as_ref()).map_err(|source| {
                ConfigError::WorkerScheme {
                    name: w.name.clone(),
                    endpoint: bulkhead_telemetry::redacted_url(&w.endpoint),
                    source,
                }
            })?;
        }
        Ok(access)
    }
}

fn listen(raw: RawListen) -> Result<Listen, ConfigError> {
    let tls = match (raw.tls_cert, raw.tls_key) {
        (Some(cert), Some(key)) => Some(ListenerFiles {
            cert,
            key,
            client_ca: raw.tls_client_ca,
        }),
        (None, None) if raw.tls_client_ca.is_some() => {
            return Err(ConfigError::ClientCaWithoutTls);
        }
        (None, None) => None,
        _ => return Err(ConfigError::PartialListenTls),
    };
    Ok(Listen {
        api: raw.api,
        admin: raw.admin,
        tls,
    })
}

fn cluster_settings(raw: RawCluster) -> Result<ClusterSettings, ConfigError> {
    let tls = match (raw.tls_ca, raw.tls_cert, raw.tls_key) {
        (Some(ca), Some(cert), Some(key)) => Some(TlsSettings {
            files: TlsFiles { ca, cert, key },
            server_name: raw.tls_server_name,
        }),
        (None, None, None) if raw.tls_server_name.is_some() => {
            return Err(ConfigError::ServerNameWithoutTls);
        }
        (None, None, None) => None,
        _ => return Err(ConfigError::PartialTls),
    };
    Ok(ClusterSettings {
        token_file: raw.token_file,
        tls,
    })
}

/// The longest timeout the gateway takes: a deadline is a point in time, and one past the
/// clock's range would fail every request.
const MAX_TIMEOUT_SECS: u64 = 7 * 24 * 3600;

/// `v`, or `default` when absent; 0 is refused by name.
fn nonzero(v: Option<u64>, field: &'static str, default: u64) -> Result<u64, ConfigError> {
    match v {
        Some(0) => Err(ConfigError::ZeroSetting { field }),
        Some(v) => Ok(v),
        None => Ok(default),
    }
}

/// `v` seconds, or `default` when absent; 0 and more than a week are refused by name.
fn timeout(
    v: Option<u64>,
    field: &'static str,
    default: Duration,
) -> Result<Duration, ConfigError> {
    match nonzero(v, field, default.as_secs())? {
        secs if secs > MAX_TIMEOUT_SECS => Err(ConfigError::TimeoutTooLong { field }),
        secs => Ok(Duration::from_secs(secs)),
    }
}

fn http_limits(raw: &RawHttp) -> Result<HttpLimits, ConfigError> {
    let d = HttpLimits::default();
    Ok(HttpLimits {
        max_body_bytes: nonzero(
            raw.max_body_bytes.map(|v| v as u64),
            "http.max_body_bytes",
            d.max_body_bytes as u64,
        )? as usize,
        request_timeout: timeout(
            raw.request_timeout_secs,
            "http.request_timeout_secs",
            d.request_timeout,
        )?,
        header_timeout: timeout(
            raw.header_timeout_secs,
            "http.header_timeout_secs",
            d.header_timeout,
        )?,
        body_timeout: timeout(
            raw.body_timeout_secs,
            "http.body_timeout_secs",
            d.body_timeout,
        )?,
        write_stall_timeout: timeout(
            raw.write_stall_timeout_secs,
            "http.write_stall_timeout_secs",
            d.write_stall_timeout,
        )?,
        stream_idle_timeout: timeout(
            raw.stream_idle_timeout_secs,
            "http.stream_idle_timeout_secs",
            d.stream_idle_timeout,
        )?,
        drain_timeout: timeout(
            raw.drain_timeout_secs,
            "http.drain_timeout_secs",
            d.drain_timeout,
        )?,
        max_connections: NonZeroUsize::new(nonzero(
            raw.max_connections.map(|v| v as u64),
            "http.max_connections",
            d.max_connections.get() as u64,
        )? as usize)
        .unwrap_or(d.max_connections),
        default_max_tokens: max_tokens(
            raw.default_max_tokens,
            "http.default_max_tokens",
            d.default_max_tokens,
        )?,
        default_completion_max_tokens: max_tokens(
            raw.default_completion_max_tokens,
            "http.default_completion_max_tokens",
            d.default_completion_max_tokens,
        )?,
    })
}

/// A default `max_tokens` setting: `default` when absent, refused when zero.
fn max_tokens(
    raw: Option<u32>,
    field: &'static str,
    default: NonZeroU32,
) -> Result<NonZeroU32, ConfigError> {
    match raw {
        None => Ok(default),
        Some(v) => NonZeroU32::new(v).ok_or(ConfigError::ZeroSetting { field }),
    }
}

fn audit_settings(raw: &RawAudit) -> Result<AuditSettings, ConfigError> {
    let d = AuditSettings::default();
    Ok(AuditSettings {
        durability: raw.durability.unwrap_or(d.durability),
        on_failure: raw.on_failure.unwrap_or(d.on_failure),
        segment_bytes: nonzero(raw.segment_bytes, "audit.segment_bytes", d.segment_bytes)?,
        gateway_records_per_minute: nonzero(
            raw.gateway_records_per_minute,
            "audit.gateway_records_per_minute",
            d.gateway_records_per_minute,
        )?,
        unread_records_per_minute: nonzero(
            raw.unread_records_per_minute,
            "audit.unread_records_per_minute",
            d.unread_records_per_minute,
        )?,
        key_file: raw.key_file.clone(),
    })
}

/// The most plugin instances a gateway may keep alive at once.
const MAX_POLICY_INSTANCES: u32 = 10_000;

fn policy_settings(raw: RawPolicies) -> Result<PolicySettings, ConfigError> {
    let d = SandboxSettings::default();
    let instances = raw.instances.unwrap_or(d.instances);
    if instances == 0 {
        return Err(ConfigError::ZeroSetting {
            field: "policies.instances",
        });
    }
    // Each instance reserves its memory's address space and a fiber stack up front.
    if instances > MAX_POLICY_INSTANCES {
        return Err(ConfigError::TooLarge {
            field: "policies.instances",
            max: MAX_POLICY_INSTANCES.into(),
        });
    }
    let max_memory_bytes = match raw.max_memory_mib {
        None => d.max_memory_bytes,
        Some(0) => {
            return Err(ConfigError::ZeroSetting {
                field: "policies.max_memory_mib",
            });
        }
        Some(mib) => (mib as usize).saturating_mul(1 << 20),
    };
    Ok(PolicySettings {
        file: raw.file,
        sandbox: SandboxSettings {
            instances,
            max_memory_bytes,
            cache_dir: raw.cache_dir,
            cache_max_bytes: raw
                .cache_max_mib
                .map_or(d.cache_max_bytes, |mib| mib.saturating_mul(1 << 20)),
        },
        // 0: no watching; otherwise at most a week, as every interval (tokio's timer panics
        // at an instant past its range, and the watch would quietly stop).
        watch_interval: match raw.watch_secs {
            Some(0) => None,
            secs => Some(timeout(
                secs,
                "policies.watch_secs",
                Duration::from_secs(2),
            )?),
        },
        hold_limit: timeout(
            raw.hold_limit_secs,
            "policies.hold_limit_secs",
            Duration::from_secs(30),
        )?,
        max_held_per_tenant: raw.max_held_per_tenant.unwrap_or(16),
    })
}

fn tenants(raw: Vec<RawTenant>) -> Result<TenantSet, ConfigError> {
    let mut set = TenantSetBuilder::default();
    for t in raw {
        let id = TenantId::new(&t.id)?;
        if t.id.starts_with('_') {
            return Err(ConfigError::ReservedTenant { tenant: t.id });
        }
        let zero = |field| ConfigError::ZeroLimit {
            tenant: t.id.clone(),
            field,
        };
        let limits = TenantLimits {
            max_context: NonZeroU32::new(t.max_context).ok_or_else(|| zero("max_context"))?,
            max_concurrent: NonZeroU32::new(t.max_concurrent)
                .ok_or_else(|| zero("max_concurrent"))?,
            requests_per_minute: NonZeroU32::new(t.requests_per_minute)
                .ok_or_else(|| zero("requests_per_minute"))?,
            tokens_per_minute: NonZeroU64::new(t.tokens_per_minute)
                .ok_or_else(|| zero("tokens_per_minute"))?,
        };
        let keys = t
            .key_sha256
            .iter()
            .enumerate()
            .map(|(index, hex)| {
                KeyHash::from_hex(hex).map_err(|source| ConfigError::KeyHash {
                    tenant: t.id.clone(),
                    index,
                    source,
                })
            })
            .collect::<Result<_, _>>()?;
        let tenant = Tenant {
            id,
            limits,
            capture_content: t.capture_content,
            reuse_id: t.reuse_id,
        };
        set.add(tenant, keys)?;
    }
    set.build()
}

fn workers(
    raw: Vec<RawWorker>,
    raw_groups: Vec<RawWorkerGroup>,
) -> Result<(Vec<WorkerConfig>, Vec<WorkerGroup>), ConfigError> {
    if raw.is_empty() && raw_groups.is_empty() {
        return Err(ConfigError::NoWorkers);
    }
    // Workers and groups share one namespace: a decode worker's `prefill` may name either.
    let named = raw
        .iter()
        .map(|w| (w.name.as_str(), w.role, w.prefill.as_deref()))
        .chain(raw_groups.iter().map(|g| (g.name(), g.role(), g.prefill())));
    let prefill_names: HashSet<&str> = named
        .clone()
        .filter(|(_, role, _)| *role == WorkerRole::Prefill)
        .map(|(name, _, _)| name)
        .collect();
    let mut seen = HashSet::new();
    for (name, role, prefill) in named {
        if !seen.insert(name) {
            return Err(ConfigError::DuplicateWorker { name: name.into() });
        }
        match (role, prefill) {
            (WorkerRole::Decode, None) => {
                return Err(ConfigError::DecodeWithoutPrefill { name: name.into() });
            }
            (WorkerRole::Decode, Some(p)) if !prefill_names.contains(p) => {
                return Err(ConfigError::UnknownPrefill {
                    name: name.into(),
                    prefill: p.into(),
                });
            }
            (WorkerRole::Both | WorkerRole::Prefill, Some(_)) => {
                return Err(ConfigError::PrefillOnNonDecode { name: name.into() });
            }
            _ => {}
        }
    }
    // Members of groups are named `group@address`: a worker named so would be listed, probed
    // and routed to as two.
    if let Some(w) = raw.iter().find(|w| w.name.contains('@')) {
        return Err(ConfigError::WorkerNameWithAt {
            name: w.name.clone(),
        });
    }
    // A name is how logs, metrics and `/workers` tell workers apart.
    if raw.iter().any(|w| w.name.trim().is_empty()) {
        return Err(ConfigError::WorkerNameEmpty);
    }
    let mut out = Vec::with_capacity(raw.len());
    for w in &raw {
        let (address, protocol) = protocol(w)?;
        let endpoint =
            worker_endpoint(address, &protocol).ok_or_else(|| ConfigError::WorkerEndpoint {
                name: w.name.clone(),
                field: protocol.field(),
                endpoint: bulkhead_telemetry::redacted_url(address),
                like: protocol.address_example(),
            })?;
        out.push(WorkerConfig {
            name: w.name.clone(),
            endpoint,
            role: w.role,
            prefill: w.prefill.clone(),
            protocol,
            group: None,
        });
    }
    let groups = raw_groups
        .into_iter()
        .map(RawWorkerGroup::validate)
        .collect::<Result<_, _>>()?;
    Ok((out, groups))
}

/// A worker's address and protocol: `grpc = …` for a Bulkhead worker, `openai = …` with its
/// model, context and tokenizer for an OpenAI-compatible server.
fn protocol(w: &RawWorker) -> Result<(&str, Protocol), ConfigError> {
    let name = || w.name.clone();
    match (&w.grpc, &w.openai) {
        (Some(grpc), None) => {
            let extra = [
                ("model", w.model.is_some()),
                ("context_length", w.context_length.is_some()),
                ("tokenizer", w.tokenizer.is_some()),
                ("key_env", w.key_env.is_some()),
                ("cache_salt", w.cache_salt.is_some()),
                ("report_cached_tokens", w.report_cached_tokens.is_some()),
            ];
            if let Some((field, _)) = extra.iter().find(|(_, set)| *set) {
                return Err(ConfigError::OpenAiOnly {
                    name: name(),
                    field,
                });
            }
            Ok((grpc, Protocol::Bulkhead))
        }
        (None, Some(url)) => {
            let problem = |problem| ConfigError::OpenAiWorker {
                name: name(),
                problem,
            };
            if w.role != WorkerRole::Both {
                return Err(problem("its role is not \"both\""));
            }
            let cache_salt = w.cache_salt.unwrap_or(true);
            let report_cached_tokens = w.report_cached_tokens.unwrap_or(false);
            if report_cached_tokens && !cache_salt {
                return Err(problem(
                    "report_cached_tokens without cache_salt: the server's cache is shared \
                     across tenants, and its count would tell a tenant what other tenants' \
                     prompts began with",
                ));
            }
            let upstream = OpenAiUpstream {
                model: w.model.clone().ok_or_else(|| problem("model is missing"))?,
                context_length: w
                    .context_length
                    .and_then(NonZeroU32::new)
                    .ok_or_else(|| problem("context_length is missing or 0"))?,
                tokenizer: w
                    .tokenizer
                    .clone()
                    .ok_or_else(|| problem("tokenizer is missing"))?,
                key_env: w.key_env.clone(),
                cache_salt,
                report_cached_tokens,
            };
            Ok((url, Protocol::OpenAi(upstream)))
        }
        _ => Err(ConfigError::WorkerProtocol { name: name() }),
    }
}

impl Protocol {
    /// The field of `[[workers]]` that gives a worker of this protocol its address.
    fn field(&self) -> &'static str {
        match self {
            Protocol::Bulkhead => "grpc",
            Protocol::OpenAi(_) => "openai",
        }
    }

    /// What an address of a worker of this protocol looks like, for a refusal.
    fn address_example(&self) -> &'static str {
        match self {
            Protocol::Bulkhead => {
                "http://127.0.0.1:50051 (or https://, with [cluster] tls_ca, tls_cert, tls_key)"
            }
            Protocol::OpenAi(_) => "http://10.0.0.7:8000 (plain HTTP only)",
        }
    }
}

/// `SCHEME://host:port` for `host:port` (`http`) or `SCHEME://host:port`, whose scheme is
/// `http` or, for a Bulkhead worker, `https` (which needs the cluster's TLS:
/// [`Config::cluster_access`]); `None` when it is none of these.
pub fn worker_endpoint(addr: &str, protocol: &Protocol) -> Option<String> {
    let with_scheme = if addr.contains("://") {
        addr.to_owned()
    } else {
        format!("http://{addr}")
    };
    let uri: http::Uri = with_scheme.parse().ok()?;
    let scheme = match (uri.scheme_str()?, protocol) {
        ("http", _) => "http",
        ("https", Protocol::Bulkhead) => "https",
        _ => return None,
    };
    // A host and port, nothing else: no path, no query, no credentials (a worker is
    // authenticated by the cluster token; a password in the address would be shown in
    // `/workers` and the log).
    let ok = uri.host().is_some_and(|h| !h.is_empty())
        && uri.port_u16().is_some_and(|p| p != 0)
        && uri.path() == "/"
        && uri.query().is_none()
        && !uri.authority()?.as_str().contains('@');
    if !ok {
        return None;
    }
    Some(format!("{scheme}://{}", uri.authority()?.as_str()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(tenants: &str, workers: &str) -> String {
        format!(
            "[listen]\napi = \"127.0.0.1:0\"\nadmin = \"127.0.0.1:0\"\n\
             [admin]\ntoken_sha256 = \"{}\"\n{tenants}\n{workers}",
            KeyHash::of("admin").to_hex()
        )
    }

    fn tenant(id: &str, key: &str) -> String {
        format!(
            "[[tenants]]\nid = \"{id}\"\nkey_sha256 = [\"{}\"]\nmax_context = 2048\n\
             max_concurrent = 2\nrequests_per_minute = 60\ntokens_per_minute = 10000\n",
            KeyHash::of(key).to_hex()
        )
    }

    const WORKER: &str = "[[workers]]\nname = \"w\"\ngrpc = \"127.0.0.1:50051\"\nrole = \"both\"\n";

    #[test]
    fn a_valid_file_parses_with_its_keys_hashed() {
        let c = Config::parse(&config(
            &(tenant("tenant-a", "sk-a") + &tenant("tenant-b", "sk-b")),
            WORKER,
        ))
        .expect("valid");
        assert_eq!(c.tenants.len(), 2);
        let a = c
            .tenants
            .keyring()
            .tenant(&KeyHash::of("sk-a"))
            .expect("a's key");
        assert_eq!(a.id.as_str(), "tenant-a");
        assert!(c.tenants.keyring().tenant(&KeyHash::of("sk-c")).is_none());
        assert_eq!(c.workers[0].endpoint, "http://127.0.0.1:50051");
        assert_eq!(c.http, HttpLimits::default());
    }

    #[test]
    fn an_admin_token_that_is_also_a_tenants_key_is_refused() {
        let e = Config::parse(&config(&tenant("tenant-a", "admin"), WORKER))
            .expect_err("the admin token opens every tenant's audit log");
        assert!(
            matches!(&e, ConfigError::AdminTokenIsTenantKey { tenant } if tenant == "tenant-a"),
            "{e}"
        );
    }

    #[test]
    fn a_refused_worker_address_is_quoted_without_its_credentials() {
        let text = config(
            &tenant("a", "sk-a"),
            "[[workers]]\nname = \"w\"\ngrpc = \"http://u:secret@127.0.0.1:1/?k=v\"\nrole = \"both\"\n",
        );
        let e = Config::parse(&text)
            .expect_err("not an address")
            .to_string();
        assert!(e.starts_with("worker \"w\": grpc = "), "{e}");
        assert!(!e.contains("secret") && !e.contains("k=v"), "{e}");
    }

    #[test]
    fn timeouts_past_a_week_are_refused_by_name() {
        let with = |secs: u64| {
            let http = format!("[http]\nrequest_timeout_secs = {secs}\n");
            Config::parse(&(config(&tenant("tenant-a", "k"), WORKER) + &http))
        };
        let week = with(MAX_TIMEOUT_SECS).expect("a week is taken");
        assert_eq!(week.http.request_timeout.as_secs(), MAX_TIMEOUT_SECS);
        // Before, the largest TOML integer parsed and every request's deadline overflowed the clock: a panic.
        for secs in [MAX_TIMEOUT_SECS + 1, i64::MAX as u64] {
            let e = with(secs).expect_err("over a week");
            assert!(e.to_string().contains("http.request_timeout_secs"), "{e}");
        }
        // Workers re-read never (a new worker never routed to), an abandoned request's hold
        // ended at once: refused as well.
        let refresh = format!("worker_refresh_secs = {}\n", i64::MAX);
        let e = Config::parse(&(refresh + &config(&tenant("tenant-a", "k"), WORKER)))
            .expect_err("over a week");
        assert!(e.to_string().contains("worker_refresh_secs"), "{e}");
        let hold = format!("{WORKER}[policies]\nfile = \"p.toml\"\nhold_limit_secs = 0\n");
        let e = Config::parse(&config(&tenant("tenant-a", "k"), &hold)).expect_err("zero");
        assert!(e.to_string().contains("policies.hold_limit_secs"), "{e}");
    }

    #[test]
    fn telemetry_is_off_by_default_and_a_bad_endpoint_is_refused_by_name() {
        let c = Config::parse(&config(&tenant("tenant-a", "k"), WORKER)).expect("valid");
        assert_eq!(c.telemetry, TelemetrySettings::default());
        assert_eq!(c.telemetry.otlp_endpoint, None);
        let text = config(
            &tenant("tenant-a", "k"),
            &format!(
                "{WORKER}[telemetry]\notlp_endpoint = \"http://127.0.0.1:4318/\"\naudit_logs = true\n"
            ),
        );
        let c = Config::parse(&text).expect("valid");
        assert_eq!(c.telemetry.client_trace, ClientTrace::Link, "by default");
        let endpoint = c.telemetry.otlp_endpoint.expect("an endpoint");
        assert_eq!(endpoint.traces(), "http://127.0.0.1:4318/v1/traces");
        assert!(c.telemetry.audit_logs);
        let trusting = |mode: &str| {
            let section = format!("{WORKER}[telemetry]\nclient_trace = \"{mode}\"\n");
            Config::parse(&config(&tenant("tenant-a", "k"), &section))
        };
        let c = trusting("continue").expect("valid");
        assert_eq!(c.telemetry.client_trace, ClientTrace::Continue);
        assert!(trusting("follow").is_err());
        let bad = config(
            &tenant("tenant-a", "k"),
            &format!("{WORKER}[telemetry]\notlp_endpoint = \"https://collector:4318\"\n"),
        );
        let e = Config::parse(&bad)
            .expect_err("https is not built in")
            .to_string();
        assert!(e.contains("telemetry.otlp_endpoint"), "{e}");
    }

    #[test]
    fn the_cluster_token_is_read_from_its_file_and_a_bad_one_is_refused_by_name() {
        let c = Config::parse(&config(&tenant("tenant-a", "k"), WORKER)).expect("valid");
        assert!(c.cluster_access().expect("none to read").token.is_none());
        let dir = crate::scratch::Scratch::new("cluster-token");
        let with = |file: &std::path::Path| {
            Config::parse(&config(
                &tenant("tenant-a", "k"),
                &format!(
                    "{WORKER}[cluster]\ntoken_file = {:?}\n",
                    file.display().to_string()
                ),
            ))
            .expect("valid: the file is read when the token is needed")
            .cluster_access()
            .map(|access| access.token.map(|t| (*t.current()).clone()))
        };
        let file = dir.0.join("token");
        let write = |text: &str| {
            bulkhead_worker::serve::cluster_token::write_file(&file, text).expect("writes");
        };
        write("0123456789abcdef0123456789abcdef\n");
        assert_eq!(
            with(&file).expect("a valid token"),
            Some(
                bulkhead_worker::serve::ClusterToken::parse("0123456789abcdef0123456789abcdef")
                    .expect("valid")
            )
        );
        write("short");
        let e = with(&file).expect_err("too short").to_string();
        assert!(
            e.contains("cluster.token_file") && e.contains("at least 32"),
            "{e}"
        );
        let e = with(&dir.0.join("missing"))
            .expect_err("no file")
            .to_string();
        assert!(
            e.contains("cluster.token_file") && e.contains("missing"),
            "{e}"
        );
    }

    #[test]
    fn cluster_tls_takes_all_three_files_and_reads_them_when_needed() {
        use bulkhead_worker::serve::tls::Authority;
        let dir = crate::scratch::Scratch::new("cluster-tls");
        let files = Authority::new("test CA")
            .expect("a CA")
            .write(&dir.0, "gateway", &["127.0.0.1".to_owned()])
            .expect("writes");
        let with = |cluster: &str| {
            Config::parse(&config(
                &tenant("tenant-a", "k"),
                &format!("{WORKER}[cluster]\n{cluster}"),
            ))
        };
        let all = format!(
            "tls_ca = {:?}\ntls_cert = {:?}\ntls_key = {:?}\n",
            files.ca.display().to_string(),
            files.cert.display().to_string(),
            files.key.display().to_string()
        );
        let c = with(&all).expect("valid");
        let settings = c.cluster.tls.as_ref().expect("TLS");
        assert_eq!((&settings.files, &settings.server_name), (&files, &None));
        assert!(c.cluster_access().expect("loads").tls.is_some());
        let named = with(&format!("{all}tls_server_name = \"bulkhead-worker\"\n")).expect("valid");
        let settings = named.cluster.tls.as_ref().expect("TLS");
        assert_eq!(settings.server_name.as_deref(), Some("bulkhead-worker"));
        let e = with("tls_server_name = \"bulkhead-worker\"\n")
            .expect_err("a name without TLS")
            .to_string();
        assert!(e.contains("tls_server_name needs"), "{e}");
        let e = with(&format!("{all}tls_server_name = \"not a name\"\n"))
            .expect("parsed")
            .cluster_access()
            .expect_err("not a DNS name")
            .to_string();
        assert!(e.contains("not a DNS name"), "{e}");
        let two = all.lines().take(2).collect::<Vec<_>>().join("\n") + "\n";
        let e = with(&two).expect_err("the key is missing").to_string();
        assert!(
            e.contains("tls_ca, tls_cert and tls_key go together"),
            "{e}"
        );
        // Parsed without reading; read (and refused by name) when the gateway needs them.
        let absent = all.replace("gateway.key", "absent.key");
        let e = with(&absent)
            .expect("valid: the files are read when needed")
            .cluster_access()
            .expect_err("no key")
            .to_string();
        assert!(
            e.starts_with("cluster: ") && e.contains("absent.key"),
            "{e}"
        );
    }

    #[test]
    fn listener_tls_takes_a_certificate_and_key_and_reads_them_when_needed() {
        use bulkhead_worker::serve::tls::Authority;
        let dir = crate::scratch::Scratch::new("listen-tls");
        let files = Authority::new("test CA")
            .expect("a CA")
            .write(&dir.0, "api", &["127.0.0.1".to_owned()])
            .expect("writes");
        let with = |listen: &str| {
            let text = config(&tenant("tenant-a", "k"), WORKER).replacen(
                "[admin]",
                &format!("{listen}[admin]"),
                1,
            );
            Config::parse(&text)
        };
        let (cert, key, ca) = (
            format!("tls_cert = {:?}\n", files.cert.display().to_string()),
            format!("tls_key = {:?}\n", files.key.display().to_string()),
            format!("tls_client_ca = {:?}\n", files.ca.display().to_string()),
        );
        let plain = with("").expect("valid");
        assert_eq!(plain.listen.tls, None);
        assert!(plain.listener_tls().expect("nothing to read").is_none());
        let c = with(&format!("{cert}{key}")).expect("valid");
        let expected = ListenerFiles {
            cert: files.cert.clone(),
            key: files.key.clone(),
            client_ca: None,
        };
        assert_eq!(c.listen.tls.as_ref(), Some(&expected));
        assert!(c.listener_tls().expect("loads").is_some());
        let c = with(&format!("{cert}{key}{ca}")).expect("valid");
        assert_eq!(
            c.listen.tls.and_then(|t| t.client_ca),
            Some(files.ca.clone())
        );
        for (listen, says) in [
            (cert.clone(), "tls_cert and tls_key go together"),
            (key.clone(), "tls_cert and tls_key go together"),
            (ca.clone(), "tls_client_ca needs tls_cert and tls_key"),
        ] {
            let e = with(&listen).expect_err("refused").to_string();
            assert!(e.contains(says), "{listen}: {e}");
        }
        // Parsed without reading; read (and refused by name) when the gateway binds.
        let absent = format!("{cert}{}", key.replace("api.key", "absent.key"));
        let e = with(&absent)
            .expect("valid: the files are read when needed")
            .listener_tls()
            .expect_err("no key")
            .to_string();
        assert!(e.starts_with("listen: ") && e.contains("absent.key"), "{e}");
    }

    #[test]
    fn a_completion_defaults_to_openais_16_tokens_and_a_chat_to_512() {
        let c = Config::parse(&config(&tenant("tenant-a", "k"), WORKER)).expect("valid");
        assert_eq!(c.http.default_max_tokens.get(), 512);
        assert_eq!(c.http.default_completion_max_tokens.get(), 16);
        let set = |n: u32| {
            let section = format!("{WORKER}[http]\ndefault_completion_max_tokens = {n}\n");
            Config::parse(&config(&tenant("tenant-a", "k"), &section))
        };
        let c = set(64).expect("valid");
        assert_eq!(c.http.default_completion_max_tokens.get(), 64);
        assert_eq!(c.http.default_max_tokens.get(), 512);
        let e = set(0).expect_err("no tokens at all").to_string();
        assert!(e.contains("http.default_completion_max_tokens"), "{e}");
    }

    #[test]
    fn the_bound_on_open_connections_defaults_to_ten_thousand_and_zero_is_refused() {
        let c = Config::parse(&config(&tenant("tenant-a", "k"), WORKER)).expect("valid");
        assert_eq!(c.http.max_connections.get(), 10_000);
        let set = |n: usize| {
            let section = format!("{WORKER}[http]\nmax_connections = {n}\n");
            Config::parse(&config(&tenant("tenant-a", "k"), &section))
        };
        assert_eq!(set(64).expect("valid").http.max_connections.get(), 64);
        let e = set(0).expect_err("no connection at all").to_string();
        assert!(e.contains("http.max_connections"), "{e}");
    }

    #[test]
    fn audit_settings_default_to_durable_and_refuse_and_parse_when_given() {
        let c = Config::parse(&config(&tenant("tenant-a", "k"), WORKER)).expect("valid");
        assert_eq!(c.audit, AuditSettings::default());
        assert_eq!(c.audit.durability, Durability::Durable);
        assert_eq!(c.audit.on_failure, OnAuditFailure::Refuse);
        assert!(!c.tenants.members()[0].tenant.capture_content);
        let text = config(
            &(tenant("tenant-a", "k") + "capture_content = true\n"),
            &format!("{WORKER}[audit]\ndurability = \"group\"\non_failure = \"serve\"\n"),
        );
        let c = Config::parse(&text).expect("valid");
        assert_eq!(c.audit.durability, Durability::Group);
        assert_eq!(c.audit.on_failure, OnAuditFailure::Serve);
        assert!(c.tenants.members()[0].tenant.capture_content);
        let budget = |n: u64| {
            let section = format!("{WORKER}[audit]\ngateway_records_per_minute = {n}\n");
            Config::parse(&config(&tenant("tenant-a", "k"), &section))
        };
        assert_eq!(
            budget(60).expect("valid").audit.gateway_records_per_minute,
            60
        );
        let e = budget(0).expect_err("no budget at all").to_string();
        assert!(e.contains("audit.gateway_records_per_minute"), "{e}");
        let section = format!("{WORKER}[audit]\nunread_records_per_minute = 0\n");
        let e = Config::parse(&config(&tenant("tenant-a", "k"), &section))
            .expect_err("no budget for refusals")
            .to_string();
        assert!(e.contains("audit.unread_records_per_minute"), "{e}");
        let bad = config(
            &tenant("tenant-a", "k"),
            &format!("{WORKER}[audit]\ndurability = \"sometimes\"\n"),
        );
        assert!(Config::parse(&bad).is_err());
    }

    #[test]
    fn the_audit_key_is_read_from_its_file_and_a_bad_one_is_refused_by_name() {
        let c = Config::parse(&config(&tenant("tenant-a", "k"), WORKER)).expect("valid");
        assert!(c.audit.chain_key().expect("none to read").is_none());
        let dir = crate::scratch::Scratch::new("audit-key");
        let with = |file: &std::path::Path| {
            let section = format!(
                "{WORKER}[audit]\nkey_file = {:?}\n",
                file.display().to_string()
            );
            Config::parse(&config(&tenant("tenant-a", "k"), &section))
                .expect("valid: the file is read where the log is opened")
                .audit
                .chain_key()
        };
        let file = dir.0.join("key");
        let secret = "0123456789abcdef0123456789abcdef";
        std::fs::write(&file, format!("{secret}\n")).expect("writes");
        let key = with(&file).expect("a valid key").expect("keyed");
        assert_eq!(key.id(), ChainKey::new(secret).expect("valid").id());
        let shown = format!("{key:?}");
        assert!(!shown.contains(secret), "{shown}");
        for (text, says) in [("short\n", "at least 32"), ("\n", "empty")] {
            std::fs::write(&file, text).expect("writes");
            let e = with(&file).expect_err("refused").to_string();
            assert!(e.contains("audit.key_file") && e.contains(says), "{e}");
        }
        let e = with(&dir.0.join("missing"))
            .expect_err("no file")
            .to_string();
        assert!(
            e.contains("audit.key_file") && e.contains("missing") && e.contains("cannot read"),
            "{e}"
        );
    }

    #[test]
    fn policy_settings_default_and_parse_when_given() {
        let section = |extra: &str| {
            let text = config(
                &tenant("tenant-a", "k"),
                &format!("{WORKER}[policies]\nfile = \"p.toml\"\n{extra}"),
            );
            Config::parse(&text).map(|c| c.policies.expect("policies on"))
        };
        let p = section("").expect("valid");
        assert_eq!(p.sandbox, SandboxSettings::default());
        assert_eq!(p.watch_interval, Some(Duration::from_secs(2)));
        let p = section(
            "cache_dir = \"c\"\ncache_max_mib = 64\ninstances = 4\nmax_memory_mib = 32\n\
             watch_secs = 0\n",
        )
        .expect("valid");
        assert_eq!(
            p.sandbox,
            SandboxSettings {
                instances: 4,
                max_memory_bytes: 32 << 20,
                cache_dir: Some("c".into()),
                cache_max_bytes: 64 << 20,
            }
        );
        assert_eq!(p.watch_interval, None);
        let e = section(&format!("watch_secs = {}\n", i64::MAX)).expect_err("refused");
        assert!(e.to_string().contains("policies.watch_secs"), "{e}");
        // A bound of 0 keeps only what the active set uses; no instance at all is refused.
        assert_eq!(
            section("cache_max_mib = 0\n")
                .expect("valid")
                .sandbox
                .cache_max_bytes,
            0
        );
        assert!(section("instances = 0\n").is_err());
        let e = section("instances = 10001\n")
            .expect_err("too many")
            .to_string();
        assert!(
            e.contains("policies.instances must be at most 10000"),
            "{e}"
        );
    }

    #[test]
    fn reserved_and_path_like_tenant_ids_are_refused() {
        assert!(matches!(
            Config::parse(&config(&tenant("_gateway", "k"), WORKER)),
            Err(ConfigError::ReservedTenant { .. })
        ));
        for bad in ["..", "a/b", "a.b"] {
            assert!(matches!(
                Config::parse(&config(&tenant(bad, "k"), WORKER)),
                Err(ConfigError::TenantId(_))
            ));
        }
    }

    #[test]
    fn the_config_never_holds_clear_keys() {
        let c = Config::parse(&config(&tenant("tenant-a", "sk-clear-key"), WORKER)).expect("ok");
        let dump = format!("{c:?}");
        assert!(!dump.contains("sk-clear-key"), "{dump}");
        assert!(
            !dump.contains(&KeyHash::of("sk-clear-key").to_hex()),
            "{dump}"
        );
        assert!(
            c.tenants
                .keyring()
                .hashes()
                .all(|h| *h == KeyHash::of("sk-clear-key"))
        );
    }

    #[test]
    fn a_clear_key_where_a_hash_belongs_is_refused() {
        let text = config(&tenant("tenant-a", "x"), WORKER)
            .replace(&KeyHash::of("x").to_hex(), "sk-demo-tenant-a");
        let err = Config::parse(&text).expect_err("clear key");
        assert!(err.to_string().contains("key_sha256[0]"), "{err}");
    }

    #[test]
    fn shared_keys_duplicate_tenants_and_zero_limits_are_refused() {
        let shared = tenant("tenant-a", "k") + &tenant("tenant-b", "k");
        assert!(matches!(
            Config::parse(&config(&shared, WORKER)),
            Err(ConfigError::SharedKey { .. })
        ));
        let h = KeyHash::of("k").to_hex();
        let twice =
            tenant("tenant-a", "k").replace(&format!("\"{h}\""), &format!("\"{h}\", \"{h}\""));
        assert!(matches!(
            Config::parse(&config(&twice, WORKER)),
            Err(ConfigError::RepeatedKey { .. })
        ));
        let dup = tenant("tenant-a", "k1") + &tenant("tenant-a", "k2");
        assert!(matches!(
            Config::parse(&config(&dup, WORKER)),
            Err(ConfigError::DuplicateTenant { .. })
        ));
        let zero = tenant("tenant-a", "k").replace("max_concurrent = 2", "max_concurrent = 0");
        assert!(matches!(
            Config::parse(&config(&zero, WORKER)),
            Err(ConfigError::ZeroLimit {
                field: "max_concurrent",
                ..
            })
        ));
    }

    #[test]
    fn unknown_fields_and_missing_parts_are_refused() {
        let typo = tenant("tenant-a", "k").replace("max_context", "max_contxt");
        assert!(Config::parse(&config(&typo, WORKER)).is_err());
        assert!(matches!(
            Config::parse(&config("", WORKER)),
            Err(ConfigError::NoTenants)
        ));
        assert!(matches!(
            Config::parse(&config(&tenant("tenant-a", "k"), "")),
            Err(ConfigError::NoWorkers)
        ));
    }

    #[test]
    fn a_decode_worker_must_name_an_existing_prefill_worker() {
        let t = tenant("tenant-a", "k");
        let decode = WORKER.replace("both", "decode");
        assert!(matches!(
            Config::parse(&config(&t, &decode)),
            Err(ConfigError::DecodeWithoutPrefill { .. })
        ));
        let dangling = format!("{decode}prefill = \"p\"\n");
        assert!(matches!(
            Config::parse(&config(&t, &dangling)),
            Err(ConfigError::UnknownPrefill { .. })
        ));
        let pair = format!(
            "{dangling}[[workers]]\nname = \"p\"\ngrpc = \"127.0.0.1:50052\"\nrole = \"prefill\"\n"
        );
        let parsed = Config::parse(&config(&t, &pair)).expect("a decode/prefill pair is valid");
        assert_eq!(parsed.workers[0].prefill.as_deref(), Some("p"));
        let both_with_prefill = format!("{WORKER}prefill = \"p\"\n");
        assert!(matches!(
            Config::parse(&config(&t, &both_with_prefill)),
            Err(ConfigError::PrefillOnNonDecode { .. })
        ));
    }

    #[test]
    fn worker_endpoints_are_http_host_port_or_https_for_bulkhead_workers() {
        let bulkhead = |addr| worker_endpoint(addr, &Protocol::Bulkhead);
        assert_eq!(
            bulkhead("127.0.0.1:5").as_deref(),
            Some("http://127.0.0.1:5")
        );
        assert_eq!(
            bulkhead("http://[::1]:5").as_deref(),
            Some("http://[::1]:5")
        );
        assert_eq!(bulkhead("https://h:5").as_deref(), Some("https://h:5"));
        for bad in [
            "127.0.0.1",
            "127.0.0.1:0",
            "ftp://h:5",
            "h:5/path",
            "",
            "http://:5",
            "https://h",
            "http://u:p@h:5",
            "http://h:5/?k=v",
        ] {
            assert_eq!(bulkhead(bad), None, "{bad:?}");
        }
        let openai = Protocol::OpenAi(OpenAiUpstream {
            model: "m".into(),
            context_length: NonZeroU32::MIN,
            tokenizer: "m.gguf".into(),
            key_env: None,
            cache_salt: true,
            report_cached_tokens: false,
        });
        assert_eq!(
            worker_endpoint("http://h:5", &openai).as_deref(),
            Some("http://h:5")
        );
        assert_eq!(worker_endpoint("https://h:5", &openai), None);
    }

    /// With the cluster's TLS every worker is called over TLS, so an `https://` one is taken
    /// as well as an `http://` one; without, it could never connect and is refused before
    /// anything is dialled, by the settings that would allow it.
    #[test]
    fn an_https_worker_needs_the_clusters_tls_files() {
        use bulkhead_worker::serve::tls::Authority;
        let https = "[[workers]]\nname = \"good\"\ngrpc = \"https://127.0.0.1:18110\"\n\
                     role = \"both\"\n";
        let plain = Config::parse(&config(&tenant("tenant-a", "k"), https)).expect("parses");
        assert_eq!(plain.workers[0].endpoint, "https://127.0.0.1:18110");
        let e = plain.cluster_access().expect_err("no TLS").to_string();
        assert!(
            e.starts_with(r#"worker "good": grpc = "https://127.0.0.1:18110": "#)
                && e.contains("[cluster] tls_ca, tls_cert, tls_key"),
            "{e}"
        );
        let dir = crate::scratch::Scratch::new("https-worker");
        let files = Authority::new("test CA")
            .expect("a CA")
            .write(&dir.0, "gateway", &["127.0.0.1".to_owned()])
            .expect("writes");
        let mut with_tls = plain;
        with_tls.cluster.tls = Some(TlsSettings {
            files,
            server_name: None,
        });
        assert!(with_tls.cluster_access().expect("loads").tls.is_some());

        let openai = "[[workers]]\nname = \"o\"\nopenai = \"https://10.0.0.7:8000\"\n\
                      role = \"both\"\nmodel = \"m\"\ncontext_length = 8\ntokenizer = \"m.gguf\"\n";
        let e = Config::parse(&config(&tenant("tenant-a", "k"), openai))
            .expect_err("no TLS to OpenAI upstreams")
            .to_string();
        assert!(
            e.contains("openai = ") && e.contains("plain HTTP only"),
            "{e}"
        );
    }

    /// An OpenAI-compatible server's count of cached prompt tokens is passed on only when the
    /// operator says so, and only with the salt: the gateway cannot tell a server that keeps
    /// its cache per salt from one that ignores the field.
    #[test]
    fn an_upstreams_cached_tokens_are_reported_only_when_vouched_for_and_salted() {
        let t = tenant("tenant-a", "k");
        let worker = |extra: &str| {
            format!(
                "[[workers]]\nname = \"o\"\nopenai = \"http://10.0.0.7:8000\"\nrole = \"both\"\n\
                 model = \"m\"\ncontext_length = 8\ntokenizer = \"m.gguf\"\n{extra}"
            )
        };
        let upstream = |extra: &str| match Config::parse(&config(&t, &worker(extra))) {
            Ok(c) => match &c.workers[0].protocol {
                Protocol::OpenAi(u) => Ok((u.cache_salt, u.report_cached_tokens)),
                Protocol::Bulkhead => panic!("an openai worker"),
            },
            Err(e) => Err(e.to_string()),
        };
        assert_eq!(upstream(""), Ok((true, false)), "salted, not reported");
        assert_eq!(upstream("report_cached_tokens = true\n"), Ok((true, true)));
        let e = upstream("cache_salt = false\nreport_cached_tokens = true\n").expect_err("refused");
        assert!(e.contains("report_cached_tokens without cache_salt"), "{e}");
        let grpc = "[[workers]]\nname = \"g\"\ngrpc = \"127.0.0.1:5\"\nrole = \"both\"\n\
                    report_cached_tokens = false\n";
        let e = Config::parse(&config(&t, grpc))
            .expect_err("openai only")
            .to_string();
        assert!(e.contains("report_cached_tokens is only for openai"), "{e}");
    }

    #[test]
    fn worker_groups_parse_and_share_the_workers_namespace() {
        let t = tenant("tenant-a", "k");
        let groups = "[[worker_groups]]\nname = \"p\"\ndns = \"bulkhead-prefill.ns.svc:50051\"\n\
                      role = \"prefill\"\n\
                      [[worker_groups]]\nname = \"d\"\ndns = \"bulkhead-decode.ns.svc:50051\"\n\
                      role = \"decode\"\nprefill = \"p\"\n";
        let c = Config::parse(&config(&t, groups)).expect("groups alone are enough");
        assert!(c.workers.is_empty());
        assert_eq!(c.worker_groups.len(), 2);
        assert_eq!(c.worker_groups[1].prefill.as_deref(), Some("p"));
        // A listed decode worker may be filled by a prefill group.
        let mixed = format!(
            "{groups}[[workers]]\nname = \"x\"\ngrpc = \"127.0.0.1:1\"\nrole = \"decode\"\nprefill = \"p\"\n"
        );
        assert!(Config::parse(&config(&t, &mixed)).is_ok());
        let clash =
            format!("{groups}[[workers]]\nname = \"d\"\ngrpc = \"127.0.0.1:1\"\nrole = \"both\"\n");
        assert!(matches!(
            Config::parse(&config(&t, &clash)),
            Err(ConfigError::DuplicateWorker { .. })
        ));
        // A worker named like a member of a group (the same process, probed and routed to as
        // two).
        let member = format!(
            "{groups}[[workers]]\nname = \"d@127.0.0.1:1\"\ngrpc = \"127.0.0.1:1\"\nrole = \"both\"\n"
        );
        assert!(matches!(
            Config::parse(&config(&t, &member)),
            Err(ConfigError::WorkerNameWithAt { .. })
        ));
        let unnamed =
            format!("{groups}[[workers]]\nname = \" \"\ngrpc = \"127.0.0.1:1\"\nrole = \"both\"\n");
        assert!(matches!(
            Config::parse(&config(&t, &unnamed)),
            Err(ConfigError::WorkerNameEmpty)
        ));
        let dangling = groups.replace("prefill = \"p\"", "prefill = \"q\"");
        assert!(matches!(
            Config::parse(&config(&t, &dangling)),
            Err(ConfigError::UnknownPrefill { .. })
        ));
        let url = groups.replace(
            "bulkhead-decode.ns.svc:50051",
            "http://bulkhead-decode:50051",
        );
        let err = Config::parse(&config(&t, &url)).expect_err("a URL is not a DNS name");
        assert!(err.to_string().contains("worker group \"d\""), "{err}");
    }
}
