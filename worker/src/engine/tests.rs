//! The engine where a test needs its insides: a frame its KV memory cannot take, a model whose
//! logits are not numbers.

use std::sync::mpsc;

use bulkhead_handoff::Message;
use bulkhead_kvpool::{RequestId, Scope};

use super::*;
use bulkhead_kernels::DType;

use crate::gguf::GgufWriter;
use crate::loader::LoadedModel;
use crate::sampling::SamplingParams;
use crate::tiny_model::TinySpec;

fn tiny_engine() -> Engine {
    tiny_engine_with(EngineConfig {
        kv: KvBudget::Tokens(256),
        ..EngineConfig::default()
    })
    .expect("engine starts")
}

/// An engine of the tiny model with `config`, or why it cannot start.
fn tiny_engine_with(config: EngineConfig) -> Result<Engine, StartupError> {
    engine_of(&TinySpec::default().to_gguf(), config)
}

/// An engine of the model `w` writes, with `config`.
fn engine_of(w: &GgufWriter, config: EngineConfig) -> Result<Engine, StartupError> {
    let path = std::env::temp_dir().join(format!(
        "bulkhead-engine-test-{}-{}.gguf",
        std::process::id(),
        rand::random::<u64>()
    ));
    w.write(&path).expect("writes the model");
    let loaded = LoadedModel::open(&path).expect("loads it");
    let _ = std::fs::remove_file(&path);
    Engine::new(loaded.model, loaded.tokenizer, config)
}

/// A setting of 0 that cannot work is refused by the flag an operator sets it with.
#[test]
fn a_zero_setting_is_refused_by_its_flag() {
    let base = EngineConfig {
        kv: KvBudget::Tokens(256),
        ..EngineConfig::default()
    };
    let zeros = [
        (
            EngineConfig {
                max_batch_tokens: 0,
                ..base.clone()
            },
            "--max-batch-tokens",
        ),
        (
            EngineConfig {
                queue_timeout: std::time::Duration::ZERO,
                ..base.clone()
            },
            "--queue-timeout-ms",
        ),
        (
            EngineConfig {
                context_length: Some(0),
                ..base.clone()
            },
            "--context-length",
        ),
        (
            EngineConfig {
                kv: KvBudget::Bytes(0),
                ..base.clone()
            },
            "--kv-memory",
        ),
    ];
    for (config, flag) in zeros {
        let Err(err) = tiny_engine_with(config) else {
            panic!("{flag} 0 was taken");
        };
        let err = err.to_string();
        assert!(err.contains(flag), "{flag}: {err}");
    }
}

fn request(prompt: &[TokenId], tx: mpsc::Sender<Event>) -> Request {
    Request {
        id: RequestId::new(1),
        tenant: Scope::new("test"),
        prompt: prompt.to_vec(),
        max_new_tokens: 4,
        sampling: SamplingParams::GREEDY,
        stop: Vec::new(),
        ignore_eos: false,
        sink: Box::new(tx),
    }
}

/// What prefill engine `p` sends for `prompt` into `target`.
fn prefilled(
    p: &mut Engine,
    prompt: &[TokenId],
    target: bulkhead_handoff::Reservation,
) -> Outbound {
    let (tx, rx) = mpsc::channel();
    p.submit_prefill(request(prompt, tx), target)
        .map_err(|(e, _)| e)
        .expect("prefill admits");
    while p.has_work() {
        p.step();
    }
    let Ok(Event::Prefilled(out)) = rx.try_recv() else {
        panic!("not prefilled");
    };
    out
}

#[test]
fn a_frame_admitted_but_not_written_fails_the_transfer_instead_of_committing_it() {
    let (mut d, mut p) = (tiny_engine(), tiny_engine());
    let prompt: Vec<TokenId> = (3..40).collect();
    let (tx, rx) = mpsc::channel();
    d.submit_decode(request(&prompt, tx))
        .map_err(|(e, _)| e)
        .expect("admits");
    d.step();
    let Ok(Event::Reserved(target)) = rx.try_recv() else {
        panic!("no reservation");
    };
    let out = prefilled(&mut p, &prompt, target);
    // Memory that has none of the pool's pages: every write fails (a device fault does so).
    d.kv = KvMemory::new(*d.kv.layout(), 0);
    for frame in &out.frames {
        d.deliver(Message::Frame(frame.clone()));
    }
    d.deliver(Message::Manifest(out.manifest.clone()));
    out.close();
    while d.has_work() {
        d.step();
    }
    let events: Vec<Event> = rx.try_iter().collect();
    assert!(
        matches!(
            events.as_slice(),
            [Event::Failed(Failure::Transfer(
                IntegrityFailure::PageNotWritten { .. }
            ))]
        ),
        "failed, never decoded from unwritten pages: {events:?}"
    );
    assert_eq!(d.transfer_stats().integrity_failures, 1);
    let s = d.pool().stats();
    assert_eq!(s.quarantined, 3, "held until its peer is gone: {s:?}");
    assert_eq!(d.transfer_stats().frames_written, 0);
}

