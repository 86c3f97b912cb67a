//! Admission and configuration (invariants I1, I3, I7): what does not fit is refused before
//! any allocation, what fits waits its turn, and every page comes back.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use bulkhead_kvpool::{RequestId, Scope};
use bulkhead_worker::engine::{
    Engine, EngineConfig, Event, Failure, FinishReason, KvBudget, StartupError, SubmitError,
};
use bulkhead_worker::tiny_model::TinySpec;

use crate::common::{collect, engine, request, run_all, tiny_model};

/// A tiny model (context 256) over a pool of `tokens` tokens.
fn tiny_engine(tokens: u64, config: EngineConfig) -> Engine {
    engine(
        tiny_model(TinySpec::default()),
        EngineConfig {
            kv: KvBudget::Tokens(tokens),
            ..config
        },
    )
}

/// A pool of 64 tokens whose waiting requests are refused after `timeout`.
fn queue_timing_out(timeout: Duration) -> Engine {
    tiny_engine(
        64,
        EngineConfig {
            queue_timeout: timeout,
            ..EngineConfig::default()
        },
    )
}

fn assert_all_pages_back(e: &Engine) {
    let s = e.pool().stats();
    assert_eq!(s.free + s.pending_scrub, s.total, "pages not back: {s:?}");
    assert_eq!(s.quarantined, 0);
}

#[test]
fn served_context_is_the_smaller_of_model_and_pool() {
    assert_eq!(
        tiny_engine(64, EngineConfig::default())
            .capacity()
            .served_context,
        64
    );
    let big = tiny_engine(4096, EngineConfig::default()).capacity();
    assert_eq!(
        (big.served_context, big.pool_tokens, big.model_context),
        (256, 4096, 256)
    );
}

