//! `stagecraft onnx`: what an ONNX model holds (`info`) and the ONNX
//! backend conformance suite (`conform`), which writes
//! `docs/onnx-conformance.md`.

use crate::error::{CliError, Result};
use stagecraft::onnx::{conformance, Dim, Mode, Model};
use std::path::{Path, PathBuf};

impl From<stagecraft::onnx::OnnxError> for CliError {
    fn from(e: stagecraft::onnx::OnnxError) -> CliError {
        CliError::new(e.to_string())
    }
}

fn describe_shape(shape: &Option<Vec<Dim>>) -> String {
    shape
        .as_deref()
        .map_or_else(|| "?".to_string(), stagecraft::onnx::describe_dims)
}

/// Prints a model's opset, inputs and outputs, op counts and the ops the
/// importer does not support.
pub fn info(path: &Path) -> Result<()> {
    let model = Model::load(path)?;
    println!("{}: opset {}", path.display(), model.opset());
    for (what, values) in [("input", model.inputs()), ("output", model.outputs())] {
        for v in values {
            let dtype = v
                .dtype
                .map_or("unsupported dtype".to_string(), |d| d.to_string());
            println!("  {what} {}: {dtype} {}", v.name, describe_shape(&v.shape));
        }
    }
    for (op, n) in model.op_counts() {
        println!("  {n:5} {op}");
    }
    let unsupported = model.unsupported_ops();
    if unsupported.is_empty() {
        println!("every op is supported");
    } else {
        println!("unsupported ops: {}", unsupported.join(", "));
    }
    Ok(())
}

/// Options of `stagecraft onnx conform`.
#[derive(Clone, Debug)]
pub struct ConformOptions {
    /// The data directory (default `data/onnx`, or `$STAGECRAFT_ONNX_DATA`).
    pub data: Option<PathBuf>,
    /// The categories to run (default: all).
    pub categories: Vec<String>,
    /// How models run.
    pub mode: Mode,
    /// Where the markdown report goes.
    pub out: PathBuf,
    /// Also write the passing cases' ids here (the checked-in expected list).
    pub expected: Option<PathBuf>,
    /// Print every case.
    pub verbose: bool,
}

/// Runs the suite and writes the report.
pub fn conform(options: &ConformOptions) -> Result<()> {
    let root = conformance::data_dir(options.data.as_deref(), Path::new("data/onnx"));
    conformance::ensure_data(&root)?;
    let categories: Vec<&str> = if options.categories.is_empty() {
        conformance::CATEGORIES.to_vec()
    } else {
        options.categories.iter().map(String::as_str).collect()
    };
    let verbose = options.verbose;
    let report = conformance::run_suite(&root, &categories, options.mode, |r| {
        if verbose {
            println!("{:?} {}", r.outcome, r.id);
        }
    })?;
    for cat in &categories {
        let c = report.counts(Some(cat));
        println!(
            "{cat}: {} pass, {} fail, {} unsupported",
            c.pass, c.fail, c.unsupported
        );
    }
    std::fs::write(&options.out, report.to_markdown())
        .map_err(|e| CliError::new(format!("cannot write {}: {e}", options.out.display())))?;
    println!("wrote {}", options.out.display());
    if let Some(path) = &options.expected {
        let mut list = report.passes().join("\n");
        list.push('\n');
        std::fs::write(path, list)
            .map_err(|e| CliError::new(format!("cannot write {}: {e}", path.display())))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// Where `stagecraft onnx run` runs a model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum RunDevice {
    /// Traced once into a graph function, run on the CPU (the default).
    Cpu,
    /// Op by op on the CPU.
    Eager,
    /// Recorded on the lazy device and run as one compiled trace.
    Lazy,
}

impl RunDevice {
    /// The model's run mode on this device.
    pub fn mode(self) -> Mode {
        match self {
            RunDevice::Cpu => Mode::Function,
            RunDevice::Eager => Mode::Eager,
            RunDevice::Lazy => Mode::Lazy,
        }
    }

    fn name(self) -> &'static str {
        match self {
            RunDevice::Cpu => "cpu",
            RunDevice::Eager => "eager",
            RunDevice::Lazy => "lazy",
        }
    }
}

