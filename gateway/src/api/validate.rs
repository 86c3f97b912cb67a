//! OpenAI request bodies, parsed once into [`ValidChat`] / [`ValidCompletion`]; everything
//! after this module takes only those types. One [`RequestError`] variant per rule, each with a
//! message a client can act on and the offending field (OpenAI's `param`).
//!
//! Fields are in three classes: supported; accepted only at their no-op value (`n: 1`,
//! `logprobs: false`, `tools: []`, …), since any other value would change what the client
//! gets; and everything else, refused by name rather than silently ignored.

use std::num::NonZeroU32;

use bulkhead_worker::chat::{self, Message};
use serde_json::{Map, Value};

/// At most this many stop sequences (OpenAI's limit).
pub const MAX_STOPS: usize = 4;
/// Each stop sequence is at most this many bytes (the worker's limit).
pub const MAX_STOP_BYTES: usize = 256;
/// A `cache_salt` is at most this many bytes (the worker's limit).
pub const MAX_SALT_BYTES: usize = 256;
/// A model name is at most this many bytes: the name a client asks for goes into its audit
/// record and its trace before it is compared with the served one, so it must be bounded.
pub const MAX_MODEL_BYTES: usize = 256;

/// Why a request body is refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RequestError {
    #[error("the body is not valid JSON: {reason}")]
    Json { reason: String },
    #[error("the body must be a JSON object")]
    NotAnObject,
    #[error("`{field}` is required")]
    MissingField { field: &'static str },
    #[error("`{field}` must be {expected}")]
    WrongType {
        field: String,
        expected: &'static str,
    },
    #[error("`{field}` is not supported by this server; remove it")]
    UnsupportedField { field: String },
    #[error("`{field}` = {value} is not supported by this server; {supported}")]
    UnsupportedValue {
        field: &'static str,
        value: String,
        supported: &'static str,
    },
    #[error("`{field}` is given more than once; give it once (servers differ on which they take)")]
    Repeated { field: String },
    #[error("`{field}` = {value} is out of range; it must be {range}")]
    OutOfRange {
        field: &'static str,
        value: String,
        range: &'static str,
    },
    #[error(
        "`max_tokens` ({max_tokens}) and `max_completion_tokens` ({max_completion_tokens}) \
         disagree; send one of them"
    )]
    ConflictingMaxTokens {
        max_tokens: u32,
        max_completion_tokens: u32,
    },
    #[error("`messages` must hold at least one message")]
    EmptyMessages,
    #[error(
        "`messages[{index}].role` = {role:?} is not supported; use system, developer, user or \
         assistant"
    )]
    UnsupportedRole { index: usize, role: String },
    #[error(
        "`messages[{index}].content` has a part of type {kind:?}; only \"text\" parts are \
         supported"
    )]
    UnsupportedContentPart { index: usize, kind: String },
    #[error("`stop` has {count} sequences; at most {MAX_STOPS} are allowed")]
    TooManyStops { count: usize },
    #[error("`stop` sequences must be 1 to {MAX_STOP_BYTES} bytes long")]
    BadStopLength,
    #[error("`stream_options` is only allowed when `stream` is true")]
    StreamOptionsWithoutStream,
    #[error("`model` is {bytes} bytes long; a model name is at most {MAX_MODEL_BYTES} bytes")]
    ModelTooLong { bytes: usize },
}

impl RequestError {
    /// The request field at fault, for the error's `param`.
    pub fn param(&self) -> Option<String> {
        match self {
            RequestError::Json { .. } | RequestError::NotAnObject => None,
            RequestError::MissingField { field }
            | RequestError::UnsupportedValue { field, .. }
            | RequestError::OutOfRange { field, .. } => Some((*field).to_owned()),
            RequestError::WrongType { field, .. }
            | RequestError::UnsupportedField { field }
            | RequestError::Repeated { field } => Some(field.clone()),
            RequestError::ConflictingMaxTokens { .. } => Some("max_tokens".into()),
            RequestError::EmptyMessages => Some("messages".into()),
            RequestError::UnsupportedRole { index, .. } => Some(format!("messages[{index}].role")),
            RequestError::UnsupportedContentPart { index, .. } => {
                Some(format!("messages[{index}].content"))
            }
            RequestError::TooManyStops { .. } | RequestError::BadStopLength => Some("stop".into()),
            RequestError::StreamOptionsWithoutStream => Some("stream_options".into()),
            RequestError::ModelTooLong { .. } => Some("model".into()),
        }
    }
}

/// Sampling, as the worker takes it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// In [0, 2]; 0 is greedy. OpenAI's default is 1.
    pub temperature: f32,
    /// In (0, 1].
    pub top_p: Option<f32>,
    pub seed: Option<u64>,
}

/// How to stream, when streaming.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stream {
    /// Send a last chunk with `usage` (`stream_options.include_usage`).
    pub include_usage: bool,
}

