//! A plugin's log lines over time. One call may write a few lines (`host.rs`), but a plugin
//! called for every request could still write those at the request rate: a tenant's traffic
//! would become the gateway's log volume. So all the calls of one plugin share a budget of
//! lines a second; lines past it are dropped and counted, and the count is logged once, when
//! the next second's first line comes.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// The most lines one plugin's calls may log in a second, all of its calls together.
pub(super) const LINES_PER_SECOND: u32 = 64;

/// How long one budget lasts.
const WINDOW: Duration = Duration::from_secs(1);

/// The log budget of one loaded plugin, shared by all of its calls.
#[derive(Debug)]
pub(super) struct PluginLog {
    pub(super) name: Arc<str>,
    window: Mutex<Window>,
}

#[derive(Debug)]
struct Window {
    /// When the second began: at its first line (`None` before any).
    started: Option<Instant>,
    written: u32,
    /// Lines dropped since the last report.
    dropped: u64,
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
            window: Mutex::new(Window {
                started: None,
                written: 0,
                dropped: 0,
            }),
        }
    }

    /// Takes one line from the budget at `now`.
    pub(super) fn admit(&self, now: Instant) -> Admit {
        let mut w = self.window.lock().unwrap_or_else(PoisonError::into_inner);
        if w.started
            .is_none_or(|started| now.saturating_duration_since(started) >= WINDOW)
        {
            w.started = Some(now);
            w.written = 0;
        }
        if w.written >= LINES_PER_SECOND {
            w.dropped = w.dropped.saturating_add(1);
            return Admit {
                write: false,
                dropped_before: 0,
            };
        }
        w.written += 1;
        Admit {
            write: true,
            dropped_before: std::mem::take(&mut w.dropped),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plugin_writes_its_lines_a_second_and_the_drops_are_said_with_the_next_line() {
        let start = Instant::now();
        let log = PluginLog::new("chatty".into());
        let written = (0..1000).filter(|_| log.admit(start).write).count();
        assert_eq!(written, LINES_PER_SECOND as usize);
        // Still within the second: dropped.
        let late = start + WINDOW - Duration::from_millis(1);
        assert!(!log.admit(late).write);
        let next = log.admit(start + WINDOW);
        assert_eq!(
            next,
            Admit {
                write: true,
                dropped_before: 1000 - u64::from(LINES_PER_SECOND) + 1,
            }
        );
        // Said once.
        assert_eq!(log.admit(start + WINDOW).dropped_before, 0);
    }
}
