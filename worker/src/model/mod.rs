//! The Llama-family model: configuration, weights mapped from GGUF, and the batched forward
//! pass over the paged KV pool.

mod config;
mod cuda;
mod forward;
mod weights;

use std::path::Path;
use std::sync::Mutex;

use bulkhead_kernels::attention::KvLayout;
use bulkhead_kernels::ops::Rope;
use bulkhead_kernels::{Activations, Device, DeviceError, Simd};

pub use config::{ModelConfig, RopeStyle};
pub use forward::{ForwardError, SeqFailure, SeqResult, SeqStep};

use crate::gguf::{Gguf, GgufError};
use cuda::CudaModel;
use weights::Weights;

/// A loaded model: the mapped file, its configuration and its weights.
#[derive(Debug)]
pub struct Model {
    gguf: Gguf,
    config: ModelConfig,
    weights: Weights,
    rope: Rope,
    /// The CPU kernels' SIMD level (the CPU path, and the oracle for the others).
    simd: Simd,
    /// The weights on a CUDA device, when the model runs there ([`Model::to_device`]).
    cuda: Option<CudaModel>,
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
            cuda: None,
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

    /// Runs the model on `device` from now on: on the CPU at its SIMD level, or on a CUDA
    /// device after uploading the weights (the KV pool must then live there too, see
    /// `KvMemory::on`).
    pub fn to_device(&mut self, device: &Device) -> Result<(), DeviceError> {
        match device {
            Device::Cpu(simd) => {
                self.simd = *simd;
                self.cuda = None;
            }
            Device::Cuda(dev) => {
                self.cuda = Some(CudaModel::upload(
                    dev,
                    &self.gguf,
                    &self.weights,
                    &self.rope,
                )?);
            }
        }
        Ok(())
    }

    /// Where the forward pass runs.
    pub fn device(&self) -> Device {
        match &self.cuda {
            Some(c) => Device::Cuda(c.device().clone()),
            None => Device::Cpu(self.simd),
        }
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
