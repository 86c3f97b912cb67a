//! The engine every plugin runs in: the component model, the pooling allocator, epoch
//! interruption (a background thread advances the epoch every [`TICK`]), one linker offering
//! the world's `host` imports and an empty WASI, and the instance slots in front of
//! instantiation, shared fairly between tenants ([`Slots`]).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use wasmtime::component::{Component, Linker};
use wasmtime::{Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig};

use super::bindings::{Plugin, PluginPre, Ready};
use super::cache::{self, Compiled};
use super::contract;
use super::digest::Digest;
use super::host::Host;
use super::plugin::Fault;
use super::slots::{Holder, Slot, Slots, Turn};

/// How much of a freed instance's linear memory, and of its tables, stays resident (zeroed
/// in place) for the next instance in its slot, instead of handed back to the kernel and
/// faulted in again — page faults and TLB shootdowns were most of a call's cost. It covers
/// the whole memory of the built-ins (one 64 KiB page: scripts/build-plugins gives them a
/// 32 KiB stack); a larger guest is zeroed this far and decommitted beyond. (Resetting only
/// the pages a call wrote, found by the `PAGEMAP_SCAN` ioctl, measured slower for memories
/// this small: the ioctl costs more than the memset it saves.)
const KEEP_RESIDENT_BYTES: usize = 256 << 10;

/// How often the epoch advances: the granularity of every call's deadline.
pub const TICK: Duration = Duration::from_millis(2);

/// The longest a call waits for an instance slot before failing as [`Fault::Busy`].
pub const SLOT_WAIT: Duration = Duration::from_secs(1);

/// How long a request's `on-response-end` waits for an instance slot: longer than a call,
/// since nobody waits for it, and, not first in line behind the calls of tenants holding
/// fewer slots, it would otherwise be dropped (its usage unaccounted) by a busy gateway; half
/// the default drain timeout, so that one spawned as shutdown begins still runs within it.
pub const END_WAIT: Duration = Duration::from_secs(5);

/// Limits of the whole sandbox, fixed for the gateway's lifetime (a reload keeps them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxSettings {
    /// Plugin instances alive at once (the pool's size, and the number of slots).
    pub instances: u32,
    /// The most linear memory any plugin may be given, in bytes.
    pub max_memory_bytes: usize,
    /// Where compiled components are cached; `None`: compile at every load.
    pub cache_dir: Option<PathBuf>,
    /// The most the cache's entries may take on disk once a set has loaded: the least recently
    /// used go first, never one the active set uses.
    pub cache_max_bytes: u64,
}

impl Default for SandboxSettings {
    fn default() -> SandboxSettings {
        SandboxSettings {
            instances: 64,
            max_memory_bytes: 256 << 20,
            cache_dir: None,
            cache_max_bytes: 1 << 30,
        }
    }
}

/// Why the sandbox cannot be built or a component not compiled: wasmtime's error chain on
/// one line (its causes may print over several, which would break the log line and the
/// reload answer).
#[derive(Debug)]
pub struct SandboxError(wasmtime::Error);

impl std::fmt::Display for SandboxError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let text = format!("{:#}", self.0);
        let mut words = text.split_whitespace();
        if let Some(first) = words.next() {
            f.write_str(first)?;
        }
        words.try_for_each(|w| write!(f, " {w}"))
    }
}

impl std::error::Error for SandboxError {}

/// The engine, the linker and the instance slots, shared by every policy set.
#[derive(Clone)]
pub(super) struct Sandbox {
    engine: Engine,
    linker: Arc<Linker<Host>>,
    slots: Slots,
    pub(super) settings: SandboxSettings,
}

