use std::path::PathBuf;

/// Why a GGUF file cannot be used. Each variant names the field or tensor at fault.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("not a GGUF file (magic {found:#010x}, expected 0x46554747 \"GGUF\")")]
    BadMagic { found: u32 },
    #[error("GGUF version {version} is not supported (supported: 2, 3)")]
    UnsupportedVersion { version: u32 },
    #[error(
        "a big-endian GGUF file (its version reads byte-swapped): only little-endian files are supported"
    )]
    BigEndian,
    #[error("the header (metadata and tensor infos) runs past {limit} bytes")]
    HeaderTooLarge { limit: usize },
    #[error("{what} is {len} bytes long, more than the {limit} taken")]
    TooLong { what: String, len: u64, limit: u64 },
    #[error("the file declares {count} {what}, more than the {limit} taken")]
    TooMany {
        what: &'static str,
        count: u64,
        limit: u64,
    },
    #[error("file truncated while reading {what} at byte {offset}")]
    Truncated { what: String, offset: u64 },
    /// `key` quoted, and cut when long.
    #[error("metadata key {key} has unknown value type {type_id}")]
    BadValueType { key: String, type_id: u32 },
    #[error("{what} is not valid UTF-8")]
    BadUtf8 { what: String },
    #[error("{what} declares {count} items, more than the file can hold")]
    ImplausibleCount { what: String, count: u64 },
    #[error("{what} takes the metadata's arrays past {limit} items in all")]
    TooManyItems { what: String, limit: u64 },
    /// `key` quoted, and cut when long.
    #[error("metadata key {key} appears twice")]
    DuplicateKey { key: String },
    #[error("tensor {name:?} appears twice")]
    DuplicateTensor { name: String },
    #[error("metadata key {key:?} is missing")]
    MissingKey { key: String },
    #[error("metadata key {key:?} should be {expected}, found {found}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: &'static str,
    },
    #[error("metadata key {key:?} has invalid value: {reason}")]
    BadValue { key: String, reason: String },
    #[error("tensor {name:?} is missing")]
    MissingTensor { name: String },
    #[error(
        "tensor {name:?} has type {type_name} (id {type_id}), which is not supported (supported: F32, F16, Q4_0, Q4_1, Q8_0)"
    )]
    UnsupportedTensorType {
        name: String,
        type_id: u32,
        type_name: &'static str,
    },
    #[error("tensor {name:?} has a bad shape {dims:?}: {reason}")]
    BadShape {
        name: String,
        dims: Vec<u64>,
        reason: String,
    },
    #[error(
        "tensor {name:?} data [{start}, {end}) lies outside the file's data section ({len} bytes)"
    )]
    OutOfBounds {
        name: String,
        start: u64,
        end: u64,
        len: u64,
    },
    #[error("tensors {first:?} and {second:?} share bytes: a model file's tensors never do")]
    Overlapping { first: String, second: String },
    #[error(
        "{count} tensors the model does not compute with, among them {names:?}: a file with weights this engine would leave out (biases, more layers than it declares) would load and answer wrongly"
    )]
    UnusedTensors { count: usize, names: Vec<String> },
    #[error("tensor {name:?} data offset {offset} is not aligned to {alignment}")]
    Misaligned {
        name: String,
        offset: u64,
        alignment: u64,
    },
}
