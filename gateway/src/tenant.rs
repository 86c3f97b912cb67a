//! Tenants: who a request is for (taken from its authenticated key, never from the client's
//! headers) and the limits that apply to it.

use std::fmt;
use std::num::{NonZeroU32, NonZeroU64};

/// A tenant's id: 1 to 64 characters of `a-z`, `0-9`, `-`, `_`, `.` (safe in metric labels,
/// log lines and file names).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TenantId(String);

/// Why a tenant id is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("tenant id {id:?} must be 1 to 64 characters of a-z, 0-9, '-', '_' or '.'")]
pub struct TenantIdError {
    pub id: String,
}

impl TenantId {
    pub fn new(id: &str) -> Result<TenantId, TenantIdError> {
        let ok = (1..=64).contains(&id.len())
            && id
                .bytes()
                .all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.'));
        if ok {
            Ok(TenantId(id.to_owned()))
        } else {
            Err(TenantIdError { id: id.to_owned() })
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for TenantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for TenantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TenantId({})", self.0)
    }
}

/// A tenant's limits; every one is at least 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TenantLimits {
    /// The longest prompt + max tokens this tenant may ask for (the gateway's effective limit
    /// is never more than the workers' own).
    pub max_context: NonZeroU32,
    /// Requests in flight at once.
    pub max_concurrent: NonZeroU32,
    /// Requests started per minute.
    pub requests_per_minute: NonZeroU32,
    /// Prompt + completion tokens per minute (charged as prompt + max tokens at admission,
    /// the unused part refunded at the end).
    pub tokens_per_minute: NonZeroU64,
}

/// A tenant, as the configuration defines it. Its keys live only in the keyring, hashed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tenant {
    pub id: TenantId,
    pub limits: TenantLimits,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenant_ids_are_label_safe() {
        assert!(TenantId::new("tenant-a").is_ok());
        assert!(TenantId::new("a.b_c-1").is_ok());
        for bad in ["", "Tenant", "a b", "a\"b", "a\nb", &"x".repeat(65)] {
            assert!(TenantId::new(bad).is_err(), "{bad:?}");
        }
    }
}
