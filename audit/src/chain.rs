//! Links and seals: what makes a chain, unkeyed or keyed.
//!
//! A line's *link* is the next line's `prev`. In an unkeyed log it is SHA-256 of the line's
//! exact bytes. In a keyed one every line carries its own MAC — HMAC-SHA256 under the
//! operator's [`ChainKey`] of the rest of the line, written first: `{"mac":"<hex>","seq":…}` —
//! and that MAC is its link: each line vouches for itself, the last one too, where a link kept
//! only in the next line would leave the last line (and a line past a head put back from an
//! older copy) to be replaced by anyone who can write the file. A keyed log also *seals* the
//! files that state what the chain cannot witness itself — each tenant's head (how far the
//! chain reached) and the roster (which tenants have one) — with a [`Seal`]: the key's id and
//! an HMAC-SHA256 over what the file states. Without the key, no one can compute a line's MAC
//! or a seal, so an edited record, a forged line, a cut tail under a rewritten head, or a
//! roster with a tenant struck off no longer verifies.
//!
//! The writer, its crash recovery and the verifier all go through one [`Chain`].

use std::fmt;
use std::fs;
use std::io;
use std::path::Path;

use hmac::{Hmac, Mac as _};
use sha2::Sha256;

use crate::hash::{self, Sha256Digest};
use crate::tenant::TenantId;

type HmacSha256 = Hmac<Sha256>;

/// The fewest bytes a [`ChainKey`]'s secret may have: HMAC-SHA256's output length.
pub const MIN_KEY_LEN: usize = 32;

/// The secret a keyed log's links and seals are computed with. Its `Debug` shows only its id.
#[derive(Clone)]
pub struct ChainKey {
    secret: Vec<u8>,
    /// The operator's key's id: a directory's key (see [`ChainKey::for_log`]) keeps the id of
    /// the key it was derived from, so a seal names the key the operator holds.
    id: KeyId,
}

/// Why a secret is not a [`ChainKey`].
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// The key file cannot be read.
    #[error("cannot read the key file: {0}")]
    Unreadable(#[source] io::Error),
    /// The key file's first line is empty.
    #[error("the key file's first line is empty: it must hold the secret")]
    Empty,
    /// The secret is too short to resist guessing.
    #[error(
        "the secret is {len} bytes, and at least {MIN_KEY_LEN} are needed (e.g. the output of `openssl rand -hex 32`)"
    )]
    TooShort {
        /// Its length.
        len: usize,
    },
}

impl ChainKey {
    /// A key from `secret` (at least [`MIN_KEY_LEN`] bytes).
    pub fn new(secret: impl Into<Vec<u8>>) -> Result<Self, KeyError> {
        let secret = secret.into();
        match secret.len() {
            0 => Err(KeyError::Empty),
            len if len < MIN_KEY_LEN => Err(KeyError::TooShort { len }),
            _ => {
                let id = Self::id_of(&secret);
                Ok(Self { secret, id })
            }
        }
    }

    /// The key in the file at `path`: its first line, without surrounding whitespace.
    pub fn read(path: &Path) -> Result<Self, KeyError> {
        let bytes = fs::read(path).map_err(KeyError::Unreadable)?;
        let first = bytes.split(|&b| b == b'\n').next().unwrap_or_default();
        Self::new(first.trim_ascii())
    }

    /// The key's id: a MAC of a constant, so a seal can tell a wrong key from an edited file
    /// without giving the key away.
    pub fn id(&self) -> KeyId {
        self.id
    }

    fn id_of(secret: &[u8]) -> KeyId {
        let mut mac = HmacSha256::new_from_slice(secret).expect("HMAC takes a key of any length");
        mac.update(b"bulkhead-audit key id");
        let mut id = [0; 8];
        id.copy_from_slice(&mac.finalize().into_bytes()[..8]);
        KeyId(id)
    }

    /// The key the logs of the data directory `id` names are sealed with: a MAC of the id
    /// under this key (see [`crate::log_id`]).
    pub(crate) fn for_log(&self, id: &crate::log_id::LogId) -> ChainKey {
        ChainKey {
            secret: self.mac(&[b"bulkhead-audit log\n", &id.0]).0.to_vec(),
            id: self.id,
        }
    }

