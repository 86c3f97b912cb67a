//! `bulkhead generate` sizes its KV pool for the one request it runs: a model file that
//! declares a context of millions of tokens (a mistake, or a long-context model) does not make
//! it allocate millions of tokens of KV.

use std::process::Command;

use crate::up::TempDir;

/// The test model with its `llama.context_length` rewritten to `tokens`.
fn declaring_context(dir: &std::path::Path, tokens: u32) -> std::path::PathBuf {
    let mut bytes = std::fs::read(crate::worker_grpc::model_path()).expect("reads the model");
    let key = b"llama.context_length";
    let at = bytes
        .windows(key.len())
        .position(|w| w == key)
        .expect("the model has a context length")
        + key.len();
    // The value's type (u32: 4), then the value.
    assert_eq!(bytes[at..at + 4], 4u32.to_le_bytes());
    bytes[at + 4..at + 8].copy_from_slice(&tokens.to_le_bytes());
    let path = dir.join("long-context.gguf");
    std::fs::write(&path, bytes).expect("writes");
    path
}

#[test]
fn a_model_declaring_a_huge_context_runs_in_the_memory_its_request_needs() {
    let dir = TempDir::new("generate");
    // Ten million tokens of KV would be 230 GB; the address space allowed here is 8 GB.
    let model = declaring_context(&dir.0, 10_000_000);
    let out = Command::new("bash")
        .arg("-c")
        .arg("ulimit -v 8000000 && exec \"$@\"")
        .arg("bash")
        .arg(env!("CARGO_BIN_EXE_bulkhead"))
        .args(["generate", "--prompt", "What is 2+2?", "--chat"])
        .args(["--max-tokens", "8", "--temperature", "0", "--threads", "1"])
        .arg("--model")
        .arg(&model)
        .output()
        .expect("runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        !String::from_utf8_lossy(&out.stdout).trim().is_empty(),
        "{stderr}"
    );
}

/// A model file that is not one stops the command with one line naming the file and what is
/// wrong, said once (not again as its own cause), and never a panic.
#[test]
fn a_broken_model_file_is_refused_in_one_line() {
    let dir = TempDir::new("generate-broken");
    let cases: [(&str, &[u8], &str); 3] = [
        ("empty.gguf", b"", "truncated"),
        (
            "text.gguf",
            b"this is not a model file at all",
            "not a GGUF file",
        ),
        ("cut.gguf", b"GGUF\x03\0\0\0\x05", "truncated"),
    ];
    for (name, bytes, says) in cases {
        let path = dir.0.join(name);
        std::fs::write(&path, bytes).expect("writes");
        // With backtraces asked for, as a developer's shell may: an answer, not a crash.
        let out = Command::new(env!("CARGO_BIN_EXE_bulkhead"))
            .args(["generate", "--prompt", "hi", "--threads", "1", "--model"])
            .arg(&path)
            .env("RUST_BACKTRACE", "1")
            .output()
            .expect("runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{name}: {stderr}");
        assert!(stderr.contains(says), "{name}: {stderr}");
        assert_eq!(stderr.matches(says).count(), 1, "said once: {stderr}");
        assert!(!stderr.contains("panicked"), "{name}: {stderr}");
        assert!(
            !stderr.to_lowercase().contains("backtrace"),
            "{name}: {stderr}"
        );
    }
}

/// Flags no machine can honour are refused with what would work: a directory as the model, a
/// model path that cannot be read (said as such, not as missing), more compute threads than
/// any process should start, CUDA kernels for the CPU. The kernels' variable is not refused
/// on the CPU (scripts set it for every process they start): with it, the start goes on to
/// the model.
#[test]
fn flags_no_machine_can_honour_are_refused_with_what_would_work() {
    let dir = TempDir::new("generate-flags");
    // A link to itself: unreadable, not missing.
    let looped = dir.0.join("loop.gguf");
    std::os::unix::fs::symlink(&looped, &looped).expect("links");
    let missing = dir.0.join("missing.gguf").display().to_string();
    let cases: [(Vec<String>, &str); 5] = [
        (
            vec!["--model".into(), dir.0.display().to_string()],
            "is not a file",
        ),
        (
            vec!["--model".into(), looped.display().to_string()],
            "cannot read the model file",
        ),
        (
            vec!["--threads".into(), "100000".into()],
            "--threads must be between 1 and 1024",
        ),
        (
            vec!["--cuda-ptx".into(), "kernels.ptx".into()],
            "--cuda-ptx names CUDA kernels, which --device cpu never runs",
        ),
        (vec!["--model".into(), missing], "not found"),
    ];
    for (args, says) in cases {
        let out = Command::new(env!("CARGO_BIN_EXE_bulkhead"))
            .args(["generate", "--prompt", "hi"])
            .args(&args)
            .env_remove("RUST_BACKTRACE")
            .env_remove("BULKHEAD_DEVICE")
            .env("BULKHEAD_CUDA_PTX", "kernels.ptx")
            .output()
            .expect("runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}
