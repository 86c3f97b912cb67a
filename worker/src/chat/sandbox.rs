//! Chat templates rendered in a child process whose memory is bounded.
//!
//! A chat template is a program, from a model file — or, for the gateway, from a worker's Info.
//! minijinja's fuel bounds how long it runs and [`RENDERED_MAX`](super::RENDERED_MAX) how much
//! it writes, but nothing within a process bounds the memory its values take: `{% set b = a ~ a
//! %}` doubles a string in one instruction, a few such lines ask for more than the machine
//! has, and an allocation that fails aborts the process — the gateway serving every tenant, or
//! a worker with its requests under way. So a serving process installs a [`Sandbox`]: a helper
//! process of the same binary (`bulkhead template-sandbox`), its address space limited
//! (`RLIMIT_AS`), no environment, in a process group of its own, that renders one job at a
//! time from its stdin. A template that exhausts it ends the helper alone: the rendering fails
//! with an error that says so, and the next one starts a fresh helper. A rendering also has a
//! deadline ([`TIME`]), which fuel alone is not: one instruction may copy a hundred megabytes.

use std::borrow::Cow;
use std::io::{self, BufRead, BufReader, Write};
use std::os::fd::AsRawFd as _;
use std::os::unix::process::CommandExt as _;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use minijinja::Environment;
use serde::{Deserialize, Serialize};

use super::{ChatError, Message, RENDERED_MAX, environment};

/// The subcommand of the binary that serves as the helper.
pub const SUBCOMMAND: &str = "template-sandbox";

/// The flag that gives the helper its memory (bytes past what it holds when it starts).
pub const MEMORY_FLAG: &str = "--memory-bytes";

/// The memory a helper may take past what it holds when it starts. Real templates render a
/// conversation's frame in a few kilobytes.
pub const MEMORY: u64 = 256 << 20;

/// How long a rendering may take before its helper is stopped. Real templates take
/// microseconds.
pub const TIME: Duration = Duration::from_secs(5);

/// The longest answer line read from a helper: a rendering at its bound, every byte of it
/// escaped by JSON (`\u0000`), and the line's frame.
const ANSWER_MAX: u64 = 6 * RENDERED_MAX as u64 + 64;

/// Compiled templates a helper keeps (one per template it was asked to render, the oldest
/// dropped first).
const KEPT: usize = 4;

/// One rendering: a template, its BOS and EOS texts, and its arguments.
#[derive(Debug, Serialize, Deserialize)]
pub struct Job<'a> {
    #[serde(borrow)]
    pub source: Cow<'a, str>,
    #[serde(borrow)]
    pub bos: Cow<'a, str>,
    #[serde(borrow)]
    pub eos: Cow<'a, str>,
    pub messages: Cow<'a, [Message]>,
    pub add_generation_prompt: bool,
}

/// The helper's answer to a job.
type Answer = Result<String, ChatError>;

/// Renders chat templates in a helper process; one job at a time.
#[derive(Debug)]
pub struct Sandbox {
    exe: PathBuf,
    memory: u64,
    helper: Mutex<Option<Helper>>,
}

/// A running helper and its pipes.
#[derive(Debug)]
struct Helper {
    child: Child,
    to: ChildStdin,
    from: BufReader<ChildStdout>,
}

impl Drop for Helper {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

static INSTALLED: OnceLock<Sandbox> = OnceLock::new();

/// Renders every chat template of this process in `sandbox` from now on. The serving binary
/// installs one at startup, before it loads a model or registers a worker; a process without
/// one (a library's tests) renders in place. Returns false if one was installed already.
pub fn install(sandbox: Sandbox) -> bool {
    INSTALLED.set(sandbox).is_ok()
}

/// The sandbox this process renders in, if one is installed.
pub fn installed() -> Option<&'static Sandbox> {
    INSTALLED.get()
}

impl Sandbox {
    /// A sandbox whose helpers run `exe` (this binary) with `memory` bytes to spend; none
    /// starts before the first rendering.
    pub fn new(exe: PathBuf, memory: u64) -> Sandbox {
        Sandbox {
            exe,
            memory,
            helper: Mutex::new(None),
        }
    }

    /// Renders `job` in the helper, starting one if none runs (or the last one ended between
    /// jobs). A helper that ends during the job (out of memory, out of time) fails it, and the
    /// next job starts a fresh one.
    pub fn render(&self, job: &Job<'_>) -> Result<String, ChatError> {
        let mut helper = self.helper.lock().unwrap_or_else(PoisonError::into_inner);
        let running = match helper.take().and_then(Helper::running) {
            Some(h) => h,
            None => self.start()?,
        };
        let (running, answer) = running.ask(job);
        *helper = running;
        answer
    }

