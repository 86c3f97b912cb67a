use std::path::Path;

use bulkhead_kernels::DType;

use super::{DEFAULT_ALIGNMENT, MAGIC, Value, ggml_from_dtype};

/// Builds a GGUF v3 file in memory: metadata in insertion order, tensors aligned to 32 bytes.
#[derive(Debug, Default)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    tensors: Vec<(String, Vec<usize>, DType, Vec<u8>)>,
}

impl GgufWriter {
    pub fn new() -> GgufWriter {
        GgufWriter::default()
    }

    /// Sets metadata `key` (a key set again takes the new value: a file holds each key once).
    pub fn meta(&mut self, key: &str, value: Value) -> &mut Self {
        match self.metadata.iter_mut().find(|(k, _)| k == key) {
            Some((_, v)) => *v = value,
            None => self.metadata.push((key.into(), value)),
        }
        self
    }

    /// Sets tensor `name` to `dims` (innermost first) holding `bytes` already encoded as
    /// `dtype` (in place of one of that name set before).
    pub fn tensor(
        &mut self,
        name: &str,
        dims: &[usize],
        dtype: DType,
        bytes: Vec<u8>,
    ) -> &mut Self {
        let tensor = (name.into(), dims.to_vec(), dtype, bytes);
        match self.tensors.iter_mut().find(|t| t.0 == name) {
            Some(t) => *t = tensor,
            None => self.tensors.push(tensor),
        }
        self
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend(MAGIC.to_le_bytes());
        out.extend(3u32.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            put_string(&mut out, key);
            out.extend(value.type_id().to_le_bytes());
            put_value(&mut out, value);
        }
        let align = DEFAULT_ALIGNMENT as usize;
        let mut offset = 0usize;
        for (name, dims, dtype, bytes) in &self.tensors {
            put_string(&mut out, name);
            out.extend((dims.len() as u32).to_le_bytes());
            dims.iter()
                .for_each(|&d| out.extend((d as u64).to_le_bytes()));
            out.extend(ggml_from_dtype(*dtype).to_le_bytes());
            out.extend((offset as u64).to_le_bytes());
            offset = (offset + bytes.len()).next_multiple_of(align);
        }
        out.resize(out.len().next_multiple_of(align), 0);
        for (_, _, _, bytes) in &self.tensors {
            out.extend(bytes);
            out.resize(out.len().next_multiple_of(align), 0);
        }
        out
    }

    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        std::fs::write(path, self.to_bytes())
    }

    /// The file as [`super::Gguf::open`] reads it (written to a temporary file, removed again).
    #[cfg(test)]
    pub fn opened(&self) -> Result<super::Gguf, super::GgufError> {
        let path = std::env::temp_dir().join(format!(
            "bulkhead-gguf-{}-{}.gguf",
            std::process::id(),
            rand::random::<u64>()
        ));
        self.write(&path).expect("writes a temporary file");
        let g = super::Gguf::open(&path);
        let _ = std::fs::remove_file(&path);
        g
    }
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::U8(v) => out.extend(v.to_le_bytes()),
        Value::I8(v) => out.extend(v.to_le_bytes()),
        Value::U16(v) => out.extend(v.to_le_bytes()),
        Value::I16(v) => out.extend(v.to_le_bytes()),
        Value::U32(v) => out.extend(v.to_le_bytes()),
        Value::I32(v) => out.extend(v.to_le_bytes()),
        Value::U64(v) => out.extend(v.to_le_bytes()),
        Value::I64(v) => out.extend(v.to_le_bytes()),
        Value::F32(v) => out.extend(v.to_le_bytes()),
        Value::F64(v) => out.extend(v.to_le_bytes()),
        Value::Bool(v) => out.push(u8::from(*v)),
        Value::String(s) => put_string(out, s),
        Value::Array(items) => {
            let elem = items.first().map_or(Value::U8(0).type_id(), Value::type_id);
            out.extend(elem.to_le_bytes());
            out.extend((items.len() as u64).to_le_bytes());
            items.iter().for_each(|i| put_value(out, i));
        }
    }
}
