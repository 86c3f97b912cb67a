//! Accepting and serving HTTP/1.1 connections. The admin listener is served on the caller's
//! runtime; the API on serving threads: the caller's runtime accepts every connection and
//! deals it to the thread with the fewest open connections, and that thread serves it, every
//! request on it start to end, on a single-threaded runtime of its own.
//!
//! Why threads of their own rather than one work-stealing runtime: with the latter, a request
//! hops between threads (the connection's task, the upstream connection's task, wake-ups
//! through the other thread's queue), and the gateway spent about a quarter more CPU per
//! request for it (docs/benchmarks.md, "Gateway overhead against nginx and LiteLLM"). A
//! connection is handed over once, when dealt.

use std::convert::Infallible;
use std::num::NonZeroUsize;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::response::IntoResponse as _;
use axum::response::Response;
use bulkhead_worker::serve::tls::{ListenerTls, Opened};
use http::Request;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot, watch};
use tokio::task::JoinSet;

use crate::api::ApiError;
use crate::config::HttpLimits;
use crate::write_deadline::WriteDeadline;

/// How long the requests cut at shutdown have to send their clients the error that ends
/// them before their connections are dropped.
const CUT_GRACE: Duration = Duration::from_millis(500);

/// Told what happens to requests that the service never finishes: the API's audit trail.
pub trait Witness: Send + Sync + 'static {
    /// Shutdown cuts the requests still running after the drain timeout (told before they
    /// are dropped).
    fn cut(&self);
    /// hyper could not parse a request and answered it `status` itself (400, 414 or 431);
    /// no service ran.
    fn unparsed(&self, status: u16);
    /// A client sent plain HTTP to a TLS port and was answered 400 `https_required`; no
    /// service ran.
    fn plain_http(&self);
    /// Returns once the work requests left behind their connections has ended (an abandoned
    /// request held on its worker, a policy's `on-response-end`): shutdown's drain waits for
    /// it as for the connections. None by default.
    fn settled(&self) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(std::future::ready(()))
    }
}

/// A witness that records nothing (the admin listener, benchmarks).
impl Witness for () {
    fn cut(&self) {}
    fn unparsed(&self, _: u16) {}
    fn plain_http(&self) {}
}

/// What hyper answered a request it could not parse, from the error its connection ended with;
/// `None` for every other error.
fn unparsed(e: &hyper::Error) -> Option<u16> {
    if e.is_parse_too_large() {
        // A URI over hyper's limit is answered 414, a head over its buffer 431.
        Some(if e.to_string().contains("URI too long") {
            414
        } else {
            431
        })
    } else if e.is_parse() {
        Some(400)
    } else {
        None
    }
}

/// What serves a connection's requests.
pub trait Service:
    hyper::service::Service<
        Request<Incoming>,
        Response = Response,
        Error = Infallible,
        Future: Send + 'static,
    > + Clone
    + Send
    + 'static
{
}

impl<S> Service for S where
    S: hyper::service::Service<
            Request<Incoming>,
            Response = Response,
            Error = Infallible,
            Future: Send + 'static,
        > + Clone
        + Send
        + 'static
{
}

/// Serves `listener` on `threads` threads until `stop`: the calling runtime accepts and is one
/// of them (with one thread, the only one); the others are started here, each with a
/// single-threaded runtime, and have drained and ended when this returns. A thread that
/// cannot be started is left out (and logged); its connections go to the others. With
/// `edge.tls`, every connection starts with its TLS handshake (see [`Connections::serve`]). A
/// client that has not sent its headers within `edge.limits.header_timeout` is disconnected
/// (slowloris), and so is one that takes no byte of its response for `write_stall_timeout`;
/// at most `edge.limits.max_connections` are open at once (lowered to what the process's
/// descriptors leave), the next waiting in the listen backlog until one closes; in-flight
/// connections get `drain_timeout` at shutdown. `witness` hears of the requests still
/// running then (before they are dropped) and of those hyper could not parse.
pub async fn serve<S: Service>(
    listener: TcpListener,
    service: S,
    edge: Edge,
    threads: NonZeroUsize,
    mut stop: watch::Receiver<bool>,
    witness: Arc<dyn Witness>,
) {
    let mut seats = vec![Seat {
        open: Arc::default(),
        to: None,
    }];
    let mut ended = Vec::new();
    for index in 1..threads.get() {
        match spawn_thread(index, service.clone(), edge.clone(), witness.clone()) {
            Ok((to, done)) => {
                seats.push(Seat {
                    open: Arc::default(),
                    to: Some(to),
                });
                ended.push(done);
            }
            Err(e) => tracing::error!(error = %e, "an API serving thread did not start"),
        }
    }
    let places = Places::new(
        edge.limits.max_connections,
        crate::descriptors::soft_limit(),
    );
    let mut local = Connections::new(service, edge, witness);
    accept(&listener, &mut stop, places, |stream, place| {
        if let Some((stream, open)) = deal(&mut seats, stream, place) {
            local.serve(stream, open);
        }
    })
    .await;
    // Closing the channels tells the other threads to drain and end.
    drop(seats);
    local.drain().await;
    for done in ended {
        let _ = done.await;
    }
}

