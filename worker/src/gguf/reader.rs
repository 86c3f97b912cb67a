use std::collections::HashMap;
use std::path::Path;

use bulkhead_kernels::{DType, QMatrix};
use memmap2::Mmap;

use crate::printable::printable;

use super::{
    DEFAULT_ALIGNMENT, GgufError, MAGIC, VERSIONS, Value, dtype_from_ggml, ggml_type_name,
};

/// Where a tensor lives and what it holds. `dims[0]` is the innermost (contiguous) dimension.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub dtype: DType,
    /// Extents, innermost first; their product fits in `usize`.
    pub dims: Vec<usize>,
    /// Byte range inside the file, checked to lie inside it.
    start: usize,
    len: usize,
}

impl TensorInfo {
    /// Number of values.
    pub fn elements(&self) -> usize {
        self.dims.iter().product()
    }
}

/// A parsed GGUF file. The header is fully validated; tensor bytes are borrowed from the map.
#[derive(Debug)]
pub struct Gguf {
    map: Mmap,
    version: u32,
    metadata: HashMap<String, Value>,
    tensors: HashMap<String, TensorInfo>,
    /// Bytes before the tensor data: the header, the metadata and the tensor infos.
    header_len: usize,
}

impl Gguf {
    /// Maps and parses the file at `path`.
    pub fn open(path: &Path) -> Result<Gguf, GgufError> {
        let io = |source| GgufError::Io {
            path: path.to_owned(),
            source,
        };
        // Not a FIFO or a device (either would hold the reader for ever).
        let file = crate::regular_file::open(path).map_err(io)?;
        // SAFETY: the map is read-only and private to this process. Bulkhead never writes model
        // files while serving; an outside writer truncating the file would fault, not corrupt
        // memory safety, on the systems we support (documented operator rule: replace model
        // files by rename, never in place).
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        let (version, metadata, tensors, header_len) = parse(&map)?;
        Ok(Gguf {
            map,
            version,
            metadata,
            tensors,
            header_len,
        })
    }

    /// The file's bytes before its tensor data: the header, every metadata value (the
    /// tokenizer's vocabulary and merges, the chat template) and the tensor infos.
    pub fn header(&self) -> &[u8] {
        &self.map[..self.header_len]
    }

    /// The file's size in bytes.
    pub fn file_len(&self) -> u64 {
        self.map.len() as u64
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.metadata
    }

    pub fn tensors(&self) -> &HashMap<String, TensorInfo> {
        &self.tensors
    }

    pub fn get(&self, key: &str) -> Result<&Value, GgufError> {
        self.metadata
            .get(key)
            .ok_or_else(|| GgufError::MissingKey { key: key.into() })
    }

