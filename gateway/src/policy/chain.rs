//! A loaded policy set: its bindings in order, and which of them apply to a request.

use std::collections::HashSet;
use std::sync::Arc;

use http::HeaderName;

use super::bindings::Hooks;
use super::digest::Digest;
use super::plugin::{Configured, Loaded};

/// One of the hooks a plugin may ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Hook {
    Request,
    Disconnect,
    ResponseEnd,
}

impl Hook {
    const ALL: [Hook; 3] = [Hook::Request, Hook::Disconnect, Hook::ResponseEnd];

    /// Its name in the WIT.
    pub(super) fn name(self) -> &'static str {
        match self {
            Hook::Request => "on-request",
            Hook::Disconnect => "on-disconnect",
            Hook::ResponseEnd => "on-response-end",
        }
    }

    fn flag(self) -> Hooks {
        match self {
            Hook::Request => Hooks::ON_REQUEST,
            Hook::Disconnect => Hooks::ON_DISCONNECT,
            Hook::ResponseEnd => Hooks::ON_RESPONSE_END,
        }
    }
}

/// One entry of the chain: a plugin with its configuration, where it applies, and how it
/// fails.
#[derive(Debug)]
pub(super) struct Binding {
    pub(super) plugin: Arc<Loaded>,
    /// How its calls start: configured from its JSON (valid against the plugin's schema and
    /// accepted by the plugin), once at load or at every call.
    pub(super) configured: Configured,
    /// `None`: every route.
    pub(super) routes: Option<Vec<String>>,
    /// `None`: every tenant.
    pub(super) tenants: Option<HashSet<String>>,
    /// The request headers the plugin sees (never credentials).
    pub(super) headers: Vec<HeaderName>,
    /// A failing call is ignored (logged, counted) rather than failing the request.
    pub(super) fail_open: bool,
    /// The hooks the plugin asked for when configured.
    pub(super) hooks: Hooks,
}

impl Binding {
    fn applies(&self, route: &str, tenant: &str) -> bool {
        self.routes
            .as_ref()
            .is_none_or(|r| r.iter().any(|x| x == route))
            && self.tenants.as_ref().is_none_or(|t| t.contains(tenant))
    }
}

/// A validated, loaded policy set; immutable (a reload builds a new one).
#[derive(Debug)]
pub struct PolicySet {
    pub(super) bindings: Vec<Binding>,
    /// The SHA-256 of the file it was loaded from (none: the empty set).
    source: Option<Digest>,
}

/// What `/policies` shows of one binding.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BindingSummary {
    pub plugin: String,
    pub sha256: Digest,
    /// The pin of the plugin's schema (`null`: not pinned).
    pub schema_sha256: Option<Digest>,
    pub routes: Option<Vec<String>>,
    pub tenants: Option<Vec<String>>,
    pub fail_open: bool,
    pub hooks: Vec<&'static str>,
    /// Its calls start from a snapshot taken after `configure` at load (false: each call
    /// runs `configure`).
    pub snapshot: bool,
}

impl PolicySet {
    pub(super) fn new(bindings: Vec<Binding>, source: Digest) -> PolicySet {
        PolicySet {
            bindings,
            source: Some(source),
        }
    }

    /// No policies: every request passes unchanged.
    pub fn empty() -> PolicySet {
        PolicySet {
            bindings: Vec::new(),
            source: None,
        }
    }

    /// The digest of the file this set came from.
    pub fn source(&self) -> Option<Digest> {
        self.source
    }

    /// The indices of the bindings that apply to a request on `route` of `tenant`, in order.
    pub(super) fn matching(&self, route: &str, tenant: &str) -> Vec<usize> {
        (0..self.bindings.len())
            .filter(|&i| self.bindings[i].applies(route, tenant))
            .collect()
    }

    /// A line for every plugin of the set whose schema the set does not pin.
    pub fn unpinned_schemas(&self) -> Vec<String> {
        let mut seen = HashSet::new();
        self.bindings
            .iter()
            .filter(|b| b.plugin.schema_sha256.is_none() && seen.insert(&*b.plugin.name))
            .map(|b| super::load::unpinned_schema(&b.plugin.name))
            .collect()
    }

    pub fn summary(&self) -> Vec<BindingSummary> {
        self.bindings
            .iter()
            .map(|b| BindingSummary {
                plugin: b.plugin.name.to_string(),
                sha256: b.plugin.digest,
                schema_sha256: b.plugin.schema_sha256,
                routes: b.routes.clone(),
                tenants: b.tenants.as_ref().map(|t| {
                    let mut t: Vec<_> = t.iter().cloned().collect();
                    t.sort();
                    t
                }),
                fail_open: b.fail_open,
                hooks: Hook::ALL
                    .into_iter()
                    .filter(|h| b.hooks.contains(h.flag()))
                    .map(Hook::name)
                    .collect(),
                snapshot: b.configured.is_snapshot(),
            })
            .collect()
    }
}
