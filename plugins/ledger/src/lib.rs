//! `ledger`: a test plugin for the end of a request. It writes every `on-response-end` it gets
//! to the gateway's log (`end <request> <outcome> <prompt>+<completion>`), as an accounting
//! policy would, and answers every `on-disconnect` with its configured directive, whatever the
//! phase, logging the phase it was told (`disconnect <request> <phase>`). A test reads the
//! gateway's metrics and log to see both hooks run for every request that passed `on-request`.

use bulkhead_policy_guest::{
    ConfigSlot, Directive, Disconnect, Guest, Hooks, Level, Outcome, Phase, RequestView,
    ResponseEnd, Verdict, allow, configured, log, parse_config, store,
};
use serde::Deserialize;

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "kebab-case")]
enum Answer {
    AbortNow,
    HoldUntilPrefillDone,
    HoldUntilFirstToken,
    HoldUntilComplete,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    on_disconnect: Answer,
}

thread_local! {
    static CONFIG: ConfigSlot<Config> = const { ConfigSlot::new(None) };
}

struct Ledger;

impl Guest for Ledger {
    fn configure(config: String) -> Result<Hooks, String> {
        store(&CONFIG, parse_config::<Config>(&config)?);
        Ok(Hooks::ON_DISCONNECT | Hooks::ON_RESPONSE_END)
    }

    fn on_request(_: RequestView) -> Verdict {
        allow()
    }

    fn on_disconnect(event: Disconnect) -> Directive {
        let phase = match event.phase {
            Phase::Queued => "queued",
            Phase::Prefilling => "prefilling",
            Phase::Transferring => "transferring",
            Phase::Decoding => "decoding",
        };
        log(
            Level::Info,
            &format!("disconnect {} {phase}", event.request_id),
        );
        configured(&CONFIG, |c| match c.on_disconnect {
            Answer::AbortNow => Directive::AbortNow,
            Answer::HoldUntilPrefillDone => Directive::HoldUntilPrefillDone,
            Answer::HoldUntilFirstToken => Directive::HoldUntilFirstToken,
            Answer::HoldUntilComplete => Directive::HoldUntilComplete,
        })
    }

    fn on_response_end(event: ResponseEnd) {
        let outcome = match event.outcome {
            Outcome::Completed => "completed",
            Outcome::ClientDisconnected => "client-disconnected",
            Outcome::Failed => "failed",
        };
        let usage = event.usage;
        log(
            Level::Info,
            &format!(
                "end {} {outcome} {}+{}",
                event.request_id, usage.prompt_tokens, usage.completion_tokens
            ),
        );
    }
}

bulkhead_policy_guest::export!(Ledger with_types_in bulkhead_policy_guest::bindings);
