//! The cluster token: a secret one deployment's gateway and workers share. A worker started
//! with one (`--cluster-token-file`) answers only the gRPC calls that present it
//! (`authorization: Bearer …`) and presents it on its own calls (decode → prefill); the gateway
//! presents it on every call to its workers (`[cluster] token_file`).
//!
//! The file holds one secret per line: the first is presented, every one is accepted. Every
//! process reads its file again every [`RELOAD_EVERY`](super::followed::RELOAD_EVERY)
//! ([`SharedToken::follow`]), so a rotation needs no restart and refuses no call: add the new
//! secret as a second line everywhere, wait for the reload, move it to the first line
//! everywhere, wait, then drop the old one.
//!
//! Without it, anyone who reaches a worker's gRPC port runs requests past the gateway: under
//! any tenant's name, with none of its keys, limits, policies or audit records, and a prefill
//! worker computes whatever prompt it is sent and writes the KV to whatever address it is given.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::{Request, Status};

use super::followed::Followed;
use super::grpc_incoming::Vouching;
use super::proto::WorkerClient;
use super::secret_file::{self, SecretFileError};

/// A client of a worker that presents the cluster token, when there is one.
pub type Client = WorkerClient<InterceptedService<Channel, Presents>>;

/// A client of the worker at the other end of `channel`, presenting `token`.
pub fn client(channel: Channel, token: Option<ClusterToken>) -> Client {
    shared_client(channel, token.map(SharedToken::fixed))
}

/// A client of the worker at the other end of `channel`, presenting `token` as it is at each
/// call.
pub fn shared_client(channel: Channel, token: Option<SharedToken>) -> Client {
    WorkerClient::with_interceptor(channel, Presents(token))
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
    #[error("the cluster token holds no secret; `openssl rand -hex 32` makes one")]
    Empty,
    #[error("the cluster token is not UTF-8 text")]
    NotText,
    /// A line of the token (1 for the first) is no secret; its text is never quoted.
    #[error("line {line} of the cluster token: {fault}")]
    Line { line: usize, fault: SecretFault },
}

/// What is wrong with one secret.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SecretFault {
    #[error(
        "a secret must be at least {MIN_SECRET_CHARS} characters (it has {0}); \
         `openssl rand -hex 32` makes one"
    )]
    TooShort(usize),
    #[error("a secret must be printable ASCII without spaces")]
    NotPrintable,
    #[error("a line starting with # (the file holds secrets, one per line, and no comments)")]
    Comment,
    #[error(
        "the demo secret deploy/k8s publishes: anyone can present it; `openssl rand -hex 32` makes one of your own"
    )]
    Published,
}

/// The demo secret the Kubernetes base ships (`deploy/k8s/base/kustomization.yaml`): public,
/// so never taken — a deployment applied without replacing it would let anyone who can reach a
/// worker call it.
const PUBLISHED: &str = "demo-cluster-token-replace-me-per-deployment";

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
fn bearer(secret: &str) -> Result<MetadataValue<Ascii>, SecretFault> {
    if secret.starts_with('#') {
        return Err(SecretFault::Comment);
    }
    if !secret.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(SecretFault::NotPrintable);
    }
    if secret.len() < MIN_SECRET_CHARS {
        return Err(SecretFault::TooShort(secret.len()));
    }
    if same(secret.as_bytes(), PUBLISHED.as_bytes()) {
        return Err(SecretFault::Published);
    }
    MetadataValue::try_from(format!("Bearer {secret}")).map_err(|_| SecretFault::NotPrintable)
}

/// Whether `a` and `b` are equal, in time that does not depend on where they differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |differ, (x, y)| differ | (x ^ y)) == 0
}

impl ClusterToken {
    /// The secrets in `text`, one per line (blank lines and surrounding whitespace ignored):
    /// the first is presented, all are accepted.
    pub fn parse(text: &str) -> Result<ClusterToken, TokenError> {
        let mut secrets = text
            .lines()
            .map(str::trim)
            .enumerate()
            .filter(|(_, l)| !l.is_empty())
            .map(|(at, secret)| {
                bearer(secret).map_err(|fault| TokenError::Line {
                    line: at + 1,
                    fault,
                })
            });
        let header = secrets.next().ok_or(TokenError::Empty)??;
        let also_accepted = secrets.collect::<Result<_, _>>()?;
        Ok(ClusterToken {
            header,
            also_accepted,
        })
    }

