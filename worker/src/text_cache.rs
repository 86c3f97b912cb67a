//! A small map from texts to values, shared between threads, bounded in entries and in bytes:
//! when it is full, the entries used least recently make room, so the texts that repeat on
//! every request (a chat template's pieces, the frames of common conversations) stay, and texts
//! that vary from request to request — one client's stream of new ones included — cannot grow
//! it or push the repeated ones out for long. A value too large to keep (more than a sixteenth
//! of the bytes) is made every time instead. Made for a few hundred entries: making room scans
//! them.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

/// The bytes a kept value holds beyond its own size (what [`TextCache`] bounds).
pub(crate) trait Held {
    fn held_bytes(&self) -> usize;
}

#[derive(Debug)]
pub(crate) struct TextCache<V> {
    kept: Mutex<Kept<V>>,
    capacity: usize,
    max_bytes: usize,
}

#[derive(Debug)]
struct Kept<V> {
    /// Each text's value, its bytes, and when it was last used.
    map: HashMap<String, Entry<V>>,
    /// The texts' and the values' bytes.
    bytes: usize,
    /// The clock of uses: counts every lookup.
    uses: u64,
}

#[derive(Debug)]
struct Entry<V> {
    value: V,
    bytes: usize,
    used: u64,
}

impl<V: Clone + Held> TextCache<V> {
    /// At most `capacity` entries of at most `max_bytes` in all.
    pub(crate) fn new(capacity: usize, max_bytes: usize) -> TextCache<V> {
        TextCache {
            kept: Mutex::new(Kept {
                map: HashMap::new(),
                bytes: 0,
                uses: 0,
            }),
            capacity,
            max_bytes,
        }
    }

    /// The value kept for `text`, if any.
    pub(crate) fn get(&self, text: &str) -> Option<V> {
        let mut kept = self.lock();
        kept.uses += 1;
        let now = kept.uses;
        let entry = kept.map.get_mut(text)?;
        entry.used = now;
        Some(entry.value.clone())
    }

    /// The value kept for `text`, or `make`'s, kept from now on unless it is too large to. `make`
    /// runs outside the lock: two threads may both make a new text's value, and one of them is
    /// kept. Its error is returned and nothing is kept.
    pub(crate) fn get_or_make<E>(
        &self,
        text: &str,
        make: impl FnOnce() -> Result<V, E>,
    ) -> Result<V, E> {
        if let Some(v) = self.get(text) {
            return Ok(v);
        }
        let v = make()?;
        let bytes = text.len() + v.held_bytes();
        if bytes > self.max_bytes / 16 {
            return Ok(v);
        }
        let mut kept = self.lock();
        if kept.map.contains_key(text) {
            return Ok(v); // another thread made it meanwhile
        }
        while !kept.map.is_empty()
            && (kept.map.len() >= self.capacity || kept.bytes + bytes > self.max_bytes)
        {
            kept.evict_least_recent();
        }
        kept.uses += 1;
        let used = kept.uses;
        kept.bytes += bytes;
        let entry = Entry {
            value: v.clone(),
            bytes,
            used,
        };
        kept.map.insert(text.to_owned(), entry);
        Ok(v)
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lock().map.len()
    }

    #[cfg(test)]
    pub(crate) fn bytes(&self) -> usize {
        self.lock().bytes
    }

    fn lock(&self) -> MutexGuard<'_, Kept<V>> {
        self.kept.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl<V> Kept<V> {
    fn evict_least_recent(&mut self) {
        let oldest = self
            .map
            .iter()
            .min_by_key(|(_, e)| e.used)
            .map(|(text, _)| text.clone());
        if let Some(e) = oldest.and_then(|text| self.map.remove(&text)) {
            self.bytes -= e.bytes;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Held for String {
        fn held_bytes(&self) -> usize {
            self.len()
        }
    }

    #[test]
    fn a_kept_value_is_not_made_again_and_the_map_never_exceeds_its_capacity() {
        let cache = TextCache::new(3, 1 << 20);
        let made = std::cell::Cell::new(0);
        let make = |v: u32| {
            made.set(made.get() + 1);
            Ok::<String, ()>(v.to_string())
        };
        assert_eq!(cache.get_or_make("a", || make(1)), Ok("1".into()));
        assert_eq!(cache.get_or_make("a", || make(2)), Ok("1".into()), "kept");
        assert_eq!(made.get(), 1);
        assert_eq!(cache.get_or_make("b", || Err(())), Err(()));
        assert_eq!(cache.len(), 1, "a failure keeps nothing");
        for i in 0..10 {
            cache.get_or_make(&i.to_string(), || make(i)).expect("made");
            assert!(cache.len() <= 3);
        }
    }

    #[test]
    fn the_map_never_holds_more_than_its_bytes_and_a_value_too_large_is_not_kept() {
        let cache = TextCache::new(1000, 1600);
        for i in 0..100 {
            let text = format!("{i:04}");
            let v = cache
                .get_or_make(&text, || Ok::<_, ()>("v".repeat(90)))
                .expect("made");
            assert_eq!(v.len(), 90);
            assert!(cache.bytes() <= 1600, "{}", cache.bytes());
            assert_eq!(cache.get(&text), Some(v), "just kept");
        }
        // A sixteenth of the bytes is the most one entry may hold.
        let big = cache
            .get_or_make("big", || Ok::<_, ()>("v".repeat(200)))
            .expect("made");
        assert_eq!(big.len(), 200, "made and returned");
        assert_eq!(cache.get("big"), None, "not kept");
    }

    /// A stream of new texts (one client's) makes room by the entries used least recently:
    /// the one every request uses stays. Emptying the whole map when it was full let a few
    /// hundred new texts throw it out again and again.
    #[test]
    fn new_texts_push_out_the_least_recently_used_never_the_one_in_use() {
        let cache = TextCache::new(4, 1 << 20);
        let made = std::cell::Cell::new(0);
        let make = |v: &str| {
            made.set(made.get() + 1);
            Ok::<String, ()>(v.to_owned())
        };
        cache.get_or_make("common", || make("c")).expect("made");
        for i in 0..100 {
            cache.get_or_make("common", || make("c")).expect("kept");
            cache
                .get_or_make(&format!("new {i}"), || make("n"))
                .expect("made");
            assert!(cache.len() <= 4);
        }
        assert_eq!(made.get(), 101, "the common text was made once");
        assert_eq!(cache.get("new 99"), Some("n".into()), "the newest is kept");
        assert_eq!(cache.get("new 0"), None, "the oldest made room");
    }
}
