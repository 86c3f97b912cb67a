//! A value a process reads from files and keeps following: read again every
//! [`RELOAD_EVERY`], a changed value is used from then on, and files that cannot be used keep
//! the value in use. The cluster token and the TLS certificates follow their files this way, so
//! a rotation or a renewal needs no restart.

use std::fmt::Display;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

/// How often a process reads its cluster token and TLS files again.
pub const RELOAD_EVERY: Duration = Duration::from_secs(5);

/// The value as it is now, shared by every clone.
#[derive(Debug)]
pub struct Followed<T>(Arc<RwLock<Arc<T>>>);

impl<T> Clone for Followed<T> {
    fn clone(&self) -> Self {
        Followed(self.0.clone())
    }
}

impl<T> Followed<T> {
    pub fn new(value: T) -> Followed<T> {
        Followed(Arc::new(RwLock::new(Arc::new(value))))
    }

    /// The value as it is now.
    pub fn current(&self) -> Arc<T> {
        // A poisoned lock still holds a whole value: only a swap writes it.
        self.0
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// [`Followed::follow`] for a value made from files: every `every`, `read` gets their
    /// bytes, which `parse` makes a value of only when they differ from the bytes the current
    /// value was made from (`made_from`): files unchanged are not parsed again.
    pub async fn follow_files<R: PartialEq, E: Display>(
        self,
        every: Duration,
        what: &str,
        read: impl Fn() -> Result<R, E>,
        made_from: impl Fn(&T) -> &R,
        parse: impl Fn(R) -> Result<T, E>,
    ) {
        let reread = |current: &T| {
            let bytes = read()?;
            if bytes == *made_from(current) {
                return Ok(None);
            }
            parse(bytes).map(Some)
        };
        self.follow(every, what, reread).await;
    }

    /// Calls `reread` with the current value every `every`, for as long as it runs (it never
    /// returns): a value it returns (what changed) replaces the current one; `None` keeps it;
    /// an error keeps it too, and is logged once until it changes or goes (a file half
    /// written, missing or exposed).
    pub async fn follow<E: Display>(
        self,
        every: Duration,
        what: &str,
        reread: impl Fn(&T) -> Result<Option<T>, E>,
    ) {
        let mut failing: Option<String> = None;
        loop {
            tokio::time::sleep(every).await;
            match reread(&self.current()) {
                Ok(changed) => {
                    failing = None;
                    if let Some(value) = changed {
                        *self.0.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(value);
                        tracing::info!("{what} changed: reloaded");
                    }
                }
                Err(e) => {
                    let why = e.to_string();
                    if failing.as_ref() != Some(&why) {
                        tracing::warn!(error = %why, "cannot reload {what}; the one in use stays");
                        failing = Some(why);
                    }
                }
            }
        }
    }
}
