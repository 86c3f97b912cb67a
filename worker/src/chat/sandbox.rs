//! Chat templates rendered in a child process whose memory and time are bounded.
//!
//! A chat template is a program, from a model file — or, for the gateway, from a worker's Info.
//! minijinja's fuel bounds how many instructions it runs and [`RENDERED_MAX`](super::RENDERED_MAX)
//! how much it writes, but nothing within a process bounds the memory its values take: `{% set
//! b = a ~ a %}` doubles a string in one instruction, a few such lines ask for more than the
//! machine has, and an allocation that fails aborts the process — the gateway serving every
//! tenant, or a worker with its requests under way. Nor does fuel bound time: one instruction
//! may copy a hundred megabytes. So a serving process installs a [`Sandbox`]: a helper process
//! of the same binary (`bulkhead template-sandbox`), its address space limited (`RLIMIT_AS`),
//! no environment, in a process group of its own, that renders one job at a time from its
//! stdin. A template that exhausts it ends the helper alone: the rendering fails with an error
//! that says so ([`ChatError::Sandbox`]), and the next one starts a fresh helper.
//!
//! ```text
//!  render ─▶ wait for the helper (≤ TIME) ─▶ write the job, read the answer (≤ TIME)
//!              busy past TIME: Unavailable      helper ended: Sandbox (its memory, its
//!                                               stack) or Unavailable; past TIME: killed,
//!                                               and once more on a fresh helper: TimedOut
//! ```
//!
//! The helper also stops itself when a job outlasts [`TIME`] (an alarm), so one whose serving
//! process died mid-job does not run on.

use std::borrow::Cow;
use std::io::{self, BufRead, BufReader, Read as _, Write};
use std::os::fd::{AsFd, AsRawFd as _};
use std::os::unix::process::{CommandExt as _, ExitStatusExt as _};
use std::path::PathBuf;
use std::process::{Child, ChildStderr, ChildStdin, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use minijinja::Environment;
use serde::{Deserialize, Serialize};

use super::{ChatError, Message, RENDERED_MAX, environment};
use crate::printable::printable;

/// The subcommand of the binary that serves as the helper.
pub const SUBCOMMAND: &str = "template-sandbox";

/// The flag that gives the helper its memory (bytes past what it holds when it starts).
pub const MEMORY_FLAG: &str = "--memory-bytes";

/// The memory a helper may take past what it holds when it starts. Real templates render a
/// conversation's frame in a few kilobytes.
pub const MEMORY: u64 = 256 << 20;

/// How long a rendering may wait for the helper, and then take; a rendering that times out is
/// tried once more on a fresh helper, so one caller waits at most about three times this, plus
/// two helpers' starts. Real templates take microseconds.
pub const TIME: Duration = Duration::from_secs(5);

/// The longest error text a helper sends (a template's `raise_exception` message is its own
/// to write).
const ERROR_MAX: usize = 4 << 10;

/// The longest answer line read from a helper: a rendering at its bound, every byte of it
/// escaped by JSON (`\u0000`), and the line's frame; an error is shorter.
const ANSWER_MAX: u64 = 6 * RENDERED_MAX as u64 + 64;

/// What of a helper's stderr (its last words: an allocation that failed) goes to the log.
const LAST_WORDS: u64 = 1 << 10;

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
    /// Only compile the template (and keep it): the answer is empty. Compiling runs the
    /// template's constant expressions, which can ask for as much memory as a rendering.
    #[serde(default)]
    pub compile_only: bool,
}

/// The helper's answer to a job.
type Answer = Result<String, ChatError>;

/// Renders chat templates in a helper process; one job at a time.
#[derive(Debug)]
pub struct Sandbox {
    exe: PathBuf,
    memory: u64,
    slot: Mutex<Slot>,
    /// Signalled when a rendering gives the helper back.
    free: Condvar,
}

