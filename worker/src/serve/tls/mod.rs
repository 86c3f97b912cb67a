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
//!  gateway ──gRPC (h2 over TLS)──▶ decode ──gRPC (h2 over TLS)──▶ prefill
//!                                    ▲                              │
//!                                    └──KV data plane (bulkhead-kv/1 over TLS)
//! ```
//!
//! One TLS stack for every hop: rustls on `ring`, TLS 1.3 only, the protocol named in the
//! handshake (ALPN: `h2` for gRPC, `bulkhead-kv/1` for the data plane, so a connection meant
//! for one is never taken for the other). A client checks that the server's certificate names
//! the host it dialled (a DNS name or an IP address in its subject alternative names).
//!
//! The files are followed ([`ClusterTls::follow`]): a renewed certificate, key or CA is used
//! for every connection made after the next reload, with no restart; connections already open
//! keep the certificates they were made with, and files that cannot be used (a renewal half
//! written) keep the ones in use.

mod authority;
mod grpc;
mod listener;
mod usage;
mod validity;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::net::TcpStream;
use tokio_rustls::rustls::crypto::CryptoProvider;
use tokio_rustls::rustls::pki_types::pem::{self, PemObject};
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{self, ClientConfig, ConfigBuilder, RootCertStore, ServerConfig};
use tokio_rustls::{TlsAcceptor, TlsConnector, client, server};

pub use authority::{Authority, WriteError};
pub use grpc::{EndpointError, WorkerEndpoint, answered_in_plain_text, endpoint};
pub use listener::{Handshakes, ListenerFiles, ListenerTls, Opened};
pub use usage::{Part, Usage};
pub use validity::{Concern, RENEW_WITHIN, Validity, render_expiry};

use super::followed::Followed;
use super::secret_file::{self, SecretFileError};

/// The protocol the KV data plane's TLS handshake names (ALPN).
const KV_ALPN: &[u8] = b"bulkhead-kv/1";

/// The protocol gRPC's TLS handshake names: HTTP/2.
const GRPC_ALPN: &[u8] = b"h2";

/// Where one process's TLS material lies: the deployment's CA certificate(s), this process's
/// certificate (chain) and its private key, all PEM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// One process's TLS settings: its files, and the name every server's certificate must
/// carry when it is not the host dialled (see [`ClusterTls::verifying_servers_as`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsSettings {
    pub files: TlsFiles,
    pub server_name: Option<String>,
}

impl TlsSettings {
    /// The files read and checked for a process playing `part`, servers verified as the
    /// settings say.
    pub fn load(&self, part: Part) -> Result<ClusterTls, TlsError> {
        let tls = ClusterTls::load_as(&self.files, part)?;
        match &self.server_name {
            Some(name) => tls.verifying_servers_as(name),
            None => Ok(tls),
        }
    }
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
    #[error(
        "the TLS certificate {path}{which} does not allow {} (peers refuse it for that): \
         reissue it with {} in its extendedKeyUsage, or with no extendedKeyUsage",
        list(missing, Usage::to_string),
        list(missing, |u| u.keyword().to_owned())
    )]
    Usage {
        path: String,
        /// Empty for the process's own certificate; which CA of the file's chain
        /// otherwise (peers check every certificate of the chain presented).
        which: String,
        missing: Vec<Usage>,
    },
    #[error("the TLS private key {path} holds no PEM private key")]
    NoKey { path: String },
    #[error("the TLS private key {path} is not a usable key: {reason}")]
    BadKey { path: String, reason: String },
    #[error("the TLS CA {path} is not a usable CA certificate: {reason}")]
    BadCa { path: String, reason: String },
    #[error("the TLS certificate {cert} and key {key} cannot be used together: {reason}")]
    Mismatch {
        cert: String,
        key: String,
        reason: String,
    },
    #[error("the TLS server name {name:?} is not a DNS name: {reason}")]
    ServerName { name: String, reason: String },
}

/// One process's side of the deployment's mutual TLS: the files, loaded and checked, and
/// followed once [`ClusterTls::follow`] runs. Its `Debug` shows no key.
///
/// Clones share it: every data connection and prefill call holds one.
#[derive(Clone)]
pub struct ClusterTls {
    current: Followed<Loaded>,
    files: Arc<TlsFiles>,
    /// What this process does, which the certificate must allow at every reload.
    part: Part,
    /// The name every server's certificate must carry, when not the host dialled.
    servers: Option<ServerName<'static>>,
}

