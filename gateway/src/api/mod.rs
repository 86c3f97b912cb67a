//! The OpenAI-compatible API: `POST /v1/chat/completions`, `POST /v1/completions`,
//! `GET /v1/models`.
//!
//! One request, in order (design.md steps 1–5):
//! ```text
//! traced (the request's span, crate::traced) ─▶ audited (a trail: one audit record per
//!   request) ─▶ Auth layer (key → tenant; tenant headers stripped) ─▶ account
//!   ─▶ tenant limits (in flight, requests/min)
//!   ─▶ body (size limit) ─▶ validate::parse_* → Valid* ─▶ chat template + tokenizer (the
//!   worker's) ─▶ admission (prompt + max tokens ≤ effective limit, else 400 before any worker
//!   is contacted) ─▶ policy chain (allow | deny; a clamp is admitted again) ─▶ tokens/min
//!   ─▶ route (least outstanding tokens) ─▶ Generate(token ids) ─▶ JSON or SSE
//!   ─▶ end: on-response-end, or on client disconnect the chain's directive (crate::policy)
//!   ─▶ the audit record (before the response in durable mode)
//! ```

mod error;
mod respond;
mod upstream;
pub mod validate;
mod wire;

use std::borrow::Cow;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, HttpBody};
use axum::extract::{Extension, FromRef, Path, State};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bulkhead_worker::chat::ChatError;
use http::HeaderMap;
use http::header::{CONTENT_ENCODING, CONTENT_TYPE, TRANSFER_ENCODING};
use tokio::time::Instant;
use tracing::Instrument as _;
use tracing::field::Empty;

pub use error::{ApiError, ErrorType, Mapping, mapping};
pub(crate) use respond::Counts;
pub use respond::Streamed;
pub use upstream::{WorkerFailure, from_status};
use validate::{CompletionPrompt, ValidCommon, parse_chat, parse_completion};

use crate::admission::{Admitted, EffectiveLimit, admit};
use crate::auth::{AuthLayer, Authenticated};
use crate::config::{ClientTrace, HttpLimits};
use crate::limits::RequestPermit;
use crate::metrics::Metrics;
use crate::policy::{Policies, Progress, RequestFacts, RequestPolicy};
use crate::tenants::Tenants;
use crate::trail::{self, Recorder, Trail};
use crate::upstreams::Leg;
use crate::workers::{Route, ServedModel, Workers};

/// What every API handler shares; a cheap `Clone`.
#[derive(Debug, Clone)]
pub struct ApiState {
    pub workers: Workers,
    /// Who may call (keys) and their limits; reloadable.
    pub tenants: Tenants,
    pub metrics: Metrics,
    pub http: HttpLimits,
    pub recorder: Recorder,
    pub policies: Policies,
    /// What a client's `traceparent` does to its request's trace.
    pub client_trace: ClientTrace,
}

/// What the router hands every handler: one pointer to the shared state, so that a request
/// clones (and drops) one reference count instead of one per field — on a hot counter shared
/// by every serving thread, each of those is a cache miss.
type Shared = Arc<ApiState>;

impl FromRef<Shared> for Recorder {
    fn from_ref(state: &Shared) -> Recorder {
        state.recorder.clone()
    }
}

pub const CHAT_ROUTE: &str = "/v1/chat/completions";
pub const COMPLETIONS_ROUTE: &str = "/v1/completions";
pub const MODELS_ROUTE: &str = "/v1/models";
/// One model (the rest of the path is its name or id, which may hold slashes).
pub const MODEL_ROUTE: &str = "/v1/models/{*model}";
pub const AUDIT_ROUTE: &str = "/v1/audit";
/// Every route of the API.
pub const ROUTES: [&str; 5] = [
    CHAT_ROUTE,
    COMPLETIONS_ROUTE,
    MODELS_ROUTE,
    MODEL_ROUTE,
    AUDIT_ROUTE,
];