    fn wrong(&self, key: &str, expected: &'static str, v: &Value) -> GgufError {
        GgufError::WrongType {
            key: key.into(),
            expected,
            found: v.type_name(),
        }
    }

    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        let v = self.get(key)?;
        v.as_u64()
            .ok_or_else(|| self.wrong(key, "a non-negative integer", v))
    }

    /// An integer key that must be a positive count that fits in `usize`.
    pub fn get_count(&self, key: &str) -> Result<usize, GgufError> {
        let v = self.get_u64(key)?;
        match usize::try_from(v) {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(GgufError::BadValue {
                key: key.into(),
                reason: format!("{v} is not a positive count"),
            }),
        }
    }

    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        let v = self.get(key)?;
        v.as_f64()
            .map(|f| f as f32)
            .ok_or_else(|| self.wrong(key, "a float", v))
    }

    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        let v = self.get(key)?;
        v.as_str().ok_or_else(|| self.wrong(key, "a string", v))
    }

    /// An array whose every element is a string.
    pub fn get_strings(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        let v = self.get(key)?;
        let items = v
            .as_array()
            .ok_or_else(|| self.wrong(key, "an array of strings", v))?;
        items
            .iter()
            .map(|i| {
                i.as_str()
                    .ok_or_else(|| self.wrong(key, "an array of strings", i))
            })
            .collect()
    }

    /// The info of tensor `name`.
    pub fn tensor_info(&self, name: &str) -> Result<&TensorInfo, GgufError> {
        self.tensors
            .get(name)
            .ok_or_else(|| GgufError::MissingTensor { name: name.into() })
    }

    /// The raw bytes of tensor `name`.
    pub fn tensor_bytes(&self, name: &str) -> Result<&[u8], GgufError> {
        Ok(self.bytes(self.tensor_range(name)?))
    }

    /// The byte range of tensor `name` in the file, for [`Gguf::bytes`].
    pub fn tensor_range(&self, name: &str) -> Result<std::ops::Range<usize>, GgufError> {
        let t = self.tensor_info(name)?;
        Ok(t.start..t.start + t.len)
    }

    /// Bytes of the file; ranges come from [`Gguf::tensor_range`].
    ///
    /// # Panics
    /// When `range` lies outside the file.
    pub fn bytes(&self, range: std::ops::Range<usize>) -> &[u8] {
        &self.map[range]
    }

    /// Hands the resident pages of `range` back to the kernel, once their bytes have been
    /// copied elsewhere (packed weights), so they stop counting in the process's memory. Best
    /// effort: a later read of the range still works, it faults the bytes back in.
    pub fn release(&self, range: std::ops::Range<usize>) {
        if range.is_empty() || range.end > self.map.len() {
            return;
        }
        // SAFETY: the map is a read-only, shared mapping of a file (see `open`): MADV_DONTNEED
        // only drops the resident copies of its pages, and any later read, through a slice
        // borrowed before or after, faults the same file bytes back in. Nothing ever writes
        // through this map, so no write can be lost.
        let _ = unsafe {
            self.map.unchecked_advise_range(
                memmap2::UncheckedAdvice::DontNeed,
                range.start,
                range.len(),
            )
        };
    }

    /// Tensor `name` as a matrix of `rows × cols` (`dims == [cols, rows]`).
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<QMatrix<'_>, GgufError> {
        let t = self.tensor_info(name)?;
        if t.dims != [cols, rows] {
            return Err(GgufError::BadShape {
                name: name.into(),
                dims: t.dims.iter().map(|&d| d as u64).collect(),
                reason: format!("expected [{cols}, {rows}]"),
            });
        }
        let bytes = self.tensor_bytes(name)?;
        QMatrix::new(t.dtype, rows, cols, bytes).map_err(|e| GgufError::BadShape {
            name: name.into(),
            dims: t.dims.iter().map(|&d| d as u64).collect(),
            reason: e.to_string(),
        })
    }

    /// Tensor `name` as `len` f32 values (an F32 or F16 vector, e.g. a norm's weight).
    pub fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, GgufError> {
        let t = self.tensor_info(name)?;
        if t.elements() != len || t.dims.len() != 1 {
            return Err(GgufError::BadShape {
                name: name.into(),
                dims: t.dims.iter().map(|&d| d as u64).collect(),
                reason: format!("expected a vector of {len}"),
            });
        }
        let mut out = vec![0.0; len];
        bulkhead_kernels::quant::dequantize_row(t.dtype, self.tensor_bytes(name)?, &mut out);
        Ok(out)
    }
}

type Parsed = (
    u32,
    HashMap<String, Value>,
    HashMap<String, TensorInfo>,
    usize,
);

