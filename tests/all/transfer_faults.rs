//! Release and reclaim across real processes: a decode worker and a prefill worker on
//! loopback, the prefill side killed or stuck mid-transfer, or dropped by the client before its
//! KV exists. Each test reads the workers' `/metrics` as an operator would.

use std::time::{Duration, Instant};

use bulkhead_worker::serve::proto::{self, InfoRequest, PrefillItem, error_code};

use crate::worker_grpc::{
    Run, Worker, available, bounded, chat, decode_at, decode_for, health, metric, pool,
    run_reporting, run_to_end, text_of, wait_all_pages_back,
};

/// A prefill worker with `prefill_args` and a decode worker wired to it with `decode_args`.
fn pair(prefill_args: &[&str], decode_args: &[&str]) -> (Worker, Worker) {
    let mut args = vec!["--role", "prefill", "--kv-tokens", "2048"];
    args.extend_from_slice(prefill_args);
    let prefill = Worker::start(&args);
    let mut args = vec!["--kv-tokens", "2048"];
    args.extend_from_slice(decode_args);
    let decode = decode_for(&prefill, &args);
    (prefill, decode)
}

/// Polls `worker`'s `/metrics` until `ready` holds for it (bounded: a prefill on a machine
/// busy with the rest of the suite can take tens of seconds); returns the text.
async fn wait_metrics(worker: &Worker, what: &str, ready: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let m = worker.metrics();
        if ready(&m) {
            return m;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}; metrics:\n{m}\nstderr:\n{}",
            text_of(&worker.stderr)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

const RECEIVING: &str = "bulkhead_kv_transfers_in_flight{side=\"receive\"}";
const SENDING: &str = "bulkhead_kv_transfers_in_flight{side=\"send\"}";

#[tokio::test]
async fn a_stuck_peer_keeps_its_quarantined_pages_until_it_dies_then_they_come_back() {
    bounded(async {
        // Prefill writes one frame and then holds the connection open without another byte.
        let (prefill, decode) = pair(
            &[
                "--transfer-batch-bytes",
                "1",
                "--fault-stall-after-frames",
                "1",
            ],
            &[
                "--transfer-timeout-ms",
                "2000",
                "--release-timeout-ms",
                "500",
                "--reclaim-after-ms",
                "300",
            ],
        );
        let mut client = decode.client().await;
        let request = tokio::spawn(async move {
            let start = Instant::now();
            let mut stream = client
                .generate(chat("What is 2+2?", 8))
                .await
                .expect("admitted")
                .into_inner();
            // What the stream says before its error.
            let mut heard = Vec::new();
            let end = loop {
                match stream.message().await {
                    Ok(Some(m)) => heard.push(m.item.expect("every item has a body")),
                    Ok(None) => break Ok(()),
                    Err(e) => break Err(e),
                }
            };
            (end, heard, start.elapsed())
        });

        // Mid-transfer: the per-role gauges show it on both sides.
        let m = wait_metrics(&decode, "the stalled transfer", |m| {
            metric(m, RECEIVING) == 1.0 && metric(m, "bulkhead_kv_frames_written_total") >= 1.0
        })
        .await;
        let tokens = metric(&m, "bulkhead_kv_in_flight_tokens{side=\"receive\"}");
        assert!(tokens > 16.0, "a prompt of several pages is in flight: {m}");
        assert!(
            metric(&m, "bulkhead_kv_reserved_tokens") >= tokens + 8.0,
            "{m}"
        );
        let p = prefill.metrics();
        assert_eq!(metric(&p, SENDING), 1.0, "{p}");
        assert_eq!(
            metric(&p, "bulkhead_kv_in_flight_tokens{side=\"send\"}"),
            tokens,
            "{p}"
        );

        let (answer, heard, took) = request.await.expect("the request task");
        let err = answer.expect_err("the transfer cannot complete");
        // Prefill computed the prompt and said so: the caller heard the request was
        // transferring, and never a token.
        assert!(
            heard
                .iter()
                .any(|i| matches!(i, proto::Item::PrefillDone(_))),
            "{heard:?}"
        );
        assert!(
            !heard.iter().any(|i| matches!(i, proto::Item::Token(_))),
            "{heard:?}"
        );
        assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
        assert_eq!(error_code(&err), Some("service_unavailable"), "{err:?}");
        assert!(took < Duration::from_secs(10), "failed after {took:?}");

        // No drain acknowledgement within the release timeout: quarantined.
        let m = wait_metrics(&decode, "the drain timeout", |m| {
            metric(m, "bulkhead_kv_drain_timeouts_total") == 1.0
        })
        .await;
        let quarantined = metric(&m, "bulkhead_kv_pool_pages{state=\"quarantined\"}");
        assert!(quarantined >= 2.0, "{m}");
        assert_eq!(metric(&m, "bulkhead_kv_quarantined_sessions"), 1.0, "{m}");
        assert_eq!(metric(&m, RECEIVING), 0.0, "{m}");

        // The peer is alive, only stuck: its pages stay out of circulation well past the
        // reclaim delay.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let m = decode.metrics();
        assert_eq!(
            metric(&m, "bulkhead_kv_pool_pages{state=\"quarantined\"}"),
            quarantined,
            "a live peer's pages came back early: {m}"
        );
        assert_eq!(metric(&m, "bulkhead_kv_reclaimed_pages_total"), 0.0, "{m}");

        // The peer dies: its connection closes, and after the reclaim delay the pages are
        // scrubbed and free again.
        drop(prefill);
        let m = wait_metrics(&decode, "the reclaim", |m| {
            metric(m, "bulkhead_kv_pool_pages{state=\"quarantined\"}") == 0.0
        })
        .await;
        assert_eq!(
            metric(&m, "bulkhead_kv_reclaimed_pages_total"),
            quarantined,
            "{m}"
        );
        assert_eq!(metric(&m, "bulkhead_kv_quarantined_sessions"), 0.0, "{m}");
        assert_eq!(
            metric(&m, "bulkhead_kv_abort_ack_seconds_count"),
            0.0,
            "{m}"
        );
        let p = wait_all_pages_back(&decode).await;
        assert_eq!(available(&p), p.total, "{p:?}");
    })
    .await;
}

#[tokio::test]
async fn prompts_that_outlast_the_transfer_timeout_are_served_while_prefill_makes_progress() {
    bounded(async {
        // Prefill computes 32 prompt tokens per step, each step far within decode's transfer
        // timeout; each prompt (about 600 tokens) takes longer than it, and the second waits
        // behind the first for longer than it before its own first step. Decode once gave up
        // on both at the timeout, however busily prefill worked.
        let timeout = Duration::from_secs(3);
        let (prefill, decode) = pair(
            &["--max-batch-tokens", "32"],
            &["--transfer-timeout-ms", "3000"],
        );
        let long = "Tell me about the history of the harbour town and its ships. ".repeat(45);
        let start = Instant::now();
        let mut requests = Vec::new();
        for lead in ["First", "Then"] {
            let mut client = decode.client().await;
            let prompt = format!("{lead}: {long}");
            requests.push(tokio::spawn(async move {
                let answer = run_reporting(&mut client, chat(&prompt, 4)).await;
                (answer, start.elapsed())
            }));
        }
        let mut finished = Vec::new();
        for request in requests {
            let (answer, took) = request.await.expect("the request task");
            let Run {
                progress,
                prefill_done,
                tokens,
                ..
            } = answer.unwrap_or_else(|e| panic!("failed after {took:?}: {e:?}"));
            assert!(prefill_done);
            assert!(tokens >= 1, "{tokens}");
            // Decode passed prefill's reports on to its caller, each one higher.
            assert!(progress.len() >= 2, "{progress:?}");
            assert!(progress.is_sorted_by(|a, b| a < b), "{progress:?}");
            finished.push(took);
        }
        // Prefill computes one prompt after the other: the second waited for as long as the
        // first took.
        let first = finished.iter().min().expect("two requests");
        assert!(
            *first > timeout,
            "the first prompt took {first:?}, within the timeout: this test shows nothing"
        );
        let m = decode.metrics();
        assert_eq!(metric(&m, RECEIVING), 0.0, "{m}");
        let computed = metric(&prefill.metrics(), "bulkhead_prompt_tokens_computed_total");
        assert!(computed > 1000.0, "{computed}");
    })
    .await;
}

#[tokio::test]
async fn a_request_dropped_while_prefill_computes_is_acknowledged_not_quarantined() {
    bounded(async {
        // A release timeout far beyond the test's waits: only the acknowledgement can free
        // the pages in time.
        let (prefill, decode) = pair(&[], &["--release-timeout-ms", "120000"]);
        let before = pool(&health(&mut decode.client().await).await);
        let mut client = decode.client().await;
        let long = "Tell me about the history of the harbour town and its ships. ".repeat(40);
        let stream = client
            .generate(chat(&long, 8))
            .await
            .expect("admitted")
            .into_inner();
        // Wait until decode has reserved and prefill is computing, then leave.
        wait_metrics(&decode, "the reservation", |m| metric(m, RECEIVING) == 1.0).await;
        let mut pc = prefill.client().await;
        let deadline = Instant::now() + Duration::from_secs(30);
        while health(&mut pc).await.running == 0 {
            assert!(Instant::now() < deadline, "prefill never started");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let dropped_at = Instant::now();
        drop(stream);

        let m = wait_metrics(&decode, "the drain acknowledgement", |m| {
            metric(m, "bulkhead_kv_abort_ack_seconds_count") == 1.0
        })
        .await;
        assert!(dropped_at.elapsed() < Duration::from_secs(30));
        assert_eq!(metric(&m, "bulkhead_kv_drain_timeouts_total"), 0.0, "{m}");
        assert_eq!(
            metric(&m, "bulkhead_kv_pool_pages{state=\"quarantined\"}"),
            0.0,
            "{m}"
        );
        let p = wait_all_pages_back(&decode).await;
        assert_eq!(available(&p), before.total, "{p:?}");
        let p = wait_all_pages_back(&prefill).await;
        assert_eq!(available(&p), p.total, "{p:?}");
        assert_eq!(metric(&prefill.metrics(), SENDING), 0.0);
    })
    .await;
}

#[tokio::test]
async fn requests_while_prefill_is_down_give_decode_its_pages_back_not_quarantine() {
    bounded(async {
        // A prefill worker that is gone before the requests come: each Prefill call fails at
        // connect, so no frame of those sessions can ever be sent. Their pages must come back,
        // not wait out the release timeout and stay quarantined (every request of an outage
        // took pages for good, and a decode worker whose prefill restarted had none left).
        let (mut prefill, decode) = pair(&[], &["--release-timeout-ms", "300"]);
        prefill.child.kill().expect("kill the prefill worker");
        prefill.child.wait().expect("reap the prefill worker");
        let mut client = decode.client().await;
        for i in 0..3 {
            let err = run_to_end(&mut client, chat("What is 2+2?", 8))
                .await
                .expect_err("no prefill worker to serve it");
            assert_eq!(err.code(), tonic::Code::Unavailable, "request {i}: {err:?}");
            assert_eq!(error_code(&err), Some("service_unavailable"), "{err:?}");
        }
        // Past the release timeout, a reservation that was not given back is quarantined.
        tokio::time::sleep(Duration::from_millis(900)).await;
        let p = pool(&health(&mut client).await);
        assert_eq!(p.quarantined, 0, "{p:?}");
        assert_eq!(available(&p), p.total, "{p:?}");
    })
    .await;
}

#[tokio::test]
async fn requests_given_up_before_a_silent_prefill_answers_give_decode_its_pages_back() {
    bounded(async {
        // A prefill worker that is there but never answers (stopped: its kernel still accepts
        // connections). A request whose transfer deadline passes, and one whose client leaves,
        // before prefill answered: neither can ever get a drain acknowledgement while prefill
        // stays silent, and no data connection of theirs ever opened to close. Their pages
        // must come back, not be quarantined for as long as the silence lasts.
        let (prefill, decode) = pair(
            &[],
            &[
                "--transfer-timeout-ms",
                "2000",
                "--release-timeout-ms",
                "300",
            ],
        );
        let mut client = decode.client().await;
        let before = pool(&health(&mut client).await);
        let stopped = std::process::Command::new("kill")
            .args(["-STOP", &prefill.child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(stopped.success());
        let err = run_to_end(&mut client, chat("What is 2+2?", 8))
            .await
            .expect_err("no answer from prefill");
        assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
        let left = tokio::time::timeout(
            Duration::from_millis(500),
            run_to_end(&mut client, chat("What is 2+2?", 8)),
        )
        .await;
        assert!(left.is_err(), "the client left before any answer: {left:?}");
        // Past the release timeout, a reservation that was not given back is quarantined.
        tokio::time::sleep(Duration::from_millis(900)).await;
        let p = pool(&health(&mut client).await);
        let _ = std::process::Command::new("kill")
            .args(["-CONT", &prefill.child.id().to_string()])
            .status();
        assert_eq!(p.quarantined, 0, "{p:?}");
        assert_eq!(available(&p), before.total, "{p:?}");
    })
    .await;
}

/// A `Prefill` call as decode would make it for a prompt of 1000 tokens — more KV than
/// loopback's socket buffers hold, quick to prefill — whose KV goes to `kv_address`.
async fn large_prefill(
    pc: &mut proto::WorkerClient<tonic::transport::Channel>,
    kv_address: String,
) -> proto::PrefillRequest {
    let info = pc
        .info(InfoRequest::default())
        .await
        .expect("info")
        .into_inner();
    let handoff = info
        .handoff
        .expect("a prefill worker describes its handoff");
    let prompt: Vec<u32> = (0..1000).map(|i| 100 + (i * 7) % 4000).collect();
    let pages = prompt.len().div_ceil(info.page_tokens as usize) as u32;
    proto::PrefillRequest {
        request_id: "large".into(),
        tenant: "tenant-a".into(),
        prompt,
        sampling: None,
        reservation: Some(proto::KvReservation {
            nonce: vec![7; 16],
            pages: (0..pages)
                .map(|page| proto::ReservedPage { page, tag: 1 })
                .collect(),
            prompt_tokens: 1000,
            cached_tokens: 0,
            page_tokens: info.page_tokens,
            token_bytes: handoff.token_bytes as u32,
        }),
        kv_address,
        cache_salt: String::new(),
        model_id: info.model_id,
    }
}

/// A decode peer that reads, but far slower than the transfer floor, and never hangs up holds
/// prefill's pages no longer than the send's deadline — the peer timeout and the KV's bytes at
/// the floor. Only decode bounded a transfer, and the kernel's bound on an unanswered peer does
/// not catch one that keeps reading: the pages stayed for as long as the peer trickled.
#[tokio::test]
async fn a_decode_peer_reading_below_the_floor_cannot_hold_prefills_pages() {
    bounded(async {
        let prefill = Worker::start(&[
            "--role",
            "prefill",
            "--kv-tokens",
            "4096",
            "--kv-peer-timeout-ms",
            "1000",
        ]);
        // 64 KiB every quarter of a second: the window opens again and again, the 23 MB of KV
        // would take a minute and a half.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("binds");
        let kv_address = listener.local_addr().expect("its address").to_string();
        let _trickle = tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 << 10];
                    loop {
                        match tokio::io::AsyncReadExt::read(&mut socket, &mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(_) => tokio::time::sleep(Duration::from_millis(250)).await,
                        }
                    }
                });
            }
        });
        let mut pc = prefill.client().await;
        let request = large_prefill(&mut pc, kv_address).await;
        let mut call = pc.prefill(request).await.expect("called").into_inner();
        wait_metrics(&prefill, "the send", |m| metric(m, SENDING) == 1.0).await;
        let sending = Instant::now();
        while metric(&prefill.metrics(), SENDING) > 0.0 {
            assert!(
                sending.elapsed() < Duration::from_secs(20),
                "a peer under the floor still holds the send"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let p = wait_all_pages_back(&prefill).await;
        assert_eq!(available(&p), p.total, "{p:?}");
        // The call, still open, hears that the transfer failed.
        let failed = loop {
            match call.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => panic!("the call ended without a word"),
                Err(status) => break status,
            }
        };
        assert_eq!(failed.code(), tonic::Code::Unavailable, "{failed:?}");
    })
    .await;
}

