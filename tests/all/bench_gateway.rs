//! `bulkhead bench gateway` in a tiny configuration (1 s windows, 2 connections, the Bulkhead
//! targets, the pass-through floor and the baseline only; nginx and LiteLLM are left out so CI
//! needs neither): the report has every field and every target answered requests, streamed
//! and not.

use std::process::{Command, Stdio};

use serde_json::Value;

use crate::up::{bounded, json, repo};

/// Runs the bench on `targets` with `extra` flags; its JSON report. LiteLLM is looked for
/// where it is not, as on a machine without it.
fn bench(targets: &str, extra: &[&str]) -> Value {
    let output = Command::new(env!("CARGO_BIN_EXE_bulkhead"))
        .args(["bench", "gateway", "--runs", "1", "--connections", "2"])
        .args([
            "--seconds",
            "1",
            "--warmup-seconds",
            "0.2",
            "--targets",
            targets,
        ])
        .args(extra)
        .env("BULKHEAD_LITELLM_VENV", "/nonexistent/venv")
        .current_dir(repo())
        .stdin(Stdio::null())
        .output()
        .expect("the bulkhead binary runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "bench gateway failed:\n{stderr}");
    assert!(
        stderr.contains("req/s ÷ nginx"),
        "the table is on stderr:\n{stderr}"
    );
    json(&String::from_utf8_lossy(&output.stdout))
}

fn assert_answered(report: &Value, key: &str) {
    let t = &report["targets"][key];
    assert!(t["rps"].as_f64() > Some(0.0), "{key}: {t}");
    assert!(t["requests"].as_u64() > Some(0), "{key}: {t}");
    assert_eq!(t["errors"], 0, "{key}: {t}");
    for field in ["p50_us", "p99_us", "added_p50_us", "added_p99_us"] {
        assert!(t[field].is_f64(), "{key}.{field}: {t}");
    }
    assert!(t["p99_us"].as_f64() >= t["p50_us"].as_f64(), "{key}: {t}");
}

#[test]
fn the_gateway_bench_reports_each_bulkhead_target_the_policy_chains_and_durable_audits_cost() {
    bounded(|| {
        let report = bench(
            "direct,bulkhead,bulkhead-policies,bulkhead-durable,pass-through",
            &[],
        );
        for key in [
            "direct",
            "bulkhead_policies_off",
            "bulkhead_policies_on",
            "bulkhead_audit_durable",
            "pass_through",
        ] {
            assert_answered(&report, key);
        }
        for field in ["rps_on_vs_off", "added_p50_us", "added_p99_us"] {
            assert!(report["policy_chain"][field].is_f64(), "{report}");
        }
        for field in ["rps_durable_vs_group", "added_p50_us", "added_p99_us"] {
            assert!(report["durable_audit"][field].is_f64(), "{report}");
        }
        assert!(report["floor"]["gateway_rps_vs_floor"].is_f64(), "{report}");
        assert_eq!(report["skipped"], serde_json::json!({}));
        assert_eq!(report["connections"], 2);

        let streamed = bench("direct,bulkhead", &["--stream"]);
        assert_eq!(streamed["stream"], true);
        for key in ["direct", "bulkhead_policies_off"] {
            assert_answered(&streamed, key);
        }
    });
}

/// `--tls`: the gateway and the floor listen on TLS and the load reaches them over it; the load
/// target, which speaks no TLS, is skipped with the reason.
#[test]
fn over_tls_the_gateway_and_the_floor_are_measured_and_the_plain_load_target_skipped() {
    bounded(|| {
        let report = bench("direct,bulkhead,pass-through", &["--tls"]);
        assert_eq!(report["tls"], true, "{report}");
        for key in ["bulkhead_policies_off", "pass_through"] {
            let t = &report["targets"][key];
            assert!(t["requests"].as_u64() > Some(0), "{key}: {t}");
            assert_eq!(t["errors"], 0, "{key}: {t}");
        }
        let why = report["skipped"]["direct"].as_str().unwrap_or_default();
        assert!(why.contains("TLS"), "{report}");
        assert!(report["floor"]["gateway_rps_vs_floor"].is_f64(), "{report}");
    });
}

#[test]
fn a_peer_that_is_not_installed_is_skipped_with_the_reason() {
    bounded(|| {
        let report = bench("direct,litellm", &[]);
        assert_answered(&report, "direct");
        let why = report["skipped"]["litellm"].as_str().unwrap_or_default();
        assert!(why.contains("scripts/bench-gateway-peers"), "{report}");
        assert!(report["targets"].get("litellm").is_none(), "{report}");
    });
}

#[test]
fn paced_load_offers_every_target_the_same_rate_and_judges_no_throughput_goal() {
    bounded(|| {
        // Closed loop, the load target answers thousands of requests a second; paced at 100,
        // it answers about 100.
        let report = bench("direct,bulkhead,bulkhead-policies", &["--rate", "100"]);
        assert_eq!(report["rate"], 100.0);
        for key in ["direct", "bulkhead_policies_off", "bulkhead_policies_on"] {
            assert_answered(&report, key);
            let rps = report["targets"][key]["rps"].as_f64().unwrap_or_default();
            assert!(
                (80.0..=120.0).contains(&rps),
                "{key} at {rps} req/s: {report}"
            );
        }
        assert!(report["policy_chain"]["added_p50_us"].is_f64(), "{report}");
        assert_eq!(report["goals"], serde_json::json!({}), "{report}");
    });
}

#[test]
fn bad_arguments_are_refused_before_anything_starts() {
    let cases: [(&[&str], &str); 6] = [
        (&["--rate=0"], "--rate must be a positive number"),
        (&["--rate=-5"], "--rate must be a positive number"),
        (&["--rate=inf"], "--rate must be a positive number"),
        (&["--rate=1e-300"], "--rate is too low"),
        (&["--seconds=1e30"], "--seconds is out of range"),
        (
            &["--nginx", "/nonexistent/nginx"],
            "--nginx /nonexistent/nginx is not an executable file",
        ),
    ];
    for (args, refusal) in cases {
        let output = Command::new(env!("CARGO_BIN_EXE_bulkhead"))
            .args(["bench", "gateway", "--targets", "direct"])
            .args(args)
            .current_dir(repo())
            .stdin(Stdio::null())
            .output()
            .expect("the bulkhead binary runs");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{args:?} was taken");
        assert!(stderr.contains(refusal), "{args:?}: {stderr}");
        assert!(!stderr.contains("starting"), "{args:?}: {stderr}");
    }
}
