//! Requests the HTTP server dropped before the API ran them. hyper hands a request to the
//! service as soon as it has read it, then goes on reading; when the client's close is in that
//! same read, hyper drops the request's future before polling it once — before [`audited`]
//! (which runs on the first poll) made its trail. Such a request reached the gateway, so it
//! still gets its one record (I5): [`Watch`] notes each request's arrival when hyper calls the
//! service, and a future dropped unpolled records it as abandoned before admission, in the
//! tenant's log when its key is valid.
//!
//! [`audited`]: super::audited

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::header::AUTHORIZATION;
use http::{HeaderMap, HeaderValue, Request};
use pin_project_lite::pin_project;

use super::{Recorder, UNMATCHED_ROUTE};
use crate::auth::authenticate;
use crate::tenants::{TenantSet, Tenants};

/// A hyper service that makes sure every request it is given is recorded, even one dropped
/// before `inner` ran it.
#[derive(Debug, Clone)]
pub struct Watch<S> {
    inner: S,
    recorder: Recorder,
    tenants: Tenants,
}

impl<S> Watch<S> {
    pub fn new(inner: S, recorder: Recorder, tenants: Tenants) -> Watch<S> {
        Watch {
            inner,
            recorder,
            tenants,
        }
    }
}

impl<S, B> hyper::service::Service<Request<B>> for Watch<S>
where
    S: hyper::service::Service<Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Watched<S::Future>;

    fn call(&self, request: Request<B>) -> Self::Future {
        let arrival = Arrival {
            recorder: self.recorder.clone(),
            tenants: self.tenants.current(),
            key: only_key(request.headers()),
            path: request.uri().path().to_owned(),
        };
        Watched {
            inner: self.inner.call(request),
            arrival: Some(arrival),
        }
    }
}

pin_project! {
    /// The inner service's future; records its request if dropped before its first poll.
    pub struct Watched<F> {
        #[pin]
        inner: F,
        arrival: Option<Arrival>,
    }

    impl<F> PinnedDrop for Watched<F> {
        fn drop(this: Pin<&mut Self>) {
            if let Some(arrival) = this.project().arrival.take() {
                arrival.record();
            }
        }
    }
}

impl<F: Future> Future for Watched<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        // Polled: the API's own trail records the request from here on.
        this.arrival.take();
        this.inner.poll(cx)
    }
}

/// The request's `Authorization` header when it has exactly one: with several it has no
/// tenant, as the API has it (`authenticate` refuses them).
fn only_key(headers: &HeaderMap) -> Option<HeaderValue> {
    let mut keys = headers.get_all(AUTHORIZATION).iter();
    match (keys.next(), keys.next()) {
        (Some(key), None) => Some(key.clone()),
        _ => None,
    }
}

/// What is known of a request the moment it arrives: its key is checked against the tenants
/// of that moment, not of its drop (a reload in between could give the key to another).
struct Arrival {
    recorder: Recorder,
    tenants: Arc<TenantSet>,
    key: Option<HeaderValue>,
    path: String,
}

impl Arrival {
    /// Records the request as abandoned by its client before admission.
    fn record(self) {
        let trail = self
            .recorder
            .trail(super::layer::request_id(), tracing::Span::none());
        trail.route(crate::api::route_of(&self.path).unwrap_or(UNMATCHED_ROUTE));
        if let Some(key) = self.key {
            let mut headers = HeaderMap::new();
            headers.insert(AUTHORIZATION, key);
            if let Some(who) = authenticate(&mut headers, self.tenants.keyring()) {
                trail.authenticated(&who);
            }
        }
        tracing::debug!(path = %self.path, "a request dropped before the API ran it");
        // Dropping the trail unfinished records the request as abandoned by its client.
        drop(trail);
    }
}
