//! TLS on the gateway's HTTP listeners (the OpenAI-compatible API and the admin port): the end
//! that clients outside the deployment reach, and across which API keys, the admin token,
//! prompts and completions travel. Without it they cross the network in the clear unless
//! something in front terminates TLS.
//!
//! Unlike the deployment's own TLS (the parent module), the clients are not the deployment's
//! processes: the certificate is whatever CA the clients trust issued it, TLS 1.2 is offered
//! besides 1.3 (rustls's suites: forward secret, authenticated encryption only), and a
//! client certificate is asked for only when the operator names the CA that must have signed
//! it (`client_ca`). The handshake offers `http/1.1` (ALPN), the one protocol the listeners
//! speak: a client that will take only another (`h2`) is refused in the handshake instead of
//! failing later on a protocol it did not expect. A client that sends plain HTTP to the port
//! is told apart from TLS by its first byte ([`Opened::PlainHttp`]), so that the server can
//! answer it with an error that says to use HTTPS rather than a TLS alert it cannot read.
//!
//! The files are followed like the deployment's ([`ListenerTls::follow`]): a renewed
//! certificate is served from the next connection on, with no restart. Handshakes are counted
//! by how they ended ([`Handshakes`]), for the gateway's metrics: a certificate clients stopped
//! trusting shows as refusals before anyone reports it.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_rustls::rustls::crypto::CryptoProvider;
use tokio_rustls::rustls::{self, ServerConfig};
use tokio_rustls::{TlsAcceptor, server};

use super::{
    TlsError, TlsFiles, Validity, client_verifier, mismatch, pem_file, private_key, secret_file,
    serving_chain, trust_anchors, usage, within,
};
use crate::serve::followed::Followed;

/// The one protocol the listeners speak, as the handshake names it.
const HTTP1_ALPN: &[u8] = b"http/1.1";

/// Where a listener's TLS material lies, all PEM: its certificate (chain) and private key, and
/// the CA that must have signed every client's certificate, when clients must present one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenerFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: Option<PathBuf>,
}

/// A process's certificate and key serving a listener, no client certificate asked for (its
/// CA is the one clients trust, not one clients' certificates come from).
impl From<TlsFiles> for ListenerFiles {
    fn from(files: TlsFiles) -> ListenerFiles {
        ListenerFiles {
            cert: files.cert,
            key: files.key,
            client_ca: None,
        }
    }
}

/// A listener's TLS: the files, loaded and checked, and followed once
/// [`ListenerTls::follow`] runs. Clones share it. Its `Debug` shows no key.
#[derive(Clone)]
pub struct ListenerTls {
    current: Followed<Served>,
    files: Arc<ListenerFiles>,
    counted: Arc<Counted>,
}

/// What a client opened a connection to a TLS port with.
#[derive(Debug)]
pub enum Opened<IO> {
    /// TLS, its handshake done.
    Tls(Box<server::TlsStream<IO>>),
    /// Plain HTTP (nothing read from it yet).
    PlainHttp(IO),
}

/// How many handshakes ended each way, since the listener's TLS was loaded (those still under
/// way when the server shuts down end uncounted).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Handshakes {
    /// Completed: the connection carries HTTP.
    pub completed: u64,
    /// Refused by TLS: no common version, suite or protocol (ALPN), a client's alert (it does
    /// not trust the certificate), a missing or unknown client certificate, not TLS at all
    /// (plain HTTP among it).
    pub refused: u64,
    /// The client closed or reset the connection before the handshake ended (a TCP probe).
    pub closed: u64,
    /// Not finished within its limit.
    pub timed_out: u64,
}

/// The counts as they are updated.
#[derive(Debug, Default)]
struct Counted {
    completed: AtomicU64,
    refused: AtomicU64,
    closed: AtomicU64,
    timed_out: AtomicU64,
}

impl std::fmt::Debug for ListenerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ListenerTls")
            .field("files", &self.files)
            .finish_non_exhaustive()
    }
}

/// The files as read, and the acceptor made from them.
struct Served {
    read: Read,
    validity: Validity,
    acceptor: TlsAcceptor,
}

