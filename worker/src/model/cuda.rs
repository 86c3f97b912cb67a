//! The forward pass on a CUDA device: the same steps as `forward.rs`, with the weights, the
//! activations and the KV pool in device memory. The CPU path is the oracle (worker tests
//! `cuda_matches_cpu`); without the `cuda` feature the device types are uninhabited and this
//! code is unreachable, but it compiles the same.

use bulkhead_kernels::attention::TagView;
use bulkhead_kernels::cuda::{CudaBuf, CudaDevice, DeviceMatrix, StepSeq};
use bulkhead_kernels::ops::Rope;
use bulkhead_kernels::{DeviceError, ShapeError};

use super::ModelConfig;
use super::forward::{ForwardError, SeqFailure, SeqResult, SeqStep};
use super::weights::{Layer, Mat, Weights};
use crate::gguf::Gguf;
use crate::kv::KvMemory;

/// One block's weights on the device.
#[derive(Debug)]
struct CudaLayer {
    attn_norm: CudaBuf<f32>,
    wq: DeviceMatrix,
    wk: DeviceMatrix,
    wv: DeviceMatrix,
    wo: DeviceMatrix,
    ffn_norm: CudaBuf<f32>,
    w_gate: DeviceMatrix,
    w_up: DeviceMatrix,
    w_down: DeviceMatrix,
}

/// A model's weights on a CUDA device.
#[derive(Debug)]
pub(super) struct CudaModel {
    dev: CudaDevice,
    embed: DeviceMatrix,
    layers: Vec<CudaLayer>,
    out_norm: CudaBuf<f32>,
    lm_head: DeviceMatrix,
    inv_freq: CudaBuf<f32>,
}

fn shape(e: ShapeError) -> DeviceError {
    DeviceError::Shape {
        what: e.to_string(),
    }
}

impl CudaModel {
    /// Uploads every weight the forward pass uses.
    pub fn upload(
        dev: &CudaDevice,
        g: &Gguf,
        w: &Weights,
        rope: &Rope,
    ) -> Result<CudaModel, DeviceError> {
        // From the file, in the GGUF block layout the CUDA kernels read; the range was released
        // after packing, so it faults back in for the upload and is released again after.
        let mat = |m: &Mat| -> Result<DeviceMatrix, DeviceError> {
            let up = dev.upload_matrix(&m.file.bind(g).map_err(shape)?);
            m.file.release(g);
            up
        };
        let layer = |l: &Layer| -> Result<CudaLayer, DeviceError> {
            Ok(CudaLayer {
                attn_norm: dev.upload(&l.attn_norm)?,
                wq: mat(&l.wq)?,
                wk: mat(&l.wk)?,
                wv: mat(&l.wv)?,
                wo: mat(&l.wo)?,
                ffn_norm: dev.upload(&l.ffn_norm)?,
                w_gate: mat(&l.w_gate)?,
                w_up: mat(&l.w_up)?,
                w_down: mat(&l.w_down)?,
            })
        };
        Ok(CudaModel {
            dev: dev.clone(),
            embed: mat(&w.embed)?,
            layers: w.layers.iter().map(layer).collect::<Result<_, _>>()?,
            out_norm: dev.upload(&w.out_norm)?,
            lm_head: mat(w.lm_head())?,
            inv_freq: dev.upload(rope.inv_freq())?,
        })
    }

    pub fn device(&self) -> &CudaDevice {
        &self.dev
    }

