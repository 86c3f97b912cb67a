//! Reading a policy set file into a validated [`PolicySet`]: every plugin's bytes checked
//! against its sha256 pin, compiled (or read from the cache) and pre-instantiated; every
//! binding's configuration validated against the JSON Schema beside its plugin, then offered
//! to the plugin's own `configure` (and the configured plugin snapshotted, where it can be:
//! see `snapshot.rs`). Any failure refuses the whole set and says where.
//!
//! ```toml
//! [plugins.length-limit]
//! component = "../plugins/dist/length-limit.wasm"  # relative to this file; the schema is
//! sha256 = "…64 hex…"                              # length-limit.schema.json beside it
//! memory_mib = 16                                   # optional (default 16)
//! timeout_ms = 50                                   # optional (default 50)
//!
//! [[chain]]                                         # in order
//! plugin = "length-limit"
//! routes = ["/v1/chat/completions"]                 # optional: every route
//! tenants = ["tenant-a"]                            # optional: every tenant
//! headers = ["x-project"]                           # request headers the plugin sees
//! fail_open = false                                 # a failing plugin fails the request
//! config = { max_prompt_tokens = 4096 }             # JSON for the plugin, schema-checked
//! ```

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use http::HeaderName;
use serde::Deserialize;

use super::chain::{Binding, PolicySet};
use super::digest::Digest;
use super::plugin::{CallLimits, Fault, Loaded};
use super::sandbox::Sandbox;
use super::snapshot::Snapshotter;

use crate::toml_errors::{self, TomlError};

/// The API routes a binding may name.
pub const ROUTES: [&str; 2] = ["/v1/chat/completions", "/v1/completions"];

/// Headers no plugin may see: credentials.
const SECRET_HEADERS: [&str; 4] = [
    "authorization",
    "cookie",
    "proxy-authorization",
    "x-api-key",
];

const DEFAULT_MEMORY_MIB: u32 = 16;
const DEFAULT_TIMEOUT_MS: u64 = 50;