    fn start(&self) -> Result<Helper, ChatError> {
        let mut child = Command::new(&self.exe)
            .arg(SUBCOMMAND)
            .arg(MEMORY_FLAG)
            .arg(self.memory.to_string())
            .env_clear()
            // The binary's allocator (mimalloc) reserves a GiB of address space up front
            // otherwise, which the limit would then leave to the template.
            .env("MIMALLOC_ARENA_RESERVE", "16MiB")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            // A terminal's Ctrl-C is for the serving process, which stops in its own time.
            .process_group(0)
            .spawn()
            .map_err(|e| {
                ChatError::Sandbox(format!(
                    "cannot start the chat template's sandbox {}: {e}",
                    self.exe.display()
                ))
            })?;
        let (Some(to), Some(from)) = (child.stdin.take(), child.stdout.take()) else {
            unreachable!("both pipes were asked for");
        };
        Ok(Helper {
            child,
            to,
            from: BufReader::new(from),
        })
    }
}

impl Helper {
    /// The helper, unless it ended (killed between jobs, say).
    fn running(mut self) -> Option<Helper> {
        matches!(self.child.try_wait(), Ok(None)).then_some(self)
    }

    /// Sends `job` and reads its answer: the helper back, unless it ended.
    fn ask(mut self, job: &Job<'_>) -> (Option<Helper>, Result<String, ChatError>) {
        match self.exchange(job) {
            Ok(answer) => (Some(self), answer),
            Err(e) => {
                let _ = self.child.kill();
                let ended = self.child.wait();
                (None, Err(ChatError::Sandbox(ended_why(&ended, &e))))
            }
        }
    }

    fn exchange(&mut self, job: &Job<'_>) -> io::Result<Answer> {
        let mut line = serde_json::to_vec(job).map_err(io::Error::other)?;
        line.push(b'\n');
        self.to.write_all(&line)?;
        self.to.flush()?;
        let answer = self.read_line(Instant::now() + TIME)?;
        serde_json::from_slice(&answer).map_err(io::Error::other)
    }

