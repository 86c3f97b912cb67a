//! Policy plugins: WebAssembly components (any language) that see each request and decide.
//!
//! ```text
//!  wit/policy.wit (bulkhead:policy@0.1.x) ── the contract
//!  policies/*.toml ──load──▶ PolicySet: [Binding(plugin pinned by sha256, JSON config checked
//!                    (file)   against the plugin's schema, routes, tenants, fail-open)]
//!                               │ swapped whole on reload (admin call or file change)
//!  request ─▶ on-request chain ─▶ allow (tags, clamp max tokens, response headers) | deny
//!  client gone ─▶ on-disconnect ─▶ abort now | hold until prefill / first token / complete
//!  end ─▶ on-response-end (usage, outcome)
//! ```
//!
//! Every call runs in a fresh store and instance (pooling allocator, `InstancePre`), with a
//! memory limit, an epoch deadline and one of the sandbox's instance slots (which a tenant
//! flooding the gateway cannot keep from the others). The instance starts configured: from a
//! snapshot of the plugin taken after its binding's `configure` at load, or, for a
//! plugin that imports WASI, by running `configure` first. A plugin that traps, runs
//! past its deadline, exceeds its memory or returns garbage fails the request closed
//! (500 `policy_error`) unless its binding is fail-open; one that finds no free slot in time
//! refuses it as busy (429, retryable), fail-open or not (a tenant that fills the sandbox must
//! not skip its own policies). Plugins get no files, no network, no
//! environment: only the world's `host` interface (a bounded log) and an empty WASI.

mod abandon;
mod bindings;
mod cache;
mod call_clock;
mod chain;
mod contract;
mod decision;
mod digest;
mod handle;
mod host;
mod limiter;
mod load;
mod log_budget;
mod plugin;
mod request;
mod sandbox;
mod slots;
mod snapshot;
mod stats;
mod verdict;

pub use abandon::{Charge, Progress};
pub use cache::Compiled;
pub use chain::{BindingSummary, PolicySet};
pub use decision::{Decision, DecisionVerdict};
pub use digest::Digest;
pub use handle::{Policies, PolicyError, PolicySettings};
pub use load::{LoadError, ROUTES};
pub use plugin::{CallLimits, Fault};
pub use request::{Refusal, Refused, RequestFacts, RequestPolicy};
pub use sandbox::{SLOT_WAIT, SandboxError, SandboxSettings, TICK};

#[cfg(test)]
mod tests;
