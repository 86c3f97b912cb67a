//! The bodies of OpenAI's completion responses, serialized straight from borrowed fields: a
//! whole response, a streamed chunk, the closing usage chunk.

use bulkhead_worker::serve::proto::Done;
use serde::{Serialize, Serializer};

use super::Endpoint;

/// The fields every response and chunk starts with.
#[derive(Debug, Clone, Copy)]
pub struct Head<'a> {
    pub endpoint: Endpoint,
    pub id: &'a str,
    pub created: u64,
    pub model: &'a str,
}

#[derive(Serialize)]
struct Body<'a, C> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: C,
    #[serde(skip_serializing_if = "UsageField::is_absent")]
    usage: UsageField,
}

/// A body's `usage`: absent, `null` (a chunk of a stream that asked for usage), or counts.
enum UsageField {
    Absent,
    Null,
    Counts(Usage),
}

impl UsageField {
    fn is_absent(&self) -> bool {
        matches!(self, UsageField::Absent)
    }
}

impl Serialize for UsageField {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            UsageField::Absent | UsageField::Null => s.serialize_unit(),
            UsageField::Counts(u) => u.serialize(s),
        }
    }
}

#[derive(Serialize)]
struct Usage {
    prompt_tokens: u32,
    completion_tokens: u32,
    total_tokens: u32,
    prompt_tokens_details: PromptTokensDetails,
}

/// OpenAI's breakdown of the prompt tokens: those read from a prompt cache (here, the
/// tenant's own prefix cache).
#[derive(Serialize)]
struct PromptTokensDetails {
    cached_tokens: u32,
}

impl Usage {
    fn of(d: &Done) -> Usage {
        Usage {
            prompt_tokens: d.prompt_tokens,
            completion_tokens: d.completion_tokens,
            total_tokens: d.prompt_tokens.saturating_add(d.completion_tokens),
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: d.cached_tokens,
            },
        }
    }
}

/// `logprobs` is always `null` (`()` serializes as `null`).
#[derive(Serialize)]
struct MessageChoice<'a> {
    index: u32,
    message: Message<'a>,
    logprobs: (),
    finish_reason: &'a str,
}

#[derive(Serialize)]
struct Message<'a> {
    role: &'static str,
    content: &'a str,
}

#[derive(Serialize)]
struct TextChoice<'a> {
    index: u32,
    text: &'a str,
    logprobs: (),
    finish_reason: Option<&'a str>,
}

impl<'a> TextChoice<'a> {
    fn new(text: &'a str, finish_reason: Option<&'a str>) -> TextChoice<'a> {
        TextChoice {
            index: 0,
            text,
            logprobs: (),
            finish_reason,
        }
    }
}

#[derive(Serialize)]
struct DeltaChoice<'a> {
    index: u32,
    delta: Delta<'a>,
    logprobs: (),
    finish_reason: Option<&'a str>,
}

#[derive(Serialize)]
struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<&'a str>,
}

impl Head<'_> {
    fn body<C: Serialize>(&self, object: &'static str, choices: C, usage: UsageField) -> String {
        let body = Body {
            id: self.id,
            object,
            created: self.created,
            model: self.model,
            choices,
            usage,
        };
        // Strings, numbers and unit: serializing cannot fail.
        serde_json::to_string(&body).unwrap_or_default()
    }

    /// The whole response, for `stream: false`.
    pub fn whole(&self, text: &str, d: &Done, finish: &str) -> String {
        let usage = UsageField::Counts(Usage::of(d));
        match self.endpoint {
            Endpoint::Chat => {
                let message = Message {
                    role: "assistant",
                    content: text,
                };
                let choice = MessageChoice {
                    index: 0,
                    message,
                    logprobs: (),
                    finish_reason: finish,
                };
                self.body("chat.completion", [choice], usage)
            }
            Endpoint::Completion => {
                let choice = TextChoice::new(text, Some(finish));
                self.body("text_completion", [choice], usage)
            }
        }
    }

    /// One streamed chunk: a text delta (the first one names the role), or with `finish` the
    /// closing one; `usage: null` on every chunk when the stream asked for usage.
    pub fn chunk(
        &self,
        text: Option<&str>,
        finish: Option<&str>,
        first: bool,
        with_usage: bool,
    ) -> String {
        let usage = if with_usage {
            UsageField::Null
        } else {
            UsageField::Absent
        };
        match self.endpoint {
            Endpoint::Chat => {
                let delta = Delta {
                    role: first.then_some("assistant"),
                    content: text,
                };
                let choice = DeltaChoice {
                    index: 0,
                    delta,
                    logprobs: (),
                    finish_reason: finish,
                };
                self.body(self.chunk_object(), [choice], usage)
            }
            Endpoint::Completion => {
                let choice = TextChoice::new(text.unwrap_or(""), finish);
                self.body(self.chunk_object(), [choice], usage)
            }
        }
    }

    /// The last chunk when the stream asked for usage: no choices, the usage.
    pub fn usage_chunk(&self, d: &Done) -> String {
        self.body(
            self.chunk_object(),
            [(); 0],
            UsageField::Counts(Usage::of(d)),
        )
    }

    /// The `object` of a streamed chunk.
    fn chunk_object(&self) -> &'static str {
        match self.endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completion => "text_completion",
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    fn head(endpoint: Endpoint) -> Head<'static> {
        Head {
            endpoint,
            id: "cmpl-1",
            created: 7,
            model: "m",
        }
    }

    fn parsed(text: &str) -> Value {
        serde_json::from_str(text).expect("JSON")
    }

    const DONE: Done = Done {
        finish_reason: 0,
        prompt_tokens: 3,
        completion_tokens: 2,
        text_tail: String::new(),
        cached_tokens: 1,
    };

    #[test]
    fn whole_responses_have_openais_shapes() {
        assert_eq!(
            parsed(&head(Endpoint::Chat).whole("hi \"x\"", &DONE, "stop")),
            json!({"id": "cmpl-1", "object": "chat.completion", "created": 7, "model": "m",
                   "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi \"x\""},
                                "logprobs": null, "finish_reason": "stop"}],
                   "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 1}}})
        );
        assert_eq!(
            parsed(&head(Endpoint::Completion).whole("hi", &DONE, "length")),
            json!({"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m",
                   "choices": [{"index": 0, "text": "hi", "logprobs": null,
                                "finish_reason": "length"}],
                   "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 1}}})
        );
    }

    #[test]
    fn chunks_name_the_role_first_carry_null_usage_when_asked_and_end_with_usage() {
        let chat = head(Endpoint::Chat);
        assert_eq!(
            parsed(&chat.chunk(Some("a"), None, true, true)),
            json!({"id": "cmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m",
                   "choices": [{"index": 0, "delta": {"role": "assistant", "content": "a"},
                                "logprobs": null, "finish_reason": null}],
                   "usage": null})
        );
        let last = parsed(&chat.chunk(None, Some("stop"), false, false));
        assert_eq!(last["choices"][0]["delta"], json!({}));
        assert_eq!(last["choices"][0]["finish_reason"], "stop");
        assert!(last.get("usage").is_none(), "no usage field unless asked");
        assert_eq!(
            parsed(&head(Endpoint::Completion).chunk(None, None, false, false))["choices"][0]["text"],
            ""
        );
        assert_eq!(
            parsed(&chat.usage_chunk(&DONE)),
            json!({"id": "cmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m",
                   "choices": [],
                   "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 1}}})
        );
    }
}
