//! One loaded plugin and its calls. Every call gets a fresh store (its own memory limit and
//! deadline) and a fresh instance from the pool, configured (from the binding's snapshot, or by
//! `configure` with its JSON), then the one hook, all on the calling task. Whatever the guest
//! does, the caller gets a value or a [`Fault`]; nothing it does can panic the gateway.

use std::sync::Arc;
use std::time::Duration;

use bulkhead_worker::printable::printable;
use wasmtime::component::Instance;
use wasmtime::{Store, Trap, UpdateDeadline};

use super::bindings::{
    Directive, Disconnect, Exports, Hooks, Plugin, Ready, RequestView, ResponseEnd, Verdict, call,
};
use super::digest::Digest;
use super::host::Host;
use super::log_budget::PluginLog;
use super::sandbox::{Sandbox, TICK};
use super::snapshot::Snapshotter;

/// The limits of one plugin's calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallLimits {
    /// Linear memory per call, in bytes.
    pub memory_bytes: usize,
    /// Time charged per call (`call_clock.rs`: its waits for a turn on the thread are not):
    /// instantiation, `configure` (unless the binding starts from a snapshot) and the hook
    /// together; at load, instantiation and `configure` (taking the snapshot after it is not
    /// counted).
    pub timeout: Duration,
}

/// How a plugin call failed; every kind fails the request closed unless the binding is
/// fail-open, but [`Fault::Busy`], which refuses the request whatever the binding says (no
/// plugin ran: there is nothing to let through on).
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
    /// `configure` answered with an error: the plugin's own reason.
    #[error("refused its configuration: {0}")]
    Refused(String),
    #[error("found no free instance slot in time")]
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
            Fault::Refused(_) => "refused",
            Fault::Busy => "busy",
        }
    }
}

/// A compiled, pre-instantiated plugin.
pub(super) struct Loaded {
    pub(super) name: Arc<str>,
    pub(super) digest: Digest,
    /// The pin of its configuration schema, if the set gave one.
    pub(super) schema_sha256: Option<Digest>,
    /// Its log lines' budget, shared by all its calls.
    pub(super) log: Arc<PluginLog>,
    ready: Ready,
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

/// How the calls of one binding (a plugin with its configuration) start, chosen at load.
pub(super) enum Configured {
    /// From the plugin's state after `configure`, snapshotted at load: a call instantiates it
    /// and goes straight to its hook.
    Snapshot(Ready),
    /// The plugin cannot be snapshotted: every call instantiates it and runs `configure` with
    /// this JSON before its hook.
    PerCall(Arc<str>),
}

impl std::fmt::Debug for Configured {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Configured::Snapshot(_) => f.write_str("Snapshot"),
            Configured::PerCall(config) => f.debug_tuple("PerCall").field(config).finish(),
        }
    }
}

impl Configured {
    pub(super) fn is_snapshot(&self) -> bool {
        matches!(self, Configured::Snapshot(_))
    }
}

/// The longest trap message kept (the rest of a guest's backtrace is noise in a log).
const MAX_TRAP_TEXT: usize = 512;

/// The most bytes one call of a plugin may have the gateway copy out of it (its answer, or one
/// host call's arguments): far above what a verdict within its own limits holds.
const MAX_COPIED_BYTES: usize = 1 << 20;

/// Component-model handles alive at once in one call's store: the policy world defines no
/// resources, and a WASI guest's are bounded far below this (`host.rs`).
const MAX_HANDLES: usize = 4096;

impl Loaded {
    pub(super) fn new(
        name: Arc<str>,
        digest: Digest,
        schema_sha256: Option<Digest>,
        ready: Ready,
        limits: CallLimits,
        sandbox: Sandbox,
    ) -> Loaded {
        Loaded {
            log: Arc::new(PluginLog::new(name.clone())),
            name,
            digest,
            schema_sha256,
            ready,
            limits,
            sandbox,
        }
    }

