//! The two network legs of a disaggregated request.
//!
//! Decode ([`start_remote_prefill`]): after the engine reserved the pages, call the prefill
//! worker's `Prefill` with the reservation. A refusal there fails the request at once with the
//! prefill worker's reason and releases the reservation (nothing was sent); an unreachable
//! prefill worker, or a call that ends before accepting, fails it with `service_unavailable`
//! and releases the reservation too, as the end of an accepted call does — also when the
//! transfer deadline or the client's going away ends the call before prefill answered: prefill
//! sends only while its call is open, and decode writes every frame itself, dropping those of
//! a closed session (a transport whose peer writes remotely would need its own teardown here).
//! The accepted call's stream is kept with the client's stream: when the client goes away,
//! dropping it aborts the transfer on the prefill side, whose `Closed(aborted)` releases it.
//!
//! Prefill ([`prefill`]): admit into this worker's own pool, compute, and write the frames to
//! decode's data plane in bounded batches, stopping with `Closed(aborted)` as soon as decode
//! drops the call. The source pages go back only after the transfer is closed. Whenever decode
//! drops the call before any KV was sent, prefill still sends it `Closed(aborted)` on the data
//! plane: its drain acknowledgement, as the protocol model has it.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tonic::Status;
use tonic::codegen::tokio_stream::Stream;
use tracing::field::Empty;
use tracing::{Instrument as _, Span};

use bulkhead_handoff::{CloseReason, SessionNonce};
use bulkhead_kvpool::Scope;

use super::actor::{CancelOnDrop, EngineHandle, Events, Submission};
use super::cluster_token::Client;
use super::error::{ServeError, ValidationError, codes, status};
use super::kvplane::{self, SendOptions, Sent};
use super::metrics::Outcome;
use super::progress::{Heard, Progress};
use super::proto::{self, PrefillItem};
use super::refusal::{from_proto_reservation, from_refusal, to_proto_reservation, to_refusal};
use super::spans;
use super::validate::{self, ValidGenerate};
use crate::engine::{Event, Failure, Outbound, Request, SubmitError};
use crate::error_chain::with_causes;
use crate::model::SeqFailure;
use crate::printable::printable;

/// A decode worker's way to its prefill worker.
#[derive(Debug, Clone)]
pub struct PrefillPeer {
    pub client: Client,
    /// Where the prefill worker sends KV: this worker's data-plane address.
    pub kv_address: String,
    /// Which prefill process answers there, as this worker's Info tells it.
    pub seen: SeenPeer,
    /// This worker's model (its Info's `model_id`), which the prefill worker must serve too.
    pub model_id: String,
}

/// The address a decode worker dials for prefill, the process that last answered there and
/// why the last probe failed: what lets preflight compare this worker with the prefill workers
/// the gateway admits against, rather than with those its configuration says this one dials,
/// and say why it has not reached one.
#[derive(Debug, Clone)]
pub struct SeenPeer {
    address: Arc<str>,
    seen: Arc<Mutex<Seen>>,
}

#[derive(Debug, Default)]
struct Seen {
    instance_id: String,
    last_error: String,
}

/// The most of a failed probe's reason kept (the peer wrote it).
const MAX_PROBE_ERROR_BYTES: usize = 300;

impl SeenPeer {
    pub fn new(address: &str) -> SeenPeer {
        SeenPeer {
            address: address.into(),
            seen: Arc::default(),
        }
    }

