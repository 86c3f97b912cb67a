//! Pre-initialised plugins. A binding's `configure` runs once, at load, in an instance of its
//! plugin that Wizer has instrumented to show its memories and globals; Wizer then writes that
//! configured state into a new component (its data segments and global initialisers), and
//! every call of the binding instantiates that: a fresh instance, already configured, that no
//! call has touched before. No call parses the binding's configuration again.
//!
//! Only a plugin that imports nothing but the world's own interfaces is snapshotted: its
//! configured state then depends on its configuration alone (`host` gives it a version string
//! and a log). A plugin that imports WASI could have drawn on a clock or on randomness in
//! `configure`, and a snapshot would replay that one draw in every call; it, and a plugin
//! Wizer cannot rewrite, runs `configure` at every call instead.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use futures_util::FutureExt;
use wasmtime::component::{ComponentType, Instance, Lift, WasmList};
use wasmtime::{Store, UpdateDeadline};
use wasmtime_wizer::{ComponentInstanceState, Wizer};

use super::bindings::{Hooks, Plugin, PluginPre, Ready};
use super::digest::Digest;
use super::host::Host;
use super::sandbox::Sandbox;

/// The prefix of the world's own interfaces (`host` and `types`, of any 0.1.x).
const WORLD: &str = "bulkhead:policy/";

/// What snapshots one plugin: Wizer, the plugin as built, and the plugin instrumented.
pub(super) struct Snapshotter {
    wizer: Wizer,
    /// The component as built: each snapshot is a rewrite of it.
    bytes: Arc<[u8]>,
    /// The component instrumented to export its memories and globals, pre-instantiated.
    instrumented: Ready,
}

impl Snapshotter {
    /// A snapshotter for the plugin `bytes`, pre-instantiated as `pre`; or why it cannot be
    /// snapshotted.
    pub(super) fn new(
        sandbox: &Sandbox,
        pre: &PluginPre<Host>,
        bytes: &[u8],
    ) -> Result<Snapshotter, String> {
        let component = pre.instance_pre().component();
        if let Some((name, _)) = component
            .component_type()
            .imports(sandbox.engine())
            .find(|(name, _)| !name.starts_with(WORLD))
        {
            return Err(format!(
                "it imports {name}, which its configure may have drawn on"
            ));
        }
        let mut wizer = Wizer::new();
        // The snapshot keeps exporting `configure`: the world requires it (no call uses it).
        wizer.keep_init_func(true);
        let instrumented = std::panic::catch_unwind(AssertUnwindSafe(|| {
            wizer.instrument_component(bytes).map(|(_, wasm)| wasm)
        }))
        .map_err(|_| "Wizer panicked instrumenting it".to_owned())?
        .map_err(|e| format!("Wizer cannot instrument it: {e:#}"))?;
        let (instrumented, _) = sandbox
            .prepare(&instrumented, &Digest::of(&instrumented))
            .map_err(|e| format!("its instrumented component does not load: {e}"))?;
        Ok(Snapshotter {
            wizer,
            bytes: bytes.into(),
            instrumented,
        })
    }

    /// Runs `configure` with `config` in a fresh instrumented instance in `store`: the hooks
    /// the plugin asked for and the configured instance; `Err(reason)`: it refused `config`.
    pub(super) async fn configure(
        &self,
        store: &mut Store<Host>,
        config: &str,
    ) -> wasmtime::Result<Result<(Hooks, Instance), String>> {
        // Not `PluginPre::instantiate_async`, as a per-call instance is made: Wizer reads the
        // state through the untyped `Instance`, which that does not return.
        let instance = self
            .instrumented
            .pre
            .instance_pre()
            .instantiate_async(&mut *store)
            .await?;
        let plugin = Plugin::new(&mut *store, &instance)?;
        let answer = plugin
            .bulkhead_policy_policy()
            .call_configure(&mut *store, config)
            .await?;
        Ok(answer.map(|hooks| (hooks, instance)))
    }

