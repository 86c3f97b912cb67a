//! `--device cuda`: the device is opened at startup, before the model, by every command that
//! runs the model; a build without the `cuda` feature, or a machine without a driver, stops
//! there with an error that says why and what to do instead (never a panic).

use std::process::{Command, Stdio};

#[test]
fn cuda_without_support_fails_the_start_before_the_model_is_loaded() {
    let commands: [&[&str]; 3] = [
        &[
            "worker",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ],
        &["generate", "--prompt", "hello"],
        &["bench", "engine"],
    ];
    for command in commands {
        let output = Command::new(env!("CARGO_BIN_EXE_bulkhead"))
            .args(command)
            .args([
                "--device",
                "cuda",
                "--model",
                "/nonexistent/bulkhead-test-model.gguf",
            ])
            .env_remove("BULKHEAD_LOG")
            .env_remove("BULKHEAD_CUDA_PTX")
            .stdin(Stdio::null())
            .output()
            .expect("the bulkhead binary runs");
        let stderr = String::from_utf8_lossy(&output.stderr);
        if cfg!(feature = "cuda") && stderr.contains("model file") {
            // The device opened: a machine with CUDA. This test is about machines without.
            eprintln!("{command:?}: this machine has CUDA; the no-driver path is not exercised");
            continue;
        }
        assert!(
            !output.status.success(),
            "{command:?} must not start; stderr: {stderr}"
        );
        assert!(stderr.contains("--device cuda:0"), "{command:?}: {stderr}");
        assert!(stderr.contains("--device cpu"), "{command:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{command:?}: {stderr}");
        assert!(
            !stderr.contains("model file"),
            "the device is checked before the model; {command:?}: {stderr}"
        );
        let why = if cfg!(feature = "cuda") {
            "no CUDA driver on this machine"
        } else {
            "rebuild with --features cuda"
        };
        assert!(stderr.contains(why), "{command:?}: {stderr}");
    }
}