/// The route `path` matches, as its template (what a record names); `None`: none.
pub fn route_of(path: &str) -> Option<&'static str> {
    match path
        .strip_prefix(MODELS_ROUTE)
        .and_then(|p| p.strip_prefix('/'))
    {
        Some(model) if !model.is_empty() => Some(MODEL_ROUTE),
        _ => ROUTES.into_iter().find(|r| *r == path),
    }
}

/// The API router: traced, audited, authenticated and counted; an answer given before the
/// request's body was read closes the connection, and says so.
pub fn router(state: ApiState) -> Router {
    let metrics = state.metrics.clone();
    let recorder = state.recorder.clone();
    let tenants = state.tenants.clone();
    let client_trace = state.client_trace;
    Router::new()
        .route(CHAT_ROUTE, post(chat_completions))
        .route(COMPLETIONS_ROUTE, post(completions))
        .route(MODELS_ROUTE, get(models))
        .route(MODEL_ROUTE, get(model))
        .route(AUDIT_ROUTE, get(audit))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(Shared::new(state))
        .layer(middleware::from_fn_with_state(
            tenants.limiter().clone(),
            trail::account,
        ))
        .layer(AuthLayer::new(tenants, metrics))
        .layer(middleware::from_fn_with_state(recorder, trail::audited))
        .layer(middleware::from_fn(crate::unread_body::close_if_unread))
        .layer(middleware::from_fn_with_state(
            client_trace,
            crate::traced::traced,
        ))
}

/// `GET /v1/audit`: a request like any other against the tenant's limits (concurrency,
/// requests per minute), so reading a log cannot cost the gateway more than serving does.
async fn audit(
    State(state): State<Shared>,
    who: Extension<Authenticated>,
    query: axum::extract::RawQuery,
) -> Response {
    let permit = match state.tenants.limiter().start(&who.tenant) {
        Ok(permit) => permit,
        Err(e) => return ApiError::from(e).into_response(),
    };
    trail::tenant_read(State(state.recorder.clone()), who, query, permit).await
}

async fn not_found() -> Response {
    ApiError::NotFound.into_response()
}

async fn method_not_allowed() -> Response {
    ApiError::MethodNotAllowed.into_response()
}

/// `GET /v1/models`: the served model, or none while no worker has reported one.
async fn models(State(state): State<Shared>) -> Response {
    let data: Vec<_> = state
        .workers
        .model()
        .map(|m| described(&m))
        .into_iter()
        .collect();
    json_response(&serde_json::json!({"object": "list", "data": data}))
}

/// `GET /v1/models/{model}`: the served model, by its name or id (OpenAI's retrieve). A name
/// that is not UTF-8 once percent-decoded names no model (OpenAI's 404, not axum's plain
/// text).
async fn model(
    State(state): State<Shared>,
    asked: Result<Path<String>, axum::extract::rejection::PathRejection>,
) -> Response {
    let asked = asked.map_or_else(|_| "(a name that is not UTF-8)".to_owned(), |Path(a)| a);
    match state.workers.model() {
        None => ApiError::NoHealthyWorker.into_response(),
        Some(m) if m.answers_to(&asked) => json_response(&described(&m)),
        Some(m) => ApiError::ModelNotFound {
            asked,
            served: m.name.clone(),
        }
        .into_response(),
    }
}

/// The policies' tags as one span attribute: a JSON array of `key=value` strings (a key holds
/// no `=`), so that no value, which may hold `,` or `=`, can read as another tag.
fn tags_attribute(tags: &[(String, String)]) -> String {
    let pairs: Vec<String> = tags.iter().map(|(k, v)| format!("{k}={v}")).collect();
    serde_json::Value::from(pairs).to_string()
}

/// A model as OpenAI's API describes one.
fn described(m: &ServedModel) -> serde_json::Value {
    serde_json::json!({
        "id": m.name, "object": "model", "created": m.created, "owned_by": "bulkhead",
    })
}

