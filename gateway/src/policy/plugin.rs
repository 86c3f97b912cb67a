//! One loaded plugin and its calls. Every call gets a fresh store (its own memory limit and
//! deadline), a fresh instance from the pool, then `configure` and the one hook. Whatever the
//! guest does, the caller gets a value or a [`Fault`]; nothing it does can panic the gateway.

use std::sync::Arc;
use std::time::Duration;

use wasmtime::{Store, Trap};

use super::bindings::{Directive, Disconnect, Hooks, PluginPre, RequestView, ResponseEnd, Verdict};
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

    /// Instantiates, configures with `config` and runs `hook`, all within the call's limits.
    /// Synchronous, and must run off the async worker threads (WASI's synchronous bindings
    /// block on the runtime): on the blocking pool, see [`Sandbox::offload`].
    fn run<R>(
        &self,
        config: &str,
        hook: impl FnOnce(&mut Store<Host>, &super::bindings::Plugin) -> wasmtime::Result<R>,
    ) -> Result<(Hooks, R), Fault> {
        let mut store = Store::new(
            self.sandbox.engine(),
            Host::new(self.name.clone(), self.limits.memory_bytes),
        );
        store.limiter(|h| &mut h.limiter);
        let ticks = self.limits.timeout.as_micros().div_ceil(TICK.as_micros()) + 1;
        store.set_epoch_deadline(u64::try_from(ticks).unwrap_or(u64::MAX));
        store.epoch_deadline_trap();
        let result = (|| {
            let plugin = self.pre.instantiate(&mut store)?;
            let configured = plugin
                .bulkhead_policy_policy()
                .call_configure(&mut store, config)?;
            match configured {
                Ok(hooks) => Ok(Ok((hooks, hook(&mut store, &plugin)?))),
                Err(reason) => Ok(Err(reason)),
            }
        })();
        match result {
            Ok(Ok(done)) => Ok(done),
            Ok(Err(reason)) => Err(Fault::Garbage(format!(
                "configure refused its configuration: {}",
                truncate(&reason)
            ))),
            Err(e) => Err(classify(&store, &e)),
        }
    }

    /// Load time: the hooks the plugin wants with `config`, or why it refuses it.
    pub(super) fn configure(&self, config: &str) -> Result<Hooks, Fault> {
        self.run(config, |_, _| Ok(())).map(|(hooks, ())| hooks)
    }

    pub(super) fn on_request(&self, config: &str, request: &RequestView) -> Result<Verdict, Fault> {
        self.run(config, |store, p| {
            p.bulkhead_policy_policy().call_on_request(store, request)
        })
        .map(|(_, r)| r)
    }

    pub(super) fn on_disconnect(
        &self,
        config: &str,
        event: &Disconnect,
    ) -> Result<Directive, Fault> {
        self.run(config, |store, p| {
            p.bulkhead_policy_policy().call_on_disconnect(store, event)
        })
        .map(|(_, r)| r)
    }

    pub(super) fn on_response_end(&self, config: &str, event: &ResponseEnd) -> Result<(), Fault> {
        self.run(config, |store, p| {
            p.bulkhead_policy_policy()
                .call_on_response_end(store, event)
        })
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
