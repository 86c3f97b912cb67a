//! The workers the gateway routes to: what each one reported (Info, Health), whether it may be
//! routed to and why not, the served model (tokenizer and chat template, built from a worker's
//! Info: the worker is their source of truth), and outstanding tokens for routing.
//!
//! ```text
//!   refresh task ──Info/Health every N s──▶ workers ─┐
//!        │                                          ▼
//!        └──────────────▶ Workers { Mutex<State> } ◀── API handlers: model(), effective_limit(),
//!                                                       route(Admitted) → Route (outstanding
//!                                                       tokens held until the Route drops)
//! ```
//!
//! The state is a few numbers per worker, updated synchronously under a mutex that is never
//! held across an await; the RPCs happen outside it. Workers found through DNS
//! ([`crate::discovery`]) come and go with [`Workers::set_members`]; every entry has an id that
//! is never reused, so a route to a worker that has left ends its claim on nothing.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bulkhead_checks::Check;
use bulkhead_worker::chat::ChatTemplate;
use bulkhead_worker::printable::printable;
use bulkhead_worker::serve::cluster_token;
use bulkhead_worker::serve::info::describe_file;
use bulkhead_worker::serve::proto::{
    self, HealthRequest, InfoRequest, ServingStatus, TokenizerData,
};
use bulkhead_worker::serve::tls;
use bulkhead_worker::tokenizer::{Tokenizer, TokenizerParts};
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use serde::Serialize;

use crate::admission::{Admitted, EffectiveLimit, WorkerCapacity, effective_limit};
use crate::config::{ClusterAccess, OpenAiUpstream, Protocol, WorkerConfig, WorkerRole};
use crate::routing::{Candidate, least_outstanding};
use crate::stalls::Stalls;
use crate::upstreams::{OpenAiClient, Upstream};
use std::num::NonZeroU32;

/// Bound on each Info (without tokenizer) and Health call.
const RPC_TIMEOUT: Duration = Duration::from_secs(3);
/// Bound on the Info call that carries the tokenizer (about 1 MB).
const TOKENIZER_TIMEOUT: Duration = Duration::from_secs(30);
/// Bound on the size of the Info that carries the tokenizer: gRPC's default, 4 MiB, is less
/// than a large vocabulary's (Llama 3's 128k tokens and 280k merges take about 5 MB).
const MAX_TOKENIZER_INFO_BYTES: usize = 64 << 20;
/// Bound on connecting to a worker.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// The most bytes of a reason not to route to a worker that its log line shows.
const MAX_REASON_BYTES: usize = 1024;

/// What a worker's Info said.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Facts {
    pub model_id: String,
    pub model_name: String,
    /// The longest prompt + max tokens it serves.
    pub served_context: u64,
    pub model_context: u64,
    /// Its measured KV pool.
    pub pool_tokens: u64,
    pub pool_pages: u32,
    pub page_tokens: u32,
}

/// How the gateway reaches its Bulkhead workers (`/workers`: `access`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Access {
    pub cluster_token: bool,
    pub mutual_tls: bool,
}

/// What a worker's Health said, or why there is no answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Health {
    /// Not asked yet.
    Unknown,
    Serving {
        pool_pages_total: u32,
        pool_pages_free: u32,
        /// Held by the prefix cache: not free, but evicted as soon as a reservation needs them.
        pool_pages_cached: u32,
        /// Out of service until no transfer can write them (counted in the total).
        pool_pages_quarantined: u32,
        queue_depth: u32,
        running: u32,
    },
    NotServing,
    Unreachable {
        error: String,
    },
}

/// Why a worker is not routed to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, thiserror::Error)]
#[serde(tag = "reason", rename_all = "snake_case")]
pub enum Unroutable {
    #[error("its Info has not been read yet")]
    NoInfo,
    #[error("its health is not known yet")]
    HealthUnknown,
    #[error("it reports that it is not serving")]
    NotServing,
    #[error("it does not answer: {error}")]
    Unreachable { error: String },
    #[error(
        "its KV pool ({pool_tokens} tokens) is smaller than the context it serves \
         ({served_context}); restart it with a larger pool or a shorter context"
    )]
    PoolSmallerThanContext {
        pool_tokens: u64,
        served_context: u64,
    },
    #[error("it serves model {model_id}, not the gateway's model {served}")]
    OtherModel { model_id: String, served: String },
    #[error(
        "quarantined pages leave {in_service} tokens of its pool in service, less than the \
         context it serves ({served_context}); they come back once no transfer can write them"
    )]
    Quarantined {
        in_service: u64,
        served_context: u64,
    },
    #[error("it fails the preflight check {check:?} ({detail})")]
    FailsCheck { check: &'static str, detail: String },
    #[error("prefill workers are reached through the decode workers that name them")]
    PrefillOnly,
    /// A decode worker that has not asked its prefill worker yet (it asks within a second of
    /// its start): neither a fault nor news, so never logged.
    #[error("it has not reached its prefill worker yet")]
    PrefillNotReachedYet,
    #[error("its prefill worker {prefill:?} is not usable: {why}")]
    PrefillUnusable { prefill: String, why: String },
    #[error("preflight fails between it and its prefill worker: {check} ({detail})")]
    PreflightFails { check: &'static str, detail: String },
    #[error(
        "the last {in_a_row} requests routed to it reached their deadline with no answer (a hung \
         or overloaded server, though its health checks may pass): not routed to for another \
         {routed_again_in_secs} s"
    )]
    Stalled {
        in_a_row: u32,
        routed_again_in_secs: u64,
    },
    #[error(
        "it answers calls that present no cluster token (started without \
         --cluster-token-file?): anyone who reaches it runs requests past the gateway"
    )]
    AnswersWithoutToken,
    /// One process reached at two addresses (a dual-stack name lists a pod under its IPv4
    /// and its IPv6 address): routed to, and counted, as one member.
    #[error("it is the process {worker} answers for (the same instance id), routed to there")]
    SameProcess { worker: String },
}

/// Whether a worker may be routed to: `None` when it may.
pub fn unroutable(
    facts: Option<&Facts>,
    health: &Health,
    served_model: Option<&str>,
) -> Option<Unroutable> {
    let facts = match facts {
        Some(f) => f,
        None => return Some(Unroutable::NoInfo),
    };
    match health {
        Health::Serving {
            pool_pages_total,
            pool_pages_quarantined,
            ..
        } => {
            // Quarantined pages come back only once no transfer can write them: until then a
            // request of the whole served context could wait for pages that are not there.
            let pages = pool_pages_total.saturating_sub(*pool_pages_quarantined);
            let in_service = u64::from(pages) * u64::from(facts.page_tokens);
            if *pool_pages_quarantined > 0 && in_service < facts.served_context {
                return Some(Unroutable::Quarantined {
                    in_service,
                    served_context: facts.served_context,
                });
            }
        }
        Health::Unknown => return Some(Unroutable::HealthUnknown),
        Health::NotServing => return Some(Unroutable::NotServing),
        Health::Unreachable { error } => {
            return Some(Unroutable::Unreachable {
                error: error.clone(),
            });
        }
    }
    if facts.pool_tokens < facts.served_context {
        return Some(Unroutable::PoolSmallerThanContext {
            pool_tokens: facts.pool_tokens,
            served_context: facts.served_context,
        });
    }
    match served_model {
        Some(served) if served != facts.model_id => Some(Unroutable::OtherModel {
            model_id: facts.model_id.clone(),
            served: served.to_owned(),
        }),
        _ => None,
    }
}

/// The model the gateway serves: tokenizer and chat template built from a worker's Info.
pub struct ServedModel {
    /// The worker's model id (changes when the model file does).
    pub id: String,
    /// The public name: `/v1/models`'s id and what requests' `model` may say.
    pub name: String,
    pub tokenizer: Tokenizer,
    /// Why chat prompts cannot be rendered, when they cannot.
    pub chat: Result<ChatTemplate, String>,
    /// When the gateway registered it (Unix seconds), for `/v1/models`.
    pub created: u64,
}

impl fmt::Debug for ServedModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServedModel")
            .field("id", &self.id)
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl ServedModel {
    /// Builds the model's tokenizer and chat template from a worker's Info.
    pub fn from_info(info: &proto::InfoResponse, data: &TokenizerData) -> Result<Self, String> {
        let tokenizer = Tokenizer::from_parts(TokenizerParts {
            model: &data.model,
            pre: (!data.pre.is_empty()).then_some(data.pre.as_str()),
            tokens: &data.tokens,
            merges: &data.merges,
            token_types: &data.token_types,
            bos: info.bos_token_id,
            eos: info.eos_token_id,
            add_bos: data.add_bos,
        })
        .map_err(|e| format!("cannot build the tokenizer from the worker's Info: {e}"))?;
        let text = |id: Option<u32>| {
            id.and_then(|i| data.tokens.get(i as usize))
                .cloned()
                .unwrap_or_default()
        };
        let chat = if !info.chat_template_refused.is_empty() {
            // The template is there, and not sent: longer than a worker takes.
            Err(printable(&info.chat_template_refused, MAX_REASON_BYTES))
        } else if info.chat_template.is_empty() {
            Err("the served model has no chat template; use /v1/completions".to_owned())
        } else {
            ChatTemplate::new(
                &info.chat_template,
                text(info.bos_token_id),
                text(Some(info.eos_token_id)),
            )
            .map_err(|e| e.to_string())
        };
        Ok(ServedModel {
            id: info.model_id.clone(),
            name: public_name(&info.model_name, &info.model_id),
            tokenizer,
            chat,
            created: unix_secs_now(),
        })
    }

    /// Whether a request's `model` names this model (its public name or its id).
    pub fn answers_to(&self, asked: &str) -> bool {
        asked == self.name || asked == self.id
    }
}

/// `SmolLM2 135M Instruct` → `smollm2-135m-instruct`; the id when the name is empty.
pub fn public_name(model_name: &str, model_id: &str) -> String {
    let slug: String = model_name
        .trim()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    let slug = slug
        .split('-')
        .filter(|p| !p.is_empty())
        .collect::<Vec<_>>()
        .join("-");
    if slug.is_empty() {
        model_id.to_owned()
    } else {
        slug
    }
}

/// Seconds since the Unix epoch, now (0 on a clock set before it).
fn unix_secs_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// How a worker group's last DNS lookup went.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GroupLookup {
    /// The `host:port` looked up.
    pub dns: String,
    /// Its members now: those the lookup found, or, after a failed one, those kept from the
    /// last answer (possibly gone).
    pub members: usize,
    pub last_lookup_unix_secs: u64,
    /// Why the last lookup failed; `None` after an answer.
    pub error: Option<String>,
    /// Since when the lookups have been failing (the kept members are that old at least).
    pub failing_since_unix_secs: Option<u64>,
}

