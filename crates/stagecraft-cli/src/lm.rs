//! `stagecraft train --model gpt`: the character-level GPT on Shakespeare
//! with AdamW, warm-up and cosine decay, and gradient clipping, all from
//! `stagecraft::nn` and `stagecraft::optim`; and `stagecraft generate`,
//! which samples from a saved model with a key/value cache.
//!
//! On the lazy device a training step (forward, backward, clipping and the
//! AdamW update) records as one trace; the learning rate and the step
//! count enter it as data, so the whole run replays one compiled trace.

use crate::error::{CliError, Result};
use crate::gpt::{generate, Generated, Gpt, GptConfig, Sampling};
use crate::profile;
use crate::shakespeare::{Corpus, Vocab};
use crate::splitmix::SplitMix64;
use crate::train::{Comparison, DeviceKind, LazySummary};
use serde::Serialize;
use stagecraft::distributed::{self, DataParallel, Reduction};
use stagecraft::layers::runtime::profile as rt_profile;
use stagecraft::nn::{Module, ModuleExt};
use stagecraft::optim::{AdamConfig, AdamW, Cosine, LrSchedule, Optimizer};
use stagecraft::{clip_grad_norm, lazy, Device, Gradients, Tensor};
use std::collections::HashMap;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Everything `train --model gpt` was asked to do. The defaults are
/// nanoGPT's CPU settings for Shakespeare.
#[derive(Clone, Debug)]
pub struct LmOptions {
    /// Where training runs.
    pub device: DeviceKind,
    /// Training steps.
    pub steps: usize,
    /// Sequences per step.
    pub batch_size: usize,
    /// Layers, heads, width, context and dropout (the vocabulary comes
    /// from the corpus).
    pub config: GptConfig,
    /// Peak learning rate.
    pub lr: f64,
    /// The learning rate at the end of the cosine decay.
    pub min_lr: f64,
    /// Linear warm-up steps.
    pub warmup: u64,
    /// AdamW's decoupled weight decay (matrices only).
    pub weight_decay: f64,
    /// AdamW's betas.
    pub betas: (f64, f64),
    /// The largest gradient norm; larger gradients are scaled down to it.
    pub clip: f64,
    /// Seeds initialization and batches.
    pub seed: u64,
    /// Also report train and validation loss every this many steps (0:
    /// only at the end).
    pub eval_every: usize,
    /// Steps timed on each device for the eager-vs-lazy comparison (0
    /// skips it).
    pub compare_steps: usize,
    /// Print the summary as JSON (and no progress).
    pub json: bool,
    /// Write a Chrome trace-event profile here.
    pub profile: Option<PathBuf>,
    /// Save the trained parameters here (safetensors).
    pub save: Option<PathBuf>,
    /// Data-parallel over the processes of the group
    /// (`stagecraft::distributed::init` must have run): each takes its
    /// rows of every global batch of `batch_size` sequences, gradients are
    /// averaged before clipping, and rank 0 alone prints and saves.
    pub distributed: bool,
}

impl LmOptions {
    /// nanoGPT's CPU run: 2,000 steps of 12 sequences of 64 characters,
    /// 4 layers of 4 heads 128 wide, AdamW at 1e-3 with betas (0.9, 0.99)
    /// and decay 0.1, 100 warm-up steps then cosine to 1e-4, clip 1.0.
    pub fn defaults(vocab: usize) -> LmOptions {
        LmOptions {
            device: DeviceKind::Lazy,
            steps: 2000,
            batch_size: 12,
            config: GptConfig::small(vocab),
            lr: 1e-3,
            min_lr: 1e-4,
            warmup: 100,
            weight_decay: 0.1,
            betas: (0.9, 0.99),
            clip: 1.0,
            seed: 1337,
            eval_every: 500,
            compare_steps: 10,
            json: false,
            profile: None,
            save: None,
            distributed: false,
        }
    }
}