#[tokio::test]
async fn a_decode_peer_that_stops_reading_and_hangs_up_gets_no_hold_on_prefills_pages_and_an_acknowledgement()
 {
    bounded(async {
        let prefill = Worker::start(&["--role", "prefill", "--kv-tokens", "4096"]);
        // A data-plane peer that accepts and never reads: prefill's writes block once the
        // socket buffers are full (the prompt's KV is tens of megabytes).
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("binds");
        let kv_address = listener.local_addr().expect("its address").to_string();
        // The first connection is held unread; what any later one carries is read whole.
        let (later, mut acknowledged) = tokio::sync::mpsc::unbounded_channel::<Vec<u8>>();
        let _unread = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((mut socket, _)) = listener.accept().await {
                if held.is_empty() {
                    held.push(socket);
                    continue;
                }
                let later = later.clone();
                tokio::spawn(async move {
                    let mut bytes = Vec::new();
                    let _ = tokio::io::AsyncReadExt::read_to_end(&mut socket, &mut bytes).await;
                    let _ = later.send(bytes);
                });
            }
        });
        let mut pc = prefill.client().await;
        let request = large_prefill(&mut pc, kv_address).await;
        let mut call = pc.prefill(request).await.expect("called").into_inner();
        let first = call.message().await.expect("an answer");
        assert!(
            matches!(first.and_then(|e| e.event), Some(PrefillItem::Accepted(_))),
            "prefill admits the prompt"
        );
        wait_metrics(&prefill, "the send", |m| metric(m, SENDING) == 1.0).await;
        // Let the writes fill the buffers and block, then hang up as decode does at its
        // transfer deadline.
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(
            metric(&prefill.metrics(), SENDING),
            1.0,
            "the send is blocked"
        );
        drop(call);
        wait_metrics(&prefill, "the blocked send to end", |m| {
            metric(m, SENDING) == 0.0
        })
        .await;
        let p = wait_all_pages_back(&prefill).await;
        assert_eq!(available(&p), p.total, "{p:?}");
        // No whole frame of the session reached decode, so the connection's end is no
        // teardown of it: prefill acknowledges the abort on a connection of its own, naming
        // the session. Without it, decode waited out its release timeout and quarantined the
        // pages of a healthy pair (a client leaving at the wrong moment).
        let ack = tokio::time::timeout(Duration::from_secs(10), acknowledged.recv())
            .await
            .expect("an acknowledgement within 10 s")
            .expect("the listener runs");
        assert!(ack.windows(16).any(|w| w == [7; 16]), "{ack:?}");
    })
    .await;
}

