//! `tenant-tag`: tags every request with `tenant=<id>` and the tenant's configured labels
//! (cost center, tier, …), which the gateway carries into the audit record (with the decision
//! of the plugin that attached them) and the trace (the policy span); optionally echoes chosen labels to the client as `x-bulkhead-<label>` headers.

use std::collections::BTreeMap;

use bulkhead_policy_guest::{
    ConfigSlot, Directive, Disconnect, Guest, Header, Hooks, Mutations, RequestView, ResponseEnd,
    Tag, Verdict, configured, parse_config, store,
};
use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    /// Labels of tenants not listed in `tenants`.
    #[serde(default)]
    default: BTreeMap<String, String>,
    /// Each tenant's labels (replacing `default` key by key).
    #[serde(default)]
    tenants: BTreeMap<String, BTreeMap<String, String>>,
    /// Labels also sent back as response headers `x-bulkhead-<label>`.
    #[serde(default)]
    echo: Vec<String>,
}

/// Label names that are the gateway's: a label `tenant` would be a second `tenant` tag beside
/// the authenticated one, and echoed, `tenant` and `clamped_max_tokens` name response headers
/// the gateway keeps for itself (it refuses them from a plugin, failing every request).
const RESERVED: [&str; 2] = ["tenant", "clamped_max_tokens"];

/// The most tags the gateway takes from one plugin's answer, `tenant=<id>` among them.
const MAX_TAGS: usize = 32;

/// The most headers the gateway takes from one plugin's answer.
const MAX_HEADERS: usize = 16;

/// What `configure` refuses rather than fail every request with: a reserved label name, more
/// labels for a tenant than the gateway takes, or more echoed than it takes headers.
fn check(config: &Config) -> Result<(), String> {
    let tenants = config.tenants.iter().map(|(t, own)| (t.as_str(), own));
    for (whose, labels) in std::iter::once(("default", &config.default)).chain(tenants) {
        if let Some(name) = labels.keys().find(|k| RESERVED.contains(&k.as_str())) {
            return Err(format!(
                "label {name:?} of {whose} is a name the gateway keeps"
            ));
        }
        let merged = config.default.keys().chain(labels.keys());
        let count = merged.collect::<std::collections::BTreeSet<_>>().len();
        if count >= MAX_TAGS {
            return Err(format!(
                "{whose} has {count} labels: at most {} beside its tenant tag",
                MAX_TAGS - 1
            ));
        }
    }
    if config.echo.len() > MAX_HEADERS {
        return Err(format!(
            "{} labels echoed: at most {MAX_HEADERS}",
            config.echo.len()
        ));
    }
    match config.echo.iter().find(|l| RESERVED.contains(&l.as_str())) {
        Some(name) => Err(format!(
            "label {name:?} cannot be echoed: the gateway sets that header"
        )),
        None => Ok(()),
    }
}

thread_local! {
    static CONFIG: ConfigSlot<Config> = const { ConfigSlot::new(None) };
}

fn decide(config: &Config, request: &RequestView) -> Verdict {
    let mut labels = config.default.clone();
    if let Some(own) = config.tenants.get(&request.tenant) {
        labels.extend(own.iter().map(|(k, v)| (k.clone(), v.clone())));
    }
    let add_headers = config
        .echo
        .iter()
        .filter_map(|label| {
            labels.get(label).map(|value| Header {
                name: format!("x-bulkhead-{}", label.replace('_', "-")),
                value: value.clone(),
            })
        })
        .collect();
    let tags = std::iter::once(Tag {
        key: "tenant".into(),
        value: request.tenant.clone(),
    })
    .chain(labels.into_iter().map(|(key, value)| Tag { key, value }))
    .collect();
    Verdict::Allow(Mutations {
        tags,
        clamp_max_tokens: None,
        add_headers,
    })
}

struct TenantTag;

impl Guest for TenantTag {
    fn configure(config: String) -> Result<Hooks, String> {
        let config = parse_config::<Config>(&config)?;
        check(&config)?;
        store(&CONFIG, config);
        Ok(Hooks::ON_REQUEST)
    }

    fn on_request(request: RequestView) -> Verdict {
        configured(&CONFIG, |config| decide(config, &request))
    }

    fn on_disconnect(_: Disconnect) -> Directive {
        Directive::AbortNow
    }

    fn on_response_end(_: ResponseEnd) {}
}

bulkhead_policy_guest::export!(TenantTag with_types_in bulkhead_policy_guest::bindings);
