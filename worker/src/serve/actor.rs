//! The engine actor: one OS thread owns the [`Engine`]; everyone else talks to it through a
//! cheap, cloneable [`EngineHandle`].
//!
//! ```text
//!   EngineHandle ──Command (Submit/Cancel/Stats)──▶ engine thread
//!        ▲                                            │ loop:
//!        └────────── oneshot replies ─────────────────┤   drain commands
//!                                                     │   step() while there is work
//!   per request: Event ◀── ChannelSink ◀── engine ────┘   else block on the channel
//! ```
//!
//! The thread never blocks on a listener: events go through unbounded channels, and a listener
//! that has gone away makes the sink report `Delivery::Gone`, which cancels the request and
//! frees its pages. A dropped [`super::service`] stream also sends `Cancel`, which covers
//! requests that emit nothing for a while (waiting, or in a long prefill).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use std::sync::mpsc as std_mpsc;
use std::time::Instant;

use bulkhead_handoff::{Received, Reservation, SessionNonce};
use bulkhead_kvpool::{PoolStats, RequestId};
use tokio::sync::{mpsc, oneshot};

use crate::engine::{
    Capacity, Delivery, Engine, Event, EventSink, Failure, FinishReason, LiveSessions, Outbound,
    PrefixStats, Request, SubmitError, TransferStats,
};

use super::error::ServeError;
use super::kvplane::{Buffers, Lease};
use super::metrics::{Metrics, Outcome};

/// A snapshot of the engine's load and pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineStats {
    pub pool: PoolStats,
    /// Admitted, waiting for pages.
    pub waiting: usize,
    pub running: usize,
    pub capacity: Capacity,
    pub transfers: TransferStats,
    pub prefix: PrefixStats,
}

/// How a request is submitted: which part of it runs on this worker.
#[derive(Debug)]
pub enum Submission {
    /// Prefill and decode here.
    Colocated,
    /// Decode here; the sink gets `Event::Reserved` for the prefill worker.
    Decode,
    /// Prefill here into a decode worker's reservation.
    PrefillFor(Reservation),
}

/// What the handle asks of the engine thread.
#[derive(Debug)]
enum Command {
    Submit {
        request: Request,
        how: Submission,
        reply: oneshot::Sender<Result<(), ServeError>>,
    },
    /// A KV data-plane message for a decode-side transfer (frames checked on arrival).
    Deliver(Received, Buffers, Lease),
    /// The prefill worker refused a transfer; nothing of it will arrive.
    PrefillRejected {
        nonce: SessionNonce,
        reason: SubmitError,
    },
    /// The prefill worker filling a decode-side transfer has computed this many prompt tokens.
    PrefillProgress {
        nonce: SessionNonce,
        computed: u64,
    },
    /// A data-plane connection ended: nothing more of these sessions can arrive.
    TransportClosed(Vec<SessionNonce>),
    /// The prefill worker failed a transfer, saying why.
    PrefillFailed {
        nonce: SessionNonce,
        failure: Failure,
    },
    /// A prefill-side transfer is over: release its source pages on the engine thread.
    Close(Box<Outbound>),
    Cancel {
        id: RequestId,
        /// Counted as cancelled; not when the caller counts the request's end otherwise.
        counted: bool,
    },
    Stats {
        reply: oneshot::Sender<EngineStats>,
    },
}

/// A cloneable handle to the engine thread.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    commands: std_mpsc::Sender<Command>,
    next_id: Arc<AtomicU64>,
    metrics: Arc<Metrics>,
    /// The engine's stats as of its last step, for when it is too busy to answer.
    published: Arc<Published>,
    /// Decode role: the sessions whose frames the data plane still reads.
    live: LiveSessions,
}

/// The stats the engine thread publishes before each step, and when.
type Published = std::sync::Mutex<(EngineStats, Instant)>;

/// How long [`EngineHandle::stats`] waits for a fresh answer before it returns the published
/// one: a step can be a long prefill, and health must not depend on the engine being idle.
const STATS_WAIT: std::time::Duration = std::time::Duration::from_millis(200);

/// How long one step may run before the engine counts as stalled: a step computes at most one
/// batch's tokens, seconds even for a large model on a slow CPU — five minutes is no step's. A
/// stalled engine fails its health checks, so the gateway routes elsewhere and an orchestrator
/// restarts it, instead of the stats it published before it stopped answering for good.
const STALLED_AFTER: std::time::Duration = std::time::Duration::from_secs(300);

