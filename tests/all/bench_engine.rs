//! `bulkhead bench engine`, briefly: without `--kv-tokens` its pool is what its own
//! measurements need, so the README's command runs as written (a fixed default of 6144 tokens
//! refused the default batch of 64 × 160 tokens), and a pool too small is refused by name.

use std::process::{Command, Stdio};

use crate::up::{bounded, json};

fn bench_engine(extra: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_bulkhead"))
        .args(["bench", "engine", "--threads", "1", "--runs", "1"])
        .args(["--prefill-tokens", "16", "--decode-tokens", "8"])
        .args(["--decode-batches", "1,4"])
        .args(extra)
        .stdin(Stdio::null())
        .output()
        .expect("the bulkhead binary runs")
}

#[test]
fn the_engine_bench_sizes_its_pool_for_its_measurements() {
    bounded(|| {
        let output = bench_engine(&[]);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "bench engine failed:\n{stderr}");
        let report = json(&String::from_utf8_lossy(&output.stdout));
        // 4 requests of a 32-token prompt and 8 new tokens each, at once: 3 pages of 16 each.
        assert_eq!(report["kv_tokens"], 4 * 3 * 16, "{report}");
        assert!(report["decode_b4_tok_s"].as_f64() > Some(0.0), "{report}");

        let output = bench_engine(&["--kv-tokens", "100"]);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success());
        assert!(
            stderr.contains("--kv-tokens 100 is too small") && stderr.contains("need 192"),
            "{stderr}"
        );
    });
}
