//! The time a plugin call is charged against its deadline. A call runs on the serving thread
//! that asked for it and yields at every epoch tick, and while it waits for its turn again the
//! thread serves other requests — other tenants' plugin calls among them. Charging that wait
//! to the call would let one tenant's slow calls (a binding that spins on what its requests
//! carry) push every other call on the thread past its deadline: requests that did nothing
//! wrong would fail closed. So a call is charged the time since it started less the time it
//! spent yielded: the time it ran, and the time it waited in a host call (a WASI sleep is the
//! guest's own doing). Its waits are not unbounded either: a call also ends once
//! [`TURN_ALLOWANCE`] of wall time past its deadline has gone by, so that calls spinning side
//! by side on one thread (each charged a share) hold their instance slots, and their requests,
//! for a bounded time.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How much wall time past its deadline a call may spend waiting for its turns.
pub(super) const TURN_ALLOWANCE: Duration = Duration::from_millis(500);

/// One call's clock; clones read the same clock.
#[derive(Debug, Clone)]
pub(super) struct CallClock {
    started: Instant,
    /// Nanoseconds spent yielded, waiting for the runtime to poll the call again.
    yielded: Arc<AtomicU64>,
}

impl CallClock {
    pub(super) fn start() -> CallClock {
        CallClock {
            started: Instant::now(),
            yielded: Arc::new(AtomicU64::new(0)),
        }
    }

    /// The time charged so far.
    pub(super) fn charged(&self) -> Duration {
        self.started
            .elapsed()
            .saturating_sub(Duration::from_nanos(self.yielded.load(Ordering::Relaxed)))
    }

    /// Yields to the runtime (the guest's turn ends at an epoch tick) without charging the
    /// wait for the next turn.
    pub(super) fn yield_turn(&self) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        let yielded = self.yielded.clone();
        Box::pin(async move {
            let since = Instant::now();
            tokio::task::yield_now().await;
            let waited = u64::try_from(since.elapsed().as_nanos()).unwrap_or(u64::MAX);
            yielded.fetch_add(waited, Ordering::Relaxed);
        })
    }

    /// Whether a call of deadline `budget` is over it: `budget` charged, or
    /// [`TURN_ALLOWANCE`] of wall time past it gone by.
    pub(super) fn over(&self, budget: Duration) -> bool {
        self.left(budget).is_zero()
    }

    /// Until the call is [`CallClock::over`] `budget`, at the soonest.
    fn left(&self, budget: Duration) -> Duration {
        let charged = budget.saturating_sub(self.charged());
        let wall = (budget + TURN_ALLOWANCE).saturating_sub(self.started.elapsed());
        charged.min(wall)
    }

    /// Resolves once the call is [`CallClock::over`] `budget`. A call that yields is charged
    /// less than the wall time that passes, so the wait is taken again until then.
    pub(super) async fn spent(&self, budget: Duration) {
        loop {
            let left = self.left(budget);
            if left.is_zero() {
                return;
            }
            tokio::time::sleep(left).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A busy task beside the clock's owner: every turn the owner yields, it waits a blocking
    /// 20 ms, as another request's plugin call would hold the thread.
    async fn hog(turns: u32) {
        for _ in 0..turns {
            std::thread::sleep(Duration::from_millis(20));
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn the_wait_for_the_next_turn_is_not_charged_and_the_rest_is() {
        let clock = CallClock::start();
        let other = tokio::spawn(hog(3));
        for _ in 0..3 {
            clock.yield_turn().await;
        }
        let wall = clock.started.elapsed();
        assert!(wall >= Duration::from_millis(60), "{wall:?}");
        assert!(
            clock.charged() < Duration::from_millis(15),
            "charged {:?} of {wall:?}",
            clock.charged()
        );
        other.await.expect("the hog ran");
        // Time not spent yielded is charged, whatever the call did with it.
        std::thread::sleep(Duration::from_millis(30));
        assert!(clock.charged() >= Duration::from_millis(30));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_call_that_waits_its_turns_is_over_its_deadline_past_the_allowance() {
        let clock = CallClock::start();
        let other = tokio::spawn(hog(40));
        let budget = Duration::from_millis(10);
        while !clock.over(budget) {
            clock.yield_turn().await;
        }
        let wall = clock.started.elapsed();
        assert!(clock.charged() < budget, "charged {:?}", clock.charged());
        assert!(wall >= budget + TURN_ALLOWANCE, "{wall:?}");
        other.abort();
    }

    #[tokio::test(flavor = "current_thread")]
    async fn spent_waits_out_the_budget_in_charged_time() {
        let clock = CallClock::start();
        let t0 = Instant::now();
        clock.spent(Duration::from_millis(30)).await;
        assert!(clock.charged() >= Duration::from_millis(30));
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    }
}
