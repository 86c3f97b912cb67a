//! The mutual-TLS flags every process of a deployment takes (`bulkhead worker`, `gateway`,
//! `preflight`), under the same names and environment variables, so one set of settings
//! serves every pod; and the gateway's flags for TLS on its own listeners.

use std::path::PathBuf;

use bulkhead_worker::serve::tls::{ListenerFiles, TlsFiles, TlsSettings};

/// Environment variables, one per flag.
pub mod env {
    pub const TLS_CA: &str = "BULKHEAD_TLS_CA";
    pub const TLS_CERT: &str = "BULKHEAD_TLS_CERT";
    pub const TLS_KEY: &str = "BULKHEAD_TLS_KEY";
    pub const TLS_SERVER_NAME: &str = "BULKHEAD_TLS_SERVER_NAME";
    pub const LISTEN_TLS_CERT: &str = "BULKHEAD_LISTEN_TLS_CERT";
    pub const LISTEN_TLS_KEY: &str = "BULKHEAD_LISTEN_TLS_KEY";
    pub const LISTEN_TLS_CLIENT_CA: &str = "BULKHEAD_LISTEN_TLS_CLIENT_CA";

    /// The cluster's, which `bulkhead up` sets by flag for its workers (with `--tls`) or not
    /// at all.
    pub const CLUSTER: [&str; 4] = [TLS_CA, TLS_CERT, TLS_KEY, TLS_SERVER_NAME];
}

#[derive(Debug, Clone, clap::Args)]
pub struct TlsArgs {
    /// Mutual TLS inside the deployment: the CA certificate (PEM) every peer's certificate
    /// must be signed by. With --tls-cert and --tls-key, every gRPC port and KV listener takes
    /// only TLS connections from peers the CA signed, and every call and transfer goes out
    /// over TLS (whether an address says http:// or https://). The files are read again every
    /// 5 s: a renewal needs no restart.
    #[arg(long, env = env::TLS_CA, requires_all = ["tls_cert", "tls_key"])]
    tls_ca: Option<PathBuf>,
    /// This process's certificate (PEM), naming the host peers reach it at (or the
    /// --tls-server-name).
    #[arg(long, env = env::TLS_CERT, requires_all = ["tls_ca", "tls_key"])]
    tls_cert: Option<PathBuf>,
    /// This process's private key (PEM; other users may not open the file).
    #[arg(long, env = env::TLS_KEY, requires_all = ["tls_ca", "tls_cert"])]
    tls_key: Option<PathBuf>,
    /// The DNS name every server's certificate must carry, instead of the host dialled: for
    /// peers dialled by addresses no certificate names in advance (pod IPs). Needs the TLS
    /// files: these flags' or, for the gateway and preflight, `[cluster]`'s.
    #[arg(long, env = env::TLS_SERVER_NAME)]
    tls_server_name: Option<String>,
}

impl TlsArgs {
    /// The settings in force: the flags' files (with the flags' server name) in place of
    /// `file`'s (the gateway's `[cluster]`; `None` for a worker) when they name any; else
    /// `file`'s, verifying servers as --tls-server-name says when it is given. A server name
    /// with no files from either is refused.
    pub fn over(&self, file: Option<TlsSettings>) -> anyhow::Result<Option<TlsSettings>> {
        if let (Some(ca), Some(cert), Some(key)) = (&self.tls_ca, &self.tls_cert, &self.tls_key) {
            return Ok(Some(TlsSettings {
                files: TlsFiles {
                    ca: ca.clone(),
                    cert: cert.clone(),
                    key: key.clone(),
                },
                server_name: self.tls_server_name.clone(),
            }));
        }
        match (file, &self.tls_server_name) {
            (file, None) => Ok(file),
            (Some(file), Some(name)) => Ok(Some(TlsSettings {
                server_name: Some(name.clone()),
                ..file
            })),
            (None, Some(_)) => anyhow::bail!(
                "--tls-server-name needs the TLS files: --tls-ca, --tls-cert and --tls-key \
                 (gateway and preflight: or [cluster] tls_ca, tls_cert and tls_key)"
            ),
        }
    }
}

/// TLS on the gateway's API and admin ports; given, the certificate and key replace
/// `[listen]`'s, and a client CA the file's (which stays when no flag names one: flags that
/// renew a certificate must not drop the client check the file asks for).
#[derive(Debug, Clone, clap::Args)]
pub struct ListenTlsArgs {
    /// The certificate (chain, PEM) both listeners serve; with --listen-tls-key they take only
    /// TLS. Read again every 5 s: a renewal needs no restart.
    #[arg(long, env = env::LISTEN_TLS_CERT, requires = "listen_tls_key")]
    listen_tls_cert: Option<PathBuf>,
    /// Its private key (PEM; other users may not open the file).
    #[arg(long, env = env::LISTEN_TLS_KEY, requires = "listen_tls_cert")]
    listen_tls_key: Option<PathBuf>,
    /// Clients must also present a certificate this CA (PEM) signed. Needs the listeners'
    /// certificate: --listen-tls-cert and --listen-tls-key, or `[listen]`'s.
    #[arg(long, env = env::LISTEN_TLS_CLIENT_CA)]
    listen_tls_client_ca: Option<PathBuf>,
}

