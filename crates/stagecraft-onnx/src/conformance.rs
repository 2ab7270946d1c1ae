//! The ONNX backend test suite: fetching its data and running its cases.
//!
//! The data is the `onnx/backend/test/data/` folder of the onnx 1.22.0
//! wheel (`node`, `simple`, `pytorch-converted`, `pytorch-operator`,
//! `light`, `real`). [`ensure_data`] fetches the wheel with `python3 -m pip
//! download` (pinned to one platform's wheel, so one SHA-256 checks it on
//! any host), checks its size and digest, and extracts the folder with
//! Python's `zipfile` into the data directory: `data/onnx/` by default,
//! `$STAGECRAFT_ONNX_DATA` or a caller's directory otherwise. Offline, the
//! error says how to get the wheel by hand.
//!
//! Each case is a folder with `model.onnx` and `test_data_set_*/` holding
//! `input_*.pb` and `output_*.pb` (`TensorProto`s). [`run_case`] runs one
//! and compares with the onnx runner's tolerances (rtol 1e-3, atol 1e-7);
//! [`Report`] collects outcomes and writes the markdown summary.

use crate::error::{OnnxError, OnnxErrorKind, Result};
use crate::model::{Mode, Model};
use crate::proto::TensorProto;
use crate::tensor::decode;
use prost::Message;
use stagecraft_fetch as fetch;
use stagecraft_tensor::DenseHostTensor;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The PyPI requirement the test data comes from.
pub const PACKAGE: &str = "onnx==1.22.0";
/// The wheel `pip download` saves (one platform's, pinned by the flags).
pub const WHEEL: &str = "onnx-1.22.0-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl";
const WHEEL_LEN: usize = 19_110_720;
const WHEEL_SHA256: &str = "1d0a2bdb15eb2b3cb65c438f3423d9620d14fdce32f92380e6bb1b2e09568ef5";
/// The environment variable naming a data directory.
pub const DATA_ENV: &str = "STAGECRAFT_ONNX_DATA";
/// Written into the data directory once extraction completed.
const MARKER: &str = ".complete-onnx-1.22.0";
/// The suite's categories, as folders of the data directory.
pub const CATEGORIES: &[&str] = &[
    "node",
    "simple",
    "pytorch-converted",
    "pytorch-operator",
    "light",
];
/// Relative tolerance of a comparison.
pub const RTOL: f64 = 1e-3;
/// Absolute tolerance of a comparison.
pub const ATOL: f64 = 1e-7;

/// The data directory: `dir` if given, else `$STAGECRAFT_ONNX_DATA`, else
/// `default`.
pub fn data_dir(dir: Option<&Path>, default: &Path) -> PathBuf {
    match dir {
        Some(d) => d.to_path_buf(),
        None => std::env::var_os(DATA_ENV).map_or_else(|| default.to_path_buf(), PathBuf::from),
    }
}

/// Makes sure `dir` holds the extracted suite, fetching and extracting the
/// wheel into it on first use (progress on stderr). A directory the caller
/// named that holds the categories already is used as it is.
pub fn ensure_data(dir: &Path) -> Result<()> {
    if dir.join(MARKER).exists() || dir.join("node").is_dir() {
        return Ok(());
    }
    std::fs::create_dir_all(dir)
        .map_err(|e| OnnxError::io(format!("cannot create {}: {e}", dir.display())))?;
    fetch::in_scratch(dir, |scratch| fetch_into(dir, scratch))
}

fn by_hand(dir: &Path) -> String {
    format!(
        "to get the data by hand, run `python3 -m pip download --no-deps --only-binary=:all: \
         --platform manylinux_2_28_x86_64 --python-version 3.11 --implementation cp --abi cp311 \
         {PACKAGE}` and unzip its onnx/backend/test/data/* into {} (or point {DATA_ENV} at such \
         a directory)",
        dir.display()
    )
}

