//! `abort-guard`: when a client disconnects, the worker is not interrupted mid-prefill or
//! mid-transfer (the bug class where an abort races the KV handoff): the gateway keeps reading
//! the worker's stream until the first token (which is when prefill is done and its pages were
//! handed off), then cancels cleanly. Requests still queued, or already decoding, are cancelled
//! at once. At most `max_held_per_tenant` abandoned requests of one tenant are held at a time;
//! past that the gateway cancels at once.

use bulkhead_policy_guest::{
    ConfigSlot, Directive, Disconnect, Guest, Hooks, Phase, RequestView, ResponseEnd, Verdict,
    allow, configured, parse_config, store,
};
use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    max_held_per_tenant: u32,
}

thread_local! {
    static CONFIG: ConfigSlot<Config> = const { ConfigSlot::new(None) };
}

fn decide(config: &Config, event: &Disconnect) -> Directive {
    if event.held_for_tenant >= config.max_held_per_tenant {
        return Directive::AbortNow;
    }
    match event.phase {
        Phase::Queued | Phase::Decoding => Directive::AbortNow,
        Phase::Prefilling => Directive::HoldUntilPrefillDone,
        Phase::Transferring => Directive::HoldUntilFirstToken,
    }
}

struct AbortGuard;

impl Guest for AbortGuard {
    fn configure(config: String) -> Result<Hooks, String> {
        store(&CONFIG, parse_config::<Config>(&config)?);
        Ok(Hooks::ON_DISCONNECT)
    }

    fn on_request(_: RequestView) -> Verdict {
        allow()
    }

    fn on_disconnect(event: Disconnect) -> Directive {
        configured(&CONFIG, |config| decide(config, &event))
    }

    fn on_response_end(_: ResponseEnd) {}
}

bulkhead_policy_guest::export!(AbortGuard with_types_in bulkhead_policy_guest::bindings);