    fn seen(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.seen.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The process `instance_id` answered at the peer's address (an older worker that sends
    /// none tells nothing).
    fn answered_by(&self, instance_id: &str) {
        let mut seen = self.seen();
        if instance_id.is_empty() {
            // Reached, but it cannot be told from another process: said, so that the peer
            // check fails with the reason rather than look like a worker still starting.
            "it answers without an instance id (a prefill worker older than this one?)"
                .clone_into(&mut seen.last_error);
            // Not the process that answered before (a rollback at the same address): its id
            // would vouch for this one, and the peer check reads the reason only without one.
            seen.instance_id.clear();
            return;
        }
        // The peer's words, kept and told again (Info, preflight): bounded and escaped.
        seen.instance_id = printable(instance_id, MAX_PROBE_ERROR_BYTES);
        seen.last_error.clear();
    }

    /// A probe failed because of `error` (bounded and escaped by the caller).
    fn failed(&self, error: &str) {
        error.clone_into(&mut self.seen().last_error);
    }

    /// As the Info response says it.
    pub fn report(&self) -> proto::PrefillPeer {
        let seen = self.seen();
        proto::PrefillPeer {
            address: self.address.to_string(),
            instance_id: seen.instance_id.clone(),
            last_error: seen.last_error.clone(),
        }
    }
}

/// How often a decode worker asks its prefill peer which process answers there.
const PEER_PROBE_EVERY: Duration = Duration::from_secs(1);

/// Decode role: asks the prefill peer's Info every second for as long as the worker serves, so
/// that a prefill worker restarted or replaced behind the address shows in this worker's Info
/// within a second, whether or not requests flow. Losing the peer (or never reaching it: a
/// wrong `--prefill`) is a warning, and reaching it again a line of its own.
pub async fn follow_peer(peer: PrefillPeer) -> Infallible {
    let mut tick = tokio::time::interval(PEER_PROBE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Whether the last probe was answered (`None`: none made yet).
    let mut reached: Option<bool> = None;
    loop {
        tick.tick().await;
        let mut client = peer.client.clone();
        let asked = client.info(proto::InfoRequest {
            include_tokenizer: false,
        });
        let failed = match tokio::time::timeout(PEER_PROBE_EVERY, asked).await {
            Ok(Ok(info)) => {
                peer.seen.answered_by(&info.get_ref().instance_id);
                if reached == Some(false) {
                    tracing::info!(prefill = %peer.seen.address, "the prefill worker answers again");
                }
                reached = Some(true);
                continue;
            }
            Ok(Err(status)) => with_causes(
                status.message().to_owned(),
                std::error::Error::source(&status),
            ),
            Err(_) => format!("no answer within {PEER_PROBE_EVERY:?}"),
        };
        // The peer wrote part of it: logged, like reported, bounded and escaped.
        let failed = printable(&failed, MAX_PROBE_ERROR_BYTES);
        peer.seen.failed(&failed);
        if reached != Some(false) {
            tracing::warn!(prefill = %peer.seen.address, error = %failed,
                "cannot reach the prefill worker; requests needing it fail until it answers (asking every second)");
        }
        reached = Some(false);
    }
}

/// The live `Prefill` call of a request, watched: if the prefill worker fails or vanishes
/// before the transfer is sent, decode fails the request at once instead of waiting for the
/// transfer timeout. Dropping it (with the client's stream) cancels the call, which aborts
/// the transfer on the prefill side.
#[derive(Debug)]
pub struct PrefillCall {
    /// Ends with prefill's `Sent` (its `cached_tokens`) or with the call (0).
    watch: tokio::task::JoinHandle<u32>,
    /// The prefill worker's count of prompt tokens computed, as it last reported it.
    computed_tokens: Arc<AtomicU64>,
    /// Answered when prefill says the prompt is computed (its transfer starts); taken once.
    computed: Option<oneshot::Receiver<()>>,
    /// What the watch ended with, once it ended (or 0 once waiting for it timed out).
    cached_tokens: Option<u32>,
    /// Started when the request's `Done` first waits for the watch.
    wait: Option<Pin<Box<tokio::time::Sleep>>>,
}

/// How long prefill's answer to its call may come after its KV did: it answers before it
/// computes, so only a peer that is stuck (or hostile) takes longer.
const ANSWER_WAIT: Duration = Duration::from_secs(5);

/// How long a finished request's `Done` waits for prefill's `Sent`, which prefill answers as
/// soon as the manifest (that decode verified before the first token) is written.
const SENT_WAIT: Duration = Duration::from_secs(1);

impl Drop for PrefillCall {
    fn drop(&mut self) {
        self.watch.abort();
    }
}

impl PrefillCall {
    /// The prompt tokens prefill read from its tenant's prefix cache, for the request's usage:
    /// ready once prefill said it sent everything, 0 if the call ended without saying so or
    /// did not say within [`SENT_WAIT`] of the first ask.
    pub fn poll_cached_tokens(&mut self, cx: &mut Context<'_>) -> Poll<u32> {
        if let Some(n) = self.cached_tokens {
            return Poll::Ready(n);
        }
        if let Poll::Ready(ended) = Pin::new(&mut self.watch).poll(cx) {
            let n = ended.unwrap_or(0);
            self.cached_tokens = Some(n);
            return Poll::Ready(n);
        }
        let wait = self
            .wait
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(SENT_WAIT)));
        match wait.as_mut().poll(cx) {
            Poll::Ready(()) => {
                tracing::debug!("prefill's Sent did not come in time: no cached-token count");
                self.cached_tokens = Some(0);
                Poll::Ready(0)
            }
            Poll::Pending => Poll::Pending,
        }
    }

    /// Ready once, when prefill said it computed the prompt and its KV is on its way; never
    /// when it did not say so (the call ended first, or a prefill worker that predates it).
    pub fn poll_computed(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let Some(computed) = self.computed.as_mut() else {
            return Poll::Pending;
        };
        let said = std::task::ready!(Pin::new(computed).poll(cx));
        self.computed = None;
        match said {
            Ok(()) => Poll::Ready(()),
            Err(_) => Poll::Pending,
        }
    }