    /// The token in the file at `path`, which other users may not open (see [`secret_file`]).
    pub fn read(path: &Path) -> Result<ClusterToken, TokenError> {
        let bytes = secret_file::read(path)?;
        ClusterToken::parse(std::str::from_utf8(&bytes).map_err(|_| TokenError::NotText)?)
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

/// The cluster token a process holds, shared by its clients and its server: the one in its
/// file, read again by [`SharedToken::follow`].
#[derive(Debug, Clone)]
pub struct SharedToken {
    current: Followed<ClusterToken>,
    file: Option<Arc<Path>>,
}

impl SharedToken {
    /// `token`, never read again.
    pub fn fixed(token: ClusterToken) -> SharedToken {
        SharedToken {
            current: Followed::new(token),
            file: None,
        }
    }

    /// The token in the file at `path` (see [`ClusterToken::read`]), which `follow` reads again.
    pub fn read(path: &Path) -> Result<SharedToken, TokenError> {
        Ok(SharedToken {
            file: Some(Arc::from(path)),
            ..SharedToken::fixed(ClusterToken::read(path)?)
        })
    }

    /// The token as it is now.
    pub fn current(&self) -> Arc<ClusterToken> {
        self.current.current()
    }

    /// Reads the file again every `every`, for as long as it runs (never returns, unless the
    /// token has no file): a changed token is used from the next call on; a file that cannot
    /// be used (missing, exposed, a bad secret: a rotation half written) keeps the token in
    /// use, and says why.
    pub async fn follow(self, every: Duration) {
        if let Some(path) = self.file {
            let reread = |current: &ClusterToken| {
                ClusterToken::read(&path).map(|token| (token != *current).then_some(token))
            };
            self.current
                .follow(every, "the cluster token", reread)
                .await;
        }
    }
}

/// Writes `secrets` to `path` as a token file, readable and writable by its owner only.
pub fn write_file(path: &Path, secrets: &str) -> std::io::Result<()> {
    secret_file::write(path, secrets.as_bytes())
}

/// A client's side: adds the token (when there is one) to every call. Shared: a client is
/// cloned for every call.
#[derive(Debug, Clone, Default)]
pub struct Presents(pub Option<SharedToken>);

impl Interceptor for Presents {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(token) = &self.0 {
            request
                .metadata_mut()
                .insert(HEADER, token.current().header.clone());
        }
        Ok(request)
    }
}

/// A server's side: refuses every call without the token (when there is one).
#[derive(Debug, Clone, Default)]
pub struct Requires(pub Option<SharedToken>);

impl Interceptor for Requires {
    /// Lets in a call that presents the token (any call, without one), and vouches for its
    /// connection ([`Vouching`]).
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let presented = request.metadata().get(HEADER).map(MetadataValue::as_bytes);
        match (&self.0, presented) {
            (Some(token), Some(p)) if !token.current().admits(p) => Err(Status::unauthenticated(
                "the cluster token presented is not this worker's (another deployment's, or \
                 one renewed on one side only)",
            )),
            (Some(_), None) => Err(Status::unauthenticated(
                "this worker answers only calls that present its cluster token",
            )),
            _ => {
                if let Some(connection) = request.extensions().get::<Vouching>() {
                    connection.vouch();
                }
                Ok(request)
            }
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
        let mut requires = Requires(Some(SharedToken::fixed(
            ClusterToken::parse(SECRET).expect("valid"),
        )));
        let refused = |r: Result<Request<()>, Status>| {
            r.err().map(|s| s.code()) == Some(tonic::Code::Unauthenticated)
        };
        let said = |r: Result<Request<()>, Status>| r.err().map(|s| s.message().to_owned());
        assert!(
            said(requires.call(presented(None))).is_some_and(|m| m.contains("present its")),
            "no token: told to present one"
        );
        assert!(
            said(requires.call(presented(Some("Bearer nope"))))
                .is_some_and(|m| m.contains("is not this worker's")),
            "a wrong token: told it is wrong"
        );
        assert!(refused(requires.call(presented(None))));
        assert!(refused(requires.call(presented(Some("Bearer nope")))));
        let one_off = format!("Bearer {}0", &SECRET[..SECRET.len() - 1]);
        assert!(refused(requires.call(presented(Some(&one_off)))));
        assert!(refused(requires.call(presented(Some(SECRET)))), "no scheme");
        let right = format!("Bearer {SECRET}");
        assert!(requires.call(presented(Some(&right))).is_ok());
        // What a client with the token sends is admitted.
        let sent = Presents(Some(SharedToken::fixed(
            ClusterToken::parse(SECRET).expect("valid"),
        )))
        .call(Request::new(()))
        .expect("added");
        assert!(requires.call(sent).is_ok());
        // Without a token, every call is answered (the worker runs unprotected).
        assert!(Requires(None).call(presented(None)).is_ok());
    }

    /// A call let in vouches for its connection (which then keeps its place); a refused one
    /// does not.
    #[test]
    fn only_a_call_let_in_vouches_for_its_connection() {
        let mut requires = Requires(Some(SharedToken::fixed(
            ClusterToken::parse(SECRET).expect("valid"),
        )));
        let on_connection = |value: Option<&str>| {
            let connection = Vouching::default();
            let mut r = presented(value);
            r.extensions_mut().insert(connection.clone());
            (r, connection)
        };
        let (wrong, unvouched) = on_connection(Some("Bearer nope"));
        assert!(requires.call(wrong).is_err());
        assert!(!unvouched.vouched());
        let right = format!("Bearer {SECRET}");
        let (call, vouched) = on_connection(Some(&right));
        assert!(requires.call(call).is_ok());
        assert!(vouched.vouched());
        let (call, open) = on_connection(None);
        assert!(Requires(None).call(call).is_ok());
        assert!(
            open.vouched(),
            "a worker without a token lets every call in"
        );
    }

