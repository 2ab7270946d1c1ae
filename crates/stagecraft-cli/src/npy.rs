//! NumPy `.npy` files (format versions 1.0, 2.0 and 3.0): what
//! `stagecraft onnx run` reads its inputs from and writes its outputs to.
//!
//! A file is the magic `\x93NUMPY`, a version, a header length, a Python
//! dict literal with `descr`, `fortran_order` and `shape`, padded so the
//! data starts on a 64-byte boundary, then the elements in C order. Only
//! little-endian (or byte-sized) `f32`, `f64`, `f16`, `i64`, `i32`, `i16`,
//! `i8`, `u64`, `u32`, `u16`, `u8` and `bool` in C order are supported; anything else is a clear
//! error naming the file.

use crate::error::{CliError, Result};
use stagecraft::layers::tensor::{Buffer, DenseHostTensor, TensorMetadata};
use stagecraft::{DType, Shape};
use std::path::Path;

const MAGIC: &[u8] = b"\x93NUMPY";

/// The `descr` NumPy writes for `dtype`, if `.npy` files here support it.
pub fn descr_of(dtype: DType) -> Option<&'static str> {
    Some(match dtype {
        DType::F32 => "<f4",
        DType::F64 => "<f8",
        DType::F16 => "<f2",
        DType::I64 => "<i8",
        DType::I32 => "<i4",
        DType::I8 => "|i1",
        DType::U8 => "|u1",
        DType::I16 => "<i2",
        DType::U16 => "<u2",
        DType::U32 => "<u4",
        DType::U64 => "<u8",
        DType::Bool => "|b1",
        _ => return None,
    })
}

/// The dtype of a `descr`, if supported.
fn dtype_of(descr: &str) -> Option<DType> {
    // Byte-sized types may be written with any byte-order mark.
    let (order, code) = descr.split_at(1.min(descr.len()));
    let code = if matches!(order, "<" | "|" | "=") {
        code
    } else {
        return None;
    };
    Some(match code {
        "f4" => DType::F32,
        "f8" => DType::F64,
        "f2" => DType::F16,
        "i8" => DType::I64,
        "i4" => DType::I32,
        "i1" => DType::I8,
        "u1" => DType::U8,
        "i2" => DType::I16,
        "u2" => DType::U16,
        "u4" => DType::U32,
        "u8" => DType::U64,
        "b1" => DType::Bool,
        _ => return None,
    })
}

/// The value of `key` in a header dict literal: the text after `'key':`
/// up to the matching end (a quoted string, a parenthesized tuple or a
/// bare word).
fn field<'a>(header: &'a str, key: &str) -> Option<&'a str> {
    let pat_single = format!("'{key}'");
    let pat_double = format!("\"{key}\"");
    let start = header
        .find(&pat_single)
        .map(|i| i + pat_single.len())
        .or_else(|| header.find(&pat_double).map(|i| i + pat_double.len()))?;
    let rest = header[start..].trim_start().strip_prefix(':')?.trim_start();
    let end = match rest.chars().next()? {
        '\'' | '"' => {
            let q = rest.chars().next()?;
            rest[1..].find(q)? + 2
        }
        '(' => rest.find(')')? + 1,
        _ => rest.find([',', '}']).unwrap_or(rest.len()),
    };
    Some(rest[..end].trim())
}

/// Parses an `.npy` file's bytes; `name` is used in errors.
pub fn decode(bytes: &[u8], name: &str) -> Result<DenseHostTensor> {
    let bad = |why: &str| CliError::new(format!("{name}: not a valid .npy file: {why}"));
    if bytes.len() < 10 || &bytes[..6] != MAGIC {
        return Err(bad("no \\x93NUMPY magic"));
    }
    let major = bytes[6];
    let (header_len, start) = match major {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 => {
            if bytes.len() < 12 {
                return Err(bad("truncated header"));
            }
            (
                u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
                12,
            )
        }
        v => return Err(bad(&format!("format version {v} is unknown"))),
    };
    let data_start = start + header_len;
    if bytes.len() < data_start {
        return Err(bad("truncated header"));
    }
    let header = std::str::from_utf8(&bytes[start..data_start])
        .map_err(|_| bad("the header is not text"))?;
    let descr = field(header, "descr").ok_or_else(|| bad("the header has no descr"))?;
    let descr = descr.trim_matches(|c| c == '\'' || c == '"');
    let dtype = dtype_of(descr).ok_or_else(|| {
        CliError::new(format!(
            "{name}: unsupported .npy dtype '{descr}' (supported: little-endian f4, f8, f2, i8, i4, i2, i1, u8, u4, u2, u1, b1)"
        ))
    })?;
    match field(header, "fortran_order") {
        Some("False") => {}
        Some("True") => {
            return Err(CliError::new(format!(
            "{name}: Fortran-order .npy files are not supported (save with np.ascontiguousarray)"
        )))
        }
        _ => return Err(bad("the header has no fortran_order")),
    }
    let shape = field(header, "shape").ok_or_else(|| bad("the header has no shape"))?;
    let dims: Vec<usize> = shape
        .trim_start_matches('(')
        .trim_end_matches(')')
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<usize>()
                .map_err(|_| bad("a dimension is not a number"))
        })
        .collect::<Result<_>>()?;
    let meta = TensorMetadata::new(dtype, Shape::from(dims));
    let len = meta.shape.numel() * dtype.size_in_bytes();
    let data = &bytes[data_start..];
    if data.len() != len {
        return Err(bad(&format!(
            "the shape needs {len} bytes of data, the file has {}",
            data.len()
        )));
    }
    if dtype == DType::Bool && data.iter().any(|&b| b > 1) {
        return Err(bad("a bool is neither 0 nor 1"));
    }
    Ok(DenseHostTensor::from_buffer(meta, Buffer::copy_of(data))?)
}

