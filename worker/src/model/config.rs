use crate::gguf::{Gguf, GgufError};

/// Rotary embedding pairing: which values of a head rotate together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// `(x[2i], x[2i+1])`: Llama checkpoints as GGUF stores them (Q/K rows permuted).
    Interleaved,
}

/// The shape of a Llama-family model, read from GGUF metadata and checked for consistency.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// `general.architecture`, e.g. `llama`.
    pub arch: String,
    /// `general.name`, or the architecture when absent.
    pub name: String,
    pub layers: usize,
    /// Embedding width; `heads * head_dim`.
    pub dim: usize,
    pub ffn_dim: usize,
    pub heads: usize,
    /// Divides `heads` (grouped-query attention).
    pub kv_heads: usize,
    /// Even, and a multiple of 32 is not required (attention is float).
    pub head_dim: usize,
    pub vocab: usize,
    pub context_length: usize,
    pub rope_base: f32,
    pub rope_style: RopeStyle,
    pub rms_eps: f32,
}

/// Architectures that share the Llama block and tensor names.
const SUPPORTED: [&str; 1] = ["llama"];

impl ModelConfig {
    pub fn from_gguf(g: &Gguf) -> Result<ModelConfig, GgufError> {
        let arch = g.get_str("general.architecture")?.to_owned();
        if !SUPPORTED.contains(&arch.as_str()) {
            return Err(GgufError::BadValue {
                key: "general.architecture".into(),
                reason: format!("{arch:?} is not supported (supported: {SUPPORTED:?})"),
            });
        }
        let key = |k: &str| format!("{arch}.{k}");
        let dim = g.get_count(&key("embedding_length"))?;
        let heads = g.get_count(&key("attention.head_count"))?;
        let kv_heads = match g.get_count(&key("attention.head_count_kv")) {
            Err(GgufError::MissingKey { .. }) => heads,
            other => other?,
        };
        let bad = |k: &str, reason: String| GgufError::BadValue {
            key: key(k),
            reason,
        };
        if dim % heads != 0 {
            return Err(bad(
                "attention.head_count",
                format!("{heads} does not divide embedding_length {dim}"),
            ));
        }
        if heads % kv_heads != 0 {
            return Err(bad(
                "attention.head_count_kv",
                format!("{kv_heads} does not divide head_count {heads}"),
            ));
        }
        let head_dim = dim / heads;
        if head_dim % 2 != 0 {
            return Err(bad(
                "attention.head_count",
                format!("head size {head_dim} is odd"),
            ));
        }
        if let Ok(rope_dims) = g.get_u64(&key("rope.dimension_count"))
            && rope_dims != head_dim as u64
        {
            return Err(bad(
                "rope.dimension_count",
                format!("partial rotary ({rope_dims} of {head_dim}) is not supported"),
            ));
        }
        let rope_base = match g.get_f32(&key("rope.freq_base")) {
            Err(GgufError::MissingKey { .. }) => 10_000.0,
            other => other?,
        };
        let vocab = g.get_strings("tokenizer.ggml.tokens")?.len();
        Ok(ModelConfig {
            name: g.get_str("general.name").unwrap_or(&arch).to_owned(),
            layers: g.get_count(&key("block_count"))?,
            ffn_dim: g.get_count(&key("feed_forward_length"))?,
            context_length: g.get_count(&key("context_length"))?,
            rms_eps: g.get_f32(&key("attention.layer_norm_rms_epsilon"))?,
            rope_style: RopeStyle::Interleaved,
            arch,
            dim,
            heads,
            kv_heads,
            head_dim,
            vocab,
            rope_base,
        })
    }
}
