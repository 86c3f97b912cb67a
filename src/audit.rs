//! `bulkhead audit`: offline tools over an audit data directory.

use std::path::PathBuf;

use anyhow::Context as _;
use bulkhead_audit::{Anchor, ChainKey, TenantId};

#[derive(Debug, clap::Subcommand)]
pub enum What {
    /// Check every tenant's hash chain (or one tenant's) and print the first problem of each
    /// by file and line. Exits non-zero on any problem.
    Verify {
        /// The audit directory (`DATA_DIR/audit`), or the gateway's data directory itself.
        dir: PathBuf,
        /// Check only this tenant.
        #[arg(long)]
        tenant: Option<TenantId>,
        /// The key file of a keyed log (the gateway's `[audit] key_file`): every log must then
        /// be keyed, with this key. Without it, a keyed log is a problem.
        #[arg(long)]
        key_file: Option<PathBuf>,
        /// `TENANT:SEQ:SHA256`, a record kept elsewhere (the collector's copy of an exported
        /// record: `bulkhead.tenant.id`, `bulkhead.audit.seq`, `bulkhead.audit.sha256`; or a
        /// record `/v1/audit` returned, its `seq` and `digest`): the log must still hold that
        /// line. Shows a log rolled back to an older copy, which verifies on its own. Repeat
        /// for more.
        #[arg(long = "anchor", value_name = "TENANT:SEQ:SHA256")]
        anchors: Vec<Anchor>,
    },
}

/// An audit directory holds the writer's `LOCK`; a data directory holds one as `audit/`.
fn audit_dir(dir: PathBuf) -> PathBuf {
    let nested = dir.join("audit");
    if !dir.join("LOCK").exists() && nested.join("LOCK").exists() {
        nested
    } else {
        dir
    }
}

pub fn run(what: What) -> anyhow::Result<()> {
    match what {
        What::Verify {
            dir,
            tenant,
            key_file,
            anchors,
        } => {
            if let (Some(t), Some(a)) = (
                &tenant,
                anchors.iter().find(|a| Some(&a.tenant) != tenant.as_ref()),
            ) {
                anyhow::bail!(
                    "--anchor names tenant {} while --tenant checks {t} alone",
                    a.tenant
                );
            }
            let dir = audit_dir(dir);
            let key = key_file
                .map(|path| {
                    ChainKey::read(&path).with_context(|| format!("--key-file {}", path.display()))
                })
                .transpose()?;
            let report =
                bulkhead_audit::verify_anchored(&dir, tenant.as_ref(), key.as_ref(), &anchors);
            println!("{report}");
            anyhow::ensure!(report.passed(), "audit log verification failed");
            Ok(())
        }
    }
}
