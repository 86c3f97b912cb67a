//! `bulkhead preflight`: the deployment check the incident lacked. It reads every configured
//! worker's Info and checks, before any traffic, that no worker serves a context longer than
//! its pool, that every decode worker is filled by a prefill worker of the group it is
//! configured with (the process it reaches, by instance id: not the address it was given),
//! and that they can hand KV over safely: same model, page size, KV layout and protocol;
//! integrity checks and two-phase release on; and a transfer batch that fits inside the
//! release timeout at the bandwidth floor. The checks are pure functions of what the workers
//! reported ([`checks`]). With `[policies]` configured, the policy set is loaded as the
//! gateway would load it ([`policy_set`]): a set the gateway would refuse fails here first.

use std::error::Error as _;
use std::fmt::Write as _;
use std::time::Duration;

use bulkhead_handoff::codec::FRAME_HEAD;
use bulkhead_worker::printable::printable;
use bulkhead_worker::serve::cluster_token;
use bulkhead_worker::serve::proto::{InfoRequest, InfoResponse, KvHandoff, Role};
use bulkhead_worker::serve::tls;

use crate::config::{ClusterAccess, Config, OpenAiUpstream, Protocol, WorkerConfig, WorkerRole};
use crate::discovery::{Resolve, resolve_group};
use crate::policy::{Policies, PolicySettings};
use crate::upstreams::OpenAiClient;

/// Bound on connecting to and asking each worker.
const ASK_LIMIT: Duration = Duration::from_secs(5);

/// How long a decode worker that has not yet reached its prefill peer is given to (it asks
/// every second).
const PEER_SETTLES: Duration = Duration::from_secs(2);

/// An OpenAI-compatible upstream and what its health probe found (the gateway's own:
/// `GET /v1/models` answers and lists the configured model).
#[derive(Debug, Clone)]
pub struct ServerAnswer {
    /// Its `[[workers]]` name and role.
    pub name: String,
    pub role: WorkerRole,
    pub upstream: OpenAiUpstream,
    pub probe: Result<(), String>,
}

/// Probes every OpenAI-compatible upstream in `config`, concurrently, as the gateway's health
/// check does.
pub async fn probe_servers(config: &Config) -> Vec<ServerAnswer> {
    let probes = config.workers.iter().filter_map(|w| match &w.protocol {
        Protocol::OpenAi(o) => Some(async move {
            let probe = match OpenAiClient::configured(&w.endpoint, o) {
                Ok(client) => client.health().await,
                Err(e) => Err(e),
            };
            ServerAnswer {
                name: w.name.clone(),
                role: w.role,
                upstream: o.clone(),
                probe,
            }
        }),
        Protocol::Bulkhead => None,
    });
    futures_util::future::join_all(probes).await
}

/// The checks of the OpenAI-compatible upstreams: each answers and lists its model, its key
/// (when it needs one) is in the environment; and a warning that its KV pool is not checked.
pub fn server_checks(servers: &[ServerAnswer]) -> Vec<Check> {
    let mut out = Vec::new();
    for s in servers {
        let check = |name, pass, detail: String| Check {
            subject: s.name.clone(),
            name,
            pass,
            detail,
            advisory: false,
            silent: false,
        };
        out.push(match &s.probe {
            Ok(()) => check(
                REACHABLE,
                true,
                format!("GET /v1/models lists {:?}", s.upstream.model),
            ),
            Err(e) => check(REACHABLE, false, e.clone()),
        });
        if let Some(var) = &s.upstream.key_env {
            // As the client reads it: a value that is not UTF-8 is no key.
            let set = std::env::var(var).is_ok();
            out.push(check(
                "has its key",
                set,
                if set {
                    format!("{var} is set")
                } else {
                    format!("key_env names {var}, which is not set: requests go without a key")
                },
            ));
        }
        if !s.upstream.cache_salt {
            out.push(Check {
                advisory: true,
                ..check(
                    "prefix cache kept per tenant",
                    false,
                    "cache_salt = false: the server's prefix cache is shared across tenants (one \
                     tenant's timing can tell what another's prompts begin with) unless the \
                     server has prefix caching off"
                        .to_owned(),
                )
            });
        }
        out.push(Check {
            advisory: true,
            ..check(
                "pool covers the served context",
                false,
                format!(
                    "not checked: an OpenAI-compatible server's KV pool is its own; the gateway \
                     admits against context_length = {}",
                    s.upstream.context_length
                ),
            )
        });
    }
    out
}

/// A configured worker and what it answered.
#[derive(Debug, Clone)]
pub struct Answer {
    pub worker: WorkerConfig,
    pub info: Result<InfoResponse, String>,
    /// Whether the worker answered at all: false when nothing did (no address, no connection,
    /// no answer in time), true for an `Info` answered or refused (a refusal is the worker's
    /// word, not its silence).
    pub answered: bool,
    /// With a cluster token configured: what the worker did with a call that presented none.
    /// `None`: not asked.
    pub open: Option<Bare>,
}

/// What a worker did with a call that presented no cluster token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Bare {
    /// Answered it: it was started without `--cluster-token-file`, so anyone who reaches it
    /// runs requests past the gateway.
    Answered,
    /// Refused it as unauthenticated.
    Refused,
    /// Failed it otherwise (unavailable, reset, timed out): whether it requires the token is
    /// not known.
    Failed(String),
}

/// One check's verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    /// The worker (or `decode ↔ prefill` pair) checked.
    pub subject: String,
    pub name: &'static str,
    pub pass: bool,
    /// The numbers behind the verdict.
    pub detail: String,
    /// A check that warns but fails nothing (preflight still exits 0; routing ignores it).
    pub advisory: bool,
    /// Failed only for want of an answer: a worker nothing answered for, or a peer not
    /// reached yet ([`unreachable_warns`] makes these warnings).
    pub silent: bool,
}