/// What `/workers` shows for one worker.
#[derive(Debug, Clone, Serialize)]
pub struct WorkerReport {
    pub name: String,
    /// The worker group it was discovered through; absent when listed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    pub endpoint: String,
    pub role: &'static str,
    pub info: Option<Facts>,
    pub health: Health,
    pub routable: bool,
    pub unroutable: Option<Unroutable>,
    /// Why, in words.
    pub unroutable_reason: Option<String>,
    pub outstanding_tokens: u64,
    /// The last error seen from it (it may have recovered since: see `health`), and when.
    pub last_error: Option<String>,
    pub last_error_unix_secs: Option<u64>,
}

struct Entry {
    /// Unique over the gateway's lifetime (never reused when a worker leaves and returns).
    id: u64,
    config: WorkerConfig,
    client: Upstream,
    /// With a cluster token: a client of the same worker presenting none, to check that the
    /// worker refuses it.
    bare: Option<cluster_token::Client>,
    /// The worker answered `bare` at the last probe.
    open: bool,
    facts: Option<Facts>,
    /// The last Info as received, for the handoff checks between a decode worker and its
    /// prefill worker.
    info: Option<Arc<proto::InfoResponse>>,
    /// An OpenAI upstream's tokenizer, read from its configured GGUF.
    tokenizer: Option<Arc<TokenizerData>>,
    health: Health,
    outstanding: u64,
    /// The last error seen from it, and when.
    last_error: Option<(String, SystemTime)>,
    /// Requests it took and left unanswered until their deadline.
    stalls: Stalls,
    /// The instance id of the process that last answered Info at its address (empty: none
    /// yet, or an OpenAI upstream, which has none).
    instance: String,
    /// Registering the model it serves failed (its Info with the tokenizer did not come, or
    /// did not build), since that process answered: another worker's is tried first.
    model_refused: bool,
    /// Which reason not to serve through it was last logged (`None`: none, or a sound
    /// prefill worker's): the log says each change of kind once, not at every refresh (a
    /// reason's figures, an ejection's countdown say, change at every one).
    logged_unroutable: Option<std::mem::Discriminant<Unroutable>>,
    /// The number of the refresh whose answer it holds (0: none yet): an answer from an
    /// earlier refresh that comes later is stale, and dropped.
    refreshed_by: u64,
}

impl Entry {
    /// Notes `error` as the last one seen from it.
    fn note_error(&mut self, error: String) {
        self.last_error = Some((error, SystemTime::now()));
    }

    /// The GGUF to read for an OpenAI upstream whose Info is not known yet.
    fn describe(&self) -> Option<Describe> {
        match &self.config.protocol {
            Protocol::OpenAi(OpenAiUpstream {
                tokenizer,
                context_length,
                ..
            }) if self.info.is_none() => Some((tokenizer.clone(), u64::from(context_length.get()))),
            _ => None,
        }
    }

    fn model_source(&self) -> ModelSource {
        match (&self.client, &self.info, &self.tokenizer) {
            (Upstream::OpenAi(_), Some(info), Some(data)) => {
                ModelSource::File(info.clone(), data.clone())
            }
            (Upstream::Grpc(client), _, _) => ModelSource::Grpc(client.clone()),
            // Unreachable in practice (an OpenAI entry gets both at once); asking a gRPC Info of
            // an HTTP server would fail, so report it as a missing tokenizer.
            (Upstream::OpenAi(_), _, _) => ModelSource::File(
                Arc::new(proto::InfoResponse::default()),
                Arc::new(TokenizerData::default()),
            ),
        }
    }
}

#[derive(Default)]
struct State {
    entries: Vec<Entry>,
    /// Each worker group's last DNS lookup, by group name.
    lookups: std::collections::BTreeMap<String, GroupLookup>,
    model: Option<Arc<ServedModel>>,
    /// The next entry id.
    next_id: u64,
    /// The token presented on every call to a Bulkhead worker, and the TLS they go over.
    cluster: ClusterAccess,
    /// Which entries may be routed to: judged once after any change (the checks behind it
    /// format their findings), not at every request. `None`: to judge again.
    judged: Option<Judged>,
    /// Refreshes started so far: each one's number orders its answers against another's that
    /// overlaps it (the periodic one and one a DNS change triggers).
    refreshes: u64,
    /// The number of the last refresh that settled the served model: kept it, or registered
    /// another (a slower, earlier one's registration does not replace that).
    model_by: u64,
}

/// Which entries may be routed to, by index, and until when that holds without a change: an
/// ejection lapses with time.
struct Judged {
    routable: Vec<bool>,
    /// When the first ejection in force ends.
    until: Option<Instant>,
}

impl State {
    fn served_id(&self) -> Option<&str> {
        self.model.as_ref().map(|m| m.id.as_str())
    }

