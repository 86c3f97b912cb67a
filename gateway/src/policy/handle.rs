//! [`Policies`]: the gateway's handle on the active policy set. A reload (admin call or file
//! change) loads and validates a whole new set first and swaps it in only when it is good;
//! requests in flight keep the set they started with (they hold an `Arc` of it), and a bad
//! new set leaves the old one active and says why.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use super::chain::PolicySet;
use super::digest::Digest;
use super::load::{self, LoadError};
use super::plugin::Fault;
use super::sandbox::{Sandbox, SandboxError, SandboxSettings};
use super::slots::{Slot, Turn};
use super::stats::Stats;

/// How the gateway runs its policies (from the `[policies]` section of its configuration).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicySettings {
    /// The policy set file.
    pub file: PathBuf,
    pub sandbox: SandboxSettings,
    /// How often the file is checked for a change; `None`: only the admin call reloads.
    pub watch_interval: Option<Duration>,
    /// The longest the gateway keeps an abandoned request from its disconnect: deciding on
    /// it (the policies' turn and instance slot), then reading its stream for a hold
    /// directive.
    pub hold_limit: Duration,
    /// The most abandoned requests of one tenant held at once, whatever the policies say (or
    /// a failing one's default): past it, a request whose client left is dropped at once.
    pub max_held_per_tenant: u32,
}

/// Why policies cannot be loaded or reloaded.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error("the policy sandbox cannot start: {0}")]
    Sandbox(#[from] SandboxError),
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error("policies are not configured (no [policies] in the gateway configuration)")]
    Disabled,
}

