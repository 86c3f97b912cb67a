//! The isolation oracle: a greedy request's output is identical whether it runs alone on a
//! fresh engine or batched with others (chunked prefill interleaved with decode steps).

use bulkhead_worker::engine::EngineConfig;

use crate::common::{engine, real_model_owned, run_all};

#[test]
fn greedy_outputs_do_not_depend_on_the_batch() {
    let prompts = [
        "The quick brown fox",
        "def fibonacci(n):",
        "Once upon a time, there was a",
        "In 1969, the first people to walk on the Moon were",
    ];
    let loaded = real_model_owned();
    let requests: Vec<(Vec<u32>, usize)> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            (
                loaded.tokenizer.encode(p, false).expect("encode"),
                12 + 3 * i,
            )
        })
        .collect();

    let config = EngineConfig {
        max_batch_tokens: 5,
        ..EngineConfig::default()
    };
    let mut together = engine(loaded, config.clone());
    let batched = run_all(&mut together, requests.clone());

    for (i, request) in requests.into_iter().enumerate() {
        let mut fresh = engine(real_model_owned(), EngineConfig::default());
        let alone = run_all(&mut fresh, vec![request]);
        assert_eq!(batched[i], alone[0], "prompt {:?}", prompts[i]);
        assert!(matches!(batched[i].finish, Some(Ok(_))));
    }
}