/// A serving thread as the dealer sees it.
struct Seat {
    /// Its open connections.
    open: Arc<AtomicUsize>,
    /// Where its connections are sent; `None`: the accepting thread itself.
    to: Option<mpsc::UnboundedSender<Dealt>>,
}

/// A connection handed to another thread, with its count on that thread's seat.
type Dealt = (std::net::TcpStream, Open);

/// Gives `stream`, holding `place`, to the seat with the fewest open connections (the first
/// of them on a tie). Returns it, with its count, when it is the accepting thread's to serve. A
/// thread that has gone (its channel closed) loses its seat, and the stream goes to another.
fn deal(
    seats: &mut Vec<Seat>,
    mut stream: TcpStream,
    mut place: OwnedSemaphorePermit,
) -> Option<(TcpStream, Open)> {
    loop {
        let (i, seat) = seats
            .iter()
            .enumerate()
            .min_by_key(|(_, s)| s.open.load(Ordering::Relaxed))
            .expect("the accepting thread's seat is never removed");
        let open = Open::new(seat.open.clone(), place);
        let Some(to) = &seat.to else {
            return Some((stream, open));
        };
        let std = stream
            .into_std()
            .map_err(|e| tracing::warn!(error = %e, "a connection could not be handed over"))
            .ok()?;
        let mpsc::error::SendError((std, open)) = to.send((std, open)).err()?;
        place = open.place;
        tracing::error!(
            thread = i,
            "an API serving thread has ended; dealing around it"
        );
        seats.remove(i);
        stream = TcpStream::from_std(std)
            .map_err(|e| tracing::warn!(error = %e, "a connection could not be taken back"))
            .ok()?;
    }
}

/// One open connection, counted on its thread's seat and holding its place among the
/// listener's until dropped.
struct Open {
    _counted: Counted,
    place: OwnedSemaphorePermit,
}

impl Open {
    fn new(count: Arc<AtomicUsize>, place: OwnedSemaphorePermit) -> Open {
        count.fetch_add(1, Ordering::Relaxed);
        Open {
            _counted: Counted(count),
            place,
        }
    }
}

/// A connection's count on its seat, taken off when dropped.
struct Counted(Arc<AtomicUsize>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// How often a listener whose connections are all open says so.
const FULL_SAID_EVERY: Duration = Duration::from_secs(10);

/// A listener's places for open connections.
struct Places {
    free: Arc<Semaphore>,
    max: usize,
    said_full: Option<std::time::Instant>,
}

impl Places {
    /// `max` places, or as many as `soft` descriptors leave when that is fewer (said once),
    /// and never more than a semaphore holds.
    fn new(max: NonZeroUsize, soft: Option<u64>) -> Places {
        let room = soft.map_or(usize::MAX, crate::descriptors::connection_room);
        if room < max.get() {
            tracing::warn!(
                max_connections = max.get(),
                room,
                descriptors = soft,
                "the limit on open descriptors leaves a listener room for fewer connections \
                 than its bound: raise it (ulimit -Hn, LimitNOFILE=)"
            );
        }
        let max = max.get().min(room).min(Semaphore::MAX_PERMITS);
        Places {
            free: Arc::new(Semaphore::new(max)),
            max,
            said_full: None,
        }
    }

    /// A place, once one is free; `None` if `stop` comes first.
    async fn take(&mut self, stop: &mut watch::Receiver<bool>) -> Option<OwnedSemaphorePermit> {
        if let Ok(place) = self.free.clone().try_acquire_owned() {
            return Some(place);
        }
        let now = std::time::Instant::now();
        if self
            .said_full
            .is_none_or(|at| now.duration_since(at) >= FULL_SAID_EVERY)
        {
            tracing::warn!(
                max_connections = self.max,
                "every connection place is taken: new connections wait in the listen backlog"
            );
            self.said_full = Some(now);
        }
        tokio::select! {
            place = self.free.clone().acquire_owned() => place.ok(),
            () = stopped(stop) => None,
        }
    }
}

/// Starts serving thread `index` (besides the accepting one), which serves the connections
/// sent to it until the sender is gone. The receiver completes once the thread has drained
/// them and shut its runtime down.
fn spawn_thread<S: Service>(
    index: usize,
    service: S,
    edge: Edge,
    witness: Arc<dyn Witness>,
) -> std::io::Result<(mpsc::UnboundedSender<Dealt>, oneshot::Receiver<()>)> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (to, mut from) = mpsc::unbounded_channel::<Dealt>();
    let (finished, done) = oneshot::channel();
    std::thread::Builder::new()
        .name(format!("bulkhead-api-{index}"))
        .spawn(move || {
            runtime.block_on(async {
                let mut connections = Connections::new(service, edge, witness);
                while let Some((std, open)) = from.recv().await {
                    match TcpStream::from_std(std) {
                        Ok(stream) => connections.serve(stream, open),
                        Err(e) => tracing::warn!(error = %e, "a dealt connection was lost"),
                    }
                }
                connections.drain().await;
            });
            // Tasks its connections spawned (held abandoned requests) end with it.
            drop(runtime);
            let _ = finished.send(());
        })?;
    Ok((to, done))
}