fn json_response(body: &serde_json::Value) -> Response {
    ([(CONTENT_TYPE, "application/json")], body.to_string()).into_response()
}

/// Which endpoint a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completion,
}

impl Endpoint {
    /// Its path (the route policies match on).
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completion => "/v1/completions",
        }
    }

    /// The body field that holds its prompt: what an error about the prompt's length names
    /// as its `param`.
    pub fn prompt_field(self) -> &'static str {
        match self {
            Endpoint::Chat => "messages",
            Endpoint::Completion => "prompt",
        }
    }
}

async fn chat_completions(
    State(state): State<Shared>,
    Extension(who): Extension<Authenticated>,
    Extension(trail): Extension<Trail>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    serve(state, who, trail, Endpoint::Chat, headers, body).await
}

async fn completions(
    State(state): State<Shared>,
    Extension(who): Extension<Authenticated>,
    Extension(trail): Extension<Trail>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    serve(state, who, trail, Endpoint::Completion, headers, body).await
}

/// Requests with bodies up to this size are templated and tokenized on the async worker
/// thread that parsed them: that takes tens of microseconds, less than a hop to the blocking
/// pool and back (two thread wake-ups). Larger prompts go to the blocking pool, so a long
/// prompt never holds up the other connections on the worker; so does a chat whose template
/// must be rendered (its frame not kept yet), which waits for the template's sandbox.
pub(crate) const INLINE_TOKENIZE_BYTES: usize = 1 << 10;

/// A validated request of either endpoint, before tokenization.
enum Parsed {
    Chat(validate::ValidChat),
    Completion(validate::ValidCompletion),
}

impl Parsed {
    fn common(&self) -> &ValidCommon {
        match self {
            Parsed::Chat(c) => &c.common,
            Parsed::Completion(c) => &c.common,
        }
    }

    fn prompt_field(&self) -> &'static str {
        match self {
            Parsed::Chat(_) => Endpoint::Chat,
            Parsed::Completion(_) => Endpoint::Completion,
        }
        .prompt_field()
    }

    /// The prompt as the audit record hashes it: the messages as JSON (each `{"content",
    /// "role"}`, keys in that order), or the prompt text, or the token ids as JSON.
    fn audited_text(&self) -> Cow<'_, str> {
        #[derive(serde::Serialize)]
        struct Audited<'a> {
            content: &'a str,
            role: &'a str,
        }
        match self {
            Parsed::Chat(c) => {
                let messages: Vec<Audited<'_>> = c
                    .messages
                    .iter()
                    .map(|m| Audited {
                        content: &m.content,
                        role: &m.role,
                    })
                    .collect();
                serde_json::to_string(&messages).unwrap_or_default().into()
            }
            Parsed::Completion(c) => match &c.prompt {
                CompletionPrompt::Text(t) => Cow::Borrowed(t),
                CompletionPrompt::Tokens(ids) => {
                    serde_json::to_string(ids).unwrap_or_default().into()
                }
            },
        }
    }
}

async fn serve(
    state: Shared,
    who: Authenticated,
    trail: Trail,
    endpoint: Endpoint,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let timeout = state.http.request_timeout;
    let deadline = Instant::now() + timeout;
    let secs = timeout.as_secs();
    // The policies' headers, once they allowed the request: on its answer, and on an error
    // after that (the tenant's tokens, no worker, the worker's refusal) as well.
    let mut policy_headers = HeaderMap::new();
    let mut shutdown = trail.shutdown_signal();
    let result = tokio::select! {
        result = tokio::time::timeout_at(
            deadline,
            start(
                &state,
                &who,
                &trail,
                endpoint,
                &headers,
                body,
                &mut policy_headers,
            ),
        ) => result,
        // Shutdown's drain timeout passed while the request was still read, checked or
        // tokenized: its client is told, as one waiting for its worker is, rather than cut off.
        () = shutdown.cut() => Ok(Err(ApiError::GatewayShutdown)),
    };
    let answered = match result {
        Err(_) => Err(ApiError::Timeout { secs }),
        Ok(Err(e)) => Err(e),
        // A wait for the worker's answer past the deadline is a failure of the call (the
        // call is dropped), not an abandoned request: the client is still there.
        Ok(Ok(mut started)) => match started.answer(deadline, secs).await {
            Ok(()) => Ok(started),
            Err(e) => Err(e),
        },
    };
    let mut response = match answered {
        Ok(started) => respond::respond(started, deadline, secs).await,
        Err(e) => {
            trail.failed(&e, None);
            e.into_response()
        }
    };
    add_policy_headers(response.headers_mut(), &policy_headers);
    response
}

