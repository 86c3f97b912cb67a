//! The CUDA backend proper (feature `cuda`): one context and stream per device, the kernels
//! of `kernels.cu`, device buffers, and the KV pool in device memory.
//!
//! Every launch is preceded by checks that the buffers hold what the kernel will index, so
//! the public API is safe: a wrong size is a `DeviceError::Shape`, never an out-of-bounds
//! access on the device.

use std::fmt;
use std::sync::{Arc, Mutex};

use bulkhead_kvpool::Tag;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DriverError, LaunchArgs,
    LaunchConfig, PinnedHostSlice, PushKernelArg,
};
use cudarc::nvrtc::{CompileError, CompileOptions, Ptx};

use super::step::{NONE, StepPlan};
use super::{DeviceError, DeviceValue, KernelSource, NVRTC_ARCH, SOURCE, StepSeq};
use crate::attention::{CANARY, IntegrityError, KvLayout, TagCheck};
use crate::matmul::QMatrix;
use crate::quant::{BLOCK, DType};

fn driver(action: &'static str) -> impl Fn(DriverError) -> DeviceError {
    move |e| DeviceError::Driver {
        action,
        error: e.to_string(),
    }
}

fn shape(what: String) -> DeviceError {
    DeviceError::Shape { what }
}

/// `v` as a kernel's `int`.
fn int(v: usize) -> Result<i32, DeviceError> {
    i32::try_from(v).map_err(|_| shape(format!("{v} does not fit a 32-bit index")))
}

/// Fails unless `buf` holds at least `n` values.
fn need<T: DeviceValue>(buf: &CudaBuf<T>, n: usize, what: &str) -> Result<(), DeviceError> {
    if buf.len() < n {
        return Err(shape(format!("{what}: {} values, {n} needed", buf.len())));
    }
    Ok(())
}

/// One thread per element, 256 per block.
fn linear(n: usize) -> Result<LaunchConfig, DeviceError> {
    let blocks = u32::try_from(n.div_ceil(256).max(1))
        .map_err(|_| shape(format!("{n} elements in one launch")))?;
    Ok(LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// NVRTC-compiles [`SOURCE`] to PTX (what `bulkhead cuda-ptx` writes, after its header).
pub fn compile_ptx() -> Result<String, DeviceError> {
    // SAFETY: only tries to load libnvrtc by its usual names; nothing is called through it.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(DeviceError::NoNvrtc);
    }
    let opts = CompileOptions {
        fmad: Some(false),
        arch: Some(NVRTC_ARCH),
        name: Some("kernels.cu".into()),
        ..CompileOptions::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts).map_err(|e| match e {
        CompileError::CompileError { log, .. } => DeviceError::Compile {
            log: log.to_string_lossy().into_owned(),
        },
        other => DeviceError::Compile {
            log: other.to_string(),
        },
    })?;
    Ok(ptx.to_src())
}

fn load_ptx(source: &KernelSource) -> Result<Ptx, DeviceError> {
    match source {
        KernelSource::Nvrtc => compile_ptx().map(Ptx::from_src),
        KernelSource::Ptx(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| DeviceError::PtxFile {
                path: path.clone(),
                error: e.to_string(),
            })?;
            super::check_ptx_file(path, &text)?;
            Ok(Ptx::from_src(text))
        }
    }
}

/// The loaded kernels.
struct Kernels {
    rms_norm: CudaFunction,
    rope: CudaFunction,
    silu_mul: CudaFunction,
    add_assign: CudaFunction,
    quantize_q8: CudaFunction,
    matmul: CudaFunction,
    get_rows: CudaFunction,
    write_kv: CudaFunction,
    attend: CudaFunction,
    fill_u16: CudaFunction,
    gather_runs: CudaFunction,
    scatter_runs: CudaFunction,
    gather_rows: CudaFunction,
}

impl Kernels {
    fn load(m: &Arc<CudaModule>) -> Result<Kernels, DeviceError> {
        let f = |name: &str| m.load_function(name).map_err(driver("load a kernel"));
        Ok(Kernels {
            rms_norm: f("rms_norm")?,
            rope: f("rope")?,
            silu_mul: f("silu_mul")?,
            add_assign: f("add_assign")?,
            quantize_q8: f("quantize_q8")?,
            matmul: f("matmul")?,
            get_rows: f("get_rows")?,
            write_kv: f("write_kv")?,
            attend: f("attend")?,
            fill_u16: f("fill_u16")?,
            gather_runs: f("gather_runs")?,
            scatter_runs: f("scatter_runs")?,
            gather_rows: f("gather_rows")?,
        })
    }
}

