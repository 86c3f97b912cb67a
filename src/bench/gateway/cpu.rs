//! CPU time a target's processes spend, read from `/proc` (Linux). Requests/s of a closed loop on
//! a shared machine depends on how the cores are split between the target, the load and the
//! upstream: a target with more runnable threads wins a larger share. CPU time per request
//! does not: it is what the target costs, whatever share it got.

use std::time::Duration;

/// A process and its descendants (nginx's workers are its master's children).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessTree(pub u32);

impl ProcessTree {
    /// User plus system CPU time used so far by every thread of the process and of its live
    /// descendants; `None` where `/proc` cannot tell (not Linux, or the process itself is
    /// gone).
    pub fn cpu(self) -> Option<Duration> {
        let ticks_per_second = clock_ticks_per_second()?;
        let mut ticks = 0u64;
        let mut pending = vec![self.0];
        while let Some(pid) = pending.pop() {
            let stat = match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
                Ok(stat) => stat,
                // A descendant may exit between listing and reading: its time is no longer
                // ours to count, and the rest of the tree still is.
                Err(_) if pid != self.0 => continue,
                Err(_) => return None,
            };
            ticks = ticks.saturating_add(used_ticks(&stat)?);
            pending.extend(children(pid));
        }
        Some(Duration::from_secs_f64(
            ticks as f64 / ticks_per_second as f64,
        ))
    }
}

fn clock_ticks_per_second() -> Option<u64> {
    // SAFETY: sysconf reads a constant of the system; it has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    u64::try_from(ticks).ok().filter(|&t| t > 0)
}

/// `utime + stime` of a `/proc/PID/stat` line. The command name (field 2) is in parentheses
/// and may hold spaces or parentheses itself, so fields are counted after its last `)`:
/// field 3 (state) is the first there, utime and stime are fields 14 and 15.
fn used_ticks(stat: &str) -> Option<u64> {
    let (_, rest) = stat.rsplit_once(')')?;
    let mut fields = rest.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

/// The children of every thread of `pid` (empty where the kernel does not list them).
fn children(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("children")).ok())
        .flat_map(|list| {
            list.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect::<Vec<u32>>()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_counted_after_the_last_parenthesis_of_the_name() {
        let stat = "4242 (a (b) c) S 1 4242 4242 0 -1 4194560 100 0 0 0 37 5 0 0 20 0 3 0";
        assert_eq!(used_ticks(stat), Some(42));
        assert_eq!(used_ticks("4242 (x) S 1"), None, "a cut line is no figure");
    }

    /// An idle shell whose child (a subshell) is busy: the tree's CPU is the child's, which
    /// only a walk of the children finds (the shell's own is nearly nothing).
    #[test]
    fn a_busy_childs_cpu_counts_toward_its_idle_parents_tree() {
        use std::os::unix::process::CommandExt as _;
        if clock_ticks_per_second().is_none() {
            return; // not Linux: nothing to meter
        }
        let mut shell = std::process::Command::new("sh")
            .args([
                "-c",
                "(i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done; sleep 5) & wait",
            ])
            .process_group(0)
            .spawn()
            .expect("sh runs");
        let tree = ProcessTree(shell.id());
        let own = || {
            std::fs::read_to_string(format!("/proc/{}/stat", shell.id()))
                .ok()
                .and_then(|stat| used_ticks(&stat))
        };
        let mut whole = Duration::ZERO;
        for _ in 0..100 {
            whole = tree.cpu().expect("the shell is alive");
            if whole >= Duration::from_millis(100) {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let own_ticks = own().expect("the shell is alive");
        let pid = i32::try_from(shell.id()).expect("a pid");
        // SAFETY: kill(2) on the shell's own process group, which this test made.
        unsafe { libc::kill(-pid, libc::SIGKILL) };
        let _ = shell.wait();
        assert!(
            whole >= Duration::from_millis(100),
            "the tree holds its child's loop: {whole:?}"
        );
        let ticks = clock_ticks_per_second().expect("Linux");
        assert!(
            Duration::from_secs_f64(own_ticks as f64 / ticks as f64) < Duration::from_millis(50),
            "the shell itself only waits: {own_ticks} ticks"
        );
    }
}
