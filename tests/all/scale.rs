//! Scale on one machine: the Kubernetes shape (a gateway in front of 2 prefill + 2 decode
//! workers, each its own process) on loopback. Half of the workers are found through DNS
//! (`[[worker_groups]]` naming `localhost:PORT`, resolved like a headless Service's name), half are
//! listed, so both paths carry traffic. Mixed traffic from three tenants spreads over both
//! decode workers; preflight covers all four workers; killing one decode worker moves the
//! traffic to the other, and no tenant ever receives another tenant's canary.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::cluster::{Gateway, preflight};
use crate::up::{ADMIN, TempDir, bounded, http, metric, sha256_hex};
use crate::worker_grpc::Worker;

/// (tenant, key, canary): each tenant's prompts carry its own canary string.
const TENANTS: [(&str, &str, &str); 3] = [
    ("tenant-a", "sk-scale-a", "CANARY-ALPHA-7F3A"),
    ("tenant-b", "sk-scale-b", "CANARY-BRAVO-91C2"),
    ("tenant-c", "sk-scale-c", "CANARY-CHARLIE-5E0D"),
];

/// The gateway's configuration: the prefill and decode groups found through DNS (`localhost`
/// resolves to the first pair's loopback address), the second pair listed.
fn config(path: &Path, prefill_dns: &str, decode_dns: &str, prefill_b: &str, decode_b: &str) {
    let mut text = format!(
        "worker_refresh_secs = 1\n\
         [listen]\napi = \"127.0.0.1:0\"\nadmin = \"127.0.0.1:0\"\n\
         [admin]\ntoken_sha256 = \"{}\"\n",
        sha256_hex(ADMIN)
    );
    for (id, key, _) in TENANTS {
        text.push_str(&format!(
            "[[tenants]]\nid = \"{id}\"\nkey_sha256 = [\"{}\"]\nmax_context = 8192\n\
             max_concurrent = 8\nrequests_per_minute = 600\ntokens_per_minute = 1000000\n",
            sha256_hex(key)
        ));
    }
    text.push_str(&format!(
        "[[worker_groups]]\nname = \"prefill\"\ndns = \"{prefill_dns}\"\nrole = \"prefill\"\n\
         [[worker_groups]]\nname = \"decode\"\ndns = \"{decode_dns}\"\nrole = \"decode\"\n\
         prefill = \"prefill\"\n\
         [[workers]]\nname = \"prefill-b\"\ngrpc = \"{prefill_b}\"\nrole = \"prefill\"\n\
         [[workers]]\nname = \"decode-b\"\ngrpc = \"{decode_b}\"\nrole = \"decode\"\n\
         prefill = \"prefill-b\"\n"
    ));
    std::fs::write(path, &text).expect("writes the config");
}

/// Requests served to the end on a worker (stop or length), from its `/metrics`.
fn served(worker: &Worker) -> u64 {
    let (status, text) = worker.admin_get("/metrics");
    assert!(status.contains("200"), "{status}");
    metric(&text, "bulkhead_requests_total{outcome=\"stop\"}")
        + metric(&text, "bulkhead_requests_total{outcome=\"length\"}")
}

