//! The KV data plane over TCP: prefill workers connect to a decode worker's KV listener and
//! write each transfer's frames, manifest and `Closed` in order (see `bulkhead_handoff`).
//!
//! Receiving (decode): each message's head is decoded from a small buffer; a frame's bytes are
//! then read from the socket straight into their own buffer (one copy out of the kernel) and
//! checked — the checksum over header and bytes — on this task, while they are hot in cache
//! and off the engine thread. The engine gets [`Received`] messages whose frames carry that
//! verdict; it still decides per frame whether the bytes may be written, and where (session,
//! index, tag, live page, token range, length, exactly once), and writes them with one copy.
//!
//! ```text
//!  socket ─▶ head (56 B) ─▶ bytes into their buffer ─▶ Frame::check ─▶ engine: Inbound::accept
//!                                                     (this task)         + one copy into the page
//! ```
//!
//! What waits for the engine is bounded ([`RECEIVE_BUDGET_BYTES`] over all connections): each
//! message holds a [`Lease`] on the budget until the engine is done with it, and a connection
//! whose message does not fit waits before reading the next, so a peer that sends faster than
//! the engine writes — or floods frames of no session — is slowed by TCP instead of queued in
//! memory. One connection carries at most [`MAX_OPEN_SESSIONS`] open sessions, and the listener
//! holds at most two connections per page of the pool, within 64 to 4096
//! ([`max_connections`]): each may read one frame ahead of its lease, so that bounds what
//! waits outside the budget too.
//!
//! When a connection ends — cleanly or not — every session it carried that was not closed is
//! reported as torn down: nothing more of it can arrive, which is the drain acknowledgement
//! for aborted transfers. A peer that sends bytes the codec refuses loses its connection,
//! never the worker.
//!
//! Sending (prefill): frames go out with vectored writes, each frame's 56-byte head and its
//! bytes where they lie, in batches of about `batch_bytes`; `aborted` is checked between
//! batches.
//!
//! With the deployment's mutual TLS ([`ClusterTls`]) every data connection is TLS 1.3: decode
//! takes frames only from a peer whose certificate the CA signed (the handshake bounded by the
//! peer timeout), and prefill writes only to a decode worker whose certificate names the
//! address it dialled (or the name servers are verified as, `--tls-server-name`).
//!
//! Both ends bound how long a peer that vanished — a dead host, a partition without a reset —
//! keeps a connection ([`bound_peer`]): without it, decode never learnt that such a peer was
//! gone (its quarantined pages never came back) and prefill's write waited on it for the
//! kernel's retransmissions, about a quarter of an hour, holding its source pages.

use std::collections::HashSet;
use std::convert::Infallible;
use std::io::IoSlice;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bulkhead_handoff::codec::{
    FRAME_HEAD, HEADER, Head, decode_head, encode, frame_head, head_len,
};
use bulkhead_handoff::{CloseReason, Frame, Manifest, Message, Received, SessionNonce};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::accepting::{self, Refused};
use super::actor::EngineHandle;
use super::tls::ClusterTls;

/// The largest frame any receive path takes (a page of a large model is a few MiB); a decode
/// worker's own limit is its page size ([`Buffers::up_to`]).
pub const MAX_FRAME_BYTES: u32 = 256 << 20;

/// The receive buffer for message heads and small messages; frame bytes bypass it.
const HEAD_BUFFER: usize = 8 << 10;

/// The most bytes of received messages waiting for the engine at once, over all of a decode
/// worker's data connections (never less than one largest frame and its cost): about a
/// hundred pages of the default model, so the engine is never starved between two reads.
pub const RECEIVE_BUDGET_BYTES: usize = 64 << 20;

/// What a message counts against the budget beyond its frame bytes: its place in the
/// engine's queue, so that a flood of small messages is bounded too.
const MESSAGE_COST: usize = 256;

/// The most sessions one data connection may carry open at once (prefill opens one per
/// connection); a peer that opens more loses its connection.
pub const MAX_OPEN_SESSIONS: usize = 64;

/// Frame buffers the receive path reuses: whoever writes a frame's bytes into their page
/// gives the buffer back, so a steady stream of transfers allocates (and faults in) no new
/// memory for them. A frame longer than `max_frame` is refused before anything is allocated
/// for it, so no peer can make the receive path reserve (and keep, as spares) more than that
/// per buffer.
#[derive(Debug, Clone)]
pub struct Buffers {
    spares: Arc<Mutex<Vec<Vec<u8>>>>,
    max_frame: u32,
    /// Bytes of received messages the engine has not finished with ([`Lease`]).
    budget: Arc<Semaphore>,
}

/// A received message's claim on the receive budget: given back when dropped, i.e. once the
/// engine wrote the frame's bytes (or refused them).
#[derive(Debug)]
pub struct Lease {
    _permit: OwnedSemaphorePermit,
}

/// Spare buffers kept (each about a page).
const SPARE_BUFFERS: usize = 64;

/// The room a new frame buffer starts with; it grows as the frame's bytes arrive.
const FIRST_ROOM: usize = 64 << 10;

impl Default for Buffers {
    /// Buffers for frames of up to [`MAX_FRAME_BYTES`].
    fn default() -> Buffers {
        Buffers::up_to(MAX_FRAME_BYTES)
    }
}

impl Buffers {
    /// Buffers for frames of at most `max_frame` bytes (a decode worker's page).
    pub fn up_to(max_frame: u32) -> Buffers {
        Buffers::with_budget(max_frame, RECEIVE_BUDGET_BYTES)
    }

    /// Buffers for frames of at most `max_frame` bytes, with at most `budget` bytes waiting
    /// for the engine at once (raised to one largest message when lower).
    fn with_budget(max_frame: u32, budget: usize) -> Buffers {
        let max_frame = max_frame.min(MAX_FRAME_BYTES);
        Buffers {
            spares: Arc::default(),
            max_frame,
            budget: Arc::new(Semaphore::new(budget.max(cost(max_frame)))),
        }
    }

    /// Waits until `bytes` fit in the budget and claims them.
    async fn lease(&self, bytes: usize) -> std::io::Result<Lease> {
        let n = u32::try_from(bytes).map_err(std::io::Error::other)?;
        let permit = self.budget.clone().acquire_many_owned(n).await;
        // The semaphore is never closed.
        let permit = permit.map_err(std::io::Error::other)?;
        Ok(Lease { _permit: permit })
    }

    /// An empty buffer for a frame of `len` bytes: a spare one (room for a page already), or
    /// a new one with room for the first [`FIRST_ROOM`] bytes that grows as they come — a
    /// peer that announces a page and withholds its bytes holds no page of memory for it.
    fn take(&self, len: usize) -> Vec<u8> {
        let spare = self.spares.lock().ok().and_then(|mut v| v.pop());
        let mut b = spare.unwrap_or_default();
        b.clear();
        b.reserve_exact(len.min(FIRST_ROOM));
        b
    }

    /// Gives a frame's buffer back for the next frame. One that never held bytes (a frame
    /// read past, of a session not received) is not kept: a flood of them would fill the
    /// spares and leave real frames to grow theirs from nothing.
    pub fn give(&self, buffer: Vec<u8>) {
        if buffer.capacity() > 0
            && let Ok(mut v) = self.spares.lock()
            && v.len() < SPARE_BUFFERS
        {
            v.push(buffer);
        }
    }
}

/// What a message of `frame_bytes` counts against the receive budget.
fn cost(frame_bytes: u32) -> usize {
    frame_bytes as usize + MESSAGE_COST
}

/// Where decode's receive path hands what arrives: the engine thread, or a bench's stand-in.
pub trait Deliver {
    /// One message, in the order it arrived; a frame's buffer goes back to `buffers` once
    /// its bytes are written, and `lease` is dropped once the message is dealt with.
    fn deliver(&self, message: Received, buffers: &Buffers, lease: Lease);
    /// The connection that carried `nonces` ended: nothing more of them can arrive.
    fn transport_closed(&self, nonces: Vec<SessionNonce>);
    /// Whether frames of `nonce` are still taken: a frame of any other session is delivered
    /// without its bytes, which are read past and never buffered.
    fn receiving(&self, nonce: SessionNonce) -> bool;
}

impl Deliver for EngineHandle {
    fn deliver(&self, message: Received, buffers: &Buffers, lease: Lease) {
        EngineHandle::deliver(self, message, buffers.clone(), lease);
    }

    fn transport_closed(&self, nonces: Vec<SessionNonce>) {
        EngineHandle::transport_closed(self, nonces);
    }

    fn receiving(&self, nonce: SessionNonce) -> bool {
        EngineHandle::receiving(self, nonce)
    }
}

/// How long a vanished data-plane peer can hold a connection by default
/// (`bulkhead worker --kv-peer-timeout-ms`).
pub const DEFAULT_PEER_TIMEOUT: Duration = Duration::from_secs(30);

