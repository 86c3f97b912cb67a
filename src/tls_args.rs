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
    /// peers dialled by addresses no certificate names in advance (pod IPs).
    #[arg(long, env = env::TLS_SERVER_NAME, requires = "tls_ca")]
    tls_server_name: Option<String>,
}

impl TlsArgs {
    /// The settings the flags give, if they give any.
    pub fn settings(&self) -> Option<TlsSettings> {
        let (Some(ca), Some(cert), Some(key)) = (&self.tls_ca, &self.tls_cert, &self.tls_key)
        else {
            return None;
        };
        Some(TlsSettings {
            files: TlsFiles {
                ca: ca.clone(),
                cert: cert.clone(),
                key: key.clone(),
            },
            server_name: self.tls_server_name.clone(),
        })
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
    /// Clients must also present a certificate this CA (PEM) signed.
    #[arg(long, env = env::LISTEN_TLS_CLIENT_CA, requires = "listen_tls_cert")]
    listen_tls_client_ca: Option<PathBuf>,
}

impl ListenTlsArgs {
    /// The listeners' files: the flags' over `file`'s (the configuration's), if either names
    /// any.
    pub fn over(&self, file: Option<ListenerFiles>) -> Option<ListenerFiles> {
        let (Some(cert), Some(key)) = (&self.listen_tls_cert, &self.listen_tls_key) else {
            return file;
        };
        Some(ListenerFiles {
            cert: cert.clone(),
            key: key.clone(),
            client_ca: self
                .listen_tls_client_ca
                .clone()
                .or(file.and_then(|f| f.client_ca)),
        })
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
        assert_eq!(
            args(None, None).over(Some(file.clone())),
            Some(file.clone())
        );
        assert_eq!(args(None, None).over(None), None);
        let flagged = args(Some("/flag/cert.pem"), None).over(Some(file.clone()));
        assert_eq!(
            flagged,
            Some(ListenerFiles {
                cert: "/flag/cert.pem".into(),
                key: "/flag/key.pem".into(),
                client_ca: Some("/file/ca.pem".into()),
            })
        );
        let own_ca = args(Some("/flag/cert.pem"), Some("/flag/ca.pem")).over(Some(file));
        assert_eq!(
            own_ca.and_then(|f| f.client_ca),
            Some(PathBuf::from("/flag/ca.pem"))
        );
    }
}
