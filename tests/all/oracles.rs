//! The isolation suite's oracles (issue 7), shared by every scenario:
//!
//! - **Canary** (I6): each tenant's prompts carry canary strings of its own; no other tenant's
//!   response (every stream chunk and error message included) or audit record, and no log line
//!   of any process, ever contains one.
//! - **Solo equality** (I2, I6): with greedy decoding, every completed response equals the same
//!   request run alone on a fresh deployment ([`Reference`]); batch-invariant kernels make this
//!   exact, so any KV that was not the request's own shows up as a different answer.
//! - **Accounting** (I1, I5): after the scenario drains, every worker's pool is back to its
//!   baseline, with exactly the quarantined pages the scenario expects; every request that
//!   reached the gateway has exactly one audit record in its tenant's log, with the status and
//!   error the client saw.
//!
//! Each oracle returns its findings (empty: it holds) instead of failing, so that a scenario
//! can also assert that an oracle fires — the all-checks-off run shows that they can fail.
//! [`assert_clean`] fails a test with every finding at once.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::up::{KEY_A, Up, exchange, header, open, parse_response, wait_records};
use crate::worker_grpc::{Worker, metric};

/// A tenant of the test configuration and its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Tenant {
    pub id: &'static str,
    pub key: &'static str,
}

pub(crate) const TENANT_A: Tenant = Tenant {
    id: "tenant-a",
    key: crate::up::KEY_A,
};
pub(crate) const TENANT_B: Tenant = Tenant {
    id: "tenant-b",
    key: crate::up::KEY_B,
};
pub(crate) const TENANT_C: Tenant = Tenant {
    id: "tenant-c",
    key: "sk-test-tenant-c",
};

/// The configuration table of [`TENANT_C`] (for `Options::toml` / `Spec::toml`).
pub(crate) fn tenant_c_toml() -> String {
    format!(
        "\n[[tenants]]\nid = \"{}\"\nkey_sha256 = [\"{}\"]\nmax_context = 8192\n\
         max_concurrent = 8\nrequests_per_minute = 600\ntokens_per_minute = 1000000\n",
        TENANT_C.id,
        crate::up::sha256_hex(TENANT_C.key)
    )
}

/// A fresh canary for `tenant`: letters and digits no answer or log holds by chance.
pub(crate) fn canary(tenant: &Tenant) -> String {
    let tag: String = tenant
        .id
        .trim_start_matches("tenant-")
        .to_ascii_uppercase()
        .chars()
        .take(1)
        .collect();
    format!("QX{tag}{:08}", rand::random::<u32>() % 100_000_000)
}

/// One request as the client sent it, and what came back.
#[derive(Debug, Clone)]
pub(crate) struct Exchange {
    pub tenant: Tenant,
    pub path: String,
    pub body: String,
    /// The canaries the request's prompt carries.
    pub canaries: Vec<String>,
    /// 0 when no response head arrived.
    pub status: u16,
    pub request_id: Option<String>,
    /// Everything received: the whole body, every stream chunk.
    pub response: String,
    /// The client left before the response ended.
    pub abandoned: bool,
}

impl Exchange {
    /// Asserts that the exchange failed with HTTP `status` and the error code `code`.
    pub fn assert_failed(&self, status: u16, code: &str) {
        assert_eq!(self.status, status, "{}", self.response);
        assert_eq!(
            self.error_code().as_deref(),
            Some(code),
            "{}",
            self.response
        );
    }

    /// The error's code (or type, when it has no code), when the response is an OpenAI error
    /// or a stream that ended in one.
    pub fn error_code(&self) -> Option<String> {
        let events = self
            .response
            .lines()
            .filter_map(|l| l.strip_prefix("data: "));
        std::iter::once(self.response.as_str())
            .chain(events)
            .filter_map(|text| serde_json::from_str::<Value>(text).ok())
            .find_map(|v| {
                let e = v.get("error")?;
                e["code"]
                    .as_str()
                    .or_else(|| e["type"].as_str())
                    .map(str::to_owned)
            })
    }
}

/// When a client that abandons its request leaves.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Leave<'a> {
    /// This long after sending it, whatever arrived by then (maybe not even the head).
    After(Duration),
    /// As soon as the flag is set (by the scenario, once what the request had to hold up has
    /// happened), whatever arrived by then.
    When(&'a AtomicBool),
    /// As soon as the response head arrived (the worker accepted the request).
    AfterHead,
    /// As soon as this many stream events (`data:` lines) arrived.
    AfterEvents(usize),
}

