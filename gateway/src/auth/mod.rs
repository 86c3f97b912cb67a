//! Authentication: `Authorization: Bearer <key>` → tenant, by the key's SHA-256 digest.
//!
//! Invariants, each with a test below:
//! - the tenant comes from the key only: client-sent tenant headers (`x-tenant`,
//!   `x-bulkhead-*`, …) are removed before anything else sees the request;
//! - a missing or unknown key is refused with 401 `invalid_api_key` before the handler runs;
//! - the key leaves the request once hashed (the `authorization` header is removed), so no
//!   later layer or log can see it.

mod future;
mod layer;

use std::sync::Arc;

use http::HeaderMap;
use http::header::AUTHORIZATION;

pub use future::ResponseFuture;
pub use layer::{Auth, AuthLayer};

use crate::keys::{KeyHash, KeyId};
use crate::tenant::Tenant;
use crate::tenants::Keyring;

/// The authenticated tenant and the id of the key that proved it, put into the request's
/// extensions by [`Auth`].
#[derive(Debug, Clone)]
pub struct Authenticated {
    pub tenant: Arc<Tenant>,
    pub key_id: KeyId,
}

/// Header names a client might use to claim a tenant; all are removed.
pub const TENANT_HEADERS: &[&str] = &["x-tenant", "x-tenant-id", "tenant", "x-org-id"];
/// Header prefixes reserved for the gateway; removed from client requests.
pub const RESERVED_PREFIXES: &[&str] = &["x-bulkhead-", "x-tenant-"];

/// Whether a client's header of this (lowercase) name is removed: it could claim a tenant.
pub fn claims_a_tenant(name: &str) -> bool {
    TENANT_HEADERS.contains(&name) || RESERVED_PREFIXES.iter().any(|p| name.starts_with(p))
}

/// Removes every header that could claim a tenant.
pub fn strip_tenant_headers(headers: &mut HeaderMap) {
    let doomed: Vec<_> = headers
        .keys()
        .filter(|name| claims_a_tenant(name.as_str()))
        .cloned()
        .collect();
    for name in doomed {
        headers.remove(name);
    }
}

/// The hash of the `Authorization: Bearer` key the request carries. A request with more
/// than one `Authorization` header carries none: which one counts would differ between this
/// gateway and whatever sits in front of it.
pub fn bearer_key(headers: &HeaderMap) -> Option<KeyHash> {
    let mut values = headers.get_all(AUTHORIZATION).iter();
    let value = values.next().filter(|_| values.next().is_none())?;
    let (scheme, key) = value.to_str().ok()?.trim().split_once(' ')?;
    let key = key.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !key.is_empty()).then(|| KeyHash::of(key))
}

/// The tenant whose key the request carries ([`bearer_key`]); removes the key from the
/// headers either way.
pub fn authenticate(headers: &mut HeaderMap, keyring: &Keyring) -> Option<Authenticated> {
    let hash = bearer_key(headers);
    headers.remove(AUTHORIZATION);
    let hash = hash?;
    let tenant = keyring.tenant(&hash)?.clone();
    Some(Authenticated {
        tenant,
        key_id: hash.id(),
    })
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;
    use crate::config::Config;

    fn keyring() -> Keyring {
        let text = format!(
            "[listen]\napi = \"127.0.0.1:0\"\nadmin = \"127.0.0.1:0\"\n\
             [admin]\ntoken_sha256 = \"{}\"\n\
             [[tenants]]\nid = \"tenant-a\"\nkey_sha256 = [\"{}\"]\nmax_context = 10\n\
             max_concurrent = 1\nrequests_per_minute = 1\ntokens_per_minute = 1\n\
             [[tenants]]\nid = \"tenant-b\"\nkey_sha256 = [\"{}\"]\nmax_context = 10\n\
             max_concurrent = 1\nrequests_per_minute = 1\ntokens_per_minute = 1\n\
             [[workers]]\nname = \"w\"\ngrpc = \"127.0.0.1:1\"\nrole = \"both\"\n",
            KeyHash::of("admin").to_hex(),
            KeyHash::of("sk-a").to_hex(),
            KeyHash::of("sk-b").to_hex(),
        );
        Config::parse(&text)
            .expect("valid")
            .tenants
            .keyring()
            .clone()
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_str(v).expect("valid header"));
        }
        h
    }

    #[test]
    fn the_right_key_names_its_tenant() {
        let mut h = headers(&[("authorization", "Bearer sk-a")]);
        let t = authenticate(&mut h, &keyring()).expect("known key");
        assert_eq!(t.tenant.id.as_str(), "tenant-a");
        assert_eq!(t.key_id, KeyHash::of("sk-a").id());
        assert!(!h.contains_key(AUTHORIZATION), "the key left the request");
    }

    #[test]
    fn a_wrong_missing_or_malformed_key_is_refused() {
        let k = keyring();
        for h in [
            headers(&[("authorization", "Bearer sk-c")]),
            headers(&[("authorization", "Bearer ")]),
            headers(&[("authorization", "Basic sk-a")]),
            headers(&[("authorization", "sk-a")]),
            headers(&[]),
        ] {
            let mut h = h;
            assert!(authenticate(&mut h, &k).is_none(), "{h:?}");
        }
        // Two keys: neither counts, whichever comes first, and both leave the request.
        for (first, second) in [
            ("Bearer sk-a", "Bearer sk-b"),
            ("Bearer sk-a", "Bearer sk-a"),
        ] {
            let mut h = headers(&[("authorization", first)]);
            h.append(AUTHORIZATION, HeaderValue::from_static(second));
            assert!(authenticate(&mut h, &k).is_none(), "{first}, {second}");
            assert!(!h.contains_key(AUTHORIZATION));
        }
    }

    #[test]
    fn client_tenant_headers_are_stripped() {
        let mut h = headers(&[
            ("authorization", "Bearer sk-a"),
            ("x-tenant", "tenant-b"),
            ("x-tenant-id", "tenant-b"),
            ("x-bulkhead-tenant", "tenant-b"),
            ("content-type", "application/json"),
        ]);
        strip_tenant_headers(&mut h);
        assert!(!h.contains_key("x-tenant"));
        assert!(!h.contains_key("x-tenant-id"));
        assert!(!h.contains_key("x-bulkhead-tenant"));
        assert!(h.contains_key("content-type"));
        let t = authenticate(&mut h, &keyring()).expect("a's key");
        assert_eq!(
            t.tenant.id.as_str(),
            "tenant-a",
            "the key decides, not a header"
        );
    }
}
