//! Compiled components on disk, so a large guest (a 15 MB Python or JavaScript policy takes
//! seconds to compile) is compiled once per component and engine configuration, not at every
//! start or reload. An entry is named `<component sha256>-<engine hash>.cwasm`; a missing,
//! stale or unreadable entry is rebuilt, never trusted.
//!
//! A compiled entry is native code the gateway runs: the cache is used only where no one but
//! the gateway's own user can write it (the directory and the entry owned by that user,
//! writable by no group or other, neither a symbolic link); anywhere else every component is
//! compiled afresh and nothing is stored. And an entry is sealed ([`seal`]): it names the
//! component it was compiled from and the SHA-256 of its artifact, so that one copied under
//! another component's name (a restore, a sync) or changed in a byte since it was written is
//! compiled again, not run.
//!
//! Every binding's snapshot is an entry of its own (see `snapshot.rs`), so each configuration
//! an operator ever loads adds one: after a set loads, [`prune`] keeps the cache within its
//! size, evicting the entries used least recently (an entry's modification time is refreshed
//! whenever it is read) and never one the set just loaded used.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

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

/// What an entry starts with, then the component's SHA-256 and the artifact's, then the
/// artifact.
const SEALED: &[u8] = b"bulkhead compiled component 1\n";

/// The entry for `artifact`, compiled from the component whose SHA-256 is `digest`.
fn seal(digest: &Digest, artifact: &[u8]) -> Vec<u8> {
    let mut entry = Vec::with_capacity(SEALED.len() + 64 + artifact.len());
    entry.extend_from_slice(SEALED);
    entry.extend_from_slice(&digest.to_bytes());
    entry.extend_from_slice(&Digest::of(artifact).to_bytes());
    entry.extend_from_slice(artifact);
    entry
}

/// The artifact `entry` holds, when it was sealed for the component `digest` and is whole.
fn unseal<'a>(digest: &Digest, entry: &'a [u8]) -> Option<&'a [u8]> {
    let rest = entry.strip_prefix(SEALED)?;
    let (component, rest) = rest.split_at_checked(32)?;
    let (sum, artifact) = rest.split_at_checked(32)?;
    (*component == digest.to_bytes() && *sum == Digest::of(artifact).to_bytes()).then_some(artifact)
}

/// The component for `bytes` (whose SHA-256 is `digest`), from the cache under `dir` when it
/// holds one, else compiled (and stored there).
pub(super) fn compile(
    engine: &Engine,
    bytes: &[u8],
    digest: &Digest,
    dir: Option<&Path>,
) -> wasmtime::Result<(Component, Compiled)> {
    let Some(dir) = dir.and_then(trusted) else {
        return Ok((Component::new(engine, bytes)?, Compiled::Fresh));
    };
    let path = entry(&dir, engine, digest);
    let read = read_private(&path);
    if read.is_none() && path.exists() {
        tracing::warn!(path = %path.display(),
            "a cached compiled component is writable by others (or not the gateway's, or unreadable): compiling again");
    }
    let artifact = read.as_deref().and_then(|entry| unseal(digest, entry));
    if read.is_some() && artifact.is_none() {
        tracing::warn!(path = %path.display(),
            "a cached compiled component is not the one its name says, or not whole: compiling again");
    }
    if let Some(artifact) = artifact {
        // SAFETY: `Component::deserialize` requires bytes produced by `precompile_component`
        // of a compatible engine and not modified since. The cache directory and the entry
        // are the gateway's user's and no one else can write them (`private`, checked on the
        // file read in `read_private`), nor move the directory (`holds_still`), each entry is
        // renamed into place whole and sealed for its component with its artifact's SHA-256
        // (checked in `unseal`), the entry's name carries the engine's compatibility hash,
        // and wasmtime checks its own header and version again before use.
        match unsafe { Component::deserialize(engine, artifact) } {
            Ok(component) => {
                touch(&path);
                return Ok((component, Compiled::Cached));
            }
            Err(e) => tracing::warn!(path = %path.display(), error = %e,
                "a cached compiled component is unusable; compiling again"),
        }
    }
    let artifact = engine.precompile_component(bytes)?;
    if let Err(e) = store(&path, &seal(digest, &artifact)) {
        tracing::warn!(dir = %dir.display(), error = %e, "cannot write the policy compile cache");
    }
    // SAFETY: `artifact` was produced just above by `precompile_component` of this engine.
    let component = unsafe { Component::deserialize(engine, &artifact)? };
    Ok((component, Compiled::Fresh))
}

