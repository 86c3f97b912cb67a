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
    /// Requests started per minute: a bucket of this many that refills at this rate, so a
    /// burst of the whole minute's worth, then the rate.
    pub requests_per_minute: NonZeroU32,
    /// Prompt + completion tokens per minute (charged as prompt + max tokens at admission,
    /// the unused part refunded at the end).
    pub tokens_per_minute: NonZeroU64,
}

impl TenantLimits {
    /// The max tokens of a request of `prompt_tokens` that gave none: the gateway's `default`,
    /// but never more than the tenant's whole minute of tokens leaves beside the prompt — the
    /// default must not make every such request too large for a small budget. A prompt that
    /// leaves nothing keeps the default (its request is too large however it is cut).
    pub fn default_max_tokens(&self, default: NonZeroU32, prompt_tokens: usize) -> NonZeroU32 {
        let prompt = u64::try_from(prompt_tokens).unwrap_or(u64::MAX);
        let room = self.tokens_per_minute.get().saturating_sub(prompt);
        u32::try_from(room)
            .ok()
            .and_then(NonZeroU32::new)
            .map_or(default, |room| default.min(room))
    }
}

/// A tenant, as the configuration defines it. Its keys live only in the keyring, hashed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tenant {
    pub id: TenantId,
    pub limits: TenantLimits,
    /// Whether the audit log stores this tenant's prompts and completions (not only their
    /// hashes).
    pub capture_content: bool,
    /// The operator's word that this id, if a reload adds it (or a start, the data directory
    /// not having served it last) while its audit log holds records, names the tenant that
    /// left them: without it such a reload or start is refused ([`crate::tenants::ReusedIds`]).
    pub reuse_id: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_default_max_tokens_fits_the_tenants_minute_beside_the_prompt() {
        let nz = |n| NonZeroU32::new(n).expect("nonzero");
        let limits = |tokens_per_minute| TenantLimits {
            max_context: nz(8192),
            max_concurrent: nz(1),
            requests_per_minute: nz(60),
            tokens_per_minute: NonZeroU64::new(tokens_per_minute).expect("nonzero"),
        };
        let default = nz(512);
        assert_eq!(limits(1_000_000).default_max_tokens(default, 30), default);
        assert_eq!(limits(300).default_max_tokens(default, 30), nz(270));
        assert_eq!(limits(300).default_max_tokens(default, 299), nz(1));
        assert_eq!(
            limits(300).default_max_tokens(default, 300),
            default,
            "nothing left: too large either way"
        );
        assert_eq!(limits(u64::MAX).default_max_tokens(default, 0), default);
    }

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
