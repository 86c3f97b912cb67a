//! The end of a request: `on-response-end` for accounting, and — when the client went away
//! before the end — `on-disconnect`, whose directive says how long the gateway keeps waiting
//! on the worker before dropping the request (dropping it cancels it at the worker).
//!
//! ```text
//!  client gone ─▶ directive ─┬─ abort-now ──────────────────────────────────▶ drop the call
//!                            ├─ hold-until-prefill-done ─┐ (the first token is when the   or
//!                            ├─ hold-until-first-token ──┴─ gateway sees prefill done) ─▶ stream
//!                            └─ hold-until-complete ──── until Done ────────────────────▶
//!  each hold is bounded by the hold limit; then on-response-end(client-disconnected)
//! ```
//!
//! The gateway sees one call (to the decode or colocated worker), so it reports the phase as
//! `queued` until the worker answers the call (a busy worker answers once the request left its
//! queue), `prefilling` until the first token — or, on a decode worker, until it says its
//! prefill worker computed the prompt, `transferring` from then on —, and `decoding` after.
//! A held request that was queued waits for the worker's answer, then for its stream as the
//! directive says. `hold-until-prefill-done` holds until the first token as
//! `hold-until-first-token` does: prefill is done for decode once its KV arrived and passed
//! its checks, which the gateway sees as the first token (a hold that ended at the computation
//! would cancel the transfer under way). A worker that fails the request while it is held
//! (refuses the call, fails the KV handoff's checks) ends the hold, and the request's record
//! says how it failed, as it would had the client stayed.

use std::sync::Arc;
use std::time::Instant;

use bulkhead_audit::{self as audit, Dropped, Hold};
use bulkhead_worker::serve::proto::Item;

use crate::api::{Counts, Endpoint, from_status};
use crate::limits::RequestPermit;
use crate::trail::{GATEWAY_SHUTDOWN_TYPE, Trail};
use crate::upstreams::{Leg, UpstreamStream, broken};
use crate::workers::Claim;

use super::bindings::{Directive, Disconnect, Hooks, Outcome, Phase, ResponseEnd, Usage};
use super::chain::{Binding, Hook, PolicySet};
use super::handle::{Held, Policies};
use super::request::RequestPolicy;
use super::slots::Turn;

/// How far a request got, as the gateway saw it.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// Token messages received from the worker.
    pub tokens: u32,
    /// A decode worker said its prefill worker computed the prompt: its KV is on its way.
    pub prefill_done: bool,
    /// (prompt, completion) tokens, once the worker said Done.
    pub usage: Option<(u32, u32)>,
    /// The request failed (before or after its 200; after the worker's `Done` too, when its
    /// record could not be made durable and the answer was not sent, or not ended).
    pub failed: bool,
}

impl Progress {
    /// The (prompt, completion) tokens the request used as far as it got: the worker's usage
    /// once it said Done, else the prompt (`prompt_tokens`, as admitted) and the tokens that
    /// came.
    pub fn counted(&self, prompt_tokens: u32) -> (u32, u32) {
        self.usage.unwrap_or((prompt_tokens, self.tokens))
    }

    /// What a request that failed before Done used: nothing before the worker said it
    /// computed the prompt (a refusal, or a failure before: a worker's progress reports count
    /// every prompt it computes, not this request's), else [`Progress::counted`] — prefill done
    /// and then failed, the prompt's work was done, as for a client that leaves then.
    pub fn used_by_failure(&self, prompt_tokens: u32) -> (u32, u32) {
        if self.tokens == 0 && !self.prefill_done {
            (0, 0)
        } else {
            self.counted(prompt_tokens)
        }
    }
}

/// A request's claim on its tenant's budget, handed over with its end: an abandoned request
/// keeps its concurrency slot while its stream is held, and is charged its prompt and the
/// tokens that came (until the hold ended), not its whole `max_tokens` — nothing when the
/// worker never answered its call.
#[derive(Debug)]
pub struct Charge {
    pub permit: RequestPermit,
    /// The prompt's tokens, as admitted.
    pub prompt_tokens: u32,
    /// The most tokens it may generate, as admitted: a held stream that sends more (a broken
    /// upstream) is charged no more.
    pub max_tokens: u32,
    /// The request's tokens on its worker, which it loads until the hold ends.
    pub claim: Option<Claim>,
}

