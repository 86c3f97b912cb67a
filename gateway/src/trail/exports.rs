//! Audit records exported over OpenTelemetry once the log holds them durably. The exported
//! record carries its place in its tenant's chain and its line's SHA-256: the collector's copy
//! is an anchor (`bulkhead audit verify --anchor`), and an anchor for a record that a crash
//! then took from the log (appended, not yet flushed) would be reported as a rollback. A record
//! the log refuses goes at once, with no place: a copy of what the log does not hold.

use std::sync::{Mutex, MutexGuard, PoisonError};

use bulkhead_audit::{AuditRecord, Seq, Sha256Digest, TenantId};
use bulkhead_telemetry::{AuditExport, RecordTrace};

/// Where exported records go: the OpenTelemetry exporter (a test's list, in tests).
type Sink = Box<dyn Fn(AuditRecord, &RecordTrace, Option<(Seq, Sha256Digest)>) + Send + Sync>;

/// Records the log took, waiting for the flush that makes them durable.
pub(super) struct Exports {
    sink: Sink,
    /// Each record with its ticket: it is durable once a flush numbered above it has finished.
    waiting: Mutex<Vec<(u64, Waiting)>>,
}

struct Waiting {
    record: AuditRecord,
    trace: RecordTrace,
    place: (Seq, Sha256Digest),
}

impl std::fmt::Debug for Exports {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exports")
            .field("waiting", &self.lock().len())
            .finish_non_exhaustive()
    }
}

impl Exports {
    pub(super) fn new(export: AuditExport) -> Exports {
        Exports::to(Box::new(move |record, trace, place| {
            export.export(record, trace, place);
        }))
    }

    fn to(sink: Sink) -> Exports {
        Exports {
            sink,
            waiting: Mutex::new(Vec::new()),
        }
    }

    /// `record`, which the log took at `place`, is exported once a flush numbered above
    /// `ticket` has made it durable.
    pub(super) fn when_durable(
        &self,
        ticket: u64,
        record: AuditRecord,
        trace: RecordTrace,
        place: (Seq, Sha256Digest),
    ) {
        let waiting = Waiting {
            record,
            trace,
            place,
        };
        self.lock().push((ticket, waiting));
    }

    /// A record the log refused: exported now, with no place in it.
    pub(super) fn refused(&self, record: AuditRecord, trace: &RecordTrace) {
        (self.sink)(record, trace, None);
    }

    /// Flush number `flush` has finished: of the records it took, those it made durable
    /// (`durable` says, by tenant and `seq`) are exported, the others forgotten (the log
    /// dropped them). A flush that failed on one tenant made those it wrote before durable.
    pub(super) fn flushed(&self, flush: u64, durable: impl Fn(&TenantId, Seq) -> bool) {
        let due: Vec<Waiting> = {
            let mut waiting = self.lock();
            // Tickets come in nearly in order, not exactly: two appends race to the queue.
            let (due, later) = std::mem::take(&mut *waiting)
                .into_iter()
                .partition(|(ticket, _)| *ticket < flush);
            *waiting = later;
            due.into_iter().map(|(_, w)| w).collect()
        };
        for w in due
            .into_iter()
            .filter(|w| durable(&w.record.tenant, w.place.0))
        {
            (self.sink)(w.record, &w.trace, Some(w.place));
        }
    }

    fn lock(&self) -> MutexGuard<'_, Vec<(u64, Waiting)>> {
        self.waiting.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use bulkhead_audit::TenantId;

    use super::*;

    fn record(id: &str) -> AuditRecord {
        let tenant = TenantId::new("tenant-a").expect("an id");
        AuditRecord::new(id.to_owned(), tenant, "/v1/completions".to_owned())
    }

    #[test]
    fn a_record_goes_out_once_a_flush_made_it_durable_and_never_if_none_did() {
        // Each record sent: its request id, and its place's seq.
        type Sent = Arc<Mutex<Vec<(String, Option<u64>)>>>;
        let sent: Sent = Arc::default();
        let log = sent.clone();
        let exports = Exports::to(Box::new(move |record, _, place| {
            let seq = place.map(|(seq, _)| seq.0);
            log.lock().expect("lock").push((record.request_id, seq));
        }));
        let place = |seq| (Seq(seq), Sha256Digest::of(b"a line"));
        let none = RecordTrace::none();
        // Tickets out of order, as racing appends queue them.
        exports.when_durable(1, record("b"), none.clone(), place(1));
        exports.when_durable(0, record("a"), none.clone(), place(0));
        exports.when_durable(2, record("c"), none.clone(), place(2));
        let all = |_: &TenantId, _| true;
        exports.flushed(1, all);
        assert_eq!(*sent.lock().expect("lock"), [("a".to_owned(), Some(0))]);
        exports.flushed(2, all);
        assert_eq!(sent.lock().expect("lock").len(), 2);
        assert_eq!(sent.lock().expect("lock")[1], ("b".to_owned(), Some(1)));
        // A failed flush dropped "c": the collector never hears of it.
        exports.flushed(3, |_, _| false);
        exports.flushed(4, all);
        assert_eq!(sent.lock().expect("lock").len(), 2);
        // A flush that failed after writing some: those it made durable go out, only those.
        exports.when_durable(4, record("e"), none.clone(), place(3));
        exports.when_durable(4, record("f"), none.clone(), place(4));
        exports.flushed(5, |_, seq| seq.0 < 4);
        assert_eq!(sent.lock().expect("lock").len(), 3);
        assert_eq!(sent.lock().expect("lock")[2], ("e".to_owned(), Some(3)));
        // A refused record goes at once, with no place.
        exports.refused(record("d"), &none);
        assert_eq!(
            sent.lock().expect("lock").last(),
            Some(&("d".to_owned(), None))
        );
    }
}
