//! The compute threads: a persistent pool that runs the kernels' parallel loops.
//!
//! A decode step runs about two hundred small parallel loops (each matmul, each layer's
//! attention), a few microseconds each. Waking a sleeping thread per loop costs as much as the
//! loop, so the pool's workers spin for a while after each loop before they sleep, and the
//! calling thread works too. Items are handed out one at a time from a shared counter, and a
//! worker joins a job only while it is open: a worker that the OS descheduled (the machine
//! may be shared) delays nobody, the caller does its items and closes the job.
//!
//! ```text
//!  caller: publish job (open) ─▶ take items ─▶ close ─▶ wait for checked-in workers ─▶ return
//!  worker: spin/sleep until a new epoch ─▶ check in if still open ─▶ take items ─▶ check out
//! ```

use std::any::Any;
use std::cell::UnsafeCell;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock, TryLockError};
use std::thread;

/// Spin iterations a worker waits for the next job before it sleeps: about 10 µs, enough to
/// bridge the serial ops between two matmuls of a step. Longer spins (1 << 14, ~200 µs) were a
/// quarter of all CPU samples and, on a shared machine, took time from the caller's thread.
const SPIN: u32 = 1 << 10;

/// A job: `f(i)` for every `i < n`. The function's lifetime is erased; [`Pool::for_each`]
/// does not return before every worker is done with it.
#[derive(Clone, Copy)]
struct Job {
    f: *const (dyn Fn(usize) + Sync),
    n: usize,
}

/// `Shared::state`: the job's epoch above bit 16, whether it is closed at bit 16, and the
/// number of workers checked in below.
const CLOSED: usize = 1 << 16;
const EPOCH_SHIFT: u32 = 17;
const COUNT: usize = CLOSED - 1;

struct Shared {
    /// Epoch, closed flag and checked-in workers of the current job (see [`CLOSED`]).
    state: AtomicUsize,
    /// The current job; written by the caller only while no worker can read it: before the
    /// epoch bump that publishes it, and after it closed with no worker checked in.
    job: UnsafeCell<Option<Job>>,
    /// The next item to hand out.
    next: AtomicUsize,
    /// Workers asleep on `wake`.
    sleeping: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    /// The first panic a worker caught in the current job, re-raised by the caller.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

// SAFETY: `job` is only written while no worker reads it (see the field's invariant), and
// the function it points to is `Sync`.
unsafe impl Sync for Shared {}
// SAFETY: as above; the raw pointer is only dereferenced under that protocol.
unsafe impl Send for Shared {}

/// The pool: `workers` threads besides the caller.
pub struct Pool {
    shared: &'static Shared,
    workers: usize,
    /// One job at a time; a nested or concurrent call runs its loop inline instead.
    submit: Mutex<()>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("threads", &(self.workers + 1))
            .finish()
    }
}

static POOL: OnceLock<Pool> = OnceLock::new();

/// Sets the number of compute threads (the caller included). Only the first call (or the
/// first parallel loop, which uses the machine's parallelism) decides; returns the count in
/// effect.
pub fn init(threads: usize) -> usize {
    POOL.get_or_init(|| Pool::new(threads.max(1))).workers + 1
}

/// The compute threads, started on first use.
pub fn global() -> &'static Pool {
    POOL.get_or_init(|| Pool::new(thread::available_parallelism().map_or(1, |n| n.get())))
}