/// Why a worker could not be reached: `what` failed, because of `cause` and its causes, and
/// the likely reason when it was reached but refused: TLS on one side only.
fn unreachable(
    what: String,
    cause: Option<&(dyn std::error::Error + 'static)>,
    cluster: &ClusterAccess,
) -> String {
    use std::io::ErrorKind::{ConnectionRefused, HostUnreachable, NetworkUnreachable, TimedOut};
    let (mut refused, mut silent, mut plain) = (false, false, false);
    for c in std::iter::successors(cause, |&c| c.source()) {
        let kind = c.downcast_ref::<std::io::Error>().map(std::io::Error::kind);
        refused |= kind == Some(ConnectionRefused);
        // Nothing answered at all: no reply can say what listens there.
        silent |= matches!(kind, Some(TimedOut | HostUnreachable | NetworkUnreachable))
            || c.to_string().starts_with("dns error");
        plain |= tls::answered_in_plain_text(c);
    }
    let mut text = bulkhead_worker::error_chain::with_causes(what, cause);
    if refused {
        text.push_str(" (nothing listens there: is the worker running, at this address?)");
    } else if silent {
        text.push_str(" (nothing answered: is the address right, the host up and reachable?)");
    } else if plain {
        text.push_str(
            " (what answered speaks no TLS: a worker started without --tls-cert — start every \
             worker with the deployment's TLS files, or call them without TLS: no [cluster] \
             tls_* and no --tls-* — or another server listens at this address)",
        );
    } else if cluster.tls.is_none() {
        text.push_str(
            " (what answered is not a Bulkhead worker speaking plain gRPC: a worker started \
             with --tls-cert takes only TLS — then set [cluster] tls_ca, tls_cert, tls_key — \
             or another server listens at this address)",
        );
    }
    text
}

/// Asks every Bulkhead worker in `config` for its Info (concurrently, each bounded,
/// presenting `token`): the listed ones and every member its worker groups resolve to now. A
/// group that resolves to no worker is one unreachable answer under the group's name. (The
/// OpenAI-compatible upstreams are [`probe_servers`]'.)
pub async fn ask(config: &Config, cluster: &ClusterAccess, resolver: &impl Resolve) -> Vec<Answer> {
    let mut workers: Vec<WorkerConfig> = config
        .workers
        .iter()
        .filter(|w| w.protocol == Protocol::Bulkhead)
        .cloned()
        .collect();
    let mut lost = Vec::new();
    for group in &config.worker_groups {
        match resolve_group(group, resolver).await {
            Ok(members) => workers.extend(members),
            Err(error) => lost.push(Answer {
                worker: WorkerConfig {
                    name: group.name.clone(),
                    endpoint: group.dns.clone(),
                    role: group.role,
                    prefill: group.prefill.clone(),
                    protocol: Protocol::Bulkhead,
                    group: None,
                },
                info: Err(error),
                answered: false,
                open: None,
            }),
        }
    }
    let ask_all = workers.iter().map(|w| ask_one(w, cluster));
    let mut answers = futures_util::future::join_all(ask_all).await;
    // A decode worker asks its prefill peer which process answers there once a second from
    // its start: one asked before it has heard is asked again once that second has passed.
    let unsure: Vec<usize> = (0..answers.len())
        .filter(|&i| {
            let peer = answers[i]
                .info
                .as_ref()
                .ok()
                .and_then(|i| i.prefill_peer.as_ref());
            peer.is_some_and(|p| p.instance_id.is_empty())
        })
        .collect();
    if !unsure.is_empty() {
        tokio::time::sleep(PEER_SETTLES).await;
        for i in unsure {
            answers[i] = ask_one(&answers[i].worker, cluster).await;
        }
    }
    answers.extend(lost);
    answers
}

/// Asks worker `w` for its Info (bounded, presenting the cluster's token) and, with a token
/// configured, whether it also answers a call that presents none.
async fn ask_one(w: &WorkerConfig, cluster: &ClusterAccess) -> Answer {
    let info = async {
        let endpoint =
            tls::endpoint(&w.endpoint, cluster.tls.as_ref()).map_err(|e| (e.to_string(), false))?;
        let token = cluster.token.as_ref();
        let channel = endpoint
            .connect_timeout(ASK_LIMIT)
            .connect()
            .await
            .map_err(|e| (unreachable(e.to_string(), e.source(), cluster), false))?;
        let answer = cluster_token::shared_client(channel.clone(), token.cloned())
            .info(InfoRequest {
                include_tokenizer: false,
            })
            .await;
        let info = answer.map(tonic::Response::into_inner).map_err(|s| {
            // A failure of the connection, not a worker's answer, carries its cause (a
            // worker that speaks TLS to a caller without it ends the connection): the
            // message at the top says little, the causes say what happened.
            match s.source() {
                Some(cause) => (
                    unreachable(s.message().to_owned(), Some(cause), cluster),
                    false,
                ),
                None => (s.message().to_owned(), true),
            }
        })?;
        // A worker that requires the token refuses the same call without it.
        let open = match token {
            Some(_) => {
                let bare = cluster_token::client(channel, None)
                    .info(InfoRequest {
                        include_tokenizer: false,
                    })
                    .await;
                Some(match bare {
                    Ok(_) => Bare::Answered,
                    Err(s) if s.code() == tonic::Code::Unauthenticated => Bare::Refused,
                    Err(s) => Bare::Failed(format!("{:?}: {}", s.code(), s.message())),
                })
            }
            None => None,
        };
        Ok((info, open))
    };
    let answer = tokio::time::timeout(ASK_LIMIT * 2, info)
        .await
        .unwrap_or_else(|_| Err(("timed out".into(), false)));
    let (info, answered, open) = match answer {
        Ok((info, open)) => (Ok(info), true, open),
        Err((e, answered)) => (Err(e), answered, None),
    };
    Answer {
        worker: w.clone(),
        info,
        answered,
        open,
    }
}

/// Makes a warning of every failure that only silence caused ([`Check::silent`]): a worker
/// nothing answered for, and a decode worker's check of its prefill peer while the peer is not
/// reached yet or gives no Info. For a deployment's gate, where workers come and go (a rolling
/// update, a node lost) and the gateway routes only to workers that answer and pass these
/// checks (it checks the peer again itself), so a gateway must not wait for every worker to
/// start. A worker that answers — a refusal too — and fails a check still fails.
pub fn unreachable_warns(checks: &mut [Check]) {
    for c in checks.iter_mut().filter(|c| !c.pass && c.silent) {
        c.advisory = true;
    }
}

const REACHABLE: &str = "reachable";

/// Every check over `answers`.
pub fn checks(answers: &[Answer]) -> Vec<Check> {
    let mut out = Vec::new();
    for a in answers {
        let subject = a.worker.name.clone();
        let check = |name, pass, detail: String| Check {
            subject: subject.clone(),
            name,
            pass,
            detail,
            advisory: false,
            silent: false,
        };
        let info = match &a.info {
            Ok(info) => info,
            Err(e) => {
                out.push(Check {
                    silent: !a.answered,
                    ..check(REACHABLE, false, e.clone())
                });
                continue;
            }
        };
        out.push(check(REACHABLE, true, format!("serves {}", info.model_id)));
        match &a.open {
            Some(bare) => out.push(check(
                "requires the cluster token",
                *bare == Bare::Refused,
                match bare {
                    Bare::Answered => "it answered a call that presented no token (started \
                         without --cluster-token-file?)"
                        .into(),
                    Bare::Refused => "a call without the token was refused".into(),
                    Bare::Failed(why) => format!(
                        "a call without the token failed otherwise than unauthenticated, so \
                         whether it requires one is not known: {}",
                        printable(why, SHOWN_BYTES)
                    ),
                },
            )),
            // Nothing to ask it with: a warning, since a demo or a closed network may mean it.
            None if matches!(a.worker.protocol, Protocol::Bulkhead) => out.push(Check {
                advisory: true,
                ..check(
                    "requires the cluster token",
                    false,
                    "the gateway presents no cluster token ([cluster] token_file), so the \
                     worker cannot require one: whoever reaches it runs requests past the \
                     gateway's tenants, limits and audit"
                        .into(),
                )
            }),
            None => {}
        }
        out.extend(own(&subject, a.worker.role, info));
    }
    // A decode worker may be filled by any member of the prefill group it names.
    for d in answers
        .iter()
        .filter(|a| a.worker.role == WorkerRole::Decode)
    {
        let Some(name) = d.worker.prefill.as_deref() else {
            continue;
        };
        let prefills = answers
            .iter()
            .filter(|a| a.worker.role == WorkerRole::Prefill && a.worker.answers_to(name));
        if let Ok(di) = &d.info {
            let members = prefills
                .clone()
                .map(|p| (p.worker.name.as_str(), p.info.as_ref().ok()));
            out.push(peer(&d.worker.name, di, name, members));
        }
        for p in prefills {
            let (Ok(di), Ok(pi)) = (&d.info, &p.info) else {
                continue;
            };
            out.extend(pair(&d.worker.name, di, &p.worker.name, pi));
            out.push(whole_context(&d.worker.name, di, &p.worker.name, pi));
        }
    }
    out.extend(one_model(answers));
    out
}

/// Whether every worker the gateway routes to (decode and colocated ones that answered) serves
/// one model: the gateway serves one (the first it registers), and never routes to a worker
/// serving another — a decode worker started on the wrong file would stand idle, seen only in
/// `/workers`. (A prefill worker is held to its decode workers' model by the pair checks.) No
/// check for fewer than two.
fn one_model(answers: &[Answer]) -> Option<Check> {
    let mut models: Vec<(&str, Vec<&str>)> = Vec::new();
    for a in answers
        .iter()
        .filter(|a| a.worker.role != WorkerRole::Prefill)
    {
        let Ok(info) = &a.info else { continue };
        let name = a.worker.name.as_str();
        match models.iter_mut().find(|(m, _)| *m == info.model_id) {
            Some((_, workers)) => workers.push(name),
            None => models.push((&info.model_id, vec![name])),
        }
    }
    if models.iter().map(|(_, w)| w.len()).sum::<usize>() < 2 {
        return None;
    }
    let detail = match models.as_slice() {
        [(model, _)] => format!("every worker serves {model}"),
        _ => models
            .iter()
            .map(|(model, workers)| format!("{model} ({})", workers.join(", ")))
            .collect::<Vec<_>>()
            .join("; "),
    };
    Some(Check {
        subject: "all workers".to_owned(),
        name: "serve one model",
        pass: models.len() == 1,
        detail,
        advisory: false,
        silent: false,
    })
}

/// The checks of one worker, configured as `role`, on what its Info says: the same at run
/// time, where a failing one keeps the gateway from routing to it.
pub fn own(subject: &str, role: WorkerRole, info: &InfoResponse) -> Vec<Check> {
    let check = |name, pass, detail: String| Check {
        subject: subject.to_owned(),
        name,
        pass,
        detail,
        advisory: false,
        silent: false,
    };
    let reported = match info.role() {
        Role::Unspecified => None,
        Role::Both => Some(WorkerRole::Both),
        Role::Prefill => Some(WorkerRole::Prefill),
        Role::Decode => Some(WorkerRole::Decode),
    };
    let h = info.handoff.unwrap_or_default();
    let mut out = vec![
        check(
            // A worker that does not say cannot be held to its role: a decode worker taken
            // for `both` would have its prefill pool left out of the limit (the incident).
            "runs the configured role",
            reported == Some(role),
            format!(
                "configured {}, runs {}",
                role.name(),
                reported.map_or("(not reported)", WorkerRole::name)
            ),
        ),
        check(
            "pool covers the served context",
            info.context_length > 0 && info.pool_tokens >= info.context_length,
            format!(
                "pool {} tokens, served context {}",
                info.pool_tokens, info.context_length
            ),
        ),
        check(
            "integrity checks on",
            h.tag_check && h.checksums,
            format!(
                "page tags {}, checksums {}",
                on(h.tag_check),
                on(h.checksums)
            ),
        ),
    ];
    if role != WorkerRole::Both {
        out.push(check(
            "two-phase release on",
            h.deferred_release,
            format!("deferred release {}", on(h.deferred_release)),
        ));
    }
    out
}

/// Whether the prefill process a decode worker dials is one of `group`'s `members` (named, with
/// their Info when they gave it): the pools the gateway admits a request against, and the
/// pairs checked, must be those the request will occupy (I7), whatever address the decode
/// worker was started with. While a member gives no Info (down, hung), the process dialled may
/// be that one: the check cannot be made, and says so rather than blame the address.
pub fn peer<'a>(
    decode: &str,
    d: &InfoResponse,
    group: &str,
    members: impl Iterator<Item = (&'a str, Option<&'a InfoResponse>)>,
) -> Check {
    let (known, silent): (Vec<_>, Vec<_>) = members.partition(|(_, info)| info.is_some());
    let (pass, detail, silence) = match &d.prefill_peer {
        None => (
            false,
            "it does not say which prefill worker it dials (a worker older than the gateway?)"
                .to_owned(),
            false,
        ),
        Some(seen) if seen.instance_id.is_empty() => (
            false,
            match seen.last_error.as_str() {
                "" => format!(
                    "it has not reached its prefill worker at {} yet",
                    seen.address
                ),
                error => format!(
                    "it has not reached its prefill worker at {}: {error}",
                    seen.address
                ),
            },
            true,
        ),
        Some(seen) => match known
            .iter()
            .find(|(_, p)| p.is_some_and(|p| p.instance_id == seen.instance_id))
        {
            Some((name, _)) => (true, format!("{} answers as {name}", seen.address), false),
            None if !silent.is_empty() => (
                false,
                format!(
                    "cannot be checked while {} gives no Info: the prefill worker it dials ({}) \
                     may be that one",
                    silent
                        .iter()
                        .map(|(name, _)| *name)
                        .collect::<Vec<_>>()
                        .join(", "),
                    seen.address
                ),
                true,
            ),
            None => (
                false,
                format!(
                    "{} answers as instance {}, which is none of {group}'s prefill workers: \
                     the gateway admits its requests against pools they do not occupy",
                    seen.address, seen.instance_id
                ),
                false,
            ),
        },
    };
    Check {
        subject: decode.to_owned(),
        name: "dials a configured prefill worker",
        pass,
        detail,
        advisory: false,
        silent: silence,
    }
}

