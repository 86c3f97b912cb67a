//! `bulkhead bench transfer`: the KV handoff over loopback TCP, side by side in one run with a
//! raw socket copy of the same bytes (the limit), with the integrity checks (checksums,
//! coverage, tags) on and off; and time to first token disaggregated against colocated.
//!
//! The same transfer over mutual TLS (`--tls-*`, as between hosts) is timed beside it.
//!
//! The handoff runs the worker's own data plane (`kvplane::send_on` / `kvplane::receive`) and
//! decode's own frame path (`write_frame`: `Inbound::accept`, then one copy into the page) on
//! a thread standing in for the engine thread. Two scopes are timed:
//! - `transfer`: from frames ready on prefill (as `Outbound` holds them after the hand-over)
//!   to every page written and the manifest verified on decode — what the raw copy compares
//!   with;
//! - `handoff`: the same plus reading the pages out of prefill's pool and checksumming them
//!   (the hand-over itself), which is what this bench timed before the data-plane rewrite.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Mutex, mpsc};
use std::thread;
use std::time::Instant;

use anyhow::{Context, bail};
use bulkhead_handoff::{
    CloseReason, Frame, FrameHeader, Inbound, Manifest, Received, Reservation, SessionNonce,
    frame_checksum,
};
use bulkhead_kvpool::{PageId, PageRef, RequestId, Tag};
use bulkhead_worker::engine::{
    Engine, EngineConfig, Event, KvBudget, Request, Written, write_frame,
};
use bulkhead_worker::kv::KvMemory;
use bulkhead_worker::loader::LoadedModel;
use bulkhead_worker::sampling::SamplingParams;
use bulkhead_worker::serve::ClusterTls;
use bulkhead_worker::serve::kvplane::{self, Buffers, Deliver, Lease};
use bulkhead_worker::serve::tls::Authority;
use serde_json::json;
use tokio::runtime::Runtime;

use super::engine::TEXT;
use super::median;
use crate::model_path::ModelArgs;

#[derive(Debug, clap::Args)]
pub struct TransferArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Pages per throughput run (each page is the model's page size).
    #[arg(long, default_value_t = 256)]
    pages: usize,
    /// Bytes per write on the sending side (at least one page: the handoff writes whole
    /// frames, and the raw copy it is compared with writes the same batches).
    #[arg(long, default_value_t = 4 << 20)]
    batch_bytes: usize,
    /// Prompt lengths for the time-to-first-token comparison (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "128,512,2048")]
    ttft_prompts: Vec<usize>,
    /// Repetitions; the medians are reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
}

/// What a throughput run includes besides the data plane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Scope {
    /// Checksums on the sender, `Inbound` on the receiver (the receive path's checksum runs
    /// either way: the data plane has no switch to skip it).
    checks: bool,
    /// Reading the pages out and building the frames is timed too.
    readout: bool,
    /// The data connection is mutual TLS (`--tls-*`), as between hosts.
    tls: bool,
}

