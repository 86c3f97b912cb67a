//! Counters and gauges of the KV handoff on one engine, as the worker's `/metrics` shows them.

use std::time::Duration;

/// The prefix cache's counters: how much of the prompts computed here it served.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Prompt tokens of the requests that looked their prompt up in the cache.
    pub prompt_tokens: u64,
    /// Of those, tokens whose KV was read from the cache instead of computed.
    pub cached_tokens: u64,
    /// Cached pages distrusted after a request that read them failed a KV integrity check on
    /// them (they leave the cache once their readers end).
    pub distrusted_pages: u64,
}

/// Why decode dropped a frame, as counted: no live session (unknown, or already abandoned: a
/// late frame), one of [`bulkhead_handoff::DropReason::LABELS`], or an accepted frame that did not fit its page
/// (a bug).
pub const DROP_LABELS: [&str; 11] = [
    "no_session",
    "wrong_session",
    "index_out_of_range",
    "tag_not_reserved",
    "page_left_session",
    "wrong_tokens",
    "wrong_length",
    "duplicate",
    "corrupt",
    "after_manifest",
    "not_written",
];

/// Frames dropped, by reason ([`DROP_LABELS`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FrameDrops([u64; DROP_LABELS.len()]);

impl FrameDrops {
    pub(super) fn add(&mut self, label: &str) {
        if let Some(i) = DROP_LABELS.iter().position(|l| *l == label) {
            self.0[i] += 1;
        }
    }

    /// Frames dropped for reason `label` (0 for an unknown label).
    pub fn get(&self, label: &str) -> u64 {
        DROP_LABELS
            .iter()
            .position(|l| *l == label)
            .map_or(0, |i| self.0[i])
    }

    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }

    /// Every reason with its count, in [`DROP_LABELS`] order.
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        DROP_LABELS.iter().copied().zip(self.0.iter().copied())
    }
}

/// Upper bounds (seconds) of the abort-acknowledgement latency histogram's buckets.
pub const ABORT_ACK_BUCKETS: [f64; 10] = [0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0];

/// A latency histogram over [`ABORT_ACK_BUCKETS`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Histogram {
    /// Observations per bucket (not cumulative); the last counts those above every bound.
    buckets: [u64; ABORT_ACK_BUCKETS.len() + 1],
    sum_micros: u64,
}

impl Histogram {
    pub(super) fn observe(&mut self, d: Duration) {
        let s = d.as_secs_f64();
        let i = ABORT_ACK_BUCKETS
            .iter()
            .position(|&b| s <= b)
            .unwrap_or(ABORT_ACK_BUCKETS.len());
        self.buckets[i] += 1;
        self.sum_micros = self
            .sum_micros
            .saturating_add(u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
    }

    pub fn count(&self) -> u64 {
        self.buckets.iter().sum()
    }

    pub fn sum_seconds(&self) -> f64 {
        self.sum_micros as f64 / 1e6
    }

    /// `(upper bound, observations at or below it)` per bucket, as Prometheus wants them
    /// (cumulative), without the `+Inf` bucket (that is [`Histogram::count`]).
    pub fn cumulative(&self) -> impl Iterator<Item = (f64, u64)> + '_ {
        ABORT_ACK_BUCKETS
            .iter()
            .zip(self.buckets.iter().scan(0, |acc, &n| {
                *acc += n;
                Some(*acc)
            }))
            .map(|(&b, n)| (b, n))
    }
}

/// The KV handoff on this engine: counters since start, and gauges as of now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TransferStats {
    /// Frames admitted and written.
    pub frames_written: u64,
    /// Frames dropped, by reason.
    pub frames_dropped: FrameDrops,
    /// Transfers that failed verification.
    pub integrity_failures: u64,
    /// Abandoned transfers whose pages were quarantined because no drain acknowledgement came.
    pub drain_timeouts: u64,
    /// Quarantined pages given back automatically: a transfer's once its peer was known gone, a
    /// failed request's after `reclaim_after`.
    pub reclaimed_pages: u64,
    /// From abandoning a transfer (cancel, timeout) to its drain acknowledgement.
    pub abort_ack: Histogram,
    /// Abandoned transfers whose pages came back because their call or connection ended,
    /// without an acknowledgement.
    pub teardown_drains: u64,
    /// Gauge: decode-side transfers waiting for or receiving their KV.
    pub transfers_in_flight: u64,
    /// Gauge: prompt tokens those transfers carry (those after decode's cached prefix).
    pub in_flight_tokens: u64,
    /// Gauge: tokens admitted and holding pages (reserved for a transfer, or running).
    pub reserved_tokens: u64,
    /// Gauge: quarantines waiting for their peer to be known gone.
    pub quarantined_sessions: u64,
}

#[cfg(test)]
mod tests {
    use bulkhead_handoff::DropReason;

    use super::*;

    #[test]
    fn drop_labels_are_the_handoff_reasons_between_the_engine_s_own() {
        assert_eq!(
            DROP_LABELS[1..=DropReason::LABELS.len()],
            DropReason::LABELS
        );
        let mut d = FrameDrops::default();
        d.add("corrupt");
        d.add("corrupt");
        d.add("no_session");
        d.add("no such reason");
        assert_eq!(
            (d.get("corrupt"), d.get("no_session"), d.total()),
            (2, 1, 3)
        );
    }

    #[test]
    fn the_histogram_is_cumulative_with_its_sum_and_count() {
        let mut h = Histogram::default();
        h.observe(Duration::from_micros(500));
        h.observe(Duration::from_millis(20));
        h.observe(Duration::from_secs(60));
        let c: Vec<(f64, u64)> = h.cumulative().collect();
        assert_eq!(c[0], (0.001, 1));
        assert_eq!(c[3], (0.05, 2));
        assert_eq!(c[9], (30.0, 2));
        assert_eq!(h.count(), 3);
        assert!((h.sum_seconds() - 60.0205).abs() < 1e-9);
    }
}