/// A request whose logits are not numbers (weights a file got wrong: here an output norm of
/// infinities) fails with that reason instead of sampling garbage, and its pages go back to the
/// pool: nothing says their contents are another's (before, every failed request's pages were
/// quarantined, out of service until a restart).
#[test]
fn logits_that_are_not_numbers_fail_the_request_and_its_pages_come_back() {
    let mut w = TinySpec::default().to_gguf();
    let inf: Vec<u8> = (0..64).flat_map(|_| f32::INFINITY.to_le_bytes()).collect();
    w.tensor("output_norm.weight", &[64], DType::F32, inf);
    let mut e = engine_of(
        &w,
        EngineConfig {
            kv: KvBudget::Tokens(256),
            ..EngineConfig::default()
        },
    )
    .expect("engine starts");
    let free = e.pool().stats().free;
    let (tx, rx) = mpsc::channel();
    e.submit(request(&(3..40).collect::<Vec<_>>(), tx))
        .map_err(|(e, _)| e)
        .expect("admits");
    while e.has_work() {
        e.step();
    }
    let events: Vec<Event> = rx.try_iter().collect();
    assert!(
        matches!(events.as_slice(), [Event::Started, Event::Failed(f)] if f.to_string().contains("not all finite")),
        "{events:?}"
    );
    e.scrub();
    let s = e.pool().stats();
    assert_eq!((s.quarantined, s.free), (0, free), "{s:?}");
}

/// A request of `tenant`, numbered `id`, for exactly `new` tokens after `prompt`.
fn request_of(
    id: u64,
    tenant: &str,
    prompt: &[TokenId],
    new: usize,
    tx: mpsc::Sender<Event>,
) -> Request {
    Request {
        id: RequestId::new(id),
        tenant: Scope::new(tenant),
        max_new_tokens: new,
        ignore_eos: true,
        ..request(prompt, tx)
    }
}

/// The pages of a request that failed its own integrity check (here, a canary read: a page
/// its attention reads that was never written) are quarantined, and come back once the reclaim
/// delay has passed: they stayed out of service until a restart, and a worker whose pool is
/// its served context was never ready again.
#[test]
fn the_pages_of_a_request_that_failed_its_integrity_check_come_back() {
    let mut e = tiny_engine_with(EngineConfig {
        kv: KvBudget::Tokens(64),
        scrub: Scrub::Canary,
        reclaim_after: std::time::Duration::from_millis(50),
        ..EngineConfig::default()
    })
    .expect("engine starts");
    let total = e.pool().stats().total;
    let (tx, rx) = mpsc::channel();
    e.submit(request_of(1, "test", &(3..23).collect::<Vec<_>>(), 4, tx))
        .map_err(|(e, _)| e)
        .expect("admits");
    for _ in 0..10 {
        if e.running.first().is_some_and(|r| !r.in_prefill()) {
            break;
        }
        e.step();
    }
    let page = e.running[0].table[0].page;
    e.kv.scrub(page, Scrub::Canary).expect("a page of the pool");
    e.step();
    let events: Vec<Event> = rx.try_iter().collect();
    assert!(
        matches!(
            events.last(),
            Some(Event::Failed(Failure::Forward(
                crate::model::SeqFailure::Integrity(_)
            )))
        ),
        "{events:?}"
    );
    assert_eq!(e.pool().stats().quarantined, 2, "out of service for now");
    assert!(
        e.next_deadline().is_some(),
        "the engine wakes to reclaim them"
    );
    std::thread::sleep(std::time::Duration::from_millis(60));
    e.step();
    let s = e.pool().stats();
    assert_eq!((s.quarantined, s.free), (0, total), "{s:?}");
}

