//! gRPC over the deployment's TLS: a server's connections ([`ClusterTls::grpc_incoming`]) and
//! its clients' ([`WorkerEndpoint`]), each handshake made with the certificates in use when it
//! starts, so a renewal reaches every new connection.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::Uri;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls;
use tokio_rustls::{client, server};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};

use super::{ClusterTls, within};
use crate::serve::grpc_incoming::{self, Admitted};

/// How long a gRPC peer has to complete its TLS handshake. The data plane bounds its
/// handshakes by the peer timeout (`--kv-peer-timeout-ms`).
const HANDSHAKE_LIMIT: Duration = Duration::from_secs(10);

impl ClusterTls {
    /// A gRPC server's connections on `listener`: only clients the CA signed. Each handshake
    /// runs on its own, within [`HANDSHAKE_LIMIT`], so a client that stalls holds up no
    /// other; a failed one is logged and dropped. Within `limits`, counted in `counts`
    /// ([`grpc_incoming`]). Accepting stops when the stream is dropped.
    pub fn grpc_incoming(
        &self,
        listener: TcpListener,
        limits: grpc_incoming::Limits,
        counts: Arc<grpc_incoming::Counts>,
    ) -> ReceiverStream<std::io::Result<Admitted<server::TlsStream<TcpStream>>>> {
        let tls = self.clone();
        grpc_incoming::incoming(listener, limits, counts, move |socket| {
            let tls = tls.clone();
            async move { tls.accept_grpc(socket).await }
        })
    }

    async fn accept_grpc(
        &self,
        socket: TcpStream,
    ) -> std::io::Result<server::TlsStream<TcpStream>> {
        socket.set_nodelay(true)?;
        let acceptor = self.current.current().grpc.acceptor.clone();
        within(HANDSHAKE_LIMIT, acceptor.accept(socket)).await
    }

    /// A gRPC client's connection to `address` (`host:port`): TCP, then the handshake with a
    /// server whose certificate names that host (or the name servers are verified as).
    pub(super) async fn connect_grpc(
        &self,
        address: &str,
    ) -> std::io::Result<client::TlsStream<TcpStream>> {
        let name = self.server_name_for(address)?;
        let socket = TcpStream::connect(address).await?;
        socket.set_nodelay(true)?;
        let connector = self.current.current().grpc.connector.clone();
        within(HANDSHAKE_LIMIT, connector.connect(name, socket)).await
    }
}

/// Why a worker's gRPC address cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    #[error("{0}")]
    Invalid(String),
    #[error(
        "https:// needs the deployment's TLS files (gateway: [cluster] tls_ca, tls_cert, \
         tls_key; worker: --tls-ca, --tls-cert, --tls-key)"
    )]
    HttpsWithoutTls,
}

/// A worker's gRPC address, called over the deployment's TLS when there is one.
#[derive(Debug, Clone)]
pub struct WorkerEndpoint {
    endpoint: Endpoint,
    tls: Option<ClusterTls>,
}

/// The gRPC endpoint of the worker at `uri` (`http://host:port`). With the deployment's TLS,
/// every call goes over TLS whatever the scheme says — no hop is left in the clear by a URI
/// written without the `s` —, to a server whose certificate names `host`. Without TLS, an
/// `https://` URI is refused: it could never connect.
pub fn endpoint(uri: &str, tls: Option<&ClusterTls>) -> Result<WorkerEndpoint, EndpointError> {
    let invalid = |e: &dyn std::fmt::Display| EndpointError::Invalid(e.to_string());
    let parsed: Uri = uri.parse().map_err(|e| invalid(&e))?;
    let https = parsed.scheme_str() == Some("https");
    let endpoint = match tls {
        None if https => return Err(EndpointError::HttpsWithoutTls),
        None => parsed,
        // The connector makes the TLS: tonic is handed a plain URI whose authority names the
        // port the scheme implies.
        Some(_) => {
            let authority = parsed
                .authority()
                .ok_or_else(|| invalid(&format!("{uri} names no host")))?;
            let port = authority.port_u16().unwrap_or(if https { 443 } else { 80 });
            let address = format!("{}:{port}", authority.host());
            let mut parts = parsed.clone().into_parts();
            parts.scheme = Some(http::uri::Scheme::HTTP);
            parts.authority = Some(address.parse().map_err(|e| invalid(&e))?);
            Uri::from_parts(parts).map_err(|e| invalid(&e))?
        }
    };
    Ok(WorkerEndpoint {
        endpoint: Endpoint::from(endpoint).tcp_nodelay(true),
        tls: tls.cloned(),
    })
}