impl ListenTlsArgs {
    /// The listeners' files: the flags' over `file`'s (the configuration's), if either names
    /// any. A client CA without a certificate from either is refused.
    pub fn over(&self, file: Option<ListenerFiles>) -> anyhow::Result<Option<ListenerFiles>> {
        let client_ca = |file: Option<ListenerFiles>| {
            self.listen_tls_client_ca
                .clone()
                .or(file.and_then(|f| f.client_ca))
        };
        match (&self.listen_tls_cert, &self.listen_tls_key, file) {
            (Some(cert), Some(key), file) => Ok(Some(ListenerFiles {
                cert: cert.clone(),
                key: key.clone(),
                client_ca: client_ca(file),
            })),
            (_, _, Some(file)) => Ok(Some(ListenerFiles {
                client_ca: client_ca(Some(file.clone())),
                ..file
            })),
            (_, _, None) if self.listen_tls_client_ca.is_some() => anyhow::bail!(
                "--listen-tls-client-ca needs the listeners' certificate: --listen-tls-cert and \
                 --listen-tls-key, or [listen] tls_cert and tls_key"
            ),
            (_, _, None) => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(cert: Option<&str>, client_ca: Option<&str>) -> ListenTlsArgs {
        ListenTlsArgs {
            listen_tls_cert: cert.map(PathBuf::from),
            listen_tls_key: cert.map(|_| PathBuf::from("/flag/key.pem")),
            listen_tls_client_ca: client_ca.map(PathBuf::from),
        }
    }

    #[test]
    fn the_flags_replace_the_files_but_keep_the_files_client_ca() {
        let file = ListenerFiles {
            cert: "/file/cert.pem".into(),
            key: "/file/key.pem".into(),
            client_ca: Some("/file/ca.pem".into()),
        };
        let over = |args: ListenTlsArgs, file| args.over(file).expect("valid");
        assert_eq!(
            over(args(None, None), Some(file.clone())),
            Some(file.clone())
        );
        assert_eq!(over(args(None, None), None), None);
        let flagged = over(args(Some("/flag/cert.pem"), None), Some(file.clone()));
        assert_eq!(
            flagged,
            Some(ListenerFiles {
                cert: "/flag/cert.pem".into(),
                key: "/flag/key.pem".into(),
                client_ca: Some("/file/ca.pem".into()),
            })
        );
        let own_ca = over(
            args(Some("/flag/cert.pem"), Some("/flag/ca.pem")),
            Some(file),
        );
        assert_eq!(
            own_ca.and_then(|f| f.client_ca),
            Some(PathBuf::from("/flag/ca.pem"))
        );
    }

    /// `--listen-tls-client-ca` adds the client check to the certificate `[listen]` names;
    /// with no certificate anywhere it is refused, naming both places to give one.
    #[test]
    fn a_client_ca_flag_takes_the_files_certificate_and_needs_one() {
        let file = ListenerFiles {
            cert: "/file/cert.pem".into(),
            key: "/file/key.pem".into(),
            client_ca: None,
        };
        assert_eq!(
            args(None, Some("/flag/ca.pem"))
                .over(Some(file.clone()))
                .expect("valid"),
            Some(ListenerFiles {
                client_ca: Some("/flag/ca.pem".into()),
                ..file
            })
        );
        let e = args(None, Some("/flag/ca.pem"))
            .over(None)
            .expect_err("nothing to serve")
            .to_string();
        assert!(
            e.contains("--listen-tls-cert") && e.contains("[listen] tls_cert"),
            "{e}"
        );
    }

    fn cluster(server_name: Option<&str>) -> TlsArgs {
        TlsArgs {
            tls_ca: None,
            tls_cert: None,
            tls_key: None,
            tls_server_name: server_name.map(str::to_owned),
        }
    }

    /// `--tls-server-name` verifies servers as that name with the TLS files `[cluster]`
    /// names; with no files anywhere it is refused, naming both places to give them.
    #[test]
    fn a_server_name_flag_takes_the_files_tls_and_needs_it() {
        let file = TlsSettings {
            files: TlsFiles {
                ca: "/file/ca.pem".into(),
                cert: "/file/cert.pem".into(),
                key: "/file/key.pem".into(),
            },
            server_name: None,
        };
        assert_eq!(
            cluster(None).over(Some(file.clone())).expect("valid"),
            Some(file.clone())
        );
        assert_eq!(
            cluster(Some("bulkhead-worker"))
                .over(Some(file.clone()))
                .expect("valid"),
            Some(TlsSettings {
                server_name: Some("bulkhead-worker".into()),
                ..file
            })
        );
        let e = cluster(Some("bulkhead-worker"))
            .over(None)
            .expect_err("no files")
            .to_string();
        assert!(
            e.contains("--tls-ca") && e.contains("[cluster] tls_ca"),
            "{e}"
        );
        assert_eq!(cluster(None).over(None).expect("valid"), None);
    }
}