/// Options of `stagecraft onnx run`.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// The `.onnx` file.
    pub model: PathBuf,
    /// `name=file.npy` per model input.
    pub inputs: Vec<String>,
    /// The directory the outputs are written to, one `.npy` per output.
    pub out: PathBuf,
    /// Where the model runs.
    pub device: RunDevice,
    /// Print a JSON summary instead of text.
    pub json: bool,
    /// Write a Chrome trace-event profile of the run here.
    pub profile: Option<PathBuf>,
}

/// A file name for output `name`: characters other than ASCII letters,
/// digits, `-`, `_` and `.` become `_`.
fn file_name(name: &str) -> String {
    let s: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '_'
            }
        })
        .collect();
    if s.is_empty() || s.starts_with('.') {
        format!("output_{s}")
    } else {
        s
    }
}

/// Runs a model on `.npy` inputs and writes its outputs as `.npy` files
/// into `options.out`; prints each output's dtype, shape and file, and
/// the load and run times (as JSON with `--json`).
pub fn run(options: &RunOptions) -> Result<()> {
    let load_start = std::time::Instant::now();
    let model = Model::load(&options.model)?;
    let load_s = load_start.elapsed().as_secs_f64();
    let mut inputs = Vec::new();
    for spec in &options.inputs {
        let (name, path) = spec
            .split_once('=')
            .ok_or_else(|| CliError::new(format!("--input {spec}: expected NAME=FILE.npy")))?;
        inputs.push((name.to_string(), crate::npy::read(Path::new(path))?));
    }
    let given: Vec<(&str, stagecraft::layers::tensor::DenseHostTensor)> = inputs
        .iter()
        .map(|(n, t)| (n.as_str(), t.clone()))
        .collect();
    if options.profile.is_some() {
        crate::profile::start();
    }
    let run_start = std::time::Instant::now();
    let outputs = model.run_with(&given, options.device.mode())?;
    let run_s = run_start.elapsed().as_secs_f64();
    let profile_events = match &options.profile {
        Some(path) => Some(crate::profile::finish(path)?),
        None => None,
    };
    std::fs::create_dir_all(&options.out)
        .map_err(|e| CliError::new(format!("cannot create {}: {e}", options.out.display())))?;
    let mut written = Vec::new();
    for (info, value) in model.outputs().iter().zip(&outputs) {
        let path = options.out.join(format!("{}.npy", file_name(&info.name)));
        crate::npy::write(&path, value)?;
        written.push(serde_json::json!({
            "name": info.name,
            "dtype": value.dtype().to_string(),
            "shape": value.shape().dims(),
            "path": path.display().to_string(),
        }));
    }
    if options.json {
        let doc = serde_json::json!({
            "model": options.model.display().to_string(),
            "device": options.device.name(),
            "opset": model.opset(),
            "load_s": load_s,
            "run_s": run_s,
            "outputs": written,
            "profile": options.profile.as_ref().map(|p| p.display().to_string()),
            "profile_events": profile_events,
        });
        println!("{doc}");
    } else {
        for w in &written {
            println!(
                "{}: {} {} -> {}",
                w["name"].as_str().unwrap_or(""),
                w["dtype"].as_str().unwrap_or(""),
                w["shape"],
                w["path"].as_str().unwrap_or("")
            );
        }
        println!(
            "loaded in {:.3} s, ran on {} in {:.3} s",
            load_s,
            options.device.name(),
            run_s
        );
        if let (Some(p), Some(n)) = (&options.profile, profile_events) {
            println!("wrote {} ({n} events)", p.display());
        }
    }
    Ok(())
}
