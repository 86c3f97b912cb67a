//! Facts about the served model that callers (the gateway) fetch once: identity, tokenizer,
//! chat template and the measured limits.

use std::path::Path;

use bulkhead_kernels::attention::{KvLayout, TagCheck};

use crate::engine::{Capacity, Engine};
use crate::gguf::Gguf;
use crate::model::Model;
use crate::tokenizer::Tokenizer;

use super::proto;

/// The Info response (without the tokenizer) for `model`, before the pool is measured.
pub fn describe(
    model: &Model,
    tokenizer: &Tokenizer,
    chat_template: &str,
    model_id: String,
    role: proto::Role,
) -> proto::InfoResponse {
    let config = model.config();
    proto::InfoResponse {
        model_id,
        model_name: config.name.clone(),
        architecture: config.arch.clone(),
        vocab_size: u32::try_from(tokenizer.vocab_size()).unwrap_or(u32::MAX),
        bos_token_id: tokenizer.bos(),
        eos_token_id: tokenizer.eos(),
        chat_template: chat_template.to_owned(),
        model_context_length: config.context_length as u64,
        role: role.into(),
        instance_id: format!("{:032x}", rand::random::<u128>()),
        ..proto::InfoResponse::default()
    }
}

/// The Info (identity, special tokens, chat template) and tokenizer of a GGUF file, read
/// without loading its weights: for a gateway that fronts a server of the same model over
/// another protocol and tokenizes itself.
pub fn describe_file(path: &Path) -> Result<(proto::InfoResponse, proto::TokenizerData), String> {
    let shown = path.display();
    let g = Gguf::open(path).map_err(|e| format!("{shown}: {e}"))?;
    let tokenizer = Tokenizer::from_gguf(&g).map_err(|e| format!("{shown}: {e}"))?;
    let name = g.get_str("general.name").unwrap_or("model").to_owned();
    let model_id = model_id(&name, &g);
    let info = proto::InfoResponse {
        model_id,
        model_name: name,
        architecture: g.get_str("general.architecture").unwrap_or("").to_owned(),
        vocab_size: u32::try_from(tokenizer.vocab_size()).unwrap_or(u32::MAX),
        bos_token_id: tokenizer.bos(),
        eos_token_id: tokenizer.eos(),
        chat_template: g
            .get_str("tokenizer.chat_template")
            .unwrap_or("")
            .to_owned(),
        ..proto::InfoResponse::default()
    };
    Ok((info, tokenizer_data(&g)))
}

/// Fills in the measured limits.
pub fn set_capacity(info: &mut proto::InfoResponse, capacity: Capacity) {
    info.context_length = capacity.served_context as u64;
    info.model_context_length = capacity.model_context as u64;
    info.pool_tokens = capacity.pool_tokens;
    info.pool_pages = capacity.pool_pages;
    info.page_tokens = capacity.page_tokens;
    info.page_bytes = capacity.page_bytes;
}

/// Fills in how this worker takes part in KV handoffs. `batch_bytes` is set on prefill
/// workers only.
pub fn set_handoff(
    info: &mut proto::InfoResponse,
    engine: &Engine,
    layout: &KvLayout,
    batch_bytes: Option<usize>,
) {
    let config = engine.config();
    info.handoff = Some(proto::KvHandoff {
        protocol_version: u32::from(bulkhead_handoff::codec::VERSION),
        token_bytes: layout.token_bytes() as u64,
        layers: layout.layers as u32,
        kv_heads: layout.kv_heads as u32,
        head_dim: layout.head_dim as u32,
        tag_check: engine.tag_check() == TagCheck::On,
        // Every transfer is verified (only a test build can turn that off) and every abandoned
        // one drained.
        checksums: bulkhead_checks::enabled(bulkhead_checks::Check::HandoffVerification),
        deferred_release: true,
        transfer_batch_bytes: batch_bytes.map_or(0, |b| b as u64),
        transfer_floor_bytes_per_s: config.transfer_floor_bytes_per_s,
        release_timeout_ms: u64::try_from(config.release_timeout.as_millis()).unwrap_or(u64::MAX),
    });
}

/// `name-SIZE-HASH`: the model's name, the file's size and an FNV-1a hash of everything
/// before its tensor data (the GGUF header, every metadata value, the tensor infos), so a
/// file with another tokenizer or chat template gets another id, without hashing the weights
/// at startup. (A MiB of it left out what lies past the vocabulary: two files of one size
/// that differed only in their chat template had one id, and a gateway tokenized with one
/// for a worker serving the other.)
pub fn model_id(name: &str, g: &Gguf) -> String {
    format!("{name}-{}-{:016x}", g.file_len(), fnv1a(g.header()))
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The tokenizer metadata, enough to rebuild the tokenizer elsewhere. Keys that are missing
/// come out empty (the worker's own tokenizer already loaded, so the required ones exist).
pub fn tokenizer_data(g: &Gguf) -> proto::TokenizerData {
    let strings = |key: &str| {
        g.get_strings(key)
            .map(|v| v.into_iter().map(str::to_owned).collect())
            .unwrap_or_default()
    };
    let string = |key: &str| g.get_str(key).map(str::to_owned).unwrap_or_default();
    proto::TokenizerData {
        model: string("tokenizer.ggml.model"),
        pre: string("tokenizer.ggml.pre"),
        tokens: strings("tokenizer.ggml.tokens"),
        merges: strings("tokenizer.ggml.merges"),
        token_types: g
            .get("tokenizer.ggml.token_type")
            .ok()
            .and_then(|v| v.as_array())
            .map(|a| {
                a.iter()
                    .map(|t| t.as_u64().and_then(|t| i32::try_from(t).ok()).unwrap_or(1))
                    .collect()
            })
            .unwrap_or_default(),
        add_bos: crate::tokenizer::add_bos(g).unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The id covers the whole header: two files of one size that differ only in their chat
    /// template, which lies past the first MiB behind a large vocabulary, are two models.
    #[test]
    fn files_that_differ_only_past_the_first_mib_of_their_header_get_different_ids() {
        let dir = std::env::temp_dir().join(format!(
            "bulkhead-model-id-{}-{}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&dir).expect("a scratch directory");
        let spec = crate::tiny_model::TinySpec {
            extra_tokens: 60_000,
            ..crate::tiny_model::TinySpec::default()
        };
        let (a, b) = (dir.join("a.gguf"), dir.join("b.gguf"));
        spec.write(&a).expect("writes");
        let mut bytes = std::fs::read(&a).expect("reads");
        let template = crate::tiny_model::CHAT_TEMPLATE.as_bytes();
        let at = bytes
            .windows(template.len())
            .position(|w| w == template)
            .expect("the template is in the file");
        assert!(at > 1 << 20, "past the first MiB: {at}");
        let last = at + template.len() - 1;
        bytes[last] = if bytes[last] == b'x' { b'y' } else { b'x' };
        std::fs::write(&b, &bytes).expect("writes");
        let id = |p: &Path| model_id("m", &Gguf::open(p).expect("opens"));
        assert_ne!(id(&a), id(&b));
        assert_eq!(id(&a), id(&a), "and one file, one id");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn fnv1a_matches_the_reference_vectors() {
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}