/// What every connection of a listener gets: the limits, and TLS when it is on.
#[derive(Debug, Clone)]
pub struct Edge {
    pub limits: HttpLimits,
    pub tls: Option<ListenerTls>,
}

/// The connections one thread serves: HTTP/1.1 with a header timeout and a write deadline
/// (over TLS when it is on), each watched so that shutdown can drain them, and held so that it
/// can cut them.
struct Connections<S> {
    service: S,
    builder: hyper::server::conn::http1::Builder,
    write_stall_timeout: Duration,
    drain_timeout: Duration,
    /// With the header timeout as the handshake's limit.
    tls: Option<(ListenerTls, Duration)>,
    witness: Arc<dyn Witness>,
    graceful: GracefulShutdown,
    /// Set when the drain begins: a connection still in its TLS handshake is closed then (it
    /// carries no request yet, and the drain would otherwise wait for its handshake).
    draining: watch::Sender<bool>,
    tasks: JoinSet<()>,
}

impl<S: Service> Connections<S> {
    fn new(service: S, edge: Edge, witness: Arc<dyn Witness>) -> Connections<S> {
        let Edge { limits, tls } = edge;
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_timeout);
        Connections {
            service,
            builder,
            write_stall_timeout: limits.write_stall_timeout,
            drain_timeout: limits.drain_timeout,
            tls: tls.map(|tls| (tls, limits.header_timeout)),
            witness,
            graceful: GracefulShutdown::new(),
            draining: watch::Sender::new(false),
            tasks: JoinSet::new(),
        }
    }

    /// Serves `stream` on a task of the current runtime; `open` counts it until it closes.
    /// With TLS, the task first completes the handshake, within the header timeout (a client
    /// that stalls it is disconnected like one that stalls its headers; the head then has its
    /// own header timeout); a connection whose handshake fails is closed, having carried no
    /// request, and one that sent plain HTTP is answered 400 `https_required` and closed.
    fn serve(&mut self, stream: TcpStream, open: Open) {
        // The tasks of connections that have closed are let go of here.
        while self.tasks.try_join_next().is_some() {}
        let _ = stream.set_nodelay(true);
        let stall = self.write_stall_timeout;
        let http = Http {
            builder: self.builder.clone(),
            service: self.service.clone(),
            watcher: self.graceful.watcher(),
            witness: self.witness.clone(),
        };
        match self.tls.clone() {
            None => self.tasks.spawn(async move {
                let _open = open;
                http.serve(WriteDeadline::new(stream, stall)).await;
            }),
            Some((tls, limit)) => {
                let mut draining = self.draining.subscribe();
                self.tasks.spawn(async move {
                    let _open = open;
                    let wrap = |s| WriteDeadline::new(s, stall);
                    let opened = tokio::select! {
                        opened = tls.accept(stream, wrap, limit) => opened,
                        () = stopped(&mut draining) => return,
                    };
                    match opened {
                        Ok(Opened::Tls(io)) => Box::pin(http.serve(io)).await,
                        Ok(Opened::PlainHttp(io)) => http.refuse_plain(io).await,
                        Err(e) => tracing::debug!(error = %e, "TLS handshake failed"),
                    }
                })
            }
        };
    }

    /// Asks every connection to finish its request in flight and close; waits at most the
    /// drain timeout, then tells the witness of those still open and drops them (their
    /// requests with them) before returning.
    async fn drain(self) {
        let Connections {
            graceful,
            mut tasks,
            drain_timeout,
            witness,
            draining,
            ..
        } = self;
        draining.send_replace(true);
        let shutdown = graceful.shutdown();
        let settled = async {
            shutdown.await;
            witness.settled().await;
        };
        tokio::pin!(settled);
        if tokio::time::timeout(drain_timeout, &mut settled)
            .await
            .is_err()
        {
            tracing::warn!("requests still running at shutdown; cutting them");
            witness.cut();
            // The requests cut answer their clients (an error event ends a stream) and their
            // connections close, the holds record how far they got; what still hangs after
            // that is dropped.
            let _ = tokio::time::timeout(CUT_GRACE, &mut settled).await;
            tasks.shutdown().await;
        }
    }
}