    /// The prefill workers a decode worker's `prefill = name` designates: that worker, or
    /// every current member of that group.
    fn prefills<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a Entry> + Clone + 'a {
        self.entries
            .iter()
            .filter(move |e| e.config.role == WorkerRole::Prefill && e.config.answers_to(name))
    }

    fn entry_mut(&mut self, id: u64) -> Option<&mut Entry> {
        self.entries.iter_mut().find(|e| e.id == id)
    }

    /// Takes what refresh number `refresh` learned of entry `i`, unless the entry holds a later
    /// refresh's answer already (two refreshes overlap, the earlier one's probe slower).
    fn apply(&mut self, refresh: u64, i: u64, answer: Probe) {
        // Gone while we asked, or answered since by a later refresh: nothing to update.
        let Some(e) = self.entry_mut(i).filter(|e| e.refreshed_by < refresh) else {
            return;
        };
        e.refreshed_by = refresh;
        e.open = answer.open;
        match answer.health {
            Ok(h) => e.health = h,
            Err(error) => {
                e.health = Health::Unreachable {
                    error: error.clone(),
                };
                e.note_error(error);
            }
        }
        match answer.info {
            Some(Ok((info, tokenizer))) => {
                // Another process at the address (restarted, or a pod recreated there):
                // the requests the last one left unanswered say nothing of this one, which
                // would stay ejected for up to five minutes.
                if e.instance != info.instance_id {
                    if !e.instance.is_empty() {
                        e.stalls = Stalls::default();
                    }
                    e.model_refused = false;
                    info.instance_id.clone_into(&mut e.instance);
                }
                e.facts = Some(facts_of(&info));
                e.info = Some(info);
                if tokenizer.is_some() {
                    e.tokenizer = tokenizer;
                }
            }
            // What it said before may no longer hold (restarted with a smaller pool,
            // say): not routed to until it says again.
            Some(Err(error)) => {
                e.facts = None;
                e.info = None;
                e.note_error(error);
            }
            None => {}
        }
    }

    /// The worker whose model to register, and where to read it: none while a healthy worker
    /// that passes its own checks still serves the served model; otherwise the first healthy
    /// worker's — one that passes them (pages quarantined for now aside) first, then the first whose model did not fail to
    /// register, so one whose Info with the tokenizer fails or does not build is not asked
    /// again and again while another could serve. A worker that fails its checks (a pool
    /// smaller than its context, a wrong role, no cluster token) listed first registered its
    /// model, and every sound worker of another model stood idle behind it.
    fn model_to_register(&self) -> Option<(u64, ModelSource)> {
        let healthy = |e: &&Entry| e.facts.is_some() && matches!(e.health, Health::Serving { .. });
        // Its lasting faults only: pages quarantined for now come back.
        let sound = |e: &Entry| {
            matches!(
                unroutable(e.facts.as_ref(), &e.health, None),
                None | Some(Unroutable::Quarantined { .. })
            ) && misconfigured(e).is_none()
        };
        let keep = self.served_id().is_some_and(|current| {
            (self.entries.iter().filter(healthy))
                .any(|e| sound(e) && e.facts.as_ref().is_some_and(|f| f.model_id == current))
        });
        if keep {
            return None;
        }
        self.entries
            .iter()
            .filter(healthy)
            .min_by_key(|e| (!sound(e), e.model_refused))
            .map(|e| (e.id, e.model_source()))
    }

    fn push(&mut self, config: WorkerConfig) -> Result<(), EndpointError> {
        let (client, bare) = client(&config, &self.cluster)?;
        self.entries.push(Entry {
            id: self.next_id,
            config,
            client,
            bare,
            open: false,
            facts: None,
            info: None,
            tokenizer: None,
            health: Health::Unknown,
            outstanding: 0,
            last_error: None,
            stalls: Stalls::default(),
            instance: String::new(),
            model_refused: false,
            logged_unroutable: None,
            refreshed_by: 0,
        });
        self.next_id += 1;
        Ok(())
    }

    /// Why `e` itself may not be routed to (or fill a decode worker's pages): its own state,
    /// or an earlier worker that may be is the same process.
    fn own(&self, e: &Entry) -> Option<Unroutable> {
        self.own_alone(e).or_else(|| {
            let id = e
                .info
                .as_ref()
                .map(|i| i.instance_id.as_str())
                .filter(|id| !id.is_empty())?;
            let same = self
                .entries
                .iter()
                .filter(|other| other.info.as_ref().is_some_and(|i| i.instance_id == id));
            // A process ejected at one address (hung, whatever the path) is at every one.
            if let Some(stalled) = same.clone().find_map(stalled) {
                return Some(stalled);
            }
            let first = same
                .take_while(|earlier| !std::ptr::eq(*earlier, e))
                .find(|earlier| self.own_alone(earlier).is_none())?;
            Some(Unroutable::SameProcess {
                worker: first.config.name.clone(),
            })
        })
    }

    /// [`State::own`], of `e` alone.
    fn own_alone(&self, e: &Entry) -> Option<Unroutable> {
        unroutable(e.facts.as_ref(), &e.health, self.served_id())
            .or_else(|| stalled(e))
            .or_else(|| misconfigured(e))
    }

    /// Logs each worker whose reason not to serve through it changed since it was last
    /// logged: a warning naming the reason and the last error (an operator reading the log
    /// sees why a worker takes no traffic — a refused certificate, a wrong token — without
    /// asking `/workers`), and a line when it serves again.
    fn log_routability(&mut self) {
        for i in 0..self.entries.len() {
            let reason = match self.unroutable(&self.entries[i]) {
                None | Some(Unroutable::PrefillOnly) => None,
                // Another address of a process served at its first: nothing to say either way.
                Some(Unroutable::SameProcess { .. }) => {
                    self.entries[i].logged_unroutable = None;
                    continue;
                }
                // A worker starting: said once it is settled, either way.
                Some(Unroutable::PrefillNotReachedYet) => continue,
                Some(why) => Some(why),
            };
            let e = &mut self.entries[i];
            let kind = reason.as_ref().map(std::mem::discriminant);
            if kind == e.logged_unroutable {
                continue;
            }
            // Escaped: a reason quotes what a worker said (its model id, its error).
            match reason.map(|why| printable(&why.to_string(), MAX_REASON_BYTES)) {
                Some(why) => {
                    // An unreachable worker's reason is its last error already.
                    let error = e.last_error.as_ref().map(|(error, _)| error.as_str());
                    match error.filter(|error| !why.contains(error)) {
                        Some(last_error) => tracing::warn!(worker = %e.config.name,
                            reason = %why, last_error, "not routing to a worker"),
                        None => tracing::warn!(worker = %e.config.name, reason = %why,
                            "not routing to a worker"),
                    }
                }
                None => tracing::info!(worker = %e.config.name, "routing to a worker again"),
            }
            e.logged_unroutable = kind;
        }
    }

    fn unroutable(&self, e: &Entry) -> Option<Unroutable> {
        let own = self.own(e);
        match (e.config.role, &e.config.prefill) {
            (WorkerRole::Both, _) => own,
            (WorkerRole::Prefill, _) => own.or(Some(Unroutable::PrefillOnly)),
            (WorkerRole::Decode, prefill) => own.or_else(|| {
                let name = prefill.as_deref().unwrap_or_default();
                // Any of them may fill this worker's pages (a group is reached through its
                // Service): at least one must be usable, and every one that reported its Info
                // must pass the pair checks.
                let prefills = self.prefills(name);
                let mut first_why = None;
                let usable = prefills.clone().filter(|p| {
                    let why = self.own(p);
                    if first_why.is_none() {
                        first_why.clone_from(&why);
                    }
                    why.is_none()
                });
                if usable.count() == 0 {
                    let why = first_why.map_or_else(
                        || "no such prefill worker is known (yet)".to_owned(),
                        |r| r.to_string(),
                    );
                    let prefill = name.to_owned();
                    return Some(Unroutable::PrefillUnusable { prefill, why });
                }
                // Whichever of them the Service picks fills the pages: one set up unsafely (its
                // integrity checks off, calls taken without the token) must not, however usable
                // the others are. What passes (unreachable, stalled, not serving) is the
                // Service's to route around.
                if let Some((p, why)) = prefills.clone().find_map(|p| Some((p, misconfigured(p)?)))
                {
                    return Some(Unroutable::PrefillUnusable {
                        prefill: name.to_owned(),
                        why: format!("{}: {why}", p.config.name),
                    });
                }
                // One that serves may fill its pages: its pool and the pair checks must be
                // known, not skipped. (One not asked yet — a member DNS just listed — is not
                // waited for: its probe brings its Health and Info together, and
                // the prefill worker's own admission and decode's verification hold meanwhile.)
                let unknown = prefills
                    .clone()
                    .find(|p| matches!(p.health, Health::Serving { .. }) && p.info.is_none());
                if let Some(p) = unknown {
                    return Some(Unroutable::PrefillUnusable {
                        prefill: name.to_owned(),
                        why: format!("{} serves but its Info has not been read", p.config.name),
                    });
                }
                // The same checks as `bulkhead preflight`, at run time; without this worker's
                // Info there is nothing to check them against, so no routing either.
                let Some(d) = e.info.as_ref() else {
                    return Some(Unroutable::NoInfo);
                };
                if !bulkhead_checks::enabled(Check::RoutingChecks) {
                    return None;
                }
                // Not asked yet: what the check below would say is not known yet either (a
                // failed probe leaves its error, which the check then reports).
                if d.prefill_peer
                    .as_ref()
                    .is_some_and(|p| p.instance_id.is_empty() && p.last_error.is_empty())
                {
                    return Some(Unroutable::PrefillNotReachedYet);
                }
                let members = prefills
                    .clone()
                    .map(|p| (p.config.name.as_str(), p.info.as_deref()));
                let dials = crate::preflight::peer(&e.config.name, d, name, members);
                let pairs = prefills
                    .filter_map(|p| Some((p, p.info.as_ref()?)))
                    .flat_map(|(p, pi)| {
                        crate::preflight::pair(&e.config.name, d, &p.config.name, pi)
                    });
                std::iter::once(dials)
                    .chain(pairs)
                    .find(|c| !c.pass)
                    .map(|c| Unroutable::PreflightFails {
                        check: c.name,
                        detail: c.detail,
                    })
            }),
        }
    }

    /// What a request routed to `e` must fit: its own served context and pool, and for a
    /// decode worker its prefill worker's as well (invariant I7: the gateway's limit is the
    /// minimum over every pool the request will occupy).
    fn capacity(&self, e: &Entry) -> Option<WorkerCapacity> {
        let own = e.facts.as_ref()?;
        let mut c = WorkerCapacity {
            served_context: own.served_context,
            pool_tokens: own.pool_tokens,
        };
        // Every prefill worker that may fill it, that has reported (a routable decode worker
        // has at least one).
        if let Some(name) = e.config.prefill.as_deref() {
            for pf in self.prefills(name).filter_map(|p| p.facts.as_ref()) {
                c.served_context = c.served_context.min(pf.served_context);
                c.pool_tokens = c.pool_tokens.min(pf.pool_tokens);
            }
        }
        Some(c)
    }

    /// Whether `e` may be routed to now.
    fn may_route(&self, e: &Entry) -> bool {
        self.model.is_some() && self.unroutable(e).is_none()
    }

    /// Judges which entries may be routed to, unless nothing changed (and no ejection ended)
    /// since they last were.
    fn judge(&mut self) {
        let now = Instant::now();
        if (self.judged.as_ref()).is_some_and(|j| j.until.is_some_and(|until| now >= until)) {
            self.judged = None;
        }
        if self.judged.is_none() {
            let routable = self.entries.iter().map(|e| self.may_route(e)).collect();
            let until = (self.entries.iter())
                .filter_map(|e| e.stalls.ejected(now))
                .map(|ejection| now + ejection.lasts)
                .min();
            self.judged = Some(Judged { routable, until });
        }
    }

    /// The entries routed to: as last judged ([`State::judge`]), or judged now when nothing
    /// was since the last change.
    fn routable(&self) -> impl Iterator<Item = (usize, &Entry)> {
        (self.entries.iter().enumerate()).filter(|&(i, e)| match &self.judged {
            Some(judged) => judged.routable.get(i) == Some(&true),
            None => self.may_route(e),
        })
    }
}

/// How `e` is set up, where that makes it unsafe to route through: it answers calls without
/// the cluster token, or fails one of `bulkhead preflight`'s checks of one worker (at run
/// time; an OpenAI-compatible server has no KV handoff and no role of Bulkhead's to check).
fn misconfigured(e: &Entry) -> Option<Unroutable> {
    if e.open {
        return Some(Unroutable::AnswersWithoutToken);
    }
    let info = e.info.as_ref().filter(|_| {
        matches!(e.client, Upstream::Grpc(_)) && bulkhead_checks::enabled(Check::RoutingChecks)
    })?;
    crate::preflight::own(&e.config.name, e.config.role, info)
        .into_iter()
        .find(|c| !c.pass)
        .map(|c| Unroutable::FailsCheck {
            check: c.name,
            detail: c.detail,
        })
}

/// Why `e` is not routed to for now, when the requests routed to it stalled.
fn stalled(e: &Entry) -> Option<Unroutable> {
    let ejection = e.stalls.ejected(Instant::now())?;
    Some(Unroutable::Stalled {
        in_a_row: ejection.in_a_row,
        routed_again_in_secs: ejection.lasts.as_secs_f64().ceil() as u64,
    })
}

/// Every configured worker; a cheap `Clone` handle.
#[derive(Clone)]
pub struct Workers {
    shared: Arc<Shared>,
}

/// What the handles share: one allocation, one reference count per clone.
struct Shared {
    state: Mutex<State>,
    /// Some worker has unanswered requests counted (set and cleared under `state`'s lock): an
    /// answer then clears its worker's count; while none has, an answer costs no lock.
    stalls_counted: AtomicBool,
}

impl fmt::Debug for Workers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Workers").finish_non_exhaustive()
    }
}

/// A worker's configured address is not a valid endpoint.
#[derive(Debug, thiserror::Error)]
#[error("worker {name}: {reason}")]
pub struct EndpointError {
    name: String,
    reason: String,
}

/// The route a request took; its tokens count as outstanding on that worker until it drops
/// (or, once its claim is taken, until the claim drops).
#[derive(Debug)]
#[must_use = "dropping the route ends its claim on the worker"]
pub struct Route {
    pub worker: String,
    /// The prefill worker that fills the decode worker's pages; `None` when colocated.
    pub prefill: Option<String>,
    pub client: Upstream,
    /// The `instance_id` of the worker process the route was judged by (its Info): a request
    /// names it, and another process at the address refuses it.
    pub instance_id: String,
    workers: Workers,
    /// The worker's entry id.
    id: u64,
    /// `None` once taken ([`Route::take_claim`]).
    claim: Option<Claim>,
}

/// A request's tokens, counted as outstanding on the worker it was routed to until dropped.
#[derive(Debug)]
#[must_use = "dropping the claim ends it"]
pub struct Claim {
    workers: Workers,
    /// The worker's entry id.
    id: u64,
    tokens: u64,
}

impl Claim {
    /// The worker failed the request it claims (a transport failure, or not serving): not
    /// routed to until its health check answers again, as [`Route::failed`].
    pub fn worker_failed(&self, error: &str) {
        self.workers.failed(self.id, error);
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        let (id, tokens) = (self.id, self.tokens);
        self.workers.routing(|s| {
            if let Some(e) = s.entry_mut(id) {
                e.outstanding = e.outstanding.saturating_sub(tokens);
            }
        });
    }
}

impl Route {
    /// The route's claim on its worker, to outlive the route: a request held after its client
    /// left still loads the worker until the hold ends.
    pub fn take_claim(&mut self) -> Option<Claim> {
        self.claim.take()
    }