fn fetch_into(dir: &Path, scratch: &Path) -> Result<()> {
    eprintln!("fetching the ONNX backend test data from the PyPI wheel {PACKAGE} ...");
    let args = [
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--platform",
        "manylinux_2_28_x86_64",
        "--python-version",
        "3.11",
        "--implementation",
        "cp",
        "--abi",
        "cp311",
        "--dest",
        ".",
        PACKAGE,
    ];
    fetch::run_tool(
        "python3",
        &args,
        scratch,
        &format!("python3 -m pip download {PACKAGE}"),
        &by_hand(dir),
    )?;
    let wheel = scratch.join(WHEEL);
    let bytes = std::fs::read(&wheel).map_err(|e| {
        OnnxError::io(format!(
            "cannot read {}: {e}; {}",
            wheel.display(),
            by_hand(dir)
        ))
    })?;
    fetch::verify(WHEEL, &bytes, WHEEL_LEN, WHEEL_SHA256)?;
    drop(bytes);
    // Extract with Python's zipfile (pip needs Python anyway), into the
    // scratch directory first, then move each category into place.
    let script = "import sys, zipfile\n\
        z = zipfile.ZipFile(sys.argv[1])\n\
        p = 'onnx/backend/test/data/'\n\
        names = [n for n in z.namelist() if n.startswith(p)]\n\
        z.extractall(sys.argv[2], names)\n";
    let out = scratch.join("x");
    let wheel_s = wheel.to_string_lossy().into_owned();
    let out_s = out.to_string_lossy().into_owned();
    fetch::run_tool(
        "python3",
        &["-c", script, &wheel_s, &out_s],
        scratch,
        "python3 -c <extract the test data>",
        &by_hand(dir),
    )?;
    let extracted = out.join("onnx/backend/test/data");
    let entries = std::fs::read_dir(&extracted)
        .map_err(|e| OnnxError::io(format!("cannot read {}: {e}", extracted.display())))?;
    for entry in entries.flatten() {
        let target = dir.join(entry.file_name());
        let _ = std::fs::remove_dir_all(&target);
        std::fs::rename(entry.path(), &target).map_err(|e| {
            OnnxError::io(format!("cannot move data into {}: {e}", target.display()))
        })?;
    }
    std::fs::write(dir.join(MARKER), WHEEL_SHA256)
        .map_err(|e| OnnxError::io(format!("cannot write into {}: {e}", dir.display())))?;
    eprintln!(
        "extracted the ONNX backend test data into {}",
        dir.display()
    );
    Ok(())
}

/// One test case: a folder with `model.onnx` and its data sets.
#[derive(Clone, Debug)]
pub struct Case {
    /// `category/name`.
    pub id: String,
    /// The category folder.
    pub category: String,
    /// The case folder, or for a `light` model its `.onnx` file.
    pub dir: PathBuf,
}

impl Case {
    /// Whether this is a `light` model: one `.onnx` file beside its
    /// expected `<name>_output_0.pb`, run on `arange(n).reshape(shape) / n`.
    pub fn is_light(&self) -> bool {
        self.category == "light"
    }
}

/// The cases of `category` under `root`, sorted by name.
pub fn cases(root: &Path, category: &str) -> Result<Vec<Case>> {
    let dir = root.join(category);
    let entries = std::fs::read_dir(&dir)
        .map_err(|e| OnnxError::io(format!("cannot read {}: {e}", dir.display())))?;
    let light = category == "light";
    let mut v: Vec<Case> = entries
        .flatten()
        .filter(|e| {
            if light {
                e.path().extension().is_some_and(|x| x == "onnx")
            } else {
                e.path().join("model.onnx").exists()
            }
        })
        .map(|e| Case {
            id: format!("{category}/{}", e.file_name().to_string_lossy()),
            category: category.to_string(),
            dir: e.path(),
        })
        .collect();
    v.sort_by(|a, b| a.id.cmp(&b.id));
    Ok(v)
}

/// How a case ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Every output matched.
    Pass,
    /// Wrong results or an error other than an unsupported feature.
    Fail(String),
    /// The model uses something the importer does not support.
    Unsupported(String),
}

/// A case's outcome and the op it tests.
#[derive(Clone, Debug)]
pub struct CaseResult {
    /// `category/name`.
    pub id: String,
    /// The category.
    pub category: String,
    /// The op type of a single-node model, else `(model)`.
    pub op: String,
    /// The outcome.
    pub outcome: Outcome,
    /// How long loading and running took.
    pub elapsed: std::time::Duration,
}

fn read_tensor(path: &Path) -> Result<DenseHostTensor> {
    let bytes = std::fs::read(path)
        .map_err(|e| OnnxError::io(format!("cannot read {}: {e}", path.display())))?;
    let proto = TensorProto::decode(bytes.as_slice()).map_err(|e| {
        OnnxError::new(
            OnnxErrorKind::Decode,
            format!("{}: not a TensorProto: {e}", path.display()),
        )
    })?;
    decode(&proto)
}