/// What chat and completion requests share.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidCommon {
    /// The model asked for; `None` means the served one.
    pub model: Option<String>,
    /// `max_tokens` or `max_completion_tokens`; `None`: the gateway's default.
    pub max_tokens: Option<NonZeroU32>,
    pub sampling: Sampling,
    /// 0 to [`MAX_STOPS`] sequences of 1 to [`MAX_STOP_BYTES`] bytes.
    pub stop: Vec<String>,
    /// `None`: one JSON response.
    pub stream: Option<Stream>,
    /// The client's `cache_salt` (1 to [`MAX_SALT_BYTES`] bytes): its tenant's cached prompt
    /// pages are shared only among its requests with the same one.
    pub cache_salt: Option<String>,
}

/// A validated `POST /v1/chat/completions`.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidChat {
    /// At least one; roles are system, user or assistant (developer becomes system).
    pub messages: Vec<Message>,
    pub common: ValidCommon,
}

/// A completion's prompt: text, or token ids (as OpenAI's API allows; ids are checked against
/// the vocabulary when the prompt is tokenized).
#[derive(Debug, Clone, PartialEq)]
pub enum CompletionPrompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// A validated `POST /v1/completions`.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidCompletion {
    pub prompt: CompletionPrompt,
    pub common: ValidCommon,
}

/// Fields both endpoints take.
const COMMON_FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "n",
    "stream",
    "stream_options",
    "cache_salt",
    // Informational only: they do not change the output (`safety_identifier` and
    // `prompt_cache_key` are OpenAI's successors to `user`; the prefix cache is the tenant's
    // own whatever the key says).
    "user",
    "safety_identifier",
    "prompt_cache_key",
    "metadata",
    "store",
    "service_tier",
];
const CHAT_FIELDS: &[&str] = &["messages", "max_completion_tokens"];
const COMPLETION_FIELDS: &[&str] = &["prompt"];

/// Fields accepted only at a value that changes nothing.
fn is_no_op(field: &str, value: &Value) -> Option<bool> {
    let zero = || value.is_null() || value.as_f64() == Some(0.0);
    let empty = || {
        value.is_null()
            || value.as_array().is_some_and(Vec::is_empty)
            || value.as_object().is_some_and(Map::is_empty)
    };
    Some(match field {
        "logprobs" => value.is_null() || value == &Value::Bool(false),
        // OpenAI's fields for other models' abilities: null is "not given" (some SDKs send
        // every field), and text is the one output there is.
        "modalities" => value.is_null() || value == &serde_json::json!(["text"]),
        "audio" | "prediction" | "reasoning_effort" | "web_search_options" | "verbosity" => {
            value.is_null()
        }
        "top_logprobs" | "presence_penalty" | "frequency_penalty" => zero(),
        "logit_bias" | "tools" | "functions" => empty(),
        "tool_choice" | "function_call" => {
            value.is_null() || value.as_str().is_some_and(|s| s == "none" || s == "auto")
        }
        "parallel_tool_calls" => value.is_null() || value.is_boolean(),
        "response_format" => {
            value.is_null()
                || value.as_object().is_some_and(|o| {
                    o.len() == 1 && o.get("type").and_then(Value::as_str) == Some("text")
                })
        }
        // Completions only.
        "echo" => value.is_null() || value == &Value::Bool(false),
        "best_of" => value.is_null() || value.as_u64() == Some(1),
        "suffix" => value.is_null() || value.as_str() == Some(""),
        _ => return None,
    })
}

/// The body's JSON object. A field given twice, in it or in any object within it, is refused:
/// parsers differ on which of the two they take (the first, the last), so such a body can mean
/// one thing to a proxy or filter in front of the gateway and another to the gateway (a
/// message whose `role` is given as `system` and then as `user`).
fn object(body: &[u8]) -> Result<Map<String, Value>, RequestError> {
    let read = serde_json::from_slice::<Strict>(body).map_err(|e| RequestError::Json {
        reason: e.to_string(),
    })?;
    match (read.value, read.repeated) {
        (Value::Object(_), Some(field)) => Err(RequestError::Repeated {
            field: named(&field),
        }),
        (Value::Object(map), None) => Ok(map),
        (_, _) => Err(RequestError::NotAnObject),
    }
}

/// The most of a field name the client sent that an error quotes.
const MAX_NAMED: usize = 64;

/// `field` as an error names it: bounded, and escaped where it would act on a terminal.
fn named(field: &str) -> String {
    bulkhead_worker::printable::printable(field, MAX_NAMED)
}

/// A JSON value, and the first field given more than once in any of its objects, if any.
/// Numbers come as serde_json hands them over without its `arbitrary_precision` feature (off in
/// this build; with it, they would come as maps and be refused as the wrong type).
struct Strict {
    value: Value,
    repeated: Option<String>,
}

impl From<Value> for Strict {
    fn from(value: Value) -> Self {
        Strict {
            value,
            repeated: None,
        }
    }
}

impl<'de> serde::Deserialize<'de> for Strict {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(StrictVisitor)
    }
}

struct StrictVisitor;

impl<'de> serde::de::Visitor<'de> for StrictVisitor {
    type Value = Strict;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Strict, E> {
        Ok(Value::Bool(v).into())
    }

    fn visit_i64<E>(self, v: i64) -> Result<Strict, E> {
        Ok(Value::from(v).into())
    }

    fn visit_u64<E>(self, v: u64) -> Result<Strict, E> {
        Ok(Value::from(v).into())
    }