    fn hmac(&self, parts: &[&[u8]]) -> HmacSha256 {
        let mut mac =
            HmacSha256::new_from_slice(&self.secret).expect("HMAC takes a key of any length");
        for part in parts {
            mac.update(part);
        }
        mac
    }

    fn mac(&self, parts: &[&[u8]]) -> Sha256Digest {
        Sha256Digest(self.hmac(parts).finalize().into_bytes().into())
    }
}

impl fmt::Debug for ChainKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ChainKey({}, secret redacted)", self.id())
    }
}

/// The id of a [`ChainKey`]: the first 8 bytes of its MAC of a constant, in 16 hex digits.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct KeyId([u8; 8]);

impl fmt::Display for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hash::to_hex(&self.0))
    }
}

impl fmt::Debug for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KeyId({self})")
    }
}

/// A keyed file's seal, written `hmac-sha256 <key id> <mac>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Seal {
    key: KeyId,
    mac: Sha256Digest,
}

impl Seal {
    /// What a seal's text starts with.
    pub const TAG: &str = "hmac-sha256 ";

    pub fn encode(&self) -> String {
        format!("{}{} {}", Self::TAG, self.key, self.mac)
    }

    /// Strict: the tag, 16 hex digits, a space, 64 hex digits.
    pub fn decode(text: &str) -> Option<Self> {
        let (key, mac) = text.strip_prefix(Self::TAG)?.split_once(' ')?;
        Some(Self {
            key: KeyId(hash::from_hex(key)?),
            mac: Sha256Digest::from_hex(mac)?,
        })
    }
}

/// What a seal vouches for.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Sealed<'a> {
    /// A tenant's head file, by what it states (without its seal and newline).
    Head {
        /// The tenant.
        tenant: &'a TenantId,
        /// What it states.
        statement: &'a str,
    },
    /// The roster, by its lines before the seal.
    Roster {
        /// Those lines, with their newlines.
        listing: &'a [u8],
    },
}

impl Sealed<'_> {
    fn mac(&self, key: &ChainKey) -> HmacSha256 {
        // Each starts with its own label, and a log line with `{`: no message is another's.
        match self {
            Self::Head { tenant, statement } => key.hmac(&[
                b"bulkhead-audit head\n",
                tenant.as_str().as_bytes(),
                b"\n",
                statement.as_bytes(),
            ]),
            Self::Roster { listing } => key.hmac(&[b"bulkhead-audit roster\n", listing]),
        }
    }
}

/// Why a file's seal, or its lack, does not fit the key the log is opened or verified with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SealProblem {
    /// The file is sealed (the log is keyed), and no key was given.
    #[error("keyed: pass --key-file to verify it (this log is sealed with HMAC-SHA256)")]
    Keyed,
    /// The file is not sealed (the log is unkeyed), and a key was given.
    #[error(
        "no seal, yet a key was given: an unkeyed log (anyone who can write it can rewrite it), \
         or a keyed one's file rewritten without the key"
    )]
    Unkeyed,
    /// The file was sealed with another key.
    #[error("sealed with another key: the key given does not match this log's")]
    WrongKey,
    /// The seal names this key and does not verify: the file was edited.
    #[error("the seal does not verify under the key it names (the key given): edited")]
    Broken,
}

/// What a keyed line starts with: `{"mac":"`, then its MAC in 64 hex digits and `",`, then the
/// fields the MAC covers (the line without this prefix starts `{` again).
const LINE_MAC: &[u8] = b"{\"mac\":\"";

/// The length of a keyed line's MAC prefix.
const LINE_MAC_LEN: usize = LINE_MAC.len() + 64 + 2;

/// Why a keyed log's line does not vouch for itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum LineProblem {
    /// The line does not start with a MAC.
    #[error(
        "the line carries no MAC: a keyed log's lines each start with their own (a keyed log \
         written before lines carried one opens only with the build that wrote it)"
    )]
    NoMac,
    /// The MAC does not verify over the rest of the line.
    #[error("the line's MAC does not verify: edited, or written without the key")]
    BadMac,
}

/// A log's chain: unkeyed, or keyed with the key borrowed from its owner.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Chain<'a> {
    key: Option<&'a ChainKey>,
}

impl<'a> Chain<'a> {
    pub fn new(key: Option<&'a ChainKey>) -> Self {
        Self { key }
    }

