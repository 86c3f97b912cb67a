//! The load generator: N HTTP/1.1 keep-alive connections, each with at most one request in
//! flight. Closed loop: each connection sends its next request as soon as it has read the
//! previous answer whole. Paced: each sends on a schedule of its own (the connections' together
//! spread evenly over time, at a total rate), or at once when its answer came after its next
//! send was due. Every answer that completes inside the measured window (after the warm-up) is
//! counted and its latency, from sending the request to the answer's last byte, recorded.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use bytes::Bytes;
use http::header::{AUTHORIZATION, CONTENT_TYPE, HOST};
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Empty, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls::pki_types::ServerName;

use super::cpu::ProcessTree;
use super::load_target::ANSWER;

/// Pause before reconnecting after a failed connection, so a dead target is not spun on.
const RECONNECT_PAUSE: Duration = Duration::from_millis(20);
/// How far behind its schedule a paced connection may fall and still make the sends up.
const MAX_BACKLOG: Duration = Duration::from_millis(20);
/// The least CPU time metered that makes a figure: `/proc` counts in ticks of 10 ms, so less
/// than ten of them is more rounding than measurement.
const MIN_METERED_CPU: Duration = Duration::from_millis(100);

/// The request every connection sends, and how its answer is checked.
#[derive(Debug, Clone)]
pub struct Ask {
    pub path: &'static str,
    pub bearer: Option<String>,
    pub body: Bytes,
    /// The answer is an SSE stream (it must end with `data: [DONE]`); otherwise one JSON
    /// object carrying the load target's answer.
    pub stream: bool,
}

impl Ask {
    /// A chat completion of `model`, streamed or not.
    pub fn chat(model: &str, bearer: Option<String>, stream: bool) -> Ask {
        let mut body = serde_json::json!({
            "model": model,
            "messages": [{"role": "user", "content": "What is 2+2?"}],
            "max_tokens": 16,
        });
        if stream {
            body["stream"] = true.into();
        }
        Ask {
            path: "/v1/chat/completions",
            bearer,
            body: Bytes::from(body.to_string()),
            stream,
        }
    }

    fn request(&self, addr: SocketAddr) -> anyhow::Result<Request<Full<Bytes>>> {
        let mut r = Request::builder()
            .method(Method::POST)
            .uri(self.path)
            .header(HOST, addr.to_string())
            .header(CONTENT_TYPE, "application/json");
        if let Some(key) = &self.bearer {
            r = r.header(AUTHORIZATION, format!("Bearer {key}"));
        }
        r.body(Full::new(self.body.clone()))
            .context("building the request")
    }

    /// Whether `body`, answered with `status`, is the answer the load target gives.
    fn accepts(&self, status: StatusCode, body: &[u8]) -> bool {
        if status != StatusCode::OK {
            return false;
        }
        let text = String::from_utf8_lossy(body);
        if self.stream {
            text.trim_end().ends_with("data: [DONE]")
        } else {
            text.contains(ANSWER)
        }
    }
}

/// Where the load connects: an address, over TLS when there is a connector (the server's
/// certificate must name the address's IP).
#[derive(Clone)]
pub struct Dial {
    pub addr: SocketAddr,
    pub tls: Option<TlsConnector>,
}

impl std::fmt::Debug for Dial {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}{}",
            self.addr,
            if self.tls.is_some() { " (TLS)" } else { "" }
        )
    }
}

/// One load: `connections` connections to `dial`, a warm-up, then the measured window.
#[derive(Debug, Clone)]
pub struct Load {
    pub dial: Dial,
    pub ask: Arc<Ask>,
    pub connections: usize,
    pub warmup: Duration,
    pub window: Duration,
    /// Paced: the time between two sends of one connection (`None`: closed loop).
    pub pace: Option<Duration>,
    /// The processes serving `addr`, whose CPU time over the window is metered.
    pub meter: Option<ProcessTree>,
}

/// What one load measured.
#[derive(Debug, Clone, Default)]
pub struct Sample {
    /// Latencies of the answers completed inside the window, sorted.
    pub latencies: Vec<Duration>,
    /// Wrong answers and failed exchanges inside the window.
    pub errors: u64,
    /// The first failure seen, for the report.
    pub first_error: Option<String>,
    /// The window's length.
    pub window: Duration,
    /// CPU time the metered processes used over the window.
    pub cpu: Option<Duration>,
}

impl Sample {
    /// Correct answers per second over the window.
    pub fn rps(&self) -> f64 {
        self.latencies.len() as f64 / self.window.as_secs_f64()
    }

    /// CPU microseconds the metered processes spent per correct answer.
    pub fn cpu_us_per_request(&self) -> Option<f64> {
        let (cpu, answers) = (self.cpu?, self.latencies.len());
        (answers > 0 && cpu >= MIN_METERED_CPU).then(|| cpu.as_secs_f64() * 1e6 / answers as f64)
    }

    /// Microseconds at quantile `q` (nearest rank); `None` without answers.
    pub fn quantile_us(&self, q: f64) -> Option<f64> {
        super::super::nearest_rank_us(&self.latencies, q)
    }
}

