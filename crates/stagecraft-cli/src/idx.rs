//! The IDX file format of MNIST: a big-endian header (two zero bytes, an
//! element-type code, the number of dimensions, then each dimension as a
//! `u32`) followed by the elements. We read the two kinds MNIST uses:
//! unsigned-byte images `[n, rows, cols]` (magic `0x00000803`) and
//! unsigned-byte labels `[n]` (magic `0x00000801`), and check everything a
//! corrupt or truncated download could get wrong.

use std::fmt;
use std::path::{Path, PathBuf};

/// The magic number of an unsigned-byte, three-dimensional IDX file.
pub const IMAGES_MAGIC: u32 = 0x0000_0803;
/// The magic number of an unsigned-byte, one-dimensional IDX file.
pub const LABELS_MAGIC: u32 = 0x0000_0801;

/// Labels are digits.
pub const CLASSES: usize = 10;

/// What is wrong with an IDX file; every message names the file.
#[derive(Debug)]
pub struct IdxError {
    path: PathBuf,
    message: String,
}

impl IdxError {
    fn new(path: &Path, message: impl Into<String>) -> IdxError {
        IdxError {
            path: path.to_path_buf(),
            message: message.into(),
        }
    }
}

impl fmt::Display for IdxError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path.display(), self.message)
    }
}

impl std::error::Error for IdxError {}

/// Grey-scale images, one byte per pixel, row-major.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Images {
    /// Number of images.
    pub count: usize,
    /// Rows per image.
    pub rows: usize,
    /// Columns per image.
    pub cols: usize,
    /// `count * rows * cols` pixels.
    pub pixels: Vec<u8>,
}

impl Images {
    /// Pixels per image.
    pub fn pixels_per_image(&self) -> usize {
        self.rows * self.cols
    }

    /// The pixels of image `i`.
    pub fn image(&self, i: usize) -> &[u8] {
        let n = self.pixels_per_image();
        &self.pixels[i * n..(i + 1) * n]
    }
}

/// Reads and checks an images file.
pub fn read_images(path: &Path) -> Result<Images, IdxError> {
    let bytes = read(path)?;
    parse_images(path, &bytes)
}

/// Reads and checks a labels file (every label a digit `0..=9`).
pub fn read_labels(path: &Path) -> Result<Vec<u8>, IdxError> {
    let bytes = read(path)?;
    parse_labels(path, &bytes)
}

fn read(path: &Path) -> Result<Vec<u8>, IdxError> {
    std::fs::read(path).map_err(|e| IdxError::new(path, format!("cannot read the file: {e}")))
}

/// Parses the header: checks the magic number and the rank it implies,
/// and returns the dimensions and where the data starts.
fn header(
    path: &Path,
    bytes: &[u8],
    magic: u32,
    what: &str,
) -> Result<(Vec<usize>, usize), IdxError> {
    if bytes.len() < 4 {
        return Err(IdxError::new(
            path,
            format!(
                "truncated: {} bytes, too short for an IDX header",
                bytes.len()
            ),
        ));
    }
    let found = u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
    if found != magic {
        return Err(IdxError::new(
            path,
            format!(
                "bad magic number 0x{found:08x}: an IDX {what} file starts with 0x{magic:08x} \
                 (is this the right file, or a compressed .gz one?)"
            ),
        ));
    }
    let rank = (magic & 0xff) as usize;
    let data_start = 4 + 4 * rank;
    if bytes.len() < data_start {
        return Err(IdxError::new(
            path,
            format!(
                "truncated: {} bytes, the header of a rank-{rank} IDX file needs {data_start}",
                bytes.len()
            ),
        ));
    }
    let dims = (0..rank)
        .map(|d| {
            let at = 4 + 4 * d;
            u32::from_be_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]) as usize
        })
        .collect::<Vec<_>>();
    let expected = dims
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .and_then(|n| n.checked_add(data_start))
        .ok_or_else(|| IdxError::new(path, format!("dimensions {dims:?} overflow")))?;
    if bytes.len() < expected {
        return Err(IdxError::new(
            path,
            format!(
                "truncated: the header says {what} of dimensions {dims:?} ({expected} bytes), \
                 the file has {} bytes",
                bytes.len()
            ),
        ));
    }
    if bytes.len() > expected {
        return Err(IdxError::new(
            path,
            format!(
                "{} bytes of trailing data after {what} of dimensions {dims:?}",
                bytes.len() - expected
            ),
        ));
    }
    Ok((dims, data_start))
}

