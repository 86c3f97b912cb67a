//! A request answered before its body was read whole — refused for its key, its path, its
//! method, a missing Host — leaves the rest of the body on the connection, and the HTTP
//! server then closes the connection after the answer. Without saying so, a client that
//! reuses the connection for its next request finds it closed ("server disconnected without
//! sending a response"), and a POST is not retried by plain HTTP clients. Such an answer says
//! `Connection: close`, so the client opens a new connection instead.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::Request;
use axum::middleware::Next;
use axum::response::Response;
use http::HeaderValue;
use http::header::{CONNECTION, CONTENT_LENGTH, TRANSFER_ENCODING};
use hyper::body::Frame;
use pin_project_lite::pin_project;

/// Answers with `Connection: close` a request whose body was not read to its end.
pub async fn close_if_unread(request: Request, next: Next) -> Response {
    let headers = request.headers();
    let has_body = headers.contains_key(TRANSFER_ENCODING)
        || headers
            .get(CONTENT_LENGTH)
            .is_some_and(|n| n.as_bytes() != b"0");
    if !has_body {
        return next.run(request).await;
    }
    let whole = Arc::new(AtomicBool::new(false));
    let request = request.map(|inner| {
        Body::new(Watched {
            inner,
            whole: whole.clone(),
        })
    });
    let mut response = next.run(request).await;
    if !whole.load(Ordering::Relaxed) {
        response
            .headers_mut()
            .insert(CONNECTION, HeaderValue::from_static("close"));
    }
    response
}

pin_project! {
    /// A request body that says when it has been read to its end.
    struct Watched {
        #[pin]
        inner: Body,
        whole: Arc<AtomicBool>,
    }
}

impl HttpBody for Watched {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = self.project();
        let polled = this.inner.poll_frame(cx);
        if matches!(polled, Poll::Ready(None)) {
            this.whole.store(true, Ordering::Relaxed);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use axum::Router;
    use axum::routing::post;
    use tower::ServiceExt as _;

    use super::*;

    async fn answer(app: &Router, path: &str, body: &'static str) -> Response {
        let request = http::Request::post(path)
            .header(CONTENT_LENGTH, body.len())
            .body(Body::from(body))
            .expect("a request");
        app.clone().oneshot(request).await.expect("answered")
    }

    #[tokio::test]
    async fn an_answer_before_the_body_is_read_closes_the_connection() {
        let app = Router::new()
            .route(
                "/read",
                post(|body: Bytes| async move { body.len().to_string() }),
            )
            .route("/refuse", post(|| async { http::StatusCode::UNAUTHORIZED }))
            .layer(axum::middleware::from_fn(close_if_unread));
        let read = answer(&app, "/read", "{\"model\":\"x\"}").await;
        assert_eq!(read.headers().get(CONNECTION), None);
        let refused = answer(&app, "/refuse", "{\"model\":\"x\"}").await;
        assert_eq!(
            refused.headers().get(CONNECTION).map(HeaderValue::as_bytes),
            Some(&b"close"[..])
        );
        // No body, nothing left on the connection.
        let empty = answer(&app, "/refuse", "").await;
        assert_eq!(empty.headers().get(CONNECTION), None);
    }
}
