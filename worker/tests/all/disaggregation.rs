//! Disaggregated prefill/decode inside one process: two engines, the KV handoff's messages
//! through the real wire codec, and faults injected between them. Invariants I1–I4: only a
//! complete, verified transfer is ever attended over, and every page comes back.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use bulkhead_handoff::codec::{decode, encode};
use bulkhead_handoff::{
    CloseReason, IntegrityFailure, Manifest, Message, Reservation, SessionNonce,
};
use bulkhead_kvpool::{RequestId, Scope};
use bulkhead_worker::engine::{
    Engine, EngineConfig, Event, Failure, KvBudget, Outbound, SubmitError,
};
use bulkhead_worker::sampling::SamplingParams;
use bulkhead_worker::tiny_model::TinySpec;

use crate::common::{Outcome, collect, engine, real_model_owned, request, run_all, tiny_model};

/// Sends `m` through the wire format, as the TCP data plane does.
fn wire(m: &Message) -> Message {
    let mut buf = Vec::new();
    encode(m, &mut buf);
    let (back, used) = decode(&buf, 64 << 20).expect("valid").expect("complete");
    assert_eq!(used, buf.len());
    back
}

/// Decode reserves; returns the reservation it names to prefill and the request's events.
fn reserve(
    decode_engine: &mut Engine,
    id: u64,
    prompt: &[u32],
    max_new: usize,
) -> (Reservation, mpsc::Receiver<Event>) {
    reserve_for(
        decode_engine,
        TENANT,
        id,
        prompt,
        max_new,
        SamplingParams::GREEDY,
    )
}

/// The test's tenant, unless a test names another.
const TENANT: &str = "test";

/// [`reserve`] for a request of `tenant`, sampled as `sampling` says.
fn reserve_for(
    decode_engine: &mut Engine,
    tenant: &str,
    id: u64,
    prompt: &[u32],
    max_new: usize,
    sampling: SamplingParams,
) -> (Reservation, mpsc::Receiver<Event>) {
    let (tx, rx) = mpsc::channel();
    let mut r = request(id, prompt, max_new, tx);
    r.tenant = Scope::new(tenant);
    r.sampling = sampling;
    decode_engine
        .submit_decode(r)
        .map_err(|(e, _)| e)
        .expect("decode admits");
    decode_engine.step();
    match rx.try_recv() {
        Ok(Event::Reserved(r)) => (r, rx),
        other => panic!("expected a reservation, got {other:?}"),
    }
}

/// Prefill computes the prompt for `target`; returns the outbound transfer.
fn prefill(
    prefill_engine: &mut Engine,
    id: u64,
    prompt: &[u32],
    target: Reservation,
) -> Result<Outbound, SubmitError> {
    prefill_sampled(prefill_engine, id, prompt, target, SamplingParams::GREEDY)
}

/// [`prefill`], its first token sampled as `sampling` says.
fn prefill_sampled(
    prefill_engine: &mut Engine,
    id: u64,
    prompt: &[u32],
    target: Reservation,
    sampling: SamplingParams,
) -> Result<Outbound, SubmitError> {
    let (tx, rx) = mpsc::channel();
    let mut r = request(id, prompt, 1, tx);
    r.sampling = sampling;
    prefill_engine
        .submit_prefill(r, target)
        .map_err(|(e, _)| e)?;
    while prefill_engine.has_work() {
        prefill_engine.step();
    }
    match rx.try_recv() {
        Ok(Event::Prefilled(out)) => Ok(out),
        other => panic!("expected the prefilled transfer, got {other:?}"),
    }
}

/// What prefill sends decode for a whole transfer: every frame, the manifest, `Closed`.
fn sent(out: &Outbound) -> Vec<Message> {
    let closed = Message::Closed {
        nonce: out.nonce(),
        reason: CloseReason::Complete,
    };
    out.frames
        .iter()
        .cloned()
        .map(Message::Frame)
        .chain([Message::Manifest(out.manifest.clone()), closed])
        .collect()
}

/// Decodes until idle and returns the outcome.
fn finish(decode_engine: &mut Engine, rx: mpsc::Receiver<Event>) -> Outcome {
    while decode_engine.has_work() {
        decode_engine.step();
    }
    collect(rx)
}

/// A whole disaggregated request; `fault` may rewrite or drop each message on the way.
fn disaggregated(
    d: &mut Engine,
    p: &mut Engine,
    prompt: &[u32],
    max_new: usize,
    fault: impl FnMut(Message) -> Option<Message>,
) -> Outcome {
    disaggregated_for(d, p, TENANT, prompt, max_new, SamplingParams::GREEDY, fault).0
}

