//! GGUF model files: metadata, tensor directory and tensor bytes.
//!
//! [`Gguf::open`] memory-maps a file and parses its header completely before anything reads a
//! tensor: every length, count, offset and tensor extent is checked against the file, so a
//! corrupt, truncated or hostile file yields a [`GgufError`] naming the field or tensor, never
//! a panic or an out-of-bounds read. [`GgufWriter`] writes files (test models, tools).

mod error;
mod reader;
mod value;
mod writer;

pub use error::GgufError;
pub use reader::{Gguf, TensorInfo};
pub use value::Value;
pub use writer::GgufWriter;

/// `"GGUF"` read as a little-endian u32.
const MAGIC: u32 = 0x4655_4747;
/// The versions this reader understands (2 and 3 share the layout).
const VERSIONS: [u32; 2] = [2, 3];
/// Alignment of the tensor data when `general.alignment` is absent.
const DEFAULT_ALIGNMENT: u64 = 32;

/// ggml's numeric type ids, for the types this engine computes with.
fn dtype_from_ggml(id: u32) -> Option<bulkhead_kernels::DType> {
    use bulkhead_kernels::DType;
    Some(match id {
        0 => DType::F32,
        1 => DType::F16,
        2 => DType::Q4_0,
        3 => DType::Q4_1,
        8 => DType::Q8_0,
        _ => return None,
    })
}

fn ggml_from_dtype(dtype: bulkhead_kernels::DType) -> u32 {
    use bulkhead_kernels::DType;
    match dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Q4_0 => 2,
        DType::Q4_1 => 3,
        DType::Q8_0 => 8,
    }
}

/// A human name for a ggml type id, for error messages about types we do not support.
fn ggml_type_name(id: u32) -> &'static str {
    const NAMES: [&str; 31] = [
        "F32", "F16", "Q4_0", "Q4_1", "Q4_2", "Q4_3", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K",
        "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL",
        "IQ3_S", "IQ2_S", "IQ4_XS", "I8", "I16", "I32", "I64", "F64", "IQ1_M", "BF16",
    ];
    NAMES.get(id as usize).copied().unwrap_or("unknown")
}

#[cfg(test)]
mod tests;
