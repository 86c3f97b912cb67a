//! Worker discovery through DNS: a `[[worker_groups]]` entry names a DNS name (a Kubernetes
//! headless Service) that resolves to every worker of one role, instead of a hand-written list
//! of addresses. The gateway re-resolves each group every refresh interval, so pods that come
//! and go are picked up; `bulkhead preflight` resolves the same names and checks every member.
//!
//! ```toml
//! [[worker_groups]]
//! name = "prefill"
//! dns = "bulkhead-prefill.bulkhead.svc.cluster.local:50051"
//! role = "prefill"
//!
//! [[worker_groups]]
//! name = "decode"
//! dns = "bulkhead-decode.bulkhead.svc.cluster.local:50051"
//! role = "decode"
//! prefill = "prefill"        # a prefill group (or a [[workers]] prefill worker)
//! ```
//!
//! ```text
//!  every interval: resolve(dns) ──▶ members(group, addrs) ──▶ Workers::set_members(group, …)
//!                  (a failed lookup keeps the last members; a name with no address, or none
//!                   at all, removes them)
//! ```
//!
//! A member is an ordinary [`WorkerConfig`] named `group@address`, with `group` set. A decode
//! worker whose `prefill` names a group may be filled by any of its members (its prefill
//! connection goes through the group's Service), so the gateway checks it against every member
//! and bounds its limit by the smallest of their pools. The resolver is a trait so tests can
//! hand out any addresses.

use std::collections::BTreeSet;
use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use serde::Deserialize;

use crate::config::{Protocol, WorkerConfig, WorkerRole};
use crate::workers::Workers;

/// A validated `[[worker_groups]]` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerGroup {
    /// Unique among groups and workers; members are named `name@address`.
    pub name: String,
    /// `host:port` to resolve; every address it resolves to is one worker's gRPC API.
    pub dns: String,
    pub role: WorkerRole,
    /// Decode groups only: the prefill group or prefill worker that fills their pages.
    pub prefill: Option<String>,
}

/// A `[[worker_groups]]` entry as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawWorkerGroup {
    name: String,
    dns: String,
    role: WorkerRole,
    #[serde(default)]
    prefill: Option<String>,
}

/// Why a `[[worker_groups]]` entry is refused.
#[derive(Debug, thiserror::Error)]
pub enum GroupError {
    #[error(
        "worker group {name:?}: dns = {dns:?} is not a name and port like \
         bulkhead-decode.bulkhead.svc.cluster.local:50051"
    )]
    Dns { name: String, dns: String },
    #[error("worker group {name:?}: the name may use only a-z A-Z 0-9 - _ .")]
    Name { name: String },
}

impl RawWorkerGroup {
    /// Checks the group's own fields; [`crate::config`] checks names and prefill references
    /// across workers and groups.
    pub(crate) fn validate(self) -> Result<WorkerGroup, GroupError> {
        let name_ok = !self.name.is_empty()
            && self
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
        if !name_ok {
            return Err(GroupError::Name { name: self.name });
        }
        if dns_target(&self.dns).is_none() {
            return Err(GroupError::Dns {
                name: self.name,
                dns: self.dns,
            });
        }
        Ok(WorkerGroup {
            name: self.name,
            dns: self.dns,
            role: self.role,
            prefill: self.prefill,
        })
    }

    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    pub(crate) fn role(&self) -> WorkerRole {
        self.role
    }

    pub(crate) fn prefill(&self) -> Option<&str> {
        self.prefill.as_deref()
    }
}

/// `(host, port)` of `host:port` (no scheme, no path, a non-empty host, a port; an IPv6
/// host in brackets, given without them); `None` else.
fn dns_target(dns: &str) -> Option<(&str, u16)> {
    let (host, port) = dns.rsplit_once(':')?;
    let port: u16 = port.parse().ok().filter(|&p| p != 0)?;
    if let Some(ip) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        return ip
            .parse::<std::net::Ipv6Addr>()
            .is_ok()
            .then_some((ip, port));
    }
    let host_ok = !host.is_empty() && !host.contains(['/', '@', ' ', ':', '[', ']']);
    host_ok.then_some((host, port))
}

impl WorkerConfig {
    /// Whether a decode worker's `prefill = name` designates this worker: it is named so, or
    /// it is a member of the group named so.
    pub fn answers_to(&self, name: &str) -> bool {
        self.name == name || self.group.as_deref() == Some(name)
    }
}

