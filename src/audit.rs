//! `bulkhead audit`: offline tools over an audit data directory.

use std::path::PathBuf;

use bulkhead_audit::TenantId;

#[derive(Debug, clap::Subcommand)]
pub enum What {
    /// Check every tenant's hash chain (or one tenant's) and print the first problem of each
    /// by file and line. Exits non-zero on any problem.
    Verify {
        /// The audit data directory.
        dir: PathBuf,
        /// Check only this tenant.
        #[arg(long)]
        tenant: Option<TenantId>,
    },
}

pub fn run(what: What) -> anyhow::Result<()> {
    match what {
        What::Verify { dir, tenant } => {
            let report = bulkhead_audit::verify(&dir, tenant.as_ref());
            println!("{report}");
            anyhow::ensure!(report.passed(), "audit log verification failed");
            Ok(())
        }
    }
}
