//! The `on-request` chain: every binding that applies, in order, sees the request (with the
//! max tokens the previous ones left) and allows it with mutations, or refuses it. The first
//! refusal ends the chain; a failing plugin refuses the request unless its binding is
//! fail-open. The result, [`RequestPolicy`], travels with the request to its end.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Instant;

use http::{HeaderMap, HeaderName, HeaderValue};

use super::bindings::{Header, Hooks, RequestView};
use super::chain::PolicySet;
use super::decision::{Decision, DecisionVerdict};
use super::handle::Policies;
use super::plugin::Fault;
use super::slots::Turn;
use super::verdict::{Checked, check};

/// What the gateway knows of a request when the chain runs (after tokenization and
/// admission, before routing).
#[derive(Debug, Clone, Copy)]
pub struct RequestFacts<'a> {
    pub id: &'a str,
    pub tenant: &'a str,
    pub model: &'a str,
    /// The API path, one of [`super::ROUTES`].
    pub route: &'a str,
    /// The client's headers (each binding sees only those it selected).
    pub headers: &'a HeaderMap,
    pub prompt_tokens: u32,
    /// The admitted max tokens.
    pub max_tokens: u32,
}

/// Why the chain refused a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// A plugin denied it (status: a 4xx).
    #[error("{message}")]
    Denied {
        plugin: Arc<str>,
        status: u16,
        message: String,
    },
    /// A plugin failed and its binding fails closed.
    #[error("policy {plugin} failed: {fault}")]
    Failed { plugin: Arc<str>, fault: Fault },
}

/// A refusal and every decision up to it (for the audit record).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    pub decisions: Vec<Decision>,
    pub refusal: Refusal,
}

/// One request's policy state, from the chain's allow to the request's end.
#[derive(Debug)]
pub struct RequestPolicy {
    pub(super) policies: Policies,
    /// The set the request started with (a reload does not change it).
    pub(super) set: Arc<PolicySet>,
    /// Indices of the bindings that apply, in order.
    pub(super) matched: Vec<usize>,
    pub(super) id: String,
    pub(super) tenant: String,
    decisions: Vec<Decision>,
    headers: Vec<(HeaderName, HeaderValue)>,
    /// Lower than the admitted max tokens, when a plugin clamped.
    clamp: Option<NonZeroU32>,
}

impl RequestPolicy {
    /// Every plugin's decision, in chain order.
    pub fn decisions(&self) -> &[Decision] {
        &self.decisions
    }

    /// The tags the plugins attached, in chain order.
    pub fn tags(&self) -> Vec<(String, String)> {
        self.decisions
            .iter()
            .flat_map(Decision::tags)
            .cloned()
            .collect()
    }

    /// The max tokens the plugins clamped the request to, when lower than admitted; the
    /// caller re-runs admission with it.
    pub fn clamp(&self) -> Option<NonZeroU32> {
        self.clamp
    }

    /// Adds the plugins' headers to a response.
    pub fn add_headers(&self, headers: &mut HeaderMap) {
        for (name, value) in &self.headers {
            headers.append(name.clone(), value.clone());
        }
        // A clamped answer ends at `length` sooner than asked: the client is told why.
        if let Some(c) = self.clamp {
            headers.insert(CLAMPED_MAX_TOKENS, HeaderValue::from(c.get()));
        }
    }
}

/// The response header that says the max tokens the policies clamped a request to.
pub const CLAMPED_MAX_TOKENS: HeaderName = HeaderName::from_static("x-bulkhead-clamped-max-tokens");

/// The headers `names` selects, each value as text: bytes past ASCII that are not UTF-8 (HTTP
/// allows them) become U+FFFD rather than hide the header from the plugin, which a client
/// could use to slip a header past a plugin that refuses it.
fn selected(headers: &HeaderMap, names: &[HeaderName]) -> Vec<Header> {
    names
        .iter()
        .flat_map(|name| {
            headers.get_all(name).iter().map(move |v| Header {
                name: name.as_str().to_owned(),
                value: String::from_utf8_lossy(v.as_bytes()).into_owned(),
            })
        })
        .collect()
}

/// What the chain allowed.
struct Chained {
    decisions: Vec<Decision>,
    headers: Vec<(HeaderName, HeaderValue)>,
    max_tokens: u32,
}