/// Waits (bounded) until the decode workers together have served `total` requests (a worker
/// counts a request as it ends, which may be a moment after the client's last byte); returns
/// each one's count.
fn wait_served(workers: &[&Worker], total: u64) -> Vec<u64> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let counts: Vec<u64> = workers.iter().map(|w| served(w)).collect();
        if counts.iter().sum::<u64>() >= total || Instant::now() > deadline {
            return counts;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// One request of tenant `t` (the `round`-th): chat, streamed chat or a completion in turn.
/// Returns the status and the whole body.
fn ask(api: &str, t: usize, round: usize) -> (u16, String) {
    let (_, key, canary) = TENANTS[t];
    let (path, body) = match (t + round) % 3 {
        0 => (
            "/v1/chat/completions",
            format!(
                r#"{{"messages":[{{"role":"user","content":"Repeat this code word: {canary}"}}],"max_tokens":8,"temperature":0}}"#
            ),
        ),
        1 => (
            "/v1/chat/completions",
            format!(
                r#"{{"messages":[{{"role":"user","content":"Say {canary} twice."}}],"max_tokens":8,"temperature":0,"stream":true}}"#
            ),
        ),
        _ => (
            "/v1/completions",
            format!(
                r#"{{"prompt":"The code word is {canary}. The code word is","max_tokens":8,"temperature":0}}"#
            ),
        ),
    };
    http(api, "POST", path, Some(key), &[], &body)
}

/// Every tenant sends `rounds` requests, the tenants concurrently; every answer must be a 200
/// that carries no other tenant's canary.
fn traffic(api: &str, rounds: usize) {
    let results: Vec<(usize, u16, String)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..TENANTS.len())
            .map(|t| {
                s.spawn(move || {
                    (0..rounds)
                        .map(|round| {
                            let (status, body) = ask(api, t, round);
                            (t, status, body)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("a tenant's thread"))
            .collect()
    });
    for (t, status, body) in &results {
        assert_eq!(*status, 200, "{}: {body}", TENANTS[*t].0);
        for (o, (other, _, canary)) in TENANTS.iter().enumerate() {
            assert!(
                o == *t || !body.contains(canary),
                "{}'s answer carries {other}'s canary: {body}",
                TENANTS[*t].0
            );
        }
    }
}

/// A DNS name for the loopback workers: `localhost` where it resolves to 127.0.0.1 alone (a
/// `::1` record would name a worker that is not listening there); the address itself, which
/// goes through the same resolver, elsewhere.
fn loopback_name() -> &'static str {
    use std::net::ToSocketAddrs;
    let v4_only = ("localhost", 1)
        .to_socket_addrs()
        .map(|a| a.map(|a| a.ip().to_string()).collect::<Vec<_>>())
        .is_ok_and(|ips| ips == ["127.0.0.1"]);
    if v4_only { "localhost" } else { "127.0.0.1" }
}

#[test]
fn two_prefill_and_two_decode_workers_share_the_load_and_survive_a_lost_decode_worker() {
    bounded(|| {
        let pool = ["--kv-tokens", "2048"];
        let (prefill_a, prefill_b) = std::thread::scope(|s| {
            let a = s.spawn(|| Worker::start(&[&["--role", "prefill"], &pool[..]].concat()));
            let b = s.spawn(|| Worker::start(&[&["--role", "prefill"], &pool[..]].concat()));
            (a.join().expect("prefill a"), b.join().expect("prefill b"))
        });
        let decode = |prefill: &Worker| {
            let uri = format!("http://{}", prefill.grpc);
            let args = [
                &["--role", "decode", "--prefill", &uri][..],
                &["--kv-listen", "127.0.0.1:0"],
                &pool,
            ]
            .concat();
            Worker::start(&args)
        };
        let (decode_a, mut decode_b) = std::thread::scope(|s| {
            let a = s.spawn(|| decode(&prefill_a));
            let b = s.spawn(|| decode(&prefill_b));
            (a.join().expect("decode a"), b.join().expect("decode b"))
        });

        // Every worker's readiness (the Kubernetes probe): its pool holds its served context.
        for w in [&prefill_a, &prefill_b, &decode_a, &decode_b] {
            let (status, body) = w.admin_get("/readyz");
            assert!(status.contains("200"), "{status}: {body}");
            assert!(body.starts_with("ready: "), "{body}");
        }

        let dir = TempDir::new("scale");
        let config_path = dir.0.join("gateway.toml");
        config(
            &config_path,
            &format!("{}:{}", loopback_name(), prefill_a.grpc.port()),
            &format!("{}:{}", loopback_name(), decode_a.grpc.port()),
            &prefill_b.grpc.to_string(),
            &decode_b.grpc.to_string(),
        );
        let member_a = format!("decode@{}", decode_a.grpc);
        let member_prefill_a = format!("prefill@{}", prefill_a.grpc);

        // The deployment check covers all four workers, the DNS-found ones by their members'
        // names, and both decode/prefill pairs.
        let (passed, report) = preflight(&config_path);
        assert!(passed, "{report}");
        for name in [&member_a, &member_prefill_a, "decode-b", "prefill-b"] {
            assert!(
                report.contains(&format!("PASS {name}")),
                "{name}:\n{report}"
            );
        }
        assert!(
            report.contains(&format!("{member_a} ↔ {member_prefill_a}"))
                && report.contains("decode-b ↔ prefill-b"),
            "{report}"
        );

        let gateway = Gateway::start(&config_path, &dir.0.join("data"), &[]);
        gateway.wait_until(&[(&member_a, true), ("decode-b", true)]);

        // Mixed traffic from three tenants at once spreads over both decode workers.
        // (Preflight and the gateway's refreshes serve no request: the counts start at 0.)
        traffic(&gateway.api, 3);
        let counts = wait_served(&[&decode_a, &decode_b], 9);
        assert_eq!(counts.iter().sum::<u64>(), 9, "{counts:?}");
        assert!(
            counts.iter().all(|&n| n > 0),
            "both decode workers serve: {counts:?}"
        );

        // One decode worker dies: the gateway stops routing to it, every later request is
        // served by the other, and still no canary crosses tenants.
        let _ = decode_b.child.kill();
        let _ = decode_b.child.wait();
        gateway.wait_until(&[(&member_a, true), ("decode-b", false)]);
        traffic(&gateway.api, 2);
        assert_eq!(wait_served(&[&decode_a], counts[0] + 6), [counts[0] + 6]);

        // And the deployment check now fails, naming the lost worker.
        let (passed, report) = preflight(&config_path);
        assert!(!passed, "{report}");
        assert!(report.contains("FAIL decode-b"), "{report}");
    });
}
