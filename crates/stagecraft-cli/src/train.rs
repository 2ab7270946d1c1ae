//! `stagecraft train`: minibatch SGD on MNIST with a progress bar, test
//! accuracy, and a summary of what the runtime did (eager vs lazy step
//! time on the same model, traces compiled, cache hit rate,
//! materializations, bytes read back to the host).

use crate::checkpoint;
use crate::error::{CliError, Result};
use crate::idx::{Images, CLASSES};
use crate::mnist::Mnist;
use crate::model::{loss, predictions, Model, ModelKind};
use crate::profile;
use crate::splitmix::SplitMix64;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;
use stagecraft::distributed::{self, DataParallel, Reduction};
use stagecraft::layers::runtime::profile as rt_profile;
use stagecraft::nn::ModuleExt;
use stagecraft::optim::{Optimizer, Sgd, SgdConfig};
use stagecraft::{lazy, Device, Tensor};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Where training runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// Op by op on the CPU.
    Eager,
    /// Recorded and run as one compiled, cached trace per step.
    Lazy,
    /// Op by op on the GPU (`gpu:0`; the `wgpu` feature). Ops without a
    /// GPU kernel run on the CPU, with copies and a warning.
    Gpu,
    /// Recorded and run on the GPU as one cached trace per step, each
    /// trace one submission of the GPU's work (the `wgpu` feature).
    #[serde(rename = "lazy-gpu")]
    LazyGpu,
}

impl DeviceKind {
    /// The device.
    pub fn device(self) -> Device {
        match self {
            DeviceKind::Eager => Device::cpu(),
            DeviceKind::Lazy => Device::lazy(&Device::cpu()),
            DeviceKind::Gpu => Device::gpu(0),
            DeviceKind::LazyGpu => Device::lazy(&Device::gpu(0)),
        }
    }

    /// The device, or the error that says why this build or machine has
    /// none (a GPU without the `wgpu` feature or without a driver).
    pub fn checked_device(self) -> Result<Device> {
        match self {
            DeviceKind::Gpu => Ok(Device::try_gpu(0)?),
            DeviceKind::LazyGpu => Ok(Device::lazy(&Device::try_gpu(0)?)),
            other => Ok(other.device()),
        }
    }

    /// The other device of the eager-vs-lazy comparison, on the same
    /// processor.
    pub fn other(self) -> Option<DeviceKind> {
        match self {
            DeviceKind::Eager => Some(DeviceKind::Lazy),
            DeviceKind::Lazy => Some(DeviceKind::Eager),
            DeviceKind::Gpu => Some(DeviceKind::LazyGpu),
            DeviceKind::LazyGpu => Some(DeviceKind::Gpu),
        }
    }

    /// True for the devices that record traces.
    pub fn is_lazy(self) -> bool {
        matches!(self, DeviceKind::Lazy | DeviceKind::LazyGpu)
    }

    /// The device's name in summaries.
    pub fn name(self) -> &'static str {
        match self {
            DeviceKind::Eager => "eager",
            DeviceKind::Lazy => "lazy",
            DeviceKind::Gpu => "gpu",
            DeviceKind::LazyGpu => "lazy-gpu",
        }
    }
}

/// Everything `train` was asked to do.
#[derive(Clone, Debug)]
pub struct TrainOptions {
    /// Which network.
    pub model: ModelKind,
    /// Where training runs.
    pub device: DeviceKind,
    /// Passes over the training set.
    pub epochs: usize,
    /// Examples per step.
    pub batch_size: usize,
    /// SGD step size at the first step (it decays linearly to zero).
    pub lr: f32,
    /// SGD momentum.
    pub momentum: f32,
    /// Seeds initialization and shuffling.
    pub seed: u64,
    /// Stop after this many steps in all (quick runs).
    pub steps: Option<usize>,
    /// Steps timed on each device for the eager-vs-lazy comparison (0
    /// skips it).
    pub compare_steps: usize,
    /// Print the summary as JSON (and no progress bar).
    pub json: bool,
    /// Write a Chrome trace-event profile here.
    pub profile: Option<PathBuf>,
    /// Save the trained parameters here (safetensors).
    pub save: Option<PathBuf>,
    /// Start from these parameters (safetensors).
    pub load: Option<PathBuf>,
    /// Data-parallel over the processes of the group
    /// (`stagecraft::distributed::init` must have run): each takes its
    /// shard of every global batch of `batch_size`, gradients are averaged
    /// in buckets, and rank 0 alone prints, evaluates and saves.
    pub distributed: bool,
}

