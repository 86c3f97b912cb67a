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

    #[test]
    fn a_busy_child_counts_toward_its_parents_tree() {
        let Some(before) = ProcessTree(std::process::id()).cpu() else {
            return; // not Linux: nothing to meter
        };
        let mut child = std::process::Command::new("sh")
            .args([
                "-c",
                "i=0; while [ $i -lt 200000 ]; do i=$((i+1)); done; sleep 5",
            ])
            .spawn()
            .expect("sh runs");
        let tree = ProcessTree(child.id());
        let mut own = Duration::ZERO;
        for _ in 0..100 {
            own = tree.cpu().expect("the child is alive");
            if own >= Duration::from_millis(50) {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let whole = ProcessTree(std::process::id()).cpu().expect("still here");
        let _ = child.kill();
        let _ = child.wait();
        assert!(
            own >= Duration::from_millis(50),
            "the child's loop: {own:?}"
        );
        assert!(
            whole >= before + own,
            "the parent's tree holds its child's CPU: {whole:?} < {before:?} + {own:?}"
        );
    }
}
