//! `bulkhead bench transfer`: the KV handoff over loopback TCP, side by side in one run with a
//! raw socket copy of the same bytes (the limit), with the integrity checks (checksums,
//! coverage, tags) on and off; and time to first token disaggregated against colocated.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc;
use std::thread;
use std::time::Instant;

use anyhow::{Context, bail};
use bulkhead_handoff::codec::{decode, encode, encode_frame};
use bulkhead_handoff::{
    CloseReason, Frame, FrameHeader, Inbound, Message, Reservation, SessionNonce,
};
use bulkhead_kvpool::{PageId, PageRef, RequestId, Tag};
use bulkhead_worker::engine::{Engine, EngineConfig, Event, KvBudget, Outbound, Request};
use bulkhead_worker::kv::KvMemory;
use bulkhead_worker::loader::LoadedModel;
use bulkhead_worker::sampling::SamplingParams;
use serde_json::json;

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
    /// Bytes per write on the sending side.
    #[arg(long, default_value_t = 4 << 20)]
    batch_bytes: usize,
    /// Prompt lengths for the time-to-first-token comparison (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "128,512,2048")]
    ttft_prompts: Vec<usize>,
    /// Repetitions; the medians are reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
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
    let payload = Payload::new(layout, args.pages);

    let (mut raw, mut on, mut off) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..args.runs {
        raw.push(payload.raw_copy(args.batch_bytes)?);
        on.push(payload.handoff(args.batch_bytes, true)?);
        off.push(payload.handoff(args.batch_bytes, false)?);
    }
    let (raw, on, off) = (median(raw), median(on), median(off));

    let ttft = Ttft::new(loaded, &path)?;
    let mut ttft_rows = Vec::new();
    for &n in &args.ttft_prompts {
        let (mut colocated, mut split) = (Vec::new(), Vec::new());
        for _ in 0..args.runs {
            colocated.push(ttft.colocated(n)?);
            split.push(ttft.disaggregated(n, args.batch_bytes)?);
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
        "handoff_checks_on_gb_s": on / 1e9,
        "handoff_checks_off_gb_s": off / 1e9,
        "on_vs_raw": on / raw,
        "integrity_cost": 1.0 - on / off,
        "ttft": ttft_rows,
    });
    println!("{report}");
    Ok(())
}