fn parse(bytes: &[u8]) -> Result<Parsed, GgufError> {
    let mut r = Reader {
        bytes,
        pos: 0,
        items_left: MAX_ITEMS,
    };
    let magic = r.u32("magic")?;
    if magic != MAGIC {
        return Err(GgufError::BadMagic { found: magic });
    }
    let version = r.u32("version")?;
    if VERSIONS.contains(&version.swap_bytes()) {
        return Err(GgufError::BigEndian);
    }
    if !VERSIONS.contains(&version) {
        return Err(GgufError::UnsupportedVersion { version });
    }
    let tensor_count = r.u64("tensor count")?;
    let kv_count = r.u64("metadata count")?;
    for (what, count) in [("metadata entries", kv_count), ("tensors", tensor_count)] {
        if count > MAX_ENTRIES {
            return Err(GgufError::TooMany {
                what,
                count,
                limit: MAX_ENTRIES,
            });
        }
    }
    // Every key/value takes at least 12 bytes, every tensor info at least 24.
    r.plausible("metadata count", kv_count, 12)?;
    r.plausible("tensor count", tensor_count, 24)?;

    let mut metadata = HashMap::new();
    for i in 0..kv_count {
        let key = r.string(&format!("key of metadata entry {i}"), MAX_KEY_BYTES)?;
        let shown = quoted(&key);
        let type_id = r.u32(&format!("type of {shown}"))?;
        // Named once per key, not once per array item: a long key over a long array would
        // otherwise cost their product in copies.
        let value = r.value(&shown, &format!("value of {shown}"), type_id, 0)?;
        if metadata.insert(key, value).is_some() {
            return Err(GgufError::DuplicateKey { key: shown });
        }
    }

    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_u64() {
            Some(a) if a.is_power_of_two() => a,
            _ => {
                return Err(GgufError::BadValue {
                    key: "general.alignment".into(),
                    reason: "must be a power of two".into(),
                });
            }
        },
    };

    let mut raw = Vec::new();
    for i in 0..tensor_count {
        let name = r.string(&format!("name of tensor {i}"), MAX_NAME_BYTES)?;
        let n_dims = r.u32(&format!("dimension count of {name:?}"))?;
        if n_dims == 0 || n_dims > 4 {
            return Err(GgufError::BadShape {
                name,
                dims: vec![],
                reason: format!("{n_dims} dimensions"),
            });
        }
        let mut dims = Vec::new();
        for d in 0..n_dims {
            dims.push(r.u64(&format!("dimension {d} of {name:?}"))?);
        }
        let type_id = r.u32(&format!("type of {name:?}"))?;
        let offset = r.u64(&format!("offset of {name:?}"))?;
        raw.push((name, dims, type_id, offset));
    }

    let data_start = (r.pos as u64).next_multiple_of(alignment);
    let data_len = (bytes.len() as u64).saturating_sub(data_start);
    let mut tensors = HashMap::new();
    for (name, dims, type_id, offset) in raw {
        let dtype = dtype_from_ggml(type_id).ok_or_else(|| GgufError::UnsupportedTensorType {
            name: name.clone(),
            type_id,
            type_name: ggml_type_name(type_id),
        })?;
        let bad_shape = |reason: &str| GgufError::BadShape {
            name: name.clone(),
            dims: dims.clone(),
            reason: reason.into(),
        };
        let udims: Vec<usize> = dims
            .iter()
            .map(|&d| usize::try_from(d).ok().filter(|&d| d > 0))
            .collect::<Option<_>>()
            .ok_or_else(|| bad_shape("zero or huge dimension"))?;
        let elements = udims
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| bad_shape("too many elements"))?;
        if !udims[0].is_multiple_of(dtype.block_len()) {
            return Err(bad_shape("rows are not a whole number of blocks"));
        }
        let len = dtype
            .bytes_for(elements)
            .ok_or_else(|| bad_shape("too many elements"))?;
        if offset % alignment != 0 {
            return Err(GgufError::Misaligned {
                name,
                offset,
                alignment,
            });
        }
        let end = offset.checked_add(len as u64);
        if end.is_none_or(|end| end > data_len) {
            return Err(GgufError::OutOfBounds {
                name,
                start: offset,
                end: end.unwrap_or(u64::MAX),
                len: data_len,
            });
        }
        let start = (data_start + offset) as usize;
        if tensors.contains_key(&name) {
            return Err(GgufError::DuplicateTensor { name });
        }
        tensors.insert(
            name,
            TensorInfo {
                dtype,
                dims: udims,
                start,
                len,
            },
        );
    }
    disjoint(&tensors)?;
    Ok((version, metadata, tensors, r.pos))
}

/// Refuses tensors whose bytes overlap. A model file lays them out one after another; a file
/// that points many tensors at the same bytes (a hundred thousand layers over one layer's
/// data, in a file of that one layer) would be unpacked into memory once per tensor.
fn disjoint(tensors: &HashMap<String, TensorInfo>) -> Result<(), GgufError> {
    let mut spans: Vec<(&str, &TensorInfo)> =
        tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    spans.sort_unstable_by_key(|(n, t)| (t.start, *n));
    for pair in spans.windows(2) {
        let [(first, a), (second, b)] = pair else {
            continue;
        };
        if b.start < a.start + a.len {
            return Err(GgufError::Overlapping {
                first: (*first).to_owned(),
                second: (*second).to_owned(),
            });
        }
    }
    Ok(())
}

/// Bounds-checked little-endian reads over the header.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
    /// Array items the metadata may still hold ([`MAX_ITEMS`] in all).
    items_left: u64,
}

/// The longest metadata key: GGUF's own bound.
const MAX_KEY_BYTES: u64 = 65_535;

/// The longest tensor name (llama.cpp takes at most 63 bytes).
const MAX_NAME_BYTES: u64 = 256;

/// The most metadata entries, and the most tensors, a file may declare: a model has tens of
/// keys and some thousands of tensors.
const MAX_ENTRIES: u64 = 1 << 16;