/// Lowers the soft limit on `pid`'s open descriptors to its open ones plus `spare`.
fn limit_descriptors(pid: u32, spare: u64) {
    let open = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("the worker's descriptors")
        .count() as u64;
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a null new limit only reads the old one into `old`, which lives across the call.
    let read = unsafe {
        libc::prlimit(
            pid as libc::pid_t,
            libc::RLIMIT_NOFILE,
            std::ptr::null(),
            &mut old,
        )
    };
    assert_eq!(read, 0, "reading the worker's limit");
    let new = libc::rlimit {
        rlim_cur: open + spare,
        rlim_max: old.rlim_max,
    };
    // SAFETY: `new` lives across the call; a null old limit is not written.
    let set = unsafe {
        libc::prlimit(
            pid as libc::pid_t,
            libc::RLIMIT_NOFILE,
            &new,
            std::ptr::null_mut(),
        )
    };
    assert_eq!(set, 0, "lowering the worker's limit");
}

#[tokio::test]
async fn peers_that_exhaust_the_decode_workers_descriptors_do_not_stop_it() {
    bounded(async {
        // Nothing is ever sent to this prefill address: no request is made.
        let mut decode = Worker::start(&[
            "--role",
            "decode",
            "--prefill",
            "http://127.0.0.1:9",
            "--kv-listen",
            "127.0.0.1:0",
            "--kv-tokens",
            "2048",
        ]);
        let kv = decode.kv.expect("a decode worker listens for KV");
        limit_descriptors(decode.child.id(), 8);
        // Far more idle connections than descriptors left: its accepts fail (EMFILE) for a
        // while, with connections still queued behind them.
        let mut idle = Vec::new();
        for _ in 0..64 {
            idle.push(tokio::net::TcpStream::connect(kv).await.expect("connects"));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            decode
                .child
                .try_wait()
                .expect("the worker's status")
                .is_none(),
            "the decode worker exited; stderr:\n{}",
            text_of(&decode.stderr)
        );
        assert!(
            text_of(&decode.stderr).contains("accepting a KV data connection failed"),
            "the limit was reached; stderr:\n{}",
            text_of(&decode.stderr)
        );
        // The peers leave: their descriptors come back, and the worker serves as before —
        // its control port, and its data port (a connection that sends garbage is taken and
        // closed, not left waiting in the queue).
        drop(idle);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let mut s = tokio::net::TcpStream::connect(kv).await.expect("connects");
            tokio::io::AsyncWriteExt::write_all(&mut s, &[0xff; 64])
                .await
                .expect("writes");
            let mut buf = [0u8; 8];
            let read = tokio::time::timeout(
                Duration::from_secs(2),
                tokio::io::AsyncReadExt::read(&mut s, &mut buf),
            )
            .await;
            if matches!(read, Ok(Ok(0)) | Ok(Err(_))) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the KV port never took a connection again; stderr:\n{}",
                text_of(&decode.stderr)
            );
        }
        let h = health(&mut decode.client().await).await;
        assert!(pool(&h).total > 0, "{h:?}");
        assert!(decode.child.try_wait().expect("status").is_none());
    })
    .await;
}

