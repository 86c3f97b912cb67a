//! One batched forward step. The batch concatenates every sequence's new tokens — a decode
//! step contributes one, a prefill chunk many — so the weight matmuls run once for all of
//! them; attention runs once for the batch, each sequence over its own pages. Each output
//! value is computed the same way whatever else is in the batch (see
//! `bulkhead_kernels::matmul` and `bulkhead_kernels::attention`), so a sequence's results do
//! not depend on its neighbours.

use bulkhead_kernels::attention::{
    BatchSeq, IntegrityError, PagedKv, PagedSeq, TagView, attend_batch, write_kv,
};
use bulkhead_kernels::ops::{Rope, add_assign, rms_norm, silu_mul};
use bulkhead_kernels::{DeviceError, ShapeError, matmul};
use bulkhead_kvpool::PageRef;

use super::{Model, Scratch};
use crate::kv::KvMemory;

/// One sequence's part of a forward step.
#[derive(Debug, Clone, Copy)]
pub struct SeqStep<'a> {
    /// The tokens to append (positions `cached..cached + tokens.len()`).
    pub tokens: &'a [u32],
    /// The sequence's page table; must cover `cached + tokens.len()` tokens.
    pub table: &'a [PageRef],
    /// Tokens already in the sequence's pages.
    pub cached: usize,
    /// Whether to return the logits after the last of `tokens`.
    pub logits: bool,
}

/// Why one sequence of a batch failed; the others are unaffected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SeqFailure {
    #[error("KV integrity: {0}")]
    Integrity(#[from] IntegrityError),
    #[error("token id {token} is outside the vocabulary of {vocab}")]
    TokenOutOfRange { token: u32, vocab: usize },
    #[error("internal error: {0}")]
    Internal(String),
}

/// Per sequence: its logits (when asked for) or why it failed.
pub type SeqResult = Result<Option<Vec<f32>>, SeqFailure>;

