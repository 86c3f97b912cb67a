//! The cluster token: a secret one deployment's gateway and workers share. A worker started
//! with one (`--cluster-token-file`) answers only the gRPC calls that present it
//! (`authorization: Bearer …`) and presents it on its own calls (decode → prefill); the gateway
//! presents it on every call to its workers (`[cluster] token_file`).
//!
//! Without it, anyone who reaches a worker's gRPC port runs requests past the gateway: under
//! any tenant's name, with none of its keys, limits, policies or audit records, and a prefill
//! worker computes whatever prompt it is sent and writes the KV to whatever address it is given.

use std::path::Path;

use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::{Request, Status};

use super::proto::WorkerClient;

/// A client of a worker that presents the cluster token, when there is one.
pub type Client = WorkerClient<InterceptedService<Channel, Presents>>;

/// A client of the worker at the other end of `channel`, presenting `token`.
pub fn client(channel: Channel, token: Option<ClusterToken>) -> Client {
    WorkerClient::with_interceptor(channel, Presents(token))
}

/// The shortest secret accepted: 128 bits as hex.
pub const MIN_SECRET_CHARS: usize = 32;

/// The metadata key the token travels in.
const HEADER: &str = "authorization";

/// Why a cluster token cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("cannot read the cluster token file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error(
        "the cluster token must be at least {MIN_SECRET_CHARS} characters (it has {0}); \
         `openssl rand -hex 32` makes one"
    )]
    TooShort(usize),
    #[error("the cluster token must be printable ASCII without spaces")]
    NotPrintable,
}

/// A cluster secret, as the `authorization` value calls carry. Its `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct ClusterToken {
    header: MetadataValue<Ascii>,
}

impl std::fmt::Debug for ClusterToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterToken(…)")
    }
}

impl ClusterToken {
    /// The token in `secret` (surrounding whitespace trimmed).
    pub fn parse(secret: &str) -> Result<ClusterToken, TokenError> {
        let secret = secret.trim();
        if !secret.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(TokenError::NotPrintable);
        }
        if secret.len() < MIN_SECRET_CHARS {
            return Err(TokenError::TooShort(secret.len()));
        }
        let header = MetadataValue::try_from(format!("Bearer {secret}"))
            .map_err(|_| TokenError::NotPrintable)?;
        Ok(ClusterToken { header })
    }

    /// The token in the file at `path`.
    pub fn read(path: &Path) -> Result<ClusterToken, TokenError> {
        let text = std::fs::read_to_string(path).map_err(|source| TokenError::Read {
            path: path.display().to_string(),
            source,
        })?;
        ClusterToken::parse(&text)
    }

    /// A fresh random token (256 bits) and its secret, to write where the others read it.
    pub fn generate() -> (ClusterToken, String) {
        let bytes: [u8; 32] = rand::random();
        let secret: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        let token = ClusterToken::parse(&secret).expect("64 hex characters are a valid token");
        (token, secret)
    }

    /// Whether `presented` (an `authorization` value) is this token, in time that does not
    /// depend on where they differ.
    fn admits(&self, presented: &[u8]) -> bool {
        let expected = self.header.as_bytes();
        expected.len() == presented.len()
            && expected
                .iter()
                .zip(presented)
                .fold(0u8, |differ, (a, b)| differ | (a ^ b))
                == 0
    }
}

/// A client's side: adds the token (when there is one) to every call.
#[derive(Debug, Clone, Default)]
pub struct Presents(pub Option<ClusterToken>);

impl Interceptor for Presents {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(token) = &self.0 {
            request.metadata_mut().insert(HEADER, token.header.clone());
        }
        Ok(request)
    }
}

/// A server's side: refuses every call without the token (when there is one).
#[derive(Debug, Clone, Default)]
pub struct Requires(pub Option<ClusterToken>);

impl Interceptor for Requires {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let Some(token) = &self.0 else {
            return Ok(request);
        };
        let presented = request.metadata().get(HEADER).map(MetadataValue::as_bytes);
        if presented.is_some_and(|p| token.admits(p)) {
            Ok(request)
        } else {
            Err(Status::unauthenticated(
                "this worker answers only calls that present its cluster token",
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "0123456789abcdef0123456789abcdef";

    fn presented(value: Option<&str>) -> Request<()> {
        let mut r = Request::new(());
        if let Some(v) = value {
            r.metadata_mut()
                .insert(HEADER, MetadataValue::try_from(v).expect("ascii"));
        }
        r
    }

    #[test]
    fn a_worker_with_a_token_admits_only_calls_that_present_it() {
        let mut requires = Requires(Some(ClusterToken::parse(SECRET).expect("valid")));
        let refused = |r: Result<Request<()>, Status>| {
            r.err().map(|s| s.code()) == Some(tonic::Code::Unauthenticated)
        };
        assert!(refused(requires.call(presented(None))));
        assert!(refused(requires.call(presented(Some("Bearer nope")))));
        let one_off = format!("Bearer {}0", &SECRET[..SECRET.len() - 1]);
        assert!(refused(requires.call(presented(Some(&one_off)))));
        assert!(refused(requires.call(presented(Some(SECRET)))), "no scheme");
        let right = format!("Bearer {SECRET}");
        assert!(requires.call(presented(Some(&right))).is_ok());
        // What a client with the token sends is admitted.
        let sent = Presents(Some(ClusterToken::parse(SECRET).expect("valid")))
            .call(Request::new(()))
            .expect("added");
        assert!(requires.call(sent).is_ok());
        // Without a token, every call is answered (the worker runs unprotected).
        assert!(Requires(None).call(presented(None)).is_ok());
    }

    #[test]
    fn a_token_is_long_printable_and_never_shown() {
        assert!(matches!(
            ClusterToken::parse("short"),
            Err(TokenError::TooShort(5))
        ));
        assert!(matches!(
            ClusterToken::parse(&format!("{SECRET} {SECRET}")),
            Err(TokenError::NotPrintable)
        ));
        assert!(
            ClusterToken::parse(&format!("  {SECRET}\n")).is_ok(),
            "trimmed"
        );
        let (token, secret) = ClusterToken::generate();
        assert_eq!(secret.len(), 64);
        assert!(!format!("{token:?}").contains(&secret));
        assert_ne!(ClusterToken::generate().1, secret);
    }
}
