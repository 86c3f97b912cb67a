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
    let (ptx, prx) = mpsc::channel();
    p.submit_prefill(request(&prompt, ptx), target)
        .map_err(|(e, _)| e)
        .expect("prefill admits");
    while p.has_work() {
        p.step();
    }
    let Ok(Event::Prefilled(out)) = prx.try_recv() else {
        panic!("not prefilled");
    };
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
        matches!(events.as_slice(), [Event::Failed(Failure::Forward(_))]),
        "failed, never decoded from unwritten pages: {events:?}"
    );
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
        matches!(events.as_slice(), [Event::Failed(f)] if f.to_string().contains("not all finite")),
        "{events:?}"
    );
    e.scrub();
    let s = e.pool().stats();
    assert_eq!((s.quarantined, s.free), (0, free), "{s:?}");
}
