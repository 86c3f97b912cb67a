//! Integration tests of `bulkhead-handoff-model`, in one binary to keep link time low.

mod correct;
mod seeded_bugs;
mod support;
