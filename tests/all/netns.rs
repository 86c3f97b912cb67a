//! Network faults between prefill and decode: each worker in a network namespace of its own,
//! the two joined by a veth pair that the tests impair, and each namespace reachable from the
//! test through a veth of its own (never impaired).
//!
//! ```text
//!   test (root namespace)
//!     │ 10.X.Y.5/30 ─ 10.X.Y.6          │ 10.X.Y.9/30 ─ 10.X.Y.10
//!     ▼                                 ▼
//!   [prefill ns] pd 10.X.Y.1/30 ═══ dp 10.X.Y.2/30 [decode ns]    ═══ impaired (tc, link down)
//! ```
//!
//! Impairments use `tc qdisc … netem` (delay, jitter, loss, reordering) where the kernel has
//! it; a kernel without `sch_netem` gets a token-bucket rate limit instead, and the test says
//! on stderr, loudly, what it could not test. Where namespaces cannot be made at all (not
//! root, no `ip`), each test prints why and passes as skipped.

use std::net::{IpAddr, Ipv4Addr};
use std::process::Command;
use std::time::{Duration, Instant};

use bulkhead_worker::serve::proto::error_code;

use crate::cluster::Placement;
use crate::worker_grpc::{
    Place, Worker, available, bounded, chat, metric, metric_sum, run_to_end, text_of,
    wait_all_pages_back,
};

/// Two namespaces joined by an impairable veth pair; removed (with their links) on drop.
struct Net {
    prefill_ns: String,
    decode_ns: String,
    /// 10.X.Y.0: three /30 links in it.
    base: [u8; 3],
}

fn run(program: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| format!("{program}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`{program} {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// What the link between the workers does to packets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Impairment {
    /// netem: delay with jitter, loss, reordering.
    Netem,
    /// No netem in this kernel: a rate limit (pacing and queueing delay) only.
    RateLimit,
}

impl Net {
    /// Makes the namespaces and links, or says why it cannot.
    fn create() -> Result<Net, String> {
        let id = std::process::id();
        let base = [10, 100 + ((id >> 8) % 100) as u8, (id & 0xff) as u8];
        let net = Net {
            prefill_ns: format!("bhp{id}"),
            decode_ns: format!("bhd{id}"),
            base,
        };
        run("ip", &["netns", "add", &net.prefill_ns])?;
        // From here on, `Drop` cleans up whatever was made.
        run("ip", &["netns", "add", &net.decode_ns])?;
        let (p, d) = (net.prefill_ns.as_str(), net.decode_ns.as_str());
        let root_p = format!("bhr{id}p");
        let root_d = format!("bhr{id}d");
        run(
            "ip",
            &[
                "link", "add", "pd", "netns", p, "type", "veth", "peer", "name", "dp", "netns", d,
            ],
        )?;
        run(
            "ip",
            &[
                "link", "add", &root_p, "type", "veth", "peer", "name", "rp", "netns", p,
            ],
        )?;
        run(
            "ip",
            &[
                "link", "add", &root_d, "type", "veth", "peer", "name", "rd", "netns", d,
            ],
        )?;
        let addr = |last: u8| format!("{}/30", net.ip(last));
        for (ns, dev, ip) in [
            (Some(p), "pd", addr(1)),
            (Some(d), "dp", addr(2)),
            (None, root_p.as_str(), addr(5)),
            (Some(p), "rp", addr(6)),
            (None, root_d.as_str(), addr(9)),
            (Some(d), "rd", addr(10)),
        ] {
            let mut args: Vec<&str> = Vec::new();
            if let Some(ns) = ns {
                args.extend(["-n", ns]);
            }
            run(
                "ip",
                &[&args[..], &["addr", "add", &ip, "dev", dev]].concat(),
            )?;
            run("ip", &[&args[..], &["link", "set", dev, "up"]].concat())?;
        }
        run("ip", &["-n", p, "link", "set", "lo", "up"])?;
        run("ip", &["-n", d, "link", "set", "lo", "up"])?;
        Ok(net)
    }

    fn ip(&self, last: u8) -> Ipv4Addr {
        Ipv4Addr::new(self.base[0], self.base[1], self.base[2], last)
    }

    fn prefill_place(&self) -> Place<'_> {
        Place {
            netns: Some(&self.prefill_ns),
            bind: "0.0.0.0",
            reach: IpAddr::V4(self.ip(6)),
        }
    }

    fn decode_place(&self) -> Place<'_> {
        Place {
            netns: Some(&self.decode_ns),
            bind: "0.0.0.0",
            reach: IpAddr::V4(self.ip(10)),
        }
    }

    /// Both ends of the workers' link, as (namespace, device).
    fn link(&self) -> [(&str, &str); 2] {
        [(&self.prefill_ns, "pd"), (&self.decode_ns, "dp")]
    }

    /// Impairs both directions of the workers' link.
    fn impair(&self) -> Impairment {
        let netem = [
            "delay", "15ms", "5ms", "reorder", "10%", "50%", "loss", "1%",
        ];
        let with_netem = self.link().iter().try_for_each(|(ns, dev)| {
            run(
                "ip",
                &[
                    &[
                        "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "netem",
                    ][..],
                    &netem,
                ]
                .concat(),
            )
        });
        match with_netem {
            Ok(()) => Impairment::Netem,
            Err(e) => {
                eprintln!(
                    "\n*** NETEM UNAVAILABLE ({e}).\n*** Delay, jitter, loss and reordering are NOT \
                     tested on this machine; the link gets a token-bucket rate limit instead.\n"
                );
                self.limit_rate();
                Impairment::RateLimit
            }
        }
    }

    /// Limits both directions of the workers' link to 40 Mbit/s (token bucket).
    fn limit_rate(&self) {
        for (ns, dev) in self.link() {
            run(
                "ip",
                &[
                    "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                    "rate", "40mbit", "burst", "32kb", "latency", "400ms",
                ],
            )
            .expect("tbf is available");
        }
    }

    /// Takes the workers' link down (a partition: packets vanish, nothing is reset) or up.
    fn set_link(&self, up: bool) {
        for (ns, dev) in self.link() {
            let state = if up { "up" } else { "down" };
            run("ip", &["-n", ns, "link", "set", dev, state]).expect("link state changes");
        }
    }

    /// A prefill worker in its namespace and a decode worker in its own, wired over the link.
    fn pair(&self, prefill_args: &[&str], decode_args: &[&str]) -> (Worker, Worker) {
        let mut args = vec!["--role", "prefill", "--kv-tokens", "2048"];
        args.extend_from_slice(prefill_args);
        let prefill = Worker::start_in(&self.prefill_place(), &args);
        let address = format!("http://{}:{}", self.ip(1), prefill.grpc.port());
        let kv = format!("{}:0", self.ip(2));
        let mut args = vec![
            "--role",
            "decode",
            "--prefill",
            &address,
            "--kv-listen",
            &kv,
            "--kv-tokens",
            "2048",
        ];
        args.extend_from_slice(decode_args);
        let decode = Worker::start_in(&self.decode_place(), &args);
        (prefill, decode)
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        // Deleting a namespace deletes its veth ends, and with them their peers.
        for ns in [&self.prefill_ns, &self.decode_ns] {
            let _ = run("ip", &["netns", "del", ns]);
        }
    }
}

