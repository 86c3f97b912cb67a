//! Paginated reads of one tenant's records. The path is built only from a [`TenantId`], so a
//! caller can name nothing but a tenant's own directory.

use std::fs;
use std::io::{BufRead as _, BufReader};
use std::path::Path;

use crate::error::{AuditError, io_err};
use crate::hash::Sha256Digest;
use crate::layout;
use crate::line::{self, Seq};
use crate::record::AuditRecord;
use crate::tenant::TenantId;

/// A record as the log holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    /// Its place in the tenant's chain.
    pub seq: Seq,
    /// SHA-256 of its line (in an unkeyed log also the next record's `prev`, and the head's
    /// digest when it is the last; a keyed log links lines by HMAC): a reader that keeps it can
    /// tell later whether the record was rewritten, even with every link recomputed.
    pub digest: Sha256Digest,
    /// The record.
    pub record: AuditRecord,
}

/// Records read at once, and whether the log holds more after them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page {
    /// In order of `seq`.
    pub records: Vec<Stored>,
    /// A record after the last one exists (and, from a live log, is durable).
    pub more: bool,
}

/// How much one read may return: records, and bytes of their lines (a record's captured
/// content can be a megabyte; a page of them is held in memory and sent at once).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    /// The most records.
    pub records: usize,
    /// The first record is returned whatever its size (a page always moves on).
    pub bytes: usize,
}

impl Limit {
    /// `records` records, whatever their size.
    pub fn records(records: usize) -> Limit {
        Limit {
            records,
            bytes: usize::MAX,
        }
    }
}

/// Up to `limit` records of `tenant` with `seq >= since`, in order. Lines not yet complete
/// (a write in progress) are not returned. An unknown tenant has no records.
pub fn read(
    dir: &Path,
    tenant: &TenantId,
    since: Seq,
    limit: usize,
) -> Result<Vec<Stored>, AuditError> {
    read_below(dir, tenant, since, Limit::records(limit), None).map(|page| page.records)
}

/// The page of `tenant`'s records from `since` within `limit`, stopping before the first
/// record at or after `below` (the writer's durable mark). Segments are read a line at a
/// time: a read holds one line and the page, never a segment.
pub(crate) fn read_below(
    dir: &Path,
    tenant: &TenantId,
    since: Seq,
    limit: Limit,
    below: Option<Seq>,
) -> Result<Page, AuditError> {
    let tdir = layout::tenant_dir(dir, tenant);
    let listing = match layout::list_tenant(&tdir) {
        Ok(l) => l,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(Page {
                records: Vec::new(),
                more: false,
            });
        }
        Err(e) => return Err(io_err("list", &tdir)(e)),
    };
    // Start at the last segment that starts at or before `since`. Segments start at rising
    // seqs (an empty one, not yet written to, only last), so a binary search finds it: a page
    // reads the first lines of log2(segments), not of every segment before it.
    let (mut start, mut end) = (0, listing.segments.len());
    while end - start > 1 {
        let mid = start + (end - start) / 2;
        match first_seq(&listing.segments[mid].1)? {
            Some(first) if first <= since => start = mid,
            _ => end = mid,
        }
    }
    // A segment's records are numbered on from its first, a line each: the lines before
    // `since` are stepped over, not decoded (decoding every one made each page of a 64 MiB
    // segment cost the segment, and one bad line before `since` failed every later page).
    let mut skip = match listing.segments.get(start) {
        Some((_, path)) => first_seq(path)?.map_or(0, |first| since.0.saturating_sub(first.0)),
        None => 0,
    };
    let mut out = Vec::new();
    let mut bytes = 0usize;
    let mut l = Vec::new();
    for (_, path) in &listing.segments[start..] {
        let mut reader = BufReader::new(fs::File::open(path).map_err(io_err("open", path))?);
        // The first segment's only: the next starts at a record of its own.
        let mut n = 1u64;
        for _ in 0..std::mem::take(&mut skip) {
            if reader.skip_until(b'\n').map_err(io_err("read", path))? == 0 {
                break;
            }
            n += 1;
        }
        for n in n.. {
            l.clear();
            reader
                .read_until(b'\n', &mut l)
                .map_err(io_err("read", path))?;
            if l.pop() != Some(b'\n') {
                break; // the segment's end, or a line still being written
            }
            let parsed = line::decode(&l).map_err(|reason| AuditError::Corrupt {
                path: path.clone(),
                line: n,
                reason,
            })?;
            // A line of another tenant's log pasted into this one is never read out as this
            // tenant's (I6): the log is taken as corrupt, as `verify` calls it.
            if parsed.record.tenant != *tenant {
                return Err(AuditError::Corrupt {
                    path: path.clone(),
                    line: n,
                    reason: "a record of another tenant".into(),
                });
            }
            if below.is_some_and(|b| parsed.seq >= b) {
                return Ok(Page {
                    records: out,
                    more: false,
                });
            }
            if parsed.seq >= since {
                // One more than the page takes: the page ends before it, and says there is more.
                let over = !out.is_empty() && bytes.saturating_add(l.len()) > limit.bytes;
                if out.len() >= limit.records || over {
                    return Ok(Page {
                        records: out,
                        more: true,
                    });
                }
                bytes = bytes.saturating_add(l.len());
                out.push(Stored {
                    seq: parsed.seq,
                    digest: Sha256Digest::of(&l),
                    record: parsed.record,
                });
            }
        }
    }
    Ok(Page {
        records: out,
        more: false,
    })
}

fn first_seq(path: &Path) -> Result<Option<Seq>, AuditError> {
    let f = fs::File::open(path).map_err(io_err("open", path))?;
    let mut first = Vec::new();
    BufReader::new(f)
        .read_until(b'\n', &mut first)
        .map_err(io_err("read", path))?;
    if first.pop() != Some(b'\n') {
        return Ok(None);
    }
    let parsed = line::decode(&first).map_err(|reason| AuditError::Corrupt {
        path: path.to_owned(),
        line: 1,
        reason,
    })?;
    Ok(Some(parsed.seq))
}
