//! The sandbox's instance slots, shared by every tenant. A free slot goes to whoever asks;
//! when none is free, each freed slot goes to the waiting tenant that holds the fewest (the
//! earliest of them on a tie), so a tenant flooding the gateway with requests whose plugins
//! run long cannot make another tenant's requests wait behind its queue: a tenant that holds
//! none gets the next slot freed. On its own, a tenant may take every slot.
//!
//! ```text
//!  held:    A A A A   (4 slots, A holds all; A has 6 more waiting, then B asks)
//!  waiting: A1 A2 A3 A4 A5 A6 B1
//!  freed ──▶ B1 (holds 0)   then A1, A2, … (first in first out among equals)
//! ```
//!
//! Among the waiters of holders that hold as many, the end of a request already served
//! ([`Turn::End`]: its `on-response-end`, where plugins account its usage) goes before any
//! call: a tenant's ends before its own calls, so that its flood starves its own requests
//! before their accounting. Ends do not go before the calls of a tenant that holds fewer: a
//! tenant's ends are not bounded by its concurrency limit (each is spawned once its request
//! let its place go), and, put ahead of every call, a flood of them took every freed slot
//! from the other tenants. The load of a policy set goes before everyone: a reload waits for
//! no tenant's flood.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::oneshot;

/// Who holds a slot: a tenant's call, or the load of a policy set.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) enum Holder {
    Tenant(Arc<str>),
    Load,
}

/// Where a waiter stands in the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Turn {
    /// The end of a request already served: ahead of the calls of holders holding as many.
    End,
    /// A call of a request being served, or a load.
    Call,
}

/// A cheap `Clone` handle on the slots.
#[derive(Debug, Clone)]
pub(super) struct Slots(Arc<Mutex<State>>);

#[derive(Debug)]
struct State {
    free: usize,
    /// Slots held now, by holder (holders holding none are not kept).
    held: HashMap<Holder, usize>,
    /// Waiters by holder (holders with none waiting are not kept): choosing the next one
    /// looks at each waiting holder once, however many of its requests' ends and calls wait.
    waiting: HashMap<Holder, Queued>,
    next_id: u64,
    /// Tests only: hand freed slots out first come, first served, whoever holds what (the
    /// plain semaphore this replaced), to show what the fair order prevents.
    #[cfg(test)]
    fifo: bool,
}

/// One holder's waiters, each queue in arrival order.
#[derive(Debug, Default)]
struct Queued {
    ends: VecDeque<Waiter>,
    calls: VecDeque<Waiter>,
}

impl Queued {
    fn queue(&mut self, turn: Turn) -> &mut VecDeque<Waiter> {
        match turn {
            Turn::End => &mut self.ends,
            Turn::Call => &mut self.calls,
        }
    }

    /// The turn whose waiter goes first (an end before a call), and when it came.
    fn first(&self) -> Option<(Turn, u64)> {
        match (self.ends.front(), self.calls.front()) {
            (Some(end), _) => Some((Turn::End, end.id)),
            (None, Some(call)) => Some((Turn::Call, call.id)),
            (None, None) => None,
        }
    }

    /// When its earliest waiter came, whatever its turn.
    #[cfg(test)]
    fn earliest(&self) -> Option<u64> {
        let ids = [self.ends.front(), self.calls.front()];
        ids.into_iter().flatten().map(|w| w.id).min()
    }

    fn len(&self) -> usize {
        self.ends.len() + self.calls.len()
    }
}

#[derive(Debug)]
struct Waiter {
    id: u64,
    granted: oneshot::Sender<()>,
}

impl State {
    fn take(&mut self, holder: &Holder) {
        *self.held.entry(holder.clone()).or_default() += 1;
    }

    fn holding(&self, holder: &Holder) -> usize {
        self.held.get(holder).copied().unwrap_or(0)
    }