/// Mean time per step on each device, measured on the same model.
#[derive(Clone, Debug, Serialize)]
pub struct Comparison {
    /// Steps timed on each device (after warm-up steps).
    pub steps: usize,
    /// Eager milliseconds per step.
    pub eager_ms_per_step: f64,
    /// Lazy milliseconds per step (cached trace).
    pub lazy_ms_per_step: f64,
    /// `eager / lazy`: above 1 when the lazy device is faster.
    pub lazy_speedup: f64,
}

/// What the lazy runtime did during training and evaluation.
#[derive(Clone, Debug, Serialize)]
pub struct LazySummary {
    /// Ops recorded on the lazy device.
    pub ops_recorded: u64,
    /// Traces compiled (cache misses).
    pub traces_compiled: u64,
    /// Trace-cache lookups that found a compiled trace.
    pub cache_hits: u64,
    /// Lookups that compiled.
    pub cache_misses: u64,
    /// `hits / (hits + misses)`.
    pub cache_hit_rate: f64,
    /// Traces run.
    pub materializations: u64,
    /// Bytes of values read back to the host.
    pub bytes_to_host: u64,
    /// Milliseconds spent building and compiling traces.
    pub compile_ms: f64,
    /// Milliseconds spent running traces.
    pub execute_ms: f64,
    /// Fresh buffer allocations in the last step (0 once the pools are warm).
    pub allocations_last_step: u64,
    /// The most bytes of tensor buffers live at once.
    pub peak_bytes: u64,
}

impl LazySummary {
    /// The summary of the lazy runtime's counters.
    pub fn from_metrics(metrics: &lazy::LazyMetrics) -> LazySummary {
        let lookups = metrics.cache_hits + metrics.cache_misses;
        LazySummary {
            ops_recorded: metrics.ops_recorded,
            traces_compiled: metrics.traces_compiled,
            cache_hits: metrics.cache_hits,
            cache_misses: metrics.cache_misses,
            cache_hit_rate: if lookups == 0 {
                0.0
            } else {
                metrics.cache_hits as f64 / lookups as f64
            },
            materializations: metrics.materializations,
            bytes_to_host: metrics.bytes_to_host,
            compile_ms: metrics.compile_time.as_secs_f64() * 1e3,
            execute_ms: metrics.execute_time.as_secs_f64() * 1e3,
            allocations_last_step: metrics.allocations_last_step,
            peak_bytes: metrics.peak_bytes,
        }
    }
}

/// The run's results, printed at the end (as JSON with `--json`).
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    /// Which network.
    pub model: ModelKind,
    /// Where training ran.
    pub device: DeviceKind,
    /// Epochs started.
    pub epochs: usize,
    /// Training steps run.
    pub steps: usize,
    /// Examples per step.
    pub batch_size: usize,
    /// SGD step size.
    pub lr: f32,
    /// SGD momentum.
    pub momentum: f32,
    /// Seed.
    pub seed: u64,
    /// Training wall time in seconds (without evaluation).
    pub train_seconds: f64,
    /// Mean training step time in milliseconds.
    pub ms_per_step: f64,
    /// Loss of the last step.
    pub final_loss: Option<f32>,
    /// Fraction of the test set classified correctly.
    pub test_accuracy: f64,
    /// Test examples evaluated.
    pub test_examples: usize,
    /// Eager vs lazy step time on the same model.
    pub comparison: Option<Comparison>,
    /// The lazy runtime's counters over training and evaluation (`None`
    /// when training ran eagerly).
    pub lazy: Option<LazySummary>,
    /// Where the profile went.
    pub profile: Option<PathBuf>,
    /// Where the checkpoint went.
    pub saved: Option<PathBuf>,
    /// Processes that trained (1 unless `--distributed`).
    pub ranks: usize,
    /// Scalar parameters of the model (what data-parallel training
    /// all-reduces each step, 4 bytes each).
    pub parameters: usize,
    /// Mean training loss of each epoch (over all processes' shards).
    pub epoch_losses: Vec<f64>,
}

