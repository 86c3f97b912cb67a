//! Test support: a scratch directory, removed when dropped.

use std::path::PathBuf;

/// A fresh directory under the system's temporary directory, removed (with everything in it)
/// on drop.
#[derive(Debug)]
pub(crate) struct Scratch(pub PathBuf);

impl Scratch {
    /// A new directory whose name starts `bulkhead-{what}-`.
    pub(crate) fn new(what: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!(
            "bulkhead-{what}-{}-{:x}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&dir).expect("scratch dir");
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
