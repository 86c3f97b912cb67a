//! One log line: `{"seq":N,"prev":"<hex>",...record fields}` followed by `\n`; in a keyed
//! log, with the line's own MAC first: `{"mac":"<hex>","seq":N,...}` (see `Chain::write`).
//!
//! `prev` is the link to the previous line — its exact bytes' SHA-256 (without the newline),
//! or in a keyed log the MAC it carries — or, for the tenant's first record, the chain's start
//! ([`Sha256Digest::ZERO`] unkeyed; see `Chain::genesis`); `seq` counts the tenant's records
//! from 0. Both continue across segments.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::hash::Sha256Digest;
use crate::record::AuditRecord;

/// A record's position in its tenant's chain, counted from 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Seq(pub u64);

impl fmt::Display for Seq {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

#[derive(Deserialize)]
struct LineIn {
    seq: Seq,
    prev: Sha256Digest,
    #[serde(flatten)]
    record: AuditRecord,
}

/// A parsed line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Parsed {
    pub seq: Seq,
    pub prev: Sha256Digest,
    pub record: AuditRecord,
}

/// A record's fields as its line holds them after `seq` and `prev`: serialized before the
/// record has a place in its chain, out of the log's lock (a record that captured a large
/// prompt takes milliseconds, which every tenant's appends waited for).
pub(crate) struct Fields(Vec<u8>);

impl Fields {
    pub fn of(record: &AuditRecord) -> Result<Fields, serde_json::Error> {
        serde_json::to_vec(record).map(Fields)
    }
}

/// Encodes a line, without its newline.
pub(crate) fn encode(seq: Seq, prev: Sha256Digest, fields: &Fields) -> Vec<u8> {
    let rest = fields.0.strip_prefix(b"{").unwrap_or(&fields.0);
    let mut line = Vec::with_capacity(100 + rest.len());
    line.extend_from_slice(format!("{{\"seq\":{},\"prev\":\"{prev}\"", seq.0).as_bytes());
    if rest != b"}" {
        line.push(b',');
    }
    line.extend_from_slice(rest);
    line
}

/// Parses a line (without its newline). The error says why, for a person.
pub(crate) fn decode(line: &[u8]) -> Result<Parsed, String> {
    let text = std::str::from_utf8(line).map_err(|e| format!("not UTF-8: {e}"))?;
    let parsed: LineIn =
        serde_json::from_str(text).map_err(|e| format!("not a valid record: {e}"))?;
    Ok(Parsed {
        seq: parsed.seq,
        prev: parsed.prev,
        record: parsed.record,
    })
}

/// Splits a segment's bytes into complete lines (without newlines) and the torn tail: the
/// bytes after the last newline, empty when the segment ends cleanly.
pub(crate) fn split(bytes: &[u8]) -> (Vec<&[u8]>, &[u8]) {
    let complete = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    let (body, tail) = bytes.split_at(complete);
    let lines = if body.is_empty() {
        Vec::new()
    } else {
        body[..body.len() - 1].split(|&b| b == b'\n').collect()
    };
    (lines, tail)
}
