//! The data directory's layout:
//!
//! ```text
//! DIR/LOCK                          held (flock) by the one writer
//! DIR/TENANTS                       the roster: every tenant whose log began, one per line;
//!                                   keyed: then "hmac-sha256 <key id> <mac>\n"
//! DIR/TENANTS.tmp                   a keyed roster's next version, before its rename
//! DIR/LOG-ID                        keyed: the directory's id, which its seals' key is
//!                                   derived with (see `log_id.rs`)
//! DIR/LOG-ID.tmp                    that id, before its rename
//! DIR/<tenant>/<segment>.jsonl      segment numbers from 0, 20 digits, contiguous
//! DIR/<tenant>/head                 "<seq> <link to that line>\n": a durable record; or
//!                                   "genesis\n": none yet; keyed: the link is the line's
//!                                   own MAC (already in the line), and
//!                                   " hmac-sha256 <key id> <mac>" before the newline
//! DIR/<tenant>/head.tmp             the next head, before its rename
//! DIR/<tenant>/<segment>-<offset>.set-aside
//!                                   keyed: what recovery cut off a segment at that offset,
//!                                   past a break a power loss leaves (see `log.rs`), kept
//!                                   for `verify` to report until an operator removes it
//! ```
//!
//! A keyed log's seals (see [`crate::ChainKey`]) are what say it is keyed: the roster's last line
//! and every head carry one; an unkeyed log's carry none.
//!
//! The head is rewritten after every group commit, once the segments are fsynced. It is a lower
//! bound: the record it names must exist with that digest, so deleting a tenant's last lines
//! or last segment is detected even though the chain itself looks complete. A tenant's
//! directory gets the genesis head before its first segment, so a tenant with records and no
//! head file lost it to a deletion, never to a crash.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use crate::chain::{Chain, Seal, SealProblem, Sealed};
use crate::hash::Sha256Digest;
use crate::line::Seq;
use crate::tenant::TenantId;

pub(crate) const LOCK: &str = "LOCK";
pub(crate) const HEAD: &str = "head";
pub(crate) const HEAD_TMP: &str = "head.tmp";
const SEGMENT_DIGITS: usize = 20;
const SEGMENT_EXT: &str = ".jsonl";
const SET_ASIDE_EXT: &str = ".set-aside";

/// A segment's number: its place in its tenant's sequence of files, from 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SegmentNo(pub u64);

pub(crate) fn tenant_dir(dir: &Path, tenant: &TenantId) -> PathBuf {
    dir.join(tenant.as_str())
}

pub(crate) fn segment_path(tenant_dir: &Path, n: SegmentNo) -> PathBuf {
    tenant_dir.join(format!(
        "{:0width$}{SEGMENT_EXT}",
        n.0,
        width = SEGMENT_DIGITS
    ))
}

fn parse_segment_name(name: &str) -> Option<SegmentNo> {
    let digits = name.strip_suffix(SEGMENT_EXT)?;
    if digits.len() != SEGMENT_DIGITS || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok().map(SegmentNo)
}

/// Where recovery keeps what it cut off `segment` at `offset` (see [`SET_ASIDE_EXT`]).
pub(crate) fn set_aside_path(tenant_dir: &Path, segment: SegmentNo, offset: u64) -> PathBuf {
    tenant_dir.join(format!(
        "{:0width$}-{offset}{SET_ASIDE_EXT}",
        segment.0,
        width = SEGMENT_DIGITS
    ))
}

fn is_set_aside_name(name: &str) -> bool {
    name.strip_suffix(SET_ASIDE_EXT)
        .and_then(|s| s.split_once('-'))
        .is_some_and(|(segment, offset)| {
            segment.len() == SEGMENT_DIGITS
                && segment.bytes().all(|b| b.is_ascii_digit())
                && offset.parse::<u64>().is_ok()
        })
}

/// What a tenant directory holds.
#[derive(Debug, Default)]
pub(crate) struct Listing {
    /// Segments, sorted by number.
    pub segments: Vec<(SegmentNo, PathBuf)>,
    /// Lines recovery set aside, sorted.
    pub set_aside: Vec<PathBuf>,
    /// Entries that are none of those nor the head, sorted.
    pub unexpected: Vec<PathBuf>,
}