/// [`disaggregated`] for a request of `tenant`, sampled as `sampling` says; also the
/// reservation decode named and how many frames prefill sent.
fn disaggregated_for(
    d: &mut Engine,
    p: &mut Engine,
    tenant: &str,
    prompt: &[u32],
    max_new: usize,
    sampling: SamplingParams,
    mut fault: impl FnMut(Message) -> Option<Message>,
) -> (Outcome, Reservation, usize) {
    let (target, rx) = reserve_for(d, tenant, 1, prompt, max_new, sampling);
    let out = prefill_sampled(p, 1, prompt, target.clone(), sampling).expect("prefill admits");
    let frames = out.frames.len();
    for m in sent(&out) {
        if let Some(m) = fault(wire(&m)) {
            d.deliver(m);
        }
    }
    out.close();
    (finish(d, rx), target, frames)
}

/// The tiny model over a pool of 256 tokens, otherwise configured as `config` says.
fn tiny_engine_with(config: EngineConfig) -> Engine {
    engine(
        tiny_model(TinySpec::default()),
        EngineConfig {
            kv: KvBudget::Tokens(256),
            ..config
        },
    )
}

fn tiny_engine(tokens: u64) -> Engine {
    engine(
        tiny_model(TinySpec::default()),
        EngineConfig {
            kv: KvBudget::Tokens(tokens),
            ..EngineConfig::default()
        },
    )
}

/// A decode worker holds at most --max-running requests, counting those whose KV is on its
/// way: the others wait for a slot. (Transfers were not counted: a burst that fitted the pool
/// reserved at once, and every one of them then decoded in a single batch.)
#[test]
fn a_decode_workers_transfers_count_against_max_running() {
    let mut d = tiny_engine_with(EngineConfig {
        max_running: 1,
        ..EngineConfig::default()
    });
    let mut p = tiny_engine(256);
    let (target, rx) = reserve(&mut d, 1, &[5; 4], 4);
    let mut waiting = Vec::new();
    for id in [2, 3] {
        let (tx, rx) = mpsc::channel();
        d.submit_decode(request(id, &[5; 4], 4, tx))
            .map_err(|(e, _)| e)
            .expect("decode admits");
        waiting.push(rx);
    }
    d.step();
    assert_eq!(d.load(), (2, 1), "one transfer, two waiting");
    assert!(
        !d.can_progress(),
        "nothing a step could do: the engine waits, not spinning"
    );
    assert!(
        waiting.iter().all(|rx| rx.try_recv().is_err()),
        "no reservation"
    );
    let out = prefill(&mut p, 1, &[5; 4], target).expect("prefill admits");
    for m in sent(&out) {
        d.deliver(wire(&m));
    }
    d.step();
    assert_eq!(d.load(), (2, 1), "the first decodes; the others still wait");
    // Once it is done, the next waiting request gets its slot and is reserved.
    for _ in 0..16 {
        d.step();
    }
    assert!(matches!(collect(rx).finish, Some(Ok(_))));
    assert!(matches!(waiting[0].try_recv(), Ok(Event::Reserved(_))));
    assert_eq!(d.load(), (1, 1));
}

fn assert_pages_back(e: &Engine, quarantined: u32) {
    let s = e.pool().stats();
    assert_eq!(s.free + s.pending_scrub + s.quarantined, s.total, "{s:?}");
    assert_eq!(s.quarantined, quarantined, "{s:?}");
}

#[test]
fn disaggregated_output_equals_colocated_output() {
    let prompts = [
        "The quick brown fox",
        "In 1969, the first people to walk on the Moon were",
    ];
    let mut colocated = engine(real_model_owned(), EngineConfig::default());
    let mut d = engine(real_model_owned(), EngineConfig::default());
    let mut p = engine(real_model_owned(), EngineConfig::default());
    for text in prompts {
        let prompt = colocated.tokenizer().encode(text, false).expect("encode");
        let alone = run_all(&mut colocated, vec![(prompt.clone(), 16)]).remove(0);
        let split = disaggregated(&mut d, &mut p, &prompt, 16, Some);
        assert_eq!(split, alone, "{text:?}");
        assert!(matches!(split.finish, Some(Ok(_))));
    }
    assert_pages_back(&d, 0);
    assert_pages_back(&p, 0);
    assert_eq!(d.transfer_stats().frames_dropped.total(), 0);
}

