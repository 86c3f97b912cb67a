//! Where the default model lives, and the thread pool every command sets up the same way.

use std::path::PathBuf;

use anyhow::Context;

/// Environment variable naming the model file.
pub const MODEL_ENV: &str = "BULKHEAD_MODEL";
/// Environment variable naming the directory `scripts/fetch-model` caches models in.
pub const MODEL_DIR_ENV: &str = "BULKHEAD_MODEL_DIR";
/// The default model's file name inside that directory.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Model selection shared by the commands.
#[derive(Debug, clap::Args)]
pub struct ModelArgs {
    /// GGUF model file [default: the model fetched by scripts/fetch-model]
    #[arg(long, env = MODEL_ENV)]
    pub model: Option<PathBuf>,
    /// Compute threads [default: the machine's cores]
    #[arg(long)]
    pub threads: Option<usize>,
}

impl ModelArgs {
    /// The model path, after checking that the file exists.
    pub fn path(&self) -> anyhow::Result<PathBuf> {
        let path = match &self.model {
            Some(p) => p.clone(),
            None => {
                let dir = match std::env::var_os(MODEL_DIR_ENV) {
                    Some(d) => PathBuf::from(d),
                    None => PathBuf::from(std::env::var_os("HOME").context("HOME is not set")?)
                        .join(".cache/bulkhead/models"),
                };
                dir.join(DEFAULT_MODEL_FILE)
            }
        };
        anyhow::ensure!(
            path.is_file(),
            "model file {} not found; run scripts/fetch-model or pass --model",
            path.display()
        );
        Ok(path)
    }

    /// Sizes the global compute pool; returns the thread count.
    pub fn init_threads(&self) -> anyhow::Result<usize> {
        let n = self
            .threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        anyhow::ensure!(n > 0, "--threads must be at least 1");
        bulkhead_kernels::pool::init(n);
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .context("starting the compute threads")?;
        Ok(n)
    }
}