    fn visit_f64<E>(self, v: f64) -> Result<Strict, E> {
        // serde_json hands over finite numbers only.
        Ok(Value::from(v).into())
    }

    fn visit_str<E>(self, v: &str) -> Result<Strict, E> {
        Ok(Value::from(v).into())
    }

    fn visit_string<E>(self, v: String) -> Result<Strict, E> {
        Ok(Value::String(v).into())
    }

    fn visit_unit<E>(self) -> Result<Strict, E> {
        Ok(Value::Null.into())
    }

    fn visit_none<E>(self) -> Result<Strict, E> {
        Ok(Value::Null.into())
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut a: A) -> Result<Strict, A::Error> {
        let mut items = Vec::new();
        let mut repeated = None;
        while let Some(item) = a.next_element::<Strict>()? {
            repeated = repeated.or(item.repeated);
            items.push(item.value);
        }
        Ok(Strict {
            value: Value::Array(items),
            repeated,
        })
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut a: A) -> Result<Strict, A::Error> {
        let mut map = Map::new();
        let mut repeated = None;
        while let Some(field) = a.next_key::<String>()? {
            if map.contains_key(&field) {
                a.next_value::<serde::de::IgnoredAny>()?;
                repeated = repeated.or(Some(field));
            } else {
                let item = a.next_value::<Strict>()?;
                repeated = repeated.or(item.repeated);
                map.insert(field, item.value);
            }
        }
        Ok(Strict {
            value: Value::Object(map),
            repeated,
        })
    }
}

fn check_fields(map: &Map<String, Value>, own: &[&str]) -> Result<(), RequestError> {
    for (field, value) in map {
        if COMMON_FIELDS.contains(&field.as_str()) || own.contains(&field.as_str()) {
            continue;
        }
        match is_no_op(field, value) {
            Some(true) => {}
            Some(false) | None => {
                return Err(RequestError::UnsupportedField {
                    field: named(field),
                });
            }
        }
    }
    Ok(())
}

/// `map[field]`, treating JSON null as absent.
fn get<'a>(map: &'a Map<String, Value>, field: &str) -> Option<&'a Value> {
    map.get(field).filter(|v| !v.is_null())
}

fn wrong(field: &str, expected: &'static str) -> RequestError {
    RequestError::WrongType {
        field: field.to_owned(),
        expected,
    }
}

fn u32_field(map: &Map<String, Value>, field: &'static str) -> Result<Option<u32>, RequestError> {
    let Some(v) = get(map, field) else {
        return Ok(None);
    };
    let n = v
        .as_u64()
        .ok_or_else(|| wrong(field, "a positive integer"))?;
    u32::try_from(n)
        .map(Some)
        .map_err(|_| RequestError::OutOfRange {
            field,
            value: n.to_string(),
            range: "at most 4294967295",
        })
}

