//! The gateway bench's load target: a minimal OpenAI-compatible server that answers every
//! request at once with the same short answer, so that what a load through a proxy measures
//! is the proxy. Not a model server: it never looks at the prompt.
//!
//! `GET /v1/models` lists [`MODEL`]; `POST /v1/chat/completions` and `POST /v1/completions`
//! answer [`ANSWER`], as one JSON object or, with `"stream": true`, as one SSE body (a chunk
//! per piece of the answer, a usage chunk when `stream_options.include_usage` asks for it,
//! then `data: [DONE]`). A request whose `max_tokens` (or `max_completion_tokens`) is below the
//! answer's five tokens gets that many, finished for `length`, as a model server would answer.
//! Every answer is rendered once at start.
//!
//! Runs as its own process (`bulkhead bench load-target`, hidden), started by the bench.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::sync::Arc;

use anyhow::Context;
use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::net::TcpListener;

/// The model name the target answers to.
pub const MODEL: &str = "bench";
/// The answer, in the pieces a stream sends.
const PIECES: [&str; 5] = ["The", " answer", " is", " 4", "."];
/// The whole answer.
pub const ANSWER: &str = "The answer is 4.";
/// Prompt tokens the usage reports (the target does not tokenize).
const PROMPT_TOKENS: usize = 8;
/// The largest request body read.
const MAX_BODY_BYTES: usize = 1 << 20;
/// The line the target prints once it listens; `addr=` follows.
pub const READY: &str = "bulkhead load-target ready ";

#[derive(Debug, clap::Args)]
pub struct LoadTargetArgs {
    /// Where to listen (port 0: any free port; the bound address is printed).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Threads serving connections.
    #[arg(long, default_value_t = NonZeroUsize::MIN)]
    threads: NonZeroUsize,
}

pub fn run(args: LoadTargetArgs) -> anyhow::Result<()> {
    crate::runtime::build(args.threads, "bench-load-target")?.block_on(async {
        let listener = TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("binding {}", args.listen))?;
        println!("{READY}addr={}", listener.local_addr()?);
        let replies = Arc::new(Replies::render());
        let stop = crate::worker::shutdown_signal();
        tokio::pin!(stop);
        loop {
            let (stream, _) = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok(a) => a,
                    // Out of descriptors and the like: keep serving the connections there are.
                    Err(_) => continue,
                },
                () = &mut stop => return Ok(()),
            };
            let _ = stream.set_nodelay(true);
            let replies = replies.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req| answer(req, replies.clone()));
                // A client that goes away mid-request is no failure of the target.
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    })
}

/// What the target reads of a request body.
#[derive(Debug, Default, Deserialize)]
struct Ask {
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    /// Read leniently (any JSON value): a limit that is no whole number is no limit here, as
    /// the target checks nothing else of a request either.
    max_tokens: Option<Value>,
    max_completion_tokens: Option<Value>,
}

#[derive(Debug, Default, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// Which answer a request gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Form {
    Whole,
    Stream { usage: bool },
}

impl Ask {
    /// How many of the answer's pieces (tokens) the request may have: all of them unless its
    /// token limit is lower (at least one: a limit of 0 is the gateway's to refuse).
    fn pieces(&self) -> usize {
        let limit = [&self.max_completion_tokens, &self.max_tokens]
            .into_iter()
            .find_map(|v| v.as_ref().and_then(Value::as_u64));
        limit.map_or(PIECES.len(), |n| {
            usize::try_from(n).map_or(PIECES.len(), |n| n.clamp(1, PIECES.len()))
        })
    }

    fn form(&self) -> Form {
        match (self.stream, &self.stream_options) {
            (false, _) => Form::Whole,
            (true, options) => Form::Stream {
                usage: options.as_ref().is_some_and(|o| o.include_usage),
            },
        }
    }
}

/// One endpoint's answers, in each form.
#[derive(Debug)]
struct Answers {
    whole: Bytes,
    stream: Bytes,
    stream_with_usage: Bytes,
}

impl Answers {
    fn get(&self, form: Form) -> (Bytes, &'static str) {
        match form {
            Form::Whole => (self.whole.clone(), "application/json"),
            Form::Stream { usage: false } => (self.stream.clone(), "text/event-stream"),
            Form::Stream { usage: true } => (self.stream_with_usage.clone(), "text/event-stream"),
        }
    }
}

