//! Reading audit records over HTTP: `GET /v1/audit?since=…&limit=…` on the API (the calling
//! tenant's records only — the tenant comes from the key, never from the request) and
//! `GET /audit/{tenant}?since=…&limit=…` on the admin listener (any tenant's, including the
//! gateway's own log).
//!
//! The query takes exactly `since` (a record's `seq`, the cursor; default 0) and `limit`
//! (1 to [`MAX_LIMIT`], default [`DEFAULT_LIMIT`]); anything else is refused with 400, so a
//! crafted `tenant=` or path parameter cannot change whose log is read.

use axum::extract::{Extension, Path, RawQuery, State};
use axum::response::{IntoResponse, Response};
use bulkhead_audit::{AuditRecord, Seq, Sha256Digest, TenantId};
use http::header::CONTENT_TYPE;
use serde::Serialize;

use crate::api::ApiError;
use crate::api::validate::RequestError;
use crate::auth::Authenticated;
use crate::limits::RequestPermit;
use crate::tenants::Tenants;

use super::Recorder;

/// Records per page when the query does not say.
pub const DEFAULT_LIMIT: usize = 100;
/// The most records one page holds.
pub const MAX_LIMIT: usize = 1000;
/// The most bytes of log lines one page holds (the first record whatever its size): records
/// with captured content can be a megabyte each, and a page is held in memory and sent whole.
const MAX_PAGE_BYTES: usize = 4 << 20;

/// One page of a tenant's records.
#[derive(Debug, Serialize)]
pub struct AuditPage {
    pub object: &'static str,
    pub tenant: String,
    pub data: Vec<Entry>,
    /// Whether records after this page exist (durable at the time of the read).
    pub has_more: bool,
    /// The `since` of the next page.
    pub next_since: u64,
}

/// A record, its place in the chain and its line's SHA-256 (in an unkeyed log the next
/// record's `prev`; a keyed log links by MAC): a tenant that keeps the digest of the last
/// record it read can check later that the log up to it was not rewritten, even with every
/// hash recomputed.
#[derive(Debug, Serialize)]
pub struct Entry {
    pub seq: u64,
    pub digest: Sha256Digest,
    pub record: AuditRecord,
}

/// The paging parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Paging {
    since: u64,
    limit: usize,
}

/// The paging parameters of a query string, its names and values percent-decoded (as any
/// client may encode them).
fn parse_paging(query: Option<&str>) -> Result<Paging, RequestError> {
    let (mut since, mut limit) = (None, None);
    for (key, value) in form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
        let number = |field: &str| {
            value.parse::<u64>().map_err(|_| RequestError::WrongType {
                field: field.to_owned(),
                expected: "a non-negative integer",
            })
        };
        match &*key {
            "since" => once(&mut since, number("since")?, "since")?,
            "limit" => {
                let n = number("limit")?;
                let n = usize::try_from(n)
                    .ok()
                    .filter(|n| (1..=MAX_LIMIT).contains(n))
                    .ok_or_else(|| RequestError::OutOfRange {
                        field: "limit",
                        value: n.to_string(),
                        range: "1 to 1000",
                    })?;
                once(&mut limit, n, "limit")?;
            }
            other => {
                return Err(RequestError::UnsupportedField {
                    field: other.chars().take(64).collect(),
                });
            }
        }
    }
    Ok(Paging {
        since: since.unwrap_or(0),
        limit: limit.unwrap_or(DEFAULT_LIMIT),
    })
}

/// Sets a parameter given once; one given twice is refused (which one a server takes differs
/// from server to server).
fn once<T>(slot: &mut Option<T>, value: T, field: &'static str) -> Result<(), RequestError> {
    match slot.replace(value) {
        None => Ok(()),
        Some(_) => Err(RequestError::Repeated {
            field: field.to_owned(),
        }),
    }
}