    /// Whether the worker's last health check answered that it serves: a check for a call
    /// that waits for it to take a request (see [`Upstream::call`]).
    pub fn serving(&self) -> impl Fn() -> bool + Send + 'static {
        let (workers, id) = (self.workers.clone(), self.id);
        move || {
            workers.routing(|s| {
                s.entry_mut(id)
                    .is_some_and(|e| matches!(e.health, Health::Serving { .. }))
            })
        }
    }

    /// The worker answered the request (its stream began, or it refused): its count of
    /// unanswered requests starts again.
    pub fn answered(&self) {
        let shared = &self.workers.shared;
        if shared.stalls_counted.load(Ordering::Relaxed) {
            // The judgement of what is routable is made again only when this worker's count
            // changed: while another worker's stalls stay counted (one ejected and still hung),
            // every answer made the next request judge every worker again.
            self.workers.routing(|s| {
                if let Some(e) = s.entry_mut(self.id)
                    && e.stalls.any()
                {
                    e.stalls.answered();
                    s.judged = None;
                }
                let any = s.entries.iter().any(|e| e.stalls.any());
                shared.stalls_counted.store(any, Ordering::Relaxed);
            });
        }
    }

    /// The request reached its deadline, `secs` after it arrived, before the worker answered
    /// it: counted against the worker, which is ejected after a few in a row (see
    /// [`crate::stalls`]).
    pub fn stalled(&self, secs: u64) {
        let shared = &self.workers.shared;
        self.workers.with(|s| {
            let e = s.entry_mut(self.id)?;
            shared.stalls_counted.store(true, Ordering::Relaxed);
            let ejection = e.stalls.stalled(Instant::now())?;
            let error = format!(
                "{} requests in a row got no answer within the request deadline ({secs} s)",
                ejection.in_a_row
            );
            tracing::warn!(
                worker = %e.config.name,
                in_a_row = ejection.in_a_row,
                ejected_for_secs = ejection.lasts.as_secs(),
                "a worker left requests unanswered until their deadline; not routed to for a while"
            );
            e.note_error(error);
            Some(())
        });
    }

    /// Marks the worker unreachable (a transport failure): no routing to it until the next
    /// successful Health.
    pub fn failed(&self, error: &str) {
        self.workers.failed(self.id, error);
    }
}

impl Workers {
    /// Entry `id` failed a request with `error`: unreachable until its health check answers.
    fn failed(&self, id: u64, error: &str) {
        self.with(|s| {
            let latest = s.refreshes;
            if let Some(e) = s.entry_mut(id) {
                // Newer than any refresh under way: only one started after it may clear it.
                e.refreshed_by = latest;
                e.health = Health::Unreachable {
                    error: error.to_owned(),
                };
                e.note_error(error.to_owned());
            }
        });
    }

    /// Lazily connected clients for `configs`, reaching them as `cluster` says (its token on
    /// every call, over its TLS); nothing is contacted until [`Workers::refresh`].
    pub fn new(configs: &[WorkerConfig], cluster: ClusterAccess) -> Result<Workers, EndpointError> {
        let mut state = State {
            cluster,
            ..State::default()
        };
        for c in configs {
            state.push(c.clone())?;
        }
        Ok(Workers {
            shared: Arc::new(Shared {
                state: Mutex::new(state),
                stalls_counted: AtomicBool::new(false),
            }),
        })
    }

    /// Makes `members` the workers of group `group`: members that left are dropped (their
    /// routes end their claims on nothing), new ones are added unknown until the next refresh,
    /// and those that stay keep what they reported. A member whose endpoint is not valid is
    /// skipped and logged.
    pub fn set_members(&self, group: &str, members: Vec<WorkerConfig>) {
        self.with(|s| {
            let in_group = |c: &WorkerConfig| c.group.as_deref() == Some(group);
            s.entries
                .retain(|e| !in_group(&e.config) || members.contains(&e.config));
            for m in members {
                if !in_group(&m) || s.entries.iter().any(|e| e.config == m) {
                    continue;
                }
                tracing::info!(worker = %m.name, "discovered a worker");
                if let Err(error) = s.push(m) {
                    tracing::warn!(%error, "skipping a discovered worker");
                }
            }
        });
    }

    /// Records how `group`'s lookup of `dns` went: answered (its members set now), or why not,
    /// its last members kept.
    pub fn looked_up(&self, group: &str, dns: &str, outcome: Result<(), String>) {
        let now = unix_secs_now();
        self.routing(|s| {
            let members = s
                .entries
                .iter()
                .filter(|e| e.config.group.as_deref() == Some(group))
                .count();
            let failing_since = s.lookups.get(group).and_then(|l| l.failing_since_unix_secs);
            let lookup = match outcome {
                Ok(()) => GroupLookup {
                    dns: dns.to_owned(),
                    members,
                    last_lookup_unix_secs: now,
                    error: None,
                    failing_since_unix_secs: None,
                },
                Err(error) => GroupLookup {
                    dns: dns.to_owned(),
                    members,
                    last_lookup_unix_secs: now,
                    error: Some(error),
                    failing_since_unix_secs: Some(failing_since.unwrap_or(now)),
                },
            };
            s.lookups.insert(group.to_owned(), lookup);
        });
    }

    /// Every worker group's last lookup, by name (what `/workers` shows beside the workers).
    pub fn lookups(&self) -> std::collections::BTreeMap<String, GroupLookup> {
        self.routing(|s| s.lookups.clone())
    }

    /// Every worker's name, in order (listed workers first, then groups' members as found).
    pub fn names(&self) -> Vec<String> {
        self.routing(|s| s.entries.iter().map(|e| e.config.name.clone()).collect())
    }

    /// `f` on the state, which it may change in any way: what is routable is judged again.
    fn with<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        self.routing(|s| {
            s.judged = None;
            f(s)
        })
    }

    /// `f` on the state, which it may read, and change only in what the judgement of what is
    /// routable does not read (tokens outstanding): a request's path, and every reader.
    fn routing<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        f(&mut self
            .shared
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner))
    }

    /// The served model, once a worker has registered.
    pub fn model(&self) -> Option<Arc<ServedModel>> {
        self.routing(|s| s.model.clone())
    }

    /// The effective limit for a tenant allowed `tenant_max`, over every routable worker.
    pub fn effective_limit(&self, tenant_max: NonZeroU32) -> Option<EffectiveLimit> {
        self.routing(|s| {
            s.judge();
            let capacities: Vec<WorkerCapacity> =
                s.routable().filter_map(|(_, e)| s.capacity(e)).collect();
            effective_limit(capacities, tenant_max)
        })
    }

    /// The routable worker with the fewest outstanding tokens; its count grows by the
    /// request's prompt + max tokens until the route drops. None while the served model is
    /// not `model_id`, the one the request was tokenized for: its token ids mean nothing to
    /// another model's workers (the model changes when none serves the old one any more).
    pub fn route(&self, admitted: &Admitted, model_id: &str) -> Option<Route> {
        let tokens = admitted.total_tokens();
        self.routing(|s| {
            if s.served_id() != Some(model_id) {
                return None;
            }
            s.judge();
            // Only a worker whose every pool holds the request: one that became routable since
            // the request was admitted may be smaller than the limit it was admitted against.
            let fits = |e: &Entry| {
                s.capacity(e)
                    .is_some_and(|c| c.served_context.min(c.pool_tokens) >= tokens)
                    || !bulkhead_checks::enabled(Check::GatewayLimit)
            };
            let candidates = s.routable().filter(|(_, e)| fits(e));
            let index = least_outstanding(candidates.map(|(index, e)| Candidate {
                index,
                outstanding_tokens: e.outstanding,
            }))?;
            self.route_to(s, index, tokens)
        })
    }

    /// A route to entry `index` of `s`, whose outstanding tokens grow by `tokens`.
    fn route_to(&self, s: &mut State, index: usize, tokens: u64) -> Option<Route> {
        let e = s.entries.get_mut(index)?;
        e.outstanding += tokens;
        Some(Route {
            worker: e.config.name.clone(),
            prefill: e.config.prefill.clone(),
            client: e.client.clone(),
            instance_id: e
                .info
                .as_ref()
                .map(|i| i.instance_id.clone())
                .unwrap_or_default(),
            workers: self.clone(),
            id: e.id,
            claim: Some(Claim {
                workers: self.clone(),
                id: e.id,
                tokens,
            }),
        })
    }

    /// How the gateway reaches its Bulkhead workers: whether it presents a cluster token, and
    /// whether its calls go over mutual TLS.
    pub fn access(&self) -> Access {
        self.routing(|s| Access {
            cluster_token: s.cluster.token.is_some(),
            mutual_tls: s.cluster.tls.is_some(),
        })
    }

    /// What each worker reported, in configuration order.
    pub fn reports(&self) -> Vec<WorkerReport> {
        self.routing(|s| {
            s.entries
                .iter()
                .map(|e| {
                    let unroutable = s.unroutable(e);
                    WorkerReport {
                        name: e.config.name.clone(),
                        group: e.config.group.clone(),
                        endpoint: dialled(&e.config, &s.cluster),
                        role: e.config.role.name(),
                        info: e.facts.clone(),
                        health: e.health.clone(),
                        routable: s.model.is_some() && unroutable.is_none(),
                        unroutable_reason: unroutable.as_ref().map(ToString::to_string),
                        unroutable,
                        outstanding_tokens: e.outstanding,
                        last_error: e.last_error.as_ref().map(|(error, _)| error.clone()),
                        last_error_unix_secs: e.last_error.as_ref().and_then(|(_, at)| {
                            at.duration_since(UNIX_EPOCH).ok().map(|d| d.as_secs())
                        }),
                    }
                })
                .collect()
        })
    }

    /// Reads every worker's Health and Info (concurrently, each bounded), and (re)builds the
    /// served model when there is none yet or no healthy worker serves it any more. Each answer
    /// is taken as it comes: one worker that does not answer (three calls of up to
    /// [`RPC_TIMEOUT`] each) delays nobody else's change of health. The served model is settled
    /// once every answer is in, from what they all said (settled at each, it could be taken
    /// from a worker not heard yet, as the last refresh left it, and the registration's wait
    /// held every answer after it).
    pub async fn refresh(&self) {
        let (refresh, mut answers): (u64, FuturesUnordered<_>) = self.with(|s| {
            s.refreshes += 1;
            let probes = s
                .entries
                .iter()
                .map(|e| (e.id, e.client.clone(), e.describe(), e.bare.clone()))
                .map(|(i, client, describe, bare)| async move {
                    (i, probe(client, describe, bare).await)
                })
                .collect();
            (s.refreshes, probes)
        });
        while let Some((i, answer)) = answers.next().await {
            self.with(|s| s.apply(refresh, i, answer));
        }
        let wanted = self.with(|s| {
            // A later refresh settled the served model already (kept it, or registered
            // another): this one saw less.
            if s.model_by > refresh {
                return None;
            }
            let wanted = s.model_to_register();
            if wanted.is_none() {
                s.model_by = refresh;
            }
            wanted
        });
        if let Some((id, source)) = wanted {
            self.register_model(id, source, refresh).await;
        }
        // Once the served model is settled: a change of model is not a reason to log.
        self.with(State::log_routability);
    }

    /// Registers the model worker `id` serves, as refresh number `refresh` chose it.
    async fn register_model(&self, id: u64, source: ModelSource, refresh: u64) {
        let info = match source {
            ModelSource::File(info, data) => Ok((info, Some(data))),
            ModelSource::Grpc(client) => {
                let mut client = client.max_decoding_message_size(MAX_TOKENIZER_INFO_BYTES);
                let call = client.info(InfoRequest {
                    include_tokenizer: true,
                });
                match tokio::time::timeout(TOKENIZER_TIMEOUT, call).await {
                    Err(_) => Err("the Info call with the tokenizer timed out".to_owned()),
                    Ok(Err(status)) => Err(format!("Info failed: {}", status.message())),
                    Ok(Ok(response)) => {
                        let mut info = response.into_inner();
                        let data = info.tokenizer.take().map(Arc::new);
                        Ok((Arc::new(info), data))
                    }
                }
            }
        };
        let built = match info {
            Err(e) => Err(e),
            // Building a 50k-token BPE takes a moment: off the async threads.
            Ok((info, data)) => tokio::task::spawn_blocking(move || match data {
                Some(data) => ServedModel::from_info(&info, &data),
                None => Err("the worker's Info has no tokenizer".to_owned()),
            })
            .await
            .unwrap_or_else(|e| Err(format!("building the tokenizer panicked: {e}"))),
        };
        self.with(|s| match built {
            // A later refresh settled it since (kept the model, or registered another): stale.
            Ok(_) if s.model_by > refresh => {}
            Ok(model) => {
                tracing::info!(model = %model.name, id = %model.id, "registered the served model");
                s.model = Some(Arc::new(model));
                s.model_by = refresh;
            }
            Err(error) => {
                tracing::warn!(%error, "cannot register the worker's model");
                if let Some(e) = s.entry_mut(id) {
                    e.model_refused = true;
                    e.note_error(error);
                }
            }
        });
    }

    /// Refreshes every `interval` until the returned handle is aborted.
    pub fn spawn_refresh(&self, interval: Duration) -> tokio::task::JoinHandle<()> {
        let workers = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                workers.refresh().await;
            }
        })
    }
}

