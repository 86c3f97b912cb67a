//! The tower layer that authenticates every request before the inner service sees it.

use std::sync::Arc;
use std::task::{Context, Poll};

use axum::response::{IntoResponse, Response};
use http::Request;
use tower::{Layer, Service};

use super::{ResponseFuture, authenticate, strip_tenant_headers};
use crate::api::ApiError;
use crate::config::Keyring;
use crate::metrics::Metrics;

/// Wraps a service in [`Auth`].
#[derive(Debug, Clone)]
pub struct AuthLayer {
    keyring: Arc<Keyring>,
    metrics: Metrics,
}

impl AuthLayer {
    pub fn new(keyring: Arc<Keyring>, metrics: Metrics) -> AuthLayer {
        AuthLayer { keyring, metrics }
    }
}

impl<S> Layer<S> for AuthLayer {
    type Service = Auth<S>;

    fn layer(&self, inner: S) -> Auth<S> {
        Auth {
            inner,
            keyring: self.keyring.clone(),
            metrics: self.metrics.clone(),
        }
    }
}

/// Strips client tenant headers, then admits only requests with a known key, tagging them
/// with [`Authenticated`]; the rest get 401 without reaching `inner`.
#[derive(Debug, Clone)]
pub struct Auth<S> {
    inner: S,
    keyring: Arc<Keyring>,
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
            let authenticated = authenticate(request.headers_mut(), &self.keyring);
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
