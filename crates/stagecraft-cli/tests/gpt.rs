//! The character-level GPT end to end on a small text the test writes:
//! training on the eager and lazy devices gives the same losses, the lazy
//! run replays one trace without allocating, save → load keeps the logits,
//! generation is deterministic and the key/value cache changes nothing,
//! and bad input is an error naming the op and the caller's line.

use stagecraft::nn::ModuleExt;
use stagecraft::{lazy, Device, Tensor};
use stagecraft_cli::gpt::{generate, Gpt, GptConfig, Sampling};
use stagecraft_cli::lm::{
    copy_to, estimate_loss, load_model, optimizer, save_model, train_step, Batches, LmOptions,
};
use stagecraft_cli::shakespeare::Corpus;
use std::sync::Mutex;

/// Tests that run lazy work or read the process-wide lazy metrics run one
/// at a time (lazy work on another thread would count in the metrics).
static SERIAL: Mutex<()> = Mutex::new(());

fn corpus() -> Corpus {
    let text = "To be, or not to be, that is the question:\n\
                Whether 'tis nobler in the mind to suffer\n\
                The slings and arrows of outrageous fortune,\n\
                Or to take arms against a sea of troubles\n"
        .repeat(20);
    Corpus::from_text(text.as_bytes()).unwrap()
}

fn options(corpus: &Corpus, steps: usize) -> LmOptions {
    let mut options = LmOptions::defaults(corpus.vocab.len());
    options.config = GptConfig {
        vocab: corpus.vocab.len(),
        n_layer: 2,
        n_head: 2,
        n_embd: 32,
        block_size: 16,
        dropout: 0.0,
    };
    options.steps = steps;
    options.batch_size = 4;
    options.warmup = 5;
    options.lr = 3e-3;
    options
}

/// The losses of `steps` training steps on `device`.
fn train(corpus: &Corpus, options: &LmOptions, device: &Device) -> (Gpt, Vec<f32>) {
    let mut model = Gpt::new(options.config, 7, device);
    model.requires_grad();
    // Initialization runs on its own, not as part of the first step.
    lazy::mark_step();
    let (mut opt, schedule) = optimizer(options);
    let mut batches = Batches::new(
        &corpus.train,
        options.batch_size,
        options.config.block_size,
        3,
    )
    .unwrap();
    let mut losses = Vec::new();
    for _ in 0..options.steps {
        let (x, y) = batches.next(device).unwrap();
        let loss = train_step(&mut model, &mut opt, &schedule, options.clip, &x, &y).unwrap();
        lazy::mark_step();
        losses.push(loss.item().unwrap());
    }
    (model, losses)
}

#[test]
fn eager_and_lazy_training_agree_and_the_lazy_run_is_one_trace() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let corpus = corpus();
    let options = options(&corpus, 50);
    let (_, eager) = train(&corpus, &options, &Device::cpu());
    lazy::reset_metrics();
    let (_, lazy_losses) = train(&corpus, &options, &Device::lazy(&Device::cpu()));
    let m = lazy::metrics();
    for (step, (a, b)) in eager.iter().zip(&lazy_losses).enumerate() {
        assert!(
            (a - b).abs() <= 1e-4 * a.abs().max(1.0),
            "step {step}: eager {a}, lazy {b}"
        );
    }
    // It learns: the last losses are well below the first.
    let first = eager[..5].iter().sum::<f32>() / 5.0;
    let last = eager[45..].iter().sum::<f32>() / 5.0;
    assert!(last < first - 0.5, "loss {first} -> {last}");
    // The schedule changes the learning rate every step, yet the step
    // compiles at most twice (its first recording, then one widening that
    // makes the changing scalars arguments), besides the initialization's
    // own trace; and a steady step allocates nothing.
    assert!(m.traces_compiled <= 3, "{m:?}");
    assert_eq!(m.allocations_last_step, 0, "{m:?}");
}