/// Parses an images file already in memory (`path` names it in errors).
pub fn parse_images(path: &Path, bytes: &[u8]) -> Result<Images, IdxError> {
    let (dims, start) = header(path, bytes, IMAGES_MAGIC, "images")?;
    let (count, rows, cols) = (dims[0], dims[1], dims[2]);
    if count == 0 || rows == 0 || cols == 0 {
        return Err(IdxError::new(
            path,
            format!("empty images: dimensions {dims:?}"),
        ));
    }
    Ok(Images {
        count,
        rows,
        cols,
        pixels: bytes[start..].to_vec(),
    })
}

/// Parses a labels file already in memory (`path` names it in errors).
pub fn parse_labels(path: &Path, bytes: &[u8]) -> Result<Vec<u8>, IdxError> {
    let (dims, start) = header(path, bytes, LABELS_MAGIC, "labels")?;
    if dims[0] == 0 {
        return Err(IdxError::new(path, "no labels"));
    }
    let labels = bytes[start..].to_vec();
    if let Some((i, &bad)) = labels
        .iter()
        .enumerate()
        .find(|(_, &l)| l as usize >= CLASSES)
    {
        return Err(IdxError::new(
            path,
            format!("label {i} is {bad}, outside the digit range 0..=9"),
        ));
    }
    Ok(labels)
}

/// The bytes of an IDX images file (tests and fuzz seeds make data with
/// it).
pub fn encode_images(images: &Images) -> Vec<u8> {
    let mut out = Vec::with_capacity(16 + images.pixels.len());
    out.extend_from_slice(&IMAGES_MAGIC.to_be_bytes());
    for d in [images.count, images.rows, images.cols] {
        out.extend_from_slice(&(d as u32).to_be_bytes());
    }
    out.extend_from_slice(&images.pixels);
    out
}

/// The bytes of an IDX labels file.
pub fn encode_labels(labels: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + labels.len());
    out.extend_from_slice(&LABELS_MAGIC.to_be_bytes());
    out.extend_from_slice(&(labels.len() as u32).to_be_bytes());
    out.extend_from_slice(labels);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn images() -> Images {
        Images {
            count: 2,
            rows: 2,
            cols: 3,
            pixels: (0..12).collect(),
        }
    }

    fn p() -> &'static Path {
        Path::new("data/x-idx")
    }

    #[test]
    fn round_trips() {
        let img = images();
        let parsed = parse_images(p(), &encode_images(&img)).unwrap();
        assert_eq!(parsed, img);
        assert_eq!(parsed.image(1), &[6, 7, 8, 9, 10, 11]);
        let labels = vec![0, 9, 3];
        assert_eq!(parse_labels(p(), &encode_labels(&labels)).unwrap(), labels);
    }

    #[test]
    fn bad_magic_names_the_file_and_both_numbers() {
        let bytes = encode_labels(&[1, 2]);
        let e = parse_images(p(), &bytes).unwrap_err().to_string();
        assert!(
            e.starts_with("data/x-idx: bad magic number 0x00000801"),
            "{e}"
        );
        assert!(e.contains("0x00000803"), "{e}");
        // A gzip file's first bytes.
        let e = parse_labels(p(), &[0x1f, 0x8b, 8, 0, 0, 0])
            .unwrap_err()
            .to_string();
        assert!(e.contains("bad magic number 0x1f8b0800"), "{e}");
    }

    #[test]
    fn truncation_is_reported_with_sizes() {
        let bytes = encode_images(&images());
        let e = parse_images(p(), &bytes[..bytes.len() - 1])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("truncated") && e.contains("[2, 2, 3] (28 bytes)"),
            "{e}"
        );
        assert!(e.contains("has 27 bytes"), "{e}");
        let e = parse_images(p(), &bytes[..10]).unwrap_err().to_string();
        assert!(e.contains("header of a rank-3 IDX file needs 16"), "{e}");
        let e = parse_labels(p(), &[0, 0]).unwrap_err().to_string();
        assert!(e.contains("too short"), "{e}");
    }

    #[test]
    fn trailing_bytes_and_empty_files_are_errors() {
        let mut bytes = encode_labels(&[1, 2]);
        bytes.push(0);
        let e = parse_labels(p(), &bytes).unwrap_err().to_string();
        assert!(e.contains("1 bytes of trailing data"), "{e}");
        let e = parse_labels(p(), &encode_labels(&[]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("no labels"), "{e}");
    }

    #[test]
    fn labels_must_be_digits() {
        let e = parse_labels(p(), &encode_labels(&[1, 2, 10]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("label 2 is 10, outside the digit range"), "{e}");
    }

    #[test]
    fn a_missing_file_says_so() {
        let e = read_labels(Path::new("/nonexistent/labels"))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("/nonexistent/labels: cannot read the file"),
            "{e}"
        );
    }
}
