//! The tenant-scoped prefix cache on a colocated engine with the real model: a prompt that
//! starts like one its tenant ran before reads those pages instead of computing them and
//! generates exactly what it generates when computed from scratch (greedy); another tenant's
//! identical prompt reads nothing; cached pages nobody reads make room for a reservation.

use std::sync::mpsc;

use bulkhead_kernels::{Device, DeviceError, device_test};
use bulkhead_kvpool::Scope;
use bulkhead_worker::engine::{Engine, EngineConfig, Event, KvBudget, Usage};
use bulkhead_worker::loader::LoadedModel;
use bulkhead_worker::tokenizer::TokenId;

use crate::common::{engine, real_model_owned, request};

fn real_model_on(dev: &Device) -> Result<LoadedModel, DeviceError> {
    let mut loaded = real_model_owned();
    loaded.model.to_device(dev)?;
    Ok(loaded)
}

const TEXT: &str = "The lighthouse keeper climbed the spiral stairs every evening at dusk, \
    counting the one hundred and twelve steps, polishing the great lens, and writing in his \
    logbook the names of the ships that passed the rocks below the cliffs";

/// Runs one greedy request of `tenant` to its end; its tokens and usage.
fn run(
    engine: &mut Engine,
    tenant: &str,
    prompt: &[TokenId],
    max_new: usize,
) -> (Vec<TokenId>, Usage) {
    let (tx, rx) = mpsc::channel();
    let mut r = request(rand::random::<u64>() >> 1, prompt, max_new, tx);
    r.tenant = Scope::new(tenant);
    engine.submit(r).map_err(|(e, _)| e).expect("admitted");
    while engine.has_work() {
        engine.step();
    }
    let mut tokens = Vec::new();
    for event in rx.try_iter() {
        match event {
            Event::Started => {}
            Event::Token { token, .. } => tokens.push(token),
            Event::Done { usage, .. } => return (tokens, usage),
            other => panic!("unexpected {other:?}"),
        }
    }
    panic!("no Done event")
}

fn cached_engine(loaded: LoadedModel, kv: KvBudget) -> Engine {
    engine(
        loaded,
        EngineConfig {
            kv,
            prefix_cache: true,
            ..EngineConfig::default()
        },
    )
}

fn a_prompt_read_from_its_tenants_cache_generates_what_computing_it_generates(
    dev: &Device,
) -> Result<(), DeviceError> {
    let loaded = real_model_on(dev)?;
    let prompt = loaded.tokenizer.encode(TEXT, false).expect("encode");
    let mut other = prompt[..40].to_vec();
    other.extend(
        loaded
            .tokenizer
            .encode(" until one night a storm", false)
            .expect("encode"),
    );
    let mut fresh = engine(real_model_on(dev)?, EngineConfig::default());
    let computed = [
        run(&mut fresh, "a", &prompt, 12).0,
        run(&mut fresh, "a", &other, 12).0,
    ];
    let mut cached = cached_engine(loaded, EngineConfig::default().kv);

    let (first, usage) = run(&mut cached, "a", &prompt, 12);
    assert_eq!(usage.cached_tokens, 0, "nothing cached yet");
    assert_eq!(first, computed[0]);
    let whole_pages = (prompt.len() - 1) / 16 * 16;
    assert!(
        whole_pages >= 32,
        "the prompt spans several pages: {}",
        prompt.len()
    );

    let (again, usage) = run(&mut cached, "a", &prompt, 12);
    assert_eq!(
        usage.cached_tokens, whole_pages,
        "all but the last page read from the cache"
    );
    assert_eq!(
        again, computed[0],
        "the cached KV is the KV the prompt computes"
    );

    let (branch, usage) = run(&mut cached, "a", &other, 12);
    assert_eq!(
        usage.cached_tokens, 32,
        "the two whole pages before the prompts differ"
    );
    assert_eq!(branch, computed[1]);

    let (theirs, usage) = run(&mut cached, "b", &prompt, 12);
    assert_eq!(
        usage.cached_tokens, 0,
        "another tenant reads none of tenant a's pages"
    );
    assert_eq!(theirs, computed[0]);

    let stats = cached.prefix_stats();
    assert_eq!(stats.cached_tokens as usize, whole_pages + 32);
    assert_eq!(stats.prompt_tokens as usize, 3 * prompt.len() + other.len());
    let pool = cached.pool().stats();
    assert!(pool.cached > 0 && pool.owned == 0, "{pool:?}");
    cached.pool().check_invariants().expect("pool invariants");
    Ok(())
}
device_test!(
    a_prompt_read_from_its_tenants_cache_generates_what_computing_it_generates,
    cpu = best
);

fn cached_pages_nobody_reads_make_room_for_a_reservation(dev: &Device) -> Result<(), DeviceError> {
    let loaded = real_model_on(dev)?;
    let prompt = loaded.tokenizer.encode(TEXT, false).expect("encode");
    let theirs: Vec<TokenId> = prompt.iter().rev().copied().collect();
    let mut fresh = engine(real_model_on(dev)?, EngineConfig::default());
    let computed = run(&mut fresh, "b", &theirs, 8).0;
    // Room for one of the two requests at a time: tenant a's cached pages must go.
    let pages = (prompt.len() + 8).div_ceil(16) as u64;
    let mut cached = cached_engine(loaded, KvBudget::Tokens(pages * 16));
    run(&mut cached, "a", &prompt, 8);
    let kept = cached.pool().stats().cached;
    assert_eq!(
        kept as usize,
        prompt.len() / 16,
        "{:?}",
        cached.pool().stats()
    );

    let (tokens, usage) = run(&mut cached, "b", &theirs, 8);
    assert_eq!(tokens, computed, "served, on evicted pages");
    assert_eq!(usage.cached_tokens, 0);
    let pool = cached.pool().stats();
    assert!(pool.cached <= kept, "{pool:?}");
    cached.pool().check_invariants().expect("pool invariants");
    Ok(())
}
device_test!(
    cached_pages_nobody_reads_make_room_for_a_reservation,
    cpu = best
);

/// What the scope prevents (test build only: `--features check-switches`, run by
/// scripts/test's switched pass): with the `prefix-scope` check off there is one cache for
/// every tenant, and tenant b's prompt reads the pages tenant a's computed — so how fast b is
/// served tells b what a sent. With the check on, the first test above sees b read nothing.
#[cfg(feature = "check-switches")]
#[test]
fn with_the_prefix_scope_switched_off_a_tenant_reads_another_tenants_pages() {
    bulkhead_checks::turn_off(&[bulkhead_checks::Check::PrefixScope]);
    let loaded = real_model_owned();
    let prompt = loaded.tokenizer.encode(TEXT, false).expect("encode");
    let mut cached = cached_engine(loaded, EngineConfig::default().kv);
    let (first, _) = run(&mut cached, "a", &prompt, 4);
    let (theirs, usage) = run(&mut cached, "b", &prompt, 4);
    assert_eq!(
        usage.cached_tokens,
        (prompt.len() - 1) / 16 * 16,
        "b read a's pages"
    );
    assert_eq!(theirs, first);
}