impl std::fmt::Debug for ClusterTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterTls(…)")
    }
}

/// The files as read, and the ends of both planes made from them.
struct Loaded {
    read: Read,
    validity: Validity,
    grpc: Ends,
    kv: Ends,
}

/// The bytes of the files, to tell whether they changed.
#[derive(PartialEq, Eq)]
struct Read {
    ca: Vec<u8>,
    cert: Vec<u8>,
    key: Vec<u8>,
}

/// A server's and a client's end for one protocol.
struct Ends {
    acceptor: TlsAcceptor,
    connector: TlsConnector,
}

/// The cryptography provider of every end: ring's, with AES-128-GCM preferred (128-bit
/// security, and fewer rounds per byte of KV than AES-256-GCM, ring's first choice).
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

/// The bytes of the PEM file at `path` (the `what`).
fn pem_file(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.display().to_string(),
        source,
    })
}

/// The certificates in `pem`, read from `path` (the `what`): at least one, each parsed.
fn certificates(
    what: &'static str,
    path: &Path,
    pem: &[u8],
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let shown = || path.display().to_string();
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::BadCertificate {
            what,
            path: shown(),
            reason: pem_reason(&e),
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            what,
            path: shown(),
        });
    }
    Ok(certs)
}

/// The certificate chain this process presents, read from `path`, and its first
/// certificate's validity. A chain any of whose certificates — a root's copy aside — has an
/// extendedKeyUsage that leaves out a usage in `needed` is refused ([`usage`]: peers check
/// the intermediate CAs the file presents too); one that is not valid now or lapses within
/// [`RENEW_WITHIN`] is warned of, at every load of the files.
fn serving_chain(
    path: &Path,
    pem: &[u8],
    needed: &[Usage],
) -> Result<(Vec<CertificateDer<'static>>, Validity), TlsError> {
    let what = "TLS certificate";
    let chain = certificates(what, path, pem)?;
    let bad = |reason: String| TlsError::BadCertificate {
        what,
        path: path.display().to_string(),
        reason,
    };
    let mut parsed = Vec::with_capacity(chain.len());
    for (at, der) in chain.iter().enumerate() {
        // The first is the process's own; each one after it, a CA of its chain.
        let which = match at {
            0 => String::new(),
            n => format!(" (its certificate {}, a CA of its chain)", n + 1),
        };
        let (_, cert) = x509_parser::parse_x509_certificate(der)
            .map_err(|e| bad(format!("its certificate{which} does not parse: {e}")))?;
        // A root's copy in the file is never on the path peers build (they start from their
        // own trust anchors), so its extendedKeyUsage is not theirs to check.
        if at > 0 && cert.subject() == cert.issuer() {
            parsed.push(cert);
            continue;
        }
        let missing = usage::missing(&cert, needed).map_err(|e| {
            bad(format!(
                "the extendedKeyUsage of its certificate{which} does not parse: {e}"
            ))
        })?;
        if !missing.is_empty() {
            return Err(TlsError::Usage {
                path: path.display().to_string(),
                which,
                missing,
            });
        }
        parsed.push(cert);
    }
    let validity = Validity::of(&parsed[0]);
    if let Some(concern) = validity.concern(SystemTime::now()) {
        tracing::warn!(certificate = %path.display(), "the TLS certificate {concern}");
    }
    Ok((chain, validity))
}

/// Each of `usages` as `word` says, joined: "a", "a and b".
fn list(usages: &[Usage], word: impl Fn(&Usage) -> String) -> String {
    usages.iter().map(word).collect::<Vec<_>>().join(" and ")
}

/// Why PEM text of certificates does not parse, its lines as text (the parser's own message
/// shows them as byte values). Never for a key: the lines quoted could be the key itself (a key
/// whose line breaks were lost is one line, taken for a BEGIN line).
fn pem_reason(e: &pem::Error) -> String {
    let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
    match e {
        pem::Error::MissingSectionEnd { end_marker } => {
            format!("no -----END {}----- line (cut short?)", text(end_marker))
        }
        pem::Error::IllegalSectionStart { line } => {
            format!("a malformed BEGIN line {:?}", text(line))
        }
        other => other.to_string(),
    }
}