/// Makes a peer that vanished end `socket` within about `limit`: bytes it leaves unacknowledged
/// that long fail the connection (`TCP_USER_TIMEOUT`), and an idle connection is probed
/// (keepalive) from a third of that on. A live peer that is merely slow or stuck acknowledges
/// what it reads and answers the probes from its kernel, so it keeps its connection (and its
/// quarantined pages stay out of circulation while it could still write).
pub fn bound_peer(socket: &TcpStream, limit: Duration) -> std::io::Result<()> {
    let socket = socket2::SockRef::from(socket);
    let at_least_a_second = |d: Duration| d.max(Duration::from_secs(1));
    socket.set_tcp_keepalive(
        &socket2::TcpKeepalive::new()
            .with_time(at_least_a_second(limit / 3))
            .with_interval(at_least_a_second(limit / 6))
            .with_retries(4),
    )?;
    socket.set_tcp_user_timeout(Some(limit))
}

/// How long a data connection may keep decode waiting ([`receive`]).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// A peer that vanished, or a connection whose next message does not come, is let go after
    /// about this long.
    pub peer_timeout: Duration,
    /// A message begun must be whole within this: the peer timeout, and the longest frame's
    /// time at the transfer floor.
    pub message: Duration,
}

impl Limits {
    /// The limits for frames of at most `max_frame` bytes at a floor of `floor` bytes/s.
    pub fn new(peer_timeout: Duration, max_frame: u32, floor: u64) -> Limits {
        let sending = Duration::from_secs_f64(f64::from(max_frame) / floor.max(1) as f64);
        Limits {
            peer_timeout,
            message: peer_timeout.saturating_add(sending),
        }
    }
}

/// The fewest and the most data connections a decode worker holds open at once, whatever its
/// pool ([`max_connections`]).
const CONNECTIONS: std::ops::RangeInclusive<usize> = 64..=4096;

/// The most data connections a decode worker whose pool has `pool_pages` pages holds open at
/// once: two per page (every transfer's session holds a page at least, and has at most its own
/// connection and its drain acknowledgement's open), within [`CONNECTIONS`] — past 4096
/// transfers waiting at once on one worker, shedding them is kinder than holding them.
pub fn max_connections(pool_pages: u32) -> usize {
    (pool_pages as usize)
        .saturating_mul(2)
        .clamp(*CONNECTIONS.start(), *CONNECTIONS.end())
}

/// Decode role: accepts data-plane connections for as long as the worker serves, at most
/// `max_connections` at once; each connection's messages go to `to` (the engine), frames of at
/// most `max_frame` bytes (a page); a peer that vanishes loses its connection after about the
/// peer timeout, and so does one whose next message does not come for that long or leaves a
/// message unfinished past `limits.message` ([`receive`]). A failed accept is logged and
/// accepting goes on ([`accepting::next`]).
///
/// A connection over the bound is closed as soon as it is accepted: each one holds a socket, a
/// task, its head buffer and up to a frame read ahead of its lease on the receive budget, so
/// whoever reaches the port could otherwise make the worker hold memory and descriptors without
/// end (until its gRPC listener, in the same process, could accept nothing either). Prefill
/// opens one connection per transfer and one per drain acknowledgement ([`max_connections`]).
/// A connection holds its place through its TLS handshake (bounded by the peer timeout).
pub async fn serve(
    listener: TcpListener,
    to: impl Deliver + Clone + Send + Sync + 'static,
    max_frame: u32,
    limits: Limits,
    max_connections: usize,
    tls: Option<ClusterTls>,
) -> Infallible {
    let peer_timeout = limits.peer_timeout;
    let buffers = Buffers::up_to(max_frame);
    let connections = Arc::new(Semaphore::new(max_connections));
    let mut refused = Refused::default();
    loop {
        let (socket, peer) = accepting::next(&listener, "KV data").await;
        let Ok(held) = connections.clone().try_acquire_owned() else {
            refused.count(peer, "KV data", max_connections);
            continue;
        };
        if let Err(e) = bound_peer(&socket, peer_timeout) {
            tracing::warn!(%peer, error = %e, "cannot bound a KV data connection's dead peer");
        }
        let (to, buffers, tls) = (to.clone(), buffers.clone(), tls.clone());
        tokio::spawn(async move {
            let _held = held;
            let socket = match accepted(socket, tls.as_ref(), peer_timeout).await {
                Ok(socket) => socket,
                Err(e) => {
                    tracing::warn!(%peer, error = %e, "refused a KV data connection: its TLS handshake failed");
                    return;
                }
            };
            if let Err(e) = receive(socket, &to, &buffers, Some(limits)).await {
                tracing::warn!(%peer, error = %e, "KV data connection ended with an error");
            }
        });
    }
}

/// A data connection, decode's side: TCP, or TLS over it.
pub type Incoming = Box<dyn AsyncRead + Unpin + Send>;

/// An accepted data connection, over `tls` when there is one: its handshake within `limit`.
pub async fn accepted(
    socket: TcpStream,
    tls: Option<&ClusterTls>,
    limit: Duration,
) -> std::io::Result<Incoming> {
    Ok(match tls {
        None => Box::new(socket),
        Some(tls) => Box::new(tls.accept(socket, limit).await?),
    })
}

/// Reads one connection's messages into `to`; on its end, reports the sessions it left open.
/// With `limits`, a connection ends once `limits.peer_timeout` passed since it was accepted or
/// since its last message of a session decode is receiving, whatever it has open: prefill
/// connects once its prompt is computed and sends a transfer's messages back to back (a wait
/// for the receive budget is decode's, not counted), so only a host that idles waits that
/// long — and without the limit it held a connection, its socket and its task, for ever: with
/// nothing open, or with a session it opened by one frame of a nonce decode never reserved
/// (the engine keeps deadlines for its own sessions only). Messages of sessions decode is not
/// receiving (a `Closed` or a frame of a random nonce, sent now and then) do not keep a
/// connection: they filled every connection's place for as long as a host cared to send
/// them. The sessions left open are reported torn down, as at any end. And a message begun
/// must end within `limits.message`: a peer could otherwise open one and withhold a frame's
/// last byte for ever. `limits` `None`: no limit.
pub async fn receive(
    socket: impl AsyncRead + Unpin,
    to: &impl Deliver,
    buffers: &Buffers,
    limits: Option<Limits>,
) -> std::io::Result<()> {
    let mut reader = BufReader::with_capacity(HEAD_BUFFER, socket);
    let mut open = HashSet::new();
    let mut last_live = Instant::now();
    let result = loop {
        let idle = limits.map(|l| {
            l.peer_timeout
                .saturating_sub(last_live.elapsed())
                .max(Duration::from_millis(1))
        });
        match read_message(&mut reader, to, buffers, idle, limits.map(|l| l.message)).await {
            Ok(None) => break Ok(()),
            Ok(Some((message, lease))) => {
                if to.receiving(message.nonce()) {
                    last_live = Instant::now();
                }
                match &message {
                    Received::Closed { nonce, .. } => {
                        open.remove(nonce);
                    }
                    other => {
                        let nonce = other.nonce();
                        if open.len() == MAX_OPEN_SESSIONS && !open.contains(&nonce) {
                            break Err(std::io::Error::new(
                                std::io::ErrorKind::InvalidData,
                                format!(
                                    "more than {MAX_OPEN_SESSIONS} sessions open on one data connection"
                                ),
                            ));
                        }
                        open.insert(nonce);
                    }
                }
                to.deliver(message, buffers, lease);
            }
            Err(e) => break Err(e),
        }
    };
    // A connection that opened no session (a drain's acknowledgement, a port scan) has
    // nothing to tell the engine.
    if !open.is_empty() {
        to.transport_closed(open.into_iter().collect());
    }
    result
}

/// Reads the next message, with its lease on the receive budget (waiting for room once it is
/// read): `None` at a clean end of the stream (between messages). With `idle`, the message
/// must begin within it, and with `begun`, be whole within that once its first byte came (a
/// wait for the budget's room is not counted).
async fn read_message(
    reader: &mut (impl AsyncRead + Unpin),
    to: &impl Deliver,
    buffers: &Buffers,
    idle: Option<Duration>,
    begun: Option<Duration>,
) -> std::io::Result<Option<(Received, Lease)>> {
    Ok(
        match read_unleased(reader, to, buffers, idle, begun).await? {
            None => None,
            // The lease is taken once the bytes are in: a peer that sends a frame's head and then
            // trickles (or withholds) its bytes holds its own buffer, never the budget that every
            // other connection's transfers need.
            Some((message, bytes)) => Some((message, buffers.lease(cost(bytes)).await?)),
        },
    )
}

