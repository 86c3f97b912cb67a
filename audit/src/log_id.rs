//! A keyed data directory's id: `DIR/LOG-ID`, 32 hex digits and a newline, made at the
//! directory's first keyed open. A keyed log's lines, heads and roster are sealed with a key
//! derived from the operator's key and this id ([`ChainKey::for_log`]), so the logs of two
//! directories written with one key — gateway replicas on a shared volume, each in its own —
//! are sealed apart: a tenant's log copied from one into the other verifies in neither, where
//! every MAC of it held (the chain's start is a MAC of the tenant alone).
//!
//! A directory keyed before ids were made has none: its logs are sealed with the key itself.
//! The id is no secret; it is part of the log, and goes wherever the log goes.

use std::fs::{self, File};
use std::io::{self, Write as _};
use std::path::Path;

use crate::chain::ChainKey;
use crate::hash::{from_hex, to_hex};

/// The id's file in the data directory.
pub(crate) const LOG_ID: &str = "LOG-ID";
/// Its first version, before its rename.
pub(crate) const LOG_ID_TMP: &str = "LOG-ID.tmp";

/// 128 random bits naming one data directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LogId(pub [u8; 16]);

impl LogId {
    fn encode(&self) -> String {
        format!("{}\n", to_hex(&self.0))
    }

    /// Strict: 32 lowercase hex digits and a newline, nothing else.
    fn parse(bytes: &[u8]) -> Option<LogId> {
        let hex = std::str::from_utf8(bytes.strip_suffix(b"\n")?).ok()?;
        from_hex(hex).map(LogId)
    }
}

/// Why a directory's id cannot be used.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LogIdError {
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("not 32 lowercase hex digits and a newline: edited")]
    Malformed,
}

/// The id of the data directory `dir`, if it has one.
fn read(dir: &Path) -> Result<Option<LogId>, LogIdError> {
    match fs::read(dir.join(LOG_ID)) {
        Ok(bytes) => LogId::parse(&bytes).map(Some).ok_or(LogIdError::Malformed),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Gives the data directory `dir` a fresh id, durably: the file, then a rename.
fn create(dir: &Path) -> io::Result<LogId> {
    let id = LogId(rand::random());
    let tmp = dir.join(LOG_ID_TMP);
    let mut file = File::create(&tmp)?;
    file.write_all(id.encode().as_bytes())?;
    file.sync_all()?;
    fs::rename(&tmp, dir.join(LOG_ID))?;
    File::open(dir)?.sync_all()?;
    Ok(id)
}

/// The key `dir`'s logs are sealed with, from the operator's `key`: derived with the
/// directory's id, or `key` itself in a directory keyed before ids were made. With `create`
/// (a writer opening a new directory), a directory without an id is given one first.
pub(crate) fn key_of(dir: &Path, key: &ChainKey, create: bool) -> Result<ChainKey, LogIdError> {
    let id = match read(dir)? {
        None if create => Some(self::create(dir)?),
        id => id,
    };
    Ok(id.map_or_else(|| key.clone(), |id| key.for_log(&id)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_round_trips_and_anything_else_is_malformed() {
        let id = LogId([0xab; 16]);
        assert_eq!(LogId::parse(id.encode().as_bytes()), Some(id));
        let text = id.encode();
        for bad in [
            text.trim_end().to_owned(),
            text.to_uppercase(),
            format!("{text}\n"),
            format!("0{text}"),
            text.replacen('a', "g", 1),
        ] {
            assert_eq!(LogId::parse(bad.as_bytes()), None, "{bad:?}");
        }
    }
}
