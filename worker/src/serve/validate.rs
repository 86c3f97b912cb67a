//! Parse, don't validate: a wire `GenerateRequest` becomes a [`ValidGenerate`] here, in one
//! place, or a [`ValidationError`]. Only a `ValidGenerate` can become an engine `Request`.
//!
//! The engine still runs its own admission (empty prompt, token range, context length, queue):
//! checks are repeated at each layer on purpose.

use bulkhead_kvpool::{RequestId, Scope};

use crate::chat::{ChatTemplate, Message};
use crate::engine::{EventSink, Request};
use crate::sampling::SamplingParams;
use crate::tokenizer::{TokenId, Tokenizer};

use super::error::ValidationError;
use super::proto::{self, Prompt};

/// Longest `request_id` and `tenant` accepted (bytes).
pub const MAX_LABEL_BYTES: usize = 128;
/// Most stop sequences per request.
pub const MAX_STOPS: usize = 16;
/// Longest stop sequence (bytes).
pub const MAX_STOP_BYTES: usize = 256;
/// Longest `cache_salt` (bytes).
pub const MAX_SALT_BYTES: usize = 256;

/// What turns text into prompt tokens: the served model's tokenizer and chat template.
#[derive(Debug)]
pub struct Prompter {
    pub tokenizer: Tokenizer,
    /// Why chat prompts are refused, when the model has no usable template.
    pub chat: Result<ChatTemplate, String>,
}

/// A generation request that passed every check this layer makes.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidGenerate {
    /// The caller's label, for logs; at most [`MAX_LABEL_BYTES`].
    pub caller_id: String,
    /// The scope of its prefix cache, and a label in logs; at most [`MAX_LABEL_BYTES`].
    pub tenant: String,
    pub prompt: Vec<TokenId>,
    pub max_new_tokens: usize,
    /// Validated (`SamplingParams::validate`).
    pub sampling: SamplingParams,
    /// At most [`MAX_STOPS`], each 1..=[`MAX_STOP_BYTES`] bytes.
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// At most [`MAX_SALT_BYTES`]; empty: none. Splits the tenant's prefix cache.
    pub cache_salt: String,
}

impl ValidGenerate {
    /// Checks `req` and tokenizes its prompt. `random_seed` supplies a seed when none is given.
    pub fn parse(
        req: proto::GenerateRequest,
        prompts: &impl PromptSource,
        random_seed: impl FnOnce() -> u64,
    ) -> Result<ValidGenerate, ValidationError> {
        label("request_id", &req.request_id)?;
        label("tenant", &req.tenant)?;
        salt(&req.cache_salt)?;
        if req.stop.len() > MAX_STOPS {
            return Err(ValidationError::TooManyStops {
                count: req.stop.len(),
                limit: MAX_STOPS,
            });
        }
        for s in &req.stop {
            if s.is_empty() {
                return Err(ValidationError::EmptyStop);
            }
            if s.len() > MAX_STOP_BYTES {
                return Err(ValidationError::FieldTooLong {
                    field: "stop",
                    len: s.len(),
                    limit: MAX_STOP_BYTES,
                });
            }
        }
        let sampling = sampling(req.sampling, random_seed)?;
        let prompt = match req.prompt.ok_or(ValidationError::MissingPrompt)? {
            Prompt::Tokens(t) => t.ids,
            Prompt::Text(text) => prompts.text(&text)?,
            Prompt::Chat(chat) => {
                if chat.messages.is_empty() {
                    return Err(ValidationError::EmptyChat);
                }
                let messages: Vec<Message> = chat
                    .messages
                    .into_iter()
                    .map(|m| Message {
                        role: m.role,
                        content: m.content,
                    })
                    .collect();
                prompts.chat(&messages)?
            }
        };
        Ok(ValidGenerate {
            caller_id: req.request_id,
            tenant: req.tenant,
            prompt,
            max_new_tokens: req.max_new_tokens as usize,
            sampling,
            stop: req.stop,
            ignore_eos: req.ignore_eos,
            cache_salt: req.cache_salt,
        })
    }