/// Scaled pixels: MNIST's mean and standard deviation, so inputs are
/// centred and of unit scale.
fn scale(pixel: u8) -> f32 {
    const MEAN: f32 = 0.1307;
    const STD: f32 = 0.3081;
    (pixel as f32 / 255.0 - MEAN) / STD
}

/// A batch of images `[n, rows*cols]` and their labels `[n]` on
/// `device`.
fn batch(
    images: &Images,
    labels: &[u8],
    indices: &[usize],
    device: &Device,
) -> Result<(Tensor<f32>, Tensor<i32>)> {
    let per = images.pixels_per_image();
    let mut x = Vec::with_capacity(indices.len() * per);
    let mut y = Vec::with_capacity(indices.len());
    for &i in indices {
        x.extend(images.image(i).iter().map(|&p| scale(p)));
        y.push(i32::from(labels[i]).min(CLASSES as i32 - 1));
    }
    Ok((
        Tensor::from_vec(x, &[indices.len(), per], device)?,
        Tensor::from_vec(y, &[indices.len()], device)?,
    ))
}

/// SGD with momentum (PyTorch's rule) for `options`.
pub fn sgd(lr: f32, momentum: f32) -> Sgd {
    Sgd::new(SgdConfig {
        lr: f64::from(lr),
        momentum: f64::from(momentum),
        ..SgdConfig::default()
    })
}

/// One training step on a batch: forward, backward, update. Returns the
/// loss (on a lazy device still pending until `mark_step`). The model's
/// parameters are marked `requires_grad()` once, before the first step;
/// the update keeps them marked.
pub fn train_step(
    model: &mut Model,
    sgd: &mut Sgd,
    x: &Tensor<f32>,
    y: &Tensor<i32>,
) -> Result<Tensor<f32>> {
    let loss = loss(&model.forward(x), y);
    let grads = loss.backward()?;
    sgd.step(model, &grads)?;
    Ok(loss)
}

/// One data-parallel step on this process's shard: forward, backward with
/// gradients averaged over the group in buckets, update. Returns the loss
/// averaged over the group.
pub fn train_step_distributed(
    model: &mut Model,
    sgd: &mut Sgd,
    ddp: &DataParallel,
    x: &Tensor<f32>,
    y: &Tensor<i32>,
) -> Result<Tensor<f32>> {
    let loss = loss(&model.forward(x), y);
    let grads = ddp.backward(model, &loss)?;
    sgd.step(model, &grads)?;
    Ok(distributed::all_reduce(&loss, Reduction::Mean))
}

/// Ends a step: on a lazy device runs its trace; reads the loss.
fn finish_step(loss: &Tensor<f32>) -> Result<f32> {
    lazy::mark_step();
    Ok(loss.item()?)
}

/// Fraction of `images` that `model` classifies correctly.
pub fn evaluate(model: &Model, images: &Images, labels: &[u8]) -> Result<f64> {
    let span = rt_profile::begin();
    let device = model.fcs[0].weight.device();
    let chunk = 1000.min(images.count);
    let mut correct = 0usize;
    let mut start = 0;
    while start < images.count {
        let end = (start + chunk).min(images.count);
        let indices: Vec<usize> = (start..end).collect();
        let (x, _) = batch(images, labels, &indices, &device)?;
        let predicted = stagecraft::no_grad(|| predictions(&model.forward(&x)))?;
        correct += predicted
            .iter()
            .zip(&labels[start..end])
            .filter(|(p, l)| **p == **l as i64)
            .count();
        start = end;
    }
    if let Some(span) = span {
        span.end(
            profile::EVALUATE,
            "evaluate",
            vec![("examples", images.count.to_string())],
        );
    }
    Ok(correct as f64 / images.count as f64)
}