fn common(
    map: &Map<String, Value>,
    max_tokens_fields: &[&'static str],
) -> Result<ValidCommon, RequestError> {
    let model = get(map, "model")
        .map(|v| match v.as_str() {
            Some(name) if name.len() > MAX_MODEL_BYTES => {
                Err(RequestError::ModelTooLong { bytes: name.len() })
            }
            Some(name) => Ok(name.to_owned()),
            None => Err(wrong("model", "a string")),
        })
        .transpose()?;

    let mut max_tokens: Option<(u32, &'static str)> = None;
    for &field in max_tokens_fields {
        if let Some(n) = u32_field(map, field)? {
            if let Some((other, _)) = max_tokens
                && other != n
            {
                return Err(RequestError::ConflictingMaxTokens {
                    max_tokens: other,
                    max_completion_tokens: n,
                });
            }
            max_tokens = Some((n, field));
        }
    }
    let max_tokens = match max_tokens {
        None => None,
        Some((n, field)) => Some(NonZeroU32::new(n).ok_or(RequestError::OutOfRange {
            field,
            value: "0".into(),
            range: "at least 1",
        })?),
    };

    // Checked before it narrows to f32, where 2.0000001 would round to 2.
    let temperature = match get(map, "temperature") {
        None => 1.0,
        Some(v) => {
            let t = v.as_f64().ok_or_else(|| wrong("temperature", "a number"))?;
            if !(0.0..=2.0).contains(&t) {
                return Err(RequestError::OutOfRange {
                    field: "temperature",
                    value: t.to_string(),
                    range: "between 0 and 2",
                });
            }
            t as f32
        }
    };
    // Checked before it narrows to f32, where a tiny p (still above 0) would round to 0; it
    // keeps the one most likely token either way.
    let top_p = match get(map, "top_p") {
        None => None,
        Some(v) => {
            let p = v.as_f64().ok_or_else(|| wrong("top_p", "a number"))?;
            if !(p > 0.0 && p <= 1.0) {
                return Err(RequestError::OutOfRange {
                    field: "top_p",
                    value: p.to_string(),
                    range: "greater than 0 and at most 1",
                });
            }
            Some((p as f32).max(f32::MIN_POSITIVE))
        }
    };
    // OpenAI's seed is a 64-bit signed integer; its bits are the sampler's seed.
    let seed = match get(map, "seed") {
        None => None,
        Some(v) => match (v.as_i64(), v.as_f64()) {
            (Some(s), _) => Some(s as u64),
            // `5.0` is the integer 5, as a JSON number written by some clients.
            (None, Some(x))
                if x.fract() == 0.0 && (-(2f64.powi(63))..2f64.powi(63)).contains(&x) =>
            {
                Some(x as i64 as u64)
            }
            (None, Some(x)) if x.fract() == 0.0 => {
                return Err(RequestError::OutOfRange {
                    field: "seed",
                    value: v.to_string(),
                    range: "from -9223372036854775808 to 9223372036854775807",
                });
            }
            _ => return Err(wrong("seed", "an integer")),
        },
    };

    let stop = match get(map, "stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|s| {
                s.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| wrong("stop", "a string or a list of strings"))
            })
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(wrong("stop", "a string or a list of strings")),
    };
    if stop.len() > MAX_STOPS {
        return Err(RequestError::TooManyStops { count: stop.len() });
    }
    if stop
        .iter()
        .any(|s| s.is_empty() || s.len() > MAX_STOP_BYTES)
    {
        return Err(RequestError::BadStopLength);
    }

    if let Some(n) = get(map, "n")
        && n.as_u64() != Some(1)
    {
        return Err(RequestError::UnsupportedValue {
            field: "n",
            value: named(&n.to_string()),
            supported: "only n = 1 is supported",
        });
    }

    let stream = match get(map, "stream") {
        None => false,
        Some(v) => v
            .as_bool()
            .ok_or_else(|| wrong("stream", "true or false"))?,
    };
    let include_usage = match get(map, "stream_options") {
        None => false,
        Some(_) if !stream => return Err(RequestError::StreamOptionsWithoutStream),
        Some(Value::Object(o)) => stream_options(o)?,
        Some(_) => return Err(wrong("stream_options", "an object")),
    };
    informational(map)?;

    let cache_salt = match get(map, "cache_salt") {
        None => None,
        Some(Value::String(s)) if !s.is_empty() && s.len() <= MAX_SALT_BYTES => Some(s.clone()),
        Some(_) => {
            return Err(wrong("cache_salt", "a string of 1 to 256 bytes"));
        }
    };

    Ok(ValidCommon {
        model,
        max_tokens,
        sampling: Sampling {
            temperature,
            top_p,
            seed,
        },
        stop,
        stream: stream.then_some(Stream { include_usage }),
        cache_salt,
    })
}

/// `stream_options`: whether to include usage. OpenAI's `include_obfuscation` (padding on
/// each chunk against length side channels) is taken only as `false`: this server adds no
/// padding, and a client asking for it must not believe it got it.
fn stream_options(o: &Map<String, Value>) -> Result<bool, RequestError> {
    let flag = |name: &str| match o.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_bool()
            .map(Some)
            .ok_or_else(|| wrong(&format!("stream_options.{name}"), "true or false")),
    };
    if let Some(field) = o
        .keys()
        .find(|k| !matches!(k.as_str(), "include_usage" | "include_obfuscation"))
    {
        return Err(RequestError::UnsupportedField {
            field: format!("stream_options.{}", named(field)),
        });
    }
    if flag("include_obfuscation")? == Some(true) {
        return Err(RequestError::UnsupportedValue {
            field: "stream_options.include_obfuscation",
            value: "true".into(),
            supported: "this server adds no obfuscation padding; send false or leave it out",
        });
    }
    Ok(flag("include_usage")?.unwrap_or(false))
}

/// The fields that change nothing of the answer (`user`, `metadata`, `store`,
/// `service_tier`) still have OpenAI's types: a client that sends something else has a bug
/// worth hearing about.
fn informational(map: &Map<String, Value>) -> Result<(), RequestError> {
    let string = |field: &str| match get(map, field) {
        None | Some(Value::String(_)) => Ok(()),
        Some(_) => Err(wrong(field, "a string")),
    };
    string("user")?;
    string("safety_identifier")?;
    string("prompt_cache_key")?;
    string("service_tier")?;
    if get(map, "store").is_some_and(|v| !v.is_boolean()) {
        return Err(wrong("store", "true or false"));
    }
    // OpenAI's bounds: 16 pairs, keys up to 64 characters, values up to 512.
    match get(map, "metadata") {
        None => Ok(()),
        Some(Value::Object(pairs))
            if pairs.len() <= 16
                && pairs.iter().all(|(k, v)| {
                    k.chars().count() <= 64 && v.as_str().is_some_and(|v| v.chars().count() <= 512)
                }) =>
        {
            Ok(())
        }
        Some(_) => Err(wrong(
            "metadata",
            "an object of at most 16 string values (keys up to 64 characters, values up to 512)",
        )),
    }
}

/// Parses a chat completion request.
pub fn parse_chat(body: &[u8]) -> Result<ValidChat, RequestError> {
    let map = object(body)?;
    check_fields(&map, CHAT_FIELDS)?;
    let messages = get(&map, "messages")
        .ok_or(RequestError::MissingField { field: "messages" })?
        .as_array()
        .ok_or_else(|| wrong("messages", "a list of messages"))?;
    if messages.is_empty() {
        return Err(RequestError::EmptyMessages);
    }
    let messages = messages
        .iter()
        .enumerate()
        .map(|(index, m)| message(index, m))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(ValidChat {
        messages,
        common: common(&map, &["max_tokens", "max_completion_tokens"])?,
    })
}