/// The GPT trains on the GPU, op by op and lazily (one cached trace per
/// step), with the CPU's losses, dropout included, and no op of a step
/// falls back to the CPU. Needs `gpu:0` in a build with the `wgpu`
/// feature (the test command's); elsewhere the device's error is checked.
#[test]
fn the_gpt_trains_on_the_gpu_eagerly_and_lazily_with_the_cpus_losses() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let gpu = match Device::try_gpu(0) {
        Ok(gpu) => gpu,
        Err(e) => {
            assert!(e.to_string().contains("`wgpu` feature"), "{e}");
            eprintln!("skipped: no GPU device in this build ({e})");
            return;
        }
    };
    let corpus = corpus();
    let mut options = options(&corpus, 6);
    // Dropout draws the same masks on both devices.
    options.config.dropout = 0.1;
    let (_, cpu) = train(&corpus, &options, &Device::cpu());
    for device in [gpu, Device::lazy(&gpu)] {
        lazy::reset_metrics();
        let (_, losses) = train(&corpus, &options, &device);
        for (step, (a, b)) in cpu.iter().zip(&losses).enumerate() {
            assert!(
                (a - b).abs() <= 1e-3 * a.abs().max(1.0),
                "{device} step {step}: CPU {a}, GPU {b}"
            );
        }
        if device.lazy_target().is_some() {
            assert!(lazy::metrics().cache_hits >= 3, "{:?}", lazy::metrics());
        }
    }
    // Every op of a training step has a GPU kernel: only the weights'
    // random initialization ran on the CPU. (Only a build with the GPU
    // device gets this far, but every build compiles the test.)
    #[cfg(feature = "wgpu")]
    {
        let fallbacks = stagecraft::layers::runtime::cpu_fallbacks();
        assert!(
            fallbacks
                .iter()
                .all(|f| f == "RandomNormal[]" || f == "RandomUniform[]"),
            "{fallbacks:?}"
        );
    }
}