/// Mean milliseconds per step of `steps` SGD steps of a copy of `model` on
/// `device`, after warm-up steps (which compile the lazy trace).
fn time_steps(
    model: &Model,
    data: &Mnist,
    options: &TrainOptions,
    device: DeviceKind,
    steps: usize,
) -> Result<f64> {
    const WARM_UP: usize = 3;
    let dev = device.device();
    let mut copy = model.copy_to(&dev);
    copy.requires_grad();
    let mut sgd = sgd(options.lr, options.momentum);
    lazy::mark_step();
    let n = options.batch_size.min(data.train_images.count);
    let indices: Vec<usize> = (0..n).collect();
    let mut timed = Duration::ZERO;
    for i in 0..WARM_UP + steps {
        let (x, y) = batch(&data.train_images, &data.train_labels, &indices, &dev)?;
        let start = Instant::now();
        let loss = train_step(&mut copy, &mut sgd, &x, &y)?;
        finish_step(&loss)?;
        if i >= WARM_UP {
            timed += start.elapsed();
        }
    }
    Ok(timed.as_secs_f64() * 1e3 / steps as f64)
}

fn progress_bar(options: &TrainOptions, len: u64) -> ProgressBar {
    if options.json || !std::io::stderr().is_terminal() || !is_root(options) {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    let style =
        ProgressStyle::with_template("epoch {prefix} [{bar:20}] {pos}/{len} {msg} eta {eta}")
            .map(|s| s.progress_chars("=> "))
            .unwrap_or_else(|_| ProgressStyle::default_bar());
    bar.set_style(style);
    bar
}

/// The rows of a global batch of `batch_size` each of `ranks` processes
/// takes.
pub fn shard_size(batch_size: usize, ranks: usize) -> Result<usize> {
    if !batch_size.is_multiple_of(ranks) {
        return Err(CliError::new(format!(
            "--batch-size {batch_size} does not split evenly over {ranks} processes: each takes \
             an equal shard of every batch"
        )));
    }
    Ok(batch_size / ranks)
}

/// True where this process prints, evaluates and saves: always, unless
/// it is a rank other than 0 of a distributed run.
fn is_root(options: &TrainOptions) -> bool {
    !options.distributed || distributed::rank() == 0
}

/// Trains, evaluates, compares devices and returns the summary.
pub fn run(options: &TrainOptions, data: &Mnist) -> Result<Summary> {
    if options.batch_size == 0 {
        return Err(CliError::new("--batch-size must be at least 1"));
    }
    let (rank, ranks) = if options.distributed {
        (distributed::rank(), distributed::world_size())
    } else {
        (0, 1)
    };
    for (set, images) in [
        ("training", &data.train_images),
        ("test", &data.test_images),
    ] {
        if (images.rows, images.cols) != (28, 28) {
            return Err(CliError::new(format!(
                "the {set} images are {}x{}; the models take 28x28 MNIST digits",
                images.rows, images.cols
            )));
        }
    }
    if options.profile.is_some() {
        profile::start();
    }
    let device = options.device.checked_device()?;
    let mut model = match &options.load {
        Some(path) => {
            let m = checkpoint::load(options.model, path, &device)?;
            if !options.json {
                eprintln!("loaded {}", path.display());
            }
            m
        }
        None => Model::init(options.model, options.seed, &device),
    };
    let mut sgd = sgd(options.lr, options.momentum);
    let ddp = options.distributed.then(|| DataParallel::new(&model));
    if let Some(ddp) = &ddp {
        ddp.broadcast_parameters(&mut model)?;
    }
    model.requires_grad();
    lazy::mark_step();
    lazy::reset_metrics();
    let mut epoch_losses = Vec::new();

    let train_count = data.train_images.count;
    // Whole batches only: a short last batch would be a second trace shape.
    let batch_size = options.batch_size.min(train_count);
    let shard = shard_size(batch_size, ranks)?;
    let per_epoch = train_count / batch_size;
    let budget = options.steps.unwrap_or(usize::MAX);
    // The step size decays linearly to zero over the run: the last steps
    // average out minibatch noise, which constant steps never do.
    let total_steps = (per_epoch * options.epochs).min(budget).max(1);
    // The epochs this run will have: fewer than asked when --steps ends it
    // early, so that the counters read "epoch 1/1" then.
    let planned_epochs = options.epochs.min(total_steps.div_ceil(per_epoch.max(1)));
    let mut shuffler = SplitMix64::new(options.seed ^ 0x5eed);
    let mut steps = 0usize;
    let mut epochs = 0usize;
    let mut final_loss = None;
    let mut train_time = Duration::ZERO;
    'epochs: for epoch in 0..options.epochs {
        if steps >= budget {
            break;
        }
        epochs += 1;
        let this_epoch = per_epoch.min(budget - steps);
        let bar = progress_bar(options, this_epoch as u64);
        bar.set_prefix(format!("{}/{planned_epochs}", epoch + 1));
        let order = shuffler.permutation(train_count);
        let mut epoch_time = Duration::ZERO;
        let mut loss_sum = 0.0f64;
        for (i, indices) in order.chunks_exact(batch_size).take(this_epoch).enumerate() {
            let indices = &indices[rank * shard..(rank + 1) * shard];
            let (x, y) = batch(&data.train_images, &data.train_labels, indices, &device)?;
            sgd.set_lr(f64::from(options.lr) * (1.0 - steps as f64 / total_steps as f64));
            let span = rt_profile::begin();
            let start = Instant::now();
            let loss = match &ddp {
                Some(ddp) => train_step_distributed(&mut model, &mut sgd, ddp, &x, &y)?,
                None => train_step(&mut model, &mut sgd, &x, &y)?,
            };
            let value = finish_step(&loss)?;
            let took = start.elapsed();
            if let Some(span) = span {
                span.end(
                    profile::STEP,
                    "train step",
                    vec![("step", steps.to_string())],
                );
            }
            if !value.is_finite() {
                bar.abandon();
                return Err(CliError::new(format!(
                    "the loss diverged ({value}) at step {steps}: try a smaller --lr"
                )));
            }
            epoch_time += took;
            train_time += took;
            loss_sum += value as f64;
            final_loss = Some(value);
            steps += 1;
            bar.set_position(i as u64 + 1);
            bar.set_message(format!(
                "step {steps} loss {value:.4} {:.2} ms/step",
                took.as_secs_f64() * 1e3
            ));
            if steps >= budget {
                bar.finish_and_clear();
                report_epoch(
                    options,
                    (epoch, planned_epochs),
                    i + 1,
                    loss_sum,
                    epoch_time,
                );
                epoch_losses.push(loss_sum / (i + 1) as f64);
                break 'epochs;
            }
        }
        bar.finish_and_clear();
        report_epoch(
            options,
            (epoch, planned_epochs),
            this_epoch,
            loss_sum,
            epoch_time,
        );
        epoch_losses.push(loss_sum / this_epoch.max(1) as f64);
    }

    // Every process holds the same parameters: rank 0 evaluates for all.
    let accuracy = if is_root(options) {
        evaluate(&model, &data.test_images, &data.test_labels)?
    } else {
        f64::NAN
    };
    let metrics = lazy::metrics();
    let lazy_summary = options
        .device
        .is_lazy()
        .then(|| LazySummary::from_metrics(&metrics));

    let comparison = if let (true, Some(other_device)) = (
        options.compare_steps > 0 && !options.distributed,
        options.device.other(),
    ) {
        if !options.json {
            eprintln!(
                "timing {} of the same model on each device...",
                counted(options.compare_steps, "step")
            );
        }
        let this = time_steps(&model, data, options, options.device, options.compare_steps)?;
        let other = time_steps(&model, data, options, other_device, options.compare_steps)?;
        let (eager, lazy_ms) = match options.device.is_lazy() {
            true => (other, this),
            false => (this, other),
        };
        Some(Comparison {
            steps: options.compare_steps,
            eager_ms_per_step: eager,
            lazy_ms_per_step: lazy_ms,
            lazy_speedup: eager / lazy_ms,
        })
    } else {
        None
    };

    let saved = match &options.save {
        Some(path) if is_root(options) => {
            checkpoint::save(&model, path)?;
            Some(path.clone())
        }
        _ => None,
    };
    if let Some(path) = &options.profile {
        let events = profile::finish(path)?;
        if !options.json {
            eprintln!("wrote {} profile events to {}", events, path.display());
        }
    }
    Ok(Summary {
        model: options.model,
        device: options.device,
        epochs,
        steps,
        batch_size,
        lr: options.lr,
        momentum: options.momentum,
        seed: options.seed,
        train_seconds: train_time.as_secs_f64(),
        ms_per_step: if steps == 0 {
            0.0
        } else {
            train_time.as_secs_f64() * 1e3 / steps as f64
        },
        final_loss,
        test_accuracy: accuracy,
        test_examples: data.test_images.count,
        comparison,
        lazy: lazy_summary,
        profile: options.profile.clone(),
        saved,
        ranks,
        parameters: model.num_params(),
        epoch_losses,
    })
}

