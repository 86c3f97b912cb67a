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
