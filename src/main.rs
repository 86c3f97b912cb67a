//! `bulkhead`: the command-line front door.

mod bench;
mod generate;
mod model_path;
mod worker;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "bulkhead",
    version,
    about = "Multi-tenant LLM serving with provable KV-cache isolation"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Generate a completion for one prompt and print it on stdout.
    Generate(generate::Args),
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        what: bench::What,
    },
    /// Serve the model over gRPC (bulkhead.worker.v1), with /metrics on an admin port.
    Worker(worker::Args),
}

fn main() -> anyhow::Result<()> {
    let command = Cli::parse().command;
    // Servers log their startup facts (measured pool, served context) by default.
    let default_level = match command {
        Command::Worker(_) => "info",
        Command::Generate(_) | Command::Bench { .. } => "warn",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("BULKHEAD_LOG")
                .unwrap_or_else(|_| default_level.into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match command {
        Command::Generate(args) => generate::run(args),
        Command::Bench { what } => bench::run(what),
        Command::Worker(args) => worker::run(args),
    }
}