struct Inner {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    kernels: Kernels,
    name: String,
}

/// An opened CUDA device with the kernels loaded. Cheap to clone (shared).
#[derive(Clone)]
pub struct CudaDevice {
    inner: Arc<Inner>,
}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDevice")
            .field("name", &self.inner.name)
            .finish_non_exhaustive()
    }
}

/// A device buffer of `T`.
pub struct CudaBuf<T: DeviceValue>(CudaSlice<T>);

impl<T: DeviceValue> fmt::Debug for CudaBuf<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudaBuf({} values)", self.0.len())
    }
}

impl<T: DeviceValue> CudaBuf<T> {
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// A weight matrix in device memory, stored as in the GGUF file.
#[derive(Debug)]
pub struct DeviceMatrix {
    dtype: DType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    data: CudaBuf<u8>,
}

impl DeviceMatrix {
    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
}

/// A batch of activation rows in device memory: f32 values and their 8-bit blocks
/// (`Activations` on the CPU). Write the values, then [`CudaDevice::quantize`].
#[derive(Debug)]
pub struct DeviceActs {
    rows: usize,
    cols: usize,
    values: CudaBuf<f32>,
    qs: CudaBuf<i8>,
    ds: CudaBuf<f32>,
    ss: CudaBuf<f32>,
}

impl DeviceActs {
    pub fn values(&self) -> &CudaBuf<f32> {
        &self.values
    }
    pub fn values_mut(&mut self) -> &mut CudaBuf<f32> {
        &mut self.values
    }
    pub fn rows(&self) -> usize {
        self.rows
    }
}

/// The KV metadata of one forward step in device memory (see `step.rs`), and the status words
/// the KV kernels record failures in.
#[derive(Debug)]
pub struct KvStep {
    /// The layout its page tables were built for: the pool's it runs on, or none.
    layout: KvLayout,
    plan: StepPlan,
    tags: Vec<Tag>,
    tokens: usize,
    tok_seq: CudaBuf<i32>,
    tok_pos: CudaBuf<i32>,
    seq_table: CudaBuf<i32>,
    table_pages: CudaBuf<u32>,
    table_tags: CudaBuf<u64>,
    pool_tags: CudaBuf<u64>,
    status: CudaBuf<i32>,
    check: i32,
    canary: i32,
    canary_bits: u32,
}

impl KvStep {
    /// Every token's position (the RoPE positions).
    pub fn positions(&self) -> &CudaBuf<i32> {
        &self.tok_pos
    }
    pub fn tokens(&self) -> usize {
        self.tokens
    }
}

/// Host staging for KV transfers: pinned memory and a device buffer of the same size (one
/// page), so transfers move at full bus speed.
struct Staging {
    host: PinnedHostSlice<u16>,
    device: CudaBuf<u16>,
}

/// The KV pool in device memory: `pages` pages of `layout`, f16 values stored as their bits.
pub struct DeviceKv {
    dev: CudaDevice,
    layout: KvLayout,
    pages: u32,
    dims: [i32; 4],
    values: CudaBuf<u16>,
    staging: Mutex<Staging>,
}

impl fmt::Debug for DeviceKv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceKv")
            .field("layout", &self.layout)
            .field("pages", &self.pages)
            .finish_non_exhaustive()
    }
}

fn dtype_code(d: DType) -> i32 {
    // The DT_* numbers of kernels.cu.
    match d {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Q4_0 => 2,
        DType::Q4_1 => 3,
        DType::Q8_0 => 4,
    }
}

impl CudaDevice {
    /// Opens CUDA device `ordinal` and loads the kernels. Fails — never panics — when this
    /// machine has no driver, no such device, or the kernels cannot be built.
    pub fn open(ordinal: usize, source: &KernelSource) -> Result<CudaDevice, DeviceError> {
        // SAFETY: only tries to load libcuda by its usual names; cudarc panics on first use
        // without it, so this probe must come before any other driver call.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(DeviceError::NoDriver);
        }
        cudarc::driver::result::init().map_err(driver("initialise the driver"))?;
        let count = cudarc::driver::result::device::get_count().map_err(driver("count devices"))?;
        let count = usize::try_from(count).unwrap_or(0);
        if ordinal >= count {
            return Err(DeviceError::NoSuchDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal).map_err(driver("create a context"))?;
        let module = ctx
            .load_module(load_ptx(source)?)
            .map_err(driver("load the kernels"))?;
        let kernels = Kernels::load(&module)?;
        let name = ctx
            .name()
            .unwrap_or_else(|_| format!("CUDA device {ordinal}"));
        let stream = ctx.default_stream();
        Ok(CudaDevice {
            inner: Arc::new(Inner {
                ctx,
                stream,
                kernels,
                name,
            }),
        })
    }

