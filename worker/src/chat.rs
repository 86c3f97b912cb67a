//! Chat templates: the model's own `tokenizer.chat_template` (Jinja), rendered with minijinja.

use minijinja::{Environment, ErrorKind, context};
use serde::{Deserialize, Serialize};

use crate::gguf::Gguf;

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Message {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// Why a chat template cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("the model has no chat template (tokenizer.chat_template)")]
    NoTemplate,
    #[error("the chat template does not compile: {0}")]
    Compile(String),
    #[error("the chat template failed on these messages: {0}")]
    Render(String),
}

/// A compiled chat template.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos: String,
    eos: String,
}

const NAME: &str = "chat";

impl ChatTemplate {
    /// The template of the model in `g`, with its BOS/EOS token texts available to it.
    pub fn from_gguf(g: &Gguf) -> Result<ChatTemplate, ChatError> {
        let source = g
            .get_str("tokenizer.chat_template")
            .map_err(|_| ChatError::NoTemplate)?;
        let tokens = g.get_strings("tokenizer.ggml.tokens").unwrap_or_default();
        let text = |key: &str| {
            g.get_u64(key)
                .ok()
                .and_then(|i| tokens.get(i as usize))
                .map(|s| (*s).to_owned())
                .unwrap_or_default()
        };
        ChatTemplate::new(
            source,
            text("tokenizer.ggml.bos_token_id"),
            text("tokenizer.ggml.eos_token_id"),
        )
    }

    pub fn new(source: &str, bos: String, eos: String) -> Result<ChatTemplate, ChatError> {
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_template_owned(NAME, source.to_owned())
            .map_err(|e| ChatError::Compile(e.to_string()))?;
        Ok(ChatTemplate {
            env,
            source: source.to_owned(),
            bos,
            eos,
        })
    }

    /// The template's Jinja source (workers hand it to the gateway).
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders `messages`, ending with the assistant's turn opened when `add_generation_prompt`.
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        let tmpl = self
            .env
            .get_template(NAME)
            .map_err(|e| ChatError::Compile(e.to_string()))?;
        tmpl.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos,
            eos_token => self.eos,
        })
        .map_err(|e| ChatError::Render(e.to_string()))
    }
}
