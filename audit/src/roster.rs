//! The roster, `DIR/TENANTS`: every tenant whose log the data directory has held, one id per
//! line, in the order their logs began. A chain lies in its tenant's directory and cannot
//! witness its own absence: without the roster, a tenant's log deleted whole (`rm -r
//! DIR/tenant-a`) left nothing for `verify` to miss. A new tenant's directory is made, given
//! its genesis head, then listed (fsynced), then given records, so a crash can leave at most
//! a directory not yet listed that holds nothing or that head alone — which the writer lists
//! at its next open — and a listed tenant without a directory or a head (emptied), or a
//! directory with records that no line lists, is a deletion or a plant. Unkeyed like the chains: it shows a deleted log, not someone who also edits this
//! file.

use std::collections::HashSet;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use crate::layout::{HEAD, HeadFile};
use crate::tenant::TenantId;

/// The roster's file name in the data directory.
pub(crate) const ROSTER: &str = "TENANTS";

/// The roster's path in `dir`.
pub(crate) fn path(dir: &Path) -> PathBuf {
    dir.join(ROSTER)
}

/// A roster as read.
#[derive(Debug, Default)]
pub(crate) struct Roster {
    /// The tenants listed, in order.
    pub listed: Vec<TenantId>,
    /// Length of the complete lines: what follows is a line a crash cut short.
    pub complete_len: u64,
    /// Bytes of that torn last line (0 when there is none).
    pub torn: u64,
}

impl Roster {
    /// Whether `tenant` is listed.
    pub fn lists(&self, tenant: &TenantId) -> bool {
        self.listed.contains(tenant)
    }
}

/// The roster of `dir`: `None` when there is no file; `Err` names the line that is not a
/// tenant id, or one listed twice.
pub(crate) fn read(dir: &Path) -> io::Result<Option<Result<Roster, String>>> {
    let bytes = match fs::read(path(dir)) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    Ok(Some(parse(&bytes)))
}

fn parse(bytes: &[u8]) -> Result<Roster, String> {
    let complete = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    let mut seen = HashSet::new();
    let mut listed = Vec::new();
    for (n, line) in bytes[..complete]
        .split_inclusive(|&b| b == b'\n')
        .enumerate()
    {
        let line = line.strip_suffix(b"\n").unwrap_or(line);
        let id = std::str::from_utf8(line)
            .ok()
            .and_then(|s| TenantId::new(s).ok())
            .ok_or_else(|| format!("line {}: not a tenant id", n + 1))?;
        if !seen.insert(id.clone()) {
            return Err(format!(
                "line {}: {id} is listed twice (its log was deleted while the gateway ran, and \
                 begun again)",
                n + 1
            ));
        }
        listed.push(id);
    }
    Ok(Roster {
        listed,
        complete_len: complete as u64,
        torn: (bytes.len() - complete) as u64,
    })
}

/// Lists `tenant` at the roster's end, durably (the file, and the directory when the file
/// is new).
pub(crate) fn append(dir: &Path, tenant: &TenantId) -> io::Result<()> {
    let path = path(dir);
    let existed = path.try_exists()?;
    let mut file = OpenOptions::new().create(true).append(true).open(&path)?;
    file.write_all(format!("{tenant}\n").as_bytes())?;
    file.sync_all()?;
    if !existed {
        File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// Makes an empty roster in `dir`, durably (a new data directory).
pub(crate) fn create(dir: &Path) -> io::Result<()> {
    File::create(path(dir))?.sync_all()?;
    File::open(dir)?.sync_all()
}

/// Cuts the roster's torn last line, durably.
pub(crate) fn cut_torn(dir: &Path, roster: &Roster) -> io::Result<()> {
    let file = OpenOptions::new().write(true).open(path(dir))?;
    file.set_len(roster.complete_len)?;
    file.sync_all()
}

/// Whether a tenant directory holds nothing but, at most, its genesis head: what a crash
/// between making it and listing it leaves.
pub(crate) fn is_unbegun(tenant_dir: &Path) -> io::Result<bool> {
    for entry in fs::read_dir(tenant_dir)? {
        let entry = entry?;
        let genesis = entry.file_name() == HEAD
            && fs::read(entry.path())? == HeadFile::Genesis.encode().as_bytes();
        if !genesis {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Whether a listed tenant's directory lost its head and holds no segment: emptied (a listed
/// tenant got its head before it was listed).
pub(crate) fn is_emptied(tenant_dir: &Path) -> io::Result<bool> {
    Ok(!tenant_dir.join(HEAD).try_exists()?
        && crate::layout::list_tenant(tenant_dir)?.segments.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_roster_is_ids_one_per_line_each_once() {
        let r = parse(b"tenant-a\n_gateway\n").expect("valid");
        let ids: Vec<&str> = r.listed.iter().map(TenantId::as_str).collect();
        assert_eq!(ids, ["tenant-a", "_gateway"]);
        assert_eq!((r.complete_len, r.torn), (18, 0));
        let r = parse(b"").expect("an empty roster");
        assert!(r.listed.is_empty());
        // A line a crash cut short is set apart, not read as an id.
        let r = parse(b"tenant-a\ntena").expect("valid with a torn line");
        assert_eq!((r.listed.len(), r.complete_len, r.torn), (1, 9, 4));
        assert!(parse(b"tenant-a\n\n").unwrap_err().contains("line 2"));
        assert!(parse(b"../x\n").unwrap_err().contains("line 1"));
        assert!(parse(b"a\nb\na\n").unwrap_err().contains("listed twice"));
    }
}
