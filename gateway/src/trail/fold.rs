//! The gateway log's budget. A request with no tenant to charge (no key, an unknown one) costs
//! its sender nothing, so a flood of them could fill the disk the tenants' logs share — and a
//! log that cannot write turns every tenant away (`on_failure = "refuse"`). Up to
//! `gateway_records_per_minute` of them get a record each; past that, each is counted into a
//! folded record that stands for every such request of its window (at most one record per
//! [`WINDOW`]). Every request is still accounted for (I5), and a flood costs the disk one
//! record per window.
//!
//! ```text
//!  budget left ─▶ the pending folded record (if any), then the request's own record
//!  budget spent ─▶ counted in the pending folded record; written once WINDOW has passed
//!                  (by the next record of any log, or by a timer set when it opened) or at
//!                  flush
//! ```

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use bulkhead_audit::{AuditRecord, Folded, StatusCount, TenantId};

use crate::limits::Bucket;

/// The longest a folded record collects requests before it is written.
pub const WINDOW: Duration = Duration::from_secs(1);

/// What the log is to take for one record, in order: the folded record that is due, if any,
/// then the record itself, unless it was folded. (An array, not a list: one per request, on
/// the hot path, allocates nothing.)
pub type Appends = [Option<AuditRecord>; 2];

/// The route a folded record names: its requests may have asked for any.
const ANY_ROUTE: &str = "*";

/// The gateway log's budget and the folded record it is collecting.
#[derive(Debug)]
pub struct Folding {
    budget: Bucket,
    pending: Option<Pending>,
}

/// A folded record in the making.
#[derive(Debug)]
struct Pending {
    tenant: TenantId,
    first_request_id: String,
    first_unix_ms: u64,
    last_request_id: String,
    last_unix_ms: u64,
    requests: u64,
    statuses: BTreeMap<u16, u64>,
    opened: Instant,
}

impl Folding {
    /// A full budget of `per_minute` records, refilled continuously.
    pub fn new(per_minute: u64, now: Instant) -> Folding {
        Folding {
            budget: Bucket::full(per_minute, now),
            pending: None,
        }
    }

    /// What the log is to take, in order, for `record`, a gateway-log record ending now: the
    /// pending folded record once it has collected for [`WINDOW`], then — within budget —
    /// `record`; past the budget `record` is counted in the pending folded record instead. (A
    /// budget that refills during a flood lets a record through now and then; the folded
    /// record still waits for its window, so a flood adds at most one record per window.)
    pub fn admit(&mut self, record: AuditRecord, now: Instant) -> Appends {
        if self.budget.take(1, now).is_ok() {
            return [self.due(now), Some(record)];
        }
        match &mut self.pending {
            Some(p) => p.add(&record),
            None => self.pending = Some(Pending::open(&record, now)),
        }
        [self.due(now), None]
    }

    /// The pending folded record, once it has collected for [`WINDOW`].
    pub fn due(&mut self, now: Instant) -> Option<AuditRecord> {
        let ripe = self
            .pending
            .as_ref()
            .is_some_and(|p| now.saturating_duration_since(p.opened) >= WINDOW);
        ripe.then(|| self.drain()).flatten()
    }

    /// The pending folded record, whatever its age (shutdown).
    pub fn drain(&mut self) -> Option<AuditRecord> {
        self.pending.take().map(Pending::seal)
    }

    /// Whether a folded record is being collected.
    pub fn pending(&self) -> bool {
        self.pending.is_some()
    }
}

impl Pending {
    fn open(first: &AuditRecord, now: Instant) -> Pending {
        let mut p = Pending {
            tenant: first.tenant.clone(),
            first_request_id: first.request_id.clone(),
            first_unix_ms: first.time_unix_ms,
            last_request_id: String::new(),
            last_unix_ms: 0,
            requests: 0,
            statuses: BTreeMap::new(),
            opened: now,
        };
        p.add(first);
        p
    }

    fn add(&mut self, record: &AuditRecord) {
        self.requests += 1;
        *self.statuses.entry(record.status).or_default() += 1;
        self.last_request_id.clone_from(&record.request_id);
        self.last_unix_ms = record.time_unix_ms;
    }

    /// The folded record, in the gateway log: no one request's model, tokens or content.
    fn seal(self) -> AuditRecord {
        let request_id = format!("{}..{}", self.first_request_id, self.last_request_id);
        AuditRecord {
            time_unix_ms: self.last_unix_ms,
            folded: Some(Folded {
                requests: self.requests,
                first_request_id: self.first_request_id,
                last_request_id: self.last_request_id,
                since_unix_ms: self.first_unix_ms,
                statuses: self
                    .statuses
                    .into_iter()
                    .map(|(status, requests)| StatusCount { status, requests })
                    .collect(),
            }),
            ..AuditRecord::new(request_id, self.tenant, ANY_ROUTE.to_owned())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(i: u64) -> AuditRecord {
        let gateway = TenantId::new(crate::trail::GATEWAY_LOG).expect("valid");
        AuditRecord {
            time_unix_ms: i,
            status: 401,
            ..AuditRecord::new(format!("req-{i}"), gateway, "/v1/models".to_owned())
        }
    }

    /// Three seconds of a flood, a request every 10 ms, against a budget of one a second:
    /// the burst and each refill get records of their own, and however often the budget lets
    /// one through, the folded records come at most once a window. Every request is counted
    /// once.
    #[test]
    fn a_flood_adds_at_most_one_folded_record_per_window_and_counts_every_request() {
        let start = Instant::now();
        let mut folding = Folding::new(60, start);
        let mut written = Vec::new();
        for i in 0..300 {
            let now = start + Duration::from_millis(10 * i);
            written.extend(folding.admit(record(i), now).into_iter().flatten());
        }
        written.extend(folding.drain());
        let own = written.iter().filter(|r| r.folded.is_none()).count();
        let folded: Vec<&Folded> = written.iter().filter_map(|r| r.folded.as_ref()).collect();
        assert!((60..=63).contains(&own), "the burst and the refills: {own}");
        assert!((2..=4).contains(&folded.len()), "{folded:#?}");
        let counted: u64 = folded.iter().map(|f| f.requests).sum();
        assert_eq!(own as u64 + counted, 300);
        for f in &folded {
            assert_eq!(
                f.statuses,
                [StatusCount {
                    status: 401,
                    requests: f.requests
                }]
            );
        }
    }
}