/// Reads the next message and says how many frame bytes it carries (0 for the others); with
/// `idle`, it must begin within it, and with `begun`, be whole within that of its first byte.
/// A frame of a session `to` is not receiving comes without its bytes (read past, not kept).
async fn read_unleased(
    reader: &mut (impl AsyncRead + Unpin),
    to: &impl Deliver,
    buffers: &Buffers,
    idle: Option<Duration>,
    begun: Option<Duration>,
) -> std::io::Result<Option<(Received, u32)>> {
    let mut head = [0u8; FRAME_HEAD];
    let first = reader.read(&mut head[..HEADER]);
    let first = match idle {
        None => first.await?,
        Some(limit) => tokio::time::timeout(limit, first).await.map_err(|_| {
            std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "no message of a session being received on the data connection within the peer timeout",
            )
        })??,
    };
    if first == 0 {
        return Ok(None);
    }
    let rest = read_rest(reader, to, buffers, head, first);
    let Some(limit) = begun else {
        return rest.await.map(Some);
    };
    let late = |_| {
        std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!(
                "a message begun on the data connection was not whole within {} ms",
                limit.as_millis()
            ),
        )
    };
    tokio::time::timeout(limit, rest)
        .await
        .map_err(late)?
        .map(Some)
}

/// The rest of a message whose first `first` bytes are in `head`.
async fn read_rest(
    reader: &mut (impl AsyncRead + Unpin),
    to: &impl Deliver,
    buffers: &Buffers,
    mut head: [u8; FRAME_HEAD],
    first: usize,
) -> std::io::Result<(Received, u32)> {
    reader.read_exact(&mut head[first..HEADER]).await?;
    let mut prefix = [0u8; HEADER];
    prefix.copy_from_slice(&head[..HEADER]);
    // An unknown kind needs no more bytes: `decode_head` refuses it below.
    let len = head_len(&prefix).unwrap_or(HEADER);
    reader.read_exact(&mut head[HEADER..len]).await?;
    let invalid = |e| std::io::Error::new(std::io::ErrorKind::InvalidData, e);
    let head = match decode_head(&head[..len], buffers.max_frame).map_err(invalid)? {
        Some((head, _)) => head,
        // `head_len` and `decode_head` agree on every kind: unreachable, but not a panic.
        None => return Err(std::io::Error::other("message head shorter than its kind")),
    };
    match head {
        Head::Whole(m) => Ok((m.into(), 0)),
        // A session decode is not receiving (never reserved, or ended): its bytes are read
        // past, never into a buffer, and the frame goes on without them (dropped as of no
        // session, as it always was). Buffered, every connection anyone could open held a
        // page of memory.
        Head::Frame { header, len } if !to.receiving(header.nonce) => {
            let (mut past, mut nowhere) = (reader.take(u64::from(len)), tokio::io::sink());
            if tokio::io::copy(&mut past, &mut nowhere).await? < u64::from(len) {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            let bytes = Vec::new();
            Ok((Received::Frame(Frame { header, bytes }.check()), 0))
        }
        Head::Frame { header, len } => {
            let bytes = read_bytes(reader, buffers.take(len as usize), len as usize).await?;
            Ok((Received::Frame(Frame { header, bytes }.check()), len))
        }
    }
}

/// Reads exactly `len` bytes into `bytes` (empty; grown as they come, to at most `len`; never
/// zero-filled) and not one byte more, however large the buffer.
async fn read_bytes(
    reader: &mut (impl AsyncRead + Unpin),
    mut bytes: Vec<u8>,
    len: usize,
) -> std::io::Result<Vec<u8>> {
    let mut limited = reader.take(len as u64);
    while bytes.len() < len {
        if bytes.len() == bytes.capacity() {
            // Doubling as it fills, never past the frame.
            let more = bytes.capacity().max(FIRST_ROOM).min(len - bytes.len());
            bytes.reserve_exact(more);
        }
        if limited.read_buf(&mut bytes).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
    }
    Ok(bytes)
}

/// A fault a test can inject into prefill's sending (`bulkhead worker --fault-stall-after-frames`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendFault {
    /// Once at least this many frames are written, stop sending and keep the connection open
    /// for as long as the process lives, even after the send is given up: a live peer that
    /// is stuck.
    StallAfterFrames(u32),
}

/// How a send ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sent {
    /// Every frame, the manifest and `Closed(complete)` were written.
    Complete { frames: u32, bytes: u64 },
    /// `aborted` said stop; `Closed(aborted)` was written instead of the rest.
    Aborted,
}

/// Prefill role: connects to the decode worker at `address` and writes the transfer.
pub async fn send(
    address: &str,
    frames: &[Frame],
    manifest: &Manifest,
    batch_bytes: usize,
    aborted: impl Fn() -> bool,
) -> std::io::Result<Sent> {
    let options = SendOptions {
        batch_bytes,
        peer_timeout: DEFAULT_PEER_TIMEOUT,
        floor_bytes_per_s: DEFAULT_FLOOR_BYTES_PER_S,
        fault: None,
        tls: None,
    };
    send_with(address, frames, manifest, &options, aborted).await
}

/// How prefill writes its transfers.
#[derive(Debug, Clone)]
pub struct SendOptions {
    /// Frames go out in batches of about this many bytes.
    pub batch_bytes: usize,
    /// How long a decode peer that vanished can hold the connection ([`bound_peer`]).
    pub peer_timeout: Duration,
    /// The slowest a transfer may go, bytes per second: a send takes at most the peer timeout
    /// and its bytes at this rate ([`SendOptions::deadline`]).
    pub floor_bytes_per_s: u64,
    /// A fault to inject (tests only).
    pub fault: Option<SendFault>,
    /// The deployment's mutual TLS: every data connection is encrypted and authenticated.
    pub tls: Option<ClusterTls>,
}

/// The transfer floor [`send`] holds its sends to: the worker's `--transfer-floor` default.
pub const DEFAULT_FLOOR_BYTES_PER_S: u64 = 100_000_000;

impl SendOptions {
    /// How long a send of `frames` may take: the peer timeout, and its bytes at the floor. A
    /// decode peer that reads, but slower than that, holds prefill's source pages no longer
    /// (a live one is only bounded by [`bound_peer`], and a hostile one that trickles never
    /// hangs up).
    pub fn deadline(&self, frames: &[Frame]) -> Duration {
        let bytes: u64 = frames
            .iter()
            .map(|f| (FRAME_HEAD + f.bytes.len()) as u64)
            .sum();
        let at_floor = bytes as f64 / self.floor_bytes_per_s.max(1) as f64;
        self.peer_timeout
            .saturating_add(Duration::try_from_secs_f64(at_floor).unwrap_or(Duration::MAX))
    }
}

/// A data connection, prefill's side: TCP, or TLS over it.
pub type Outgoing = Box<dyn AsyncWrite + Unpin + Send>;

/// Connects to the decode worker at `address` as `options` say: a host that does not answer at
/// all within the peer timeout is as gone as one that stops answering.
pub async fn connect(address: &str, options: &SendOptions) -> std::io::Result<Outgoing> {
    let limit = options.peer_timeout;
    let socket = tokio::time::timeout(limit, TcpStream::connect(address))
        .await
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
    socket.set_nodelay(true)?;
    bound_peer(&socket, limit)?;
    Ok(match &options.tls {
        None => Box::new(socket),
        Some(tls) => Box::new(tls.connect(address, socket, limit).await?),
    })
}

/// [`send`], with every option.
pub async fn send_with(
    address: &str,
    frames: &[Frame],
    manifest: &Manifest,
    options: &SendOptions,
    aborted: impl Fn() -> bool,
) -> std::io::Result<Sent> {
    let mut socket = connect(address, options).await?;
    let (batch_bytes, fault) = (options.batch_bytes, options.fault);
    if fault.is_some() {
        // The stall plays a peer whose connection stays open for as long as the process
        // lives, whatever its caller does: the socket goes to a task of its own, and this
        // send waits until its caller gives up on it.
        let (frames, manifest) = (frames.to_vec(), manifest.clone());
        tokio::spawn(async move {
            let held = send_frames(&mut socket, &frames, &manifest, batch_bytes, fault, || {
                false
            });
            let _ = held.await;
        });
        return std::future::pending().await;
    }
    send_frames(&mut socket, frames, manifest, batch_bytes, fault, aborted).await
}

/// Writes `frames` (in batches of about `batch_bytes`, checking `aborted` between batches),
/// the manifest and `Closed` to `socket`, then shuts it down.
pub async fn send_on(
    socket: &mut (impl AsyncWrite + Unpin),
    frames: &[Frame],
    manifest: &Manifest,
    batch_bytes: usize,
    aborted: impl Fn() -> bool,
) -> std::io::Result<Sent> {
    send_frames(socket, frames, manifest, batch_bytes, None, aborted).await
}

