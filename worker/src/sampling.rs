//! Choosing the next token from logits: greedy, or temperature with top-k and top-p, seeded.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::tokenizer::TokenId;

/// Sampling settings of one request, validated: `temperature >= 0`, `0 < top_p <= 1`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; `None` keeps all.
    pub top_k: Option<usize>,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p`.
    pub top_p: f32,
    /// Seed of the request's random stream; the same seed gives the same tokens.
    pub seed: u64,
}

impl SamplingParams {
    pub const GREEDY: SamplingParams = SamplingParams {
        temperature: 0.0,
        top_k: None,
        top_p: 1.0,
        seed: 0,
    };
}

/// Why sampling settings were refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    #[error("temperature must be a finite number ≥ 0, got {0}")]
    Temperature(f32),
    #[error("top_p must be in (0, 1], got {0}")]
    TopP(f32),
    #[error("top_k must be ≥ 1")]
    TopK,
}

impl SamplingParams {
    pub fn validate(self) -> Result<SamplingParams, SamplingError> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(SamplingError::Temperature(self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::TopP(self.top_p));
        }
        if self.top_k == Some(0) {
            return Err(SamplingError::TopK);
        }
        Ok(self)
    }
}

/// A request's sampler: its settings and its own random stream.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    scratch: Vec<(f32, TokenId)>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Sampler {
        Sampler {
            params,
            rng: StdRng::seed_from_u64(params.seed),
            scratch: Vec::new(),
        }
    }

    /// The sampler of a request whose first `sampled` tokens were chosen elsewhere (a prefill
    /// worker chose the first): its stream goes on where that one's left off, so a seed gives
    /// the same tokens across workers as on one. [`Sampler::sample`] draws once per token
    /// unless greedy.
    pub fn resumed(params: SamplingParams, sampled: usize) -> Sampler {
        let mut s = Sampler::new(params);
        if params.temperature != 0.0 {
            for _ in 0..sampled {
                s.rng.random::<f32>();
            }
        }
        s
    }

    pub fn sample(&mut self, logits: &[f32]) -> TokenId {
        if self.params.temperature == 0.0 {
            return argmax(logits);
        }
        let t = self.params.temperature;
        // Scaled from the largest logit down: never above 0, so a temperature near zero
        // sends the others to -inf (weight 0), never the largest to +inf (inf - inf is NaN).
        let top = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let c = &mut self.scratch;
        c.clear();
        c.extend(
            logits
                .iter()
                .enumerate()
                .map(|(i, &l)| ((l - top) / t, i as TokenId)),
        );
        c.sort_unstable_by(|a, b| b.0.total_cmp(&a.0));
        if let Some(k) = self.params.top_k {
            c.truncate(k.max(1));
        }
        // The largest is 0 already: exp keeps every weight in (0, 1]. Sums in f64: summed in
        // f32 from the largest down, a long tail of weights each under half an f32 step of
        // the running sum would be lost — cut by top-p even at 1, and never drawn.
        let mut total = 0.0f64;
        for e in c.iter_mut() {
            e.0 = e.0.exp();
            total += f64::from(e.0);
        }
        // top_p 1 (OpenAI's default) keeps every token.
        if self.params.top_p < 1.0 {
            let wanted = f64::from(self.params.top_p) * total;
            let mut kept = 0.0f64;
            let mut keep = c.len();
            for (i, e) in c.iter().enumerate() {
                kept += f64::from(e.0);
                if kept >= wanted {
                    keep = i + 1;
                    total = kept;
                    break;
                }
            }
            c.truncate(keep);
        }
        let mut r = f64::from(self.rng.random::<f32>()) * total;
        for e in c.iter() {
            r -= f64::from(e.0);
            if r <= 0.0 {
                return e.1;
            }
        }
        c[c.len() - 1].1
    }
}

/// The index of the largest logit (the first one on ties).
pub fn argmax(logits: &[f32]) -> TokenId {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as TokenId
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_maximum() {
        assert_eq!(argmax(&[0.1, 3.0, 3.0, -1.0]), 1);
        assert_eq!(
            Sampler::new(SamplingParams::GREEDY).sample(&[0.0, 1.0, 5.0]),
            2
        );
    }

    #[test]
    fn the_same_seed_gives_the_same_tokens() {
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let p = SamplingParams {
            temperature: 1.0,
            top_k: None,
            top_p: 1.0,
            seed: 42,
        };
        let run = |p| {
            let mut s = Sampler::new(p);
            (0..20).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(run(p), run(p));
        assert_ne!(run(p), run(SamplingParams { seed: 43, ..p }));
        let mut resumed = Sampler::resumed(p, 5);
        let rest: Vec<_> = (0..15).map(|_| resumed.sample(&logits)).collect();
        assert_eq!(rest, run(p)[5..]);
    }

    #[test]
    fn top_k_and_top_p_keep_only_the_head() {
        let logits = [10.0, 9.5, 0.0, -1.0, -2.0];
        let mut k = Sampler::new(SamplingParams {
            temperature: 5.0,
            top_k: Some(2),
            top_p: 1.0,
            seed: 1,
        });
        let mut p = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: None,
            top_p: 0.5,
            seed: 1,
        });
        for _ in 0..200 {
            assert!(k.sample(&logits) < 2);
            assert_eq!(p.sample(&logits), 0);
        }
    }

    /// A long tail of small weights: summed in f32 from the largest down, each fell under
    /// half a step of the running sum, so top-p cut the tail even at 1 and no draw reached it.
    #[test]
    fn at_top_p_1_the_long_tail_is_drawn_at_its_weight() {
        // Token 0 at weight 1, 49 151 others at e^-17 each: 0.20% of the mass in all.
        let mut logits = vec![-17.0f32; 49152];
        logits[0] = 0.0;
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: None,
            top_p: 1.0,
            seed: 7,
        });
        let tail = (0..10_000).filter(|_| s.sample(&logits) != 0).count();
        // About 20 expected (0.20% of 10 000); none before.
        assert!((5..=60).contains(&tail), "{tail} of 10 000 from the tail");
    }

    #[test]
    fn a_temperature_near_zero_samples_the_most_likely_token() {
        let logits = [0.5, 3.0, 2.9, -1.0];
        for temperature in [1e-40, 1e-30, 1e-6] {
            for seed in 0..20 {
                let mut s = Sampler::new(SamplingParams {
                    temperature,
                    top_k: None,
                    top_p: 1.0,
                    seed,
                });
                // Before, the largest logits became +inf, every weight NaN, and the least
                // likely token came out.
                assert_eq!(s.sample(&logits), 1, "temperature {temperature}");
            }
        }
    }

    #[test]
    fn bad_settings_are_refused() {
        let bad = |p: SamplingParams| p.validate().is_err();
        assert!(bad(SamplingParams {
            temperature: -1.0,
            ..SamplingParams::GREEDY
        }));
        assert!(bad(SamplingParams {
            temperature: f32::NAN,
            ..SamplingParams::GREEDY
        }));
        assert!(bad(SamplingParams {
            top_p: 0.0,
            ..SamplingParams::GREEDY
        }));
        assert!(bad(SamplingParams {
            top_k: Some(0),
            ..SamplingParams::GREEDY
        }));
    }
}