fn numbered(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let mut v: Vec<(usize, PathBuf)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let n = name
                .strip_prefix(prefix)?
                .strip_suffix(".pb")?
                .parse()
                .ok()?;
            Some((n, e.path()))
        })
        .collect();
    v.sort();
    v.into_iter().map(|(_, p)| p).collect()
}

/// Whether `actual` matches `expected` within the tolerances (same dtype
/// and shape; NaNs match NaNs; integers and bools exactly).
pub fn compare(
    expected: &DenseHostTensor,
    actual: &DenseHostTensor,
) -> std::result::Result<(), String> {
    compare_with(expected, actual, RTOL)
}

/// [`compare`] with another relative tolerance.
pub fn compare_with(
    expected: &DenseHostTensor,
    actual: &DenseHostTensor,
    rtol: f64,
) -> std::result::Result<(), String> {
    if expected.dtype() != actual.dtype() {
        return Err(format!(
            "dtype {} instead of {}",
            actual.dtype(),
            expected.dtype()
        ));
    }
    if expected.shape() != actual.shape() {
        return Err(format!(
            "shape {} instead of {}",
            actual.shape(),
            expected.shape()
        ));
    }
    let as_f64 = |t: &DenseHostTensor| -> std::result::Result<Vec<f64>, String> {
        (0..t.numel())
            .map(|i| {
                t.get_scalar(i)
                    .map(crate::translate::scalar_f64)
                    .ok_or_else(|| "unreadable value".to_string())
            })
            .collect()
    };
    if expected.dtype().is_int() {
        // Exactly, beyond 2^53 too (no detour through f64).
        for i in 0..expected.numel() {
            let (e, a) = (expected.get_scalar(i), actual.get_scalar(i));
            let (Some(e), Some(a)) = (e, a) else {
                return Err("unreadable value".to_string());
            };
            if e != a {
                return Err(format!("element {i}: {a} instead of {e}"));
            }
        }
        return Ok(());
    }
    let (e, a) = (as_f64(expected)?, as_f64(actual)?);
    let exact = !expected.dtype().is_float();
    for i in 0..e.len() {
        let (x, y) = (e[i], a[i]);
        let ok = if x.is_nan() || y.is_nan() {
            x.is_nan() && y.is_nan()
        } else if exact || x.is_infinite() {
            x == y
        } else {
            (x - y).abs() <= ATOL + rtol * x.abs()
        };
        if !ok {
            return Err(format!("element {i}: {y} instead of {x}"));
        }
    }
    Ok(())
}

/// Runs one case in `mode` and classifies it. Never panics: a panic inside
/// is caught and reported as a failure.
pub fn run_case(case: &Case, mode: Mode) -> CaseResult {
    let start = std::time::Instant::now();
    let model = if case.is_light() {
        Model::load(&case.dir)
    } else {
        Model::load(case.dir.join("model.onnx"))
    };
    let op = match &model {
        Ok(m) => {
            let counts = m.op_counts();
            if counts.len() == 1 && counts[0].1 == 1 {
                counts[0].0.clone()
            } else {
                "(model)".to_string()
            }
        }
        Err(_) => "(model)".to_string(),
    };
    let outcome = match model {
        Err(e) => classify(e),
        Ok(model) => {
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                run_loaded(case, &model, mode)
            })) {
                Ok(Ok(())) => Outcome::Pass,
                Ok(Err(e)) => classify(e),
                Err(p) => {
                    let msg = p
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default();
                    Outcome::Fail(format!("panic: {msg}"))
                }
            }
        }
    };
    CaseResult {
        id: case.id.clone(),
        category: case.category.clone(),
        op,
        outcome,
        elapsed: start.elapsed(),
    }
}

fn classify(e: OnnxError) -> Outcome {
    if e.is_unsupported() {
        Outcome::Unsupported(e.to_string())
    } else {
        Outcome::Fail(e.to_string())
    }
}

