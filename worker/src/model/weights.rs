//! The model's weights, packed once at load for the CPU kernels that read them
//! ([`PackedMatrix`]). Once a matrix is packed, its pages of the mapped file are handed back
//! to the kernel, so the file's bytes and the packed copy are never resident together.
//!
//! Each matrix also keeps where it lies in the file ([`MatDesc`]): the CUDA kernels read the
//! GGUF block layout, not the packed one, so `Model::to_device` uploads from the file (a
//! released range faults back in from the file) and releases the range again.

use std::ops::Range;

use bulkhead_kernels::{DType, PackedMatrix, QMatrix, ShapeError};

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
    /// The matrix over the file's bytes (in GGUF block layout). Cannot fail for the file it
    /// was loaded from.
    pub(super) fn bind<'a>(&self, g: &'a Gguf) -> Result<QMatrix<'a>, ShapeError> {
        QMatrix::new(
            self.dtype,
            self.rows,
            self.cols,
            g.bytes(self.bytes.clone()),
        )
    }

    /// Hands the matrix's pages of the mapped file back to the kernel (see [`Gguf::release`]).
    pub(super) fn release(&self, g: &Gguf) {
        g.release(self.bytes.clone());
    }
}

/// A weight matrix: packed for the CPU, and where it lies in the file.
#[derive(Debug)]
pub(super) struct Mat {
    pub packed: PackedMatrix,
    pub file: MatDesc,
}

impl std::ops::Deref for Mat {
    type Target = PackedMatrix;

    fn deref(&self) -> &PackedMatrix {
        &self.packed
    }
}

/// Tensor `name` (`rows × cols`) packed for the kernels; its file pages are released.
fn pack(g: &Gguf, name: &str, rows: usize, cols: usize) -> Result<Mat, GgufError> {
    let m = g.matrix(name, rows, cols)?;
    let file = MatDesc {
        dtype: m.dtype(),
        rows,
        cols,
        bytes: g.tensor_range(name)?,
    };
    let packed = PackedMatrix::pack(&m);
    file.release(g);
    Ok(Mat { packed, file })
}

/// One transformer block's weights.
#[derive(Debug)]
pub(super) struct Layer {
    pub attn_norm: Vec<f32>,
    pub wq: Mat,
    pub wk: Mat,
    pub wv: Mat,
    pub wo: Mat,
    pub ffn_norm: Vec<f32>,
    pub w_gate: Mat,
    pub w_up: Mat,
    pub w_down: Mat,
}

/// All weights of a Llama-family model.
#[derive(Debug)]
pub(super) struct Weights {
    pub embed: Mat,
    pub layers: Vec<Layer>,
    pub out_norm: Vec<f32>,
    /// `output.weight`; `None` when the head is tied to the embedding.
    output: Option<Mat>,
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
    pub fn lm_head(&self) -> &Mat {
        self.output.as_ref().unwrap_or(&self.embed)
    }
}