/// The workers a group's addresses stand for: one per distinct address, in address order.
pub fn members(group: &WorkerGroup, addrs: &[SocketAddr]) -> Vec<WorkerConfig> {
    let distinct: BTreeSet<SocketAddr> = addrs.iter().copied().collect();
    distinct
        .into_iter()
        .map(|addr| WorkerConfig {
            name: format!("{}@{addr}", group.name),
            endpoint: format!("http://{addr}"),
            role: group.role,
            prefill: group.prefill.clone(),
            protocol: Protocol::Bulkhead,
            group: Some(group.name.clone()),
        })
        .collect()
}

/// Resolves a `host:port` to socket addresses: none when the name does not exist or has no
/// address (its headless Service scaled to nothing), an error when the lookup failed (no
/// answer, a server failure): the two are told apart, as members are removed only on the
/// first.
pub trait Resolve: Send + Sync + 'static {
    fn resolve(
        &self,
        target: &str,
    ) -> impl Future<Output = std::io::Result<Vec<SocketAddr>>> + Send;
}

/// The system resolver (what the pod's `/etc/resolv.conf` says: cluster DNS on Kubernetes),
/// through `getaddrinfo`, whose error codes say which failure it was.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemResolver;

/// Bound on one lookup.
const LOOKUP_LIMIT: Duration = Duration::from_secs(5);

impl Resolve for SystemResolver {
    async fn resolve(&self, target: &str) -> std::io::Result<Vec<SocketAddr>> {
        let invalid = || {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{target:?} is not a name and port"),
            )
        };
        let (host, port) = dns_target(target).ok_or_else(invalid)?;
        let (host, port) = (host.to_owned(), port.to_string());
        let lookup = tokio::task::spawn_blocking(move || lookup(&host, &port));
        match tokio::time::timeout(LOOKUP_LIMIT, lookup).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(e)) => Err(std::io::Error::other(e)),
            Err(_) => Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no DNS answer within {} s", LOOKUP_LIMIT.as_secs()),
            )),
        }
    }
}

/// `getaddrinfo(host, port)` for stream sockets: the addresses, none for a name that does not
/// exist or has none (`EAI_NONAME`, `EAI_NODATA`), or the failure.
fn lookup(host: &str, port: &str) -> std::io::Result<Vec<SocketAddr>> {
    use dns_lookup::{AddrInfoHints, LookupErrorKind};

    let hints = AddrInfoHints {
        socktype: libc::SOCK_STREAM,
        ..AddrInfoHints::default()
    };
    match dns_lookup::getaddrinfo(Some(host), Some(port), Some(hints)) {
        Ok(answers) => answers
            .map(|a| a.map(|a| a.sockaddr))
            .collect::<std::io::Result<Vec<_>>>(),
        Err(e) if matches!(e.kind(), LookupErrorKind::NoName | LookupErrorKind::NoData) => {
            Ok(Vec::new())
        }
        Err(e) => Err(e.into()),
    }
}

/// A group's members now, or why they could not be found. An empty list is an error too: a
/// group with no worker serves nothing (a name that does not exist is such a group).
pub async fn resolve_group(
    group: &WorkerGroup,
    resolver: &impl Resolve,
) -> Result<Vec<WorkerConfig>, String> {
    match resolver.resolve(&group.dns).await {
        Ok(addrs) if addrs.is_empty() => Err(format!("{} resolves to no address", group.dns)),
        Ok(addrs) => Ok(members(group, &addrs)),
        Err(e) => Err(format!("cannot resolve {}: {e}", group.dns)),
    }
}

/// Resolves every group once and hands its members to `workers`. A failed lookup keeps the
/// members the group had (their health decides whether they are routed to); a name that
/// resolves to nothing, or no longer exists, leaves the group empty (a pod IP it held may be
/// another pod's next).
pub async fn sync(workers: &Workers, groups: &[WorkerGroup], resolver: &impl Resolve) {
    for group in groups {
        match resolver.resolve(&group.dns).await {
            Ok(addrs) => {
                workers.set_members(&group.name, members(group, &addrs));
                workers.looked_up(&group.name, &group.dns, Ok(()));
            }
            Err(error) => {
                tracing::warn!(group = %group.name, dns = %group.dns, %error,
                    "cannot resolve a worker group; keeping its last members");
                workers.looked_up(&group.name, &group.dns, Err(error.to_string()));
            }
        }
    }
}