/// Loads the policy set `settings` names as the gateway does at start — every plugin compiled
/// (through the configured cache), pinned by its digest, its configuration checked against its
/// schema and by the plugin itself — and says whether it would start with it, and why not
/// (blocking: compiles).
pub fn policy_set(settings: PolicySettings) -> Check {
    let file = settings.file.display().to_string();
    let (pass, detail) = match Policies::load(settings) {
        Ok(policies) => {
            let chain = policies.current().summary();
            let plugins: Vec<&str> = chain.iter().map(|b| b.plugin.as_str()).collect();
            (
                true,
                format!(
                    "{file}: {} binding(s) ({})",
                    chain.len(),
                    plugins.join(", ")
                ),
            )
        }
        Err(e) => (false, format!("{file}: {e}")),
    };
    Check {
        subject: "policies".to_owned(),
        name: "policy set loads",
        pass,
        detail,
        advisory: false,
        silent: false,
    }
}

fn pair_subject(decode: &str, prefill: &str) -> String {
    format!("{decode} ↔ {prefill}")
}

/// Preflight's own warning about a pair, not a failure and not a gate on routing (the gateway
/// routes such a pair safely, admitting only what both hold): the prefill worker serves a
/// shorter context than its decode worker. A worker started with a pool smaller than the
/// model's context serves only what its pool holds, so the incident's configuration — a
/// prefill pool smaller than decode's — shows here, before clients meet it as
/// `context_length_exceeded`.
fn whole_context(decode: &str, d: &InfoResponse, prefill: &str, p: &InfoResponse) -> Check {
    Check {
        subject: pair_subject(decode, prefill),
        name: "prefill serves decode's context",
        pass: p.context_length >= d.context_length,
        detail: format!(
            "decode serves {} tokens, prefill {}: the pair admits at most {}",
            d.context_length,
            p.context_length,
            d.context_length.min(p.context_length)
        ),
        advisory: true,
        silent: false,
    }
}

