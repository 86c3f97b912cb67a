//! `bulkhead bench prefix`, briefly: requests sharing a system prompt read it from the
//! tenant's prefix cache on the side where the cache is on, and both sides are timed; each run
//! starts from an empty cache; the prompts it measured are written for the llama.cpp peer.

use std::process::{Command, Stdio};

use crate::up::{bounded, json};

#[test]
fn the_prefix_bench_serves_the_shared_system_prompt_from_the_cache() {
    bounded(|| {
        let dir = crate::up::TempDir::new("bench-prefix");
        let prompts = dir.0.join("prompts.json");
        let output = Command::new(env!("CARGO_BIN_EXE_bulkhead"))
            .args([
                "bench",
                "prefix",
                "--shared-tokens",
                "64",
                "--question-tokens",
                "8",
            ])
            .args(["--requests", "3", "--runs", "2"])
            .arg("--prompts-out")
            .arg(&prompts)
            .stdin(Stdio::null())
            .output()
            .expect("the bulkhead binary runs");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "bench prefix failed:\n{stderr}");
        let report = json(&String::from_utf8_lossy(&output.stdout));
        // 3 prompts of 72 tokens a run: the first computes everything, the next two read the
        // 64 shared tokens (four whole pages): 128 of 216, in the second run too (its prompts
        // are the first run's, whose questions are not read from a cache it left behind).
        let read = report["prompt_tokens_read_from_cache_pct"].as_f64();
        assert_eq!(read.map(|p| p.round()), Some(59.0), "{report}");
        for side in ["ttft_ms_cache_off", "ttft_ms_cache_on", "ttft_off_over_on"] {
            assert!(
                report[side].as_f64().is_some_and(|v| v > 0.0),
                "{side}: {report}"
            );
        }
        // The prompts measured, for the llama.cpp peer: three of 72 tokens a run, sharing the
        // first 64 and no more.
        let written = json(&std::fs::read_to_string(&prompts).expect("written"));
        let measured: Vec<Vec<u64>> = written["prompts"]
            .as_array()
            .expect("a list")
            .iter()
            .map(|p| {
                p.as_array()
                    .expect("token ids")
                    .iter()
                    .filter_map(|t| t.as_u64())
                    .collect()
            })
            .collect();
        assert_eq!(measured.len(), 6, "{written}");
        assert!(measured.iter().all(|p| p.len() == 72), "{written}");
        assert!(measured.iter().all(|p| p[..64] == measured[0][..64]));
        assert!(measured[1][64..] != measured[0][64..] && measured[2][64..] != measured[1][64..]);
    });
}