/// Every exchange of a scenario, from every client thread.
#[derive(Debug, Default)]
pub(crate) struct Ledger(Mutex<Vec<Exchange>>);

impl Ledger {
    /// Sends one request of `tenant` to the API at `api` (`Connection: close`), records it and
    /// returns it.
    pub fn send(
        &self,
        api: &str,
        tenant: Tenant,
        path: &str,
        body: &str,
        canaries: &[&str],
    ) -> Exchange {
        let (status, head, response) = exchange(api, "POST", path, Some(tenant.key), &[], body);
        let e = Exchange {
            tenant,
            path: path.to_owned(),
            body: body.to_owned(),
            canaries: canaries.iter().map(|c| (*c).to_owned()).collect(),
            status,
            request_id: header(&head, "x-request-id").map(str::to_owned),
            response,
            abandoned: false,
        };
        self.record(e.clone());
        e
    }

    /// Sends one streaming request of `tenant` and leaves as `leave` says; records it (as
    /// abandoned, unless the stream had ended by then) and returns it.
    pub fn abandon(
        &self,
        api: &str,
        tenant: Tenant,
        path: &str,
        body: &str,
        canaries: &[&str],
        leave: Leave<'_>,
    ) -> Exchange {
        use std::io::Read;
        let mut s = open(api, tenant.key, path, body);
        let deadline = Instant::now()
            + match leave {
                Leave::After(d) => d,
                Leave::When(_) | Leave::AfterHead | Leave::AfterEvents(_) => crate::up::HTTP_LIMIT,
            };
        s.set_read_timeout(Some(Duration::from_millis(20)))
            .expect("a timeout");
        let (mut raw, mut buf) = (Vec::new(), [0u8; 4096]);
        // The stream ended on its own: its `[DONE]`, or its body's last chunk (after an error).
        let ended = |raw: &[u8]| {
            let text = String::from_utf8_lossy(raw);
            text.contains("data: [DONE]") || text.ends_with("\r\n0\r\n\r\n")
        };
        while Instant::now() < deadline && !ended(&raw) {
            let text = String::from_utf8_lossy(&raw);
            let leave_now = match leave {
                Leave::After(_) => false,
                Leave::When(flag) => flag.load(Ordering::SeqCst),
                Leave::AfterHead => text.contains("\r\n\r\n"),
                Leave::AfterEvents(n) => text.matches("data:").count() >= n,
            };
            if leave_now {
                break;
            }
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => raw.extend_from_slice(&buf[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(_) => break,
            }
        }
        drop(s);
        let raw = String::from_utf8_lossy(&raw).into_owned();
        let (status, response) = parse_response(&raw);
        let head = raw.split_once("\r\n\r\n").map_or("", |(h, _)| h);
        let e = Exchange {
            tenant,
            path: path.to_owned(),
            body: body.to_owned(),
            canaries: canaries.iter().map(|c| (*c).to_owned()).collect(),
            status,
            request_id: header(head, "x-request-id").map(str::to_owned),
            abandoned: !ended(raw.as_bytes()),
            response,
        };
        self.record(e.clone());
        e
    }

    /// Records an exchange made some other way (a client that leaves mid-stream).
    pub fn record(&self, e: Exchange) {
        self.0.lock().expect("the ledger").push(e);
    }

    pub fn all(&self) -> Vec<Exchange> {
        self.0.lock().expect("the ledger").clone()
    }
}

/// Fails the test with every finding, if there are any.
pub(crate) fn assert_clean(findings: &[String]) {
    assert!(
        findings.is_empty(),
        "{} oracle finding(s):\n- {}",
        findings.len(),
        findings.join("\n- ")
    );
}

/// A short excerpt of `text` around `needle`, for a finding.
fn around(text: &str, needle: &str) -> String {
    // A reformatted canary: near its first letters.
    let at = text
        .find(needle)
        .or_else(|| text.find(needle.get(..3).unwrap_or(needle)))
        .unwrap_or(0);
    let start = text.floor_char_boundary(at.saturating_sub(80));
    let end = text.ceil_char_boundary((at + needle.len() + 80).min(text.len()));
    text[start..end].replace('\n', "⏎")
}

/// Text as the canary oracle compares it: letters and digits only, in upper case. A model that
/// leaks a canary may reformat it (`QXA65677683` came back as `QXA6567-7683`); squashed, it
/// is still found.
fn squash(text: &str) -> String {
    text.chars()
        .filter(char::is_ascii_alphanumeric)
        .map(|c| c.to_ascii_uppercase())
        .collect()
}

/// The canary oracle over `exchanges`, the processes' `logs` (name, text) and each tenant's
/// audit records (tenant id, records).
pub(crate) fn canary_findings(
    exchanges: &[Exchange],
    logs: &[(String, String)],
    audit: &[(String, Vec<Value>)],
) -> Vec<String> {
    let planted: Vec<(&str, &str)> = exchanges
        .iter()
        .flat_map(|e| e.canaries.iter().map(move |c| (e.tenant.id, c.as_str())))
        .collect();
    let mut findings = Vec::new();
    for e in exchanges {
        let response = squash(&e.response);
        for &(owner, c) in &planted {
            if owner != e.tenant.id && response.contains(&squash(c)) {
                findings.push(format!(
                    "LEAK: {}'s response (request {}, status {}) carries {owner}'s canary {c}: …{}…",
                    e.tenant.id,
                    e.request_id.as_deref().unwrap_or("?"),
                    e.status,
                    around(&e.response, c)
                ));
            }
        }
    }
    for (name, text) in logs {
        let mut seen = std::collections::HashSet::new();
        for line in text.lines() {
            let squashed = squash(line);
            for &(owner, c) in &planted {
                if squashed.contains(&squash(c)) && seen.insert(c) {
                    findings.push(format!(
                        "the {name} log carries {owner}'s canary {c}: {}",
                        around(line, c)
                    ));
                }
            }
        }
    }
    for (tenant, records) in audit {
        let text = serde_json::to_string(records).expect("records are JSON");
        let squashed = squash(&text);
        for &(owner, c) in &planted {
            if owner != tenant && squashed.contains(&squash(c)) {
                findings.push(format!(
                    "{tenant}'s audit log carries {owner}'s canary {c}: …{}…",
                    around(&text, c)
                ));
            }
        }
    }
    findings
}

/// The generated text and finish reason of a completed response (chat or completion, streamed
/// or not).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Answer {
    pub text: String,
    pub finish: Option<String>,
}

