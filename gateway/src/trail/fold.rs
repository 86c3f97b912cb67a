//! The logs' budgets. Requests whose records say little more than that they came, and that
//! cost their sender next to nothing, could fill the disk every log shares — and a log that
//! cannot write turns every tenant away (`on_failure = "refuse"`):
//! - a request with no tenant to charge (no key, an unknown one), in the gateway's log;
//! - a tenant's request that ended before a prompt of it was counted (refused at the door by
//!   the tenant's limits, a model listing, an unknown route, a body that is not a request), in
//!   the tenant's log: its limits bound only the requests they let in, and a listing or an
//!   unknown route is not limited at all (a gateway in front health-checks by `/v1/models`).
//!
//! Each log has a budget for such records (`gateway_records_per_minute` for the gateway's,
//! `unread_records_per_minute` for each tenant's); past it, each is counted into a folded
//! record of its log that stands for every such request of its window (at most one record per
//! [`WINDOW`] and log). Every request is still accounted for (I5), and a flood costs the disk
//! one record per window. A request whose prompt was counted has a record of its own, always:
//! it passed its tenant's limits.
//!
//! ```text
//!  budget left ─▶ the log's pending folded record once due, then the request's own record
//!  budget spent ─▶ counted in the log's pending folded record; written once WINDOW has
//!                  passed (by the log's next record, or by a timer set when it opened) or at
//!                  flush
//! ```

use std::collections::{BTreeMap, HashMap};
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

/// Every log's budget and the folded record it is collecting.
#[derive(Debug)]
pub struct Folds {
    gateway: TenantId,
    gateway_per_minute: u64,
    unread_per_minute: u64,
    /// The logs that have had a foldable record, while their budget is not whole again or a
    /// folded record is being collected (a new entry sweeps out the others that are idle).
    logs: HashMap<TenantId, Folding>,
}

/// What the log is to take for one record, and the log whose folded record it opened.
#[derive(Debug)]
pub struct Admitted {
    pub appends: Appends,
    /// The record was the first one counted into its log's folded record: whoever writes the
    /// records sees that it goes out a window later.
    pub opened: Option<TenantId>,
}

impl Folds {
    /// The gateway log's budget of `gateway_per_minute` records and each tenant's of
    /// `unread_per_minute`.
    pub fn new(gateway: TenantId, gateway_per_minute: u64, unread_per_minute: u64) -> Folds {
        Folds {
            gateway,
            gateway_per_minute,
            unread_per_minute,
            logs: HashMap::new(),
        }
    }

    /// What the log is to take for `record`, a [`foldable`] one, in order: its log's folded
    /// record once due, then — within its log's budget — `record`.
    pub fn admit(&mut self, record: AuditRecord, now: Instant) -> Admitted {
        debug_assert!(foldable(&record, &self.gateway), "{record:?}");
        if !self.logs.contains_key(&record.tenant) {
            self.logs.retain(|_, f| !f.idle(now));
        }
        let per_minute = if record.tenant == self.gateway {
            self.gateway_per_minute
        } else {
            self.unread_per_minute
        };
        let tenant = record.tenant.clone();
        let folding = self
            .logs
            .entry(tenant.clone())
            .or_insert_with(|| Folding::new(per_minute, now));
        let collecting = folding.pending();
        let appends = folding.admit(record, now);
        Admitted {
            opened: (folding.pending() && !collecting).then_some(tenant),
            appends,
        }
    }

    /// `log`'s pending folded record, once it has collected for [`WINDOW`].
    pub fn due(&mut self, log: &TenantId, now: Instant) -> Option<AuditRecord> {
        self.logs.get_mut(log).and_then(|f| f.due(now))
    }

    /// Every log's pending folded record, whatever its age (shutdown).
    pub fn drain(&mut self) -> Vec<AuditRecord> {
        self.logs.values_mut().filter_map(Folding::drain).collect()
    }
}

/// Whether `record` goes through its log's budget: every record of the `gateway` log, and a
/// tenant's request that ended before a prompt of it was counted — no policy asked, no worker
/// contacted, so its record holds no more than its route, key, status and why.
pub fn foldable(record: &AuditRecord, gateway: &TenantId) -> bool {
    record.tenant == *gateway
        || (record.input_tokens.is_none()
            && record.workers.is_none()
            && record.policy.is_empty()
            && !answered_audit_read(record))
}

/// A tenant's read of its own audit log that was answered: who read which records is an audit
/// event of its own, kept whole (the reads are limited like any request).
fn answered_audit_read(record: &AuditRecord) -> bool {
    record.route == crate::api::AUDIT_ROUTE && record.status < 400
}

/// One log's budget and the folded record it is collecting.
#[derive(Debug)]
struct Folding {
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
    fn new(per_minute: u64, now: Instant) -> Folding {
        Folding {
            budget: Bucket::full(per_minute, now),
            pending: None,
        }
    }