    /// The holder and turn the next freed slot goes to: a load first; then of the holders
    /// that hold the fewest, an end before a call, and then the one that has waited longest.
    fn next(&self) -> Option<(Holder, Turn)> {
        #[cfg(test)]
        if self.fifo {
            let (holder, q) = self.waiting.iter().min_by_key(|(_, q)| q.earliest())?;
            let turn = if q.ends.front().map(|w| w.id) == q.earliest() {
                Turn::End
            } else {
                Turn::Call
            };
            return Some((holder.clone(), turn));
        }
        self.waiting
            .iter()
            .filter_map(|(holder, q)| {
                let (turn, since) = q.first()?;
                let key = (*holder != Holder::Load, self.holding(holder), turn, since);
                Some((key, holder))
            })
            .min_by_key(|(key, _)| *key)
            .map(|((_, _, turn, _), holder)| (holder.clone(), turn))
    }

    /// Takes the first waiter of `holder`'s in `turn` out of the queue.
    fn dequeue(&mut self, holder: &Holder, turn: Turn) -> Option<Waiter> {
        let q = self.waiting.get_mut(holder)?;
        let waiter = q.queue(turn).pop_front();
        if q.len() == 0 {
            self.waiting.remove(holder);
        }
        waiter
    }

    /// `holder` gives a slot back: it goes to the next waiter still waiting, or is free.
    fn release(&mut self, holder: &Holder) {
        if let Some(n) = self.held.get_mut(holder) {
            *n -= 1;
            if *n == 0 {
                self.held.remove(holder);
            }
        }
        while let Some((next, turn)) = self.next() {
            let Some(waiter) = self.dequeue(&next, turn) else {
                break;
            };
            // A waiter gone without taking its slot out of the queue cannot exist (its drop
            // does), but a send to one that is being dropped now fails: the next one gets it.
            if waiter.granted.send(()).is_ok() {
                self.take(&next);
                return;
            }
        }
        self.free += 1;
    }
}

fn lock(state: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    state.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One slot held; given back on drop.
#[derive(Debug)]
pub(super) struct Slot {
    slots: Slots,
    holder: Holder,
}

impl Drop for Slot {
    fn drop(&mut self) {
        lock(&self.slots.0).release(&self.holder);
    }
}

/// A place in the queue; leaving it (a timeout, a cancelled request) takes the place out, or
/// gives back the slot granted in the meantime.
struct Waiting {
    slots: Slots,
    id: u64,
    holder: Holder,
    turn: Turn,
    granted: Option<oneshot::Receiver<()>>,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        let Some(mut granted) = self.granted.take() else {
            return;
        };
        let mut state = lock(&self.slots.0);
        let waited = state.waiting.get_mut(&self.holder).and_then(|q| {
            let queue = q.queue(self.turn);
            let i = queue.iter().position(|w| w.id == self.id)?;
            queue.remove(i)?;
            Some(q.len())
        });
        match waited {
            Some(0) => {
                state.waiting.remove(&self.holder);
            }
            Some(_) => {}
            None => {
                if granted.try_recv().is_ok() {
                    state.release(&self.holder);
                }
            }
        }
    }
}

impl Slots {
    pub(super) fn new(slots: usize) -> Slots {
        Slots(Arc::new(Mutex::new(State {
            free: slots,
            held: HashMap::new(),
            waiting: HashMap::new(),
            next_id: 0,
            #[cfg(test)]
            fifo: false,
        })))
    }

    /// A slot for `holder`, in its `turn`, waiting at most `wait` (`None`: as long as it
    /// takes).
    pub(super) async fn acquire(
        &self,
        holder: Holder,
        turn: Turn,
        wait: Option<Duration>,
    ) -> Option<Slot> {
        let mut waiting = {
            let mut state = lock(&self.0);
            if state.free > 0 {
                state.free -= 1;
                state.take(&holder);
                return Some(Slot {
                    slots: self.clone(),
                    holder,
                });
            }
            let (tx, rx) = oneshot::channel();
            let id = state.next_id;
            state.next_id += 1;
            let queued = state.waiting.entry(holder.clone()).or_default();
            queued.queue(turn).push_back(Waiter { id, granted: tx });
            Waiting {
                slots: self.clone(),
                id,
                holder,
                turn,
                granted: Some(rx),
            }
        };
        let rx = waiting.granted.as_mut()?;
        let granted = match wait {
            Some(wait) => tokio::time::timeout(wait, rx).await.ok()?,
            None => rx.await,
        };
        granted.ok()?;
        waiting.granted = None;
        Some(Slot {
            slots: self.clone(),
            holder: waiting.holder.clone(),
        })
    }
}