pub fn run(args: TransferArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.runs > 0 && args.pages > 0,
        "--runs and --pages must be at least 1"
    );
    anyhow::ensure!(
        args.model.device == bulkhead_kernels::DeviceSpec::Cpu,
        "bench transfer measures the CPU data path only; use --device cpu"
    );
    let threads = args.model.init_threads()?;
    let path = args.model.path()?;
    let loaded = LoadedModel::open(&path)?;
    let layout = loaded
        .model
        .kv_layout(bulkhead_kvpool::DEFAULT_PAGE_TOKENS.get() as usize);
    anyhow::ensure!(
        args.batch_bytes >= layout.page_bytes(),
        "--batch-bytes must be at least one page of this model's KV ({} bytes): the handoff \
         writes whole frames",
        layout.page_bytes()
    );
    let payload = Payload::new(layout, args.pages);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;

    let scope = |checks, readout, tls| Scope {
        checks,
        readout,
        tls,
    };
    let scopes = [
        scope(true, false, false),
        scope(false, false, false),
        scope(true, true, false),
        scope(false, true, false),
        scope(true, false, true),
    ];
    // Both ends of the TLS scope: a fresh CA and a certificate for 127.0.0.1, as `bulkhead up
    // --tls` makes them.
    let tls = Authority::new("bench CA")?.cluster_tls(&["127.0.0.1"])?;
    let mut raw = Vec::new();
    let mut runs: Vec<Vec<f64>> = vec![Vec::new(); scopes.len()];
    let mut hash = Vec::new();
    for _ in 0..args.runs {
        raw.push(payload.raw_copy(args.batch_bytes)?);
        for (scope, out) in scopes.iter().zip(&mut runs) {
            let tls = scope.tls.then_some(&tls);
            out.push(payload.handoff(&rt, args.batch_bytes, *scope, tls)?);
        }
        hash.push(payload.checksum_rate());
    }
    let raw = median(raw);
    let [t_on, t_off, h_on, h_off, t_tls] = [0, 1, 2, 3, 4].map(|i| median(runs[i].clone()));

    let ttft = Ttft::new(loaded, &path)?;
    let mut ttft_rows = Vec::new();
    for &n in &args.ttft_prompts {
        let (mut colocated, mut split) = (Vec::new(), Vec::new());
        for _ in 0..args.runs {
            colocated.push(ttft.colocated(n)?);
            split.push(ttft.disaggregated(&rt, n, args.batch_bytes)?);
        }
        let (c, d) = (median(colocated), median(split));
        ttft_rows.push(json!({"prompt_tokens": n, "colocated_ms": c * 1e3, "disaggregated_ms": d * 1e3, "ratio": d / c}));
    }

    let report = json!({
        "model": path.display().to_string(),
        "threads": threads,
        "runs": args.runs,
        "page_bytes": layout.page_bytes(),
        "pages": args.pages,
        "raw_tcp_gb_s": raw / 1e9,
        "transfer_checks_on_gb_s": t_on / 1e9,
        "transfer_checks_off_gb_s": t_off / 1e9,
        "transfer_on_vs_raw": t_on / raw,
        "transfer_tls_gb_s": t_tls / 1e9,
        "tls_vs_plain": t_tls / t_on,
        "handoff_checks_on_gb_s": h_on / 1e9,
        "handoff_checks_off_gb_s": h_off / 1e9,
        "on_vs_raw": h_on / raw,
        "integrity_cost": 1.0 - h_on / h_off,
        "checksum_gb_s": median(hash) / 1e9,
        "ttft": ttft_rows,
    });
    println!("{report}");
    Ok(())
}

/// `pages` pages of KV in a source pool.
struct Payload {
    layout: bulkhead_kernels::attention::KvLayout,
    source: KvMemory,
    pages: usize,
    /// The receive path's frame buffers, kept across runs as a worker keeps them across
    /// connections.
    buffers: Buffers,
}

/// A stand-in for decode's engine thread: messages (with their leases on the receive budget)
/// go over a channel to a thread that owns the destination pool, as `Command::Deliver` does.
struct ToThread(mpsc::Sender<Option<(Received, Lease)>>);

impl Deliver for ToThread {
    fn deliver(&self, message: Received, _buffers: &Buffers, lease: Lease) {
        let _ = self.0.send(Some((message, lease)));
    }

    fn transport_closed(&self, _nonces: Vec<bulkhead_handoff::SessionNonce>) {
        let _ = self.0.send(None);
    }

    fn receiving(&self, _nonce: bulkhead_handoff::SessionNonce) -> bool {
        true
    }
}

impl Payload {
    fn new(layout: bulkhead_kernels::attention::KvLayout, pages: usize) -> Payload {
        let mut source = KvMemory::new(layout, pages);
        // `KvMemory::new` is host memory, so this fills every value.
        for (i, v) in source.host_mut().into_iter().flatten().enumerate() {
            *v = half::f16::from_f32((i % 251) as f32 / 251.0);
        }
        Payload {
            layout,
            source,
            pages,
            buffers: Buffers::default(),
        }
    }

    fn total_bytes(&self) -> usize {
        self.pages * self.layout.page_bytes()
    }