    /// The device's name, e.g. "NVIDIA H200".
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    fn stream(&self) -> &Arc<CudaStream> {
        &self.inner.stream
    }

    /// Waits for all queued work.
    pub fn synchronize(&self) -> Result<(), DeviceError> {
        self.stream().synchronize().map_err(driver("synchronize"))
    }

    /// A new buffer holding `host` (at least one value is allocated, so empty inputs work).
    pub fn upload<T: DeviceValue>(&self, host: &[T]) -> Result<CudaBuf<T>, DeviceError> {
        let padded;
        let src = if host.is_empty() {
            padded = [T::default()];
            &padded[..]
        } else {
            host
        };
        let s = self
            .stream()
            .clone_htod(src)
            .map_err(driver("copy to the device"))?;
        Ok(CudaBuf(s))
    }

    /// A new buffer of `n` zeros (at least one).
    pub fn zeros<T: DeviceValue>(&self, n: usize) -> Result<CudaBuf<T>, DeviceError> {
        let s = self
            .stream()
            .alloc_zeros(n.max(1))
            .map_err(driver("allocate device memory"))?;
        Ok(CudaBuf(s))
    }

    /// The first `n` values of `buf`.
    pub fn download<T: DeviceValue>(
        &self,
        buf: &CudaBuf<T>,
        n: usize,
    ) -> Result<Vec<T>, DeviceError> {
        need(buf, n, "download")?;
        let mut out = vec![T::default(); n];
        if n > 0 {
            self.stream()
                .memcpy_dtoh(&buf.0.slice(..n), &mut out[..])
                .map_err(driver("copy from the device"))?;
        }
        self.synchronize()?;
        Ok(out)
    }

    /// Copies `host` into the start of `dst`.
    pub fn write<T: DeviceValue>(
        &self,
        host: &[T],
        dst: &mut CudaBuf<T>,
    ) -> Result<(), DeviceError> {
        need(dst, host.len(), "write")?;
        if host.is_empty() {
            return Ok(());
        }
        self.stream()
            .memcpy_htod(host, &mut dst.0.slice_mut(..host.len()))
            .map_err(driver("copy to the device"))
    }

    /// Uploads a weight matrix.
    pub fn upload_matrix(&self, w: &QMatrix<'_>) -> Result<DeviceMatrix, DeviceError> {
        Ok(DeviceMatrix {
            dtype: w.dtype(),
            rows: w.rows(),
            cols: w.cols(),
            row_bytes: w.row_bytes(),
            data: self.upload(w.bytes())?,
        })
    }

    /// Activation buffers for `rows` rows of `cols` values (`cols` whole blocks).
    pub fn acts(&self, rows: usize, cols: usize) -> Result<DeviceActs, DeviceError> {
        if !cols.is_multiple_of(BLOCK) {
            return Err(shape(format!(
                "activation width {cols} is not whole blocks"
            )));
        }
        let n = rows * cols;
        Ok(DeviceActs {
            rows,
            cols,
            values: self.zeros(n)?,
            qs: self.zeros(n)?,
            ds: self.zeros(n / BLOCK)?,
            ss: self.zeros(n / BLOCK)?,
        })
    }

    /// Quantizes the activation values into their 8-bit blocks.
    pub fn quantize(&self, a: &mut DeviceActs) -> Result<(), DeviceError> {
        let blocks = a.rows * a.cols / BLOCK;
        if blocks == 0 {
            return Ok(());
        }
        let nb = int(blocks)?;
        let k = &self.inner.kernels;
        let mut b = self.stream().launch_builder(&k.quantize_q8);
        b.arg(&a.values.0)
            .arg(&mut a.qs.0)
            .arg(&mut a.ds.0)
            .arg(&mut a.ss.0)
            .arg(&nb);
        // SAFETY: the arguments match `quantize_q8`'s parameters; `acts` sized every buffer
        // for `rows × cols` values (blocks × 32 quantized values, one scale and sum per
        // block) and the kernel touches only blocks below `nb`.
        unsafe { b.launch(linear(blocks * 32)?) }.map_err(driver("launch quantize_q8"))?;
        Ok(())
    }