/// The answer in a 200 response body, or `None` when the body holds none.
pub(crate) fn answer(body: &str) -> Option<Answer> {
    let choice_text = |c: &Value, delta: bool| {
        let m = if delta { &c["delta"] } else { &c["message"] };
        m["content"]
            .as_str()
            .or_else(|| c["text"].as_str())
            .unwrap_or_default()
            .to_owned()
    };
    if let Ok(v) = serde_json::from_str::<Value>(body) {
        let c = &v["choices"][0];
        return c.is_object().then(|| Answer {
            text: choice_text(c, false),
            finish: c["finish_reason"].as_str().map(str::to_owned),
        });
    }
    let mut answer = Answer {
        text: String::new(),
        finish: None,
    };
    let mut done = false;
    for data in body.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if data.trim() == "[DONE]" {
            done = true;
            continue;
        }
        let chunk: Value = serde_json::from_str(data).ok()?;
        let c = &chunk["choices"][0];
        answer.text.push_str(&choice_text(c, true));
        if let Some(f) = c["finish_reason"].as_str() {
            answer.finish = Some(f.to_owned());
        }
    }
    done.then_some(answer)
}

/// The solo-equality oracle's reference: a fresh `bulkhead up` (default configuration, every
/// check on, nothing else running) that answers each distinct request once, alone.
pub(crate) struct Reference {
    up: Up,
    answers: HashMap<(String, String), Answer>,
}

impl Reference {
    pub fn start() -> Reference {
        let up = Up::start(&[]);
        up.wait_routable();
        Reference {
            up,
            answers: HashMap::new(),
        }
    }

    /// How many tokens the prompt of `body` (a request on `path`) takes, as the gateway counts
    /// them (asked of the reference, so the deployment under test sees nothing of it).
    pub fn prompt_tokens(&self, path: &str, body: &str) -> u64 {
        let mut probe: Value = serde_json::from_str(body).expect("a JSON body");
        probe["max_tokens"] = 1.into();
        probe["stream"] = false.into();
        let (status, _, response) = exchange(
            &self.up.api,
            "POST",
            path,
            Some(KEY_A),
            &[],
            &probe.to_string(),
        );
        assert_eq!(status, 200, "the reference counts {body}: {response}");
        serde_json::from_str::<Value>(&response).expect("JSON")["usage"]["prompt_tokens"]
            .as_u64()
            .expect("usage")
    }

