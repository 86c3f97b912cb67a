//! Per-tenant limits: requests in flight, requests per minute, tokens per minute. Over any of
//! them → 429 `rate_limit_exceeded`.
//!
//! The logic is synchronous ([`TenantBudget`], time passed in, unit-tested directly); the
//! shared [`Limiter`] holds one budget per tenant behind a mutex held for a few arithmetic
//! operations, never across an await. A [`RequestPermit`] holds the tenant's concurrency slot
//! and returns it (and the unused part of its token charge) when dropped.
//!
//! A tenants reload ([`crate::tenants`]) retunes the budgets of the tenants that stay to their
//! new limits ([`Limiter::retune`]): requests in flight and each minute's usage carry over, so a
//! reload never lets a tenant burst past its limit. A tenant renamed (its keys under a new id,
//! the old id gone) keeps its budget under the new id. Budgets of removed tenants are kept (a
//! few bytes each) until their last permit drops and beyond: a tenant removed and added back
//! keeps its usage.
//!
//! Every answer to a tenant carries the state of its per-minute limits in OpenAI's
//! `x-ratelimit-*` headers ([`RateLimits`]), so a client can pace itself before a 429.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use http::{HeaderMap, HeaderName, HeaderValue};

use crate::tenant::{Tenant, TenantId, TenantLimits};
use crate::tenants::TenantSet;

/// Which limit a request ran into.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LimitError {
    #[error(
        "tenant {tenant} has its limit of {limit} concurrent requests in flight; retry when one \
         finishes"
    )]
    Concurrency { tenant: TenantId, limit: u32 },
    #[error(
        "tenant {tenant} is over its {limit} requests per minute; retry in {retry_after_secs} s"
    )]
    RequestsPerMinute {
        tenant: TenantId,
        limit: u32,
        retry_after_secs: u64,
    },
    #[error(
        "tenant {tenant} is over its {limit} tokens per minute (this request needs {needed}); \
         retry in {retry_after_secs} s"
    )]
    TokensPerMinute {
        tenant: TenantId,
        limit: u64,
        needed: u64,
        retry_after_secs: u64,
    },
    /// Not a wait: no minute ever has room for it.
    #[error(
        "this request needs {needed} tokens (its prompt and max tokens), more than tenant \
         {tenant}'s whole budget of {limit} tokens per minute: it can never be admitted; lower \
         its max tokens or shorten its prompt"
    )]
    OverWholeBudget {
        tenant: TenantId,
        limit: u64,
        needed: u64,
    },
}

/// A token bucket refilled continuously at `capacity` per minute.
#[derive(Debug, Clone)]
pub(crate) struct Bucket {
    capacity: f64,
    /// What may be taken now: from 0 to `capacity`.
    level: f64,
    at: Instant,
}

impl Bucket {
    pub(crate) fn full(capacity: u64, now: Instant) -> Bucket {
        Bucket {
            capacity: capacity as f64,
            level: capacity as f64,
            at: now,
        }
    }

    /// Refills up to `now`. An instant older than the last refill (read before another
    /// thread's, which took the lock first) refills nothing and leaves the clock where it is:
    /// set back, the next refill would credit the time between them twice.
    fn refill(&mut self, now: Instant) {
        if now <= self.at {
            return;
        }
        let dt = now.duration_since(self.at).as_secs_f64();
        self.level = (self.level + dt * self.capacity / 60.0).min(self.capacity);
        self.at = now;
    }

    /// Takes `n`, or says in how many whole seconds it could.
    pub(crate) fn take(&mut self, n: u64, now: Instant) -> Result<(), u64> {
        self.refill(now);
        let n = n as f64;
        if n <= self.level {
            self.level -= n;
            return Ok(());
        }
        let missing = n.min(self.capacity) - self.level;
        Err((missing * 60.0 / self.capacity).ceil().max(1.0) as u64)
    }