/// Adds the headers the policies asked for to an answer's `headers`, except where the gateway
/// set the name already: theirs never replace its own (`x-should-retry: false` on a 500 keeps
/// a client from charging the tenant again for a failure, whatever a plugin says).
fn add_policy_headers(headers: &mut HeaderMap, policy_headers: &HeaderMap) {
    if policy_headers.is_empty() {
        return;
    }
    let set: Vec<bool> = (policy_headers.keys())
        .map(|name| headers.contains_key(name))
        .collect();
    for (name, set) in policy_headers.keys().zip(set) {
        if !set {
            for value in policy_headers.get_all(name) {
                headers.append(name.clone(), value.clone());
            }
        }
    }
}

/// Whether a body read failed because the client's connection ended (closed, reset) before the
/// body was whole, rather than for what the client sent: somewhere in the error's chain, an
/// I/O error of that kind or hyper's incomplete message.
fn closed_by_client(e: &(dyn std::error::Error + 'static)) -> bool {
    use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset, UnexpectedEof};
    std::iter::successors(Some(e), |e| e.source()).any(|e| {
        e.downcast_ref::<std::io::Error>().is_some_and(|io| {
            matches!(
                io.kind(),
                UnexpectedEof | ConnectionReset | ConnectionAborted | BrokenPipe
            )
        }) || e
            .downcast_ref::<hyper::Error>()
            .is_some_and(hyper::Error::is_incomplete_message)
    })
}

