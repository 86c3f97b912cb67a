//! The Llama-family model: configuration, weights mapped from GGUF, and the batched forward
//! pass over the paged KV pool.

mod config;
mod forward;
mod weights;

use std::path::Path;
use std::sync::Mutex;

use bulkhead_kernels::attention::KvLayout;
use bulkhead_kernels::ops::Rope;
use bulkhead_kernels::{Activations, Simd};

pub use config::{ModelConfig, RopeStyle};
pub use forward::{SeqFailure, SeqResult, SeqStep};

use crate::gguf::{Gguf, GgufError};
use weights::Weights;

/// A loaded model: the mapped file, its configuration and its weights.
#[derive(Debug)]
pub struct Model {
    gguf: Gguf,
    config: ModelConfig,
    weights: Weights,
    rope: Rope,
    simd: Simd,
    /// The forward pass's working buffers, kept between steps so a decode step allocates
    /// nothing once they have grown to the batch size.
    scratch: Mutex<Scratch>,
}

/// Working buffers of one forward step (see `forward.rs`), sized per step.
#[derive(Debug, Default)]
struct Scratch {
    x: Vec<f32>,
    angles: Vec<(f32, f32)>,
    acts: Activations,
    xn: Vec<f32>,
    q: Vec<f32>,
    att: Vec<f32>,
    o: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
}

impl Model {
    /// Opens and validates a GGUF model: every tensor the forward pass uses must exist with the
    /// right shape and a supported type.
    pub fn open(path: &Path) -> Result<Model, GgufError> {
        Model::from_gguf(Gguf::open(path)?)
    }

    pub fn from_gguf(gguf: Gguf) -> Result<Model, GgufError> {
        let config = ModelConfig::from_gguf(&gguf)?;
        let weights = Weights::load(&gguf, &config)?;
        let rope = Rope::new(config.head_dim, config.rope_base);
        Ok(Model {
            gguf,
            config,
            weights,
            rope,
            simd: Simd::best(),
            scratch: Mutex::default(),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn gguf(&self) -> &Gguf {
        &self.gguf
    }

    /// Uses the given SIMD level for every kernel (tests force each level in turn).
    pub fn set_simd(&mut self, simd: Simd) {
        self.simd = simd;
    }

    pub fn simd(&self) -> Simd {
        self.simd
    }

    /// The KV pool page shape this model needs for pages of `page_tokens` tokens.
    pub fn kv_layout(&self, page_tokens: usize) -> KvLayout {
        KvLayout {
            layers: self.config.layers,
            kv_heads: self.config.kv_heads,
            head_dim: self.config.head_dim,
            page_tokens,
        }
    }
}
