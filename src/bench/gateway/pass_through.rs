//! The gateway bench's floor: a reverse proxy that does nothing but pass requests through, built
//! on exactly the parts the gateway serves with — its serving threads
//! ([`bulkhead_gateway::serving`]: one single-threaded tokio runtime per thread, connections
//! dealt by the accepting thread), hyper's HTTP/1.1 server, and one pooled hyper client per
//! thread to the upstream. It reads no body, parses no JSON, authenticates no one and writes no
//! audit record: what it costs per request is what the stack costs before any of the gateway's
//! own work, so the bench can tell the stack's share of the gap to nginx from the gateway's.
//!
//! Runs as its own process (`bulkhead bench pass-through`, hidden), started by the bench.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bulkhead_gateway::config::HttpLimits;
use bulkhead_gateway::serving::Edge;
use bulkhead_worker::serve::tls::{ListenerFiles, ListenerTls};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Request, StatusCode, Uri};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// The line the proxy prints once it listens; `addr=` follows.
pub const READY: &str = "bulkhead pass-through ready ";

#[derive(Debug, clap::Args)]
pub struct PassThroughArgs {
    /// The upstream every request is passed to.
    #[arg(long)]
    upstream: SocketAddr,
    /// Where to listen (port 0: any free port; the bound address is printed).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Serving threads (as the gateway's `--serving-threads`).
    #[arg(long, default_value_t = NonZeroUsize::MIN)]
    threads: NonZeroUsize,
    /// Listen on TLS with this certificate (as the gateway's `[listen] tls_cert`).
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// Its private key.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
}

pub fn run(args: PassThroughArgs) -> anyhow::Result<()> {
    crate::runtime::main()?.block_on(async {
        let listener = TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("binding {}", args.listen))?;
        let tls = match (args.tls_cert, args.tls_key) {
            (Some(cert), Some(key)) => Some(ListenerTls::load(&ListenerFiles {
                cert,
                key,
                client_ca: None,
            })?),
            _ => None,
        };
        // Ready only once it can serve: a certificate that does not load is its error, not a
        // ready line and then one.
        println!("{READY}addr={}", listener.local_addr()?);
        let (stop_tx, stop) = watch::channel(false);
        tokio::spawn(async move {
            crate::worker::shutdown_signal().await;
            let _ = stop_tx.send(true);
        });
        proxy(listener, args.upstream, args.threads, tls, stop).await
    })
}

/// Serves `listener` on `threads` serving threads, passing every request to `upstream`, until
/// `stop`.
async fn proxy(
    listener: TcpListener,
    upstream: SocketAddr,
    threads: NonZeroUsize,
    tls: Option<ListenerTls>,
    stop: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let authority = Authority::try_from(upstream.to_string())
        .context("the upstream address as a URI authority")?;
    let service = hyper::service::service_fn(move |req| pass(req, authority.clone()));
    // A client gets as long to send its request headers as the gateway gives it by default.
    let edge = Edge {
        limits: HttpLimits::default(),
        tls,
    };
    bulkhead_gateway::serving::serve(listener, service, edge, threads, stop, Arc::new(())).await;
    Ok(())
}

thread_local! {
    /// This serving thread's pooled connections to the upstream.
    static CLIENT: Client<HttpConnector, Incoming> = {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        Client::builder(TokioExecutor::new()).build(connector)
    };
}

/// Sends `req` on to the upstream at `authority` as it came (method, path, headers, body) and
/// answers with what the upstream answered, streamed; 502 when the upstream cannot be reached.
async fn pass(mut req: Request<Incoming>, authority: Authority) -> Result<Response, Infallible> {
    let mut parts = http::uri::Parts::default();
    parts.scheme = Some(Scheme::HTTP);
    parts.authority = Some(authority);
    parts.path_and_query = Some(
        req.uri()
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/")),
    );
    *req.uri_mut() = match Uri::from_parts(parts) {
        Ok(uri) => uri,
        Err(_) => return Ok(StatusCode::BAD_REQUEST.into_response()),
    };
    let sent = CLIENT.with(|client| client.request(req));
    Ok(match sent.await {
        Ok(answer) => answer.map(Body::new),
        Err(e) => (StatusCode::BAD_GATEWAY, format!("upstream: {e}")).into_response(),
    })
}

#[cfg(test)]
mod tests {
    use super::super::load;
    use super::*;

    /// A pass-through on two serving threads in front of `upstream`, and its address.
    async fn started(upstream: SocketAddr) -> (SocketAddr, watch::Sender<bool>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("address");
        let (stop_tx, stop) = watch::channel(false);
        let threads = NonZeroUsize::new(2).expect("two");
        tokio::spawn(proxy(listener, upstream, threads, None, stop));
        (addr, stop_tx)
    }

    #[tokio::test]
    async fn requests_pass_through_untouched_and_a_dead_upstream_is_a_502() {
        // The upstream names what it was sent: method, path and query, the bearer header.
        let upstream = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let upstream_addr = upstream.local_addr().expect("address");
        tokio::spawn(async move {
            while let Ok((stream, _)) = upstream.accept().await {
                let echo = hyper::service::service_fn(|req: Request<Incoming>| async move {
                    let auth = req.headers().get(http::header::AUTHORIZATION).cloned();
                    let seen = format!("{} {} {auth:?}", req.method(), req.uri());
                    Ok::<_, Infallible>(http::Response::new(http_body_util::Full::new(
                        bytes::Bytes::from(seen),
                    )))
                });
                tokio::spawn(
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), echo),
                );
            }
        });
        let (addr, _stop) = started(upstream_addr).await;
        for _ in 0..3 {
            let plain = load::Dial { addr, tls: None };
            let (status, body) = load::get(&plain, "/v1/models?x=1", Some("sk-k"))
                .await
                .expect("an answer");
            assert_eq!(status, StatusCode::OK);
            assert_eq!(body, "GET /v1/models?x=1 Some(\"Bearer sk-k\")");
        }

        let gone = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let dead = gone.local_addr().expect("address");
        drop(gone);
        let (addr, _stop) = started(dead).await;
        let (status, body) = load::get(&load::Dial { addr, tls: None }, "/v1/models", None)
            .await
            .expect("an answer");
        assert_eq!(status, StatusCode::BAD_GATEWAY);
        assert!(
            String::from_utf8_lossy(&body).starts_with("upstream: "),
            "{body:?}"
        );
    }
}
