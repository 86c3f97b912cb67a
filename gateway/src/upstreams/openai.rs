//! OpenAI-compatible HTTP upstreams (vLLM, SGLang, llama.cpp's server, another Bulkhead
//! gateway). The gateway tokenizes, admits and audits exactly as for its own workers, then
//! sends the token ids as one streaming `POST /v1/completions` and reads the SSE stream back
//! as the worker protocol's tokens and `Done`. Upstream errors become statuses with the worker
//! protocol's error codes, so one table maps both kinds of upstream onto the API's errors.

use std::borrow::Cow;
use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bulkhead_worker::engine::{StopScan, StopWatch};
use bulkhead_worker::serve::proto::{
    Done, FinishReason, GenerateRequest, GenerateResponse, Item, Prompt, REFUSED_BY_KEY,
    RETRY_AFTER_KEY, Token, error_code, error_code_status,
};
use bytes::Bytes;
use futures_util::{Stream, StreamExt as _, TryStreamExt as _};
use http::header::{AUTHORIZATION, CONTENT_TYPE};
use http::{HeaderValue, Method, Request, Uri};
use http_body_util::{BodyExt as _, Full, Limited};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use thread_local::ThreadLocal;
use tonic::metadata::MetadataValue;
use tonic::{Code, Status};

use super::broken;

/// Bound on a health probe.
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);
/// Bound on connecting to the upstream.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// The most of an SSE event kept waiting for its end, and the longest error body read; past
/// it, a protocol error. (An event that arrives whole in one read is parsed where it lies,
/// whatever its length: memory stays bounded by the read.)
const MAX_EVENT_BYTES: usize = 1 << 20;

/// One OpenAI-compatible server and the model name it is asked for, over plain HTTP/1.1
/// keep-alive connections (hyper's pooled client: this is the gateway's hot path, and an
/// upstream that redirects is an error, not something to follow).
///
/// Each thread that calls gets a pool of its own: a connection's task runs on the runtime
/// that opened it, so a request served on one thread never waits on another thread's
/// connection (the gateway serves on one single-threaded runtime per thread).
#[derive(Debug)]
pub struct OpenAiClient {
    /// `GET` here lists the models.
    models: Uri,
    /// `POST` here starts a completion.
    completions: Uri,
    model: String,
    /// `Bearer` and the upstream's own key, when it needs one (marked sensitive).
    authorization: Option<HeaderValue>,
    /// Whether each request carries its tenant's `cache_salt` (see [`cache_salt`]).
    salted: bool,
    /// Whether the server's count of cached prompt tokens is passed on (the operator vouches
    /// that it keeps its prefix cache per salt).
    report_cached: bool,
    http: ThreadLocal<Client<HttpConnector, Full<Bytes>>>,
}

/// The `cache_salt` of `tenant`'s requests that carried `client` (theirs, or empty): the
/// server's prefix cache (vLLM's, keyed by it) then shares cached blocks only among requests
/// of one tenant with one client salt, as Bulkhead's own workers do. A digest, so that the
/// upstream is told neither the tenant's name nor the client's salt.
fn cache_salt(tenant: &str, client: &str) -> String {
    use sha2::Digest as _;
    // Lengths first: no tenant and salt run together into another pair's bytes.
    let digest = sha2::Sha256::new()
        .chain_update(b"bulkhead cache salt\0")
        .chain_update((tenant.len() as u64).to_le_bytes())
        .chain_update(tenant.as_bytes())
        .chain_update(client.as_bytes())
        .finalize();
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// A failure reading a body, whatever its source.
type BodyError = Box<dyn std::error::Error + Send + Sync>;

/// The body of the one request the gateway sends: a streamed `/v1/completions` of token ids.
#[derive(Serialize)]
struct CompletionRequest<'a> {
    model: &'a str,
    prompt: &'a [u32],
    max_tokens: u32,
    stream: bool,
    stream_options: StreamOptions,
    temperature: f32,
    #[serde(skip_serializing_if = "Option::is_none")]
    top_p: Option<f32>,
    /// Signed, as OpenAI's API and servers like vLLM take it ([`signed_seed`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    seed: Option<i64>,
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    stop: &'a [String],
    #[serde(skip_serializing_if = "Option::is_none")]
    cache_salt: Option<String>,
}

#[derive(Serialize)]
struct StreamOptions {
    include_usage: bool,
}

type Body = Pin<Box<dyn Stream<Item = Result<Bytes, BodyError>> + Send>>;

/// A streaming completion in progress.
pub struct SseStream {
    body: Body,
    /// Bytes read and not yet parsed: at most a part of one event.
    buf: Vec<u8>,
    /// The count of a long answer's tokens under way on the blocking pool: kept here, so that
    /// a `message` call dropped while it runs leaves it to the next. Dropped with the stream,
    /// it runs to its end (bounded: the text is at most `max_tokens` tokens' worth).
    counting: Option<tokio::task::JoinHandle<Option<u32>>>,
    /// Where in `buf` an event's end may yet be found: what lies before holds no separator
    /// that more bytes could complete, so a trickling upstream costs each byte one look.
    scanned: usize,
    events: Events,
}

/// Counts a completion's tokens with the served model's tokenizer: for an upstream that sends
/// no usage (it ignored `stream_options.include_usage`), or a count its text belies, where
/// counting its chunks would undercount a server that sends several tokens in one (and the
/// tenant's charge with it).
pub struct TokenCounter {
    count: Arc<Count>,
    /// The most bytes of text one token of the vocabulary decodes to.
    token_bytes: u64,
}

/// Tokens in a text, when they can be counted.
type Count = dyn Fn(&str) -> Option<u32> + Send + Sync;

impl TokenCounter {
    /// `token_bytes`: the most bytes of text one token decodes to (at least 1).
    pub fn new(
        token_bytes: usize,
        count: impl Fn(&str) -> Option<u32> + Send + Sync + 'static,
    ) -> TokenCounter {
        TokenCounter {
            count: Arc::new(count),
            token_bytes: (token_bytes as u64).max(1),
        }
    }

    /// Whether `bytes` of text can be `tokens` tokens.
    fn can_hold(&self, tokens: u32, bytes: usize) -> bool {
        bytes as u64 <= u64::from(tokens) * self.token_bytes
    }
}

impl std::fmt::Debug for TokenCounter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenCounter")
    }
}

/// What the events parsed so far say. The gateway holds the upstream to the request it sent:
/// the prompt's tokens are its own count (it sent the ids), the answer stops at the request's
/// stop strings whether or not the server did, and a server whose text outgrows `max_tokens`
/// or whose usage exceeds it, or that sends several choices, fails the request.
#[derive(Debug)]
struct Events {
    /// Parsed items not yet returned.
    ready: VecDeque<GenerateResponse>,
    finish: FinishReason,
    /// The upstream's count of completion tokens.
    usage: Option<u32>,
    /// The upstream's `usage.prompt_tokens_details.cached_tokens` (0 when it sends none, or
    /// when it is not reported).
    cached_tokens: u32,
    /// Whether the upstream's count of cached tokens is passed on.
    report_cached: bool,
    prompt_tokens: u32,
    max_tokens: u32,
    /// The request's stop strings, applied again to what the upstream sends.
    stops: StopWatch,
    /// The stop string the gateway ended the answer at (the upstream sent on past it): it was
    /// generated, and the tenant is charged for it.
    stopped_by: Option<String>,
    /// A chunk said the finish reason: text after it is the answer's end too.
    closing: bool,
    /// Bytes of text the upstream sent.
    received: usize,
    /// The completion so far as the client gets it, counted at the end when the upstream's
    /// usage is missing or belied.
    text: String,
    /// Text that came with the finish reason: the answer's end, not a token of its own (a
    /// server that held text back for its stop strings sends it there).
    tail: String,
    counter: TokenCounter,
    /// Chunks with text: the count when the counter cannot count.
    chunks: u32,
    /// The answer ended and the upstream's count is not to be taken: what it generated, to
    /// count before `Done` can say how many tokens it was.
    recount: Option<String>,
    ended: bool,
    /// An event that failed to parse, or said the upstream failed: returned after the items
    /// before it.
    failure: Option<Status>,
}

impl std::fmt::Debug for SseStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SseStream")
            .field("ended", &self.events.ended)
            .finish_non_exhaustive()
    }
}

/// One completion chunk, as much of it as the gateway reads: borrowed from the event where
/// the text has no escapes. Unknown fields are ignored.
#[derive(Deserialize)]
struct Chunk<'a> {
    #[serde(default, borrow, deserialize_with = "null_as_default")]
    choices: Vec<Choice<'a>>,
    usage: Option<Value>,
    /// JSON `null` reads as `None`.
    error: Option<Value>,
}

#[derive(Deserialize)]
struct Choice<'a> {
    #[serde(default, deserialize_with = "null_as_default")]
    index: u64,
    #[serde(default, borrow)]
    text: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    finish_reason: Option<Cow<'a, str>>,
}

/// A field that may be `null` (some servers send `"choices": null` on a usage chunk) reads as
/// its default, as when it is missing.
fn null_as_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

impl OpenAiClient {
    /// A client for the server at `base` (`http://host:port`), asking for `model`, with the
    /// upstream's own API key when it needs one; `salted`: each request carries its tenant's
    /// `cache_salt`; `report_cached`: the server's count of cached prompt tokens is passed on
    /// (only salted, and only for a server that keeps its cache per salt: otherwise that count
    /// tells a tenant what other tenants' prompts began with).
    pub fn new(
        base: &str,
        model: &str,
        key: Option<String>,
        salted: bool,
        report_cached: bool,
    ) -> Result<OpenAiClient, String> {
        let base = base.trim_end_matches('/');
        let uri = |path: &str| -> Result<Uri, String> {
            let uri: Uri = format!("{base}{path}")
                .parse()
                .map_err(|e| format!("{base:?} is not a base URL: {e}"))?;
            match (uri.scheme_str(), uri.host()) {
                (Some("http"), Some(_)) => Ok(uri),
                _ => Err(format!(
                    "{base:?} is not an http://host[:port] URL (plain HTTP only)"
                )),
            }
        };
        let authorization = key
            .map(|k| {
                let mut v = HeaderValue::try_from(format!("Bearer {k}"))
                    .map_err(|_| "the upstream key is not a valid header value".to_owned())?;
                v.set_sensitive(true);
                Ok::<_, String>(v)
            })
            .transpose()?;
        Ok(OpenAiClient {
            models: uri("/v1/models")?,
            completions: uri("/v1/completions")?,
            model: model.to_owned(),
            authorization,
            salted,
            report_cached: salted && report_cached,
            http: ThreadLocal::new(),
        })
    }