impl Pool {
    fn new(threads: usize) -> Pool {
        let shared: &'static Shared = Box::leak(Box::new(Shared {
            state: AtomicUsize::new(CLOSED),
            job: UnsafeCell::new(None),
            next: AtomicUsize::new(0),
            sleeping: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            panic: Mutex::new(None),
        }));
        let mut workers = 0;
        // At most COUNT workers: one more checked in would carry into the CLOSED bit, and a
        // job would be taken for closed while workers still ran its caller's closure.
        for i in 1..threads.min(COUNT + 1) {
            let spawned = thread::Builder::new()
                .name(format!("bulkhead-compute-{i}"))
                .spawn(move || worker(shared));
            workers += usize::from(spawned.is_ok());
        }
        Pool {
            shared,
            workers,
            submit: Mutex::new(()),
        }
    }

    /// Threads that run loops, the caller included.
    pub fn threads(&self) -> usize {
        self.workers + 1
    }

    /// Calls `f(i)` for every `i < n`, spread over the pool's threads; returns when all are
    /// done. A panic in `f` is re-raised here.
    pub fn for_each(&self, n: usize, f: &(dyn Fn(usize) + Sync)) {
        let guard = match self.submit.try_lock() {
            Ok(g) => Some(g),
            Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        };
        if n <= 1 || self.workers == 0 || guard.is_none() {
            (0..n).for_each(f);
            return;
        }
        let s = self.shared;
        // SAFETY: only lifetimes change; the pointer is dereferenced only until every worker
        // checked out of this job, which happens before this function returns.
        let f: *const (dyn Fn(usize) + Sync) = unsafe { std::mem::transmute(f) };
        // SAFETY: no worker reads `job` now: the previous job closed with no worker checked
        // in, and none checks in before the new epoch below is published.
        unsafe { *s.job.get() = Some(Job { f, n }) };
        s.next.store(0, Ordering::Relaxed);
        let epoch = (s.state.load(Ordering::Relaxed) >> EPOCH_SHIFT).wrapping_add(1);
        s.state.store(epoch << EPOCH_SHIFT, Ordering::SeqCst);
        if s.sleeping.load(Ordering::SeqCst) > 0 {
            drop(s.lock.lock());
            s.wake.notify_all();
        }
        let mine = catch_unwind(AssertUnwindSafe(|| take_items(s, f, n)));
        s.state.fetch_or(CLOSED, Ordering::SeqCst);
        let mut spins = 0u32;
        while s.state.load(Ordering::Acquire) & COUNT > 0 {
            spins = spins.saturating_add(1);
            if spins < SPIN {
                std::hint::spin_loop();
            } else {
                thread::yield_now();
            }
        }
        // SAFETY: the job is closed and no worker is checked in; none reads `job` again
        // before the next epoch.
        unsafe { *s.job.get() = None };
        // Taken whether or not it is the one raised: left behind, a worker's panic of this
        // job would fail the next one, another caller's.
        let caught = s.panic.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(p) = mine.err().or(caught) {
            resume_unwind(p);
        }
    }
}

impl Pool {
    /// Calls `f(i, chunk)` for each of the consecutive `chunk_len`-long chunks of `out` (the
    /// last may be shorter), spread over the pool's threads.
    pub fn for_each_chunk_mut(
        &self,
        out: &mut [f32],
        chunk_len: usize,
        f: &(dyn Fn(usize, &mut [f32]) + Sync),
    ) {
        let len = out.len();
        let base = SharedOut::new(out);
        self.for_each(len.div_ceil(chunk_len.max(1)), &|i| {
            let start = i * chunk_len;
            let end = (start + chunk_len).min(len);
            // SAFETY: `start..end` lies inside `out`, which is borrowed mutably for the whole
            // loop; each item `i` runs once, and the items' ranges are disjoint.
            let chunk =
                unsafe { std::slice::from_raw_parts_mut(base.ptr().add(start), end - start) };
            f(i, chunk);
        });
    }
}

/// The output of a parallel loop whose items write disjoint elements of it.
#[derive(Clone, Copy)]
pub(crate) struct SharedOut(*mut f32);

impl SharedOut {
    pub(crate) fn new(out: &mut [f32]) -> SharedOut {
        SharedOut(out.as_mut_ptr())
    }

    /// The output's first element (a method, so closures capture the whole `Sync` wrapper).
    fn ptr(self) -> *mut f32 {
        self.0
    }

    /// # Safety
    /// `at` is in bounds of the output slice, which is alive, and no other thread accesses
    /// element `at` concurrently.
    pub(crate) unsafe fn write(self, at: usize, v: f32) {
        // SAFETY: guaranteed by the caller.
        unsafe { self.0.add(at).write(v) }
    }
}
// SAFETY: items write disjoint elements (the callers' contract).
unsafe impl Send for SharedOut {}
// SAFETY: as above.
unsafe impl Sync for SharedOut {}

fn take_items(s: &Shared, f: *const (dyn Fn(usize) + Sync), n: usize) {
    loop {
        let i = s.next.fetch_add(1, Ordering::Relaxed);
        if i >= n {
            return;
        }
        // SAFETY: the job's function outlives the job (see `Pool::for_each`).
        unsafe { (*f)(i) };
    }
}