/// The `on-request` chain over the bindings `matched` of `set`.
async fn chain(
    policies: &Policies,
    set: &PolicySet,
    matched: &[usize],
    facts: &RequestFacts<'_>,
) -> Result<Chained, Refused> {
    let mut out = Chained {
        decisions: Vec::new(),
        headers: Vec::new(),
        max_tokens: facts.max_tokens,
    };
    for &i in matched {
        let binding = &set.bindings[i];
        if !binding.hooks.contains(Hooks::ON_REQUEST) {
            continue;
        }
        let plugin = &binding.plugin;
        let view = RequestView {
            request_id: facts.id.to_owned(),
            tenant: facts.tenant.to_owned(),
            model: facts.model.to_owned(),
            route: facts.route.to_owned(),
            prompt_tokens: facts.prompt_tokens,
            max_tokens: out.max_tokens,
            headers: selected(facts.headers, &binding.headers),
        };
        let started = Instant::now();
        let answer = plugin
            .on_request(&binding.configured, &view)
            .await
            .and_then(|verdict| check(verdict, facts.tenant));
        let took = started.elapsed();
        let (verdict, refusal) = match answer {
            Ok(Checked::Allow {
                tags,
                clamp,
                headers,
            }) => {
                let clamped_to = clamp.filter(|&c| c < out.max_tokens);
                if let Some(c) = clamped_to {
                    out.max_tokens = c;
                }
                let names = headers.iter().map(|(n, _)| n.as_str().to_owned()).collect();
                out.headers.extend(headers);
                let verdict = DecisionVerdict::Allow {
                    clamped_to,
                    tags,
                    headers: names,
                };
                (verdict, None)
            }
            Ok(Checked::Deny { status, message }) => (
                DecisionVerdict::Deny { status },
                Some(Refusal::Denied {
                    plugin: plugin.name.clone(),
                    status,
                    message,
                }),
            ),
            Err(fault) => {
                // A busy sandbox is not the plugin's fault: refused whatever the binding says,
                // as when no slot is free (below).
                let fail_open = binding.fail_open && !matches!(fault, Fault::Busy);
                policies.stats().fault(&plugin.name, fault.kind());
                tracing::warn!(plugin = %plugin.name, request = %facts.id, %fault,
                    fail_open, "a policy plugin failed on a request");
                let verdict = DecisionVerdict::Fault {
                    fault: fault.kind(),
                    fail_open,
                };
                let refusal = (!fail_open).then(|| Refusal::Failed {
                    plugin: plugin.name.clone(),
                    fault,
                });
                (verdict, refusal)
            }
        };
        policies
            .stats()
            .decision(&plugin.name, verdict.label(), took);
        out.decisions.push(decision(plugin, verdict));
        if let Some(refusal) = refusal {
            return Err(Refused {
                decisions: out.decisions,
                refusal,
            });
        }
    }
    Ok(out)
}

impl Policies {
    /// Runs the `on-request` chain of the active set on a request.
    pub async fn on_request(&self, facts: RequestFacts<'_>) -> Result<RequestPolicy, Refused> {
        let set = self.current();
        let matched = set.matching(facts.route, facts.tenant);
        let unchanged = || Chained {
            decisions: Vec::new(),
            headers: Vec::new(),
            max_tokens: facts.max_tokens,
        };
        let wanted = matched
            .iter()
            .any(|&i| set.bindings[i].hooks.contains(Hooks::ON_REQUEST));
        let chained = if wanted {
            match self.slot(facts.tenant, Turn::Call).await {
                Some(Ok(_slot)) => chain(self, &set, &matched, &facts).await?,
                // No slot: refused whatever the bindings say, as what it is — a full sandbox,
                // retryable. Fail-open is for a plugin's own faults: let through unchanged, a
                // tenant that floods the sandbox would skip its own policies (the fair queue
                // serves the heaviest tenant last, so its requests are the ones that wait out).
                Some(Err(fault)) => {
                    return Err(Refused {
                        decisions: Vec::new(),
                        refusal: Refusal::Failed {
                            plugin: "(sandbox)".into(),
                            fault,
                        },
                    });
                }
                None => unchanged(),
            }
        } else {
            unchanged()
        };
        Ok(RequestPolicy {
            policies: self.clone(),
            set,
            matched,
            id: facts.id.to_owned(),
            tenant: facts.tenant.to_owned(),
            clamp: (chained.max_tokens < facts.max_tokens)
                .then(|| NonZeroU32::new(chained.max_tokens))
                .flatten(),
            decisions: chained.decisions,
            headers: chained.headers,
        })
    }
}

fn decision(plugin: &super::plugin::Loaded, verdict: DecisionVerdict) -> Decision {
    Decision {
        plugin: plugin.name.to_string(),
        sha256: plugin.digest,
        verdict,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_selected_header_whose_value_is_not_utf8_is_seen_not_hidden() {
        let mut headers = HeaderMap::new();
        headers.append("x-flag", HeaderValue::from_static("plain"));
        let odd = HeaderValue::from_bytes(b"odd\x80").expect("HTTP allows the byte");
        headers.append("x-flag", odd);
        headers.append("x-other", HeaderValue::from_static("not selected"));
        let seen = selected(&headers, &[HeaderName::from_static("x-flag")]);
        let values: Vec<&str> = seen.iter().map(|h| h.value.as_str()).collect();
        assert_eq!(values, ["plain", "odd\u{FFFD}"]);
        assert!(seen.iter().all(|h| h.name == "x-flag"));
    }
}
