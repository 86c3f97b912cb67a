//! The cluster token: a secret one deployment's gateway and workers share. A worker started
//! with one (`--cluster-token-file`) answers only the gRPC calls that present it
//! (`authorization: Bearer …`) and presents it on its own calls (decode → prefill); the gateway
//! presents it on every call to its workers (`[cluster] token_file`).
//!
//! The file holds one secret per line: the first is presented, every one is accepted. To rotate
//! without a refused call: add the new secret as a second line everywhere (restart each
//! process), move it to the first line everywhere, then drop the old one.
//!
//! Without it, anyone who reaches a worker's gRPC port runs requests past the gateway: under
//! any tenant's name, with none of its keys, limits, policies or audit records, and a prefill
//! worker computes whatever prompt it is sent and writes the KV to whatever address it is given.

use std::path::Path;
use std::sync::Arc;

use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::{Request, Status};

use super::proto::WorkerClient;
use super::secret_file::{self, SecretFileError};

/// A client of a worker that presents the cluster token, when there is one.
pub type Client = WorkerClient<InterceptedService<Channel, Presents>>;

/// A client of the worker at the other end of `channel`, presenting `token`.
pub fn client(channel: Channel, token: Option<ClusterToken>) -> Client {
    WorkerClient::with_interceptor(channel, Presents(token.map(Arc::new)))
}

/// The shortest secret accepted: 128 bits as hex.
pub const MIN_SECRET_CHARS: usize = 32;

/// The metadata key the token travels in.
const HEADER: &str = "authorization";

/// Why a cluster token cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("the cluster token file: {0}")]
    File(#[from] SecretFileError),
    #[error(
        "the cluster token must be at least {MIN_SECRET_CHARS} characters (it has {0}); \
         `openssl rand -hex 32` makes one"
    )]
    TooShort(usize),
    #[error("the cluster token must be printable ASCII without spaces")]
    NotPrintable,
}

/// A cluster secret, as the `authorization` value calls carry, and the others accepted while
/// it is rotated. Its `Debug` never shows them.
#[derive(Clone, PartialEq, Eq)]
pub struct ClusterToken {
    /// Presented on calls, and accepted.
    header: MetadataValue<Ascii>,
    /// Accepted too (the next or the previous secret during a rotation).
    also_accepted: Vec<MetadataValue<Ascii>>,
}

impl std::fmt::Debug for ClusterToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterToken(…)")
    }
}

/// `secret` as an `authorization` value.
fn bearer(secret: &str) -> Result<MetadataValue<Ascii>, TokenError> {
    if !secret.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(TokenError::NotPrintable);
    }
    if secret.len() < MIN_SECRET_CHARS {
        return Err(TokenError::TooShort(secret.len()));
    }
    MetadataValue::try_from(format!("Bearer {secret}")).map_err(|_| TokenError::NotPrintable)
}

/// Whether `a` and `b` are equal, in time that does not depend on where they differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |differ, (x, y)| differ | (x ^ y)) == 0
}

impl ClusterToken {
    /// The secrets in `text`, one per line (blank lines and surrounding whitespace ignored):
    /// the first is presented, all are accepted.
    pub fn parse(text: &str) -> Result<ClusterToken, TokenError> {
        let mut secrets = text.lines().map(str::trim).filter(|l| !l.is_empty());
        let header = bearer(secrets.next().unwrap_or_default())?;
        let also_accepted = secrets.map(bearer).collect::<Result<_, _>>()?;
        Ok(ClusterToken {
            header,
            also_accepted,
        })
    }

    /// The token in the file at `path`, which other users may not open (see [`secret_file`]).
    pub fn read(path: &Path) -> Result<ClusterToken, TokenError> {
        let bytes = secret_file::read(path)?;
        ClusterToken::parse(std::str::from_utf8(&bytes).map_err(|_| TokenError::NotPrintable)?)
    }

    /// A fresh random token (256 bits) and its secret, to write where the others read it.
    pub fn generate() -> (ClusterToken, String) {
        let bytes: [u8; 32] = rand::random();
        let secret: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        let token = ClusterToken::parse(&secret).expect("64 hex characters are a valid token");
        (token, secret)
    }

    /// Whether `presented` (an `authorization` value) is one of this token's secrets; every
    /// one is compared, each in constant time.
    fn admits(&self, presented: &[u8]) -> bool {
        std::iter::once(&self.header)
            .chain(&self.also_accepted)
            .fold(false, |found, t| found | same(t.as_bytes(), presented))
    }
}

/// Writes `secrets` to `path` as a token file, readable and writable by its owner only.
pub fn write_file(path: &Path, secrets: &str) -> std::io::Result<()> {
    secret_file::write(path, secrets.as_bytes())
}

/// A client's side: adds the token (when there is one) to every call. Shared: a client is
/// cloned for every call.
#[derive(Debug, Clone, Default)]
pub struct Presents(pub Option<Arc<ClusterToken>>);

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
        let sent = Presents(Some(Arc::new(ClusterToken::parse(SECRET).expect("valid"))))
            .call(Request::new(()))
            .expect("added");
        assert!(requires.call(sent).is_ok());
        // Without a token, every call is answered (the worker runs unprotected).
        assert!(Requires(None).call(presented(None)).is_ok());
    }

    #[test]
    fn a_second_secret_is_accepted_and_never_presented_so_a_rotation_refuses_no_call() {
        let old = "0123456789abcdef0123456789abcdef";
        let new = "fedcba9876543210fedcba9876543210";
        let both = ClusterToken::parse(&format!("{old}\n\n{new}\n")).expect("two secrets");
        let bearer = |s: &str| Some(format!("Bearer {s}"));
        let mut requires = Requires(Some(both.clone()));
        for secret in [old, new] {
            let call = presented(bearer(secret).as_deref());
            assert!(requires.call(call).is_ok(), "{secret} accepted");
        }
        let other = "00000000000000000000000000000000";
        assert!(requires.call(presented(bearer(other).as_deref())).is_err());
        // The first line is the one presented.
        let sent = Presents(Some(Arc::new(both)))
            .call(Request::new(()))
            .expect("added");
        assert_eq!(
            sent.metadata().get(HEADER).and_then(|v| v.to_str().ok()),
            bearer(old).as_deref()
        );
        // A bad second line is refused like a bad first one.
        assert!(matches!(
            ClusterToken::parse(&format!("{old}\nshort")),
            Err(TokenError::TooShort(5))
        ));
    }

    #[test]
    fn a_token_file_other_users_can_open_is_refused_by_its_name() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir =
            std::env::temp_dir().join(format!("bulkhead-token-mode-{}", rand::random::<u64>()));
        std::fs::create_dir_all(&dir).expect("a directory");
        let file = dir.join("token");
        write_file(&file, SECRET).expect("writes");
        assert!(
            ClusterToken::read(&file).is_ok(),
            "written for its owner only"
        );
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let refused = ClusterToken::read(&file).expect_err("exposed").to_string();
        assert!(
            refused.contains("cluster token file") && refused.contains("open to other users"),
            "{refused}"
        );
        let _ = std::fs::remove_dir_all(&dir);
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