    /// The answer to `body` on `path`, run alone.
    pub fn answer(&mut self, path: &str, body: &str) -> Answer {
        let key = (path.to_owned(), body.to_owned());
        if let Some(a) = self.answers.get(&key) {
            return a.clone();
        }
        let (status, _, response) = exchange(&self.up.api, "POST", path, Some(KEY_A), &[], body);
        assert_eq!(status, 200, "the reference answers {body}: {response}");
        let a = answer(&response).unwrap_or_else(|| panic!("no answer in {response}"));
        self.answers.insert(key, a.clone());
        a
    }
}

/// The solo-equality oracle: every completed exchange's answer equals the reference's.
pub(crate) fn solo_findings(exchanges: &[Exchange], reference: &mut Reference) -> Vec<String> {
    let mut findings = Vec::new();
    // Completed: a 200 whose client stayed to the end and whose stream did not end in an error.
    let completed = |e: &&Exchange| e.status == 200 && !e.abandoned && e.error_code().is_none();
    for e in exchanges.iter().filter(completed) {
        let Some(got) = answer(&e.response) else {
            findings.push(format!(
                "{}'s request {} answered 200 without a complete answer: {}",
                e.tenant.id,
                e.request_id.as_deref().unwrap_or("?"),
                e.response
            ));
            continue;
        };
        let alone = reference.answer(&e.path, &e.body);
        if got != alone {
            findings.push(format!(
                "NOT SOLO-EQUAL: {}'s request {} ({}) answered {:?} ({:?}); alone it answers {:?} ({:?})",
                e.tenant.id,
                e.request_id.as_deref().unwrap_or("?"),
                e.body,
                got.text,
                got.finish,
                alone.text,
                alone.finish
            ));
        }
    }
    findings
}

/// A worker's KV pool pages by state, from its `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pool {
    pub free: u32,
    pub reserved: u32,
    pub owned: u32,
    pub releasing: u32,
    pub quarantined: u32,
    pub pending_scrub: u32,
    /// In the tenants' prefix caches: given back whenever a reservation needs them.
    pub cached: u32,
    /// Quarantined pages reclaimed since the worker started (a counter: a transfer's
    /// quarantined pages come back once its peer is known gone).
    pub reclaimed: u32,
}

impl Pool {
    pub fn of(worker: &Worker) -> Pool {
        let m = worker.metrics();
        let pages = |state: &str| {
            metric(&m, &format!("bulkhead_kv_pool_pages{{state=\"{state}\"}}")) as u32
        };
        Pool {
            free: pages("free"),
            reserved: pages("reserved"),
            owned: pages("owned"),
            releasing: pages("releasing"),
            quarantined: pages("quarantined"),
            pending_scrub: pages("pending_scrub"),
            cached: pages("cached"),
            reclaimed: metric(&m, "bulkhead_kv_reclaimed_pages_total") as u32,
        }
    }

    /// A pool of `total` pages, all free.
    pub fn all_free(total: u32) -> Pool {
        Pool {
            free: total,
            reserved: 0,
            owned: 0,
            releasing: 0,
            quarantined: 0,
            pending_scrub: 0,
            cached: 0,
            reclaimed: 0,
        }
    }

    pub fn total(&self) -> u32 {
        self.free
            + self.reserved
            + self.owned
            + self.releasing
            + self.quarantined
            + self.pending_scrub
            + self.cached
    }

    /// Free, or free as soon as a reservation needs them: scrubbed at the engine's next step,
    /// or evicted from a prefix cache.
    pub fn available(&self) -> u32 {
        self.free + self.pending_scrub + self.cached
    }

    /// Nothing held by a request or a transfer.
    fn settled(&self) -> bool {
        self.reserved + self.owned + self.releasing == 0
    }
}

