//! The properties checked in every reachable state.

use stateright::Property;

use crate::ids::Nonce;
use crate::model::HandoffModel;
use crate::state::{Contents, Holder, Outcome, ReqStatus, Session, State};

/// Name of the mission property.
pub const NO_FOREIGN_BYTES_READ: &str = "no_foreign_bytes_read";
/// Name of the sharper leak property.
pub const NO_OTHER_SESSION_BYTES_READ: &str = "no_other_session_bytes_read";
/// Name of I1.
pub const I1_OWNERSHIP: &str = "i1_ownership";
/// Name of I4.
pub const I4_NO_LATE_WRITES: &str = "i4_no_late_writes";
/// Name of the "some request commits" example.
pub const SOME_REQUEST_COMMITS: &str = "some_request_commits";
/// Name of the "some request is rejected" example.
pub const SOME_REQUEST_REJECTED: &str = "some_request_rejected";
/// Name of the "some page is allocated twice" example.
pub const SOME_PAGE_REUSED: &str = "some_page_reused";
/// Name of the "some quarantine is reclaimed" example.
pub const SOME_QUARANTINE_RECLAIMED: &str = "some_quarantine_reclaimed";
/// Name of the "some request commits over a cached prefix" example.
pub const SOME_PREFIX_READ: &str = "some_prefix_read";
/// Name of the "some cached page is evicted" example.
pub const SOME_CACHED_PAGE_EVICTED: &str = "some_cached_page_evicted";

/// The always-properties a correct protocol must keep.
pub const SAFETY: [&str; 4] = [
    NO_FOREIGN_BYTES_READ,
    NO_OTHER_SESSION_BYTES_READ,
    I1_OWNERSHIP,
    I4_NO_LATE_WRITES,
];

/// The sometimes-properties that show the model is not vacuous.
pub const EXAMPLES: [&str; 6] = [
    SOME_REQUEST_COMMITS,
    SOME_REQUEST_REJECTED,
    SOME_PAGE_REUSED,
    SOME_QUARANTINE_RECLAIMED,
    SOME_PREFIX_READ,
    SOME_CACHED_PAGE_EVICTED,
];

pub(crate) fn all() -> Vec<Property<HandoffModel>> {
    vec![
        Property::always(NO_FOREIGN_BYTES_READ, |_, s| no_foreign_bytes_read(s)),
        Property::always(NO_OTHER_SESSION_BYTES_READ, |_, s| {
            no_other_session_bytes_read(s)
        }),
        Property::always(I1_OWNERSHIP, |_, s| ownership(s)),
        Property::always(I4_NO_LATE_WRITES, |_, s| no_late_writes(s)),
        Property::sometimes(SOME_REQUEST_COMMITS, |_, s| some_request_commits(s)),
        Property::sometimes(SOME_REQUEST_REJECTED, |_, s| some_request_rejected(s)),
        Property::sometimes(SOME_PAGE_REUSED, |_, s| some_page_reused(s)),
        Property::sometimes(SOME_QUARANTINE_RECLAIMED, |_, s: &State| s.reclaimed),
        Property::sometimes(SOME_PREFIX_READ, |_, s: &State| s.prefix_read),
        Property::sometimes(SOME_CACHED_PAGE_EVICTED, |_, s: &State| s.evicted),
    ]
}

/// I4: no session's bytes ever landed in a page that the session did not hold at that moment.
#[must_use]
pub fn no_late_writes(s: &State) -> bool {
    s.late_write.is_none()
}

/// Example: a request has committed (it is running or has finished).
#[must_use]
pub fn some_request_commits(s: &State) -> bool {
    s.requests.iter().any(|r| {
        matches!(
            r.status,
            ReqStatus::Running(_) | ReqStatus::Done(Outcome::Finished)
        )
    })
}

/// Example: a request got an explicit rejection (decode's or prefill's admission).
#[must_use]
pub fn some_request_rejected(s: &State) -> bool {
    s.requests.iter().any(|r| {
        matches!(
            r.status,
            ReqStatus::Done(Outcome::RejectedByDecode | Outcome::RejectedByPrefill)
        )
    })
}

