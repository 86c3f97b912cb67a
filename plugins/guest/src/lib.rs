//! Bindings of `bulkhead:policy` (the WIT in `wit/` at the repository root) for Rust guests, and
//! the few helpers every built-in plugin needs. A plugin implements [`Guest`] and exports it:
//!
//! ```ignore
//! struct MyPolicy;
//! impl bulkhead_policy_guest::Guest for MyPolicy { /* … */ }
//! bulkhead_policy_guest::export!(MyPolicy with_types_in bulkhead_policy_guest::bindings);
//! ```

#[cfg(any(test, all(target_family = "wasm", target_os = "unknown")))]
mod heap;

#[cfg(all(target_family = "wasm", target_os = "unknown"))]
#[global_allocator]
static HEAP: heap::Bump<heap::Linear> = heap::Bump::new(heap::Linear);

pub mod bindings {
    wit_bindgen::generate!({
        world: "plugin",
        path: "../../wit",
        pub_export_macro: true,
        export_macro_name: "export",
        default_bindings_module: "bulkhead_policy_guest::bindings",
    });
}

pub use bindings::bulkhead::policy::host::{Level, log};
pub use bindings::bulkhead::policy::types::{
    Denial, Directive, Disconnect, Header, Hooks, Mutations, Outcome, Phase, RequestView,
    ResponseEnd, Tag, Usage, Verdict,
};
pub use bindings::export;
pub use bindings::exports::bulkhead::policy::policy::Guest;

/// Parses a plugin's JSON configuration (the gateway validated it against the plugin's schema
/// already; this is the plugin's own check).
pub fn parse_config<T: serde::de::DeserializeOwned>(json: &str) -> Result<T, String> {
    serde_json::from_str(json).map_err(|e| format!("bad configuration: {e}"))
}

/// Allow, changing nothing.
pub fn allow() -> Verdict {
    Verdict::Allow(Mutations {
        tags: Vec::new(),
        clamp_max_tokens: None,
        add_headers: Vec::new(),
    })
}

/// Deny with `status` (a 4xx) and a message for the client.
pub fn deny(status: u16, message: impl Into<String>) -> Verdict {
    Verdict::Deny(Denial {
        status,
        message: message.into(),
    })
}

/// Where a plugin keeps its parsed configuration between `configure` and the hook call of the
/// same instance.
pub type ConfigSlot<T> = std::cell::RefCell<Option<T>>;

/// Runs `f` with the configuration `configure` stored in `slot`. The gateway always calls
/// `configure` first; a hook called without it traps (the gateway fails the request closed).
pub fn configured<T: 'static, R>(
    slot: &'static std::thread::LocalKey<ConfigSlot<T>>,
    f: impl FnOnce(&T) -> R,
) -> R {
    slot.with(|c| match &*c.borrow() {
        Some(config) => f(config),
        None => panic!("a hook was called before configure"),
    })
}

/// Stores the configuration for [`configured`].
pub fn store<T: 'static>(slot: &'static std::thread::LocalKey<ConfigSlot<T>>, config: T) {
    slot.with(|c| *c.borrow_mut() = Some(config));
}