    /// Whether it has refilled to its capacity by `now`.
    pub(crate) fn is_full(&mut self, now: Instant) -> bool {
        self.refill(now);
        self.level >= self.capacity
    }

    /// What is left now, and how long until the bucket is full again.
    fn window(&mut self, now: Instant) -> Window {
        self.refill(now);
        Window {
            limit: self.capacity as u64,
            remaining: self.level.max(0.0) as u64,
            // Rounded up to the millisecond: a reset of `0s` says the limit is whole.
            reset: Duration::try_from_secs_f64(
                ((self.capacity - self.level) * 60_000.0 / self.capacity).ceil() / 1000.0,
            )
            .unwrap_or(Duration::MAX),
        }
    }

    fn give_back(&mut self, n: u64) {
        self.level = (self.level + n as f64).min(self.capacity);
    }

    /// A new capacity that keeps what the window has used: `capacity - level` stays the same,
    /// so lowering the capacity below the usage leaves nothing to take rather than a fresh
    /// budget — and no more: the last minute's usage ages out within a minute at the new rate,
    /// as it would have at the old one. (Kept as a debt, a limit lowered from 60 to 1 a minute
    /// after 60 requests locked the tenant out for an hour.)
    fn resize(&mut self, capacity: u64, now: Instant) {
        self.refill(now);
        let used = self.capacity - self.level;
        self.capacity = capacity as f64;
        self.level = (self.capacity - used).max(0.0);
    }
}

/// One tenant's state.
#[derive(Debug, Clone)]
pub struct TenantBudget {
    limits: TenantLimits,
    in_flight: u32,
    requests: Bucket,
    tokens: Bucket,
}

impl TenantBudget {
    pub fn new(limits: TenantLimits, now: Instant) -> TenantBudget {
        TenantBudget {
            limits,
            in_flight: 0,
            requests: Bucket::full(u64::from(limits.requests_per_minute.get()), now),
            tokens: Bucket::full(limits.tokens_per_minute.get(), now),
        }
    }

    /// Starts a request: takes a concurrency slot and one request from the minute's budget.
    pub fn start(&mut self, tenant: &TenantId, now: Instant) -> Result<(), LimitError> {
        let limit = self.limits.max_concurrent.get();
        if self.in_flight >= limit {
            return Err(LimitError::Concurrency {
                tenant: tenant.clone(),
                limit,
            });
        }
        self.requests
            .take(1, now)
            .map_err(|retry_after_secs| LimitError::RequestsPerMinute {
                tenant: tenant.clone(),
                limit: self.limits.requests_per_minute.get(),
                retry_after_secs,
            })?;
        self.in_flight += 1;
        Ok(())
    }

    /// Charges `n` tokens to the minute's budget. A request larger than the whole budget can
    /// never pass and is refused at once. A refused request keeps its request of the minute:
    /// each one was read, tokenized and recorded, and a tenant past its tokens must not send
    /// them unthrottled.
    pub fn charge(&mut self, tenant: &TenantId, n: u64, now: Instant) -> Result<(), LimitError> {
        let limit = self.limits.tokens_per_minute.get();
        if n > limit {
            return Err(LimitError::OverWholeBudget {
                tenant: tenant.clone(),
                limit,
                needed: n,
            });
        }
        self.tokens
            .take(n, now)
            .map_err(|retry_after_secs| LimitError::TokensPerMinute {
                tenant: tenant.clone(),
                limit,
                needed: n,
                retry_after_secs,
            })
    }

    /// New limits for the requests that start from now on; requests in flight and the
    /// minute's usage carry over (see [`Bucket::resize`]).
    pub fn retune(&mut self, limits: TenantLimits, now: Instant) {
        if limits == self.limits {
            return;
        }
        self.requests
            .resize(u64::from(limits.requests_per_minute.get()), now);
        self.tokens.resize(limits.tokens_per_minute.get(), now);
        self.limits = limits;
    }