/// The stats published at `at`, as an answer at `now`: an error once they are older than
/// [`STALLED_AFTER`].
fn published_answer(
    (stats, at): (EngineStats, Instant),
    now: Instant,
) -> Result<EngineStats, ServeError> {
    let age = now.saturating_duration_since(at);
    if age > STALLED_AFTER {
        return Err(ServeError::EngineStalled {
            secs: age.as_secs(),
        });
    }
    Ok(stats)
}

/// How long the engine thread sleeps at most while requests wait for pages (see [`run`]).
const WAITING_POLL: std::time::Duration = std::time::Duration::from_millis(10);

/// The engine thread, for joining at shutdown.
#[derive(Debug)]
pub struct EngineThread(std::thread::JoinHandle<()>);

impl EngineThread {
    /// Waits for the thread to end (it ends once every handle is dropped).
    pub fn join(self) {
        if self.0.join().is_err() {
            tracing::error!("the engine thread panicked");
        }
    }
}

/// The events of one submitted request; `Done` or `Failed` is the last.
pub type Events = mpsc::UnboundedReceiver<Event>;

impl EngineHandle {
    /// Starts the engine thread; it runs until every handle is dropped.
    pub fn spawn(
        engine: Engine,
        metrics: Arc<Metrics>,
    ) -> std::io::Result<(EngineHandle, EngineThread)> {
        let (tx, rx) = std_mpsc::channel();
        let thread_metrics = metrics.clone();
        let published = Arc::new(Published::new((stats_of(&engine), Instant::now())));
        let thread_published = published.clone();
        let live = engine.live_sessions();
        let thread = std::thread::Builder::new()
            .name("bulkhead-engine".into())
            .spawn(move || run(engine, rx, &thread_metrics, &thread_published))?;
        let handle = EngineHandle {
            commands: tx,
            next_id: Arc::new(AtomicU64::new(1)),
            metrics,
            published,
            live,
        };
        Ok((handle, EngineThread(thread)))
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Decode role: whether the data plane still reads frames of `nonce`.
    pub fn receiving(&self, nonce: SessionNonce) -> bool {
        self.live.contains(nonce)
    }

    /// A fresh worker-internal id; callers' ids are never trusted to be unique.
    fn next_id(&self) -> RequestId {
        RequestId::new(self.next_id.fetch_add(1, Ordering::Relaxed))
    }

    /// Submits the request `build` makes around a fresh sink (with a fresh id); once admitted,
    /// returns its events and a guard that cancels it when dropped.
    pub async fn submit(
        &self,
        how: Submission,
        build: impl FnOnce(RequestId, Box<dyn EventSink>) -> Request,
    ) -> Result<(Events, CancelOnDrop), ServeError> {
        self.submit_unclaimed(how, build)
            .await
            .map(Unclaimed::claim)
    }

    /// [`EngineHandle::submit`], its events and guard handed over [`Unclaimed`]: a caller
    /// that leaves before it reads its reservation — or before the submission is answered
    /// (the engine may reserve at once) — has it closed at once.
    pub(crate) async fn submit_unclaimed(
        &self,
        how: Submission,
        build: impl FnOnce(RequestId, Box<dyn EventSink>) -> Request,
    ) -> Result<Unclaimed<'_>, ServeError> {
        let (tx, rx) = mpsc::unbounded_channel();
        let sink = ChannelSink {
            tx,
            metrics: self.metrics.clone(),
        };
        let id = self.next_id();
        let request = build(id, Box::new(sink));
        let (reply, answer) = oneshot::channel();
        self.commands
            .send(Command::Submit {
                request,
                how,
                reply,
            })
            .map_err(|_| ServeError::EngineGone)?;
        // From here on, if this future is dropped the request must not linger in the engine,
        // nor a reservation the engine made for it in the events nobody reads.
        let guard = CancelOnDrop {
            handle: self.clone(),
            id,
            armed: true,
        };
        let unclaimed = Unclaimed::new(self, rx, guard);
        match answer.await {
            Ok(Ok(())) => Ok(unclaimed),
            Ok(Err(e)) => Err(unclaimed.refused(e)),
            Err(_) => Err(unclaimed.refused(ServeError::EngineGone)),
        }
    }

    /// Cancels `id` wherever it is, counted as cancelled; harmless if it already ended.
    pub fn cancel(&self, id: RequestId) {
        self.send_cancel(id, true);
    }

    fn send_cancel(&self, id: RequestId, counted: bool) {
        // An error means the engine thread is gone, and with it the request.
        let _ = self.commands.send(Command::Cancel { id, counted });
    }

