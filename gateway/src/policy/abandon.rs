//! The end of a request: `on-response-end` for accounting, and — when the client went away
//! before the end — `on-disconnect`, whose directive says how long the gateway keeps reading
//! the worker's stream before dropping it (dropping it cancels the request at the worker).
//!
//! ```text
//!  client gone ─▶ directive ─┬─ abort-now ──────────────────────────────────▶ drop stream
//!                            ├─ hold-until-prefill-done ─┐ (the first token is when the
//!                            ├─ hold-until-first-token ──┴─ gateway sees prefill done) ─▶ drop
//!                            └─ hold-until-complete ──── until Done ────────────────────▶ drop
//!  each hold is bounded by the hold limit; then on-response-end(client-disconnected)
//! ```
//!
//! The gateway sees one stream (to the decode or colocated worker), so it reports the phase
//! as `prefilling` until the first token and `decoding` after.

use std::sync::Arc;
use std::time::Instant;

use bulkhead_audit::{self as audit, Dropped, Hold};
use bulkhead_worker::serve::proto::Item;

use crate::limits::RequestPermit;
use crate::trail::Trail;
use crate::upstreams::UpstreamStream;
use crate::workers::Claim;

use super::bindings::{Directive, Disconnect, Hooks, Outcome, Phase, ResponseEnd, Usage};
use super::chain::{Binding, Hook, PolicySet};
use super::handle::Policies;
use super::request::RequestPolicy;

/// How far a request got, as the gateway saw it.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// Token messages received from the worker.
    pub tokens: u32,
    /// (prompt, completion) tokens, once the worker said Done.
    pub usage: Option<(u32, u32)>,
    /// The request failed (before or after its 200).
    pub failed: bool,
}

impl Progress {
    /// The tokens the request used as far as it got: the worker's usage once it said Done,
    /// else the prompt (`prompt_tokens`, as admitted) and the tokens that came.
    pub fn used(&self, prompt_tokens: u32) -> u64 {
        match self.usage {
            Some((prompt, completion)) => u64::from(prompt) + u64::from(completion),
            None => u64::from(prompt_tokens) + u64::from(self.tokens),
        }
    }
}

/// A request's claim on its tenant's budget, handed over with its end: an abandoned request
/// keeps its concurrency slot while its stream is held, and is charged its prompt and the
/// tokens that came (until the hold ended), not its whole `max_tokens`.
#[derive(Debug)]
pub struct Charge {
    pub permit: RequestPermit,
    /// The prompt's tokens, as admitted.
    pub prompt_tokens: u32,
    /// The request's tokens on its worker, which it loads until the hold ends.
    pub claim: Option<Claim>,
}

impl Charge {
    /// Settles the charge to what the request used, as far as `progress` got.
    fn settle(mut self, progress: Progress) {
        self.permit.set_used(progress.used(self.prompt_tokens));
    }
}

/// The directive a failing `on-disconnect` plugin gets when its binding fails closed: the
/// design's default (never abort before the first token).
const ON_FAULT: Directive = Directive::HoldUntilFirstToken;

fn rank(d: Directive) -> u8 {
    match d {
        Directive::AbortNow => 0,
        Directive::HoldUntilPrefillDone => 1,
        Directive::HoldUntilFirstToken => 2,
        Directive::HoldUntilComplete => 3,
    }
}

/// The directive as the audit record names it.
fn recorded(d: Directive) -> audit::Directive {
    match d {
        Directive::AbortNow => audit::Directive::AbortNow,
        Directive::HoldUntilPrefillDone => audit::Directive::HoldUntilPrefillDone,
        Directive::HoldUntilFirstToken => audit::Directive::HoldUntilFirstToken,
        Directive::HoldUntilComplete => audit::Directive::HoldUntilComplete,
    }
}

/// What the end of a request needs, owned (it may run in a task after the response is gone).
struct Ending {
    policies: Policies,
    set: Arc<PolicySet>,
    matched: Vec<usize>,
    id: String,
    tenant: String,
}

impl Ending {
    fn wanting(&self, hook: Hooks) -> impl Iterator<Item = &Binding> {
        self.matched
            .iter()
            .map(|&i| &self.set.bindings[i])
            .filter(move |b| b.hooks.contains(hook))
    }

    /// The longest hold any `on-disconnect` plugin asks for (abort-now when none asks).
    async fn directive(&self, progress: Progress, held_for_tenant: u32) -> Directive {
        let event = Disconnect {
            request_id: self.id.clone(),
            tenant: self.tenant.clone(),
            phase: if progress.tokens == 0 {
                Phase::Prefilling
            } else {
                Phase::Decoding
            },
            tokens_so_far: progress.tokens,
            held_for_tenant,
        };
        let mut directive = Directive::AbortNow;
        for b in self.wanting(Hooks::ON_DISCONNECT) {
            let started = Instant::now();
            let answer = b.plugin.on_disconnect(&b.configured, &event).await;
            let stats = self.policies.stats();
            stats.call(&b.plugin.name, Hook::Disconnect, started.elapsed());
            let d = match answer {
                Ok(d) => d,
                Err(fault) => {
                    stats.fault(&b.plugin.name, fault.kind());
                    tracing::warn!(plugin = %b.plugin.name, request = %self.id, %fault,
                        "a policy plugin failed on a disconnect");
                    if b.fail_open {
                        continue;
                    }
                    ON_FAULT
                }
            };
            if rank(d) > rank(directive) {
                directive = d;
            }
        }
        directive
    }