/// Everything up to the call to the worker: the request parsed, tokenized, admitted, allowed
/// by the policies, charged and routed, its call made (not answered yet). Once the policies
/// allowed it, the headers they add to its response are in `policy_headers`.
async fn start(
    state: &ApiState,
    who: &Authenticated,
    trail: &Trail,
    endpoint: Endpoint,
    headers: &HeaderMap,
    body: Body,
    policy_headers: &mut HeaderMap,
) -> Result<respond::Started, ApiError> {
    let tenant = who.tenant.clone();
    let mut permit = state.tenants.limiter().start(&tenant)?;
    let limit = state.http.max_body_bytes;
    // A declared length over the limit is refused before the body is read, so a client
    // waiting for `100 Continue` hears 413 at once instead of sending the body for nothing.
    if HttpBody::size_hint(&body).lower() > limit as u64 {
        return Err(ApiError::BodyTooLarge { limit });
    }
    // Read as sent: a compressed body would be parsed as JSON and refused as not JSON, and
    // one whose header lies would be taken as it is.
    if let Some(coding) = foreign_coding(headers) {
        return Err(ApiError::UnsupportedEncoding {
            coding: String::from_utf8_lossy(coding).chars().take(64).collect(),
        });
    }
    let waited = state.http.body_timeout;
    let read = tokio::time::timeout(waited, axum::body::to_bytes(body, limit)).await;
    let bytes = read
        .map_err(|_| ApiError::BodyTimeout {
            secs: waited.as_secs(),
        })?
        .map_err(|e| {
            let e = e.into_inner();
            if e.is::<http_body_util::LengthLimitError>() {
                ApiError::BodyTooLarge { limit }
            } else if closed_by_client(&*e) {
                ApiError::ClientClosedBody
            } else {
                ApiError::BodyUnreadable {
                    reason: e.to_string(),
                }
            }
        })?;
    let parsed = match endpoint {
        Endpoint::Chat => Parsed::Chat(parse_chat(&bytes)?),
        Endpoint::Completion => Parsed::Completion(parse_completion(&bytes)?),
    };
    let model = state.workers.model().ok_or(ApiError::NoHealthyWorker)?;
    trail.model(parsed.common().model.as_deref().unwrap_or(&model.name));
    if let Some(asked) = &parsed.common().model
        && !model.answers_to(asked)
    {
        return Err(ApiError::ModelNotFound {
            asked: asked.clone(),
            served: model.name.clone(),
        });
    }
    let span = tracing::info_span!("tokenize");
    let inline = (bytes.len() <= INLINE_TOKENIZE_BYTES)
        .then(|| span.in_scope(|| tokenize_kept(&model, &parsed)))
        .flatten();
    let (parsed, prompt) = if let Some(prompt) = inline {
        drop(span);
        (parsed, prompt)
    } else {
        let model = model.clone();
        tokio::task::spawn_blocking(move || {
            let prompt = tokenize(&model, &parsed);
            (parsed, prompt)
        })
        .instrument(span)
        .await
        .map_err(|_| ApiError::Internal)?
    };
    let prompt = prompt?;
    trail.prompt(&parsed.audited_text(), prompt.len());
    let common = parsed.common();

    // The tenant's limits now: a reload while the body came or the prompt was tokenized has
    // retuned its budget, and reaches its admission too.
    let limits = permit.limits();
    let limit = state
        .workers
        .effective_limit(limits.max_context)
        .ok_or(ApiError::NoHealthyWorker)?;
    let admitted = admission(
        endpoint,
        prompt.len(),
        common.max_tokens,
        limits.default_max_tokens(default_max_tokens(&state.http, endpoint), prompt.len()),
        limit,
    )?;
    // The policy chain (design step 3); a clamp of max tokens goes through admission again.
    let request_id = trail.request_id();
    let policy_span = tracing::info_span!(
        "policy",
        bulkhead.policy.decisions = Empty,
        bulkhead.policy.tags = Empty,
        bulkhead.policy.max_tokens = Empty,
        error.type = Empty,
    );
    let policy = state
        .policies
        .on_request(RequestFacts {
            id: &request_id,
            tenant: tenant.id.as_str(),
            model: &model.name,
            route: endpoint.path(),
            headers,
            prompt_tokens: admitted.prompt_tokens(),
            max_tokens: admitted.max_new_tokens(),
        })
        .instrument(policy_span.clone())
        .await
        .map_err(|refused| {
            // A refusal's record names the plugin that refused, and every decision before it.
            trail.policy(refused.decisions.iter().map(Into::into).collect());
            let e = ApiError::from(refused);
            policy_span.record("error.type", e.error_type());
            e
        })?;
    policy_span.record("bulkhead.policy.decisions", policy.decisions().len());
    let tags = policy.tags();
    if !tags.is_empty() {
        policy_span.record("bulkhead.policy.tags", tags_attribute(&tags));
    }
    policy_span.record(
        "bulkhead.policy.max_tokens",
        policy.clamp().map(NonZeroU32::get),
    );
    drop(policy_span);
    trail.policy(policy.decisions().iter().map(Into::into).collect());
    policy.add_headers(policy_headers);
    let routed = charge_and_route(
        state,
        endpoint,
        &mut permit,
        admitted,
        &policy,
        &model.id,
        limit,
    );
    let (admitted, route) = match routed {
        Ok(routed) => routed,
        Err(e) => {
            policy.failed();
            return Err(e);
        }
    };
    trail.routed(&route);

    let request = upstream::Generate {
        request_id: &request_id,
        tenant: tenant.id.as_str(),
        prompt,
        admitted,
        sampling: common.sampling,
        stop: &common.stop,
        cache_salt: common.cache_salt.as_deref(),
        instance_id: &route.instance_id,
    }
    .into_request();
    let upstream_span = route.client.span(&route.worker);
    let idle = state.http.stream_idle_timeout;
    let call = route
        .client
        .call(request, &upstream_span, &model, idle, route.serving());
    let prefix = match endpoint {
        Endpoint::Chat => "chatcmpl",
        Endpoint::Completion => "cmpl",
    };
    let id = format!("{prefix}-{}", request_id.trim_start_matches("req-"));
    Ok(respond::Started {
        endpoint,
        id,
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        model: model.name.clone(),
        stream_mode: common.stream,
        tenant,
        permit: Some(permit),
        prompt_tokens: admitted.prompt_tokens(),
        max_tokens: admitted.max_new_tokens(),
        route,
        metrics: state.metrics.clone(),
        upstream: Some(Leg::Calling(call)),
        progress: Progress::default(),
        policy: Some(policy),
        trail: trail.clone(),
        upstream_span,
        idle,
        shutdown: trail.shutdown_signal(),
        computed: respond::ComputedTokens::default(),
        deadline: None,
    })
}