    /// Bytes per second of a plain socket copy of the same volume into a page buffer.
    fn raw_copy(&self, batch: usize) -> anyhow::Result<f64> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let total = self.total_bytes();
        let page = self.layout.page_bytes();
        let bytes: Vec<u8> = self
            .source
            .host()
            .unwrap_or_default()
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let start = Instant::now();
        let reader = thread::spawn(move || -> std::io::Result<()> {
            let (mut s, _) = listener.accept()?;
            let mut sink = vec![0u8; page];
            let mut left = total;
            while left > 0 {
                let n = s.read(&mut sink[..page.min(left)])?;
                if n == 0 {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
                left -= n;
            }
            Ok(())
        });
        let mut s = TcpStream::connect(addr)?;
        s.set_nodelay(true)?;
        for chunk in bytes.chunks(batch) {
            s.write_all(chunk)?;
        }
        drop(s);
        reader
            .join()
            .map_err(|_| anyhow::anyhow!("reader panicked"))??;
        Ok(total as f64 / start.elapsed().as_secs_f64())
    }

    /// Bytes per second of the frame checksum alone, over every page once.
    fn checksum_rate(&self) -> f64 {
        let nonce = SessionNonce([1; 16]);
        let start = Instant::now();
        let mut acc = 0u64;
        for i in 0..self.pages as u32 {
            let bytes = self
                .source
                .page_bytes(PageId::new(i))
                .expect("the benchmark's pool is in host memory");
            acc ^= frame_checksum(&nonce, i, Tag::new(1), &(0..1), bytes);
        }
        std::hint::black_box(acc);
        self.total_bytes() as f64 / start.elapsed().as_secs_f64()
    }

    /// The reservation of every page, as decode would name it.
    fn target(&self) -> Reservation {
        let pt = self.layout.page_tokens as u32;
        Reservation {
            nonce: SessionNonce(rand::random()),
            pages: (0..self.pages as u32)
                .map(|i| PageRef {
                    page: PageId::new(i),
                    tag: Tag::new(u64::from(i) + 1),
                })
                .collect(),
            prompt_tokens: self.pages as u32 * pt,
            cached_tokens: 0,
            page_tokens: pt,
            token_bytes: self.layout.token_bytes() as u32,
        }
    }

    /// Prefill's hand-over: every page read out of the pool into a frame for `target`, and
    /// the manifest.
    fn read_out(
        &self,
        target: &Reservation,
        checks: bool,
    ) -> anyhow::Result<(Vec<Frame>, Manifest)> {
        let pt = target.page_tokens;
        let mut frames = Vec::with_capacity(target.pages.len());
        for (i, r) in target.pages.iter().enumerate() {
            let bytes = self.source.read_slots(r.page, 0..pt as usize)?;
            let tokens = i as u32 * pt..(i as u32 + 1) * pt;
            frames.push(if checks {
                Frame::new(target.nonce, i as u32, r.tag, tokens, bytes)
            } else {
                Frame {
                    header: FrameHeader {
                        nonce: target.nonce,
                        index: i as u32,
                        tag: r.tag,
                        tokens,
                        checksum: 0,
                    },
                    bytes,
                }
            });
        }
        let manifest = Manifest::new(
            target.nonce,
            target.prompt_tokens,
            0,
            frames.iter().map(|f| f.header.checksum),
        );
        Ok((frames, manifest))
    }