    /// `span` is the call's client span; it ends with the call.
    fn watch(
        engine: EngineHandle,
        nonce: SessionNonce,
        mut call: tonic::Streaming<proto::PrefillEvent>,
        span: Span,
    ) -> PrefillCall {
        let computed_tokens = Arc::new(AtomicU64::new(0));
        let reported = computed_tokens.clone();
        let (said_computed, computed) = oneshot::channel();
        let mut said_computed = Some(said_computed);
        let mut heard = Heard::default();
        let watch = tokio::spawn(async move {
            loop {
                match call.message().await {
                    Ok(Some(proto::PrefillEvent {
                        event: Some(PrefillItem::Sent(sent)),
                    })) => {
                        span.record("bulkhead.kv.frames", sent.frames);
                        span.record("bulkhead.kv.bytes", sent.bytes);
                        return sent.cached_tokens;
                    }
                    Ok(Some(proto::PrefillEvent {
                        event: Some(PrefillItem::Progress(progress)),
                    })) => {
                        reported.store(progress.computed_tokens, Ordering::Relaxed);
                        if heard.pass(progress.computed_tokens, std::time::Instant::now()) {
                            engine.prefill_progress(nonce, progress.computed_tokens);
                        }
                    }
                    Ok(Some(proto::PrefillEvent {
                        event: Some(PrefillItem::Computed(_)),
                    })) => {
                        if let Some(said) = said_computed.take() {
                            let _ = said.send(());
                            // The transfer starts now: its deadline does too, once (a count
                            // no progress can pass: later ones are no news). Prefill's last
                            // step and the lag of its reports came out of it otherwise.
                            engine.prefill_progress(nonce, u64::MAX);
                        }
                    }
                    Ok(Some(_)) => {}
                    ended @ (Ok(None) | Err(_)) => {
                        // The prefill side is gone or failed: nothing more of this session
                        // will be sent. (Frames already on the data plane are dropped: the
                        // session is no longer open.) A failure that says why is the
                        // request's, told as it is: a KV integrity failure or a broken
                        // answer is no outage to retry.
                        let said = ended.err().and_then(|status| prefill_failure(&status));
                        span.record(
                            "error.type",
                            said.as_ref()
                                .map_or(codes::SERVICE_UNAVAILABLE, |(code, _)| code),
                        );
                        span.record("otel.status_code", "ERROR");
                        match said {
                            Some((_, failure)) => engine.prefill_failed(nonce, failure),
                            None => engine.transport_closed(vec![nonce]),
                        }
                        return 0;
                    }
                }
            }
        });
        PrefillCall {
            watch,
            computed_tokens,
            computed: Some(computed),
            cached_tokens: None,
            wait: None,
        }
    }

    /// The prefill worker's count of prompt tokens computed, as it last reported it (0 before
    /// its first report).
    pub fn computed_tokens(&self) -> u64 {
        self.computed_tokens.load(Ordering::Relaxed)
    }
}

/// A decode request whose prefill worker accepted it.
pub struct RemoteStart {
    /// The request's first event when it came before prefill's answer was read.
    pub early: Option<Event>,
    /// The rest of the request's events.
    pub events: Events,
    pub guard: CancelOnDrop,
    /// The live prefill call.
    pub call: PrefillCall,
}

/// A `Prefill` call prefill has not answered yet. If it ends so — it failed, even at connect,
/// its stream closed, the engine's transfer deadline came first, or the client went away and
/// the call was dropped — the end is the session's teardown, as the end of an accepted call
/// is (see [`PrefillCall`]): the reservation comes back at once. Waiting for prefill's drain
/// acknowledgement instead held it for good when none ever came (prefill down, a partition
/// that does not heal): no data connection of the session ever opened, so none closes to
/// reclaim it.
struct Unanswered<'a> {
    engine: &'a EngineHandle,
    /// `None` once prefill answered.
    nonce: Option<SessionNonce>,
}

impl Unanswered<'_> {
    /// Prefill answered (accepted or refused): what follows is said by the answer.
    fn answered(mut self) {
        self.nonce = None;
    }
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if let Some(nonce) = self.nonce {
            self.engine.transport_closed(vec![nonce]);
        }
    }
}

/// Which of the two waits of [`start_remote_prefill`] ended first.
enum Raced<A> {
    Answer(A),
    Event(Option<Event>),
}