/// Marks the entry at `path` as used now, for [`prune`]'s order. Opened to read: its owner
/// (the gateway's user, or it is not used) may set its times without write permission, and an
/// entry made read-only aged while used, and was pruned from under the set that used it. A
/// cache the gateway may read but not own still works; its entries only age.
fn touch(path: &Path) {
    let now = SystemTime::now();
    if let Err(e) = std::fs::File::open(path).and_then(|f| f.set_modified(now)) {
        tracing::debug!(path = %path.display(), error = %e, "cannot refresh a cache entry's time");
    }
}

/// What [`prune`] removed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Pruned {
    pub(super) entries: usize,
    pub(super) bytes: u64,
}

/// A temporary file older than this was left by a writer that died (a write takes seconds at
/// most); a younger one may be another gateway's write in progress.
const ABANDONED_TMP: Duration = Duration::from_secs(3600);

/// Slack below `used_since` still counted as used since: filesystems round modification times
/// (down to whole seconds on some, two on FAT).
const MTIME_SLACK: Duration = Duration::from_secs(2);

/// Removes the least recently used entries under `dir` until the entries take at most
/// `max_bytes`, sparing every entry used since `used_since` (those of the set just loaded,
/// which may alone exceed the bound), and removes abandoned temporary files. Other files are
/// left alone.
pub(super) fn prune(dir: &Path, max_bytes: u64, used_since: SystemTime) -> std::io::Result<Pruned> {
    let now = SystemTime::now();
    let spared_after = used_since.checked_sub(MTIME_SLACK).unwrap_or(used_since);
    let mut entries = Vec::new();
    let mut total = 0u64;
    let mut pruned = Pruned::default();
    for e in std::fs::read_dir(dir)?.flatten() {
        let path = e.path();
        let Ok(meta) = e.metadata() else { continue };
        let Ok(modified) = meta.modified() else {
            continue;
        };
        if !meta.is_file() {
            continue;
        }
        match path.extension().and_then(|x| x.to_str()) {
            Some("cwasm") => {
                total += meta.len();
                if modified < spared_after {
                    entries.push((modified, meta.len(), path));
                }
            }
            Some(x) if x.starts_with("tmp") => {
                let age = now.duration_since(modified).unwrap_or_default();
                if age > ABANDONED_TMP && remove(&path) {
                    pruned.entries += 1;
                    pruned.bytes += meta.len();
                }
            }
            _ => {}
        }
    }
    entries.sort();
    for (_, len, path) in entries {
        if total <= max_bytes {
            break;
        }
        if remove(&path) {
            total -= len;
            pruned.entries += 1;
            pruned.bytes += len;
        }
    }
    Ok(pruned)
}

/// Removes a file (another gateway sharing the cache may have removed it first); whether it
/// is gone.
fn remove(path: &Path) -> bool {
    match std::fs::remove_file(path) {
        Ok(()) => true,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => true,
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot evict a cache entry");
            false
        }
    }
}