pub(crate) fn list_tenant(tenant_dir: &Path) -> io::Result<Listing> {
    let mut listing = Listing::default();
    for entry in fs::read_dir(tenant_dir)? {
        let entry = entry?;
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_str();
        let is_file = entry.file_type()?.is_file();
        match name.and_then(parse_segment_name) {
            Some(n) if is_file => listing.segments.push((n, path)),
            _ if is_file && matches!(name, Some(HEAD | HEAD_TMP)) => {}
            _ if is_file && name.is_some_and(is_set_aside_name) => listing.set_aside.push(path),
            _ => listing.unexpected.push(path),
        }
    }
    listing.segments.sort();
    listing.set_aside.sort();
    listing.unexpected.sort();
    Ok(listing)
}

/// The tenants of a data directory, and the entries that are not tenant directories.
pub(crate) fn list_tenants(dir: &Path) -> io::Result<(Vec<TenantId>, Vec<PathBuf>)> {
    let mut tenants = Vec::new();
    let mut unexpected = Vec::new();
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        let is_dir = entry.file_type()?.is_dir();
        match name.to_str().map(TenantId::new) {
            Some(Ok(t)) if is_dir => tenants.push(t),
            _ if !is_dir
                && matches!(
                    name.to_str(),
                    Some(
                        LOCK | crate::roster::ROSTER
                            | crate::roster::ROSTER_TMP
                            | crate::log_id::LOG_ID
                            | crate::log_id::LOG_ID_TMP
                    )
                ) => {}
            _ => unexpected.push(entry.path()),
        }
    }
    tenants.sort();
    unexpected.sort();
    Ok((tenants, unexpected))
}

/// A durable record the head names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Head {
    pub seq: Seq,
    /// The link to that record's line (see [`Chain::link`]).
    pub digest: Sha256Digest,
}

impl Head {
    /// `<seq> <link>`.
    fn statement(&self) -> String {
        format!("{} {}", self.seq, self.digest)
    }

    /// Strict: `<seq without leading zeros> <64 hex>`, nothing else.
    fn parse(text: &str) -> Option<Self> {
        let (seq, digest) = text.split_once(' ')?;
        let canonical = !seq.is_empty()
            && seq.bytes().all(|b| b.is_ascii_digit())
            && (seq == "0" || !seq.starts_with('0'));
        if !canonical {
            return None;
        }
        Some(Self {
            seq: Seq(seq.parse().ok()?),
            digest: Sha256Digest::from_hex(digest)?,
        })
    }
}

/// What a head file says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HeadFile {
    /// No record is durable yet.
    Genesis,
    /// This record is durable.
    At(Head),
}

impl HeadFile {
    const GENESIS: &str = "genesis";

    /// What it states, without seal or newline: what a keyed log's seal vouches for.
    fn statement(&self) -> String {
        match self {
            Self::Genesis => Self::GENESIS.to_owned(),
            Self::At(head) => head.statement(),
        }
    }

    /// The file: its statement, then its seal in a keyed log, then a newline.
    pub fn encode(&self, chain: Chain<'_>, tenant: &TenantId) -> String {
        let statement = self.statement();
        let sealed = Sealed::Head {
            tenant,
            statement: &statement,
        };
        match chain.seal(sealed) {
            None => format!("{statement}\n"),
            Some(seal) => format!("{statement} {}\n", seal.encode()),
        }
    }

    /// Strict: what [`HeadFile::encode`] writes, and nothing else. The seal is not checked
    /// here: [`HeadFile::check`] does.
    pub fn decode(bytes: &[u8]) -> Option<(Self, Option<Seal>)> {
        let text = std::str::from_utf8(bytes).ok()?.strip_suffix('\n')?;
        let (statement, seal) = match text.find(Seal::TAG) {
            Some(at) => (
                text[..at].strip_suffix(' ')?,
                Some(Seal::decode(&text[at..])?),
            ),
            None => (text, None),
        };
        let head = match statement {
            Self::GENESIS => Self::Genesis,
            _ => Self::At(Head::parse(statement)?),
        };
        Some((head, seal))
    }

    /// Whether `seal` is the one `chain` gives this head of `tenant`'s.
    pub fn check(
        &self,
        chain: Chain<'_>,
        tenant: &TenantId,
        seal: Option<&Seal>,
    ) -> Result<(), SealProblem> {
        let statement = self.statement();
        let sealed = Sealed::Head {
            tenant,
            statement: &statement,
        };
        chain.check(sealed, seal)
    }
}

