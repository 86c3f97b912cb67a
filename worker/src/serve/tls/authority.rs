//! A deployment's own certificate authority, made on the spot: `bulkhead up --tls` makes one
//! per start, `bench transfer` one for its TLS scope, and tests theirs (an operator's
//! deployment brings its own CA). Every certificate it issues serves and presents (server and
//! client authentication), since each process is both. Its certificates are valid from an hour
//! before they are made for [`VALID_FOR`]: a start's CA is not meant to outlive a deployment.

use std::path::Path;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};

use std::sync::Arc;

use tokio_rustls::TlsConnector;
use tokio_rustls::rustls::{self, ClientConfig};

use super::{ClusterTls, TlsError, TlsFiles, trust_anchors};
use crate::serve::secret_file;

/// How long a certificate this CA issues (and the CA's own) stays valid.
pub const VALID_FOR: std::time::Duration = std::time::Duration::from_secs(365 * 24 * 3600);

/// `params` valid from an hour ago (clocks a little behind still accept it) for [`VALID_FOR`]
/// (rcgen's default runs from 1975 to 4096: an expiry no alert would ever see coming).
fn valid_from_now(params: &mut CertificateParams) {
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::hours(1);
    params.not_after = now + VALID_FOR;
}

/// A CA: its certificate and the key that signs what it issues.
pub struct Authority {
    pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl std::fmt::Debug for Authority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Authority(…)")
    }
}

fn named(common_name: &str) -> DistinguishedName {
    let mut name = DistinguishedName::new();
    name.push(DnType::CommonName, common_name);
    name
}

impl Authority {
    /// A fresh CA (a new P-256 key) called `common_name`.
    pub fn new(common_name: &str) -> Result<Authority, rcgen::Error> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::default();
        params.distinguished_name = named(common_name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        valid_from_now(&mut params);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let pem = params.self_signed(&key)?.pem();
        Ok(Authority {
            pem,
            issuer: Issuer::new(params, key),
        })
    }

    /// A client of HTTPS servers whose certificates this CA issued (and no others), offering
    /// HTTP/1.1: `bench gateway --tls`'s load, and tests'.
    pub fn https_client(&self) -> Result<TlsConnector, TlsError> {
        let roots = trust_anchors(Path::new("(this CA)"), self.pem.as_bytes())?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut client = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("ring supports TLS 1.3 and 1.2")
            .with_root_certificates(roots)
            .with_no_client_auth();
        client.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(TlsConnector::from(Arc::new(client)))
    }

    /// The CA certificate, PEM: what every process trusts.
    pub fn ca_pem(&self) -> &str {
        &self.pem
    }

    /// A certificate (with a new key) for a process reached at `names` (DNS names or IP
    /// addresses), good for serving and for presenting as a client: (certificate, key), PEM.
    fn issue(&self, common_name: &str, names: &[String]) -> Result<(String, String), rcgen::Error> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(names.to_vec())?;
        params.distinguished_name = named(common_name);
        params.is_ca = IsCa::ExplicitNoCa;
        valid_from_now(&mut params);
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok((cert.pem(), key.serialize_pem()))
    }

    /// Issues a certificate for `names` and writes it into `dir` with the CA: `ca.pem`,
    /// `NAME.pem` and `NAME.key` (its owner only), the files a process is started with.
    pub fn write(
        &self,
        dir: &Path,
        common_name: &str,
        names: &[String],
    ) -> Result<TlsFiles, WriteError> {
        let (cert_pem, key_pem) = self.issue(common_name, names)?;
        std::fs::create_dir_all(dir)?;
        let files = TlsFiles {
            ca: dir.join("ca.pem"),
            cert: dir.join(format!("{common_name}.pem")),
            key: dir.join(format!("{common_name}.key")),
        };
        std::fs::write(&files.ca, &self.pem)?;
        std::fs::write(&files.cert, cert_pem)?;
        secret_file::write(&files.key, key_pem.as_bytes())?;
        Ok(files)
    }

    /// A process's side of this CA's TLS, reached at `names`, its files never followed: a
    /// certificate issued into a fresh temporary directory, loaded, and the directory removed
    /// (`bench transfer`'s ends, and tests').
    pub fn cluster_tls(&self, names: &[&str]) -> Result<ClusterTls, WriteError> {
        let dir = std::env::temp_dir().join(format!("bulkhead-tls-{}", rand::random::<u64>()));
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        let loaded = self
            .write(&dir, "peer", &names)
            .and_then(|files| Ok(ClusterTls::load(&files)?));
        let _ = std::fs::remove_dir_all(&dir);
        loaded
    }
}

/// Why certificates could not be written (or loaded back).
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("making a certificate: {0}")]
    Certificate(#[from] rcgen::Error),
    #[error("writing a certificate: {0}")]
    Io(#[from] std::io::Error),
    #[error("loading the certificate written: {0}")]
    Load(#[from] TlsError),
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the CA issues is valid now, and lapses within [`VALID_FOR`] of now: not in 4096.
    #[test]
    fn certificates_are_valid_from_now_for_a_year() {
        let ca = Authority::new("test CA").expect("a CA");
        let tls = ca.cluster_tls(&["127.0.0.1"]).expect("issued");
        let clock = std::time::SystemTime::now();
        let since_epoch = clock
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after 1970");
        let now = i64::try_from(since_epoch.as_secs()).expect("fits");
        let validity = tls.validity();
        let year = i64::try_from(VALID_FOR.as_secs()).expect("fits");
        assert!(validity.not_before <= now - 3000, "{validity:?}");
        assert!(validity.not_before >= now - 3700, "{validity:?}");
        assert!(
            (validity.not_after - (now + year)).abs() < 60,
            "{validity:?}"
        );
        assert_eq!(validity.concern(clock), None);
    }
}
