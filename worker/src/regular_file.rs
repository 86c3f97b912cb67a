//! Reading a file an operator names (a configuration, a policy set, a plugin) without being
//! held by what is not one: a FIFO with no writer would block the reader forever (a reload
//! never answering, shutdown never finishing), a device would never end. The file is opened
//! without blocking and read only if it is a regular file.

use std::io::{self, Read as _};
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::Path;

/// The regular file at `path` (a symbolic link is followed), open to read; an error of kind
/// `InvalidInput` for anything else.
pub fn open(path: &Path) -> io::Result<std::fs::File> {
    // O_NONBLOCK: opening a FIFO returns at once; on a regular file it changes nothing.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    let kind = file.metadata()?.file_type();
    if !kind.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            if kind.is_dir() {
                "is a directory, not a file"
            } else {
                "is not a regular file (a FIFO, socket or device)"
            },
        ));
    }
    Ok(file)
}

/// The whole contents of the regular file at `path` (a symbolic link is followed); an error of
/// kind `InvalidInput` for anything else.
pub fn read(path: &Path) -> io::Result<Vec<u8>> {
    let mut file = open(path)?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// [`read`], as UTF-8 text; invalid UTF-8 is an `InvalidData` error that says where.
pub fn read_text(path: &Path) -> io::Result<String> {
    String::from_utf8(read(path)?).map_err(|e| {
        let at = e.utf8_error().valid_up_to();
        let line = e.as_bytes()[..at].iter().filter(|&&b| b == b'\n').count() + 1;
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("not UTF-8 text: an invalid byte on line {line} (byte {at})"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "bulkhead-regular-file-{}-{name}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a scratch directory");
        dir
    }

    #[test]
    fn a_fifo_a_directory_and_a_device_are_refused_without_blocking() {
        let dir = scratch("kinds");
        let fifo = dir.join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().expect("UTF-8")).expect("no NUL");
        // SAFETY: `c` is a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        for path in [fifo.as_path(), dir.as_path(), Path::new("/dev/zero")] {
            let e = read(path).expect_err("refused");
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{}", path.display());
        }
        let file = dir.join("file");
        std::fs::write(&file, "a = 1\n").expect("writes");
        assert_eq!(read_text(&file).expect("reads"), "a = 1\n");
        std::fs::write(&file, b"a = 1\nb = \"\xff\"\n").expect("writes");
        let e = read_text(&file).expect_err("not UTF-8");
        assert!(e.to_string().contains("line 2 (byte 11)"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
