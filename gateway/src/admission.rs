//! Gateway admission (design step 4): a request is admitted only when its prompt plus the
//! tokens it may generate fit the effective limit, computed before any worker is contacted.
//!
//! The effective limit is the minimum of the tenant's own limit and, over every worker the
//! request could be routed to, its served context and its measured pool. Only [`Admitted`]
//! can be routed (see [`crate::workers`]).

use std::num::NonZeroU32;

use bulkhead_checks::Check;

/// What one routable worker reported (its Info).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerCapacity {
    /// The longest prompt + max tokens the worker serves.
    pub served_context: u64,
    /// Its measured KV pool, in tokens.
    pub pool_tokens: u64,
}

/// The most tokens (prompt + max new) one request may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EffectiveLimit {
    pub tokens: u64,
}

/// The effective limit over `workers` (the routable ones) for a tenant allowed `tenant_max`;
/// `None` when there is no routable worker.
pub fn effective_limit(
    workers: impl IntoIterator<Item = WorkerCapacity>,
    tenant_max: NonZeroU32,
) -> Option<EffectiveLimit> {
    let workers = workers
        .into_iter()
        .map(|w| w.served_context.min(w.pool_tokens))
        .min()?;
    Some(EffectiveLimit {
        tokens: workers.min(u64::from(tenant_max.get())),
    })
}

/// A request that fits: only this can be routed, and only [`admit`] makes one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admitted {
    prompt_tokens: u32,
    /// At least 1; `prompt_tokens + max_new_tokens` fits the effective limit.
    max_new_tokens: u32,
}

impl Admitted {
    /// The prompt's tokens.
    pub fn prompt_tokens(&self) -> u32 {
        self.prompt_tokens
    }

    /// The most tokens the request may generate (at least 1).
    pub fn max_new_tokens(&self) -> u32 {
        self.max_new_tokens
    }

    /// Prompt + max new tokens: what the request may occupy on a worker.
    pub fn total_tokens(&self) -> u64 {
        u64::from(self.prompt_tokens) + u64::from(self.max_new_tokens)
    }
}

/// Why a request does not fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "this request needs {requested} tokens ({prompt_tokens} in the prompt + {max_new_tokens} to \
     generate) but the limit is {limit}; shorten the prompt or lower max_tokens"
)]
pub struct ContextLengthExceeded {
    pub requested: u64,
    pub prompt_tokens: u64,
    pub max_new_tokens: u64,
    pub limit: u64,
}

/// Admits `prompt_tokens` with `max_tokens` (the request's, or when it gave none,
/// `default_max_tokens` clamped to what is left of the limit).
pub fn admit(
    prompt_tokens: usize,
    max_tokens: Option<NonZeroU32>,
    default_max_tokens: NonZeroU32,
    limit: EffectiveLimit,
) -> Result<Admitted, ContextLengthExceeded> {
    let prompt = prompt_tokens as u64;
    let left = limit.tokens.saturating_sub(prompt);
    let max_new = match max_tokens {
        Some(m) => u64::from(m.get()),
        None => u64::from(default_max_tokens.get()).min(left).max(1),
    };
    let requested = prompt.saturating_add(max_new);
    let rejected = ContextLengthExceeded {
        requested,
        prompt_tokens: prompt,
        max_new_tokens: max_new,
        limit: limit.tokens,
    };
    let over = requested > limit.tokens && bulkhead_checks::enabled(Check::GatewayLimit);
    if prompt == 0 || over {
        return Err(rejected);
    }
    match (u32::try_from(prompt), u32::try_from(max_new)) {
        (Ok(prompt_tokens), Ok(max_new_tokens)) => Ok(Admitted {
            prompt_tokens,
            max_new_tokens,
        }),
        _ => Err(rejected),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nz(n: u32) -> NonZeroU32 {
        NonZeroU32::new(n).expect("non-zero")
    }

    fn w(served_context: u64, pool_tokens: u64) -> WorkerCapacity {
        WorkerCapacity {
            served_context,
            pool_tokens,
        }
    }

    fn limit(tokens: u64) -> EffectiveLimit {
        EffectiveLimit { tokens }
    }

    #[test]
    fn the_limit_is_the_minimum_over_contexts_pools_and_the_tenant() {
        let l = effective_limit([w(8192, 8192), w(8192, 4096)], nz(100_000)).expect("some");
        assert_eq!(l.tokens, 4096, "the smaller pool binds");
        let l = effective_limit([w(2048, 8192)], nz(100_000)).expect("some");
        assert_eq!(l.tokens, 2048, "the served context binds");
        let l = effective_limit([w(8192, 8192)], nz(1000)).expect("some");
        assert_eq!(l.tokens, 1000, "the tenant binds");
        assert_eq!(effective_limit([], nz(1000)), None, "no routable worker");
    }

    #[test]
    fn a_pool_smaller_than_the_context_bounds_the_limit() {
        // The incident's numbers: context 1,048,576, pool 681,280.
        let l = effective_limit([w(1_048_576, 681_280)], nz(u32::MAX)).expect("some");
        assert_eq!(l.tokens, 681_280);
    }

    #[test]
    fn prompt_plus_max_tokens_must_fit() {
        assert_eq!(
            admit(90, Some(nz(10)), nz(512), limit(100)),
            Ok(Admitted {
                prompt_tokens: 90,
                max_new_tokens: 10
            })
        );
        let err = admit(90, Some(nz(11)), nz(512), limit(100)).expect_err("one over");
        assert_eq!(err.requested, 101);
        assert_eq!(err.limit, 100);
        assert!(admit(101, Some(nz(1)), nz(512), limit(100)).is_err());
    }

    #[test]
    fn the_default_max_tokens_is_clamped_to_what_is_left() {
        let a = admit(90, None, nz(512), limit(100)).expect("fits");
        assert_eq!(a.max_new_tokens(), 10);
        let a = admit(10, None, nz(5), limit(100)).expect("fits");
        assert_eq!(a.max_new_tokens(), 5);
        // Nothing left: still needs one token to generate, so it does not fit.
        assert!(admit(100, None, nz(512), limit(100)).is_err());
    }

    #[test]
    fn an_empty_prompt_is_never_admitted() {
        assert!(admit(0, Some(nz(1)), nz(1), limit(100)).is_err());
    }

    #[test]
    fn huge_numbers_do_not_overflow() {
        assert!(admit(usize::MAX, Some(nz(u32::MAX)), nz(1), limit(u64::MAX)).is_err());
        // Both at their largest, in u32: their sum is compared whole, never wrapped.
        let most = u32::MAX as usize;
        let err = admit(most, Some(nz(u32::MAX)), nz(1), limit(u64::from(u32::MAX)))
            .expect_err("twice the limit");
        assert_eq!(err.requested, 2 * u64::from(u32::MAX));
        // A prompt past u64's reach (a 128-bit usize) saturates instead of wrapping.
        let err = admit(usize::MAX, Some(nz(2)), nz(1), limit(100)).expect_err("over");
        assert_eq!(err.requested, (usize::MAX as u64).saturating_add(2));
    }
}