/// The checks between a decode worker and its prefill worker.
pub fn pair(decode: &str, d: &InfoResponse, prefill: &str, p: &InfoResponse) -> Vec<Check> {
    let subject = pair_subject(decode, prefill);
    let check = |name, pass, detail: String| Check {
        subject: subject.clone(),
        name,
        pass,
        detail,
        advisory: false,
        silent: false,
    };
    let (dh, ph) = (d.handoff.unwrap_or_default(), p.handoff.unwrap_or_default());
    let layout = |h: &KvHandoff| (h.token_bytes, h.layers, h.kv_heads, h.head_dim);
    // The sender adds whole frames (a page each) to a batch until it reaches the bound: the
    // longest batch is a byte short of the bound and then one more frame.
    // A frame is a page of decode's (its reservation names the pages).
    let frame =
        (FRAME_HEAD as u64).saturating_add(u64::from(d.page_tokens).saturating_mul(ph.token_bytes));
    let batch = ph
        .transfer_batch_bytes
        .saturating_sub(1)
        .saturating_add(frame);
    // Once decode abandons a transfer, the batch under way is the sender's to finish, at any
    // rate above the prefill worker's floor; before that, decode's floor holds it: the slower
    // of the two bounds it.
    let floor = (dh.transfer_floor_bytes_per_s)
        .min(ph.transfer_floor_bytes_per_s)
        .max(1);
    let batch_secs = batch as f64 / floor as f64;
    let release_secs = dh.release_timeout_ms as f64 / 1000.0;
    vec![
        check(
            "same model",
            d.model_id == p.model_id,
            format!("{} / {}", d.model_id, p.model_id),
        ),
        check(
            "same page size",
            d.page_tokens == p.page_tokens,
            format!("{} / {} tokens", d.page_tokens, p.page_tokens),
        ),
        check(
            "same KV layout",
            layout(&dh) == layout(&ph),
            format!(
                "{:?} / {:?} (bytes per token, layers, KV heads, head size)",
                layout(&dh),
                layout(&ph)
            ),
        ),
        check(
            "same protocol version",
            dh.protocol_version == ph.protocol_version,
            format!("{} / {}", dh.protocol_version, ph.protocol_version),
        ),
        check(
            "a transfer batch fits the release timeout",
            batch_secs <= release_secs,
            format!(
                "up to {batch} bytes (a batch bound of {} and a page's frame of {frame}) at the \
                 {floor} bytes/s floor (decode {} / prefill {}) take {batch_secs:.3} s; release \
                 timeout {release_secs:.3} s",
                ph.transfer_batch_bytes,
                dh.transfer_floor_bytes_per_s,
                ph.transfer_floor_bytes_per_s
            ),
        ),
    ]
}

fn on(b: bool) -> &'static str {
    if b { "on" } else { "OFF" }
}

/// The most bytes of a worker's text (a model id, an error, a check's detail) a report shows.
const SHOWN_BYTES: usize = 1024;

