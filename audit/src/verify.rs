//! The verifier: checks every chain and names the first problem of each exactly.
//!
//! The data directory: its roster (`TENANTS`) lists every tenant directory that holds
//! anything, and every tenant it lists has its directory (a log deleted whole).
//!
//! Per tenant, in order: no stray entries; a readable head; segments numbered 0, 1, 2, … with no
//! gap; in every segment every line complete, a valid record of this tenant, `seq` one more than
//! the line before, and `prev` the link to the line before (its SHA-256; in a keyed log the MAC
//! each line starts with, which must verify under the key over the rest of the line); finally the
//! record the head names exists and links to the head's digest (this catches a deleted tail, which
//! the chain alone cannot).
//!
//! Keyed or not: given a key, the roster and every head must be sealed with it; given none,
//! none may be sealed. A log sealed with no key given, or with another key, is reported as soon
//! as its roster or head is read (none of its links could be checked); a missing or broken seal
//! once the lines before it are checked, so that an edited line is named first.
//!
//! Where a check involves two lines, the problem names the line whose bytes no longer match:
//! a modified record is reported at its own line, found through the next line's `prev`.

use std::collections::BTreeSet;
use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};

use crate::chain::{Chain, ChainKey, LineProblem, SealProblem};
use crate::hash::Sha256Digest;
use crate::layout::{self, HEAD, HeadFile, SegmentNo};
use crate::line::{self, Seq};
use crate::roster;
use crate::tenant::TenantId;

/// Where a problem is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The file (or the directory entry, or the missing file's expected path).
    pub path: PathBuf,
    /// The 1-based line, when the problem is a line.
    pub line: Option<u64>,
    /// What is wrong.
    pub reason: Reason,
}

/// What is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reason {
    /// A file or directory could not be read.
    Io(String),
    /// An entry that the writer never creates.
    UnexpectedEntry,
    /// Lines the writer cut off at recovery and kept here: past a line of NULs, lines it had
    /// written after it (a power loss's leftovers — or an edit made to look like one).
    SetAside,
    /// The tenant asked for has no directory.
    NoSuchTenant,
    /// A segment is missing from the sequence.
    SegmentMissing,
    /// A segment other than the last is empty.
    EmptySegment,
    /// The line has no newline: a torn write (reopen the log to cut it off) or truncation.
    TornLine,
    /// The line is not a valid record.
    BadRecord(String),
    /// The record names another tenant.
    WrongTenant(TenantId),
    /// The record's `seq` is not the next one.
    SeqMismatch {
        /// The `seq` due here.
        expected: Seq,
        /// The `seq` the line has.
        found: Seq,
    },
    /// Records are missing after this point (reported where they should have been).
    MissingRecords {
        /// The first missing `seq`.
        from: Seq,
        /// The `seq` found next.
        next: Seq,
    },
    /// The log ends before the record the head names (reported where the next one should be).
    MissingTail {
        /// The first missing `seq`.
        from: Seq,
        /// The `seq` the head names.
        head: Seq,
    },
    /// The first record's `prev` is not the chain's start: 64 zeros, or in a keyed log the
    /// key's MAC of the tenant.
    BadGenesis,
    /// A keyed log's line does not vouch for itself: no MAC, or one that does not verify.
    LineMac(LineProblem),
    /// The line's bytes do not link to what a later line or the head recorded for it.
    Modified {
        /// The file that recorded the digest.
        recorded_in: PathBuf,
        /// Its line (`None` for the head).
        recorded_line: Option<u64>,
    },
    /// The head file cannot be read or parsed.
    BadHead(String),
    /// The tenant has records but no head.
    HeadMissing,
    /// The data directory holds tenant logs, or is verified with a key, but has no roster.
    RosterMissing,
    /// The directory holds no audit log at all: no writer's lock, no roster, no tenant (a
    /// wrong directory, or a log deleted whole with its roster).
    NoAuditLog,
    /// The roster has a line that is not a tenant id, or lists one twice.
    BadRoster(String),
    /// The roster lists the tenant, and its directory is gone: its log was deleted whole.
    LogDeleted,
    /// The tenant's directory holds a log that the roster does not list: placed there, or
    /// the roster was edited.
    Unlisted,
    /// The head says no record is durable yet, and more than one record stands behind it: a
    /// tenant's first record is written alone with a head naming it, so only a crash's one
    /// record can be there; the head was rewritten (hiding a cut tail?).
    GenesisBehind {
        /// The records in the log.
        records: u64,
    },
    /// The roster's or the head's seal does not fit the key given (or its absence).
    Seal(SealProblem),
    /// The record an anchor names is here, and its line is not the one the anchor was taken
    /// from.
    AnchorDiffers {
        /// The record.
        seq: Seq,
    },
    /// The log ends before the record an anchor names: the log, or its directory, was rolled
    /// back to an older copy (or its tail cut under a rewritten head). Reported where the
    /// record should be.
    RolledBack {
        /// The anchored record.
        anchored: Seq,
        /// The first record the log lacks.
        from: Seq,
    },
}

