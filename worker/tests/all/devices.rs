//! Every device computes the model the portable CPU kernels compute: each test is written once
//! and runs on the CPU at every SIMD level (`on_cpu`) and, under the `cuda` feature, on a CUDA
//! device (`on_cuda`, skipped loudly where there is none). The portable CPU path is the oracle.
//!
//! Stated tolerances against the oracle:
//! - tiny random models, every weight format: logits within [`TINY_TOLERANCE`];
//! - the real model on the golden prompts, at a CPU SIMD level: the prompt's last logits and
//!   the greedy tokens equal bit for bit. Every CPU level computes the same float operations
//!   in the same order (the matmul tiles and the attention kernels alike), so any difference
//!   is a bug;
//! - the real model on the golden prompts, on CUDA: the prompt's last logits of the tokens
//!   llama.cpp ranks in its top 40 (those golden.json records, the set golden.rs checks)
//!   within [`LOGIT_TOLERANCE`], and greedy tokens equal up to the first step where the
//!   oracle's top-1 margin is below [`ROBUST_MARGIN`]. CUDA computes the same integer block
//!   dots but sums floats in another order, and activations are quantized to 8 bits before
//!   every matmul (as llama.cpp does), so a last-bit difference can move a value to the next
//!   step, and over 30 layers that grows. Measured on the CPU before its levels were made
//!   identical, with an order change in the attention sums alone (a sequential sum against
//!   8 lanes with FMA), over all 10 golden prompts: 0.27 to 0.50 on those top-40 logits, but
//!   0.45 to 1.34 over the whole vocabulary, where far-down tokens move most; hence the
//!   top-40 set. The bound is golden.rs's against llama.cpp, which itself moves by up to 0.66
//!   between batched and one-by-one prefill of the same prompt.

use bulkhead_kernels::{DType, Device, DeviceError, Simd, device_test};
use bulkhead_kvpool::Scrub;
use bulkhead_worker::sampling::argmax;
use bulkhead_worker::tiny_model::TinySpec;

use crate::common::{Session, real_model_owned, tiny_model_on};

const TINY_TOLERANCE: f32 = 1e-3;
const LOGIT_TOLERANCE: f32 = 0.75;
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
        let want = logits_on(spec(), &Device::Cpu(Simd::PORTABLE), &prompt)?;
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

/// A golden prompt: its name, its tokens as llama.cpp tokenized them, and the ids of the
/// tokens llama.cpp ranks in its top 40 for the prompt's last position.
struct Golden {
    name: String,
    tokens: Vec<u32>,
    top: Vec<usize>,
}

fn golden_prompts() -> Vec<Golden> {
    let text = std::fs::read_to_string(crate::common::fixtures_dir().join("golden.json"))
        .expect("read golden.json");
    let json: serde_json::Value = serde_json::from_str(&text).expect("parse golden.json");
    let ids = |v: &serde_json::Value| v.as_u64().expect("token id");
    json["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| Golden {
            name: c["name"].as_str().expect("name").to_owned(),
            tokens: c["tokens"]
                .as_array()
                .expect("tokens")
                .iter()
                .map(|t| ids(t) as u32)
                .collect(),
            top: c["prompt_logits"]["top"]
                .as_array()
                .expect("top logits")
                .iter()
                .map(|pair| ids(&pair[0]) as usize)
                .collect(),
        })
        .collect()
}

fn greedy(dev: &Device, prompts: &[Golden]) -> Result<Vec<Run>, DeviceError> {
    let mut loaded = real_model_owned();
    loaded.model.to_device(dev)?;
    let mut runs = Vec::new();
    for Golden { tokens: prompt, .. } in prompts {
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

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// The CPU halves take the first three golden prompts (CI has two cores); CUDA takes all.
fn the_golden_prompts_decode_like_the_portable_cpu(dev: &Device) -> Result<(), DeviceError> {
    let all = golden_prompts();
    let prompts = match dev {
        // The oracle itself.
        Device::Cpu(s) if *s == Simd::PORTABLE => return Ok(()),
        Device::Cpu(_) => &all[..3],
        Device::Cuda(_) => &all[..],
    };
    let oracle = greedy(&Device::Cpu(Simd::PORTABLE), prompts)?;
    let got = greedy(dev, prompts)?;
    if let Device::Cpu(_) = dev {
        for ((golden, want), got) in prompts.iter().zip(&oracle).zip(&got) {
            let name = &golden.name;
            assert!(
                bits(&got.logits) == bits(&want.logits),
                "{name} on {}: prompt logits differ from the portable CPU's",
                dev.describe()
            );
            assert_eq!(
                (&got.tokens, bits(&got.margins)),
                (&want.tokens, bits(&want.margins)),
                "{name} on {}: greedy tokens and margins",
                dev.describe()
            );
        }
        return Ok(());
    }
    let (mut worst, mut worst_anywhere) = (0.0f32, 0.0f32);
    for ((golden, want), got) in prompts.iter().zip(&oracle).zip(&got) {
        let name = &golden.name;
        let diff = |i: usize| (got.logits[i] - want.logits[i]).abs();
        let top = golden.top.iter().map(|&i| diff(i)).fold(0.0, f32::max);
        worst = worst.max(top);
        worst_anywhere = (0..want.logits.len())
            .map(diff)
            .fold(worst_anywhere, f32::max);
        assert!(
            top <= LOGIT_TOLERANCE,
            "{name} on {}: prompt logits of llama.cpp's top 40 differ by {top}",
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
        "{}: largest logit difference from the portable CPU: {worst} on llama.cpp's top 40, \
         {worst_anywhere} over the whole vocabulary",
        dev.describe()
    );
    Ok(())
}
device_test!(the_golden_prompts_decode_like_the_portable_cpu);
