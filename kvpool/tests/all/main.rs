//! Integration tests of `bulkhead-kvpool`, in one binary to keep link time low.

mod lifecycle_model;
mod prefix_model;

/// Takes item `i` (modulo the length) out of `items`, if any: how the property tests pick one
/// of the objects they hold.
fn take<T>(items: &mut Vec<T>, i: usize) -> Option<T> {
    if items.is_empty() {
        None
    } else {
        Some(items.swap_remove(i % items.len()))
    }
}