/// The private key in `pem`, read from `path`: a PEM key block whose key the signing code
/// can use (a block whose bytes are no key is refused here, not later as a mismatch with the
/// certificate). The reasons quote nothing of the file.
fn private_key(path: &Path, pem: &[u8]) -> Result<PrivateKeyDer<'static>, TlsError> {
    let bad = |reason: &str| TlsError::BadKey {
        path: path.display().to_string(),
        reason: reason.to_owned(),
    };
    let key = PrivateKeyDer::from_pem_slice(pem).map_err(|e| match e {
        pem::Error::NoItemsFound => TlsError::NoKey {
            path: path.display().to_string(),
        },
        pem::Error::MissingSectionEnd { .. } | pem::Error::IllegalSectionStart { .. } => {
            bad("its PEM block is malformed or not closed (line breaks lost?)")
        }
        _ => bad("its PEM block does not decode"),
    })?;
    rustls::crypto::ring::sign::any_supported_type(&key)
        .map_err(|_| bad("its bytes are no key of a supported type"))?;
    Ok(key)
}

/// The CA certificates in `pem`, read from `path`, as the only roots a peer's certificate may
/// chain to.
fn trust_anchors(path: &Path, pem: &[u8]) -> Result<Arc<RootCertStore>, TlsError> {
    let mut roots = RootCertStore::empty();
    for cert in certificates("TLS CA", path, pem)? {
        roots.add(cert).map_err(|e| bad_ca(path, e))?;
    }
    Ok(Arc::new(roots))
}

/// A server's check of its clients: a certificate that chains to `roots` (read from `ca`).
fn client_verifier(
    ca: &Path,
    roots: &Arc<RootCertStore>,
    provider: Arc<CryptoProvider>,
) -> Result<Arc<dyn rustls::server::danger::ClientCertVerifier>, TlsError> {
    WebPkiClientVerifier::builder_with_provider(roots.clone(), provider)
        .build()
        .map_err(|e| bad_ca(ca, e))
}

fn bad_ca(path: &Path, reason: impl std::fmt::Display) -> TlsError {
    TlsError::BadCa {
        path: path.display().to_string(),
        reason: reason.to_string(),
    }
}

/// The certificate at `cert` does not go with the key at `key`.
fn mismatch(cert: &Path, key: &Path, e: rustls::Error) -> TlsError {
    TlsError::Mismatch {
        cert: cert.display().to_string(),
        key: key.display().to_string(),
        reason: e.to_string(),
    }
}

impl Read {
    /// The files' bytes, the key's only if other users cannot open it.
    fn from_files(files: &TlsFiles) -> Result<Read, TlsError> {
        Ok(Read {
            ca: pem_file("TLS CA", &files.ca)?,
            cert: pem_file("TLS certificate", &files.cert)?,
            key: secret_file::read(&files.key)?,
        })
    }
}

impl Loaded {
    /// Reads and checks `files` for a process playing `part`: the CA parses and is usable as
    /// a trust anchor, the key file is open to its owner only and holds a key, and the
    /// certificate goes with the key and allows what `part` needs.
    fn read(files: &TlsFiles, part: Part) -> Result<Loaded, TlsError> {
        Loaded::parse(files, part, Read::from_files(files)?)
    }

    /// The ends made from `read`, the bytes of `files`.
    fn parse(files: &TlsFiles, part: Part, read: Read) -> Result<Loaded, TlsError> {
        let roots = trust_anchors(&files.ca, &read.ca)?;
        let (chain, validity) = serving_chain(&files.cert, &read.cert, part.needs())?;
        let key = private_key(&files.key, &read.key)?;
        let mismatch = |e| mismatch(&files.cert, &files.key, e);
        let ends = |alpn: &[u8]| -> Result<Ends, TlsError> {
            let verifier = client_verifier(&files.ca, &roots, provider())?;
            let mut server = tls13(ServerConfig::builder_with_provider(provider()))
                .with_client_cert_verifier(verifier)
                .with_single_cert(chain.clone(), key.clone_key())
                .map_err(mismatch)?;
            server.alpn_protocols = vec![alpn.to_vec()];
            // No session tickets: nothing resumes, and a data connection then carries nothing
            // from decode to prefill after the handshake. Prefill only writes; a ticket left
            // unread in its socket made its close a reset, and decode lost what it had not
            // read yet.
            server.send_tls13_tickets = 0;
            let mut client = tls13(ClientConfig::builder_with_provider(provider()))
                .with_root_certificates(roots.clone())
                .with_client_auth_cert(chain.clone(), key.clone_key())
                .map_err(mismatch)?;
            client.alpn_protocols = vec![alpn.to_vec()];
            Ok(Ends {
                acceptor: TlsAcceptor::from(Arc::new(server)),
                connector: TlsConnector::from(Arc::new(client)),
            })
        };
        Ok(Loaded {
            grpc: ends(GRPC_ALPN)?,
            kv: ends(KV_ALPN)?,
            read,
            validity,
        })
    }
}