    /// The component whose instances start in the state `instance` (configured, in `store`)
    /// is in now, or why none could be made. The plugin's own code has finished: what runs in
    /// the instance from here is only the instrumentation's reads of its memories and globals,
    /// and, with Wizer's scan of a large memory (a Python guest's is tens of MB) between
    /// them, the whole may outlast the plugin's call deadline, so the store's deadline no
    /// longer interrupts. Wizer's panics are errors here: a component it cannot rewrite makes
    /// its binding configure per call, and never takes the gateway down.
    pub(super) async fn snapshot(
        &self,
        store: &mut Store<Host>,
        instance: Instance,
    ) -> Result<Vec<u8>, String> {
        store.epoch_deadline_callback(|_| Ok(UpdateDeadline::Yield(1)));
        AssertUnwindSafe(self.rewrite(store, instance))
            .catch_unwind()
            .await
            .unwrap_or_else(|_| Err("Wizer panicked taking its snapshot".into()))
    }

    async fn rewrite(
        &self,
        store: &mut Store<Host>,
        instance: Instance,
    ) -> Result<Vec<u8>, String> {
        // The context borrows the bytes it parsed, so it is parsed again here (a fraction of
        // a millisecond for the Rust and C guests that can be snapshotted).
        let (cx, _) = self
            .wizer
            .instrument_component(&self.bytes)
            .map_err(|e| format!("{e:#}"))?;
        let mut probe = Probe {
            store,
            instance,
            failed: None,
        };
        let rewritten = self
            .wizer
            .snapshot_component(&cx, &mut probe)
            .await
            .map_err(|e| format!("{e:#}"))?;
        match probe.failed {
            Some(e) => Err(format!("reading its state failed: {e:#}")),
            None => Ok(rewritten),
        }
    }
}

#[cfg(test)]
impl Snapshotter {
    /// What no load builds: a snapshotter whose instrumented plugin is the plugin as built
    /// (`pre`), so `configure` runs but every read of the state fails (nothing exports it):
    /// for tests of a plugin whose snapshot cannot be taken.
    pub(super) fn with_unreadable_state(pre: &Ready, bytes: &[u8]) -> Snapshotter {
        let mut wizer = Wizer::new();
        wizer.keep_init_func(true);
        Snapshotter {
            wizer,
            bytes: bytes.into(),
            instrumented: pre.clone(),
        }
    }
}

/// Reads an instrumented instance's state for Wizer through the exports instrumenting added.
/// Wizer's interface has no room for an error, so the first one is kept here (the snapshot is
/// then discarded) and the reads after it answer zeros.
struct Probe<'a> {
    store: &'a mut Store<Host>,
    instance: Instance,
    failed: Option<wasmtime::Error>,
}

impl Probe<'_> {
    /// Calls `func` of the exported instance `group`, which takes nothing and returns an `R`.
    async fn call<R>(&mut self, group: &str, func: &str) -> Option<R>
    where
        R: ComponentType + Lift + Send + Sync + 'static,
    {
        if self.failed.is_some() {
            return None;
        }
        let missing = || wasmtime::Error::msg(format!("no export {group}#{func}"));
        let answer = async {
            let g = self
                .instance
                .get_export_index(&mut *self.store, None, group)
                .ok_or_else(missing)?;
            let f = self
                .instance
                .get_export_index(&mut *self.store, Some(&g), func)
                .ok_or_else(missing)?;
            let f = self
                .instance
                .get_typed_func::<(), (R,)>(&mut *self.store, f)?;
            Ok(f.call_async(&mut *self.store, ()).await?.0)
        }
        .await;
        answer.map_err(|e| self.failed = Some(e)).ok()
    }
}

impl ComponentInstanceState for Probe<'_> {
    async fn call_func_ret_list_u8(
        &mut self,
        instance: &str,
        func: &str,
        contents: impl FnOnce(&[u8]) + Send,
    ) {
        match self.call::<WasmList<u8>>(instance, func).await {
            Some(list) => contents(list.as_le_slice(&*self.store)),
            None => contents(&[]),
        }
    }

    async fn call_func_ret_s32(&mut self, instance: &str, func: &str) -> i32 {
        self.call(instance, func).await.unwrap_or_default()
    }

    async fn call_func_ret_s64(&mut self, instance: &str, func: &str) -> i64 {
        self.call(instance, func).await.unwrap_or_default()
    }

    async fn call_func_ret_f32(&mut self, instance: &str, func: &str) -> u32 {
        self.call::<f32>(instance, func)
            .await
            .map_or(0, f32::to_bits)
    }

    async fn call_func_ret_f64(&mut self, instance: &str, func: &str) -> u64 {
        self.call::<f64>(instance, func)
            .await
            .map_or(0, f64::to_bits)
    }
}
