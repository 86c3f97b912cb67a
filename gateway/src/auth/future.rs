//! The response future of [`super::Auth`]: the inner service's, or an immediate refusal.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::response::{IntoResponse, Response};
use pin_project_lite::pin_project;

use crate::api::ApiError;

pin_project! {
    /// Either the inner service's future or a ready 401.
    #[derive(Debug)]
    pub struct ResponseFuture<F> {
        #[pin]
        kind: Kind<F>,
    }
}

pin_project! {
    #[project = KindProj]
    #[derive(Debug)]
    enum Kind<F> {
        Inner { #[pin] future: F },
        Refused { response: Option<Response> },
    }
}

impl<F> ResponseFuture<F> {
    pub(super) fn inner(future: F) -> Self {
        ResponseFuture {
            kind: Kind::Inner { future },
        }
    }

    pub(super) fn refused(response: Response) -> Self {
        ResponseFuture {
            kind: Kind::Refused {
                response: Some(response),
            },
        }
    }
}

impl<F, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<Response, E>>,
{
    type Output = Result<Response, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Inner { future } => future.poll(cx),
            // Polled again after completion: answer an error rather than panic.
            KindProj::Refused { response } => Poll::Ready(Ok(response
                .take()
                .unwrap_or_else(|| ApiError::Internal.into_response()))),
        }
    }
}
