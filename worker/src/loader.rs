//! Opening a model file: the weights, the tokenizer and the chat template from one GGUF.

use std::path::Path;

use crate::chat::{ChatError, ChatTemplate};
use crate::gguf::GgufError;
use crate::model::Model;
use crate::tokenizer::{Tokenizer, TokenizerError};

/// Why a model could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    // The cause is in the message, not a `source`: a report would print it twice.
    #[error("model {path}: {error}")]
    Gguf { path: String, error: GgufError },
    #[error("model {path}: tokenizer: {error}")]
    Tokenizer { path: String, error: TokenizerError },
    #[error("model {path}: vocabulary has {tokenizer} tokens but the weights have {model} rows")]
    VocabMismatch {
        path: String,
        tokenizer: usize,
        model: usize,
    },
}

/// A model ready to serve.
#[derive(Debug)]
pub struct LoadedModel {
    pub model: Model,
    pub tokenizer: Tokenizer,
    /// `None` when the file has no chat template (chat requests are then refused).
    pub chat: Result<ChatTemplate, ChatError>,
}

impl LoadedModel {
    pub fn open(path: &Path) -> Result<LoadedModel, LoadError> {
        let p = || path.display().to_string();
        let model = Model::open(path).map_err(|error| LoadError::Gguf { path: p(), error })?;
        let tokenizer = Tokenizer::from_gguf(model.gguf())
            .map_err(|error| LoadError::Tokenizer { path: p(), error })?;
        if tokenizer.vocab_size() != model.config().vocab {
            return Err(LoadError::VocabMismatch {
                path: p(),
                tokenizer: tokenizer.vocab_size(),
                model: model.config().vocab,
            });
        }
        let chat = ChatTemplate::from_gguf(model.gguf());
        Ok(LoadedModel {
            model,
            tokenizer,
            chat,
        })
    }
}