/// `handshake`, within `limit`: a peer that stalls it (or never starts it) holds a connection
/// no longer.
async fn within<T>(
    limit: Duration,
    handshake: impl Future<Output = std::io::Result<T>>,
) -> std::io::Result<T> {
    tokio::time::timeout(limit, handshake)
        .await
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))?
}

impl ClusterTls {
    /// Reads and checks a worker's `files` (see [`TlsError`] for what is refused).
    pub fn load(files: &TlsFiles) -> Result<ClusterTls, TlsError> {
        ClusterTls::load_as(files, Part::ServesAndCalls)
    }

    /// Reads and checks `files` for a process playing `part`.
    pub fn load_as(files: &TlsFiles, part: Part) -> Result<ClusterTls, TlsError> {
        Ok(ClusterTls {
            current: Followed::new(Loaded::read(files, part)?),
            files: Arc::new(files.clone()),
            part,
            servers: None,
        })
    }

    /// Every server this process calls must hold a certificate for `name` (a DNS name),
    /// whatever address it was dialled at: for deployments whose peers are dialled at
    /// addresses no certificate can name in advance (pod IPs, which a pod's certificate is
    /// issued before it has). Without it, a server's certificate must name the host dialled.
    pub fn verifying_servers_as(self, name: &str) -> Result<ClusterTls, TlsError> {
        let named = ServerName::try_from(name.to_owned()).map_err(|e| TlsError::ServerName {
            name: name.to_owned(),
            reason: e.to_string(),
        })?;
        Ok(ClusterTls {
            servers: Some(named),
            ..self
        })
    }

    /// The name the certificate of the server at `address` (`host:port`) must carry.
    fn server_name_for(&self, address: &str) -> std::io::Result<ServerName<'static>> {
        match &self.servers {
            Some(name) => Ok(name.clone()),
            None => server_name(address),
        }
    }

    /// Reads the files again every `every`, for as long as it runs (it never returns): files
    /// that changed and load are used from the next connection on, by every clone.
    pub async fn follow(self, every: Duration) {
        let (files, part) = (self.files.clone(), self.part);
        self.current
            .follow_files(
                every,
                "the TLS files",
                || Read::from_files(&files),
                |loaded| &loaded.read,
                |read| Loaded::parse(&files, part, read),
            )
            .await;
    }

    /// The validity of the certificate this process presents now.
    pub fn validity(&self) -> Validity {
        self.current.current().validity
    }

    /// The KV data plane, decode's side: the handshake on an accepted connection, within
    /// `limit`.
    pub async fn accept(
        &self,
        socket: TcpStream,
        limit: Duration,
    ) -> std::io::Result<server::TlsStream<TcpStream>> {
        let acceptor = self.current.current().kv.acceptor.clone();
        within(limit, acceptor.accept(socket)).await
    }

    /// The KV data plane, prefill's side: the handshake on `socket`, connected to `address`
    /// (`host:port`), whose certificate must name that host (or the name servers are verified
    /// as); within `limit`.
    pub async fn connect(
        &self,
        address: &str,
        socket: TcpStream,
        limit: Duration,
    ) -> std::io::Result<client::TlsStream<TcpStream>> {
        let connector = self.current.current().kv.connector.clone();
        within(
            limit,
            connector.connect(self.server_name_for(address)?, socket),
        )
        .await
    }
}