/// A request the prefix cache cannot make room for (the other pages are held by a running
/// request) evicts none of it: it emptied another tenant's cache at every step it waited, and
/// still waited.
#[test]
fn a_request_eviction_cannot_make_room_for_evicts_nothing() {
    let mut e = tiny_engine_with(EngineConfig {
        kv: KvBudget::Tokens(128),
        prefix_cache: true,
        ..EngineConfig::default()
    })
    .expect("engine starts");
    let (tx, _rx) = mpsc::channel();
    // Tenant b's 65-token prompt leaves four whole pages cached.
    let b: Vec<TokenId> = (3..68).collect();
    e.submit(request_of(1, "b", &b, 2, tx.clone()))
        .map_err(|(e, _)| e)
        .expect("admits");
    while e.has_work() {
        e.step();
    }
    e.step();
    assert_eq!(e.pool().stats().cached, 4);
    // Tenant c's request holds the other four pages while it runs.
    e.submit(request_of(
        2,
        "c",
        &(70..120).collect::<Vec<_>>(),
        14,
        tx.clone(),
    ))
    .map_err(|(e, _)| e)
    .expect("admits");
    e.step();
    assert_eq!(e.running.len(), 1);
    // Tenant a's needs all eight: four more than the cache can give.
    e.submit(request_of(3, "a", &(130..230).collect::<Vec<_>>(), 28, tx))
        .map_err(|(e, _)| e)
        .expect("admits: it fits the pool");
    e.step();
    assert_eq!(e.waiting.len(), 1, "a waits");
    assert_eq!(e.pool().stats().cached, 4, "b's cache is kept");
}

/// A request that fails the KV check on a cached page of its prefix distrusts that page (and
/// those after it): the next request of the tenant with the same prompt computes it again and
/// succeeds. Kept in the cache, the page failed every such request, for as long as they kept
/// it recently used.
#[test]
fn a_cached_page_a_request_failed_on_is_not_read_again() {
    let mut e = tiny_engine_with(EngineConfig {
        kv: KvBudget::Tokens(128),
        prefix_cache: true,
        scrub: Scrub::Canary,
        ..EngineConfig::default()
    })
    .expect("engine starts");
    let prompt: Vec<TokenId> = (3..43).collect();
    let run = |e: &mut Engine, id: u64| {
        let (tx, rx) = mpsc::channel();
        e.submit(request_of(id, "t", &prompt, 2, tx))
            .map_err(|(e, _)| e)
            .expect("admits");
        while e.has_work() {
            e.step();
        }
        rx.try_iter().last()
    };
    assert!(matches!(run(&mut e, 1), Some(Event::Done { .. })));
    assert_eq!(e.pool().stats().cached, 2, "two whole prompt pages kept");
    let cached = e.pool().cached_prefix(&Scope::new("t"), &prompt, 2);
    e.kv.scrub(cached.pages()[0].page, Scrub::Canary)
        .expect("a page of the pool");
    drop(cached);

    let failed = run(&mut e, 2);
    assert!(
        matches!(
            failed,
            Some(Event::Failed(Failure::Forward(
                crate::model::SeqFailure::Integrity(_)
            )))
        ),
        "{failed:?}"
    );
    let left = e.pool().stats().cached;
    let again = run(&mut e, 3);
    assert!(matches!(again, Some(Event::Done { .. })), "{again:?}");
    assert_eq!(left, 0, "both pages left the cache");
    assert_eq!(
        e.prefix_stats().distrusted_pages,
        2,
        "the page and the next"
    );
    assert_eq!(e.pool().stats().cached, 2, "computed and kept again");
}

/// Decode's data plane reads frames only of sessions the engine still receives: a reservation
/// named to prefill is one, also while it drains after its request left; a committed transfer
/// is not, nor a session never reserved.
#[test]
fn a_session_is_received_from_its_reservation_until_it_commits_or_drains() {
    let (mut d, mut p) = (tiny_engine(), tiny_engine());
    let live = d.live_sessions();
    let prompt: Vec<TokenId> = (3..40).collect();
    let reserve = |d: &mut Engine, id: u64| {
        let (tx, rx) = mpsc::channel();
        d.submit_decode(Request {
            id: RequestId::new(id),
            ..request(&prompt, tx)
        })
        .map_err(|(e, _)| e)
        .expect("admits");
        d.step();
        let Ok(Event::Reserved(target)) = rx.try_recv() else {
            panic!("no reservation");
        };
        (target, rx)
    };
    assert!(!live.contains(bulkhead_handoff::SessionNonce([9; 16])));

    let (target, rx) = reserve(&mut d, 1);
    let nonce = target.nonce;
    assert!(live.contains(nonce), "reserved");
    let out = prefilled(&mut p, &prompt, target);
    for frame in &out.frames {
        d.deliver(Message::Frame(frame.clone()));
    }
    assert!(live.contains(nonce), "frames still coming");
    d.deliver(Message::Manifest(out.manifest.clone()));
    assert!(
        !live.contains(nonce),
        "committed: no frame of it is read again"
    );
    drop((out, rx));

    let (target, _rx) = reserve(&mut d, 2);
    assert!(d.cancel(RequestId::new(2)));
    assert!(
        live.contains(target.nonce),
        "draining: its frames may still come"
    );
    d.deliver(Message::Closed {
        nonce: target.nonce,
        reason: CloseReason::Aborted,
    });
    assert!(!live.contains(target.nonce), "drained");
}