/// Decode role: waits for the engine's reservation and hands it to the prefill worker.
pub async fn start_remote_prefill(
    engine: &EngineHandle,
    peer: &PrefillPeer,
    valid: ValidGenerate,
) -> Result<RemoteStart, ServeError> {
    let prompt = valid.prompt.clone();
    let max_new_tokens = valid.max_new_tokens;
    let sampling = valid.sampling;
    let (caller_id, tenant) = (valid.caller_id.clone(), valid.tenant.clone());
    let cache_salt = valid.cache_salt.clone();
    let admission = async {
        engine
            .submit_unclaimed(Submission::Decode, |id, sink| valid.into_request(id, sink))
            .await?
            .first("its reservation", |event| match event {
                Event::Reserved(target) => Ok(target),
                other => Err(other),
            })
            .await
    };
    // Declared before the request's events and guard, so dropped after them: a caller that
    // leaves before prefill answers cancels the request (counted as cancelled) before the
    // session's teardown, which then ends its drain; the other way round, the engine failed
    // the request for the closed session first and counted the caller's leaving as a prefill
    // failure.
    let mut unanswered = Unanswered {
        engine,
        nonce: None,
    };
    // Admission here ends with the pages reserved.
    let (mut events, guard, target) = admission
        .instrument(tracing::info_span!("admission"))
        .await?;
    let request = proto::PrefillRequest {
        request_id: caller_id,
        tenant,
        prompt,
        sampling: Some(proto::SamplingParams {
            temperature: sampling.temperature,
            top_k: sampling.top_k.map(|k| u32::try_from(k).unwrap_or(u32::MAX)),
            top_p: Some(sampling.top_p),
            seed: Some(sampling.seed),
        }),
        reservation: Some(to_proto_reservation(&target)),
        kv_address: peer.kv_address.clone(),
        cache_salt,
        model_id: peer.model_id.clone(),
    };
    // Failing here drops `guard`: the request is cancelled (the caller's leaving, counted so)
    // or withdrawn (prefill's failure, counted as that).
    let unavailable = |reason: String| ServeError::PrefillUnavailable { reason };
    let client = peer.client.clone();
    let mut request = tonic::Request::new(request);
    let call_span = spans::prefill_call(request.metadata_mut());
    let answer = async move {
        let mut call = client.clone().prefill(request).await?.into_inner();
        let first = call.message().await?;
        Ok::<_, Status>((call, first))
    }
    .instrument(call_span.clone());
    // Until prefill answers, however this ends — the call failed or closed, the engine's
    // transfer deadline, the client gone — the call's end is the session's teardown.
    unanswered.nonce = Some(target.nonce);
    // An unreachable or silent prefill worker must not hold the request past its transfer
    // deadline: the engine's verdict (a timeout) ends the wait.
    tokio::pin!(answer);
    // The engine's word first when both are in: a failure it already told (and counted) is
    // the request's end, not the call's failure beside it (counted again), and an answer it
    // already finished is not lost to an answer wait that timed out.
    let raced = tokio::select! {
        biased;
        event = events.recv() => Raced::Event(event),
        answer = &mut answer => Raced::Answer(answer),
    };
    let (answer, early) = match raced {
        Raced::Answer(answer) => (answer, None),
        Raced::Event(Some(Event::Failed(f))) => return Err(ServeError::Failed(f)),
        Raced::Event(None) => return Err(ServeError::EngineGone),
        // The KV was sent and committed before the call's first answer was read (a short
        // prompt on a fast data plane): prefill did accept. The event is the stream's first.
        // Its answer is due (prefill answers before it computes): a peer that sent the KV and
        // never answers does not hold the request for ever.
        Raced::Event(Some(early @ (Event::Token { .. } | Event::Done { .. }))) => {
            let answered = tokio::time::timeout(ANSWER_WAIT, answer).await;
            let answer = answered.unwrap_or_else(|_| {
                Err(Status::deadline_exceeded(
                    "prefill sent the KV and did not answer its call",
                ))
            });
            (answer, Some(early))
        }
        Raced::Event(Some(other)) => {
            tracing::error!(
                event = other.kind(),
                "a decode request's event before its prefill answered"
            );
            return Err(ServeError::Internal { what: "engine" });
        }
    };
    // A call that failed is this request's failure, counted as one when it is refused: the
    // reservation is withdrawn, not cancelled (which counted it a second time, as cancelled).
    let (call, first) = match answer {
        Ok(answered) => answered,
        Err(s) => {
            // The engine failed the request as the call failed (its transfer deadline, say):
            // that failure, told and counted once, is the request's, as when it came first.
            if early.is_none()
                && let Ok(Event::Failed(f)) = events.try_recv()
            {
                return Err(ServeError::Failed(f));
            }
            spans::failed(&call_span, &s);
            guard.withdraw();
            return Err(unavailable(printable(s.message(), MAX_PROBE_ERROR_BYTES)));
        }
    };
    let refused = match first {
        Some(proto::PrefillEvent {
            event: Some(PrefillItem::Accepted(accepted)),
        }) => {
            peer.seen.answered_by(&accepted.instance_id);
            unanswered.answered();
            return Ok(RemoteStart {
                early,
                events,
                guard,
                call: PrefillCall::watch(engine.clone(), target.nonce, call, call_span),
            });
        }
        // Refused after its KV was sent, verified and decoded from: the peer contradicts
        // itself. Not its admission's refusal, which the client would be told (a 429 to retry,
        // a 400 for a prompt this worker admitted and decoded): the request ends as a prefill
        // failure, and the running request is cancelled now.
        Some(proto::PrefillEvent {
            event: Some(PrefillItem::Rejected(_)),
        }) if early.is_some() => {
            unanswered.answered();
            guard.withdraw();
            unavailable("it refused a request whose KV it had sent".into())
        }
        Some(proto::PrefillEvent {
            event: Some(PrefillItem::Rejected(refusal)),
        }) => {
            let reason = restated(from_refusal(&refusal), max_new_tokens);
            unanswered.answered();
            engine.prefill_rejected(target.nonce, reason.clone());
            let mut guard = guard;
            guard.disarm();
            // Prefill's admission refused it, not this worker's: the status names that layer.
            ServeError::Failed(Failure::PrefillRejected(reason))
        }
        other => {
            guard.withdraw();
            unavailable(format!("unexpected first answer {other:?}"))
        }
    };
    spans::failed(&call_span, &status(&refused));
    Err(refused)
}

/// A prefill worker's refusal as the client's request would read it: prefill admits a prompt
/// with one token to generate (the first, which it computes), so its context-length refusal
/// counts that one; the request asked for `max_new` (its client is told the numbers decode's
/// own refusal would give, as the gateway's do).
fn restated(refusal: SubmitError, max_new: usize) -> SubmitError {
    match refusal {
        SubmitError::ContextLengthExceeded { limit, prompt, .. } => {
            SubmitError::ContextLengthExceeded {
                requested: (prompt as u64).saturating_add(max_new as u64),
                limit,
                prompt,
                max_new,
            }
        }
        other => other,
    }
}

/// The `Prefill` answer stream.
pub type PrefillStream = Pin<Box<dyn Stream<Item = Result<proto::PrefillEvent, Status>> + Send>>;

