use std::ops::Range;

use bulkhead_kernels::{DType, QMatrix, ShapeError};

use super::ModelConfig;
use crate::gguf::{Gguf, GgufError};

/// A weight matrix inside the mapped file, its shape checked at load.
#[derive(Debug, Clone)]
pub(super) struct MatDesc {
    dtype: DType,
    rows: usize,
    cols: usize,
    bytes: Range<usize>,
}

impl MatDesc {
    fn load(g: &Gguf, name: &str, rows: usize, cols: usize) -> Result<MatDesc, GgufError> {
        let m = g.matrix(name, rows, cols)?;
        let bytes = g.tensor_range(name)?;
        Ok(MatDesc {
            dtype: m.dtype(),
            rows,
            cols,
            bytes,
        })
    }

    /// The matrix over the file's bytes. Cannot fail for the file it was loaded from.
    pub(super) fn bind<'a>(&self, g: &'a Gguf) -> Result<QMatrix<'a>, ShapeError> {
        QMatrix::new(
            self.dtype,
            self.rows,
            self.cols,
            g.bytes(self.bytes.clone()),
        )
    }
}

/// One transformer block's weights.
#[derive(Debug)]
pub(super) struct Layer {
    pub attn_norm: Vec<f32>,
    pub wq: MatDesc,
    pub wk: MatDesc,
    pub wv: MatDesc,
    pub wo: MatDesc,
    pub ffn_norm: Vec<f32>,
    pub w_gate: MatDesc,
    pub w_up: MatDesc,
    pub w_down: MatDesc,
}

/// All weights of a Llama-family model.
#[derive(Debug)]
pub(super) struct Weights {
    pub embed: MatDesc,
    pub layers: Vec<Layer>,
    pub out_norm: Vec<f32>,
    /// `output.weight`, or the embedding when the head is tied to it.
    pub lm_head: MatDesc,
}

impl Weights {
    pub fn load(g: &Gguf, c: &ModelConfig) -> Result<Weights, GgufError> {
        let kv_dim = c.kv_heads * c.head_dim;
        let layers = (0..c.layers)
            .map(|i| {
                let n = |t: &str| format!("blk.{i}.{t}.weight");
                Ok(Layer {
                    attn_norm: g.vector(&n("attn_norm"), c.dim)?,
                    wq: MatDesc::load(g, &n("attn_q"), c.dim, c.dim)?,
                    wk: MatDesc::load(g, &n("attn_k"), kv_dim, c.dim)?,
                    wv: MatDesc::load(g, &n("attn_v"), kv_dim, c.dim)?,
                    wo: MatDesc::load(g, &n("attn_output"), c.dim, c.dim)?,
                    ffn_norm: g.vector(&n("ffn_norm"), c.dim)?,
                    w_gate: MatDesc::load(g, &n("ffn_gate"), c.ffn_dim, c.dim)?,
                    w_up: MatDesc::load(g, &n("ffn_up"), c.ffn_dim, c.dim)?,
                    w_down: MatDesc::load(g, &n("ffn_down"), c.dim, c.ffn_dim)?,
                })
            })
            .collect::<Result<_, GgufError>>()?;
        let embed = MatDesc::load(g, "token_embd.weight", c.vocab, c.dim)?;
        let lm_head = match g.tensor_info("output.weight") {
            Ok(_) => MatDesc::load(g, "output.weight", c.vocab, c.dim)?,
            Err(_) => embed.clone(),
        };
        Ok(Weights {
            embed,
            layers,
            out_norm: g.vector("output_norm.weight", c.dim)?,
            lm_head,
        })
    }
}