/// A record's place and the SHA-256 of its line, kept apart from the log (the collector's copy
/// of the exported record, `bulkhead.audit.seq` and `bulkhead.audit.sha256`, or a digest
/// `/v1/audit` returned): the log must still hold that very line. Neither the chain nor a key
/// shows a log rolled back to an older copy of itself; an anchor from after the copy does.
/// Written `TENANT:SEQ:SHA256`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Anchor {
    /// The tenant whose log holds the record.
    pub tenant: TenantId,
    /// The record's place in its chain.
    pub seq: Seq,
    /// The SHA-256 of its line.
    pub sha256: Sha256Digest,
}

impl std::str::FromStr for Anchor {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let shape = || format!("{s:?} is not TENANT:SEQ:SHA256");
        let mut parts = s.split(':');
        let (Some(tenant), Some(seq), Some(sha256), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(shape());
        };
        Ok(Anchor {
            tenant: tenant.parse().map_err(|e| format!("{}: {e}", shape()))?,
            seq: Seq(seq
                .bytes()
                .all(|b| b.is_ascii_digit())
                .then(|| seq.parse().ok())
                .flatten()
                .ok_or_else(shape)?),
            sha256: Sha256Digest::from_hex(sha256).ok_or_else(shape)?,
        })
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Io(e) => write!(f, "cannot read: {e}"),
            Self::UnexpectedEntry => f.write_str("unexpected entry (the writer never creates it)"),
            Self::SetAside => f.write_str(
                "lines the writer cut off its log at recovery and kept here: past a block of \
                 NULs, records it had written but could not chain on (what a power loss leaves, \
                 or an edit made to look like it); compare them with the collector's copies, \
                 then remove the file",
            ),
            Self::NoSuchTenant => f.write_str("no such tenant"),
            Self::SegmentMissing => f.write_str("segment is missing"),
            Self::EmptySegment => f.write_str("segment is empty but is not the last one"),
            Self::TornLine => f.write_str("incomplete last line (torn write or truncation)"),
            Self::BadRecord(e) => write!(f, "invalid record: {e}"),
            Self::LineMac(problem) => problem.fmt(f),
            Self::WrongTenant(t) => write!(f, "record belongs to tenant {t}"),
            Self::SeqMismatch { expected, found } => {
                write!(f, "expected record seq {expected}, found seq {found}")
            }
            Self::MissingRecords { from, next } => {
                write!(
                    f,
                    "records from seq {from} are missing (next found: seq {next})"
                )
            }
            Self::MissingTail { from, head } => write!(
                f,
                "records from seq {from} on are missing: the head names seq {head} as written, \
                 and the log ends before it"
            ),
            Self::BadGenesis => {
                f.write_str("first record's prev is not the chain's start (64 zeros unkeyed)")
            }
            Self::Modified {
                recorded_in,
                recorded_line,
            } => {
                write!(
                    f,
                    "record was modified: its digest differs from the one recorded in "
                )?;
                match recorded_line {
                    Some(l) => write!(f, "{}:{l}", recorded_in.display()),
                    None => write!(f, "{}", recorded_in.display()),
                }
            }
            Self::BadHead(e) => f.write_str(e),
            Self::HeadMissing => f.write_str("tenant has records but no head file"),
            Self::RosterMissing => f.write_str(
                "the roster is missing, yet the directory holds tenant logs or is keyed (a keyed \
                 writer seals one at its first open): deleted, or logs from before the roster",
            ),
            Self::NoAuditLog => f.write_str(
                "no audit log here: no LOCK, no roster, no tenant (the wrong directory, or the \
                 log deleted whole)",
            ),
            Self::BadRoster(e) => f.write_str(e),
            Self::LogDeleted => f.write_str(
                "the roster lists this tenant, and its log directory is gone or emptied (deleted)",
            ),
            Self::Unlisted => f.write_str(
                "a log the roster does not list (placed here, or the roster was edited)",
            ),
            Self::GenesisBehind { records } => write!(
                f,
                "the head says no record is written yet, but the log holds {records}: a \
                 tenant's first record goes down alone with a head naming it, so the head was \
                 rewritten (records after the last one may have been cut)"
            ),
            Self::Seal(problem) => problem.fmt(f),
            Self::AnchorDiffers { seq } => write!(
                f,
                "record {} is not the line its anchor was taken from: rewritten",
                seq.0
            ),
            Self::RolledBack { anchored, from } => write!(
                f,
                "the log ends before record {}, which an anchor names (it lacks {} on): rolled \
                 back to an older copy, or its tail cut",
                anchored.0, from.0
            ),
        }
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(l) => write!(f, "{}:{l}: {}", self.path.display(), self.reason),
            None => write!(f, "{}: {}", self.path.display(), self.reason),
        }
    }
}