    /// Whether the log is keyed.
    pub fn is_keyed(&self) -> bool {
        self.key.is_some()
    }

    /// The line to write for `body` (an encoded record, a JSON object, without the newline)
    /// and the link to it: unkeyed, `body` itself and its SHA-256; keyed, `body` with its MAC
    /// written first, and that MAC.
    pub fn write(&self, body: Vec<u8>) -> (Vec<u8>, Sha256Digest) {
        let Some(key) = self.key else {
            let link = Sha256Digest::of(&body);
            return (body, link);
        };
        let mac = key.mac(&[&body]);
        let fields = body.strip_prefix(b"{").unwrap_or(&body);
        let mut line = Vec::with_capacity(LINE_MAC_LEN + fields.len());
        line.extend_from_slice(LINE_MAC);
        line.extend_from_slice(mac.to_string().as_bytes());
        line.extend_from_slice(b"\",");
        line.extend_from_slice(fields);
        (line, mac)
    }

    /// The link to `line` as found (its exact bytes, without the newline): the next line's
    /// `prev`. Unkeyed, its SHA-256; keyed, the MAC it starts with, once that verifies over
    /// the rest of the line.
    pub fn link(&self, line: &[u8]) -> Result<Sha256Digest, LineProblem> {
        let Some(key) = self.key else {
            return Ok(Sha256Digest::of(line));
        };
        let (prefix, fields) = line
            .split_at_checked(LINE_MAC_LEN)
            .ok_or(LineProblem::NoMac)?;
        let mac = prefix
            .strip_prefix(LINE_MAC)
            .and_then(|p| p.strip_suffix(b"\","))
            .and_then(|hex| std::str::from_utf8(hex).ok())
            .and_then(Sha256Digest::from_hex)
            .ok_or(LineProblem::NoMac)?;
        key.hmac(&[b"{", fields])
            .verify_slice(&mac.0)
            .map_err(|_| LineProblem::BadMac)?;
        Ok(mac)
    }

    /// The `prev` of `tenant`'s first record: zeros unkeyed; keyed, a MAC of the tenant, so
    /// that no one without the key can write a first record (a tenant whose head is genesis
    /// would otherwise take one that starts from zeros).
    pub fn genesis(&self, tenant: &TenantId) -> Sha256Digest {
        match self.key {
            None => Sha256Digest::ZERO,
            Some(key) => key.mac(&[b"bulkhead-audit genesis\n", tenant.as_str().as_bytes()]),
        }
    }

    /// The seal of `what`; `None` in an unkeyed log.
    pub fn seal(&self, what: Sealed<'_>) -> Option<Seal> {
        self.key.map(|key| Seal {
            key: key.id(),
            mac: Sha256Digest(what.mac(key).finalize().into_bytes().into()),
        })
    }

