//! `bulkhead`: the command-line front door.

mod audit;
mod bench;
mod child;
mod data_dir;
mod gateway;
mod generate;
mod model_path;
mod runtime;
mod signals;
mod switches;
mod telemetry;
mod tls_args;
mod up;
mod worker;

use bulkhead_worker::chat::sandbox;
use clap::{Parser, Subcommand};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
    Worker(Box<worker::Args>),
    /// Serve the OpenAI-compatible gateway in front of the configured workers.
    Gateway(gateway::Args),
    /// Check the workers a gateway configuration lists before traffic: pools against served
    /// contexts, prefill/decode agreement, integrity settings. Exits non-zero on any failure.
    Preflight(gateway::PreflightArgs),
    /// Start the workers and the gateway on loopback with the default configuration.
    Up(up::Args),
    /// Audit log tools.
    Audit {
        #[command(subcommand)]
        what: audit::What,
    },
    /// Print the SHA-256 digest of each key read from stdin (one per line), for configs.
    HashKey,
    /// Compile the CUDA kernels with NVRTC into a PTX file, for GPU machines without NVRTC
    /// (pass it there with --cuda-ptx; scripts/gpu-bundle does this).
    CudaPtx {
        /// Where to write the PTX.
        #[arg(long)]
        out: std::path::PathBuf,
    },
    /// The chat template sandbox's helper: the serving processes start it, not an operator
    /// (bulkhead_worker::chat::sandbox).
    #[command(name = "template-sandbox", hide = true)]
    TemplateSandbox {
        /// The memory it may take past what it holds when it starts.
        #[arg(long = "memory-bytes")]
        memory_bytes: u64,
    },
}

fn main() -> std::process::ExitCode {
    match run(Cli::parse().command) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // The error and its causes, never a backtrace (even with RUST_BACKTRACE set): a
            // refused input or a failed check is an answer, not a crash. Panics keep theirs.
            eprintln!("Error: {e}");
            let causes = causes_not_said(&e);
            if !causes.is_empty() {
                eprintln!("\nCaused by:");
                for cause in causes {
                    eprintln!("    {cause}");
                }
            }
            std::process::ExitCode::FAILURE
        }
    }
}

/// The causes of `e` that the link before each does not already say.
fn causes_not_said(e: &anyhow::Error) -> Vec<String> {
    let links = bulkhead_worker::error_chain::unsaid(e.chain().map(ToString::to_string));
    links.into_iter().skip(1).collect()
}

fn run(command: Command) -> anyhow::Result<()> {
    // Chat templates come from model files and workers' Info: rendered in a helper process
    // whose memory is bounded (this binary, as `template-sandbox`), never in this one.
    // `/proc/self/exe`: the running binary, even after its file was replaced (an upgrade, a
    // rebuild) — its path would then start another version, or nothing.
    if !matches!(command, Command::TemplateSandbox { .. }) {
        let exe = std::path::PathBuf::from("/proc/self/exe");
        sandbox::install(sandbox::Sandbox::new(exe, sandbox::MEMORY));
    }
    // A server holds a descriptor per connection (the gateway's clients and upstreams, a
    // worker's gRPC and KV connections): a soft limit of 1024, common by default, runs out
    // long before their own bounds do. Its children (`up`'s workers) inherit the raise.
    if matches!(
        command,
        Command::Worker(_) | Command::Gateway(_) | Command::Up(_) | Command::Bench { .. }
    ) {
        bulkhead_gateway::descriptors::raise_limit();
    }
    // The servers install their own telemetry (they export spans when configured to) and log
    // their startup facts (measured pool, served context) by default; the rest only warn.
    let _log = match command {
        Command::Worker(_)
        | Command::Gateway(_)
        | Command::Up(_)
        | Command::TemplateSandbox { .. } => None,
        Command::Generate(_)
        | Command::Bench { .. }
        | Command::Audit { .. }
        | Command::HashKey
        | Command::CudaPtx { .. }
        | Command::Preflight(_) => Some(telemetry::install("warn", None)?),
    };
    match command {
        Command::Generate(args) => generate::run(args),
        Command::Bench { what } => bench::run(what),
        Command::Worker(args) => worker::run(*args),
        Command::Gateway(args) => gateway::run(args),
        Command::Up(args) => up::run(args),
        Command::Preflight(args) => gateway::preflight(args),
        Command::Audit { what } => audit::run(what),
        Command::HashKey => gateway::hash_key(),
        Command::CudaPtx { out } => cuda_ptx(&out),
        Command::TemplateSandbox { memory_bytes } => Ok(sandbox::serve(memory_bytes)?),
    }
}

fn cuda_ptx(out: &std::path::Path) -> anyhow::Result<()> {
    use anyhow::Context;
    let ptx = bulkhead_kernels::cuda::compile_ptx()?;
    std::fs::write(out, bulkhead_kernels::cuda::ptx_file_contents(&ptx))
        .with_context(|| format!("writing {}", out.display()))?;
    eprintln!("wrote the CUDA kernels to {}", out.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory as _;

    /// Every subcommand's flags are distinct (clap checks this only when the subcommand runs).
    #[test]
    fn the_command_line_is_well_formed() {
        super::Cli::command().debug_assert();
    }

    /// The chat template sandbox starts its helpers with the names its library gives.
    #[test]
    fn the_sandbox_helper_parses_as_the_library_starts_it() {
        use bulkhead_worker::chat::sandbox::{MEMORY_FLAG, SUBCOMMAND};
        use clap::Parser as _;
        let cli =
            super::Cli::try_parse_from(["bulkhead", SUBCOMMAND, MEMORY_FLAG, "5"]).expect("parses");
        assert!(matches!(
            cli.command,
            super::Command::TemplateSandbox { memory_bytes: 5 }
        ));
    }

    /// An error that names its source in its own message (`cannot read f.toml: {source}`).
    #[derive(Debug)]
    struct Read(std::io::Error);

    impl std::fmt::Display for Read {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "cannot read f.toml: {}", self.0)
        }
    }

    impl std::error::Error for Read {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn a_cause_its_error_already_names_is_printed_once() {
        let missing = || std::io::Error::new(std::io::ErrorKind::NotFound, "No such file");
        let e = anyhow::Error::new(Read(missing())).context("invalid configuration");
        assert_eq!(
            super::causes_not_said(&e),
            ["cannot read f.toml: No such file"]
        );
        let e = anyhow::Error::new(missing()).context("invalid configuration");
        assert_eq!(super::causes_not_said(&e), ["No such file"]);
    }
}
