//! `bulkhead`: the command-line front door.

mod bench;
mod generate;
mod model_path;

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
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("BULKHEAD_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Generate(args) => generate::run(args),
        Command::Bench { what } => bench::run(what),
    }
}
