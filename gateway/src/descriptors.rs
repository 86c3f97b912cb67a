//! The process's limit on open descriptors: raised to its hard limit at start (a default soft
//! limit of 1024 is far below what a gateway or a worker holds under load), and what it leaves
//! a listener's connections.

/// Descriptors kept out of the connections' share: the listeners, the admin port's
/// connections, the audit log's files, the workers' channels, the template sandbox's pipes.
const RESERVED: u64 = 256;

/// Raises this process's soft limit on open descriptors to its hard limit. Returns the soft
/// limit in force afterwards (`None` if it cannot be read; the limit is then left alone).
pub fn raise_limit() -> Option<u64> {
    let mut limit = soft_and_hard()?;
    if limit.rlim_cur < limit.rlim_max {
        limit.rlim_cur = limit.rlim_max;
        // SAFETY: `limit` lives across the call and is only read.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } != 0 {
            tracing::warn!(
                error = %std::io::Error::last_os_error(),
                "could not raise the limit on open descriptors"
            );
        }
    }
    soft_and_hard().map(|l| l.rlim_cur)
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
        assert_eq!(raise_limit(), Some(hard));
        assert_eq!(soft_limit(), Some(hard));
    }
}