    /// The client of the `[[workers]]` entry at `endpoint` with `upstream`'s settings: its key
    /// read from the variable `key_env` names, when it names one.
    pub fn configured(
        endpoint: &str,
        upstream: &crate::config::OpenAiUpstream,
    ) -> Result<OpenAiClient, String> {
        let key = upstream
            .key_env
            .as_ref()
            .and_then(|v| std::env::var(v).ok());
        OpenAiClient::new(
            endpoint,
            &upstream.model,
            key,
            upstream.cache_salt,
            upstream.report_cached_tokens,
        )
    }

    /// The calling thread's pooled client.
    fn http(&self) -> &Client<HttpConnector, Full<Bytes>> {
        self.http.get_or(|| {
            let mut connector = HttpConnector::new();
            connector.set_connect_timeout(Some(CONNECT_TIMEOUT));
            connector.set_nodelay(true);
            Client::builder(TokioExecutor::new()).build(connector)
        })
    }

    /// Sends `method uri` with `body`, the key and `headers`.
    async fn send(
        &self,
        method: Method,
        uri: &Uri,
        headers: http::HeaderMap,
        body: Bytes,
    ) -> Result<http::Response<Incoming>, String> {
        let mut request = Request::builder()
            .method(method)
            .uri(uri.clone())
            .body(Full::new(body))
            .map_err(|e| e.to_string())?;
        let h = request.headers_mut();
        h.extend(headers);
        if let Some(auth) = &self.authorization {
            h.insert(AUTHORIZATION, auth.clone());
        }
        self.http().request(request).await.map_err(|e| {
            // The connector's reason (refused, timed out) is the error's source.
            match std::error::Error::source(&e) {
                Some(source) => format!("{e}: {source}"),
                None => e.to_string(),
            }
        })
    }

    /// Whether the server answers `GET /v1/models` and lists the model.
    pub async fn health(&self) -> Result<(), String> {
        let probe = async {
            let r = self
                .send(
                    Method::GET,
                    &self.models,
                    http::HeaderMap::new(),
                    Bytes::new(),
                )
                .await
                .map_err(|e| format!("GET /v1/models: {e}"))?;
            let status = r.status();
            let body = read_bounded(r).await?;
            if !status.is_success() {
                return Err(format!("GET /v1/models answered {status}"));
            }
            let listed: Value = serde_json::from_slice(&body)
                .map_err(|e| format!("GET /v1/models is not JSON: {e}"))?;
            let found = listed["data"]
                .as_array()
                .is_some_and(|d| d.iter().any(|m| m["id"] == self.model.as_str()));
            if found {
                Ok(())
            } else {
                Err(format!("GET /v1/models does not list {:?}", self.model))
            }
        };
        tokio::time::timeout(PROBE_TIMEOUT, probe)
            .await
            .unwrap_or_else(|_| Err(format!("no answer within {} s", PROBE_TIMEOUT.as_secs())))
    }

    /// The upstream request's JSON for `request` (its token ids as a streamed completion),
    /// and how many tokens its prompt has.
    fn completion_body(&self, request: &GenerateRequest) -> Result<(Vec<u8>, u32), Status> {
        let Some(Prompt::Tokens(prompt)) = &request.prompt else {
            return Err(Status::internal("the gateway sends token prompts only"));
        };
        let sampling = request.sampling.unwrap_or_default();
        let body = CompletionRequest {
            model: &self.model,
            prompt: &prompt.ids,
            max_tokens: request.max_new_tokens,
            stream: true,
            stream_options: StreamOptions {
                include_usage: true,
            },
            temperature: sampling.temperature,
            top_p: sampling.top_p,
            seed: sampling.seed.map(signed_seed),
            stop: &request.stop,
            cache_salt: self
                .salted
                .then(|| cache_salt(&request.tenant, &request.cache_salt)),
        };
        let json = serde_json::to_vec(&body)
            .map_err(|e| Status::internal(format!("encoding the upstream request: {e}")))?;
        Ok((json, u32::try_from(prompt.ids.len()).unwrap_or(u32::MAX)))
    }

    /// Starts the completion, sending `headers` along (the trace context); a refusal or
    /// transport failure is a status with the worker protocol's error code. `counter` counts
    /// the completion's tokens when the upstream sends no usage.
    pub async fn generate(
        &self,
        request: GenerateRequest,
        headers: http::HeaderMap,
        counter: TokenCounter,
    ) -> Result<SseStream, Status> {
        let (body, prompt_tokens) = self.completion_body(&request)?;
        let mut headers = headers;
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        let response = self
            .send(Method::POST, &self.completions, headers, body.into())
            .await
            .map_err(|e| Status::unavailable(format!("the upstream is unreachable: {e}")))?;
        let status = response.status();
        if !status.is_success() {
            let wait = response
                .headers()
                .get(http::header::RETRY_AFTER)
                .and_then(|v| retry_after_secs(v.to_str().ok()?, SystemTime::now()));
            let text = read_bounded(response).await.unwrap_or_default();
            let mut refused = refusal(status.as_u16(), &text, self.salted);
            if let Some(wait) = wait
                && error_code(&refused) == Some("rate_limit_exceeded")
            {
                refused.metadata_mut().insert(RETRY_AFTER_KEY, wait.into());
            }
            return Err(refused);
        }
        let asked = Asked {
            prompt_tokens,
            max_tokens: request.max_new_tokens,
            stop: request.stop,
        };
        Ok(SseStream::new(
            Box::pin(
                response
                    .into_body()
                    .into_data_stream()
                    .map_err(BodyError::from),
            ),
            asked,
            counter,
            self.report_cached,
        ))
    }
}

/// A `Retry-After` value in seconds from `now`: delay-seconds, or an HTTP-date (a date
/// already past is 0: retry at once). Anything else is no value.
fn retry_after_secs(value: &str, now: SystemTime) -> Option<u64> {
    let value = value.trim();
    value.parse::<u64>().ok().or_else(|| {
        let at = httpdate::parse_http_date(value).ok()?;
        Some(
            at.duration_since(now)
                .map_or(0, |d| d.as_secs_f64().ceil() as u64),
        )
    })
}

async fn read_bounded<B>(response: http::Response<B>) -> Result<Bytes, String>
where
    B: hyper::body::Body,
    B::Error: Into<BodyError>,
{
    Limited::new(response.into_body(), MAX_EVENT_BYTES)
        .collect()
        .await
        .map(|b| b.to_bytes())
        .map_err(|e| match e.downcast::<http_body_util::LengthLimitError>() {
            Ok(_) => format!("the upstream's answer exceeds {MAX_EVENT_BYTES} bytes"),
            Err(e) => e.to_string(),
        })
}

/// A client's seed as an OpenAI-compatible upstream takes it: a signed 64-bit integer. The
/// gateway keeps a negative seed's bits in an unsigned one (the worker protocol's type); this
/// gives them back, so `-1` goes out as `-1`, and no seed goes out of the signed range (a
/// server checking it would refuse a valid request).
fn signed_seed(seed: u64) -> i64 {
    i64::from_ne_bytes(seed.to_ne_bytes())
}

/// The status for an upstream's error answer (`http`: its HTTP status and body) to a request
/// that carried a cache salt or not (`salted`). A server that refuses the salt (vLLM's V0
/// engine does; others ignore an unknown field) refuses every request for it: the gateway's
/// configuration, not the client's mistake. The error object is OpenAI's `{"error": {…}}`, or
/// the body itself (`{"object": "error", "message": …}`, as SGLang and older vLLM answer).
fn refusal(http: u16, body: &[u8], salted: bool) -> Status {
    let parsed: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let error = match &parsed["error"] {
        e @ Value::Object(_) => e,
        _ => &parsed,
    };
    // The field named as the one at fault, or a message that says an unknown field is it (one
    // that merely quotes the request, which holds the salt, is about something else).
    let refused_field = [
        "nrecognized",
        "xtra",
        "not permitted",
        "nknown",
        "unexpected",
        "not supported",
        "nsupported",
    ];
    let about_salt = error["param"] == "cache_salt"
        || error["message"].as_str().is_some_and(|m| {
            m.contains("cache_salt") && refused_field.iter().any(|w| m.contains(w))
        });
    if salted && matches!(http, 400 | 422) && about_salt {
        return error_code_status(
            Code::Internal,
            "the upstream does not take the cache_salt field: set cache_salt = false on its \
             [[workers]] entry (its prefix cache is then shared across tenants)"
                .to_owned(),
            "internal_error",
        );
    }
    coded(Some(http), error)
}

