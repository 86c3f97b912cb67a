//! What one store holds: the plugin's name (for its log lines), its limiter, and an empty WASI
//! context (no files, no network, no environment, no arguments, no stdio) for guests whose
//! standard library imports WASI 0.2. Also the `host` interface the world imports.

use std::sync::Arc;

use wasmtime::component::ResourceTable;
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use super::bindings::{HostImports, Level, TypesHost};
use super::limiter::Limiter;

/// Log lines one call may write; the rest are dropped (a plugin cannot flood the log).
const MAX_LOG_LINES: u32 = 16;
/// Longest log line kept, in bytes.
const MAX_LOG_BYTES: usize = 1024;

/// The data of one store (one call of one plugin).
pub(super) struct Host {
    pub(super) plugin: Arc<str>,
    pub(super) limiter: Limiter,
    logged: u32,
    /// Built at the guest's first WASI call: a component that imports no WASI (as the
    /// built-ins) never pays for one.
    wasi: Option<WasiCtx>,
    table: ResourceTable,
}

impl std::fmt::Debug for Host {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Host")
            .field("plugin", &self.plugin)
            .field("limiter", &self.limiter)
            .finish_non_exhaustive()
    }
}

impl Host {
    pub(super) fn new(plugin: Arc<str>, memory_bytes: usize) -> Host {
        Host {
            plugin,
            limiter: Limiter::new(memory_bytes),
            logged: 0,
            wasi: None,
            table: ResourceTable::new(),
        }
    }
}

impl WasiView for Host {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            // Deny-all: no preopened directory, no environment, no sockets allowed.
            ctx: self.wasi.get_or_insert_with(|| WasiCtx::builder().build()),
            table: &mut self.table,
        }
    }
}

impl TypesHost for Host {}

impl HostImports for Host {
    fn log(&mut self, level: Level, message: String) {
        self.logged = self.logged.saturating_add(1);
        if self.logged > MAX_LOG_LINES {
            return;
        }
        let mut end = message.len().min(MAX_LOG_BYTES);
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        let message = &message[..end];
        let plugin = &*self.plugin;
        match level {
            Level::Debug => tracing::debug!(plugin, "{message}"),
            Level::Info => tracing::info!(plugin, "{message}"),
            Level::Warn => tracing::warn!(plugin, "{message}"),
        }
    }

    fn gateway_version(&mut self) -> String {
        env!("CARGO_PKG_VERSION").to_owned()
    }
}