    /// Hands a data-plane message to the engine; a frame's buffer goes back to `buffers`, and
    /// `lease` is dropped once the message is dealt with.
    pub fn deliver(&self, message: Received, buffers: Buffers, lease: Lease) {
        let _ = self
            .commands
            .send(Command::Deliver(message, buffers, lease));
    }

    /// The prefill worker refused transfer `nonce`.
    pub fn prefill_rejected(&self, nonce: SessionNonce, reason: SubmitError) {
        let _ = self
            .commands
            .send(Command::PrefillRejected { nonce, reason });
    }

    /// The prefill worker filling transfer `nonce` has computed `computed` prompt tokens since
    /// it started.
    pub fn prefill_progress(&self, nonce: SessionNonce, computed: u64) {
        let _ = self
            .commands
            .send(Command::PrefillProgress { nonce, computed });
    }

    /// The prefill worker failed transfer `nonce` with `failure`.
    pub fn prefill_failed(&self, nonce: SessionNonce, failure: Failure) {
        let _ = self
            .commands
            .send(Command::PrefillFailed { nonce, failure });
    }

    /// A data-plane connection that carried `nonces` ended.
    pub fn transport_closed(&self, nonces: Vec<SessionNonce>) {
        let _ = self.commands.send(Command::TransportClosed(nonces));
    }

    /// A prefill-side transfer is over; its source pages go back on the engine thread.
    pub fn close(&self, outbound: Outbound) {
        let _ = self.commands.send(Command::Close(Box::new(outbound)));
    }

    /// The engine's stats: fresh (after every command sent before) when the engine answers
    /// within [`STATS_WAIT`], else as published before its current step.
    pub async fn stats(&self) -> Result<EngineStats, ServeError> {
        let (reply, answer) = oneshot::channel();
        self.commands
            .send(Command::Stats { reply })
            .map_err(|_| ServeError::EngineGone)?;
        match tokio::time::timeout(STATS_WAIT, answer).await {
            Ok(fresh) => fresh.map_err(|_| ServeError::EngineGone),
            Err(_busy) => published_answer(
                *self
                    .published
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner),
                Instant::now(),
            ),
        }
    }
}

#[cfg(test)]
impl EngineHandle {
    /// An engine thread over a tiny random model and a 256-token pool.
    pub(crate) fn tiny() -> EngineHandle {
        use crate::engine::{EngineConfig, KvBudget};
        let path = std::env::temp_dir().join(format!(
            "bulkhead-engine-{}-{}.gguf",
            std::process::id(),
            rand::random::<u64>()
        ));
        crate::tiny_model::TinySpec::default()
            .write(&path)
            .expect("write the tiny model");
        let loaded = crate::loader::LoadedModel::open(&path).expect("load the tiny model");
        let _ = std::fs::remove_file(&path);
        let config = EngineConfig {
            kv: KvBudget::Tokens(256),
            ..EngineConfig::default()
        };
        let engine = Engine::new(loaded.model, loaded.tokenizer, config).expect("engine starts");
        EngineHandle::spawn(engine, Arc::new(Metrics::default()))
            .expect("spawn")
            .0
    }
}

/// The engine thread's loop.
fn run(
    mut engine: Engine,
    commands: std_mpsc::Receiver<Command>,
    metrics: &Metrics,
    published: &Published,
) {
    loop {
        // Block only when a step could do nothing: released pages waiting for a scrub count as
        // work, since `step` is what scrubs them back onto the free list; requests that wait
        // for pages do not — a command (a transfer's end, a cancel) or a deadline frees them,
        // and every command is followed by a step — though the wait is then cut to
        // [`WAITING_POLL`], for pages handed back off this thread (a holder dropped with its
        // channel). Deadlines bound the wait.
        let busy = engine.can_progress() || engine.pool().stats().pending_scrub > 0;
        if !busy {
            let poll = engine.has_work().then(|| Instant::now() + WAITING_POLL);
            let next = match engine.next_deadline().into_iter().chain(poll).min() {
                None => commands
                    .recv()
                    .map_err(|_| std_mpsc::RecvTimeoutError::Disconnected),
                Some(at) => commands.recv_timeout(at.saturating_duration_since(Instant::now())),
            };
            match next {
                Ok(c) => handle(&mut engine, c, metrics),
                Err(std_mpsc::RecvTimeoutError::Timeout) => {}
                Err(std_mpsc::RecvTimeoutError::Disconnected) => break,
            }
        }
        loop {
            match commands.try_recv() {
                Ok(c) => handle(&mut engine, c, metrics),
                Err(std_mpsc::TryRecvError::Empty) => break,
                Err(std_mpsc::TryRecvError::Disconnected) => {
                    if !engine.has_work() {
                        return;
                    }
                    break;
                }
            }
        }
        *published
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) =
            (stats_of(&engine), Instant::now());
        engine.step();
        metrics.set_computed_prompt_tokens(engine.computed_prompt_tokens());
    }
}