/// The status for an upstream's OpenAI error object (`message`, `type`, `code`), from an
/// error answer (`http`, its status) or from an error event after the 200 (`None`), coded
/// like the worker protocol's: a code of the API's table keeps its meaning (another Bulkhead
/// gateway upstream says `kv_integrity_error` so), and only an upstream in trouble — a 5xx,
/// or an event, without such a code — reads as unavailable (its route marked failed).
fn coded(http: Option<u16>, error: &Value) -> Status {
    let message = error["message"]
        .as_str()
        .unwrap_or("the upstream refused the request")
        .chars()
        .take(1000)
        .collect::<String>();
    // vLLM's and llama.cpp's servers give the HTTP status as `code` (a number), in an error
    // event too: a client's bad request mid-stream is not a server down.
    let http = http.or_else(|| {
        error["code"]
            .as_u64()
            .and_then(|c| u16::try_from(c).ok())
            .filter(|c| (400..600).contains(c))
    });
    let own_code = error["code"].as_str();
    let code = own_code
        .or_else(|| error["type"].as_str())
        .unwrap_or_default();
    match (http, code) {
        // A key the upstream refuses (or none it was given: OpenAI's code is null then) is the
        // gateway's misconfiguration, not the client's.
        (Some(401 | 403), _) if matches!(own_code, None | Some("invalid_api_key")) => {
            error_code_status(
                Code::Internal,
                "the upstream refused the gateway's key".to_owned(),
                "internal_error",
            )
        }
        // Refused for another reason (another gateway's policy): this request's failure.
        (Some(401 | 403), _) => error_code_status(
            Code::Internal,
            format!("the upstream refused the request: {message}"),
            "internal_error",
        ),
        // Another Bulkhead gateway broke this one answer (its worker's), as its `code` says
        // (a server's own 5xx may carry that word as its `type`): not a server down.
        (Some(500) | None, _) if own_code == Some("internal_error") => {
            error_code_status(Code::Internal, message, "internal_error")
        }
        // llama.cpp's server names it by its `type`.
        (_, "context_length_exceeded" | "exceed_context_size_error") => refused_upstream(
            error_code_status(Code::InvalidArgument, message, "context_length_exceeded"),
        ),
        (_, "kv_integrity_error") => {
            error_code_status(Code::Internal, message, "kv_integrity_error")
        }
        (Some(429), _) | (_, "rate_limit_exceeded") => refused_upstream(error_code_status(
            Code::ResourceExhausted,
            message,
            "rate_limit_exceeded",
        )),
        // vLLM's (and OpenAI's) say it in their message only: "This model's maximum context
        // length is 2048 tokens. However, you requested 2100 tokens …".
        (Some(400 | 413 | 422), _) if message.contains("maximum context length") => {
            refused_upstream(error_code_status(
                Code::InvalidArgument,
                message,
                "context_length_exceeded",
            ))
        }
        // A 404 is not the client's: the gateway sends only its own path and configured model,
        // so the server no longer serves it (renamed, reloaded) and is in trouble as a 5xx is.
        (Some(400 | 413 | 422), _) => {
            error_code_status(Code::InvalidArgument, message, "invalid_request_error")
        }
        (Some(status), _) => {
            Status::unavailable(format!("the upstream answered {status}: {message}"))
        }
        (None, _) => Status::unavailable(format!("the upstream failed mid-stream: {message}")),
    }
}

/// `status`, a refusal the upstream decided (its context, its load), as its own: the layer that
/// serves as a colocated worker's, decode — the gateway had admitted the request, and its record
/// must not say the gateway refused it (a `context_length` set above the server's own is the
/// misconfiguration that record shows).
fn refused_upstream(mut status: Status) -> Status {
    status
        .metadata_mut()
        .insert(REFUSED_BY_KEY, MetadataValue::from_static("decode"));
    status
}

/// The status for an error event (`event: error`, or llama.cpp's `error:` field): its data is
/// an OpenAI error (`{"error": {…}}`), the error object alone, or text.
fn error_event(data: &str) -> Status {
    let value = serde_json::from_str::<Value>(data)
        .ok()
        .filter(Value::is_object)
        .unwrap_or_else(|| serde_json::json!({ "message": data }));
    let error = if value["error"].is_object() {
        &value["error"]
    } else {
        &value
    };
    coded(None, error)
}

/// What the gateway asked the upstream for.
struct Asked {
    /// The prompt's tokens (the ids sent).
    prompt_tokens: u32,
    max_tokens: u32,
    stop: Vec<String>,
}

impl SseStream {
    /// `report_cached`: the server's count of cached prompt tokens is the tenant's own (salted,
    /// and the server keeps its cache per salt) and is passed on; otherwise it is reported as 0.
    fn new(body: Body, asked: Asked, counter: TokenCounter, report_cached: bool) -> SseStream {
        SseStream {
            body,
            buf: Vec::new(),
            counting: None,
            scanned: 0,
            events: Events {
                ready: VecDeque::new(),
                finish: FinishReason::Stop,
                usage: None,
                cached_tokens: 0,
                report_cached,
                prompt_tokens: asked.prompt_tokens,
                max_tokens: asked.max_tokens,
                stops: StopWatch::new(asked.stop),
                stopped_by: None,
                closing: false,
                received: 0,
                text: String::new(),
                tail: String::new(),
                counter,
                chunks: 0,
                recount: None,
                ended: false,
                failure: None,
            },
        }
    }

    /// The completion tokens of the text received so far (a request that ends before `Done`:
    /// its client left, or the stream failed), counted with the served model's tokenizer —
    /// or, where it cannot count, its chunks — and at most the request's `max_tokens`. A long
    /// text is counted on the blocking pool, as the answer's recount is: never on this thread,
    /// whose other connections it would hold up.
    pub fn generated(&self) -> impl Future<Output = u32> + Send + 'static {
        let e = &self.events;
        // Counted here, or (only a text too long for that) copied for the blocking pool.
        let counting = self
            .generated_now()
            .ok_or_else(|| (e.counter.count.clone(), e.text.clone()));
        let (chunks, max_tokens) = (e.chunks, e.max_tokens);
        async move {
            match counting {
                Ok(n) => n,
                Err((count, text)) => tokio::task::spawn_blocking(move || count(&text))
                    .await
                    .ok()
                    .flatten()
                    .unwrap_or(chunks)
                    .min(max_tokens),
            }
        }
    }

    /// [`SseStream::generated`] when the text is short enough to count here; `None` otherwise.
    pub fn generated_now(&self) -> Option<u32> {
        let e = &self.events;
        let counted = |text: &str| match text {
            "" => Some(0),
            text => (e.counter.count)(text),
        };
        (e.text.len() <= crate::api::INLINE_TOKENIZE_BYTES)
            .then(|| counted(&e.text).unwrap_or(e.chunks).min(e.max_tokens))
    }

    /// The next token or the closing `Done`; `None` after it. Cancel-safe.
    pub async fn message(&mut self) -> Result<Option<GenerateResponse>, Status> {
        loop {
            if let Some(item) = self.events.ready.pop_front() {
                return Ok(Some(item));
            }
            if let Some(failure) = self.events.failure.take() {
                return Err(failure);
            }
            if let Some(text) = self.events.recount.take() {
                let count = self.events.counter.count.clone();
                // A short answer is counted here (less than a hop to the blocking pool), a
                // long one there, so that it never holds up this thread's other connections.
                if text.len() <= crate::api::INLINE_TOKENIZE_BYTES {
                    let tokens = self.events.recounted(count(&text))?;
                    self.events.close(tokens);
                    continue;
                }
                self.counting = Some(tokio::task::spawn_blocking(move || count(&text)));
            }
            if let Some(counting) = &mut self.counting {
                let counted = counting.await;
                self.counting = None;
                let counted = counted
                    .map_err(|e| broken(&format!("counting the answer's tokens failed: {e}")))?;
                let tokens = self.events.recounted(counted)?;
                self.events.close(tokens);
                continue;
            }
            if self.events.ended {
                return Ok(None);
            }
            match self.body.next().await {
                Some(Ok(bytes)) => {
                    // Most reads hold whole events: parse them where they lie, and keep only
                    // an unfinished tail.
                    if self.buf.is_empty() {
                        let parsed = self.events.parse_all(&bytes);
                        self.buf.extend_from_slice(&bytes[parsed..]);
                    } else {
                        self.buf.extend_from_slice(&bytes);
                        if event_end(&self.buf, self.scanned).is_some() {
                            let parsed = self.events.parse_all(&self.buf);
                            self.buf.drain(..parsed);
                        }
                    }
                    // A separator is at most 4 bytes: one could end in the next read only
                    // if it starts in the last 3.
                    self.scanned = self.buf.len().saturating_sub(3);
                    if self.buf.len() > MAX_EVENT_BYTES {
                        return Err(broken("an upstream SSE event is too long"));
                    }
                }
                Some(Err(e)) => {
                    return Err(Status::unavailable(format!(
                        "the upstream's stream broke: {e}"
                    )));
                }
                None => {
                    return Err(Status::unavailable(
                        "the upstream's stream ended before [DONE]",
                    ));
                }
            }
        }
    }
}

/// One SSE event, as far as the gateway reads it.
#[derive(Debug, PartialEq, Eq)]
struct SseEvent<'a> {
    /// The `data:` lines' values, joined by newlines (borrowed when there is one: the usual
    /// event); for an `error:` field without data, that field's value.
    data: Cow<'a, str>,
    /// The event says it is a failure: `event: error` (the SSE way), or an `error:` field
    /// (llama.cpp's server sends its failures so, and a `[DONE]` after them).
    error: bool,
}

/// The first complete event in `buf`: its length with the blank line that ends it, and the
/// event. A line ends at `\r\n`, `\n` or `\r`, as SSE has it; an event at a blank line.
fn next_event(buf: &[u8]) -> Option<(usize, SseEvent<'_>)> {
    let (at, sep) = event_end(buf, 0)?;
    let event = match std::str::from_utf8(&buf[..at]) {
        Ok(text) => sse_event(text),
        Err(_) => {
            let text = String::from_utf8_lossy(&buf[..at]);
            let lossy = sse_event(&text);
            SseEvent {
                data: Cow::Owned(lossy.data.into_owned()),
                error: lossy.error,
            }
        }
    };
    Some((at + sep, event))
}

/// The fields of an event's `text` that the gateway reads.
fn sse_event(text: &str) -> SseEvent<'_> {
    let (mut first, mut joined, mut error, mut error_field) = (None, None::<String>, false, None);
    for line in text.split(['\r', '\n']) {
        if let Some(value) = field(line, "data") {
            match (first, &mut joined) {
                (None, _) => first = Some(value),
                (Some(one), None) => joined = Some(format!("{one}\n{value}")),
                (Some(_), Some(all)) => {
                    all.push('\n');
                    all.push_str(value);
                }
            }
        } else if let Some(value) = field(line, "event") {
            error |= value == "error";
        } else if let Some(value) = field(line, "error") {
            error = true;
            error_field.get_or_insert(value);
        }
    }
    let data = match (joined, first.or(error_field)) {
        (Some(all), _) => Cow::Owned(all),
        (None, one) => Cow::Borrowed(one.unwrap_or_default()),
    };
    SseEvent { data, error }
}

/// The value of `line` if it is the field `name`.
fn field<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    Some(line.strip_prefix(name)?.strip_prefix(':')?.trim_start())
}