/// The first coding of the body other than none: a `Content-Encoding` other than `identity`
/// or a transfer coding other than `chunked` (hyper undoes only that one), in any of the
/// headers' lines and list items — the first line alone let `identity` then `gzip` through.
fn foreign_coding(headers: &HeaderMap) -> Option<&[u8]> {
    let codings = |name, none: &'static [u8]| {
        headers
            .get_all(name)
            .into_iter()
            .flat_map(|v| v.as_bytes().split(|&b| b == b','))
            .map(<[u8]>::trim_ascii)
            .filter(|c| !c.is_empty())
            .find(move |c| !c.eq_ignore_ascii_case(none))
    };
    codings(CONTENT_ENCODING, b"identity").or_else(|| codings(TRANSFER_ENCODING, b"chunked"))
}

/// After the policies allowed a request: admission again when they clamped its max tokens,
/// its tokens-per-minute charge, and its route to a worker of `model_id`, the model it was
/// tokenized for.
fn charge_and_route(
    state: &ApiState,
    endpoint: Endpoint,
    permit: &mut RequestPermit,
    admitted: Admitted,
    policy: &RequestPolicy,
    model_id: &str,
    limit: EffectiveLimit,
) -> Result<(Admitted, Route), ApiError> {
    let admitted = match policy.clamp() {
        None => admitted,
        Some(max) => admission(
            endpoint,
            admitted.prompt_tokens() as usize,
            Some(max),
            default_max_tokens(&state.http, endpoint),
            limit,
        )?,
    };
    permit.charge_tokens(admitted.total_tokens())?;
    // Never its max tokens unless it used them: its end settles the charge to what it used
    // (`Started`, the policies' end); until then, at most its prompt.
    permit.set_used(u64::from(admitted.prompt_tokens()));
    let route = tracing::info_span!(
        "route",
        bulkhead.workers.decode = Empty,
        bulkhead.workers.prefill = Empty,
    )
    .in_scope(|| {
        let route = state.workers.route(&admitted, model_id);
        if let Some(r) = &route {
            let span = tracing::Span::current();
            span.record("bulkhead.workers.decode", r.worker.as_str());
            span.record("bulkhead.workers.prefill", r.prefill.as_deref());
        }
        route
    });
    match route {
        Some(route) => Ok((admitted, route)),
        None => {
            // Unroutable since the limit was taken (the policies ran in between): nothing was
            // used, so the tokens charged come back.
            permit.set_used(0);
            Err(ApiError::NoHealthyWorker)
        }
    }
}

/// `max_tokens` for a request of `endpoint` that names none.
fn default_max_tokens(http: &HttpLimits, endpoint: Endpoint) -> NonZeroU32 {
    match endpoint {
        Endpoint::Chat => http.default_max_tokens,
        Endpoint::Completion => http.default_completion_max_tokens,
    }
}

