//! A component's SHA-256: what a policy set pins, what the compile cache is keyed by, and what
//! every decision reports.

use std::fmt;

use sha2::{Digest as _, Sha256};

/// The SHA-256 of a component's bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Digest([u8; 32]);

impl Digest {
    pub fn of(bytes: &[u8]) -> Digest {
        Digest(Sha256::digest(bytes).into())
    }

    /// The digest's bytes.
    pub fn to_bytes(&self) -> [u8; 32] {
        self.0
    }

    /// Parses 64 hex digits (either case); `None` otherwise.
    pub fn from_hex(hex: &str) -> Option<Digest> {
        let hex = hex.as_bytes();
        // Digits only (a radix parse alone takes a sign: "+f").
        if hex.len() != 64 || !hex.iter().all(u8::is_ascii_hexdigit) {
            return None;
        }
        let mut out = [0u8; 32];
        for (o, pair) in out.iter_mut().zip(hex.chunks_exact(2)) {
            let s = std::str::from_utf8(pair).ok()?;
            *o = u8::from_str_radix(s, 16).ok()?;
        }
        Some(Digest(out))
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{self}")
    }
}

impl serde::Serialize for Digest {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trips_and_rejects_what_is_not_a_digest() {
        let d = Digest::of(b"abc");
        assert_eq!(
            d.to_string(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(Digest::from_hex(&d.to_string()), Some(d));
        assert_eq!(Digest::from_hex(&d.to_string().to_uppercase()), Some(d));
        assert_eq!(Digest::from_hex("ab"), None);
        assert_eq!(Digest::from_hex(&"g".repeat(64)), None);
        assert_eq!(Digest::from_hex(&"é".repeat(32)), None);
        assert_eq!(
            Digest::from_hex(&"+f".repeat(32)),
            None,
            "a sign is no digit"
        );
    }
}