/// Losses at one point of training.
#[derive(Clone, Debug, Serialize)]
pub struct Evaluation {
    /// Steps done.
    pub step: usize,
    /// Mean loss of the fixed training batches.
    pub train_loss: f64,
    /// Mean loss of the fixed validation batches.
    pub val_loss: f64,
}

/// The run's results.
#[derive(Clone, Debug, Serialize)]
pub struct LmSummary {
    /// Always `gpt`.
    pub model: &'static str,
    /// Where training ran.
    pub device: DeviceKind,
    /// The model's shape.
    pub config: GptConfig,
    /// Scalar parameters.
    pub parameters: usize,
    /// Training steps run.
    pub steps: usize,
    /// Sequences per step.
    pub batch_size: usize,
    /// Peak learning rate.
    pub lr: f64,
    /// Seed.
    pub seed: u64,
    /// Training wall time in seconds (without evaluation).
    pub train_seconds: f64,
    /// Mean training step time in milliseconds.
    pub ms_per_step: f64,
    /// Training tokens per second.
    pub tokens_per_second: f64,
    /// Loss of the last step.
    pub final_loss: Option<f32>,
    /// Train and validation loss (means of 20 fixed batches each) during
    /// and after training.
    pub evaluations: Vec<Evaluation>,
    /// Eager vs lazy step time on the same model.
    pub comparison: Option<Comparison>,
    /// The lazy runtime's counters (`None` when training ran eagerly).
    pub lazy: Option<LazySummary>,
    /// Where the profile went.
    pub profile: Option<PathBuf>,
    /// Where the checkpoint went.
    pub saved: Option<PathBuf>,
}

/// Batches the loss is estimated on, as nanoGPT does.
pub const EVAL_BATCHES: usize = 20;

/// Token ids and next-token targets, each `[batch, block]`, from random
/// windows of `tokens`.
pub struct Batches<'a> {
    tokens: &'a [u32],
    batch: usize,
    block: usize,
    offsets: SplitMix64,
}