/// Gateway admission (design step 4) in its span: prompt + max tokens against `limit`.
fn admission(
    endpoint: Endpoint,
    prompt_tokens: usize,
    max_tokens: Option<NonZeroU32>,
    default_max_tokens: NonZeroU32,
    limit: EffectiveLimit,
) -> Result<Admitted, ApiError> {
    let span = tracing::info_span!(
        "admission",
        gen_ai.usage.input_tokens = prompt_tokens,
        gen_ai.request.max_tokens = max_tokens.map(NonZeroU32::get),
        bulkhead.admission.limit = limit.tokens,
        error.type = Empty,
    );
    span.in_scope(|| {
        admit(prompt_tokens, max_tokens, default_max_tokens, limit)
            .map_err(|exceeded| ApiError::ContextLengthExceeded { exceeded, endpoint })
            .inspect_err(|e| {
                span.record("error.type", e.error_type());
            })
    })
}

/// The prompt's token ids: chat messages through the model's chat template, completion
/// prompts as plain text (control-token text in them stays text). A prompt of no tokens (an
/// empty completion prompt) is refused as such, not left for admission to call too long.
fn tokenize(model: &ServedModel, parsed: &Parsed) -> Result<Vec<u32>, ApiError> {
    not_empty(prompt_ids(model, parsed)?, parsed.prompt_field())
}

/// [`tokenize`], unless that would render the chat template (a chat whose frame is not kept
/// yet, rendered in the template's sandbox): `None` then.
fn tokenize_kept(model: &ServedModel, parsed: &Parsed) -> Option<Result<Vec<u32>, ApiError>> {
    let (Parsed::Chat(chat), Ok(template)) = (parsed, &model.chat) else {
        return Some(tokenize(model, parsed));
    };
    let param = parsed.prompt_field();
    let ids = template.encode_kept(&model.tokenizer, &chat.messages, true)?;
    Some(
        ids.map_err(|e| chat_refused(e, param))
            .and_then(|ids| not_empty(ids, param)),
    )
}

/// `ids`, unless there are none.
fn not_empty(ids: Vec<u32>, param: &'static str) -> Result<Vec<u32>, ApiError> {
    if ids.is_empty() {
        return Err(ApiError::Prompt {
            reason: "the prompt is empty: there is no token to generate from".into(),
            param,
        });
    }
    Ok(ids)
}

/// What a chat prompt the template could not encode is told: why, when the template or the
/// messages are at fault; to retry when its sandbox was unavailable (the sandbox logged why).
fn chat_refused(e: ChatError, param: &'static str) -> ApiError {
    if e.transient() {
        return ApiError::TemplateBusy;
    }
    ApiError::Prompt {
        reason: e.to_string(),
        param,
    }
}