/// A `Prefill` call's labels are bounded as `Generate`'s are: they go into spans, logs and the
/// prefix cache's scope, so a peer's megabyte-long tenant is refused, and nothing allocated. So
/// is a call from a decode worker of another model (a prefill worker replaced behind its
/// address by one of another model, its KV the same shape): decode would commit the KV as its
/// own model's and answer wrongly.
#[tokio::test]
async fn a_prefill_call_with_a_bad_label_address_or_model_is_refused_before_anything_is_allocated()
{
    bounded(async {
        let prefill = Worker::start(&["--role", "prefill", "--kv-tokens", "2048"]);
        let mut pc = prefill.client().await;
        let before = pool(&health(&mut pc).await);
        let model_id = pc
            .info(InfoRequest::default())
            .await
            .expect("info")
            .into_inner()
            .model_id;
        let call = |request_id: String, tenant: String| proto::PrefillRequest {
            request_id,
            tenant,
            prompt: vec![100, 101, 102],
            sampling: None,
            reservation: Some(proto::KvReservation {
                nonce: vec![7; 16],
                pages: vec![proto::ReservedPage { page: 0, tag: 1 }],
                prompt_tokens: 3,
                cached_tokens: 0,
                page_tokens: 16,
                token_bytes: 1,
            }),
            kv_address: "127.0.0.1:9".into(),
            cache_salt: String::new(),
            model_id: model_id.clone(),
        };
        let long = "t".repeat(bulkhead_worker::serve::MAX_LABEL_BYTES + 1);
        for (field, request) in [
            ("tenant", call("r".into(), long.clone())),
            ("request_id", call(long.clone(), "tenant-a".into())),
        ] {
            let e = pc.prefill(request).await.expect_err("refused");
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
            assert!(e.message().contains(field), "{e:?}");
        }
        // The data plane decode names is an address and port: a host name would be resolved
        // and dialled, and text would be logged as it is (a line of the caller's own).
        for address in ["x\nFORGED 127.0.0.1:9", "localhost:9", "127.0.0.1"] {
            let mut request = call("r".into(), "tenant-a".into());
            request.kv_address = address.into();
            let e = pc.prefill(request).await.expect_err(address);
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{address}: {e:?}");
            assert!(e.message().contains("kv_address"), "{e:?}");
        }
        // Naming none skips nothing.
        for (other, said) in [("another-model", "another-model"), ("", "(none named)")] {
            let mut request = call("r".into(), "tenant-a".into());
            request.model_id = other.into();
            let e = pc.prefill(request).await.expect_err("another model");
            assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{other}: {e:?}");
            assert!(e.message().contains(said), "{e:?}");
        }
        assert_eq!(pool(&health(&mut pc).await), before);
    })
    .await;
}

