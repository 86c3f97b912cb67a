//! `--data-dir`: where the gateway keeps its state (the audit log under `DIR/audit`), shared by
//! `bulkhead gateway` and `bulkhead up`.

use std::path::PathBuf;

/// The environment variable of `--data-dir`.
pub const ENV: &str = "BULKHEAD_DATA_DIR";

#[derive(Debug, Clone, clap::Args)]
pub struct DataDir {
    /// The gateway's data directory (the audit log lives in DIR/audit). Default:
    /// $XDG_STATE_HOME/bulkhead, else ~/.local/state/bulkhead.
    #[arg(long = "data-dir", env = ENV, value_name = "DIR")]
    dir: Option<PathBuf>,
}

impl DataDir {
    /// The directory given, or the default.
    pub fn path(&self) -> anyhow::Result<PathBuf> {
        if let Some(dir) = &self.dir {
            return Ok(dir.clone());
        }
        let state = std::env::var_os("XDG_STATE_HOME")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .or_else(|| {
                std::env::var_os("HOME")
                    .filter(|v| !v.is_empty())
                    .map(|home| PathBuf::from(home).join(".local/state"))
            });
        state.map(|s| s.join("bulkhead")).ok_or_else(|| {
            anyhow::anyhow!(
                "no data directory: pass --data-dir (neither XDG_STATE_HOME nor HOME is set)"
            )
        })
    }
}
