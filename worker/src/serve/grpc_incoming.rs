//! A worker's gRPC connections, bounded: at most [`Limits::max`] open at once, at most
//! [`Limits::unvouched`] of them before a call on them was let in, and each closed unless a
//! call on it presents the cluster token within [`Limits::vouch_within`].
//!
//! Each connection holds a socket, a task and HTTP/2's buffers. Unbounded, whoever reaches
//! the port could make the worker hold them without end, until no listener of the process (the
//! KV data plane's, the admin port's) could accept anything. Bounded alone, the same peer could
//! hold every place with connections that never call, and lock the gateway out. So a
//! connection keeps its place past its first seconds only once a call on it was let in
//! ([`Vouching::vouch`], from the cluster token's check). Connections not yet vouched for are
//! at most a quarter of the places: one past that evicts the oldest still waiting, never the
//! newcomer. A flood of silent connections then only shortens how long a new one may wait
//! for its first call — at a hundred connections a second, more than a second —, while the
//! gateway and decode workers call as soon as they connect.

use std::collections::VecDeque;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Sleep;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::Connected;

use super::accepting::{self, Refused};

/// How many connections a worker's gRPC server holds open, and how long one may go without a
/// call that presents the cluster token.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max: usize,
    /// Of those, connections on which no call was let in yet; one more evicts the oldest.
    pub unvouched: usize,
    pub vouch_within: Duration,
}

impl Limits {
    /// A worker's: room for every gateway and decode worker of a large deployment, a few
    /// connections each; ten seconds to make the first call.
    pub const WORKER: Limits = Limits {
        max: 512,
        unvouched: 128,
        vouch_within: Duration::from_secs(10),
    };
}

/// Handshaken connections waiting for the gRPC server to take them.
const WAITING: usize = 64;

/// What the bounds did, for `/metrics`.
#[derive(Debug, Default)]
pub struct Counts {
    /// Connections holding a place now.
    open: AtomicU64,
    /// Closed as soon as accepted: every place was held.
    over_bound: AtomicU64,
    /// Closed when their time ran out with no call let in.
    out_of_time: AtomicU64,
    /// Closed with no call let in yet, to make room for a newer such connection.
    evicted: AtomicU64,
}

impl Counts {
    /// (open now, closed over the bound, closed out of time, evicted).
    pub fn get(&self) -> (u64, u64, u64, u64) {
        (
            self.open.load(Ordering::Relaxed),
            self.over_bound.load(Ordering::Relaxed),
            self.out_of_time.load(Ordering::Relaxed),
            self.evicted.load(Ordering::Relaxed),
        )
    }
}