impl<'a> Batches<'a> {
    /// Windows of `block + 1` tokens of `tokens`, drawn from `seed`.
    pub fn new(tokens: &'a [u32], batch: usize, block: usize, seed: u64) -> Result<Batches<'a>> {
        if tokens.len() <= block + 1 {
            return Err(CliError::new(format!(
                "{} tokens are too few for windows of {} (the context and one more)",
                tokens.len(),
                block + 1
            )));
        }
        Ok(Batches {
            tokens,
            batch,
            block,
            offsets: SplitMix64::new(seed),
        })
    }

    /// The next batch, on `device`.
    pub fn next(&mut self, device: &Device) -> Result<(Tensor<i32>, Tensor<i32>)> {
        let (b, t) = (self.batch, self.block);
        let mut x = Vec::with_capacity(b * t);
        let mut y = Vec::with_capacity(b * t);
        for _ in 0..b {
            let i = self.offsets.below(self.tokens.len() - t);
            x.extend(self.tokens[i..i + t].iter().map(|&v| v as i32));
            y.extend(self.tokens[i + 1..i + 1 + t].iter().map(|&v| v as i32));
        }
        Ok((
            Tensor::from_vec(x, &[b, t], device)?,
            Tensor::from_vec(y, &[b, t], device)?,
        ))
    }
}

/// One training step: forward, backward, clipping to `clip`, the AdamW
/// update at the schedule's learning rate. Returns the loss (on a lazy
/// device still pending until the step is marked). The parameters are
/// marked `requires_grad()` once, before the first step; updates keep them
/// marked.
pub fn train_step(
    model: &mut Gpt,
    optimizer: &mut AdamW,
    schedule: &dyn LrSchedule,
    clip: f64,
    x: &Tensor<i32>,
    y: &Tensor<i32>,
) -> Result<Tensor<f32>> {
    train_step_with(model, optimizer, schedule, clip, x, y, None)
}

/// [`train_step`], with the gradients averaged over the group by `ddp`
/// (before clipping, so every process clips the same gradients) when
/// given; the returned loss is then this process's.
pub fn train_step_with(
    model: &mut Gpt,
    optimizer: &mut AdamW,
    schedule: &dyn LrSchedule,
    clip: f64,
    x: &Tensor<i32>,
    y: &Tensor<i32>,
    ddp: Option<&DataParallel>,
) -> Result<Tensor<f32>> {
    let loss = model.loss(x, y);
    let grads = match ddp {
        Some(ddp) => ddp.backward(model, &loss)?,
        None => loss.backward()?,
    };
    let params = model.named_params();
    let mut raw = Vec::with_capacity(params.len());
    for (name, p) in &params {
        raw.push(
            grads
                .get(p)
                .ok_or_else(|| CliError::new(format!("no gradient for {name}")))?,
        );
    }
    // One fused reduction over every gradient, then one scale each.
    let (clipped, _norm) = clip_grad_norm(&raw, clip);
    let mut grads = Gradients::default();
    for ((_, p), g) in params.iter().zip(clipped) {
        grads.insert(p, g);
    }
    optimizer.step_scheduled(schedule, model, &grads)?;
    Ok(loss)
}

/// Mean loss of `batches` fixed batches drawn from `tokens` with `seed`,
/// in evaluation mode.
pub fn estimate_loss(
    model: &mut Gpt,
    tokens: &[u32],
    batch: usize,
    seed: u64,
    batches: usize,
) -> Result<f64> {
    let span = rt_profile::begin();
    model.eval();
    let device = model.device();
    let mut draws = Batches::new(tokens, batch, model.config.block_size, seed)?;
    let mut sum = 0.0;
    for _ in 0..batches {
        let (x, y) = draws.next(&device)?;
        // Not recorded: the parameters are marked, but this loss is never
        // differentiated.
        let loss = stagecraft::no_grad(|| model.loss(&x, &y));
        lazy::mark_step();
        sum += loss.item()? as f64;
    }
    model.train();
    if let Some(span) = span {
        span.end(
            profile::EVALUATE,
            "evaluate",
            vec![("batches", batches.to_string())],
        );
    }
    Ok(sum / batches as f64)
}

/// The optimizer and schedule of `options`.
pub fn optimizer(options: &LmOptions) -> (AdamW, Cosine) {
    let config = AdamConfig {
        lr: options.lr,
        betas: options.betas,
        eps: 1e-8,
        weight_decay: options.weight_decay,
    };
    let schedule = Cosine {
        max_lr: options.lr,
        min_lr: options.min_lr,
        warmup: options.warmup,
        total: options.steps as u64,
    };
    (AdamW::new(config), schedule)
}

/// A copy of `model` on `device`.
pub fn copy_to(model: &Gpt, device: &Device) -> Gpt {
    let mut copy = model.clone();
    copy.visit_params_mut("", &mut |_, t| *t = t.to_device(device));
    copy
}

/// Mean milliseconds per step of `steps` steps of a copy of `model` on
/// `device`, after warm-up steps (which compile the lazy trace).
fn time_steps(
    model: &Gpt,
    corpus: &Corpus,
    options: &LmOptions,
    device: DeviceKind,
    steps: usize,
) -> Result<f64> {
    const WARM_UP: usize = 3;
    let dev = device.device();
    let mut copy = copy_to(model, &dev);
    copy.requires_grad();
    let (mut opt, schedule) = optimizer(options);
    lazy::mark_step();
    let mut batches = Batches::new(
        &corpus.train,
        options.batch_size,
        options.config.block_size,
        options.seed ^ 0x7135,
    )?;
    let mut timed = Duration::ZERO;
    for i in 0..WARM_UP + steps {
        let (x, y) = batches.next(&dev)?;
        let start = Instant::now();
        let loss = train_step(&mut copy, &mut opt, &schedule, options.clip, &x, &y)?;
        lazy::mark_step();
        loss.item()?;
        if i >= WARM_UP {
            timed += start.elapsed();
        }
    }
    Ok(timed.as_secs_f64() * 1e3 / steps.max(1) as f64)
}

fn lazy_summary() -> LazySummary {
    LazySummary::from_metrics(&lazy::metrics())
}

/// Trains, evaluates, compares devices and returns the summary.
pub fn run(options: &LmOptions, corpus: &Corpus) -> Result<LmSummary> {
    if options.batch_size == 0 {
        return Err(CliError::new("--batch-size must be at least 1"));
    }
    if options.profile.is_some() {
        profile::start();
    }
    let (rank, ranks) = if options.distributed {
        (distributed::rank(), distributed::world_size())
    } else {
        (0, 1)
    };
    let shard = crate::train::shard_size(options.batch_size, ranks)?;
    let root = rank == 0;
    let device = options.device.checked_device()?;
    let mut model = Gpt::new(options.config, options.seed, &device);
    let ddp = options.distributed.then(|| DataParallel::new(&model));
    if let Some(ddp) = &ddp {
        ddp.broadcast_parameters(&mut model)?;
    }
    model.requires_grad();
    let (mut opt, schedule) = optimizer(options);
    let mut batches = Batches::new(
        &corpus.train,
        options.batch_size,
        options.config.block_size,
        options.seed,
    )?;
    lazy::mark_step();
    lazy::reset_metrics();
    let say = |line: String| {
        if !options.json && root {
            eprintln!("{line}");
        }
    };
    say(format!(
        "gpt: {} parameters, {} layers x {} heads x {} wide, context {}, vocabulary {}; {} training and {} validation tokens",
        model.num_params(),
        options.config.n_layer,
        options.config.n_head,
        options.config.n_embd,
        options.config.block_size,
        options.config.vocab,
        corpus.train.len(),
        corpus.val.len()
    ));
    let evaluate = |model: &mut Gpt, step: usize| -> Result<Evaluation> {
        let train_loss = estimate_loss(
            model,
            &corpus.train,
            options.batch_size,
            0x7ea1,
            EVAL_BATCHES,
        )?;
        let val_loss = estimate_loss(model, &corpus.val, options.batch_size, 7, EVAL_BATCHES)?;
        Ok(Evaluation {
            step,
            train_loss,
            val_loss,
        })
    };
    let live = !options.json && root && std::io::stderr().is_terminal();
    let mut evaluations = Vec::new();
    let mut train_time = Duration::ZERO;
    let mut final_loss = None;
    for step in 0..options.steps {
        let (x, y) = batches.next(&device)?;
        // Every process draws the same global batch and keeps its rows.
        let (x, y) = if ranks > 1 {
            (
                x.narrow(0, rank * shard, shard),
                y.narrow(0, rank * shard, shard),
            )
        } else {
            (x, y)
        };
        let span = rt_profile::begin();
        let start = Instant::now();
        let clip = options.clip;
        let loss = train_step_with(&mut model, &mut opt, &schedule, clip, &x, &y, ddp.as_ref())?;
        let loss = match &ddp {
            Some(_) => distributed::all_reduce(&loss, Reduction::Mean),
            None => loss,
        };
        lazy::mark_step();
        let value = loss.item()?;
        let took = start.elapsed();
        if let Some(span) = span {
            span.end(
                profile::STEP,
                "train step",
                vec![("step", step.to_string())],
            );
        }
        if !value.is_finite() {
            return Err(CliError::new(format!(
                "the loss diverged ({value}) at step {step}: try a smaller --lr"
            )));
        }
        train_time += took;
        final_loss = Some(value);
        if live && step % 10 == 0 {
            eprint!(
                "\rstep {step}/{} loss {value:.4} {:.2} ms/step ",
                options.steps,
                took.as_secs_f64() * 1e3
            );
        }
        let done = step + 1;
        if options.eval_every > 0 && done % options.eval_every == 0 && done < options.steps {
            let e = evaluate(&mut model, done)?;
            if live {
                eprintln!();
            }
            say(format!(
                "step {done}: train loss {:.4}, val loss {:.4}",
                e.train_loss, e.val_loss
            ));
            evaluations.push(e);
        }
    }
    if live {
        eprintln!();
    }
    let last = evaluate(&mut model, options.steps)?;
    say(format!(
        "step {}: train loss {:.4}, val loss {:.4}",
        last.step, last.train_loss, last.val_loss
    ));
    evaluations.push(last);
    let lazy = options.device.is_lazy().then(lazy_summary);

    let comparison = if let (true, Some(other_device)) = (
        options.compare_steps > 0 && !options.distributed,
        options.device.other(),
    ) {
        say(format!(
            "timing {} of the same model on each device...",
            crate::train::counted(options.compare_steps, "step")
        ));
        let this = time_steps(
            &model,
            corpus,
            options,
            options.device,
            options.compare_steps,
        )?;
        let other = time_steps(&model, corpus, options, other_device, options.compare_steps)?;
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
        Some(path) if root => {
            save_model(&model, &corpus.vocab, path)?;
            Some(path.clone())
        }
        _ => None,
    };
    if let Some(path) = &options.profile {
        let events = profile::finish(path)?;
        say(format!(
            "wrote {} profile events to {}",
            events,
            path.display()
        ));
    }
    let seconds = train_time.as_secs_f64();
    Ok(LmSummary {
        model: "gpt",
        device: options.device,
        config: options.config,
        parameters: model.num_params(),
        steps: options.steps,
        batch_size: options.batch_size,
        lr: options.lr,
        seed: options.seed,
        train_seconds: seconds,
        ms_per_step: if options.steps == 0 {
            0.0
        } else {
            seconds * 1e3 / options.steps as f64
        },
        tokens_per_second: if seconds > 0.0 {
            (options.steps * options.batch_size * options.config.block_size) as f64 / seconds
        } else {
            0.0
        },
        final_loss,
        evaluations,
        comparison,
        lazy,
        profile: options.profile.clone(),
        saved,
    })
}

/// The summary for people.
pub fn print_summary(s: &LmSummary) {
    println!(
        "gpt on the {} device: {} ({:.1} s, {:.2} ms/step, {:.0} tokens/s), final loss {}",
        s.device.name(),
        crate::train::counted(s.steps, "step"),
        s.train_seconds,
        s.ms_per_step,
        s.tokens_per_second,
        s.final_loss.map_or("-".to_string(), |l| format!("{l:.4}"))
    );
    if let Some(e) = s.evaluations.last() {
        println!(
            "train loss {:.4}, validation loss {:.4} (means of {EVAL_BATCHES} fixed batches)",
            e.train_loss, e.val_loss
        );
    }
    if let Some(c) = &s.comparison {
        println!(
            "step time, same model and batch: eager {:.2} ms, lazy {:.2} ms ({:.2}x)",
            c.eager_ms_per_step, c.lazy_ms_per_step, c.lazy_speedup
        );
    }
    if let Some(l) = &s.lazy {
        crate::train::print_lazy(l);
    }
    if let Some(p) = &s.saved {
        println!("saved parameters to {}", p.display());
    }
    if let Some(p) = &s.profile {
        println!("profile: {} (open in https://ui.perfetto.dev)", p.display());
    }
}

/// What `generate` was asked to do.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// The saved model.
    pub load: PathBuf,
    /// The text to continue.
    pub prompt: String,
    /// New tokens.
    pub tokens: usize,
    /// Sampling temperature, top-k and seed.
    pub sampling: Sampling,
    /// Run every token over its whole window instead of the cache.
    pub no_cache: bool,
    /// Where it runs.
    pub device: DeviceKind,
}