/// Reads the head and its seal, unchecked: `Ok(None)` when there is none, `Err` with a reason
/// when it is unreadable.
pub(crate) fn read_head(tenant_dir: &Path) -> Result<Option<(HeadFile, Option<Seal>)>, String> {
    match fs::read(tenant_dir.join(HEAD)) {
        Ok(bytes) => HeadFile::decode(&bytes).map(Some).ok_or_else(|| {
            "head file is malformed (expected \"<seq> <digest>\" or \"genesis\", then \
             \" hmac-sha256 <key id> <mac>\" in a keyed log, and a newline)"
                .to_owned()
        }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("cannot read head file: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_names_round_trip_and_are_strict() {
        let p = segment_path(Path::new("d"), SegmentNo(7));
        assert_eq!(p, Path::new("d/00000000000000000007.jsonl"));
        let name = p.file_name().and_then(|n| n.to_str()).unwrap();
        assert_eq!(parse_segment_name(name), Some(SegmentNo(7)));
        assert_eq!(parse_segment_name("7.jsonl"), None);
        assert_eq!(parse_segment_name("0000000000000000000a.jsonl"), None);
        assert_eq!(parse_segment_name("99999999999999999999.jsonl"), None);
    }

    fn unkeyed(head: HeadFile) -> String {
        head.encode(Chain::new(None), &TenantId::new("a").expect("valid"))
    }

    #[test]
    fn head_is_strict() {
        let h = Head {
            seq: Seq(12),
            digest: Sha256Digest::of(b"x"),
        };
        let at = |bytes: &[u8]| HeadFile::decode(bytes).map(|(h, _)| h);
        assert_eq!(
            at(unkeyed(HeadFile::At(h)).as_bytes()),
            Some(HeadFile::At(h))
        );
        let z = format!("0 {}\n", Sha256Digest::ZERO);
        assert!(at(z.as_bytes()).is_some());
        for bad in [
            format!("012 {}\n", h.digest),
            format!("12 {}", h.digest),
            format!("12  {}\n", h.digest),
            format!("+12 {}\n", h.digest),
            format!("12 {}\n\n", h.digest),
        ] {
            assert_eq!(at(bad.as_bytes()), None, "{bad:?}");
        }
    }

    #[test]
    fn the_genesis_head_is_one_exact_line() {
        let genesis = unkeyed(HeadFile::Genesis);
        assert_eq!(
            HeadFile::decode(genesis.as_bytes()),
            Some((HeadFile::Genesis, None))
        );
        for bad in ["genesis", "genesis\n\n", "Genesis\n", " genesis\n"] {
            assert_eq!(HeadFile::decode(bad.as_bytes()), None, "{bad:?}");
        }
        let h = Head {
            seq: Seq(3),
            digest: Sha256Digest::of(b"x"),
        };
        assert_eq!(
            HeadFile::decode(unkeyed(HeadFile::At(h)).as_bytes()),
            Some((HeadFile::At(h), None))
        );
    }

    #[test]
    fn a_keyed_head_carries_its_seal() {
        let key = crate::ChainKey::new([7; 32]).expect("long enough");
        let (chain, a) = (Chain::new(Some(&key)), TenantId::new("a").expect("valid"));
        for head in [
            HeadFile::Genesis,
            HeadFile::At(Head {
                seq: Seq(3),
                digest: Sha256Digest::of(b"x"),
            }),
        ] {
            let text = head.encode(chain, &a);
            assert!(text.contains(" hmac-sha256 "), "{text}");
            let (decoded, seal) = HeadFile::decode(text.as_bytes()).expect("decodes");
            assert_eq!(decoded, head);
            assert_eq!(decoded.check(chain, &a, seal.as_ref()), Ok(()));
            let bare = unkeyed(head);
            let (_, none) = HeadFile::decode(bare.as_bytes()).expect("decodes");
            assert_eq!(
                head.check(chain, &a, none.as_ref()),
                Err(SealProblem::Unkeyed)
            );
            let spaced = text.replace(" hmac", "  hmac");
            assert_eq!(HeadFile::decode(spaced.as_bytes()), None, "{spaced:?}");
        }
    }
}