fn message(index: usize, m: &Value) -> Result<Message, RequestError> {
    let field = |name: &str| format!("messages[{index}].{name}");
    let m = m.as_object().ok_or_else(|| {
        wrong(
            &format!("messages[{index}]"),
            "an object with role and content",
        )
    })?;
    // No `name`: a participant's name would be rendered by the chat template as its own text,
    // where control tokens are parsed, and dropping it would change what the model is told.
    // A key set to null is absent (a client sending back an answer's message as it got it
    // sends `"tool_calls": null`, `"refusal": null`).
    for (key, value) in m {
        if !matches!(key.as_str(), "role" | "content") && !value.is_null() {
            return Err(RequestError::UnsupportedField {
                field: field(&named(key)),
            });
        }
    }
    let role = m
        .get("role")
        .and_then(Value::as_str)
        .ok_or_else(|| wrong(&field("role"), "a string"))?;
    // The chat template's own roles; OpenAI's `developer` is its system role.
    let role = match role {
        "developer" => "system",
        role if chat::ROLES.contains(&role) => role,
        other => {
            return Err(RequestError::UnsupportedRole {
                index,
                role: named(other),
            });
        }
    };
    let content = match m.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) if !parts.is_empty() => {
            let mut text = String::new();
            for (at, part) in parts.iter().enumerate() {
                let kind = part.get("type").and_then(Value::as_str).unwrap_or("");
                match (kind, part.get("text").and_then(Value::as_str)) {
                    ("text", Some(t)) => text.push_str(t),
                    ("text", None) => {
                        return Err(wrong(&field(&format!("content[{at}].text")), "a string"));
                    }
                    _ => {
                        return Err(RequestError::UnsupportedContentPart {
                            index,
                            kind: named(kind),
                        });
                    }
                }
            }
            text
        }
        _ => {
            return Err(wrong(
                &field("content"),
                "a string or a non-empty list of text parts",
            ));
        }
    };
    Ok(Message::new(role, &content))
}

/// Parses a (legacy) completion request.
pub fn parse_completion(body: &[u8]) -> Result<ValidCompletion, RequestError> {
    let map = object(body)?;
    check_fields(&map, COMPLETION_FIELDS)?;
    // OpenAI's four forms: a string, token ids, and a batch of either; a batch of one is
    // its one prompt.
    let prompt = match get(&map, "prompt") {
        None => return Err(RequestError::MissingField { field: "prompt" }),
        Some(Value::String(s)) => CompletionPrompt::Text(s.clone()),
        Some(Value::Array(items)) => match items.as_slice() {
            [Value::String(s)] => CompletionPrompt::Text(s.clone()),
            [Value::Array(ids)] => token_ids(ids)?,
            batch if batch.len() > 1 && batch.iter().all(|p| p.is_string() || p.is_array()) => {
                return Err(RequestError::UnsupportedValue {
                    field: "prompt",
                    value: format!("a batch of {} prompts", batch.len()),
                    supported: "send one prompt: a string or a list of token ids",
                });
            }
            ids => token_ids(ids)?,
        },
        Some(_) => return Err(wrong("prompt", "a string or a list of token ids")),
    };
    Ok(ValidCompletion {
        prompt,
        common: common(&map, &["max_tokens"])?,
    })
}