/// The report: one line per worker (the OpenAI-compatible `servers` last: the model they are
/// asked for and their configured context), then one per check; and whether every check
/// passed.
pub fn render(answers: &[Answer], servers: &[ServerAnswer], checks: &[Check]) -> (String, bool) {
    let mut out = String::new();
    // Columns at least as wide as their longest entry (a GGUF's model id runs past 50
    // characters).
    let width = |entries: &mut dyn Iterator<Item = &str>, least: usize| {
        entries.map(|e| e.chars().count()).fold(least, usize::max)
    };
    let names = answers.iter().map(|a| a.worker.name.as_str());
    let name = width(
        &mut names.chain(servers.iter().map(|s| s.name.as_str())),
        16,
    );
    // What a worker says is shown escaped: a model id or an error is its text, which could
    // otherwise write lines of its own or terminal controls into the report.
    let shown = |text: &str| printable(text, SHOWN_BYTES);
    let model_ids: Vec<String> = answers
        .iter()
        .filter_map(|a| Some(shown(&a.info.as_ref().ok()?.model_id)))
        .collect();
    let models = model_ids.iter().map(String::as_str);
    let model = width(
        &mut models.chain(servers.iter().map(|s| s.upstream.model.as_str())),
        40,
    );
    let _ = writeln!(
        out,
        "{:<name$} {:<8} {:<model$} {:>10} {:>10} {:>6}",
        "worker", "role", "model", "context", "pool", "page"
    );
    for a in answers {
        let role = a.worker.role.name();
        match &a.info {
            Ok(i) => {
                let _ = writeln!(
                    out,
                    "{:<name$} {role:<8} {:<model$} {:>10} {:>10} {:>6}",
                    a.worker.name,
                    shown(&i.model_id),
                    i.context_length,
                    i.pool_tokens,
                    i.page_tokens
                );
            }
            Err(e) => {
                let e = shown(&e.to_string());
                let _ = writeln!(out, "{:<name$} {role:<8} unreachable: {e}", a.worker.name);
            }
        }
    }
    for s in servers {
        let _ = writeln!(
            out,
            "{:<name$} {:<8} {:<model$} {:>10} {:>10} {:>6}",
            s.name,
            s.role.name(),
            s.upstream.model,
            s.upstream.context_length,
            "-",
            "-"
        );
    }
    out.push('\n');
    for c in checks {
        let _ = writeln!(
            out,
            "{} {:<28} {}: {}",
            match (c.pass, c.advisory) {
                (true, _) => "PASS",
                (false, true) => "WARN",
                (false, false) => "FAIL",
            },
            c.subject,
            c.name,
            shown(&c.detail)
        );
    }
    let passed = checks.iter().all(|c| c.pass || c.advisory);
    (out, passed)
}

#[cfg(test)]
mod tests {
    use bulkhead_worker::serve::proto::PrefillPeer;

    use super::*;

    fn info(model: &str, pool: u64, context: u64, page: u32, batch: u64) -> InfoResponse {
        InfoResponse {
            model_id: model.into(),
            role: Role::Both.into(),
            pool_tokens: pool,
            context_length: context,
            page_tokens: page,
            handoff: Some(KvHandoff {
                protocol_version: 1,
                token_bytes: 23_040,
                layers: 30,
                kv_heads: 3,
                head_dim: 64,
                tag_check: true,
                checksums: true,
                deferred_release: true,
                transfer_batch_bytes: batch,
                transfer_floor_bytes_per_s: 100_000_000,
                release_timeout_ms: 10_000,
            }),
            ..InfoResponse::default()
        }
    }

    fn worker(name: &str, role: WorkerRole, prefill: Option<&str>) -> WorkerConfig {
        WorkerConfig {
            protocol: crate::config::Protocol::Bulkhead,
            name: name.into(),
            endpoint: "http://127.0.0.1:1".into(),
            role,
            prefill: prefill.map(Into::into),
            group: None,
        }
    }

    /// `decode`, having reached the process `prefill` at its address.
    fn dialing(prefill: &InfoResponse, decode: InfoResponse) -> InfoResponse {
        InfoResponse {
            prefill_peer: Some(PrefillPeer {
                address: "http://p:50051".into(),
                instance_id: prefill.instance_id.clone(),
                last_error: String::new(),
            }),
            ..decode
        }
    }

    /// Prefill worker `p` and decode worker `d`, configured and dialing as a pair.
    fn pair_answers(prefill: InfoResponse, decode: InfoResponse) -> Vec<Answer> {
        let prefill = InfoResponse {
            instance_id: "p-1".into(),
            role: Role::Prefill.into(),
            ..prefill
        };
        let decode = dialing(
            &prefill,
            InfoResponse {
                role: Role::Decode.into(),
                ..decode
            },
        );
        vec![
            Answer {
                worker: worker("p", WorkerRole::Prefill, None),
                info: Ok(prefill),
                answered: true,
                open: None,
            },
            Answer {
                worker: worker("d", WorkerRole::Decode, Some("p")),
                info: Ok(decode),
                answered: true,
                open: None,
            },
        ]
    }

    fn failed(checks: &[Check]) -> Vec<(&str, &'static str)> {
        checks
            .iter()
            .filter(|c| !c.pass && !c.advisory)
            .map(|c| (c.subject.as_str(), c.name))
            .collect()
    }

    #[test]
    fn a_matching_pair_passes_every_check() {
        let answers = pair_answers(
            info("m", 8192, 8192, 16, 4 << 20),
            info("m", 8192, 8192, 16, 0),
        );
        let checks = checks(&answers);
        assert!(checks.len() >= 12, "{checks:?}");
        assert_eq!(failed(&checks), []);
        assert!(render(&answers, &[], &checks).1);
    }

    #[test]
    fn workers_serving_two_models_fail_by_model() {
        let answers = |model: &str| {
            let mut a = pair_answers(
                info("m", 8192, 8192, 16, 4 << 20),
                info("m", 8192, 8192, 16, 0),
            );
            a.push(Answer {
                worker: worker("b", WorkerRole::Both, None),
                info: Ok(InfoResponse {
                    role: Role::Both.into(),
                    ..info(model, 8192, 8192, 16, 0)
                }),
                answered: true,
                open: None,
            });
            a
        };
        let mixed = checks(&answers("other"));
        assert_eq!(failed(&mixed), [("all workers", "serve one model")]);
        let check = mixed.iter().find(|c| c.name == "serve one model");
        assert_eq!(check.map(|c| c.detail.as_str()), Some("m (d); other (b)"));
        assert_eq!(failed(&checks(&answers("m"))), []);
        // One worker routed to: nothing to compare (its prefill worker's model is a pair check).
        let mut alone = answers("other");
        alone.truncate(2);
        assert!(!checks(&alone).iter().any(|c| c.name == "serve one model"));
    }

