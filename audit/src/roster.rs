//! The roster, `DIR/TENANTS`: every tenant whose log the data directory has held, one id per
//! line, in the order their logs began. A chain lies in its tenant's directory and cannot
//! witness its own absence: without the roster, a tenant's log deleted whole (`rm -r
//! DIR/tenant-a`) left nothing for `verify` to miss. A new tenant's directory is made, given
//! its genesis head, then listed (fsynced), then given records, so a crash can leave at most
//! a directory not yet listed that holds nothing or that head alone — which the writer lists
//! at its next open — and a listed tenant without a directory or a head (emptied), or a
//! directory with records that no line lists, is a deletion or a plant.
//!
//! Unkeyed, lines are appended, and it shows a deleted log, not someone who also edits this
//! file. Keyed, its last line is a seal over the lines before it (`hmac-sha256 <key id>
//! <mac>`, see [`crate::chain`]), and it is rewritten whole (`TENANTS.tmp`, then a rename) to
//! list a tenant: striking a tenant off needs the key. An empty keyed roster is its seal alone,
//! so a new keyed data directory says so before it holds any log.

use std::collections::HashSet;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use crate::chain::{Chain, Seal, SealProblem, Sealed};
use crate::layout::{HEAD, HEAD_TMP, HeadFile};
use crate::tenant::TenantId;

/// The roster's file name in the data directory.
pub(crate) const ROSTER: &str = "TENANTS";
/// A keyed roster's next version, before its rename.
pub(crate) const ROSTER_TMP: &str = "TENANTS.tmp";

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
    /// A keyed roster's seal, unchecked ([`Roster::check`] does).
    pub seal: Option<Seal>,
}

impl Roster {
    /// Whether `tenant` is listed.
    pub fn lists(&self, tenant: &TenantId) -> bool {
        self.listed.contains(tenant)
    }

    /// Whether the seal is the one `chain` gives this listing.
    pub fn check(&self, chain: Chain<'_>) -> Result<(), SealProblem> {
        let listing = listing(&self.listed);
        chain.check(Sealed::Roster { listing: &listing }, self.seal.as_ref())
    }
}

