//! Tenants: who a request is for (taken from its authenticated key, never from the client's
//! headers) and the limits that apply to it.

use std::num::{NonZeroU32, NonZeroU64};

/// A tenant's id: 1 to 64 characters of `a-z`, `0-9`, `-`, `_` — safe in metric labels, log
/// lines and as one path component (the audit log names a directory after it). One definition,
/// shared with the audit log.
pub use bulkhead_audit::{TenantId, TenantIdError};

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
    /// Whether the audit log stores this tenant's prompts and completions (not only their
    /// hashes).
    pub capture_content: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenant_ids_are_label_safe() {
        assert!(TenantId::new("tenant-a").is_ok());
        assert!(TenantId::new("a_b-1").is_ok());
        for bad in [
            "",
            "Tenant",
            "a b",
            "a\"b",
            "a\nb",
            "..",
            "a.b",
            &"x".repeat(65),
        ] {
            assert!(TenantId::new(bad).is_err(), "{bad:?}");
        }
    }
}