    /// `on-response-end` of every plugin that asked.
    async fn response_end(&self, outcome: Outcome, usage: (u32, u32)) {
        let event = ResponseEnd {
            request_id: self.id.clone(),
            tenant: self.tenant.clone(),
            usage: Usage {
                prompt_tokens: usage.0,
                completion_tokens: usage.1,
            },
            outcome,
        };
        for b in self.wanting(Hooks::ON_RESPONSE_END) {
            let started = Instant::now();
            let answer = b.plugin.on_response_end(&b.configured, &event).await;
            let stats = self.policies.stats();
            stats.call(&b.plugin.name, Hook::ResponseEnd, started.elapsed());
            if let Err(fault) = answer {
                stats.fault(&b.plugin.name, fault.kind());
                tracing::warn!(plugin = %b.plugin.name, request = %self.id, %fault,
                    "a policy plugin failed at a response's end");
            }
        }
    }

    /// [`Ending::response_end`] in an instance slot, when some plugin asked for it.
    async fn end(self: Arc<Self>, outcome: Outcome, usage: (u32, u32)) {
        if self.wanting(Hooks::ON_RESPONSE_END).next().is_none() {
            return;
        }
        match self.policies.slot().await {
            Some(Ok(_slot)) => self.response_end(outcome, usage).await,
            Some(Err(fault)) => tracing::warn!(%fault, "on-response-end could not run"),
            None => {}
        }
    }

    async fn abandoned(
        self: Arc<Self>,
        upstream: Option<UpstreamStream>,
        mut progress: Progress,
        trail: Trail,
        charge: Charge,
    ) {
        let (held_before, held) = self.policies.hold(&self.tenant);
        let directive = if self.wanting(Hooks::ON_DISCONNECT).next().is_none() {
            Directive::AbortNow
        } else {
            match self.policies.slot().await {
                Some(Ok(_slot)) => self.directive(progress, held_before).await,
                Some(Err(fault)) => {
                    tracing::warn!(request = %self.id, %fault, "on-disconnect could not run");
                    // As each plugin's own fault would: only a fail-closed one holds.
                    if self.wanting(Hooks::ON_DISCONNECT).all(|b| b.fail_open) {
                        Directive::AbortNow
                    } else {
                        ON_FAULT
                    }
                }
                None => Directive::AbortNow,
            }
        };
        self.policies.stats().abandoned(recorded(directive).name());
        if let Some(mut upstream) = upstream {
            let since = Instant::now();
            let limit = self.policies.hold_limit();
            let _ =
                tokio::time::timeout(limit, drain(&mut upstream, directive, &mut progress)).await;
            drop(upstream);
            let dropped = match (progress.usage, progress.tokens) {
                (Some(_), _) => Dropped::AfterDone,
                (None, 0) => Dropped::BeforeFirstToken,
                (None, _) => Dropped::AfterFirstToken,
            };
            self.policies.stats().dropped(dropped.name());
            tracing::debug!(request = %self.id, directive = recorded(directive).name(),
                tokens = progress.tokens, at = dropped.name(),
                "an abandoned request's stream is dropped");
            trail.held(Hold {
                directive: recorded(directive),
                dropped,
                held_ms: u64::try_from(since.elapsed().as_millis()).unwrap_or(u64::MAX),
            });
        }
        // The request's record is written once the trail's last holder lets go: here, with
        // the hold in it.
        drop(trail);
        drop(held);
        charge.settle(progress);
        let usage = progress.usage.unwrap_or((0, progress.tokens));
        self.end(Outcome::ClientDisconnected, usage).await;
    }
}

/// Reads `upstream` until `directive` is satisfied (or the stream ends).
async fn drain(upstream: &mut UpstreamStream, directive: Directive, progress: &mut Progress) {
    let until_complete = match directive {
        Directive::AbortNow => return,
        Directive::HoldUntilPrefillDone | Directive::HoldUntilFirstToken => {
            if progress.tokens > 0 {
                return;
            }
            false
        }
        Directive::HoldUntilComplete => true,
    };
    while let Ok(Some(message)) = upstream.message().await {
        match message.item {
            Some(Item::Token(_)) => {
                progress.tokens = progress.tokens.saturating_add(1);
                if !until_complete {
                    return;
                }
            }
            Some(Item::Done(d)) => {
                progress.usage = Some((d.prompt_tokens, d.completion_tokens));
                return;
            }
            Some(Item::Progress(_)) | None => {}
        }
    }
}

impl RequestPolicy {
    /// The request ended: completed (`progress.usage`), failed, or abandoned by its client
    /// (neither). Called once, when the response's state is dropped; the work runs in a task.
    /// An abandoned request's `trail` is kept until its stream is dropped, so that its record
    /// says how the stream was held, and its `charge` until then too, settled to what it used.
    pub fn finish(
        self,
        upstream: Option<UpstreamStream>,
        progress: Progress,
        trail: Trail,
        charge: Charge,
    ) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let ending = Arc::new(Ending {
            policies: self.policies.clone(),
            set: self.set.clone(),
            matched: self.matched.clone(),
            id: self.id.clone(),
            tenant: self.tenant.clone(),
        });
        let outcome = match (progress.usage, progress.failed) {
            (Some(usage), _) => Some((Outcome::Completed, usage)),
            (None, true) => Some((Outcome::Failed, (0, progress.tokens))),
            (None, false) => None,
        };
        match outcome {
            Some((outcome, usage)) => {
                if ending.wanting(Hooks::ON_RESPONSE_END).next().is_some() {
                    runtime.spawn(ending.end(outcome, usage));
                }
            }
            None => {
                runtime.spawn(ending.abandoned(upstream, progress, trail, charge));
            }
        }
    }
}