/// Prefill role: the `Prefill` RPC. Once the reservation parses, the rest runs in a task of
/// its own, so that a call decode drops at any point still ends with decode's drain
/// acknowledgement (see [`acknowledge_abort`]).
pub async fn prefill(
    engine: &EngineHandle,
    request: proto::PrefillRequest,
    options: SendOptions,
    info: &proto::InfoResponse,
) -> Result<PrefillStream, Status> {
    // Checked before anything else: a decode worker of another model (a prefill worker replaced
    // behind its address, its KV of the same shape) would commit this model's KV as its own. A
    // call that names none is refused too: the check is not the caller's to skip.
    if request.model_id != info.model_id {
        return Err(status(&ServeError::OtherModel {
            ours: info.model_id.clone(),
            theirs: match request.model_id.as_str() {
                "" => "(none named)".into(),
                theirs => printable(theirs, MAX_PROBE_ERROR_BYTES),
            },
        }));
    }
    let target = request
        .reservation
        .as_ref()
        .ok_or_else(|| ValidationError::Reservation {
            reason: "missing".into(),
        })
        .and_then(from_proto_reservation)
        .map_err(|e| status(&e.into()))?;
    validate::label("request_id", &request.request_id)
        .and_then(|()| validate::label("tenant", &request.tenant))
        .and_then(|()| validate::salt(&request.cache_salt))
        .map_err(|e| status(&e.into()))?;
    let address: std::net::SocketAddr = request
        .kv_address
        .parse()
        .map_err(|_| status(&ValidationError::KvAddress.into()))?;
    // Decode always sends the seed it chose, so prefill samples the first token the same way.
    let sampling = validate::sampling(request.sampling, || 0)
        .map_err(|e| status(&ValidationError::Sampling(e).into()))?;
    let (tx, rx) = mpsc::channel::<Result<proto::PrefillEvent, Status>>(4);
    let send = SendTo {
        nonce: target.nonce,
        address: address.to_string(),
        options,
    };
    let engine = engine.clone();
    let caller_id = request.request_id;
    let tenant = Scope::salted(&request.tenant, &request.cache_salt);
    let prompt = request.prompt;
    let accepted = proto::PrefillAccepted {
        instance_id: info.instance_id.clone(),
    };
    // In the `Prefill` call's span (the caller's): the steps below are its children.
    let span = Span::current();
    let task = async move {
        let item = |event| Ok(proto::PrefillEvent { event: Some(event) });
        let submitted = engine
            .submit(Submission::PrefillFor(target), |id, sink| Request {
                id,
                tenant,
                prompt,
                max_new_tokens: 1,
                sampling,
                stop: Vec::new(),
                ignore_eos: true,
                sink,
            })
            .instrument(tracing::info_span!("admission"))
            .await;
        let answer = match submitted {
            Err(ServeError::Submit(e)) => {
                tracing::info!(caller_id, error = %e, "prefill refused");
                let refusal = to_refusal(&e);
                engine
                    .metrics()
                    .count(Outcome::refused(&ServeError::Submit(e)));
                item(PrefillItem::Rejected(refusal))
            }
            Err(e) => Err(status(&e)),
            Ok((mut events, guard)) => {
                if tx.send(item(PrefillItem::Accepted(accepted))).await.is_ok() {
                    transfer(engine, events, guard, tx, send).await;
                } else {
                    abandon(&engine, &mut events, guard);
                    acknowledge_abort(&send).await;
                }
                return;
            }
        };
        if let Err(status) = &answer {
            spans::failed(&Span::current(), status);
        }
        if tx.send(answer).await.is_err() {
            // Decode left before it heard the answer: it may be waiting for the drain.
            acknowledge_abort(&send).await;
        }
    };
    tokio::spawn(task.instrument(span));
    Ok(Box::pin(
        tonic::codegen::tokio_stream::wrappers::ReceiverStream::new(rx),
    ))
}

/// Decode dropped the call before any KV of the session was sent: the request ends here. The
/// guard cancels it; KV the engine already handed over (its answer crossed the drop) goes
/// back to the engine to be closed — its pages freed on the engine's thread, into the prefix
/// cache, not dropped on this one, where freeing waits for the pool's lock through a forward
/// pass — and the request is counted cancelled (the engine's cancel no longer finds it).
fn abandon(engine: &EngineHandle, events: &mut Events, guard: CancelOnDrop) {
    events.close();
    drop(guard);
    while let Ok(event) = events.try_recv() {
        if let Event::Prefilled(outbound) = event {
            engine.close(outbound);
            engine.metrics().count(Outcome::Cancelled);
        }
    }
}

/// Decode dropped the call before any KV of the session was sent: tell it on the data plane
/// that nothing of the session will come (its drain acknowledgement), so it frees the pages
/// now instead of quarantining them when its release timeout expires.
async fn acknowledge_abort(send: &SendTo) {
    let closed = kvplane::send_closed(
        &send.address,
        send.nonce,
        CloseReason::Aborted,
        &send.options,
    );
    if let Err(e) = closed.await {
        tracing::warn!(address = %send.address, error = %e, "could not acknowledge an abort");
    }
}

/// Where and how prefill writes one transfer.
#[derive(Debug)]
struct SendTo {
    nonce: SessionNonce,
    address: String,
    options: SendOptions,
}

/// How the computation of a prefill request ended.
enum Computed {
    /// The prompt's KV, ready to send.
    Kv(Outbound),
    /// It failed, and decode was told why on the call.
    Failed,
    /// Decode dropped the call: it waits for nothing but the drain acknowledgement.
    Dropped,
}