fn stats_of(engine: &Engine) -> EngineStats {
    let (waiting, running) = engine.load();
    EngineStats {
        pool: engine.pool().stats(),
        waiting,
        running,
        capacity: engine.capacity(),
        transfers: engine.transfer_stats(),
        prefix: engine.prefix_stats(),
    }
}

fn handle(engine: &mut Engine, command: Command, metrics: &Metrics) {
    match command {
        Command::Submit {
            request,
            how,
            reply,
        } => {
            let result = match how {
                Submission::Colocated => engine.submit(request),
                Submission::Decode => engine.submit_decode(request),
                Submission::PrefillFor(target) => engine.submit_prefill(request, target),
            };
            // A caller that stopped waiting drops its receiver; the request then runs until its
            // sink reports `Gone` at the first event.
            let _ = reply.send(result.map_err(|(e, _request)| e.into()));
        }
        Command::Cancel { id, counted } => {
            if engine.cancel(id) && counted {
                metrics.count(Outcome::Cancelled);
            }
        }
        Command::Deliver(message, buffers, lease) => {
            if let Some(spent) = engine.deliver(message) {
                buffers.give(spent);
            }
            drop(lease);
        }
        Command::PrefillRejected { nonce, reason } => engine.prefill_rejected(nonce, reason),
        Command::PrefillProgress { nonce, computed } => engine.prefill_progress(nonce, computed),
        Command::TransportClosed(nonces) => engine.transport_closed(&nonces),
        Command::PrefillFailed { nonce, failure } => engine.prefill_failed(nonce, failure),
        Command::Close(outbound) => outbound.close(),
        Command::Stats { reply } => {
            let _ = reply.send(stats_of(engine));
        }
    }
}

/// A submitted request's events and guard that nobody has taken yet. Dropped so — its caller
/// left as the engine reserved its pages, before it read the reservation, or even before the
/// submission's answer — the session was never named to a prefill worker, so no drain
/// acknowledgement and no teardown of a call would ever come: the pages waited the release
/// timeout and were quarantined. Dropped so, the request is cancelled and then its session
/// torn down (the order `Unanswered` in `disagg.rs` keeps), and the pages come back at once.
pub(crate) struct Unclaimed<'a> {
    engine: &'a EngineHandle,
    /// `None` once taken.
    waiting: Option<(Events, CancelOnDrop)>,
}

impl<'a> Unclaimed<'a> {
    pub(crate) fn new(engine: &'a EngineHandle, events: Events, guard: CancelOnDrop) -> Self {
        Self {
            engine,
            waiting: Some((events, guard)),
        }
    }

    /// The next event, while nobody has taken them.
    pub(crate) async fn next(&mut self) -> Option<Event> {
        self.waiting.as_mut()?.0.recv().await
    }

    /// Waits for the request's first event, which `first` takes (`Err` gives it back: not the
    /// one expected), then claims the events and the guard. A failure first, or the engine
    /// gone, is the submission's.
    pub(crate) async fn first<T>(
        mut self,
        what: &'static str,
        first: impl FnOnce(Event) -> Result<T, Event>,
    ) -> Result<(Events, CancelOnDrop, T), ServeError> {
        match self.next().await {
            Some(Event::Failed(f)) => Err(ServeError::Failed(f)),
            None => Err(ServeError::EngineGone),
            Some(event) => match first(event) {
                Ok(first) => {
                    let (events, guard) = self.claim();
                    Ok((events, guard, first))
                }
                Err(other) => {
                    tracing::error!(
                        event = other.kind(),
                        "a request's first event was not {what}"
                    );
                    Err(ServeError::Internal { what: "engine" })
                }
            },
        }
    }

    /// The caller takes the events and the guard: from here on it names the session.
    pub(crate) fn claim(mut self) -> (Events, CancelOnDrop) {
        self.waiting
            .take()
            .expect("taken once, by claim or refused")
    }

    /// The engine refused the submission (`e`): nothing of it is left to cancel.
    fn refused(mut self, e: ServeError) -> ServeError {
        if let Some((_, mut guard)) = self.waiting.take() {
            guard.disarm();
        }
        e
    }
}

