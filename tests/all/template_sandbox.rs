//! Chat templates from model files are rendered in a sandbox whose memory is bounded
//! (bulkhead_worker::chat::sandbox): a template that asks for more memory than its sandbox
//! allows fails its renderings, and the worker and the gateway serving it keep serving.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use bulkhead_worker::chat::Message;
use bulkhead_worker::chat::sandbox::{Job, MEMORY, MEMORY_FLAG, SUBCOMMAND, Sandbox, TIME};
use bulkhead_worker::gguf::Value;
use bulkhead_worker::tiny_model::TinySpec;

use crate::cluster::Gateway;
use crate::up::{KEY_A, TempDir, bounded, http, json};
use crate::worker_grpc::Worker;

/// Holds about 310 MB at once: strings of 10, 20, 40, 80 and 160 MB.
const DOUBLING: &str = "{% set a = 'x' * 10000000 %}{% set b = a ~ a %}{% set c = b ~ b %}\
{% set d = c ~ c %}{% set e = d ~ d %}{{ e | length }}";

/// One allocation of 100 GB, more than any machine here has: in the serving process it would
/// abort it.
const EXHAUSTING: &str = "{{ 'x' | indent(100000000000, true) }}";

/// A hundred thousand copies of 50 MB in a few instructions each: within the fuel, and most
/// of an hour.
const SLOW: &str = "{% for i in range(100000) %}{% set x = 'x' * (50000000 + i) %}{% endfor %}";

/// A hundred gigabytes of constants, folded while the template compiles: before it renders
/// anything, and in whichever process compiles it.
fn folding() -> String {
    "{% set a = 'x' * 100000000 %}".repeat(1000)
}

/// A chain of 120 000 operators, which the compiler recurses through once per term: deeper
/// than a thread's stack.
fn deep() -> String {
    format!("{{{{ {} }}}}", vec!["1"; 120_000].join("~"))
}

/// An ordinary template.
const ROLES: &str = "{% for m in messages %}{{ m.role }}{% endfor %}";

fn job(source: &str) -> Job<'_> {
    Job {
        source: source.into(),
        bos: "".into(),
        eos: "".into(),
        messages: vec![Message::new("user", "hi")].into(),
        add_generation_prompt: true,
        compile_only: false,
    }
}

/// A template's compilation alone.
fn compiling(source: &str) -> Job<'_> {
    Job {
        messages: Vec::new().into(),
        compile_only: true,
        ..job(source)
    }
}

fn sandbox(memory: u64) -> Sandbox {
    Sandbox::new(PathBuf::from(env!("CARGO_BIN_EXE_bulkhead")), memory)
}

#[test]
fn a_template_past_its_sandboxs_memory_fails_and_the_next_rendering_gets_a_fresh_one() {
    let bounded_one = sandbox(MEMORY);
    let e = bounded_one
        .render(&job(DOUBLING))
        .expect_err("past the sandbox's memory");
    assert!(e.to_string().contains("ran out of the memory"), "{e}");
    // The helper that ended is replaced.
    assert_eq!(
        bounded_one
            .render(&job(ROLES))
            .expect("a fresh helper renders"),
        "user"
    );
    let e = bounded_one
        .render(&job(EXHAUSTING))
        .expect_err("past any memory");
    assert!(e.to_string().contains("ran out of the memory"), "{e}");
    // What stopped it is the limit: with a GiB to spend, the same template renders.
    assert_eq!(
        sandbox(1 << 30)
            .render(&job(DOUBLING))
            .expect("within a GiB"),
        "160000000"
    );
}

/// Compiling a template can exhaust memory or stack as rendering can: the sandbox compiles it
/// under the same limits, and a template that compiles is kept there.
#[test]
fn a_template_that_exhausts_its_compilation_fails_in_the_sandbox() {
    let sandbox = sandbox(MEMORY);
    for (what, source) in [("folding", folding()), ("deep", deep())] {
        let e = sandbox
            .render(&compiling(&source))
            .expect_err("past the sandbox's limits");
        assert!(
            e.to_string().contains("ran out of the memory"),
            "{what}: {e}"
        );
    }
    assert_eq!(sandbox.render(&compiling(ROLES)).expect("compiles"), "");
    assert_eq!(sandbox.render(&job(ROLES)).expect("renders"), "user");
}

#[test]
fn a_template_past_its_deadline_is_stopped_and_the_next_rendering_gets_a_fresh_helper() {
    bounded(|| {
        let sandbox = sandbox(MEMORY);
        let start = Instant::now();
        let e = sandbox.render(&job(SLOW)).expect_err("past its time");
        assert!(e.to_string().contains("took longer than"), "{e}");
        let took = start.elapsed();
        // On two helpers in turn: the first may have been slowed by its host.
        assert!(
            took >= 2 * TIME && took < 2 * TIME + Duration::from_secs(5),
            "{took:?}"
        );
        assert_eq!(sandbox.render(&job(ROLES)).expect("a fresh helper"), "user");
    });
}