/// Example: a page has been allocated a second time.
#[must_use]
pub fn some_page_reused(s: &State) -> bool {
    s.pages.iter().any(|p| p.allocations >= 2)
}

/// The mission: a request that attends over its pages (committed, running) finds in every one
/// of its reservation exactly its own session's bytes, and in the cached prefix page it reads
/// the bytes of a session of its own tenant — never zero, never anyone else's.
#[must_use]
pub fn no_foreign_bytes_read(s: &State) -> bool {
    running_sessions(s).all(|(nonce, session)| {
        session.is_some_and(|x| {
            let own = x
                .table
                .iter()
                .all(|e| s.pages[e.page.index()].contents == Contents::Bytes(nonce));
            let prefix = x.prefix.is_none_or(|p| match s.pages[p.index()].contents {
                Contents::Bytes(writer) => same_tenant(s, writer, nonce),
                Contents::Zero => false,
            });
            own && prefix
        })
    })
}

/// The leak itself: a running request never finds another session's bytes in its
/// reservation, nor another tenant's in the cached prefix page it reads (zero pages are wrong
/// too, but only [`no_foreign_bytes_read`] says so).
#[must_use]
pub fn no_other_session_bytes_read(s: &State) -> bool {
    running_sessions(s).all(|(nonce, session)| {
        session.is_some_and(|x| {
            let own = x.table.iter().all(|e| {
                !matches!(s.pages[e.page.index()].contents, Contents::Bytes(other) if other != nonce)
            });
            let prefix = x.prefix.is_none_or(|p| {
                !matches!(s.pages[p.index()].contents,
                    Contents::Bytes(writer) if !same_tenant(s, writer, nonce))
            });
            own && prefix
        })
    })
}

/// Whether sessions `a` and `b` are of one tenant.
fn same_tenant(s: &State, a: Nonce, b: Nonce) -> bool {
    matches!((s.tenant_of(a), s.tenant_of(b)), (Some(x), Some(y)) if x == y)
}

/// I1: each page is free, quarantined, cached, or held by exactly one session — and the
/// allocator, the prefix cache and the transfer table agree on it: a page the allocator holds
/// for session `n` is in `n`'s table and no other open session's; a free, quarantined or
/// cached page is in no open session's table; a cached page's pins are the open sessions
/// reading it; the prefix page an open session reads is cached.
#[must_use]
pub fn ownership(s: &State) -> bool {
    let pages = s.pages.iter().enumerate().all(|(i, page)| {
        let mut claims = s
            .sessions
            .iter()
            .filter(|x| x.table.iter().any(|e| e.page.index() == i))
            .map(|x| x.nonce);
        match page.holder {
            Holder::Free | Holder::Quarantined(_) => claims.next().is_none(),
            Holder::Cached { pins, .. } => {
                let readers = s
                    .sessions
                    .iter()
                    .filter(|x| x.prefix.is_some_and(|p| p.index() == i))
                    .count();
                claims.next().is_none() && usize::from(pins) == readers
            }
            Holder::Held(owner, _) => claims.next() == Some(owner) && claims.next().is_none(),
        }
    });
    let prefixes = s.sessions.iter().all(|x| {
        x.prefix
            .is_none_or(|p| matches!(s.pages[p.index()].holder, Holder::Cached { .. }))
    });
    pages && prefixes
}