#[test]
fn a_context_longer_than_the_pool_refuses_to_start_and_says_how_to_fix_it() {
    let loaded = tiny_model(TinySpec::default());
    let config = EngineConfig {
        kv: KvBudget::Tokens(64),
        context_length: Some(200),
        ..EngineConfig::default()
    };
    let err = Engine::new(loaded.model, loaded.tokenizer, config).expect_err("must refuse");
    assert!(
        matches!(
            err,
            StartupError::ContextExceedsPool {
                requested: 200,
                pool_tokens: 64,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("--kv-memory"), "{err}");
}

/// A context of 0 serves nothing, and one longer than the model's was cut to it in silence:
/// both refuse to start; so does a pool larger than the host's memory, before it is zeroed
/// page by page until the out-of-memory killer ends the process.
#[test]
fn a_context_the_model_cannot_serve_or_a_pool_the_host_cannot_hold_refuses_to_start() {
    let refusal = |kv, context_length| {
        let loaded = tiny_model(TinySpec::default());
        let config = EngineConfig {
            kv,
            context_length,
            ..EngineConfig::default()
        };
        Engine::new(loaded.model, loaded.tokenizer, config).expect_err("must refuse")
    };
    let err = refusal(KvBudget::Tokens(1024), Some(0));
    assert!(matches!(err, StartupError::Zero { .. }), "{err:?}");
    let err = refusal(KvBudget::Tokens(1024), Some(257));
    assert!(
        matches!(
            err,
            StartupError::ContextExceedsModel {
                requested: 257,
                model_context: 256
            }
        ),
        "{err:?}"
    );
    // About 2^31 pages, terabytes: more than any machine this runs on has free.
    let err = refusal(KvBudget::Tokens(u64::from(u32::MAX) * 8), None);
    assert!(
        matches!(err, StartupError::PoolExceedsMemory { bytes, .. } if bytes > 1 << 42),
        "{err:?}"
    );
    assert!(err.to_string().contains("--kv-memory"), "{err}");
}

#[test]
fn a_prompt_over_the_pool_is_rejected_before_any_allocation() {
    let mut e = tiny_engine(64, EngineConfig::default());
    let (tx, _rx) = mpsc::channel();
    let before = e.pool().stats();
    let (err, _) = e
        .submit(request(1, &[5; 60], 10, tx))
        .expect_err("60 + 10 > 64");
    assert_eq!(
        err,
        SubmitError::ContextLengthExceeded {
            requested: 70,
            limit: 64,
            prompt: 60,
            max_new: 10
        }
    );
    assert_eq!(e.pool().stats(), before, "nothing was reserved");
    assert!(!e.has_work(), "nothing was queued");
    let (tx, _rx) = mpsc::channel();
    assert!(
        e.submit(request(2, &[5; 60], 4, tx)).is_ok(),
        "exactly the pool fits"
    );
}

/// What decode admission's served-context check stands in front of (test build only:
/// `--features check-switches`, scripts/test's switched pass): with it off, a request over the
/// pool is taken, and the pool's own bound is all that stops it — it is never reserved, and
/// ends refused for load at the queue's timeout, with every page free throughout. With the
/// check on, the test above sees it refused at once.
#[cfg(feature = "check-switches")]
#[test]
fn with_decode_admission_switched_off_a_request_over_the_pool_is_taken_but_never_reserved() {
    bulkhead_checks::turn_off(&[bulkhead_checks::Check::DecodeAdmission]);
    let timeout = Duration::from_millis(200);
    let mut e = queue_timing_out(timeout);
    let before = e.pool().stats();
    let (tx, rx) = mpsc::channel();
    e.submit(request(1, &[5; 60], 10, tx))
        .map_err(|(err, _)| err)
        .expect("the check is off: 60 + 10 over 64 is taken");
    let started = Instant::now();
    while e.has_work() {
        assert!(started.elapsed() < 10 * timeout, "never ended");
        assert_eq!(e.pool().stats(), before, "over the pool, yet reserved");
        std::thread::sleep(Duration::from_millis(20));
        e.step();
    }
    let refused = collect(rx);
    assert!(
        matches!(refused.finish, Some(Err(Failure::QueueTimedOut(t))) if t == timeout),
        "{refused:?}"
    );
    assert_all_pages_back(&e);
}

#[test]
fn bad_requests_are_refused_with_a_reason() {
    let mut e = tiny_engine(256, EngineConfig::default());
    let (tx, _rx) = mpsc::channel();
    let refuse = |e: &mut Engine, prompt: &[u32], max_new| {
        e.submit(request(1, prompt, max_new, tx.clone()))
            .map_err(|(err, _)| err)
    };
    assert_eq!(refuse(&mut e, &[], 4), Err(SubmitError::EmptyPrompt));
    assert_eq!(refuse(&mut e, &[5], 0), Err(SubmitError::NoNewTokens));
    assert_eq!(
        refuse(&mut e, &[5, 99_999], 4),
        Err(SubmitError::TokenOutOfRange {
            token: 99_999,
            vocab: 259
        })
    );
    assert!(refuse(&mut e, &[5], 4).is_ok());
    assert!(matches!(
        refuse(&mut e, &[5], 4),
        Err(SubmitError::DuplicateId(_))
    ));
}

#[test]
fn a_request_that_fits_but_not_now_waits_and_the_queue_is_bounded() {
    let mut e = tiny_engine(
        64,
        EngineConfig {
            queue_capacity: 2,
            ..EngineConfig::default()
        },
    );
    let mut rxs = Vec::new();
    for id in 0..2 {
        let (tx, rx) = mpsc::channel();
        e.submit(request(id, &[5; 40], 20, tx))
            .map_err(|(err, _)| err)
            .expect("fits the pool");
        rxs.push(rx);
    }
    e.step();
    assert_eq!(e.load(), (1, 1), "the second request waits for pages");
    let (tx, _rx) = mpsc::channel();
    e.submit(request(7, &[5; 4], 4, tx.clone()))
        .map_err(|(err, _)| err)
        .expect("queue has room");
    let (err, _) = e
        .submit(request(8, &[5; 4], 4, tx))
        .expect_err("queue full");
    assert_eq!(err, SubmitError::QueueFull { capacity: 2 });
    while e.has_work() {
        e.step();
    }
    for rx in rxs {
        let out = collect(rx);
        assert!(matches!(out.finish, Some(Ok(_))), "{out:?}");
        assert!(!out.tokens.is_empty());
    }
    assert_all_pages_back(&e);
}

#[test]
fn a_request_that_waits_for_pages_past_the_queue_timeout_is_refused_as_busy() {
    let timeout = Duration::from_millis(200);
    let mut e = queue_timing_out(timeout);
    let (tx, running) = mpsc::channel();
    let mut first = request(1, &[5; 40], 24, tx);
    first.ignore_eos = true;
    e.submit(first)
        .map_err(|(err, _)| err)
        .expect("fits the pool");
    e.step();
    let (tx, waiting) = mpsc::channel();
    e.submit(request(2, &[5; 40], 20, tx))
        .map_err(|(err, _)| err)
        .expect("fits the pool, not now");
    e.step();
    assert_eq!(e.load(), (1, 1), "the second request waits for pages");
    // The first holds its pages past the timeout (a step per 20 ms: 24 tokens take 480 ms).
    let started = Instant::now();
    while e.load().0 == 1 && started.elapsed() < 10 * timeout {
        std::thread::sleep(Duration::from_millis(20));
        e.step();
    }
    assert_eq!(
        e.load(),
        (0, 1),
        "the waiting request was refused, the running one runs on"
    );
    let refused = collect(waiting);
    assert!(
        matches!(refused.finish, Some(Err(Failure::QueueTimedOut(t))) if t == timeout),
        "{refused:?}"
    );
    assert!(refused.tokens.is_empty());
    while e.has_work() {
        e.step();
    }
    let served = collect(running);
    assert!(matches!(served.finish, Some(Ok(_))), "{served:?}");
    assert_all_pages_back(&e);
}

#[test]
fn a_zero_queue_timeout_refuses_to_start() {
    let loaded = tiny_model(TinySpec::default());
    let config = EngineConfig {
        queue_timeout: Duration::ZERO,
        ..EngineConfig::default()
    };
    let err = Engine::new(loaded.model, loaded.tokenizer, config).expect_err("must refuse");
    assert_eq!(
        err,
        StartupError::Zero {
            what: "--queue-timeout-ms"
        }
    );
}

#[test]
fn every_page_comes_back_after_requests_finish() {
    let mut e = tiny_engine(
        256,
        EngineConfig {
            max_batch_tokens: 7,
            ..EngineConfig::default()
        },
    );
    let outs = run_all(
        &mut e,
        vec![(vec![5; 30], 8), (vec![9; 3], 20), (vec![40; 50], 1)],
    );
    for out in &outs {
        assert!(
            matches!(
                out.finish,
                Some(Ok(FinishReason::Length | FinishReason::Stop))
            ),
            "{out:?}"
        );
    }
    assert_eq!(outs[2].tokens.len(), 1);
    assert_all_pages_back(&e);
}

#[test]
fn a_dropped_listener_cancels_the_request_and_frees_its_pages() {
    let mut e = tiny_engine(256, EngineConfig::default());
    let (tx, rx) = mpsc::channel();
    e.submit(request(1, &[5; 10], 200, tx))
        .map_err(|(err, _)| err)
        .expect("admitted");
    e.step();
    assert!(e.pool().stats().owned > 0);
    drop(rx);
    e.step();
    assert!(!e.has_work(), "cancelled");
    assert_all_pages_back(&e);
}

#[test]
fn at_most_max_running_requests_hold_pages_at_once_and_cancel_finds_each_once() {
    let mut e = tiny_engine(
        256,
        EngineConfig {
            max_running: 1,
            ..EngineConfig::default()
        },
    );
    let mut rxs = Vec::new();
    for id in [1, 2, 3] {
        let (tx, rx) = mpsc::channel();
        let mut r = request(id, &[5; 4], 50, tx);
        r.ignore_eos = true; // runs until cancelled or 50 tokens
        e.submit(r).map_err(|(err, _)| err).expect("fits the pool");
        rxs.push(rx);
    }
    e.step();
    assert_eq!(e.load(), (2, 1), "one runs, two wait");
    assert!(!e.cancel(RequestId::new(9)), "no such request");
    assert!(e.cancel(RequestId::new(3)), "a waiting request");
    assert!(!e.cancel(RequestId::new(3)), "already cancelled");
    assert!(e.cancel(RequestId::new(1)), "the running request");
    assert_eq!(e.load(), (1, 0));
    while e.has_work() {
        e.step();
    }
    let outs: Vec<_> = rxs.into_iter().map(collect).collect();
    assert!(matches!(outs[1].finish, Some(Ok(_))), "{:?}", outs[1]);
    assert_all_pages_back(&e);
}

#[test]
fn prompts_are_computed_first_come_first_served() {
    // Sixteen prompt tokens a step: one 40-token prompt at a time, each waiting for the ones
    // that came before it.
    let mut e = tiny_engine(
        1024,
        EngineConfig {
            max_batch_tokens: 16,
            ..EngineConfig::default()
        },
    );
    let prompt: Vec<u32> = (3..43).collect();
    let events: Vec<_> = (1..=4)
        .map(|id| {
            let (tx, rx) = mpsc::channel();
            e.submit(request(id, &prompt, 1, tx))
                .map_err(|(e, _)| e)
                .expect("admitted");
            rx
        })
        .collect();
    // The step at which each first heard of its answer.
    let mut heard = [None; 4];
    let mut step = 0;
    while e.has_work() {
        e.step();
        step += 1;
        for (at, rx) in heard.iter_mut().zip(&events) {
            let answered = rx.try_iter().any(|event| !matches!(event, Event::Started));
            if answered && at.is_none() {
                *at = Some(step);
            }
        }
    }
    // 160 prompt tokens at 16 a step, in arrival order: the first prompt's 40 end in step 3
    // (16 + 16 + 8), the second's in step 5 (8 + 16 + 16), the third's in 8, the last's in 10.
    // Shared in turn, they would end in steps 9, 10, 11 and 12.
    let heard: Vec<u32> = heard
        .iter()
        .map(|s| s.expect("every one answered"))
        .collect();
    assert_eq!(heard, [3, 5, 8, 10]);
}

/// One tenant's long prompt does not hold another tenant's short one for its whole length:
/// each tenant with a prompt to compute gets an equal share of a step's prompt tokens. With
/// first come, first served alone, the short prompt's first token came after the long one's.
#[test]
fn a_tenants_long_prompt_does_not_hold_another_tenants_short_one() {
    let mut e = tiny_engine(
        1024,
        EngineConfig {
            max_batch_tokens: 16,
            ..EngineConfig::default()
        },
    );
    let long: Vec<u32> = (3..203).collect();
    let short: Vec<u32> = (3..11).collect();
    let mut first_token_at = Vec::new();
    let events: Vec<_> = [("tenant-a", long), ("tenant-b", short)]
        .into_iter()
        .enumerate()
        .map(|(i, (tenant, prompt))| {
            let (tx, rx) = mpsc::channel();
            let mut r = request(i as u64 + 1, &prompt, 1, tx);
            r.tenant = Scope::new(tenant);
            e.submit(r).map_err(|(e, _)| e).expect("admitted");
            rx
        })
        .collect();
    let mut step = 0;
    while e.has_work() {
        e.step();
        step += 1;
        for (name, rx) in ["tenant-a", "tenant-b"].iter().zip(&events) {
            if rx
                .try_iter()
                .any(|ev| matches!(ev, Event::Token { .. } | Event::Done { .. }))
                && !first_token_at.iter().any(|(n, _)| n == name)
            {
                first_token_at.push((*name, step));
            }
        }
    }
    // b's 8 tokens fit its half of the first step's 16; a's 200 take about 13 steps.
    assert_eq!(
        first_token_at.first(),
        Some(&("tenant-b", 1)),
        "{first_token_at:?}"
    );
    assert_eq!(first_token_at.len(), 2, "{first_token_at:?}");
    assert_all_pages_back(&e);
}