/// A helper whose serving process died mid-job (its stdin closed, nobody to kill it) stops
/// itself once the job outlasts its time, instead of running on for most of an hour.
#[test]
fn a_helper_left_alone_mid_job_stops_itself() {
    use std::io::Write as _;
    use std::os::unix::process::ExitStatusExt as _;
    bounded(|| {
        let mut helper = std::process::Command::new(env!("CARGO_BIN_EXE_bulkhead"))
            .args([SUBCOMMAND, MEMORY_FLAG, &MEMORY.to_string()])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("the helper starts");
        let mut line = serde_json::to_vec(&job(SLOW)).expect("serializes");
        line.push(b'\n');
        let mut stdin = helper.stdin.take().expect("piped");
        stdin.write_all(&line).expect("sends the job");
        drop(stdin);
        let started = Instant::now();
        let status = helper.wait().expect("waits");
        assert_eq!(status.signal(), Some(libc::SIGALRM), "{status}");
        assert!(started.elapsed() < TIME + Duration::from_secs(5));
    });
}

/// A model whose chat template would abort any process that rendered it: the worker serving it
/// and the gateway in front answer its chat requests with an error that says why, and go on
/// serving completions, and chat again.
#[test]
fn a_model_whose_chat_template_exhausts_memory_fails_chat_requests_and_nothing_else() {
    template_fails_chat_requests_and_nothing_else(
        Value::String(EXHAUSTING.to_owned()),
        "ran out of the memory",
    );
}

/// The same for a template that would abort any process that compiled it: neither the worker,
/// which compiles its model's template at load, nor the gateway, which compiles the one each
/// worker's Info names, compiles it in its own process.
#[test]
fn a_model_whose_chat_template_exhausts_its_compilation_fails_chat_requests_and_nothing_else() {
    template_fails_chat_requests_and_nothing_else(
        Value::String(folding()),
        "ran out of the memory",
    );
}

/// A template longer than a worker takes is not sent in its Info, and its chat requests were
/// told at the gateway that the model has no chat template: they are told why.
#[test]
fn a_model_whose_chat_template_is_too_long_fails_chat_requests_saying_so() {
    let max = bulkhead_worker::chat::SOURCE_MAX;
    let pad = "x".repeat(max);
    template_fails_chat_requests_and_nothing_else(
        Value::String(format!("{{# {pad} #}}{{{{ messages }}}}")),
        "are taken",
    );
}

/// A template the model file holds as another type than text is not sent either: its chat
/// requests are told it cannot be read, not that the model has none.
#[test]
fn a_model_whose_chat_template_is_not_text_fails_chat_requests_saying_so() {
    template_fails_chat_requests_and_nothing_else(Value::U32(7), "cannot be read");
}

/// A model whose chat template is `template`: its chat requests fail, saying `says`, at the
/// gateway and at the worker, and completions are served.
fn template_fails_chat_requests_and_nothing_else(template: Value, says: &'static str) {
    bounded(move || {
        let dir = TempDir::new("hostile-template");
        let model = dir.0.join("hostile.gguf");
        let mut file = TinySpec::default().to_gguf();
        file.meta("tokenizer.chat_template", template);
        file.write(&model).expect("writes the model");
        let mut worker = Worker::start_on(&model, &["--role", "both"]);

        let mut gateway = Gateway::in_front_of(&dir.0, &worker.grpc);

        let post =
            |path: &str, body: &str| http(&gateway.api, "POST", path, Some(KEY_A), &[], body);
        let chat = r#"{"model": "tiny-random-llama", "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}]}"#;
        let completion = r#"{"model": "tiny-random-llama", "max_tokens": 2, "prompt": "hi"}"#;
        for _ in 0..2 {
            let (status, body) = post("/v1/chat/completions", chat);
            assert_eq!(status, 400, "{body}");
            let message = json(&body)["error"]["message"]
                .as_str()
                .unwrap_or("")
                .to_owned();
            assert!(message.contains(says), "{body}");
            let (status, body) = post("/v1/completions", completion);
            assert_eq!(status, 200, "{body}");
        }
        // The worker renders its own chat prompts (a gRPC caller's messages) the same way.
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        let refused = runtime.block_on(async {
            let mut client = worker.client().await;
            client
                .generate(crate::worker_grpc::chat("hi", 2))
                .await
                .expect_err("the template cannot render")
        });
        assert!(refused.message().contains(says), "{refused:?}");
        assert!(
            worker.child.try_wait().expect("waits").is_none(),
            "the worker runs"
        );
        assert!(
            gateway.child.try_wait().expect("waits").is_none(),
            "the gateway runs"
        );
    });
}