/// Where the served model's tokenizer comes from.
enum ModelSource {
    /// A Bulkhead worker's Info, asked again with the tokenizer.
    Grpc(cluster_token::Client),
    /// An OpenAI upstream's configured GGUF, already read.
    File(Arc<proto::InfoResponse>, Arc<TokenizerData>),
}

/// An OpenAI upstream's GGUF to read once, and the context the upstream serves.
type Describe = (std::path::PathBuf, u64);

/// What one probe learned.
struct Probe {
    health: Result<Health, String>,
    /// Info (and, read from a GGUF, its tokenizer); `None` when not asked this time.
    info: Option<Result<Described, String>>,
    /// It answered a call presenting no cluster token.
    open: bool,
}

/// An Info, and the tokenizer when it was read from a GGUF.
type Described = (Arc<proto::InfoResponse>, Option<Arc<TokenizerData>>);

/// Health and Info of one upstream: a worker's Health and Info RPCs (and, with `bare`, whether
/// it answers Health without the cluster token), or an OpenAI server's model list and (once)
/// the Info its configured GGUF gives.
async fn probe(
    client: Upstream,
    describe: Option<Describe>,
    bare: Option<cluster_token::Client>,
) -> Probe {
    match client {
        Upstream::Grpc(mut client) => {
            let health = rpc(client.health(HealthRequest {})).await;
            let open = match (&health, bare) {
                (Ok(_), Some(mut bare)) => rpc(bare.health(HealthRequest {})).await.is_ok(),
                _ => false,
            };
            let info = match &health {
                Ok(_) => Some(
                    rpc(client.info(InfoRequest {
                        include_tokenizer: false,
                    }))
                    .await
                    .map(|info| (Arc::new(info), None)),
                ),
                Err(_) => None,
            };
            Probe {
                health: health.map(|h| health_of(&h)),
                info,
                open,
            }
        }
        Upstream::OpenAi(client) => {
            let health = client.health().await.map(|()| Health::Serving {
                pool_pages_total: 0,
                pool_pages_free: 0,
                pool_pages_cached: 0,
                pool_pages_quarantined: 0,
                queue_depth: 0,
                running: 0,
            });
            let info = match (&health, describe) {
                (Ok(_), Some((path, context))) => Some(
                    tokio::task::spawn_blocking(move || {
                        let (mut info, data) = describe_file(&path)?;
                        // The upstream's pool is its own: it is admitted against what it
                        // serves, as configured.
                        info.context_length = context;
                        info.model_context_length = context;
                        info.pool_tokens = context;
                        Ok((Arc::new(info), Some(Arc::new(data))))
                    })
                    .await
                    .unwrap_or_else(|e| Err(format!("reading the tokenizer panicked: {e}"))),
                ),
                _ => None,
            };
            // The token is between Bulkhead's own processes: not asked of another server.
            Probe {
                health,
                info,
                open: false,
            }
        }
    }
}

/// The address of worker `c` as the gateway dials it: a Bulkhead worker's over the cluster's
/// TLS, when it has one, whatever scheme its configuration wrote.
fn dialled(c: &WorkerConfig, cluster: &ClusterAccess) -> String {
    match (&c.protocol, &cluster.tls) {
        (Protocol::Bulkhead, Some(_)) => match c.endpoint.strip_prefix("http://") {
            Some(authority) => format!("https://{authority}"),
            None => c.endpoint.clone(),
        },
        _ => c.endpoint.clone(),
    }
}

/// The client for a configured worker (presenting the cluster token, when it is a Bulkhead
/// worker, over the cluster's TLS) and, with a token, one presenting none over the same
/// connection; nothing is contacted yet.
fn client(
    c: &WorkerConfig,
    cluster: &ClusterAccess,
) -> Result<(Upstream, Option<cluster_token::Client>), EndpointError> {
    let invalid = |reason: String| EndpointError {
        name: c.name.clone(),
        reason,
    };
    match &c.protocol {
        Protocol::Bulkhead => {
            let endpoint = tls::endpoint(&c.endpoint, cluster.tls.as_ref())
                .map_err(|e| invalid(e.to_string()))?
                .connect_timeout(CONNECT_TIMEOUT);
            let channel = endpoint.connect_lazy();
            let token = cluster.token.clone();
            let bare = token
                .is_some()
                .then(|| cluster_token::client(channel.clone(), None));
            Ok((
                Upstream::Grpc(cluster_token::shared_client(channel, token)),
                bare,
            ))
        }
        Protocol::OpenAi(o) => {
            let client = OpenAiClient::configured(&c.endpoint, o).map_err(invalid)?;
            Ok((Upstream::OpenAi(Arc::new(client)), None))
        }
    }
}

