//! What a process's own certificate may be used for. A prefill or decode worker both serves
//! (its gRPC port, a decode worker's KV listener) and calls (decode its prefill, prefill
//! decode's KV listener), so its cluster certificate must allow TLS server and client
//! authentication; a colocated worker only serves, the gateway and preflight only call
//! workers ([`Part`]); the gateway's own listeners only serve ([`LISTENER`]). Peers check this only in the handshake: a certificate without client
//! authentication serves, then has every call it makes refused — so it is refused where the
//! files are loaded instead, naming the usage it lacks.
//!
//! The rule is the peers' own (rustls' verifiers, RFC 5280 §4.2.1.12): a certificate without
//! an extendedKeyUsage extension may be used for anything; one with it, only for the purposes
//! it lists by name (`anyExtendedKeyUsage` does not stand in for them). The verifiers apply it
//! to every certificate of the chain presented, so it is checked on each intermediate CA the
//! certificate file holds too.

use x509_parser::certificate::X509Certificate;

/// A purpose of TLS certificates that every process's own needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Usage {
    /// `serverAuth`: serving a gRPC port or a KV listener.
    ServerAuth,
    /// `clientAuth`: calling another process.
    ClientAuth,
}

/// What a process does on the deployment's mutual TLS, which decides the usages its
/// certificate needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// A prefill or decode worker: serves gRPC and the KV data plane, and calls its peers
    /// (serverAuth and clientAuth).
    ServesAndCalls,
    /// A colocated worker: only serves (serverAuth).
    Serves,
    /// The gateway and preflight: only call workers (clientAuth).
    Calls,
}

impl Part {
    /// The usages a certificate must allow to play this part.
    pub(super) fn needs(self) -> &'static [Usage] {
        match self {
            Part::ServesAndCalls => &[Usage::ServerAuth, Usage::ClientAuth],
            Part::Serves => &[Usage::ServerAuth],
            Part::Calls => &[Usage::ClientAuth],
        }
    }
}

/// What the certificate of the gateway's own listeners is used for: serving.
pub(super) const LISTENER: &[Usage] = &[Usage::ServerAuth];

impl Usage {
    /// Its name in an extendedKeyUsage (RFC 5280's `id-kp-…`).
    pub fn keyword(self) -> &'static str {
        match self {
            Usage::ServerAuth => "serverAuth",
            Usage::ClientAuth => "clientAuth",
        }
    }
}

impl std::fmt::Display for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Usage::ServerAuth => "server authentication (serving)",
            Usage::ClientAuth => "client authentication (calling other processes)",
        })
    }
}

/// The usages of `needed` that `cert`'s extendedKeyUsage leaves out (none when it has no such
/// extension), or why the extension cannot be read.
pub(super) fn missing(cert: &X509Certificate<'_>, needed: &[Usage]) -> Result<Vec<Usage>, String> {
    let Some(eku) = cert.extended_key_usage().map_err(|e| e.to_string())? else {
        return Ok(Vec::new());
    };
    let allows = |usage: &Usage| match usage {
        Usage::ServerAuth => eku.value.server_auth,
        Usage::ClientAuth => eku.value.client_auth,
    };
    Ok(needed.iter().filter(|u| !allows(u)).copied().collect())
}

#[cfg(test)]
mod tests {
    use rcgen::ExtendedKeyUsagePurpose as Purpose;

    use super::*;

    /// What a certificate listing `purposes` (no extension at all when `None`) lacks to play
    /// `part`.
    fn lacks_for(part: Part, purposes: Option<Vec<Purpose>>) -> Vec<Usage> {
        let mut params =
            rcgen::CertificateParams::new(vec!["localhost".to_owned()]).expect("valid names");
        params.extended_key_usages = purposes.unwrap_or_default();
        let key = rcgen::KeyPair::generate().expect("a key");
        let cert = params.self_signed(&key).expect("signed");
        let (_, parsed) = x509_parser::parse_x509_certificate(cert.der()).expect("parses");
        missing(&parsed, part.needs()).expect("readable")
    }

    /// What a worker's certificate listing `purposes` lacks.
    fn lacks(purposes: Option<Vec<Purpose>>) -> Vec<Usage> {
        lacks_for(Part::ServesAndCalls, purposes)
    }

    #[test]
    fn a_certificate_must_list_both_server_and_client_authentication_when_it_lists_any() {
        assert_eq!(lacks(None), []);
        assert_eq!(
            lacks(Some(vec![Purpose::ServerAuth, Purpose::ClientAuth])),
            []
        );
        assert_eq!(lacks(Some(vec![Purpose::ServerAuth])), [Usage::ClientAuth]);
        assert_eq!(lacks(Some(vec![Purpose::ClientAuth])), [Usage::ServerAuth]);
        assert_eq!(
            lacks(Some(vec![Purpose::Any])),
            [Usage::ServerAuth, Usage::ClientAuth],
            "peers do not take anyExtendedKeyUsage for either"
        );
        assert_eq!(
            lacks(Some(vec![Purpose::CodeSigning])),
            [Usage::ServerAuth, Usage::ClientAuth]
        );
    }

    /// The gateway and preflight only call: client authentication is all they need (the
    /// Kubernetes TLS overlay issues the gateway's with no other).
    #[test]
    fn a_caller_needs_client_authentication_only() {
        assert_eq!(lacks_for(Part::Calls, Some(vec![Purpose::ClientAuth])), []);
        assert_eq!(
            lacks_for(Part::Calls, Some(vec![Purpose::ServerAuth])),
            [Usage::ClientAuth]
        );
        assert_eq!(lacks_for(Part::Calls, None), []);
    }

    /// A colocated worker only serves: server authentication is all it needs.
    #[test]
    fn a_colocated_worker_needs_server_authentication_only() {
        assert_eq!(lacks_for(Part::Serves, Some(vec![Purpose::ServerAuth])), []);
        assert_eq!(
            lacks_for(Part::Serves, Some(vec![Purpose::ClientAuth])),
            [Usage::ServerAuth]
        );
    }
}