/// The active policy set and what every request needs besides it; a cheap `Clone`.
#[derive(Debug, Clone)]
pub struct Policies {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// `None` when policies are disabled.
    runtime: Option<(Sandbox, PolicySettings)>,
    current: RwLock<Arc<PolicySet>>,
    /// Why the last reload was refused (cleared by a good one).
    last_error: Mutex<Option<String>>,
    /// The digest of the file as the last load or reload read it (`None`: it could not be
    /// read): what the watcher compares the file with, whoever asked for that reload.
    tried: Mutex<Option<Digest>>,
    /// One reload at a time.
    reloading: Mutex<()>,
    /// tenant → abandoned requests held now.
    held: Mutex<HashMap<String, u32>>,
    /// tenant → the turn its disconnect decisions take ([`Policies::deciding`]); an entry is
    /// kept while a decision holds or waits for it.
    deciding: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Requests' ends running in tasks (holds, `on-response-end`): shutdown waits for them.
    ends: tokio::sync::watch::Sender<usize>,
    stats: Stats,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Policies {
    /// No policies: every request passes unchanged; disconnects abort at once.
    pub fn disabled() -> Policies {
        Policies::new(None, PolicySet::empty())
    }

    /// Starts the sandbox and loads the set in `settings.file` (blocking: compiles).
    pub fn load(settings: PolicySettings) -> Result<Policies, PolicyError> {
        let sandbox = Sandbox::new(settings.sandbox.clone())?;
        let set = load::load(&sandbox, &settings.file)?;
        Ok(Policies::new(Some((sandbox, settings)), set))
    }

    fn new(runtime: Option<(Sandbox, PolicySettings)>, set: PolicySet) -> Policies {
        Policies {
            inner: Arc::new(Inner {
                runtime,
                tried: Mutex::new(set.source()),
                current: RwLock::new(Arc::new(set)),
                last_error: Mutex::new(None),
                reloading: Mutex::new(()),
                held: Mutex::new(HashMap::new()),
                deciding: Mutex::new(HashMap::new()),
                ends: tokio::sync::watch::Sender::new(0),
                stats: Stats::default(),
            }),
        }
    }

    /// The active set (requests keep it until they end).
    pub fn current(&self) -> Arc<PolicySet> {
        self.inner
            .current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    pub(super) fn stats(&self) -> &Stats {
        &self.inner.stats
    }

    /// An instance slot of the sandbox for a call of `tenant`'s in its `turn` (see
    /// [`Sandbox::slot`]); policies that are disabled have no plugin to call, so this is `None`.
    pub(super) async fn slot(&self, tenant: &str, turn: Turn) -> Option<Result<Slot, Fault>> {
        match &self.inner.runtime {
            Some((sandbox, _)) => {
                let asked = Instant::now();
                let slot = sandbox.slot(tenant, turn).await;
                self.inner
                    .stats
                    .slot_wait(tenant, asked.elapsed(), slot.is_ok());
                Some(slot)
            }
            None => None,
        }
    }

    /// How many abandoned requests of one tenant may be held at once (none without policies).
    pub(super) fn max_held(&self) -> u32 {
        self.inner
            .runtime
            .as_ref()
            .map_or(0, |(_, s)| s.max_held_per_tenant)
    }

    pub(super) fn hold_limit(&self) -> Duration {
        self.inner
            .runtime
            .as_ref()
            .map_or(Duration::ZERO, |(_, s)| s.hold_limit)
    }

    /// Loads the file again and swaps the new set in when it is valid; otherwise the active
    /// set stays and the error says why (blocking: compiles; call off the async threads). The
    /// file is read once no other reload runs: two reloads swap in what they read in the order
    /// they read it, the later file last.
    pub fn reload(&self) -> Result<Arc<PolicySet>, PolicyError> {
        let (_, settings) = self.inner.runtime.as_ref().ok_or(PolicyError::Disabled)?;
        let _one = lock(&self.inner.reloading);
        self.swap_in(load::read(&settings.file))
    }

    /// The watcher's reload of `settled`, the file as it read the same at two looks: once no
    /// other reload runs, and only if the file still reads so and that is not what the last
    /// reload tried. `None`: not reloaded (a reload that waited meanwhile, or an edit since,
    /// read a later file: the bytes read before it are not swapped in after it).
    pub(super) fn reload_settled(
        &self,
        settled: Result<Vec<u8>, LoadError>,
    ) -> Option<Result<Arc<PolicySet>, PolicyError>> {
        let (_, settings) = self.inner.runtime.as_ref()?;
        let _one = lock(&self.inner.reloading);
        let digest = |text: &Result<Vec<u8>, LoadError>| text.as_deref().ok().map(Digest::of);
        let now = load::read(&settings.file);
        if digest(&now) != digest(&settled) || digest(&now) == *lock(&self.inner.tried) {
            return None;
        }
        Some(self.swap_in(now))
    }

    /// Swaps in the set `text` (the file's contents, as read under the reload lock) holds.
    fn swap_in(&self, text: Result<Vec<u8>, LoadError>) -> Result<Arc<PolicySet>, PolicyError> {
        let (sandbox, settings) = self.inner.runtime.as_ref().ok_or(PolicyError::Disabled)?;
        *lock(&self.inner.tried) = text.as_deref().ok().map(Digest::of);
        match text.and_then(|text| load::load_text(sandbox, &settings.file, &text)) {
            Ok(set) => {
                let set = Arc::new(set);
                *self
                    .inner
                    .current
                    .write()
                    .unwrap_or_else(PoisonError::into_inner) = set.clone();
                *lock(&self.inner.last_error) = None;
                self.inner.stats.reload(true);
                tracing::info!(bindings = set.bindings.len(), "policy set reloaded");
                Ok(set)
            }
            Err(e) => {
                *lock(&self.inner.last_error) = Some(e.to_string());
                self.inner.stats.reload(false);
                tracing::warn!(error = %e, "policy reload refused; the previous set stays active");
                Err(e.into())
            }
        }
    }

    /// Why the last reload was refused, if it was.
    pub fn last_error(&self) -> Option<String> {
        lock(&self.inner.last_error).clone()
    }

    /// Checks the policy file every `watch_interval` and reloads when its content differs
    /// from what the last reload read — the watcher's or an admin call's (a refused content
    /// is not retried until it changes again) — and has read the same at two looks in a row
    /// ([`Settling`]). A file that can no longer be read (deleted, its permissions changed) is
    /// a refused reload too, said once until it can be read again: the active set stays.
    /// `None` when not watching.
    pub fn spawn_watch(&self) -> Option<tokio::task::JoinHandle<()>> {
        let (_, settings) = self.inner.runtime.as_ref()?;
        let interval = settings.watch_interval?;
        let file = settings.file.clone();
        let policies = self.clone();
        Some(tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut settling = Settling::default();
            loop {
                tick.tick().await;
                let path = file.clone();
                let Ok(read) = tokio::task::spawn_blocking(move || load::read(&path)).await else {
                    continue;
                };
                let now = read.as_deref().ok().map(Digest::of);
                let tried = *lock(&policies.inner.tried);
                if !settling.settled(now, tried) {
                    continue;
                }
                // The very bytes that read the same twice: a read again could catch a new
                // edit half-written (and is then not taken).
                let p = policies.clone();
                let _ = tokio::task::spawn_blocking(move || p.reload_settled(read)).await;
            }
        }))
    }

    /// Waits for `tenant`'s turn to decide on a disconnect; the next decision of the tenant's
    /// waits until the returned turn is dropped.
    pub(super) async fn deciding(&self, tenant: &str) -> Deciding {
        let turn = lock(&self.inner.deciding)
            .entry(tenant.to_owned())
            .or_default()
            .clone();
        Deciding {
            policies: self.clone(),
            tenant: tenant.to_owned(),
            turn: Some(turn.lock_owned().await),
        }
    }

