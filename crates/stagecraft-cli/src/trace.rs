//! `stagecraft trace`: the training step's lazy trace, before and after
//! the optimization passes, as text and as SVG pictures (see
//! `docs/traces.md` for reading and rendering them).

use crate::error::{CliError, Result};
use crate::idx::Images;
use crate::model::{Model, ModelKind};
use crate::train::{sgd, train_step};
use stagecraft::layers::graph::{svg, text, Function};
use stagecraft::nn::ModuleExt;
use stagecraft::{lazy, Device, Tensor};
use std::path::{Path, PathBuf};

/// The files `trace` writes, and the sizes of the two functions.
#[derive(Clone, Debug)]
pub struct TraceFiles {
    /// `trace.txt` and `trace.svg` (then `trace-2.svg`, … when the picture
    /// needs more than one page), the same for `trace_optimized`.
    pub files: Vec<PathBuf>,
    /// Nodes in the recorded trace.
    pub recorded_nodes: usize,
    /// Nodes after the passes (fusion merges elementwise chains).
    pub optimized_nodes: usize,
}

/// A batch whose pixel values do not matter: a step's trace depends on
/// shapes and ops, never on the values of its (argument) inputs, so the
/// picture needs no download.
fn synthetic_batch(batch: usize, device: &Device) -> Result<(Tensor<f32>, Tensor<i32>)> {
    let images = Images {
        count: batch,
        rows: 28,
        cols: 28,
        pixels: (0..batch * 784).map(|i| (i * 37 % 251) as u8).collect(),
    };
    let x: Vec<f32> = images.pixels.iter().map(|&p| p as f32 / 255.0).collect();
    let y: Vec<i32> = (0..batch).map(|row| (row % 10) as i32).collect();
    Ok((
        Tensor::from_vec(x, &[batch, 784], device)?,
        Tensor::from_vec(y, &[batch], device)?,
    ))
}

fn write(path: &Path, contents: &str) -> Result<()> {
    std::fs::write(path, contents)
        .map_err(|e| CliError::new(format!("cannot write {}: {e}", path.display())))
}

fn write_pair(out: &Path, stem: &str, f: &Function, files: &mut Vec<PathBuf>) -> Result<()> {
    let txt = out.join(format!("{stem}.txt"));
    write(&txt, &text::print(f))?;
    files.push(txt);
    // Pages of an earlier, longer trace would be read as part of this one.
    for stale in 2.. {
        let old = out.join(format!("{stem}-{stale}.svg"));
        if std::fs::remove_file(&old).is_err() {
            break;
        }
    }
    for (i, page) in svg::pages(f, svg::Limits::default()).iter().enumerate() {
        let name = match i {
            0 => format!("{stem}.svg"),
            _ => format!("{stem}-{}.svg", i + 1),
        };
        let path = out.join(name);
        write(&path, page)?;
        files.push(path);
    }
    Ok(())
}

/// Runs two training steps of `kind` on the lazy device (so the third is
/// the steady-state step that hits the cache), then writes the third
/// step's trace before and after the passes into `out`.
pub fn run(kind: ModelKind, batch: usize, out: &Path) -> Result<TraceFiles> {
    if batch == 0 {
        return Err(CliError::new("--batch-size must be at least 1"));
    }
    std::fs::create_dir_all(out)
        .map_err(|e| CliError::new(format!("cannot create {}: {e}", out.display())))?;
    let device = Device::lazy(&Device::cpu());
    let mut model = Model::init(kind, 0, &device);
    model.requires_grad();
    let mut sgd = sgd(0.01, 0.9);
    lazy::mark_step();
    let (x, y) = synthetic_batch(batch, &device)?;
    for _ in 0..2 {
        let loss = train_step(&mut model, &mut sgd, &x, &y)?;
        lazy::mark_step();
        loss.item()?;
    }
    let loss = train_step(&mut model, &mut sgd, &x, &y)?;
    let step = lazy::step_trace()?;
    lazy::mark_step();
    loss.item()?;
    let mut files = Vec::new();
    write_pair(out, "trace", &step.recorded, &mut files)?;
    write_pair(out, "trace_optimized", &step.optimized, &mut files)?;
    Ok(TraceFiles {
        files,
        recorded_nodes: step.recorded.nodes.len(),
        optimized_nodes: step.optimized.nodes.len(),
    })
}