/// Runs `load` and returns what it measured.
pub async fn drive(load: &Load) -> Sample {
    let start = Instant::now() + load.warmup;
    let end = start + load.window;
    let tasks: Vec<_> = (0..load.connections)
        .map(|i| {
            // Paced connections start a share of the pace apart, so their sends interleave.
            let schedule = load.pace.map(|pace| Schedule {
                next: Instant::now() + pace.mul_f64(i as f64 / load.connections as f64),
                pace,
            });
            tokio::spawn(connection(
                load.dial.clone(),
                load.ask.clone(),
                schedule,
                start,
                end,
            ))
        })
        .collect();
    let cpu = match load.meter {
        Some(tree) => {
            tokio::time::sleep_until(start).await;
            let before = tree.cpu();
            tokio::time::sleep_until(end).await;
            before.zip(tree.cpu()).map(|(b, a)| a.saturating_sub(b))
        }
        None => None,
    };
    let mut sample = Sample {
        window: load.window,
        cpu,
        ..Sample::default()
    };
    for task in tasks {
        match task.await {
            Ok(part) => {
                sample.latencies.extend(part.latencies);
                sample.errors += part.errors;
                if sample.first_error.is_none() {
                    sample.first_error = part.first_error;
                }
            }
            Err(e) => {
                sample.errors += 1;
                sample
                    .first_error
                    .get_or_insert(format!("a load task failed: {e}"));
            }
        }
    }
    sample.latencies.sort_unstable();
    sample
}

/// When a paced connection sends next, and the time between its sends.
#[derive(Debug, Clone, Copy)]
struct Schedule {
    next: Instant,
    pace: Duration,
}

impl Schedule {
    /// Waits until the next send is due (not at all when it is overdue) and sets the one after
    /// a pace later on a fixed grid: a send the timer woke late for (its resolution is a
    /// millisecond, coarser than the pace of a high rate) is made up by the next ones going
    /// at once, so the rate offered is the rate asked for, up to what the target answers.
    /// A connection further behind (a target that stalled) is forgiven all but
    /// [`MAX_BACKLOG`] of it, not made to flood the target when it comes back.
    /// Returns when the send was due: its latency counts from then, so that a target that
    /// answers late delays the sends behind it and is charged for their wait too, as it
    /// would be by clients sending at this rate (not only for the time each took once sent).
    async fn wait(&mut self) -> Instant {
        let due = self.next;
        tokio::time::sleep_until(due).await;
        let now = Instant::now();
        let floor = now.checked_sub(MAX_BACKLOG.max(self.pace)).unwrap_or(now);
        self.next = (self.next + self.pace).max(floor);
        due
    }
}

/// One connection's loop until `end`, closed or paced by `schedule`; what completes from
/// `start` on counts.
async fn connection(
    dial: Dial,
    ask: Arc<Ask>,
    mut schedule: Option<Schedule>,
    start: Instant,
    end: Instant,
) -> Sample {
    let mut out = Sample::default();
    let fail = |out: &mut Sample, at: Instant, what: String| {
        if at >= start {
            out.errors += 1;
            out.first_error.get_or_insert(what);
        }
    };
    let addr = dial.addr;
    let mut sender: Option<SendRequest<Full<Bytes>>> = None;
    while Instant::now() < end {
        let due = match &mut schedule {
            Some(schedule) => Some(schedule.wait().await),
            None => None,
        };
        let s = match sender.take().filter(|s| !s.is_closed()) {
            Some(s) => s,
            None => match tokio::time::timeout_at(end, connect(&dial)).await {
                Err(_) => break,
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    fail(
                        &mut out,
                        Instant::now(),
                        format!("connecting to {addr}: {e:#}"),
                    );
                    tokio::time::sleep(RECONNECT_PAUSE).await;
                    continue;
                }
            },
        };
        let mut s = s;
        let t0 = due.unwrap_or_else(Instant::now);
        let exchanged = tokio::time::timeout_at(end, exchange(&mut s, &ask, addr)).await;
        let done = Instant::now();
        match exchanged {
            // The window closed mid-request: it is neither counted nor a failure.
            Err(_) => break,
            Ok(Ok((status, body))) => {
                if ask.accepts(status, &body) {
                    if done >= start {
                        out.latencies.push(done - t0);
                    }
                } else {
                    let text = String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned();
                    fail(&mut out, done, format!("answered {status}: {text}"));
                }
                sender = Some(s);
            }
            Ok(Err(e)) => {
                fail(&mut out, done, format!("exchange with {addr}: {e:#}"));
                tokio::time::sleep(RECONNECT_PAUSE).await;
            }
        }
    }
    out
}

async fn connect<B>(dial: &Dial) -> anyhow::Result<SendRequest<B>>
where
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let stream = TcpStream::connect(dial.addr).await?;
    stream.set_nodelay(true)?;
    match &dial.tls {
        None => http1(stream).await,
        Some(connector) => {
            let name = ServerName::IpAddress(dial.addr.ip().into());
            http1(connector.connect(name, stream).await?).await
        }
    }
}

