//! A worker's gRPC connections, bounded: at most [`Limits::max`] open at once, at most
//! [`Limits::unvouched`] of them before a call on them was let in, and each closed unless a
//! call on it presents the cluster token within [`Limits::vouch_within`].
//!
//! Each connection holds a socket, a task and HTTP/2's buffers. Unbounded, whoever reaches
//! the port could make the worker hold them without end, until no listener of the process (the
//! KV data plane's, the admin port's) could accept anything. Bounded alone, the same peer could
//! hold every place with connections that never call, and lock the gateway out. So a
//! connection keeps its place past its first seconds only once a call on it was let in
//! ([`Vouching::vouch`], from the cluster token's check), and connections not yet vouched for
//! — whoever opens them, however fast they are opened again — hold at most a quarter of the
//! places: the rest stay for the gateway and decode workers, which call as soon as they
//! connect.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Sleep;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::Connected;

use super::accepting::{self, Refused};

/// How many connections a worker's gRPC server holds open, and how long one may go without a
/// call that presents the cluster token.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max: usize,
    /// Of those, connections on which no call was let in yet.
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
    /// Closed as soon as accepted: every place was held (or every place for a connection
    /// not yet vouched for).
    over_bound: AtomicU64,
    /// Closed when their time ran out with no call let in.
    out_of_time: AtomicU64,
}

impl Counts {
    /// (open now, closed over the bound, closed out of time).
    pub fn get(&self) -> (u64, u64, u64) {
        (
            self.open.load(Ordering::Relaxed),
            self.over_bound.load(Ordering::Relaxed),
            self.out_of_time.load(Ordering::Relaxed),
        )
    }
}

/// The connections on `listener`, each made ready by `handshake` (TLS, or socket options) on
/// its own task, so a peer that stalls holds up no other; a failed handshake is logged and
/// the connection dropped. A connection over `limits.max`, or over `limits.unvouched` of those
/// not yet vouched for, is closed as soon as it is accepted (counted in one log line at most
/// every few seconds). Accepting stops when the stream is
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
    let unvouched = Arc::new(Semaphore::new(limits.unvouched));
    tokio::spawn(async move {
        let mut refused = Refused::default();
        loop {
            let (socket, peer) = tokio::select! {
                () = ready.closed() => return,
                accepted = accepting::next(&listener, "gRPC") => accepted,
            };
            let (Ok(permit), Ok(unvouched)) = (
                places.clone().try_acquire_owned(),
                unvouched.clone().try_acquire_owned(),
            ) else {
                counts.over_bound.fetch_add(1, Ordering::Relaxed);
                refused.count(peer, "gRPC", limits.max);
                continue;
            };
            let place = Place::new(permit, unvouched, counts.clone());
            let (handshaking, ready) = (handshake(socket), ready.clone());
            tokio::spawn(async move {
                match handshaking.await {
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
    /// The connection's place among those not vouched for, until it is.
    unvouched_place: std::sync::Mutex<Option<OwnedSemaphorePermit>>,
}

impl Vouching {
    /// Holds `place` among the connections not vouched for until [`Vouching::vouch`].
    fn holding(place: OwnedSemaphorePermit) -> Vouching {
        Vouching(Arc::new(Vouched {
            vouched: AtomicBool::new(false),
            unvouched_place: std::sync::Mutex::new(Some(place)),
        }))
    }

    /// A call on the connection was let in: it keeps its place for as long as it stays open,
    /// and leaves its place among those not vouched for.
    pub fn vouch(&self) {
        if !self.0.vouched.swap(true, Ordering::Relaxed) {
            let place = self.0.unvouched_place.lock().map(|mut p| p.take());
            drop(place);
        }
    }

    pub(super) fn vouched(&self) -> bool {
        self.0.vouched.load(Ordering::Relaxed)
    }
}

/// One of the server's places, counted open until it is dropped, with its place among the
/// connections not vouched for (held until a call on it is let in).
#[derive(Debug)]
struct Place {
    _permit: OwnedSemaphorePermit,
    vouching: Vouching,
    counts: Arc<Counts>,
}

impl Place {
    fn new(
        permit: OwnedSemaphorePermit,
        unvouched: OwnedSemaphorePermit,
        counts: Arc<Counts>,
    ) -> Self {
        counts.open.fetch_add(1, Ordering::Relaxed);
        Self {
            _permit: permit,
            vouching: Vouching::holding(unvouched),
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

    /// An error once the connection's time ran out with no call let in.
    fn out_of_time(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        if let Standing::Waiting(until) = &mut self.standing {
            if self.place.vouching.vouched() {
                self.standing = Standing::Vouched;
            } else if until.as_mut().poll(cx).is_ready() {
                let counts = &self.place.counts;
                counts.out_of_time.fetch_add(1, Ordering::Relaxed);
                self.standing = Standing::OutOfTime;
            }
        }
        match self.standing {
            Standing::OutOfTime => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "no call on the connection presented the cluster token in time",
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
        assert_eq!(counts.get(), (2, 1, 0));
        let (client, admitted) = &mut held[0];
        client.write_all(b"x").await.expect("writes");
        let mut byte = [0u8; 1];
        admitted.read_exact(&mut byte).await.expect("served");
        assert_eq!(&byte, b"x");

        drop(held.remove(0));
        let _next = TcpStream::connect(&address).await.expect("connects");
        let taken = tokio::time::timeout(Duration::from_secs(5), incoming.next()).await;
        assert!(matches!(taken, Ok(Some(Ok(_)))), "the freed place is taken");
        assert_eq!(counts.get(), (2, 1, 0));
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
        let mut clients = Vec::new();
        let mut admitted = Vec::new();
        for _ in 0..2 {
            clients.push(TcpStream::connect(&address).await.expect("connects"));
            admitted.push(incoming.next().await.expect("a connection").expect("ready"));
        }
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
        assert_eq!(counts.get(), (2, 0, 1), "counted once");

        let reading = tokio::spawn(async move {
            let mut byte = [0u8; 1];
            admitted[1].read_exact(&mut byte).await.map(|_| byte)
        });
        tokio::time::sleep(Duration::from_millis(400)).await;
        clients[1].write_all(b"y").await.expect("writes");
        let read = reading.await.expect("joins").expect("still served");
        assert_eq!(&read, b"y");
    }

    /// Connections not vouched for hold at most their share of the places: past it a new one
    /// is closed though places are free, and a vouch frees its share at once. Without it,
    /// silent connections opened again and again held every place.
    #[tokio::test]
    async fn connections_not_vouched_for_hold_only_their_share_of_the_places() {
        let limits = Limits {
            max: 4,
            unvouched: 1,
            vouch_within: Duration::from_secs(60),
        };
        let (address, mut incoming, counts) = listening(limits).await;
        let _first = TcpStream::connect(&address).await.expect("connects");
        let first = incoming.next().await.expect("a connection").expect("ready");
        let mut second = TcpStream::connect(&address).await.expect("connects");
        assert!(closed_within(&mut second, Duration::from_secs(5)).await);
        assert_eq!(counts.get(), (1, 1, 0));
        first.connect_info().vouch();
        let _third = TcpStream::connect(&address).await.expect("connects");
        let taken = tokio::time::timeout(Duration::from_secs(5), incoming.next()).await;
        assert!(
            matches!(taken, Ok(Some(Ok(_)))),
            "the share freed by the vouch"
        );
        assert_eq!(counts.get(), (2, 1, 0));
    }
}
