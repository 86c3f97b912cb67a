//! Responses' waits for their records (every one in durable mode; in group commit, those
//! appended while the flushes are behind). One thread fsyncs on behalf of every waiting response; each response
//! waits on the async runtime (no thread of its own) for a flush that *started* after its
//! record was appended, since that flush takes every record pending at its start. Concurrent
//! responses share one fsync and get one wake-up each.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::Thread;

use bulkhead_audit::AuditError;
use tokio::sync::watch;

/// The latest finished flush: how many have finished, and why the last one failed (a failed
/// flush poisons the log, so every later one fails too).
#[derive(Debug, Clone, Default)]
struct Flushed {
    count: u64,
    failure: Option<String>,
}

#[derive(Debug)]
struct Shared {
    /// Waits asked for so far (the thread flushes while this is ahead of what it handled).
    requested: AtomicU64,
    /// Flushes started so far.
    started: AtomicU64,
    stop: AtomicBool,
}

#[derive(Debug)]
pub(super) struct Syncer {
    shared: Arc<Shared>,
    /// Finished flushes. The thread holds the only sender: when it ends, for whatever reason,
    /// every waiter learns it instead of waiting forever.
    done: watch::Receiver<Flushed>,
    thread: Thread,
}

impl Syncer {
    /// Starts the thread; `flush` makes every appended record durable, or returns `None` once
    /// the log is gone (the thread then ends); `flushed` hears each flush's number, after its
    /// waiters are woken.
    pub(super) fn start(
        flush: impl Fn() -> Option<Result<(), AuditError>> + Send + 'static,
        flushed: impl Fn(u64) + Send + 'static,
    ) -> std::io::Result<Syncer> {
        let shared = Arc::new(Shared {
            requested: AtomicU64::new(0),
            started: AtomicU64::new(0),
            stop: AtomicBool::new(false),
        });
        let (done_tx, done) = watch::channel(Flushed::default());
        let own = shared.clone();
        let handle = std::thread::Builder::new()
            .name("audit-fsync".into())
            .spawn(move || {
                let mut handled = 0;
                while !own.stop.load(Ordering::Acquire) {
                    let requested = own.requested.load(Ordering::SeqCst);
                    if requested == handled {
                        std::thread::park();
                        continue;
                    }
                    handled = requested;
                    let count = own.started.fetch_add(1, Ordering::SeqCst) + 1;
                    let Some(result) = flush() else { return };
                    done_tx.send_replace(Flushed {
                        count,
                        failure: result.err().map(|e| e.to_string()),
                    });
                    flushed(count);
                }
            })?;
        Ok(Syncer {
            shared,
            done,
            thread: handle.thread().clone(),
        })
    }

    /// Returns once every record appended before this call is durable.
    ///
    /// Why a flush that starts after `started` was read includes those records: the append
    /// released the log's state lock before this read; had the flush taken that lock first, its
    /// `started` increment (made before) would be visible to this read.
    pub(super) async fn durable(&self) -> Result<(), AuditError> {
        let mut done = self.done.clone();
        let after = self.ticket();
        self.kick();
        let flushed =
            done.wait_for(|f| f.count > after)
                .await
                .map_err(|_| AuditError::Poisoned {
                    reason: "the audit fsync thread stopped".into(),
                })?;
        match &flushed.failure {
            None => Ok(()),
            Some(reason) => Err(AuditError::Poisoned {
                reason: reason.clone(),
            }),
        }
    }
}

impl Syncer {
    /// The ticket of the records appended before this call: they are durable once a flush
    /// numbered above it has succeeded (see [`Syncer::durable`] for why).
    pub(super) fn ticket(&self) -> u64 {
        self.shared.started.load(Ordering::SeqCst)
    }

    /// Asks for a flush, without waiting for it: one starts after this call.
    pub(super) fn kick(&self) {
        self.shared.requested.fetch_add(1, Ordering::SeqCst);
        self.thread.unpark();
    }
}

impl Drop for Syncer {
    fn drop(&mut self) {
        // Not joined: the thread may hold the last reference to the log during a flush.
        self.shared.stop.store(true, Ordering::Release);
        self.thread.unpark();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake log: `append` counts records; a flush makes durable those appended when it took
    /// them (at its start), after a pause.
    #[derive(Default)]
    struct FakeLog {
        appended: AtomicU64,
        durable: AtomicU64,
        flushes: AtomicU64,
    }

    fn syncer(log: &Arc<FakeLog>, fail: bool) -> Syncer {
        let log = log.clone();
        Syncer::start(
            move || {
                let taken = log.appended.load(Ordering::SeqCst);
                std::thread::sleep(std::time::Duration::from_millis(1));
                log.flushes.fetch_add(1, Ordering::SeqCst);
                if fail {
                    return Some(Err(AuditError::Poisoned {
                        reason: "disk full".into(),
                    }));
                }
                log.durable.fetch_max(taken, Ordering::SeqCst);
                Some(Ok(()))
            },
            |_| {},
        )
        .expect("thread")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_waiter_returns_after_its_record_is_durable_and_waiters_share_flushes() {
        let log = Arc::new(FakeLog::default());
        let syncer = Arc::new(syncer(&log, false));
        let waiters: Vec<_> = (0..200)
            .map(|_| {
                let (log, syncer) = (log.clone(), syncer.clone());
                tokio::spawn(async move {
                    let mine = log.appended.fetch_add(1, Ordering::SeqCst) + 1;
                    syncer.durable().await.expect("flushed");
                    let durable = log.durable.load(Ordering::SeqCst);
                    assert!(durable >= mine, "record {mine} answered at {durable}");
                })
            })
            .collect();
        for w in waiters {
            w.await.expect("a waiter");
        }
        let flushes = log.flushes.load(Ordering::SeqCst);
        assert!(
            flushes < 200,
            "{flushes} flushes for 200 waiters: none shared"
        );
    }

    #[tokio::test]
    async fn waiters_fail_when_the_thread_ends() {
        let syncer = Syncer::start(|| None, |_| {}).expect("thread");
        let e = syncer.durable().await.expect_err("no flush will come");
        assert!(e.to_string().contains("fsync thread stopped"), "{e}");
    }

    #[tokio::test]
    async fn a_failed_flush_fails_its_waiters() {
        let log = Arc::new(FakeLog::default());
        let syncer = syncer(&log, true);
        let e = syncer.durable().await.expect_err("the flush failed");
        assert!(e.to_string().contains("disk full"), "{e}");
    }
}