    /// Ends a request: frees its slot and refunds `unused` charged tokens.
    pub fn finish(&mut self, unused: u64) {
        self.in_flight = self.in_flight.saturating_sub(1);
        self.tokens.give_back(unused);
    }

    pub fn in_flight(&self) -> u32 {
        self.in_flight
    }

    /// The per-minute limits' state now.
    pub fn rate_limits(&mut self, now: Instant) -> RateLimits {
        RateLimits {
            requests: self.requests.window(now),
            tokens: self.tokens.window(now),
        }
    }
}

/// One per-minute limit as a client sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Window {
    pub limit: u64,
    /// What may be taken now (tokens charged to requests in flight are not: each is charged its
    /// prompt and max tokens until it ends).
    pub remaining: u64,
    /// Until the limit is whole again.
    pub reset: Duration,
}

/// A tenant's per-minute limits, for OpenAI's `x-ratelimit-*` response headers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateLimits {
    pub requests: Window,
    pub tokens: Window,
}

impl RateLimits {
    /// Sets `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` as OpenAI's API does (the
    /// reset as a duration such as `1s`, `6m0s` or `250ms`).
    pub fn write(&self, headers: &mut HeaderMap) {
        for (window, [limit, remaining, reset]) in [
            (self.requests, REQUEST_HEADERS),
            (self.tokens, TOKEN_HEADERS),
        ] {
            headers.insert(limit, HeaderValue::from(window.limit));
            headers.insert(remaining, HeaderValue::from(window.remaining));
            if let Ok(text) = HeaderValue::try_from(duration_text(window.reset)) {
                headers.insert(reset, text);
            }
        }
    }
}

/// `x-ratelimit-{limit,remaining,reset}-requests`.
const REQUEST_HEADERS: [HeaderName; 3] = [
    HeaderName::from_static("x-ratelimit-limit-requests"),
    HeaderName::from_static("x-ratelimit-remaining-requests"),
    HeaderName::from_static("x-ratelimit-reset-requests"),
];

/// `x-ratelimit-{limit,remaining,reset}-tokens`.
const TOKEN_HEADERS: [HeaderName; 3] = [
    HeaderName::from_static("x-ratelimit-limit-tokens"),
    HeaderName::from_static("x-ratelimit-remaining-tokens"),
    HeaderName::from_static("x-ratelimit-reset-tokens"),
];

/// A duration as Go prints one, to the millisecond, as OpenAI's reset headers are: `0s`,
/// `250ms`, `1.5s`, `6m0s`, `1m0.25s`, `1h30m0s`.
fn duration_text(d: Duration) -> String {
    let ms = d.as_millis();
    if ms == 0 {
        return "0s".into();
    }
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let mut text = String::new();
    let (hours, ms) = (ms / 3_600_000, ms % 3_600_000);
    let (minutes, ms) = (ms / 60_000, ms % 60_000);
    if hours > 0 {
        let _ = write!(text, "{hours}h{minutes}m");
    } else if minutes > 0 {
        let _ = write!(text, "{minutes}m");
    }
    let _ = write!(text, "{}", ms / 1000);
    if ms % 1000 > 0 {
        let _ = write!(text, ".{:03}", ms % 1000);
        text.truncate(text.trim_end_matches('0').len());
    }
    text.push('s');
    text
}

/// Every tenant's budget; a cheap `Clone` handle.
#[derive(Debug, Clone, Default)]
pub struct Limiter {
    budgets: Arc<Mutex<Budgets>>,
}

/// The budgets, each under the id of the tenant that spends it now. A budget is never dropped
/// (a few bytes each), so a permit's index stays valid whatever reloads happen meanwhile.
#[derive(Debug, Default)]
struct Budgets {
    of: HashMap<TenantId, usize>,
    /// The ids tenants were renamed from, each to its budget under the new id: a request
    /// authenticated under the old id before the reload spends the renamed tenant's budget,
    /// not a fresh one. Dropped when the old id is configured again.
    was: HashMap<TenantId, usize>,
    all: Vec<TenantBudget>,
}