/// What serves one connection's HTTP once its bytes are plain.
struct Http<S> {
    builder: hyper::server::conn::http1::Builder,
    service: S,
    watcher: Watcher,
    witness: Arc<dyn Witness>,
}

impl<S> Http<S> {
    /// Answers the plain-HTTP request on a TLS port 400 `https_required` (hyper reads its
    /// head; nothing else of it is used) and closes the connection.
    async fn refuse_plain<IO: AsyncRead + AsyncWrite + Unpin + Send + 'static>(self, io: IO) {
        let witness = self.witness;
        // Told once a request's head has parsed: a byte and a close is no request.
        let refuse = hyper::service::service_fn(move |_: Request<Incoming>| {
            witness.plain_http();
            async { Ok::<_, Infallible>(ApiError::HttpsRequired.into_response()) }
        });
        let mut builder = self.builder;
        builder.keep_alive(false);
        let connection = builder.serve_connection(TokioIo::new(io), refuse);
        if let Err(e) = self.watcher.watch(connection).await {
            tracing::debug!(error = %e, "a plain-HTTP connection to a TLS port ended with an error");
        }
    }
}

impl<S: Service> Http<S> {
    /// Serves the connection's requests until it closes, watched for shutdown.
    async fn serve<IO: AsyncRead + AsyncWrite + Unpin + Send + 'static>(self, io: IO) {
        let connection = self
            .builder
            .serve_connection(TokioIo::new(io), self.service);
        if let Err(e) = self.watcher.watch(connection).await {
            tracing::debug!(error = %e, "connection ended with an error");
            if let Some(status) = unparsed(&e) {
                self.witness.unparsed(status);
            }
        }
    }
}