/// The accounting oracle for one worker's pool: waits (bounded) until nothing is held, then
/// checks that exactly `quarantined` pages went to quarantine since the `baseline` (still
/// there, or reclaimed since) and that every other page is available again.
pub(crate) fn pool_findings(
    name: &str,
    worker: &Worker,
    baseline: Pool,
    quarantined: u32,
) -> Vec<String> {
    let went = |p: &Pool| p.quarantined + p.reclaimed.saturating_sub(baseline.reclaimed);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut now = Pool::of(worker);
    while !(now.settled() && went(&now) == quarantined) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        now = Pool::of(worker);
    }
    let mut findings = Vec::new();
    if now.total() != baseline.total() {
        findings.push(format!(
            "the {name} pool has {} pages, it had {}",
            now.total(),
            baseline.total()
        ));
    }
    if !now.settled() {
        findings.push(format!("the {name} pool still holds pages: {now:?}"));
    }
    if went(&now) != quarantined {
        findings.push(format!(
            "the {name} pool quarantined {} pages, the scenario expects {quarantined}: {now:?}",
            went(&now)
        ));
    }
    if now.available() + now.quarantined != baseline.available() {
        findings.push(format!(
            "the {name} pool did not return to its baseline {baseline:?}: {now:?}"
        ));
    }
    findings
}

/// The audit half of the accounting oracle: for every tenant in `exchanges`, its log (read
/// through the gateway's admin listener at `admin`) holds exactly one record per request, with
/// the status and error the client saw (a client that left: `client_disconnected`). Returns the
/// findings and the records read, by tenant.
pub(crate) fn audit_findings(
    admin: &str,
    exchanges: &[Exchange],
) -> (Vec<String>, Vec<(String, Vec<Value>)>) {
    let mut by_tenant: Vec<(Tenant, Vec<&Exchange>)> = Vec::new();
    for e in exchanges {
        match by_tenant.iter_mut().find(|(t, _)| *t == e.tenant) {
            Some((_, list)) => list.push(e),
            None => by_tenant.push((e.tenant, vec![e])),
        }
    }
    let mut findings = Vec::new();
    let mut read = Vec::new();
    for (tenant, sent) in by_tenant {
        let records = wait_records(admin, tenant.id, sent.len());
        if records.len() != sent.len() {
            findings.push(format!(
                "{} sent {} requests and its audit log holds {} records",
                tenant.id,
                sent.len(),
                records.len()
            ));
        }
        // Clients that left before the response head have no request id: each must match one
        // record of nobody else's, a disconnect.
        let known: Vec<&str> = sent
            .iter()
            .filter_map(|e| e.request_id.as_deref())
            .collect();
        let anonymous = sent.iter().filter(|e| e.request_id.is_none()).count();
        let unmatched: Vec<&Value> = records
            .iter()
            .filter(|r| !known.iter().any(|id| r["bulkhead.request.id"] == *id))
            .collect();
        if unmatched.len() != anonymous
            || unmatched
                .iter()
                .any(|r| r["error.type"] != "client_disconnected")
        {
            findings.push(format!(
                "{} has {anonymous} requests whose client left before the head, and these records of no known request: {unmatched:#?}",
                tenant.id
            ));
        }
        for e in sent {
            let Some(id) = &e.request_id else {
                if !e.abandoned {
                    findings.push(format!(
                        "{}'s request got no x-request-id (status {}): {}",
                        tenant.id, e.status, e.response
                    ));
                }
                continue;
            };
            let mine: Vec<&Value> = records
                .iter()
                .filter(|r| r["bulkhead.request.id"] == id.as_str())
                .collect();
            let [record] = mine.as_slice() else {
                findings.push(format!(
                    "{}'s request {id} has {} audit records, not one",
                    tenant.id,
                    mine.len()
                ));
                continue;
            };
            let (status, error) = (
                record["http.response.status_code"].as_u64().unwrap_or(0),
                record["error.type"].as_str().map(str::to_owned),
            );
            // A client that left before reading the end may have left after the gateway wrote
            // it: then the record truthfully says the request completed (200, tokens sent).
            let completed_before_leaving = e.abandoned
                && status == 200
                && error.is_none()
                && record["gen_ai.usage.output_tokens"].as_u64() > Some(0);
            let want_error = if e.abandoned && !completed_before_leaving {
                Some("client_disconnected".to_owned())
            } else if e.abandoned {
                None
            } else {
                e.error_code()
            };
            if (!e.abandoned && status != u64::from(e.status)) || error != want_error {
                findings.push(format!(
                    "{}'s request {id}: the client saw {} {:?}{}, its audit record says {status} {error:?}",
                    tenant.id,
                    e.status,
                    e.error_code(),
                    if e.abandoned { " and left" } else { "" }
                ));
            }
            if record["bulkhead.tenant.id"] != tenant.id {
                findings.push(format!(
                    "{}'s request {id} is recorded for {}",
                    tenant.id, record["bulkhead.tenant.id"]
                ));
            }
        }
        read.push((tenant.id.to_owned(), records));
    }
    (findings, read)
}