async fn send_frames(
    socket: &mut (impl AsyncWrite + Unpin),
    frames: &[Frame],
    manifest: &Manifest,
    batch_bytes: usize,
    fault: Option<SendFault>,
    aborted: impl Fn() -> bool,
) -> std::io::Result<Sent> {
    let nonce = manifest.nonce;
    let mut bytes = 0u64;
    let mut rest = frames;
    while !rest.is_empty() {
        let mut n = 0;
        let mut size = 0;
        while n < rest.len() && (n == 0 || size < batch_bytes) {
            size += FRAME_HEAD + rest[n].bytes.len();
            n += 1;
        }
        let (batch, later) = rest.split_at(n);
        let heads: Vec<[u8; FRAME_HEAD]> = batch
            .iter()
            .map(|f| frame_head(&f.header, f.bytes.len() as u32))
            .collect();
        let mut slices: Vec<IoSlice<'_>> = heads
            .iter()
            .zip(batch)
            .flat_map(|(h, f)| [IoSlice::new(h), IoSlice::new(&f.bytes)])
            .collect();
        write_all_vectored(socket, &mut slices).await?;
        bytes += size as u64;
        rest = later;
        if let Some(SendFault::StallAfterFrames(n)) = fault
            && frames.len() - rest.len() >= n as usize
        {
            tracing::warn!(session = %nonce, "fault injection: KV send stalls");
            std::future::pending::<()>().await;
        }
        if !rest.is_empty() && aborted() {
            let mut buf = Vec::new();
            encode(
                &Message::Closed {
                    nonce,
                    reason: CloseReason::Aborted,
                },
                &mut buf,
            );
            socket.write_all(&buf).await?;
            socket.shutdown().await?;
            return Ok(Sent::Aborted);
        }
    }
    let mut buf = Vec::new();
    encode(&Message::Manifest(manifest.clone()), &mut buf);
    encode(
        &Message::Closed {
            nonce,
            reason: CloseReason::Complete,
        },
        &mut buf,
    );
    socket.write_all(&buf).await?;
    bytes += buf.len() as u64;
    socket.shutdown().await?;
    Ok(Sent::Complete {
        frames: frames.len() as u32,
        bytes,
    })
}

/// Prefill role: tells decode that nothing of session `nonce` was or will be sent (decode
/// aborted it before its KV was computed): the drain acknowledgement on a connection of its own.
pub async fn send_closed(
    address: &str,
    nonce: SessionNonce,
    reason: CloseReason,
    options: &SendOptions,
) -> std::io::Result<()> {
    let mut socket = connect(address, options).await?;
    let mut buf = Vec::new();
    encode(&Message::Closed { nonce, reason }, &mut buf);
    socket.write_all(&buf).await?;
    socket.shutdown().await
}

