//! The gateway's configuration: a TOML file, parsed and validated once at start into [`Config`].
//! Nothing downstream re-checks it, and nothing downstream reads the file or the environment.
//!
//! ```toml
//! [listen]
//! api = "127.0.0.1:8080"
//! admin = "127.0.0.1:9090"
//!
//! [admin]
//! token_sha256 = "…64 hex…"        # sha256 of the admin bearer token
//!
//! [http]                            # optional; these are the defaults
//! max_body_bytes = 1048576
//! request_timeout_secs = 300
//! header_timeout_secs = 10
//! default_max_tokens = 512
//!
//! [[tenants]]
//! id = "tenant-a"
//! key_sha256 = ["…64 hex…"]         # sha256 of each API key; never the key itself
//! max_context = 8192
//! max_concurrent = 4
//! requests_per_minute = 120
//! tokens_per_minute = 200000
//!
//! [[workers]]
//! name = "local"
//! grpc = "http://127.0.0.1:50051"
//! role = "both"
//!
//! [policies]                        # optional: no policy plugins without it
//! file = "policies/local.toml"      # paths relative to the working directory
//! cache_dir = "plugins/dist/cache"  # compiled components (optional: compile at each load)
//! watch_secs = 2                    # reload when the file changes (0: admin call only)
//! hold_limit_secs = 30              # longest hold of an abandoned request's stream
//! instances = 64                    # plugin instances alive at once
//! max_memory_mib = 256              # the most memory any plugin may be given
//! ```

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::num::{NonZeroU32, NonZeroU64};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use crate::keys::{KeyHash, KeyHashError};
use crate::policy::{PolicySettings, SandboxSettings};
use crate::tenant::{Tenant, TenantId, TenantIdError, TenantLimits};

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub listen: Listen,
    /// The admin listener's bearer token, hashed.
    pub admin_token: KeyHash,
    pub http: HttpLimits,
    /// Every API key's hash → its tenant. Keys are unique across tenants.
    pub keyring: Keyring,
    /// The tenants, in file order.
    pub tenants: Vec<Arc<Tenant>>,
    /// At least one; names are unique.
    pub workers: Vec<WorkerConfig>,
    /// How often the gateway re-reads every worker's Info and Health.
    pub refresh_interval: Duration,
    /// Policy plugins; `None`: none run.
    pub policies: Option<PolicySettings>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Listen {
    pub api: SocketAddr,
    pub admin: SocketAddr,
}

/// Limits of the HTTP edge, the same for every tenant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// Larger request bodies get 413 before they are parsed.
    pub max_body_bytes: usize,
    /// A request that has not produced its response (its headers, when streaming) by then gets
    /// 408.
    pub request_timeout: Duration,
    /// A client that has not sent its request headers by then is disconnected (slowloris).
    pub header_timeout: Duration,
    /// `max_tokens` when a request does not say (clamped to what is left of the limit).
    pub default_max_tokens: NonZeroU32,
}

impl Default for HttpLimits {
    fn default() -> HttpLimits {
        HttpLimits {
            max_body_bytes: 1 << 20,
            request_timeout: Duration::from_secs(300),
            header_timeout: Duration::from_secs(10),
            default_max_tokens: NonZeroU32::MIN.saturating_add(511),
        }
    }
}

/// API key hashes → tenants.
#[derive(Debug, Clone, Default)]
pub struct Keyring {
    by_hash: HashMap<KeyHash, Arc<Tenant>>,
}

impl Keyring {
    /// The tenant whose key hashes to `hash`.
    pub fn tenant(&self, hash: &KeyHash) -> Option<&Arc<Tenant>> {
        self.by_hash.get(hash)
    }

    /// How many keys there are.
    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }

    /// Every key hash (tests check that no clear key is among them).
    pub fn hashes(&self) -> impl Iterator<Item = &KeyHash> {
        self.by_hash.keys()
    }
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