    /// What the log is to take, in order, for `record`, a foldable record ending now: the
    /// pending folded record once it has collected for [`WINDOW`], then — within budget —
    /// `record`; past the budget `record` is counted in the pending folded record instead. (A
    /// budget that refills during a flood lets a record through now and then; the folded
    /// record still waits for its window, so a flood adds at most one record per window.)
    fn admit(&mut self, record: AuditRecord, now: Instant) -> Appends {
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
    fn due(&mut self, now: Instant) -> Option<AuditRecord> {
        let ripe = self
            .pending
            .as_ref()
            .is_some_and(|p| now.saturating_duration_since(p.opened) >= WINDOW);
        ripe.then(|| self.drain()).flatten()
    }

    /// The pending folded record, whatever its age (shutdown).
    fn drain(&mut self) -> Option<AuditRecord> {
        self.pending.take().map(Pending::seal)
    }

    /// Whether a folded record is being collected.
    fn pending(&self) -> bool {
        self.pending.is_some()
    }

    /// Whether it has nothing to remember: no folded record collecting, the budget whole.
    fn idle(&mut self, now: Instant) -> bool {
        self.pending.is_none() && self.budget.is_full(now)
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

    /// The folded record, in its log: no one request's model, tokens or content.
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

    fn of(log: &TenantId, i: u64, status: u16) -> AuditRecord {
        AuditRecord {
            time_unix_ms: i,
            status,
            ..AuditRecord::new(format!("{log}-{i}"), log.clone(), "/v1/models".to_owned())
        }
    }

    /// A record of a request whose prompt was counted: never folded.
    fn read(log: &TenantId, i: u64, status: u16) -> AuditRecord {
        AuditRecord {
            input_tokens: Some(7),
            ..of(log, i, status)
        }
    }

    fn written(admitted: Admitted, into: &mut Vec<AuditRecord>) {
        into.extend(admitted.appends.into_iter().flatten());
    }

    /// Each log folds its own flood within its own budget: the gateway's of requests without
    /// a key, a tenant's of requests that ended before a prompt was counted (here refused at
    /// the door); a log's due folded record goes out with its own next foldable record, never
    /// another log's. A tenant's records of requests whose prompt was counted — answered, or
    /// refused after —, and its answered reads of its audit log, are not foldable.
    #[test]
    fn each_log_folds_its_own_flood_and_a_tenants_other_records_are_never_folded() {
        let start = Instant::now();
        let gateway = TenantId::new(crate::trail::GATEWAY_LOG).expect("valid");
        let (a, b) = (
            TenantId::new("tenant-a").expect("valid"),
            TenantId::new("tenant-b").expect("valid"),
        );
        for kept in [read(&b, 1, 429), read(&b, 2, 200)] {
            assert!(!foldable(&kept, &gateway), "{kept:?}");
        }
        let mut audit_read = of(&b, 3, 200);
        audit_read.route = crate::api::AUDIT_ROUTE.to_owned();
        assert!(!foldable(&audit_read, &gateway));
        audit_read.status = 429;
        assert!(foldable(&audit_read, &gateway), "a refused read folds");

        let mut folds = Folds::new(gateway.clone(), 2, 3);
        let mut out = Vec::new();
        let mut opened = Vec::new();
        for i in 0..10 {
            for (log, status) in [(&a, 429), (&gateway, 401)] {
                let admitted = folds.admit(of(log, i, status), start);
                opened.extend(admitted.opened.clone());
                written(admitted, &mut out);
            }
        }
        let own = |log: &TenantId| out.iter().filter(|r| r.tenant == *log).count();
        assert_eq!((own(&a), own(&gateway)), (3, 2));
        assert!(out.iter().all(|r| r.folded.is_none()));
        assert_eq!(
            opened,
            [gateway.clone(), a.clone()],
            "each log's fold opens once, when its budget is spent"
        );

        let later = start + WINDOW;
        assert!(folds.due(&b, later).is_none(), "b has no folded record");
        let admitted = folds.admit(of(&a, 99, 429), later);
        let folded = admitted.appends[0]
            .as_ref()
            .expect("a's folded record is due");
        assert_eq!(folded.tenant, a);
        let f = folded.folded.as_ref().expect("folded");
        // The seven past the budget and this one, counted before its record went out.
        assert_eq!(
            (f.requests, f.statuses.clone()),
            (
                8,
                vec![StatusCount {
                    status: 429,
                    requests: 8
                }]
            )
        );
        assert!(admitted.appends[1].is_none(), "past the budget: folded");

        let drained = folds.drain();
        assert_eq!(drained.len(), 1, "{drained:#?}");
        assert_eq!(drained[0].tenant, gateway);
        assert_eq!(drained[0].folded.as_ref().map(|f| f.requests), Some(8));

        // Once their budgets are whole again, a log's first foldable record sweeps the idle
        // ones out: the budgets of tenants gone by a reload are not kept for ever.
        let whole = start + Duration::from_secs(120);
        written(folds.admit(of(&b, 200, 429), whole), &mut out);
        assert_eq!(folds.logs.keys().collect::<Vec<_>>(), [&b]);
    }
}