/// One tenant's result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantReport {
    /// The tenant.
    pub tenant: TenantId,
    /// Records checked before the first problem (all of them when there is none).
    pub records: u64,
    /// Segments present.
    pub segments: u64,
    /// The first problem, if any.
    pub problem: Option<Problem>,
}

/// The whole result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    /// A problem with the data directory itself (unreadable, stray entries).
    pub dir_problem: Option<Problem>,
    /// Each tenant checked, sorted by id.
    pub tenants: Vec<TenantReport>,
}

impl Report {
    /// True when nothing is wrong.
    pub fn passed(&self) -> bool {
        self.dir_problem.is_none() && self.tenants.iter().all(|t| t.problem.is_none())
    }

    /// The first problem, in directory then tenant order.
    pub fn first_problem(&self) -> Option<&Problem> {
        self.dir_problem
            .as_ref()
            .or_else(|| self.tenants.iter().find_map(|t| t.problem.as_ref()))
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(p) = &self.dir_problem {
            writeln!(f, "FAIL {p}")?;
        }
        for t in &self.tenants {
            match &t.problem {
                None => writeln!(
                    f,
                    "ok   {}: {} records in {} segments",
                    t.tenant, t.records, t.segments
                )?,
                Some(p) => writeln!(
                    f,
                    "FAIL {}: {p} (after {} good records)",
                    t.tenant, t.records
                )?,
            }
        }
        write!(f, "{}", if self.passed() { "PASS" } else { "FAIL" })
    }
}

/// Verifies every tenant under `dir` and every tenant its roster lists, or only `tenant`, as a
/// keyed log when given its `key`, as an unkeyed one otherwise.
pub fn verify(dir: &Path, tenant: Option<&TenantId>, key: Option<&ChainKey>) -> Report {
    verify_anchored(dir, tenant, key, &[])
}