/// Completes once stop is set (or its sender is gone, which also means stop).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// Accepts connections until `stop`, each once it has a place, handing it with its place to `deal`.
async fn accept(
    listener: &TcpListener,
    stop: &mut watch::Receiver<bool>,
    mut places: Places,
    mut deal: impl FnMut(TcpStream, OwnedSemaphorePermit),
) {
    loop {
        let Some(place) = places.take(stop).await else {
            return;
        };
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => deal(stream, place),
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            () = stopped(stop) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use axum::body::Body;
    use http_body_util::BodyExt as _;

    /// A service answering with the name of the thread that serves the request.
    fn thread_name() -> impl Service {
        hyper::service::service_fn(|_: Request<Incoming>| async {
            let name = std::thread::current().name().unwrap_or("").to_owned();
            Ok::<_, Infallible>(Response::new(Body::from(name)))
        })
    }

    /// A keep-alive connection to `addr`.
    async fn connect(
        addr: std::net::SocketAddr,
    ) -> hyper::client::conn::http1::SendRequest<http_body_util::Empty<bytes::Bytes>> {
        let stream = TcpStream::connect(addr).await.expect("connect");
        let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .expect("handshake");
        tokio::spawn(conn);
        send
    }

    /// The name of the thread that serves a request on `send`'s connection.
    async fn served_by(
        send: &mut hyper::client::conn::http1::SendRequest<http_body_util::Empty<bytes::Bytes>>,
    ) -> String {
        let request = Request::get("/")
            .header("host", "test")
            .body(http_body_util::Empty::new())
            .expect("request");
        let response = send.send_request(request).await.expect("response");
        let body = response.into_body().collect().await.expect("body");
        String::from_utf8(body.to_bytes().to_vec()).expect("utf-8")
    }

    /// [`serve`] on a fresh loopback listener, as a task.
    struct Running {
        addr: std::net::SocketAddr,
        stop: watch::Sender<bool>,
        task: tokio::task::JoinHandle<()>,
    }

    async fn start(
        service: impl Service,
        limits: HttpLimits,
        threads: NonZeroUsize,
        witness: Arc<dyn Witness>,
    ) -> Running {
        start_with(service, limits, None, threads, witness).await
    }

    async fn start_with(
        service: impl Service,
        limits: HttpLimits,
        tls: Option<ListenerTls>,
        threads: NonZeroUsize,
        witness: Arc<dyn Witness>,
    ) -> Running {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop, stopped) = watch::channel(false);
        let edge = Edge { limits, tls };
        let task = tokio::spawn(serve(listener, service, edge, threads, stopped, witness));
        Running { addr, stop, task }
    }

    impl Running {
        /// Stops serving and waits, at most `within`, until every thread drained and ended.
        async fn stop(self, within: Duration) {
            self.stop.send(true).expect("stop");
            tokio::time::timeout(within, self.task)
                .await
                .expect("every thread drained and ended")
                .expect("no panic");
        }
    }

    /// Past `max_connections` a connection waits in the listen backlog, unserved, while those
    /// open are served; once one closes, it is taken. Unbounded, whoever opens connections
    /// takes every descriptor, and with them every upstream connection and audit file.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn past_its_bound_a_connection_waits_until_one_closes() {
        let two = NonZeroUsize::new(2).expect("2");
        let limits = HttpLimits {
            max_connections: two,
            ..HttpLimits::default()
        };
        let serving = start(thread_name(), limits, two, Arc::new(())).await;
        let mut open = vec![connect(serving.addr).await, connect(serving.addr).await];
        for c in &mut open {
            served_by(c).await;
        }
        let mut third = connect(serving.addr).await;
        let waiting = tokio::spawn(async move { served_by(&mut third).await });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!waiting.is_finished(), "served past the bound");
        served_by(&mut open[1]).await;
        drop(open.remove(0));
        let served = tokio::time::timeout(Duration::from_secs(5), waiting).await;
        assert!(matches!(served, Ok(Ok(_))), "taken once a place is free");
        serving.stop(Duration::from_secs(5)).await;
    }

    /// The bound is lowered to what the descriptors leave.
    #[test]
    fn a_bound_the_descriptors_cannot_hold_is_lowered() {
        let max = NonZeroUsize::new(10_000).expect("nonzero");
        assert_eq!(Places::new(max, Some(1024)).max, 384);
        assert_eq!(Places::new(max, Some(1 << 20)).max, 10_000);
        assert_eq!(Places::new(max, None).max, 10_000);
        let huge = NonZeroUsize::new(usize::MAX).expect("nonzero");
        assert_eq!(Places::new(huge, None).max, Semaphore::MAX_PERMITS);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn each_connection_goes_to_the_thread_with_the_fewest_open_and_stays_there() {
        let three = NonZeroUsize::new(3).expect("3");
        let serving = start(thread_name(), HttpLimits::default(), three, Arc::new(())).await;
        let addr = serving.addr;
        let here = std::thread::current().name().unwrap_or("").to_owned();
        let mut connections = Vec::new();
        let mut names = Vec::new();
        for _ in 0..6 {
            let mut c = connect(addr).await;
            names.push(served_by(&mut c).await);
            connections.push(c);
        }
        let expected = [here.as_str(), "bulkhead-api-1", "bulkhead-api-2"];
        assert_eq!(names[..3], expected, "dealt in turn while all were even");
        assert_eq!(names[3..], expected, "and again");
        // Every request on a connection is served by the thread it was dealt to.
        for (c, name) in connections.iter_mut().zip(&names) {
            assert_eq!(&served_by(c).await, name);
        }
        // The thread whose connections close has the fewest open: it gets the next two (taken
        // in turn, or with counts that never went down, they would go elsewhere).
        let closed = connections.remove(4);
        drop(closed);
        let closed = connections.remove(1);
        drop(closed);
        let mut both = false;
        for _ in 0..100 {
            let (mut c, mut d) = (connect(addr).await, connect(addr).await);
            let names = [served_by(&mut c).await, served_by(&mut d).await];
            if names == ["bulkhead-api-1", "bulkhead-api-1"] {
                both = true;
                break;
            }
            // The closes had not been seen yet: try again once these two are closed too.
            drop((c, d));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            both,
            "the emptied thread did not get the next two connections"
        );
        serving.stop(Duration::from_secs(5)).await;
    }

    /// A response body that never ends, and says when it is dropped.
    struct Endless(Arc<AtomicUsize>);

    impl hyper::body::Body for Endless {
        type Data = bytes::Bytes;
        type Error = Infallible;

        fn poll_frame(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<hyper::body::Frame<bytes::Bytes>, Infallible>>> {
            let chunk = bytes::Bytes::from_static(&[b'x'; 16 << 10]);
            std::task::Poll::Ready(Some(Ok(hyper::body::Frame::data(chunk))))
        }
    }

    impl Drop for Endless {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A service answering every request with an [`Endless`] body; `dropped` counts the
    /// bodies dropped.
    fn endless(dropped: &Arc<AtomicUsize>) -> impl Service {
        let bodies = dropped.clone();
        hyper::service::service_fn(move |_: Request<Incoming>| {
            let body = Body::new(Endless(bodies.clone()));
            async move { Ok::<_, Infallible>(Response::new(body)) }
        })
    }

    /// Asks `addr` for `/` and reads the head of its 200 answer, and no more.
    async fn answer_under_way(addr: std::net::SocketAddr) -> TcpStream {
        let mut client = TcpStream::connect(addr).await.expect("connect");
        tokio::io::AsyncWriteExt::write_all(&mut client, b"GET / HTTP/1.1\r\nhost: t\r\n\r\n")
            .await
            .expect("asks");
        let mut head = [0; 1024];
        let n = tokio::io::AsyncReadExt::read(&mut client, &mut head)
            .await
            .expect("the answer starts");
        assert!(head[..n].starts_with(b"HTTP/1.1 200"));
        client
    }

    /// A client that reads the head of an endless answer and then nothing, its socket left
    /// open, over real sockets: once the kernel's buffers are full the connection is closed
    /// after the write-stall timeout and the response body dropped — what ends the request
    /// behind it as a client disconnect.
    #[tokio::test(flavor = "current_thread")]
    async fn a_client_that_stops_reading_is_disconnected_and_its_response_dropped() {
        let dropped = Arc::new(AtomicUsize::new(0));
        let limits = HttpLimits {
            write_stall_timeout: Duration::from_secs(1),
            ..HttpLimits::default()
        };
        let serving = start(endless(&dropped), limits, NonZeroUsize::MIN, Arc::new(())).await;
        let mut client = answer_under_way(serving.addr).await;
        let stopped = std::time::Instant::now();
        // Read nothing more: within the buffers' fill time plus the timeout, the body is gone.
        while dropped.load(Ordering::Relaxed) == 0 {
            assert!(
                stopped.elapsed() < Duration::from_secs(20),
                "the stalled connection was never given up"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(
            stopped.elapsed() >= Duration::from_secs(1),
            "not before the timeout: {:?}",
            stopped.elapsed()
        );
        // And the server hung up: reading drains what the buffers held, then ends.
        let mut rest = Vec::new();
        let drained = tokio::time::timeout(
            Duration::from_secs(10),
            tokio::io::AsyncReadExt::read_to_end(&mut client, &mut rest),
        )
        .await
        .expect("the connection ends, not waits");
        assert!(
            drained.is_ok()
                || drained.is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset)
        );
        serving.stop(Duration::from_secs(15)).await;
    }

    /// What a test's witness was told.
    #[derive(Default)]
    struct Told {
        cuts: AtomicUsize,
        unparsed: std::sync::Mutex<Vec<u16>>,
        plain_http: AtomicUsize,
    }

    impl Witness for Told {
        fn cut(&self) {
            self.cuts.fetch_add(1, Ordering::Relaxed);
        }
        fn unparsed(&self, status: u16) {
            self.unparsed.lock().expect("not poisoned").push(status);
        }
        fn plain_http(&self) {
            self.plain_http.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A request hyper cannot parse never reaches the service; hyper answers it, and the
    /// witness hears of it with the status hyper sent: a malformed request line 400, more
    /// headers than hyper takes 431, a URI over its limit 414.
    #[tokio::test(flavor = "current_thread")]
    async fn requests_hyper_cannot_parse_are_told_with_the_status_it_answered() {
        let told = Arc::new(Told::default());
        let limits = HttpLimits::default();
        let serving = start(thread_name(), limits, NonZeroUsize::MIN, told.clone()).await;
        let many_headers: String = (0..200).map(|i| format!("x-h{i}: v\r\n")).collect();
        let long_uri = format!("GET /{} HTTP/1.1\r\nhost: t\r\n\r\n", "a".repeat(70_000));
        let requests = [
            ("GARBAGE\r\n\r\n".to_owned(), "400"),
            (
                format!("GET / HTTP/1.1\r\nhost: t\r\n{many_headers}\r\n"),
                "431",
            ),
            (long_uri, "414"),
        ];
        for (request, status) in &requests {
            let mut client = TcpStream::connect(serving.addr).await.expect("connect");
            tokio::io::AsyncWriteExt::write_all(&mut client, request.as_bytes())
                .await
                .expect("sends");
            let mut answer = Vec::new();
            let _ = tokio::io::AsyncReadExt::read_to_end(&mut client, &mut answer).await;
            let answer = String::from_utf8_lossy(&answer);
            assert!(
                answer.starts_with(&format!("HTTP/1.1 {status}")),
                "{answer}"
            );
        }
        // Each connection's task tells the witness as it ends.
        for _ in 0..100 {
            if told.unparsed.lock().expect("not poisoned").len() == requests.len() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(
            *told.unparsed.lock().expect("not poisoned"),
            [400, 431, 414]
        );
        assert_eq!(told.cuts.load(Ordering::Relaxed), 0);
        serving.stop(Duration::from_secs(15)).await;
    }

    /// Shutdown gives requests in flight the drain timeout, then cuts those still running
    /// and says so first; with none running, it cuts nothing.
    #[tokio::test(flavor = "current_thread")]
    async fn requests_still_running_at_the_drain_timeout_are_cut_and_said_so() {
        for running in [true, false] {
            let dropped = Arc::new(AtomicUsize::new(0));
            let limits = HttpLimits {
                drain_timeout: Duration::from_secs(1),
                ..HttpLimits::default()
            };
            let told = Arc::new(Told::default());
            let serving = start(endless(&dropped), limits, NonZeroUsize::MIN, told.clone()).await;
            let _client = match running {
                true => answer_under_way(serving.addr).await,
                false => TcpStream::connect(serving.addr).await.expect("connect"),
            };
            let stopped = std::time::Instant::now();
            serving.stop(Duration::from_secs(10)).await;
            assert_eq!(told.cuts.load(Ordering::Relaxed), usize::from(running));
            // Its response (with the request behind it) was dropped before serving returned:
            // a request's record is written on drop, before shutdown's last flush.
            assert_eq!(dropped.load(Ordering::Relaxed), usize::from(running));
            if running {
                assert!(
                    stopped.elapsed() >= Duration::from_secs(1),
                    "{:?}",
                    stopped.elapsed()
                );
            }
        }
    }

    /// A witness with work left behind its connections (an abandoned request held on its
    /// worker) that ends by itself after `ends_after`, or when shutdown cuts it.
    struct Lingering {
        cuts: AtomicUsize,
        work: tokio::sync::watch::Sender<bool>,
    }

    impl Witness for Lingering {
        fn cut(&self) {
            self.cuts.fetch_add(1, Ordering::Relaxed);
            self.work.send_replace(false);
        }
        fn unparsed(&self, _: u16) {}
        fn plain_http(&self) {}
        fn settled(&self) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
            let mut work = self.work.subscribe();
            Box::pin(async move {
                let _ = work.wait_for(|running| !running).await;
            })
        }
    }

    /// Shutdown waits for what requests left behind their connections (with none open) as for
    /// the connections: until it ends, within the drain timeout; past it, it is cut first.
    #[tokio::test(flavor = "current_thread")]
    async fn shutdown_waits_for_work_left_behind_connections_then_cuts_it() {
        for ends_after in [Some(Duration::from_millis(400)), None] {
            let limits = HttpLimits {
                drain_timeout: Duration::from_secs(1),
                ..HttpLimits::default()
            };
            let witness = Arc::new(Lingering {
                cuts: AtomicUsize::new(0),
                work: tokio::sync::watch::Sender::new(true),
            });
            let serving = start(thread_name(), limits, NonZeroUsize::MIN, witness.clone()).await;
            if let Some(after) = ends_after {
                let w = witness.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(after).await;
                    w.work.send_replace(false);
                });
            }
            let stopped = std::time::Instant::now();
            serving.stop(Duration::from_secs(10)).await;
            let took = stopped.elapsed();
            let waited = ends_after.unwrap_or(limits.drain_timeout);
            assert!(
                took >= waited,
                "returned after {took:?}, before the work ended"
            );
            assert!(!*witness.work.borrow(), "the work ended first");
            assert_eq!(
                witness.cuts.load(Ordering::Relaxed),
                usize::from(ends_after.is_none())
            );
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_thread_that_has_ended_loses_its_seat_and_its_connection_is_served_here() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let _client = TcpStream::connect(listener.local_addr().expect("addr"))
            .await
            .expect("connect");
        let (stream, _) = listener.accept().await.expect("accept");
        let here = Arc::new(AtomicUsize::new(5));
        let (to, ended) = mpsc::unbounded_channel();
        drop(ended);
        let mut seats = vec![
            Seat {
                open: here.clone(),
                to: None,
            },
            Seat {
                open: Arc::default(),
                to: Some(to),
            },
        ];
        let places = Arc::new(Semaphore::new(1));
        let place = places.clone().try_acquire_owned().expect("a place");
        let (_stream, open) =
            deal(&mut seats, stream, place).expect("served by the accepting thread");
        assert_eq!(seats.len(), 1, "the ended thread's seat is gone");
        assert_eq!(here.load(Ordering::Relaxed), 6, "counted here");
        assert_eq!(places.available_permits(), 0, "its place went with it");
        drop(open);
        assert_eq!(here.load(Ordering::Relaxed), 5, "and uncounted when closed");
        assert_eq!(places.available_permits(), 1, "its place free again");
    }

    /// A certificate for 127.0.0.1 from a fresh CA, loaded as a listener's TLS; and a client
    /// trusting that CA. The files are removed once loaded.
    fn tls_pair() -> (ListenerTls, tokio_rustls::TlsConnector) {
        use bulkhead_worker::serve::tls::Authority;
        let dir = std::env::temp_dir().join(format!("bulkhead-serving-{}", rand::random::<u64>()));
        let ca = Authority::new("test CA").expect("a CA");
        let files = ca
            .write(&dir, "api", &["127.0.0.1".to_owned()])
            .expect("writes");
        let tls = ListenerTls::load(&files.into()).expect("loads");
        let _ = std::fs::remove_dir_all(&dir);
        (tls, ca.https_client().expect("a client"))
    }

    /// With TLS, every serving thread serves (each completes the handshakes of the
    /// connections dealt to it); a client speaking plain HTTP to the port is answered 400
    /// `https_required` (and the witness told), never served.
    #[tokio::test(flavor = "current_thread")]
    async fn over_tls_every_thread_serves_and_plain_http_is_told_to_use_https() {
        let (tls, connector) = tls_pair();
        let told = Arc::new(Told::default());
        let two = NonZeroUsize::new(2).expect("2");
        let limits = HttpLimits::default();
        let serving = start_with(thread_name(), limits, Some(tls), two, told.clone()).await;
        let mut names = Vec::new();
        let mut connections = Vec::new();
        for _ in 0..2 {
            let socket = TcpStream::connect(serving.addr).await.expect("connect");
            let name =
                tokio_rustls::rustls::pki_types::ServerName::try_from("127.0.0.1").expect("a name");
            let stream = connector.connect(name, socket).await.expect("handshake");
            let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
                .await
                .expect("HTTP handshake");
            tokio::spawn(conn);
            names.push(served_by(&mut send).await);
            connections.push(send);
        }
        let here = std::thread::current().name().unwrap_or("").to_owned();
        assert_eq!(names, [here.as_str(), "bulkhead-api-1"]);

        let mut plain = TcpStream::connect(serving.addr).await.expect("connect");
        tokio::io::AsyncWriteExt::write_all(&mut plain, b"GET / HTTP/1.1\r\nhost: t\r\n\r\n")
            .await
            .expect("sends");
        let mut answer = Vec::new();
        let _ = tokio::time::timeout(
            Duration::from_secs(5),
            tokio::io::AsyncReadExt::read_to_end(&mut plain, &mut answer),
        )
        .await
        .expect("the connection is closed, not kept");
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
        assert!(answer.contains(r#""code":"https_required""#), "{answer}");
        assert!(
            !answer.contains("bulkhead-api"),
            "the service never ran: {answer}"
        );
        // A byte that looks like plain HTTP and a close is no request: nothing told of it.
        let mut one = TcpStream::connect(serving.addr).await.expect("connect");
        tokio::io::AsyncWriteExt::write_all(&mut one, b"G")
            .await
            .expect("sends");
        drop(one);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(told.plain_http.load(Ordering::Relaxed), 1);
        assert!(told.unparsed.lock().expect("not poisoned").is_empty());
        drop(connections);
        serving.stop(Duration::from_secs(5)).await;
    }

    /// Shutdown does not wait for a connection still in its TLS handshake (it carries no
    /// request): the drain ends at once, nothing is cut, and the connection is closed.
    #[tokio::test(flavor = "current_thread")]
    async fn shutdown_closes_a_connection_still_in_its_handshake_at_once() {
        let (tls, _) = tls_pair();
        let told = Arc::new(Told::default());
        let limits = HttpLimits {
            drain_timeout: Duration::from_secs(5),
            header_timeout: Duration::from_secs(10),
            ..HttpLimits::default()
        };
        let one = NonZeroUsize::MIN;
        let serving = start_with(thread_name(), limits, Some(tls), one, told.clone()).await;
        let mut stalled = TcpStream::connect(serving.addr).await.expect("connect");
        // Half a hello, then nothing.
        tokio::io::AsyncWriteExt::write_all(&mut stalled, &[0x16, 0x03, 0x01])
            .await
            .expect("sends");
        tokio::time::sleep(Duration::from_millis(100)).await;
        let stopping = std::time::Instant::now();
        serving.stop(Duration::from_secs(10)).await;
        assert!(
            stopping.elapsed() < Duration::from_secs(2),
            "the drain waited for the handshake: {:?}",
            stopping.elapsed()
        );
        assert_eq!(told.cuts.load(Ordering::Relaxed), 0);
        let closed = tokio::time::timeout(
            Duration::from_secs(2),
            tokio::io::AsyncReadExt::read_to_end(&mut stalled, &mut Vec::new()),
        )
        .await;
        assert!(closed.is_ok(), "the connection was left open");
    }
}