/// Why a whole step failed (a bug or a device fault, never a request's doing).
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error("weight shape: {0}")]
    Shape(#[from] ShapeError),
    #[error("device: {0}")]
    Device(#[from] DeviceError),
    #[error("the KV pool is not in the memory of the device the model runs on")]
    KvElsewhere,
}

impl Model {
    /// Runs one step for `batch`, writing the new tokens' K/V into `kv` and reading only pages
    /// whose current tag (`view.tags`, indexed by page) matches the sequence's page table.
    /// Runs on the model's device; `kv` must be in that device's memory.
    pub fn forward(
        &self,
        batch: &[SeqStep<'_>],
        kv: &mut KvMemory,
        view: TagView<'_>,
    ) -> Result<Vec<SeqResult>, ForwardError> {
        match &self.cuda {
            Some(cuda) => cuda.forward(&self.config, batch, kv, view),
            None => self.forward_cpu(batch, kv, view),
        }
    }

    fn forward_cpu(
        &self,
        batch: &[SeqStep<'_>],
        kv: &mut KvMemory,
        view: TagView<'_>,
    ) -> Result<Vec<SeqResult>, ForwardError> {
        let c = &self.config;
        let (dim, kvd, hd) = (c.dim, c.kv_heads * c.head_dim, c.head_dim);
        let n: usize = batch.iter().map(|s| s.tokens.len()).sum();
        let mut failed: Vec<Option<SeqFailure>> = vec![None; batch.len()];

        let mut guard = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        let Scratch {
            x,
            angles,
            acts,
            xn,
            q,
            att,
            o,
            k,
            v,
            gate,
            up,
        } = &mut *guard;
        for (buf, len) in [
            (&mut *x, n * dim),
            (&mut *xn, n * dim),
            (&mut *q, n * dim),
            (&mut *att, n * dim),
            (&mut *o, n * dim),
            (&mut *k, n * kvd),
            (&mut *v, n * kvd),
            (&mut *gate, n * c.ffn_dim),
            (&mut *up, n * c.ffn_dim),
        ] {
            buf.clear();
            buf.resize(len, 0.0);
        }
        angles.clear();
        angles.resize(n * hd / 2, (0.0, 0.0));
        let embed = &self.weights.embed;
        let mut row = 0;
        for (si, s) in batch.iter().enumerate() {
            for (i, &t) in s.tokens.iter().enumerate() {
                if (t as usize) < c.vocab {
                    embed.dequantize_row(t as usize, &mut x[row * dim..(row + 1) * dim]);
                } else {
                    failed[si] = Some(SeqFailure::TokenOutOfRange {
                        token: t,
                        vocab: c.vocab,
                    });
                }
                self.rope
                    .angles(s.cached + i, &mut angles[row * hd / 2..(row + 1) * hd / 2]);
                row += 1;
            }
        }

        let mut seqs: Vec<BatchSeq<'_>> = batch
            .iter()
            .zip(&failed)
            .map(|(s, f)| BatchSeq {
                seq: PagedSeq {
                    table: s.table,
                    cached: s.cached,
                    new: s.tokens.len(),
                },
                live: f.is_none(),
            })
            .collect();
        for (l, w) in self.weights.layers.iter().enumerate() {
            rms_norm(x, &w.attn_norm, c.rms_eps, xn);
            acts.load(xn, n, dim);
            matmul(self.simd, &w.wq, acts, q);
            matmul(self.simd, &w.wk, acts, k);
            matmul(self.simd, &w.wv, acts, v);
            for r in 0..n {
                let a = &angles[r * hd / 2..(r + 1) * hd / 2];
                Rope::apply(a, &mut q[r * dim..(r + 1) * dim]);
                Rope::apply(a, &mut k[r * kvd..(r + 1) * kvd]);
            }
            let layout = *kv.layout();
            let mem = kv.host_mut().ok_or(ForwardError::KvElsewhere)?;
            let mut row0 = 0;
            for (si, s) in seqs.iter_mut().enumerate() {
                let rows = row0..row0 + s.seq.new;
                row0 = rows.end;
                if !s.live {
                    continue;
                }
                let kv_rows = rows.start * kvd..rows.end * kvd;
                let written = write_kv(
                    &layout,
                    mem,
                    view,
                    s.seq,
                    l,
                    (&k[kv_rows.clone()], &v[kv_rows]),
                );
                if let Err(e) = written {
                    failed[si] = Some(e.into());
                    s.live = false;
                }
            }
            let paged = PagedKv {
                layout: &layout,
                values: mem,
                tags: view,
            };
            let attended = attend_batch(self.simd, paged, &seqs, l, q, att);
            let mut row0 = 0;
            for (si, (s, r)) in seqs.iter_mut().zip(attended).enumerate() {
                let rows = row0..row0 + s.seq.new;
                row0 = rows.end;
                if let Err(e) = r {
                    failed[si] = Some(e.into());
                    s.live = false;
                    att[rows.start * dim..rows.end * dim].fill(0.0);
                }
            }
            acts.load(att, n, dim);
            matmul(self.simd, &w.wo, acts, o);
            add_assign(x, o);

            rms_norm(x, &w.ffn_norm, c.rms_eps, xn);
            acts.load(xn, n, dim);
            matmul(self.simd, &w.w_gate, acts, gate);
            matmul(self.simd, &w.w_up, acts, up);
            silu_mul(gate, up);
            acts.load(gate, n, c.ffn_dim);
            matmul(self.simd, &w.w_down, acts, o);
            add_assign(x, o);
        }

        // The LM head runs only for the last token of the sequences that asked for logits.
        let mut wanted = Vec::new();
        let mut row_end = 0;
        for (si, s) in batch.iter().enumerate() {
            row_end += s.tokens.len();
            if s.logits && failed[si].is_none() && !s.tokens.is_empty() {
                wanted.push((si, row_end - 1));
            }
        }
        let mut last = vec![0.0; wanted.len() * dim];
        for (j, &(_, r)) in wanted.iter().enumerate() {
            rms_norm(
                &x[r * dim..(r + 1) * dim],
                &self.weights.out_norm,
                c.rms_eps,
                &mut last[j * dim..(j + 1) * dim],
            );
        }
        let mut logits = vec![0.0; wanted.len() * c.vocab];
        if !wanted.is_empty() {
            acts.load(&last, wanted.len(), dim);
            matmul(self.simd, self.weights.lm_head(), acts, &mut logits);
        }
        let mut results: Vec<SeqResult> = failed
            .into_iter()
            .map(|f| f.map_or(Ok(None), Err))
            .collect();
        for (j, (si, _)) in wanted.into_iter().enumerate() {
            results[si] = Ok(Some(logits[j * c.vocab..(j + 1) * c.vocab].to_vec()));
        }
        Ok(results)
    }
}
