//! `DATA_DIR/tenants-served`: the ids of the tenants the gateway last served from that data
//! directory, one per line. It is rewritten (a temporary file, fsynced, then renamed) when the
//! gateway starts and before each reload takes effect, so it always names a set that was
//! active or about to be.
//!
//! A reload sees which ids it adds: they are not in the running set. A start had no way to
//! tell, because an id removed by a reload or between two runs left no trace but its audit
//! records, and a new tenant configured under it at the next start read them. This file is
//! that trace: an id configured at start that it does not name, and whose audit log holds
//! records, is an id given again ([`super::ReusedIds`]), exactly as for a reload.
//!
//! A data directory without the file (a new one, or one written by a gateway before the file
//! existed) has nothing to compare with: that start is not checked, and it writes the file.

use std::collections::BTreeSet;
use std::fs::{self, File};
use std::io::{self, Write as _};
use std::path::{Path, PathBuf};

use crate::tenant::TenantId;

/// The file's name in the data directory.
const NAME: &str = "tenants-served";
/// Its next version, before the rename.
const NAME_TMP: &str = "tenants-served.tmp";
const HEADING: &str = "# The tenants this gateway last served from this data directory \
    (written by the gateway at each start and reload; see the README on `reuse_id`).\n";

/// Where a data directory keeps the ids it served last.
#[derive(Debug, Clone)]
pub struct ServedFile {
    dir: PathBuf,
}

/// Why the file could not be read or written.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {problem}")]
pub struct ServedError {
    path: String,
    problem: String,
}

impl ServedFile {
    /// The file in `data_dir` (which the gateway's audit log lives under).
    pub fn in_dir(data_dir: &Path) -> ServedFile {
        ServedFile {
            dir: data_dir.to_path_buf(),
        }
    }

    /// The file's path.
    pub fn path(&self) -> PathBuf {
        self.dir.join(NAME)
    }

    fn error(&self, problem: impl std::fmt::Display) -> ServedError {
        ServedError {
            path: self.path().display().to_string(),
            problem: problem.to_string(),
        }
    }

    /// The ids served last; `None` when the directory has no such file yet.
    pub fn read(&self) -> Result<Option<BTreeSet<TenantId>>, ServedError> {
        let text = match fs::read_to_string(self.path()) {
            Ok(text) => text,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(self.error(e)),
        };
        text.lines()
            .enumerate()
            .filter(|(_, line)| !line.is_empty() && !line.starts_with('#'))
            .map(|(n, line)| {
                TenantId::new(line).map_err(|e| {
                    self.error(format_args!(
                        "line {}: {e} (the file was edited; remove it to start without comparing \
                         the configured tenants with the last served)",
                        n + 1
                    ))
                })
            })
            .collect::<Result<_, _>>()
            .map(Some)
    }

    /// Makes `ids` the ids served last, durably.
    pub fn write<'a>(
        &self,
        ids: impl IntoIterator<Item = &'a TenantId>,
    ) -> Result<(), ServedError> {
        let mut text = String::from(HEADING);
        for id in ids {
            text.push_str(id.as_str());
            text.push('\n');
        }
        let tmp = self.dir.join(NAME_TMP);
        let written = File::create(&tmp)
            .and_then(|mut file| {
                file.write_all(text.as_bytes())?;
                file.sync_all()
            })
            .and_then(|()| fs::rename(&tmp, self.path()))
            .and_then(|()| File::open(&self.dir)?.sync_all());
        written.map_err(|e| self.error(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scratch::Scratch;

    fn id(s: &str) -> TenantId {
        TenantId::new(s).expect("valid")
    }

    #[test]
    fn the_ids_written_read_back_and_an_edited_line_is_an_error() {
        let dir = Scratch::new("served");
        let file = ServedFile::in_dir(&dir.0);
        assert_eq!(file.read().expect("reads"), None, "no file yet");
        file.write([&id("tenant-a"), &id("tenant-b")])
            .expect("writes");
        let read = file.read().expect("reads").expect("a file");
        assert_eq!(read, BTreeSet::from([id("tenant-a"), id("tenant-b")]));
        fs::write(file.path(), "tenant-a\nnot a tenant!\n").expect("edits");
        let error = file.read().expect_err("an invalid id");
        assert!(error.to_string().contains("line 2"), "{error}");
    }
}