/// A page of `tenant`'s records, read and written out on the blocking pool (a page can be
/// megabytes: a serving thread's other connections do not wait for it). `permit`, the
/// tenant's request slot, is held by the read itself: a client that leaves does not free it
/// while the read goes on.
async fn page(
    recorder: &Recorder,
    tenant: TenantId,
    paging: Paging,
    permit: Option<RequestPermit>,
) -> Response {
    let recorder = recorder.clone();
    let page = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        let limit = bulkhead_audit::Limit {
            records: paging.limit,
            bytes: MAX_PAGE_BYTES,
        };
        let read = recorder
            .read_page(&tenant, Seq(paging.since), limit)
            .inspect_err(|e| {
                tracing::error!(error = %e, tenant = %tenant, "reading the audit log failed");
            })
            .map_err(|_| ApiError::AuditUnavailable)?;
        let next_since = read
            .records
            .last()
            .map_or(paging.since, |r| r.seq.0.saturating_add(1));
        let page = AuditPage {
            object: "list",
            tenant: tenant.to_string(),
            data: read
                .records
                .into_iter()
                .map(|r| Entry {
                    seq: r.seq.0,
                    digest: r.digest,
                    record: r.record,
                })
                .collect(),
            has_more: read.more,
            next_since,
        };
        serde_json::to_string(&page).map_err(|_| ApiError::Internal)
    })
    .await;
    match page {
        Ok(Ok(body)) => ([(CONTENT_TYPE, "application/json")], body).into_response(),
        Ok(Err(e)) => e.into_response(),
        Err(_) => ApiError::Internal.into_response(),
    }
}

/// `GET /v1/audit`: the calling tenant's own records, read under `permit`.
pub async fn tenant_read(
    State(recorder): State<Recorder>,
    Extension(who): Extension<Authenticated>,
    RawQuery(query): RawQuery,
    permit: RequestPermit,
) -> Response {
    match parse_paging(query.as_deref()) {
        Ok(paging) => page(&recorder, who.tenant.id.clone(), paging, Some(permit)).await,
        Err(e) => ApiError::from(e).into_response(),
    }
}

/// `GET /audit/{tenant}` on the admin listener: any tenant's records — a configured tenant's
/// (none yet is an empty page), a removed tenant's whose log remains, the gateway's own; any
/// other name is 404, so a typo is not read as a tenant with nothing to show.
pub async fn admin_read(
    State(recorder): State<Recorder>,
    State(tenants): State<Tenants>,
    tenant: Result<Path<String>, axum::extract::rejection::PathRejection>,
    RawQuery(query): RawQuery,
) -> Response {
    // A name that is not UTF-8 is no tenant id either (and is told so in the API's shape, not
    // the extractor's plain text).
    let Some(tenant) = tenant.ok().and_then(|Path(t)| TenantId::new(&t).ok()) else {
        return ApiError::from(RequestError::WrongType {
            field: "tenant".into(),
            expected: "a tenant id (1 to 64 of a-z, 0-9, '-', '_')",
        })
        .into_response();
    };
    if !recorder.holds(&tenant) && tenants.current().get(&tenant).is_none() {
        return ApiError::NoAuditLog {
            tenant: tenant.to_string(),
        }
        .into_response();
    }
    match parse_paging(query.as_deref()) {
        Ok(paging) => page(&recorder, tenant, paging, None).await,
        Err(e) => ApiError::from(e).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paging_defaults_and_bounds() {
        assert_eq!(
            parse_paging(None),
            Ok(Paging {
                since: 0,
                limit: DEFAULT_LIMIT
            })
        );
        assert_eq!(
            parse_paging(Some("since=7&limit=3")),
            Ok(Paging { since: 7, limit: 3 })
        );
        // Names and values percent-decoded, as any client may send them.
        assert_eq!(
            parse_paging(Some("%6cimit=%33&since=%37")),
            Ok(Paging { since: 7, limit: 3 })
        );
        assert!(parse_paging(Some("limit=0")).is_err());
        assert!(parse_paging(Some("limit=1001")).is_err());
        assert!(parse_paging(Some("since=-1")).is_err());
        assert!(parse_paging(Some("since=abc")).is_err());
        for twice in [
            "since=0&since=5",
            "limit=1&limit=2",
            "limit=3&since=1&limit=3",
        ] {
            let e = parse_paging(Some(twice)).expect_err(twice);
            assert!(matches!(e, RequestError::Repeated { .. }), "{twice}: {e:?}");
        }
    }

    #[test]
    fn a_tenant_parameter_or_anything_else_is_refused_not_ignored() {
        for q in [
            "tenant=tenant-b",
            "since=0&tenant=tenant-b",
            "tenant%3Dx=1",
            "..%2Ftenant-b=1",
        ] {
            let e = parse_paging(Some(q)).expect_err(q);
            assert!(
                matches!(e, RequestError::UnsupportedField { .. }),
                "{q}: {e:?}"
            );
        }
    }
}