/// Writes every byte of `slices`, however the socket splits the writes.
async fn write_all_vectored(
    socket: &mut (impl AsyncWrite + Unpin),
    mut slices: &mut [IoSlice<'_>],
) -> std::io::Result<()> {
    while !slices.is_empty() {
        let n = socket.write_vectored(slices).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut slices, n);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use bulkhead_handoff::CheckedFrame;
    use bulkhead_handoff::codec::encode_frame;
    use bulkhead_kvpool::Tag;
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};
    use tokio_rustls::rustls::{ClientConfig, RootCertStore};

    use super::*;

    /// What arrived; clones share it (so that `serve` can hand one to each connection).
    #[derive(Default, Clone)]
    struct Log {
        got: Arc<Mutex<Vec<Received>>>,
        closed: Arc<Mutex<Vec<SessionNonce>>>,
        /// Sessions no longer received (every other one is).
        ended: Arc<Mutex<Vec<SessionNonce>>>,
    }

    impl Deliver for Log {
        fn deliver(&self, message: Received, buffers: &Buffers, _lease: Lease) {
            // Give the buffer back, as the engine does, so that buffers are reused.
            if let Received::Frame(f) = &message {
                buffers.give(f.clone().into_bytes());
            }
            self.got.lock().expect("lock").push(message);
        }
        fn transport_closed(&self, nonces: Vec<SessionNonce>) {
            self.closed.lock().expect("lock").extend(nonces);
        }
        fn receiving(&self, nonce: SessionNonce) -> bool {
            !self.ended.lock().expect("lock").contains(&nonce)
        }
    }

    const NONCE: SessionNonce = SessionNonce([5; 16]);

    fn frames(n: u32, len: usize) -> Vec<Frame> {
        (0..n)
            .map(|i| {
                let bytes = (0..len).map(|b| (b as u32 * 7 + i) as u8).collect();
                Frame::new(
                    NONCE,
                    i,
                    Tag::new(u64::from(i) + 1),
                    i * 4..i * 4 + 4,
                    bytes,
                )
            })
            .collect()
    }

    fn manifest(fs: &[Frame]) -> Manifest {
        Manifest::new(
            NONCE,
            fs.len() as u32 * 4,
            3,
            fs.iter().map(|f| f.header.checksum),
        )
    }

    /// Sends through an in-memory pipe of `pipe` bytes (small pipes split every write).
    async fn round_trip(fs: &[Frame], batch: usize, pipe: usize) -> Log {
        let (mut tx, rx) = tokio::io::duplex(pipe);
        let log = Log::default();
        let m = manifest(fs);
        let (sent, received) = tokio::join!(send_on(&mut tx, fs, &m, batch, || false), async {
            receive(rx, &log, &Buffers::default(), None).await
        });
        assert!(matches!(sent, Ok(Sent::Complete { .. })));
        received.expect("clean end");
        log
    }

    #[tokio::test]
    async fn a_data_connection_bounds_how_long_a_vanished_peer_holds_it() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let socket = TcpStream::connect(listener.local_addr().expect("address"))
            .await
            .expect("connects");
        bound_peer(&socket, Duration::from_secs(30)).expect("bounded");
        let s = socket2::SockRef::from(&socket);
        assert!(s.keepalive().expect("SO_KEEPALIVE"));
        let probes = (
            s.tcp_keepalive_time().expect("TCP_KEEPIDLE"),
            s.tcp_keepalive_interval().expect("TCP_KEEPINTVL"),
        );
        assert_eq!(probes, (Duration::from_secs(10), Duration::from_secs(5)));
        let unacknowledged = s.tcp_user_timeout().expect("TCP_USER_TIMEOUT");
        assert_eq!(unacknowledged, Some(Duration::from_secs(30)));
        // A short bound still probes at whole seconds (the kernel's unit).
        bound_peer(&socket, Duration::from_millis(1500)).expect("bounded");
        assert_eq!(
            s.tcp_keepalive_interval().expect("TCP_KEEPINTVL"),
            Duration::from_secs(1)
        );
    }

    #[tokio::test]
    async fn a_decode_peer_that_never_answers_the_connect_fails_the_send_within_the_peer_timeout() {
        // A listener whose accept queue is full (backlog 0, one connection never accepted):
        // the kernel drops the next connection's SYNs, as from a host that is gone.
        let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)
            .expect("socket");
        socket
            .bind(&std::net::SocketAddr::from(([127, 0, 0, 1], 0)).into())
            .expect("bind");
        socket.listen(0).expect("listen");
        let address = socket
            .local_addr()
            .expect("address")
            .as_socket()
            .expect("an IP address");
        let mut queued = Vec::new();
        let filled = async {
            loop {
                let connect = TcpStream::connect(address);
                match tokio::time::timeout(Duration::from_millis(300), connect).await {
                    Ok(Ok(s)) => queued.push(s),
                    Ok(Err(e)) => panic!("connect failed instead of hanging: {e}"),
                    Err(_) => return,
                }
                assert!(queued.len() < 16, "the accept queue never filled");
            }
        };
        filled.await;
        let fs = frames(1, 100);
        let options = SendOptions {
            peer_timeout: Duration::from_millis(500),
            ..plain()
        };
        let (to, m) = (address.to_string(), manifest(&fs));
        let started = std::time::Instant::now();
        let sending = send_with(&to, &fs, &m, &options, || false);
        let sent = tokio::time::timeout(Duration::from_secs(10), sending)
            .await
            .expect("the send ends on its own");
        let e = sent.expect_err("nobody answered");
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut, "{e}");
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "{:?}",
            started.elapsed()
        );
    }

    #[tokio::test]
    async fn every_frame_arrives_checked_and_in_order_however_the_stream_splits() {
        let fs = frames(5, 3000);
        for (batch, pipe) in [(1, 7), (4000, 1 << 20), (1 << 20, 100)] {
            let log = round_trip(&fs, batch, pipe).await;
            let got = log.got.lock().expect("lock");
            let want = received(
                &fs,
                [
                    Received::Manifest(manifest(&fs)),
                    Received::Closed {
                        nonce: NONCE,
                        reason: CloseReason::Complete,
                    },
                ],
            );
            assert_eq!(*got, want);
            assert!(log.closed.lock().expect("lock").is_empty());
        }
    }

    /// What the receiver gets for the frames `fs` followed by the messages `then`.
    fn received(fs: &[Frame], then: impl IntoIterator<Item = Received>) -> Vec<Received> {
        fs.iter()
            .cloned()
            .map(|f| Received::Frame(f.check()))
            .chain(then)
            .collect()
    }

    #[tokio::test]
    async fn an_aborted_send_stops_after_the_current_batch_with_closed_aborted() {
        let fs = frames(5, 100);
        let m = manifest(&fs);
        let aborted = Received::Closed {
            nonce: NONCE,
            reason: CloseReason::Aborted,
        };
        // A batch is at least one frame and grows while it is under `batch_bytes`.
        for (batch, sent) in [(1, 1), (2 * (FRAME_HEAD + 100), 2)] {
            let (mut tx, rx) = tokio::io::duplex(1 << 20);
            let log = Log::default();
            let (result, end) = tokio::join!(send_on(&mut tx, &fs, &m, batch, || true), async {
                receive(rx, &log, &Buffers::default(), None).await
            });
            assert_eq!(result.expect("sent"), Sent::Aborted);
            end.expect("clean end");
            let got = log.got.lock().expect("lock");
            assert_eq!(
                *got,
                received(&fs[..sent], [aborted.clone()]),
                "batch {batch}"
            );
            assert!(log.closed.lock().expect("lock").is_empty());
        }
    }

    #[tokio::test]
    async fn a_send_whose_last_batch_is_out_completes_and_counts_its_bytes() {
        let fs = frames(3, 100);
        let m = manifest(&fs);
        let (mut tx, rx) = tokio::io::duplex(1 << 20);
        let log = Log::default();
        let (result, end) = tokio::join!(send_on(&mut tx, &fs, &m, 1 << 20, || true), async {
            receive(rx, &log, &Buffers::default(), None).await
        });
        end.expect("clean end");
        let mut tail = Vec::new();
        encode(&Message::Manifest(m), &mut tail);
        encode(
            &Message::Closed {
                nonce: NONCE,
                reason: CloseReason::Complete,
            },
            &mut tail,
        );
        let bytes = (3 * (FRAME_HEAD + 100) + tail.len()) as u64;
        assert_eq!(result.expect("sent"), Sent::Complete { frames: 3, bytes });
        assert_eq!(log.got.lock().expect("lock").len(), 5);
    }

    /// An engine that falls behind: it keeps every lease until told to catch up.
    #[derive(Default, Clone)]
    struct Behind {
        leases: Arc<Mutex<Vec<Lease>>>,
        taken: Arc<Mutex<usize>>,
    }

    impl Deliver for Behind {
        fn deliver(&self, message: Received, buffers: &Buffers, lease: Lease) {
            if let Received::Frame(f) = message {
                buffers.give(f.into_bytes());
            }
            self.leases.lock().expect("lock").push(lease);
            *self.taken.lock().expect("lock") += 1;
        }
        fn transport_closed(&self, _: Vec<SessionNonce>) {}
        fn receiving(&self, _: SessionNonce) -> bool {
            true
        }
    }

    #[tokio::test]
    async fn what_waits_for_the_engine_is_held_to_the_receive_budget() {
        // 40 frames of 1000 bytes, all in the pipe at once; room for 4 of them.
        let fs = frames(40, 1000);
        let buffers = Buffers::with_budget(1000, 4 * cost(1000));
        let behind = Behind::default();
        let (mut tx, rx) = tokio::io::duplex(1 << 20);
        let receiving = tokio::spawn({
            let (behind, buffers) = (behind.clone(), buffers.clone());
            async move { receive(rx, &behind, &buffers, None).await }
        });
        let sent = send_on(&mut tx, &fs, &manifest(&fs), 1 << 20, || false).await;
        assert!(matches!(sent, Ok(Sent::Complete { .. })));
        drop(tx);
        // The receive path takes what fits (however slowly a loaded machine runs it), then
        // stops there.
        let taken = || *behind.taken.lock().expect("lock");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while taken() < 4 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(taken(), 4, "stopped at the budget");
        assert!(!receiving.is_finished());
        // The engine catches up: the rest comes, the manifest and `Closed` too.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !receiving.is_finished() {
            assert!(tokio::time::Instant::now() < deadline, "never finished");
            behind.leases.lock().expect("lock").clear();
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        receiving.await.expect("joined").expect("clean end");
        assert_eq!(*behind.taken.lock().expect("lock"), 42);
    }

    #[tokio::test]
    async fn a_peer_that_withholds_a_frames_bytes_holds_none_of_the_budget() {
        // Room for one frame. One peer sends a frame's head and 10 of its 1000 bytes, then
        // nothing; another's whole transfer must still get through.
        let fs = frames(3, 1000);
        let buffers = Buffers::with_budget(1000, cost(1000));
        let mut partial = Vec::new();
        encode_frame(&fs[0], &mut partial);
        let (mut stalled, rx) = tokio::io::duplex(1 << 20);
        stalled
            .write_all(&partial[..FRAME_HEAD + 10])
            .await
            .expect("writes");
        let withheld = tokio::spawn({
            let buffers = buffers.clone();
            async move { receive(rx, &Log::default(), &buffers, None).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        let (mut tx, rx) = tokio::io::duplex(1 << 20);
        let log = Log::default();
        let whole = async {
            let sent = send_on(&mut tx, &fs, &manifest(&fs), 1 << 20, || false).await;
            drop(tx);
            sent
        };
        let both = async { tokio::join!(whole, receive(rx, &log, &buffers, None)) };
        let (sent, received) = tokio::time::timeout(Duration::from_secs(5), both)
            .await
            .expect("the whole transfer is not held up");
        assert!(matches!(sent, Ok(Sent::Complete { .. })));
        received.expect("clean end");
        assert_eq!(log.got.lock().expect("lock").len(), 5);
        assert!(!withheld.is_finished());
        drop(stalled);
    }

    /// A peer that opens a session (any nonce does, until the engine judges it) and then
    /// withholds the rest of a frame it began loses the connection at the limit, and its
    /// buffer never took the page it announced: before, it held both for ever.
    #[tokio::test]
    async fn a_frame_begun_and_withheld_ends_its_connection_at_the_limit() {
        let limit = Some(Limits::new(Duration::from_millis(100), 0, 1));
        let fs = frames(1, 200_000);
        // A manifest opens the session; then a frame's head and ten of its bytes.
        let mut bytes = Vec::new();
        encode(&Message::Manifest(manifest(&fs)), &mut bytes);
        let mut begun = bytes.clone();
        encode_frame(&fs[0], &mut begun);
        begun.truncate(bytes.len() + FRAME_HEAD + 10);
        let (mut tx, rx) = tokio::io::duplex(1 << 20);
        tx.write_all(&begun).await.expect("writes");
        let t0 = std::time::Instant::now();
        let ended = tokio::time::timeout(
            Duration::from_secs(5),
            receive(rx, &Log::default(), &Buffers::default(), limit),
        )
        .await
        .expect("the connection ends");
        let e = ended.expect_err("closed for the withheld frame");
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut, "{e}");
        assert!(e.to_string().contains("begun"), "{e}");
        assert!(t0.elapsed() >= Duration::from_millis(100));
        drop(tx);
        // The most room a read of the withheld frame was offered: what its buffer took.
        let (mut tx, rx) = tokio::io::duplex(1 << 20);
        tx.write_all(&begun).await.expect("writes");
        let offered = Offered::new(rx);
        let most = offered.most.clone();
        let ended = receive(offered, &Log::default(), &Buffers::default(), limit).await;
        assert!(ended.is_err());
        let most = most.load(std::sync::atomic::Ordering::Relaxed);
        assert!((1..=FIRST_ROOM).contains(&most), "{most}");
    }

    /// A frame's buffer grows as its bytes come, to the frame's length and no further
    /// (`read_buf`'s own growth doubles past it).
    #[tokio::test]
    async fn a_frame_buffer_grows_to_the_frame_and_no_further() {
        let len = 200_000;
        let fs = frames(1, len);
        let mut bytes = Vec::new();
        encode_frame(&fs[0], &mut bytes);
        let log = Log::default();
        receive(&bytes[..], &log, &Buffers::default(), None)
            .await
            .expect("a clean end");
        let got = log.got.lock().expect("lock").pop();
        let Some(Received::Frame(frame)) = got else {
            panic!("a frame: {got:?}");
        };
        let frame = frame.into_bytes();
        assert_eq!((frame.len(), frame.capacity()), (len, len));
    }

    /// A frame of a session decode is not receiving is read past, never into a buffer: it
    /// comes without its bytes (for the engine to count as of no session), and the connection
    /// reads on. Buffered, every connection a peer may open held a page of memory, whatever
    /// decode had reserved.
    #[tokio::test]
    async fn a_frame_of_a_session_not_received_is_read_past_not_kept() {
        let fs = frames(2, 200_000);
        let mut bytes = Vec::new();
        for f in &fs {
            encode_frame(f, &mut bytes);
        }
        let log = Log::default();
        log.ended.lock().expect("lock").push(NONCE);
        let buffers = Buffers::default();
        receive(&bytes[..], &log, &buffers, None)
            .await
            .expect("a clean end");
        let got = std::mem::take(&mut *log.got.lock().expect("lock"));
        assert_eq!(got.len(), 2, "both delivered, the connection read on");
        for m in got {
            let Received::Frame(f) = m else {
                panic!("a frame: {m:?}");
            };
            let kept = f.into_bytes();
            assert_eq!((kept.len(), kept.capacity()), (0, 0), "no byte kept");
        }
        // Given back (as the engine gives every frame's buffer back), an empty one is not
        // kept for the next frame; one that held bytes is.
        let spares = || buffers.spares.lock().expect("lock").len();
        assert_eq!(spares(), 0, "the two read past were not kept");
        buffers.give(Vec::with_capacity(8));
        assert_eq!(spares(), 1);
        // A session that is received takes the same frames whole.
        let log = Log::default();
        receive(&bytes[..], &log, &buffers, None)
            .await
            .expect("a clean end");
        let got = log.got.lock().expect("lock");
        assert!(
            got.iter().all(
                |m| matches!(m, Received::Frame(f) if f.clone().into_bytes().len() == 200_000)
            ),
            "{} frames",
            got.len()
        );
    }

    /// A frame read past that ends before its bytes do is a cut connection, as any frame.
    #[tokio::test]
    async fn a_frame_read_past_that_ends_short_is_an_unexpected_end() {
        let fs = frames(1, 1000);
        let mut bytes = Vec::new();
        encode_frame(&fs[0], &mut bytes);
        let log = Log::default();
        log.ended.lock().expect("lock").push(NONCE);
        let cut = &bytes[..bytes.len() - 10];
        let error = receive(cut, &log, &Buffers::default(), None)
            .await
            .expect_err("cut short");
        assert_eq!(error.kind(), std::io::ErrorKind::UnexpectedEof);
        assert!(log.got.lock().expect("lock").is_empty());
    }

    /// A reader that records the most room any read of it was offered.
    struct Offered<R> {
        inner: R,
        most: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl<R> Offered<R> {
        fn new(inner: R) -> Offered<R> {
            Offered {
                inner,
                most: Arc::default(),
            }
        }
    }

    impl<R: AsyncRead + Unpin> AsyncRead for Offered<R> {
        fn poll_read(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            self.most
                .fetch_max(buf.remaining(), std::sync::atomic::Ordering::Relaxed);
            std::pin::Pin::new(&mut self.inner).poll_read(cx, buf)
        }
    }

    #[tokio::test]
    async fn a_connection_that_opens_too_many_sessions_loses_it() {
        let mut bytes = Vec::new();
        for i in 0..=MAX_OPEN_SESSIONS {
            let mut nonce = [0; 16];
            nonce[..8].copy_from_slice(&(i as u64).to_le_bytes());
            let mut m = manifest(&[]);
            m.nonce = SessionNonce(nonce);
            encode(&Message::Manifest(m), &mut bytes);
        }
        let log = Log::default();
        let ended = receive(&bytes[..], &log, &Buffers::default(), None).await;
        let e = ended.expect_err("refused");
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData, "{e}");
        assert_eq!(log.got.lock().expect("lock").len(), MAX_OPEN_SESSIONS);
        // Every session it opened is reported torn down.
        assert_eq!(log.closed.lock().expect("lock").len(), MAX_OPEN_SESSIONS);
    }

    /// A connection whose next message does not come within the limit is closed, whatever it
    /// has open: one frame of a nonce decode never reserved held it for ever (the engine keeps
    /// deadlines for its own sessions only). Messages that keep coming keep it open, however
    /// long the transfer.
    #[tokio::test]
    async fn a_connection_that_idles_is_closed_whatever_it_has_open() {
        use std::time::Duration;
        let limit = Some(Limits::new(Duration::from_millis(500), 0, 1));
        let log = Log::default();
        let (_quiet, rx) = tokio::io::duplex(1 << 16);
        let t0 = std::time::Instant::now();
        let ended = receive(rx, &log, &Buffers::default(), limit).await;
        let e = ended.expect_err("closed for idling");
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut, "{e}");
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
        // Without the limit it is still open after longer.
        let (_quiet, rx) = tokio::io::duplex(1 << 16);
        let buffers = Buffers::default();
        let idling = receive(rx, &log, &buffers, None);
        assert!(
            tokio::time::timeout(Duration::from_millis(1500), idling)
                .await
                .is_err()
        );

        // One frame opens a session, then nothing: closed all the same, the session reported
        // torn down.
        let fs = frames(2, 100);
        let (mut tx, rx) = tokio::io::duplex(1 << 16);
        let receiving = tokio::spawn({
            let (log, buffers) = (log.clone(), buffers.clone());
            async move { receive(rx, &log, &buffers, limit).await }
        });
        let mut bytes = Vec::new();
        encode_frame(&fs[0], &mut bytes);
        tx.write_all(&bytes).await.expect("writes");
        let ended = tokio::time::timeout(Duration::from_secs(5), receiving)
            .await
            .expect("closed for idling")
            .expect("the task ran");
        assert_eq!(
            ended.expect_err("idle").kind(),
            std::io::ErrorKind::TimedOut
        );
        assert_eq!(*log.closed.lock().expect("lock"), [NONCE]);

        // A transfer whose messages come apart, each within the limit, runs to its end: longer
        // than the limit in all.
        let log = Log::default();
        let (mut tx, rx) = tokio::io::duplex(1 << 16);
        let receiving = tokio::spawn({
            let (log, buffers) = (log.clone(), buffers.clone());
            async move { receive(rx, &log, &buffers, limit).await }
        });
        let mut messages = Vec::new();
        for f in &fs {
            let mut bytes = Vec::new();
            encode_frame(f, &mut bytes);
            messages.push(bytes);
        }
        for m in [
            Message::Manifest(manifest(&fs)),
            Message::Closed {
                nonce: NONCE,
                reason: CloseReason::Complete,
            },
        ] {
            let mut bytes = Vec::new();
            encode(&m, &mut bytes);
            messages.push(bytes);
        }
        let t0 = std::time::Instant::now();
        for m in messages {
            tx.write_all(&m).await.expect("writes");
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
        assert!(t0.elapsed() > Duration::from_millis(500));
        drop(tx);
        let ended = tokio::time::timeout(Duration::from_secs(5), receiving)
            .await
            .expect("ends")
            .expect("the task ran");
        ended.expect("a clean end");
        assert_eq!(log.got.lock().expect("lock").len(), 4);
        assert!(
            log.closed.lock().expect("lock").is_empty(),
            "closed cleanly"
        );
    }

    /// Messages of sessions decode is not receiving do not keep a connection: a `Closed` of a
    /// nonce never reserved, sent every 150 ms, held a connection's place for as long as the
    /// host sent them (with every place so held, each transfer's connection was refused).
    #[tokio::test]
    async fn messages_of_sessions_not_received_do_not_keep_a_connection_open() {
        let limit = Some(Limits::new(Duration::from_millis(500), 0, 1));
        let stranger = SessionNonce([9; 16]);
        let log = Log::default();
        log.ended.lock().expect("lock").push(stranger);
        let (mut tx, rx) = tokio::io::duplex(1 << 16);
        let receiving = tokio::spawn({
            let log = log.clone();
            async move { receive(rx, &log, &Buffers::default(), limit).await }
        });
        let mut closed = Vec::new();
        encode(
            &Message::Closed {
                nonce: stranger,
                reason: CloseReason::Aborted,
            },
            &mut closed,
        );
        let t0 = std::time::Instant::now();
        let ended = loop {
            if receiving.is_finished() || t0.elapsed() > Duration::from_secs(5) {
                break tokio::time::timeout(Duration::from_secs(1), receiving).await;
            }
            // A write fails once the connection has ended: the loop sees it finished.
            let _ = tx.write_all(&closed).await;
            tokio::time::sleep(Duration::from_millis(150)).await;
        };
        let ended = ended.expect("closed for idling").expect("the task ran");
        assert_eq!(
            ended.expect_err("idle").kind(),
            std::io::ErrorKind::TimedOut
        );
        assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
        assert!(log.got.lock().expect("lock").len() >= 2, "they were read");
    }

    #[tokio::test]
    async fn a_stall_fault_stops_sending_after_its_frame_count() {
        let fs = frames(5, 100);
        let m = manifest(&fs);
        let (mut tx, rx) = tokio::io::duplex(1 << 20);
        let log = Log::default();
        let stall = Some(SendFault::StallAfterFrames(2));
        let buffers = Buffers::default();
        let both = async {
            tokio::join!(
                send_frames(&mut tx, &fs, &m, 1, stall, || false),
                receive(rx, &log, &buffers, None)
            )
        };
        let wait = std::time::Duration::from_millis(300);
        assert!(tokio::time::timeout(wait, both).await.is_err(), "stalled");
        let got = log.got.lock().expect("lock");
        assert_eq!(*got, received(&fs[..2], std::iter::empty()));
    }

    /// Sending options without TLS.
    fn plain() -> SendOptions {
        SendOptions {
            batch_bytes: 1 << 20,
            peer_timeout: DEFAULT_PEER_TIMEOUT,
            floor_bytes_per_s: DEFAULT_FLOOR_BYTES_PER_S,
            fault: None,
            tls: None,
        }
    }

    /// A send's deadline is the peer timeout and its bytes at the floor.
    #[test]
    fn a_sends_deadline_is_the_peer_timeout_and_its_bytes_at_the_floor() {
        let options = SendOptions {
            peer_timeout: Duration::from_secs(2),
            floor_bytes_per_s: 1_000,
            ..plain()
        };
        let fs = frames(3, 1_000 - FRAME_HEAD);
        assert_eq!(options.deadline(&fs), Duration::from_secs(5));
        assert_eq!(options.deadline(&[]), Duration::from_secs(2));
    }

    /// Waits (bounded) until `log` holds `n` messages: connections are served on tasks of
    /// their own.
    async fn wait_for(log: &Log, n: usize) {
        for _ in 0..500 {
            if log.got.lock().expect("lock").len() >= n {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }

    /// A listener serving into a fresh log, with `tls`, at most `connections` at once.
    async fn listening_with(
        tls: Option<ClusterTls>,
        connections: usize,
    ) -> (String, Log, tokio::task::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address").to_string();
        let log = Log::default();
        let serving = serve(
            listener,
            log.clone(),
            MAX_FRAME_BYTES,
            Limits::new(DEFAULT_PEER_TIMEOUT, MAX_FRAME_BYTES, 100_000_000),
            connections,
            tls,
        );
        let server = tokio::spawn(async move { match serving.await {} });
        (address, log, server)
    }

    /// A listener serving into a fresh log, with `tls`.
    async fn listening(tls: Option<ClusterTls>) -> (String, Log, tokio::task::JoinHandle<()>) {
        listening_with(tls, 64).await
    }

    /// A transfer of `fs` and then a drain acknowledgement, each on its own connection, from
    /// a sender with `options` to `address`: what arrived in `log`.
    async fn transfer_and_acknowledge(
        address: &str,
        log: &Log,
        fs: &[Frame],
        options: &SendOptions,
    ) -> Vec<Received> {
        let sent = send_with(address, fs, &manifest(fs), options, || false).await;
        assert!(
            matches!(sent, Ok(Sent::Complete { frames, .. }) if frames as usize == fs.len()),
            "{sent:?}"
        );
        send_closed(address, NONCE, CloseReason::Aborted, options)
            .await
            .expect("sent");
        wait_for(log, fs.len() + 3).await;
        log.got.lock().expect("lock").clone()
    }

    #[tokio::test]
    async fn the_listener_takes_a_transfer_and_a_drain_acknowledgement_on_their_own_connections() {
        let ca = crate::serve::tls::Authority::new("test CA").expect("a CA");
        let tls = || Some(ca.cluster_tls(&["127.0.0.1"]).expect("issued"));
        for (server_tls, client_tls) in [(None, None), (tls(), tls())] {
            let (address, log, server) = listening(server_tls).await;
            let fs = frames(2, 100);
            let options = SendOptions {
                tls: client_tls,
                ..plain()
            };
            let got = transfer_and_acknowledge(&address, &log, &fs, &options).await;
            server.abort();
            assert_eq!(got.len(), 5, "{got:?}");
            assert_eq!(
                got[..4],
                received(&fs, [Received::Manifest(manifest(&fs)), complete()])
            );
            assert_eq!(
                got[4],
                Received::Closed {
                    nonce: NONCE,
                    reason: CloseReason::Aborted
                }
            );
        }
    }

    #[test]
    fn a_worker_holds_two_connections_a_page_within_its_bounds() {
        assert_eq!(max_connections(0), 64);
        assert_eq!(max_connections(100), 200);
        assert_eq!(max_connections(42_580), 4096);
        assert_eq!(max_connections(u32::MAX), 4096);
    }

    /// Whether the listener closes `socket` (it reads the end, or a reset) within a second.
    async fn closed_at_once(socket: &mut TcpStream) -> bool {
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(1), socket.read(&mut byte)).await;
        matches!(read, Ok(Ok(0) | Err(_)))
    }

    #[tokio::test]
    async fn connections_over_the_bound_are_closed_and_a_freed_place_is_taken_again() {
        let (address, log, server) = listening_with(None, 2).await;
        let mut idle = Vec::new();
        for _ in 0..2 {
            let mut socket = TcpStream::connect(&address).await.expect("connect");
            assert!(!closed_at_once(&mut socket).await, "within the bound: held");
            idle.push(socket);
        }
        for _ in 0..3 {
            let mut over = TcpStream::connect(&address).await.expect("connect");
            assert!(closed_at_once(&mut over).await, "over the bound: closed");
        }
        assert!(log.got.lock().expect("lock").is_empty());
        // One leaves: its place is taken by a transfer (once the listener has seen it go).
        idle.pop();
        let fs = frames(1, 100);
        for _ in 0..100 {
            let _ = send_with(&address, &fs, &manifest(&fs), &plain(), || false).await;
            tokio::time::sleep(Duration::from_millis(20)).await;
            if !log.got.lock().expect("lock").is_empty() {
                break;
            }
        }
        server.abort();
        let got = log.got.lock().expect("lock").clone();
        assert_eq!(
            got[..],
            received(&fs, [Received::Manifest(manifest(&fs)), complete()])[..]
        );
    }

    fn complete() -> Received {
        Received::Closed {
            nonce: NONCE,
            reason: CloseReason::Complete,
        }
    }

    /// The failure mutual TLS prevents: a host on the path between prefill and decode (here a
    /// relay that forwards every byte and keeps a copy) reads the KV pages in the clear —
    /// and a prompt can be read back from its KV. Over TLS it holds not one 16-byte run of any
    /// frame's bytes, and the transfer still arrives whole and checked.
    #[tokio::test]
    async fn an_on_path_host_reads_the_kv_in_the_clear_without_tls_and_nothing_with_it() {
        let ca = crate::serve::tls::Authority::new("test CA").expect("a CA");
        let tls = || Some(ca.cluster_tls(&["127.0.0.1"]).expect("issued"));
        let fs = frames(4, 4096);
        let seen_in = |copy: &[u8]| {
            fs.iter()
                .flat_map(|f| f.bytes.chunks_exact(16))
                .filter(|run| copy.windows(16).any(|w| w == *run))
                .count()
        };
        for (server_tls, client_tls, expect_clear) in [(None, None, true), (tls(), tls(), false)] {
            let (decode, log, server) = listening(server_tls).await;
            let (relay, copy) = relay_to(&decode).await;
            let options = SendOptions {
                tls: client_tls,
                ..plain()
            };
            let got = transfer_and_acknowledge(&relay, &log, &fs, &options).await;
            server.abort();
            assert_eq!(
                got[..fs.len() + 2],
                received(&fs, [Received::Manifest(manifest(&fs)), complete()])
            );
            let copy = copy.lock().expect("lock").clone();
            assert!(copy.len() > fs.len() * 4096, "the relay saw the transfer");
            let runs = fs.len() * 4096 / 16;
            let seen = seen_in(&copy);
            if expect_clear {
                assert_eq!(seen, runs, "every byte of KV crosses in the clear");
            } else {
                assert_eq!(seen, 0, "no KV is readable on the path");
            }
        }
    }

    /// A relay on a port of its own that forwards each connection to `to` and copies what the
    /// sender writes.
    async fn relay_to(to: &str) -> (String, Arc<Mutex<Vec<u8>>>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address").to_string();
        let copy = Arc::new(Mutex::new(Vec::new()));
        let (to, kept) = (to.to_owned(), copy.clone());
        tokio::spawn(async move {
            while let Ok((mut from, _)) = listener.accept().await {
                let mut onward = TcpStream::connect(&to).await.expect("connects");
                let kept = kept.clone();
                tokio::spawn(async move {
                    let (mut from_r, mut from_w) = from.split();
                    let (mut on_r, mut on_w) = onward.split();
                    let forward = async {
                        let mut buf = vec![0u8; 64 << 10];
                        loop {
                            let n = from_r.read(&mut buf).await.unwrap_or(0);
                            if n == 0 {
                                let _ = on_w.shutdown().await;
                                return;
                            }
                            kept.lock().expect("lock").extend_from_slice(&buf[..n]);
                            if on_w.write_all(&buf[..n]).await.is_err() {
                                return;
                            }
                        }
                    };
                    let back = tokio::io::copy(&mut on_r, &mut from_w);
                    let _ = tokio::join!(forward, back);
                });
            }
        });
        (address, copy)
    }

    /// Only a peer the deployment's CA signed gets a frame in: one without a certificate, one
    /// with another CA's, and one speaking plain TCP are each refused at the handshake, and
    /// the listener goes on serving the peer that has one.
    #[tokio::test]
    async fn a_tls_listener_takes_frames_only_from_peers_the_ca_signed() {
        let ca = crate::serve::tls::Authority::new("test CA").expect("a CA");
        let (address, log, server) =
            listening(Some(ca.cluster_tls(&["127.0.0.1"]).expect("issued"))).await;
        let fs = frames(2, 100);
        let m = manifest(&fs);
        let stranger = crate::serve::tls::Authority::new("another CA").expect("a CA");
        let foreign = SendOptions {
            tls: Some(stranger.cluster_tls(&["127.0.0.1"]).expect("issued")),
            ..plain()
        };
        assert!(
            send_with(&address, &fs, &m, &foreign, || false)
                .await
                .is_err()
        );
        // Plain TCP: the bytes go out (nothing answers a handshake that never starts), and
        // none of them is taken as a message.
        let _ = send_with(&address, &fs, &m, &plain(), || false).await;
        // A client that trusts the CA but presents no certificate.
        let anonymous = {
            let mut roots = RootCertStore::empty();
            for cert in CertificateDer::pem_slice_iter(ca.ca_pem().as_bytes()) {
                roots.add(cert.expect("parses")).expect("a root");
            }
            let config = ClientConfig::builder_with_provider(Arc::new(
                tokio_rustls::rustls::crypto::ring::default_provider(),
            ))
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
            tokio_rustls::TlsConnector::from(Arc::new(config))
        };
        let socket = TcpStream::connect(&address).await.expect("connects");
        let name = ServerName::try_from("127.0.0.1").expect("an IP");
        if let Ok(mut stream) = anonymous.connect(name, socket).await {
            // TLS 1.3 refuses a missing client certificate after the client's last flight:
            // the write may go out, and the server reads nothing from it.
            let mut buf = Vec::new();
            encode_frame(&fs[0], &mut buf);
            let _ = stream.write_all(&buf).await;
            let _ = stream.shutdown().await;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(log.got.lock().expect("lock").is_empty(), "nothing got in");
        let signed = SendOptions {
            tls: Some(ca.cluster_tls(&["127.0.0.1"]).expect("issued")),
            ..plain()
        };
        let got = transfer_and_acknowledge(&address, &log, &fs, &signed).await;
        server.abort();
        assert_eq!(got.len(), 5, "the listener still serves: {got:?}");
    }

    /// Prefill checks that the decode worker it dials is the one the certificate names: a
    /// certificate for another host fails the send before any byte of KV is written.
    #[tokio::test]
    async fn prefill_refuses_a_decode_peer_whose_certificate_names_another_host() {
        let ca = crate::serve::tls::Authority::new("test CA").expect("a CA");
        let (address, log, server) =
            listening(Some(ca.cluster_tls(&["decode-1.example"]).expect("issued"))).await;
        let fs = frames(2, 100);
        let options = SendOptions {
            tls: Some(ca.cluster_tls(&["127.0.0.1"]).expect("issued")),
            ..plain()
        };
        let e = send_with(&address, &fs, &manifest(&fs), &options, || false)
            .await
            .expect_err("the name does not match");
        assert!(e.to_string().contains("certificate"), "{e}");
        server.abort();
        assert!(log.got.lock().expect("lock").is_empty());
    }

    #[tokio::test]
    async fn the_engine_takes_what_the_receive_path_hands_it() {
        use crate::engine::{Event, Failure, Request};
        use crate::sampling::SamplingParams;
        let engine = EngineHandle::tiny();
        let (mut events, _cancel) = engine
            .submit(super::super::Submission::Decode, |id, sink| Request {
                id,
                tenant: bulkhead_kvpool::Scope::new("test"),
                prompt: vec![5; 20],
                max_new_tokens: 4,
                sampling: SamplingParams::GREEDY,
                stop: Vec::new(),
                ignore_eos: false,
                sink,
            })
            .await
            .expect("admitted");
        let Some(Event::Reserved(target)) = events.recv().await else {
            panic!("expected the reservation");
        };
        // A frame of no session: dropped, counted, its buffer handed back for reuse and its
        // lease on the receive budget given back.
        let buffers = Buffers::default();
        let budget = buffers.budget.available_permits();
        let stray = Frame::new(SessionNonce([9; 16]), 0, Tag::new(1), 0..1, vec![1; 8]);
        let lease = buffers.lease(cost(8)).await.expect("room");
        Deliver::deliver(&engine, Received::Frame(stray.check()), &buffers, lease);
        // The transfer's connection ends: the request fails at once.
        Deliver::transport_closed(&engine, vec![target.nonce]);
        assert!(matches!(
            events.recv().await,
            Some(Event::Failed(Failure::PrefillClosed(_)))
        ));
        let stats = engine.stats().await.expect("stats");
        assert_eq!(stats.transfers.frames_dropped.get("no_session"), 1);
        assert_eq!(buffers.spares.lock().expect("lock").len(), 1);
        assert_eq!(buffers.budget.available_permits(), budget);
    }

    #[test]
    fn spare_buffers_are_bounded_and_handed_out_empty_with_room() {
        let buffers = Buffers::default();
        for _ in 0..SPARE_BUFFERS + 3 {
            buffers.give(vec![7; 8]);
        }
        let spares = || buffers.spares.lock().expect("lock").len();
        assert_eq!(spares(), SPARE_BUFFERS);
        let b = buffers.take(100);
        assert!(b.is_empty() && b.capacity() >= 100, "{b:?}");
        assert_eq!(spares(), SPARE_BUFFERS - 1);
    }

    #[tokio::test]
    async fn reused_larger_buffers_never_read_past_a_short_frame() {
        // Full pages, then a short last page: the buffers given back after the full pages
        // are larger than the short frame.
        let mut fs = frames(4, 3000);
        fs.push(Frame::new(NONCE, 4, Tag::new(5), 16..18, vec![9; 1500]));
        let m = manifest(&fs);
        let mut wire = Vec::new();
        fs.iter().for_each(|f| encode_frame(f, &mut wire));
        encode(&Message::Manifest(m.clone()), &mut wire);
        let log = Log::default();
        receive(&wire[..], &log, &Buffers::default(), None)
            .await
            .expect("clean end");
        let got = log.got.lock().expect("lock");
        assert_eq!(got.len(), 6);
        assert_eq!(got[4], Received::Frame(fs[4].clone().check()));
        assert_eq!(got[5], Received::Manifest(m));
    }

    #[tokio::test]
    async fn a_corrupted_frame_arrives_marked_and_the_stream_goes_on() {
        let fs = frames(3, 100);
        let mut wire = Vec::new();
        fs.iter().for_each(|f| encode_frame(f, &mut wire));
        let at = 2 * FRAME_HEAD + 100 + 50; // inside the second frame's bytes
        wire[at] ^= 4;
        let log = Log::default();
        receive(&wire[..], &log, &Buffers::default(), None)
            .await
            .expect("clean end");
        let got = log.got.lock().expect("lock");
        let intact: Vec<bool> = got
            .iter()
            .map(|m| match m {
                Received::Frame(f) => CheckedFrame::intact(f),
                other => panic!("unexpected {other:?}"),
            })
            .collect();
        assert_eq!(intact, [true, false, true]);
        // The stream ended without `Closed`: the session is reported torn down.
        assert_eq!(*log.closed.lock().expect("lock"), [NONCE]);
    }

    #[tokio::test]
    async fn a_stream_cut_inside_a_frame_or_with_bad_bytes_is_an_error_not_a_panic() {
        let fs = frames(2, 100);
        let mut wire = Vec::new();
        fs.iter().for_each(|f| encode_frame(f, &mut wire));
        for cut in [1, HEADER + 3, FRAME_HEAD + 10, wire.len() - 1] {
            let log = Log::default();
            let cut_short = receive(&wire[..cut], &log, &Buffers::default(), None).await;
            assert!(cut_short.is_err(), "cut at {cut}");
        }
        let mut bad = wire.clone();
        bad[5] = 9; // unknown kind
        let log = Log::default();
        assert!(
            receive(&bad[..], &log, &Buffers::default(), None)
                .await
                .is_err()
        );
        let mut huge = wire;
        huge[HEADER + 28..HEADER + 32].copy_from_slice(&u32::MAX.to_le_bytes());
        let refused = receive(&huge[..], &Log::default(), &Buffers::default(), None).await;
        assert!(refused.is_err());
    }

    #[tokio::test]
    async fn a_frame_longer_than_a_page_is_refused_before_its_bytes_are_read() {
        let fs = frames(2, 100);
        let len = fs[0].bytes.len() as u32;
        let mut wire = Vec::new();
        fs.iter().for_each(|f| encode_frame(f, &mut wire));
        let log = Log::default();
        receive(&wire[..], &log, &Buffers::up_to(len), None)
            .await
            .expect("frames of exactly a page are taken");
        assert_eq!(log.got.lock().expect("lock").len(), 2);
        let log = Log::default();
        let refused = receive(&wire[..], &log, &Buffers::up_to(len - 1), None).await;
        let e = refused.expect_err("one byte over a page");
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData, "{e}");
        assert!(
            log.got.lock().expect("lock").is_empty(),
            "nothing delivered"
        );
    }
}