impl Charge {
    /// What the request's `Done` must say.
    fn counts(&self) -> Counts {
        Counts {
            prompt_tokens: self.prompt_tokens,
            max_tokens: self.max_tokens,
        }
    }

    /// Settles the charge to `usage` (prompt, completion tokens).
    fn settle(mut self, (prompt, completion): (u32, u32)) {
        self.permit
            .set_used(u64::from(prompt) + u64::from(completion));
    }
}

/// The directive a failing `on-disconnect` plugin gets when its binding fails closed: the
/// design's default, never abort before the first token once the worker took the request (a
/// request still in its queue, or already decoding, has nothing to protect).
fn on_fault(phase: Phase) -> Directive {
    match phase {
        Phase::Queued | Phase::Decoding => Directive::AbortNow,
        Phase::Prefilling | Phase::Transferring => Directive::HoldUntilFirstToken,
    }
}

/// The outcome as the WIT names it.
fn outcome_name(outcome: Outcome) -> &'static str {
    match outcome {
        Outcome::Completed => "completed",
        Outcome::Failed => "failed",
        Outcome::ClientDisconnected => "client_disconnected",
    }
}

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
pub(super) struct Ending {
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
    async fn directive(&self, phase: Phase, progress: Progress, held_for_tenant: u32) -> Directive {
        let event = Disconnect {
            request_id: self.id.clone(),
            tenant: self.tenant.clone(),
            phase,
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
                    on_fault(phase)
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

    /// [`Ending::end`] in a task, when some plugin asked for it.
    fn spawn_end(
        self: Arc<Self>,
        runtime: &tokio::runtime::Handle,
        outcome: Outcome,
        usage: (u32, u32),
    ) {
        self.policies.stats().ended(outcome_name(outcome));
        if self.wanting(Hooks::ON_RESPONSE_END).next().is_some() {
            self.policies
                .clone()
                .spawn_end(runtime, self.end(outcome, usage));
        }
    }

    /// [`Ending::response_end`] in an instance slot, when some plugin asked for it.
    async fn end(self: Arc<Self>, outcome: Outcome, usage: (u32, u32)) {
        if self.wanting(Hooks::ON_RESPONSE_END).next().is_none() {
            return;
        }
        match self.policies.slot(&self.tenant, Turn::End).await {
            Some(Ok(_slot)) => self.response_end(outcome, usage).await,
            Some(Err(fault)) => tracing::warn!(%fault, "on-response-end could not run"),
            None => {}
        }
    }

    /// The directive for a request abandoned in `phase`: the longest any `on-disconnect`
    /// policy asks for, in an instance slot (abort-now when none asks), and its hold counted
    /// against the tenant's `bound`. Past the bound the policies are not asked (a failing
    /// plugin's default would hold too): abort-now, said `over_bound`.
    ///
    /// A tenant's decisions take turns, each then in an instance slot: each reads what the
    /// tenant holds, asks the plugins with it and counts its hold before the next one reads. Read
    /// sooner, a burst of disconnects was judged all at once by what the tenant held before
    /// it, and a plugin's own cap (abort-guard's `max_held_per_tenant`) let the whole burst
    /// through; counted sooner (from the disconnect on), requests still being decided, and
    /// those decided abort-now, counted as holds.
    pub(super) async fn decide(&self, phase: Phase, progress: Progress, bound: u32) -> Decided {
        let over = |held_before| Decided {
            directive: Directive::AbortNow,
            held: None,
            held_before,
            over_bound: true,
        };
        let held_now = self.policies.held_for(&self.tenant);
        // No plugin to ask: abort-now, whatever the tenant holds (not a refusal at the bound).
        if self.wanting(Hooks::ON_DISCONNECT).next().is_none() {
            return Decided::abort(held_now);
        }
        if held_now >= bound {
            return over(held_now);
        }
        // The turn before the slot: a tenant's burst waits for its turn holding nothing, and
        // takes one instance slot at a time (taken first, its slots sat idle through the
        // turns, and other tenants' calls found none).
        let _turn = self.policies.deciding(&self.tenant).await;
        // What the tenant holds now only falls until this turn counts a hold of its own: read
        // before the slot, a request over the bound waits for none.
        let held_before = self.policies.held_for(&self.tenant);
        if held_before >= bound {
            return over(held_before);
        }
        let slot = self.policies.slot(&self.tenant, Turn::Call).await;
        let directive = match slot {
            Some(Ok(_slot)) => self.directive(phase, progress, held_before).await,
            Some(Err(fault)) => {
                tracing::warn!(request = %self.id, %fault, "on-disconnect could not run");
                // As each plugin's own fault would: only a fail-closed one holds.
                if self.wanting(Hooks::ON_DISCONNECT).all(|b| b.fail_open) {
                    Directive::AbortNow
                } else {
                    on_fault(phase)
                }
            }
            None => Directive::AbortNow,
        };
        match directive {
            Directive::AbortNow => Decided::abort(held_before),
            directive => match self.policies.hold(&self.tenant, bound) {
                Some(held) => Decided {
                    directive,
                    held: Some(held),
                    held_before,
                    over_bound: false,
                },
                None => over(held_before),
            },
        }
    }

    async fn abandoned(
        self: Arc<Self>,
        leg: Option<Leg>,
        mut progress: Progress,
        trail: Trail,
        charge: Charge,
        endpoint: Endpoint,
    ) {
        let bound = self.policies.max_held();
        let phase = phase(leg.as_ref(), progress);
        // The hold limit runs from the disconnect, the decision's wait included: a request
        // waiting for its tenant's turn or an instance slot is held as surely as one decided
        // held (its worker computes on), and a burst of disconnects while the sandbox was
        // busy was decided a slot wait after another, each held on until then.
        let until = tokio::time::Instant::now() + self.policies.hold_limit();
        // Shutdown's drain waits for the policies' decision and the hold; either still under
        // way at its timeout is cut (nothing more is held), and the record says so. What has
        // happened already (a decision made, the worker's failure) comes first.
        let mut shutdown = trail.shutdown_signal();
        let deciding = tokio::time::timeout_at(until, self.decide(phase, progress, bound));
        let decided = tokio::select! {
            biased;
            decided = deciding => Some(decided.unwrap_or_else(|_| {
                tracing::debug!(request = %self.id, tenant = %self.tenant,
                    "no decision on an abandoned request within the hold limit: dropped");
                Decided::abort(self.policies.held_for(&self.tenant))
            })),
            () = shutdown.cut() => None,
        };
        let mut cut = decided.is_none();
        let Decided {
            directive,
            held,
            held_before,
            over_bound,
        } = decided.unwrap_or(Decided::abort(0));
        if over_bound {
            tracing::debug!(request = %self.id, tenant = %self.tenant, held = held_before,
                "the tenant holds as many abandoned requests as the gateway allows: dropped");
            self.policies.stats().over_hold_bound(&self.tenant);
        }
        self.policies.stats().abandoned(recorded(directive).name());
        // A call the worker never answered ran nothing there: it used no tokens.
        let mut answered = !matches!(leg, Some(Leg::Calling(_)));
        let mut failure = None;
        if let Some(leg) = leg {
            let since = Instant::now();
            // The worker's stream, once there is one, is kept here: what it sent is counted
            // whatever ends the hold (its end, its limit, shutdown's cut), then it is dropped.
            let mut stream = None;
            if cut {
                if let Leg::Streaming(s) = leg {
                    stream = Some(s);
                }
            } else {
                let holding = tokio::time::timeout_at(
                    until,
                    hold(
                        leg,
                        directive,
                        charge.counts(),
                        &mut progress,
                        &mut answered,
                        &mut stream,
                    ),
                );
                cut = tokio::select! {
                    biased;
                    held = holding => {
                        if let Ok(Err(status)) = held {
                            tracing::debug!(request = %self.id, %status, "an abandoned request failed while held");
                            let f = from_status(&status, endpoint);
                            // As had its client stayed: a worker down is not routed to until
                            // its health check answers again.
                            if let Some(claim) = charge.claim.as_ref().filter(|_| f.worker_down) {
                                claim.worker_failed(status.message());
                            }
                            failure = Some(f);
                        }
                        false
                    }
                    () = shutdown.cut() => true,
                };
            }
            // Short of `Done`, the tokens that came as the upstream's text counts them (an
            // OpenAI-compatible server's chunk may hold several). The stream goes first: the
            // upstream stops generating at the hold's end, not once a long text is counted.
            let counting = (stream.as_ref())
                .filter(|_| progress.usage.is_none())
                .and_then(UpstreamStream::generated);
            drop(stream);
            if let Some(counting) = counting {
                progress.tokens = counting.await;
            }
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
                failed: match (&failure, cut) {
                    (Some(f), _) => Some(f.error.error_type().to_owned()),
                    (None, true) => Some(GATEWAY_SHUTDOWN_TYPE.to_owned()),
                    (None, false) => None,
                },
            });
        }
        // As had its client stayed: a request that failed is charged what a failure is.
        let usage = match (answered, &failure) {
            (false, _) => (0, 0),
            (true, Some(_)) => progress.used_by_failure(charge.prompt_tokens),
            (true, None) => progress.counted(charge.prompt_tokens),
        };
        let usage = (usage.0, usage.1.min(charge.max_tokens));
        if usage.1 > 0 {
            trail.generated(usage.1);
        }
        // After the tokens, which say the handoff passed: a later failure says otherwise.
        if let Some(f) = failure {
            trail.failed(&f.error, f.refused_by);
        }
        // The request's record is written once the trail's last holder lets go: here, with
        // the hold and the tokens that came in it.
        drop(trail);
        drop(held);
        charge.settle(usage);
        self.policies
            .stats()
            .ended(outcome_name(Outcome::ClientDisconnected));
        self.end(Outcome::ClientDisconnected, usage).await;
    }
}