/// The lines that list `tenants`, each with its newline.
fn listing(tenants: &[TenantId]) -> Vec<u8> {
    tenants
        .iter()
        .flat_map(|t| [t.as_str(), "\n"])
        .collect::<String>()
        .into_bytes()
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
    let mut seal = None;
    for (n, line) in bytes[..complete]
        .split_inclusive(|&b| b == b'\n')
        .enumerate()
    {
        let line = line.strip_suffix(b"\n").unwrap_or(line);
        if seal.is_some() {
            return Err(format!("line {}: a line after the seal", n + 1));
        }
        if line.starts_with(Seal::TAG.as_bytes()) {
            let found = std::str::from_utf8(line).ok().and_then(Seal::decode);
            seal = Some(found.ok_or_else(|| format!("line {}: a malformed seal", n + 1))?);
            continue;
        }
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
    let torn = (bytes.len() - complete) as u64;
    if seal.is_some() && torn > 0 {
        return Err("bytes after the seal".to_owned());
    }
    Ok(Roster {
        listed,
        complete_len: complete as u64,
        torn,
        seal,
    })
}

/// Lists `tenant` at the roster's end, durably (the file, and the directory when the file
/// is new). Keyed, the roster is rewritten with a new seal, once its seal is checked again: a
/// roster edited while the writer ran is not sealed anew.
pub(crate) fn append(dir: &Path, chain: Chain<'_>, tenant: &TenantId) -> io::Result<()> {
    let path = path(dir);
    if chain.is_keyed() {
        let mut roster = parse(&fs::read(&path)?).map_err(io::Error::other)?;
        roster
            .check(chain)
            .map_err(|problem| io::Error::other(format!("its seal: {problem}")))?;
        roster.listed.push(tenant.clone());
        return write_sealed(dir, chain, &roster.listed);
    }
    let existed = path.try_exists()?;
    let mut file = OpenOptions::new().create(true).append(true).open(&path)?;
    file.write_all(format!("{tenant}\n").as_bytes())?;
    file.sync_all()?;
    if !existed {
        File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// Makes an empty roster in `dir`, durably (a new data directory): keyed, its seal alone.
pub(crate) fn create(dir: &Path, chain: Chain<'_>) -> io::Result<()> {
    if chain.is_keyed() {
        return write_sealed(dir, chain, &[]);
    }
    File::create(path(dir))?.sync_all()?;
    File::open(dir)?.sync_all()
}

/// The roster listing `tenants`, then its seal in a keyed log.
fn sealed(chain: Chain<'_>, tenants: &[TenantId]) -> Vec<u8> {
    let mut bytes = listing(tenants);
    if let Some(seal) = chain.seal(Sealed::Roster { listing: &bytes }) {
        bytes.extend_from_slice(format!("{}\n", seal.encode()).as_bytes());
    }
    bytes
}

/// Writes a keyed roster listing `tenants` whole, durably: the next version, then a rename.
fn write_sealed(dir: &Path, chain: Chain<'_>, tenants: &[TenantId]) -> io::Result<()> {
    let bytes = sealed(chain, tenants);
    let tmp = dir.join(ROSTER_TMP);
    let mut file = File::create(&tmp)?;
    file.write_all(&bytes)?;
    file.sync_all()?;
    fs::rename(&tmp, path(dir))?;
    File::open(dir)?.sync_all()
}

/// Cuts the roster's torn last line, durably.
pub(crate) fn cut_torn(dir: &Path, roster: &Roster) -> io::Result<()> {
    let file = OpenOptions::new().write(true).open(path(dir))?;
    file.set_len(roster.complete_len)?;
    file.sync_all()
}

/// Whether `tenant`'s directory holds nothing but, at most, its genesis head (sealed as
/// `chain` seals, in a keyed log) and the head's unfinished next copy: what a crash between
/// making it and listing it leaves — in the middle of writing that head, too. A keyed log's
/// writer lists no directory someone without the key planted.
pub(crate) fn is_unbegun(
    chain: Chain<'_>,
    tenant: &TenantId,
    tenant_dir: &Path,
) -> io::Result<bool> {
    for entry in fs::read_dir(tenant_dir)? {
        let entry = entry?;
        if entry.file_name() == HEAD_TMP && entry.file_type()?.is_file() {
            continue;
        }
        let genesis = entry.file_name() == HEAD
            && HeadFile::decode(&fs::read(entry.path())?).is_some_and(|(head, seal)| {
                head == HeadFile::Genesis && head.check(chain, tenant, seal.as_ref()).is_ok()
            });
        if !genesis {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Whether a listed tenant's directory lost its head and holds no whole record: emptied. A
/// listed tenant got its head before it was listed, so no crash leaves it headless; segment
/// files left empty, or holding the start of a line, change nothing (one with a record is
/// reported as a missing head, by the chain's check).
pub(crate) fn is_emptied(tenant_dir: &Path) -> io::Result<bool> {
    if tenant_dir.join(HEAD).try_exists()? {
        return Ok(false);
    }
    for (_, path) in crate::layout::list_tenant(tenant_dir)?.segments {
        if holds_a_line(&path)? {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Whether the file at `path` holds a newline, read a block at a time.
fn holds_a_line(path: &Path) -> io::Result<bool> {
    let mut file = File::open(path)?;
    let mut block = [0u8; 64 * 1024];
    loop {
        match io::Read::read(&mut file, &mut block)? {
            0 => return Ok(false),
            n if block[..n].contains(&b'\n') => return Ok(true),
            _ => {}
        }
    }
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

    #[test]
    fn a_keyed_roster_ends_with_its_seal() {
        let key = crate::ChainKey::new([7; 32]).expect("long enough");
        let chain = Chain::new(Some(&key));
        let ids = [
            TenantId::new("a").expect("valid"),
            TenantId::new("b").expect("valid"),
        ];
        let bytes = sealed(chain, &ids);
        let seal = chain.seal(Sealed::Roster {
            listing: &listing(&ids),
        });
        let r = parse(&bytes).expect("valid");
        assert!(seal.is_some());
        assert_eq!((r.listed.len(), r.seal), (2, seal));
        assert_eq!(r.check(chain), Ok(()));
        assert_eq!(r.check(Chain::new(None)), Err(SealProblem::Keyed));
        // One tenant struck off: the seal no longer fits.
        let struck = parse(&bytes[2..]).expect("still well-formed");
        assert_eq!(struck.check(chain), Err(SealProblem::Broken));
        let mut after = bytes.clone();
        after.extend_from_slice(b"c\n");
        assert!(parse(&after).unwrap_err().contains("after the seal"));
        assert!(
            parse(b"hmac-sha256 00\n")
                .unwrap_err()
                .contains("malformed seal")
        );
    }
}