/// The bytes of the files, to tell whether they changed.
#[derive(PartialEq, Eq)]
struct Read {
    cert: Vec<u8>,
    key: Vec<u8>,
    client_ca: Option<Vec<u8>>,
}

impl Read {
    /// The files' bytes, the key's only if other users cannot open it.
    fn from_files(files: &ListenerFiles) -> Result<Read, TlsError> {
        Ok(Read {
            cert: pem_file("TLS certificate", &files.cert)?,
            key: secret_file::read(&files.key)?,
            client_ca: files
                .client_ca
                .as_deref()
                .map(|ca| pem_file("TLS client CA", ca))
                .transpose()?,
        })
    }
}

/// ring's provider with its default suites (TLS 1.3's, and TLS 1.2's with ECDHE and AEAD).
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl Served {
    fn read(files: &ListenerFiles) -> Result<Served, TlsError> {
        Served::parse(files, Read::from_files(files)?)
    }

    /// The acceptor made from `read`, the bytes of `files`.
    fn parse(files: &ListenerFiles, read: Read) -> Result<Served, TlsError> {
        let (chain, validity) = serving_chain(&files.cert, &read.cert, usage::LISTENER)?;
        let key = private_key(&files.key, &read.key)?;
        let builder = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("ring supports TLS 1.3 and 1.2");
        let builder = match files.client_ca.as_deref().zip(read.client_ca.as_deref()) {
            Some((path, pem)) => {
                let roots = trust_anchors(path, pem)?;
                builder.with_client_cert_verifier(client_verifier(path, &roots, provider())?)
            }
            None => builder.with_no_client_auth(),
        };
        let mut config = builder
            .with_single_cert(chain, key)
            .map_err(|e| mismatch(&files.cert, &files.key, e))?;
        config.alpn_protocols = vec![HTTP1_ALPN.to_vec()];
        Ok(Served {
            acceptor: TlsAcceptor::from(Arc::new(config)),
            read,
            validity,
        })
    }
}

impl ListenerTls {
    /// Reads and checks `files`: the key file is open to its owner only and holds a key, the
    /// certificate goes with it, and the client CA (if any) is usable as a trust anchor.
    pub fn load(files: &ListenerFiles) -> Result<ListenerTls, TlsError> {
        Ok(ListenerTls {
            current: Followed::new(Served::read(files)?),
            files: Arc::new(files.clone()),
            counted: Arc::default(),
        })
    }

    /// Reads the files again every `every`, for as long as it runs (it never returns): files
    /// that changed and load are served from the next connection on, by every clone; files
    /// that do not load keep the ones in use.
    pub async fn follow(self, every: Duration) {
        let files = self.files.clone();
        self.current
            .follow_files(
                every,
                "the listener's TLS files",
                || Read::from_files(&files),
                |served| &served.read,
                |read| Served::parse(&files, read),
            )
            .await;
    }

    /// The handshake on an accepted connection, over `wrap(socket)`, all within `limit`: a
    /// client that stalls it (or never starts it) holds the connection no longer. A client
    /// whose first byte starts an HTTP request line instead (an upper-case letter: no TLS
    /// record starts so) gets its connection back as [`Opened::PlainHttp`], counted as
    /// refused. Counted by how it ended.
    pub async fn accept<IO: AsyncRead + AsyncWrite + Unpin>(
        &self,
        socket: TcpStream,
        wrap: impl FnOnce(TcpStream) -> IO,
        limit: Duration,
    ) -> std::io::Result<Opened<IO>> {
        let acceptor = self.current.current().acceptor.clone();
        let ended = within(limit, async {
            let mut first = [0; 1];
            if socket.peek(&mut first).await? == 1 && first[0].is_ascii_uppercase() {
                return Ok(Opened::PlainHttp(wrap(socket)));
            }
            let tls = acceptor.accept(wrap(socket)).await?;
            Ok(Opened::Tls(Box::new(tls)))
        })
        .await;
        let c = &self.counted;
        let count = match &ended {
            Ok(Opened::Tls(_)) => &c.completed,
            Ok(Opened::PlainHttp(_)) => &c.refused,
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => &c.timed_out,
            // rustls's own errors (and the peer's alerts) come as invalid data.
            Err(e) if e.kind() == std::io::ErrorKind::InvalidData => &c.refused,
            Err(_) => &c.closed,
        };
        count.fetch_add(1, Ordering::Relaxed);
        ended
    }