    /// `out[r] = x[r] / rms(x[r]) * w` for `rows` rows of `w.len()` values.
    pub fn rms_norm(
        &self,
        x: &CudaBuf<f32>,
        w: &CudaBuf<f32>,
        eps: f32,
        rows: usize,
        out: &mut CudaBuf<f32>,
    ) -> Result<(), DeviceError> {
        let dim = w.len();
        need(x, rows * dim, "rms_norm input")?;
        need(out, rows * dim, "rms_norm output")?;
        if rows == 0 {
            return Ok(());
        }
        let d = int(dim)?;
        let mut b = self.stream().launch_builder(&self.inner.kernels.rms_norm);
        b.arg(&x.0).arg(&w.0).arg(&mut out.0).arg(&d).arg(&eps);
        let cfg = LaunchConfig {
            grid_dim: (
                u32::try_from(rows).map_err(|_| shape(format!("{rows} rows")))?,
                1,
                1,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: arguments match `rms_norm`'s parameters; one block per row reads and writes
        // `dim` values of row `blockIdx.x < rows`, inside both buffers (checked above).
        unsafe { b.launch(cfg) }.map_err(driver("launch rms_norm"))?;
        Ok(())
    }

    /// RoPE (interleaved pairs) on `rows` rows of whole heads, row `r` at `positions[r]`.
    pub fn rope(
        &self,
        x: &mut CudaBuf<f32>,
        rows: usize,
        width: usize,
        positions: &CudaBuf<i32>,
        inv_freq: &CudaBuf<f32>,
    ) -> Result<(), DeviceError> {
        let half = inv_freq.len();
        if half == 0 || !width.is_multiple_of(2 * half) {
            return Err(shape(format!(
                "rope: width {width} is not whole heads of {}",
                2 * half
            )));
        }
        need(x, rows * width, "rope input")?;
        need(positions, rows, "rope positions")?;
        if rows == 0 {
            return Ok(());
        }
        let (r, w, h) = (int(rows)?, int(width)?, int(half)?);
        let mut b = self.stream().launch_builder(&self.inner.kernels.rope);
        b.arg(&mut x.0)
            .arg(&positions.0)
            .arg(&inv_freq.0)
            .arg(&r)
            .arg(&w)
            .arg(&h);
        // SAFETY: arguments match `rope`'s parameters; thread i < rows × width / 2 touches
        // pair i of `x` (rows × width values), positions[i / (width/2)] and
        // inv_freq[(i mod width/2) mod half], all in bounds (checked above).
        unsafe { b.launch(linear(rows * width / 2)?) }.map_err(driver("launch rope"))?;
        Ok(())
    }

    /// `gate = silu(gate) * up` over the first `n` values.
    pub fn silu_mul(
        &self,
        gate: &mut CudaBuf<f32>,
        up: &CudaBuf<f32>,
        n: usize,
    ) -> Result<(), DeviceError> {
        self.binary(&self.inner.kernels.silu_mul, gate, up, n)
    }

    /// `a += b` over the first `n` values.
    pub fn add_assign(
        &self,
        a: &mut CudaBuf<f32>,
        b: &CudaBuf<f32>,
        n: usize,
    ) -> Result<(), DeviceError> {
        self.binary(&self.inner.kernels.add_assign, a, b, n)
    }

    fn binary(
        &self,
        f: &CudaFunction,
        a: &mut CudaBuf<f32>,
        b: &CudaBuf<f32>,
        n: usize,
    ) -> Result<(), DeviceError> {
        need(a, n, "element-wise output")?;
        need(b, n, "element-wise input")?;
        if n == 0 {
            return Ok(());
        }
        let len = int(n)?;
        let mut l = self.stream().launch_builder(f);
        l.arg(&mut a.0).arg(&b.0).arg(&len);
        // SAFETY: `silu_mul` and `add_assign` both take (float*, const float*, int) and touch
        // index i < n of both buffers, which hold at least n values (checked above).
        unsafe { l.launch(linear(n)?) }.map_err(driver("launch an element-wise kernel"))?;
        Ok(())
    }

    /// `out[t][r] = w.row(r) · x.row(t)`; `out` holds `x.rows() × w.rows()` values.
    pub fn matmul(
        &self,
        w: &DeviceMatrix,
        x: &DeviceActs,
        out: &mut CudaBuf<f32>,
    ) -> Result<(), DeviceError> {
        if x.cols != w.cols {
            return Err(shape(format!(
                "matmul: {} columns against {}",
                x.cols, w.cols
            )));
        }
        need(out, x.rows * w.rows, "matmul output")?;
        need(&w.data, w.rows * w.row_bytes, "matmul weights")?;
        if x.rows == 0 || w.rows == 0 {
            return Ok(());
        }
        let (dt, m, k, rb, n) = (
            dtype_code(w.dtype),
            int(w.rows)?,
            int(w.cols)?,
            int(w.row_bytes)?,
            int(x.rows)?,
        );
        let mut b = self.stream().launch_builder(&self.inner.kernels.matmul);
        b.arg(&w.data.0)
            .arg(&dt)
            .arg(&m)
            .arg(&k)
            .arg(&rb)
            .arg(&x.values.0)
            .arg(&x.qs.0)
            .arg(&x.ds.0)
            .arg(&x.ss.0)
            .arg(&n)
            .arg(&mut out.0);
        // Four warps per block (MM_WARPS), eight activation rows per warp (MM_TILE).
        let grid = (
            u32::try_from(w.rows.div_ceil(4)).map_err(|_| shape(format!("{m} rows")))?,
            u32::try_from(x.rows.div_ceil(8)).map_err(|_| shape(format!("{n} rows")))?,
        );
        if grid.1 > 65_535 {
            return Err(shape(format!("matmul over {n} activation rows")));
        }
        let cfg = LaunchConfig {
            grid_dim: (grid.0, grid.1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: arguments match `matmul`'s parameters. A warp reads weight row r < m
        // (row_bytes each, m × row_bytes checked), activation rows t < n of `x` (sized by
        // `acts` for rows × cols, cols == k) and writes out[t × m + r] < n × m (checked).
        unsafe { b.launch(cfg) }.map_err(driver("launch matmul"))?;
        Ok(())
    }

    /// Rows `ids[..n]` of `w`, dequantized into `out` (`n × w.cols()`); ids outside `w` give
    /// zero rows.
    pub fn get_rows(
        &self,
        w: &DeviceMatrix,
        ids: &CudaBuf<u32>,
        n: usize,
        out: &mut CudaBuf<f32>,
    ) -> Result<(), DeviceError> {
        need(ids, n, "row ids")?;
        need(out, n * w.cols, "rows output")?;
        if n == 0 {
            return Ok(());
        }
        let (dt, m, k, rb, len) = (
            dtype_code(w.dtype),
            int(w.rows)?,
            int(w.cols)?,
            int(w.row_bytes)?,
            int(n)?,
        );
        let mut b = self.stream().launch_builder(&self.inner.kernels.get_rows);
        b.arg(&w.data.0)
            .arg(&dt)
            .arg(&m)
            .arg(&k)
            .arg(&rb)
            .arg(&ids.0)
            .arg(&len)
            .arg(&mut out.0);
        // SAFETY: arguments match `get_rows`'s parameters; thread i < n × k reads ids[i / k]
        // and, only when that id is < m, weight row id (inside m × row_bytes), and writes
        // out[i] (checked above).
        unsafe { b.launch(linear(n * w.cols)?) }.map_err(driver("launch get_rows"))?;
        Ok(())
    }

    /// Rows `ids[..n]` of `src` (rows of `width` values) into `out`; ids outside give zeros.
    pub fn gather_rows(
        &self,
        src: &CudaBuf<f32>,
        width: usize,
        ids: &CudaBuf<u32>,
        n: usize,
        out: &mut CudaBuf<f32>,
    ) -> Result<(), DeviceError> {
        if width == 0 {
            return Err(shape("gather of empty rows".into()));
        }
        need(ids, n, "row ids")?;
        need(out, n * width, "gathered rows")?;
        if n == 0 {
            return Ok(());
        }
        let (rows, w, len) = (int(src.len() / width)?, int(width)?, int(n)?);
        let mut b = self
            .stream()
            .launch_builder(&self.inner.kernels.gather_rows);
        b.arg(&src.0)
            .arg(&rows)
            .arg(&w)
            .arg(&ids.0)
            .arg(&len)
            .arg(&mut out.0);
        // SAFETY: arguments match `gather_rows`'s parameters; thread i < n × width reads
        // ids[i / width] and, only when that id is below src.len() / width, src inside its
        // rows; it writes out[i] (checked above).
        unsafe { b.launch(linear(n * width)?) }.map_err(driver("launch gather_rows"))?;
        Ok(())
    }

    /// The KV pool for `pages` pages of `layout`, zeroed.
    pub fn kv_pool(&self, layout: KvLayout, pages: usize) -> Result<DeviceKv, DeviceError> {
        if layout.head_dim == 0 || layout.head_dim > 128 {
            return Err(shape(format!(
                "head_dim {} (the attention kernel takes 1 to 128)",
                layout.head_dim
            )));
        }
        let page_values = layout.page_values();
        let values = self.zeros(page_values * pages)?;
        // SAFETY: pinned memory starts uninitialised; it is zeroed through the raw pointer
        // below before any slice of it is made.
        let mut host = unsafe {
            self.inner
                .ctx
                .alloc_pinned_with_flags::<u16>(page_values, 0)
        }
        .map_err(driver("allocate pinned host memory"))?;
        let ptr = host
            .as_mut_ptr()
            .map_err(driver("allocate pinned host memory"))?;
        // SAFETY: `ptr` points to `page_values` u16 of pinned memory owned by `host`.
        unsafe { std::ptr::write_bytes(ptr, 0, page_values) };
        let staging = Staging {
            host,
            device: self.zeros(page_values)?,
        };
        Ok(DeviceKv {
            dev: self.clone(),
            layout,
            pages: u32::try_from(pages).map_err(|_| shape(format!("{pages} pages")))?,
            dims: [
                int(layout.layers)?,
                int(layout.kv_heads)?,
                int(layout.head_dim)?,
                int(layout.page_tokens)?,
            ],
            values,
            staging: Mutex::new(staging),
        })
    }

    /// Uploads one step's KV metadata. `tags` are the pool's current tags (`TagView::tags`).
    pub fn kv_step(
        &self,
        layout: &KvLayout,
        tags: &[Tag],
        check: TagCheck,
        canary: bool,
        seqs: &[StepSeq<'_>],
    ) -> Result<KvStep, DeviceError> {
        let plan = StepPlan::new(layout, tags, seqs)?;
        Ok(KvStep {
            layout: *layout,
            tokens: plan.tok_pos.len(),
            tok_seq: self.upload(&plan.tok_seq)?,
            tok_pos: self.upload(&plan.tok_pos)?,
            seq_table: self.upload(&plan.seq_table)?,
            table_pages: self.upload(&plan.table_pages)?,
            table_tags: self.upload(&plan.table_tags)?,
            pool_tags: self.upload(&plan.pool_tags)?,
            status: self.upload(&vec![NONE; 2 * seqs.len()])?,
            check: i32::from(check == TagCheck::On),
            canary: i32::from(canary),
            canary_bits: u32::from(CANARY.to_bits()),
            tags: tags.to_vec(),
            plan,
        })
    }

    /// What the step's KV kernels found, per sequence (waits for them).
    pub fn step_failures(&self, step: &KvStep) -> Result<Vec<Option<IntegrityError>>, DeviceError> {
        let status = self.download(&step.status, 2 * step.plan.early.len())?;
        Ok(step.plan.failures(&status, &step.tags))
    }

    /// Pushes the KV kernels' leading parameters (`KV_PARAMS` in kernels.cu), in order.
    fn kv_args<'a>(b: &mut LaunchArgs<'a>, kv: &'a mut DeviceKv, s: &'a mut KvStep) {
        let [layers, kv_heads, head_dim, page_tokens] = &kv.dims;
        b.arg(&mut kv.values.0)
            .arg(&s.pool_tags.0)
            .arg(&kv.pages)
            .arg(layers)
            .arg(kv_heads)
            .arg(head_dim)
            .arg(page_tokens)
            .arg(&s.tok_seq.0)
            .arg(&s.tok_pos.0)
            .arg(&s.seq_table.0)
            .arg(&s.table_pages.0)
            .arg(&s.table_tags.0)
            .arg(&mut s.status.0)
            .arg(&s.check)
            .arg(&s.canary)
            .arg(&s.canary_bits);
    }

    /// Checks that a step and a pool agree before a KV kernel indexes one with the other.
    fn check_step(kv: &DeviceKv, s: &KvStep) -> Result<(), DeviceError> {
        // The kernels index a step's page tables by the pool's page size: tables built for
        // another one would send a sequence's tokens to another's entries, or past the table.
        if s.layout != kv.layout {
            return Err(shape(format!(
                "a step planned for {:?} on a pool of {:?}",
                s.layout, kv.layout
            )));
        }
        if s.plan.pool_tags.len() != kv.pages as usize {
            return Err(shape(format!(
                "{} page tags for a pool of {} pages",
                s.plan.pool_tags.len(),
                kv.pages
            )));
        }
        Ok(())
    }

    /// Writes the step's new K and V rows (`tokens × kv_heads × head_dim` each) into `layer`.
    pub fn write_kv(
        &self,
        kv: &mut DeviceKv,
        step: &mut KvStep,
        layer: usize,
        k: &CudaBuf<f32>,
        v: &CudaBuf<f32>,
    ) -> Result<(), DeviceError> {
        Self::check_step(kv, step)?;
        let kvd = kv.layout.kv_heads * kv.layout.head_dim;
        let n = step.tokens;
        need(k, n * kvd, "new keys")?;
        need(v, n * kvd, "new values")?;
        if layer >= kv.layout.layers {
            return Err(shape(format!("layer {layer} of {}", kv.layout.layers)));
        }
        if n == 0 {
            return Ok(());
        }
        let (l, len) = (int(layer)?, int(n)?);
        let dev = kv.dev.clone();
        let mut b = dev.stream().launch_builder(&dev.inner.kernels.write_kv);
        Self::kv_args(&mut b, kv, step);
        b.arg(&l).arg(&k.0).arg(&v.0).arg(&len);
        // SAFETY: arguments match `write_kv`'s parameters (KV_PARAMS, then layer, k, v, n).
        // Thread i < n × kvd reads k[i], v[i] (checked); its token's table entry exists
        // (StepPlan kept `needed` pages for every active sequence, and positions are below
        // cached + new); the page is bounds-checked against `pages` (== the pool's pages,
        // checked) before the write, and layer < layers.
        unsafe { b.launch(linear(n * kvd)?) }.map_err(driver("launch write_kv"))?;
        Ok(())
    }

    /// Causal attention of the step's tokens over their sequences' pages in `layer`; `q` and
    /// `out` are `tokens × heads × head_dim`.
    pub fn attend(
        &self,
        kv: &mut DeviceKv,
        step: &mut KvStep,
        layer: usize,
        q: &CudaBuf<f32>,
        heads: usize,
        out: &mut CudaBuf<f32>,
    ) -> Result<(), DeviceError> {
        Self::check_step(kv, step)?;
        let hd = kv.layout.head_dim;
        let n = step.tokens;
        if heads == 0 || !heads.is_multiple_of(kv.layout.kv_heads) || heads > 65_535 {
            return Err(shape(format!(
                "{heads} heads over {} kv heads",
                kv.layout.kv_heads
            )));
        }
        need(q, n * heads * hd, "queries")?;
        need(out, n * heads * hd, "attention output")?;
        if layer >= kv.layout.layers {
            return Err(shape(format!("layer {layer} of {}", kv.layout.layers)));
        }
        if n == 0 {
            return Ok(());
        }
        let (l, h) = (int(layer)?, int(heads)?);
        let scale = 1.0 / (hd as f32).sqrt();
        let dev = kv.dev.clone();
        let mut b = dev.stream().launch_builder(&dev.inner.kernels.attend);
        Self::kv_args(&mut b, kv, step);
        b.arg(&l).arg(&q.0).arg(&h).arg(&scale).arg(&mut out.0);
        let cfg = LaunchConfig {
            grid_dim: (
                u32::try_from(n).map_err(|_| shape(format!("{n} tokens")))?,
                h as u32,
                1,
            ),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: arguments match `attend`'s parameters (KV_PARAMS, then layer, q, heads,
        // scale, out). Warp (t, h) reads q and writes out at row t × heads + h (checked
        // sizes; head_dim ≤ 128, checked by `kv_pool`), reads table
        // entries below `needed` for positions ≤ its own, and bounds-checks every page before
        // reading it.
        unsafe { b.launch(cfg) }.map_err(driver("launch attend"))?;
        Ok(())
    }
}

impl DeviceKv {
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    pub fn pages(&self) -> usize {
        self.pages as usize
    }

    /// Checks that `runs` runs of `width` values starting `stride` apart from `start` lie in
    /// the pool and fit one staging buffer.
    fn check_runs(
        &self,
        start: usize,
        runs: usize,
        stride: usize,
        width: usize,
    ) -> Result<(), DeviceError> {
        let end = (runs.max(1) - 1) * stride + width + start;
        if runs == 0 || width == 0 || width > stride || end > self.values.len() {
            return Err(shape(format!(
                "runs {runs}×{width} every {stride} from {start} in a pool of {}",
                self.values.len()
            )));
        }
        if runs * width > self.layout.page_values() {
            return Err(shape(format!(
                "{} values at once (one page at most)",
                runs * width
            )));
        }
        Ok(())
    }

    /// Sets `n` values from `start` to `bits` (a scrub: zero or the canary).
    pub fn fill(&mut self, start: usize, n: usize, bits: u16) -> Result<(), DeviceError> {
        if start + n > self.values.len() {
            return Err(shape(format!(
                "fill {start}+{n} in a pool of {}",
                self.values.len()
            )));
        }
        if n == 0 {
            return Ok(());
        }
        let len = u32::try_from(n).map_err(|_| shape(format!("fill of {n} values")))?;
        let dev = self.dev.clone();
        let mut dst = self.values.0.slice_mut(start..start + n);
        let mut b = dev.stream().launch_builder(&dev.inner.kernels.fill_u16);
        b.arg(&mut dst).arg(&len).arg(&bits);
        // SAFETY: arguments match `fill_u16`'s parameters; thread i < n writes dst[i], and
        // `dst` is a view of exactly n values.
        unsafe { b.launch(linear(n)?) }.map_err(driver("launch fill_u16"))?;
        Ok(())
    }

    /// The values of `runs` runs of `width`, `stride` apart from `start`, packed.
    pub fn read_runs(
        &self,
        start: usize,
        runs: usize,
        stride: usize,
        width: usize,
    ) -> Result<Vec<u16>, DeviceError> {
        self.check_runs(start, runs, stride, width)?;
        let n = runs * width;
        let mut staging = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        let Staging { host, device } = &mut *staging;
        let dev = &self.dev;
        let (r, s, w) = (int(runs)?, int(stride)?, int(width)?);
        let src = self.values.0.slice(start..);
        let mut b = dev.stream().launch_builder(&dev.inner.kernels.gather_runs);
        b.arg(&src).arg(&mut device.0).arg(&r).arg(&s).arg(&w);
        // SAFETY: arguments match `gather_runs`'s parameters; thread i < runs × width reads
        // src[(i / width) × stride + i mod width] < (runs-1) × stride + width, inside the view
        // (checked by `check_runs`), and writes device[i] (one page of staging ≥ n, checked).
        unsafe { b.launch(linear(n)?) }.map_err(driver("launch gather_runs"))?;
        dev.stream()
            .memcpy_dtoh(&device.0.slice(..n), host)
            .map_err(driver("copy KV to pinned memory"))?;
        let values = host.as_slice().map_err(driver("wait for a KV copy"))?;
        Ok(values[..n].to_vec())
    }

    /// Writes `values` (packed runs of `width`) into runs `stride` apart from `start`.
    pub fn write_runs(
        &mut self,
        start: usize,
        stride: usize,
        width: usize,
        values: &[u16],
    ) -> Result<(), DeviceError> {
        if width == 0 || !values.len().is_multiple_of(width) {
            return Err(shape(format!("{} values in runs of {width}", values.len())));
        }
        let runs = values.len() / width;
        self.check_runs(start, runs, stride, width)?;
        let n = values.len();
        let mut staging = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        let Staging { host, device } = &mut *staging;
        let dev = self.dev.clone();
        host.as_mut_slice()
            .map_err(driver("wait for pinned memory"))?[..n]
            .copy_from_slice(values);
        // The whole staging page goes over (pinned and device buffers have the same size).
        dev.stream()
            .memcpy_htod(&*host, &mut device.0)
            .map_err(driver("copy KV from pinned memory"))?;
        let (r, s, w) = (int(runs)?, int(stride)?, int(width)?);
        let mut dst = self.values.0.slice_mut(start..);
        let mut b = dev.stream().launch_builder(&dev.inner.kernels.scatter_runs);
        b.arg(&device.0).arg(&mut dst).arg(&r).arg(&s).arg(&w);
        // SAFETY: the mirror of `read_runs`: thread i < n reads device[i] and writes
        // dst[(i / width) × stride + i mod width], inside the view (checked).
        unsafe { b.launch(linear(n)?) }.map_err(driver("launch scatter_runs"))?;
        Ok(())
    }
}
