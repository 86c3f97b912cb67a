use bulkhead_kernels::DType;
use bulkhead_kernels::quant::quantize_row;

use super::*;

fn sample() -> GgufWriter {
    let mut w = GgufWriter::new();
    w.meta("general.architecture", Value::String("llama".into()))
        .meta("llama.block_count", Value::U32(2))
        .meta(
            "tokenizer.ggml.tokens",
            Value::Array(vec![Value::String("a".into()), Value::String("b".into())]),
        )
        .tensor(
            "norm",
            &[32],
            DType::F32,
            quantize_row(DType::F32, &[0.5; 32]),
        )
        .tensor(
            "w",
            &[64, 3],
            DType::Q4_1,
            quantize_row(DType::Q4_1, &[1.0; 192]),
        );
    w
}

fn parse_bytes(bytes: &[u8]) -> Result<Gguf, GgufError> {
    let dir = std::env::temp_dir().join(format!(
        "bulkhead-gguf-{}-{}",
        std::process::id(),
        rand::random::<u64>()
    ));
    std::fs::write(&dir, bytes).expect("write temp file");
    let r = Gguf::open(&dir);
    let _ = std::fs::remove_file(&dir);
    r
}

#[test]
fn a_written_file_reads_back() {
    let g = parse_bytes(&sample().to_bytes()).unwrap();
    assert_eq!(g.version(), 3);
    assert_eq!(g.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(g.get_count("llama.block_count").unwrap(), 2);
    assert_eq!(g.get_strings("tokenizer.ggml.tokens").unwrap(), ["a", "b"]);
    assert_eq!(g.vector("norm", 32).unwrap(), vec![0.5; 32]);
    let m = g.matrix("w", 3, 64).unwrap();
    assert_eq!((m.rows(), m.cols(), m.dtype()), (3, 64, DType::Q4_1));
}

#[test]
fn every_truncation_is_an_error_not_a_panic() {
    let bytes = sample().to_bytes();
    // The last tensor ("w", 120 bytes at data offset 128) ends 8 bytes before the file's
    // final alignment padding; cutting only padding leaves a valid file.
    let end_of_data = bytes.len() - 8;
    for len in 0..end_of_data {
        assert!(
            parse_bytes(&bytes[..len]).is_err(),
            "truncated to {len} bytes parsed"
        );
    }
    assert!(parse_bytes(&bytes[..end_of_data]).is_ok());
}

#[test]
fn corrupt_bytes_never_panic() {
    let bytes = sample().to_bytes();
    let mut seed = 0x9e37_79b9_u32;
    for _ in 0..400 {
        let mut b = bytes.clone();
        for _ in 0..3 {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let at = seed as usize % b.len();
            b[at] = (seed >> 24) as u8;
        }
        let _ = parse_bytes(&b);
    }
}

#[test]
fn errors_name_the_field_at_fault() {
    let err = |bytes: &[u8]| parse_bytes(bytes).unwrap_err().to_string();
    assert!(err(b"GGML\x03\0\0\0").contains("not a GGUF file"));
    let mut v9 = sample().to_bytes();
    v9[4] = 9;
    assert!(err(&v9).contains("version 9"));

    let mut w = GgufWriter::new();
    w.tensor("blk.0.ffn_up.weight", &[256], DType::Q8_0, vec![0; 8 * 34]);
    let mut bytes = w.to_bytes();
    // The type id sits 12 bytes before the end of the only tensor info (type u32, offset u64).
    let info_end = 24 + 8 + "blk.0.ffn_up.weight".len() + 4 + 8 + 4 + 8;
    bytes[info_end - 12..info_end - 8].copy_from_slice(&12u32.to_le_bytes());
    let msg = err(&bytes);
    assert!(
        msg.contains("blk.0.ffn_up.weight") && msg.contains("Q4_K"),
        "{msg}"
    );

    let g = parse_bytes(&sample().to_bytes()).unwrap();
    assert!(
        g.get_count("llama.context_length")
            .unwrap_err()
            .to_string()
            .contains("llama.context_length")
    );
    assert!(
        g.get_str("llama.block_count")
            .unwrap_err()
            .to_string()
            .contains("should be a string")
    );
    assert!(
        g.matrix("w", 64, 3)
            .unwrap_err()
            .to_string()
            .contains("\"w\"")
    );
}

#[test]
fn a_tensor_past_the_end_is_out_of_bounds() {
    let mut w = GgufWriter::new();
    w.tensor("t", &[32], DType::F32, vec![0; 128]);
    let bytes = w.to_bytes();
    let msg = parse_bytes(&bytes[..bytes.len() - 4])
        .unwrap_err()
        .to_string();
    assert!(msg.contains("\"t\"") && msg.contains("outside"), "{msg}");
}

/// An array of a million one-byte items is a megabyte of file and was 32 MB of memory: the
/// metadata's arrays are held to a number of items in all, whatever the file's size.
#[test]
fn the_metadata_arrays_are_held_to_a_number_of_items_in_all() {
    let file = |count: u64| {
        let mut b = Vec::new();
        b.extend(b"GGUF");
        b.extend(3u32.to_le_bytes());
        b.extend(0u64.to_le_bytes()); // tensors
        b.extend(1u64.to_le_bytes()); // metadata keys
        let key = b"x.bytes";
        b.extend((key.len() as u64).to_le_bytes());
        b.extend(key);
        b.extend(9u32.to_le_bytes()); // an array
        b.extend(0u32.to_le_bytes()); // of u8
        b.extend(count.to_le_bytes());
        b.resize(b.len() + count as usize, 7);
        b
    };
    let g = parse_bytes(&file(1000)).expect("a thousand items");
    assert!(matches!(g.get("x.bytes"), Ok(Value::Array(a)) if a.len() == 1000));
    let e = parse_bytes(&file((4 << 20) + 1)).expect_err("refused");
    assert!(matches!(e, GgufError::TooManyItems { .. }), "{e}");
}

/// Two tensors pointed at the same bytes: a small file that would be unpacked once per tensor
/// (a hundred thousand layers over one layer's data) is refused as it is read.
#[test]
fn tensors_that_share_bytes_are_refused() {
    let mut w = GgufWriter::new();
    w.tensor("a", &[32], DType::F32, vec![0; 128])
        .tensor("b", &[32], DType::F32, vec![0; 128]);
    let mut bytes = w.to_bytes();
    assert!(parse_bytes(&bytes).is_ok(), "one after the other");
    // b's info is the last in the header: its offset is the 8 bytes before the padding to
    // the data section. Point it at a's bytes, then into their middle.
    let b_offset = bytes
        .windows(8)
        .rposition(|w| w == 128u64.to_le_bytes())
        .expect("b's offset");
    for offset in [0u64, 64] {
        bytes[b_offset..b_offset + 8].copy_from_slice(&offset.to_le_bytes());
        let e = parse_bytes(&bytes).expect_err("overlapping");
        assert!(matches!(e, GgufError::Overlapping { .. }), "{e}");
        assert!(e.to_string().contains("\"a\" and \"b\""), "{e}");
    }
}

/// A long key over a long array was named again for every item: its copies grew with their
/// product (a 4 MB file took minutes).
#[test]
fn a_long_key_over_a_long_array_reads_in_time() {
    let key = "k".repeat((64 << 10) - 1);
    let count = 1u64 << 20;
    let mut b = Vec::new();
    b.extend(b"GGUF");
    b.extend(3u32.to_le_bytes());
    b.extend(0u64.to_le_bytes()); // tensors
    b.extend(1u64.to_le_bytes()); // metadata keys
    b.extend((key.len() as u64).to_le_bytes());
    b.extend(key.as_bytes());
    b.extend(9u32.to_le_bytes()); // an array
    b.extend(0u32.to_le_bytes()); // of u8
    b.extend(count.to_le_bytes());
    b.resize(b.len() + count as usize, 7);
    let started = std::time::Instant::now();
    let g = parse_bytes(&b).expect("a valid file");
    assert!(matches!(g.get(&key), Ok(Value::Array(a)) if a.len() == count as usize));
    assert!(
        started.elapsed() < std::time::Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn a_fifo_is_refused_without_blocking() {
    let path = std::env::temp_dir().join(format!(
        "bulkhead-gguf-fifo-{}-{}",
        std::process::id(),
        rand::random::<u64>()
    ));
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).expect("a path");
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let (tx, rx) = std::sync::mpsc::channel();
    let opening = path.clone();
    std::thread::spawn(move || {
        let _ = tx.send(Gguf::open(&opening).map(|_| ()).map_err(|e| e.to_string()));
    });
    let opened = rx.recv_timeout(std::time::Duration::from_secs(5));
    let _ = std::fs::remove_file(&path);
    let e = opened.expect("answered at once").expect_err("refused");
    assert!(e.contains("not a regular file"), "{e}");
}

/// The header of a metadata count and `keys` keys (with their bytes), cut after the last key.
fn header_with_keys(count: u64, keys: &[&[u8]]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend(b"GGUF");
    b.extend(3u32.to_le_bytes());
    b.extend(0u64.to_le_bytes()); // tensors
    b.extend(count.to_le_bytes());
    for key in keys {
        b.extend((key.len() as u64).to_le_bytes());
        b.extend(*key);
    }
    b
}

/// A key past GGUF's 65 535 bytes is refused before it is copied, and one within it is quoted
/// cut in errors: a 60 KB key of control bytes made every error about it (and the log line
/// saying it) several hundred KB of escapes.
#[test]
fn a_long_key_is_refused_or_quoted_short() {
    let e = parse_bytes(&header_with_keys(1, &[&[b'k'; 70_000]])).expect_err("refused");
    assert!(matches!(e, GgufError::TooLong { len: 70_000, .. }), "{e}");
    let e = parse_bytes(&header_with_keys(1, &[&[0x7f; 60_000]])).expect_err("truncated");
    let said = e.to_string();
    assert!(matches!(e, GgufError::Truncated { .. }), "{said}");
    assert!(said.len() < 1_000, "{} bytes: {}", said.len(), &said[..200]);
    let mut dup = header_with_keys(2, &[]);
    for _ in 0..2 {
        dup.extend(&header_with_keys(1, &[&[0x7f; 60_000]])[24..]);
        dup.extend(7u32.to_le_bytes()); // a bool
        dup.push(1);
    }
    let said = parse_bytes(&dup).expect_err("twice").to_string();
    assert!(
        said.contains("appears twice") && said.len() < 1_000,
        "{said:.200}"
    );
}

/// A file declaring more metadata entries or tensors than any model has is refused before
/// they are read: each costs memory well past its bytes in the file.
#[test]
fn more_entries_than_any_model_has_are_refused() {
    let mut b = header_with_keys(70_000, &[]);
    b.resize(2 << 20, 0);
    let e = parse_bytes(&b).expect_err("refused");
    assert!(
        matches!(
            e,
            GgufError::TooMany {
                what: "metadata entries",
                count: 70_000,
                ..
            }
        ),
        "{e}"
    );
    b[8..16].copy_from_slice(&70_000u64.to_le_bytes());
    b[16..24].copy_from_slice(&0u64.to_le_bytes());
    let e = parse_bytes(&b).expect_err("refused");
    assert!(
        matches!(
            e,
            GgufError::TooMany {
                what: "tensors",
                ..
            }
        ),
        "{e}"
    );
}

/// A header past its bound is refused where it passes it, not copied into memory whole.
#[test]
fn a_header_past_its_bound_is_refused() {
    let value = reader::MAX_HEADER_BYTES;
    let mut b = header_with_keys(1, &[b"general.huge"]);
    b.extend(8u32.to_le_bytes()); // a string
    b.extend((value as u64).to_le_bytes());
    b.resize(b.len() + value, b'x');
    let e = parse_bytes(&b).expect_err("refused");
    assert!(matches!(e, GgufError::HeaderTooLarge { .. }), "{e}");
}

/// A big-endian file says so, not that its version (byte-swapped) is unknown.
#[test]
fn a_big_endian_file_is_named_as_such() {
    let mut b = sample().to_bytes();
    b[4..8].copy_from_slice(&3u32.to_be_bytes());
    let e = parse_bytes(&b).expect_err("refused");
    assert!(matches!(e, GgufError::BigEndian), "{e}");
}