/// Runs a `light` model on `arange(n).reshape(shape) / n` and compares
/// with its expected output (DenseNet-121 with rtol 2e-3, as the suite
/// does).
fn run_light(case: &Case, model: &Model, mode: Mode) -> Result<()> {
    let stem = case
        .dir
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let expected = read_tensor(&case.dir.with_file_name(format!("{stem}_output_0.pb")))?;
    let info = model
        .inputs()
        .first()
        .ok_or_else(|| OnnxError::invalid("the model has no input"))?;
    let dims: Vec<usize> = info
        .shape
        .iter()
        .flatten()
        .map(|d| match d {
            crate::model::Dim::Fixed(n) => Ok(*n),
            _ => Err(OnnxError::invalid(
                "a light model's input shape must be fixed",
            )),
        })
        .collect::<Result<_>>()?;
    let n: usize = dims.iter().product();
    let values: Vec<f32> = (0..n).map(|i| i as f32 / n as f32).collect();
    let x = DenseHostTensor::from_slice(&values, dims.as_slice())?;
    let outputs = model.run_with(&[(info.name.as_str(), x)], mode)?;
    let rtol = if stem.contains("densenet") {
        2e-3
    } else {
        RTOL
    };
    let actual = outputs
        .first()
        .ok_or_else(|| OnnxError::invalid("the model has no output"))?;
    compare_with(&expected, actual, rtol)
        .map_err(|why| OnnxError::new(OnnxErrorKind::Runtime, format!("output 0: {why}")))
}

fn run_loaded(case: &Case, model: &Model, mode: Mode) -> Result<()> {
    if case.is_light() {
        return run_light(case, model, mode);
    }
    if let Some(i) = model.inputs().iter().find(|i| i.dtype.is_none()) {
        return Err(OnnxError::unsupported(format!(
            "input '{}' of type {}",
            i.name, i.onnx_type
        )));
    }
    if let Some(o) = model.outputs().iter().find(|o| o.dtype.is_none()) {
        return Err(OnnxError::unsupported(format!(
            "output '{}' of type {}",
            o.name, o.onnx_type
        )));
    }
    let mut sets: Vec<PathBuf> = std::fs::read_dir(&case.dir)
        .map_err(|e| OnnxError::io(format!("cannot read {}: {e}", case.dir.display())))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.is_dir()
                && p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("test_data_set_"))
        })
        .collect();
    sets.sort();
    if sets.is_empty() {
        return Err(OnnxError::invalid("the case has no test_data_set_*"));
    }
    for set in sets {
        let inputs = numbered(&set, "input_")
            .iter()
            .map(|p| read_tensor(p))
            .collect::<Result<Vec<_>>>()?;
        let expected = numbered(&set, "output_")
            .iter()
            .map(|p| read_tensor(p))
            .collect::<Result<Vec<_>>>()?;
        if inputs.len() != model.inputs().len() {
            return Err(OnnxError::invalid(format!(
                "{} inputs for a model of {} inputs",
                inputs.len(),
                model.inputs().len()
            )));
        }
        let named: Vec<(&str, DenseHostTensor)> = model
            .inputs()
            .iter()
            .zip(inputs)
            .map(|(i, t)| (i.name.as_str(), t))
            .collect();
        let outputs = model.run_with(&named, mode)?;
        for (i, (e, a)) in expected.iter().zip(&outputs).enumerate() {
            compare(e, a).map_err(|why| {
                OnnxError::new(
                    OnnxErrorKind::Runtime,
                    format!(
                        "{}: output {i} ('{}'): {why}",
                        set.file_name().unwrap_or_default().to_string_lossy(),
                        model.outputs()[i].name
                    ),
                )
            })?;
        }
    }
    Ok(())
}

/// The outcomes of a run of the suite.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// One result per case, in order.
    pub results: Vec<CaseResult>,
}

/// Pass, fail and unsupported counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Cases that passed.
    pub pass: usize,
    /// Cases that failed.
    pub fail: usize,
    /// Cases classified unsupported.
    pub unsupported: usize,
}

impl Counts {
    fn add(&mut self, o: &Outcome) {
        match o {
            Outcome::Pass => self.pass += 1,
            Outcome::Fail(_) => self.fail += 1,
            Outcome::Unsupported(_) => self.unsupported += 1,
        }
    }
}

impl Report {
    /// Counts over every case of `category` (all categories when `None`).
    pub fn counts(&self, category: Option<&str>) -> Counts {
        let mut c = Counts::default();
        for r in &self.results {
            if category.is_none_or(|k| r.category == k) {
                c.add(&r.outcome);
            }
        }
        c
    }

    /// The ids of the cases that passed, sorted.
    pub fn passes(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .results
            .iter()
            .filter(|r| r.outcome == Outcome::Pass)
            .map(|r| r.id.clone())
            .collect();
        v.sort();
        v
    }