/// Submits `request` to `e`, which must admit it.
fn admitted(e: &mut Engine, request: Request) {
    e.submit(request).map_err(|(e, _)| e).expect("admits");
}

/// An engine of 256 tokens' pages with `config` besides, where tenant a's request 1 holds
/// half the pool and its request 2, for the whole pool, was just admitted behind it; with the
/// requests' events.
fn a_request_for_the_whole_pool_behind_another(
    config: EngineConfig,
) -> (Engine, mpsc::Sender<Event>, mpsc::Receiver<Event>) {
    let mut e = tiny_engine_with(EngineConfig {
        kv: KvBudget::Tokens(256),
        ..config
    })
    .expect("engine starts");
    let (tx, rx) = mpsc::channel();
    let half: Vec<TokenId> = (3..103).collect();
    admitted(&mut e, request_of(1, "a", &half, 28, tx.clone()));
    e.step();
    let whole: Vec<TokenId> = (3..203).collect();
    admitted(&mut e, request_of(2, "a", &whole, 56, tx.clone()));
    (e, tx, rx)
}

/// The ids of the requests waiting, in order.
fn waiting_ids(e: &Engine) -> Vec<u64> {
    e.waiting.iter().map(|w| w.request.id.get()).collect()
}

/// A tenant's request for the whole pool, waiting for pages another of its requests holds,
/// does not hold back another tenant's small request that the free pages fit: it waited behind
/// it, pages free, until its queue timeout. The tenant's own later requests still wait behind
/// it, in order.
#[test]
fn a_request_waiting_for_pages_holds_back_its_own_tenant_only() {
    let (mut e, tx, _rx) = a_request_for_the_whole_pool_behind_another(EngineConfig::default());
    admitted(&mut e, request_of(3, "a", &[3, 4, 5, 6], 4, tx.clone()));
    admitted(&mut e, request_of(4, "b", &[3, 4, 5, 6], 4, tx));
    e.step();
    assert_eq!(e.load(), (2, 2), "b's started beside a's first");
    assert_eq!(waiting_ids(&e), [2, 3], "a's wait in order");
}

/// A request that has waited a quarter of the queue timeout for pages holds back every request
/// after it, whatever their tenant: the pages given back go to it, and other tenants' small
/// requests cannot keep it waiting until its timeout.
#[test]
fn a_request_waiting_past_its_patience_holds_back_every_later_one() {
    let (mut e, tx, _rx) = a_request_for_the_whole_pool_behind_another(EngineConfig {
        queue_timeout: std::time::Duration::from_secs(4),
        ..EngineConfig::default()
    });
    e.step();
    std::thread::sleep(std::time::Duration::from_millis(1_100));
    admitted(&mut e, request_of(3, "b", &[3, 4, 5, 6], 4, tx));
    e.step();
    assert_eq!(
        waiting_ids(&e),
        [2, 3],
        "b's waits behind a's request for the pool"
    );
    while e.running.iter().any(|r| r.request.id.get() == 1) {
        e.step();
    }
    e.step();
    assert_eq!(waiting_ids(&e), [3], "the pages went to a's request");
}

/// With as many requests decoding as a step has tokens, a prompt still moves: it got none of
/// the budget, and waited, holding its pages and place, until enough answers ended.
#[test]
fn a_prompt_moves_while_decoding_requests_take_the_whole_budget() {
    let mut e = tiny_engine_with(EngineConfig {
        kv: KvBudget::Tokens(256),
        max_batch_tokens: 2,
        max_running: 8,
        ..EngineConfig::default()
    })
    .expect("engine starts");
    let (tx, rx) = mpsc::channel();
    admitted(&mut e, request_of(1, "a", &[3, 4], 50, tx.clone()));
    admitted(&mut e, request_of(2, "a", &[5, 6], 50, tx.clone()));
    for _ in 0..3 {
        e.step();
    }
    assert!(e.running.iter().all(|r| !r.in_prefill()), "both decode");
    admitted(&mut e, request_of(3, "b", &[7, 8], 1, tx));
    for _ in 0..5 {
        e.step();
    }
    let done = rx
        .try_iter()
        .any(|event| matches!(event, Event::Done { .. }));
    assert!(done, "b's one-token answer is done within five steps");
}