/// Every running request's nonce and session (`None`, a violation, if its session is gone).
fn running_sessions(s: &State) -> impl Iterator<Item = (Nonce, Option<&Session>)> + '_ {
    s.requests.iter().filter_map(|r| match r.status {
        ReqStatus::Running(nonce) => Some((nonce, s.session(nonce))),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use stateright::Model;

    use super::*;
    use crate::config::{Config, Variant};
    use crate::ids::{PageIdx, ReqIdx, Tag};
    use crate::model::Action;
    use crate::net::Slot;
    use crate::state::{Hold, Phase};

    fn start() -> (HandoffModel, State) {
        let model = HandoffModel::new(Config::reuse_shape(Variant::Correct));
        let init = model.init_states().remove(0);
        let admitted = model
            .next_state(&init, Action::Admit(ReqIdx(0)))
            .expect("admission of R1 changes the state");
        (model, admitted)
    }

    #[test]
    fn a_page_claimed_by_two_sessions_breaks_i1() {
        let (_, mut s) = start();
        assert!(ownership(&s));
        let mut other = s.sessions[0].clone();
        other.nonce = Nonce(9);
        s.sessions.push(other);
        assert!(!ownership(&s));
    }

    #[test]
    fn a_free_page_in_an_open_table_breaks_i1() {
        let (_, mut s) = start();
        s.pages[0].holder = Holder::Free;
        assert!(!ownership(&s));
    }

    #[test]
    fn a_running_request_over_a_zero_page_reads_foreign_bytes() {
        let (_, mut s) = start();
        let nonce = s.sessions[0].nonce;
        s.requests[0].status = ReqStatus::Running(nonce);
        s.sessions[0].phase = Phase::Running;
        s.pages[0].contents = Contents::Bytes(nonce);
        s.pages[1].contents = Contents::Bytes(nonce);
        assert!(no_foreign_bytes_read(&s));
        s.pages[1].contents = Contents::Zero;
        assert!(!no_foreign_bytes_read(&s));
        assert!(no_other_session_bytes_read(&s));
        s.pages[1].contents = Contents::Bytes(Nonce(7));
        assert!(!no_other_session_bytes_read(&s));
    }

    #[test]
    fn a_running_request_whose_session_vanished_fails_the_mission() {
        let (_, mut s) = start();
        s.requests[0].status = ReqStatus::Running(Nonce(5));
        s.sessions.push(Session {
            nonce: Nonce(6),
            req: ReqIdx(1),
            prefix: None,
            table: vec![Slot {
                page: PageIdx(2),
                tag: Tag(3),
            }],
            written: vec![0],
            phase: Phase::Transfer,
        });
        s.pages[2].holder = Holder::Held(Nonce(6), Hold::Reserved);
        assert!(!no_foreign_bytes_read(&s));
    }

    /// R1 (nonce 0, tenant 0) admitted over p0–p1 and reading p2 from the cache, pinned once;
    /// session 1 is another of tenant 0's.
    fn reading_a_cached_prefix() -> State {
        let (_, mut s) = start();
        s.sessions[0].prefix = Some(PageIdx(2));
        s.pages[2].holder = Holder::Cached { tenant: 0, pins: 1 };
        s.tenant_of = vec![0, 0];
        s
    }

    #[test]
    fn a_cached_page_pinned_by_other_than_its_readers_breaks_i1() {
        let mut s = reading_a_cached_prefix();
        assert!(ownership(&s));
        s.pages[2].holder = Holder::Cached { tenant: 0, pins: 0 };
        assert!(!ownership(&s));
        s.pages[2].holder = Holder::Cached { tenant: 0, pins: 2 };
        assert!(!ownership(&s));
    }

    #[test]
    fn a_prefix_page_that_left_the_cache_under_its_reader_breaks_i1() {
        let mut s = reading_a_cached_prefix();
        s.pages[2].holder = Holder::Free;
        assert!(!ownership(&s));
    }

    #[test]
    fn a_cached_prefix_is_read_only_from_the_readers_own_tenant() {
        let mut s = reading_a_cached_prefix();
        let nonce = s.sessions[0].nonce;
        s.requests[0].status = ReqStatus::Running(nonce);
        s.sessions[0].phase = Phase::Running;
        s.pages[0].contents = Contents::Bytes(nonce);
        s.pages[1].contents = Contents::Bytes(nonce);
        s.pages[2].contents = Contents::Bytes(Nonce(1));
        assert!(no_foreign_bytes_read(&s));
        assert!(no_other_session_bytes_read(&s));
        s.tenant_of[1] = 1;
        assert!(!no_foreign_bytes_read(&s));
        assert!(!no_other_session_bytes_read(&s));
        s.pages[2].contents = Contents::Zero;
        assert!(!no_foreign_bytes_read(&s));
        assert!(no_other_session_bytes_read(&s));
    }
}