#[cfg(test)]
impl Slots {
    /// The plain first-come, first-served queue.
    pub(super) fn fifo(slots: usize) -> Slots {
        let s = Slots::new(slots);
        lock(&s.0).fifo = true;
        s
    }

    /// (free slots, waiters, holders holding any).
    fn counts(&self) -> (usize, usize, usize) {
        let s = lock(&self.0);
        let waiting = s.waiting.values().map(Queued::len).sum();
        (s.free, waiting, s.held.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tenant(name: &str) -> Holder {
        Holder::Tenant(name.into())
    }

    const WAIT: Option<Duration> = Some(Duration::from_secs(5));

    /// Queues `n` waiters of `holder` on `slots`, each reporting its grant on `order`.
    fn queue(
        slots: &Slots,
        holder: &Holder,
        n: usize,
        order: &tokio::sync::mpsc::UnboundedSender<Holder>,
    ) -> Vec<tokio::task::JoinHandle<()>> {
        (0..n)
            .map(|_| {
                let (slots, holder, order) = (slots.clone(), holder.clone(), order.clone());
                tokio::spawn(async move {
                    let slot = slots
                        .acquire(holder.clone(), Turn::Call, WAIT)
                        .await
                        .expect("granted");
                    order.send(holder).expect("the test listens");
                    drop(slot);
                })
            })
            .collect()
    }

    /// Tenant A holds both slots and queues four more calls; then B asks. Fair: the first
    /// slot freed goes to B. First come, first served (the check off): B waits behind all of
    /// A's queue.
    async fn grant_order(slots: Slots) -> Vec<Holder> {
        let (a, b) = (tenant("a"), tenant("b"));
        let held = [
            slots
                .acquire(a.clone(), Turn::Call, WAIT)
                .await
                .expect("free"),
            slots
                .acquire(a.clone(), Turn::Call, WAIT)
                .await
                .expect("free"),
        ];
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut tasks = queue(&slots, &a, 4, &tx);
        tokio::task::yield_now().await;
        tasks.extend(queue(&slots, &b, 1, &tx));
        tokio::task::yield_now().await;
        assert_eq!(slots.counts(), (0, 5, 1), "A holds both, five wait");
        let mut order = Vec::new();
        // One slot freed at a time: each grant is decided before the next slot frees.
        let [first, second] = held;
        drop(first);
        order.push(rx.recv().await.expect("a grant"));
        drop(second);
        for task in tasks {
            task.await.expect("the waiter ran");
        }
        while let Ok(h) = rx.try_recv() {
            order.push(h);
        }
        assert_eq!(slots.counts(), (2, 0, 0), "every slot back, nobody waiting");
        order
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_freed_slot_goes_to_the_waiting_tenant_that_holds_the_fewest() {
        let fair = grant_order(Slots::new(2)).await;
        assert_eq!(fair[0], tenant("b"), "{fair:?}");
        let fifo = grant_order(Slots::fifo(2)).await;
        assert_eq!(fifo.last(), Some(&tenant("b")), "{fifo:?}");
    }

    /// Slots held by `holders` (one each); then `waiters` queue in order. Slot `free` of the
    /// held ones is given back, then the rest, one at a time: the order of the grants.
    async fn grants(
        holders: &[Holder],
        free: usize,
        waiters: &[(Holder, Turn)],
    ) -> Vec<(Holder, Turn)> {
        let slots = Slots::new(holders.len());
        let mut held = Vec::new();
        for h in holders {
            held.push(Some(
                slots
                    .acquire(h.clone(), Turn::Call, WAIT)
                    .await
                    .expect("free"),
            ));
        }
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut tasks = Vec::new();
        for (holder, turn) in waiters.iter().cloned() {
            let (slots, tx) = (slots.clone(), tx.clone());
            tasks.push(tokio::spawn(async move {
                let slot = slots
                    .acquire(holder.clone(), turn, WAIT)
                    .await
                    .expect("granted");
                tx.send((holder, turn)).expect("the test listens");
                // Held until the test has seen the grant: the next one is decided by the
                // same counts.
                tokio::task::yield_now().await;
                drop(slot);
            }));
            tokio::task::yield_now().await;
        }
        held[free] = None;
        let mut order = vec![rx.recv().await.expect("a grant")];
        drop(held);
        for task in tasks {
            task.await.expect("the waiter ran");
        }
        while let Ok(g) = rx.try_recv() {
            order.push(g);
        }
        order
    }

    /// A tenant's end goes before its own calls, and before the calls of a tenant that holds
    /// as many slots; not before those of a tenant that holds fewer: A's ends, unbounded by
    /// its concurrency limit, took every slot freed from B's requests when they went before
    /// every call.
    #[tokio::test(flavor = "current_thread")]
    async fn a_freed_slot_goes_to_an_end_before_the_calls_of_tenants_holding_as_many() {
        let (a, b, c) = (tenant("a"), tenant("b"), tenant("c"));
        let (call, end) = (Turn::Call, Turn::End);
        // A holds both slots; B's call waits, then A's end, then A's call; one of A's frees.
        let order = grants(
            &[a.clone(), a.clone()],
            0,
            &[(b.clone(), call), (a.clone(), end), (a.clone(), call)],
        )
        .await;
        assert_eq!(order[0], (b.clone(), call), "B holds none: {order:?}");
        // A and B hold one each, C's frees: B's call waited first, A's end goes first.
        let order = grants(
            &[a.clone(), b.clone(), c.clone()],
            2,
            &[(b.clone(), call), (a.clone(), call), (a.clone(), end)],
        )
        .await;
        assert_eq!(order[0], (a.clone(), end), "{order:?}");
        assert_eq!(order[1], (b.clone(), call), "{order:?}");
    }

    /// The load of a policy set goes before every tenant's waiters, ends too: a reload waits
    /// for no flood.
    #[tokio::test(flavor = "current_thread")]
    async fn a_freed_slot_goes_to_a_waiting_load_first() {
        let a = tenant("a");
        let order = grants(
            std::slice::from_ref(&a),
            0,
            &[(a.clone(), Turn::End), (Holder::Load, Turn::Call)],
        )
        .await;
        assert_eq!(order[0], (Holder::Load, Turn::Call), "{order:?}");
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_waiter_that_times_out_or_is_dropped_leaves_no_slot_behind() {
        let slots = Slots::new(1);
        let held = slots
            .acquire(tenant("a"), Turn::Call, WAIT)
            .await
            .expect("free");
        let timed_out = slots
            .acquire(tenant("b"), Turn::Call, Some(Duration::from_millis(10)))
            .await;
        assert!(timed_out.is_none());
        assert_eq!(slots.counts(), (0, 0, 1), "its place is gone");
        // A waiter cancelled while waiting (its request dropped).
        let cancelled = tokio::spawn({
            let slots = slots.clone();
            async move { slots.acquire(tenant("c"), Turn::Call, None).await }
        });
        tokio::task::yield_now().await;
        assert_eq!(slots.counts(), (0, 1, 1));
        cancelled.abort();
        let _ = cancelled.await;
        assert_eq!(slots.counts(), (0, 0, 1));
        drop(held);
        assert_eq!(slots.counts(), (1, 0, 0), "the slot is free again");
        let again = slots.acquire(tenant("b"), Turn::Call, WAIT).await;
        assert!(again.is_some());
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_slot_granted_to_a_waiter_that_leaves_before_taking_it_is_given_back() {
        let slots = Slots::new(1);
        let held = slots
            .acquire(tenant("a"), Turn::Call, WAIT)
            .await
            .expect("free");
        let mut waiting = Box::pin(slots.acquire(tenant("b"), Turn::Call, WAIT));
        // Polled once: queued.
        assert!(futures_util::poll!(waiting.as_mut()).is_pending());
        assert_eq!(slots.counts(), (0, 1, 1));
        // Granted (the slot is B's now), but B leaves before it looks.
        drop(held);
        assert_eq!(slots.counts(), (0, 0, 1), "granted to B");
        drop(waiting);
        assert_eq!(slots.counts(), (1, 0, 0), "given back");
    }
}