/// What was decided for an abandoned request.
pub(super) struct Decided {
    directive: Directive,
    /// Its hold, counted for its tenant while it lasts; `None` for abort-now.
    pub(super) held: Option<Held>,
    /// What the tenant held when the policies were asked (or the bound was found reached).
    held_before: u32,
    /// The tenant held as many as the gateway allows: abort-now, the policies not asked.
    pub(super) over_bound: bool,
}

impl Decided {
    fn abort(held_before: u32) -> Decided {
        Decided {
            directive: Directive::AbortNow,
            held: None,
            held_before,
            over_bound: false,
        }
    }
}

/// Where a request was when its client left, as the gateway saw its call (`leg`; `None`: it
/// failed) and stream.
fn phase(leg: Option<&Leg>, progress: Progress) -> Phase {
    match (leg, progress.tokens, progress.prefill_done) {
        (Some(Leg::Calling(_)), _, _) => Phase::Queued,
        (_, 0, false) => Phase::Prefilling,
        (_, 0, true) => Phase::Transferring,
        (_, _, _) => Phase::Decoding,
    }
}

/// Waits on the worker as `directive` says: for its answer to the call (unless abort-now),
/// then on its stream, which goes into `kept` (its caller counts what it sent). Fails with the
/// worker's status when it refused the call or failed the stream before the directive was
/// satisfied.
async fn hold(
    leg: Leg,
    directive: Directive,
    counts: Counts,
    progress: &mut Progress,
    answered: &mut bool,
    kept: &mut Option<UpstreamStream>,
) -> Result<(), tonic::Status> {
    let upstream = match leg {
        Leg::Streaming(upstream) => kept.insert(upstream),
        Leg::Calling(_) if matches!(directive, Directive::AbortNow) => return Ok(()),
        Leg::Calling(call) => {
            let upstream = call.await?;
            *answered = true;
            kept.insert(upstream)
        }
    };
    drain(upstream, directive, counts, progress).await
}

