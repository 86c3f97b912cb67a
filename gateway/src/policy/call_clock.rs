//! The time a plugin call is charged against its deadline. A call runs on the serving thread
//! that asked for it and yields at every epoch tick, and while it waits for its turn again the
//! thread serves other requests — other tenants' plugin calls among them. Charging that wait
//! to the call would let one tenant's slow calls (a binding that spins on what its requests
//! carry) push every other call on the thread past its deadline: requests that did nothing
//! wrong would fail closed. So a call is charged the time since it started less the time it
//! spent yielded: the time it ran, and the time it waited in a host call (a WASI sleep is the
//! guest's own doing).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

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

    /// Resolves once `budget` has been charged. A call that yields is charged less than the
    /// wall time that passes, so the wait is taken again until the budget is spent.
    pub(super) async fn spent(&self, budget: Duration) {
        loop {
            let left = budget.saturating_sub(self.charged());
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
    async fn spent_waits_out_the_budget_in_charged_time() {
        let clock = CallClock::start();
        let t0 = Instant::now();
        clock.spent(Duration::from_millis(30)).await;
        assert!(clock.charged() >= Duration::from_millis(30));
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    }
}
