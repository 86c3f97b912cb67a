//! Links and seals: what makes a chain, unkeyed or keyed.
//!
//! A line's *link* is the next line's `prev`: SHA-256 of the line's exact bytes in an unkeyed
//! log, HMAC-SHA256 under the operator's [`ChainKey`] in a keyed one. A keyed log also *seals*
//! the files that state what the chain cannot witness itself — each tenant's head (how far the
//! chain reached) and the roster (which tenants have one) — with a [`Seal`]: the key's id and
//! an HMAC-SHA256 over what the file states. Without the key, no one can recompute a link or a
//! seal, so an edited record, a forged line that chains, a cut tail under a rewritten head, or a
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
            _ => Ok(Self { secret }),
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
        let mac = self.mac(&[b"bulkhead-audit key id"]);
        let mut id = [0; 8];
        id.copy_from_slice(&mac.0[..8]);
        KeyId(id)
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

    /// The link to `line` (its exact bytes, without the newline): the next line's `prev`.
    pub fn link(&self, line: &[u8]) -> Sha256Digest {
        match self.key {
            None => Sha256Digest::of(line),
            Some(key) => key.mac(&[line]),
        }
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

    /// What a head states for the link to the record it names: the link itself unkeyed;
    /// keyed, its SHA-256, so that the head gives away no link (with the last one, anyone could
    /// append a line that chains on).
    pub fn stated(&self, link: Sha256Digest) -> Sha256Digest {
        match self.key {
            None => link,
            Some(_) => Sha256Digest::of(&link.0),
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

    #[test]
    fn links_are_sha256_unkeyed_and_hmac_keyed() {
        let k = key(1);
        assert_eq!(Chain::new(None).link(b"abc"), Sha256Digest::of(b"abc"));
        let keyed = Chain::new(Some(&k)).link(b"abc");
        assert_ne!(keyed, Sha256Digest::of(b"abc"));
        assert_ne!(keyed, Chain::new(Some(&key(2))).link(b"abc"));
    }

    /// Keyed, neither a first record's `prev` nor what a head states is a value anyone
    /// without the key could chain a line onto; unkeyed, both are as they always were.
    #[test]
    fn keyed_heads_and_first_records_give_no_link_away() {
        let (k, t) = (key(1), TenantId::new("a").expect("valid"));
        let (plain, keyed) = (Chain::new(None), Chain::new(Some(&k)));
        assert_eq!(plain.genesis(&t), Sha256Digest::ZERO);
        assert_eq!(plain.stated(plain.link(b"abc")), plain.link(b"abc"));
        assert_ne!(keyed.genesis(&t), Sha256Digest::ZERO);
        assert_ne!(
            keyed.genesis(&t),
            keyed.genesis(&TenantId::new("b").expect("valid"))
        );
        let link = keyed.link(b"abc");
        assert_ne!(keyed.stated(link), link);
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