    /// How many abandoned requests the gateway holds for `tenant` now.
    pub(super) fn held_for(&self, tenant: &str) -> u32 {
        lock(&self.inner.held).get(tenant).copied().unwrap_or(0)
    }

    /// Counts one more abandoned request held for `tenant`, unless it holds `bound` already
    /// (checked and counted at once: requests decided side by side cannot pass it together).
    pub(super) fn hold(&self, tenant: &str, bound: u32) -> Option<Held> {
        let mut held = lock(&self.inner.held);
        let n = held.get(tenant).copied().unwrap_or(0);
        if n >= bound {
            return None;
        }
        held.insert(tenant.to_owned(), n + 1);
        Some(Held {
            policies: self.clone(),
            tenant: tenant.to_owned(),
        })
    }

    /// Runs `end` (a request's end: its hold, its `on-response-end`) in a task on `runtime`,
    /// counted until it returns or is dropped, so that shutdown can wait for it
    /// ([`Policies::ended`]).
    pub(super) fn spawn_end(
        &self,
        runtime: &tokio::runtime::Handle,
        end: impl Future<Output = ()> + Send + 'static,
    ) {
        self.inner.ends.send_modify(|n| *n += 1);
        let counted = RunningEnd {
            policies: self.clone(),
        };
        runtime.spawn(async move {
            end.await;
            drop(counted);
        });
    }

    /// Returns once no request's end is running in a task: every hold has ended and every
    /// `on-response-end` has been called (shutdown waits for this, within its drain timeout,
    /// and cuts the holds that outlast it).
    pub async fn ended(&self) {
        let mut ends = self.inner.ends.subscribe();
        // The sender lives as long as `self`: the wait cannot fail.
        let _ = ends.wait_for(|n| *n == 0).await;
    }

    /// The policy counters, in Prometheus text; the per-tenant ones of the tenants `keep`
    /// says.
    pub fn render_metrics(&self, out: &mut String, keep: &dyn Fn(&str) -> bool) {
        self.inner.stats.render(out, keep);
    }

    /// What `GET /policies` shows: the active set and the last refused reload.
    pub fn status(&self) -> serde_json::Value {
        let set = self.current();
        serde_json::json!({
            "enabled": self.inner.runtime.is_some(),
            "source_sha256": set.source(),
            "chain": set.summary(),
            "last_reload_error": self.last_error(),
        })
    }
}

/// What the watcher read at its last look, so that it takes a change only once the file reads
/// the same at two looks in a row: an editor that rewrites the file in place (truncates, then
/// writes) or a file longer than a page can be read part-written, and a part that happens to
/// be a valid set — its first bindings only, a binding cut before its `tenants` line (so
/// applying to every tenant), a `config = {}` — would be the active set until the next look.
#[derive(Debug, Default)]
pub(super) struct Settling {
    /// The file's digest at the last look (`None` inside: unreadable), unless it was the
    /// content tried last.
    last: Option<Option<Digest>>,
}

impl Settling {
    /// Whether to reload: the file (`now`, its digest; `None`: unreadable) differs from the
    /// content the last reload `tried`, and read the same at the look before.
    pub(super) fn settled(&mut self, now: Option<Digest>, tried: Option<Digest>) -> bool {
        if now == tried {
            self.last = None;
            return false;
        }
        self.last.replace(now) == Some(now)
    }
}

/// A tenant's turn to decide on a disconnect ([`Policies::deciding`]); the next one's on drop.
pub(super) struct Deciding {
    policies: Policies,
    tenant: String,
    turn: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl Drop for Deciding {
    fn drop(&mut self) {
        let mut deciding = lock(&self.policies.inner.deciding);
        drop(self.turn.take());
        // No one else holds or waits for the turn (they would hold the map's entry too): the
        // entry goes, so tenants that come and go leave nothing behind.
        if deciding
            .get(&self.tenant)
            .is_some_and(|turn| Arc::strong_count(turn) == 1)
        {
            deciding.remove(&self.tenant);
        }
    }
}

/// One abandoned request held; released on drop.
#[derive(Debug)]
pub(super) struct Held {
    policies: Policies,
    tenant: String,
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut held = lock(&self.policies.inner.held);
        if let Some(n) = held.get_mut(&self.tenant) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                held.remove(&self.tenant);
            }
        }
    }
}

/// One request's end counted as running (see [`Policies::spawn_end`]).
struct RunningEnd {
    policies: Policies,
}

impl Drop for RunningEnd {
    fn drop(&mut self) {
        self.policies
            .inner
            .ends
            .send_modify(|n| *n = n.saturating_sub(1));
    }
}