/// TLS 1.3 only: nothing older is negotiated.
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

    pub(super) mod tempdir {
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

        // A file in the directory holding `text`.
        let holding = |name: &str, text: &str| {
            let path = dir.0.join(name);
            std::fs::write(&path, text).expect("writes");
            path
        };
        let e = refused(&TlsFiles {
            cert: holding("garbage.pem", "not a certificate\n"),
            ..files.clone()
        });
        assert!(
            e.contains("holds no PEM certificate") && e.contains("garbage.pem"),
            "{e}"
        );

        // A PEM block whose body is not base64, and a CA block whose bytes are no certificate.
        let e = refused(&TlsFiles {
            cert: holding(
                "broken.pem",
                "-----BEGIN CERTIFICATE-----\n!!!!\n-----END CERTIFICATE-----\n",
            ),
            ..files.clone()
        });
        assert!(e.contains("not a valid PEM certificate"), "{e}");
        let e = refused(&TlsFiles {
            ca: holding(
                "junk-ca.pem",
                "-----BEGIN CERTIFICATE-----\nAAECAwQF\n-----END CERTIFICATE-----\n",
            ),
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

    /// Writes over `files`' certificate and key a self-signed certificate for 127.0.0.1,
    /// valid until 2090, whose extendedKeyUsage lists `purposes` (`None`: no such extension),
    /// and its key. Returns its notAfter.
    fn self_signed_over(
        files: &TlsFiles,
        purposes: Option<Vec<rcgen::ExtendedKeyUsagePurpose>>,
    ) -> i64 {
        let mut params =
            rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()]).expect("valid names");
        params.extended_key_usages = purposes.unwrap_or_default();
        params.not_after = rcgen::date_time_ymd(2090, 1, 1);
        let key = rcgen::KeyPair::generate().expect("a key");
        let cert = params.self_signed(&key).expect("signed");
        std::fs::write(&files.cert, cert.pem()).expect("writes");
        secret_file::write(&files.key, key.serialize_pem().as_bytes()).expect("writes");
        // 2090-01-01 00:00 UTC.
        3_786_912_000
    }

    /// Peers check the extendedKeyUsage of every certificate of the chain presented: an
    /// intermediate CA restricted to server authentication in a worker's file made every call
    /// it placed fail in the handshake, though the file loaded. It is refused at load, named.
    #[test]
    fn an_intermediate_ca_that_cannot_call_is_refused_at_load() {
        use rcgen::{
            BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
        };
        let (dir, files) = written();
        let root_key = KeyPair::generate().expect("a key");
        let named = |name: &str| {
            let mut dn = rcgen::DistinguishedName::new();
            dn.push(rcgen::DnType::CommonName, name);
            dn
        };
        let mut root = CertificateParams::default();
        root.distinguished_name = named("a root");
        root.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        // Peers never check their trust anchor's usages: a copy of it in the file passes.
        root.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let root_pem = root.self_signed(&root_key).expect("signed").pem();
        let root = Issuer::new(root, root_key);
        let chain = |purposes: Vec<ExtendedKeyUsagePurpose>| {
            let key = KeyPair::generate().expect("a key");
            let mut middle = CertificateParams::default();
            middle.distinguished_name = named("an intermediate");
            middle.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            middle.extended_key_usages = purposes;
            let middle_pem = middle.signed_by(&key, &root).expect("signed").pem();
            let middle = Issuer::new(middle, key);
            let leaf_key = KeyPair::generate().expect("a key");
            let leaf = CertificateParams::new(vec!["127.0.0.1".to_owned()]).expect("names");
            let leaf_pem = leaf.signed_by(&leaf_key, &middle).expect("signed").pem();
            std::fs::write(&files.cert, format!("{leaf_pem}{middle_pem}{root_pem}"))
                .expect("writes");
            secret_file::write(&files.key, leaf_key.serialize_pem().as_bytes()).expect("writes");
            std::fs::write(&files.ca, &root_pem).expect("writes");
        };
        chain(vec![ExtendedKeyUsagePurpose::ServerAuth]);
        let e = ClusterTls::load(&files).expect_err("refused").to_string();
        assert!(
            e.contains(
                "(its certificate 2, a CA of its chain) does not allow client \
                 authentication"
            ),
            "{e}"
        );
        chain(vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ]);
        assert!(ClusterTls::load(&files).is_ok());
        drop(dir);
    }

    /// A prefill or decode worker serves and calls: a certificate whose extendedKeyUsage
    /// leaves out client (or server) authentication is refused by name when the files are loaded — peers would
    /// refuse it in every handshake —, and a renewal without it keeps the files in use; one
    /// with no extendedKeyUsage at all may be used for anything.
    #[tokio::test]
    async fn a_certificate_that_cannot_both_serve_and_call_is_refused_at_load_and_reload() {
        use rcgen::ExtendedKeyUsagePurpose::{ClientAuth, ServerAuth};
        let (_dir, files) = written();
        let tls = ClusterTls::load(&files).expect("loads");
        let in_use = tls.validity();
        let follower = tokio::spawn(tls.clone().follow(Duration::from_millis(20)));

        self_signed_over(&files, Some(vec![ServerAuth]));
        let e = ClusterTls::load(&files).expect_err("refused").to_string();
        assert!(
            e.contains("does not allow client authentication (calling other processes)")
                && e.contains("with clientAuth in its extendedKeyUsage")
                && e.contains(&files.cert.display().to_string())
                && !e.contains("serverAuth"),
            "{e}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(
            tls.validity(),
            in_use,
            "a renewal that cannot call was taken"
        );

        self_signed_over(&files, Some(vec![ClientAuth]));
        let e = ClusterTls::load(&files).expect_err("refused").to_string();
        assert!(
            e.contains("does not allow server authentication (serving)"),
            "{e}"
        );

        assert!(
            ClusterTls::load_as(&files, Part::Calls).is_ok(),
            "a gateway only calls"
        );

        let not_after = self_signed_over(&files, None);
        assert!(ClusterTls::load(&files).is_ok());
        let mut renewed = false;
        for _ in 0..50 {
            tokio::time::sleep(Duration::from_millis(20)).await;
            if tls.validity().not_after == not_after {
                renewed = true;
                break;
            }
        }
        assert!(
            renewed,
            "a certificate without extendedKeyUsage was not taken"
        );
        follower.abort();
    }

    /// A data connection on loopback, both ends with certificates from one CA: (decode's
    /// end, prefill's end), handshakes done.
    async fn data_connection() -> (server::TlsStream<TcpStream>, client::TlsStream<TcpStream>) {
        let ca = Authority::new("test CA").expect("a CA");
        let (decode, prefill) = (
            ca.cluster_tls(&["127.0.0.1"]).expect("issued"),
            ca.cluster_tls(&["127.0.0.1"]).expect("issued"),
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

    /// A gRPC server's connections and a KV listener, both with one process's TLS.
    struct Listening {
        tls: ClusterTls,
        incoming: tokio_stream::wrappers::ReceiverStream<
            std::io::Result<crate::serve::grpc_incoming::Admitted<server::TlsStream<TcpStream>>>,
        >,
        grpc: String,
        kv: tokio::net::TcpListener,
    }

    impl Listening {
        async fn new(tls: &ClusterTls) -> Listening {
            let bind = || tokio::net::TcpListener::bind("127.0.0.1:0");
            let grpc = bind().await.expect("bind");
            Listening {
                tls: tls.clone(),
                grpc: grpc.local_addr().expect("address").to_string(),
                incoming: tls.grpc_incoming(
                    grpc,
                    crate::serve::grpc_incoming::Limits::WORKER,
                    std::sync::Arc::default(),
                ),
                kv: bind().await.expect("bind"),
            }
        }

        /// Whether the gRPC server and the KV listener take a connection from `client`:
        /// (gRPC, KV data plane).
        async fn admits(&mut self, client: &ClusterTls) -> (bool, bool) {
            use tokio_stream::StreamExt as _;
            let limit = Duration::from_millis(500);
            let _ = client.connect_grpc(&self.grpc).await;
            let by_grpc = matches!(
                tokio::time::timeout(limit, self.incoming.next()).await,
                Ok(Some(Ok(_)))
            );
            let kv = self.kv.local_addr().expect("address").to_string();
            let connecting = async {
                let socket = TcpStream::connect(&kv).await.expect("connects");
                client.connect(&kv, socket, limit).await
            };
            let accepting = async {
                let (socket, _) = self.kv.accept().await.expect("accepts");
                self.tls.accept(socket, limit).await
            };
            let (_, by_kv) = tokio::join!(connecting, accepting);
            (by_grpc, by_kv.is_ok())
        }
    }

    /// A renewal — here to another CA altogether: certificate, key and CA — reaches every
    /// connection made after the next reload, on both planes, with no restart; a renewal left
    /// broken (a certificate file half written) keeps the certificates in use.
    #[tokio::test]
    async fn a_renewed_certificate_reaches_new_connections_without_a_restart() {
        let dir = tempdir::Dir::new();
        let names = ["127.0.0.1".to_owned()];
        let (old_ca, new_ca) = (
            Authority::new("old CA").expect("a CA"),
            Authority::new("new CA").expect("a CA"),
        );
        let files = old_ca.write(&dir.0, "worker", &names).expect("writes");
        let server = ClusterTls::load(&files).expect("loads");
        let (old, new) = (
            old_ca.cluster_tls(&["127.0.0.1"]).expect("issued"),
            new_ca.cluster_tls(&["127.0.0.1"]).expect("issued"),
        );
        let mut listening = Listening::new(&server).await;
        assert_eq!(listening.admits(&old).await, (true, true));
        assert_eq!(listening.admits(&new).await, (false, false));

        let follower = tokio::spawn(server.clone().follow(Duration::from_millis(20)));
        new_ca.write(&dir.0, "worker", &names).expect("renews");
        let mut renewed = false;
        for _ in 0..50 {
            if listening.admits(&new).await == (true, true) {
                renewed = true;
                break;
            }
        }
        assert!(renewed, "the renewal never reached a new connection");
        assert_eq!(
            listening.admits(&old).await,
            (false, false),
            "the old CA is gone"
        );

        std::fs::write(&files.cert, "-----BEGIN CERTIFICATE-----\n").expect("writes");
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(
            listening.admits(&new).await,
            (true, true),
            "a broken renewal keeps the last one"
        );
        follower.abort();
    }

    /// Neither plane speaks anything older than TLS 1.3, even to a client the CA signed
    /// (tonic's own TLS took 1.2 on gRPC).
    #[tokio::test]
    async fn a_client_offering_only_tls_1_2_gets_no_connection_on_either_plane() {
        let (_dir, files) = written();
        let server = ClusterTls::load(&files).expect("loads");
        let mut listening = Listening::new(&server).await;
        let read = Read::from_files(&files).expect("reads");
        let ca = certificates("TLS CA", &files.ca, &read.ca).expect("a CA");
        let chain =
            certificates("TLS certificate", &files.cert, &read.cert).expect("a certificate");
        let mut roots = RootCertStore::empty();
        roots.add_parsable_certificates(ca);
        let tls12 = |alpn: &[u8]| {
            let ring = Arc::new(rustls::crypto::ring::default_provider());
            let mut config = ClientConfig::builder_with_provider(ring)
                .with_protocol_versions(&[&rustls::version::TLS12])
                .expect("ring speaks TLS 1.2")
                .with_root_certificates(roots.clone())
                .with_client_auth_cert(
                    chain.clone(),
                    PrivateKeyDer::from_pem_slice(&read.key).expect("a key"),
                )
                .expect("a client");
            config.alpn_protocols = vec![alpn.to_vec()];
            TlsConnector::from(Arc::new(config))
        };
        let name = || server_name("127.0.0.1:1").expect("a name");

        let socket = TcpStream::connect(&listening.grpc).await.expect("connects");
        let e = tls12(GRPC_ALPN)
            .connect(name(), socket)
            .await
            .expect_err("refused");
        assert!(e.to_string().contains("ProtocolVersion"), "{e}");
        use tokio_stream::StreamExt as _;
        let taken = tokio::time::timeout(Duration::from_millis(300), listening.incoming.next());
        assert!(taken.await.is_err(), "the gRPC server took the connection");

        let kv = listening.kv.local_addr().expect("address");
        let connecting = async {
            let socket = TcpStream::connect(kv).await.expect("connects");
            tls12(KV_ALPN).connect(name(), socket).await
        };
        let accepting = async {
            let (socket, _) = listening.kv.accept().await.expect("accepts");
            server.accept(socket, Duration::from_secs(5)).await
        };
        let (connected, accepted) = tokio::join!(connecting, accepting);
        let e = connected.expect_err("refused");
        assert!(e.to_string().contains("ProtocolVersion"), "{e}");
        assert!(accepted.is_err(), "the KV plane took the connection");
        // The same client offering TLS 1.3 is taken: the refusal is the version's.
        assert_eq!(listening.admits(&server).await, (true, true));
    }

    /// Both planes ask every client for a certificate of their CA: one that trusts the CA but
    /// presents no certificate, or another CA's, is refused on each. (A foreign client that
    /// also distrusts the server fails on its own side, before the server judges it: such a
    /// test would pass with a server that asked for nothing.)
    #[tokio::test]
    async fn a_client_without_a_certificate_of_the_ca_gets_no_connection_on_either_plane() {
        use tokio_stream::StreamExt as _;
        let (_dir, files) = written();
        let server = ClusterTls::load(&files).expect("loads");
        let mut listening = Listening::new(&server).await;
        let read = Read::from_files(&files).expect("reads");
        let mut roots = RootCertStore::empty();
        roots.add_parsable_certificates(certificates("TLS CA", &files.ca, &read.ca).expect("a CA"));
        let other_dir = tempdir::Dir::new();
        let other = Authority::new("another CA")
            .expect("a CA")
            .write(&other_dir.0, "intruder", &["127.0.0.1".to_owned()])
            .expect("writes");
        let other_read = Read::from_files(&other).expect("reads");
        let other_chain =
            certificates("TLS certificate", &other.cert, &other_read.cert).expect("a certificate");
        // A TLS 1.3 client trusting the server's CA, with another CA's certificate or none.
        let client = |alpn: &[u8], presents: bool| {
            let trusting = ClientConfig::builder_with_provider(provider())
                .with_protocol_versions(&[&rustls::version::TLS13])
                .expect("TLS 1.3")
                .with_root_certificates(roots.clone());
            let mut config = if presents {
                let key = PrivateKeyDer::from_pem_slice(&other_read.key).expect("a key");
                trusting
                    .with_client_auth_cert(other_chain.clone(), key)
                    .expect("a client")
            } else {
                trusting.with_no_client_auth()
            };
            config.alpn_protocols = vec![alpn.to_vec()];
            TlsConnector::from(Arc::new(config))
        };
        let name = || server_name("127.0.0.1:1").expect("a name");
        let limit = Duration::from_millis(300);
        for presents in [false, true] {
            let socket = TcpStream::connect(&listening.grpc).await.expect("connects");
            // TLS 1.3: the client may think it is done before the server has judged it.
            let _connected = client(GRPC_ALPN, presents).connect(name(), socket).await;
            let taken = tokio::time::timeout(limit, listening.incoming.next()).await;
            assert!(
                !matches!(taken, Ok(Some(Ok(_)))),
                "the gRPC server took a client presenting {}",
                if presents {
                    "another CA's certificate"
                } else {
                    "none"
                }
            );
            let kv = listening.kv.local_addr().expect("address");
            let connecting = async {
                let socket = TcpStream::connect(kv).await.expect("connects");
                client(KV_ALPN, presents).connect(name(), socket).await
            };
            let accepting = async {
                let (socket, _) = listening.kv.accept().await.expect("accepts");
                server.accept(socket, Duration::from_secs(5)).await
            };
            let (_connected, accepted) = tokio::join!(connecting, accepting);
            assert!(
                accepted.is_err(),
                "the KV plane took it (presents: {presents})"
            );
        }
        // The server's own certificate is taken on both: the refusals are the certificates'.
        assert_eq!(listening.admits(&server).await, (true, true));
    }

    /// Peers dialled at addresses no certificate names in advance (pod IPs) are verified as
    /// one name instead: a server whose certificate carries only that name is taken, on both
    /// planes, by a client verifying servers as it, and refused by one checking the address
    /// dialled or verifying another name.
    #[tokio::test]
    async fn servers_can_be_verified_as_one_name_whatever_address_they_are_dialled_at() {
        let dir = tempdir::Dir::new();
        let ca = Authority::new("test CA").expect("a CA");
        let files = ca
            .write(&dir.0, "worker", &["bulkhead-worker".to_owned()])
            .expect("writes");
        let server = ClusterTls::load(&files).expect("loads");
        let mut listening = Listening::new(&server).await;
        let client = ca.cluster_tls(&["127.0.0.1"]).expect("issued");
        assert_eq!(listening.admits(&client).await, (false, false));
        let named = |name: &str| client.clone().verifying_servers_as(name).expect("a name");
        assert_eq!(
            listening.admits(&named("bulkhead-worker")).await,
            (true, true)
        );
        assert_eq!(
            listening.admits(&named("bulkhead-other")).await,
            (false, false)
        );
        let e = client
            .verifying_servers_as("not a name")
            .expect_err("refused");
        assert!(e.to_string().contains("not a DNS name"), "{e}");
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