/// HTTP/1.1 over `io`, its connection driven by a task of its own.
async fn http1<B, IO>(io: IO) -> anyhow::Result<SendRequest<B>>
where
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await?;
    tokio::spawn(async move {
        // Ends when the connection closes, whichever side closes it.
        let _ = conn.await;
    });
    Ok(sender)
}

async fn exchange(
    sender: &mut SendRequest<Full<Bytes>>,
    ask: &Ask,
    addr: SocketAddr,
) -> anyhow::Result<(StatusCode, Bytes)> {
    sender.ready().await?;
    let response = sender.send_request(ask.request(addr)?).await?;
    let status = response.status();
    let body = response.into_body().collect().await?.to_bytes();
    Ok((status, body))
}

/// Sends `ask` once on a fresh connection and checks the answer: a target is probed this way
/// before it is measured.
pub async fn probe(dial: &Dial, ask: &Ask) -> anyhow::Result<()> {
    let mut sender = connect(dial).await?;
    let (status, body) = exchange(&mut sender, ask, dial.addr).await?;
    if !ask.accepts(status, &body) {
        let text = String::from_utf8_lossy(&body[..body.len().min(500)]).into_owned();
        bail!("answered {status}, not the load target's answer: {text}");
    }
    Ok(())
}

/// `GET path` on a fresh connection, with a bearer token if given: the status and the body.
pub async fn get(
    dial: &Dial,
    path: &str,
    bearer: Option<&str>,
) -> anyhow::Result<(StatusCode, Bytes)> {
    let mut sender = connect::<Empty<Bytes>>(dial).await?;
    let mut r = Request::builder()
        .method(Method::GET)
        .uri(path)
        .header(HOST, dial.addr.to_string());
    if let Some(key) = bearer {
        r = r.header(AUTHORIZATION, format!("Bearer {key}"));
    }
    let response = sender.send_request(r.body(Empty::new())?).await?;
    let status = response.status();
    Ok((status, response.into_body().collect().await?.to_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sends of a connection paced at `pace` within `span`, each request taking `busy`.
    async fn paced_sends(pace: Duration, busy: Duration, span: Duration) -> usize {
        let start = Instant::now();
        let mut schedule = Schedule { next: start, pace };
        let mut sends = 0;
        while Instant::now() < start + span {
            schedule.wait().await;
            sends += 1;
            tokio::time::advance(busy).await;
        }
        sends
    }

    #[tokio::test(start_paused = true)]
    async fn a_paced_connection_sends_at_its_rate_though_its_timer_wakes_late() {
        // A pace finer than the timer's millisecond: every wake is late, and the sends it owes
        // go at once after it.
        let sends = paced_sends(
            Duration::from_micros(1500),
            Duration::from_micros(300),
            Duration::from_millis(300),
        )
        .await;
        assert!((199..=201).contains(&sends), "{sends} sends, 200 asked");
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_far_behind_is_not_made_to_flood_the_target() {
        let start = Instant::now();
        let pace = Duration::from_millis(1);
        let mut schedule = Schedule { next: start, pace };
        schedule.wait().await;
        // The target stalls for a second: of the 1 000 sends owed, the one it was making, the
        // backlog's 20 ms and the one due now go at once.
        tokio::time::advance(Duration::from_secs(1)).await;
        let resumed = Instant::now();
        let mut at_once = 0;
        loop {
            schedule.wait().await;
            if Instant::now() > resumed {
                break;
            }
            at_once += 1;
        }
        assert_eq!(at_once, 22);
    }

    #[test]
    fn quantiles_are_nearest_rank_and_absent_without_answers() {
        let sample = Sample {
            latencies: (1..=100).map(Duration::from_micros).collect(),
            window: Duration::from_secs(2),
            ..Sample::default()
        };
        assert_eq!(sample.quantile_us(0.5), Some(50.0));
        assert_eq!(sample.quantile_us(0.99), Some(99.0));
        assert_eq!(sample.quantile_us(1.0), Some(100.0));
        assert_eq!(sample.rps(), 50.0);
        assert_eq!(Sample::default().quantile_us(0.5), None);
    }

    #[test]
    fn only_the_load_targets_answer_is_accepted() {
        let plain = Ask::chat("m", None, false);
        let body = format!(r#"{{"choices":[{{"message":{{"content":"{ANSWER}"}}}}]}}"#);
        assert!(plain.accepts(StatusCode::OK, body.as_bytes()));
        assert!(!plain.accepts(StatusCode::TOO_MANY_REQUESTS, body.as_bytes()));
        assert!(!plain.accepts(StatusCode::OK, b"{}"));
        let stream = Ask::chat("m", None, true);
        assert!(stream.accepts(StatusCode::OK, b"data: {}\n\ndata: [DONE]\n\n"));
        assert!(!stream.accepts(StatusCode::OK, b"data: {}\n\n"));
    }
}