    /// The validity of the certificate served now.
    pub fn validity(&self) -> Validity {
        self.current.current().validity
    }

    /// How the handshakes have ended so far (every clone's).
    pub fn handshakes(&self) -> Handshakes {
        let c = &self.counted;
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Handshakes {
            completed: n(&c.completed),
            refused: n(&c.refused),
            closed: n(&c.closed),
            timed_out: n(&c.timed_out),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;

    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::net::{TcpListener, TcpStream};
    use tokio_rustls::TlsConnector;
    use tokio_rustls::rustls::pki_types::pem::PemObject as _;
    use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    use tokio_rustls::rustls::{ClientConfig, ProtocolVersion};

    use super::super::Authority;
    use super::super::tests::tempdir;
    use super::*;

    const LOOPBACK: &str = "127.0.0.1";

    /// A listener certificate for 127.0.0.1 from `ca`, in `dir`, with no client CA.
    fn issued(ca: &Authority, dir: &std::path::Path) -> (TlsFiles, ListenerFiles) {
        let files = ca
            .write(dir, "api", &[LOOPBACK.to_owned()])
            .expect("writes");
        (files.clone(), files.into())
    }

    /// How a test client connects.
    struct Client<'a> {
        /// The CA it trusts.
        trusts: &'a Authority,
        alpn: &'a [&'a [u8]],
        /// Only TLS 1.2 (rustls's default offers 1.3 and 1.2).
        tls12_only: bool,
        /// The certificate and key it presents.
        presents: Option<&'a TlsFiles>,
    }

    impl<'a> Client<'a> {
        fn trusting(trusts: &'a Authority) -> Client<'a> {
            Client {
                trusts,
                alpn: &[b"http/1.1"],
                tls12_only: false,
                presents: None,
            }
        }

        fn connector(&self) -> TlsConnector {
            let ca = self.trusts.ca_pem().as_bytes();
            let roots = trust_anchors(std::path::Path::new("ca.pem"), ca).expect("the CA");
            let builder = ClientConfig::builder_with_provider(provider());
            let builder = if self.tls12_only {
                builder.with_protocol_versions(&[&rustls::version::TLS12])
            } else {
                builder.with_safe_default_protocol_versions()
            }
            .expect("versions")
            .with_root_certificates(roots);
            let mut config = match self.presents {
                None => builder.with_no_client_auth(),
                Some(files) => {
                    let chain = CertificateDer::pem_file_iter(&files.cert)
                        .expect("reads")
                        .collect::<Result<Vec<_>, _>>()
                        .expect("certificates");
                    let key = PrivateKeyDer::from_pem_file(&files.key).expect("a key");
                    builder.with_client_auth_cert(chain, key).expect("usable")
                }
            };
            config.alpn_protocols = self.alpn.iter().map(|p| p.to_vec()).collect();
            TlsConnector::from(Arc::new(config))
        }

        /// Whether the listener at `addr` takes this client: its handshake completes and the
        /// server's first bytes arrive over it. Then the version and protocol agreed.
        async fn admitted(&self, addr: std::net::SocketAddr) -> Option<(ProtocolVersion, Vec<u8>)> {
            let socket = TcpStream::connect(addr).await.expect("connects");
            let name = ServerName::try_from(LOOPBACK).expect("a name");
            let mut tls = self.connector().connect(name, socket).await.ok()?;
            // In TLS 1.3 a client finishes its handshake before the server has checked the
            // client's certificate: a refusal shows on the first read.
            let mut greeting = [0; 2];
            tokio::time::timeout(Duration::from_secs(5), tls.read_exact(&mut greeting))
                .await
                .expect("the server answers or hangs up")
                .ok()?;
            assert_eq!(&greeting, b"ok");
            let (_, session) = tls.get_ref();
            Some((
                session.protocol_version().expect("a version"),
                session.alpn_protocol().unwrap_or_default().to_vec(),
            ))
        }
    }