/// A seed gives the same tokens whether one worker samples them all or prefill samples the
/// first and decode the rest: decode's random stream goes on where prefill's left off (it
/// once started over, so the second token reused the first one's draw).
#[test]
fn a_seeded_sample_split_across_workers_equals_it_on_one() {
    let sampling = SamplingParams {
        temperature: 1.0,
        top_k: None,
        top_p: 1.0,
        seed: 7,
    };
    let mut colocated = engine(real_model_owned(), EngineConfig::default());
    let mut d = engine(real_model_owned(), EngineConfig::default());
    let mut p = engine(real_model_owned(), EngineConfig::default());
    let prompt = colocated
        .tokenizer()
        .encode("Once upon a time, there was a", false)
        .expect("encode");
    let (tx, rx) = mpsc::channel();
    let mut r = request(1, &prompt, 12, tx);
    r.sampling = sampling;
    colocated.submit(r).map_err(|(e, _)| e).expect("admitted");
    let alone = finish(&mut colocated, rx);
    let (split, _, _) = disaggregated_for(&mut d, &mut p, TENANT, &prompt, 12, sampling, Some);
    assert_eq!(split, alone);
    assert_eq!(split.tokens.len(), 12, "{split:?}");
}

/// A decode worker with the prefix cache keeps the pages of the prompts it received in their
/// tenant's cache: that tenant's next prompt starting with them is sent only the rest, and
/// generates exactly what it generates sent whole; another tenant's identical prompt, or a
/// decode worker without the cache, is sent all of it.
#[test]
fn a_decode_worker_is_sent_only_what_its_tenants_cache_lacks() {
    let with_cache = EngineConfig {
        prefix_cache: true,
        ..EngineConfig::default()
    };
    let mut d = engine(real_model_owned(), with_cache);
    let mut plain = engine(real_model_owned(), EngineConfig::default());
    let mut p = engine(real_model_owned(), EngineConfig::default());
    let mut colocated = engine(real_model_owned(), EngineConfig::default());
    let encode = |text| colocated.tokenizer().encode(text, false).expect("encode");
    let first = encode(
        "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the \
         one hundred and twelve steps, polishing the great lens, and writing in his logbook the \
         names of the ships that passed the rocks below the cliffs",
    );
    let pt = d.capacity().page_tokens as usize;
    assert!(first.len() > 2 * pt + 4, "{} tokens", first.len());
    let mut second = first[..2 * pt + 4].to_vec();
    second.extend(encode(" until one night a storm"));
    let alone = run_all(
        &mut colocated,
        vec![(first.clone(), 8), (second.clone(), 8)],
    );
    let mut send = |d: &mut Engine, tenant, prompt: &[u32]| {
        let (outcome, target, frames) =
            disaggregated_for(d, &mut p, tenant, prompt, 8, SamplingParams::GREEDY, Some);
        assert_eq!(frames, target.pages.len(), "one frame per named page");
        (outcome, target.cached_tokens as usize, frames)
    };
    let (out, cached, _) = send(&mut d, "a", &first);
    assert_eq!((out, cached), (alone[0].clone(), 0));
    // Two whole pages of the second prompt are in tenant a's cache on decode.
    let (out, cached, frames) = send(&mut d, "a", &second);
    assert_eq!(
        out, alone[1],
        "the second prompt, its first pages from decode's cache"
    );
    assert_eq!(cached, 2 * pt);
    assert_eq!(frames, (second.len() - 2 * pt).div_ceil(pt));
    for (engine, tenant) in [(&mut d, "b"), (&mut plain, "a")] {
        let (out, cached, frames) = send(engine, tenant, &second);
        assert_eq!((out, cached), (alone[1].clone(), 0), "tenant {tenant}");
        assert_eq!(frames, second.len().div_ceil(pt));
    }
    let s = d.pool().stats();
    assert!(s.cached > 0, "{s:?}");
    assert_eq!(s.free + s.pending_scrub + s.cached, s.total, "{s:?}");
    assert_eq!(d.transfer_stats().frames_dropped.total(), 0);
}