/// The prompt's token ids, however many (none for an empty completion prompt).
fn prompt_ids(model: &ServedModel, parsed: &Parsed) -> Result<Vec<u32>, ApiError> {
    let param = parsed.prompt_field();
    let prompt = |e: &dyn std::fmt::Display| ApiError::Prompt {
        reason: format!("the prompt cannot be tokenized: {e}"),
        param,
    };
    match parsed {
        Parsed::Chat(chat) => {
            let template = model.chat.as_ref().map_err(|reason| ApiError::Prompt {
                reason: reason.clone(),
                param,
            })?;
            template
                .encode(&model.tokenizer, &chat.messages, true)
                .map_err(|e| chat_refused(e, param))
        }
        Parsed::Completion(c) => match &c.prompt {
            CompletionPrompt::Text(text) => {
                model.tokenizer.encode_prompt(text).map_err(|e| prompt(&e))
            }
            CompletionPrompt::Tokens(ids) => {
                let vocab = model.tokenizer.vocab_size();
                match ids.iter().find(|&&id| id as usize >= vocab) {
                    Some(id) => Err(ApiError::Prompt {
                        reason: format!(
                            "prompt token id {id} is out of range: the vocabulary has {vocab} tokens"
                        ),
                        param,
                    }),
                    None => Ok(ids.clone()),
                }
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A plugin's header never replaces one the gateway set on the answer: a plugin adding
    /// `x-should-retry: true` turned the 500 of a KV integrity failure into one the official
    /// client sends again (charging the tenant each time).
    #[test]
    fn a_policys_header_adds_to_the_answer_and_replaces_none_of_the_gateways() {
        let mut answer = HeaderMap::new();
        answer.insert("x-should-retry", http::HeaderValue::from_static("false"));
        let mut policies = HeaderMap::new();
        policies.insert("x-should-retry", http::HeaderValue::from_static("true"));
        policies.append("x-tier", http::HeaderValue::from_static("gold"));
        policies.append("x-tier", http::HeaderValue::from_static("eu"));
        add_policy_headers(&mut answer, &policies);
        let all = |name| -> Vec<_> { answer.get_all(name).iter().cloned().collect() };
        assert_eq!(all("x-should-retry"), ["false"]);
        assert_eq!(all("x-tier"), ["gold", "eu"]);
    }

    #[test]
    fn every_line_and_item_of_a_bodys_codings_is_read() {
        let with = |lines: &[(&str, &str)]| {
            let mut h = HeaderMap::new();
            for (name, value) in lines {
                h.append(
                    http::HeaderName::from_bytes(name.as_bytes()).expect("a name"),
                    http::HeaderValue::from_str(value).expect("a value"),
                );
            }
            foreign_coding(&h).map(|c| String::from_utf8_lossy(c).into_owned())
        };
        assert_eq!(with(&[]), None);
        assert_eq!(with(&[("content-encoding", "Identity")]), None);
        assert_eq!(with(&[("transfer-encoding", "chunked")]), None);
        for (lines, coding) in [
            (&[("content-encoding", "gzip")][..], "gzip"),
            (
                &[
                    ("content-encoding", "identity"),
                    ("content-encoding", "gzip"),
                ][..],
                "gzip",
            ),
            (&[("content-encoding", "identity, br")][..], "br"),
            (&[("transfer-encoding", "gzip, chunked")][..], "gzip"),
        ] {
            assert_eq!(with(lines).as_deref(), Some(coding), "{lines:?}");
        }
    }

    #[test]
    fn the_audited_prompt_keeps_its_byte_format() {
        // Records written before and after must hash prompts alike: keys sorted, compact.
        let chat = validate::parse_chat(
            br#"{"messages":[{"role":"system","content":"be \"brief\""},{"role":"user","content":"hi\n"}]}"#,
        )
        .expect("valid");
        assert_eq!(
            Parsed::Chat(chat).audited_text(),
            r#"[{"content":"be \"brief\"","role":"system"},{"content":"hi\n","role":"user"}]"#
        );
        let ids = validate::parse_completion(br#"{"prompt":[1,2,3]}"#).expect("valid");
        assert_eq!(Parsed::Completion(ids).audited_text(), "[1,2,3]");
    }

    #[test]
    fn tags_on_the_trace_cannot_forge_another() {
        let tags = [("tier".to_owned(), "gold,tenant=tenant-b".to_owned())];
        let attribute = tags_attribute(&tags);
        let read: serde_json::Value = serde_json::from_str(&attribute).expect("JSON");
        assert_eq!(read, serde_json::json!(["tier=gold,tenant=tenant-b"]));
    }

    #[test]
    fn a_path_is_recorded_as_the_template_of_its_route() {
        for (path, route) in [
            ("/v1/chat/completions", Some(CHAT_ROUTE)),
            ("/v1/models", Some(MODELS_ROUTE)),
            ("/v1/models/smollm2-135m-instruct", Some(MODEL_ROUTE)),
            ("/v1/models/org/model", Some(MODEL_ROUTE)),
            ("/v1/models/", None),
            ("/v1/modelsx", None),
            ("/v1/chat", None),
        ] {
            assert_eq!(route_of(path), route, "{path}");
        }
    }
}
