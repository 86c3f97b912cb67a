//! Tenant ids: the only thing that names a directory under the data directory.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The longest tenant id, in bytes.
pub const MAX_TENANT_LEN: usize = 64;

/// A validated tenant id: 1 to [`MAX_TENANT_LEN`] bytes of `[a-z0-9_-]`.
///
/// Invariant: the id is safe to use as one path component; it can never be empty, `.`, `..`,
/// contain a separator, or name anything outside its own directory.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TenantId(String);

/// Why a string is not a tenant id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TenantIdError {
    /// The id is empty.
    #[error("tenant id is empty")]
    Empty,
    /// The id is longer than [`MAX_TENANT_LEN`] bytes.
    #[error("tenant id is {len} bytes long; the limit is {MAX_TENANT_LEN}")]
    TooLong {
        /// The length in bytes.
        len: usize,
    },
    /// The id holds a character outside `[a-z0-9_-]`.
    #[error("tenant id holds {found:?}; only lowercase letters, digits, '-' and '_' are allowed")]
    BadChar {
        /// The first offending character.
        found: char,
    },
}

impl TenantId {
    /// Parses a tenant id.
    pub fn new(id: &str) -> Result<Self, TenantIdError> {
        if id.is_empty() {
            return Err(TenantIdError::Empty);
        }
        if id.len() > MAX_TENANT_LEN {
            return Err(TenantIdError::TooLong { len: id.len() });
        }
        if let Some(found) = id
            .chars()
            .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-' || *c == '_'))
        {
            return Err(TenantIdError::BadChar { found });
        }
        Ok(Self(id.to_owned()))
    }

    /// The id as a string (also its directory name).
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::str::FromStr for TenantId {
    type Err = TenantIdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

impl fmt::Display for TenantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Serialize for TenantId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for TenantId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Self::new(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_tricks_are_refused() {
        assert_eq!(TenantId::new(""), Err(TenantIdError::Empty));
        assert_eq!(
            TenantId::new("."),
            Err(TenantIdError::BadChar { found: '.' })
        );
        assert_eq!(
            TenantId::new(".."),
            Err(TenantIdError::BadChar { found: '.' })
        );
        assert_eq!(
            TenantId::new("../x"),
            Err(TenantIdError::BadChar { found: '.' })
        );
        assert_eq!(
            TenantId::new("a/b"),
            Err(TenantIdError::BadChar { found: '/' })
        );
        assert_eq!(
            TenantId::new("a\\b"),
            Err(TenantIdError::BadChar { found: '\\' })
        );
        assert_eq!(
            TenantId::new("A"),
            Err(TenantIdError::BadChar { found: 'A' })
        );
        assert_eq!(
            TenantId::new("a\0"),
            Err(TenantIdError::BadChar { found: '\0' })
        );
        assert_eq!(
            TenantId::new(&"a".repeat(65)),
            Err(TenantIdError::TooLong { len: 65 })
        );
    }

    #[test]
    fn plain_ids_are_accepted() {
        for id in ["a", "acme-corp", "tenant_7", &"z".repeat(64)] {
            assert_eq!(
                TenantId::new(id).map(|t| t.as_str().to_owned()),
                Ok(id.to_owned())
            );
        }
    }

    #[test]
    fn deserializing_validates() {
        assert!(serde_json::from_str::<TenantId>("\"../etc\"").is_err());
        assert!(serde_json::from_str::<TenantId>("\"ok\"").is_ok());
    }
}