    /// The engine request, under the worker-internal `id`.
    pub fn into_request(self, id: RequestId, sink: Box<dyn EventSink>) -> Request {
        Request {
            id,
            tenant: Scope::salted(&self.tenant, &self.cache_salt),
            prompt: self.prompt,
            max_new_tokens: self.max_new_tokens,
            sampling: self.sampling,
            stop: self.stop,
            ignore_eos: self.ignore_eos,
            sink,
        }
    }
}

/// The wire sampling settings, validated; greedy when absent. `random_seed` supplies a seed
/// when none is given.
pub fn sampling(
    wire: Option<proto::SamplingParams>,
    random_seed: impl FnOnce() -> u64,
) -> Result<SamplingParams, crate::sampling::SamplingError> {
    match wire {
        None => SamplingParams::GREEDY,
        Some(s) => SamplingParams {
            temperature: s.temperature,
            top_k: s.top_k.map(|k| k as usize),
            top_p: s.top_p.unwrap_or(1.0),
            seed: s.seed.unwrap_or_else(random_seed),
        },
    }
    .validate()
}

/// Turns prompt text into tokens (a seam for tests).
pub trait PromptSource {
    /// Raw text; control-token text in it stays plain text.
    fn text(&self, text: &str) -> Result<Vec<TokenId>, ValidationError>;
    /// Chat messages through the chat template, with the assistant's turn opened.
    fn chat(&self, messages: &[Message]) -> Result<Vec<TokenId>, ValidationError>;
}

impl PromptSource for Prompter {
    fn text(&self, text: &str) -> Result<Vec<TokenId>, ValidationError> {
        self.tokenizer
            .encode_prompt(text)
            .map_err(|e| ValidationError::Tokenize {
                reason: e.to_string(),
            })
    }

    fn chat(&self, messages: &[Message]) -> Result<Vec<TokenId>, ValidationError> {
        let template = self
            .chat
            .as_ref()
            .map_err(|reason| ValidationError::ChatUnavailable {
                reason: reason.clone(),
            })?;
        template
            .encode(&self.tokenizer, messages, true)
            .map_err(|e| {
                // Unavailable: the sandbox logged why.
                if e.transient() {
                    return ValidationError::ChatSandbox;
                }
                ValidationError::ChatRender {
                    reason: e.to_string(),
                }
            })
    }
}

/// A caller's label (`request_id`, `tenant`): for logs, spans and the prefix cache's scope, so
/// at most [`MAX_LABEL_BYTES`].
pub fn label(field: &'static str, value: &str) -> Result<(), ValidationError> {
    at_most(field, value, MAX_LABEL_BYTES)
}

/// Checks a request's `cache_salt`: at most [`MAX_SALT_BYTES`].
pub fn salt(value: &str) -> Result<(), ValidationError> {
    at_most("cache_salt", value, MAX_SALT_BYTES)
}