    /// A batch is checked as the sender makes it: a frame (a page) past the bound. A bound of
    /// 0 (one page a batch) or one just inside the timeout whose pages are large is not
    /// taken for instant.
    #[test]
    fn a_transfer_batch_is_checked_with_the_frame_that_overshoots_its_bound() {
        const BATCH: &str = "a transfer batch fits the release timeout";
        // 10 s at 100 MB/s is 1 GB; a page of 16 tokens of 23 040 bytes is 368 640 bytes.
        let page = 16 * 23_040;
        for (batch, page_tokens, fits) in [
            (4 << 20, 16, true),
            (1_000_000_000 - page, 16, false),
            (1_000_000_000 - 2 * page, 16, true),
            (0, 16, true),
            (0, 1 << 16, false),
        ] {
            let answers = pair_answers(
                info("m", 1 << 20, 8192, page_tokens, batch as u64),
                info("m", 1 << 20, 8192, page_tokens, 0),
            );
            let failed_batch = failed(&checks(&answers)).iter().any(|(_, c)| *c == BATCH);
            assert_eq!(!failed_batch, fits, "batch {batch}, page of {page_tokens}");
        }
        // The prefill worker finishes a batch at any rate above its own floor: a 4 MiB batch
        // at 100 kB/s takes 42 s, past a 10 s release timeout, whatever decode's floor.
        for (prefill_floor, fits) in [(100_000, false), (100_000_000, true), (u64::MAX, true)] {
            let mut prefill = info("m", 1 << 20, 8192, 16, 4 << 20);
            if let Some(h) = prefill.handoff.as_mut() {
                h.transfer_floor_bytes_per_s = prefill_floor;
            }
            let answers = pair_answers(prefill, info("m", 1 << 20, 8192, 16, 0));
            let failed_batch = failed(&checks(&answers)).iter().any(|(_, c)| *c == BATCH);
            assert_eq!(!failed_batch, fits, "prefill's floor {prefill_floor}");
        }
    }

    /// An OpenAI-compatible upstream `vllm` serving `served-model`, as probed.
    fn openai_server(
        probe: Result<(), String>,
        key_env: Option<&str>,
        cache_salt: bool,
    ) -> ServerAnswer {
        ServerAnswer {
            name: "vllm".into(),
            role: WorkerRole::Both,
            upstream: OpenAiUpstream {
                model: "served-model".into(),
                context_length: std::num::NonZeroU32::new(4096).expect("non-zero"),
                tokenizer: "m.gguf".into(),
                key_env: key_env.map(str::to_owned),
                cache_salt,
                report_cached_tokens: false,
            },
            probe,
        }
    }

    /// Without its cache salt, an OpenAI-compatible upstream's prefix cache is shared across
    /// tenants: said, as a warning (a server with prefix caching off shares nothing).
    #[test]
    fn an_openai_upstream_without_its_cache_salt_is_warned_of() {
        let server = |cache_salt| [openai_server(Ok(()), None, cache_salt)];
        let warned = |up: &[ServerAnswer]| {
            server_checks(up)
                .iter()
                .any(|c| c.name == "prefix cache kept per tenant" && !c.pass && c.advisory)
        };
        assert!(warned(&server(false)));
        assert!(!warned(&server(true)));
    }

    /// An OpenAI-compatible upstream that does not answer fails; its pool is never said to
    /// pass (nothing here can see it); a key its configuration names must be set.
    #[test]
    fn an_openai_upstream_is_probed_and_its_pool_never_passes() {
        let server =
            |probe: Result<(), String>, key_env: Option<&str>| openai_server(probe, key_env, true);
        let up = server(Ok(()), None);
        let down = server(
            Err("connection refused".into()),
            Some("BULKHEAD_TEST_UNSET_KEY"),
        );
        let up = [up];
        let (text, passed) = render(&[], &up, &server_checks(&up));
        assert!(passed, "{text}");
        assert!(text.contains("served-model"), "{text}");
        assert!(text.contains("WARN vllm"), "{text}");
        assert!(text.contains("not checked"), "{text}");
        let down = [down];
        let (text, passed) = render(&[], &down, &server_checks(&down));
        assert!(!passed, "{text}");
        assert!(text.contains("FAIL vllm"), "{text}");
        assert!(text.contains("connection refused"), "{text}");
        assert!(
            text.contains("BULKHEAD_TEST_UNSET_KEY, which is not set"),
            "{text}"
        );
    }

    /// A dead address is told apart from a worker that takes only TLS: the TLS hint is for a
    /// connection that was made and then ended, not for one nobody took.
    #[test]
    fn a_refused_connection_is_not_blamed_on_tls() {
        let plain = ClusterAccess::default();
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        let said = unreachable("transport error".into(), Some(&refused), &plain);
        assert!(said.contains("nothing listens there"), "{said}");
        assert!(!said.contains("tls_ca"), "{said}");
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        let said = unreachable("transport error".into(), Some(&reset), &plain);
        assert!(said.contains("takes only TLS"), "{said}");
        // Nothing answered (a timeout, no route): neither TLS nor another server is to blame.
        for kind in [
            std::io::ErrorKind::TimedOut,
            std::io::ErrorKind::HostUnreachable,
        ] {
            let silent = std::io::Error::from(kind);
            let said = unreachable("transport error".into(), Some(&silent), &plain);
            assert!(said.contains("nothing answered"), "{said}");
            assert!(!said.contains("TLS"), "{said}");
        }
    }

