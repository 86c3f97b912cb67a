//! Files that hold a secret (the cluster token, a TLS private key): read only when other users
//! cannot open them — as ssh refuses an exposed private key, since a secret anyone on the host
//! can read is no secret — and written readable by their owner only.

use std::io::{Read as _, Write as _};
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::path::Path;

/// Why a secret file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SecretFileError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error(
        "{path} is open to other users (mode {mode:o}): `chmod o-rwx` it \
         (its owner, or a group, may read it)"
    )]
    Exposed { path: String, mode: u32 },
}

/// The contents of the secret file at `path`, which other users may not read or write.
pub fn read(path: &Path) -> Result<Vec<u8>, SecretFileError> {
    let shown = || path.display().to_string();
    let unreadable = |source| SecretFileError::Read {
        path: shown(),
        source,
    };
    // One open: the mode checked is the mode of the file read.
    let mut file = std::fs::File::open(path).map_err(unreadable)?;
    let mode = file.metadata().map_err(unreadable)?.permissions().mode();
    if mode & 0o007 != 0 {
        return Err(SecretFileError::Exposed {
            path: shown(),
            mode: mode & 0o777,
        });
    }
    let mut contents = Vec::new();
    file.read_to_end(&mut contents).map_err(unreadable)?;
    Ok(contents)
}

/// Writes `secret` to `path`: created anew (whatever was there is replaced), readable and
/// writable by its owner only.
pub fn write(path: &Path, secret: &[u8]) -> std::io::Result<()> {
    // Removed first: a file opened for writing keeps its mode.
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?
        .write_all(secret)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_file_other_users_can_open_is_refused() {
        let dir =
            std::env::temp_dir().join(format!("bulkhead-secret-mode-{}", rand::random::<u64>()));
        std::fs::create_dir_all(&dir).expect("a directory");
        let file = dir.join("secret");
        std::fs::write(&file, "old").expect("writes");
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        write(&file, b"secret").expect("replaces");
        assert_eq!(read(&file).expect("owner only"), b"secret");
        let mode = |m| std::fs::set_permissions(&file, std::fs::Permissions::from_mode(m));
        for open in [0o644, 0o604, 0o602, 0o601] {
            mode(open).expect("chmod");
            let refused = read(&file);
            assert!(
                matches!(refused, Err(SecretFileError::Exposed { mode, .. }) if mode == open),
                "{open:o}: {refused:?}"
            );
        }
        for closed in [0o600, 0o440, 0o400] {
            mode(closed).expect("chmod");
            assert!(read(&file).is_ok(), "{closed:o}");
        }
        assert!(matches!(
            read(&dir.join("absent")),
            Err(SecretFileError::Read { .. })
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