/// Waits for the prompt's KV, reporting this worker's progress to decode meanwhile
/// ([`Progress`]): its sign that the transfer is coming, which restarts its wait.
async fn computed(
    engine: &EngineHandle,
    events: &mut Events,
    tx: &mpsc::Sender<Result<proto::PrefillEvent, Status>>,
) -> Computed {
    let count = || engine.metrics().computed_prompt_tokens();
    let mut progress = Progress::from(count());
    loop {
        let answer = tokio::select! {
            // The engine's answer first: a prompt computed as decode left is closed, not lost.
            biased;
            event = events.recv() => match event {
                Some(Event::Prefilled(outbound)) => return Computed::Kv(outbound),
                Some(Event::Failed(f)) => Err(status(&ServeError::Failed(f))),
                other => {
                    let event = other.as_ref().map_or("none", Event::kind);
                    tracing::error!(event, "a prefill request ended without its KV");
                    Err(status(&ServeError::Internal { what: "engine" }))
                }
            },
            computed_tokens = progress.report(count) => {
                let progress = proto::PromptProgress { computed_tokens };
                Ok(proto::PrefillEvent {
                    event: Some(PrefillItem::Progress(progress)),
                })
            }
            () = tx.closed() => return Computed::Dropped,
        };
        if answer.is_err() {
            return match tx.send(answer).await {
                Ok(()) => Computed::Failed,
                Err(_) => Computed::Dropped,
            };
        }
        // Progress is news, not owed: one that finds decode's window full (a peer that stopped
        // reading) is dropped, so that the wait for the engine goes on — the prompt's KV, when
        // it comes, holds the source pages, and must not wait behind a send.
        if let Err(mpsc::error::TrySendError::Closed(_)) = tx.try_send(answer) {
            return Computed::Dropped;
        }
    }
}

/// Waits for the prompt's KV and writes it to decode; the source pages go back once the
/// transfer is closed, whatever happened.
async fn transfer(
    engine: EngineHandle,
    mut events: Events,
    mut guard: CancelOnDrop,
    tx: mpsc::Sender<Result<proto::PrefillEvent, Status>>,
    send: SendTo,
) {
    let computing = tracing::info_span!("prefill");
    let outbound = match computed(&engine, &mut events, &tx)
        .instrument(computing.clone())
        .await
    {
        Computed::Kv(outbound) => outbound,
        Computed::Failed => return,
        // Decode dropped the call before the prompt was computed: the guard cancels it, and
        // decode hears at once that nothing of the session will come (its drain
        // acknowledgement) instead of quarantining the pages when its release timeout expires.
        Computed::Dropped => {
            abandon(&engine, &mut events, guard);
            acknowledge_abort(&send).await;
            return;
        }
    };
    drop(computing);
    guard.disarm();
    // Decode's sign that the request is now transferring (it reads the call throughout; a
    // call it dropped fails the send at once, and the transfer below sees it gone).
    let computed = proto::PrefillEvent {
        event: Some(PrefillItem::Computed(proto::PrefillComputed {})),
    };
    // As progress: never waited for, with the source pages held.
    let _ = tx.try_send(Ok(computed));
    let sending = engine.metrics().sending(u64::from(outbound.sent_tokens()));
    let transfer_span = tracing::info_span!(
        "kv_transfer",
        bulkhead.kv.tokens = outbound.sent_tokens(),
        bulkhead.kv.frames = Empty,
        bulkhead.kv.bytes = Empty,
        bulkhead.kv.aborted = Empty,
        error.type = Empty,
        otel.status_code = Empty,
    );
    let frames = super::tamper::frames(&outbound.frames);
    // Bounded: a decode peer that reads slower than the floor holds the source pages no
    // longer than its deadline (only decode bounded a transfer, and a hostile decode worker
    // that trickles its reads never hangs up).
    let limit = send.options.deadline(&frames);
    let sending_kv = kvplane::send_with(
        &send.address,
        &frames,
        &outbound.manifest,
        &send.options,
        || tx.is_closed(),
    );
    let writes = async {
        tokio::time::timeout(limit, sending_kv)
            .await
            .unwrap_or_else(|_| {
                Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("the decode peer took the KV slower than the floor: {limit:?} passed"),
                ))
            })
    }
    .instrument(transfer_span.clone());
    // Between batches the send itself sees decode hang up (and says so on the data plane); a
    // connect or a write that waits on a peer that stopped reading does not. Decode hangs up
    // when its client leaves, or at its transfer deadline: the send is dropped, and the source
    // pages come back instead of waiting on that peer for ever.
    let (sent, hung_up) = tokio::select! {
        biased;
        sent = writes => (sent, false),
        () = tx.closed() => (Ok(Sent::Aborted), true),
    };
    drop(frames);
    drop(sending);
    match &sent {
        Ok(Sent::Complete { frames, bytes }) => {
            transfer_span.record("bulkhead.kv.frames", frames);
            transfer_span.record("bulkhead.kv.bytes", bytes);
        }
        Ok(Sent::Aborted) => {
            transfer_span.record("bulkhead.kv.aborted", true);
        }
        Err(_) => {
            transfer_span.record("error.type", codes::SERVICE_UNAVAILABLE);
            transfer_span.record("otel.status_code", "ERROR");
        }
    }
    drop(transfer_span);
    let cached_tokens = u32::try_from(outbound.cached_tokens()).unwrap_or(u32::MAX);
    // Counted before the pages go back, so that a pool seen whole has its request counted.
    engine.metrics().count(match &sent {
        Ok(Sent::Complete { .. }) => Outcome::Prefilled,
        Ok(Sent::Aborted) => Outcome::Cancelled,
        Err(_) => Outcome::FailedPrefill,
    });
    engine.close(outbound);
    let answer = match sent {
        Ok(Sent::Complete { frames, bytes }) => Ok(proto::PrefillEvent {
            event: Some(PrefillItem::Sent(proto::PrefillSent {
                frames,
                bytes,
                cached_tokens,
            })),
        }),
        Ok(Sent::Aborted) => {
            // A send dropped at decode's hang-up wrote no `Closed`, and its connection's end
            // is no teardown of the session unless a whole message of it arrived first: the
            // connection may not have opened yet, or the first frame was cut short. Decode
            // may then be waiting for the drain with nothing to end its wait: acknowledge on a
            // connection of its own (harmless if the connection's end already did — decode
            // ignores a `Closed` of a session it no longer holds). Not while the stall fault
            // keeps the socket open: that plays a peer that is stuck, not one that stopped.
            if hung_up && send.options.fault.is_none() {
                acknowledge_abort(&send).await;
            }
            return;
        }
        Err(e) => {
            tracing::warn!(address = %send.address, error = %e, "KV transfer to decode failed");
            let failed = status(&ServeError::PrefillUnavailable {
                reason: e.to_string(),
            });
            // The Prefill call's own span (this task's): its status was left unset.
            spans::failed(&Span::current(), &failed);
            Err(failed)
        }
    };
    let _ = tx.send(answer).await;
}

