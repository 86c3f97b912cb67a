//! A Prometheus histogram with fixed bucket bounds, counted in whole units of a [`Scale`]
//! (microseconds for requests and policy calls) and rendered in seconds.

use std::fmt::Write as _;
use std::marker::PhantomData;
use std::time::Duration;

/// A histogram's unit and bucket bounds.
pub(crate) trait Scale {
    /// The buckets' upper bounds, ascending, in this scale's units; at most [`MAX_BUCKETS`].
    const BOUNDS: &'static [u64];
    /// Units in a second.
    const PER_SECOND: u64;
}

/// The most buckets a scale may have.
const MAX_BUCKETS: usize = 16;

/// Observations in units of `S`.
pub(crate) struct Histogram<S> {
    /// Observations ≤ each bound and above the one before (summed when rendered).
    buckets: [u64; MAX_BUCKETS],
    count: u64,
    sum: u64,
    scale: PhantomData<S>,
}

impl<S> Default for Histogram<S> {
    fn default() -> Histogram<S> {
        Histogram {
            buckets: [0; MAX_BUCKETS],
            count: 0,
            sum: 0,
            scale: PhantomData,
        }
    }
}

impl<S> Clone for Histogram<S> {
    fn clone(&self) -> Histogram<S> {
        Histogram {
            buckets: self.buckets,
            count: self.count,
            sum: self.sum,
            scale: PhantomData,
        }
    }
}

impl<S> std::fmt::Debug for Histogram<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Histogram")
            .field("count", &self.count)
            .field("sum", &self.sum)
            .finish_non_exhaustive()
    }
}

impl<S: Scale> Histogram<S> {
    /// Refuses, at compile time, a scale with more bounds than there are buckets.
    const FITS: () = assert!(S::BOUNDS.len() <= MAX_BUCKETS);

    /// One observation of `took`, in whole units of the scale (saturating).
    pub(crate) fn observe(&mut self, took: Duration) {
        let units = took.as_nanos() * u128::from(S::PER_SECOND) / 1_000_000_000;
        self.observe_units(u64::try_from(units).unwrap_or(u64::MAX));
    }

    fn observe_units(&mut self, value: u64) {
        let () = Self::FITS;
        if let Some(i) = S::BOUNDS.iter().position(|&b| value <= b) {
            self.buckets[i] += 1;
        }
        self.count += 1;
        self.sum = self.sum.saturating_add(value);
    }

    pub(crate) fn add(&mut self, other: &Histogram<S>) {
        for (mine, theirs) in self.buckets.iter_mut().zip(other.buckets) {
            *mine += theirs;
        }
        self.count += other.count;
        self.sum = self.sum.saturating_add(other.sum);
    }

    /// The `_bucket`, `_sum` and `_count` lines of `name` with `labels` (`k="v",…`).
    pub(crate) fn render(&self, out: &mut String, name: &str, labels: &str) {
        let seconds = |units: u64| units as f64 / S::PER_SECOND as f64;
        let mut cumulative = 0;
        for (&bound, n) in S::BOUNDS.iter().zip(self.buckets) {
            cumulative += n;
            let le = seconds(bound);
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{le}\"}} {cumulative}");
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels},le=\"+Inf\"}} {count}\n\
             {name}_sum{{{labels}}} {sum}\n\
             {name}_count{{{labels}}} {count}",
            count = self.count,
            sum = seconds(self.sum),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Tens;

    impl Scale for Tens {
        const BOUNDS: &'static [u64] = &[10, 100];
        const PER_SECOND: u64 = 1000;
    }

    #[test]
    fn buckets_are_cumulative_in_seconds_and_overflow_counts_only_in_inf() {
        let mut h = Histogram::<Tens>::default();
        for v in [3, 10, 11, 5000] {
            h.observe(Duration::from_millis(v));
        }
        let mut other = Histogram::<Tens>::default();
        other.observe(Duration::from_millis(100));
        h.add(&other);
        let mut out = String::new();
        h.render(&mut out, "t", "k=\"v\"");
        assert_eq!(
            out,
            "t_bucket{k=\"v\",le=\"0.01\"} 2\n\
             t_bucket{k=\"v\",le=\"0.1\"} 4\n\
             t_bucket{k=\"v\",le=\"+Inf\"} 5\n\
             t_sum{k=\"v\"} 5.124\n\
             t_count{k=\"v\"} 5\n"
        );
    }
}
