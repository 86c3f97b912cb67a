//! Every device computes the model the portable CPU kernels compute: each test is written once
//! and runs on the CPU at every SIMD level (`on_cpu`) and, under the `cuda` feature, on a CUDA
//! device (`on_cuda`, skipped loudly where there is none). The portable CPU path is the oracle.
//!
//! Stated tolerances against the oracle:
//! - tiny random models, every weight format: logits within [`TINY_TOLERANCE`];
//! - the real model on the golden prompts: the prompt's last logits within
//!   [`LOGIT_TOLERANCE`] over the whole vocabulary, and greedy tokens equal up to the first
//!   step where the oracle's top-1 margin is below [`ROBUST_MARGIN`]. Every device computes
//!   the same integer block dots; only float sums run in another order. But activations are
//!   quantized to 8 bits before every matmul (as llama.cpp does), so a last-bit difference
//!   can move a value to the next step, and over 30 layers that grows: the AVX2 path differs
//!   from the portable one by up to 0.64 on ~25-scale logits, the size of llama.cpp's own
//!   0.66 between batched and one-by-one prefill (golden.rs uses the same bounds against it).

use bulkhead_kernels::{DType, Device, DeviceError, Simd, device_test};
use bulkhead_kvpool::Scrub;
use bulkhead_worker::sampling::argmax;
use bulkhead_worker::tiny_model::TinySpec;

use crate::common::{Session, real_model_owned, tiny_model_on};

const TINY_TOLERANCE: f32 = 1e-3;
const LOGIT_TOLERANCE: f32 = 1.0;
const ROBUST_MARGIN: f32 = 1.0;
/// Greedy steps per golden prompt.
const STEPS: usize = 12;

fn logits_on(spec: TinySpec, dev: &Device, prompt: &[u32]) -> Result<Vec<f32>, DeviceError> {
    let loaded = tiny_model_on(spec, dev)?;
    let mut s = Session::new(&loaded.model, 4, Scrub::None);
    let alloc = s.allocate(1, prompt.len());
    Ok(s.run(alloc.pages(), 0, prompt).expect("forward"))
}

fn every_weight_format_matches_the_portable_cpu(dev: &Device) -> Result<(), DeviceError> {
    let prompt: Vec<u32> = (10..40).collect();
    for dtype in [
        DType::Q4_0,
        DType::Q4_1,
        DType::Q8_0,
        DType::F16,
        DType::F32,
    ] {
        let spec = || TinySpec {
            matrix_dtype: dtype,
            embed_dtype: dtype,
            ..TinySpec::default()
        };
        let want = logits_on(spec(), &Device::Cpu(Simd::Portable), &prompt)?;
        assert!(want.iter().all(|l| l.is_finite()));
        let got = logits_on(spec(), dev, &prompt)?;
        let worst = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(
            worst < TINY_TOLERANCE,
            "{dtype:?} on {}: logits differ by {worst}",
            dev.describe()
        );
    }
    Ok(())
}
device_test!(every_weight_format_matches_the_portable_cpu);

/// One golden prompt's run: its last prompt logits and the greedy tokens with their margins.
#[derive(Debug, Clone)]
struct Run {
    logits: Vec<f32>,
    tokens: Vec<u32>,
    margins: Vec<f32>,
}

/// Top-1 minus top-2.
fn margin(logits: &[f32]) -> f32 {
    let top = argmax(logits) as usize;
    let second = logits
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != top)
        .map(|(_, &l)| l)
        .fold(f32::NEG_INFINITY, f32::max);
    logits[top] - second
}

/// The golden prompts (their tokens as llama.cpp tokenized them).
fn golden_prompts() -> Vec<(String, Vec<u32>)> {
    let text = std::fs::read_to_string(crate::common::fixtures_dir().join("golden.json"))
        .expect("read golden.json");
    let json: serde_json::Value = serde_json::from_str(&text).expect("parse golden.json");
    json["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| {
            let tokens = c["tokens"]
                .as_array()
                .expect("tokens")
                .iter()
                .map(|t| t.as_u64().expect("token") as u32)
                .collect();
            (c["name"].as_str().expect("name").to_owned(), tokens)
        })
        .collect()
}

fn greedy(dev: &Device, prompts: &[(String, Vec<u32>)]) -> Result<Vec<Run>, DeviceError> {
    let mut loaded = real_model_owned();
    loaded.model.to_device(dev)?;
    let mut runs = Vec::new();
    for (_, prompt) in prompts {
        let total = prompt.len() + STEPS;
        let mut s = Session::new(&loaded.model, (total as u32).div_ceil(16), Scrub::None);
        let alloc = s.allocate(1, total);
        let mut logits = s.run(alloc.pages(), 0, prompt).expect("prefill");
        let first = logits.clone();
        let (mut tokens, mut margins) = (Vec::new(), Vec::new());
        for pos in prompt.len()..total {
            let t = argmax(&logits);
            tokens.push(t);
            margins.push(margin(&logits));
            logits = s.run(alloc.pages(), pos, &[t]).expect("decode");
        }
        runs.push(Run {
            logits: first,
            tokens,
            margins,
        });
    }
    Ok(runs)
}

/// The CPU halves take the first three golden prompts (CI has two cores); CUDA takes all.
fn the_golden_prompts_decode_like_the_portable_cpu(dev: &Device) -> Result<(), DeviceError> {
    let all = golden_prompts();
    let prompts = match dev {
        // The oracle itself.
        Device::Cpu(Simd::Portable) => return Ok(()),
        Device::Cpu(_) => &all[..3],
        Device::Cuda(_) => &all[..],
    };
    let oracle = greedy(&Device::Cpu(Simd::Portable), prompts)?;
    let got = greedy(dev, prompts)?;
    let mut worst = 0.0f32;
    for (((name, _), want), got) in prompts.iter().zip(&oracle).zip(&got) {
        let diff = got
            .logits
            .iter()
            .zip(&want.logits)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        worst = worst.max(diff);
        assert!(
            diff <= LOGIT_TOLERANCE,
            "{name} on {}: prompt logits differ by {diff}",
            dev.describe()
        );
        let robust = want
            .margins
            .iter()
            .position(|&m| m < ROBUST_MARGIN)
            .unwrap_or(STEPS);
        assert_eq!(
            got.tokens[..robust],
            want.tokens[..robust],
            "{name} on {}: greedy tokens (oracle margins {:?})",
            dev.describe(),
            want.margins
        );
    }
    eprintln!(
        "{}: largest logit difference from the portable CPU: {worst}",
        dev.describe()
    );
    Ok(())
}
device_test!(the_golden_prompts_decode_like_the_portable_cpu);