/// Every answer, rendered once: `chat[n - 1]` and `completion[n - 1]` are the answers of `n`
/// pieces.
#[derive(Debug)]
struct Replies {
    models: Bytes,
    chat: Vec<Answers>,
    completion: Vec<Answers>,
}

impl Replies {
    fn render() -> Replies {
        let (chat, completion) = (1..=PIECES.len()).map(Self::answers).unzip();
        Replies {
            models: Bytes::from(
                json!({"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "bulkhead-bench"}]})
                    .to_string(),
            ),
            chat,
            completion,
        }
    }

    /// The chat and the completion answers of the answer's first `n` pieces.
    fn answers(n: usize) -> (Answers, Answers) {
        let pieces = &PIECES[..n];
        let text: String = pieces.concat();
        let finish = if n < PIECES.len() { "length" } else { "stop" };
        let usage = json!({
            "prompt_tokens": PROMPT_TOKENS,
            "completion_tokens": n,
            "total_tokens": PROMPT_TOKENS + n,
        });
        let chat_head = json!({"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0, "model": MODEL});
        let chat_choice = |delta: Value, finish: Value| json!([{"index": 0, "delta": delta, "finish_reason": finish}]);
        let mut chat_chunks = vec![chat_choice(
            json!({"role": "assistant", "content": ""}),
            Value::Null,
        )];
        chat_chunks.extend(
            pieces
                .iter()
                .map(|p| chat_choice(json!({"content": p}), Value::Null)),
        );
        chat_chunks.push(chat_choice(json!({}), json!(finish)));
        let text_head =
            json!({"id": "cmpl-bench", "object": "text_completion", "created": 0, "model": MODEL});
        let text_choice = |text: &str, finish: Value| json!([{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}]);
        let mut text_chunks: Vec<Value> =
            pieces.iter().map(|p| text_choice(p, Value::Null)).collect();
        text_chunks.push(text_choice("", json!(finish)));
        let chat = Answers {
            whole: Bytes::from(
                json!({
                    "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": MODEL,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
                    "usage": usage,
                })
                .to_string(),
            ),
            stream: sse(&chat_head, &chat_chunks, None),
            stream_with_usage: sse(&chat_head, &chat_chunks, Some(&usage)),
        };
        let completion = Answers {
            whole: Bytes::from(
                json!({
                    "id": "cmpl-bench", "object": "text_completion", "created": 0, "model": MODEL,
                    "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}],
                    "usage": usage,
                })
                .to_string(),
            ),
            stream: sse(&text_head, &text_chunks, None),
            stream_with_usage: sse(&text_head, &text_chunks, Some(&usage)),
        };
        (chat, completion)
    }
}

/// An SSE body: one event per chunk (`head` with its `choices`), the usage chunk if given,
/// then `[DONE]`.
fn sse(head: &Value, choices: &[Value], usage: Option<&Value>) -> Bytes {
    let mut out = String::new();
    let mut event = |choices: &Value, usage: Option<&Value>| {
        let mut chunk = head.clone();
        chunk["choices"] = choices.clone();
        if let Some(u) = usage {
            chunk["usage"] = u.clone();
        }
        out.push_str(&format!("data: {chunk}\n\n"));
    };
    for c in choices {
        event(c, None);
    }
    if let Some(u) = usage {
        event(&json!([]), Some(u));
    }
    out.push_str("data: [DONE]\n\n");
    Bytes::from(out)
}

async fn answer(
    req: Request<Incoming>,
    replies: Arc<Replies>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let answers = match (req.method(), req.uri().path()) {
        (&Method::GET, "/v1/models") => {
            return Ok(reply(
                StatusCode::OK,
                replies.models.clone(),
                "application/json",
            ));
        }
        (&Method::POST, "/v1/chat/completions") => &replies.chat[..],
        (&Method::POST, "/v1/completions") => &replies.completion[..],
        _ => return Ok(error(StatusCode::NOT_FOUND, "no such endpoint")),
    };
    let body = match Limited::new(req.into_body(), MAX_BODY_BYTES)
        .collect()
        .await
    {
        Ok(b) => b.to_bytes(),
        Err(_) => return Ok(error(StatusCode::BAD_REQUEST, "unreadable body")),
    };
    let Ok(ask) = serde_json::from_slice::<Ask>(&body) else {
        return Ok(error(
            StatusCode::BAD_REQUEST,
            "the body is not a JSON object",
        ));
    };
    let (bytes, content_type) = answers[ask.pieces() - 1].get(ask.form());
    Ok(reply(StatusCode::OK, bytes, content_type))
}

fn reply(status: StatusCode, body: Bytes, content_type: &'static str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

fn error(status: StatusCode, message: &str) -> Response<Full<Bytes>> {
    let body =
        json!({"error": {"message": message, "type": "invalid_request_error", "code": null}});
    reply(status, Bytes::from(body.to_string()), "application/json")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(body: &Bytes) -> Vec<String> {
        std::str::from_utf8(body)
            .expect("UTF-8")
            .split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| e.strip_prefix("data: ").expect("data events").to_owned())
            .collect()
    }

    #[test]
    fn every_answer_spells_its_pieces_and_a_streamed_one_ends_with_done() {
        let replies = Replies::render();
        for (all, field) in [
            (&replies.chat, "/delta/content"),
            (&replies.completion, "/text"),
        ] {
            assert_eq!(all.len(), PIECES.len());
            for (i, answers) in all.iter().enumerate() {
                let n = i + 1;
                let (want, finish) = if n == PIECES.len() {
                    (ANSWER.to_owned(), "stop")
                } else {
                    (PIECES[..n].concat(), "length")
                };
                for usage in [false, true] {
                    let evs = events(&answers.get(Form::Stream { usage }).0);
                    assert_eq!(evs.last().map(String::as_str), Some("[DONE]"));
                    let chunks: Vec<Value> = evs[..evs.len() - 1]
                        .iter()
                        .map(|e| serde_json::from_str(e).expect("JSON chunks"))
                        .collect();
                    let text: String = chunks
                        .iter()
                        .filter_map(|c| c["choices"][0].pointer(field)?.as_str().map(str::to_owned))
                        .collect();
                    assert_eq!(text, want);
                    let finishes: Vec<&Value> = chunks
                        .iter()
                        .filter_map(|c| c["choices"][0].get("finish_reason"))
                        .filter(|f| !f.is_null())
                        .collect();
                    assert_eq!(finishes, [finish]);
                    let usages = chunks.iter().filter(|c| c["usage"].is_object()).count();
                    assert_eq!(usages, usize::from(usage), "usage only when asked for");
                }
                let whole: Value =
                    serde_json::from_slice(&answers.get(Form::Whole).0).expect("JSON");
                assert_eq!(whole["usage"]["completion_tokens"], n);
                assert_eq!(whole["choices"][0]["finish_reason"], finish);
            }
        }
    }

    #[test]
    fn a_token_limit_below_the_answer_gets_that_many_pieces() {
        let pieces = |s: &str| serde_json::from_str::<Ask>(s).expect("parses").pieces();
        assert_eq!(pieces(r#"{"messages":[]}"#), PIECES.len());
        assert_eq!(pieces(r#"{"max_tokens":2}"#), 2);
        assert_eq!(pieces(r#"{"max_tokens":64}"#), PIECES.len());
        assert_eq!(pieces(r#"{"max_tokens":9,"max_completion_tokens":3}"#), 3);
        assert_eq!(pieces(r#"{"max_tokens":0}"#), 1);
        assert_eq!(pieces(r#"{"max_tokens":-1}"#), PIECES.len());
        assert_eq!(pieces(r#"{"max_tokens":2.5}"#), PIECES.len());
    }

    #[test]
    fn the_form_follows_stream_and_include_usage() {
        let form = |s: &str| serde_json::from_str::<Ask>(s).expect("parses").form();
        assert_eq!(form(r#"{"messages":[]}"#), Form::Whole);
        assert_eq!(form(r#"{"stream":true}"#), Form::Stream { usage: false });
        assert_eq!(
            form(r#"{"stream":true,"stream_options":{"include_usage":true},"prompt":[1,2]}"#),
            Form::Stream { usage: true }
        );
        assert_eq!(
            form(r#"{"stream":false,"stream_options":{"include_usage":true}}"#),
            Form::Whole
        );
    }
}
