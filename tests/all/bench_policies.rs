//! `bulkhead bench policies` on the default policy set (the three built-ins), briefly: the
//! report names each binding and whether it starts from a snapshot, and times the chain.

use std::process::{Command, Stdio};

use crate::up::{bounded, json, repo};

#[test]
fn the_policy_bench_times_the_default_chain_of_snapshotted_built_ins() {
    bounded(|| {
        let output = Command::new(env!("CARGO_BIN_EXE_bulkhead"))
            .args(["bench", "policies", "--requests", "200"])
            .current_dir(repo())
            .stdin(Stdio::null())
            .output()
            .expect("the bulkhead binary runs");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "bench policies failed:\n{stderr}");
        let report = json(&String::from_utf8_lossy(&output.stdout));
        let bindings: Vec<(&str, bool)> = report["bindings"]
            .as_array()
            .unwrap_or_else(|| panic!("bindings: {report}"))
            .iter()
            .map(|b| {
                let plugin = b["plugin"].as_str().expect("plugin");
                (plugin, b["snapshot"].as_bool().expect("snapshot"))
            })
            .collect();
        assert_eq!(
            bindings,
            [
                ("tenant-tag", true),
                ("length-limit", true),
                ("abort-guard", true)
            ],
            "{report}"
        );
        assert_eq!(report["requests"], 200, "{report}");
        for key in ["chain_us", "no_policies_us"] {
            let p50 = report[key]["p50"].as_f64().expect("p50");
            let p99 = report[key]["p99"].as_f64().expect("p99");
            assert!(p50 > 0.0 && p99 >= p50, "{key}: {report}");
        }
        // Two fresh instances cost more than none.
        assert!(
            report["chain_us"]["p50"].as_f64() > report["no_policies_us"]["p50"].as_f64(),
            "{report}"
        );
    });
}

/// A set that denies the benchmark's request is refused by name, with the plugin's reason
/// (it was a dump of the refusal's Rust structures).
#[test]
fn a_set_that_denies_the_benchmarks_request_is_said_so() {
    let dir = crate::up::TempDir::new("bench-deny");
    let dist = format!("{}/", repo().join("plugins/dist").display());
    let set = std::fs::read_to_string(repo().join("policies/local.toml"))
        .expect("the policy set")
        .replace("../plugins/dist/", &dist)
        .replace("max_prompt_tokens = 7680", "max_prompt_tokens = 50");
    let file = dir.0.join("deny.toml");
    std::fs::write(&file, set).expect("writes the set");
    let output = Command::new(env!("CARGO_BIN_EXE_bulkhead"))
        .args(["bench", "policies", "--requests", "10", "--policies"])
        .arg(&file)
        .current_dir(repo())
        .stdin(Stdio::null())
        .output()
        .expect("the bulkhead binary runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains("policy length-limit denied the benchmark's request (tenant-a")
            && !stderr.contains("Refused {"),
        "{stderr}"
    );
}