/// A bounded unary call; transport failures and timeouts become text.
async fn rpc<T>(
    call: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T, String> {
    match tokio::time::timeout(RPC_TIMEOUT, call).await {
        Err(_) => Err(format!("no answer within {} s", RPC_TIMEOUT.as_secs())),
        // With its causes: a transport error's is the reason ("received fatal alert:
        // UnknownCA", a refused connection), its message alone only "transport error".
        Ok(Err(status)) => Err(bulkhead_worker::error_chain::with_causes(
            format!("{:?}: {}", status.code(), status.message()),
            std::error::Error::source(&status),
        )),
        Ok(Ok(r)) => Ok(r.into_inner()),
    }
}

fn health_of(h: &proto::HealthResponse) -> Health {
    match ServingStatus::try_from(h.status) {
        Ok(ServingStatus::Serving) => {
            let pool = h.pool.unwrap_or_default();
            Health::Serving {
                pool_pages_total: pool.total,
                pool_pages_free: pool.free,
                pool_pages_cached: pool.cached,
                pool_pages_quarantined: pool.quarantined,
                queue_depth: h.queue_depth,
                running: h.running,
            }
        }
        Ok(ServingStatus::NotServing | ServingStatus::Unspecified) | Err(_) => Health::NotServing,
    }
}

fn facts_of(info: &proto::InfoResponse) -> Facts {
    Facts {
        model_id: info.model_id.clone(),
        model_name: info.model_name.clone(),
        served_context: info.context_length,
        model_context: info.model_context_length,
        pool_tokens: info.pool_tokens,
        pool_pages: info.pool_pages,
        page_tokens: info.page_tokens,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(served_context: u64, pool_tokens: u64) -> Facts {
        Facts {
            model_id: "m-1".into(),
            model_name: "M".into(),
            served_context,
            model_context: 8192,
            pool_tokens,
            pool_pages: 1,
            page_tokens: 16,
        }
    }

    fn serving() -> Health {
        Health::Serving {
            pool_pages_total: 10,
            pool_pages_free: 10,
            pool_pages_cached: 0,
            pool_pages_quarantined: 0,
            queue_depth: 0,
            running: 0,
        }
    }

    /// Workers `(name, role, prefill)` with a served model (the tiny model's tokenizer), none
    /// of them asked anything yet, configured where nothing listens.
    fn workers(list: &[(&str, WorkerRole, Option<&str>)]) -> Workers {
        let at: Vec<_> = list
            .iter()
            .map(|&(name, role, prefill)| (name, role, prefill, "http://127.0.0.1:9"))
            .collect();
        workers_at(&at)
    }

    /// Workers `(name, role, prefill, endpoint)`, as [`workers`].
    fn workers_at(list: &[(&str, WorkerRole, Option<&str>, &str)]) -> Workers {
        let configs: Vec<WorkerConfig> = list
            .iter()
            .map(|&(name, role, prefill, endpoint)| WorkerConfig {
                name: name.into(),
                endpoint: endpoint.into(),
                role,
                prefill: prefill.map(Into::into),
                protocol: Protocol::Bulkhead,
                group: None,
            })
            .collect();
        let workers = Workers::new(&configs, ClusterAccess::default()).expect("workers");
        let ModelSource::File(info, data) = tiny() else {
            unreachable!("a file")
        };
        let model = ServedModel::from_info(&info, &data).expect("a served model");
        workers.with(|s| s.model = Some(Arc::new(model)));
        workers
    }

    /// The gateway tokenizes a raw prompt as the worker does: after the BOS token when the
    /// model's file asks for one (its Info's tokenizer says so).
    #[test]
    fn a_prompt_starts_with_bos_when_the_workers_tokenizer_says_so() {
        let ModelSource::File(info, mut data) = tiny() else {
            unreachable!("a file")
        };
        let bos = info.bos_token_id.expect("the tiny model has a BOS");
        let plain = ServedModel::from_info(&info, &data).expect("a served model");
        let text = plain.tokenizer.encode_prompt("ab").expect("encodes");
        assert_ne!(text.first(), Some(&bos));
        Arc::make_mut(&mut data).add_bos = true;
        let with = ServedModel::from_info(&info, &data).expect("a served model");
        assert_eq!(
            with.tokenizer.encode_prompt("ab").expect("encodes"),
            [&[bos][..], &text].concat()
        );
    }

    /// The tiny test model, as an OpenAI upstream's GGUF describes it.
    fn tiny() -> ModelSource {
        let dir = crate::scratch::Scratch::new("workers");
        let path = dir.0.join("tiny.gguf");
        bulkhead_worker::tiny_model::TinySpec::default()
            .write(&path)
            .expect("writes the tiny model");
        let (info, data) =
            bulkhead_worker::serve::info::describe_file(&path).expect("describes it");
        ModelSource::File(Arc::new(info), Arc::new(data))
    }

    /// The instance id of worker `name`'s process in these tests.
    fn instance(name: &str) -> String {
        format!("{name}-instance")
    }

    /// What worker `name` says: its role, pool and served context, the model the gateway
    /// serves, every check on; a decode worker, that the prefill worker named as its group
    /// answers where it dials.
    fn reports(workers: &Workers, name: &str, role: WorkerRole, pool: u64, context: u64) {
        workers.with(|s| {
            let model_id = s.served_id().expect("a served model").to_owned();
            let e = s
                .entries
                .iter_mut()
                .find(|e| e.config.name == name)
                .expect("a worker of that name");
            let prefill_peer = e.config.prefill.as_deref().map(|p| proto::PrefillPeer {
                address: format!("http://{p}:50051"),
                instance_id: instance(p),
                last_error: String::new(),
            });
            let info = proto::InfoResponse {
                instance_id: instance(name),
                prefill_peer,
                model_id,
                role: match role {
                    WorkerRole::Both => proto::Role::Both,
                    WorkerRole::Prefill => proto::Role::Prefill,
                    WorkerRole::Decode => proto::Role::Decode,
                }
                .into(),
                pool_tokens: pool,
                pool_pages: u32::try_from(pool / 16).expect("a small pool"),
                page_tokens: 16,
                context_length: context,
                model_context_length: context,
                handoff: Some(proto::KvHandoff {
                    tag_check: true,
                    checksums: true,
                    deferred_release: true,
                    transfer_floor_bytes_per_s: 100_000_000,
                    release_timeout_ms: 10_000,
                    ..proto::KvHandoff::default()
                }),
                ..proto::InfoResponse::default()
            };
            e.facts = Some(facts_of(&info));
            e.info = Some(Arc::new(info));
            e.health = serving();
        });
    }

    /// A route for a request of `total` tokens, tokenized for the served model.
    fn to(w: &Workers, total: u32) -> Option<Route> {
        let id = w.model().map(|m| m.id.clone()).unwrap_or_default();
        w.route(&admitted(total), &id)
    }

    fn admitted(total: u32) -> Admitted {
        let max = std::num::NonZeroU32::new(total - 10);
        let limit = crate::admission::EffectiveLimit {
            tokens: u64::from(total),
        };
        crate::admission::admit(10, max, std::num::NonZeroU32::MIN, limit).expect("fits")
    }

    /// A request admitted against the larger worker's limit is never routed to a smaller one
    /// that became routable since (or that has fewer tokens outstanding).
    #[tokio::test]
    async fn a_request_goes_only_to_a_worker_whose_pools_hold_it() {
        let w = workers(&[
            ("big", WorkerRole::Both, None),
            ("small", WorkerRole::Both, None),
        ]);
        reports(&w, "big", WorkerRole::Both, 8192, 8192);
        reports(&w, "small", WorkerRole::Both, 4096, 4096);
        let held = to(&w, 1000).expect("a route");
        assert_eq!(held.worker, "big", "a tie goes to the first");
        // "small" has the fewest tokens outstanding, but cannot hold it.
        let route = to(&w, 6000).expect("a route");
        assert_eq!(route.worker, "big", "the only one it fits");
        let route = to(&w, 3000).expect("a route");
        assert_eq!(route.worker, "small", "the least loaded that fits");
        // Nothing routable holds more than 8192.
        assert!(to(&w, 9000).is_none());
    }

    /// A decode worker is not routed to while a prefill worker that may fill its pages serves
    /// without having said what its pool holds: its pool and the pair checks are unknown.
    #[tokio::test]
    async fn a_serving_prefill_worker_whose_info_is_unread_keeps_its_decode_worker_unroutable() {
        let w = workers(&[
            ("d", WorkerRole::Decode, Some("p")),
            ("p", WorkerRole::Prefill, None),
            ("p2", WorkerRole::Prefill, None),
        ]);
        w.with(|s| {
            for e in &mut s.entries {
                e.config.group = Some("p".into());
            }
            s.entries[0].config.group = None;
        });
        reports(&w, "d", WorkerRole::Decode, 8192, 8192);
        reports(&w, "p", WorkerRole::Prefill, 8192, 8192);
        assert!(to(&w, 100).is_some(), "p2 does not serve yet");
        w.with(|s| s.entries[2].health = serving());
        let why = w.with(|s| s.unroutable(&s.entries[0]));
        assert!(
            matches!(&why, Some(Unroutable::PrefillUnusable { why, .. }) if why.contains("p2")),
            "{why:?}"
        );
        reports(&w, "p2", WorkerRole::Prefill, 2048, 2048);
        assert!(to(&w, 4000).is_none(), "p2's pool bounds it now");
        let route = to(&w, 2000).expect("routed");
        assert_eq!(
            route.instance_id,
            instance("d"),
            "a request names the process its route was judged by"
        );
    }

    /// A decode worker whose prefill group has a member set up without the integrity checks
    /// is not routed to, however usable the others are: the Service may send its transfer to
    /// that member. One merely not serving is the Service's to route around.
    #[tokio::test]
    async fn a_prefill_member_without_its_integrity_checks_keeps_its_decode_worker_unroutable() {
        let w = workers(&[
            ("d", WorkerRole::Decode, Some("p")),
            ("p", WorkerRole::Prefill, None),
            ("p2", WorkerRole::Prefill, None),
        ]);
        w.with(|s| {
            for e in &mut s.entries[1..] {
                e.config.group = Some("p".into());
            }
        });
        for (name, role) in [
            ("d", WorkerRole::Decode),
            ("p", WorkerRole::Prefill),
            ("p2", WorkerRole::Prefill),
        ] {
            reports(&w, name, role, 8192, 8192);
        }
        assert!(to(&w, 100).is_some());
        w.with(|s| s.entries[2].health = Health::NotServing);
        assert!(to(&w, 100).is_some(), "p serves; p2 is routed around");
        w.with(|s| {
            s.entries[2].health = serving();
            let info = Arc::make_mut(s.entries[2].info.as_mut().expect("p2's Info"));
            info.handoff.as_mut().expect("handoff").checksums = false;
        });
        let why = w.with(|s| s.unroutable(&s.entries[0]));
        assert!(
            matches!(&why, Some(Unroutable::PrefillUnusable { why, .. }) if why.starts_with("p2: ")),
            "{why:?}"
        );
        assert!(to(&w, 100).is_none());
    }

    /// A group's name listing one pod at two addresses (IPv4 and IPv6) makes two members of
    /// one process: only the first that may be routed to is, so the process is counted and
    /// loaded once; the other takes over when the first cannot be reached.
    #[tokio::test]
    async fn one_process_at_two_addresses_is_routed_to_as_one() {
        let w = workers(&[
            ("both@10.0.0.1:50051", WorkerRole::Both, None),
            ("both@[fd00::1]:50051", WorkerRole::Both, None),
            ("other", WorkerRole::Both, None),
        ]);
        for name in ["both@10.0.0.1:50051", "both@[fd00::1]:50051", "other"] {
            reports(&w, name, WorkerRole::Both, 8192, 8192);
        }
        let same = instance("both@10.0.0.1:50051");
        w.with(|s| Arc::make_mut(s.entries[1].info.as_mut().expect("Info")).instance_id = same);
        let why = w.with(|s| s.unroutable(&s.entries[1]));
        assert!(
            matches!(&why, Some(Unroutable::SameProcess { worker }) if worker == "both@10.0.0.1:50051"),
            "{why:?}"
        );
        // Held, so each goes to the least loaded: the two processes, never the second address.
        let routes: Vec<Route> = (0..4).map(|_| to(&w, 100).expect("a route")).collect();
        let names: Vec<&str> = routes.iter().map(|r| r.worker.as_str()).collect();
        assert!(names.contains(&"other"), "{names:?}");
        assert!(!names.iter().any(|r| r.contains("fd00")), "{names:?}");
        // Requests stall at the first address: the process is hung, at every address.
        w.with(|s| {
            let now = Instant::now();
            for _ in 0..3 {
                s.entries[0].stalls.stalled(now);
            }
        });
        let why = w.with(|s| s.unroutable(&s.entries[1]));
        assert!(matches!(why, Some(Unroutable::Stalled { .. })), "{why:?}");
        w.with(|s| s.entries[0].stalls = Stalls::default());
        // The IPv4 address stops answering: the same process is reached at its IPv6 one.
        w.with(|s| {
            s.entries[0].health = Health::Unreachable {
                error: "network unreachable".into(),
            };
            s.judged = None;
        });
        assert_eq!(w.with(|s| s.unroutable(&s.entries[1])), None);
    }

    /// Which process answers where decode `d` dials its prefill worker (`p`'s, at first).
    fn dials(w: &Workers, instance_id: &str) {
        w.with(|s| {
            let d = s.entries[0].info.as_mut().expect("d's Info");
            let peer = Arc::make_mut(d).prefill_peer.as_mut().expect("d's peer");
            instance_id.clone_into(&mut peer.instance_id);
        });
    }

    /// A decode worker filled by a prefill process the gateway does not know of (started with
    /// another `--prefill` than the gateway's configuration says, or not having reached it
    /// yet) is not routed to: the gateway would admit its requests against a pool and check
    /// a pair they do not occupy. It is again once the process it reaches is a known one.
    #[tokio::test]
    async fn a_decode_worker_filled_by_a_prefill_worker_the_gateway_does_not_know_gets_nothing() {
        let w = workers(&[
            ("d", WorkerRole::Decode, Some("p")),
            ("p", WorkerRole::Prefill, None),
        ]);
        reports(&w, "d", WorkerRole::Decode, 8192, 8192);
        reports(&w, "p", WorkerRole::Prefill, 8192, 8192);
        assert!(to(&w, 100).is_some(), "d dials p");
        let fails = |w: &Workers| {
            let why = w.with(|s| s.unroutable(&s.entries[0]));
            assert!(to(w, 100).is_none(), "{why:?}");
            match why {
                Some(Unroutable::PreflightFails {
                    check: "dials a configured prefill worker",
                    detail,
                }) => detail,
                other => panic!("{other:?}"),
            }
        };
        dials(&w, "stranger");
        let detail = fails(&w);
        assert!(detail.contains("instance stranger"), "{detail}");
        // Not reached yet, nothing failed: a state of its start, not routed to, not logged.
        dials(&w, "");
        assert_eq!(
            w.with(|s| s.unroutable(&s.entries[0])),
            Some(Unroutable::PrefillNotReachedYet)
        );
        assert!(to(&w, 100).is_none());
        // Its probe failed: the check says why.
        w.with(|s| {
            let d = s.entries[0].info.as_mut().expect("d's Info");
            let peer = Arc::make_mut(d).prefill_peer.as_mut().expect("d's peer");
            "refused".clone_into(&mut peer.last_error);
        });
        let detail = fails(&w);
        assert!(
            detail.contains("has not reached") && detail.ends_with(": refused"),
            "{detail}"
        );
        // p restarted: a new process, which d reaches too.
        w.with(|s| {
            Arc::make_mut(s.entries[1].info.as_mut().expect("p's Info")).instance_id =
                "p-again".into()
        });
        dials(&w, "p-again");
        assert!(to(&w, 100).is_some());
    }

    /// A worker that runs another role than configured (a decode worker configured as
    /// `both`: its prefill worker's pool would be left out of the limit) is not routed to.
    #[tokio::test]
    async fn a_worker_running_another_role_than_configured_is_not_routed_to() {
        let w = workers(&[("w", WorkerRole::Both, None)]);
        reports(&w, "w", WorkerRole::Decode, 8192, 8192);
        let why = w.with(|s| s.unroutable(&s.entries[0]));
        assert!(
            matches!(
                why,
                Some(Unroutable::FailsCheck {
                    check: "runs the configured role",
                    ..
                })
            ),
            "{why:?}"
        );
        reports(&w, "w", WorkerRole::Both, 8192, 8192);
        assert!(to(&w, 100).is_some());
    }

    /// Quarantined pages that leave less than the served context in service keep a worker
    /// out of routing until they come back.
    #[test]
    fn a_worker_whose_quarantine_leaves_less_than_its_context_is_not_routed_to() {
        let quarantined = |pages| Health::Serving {
            pool_pages_total: 256,
            pool_pages_free: 0,
            pool_pages_cached: 0,
            pool_pages_quarantined: pages,
            queue_depth: 0,
            running: 0,
        };
        let f = facts(4000, 4096);
        assert_eq!(unroutable(Some(&f), &quarantined(6), Some("m-1")), None);
        assert_eq!(
            unroutable(Some(&f), &quarantined(7), Some("m-1")),
            Some(Unroutable::Quarantined {
                in_service: 249 * 16,
                served_context: 4000
            })
        );
    }

    #[test]
    fn health_shows_the_pages_the_prefix_cache_holds_apart_from_the_free_ones() {
        let answer = proto::HealthResponse {
            status: ServingStatus::Serving as i32,
            pool: Some(proto::PoolPages {
                total: 10,
                free: 4,
                cached: 3,
                owned: 3,
                ..proto::PoolPages::default()
            }),
            queue_depth: 1,
            running: 2,
        };
        assert_eq!(
            health_of(&answer),
            Health::Serving {
                pool_pages_total: 10,
                pool_pages_free: 4,
                pool_pages_cached: 3,
                pool_pages_quarantined: 0,
                queue_depth: 1,
                running: 2,
            }
        );
    }

    /// A held request keeps its tokens on its worker after its route is gone, until the
    /// claim it took drops; a route whose claim was not taken ends it with itself.
    #[tokio::test]
    async fn a_taken_claim_keeps_the_tokens_outstanding_after_the_route_drops() {
        let config = WorkerConfig {
            name: "w".into(),
            endpoint: "http://127.0.0.1:9".into(),
            role: WorkerRole::Both,
            prefill: None,
            protocol: Protocol::Bulkhead,
            group: None,
        };
        let workers = Workers::new(&[config], ClusterAccess::default()).expect("workers");
        let outstanding = || workers.with(|s| s.entries[0].outstanding);
        let mut route = workers
            .with(|s| workers.route_to(s, 0, 100))
            .expect("a route");
        assert_eq!(outstanding(), 100);
        let claim = route.take_claim();
        drop(route);
        assert_eq!(outstanding(), 100, "the claim holds them");
        drop(claim);
        assert_eq!(outstanding(), 0);
        let route = workers.with(|s| workers.route_to(s, 0, 50));
        drop(route);
        assert_eq!(outstanding(), 0, "an untaken claim ends with its route");
    }

    /// What is routable is judged once per change, not at every request: a worker whose call
    /// failed gets none of the next requests, and gets them again once it answers.
    #[tokio::test]
    async fn a_worker_whose_call_failed_gets_no_next_request_until_it_answers_again() {
        let w = workers(&[("a", WorkerRole::Both, None), ("b", WorkerRole::Both, None)]);
        reports(&w, "a", WorkerRole::Both, 8192, 8192);
        reports(&w, "b", WorkerRole::Both, 8192, 8192);
        let first = to(&w, 100).expect("a route");
        assert_eq!(first.worker, "a", "a tie goes to the first");
        first.failed("connection reset");
        drop(first);
        for _ in 0..3 {
            assert_eq!(to(&w, 100).expect("a route").worker, "b");
        }
        reports(&w, "a", WorkerRole::Both, 8192, 8192);
        assert_eq!(to(&w, 100).expect("a route").worker, "a");
    }

    /// Reading the workers (the served model, at every request) keeps the judgement of what
    /// is routable; an ejection's end, which no change marks, is judged when it comes. A
    /// request is routed only for the model it was tokenized for.
    #[tokio::test]
    async fn the_judgement_outlives_reads_and_ends_with_the_first_ejection() {
        let w = workers(&[("a", WorkerRole::Both, None), ("b", WorkerRole::Both, None)]);
        reports(&w, "a", WorkerRole::Both, 8192, 8192);
        reports(&w, "b", WorkerRole::Both, 8192, 8192);
        // a is ejected for 300 ms from now: its three stalls counted as if they were older.
        let ejection = w.with(|s| {
            let back = Instant::now() - Duration::from_secs(30) + Duration::from_millis(300);
            for _ in 0..3 {
                s.entries[0].stalls.stalled(back);
            }
            s.entries[0].stalls.ejected(Instant::now())
        });
        assert!(ejection.is_some(), "ejected");
        assert_eq!(to(&w, 100).expect("a route").worker, "b");
        // A request tokenized for a model no longer served goes nowhere.
        assert!(w.route(&admitted(100), "the-model-before").is_none());
        let _ = (w.model(), w.names(), w.reports(), w.access());
        assert!(
            w.routing(|s| s.judged.is_some()),
            "reads keep the judgement"
        );
        std::thread::sleep(Duration::from_millis(350));
        assert_eq!(
            to(&w, 100).expect("a route").worker,
            "a",
            "routed to again once its ejection ended"
        );
    }

    /// Two refreshes overlap (the periodic one and one a DNS change triggered) and the earlier
    /// one's probe answers last: its stale answer is dropped, not taken over the later one's.
    #[tokio::test]
    async fn an_earlier_refresh_answering_last_does_not_overwrite_a_later_one() {
        let w = workers(&[("d", WorkerRole::Both, None)]);
        let serving = || Probe {
            health: Ok(Health::Serving {
                pool_pages_total: 8,
                pool_pages_free: 8,
                pool_pages_cached: 0,
                pool_pages_quarantined: 0,
                queue_depth: 0,
                running: 0,
            }),
            info: None,
            open: false,
        };
        let gone = || Probe {
            health: Err("connection refused".to_owned()),
            info: None,
            open: false,
        };
        w.with(|s| {
            let id = s.entries[0].id;
            s.apply(2, id, serving());
            s.apply(1, id, gone());
            assert!(
                matches!(s.entries[0].health, Health::Serving { .. }),
                "the later refresh's answer stands"
            );
            s.apply(3, id, gone());
            assert!(
                matches!(s.entries[0].health, Health::Unreachable { .. }),
                "a newer one is taken"
            );
            s.model = None;
            s.model_by = 3;
        });
        // So with the served model: an earlier refresh's choice, registered after a later one
        // settled it (kept the model, or registered another), is dropped.
        let id = w.with(|s| s.entries[0].id);
        w.register_model(id, tiny(), 2).await;
        assert!(w.with(|s| s.model.is_none()), "a stale choice");
        w.register_model(id, tiny(), 4).await;
        assert!(w.with(|s| s.model.is_some()), "a newer one");
    }

    /// A worker whose model fails to register (its Info with the tokenizer does not come) is
    /// not asked again while another healthy worker's may serve: the gateway asked the first
    /// healthy worker at every refresh and served nothing, beside a sound one.
    #[tokio::test]
    async fn a_worker_whose_model_fails_to_register_gives_way_to_another() {
        let w = workers(&[("a", WorkerRole::Both, None), ("b", WorkerRole::Both, None)]);
        reports(&w, "a", WorkerRole::Both, 8192, 8192);
        reports(&w, "b", WorkerRole::Both, 8192, 8192);
        assert!(
            w.with(|s| s.model_to_register().is_none()),
            "a worker serves it"
        );
        w.with(|s| s.model = None);
        let chosen = |w: &Workers| {
            w.with(|s| {
                let (id, source) = s.model_to_register().expect("one to register");
                let name = s.entry_mut(id).expect("an entry").config.name.clone();
                (id, source, name)
            })
        };
        let (id, source, name) = chosen(&w);
        assert_eq!(name, "a");
        // Nothing listens where a is configured: its Info fails.
        w.register_model(id, source, 2).await;
        assert!(w.with(|s| s.model.is_none()));
        let (id, _, name) = chosen(&w);
        assert_eq!(name, "b", "the other worker's");
        w.register_model(id, tiny(), 3).await;
        assert!(w.with(|s| s.model.is_some()));
    }

    /// A worker that fails its own checks (here a pool smaller than its context) does not
    /// decide the served model ahead of a sound one: listed first, it registered its model, and
    /// every sound worker of another model stood idle behind it.
    #[tokio::test]
    async fn a_worker_that_fails_its_checks_does_not_decide_the_served_model() {
        let w = workers(&[("a", WorkerRole::Both, None), ("b", WorkerRole::Both, None)]);
        reports(&w, "a", WorkerRole::Both, 4096, 8192);
        reports(&w, "b", WorkerRole::Both, 8192, 8192);
        let name = |w: &Workers| {
            w.with(|s| {
                let (id, _) = s.model_to_register()?;
                Some(s.entry_mut(id).expect("an entry").config.name.clone())
            })
        };
        w.with(|s| s.model = None);
        assert_eq!(name(&w), Some("b".to_owned()), "b alone serves soundly");
    }

    /// Pages quarantined for now (they come back) do not make a worker unsound: the served
    /// model stays. Counted as a lasting fault, a brief quarantine on every worker of the
    /// served model handed the gateway to a worker of another model for good.
    #[tokio::test]
    async fn a_worker_with_pages_quarantined_for_now_keeps_the_served_model() {
        let w = workers(&[("a", WorkerRole::Both, None)]);
        reports(&w, "a", WorkerRole::Both, 8192, 8192);
        w.with(|s| {
            s.entries[0].health = Health::Serving {
                pool_pages_total: 512,
                pool_pages_free: 0,
                pool_pages_cached: 0,
                pool_pages_quarantined: 8,
                queue_depth: 0,
                running: 0,
            };
            assert!(matches!(
                s.unroutable(&s.entries[0]),
                Some(Unroutable::Quarantined { .. })
            ));
            assert!(s.model_to_register().is_none(), "the served model is kept");
        });
    }

    /// A worker that stopped answering is not routed to as soon as its own probe fails, while
    /// another worker's probe still waits for its answer: a refresh took every answer only once
    /// the slowest probe had ended (up to three calls of [`RPC_TIMEOUT`] each).
    #[tokio::test]
    async fn one_slow_probe_delays_no_other_workers_change_of_health() {
        // Accepts connections and never answers them: its probe ends only at its timeouts.
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("binds");
        let address = format!("http://{}", silent.local_addr().expect("an address"));
        let held = tokio::spawn(async move {
            let mut open = Vec::new();
            while let Ok((stream, _)) = silent.accept().await {
                open.push(stream);
            }
        });
        let w = workers_at(&[
            ("silent", WorkerRole::Both, None, &address),
            ("gone", WorkerRole::Both, None, "http://127.0.0.1:9"),
        ]);
        reports(&w, "silent", WorkerRole::Both, 8192, 8192);
        reports(&w, "gone", WorkerRole::Both, 8192, 8192);
        let refreshing = tokio::spawn({
            let w = w.clone();
            async move { w.refresh().await }
        });
        let health = |name: &str| {
            w.with(|s| {
                let e = s.entries.iter().find(|e| e.config.name == name);
                e.map(|e| matches!(e.health, Health::Unreachable { .. }))
            })
        };
        let asked = Instant::now();
        while health("gone") != Some(true) {
            assert!(
                asked.elapsed() < RPC_TIMEOUT / 2,
                "the refused worker's failure waited for the silent one's probe"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(
            !refreshing.is_finished(),
            "the silent worker's probe still waits"
        );
        assert_eq!(health("silent"), Some(false), "not answered yet");
        refreshing.await.expect("the refresh ends");
        assert_eq!(health("silent"), Some(true), "its probe timed out");
        held.abort();
    }

    /// A worker that cannot be reached is logged as not routed to (each change once) with the cause of
    /// its failed call (the transport's reason, not only "transport error").
    #[tokio::test]
    async fn a_worker_left_unroutable_is_logged_with_its_failures_cause() {
        let w = workers(&[
            ("p", WorkerRole::Prefill, None),
            ("d", WorkerRole::Decode, Some("p")),
        ]);
        w.refresh().await;
        let (logged, error) = w.with(|s| {
            let logged: Vec<_> = s.entries.iter().map(|e| e.logged_unroutable).collect();
            let error = s.entries[1]
                .last_error
                .clone()
                .map(|(e, _)| e)
                .unwrap_or_default();
            (logged, error)
        });
        assert!(logged.iter().all(Option::is_some), "{logged:?}");
        assert!(
            error.contains("transport error") && error.to_lowercase().contains("refused"),
            "{error}"
        );
    }

    /// A worker that leaves requests unanswered until their deadline while its health checks
    /// pass is ejected after three in a row, whatever its health says; an answer between them
    /// starts the count again.
    #[tokio::test]
    async fn a_worker_that_leaves_three_requests_in_a_row_unanswered_is_ejected() {
        let w = workers(&[("a", WorkerRole::Both, None), ("b", WorkerRole::Both, None)]);
        reports(&w, "a", WorkerRole::Both, 8192, 8192);
        reports(&w, "b", WorkerRole::Both, 8192, 8192);
        let to_a = || {
            let route = to(&w, 100).expect("a route");
            assert_eq!(route.worker, "a", "a tie goes to the first");
            route
        };
        to_a().stalled(300);
        to_a().stalled(300);
        // An answer clears the two: two more are not enough.
        to_a().answered();
        to_a().stalled(300);
        to_a().stalled(300);
        to_a().stalled(300);
        // Ejected: its health check still passes, and it is still not routed to.
        reports(&w, "a", WorkerRole::Both, 8192, 8192);
        for _ in 0..3 {
            assert_eq!(to(&w, 100).expect("a route").worker, "b");
        }
        let report = w.reports().into_iter().find(|r| r.name == "a").expect("a");
        assert!(
            matches!(
                report.unroutable,
                Some(Unroutable::Stalled {
                    in_a_row: 3,
                    routed_again_in_secs: 1..=30
                })
            ),
            "{report:?}"
        );
        assert!(
            report
                .last_error
                .as_ref()
                .is_some_and(|e| e.contains("3 requests in a row")),
        );
        // When: a recovered worker's last error is history, not its state.
        let now = unix_secs_now();
        assert!(
            report
                .last_error_unix_secs
                .is_some_and(|at| at.abs_diff(now) < 60),
            "{report:?}"
        );
    }

    /// An ejection is the evidence of one process: another that answers Info at the address
    /// (the worker restarted) is routed to at once; the same one that answers again is not.
    #[tokio::test]
    async fn an_ejection_ends_when_another_process_answers_at_the_address() {
        let w = workers(&[("a", WorkerRole::Both, None), ("b", WorkerRole::Both, None)]);
        let answer = |w: &Workers, instance_id: &str| {
            w.with(|s| {
                let (id, info) = (s.entries[0].id, s.entries[0].info.clone().expect("Info"));
                let info = proto::InfoResponse {
                    instance_id: instance_id.to_owned(),
                    ..(*info).clone()
                };
                let refresh = s.entries[0].refreshed_by + 1;
                let probe = Probe {
                    health: Ok(serving()),
                    info: Some(Ok((Arc::new(info), None))),
                    open: false,
                };
                s.apply(refresh, id, probe);
            });
        };
        reports(&w, "a", WorkerRole::Both, 8192, 8192);
        reports(&w, "b", WorkerRole::Both, 8192, 8192);
        answer(&w, &instance("a"));
        for _ in 0..3 {
            let route = to(&w, 100).expect("a route");
            assert_eq!(route.worker, "a", "a tie goes to the first");
            route.stalled(300);
        }
        answer(&w, &instance("a"));
        assert_eq!(to(&w, 100).expect("a route").worker, "b", "still ejected");
        answer(&w, "a-restarted");
        assert_eq!(to(&w, 100).expect("a route").worker, "a", "another process");
    }

    /// While one worker is ejected, another's answers leave the judgement of what is routable
    /// standing: each made the next request judge every worker again, under the lock every
    /// request takes.
    #[tokio::test]
    async fn answers_of_a_worker_with_nothing_counted_keep_the_judgement() {
        let w = workers(&[("a", WorkerRole::Both, None), ("b", WorkerRole::Both, None)]);
        reports(&w, "a", WorkerRole::Both, 8192, 8192);
        reports(&w, "b", WorkerRole::Both, 8192, 8192);
        for _ in 0..3 {
            to(&w, 100).expect("a route").stalled(300);
        }
        let route = to(&w, 100).expect("a route");
        assert_eq!(route.worker, "b", "a is ejected");
        assert!(w.routing(|s| s.judged.is_some()));
        route.answered();
        assert!(w.routing(|s| s.judged.is_some()), "nothing changed");
    }

    #[test]
    fn a_healthy_worker_with_enough_pool_is_routable() {
        assert_eq!(
            unroutable(Some(&facts(4096, 4096)), &serving(), Some("m-1")),
            None
        );
    }

    #[test]
    fn a_pool_smaller_than_the_served_context_is_not_routed_to() {
        assert_eq!(
            unroutable(Some(&facts(8192, 4096)), &serving(), Some("m-1")),
            Some(Unroutable::PoolSmallerThanContext {
                pool_tokens: 4096,
                served_context: 8192
            })
        );
    }

    #[test]
    fn unhealthy_unknown_and_other_model_workers_are_not_routed_to() {
        let f = facts(4096, 4096);
        assert_eq!(unroutable(None, &serving(), None), Some(Unroutable::NoInfo));
        assert_eq!(
            unroutable(Some(&f), &Health::Unknown, None),
            Some(Unroutable::HealthUnknown)
        );
        assert_eq!(
            unroutable(Some(&f), &Health::NotServing, None),
            Some(Unroutable::NotServing)
        );
        assert!(matches!(
            unroutable(Some(&f), &Health::Unreachable { error: "x".into() }, None),
            Some(Unroutable::Unreachable { .. })
        ));
        assert!(matches!(
            unroutable(Some(&f), &serving(), Some("m-2")),
            Some(Unroutable::OtherModel { .. })
        ));
    }

    #[test]
    fn public_names_are_slugs() {
        assert_eq!(
            public_name("SmolLM2 135M Instruct", "id"),
            "smollm2-135m-instruct"
        );
        assert_eq!(public_name("  ", "the-id"), "the-id");
        assert_eq!(public_name("Llama-3.1 8B", "id"), "llama-3.1-8b");
    }
}
