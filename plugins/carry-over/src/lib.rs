//! `carry-over`: a test plugin that tries to carry data from one call to the next. Its
//! instance remembers the tenant of every request it sees and tags the next one with it
//! (`previous`, `none` when it saw none), and counts its calls (`calls`); it also tags its
//! configured `label`, so a test sees the configuration reached the call. In an instance that
//! served tenant-a, a request of tenant-b would be tagged `previous=tenant-a`: the gateway's
//! fresh instance per call must keep that from ever happening.

use std::cell::{Cell, RefCell};

use bulkhead_policy_guest::{
    ConfigSlot, Directive, Disconnect, Guest, Hooks, Mutations, RequestView, ResponseEnd, Tag,
    Verdict, configured, parse_config, store,
};
use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    label: String,
}

thread_local! {
    static CONFIG: ConfigSlot<Config> = const { ConfigSlot::new(None) };
    static PREVIOUS: RefCell<Option<String>> = const { RefCell::new(None) };
    static CALLS: Cell<u32> = const { Cell::new(0) };
}

fn tag(key: &str, value: String) -> Tag {
    Tag {
        key: key.into(),
        value,
    }
}

struct CarryOver;

impl Guest for CarryOver {
    fn configure(config: String) -> Result<Hooks, String> {
        store(&CONFIG, parse_config::<Config>(&config)?);
        Ok(Hooks::ON_REQUEST)
    }

    fn on_request(request: RequestView) -> Verdict {
        let previous = PREVIOUS.with(|p| p.replace(Some(request.tenant.clone())));
        let calls = CALLS.with(|c| {
            c.set(c.get() + 1);
            c.get()
        });
        let label = configured(&CONFIG, |c| c.label.clone());
        Verdict::Allow(Mutations {
            tags: vec![
                tag("previous", previous.unwrap_or_else(|| "none".into())),
                tag("calls", calls.to_string()),
                tag("label", label),
            ],
            clamp_max_tokens: None,
            add_headers: Vec::new(),
        })
    }

    fn on_disconnect(_: Disconnect) -> Directive {
        Directive::AbortNow
    }

    fn on_response_end(_: ResponseEnd) {}
}

bulkhead_policy_guest::export!(CarryOver with_types_in bulkhead_policy_guest::bindings);
