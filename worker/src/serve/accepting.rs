//! Taking connections off a listener, whatever fails on the way.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};

/// How long accepting pauses after it failed: a failure that says the process is out of a
/// resource (descriptors, memory) would otherwise repeat at once, in a busy loop.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// The next connection on `listener` (which takes `what`'s connections). A failed accept — a
/// peer that reset before it was taken, or descriptors run out because peers hold many
/// connections open — is logged and accepting goes on after [`ACCEPT_BACKOFF`]: no peer can
/// stop a listener this way.
pub async fn next(listener: &TcpListener, what: &str) -> (TcpStream, SocketAddr) {
    loop {
        match listener.accept().await {
            Ok(accepted) => return accepted,
            Err(e) => {
                tracing::warn!(error = %e, "accepting a {what} connection failed; still listening");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
            }
        }
    }
}

/// How often a listener says it closed connections over its bound (with how many).
const REFUSALS_LOGGED_EVERY: Duration = Duration::from_secs(10);

/// Connections closed over a listener's bound since it was last said, said at most every
/// [`REFUSALS_LOGGED_EVERY`] (a flood of them is one line, not one each).
#[derive(Debug, Default)]
pub struct Refused {
    since_said: u64,
    said_at: Option<std::time::Instant>,
}

impl Refused {
    /// `peer`'s connection, one of `what`'s, was closed over the bound of `max` open ones.
    pub fn count(&mut self, peer: SocketAddr, what: &str, max: usize) {
        self.since_said += 1;
        let now = std::time::Instant::now();
        if self
            .said_at
            .is_some_and(|at| now.duration_since(at) < REFUSALS_LOGGED_EVERY)
        {
            return;
        }
        tracing::warn!(%peer, closed = self.since_said, max_connections = max,
            "closed {what} connections over the bound on open ones");
        self.since_said = 0;
        self.said_at = Some(now);
    }
}
