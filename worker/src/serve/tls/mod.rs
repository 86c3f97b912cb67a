//! Mutual TLS between a deployment's processes: the gateway's calls to its workers, decode's
//! calls to prefill, and the KV data plane (prefill → decode).
//!
//! Every process holds a certificate signed by the deployment's CA and its key; each end of a
//! connection proves itself to the other (mutual), and trusts no other CA. Without it, gRPC
//! calls — prompts as token ids, generations, the cluster token — and the KV pages themselves
//! (from which a prompt can be read back) cross the network in the clear, and an on-path host
//! reads every tenant's traffic. The cluster token stays what decides who may call; TLS makes
//! it and everything else unreadable on the way, and a process without a CA-signed certificate
//! cannot even open a connection.
//!
//! ```text
//!  gateway ──gRPC (https://, tonic)──▶ decode ──gRPC (https://)──▶ prefill
//!                                        ▲                          │
//!                                        └──KV data plane (rustls)──┘
//! ```
//!
//! rustls on `ring`: the data plane speaks TLS 1.3 only; gRPC (tonic's TLS) also accepts 1.2,
//! and two Bulkhead processes agree on 1.3. A client checks that the server's certificate
//! names the host it dialled (a DNS name or an IP address in its subject alternative names).

mod authority;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpStream;
use tokio_rustls::rustls::client::WantsClientCert;
use tokio_rustls::rustls::crypto::CryptoProvider;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{self, ClientConfig, ConfigBuilder, RootCertStore, ServerConfig};
use tokio_rustls::{TlsAcceptor, TlsConnector, client, server};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};

pub use authority::{Authority, WriteError};

use super::secret_file::{self, SecretFileError};

/// The protocol the KV data plane's TLS handshake names (ALPN), so that a connection meant for
/// another service (gRPC's `h2`) is never taken for a data connection.
const KV_ALPN: &[u8] = b"bulkhead-kv/1";

/// How long a gRPC client has to complete its TLS handshake: one that stalls it (or never
/// starts it) holds a connection no longer. The data plane bounds its handshakes by the peer
/// timeout (`--kv-peer-timeout-ms`).
const GRPC_HANDSHAKE_LIMIT: Duration = Duration::from_secs(10);

/// Where one process's TLS material lies: the deployment's CA certificate(s), this process's
/// certificate (chain) and its private key, all PEM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Why TLS cannot be set up.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read the {what} {path}: {source}")]
    Read {
        what: &'static str,
        path: String,
        source: std::io::Error,
    },
    #[error("the TLS private key: {0}")]
    Key(#[from] SecretFileError),
    #[error("the {what} {path} holds no PEM certificate")]
    NoCertificate { what: &'static str, path: String },
    #[error("the {what} {path} is not a valid PEM certificate: {reason}")]
    BadCertificate {
        what: &'static str,
        path: String,
        reason: String,
    },
    #[error("the TLS private key {path} holds no PEM private key")]
    NoKey { path: String },
    #[error("the TLS CA {path} is not a usable CA certificate: {reason}")]
    BadCa { path: String, reason: String },
    #[error("the TLS certificate {cert} and key {key} cannot be used together: {reason}")]
    Mismatch {
        cert: String,
        key: String,
        reason: String,
    },
}

/// One process's side of the deployment's mutual TLS, loaded and checked: what its gRPC server
/// and clients (tonic) and its KV data plane (rustls) use. Its `Debug` shows no key.
///
/// Clones share it: every data connection and prefill call holds one.
#[derive(Clone)]
pub struct ClusterTls(Arc<Loaded>);

struct Loaded {
    ca_pem: Vec<u8>,
    identity: Identity,
    acceptor: TlsAcceptor,
    connector: TlsConnector,
}

impl std::fmt::Debug for ClusterTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterTls(…)")
    }
}

/// The cryptography provider of the data plane's ends: ring's, with AES-128-GCM preferred
/// (128-bit security, and fewer rounds per byte of KV than AES-256-GCM, ring's first choice).
fn provider() -> Arc<CryptoProvider> {
    use rustls::crypto::ring::cipher_suite;
    Arc::new(CryptoProvider {
        cipher_suites: vec![
            cipher_suite::TLS13_AES_128_GCM_SHA256,
            cipher_suite::TLS13_AES_256_GCM_SHA384,
            cipher_suite::TLS13_CHACHA20_POLY1305_SHA256,
        ],
        ..rustls::crypto::ring::default_provider()
    })
}

/// The certificates in the PEM file at `path`: at least one, each parsed.
fn certificates(
    what: &'static str,
    path: &Path,
) -> Result<(Vec<u8>, Vec<CertificateDer<'static>>), TlsError> {
    let shown = || path.display().to_string();
    let pem = std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: shown(),
        source,
    })?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::BadCertificate {
            what,
            path: shown(),
            reason: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            what,
            path: shown(),
        });
    }
    Ok((pem, certs))
}

