//! What one store holds: the plugin's log (its name and its budget of lines), its limiter, the
//! call's clock, and an empty WASI context (no files, no network, no environment, no arguments,
//! no stdio; clocks stopped at 0 and randomness a constant) for guests whose standard library
//! imports WASI 0.2. Also the `host` interface the world imports.

use std::sync::Arc;
use std::time::Duration;

use bulkhead_worker::printable::printable;
use wasmtime::component::ResourceTable;
use wasmtime_wasi::{
    Deterministic, HostMonotonicClock, HostWallClock, WasiCtx, WasiCtxView, WasiView,
};

use super::bindings::{HostImports, Level, TypesHost};
use super::call_clock::CallClock;
use super::limiter::Limiter;
use super::log_budget::{LINES_PER_TENANT, PluginLog};

/// Log lines one call may write; the rest are dropped (a call cannot flood the log, nor, with
/// the tenant's and the plugin's budgets a second, can its calls together).
const MAX_LOG_LINES: u32 = 16;
/// Longest log line kept, in bytes.
const MAX_LOG_BYTES: usize = 1024;
/// The most bytes one `get-random-bytes` call may ask for (more traps); its default, 64 MiB,
/// is allocated on the host, outside the plugin's memory limit. 64 KiB: what a browser's
/// `crypto.getRandomValues` takes.
const MAX_RANDOM_BYTES: u64 = 64 << 10;
/// The most WASI resources (pollables, streams) one call may hold at once; each lives on the
/// host, outside the plugin's memory limit.
const MAX_WASI_RESOURCES: usize = 256;

/// The data of one store (one call of one plugin).
pub(super) struct Host {
    log: Arc<PluginLog>,
    /// Whose request the call is for (`None`: `configure` at load): its lines take from that
    /// tenant's budget.
    tenant: Option<Box<str>>,
    pub(super) limiter: Limiter,
    /// What the call is charged against its deadline, from the store's creation.
    pub(super) clock: CallClock,
    logged: u32,
    /// Built at the guest's first WASI call: a component that imports no WASI (as the
    /// built-ins) never pays for one.
    wasi: Option<WasiCtx>,
    table: ResourceTable,
}

impl std::fmt::Debug for Host {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Host")
            .field("plugin", &self.log.name)
            .field("limiter", &self.limiter)
            .finish_non_exhaustive()
    }
}

impl Host {
    pub(super) fn new(log: Arc<PluginLog>, tenant: Option<&str>, memory_bytes: usize) -> Host {
        let mut table = ResourceTable::new();
        table.set_max_capacity(MAX_WASI_RESOURCES);
        Host {
            log,
            tenant: tenant.map(Into::into),
            limiter: Limiter::new(memory_bytes),
            clock: CallClock::start(),
            logged: 0,
            wasi: None,
            table,
        }
    }
}

impl WasiView for Host {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            // Deny-all: no preopened directory, no environment, no sockets allowed.
            ctx: self.wasi.get_or_insert_with(sealed_wasi),
            table: &mut self.table,
        }
    }
}

/// The WASI context of a call: nothing to reach (no preopened directory, no environment, no
/// sockets allowed, empty stdio), and no way to tell time or one call from another — a
/// plugin's verdict depends on its configuration and the request alone, and a guest sharing
/// the gateway's process gets no timer to measure it with (waits still take real time, under
/// the call's deadline).
fn sealed_wasi() -> WasiCtx {
    let mut builder = WasiCtx::builder();
    builder
        .wall_clock(Stopped)
        .monotonic_clock(Stopped)
        .secure_random(Deterministic::new(vec![0]))
        .insecure_random(Deterministic::new(vec![0]))
        .insecure_random_seed(0)
        .max_random_size(MAX_RANDOM_BYTES)
        // Denied by default in this wasmtime-wasi; said here, so that a version whose default
        // differs changes nothing.
        .allow_tcp(false)
        .allow_udp(false)
        .allow_ip_name_lookup(false);
    builder.build()
}

/// A clock that always reads 0.
struct Stopped;

impl HostWallClock for Stopped {
    fn resolution(&self) -> Duration {
        Duration::from_secs(1)
    }

    fn now(&self) -> Duration {
        Duration::ZERO
    }
}

impl HostMonotonicClock for Stopped {
    fn resolution(&self) -> u64 {
        1_000_000_000
    }

    fn now(&self) -> u64 {
        0
    }
}

impl TypesHost for Host {}

impl HostImports for Host {
    fn log(&mut self, level: Level, message: String) {
        self.logged = self.logged.saturating_add(1);
        if self.logged > MAX_LOG_LINES {
            return;
        }
        let tenant = self.tenant.as_deref();
        let admit = self.log.admit(tenant, std::time::Instant::now());
        let plugin = &*self.log.name;
        if admit.dropped_before > 0 {
            tracing::warn!(
                plugin,
                tenant,
                dropped = admit.dropped_before,
                "the plugin's log lines past {LINES_PER_TENANT} a second for a tenant (or past \
                 the plugin's own budget) were dropped"
            );
        }
        if !admit.write {
            return;
        }
        let message = printable(&message, MAX_LOG_BYTES);
        match level {
            Level::Debug => tracing::debug!(plugin, tenant, "{message}"),
            Level::Info => tracing::info!(plugin, tenant, "{message}"),
            Level::Warn => tracing::warn!(plugin, tenant, "{message}"),
        }
    }

    fn gateway_version(&mut self) -> String {
        env!("CARGO_PKG_VERSION").to_owned()
    }
}