fn epoch(s: &Shared) -> usize {
    s.state.load(Ordering::SeqCst) >> EPOCH_SHIFT
}

fn worker(s: &'static Shared) {
    let mut seen = epoch(s);
    loop {
        let mut spins = 0u32;
        while epoch(s) == seen && spins < SPIN {
            spins += 1;
            std::hint::spin_loop();
        }
        if epoch(s) == seen {
            let mut guard = s.lock.lock().unwrap_or_else(|p| p.into_inner());
            s.sleeping.fetch_add(1, Ordering::SeqCst);
            while epoch(s) == seen {
                guard = s.wake.wait(guard).unwrap_or_else(|p| p.into_inner());
            }
            s.sleeping.fetch_sub(1, Ordering::SeqCst);
        }
        // Check in, unless the job closed (or a newer one started) meanwhile.
        let mut cur = s.state.load(Ordering::SeqCst);
        seen = cur >> EPOCH_SHIFT;
        let joined = loop {
            if cur >> EPOCH_SHIFT != seen || cur & CLOSED != 0 {
                break false;
            }
            match s
                .state
                .compare_exchange_weak(cur, cur + 1, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => break true,
                Err(now) => cur = now,
            }
        };
        if !joined {
            continue;
        }
        // SAFETY: checked in to an open job: `job` holds it until this worker checks out.
        if let Some(Job { f, n }) = unsafe { *s.job.get() }
            && let Err(p) = catch_unwind(AssertUnwindSafe(|| take_items(s, f, n)))
        {
            let mut slot = s.panic.lock().unwrap_or_else(|p| p.into_inner());
            slot.get_or_insert(p);
        }
        s.state.fetch_sub(1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_item_runs_exactly_once() {
        let pool = Pool::new(3);
        for n in [0, 1, 2, 7, 1000] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.for_each(n, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "n = {n}"
            );
        }
    }

    #[test]
    fn a_panic_in_an_item_reaches_the_caller_and_the_pool_still_works() {
        let pool = Pool::new(2);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.for_each(64, &|i| assert!(i != 40, "item 40"));
        }));
        assert!(r.is_err());
        let count = AtomicUsize::new(0);
        pool.for_each(64, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 64);
    }

    /// When the caller's items and a worker's both panic, the next job, another caller's,
    /// runs clean: the worker's panic was left behind and raised in it.
    #[test]
    fn a_jobs_panics_do_not_reach_the_next_job() {
        let pool = Pool::new(2);
        for _ in 0..20 {
            let entered = AtomicUsize::new(0);
            let r = catch_unwind(AssertUnwindSafe(|| {
                pool.for_each(2, &|_| {
                    // Both threads in the job before either panics (bounded: a worker that
                    // never joins leaves the caller to panic alone).
                    entered.fetch_add(1, Ordering::SeqCst);
                    let since = std::time::Instant::now();
                    while entered.load(Ordering::SeqCst) < 2
                        && since.elapsed() < std::time::Duration::from_secs(1)
                    {
                        std::hint::spin_loop();
                    }
                    panic!("an item panics");
                });
            }));
            assert!(r.is_err());
            let count = AtomicUsize::new(0);
            pool.for_each(64, &|_| {
                count.fetch_add(1, Ordering::Relaxed);
            });
            assert_eq!(count.load(Ordering::Relaxed), 64);
        }
    }

    #[test]
    fn chunks_cover_the_output_once() {
        let pool = Pool::new(2);
        let mut out = vec![0.0f32; 103];
        pool.for_each_chunk_mut(&mut out, 10, &|i, c| {
            c.iter_mut().for_each(|v| *v += i as f32)
        });
        let want: Vec<f32> = (0..103).map(|j| (j / 10) as f32).collect();
        assert_eq!(out, want);
    }

    #[test]
    fn a_nested_loop_runs_inline() {
        let pool = Pool::new(2);
        let count = AtomicUsize::new(0);
        pool.for_each(4, &|_| {
            pool.for_each(4, &|_| {
                count.fetch_add(1, Ordering::Relaxed);
            })
        });
        assert_eq!(count.load(Ordering::Relaxed), 16);
    }
}