/// A prefill peer that sends a transfer's KV — valid, every frame and the manifest — and then
/// answers its call as `answers` says.
struct StandInPrefill {
    answers: Answers,
}

/// How a [`StandInPrefill`] answers its call.
#[derive(Clone, Copy)]
enum Answers {
    Never,
    /// Accepted, then sent, saying that this many of the prompt's tokens came from its cache.
    Sent(u32),
    /// Accepted, then failed with this error code (it sends no KV).
    Fails(&'static str),
    /// Refused at its admission (a full queue), once its KV was sent and decode had the time
    /// to decode from it.
    RefusesAfterSending,
}

type Items<T> =
    std::pin::Pin<Box<dyn futures_util::Stream<Item = Result<T, tonic::Status>> + Send + 'static>>;

#[tonic::async_trait]
impl proto::Worker for StandInPrefill {
    type GenerateStream = Items<proto::GenerateResponse>;
    type PrefillStream = Items<proto::PrefillEvent>;

    async fn generate(
        &self,
        _: tonic::Request<proto::GenerateRequest>,
    ) -> Result<tonic::Response<Self::GenerateStream>, tonic::Status> {
        Err(tonic::Status::unimplemented("a prefill stand-in"))
    }

    async fn info(
        &self,
        _: tonic::Request<InfoRequest>,
    ) -> Result<tonic::Response<proto::InfoResponse>, tonic::Status> {
        Ok(tonic::Response::new(proto::InfoResponse {
            instance_id: "stand-in".into(),
            ..proto::InfoResponse::default()
        }))
    }