/// The length of the line break at `buf[i]` (`\r\n`, `\n` or `\r`; 0 for none), or `None`
/// when that cannot be told yet: a `\r` that ends `buf` may be the start of a `\r\n`.
fn line_break(buf: &[u8], i: usize) -> Option<usize> {
    match (buf.get(i), buf.get(i + 1)) {
        (Some(b'\r'), Some(b'\n')) => Some(2),
        (Some(b'\r'), None) => None,
        (Some(b'\r' | b'\n'), _) => Some(1),
        _ => Some(0),
    }
}

/// Where the first event in `buf` ends: the offset of the line break that ends its last line,
/// and the length of that break and the blank line's after it. A blank line's `\r` that ends
/// `buf` ends the event (whether a `\n` follows or not: that would be a blank line of its
/// own, an empty event). The search starts at `from`: a break that starts before it is not
/// found (one found from inside a `\r\n` ends the event at the same byte).
fn event_end(buf: &[u8], mut from: usize) -> Option<(usize, usize)> {
    loop {
        let i = from + memchr::memchr2(b'\n', b'\r', buf.get(from..)?)?;
        let first = line_break(buf, i)?;
        match line_break(buf, i + first) {
            None => return Some((i, first + 1)),
            Some(0) if i + first == buf.len() => return None,
            Some(0) => from = i + first,
            Some(second) => return Some((i, first + second)),
        }
    }
}

impl Events {
    /// Parses every complete event in `buf` up to `[DONE]` or a failure (which ends the
    /// stream too); returns how many bytes they took.
    fn parse_all(&mut self, buf: &[u8]) -> usize {
        let mut parsed = 0;
        while !self.ended
            && let Some((len, event)) = next_event(&buf[parsed..])
        {
            let parsed_event = if event.error {
                Err(error_event(&event.data))
            } else {
                self.parse(&event.data)
            };
            if let Err(failure) = parsed_event {
                self.failure = Some(failure);
                self.ended = true;
            }
            parsed += len;
        }
        parsed
    }

    fn parse(&mut self, data: &str) -> Result<(), Status> {
        if data.is_empty() {
            return Ok(());
        }
        if data == "[DONE]" {
            // Every server ends an answer with a chunk that says why; a stream without one
            // was cut short, by a failure the server sent in a way not read here.
            if !self.closing {
                return Err(broken(
                    "the upstream ended its stream without a finish_reason: an answer cut short",
                ));
            }
            return self.done();
        }
        let chunk: Chunk<'_> = serde_json::from_str(data).map_err(|e| {
            broken(&format!(
                "an upstream SSE event is not a completion chunk: {e}"
            ))
        })?;
        if let Some(error) = chunk.error {
            return Err(coded(None, &error));
        }
        if let Some(usage) = chunk.usage.filter(Value::is_object) {
            let n = |v: &Value| v.as_u64().and_then(|v| u32::try_from(v).ok());
            if let Some(c) = n(&usage["completion_tokens"]) {
                self.usage = Some(c);
            }
            if self.report_cached {
                let cached = n(&usage["prompt_tokens_details"]["cached_tokens"]).unwrap_or(0);
                self.cached_tokens = cached.min(self.prompt_tokens);
            }
        }
        let mut choices = chunk.choices.into_iter();
        let Some(choice) = choices.next() else {
            return Ok(());
        };
        if choice.index != 0 || choices.next().is_some() {
            return Err(broken(
                "the upstream sent several choices; the gateway asks for one",
            ));
        }
        self.closing |= choice.finish_reason.is_some();
        if let Some(text) = choice.text.filter(|t| !t.is_empty()) {
            self.chunks += 1;
            self.received += text.len();
            if !self.counter.can_hold(self.max_tokens, self.received) {
                return Err(broken(&format!(
                    "the upstream sent more text than {} tokens hold",
                    self.max_tokens
                )));
            }
            match self.stops.push(&text) {
                StopScan::Continue(out) => self.emit(out, self.closing),
                StopScan::Stopped { text, stop } => {
                    self.emit(text, true);
                    self.stopped_by = Some(stop);
                    self.finish = FinishReason::Stop;
                    return self.done();
                }
            }
        }
        match choice.finish_reason.as_deref() {
            Some("length") => self.finish = FinishReason::Length,
            // The server withheld the rest: the client is told so, not that the answer ended
            // where the model wanted it to.
            Some("content_filter") => self.finish = FinishReason::ContentFilter,
            // vLLM's ends of a generation cut short (an aborted request, a failed KV load
            // between its prefill and decode): followed by `[DONE]` like any end, they are
            // failures, never a 200 that says the answer stopped where it wanted to. This
            // request's, not the server's: it stays routed to.
            Some(reason @ ("abort" | "error")) => {
                return Err(broken(&format!(
                    "the upstream ended the generation with finish_reason {reason:?}"
                )));
            }
            Some(_) => self.finish = FinishReason::Stop,
            None => {}
        }
        Ok(())
    }

    /// Text for the client: a token, or (`last`: it came with the finish reason, or ends the
    /// answer at a stop string) part of the answer's end, not a token of its own.
    fn emit(&mut self, text: String, last: bool) {
        if text.is_empty() {
            return;
        }
        self.text.push_str(&text);
        if last {
            self.tail.push_str(&text);
        } else {
            self.ready.push_back(GenerateResponse {
                item: Some(Item::Token(Token {
                    text,
                    ..Token::default()
                })),
            });
        }
    }

    /// The answer's end, with the text held back for a stop string that did not come: `Done`,
    /// or — when the upstream's count is not to be taken — what to count first.
    fn done(&mut self) -> Result<(), Status> {
        let held = self.stops.finish();
        self.emit(held, true);
        self.ended = true;
        match self.upstream_count()? {
            Some(tokens) => self.close(tokens),
            None => {
                self.recount = Some(match &self.stopped_by {
                    Some(stop) => format!("{}{stop}", self.text),
                    None => self.text.clone(),
                });
            }
        }
        Ok(())
    }

    /// `Done`, the answer being `completion_tokens` long.
    fn close(&mut self, completion_tokens: u32) {
        self.ready.push_back(GenerateResponse {
            item: Some(Item::Done(Done {
                finish_reason: self.finish.into(),
                prompt_tokens: self.prompt_tokens,
                completion_tokens,
                text_tail: std::mem::take(&mut self.tail),
                cached_tokens: self.cached_tokens,
            })),
        });
    }

    /// The completion's tokens as the upstream counted them, when that count is to be taken:
    /// at most `max_tokens` and no fewer than the pieces of text it sent or than its text can
    /// be; `None` when it is to be counted again (see [`Events::recounted`]). A count above
    /// `max_tokens` says the upstream ignored it: the request fails.
    fn upstream_count(&self) -> Result<Option<u32>, Status> {
        match self.usage {
            Some(c) if c > self.max_tokens => Err(broken(&format!(
                "the upstream counts {c} completion tokens, more than the {} asked for",
                self.max_tokens
            ))),
            Some(c)
                if self.stopped_by.is_none()
                    && c >= self.chunks
                    && self.counter.can_hold(c, self.received) =>
            {
                Ok(Some(c))
            }
            _ => Ok(None),
        }
    }

    /// The completion's tokens from the tokenizer's count of what it generated — the text the
    /// client got, and the stop string that ended it when the gateway cut it there — (its
    /// pieces when the text cannot be tokenized, `counted` `None`), at most `max_tokens`; a
    /// count well above `max_tokens` fails the request.
    fn recounted(&self, counted: Option<u32>) -> Result<u32, Status> {
        let counted = counted.unwrap_or(self.chunks);
        if counted > recount_bound(self.max_tokens) {
            return Err(broken(&format!(
                "the upstream sent about {counted} tokens of text, more than the {} asked for",
                self.max_tokens
            )));
        }
        Ok(counted.min(self.max_tokens))
    }
}

