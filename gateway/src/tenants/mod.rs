//! [`Tenants`]: the gateway's handle on the active tenants — their keys and limits — which a
//! reload replaces as a whole without a restart.
//!
//! ```text
//!  POST /tenants/reload, SIGHUP
//!        │
//!        ▼
//!  ConfigFile::read ── the whole file, the startup parser ──▶ refused: 422, the running set
//!        │                                                   stays, last_reload_error says why
//!        ▼ a TenantSet (ids, limits, keyring)
//!  Limiter::retune (tenants that stay: new limits; in-flight counts and the minute's usage kept)
//!        │
//!        ▼
//!  swap: the next request authenticates against the new keyring
//! ```
//!
//! Invariants, each with a test in `tests.rs`:
//! - a file that does not parse and validate changes nothing;
//! - a removed tenant's key, or a key rotated away, is refused from the next request on;
//!   requests in flight keep the tenant (and limits) they were authenticated with;
//! - a changed limit applies to requests that start after the reload, and the limiter keeps
//!   the in-flight counts and window usage of tenants that stay (a reload is not a reset);
//! - sections a running gateway does not change (listeners, admin token, HTTP limits, audit,
//!   workers, policies' settings, telemetry) are not applied, and the reload names those
//!   that differ.

mod reload;
mod served;
mod set;
#[cfg(test)]
mod tests;

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, RwLock};

pub use reload::{ConfigFile, ReloadError, Reloaded, ReusedIds, Section};
pub use served::{ServedError, ServedFile};
pub(crate) use set::TenantSetBuilder;
pub use set::{Keyring, Member, TenantSet};

use crate::limits::Limiter;
use crate::tenant::TenantId;
use crate::trail::Recorder;

/// The active tenant set and the limiter that enforces it; a cheap `Clone`.
#[derive(Debug, Clone)]
pub struct Tenants {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    current: RwLock<Arc<TenantSet>>,
    /// Every tenant's budget; retuned at each swap.
    limiter: Limiter,
    /// Where reloads read; `None`: the gateway was started from text, not a file.
    file: Option<ConfigFile>,
    /// One reload at a time, so two reloads cannot swap in the older file last.
    reloading: Mutex<()>,
    /// Why the last reload was refused (cleared by a good one).
    last_error: Mutex<Option<String>>,
    reloads_ok: AtomicU64,
    reloads_refused: AtomicU64,
    /// The audit log a reload looks up its new tenants' ids in, and where the ids served are
    /// kept ([`Tenants::audited_by`]).
    audit: OnceLock<Audited>,
}

#[derive(Debug)]
struct Audited {
    recorder: Recorder,
    served: ServedFile,
}

