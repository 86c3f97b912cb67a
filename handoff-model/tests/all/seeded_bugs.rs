//! Each seeded bug yields a counterexample: the checker can fail.

use bulkhead_handoff_model::properties::{
    I1_OWNERSHIP, I4_NO_LATE_WRITES, NO_FOREIGN_BYTES_READ, NO_OTHER_SESSION_BYTES_READ,
    no_foreign_bytes_read, ownership,
};
use bulkhead_handoff_model::{Config, Contents, ReqStatus, State, Variant};

use crate::support::{run, shortest};

/// Whether some running request has a page holding another session's bytes.
fn reads_other_sessions_bytes(s: &State) -> bool {
    s.requests.iter().any(|r| match r.status {
        ReqStatus::Running(nonce) => s.session(nonce).is_some_and(|x| {
            x.table.iter().any(|e| {
                matches!(s.pages[e.page.index()].contents, Contents::Bytes(other) if other != nonce)
            })
        }),
        _ => false,
    })
}

/// Whether some running request reads a cached prefix page holding the bytes of a session of
/// another tenant.
fn reads_other_tenants_prefix(s: &State) -> bool {
    s.requests.iter().any(|r| match r.status {
        ReqStatus::Running(nonce) => {
            s.session(nonce).and_then(|x| x.prefix).is_some_and(|p| {
                match s.pages[p.index()].contents {
                    Contents::Bytes(writer) => s.tenant_of(writer) != s.tenant_of(nonce),
                    Contents::Zero => false,
                }
            })
        }
        _ => false,
    })
}

#[test]
fn incident_variant_reads_another_sessions_bytes() {
    let config = Config::incident_shape(Variant::Incident);
    let report = run("Incident", &config);
    assert!(report.discoveries.contains_key(NO_FOREIGN_BYTES_READ));
    assert!(report.discoveries.contains_key(NO_OTHER_SESSION_BYTES_READ));
    let trace = shortest("Incident", &config, NO_OTHER_SESSION_BYTES_READ);
    assert!(reads_other_sessions_bytes(&trace.last));
}

#[test]
fn no_tag_check_variant_lets_a_late_frame_into_a_reused_page() {
    let config = Config::reuse_shape(Variant::NoTagCheck);
    let report = run("NoTagCheck", &config);
    assert!(report.discoveries.contains_key(NO_FOREIGN_BYTES_READ));
    assert!(report.discoveries.contains_key(I4_NO_LATE_WRITES));
    let trace = shortest("NoTagCheck", &config, NO_OTHER_SESSION_BYTES_READ);
    assert!(reads_other_sessions_bytes(&trace.last));
}

#[test]
fn eager_release_variant_writes_into_a_page_after_it_left_the_session() {
    let config = Config::incident_shape(Variant::EagerRelease);
    let report = run("EagerRelease", &config);
    assert!(report.discoveries.contains_key(I4_NO_LATE_WRITES));
    assert!(report.discoveries.contains_key(I1_OWNERSHIP));
    let trace = shortest("EagerRelease", &config, I4_NO_LATE_WRITES);
    assert!(trace.last.late_write.is_some());
}

#[test]
fn unscoped_cache_variant_reads_another_tenants_cached_prefix() {
    let config = Config::prefix_shape(Variant::UnscopedCache);
    let trace = shortest("UnscopedCache", &config, NO_OTHER_SESSION_BYTES_READ);
    assert!(reads_other_tenants_prefix(&trace.last));
    assert!(!no_foreign_bytes_read(&trace.last));
}

#[test]
fn unpinned_prefix_variant_lets_another_tenant_overwrite_a_page_being_read() {
    let config = Config::prefix_shape(Variant::UnpinnedPrefix);
    let trace = shortest("UnpinnedPrefix", &config, NO_OTHER_SESSION_BYTES_READ);
    assert!(reads_other_tenants_prefix(&trace.last));
    assert!(!no_foreign_bytes_read(&trace.last));
    assert!(!ownership(&trace.last));
}