/// The helper, when no rendering has it.
#[derive(Debug, Default)]
struct Slot {
    helper: Option<Helper>,
    busy: bool,
}

/// One rendering's turn with the helper; when it ends (a panic included), the helper it holds
/// goes back and the next rendering's turn begins.
struct Turn<'a> {
    sandbox: &'a Sandbox,
    helper: Option<Helper>,
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        let mut slot = self.sandbox.lock();
        slot.helper = self.helper.take();
        slot.busy = false;
        drop(slot);
        self.sandbox.free.notify_one();
    }
}

/// A running helper and its pipes.
#[derive(Debug)]
struct Helper {
    child: Child,
    to: ChildStdin,
    from: BufReader<ChildStdout>,
    stderr: ChildStderr,
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
            slot: Mutex::new(Slot::default()),
            free: Condvar::new(),
        }
    }

    /// Renders `job` in the helper, once no other rendering has it (within [`TIME`]), starting
    /// one if none runs (or the last ended between jobs). A helper that ends during the job,
    /// or outlasts [`TIME`], fails it and is replaced by the next job.
    pub fn render(&self, job: &Job<'_>) -> Answer {
        let mut turn = self.take()?;
        let kept = turn.helper.take().and_then(Helper::running);
        let reused = kept.is_some();
        let (mut helper, mut answer) = self.ask(kept, job);
        let again = match &answer {
            // A kept helper that broke off before answering may have been ending as the job
            // came (killed between jobs).
            Err(ChatError::Unavailable(_)) => reused,
            // A host busy elsewhere may have slowed the helper (a fresh one's start counts in
            // its time): the template's fault, and kept as such, only if a second one runs
            // out of time too.
            Err(ChatError::TimedOut(_)) => true,
            _ => false,
        };
        if again && helper.is_none() {
            (helper, answer) = self.ask(None, job);
        }
        turn.helper = helper;
        answer
    }

    /// Asks `helper` (a fresh one if `None`) to render `job`: the helper back, unless it ended.
    fn ask(&self, helper: Option<Helper>, job: &Job<'_>) -> (Option<Helper>, Answer) {
        let helper = match helper {
            Some(h) => h,
            None => match self.start() {
                Ok(h) => h,
                Err(e) => return (None, Err(e)),
            },
        };
        helper.ask(job)
    }

    /// This rendering's turn with the helper (if one runs), once no other rendering has it.
    fn take(&self) -> Result<Turn<'_>, ChatError> {
        let (mut slot, wait) = self
            .free
            .wait_timeout_while(self.lock(), TIME, |s| s.busy)
            .unwrap_or_else(PoisonError::into_inner);
        if wait.timed_out() && slot.busy {
            let e = ChatError::Unavailable(format!("other renderings held it for {TIME:?}"));
            tracing::warn!(error = %e, "a chat template rendering did not get the sandbox");
            return Err(e);
        }
        slot.busy = true;
        Ok(Turn {
            sandbox: self,
            helper: slot.helper.take(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Slot> {
        self.slot.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A fresh helper; why not, said in the log too.
    fn start(&self) -> Result<Helper, ChatError> {
        self.spawn().inspect_err(|e| {
            tracing::warn!(error = %e, "cannot start the chat template's sandbox");
        })
    }

    fn spawn(&self) -> Result<Helper, ChatError> {
        let mut command = Command::new(&self.exe);
        // Nothing of this process's environment (its secrets), but where the dynamic loader
        // finds the binary's libraries when it needs telling.
        command.env_clear();
        if let Some(path) = std::env::var_os("LD_LIBRARY_PATH") {
            command.env("LD_LIBRARY_PATH", path);
        }
        let mut child = command
            .arg(SUBCOMMAND)
            .arg(MEMORY_FLAG)
            .arg(self.memory.to_string())
            // The binary's allocator (mimalloc) reserves a GiB of address space up front
            // otherwise, which the limit would then leave to the template.
            .env("MIMALLOC_ARENA_RESERVE", "16MiB")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // A terminal's Ctrl-C is for the serving process, which stops in its own time.
            .process_group(0)
            .spawn()
            .map_err(|e| {
                ChatError::Unavailable(format!("cannot start {}: {e}", self.exe.display()))
            })?;
        let (Some(to), Some(from), Some(stderr)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            unreachable!("the three pipes were asked for");
        };
        nonblocking(&to)
            .map_err(|e| ChatError::Unavailable(format!("cannot set up its pipe: {e}")))?;
        Ok(Helper {
            child,
            to,
            from: BufReader::new(from),
            stderr,
        })
    }
}

impl Helper {
    /// The helper, unless it ended (killed between jobs, say).
    fn running(mut self) -> Option<Helper> {
        matches!(self.child.try_wait(), Ok(None)).then_some(self)
    }

    /// Sends `job` and reads its answer: the helper back, unless it ended or was stopped.
    fn ask(mut self, job: &Job<'_>) -> (Option<Helper>, Answer) {
        match self.exchange(job, Instant::now() + TIME) {
            Ok(answer) => (Some(self), answer),
            Err(e) => {
                // The whole group (its own): nothing it started keeps its stderr open.
                if let Ok(pid) = libc::pid_t::try_from(self.child.id()) {
                    // SAFETY: kill(2) on the helper's own process group.
                    unsafe { libc::kill(-pid, libc::SIGKILL) };
                }
                let _ = self.child.kill();
                let ended = self.child.wait();
                let mut last_words = Vec::new();
                let _ = (&mut self.stderr)
                    .take(LAST_WORDS)
                    .read_to_end(&mut last_words);
                let error = stopped(&ended, &e);
                tracing::warn!(
                    %error,
                    stderr = %printable(&String::from_utf8_lossy(&last_words), LAST_WORDS as usize),
                    "the chat template's sandbox stopped"
                );
                (None, Err(error))
            }
        }
    }

    fn exchange(&mut self, job: &Job<'_>, deadline: Instant) -> io::Result<Answer> {
        let mut line = serde_json::to_vec(job).map_err(io::Error::other)?;
        line.push(b'\n');
        self.write_by(&line, deadline)?;
        let answer = self.read_line(deadline)?;
        serde_json::from_slice(&answer).map_err(io::Error::other)
    }

    /// Writes all of `bytes` to the helper's stdin (non-blocking) by `deadline`.
    fn write_by(&mut self, mut bytes: &[u8], deadline: Instant) -> io::Result<()> {
        while !bytes.is_empty() {
            match self.to.write(bytes) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => bytes = &bytes[n..],
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    ready_by(&self.to, libc::POLLOUT, deadline)?;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// The helper's next line, by `deadline`, of at most [`ANSWER_MAX`] bytes.
    fn read_line(&mut self, deadline: Instant) -> io::Result<Vec<u8>> {
        let mut line = Vec::new();
        loop {
            if self.from.buffer().is_empty() {
                ready_by(self.from.get_ref(), libc::POLLIN, deadline)?;
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
                return Err(io::Error::other(format!(
                    "an answer longer than {ANSWER_MAX} bytes"
                )));
            }
        }
    }
}

/// Sets `pipe` non-blocking, so a write never waits past its deadline.
fn nonblocking(pipe: &impl AsFd) -> io::Result<()> {
    let fd = pipe.as_fd().as_raw_fd();
    // SAFETY: fcntl on a descriptor the caller owns, with plain integer arguments.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Waits until `pipe` is ready for `events` (or has ended), by `deadline`.
fn ready_by(pipe: &impl AsFd, events: libc::c_short, deadline: Instant) -> io::Result<()> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        let mut poll = libc::pollfd {
            fd: pipe.as_fd().as_raw_fd(),
            events,
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

/// Why a helper that was stopped during a job (`e`: what the exchange met) failed it: the
/// template's doing when it outlasted [`TIME`] or aborted the helper (an allocation past the
/// limit, or its stack), the sandbox's otherwise.
fn stopped(ended: &io::Result<ExitStatus>, e: &io::Error) -> ChatError {
    if e.kind() == io::ErrorKind::TimedOut {
        return ChatError::TimedOut(TIME);
    }
    match ended {
        Ok(status) if matches!(status.signal(), Some(libc::SIGABRT | libc::SIGSEGV)) => {
            ChatError::Sandbox(
                "the chat template ran out of the memory or stack its sandbox allows".to_owned(),
            )
        }
        Ok(status) => ChatError::Unavailable(format!("its helper ended ({status}): {e}")),
        Err(wait) => ChatError::Unavailable(format!("its helper failed: {e}; {wait}")),
    }
}

/// The helper's life: limits its own memory to `memory` bytes past what it holds now, then
/// answers each job line of stdin on stdout until stdin ends (its serving process did), each
/// job under an alarm that ends the helper should the job outlast [`TIME`].
pub fn serve(memory: u64) -> io::Result<()> {
    limit_memory(memory)?;
    let seconds = u32::try_from(TIME.as_secs() + 1).unwrap_or(u32::MAX);
    serve_on(io::stdin().lock(), io::stdout().lock(), |busy| {
        // SAFETY: alarm(2) has no preconditions; SIGALRM's default action ends the helper.
        unsafe { libc::alarm(if busy { seconds } else { 0 }) };
    })
}

/// Answers each job line of `input` with one line on `output`, until `input` ends; `busy`
/// hears when a job starts (true) and ends (false).
fn serve_on(
    mut input: impl BufRead,
    mut output: impl Write,
    mut busy: impl FnMut(bool),
) -> io::Result<()> {
    let mut kept: Vec<(String, Environment<'static>)> = Vec::new();
    let mut line = String::new();
    loop {
        line.clear();
        if input.read_line(&mut line)? == 0 {
            return Ok(());
        }
        busy(true);
        let answer: Answer = match serde_json::from_str::<Job<'_>>(&line) {
            Ok(job) => render_kept(&mut kept, &job).map_err(bounded),
            Err(e) => Err(ChatError::Unavailable(format!("cannot read its job: {e}"))),
        };
        busy(false);
        let mut out = serde_json::to_vec(&answer).map_err(io::Error::other)?;
        out.push(b'\n');
        output.write_all(&out)?;
        output.flush()?;
    }
}

/// `e` with its text cut to [`ERROR_MAX`] bytes.
fn bounded(e: ChatError) -> ChatError {
    let cut = |s: String| printable(&s, ERROR_MAX);
    match e {
        ChatError::Compile(s) => ChatError::Compile(cut(s)),
        ChatError::Unreadable(s) => ChatError::Unreadable(cut(s)),
        ChatError::Render(s) => ChatError::Render(cut(s)),
        ChatError::Tokenize(s) => ChatError::Tokenize(cut(s)),
        ChatError::Role(s) => ChatError::Role(cut(s)),
        ChatError::Sandbox(s) => ChatError::Sandbox(cut(s)),
        ChatError::Unavailable(s) => ChatError::Unavailable(cut(s)),
        e @ (ChatError::NoTemplate | ChatError::ContentRewritten | ChatError::TimedOut(_)) => e,
    }
}

/// Renders `job` with its template's environment, compiled once and kept among [`KEPT`].
fn render_kept(kept: &mut Vec<(String, Environment<'static>)>, job: &Job<'_>) -> Answer {
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
    if job.compile_only {
        return Ok(String::new());
    }
    job.render_with(&kept[at].1)
}

/// Limits this process's address space to what it maps now plus `memory` bytes, and its
/// stack to [`STACK`].
fn limit_memory(memory: u64) -> io::Result<()> {
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
    // Jobs run on the main thread, whose stack grows up to this limit (checked at each
    // growth): inherited, it could be unlimited, and a template nesting past any stack would
    // then take the memory above instead of ending on its own limit.
    let mut stack = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain system calls with a valid struct to fill, then to read.
    if unsafe { libc::getrlimit(libc::RLIMIT_STACK, &mut stack) } != 0 {
        return Err(io::Error::last_os_error());
    }
    stack.rlim_cur = stack.rlim_cur.min(STACK);
    stack.rlim_max = stack.rlim_max.min(STACK);
    // SAFETY: as above.
    if unsafe { libc::setrlimit(libc::RLIMIT_STACK, &stack) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The helper's stack: the usual default.
const STACK: u64 = 8 << 20;

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
            compile_only: false,
        }
    }

    /// The helper's answers to `jobs`, and whether it was busy at each job's start and end.
    fn answers(jobs: &[&str]) -> (Vec<Answer>, Vec<bool>) {
        let input: String = jobs.iter().map(|j| format!("{j}\n")).collect();
        let mut output = Vec::new();
        let mut busy = Vec::new();
        serve_on(input.as_bytes(), &mut output, |b| busy.push(b)).expect("serves");
        let answers = output
            .split(|&b| b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|l| serde_json::from_slice(l).expect("an answer line"))
            .collect();
        (answers, busy)
    }

    #[test]
    fn a_helper_answers_each_job_in_order_and_a_broken_one_with_its_error() {
        let line = |source: &str, content: &str| {
            serde_json::to_string(&job(source, content)).expect("serializes")
        };
        let echo = "{{ bos_token }}{% for m in messages %}{{ m.role }}:{{ m.content }}{% endfor %}";
        let (got, busy) = answers(&[
            &line(echo, "hi"),
            "not json",
            &line("{{ raise_exception('no' * 100000) }}", "x"),
            &line("{% for %}", "x"),
            &line(echo, "multi\nline \"quoted\""),
        ]);
        assert_eq!(got.len(), 5);
        assert_eq!(busy, [true, false].repeat(5), "each job under its alarm");
        assert_eq!(got[0].as_deref().ok(), Some("<s>user:hi"));
        assert!(
            matches!(&got[1], Err(ChatError::Unavailable(e)) if e.contains("cannot read its job"))
        );
        // The template's own message, cut.
        assert!(
            matches!(&got[2], Err(ChatError::Render(e)) if e.contains("nono") && e.len() <= ERROR_MAX)
        );
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

    /// A sandbox whose helper is the shell script `body` (it reads a job per `read`).
    fn scripted(name: &str, body: &str) -> (Sandbox, PathBuf) {
        use std::os::unix::fs::PermissionsExt as _;
        let path = std::env::temp_dir().join(format!(
            "bulkhead-sandbox-{name}-{}-{}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).expect("writes the script");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        (Sandbox::new(path.clone(), MEMORY), path)
    }

    #[test]
    fn the_parent_reads_an_answer_in_pieces_and_replaces_a_helper_that_ends_between_jobs() {
        // Answers its one job in two writes, then ends: the next job needs a fresh helper.
        let (sandbox, path) = scripted(
            "pieces",
            r#"read job; printf '{"Ok":"a'; sleep 0.2; printf 'b"}\n'"#,
        );
        for pause in [0, 100, 0] {
            // With no pause, the helper may still be ending as the next job comes.
            std::thread::sleep(Duration::from_millis(pause));
            assert_eq!(sandbox.render(&job("x", "")).expect("answers"), "ab");
        }
        let _ = std::fs::remove_file(path);
    }

    #[test]
    fn a_helper_that_breaks_off_fails_the_job_by_the_templates_fault_or_the_sandboxs() {
        let cases = [
            // An abort: what an allocation past the limit does.
            ("abort", "read job; kill -ABRT $$", true),
            ("exit", "read job; exit 3", false),
            ("garbage", "read job; echo 'not an answer'; sleep 5", false),
        ];
        for (name, body, templates_fault) in cases {
            let (sandbox, path) = scripted(name, body);
            let e = sandbox.render(&job("x", "")).expect_err(name);
            assert_eq!(
                matches!(e, ChatError::Sandbox(_)),
                templates_fault,
                "{name}: {e}"
            );
            assert_eq!(e.transient(), !templates_fault, "{name}: {e}");
            let _ = std::fs::remove_file(path);
        }
    }

    /// A helper slow past its time once (its host busy elsewhere) does not make the
    /// template's rendering fail, which would be kept as the template's own failure: the job
    /// goes once more to a fresh helper.
    #[test]
    fn a_rendering_past_its_time_once_is_asked_again_of_a_fresh_helper() {
        // Its first start sleeps past the time without reading its job; the next answers.
        let (sandbox, path) = scripted(
            "slow-once",
            r#"if [ ! -e "$0.slow" ]; then touch "$0.slow"; sleep 30; fi; while read job; do echo '{"Ok":"done"}'; done"#,
        );
        let started = Instant::now();
        assert_eq!(sandbox.render(&job("x", "")).expect("renders"), "done");
        assert!(
            started.elapsed() >= TIME,
            "the first helper ran out of time"
        );
        let _ = std::fs::remove_file(format!("{}.slow", path.display()));
        let _ = std::fs::remove_file(path);
    }

    #[test]
    fn renderings_wait_their_turn_for_the_helper() {
        let (sandbox, path) = scripted(
            "turns",
            r#"while read job; do sleep 0.2; echo '{"Ok":"done"}'; done"#,
        );
        let started = Instant::now();
        std::thread::scope(|s| {
            let all: Vec<_> = (0..3)
                .map(|_| s.spawn(|| sandbox.render(&job("x", ""))))
                .collect();
            for one in all {
                assert_eq!(one.join().expect("joins").expect("renders"), "done");
            }
        });
        assert!(
            started.elapsed() >= Duration::from_millis(600),
            "one at a time"
        );
        let _ = std::fs::remove_file(path);
    }

    #[test]
    fn a_turn_ended_by_a_panic_gives_the_helper_back() {
        let sandbox = Sandbox::new("/nonexistent/bulkhead".into(), MEMORY);
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _turn = sandbox.take().expect("free");
            panic!("a bug in the middle of a rendering");
        }));
        assert!(panicked.is_err());
        let started = Instant::now();
        assert!(sandbox.take().is_ok(), "the sandbox is free again");
        assert!(
            started.elapsed() < TIME,
            "without waiting out another's turn"
        );
    }

    #[test]
    fn a_helper_answering_in_band_is_kept_not_replaced() {
        // Counts its starts in a file: one start answers every job.
        let (sandbox, path) = scripted(
            "kept",
            r#"echo start >> "$0.starts"; while read job; do echo '{"Err":{"Unavailable":"cannot read its job"}}'; done"#,
        );
        for _ in 0..3 {
            let e = sandbox.render(&job("x", "")).expect_err("its answer");
            assert!(e.transient(), "{e}");
        }
        let starts =
            std::fs::read_to_string(format!("{}.starts", path.display())).expect("counted");
        assert_eq!(starts.lines().count(), 1, "one helper for all three");
        let _ = std::fs::remove_file(format!("{}.starts", path.display()));
        let _ = std::fs::remove_file(path);
    }

    #[test]
    fn a_sandbox_whose_binary_cannot_start_is_unavailable_and_says_which() {
        let sandbox = Sandbox::new("/nonexistent/bulkhead".into(), MEMORY);
        let e = sandbox.render(&job("x", "")).expect_err("no helper");
        assert!(e.transient(), "{e}");
        assert!(e.to_string().contains("/nonexistent/bulkhead"), "{e}");
    }
}
