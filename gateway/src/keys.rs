//! API keys and admin tokens are kept only as SHA-256 digests: a key in clear never enters the
//! configuration, the gateway's memory after a request's lookup, or a log line.

use std::fmt;

use sha2::{Digest, Sha256};

/// The SHA-256 digest of a secret (an API key or the admin token).
///
/// `Debug` shows a short prefix only, so a logged config does not even carry whole digests.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct KeyHash([u8; 32]);

/// Why a configured digest is not a SHA-256 hex string.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyHashError {
    #[error(
        "a key hash must be 64 hexadecimal characters (SHA-256), not {len} characters; \
         compute one with `bulkhead hash-key`"
    )]
    Length { len: usize },
    #[error("a key hash must be hexadecimal; found {found:?}")]
    NotHex { found: char },
}

impl KeyHash {
    /// The digest of `secret`.
    pub fn of(secret: &str) -> KeyHash {
        KeyHash(Sha256::digest(secret.as_bytes()).into())
    }

    /// Parses 64 hexadecimal characters (either case).
    pub fn from_hex(hex: &str) -> Result<KeyHash, KeyHashError> {
        let hex = hex.trim();
        if hex.len() != 64 {
            return Err(KeyHashError::Length {
                len: hex.chars().count(),
            });
        }
        let mut out = [0u8; 32];
        let digits: Vec<u8> = hex
            .chars()
            .map(|c| {
                c.to_digit(16)
                    .map(|d| d as u8)
                    .ok_or(KeyHashError::NotHex { found: c })
            })
            .collect::<Result<_, _>>()?;
        for (byte, pair) in out.iter_mut().zip(digits.chunks_exact(2)) {
            *byte = (pair[0] << 4) | pair[1];
        }
        Ok(KeyHash(out))
    }

    /// Lowercase hexadecimal, as the configuration holds it.
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }

    /// The key's public name (audit records, logs): the first 12 hex characters of the
    /// SHA-256 of this digest. Stable for a key, and it reveals neither the key nor the digest
    /// the configuration stores.
    pub fn id(&self) -> KeyId {
        let digest = Sha256::digest(self.0);
        KeyId(hex(&digest[..6]))
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A key's public name; see [`KeyHash::id`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KeyId(String);

impl KeyId {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for KeyHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KeyHash({}…)", &self.to_hex()[..8])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_digest_is_sha256() {
        // sha256("abc"), FIPS 180-2 appendix B.1.
        assert_eq!(
            KeyHash::of("abc").to_hex(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn a_digest_shows_in_logs_as_a_short_prefix_only() {
        let h = KeyHash::of("abc");
        let shown = format!("{h:?}");
        assert_eq!(shown, "KeyHash(ba7816bf…)");
        assert!(!shown.contains(&h.to_hex()[8..16]), "{shown}");
    }

    #[test]
    fn a_key_id_shows_as_its_twelve_hex_digits() {
        let id = KeyHash::of("sk-demo-tenant-a").id();
        assert_eq!(id.to_string(), id.as_str());
        assert_eq!(id.as_str().len(), 12);
        assert!(id.as_str().chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(id, KeyHash::of("sk-demo-tenant-b").id());
    }

    #[test]
    fn hex_round_trips_in_either_case() {
        let h = KeyHash::of("sk-demo-tenant-a");
        assert_eq!(KeyHash::from_hex(&h.to_hex()), Ok(h));
        assert_eq!(KeyHash::from_hex(&h.to_hex().to_uppercase()), Ok(h));
    }

    #[test]
    fn malformed_hex_is_refused_with_a_reason() {
        assert_eq!(
            KeyHash::from_hex("abcd"),
            Err(KeyHashError::Length { len: 4 })
        );
        let bad = format!("{}g", "0".repeat(63));
        assert_eq!(
            KeyHash::from_hex(&bad),
            Err(KeyHashError::NotHex { found: 'g' })
        );
        // A clear-text key pasted where a hash belongs is refused, not hashed silently.
        assert!(KeyHash::from_hex("sk-demo-tenant-a").is_err());
    }

    #[test]
    fn key_ids_are_stable_distinct_and_reveal_neither_key_nor_digest() {
        let a = KeyHash::of("sk-demo-tenant-a");
        let b = KeyHash::of("sk-demo-tenant-b");
        assert_eq!(a.id(), KeyHash::of("sk-demo-tenant-a").id());
        assert_ne!(a.id(), b.id());
        assert_eq!(a.id().as_str().len(), 12);
        assert!(
            !a.to_hex().contains(a.id().as_str()),
            "not a prefix of the stored digest"
        );
    }

    #[test]
    fn debug_output_never_holds_the_whole_digest() {
        let h = KeyHash::of("secret");
        let shown = format!("{h:?}");
        assert!(!shown.contains(&h.to_hex()), "{shown}");
        assert!(!shown.contains("secret"), "{shown}");
    }
}