    /// A fresh store with the plugin's limits: its memory limit, and a deadline of
    /// [`CallLimits::timeout`] charged from now (`call_clock.rs`). The guest yields to the
    /// runtime at every epoch tick and traps (as [`Fault::Timeout`]) at the first tick past its
    /// deadline.
    /// `tenant`: whose request the call is for (`None`: `configure` at load).
    fn store(&self, tenant: Option<&str>) -> Store<Host> {
        let mut store = Store::new(
            self.sandbox.engine(),
            Host::new(self.log.clone(), tenant, self.limits.memory_bytes),
        );
        store.limiter(|h| &mut h.limiter);
        // What the gateway copies out of one call (a verdict, a log line) is bounded by this,
        // not by wasmtime's default of 128 MiB: strings in a list can all point at the same
        // guest bytes, so a small plugin could make the gateway allocate far beyond its own
        // memory limit.
        store.set_hostcall_fuel(MAX_COPIED_BYTES);
        // Handles a guest makes with `resource.new` live in host memory, outside its memory
        // limit: wasmtime's default allows 100 000 a store.
        store.set_max_component_handles(MAX_HANDLES);
        let clock = store.data().clock.clone();
        let timeout = self.limits.timeout;
        store.set_epoch_deadline(1);
        store.epoch_deadline_callback(move |_| {
            Ok(if clock.over(timeout) {
                UpdateDeadline::Interrupt
            } else {
                UpdateDeadline::YieldCustom(1, clock.yield_turn())
            })
        });
        store
    }

    /// Runs `call` in `store` (from [`Loaded::store`]) on the calling task, within the
    /// plugin's limits: a host call that waits (a WASI clock) is cut off at the deadline too,
    /// by dropping the call.
    async fn limited<R>(
        &self,
        store: &mut Store<Host>,
        call: impl AsyncFnOnce(&mut Store<Host>) -> wasmtime::Result<Result<R, Fault>>,
    ) -> Result<R, Fault> {
        // The epoch trap fires within a tick of the deadline; this is the backstop for a guest
        // parked in a host call.
        let clock = store.data().clock.clone();
        tokio::select! {
            biased;
            answer = call(&mut *store) => match answer {
                Ok(done) => done,
                Err(e) => Err(classify(store, &e)),
            },
            () = clock.spent(self.limits.timeout + 2 * TICK) => Err(Fault::Timeout),
        }
    }

    /// Instantiates the binding's plugin as `configured` says and runs `hook` on the instance
    /// (with where its functions are), within the call's limits ([`Loaded::limited`]).
    async fn run<R>(
        &self,
        configured: &Configured,
        tenant: &str,
        hook: impl AsyncFnOnce(&mut Store<Host>, &Instance, &Exports) -> wasmtime::Result<R>,
    ) -> Result<R, Fault> {
        self.limited(&mut self.store(Some(tenant)), async |store| {
            let (instance, exports) = match configured {
                Configured::Snapshot(ready) => {
                    (ready.instantiate(&mut *store).await?, &ready.exports)
                }
                Configured::PerCall(config) => {
                    let instance = self.ready.instantiate(&mut *store).await?;
                    let exports = &self.ready.exports;
                    let answer: (Result<Hooks, String>,) =
                        call(store, &instance, &exports.configure, (&**config,)).await?;
                    if let (Err(reason),) = answer {
                        return Ok(Err(refused(&reason)));
                    }
                    (instance, exports)
                }
            };
            Ok(Ok(hook(store, &instance, exports).await?))
        })
        .await
    }

    /// Load time: a fresh instance of the plugin in `store`, its every function's type checked,
    /// configured with `config`: the hooks it asked for, or its refusal.
    async fn configure_in(
        &self,
        store: &mut Store<Host>,
        config: &str,
    ) -> wasmtime::Result<Result<Hooks, Fault>> {
        let plugin: Plugin = self.ready.pre.instantiate_async(&mut *store).await?;
        let answer = plugin
            .bulkhead_policy_policy()
            .call_configure(&mut *store, config)
            .await?;
        Ok(answer.map_err(|reason| refused(&reason)))
    }