    /// Bytes per second of the handoff in `scope` through the worker's data plane (over `tls`
    /// when given).
    fn handoff(
        &self,
        rt: &Runtime,
        batch: usize,
        scope: Scope,
        tls: Option<&ClusterTls>,
    ) -> anyhow::Result<f64> {
        let target = self.target();
        let mut ready = if scope.readout {
            None
        } else {
            Some(self.read_out(&target, scope.checks)?)
        };
        let (tx, rx) = mpsc::channel();
        // Decode's pool is long-lived in a worker: its memory is in place before a transfer.
        let mut dest = KvMemory::new(self.layout, self.pages);
        dest.host_mut()
            .expect("the benchmark's pool is in host memory")
            .fill(half::f16::ZERO);
        let decode = {
            let (t, buffers) = (target.clone(), self.buffers.clone());
            thread::spawn(move || decode_thread(dest, t, scope.checks, rx, &buffers))
        };
        let start = Instant::now();
        let (frames, manifest) = match ready.take() {
            Some(r) => r,
            None => self.read_out(&target, scope.checks)?,
        };
        rt.block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            let addr = listener.local_addr()?;
            let to = ToThread(tx);
            let buffers = self.buffers.clone();
            let server_tls = tls.cloned();
            let receiver = tokio::spawn(async move {
                let (socket, _) = listener.accept().await?;
                let limit = kvplane::DEFAULT_PEER_TIMEOUT;
                let socket = kvplane::accepted(socket, server_tls.as_ref(), limit).await?;
                kvplane::receive(socket, &to, &buffers, None).await
            });
            let options = kvplane::SendOptions {
                batch_bytes: batch,
                peer_timeout: kvplane::DEFAULT_PEER_TIMEOUT,
                floor_bytes_per_s: kvplane::DEFAULT_FLOOR_BYTES_PER_S,
                fault: None,
                tls: tls.cloned(),
            };
            let mut socket = kvplane::connect(&addr.to_string(), &options).await?;
            kvplane::send_on(&mut socket, &frames, &manifest, batch, || false).await?;
            receiver.await??;
            anyhow::Ok(())
        })?;
        decode
            .join()
            .map_err(|_| anyhow::anyhow!("decode thread panicked"))??;
        Ok(self.total_bytes() as f64 / start.elapsed().as_secs_f64())
    }
}

/// Decode's side: frames through `write_frame` (checks on) or straight into their pages.
fn decode_thread(
    mut dest: KvMemory,
    t: Reservation,
    checks: bool,
    rx: mpsc::Receiver<Option<(Received, Lease)>>,
    buffers: &Buffers,
) -> anyhow::Result<()> {
    let mut inbound = Inbound::new(t.clone());
    let live = |p: PageId| t.pages.get(p.index()).map(|r| r.tag);
    let pt = t.page_tokens as usize;
    let mut written = Written::new(dest.pages(), pt);
    // Each message's lease is dropped once it is dealt with, as on the engine thread.
    while let Ok(Some((m, _lease))) = rx.recv() {
        match m {
            Received::Frame(f) if checks => {
                write_frame(&mut inbound, &mut dest, &mut written, &f, live)?;
                buffers.give(f.into_bytes());
            }
            Received::Frame(f) => {
                let page = t
                    .pages
                    .get(f.header().index as usize)
                    .context("frame index")?
                    .page;
                dest.write_slots(page, 0..pt, f.bytes())?;
                buffers.give(f.into_bytes());
            }
            Received::Manifest(m) if checks => {
                inbound
                    .finish(&m, live)
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
            }
            Received::Manifest(_) => {}
            Received::Closed { reason, .. } => {
                anyhow::ensure!(reason == CloseReason::Complete, "closed: {reason:?}");
                return Ok(());
            }
        }
    }
    bail!("connection closed before the transfer ended")
}

/// Time to first token: one engine colocated, or a prefill engine and a decode engine joined
/// by the handoff over loopback TCP.
struct Ttft {
    colocated: std::cell::RefCell<Engine>,
    prefill: std::cell::RefCell<Engine>,
    decode: std::cell::RefCell<Engine>,
    text: Vec<u32>,
}

impl Ttft {
    fn new(loaded: LoadedModel, path: &std::path::Path) -> anyhow::Result<Ttft> {
        let text = loaded.tokenizer.encode(&TEXT.repeat(80), false)?;
        let config = EngineConfig {
            kv: KvBudget::Tokens(8192),
            max_batch_tokens: 512,
            ..EngineConfig::default()
        };
        let open = || -> anyhow::Result<Engine> {
            let l = LoadedModel::open(path)?;
            Ok(Engine::new(l.model, l.tokenizer, config.clone())?)
        };
        Ok(Ttft {
            colocated: Engine::new(loaded.model, loaded.tokenizer, config.clone())?.into(),
            prefill: open()?.into(),
            decode: open()?.into(),
            text,
        })
    }

