//! Reading the gateway's configuration file again. [`ConfigFile`] remembers where the running
//! configuration came from and its restart-only sections as the file had them at start (before
//! any command-line override, e.g. `bulkhead up`'s ports and worker addresses), so a reload
//! names exactly the sections an operator changed in the file since.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::config::{
    AuditSettings, ClusterSettings, Config, ConfigError, HttpLimits, Listen, TelemetrySettings,
    WorkerConfig,
};
use crate::discovery::WorkerGroup;
use crate::keys::KeyHash;
use crate::policy::PolicySettings;
use crate::tenant::TenantId;
use crate::tenants::TenantSet;
use crate::tenants::served::ServedError;

/// The configuration file a gateway was started from.
#[derive(Debug, Clone)]
pub struct ConfigFile {
    path: PathBuf,
    /// The file's restart-only sections when the gateway started: what runs.
    running: RestartOnly,
}

impl ConfigFile {
    /// Reads and validates the file at `path` ([`Config::load`]) and remembers it for reloads.
    pub fn load(path: &Path) -> Result<(Config, ConfigFile), ConfigError> {
        Self::load_with_text(path).map(|(config, file, _)| (config, file))
    }

    /// [`ConfigFile::load`], and the text it validated.
    pub fn load_with_text(path: &Path) -> Result<(Config, ConfigFile, String), ConfigError> {
        let text = Config::read(path)?;
        let config = Config::parse(&text)?;
        let file = ConfigFile {
            path: path.to_owned(),
            running: RestartOnly::of(&config),
        };
        Ok((config, file, text))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads and validates the file again, whole, with the same parser as at start: its
    /// tenants, and the restart-only sections that differ from the running ones.
    pub(super) fn read(&self) -> Result<(TenantSet, Vec<Section>), ConfigError> {
        let config = Config::load(&self.path)?;
        // The file's admin token is checked against its tenants by the parser; the running one
        // (a new one takes a restart) must not become a tenant's key either.
        if let Some(t) = config.tenants.keyring().tenant(&self.running.admin_token) {
            return Err(ConfigError::AdminTokenIsTenantKey {
                tenant: t.id.to_string(),
            });
        }
        let restart_required = self.running.differing(&RestartOnly::of(&config));
        Ok((config.tenants, restart_required))
    }
}

/// A section of the configuration that a running gateway does not change: a reload leaves it
/// as it is and names it when the file's differs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Section {
    Listen,
    Admin,
    Http,
    Audit,
    Workers,
    WorkerGroups,
    WorkerRefresh,
    Policies,
    Telemetry,
    Cluster,
}

impl Section {
    /// Its name in the file.
    pub fn name(self) -> &'static str {
        match self {
            Section::Listen => "listen",
            Section::Admin => "admin",
            Section::Http => "http",
            Section::Audit => "audit",
            Section::Workers => "workers",
            Section::WorkerGroups => "worker_groups",
            Section::WorkerRefresh => "worker_refresh_secs",
            Section::Policies => "policies",
            Section::Telemetry => "telemetry",
            Section::Cluster => "cluster",
        }
    }
}

/// Everything in a [`Config`] but its tenants.
#[derive(Debug, Clone, PartialEq)]
struct RestartOnly {
    listen: Listen,
    admin_token: KeyHash,
    http: HttpLimits,
    audit: AuditSettings,
    workers: Vec<WorkerConfig>,
    worker_groups: Vec<WorkerGroup>,
    refresh_interval: Duration,
    policies: Option<PolicySettings>,
    telemetry: TelemetrySettings,
    cluster: ClusterSettings,
}

impl RestartOnly {
    fn of(config: &Config) -> RestartOnly {
        // Exhaustive: a new field of `Config` must be classified here, reloadable or not.
        let Config {
            listen,
            admin_token,
            http,
            audit,
            tenants: _,
            workers,
            worker_groups,
            refresh_interval,
            policies,
            telemetry,
            cluster,
        } = config;
        RestartOnly {
            listen: listen.clone(),
            admin_token: *admin_token,
            http: *http,
            audit: audit.clone(),
            workers: workers.clone(),
            worker_groups: worker_groups.clone(),
            refresh_interval: *refresh_interval,
            policies: policies.clone(),
            telemetry: telemetry.clone(),
            cluster: cluster.clone(),
        }
    }

