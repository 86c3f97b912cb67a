//! `bulkhead audit`: offline tools over an audit data directory.

use std::path::PathBuf;

use anyhow::Context as _;
use bulkhead_audit::{ChainKey, TenantId};

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
        } => {
            let dir = audit_dir(dir);
            let key = key_file
                .map(|path| {
                    ChainKey::read(&path).with_context(|| format!("--key-file {}", path.display()))
                })
                .transpose()?;
            let report = bulkhead_audit::verify(&dir, tenant.as_ref(), key.as_ref());
            println!("{report}");
            anyhow::ensure!(report.passed(), "audit log verification failed");
            Ok(())
        }
    }
}
