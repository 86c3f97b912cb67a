//! Child processes the commands start (`bulkhead up`'s workers, the gateway bench's targets):
//! tied to this process's life, awaited on their ready line, stopped with SIGTERM first.

use std::time::Duration;

use anyhow::bail;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// Waits until `child` prints a stdout line starting with `prefix` (the child's stdout must be
/// piped) and returns the rest of that line. Its stdout keeps being drained afterwards, so the
/// child never blocks on a full pipe. `what` names the child in errors.
pub async fn ready_line(
    child: &mut Child,
    prefix: &str,
    limit: Duration,
    what: &str,
) -> anyhow::Result<String> {
    let Some(stdout) = child.stdout.take() else {
        bail!("the {what}'s stdout is not piped");
    };
    let mut lines = BufReader::new(stdout).lines();
    let ready = tokio::time::timeout(limit, async {
        while let Some(line) = lines.next_line().await? {
            if let Some(rest) = line.strip_prefix(prefix) {
                return Ok::<_, std::io::Error>(Some(rest.to_owned()));
            }
        }
        Ok(None)
    })
    .await;
    let line = match ready {
        Ok(Ok(Some(line))) => line,
        Ok(Ok(None)) => bail!("the {what} exited before it was ready (see its log above)"),
        Ok(Err(e)) => bail!("reading the {what}'s output: {e}"),
        Err(_) => bail!("the {what} was not ready within {} s", limit.as_secs()),
    };
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok(line)
}

/// The value of `key=` in a ready line's space-separated fields.
pub fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|f| f.strip_prefix(key)?.strip_prefix('='))
}

/// SIGTERM, then SIGKILL if the child has not stopped within `limit`.
pub async fn stop(child: &mut Child, limit: Duration, what: &str) {
    if let Some(pid) = child.id().and_then(|p| libc::pid_t::try_from(p).ok()) {
        // SAFETY: kill(2) with a pid we spawned and still own (not yet reaped, so the pid
        // cannot have been reused) and a valid signal number; no memory is involved.
        unsafe {
            libc::kill(pid, libc::SIGTERM);
        }
    }
    if tokio::time::timeout(limit, child.wait()).await.is_err() {
        eprintln!("the {what} did not stop; killing it");
        let _ = child.kill().await;
    }
}

/// The child gets SIGTERM if this process dies first (Linux), so none is orphaned — also when
/// it died between the fork and the request for the signal (the child then has another
/// parent already, and does not start).
#[cfg(target_os = "linux")]
pub fn die_with_parent(cmd: &mut Command) {
    let parent = libc::pid_t::try_from(std::process::id()).unwrap_or(0);
    // SAFETY: the closure runs in the forked child before exec and only calls prctl(2) and
    // getppid(2), which are async-signal-safe; it touches no memory of the parent's but a
    // copied integer.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            // No allocation here (another thread may have held the allocator's lock at the
            // fork): an error number alone.
            if libc::getppid() != parent {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
pub fn die_with_parent(_cmd: &mut Command) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_found_by_their_whole_key() {
        let line = "api=127.0.0.1:1 admin=127.0.0.1:2 api_pid=7";
        assert_eq!(field(line, "api"), Some("127.0.0.1:1"));
        assert_eq!(field(line, "admin"), Some("127.0.0.1:2"));
        assert_eq!(field(line, "api_pid"), Some("7"));
        assert_eq!(field(line, "grpc"), None);
    }
}