/// The most tokens a recount of an answer of `max_tokens` may find before the answer is
/// taken for one that ignored `max_tokens`: generated text tokenized again may split into a
/// few more tokens than the model generated, never into a quarter more.
fn recount_bound(max_tokens: u32) -> u32 {
    max_tokens.saturating_add(max_tokens / 4).saturating_add(4)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use bulkhead_worker::serve::proto::{SamplingParams, TokenPrompt};

    #[tokio::test]
    async fn an_answer_over_the_bound_is_an_error_and_one_at_it_is_read() {
        let answer = |n: usize| http::Response::new(Full::new(Bytes::from(vec![b'x'; n])));
        let at = read_bounded(answer(MAX_EVENT_BYTES))
            .await
            .expect("at the bound");
        assert_eq!(at.len(), MAX_EVENT_BYTES);
        let over = read_bounded(answer(MAX_EVENT_BYTES + 1))
            .await
            .expect_err("over the bound");
        assert!(over.contains("exceeds"), "{over}");
    }

    #[test]
    fn retry_after_in_seconds_or_as_an_http_date() {
        let now = httpdate::parse_http_date("Sun, 06 Nov 1994 08:49:37 GMT").expect("a date");
        assert_eq!(retry_after_secs(" 17 ", now), Some(17));
        assert_eq!(
            retry_after_secs("Sun, 06 Nov 1994 08:50:07 GMT", now),
            Some(30)
        );
        assert_eq!(
            retry_after_secs("Sun, 06 Nov 1994 08:49:36 GMT", now),
            Some(0),
            "a date already past: at once"
        );
        assert_eq!(retry_after_secs("soon", now), None);
        assert_eq!(retry_after_secs("-5", now), None);
    }

    fn stream(chunks: &[&str]) -> SseStream {
        stream_reporting(chunks, true)
    }

    /// [`stream`] of a request whose upstream's count of cached tokens is passed on or not.
    fn stream_reporting(chunks: &[&str], report_cached: bool) -> SseStream {
        stream_asking(chunks, report_cached, 100, &[])
    }

    /// The stream of a request of 5 prompt tokens, `max_tokens` and `stop`, whose tokens are
    /// words of at most 16 bytes.
    fn stream_asking(
        chunks: &[&str],
        report_cached: bool,
        max_tokens: u32,
        stop: &[&str],
    ) -> SseStream {
        stream_counting(chunks, report_cached, max_tokens, stop, words())
    }

    /// Counts words: a stand-in tokenizer.
    fn words() -> TokenCounter {
        TokenCounter::new(16, |t| u32::try_from(t.split_whitespace().count()).ok())
    }

    /// [`stream_asking`] with the tokens counted by `counter`.
    fn stream_counting(
        chunks: &[&str],
        report_cached: bool,
        max_tokens: u32,
        stop: &[&str],
        counter: TokenCounter,
    ) -> SseStream {
        let pieces = chunks.iter().map(|c| Bytes::from(c.to_string())).collect();
        stream_of(pieces, report_cached, max_tokens, stop, counter)
    }

    /// [`stream_counting`] of a body that arrives as `pieces` (cut anywhere, inside a
    /// character too).
    fn stream_of(
        pieces: Vec<Bytes>,
        report_cached: bool,
        max_tokens: u32,
        stop: &[&str],
        counter: TokenCounter,
    ) -> SseStream {
        let owned: Vec<Result<Bytes, BodyError>> = pieces.into_iter().map(Ok).collect();
        let asked = Asked {
            prompt_tokens: 5,
            max_tokens,
            stop: stop.iter().map(|s| (*s).to_owned()).collect(),
        };
        SseStream::new(
            Box::pin(futures_util::stream::iter(owned)),
            asked,
            counter,
            report_cached,
        )
    }

    /// A stream cut before its end is counted by its text, not its chunks: two chunks of three
    /// words each are six tokens (a server that sends several tokens a chunk would otherwise
    /// be charged, recorded and reported a third of what it generated).
    #[tokio::test]
    async fn a_stream_cut_midway_counts_the_tokens_of_its_text_not_its_chunks() {
        let chunks = [chunk("a b c", None), chunk(" d e f", None)];
        let pieces: Vec<&str> = chunks.iter().map(String::as_str).collect();
        let mut s = stream_counting(&pieces, true, 100, &[], words());
        assert_eq!(s.generated().await, 0, "nothing yet");
        let mut messages = 0;
        while let Ok(Some(m)) = s.message().await {
            assert!(matches!(m.item, Some(Item::Token(_))), "{m:?}");
            messages += 1;
        }
        assert_eq!(messages, 2);
        assert_eq!(s.generated_now(), Some(6));
        assert_eq!(s.generated().await, 6);
        let mut capped = stream_counting(&pieces, true, 4, &[], words());
        while let Ok(Some(_)) = capped.message().await {}
        assert_eq!(capped.generated().await, 4, "never past max_tokens");
    }

    /// For the policies' tests of a held request: one chunk per text, counted as words, then
    /// the body ends before `[DONE]` (a server gone) or, with `stalls`, sends nothing more.
    pub(crate) fn held_stream(texts: &[&str], stalls: bool) -> SseStream {
        let events: Vec<Result<Bytes, BodyError>> = texts
            .iter()
            .map(|t| Ok(Bytes::from(chunk(t, None))))
            .collect();
        let events = futures_util::stream::iter(events);
        let body: Body = if stalls {
            Box::pin(events.chain(futures_util::stream::pending()))
        } else {
            Box::pin(events)
        };
        let asked = Asked {
            prompt_tokens: 10,
            max_tokens: 990,
            stop: Vec::new(),
        };
        SseStream::new(body, asked, words(), false)
    }

    /// [`held_stream`] that ends: its last chunk says `stop`, then `[DONE]`.
    pub(crate) fn finished_stream(texts: &[&str]) -> SseStream {
        let mut events: Vec<Result<Bytes, BodyError>> = texts
            .iter()
            .map(|t| Ok(Bytes::from(chunk(t, None))))
            .collect();
        events.push(Ok(Bytes::from(chunk("", Some("stop")))));
        events.push(Ok(Bytes::from_static(b"data: [DONE]\n\n")));
        let asked = Asked {
            prompt_tokens: 10,
            max_tokens: 990,
            stop: Vec::new(),
        };
        SseStream::new(
            Box::pin(futures_util::stream::iter(events)),
            asked,
            words(),
            false,
        )
    }

    /// The event of one completion chunk: `text`, and `finish` as its finish reason.
    fn chunk(text: &str, finish: Option<&str>) -> String {
        let chunk = serde_json::json!({"choices": [{"text": text, "finish_reason": finish}]});
        format!("data: {chunk}\n\n")
    }

    async fn drain(mut s: SseStream) -> Result<(String, Done), Status> {
        let mut text = String::new();
        loop {
            match s.message().await?.and_then(|m| m.item) {
                Some(Item::Token(t)) => text.push_str(&t.text),
                Some(Item::Done(d)) => {
                    text.push_str(&d.text_tail);
                    return Ok((text, d));
                }
                Some(Item::Progress(_) | Item::PrefillDone(_)) => {
                    return Err(Status::internal("an HTTP upstream's progress"));
                }
                None => return Err(Status::internal("ended without Done")),
            }
        }
    }

    #[tokio::test]
    async fn events_split_anywhere_become_tokens_and_done_with_usage() {
        let s = stream(&[
            "data: {\"choices\":[{\"text\":\"Hel\",\"finish_reason\":null}]}\n",
            "\ndata: {\"choices\":[{\"text\":\"lo\",\"finish_reason\":\"length\"}]}\r\n\r\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2,",
            "\"prompt_tokens_details\":{\"cached_tokens\":4}}}\n\n",
            "data: [DONE]\n\n",
        ]);
        let (text, done) = drain(s).await.expect("a complete stream");
        assert_eq!(text, "Hello");
        assert_eq!(done.finish_reason, i32::from(FinishReason::Length));
        assert_eq!((done.prompt_tokens, done.completion_tokens), (5, 2));
        assert_eq!(
            done.cached_tokens, 4,
            "the upstream's prompt cache, passed through"
        );
    }

    #[tokio::test]
    async fn text_that_comes_with_the_finish_reason_is_the_answers_end_not_a_token() {
        // Another Bulkhead gateway sends the text it held back for a stop string with its
        // finish: counted as a token, an answer of the one token asked for read as two.
        let mut s = stream(&[
            "data: {\"choices\":[{\"text\":\"T\",\"finish_reason\":null}]}\n\n",
            "data: {\"choices\":[{\"text\":\"he\",\"finish_reason\":\"length\"}]}\n\n",
            "data: [DONE]\n\n",
        ]);
        let mut tokens = Vec::new();
        let done = loop {
            match s.message().await.expect("parses").and_then(|m| m.item) {
                Some(Item::Token(t)) => tokens.push(t.text),
                Some(Item::Done(d)) => break d,
                other => panic!("{other:?}"),
            }
        };
        assert_eq!(tokens, ["T"]);
        assert_eq!(done.text_tail, "he");
        assert_eq!(done.finish_reason, i32::from(FinishReason::Length));
    }

    #[tokio::test]
    async fn a_generation_the_upstream_aborted_or_failed_is_an_error_not_a_stop() {
        for reason in ["abort", "error"] {
            let event = chunk("a", Some(reason));
            let failed = drain(stream(&[&event, "data: [DONE]\n\n"])).await;
            let status = failed.expect_err("a cut generation fails the request");
            assert_eq!(status.code(), Code::Internal, "{reason}");
            assert_eq!(
                error_code(&status),
                Some("internal_error"),
                "the server stays up"
            );
            assert!(status.message().contains(reason), "{status:?}");
        }
    }

    #[tokio::test]
    async fn a_filtered_answer_is_said_to_be_filtered_not_finished() {
        let body = "data: {\"choices\":[{\"text\":\"Hel\"}]}\n\n\
                    data: {\"choices\":[{\"text\":\"\",\"finish_reason\":\"content_filter\"}]}\n\n\
                    data: [DONE]\n\n";
        let (text, done) = drain(stream(&[body])).await.expect("a complete stream");
        assert_eq!(text, "Hel");
        assert_eq!(done.finish_reason, i32::from(FinishReason::ContentFilter));
    }

    #[tokio::test]
    async fn a_stream_read_a_byte_at_a_time_parses_as_a_whole() {
        let body = "data: {\"choices\":[{\"text\":\"Hel\"}]}\r\n\r\n\
                    data: {\"choices\":[{\"text\":\"lo\",\"finish_reason\":\"stop\"}]}\n\n\
                    data: [DONE]\r\n\r\n";
        let bytes: Vec<String> = body.chars().map(String::from).collect();
        let chunks: Vec<&str> = bytes.iter().map(String::as_str).collect();
        let (text, done) = drain(stream(&chunks)).await.expect("a complete stream");
        assert_eq!(text, "Hello");
        assert_eq!(done.finish_reason, i32::from(FinishReason::Stop));
    }

    #[tokio::test]
    async fn without_usage_the_completion_is_counted_by_the_tokenizer_not_by_chunks() {
        // Two chunks of three and two "tokens" (words, for the stand-in tokenizer).
        let s = stream(&[
            "data: {\"choices\":[{\"text\":\"one two three\",\"finish_reason\":null}]}\n\n",
            "data: {\"choices\":[{\"text\":\" four five\",\"finish_reason\":\"stop\"}]}\n\n",
            "data: [DONE]\n\n",
        ]);
        let (text, done) = drain(s).await.expect("a complete stream");
        assert_eq!(text, "one two three four five");
        assert_eq!((done.prompt_tokens, done.completion_tokens), (5, 5));
    }

    #[tokio::test]
    async fn a_stream_reads_the_same_however_its_bytes_are_cut() {
        // An escaped character, a raw two-byte one and a raw four-byte one: cut every one, two
        // or three bytes, each is split across pieces somewhere.
        let whole = concat!(
            ": a comment, no data\n\n",
            "data: {\"choices\":[{\"text\":\"caf\\u00e9 é😀 \\\"x\\\"\",\"finish_reason\":null}],\"extra\":[1,{}]}\r\n\r\n",
            "data: {\"choices\":[{\"text\":\"\",\"finish_reason\":\"length\"}]}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":1}}\n\n",
            "data: [DONE]\n\n",
        );
        for size in [1, 2, 3, 7, 64, whole.len()] {
            let pieces = whole
                .as_bytes()
                .chunks(size)
                .map(Bytes::copy_from_slice)
                .collect();
            let (text, done) = drain(stream_of(pieces, true, 100, &[], words()))
                .await
                .expect("a complete stream");
            assert_eq!(text, "café é😀 \"x\"", "cut every {size} bytes");
            assert_eq!(done.finish_reason, i32::from(FinishReason::Length));
            assert_eq!((done.prompt_tokens, done.completion_tokens), (5, 1));
        }
    }

    #[tokio::test]
    async fn tokens_before_a_failing_event_arrive_before_its_error() {
        let mut s = stream(&[concat!(
            "data: {\"choices\":[{\"text\":\"a\"}]}\n\n",
            "data: {\"error\":{\"message\":\"boom\"}}\n\n",
            "data: {\"choices\":[{\"text\":\"never\"}]}\n\n",
        )]);
        let first = s
            .message()
            .await
            .expect("the token first")
            .and_then(|m| m.item);
        assert!(matches!(first, Some(Item::Token(t)) if t.text == "a"));
        let e = s.message().await.expect_err("then the failure");
        assert!(e.message().contains("boom"), "{e:?}");
        assert!(
            s.message().await.expect("ended").is_none(),
            "nothing after it"
        );
    }

    #[test]
    fn the_event_end_is_the_first_blank_line_whatever_its_line_breaks() {
        // SSE's grammar read plainly: a line break is `\r\n`, `\n` or `\r` (a `\r` at the end
        // is not known yet), and an event ends where one follows another.
        let naive = |buf: &[u8]| -> Option<(usize, usize)> {
            let brk = |at: usize| match &buf[at..] {
                [b'\r', b'\n', ..] => Some(Some(2)),
                [b'\r'] => None,
                [b'\r' | b'\n', ..] => Some(Some(1)),
                _ => Some(None),
            };
            for i in 0..buf.len() {
                let Some(first) = brk(i)? else { continue };
                if i + first == buf.len() {
                    return None;
                }
                match brk(i + first) {
                    None => return Some((i, first + 1)),
                    Some(Some(second)) => return Some((i, first + second)),
                    Some(None) => {}
                }
            }
            None
        };
        // Every string of up to 8 bytes over '\n', '\r' and 'a', against the plain reading.
        let mut strings: Vec<Vec<u8>> = vec![Vec::new()];
        for _ in 0..8 {
            let longer: Vec<Vec<u8>> = strings
                .iter()
                .filter(|s| s.len() == strings.last().map_or(0, Vec::len))
                .flat_map(|s| {
                    [b'\n', b'\r', b'a'].map(|b| {
                        let mut t = s.clone();
                        t.push(b);
                        t
                    })
                })
                .collect();
            strings.extend(longer);
        }
        assert_eq!(strings.len(), (0..=8).map(|n| 3usize.pow(n)).sum::<usize>());
        let end = |found: Option<(usize, usize)>| found.map(|(at, sep)| at + sep);
        for s in &strings {
            assert_eq!(event_end(s, 0), naive(s), "{s:?}");
            // Read in two parts, the first with no end: a search of the whole from three
            // bytes before the second part's start ends the event where a search from the
            // start does (its last line's break may be found from its `\n`).
            for k in (0..=s.len()).filter(|&k| naive(&s[..k]).is_none()) {
                let resumed = event_end(s, k.saturating_sub(3));
                assert_eq!(end(resumed), end(naive(s)), "{s:?} at {k}");
                if let (Some((at, _)), Some((from_start, _))) = (resumed, naive(s)) {
                    assert!(at - from_start <= 1, "{s:?} at {k}");
                }
            }
        }
    }

    #[test]
    fn multi_line_data_is_joined_and_a_single_line_is_borrowed() {
        let (len, event) = next_event(b"data: a\ndata:b\n\nrest").expect("an event");
        assert_eq!((len, &*event.data, event.error), (16, "a\nb", false));
        let (_, event) = next_event(b"data: {}\n\n").expect("an event");
        assert!(matches!(event.data, Cow::Borrowed("{}")));
        assert!(next_event(b"data: {}\n").is_none(), "not complete yet");
        let (_, event) = next_event(b"data: \xff{}\n\n").expect("an event");
        assert_eq!(
            event.data, "\u{FFFD}{}",
            "invalid UTF-8 is replaced, not fatal"
        );
        // Lines broken by a lone `\r`, and the blank line too.
        let (len, event) = next_event(b"data: a\rdata: b\r\rdata: c").expect("an event");
        assert_eq!((len, &*event.data), (17, "a\nb"));
    }

    #[test]
    fn an_error_event_is_one_by_its_type_or_its_error_field() {
        let error = |text: &[u8]| {
            let (_, event) = next_event(text).expect("an event");
            (event.error, event.data.into_owned())
        };
        assert_eq!(
            error(b"event: error\ndata: {\"m\":1}\n\n"),
            (true, "{\"m\":1}".into())
        );
        // llama.cpp's server: an `error` field, no data.
        assert_eq!(
            error(b"error: {\"code\":400}\n\n"),
            (true, "{\"code\":400}".into())
        );
        assert_eq!(error(b"event: message\ndata: x\n\n"), (false, "x".into()));
        // A field is matched whole: `errors:` and `dataset:` are other fields.
        assert_eq!(error(b"errors: 1\ndataset: 2\n\n"), (false, String::new()));
    }

    #[tokio::test]
    async fn a_stream_cut_before_done_or_with_garbage_is_an_error_not_a_success() {
        let cut = stream(&["data: {\"choices\":[{\"text\":\"a\"}]}\n\n"]);
        let e = drain(cut).await.expect_err("no [DONE]");
        assert_eq!(e.code(), Code::Unavailable);
        // Garbage, even before a [DONE]: this answer is broken, the server is not down.
        let garbage = stream(&["data: {not json\n\n", "data: [DONE]\n\n"]);
        let e = drain(garbage).await.expect_err("garbage");
        assert!(e.message().contains("not a completion chunk"), "{e:?}");
        assert!(!crate::api::from_status(&e, crate::api::Endpoint::Chat).worker_down);
        let failed = stream(&["data: {\"error\":{\"message\":\"boom\"}}\n\n"]);
        assert_eq!(
            drain(failed).await.expect_err("an error event").code(),
            Code::Unavailable
        );
        let endless = stream(&[&"x".repeat(MAX_EVENT_BYTES + 1)]);
        let e = drain(endless)
            .await
            .expect_err("an unbounded event is refused");
        assert!(e.message().contains("too long"), "{e:?}");
        // A chunk whose fields are null reads as one whose fields are missing.
        let nulls = stream(&[
            "data: {\"choices\":[{\"index\":null,\"text\":\"a\",\"finish_reason\":null}]}\n\n",
            "data: {\"choices\":null,\"usage\":null}\n\n",
            &chunk("", Some("stop")),
            "data: [DONE]\n\n",
        ]);
        assert_eq!(drain(nulls).await.expect("served").0, "a");
    }

    /// A stream that ends without saying why was cut short: never a 200 with part of an
    /// answer (the design's I3), and the server is not taken for down.
    #[tokio::test]
    async fn done_without_a_finish_reason_is_an_answer_cut_short() {
        let cut = stream(&[&chunk("a", None), "data: [DONE]\n\n"]);
        let e = drain(cut).await.expect_err("no finish_reason");
        assert!(e.message().contains("without a finish_reason"), "{e:?}");
        assert!(!crate::api::from_status(&e, crate::api::Endpoint::Chat).worker_down);
        let nothing = stream(&["data: [DONE]\n\n"]);
        drain(nothing).await.expect_err("nothing at all");
    }

    /// llama.cpp's server reports a failure mid-stream as an `error` field, then sends
    /// `[DONE]`; vLLM's as data with the HTTP status as a number in `code`. A client's bad
    /// request (a prompt over the server's own context) fails that request, and leaves the
    /// server routed to; a server error takes it out.
    #[tokio::test]
    async fn error_events_fail_the_request_and_their_numeric_code_says_whose_fault() {
        let cases = [
            (
                "error: {\"code\":400,\"message\":\"exceeds the available context size\",\"type\":\"exceed_context_size_error\"}\n\n",
                Code::InvalidArgument,
                false,
            ),
            (
                "data: {\"error\":{\"message\":\"bad\",\"type\":\"BadRequestError\",\"code\":400}}\n\n",
                Code::InvalidArgument,
                false,
            ),
            (
                "event: error\ndata: {\"error\":{\"message\":\"slow down\",\"code\":429}}\n\n",
                Code::ResourceExhausted,
                false,
            ),
            (
                "data: {\"error\":{\"message\":\"engine dead\",\"code\":500}}\n\n",
                Code::Unavailable,
                true,
            ),
            (
                "event: error\ndata: plain words\n\n",
                Code::Unavailable,
                true,
            ),
        ];
        for (event, code, down) in cases {
            let s = stream(&[&chunk("a", None), event, "data: [DONE]\n\n"]);
            let e = drain(s)
                .await
                .expect_err("an error event fails the request");
            assert_eq!(e.code(), code, "{event}: {e:?}");
            assert_eq!(
                crate::api::from_status(&e, crate::api::Endpoint::Chat).worker_down,
                down,
                "{event}"
            );
        }
    }

    #[tokio::test]
    async fn every_kind_of_sse_line_break_ends_events() {
        for brk in ["\n", "\r\n", "\r"] {
            // (`\r` then `\n` is one break, not two.)
            for blank in ["\n", "\r\n", "\r"]
                .into_iter()
                .filter(|b| !(brk == "\r" && b.starts_with('\n')))
            {
                let end = format!("{brk}{blank}");
                let body = format!(
                    "data: {{\"choices\":[{{\"text\":\"Hel\"}}]}}{end}\
                     data: {{\"choices\":[{{\"text\":\"lo\",\"finish_reason\":\"stop\"}}]}}{end}\
                     data: [DONE]{end}"
                );
                let bytes: Vec<String> = body.chars().map(String::from).collect();
                let pieces: Vec<&str> = bytes.iter().map(String::as_str).collect();
                for s in [stream(&[&body]), stream(&pieces)] {
                    let (text, _) = drain(s).await.unwrap_or_else(|e| panic!("{end:?}: {e:?}"));
                    assert_eq!(text, "Hello", "{end:?}");
                }
            }
        }
    }

    #[test]
    fn only_plain_http_bases_and_header_safe_keys_make_a_client() {
        let ok = OpenAiClient::new(
            "http://127.0.0.1:8000/",
            "m",
            Some("sk-x".into()),
            true,
            false,
        )
        .expect("a plain HTTP base");
        assert_eq!(ok.completions, "http://127.0.0.1:8000/v1/completions");
        assert!(
            ok.authorization
                .as_ref()
                .is_some_and(HeaderValue::is_sensitive)
        );
        for base in ["https://host", "host:8000", "http://", "ftp://host"] {
            assert!(
                OpenAiClient::new(base, "m", None, true, false).is_err(),
                "{base} is refused"
            );
        }
        assert!(OpenAiClient::new("http://h", "m", Some("sk\nx".into()), true, false).is_err());
    }

    #[test]
    fn refusals_carry_the_worker_protocols_codes() {
        let too_long = refusal(
            400,
            br#"{"error":{"message":"too long","code":"context_length_exceeded"}}"#,
            true,
        );
        assert_eq!(error_code(&too_long), Some("context_length_exceeded"));
        // llama.cpp's server names it by its type, its code the HTTP status.
        let llama = refusal(
            400,
            br#"{"error":{"code":400,"message":"the request exceeds the available context size","type":"exceed_context_size_error"}}"#,
            true,
        );
        assert_eq!(error_code(&llama), Some("context_length_exceeded"));
        // vLLM's says so in its message only.
        let vllm = refusal(
            400,
            br#"{"object":"error","message":"This model's maximum context length is 2048 tokens. However, you requested 2100 tokens (2000 in the messages, 100 in the completion).","type":"BadRequestError","param":null,"code":400}"#,
            true,
        );
        assert_eq!(error_code(&vllm), Some("context_length_exceeded"));
        assert_eq!(
            bulkhead_worker::serve::proto::refused_by(&vllm),
            Some("decode")
        );
        // SGLang's (and older vLLM's) error object is the body itself: its message is kept,
        // and a refused salt is seen in it.
        let flat = refusal(
            400,
            br#"{"object":"error","message":"n must be 1","type":"BadRequestError","code":400}"#,
            true,
        );
        assert_eq!(error_code(&flat), Some("invalid_request_error"));
        assert!(flat.message().contains("n must be 1"), "{flat:?}");
        let flat_salt = refusal(
            400,
            br#"{"object":"error","message":"Unrecognized field: cache_salt","code":400}"#,
            true,
        );
        assert_eq!(error_code(&flat_salt), Some("internal_error"));
        let busy = refusal(429, b"", true);
        assert_eq!(error_code(&busy), Some("rate_limit_exceeded"));
        // The upstream's own refusals, not the gateway's admission.
        let by = bulkhead_worker::serve::proto::refused_by;
        assert_eq!(by(&too_long), Some("decode"));
        assert_eq!(by(&busy), Some("decode"));
        assert_eq!(
            error_code(&refusal(400, b"nonsense", true)),
            Some("invalid_request_error")
        );
        let down = refusal(502, b"", true);
        assert_eq!(down.code(), Code::Unavailable);
        let gone = refusal(
            404,
            br#"{"error":{"message":"The model `m` does not exist"}}"#,
            true,
        );
        assert_eq!(gone.code(), Code::Unavailable, "not the client's fault");
        assert_eq!(error_code(&gone), None);
        assert_eq!(
            error_code(&down),
            None,
            "no code: the upstream is in trouble"
        );
        // A refused key is the gateway's configuration; another refusal (an upstream
        // gateway's policy) is this request's, said as the upstream said it.
        for body in [
            &b""[..],
            br#"{"error":{"code":"invalid_api_key","message":"m"}}"#,
            br#"{"error":{"code":null,"type":"invalid_request_error","message":"no key"}}"#,
        ] {
            let refused = refusal(401, body, true);
            assert_eq!(error_code(&refused), Some("internal_error"));
            assert!(refused.message().contains("gateway's key"), "{refused:?}");
        }
        let denied = refusal(
            403,
            br#"{"error":{"code":"policy_denied","message":"not on Sundays"}}"#,
            true,
        );
        assert_eq!(error_code(&denied), Some("internal_error"));
        assert!(denied.message().contains("not on Sundays"), "{denied:?}");
    }

    /// A server that refuses `cache_salt` (vLLM's V0 engine, or a server that checks for unknown
    /// fields) refuses every salted request for it: the gateway's configuration, named with its
    /// fix, never the client's invalid request.
    #[test]
    fn an_upstream_that_refuses_the_cache_salt_is_the_gateways_configuration_error() {
        let unknown = br#"{"error":{"message":"Unrecognized request argument supplied: cache_salt","type":"invalid_request_error","param":"cache_salt"}}"#;
        for (http, body) in [
            (400, &unknown[..]),
            (422, br#"{"error":{"message":"x","param":"cache_salt"}}"#),
            // vLLM's V0 engine.
            (
                400,
                br#"{"error":{"message":"Parameter 'cache_salt' is not supported with this instance of vLLM, which uses engine V0."}}"#,
            ),
        ] {
            let refused = refusal(http, body, true);
            assert_eq!(error_code(&refused), Some("internal_error"), "{refused:?}");
            assert!(
                refused.message().contains("cache_salt = false"),
                "{refused:?}"
            );
        }
        // A refusal of something else that quotes the request (which holds the salt) is not
        // about the salt.
        let quoting = br#"{"error":{"message":"max_tokens must be at least 1, got 0 (input: {'cache_salt': 'ab', 'max_tokens': 0})"}}"#;
        assert_eq!(
            error_code(&refusal(400, quoting, true)),
            Some("invalid_request_error")
        );
        // Unsalted, the field was not sent: whatever the server says of it is its own.
        assert_eq!(
            error_code(&refusal(400, unknown, false)),
            Some("invalid_request_error")
        );
    }

    /// The upstream's prefix cache is shared only within a tenant: each tenant's requests
    /// carry a salt of their own (and no tenant name); unless the operator vouches that the
    /// server keeps its cache per salt, the server's cached-token count — which would say what
    /// other tenants' prompts began with — is not passed on.
    #[tokio::test]
    async fn each_tenants_requests_carry_a_cache_salt_of_their_own() {
        let salted_body = |salted: bool, tenant: &str, client_salt: &str| -> Value {
            let client = OpenAiClient::new("http://127.0.0.1:8000", "m", None, salted, false)
                .expect("a client");
            let request = GenerateRequest {
                tenant: tenant.to_owned(),
                cache_salt: client_salt.to_owned(),
                prompt: Some(Prompt::Tokens(TokenPrompt { ids: vec![1, 2] })),
                ..GenerateRequest::default()
            };
            serde_json::from_slice(&client.completion_body(&request).expect("a body").0)
                .expect("JSON")
        };
        let body = |salted: bool, tenant: &str| salted_body(salted, tenant, "");
        let (a, b) = (body(true, "tenant-a"), body(true, "tenant-b"));
        let salt = |v: &Value| v["cache_salt"].as_str().expect("a salt").to_owned();
        assert_ne!(salt(&a), salt(&b), "tenants never share a salt");
        assert_eq!(
            salt(&a),
            salt(&body(true, "tenant-a")),
            "a tenant keeps its own"
        );
        assert!(!salt(&a).contains("tenant-a"), "the name is not sent");
        assert!(body(false, "tenant-a").get("cache_salt").is_none());
        let with_client_salt = salted_body(true, "tenant-a", "s1");
        assert_ne!(
            salt(&with_client_salt),
            salt(&a),
            "the client's salt splits it"
        );
        assert!(!salt(&with_client_salt).contains("s1"));
        assert_ne!(
            salt(&salted_body(true, "ab", "c")),
            salt(&salted_body(true, "a", "bc")),
            "tenant and salt do not run together"
        );

        let usage = [
            "data: {\"choices\":[{\"text\":\"x\",\"finish_reason\":\"stop\"}],\"usage\":\
             {\"prompt_tokens\":5,\"completion_tokens\":1,\"prompt_tokens_details\":{\"cached_tokens\":4}}}\n\n",
            "data: [DONE]\n\n",
        ];
        for (report, cached) in [(true, 4), (false, 0)] {
            let (_, done) = drain(stream_reporting(&usage, report)).await.expect("done");
            assert_eq!(done.cached_tokens, cached, "reported: {report}");
        }
        // Passed on only salted and vouched for: a server that ignores the salt (vLLM answers
        // an unknown field with a warning in its log) keeps one cache for every tenant.
        for (salted, vouched, reported) in [
            (true, true, true),
            (true, false, false),
            (false, true, false),
            (false, false, false),
        ] {
            let client = OpenAiClient::new("http://127.0.0.1:8000", "m", None, salted, vouched)
                .expect("a client");
            assert_eq!(client.report_cached, reported, "{salted} {vouched}");
        }
    }

    #[test]
    fn seeds_go_out_signed_as_the_client_sent_them() {
        let client =
            OpenAiClient::new("http://127.0.0.1:8000", "m", None, true, false).expect("a client");
        for (sent, out) in [
            ("-1", -1),
            ("42", 42),
            ("9223372036854775807", i64::MAX),
            ("-9223372036854775808", i64::MIN),
        ] {
            let body = format!(r#"{{"prompt":"x","seed":{sent}}}"#);
            let parsed =
                crate::api::validate::parse_completion(body.as_bytes()).expect("a valid seed");
            let request = GenerateRequest {
                prompt: Some(Prompt::Tokens(TokenPrompt { ids: vec![1, 2] })),
                sampling: Some(SamplingParams {
                    seed: parsed.common.sampling.seed,
                    ..SamplingParams::default()
                }),
                ..GenerateRequest::default()
            };
            let json: Value =
                serde_json::from_slice(&client.completion_body(&request).expect("a body").0)
                    .expect("JSON");
            assert_eq!(json["seed"], out, "seed {sent}");
        }
    }

    #[tokio::test]
    async fn an_upstreams_kv_integrity_error_stays_one_and_leaves_its_route_up() {
        // Another Bulkhead gateway's codes for one answer's failure: its handoff's checks, or
        // its worker breaking the answer.
        for (code, error) in [
            ("kv_integrity_error", crate::api::ApiError::KvIntegrity),
            ("internal_error", crate::api::ApiError::Internal),
        ] {
            let body = format!(r#"{{"error":{{"message":"m","type":"{code}","code":"{code}"}}}}"#);
            let event = format!("data: {body}\n\n");
            let answered = refusal(500, body.as_bytes(), true);
            let streamed = drain(stream(&[&event])).await.expect_err("an error event");
            for status in [answered, streamed] {
                assert_eq!(error_code(&status), Some(code), "{status:?}");
                let failure = crate::api::from_status(&status, crate::api::Endpoint::Chat);
                assert_eq!(failure.error, error);
                assert!(
                    !failure.worker_down,
                    "one request's failure, not the upstream's"
                );
            }
        }
        // Without a code of the table, a 500 or an event is the upstream's trouble, so is a
        // 503 whose type (not code) says internal_error.
        assert_eq!(refusal(500, b"{}", true).code(), Code::Unavailable);
        let typed = br#"{"error":{"message":"m","type":"internal_error"}}"#;
        assert_eq!(refusal(503, typed, true).code(), Code::Unavailable);
        let event = "data: {\"error\":{\"message\":\"boom\",\"code\":\"oops\"}}\n\n";
        let status = drain(stream(&[event])).await.expect_err("an error event");
        assert!(crate::api::from_status(&status, crate::api::Endpoint::Chat).worker_down);
    }

    /// An answer whose count is not taken from the upstream is counted again: a short one on
    /// the thread serving the stream, a long one on the blocking pool (it would hold up that
    /// thread's other connections); either way by the tokenizer, and a `message` call dropped
    /// while the count runs leaves it to the next.
    #[tokio::test(flavor = "current_thread")]
    async fn a_long_answer_is_counted_off_the_serving_thread() {
        let here = std::thread::current().id();
        for (words, inline) in [(10, true), (2000, false)] {
            let counted_on = Arc::new(std::sync::Mutex::new(None));
            let seen = counted_on.clone();
            let counter = TokenCounter::new(16, move |t| {
                *seen.lock().expect("not poisoned") = Some(std::thread::current().id());
                u32::try_from(t.split_whitespace().count()).ok()
            });
            let text = chunk(&" word".repeat(words), Some("stop"));
            let mut s = stream_counting(&[&text, "data: [DONE]\n\n"], true, 5000, &[], counter);
            // The first call is dropped as soon as it waits (the count, when off-thread).
            let first = tokio::time::timeout(Duration::ZERO, s.message()).await;
            let mut items: Vec<Item> = match first {
                Ok(item) => item
                    .expect("served")
                    .and_then(|m| m.item)
                    .into_iter()
                    .collect(),
                Err(_) => Vec::new(),
            };
            while let Some(item) = s.message().await.expect("served").and_then(|m| m.item) {
                items.push(item);
            }
            let done = items
                .into_iter()
                .find_map(|i| match i {
                    Item::Done(d) => Some(d),
                    _ => None,
                })
                .expect("Done");
            assert_eq!(done.completion_tokens, words as u32);
            let on = counted_on.lock().expect("not poisoned").expect("counted");
            assert_eq!(on == here, inline, "{words} words counted on {on:?}");
        }
    }

    /// A count on the blocking pool that fails (the tokenizer panicked) fails the one request
    /// as the upstream's broken answer, not the server: it stays routed to.
    #[tokio::test(flavor = "current_thread")]
    async fn a_count_that_fails_off_the_serving_thread_fails_the_request_alone() {
        let counter = TokenCounter::new(16, |_| panic!("a tokenizer bug"));
        let text = chunk(&" word".repeat(2000), Some("stop"));
        let s = stream_counting(&[&text, "data: [DONE]\n\n"], true, 5000, &[], counter);
        let e = drain(s).await.expect_err("the count failed");
        assert!(
            e.message().contains("counting the answer's tokens failed"),
            "{e:?}"
        );
        assert!(!crate::api::from_status(&e, crate::api::Endpoint::Chat).worker_down);
    }

    /// An upstream that ignores `max_tokens` fails the request as soon as its text outgrows
    /// what that many tokens can hold, whether in many chunks, one, or the closing one; a
    /// usage count above `max_tokens` fails it too. The server stays routed to.
    #[tokio::test]
    async fn an_upstream_past_max_tokens_fails_the_request_however_it_sends_the_text() {
        let flood = chunk(&" hello".repeat(2000), Some("length"));
        let one = chunk(&" hello".repeat(2000), None);
        let overcount = "data: {\"choices\":[{\"text\":\"hi\",\"finish_reason\":\"length\"}],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":9}}\n\n";
        for body in [flood.as_str(), one.as_str(), overcount] {
            let failed = drain(stream_asking(&[body, "data: [DONE]\n\n"], true, 5, &[])).await;
            let status = failed.expect_err("more than max_tokens");
            assert_eq!(error_code(&status), Some("internal_error"), "{status:?}");
            assert!(
                !crate::api::from_status(&status, crate::api::Endpoint::Chat).worker_down,
                "one request's failure"
            );
        }
        // Within the bytes 5 tokens may hold, but far more tokens: counted, and failed.
        let words = chunk(&" a".repeat(20), Some("length"));
        let status = drain(stream_asking(&[&words, "data: [DONE]\n\n"], true, 5, &[]))
            .await
            .expect_err("20 tokens for 5");
        assert_eq!(error_code(&status), Some("internal_error"), "{status:?}");
        // A recount a little over (text tokenized again): served, charged max_tokens.
        let near = chunk(&" a".repeat(7), Some("length"));
        let (_, done) = drain(stream_asking(&[&near, "data: [DONE]\n\n"], true, 5, &[]))
            .await
            .expect("within the recount's margin");
        assert_eq!(done.completion_tokens, 5);
        // At the bound (5 tokens of 16 bytes), the text is read.
        let at = chunk(&"x".repeat(80), Some("length"));
        let (text, _) = drain(stream_asking(&[&at, "data: [DONE]\n\n"], true, 5, &[]))
            .await
            .expect("within the bound");
        assert_eq!(text.len(), 80);
    }

    /// The usage the tenant is charged and the record says is held to what the gateway can
    /// see: its own prompt count (it sent the ids), a completion count the text does not belie
    /// (else the tokenizer's), cached tokens no more than the prompt's.
    #[tokio::test]
    async fn the_upstreams_usage_is_held_to_what_the_gateway_sent_and_got() {
        let lying = stream_asking(
            &[
                "data: {\"choices\":[{\"text\":\"one two three four five six seven eight nine ten eleven twelve\",\"finish_reason\":\"stop\"}]}\n\n",
                "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":30,\"completion_tokens\":1,\"prompt_tokens_details\":{\"cached_tokens\":999999}}}\n\n",
                "data: [DONE]\n\n",
            ],
            true,
            100,
            &[],
        );
        let (_, done) = drain(lying).await.expect("a complete stream");
        assert_eq!(done.prompt_tokens, 5, "the ids the gateway sent");
        assert_eq!(
            done.completion_tokens, 12,
            "counted: one token cannot hold the text"
        );
        assert_eq!(done.cached_tokens, 5, "at most the prompt");

        // Fewer tokens than the pieces of text it sent: counted too.
        let mut chunks = vec!["data: {\"choices\":[{\"text\":\" a\"}]}\n\n"; 6];
        chunks.push("data: {\"choices\":[{\"text\":\"\",\"finish_reason\":\"stop\"}],\"usage\":{\"completion_tokens\":2}}\n\n");
        chunks.push("data: [DONE]\n\n");
        let (_, done) = drain(stream(&chunks)).await.expect("a complete stream");
        assert_eq!(done.completion_tokens, 6);
        // An honest count stands.
        chunks[6] = "data: {\"choices\":[{\"text\":\"\",\"finish_reason\":\"stop\"}],\"usage\":{\"completion_tokens\":7}}\n\n";
        let (_, done) = drain(stream(&chunks)).await.expect("a complete stream");
        assert_eq!(done.completion_tokens, 7);
    }

    /// Text after the chunk that said the finish reason still comes after the text of that
    /// chunk: the answer's end, in the order sent.
    #[tokio::test]
    async fn text_after_the_finish_reason_stays_in_order() {
        let (text, _) = drain(stream(&[
            "data: {\"choices\":[{\"text\":\"A\",\"finish_reason\":\"stop\"}]}\n\n",
            "data: {\"choices\":[{\"text\":\"B\",\"finish_reason\":null}]}\n\n",
            "data: [DONE]\n\n",
        ]))
        .await
        .expect("a complete stream");
        assert_eq!(text, "AB");
    }

    #[tokio::test]
    async fn several_choices_are_a_broken_answer_not_text_interleaved() {
        for chunk in [
            "data: {\"choices\":[{\"index\":1,\"text\":\"SECRET\"}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"text\":\"a\"},{\"index\":1,\"text\":\"b\"}]}\n\n",
        ] {
            let status = drain(stream(&[chunk, "data: [DONE]\n\n"]))
                .await
                .expect_err("several choices");
            assert_eq!(error_code(&status), Some("internal_error"), "{status:?}");
        }
    }

    /// A server that sends on past a stop string (it ignored `stop`): the answer ends before
    /// it, as a Bulkhead worker's would, also when it spans chunks; a partial match the answer
    /// ends on is released.
    #[tokio::test]
    async fn the_requests_stop_strings_end_the_answer_whatever_the_upstream_does() {
        let chunks = [
            "data: {\"choices\":[{\"text\":\" one ST\",\"finish_reason\":null}]}\n\n",
            "data: {\"choices\":[{\"text\":\"OP two\",\"finish_reason\":null}]}\n\n",
            "data: {\"choices\":[{\"text\":\" three\",\"finish_reason\":\"length\"}]}\n\n",
            "data: [DONE]\n\n",
        ];
        let (text, done) = drain(stream_asking(&chunks, true, 100, &["STOP"]))
            .await
            .expect("a complete answer");
        assert_eq!(text, " one ");
        assert_eq!(done.finish_reason, i32::from(FinishReason::Stop));
        assert_eq!(
            done.completion_tokens, 2,
            "what the client got and the stop string, counted: as a server that stops would"
        );

        let (text, done) = drain(stream_asking(&chunks, true, 100, &["STOPPED"]))
            .await
            .expect("a complete answer");
        assert_eq!(
            text, " one STOP two three",
            "no stop: everything, held text released"
        );
        assert_eq!(done.finish_reason, i32::from(FinishReason::Length));
    }
}