impl ClusterTls {
    /// Reads and checks `files`: the CA parses and is usable as a trust anchor, the key file
    /// is open to its owner only and holds a key, and the certificate goes with the key.
    pub fn load(files: &TlsFiles) -> Result<ClusterTls, TlsError> {
        let (ca_pem, ca) = certificates("TLS CA", &files.ca)?;
        let (cert_pem, chain) = certificates("TLS certificate", &files.cert)?;
        let key_pem = secret_file::read(&files.key)?;
        let no_key = || TlsError::NoKey {
            path: files.key.display().to_string(),
        };
        let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|_| no_key())?;

        let bad_ca = |reason: String| TlsError::BadCa {
            path: files.ca.display().to_string(),
            reason,
        };
        let mut roots = RootCertStore::empty();
        for cert in ca {
            roots.add(cert).map_err(|e| bad_ca(e.to_string()))?;
        }
        let roots = Arc::new(roots);
        let mismatch = |e: rustls::Error| TlsError::Mismatch {
            cert: files.cert.display().to_string(),
            key: files.key.display().to_string(),
            reason: e.to_string(),
        };
        let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider())
            .build()
            .map_err(|e| bad_ca(e.to_string()))?;
        let mut server = tls13(ServerConfig::builder_with_provider(provider()))
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(mismatch)?;
        server.alpn_protocols = vec![KV_ALPN.to_vec()];
        // No session tickets: nothing resumes, and a data connection then carries nothing from
        // decode to prefill after the handshake. Prefill only writes; a ticket left unread in
        // its socket made its close a reset, and decode lost what it had not read yet.
        server.send_tls13_tickets = 0;
        let client: ConfigBuilder<ClientConfig, WantsClientCert> =
            tls13(ClientConfig::builder_with_provider(provider())).with_root_certificates(roots);
        let mut client = client.with_client_auth_cert(chain, key).map_err(mismatch)?;
        client.alpn_protocols = vec![KV_ALPN.to_vec()];

        Ok(ClusterTls(Arc::new(Loaded {
            ca_pem,
            identity: Identity::from_pem(cert_pem, key_pem),
            acceptor: TlsAcceptor::from(Arc::new(server)),
            connector: TlsConnector::from(Arc::new(client)),
        })))
    }

    /// The gRPC server's side: its certificate, only clients the CA signed, and a bounded
    /// handshake.
    pub fn grpc_server(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(self.0.identity.clone())
            .client_ca_root(Certificate::from_pem(&self.0.ca_pem))
            .timeout(GRPC_HANDSHAKE_LIMIT)
    }

    /// A gRPC client's side (an `https://` endpoint): only servers the CA signed, for the host
    /// the endpoint names, and this process's certificate.
    pub fn grpc_client(&self) -> ClientTlsConfig {
        ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.0.ca_pem))
            .identity(self.0.identity.clone())
    }

    /// The KV data plane, decode's side: the handshake on an accepted connection, within
    /// `limit` (a peer that stalls it holds nothing for longer).
    pub async fn accept(
        &self,
        socket: TcpStream,
        limit: Duration,
    ) -> std::io::Result<server::TlsStream<TcpStream>> {
        tokio::time::timeout(limit, self.0.acceptor.accept(socket))
            .await
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))?
    }

    /// The KV data plane, prefill's side: the handshake on `socket`, connected to `address`
    /// (`host:port`), whose certificate must name that host; within `limit`.
    pub async fn connect(
        &self,
        address: &str,
        socket: TcpStream,
        limit: Duration,
    ) -> std::io::Result<client::TlsStream<TcpStream>> {
        let name = server_name(address)?;
        tokio::time::timeout(limit, self.0.connector.connect(name, socket))
            .await
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))?
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

/// The gRPC endpoint of the worker at `uri` (`http://host:port`). With the deployment's TLS,
/// the call goes over TLS whatever the scheme says — no hop is left in the clear by a URI
/// written without the `s` —, to a server whose certificate names `host`. Without TLS, an
/// `https://` URI is refused: it could never connect.
pub fn endpoint(uri: &str, tls: Option<&ClusterTls>) -> Result<Endpoint, EndpointError> {
    let invalid = |e: &dyn std::fmt::Display| EndpointError::Invalid(e.to_string());
    let parsed: http::Uri = uri.parse().map_err(|e| invalid(&e))?;
    match (tls, parsed.scheme_str()) {
        (None, Some("https")) => Err(EndpointError::HttpsWithoutTls),
        (None, _) => Endpoint::from_shared(uri.to_owned()).map_err(|e| invalid(&e)),
        (Some(tls), _) => {
            let mut parts = parsed.into_parts();
            parts.scheme = Some(http::uri::Scheme::HTTPS);
            let https = http::Uri::from_parts(parts).map_err(|e| invalid(&e))?;
            Endpoint::from(https)
                .tls_config(tls.grpc_client())
                .map_err(|e| invalid(&e))
        }
    }
}