#[test]
fn a_prompt_over_the_prefill_pool_is_rejected_before_any_transfer() {
    // Decode's pool fits the prompt; prefill's does not (the incident's asymmetry).
    let mut d = tiny_engine(256);
    let mut p = tiny_engine(32);
    let prompt = vec![5u32; 40];
    let (target, rx) = reserve(&mut d, 1, &prompt, 8);
    let nonce = target.nonce;
    let before = p.pool().stats();
    let err = prefill(&mut p, 1, &prompt, target).expect_err("prefill must refuse");
    assert!(
        matches!(
            err,
            SubmitError::ContextLengthExceeded {
                requested: 40,
                limit: 32,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(p.pool().stats(), before, "prefill allocated nothing");
    // Decode learns of the rejection at once, fails the request with prefill's reason and
    // releases the reservation.
    d.prefill_rejected(nonce, err.clone());
    assert_eq!(collect(rx).finish, Some(Err(Failure::PrefillRejected(err))));
    d.step();
    assert_pages_back(&d, 0);
}

#[test]
fn a_corrupted_frame_fails_the_request_and_quarantines_its_pages() {
    let (mut d, mut p) = (tiny_engine(256), tiny_engine(256));
    let prompt: Vec<u32> = (3..40).collect();
    let mut n = 0;
    let out = disaggregated(&mut d, &mut p, &prompt, 8, |m| {
        n += 1;
        match m {
            Message::Frame(mut f) if n == 2 => {
                f.bytes[7] ^= 0x10;
                Some(Message::Frame(f))
            }
            other => Some(other),
        }
    });
    assert_eq!(
        out.finish,
        Some(Err(Failure::Transfer(IntegrityFailure::ChecksumMismatch {
            index: 1
        })))
    );
    assert!(
        out.tokens.is_empty(),
        "nothing was generated from unverified KV"
    );
    assert_pages_back(&d, 3); // the whole reservation: 37 + 8 tokens in pages of 16
    assert_pages_back(&p, 0);
}

/// A peer that closes a transfer as complete without its manifest (one page of three sent)
/// failed verification: `kv_integrity_error`, counted, its pages quarantined until the grace
/// period after its end. It was taken for prefill's own failure: a 503 that marked a healthy
/// decode worker down, its pages released, nothing counted.
#[test]
fn a_transfer_closed_as_complete_without_its_manifest_fails_verification() {
    for (grace, back) in [(Duration::ZERO, true), (Duration::from_secs(3600), false)] {
        let mut d = tiny_engine_with(EngineConfig {
            reclaim_after: grace,
            ..EngineConfig::default()
        });
        let mut p = tiny_engine(256);
        let prompt: Vec<u32> = (3..40).collect();
        let out = disaggregated(&mut d, &mut p, &prompt, 8, |m| match m {
            Message::Frame(f) if f.header.index > 0 => None,
            Message::Manifest(_) => None,
            other => Some(other),
        });
        assert_eq!(
            out.finish,
            Some(Err(Failure::Transfer(
                IntegrityFailure::CompleteWithoutManifest
            )))
        );
        assert!(out.tokens.is_empty());
        assert_eq!(d.transfer_stats().integrity_failures, 1);
        d.step();
        let (quarantined, reclaimed) = if back { (0, 3) } else { (3, 0) };
        assert_pages_back(&d, quarantined);
        assert_eq!(d.transfer_stats().reclaimed_pages, reclaimed, "{grace:?}");
    }
}

/// A first token changed on the way (a flipped bit, or a peer that rewrites it) fails the
/// transfer's digest: decode generated from a token prefill never sampled, and answered 200.
#[test]
fn a_manifest_whose_first_token_changed_on_the_way_fails_the_request_before_any_token() {
    let (mut d, mut p) = (tiny_engine(256), tiny_engine(256));
    let prompt: Vec<u32> = (3..40).collect();
    let out = disaggregated(&mut d, &mut p, &prompt, 8, |m| match m {
        Message::Manifest(mut manifest) => {
            manifest.first_token ^= 1;
            Some(Message::Manifest(manifest))
        }
        other => Some(other),
    });
    assert_eq!(
        out.finish,
        Some(Err(Failure::Transfer(IntegrityFailure::DigestMismatch)))
    );
    assert!(out.tokens.is_empty(), "no token reached the client");
    assert_pages_back(&d, 3);
}

#[test]
fn a_dropped_frame_fails_the_request() {
    let (mut d, mut p) = (tiny_engine(256), tiny_engine(256));
    let prompt: Vec<u32> = (3..40).collect();
    let out = disaggregated(&mut d, &mut p, &prompt, 8, |m| match m {
        Message::Frame(f) if f.header.index == 1 => None,
        other => Some(other),
    });
    assert_eq!(
        out.finish,
        Some(Err(Failure::Transfer(IntegrityFailure::PageMissing {
            index: 1
        })))
    );
}

/// A prefill worker that sampled a token outside the vocabulary (a bug, its manifest sealed
/// as it should be) fails the request before any token reaches the client.
#[test]
fn a_manifest_whose_first_token_is_outside_the_vocabulary_fails_the_request_before_any_token() {
    let (mut d, mut p) = (tiny_engine(256), tiny_engine(256));
    let vocab = d.tokenizer().vocab_size();
    let prompt: Vec<u32> = (3..40).collect();
    let mut checksums = Vec::new();
    let out = disaggregated(&mut d, &mut p, &prompt, 8, |m| match m {
        Message::Frame(f) => {
            checksums.push(f.header.checksum);
            Some(Message::Frame(f))
        }
        Message::Manifest(m) => Some(Message::Manifest(Manifest::new(
            m.nonce,
            m.tokens,
            vocab as u32,
            checksums.iter().copied(),
        ))),
        other => Some(other),
    });
    assert_eq!(
        out.finish,
        Some(Err(Failure::Transfer(
            IntegrityFailure::FirstTokenOutOfRange {
                token: vocab as u32,
                vocab
            }
        )))
    );
    assert!(
        out.tokens.is_empty(),
        "the bogus token never reached the client"
    );
    assert_pages_back(&d, 3);
    assert_pages_back(&p, 0);
}

#[test]
fn the_incident_a_one_page_placeholder_never_reaches_decode() {
    // Prefill "rejects" by computing a one-token placeholder and claiming success.
    let (mut d, mut p) = (tiny_engine(256), tiny_engine(256));
    let prompt: Vec<u32> = (3..60).collect();
    let (target, rx) = reserve(&mut d, 1, &prompt, 4);
    let mut placeholder_target = target.clone();
    placeholder_target.prompt_tokens = 1;
    placeholder_target.pages.truncate(1);
    let out = prefill(&mut p, 1, &prompt[..1], placeholder_target).expect("placeholder prefill");
    for f in &out.frames {
        d.deliver(wire(&Message::Frame(f.clone())));
    }
    d.deliver(wire(&Message::Manifest(out.manifest.clone())));
    out.close();
    let outcome = finish(&mut d, rx);
    assert!(
        matches!(outcome.finish, Some(Err(Failure::Transfer(_)))),
        "{outcome:?}"
    );
    assert!(outcome.tokens.is_empty());
}

#[test]
fn an_aborted_transfer_keeps_its_pages_until_the_drain_acknowledgement() {
    let (mut d, mut p) = (tiny_engine(256), tiny_engine(256));
    let prompt: Vec<u32> = (3..40).collect();
    let (target, _rx) = reserve(&mut d, 1, &prompt, 8);
    let out = prefill(&mut p, 1, &prompt, target).expect("prefill");
    d.deliver(wire(&Message::Frame(out.frames[0].clone())));
    assert!(d.cancel(RequestId::new(1)), "client went away mid-transfer");
    let held = d.pool().stats();
    assert!(held.releasing > 0, "pages wait for the drain: {held:?}");
    // A late frame of the aborted session is dropped, never written.
    let dropped = d.transfer_stats().frames_dropped.total();
    d.deliver(wire(&Message::Frame(out.frames[1].clone())));
    assert_eq!(d.transfer_stats().frames_dropped.total(), dropped + 1);
    d.step();
    assert_eq!(
        d.pool().stats(),
        held,
        "the drain deadline is release_timeout away"
    );
    d.deliver(Message::Closed {
        nonce: out.nonce(),
        reason: CloseReason::Aborted,
    });
    out.close();
    d.step();
    assert_pages_back(&d, 0);
    assert_pages_back(&p, 0);
}

/// A transfer reserved after a cached prefix that ends any way but a commit lets the prefix's
/// pages go: they stay cached, and can be evicted again once nothing reads them.
#[test]
fn an_abandoned_transfer_after_a_cached_prefix_lets_the_prefix_go() {
    let cached = EngineConfig {
        prefix_cache: true,
        ..EngineConfig::default()
    };
    let (mut d, mut p) = (tiny_engine_with(cached), tiny_engine(256));
    let prompt: Vec<u32> = (3..40).collect();
    disaggregated_for(
        &mut d,
        &mut p,
        TENANT,
        &prompt,
        4,
        SamplingParams::GREEDY,
        Some,
    );
    let after_first = d.pool().stats();
    assert_eq!(
        after_first.cached, 2,
        "two whole pages of 16: {after_first:?}"
    );
    for end in ["cancelled", "rejected by prefill"] {
        let (target, _rx) = reserve(&mut d, 2, &prompt, 4);
        assert_eq!(target.cached_tokens, 32, "{end}");
        match end {
            "cancelled" => {
                assert!(d.cancel(RequestId::new(2)));
                d.deliver(Message::Closed {
                    nonce: target.nonce,
                    reason: CloseReason::Aborted,
                });
            }
            _ => d.prefill_rejected(target.nonce, SubmitError::EmptyPrompt),
        }
        d.step();
        let s = d.pool().stats();
        assert_eq!(s.free + s.pending_scrub + s.cached, s.total, "{end}: {s:?}");
        assert_eq!(s.cached, 2, "{end}: {s:?}");
    }
    // Nothing pins them: both can be evicted.
    assert_eq!(d.pool().evict(u32::MAX), 2);
}

/// No drain acknowledgement in time: the pages are quarantined. If a frame of the session
/// arrived, a data connection carries it, and they stay until its end says the peer is gone;
/// if none did (prefill stopped or died while computing, the client left before the
/// reservation was named), no connection will ever say so, and they come back after the grace
/// period (decode writes every frame itself, only while the session is in transfer).
#[test]
fn without_a_drain_acknowledgement_pages_are_quarantined_until_no_frame_can_land() {
    for heard in [true, false] {
        let mut d = tiny_engine_with(EngineConfig {
            release_timeout: Duration::ZERO,
            reclaim_after: Duration::ZERO,
            ..EngineConfig::default()
        });
        let mut p = tiny_engine(256);
        let prompt: Vec<u32> = (3..40).collect();
        let (target, _rx) = reserve(&mut d, 1, &prompt, 8);
        let out = prefill(&mut p, 1, &prompt, target).expect("prefill");
        if heard {
            d.deliver(wire(&Message::Frame(out.frames[0].clone())));
        }
        d.cancel(RequestId::new(1));
        d.step();
        d.step();
        let quarantined = if heard { 3 } else { 0 }; // 45 tokens → 3 pages
        assert_pages_back(&d, quarantined);
        assert_eq!(d.transfer_stats().drain_timeouts, 1, "heard: {heard}");
        assert_eq!(
            d.transfer_stats().reclaimed_pages,
            3 - u64::from(quarantined)
        );
        // A late frame of the session is dropped, never written, either way.
        let dropped = d.transfer_stats().frames_dropped.total();
        d.deliver(wire(&Message::Frame(out.frames[1].clone())));
        assert_eq!(d.transfer_stats().frames_dropped.total(), dropped + 1);
        out.close();
    }
}

#[test]
fn a_transfer_that_never_completes_times_out() {
    let mut d = tiny_engine_with(EngineConfig {
        transfer_timeout: Duration::ZERO,
        // No allowance for the bytes either: the deadline is now.
        transfer_floor_bytes_per_s: u64::MAX,
        ..EngineConfig::default()
    });
    let prompt: Vec<u32> = (3..40).collect();
    let (_target, rx) = reserve(&mut d, 1, &prompt, 8);
    d.step();
    assert!(matches!(
        collect(rx).finish,
        Some(Err(Failure::TransferTimedOut(_)))
    ));
    assert!(
        d.pool().stats().releasing > 0,
        "the pages wait for the drain, not the free list"
    );
}

#[test]
fn the_engine_counts_every_prompt_token_it_computes_as_it_computes_it() {
    // Prefill's progress, as decode hears it: the count rises with every chunk.
    let mut p = tiny_engine_with(EngineConfig {
        max_batch_tokens: 16,
        ..EngineConfig::default()
    });
    let mut d = tiny_engine(256);
    let prompt: Vec<u32> = (3..40).collect(); // 37 tokens: chunks of 16, 16 and 5
    let (target, _rx) = reserve(&mut d, 1, &prompt, 8);
    let (tx, _events) = mpsc::channel();
    p.submit_prefill(request(1, &prompt, 1, tx), target)
        .map_err(|(e, _)| e)
        .expect("prefill admits");
    let mut counts = vec![p.computed_prompt_tokens()];
    while p.has_work() {
        p.step();
        counts.push(p.computed_prompt_tokens());
    }
    assert_eq!(counts, [0, 16, 32, 37]);
    // Decode computes no prompt.
    assert_eq!(d.computed_prompt_tokens(), 0);
}

#[test]
fn only_new_progress_restarts_a_transfers_wait() {
    let mut d = tiny_engine(256);
    let prompt: Vec<u32> = (3..40).collect();
    let (target, _rx) = reserve(&mut d, 1, &prompt, 8);
    let first = d.next_deadline().expect("the transfer's deadline");
    let pause = Duration::from_millis(20);
    std::thread::sleep(pause);
    d.prefill_progress(target.nonce, 1000);
    let restarted = d.next_deadline().expect("still waiting");
    assert!(restarted >= first + pause, "progress restarts the wait");
    std::thread::sleep(pause);
    // The same count again, or a lower one: a peer that stopped computing.
    for stale in [1000, 999, 0] {
        d.prefill_progress(target.nonce, stale);
        assert_eq!(d.next_deadline(), Some(restarted), "{stale} moved it");
    }
    d.prefill_progress(target.nonce, 1001);
    assert!(d.next_deadline() >= Some(restarted + pause));
    // Another session's progress is not this one's.
    let later = d.next_deadline();
    d.prefill_progress(SessionNonce([7; 16]), 5000);
    assert_eq!(d.next_deadline(), later);
}

#[test]
fn a_verified_transfer_writes_every_frame_and_hands_back_every_buffer() {
    let (mut d, mut p) = (tiny_engine(256), tiny_engine(256));
    let prompt: Vec<u32> = (3..40).collect();
    let (target, rx) = reserve(&mut d, 1, &prompt, 8);
    let out = prefill(&mut p, 1, &prompt, target).expect("prefill");
    for f in &out.frames {
        let back = d.deliver(wire(&Message::Frame(f.clone())));
        assert_eq!(
            back.as_ref(),
            Some(&f.bytes),
            "the buffer comes back for reuse"
        );
    }
    assert_eq!(d.transfer_stats().frames_written, out.frames.len() as u64);
    assert_eq!(
        d.deliver(wire(&Message::Manifest(out.manifest.clone()))),
        None
    );
    out.close();
    let outcome = finish(&mut d, rx);
    assert!(matches!(outcome.finish, Some(Ok(_))), "{outcome:?}");
    assert_pages_back(&d, 0);
}

#[test]
fn prefill_refuses_a_reservation_that_does_not_describe_its_prompt() {
    let (mut d, mut p) = (tiny_engine(256), tiny_engine(256));
    // 37 tokens: 3 pages of 16, and still 3 pages of 13 (so only the field under test differs).
    let prompt: Vec<u32> = (3..40).collect();
    let (target, _rx) = reserve(&mut d, 1, &prompt, 8);
    let before = p.pool().stats();
    let changes: [fn(&mut Reservation); 7] = [
        |t| t.prompt_tokens += 1,
        |t| t.page_tokens = 13,
        |t| t.token_bytes += 1,
        |t| {
            t.pages.pop();
        },
        |t| t.cached_tokens = 8,
        |t| t.cached_tokens = 48,
        // Whole pages, but the reservation still names a page for each of the prompt's.
        |t| t.cached_tokens = 16,
    ];
    for (i, change) in changes.iter().enumerate() {
        let mut t = target.clone();
        change(&mut t);
        let (tx, _rx) = mpsc::channel();
        let refused = p
            .submit_prefill(request(10 + i as u64, &prompt, 1, tx), t)
            .map_err(|(e, _)| e);
        assert!(
            matches!(refused, Err(SubmitError::ReservationMismatch(_))),
            "change {i}: {refused:?}"
        );
    }
    assert_eq!(p.pool().stats(), before, "prefill allocated nothing");
    assert!(!p.has_work());
}

#[test]
fn a_torn_down_transport_fails_the_transfer_and_counts_as_the_drain() {
    let mut d = tiny_engine(256);
    let prompt: Vec<u32> = (3..40).collect();
    let (first, rx) = reserve(&mut d, 1, &prompt, 8);
    let (abandoned, _rx) = reserve(&mut d, 2, &prompt, 8);
    assert!(d.cancel(RequestId::new(2)));
    assert!(d.pool().stats().releasing > 0, "waiting for the drain");
    let s = d.transfer_stats();
    assert_eq!(
        (s.transfers_in_flight, s.in_flight_tokens, s.reserved_tokens),
        (1, 37, 45),
        "the first transfer's 37 prompt tokens, 45 with the tokens to generate"
    );
    d.transport_closed(&[first.nonce, abandoned.nonce]);
    assert_eq!(
        collect(rx).finish,
        Some(Err(Failure::PrefillClosed("prefill failed")))
    );
    d.step();
    assert_pages_back(&d, 0);
    // No peer acknowledged the abandoned one's drain: not timed as if it had.
    let s = d.transfer_stats();
    assert_eq!((s.teardown_drains, s.abort_ack.count()), (1, 0));
}

/// A transfer whose connection ends after a frame arrived corrupted, before any manifest (a
/// bit flipped in a frame's length ends the connection at the next head), failed its
/// verification: counted, its pages quarantined until its peer is gone and the grace period.
/// It was taken for prefill's own failure: a 503 retried, its pages released, nothing
/// counted, whatever the corruption.
#[test]
fn a_transfer_ended_after_a_corrupted_frame_and_before_its_manifest_fails_verification() {
    let mut d = tiny_engine_with(EngineConfig {
        reclaim_after: Duration::from_secs(3600),
        ..EngineConfig::default()
    });
    let mut p = tiny_engine(256);
    let prompt: Vec<u32> = (3..40).collect();
    let (target, rx) = reserve(&mut d, 1, &prompt, 8);
    let out = prefill(&mut p, 1, &prompt, target).expect("prefill");
    let mut corrupt = out.frames[1].clone();
    corrupt.bytes[0] ^= 1;
    for f in [&out.frames[0], &corrupt] {
        d.deliver(wire(&Message::Frame(f.clone())));
    }
    d.transport_closed(&[out.nonce()]);
    assert_eq!(
        collect(rx).finish,
        Some(Err(Failure::Transfer(IntegrityFailure::ChecksumMismatch {
            index: 1
        })))
    );
    assert_eq!(d.transfer_stats().integrity_failures, 1);
    d.step();
    assert_pages_back(&d, 3);
}

/// Decode's side of a transfer whose second frame arrives corrupted: the request fails and
/// its pages are quarantined. Returns the session.
fn quarantine_a_transfer(d: &mut Engine) -> SessionNonce {
    let mut p = tiny_engine(256);
    let prompt: Vec<u32> = (3..40).collect();
    let (target, _rx) = reserve(d, 1, &prompt, 8);
    let out = prefill(&mut p, 1, &prompt, target).expect("prefill");
    let mut corrupt = out.frames[1].clone();
    corrupt.bytes[0] ^= 1;
    for f in [&out.frames[0], &corrupt, &out.frames[2]] {
        d.deliver(wire(&Message::Frame(f.clone())));
    }
    d.deliver(wire(&Message::Manifest(out.manifest.clone())));
    assert_eq!(d.pool().stats().quarantined, 3);
    assert_eq!(d.transfer_stats().integrity_failures, 1);
    out.nonce()
}

#[test]
fn a_quarantined_transfer_comes_back_only_after_its_peer_is_gone_and_the_grace_period() {
    for (grace, back) in [(Duration::ZERO, true), (Duration::from_secs(3600), false)] {
        let mut d = tiny_engine_with(EngineConfig {
            reclaim_after: grace,
            ..EngineConfig::default()
        });
        let nonce = quarantine_a_transfer(&mut d);
        d.step();
        assert_pages_back(&d, 3); // the peer may still write: never reused
        assert_eq!(d.transfer_stats().quarantined_sessions, 1);
        d.deliver(Message::Closed {
            nonce,
            reason: CloseReason::Aborted,
        });
        d.step();
        let (quarantined, reclaimed) = if back { (0, 3) } else { (3, 0) };
        assert_pages_back(&d, quarantined);
        assert_eq!(d.transfer_stats().reclaimed_pages, reclaimed, "{grace:?}");
    }
}

#[test]
fn a_transfer_waits_the_timeout_plus_its_bytes_at_the_floor_rate() {
    let prompt: Vec<u32> = (3..40).collect();
    let token_bytes = tiny_engine(256).capacity().token_bytes;
    let bytes = prompt.len() as u64 * token_bytes;
    // The floor rate moves the prompt's bytes in exactly one second.
    let mut d = tiny_engine_with(EngineConfig {
        transfer_timeout: Duration::from_secs(100),
        transfer_floor_bytes_per_s: bytes,
        ..EngineConfig::default()
    });
    let earliest = Instant::now() + Duration::from_secs(101);
    let _transfer = reserve(&mut d, 1, &prompt, 8);
    let latest = Instant::now() + Duration::from_secs(101);
    let deadline = d.next_deadline().expect("a transfer in flight");
    assert!(
        earliest <= deadline && deadline <= latest,
        "{:?} after the earliest",
        deadline.checked_duration_since(earliest)
    );
}

/// A request waiting for pages that only another transfer's end can free gives the engine
/// nothing to step: its thread sleeps until a command or a deadline (the request's queue
/// deadline among them) instead of spinning; the transfer's end starts it.
#[test]
fn a_request_waiting_for_pages_a_transfer_holds_leaves_the_engine_nothing_to_step() {
    let mut d = tiny_engine(256);
    let (first, _rx) = reserve(&mut d, 1, &(3..40).collect::<Vec<u32>>(), 8);
    assert!(
        !d.can_progress(),
        "a transfer in flight alone: nothing to step"
    );
    let (tx, rx) = mpsc::channel();
    d.submit_decode(request(2, &[5; 227], 8, tx))
        .map_err(|(e, _)| e)
        .expect("fits the pool, not now");
    assert!(d.can_progress(), "not yet tried against the pool");
    let queued = Instant::now();
    d.step();
    assert_eq!(d.load(), (1, 1), "15 pages wanted, 13 free");
    assert!(d.has_work());
    assert!(!d.can_progress(), "another step could not start it");
    let deadline = d.next_deadline().expect("deadlines");
    assert!(
        deadline <= queued + EngineConfig::default().queue_timeout,
        "its queue deadline bounds the sleep"
    );
    // The transfer's end (a command) frees the pages; the step after it starts the request.
    d.prefill_rejected(first.nonce, SubmitError::EmptyPrompt);
    d.step();
    d.step();
    assert!(
        matches!(rx.try_recv(), Ok(Event::Reserved(_))),
        "started once the pages came back"
    );
    assert_eq!(d.load(), (0, 1));
}
