//! The tower layer that authenticates every request before the inner service sees it.

use std::task::{Context, Poll};

use axum::response::{IntoResponse, Response};
use http::Request;
use tower::{Layer, Service};

use super::{ResponseFuture, authenticate, strip_tenant_headers};
use crate::api::ApiError;
use crate::metrics::Metrics;
use crate::tenants::Tenants;

/// Wraps a service in [`Auth`].
#[derive(Debug, Clone)]
pub struct AuthLayer {
    tenants: Tenants,
    metrics: Metrics,
}

impl AuthLayer {
    /// Authenticates against the tenant set active when each request arrives.
    pub fn new(tenants: Tenants, metrics: Metrics) -> AuthLayer {
        AuthLayer { tenants, metrics }
    }
}

impl<S> Layer<S> for AuthLayer {
    type Service = Auth<S>;

    fn layer(&self, inner: S) -> Auth<S> {
        Auth {
            inner,
            tenants: self.tenants.clone(),
            metrics: self.metrics.clone(),
        }
    }
}

/// Strips client tenant headers, then admits only requests with a known key, tagging them
/// with [`Authenticated`]; the rest get 401 without reaching `inner`. Each request is checked
/// against the set active when it arrives (a reload counts from the next request on).
#[derive(Debug, Clone)]
pub struct Auth<S> {
    inner: S,
    tenants: Tenants,
    metrics: Metrics,
}

impl<S, B> Service<Request<B>> for Auth<S>
where
    S: Service<Request<B>, Response = Response>,
{
    type Response = Response;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        let span = tracing::info_span!(
            "auth",
            bulkhead.tenant.id = tracing::field::Empty,
            error.type = tracing::field::Empty
        );
        let authenticated = span.in_scope(|| {
            strip_tenant_headers(request.headers_mut());
            let authenticated =
                authenticate(request.headers_mut(), self.tenants.current().keyring());
            match &authenticated {
                Some(a) => span.record("bulkhead.tenant.id", a.tenant.id.as_str()),
                None => span.record("error.type", ApiError::InvalidApiKey.error_type()),
            };
            authenticated
        });
        match authenticated {
            Some(authenticated) => {
                request.extensions_mut().insert(authenticated);
                ResponseFuture::inner(self.inner.call(request))
            }
            None => {
                self.metrics.unauthenticated();
                ResponseFuture::refused(ApiError::InvalidApiKey.into_response())
            }
        }
    }
}
