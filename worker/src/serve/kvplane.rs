//! The KV data plane over TCP: prefill workers connect to a decode worker's KV listener and
//! write each transfer's frames, manifest and `Closed` in order (see `bulkhead_handoff`).
//!
//! Decode reads messages with the handoff codec and hands them to the engine thread, which
//! decides per frame whether it may be written. When a connection ends — cleanly or not — every
//! session it carried that was not closed is reported as torn down: nothing more of it can
//! arrive, which is the drain acknowledgement for aborted transfers. A peer that sends bytes
//! the codec refuses loses its connection, never the worker.

use std::collections::HashSet;

use bulkhead_handoff::codec::{decode, encode, encode_frame};
use bulkhead_handoff::{CloseReason, Message};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::actor::EngineHandle;
use crate::engine::Outbound;

/// Frames larger than this are refused before their bytes are read (a page of a large model
/// is a few MiB).
pub const MAX_FRAME_BYTES: u32 = 256 << 20;

/// Decode role: accepts data-plane connections until the listener fails.
pub async fn serve(listener: TcpListener, engine: EngineHandle) -> std::io::Result<()> {
    loop {
        let (socket, peer) = listener.accept().await?;
        let engine = engine.clone();
        tokio::spawn(async move {
            if let Err(e) = receive(socket, &engine).await {
                tracing::warn!(%peer, error = %e, "KV data connection ended with an error");
            }
        });
    }
}

/// Reads one connection's messages into the engine.
async fn receive(mut socket: TcpStream, engine: &EngineHandle) -> std::io::Result<()> {
    let mut open = HashSet::new();
    let mut buf = Vec::with_capacity(1 << 20);
    let mut chunk = vec![0u8; 1 << 18];
    let result = loop {
        let n = match socket.read(&mut chunk).await {
            Ok(0) => break Ok(()),
            Ok(n) => n,
            Err(e) => break Err(e),
        };
        buf.extend_from_slice(&chunk[..n]);
        let mut used_total = 0;
        let parsed = loop {
            match decode(&buf[used_total..], MAX_FRAME_BYTES) {
                Ok(Some((message, used))) => {
                    used_total += used;
                    match &message {
                        Message::Closed { nonce, .. } => {
                            open.remove(nonce);
                        }
                        other => {
                            open.insert(other.nonce());
                        }
                    }
                    engine.deliver(message);
                }
                Ok(None) => break Ok(()),
                Err(e) => break Err(e),
            }
        };
        buf.drain(..used_total);
        if let Err(e) = parsed {
            break Err(std::io::Error::new(std::io::ErrorKind::InvalidData, e));
        }
    };
    engine.transport_closed(open.into_iter().collect());
    result
}

/// How a send ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sent {
    /// Every frame, the manifest and `Closed(complete)` were written.
    Complete { frames: u32, bytes: u64 },
    /// `aborted` said stop; `Closed(aborted)` was written instead of the rest.
    Aborted,
}

/// Prefill role: writes `outbound` to the decode worker at `address` in batches of about
/// `batch_bytes`, checking `aborted` between batches.
pub async fn send(
    address: &str,
    outbound: &Outbound,
    batch_bytes: usize,
    aborted: impl Fn() -> bool,
) -> std::io::Result<Sent> {
    let mut socket = TcpStream::connect(address).await?;
    socket.set_nodelay(true)?;
    let nonce = outbound.nonce();
    let mut buf = Vec::with_capacity(batch_bytes.saturating_add(1 << 16));
    let mut bytes = 0u64;
    for frame in &outbound.frames {
        encode_frame(frame, &mut buf);
        if buf.len() >= batch_bytes {
            socket.write_all(&buf).await?;
            bytes += buf.len() as u64;
            buf.clear();
            if aborted() {
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
    }
    encode(&Message::Manifest(outbound.manifest.clone()), &mut buf);
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
        frames: outbound.frames.len() as u32,
        bytes,
    })
}
