//! Integration tests of `bulkhead-kvpool`, in one binary to keep link time low.

mod lifecycle_model;
mod prefix_model;
