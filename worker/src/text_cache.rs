//! A small map from texts to values, shared between threads, that empties itself when it is
//! full: the texts that repeat on every request (a chat template's pieces) stay, and texts
//! that vary from request to request cannot grow it.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

#[derive(Debug)]
pub(crate) struct TextCache<V> {
    map: Mutex<HashMap<String, V>>,
    capacity: usize,
}

impl<V: Clone> TextCache<V> {
    pub(crate) fn new(capacity: usize) -> TextCache<V> {
        TextCache {
            map: Mutex::new(HashMap::new()),
            capacity,
        }
    }

    /// The value kept for `text`, if any.
    pub(crate) fn get(&self, text: &str) -> Option<V> {
        self.lock().get(text).cloned()
    }

    /// The value kept for `text`, or `make`'s, kept from now on. `make` runs outside the
    /// lock: two threads may both make a new text's value, and one of them is kept. Its error
    /// is returned and nothing is kept.
    pub(crate) fn get_or_make<E>(
        &self,
        text: &str,
        make: impl FnOnce() -> Result<V, E>,
    ) -> Result<V, E> {
        if let Some(v) = self.get(text) {
            return Ok(v);
        }
        let v = make()?;
        let mut map = self.lock();
        if map.len() >= self.capacity {
            map.clear();
        }
        map.insert(text.to_owned(), v.clone());
        Ok(v)
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, V>> {
        self.map.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_value_is_not_made_again_and_the_map_never_exceeds_its_capacity() {
        let cache = TextCache::new(3);
        let made = std::cell::Cell::new(0);
        let make = |v: u32| {
            made.set(made.get() + 1);
            Ok::<u32, ()>(v)
        };
        assert_eq!(cache.get_or_make("a", || make(1)), Ok(1));
        assert_eq!(cache.get_or_make("a", || make(2)), Ok(1), "kept");
        assert_eq!(made.get(), 1);
        assert_eq!(cache.get_or_make("b", || Err(())), Err(()));
        assert_eq!(cache.len(), 1, "a failure keeps nothing");
        for i in 0..10 {
            cache.get_or_make(&i.to_string(), || make(i)).expect("made");
            assert!(cache.len() <= 3);
        }
    }
}