    async fn health(
        &self,
        _: tonic::Request<proto::HealthRequest>,
    ) -> Result<tonic::Response<proto::HealthResponse>, tonic::Status> {
        Ok(tonic::Response::new(proto::HealthResponse::default()))
    }

    async fn prefill(
        &self,
        request: tonic::Request<proto::PrefillRequest>,
    ) -> Result<tonic::Response<Self::PrefillStream>, tonic::Status> {
        use bulkhead_handoff::{Frame, Manifest, SessionNonce};
        use futures_util::StreamExt as _;
        let r = request.into_inner();
        let t = r.reservation.expect("decode names its reservation");
        let nonce = SessionNonce(t.nonce.as_slice().try_into().expect("a 16-byte nonce"));
        let frames: Vec<Frame> = (t.pages.iter().enumerate())
            .map(|(i, page)| {
                let start = i as u32 * t.page_tokens + t.cached_tokens;
                let end = (start + t.page_tokens).min(t.prompt_tokens);
                let bytes = vec![0; ((end - start) * t.token_bytes) as usize];
                let tag = bulkhead_kvpool::Tag::new(page.tag);
                Frame::new(nonce, i as u32, tag, start..end, bytes)
            })
            .collect();
        let manifest = Manifest::new(
            nonce,
            t.prompt_tokens,
            1,
            frames.iter().map(|f| f.header.checksum),
        );
        let sending = async move {
            bulkhead_worker::serve::kvplane::send(
                &r.kv_address,
                &frames,
                &manifest,
                1 << 20,
                || false,
            )
            .await
        };
        let event = |event| Ok(proto::PrefillEvent { event: Some(event) });
        let accepted = event(PrefillItem::Accepted(proto::PrefillAccepted {
            instance_id: "stand-in".into(),
        }));
        let cached_tokens = match self.answers {
            Answers::Sent(cached_tokens) => cached_tokens,
            Answers::Never => {
                tokio::spawn(async move {
                    let sent = sending.await;
                    assert!(sent.is_ok(), "{sent:?}");
                });
                return Ok(tonic::Response::new(Box::pin(
                    futures_util::stream::pending(),
                )));
            }
            Answers::RefusesAfterSending => {
                let refused = async move {
                    let sent = sending.await;
                    assert!(sent.is_ok(), "{sent:?}");
                    // Time for decode to verify the KV and decode its first token, on a
                    // loaded machine; within decode's wait for the answer (5 s).
                    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
                    event(PrefillItem::Rejected(proto::Refusal {
                        reason: proto::RefusalReason::RefusalQueueFull.into(),
                        ..proto::Refusal::default()
                    }))
                };
                let items =
                    futures_util::stream::once(refused).chain(futures_util::stream::pending());
                return Ok(tonic::Response::new(Box::pin(items)));
            }
            Answers::Fails(code) => {
                let failed = proto::error_code_status(
                    tonic::Code::Internal,
                    "the stand-in fails".to_owned(),
                    code,
                );
                let items = futures_util::stream::iter([accepted, Err(failed)]);
                return Ok(tonic::Response::new(Box::pin(items)));
            }
        };
        let sent = async move {
            let sent = sending.await.expect("sent");
            let bulkhead_worker::serve::kvplane::Sent::Complete { frames, bytes } = sent else {
                panic!("{sent:?}");
            };
            event(PrefillItem::Sent(proto::PrefillSent {
                frames,
                bytes,
                cached_tokens,
            }))
        };
        let items = futures_util::stream::once(async { accepted })
            .chain(futures_util::stream::once(sent))
            .chain(futures_util::stream::pending());
        Ok(tonic::Response::new(Box::pin(items)))
    }
}

/// A decode worker whose prefill peer is a [`StandInPrefill`] answering as `answers` says (the
/// stand-in's server task, to hold).
async fn decode_with_a_stand_in(answers: Answers) -> (Worker, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("binds");
    let address = format!("http://{}", listener.local_addr().expect("its address"));
    let serving = tokio::spawn(async move {
        let served = tonic::transport::Server::builder()
            .add_service(proto::WorkerServer::new(StandInPrefill { answers }))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
            .await;
        assert!(served.is_ok(), "{served:?}");
    });
    (decode_at(&address, &["--kv-tokens", "2048"]), serving)
}

/// A prefill peer that says it read far more of the prompt from its cache than the prompt has
/// is believed up to the prompt: the count goes into the client's usage and the tenant's
/// metering.
#[tokio::test]
async fn a_prefill_peers_cached_token_count_is_believed_up_to_the_prompt() {
    bounded(async {
        let (decode, _prefill) = decode_with_a_stand_in(Answers::Sent(1_000_000)).await;
        let mut client = decode.client().await;
        let mut stream = client
            .generate(chat("Hi", 4))
            .await
            .expect("admitted")
            .into_inner();
        let done = loop {
            match stream.message().await.expect("a clean stream") {
                Some(proto::GenerateResponse {
                    item: Some(proto::Item::Done(done)),
                }) => break done,
                Some(_) => {}
                None => panic!("the stream ended without Done"),
            }
        };
        assert!(done.prompt_tokens > 0, "{done:?}");
        assert_eq!(done.cached_tokens, done.prompt_tokens, "{done:?}");
    })
    .await;
}

/// A prefill peer that refuses a request at its admission after it sent the request's KV, and
/// decode decoded from it, contradicts itself: the request fails as a prefill failure (503,
/// the fault prefill's), not as the admission's refusal it says (a 429 a client would retry
/// for a request already generating), and decode's pages all come back.
#[tokio::test]
async fn a_prefill_peer_that_refuses_a_request_after_sending_its_kv_fails_it() {
    bounded(async {
        let (decode, _prefill) = decode_with_a_stand_in(Answers::RefusesAfterSending).await;
        let mut client = decode.client().await;
        let err = run_to_end(&mut client, chat("Hi", 64))
            .await
            .expect_err("prefill contradicted itself");
        assert_eq!(error_code(&err), Some("service_unavailable"), "{err:?}");
        assert!(proto::prefill_at_fault(&err), "{err:?}");
        let p = wait_all_pages_back(&decode).await;
        assert_eq!(available(&p), p.total, "{p:?}");
    })
    .await;
}

/// A prefill peer that fails a transfer and says why — its KV failed its integrity check, or
/// its answer broke — fails the request so at decode, not as a prefill outage a client would
/// retry (503 `service_unavailable`); decode's pages all come back.
#[tokio::test]
async fn a_prefill_peers_failure_that_says_why_is_the_requests() {
    bounded(async {
        for code in ["kv_integrity_error", "internal_error"] {
            let (decode, _prefill) = decode_with_a_stand_in(Answers::Fails(code)).await;
            let mut client = decode.client().await;
            let err = run_to_end(&mut client, chat("Hi", 4))
                .await
                .expect_err("prefill failed");
            assert_eq!(error_code(&err), Some(code), "{err:?}");
            assert_eq!(err.code(), tonic::Code::Internal, "{err:?}");
            let p = wait_all_pages_back(&decode).await;
            assert_eq!(available(&p), p.total, "{p:?}");
        }
    })
    .await;
}

/// A prefill peer that sent the KV (decode verified it and generates) and never answers its
/// call: the request fails (`service_unavailable`) within a few seconds. It waited for that
/// answer without end, after the KV had made the wait's other end (the transfer deadline) moot.
#[tokio::test]
async fn a_prefill_peer_that_sends_the_kv_and_never_answers_its_call_does_not_hold_the_request() {
    bounded(async {
        let (decode, _prefill) = decode_with_a_stand_in(Answers::Never).await;
        let mut client = decode.client().await;
        let started = Instant::now();
        let answered = tokio::time::timeout(
            Duration::from_secs(30),
            run_to_end(&mut client, chat("Hi", 4)),
        )
        .await
        .expect("the request ends");
        let err = answered.expect_err("prefill never answered");
        assert_eq!(error_code(&err), Some("service_unavailable"), "{err:?}");
        // Ended by the wait for the answer (5 s), not at once by something else.
        let took = started.elapsed();
        assert!(
            took > Duration::from_secs(4) && took < Duration::from_secs(20),
            "{took:?}"
        );
        // The KV did arrive and pass: the wait was for the call alone.
        let m = decode.metrics();
        assert!(metric(&m, "bulkhead_kv_frames_written_total") >= 1.0, "{m}");
        assert_eq!(
            metric(&m, "bulkhead_kv_integrity_failures_total"),
            0.0,
            "{m}"
        );
    })
    .await;
}
