//! Telling a caller that waits for a prompt's computation that it goes on.
//!
//! A prompt's first token can be minutes away — a long prompt on a CPU, or one queued behind
//! others — and a caller cannot tell that wait from a worker that stopped: both are silent. So
//! while a caller waits, the worker reports its count of prompt tokens computed, for any request
//! (prompts are computed in arrival order, so the ones queued before this one are progress
//! towards it too), at most every [`EVERY`] and only when the count rose. A decode worker
//! restarts its transfer deadline with each report from its prefill worker, the gateway its
//! silence timeout with each report on `Generate`; a worker that stopped computing stops
//! reporting, and a report that does not rise is never sent.

use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::{Interval, MissedTickBehavior};

/// How often, at most, a waiting caller hears of progress. A caller's silence timeout should be
/// several times this.
pub const EVERY: Duration = Duration::from_millis(500);

/// The reports due to one waiting caller.
#[derive(Debug)]
pub struct Progress {
    ticks: Interval,
    /// The count last reported (or seen when the wait began).
    told: u64,
}

impl Progress {
    /// Starts from the computing worker's count `now`: only a rise above it is reported, the
    /// first at [`EVERY`] from now.
    pub fn from(now: u64) -> Progress {
        let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + EVERY, EVERY);
        ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
        Progress { ticks, told: now }
    }

    /// The count to report now: at a tick, when `count()` rose since the last report.
    pub fn poll_report(&mut self, cx: &mut Context<'_>, count: impl Fn() -> u64) -> Poll<u64> {
        loop {
            std::task::ready!(self.ticks.poll_tick(cx));
            let now = count();
            if now > self.told {
                self.told = now;
                return Poll::Ready(now);
            }
        }
    }

    /// [`Progress::poll_report`] as a future.
    pub async fn report(&mut self, count: impl Fn() -> u64) -> u64 {
        std::future::poll_fn(|cx| self.poll_report(cx, &count)).await
    }
}

/// What a receiver passes on of a peer's reports: a rise only, and at most one every half
/// [`EVERY`] (an honest peer reports at most every [`EVERY`]), so a peer that floods reports
/// costs the receiver a comparison each, never a command queued for its engine.
#[derive(Debug, Default)]
pub struct Heard {
    /// The count last passed on, and when.
    last: u64,
    at: Option<std::time::Instant>,
}

impl Heard {
    /// Whether the report of `count`, heard at `now`, is passed on.
    pub fn pass(&mut self, count: u64, now: std::time::Instant) -> bool {
        let due = self
            .at
            .is_none_or(|at| now.saturating_duration_since(at) >= EVERY / 2);
        if count <= self.last || !due {
            return false;
        }
        self.last = count;
        self.at = Some(now);
        true
    }
}

#[cfg(test)]
mod tests {
    /// A peer that floods reports is heard at an honest peer's pace, and only as it rises.
    #[test]
    fn a_flood_of_reports_is_passed_on_at_most_every_half_tick_and_only_rising() {
        let t0 = std::time::Instant::now();
        let mut heard = Heard::default();
        assert!(heard.pass(5, t0));
        assert!(!heard.pass(6, t0 + Duration::from_millis(10)), "too soon");
        assert!(heard.pass(6, t0 + EVERY / 2), "due, and risen");
        assert!(
            !heard.pass(6, t0 + EVERY * 4),
            "due, but not risen: a peer that stopped is not heard"
        );
        assert!(!heard.pass(3, t0 + EVERY * 5), "a fall is not heard");
        let passed = (1..=10_000u64)
            .filter(|i| heard.pass(6 + i, t0 + EVERY * 6 + Duration::from_micros(*i)))
            .count();
        assert_eq!(passed, 1, "ten thousand reports within 10 ms");
    }

    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    #[tokio::test(start_paused = true)]
    async fn only_a_rise_is_reported_and_at_most_once_per_tick() {
        let count = Arc::new(AtomicU64::new(100));
        let read = || count.load(Ordering::Relaxed);
        let started = tokio::time::Instant::now();
        let mut progress = Progress::from(read());

        // A rise at once is reported a tick after the wait began, not before.
        count.store(140, Ordering::Relaxed);
        assert_eq!(progress.report(read).await, 140);
        assert_eq!(started.elapsed(), EVERY);
        // A rise right after a report waits for the next tick.
        let told = tokio::time::Instant::now();
        count.store(150, Ordering::Relaxed);
        assert_eq!(progress.report(read).await, 150);
        assert_eq!(told.elapsed(), EVERY);

        // No rise: nothing, however long the wait; the same count is never reported twice.
        let silent = tokio::time::timeout(10 * EVERY, progress.report(read)).await;
        assert!(silent.is_err(), "reported without a rise");

        // Rises between ticks come as one report, by the next tick.
        let before = tokio::time::Instant::now();
        count.store(160, Ordering::Relaxed);
        count.store(170, Ordering::Relaxed);
        assert_eq!(progress.report(read).await, 170);
        assert!(before.elapsed() <= EVERY, "{:?}", before.elapsed());
    }
}