    fn prompt(&self, n: usize) -> anyhow::Result<&[u32]> {
        self.text
            .get(..n)
            .context("benchmark text too short for the prompt length")
    }

    fn request(prompt: &[u32], tx: mpsc::Sender<Event>) -> Request {
        Request {
            id: RequestId::new(rand::random::<u64>() >> 1),
            tenant: bulkhead_kvpool::Scope::new("bench"),
            prompt: prompt.to_vec(),
            max_new_tokens: 1,
            sampling: SamplingParams::GREEDY,
            stop: Vec::new(),
            ignore_eos: true,
            sink: Box::new(tx),
        }
    }

    fn colocated(&self, n: usize) -> anyhow::Result<f64> {
        let mut e = self.colocated.borrow_mut();
        let (tx, rx) = mpsc::channel();
        let start = Instant::now();
        e.submit(Self::request(self.prompt(n)?, tx))
            .map_err(|(e, _)| e)?;
        first_token(&mut e, &rx)?;
        Ok(start.elapsed().as_secs_f64())
    }

    fn disaggregated(&self, rt: &Runtime, n: usize, batch: usize) -> anyhow::Result<f64> {
        let prompt = self.prompt(n)?;
        let (mut d, mut p) = (self.decode.borrow_mut(), self.prefill.borrow_mut());
        let (dtx, drx) = mpsc::channel();
        let start = Instant::now();
        d.submit_decode(Self::request(prompt, dtx))
            .map_err(|(e, _)| e)?;
        d.step();
        let Ok(Event::Reserved(target)) = drx.try_recv() else {
            bail!("decode did not reserve")
        };
        let (ptx, prx) = mpsc::channel();
        p.submit_prefill(Self::request(prompt, ptx), target)
            .map_err(|(e, _)| e)?;
        while p.has_work() {
            p.step();
        }
        let Ok(Event::Prefilled(outbound)) = prx.try_recv() else {
            bail!("prefill did not hand over")
        };
        for m in over_loopback(rt, &outbound.frames, &outbound.manifest, batch)? {
            let _ = d.deliver(m);
        }
        outbound.close();
        first_token(&mut d, &drx)?;
        Ok(start.elapsed().as_secs_f64())
    }
}

/// Collects what decode's receive path hands over.
#[derive(Default)]
struct Collect(Mutex<Vec<Received>>);

impl Deliver for Collect {
    fn deliver(&self, message: Received, _buffers: &Buffers, _lease: Lease) {
        if let Ok(mut v) = self.0.lock() {
            v.push(message);
        }
    }

    fn transport_closed(&self, _nonces: Vec<SessionNonce>) {}

    fn receiving(&self, _nonce: SessionNonce) -> bool {
        true
    }
}

/// Sends a transfer through a loopback socket with the worker's data plane and returns the
/// messages as decode's receive path hands them to the engine.
fn over_loopback(
    rt: &Runtime,
    frames: &[Frame],
    manifest: &Manifest,
    batch: usize,
) -> anyhow::Result<Vec<Received>> {
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let receiver = tokio::spawn(async move {
            let (socket, _) = listener.accept().await?;
            let got = Collect::default();
            kvplane::receive(socket, &got, &Buffers::default(), None).await?;
            anyhow::Ok(
                got.0
                    .into_inner()
                    .map_err(|_| anyhow::anyhow!("poisoned"))?,
            )
        });
        kvplane::send(&addr.to_string(), frames, manifest, batch, || false).await?;
        receiver.await?
    })
}

/// Steps `engine` until the request on `rx` produced its first token.
fn first_token(engine: &mut Engine, rx: &mpsc::Receiver<Event>) -> anyhow::Result<()> {
    loop {
        engine.step();
        for e in rx.try_iter() {
            match e {
                Event::Token { .. } => {
                    while engine.has_work() {
                        engine.step();
                    }
                    return Ok(());
                }
                Event::Failed(f) => bail!("benchmark request failed: {f}"),
                _ => {}
            }
        }
    }
}