impl WorkerEndpoint {
    /// A connection (TCP and, with TLS, the handshake) that takes longer than `limit` fails.
    pub fn connect_timeout(self, limit: Duration) -> WorkerEndpoint {
        WorkerEndpoint {
            endpoint: self.endpoint.connect_timeout(limit),
            ..self
        }
    }

    /// A connection that cannot be made within `limit` (at least a second) fails, and one
    /// whose peer stops answering — a host gone without a reset, a link cut — is closed after
    /// about `limit` (HTTP/2 pings every third of it, idle or not, each to be answered within
    /// a third; TCP keepalive too on a plain-text connection): the calls on it fail then, not
    /// when the kernel gives up retransmitting (about a quarter of an hour), and the next call
    /// connects afresh.
    pub fn alive_within(self, limit: Duration) -> WorkerEndpoint {
        let third = (limit / 3).max(Duration::from_secs(1));
        WorkerEndpoint {
            endpoint: self
                .endpoint
                .connect_timeout(limit.max(Duration::from_secs(1)))
                .http2_keep_alive_interval(third)
                .keep_alive_timeout(third)
                .keep_alive_while_idle(true)
                .tcp_keepalive(Some(third)),
            ..self
        }
    }

    /// A channel that connects at its first call, and again after a connection is lost.
    pub fn connect_lazy(&self) -> Channel {
        match &self.tls {
            None => self.endpoint.connect_lazy(),
            Some(tls) => self
                .endpoint
                .connect_with_connector_lazy(Connector(tls.clone())),
        }
    }

    /// A channel, connected now.
    pub async fn connect(&self) -> Result<Channel, tonic::transport::Error> {
        match &self.tls {
            None => self.endpoint.connect().await,
            Some(tls) => {
                self.endpoint
                    .connect_with_connector(Connector(tls.clone()))
                    .await
            }
        }
    }
}

