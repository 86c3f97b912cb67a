//! `length-limit`: refuses prompts over `max_prompt_tokens` and keeps prompt + max tokens within
//! `max_total_tokens` (clamping max tokens when the prompt leaves room, refusing otherwise).
//! Per-tenant and per-route overrides take the smallest of every limit that applies.

use std::collections::BTreeMap;

use bulkhead_policy_guest::{
    ConfigSlot, Directive, Disconnect, Guest, Hooks, Mutations, RequestView, ResponseEnd, Verdict,
    allow, configured, deny, parse_config, store,
};
use serde::Deserialize;

#[derive(Debug, Default, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
struct Limits {
    max_prompt_tokens: Option<u32>,
    max_total_tokens: Option<u32>,
}

impl Limits {
    /// The tighter of two limit sets, field by field.
    fn and(self, other: Limits) -> Limits {
        let min = |a: Option<u32>, b: Option<u32>| match (a, b) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        Limits {
            max_prompt_tokens: min(self.max_prompt_tokens, other.max_prompt_tokens),
            max_total_tokens: min(self.max_total_tokens, other.max_total_tokens),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    #[serde(flatten)]
    default: Limits,
    #[serde(default)]
    tenants: BTreeMap<String, Limits>,
    #[serde(default)]
    routes: BTreeMap<String, Limits>,
}

/// The status of every refusal: the request is too long, like the gateway's own
/// `context_length_exceeded`.
const TOO_LONG: u16 = 400;

struct LengthLimit;

fn decide(config: &Config, request: &RequestView) -> Verdict {
    let limits = [
        config.tenants.get(&request.tenant),
        config.routes.get(&request.route),
    ]
    .into_iter()
    .flatten()
    .fold(config.default, |acc, l| acc.and(*l));
    if let Some(max) = limits.max_prompt_tokens
        && request.prompt_tokens > max
    {
        return deny(
            TOO_LONG,
            format!(
                "the prompt has {} tokens; this policy allows at most {max}",
                request.prompt_tokens
            ),
        );
    }
    let Some(total) = limits.max_total_tokens else {
        return allow();
    };
    let room = total.saturating_sub(request.prompt_tokens);
    if room == 0 {
        return deny(
            TOO_LONG,
            format!(
                "the prompt has {} tokens and leaves no room to generate under this policy's \
                 limit of {total} tokens in all",
                request.prompt_tokens
            ),
        );
    }
    Verdict::Allow(Mutations {
        tags: Vec::new(),
        clamp_max_tokens: (request.max_tokens > room).then_some(room),
        add_headers: Vec::new(),
    })
}

thread_local! {
    static CONFIG: ConfigSlot<Config> = const { ConfigSlot::new(None) };
}

impl Guest for LengthLimit {
    fn configure(config: String) -> Result<Hooks, String> {
        let config: Config = parse_config(&config)?;
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

bulkhead_policy_guest::export!(LengthLimit with_types_in bulkhead_policy_guest::bindings);
