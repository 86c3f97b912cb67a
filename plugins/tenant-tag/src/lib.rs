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
        store(&CONFIG, parse_config::<Config>(&config)?);
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
