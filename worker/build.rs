//! Compiles the worker's protos (`proto/`) into Rust with protox (pure Rust, no `protoc`).
//!
//! The output goes to `OUT_DIR` on every build and is included by `src/serve/proto.rs`, so the
//! generated code can never be stale: there is no checked-in copy to drift.

use std::path::PathBuf;

use anyhow::Context;

const PROTOS: &[&str] = &["bulkhead/worker/v1/worker.proto"];

fn main() -> anyhow::Result<()> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?)
        .parent()
        .context("the worker crate lives inside the workspace")?
        .join("proto");
    println!("cargo:rerun-if-changed={}", root.display());
    let fds = protox::compile(PROTOS, [&root]).context("compiling the protos")?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)
        .context("generating Rust from the protos")?;
    Ok(())
}