impl std::fmt::Debug for Sandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sandbox")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl Sandbox {
    pub(super) fn new(settings: SandboxSettings) -> Result<Sandbox, SandboxError> {
        let mut pool = PoolingAllocationConfig::new();
        let n = settings.instances.max(1);
        // Guests in Python or JavaScript bring several core modules, memories and large
        // tables; Rust and C guests need one of each.
        pool.total_component_instances(n)
            .total_core_instances(n.saturating_mul(64))
            .total_memories(n.saturating_mul(4))
            .total_tables(n.saturating_mul(8))
            .max_core_instances_per_component(64)
            .max_memories_per_component(4)
            .max_tables_per_component(8)
            .max_core_instance_size(4 << 20)
            .table_elements(100_000)
            .max_memory_size(settings.max_memory_bytes)
            // Every call runs on a fiber of its own: one stack per slot (the default, 1000,
            // made the 1001st concurrent call fail past its slot, as if its plugin trapped).
            .total_stacks(n)
            .linear_memory_keep_resident(KEEP_RESIDENT_BYTES)
            .table_keep_resident(KEEP_RESIDENT_BYTES);
        let mut config = Config::new();
        config
            .wasm_component_model(true)
            .epoch_interruption(true)
            .memory_reservation(settings.max_memory_bytes as u64)
            .memory_reservation_for_growth(0)
            .allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
        let engine = Engine::new(&config).map_err(SandboxError)?;
        let mut linker = Linker::<Host>::new(&engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker).map_err(SandboxError)?;
        Plugin::add_to_linker::<Host, wasmtime::component::HasSelf<Host>>(&mut linker, |h| h)
            .map_err(SandboxError)?;
        spawn_ticker(&engine).map_err(|e| SandboxError(e.into()))?;
        Ok(Sandbox {
            engine,
            linker: Arc::new(linker),
            slots: Slots::new(n as usize),
            settings,
        })
    }

    /// An instance slot for a call of `tenant`'s in its `turn`, waiting at most [`SLOT_WAIT`]
    /// for one to be free, or [`END_WAIT`] for an end (when slots are short, the tenant
    /// holding the fewest goes first, and of those an end). Plugin calls run on the async
    /// worker that holds it: they are asynchronous and yield at every epoch tick, so a slow
    /// plugin never blocks the runtime's threads.
    pub(super) async fn slot(&self, tenant: &str, turn: Turn) -> Result<Slot, Fault> {
        let wait = match turn {
            Turn::End => END_WAIT,
            Turn::Call => SLOT_WAIT,
        };
        self.slots
            .acquire(Holder::Tenant(tenant.into()), turn, Some(wait))
            .await
            .ok_or(Fault::Busy)
    }

    /// An instance slot for loading a set, waiting as long as calls hold every slot (each
    /// ends by its deadline): a reload under load neither fails for want of one nor takes
    /// the one a call was promised.
    pub(super) async fn slot_for_load(&self) -> Result<Slot, Fault> {
        self.slots
            .acquire(Holder::Load, Turn::Call, None)
            .await
            .ok_or(Fault::Busy)
    }

    pub(super) fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Compiles (or reads from the cache) and pre-instantiates a component: every import is
    /// resolved now, so a per-call instantiation only allocates.
    pub(super) fn prepare(
        &self,
        bytes: &[u8],
        digest: &Digest,
    ) -> Result<(Ready, Compiled), SandboxError> {
        if let Some(why) = contract::not_a_component(bytes) {
            return Err(SandboxError(wasmtime::format_err!("{why}")));
        }
        let (component, compiled) = cache::compile(
            &self.engine,
            bytes,
            digest,
            self.settings.cache_dir.as_deref(),
        )
        .map_err(SandboxError)?;
        let ready = self.pre(&component).map_err(|e| {
            SandboxError(match contract::mismatch(&self.engine, &component) {
                Some(why) => e.context(why),
                None => e,
            })
        })?;
        Ok((ready, compiled))
    }

    /// Keeps the compile cache within its bound once a set has loaded; the entries used since
    /// `used_since` (the load's start) stay.
    pub(super) fn prune_cache(&self, used_since: SystemTime) {
        let Some(dir) = self.settings.cache_dir.as_deref().and_then(cache::trusted) else {
            return;
        };
        match cache::prune(&dir, self.settings.cache_max_bytes, used_since) {
            Ok(p) if p.entries > 0 => tracing::info!(dir = %dir.display(), evicted = p.entries,
                bytes = p.bytes, "policy compile cache pruned"),
            Ok(_) => {}
            Err(e) => tracing::warn!(dir = %dir.display(), error = %e,
                "cannot prune the policy compile cache"),
        }
    }

    fn pre(&self, component: &Component) -> wasmtime::Result<Ready> {
        Ready::new(PluginPre::new(self.linker.instantiate_pre(component)?)?)
    }
}

/// Advances `engine`'s epoch every [`TICK`] until the engine is gone. Without it no deadline
/// would ever fire, so failing to start it fails the sandbox.
fn spawn_ticker(engine: &Engine) -> std::io::Result<()> {
    let weak = engine.weak();
    std::thread::Builder::new()
        .name("policy-epoch".into())
        .spawn(move || {
            while let Some(engine) = weak.upgrade() {
                engine.increment_epoch();
                drop(engine);
                std::thread::sleep(TICK);
            }
        })
        .map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_compile_error_is_told_on_one_line() {
        let inner = wasmtime::format_err!("bad magic number - expected=[\n    0x0,\n    0x61,\n]");
        let e = SandboxError(inner.context("failed to parse WebAssembly module"));
        assert_eq!(
            e.to_string(),
            "failed to parse WebAssembly module: bad magic number - expected=[ 0x0, 0x61, ]"
        );
    }
}
