//! A deadline on a connection's writes: a client that accepts no byte of its response for
//! [`crate::config::HttpLimits::write_stall_timeout`] is disconnected.
//!
//! A client that stops reading a stream (and keeps its socket open) fills the kernel's
//! buffers; hyper then stops asking the response body for more, so the request would stay
//! under way for as long as the socket stays open, holding its tenant's concurrency slot,
//! its route's outstanding tokens and, behind them, the worker's flow-controlled stream. The
//! read side has hyper's header timeout (slowloris) and the request timeout; this is the
//! write side's. A write that fails ends the connection, hyper drops the response body, and
//! the request ends as a client disconnect (its policy directive, its audit record).
//!
//! The clock runs only while a write waits: a slow reader that takes a byte now and then
//! keeps its connection, and a connection idle between requests writes nothing.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// `io` whose writes fail once one has waited `limit` without the peer taking a byte.
pub struct WriteDeadline<IO> {
    io: IO,
    limit: Duration,
    /// The deadline of the write now waiting; made at the connection's first wait, reset at
    /// each later one.
    deadline: Option<Pin<Box<Sleep>>>,
    /// Whether a write is waiting now (the deadline runs).
    waiting: bool,
}

impl<IO> WriteDeadline<IO> {
    pub fn new(io: IO, limit: Duration) -> WriteDeadline<IO> {
        WriteDeadline {
            io,
            limit,
            deadline: None,
            waiting: false,
        }
    }

    /// Called with what a write returned: progress stops the clock; a wait starts it (if it
    /// is not running) and fails once it has run `limit`.
    fn after<T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if polled.is_ready() {
            self.waiting = false;
            return polled;
        }
        let deadline = Instant::now() + self.limit;
        let sleep = match (&mut self.deadline, self.waiting) {
            (Some(sleep), true) => sleep,
            (Some(sleep), false) => {
                sleep.as_mut().reset(deadline);
                sleep
            }
            (slot @ None, _) => slot.insert(Box::pin(tokio::time::sleep_until(deadline))),
        };
        self.waiting = true;
        match sleep.as_mut().poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "the client took no byte of the response for {} s",
                    self.limit.as_secs_f64()
                ),
            ))),
        }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for WriteDeadline<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for WriteDeadline<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_write(cx, buf);
        this.after(cx, polled)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        this.after(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_flush(cx);
        this.after(cx, polled)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_shutdown(cx);
        this.after(cx, polled)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    const LIMIT: Duration = Duration::from_secs(5);

    /// Writes `chunk` until a write waits (the pipe is full); returns how much went.
    async fn fill(w: &mut WriteDeadline<tokio::io::DuplexStream>, chunk: &[u8]) -> usize {
        let mut sent = 0;
        while let Ok(Ok(n)) = tokio::time::timeout(Duration::from_millis(1), w.write(chunk)).await {
            sent += n;
        }
        sent
    }

    #[tokio::test(start_paused = true)]
    async fn a_write_the_peer_takes_nothing_of_for_the_limit_fails() {
        let (near, _far) = tokio::io::duplex(64);
        let mut w = WriteDeadline::new(near, LIMIT);
        assert_eq!(
            fill(&mut w, &[7; 16]).await,
            64,
            "the pipe took its 64 bytes"
        );
        let started = Instant::now();
        let e = w
            .write(&[7; 16])
            .await
            .expect_err("the stalled write fails");
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(
            started.elapsed() > LIMIT - Duration::from_secs(1) && started.elapsed() <= LIMIT,
            "at the deadline: {:?}",
            started.elapsed()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_reader_that_takes_a_byte_within_each_limit_keeps_its_connection() {
        let (near, mut far) = tokio::io::duplex(64);
        let mut w = WriteDeadline::new(near, LIMIT);
        let reader = tokio::spawn(async move {
            let mut taken = 0;
            let mut byte = [0; 1];
            while far.read_exact(&mut byte).await.is_ok() {
                taken += 1;
                tokio::time::sleep(LIMIT - Duration::from_secs(1)).await;
            }
            taken
        });
        // Past the pipe's 64 bytes every write waits on the reader, 64 times the limit in all:
        // none fails.
        for _ in 0..128 {
            w.write_all(&[7]).await.expect("each byte is taken in time");
        }
        drop(w);
        assert_eq!(reader.await.expect("reader"), 128);
    }

    #[tokio::test(start_paused = true)]
    async fn the_clock_restarts_at_each_wait_not_at_the_connections_first() {
        let (near, mut far) = tokio::io::duplex(64);
        let mut w = WriteDeadline::new(near, LIMIT);
        fill(&mut w, &[7; 16]).await;
        // A wait that ends before the deadline: the reader drains the pipe.
        tokio::time::sleep(LIMIT - Duration::from_secs(1)).await;
        let mut drained = [0; 64];
        far.read_exact(&mut drained).await.expect("drains");
        w.write_all(&[7; 16]).await.expect("progress");
        // A second full wait of nearly the limit, past the first wait's deadline: no failure.
        fill(&mut w, &[7; 16]).await;
        let reader = tokio::spawn(async move {
            tokio::time::sleep(LIMIT - Duration::from_secs(1)).await;
            far.read_exact(&mut drained).await.expect("drains again");
            far
        });
        w.write_all(&[7; 16])
            .await
            .expect("the second wait ran its own clock");
        drop(reader.await.expect("reader"));
    }
}