/// Writes `artifact` at `path` whole: to a temporary name first (readable and writable by the
/// gateway's user alone), then renamed.
fn store(path: &Path, artifact: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    let tmp = path.with_extension(format!("tmp{:08x}", rand::random::<u32>()));
    let mut options = std::fs::File::options();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    options.open(&tmp)?.write_all(artifact)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// The cache directory `dir` resolves to (created if missing; a link to it is followed once,
/// here), when it is the gateway's user's and no one else's to write; `None`, said in the log,
/// otherwise: then nothing is read from it, stored in it or pruned.
pub(super) fn trusted(dir: &Path) -> Option<PathBuf> {
    if let Err(e) = create_private_dir(dir) {
        tracing::warn!(dir = %dir.display(), error = %e, "cannot create the policy compile cache");
    }
    let real = std::fs::canonicalize(dir)
        .inspect_err(|e| {
            tracing::warn!(dir = %dir.display(), error = %e, "the policy compile cache is unusable");
        })
        .ok()?;
    if !private(&real) {
        tracing::warn!(dir = %real.display(),
            "the policy compile cache is writable by others (or not the gateway's): not used");
        return None;
    }
    if let Some(open) = real.ancestors().skip(1).find(|a| !holds_still(a)) {
        tracing::warn!(dir = %real.display(), above = %open.display(),
            "a directory above the policy compile cache is writable by anyone and not sticky: not used");
        return None;
    }
    Some(real)
}

/// The bytes of the entry at `path` when it is a regular file of the gateway's user that no
/// group or other may write (see [`private`]), checked on the opened file itself (a link is
/// not followed), so that nothing swapped in between the check and the read is read.
#[cfg(unix)]
fn read_private(path: &Path) -> Option<Vec<u8>> {
    use std::io::Read as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut file = std::fs::File::options()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .ok()?;
    let meta = file.metadata().ok()?;
    if !meta.is_file() || !mine(&meta) {
        return None;
    }
    let mut bytes = Vec::with_capacity(usize::try_from(meta.len()).unwrap_or(0));
    file.read_to_end(&mut bytes).ok()?;
    Some(bytes)
}

#[cfg(not(unix))]
fn read_private(path: &Path) -> Option<Vec<u8>> {
    private(path).then(|| std::fs::read(path).ok()).flatten()
}

/// Whether what lies in the directory `dir` (above the cache) stays where it is: `dir` is
/// writable by no other user, or sticky (as `/tmp` is: others may add entries there, not
/// rename or remove another's). A directory its group may write is the operator's
/// choice of who shares it (a umask of 002, a Kubernetes volume's `fsGroup`).
#[cfg(unix)]
fn holds_still(dir: &Path) -> bool {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::metadata(dir).is_ok_and(|m| m.mode() & 0o002 == 0 || m.mode() & 0o1000 != 0)
}

#[cfg(not(unix))]
fn holds_still(_: &Path) -> bool {
    true
}

/// Whether `path` itself (a link is not followed) belongs to the gateway's user and no group
/// or other may write it.
#[cfg(unix)]
fn private(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| !m.file_type().is_symlink() && mine(&m))
}

/// Whether what `meta` describes belongs to the gateway's (effective) user and no group or
/// other may write it.
#[cfg(unix)]
fn mine(meta: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt as _;
    // SAFETY: `geteuid` has no preconditions and cannot fail.
    let user = unsafe { libc::geteuid() };
    meta.uid() == user && meta.mode() & 0o022 == 0
}

#[cfg(not(unix))]
fn private(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| !m.file_type().is_symlink())
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

/// Sets `path`'s modification time to `age` ago (tests: entries of an earlier use).
#[cfg(test)]
pub(super) fn backdate(path: &Path, age: Duration) {
    std::fs::File::options()
        .write(true)
        .open(path)
        .and_then(|f| f.set_modified(SystemTime::now() - age))
        .expect("sets the time");
}