/// What `generate` produced.
#[derive(Clone, Debug, Serialize)]
pub struct GenerateSummary {
    /// The prompt and the sampled continuation.
    pub text: String,
    /// New tokens.
    pub tokens: usize,
    /// Positions the model ran (the prompt and refills included).
    pub positions_computed: usize,
    /// New tokens per second.
    pub tokens_per_second: f64,
    /// Whether the key/value cache was used.
    pub cached: bool,
}

/// The header key of the model's configuration (JSON) in a checkpoint.
const CONFIG_KEY: &str = "stagecraft.gpt.config";
/// The header key of the model's characters (JSON string) in a checkpoint.
const VOCAB_KEY: &str = "stagecraft.gpt.vocab";

/// Saves `model` with its configuration and characters in the
/// safetensors header, so that `generate` needs nothing else.
pub fn save_model(model: &Gpt, vocab: &Vocab, path: &Path) -> Result<()> {
    let text = |e: serde_json::Error| CliError::new(format!("cannot encode the model: {e}"));
    let chars = String::from_utf8_lossy(&vocab.chars).into_owned();
    let metadata = HashMap::from([
        (
            CONFIG_KEY.to_string(),
            serde_json::to_string(&model.config).map_err(text)?,
        ),
        (
            VOCAB_KEY.to_string(),
            serde_json::to_string(&chars).map_err(text)?,
        ),
    ]);
    stagecraft::nn::save_with_metadata(model, path, &metadata)?;
    Ok(())
}