    /// One batched step (see `Model::forward`).
    pub fn forward(
        &self,
        c: &ModelConfig,
        batch: &[SeqStep<'_>],
        kv: &mut KvMemory,
        view: TagView<'_>,
    ) -> Result<Vec<SeqResult>, ForwardError> {
        let dev = &self.dev;
        let (dim, kvd, ffn) = (c.dim, c.kv_heads * c.head_dim, c.ffn_dim);
        let n: usize = batch.iter().map(|s| s.tokens.len()).sum();
        let mut failed: Vec<Option<SeqFailure>> = vec![None; batch.len()];
        let mut ids = Vec::with_capacity(n);
        for (si, s) in batch.iter().enumerate() {
            for &t in s.tokens {
                if t as usize >= c.vocab {
                    failed[si] = Some(SeqFailure::TokenOutOfRange {
                        token: t,
                        vocab: c.vocab,
                    });
                }
                ids.push(t);
            }
        }
        let seqs: Vec<StepSeq<'_>> = batch
            .iter()
            .zip(&failed)
            .map(|(s, f)| StepSeq {
                table: s.table,
                cached: s.cached,
                new: s.tokens.len(),
                active: f.is_none(),
            })
            .collect();
        let pool = kv.device_mut().ok_or(ForwardError::KvElsewhere)?;
        let layout = *pool.layout();
        let mut step = dev.kv_step(&layout, view.tags, view.check, view.canary, &seqs)?;

        let mut x = dev.zeros(n * dim)?;
        dev.get_rows(&self.embed, &dev.upload(&ids)?, n, &mut x)?;
        let mut a_dim = dev.acts(n, dim)?;
        let mut a_ffn = dev.acts(n, ffn)?;
        let (mut q, mut o) = (dev.zeros(n * dim)?, dev.zeros(n * dim)?);
        let (mut k, mut v) = (dev.zeros(n * kvd)?, dev.zeros(n * kvd)?);
        let mut up = dev.zeros(n * ffn)?;
        for (l, w) in self.layers.iter().enumerate() {
            dev.rms_norm(&x, &w.attn_norm, c.rms_eps, n, a_dim.values_mut())?;
            dev.quantize(&mut a_dim)?;
            dev.matmul(&w.wq, &a_dim, &mut q)?;
            dev.matmul(&w.wk, &a_dim, &mut k)?;
            dev.matmul(&w.wv, &a_dim, &mut v)?;
            dev.rope(&mut q, n, dim, step.positions(), &self.inv_freq)?;
            dev.rope(&mut k, n, kvd, step.positions(), &self.inv_freq)?;
            dev.write_kv(pool, &mut step, l, &k, &v)?;
            dev.attend(pool, &mut step, l, &q, c.heads, a_dim.values_mut())?;
            dev.quantize(&mut a_dim)?;
            dev.matmul(&w.wo, &a_dim, &mut o)?;
            dev.add_assign(&mut x, &o, n * dim)?;

            dev.rms_norm(&x, &w.ffn_norm, c.rms_eps, n, a_dim.values_mut())?;
            dev.quantize(&mut a_dim)?;
            dev.matmul(&w.w_gate, &a_dim, a_ffn.values_mut())?;
            dev.matmul(&w.w_up, &a_dim, &mut up)?;
            dev.silu_mul(a_ffn.values_mut(), &up, n * ffn)?;
            dev.quantize(&mut a_ffn)?;
            dev.matmul(&w.w_down, &a_ffn, &mut o)?;
            dev.add_assign(&mut x, &o, n * dim)?;
        }
        for (f, kv_failure) in failed.iter_mut().zip(dev.step_failures(&step)?) {
            if f.is_none() {
                *f = kv_failure.map(SeqFailure::Integrity);
            }
        }

        // The LM head runs only for the last token of the sequences that asked for logits.
        let mut wanted = Vec::new();
        let mut row_end = 0;
        for (si, s) in batch.iter().enumerate() {
            row_end += s.tokens.len();
            if s.logits && failed[si].is_none() && !s.tokens.is_empty() {
                wanted.push((si, (row_end - 1) as u32));
            }
        }
        let mut results: Vec<SeqResult> = failed
            .into_iter()
            .map(|f| f.map_or(Ok(None), Err))
            .collect();
        if wanted.is_empty() {
            return Ok(results);
        }
        let m = wanted.len();
        let rows: Vec<u32> = wanted.iter().map(|&(_, r)| r).collect();
        let mut last = dev.zeros(m * dim)?;
        dev.gather_rows(&x, dim, &dev.upload(&rows)?, m, &mut last)?;
        let mut a_last = dev.acts(m, dim)?;
        dev.rms_norm(&last, &self.out_norm, c.rms_eps, m, a_last.values_mut())?;
        dev.quantize(&mut a_last)?;
        let mut logits = dev.zeros(m * c.vocab)?;
        dev.matmul(&self.lm_head, &a_last, &mut logits)?;
        let logits = dev.download(&logits, m * c.vocab)?;
        for (j, (si, _)) in wanted.into_iter().enumerate() {
            results[si] = Ok(Some(logits[j * c.vocab..(j + 1) * c.vocab].to_vec()));
        }
        Ok(results)
    }
}