/// Why the configured tenants cannot start serving.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(
        "the configured tenants were refused: {ids}. To start once without comparing the \
         configured tenants with those served last (bulkhead up's built-in configuration has no \
         entry to say reuse_id in), remove {served}"
    )]
    ReusedId { ids: ReusedIds, served: String },
    #[error("the ids of the tenants served: {0}")]
    Served(#[from] ServedError),
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Audited {
    /// Which of `added` (ids `set` gives tenants that were not served before) already have
    /// audit records; refused, the ids of those `set` does not vouch for (`reuse_id`).
    fn vouched(&self, set: &TenantSet, added: &[TenantId]) -> Result<Vec<TenantId>, ReusedIds> {
        let reused: Vec<TenantId> = added
            .iter()
            .filter(|id| self.recorder.holds(id))
            .cloned()
            .collect();
        let unvouched: Vec<TenantId> = reused
            .iter()
            .filter(|id| set.get(id).is_some_and(|t| !t.reuse_id))
            .cloned()
            .collect();
        if unvouched.is_empty() {
            Ok(reused)
        } else {
            Err(ReusedIds(unvouched))
        }
    }
}

/// Logs the ids configured again with `reuse_id`, if any.
fn note_reused(reused: &[TenantId]) {
    if !reused.is_empty() {
        let names: Vec<String> = reused.iter().map(ToString::to_string).collect();
        tracing::info!(
            reused = ?names,
            "tenants back under ids whose audit records they left (reuse_id)"
        );
    }
}

impl Tenants {
    /// `set` active, enforced by `limiter`; reloads read `file`.
    pub fn new(set: TenantSet, limiter: Limiter, file: Option<ConfigFile>) -> Tenants {
        Tenants {
            inner: Arc::new(Inner {
                current: RwLock::new(Arc::new(set)),
                limiter,
                file,
                reloading: Mutex::new(()),
                last_error: Mutex::new(None),
                reloads_ok: AtomicU64::new(0),
                reloads_refused: AtomicU64::new(0),
                audit: OnceLock::new(),
            }),
        }
    }

    /// Reloads look up the ids of the tenants they add in `recorder`'s log: an id with
    /// records already reads its earlier holder's, and the reload is refused unless the id's
    /// entry says `reuse_id`. The same holds now for the ids configured at start that `served`
    /// (the ids served last from this data directory) lacks; then `served` names the active
    /// set. Returns the ids configured again with `reuse_id`. Call once, before serving
    /// (blocking: reads and writes a file).
    pub fn audited_by(
        &self,
        recorder: Recorder,
        served: ServedFile,
    ) -> Result<Vec<TenantId>, StartError> {
        let set = self.current();
        let before = served.read()?;
        let added: Vec<TenantId> = set
            .tenants()
            .map(|t| &t.id)
            .filter(|id| before.as_ref().is_some_and(|ids| !ids.contains(*id)))
            .cloned()
            .collect();
        let audited = Audited { recorder, served };
        let reused = audited
            .vouched(&set, &added)
            .map_err(|ids| StartError::ReusedId {
                ids,
                served: audited.served.path().display().to_string(),
            })?;
        audited.served.write(set.tenants().map(|t| &t.id))?;
        let _ = self.inner.audit.set(audited);
        note_reused(&reused);
        Ok(reused)
    }

    /// The active set (a request keeps the tenant it authenticated as until it ends).
    pub fn current(&self) -> Arc<TenantSet> {
        self.inner
            .current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The per-tenant limits' state.
    pub fn limiter(&self) -> &Limiter {
        &self.inner.limiter
    }

    /// The file reloads read, if any.
    pub fn file(&self) -> Option<&ConfigFile> {
        self.inner.file.as_ref()
    }

    /// Reads the configuration file again and, when it is valid, swaps its tenants in; the
    /// restart-only sections are never applied (the answer names those that differ). Otherwise
    /// nothing changes and the error says why. Blocking (reads a file): call off the async
    /// threads.
    pub fn reload(&self) -> Result<Reloaded, ReloadError> {
        let _one = lock(&self.inner.reloading);
        let result = self
            .inner
            .file
            .as_ref()
            .ok_or(ReloadError::NoFile)
            .and_then(|file| Ok(file.read()?))
            .and_then(|(set, restart_required)| {
                let mut reloaded = Reloaded::between(&self.current(), &set, restart_required);
                let Some(audited) = self.inner.audit.get() else {
                    return Ok((set, reloaded));
                };
                reloaded.reused = audited
                    .vouched(&set, &reloaded.added)
                    .map_err(ReloadError::ReusedId)?;
                audited.served.write(set.tenants().map(|t| &t.id))?;
                Ok((set, reloaded))
            });
        match result {
            Ok((set, reloaded)) => {
                self.swap(set, &reloaded.renamed);
                *lock(&self.inner.last_error) = None;
                self.inner.reloads_ok.fetch_add(1, Ordering::Relaxed);
                let names = |ids: &[crate::tenant::TenantId]| {
                    ids.iter().map(|id| id.to_string()).collect::<Vec<_>>()
                };
                tracing::info!(
                    added = ?names(&reloaded.added),
                    removed = ?names(&reloaded.removed),
                    changed = ?names(&reloaded.changed),
                    renamed = ?reloaded.renamed.iter().map(|(old, new)| format!("{old} -> {new}")).collect::<Vec<_>>(),
                    restart_required = ?reloaded.restart_required.iter().map(|s| s.name()).collect::<Vec<_>>(),
                    "tenants reloaded"
                );
                note_reused(&reloaded.reused);
                Ok(reloaded)
            }
            Err(e) => {
                *lock(&self.inner.last_error) = Some(e.to_string());
                self.inner.reloads_refused.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %e, "tenants reload");
                Err(e)
            }
        }
    }

    /// Makes `set` the active one: the limiter takes the new limits (and the renamed tenants'
    /// budgets) first, so a request that authenticates against the new set is always limited
    /// by them.
    fn swap(&self, set: TenantSet, renamed: &[(TenantId, TenantId)]) {
        self.inner.limiter.retune(&set, renamed);
        *self
            .inner
            .current
            .write()
            .unwrap_or_else(PoisonError::into_inner) = Arc::new(set);
    }

    /// Why the last reload was refused, if it was.
    pub fn last_error(&self) -> Option<String> {
        lock(&self.inner.last_error).clone()
    }

    /// What `GET /tenants` shows: every tenant's id, limits, key ids (never a key or its
    /// hash) and requests in flight; the file reloads read and the last refused reload.
    pub fn status(&self) -> serde_json::Value {
        let set = self.current();
        let tenants: Vec<_> = set
            .members()
            .iter()
            .map(|m| {
                let t = &m.tenant;
                serde_json::json!({
                    "id": t.id.as_str(),
                    "limits": {
                        "max_context": t.limits.max_context.get(),
                        "max_concurrent": t.limits.max_concurrent.get(),
                        "requests_per_minute": t.limits.requests_per_minute.get(),
                        "tokens_per_minute": t.limits.tokens_per_minute.get(),
                    },
                    "capture_content": t.capture_content,
                    "key_ids": m.key_ids.iter().map(|k| k.as_str()).collect::<Vec<_>>(),
                    "in_flight": self.inner.limiter.in_flight(&t.id),
                })
            })
            .collect();
        serde_json::json!({
            "tenants": tenants,
            "file": self.inner.file.as_ref().map(|f| f.path().display().to_string()),
            "last_reload_error": self.last_error(),
        })
    }

    /// `bulkhead_tenant_reloads_total{result}`, in Prometheus text.
    pub fn render_metrics(&self, out: &mut String) {
        let name = "bulkhead_tenant_reloads_total";
        let _ = writeln!(
            out,
            "# HELP {name} Tenants reloads by result.\n# TYPE {name} counter\n\
             {name}{{result=\"ok\"}} {}\n{name}{{result=\"refused\"}} {}",
            self.inner.reloads_ok.load(Ordering::Relaxed),
            self.inner.reloads_refused.load(Ordering::Relaxed),
        );
    }

    /// Reloads on every SIGHUP; without a file to read, each is a refused reload that says so
    /// (the signal's default action would end the process: an operator sending the documented
    /// reload signal would stop the gateway). `None` where the platform has no SIGHUP.
    pub fn spawn_reload_on_hangup(&self) -> Option<tokio::task::JoinHandle<()>> {
        hangups().map(|mut hangups| {
            let tenants = self.clone();
            tokio::spawn(async move {
                while hangups.recv().await.is_some() {
                    let t = tenants.clone();
                    // The outcome is logged, counted and shown by `GET /tenants`.
                    let _ = tokio::task::spawn_blocking(move || t.reload()).await;
                }
            })
        })
    }
}

/// SIGHUP deliveries.
#[cfg(unix)]
fn hangups() -> Option<tokio::signal::unix::Signal> {
    use tokio::signal::unix::{SignalKind, signal};
    signal(SignalKind::hangup())
        .map_err(
            |e| tracing::warn!(error = %e, "cannot listen for SIGHUP; reload with the admin call"),
        )
        .ok()
}

/// No SIGHUP here: reload with the admin call.
#[cfg(not(unix))]
fn hangups() -> Option<NoHangups> {
    None
}

/// The twin of tokio's `Signal` where there is no SIGHUP; never constructed.
#[cfg(not(unix))]
#[derive(Debug)]
enum NoHangups {}

#[cfg(not(unix))]
impl NoHangups {
    async fn recv(&mut self) -> Option<()> {
        match *self {}
    }
}
