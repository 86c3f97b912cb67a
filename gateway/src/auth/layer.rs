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

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::future::{Ready, ready};

    use super::*;
    use crate::keys::KeyHash;

    /// A service that is never ready, as one whose queue is full.
    struct Full;

    impl Service<Request<()>> for Full {
        type Response = Response;
        type Error = Infallible;
        type Future = Ready<Result<Response, Infallible>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
            Poll::Pending
        }

        fn call(&mut self, _: Request<()>) -> Self::Future {
            ready(Ok(Response::default()))
        }
    }

    #[test]
    fn the_inner_services_backpressure_passes_through() {
        let text = format!(
            "[listen]\napi = \"127.0.0.1:0\"\nadmin = \"127.0.0.1:0\"\n\
             [admin]\ntoken_sha256 = \"{}\"\n\
             [[tenants]]\nid = \"t\"\nkey_sha256 = [\"{}\"]\nmax_context = 10\n\
             max_concurrent = 1\nrequests_per_minute = 1\ntokens_per_minute = 1\n\
             [[workers]]\nname = \"w\"\ngrpc = \"127.0.0.1:1\"\nrole = \"both\"\n",
            KeyHash::of("admin").to_hex(),
            KeyHash::of("sk-t").to_hex(),
        );
        let config = crate::Config::parse(&text).expect("valid");
        let tenants = Tenants::new(config.tenants, crate::limits::Limiter::default(), None);
        let mut auth = AuthLayer::new(tenants, Metrics::default()).layer(Full);
        let mut cx = Context::from_waker(std::task::Waker::noop());
        assert!(auth.poll_ready(&mut cx).is_pending());
    }
}
