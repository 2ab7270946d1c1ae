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
    match shape {
        None => "?".to_string(),
        Some(dims) => {
            let parts: Vec<String> = dims
                .iter()
                .map(|d| match d {
                    Dim::Fixed(n) => n.to_string(),
                    Dim::Named(s) => s.clone(),
                    Dim::Unknown => "?".to_string(),
                })
                .collect();
            format!("[{}]", parts.join(", "))
        }
    }
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