/// The most bytes the header (metadata and tensor infos) may take: all of it is copied into
/// memory, where the tensor data is only mapped. A vocabulary of 256k tokens with its merges,
/// types and scores takes about 20 MiB.
pub(super) const MAX_HEADER_BYTES: usize = 256 << 20;

/// The most of a key an error quotes: a key may be 64 KiB long.
const QUOTED: usize = 64;

/// `key` quoted for an error message: cut to [`QUOTED`] bytes, and what would act on a terminal
/// escaped ([`printable`]).
fn quoted(key: &str) -> String {
    let cut = if key.len() > QUOTED { "…" } else { "" };
    format!("\"{}\"{cut}", printable(key, QUOTED))
}

/// Arrays nest at most this deep (GGUF writers use one level).
const MAX_DEPTH: usize = 4;

/// The most array items the metadata may hold, all arrays together: each takes a
/// [`Value`] in memory (32 bytes: 128 MiB at most), where a `u8` item takes one byte of the
/// file. A vocabulary of 256k tokens with its merges, types and scores is about a million.
const MAX_ITEMS: u64 = 4 << 20;

/// The fewest bytes an array item of GGUF type `type_id` takes in the file (a string: its
/// length; an array: its type and count).
fn item_bytes(type_id: u32) -> u64 {
    match type_id {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 | 10..=12 => 8,
        9 => 12,
        _ => 1,
    }
}

impl Reader<'_> {
    fn take(&mut self, n: u64, what: &str) -> Result<&[u8], GgufError> {
        let truncated = || GgufError::Truncated {
            what: what.into(),
            offset: self.pos as u64,
        };
        let n = usize::try_from(n).map_err(|_| truncated())?;
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or_else(truncated)?;
        if end > MAX_HEADER_BYTES {
            return Err(GgufError::HeaderTooLarge {
                limit: MAX_HEADER_BYTES,
            });
        }
        let s = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let s = self.take(N as u64, what)?;
        let mut a = [0; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// Rejects counts that could not fit in the rest of the file at `min_bytes` each, before
    /// anything is allocated for them.
    fn plausible(&self, what: &str, count: u64, min_bytes: u64) -> Result<(), GgufError> {
        let left = (self.bytes.len() - self.pos) as u64;
        if count.saturating_mul(min_bytes) > left {
            return Err(GgufError::ImplausibleCount {
                what: what.into(),
                count,
            });
        }
        Ok(())
    }

    /// A string of at most `limit` bytes.
    fn string(&mut self, what: &str, limit: u64) -> Result<String, GgufError> {
        let len = self.u64(what)?;
        if len > limit {
            return Err(GgufError::TooLong {
                what: what.into(),
                len,
                limit,
            });
        }
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::BadUtf8 { what: what.into() })
    }

    /// The value of `key` (named `what` in errors), of type `type_id`.
    fn value(
        &mut self,
        key: &str,
        what: &str,
        type_id: u32,
        depth: usize,
    ) -> Result<Value, GgufError> {
        Ok(match type_id {
            0 => Value::U8(u8::from_le_bytes(self.array(what)?)),
            1 => Value::I8(i8::from_le_bytes(self.array(what)?)),
            2 => Value::U16(u16::from_le_bytes(self.array(what)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(what)?)),
            4 => Value::U32(u32::from_le_bytes(self.array(what)?)),
            5 => Value::I32(i32::from_le_bytes(self.array(what)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(what)?)),
            7 => Value::Bool(self.array::<1>(what)?[0] != 0),
            8 => Value::String(self.string(what, u64::MAX)?),
            10 => Value::U64(u64::from_le_bytes(self.array(what)?)),
            11 => Value::I64(i64::from_le_bytes(self.array(what)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(what)?)),
            9 if depth < MAX_DEPTH => {
                let elem = self.u32(what)?;
                let count = self.u64(what)?;
                self.plausible(what, count, item_bytes(elem))?;
                self.items_left =
                    self.items_left
                        .checked_sub(count)
                        .ok_or_else(|| GgufError::TooManyItems {
                            what: what.to_owned(),
                            limit: MAX_ITEMS,
                        })?;
                let items = (0..count)
                    .map(|_| self.value(key, what, elem, depth + 1))
                    .collect::<Result<_, _>>()?;
                Value::Array(items)
            }
            _ => {
                return Err(GgufError::BadValueType {
                    key: key.into(),
                    type_id,
                });
            }
        })
    }
}