/// TLS 1.3 only: nothing older is negotiated on the data plane.
fn tls13<S: rustls::ConfigSide>(
    builder: ConfigBuilder<S, rustls::WantsVersions>,
) -> ConfigBuilder<S, rustls::WantsVerifier> {
    builder
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("ring supports TLS 1.3")
}

/// The host of `address` (`host:port`, `ip:port` or `[ipv6]:port`) as the name its server's
/// certificate must carry.
fn server_name(address: &str) -> std::io::Result<ServerName<'static>> {
    let invalid = |why: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, why);
    if let Ok(socket) = address.parse::<std::net::SocketAddr>() {
        return Ok(ServerName::IpAddress(socket.ip().into()));
    }
    let (host, _port) = address
        .rsplit_once(':')
        .ok_or_else(|| invalid(format!("{address:?} has no port")))?;
    ServerName::try_from(host.to_owned())
        .map_err(|e| invalid(format!("{host:?} is not a host name: {e}")))
}

/// A deployment's TLS for tests: [`ClusterTls`] for processes reached at `names`, issued by
/// `ca` and written to a fresh temporary directory.
#[cfg(test)]
pub(crate) fn issued_for(ca: &Authority, names: &[&str]) -> ClusterTls {
    let dir = std::env::temp_dir().join(format!("bulkhead-tls-{}", rand::random::<u64>()));
    let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
    let files = ca.write(&dir, "peer", &names).expect("writes");
    let tls = ClusterTls::load(&files).expect("loads");
    let _ = std::fs::remove_dir_all(&dir);
    tls
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;

    use super::*;

    /// Certificates for 127.0.0.1 from a fresh CA, in a fresh directory.
    fn written() -> (tempdir::Dir, TlsFiles) {
        let dir = tempdir::Dir::new();
        let ca = Authority::new("test CA").expect("a CA");
        let files = ca
            .write(&dir.0, "worker", &["127.0.0.1".to_owned()])
            .expect("writes");
        (dir, files)
    }

    mod tempdir {
        /// A directory removed when dropped.
        pub struct Dir(pub std::path::PathBuf);
        impl Dir {
            pub fn new() -> Dir {
                let dir =
                    std::env::temp_dir().join(format!("bulkhead-tls-{}", rand::random::<u64>()));
                std::fs::create_dir_all(&dir).expect("a directory");
                Dir(dir)
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    #[test]
    fn written_files_load_and_the_key_is_its_owners_alone() {
        let (_dir, files) = written();
        let mode = std::fs::metadata(&files.key)
            .expect("key")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        assert!(ClusterTls::load(&files).is_ok());
        assert_eq!(
            format!("{:?}", ClusterTls::load(&files).expect("loads")),
            "ClusterTls(…)"
        );
    }

    #[test]
    fn bad_tls_files_are_refused_with_a_reason_that_names_them() {
        let (dir, files) = written();
        let refused = |files: &TlsFiles| ClusterTls::load(files).expect_err("refused").to_string();

        let missing = TlsFiles {
            ca: dir.0.join("absent.pem"),
            ..files.clone()
        };
        let e = refused(&missing);
        assert!(e.contains("TLS CA") && e.contains("absent.pem"), "{e}");

        let garbage = dir.0.join("garbage.pem");
        std::fs::write(&garbage, "not a certificate\n").expect("writes");
        let e = refused(&TlsFiles {
            cert: garbage.clone(),
            ..files.clone()
        });
        assert!(
            e.contains("holds no PEM certificate") && e.contains("garbage.pem"),
            "{e}"
        );

        // A PEM block whose body is not base64, and a CA block whose bytes are no certificate.
        let broken = dir.0.join("broken.pem");
        std::fs::write(
            &broken,
            "-----BEGIN CERTIFICATE-----\n!!!!\n-----END CERTIFICATE-----\n",
        )
        .expect("writes");
        let e = refused(&TlsFiles {
            cert: broken,
            ..files.clone()
        });
        assert!(e.contains("not a valid PEM certificate"), "{e}");
        let junk = dir.0.join("junk-ca.pem");
        std::fs::write(
            &junk,
            "-----BEGIN CERTIFICATE-----\nAAECAwQF\n-----END CERTIFICATE-----\n",
        )
        .expect("writes");
        let e = refused(&TlsFiles {
            ca: junk,
            ..files.clone()
        });
        assert!(
            e.contains("not a usable CA certificate") && e.contains("junk-ca.pem"),
            "{e}"
        );

        // A key that is not the certificate's.
        let other = Authority::new("other")
            .expect("a CA")
            .write(&dir.0.join("other"), "worker", &["127.0.0.1".to_owned()])
            .expect("writes");
        let e = refused(&TlsFiles {
            key: other.key.clone(),
            ..files.clone()
        });
        assert!(e.contains("cannot be used together"), "{e}");

        // A certificate where the key should be.
        let not_a_key = dir.0.join("cert-as-key.pem");
        secret_file::write(&not_a_key, &std::fs::read(&files.cert).expect("reads"))
            .expect("writes");
        let e = refused(&TlsFiles {
            key: not_a_key,
            ..files.clone()
        });
        assert!(e.contains("holds no PEM private key"), "{e}");

        // A key other users may read.
        std::fs::set_permissions(&files.key, std::fs::Permissions::from_mode(0o644))
            .expect("chmod");
        let e = refused(&files);
        assert!(e.contains("open to other users"), "{e}");
    }

    #[test]
    fn with_tls_every_worker_is_called_over_tls_and_https_without_it_is_refused() {
        let ca = Authority::new("test CA").expect("a CA");
        let tls = issued_for(&ca, &["127.0.0.1"]);
        for uri in ["http://127.0.0.1:5", "https://127.0.0.1:5"] {
            let e = endpoint(uri, Some(&tls)).expect("valid");
            assert_eq!(e.uri().scheme_str(), Some("https"), "{uri}");
        }
        let plain = endpoint("http://127.0.0.1:5", None).expect("valid");
        assert_eq!(plain.uri().scheme_str(), Some("http"));
        assert!(matches!(
            endpoint("https://127.0.0.1:5", None),
            Err(EndpointError::HttpsWithoutTls)
        ));
        assert!(matches!(
            endpoint("not a uri", None),
            Err(EndpointError::Invalid(_))
        ));
    }

    /// A data connection on loopback, both ends with certificates from one CA: (decode's
    /// end, prefill's end), handshakes done.
    async fn data_connection() -> (server::TlsStream<TcpStream>, client::TlsStream<TcpStream>) {
        let ca = Authority::new("test CA").expect("a CA");
        let (decode, prefill) = (
            issued_for(&ca, &["127.0.0.1"]),
            issued_for(&ca, &["127.0.0.1"]),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let address = listener.local_addr().expect("address").to_string();
        let limit = Duration::from_secs(5);
        let accepting = async {
            let (socket, _) = listener.accept().await.expect("accepts");
            decode.accept(socket, limit).await.expect("handshake")
        };
        let connecting = async {
            let socket = TcpStream::connect(&address).await.expect("connects");
            prefill
                .connect(&address, socket, limit)
                .await
                .expect("handshake")
        };
        tokio::join!(accepting, connecting)
    }

    /// Prefill only writes on a data connection, so decode must send it nothing after the
    /// handshake: bytes left unread in prefill's socket (TLS 1.3 session tickets did) turn its
    /// close into a reset, and decode then loses the end of the transfer it had not read yet.
    #[tokio::test]
    async fn decode_sends_prefill_nothing_after_the_handshake() {
        let (_decode, prefill) = data_connection().await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut unread = [0u8; 512];
        let read = prefill.get_ref().0.try_read(&mut unread);
        assert!(
            matches!(&read, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
            "decode sent {read:?} bytes after the handshake"
        );
    }

    #[tokio::test]
    async fn a_data_connection_is_tls_1_3_with_aes_128_gcm_and_its_own_protocol() {
        let (decode, prefill) = data_connection().await;
        let (decode, prefill) = (decode.get_ref().1, prefill.get_ref().1);
        let sides = [
            (
                decode.protocol_version(),
                decode.negotiated_cipher_suite().map(|s| s.suite()),
                decode.alpn_protocol(),
            ),
            (
                prefill.protocol_version(),
                prefill.negotiated_cipher_suite().map(|s| s.suite()),
                prefill.alpn_protocol(),
            ),
        ];
        for side in sides {
            assert_eq!(
                side,
                (
                    Some(rustls::ProtocolVersion::TLSv1_3),
                    Some(rustls::CipherSuite::TLS13_AES_128_GCM_SHA256),
                    Some(KV_ALPN)
                )
            );
        }
    }

    #[test]
    fn a_data_connection_checks_the_host_it_dialled() {
        use std::net::{IpAddr, Ipv4Addr};
        assert_eq!(
            server_name("127.0.0.1:7").expect("an IP"),
            ServerName::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST).into())
        );
        assert_eq!(
            server_name("decode-0.bulkhead.svc:7").expect("a name"),
            ServerName::try_from("decode-0.bulkhead.svc").expect("valid")
        );
        assert!(server_name("no-port").is_err());
        assert!(server_name("bad host:7").is_err());
    }
}