impl Budgets {
    /// The index of `tenant`'s budget, made from its limits if it has none yet.
    fn index(&mut self, tenant: &Arc<Tenant>, now: Instant) -> usize {
        // Looked up before it is made: no id is copied for a tenant that has one.
        if let Some(&i) = self.of.get(&tenant.id).or_else(|| self.was.get(&tenant.id)) {
            return i;
        }
        self.all.push(TenantBudget::new(tenant.limits, now));
        self.of.insert(tenant.id.clone(), self.all.len() - 1);
        self.all.len() - 1
    }
}

impl Limiter {
    /// Starts a request for `tenant` (concurrency and requests per minute).
    pub fn start(&self, tenant: &Arc<Tenant>) -> Result<RequestPermit, LimitError> {
        let now = Instant::now();
        let mut budgets = self.lock();
        let budget = budgets.index(tenant, now);
        budgets.all[budget].start(&tenant.id, now)?;
        Ok(RequestPermit {
            limiter: self.clone(),
            tenant: tenant.id.clone(),
            budget,
            charged: 0,
            used: None,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Budgets> {
        self.budgets.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Gives every tenant of `tenants` its limits from `tenants` (a reload): a budget it has
    /// is retuned ([`TenantBudget::retune`]), and one it lacks is made now — not at its first
    /// request, which may have authenticated against the set before and would bring that
    /// set's limits. A tenant renamed (`renamed`: old id, new id) keeps its budget under its
    /// new id, with its requests in flight and the minute's usage: its keys would otherwise
    /// start afresh under the new name.
    pub fn retune(&self, tenants: &TenantSet, renamed: &[(TenantId, TenantId)]) {
        let now = Instant::now();
        let mut budgets = self.lock();
        for (old, new) in renamed {
            if let Some(i) = budgets
                .of
                .remove(old)
                .or_else(|| budgets.was.get(old).copied())
            {
                budgets.of.insert(new.clone(), i);
                budgets.was.insert(old.clone(), i);
            }
        }
        for tenant in tenants.tenants() {
            // An id a tenant was renamed from, configured again: a tenant of its own now.
            budgets.was.remove(&tenant.id);
            let i = budgets.index(tenant, now);
            budgets.all[i].retune(tenant.limits, now);
        }
    }

    /// `tenant`'s per-minute limits now.
    pub fn rate_limits(&self, tenant: &Arc<Tenant>) -> RateLimits {
        let now = Instant::now();
        let mut budgets = self.lock();
        let i = budgets.index(tenant, now);
        budgets.all[i].rate_limits(now)
    }

    /// Requests in flight for `tenant` now.
    pub fn in_flight(&self, tenant: &TenantId) -> u32 {
        let budgets = self.lock();
        budgets
            .of
            .get(tenant)
            .map_or(0, |&i| budgets.all[i].in_flight())
    }
}

/// A started request's claim on its tenant's budget; dropping it ends the request.
#[derive(Debug)]
#[must_use = "dropping the permit ends the request at once"]
pub struct RequestPermit {
    limiter: Limiter,
    /// The id it started under, for refusals.
    tenant: TenantId,
    /// Its budget's index in [`Budgets::all`]: the tenant's, whatever it is called by now.
    budget: usize,
    charged: u64,
    /// Tokens actually used, once known; `None` refunds nothing.
    used: Option<u64>,
}

impl RequestPermit {
    /// The tenant's limits as of now: a reload that changed them since the request started
    /// reaches its admission (its context and default max tokens) as it reached the budget.
    pub fn limits(&self) -> TenantLimits {
        self.limiter.lock().all[self.budget].limits
    }

    /// Charges `n` tokens (prompt + max tokens) to the tenant's tokens per minute.
    pub fn charge_tokens(&mut self, n: u64) -> Result<(), LimitError> {
        let now = Instant::now();
        self.limiter.lock().all[self.budget].charge(&self.tenant, n, now)?;
        self.charged += n;
        Ok(())
    }

    /// Records how many of the charged tokens the request really used (prompt + generated); the
    /// rest is refunded when the permit drops.
    pub fn set_used(&mut self, used: u64) {
        self.used = Some(used);
    }
}

impl Drop for RequestPermit {
    fn drop(&mut self) {
        let unused = self
            .used
            .map_or(0, |used| self.charged.saturating_sub(used));
        self.limiter.lock().all[self.budget].finish(unused);
    }
}

/// How long a client should wait before retrying, for the `retry-after` header; `None` when
/// waiting would not help.
pub fn retry_after(err: &LimitError) -> Option<Duration> {
    match err {
        LimitError::Concurrency { .. } => Some(Duration::from_secs(1)),
        LimitError::RequestsPerMinute {
            retry_after_secs, ..
        }
        | LimitError::TokensPerMinute {
            retry_after_secs, ..
        } => Some(Duration::from_secs(*retry_after_secs)),
        LimitError::OverWholeBudget { .. } => None,
    }
}

#[cfg(test)]
mod tests {
    use std::num::{NonZeroU32, NonZeroU64};

    use super::*;

    fn limits(concurrent: u32, rpm: u32, tpm: u64) -> TenantLimits {
        TenantLimits {
            max_context: NonZeroU32::new(1000).expect("nz"),
            max_concurrent: NonZeroU32::new(concurrent).expect("nz"),
            requests_per_minute: NonZeroU32::new(rpm).expect("nz"),
            tokens_per_minute: NonZeroU64::new(tpm).expect("nz"),
        }
    }

    fn id() -> TenantId {
        TenantId::new("t").expect("valid")
    }

    #[test]
    fn a_refusal_says_how_long_until_what_is_missing_has_refilled() {
        // 60 a minute: one a second. With 1 left, 3 more need 2 s, not 3 or 4.
        let t0 = Instant::now();
        let mut b = Bucket::full(60, t0);
        b.take(59, t0).expect("within the budget");
        assert_eq!(b.take(3, t0), Err(2));
        // Asking for more than the whole budget waits for a full bucket, no longer.
        assert_eq!(b.take(600, t0), Err(59));
        // Half a token short still waits a whole second.
        assert_eq!(b.take(1, t0), Ok(()));
        assert_eq!(b.take(1, t0 + Duration::from_millis(500)), Err(1));
    }

    /// Instants are read before the limiter's lock: one read earlier can come after one read
    /// later. It refills nothing, and the time between them is credited once.
    #[test]
    fn an_instant_older_than_the_last_refill_credits_nothing_twice() {
        let t0 = Instant::now();
        let mut b = Bucket::full(60, t0);
        b.take(60, t0).expect("the whole minute");
        let t10 = t0 + Duration::from_secs(10);
        b.take(10, t10).expect("ten seconds' worth");
        assert!(
            b.take(1, t0 + Duration::from_secs(5)).is_err(),
            "nothing left"
        );
        assert!(b.take(1, t10).is_err(), "nothing refilled since t10");
    }

    #[test]
    fn concurrency_is_capped_and_slots_come_back() {
        let now = Instant::now();
        let mut b = TenantBudget::new(limits(2, 100, 1000), now);
        b.start(&id(), now).expect("1");
        b.start(&id(), now).expect("2");
        assert!(matches!(
            b.start(&id(), now),
            Err(LimitError::Concurrency { limit: 2, .. })
        ));
        b.finish(0);
        b.start(&id(), now).expect("a slot came back");
    }

    #[test]
    fn requests_per_minute_refill_over_time() {
        let t0 = Instant::now();
        let mut b = TenantBudget::new(limits(100, 2, 1000), t0);
        b.start(&id(), t0).expect("1");
        b.start(&id(), t0).expect("2");
        let err = b.start(&id(), t0).expect_err("3rd in the same instant");
        assert!(
            matches!(
                err,
                LimitError::RequestsPerMinute {
                    retry_after_secs: 30,
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(b.start(&id(), t0 + Duration::from_secs(29)).is_err());
        b.start(&id(), t0 + Duration::from_secs(30))
            .expect("one request refilled after 30 s at 2/min");
    }

    #[test]
    fn tokens_per_minute_are_charged_and_refunded() {
        let t0 = Instant::now();
        let mut b = TenantBudget::new(limits(10, 100, 1000), t0);
        b.charge(&id(), 800, t0).expect("fits");
        assert!(
            b.charge(&id(), 300, t0).is_err(),
            "over the minute's budget"
        );
        b.finish(500);
        b.charge(&id(), 300, t0).expect("the refund made room");
        assert!(
            matches!(
                b.charge(&id(), 1001, t0 + Duration::from_secs(3600)),
                Err(LimitError::OverWholeBudget { needed: 1001, .. })
            ),
            "larger than the whole budget: never"
        );
    }

    #[test]
    fn retuning_keeps_in_flight_requests_and_the_minutes_usage() {
        let t0 = Instant::now();
        let mut b = TenantBudget::new(limits(4, 10, 1000), t0);
        for _ in 0..3 {
            b.start(&id(), t0).expect("under 4 in flight and 10/min");
        }
        b.charge(&id(), 600, t0).expect("fits");
        // Lowered below what is in flight and below what the minute used: nothing more starts.
        b.retune(limits(2, 2, 500), t0);
        assert_eq!(b.in_flight(), 3, "in-flight requests carry over");
        assert!(matches!(
            b.start(&id(), t0),
            Err(LimitError::Concurrency { limit: 2, .. })
        ));
        b.finish(0);
        b.finish(0);
        assert!(
            matches!(
                b.start(&id(), t0),
                Err(LimitError::RequestsPerMinute { limit: 2, .. })
            ),
            "3 requests used of the new 2 per minute: no fresh budget"
        );
        assert!(
            b.charge(&id(), 1, t0).is_err(),
            "600 tokens used of the new 500 per minute"
        );
        // Raised again: the usage counts against the larger limit, as much of it as the
        // lowered one held (its whole minute).
        b.retune(limits(20, 10, 1000), t0);
        assert_eq!(b.in_flight(), 1);
        for _ in 0..8 {
            b.start(&id(), t0).expect("2 of 10 used");
        }
        assert!(b.start(&id(), t0).is_err(), "10 of 10 used");
        b.charge(&id(), 500, t0).expect("500 of 1000 used");
        assert!(b.charge(&id(), 1, t0).is_err(), "1000 of 1000 used");
    }

    /// A limit lowered below the last minute's usage refills at its new rate from nothing,
    /// not from a debt of the difference: lowered from 60 to 1 a minute after 60 requests, the
    /// next request waited an hour.
    #[test]
    fn a_limit_lowered_below_the_minutes_usage_lets_it_age_out_within_a_minute() {
        let t0 = Instant::now();
        let mut d = TenantBudget::new(limits(100, 60, 1_000_000), t0);
        for _ in 0..60 {
            d.start(&id(), t0).expect("60/min");
        }
        d.charge(&id(), 900_000, t0).expect("fits");
        d.retune(limits(100, 1, 10_000), t0);
        assert!(
            matches!(
                d.start(&id(), t0 + Duration::from_secs(30)),
                Err(LimitError::RequestsPerMinute {
                    retry_after_secs: 30,
                    ..
                })
            ),
            "half a request refilled"
        );
        d.start(&id(), t0 + Duration::from_secs(61))
            .expect("a minute at 1/min refills one request");
        d.charge(&id(), 10_000, t0 + Duration::from_secs(61))
            .expect("and the new minute's tokens");
    }

    #[test]
    fn the_rate_limit_headers_say_what_is_left_and_when_it_is_whole() {
        let t0 = Instant::now();
        let mut b = TenantBudget::new(limits(10, 120, 6000), t0);
        b.start(&id(), t0).expect("1 of 120");
        b.charge(&id(), 1500, t0).expect("1500 of 6000");
        let later = t0 + Duration::from_millis(250);
        let now = b.rate_limits(later);
        // 120 a minute refill 0.5 in 250 ms: 119.5 left, whole in 250 ms.
        assert_eq!(
            now.requests,
            Window {
                limit: 120,
                remaining: 119,
                reset: Duration::from_millis(250)
            }
        );
        // 6000 a minute refill 25 in 250 ms: 4525 left, 1475 short: 14.75 s.
        assert_eq!(now.tokens.remaining, 4525);
        assert_eq!(now.tokens.reset.as_millis(), 14_750);
        let mut headers = HeaderMap::new();
        now.write(&mut headers);
        let header = |name: &str| headers[name].to_str().expect("ascii").to_owned();
        assert_eq!(header("x-ratelimit-limit-requests"), "120");
        assert_eq!(header("x-ratelimit-remaining-requests"), "119");
        assert_eq!(header("x-ratelimit-reset-requests"), "250ms");
        assert_eq!(header("x-ratelimit-limit-tokens"), "6000");
        assert_eq!(header("x-ratelimit-remaining-tokens"), "4525");
        assert_eq!(header("x-ratelimit-reset-tokens"), "14.75s");
        // A limit lowered below the minute's usage shows nothing left, whole again in a minute.
        b.retune(limits(10, 120, 1000), later);
        let lowered = b.rate_limits(later).tokens;
        assert_eq!((lowered.limit, lowered.remaining), (1000, 0));
        assert_eq!(duration_text(lowered.reset), "1m0s");
        // Half a millisecond short of whole is not whole: the reset rounds up.
        let mut c = TenantBudget::new(limits(10, 120, 6000), t0);
        c.start(&id(), t0).expect("1 of 120");
        let almost = c.rate_limits(t0 + Duration::from_micros(499_750)).requests;
        assert_eq!(almost.reset, Duration::from_millis(1), "{almost:?}");
    }

    #[test]
    fn durations_are_written_as_openai_writes_them() {
        let ms = Duration::from_millis;
        for (d, text) in [
            (ms(0), "0s"),
            (Duration::from_micros(400), "0s"),
            (ms(17), "17ms"),
            (ms(1000), "1s"),
            (ms(1500), "1.5s"),
            (ms(59_999), "59.999s"),
            (ms(360_000), "6m0s"),
            (ms(61_250), "1m1.25s"),
            (ms(5_400_000), "1h30m0s"),
            (ms(3_600_500), "1h0m0.5s"),
        ] {
            assert_eq!(duration_text(d), text, "{d:?}");
        }
    }

    #[test]
    fn dropping_the_permit_frees_the_slot() {
        let tenant = Arc::new(Tenant {
            id: id(),
            limits: limits(1, 100, 1000),
            capture_content: false,
            reuse_id: false,
        });
        let limiter = Limiter::default();
        let permit = limiter.start(&tenant).expect("first");
        assert!(limiter.start(&tenant).is_err(), "one at a time");
        assert_eq!(limiter.in_flight(&tenant.id), 1);
        drop(permit);
        assert_eq!(limiter.in_flight(&tenant.id), 0);
        let _again = limiter.start(&tenant).expect("the slot came back");
    }

    #[test]
    fn tenants_have_separate_budgets() {
        let a = Arc::new(Tenant {
            id: TenantId::new("a").expect("valid"),
            limits: limits(1, 100, 1000),
            capture_content: false,
            reuse_id: false,
        });
        let b = Arc::new(Tenant {
            id: TenantId::new("b").expect("valid"),
            limits: limits(1, 100, 1000),
            capture_content: false,
            reuse_id: false,
        });
        let limiter = Limiter::default();
        let _a = limiter.start(&a).expect("a");
        let _b = limiter.start(&b).expect("b is not limited by a");
    }
}