/// Reads an `.npy` file.
pub fn read(path: &Path) -> Result<DenseHostTensor> {
    let bytes = std::fs::read(path)
        .map_err(|e| CliError::new(format!("cannot read {}: {e}", path.display())))?;
    decode(&bytes, &path.display().to_string())
}

/// The bytes of `t` as an `.npy` file (format 1.0, C order).
pub fn encode(t: &DenseHostTensor) -> Result<Vec<u8>> {
    let descr = descr_of(t.dtype()).ok_or_else(|| {
        CliError::new(format!("a {} tensor cannot be written as .npy", t.dtype()))
    })?;
    let dims = t.shape().dims();
    let shape = match dims {
        [d] => format!("({d},)"),
        _ => format!(
            "({})",
            dims.iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    // Pad with spaces and a newline so the data starts on 64 bytes.
    let unpadded = MAGIC.len() + 4 + header.len() + 1;
    header.push_str(&" ".repeat((64 - unpadded % 64) % 64));
    header.push('\n');
    let header_len = u16::try_from(header.len())
        .map_err(|_| CliError::new("an .npy header longer than 65535 bytes"))?;
    let len = t.numel() * t.dtype().size_in_bytes();
    let mut out = Vec::with_capacity(10 + header.len() + len);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&[1, 0]);
    out.extend_from_slice(&header_len.to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(&t.buffer().bytes()[..len]);
    Ok(out)
}

/// Writes `t` to `path` as an `.npy` file.
pub fn write(path: &Path, t: &DenseHostTensor) -> Result<()> {
    std::fs::write(path, encode(t)?)
        .map_err(|e| CliError::new(format!("cannot write {}: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_every_supported_dtype() {
        let f = DenseHostTensor::from_slice(&[1.5f32, -2.0, 3.25, 0.0, 7.0, 8.0], [2, 3]).unwrap();
        let back = decode(&encode(&f).unwrap(), "f.npy").unwrap();
        assert_eq!(back.shape().dims(), &[2, 3]);
        assert_eq!(back.to_vec::<f32>().unwrap(), f.to_vec::<f32>().unwrap());
        let i = DenseHostTensor::from_slice(&[-1i64, 5], [2]).unwrap();
        let back = decode(&encode(&i).unwrap(), "i.npy").unwrap();
        assert_eq!(back.to_vec::<i64>().unwrap(), vec![-1, 5]);
        let b = DenseHostTensor::from_slice(&[true], Shape::scalar()).unwrap();
        let bytes = encode(&b).unwrap();
        assert_eq!((bytes.len() - 1) % 64, 0, "data starts on 64 bytes");
        let back = decode(&bytes, "b.npy").unwrap();
        assert_eq!(back.shape().dims(), &[] as &[usize]);
        assert_eq!(back.to_vec::<bool>().unwrap(), vec![true]);
    }

    #[test]
    fn reads_what_numpy_writes() {
        // np.save of np.arange(3, dtype='<i4'), as NumPy 1.x writes it.
        let mut bytes = b"\x93NUMPY\x01\x00v\x00".to_vec();
        let mut header = "{'descr': '<i4', 'fortran_order': False, 'shape': (3,), }".to_string();
        header.push_str(&" ".repeat(118 - header.len() - 1));
        header.push('\n');
        bytes.extend_from_slice(header.as_bytes());
        for v in [0i32, 1, 2] {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        let t = decode(&bytes, "a.npy").unwrap();
        assert_eq!(t.to_vec::<i32>().unwrap(), vec![0, 1, 2]);
    }

    /// `bytes` with the first `from` replaced by `to` (of the same length).
    fn patched(mut bytes: Vec<u8>, from: &str, to: &str) -> Vec<u8> {
        let at = bytes
            .windows(from.len())
            .position(|w| w == from.as_bytes())
            .expect("the pattern is in the header");
        bytes[at..at + to.len()].copy_from_slice(to.as_bytes());
        bytes
    }

    #[test]
    fn unsupported_files_are_clear_errors() {
        let f = encode(&DenseHostTensor::from_slice(&[1.0f64], [1]).unwrap()).unwrap();
        let e = decode(&patched(f, "<f8", ">f8"), "big.npy")
            .unwrap_err()
            .to_string();
        assert!(e.contains("big.npy") && e.contains(">f8"), "{e}");
        let g = encode(&DenseHostTensor::from_slice(&[1.0f32], [1]).unwrap()).unwrap();
        let g = patched(g, "'fortran_order': False", "'fortran_order': True ");
        let e = decode(&g, "f.npy").unwrap_err().to_string();
        assert!(e.contains("Fortran"), "{e}");
        let e = decode(b"hello", "x.npy").unwrap_err().to_string();
        assert!(e.contains("x.npy: not a valid .npy file"), "{e}");
        let mut h = encode(&DenseHostTensor::from_slice(&[1.0f32, 2.0], [2]).unwrap()).unwrap();
        h.pop();
        let e = decode(&h, "t.npy").unwrap_err().to_string();
        assert!(e.contains("needs 8 bytes"), "{e}");
    }
}
