//! Decode's sessions whose frames are still read — those in transfer and those draining —,
//! shared with the data plane, which reads no frame's bytes for any other.
//!
//! A frame's head names its session; its bytes are up to a page. Read before the session was
//! known, a peer that reaches the KV port could make decode hold a page of memory on every
//! connection it may open (twice the pool's pages), whatever sessions decode had reserved.
//! With this set the data plane reads such a frame's bytes past, never into a buffer.

use std::collections::HashMap;
use std::collections::hash_map::Values;
use std::sync::{Arc, PoisonError, RwLock};

use bulkhead_handoff::SessionNonce;

/// The sessions decode reads frames of, shared between the engine and the data plane.
#[derive(Debug, Clone, Default)]
pub struct LiveSessions(Arc<RwLock<HashMap<SessionNonce, u8>>>);

impl LiveSessions {
    /// Whether frames of `nonce` are still read.
    #[must_use]
    pub fn contains(&self, nonce: SessionNonce) -> bool {
        let sessions = self.0.read().unwrap_or_else(PoisonError::into_inner);
        sessions.contains_key(&nonce)
    }

    /// Keeps `nonce` live until the guard drops, whatever the maps do meanwhile: a session
    /// named to prefill before it enters a map, or moved from one map to the other, is never
    /// out of the set in between.
    pub(super) fn keep(&self, nonce: SessionNonce) -> Kept {
        self.enter(nonce);
        Kept {
            live: self.clone(),
            nonce,
        }
    }

    /// `nonce` entered one of the maps.
    fn enter(&self, nonce: SessionNonce) {
        let mut sessions = self.0.write().unwrap_or_else(PoisonError::into_inner);
        *sessions.entry(nonce).or_default() += 1;
    }

    /// `nonce` left one of the maps.
    fn leave(&self, nonce: SessionNonce) {
        let mut sessions = self.0.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = sessions.get_mut(&nonce) {
            *n -= 1;
            if *n == 0 {
                sessions.remove(&nonce);
            }
        }
    }
}

/// A session kept live ([`LiveSessions::keep`]) until dropped.
#[derive(Debug)]
pub(super) struct Kept {
    live: LiveSessions,
    nonce: SessionNonce,
}

impl Drop for Kept {
    fn drop(&mut self) {
        self.live.leave(self.nonce);
    }
}

/// A map of sessions whose keys are in [`LiveSessions`] for as long as they are in the map.
#[derive(Debug)]
pub(super) struct Tracked<V> {
    map: HashMap<SessionNonce, V>,
    live: LiveSessions,
}

impl<V> Tracked<V> {
    pub(super) fn new(live: LiveSessions) -> Self {
        Self {
            map: HashMap::new(),
            live,
        }
    }

    pub(super) fn insert(&mut self, nonce: SessionNonce, value: V) {
        if self.map.insert(nonce, value).is_none() {
            self.live.enter(nonce);
        }
    }

    pub(super) fn remove(&mut self, nonce: &SessionNonce) -> Option<V> {
        let value = self.map.remove(nonce)?;
        self.live.leave(*nonce);
        Some(value)
    }

    pub(super) fn get_mut(&mut self, nonce: &SessionNonce) -> Option<&mut V> {
        self.map.get_mut(nonce)
    }

    pub(super) fn len(&self) -> usize {
        self.map.len()
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = (&SessionNonce, &V)> {
        self.map.iter()
    }

    pub(super) fn values(&self) -> Values<'_, SessionNonce, V> {
        self.map.values()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A session moved from one map to the other is live throughout, and not once it left
    /// both; kept, it is live before it enters a map and while it moves in the engine's order
    /// (out of one, then into the other).
    #[test]
    fn a_session_is_live_while_in_either_map() {
        let live = LiveSessions::default();
        let (mut transfers, mut draining) =
            (Tracked::new(live.clone()), Tracked::new(live.clone()));
        let nonce = SessionNonce([7; 16]);
        assert!(!live.contains(nonce));
        transfers.insert(nonce, ());
        transfers.insert(nonce, ());
        assert!(live.contains(nonce));
        draining.insert(nonce, ());
        assert!(transfers.remove(&nonce).is_some());
        assert!(live.contains(nonce), "still draining");
        assert!(draining.remove(&nonce).is_some());
        assert!(!live.contains(nonce));
        assert!(draining.remove(&nonce).is_none());
        assert!(!live.contains(nonce));

        let kept = live.keep(nonce);
        assert!(live.contains(nonce), "named before it is in a map");
        transfers.insert(nonce, ());
        drop(kept);
        let kept = live.keep(nonce);
        assert!(transfers.remove(&nonce).is_some());
        assert!(live.contains(nonce), "moving");
        draining.insert(nonce, ());
        drop(kept);
        assert!(live.contains(nonce), "draining");
        assert!(draining.remove(&nonce).is_some());
        assert!(!live.contains(nonce));
        drop(live.keep(nonce));
        assert!(!live.contains(nonce), "a reservation whose caller was gone");
    }
}
