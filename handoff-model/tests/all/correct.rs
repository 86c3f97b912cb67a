//! The real protocol keeps every property, and the examples are reachable (so the properties
//! are not vacuous).

use bulkhead_handoff_model::properties::{
    SAFETY, SOME_CACHED_PAGE_EVICTED, SOME_PAGE_REUSED, SOME_PREFIX_READ,
    SOME_QUARANTINE_RECLAIMED, SOME_REQUEST_COMMITS, SOME_REQUEST_REJECTED,
};
use bulkhead_handoff_model::{Config, Variant};

use crate::support::run;

fn assert_correct(label: &str, config: &Config, examples: &[&'static str]) {
    let report = run(label, config);
    assert!(report.complete, "{label}: the check did not finish");
    for name in SAFETY {
        if let Some(trace) = report.discoveries.get(name) {
            panic!("{label}: `{name}` violated:\n{}", trace.render());
        }
    }
    for name in examples {
        assert!(
            report.discoveries.contains_key(name),
            "{label}: `{name}` never happens, so the model is vacuous there"
        );
    }
}

#[test]
fn correct_protocol_never_reads_foreign_bytes_in_the_incident_shape() {
    assert_correct(
        "Correct, incident shape",
        &Config::incident_shape(Variant::Correct),
        &[
            SOME_REQUEST_COMMITS,
            SOME_REQUEST_REJECTED,
            SOME_PAGE_REUSED,
            SOME_QUARANTINE_RECLAIMED,
        ],
    );
}

#[test]
fn correct_protocol_never_reads_foreign_bytes_with_page_reuse() {
    assert_correct(
        "Correct, reuse shape",
        &Config::reuse_shape(Variant::Correct),
        &[SOME_REQUEST_COMMITS, SOME_PAGE_REUSED],
    );
}

#[test]
fn correct_protocol_never_reads_foreign_bytes_with_retries() {
    assert_correct(
        "Correct, retry shape",
        &Config::retry_shape(Variant::Correct),
        &[SOME_REQUEST_COMMITS, SOME_PAGE_REUSED],
    );
}

#[test]
fn correct_protocol_reads_only_its_own_tenants_cached_prefix() {
    assert_correct(
        "Correct, prefix shape",
        &Config::prefix_shape(Variant::Correct),
        &[
            SOME_REQUEST_COMMITS,
            SOME_PAGE_REUSED,
            SOME_PREFIX_READ,
            SOME_CACHED_PAGE_EVICTED,
        ],
    );
}
