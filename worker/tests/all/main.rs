//! The worker's integration tests, in one binary to keep link time low.

mod admission;
mod batch_invariance;
mod common;
mod devices;
mod disaggregation;
mod golden;
mod isolation;
mod prefix_cache;
mod stops;