/// Reads `upstream` until `directive` is satisfied, or the stream fails (a stream that ends
/// without `Done` is broken: the worker's transport failed; a `Done` whose counts are not the
/// request's, `counts`, is a broken answer, as had its client stayed).
async fn drain(
    upstream: &mut UpstreamStream,
    directive: Directive,
    counts: Counts,
    progress: &mut Progress,
) -> Result<(), tonic::Status> {
    let until_complete = match directive {
        Directive::AbortNow => return Ok(()),
        Directive::HoldUntilPrefillDone | Directive::HoldUntilFirstToken => {
            if progress.tokens > 0 {
                return Ok(());
            }
            false
        }
        Directive::HoldUntilComplete => true,
    };
    loop {
        let Some(message) = upstream.message().await? else {
            return Err(tonic::Status::unavailable(
                "the worker's stream ended without Done",
            ));
        };
        match message.item {
            Some(Item::Token(_)) => {
                progress.tokens = progress.tokens.saturating_add(1);
                if !until_complete {
                    return Ok(());
                }
            }
            Some(Item::Done(d)) => {
                let sent = upstream.sends_each_token().then_some(progress.tokens);
                // A broken answer, not a worker down (as had its client stayed).
                counts.hold(&d, sent).map_err(|why| {
                    broken(&format!("the worker's counts are not the request's: {why}"))
                })?;
                progress.usage = Some((d.prompt_tokens, d.completion_tokens));
                return Ok(());
            }
            Some(Item::PrefillDone(_)) => progress.prefill_done = true,
            Some(Item::Progress(_)) | None => {}
        }
    }
}

