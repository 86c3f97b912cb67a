//! A small random-weight Llama model written as a real GGUF file, so tests exercise the whole
//! loading and forward path without the real model.

use std::path::Path;

use bulkhead_kernels::DType;
use bulkhead_kernels::quant::quantize_row;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::gguf::{GgufWriter, Value};
use crate::tokenizer::byte_level_char;

/// Shape and storage of a tiny model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TinySpec {
    pub layers: usize,
    pub dim: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub ffn_dim: usize,
    pub context_length: usize,
    /// How the attention and FFN matrices are stored.
    pub matrix_dtype: DType,
    /// How the embedding (tied LM head) is stored.
    pub embed_dtype: DType,
    /// `tokenizer.ggml.pre`.
    pub pre_tokenizer: &'static str,
    /// `general.architecture`, also the prefix of the shape keys.
    pub arch: &'static str,
    pub seed: u64,
    /// Ordinary tokens after the bytes' (`extra-token-00000000`, ...), for the size of a
    /// large vocabulary.
    pub extra_tokens: usize,
}

impl Default for TinySpec {
    fn default() -> TinySpec {
        TinySpec {
            layers: 2,
            dim: 64,
            heads: 4,
            kv_heads: 2,
            ffn_dim: 128,
            context_length: 256,
            matrix_dtype: DType::Q4_1,
            embed_dtype: DType::Q8_0,
            pre_tokenizer: "smollm",
            arch: "llama",
            seed: 7,
            extra_tokens: 0,
        }
    }
}

/// Control tokens, ids 0.. in this order; ordinary tokens (one per byte) follow.
pub const TINY_CONTROL: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

pub(crate) const CHAT_TEMPLATE: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

impl TinySpec {
    /// The GGUF file's bytes.
    pub fn to_gguf(&self) -> GgufWriter {
        let mut rng = StdRng::seed_from_u64(self.seed);
        let mut tokens: Vec<Value> = TINY_CONTROL
            .iter()
            .map(|s| Value::String((*s).into()))
            .collect();
        let mut types = vec![Value::I32(3); TINY_CONTROL.len()];
        for b in 0..=255u8 {
            tokens.push(Value::String(byte_level_char(b).to_string()));
            types.push(Value::I32(1));
        }
        for i in 0..self.extra_tokens {
            tokens.push(Value::String(format!("extra-token-{i:08}")));
            types.push(Value::I32(1));
        }
        let vocab = tokens.len();
        let mut w = GgufWriter::new();
        let a = |k: &str| format!("{}.{k}", self.arch);
        w.meta("general.architecture", Value::String(self.arch.into()))
            .meta("general.name", Value::String("tiny-random-llama".into()))
            .meta(&a("block_count"), Value::U32(self.layers as u32))
            .meta(&a("embedding_length"), Value::U32(self.dim as u32))
            .meta(&a("feed_forward_length"), Value::U32(self.ffn_dim as u32))
            .meta(&a("attention.head_count"), Value::U32(self.heads as u32))
            .meta(
                &a("attention.head_count_kv"),
                Value::U32(self.kv_heads as u32),
            )
            .meta(&a("context_length"), Value::U32(self.context_length as u32))
            .meta(&a("rope.freq_base"), Value::F32(10_000.0))
            .meta(&a("attention.layer_norm_rms_epsilon"), Value::F32(1e-5))
            .meta("tokenizer.ggml.model", Value::String("gpt2".into()))
            .meta(
                "tokenizer.ggml.pre",
                Value::String(self.pre_tokenizer.into()),
            )
            .meta("tokenizer.ggml.tokens", Value::Array(tokens))
            .meta("tokenizer.ggml.token_type", Value::Array(types))
            .meta("tokenizer.ggml.merges", Value::Array(Vec::new()))
            .meta("tokenizer.ggml.bos_token_id", Value::U32(1))
            .meta("tokenizer.ggml.eos_token_id", Value::U32(2))
            .meta(
                "tokenizer.chat_template",
                Value::String(CHAT_TEMPLATE.into()),
            );

        let mut matrix = |name: &str, rows: usize, cols: usize, dtype: DType, scale: f32| {
            let values: Vec<f32> = (0..rows * cols)
                .map(|_| rng.random_range(-scale..scale))
                .collect();
            let bytes = values
                .chunks(cols)
                .flat_map(|r| quantize_row(dtype, r))
                .collect();
            w.tensor(name, &[cols, rows], dtype, bytes);
        };
        let (d, kvd, f, md) = (
            self.dim,
            self.dim / self.heads * self.kv_heads,
            self.ffn_dim,
            self.matrix_dtype,
        );
        let s = 1.0 / (d as f32).sqrt();
        matrix("token_embd.weight", vocab, d, self.embed_dtype, 1.0);
        for l in 0..self.layers {
            let n = |t: &str| format!("blk.{l}.{t}.weight");
            matrix(&n("attn_q"), d, d, md, s * 2.0);
            matrix(&n("attn_k"), kvd, d, md, s * 2.0);
            matrix(&n("attn_v"), kvd, d, md, s);
            matrix(&n("attn_output"), d, d, md, s);
            matrix(&n("ffn_gate"), f, d, md, s);
            matrix(&n("ffn_up"), f, d, md, s);
            matrix(&n("ffn_down"), d, f, md, 1.0 / (f as f32).sqrt());
        }
        let ones = quantize_row(DType::F32, &vec![1.0; d]);
        for l in 0..self.layers {
            w.tensor(
                &format!("blk.{l}.attn_norm.weight"),
                &[d],
                DType::F32,
                ones.clone(),
            );
            w.tensor(
                &format!("blk.{l}.ffn_norm.weight"),
                &[d],
                DType::F32,
                ones.clone(),
            );
        }
        w.tensor("output_norm.weight", &[d], DType::F32, ones);
        w
    }

    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        self.to_gguf().write(path)
    }
}