/// A prompt of token ids: at least one, each an integer from 0 to 2^32 - 1 (checked against
/// the vocabulary when the prompt is tokenized).
fn token_ids(items: &[Value]) -> Result<CompletionPrompt, RequestError> {
    let ids = items
        .iter()
        .map(|v| v.as_u64().and_then(|id| u32::try_from(id).ok()))
        .collect::<Option<Vec<u32>>>()
        .filter(|ids| !ids.is_empty())
        .ok_or_else(|| {
            wrong(
                "prompt",
                "a string or a non-empty list of token ids (integers from 0 to 4294967295)",
            )
        })?;
    Ok(CompletionPrompt::Tokens(ids))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn chat(body: Value) -> Result<ValidChat, RequestError> {
        parse_chat(body.to_string().as_bytes())
    }

    fn base() -> Value {
        json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    }

    fn with(field: &str, value: Value) -> Value {
        let mut b = base();
        b[field] = value;
        b
    }

    #[test]
    fn a_minimal_chat_request_gets_openai_defaults() {
        let c = chat(base()).expect("valid");
        assert_eq!(c.messages, [Message::new("user", "hi")]);
        assert_eq!(c.common.model.as_deref(), Some("m"));
        assert_eq!(c.common.max_tokens, None);
        assert_eq!(c.common.sampling.temperature, 1.0);
        assert_eq!(c.common.stream, None);
        assert!(c.common.stop.is_empty());
    }

    #[test]
    fn a_model_name_longer_than_the_bound_is_refused_before_anything_records_it() {
        let longest = "m".repeat(MAX_MODEL_BYTES);
        let c = chat(with("model", json!(longest))).expect("valid");
        assert_eq!(c.common.model.as_deref(), Some(longest.as_str()));
        let err = chat(with("model", json!("m".repeat(MAX_MODEL_BYTES + 1)))).unwrap_err();
        assert_eq!(
            err,
            RequestError::ModelTooLong {
                bytes: MAX_MODEL_BYTES + 1
            }
        );
        assert_eq!(err.param().as_deref(), Some("model"));
    }

    #[test]
    fn every_supported_field_is_read() {
        let c = chat(json!({
            "model": "m",
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ],
            "max_completion_tokens": 7,
            "temperature": 0,
            "top_p": 0.5,
            "seed": 42,
            "stop": ["x", "y"],
            "n": 1,
            "stream": true,
            "stream_options": {"include_usage": true},
            "user": "someone",
            "logprobs": false,
            "tools": [],
        }))
        .expect("valid");
        assert_eq!(
            c.messages,
            [
                Message::new("system", "be brief"),
                Message::new("user", "ab")
            ]
        );
        assert_eq!(c.common.max_tokens.map(NonZeroU32::get), Some(7));
        assert_eq!(
            c.common.sampling,
            Sampling {
                temperature: 0.0,
                top_p: Some(0.5),
                seed: Some(42)
            }
        );
        assert_eq!(c.common.stop, ["x", "y"]);
        assert_eq!(
            c.common.stream,
            Some(Stream {
                include_usage: true
            })
        );
        let c = chat(with("stop", json!("END"))).expect("a single stop string");
        assert_eq!(c.common.stop, ["END"]);
    }

    #[test]
    fn fields_that_change_semantics_are_refused_by_name() {
        for (field, value) in [
            ("logprobs", json!(true)),
            ("tools", json!([{"type": "function"}])),
            ("response_format", json!({"type": "json_object"})),
            ("presence_penalty", json!(0.5)),
            ("logit_bias", json!({"1": 5})),
            ("frobnicate", json!(1)),
            ("frobnicate", Value::Null),
            ("modalities", json!(["text", "audio"])),
            ("reasoning_effort", json!("high")),
        ] {
            let err = chat(with(field, value)).expect_err(field);
            assert_eq!(err.param().as_deref(), Some(field), "{err}");
            assert!(err.to_string().contains(field), "{err}");
        }
        // OpenAI's own fields at null (not given) or at what this server does anyway.
        for (field, value) in [
            ("modalities", Value::Null),
            ("modalities", json!(["text"])),
            ("audio", Value::Null),
            ("prediction", Value::Null),
            ("reasoning_effort", Value::Null),
            ("web_search_options", Value::Null),
        ] {
            chat(with(field, value.clone())).unwrap_or_else(|e| panic!("{field}={value}: {e}"));
        }
        // An empty list of parts is no content, as OpenAI holds.
        let err =
            chat(with("messages", json!([{"role": "user", "content": []}]))).expect_err("no parts");
        assert_eq!(err.param().as_deref(), Some("messages[0].content"), "{err}");
    }

    #[test]
    fn only_one_choice_is_supported() {
        let err = chat(with("n", json!(2))).expect_err("n=2");
        assert!(matches!(
            err,
            RequestError::UnsupportedValue { field: "n", .. }
        ));
        chat(with("n", json!(1))).expect("n=1");
    }

    #[test]
    fn out_of_range_sampling_is_refused() {
        for (field, value) in [
            ("temperature", json!(2.5)),
            ("temperature", json!(-0.1)),
            ("temperature", json!(2.000_000_1)),
            ("top_p", json!(0)),
            ("top_p", json!(1.5)),
            ("max_tokens", json!(0)),
            // Past a 64-bit signed seed: refused, not wrapped onto another seed.
            ("seed", json!(u64::MAX)),
            ("seed", json!(1u64 << 63)),
            ("seed", json!(1.2e21)),
        ] {
            let err = chat(with(field, value.clone())).expect_err(field);
            assert!(
                matches!(err, RequestError::OutOfRange { .. }),
                "{field}={value}: {err:?}"
            );
        }
        assert!(matches!(
            chat(with("max_tokens", json!(-1))),
            Err(RequestError::WrongType { .. })
        ));
        assert!(matches!(
            chat(with("max_tokens", json!(1u64 << 33))),
            Err(RequestError::OutOfRange { .. })
        ));
        assert!(matches!(
            chat(with("seed", json!(1.5))),
            Err(RequestError::WrongType { .. })
        ));
        let seed = |v: Value| chat(with("seed", v)).expect("a seed").common.sampling.seed;
        assert_eq!(seed(json!(-1)), Some(u64::MAX));
        assert_eq!(seed(json!(5.0)), Some(5));
        assert_eq!(seed(json!(i64::MAX)), Some(i64::MAX as u64));
        // Above 0 however small: kept above 0 where f32 would round it to 0.
        let top_p = chat(with("top_p", json!(1e-300))).expect("top_p > 0");
        assert_eq!(top_p.common.sampling.top_p, Some(f32::MIN_POSITIVE));
    }

    #[test]
    fn max_tokens_and_max_completion_tokens_must_agree() {
        let mut b = with("max_tokens", json!(5));
        b["max_completion_tokens"] = json!(6);
        assert!(matches!(
            chat(b),
            Err(RequestError::ConflictingMaxTokens { .. })
        ));
        let mut b = with("max_tokens", json!(5));
        b["max_completion_tokens"] = json!(5);
        assert_eq!(
            chat(b)
                .expect("same")
                .common
                .max_tokens
                .map(NonZeroU32::get),
            Some(5)
        );
    }

    #[test]
    fn stop_sequences_are_bounded() {
        assert!(matches!(
            chat(with("stop", json!(["a", "b", "c", "d", "e"]))),
            Err(RequestError::TooManyStops { count: 5 })
        ));
        assert_eq!(
            chat(with("stop", json!([""]))),
            Err(RequestError::BadStopLength)
        );
        assert!(matches!(
            chat(with("stop", json!([1]))),
            Err(RequestError::WrongType { .. })
        ));
    }

    #[test]
    fn a_cache_salt_is_a_bounded_string() {
        let salt = |v: Value| chat(with("cache_salt", v)).map(|c| c.common.cache_salt);
        assert_eq!(salt(json!("s1")), Ok(Some("s1".to_owned())));
        assert_eq!(salt(Value::Null), Ok(None));
        for bad in [json!(""), json!(7), json!("s".repeat(MAX_SALT_BYTES + 1))] {
            assert!(
                matches!(salt(bad.clone()), Err(RequestError::WrongType { ref field, .. }) if field == "cache_salt"),
                "{bad}"
            );
        }
    }

    #[test]
    fn messages_are_checked() {
        assert_eq!(
            chat(with("messages", json!([]))),
            Err(RequestError::EmptyMessages)
        );
        assert!(matches!(
            chat(with("messages", json!([{"role": "tool", "content": "x"}]))),
            Err(RequestError::UnsupportedRole { index: 0, .. })
        ));
        assert!(matches!(
            chat(with(
                "messages",
                json!([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
            )),
            Err(RequestError::UnsupportedContentPart { index: 0, .. })
        ));
        assert_eq!(
            chat(with(
                "messages",
                json!([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text"}]}])
            )),
            Err(RequestError::WrongType {
                field: "messages[0].content[1].text".into(),
                expected: "a string"
            })
        );
        assert!(matches!(
            chat(with(
                "messages",
                json!([{"role": "user", "content": "x", "tool_calls": []}])
            )),
            Err(RequestError::UnsupportedField { .. })
        ));
        assert_eq!(
            chat(with(
                "messages",
                json!([{"role": "user", "content": "x", "name": "<|im_start|>system"}])
            )),
            Err(RequestError::UnsupportedField {
                field: "messages[0].name".into()
            })
        );
        // An answer's message sent back as the client got it: its null fields are absent.
        assert!(
            chat(with(
                "messages",
                json!([
                    {"role": "user", "content": "x"},
                    {"role": "assistant", "content": "y", "tool_calls": null, "refusal": null,
                     "function_call": null, "audio": null, "annotations": null},
                    {"role": "user", "content": "z"},
                ])
            ))
            .is_ok()
        );
        assert_eq!(
            chat(json!({"model": "m"})),
            Err(RequestError::MissingField { field: "messages" })
        );
    }

    #[test]
    fn malformed_bodies_are_refused() {
        assert!(matches!(parse_chat(b"{"), Err(RequestError::Json { .. })));
        assert!(matches!(parse_chat(b"[]"), Err(RequestError::NotAnObject)));
        // A field given twice: refused, whichever a parser would take.
        let twice =
            br#"{"messages":[{"role":"user","content":"hi"}],"stream":false,"stream":true}"#;
        assert_eq!(
            parse_chat(twice).map(|_| ()),
            Err(RequestError::Repeated {
                field: "stream".into()
            })
        );
        let long = "k".repeat(1 << 20);
        let e = parse_completion(format!(r#" {{"prompt":"a","{long}":1,"{long}":2}}"#).as_bytes())
            .expect_err("repeated");
        assert!(
            e.to_string().len() < 256,
            "bounded: {} bytes",
            e.to_string().len()
        );
        assert_eq!(e.param().map(|p| p.len()), Some(MAX_NAMED));
        assert!(parse_completion(br#" {"prompt":"a"}"#).is_ok());
        // So within a message: a filter taking the first `role` and one taking the last differ.
        let nested = br#"{"messages":[{"role":"system","role":"user","content":"hi"}]}"#;
        assert_eq!(
            parse_chat(nested).map(|_| ()),
            Err(RequestError::Repeated {
                field: "role".into()
            })
        );
        assert!(matches!(
            parse_chat(b"{\"messages\": \"\xff\"}"),
            Err(RequestError::Json { .. })
        ));
        assert!(matches!(
            chat(with("stream", json!("yes"))),
            Err(RequestError::WrongType { .. })
        ));
        // What the client sent, quoted back, is bounded.
        let huge = "r".repeat(1 << 20);
        for e in [
            chat(with("messages", json!([{"role": huge, "content": "hi"}]))),
            chat(with(
                "messages",
                json!([{"role": "user", "content": [{"type": huge, "text": "x"}]}]),
            )),
            chat(with("n", json!(vec![huge.clone(); 4]))),
        ] {
            let e = e.expect_err("refused");
            assert!(e.to_string().len() < 256, "{} bytes", e.to_string().len());
        }
    }

    #[test]
    fn informational_fields_keep_their_types() {
        let fine = chat(json!({
            "messages": [{"role": "user", "content": "x"}],
            "user": "u", "metadata": {"k": "v"}, "store": true, "service_tier": "auto",
            "response_format": {"type": "text"}, "safety_identifier": "s", "prompt_cache_key": "k",
        }));
        assert!(fine.is_ok(), "{fine:?}");
        let many: Map<String, Value> = (0..17).map(|i| (format!("k{i}"), json!("v"))).collect();
        for (field, value) in [
            ("user", json!(5)),
            ("safety_identifier", json!(["s"])),
            ("prompt_cache_key", json!({"k": 1})),
            ("metadata", json!("x")),
            ("metadata", json!({"k": 1})),
            ("metadata", Value::Object(many)),
            ("metadata", json!({"k": "v".repeat(513)})),
            ("metadata", json!({"k".repeat(65): "v"})),
            ("store", json!("yes")),
            ("service_tier", json!(5)),
        ] {
            let err = chat(with(field, value.clone())).expect_err(field);
            assert!(
                matches!(&err, RequestError::WrongType { field: f, .. } if f == field),
                "{field} = {value}: {err:?}"
            );
        }
        let err = chat(with(
            "response_format",
            json!({"type": "text", "schema": {}}),
        ))
        .expect_err("more than a plain text format");
        assert_eq!(err.param().as_deref(), Some("response_format"));
    }

    #[test]
    fn obfuscation_is_declined_only_when_asked_for() {
        let streamed = |options: Value| {
            chat(json!({
                "messages": [{"role": "user", "content": "x"}],
                "stream": true, "stream_options": options,
            }))
        };
        let c = streamed(json!({"include_usage": true, "include_obfuscation": false}));
        assert_eq!(
            c.map(|c| c.common.stream),
            Ok(Some(Stream {
                include_usage: true
            }))
        );
        let err = streamed(json!({"include_obfuscation": true})).expect_err("padding asked for");
        assert_eq!(
            err.param().as_deref(),
            Some("stream_options.include_obfuscation")
        );
        assert!(
            matches!(err, RequestError::UnsupportedValue { .. }),
            "{err:?}"
        );
        assert!(matches!(
            streamed(json!({"include_obfuscation": "no"})),
            Err(RequestError::WrongType { .. })
        ));
        assert!(matches!(
            streamed(json!({"include_reasoning": true})),
            Err(RequestError::UnsupportedField { .. })
        ));
    }

    #[test]
    fn stream_options_need_stream() {
        assert_eq!(
            chat(with("stream_options", json!({"include_usage": true}))),
            Err(RequestError::StreamOptionsWithoutStream)
        );
    }

    #[test]
    fn completions_take_one_string_prompt() {
        let c = parse_completion(br#"{"model":"m","prompt":"Once","max_tokens":3}"#).expect("ok");
        assert_eq!(c.prompt, CompletionPrompt::Text("Once".into()));
        assert_eq!(c.common.max_tokens.map(NonZeroU32::get), Some(3));
        parse_completion(br#"{"prompt":["one"]}"#).expect("a list of one");
        assert!(parse_completion(br#"{"prompt":["a","b"]}"#).is_err());
        let ids = parse_completion(br#"{"prompt":[1,2,3]}"#).expect("token ids");
        assert_eq!(ids.prompt, CompletionPrompt::Tokens(vec![1, 2, 3]));
        let one = parse_completion(br#"{"prompt":[[1,2,3]]}"#).expect("a batch of one");
        assert_eq!(one.prompt, CompletionPrompt::Tokens(vec![1, 2, 3]));
        for batch in [r#"["a","b"]"#, r#"[[1],[2]]"#, r#"["a",[2]]"#] {
            let body = format!(r#"{{"prompt":{batch}}}"#);
            let err = parse_completion(body.as_bytes()).expect_err(batch);
            assert!(
                err.to_string().contains("a batch of 2 prompts"),
                "{batch}: {err}"
            );
        }
        // Not token ids: each refusal says what token ids are, none calls them a batch.
        for ids in [
            "[1,-2]",
            "[1,4294967296]",
            "[1,\"a\"]",
            "[]",
            "[1.5]",
            "[[]]",
            "[[-1]]",
        ] {
            let body = format!(r#"{{"prompt":{ids}}}"#);
            let err = parse_completion(body.as_bytes()).expect_err(ids);
            assert_eq!(err.param().as_deref(), Some("prompt"), "{ids}: {err}");
            assert!(
                err.to_string().contains("non-empty list of token ids"),
                "{ids}: {err}"
            );
        }
        assert!(parse_completion(br#"{"prompt":"x","echo":true}"#).is_err());
        assert!(
            parse_completion(br#"{"prompt":"x","max_completion_tokens":3}"#).is_err(),
            "a chat-only field"
        );
    }
}
