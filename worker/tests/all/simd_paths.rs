//! Every SIMD path the CPU supports computes the same model as the portable path, for every
//! weight format, and the real model gives the same greedy answer on each.

use bulkhead_kernels::{DType, Simd};
use bulkhead_kvpool::Scrub;
use bulkhead_worker::tiny_model::TinySpec;

use crate::common::{Session, real_model_owned, tiny_model};

fn logits_with(
    loaded: &mut bulkhead_worker::loader::LoadedModel,
    simd: Simd,
    prompt: &[u32],
) -> Vec<f32> {
    loaded.model.set_simd(simd);
    let mut s = Session::new(&loaded.model, 4, Scrub::None);
    let alloc = s.allocate(1, prompt.len());
    s.run(alloc.pages(), 0, prompt).expect("forward")
}

#[test]
fn every_simd_path_matches_the_portable_one_for_every_weight_format() {
    let prompt: Vec<u32> = (10..40).collect();
    for dtype in [
        DType::Q4_0,
        DType::Q4_1,
        DType::Q8_0,
        DType::F16,
        DType::F32,
    ] {
        let mut loaded = tiny_model(TinySpec {
            matrix_dtype: dtype,
            embed_dtype: dtype,
            ..TinySpec::default()
        });
        let want = logits_with(&mut loaded, Simd::Portable, &prompt);
        assert!(want.iter().all(|l| l.is_finite()));
        for simd in Simd::available() {
            let got = logits_with(&mut loaded, simd, &prompt);
            let worst = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(
                worst < 1e-3,
                "{dtype:?} on {simd:?}: logits differ by {worst}"
            );
        }
    }
}

#[test]
fn the_real_model_answers_the_same_on_every_simd_path() {
    let mut loaded = real_model_owned();
    let chat = loaded.chat.as_ref().expect("template");
    let text = chat
        .render(
            &[bulkhead_worker::chat::Message::new("user", "What is 2+2?")],
            true,
        )
        .expect("render");
    let prompt = loaded.tokenizer.encode(&text, true).expect("encode");
    let mut answers = Vec::new();
    for simd in Simd::available() {
        loaded.model.set_simd(simd);
        let mut s = Session::new(&loaded.model, 4, Scrub::None);
        let alloc = s.allocate(1, prompt.len() + 12);
        let mut logits = s.run(alloc.pages(), 0, &prompt).expect("prefill");
        let mut tokens = Vec::new();
        for pos in prompt.len()..prompt.len() + 12 {
            let t = bulkhead_worker::sampling::argmax(&logits);
            tokens.push(t);
            logits = s.run(alloc.pages(), pos, &[t]).expect("decode");
        }
        let text = loaded.tokenizer.decode(&tokens);
        assert!(text.contains('4'), "{simd:?}: {text:?}");
        answers.push(tokens);
    }
    assert!(answers.windows(2).all(|w| w[0] == w[1]), "{answers:?}");
}