/// Re-resolves every group every `interval` (then refreshes the workers, so new members are
/// routable at once) until the returned handle is aborted.
pub fn spawn_sync<R: Resolve>(
    workers: &Workers,
    groups: Vec<WorkerGroup>,
    resolver: R,
    interval: Duration,
) -> tokio::task::JoinHandle<()> {
    let workers = workers.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            let before = workers.names();
            sync(&workers, &groups, &resolver).await;
            if workers.names() != before {
                workers.refresh().await;
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Mutex;

    use super::*;

    fn group(role: WorkerRole, prefill: Option<&str>) -> WorkerGroup {
        WorkerGroup {
            name: "decode".into(),
            dns: "bulkhead-decode.ns.svc.cluster.local:50051".into(),
            role,
            prefill: prefill.map(Into::into),
        }
    }

    fn addr(s: &str) -> SocketAddr {
        s.parse().expect("an address")
    }

    /// Answers from a table; names it does not know fail like an unreachable server.
    #[derive(Default)]
    struct FakeResolver(Mutex<HashMap<String, Vec<SocketAddr>>>);

    impl FakeResolver {
        fn set(&self, name: &str, addrs: &[&str]) {
            if let Ok(mut t) = self.0.lock() {
                t.insert(name.into(), addrs.iter().map(|a| addr(a)).collect());
            }
        }

        fn forget(&self, name: &str) {
            if let Ok(mut t) = self.0.lock() {
                t.remove(name);
            }
        }
    }

    impl Resolve for FakeResolver {
        async fn resolve(&self, target: &str) -> std::io::Result<Vec<SocketAddr>> {
            let table = self.0.lock().map_err(|_| std::io::ErrorKind::Other)?;
            table
                .get(target)
                .cloned()
                .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer"))
        }
    }

    #[test]
    fn every_distinct_address_is_one_member_named_after_its_group() {
        let g = group(WorkerRole::Decode, Some("prefill"));
        let m = members(
            &g,
            &[
                addr("10.0.0.7:50051"),
                addr("10.0.0.5:50051"),
                addr("10.0.0.7:50051"),
                addr("[fd00::1]:50051"),
            ],
        );
        let names: Vec<&str> = m.iter().map(|w| w.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "decode@10.0.0.5:50051",
                "decode@10.0.0.7:50051",
                "decode@[fd00::1]:50051"
            ]
        );
        assert_eq!(m[2].endpoint, "http://[fd00::1]:50051");
        assert!(m.iter().all(|w| w.role == WorkerRole::Decode
            && w.prefill.as_deref() == Some("prefill")
            && w.answers_to("decode")
            && !w.answers_to("prefill")));
        // Every member is a valid gRPC endpoint for the gateway.
        assert!(m.iter().all(
            |w| crate::config::worker_endpoint(&w.endpoint, &w.protocol).as_ref()
                == Some(&w.endpoint)
        ));
    }

    #[test]
    fn dns_targets_need_a_host_and_a_port() {
        assert_eq!(dns_target("svc.ns:50051"), Some(("svc.ns", 50051)));
        assert_eq!(dns_target("localhost:1"), Some(("localhost", 1)));
        assert_eq!(dns_target("[fd00::1]:50051"), Some(("fd00::1", 50051)));
        for bad in [
            "svc:50051:50051",
            "fd00::1:50051",
            "[svc]:50051",
            "svc.ns",
            ":50051",
            "http://svc:50051",
            "svc:0",
            "svc:99999",
            "svc:port",
            "",
        ] {
            assert_eq!(dns_target(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn bad_group_fields_are_refused_with_the_group_named() {
        let raw = |name: &str, dns: &str| RawWorkerGroup {
            name: name.into(),
            dns: dns.into(),
            role: WorkerRole::Prefill,
            prefill: None,
        };
        let err = raw("p", "http://x:1").validate().expect_err("a URL");
        assert!(err.to_string().contains("\"p\""), "{err}");
        assert!(matches!(
            raw("a b", "x:1").validate(),
            Err(GroupError::Name { .. })
        ));
        assert!(matches!(
            raw("a@b", "x:1").validate(),
            Err(GroupError::Name { .. })
        ));
        assert!(raw("prefill", "x:1").validate().is_ok());
    }

    #[tokio::test]
    async fn an_empty_or_failed_lookup_is_an_error_for_preflight() {
        let g = group(WorkerRole::Both, None);
        let r = FakeResolver::default();
        let err = resolve_group(&g, &r).await.expect_err("unknown name");
        assert!(err.contains("cannot resolve"), "{err}");
        r.set(&g.dns, &[]);
        let err = resolve_group(&g, &r).await.expect_err("no address");
        assert!(err.contains("no address"), "{err}");
        r.set(&g.dns, &["127.0.0.1:1", "127.0.0.2:1"]);
        assert_eq!(resolve_group(&g, &r).await.map(|m| m.len()), Ok(2));
    }

    #[tokio::test]
    async fn members_follow_the_dns_answers_and_survive_a_failed_lookup() {
        let g = group(WorkerRole::Both, None);
        let workers =
            Workers::new(&[], crate::config::ClusterAccess::default()).expect("no static workers");
        let r = FakeResolver::default();
        r.set(&g.dns, &["127.0.0.1:1", "127.0.0.2:1"]);
        sync(&workers, std::slice::from_ref(&g), &r).await;
        assert_eq!(
            workers.names(),
            ["decode@127.0.0.1:1", "decode@127.0.0.2:1"]
        );
        // A pod goes, another comes.
        r.set(&g.dns, &["127.0.0.2:1", "127.0.0.3:1"]);
        sync(&workers, std::slice::from_ref(&g), &r).await;
        assert_eq!(
            workers.names(),
            ["decode@127.0.0.2:1", "decode@127.0.0.3:1"]
        );
        assert_eq!(workers.lookups()["decode"].members, 2);
        assert_eq!(workers.lookups()["decode"].error, None);
        // The DNS server is unreachable: keep what we had, and say so.
        r.forget(&g.dns);
        sync(&workers, std::slice::from_ref(&g), &r).await;
        assert_eq!(workers.names().len(), 2);
        let lookup = &workers.lookups()["decode"];
        assert_eq!(lookup.members, 2, "kept");
        assert_eq!(lookup.error.as_deref(), Some("no answer"));
        let since = lookup.failing_since_unix_secs.expect("failing");
        sync(&workers, std::slice::from_ref(&g), &r).await;
        assert_eq!(
            workers.lookups()["decode"].failing_since_unix_secs,
            Some(since),
            "failing since the first failure"
        );
        // Scaled to zero.
        r.set(&g.dns, &[]);
        sync(&workers, std::slice::from_ref(&g), &r).await;
        assert!(workers.names().is_empty());
        let lookup = &workers.lookups()["decode"];
        assert_eq!((lookup.members, &lookup.error), (0, &None));
        assert_eq!(lookup.failing_since_unix_secs, None);
    }

    #[test]
    fn the_kubernetes_config_parses_into_two_groups() {
        let c = crate::Config::parse(include_str!("../../deploy/k8s/base/gateway.toml"))
            .expect("deploy/k8s/base/gateway.toml is a valid configuration");
        assert!(c.workers.is_empty(), "no address lists on Kubernetes");
        let groups: Vec<(&str, WorkerRole, Option<&str>)> = c
            .worker_groups
            .iter()
            .map(|g| (g.name.as_str(), g.role, g.prefill.as_deref()))
            .collect();
        assert_eq!(
            groups,
            [
                ("prefill", WorkerRole::Prefill, None),
                ("decode", WorkerRole::Decode, Some("prefill"))
            ]
        );
    }

    #[tokio::test]
    async fn the_system_resolver_answers_none_for_a_name_that_does_not_exist() {
        // `.invalid` never resolves (RFC 6761): NXDOMAIN from any resolver that answers (this
        // machine's does; one with no reachable DNS server at all reports EAI_AGAIN instead, a
        // failed lookup, and this test with it).
        let answer = SystemResolver
            .resolve("bulkhead-no-such-name.invalid:50051")
            .await;
        assert!(
            matches!(&answer, Ok(a) if a.is_empty()),
            "an unknown name is an empty answer: {answer:?}"
        );
        let answer = SystemResolver.resolve("[::1]:50051").await;
        assert!(
            matches!(&answer, Ok(a) if a == &[addr("[::1]:50051")]),
            "{answer:?}"
        );
    }

    #[tokio::test]
    async fn the_system_resolver_finds_localhost() {
        let addrs = SystemResolver
            .resolve("localhost:50051")
            .await
            .expect("localhost resolves");
        assert!(!addrs.is_empty());
        assert!(
            addrs
                .iter()
                .all(|a| a.ip().is_loopback() && a.port() == 50051)
        );
    }
}