/// A configured worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerConfig {
    /// Unique; used in logs, metrics and `/workers`.
    pub name: String,
    /// `http://host:port` of its gRPC API.
    pub endpoint: String,
    pub role: WorkerRole,
    /// Decode workers only: the configured name of their prefill worker.
    pub prefill: Option<String>,
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
    Toml(#[from] toml::de::Error),
    #[error("admin.token_sha256: {0}")]
    AdminToken(KeyHashError),
    #[error(transparent)]
    TenantId(#[from] TenantIdError),
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
    #[error("tenant {tenant:?}: {field} must be at least 1")]
    ZeroLimit { tenant: String, field: &'static str },
    #[error("no tenants: define at least one [[tenants]]")]
    NoTenants,
    #[error("no workers: define at least one [[workers]]")]
    NoWorkers,
    #[error("worker {name:?} is defined twice")]
    DuplicateWorker { name: String },
    #[error("worker {name:?}: grpc = {endpoint:?} is not an address like http://127.0.0.1:50051")]
    WorkerEndpoint { name: String, endpoint: String },
    #[error("worker {name:?}: a decode worker must name its prefill worker (prefill = \"…\")")]
    DecodeWithoutPrefill { name: String },
    #[error("worker {name:?}: prefill = {prefill:?} names no worker with role = \"prefill\"")]
    UnknownPrefill { name: String, prefill: String },
    #[error("worker {name:?}: only decode workers name a prefill worker")]
    PrefillOnNonDecode { name: String },
    #[error("{field} must be at least 1")]
    ZeroSetting { field: &'static str },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    listen: RawListen,
    admin: RawAdmin,
    #[serde(default)]
    http: RawHttp,
    #[serde(default)]
    tenants: Vec<RawTenant>,
    #[serde(default)]
    workers: Vec<RawWorker>,
    #[serde(default = "default_refresh_secs")]
    worker_refresh_secs: u64,
    #[serde(default)]
    policies: Option<RawPolicies>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPolicies {
    file: std::path::PathBuf,
    cache_dir: Option<std::path::PathBuf>,
    watch_secs: Option<u64>,
    hold_limit_secs: Option<u64>,
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
    default_max_tokens: Option<u32>,
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
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawWorker {
    name: String,
    grpc: String,
    role: WorkerRole,
    /// Decode workers: the name of the prefill worker that fills their pages.
    #[serde(default)]
    prefill: Option<String>,
}

impl Config {
    /// Reads and validates the file at `path`.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Config::parse(&text)
    }

    /// Validates a configuration given as TOML text.
    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        let raw: RawConfig = toml::from_str(text)?;
        let admin_token =
            KeyHash::from_hex(&raw.admin.token_sha256).map_err(ConfigError::AdminToken)?;
        let http = http_limits(&raw.http)?;
        let (keyring, tenants) = tenants(raw.tenants)?;
        let workers = workers(raw.workers)?;
        if raw.worker_refresh_secs == 0 {
            return Err(ConfigError::ZeroSetting {
                field: "worker_refresh_secs",
            });
        }
        Ok(Config {
            listen: Listen {
                api: raw.listen.api,
                admin: raw.listen.admin,
            },
            admin_token,
            http,
            keyring,
            tenants,
            workers,
            refresh_interval: Duration::from_secs(raw.worker_refresh_secs),
            policies: raw.policies.map(policy_settings).transpose()?,
        })
    }
}

fn http_limits(raw: &RawHttp) -> Result<HttpLimits, ConfigError> {
    let d = HttpLimits::default();
    let nonzero = |v: Option<u64>, field: &'static str, default: u64| match v {
        Some(0) => Err(ConfigError::ZeroSetting { field }),
        Some(v) => Ok(v),
        None => Ok(default),
    };
    Ok(HttpLimits {
        max_body_bytes: nonzero(
            raw.max_body_bytes.map(|v| v as u64),
            "http.max_body_bytes",
            d.max_body_bytes as u64,
        )? as usize,
        request_timeout: Duration::from_secs(nonzero(
            raw.request_timeout_secs,
            "http.request_timeout_secs",
            d.request_timeout.as_secs(),
        )?),
        header_timeout: Duration::from_secs(nonzero(
            raw.header_timeout_secs,
            "http.header_timeout_secs",
            d.header_timeout.as_secs(),
        )?),
        default_max_tokens: match raw.default_max_tokens {
            None => d.default_max_tokens,
            Some(v) => NonZeroU32::new(v).ok_or(ConfigError::ZeroSetting {
                field: "http.default_max_tokens",
            })?,
        },
    })
}

fn policy_settings(raw: RawPolicies) -> Result<PolicySettings, ConfigError> {
    let d = SandboxSettings::default();
    let instances = raw.instances.unwrap_or(d.instances);
    if instances == 0 {
        return Err(ConfigError::ZeroSetting {
            field: "policies.instances",
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
        },
        watch_interval: match raw.watch_secs.unwrap_or(2) {
            0 => None,
            s => Some(Duration::from_secs(s)),
        },
        hold_limit: Duration::from_secs(raw.hold_limit_secs.unwrap_or(30)),
    })
}

fn tenants(raw: Vec<RawTenant>) -> Result<(Keyring, Vec<Arc<Tenant>>), ConfigError> {
    if raw.is_empty() {
        return Err(ConfigError::NoTenants);
    }
    let mut keyring = Keyring::default();
    let mut tenants = Vec::with_capacity(raw.len());
    let mut seen = HashSet::new();
    for t in raw {
        let id = TenantId::new(&t.id)?;
        if !seen.insert(id.clone()) {
            return Err(ConfigError::DuplicateTenant { tenant: t.id });
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
        if t.key_sha256.is_empty() {
            return Err(ConfigError::NoKeys { tenant: t.id });
        }
        let tenant = Arc::new(Tenant { id, limits });
        for (index, hex) in t.key_sha256.iter().enumerate() {
            let hash = KeyHash::from_hex(hex).map_err(|source| ConfigError::KeyHash {
                tenant: t.id.clone(),
                index,
                source,
            })?;
            if let Some(other) = keyring.by_hash.insert(hash, tenant.clone()) {
                return Err(ConfigError::SharedKey {
                    tenant: t.id.clone(),
                    other: other.id.to_string(),
                });
            }
        }
        tenants.push(tenant);
    }
    Ok((keyring, tenants))
}

fn workers(raw: Vec<RawWorker>) -> Result<Vec<WorkerConfig>, ConfigError> {
    if raw.is_empty() {
        return Err(ConfigError::NoWorkers);
    }
    let prefill_names: HashSet<&str> = raw
        .iter()
        .filter(|w| w.role == WorkerRole::Prefill)
        .map(|w| w.name.as_str())
        .collect();
    let mut seen = HashSet::new();
    let mut out = Vec::with_capacity(raw.len());
    for w in &raw {
        if !seen.insert(w.name.clone()) {
            return Err(ConfigError::DuplicateWorker {
                name: w.name.clone(),
            });
        }
        match (w.role, &w.prefill) {
            (WorkerRole::Decode, None) => {
                return Err(ConfigError::DecodeWithoutPrefill {
                    name: w.name.clone(),
                });
            }
            (WorkerRole::Decode, Some(p)) if !prefill_names.contains(p.as_str()) => {
                return Err(ConfigError::UnknownPrefill {
                    name: w.name.clone(),
                    prefill: p.clone(),
                });
            }
            (WorkerRole::Both | WorkerRole::Prefill, Some(_)) => {
                return Err(ConfigError::PrefillOnNonDecode {
                    name: w.name.clone(),
                });
            }
            _ => {}
        }
        let endpoint = worker_endpoint(&w.grpc).ok_or_else(|| ConfigError::WorkerEndpoint {
            name: w.name.clone(),
            endpoint: w.grpc.clone(),
        })?;
        out.push(WorkerConfig {
            name: w.name.clone(),
            endpoint,
            role: w.role,
            prefill: w.prefill.clone(),
        });
    }
    Ok(out)
}

/// `http://host:port` for `host:port` or `http://host:port`; `None` when it is neither.
pub fn worker_endpoint(addr: &str) -> Option<String> {
    let with_scheme = if addr.contains("://") {
        addr.to_owned()
    } else {
        format!("http://{addr}")
    };
    let uri: http::Uri = with_scheme.parse().ok()?;
    let ok = uri.scheme_str() == Some("http")
        && uri.host().is_some_and(|h| !h.is_empty())
        && uri.port_u16().is_some()
        && uri.path() == "/";
    if !ok {
        return None;
    }
    Some(format!("http://{}", uri.authority()?.as_str()))
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
        let a = c.keyring.tenant(&KeyHash::of("sk-a")).expect("a's key");
        assert_eq!(a.id.as_str(), "tenant-a");
        assert!(c.keyring.tenant(&KeyHash::of("sk-c")).is_none());
        assert_eq!(c.workers[0].endpoint, "http://127.0.0.1:50051");
        assert_eq!(c.http, HttpLimits::default());
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
            c.keyring
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
    fn worker_endpoints_are_http_host_port() {
        assert_eq!(
            worker_endpoint("127.0.0.1:5").as_deref(),
            Some("http://127.0.0.1:5")
        );
        assert_eq!(
            worker_endpoint("http://[::1]:5").as_deref(),
            Some("http://[::1]:5")
        );
        for bad in ["127.0.0.1", "https://h:5", "h:5/path", "", "http://:5"] {
            assert_eq!(worker_endpoint(bad), None, "{bad:?}");
        }
    }
}