/// [`verify`], and each tenant's log holds the lines `anchors` name (an anchored tenant is
/// checked even when neither its directory nor the roster is there any more).
pub fn verify_anchored(
    dir: &Path,
    tenant: Option<&TenantId>,
    key: Option<&ChainKey>,
    anchors: &[Anchor],
) -> Report {
    // The key this directory's seals were made with, derived with its id (`log_id.rs`).
    let key = match key.map(|k| crate::log_id::key_of(dir, k, false)) {
        None => None,
        Some(Ok(key)) => Some(key),
        Some(Err(e)) => {
            let path = dir.join(crate::log_id::LOG_ID);
            return Report {
                dir_problem: Some(at(&path, None, Reason::Io(e.to_string()))),
                tenants: Vec::new(),
            };
        }
    };
    let chain = Chain::new(key.as_ref());
    let (present, unexpected) = match layout::list_tenants(dir) {
        Ok(listing) => listing,
        Err(e) => {
            return Report {
                dir_problem: Some(at(dir, None, Reason::Io(e.to_string()))),
                tenants: Vec::new(),
            };
        }
    };
    let roster_path = roster::path(dir);
    // The roster's tenants, when it can be read; a problem with it is the directory's.
    let (listed, roster_problem) = match roster::read(dir) {
        Err(e) => (
            None,
            Some(at(&roster_path, None, Reason::Io(e.to_string()))),
        ),
        // A keyed writer seals an empty roster at its first open.
        Ok(None) if chain.is_keyed() => (None, Some(at(&roster_path, None, Reason::RosterMissing))),
        // A gateway that has recorded nothing yet holds its lock only.
        Ok(None) if present.is_empty() && dir.join(layout::LOCK).exists() => {
            (Some(Vec::new()), None)
        }
        Ok(None) if present.is_empty() => (None, Some(at(dir, None, Reason::NoAuditLog))),
        Ok(None) => (None, Some(at(&roster_path, None, Reason::RosterMissing))),
        Ok(Some(Err(e))) => (None, Some(at(&roster_path, None, Reason::BadRoster(e)))),
        Ok(Some(Ok(r))) => {
            let torn = (r.torn > 0).then(|| {
                at(
                    &roster_path,
                    Some(r.listed.len() as u64 + 1),
                    Reason::TornLine,
                )
            });
            let seal = r
                .check(chain)
                .err()
                .map(|p| at(&roster_path, None, Reason::Seal(p)));
            (Some(r.listed), seal.or(torn))
        }
    };
    let ids: BTreeSet<TenantId> = match tenant {
        Some(t) => BTreeSet::from([t.clone()]),
        None => present
            .iter()
            .chain(listed.iter().flatten())
            .chain(anchors.iter().map(|a| &a.tenant))
            .cloned()
            .collect(),
    };
    let stray = unexpected
        .into_iter()
        .next()
        .filter(|_| tenant.is_none())
        .map(|path| at(&path, None, Reason::UnexpectedEntry));
    // Once for the run: the probe takes the writer's lock shared for a moment.
    let writing = writer_active(dir);
    Report {
        dir_problem: roster_problem.or(stray),
        tenants: ids
            .iter()
            .map(|t| {
                let anchors: Vec<&Anchor> = anchors.iter().filter(|a| a.tenant == *t).collect();
                match &listed {
                    Some(listed) => against_roster(
                        dir,
                        (chain, writing),
                        t,
                        (present.contains(t), listed.contains(t)),
                        &anchors,
                    ),
                    None => verify_tenant(dir, (chain, writing), t, &anchors),
                }
            })
            .collect(),
    }
}