    /// Whether `found` is the seal this chain gives `what` (none when unkeyed).
    pub fn check(&self, what: Sealed<'_>, found: Option<&Seal>) -> Result<(), SealProblem> {
        match (self.key, found) {
            (None, None) => Ok(()),
            (None, Some(_)) => Err(SealProblem::Keyed),
            (Some(_), None) => Err(SealProblem::Unkeyed),
            (Some(key), Some(seal)) if seal.key != key.id() => Err(SealProblem::WrongKey),
            (Some(key), Some(seal)) => what
                .mac(key)
                .verify_slice(&seal.mac.0)
                .map_err(|_| SealProblem::Broken),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(byte: u8) -> ChainKey {
        ChainKey::new(vec![byte; MIN_KEY_LEN]).expect("long enough")
    }

    #[test]
    fn a_key_needs_32_bytes_and_hides_its_secret() {
        assert!(matches!(ChainKey::new(""), Err(KeyError::Empty)));
        assert!(matches!(
            ChainKey::new(vec![b'k'; MIN_KEY_LEN - 1]),
            Err(KeyError::TooShort { len: 31 })
        ));
        let k = ChainKey::new("s3cret-s3cret-s3cret-s3cret-s3cret").expect("34 bytes");
        let shown = format!("{k:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(shown.contains("redacted"), "{shown}");
    }

    const BODY: &[u8] = br#"{"seq":0,"prev":"00"}"#;

    #[test]
    fn unkeyed_lines_are_their_body_linked_by_sha256() {
        let plain = Chain::new(None);
        let (line, link) = plain.write(BODY.to_vec());
        assert_eq!(line, BODY);
        assert_eq!(link, Sha256Digest::of(BODY));
        assert_eq!(plain.link(&line), Ok(link));
    }

    /// Keyed, a line starts with its own MAC, which is its link: it verifies under its key
    /// alone, and an edit anywhere in it, a MAC taken from another line, a line without one,
    /// or another key fails.
    #[test]
    fn a_keyed_line_carries_its_own_mac_and_nothing_else_verifies() {
        let k = key(1);
        let keyed = Chain::new(Some(&k));
        let (line, link) = keyed.write(BODY.to_vec());
        let text = String::from_utf8(line.clone()).expect("text");
        assert!(
            text.starts_with(&format!("{{\"mac\":\"{link}\",\"seq\":0")),
            "{text}"
        );
        let _: serde_json::Value = serde_json::from_slice(&line).expect("still one JSON object");
        assert_eq!(keyed.link(&line), Ok(link));
        assert_ne!(link, Sha256Digest::of(BODY));
        assert_eq!(
            Chain::new(Some(&key(2))).link(&line),
            Err(LineProblem::BadMac)
        );
        let edited = text.replace("\"seq\":0", "\"seq\":1");
        assert_eq!(keyed.link(edited.as_bytes()), Err(LineProblem::BadMac));
        let (other, _) = keyed.write(br#"{"seq":1,"prev":"00"}"#.to_vec());
        let mut swapped = other[..LINE_MAC_LEN].to_vec();
        swapped.extend_from_slice(&line[LINE_MAC_LEN..]);
        assert_eq!(keyed.link(&swapped), Err(LineProblem::BadMac));
        assert_eq!(keyed.link(BODY), Err(LineProblem::NoMac));
        assert_eq!(keyed.link(b"{"), Err(LineProblem::NoMac));
        assert_eq!(
            keyed.link(&line[..LINE_MAC_LEN - 1]),
            Err(LineProblem::NoMac)
        );
    }

    /// Keyed, a first record's `prev` is not a value anyone without the key could start a
    /// tenant's chain with; unkeyed, it is zeros as it always was.
    #[test]
    fn a_keyed_first_record_starts_from_a_mac_of_its_tenant() {
        let (k, t) = (key(1), TenantId::new("a").expect("valid"));
        let (plain, keyed) = (Chain::new(None), Chain::new(Some(&k)));
        assert_eq!(plain.genesis(&t), Sha256Digest::ZERO);
        assert_ne!(keyed.genesis(&t), Sha256Digest::ZERO);
        assert_ne!(
            keyed.genesis(&t),
            keyed.genesis(&TenantId::new("b").expect("valid"))
        );
    }

    #[test]
    fn a_seal_round_trips_and_tells_each_misfit_apart() {
        let (k, other) = (key(1), key(2));
        let t = TenantId::new("a").expect("valid");
        let what = Sealed::Head {
            tenant: &t,
            statement: "genesis",
        };
        let chain = Chain::new(Some(&k));
        let seal = chain.seal(what).expect("keyed");
        assert_eq!(Seal::decode(&seal.encode()), Some(seal));
        assert_eq!(chain.check(what, Some(&seal)), Ok(()));
        let edited = Sealed::Head {
            tenant: &t,
            statement: "3 00",
        };
        assert_eq!(chain.check(edited, Some(&seal)), Err(SealProblem::Broken));
        let elsewhere = Sealed::Head {
            tenant: &TenantId::new("b").expect("valid"),
            statement: "genesis",
        };
        assert_eq!(
            chain.check(elsewhere, Some(&seal)),
            Err(SealProblem::Broken)
        );
        assert_eq!(
            Chain::new(Some(&other)).check(what, Some(&seal)),
            Err(SealProblem::WrongKey)
        );
        assert_eq!(
            Chain::new(None).check(what, Some(&seal)),
            Err(SealProblem::Keyed)
        );
        assert_eq!(chain.check(what, None), Err(SealProblem::Unkeyed));
        assert_eq!(Chain::new(None).seal(what), None);
        for bad in [
            "hmac-sha256 00",
            "hmac-sha256  00",
            &seal.encode().to_uppercase(),
            &format!("{} ", seal.encode()),
        ] {
            assert_eq!(Seal::decode(bad), None, "{bad:?}");
        }
    }
}
