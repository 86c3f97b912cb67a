//! One loaded plugin and its calls. Every call gets a fresh store (its own memory limit and
//! deadline), a fresh instance from the pool, then `configure` and the one hook, all on the
//! calling task. Whatever the guest does, the caller gets a value or a [`Fault`]; nothing it
//! does can panic the gateway.

use std::sync::Arc;
use std::time::{Duration, Instant};

use wasmtime::{Store, Trap, UpdateDeadline};

use super::bindings::{
    Directive, Disconnect, Hooks, Plugin, PluginPre, RequestView, ResponseEnd, Verdict,
};
use super::digest::Digest;
use super::host::Host;
use super::sandbox::{Sandbox, TICK};

/// The limits of one plugin's calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallLimits {
    /// Linear memory per call, in bytes.
    pub memory_bytes: usize,
    /// Wall time per call (instantiation, `configure` and the hook together).
    pub timeout: Duration,
}

/// How a plugin call failed; every kind fails the request closed unless the binding is
/// fail-open.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, serde::Serialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "detail")]
pub enum Fault {
    #[error("trapped: {0}")]
    Trap(String),
    #[error("ran past its deadline")]
    Timeout,
    #[error("exceeded its memory limit")]
    Memory,
    #[error("returned an invalid answer: {0}")]
    Garbage(String),
    #[error("no instance slot was free in time")]
    Busy,
}

impl Fault {
    /// A short name for logs and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Fault::Trap(_) => "trap",
            Fault::Timeout => "timeout",
            Fault::Memory => "memory",
            Fault::Garbage(_) => "garbage",
            Fault::Busy => "busy",
        }
    }
}

/// A compiled, pre-instantiated plugin.
pub(super) struct Loaded {
    pub(super) name: Arc<str>,
    pub(super) digest: Digest,
    pre: PluginPre<Host>,
    limits: CallLimits,
    sandbox: Sandbox,
}

impl std::fmt::Debug for Loaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loaded")
            .field("name", &self.name)
            .field("digest", &self.digest)
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

/// The longest trap message kept (the rest of a guest's backtrace is noise in a log).
const MAX_TRAP_TEXT: usize = 512;

impl Loaded {
    pub(super) fn new(
        name: Arc<str>,
        digest: Digest,
        pre: PluginPre<Host>,
        limits: CallLimits,
        sandbox: Sandbox,
    ) -> Loaded {
        Loaded {
            name,
            digest,
            pre,
            limits,
            sandbox,
        }
    }

    /// Instantiates, configures with `config` and runs `hook`, all within the call's limits,
    /// on the calling task. The guest yields to the runtime at every epoch tick and traps
    /// (as [`Fault::Timeout`]) at the first tick past its deadline; a host call that waits
    /// (a WASI clock) is cut off at the deadline too, by dropping the call.
    async fn run<R>(
        &self,
        config: &str,
        hook: impl AsyncFnOnce(&mut Store<Host>, &Plugin) -> wasmtime::Result<R>,
    ) -> Result<(Hooks, R), Fault> {
        let mut store = Store::new(
            self.sandbox.engine(),
            Host::new(self.name.clone(), self.limits.memory_bytes),
        );
        store.limiter(|h| &mut h.limiter);
        let deadline = Instant::now() + self.limits.timeout;
        store.set_epoch_deadline(1);
        store.epoch_deadline_callback(move |_| {
            Ok(if Instant::now() < deadline {
                UpdateDeadline::Yield(1)
            } else {
                UpdateDeadline::Interrupt
            })
        });
        let call = async {
            let plugin = self.pre.instantiate_async(&mut store).await?;
            let configured = plugin
                .bulkhead_policy_policy()
                .call_configure(&mut store, config)
                .await?;
            match configured {
                Ok(hooks) => Ok(Ok((hooks, hook(&mut store, &plugin).await?))),
                Err(reason) => Ok(Err(reason)),
            }
        };
        // The epoch trap fires within a tick of the deadline; the timeout is the backstop for
        // a guest parked in a host call.
        let result = tokio::time::timeout(self.limits.timeout + 2 * TICK, call).await;
        match result {
            Err(_) => Err(Fault::Timeout),
            Ok(Ok(Ok(done))) => Ok(done),
            Ok(Ok(Err(reason))) => Err(Fault::Garbage(format!(
                "configure refused its configuration: {}",
                truncate(&reason)
            ))),
            Ok(Err(e)) => Err(classify(&store, &e)),
        }
    }

    /// Load time: the hooks the plugin wants with `config`, or why it refuses it. Loading is
    /// synchronous (and may run on an async worker thread, as in tests), so the call runs on a
    /// thread of its own with a runtime of its own.
    pub(super) fn configure(&self, config: &str) -> Result<Hooks, Fault> {
        let lost = |what: &str| Fault::Trap(format!("the host thread running configure {what}"));
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    tokio::runtime::Builder::new_current_thread()
                        .enable_time()
                        .build()
                        .map_err(|e| lost(&format!("has no runtime: {e}")))?
                        .block_on(self.run(config, async |_, _| Ok(())))
                        .map(|(hooks, ())| hooks)
                })
                .join()
                .unwrap_or_else(|_| Err(lost("failed")))
        })
    }

    pub(super) async fn on_request(
        &self,
        config: &str,
        request: &RequestView,
    ) -> Result<Verdict, Fault> {
        self.run(config, async |store, p| {
            p.bulkhead_policy_policy()
                .call_on_request(store, request)
                .await
        })
        .await
        .map(|(_, r)| r)
    }

    pub(super) async fn on_disconnect(
        &self,
        config: &str,
        event: &Disconnect,
    ) -> Result<Directive, Fault> {
        self.run(config, async |store, p| {
            p.bulkhead_policy_policy()
                .call_on_disconnect(store, event)
                .await
        })
        .await
        .map(|(_, r)| r)
    }

    pub(super) async fn on_response_end(
        &self,
        config: &str,
        event: &ResponseEnd,
    ) -> Result<(), Fault> {
        self.run(config, async |store, p| {
            p.bulkhead_policy_policy()
                .call_on_response_end(store, event)
                .await
        })
        .await
        .map(|(_, r)| r)
    }
}

fn truncate(s: &str) -> String {
    let mut end = s.len().min(MAX_TRAP_TEXT);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

/// What a failed call means: a refused memory growth, the epoch deadline, or another trap.
fn classify(store: &Store<Host>, e: &wasmtime::Error) -> Fault {
    if store.data().limiter.refused {
        Fault::Memory
    } else if e.downcast_ref::<Trap>() == Some(&Trap::Interrupt) {
        Fault::Timeout
    } else {
        Fault::Trap(truncate(&format!("{e:#}")))
    }
}