/// Loads a model saved by [`save_model`], in evaluation mode, with its
/// characters.
pub fn load_model(path: &Path, device: &Device) -> Result<(Gpt, Vocab)> {
    let bytes = std::fs::read(path)
        .map_err(|e| CliError::new(format!("cannot read {}: {e}", path.display())))?;
    let metadata = stagecraft::nn::read_metadata(&bytes)
        .map_err(|e| CliError::new(format!("{}: {e}", path.display())))?;
    let field = |key: &str| {
        metadata.get(key).ok_or_else(|| {
            CliError::new(format!(
                "{}: not a GPT saved by `stagecraft train --model gpt --save` (no {key} in its header)",
                path.display()
            ))
        })
    };
    let bad =
        |e: serde_json::Error| CliError::new(format!("{}: corrupt header: {e}", path.display()));
    let config: GptConfig = serde_json::from_str(field(CONFIG_KEY)?).map_err(bad)?;
    let chars: String = serde_json::from_str(field(VOCAB_KEY)?).map_err(bad)?;
    let vocab = Vocab {
        chars: chars.into_bytes(),
    };
    if vocab.len() != config.vocab
        || config.n_head == 0
        || !config.n_embd.is_multiple_of(config.n_head)
    {
        return Err(CliError::new(format!(
            "{}: corrupt header: {} characters for a vocabulary of {}, {} heads for width {}",
            path.display(),
            vocab.len(),
            config.vocab,
            config.n_head,
            config.n_embd
        )));
    }
    let mut model = Gpt::new(config, 0, device);
    stagecraft::nn::load_from_bytes(&mut model, &bytes, &path.display().to_string())?;
    model.eval();
    Ok((model, vocab))
}

/// Samples a continuation of the prompt.
pub fn run_generate(options: &GenerateOptions) -> Result<GenerateSummary> {
    let device = options.device.device();
    let (model, vocab) = load_model(&options.load, &device)?;
    let prompt = vocab.encode(&options.prompt)?;
    let start = Instant::now();
    let Generated {
        tokens,
        positions_computed,
    } = generate(
        &model,
        &prompt,
        options.tokens,
        &options.sampling,
        !options.no_cache,
    )?;
    let seconds = start.elapsed().as_secs_f64();
    Ok(GenerateSummary {
        text: format!("{}{}", options.prompt, vocab.decode(&tokens)),
        tokens: tokens.len(),
        positions_computed,
        tokens_per_second: if seconds > 0.0 {
            tokens.len() as f64 / seconds
        } else {
            0.0
        },
        cached: !options.no_cache,
    })
}