/// `pages` pages of KV in a source pool, and an equal destination pool.
struct Payload {
    layout: bulkhead_kernels::attention::KvLayout,
    source: KvMemory,
    pages: usize,
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
        for chunk in bytes.chunks(batch.max(1)) {
            s.write_all(chunk)?;
        }
        drop(s);
        reader
            .join()
            .map_err(|_| anyhow::anyhow!("reader panicked"))??;
        Ok(total as f64 / start.elapsed().as_secs_f64())
    }

    /// Bytes per second of the whole handoff: read pages out into frames, encode, send,
    /// decode, (verify,) write into the destination pool.
    fn handoff(&self, batch: usize, checks: bool) -> anyhow::Result<f64> {
        let pt = self.layout.page_tokens as u32;
        let tokens = self.pages as u32 * pt;
        let nonce = SessionNonce(rand::random());
        let table: Vec<PageRef> = (0..self.pages as u32)
            .map(|i| PageRef {
                page: PageId::new(i),
                tag: Tag::new(u64::from(i) + 1),
            })
            .collect();
        let target = Reservation {
            nonce,
            pages: table.clone(),
            prompt_tokens: tokens,
            page_tokens: pt,
            token_bytes: self.layout.token_bytes() as u32,
        };
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let layout = self.layout;
        let (pages, t) = (self.pages, target.clone());
        let start = Instant::now();
        let receiver = thread::spawn(move || -> anyhow::Result<()> {
            let (mut s, _) = listener.accept()?;
            let mut dest = KvMemory::new(layout, pages);
            let mut inbound = Inbound::new(t.clone());
            let live = |p: PageId| t.pages.get(p.index()).map(|r| r.tag);
            let (mut buf, mut chunk) = (Vec::new(), vec![0u8; 1 << 20]);
            loop {
                let n = s.read(&mut chunk)?;
                if n == 0 {
                    bail!("connection closed before the transfer ended");
                }
                buf.extend_from_slice(&chunk[..n]);
                let mut used = 0;
                while let Some((m, k)) = decode(&buf[used..], 64 << 20)? {
                    used += k;
                    match m {
                        Message::Frame(f) => {
                            let page = if checks {
                                inbound
                                    .accept(&f, live)
                                    .map_err(|e| anyhow::anyhow!("{e}"))?
                                    .page
                            } else {
                                t.pages[f.header.index as usize].page
                            };
                            dest.write_slots(page, 0..pt as usize, &f.bytes)?;
                        }
                        Message::Manifest(m) if checks => {
                            inbound
                                .finish(&m, live)
                                .map_err(|e| anyhow::anyhow!("{e}"))?;
                        }
                        Message::Manifest(_) => {}
                        Message::Closed { .. } => return Ok(()),
                    }
                }
                buf.drain(..used);
            }
        });
        let mut s = TcpStream::connect(addr)?;
        s.set_nodelay(true)?;
        let mut out = Vec::with_capacity(batch + (1 << 16));
        let mut checksums = Vec::with_capacity(self.pages);
        for (i, r) in table.iter().enumerate() {
            let bytes = self.source.read_slots(r.page, 0..pt as usize)?;
            let range = i as u32 * pt..(i as u32 + 1) * pt;
            let frame = if checks {
                Frame::new(nonce, i as u32, r.tag, range, bytes)
            } else {
                Frame {
                    header: FrameHeader {
                        nonce,
                        index: i as u32,
                        tag: r.tag,
                        tokens: range,
                        checksum: 0,
                    },
                    bytes,
                }
            };
            checksums.push(frame.header.checksum);
            encode_frame(&frame, &mut out);
            if out.len() >= batch {
                s.write_all(&out)?;
                out.clear();
            }
        }
        let manifest = bulkhead_handoff::Manifest {
            nonce,
            tokens,
            pages: self.pages as u32,
            digest: bulkhead_handoff::digest(checksums),
            first_token: 0,
        };
        encode(&Message::Manifest(manifest), &mut out);
        encode(
            &Message::Closed {
                nonce,
                reason: CloseReason::Complete,
            },
            &mut out,
        );
        s.write_all(&out)?;
        receiver
            .join()
            .map_err(|_| anyhow::anyhow!("receiver panicked"))??;
        Ok(self.total_bytes() as f64 / start.elapsed().as_secs_f64())
    }
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

    fn disaggregated(&self, n: usize, batch: usize) -> anyhow::Result<f64> {
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
        for m in over_loopback(&outbound, batch)? {
            d.deliver(m);
        }
        outbound.close();
        first_token(&mut d, &drx)?;
        Ok(start.elapsed().as_secs_f64())
    }
}

/// Sends `outbound` through a loopback socket and returns the messages as decode reads them.
fn over_loopback(outbound: &Outbound, batch: usize) -> anyhow::Result<Vec<Message>> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let reader = thread::spawn(move || -> anyhow::Result<Vec<Message>> {
        let (mut s, _) = listener.accept()?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf)?;
        let (mut at, mut out) = (0, Vec::new());
        while let Some((m, used)) = decode(&buf[at..], 64 << 20)? {
            at += used;
            out.push(m);
        }
        Ok(out)
    });
    let mut s = TcpStream::connect(addr)?;
    let mut out = Vec::new();
    for f in &outbound.frames {
        encode_frame(f, &mut out);
        if out.len() >= batch {
            s.write_all(&out)?;
            out.clear();
        }
    }
    encode(&Message::Manifest(outbound.manifest.clone()), &mut out);
    encode(
        &Message::Closed {
            nonce: outbound.nonce(),
            reason: CloseReason::Complete,
        },
        &mut out,
    );
    s.write_all(&out)?;
    drop(s);
    reader
        .join()
        .map_err(|_| anyhow::anyhow!("reader panicked"))?
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
