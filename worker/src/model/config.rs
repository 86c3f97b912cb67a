use bulkhead_kernels::quant::BLOCK;

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
        let ffn_dim = g.get_count(&key("feed_forward_length"))?;
        // The CPU kernels take activations in whole quantization blocks: a float (F16/F32)
        // weight of another width loads, then fails the first request.
        for (k, width) in [("embedding_length", dim), ("feed_forward_length", ffn_dim)] {
            if width % BLOCK != 0 {
                return Err(bad(k, format!("{width} is not a multiple of {BLOCK}")));
            }
        }
        let head_dim = dim / heads;
        if head_dim % 2 != 0 {
            return Err(bad(
                "attention.head_count",
                format!("head size {head_dim} is odd"),
            ));
        }
        // Of any other type than a count, it is refused, not read as absent: a partial rotary
        // model computed as a full one answers wrongly.
        match g.get_u64(&key("rope.dimension_count")) {
            Err(GgufError::MissingKey { .. }) => {}
            Ok(rope_dims) if rope_dims == head_dim as u64 => {}
            Ok(rope_dims) => {
                return Err(bad(
                    "rope.dimension_count",
                    format!("partial rotary ({rope_dims} of {head_dim}) is not supported"),
                ));
            }
            Err(e) => return Err(e),
        }
        match g.get_u64(&key("expert_count")) {
            Err(GgufError::MissingKey { .. }) | Ok(0) => {}
            Ok(experts) => {
                return Err(bad(
                    "expert_count",
                    format!("a mixture of {experts} experts is not supported"),
                ));
            }
            Err(e) => return Err(e),
        }
        let rope_base = match g.get_f32(&key("rope.freq_base")) {
            Err(GgufError::MissingKey { .. }) => 10_000.0,
            other => other?,
        };
        // A base of 1 or less (or NaN) makes every rotation frequency 1, infinite or NaN: the
        // model answers garbage, or NaN logits, with no error.
        if !(rope_base.is_finite() && rope_base > 1.0) {
            return Err(bad(
                "rope.freq_base",
                format!("{rope_base} is not a base above 1"),
            ));
        }
        // RoPE scaling (Llama 3.1's frequency factors, linear/YaRN scaling) changes every
        // position's rotation; refuse it rather than compute a subtly different model.
        if g.tensor_info("rope_freqs.weight").is_ok() {
            return Err(bad(
                "rope.scaling.type",
                "RoPE frequency factors (rope_freqs.weight) are not supported".into(),
            ));
        }
        let typed = match g.get_str(&key("rope.scaling.type")) {
            Err(GgufError::MissingKey { .. }) => false,
            Ok("none") => true,
            Ok(other) => {
                return Err(bad(
                    "rope.scaling.type",
                    format!("RoPE scaling {other:?} is not supported"),
                ));
            }
            Err(e) => return Err(e),
        };
        // A scaling factor without a type is linear scaling to llama.cpp (and the older
        // `rope.scale_linear` too): every position's angle divided by it. 1 (or 0, unset)
        // scales nothing; a type of "none" scales nothing whatever the factor says.
        let factors: &[&str] = if typed {
            &[]
        } else {
            &["rope.scaling.factor", "rope.scale_linear"]
        };
        for &name in factors {
            match g.get_f32(&key(name)) {
                Err(GgufError::MissingKey { .. }) => {}
                Ok(f) if f == 0.0 || f == 1.0 => {}
                Ok(f) => {
                    return Err(bad(name, format!("RoPE scaling by {f} is not supported")));
                }
                Err(e) => return Err(e),
            }
        }
        let vocab = g.get_strings("tokenizer.ggml.tokens")?.len();
        let rms_eps = g.get_f32(&key("attention.layer_norm_rms_epsilon"))?;
        // A NaN or negative epsilon divides every norm into NaN: text of nothing, no error.
        if !(rms_eps.is_finite() && rms_eps > 0.0) {
            return Err(bad(
                "attention.layer_norm_rms_epsilon",
                format!("{rms_eps} is not a small positive number"),
            ));
        }
        Ok(ModelConfig {
            name: g.get_str("general.name").unwrap_or(&arch).to_owned(),
            layers: g.get_count(&key("block_count"))?,
            ffn_dim,
            context_length: g.get_count(&key("context_length"))?,
            rms_eps,
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

#[cfg(test)]
mod tests {
    use crate::gguf::{Gguf, Value};
    use crate::tiny_model::TinySpec;

    use super::*;

    fn config_with(extra: Option<(&str, Value)>) -> Result<ModelConfig, GgufError> {
        config_with_all(extra.into_iter().collect())
    }

    fn config_with_all(extra: Vec<(&str, Value)>) -> Result<ModelConfig, GgufError> {
        let mut w = TinySpec::default().to_gguf();
        for (k, v) in extra {
            w.meta(k, v);
        }
        let path = std::env::temp_dir().join(format!(
            "bulkhead-cfg-{}-{}.gguf",
            std::process::id(),
            rand::random::<u32>()
        ));
        w.write(&path).expect("write");
        let g = Gguf::open(&path).expect("open");
        let _ = std::fs::remove_file(&path);
        ModelConfig::from_gguf(&g)
    }

    #[test]
    fn the_tiny_model_reads_its_shape() {
        let c = config_with(None).expect("valid");
        assert_eq!(
            (c.layers, c.dim, c.heads, c.kv_heads, c.head_dim, c.vocab),
            (2, 64, 4, 2, 16, 259)
        );
    }

    /// A rotary dimension of another type than a count is refused, not read as absent (a
    /// partial rotary model computed as a full one answers wrongly); so is a mixture of
    /// experts, by name.
    #[test]
    fn a_mistyped_rotary_dimension_or_experts_are_refused() {
        let e = config_with(Some(("llama.rope.dimension_count", Value::F32(8.0))))
            .expect_err("refused");
        assert!(matches!(e, GgufError::WrongType { .. }), "{e}");
        config_with(Some(("llama.rope.dimension_count", Value::U32(16)))).expect("the full head");
        config_with(Some(("llama.expert_count", Value::U32(0)))).expect("no experts");
        let e = config_with(Some(("llama.expert_count", Value::U32(8)))).expect_err("refused");
        assert!(e.to_string().contains("mixture of 8 experts"), "{e}");
    }

    #[test]
    fn an_epsilon_that_is_not_a_small_positive_number_is_refused() {
        for eps in [f32::NAN, f32::INFINITY, 0.0, -1e-5] {
            let err = config_with(Some((
                "llama.attention.layer_norm_rms_epsilon",
                Value::F32(eps),
            )))
            .expect_err("refused");
            assert!(
                matches!(&err, GgufError::BadValue { key, .. } if key.ends_with("layer_norm_rms_epsilon")),
                "{eps}: {err}"
            );
        }
    }

    #[test]
    fn a_rope_base_that_is_not_above_1_is_refused() {
        for base in [f32::NAN, f32::INFINITY, 0.0, -10_000.0, 1.0] {
            let err =
                config_with(Some(("llama.rope.freq_base", Value::F32(base)))).expect_err("refused");
            assert!(
                matches!(&err, GgufError::BadValue { key, .. } if key.ends_with("rope.freq_base")),
                "{base}: {err}"
            );
        }
        assert!(config_with(Some(("llama.rope.freq_base", Value::F32(500_000.0)))).is_ok());
    }

    #[test]
    fn a_width_that_is_not_whole_blocks_is_refused() {
        for (k, width) in [("embedding_length", 48), ("feed_forward_length", 100)] {
            let err =
                config_with(Some((&format!("llama.{k}"), Value::U32(width)))).expect_err("refused");
            assert!(
                matches!(&err, GgufError::BadValue { key, .. } if key.ends_with(k)),
                "{k} {width}: {err}"
            );
        }
    }

    #[test]
    fn rope_scaling_is_refused_by_name_not_computed_wrongly() {
        let err = config_with(Some((
            "llama.rope.scaling.type",
            Value::String("yarn".into()),
        )))
        .expect_err("unsupported");
        assert!(
            err.to_string().contains("llama.rope.scaling.type") && err.to_string().contains("yarn"),
            "{err}"
        );
        assert!(
            config_with(Some((
                "llama.rope.scaling.type",
                Value::String("none".into())
            )))
            .is_ok()
        );
        // A factor under a type of "none": not scaled, as llama.cpp takes it.
        assert!(
            config_with_all(vec![
                ("llama.rope.scaling.type", Value::String("none".into())),
                ("llama.rope.scaling.factor", Value::F32(4.0)),
            ])
            .is_ok()
        );
        // A factor without a type: linear scaling, to llama.cpp.
        for name in ["llama.rope.scaling.factor", "llama.rope.scale_linear"] {
            let err = config_with(Some((name, Value::F32(4.0)))).expect_err("scaled");
            assert!(err.to_string().contains(name), "{err}");
            assert!(
                config_with(Some((name, Value::F32(1.0)))).is_ok(),
                "{name} of 1"
            );
        }
    }

    #[test]
    fn other_architectures_are_refused_by_name() {
        let path = std::env::temp_dir().join(format!("bulkhead-arch-{}.gguf", std::process::id()));
        TinySpec {
            arch: "qwen2",
            ..TinySpec::default()
        }
        .write(&path)
        .expect("write");
        let g = Gguf::open(&path).expect("open");
        let _ = std::fs::remove_file(&path);
        let err = ModelConfig::from_gguf(&g).expect_err("qwen2 is not supported");
        assert!(
            err.to_string().contains("general.architecture") && err.to_string().contains("qwen2"),
            "{err}"
        );
    }
}