/// `value` of `field` is at most `limit` bytes.
fn at_most(field: &'static str, value: &str, limit: usize) -> Result<(), ValidationError> {
    if value.len() > limit {
        return Err(ValidationError::FieldTooLong {
            field,
            len: value.len(),
            limit,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::SamplingError;

    /// Bytes as tokens; chat renders `role: content` lines.
    struct Bytes;

    impl PromptSource for Bytes {
        fn text(&self, text: &str) -> Result<Vec<TokenId>, ValidationError> {
            Ok(text.bytes().map(TokenId::from).collect())
        }
        fn chat(&self, messages: &[Message]) -> Result<Vec<TokenId>, ValidationError> {
            let text: String = messages
                .iter()
                .map(|m| format!("{}: {}\n", m.role, m.content))
                .collect();
            self.text(&text)
        }
    }

    fn request(prompt: Prompt) -> proto::GenerateRequest {
        proto::GenerateRequest {
            request_id: "r1".into(),
            tenant: "acme".into(),
            prompt: Some(prompt),
            max_new_tokens: 8,
            sampling: None,
            stop: Vec::new(),
            ignore_eos: false,
            cache_salt: String::new(),
            instance_id: String::new(),
        }
    }

    fn parse(req: proto::GenerateRequest) -> Result<ValidGenerate, ValidationError> {
        ValidGenerate::parse(req, &Bytes, || 42)
    }

    #[test]
    fn token_prompts_pass_through_and_sampling_defaults_to_greedy() {
        let v = parse(request(Prompt::Tokens(proto::TokenPrompt {
            ids: vec![5, 6],
        })));
        let v = v.expect("valid");
        assert_eq!(v.prompt, vec![5, 6]);
        assert_eq!(v.sampling, SamplingParams::GREEDY);
        assert_eq!(v.max_new_tokens, 8);
    }

    /// The engine's prefix-cache scope is the tenant and its salt: requests of one tenant with
    /// another salt (or none) share no cached pages (the colocated and decode paths; prefill's
    /// scopes its own the same way).
    #[test]
    fn a_requests_cache_scope_is_its_tenant_and_salt() {
        let scope = |salt: &str| {
            let mut r = request(Prompt::Tokens(proto::TokenPrompt { ids: vec![5] }));
            r.cache_salt = salt.into();
            let (tx, _rx) = std::sync::mpsc::channel();
            parse(r)
                .expect("valid")
                .into_request(RequestId::new(1), Box::new(tx))
                .tenant
        };
        assert_eq!(scope("s1"), Scope::salted("acme", "s1"));
        assert_ne!(scope("s1"), scope("s2"));
        assert_ne!(scope("s1"), scope(""));
        assert_eq!(scope(""), Scope::new("acme"));
    }

    #[test]
    fn text_and_chat_prompts_are_tokenized() {
        let v = parse(request(Prompt::Text("hi".into()))).expect("valid");
        assert_eq!(v.prompt, vec![104, 105]);
        let chat = Prompt::Chat(proto::ChatPrompt {
            messages: vec![proto::ChatMessage {
                role: "u".into(),
                content: "x".into(),
            }],
        });
        let v = parse(request(chat)).expect("valid");
        assert_eq!(v.prompt, b"u: x\n".map(TokenId::from).to_vec());
    }

    #[test]
    fn a_missing_prompt_or_empty_chat_is_refused() {
        let mut r = request(Prompt::Text("x".into()));
        r.prompt = None;
        assert_eq!(parse(r), Err(ValidationError::MissingPrompt));
        let r = request(Prompt::Chat(proto::ChatPrompt::default()));
        assert_eq!(parse(r), Err(ValidationError::EmptyChat));
    }

    #[test]
    fn sampling_is_validated_and_a_missing_seed_is_drawn() {
        let mut r = request(Prompt::Text("x".into()));
        r.sampling = Some(proto::SamplingParams {
            temperature: 0.7,
            top_k: None,
            top_p: None,
            seed: None,
        });
        let v = parse(r.clone()).expect("valid");
        assert_eq!(v.sampling.seed, 42);
        assert_eq!(v.sampling.top_p, 1.0);
        r.sampling = Some(proto::SamplingParams {
            temperature: 0.7,
            top_k: Some(0),
            top_p: None,
            seed: Some(1),
        });
        assert_eq!(
            parse(r.clone()),
            Err(ValidationError::Sampling(SamplingError::TopK))
        );
        r.sampling = Some(proto::SamplingParams {
            temperature: f32::NAN,
            top_k: None,
            top_p: None,
            seed: Some(1),
        });
        assert!(matches!(
            parse(r),
            Err(ValidationError::Sampling(SamplingError::Temperature(_)))
        ));
    }

    #[test]
    fn labels_and_stops_are_bounded() {
        let mut r = request(Prompt::Text("x".into()));
        r.cache_salt = "s".repeat(MAX_SALT_BYTES + 1);
        assert!(matches!(
            parse(r),
            Err(ValidationError::FieldTooLong {
                field: "cache_salt",
                ..
            })
        ));
        let mut r = request(Prompt::Text("x".into()));
        r.tenant = "t".repeat(MAX_LABEL_BYTES + 1);
        assert!(matches!(
            parse(r),
            Err(ValidationError::FieldTooLong {
                field: "tenant",
                ..
            })
        ));
        let mut r = request(Prompt::Text("x".into()));
        r.stop = vec!["s".into(); MAX_STOPS + 1];
        assert!(matches!(
            parse(r),
            Err(ValidationError::TooManyStops { .. })
        ));
        let mut r = request(Prompt::Text("x".into()));
        r.stop = vec![String::new()];
        assert_eq!(parse(r), Err(ValidationError::EmptyStop));
    }
}