/// [`verify_tenant`], once the tenant's directory agrees with the roster: a listed tenant has
/// its directory and its head, and a directory no line lists holds at most a genesis head (a
/// crash between making and listing it).
fn against_roster(
    dir: &Path,
    (chain, writing): (Chain<'_>, bool),
    tenant: &TenantId,
    (present, listed): (bool, bool),
    anchors: &[&Anchor],
) -> TenantReport {
    let tdir = layout::tenant_dir(dir, tenant);
    let io = |e: std::io::Error| Some(Reason::Io(e.to_string()));
    let problem = match (present, listed) {
        // Made since the directory was listed (a live writer): not gone.
        (false, true) if tdir.is_dir() => None,
        (false, true) => Some(Reason::LogDeleted),
        (true, true) => match roster::is_emptied(&tdir) {
            Ok(true) => Some(Reason::LogDeleted),
            Ok(false) => None,
            Err(e) => io(e),
        },
        (true, false) => match roster::is_unbegun(chain, tenant, &tdir) {
            Ok(true) => None,
            Ok(false) => Some(Reason::Unlisted),
            Err(e) => io(e),
        },
        (false, false) => None,
    };
    match problem {
        Some(reason) => TenantReport {
            tenant: tenant.clone(),
            records: 0,
            segments: 0,
            problem: Some(at(&tdir, None, reason)),
        },
        None => verify_tenant(dir, (chain, writing), tenant, anchors),
    }
}

/// Checks `tenant`'s log with `chain`; with `writing`, a writer holds the log
/// ([`writer_active`]).
fn verify_tenant(
    dir: &Path,
    (chain, writing): (Chain<'_>, bool),
    tenant: &TenantId,
    anchors: &[&Anchor],
) -> TenantReport {
    let mut report = TenantReport {
        tenant: tenant.clone(),
        records: 0,
        segments: 0,
        problem: None,
    };
    let tdir = layout::tenant_dir(dir, tenant);
    if let Err(p) = check_tenant(&tdir, chain, (tenant, anchors), writing, &mut report) {
        report.problem = Some(p);
    }
    report
}

/// Whether a writer (a running gateway) holds the lock of the log in `dir` now: the last line
/// of a tenant's log may then be one it is still writing.
fn writer_active(dir: &Path) -> bool {
    let Ok(lock) = fs::File::open(dir.join(layout::LOCK)) else {
        return false;
    };
    matches!(lock.try_lock_shared(), Err(fs::TryLockError::WouldBlock))
}

fn at(path: &Path, line: Option<u64>, reason: Reason) -> Problem {
    Problem {
        path: path.to_owned(),
        line,
        reason,
    }
}

/// Checks one tenant's log; with `writing`, a writer holds the log (see [`writer_active`]).
fn check_tenant(
    tdir: &Path,
    chain: Chain<'_>,
    (tenant, anchors): (&TenantId, &[&Anchor]),
    writing: bool,
    report: &mut TenantReport,
) -> Result<(), Problem> {
    // The head first, then the segments: a running gateway that rotates between the two
    // reads adds a segment the listing still sees, where the other order missed the segment
    // a newer head names (a false "records deleted").
    let head_path = tdir.join(HEAD);
    let head = layout::read_head(tdir).map_err(|e| at(&head_path, None, Reason::BadHead(e)));
    let listing = match layout::list_tenant(tdir) {
        Ok(l) => l,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let reason = match anchors.iter().map(|a| a.seq).max() {
                Some(anchored) => Reason::RolledBack {
                    anchored,
                    from: Seq(0),
                },
                None => Reason::NoSuchTenant,
            };
            return Err(at(tdir, None, reason));
        }
        Err(e) => return Err(at(tdir, None, Reason::Io(e.to_string()))),
    };
    if let Some(path) = listing.unexpected.first() {
        return Err(at(path, None, Reason::UnexpectedEntry));
    }
    let head = head?;
    // A seal with no key or another key: no link can be checked. A missing or broken one is
    // reported after the lines.
    let seal = match &head {
        Some((head, seal)) => head.check(chain, tenant, seal.as_ref()).err(),
        None => None,
    };
    if let Some(p @ (SealProblem::Keyed | SealProblem::WrongKey)) = seal {
        return Err(at(&head_path, None, Reason::Seal(p)));
    }
    let head = head.map(|(head, _)| head);
    // The genesis head names no record: every record is past it, none acknowledged yet.
    let genesis = head == Some(HeadFile::Genesis);
    let head = match head {
        Some(HeadFile::At(h)) => Some(h),
        Some(HeadFile::Genesis) | None => None,
    };
    report.segments = listing.segments.len() as u64;

    let mut next_seq = Seq(0);
    let mut prev = chain.genesis(tenant);
    // Where the previous line is: (file, line number).
    let mut prev_at: Option<(PathBuf, u64)> = None;
    // The location and digest of the record the head names, once seen, and how many records
    // come before it.
    let mut head_seen: Option<(PathBuf, u64, Sha256Digest, u64)> = None;
    let last_index = listing.segments.len().saturating_sub(1);
    for (index, (number, path)) in listing.segments.iter().enumerate() {
        let expected = SegmentNo(index as u64);
        if *number != expected {
            return Err(at(
                &layout::segment_path(tdir, expected),
                None,
                Reason::SegmentMissing,
            ));
        }
        let bytes = fs::read(path).map_err(|e| at(path, None, Reason::Io(e.to_string())))?;
        if bytes.is_empty() && index != last_index {
            return Err(at(path, None, Reason::EmptySegment));
        }
        let (lines, tail) = line::split(&bytes);
        for (i, l) in lines.iter().enumerate() {
            let n = i as u64 + 1;
            let parsed = line::decode(l).map_err(|e| at(path, Some(n), Reason::BadRecord(e)))?;
            // Keyed, a line vouches for itself first: an edit anywhere in it, its `seq` and
            // `prev` too, is named at its own line.
            let link = chain
                .link(l)
                .map_err(|problem| at(path, Some(n), Reason::LineMac(problem)))?;
            if parsed.seq != next_seq {
                return Err(match &prev_at {
                    // The first line of a segment skips ahead: the earlier segment lost its end.
                    Some((prev_path, prev_line)) if i == 0 && parsed.seq > next_seq => at(
                        prev_path,
                        Some(prev_line + 1),
                        Reason::MissingRecords {
                            from: next_seq,
                            next: parsed.seq,
                        },
                    ),
                    _ => at(
                        path,
                        Some(n),
                        Reason::SeqMismatch {
                            expected: next_seq,
                            found: parsed.seq,
                        },
                    ),
                });
            }
            if parsed.prev != prev {
                return Err(match &prev_at {
                    Some((prev_path, prev_line)) => {
                        // The previous record, counted, is the one modified.
                        report.records -= 1;
                        at(
                            prev_path,
                            Some(*prev_line),
                            Reason::Modified {
                                recorded_in: path.clone(),
                                recorded_line: Some(n),
                            },
                        )
                    }
                    None => at(path, Some(n), Reason::BadGenesis),
                });
            }
            if parsed.record.tenant != *tenant {
                return Err(at(path, Some(n), Reason::WrongTenant(parsed.record.tenant)));
            }
            if anchors
                .iter()
                .any(|a| a.seq == parsed.seq && a.sha256 != Sha256Digest::of(l))
            {
                return Err(at(path, Some(n), Reason::AnchorDiffers { seq: parsed.seq }));
            }
            prev = link;
            if head.is_some_and(|h| h.seq == parsed.seq) {
                head_seen = Some((path.clone(), n, prev, report.records));
            }
            prev_at = Some((path.clone(), n));
            report.records += 1;
            // No overflow: a seq of u64::MAX cannot be followed by a matching one.
            next_seq = Seq(next_seq.0.saturating_add(1));
        }
        // While a writer holds the log, a line cut short at the end of the last segment, past
        // the head's record, is one it is writing as it is read: not yet acknowledged, as
        // every record past the head (a restart cuts it if it was never finished).
        let writing_it = writing && index == last_index && (head.is_none() || head_seen.is_some());
        if !tail.is_empty() && !writing_it {
            return Err(at(path, Some(lines.len() as u64 + 1), Reason::TornLine));
        }
    }
    if let Some(p) = seal {
        return Err(at(&head_path, None, Reason::Seal(p)));
    }
    // The furthest anchor past the log's end.
    if let Some(a) = anchors
        .iter()
        .filter(|a| a.seq >= next_seq)
        .max_by_key(|a| a.seq)
    {
        let reason = Reason::RolledBack {
            anchored: a.seq,
            from: next_seq,
        };
        return Err(match &prev_at {
            Some((path, line)) => at(path, Some(line + 1), reason),
            None => at(tdir, None, reason),
        });
    }
    match (head, head_seen) {
        (None, _) if report.records > 0 && !genesis => {
            Err(at(&head_path, None, Reason::HeadMissing))
        }
        (None, _) if report.records > 1 => Err(at(
            &head_path,
            None,
            Reason::GenesisBehind {
                records: report.records,
            },
        )),
        (None, _) => Ok(()),
        (Some(h), None) => Err(match prev_at {
            Some((path, line)) => at(
                &path,
                Some(line + 1),
                Reason::MissingTail {
                    from: next_seq,
                    head: h.seq,
                },
            ),
            None => at(
                &listing.segments.first().map_or_else(
                    || layout::segment_path(tdir, SegmentNo(0)),
                    |(_, p)| p.clone(),
                ),
                None,
                Reason::MissingTail {
                    from: next_seq,
                    head: h.seq,
                },
            ),
        }),
        (Some(h), Some((path, line, digest, before))) if digest != h.digest => {
            report.records = before;
            Err(at(
                &path,
                Some(line),
                Reason::Modified {
                    recorded_in: head_path,
                    recorded_line: None,
                },
            ))
        }
        (Some(_), Some(_)) => Ok(()),
    }?;
    // Checked whole, the chain holds; lines recovery set aside past a break are reported
    // until an operator has accounted for them.
    match listing.set_aside.first() {
        Some(path) => Err(at(path, None, Reason::SetAside)),
        None => Ok(()),
    }
}