    /// A listener on loopback that completes each connection's handshake with `tls` (within
    /// `limit`) and writes "ok" over it.
    async fn listening(tls: ListenerTls, limit: Duration) -> std::net::SocketAddr {
        let listener = TcpListener::bind((LOOPBACK, 0)).await.expect("bind");
        let addr = listener.local_addr().expect("address");
        tokio::spawn(async move {
            loop {
                let (socket, _) = listener.accept().await.expect("accepts");
                let tls = tls.clone();
                tokio::spawn(async move {
                    match tls.accept(socket, |s| s, limit).await {
                        Ok(Opened::Tls(mut stream)) => {
                            let _ = stream.write_all(b"ok").await;
                            let _ = stream.flush().await;
                            let _ = stream.read(&mut [0; 1]).await;
                        }
                        Ok(Opened::PlainHttp(mut plain)) => {
                            let _ = plain.write_all(b"plain").await;
                        }
                        Err(_) => {}
                    }
                });
            }
        });
        addr
    }

    /// TLS 1.3 or 1.2, `http/1.1` as the protocol (or none named), the certificate checked
    /// against the CA the client trusts; a client that will speak only h2 is refused in the
    /// handshake, and so is one that trusts another CA.
    #[tokio::test]
    async fn a_listener_takes_tls_1_3_and_1_2_for_http_1_1_only() {
        let dir = tempdir::Dir::new();
        let ca = Authority::new("public CA").expect("a CA");
        let (_, files) = issued(&ca, &dir.0);
        let tls = ListenerTls::load(&files).expect("loads");
        let addr = listening(tls.clone(), Duration::from_secs(5)).await;

        let http1 = b"http/1.1".to_vec();
        let client = Client::trusting(&ca);
        assert_eq!(
            client.admitted(addr).await,
            Some((ProtocolVersion::TLSv1_3, http1.clone()))
        );
        let tls12 = Client {
            tls12_only: true,
            ..Client::trusting(&ca)
        };
        assert_eq!(
            tls12.admitted(addr).await,
            Some((ProtocolVersion::TLSv1_2, http1))
        );
        let unnamed = Client {
            alpn: &[],
            ..Client::trusting(&ca)
        };
        assert_eq!(
            unnamed.admitted(addr).await,
            Some((ProtocolVersion::TLSv1_3, Vec::new()))
        );
        let h2_only = Client {
            alpn: &[b"h2"],
            ..Client::trusting(&ca)
        };
        assert_eq!(h2_only.admitted(addr).await, None);
        let stranger = Authority::new("another CA").expect("a CA");
        assert_eq!(Client::trusting(&stranger).admitted(addr).await, None);
        drop(TcpStream::connect(addr).await.expect("connects"));
        // Plain HTTP is told apart (and counted as refused); bytes that are neither are left
        // to TLS, which refuses them.
        for (sent, answer) in [
            (&b"GET / HTTP/1.1\r\n\r\n"[..], &b"plain"[..]),
            (&b"get / HTTP/1.1\r\n\r\n"[..], &b""[..]),
        ] {
            let mut socket = TcpStream::connect(addr).await.expect("connects");
            socket.write_all(sent).await.expect("sends");
            let mut got = Vec::new();
            let _ = socket.read_to_end(&mut got).await;
            assert_eq!(got.starts_with(b"plain"), answer == b"plain", "{got:?}");
        }
        let expected = Handshakes {
            completed: 3,
            refused: 4,
            closed: 1,
            timed_out: 0,
        };
        for _ in 0..100 {
            if tls.handshakes() == expected {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(
            tls.handshakes(),
            expected,
            "h2 only and another CA refused, a probe closed"
        );
    }

    /// With a client CA, a client must present a certificate that CA signed: none, or one of
    /// another CA, gets no connection.
    #[tokio::test]
    async fn with_a_client_ca_only_clients_it_signed_are_taken() {
        let dir = tempdir::Dir::new();
        let (ca, clients, strangers) = (
            Authority::new("public CA").expect("a CA"),
            Authority::new("clients' CA").expect("a CA"),
            Authority::new("another CA").expect("a CA"),
        );
        let (_, mut files) = issued(&ca, &dir.0);
        let client_files = clients
            .write(&dir.0.join("client"), "client", &["client".to_owned()])
            .expect("writes");
        let stranger_files = strangers
            .write(&dir.0.join("stranger"), "client", &["client".to_owned()])
            .expect("writes");
        files.client_ca = Some(client_files.ca.clone());
        let tls = ListenerTls::load(&files).expect("loads");
        let addr = listening(tls, Duration::from_secs(5)).await;

        assert_eq!(Client::trusting(&ca).admitted(addr).await, None);
        let signed = Client {
            presents: Some(&client_files),
            ..Client::trusting(&ca)
        };
        assert!(signed.admitted(addr).await.is_some());
        let stranger = Client {
            presents: Some(&stranger_files),
            ..Client::trusting(&ca)
        };
        assert_eq!(stranger.admitted(addr).await, None);
    }

    /// A client that opens a connection and sends nothing (or half a hello) is disconnected
    /// at the handshake's limit instead of holding the connection.
    #[tokio::test]
    async fn a_stalled_handshake_is_given_up_at_its_limit() {
        let dir = tempdir::Dir::new();
        let ca = Authority::new("public CA").expect("a CA");
        let (_, files) = issued(&ca, &dir.0);
        let tls = ListenerTls::load(&files).expect("loads");
        let addr = listening(tls.clone(), Duration::from_millis(300)).await;
        for sent in [&b""[..], &[0x16, 0x03, 0x01, 0x01, 0x00, 0x01][..]] {
            let mut socket = TcpStream::connect(addr).await.expect("connects");
            socket.write_all(sent).await.expect("sends");
            let started = std::time::Instant::now();
            let mut rest = Vec::new();
            let ended =
                tokio::time::timeout(Duration::from_secs(5), socket.read_to_end(&mut rest)).await;
            assert!(ended.is_ok(), "still connected after 5 s ({sent:?})");
            assert!(started.elapsed() >= Duration::from_millis(250), "{sent:?}");
        }
        assert_eq!(tls.handshakes().timed_out, 2);
    }

    /// A renewal (here from another CA) is served to every connection made after the next
    /// reload, with no restart; a renewal left broken keeps the certificate in use.
    #[tokio::test]
    async fn a_renewed_certificate_is_served_to_new_connections_without_a_restart() {
        let dir = tempdir::Dir::new();
        let (old_ca, new_ca) = (
            Authority::new("old CA").expect("a CA"),
            Authority::new("new CA").expect("a CA"),
        );
        let (_, files) = issued(&old_ca, &dir.0);
        let tls = ListenerTls::load(&files).expect("loads");
        let addr = listening(tls.clone(), Duration::from_secs(5)).await;
        let (old, new) = (Client::trusting(&old_ca), Client::trusting(&new_ca));
        assert!(old.admitted(addr).await.is_some());
        assert!(new.admitted(addr).await.is_none());

        let follower = tokio::spawn(tls.follow(Duration::from_millis(20)));
        issued(&new_ca, &dir.0);
        let mut renewed = false;
        for _ in 0..100 {
            if new.admitted(addr).await.is_some() {
                renewed = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(renewed, "the renewal never reached a new connection");
        assert!(
            old.admitted(addr).await.is_none(),
            "the old certificate is gone"
        );

        std::fs::write(&files.cert, "-----BEGIN CERTIFICATE-----\n").expect("writes");
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            new.admitted(addr).await.is_some(),
            "a broken renewal keeps the last one"
        );
        // And the files are still followed: the renewal finished is served.
        let last_ca = Authority::new("last CA").expect("a CA");
        issued(&last_ca, &dir.0);
        let last = Client::trusting(&last_ca);
        let mut finished = false;
        for _ in 0..100 {
            if last.admitted(addr).await.is_some() {
                finished = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            finished,
            "the files were no longer followed after a broken renewal"
        );
        follower.abort();
    }

    /// The listeners only serve: their certificate needs server authentication (clients
    /// refuse one without), not client authentication (public CAs no longer issue it).
    #[test]
    fn a_listeners_certificate_needs_server_authentication_only() {
        use rcgen::ExtendedKeyUsagePurpose::{ClientAuth, ServerAuth};
        let dir = tempdir::Dir::new();
        let files = ListenerFiles {
            cert: dir.0.join("api.pem"),
            key: dir.0.join("api.key"),
            client_ca: None,
        };
        let load = |purpose| {
            let mut params =
                rcgen::CertificateParams::new(vec![LOOPBACK.to_owned()]).expect("valid names");
            params.extended_key_usages = vec![purpose];
            let key = rcgen::KeyPair::generate().expect("a key");
            let cert = params.self_signed(&key).expect("signed");
            std::fs::write(&files.cert, cert.pem()).expect("writes");
            secret_file::write(&files.key, key.serialize_pem().as_bytes()).expect("writes");
            ListenerTls::load(&files)
        };
        assert!(load(ServerAuth).is_ok());
        let e = load(ClientAuth).expect_err("cannot serve").to_string();
        assert!(
            e.contains("api.pem") && e.contains("does not allow server authentication"),
            "{e}"
        );
    }

    /// Files that cannot serve are refused at load with a reason naming them: a missing
    /// certificate, a key other users may read, a key of another certificate, a client CA
    /// that is not one.
    #[test]
    fn bad_listener_files_are_refused_with_a_reason_that_names_them() {
        let dir = tempdir::Dir::new();
        let ca = Authority::new("public CA").expect("a CA");
        let (_, files) = issued(&ca, &dir.0);
        let refused =
            |files: &ListenerFiles| ListenerTls::load(files).expect_err("refused").to_string();
        // Loaded, its Debug names the files and shows nothing of the key.
        let key_pem = std::fs::read_to_string(&files.key).expect("reads");
        let shown = format!("{:?}", ListenerTls::load(&files).expect("loads"));
        let secret = key_pem.lines().nth(1).expect("a line of the key");
        assert!(
            shown.contains("api.key") && !shown.contains(secret),
            "{shown}"
        );
        let e = refused(&ListenerFiles {
            cert: dir.0.join("absent.pem"),
            ..files.clone()
        });
        assert!(e.contains("absent.pem"), "{e}");

        let (other, _) = issued(&Authority::new("other").expect("a CA"), &dir.0.join("o"));
        let e = refused(&ListenerFiles {
            key: other.key,
            ..files.clone()
        });
        assert!(e.contains("cannot be used together"), "{e}");

        // A certificate cut short says which line is missing, as text.
        let cut = dir.0.join("cut.pem");
        let whole = std::fs::read_to_string(&files.cert).expect("reads");
        std::fs::write(&cut, &whole[..whole.len() / 2]).expect("writes");
        let e = refused(&ListenerFiles {
            cert: cut,
            ..files.clone()
        });
        assert!(
            e.contains("cut.pem") && e.contains("-----END CERTIFICATE-----"),
            "{e}"
        );
        // A key block whose bytes are no key is refused as such, not as a mismatch.
        let garbled = dir.0.join("garbled.key");
        secret_file::write(
            &garbled,
            b"-----BEGIN PRIVATE KEY-----\nAAECAwQF\n-----END PRIVATE KEY-----\n",
        )
        .expect("writes");
        let e = refused(&ListenerFiles {
            key: garbled,
            ..files.clone()
        });
        assert!(
            e.contains("garbled.key") && e.contains("not a usable key"),
            "{e}"
        );
        // A key whose line breaks were lost (one line): refused without quoting it.
        let flattened = dir.0.join("flattened.key");
        secret_file::write(&flattened, key_pem.replace('\n', " ").as_bytes()).expect("writes");
        let e = refused(&ListenerFiles {
            key: flattened,
            ..files.clone()
        });
        assert!(e.contains("not a usable key") && !e.contains(secret), "{e}");

        let junk = dir.0.join("junk-ca.pem");
        std::fs::write(&junk, "not a certificate\n").expect("writes");
        let e = refused(&ListenerFiles {
            client_ca: Some(junk),
            ..files.clone()
        });
        assert!(e.contains("junk-ca.pem"), "{e}");

        std::fs::set_permissions(&files.key, std::fs::Permissions::from_mode(0o644))
            .expect("chmod");
        let e = refused(&files);
        assert!(e.contains("open to other users"), "{e}");
    }
}