impl RequestPolicy {
    /// The request ended: completed (`progress.usage`), failed, or abandoned by its client
    /// (neither). Called once, when the response's state is dropped; the work runs in a task.
    /// An abandoned request's `trail` is kept until its call or stream is dropped, so that its
    /// record says how it was held, and its `charge` until then too, settled to what it used.
    /// A request shutdown cut (its client did not leave) failed: no disconnect directive holds
    /// it, and dropping `leg` here cancels it at the worker. `endpoint` is the API it came by
    /// (what a worker's failure during a hold means for its record).
    pub fn finish(
        self,
        leg: Option<Leg>,
        progress: Progress,
        trail: Trail,
        charge: Charge,
        endpoint: Endpoint,
    ) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let ending = self.ending();
        match (progress.usage, progress.failed || trail.cut_by_shutdown()) {
            // The worker's answer, not sent: its record could not be made durable (503), its
            // charge stands (the worker did the work).
            (Some(usage), _) if progress.failed => {
                ending.spawn_end(&runtime, Outcome::Failed, usage);
            }
            (Some(usage), _) => ending.spawn_end(&runtime, Outcome::Completed, usage),
            (None, true) => {
                if progress.tokens > 0 {
                    trail.generated(progress.tokens);
                }
                let usage = progress.used_by_failure(charge.prompt_tokens);
                charge.settle(usage);
                ending.spawn_end(&runtime, Outcome::Failed, usage);
            }
            (None, false) => {
                let policies = ending.policies.clone();
                policies.spawn_end(
                    &runtime,
                    ending.abandoned(leg, progress, trail, charge, endpoint),
                );
            }
        }
    }

    /// The request failed after the chain allowed it and before a worker was called (a limit
    /// of the gateway's, or no worker to route to): `on-response-end`, nothing used.
    pub fn failed(self) {
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            self.ending().spawn_end(&runtime, Outcome::Failed, (0, 0));
        }
    }

    pub(super) fn ending(self) -> Arc<Ending> {
        Arc::new(Ending {
            policies: self.policies,
            set: self.set,
            matched: self.matched,
            id: self.id,
            tenant: self.tenant,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_transferring_from_prefill_done_to_its_first_token() {
        let at = |tokens, prefill_done| {
            phase(
                None,
                Progress {
                    tokens,
                    prefill_done,
                    ..Progress::default()
                },
            )
        };
        assert_eq!(at(0, false), Phase::Prefilling);
        assert_eq!(at(0, true), Phase::Transferring);
        assert_eq!(at(3, true), Phase::Decoding);
        assert_eq!(at(3, false), Phase::Decoding, "colocated: no transfer");
    }
}