    /// Load time: the hooks the plugin wants with `config` and how the binding's calls start,
    /// or why the plugin refuses `config`. With a `snapshotter` (the plugin can be
    /// snapshotted), it is configured once here and its calls start from the snapshot; without
    /// one, or when the snapshot cannot be used, they run `configure` each. Loading is
    /// synchronous (and may run on an async worker thread, as in tests), so the call runs on a
    /// thread of its own with a runtime of its own.
    pub(super) fn configure(
        &self,
        config: &str,
        snapshotter: Option<&Snapshotter>,
    ) -> Result<(Hooks, Configured), Fault> {
        let lost = |what: &str| Fault::Trap(format!("the host thread running configure {what}"));
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    tokio::runtime::Builder::new_current_thread()
                        .enable_time()
                        .build()
                        .map_err(|e| lost(&format!("has no runtime: {e}")))?
                        .block_on(self.configure_once(config, snapshotter))
                })
                .join()
                .unwrap_or_else(|_| Err(lost("failed")))
        })
    }

    async fn configure_once(
        &self,
        config: &str,
        snapshotter: Option<&Snapshotter>,
    ) -> Result<(Hooks, Configured), Fault> {
        let per_call = || Configured::PerCall(config.into());
        // The store's instance takes a slot, until the snapshot is read out of it (not while
        // the snapshot compiles, which may take seconds).
        let slot = self.sandbox.slot_for_load().await?;
        let mut store = self.store(None);
        let Some(snapshotter) = snapshotter else {
            let hooks = self
                .limited(&mut store, async |store| {
                    self.configure_in(store, config).await
                })
                .await?;
            return Ok((hooks, per_call()));
        };
        let (hooks, instance) = self
            .limited(&mut store, async |store| {
                Ok(snapshotter
                    .configure(store, config)
                    .await?
                    .map_err(|reason| refused(&reason)))
            })
            .await?;
        // The snapshot copies the plugin's whole memory out (a Python guest's is over 10 MiB):
        // bounded by its memory limit here, not by what one call's answer may copy.
        store.set_hostcall_fuel(self.limits.memory_bytes.saturating_add(MAX_COPIED_BYTES));
        let snapshot = snapshotter.snapshot(&mut store, instance).await;
        drop(store);
        drop(slot);
        let prepared = snapshot.and_then(|bytes| {
            self.sandbox
                .prepare(&bytes, &Digest::of(&bytes))
                .map(|(pre, _)| pre)
                .map_err(|e| e.to_string())
        });
        match prepared {
            Ok(pre) => Ok((hooks, Configured::Snapshot(pre))),
            Err(reason) => {
                tracing::warn!(plugin = %self.name, %reason,
                    "a policy plugin's configured state cannot be snapshotted; every call \
                     configures it");
                Ok((hooks, per_call()))
            }
        }
    }

    pub(super) async fn on_request(
        &self,
        configured: &Configured,
        request: &RequestView,
    ) -> Result<Verdict, Fault> {
        self.run(
            configured,
            &request.tenant,
            async |store, instance, exports| {
                let (verdict,) = call(store, instance, &exports.on_request, (request,)).await?;
                Ok(verdict)
            },
        )
        .await
    }

    pub(super) async fn on_disconnect(
        &self,
        configured: &Configured,
        event: &Disconnect,
    ) -> Result<Directive, Fault> {
        self.run(
            configured,
            &event.tenant,
            async |store, instance, exports| {
                let (directive,) = call(store, instance, &exports.on_disconnect, (event,)).await?;
                Ok(directive)
            },
        )
        .await
    }

    pub(super) async fn on_response_end(
        &self,
        configured: &Configured,
        event: &ResponseEnd,
    ) -> Result<(), Fault> {
        self.run(
            configured,
            &event.tenant,
            async |store, instance, exports| {
                call(store, instance, &exports.on_response_end, (event,)).await
            },
        )
        .await
    }
}

#[cfg(test)]
impl Loaded {
    /// What the gateway never does: `requests`, one after the other, in one instance (tests
    /// show what a plugin would carry from one call to the next).
    pub(super) async fn on_requests_in_one_instance(
        &self,
        configured: &Configured,
        requests: &[RequestView],
    ) -> Result<Vec<Verdict>, Fault> {
        let tenant = requests.first().map_or("", |r| r.tenant.as_str());
        self.run(configured, tenant, async |store, instance, exports| {
            let mut verdicts = Vec::new();
            for request in requests {
                let (verdict,) = call(store, instance, &exports.on_request, (request,)).await?;
                verdicts.push(verdict);
            }
            Ok(verdicts)
        })
        .await
    }
}

/// A plugin's refusal of its configuration, as a fault.
fn refused(reason: &str) -> Fault {
    Fault::Refused(printable(reason, MAX_TRAP_TEXT))
}

/// What a failed call means: a refused memory growth, the epoch deadline, or another trap.
fn classify(store: &Store<Host>, e: &wasmtime::Error) -> Fault {
    if store.data().limiter.refused {
        Fault::Memory
    } else if e.is::<wasmtime::PoolConcurrencyLimitError>() {
        // The pool, not the plugin: the sandbox is busy.
        Fault::Busy
    } else if e.downcast_ref::<Trap>() == Some(&Trap::Interrupt) {
        Fault::Timeout
    } else {
        // The trap itself, not the chain around it: that opens with wasmtime's backtrace of
        // the guest's frames, lines of addresses that pushed the cause past any bound.
        let cause = e
            .downcast_ref::<Trap>()
            .map_or_else(|| e.root_cause().to_string(), Trap::to_string);
        Fault::Trap(printable(&cause, MAX_TRAP_TEXT))
    }
}
