//! `ledger`: a test plugin for the end of a request. It writes every `on-response-end` it gets
//! to the gateway's log (`end <request> <outcome> <prompt>+<completion>`), as an accounting
//! policy would, and answers an `on-disconnect` in one of its configured phases with its
//! configured directive (abort-now in the others), logging the phase it was told
//! (`disconnect <request> <phase>`). A test reads the gateway's metrics to see both hooks run
//! for every request that passed `on-request`, and the directive to see the phase.

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

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
enum When {
    Queued,
    Prefilling,
    Transferring,
    Decoding,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    on_disconnect: Answer,
    phases: Vec<When>,
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
        let (when, phase) = match event.phase {
            Phase::Queued => (When::Queued, "queued"),
            Phase::Prefilling => (When::Prefilling, "prefilling"),
            Phase::Transferring => (When::Transferring, "transferring"),
            Phase::Decoding => (When::Decoding, "decoding"),
        };
        log(
            Level::Info,
            &format!("disconnect {} {phase}", event.request_id),
        );
        configured(&CONFIG, |c| {
            if !c.phases.contains(&when) {
                return Directive::AbortNow;
            }
            match c.on_disconnect {
                Answer::AbortNow => Directive::AbortNow,
                Answer::HoldUntilPrefillDone => Directive::HoldUntilPrefillDone,
                Answer::HoldUntilFirstToken => Directive::HoldUntilFirstToken,
                Answer::HoldUntilComplete => Directive::HoldUntilComplete,
            }
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
