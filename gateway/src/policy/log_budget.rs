//! A plugin's log lines over time. One call may write a few lines (`host.rs`), but a plugin
//! called for every request could still write those at the request rate: a tenant's traffic
//! would become the gateway's log volume. So each tenant's calls of one plugin share a budget
//! of lines a second, and all of the plugin's calls a larger one; lines past either are dropped
//! and counted, and the count is logged once, with the tenant's next line. A budget of the
//! tenant's own means that one tenant's flood drops its own lines, not those of every other
//! tenant (a plugin's accounting among them).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// The most lines one tenant's calls of a plugin may log in a second, all together.
pub(super) const LINES_PER_TENANT: u32 = 64;

/// The most lines all of a plugin's calls may log in a second: a sixteenth each for a
/// flood of sixteen tenants.
pub(super) const LINES_PER_PLUGIN: u32 = 16 * LINES_PER_TENANT;

/// How long one budget lasts.
const WINDOW: Duration = Duration::from_secs(1);

/// Tenants' windows kept before those with nothing to say are forgotten.
const KEPT_TENANTS: usize = 4096;

/// The log budget of one loaded plugin, shared by all of its calls.
#[derive(Debug)]
pub(super) struct PluginLog {
    pub(super) name: Arc<str>,
    windows: Mutex<Windows>,
}

#[derive(Debug, Default)]
struct Windows {
    plugin: Window,
    /// The lines of calls made for no tenant: `configure` at load.
    load: Window,
    tenants: HashMap<Box<str>, Window>,
}

#[derive(Debug, Default)]
struct Window {
    /// When the second began: at its first line (`None` before any).
    started: Option<Instant>,
    written: u32,
    /// Lines dropped since the last report.
    dropped: u64,
}

impl Window {
    /// Starts a new second at `now` once the last one is over.
    fn roll(&mut self, now: Instant) {
        if self
            .started
            .is_none_or(|started| now.saturating_duration_since(started) >= WINDOW)
        {
            self.started = Some(now);
            self.written = 0;
        }
    }

    /// Whether forgetting the window would lose nothing: its second is over, its drops said.
    fn spent(&self, now: Instant) -> bool {
        self.dropped == 0
            && self
                .started
                .is_none_or(|started| now.saturating_duration_since(started) >= WINDOW)
    }
}

/// Whether a line may be written, and the lines dropped before it that are yet to be said.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Admit {
    pub(super) write: bool,
    pub(super) dropped_before: u64,
}

impl PluginLog {
    pub(super) fn new(name: Arc<str>) -> PluginLog {
        PluginLog {
            name,
            windows: Mutex::new(Windows::default()),
        }
    }

    /// Takes one line of `tenant`'s calls (`None`: the load's) from the budget at `now`.
    pub(super) fn admit(&self, tenant: Option<&str>, now: Instant) -> Admit {
        let mut guard = self.windows.lock().unwrap_or_else(PoisonError::into_inner);
        let Windows {
            plugin,
            load,
            tenants,
        } = &mut *guard;
        let own = match tenant {
            None => load,
            Some(tenant) => {
                if !tenants.contains_key(tenant) && tenants.len() >= KEPT_TENANTS {
                    tenants.retain(|_, w| !w.spent(now));
                }
                tenants.entry(tenant.into()).or_default()
            }
        };
        plugin.roll(now);
        own.roll(now);
        if own.written >= LINES_PER_TENANT || plugin.written >= LINES_PER_PLUGIN {
            own.dropped = own.dropped.saturating_add(1);
            return Admit {
                write: false,
                dropped_before: 0,
            };
        }
        own.written += 1;
        plugin.written += 1;
        Admit {
            write: true,
            dropped_before: std::mem::take(&mut own.dropped),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_writes_its_lines_a_second_and_the_drops_are_said_with_its_next_line() {
        let start = Instant::now();
        let log = PluginLog::new("chatty".into());
        let a = Some("tenant-a");
        let written = (0..1000).filter(|_| log.admit(a, start).write).count();
        assert_eq!(written, LINES_PER_TENANT as usize);
        // Still within the second: dropped.
        let late = start + WINDOW - Duration::from_millis(1);
        assert!(!log.admit(a, late).write);
        // Another tenant's lines are its own.
        assert_eq!(
            log.admit(Some("tenant-b"), late),
            Admit {
                write: true,
                dropped_before: 0
            }
        );
        assert!(log.admit(None, late).write, "the load's lines too");
        let next = log.admit(a, start + WINDOW);
        assert_eq!(
            next,
            Admit {
                write: true,
                dropped_before: 1000 - u64::from(LINES_PER_TENANT) + 1,
            }
        );
        // Said once.
        assert_eq!(log.admit(a, start + WINDOW).dropped_before, 0);
    }

    #[test]
    fn all_tenants_together_are_held_to_the_plugins_lines_a_second() {
        let start = Instant::now();
        let log = PluginLog::new("chatty".into());
        let tenants: Vec<String> = (0..20).map(|n| format!("t{n}")).collect();
        let written = tenants
            .iter()
            .flat_map(|t| (0..LINES_PER_TENANT).map(move |_| t))
            .filter(|t| log.admit(Some(t), start).write)
            .count();
        assert_eq!(written, LINES_PER_PLUGIN as usize);
        assert!(
            log.admit(Some("t19"), start + WINDOW).write,
            "a second later"
        );
    }

    #[test]
    fn tenants_with_nothing_to_say_are_forgotten_past_the_kept_count() {
        let start = Instant::now();
        let log = PluginLog::new("chatty".into());
        // A line each, a millisecond apart: fewer a second than the plugin's budget.
        let mut now = start;
        for n in 0..KEPT_TENANTS {
            now += Duration::from_millis(1);
            assert!(log.admit(Some(&format!("t{n}")), now).write);
        }
        log.admit(Some("late"), now + WINDOW);
        let kept = log.windows.lock().expect("not poisoned").tenants.len();
        assert_eq!(kept, 1, "only the late tenant's window is live");
    }
}