    #[test]
    fn a_second_secret_is_accepted_and_never_presented_so_a_rotation_refuses_no_call() {
        let old = "0123456789abcdef0123456789abcdef";
        let new = "fedcba9876543210fedcba9876543210";
        let both = ClusterToken::parse(&format!("{old}\n\n{new}\n")).expect("two secrets");
        let bearer = |s: &str| Some(format!("Bearer {s}"));
        let mut requires = Requires(Some(SharedToken::fixed(both.clone())));
        for secret in [old, new] {
            let call = presented(bearer(secret).as_deref());
            assert!(requires.call(call).is_ok(), "{secret} accepted");
        }
        let other = "00000000000000000000000000000000";
        assert!(requires.call(presented(bearer(other).as_deref())).is_err());
        // The first line is the one presented.
        let sent = Presents(Some(SharedToken::fixed(both)))
            .call(Request::new(()))
            .expect("added");
        assert_eq!(
            sent.metadata().get(HEADER).and_then(|v| v.to_str().ok()),
            bearer(old).as_deref()
        );
        // The Kubernetes base's demo secret is public: refused, on any line.
        assert!(matches!(
            ClusterToken::parse(&format!("{old}\n{PUBLISHED}")),
            Err(TokenError::Line {
                line: 2,
                fault: SecretFault::Published
            })
        ));
        // A bad second line is refused like a bad first one, by its line.
        assert!(matches!(
            ClusterToken::parse(&format!("{old}\n\nshort")),
            Err(TokenError::Line {
                line: 3,
                fault: SecretFault::TooShort(5)
            })
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

    /// A rotation without a restart: the file gains the new secret (both accepted, the old
    /// one presented), the secrets swap lines (the new one presented), the old one goes (and
    /// is refused); a file half written meanwhile keeps the token in use.
    #[tokio::test]
    async fn a_token_follows_its_file_so_a_rotation_needs_no_restart() {
        let dir = std::env::temp_dir().join(format!("bulkhead-token-{}", rand::random::<u64>()));
        std::fs::create_dir_all(&dir).expect("a directory");
        let file = dir.join("token");
        let (old, new) = (SECRET, "fedcba9876543210fedcba9876543210");
        write_file(&file, old).expect("writes");
        let token = SharedToken::read(&file).expect("reads");
        let follower = tokio::spawn(token.clone().follow(Duration::from_millis(20)));
        let mut requires = Requires(Some(token.clone()));
        let mut admits = |secret: &str| {
            requires
                .call(presented(Some(&format!("Bearer {secret}"))))
                .is_ok()
        };
        let presents = |token: &SharedToken| {
            let sent = Presents(Some(token.clone()))
                .call(Request::new(()))
                .expect("added");
            sent.metadata()
                .get(HEADER)
                .and_then(|v| v.to_str().ok().map(str::to_owned))
        };
        // Waits (bounded) until the token in use is `want`'s.
        let reloaded = |want: &str| {
            let want = ClusterToken::parse(want).expect("valid");
            let token = token.clone();
            async move {
                for _ in 0..250 {
                    if *token.current() == want {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                panic!("never reloaded");
            }
        };
        assert!(admits(old) && !admits(new));

        write_file(&file, &format!("{old}\n{new}")).expect("writes");
        reloaded(&format!("{old}\n{new}")).await;
        assert!(admits(old) && admits(new));
        assert_eq!(presents(&token), Some(format!("Bearer {old}")));

        write_file(&file, "short").expect("writes");
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            admits(old) && admits(new),
            "a bad file keeps the token in use"
        );

        write_file(&file, &format!("{new}\n{old}")).expect("writes");
        reloaded(&format!("{new}\n{old}")).await;
        assert_eq!(presents(&token), Some(format!("Bearer {new}")));

        write_file(&file, new).expect("writes");
        reloaded(new).await;
        assert!(admits(new) && !admits(old));
        follower.abort();
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_token_is_long_printable_and_never_shown() {
        let refused = |text: &str| ClusterToken::parse(text).expect_err(text).to_string();
        assert_eq!(
            refused("short"),
            "line 1 of the cluster token: a secret must be at least 32 characters (it has 5); \
             `openssl rand -hex 32` makes one"
        );
        let spaced = refused(&format!("{SECRET} {SECRET}"));
        assert!(spaced.starts_with("line 1 of the cluster token: a secret must be printable"));
        assert!(!spaced.contains(SECRET), "{spaced}");
        // A comment is refused by its line, never taken for a secret.
        let commented = refused(&format!("# rotated on Monday, the new one first\n{SECRET}"));
        assert_eq!(
            commented,
            "line 1 of the cluster token: a line starting with # (the file holds secrets, one \
             per line, and no comments)"
        );
        assert!(refused(&format!("{SECRET}\n#{SECRET}")).contains("line 2"));
        assert!(matches!(
            ClusterToken::parse(" \n\n"),
            Err(TokenError::Empty)
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