#[test]
fn save_and_load_keep_the_logits() {
    let corpus = corpus();
    let options = options(&corpus, 5);
    let (model, _) = train(&corpus, &options, &Device::cpu());
    let dir = std::env::temp_dir().join(format!("stagecraft-gpt-{}", std::process::id()));
    let path = dir.join("gpt.safetensors");
    save_model(&model, &corpus.vocab, &path).unwrap();
    let (loaded, vocab) = load_model(&path, &Device::cpu()).unwrap();
    assert_eq!(vocab, corpus.vocab);
    assert_eq!(loaded.config, model.config);
    let ids: Vec<i32> = corpus.train[..16].iter().map(|&t| t as i32).collect();
    let x = Tensor::from_vec(ids, &[1, 16], &Device::cpu()).unwrap();
    assert_eq!(
        model.forward(&x).to_vec().unwrap(),
        loaded.forward(&x).to_vec().unwrap()
    );
    // A file that is not a GPT checkpoint says so.
    std::fs::write(&path, b"not safetensors").unwrap();
    let err = load_model(&path, &Device::cpu()).unwrap_err().to_string();
    assert!(err.contains("gpt.safetensors"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn generation_is_seeded_and_the_cache_changes_nothing() {
    let corpus = corpus();
    let options = options(&corpus, 20);
    let (model, _) = train(&corpus, &options, &Device::cpu());
    let prompt = corpus.vocab.encode("To be").unwrap();
    let sampling = Sampling {
        temperature: 0.8,
        top_k: Some(5),
        seed: 1,
    };
    // 40 tokens run past the context of 16 twice: the window restarts.
    let cached = generate(&model, &prompt, 40, &sampling, true).unwrap();
    let again = generate(&model, &prompt, 40, &sampling, true).unwrap();
    let uncached = generate(&model, &prompt, 40, &sampling, false).unwrap();
    assert_eq!(cached.tokens.len(), 40);
    assert_eq!(cached.tokens, again.tokens);
    assert_eq!(cached.tokens, uncached.tokens);
    // The cache runs each new token once (plus refills), far fewer
    // positions than the windows.
    assert!(
        cached.positions_computed * 3 < uncached.positions_computed,
        "{} vs {}",
        cached.positions_computed,
        uncached.positions_computed
    );
    let other = Sampling {
        seed: 2,
        ..sampling
    };
    let different = generate(&model, &prompt, 40, &other, true).unwrap();
    assert_ne!(cached.tokens, different.tokens);
}

#[test]
fn cached_logits_equal_the_full_forward() {
    let corpus = corpus();
    let model = Gpt::new(options(&corpus, 1).config, 3, &Device::cpu());
    let ids: Vec<i32> = corpus.train[..12].iter().map(|&t| t as i32).collect();
    let full = model
        .forward(&Tensor::from_vec(ids.clone(), &[1, 12], &Device::cpu()).unwrap())
        .to_vec()
        .unwrap();
    let mut cache = Default::default();
    let mut incremental = Vec::new();
    // A prefix of 5, then one position at a time, then a chunk of 3.
    for (a, b) in [(0, 5), (5, 6), (6, 7), (7, 8), (8, 9), (9, 12)] {
        let x = Tensor::from_vec(ids[a..b].to_vec(), &[1, b - a], &Device::cpu()).unwrap();
        incremental.extend(model.forward_cached(&x, &mut cache).to_vec().unwrap());
    }
    assert_eq!(full.len(), incremental.len());
    for (i, (a, b)) in full.iter().zip(&incremental).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 * a.abs().max(1.0),
            "logit {i}: {a} vs {b}"
        );
    }
}

/// The error of `t`: its op, and the line it names.
fn error_of(t: &Tensor<f32>) -> (String, u32) {
    let err = t.to_vec().unwrap_err();
    (
        err.op().unwrap_or("").to_string(),
        err.location().map(|l| l.line()).unwrap_or(0),
    )
}

#[test]
fn bad_input_names_the_op_and_the_line() {
    let corpus = corpus();
    let cpu = Device::cpu();
    let model = Gpt::new(options(&corpus, 1).config, 3, &cpu);
    let vocab = corpus.vocab.len() as i32;

    let out_of_range = Tensor::from_vec(vec![0, vocab], &[1, 2], &cpu).unwrap();
    let line = line!() + 1;
    let logits = model.forward(&out_of_range);
    assert_eq!(error_of(&logits), ("Embedding".to_string(), line));

    let too_long = Tensor::from_vec(vec![0; 17], &[1, 17], &cpu).unwrap();
    let line = line!() + 1;
    let logits = model.forward(&too_long);
    assert_eq!(error_of(&logits), ("Gpt".to_string(), line));
    let message = logits.to_vec().unwrap_err().to_string();
    assert!(message.contains("context of 16"), "{message}");

    let x = Tensor::from_vec(vec![0; 8], &[2, 4], &cpu).unwrap();
    let wrong_targets = Tensor::from_vec(vec![0; 6], &[2, 3], &cpu).unwrap();
    let line = line!() + 1;
    let loss = model.loss(&x, &wrong_targets);
    assert_eq!(error_of(&loss), ("CrossEntropy".to_string(), line));
}

#[test]
fn validation_loss_is_the_mean_of_fixed_batches() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let corpus = corpus();
    let mut model = Gpt::new(options(&corpus, 1).config, 3, &Device::cpu());
    let a = estimate_loss(&mut model, &corpus.val, 4, 7, 3).unwrap();
    let b = estimate_loss(&mut model, &corpus.val, 4, 7, 3).unwrap();
    assert_eq!(a, b);
    // An untrained model is near the uniform guess, ln(vocab).
    let uniform = (corpus.vocab.len() as f64).ln();
    assert!((a - uniform).abs() < 0.5, "{a} vs {uniform}");
    // The same parameters on the lazy device give the same loss.
    let mut lazy_model = copy_to(&model, &Device::lazy(&Device::cpu()));
    let c = estimate_loss(&mut lazy_model, &corpus.val, 4, 7, 3).unwrap();
    assert!((a - c).abs() < 1e-5, "{a} vs {c}");
}
