//! Integration tests of `bulkhead-audit`, in one binary to keep link time low.

mod anchors;
mod common;
mod keyed;
mod log;
mod property;
mod tamper;
