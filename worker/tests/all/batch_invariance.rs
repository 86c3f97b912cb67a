//! The isolation oracle: a greedy request's output is identical whether it runs alone on a
//! fresh engine or batched with others (chunked prefill interleaved with decode steps), on
//! every device.

use bulkhead_kernels::{Device, DeviceError, device_test};
use bulkhead_worker::engine::EngineConfig;
use bulkhead_worker::loader::LoadedModel;

use crate::common::{engine, real_model_owned, run_all};

fn real_model_on(dev: &Device) -> Result<LoadedModel, DeviceError> {
    let mut loaded = real_model_owned();
    loaded.model.to_device(dev)?;
    Ok(loaded)
}

fn greedy_outputs_do_not_depend_on_the_batch(dev: &Device) -> Result<(), DeviceError> {
    let prompts = [
        "The quick brown fox",
        "def fibonacci(n):",
        "Once upon a time, there was a",
        "In 1969, the first people to walk on the Moon were",
    ];
    let loaded = real_model_on(dev)?;
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
        let mut fresh = engine(real_model_on(dev)?, EngineConfig::default());
        let alone = run_all(&mut fresh, vec![request]);
        assert_eq!(batched[i], alone[0], "prompt {:?}", prompts[i]);
        assert!(matches!(batched[i].finish, Some(Ok(_))));
    }
    Ok(())
}
device_test!(greedy_outputs_do_not_depend_on_the_batch, cpu = best);