/// The connections on `listener`, each made ready by `handshake` (TLS, or socket options) on
/// its own task, so a peer that stalls holds up no other; a failed handshake is logged and
/// the connection dropped. A connection over `limits.max` is closed as soon as it is accepted
/// (counted in one log line at most every few seconds); one that makes more than
/// `limits.unvouched` not yet vouched for evicts the oldest of them. Accepting stops when the stream is
/// dropped. What it does is counted in `counts`.
pub fn incoming<S, F, H>(
    listener: TcpListener,
    limits: Limits,
    counts: Arc<Counts>,
    handshake: H,
) -> ReceiverStream<io::Result<Admitted<S>>>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    F: Future<Output = io::Result<S>> + Send + 'static,
    H: Fn(TcpStream) -> F + Send + 'static,
{
    let (ready, incoming) = tokio::sync::mpsc::channel(WAITING);
    let places = Arc::new(Semaphore::new(limits.max));
    tokio::spawn(async move {
        let mut refused = Refused::default();
        let mut unvouched = Unvouched::new(limits.unvouched);
        loop {
            let (socket, peer) = tokio::select! {
                () = ready.closed() => return,
                accepted = accepting::next(&listener, "gRPC") => accepted,
            };
            let Ok(permit) = places.clone().try_acquire_owned() else {
                counts.over_bound.fetch_add(1, Ordering::Relaxed);
                refused.count(peer, "gRPC", limits.max);
                continue;
            };
            let place = Place::new(permit, counts.clone());
            unvouched.take_in(&place.vouching);
            let (handshaking, ready) = (handshake(socket), ready.clone());
            tokio::spawn(async move {
                // Evicted mid-handshake (a peer that never finishes its TLS hello), the
                // connection goes at once: it held a place until its handshake's limit.
                let handshaken = tokio::select! {
                    handshaken = handshaking => handshaken,
                    () = place.vouching.0.evicted_now.notified() => {
                        place.counts.evicted.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                };
                match handshaken {
                    Ok(stream) => {
                        let admitted = Admitted::new(stream, place, limits.vouch_within);
                        let _ = ready.send(Ok(admitted)).await;
                    }
                    Err(e) => {
                        tracing::warn!(%peer, error = %e, "refused a gRPC connection: its handshake failed");
                    }
                }
            });
        }
    });
    ReceiverStream::new(incoming)
}

/// Whether a call on a connection was let in. The server puts it in every call's extensions
/// (it is the connection's [`Connected::ConnectInfo`]).
#[derive(Debug, Clone, Default)]
pub struct Vouching(Arc<Vouched>);

#[derive(Debug, Default)]
pub struct Vouched {
    vouched: AtomicBool,
    /// Closed to make room for a newer connection not vouched for.
    evicted: AtomicBool,
    /// The connection's task, woken when it is evicted.
    waker: Mutex<Option<Waker>>,
    /// Told when it is evicted, for its handshake's task.
    evicted_now: Notify,
}

impl Vouching {
    /// A call on the connection was let in: it keeps its place for as long as it stays open.
    pub fn vouch(&self) {
        self.0.vouched.store(true, Ordering::SeqCst);
    }

    pub(super) fn vouched(&self) -> bool {
        self.0.vouched.load(Ordering::SeqCst)
    }

    /// Closes the connection (unless a call on it was let in first): its next read, write or
    /// flush fails, and its task is woken for one.
    fn evict(&self) {
        self.0.evicted.store(true, Ordering::SeqCst);
        self.0.evicted_now.notify_one();
        let waker = self.0.waker.lock().ok().and_then(|mut w| w.take());
        if let Some(waker) = waker {
            waker.wake();
        }
    }

    /// Whether the connection was evicted; if not, `cx` is woken when it is.
    fn evicted(&self, cx: &Context<'_>) -> bool {
        if let Ok(mut waker) = self.0.waker.lock() {
            match &mut *waker {
                Some(w) if w.will_wake(cx.waker()) => {}
                w => *w = Some(cx.waker().clone()),
            }
        }
        self.0.evicted.load(Ordering::SeqCst)
    }
}

/// The connections not vouched for yet, oldest first: at most `max`.
struct Unvouched {
    queue: VecDeque<Weak<Vouched>>,
    max: usize,
}

impl Unvouched {
    fn new(max: usize) -> Unvouched {
        Unvouched {
            queue: VecDeque::with_capacity(max),
            max,
        }
    }

    /// Counts `new` among them; when that makes one too many, the oldest still waiting for
    /// its first call is evicted (those vouched for since, or closed, leave first).
    fn take_in(&mut self, new: &Vouching) {
        let waiting = |w: &Weak<Vouched>| w.upgrade().is_some_and(|v| !Vouching(v).vouched());
        self.queue.retain(waiting);
        if self.queue.len() >= self.max
            && let Some(oldest) = self.queue.pop_front().and_then(|w| w.upgrade())
        {
            Vouching(oldest).evict();
        }
        self.queue.push_back(Arc::downgrade(&new.0));
    }
}

/// One of the server's places, counted open until it is dropped.
#[derive(Debug)]
struct Place {
    _permit: OwnedSemaphorePermit,
    vouching: Vouching,
    counts: Arc<Counts>,
}

impl Place {
    fn new(permit: OwnedSemaphorePermit, counts: Arc<Counts>) -> Self {
        counts.open.fetch_add(1, Ordering::Relaxed);
        Self {
            _permit: permit,
            vouching: Vouching::default(),
            counts,
        }
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        self.counts.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Where a connection stands with its time to make a call.
#[derive(Debug)]
enum Standing {
    /// No call let in yet: the connection's time runs out then.
    Waiting(Pin<Box<Sleep>>),
    Vouched,
    OutOfTime,
    Evicted,
}

/// A connection that holds one of the server's places until it is dropped, and fails its
/// reads, writes and flushes once its time to make a call has run out without one (the
/// server then closes it; a peer that stops reading stalls the server's writes, so they are
/// held to the time too).
#[derive(Debug)]
pub struct Admitted<S> {
    stream: S,
    standing: Standing,
    place: Place,
}

impl<S> Admitted<S> {
    fn new(stream: S, place: Place, vouch_within: Duration) -> Self {
        Self {
            stream,
            standing: Standing::Waiting(Box::pin(tokio::time::sleep(vouch_within))),
            place,
        }
    }

    /// `io` on the stream, unless the connection's time ran out with no call let in.
    fn in_time<T>(
        &mut self,
        cx: &mut Context<'_>,
        io: impl FnOnce(Pin<&mut S>, &mut Context<'_>) -> Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>>
    where
        S: Unpin,
    {
        match self.out_of_time(cx) {
            Ok(()) => io(Pin::new(&mut self.stream), cx),
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    /// An error once the connection's time ran out, or it was evicted, with no call let in.
    fn out_of_time(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        if let Standing::Waiting(until) = &mut self.standing {
            let (vouching, counts) = (&self.place.vouching, &self.place.counts);
            if vouching.vouched() {
                self.standing = Standing::Vouched;
            } else if vouching.evicted(cx) {
                counts.evicted.fetch_add(1, Ordering::Relaxed);
                self.standing = Standing::Evicted;
            } else if until.as_mut().poll(cx).is_ready() {
                counts.out_of_time.fetch_add(1, Ordering::Relaxed);
                self.standing = Standing::OutOfTime;
            }
        }
        match self.standing {
            Standing::OutOfTime => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "no call on the connection presented the cluster token in time",
            )),
            Standing::Evicted => Err(io::Error::other(
                "closed for a newer connection: none of its calls presented the cluster token yet",
            )),
            Standing::Waiting(_) | Standing::Vouched => Ok(()),
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Admitted<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.get_mut().in_time(cx, |s, cx| s.poll_read(cx, buf))
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Admitted<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().in_time(cx, |s, cx| s.poll_write(cx, buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.get_mut()
            .in_time(cx, |s, cx| s.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().in_time(cx, |s, cx| s.poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

impl<S> Connected for Admitted<S> {
    type ConnectInfo = Vouching;

    fn connect_info(&self) -> Vouching {
        self.place.vouching.clone()
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_stream::StreamExt as _;

    use super::*;

    type Listening = (
        String,
        ReceiverStream<io::Result<Admitted<TcpStream>>>,
        Arc<Counts>,
    );

    async fn listening(limits: Limits) -> Listening {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address").to_string();
        let counts = Arc::new(Counts::default());
        let incoming = incoming(listener, limits, counts.clone(), |s| async { Ok(s) });
        (address, incoming, counts)
    }

    /// `n` clients connected to `address`, and their connections as `incoming` gives them.
    async fn connected(
        address: &str,
        incoming: &mut ReceiverStream<io::Result<Admitted<TcpStream>>>,
        n: usize,
    ) -> (Vec<TcpStream>, Vec<Admitted<TcpStream>>) {
        let mut clients = Vec::new();
        let mut admitted = Vec::new();
        for _ in 0..n {
            clients.push(TcpStream::connect(address).await.expect("connects"));
            admitted.push(incoming.next().await.expect("a connection").expect("ready"));
        }
        (clients, admitted)
    }

    /// Whether the server closed `client`'s connection within `limit`.
    async fn closed_within(client: &mut TcpStream, limit: Duration) -> bool {
        let mut byte = [0u8; 1];
        matches!(
            tokio::time::timeout(limit, client.read(&mut byte)).await,
            Ok(Ok(0) | Err(_))
        )
    }

    /// Past the bound a connection is closed at once, and the connections held are served;
    /// a place freed is taken by the next one.
    #[tokio::test]
    async fn a_connection_over_the_bound_is_closed_and_a_freed_place_taken_again() {
        let limits = Limits {
            max: 2,
            unvouched: 2,
            vouch_within: Duration::from_secs(60),
        };
        let (address, mut incoming, counts) = listening(limits).await;
        let mut held = Vec::new();
        for _ in 0..2 {
            let client = TcpStream::connect(&address).await.expect("connects");
            let admitted = incoming.next().await.expect("a connection").expect("ready");
            held.push((client, admitted));
        }
        let mut over = TcpStream::connect(&address).await.expect("connects");
        assert!(closed_within(&mut over, Duration::from_secs(5)).await);
        assert_eq!(counts.get(), (2, 1, 0, 0));
        let (client, admitted) = &mut held[0];
        client.write_all(b"x").await.expect("writes");
        let mut byte = [0u8; 1];
        admitted.read_exact(&mut byte).await.expect("served");
        assert_eq!(&byte, b"x");

        drop(held.remove(0));
        let _next = TcpStream::connect(&address).await.expect("connects");
        let taken = tokio::time::timeout(Duration::from_secs(5), incoming.next()).await;
        assert!(matches!(taken, Ok(Some(Ok(_)))), "the freed place is taken");
        assert_eq!(counts.get(), (2, 1, 0, 0));
    }

    /// A connection on which no call was let in fails its read once its time runs out; one
    /// vouched for keeps reading past it.
    #[tokio::test]
    async fn a_connection_no_call_vouched_for_is_dropped_when_its_time_runs_out() {
        let limits = Limits {
            max: 4,
            unvouched: 4,
            vouch_within: Duration::from_millis(200),
        };
        let (address, mut incoming, counts) = listening(limits).await;
        let (mut clients, mut admitted) = connected(&address, &mut incoming, 2).await;
        admitted[1].connect_info().vouch();
        let mut byte = [0u8; 1];
        let unvouched = tokio::time::timeout(Duration::from_secs(5), admitted[0].read(&mut byte));
        let error = unvouched
            .await
            .expect("fails in time")
            .expect_err("out of time");
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        let again = admitted[0].read(&mut byte).await;
        assert!(again.is_err(), "it stays out of time");
        // Nor can it be written to: a peer that stops reading would stall the server's
        // writes, and keep its place, if only reads were held to the time.
        let written = admitted[0].write_all(b"z").await;
        assert!(written.is_err(), "writes are held to the time too");
        assert_eq!(counts.get(), (2, 0, 1, 0), "counted once");

        let reading = tokio::spawn(async move {
            let mut byte = [0u8; 1];
            admitted[1].read_exact(&mut byte).await.map(|_| byte)
        });
        tokio::time::sleep(Duration::from_millis(400)).await;
        clients[1].write_all(b"y").await.expect("writes");
        let read = reading.await.expect("joins").expect("still served");
        assert_eq!(&read, b"y");
    }

    /// A connection that makes one too many not vouched for evicts the oldest of them (its
    /// reads fail at once, without waiting for its time), never the newcomer, nor one vouched
    /// for. Refusing the newcomer instead, silent connections opened again and again kept every
    /// new one out: the gateway's and decode's as well.
    #[tokio::test]
    async fn a_connection_past_the_share_not_vouched_for_evicts_the_oldest() {
        let limits = Limits {
            max: 8,
            unvouched: 2,
            vouch_within: Duration::from_secs(60),
        };
        let (address, mut incoming, counts) = listening(limits).await;
        let (mut clients, mut admitted) = connected(&address, &mut incoming, 3).await;
        // The first is vouched for: it is out of the count, and the third fits.
        admitted[0].connect_info().vouch();
        assert_eq!(counts.get(), (3, 0, 0, 0));
        // The fourth makes three waiting: the oldest of them (the second) goes.
        let mut oldest = admitted.remove(1);
        let reading = tokio::spawn(async move {
            let mut byte = [0u8; 1];
            oldest.read(&mut byte).await
        });
        clients.push(TcpStream::connect(&address).await.expect("connects"));
        admitted.push(incoming.next().await.expect("a connection").expect("ready"));
        let read = tokio::time::timeout(Duration::from_secs(5), reading).await;
        let error = read.expect("woken").expect("joins").expect_err("evicted");
        assert!(error.to_string().contains("newer connection"), "{error}");
        assert_eq!(counts.get().3, 1);
        // The vouched-for one and the newer ones are served.
        for (c, a) in [(0, 0), (2, 1), (3, 2)] {
            clients[c].write_all(b"x").await.expect("writes");
            let mut byte = [0u8; 1];
            admitted[a].read_exact(&mut byte).await.expect("served");
        }
    }

    /// A connection evicted while its handshake is still running goes at once: a peer that
    /// never finishes its TLS hello held its place until the handshake's limit, eviction or
    /// not, and a flood of them took every place.
    #[tokio::test]
    async fn a_connection_evicted_mid_handshake_goes_at_once() {
        let limits = Limits {
            max: 8,
            unvouched: 1,
            vouch_within: Duration::from_secs(60),
        };
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address");
        let counts = Arc::new(Counts::default());
        // The handshake: the client's first byte.
        let mut incoming = incoming(
            listener,
            limits,
            counts.clone(),
            |s: TcpStream| async move {
                s.peek(&mut [0u8; 1]).await?;
                Ok(s)
            },
        );
        let mut stalled = TcpStream::connect(address).await.expect("connects");
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut next = TcpStream::connect(address).await.expect("connects");
        next.write_all(b"x").await.expect("its hello");
        let taken = tokio::time::timeout(Duration::from_secs(5), incoming.next()).await;
        assert!(matches!(taken, Ok(Some(Ok(_)))), "the newcomer is taken");
        assert!(closed_within(&mut stalled, Duration::from_secs(5)).await);
        assert_eq!(counts.get(), (1, 0, 0, 1));
    }
}