/// Set to 1 where these tests must run (`scripts/test`, which installs iproute2 and runs as
/// root): there a namespace that cannot be made fails the test instead of skipping it.
const REQUIRE_ENV: &str = "BULKHEAD_REQUIRE_NETNS";

/// The namespaces, or `None` after saying loudly why these tests cannot run here (a failure
/// with [`REQUIRE_ENV`] set).
fn net_or_skip(test: &str) -> Option<Net> {
    match Net::create() {
        Ok(net) => Some(net),
        Err(e) if std::env::var(REQUIRE_ENV).is_ok_and(|v| v == "1") => {
            panic!(
                "{test}: network namespaces are required ({REQUIRE_ENV}=1) and not available: {e}"
            )
        }
        Err(e) => {
            eprintln!(
                "\n*** SKIPPED {test}: network namespaces are not available here ({e}).\n\
                 *** These tests need root and iproute2.\n"
            );
            None
        }
    }
}

/// Both workers have every page back and nothing quarantined (bounded wait).
async fn pools_at_baseline(prefill: &Worker, decode: &Worker) {
    for w in [prefill, decode] {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let p = wait_all_pages_back(w).await;
            if available(&p) == p.total && p.quarantined == 0 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the pool did not return to baseline: {p:?}\n{}",
                w.metrics()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

#[tokio::test]
async fn over_an_impaired_link_between_namespaces_the_answer_is_unchanged() {
    let Some(net) = net_or_skip("over_an_impaired_link_between_namespaces_the_answer_is_unchanged")
    else {
        return;
    };
    bounded(async {
        let (prefill, decode) = net.pair(&[], &[]);
        let request = chat("What is 2+2?", 24);
        let clean = run_to_end(&mut decode.client().await, request.clone())
            .await
            .expect("an answer over the clean link");
        assert!(clean.0.contains('4'), "{clean:?}");
        let impairment = net.impair();
        for _ in 0..3 {
            let start = Instant::now();
            let impaired = run_to_end(&mut decode.client().await, request.clone())
                .await
                .unwrap_or_else(|e| {
                    panic!(
                        "an answer over the {impairment:?} link: {e:?}\ndecode:\n{}\nprefill:\n{}",
                        text_of(&decode.stderr),
                        text_of(&prefill.stderr)
                    )
                });
            assert_eq!(
                impaired, clean,
                "the link changed the answer ({impairment:?})"
            );
            assert!(start.elapsed() < Duration::from_secs(60));
        }
        pools_at_baseline(&prefill, &decode).await;
        let m = decode.metrics();
        assert_eq!(
            metric_sum(&m, "bulkhead_kv_frames_dropped_total"),
            0.0,
            "{m}"
        );
        assert_eq!(
            metric(&m, "bulkhead_kv_integrity_failures_total"),
            0.0,
            "{m}"
        );
    })
    .await;
}

#[tokio::test]
async fn a_partition_fails_the_request_within_its_deadline_and_the_pools_recover_before_it_heals() {
    let Some(net) = net_or_skip(
        "a_partition_fails_the_request_within_its_deadline_and_the_pools_recover_before_it_heals",
    ) else {
        return;
    };
    bounded(async {
        let (prefill, decode) = net.pair(
            &[],
            &[
                "--transfer-timeout-ms",
                "3000",
                "--release-timeout-ms",
                "1000",
                "--reclaim-after-ms",
                "300",
            ],
        );
        let request = chat("What is 2+2?", 8);
        // Connections are up before the partition, as in a serving pair.
        let before = run_to_end(&mut decode.client().await, request.clone())
            .await
            .expect("an answer before the partition");

        net.set_link(false);
        let start = Instant::now();
        let err = run_to_end(&mut decode.client().await, request.clone())
            .await
            .expect_err("nothing crosses a partition");
        let took = start.elapsed();
        assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
        assert_eq!(error_code(&err), Some("service_unavailable"), "{err:?}");
        assert!(
            took < Duration::from_secs(10),
            "a 3 s transfer deadline failed after {took:?}"
        );

        // The pages come back while the partition lasts: it may never heal.
        pools_at_baseline(&prefill, &decode).await;
        net.set_link(true);
        let m = decode.metrics();
        assert!(
            metric(&m, "bulkhead_kv_abort_ack_seconds_count")
                + metric(&m, "bulkhead_kv_reclaimed_pages_total")
                + metric(&m, "bulkhead_kv_teardown_drains_total")
                > 0.0,
            "the pages came back through an acknowledgement, a reclaim or a teardown: {m}"
        );
        // And the healed pair serves again.
        let again = run_to_end(&mut decode.client().await, request)
            .await
            .expect("an answer after the partition healed");
        assert_eq!(again, before);
    })
    .await;
}

#[tokio::test]
async fn a_peer_lost_mid_transfer_for_good_gives_both_workers_their_pages_back() {
    let Some(net) =
        net_or_skip("a_peer_lost_mid_transfer_for_good_gives_both_workers_their_pages_back")
    else {
        return;
    };
    bounded(async {
        // A dead host or a partition that never heals: no reset ever comes. Each end must
        // learn that its peer is gone from the silence alone (`--kv-peer-timeout-ms`).
        let peer_timeout = ["--kv-peer-timeout-ms", "2000"];
        let mut decode_args = vec![
            "--release-timeout-ms",
            "500",
            "--reclaim-after-ms",
            "300",
            // The transfer takes seconds on the slowed link: no deadline ends it first.
            "--transfer-floor",
            "100KB",
        ];
        decode_args.extend_from_slice(&peer_timeout);
        let (prefill, decode) = net.pair(&peer_timeout, &decode_args);
        net.limit_rate();
        let mut client = decode.client().await;
        // About 600 prompt tokens: tens of megabytes of KV, several seconds at 40 Mbit/s.
        let long = "The harbour town keeps every record in order. ".repeat(60);
        let request = tokio::spawn(async move { run_to_end(&mut client, chat(&long, 8)).await });
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let m = decode.metrics();
            if metric(&m, "bulkhead_kv_frames_written_total") >= 2.0 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the transfer never started:\n{m}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        net.set_link(false);
        let lost = Instant::now();
        let err = tokio::time::timeout(Duration::from_secs(30), request)
            .await
            .expect("the request fails within 30 s of the loss")
            .expect("the request's task")
            .expect_err("the transfer cannot complete");
        assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
        // Both pools recover while the link stays down: decode's pages once its data
        // connection is known dead, prefill's once its blocked write times out.
        pools_at_baseline(&prefill, &decode).await;
        assert!(
            lost.elapsed() < Duration::from_secs(30),
            "recovered {:?} after the loss",
            lost.elapsed()
        );
        let p = prefill.metrics();
        assert_eq!(
            metric(&p, "bulkhead_kv_transfers_in_flight{side=\"send\"}"),
            0.0,
            "{p}"
        );
    })
    .await;
}

/// The isolation suite's incident (crate::isolation) with the prefill worker and the decode
/// worker each in its namespace, the link between them impaired, the gateway in the test's
/// namespace: the over-pool prompts are refused, the other tenants' KV crosses the impaired
/// link, and no oracle finds anything.
#[test]
fn across_namespaces_over_an_impaired_link_the_incident_is_refused_and_nothing_leaks() {
    crate::up::bounded(|| {
        let Some(net) = net_or_skip(
            "across_namespaces_over_an_impaired_link_the_incident_is_refused_and_nothing_leaks",
        ) else {
            return;
        };
        let impairment = net.impair();
        eprintln!("the workers' link: {impairment:?}");
        let (prefill, decode) = (net.prefill_place(), net.decode_place());
        crate::isolation::the_incident_at(Some(Placement {
            prefill: &prefill,
            decode: &decode,
            prefill_from_decode: IpAddr::V4(net.ip(1)),
            decode_kv: IpAddr::V4(net.ip(2)),
        }));
    });
}

/// Mutual TLS across hosts: the workers each in a namespace, the gateway in the test's, every
/// process with a certificate from one CA naming the namespaces' addresses. A request is
/// served through all three hops — gateway → decode and decode → prefill over gRPC with TLS,
/// the KV from prefill to decode over the TLS data plane, across the workers' link — and its
/// frames are written on decode.
#[test]
fn across_namespaces_every_hop_is_mutual_tls_and_serves() {
    use bulkhead_worker::serve::tls::Authority;
    crate::up::bounded(|| {
        let Some(net) = net_or_skip("across_namespaces_every_hop_is_mutual_tls_and_serves") else {
            return;
        };
        let dir = crate::up::TempDir::new("netns-tls");
        // One certificate for every process: the addresses each is reached at.
        let names: Vec<String> = [1, 2, 6, 10]
            .map(|last| net.ip(last).to_string())
            .into_iter()
            .chain(["127.0.0.1".to_owned()])
            .collect();
        let files = Authority::new("netns CA")
            .expect("a CA")
            .write(&dir.0, "cluster", &names)
            .expect("writes");
        let shown = |p: &std::path::Path| p.display().to_string();
        let (ca, cert, key) = (shown(&files.ca), shown(&files.cert), shown(&files.key));
        let env = [
            ("BULKHEAD_TLS_CA", ca.as_str()),
            ("BULKHEAD_TLS_CERT", cert.as_str()),
            ("BULKHEAD_TLS_KEY", key.as_str()),
        ];
        let toml = format!("[cluster]\ntls_ca = {ca:?}\ntls_cert = {cert:?}\ntls_key = {key:?}\n");
        let (prefill, decode) = (net.prefill_place(), net.decode_place());
        let cluster = crate::cluster::Cluster::start(crate::cluster::Spec {
            env: &env,
            toml: &toml,
            placement: Some(Placement {
                prefill: &prefill,
                decode: &decode,
                prefill_from_decode: IpAddr::V4(net.ip(1)),
                decode_kv: IpAddr::V4(net.ip(2)),
            }),
            ..crate::cluster::Spec::default()
        });
        let body = crate::isolation::completion("The harbour woke before the town did.", 8, false);
        let (status, answer) = crate::up::http(
            cluster.api(),
            "POST",
            "/v1/completions",
            Some(crate::up::KEY_B),
            &[],
            &body,
        );
        assert_eq!(status, 200, "{answer}");
        let written = metric(
            &cluster.decode.metrics(),
            "bulkhead_kv_frames_written_total",
        );
        assert!(written > 0.0, "the KV crossed the link: {written}");
        // Each worker shows when the certificate it presents lapses.
        let expiry = bulkhead_worker::serve::ClusterTls::load(&files)
            .expect("loads")
            .validity()
            .not_after;
        assert_eq!(
            metric(
                &cluster.decode.metrics(),
                "bulkhead_tls_certificate_expiry_timestamp_seconds{certificate=\"cluster\"}"
            ),
            expiry as f64
        );
    });
}
