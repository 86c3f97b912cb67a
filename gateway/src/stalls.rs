//! Requests a worker took and never answered. A server that accepts a request and then sends
//! nothing — hung, or queueing far past any deadline — can still pass its health checks (an
//! OpenAI-compatible server such as llama.cpp's sends no headers before its first token, so
//! a queued request and a hung server look alike for a while). Each request routed to it then
//! waits out its whole deadline. After [`STALLS_TO_EJECT`] requests in a row end at their
//! deadline with no answer, the worker is not routed to for a while (30 s, doubling at each
//! ejection in a row up to 5 minutes); once that passes it takes requests again, and the first
//! answer it gives clears the count. Health checks do not end an ejection: they are what a
//! hung server still passes.

use std::time::{Duration, Instant};

/// Requests in a row that end at their deadline with no answer before the worker is ejected.
pub const STALLS_TO_EJECT: u32 = 3;

/// How long the first ejection in a row lasts; each one after it lasts twice the last.
const FIRST_EJECTION: Duration = Duration::from_secs(30);

/// The longest ejection.
const MAX_EJECTION: Duration = Duration::from_secs(300);

/// A worker's record of requests it left unanswered.
#[derive(Debug, Default, Clone)]
pub struct Stalls {
    /// Requests in a row that reached their deadline unanswered.
    in_a_row: u32,
    /// Ejections since the worker last answered.
    ejections: u32,
    /// Not routed to before this.
    until: Option<Instant>,
}

/// Why a worker is ejected, for `/workers` and the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ejection {
    /// Requests in a row that reached their deadline unanswered.
    pub in_a_row: u32,
    /// How long this ejection lasts, from the last of them.
    pub lasts: Duration,
}

impl Stalls {
    /// The worker answered a request: the count starts again.
    pub fn answered(&mut self) {
        *self = Stalls::default();
    }

    /// Whether any request is counted (an answer has something to clear).
    pub fn any(&self) -> bool {
        self.in_a_row > 0
    }

    /// A request reached its deadline at `now` with no answer; returns the ejection it starts,
    /// when it starts one. Requests routed before an ejection and ending during it add to the
    /// count but neither lengthen it nor start another (a hung worker's requests in flight all
    /// end at about the same time).
    pub fn stalled(&mut self, now: Instant) -> Option<Ejection> {
        self.in_a_row = self.in_a_row.saturating_add(1);
        if self.in_a_row < STALLS_TO_EJECT || self.ejected(now).is_some() {
            return None;
        }
        let lasts = FIRST_EJECTION
            .saturating_mul(1 << self.ejections.min(8))
            .min(MAX_EJECTION);
        self.ejections = self.ejections.saturating_add(1);
        self.until = Some(now + lasts);
        Some(Ejection {
            in_a_row: self.in_a_row,
            lasts,
        })
    }

    /// The ejection in force at `now`, if any.
    pub fn ejected(&self, now: Instant) -> Option<Ejection> {
        let until = self.until.filter(|&until| now < until)?;
        Some(Ejection {
            in_a_row: self.in_a_row,
            lasts: until - now,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn three_unanswered_in_a_row_eject_for_a_doubling_while_and_an_answer_clears_them() {
        let t0 = Instant::now();
        let mut s = Stalls::default();
        assert_eq!(s.stalled(t0), None);
        assert_eq!(s.stalled(t0), None);
        assert_eq!(s.ejected(t0), None, "two are not enough");
        let first = s.stalled(t0).expect("the third ejects");
        assert_eq!(first.lasts, FIRST_EJECTION);
        assert_eq!(
            s.ejected(t0 + Duration::from_secs(29)).map(|e| e.in_a_row),
            Some(3)
        );
        assert_eq!(
            s.ejected(t0 + FIRST_EJECTION),
            None,
            "routed again after it"
        );
        // Back, it leaves the next one unanswered too: ejected at once, twice as long.
        let t1 = t0 + FIRST_EJECTION;
        assert_eq!(s.stalled(t1).map(|e| e.lasts), Some(2 * FIRST_EJECTION));
        // Requests ending during an ejection neither lengthen it nor double the next.
        for _ in 0..20 {
            assert_eq!(s.stalled(t1), None);
        }
        assert_eq!(s.ejected(t1).map(|e| e.lasts), Some(2 * FIRST_EJECTION));
        // The doubling stops at the longest ejection.
        let mut t = t1;
        for _ in 0..10 {
            t += MAX_EJECTION;
            s.stalled(t);
        }
        assert_eq!(s.ejected(t).map(|e| e.lasts), Some(MAX_EJECTION));
        // An answer clears the count and the doubling.
        s.answered();
        assert!(!s.any());
        assert_eq!(s.ejected(t1), None);
        assert_eq!(s.stalled(t1), None);
        assert_eq!(s.stalled(t1), None);
        assert_eq!(s.stalled(t1).map(|e| e.lasts), Some(FIRST_EJECTION));
    }
}