    /// The helper's next line, by `deadline`, of at most [`ANSWER_MAX`] bytes.
    fn read_line(&mut self, deadline: Instant) -> io::Result<Vec<u8>> {
        let mut line = Vec::new();
        loop {
            if self.from.buffer().is_empty() {
                readable_by(self.from.get_ref(), deadline)?;
            }
            let bytes = self.from.fill_buf()?;
            if bytes.is_empty() {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            let (taken, whole) = match bytes.iter().position(|&b| b == b'\n') {
                Some(end) => (end + 1, true),
                None => (bytes.len(), false),
            };
            line.extend_from_slice(&bytes[..taken]);
            self.from.consume(taken);
            if whole {
                return Ok(line);
            }
            if line.len() as u64 > ANSWER_MAX {
                return Err(io::Error::other("the answer is longer than any rendering"));
            }
        }
    }
}

/// Waits until `pipe` has bytes to read (or has ended), by `deadline`.
fn readable_by(pipe: &ChildStdout, deadline: Instant) -> io::Result<()> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        let mut poll = libc::pollfd {
            fd: pipe.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let millis = libc::c_int::try_from(left.as_millis().max(1)).unwrap_or(libc::c_int::MAX);
        // SAFETY: one valid pollfd, owned for the call.
        match unsafe { libc::poll(&mut poll, 1, millis) } {
            0 => {}
            n if n > 0 => return Ok(()),
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
}

/// Why a helper that ended during a job failed it.
fn ended_why(ended: &io::Result<ExitStatus>, e: &io::Error) -> String {
    use std::os::unix::process::ExitStatusExt as _;
    match ended {
        _ if e.kind() == io::ErrorKind::TimedOut => {
            format!("the chat template's rendering took longer than {TIME:?}, and was stopped")
        }
        // An allocation that fails aborts the helper.
        Ok(status) if status.signal() == Some(libc::SIGABRT) => {
            "the chat template ran out of the memory its sandbox allows".to_owned()
        }
        Ok(status) => format!("the chat template's sandbox ended ({status}): {e}"),
        Err(wait) => format!("the chat template's sandbox failed: {e}; {wait}"),
    }
}

/// The helper's life: limits its own memory to `memory` bytes past what it holds now, then
/// answers each job line of `input` on `output` until `input` ends (its serving process did).
pub fn serve(memory: u64) -> io::Result<()> {
    limit_address_space(memory)?;
    serve_on(io::stdin().lock(), io::stdout().lock())
}

/// Answers each job line of `input` with one line on `output`, until `input` ends.
fn serve_on(mut input: impl BufRead, mut output: impl Write) -> io::Result<()> {
    let mut kept: Vec<(String, Environment<'static>)> = Vec::new();
    let mut line = String::new();
    loop {
        line.clear();
        if input.read_line(&mut line)? == 0 {
            return Ok(());
        }
        let answer: Answer = match serde_json::from_str::<Job<'_>>(&line) {
            Ok(job) => render_kept(&mut kept, &job),
            Err(e) => Err(ChatError::Sandbox(format!(
                "the chat template's sandbox cannot read its job: {e}"
            ))),
        };
        let mut out = serde_json::to_vec(&answer).map_err(io::Error::other)?;
        out.push(b'\n');
        output.write_all(&out)?;
        output.flush()?;
    }
}

/// Renders `job` with its template's environment, compiled once and kept among [`KEPT`].
fn render_kept(
    kept: &mut Vec<(String, Environment<'static>)>,
    job: &Job<'_>,
) -> Result<String, ChatError> {
    let at = match kept.iter().position(|(source, _)| *source == job.source) {
        Some(at) => at,
        None => {
            if kept.len() == KEPT {
                kept.remove(0);
            }
            kept.push((job.source.to_string(), environment(&job.source)?));
            kept.len() - 1
        }
    };
    job.render_with(&kept[at].1)
}

/// Limits this process's address space to what it maps now plus `memory` bytes.
fn limit_address_space(memory: u64) -> io::Result<()> {
    let statm = std::fs::read_to_string("/proc/self/statm")?;
    let pages: u64 = statm
        .split_whitespace()
        .next()
        .and_then(|p| p.parse().ok())
        .ok_or_else(|| io::Error::other(format!("unreadable /proc/self/statm: {statm:?}")))?;
    // SAFETY: sysconf has no preconditions.
    let page = u64::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
        .map_err(|_| io::Error::other("no page size"))?;
    let limit = pages.saturating_mul(page).saturating_add(memory);
    let rlimit = libc::rlimit {
        rlim_cur: limit,
        rlim_max: limit,
    };
    // SAFETY: a plain system call with a valid, initialized struct.
    if unsafe { libc::setrlimit(libc::RLIMIT_AS, &rlimit) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job<'a>(source: &'a str, content: &str) -> Job<'a> {
        Job {
            source: source.into(),
            bos: "<s>".into(),
            eos: "</s>".into(),
            messages: vec![Message::new("user", content)].into(),
            add_generation_prompt: true,
        }
    }

    fn answers(jobs: &[&str]) -> Vec<Answer> {
        let input: String = jobs.iter().map(|j| format!("{j}\n")).collect();
        let mut output = Vec::new();
        serve_on(input.as_bytes(), &mut output).expect("serves");
        output
            .split(|&b| b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|l| serde_json::from_slice(l).expect("an answer line"))
            .collect()
    }

    #[test]
    fn a_helper_answers_each_job_in_order_and_a_broken_one_with_its_error() {
        let line = |source: &str, content: &str| {
            serde_json::to_string(&job(source, content)).expect("serializes")
        };
        let echo = "{{ bos_token }}{% for m in messages %}{{ m.role }}:{{ m.content }}{% endfor %}";
        let got = answers(&[
            &line(echo, "hi"),
            "not json",
            &line("{{ raise_exception('no') }}", "x"),
            &line("{% for %}", "x"),
            &line(echo, "multi\nline \"quoted\""),
        ]);
        assert_eq!(got.len(), 5);
        assert_eq!(got[0].as_deref().ok(), Some("<s>user:hi"));
        assert!(matches!(&got[1], Err(ChatError::Sandbox(e)) if e.contains("cannot read its job")));
        assert!(matches!(&got[2], Err(ChatError::Render(e)) if e.contains("no")));
        assert!(matches!(&got[3], Err(ChatError::Compile(_))));
        assert_eq!(
            got[4].as_deref().ok(),
            Some("<s>user:multi\nline \"quoted\"")
        );
    }

    #[test]
    fn a_helper_keeps_a_few_compiled_templates_and_drops_the_oldest() {
        let mut kept = Vec::new();
        for i in 0..KEPT + 2 {
            let source = format!("{i}");
            assert_eq!(render_kept(&mut kept, &job(&source, "")).ok(), Some(source));
        }
        assert_eq!(kept.len(), KEPT);
        assert_eq!(kept[0].0, "2", "the two oldest dropped");
        // A kept one is used again, not compiled a second time.
        render_kept(&mut kept, &job("3", "")).expect("renders");
        assert_eq!(kept.len(), KEPT);
        assert_eq!(kept[0].0, "2");
    }

    #[test]
    fn a_sandbox_whose_binary_cannot_start_fails_the_rendering_by_name() {
        let sandbox = Sandbox::new("/nonexistent/bulkhead".into(), MEMORY);
        let e = sandbox.render(&job("x", "")).expect_err("no helper");
        assert!(e.to_string().contains("/nonexistent/bulkhead"), "{e}");
    }
}
