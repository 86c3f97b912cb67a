//! The async runtimes the commands run on, and `--serving-threads`, the gateway's (shared by
//! `bulkhead gateway` and `bulkhead up`).

use std::num::NonZeroUsize;

use anyhow::Context;

/// The environment variable of `--serving-threads`.
pub const THREADS_ENV: &str = "BULKHEAD_SERVING_THREADS";

#[derive(Debug, Clone, Copy, clap::Args)]
pub struct Threads {
    /// Threads serving the gateway's API connections, each a single-threaded runtime that
    /// runs its connections' requests start to end [default: one per CPU this process may run
    /// on]
    #[arg(long = "serving-threads", env = THREADS_ENV, value_name = "N")]
    serving_threads: Option<NonZeroUsize>,
}

impl Threads {
    /// The count given, or one per available CPU.
    pub fn count(self) -> NonZeroUsize {
        self.serving_threads.unwrap_or_else(per_cpu)
    }
}

/// One thread per CPU this process may run on.
pub fn per_cpu() -> NonZeroUsize {
    std::thread::available_parallelism().unwrap_or(NonZeroUsize::MIN)
}

/// The runtime a command's main work runs on: single-threaded (the gateway adds its serving
/// threads itself).
pub fn main() -> anyhow::Result<tokio::runtime::Runtime> {
    build(NonZeroUsize::MIN, "bulkhead")
}

/// A runtime of `threads` threads named `name`: with one, a current-thread runtime (every task
/// on the calling thread), else a work-stealing one.
pub fn build(threads: NonZeroUsize, name: &str) -> anyhow::Result<tokio::runtime::Runtime> {
    let mut builder = if threads == NonZeroUsize::MIN {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(threads.get());
        b
    };
    builder
        .thread_name(name)
        .enable_all()
        .build()
        .context("starting the async runtime")
}
