//! A request answered before its body was read whole — refused for its key, its path, its
//! method, its tenant's rate — leaves the rest of the body on the connection, and the HTTP
//! server closes the connection after the answer unless someone reads that rest. Without
//! saying so, a client that reuses the connection for its next request finds it closed
//! ("server disconnected without sending a response"), and a POST is not retried by plain HTTP
//! clients.
//!
//! So a small body (a declared length of at most [`DRAIN_LIMIT`], no `Expect: 100-continue`)
//! left unread is read to its end and discarded after the answer, as nginx discards a refused
//! request's body, and the connection stays open for the client's next request: a client
//! refused again and again (a rate limit's 429s) does not reconnect for each. Any other such
//! answer says `Connection: close`, so the client opens a new connection instead.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::Request;
use axum::middleware::Next;
use axum::response::Response;
use http::header::{CONNECTION, CONTENT_LENGTH, EXPECT, TRANSFER_ENCODING};
use http::{HeaderMap, HeaderValue};
use http_body_util::BodyExt as _;
use hyper::body::Frame;

/// The largest unread body discarded to keep its connection open.
pub const DRAIN_LIMIT: u64 = 64 << 10;

/// How long a discarded body may take to arrive whole; past it the connection is closed.
const DRAIN_FOR: Duration = Duration::from_secs(5);

/// Answers a request whose body was not read to its end with `Connection: close`, unless its
/// rest is small enough to discard.
pub async fn close_if_unread(request: Request, next: Next) -> Response {
    let headers = request.headers();
    let has_body = headers.contains_key(TRANSFER_ENCODING)
        || headers
            .get(CONTENT_LENGTH)
            .is_some_and(|n| n.as_bytes() != b"0");
    if !has_body {
        return next.run(request).await;
    }
    let drain = drainable(headers);
    let seen = Arc::new(Seen::default());
    let request = request.map(|inner| {
        Body::new(Watched {
            inner,
            seen: seen.clone(),
            drain,
        })
    });
    let mut response = next.run(request).await;
    if !seen.whole.load(Ordering::Relaxed) && !seen.draining.load(Ordering::Relaxed) {
        response
            .headers_mut()
            .insert(CONNECTION, HeaderValue::from_static("close"));
    }
    response
}

/// Whether a body left unread may be discarded: its length is declared and small, and the
/// client sends it without waiting to be asked (a client that expects `100 Continue` would
/// never send it, as none is sent once the answer is).
fn drainable(headers: &HeaderMap) -> bool {
    let small = headers
        .get(CONTENT_LENGTH)
        .and_then(|n| n.to_str().ok()?.parse::<u64>().ok())
        .is_some_and(|n| n <= DRAIN_LIMIT);
    small && !headers.contains_key(TRANSFER_ENCODING) && !headers.contains_key(EXPECT)
}

/// What became of a request's body.
#[derive(Debug, Default)]
struct Seen {
    /// Read to its end.
    whole: AtomicBool,
    /// Left unread, and being discarded.
    draining: AtomicBool,
}

/// A request body that says when it has been read to its end, and, dropped unread when it may
/// be, has its rest discarded.
struct Watched {
    inner: Body,
    seen: Arc<Seen>,
    drain: bool,
}

impl HttpBody for Watched {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None)) {
            self.seen.whole.store(true, Ordering::Relaxed);
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

impl Drop for Watched {
    fn drop(&mut self) {
        if !self.drain || self.seen.whole.load(Ordering::Relaxed) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let mut rest = std::mem::replace(&mut self.inner, Body::empty());
        self.seen.draining.store(true, Ordering::Relaxed);
        runtime.spawn(async move {
            // Ends at the body's end, an error (the client left), or the deadline; the server
            // keeps the connection open only for a body read to its end.
            let _ = tokio::time::timeout(DRAIN_FOR, async {
                while let Some(Ok(_)) = rest.frame().await {}
            })
            .await;
        });
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
    async fn an_answer_before_a_large_body_is_read_closes_the_connection() {
        let app = Router::new()
            .route(
                "/read",
                post(|body: Bytes| async move { body.len().to_string() }),
            )
            .route("/refuse", post(|| async { http::StatusCode::UNAUTHORIZED }))
            .layer(axum::middleware::from_fn(close_if_unread));
        let read = answer(&app, "/read", "{\"model\":\"x\"}").await;
        assert_eq!(read.headers().get(CONNECTION), None);
        // A small body is discarded, and its connection kept.
        let refused = answer(&app, "/refuse", "{\"model\":\"x\"}").await;
        assert_eq!(refused.headers().get(CONNECTION), None);
        // One past the limit is not.
        let large: &'static str = "x".repeat(DRAIN_LIMIT as usize + 1).leak();
        let refused = answer(&app, "/refuse", large).await;
        assert_eq!(
            refused.headers().get(CONNECTION).map(HeaderValue::as_bytes),
            Some(&b"close"[..])
        );
        // A body the client sends only once asked, or of no declared length: the connection
        // closes.
        for (name, value) in [(EXPECT, "100-continue"), (TRANSFER_ENCODING, "chunked")] {
            let mut request = http::Request::post("/refuse").header(&name, value);
            if name == EXPECT {
                request = request.header(CONTENT_LENGTH, 2);
            }
            let request = request.body(Body::from("{}")).expect("a request");
            let refused = app.clone().oneshot(request).await.expect("answered");
            assert_eq!(
                refused.headers().get(CONNECTION).map(HeaderValue::as_bytes),
                Some(&b"close"[..]),
                "{name}"
            );
        }
        // No body, nothing left on the connection.
        let empty = answer(&app, "/refuse", "").await;
        assert_eq!(empty.headers().get(CONNECTION), None);
    }
}
