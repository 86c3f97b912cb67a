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

/// The tensors of layer `i`, in the order [`Layer`] holds them.
fn layer_tensors(i: usize) -> [String; 9] {
    [
        "attn_norm",
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "ffn_norm",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
    ]
    .map(|t| format!("blk.{i}.{t}.weight"))
}

const EMBEDDING: &str = "token_embd.weight";
const OUTPUT_NORM: &str = "output_norm.weight";
const OUTPUT: &str = "output.weight";

/// Refuses a file with tensors a model of `c` does not compute with (llama.cpp refuses them
/// too): biases, more layers than `block_count` says, a mixture of experts. Loaded without
/// them, the model would answer, wrongly.
fn all_used(g: &Gguf, c: &ModelConfig) -> Result<(), GgufError> {
    let mut used: std::collections::HashSet<String> =
        (0..c.layers).flat_map(layer_tensors).collect();
    used.extend([EMBEDDING, OUTPUT_NORM, OUTPUT].map(String::from));
    let mut names: Vec<String> = g
        .tensors()
        .keys()
        .filter(|name| !used.contains(*name))
        .cloned()
        .collect();
    if names.is_empty() {
        return Ok(());
    }
    names.sort_unstable();
    let count = names.len();
    names.truncate(4);
    Err(GgufError::UnusedTensors { count, names })
}

impl Weights {
    pub fn load(g: &Gguf, c: &ModelConfig) -> Result<Weights, GgufError> {
        all_used(g, c)?;
        let kv_dim = c.kv_heads * c.head_dim;
        let layers = (0..c.layers)
            .map(|i| {
                let [attn_norm, wq, wk, wv, wo, ffn_norm, w_gate, w_up, w_down] = layer_tensors(i);
                Ok(Layer {
                    attn_norm: g.vector(&attn_norm, c.dim)?,
                    wq: pack(g, &wq, c.dim, c.dim)?,
                    wk: pack(g, &wk, kv_dim, c.dim)?,
                    wv: pack(g, &wv, kv_dim, c.dim)?,
                    wo: pack(g, &wo, c.dim, c.dim)?,
                    ffn_norm: g.vector(&ffn_norm, c.dim)?,
                    w_gate: pack(g, &w_gate, c.ffn_dim, c.dim)?,
                    w_up: pack(g, &w_up, c.ffn_dim, c.dim)?,
                    w_down: pack(g, &w_down, c.dim, c.ffn_dim)?,
                })
            })
            .collect::<Result<_, GgufError>>()?;
        let embed = pack(g, EMBEDDING, c.vocab, c.dim)?;
        let output = match g.tensor_info(OUTPUT) {
            Ok(_) => Some(pack(g, OUTPUT, c.vocab, c.dim)?),
            Err(_) => None,
        };
        Ok(Weights {
            embed,
            layers,
            out_norm: g.vector(OUTPUT_NORM, c.dim)?,
            output,
        })
    }

    /// The LM head: `output.weight`, or the embedding when the head is tied to it.
    pub fn lm_head(&self) -> &Mat {
        self.output.as_ref().unwrap_or(&self.embed)
    }
}

#[cfg(test)]
mod tests {
    use bulkhead_kernels::quant::quantize_row;

    use super::*;
    use crate::gguf::Value;
    use crate::model::Model;
    use crate::tiny_model::TinySpec;

    /// A tensor the model would not compute with — a bias, a layer past `block_count` — fails
    /// the load and is named: left out, the model loaded and answered wrongly.
    #[test]
    fn a_tensor_the_model_leaves_out_is_refused() {
        let mut w = TinySpec::default().to_gguf();
        Model::from_gguf(w.opened().expect("opens")).expect("the tiny model loads");
        w.tensor(
            "blk.0.attn_q.bias",
            &[64],
            DType::F32,
            quantize_row(DType::F32, &[0.0; 64]),
        );
        let e = Model::from_gguf(w.opened().expect("opens")).expect_err("refused");
        assert!(
            matches!(&e, GgufError::UnusedTensors { count: 1, names } if names == &["blk.0.attn_q.bias"]),
            "{e}"
        );

        let mut w = TinySpec::default().to_gguf();
        w.meta("llama.block_count", Value::U32(1));
        let e = Model::from_gguf(w.opened().expect("opens")).expect_err("refused");
        assert!(
            matches!(&e, GgufError::UnusedTensors { count: 9, names } if names[0].starts_with("blk.1.")),
            "{e}"
        );
    }
}