/// Why a policy set is refused.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error(
        "{path} has no chain: a policy set lists its bindings as [[chain]] tables (write \
         `chain = []` to run no policy); an empty or truncated file is never taken for one"
    )]
    NoChain { path: String },
    #[error("plugin {plugin:?}: cannot read its {what} {path}: {source}")]
    PluginFile {
        plugin: String,
        what: &'static str,
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Toml { path: String, source: TomlError },
    #[error("plugin {plugin:?}: {field} = {value:?} is not 64 hex digits")]
    BadPin {
        plugin: String,
        field: &'static str,
        value: String,
    },
    #[error(
        "plugin {plugin:?}: {path} has sha256 {actual}, but the set pins {pinned}: pin the \
         component you mean to run (its sha256sum), or put back the one pinned"
    )]
    PinMismatch {
        plugin: String,
        path: String,
        pinned: Digest,
        actual: Digest,
    },
    #[error(
        "plugin {plugin:?}: its schema {path} has sha256 {actual}, but the set pins {pinned} \
         (schema_sha256): pin the schema you mean to check configurations with, or put back \
         the one pinned"
    )]
    SchemaPinMismatch {
        plugin: String,
        path: String,
        pinned: Digest,
        actual: Digest,
    },
    #[error("plugin {plugin:?}: {field} {reason}")]
    Limit {
        plugin: String,
        field: &'static str,
        reason: String,
    },
    #[error("plugin {plugin:?}: its schema {path} is not a usable JSON Schema: {reason}")]
    Schema {
        plugin: String,
        path: String,
        reason: String,
    },
    #[error("plugin {plugin:?}: cannot compile {path}: {reason}")]
    Compile {
        plugin: String,
        path: String,
        reason: String,
    },
    #[error("chain[{index}] ({plugin}): an empty tenant name in `tenants` matches no tenant")]
    EmptyTenant { index: usize, plugin: String },
    #[error(
        "chain[{index}] ({plugin}): `{field} = []` matches nothing, so the binding would never \
         apply: leave `{field}` out to apply it to every one, or remove the binding"
    )]
    MatchesNothing {
        index: usize,
        plugin: String,
        field: &'static str,
    },
    #[error("chain[{index}]: plugin {plugin:?} is not defined under [plugins]")]
    UnknownPlugin { index: usize, plugin: String },
    #[error(
        "plugin {plugin:?}: a plugin's name is 1 to {MAX_PLUGIN_NAME} letters, digits, `-`, `_` \
         or `.` (it names the plugin in metrics, logs and audit records)"
    )]
    BadName { plugin: String },
    #[error("chain[{index}] ({plugin}): route {route:?} is not one of {ROUTES:?}")]
    UnknownRoute {
        index: usize,
        plugin: String,
        route: String,
    },
    #[error("chain[{index}] ({plugin}): header {header:?} {reason}")]
    Header {
        index: usize,
        plugin: String,
        header: String,
        reason: &'static str,
    },
    #[error("chain[{index}] ({plugin}): the configuration does not match its schema: {errors}")]
    InvalidConfig {
        index: usize,
        plugin: String,
        errors: String,
    },
    #[error("chain[{index}] ({plugin}): configuring the plugin failed: it {fault}")]
    Configure {
        index: usize,
        plugin: String,
        fault: Fault,
    },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSet {
    #[serde(default)]
    plugins: BTreeMap<String, RawPlugin>,
    /// `None`: the file does not say (an empty or truncated file), never taken as no policy.
    chain: Option<Vec<RawBinding>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPlugin {
    component: PathBuf,
    sha256: String,
    /// The sha256 of the schema beside the component, when the set pins it too (without it,
    /// whoever can replace the schema file can loosen what configurations pass).
    schema_sha256: Option<String>,
    memory_mib: Option<u32>,
    timeout_ms: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBinding {
    plugin: String,
    routes: Option<Vec<String>>,
    tenants: Option<Vec<String>>,
    #[serde(default)]
    headers: Vec<String>,
    #[serde(default)]
    fail_open: bool,
    #[serde(default)]
    config: toml::Table,
}

/// A plugin of the set, loaded, its configuration schema, and what snapshots its bindings
/// (`None`: it cannot be snapshotted), kept only while the set loads.
struct Prepared {
    loaded: Arc<Loaded>,
    schema: jsonschema::Validator,
    snapshotter: Option<Snapshotter>,
}

/// Reads, checks and loads the policy set at `path` (component paths are relative to it).
pub(super) fn load(sandbox: &Sandbox, path: &Path) -> Result<PolicySet, LoadError> {
    load_text(sandbox, path, &read(path)?)
}

/// Checks and loads `text`, the policy set read from `path`.
pub(super) fn load_text(
    sandbox: &Sandbox,
    path: &Path,
    text: &[u8],
) -> Result<PolicySet, LoadError> {
    let started = SystemTime::now();
    let raw: RawSet =
        toml_errors::parse(&String::from_utf8_lossy(text)).map_err(|source| LoadError::Toml {
            path: path.display().to_string(),
            source,
        })?;
    let chain = raw.chain.ok_or_else(|| LoadError::NoChain {
        path: path.display().to_string(),
    })?;
    let base = path.parent().unwrap_or(Path::new("."));
    let mut plugins = HashMap::new();
    // Only the plugins some binding uses are loaded.
    let used: HashSet<&str> = chain.iter().map(|b| b.plugin.as_str()).collect();
    for (name, p) in raw
        .plugins
        .iter()
        .filter(|(n, _)| used.contains(n.as_str()))
    {
        if !is_plugin_name(name) {
            return Err(LoadError::BadName {
                plugin: bulkhead_worker::printable::printable(name, MAX_PLUGIN_NAME),
            });
        }
        plugins.insert(name.as_str(), prepare(sandbox, base, name, p)?);
    }
    let mut bindings = Vec::with_capacity(chain.len());
    for (index, b) in chain.into_iter().enumerate() {
        let prepared = plugins
            .get(b.plugin.as_str())
            .ok_or_else(|| LoadError::UnknownPlugin {
                index,
                plugin: b.plugin.clone(),
            })?;
        bindings.push(bind(index, b, prepared)?);
    }
    // Only a set that loads prunes: a refused one leaves the active set's entries as they were.
    sandbox.prune_cache(started);
    Ok(PolicySet::new(bindings, Digest::of(text)))
}

/// The longest name a plugin may have.
const MAX_PLUGIN_NAME: usize = 64;

/// Whether `name` may name a plugin: it goes unquoted into Prometheus labels and log lines.
fn is_plugin_name(name: &str) -> bool {
    (1..=MAX_PLUGIN_NAME).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
}

/// The policy set file's bytes.
pub(super) fn read(path: &Path) -> Result<Vec<u8>, LoadError> {
    bulkhead_worker::regular_file::read(path).map_err(|source| LoadError::Read {
        path: path.display().to_string(),
        source,
    })
}

/// A file of plugin `name`'s, read.
fn plugin_file(name: &str, what: &'static str, path: &Path) -> Result<Vec<u8>, LoadError> {
    bulkhead_worker::regular_file::read(path).map_err(|source| LoadError::PluginFile {
        plugin: name.to_owned(),
        what,
        path: path.display().to_string(),
        source,
    })
}

fn prepare(
    sandbox: &Sandbox,
    base: &Path,
    name: &str,
    raw: &RawPlugin,
) -> Result<Prepared, LoadError> {
    let pin = |field, value: &String| {
        Digest::from_hex(value).ok_or_else(|| LoadError::BadPin {
            plugin: name.to_owned(),
            field,
            value: value.clone(),
        })
    };
    let pinned = pin("sha256", &raw.sha256)?;
    let schema_pin = raw
        .schema_sha256
        .as_ref()
        .map(|value| pin("schema_sha256", value))
        .transpose()?;
    let path = base.join(&raw.component);
    let bytes = plugin_file(name, "component", &path)?;
    let actual = Digest::of(&bytes);
    if actual != pinned {
        return Err(LoadError::PinMismatch {
            plugin: name.to_owned(),
            path: path.display().to_string(),
            pinned,
            actual,
        });
    }
    let limits = limits(sandbox, name, raw)?;
    let schema = schema(name, &path.with_extension("schema.json"), schema_pin)?;
    let (pre, compiled) = sandbox
        .prepare(&bytes, &actual)
        .map_err(|e| LoadError::Compile {
            plugin: name.to_owned(),
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
    let snapshotter = Snapshotter::new(sandbox, &pre.pre, &bytes)
        .inspect_err(|reason| {
            tracing::info!(plugin = name, %reason,
                "policy plugin not snapshotted: each call runs its configure");
        })
        .ok();
    tracing::debug!(plugin = name, sha256 = %actual, ?compiled, "policy plugin loaded");
    if schema_pin.is_none() {
        tracing::warn!(plugin = name, "{}", unpinned_schema(name));
    }
    let loaded = Loaded::new(
        name.into(),
        actual,
        schema_pin,
        pre,
        limits,
        sandbox.clone(),
    );
    Ok(Prepared {
        loaded: Arc::new(loaded),
        schema,
        snapshotter,
    })
}

/// What `GET /policies` and the log say of a plugin whose schema the set does not pin.
pub(super) fn unpinned_schema(plugin: &str) -> String {
    format!(
        "plugin {plugin:?}: its schema is not pinned (schema_sha256): whoever can replace the \
         schema beside its component can loosen what configurations pass"
    )
}

fn limits(sandbox: &Sandbox, name: &str, raw: &RawPlugin) -> Result<CallLimits, LoadError> {
    let err = |field, reason: String| LoadError::Limit {
        plugin: name.to_owned(),
        field,
        reason,
    };
    let mib = raw.memory_mib.unwrap_or(DEFAULT_MEMORY_MIB);
    let memory_bytes = (mib as usize).saturating_mul(1 << 20);
    let max = sandbox.settings.max_memory_bytes;
    if mib == 0 || memory_bytes > max {
        return Err(err(
            "memory_mib",
            format!("must be between 1 and {} (the sandbox's limit)", max >> 20),
        ));
    }
    let ms = raw.timeout_ms.unwrap_or(DEFAULT_TIMEOUT_MS);
    if !(1..=10_000).contains(&ms) {
        return Err(err("timeout_ms", "must be between 1 and 10000".into()));
    }
    Ok(CallLimits {
        memory_bytes,
        timeout: Duration::from_millis(ms),
    })
}

fn schema(
    name: &str,
    path: &Path,
    pinned: Option<Digest>,
) -> Result<jsonschema::Validator, LoadError> {
    let err = |reason: String| LoadError::Schema {
        plugin: name.to_owned(),
        path: path.display().to_string(),
        reason,
    };
    let text = plugin_file(name, "schema", path)?;
    let actual = Digest::of(&text);
    if let Some(pinned) = pinned.filter(|p| *p != actual) {
        return Err(LoadError::SchemaPinMismatch {
            plugin: name.to_owned(),
            path: path.display().to_string(),
            pinned,
            actual,
        });
    }
    let value: serde_json::Value = serde_json::from_slice(&text).map_err(|e| err(e.to_string()))?;
    jsonschema::validator_for(&value).map_err(|e| err(e.to_string()))
}

fn bind(index: usize, raw: RawBinding, prepared: &Prepared) -> Result<Binding, LoadError> {
    let plugin = raw.plugin;
    if let Some(route) = raw
        .routes
        .iter()
        .flatten()
        .find(|r| !ROUTES.contains(&r.as_str()))
    {
        return Err(LoadError::UnknownRoute {
            index,
            plugin,
            route: route.clone(),
        });
    }
    if raw.tenants.iter().flatten().any(String::is_empty) {
        return Err(LoadError::EmptyTenant { index, plugin });
    }
    for (field, empty) in [
        ("tenants", raw.tenants.as_ref().is_some_and(Vec::is_empty)),
        ("routes", raw.routes.as_ref().is_some_and(Vec::is_empty)),
    ] {
        if empty {
            return Err(LoadError::MatchesNothing {
                index,
                plugin,
                field,
            });
        }
    }
    let mut headers = Vec::with_capacity(raw.headers.len());
    for h in &raw.headers {
        let header_err = |reason| LoadError::Header {
            index,
            plugin: plugin.clone(),
            header: h.clone(),
            reason,
        };
        let name = HeaderName::from_bytes(h.as_bytes())
            .map_err(|_| header_err("is not a valid header name"))?;
        if SECRET_HEADERS.contains(&name.as_str()) {
            return Err(header_err("carries credentials; no plugin may see it"));
        }
        // Removed before any plugin runs: a rule on it would never see a value.
        if crate::auth::claims_a_tenant(name.as_str()) {
            return Err(header_err(
                "could claim a tenant, so the gateway removes it from every request",
            ));
        }
        headers.push(name);
    }
    let config = serde_json::to_value(&raw.config).map_err(|e| LoadError::InvalidConfig {
        index,
        plugin: plugin.clone(),
        errors: e.to_string(),
    })?;
    let errors: Vec<String> = prepared
        .schema
        .iter_errors(&config)
        .map(|e| {
            let at = e.instance_path().to_string();
            let at = if at.is_empty() { "/".to_owned() } else { at };
            format!("at {at}: {}", e.masked())
        })
        .collect();
    if !errors.is_empty() {
        return Err(LoadError::InvalidConfig {
            index,
            plugin,
            errors: errors.join("; "),
        });
    }
    let (hooks, configured) = prepared
        .loaded
        .configure(&config.to_string(), prepared.snapshotter.as_ref())
        .map_err(|fault| LoadError::Configure {
            index,
            plugin: plugin.clone(),
            fault,
        })?;
    Ok(Binding {
        plugin: prepared.loaded.clone(),
        configured,
        routes: raw.routes,
        tenants: raw.tenants.map(|t| t.into_iter().collect()),
        headers,
        fail_open: raw.fail_open,
        hooks,
    })
}
