//! The process's limit on open descriptors: raised to its hard limit at start (a default soft
//! limit of 1024 is far below what a gateway or a worker holds under load), and what it leaves
//! a listener's connections.

/// Descriptors kept out of the connections' share: the listeners, the admin port's
/// connections, the audit log's files, the workers' channels, the template sandbox's pipes.
const RESERVED: u64 = 256;

/// Raises this process's soft limit on open descriptors to its hard limit (or to the kernel's
/// `fs.nr_open`, when the hard limit is past what the kernel lets a process have). Returns the
/// soft limit in force afterwards (`None` if it cannot be read; the limit is then left alone).
/// Runs before any log is set up: a failure is said on stderr.
pub fn raise_limit() -> Option<u64> {
    let mut limit = soft_and_hard()?;
    let most = std::fs::read_to_string("/proc/sys/fs/nr_open")
        .ok()
        .and_then(|n| n.trim().parse::<u64>().ok())
        .map_or(limit.rlim_max, |n| n.min(limit.rlim_max));
    if limit.rlim_cur < most {
        // The kernel refuses a hard limit past `fs.nr_open` even unchanged: lowered with it.
        limit.rlim_cur = most;
        limit.rlim_max = most;
        // SAFETY: `limit` lives across the call and is only read.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } != 0 {
            eprintln!(
                "warning: could not raise the limit on open descriptors to {most}: {}",
                std::io::Error::last_os_error()
            );
        }
    }
    soft_limit()
}

/// The most connections one listener holds open when the process may open `soft`
/// descriptors: half of what is left after [`RESERVED`] (a request in flight may hold an
/// upstream connection beside its client's), at least one.
#[must_use]
pub fn connection_room(soft: u64) -> usize {
    usize::try_from(soft.saturating_sub(RESERVED) / 2)
        .unwrap_or(usize::MAX)
        .max(1)
}

/// The soft limit on open descriptors now, if it can be read.
pub fn soft_limit() -> Option<u64> {
    soft_and_hard().map(|l| l.rlim_cur)
}

fn soft_and_hard() -> Option<libc::rlimit> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` lives across the call, which writes it.
    (unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0).then_some(limit)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_get_half_of_what_the_reserve_leaves_and_at_least_one() {
        assert_eq!(connection_room(1024), 384);
        assert_eq!(connection_room(1_048_576), 524_160);
        assert_eq!(connection_room(100), 1);
    }

    #[test]
    fn the_soft_limit_is_raised_to_the_hard_one() {
        let hard = soft_and_hard().expect("readable").rlim_max;
        let nr_open = std::fs::read_to_string("/proc/sys/fs/nr_open").expect("Linux");
        let nr_open: u64 = nr_open.trim().parse().expect("a number");
        let raised = raise_limit().expect("readable");
        assert!(raised <= hard);
        assert_eq!(soft_limit(), Some(raised));
        assert_eq!(raised, hard.min(nr_open));
    }
}
