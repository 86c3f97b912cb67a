//! `bulkhead worker --kv-transport`: the data plane is checked at startup, before the model.

use std::process::{Command, Stdio};

/// Asked for RDMA where there is none (a build without the `rdma` feature, or a machine without
/// a device), the worker exits non-zero with an error that names RDMA and the way out — before
/// it looks at the model (the path given here does not exist).
#[test]
fn rdma_without_support_fails_the_start_before_the_model_is_loaded() {
    let output = Command::new(env!("CARGO_BIN_EXE_bulkhead"))
        .args(["worker", "--kv-transport", "rdma"])
        .args(["--model", "/nonexistent/bulkhead-test-model.gguf"])
        .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
        .env_remove("BULKHEAD_LOG")
        .env_remove("BULKHEAD_RDMA_DEVICE")
        .stdin(Stdio::null())
        .output()
        .expect("the bulkhead binary runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success(),
        "the worker must not start; stderr: {stderr}"
    );
    assert!(
        stderr.contains("RDMA") && stderr.contains("--kv-transport tcp"),
        "stderr: {stderr}"
    );
    assert!(
        !stderr.contains("model file"),
        "the transport is checked before the model; stderr: {stderr}"
    );
    #[cfg(not(feature = "rdma"))]
    assert!(
        stderr.contains("rebuild with --features rdma"),
        "stderr: {stderr}"
    );
}