    /// The sections of `file` that differ from these, in file order.
    fn differing(&self, file: &RestartOnly) -> Vec<Section> {
        let RestartOnly {
            listen,
            admin_token,
            http,
            audit,
            workers,
            worker_groups,
            refresh_interval,
            policies,
            telemetry,
            cluster,
        } = self;
        [
            (Section::Listen, *listen != file.listen),
            (Section::Admin, *admin_token != file.admin_token),
            (Section::Http, *http != file.http),
            (Section::Audit, *audit != file.audit),
            (
                Section::Workers,
                !same_by_name(workers, &file.workers, |w| &w.name),
            ),
            (
                Section::WorkerGroups,
                !same_by_name(worker_groups, &file.worker_groups, |g| &g.name),
            ),
            (
                Section::WorkerRefresh,
                *refresh_interval != file.refresh_interval,
            ),
            (Section::Policies, *policies != file.policies),
            (Section::Telemetry, *telemetry != file.telemetry),
            (Section::Cluster, *cluster != file.cluster),
        ]
        .into_iter()
        .filter_map(|(section, differs)| differs.then_some(section))
        .collect()
    }
}

/// Why a reload changed nothing.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error(
        "the gateway was started without a configuration file (bulkhead up's built-in one); \
         start it with --config FILE to reload its tenants"
    )]
    NoFile,
    #[error("the configuration was refused; the running tenants stay: {0}")]
    Invalid(#[from] ConfigError),
    #[error("the configuration was refused; the running tenants stay: {0}")]
    ReusedId(ReusedIds),
    #[error("the configuration was refused; the running tenants stay: {0}")]
    Served(#[from] ServedError),
}

/// Ids a configuration gives tenants though their audit logs hold records, with no entry
/// saying `reuse_id`: a reload or a start adding them is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReusedIds(pub Vec<TenantId>);

impl std::fmt::Display for ReusedIds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let quoted: Vec<String> = self.0.iter().map(|id| format!("`{id}`")).collect();
        write!(
            f,
            "it adds {}, whose audit log already holds records. Another tenant given such an id \
             would read those records (/v1/audit) and share the prefix cache the workers keep \
             for the id. Give a new tenant a new id; for the tenant that left the records, \
             coming back, set `reuse_id = true` on its entry",
            quoted.join(", ")
        )
    }
}

/// What a reload changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reloaded {
    /// Tenants new in the file.
    pub added: Vec<TenantId>,
    /// Tenants no longer in the file: their keys are refused from now on.
    pub removed: Vec<TenantId>,
    /// Tenants whose limits, keys or content capture changed.
    pub changed: Vec<TenantId>,
    /// Sections that differ from the running ones and were not applied: they need a restart.
    pub restart_required: Vec<Section>,
    /// Tenants new in the file whose id already has audit records: each reads its earlier
    /// holder's (a tenant's log is its id's).
    pub reused: Vec<TenantId>,
    /// Tenants removed whose keys now belong to a tenant added (old id, new id): the new id
    /// takes over the old one's budget ([`crate::limits::Limiter::retune`]).
    pub renamed: Vec<(TenantId, TenantId)>,
}

impl Reloaded {
    /// What changed from `old` to `new`.
    pub(super) fn between(
        old: &TenantSet,
        new: &TenantSet,
        restart_required: Vec<Section>,
    ) -> Reloaded {
        let ids = |set: &TenantSet, other: &TenantSet| -> Vec<TenantId> {
            set.tenants()
                .filter(|t| other.get(&t.id).is_none())
                .map(|t| t.id.clone())
                .collect()
        };
        let changed = new
            .members()
            .iter()
            .filter(|m| {
                old.members()
                    .iter()
                    .find(|o| o.tenant.id == m.tenant.id)
                    .is_some_and(|o| o.tenant != m.tenant || o.key_ids != m.key_ids)
            })
            .map(|m| m.tenant.id.clone())
            .collect();
        Reloaded {
            added: ids(new, old),
            removed: ids(old, new),
            changed,
            restart_required,
            reused: Vec::new(),
            renamed: new.renamed_from(old),
        }
    }
}

/// Whether two lists of uniquely named entries hold the same entries, in any order (the
/// order of `[[workers]]` or `[[worker_groups]]` in the file means nothing).
fn same_by_name<T: PartialEq>(a: &[T], b: &[T], name: impl Fn(&T) -> &String) -> bool {
    a.len() == b.len()
        && a.iter()
            .all(|x| b.iter().any(|y| name(y) == name(x) && y == x))
}
