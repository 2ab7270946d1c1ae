//! B7: one training step of the character-level GPT at nanoGPT's CPU
//! settings (4 layers, 4 heads, 128 wide, context 64, batch 12, vocabulary
//! 84): forward, backward, one fused gradient-norm clip, the AdamW update
//! at the schedule's learning rate, and the loss read on the host. The
//! same step as `../shared/peers/bench_gpt_torch.py` runs in PyTorch.
//!
//! Rows:
//! - `lazy`: the step on the lazy device (one cached trace per step);
//! - `eager`: the same step op by op;
//! - `lazy-forward`, `eager-forward`: the loss of one batch in evaluation
//!   mode without gradients (what `estimate_loss` runs per batch, and
//!   inference of the same model): the forward pass alone, with GELU fused
//!   into its product's epilogue;
//! - `matmuls`: only the step's matrix products, eagerly, as separate
//!   ops of the step's shapes (three per linear layer: the forward product
//!   and the two of its gradient, for the 16 block layers and the tied
//!   head), the floor the breakdown compares the step with. Attention's
//!   own products run inside its fused op and are not in this row.
//!
//! Batches come from a fixed pseudo-random token stream over 84 symbols
//! (the corpus's size), so the bench needs no download; the step's cost
//! does not depend on which characters they are. Before the rows the
//! bench prints the most buffer allocations the lazy device made in any
//! of 20 steady-state steps (the target is 0).
//!
//! With `STAGECRAFT_BENCH_GPU=1` (and `--features wgpu`) the rows run on
//! `gpu:0` instead: `gpu-lazy`, `gpu-eager` and `gpu-matmuls`, beside
//! PyTorch CUDA's step from `scripts/bench_torch_cuda.py`.
//!
//! Run on both cores and on one pinned core:
//! `RAYON_NUM_THREADS=2 cargo bench -p stagecraft-cli --bench gpt_step` and
//! `RAYON_NUM_THREADS=1 taskset -c 0 cargo bench -p stagecraft-cli --bench gpt_step`.

use criterion::{criterion_group, criterion_main, Criterion};
use stagecraft::layers::ops::{self as ops, OpAttrs};
use stagecraft::layers::runtime::{self as runtime, Args, TensorHandle};
use stagecraft::nn::ModuleExt;
use stagecraft::{lazy, Device, Location, Tensor};
use stagecraft_cli::gpt::Gpt;
use stagecraft_cli::lm::{optimizer, train_step, Batches, LmOptions};
use std::time::{Duration, Instant};

const VOCAB: usize = 84;

/// Steps run before a step is timed or its allocations counted.
const WARM_UP_STEPS: usize = 30;

/// A fixed stream of tokens below [`VOCAB`].
fn tokens() -> Vec<u32> {
    let mut state = 0x5eed_u64;
    (0..200_000)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) % VOCAB as u64) as u32
        })
        .collect()
}

fn step_bench(c: &mut Criterion, name: &str, device: &Device, stream: &[u32]) {
    let options = LmOptions::defaults(VOCAB);
    let mut model = Gpt::new(options.config, 1337, device);
    model.requires_grad();
    let (mut opt, schedule) = optimizer(&options);
    let mut draw = Batches::new(stream, options.batch_size, options.config.block_size, 1).unwrap();
    // Eight batches reused in turn, as the peer does.
    let batches: Vec<(Tensor<i32>, Tensor<i32>)> =
        (0..8).map(|_| draw.next(device).unwrap()).collect();
    let mut k = 0;
    // One step, in three timed phases: recording the ops, running the
    // trace (on a GPU: launching its kernels), waiting for the loss.
    let mut step = |model: &mut Gpt, phases: &mut [Duration; 3]| {
        let (x, y) = &batches[k % batches.len()];
        k += 1;
        let start = Instant::now();
        let loss = train_step(model, &mut opt, &schedule, options.clip, x, y).unwrap();
        let recorded = Instant::now();
        lazy::mark_step();
        let ran = Instant::now();
        let value = loss.item().unwrap();
        phases[0] += recorded - start;
        phases[1] += ran - recorded;
        phases[2] += ran.elapsed();
        value
    };
    let mut phases = [Duration::ZERO; 3];
    // On two threads the dataflow executor runs independent ops side by
    // side, in an order that differs from step to step, so the buffer
    // pools can take some 20 steps to reach their high-water mark
    // (docs/performance.md, "Adam's update in one pass").
    for _ in 0..WARM_UP_STEPS {
        step(&mut model, &mut phases);
    }
    if name.ends_with("lazy") {
        let ops_before = runtime::stats().ops_executed;
        let before = lazy::metrics();
        let (steps, mut phases) = (20u32, [Duration::ZERO; 3]);
        let mut most_allocations = 0;
        for _ in 0..steps {
            step(&mut model, &mut phases);
            most_allocations = most_allocations.max(lazy::metrics().allocations_last_step);
        }
        let after = lazy::metrics();
        println!(
            "B7 {name} steady state: at most {most_allocations} buffer allocations per step \
             over {steps} steps after {WARM_UP_STEPS}, {} traces compiled",
            after.traces_compiled
        );
        println!(
            "B7 {name} per step: recording {:.2?}, running the trace {:.2?}, reading the loss {:.2?}; {} ops",
            phases[0] / steps,
            phases[1] / steps,
            phases[2] / steps,
            (runtime::stats().ops_executed - ops_before) / u64::from(steps)
        );
        // The trace's run, apart: what the host does around the kernels
        // runs while the pool waits.
        println!(
            "B7 {name} trace per step: collecting {:.2?}, key {:.2?}, lookup {:.2?}, executing {:.2?}",
            (after.collect_time - before.collect_time) / steps,
            (after.key_time - before.key_time) / steps,
            (after.lookup_time - before.lookup_time) / steps,
            (after.execute_time - before.execute_time) / steps,
        );
    }
    c.bench_function(&format!("B7/{name}"), |b| {
        b.iter(|| step(&mut model, &mut phases))
    });
}

