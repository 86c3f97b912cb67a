//! How much host memory a KV pool may take: the kernel's estimate of what can be allocated
//! without swapping (`MemAvailable`), and, inside a cgroup with a memory limit, what is left
//! under it. A pool larger than that is refused at startup with a reason, instead of being
//! zeroed page by page until the out-of-memory killer ends the process (or another).

use std::path::Path;

/// The bytes a new allocation can take now, when the host says (Linux).
pub fn available_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
    let host = meminfo.as_deref().and_then(mem_available);
    // The smaller of the two that are known.
    host.into_iter()
        .chain(cgroup_room(Path::new("/sys/fs/cgroup")))
        .min()
}

/// `MemAvailable` of `/proc/meminfo` text, in bytes.
fn mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// What is left under a cgroup v2 memory limit at `dir` (`None` without one).
fn cgroup_room(dir: &Path) -> Option<u64> {
    let read = |name| std::fs::read_to_string(dir.join(name)).ok();
    let max: u64 = read("memory.max")?.trim().parse().ok()?;
    let current: u64 = read("memory.current")?.trim().parse().ok()?;
    Some(max.saturating_sub(current))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_available_is_read_in_bytes() {
        let text = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(mem_available(text), Some(20_000_000 * 1024));
        assert_eq!(mem_available("MemTotal: 1 kB\n"), None);
    }

    #[test]
    fn a_cgroup_limit_leaves_what_is_not_used() {
        let dir = std::env::temp_dir().join(format!("bulkhead-cgroup-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("memory.max"), "1000\n").unwrap();
        std::fs::write(dir.join("memory.current"), "300\n").unwrap();
        assert_eq!(cgroup_room(&dir), Some(700));
        std::fs::write(dir.join("memory.max"), "max\n").unwrap();
        assert_eq!(cgroup_room(&dir), None, "no limit");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn this_host_says_something() {
        assert!(available_bytes().is_some_and(|b| b > 0));
    }
}
