//! Compiled components on disk, so a large guest (a 15 MB Python or JavaScript policy takes
//! seconds to compile) is compiled once per component and engine configuration, not at every
//! start or reload. An entry is named `<component sha256>-<engine hash>.cwasm`; a missing,
//! stale or unreadable entry is rebuilt, never trusted.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};

use wasmtime::Engine;
use wasmtime::component::Component;

use super::digest::Digest;

/// Where a compiled component came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compiled {
    /// Read from the cache.
    Cached,
    /// Compiled now (and written to the cache when there is one).
    Fresh,
}

/// A hash of everything that makes a compiled artifact usable by `engine`: wasmtime's own
/// compatibility hash (its version, the compiler's settings and the target).
fn engine_hash(engine: &Engine) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    engine.precompile_compatibility_hash().hash(&mut h);
    h.finish()
}

fn entry(dir: &Path, engine: &Engine, digest: &Digest) -> PathBuf {
    dir.join(format!("{digest}-{:016x}.cwasm", engine_hash(engine)))
}

/// The component for `bytes` (whose SHA-256 is `digest`), from the cache under `dir` when it
/// holds one, else compiled (and stored there).
pub(super) fn compile(
    engine: &Engine,
    bytes: &[u8],
    digest: &Digest,
    dir: Option<&Path>,
) -> wasmtime::Result<(Component, Compiled)> {
    let Some(dir) = dir else {
        return Ok((Component::new(engine, bytes)?, Compiled::Fresh));
    };
    let path = entry(dir, engine, digest);
    if let Ok(artifact) = std::fs::read(&path) {
        // SAFETY: `Component::deserialize` requires bytes produced by `precompile_component`
        // of a compatible engine and not modified since. The cache directory is the gateway's
        // own (created by it, written only below, each entry renamed into place whole), the
        // entry's name carries the engine's compatibility hash, and wasmtime checks its own
        // header and version again before use.
        match unsafe { Component::deserialize(engine, &artifact) } {
            Ok(component) => return Ok((component, Compiled::Cached)),
            Err(e) => tracing::warn!(path = %path.display(), error = %e,
                "a cached compiled component is unusable; compiling again"),
        }
    }
    let artifact = engine.precompile_component(bytes)?;
    if let Err(e) = store(dir, &path, &artifact) {
        tracing::warn!(dir = %dir.display(), error = %e, "cannot write the policy compile cache");
    }
    // SAFETY: `artifact` was produced just above by `precompile_component` of this engine.
    let component = unsafe { Component::deserialize(engine, &artifact)? };
    Ok((component, Compiled::Fresh))
}

/// Writes `artifact` at `path` whole: to a temporary name first, then renamed.
fn store(dir: &Path, path: &Path, artifact: &[u8]) -> std::io::Result<()> {
    create_private_dir(dir)?;
    let tmp = path.with_extension(format!("tmp{:08x}", rand::random::<u32>()));
    std::fs::write(&tmp, artifact)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

#[cfg(unix)]
fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

#[cfg(not(unix))]
fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)
}