/// What a prefill worker's failed call says of the request, when it says: its KV failed its
/// integrity check, or its answer broke (with the code to record). `None` for anything else
/// (an outage, a transport's end): the transfer closed, a 503 to retry.
fn prefill_failure(status: &Status) -> Option<(&'static str, Failure)> {
    match proto::error_code(status) {
        Some(codes::KV_INTEGRITY) => Some((codes::KV_INTEGRITY, Failure::PrefillIntegrity)),
        Some(codes::INTERNAL) => Some((
            codes::INTERNAL,
            Failure::Forward(SeqFailure::Internal(
                "the prefill worker broke the request's answer".to_owned(),
            )),
        )),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::serve::actor::Unclaimed;

    /// A decode request submitted to `engine`, its pages reserved (the engine said so) and
    /// its `Reserved` event not read: as a client that left at that moment leaves it.
    async fn reserved_unread(engine: &EngineHandle) -> (Events, CancelOnDrop) {
        let (events, guard) = engine
            .submit(Submission::Decode, decode_request)
            .await
            .expect("admitted");
        until_reserved(engine).await;
        (events, guard)
    }

    /// A decode request of 20 prompt tokens and 4 to generate.
    fn decode_request(
        id: bulkhead_kvpool::RequestId,
        sink: Box<dyn crate::engine::EventSink>,
    ) -> Request {
        Request {
            id,
            tenant: Scope::new("test"),
            prompt: vec![5; 20],
            max_new_tokens: 4,
            sampling: crate::sampling::SamplingParams::GREEDY,
            stop: Vec::new(),
            ignore_eos: false,
            sink,
        }
    }

    /// Returns once `engine` has pages reserved.
    async fn until_reserved(engine: &EngineHandle) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while engine.stats().await.expect("stats").pool.reserved == 0 {
            assert!(Instant::now() < deadline, "never reserved");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// The pool's pages once `holds` says they are as expected, or after 5 s (a busy engine
    /// answers stats late, from before its step): less than the release timeout (10 s) that
    /// held pages wait.
    async fn pages(
        engine: &EngineHandle,
        holds: impl Fn(&bulkhead_kvpool::PoolStats) -> bool,
    ) -> bulkhead_kvpool::PoolStats {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let pool = engine.stats().await.expect("stats").pool;
            if holds(&pool) || Instant::now() > deadline {
                return pool;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Every page back: free, or waiting for its scrub.
    fn all_back(s: &bulkhead_kvpool::PoolStats) -> bool {
        s.releasing == 0
            && s.reserved == 0
            && s.quarantined == 0
            && s.free + s.pending_scrub == s.total
    }

    /// A client that leaves as its pages are reserved, before the reservation is read, never
    /// had its session named to a prefill worker: no drain acknowledgement will come, and its
    /// pages come back at once — not after the release timeout, into quarantine.
    #[tokio::test]
    async fn a_client_that_leaves_as_its_pages_are_reserved_gives_them_back_at_once() {
        let engine = EngineHandle::tiny();
        // Without `Unclaimed`: the pages wait for an acknowledgement nobody will send.
        let (events, guard) = reserved_unread(&engine).await;
        drop((events, guard));
        let held = pages(&engine, |s| s.releasing > 0).await;
        assert!(held.releasing > 0, "the drain it saves: {held:?}");
        let engine = EngineHandle::tiny();
        let (events, guard) = reserved_unread(&engine).await;
        drop(Unclaimed::new(&engine, events, guard));
        let back = pages(&engine, all_back).await;
        assert!(all_back(&back), "{back:?}");
        let stats = engine.stats().await.expect("stats");
        assert_eq!(stats.transfers.drain_timeouts, 0);
    }

    /// A client that leaves while its submission is answered — the engine admitted it and
    /// reserved its pages, the answer not yet read — gives them back at once too: the
    /// reservation waited in the events nobody read, and the pages for the release timeout.
    #[tokio::test]
    async fn a_client_that_leaves_before_its_submission_is_answered_gives_its_pages_back_at_once() {
        let engine = EngineHandle::tiny();
        let mut cx = Context::from_waker(std::task::Waker::noop());
        // The engine thread can answer before the first poll is over: such a submission is
        // dropped answered (its pages come back as a reservation's left unread), and the test
        // submits again until one is not.
        let submit = loop {
            let mut submit = Box::pin(engine.submit(Submission::Decode, decode_request));
            if submit.as_mut().poll(&mut cx).is_pending() {
                break submit;
            }
            drop(submit);
            let back = pages(&engine, all_back).await;
            assert!(all_back(&back), "{back:?}");
        };
        until_reserved(&engine).await;
        drop(submit);
        let back = pages(&engine, all_back).await;
        assert!(all_back(&back), "{back:?}");
        let stats = engine.stats().await.expect("stats");
        assert_eq!(stats.transfers.drain_timeouts, 0);
    }

    /// A prefill worker counts one token to generate; the client asked for more, and is told
    /// its own request's numbers. Other refusals pass as they are.
    #[test]
    fn a_prefill_refusal_is_restated_with_the_requests_own_numbers() {
        let refused = SubmitError::ContextLengthExceeded {
            requested: 43,
            limit: 32,
            prompt: 43,
            max_new: 1,
        };
        let told = restated(refused, 7);
        assert_eq!(
            told,
            SubmitError::ContextLengthExceeded {
                requested: 50,
                limit: 32,
                prompt: 43,
                max_new: 7,
            }
        );
        assert!(
            told.to_string()
                .contains("needs 50 (43 in the prompt + 7 to generate)")
        );
        let full = SubmitError::QueueFull { capacity: 3 };
        assert_eq!(restated(full.clone(), 7), full);
    }

    /// What the peer's Info says: a failed probe's reason until a process answers with its
    /// instance id; one that answers without (an older worker) is reported as such, not as
    /// not reached yet (the gateway waits, silently, on a worker still starting).
    #[test]
    fn a_peer_is_reported_by_its_instance_or_by_why_it_is_not() {
        let seen = SeenPeer::new("http://p:50051");
        assert_eq!(seen.report().instance_id, "");
        assert_eq!(seen.report().last_error, "", "not asked yet");
        seen.failed("refused");
        assert_eq!(seen.report().last_error, "refused");
        seen.answered_by("");
        assert_eq!(seen.report().instance_id, "");
        assert!(seen.report().last_error.contains("without an instance id"));
        seen.answered_by("p-1");
        assert_eq!(seen.report().instance_id, "p-1");
        assert_eq!(seen.report().last_error, "");
        // Replaced at that address by a process that answers without one.
        seen.answered_by("");
        assert_eq!(seen.report().instance_id, "", "p-1 no longer answers there");
        assert!(seen.report().last_error.contains("without an instance id"));
    }

    fn call(watch: tokio::task::JoinHandle<u32>) -> PrefillCall {
        PrefillCall {
            watch,
            computed_tokens: Arc::default(),
            computed: None,
            cached_tokens: None,
            wait: None,
        }
    }

    #[tokio::test]
    async fn prefills_computed_is_ready_once_and_never_when_prefill_did_not_say_it() {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let (said, computed) = oneshot::channel();
        let mut told = call(tokio::spawn(std::future::pending()));
        told.computed = Some(computed);
        assert!(told.poll_computed(&mut cx).is_pending(), "not said yet");
        said.send(()).expect("the call holds the receiver");
        assert!(told.poll_computed(&mut cx).is_ready());
        assert!(told.poll_computed(&mut cx).is_pending(), "told twice");

        let (said, computed) = oneshot::channel::<()>();
        let mut silent = call(tokio::spawn(std::future::pending()));
        silent.computed = Some(computed);
        drop(said);
        assert!(
            silent.poll_computed(&mut cx).is_pending(),
            "the call ended without it"
        );
        assert!(silent.computed.is_none());
    }

    #[tokio::test]
    async fn done_gets_prefills_cached_count_and_waits_for_it_at_most_sent_wait() {
        let mut answered = call(tokio::spawn(async { 48 }));
        let n = std::future::poll_fn(|cx| answered.poll_cached_tokens(cx)).await;
        assert_eq!(n, 48, "prefill's Sent said 48");
        assert_eq!(
            std::future::poll_fn(|cx| answered.poll_cached_tokens(cx)).await,
            48
        );

        // A prefill worker that never answers `Sent` holds the request's end for SENT_WAIT,
        // not for ever; the count is then 0 (unknown).
        let mut silent = call(tokio::spawn(std::future::pending()));
        let started = Instant::now();
        let n = std::future::poll_fn(|cx| silent.poll_cached_tokens(cx)).await;
        let waited = started.elapsed();
        assert_eq!(n, 0);
        assert!(waited >= SENT_WAIT && waited < SENT_WAIT * 5, "{waited:?}");
    }
}