/// Whether `error` is this side's TLS finding that the server it dialled answered in plain
/// text (its first bytes are no TLS record): a worker started without the deployment's TLS
/// files. One link of an error's chain; rustls' own words for it ("received corrupt message
/// of type InvalidContentType") do not say so.
pub fn answered_in_plain_text(error: &(dyn std::error::Error + 'static)) -> bool {
    let tls = error.downcast_ref::<rustls::Error>().or_else(|| {
        let io = error.downcast_ref::<std::io::Error>()?;
        io.get_ref()?.downcast_ref::<rustls::Error>()
    });
    matches!(
        tls,
        Some(rustls::Error::InvalidMessage(
            rustls::InvalidMessage::InvalidContentType
        ))
    )
}

/// Makes a gRPC channel's connections over the deployment's TLS.
#[derive(Clone)]
struct Connector(ClusterTls);

impl tower::Service<Uri> for Connector {
    type Response = TokioIo<client::TlsStream<TcpStream>>;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = std::io::Result<Self::Response>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let tls = self.0.clone();
        Box::pin(async move {
            // `endpoint` gave every URI a host and a port.
            let address = uri.authority().map_or_else(String::new, |a| a.to_string());
            Ok(TokioIo::new(tls.connect_grpc(&address).await?))
        })
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::AsyncReadExt as _;

    use super::*;
    use crate::serve::tls::Authority;

    /// The first bytes a channel made from `uri` (with `tls`, or none) sends to the listener
    /// it dials.
    async fn first_bytes(uri_of: impl Fn(&str) -> String, tls: Option<&ClusterTls>) -> Vec<u8> {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address").to_string();
        let channel = endpoint(&uri_of(&address), tls)
            .expect("valid")
            .connect_lazy();
        let call = tokio::spawn(async move {
            let _ = crate::serve::proto::WorkerClient::new(channel)
                .health(crate::serve::proto::HealthRequest {})
                .await;
        });
        let (mut socket, _) = listener.accept().await.expect("dialled");
        let mut first = vec![0; 3];
        socket.read_exact(&mut first).await.expect("bytes");
        call.abort();
        first
    }

    /// A peer that takes the connection and then says nothing (a host gone without a reset
    /// looks so) fails the call on it within about the limit, instead of holding it for as
    /// long as the kernel retransmits.
    #[tokio::test]
    async fn a_silent_peer_fails_its_calls_within_the_limit() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("binds");
        let address = listener.local_addr().expect("its address");
        // Takes every connection and keeps it, reading nothing and answering nothing.
        let held = tokio::spawn(async move {
            let mut kept = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                kept.push(socket);
            }
        });
        let limit = Duration::from_secs(3);
        let channel = endpoint(&format!("http://{address}"), None)
            .expect("an endpoint")
            .alive_within(limit)
            .connect_lazy();
        let mut client = crate::serve::proto::WorkerClient::new(channel);
        let started = std::time::Instant::now();
        let call = client.health(crate::serve::proto::HealthRequest::default());
        let answered = tokio::time::timeout(Duration::from_secs(30), call).await;
        assert!(matches!(answered, Ok(Err(_))), "{answered:?}");
        assert!(started.elapsed() < 3 * limit, "{:?}", started.elapsed());
        held.abort();
    }

    /// A worker started without TLS answers a TLS client's hello in plain HTTP/2 (its
    /// SETTINGS frame): the failed connection says so, and a server that ends the connection
    /// (one that takes only TLS, refusing a caller without it) is not mistaken for one.
    #[tokio::test]
    async fn a_plain_text_answer_to_tls_is_recognised_as_such() {
        use tokio::io::AsyncWriteExt as _;
        let ca = Authority::new("test CA").expect("a CA");
        let tls = ca.cluster_tls(&["127.0.0.1"]).expect("issued");
        let causes = |answer: &'static [u8]| {
            let tls = tls.clone();
            async move {
                let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
                let address = listener.local_addr().expect("address");
                let plain = tokio::spawn(async move {
                    let (mut socket, _) = listener.accept().await.expect("dialled");
                    let _ = socket.write_all(answer).await;
                    tokio::time::sleep(Duration::from_millis(300)).await;
                });
                let e = endpoint(&format!("http://{address}"), Some(&tls))
                    .expect("valid")
                    .connect()
                    .await
                    .expect_err("no TLS there");
                plain.abort();
                let mut said = false;
                let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&e);
                while let Some(c) = cause {
                    said |= answered_in_plain_text(c);
                    cause = c.source();
                }
                said
            }
        };
        // An empty SETTINGS frame: what an HTTP/2 server sends first.
        assert!(causes(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).await);
        assert!(!causes(b"").await);
    }

    /// With TLS, a worker is called over TLS whether its URI says `http://` or `https://`
    /// (the first bytes are a TLS handshake record, 0x16 0x03 …); without, in the clear (the
    /// HTTP/2 preface, `PRI`), and `https://` is refused.
    #[tokio::test]
    async fn with_tls_every_worker_is_called_over_tls_and_https_without_it_is_refused() {
        let ca = Authority::new("test CA").expect("a CA");
        let tls = ca.cluster_tls(&["127.0.0.1"]).expect("issued");
        for scheme in ["http", "https"] {
            let sent = first_bytes(|a| format!("{scheme}://{a}"), Some(&tls)).await;
            assert_eq!(&sent[..2], &[0x16, 0x03], "{scheme}: {sent:?}");
        }
        let sent = first_bytes(|a| format!("http://{a}"), None).await;
        assert_eq!(sent, b"PRI");
        assert!(matches!(
            endpoint("https://127.0.0.1:5", None),
            Err(EndpointError::HttpsWithoutTls)
        ));
        assert!(matches!(
            endpoint("not a uri", None),
            Err(EndpointError::Invalid(_))
        ));
    }
}
