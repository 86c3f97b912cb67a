//! Ctrl-C and SIGTERM, listened for from the start, so that the second of them is heard too:
//! the first asks the gateway to drain, a second cuts the drain short ([`drain`]).

use std::time::Duration;

use anyhow::Context;
use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio::task::JoinHandle;

/// The process's Ctrl-C (SIGINT) and SIGTERM, each delivery heard once.
pub struct Signals {
    interrupt: Option<Signal>,
    terminate: Option<Signal>,
}

impl Signals {
    /// Listens for both from now on (one that cannot be listened for is said, and never heard).
    pub fn listen() -> Signals {
        let listen = |kind: SignalKind, name: &str| {
            signal(kind)
                .inspect_err(|e| tracing::warn!(error = %e, "cannot listen for {name}"))
                .ok()
        };
        Signals {
            interrupt: listen(SignalKind::interrupt(), "Ctrl-C"),
            terminate: listen(SignalKind::terminate(), "SIGTERM"),
        }
    }

    /// Completes at the next Ctrl-C or SIGTERM.
    pub async fn next(&mut self) {
        async fn one(signal: Option<&mut Signal>) {
            match signal {
                Some(s) => {
                    s.recv().await;
                }
                None => std::future::pending().await,
            }
        }
        tokio::select! {
            () = one(self.interrupt.as_mut()) => {}
            () = one(self.terminate.as_mut()) => {}
        }
    }
}

/// How long the gateway gets to end once a second signal cut its requests, before it is stopped
/// where it is.
const CUT_LIMIT: Duration = Duration::from_secs(5);

/// Waits for `serving` (the gateway, told to stop: it drains) to end, or for another signal,
/// which cuts the drain short: `cut` ends the requests under way as the drain timeout would
/// (each client told, each record saying so), and the gateway ends with its audit log flushed
/// — stopped where it is only if it has not within [`CUT_LIMIT`]. An operator's second Ctrl-C
/// does not wait out the drain. Whether it was cut, or the gateway's failure (a panic, said,
/// not dropped).
pub async fn drain(
    serving: &mut JoinHandle<()>,
    signals: &mut Signals,
    cut: impl FnOnce(),
) -> anyhow::Result<bool> {
    tokio::select! {
        ended = &mut *serving => return ended.context("the gateway failed").map(|()| false),
        () = signals.next() => {}
    }
    eprintln!("a second signal: cutting the requests under way");
    cut();
    match tokio::time::timeout(CUT_LIMIT, &mut *serving).await {
        Ok(ended) => ended.context("the gateway failed").map(|()| true),
        Err(_) => {
            serving.abort();
            eprintln!("the gateway did not end within {CUT_LIMIT:?} of the cut: stopped");
            Ok(true)
        }
    }
}
