//! The model's weights, packed once at load for the kernels that read them
//! ([`PackedMatrix`]). Once a matrix is packed, its pages of the mapped file are handed back
//! to the kernel, so the file's bytes and the packed copy are never resident together.

use bulkhead_kernels::PackedMatrix;

use super::ModelConfig;
use crate::gguf::{Gguf, GgufError};

/// Tensor `name` (`rows × cols`) packed for the kernels; its file pages are released.
fn pack(g: &Gguf, name: &str, rows: usize, cols: usize) -> Result<PackedMatrix, GgufError> {
    let packed = PackedMatrix::pack(&g.matrix(name, rows, cols)?);
    g.release(g.tensor_range(name)?);
    Ok(packed)
}

/// One transformer block's weights.
#[derive(Debug)]
pub(super) struct Layer {
    pub attn_norm: Vec<f32>,
    pub wq: PackedMatrix,
    pub wk: PackedMatrix,
    pub wv: PackedMatrix,
    pub wo: PackedMatrix,
    pub ffn_norm: Vec<f32>,
    pub w_gate: PackedMatrix,
    pub w_up: PackedMatrix,
    pub w_down: PackedMatrix,
}

/// All weights of a Llama-family model.
#[derive(Debug)]
pub(super) struct Weights {
    pub embed: PackedMatrix,
    pub layers: Vec<Layer>,
    pub out_norm: Vec<f32>,
    /// `output.weight`; `None` when the head is tied to the embedding.
    output: Option<PackedMatrix>,
}

impl Weights {
    pub fn load(g: &Gguf, c: &ModelConfig) -> Result<Weights, GgufError> {
        let kv_dim = c.kv_heads * c.head_dim;
        let layers = (0..c.layers)
            .map(|i| {
                let n = |t: &str| format!("blk.{i}.{t}.weight");
                Ok(Layer {
                    attn_norm: g.vector(&n("attn_norm"), c.dim)?,
                    wq: pack(g, &n("attn_q"), c.dim, c.dim)?,
                    wk: pack(g, &n("attn_k"), kv_dim, c.dim)?,
                    wv: pack(g, &n("attn_v"), kv_dim, c.dim)?,
                    wo: pack(g, &n("attn_output"), c.dim, c.dim)?,
                    ffn_norm: g.vector(&n("ffn_norm"), c.dim)?,
                    w_gate: pack(g, &n("ffn_gate"), c.ffn_dim, c.dim)?,
                    w_up: pack(g, &n("ffn_up"), c.ffn_dim, c.dim)?,
                    w_down: pack(g, &n("ffn_down"), c.dim, c.ffn_dim)?,
                })
            })
            .collect::<Result<_, GgufError>>()?;
        let embed = pack(g, "token_embd.weight", c.vocab, c.dim)?;
        let output = match g.tensor_info("output.weight") {
            Ok(_) => Some(pack(g, "output.weight", c.vocab, c.dim)?),
            Err(_) => None,
        };
        Ok(Weights {
            embed,
            layers,
            out_norm: g.vector("output_norm.weight", c.dim)?,
            output,
        })
    }

    /// The LM head: `output.weight`, or the embedding when the head is tied to it.
    pub fn lm_head(&self) -> &PackedMatrix {
        self.output.as_ref().unwrap_or(&self.embed)
    }
}