/// `entry`'s artifact sealed for the component `digest` (tests: an entry forged by someone who
/// can write the cache — the seal is no secret, only the file's owner and mode keep it out).
#[cfg(test)]
pub(super) fn reseal(entry: &[u8], digest: &Digest) -> Vec<u8> {
    let artifact = &entry[SEALED.len() + 64..];
    seal(digest, artifact)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scratch::Scratch;

    /// Two components: an empty one, and one holding a custom section.
    const EMPTY: &[u8] = b"\0asm\x0d\x00\x01\x00";
    const NAMED: &[u8] = b"\0asm\x0d\x00\x01\x00\x00\x02\x01a";

    #[test]
    fn an_entry_changed_in_a_byte_or_copied_under_another_components_name_is_compiled_again() {
        let dir = Scratch::new("cache");
        let cache = dir.0.join("compiled");
        let engine = Engine::default();
        let (empty, named) = (Digest::of(EMPTY), Digest::of(NAMED));
        let compiled = |bytes, digest| {
            compile(&engine, bytes, digest, Some(&cache))
                .expect("compiles")
                .1
        };
        assert_eq!(compiled(EMPTY, &empty), Compiled::Fresh);
        assert_eq!(compiled(EMPTY, &empty), Compiled::Cached);
        let real = trusted(&cache).expect("a private cache");
        let (of_empty, of_named) = (entry(&real, &engine, &empty), entry(&real, &engine, &named));
        // One byte of the artifact changed: compiled again, and written whole again.
        let mut bytes = std::fs::read(&of_empty).expect("reads");
        *bytes.last_mut().expect("an artifact") ^= 1;
        std::fs::write(&of_empty, bytes).expect("writes");
        assert_eq!(compiled(EMPTY, &empty), Compiled::Fresh);
        assert_eq!(compiled(EMPTY, &empty), Compiled::Cached);
        // Another component's valid entry under this one's name: never run as this one.
        assert_eq!(compiled(NAMED, &named), Compiled::Fresh);
        std::fs::copy(&of_named, &of_empty).expect("copies");
        assert_eq!(compiled(EMPTY, &empty), Compiled::Fresh);
        assert_eq!(compiled(NAMED, &named), Compiled::Cached);
    }

    /// An entry made read-only by its owner is still marked used when used, so that pruning
    /// spares it with the set that uses it.
    #[test]
    fn a_read_only_entry_used_is_marked_used() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = Scratch::new("cache");
        let entry = file(&dir.0, "a-1.cwasm", 400, Duration::from_secs(3600));
        std::fs::set_permissions(&entry, std::fs::Permissions::from_mode(0o400))
            .expect("read-only");
        let loading = SystemTime::now() - Duration::from_secs(60);
        std::thread::scope(|s| {
            s.spawn(|| {
                without_dac_override();
                touch(&entry);
            });
        });
        assert_eq!(
            prune(&dir.0, 0, loading).expect("prunes"),
            Pruned::default()
        );
        assert!(entry.exists());
    }

    /// Takes from this thread the capability by which root writes whatever a file's mode says
    /// (CI runs as root): the thread then meets a file's mode as the gateway's own user does.
    fn without_dac_override() {
        #[repr(C)]
        struct Header {
            version: u32,
            pid: i32,
        }
        #[repr(C)]
        #[derive(Default, Clone, Copy)]
        struct Data {
            effective: u32,
            permitted: u32,
            inheritable: u32,
        }
        const VERSION_3: u32 = 0x2008_0522;
        const CAP_DAC_OVERRIDE: u32 = 1;
        let mut header = Header {
            version: VERSION_3,
            pid: 0,
        };
        let mut data = [Data::default(); 2];
        // SAFETY: capget and capset take a version-3 header and two data words
        // (capabilities(7)); pid 0 is the calling thread, which alone loses the capability.
        unsafe {
            let got = libc::syscall(libc::SYS_capget, &raw mut header, data.as_mut_ptr());
            assert_eq!(got, 0, "capget");
            data[0].effective &= !(1 << CAP_DAC_OVERRIDE);
            let set = libc::syscall(libc::SYS_capset, &raw mut header, data.as_ptr());
            assert_eq!(set, 0, "capset");
        }
    }

    /// A file of `len` bytes under `dir`, last modified `age` ago.
    fn file(dir: &Path, name: &str, len: usize, age: Duration) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, vec![0u8; len]).expect("writes");
        backdate(&path, age);
        path
    }

    #[test]
    fn pruning_evicts_the_least_recently_used_entries_and_spares_the_loaded_set() {
        let dir = Scratch::new("cache");
        let hour = Duration::from_secs(3600);
        let oldest = file(&dir.0, "a-1.cwasm", 400, 5 * hour);
        let older = file(&dir.0, "b-1.cwasm", 400, 4 * hour);
        let old = file(&dir.0, "c-1.cwasm", 400, 3 * hour);
        let abandoned = file(&dir.0, "d-1.tmp0000abcd", 50, 2 * hour);
        let writing = file(&dir.0, "e-1.tmp0000abcd", 50, Duration::ZERO);
        let other = file(&dir.0, "notes.txt", 10_000, 9 * hour);
        let loading = SystemTime::now() - Duration::from_secs(60);
        // Used by the set being loaded: spared, though they alone exceed the bound.
        let used = file(&dir.0, "f-1.cwasm", 600, Duration::ZERO);
        let used_too = file(&dir.0, "g-1.cwasm", 600, Duration::ZERO);

        // 2400 bytes of entries, at most 1600: the two oldest go, and the old one stays.
        let pruned = prune(&dir.0, 1600, loading).expect("prunes");
        assert_eq!(
            pruned,
            Pruned {
                entries: 3,
                bytes: 850
            }
        );
        for gone in [&oldest, &older, &abandoned] {
            assert!(!gone.exists(), "{} should be evicted", gone.display());
        }
        for kept in [&old, &writing, &other, &used, &used_too] {
            assert!(kept.exists(), "{} should be kept", kept.display());
        }

        // A bound below what the loaded set uses: everything else goes, the set stays.
        let pruned = prune(&dir.0, 0, loading).expect("prunes");
        assert_eq!(
            pruned,
            Pruned {
                entries: 1,
                bytes: 400
            }
        );
        assert!(!old.exists() && used.exists() && used_too.exists());

        // Within the bound: nothing to do.
        let pruned = prune(&dir.0, 1 << 20, SystemTime::now()).expect("prunes");
        assert_eq!(pruned, Pruned::default());
    }
}