/// One line per epoch on stderr, which stays when the epoch's progress bar
/// is cleared (and is all that logs and pipes see), with `--json` too:
/// stdout then holds the JSON alone.
fn report_epoch(
    options: &TrainOptions,
    (epoch, planned_epochs): (usize, usize),
    steps: usize,
    loss_sum: f64,
    time: Duration,
) {
    if steps == 0 || !is_root(options) {
        return;
    }
    eprintln!(
        "epoch {}/{}: {}, mean loss {:.4}, {:.2} ms/step",
        epoch + 1,
        planned_epochs,
        counted(steps, "step"),
        loss_sum / steps as f64,
        time.as_secs_f64() * 1e3 / steps as f64
    );
}

/// `1 step`, `2 steps`.
pub fn counted(n: usize, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

/// The summary for people.
pub fn print_summary(s: &Summary) {
    println!(
        "{} on the {} device{}: {} in {} ({:.1} s, {:.2} ms/step), final loss {}",
        s.model.name(),
        s.device.name(),
        if s.ranks > 1 {
            format!(", data-parallel over {} processes", s.ranks)
        } else {
            String::new()
        },
        counted(s.steps, "step"),
        counted(s.epochs, "epoch"),
        s.train_seconds,
        s.ms_per_step,
        s.final_loss.map_or("-".to_string(), |l| format!("{l:.4}"))
    );
    println!(
        "test accuracy: {:.2}% ({} examples)",
        s.test_accuracy * 100.0,
        s.test_examples
    );
    if let Some(c) = &s.comparison {
        println!(
            "step time, same model and batch: eager {:.2} ms, lazy {:.2} ms ({:.2}x)",
            c.eager_ms_per_step, c.lazy_ms_per_step, c.lazy_speedup
        );
    }
    if let Some(l) = &s.lazy {
        print_lazy(l);
    }
    if let Some(p) = &s.saved {
        println!("saved parameters to {}", p.display());
    }
    if let Some(p) = &s.profile {
        println!("profile: {} (open in https://ui.perfetto.dev)", p.display());
    }
}

/// The lazy runtime's line of a summary.
pub fn print_lazy(l: &LazySummary) {
    println!(
        "lazy runtime: {} traces compiled, cache hit rate {:.1}% ({} hits, {} misses), \
         {} materializations, {} bytes to host, {} ops recorded, compile {:.1} ms, run {:.1} ms, \
         {} buffer allocations in the last step, peak {:.1} MiB of buffers",
        l.traces_compiled,
        l.cache_hit_rate * 100.0,
        l.cache_hits,
        l.cache_misses,
        l.materializations,
        l.bytes_to_host,
        l.ops_recorded,
        l.compile_ms,
        l.execute_ms,
        l.allocations_last_step,
        l.peak_bytes as f64 / (1 << 20) as f64
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_are_scaled_with_their_labels() {
        let images = Images {
            count: 2,
            rows: 1,
            cols: 2,
            pixels: vec![0, 255, 10, 20],
        };
        let (x, y) = batch(&images, &[3, 1], &[1, 0], &Device::cpu()).unwrap();
        assert_eq!(x.dims(), &[2, 2]);
        let xs = x.to_vec().unwrap();
        assert!((xs[2] - scale(0)).abs() < 1e-6 && (xs[3] - scale(255)).abs() < 1e-6);
        assert_eq!(y.to_vec().unwrap(), vec![1, 3]);
    }
}