/// The loss of one batch in evaluation mode, without gradients, read on
/// the host: the forward pass alone.
fn forward_bench(c: &mut Criterion, name: &str, device: &Device, stream: &[u32]) {
    let options = LmOptions::defaults(VOCAB);
    let mut model = Gpt::new(options.config, 1337, device);
    model.eval();
    let mut draw = Batches::new(stream, options.batch_size, options.config.block_size, 2).unwrap();
    let batches: Vec<(Tensor<i32>, Tensor<i32>)> =
        (0..8).map(|_| draw.next(device).unwrap()).collect();
    let mut k = 0;
    c.bench_function(&format!("B7/{name}"), |b| {
        b.iter(|| {
            let (x, y) = &batches[k % batches.len()];
            k += 1;
            let loss = stagecraft::no_grad(|| model.loss(x, y));
            lazy::mark_step();
            loss.item().unwrap()
        })
    });
}

/// `a·b` with either operand transposed inside the kernel, as the
/// gradient rules run it.
fn matmul(a: &Tensor<f32>, b: &Tensor<f32>, ta: bool, tb: bool) -> TensorHandle {
    let mut attrs = OpAttrs::new();
    attrs
        .set_bool("transpose_a", ta)
        .set_bool("transpose_b", tb);
    let args: Args = [a.handle().clone(), b.handle().clone()]
        .into_iter()
        .collect();
    runtime::execute(
        &ops::MATMUL,
        a.device(),
        Location::caller(),
        args,
        (&attrs).into(),
    )
    .swap_remove(0)
}

/// The step's matrix products as separate eager ops: for each linear
/// layer `y = x·Wᵀ` (`[768, in] × [out, in]ᵀ`), its input gradient
/// `dy·W` and its weight gradient `dyᵀ·x`.
fn matmul_bench(c: &mut Criterion, name: &str, device: &Device) {
    let rows = 12 * 64;
    let c_ = 128;
    let mut layers = Vec::new();
    for _ in 0..4 {
        layers.extend([(c_, 3 * c_), (c_, c_), (c_, 4 * c_), (4 * c_, c_)]);
    }
    layers.push((c_, VOCAB));
    // Dense values, as the step's are: a `Tensor::full` holds one value
    // that every op reading it expands to a dense buffer first, a cost the
    // step's products do not pay (docs/performance.md, "A lazy trace runs
    // in recording order").
    let dense = |dims: &[usize], value: f32| {
        let count = dims.iter().product();
        Tensor::<f32>::from_vec(vec![value; count], dims, device).expect("a valid shape")
    };
    let operands: Vec<_> = layers
        .iter()
        .map(|&(i, o)| {
            (
                dense(&[rows, i], 0.5),
                dense(&[o, i], 0.25),
                dense(&[rows, o], 0.125),
            )
        })
        .collect();
    c.bench_function(&format!("B7/{name}"), |b| {
        b.iter(|| {
            let mut outs = Vec::with_capacity(3 * operands.len());
            for (x, w, dy) in &operands {
                outs.push(matmul(x, w, false, true));
                outs.push(matmul(dy, w, false, false));
                outs.push(matmul(dy, x, true, false));
            }
            for t in &outs {
                t.wait_value().unwrap();
            }
            // A GPU's products are ready when recorded: wait for them.
            device.synchronize().unwrap();
        })
    });
}

fn benches(c: &mut Criterion) {
    let stream = tokens();
    if std::env::var_os("STAGECRAFT_BENCH_GPU").is_some() {
        let gpu = Device::try_gpu(0).unwrap_or_else(|e| {
            panic!("STAGECRAFT_BENCH_GPU asks for gpu:0 (build with `--features wgpu`): {e}")
        });
        step_bench(c, "gpu-lazy", &Device::lazy(&gpu), &stream);
        step_bench(c, "gpu-eager", &gpu, &stream);
        matmul_bench(c, "gpu-matmuls", &gpu);
        return;
    }
    step_bench(c, "lazy", &Device::lazy(&Device::cpu()), &stream);
    step_bench(c, "eager", &Device::cpu(), &stream);
    forward_bench(c, "lazy-forward", &Device::lazy(&Device::cpu()), &stream);
    forward_bench(c, "eager-forward", &Device::cpu(), &stream);
    matmul_bench(c, "matmuls", &Device::cpu());
}

criterion_group! {
    name = b7;
    config = Criterion::default()
        .sample_size(30)
        .warm_up_time(Duration::from_secs(2))
        .measurement_time(Duration::from_secs(6));
    targets = benches
}
criterion_main!(b7);
