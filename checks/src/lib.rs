//! The isolation checks of every layer, by name, and — in test builds only — the switches
//! that turn them off one at a time.
//!
//! Each layer of the request path enforces the limits on its own (design.md): the gateway's
//! limit, its routing only to workers that pass the deployment checks, decode admission,
//! prefill admission, decode's verification of a KV handoff, and the attention kernel's page-tag
//! check. The isolation suite proves that with any one of them off
//! the others still stop the incident, and that its oracles see a leak once nothing stops it.
//! The prefix cache's scoping is the one check no other layer stands in for: with it off, its
//! tests show one tenant's prompt served from another tenant's cached pages.
//! For that it needs a build in which a check can be off:
//!
//! ```text
//!                      production build                 test build (feature `switches`)
//!  enabled(check)      const true                       false once turn_off(&[check]) ran
//!  injected(fault)     const false                      true once inject(&[fault]) ran
//!  turn_off, inject    not compiled                     the binary calls them at startup
//! ```
//!
//! A layer asks [`enabled`] where it enforces its check; in a production build the answer is a
//! constant, the branch folds away, and nothing in the binary can turn a check off. Only the
//! binary's entry point turns checks off (from its environment, loudly), never a library.
#![warn(missing_docs)]

/// One layer's isolation check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Check {
    /// The gateway: `prompt + max tokens` within the effective limit (the minimum over the
    /// routable workers' served contexts and pools, and the tenant's), before any worker is
    /// contacted.
    GatewayLimit,
    /// The decode worker's admission: `prompt + max new tokens` within its served context and
    /// its pool's whole capacity.
    DecodeAdmission,
    /// The prefill worker's admission: the prompt within its served context and its pool's
    /// whole capacity.
    PrefillAdmission,
    /// The decode worker's verification of a KV handoff: each frame (session, reserved index
    /// and tag, live page, token range, length, exactly once, checksum) and the manifest (tokens
    /// and pages as reserved, every page written, digest, tags unchanged) before commit.
    HandoffVerification,
    /// The attention kernel's comparison of every page's tag with the pool's before it reads.
    TagCheck,
    /// The prefix cache's scoping: a prompt reads only cached pages its own tenant's requests
    /// computed (off: one cache shared by every tenant).
    PrefixScope,
    /// The gateway's deployment checks at run time (invariant I7): it routes only to a worker
    /// that passes `bulkhead preflight`'s checks of it (the role it is configured as, a pool
    /// that covers its served context, integrity checks and two-phase release on) and of its
    /// pairing with its prefill workers. With it off, a worker whose own checks are off still
    /// gets traffic, so the layers after it can be shown at work.
    RoutingChecks,
}

impl Check {
    /// Every check, in request-path order.
    pub const ALL: [Check; 7] = [
        Check::GatewayLimit,
        Check::RoutingChecks,
        Check::DecodeAdmission,
        Check::PrefillAdmission,
        Check::HandoffVerification,
        Check::TagCheck,
        Check::PrefixScope,
    ];

    /// The check's name in switch lists (`gateway-limit`, …).
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Check::GatewayLimit => "gateway-limit",
            Check::DecodeAdmission => "decode-admission",
            Check::PrefillAdmission => "prefill-admission",
            Check::HandoffVerification => "handoff-verification",
            Check::TagCheck => "tag-check",
            Check::PrefixScope => "prefix-scope",
            Check::RoutingChecks => "routing-checks",
        }
    }

    #[cfg(any(feature = "switches", test))]
    const fn bit(self) -> u8 {
        1 << self as u8
    }
}

/// A bug a test build can put back, to show what the checks do about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fault {
    /// The incident's prefill: a prompt its admission refuses is not refused but replaced by a
    /// one-token placeholder, whose one page is sent to decode with a manifest that claims the
    /// whole prompt.
    IncidentPlaceholder,
    /// Prefill flips a byte of the second frame of every transfer after its checksum.
    CorruptFrame,
    /// Prefill never sends the second frame of a transfer (the manifest still counts it).
    DropFrame,
    /// Prefill sends the second frame of a transfer twice.
    DuplicateFrame,
    /// Prefill sends the second frame under another session's nonce (a well-formed frame).
    ForgedNonce,
    /// Prefill sends the second frame with a tag the reservation does not hold for that page
    /// (an earlier holder's, one less: a well-formed frame).
    StaleTag,
}

impl Fault {
    /// Every fault.
    pub const ALL: [Fault; 6] = [
        Fault::IncidentPlaceholder,
        Fault::CorruptFrame,
        Fault::DropFrame,
        Fault::DuplicateFrame,
        Fault::ForgedNonce,
        Fault::StaleTag,
    ];

    /// The fault's name in switch lists.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Fault::IncidentPlaceholder => "incident-placeholder",
            Fault::CorruptFrame => "corrupt-frame",
            Fault::DropFrame => "drop-frame",
            Fault::DuplicateFrame => "duplicate-frame",
            Fault::ForgedNonce => "forged-nonce",
            Fault::StaleTag => "stale-tag",
        }
    }

    #[cfg(any(feature = "switches", test))]
    const fn bit(self) -> u8 {
        1 << self as u8
    }
}

/// Whether this build can turn checks off (the `switches` feature).
pub const SWITCHES: bool = cfg!(feature = "switches");

#[cfg(feature = "switches")]
mod switches;
#[cfg(feature = "switches")]
pub use switches::{ParseError, enabled, inject, injected, parse, turn_off};

/// Whether `check` is enforced: always, in a build without the `switches` feature.
#[cfg(not(feature = "switches"))]
#[inline(always)]
#[must_use]
pub const fn enabled(check: Check) -> bool {
    let _ = check;
    true
}

/// Whether `fault` is injected: never, in a build without the `switches` feature.
#[cfg(not(feature = "switches"))]
#[inline(always)]
#[must_use]
pub const fn injected(fault: Fault) -> bool {
    let _ = fault;
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_distinct_and_bits_do_not_overlap() {
        let mut bits = 0u8;
        for c in Check::ALL {
            assert_eq!(bits & c.bit(), 0, "{c:?}");
            bits |= c.bit();
        }
        let names: std::collections::HashSet<_> = Check::ALL.iter().map(|c| c.name()).collect();
        assert_eq!(names.len(), Check::ALL.len());
        let mut bits = 0u8;
        for f in Fault::ALL {
            assert_eq!(bits & f.bit(), 0, "{f:?}");
            bits |= f.bit();
        }
    }

    #[cfg(not(feature = "switches"))]
    #[test]
    fn without_the_feature_every_check_is_on_and_no_fault_is_injected() {
        const { assert!(!SWITCHES) };
        assert!(Check::ALL.iter().all(|&c| enabled(c)));
        assert!(Fault::ALL.iter().all(|&f| !injected(f)));
    }
}