impl Drop for Unclaimed<'_> {
    fn drop(&mut self) {
        let Some((mut events, guard)) = self.waiting.take() else {
            return;
        };
        // From here a reservation the engine makes goes nowhere, and it drops it itself.
        events.close();
        drop(guard);
        while let Ok(event) = events.try_recv() {
            if let Event::Reserved(target) = event {
                self.engine.transport_closed(vec![target.nonce]);
            }
        }
    }
}

/// Cancels a submitted request when dropped, unless disarmed (it ended on its own).
#[derive(Debug)]
pub struct CancelOnDrop {
    handle: EngineHandle,
    id: RequestId,
    armed: bool,
}

impl CancelOnDrop {
    /// The worker-internal id of the request.
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// The request ended by itself; dropping the guard no longer cancels it.
    pub fn disarm(&mut self) {
        self.armed = false;
    }

    /// Cancels the request, which its caller counts as it fails it (a refusal): not as
    /// cancelled too.
    pub fn withdraw(mut self) {
        self.armed = false;
        self.handle.send_cancel(self.id, false);
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if self.armed {
            self.handle.cancel(self.id);
        }
    }
}

/// Delivers one request's events to its stream, counting outcomes and tokens. Never blocks.
#[derive(Debug)]
struct ChannelSink {
    tx: mpsc::UnboundedSender<Event>,
    metrics: Arc<Metrics>,
}

impl EventSink for ChannelSink {
    fn emit(&mut self, event: Event) -> Delivery {
        match &event {
            Event::Token { .. } => self.metrics.add_generated(1),
            Event::Done { reason, .. } => self.metrics.count(match reason {
                FinishReason::Stop => Outcome::Stop,
                FinishReason::Length => Outcome::Length,
            }),
            Event::Failed(f) => self.metrics.count(Outcome::failed(f)),
            // A start is no outcome; transfer events are counted by the transfer paths.
            Event::Started | Event::Reserved(_) | Event::Prefilled(_) => {}
        }
        let counted = matches!(event, Event::Done { .. } | Event::Failed(_));
        match self.tx.send(event) {
            Ok(()) => Delivery::Delivered,
            Err(_) => {
                // The engine drops a request whose event found no listener — a token, a
                // reservation, a computed prompt —: it was cancelled (the listener's cancel
                // will not find it). A final event that found none was counted above.
                if !counted {
                    self.metrics.count(Outcome::Cancelled);
                }
                Delivery::Gone
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Published stats stand in for a busy engine's answer, not for one stuck in a step: past
    /// [`STALLED_AFTER`] its health checks fail, where they answered "ok" for ever.
    #[tokio::test]
    async fn an_engine_stuck_in_a_step_fails_its_health_checks() {
        let stats = EngineHandle::tiny().stats().await.expect("stats");
        let at = Instant::now();
        assert!(published_answer((stats, at), at + STALLED_AFTER / 2).is_ok());
        let stalled = published_answer((stats, at), at + STALLED_AFTER * 2);
        assert!(
            matches!(stalled, Err(ServeError::EngineStalled { secs }) if secs >= 600),
            "{stalled:?}"
        );
    }

    /// An event that finds no listener counts its request cancelled once: the engine drops the
    /// request, so the cancel its listener sent on leaving finds nothing to count. (Only a
    /// token's was counted: a reservation or a computed prompt nobody took left its request
    /// uncounted.) A final event's outcome is counted once, as it is emitted.
    #[test]
    fn an_event_nobody_takes_counts_its_request_cancelled_once() {
        let metrics = Arc::new(Metrics::default());
        let (tx, rx) = mpsc::unbounded_channel();
        drop(rx);
        let mut sink = ChannelSink {
            tx,
            metrics: metrics.clone(),
        };
        let reservation = Reservation {
            nonce: SessionNonce([7; 16]),
            pages: Vec::new(),
            prompt_tokens: 4,
            cached_tokens: 0,
            page_tokens: 16,
            token_bytes: 8,
        };
        assert_eq!(sink.emit(Event::Reserved(reservation)), Delivery::Gone);
        assert_eq!(metrics.requests(Outcome::Cancelled), 1);
        let token = Event::Token {
            token: 5,
            text: "a".into(),
        };
        assert_eq!(sink.emit(token), Delivery::Gone);
        assert_eq!(metrics.requests(Outcome::Cancelled), 2);
        let done = Event::Failed(crate::engine::Failure::QueueTimedOut(
            std::time::Duration::from_secs(1),
        ));
        assert_eq!(sink.emit(done), Delivery::Gone);
        assert_eq!(metrics.requests(Outcome::Cancelled), 2, "counted as failed");
    }
}