    /// The report as markdown: counts per category and per op, then every
    /// failure and unsupported case with its reason.
    pub fn to_markdown(&self) -> String {
        let mut s = String::new();
        s.push_str("# ONNX backend conformance\n\n");
        s.push_str(&format!(
            "Generated by `stagecraft onnx conform` from the test data of {PACKAGE} \
             (rtol {RTOL:e}, atol {ATOL:e}). A case is *unsupported* when the model uses an \
             op, opset, dtype or attribute the importer refuses with a reason; *fail* is a \
             wrong result or any other error.\n\n"
        ));
        s.push_str("## Per category\n\n| category | pass | fail | unsupported | total |\n|---|---:|---:|---:|---:|\n");
        let mut categories: Vec<&str> = self.results.iter().map(|r| r.category.as_str()).collect();
        categories.dedup();
        for cat in &categories {
            let c = self.counts(Some(cat));
            s.push_str(&format!(
                "| {cat} | {} | {} | {} | {} |\n",
                c.pass,
                c.fail,
                c.unsupported,
                c.pass + c.fail + c.unsupported
            ));
        }
        let mut single = Counts::default();
        let mut expanded = Counts::default();
        for r in self.results.iter().filter(|r| r.category == "node") {
            if r.id.contains("_expanded") {
                expanded.add(&r.outcome);
            } else {
                single.add(&r.outcome);
            }
        }
        for (name, c) in [
            ("node: single-node cases", single),
            ("node: `_expanded` cases", expanded),
        ] {
            if c.pass + c.fail + c.unsupported > 0 {
                s.push_str(&format!(
                    "| {name} | {} | {} | {} | {} |\n",
                    c.pass,
                    c.fail,
                    c.unsupported,
                    c.pass + c.fail + c.unsupported
                ));
            }
        }
        let c = self.counts(None);
        s.push_str(&format!(
            "| **all** | {} | {} | {} | {} |\n\n",
            c.pass,
            c.fail,
            c.unsupported,
            c.pass + c.fail + c.unsupported
        ));
        s.push_str("## Per op (single-node `node` cases)\n\n| op | pass | fail | unsupported |\n|---|---:|---:|---:|\n");
        let mut per_op: BTreeMap<&str, Counts> = BTreeMap::new();
        for r in self.results.iter().filter(|r| r.category == "node") {
            per_op.entry(r.op.as_str()).or_default().add(&r.outcome);
        }
        for (op, c) in &per_op {
            s.push_str(&format!(
                "| {op} | {} | {} | {} |\n",
                c.pass, c.fail, c.unsupported
            ));
        }
        // No timings: the report is checked in, and a time without its
        // host and a peer beside it says nothing (B8 is the speed figure).
        s.push_str("\n## Failures\n\n");
        for r in &self.results {
            if let Outcome::Fail(why) = &r.outcome {
                s.push_str(&format!("- `{}`: {}\n", r.id, one_line(why)));
            }
        }
        s.push_str("\n## Unsupported\n\n");
        for r in &self.results {
            if let Outcome::Unsupported(why) = &r.outcome {
                s.push_str(&format!("- `{}`: {}\n", r.id, one_line(why)));
            }
        }
        s
    }
}

fn one_line(s: &str) -> String {
    let line: String = s.split_whitespace().collect::<Vec<_>>().join(" ");
    if line.len() > 300 {
        let mut end = 300;
        while !line.is_char_boundary(end) {
            end -= 1;
        }
        format!("{}…", &line[..end])
    } else {
        line
    }
}

/// Runs every case of `categories` under `root` in `mode`, calling
/// `progress` after each.
pub fn run_suite(
    root: &Path,
    categories: &[&str],
    mode: Mode,
    mut progress: impl FnMut(&CaseResult),
) -> Result<Report> {
    let mut report = Report::default();
    for cat in categories {
        for case in cases(root, cat)? {
            let r = run_case(&case, mode);
            progress(&r);
            report.results.push(r);
        }
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compare_uses_the_tolerances() {
        let e = DenseHostTensor::from_slice(&[1.0f32, f32::NAN, 0.0], [3]).unwrap();
        let a = DenseHostTensor::from_slice(&[1.0009f32, f32::NAN, 5e-8], [3]).unwrap();
        assert!(compare(&e, &a).is_ok());
        let b = DenseHostTensor::from_slice(&[1.01f32, f32::NAN, 0.0], [3]).unwrap();
        assert!(compare(&e, &b).unwrap_err().contains("element 0"));
        let c = DenseHostTensor::from_slice(&[1.0f32, 2.0], [2]).unwrap();
        assert!(compare(&e, &c).unwrap_err().contains("shape"));
    }
}