    /// TLS on the gateway's side only is told as the mirror of TLS on the worker's only: the
    /// worker's plain-text answer to the TLS hello names the worker's missing --tls-cert.
    #[test]
    fn a_worker_answering_tls_in_plain_text_is_said_to_lack_tls() {
        use bulkhead_worker::serve::tls::Authority;
        let with_tls = ClusterAccess {
            token: None,
            tls: Some(
                Authority::new("test CA")
                    .expect("a CA")
                    .cluster_tls(&["127.0.0.1"])
                    .expect("issued"),
            ),
        };
        let corrupt = std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            tokio_rustls::rustls::Error::InvalidMessage(
                tokio_rustls::rustls::InvalidMessage::InvalidContentType,
            ),
        );
        let said = unreachable("transport error".into(), Some(&corrupt), &with_tls);
        assert!(
            said.contains("InvalidContentType")
                && said.contains("speaks no TLS")
                && said.contains("started without --tls-cert")
                && said.contains("another server"),
            "{said}"
        );
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        let said = unreachable("transport error".into(), Some(&reset), &with_tls);
        assert!(
            !said.contains("speaks no TLS") && !said.contains("takes only TLS"),
            "{said}"
        );
    }

    #[test]
    fn a_worker_running_another_role_or_serving_no_context_fails() {
        let mut decode = info("m", 8192, 8192, 16, 0);
        decode.role = Role::Decode.into();
        let as_both = own("w", WorkerRole::Both, &decode);
        assert_eq!(failed(&as_both), [("w", "runs the configured role")]);
        assert_eq!(failed(&own("w", WorkerRole::Decode, &decode)), []);
        // One that does not say cannot be held to its role.
        let silent = InfoResponse {
            role: Role::Unspecified.into(),
            ..decode
        };
        assert_eq!(
            failed(&own("w", WorkerRole::Decode, &silent)),
            [("w", "runs the configured role")]
        );
        let nothing = info("m", 0, 0, 16, 0);
        assert_eq!(
            failed(&own("w", WorkerRole::Both, &nothing)),
            [("w", "pool covers the served context")]
        );
    }

    #[test]
    fn the_incident_a_pool_smaller_than_the_served_context_fails() {
        // 1,048,576-token context over a 681,280-token pool: the incident's numbers.
        let answers = pair_answers(
            info("m", 681_280, 1_048_576, 16, 4 << 20),
            info("m", 8192, 8192, 16, 0),
        );
        assert_eq!(
            failed(&checks(&answers)),
            [("p", "pool covers the served context")]
        );
    }

    /// The table's columns stay aligned under their titles however long a model's id is.
    #[test]
    fn the_table_is_as_wide_as_its_longest_model_id() {
        let id = "Smollm2 135M 8k Lc100K Mix1 Ep2-98362432-175cf92253bf70f3";
        let answers = pair_answers(info(id, 64, 64, 16, 4 << 20), info(id, 4096, 4096, 16, 0));
        let (report, _) = render(&answers, &[], &checks(&answers));
        let lines: Vec<&str> = report.lines().take(3).collect();
        let column = |line: &str, text: &str| line.find(text).unwrap_or_else(|| panic!("{report}"));
        // Right-aligned: every row's pool ends where the title "pool" ends.
        let pool_end = column(lines[0], "pool") + "pool".len();
        assert_eq!(
            column(lines[1], " 64     16") + " 64".len(),
            pool_end,
            "{report}"
        );
        assert_eq!(
            column(lines[2], "4096     16") + "4096".len(),
            pool_end,
            "{report}"
        );
    }

    /// What a worker says is shown escaped: a model id with a line break and terminal
    /// controls writes no line of its own into the report, nor controls to the terminal. A
    /// token size that overflows the batch's arithmetic fails the layout check, no panic.
    #[test]
    fn a_workers_own_text_is_escaped_and_its_absurd_numbers_overflow_nothing() {
        let id = "m\nPASS forged: all good\x1b[2J";
        let mut prefill = info(id, 4096, 4096, 16, 4 << 20);
        if let Some(h) = prefill.handoff.as_mut() {
            h.token_bytes = u64::MAX;
        }
        let answers = pair_answers(prefill, info(id, 4096, 4096, 16, 0));
        let (report, passed) = render(&answers, &[], &checks(&answers));
        assert!(!passed, "{report}");
        assert!(!report.contains('\x1b'), "{report}");
        assert!(
            !report.lines().any(|l| l.starts_with("PASS forged")),
            "{report}"
        );
    }

    /// A prefill worker started with a smaller pool serves a shorter context (its pool's):
    /// every check passes (the gateway admits only what both hold), and the report warns.
    #[test]
    fn a_prefill_worker_serving_a_shorter_context_than_decode_is_warned_of() {
        let warned = |answers: &[Answer]| {
            let checks = checks(answers);
            let (report, passed) = render(answers, &[], &checks);
            assert!(passed, "{report}");
            assert_eq!(failed(&checks), [], "{report}");
            report.contains("WARN d ↔ p")
                && report.contains(
                    "prefill serves decode's context: decode serves 8192 tokens, prefill 64",
                )
        };
        let short = pair_answers(info("m", 64, 64, 16, 4 << 20), info("m", 8192, 8192, 16, 0));
        assert!(warned(&short));
        let longer = pair_answers(
            info("m", 16384, 16384, 16, 4 << 20),
            info("m", 8192, 8192, 16, 0),
        );
        assert!(!warned(&longer));
    }

    #[test]
    fn mismatched_pairs_and_slow_batches_fail_by_name() {
        let mut other = info("other", 8192, 8192, 32, 0);
        if let Some(h) = other.handoff.as_mut() {
            h.token_bytes = 1;
            h.protocol_version = 2;
        }
        let answers = pair_answers(info("m", 8192, 8192, 16, 4 << 30), other);
        let names: Vec<&str> = failed(&checks(&answers))
            .into_iter()
            .map(|(_, n)| n)
            .collect();
        assert_eq!(
            names,
            [
                "same model",
                "same page size",
                "same KV layout",
                "same protocol version",
                "a transfer batch fits the release timeout"
            ]
        );
    }

    /// The pair checks compare decode with the prefill workers the gateway is configured with;
    /// a decode worker started with another `--prefill` passes them all while its requests
    /// occupy a pool nobody checked. What it reports reaching is compared with them too.
    #[test]
    fn a_decode_worker_dialing_another_prefill_worker_than_configured_fails() {
        let mut answers = pair_answers(
            info("m", 8192, 8192, 16, 4 << 20),
            info("m", 8192, 8192, 16, 0),
        );
        fn peer(answers: &mut [Answer]) -> &mut PrefillPeer {
            let decode = answers[1].info.as_mut().expect("decode's Info");
            decode.prefill_peer.as_mut().expect("its peer")
        }
        "a-stranger".clone_into(&mut peer(&mut answers).instance_id);
        let checks = checks(&answers);
        assert_eq!(
            failed(&checks),
            [("d", "dials a configured prefill worker")]
        );
        let detail = &checks
            .iter()
            .find(|c| !c.pass && !c.advisory)
            .expect("a failure")
            .detail;
        assert!(
            detail.contains("http://p:50051 answers as instance a-stranger"),
            "{detail}"
        );
        // What `--unreachable-warns` makes of each: the stranger is no silence.
        let gated = |answers: &[Answer]| {
            let mut checks = super::checks(answers);
            unreachable_warns(&mut checks);
            failed(&checks)
                .into_iter()
                .map(|(s, n)| (s.to_owned(), n))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            gated(&answers),
            [("d".to_owned(), "dials a configured prefill worker")]
        );
        // The prefill worker gives no Info (down): the process dialled may be it, so the
        // address is not blamed; the check cannot be made.
        let prefill_info = std::mem::replace(&mut answers[0].info, Err("refused".into()));
        answers[0].answered = false;
        // Silent, under the gate: a warning for both, the gateway checks again before routing.
        assert_eq!(gated(&answers), []);
        let checks = super::checks(&answers);
        let dials = checks
            .iter()
            .find(|c| c.name == "dials a configured prefill worker")
            .expect("the check");
        assert!(!dials.pass);
        assert!(
            dials
                .detail
                .starts_with("cannot be checked while p gives no Info"),
            "{}",
            dials.detail
        );
        answers[0].info = prefill_info;
        answers[0].answered = true;

        peer(&mut answers).instance_id.clear();
        let checks = super::checks(&answers);
        assert_eq!(
            failed(&checks),
            [("d", "dials a configured prefill worker")]
        );
        assert_eq!(
            gated(&answers),
            [],
            "not reached yet: a warning under the gate"
        );
        // Why it has not reached one, when it knows.
        "refused: the cluster token presented is not this worker's"
            .clone_into(&mut peer(&mut answers).last_error);
        let detail = super::checks(&answers)
            .into_iter()
            .find(|c| !c.pass && !c.advisory)
            .expect("a failure")
            .detail;
        assert_eq!(
            detail,
            "it has not reached its prefill worker at http://p:50051: refused: the cluster \
             token presented is not this worker's"
        );
        answers[1]
            .info
            .as_mut()
            .expect("decode's Info")
            .prefill_peer = None;
        assert_eq!(
            failed(&super::checks(&answers)),
            [("d", "dials a configured prefill worker")]
        );
    }

    #[test]
    fn a_decode_worker_is_checked_against_every_member_of_its_prefill_group() {
        let member = |name: &str, role, prefill: Option<&str>, group: &str| WorkerConfig {
            group: Some(group.into()),
            ..worker(name, role, prefill)
        };
        let prefill = |page| InfoResponse {
            role: Role::Prefill.into(),
            ..info("m", 8192, 8192, page, 4 << 20)
        };
        let p_a = InfoResponse {
            instance_id: "p@a-1".into(),
            ..prefill(16)
        };
        let d_a = InfoResponse {
            role: Role::Decode.into(),
            ..dialing(&p_a, info("m", 8192, 8192, 16, 0))
        };
        let answers = vec![
            Answer {
                worker: member("p@a", WorkerRole::Prefill, None, "p"),
                info: Ok(p_a),
                answered: true,
                open: None,
            },
            Answer {
                worker: member("p@b", WorkerRole::Prefill, None, "p"),
                info: Ok(prefill(32)),
                answered: true,
                open: None,
            },
            Answer {
                worker: member("d@a", WorkerRole::Decode, Some("p"), "d"),
                info: Ok(d_a),
                answered: true,
                open: None,
            },
        ];
        let checks = checks(&answers);
        assert!(checks.iter().any(|c| c.subject == "d@a ↔ p@a"));
        assert_eq!(failed(&checks), [("d@a ↔ p@b", "same page size")]);
    }

    #[tokio::test]
    async fn a_group_that_resolves_to_no_worker_fails_preflight() {
        struct Nothing;
        impl Resolve for Nothing {
            async fn resolve(&self, _: &str) -> std::io::Result<Vec<std::net::SocketAddr>> {
                Ok(Vec::new())
            }
        }
        let config = crate::Config::parse(include_str!("../../deploy/k8s/base/gateway.toml"))
            .expect("valid");
        let answers = ask(&config, &ClusterAccess::default(), &Nothing).await;
        let (text, passed) = render(&answers, &[], &checks(&answers));
        assert!(!passed);
        assert!(
            text.contains("FAIL prefill") && text.contains("FAIL decode"),
            "{text}"
        );
        assert!(text.contains("resolves to no address"), "{text}");
    }

    #[test]
    fn a_worker_that_answers_without_the_cluster_token_fails() {
        let answer = |name: &str, open| Answer {
            worker: worker(name, WorkerRole::Both, None),
            info: Ok(info("m", 8192, 8192, 16, 0)),
            answered: true,
            open,
        };
        let answers = vec![
            answer("open", Some(Bare::Answered)),
            answer("closed", Some(Bare::Refused)),
            answer("not-asked", None),
            // Refused, but not for the token: that says nothing of whether it needs one.
            answer("busy", Some(Bare::Failed("Unavailable: overloaded".into()))),
        ];
        let checks = checks(&answers);
        assert_eq!(
            failed(&checks),
            [
                ("open", "requires the cluster token"),
                ("busy", "requires the cluster token")
            ]
        );
        let verdict = |name: &str| {
            checks
                .iter()
                .find(|c| c.subject == name && c.name == "requires the cluster token")
                .map(|c| (c.pass, c.advisory))
        };
        assert_eq!(verdict("closed"), Some((true, false)));
        // With no token to ask with, a warning that fails nothing.
        assert_eq!(verdict("not-asked"), Some((false, true)));
    }

    #[test]
    fn an_unreachable_worker_or_integrity_off_fails() {
        let mut off = info("m", 8192, 8192, 16, 0);
        if let Some(h) = off.handoff.as_mut() {
            h.tag_check = false;
        }
        let answers = vec![
            Answer {
                worker: worker("a", WorkerRole::Both, None),
                info: Err("connection refused".into()),
                answered: false,
                open: None,
            },
            Answer {
                worker: worker("b", WorkerRole::Both, None),
                info: Ok(off),
                answered: true,
                open: None,
            },
            // Answered, refusing the gateway (another cluster token): its word, not silence.
            Answer {
                worker: worker("c", WorkerRole::Both, None),
                info: Err("the cluster token is not this cluster's".into()),
                answered: true,
                open: None,
            },
        ];
        let (text, passed) = render(&answers, &[], &checks(&answers));
        assert!(!passed);
        assert!(
            text.contains("FAIL a") && text.contains("reachable"),
            "{text}"
        );
        assert!(
            text.contains("integrity checks on: page tags OFF"),
            "{text}"
        );
        // A deployment's gate (--unreachable-warns): the worker that does not answer warns,
        // the one that answers with its checks off still fails.
        // A deployment's gate (--unreachable-warns): the worker that does not answer warns;
        // the one that refused the gateway and the one with its checks off still fail.
        let mut gate = checks(&answers);
        unreachable_warns(&mut gate);
        let (text, passed) = render(&answers, &[], &gate);
        assert!(!passed, "{text}");
        assert!(!text.contains("FAIL a"), "{text}");
        assert!(text.contains("FAIL b") && text.contains("FAIL c"), "{text}");
        let (text, passed) = render(&answers[..1], &[], &gate[..1]);
        assert!(passed, "{text}");
    }
}
