//! B7: one training step of the character-level GPT at nanoGPT's CPU
//! settings (4 layers, 4 heads, 128 wide, context 64, batch 12, vocabulary
//! 84): forward, backward, one fused gradient-norm clip, the AdamW update
//! at the schedule's learning rate, and the loss read on the host. The
//! same step as `../shared/peers/bench_gpt_torch.py` runs in PyTorch.
//!
//! Rows:
//! - `lazy`: the step on the lazy device (one cached trace per step);
//! - `eager`: the same step op by op;
//! - `matmuls`: only the step's matrix products, eagerly, as separate
//!   ops of the step's shapes (three per linear layer: the forward product
//!   and the two of its gradient, for the 16 block layers and the tied
//!   head), the floor the breakdown compares the step with. Attention's
//!   own products run inside its fused op and are not in this row.
//!
//! Batches come from a fixed pseudo-random token stream over 84 symbols
//! (the corpus's size), so the bench needs no download; the step's cost
//! does not depend on which characters they are. Before the rows the
//! bench prints the lazy device's buffer allocations in a steady-state
//! step (the target is 0).
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
use std::time::Duration;

const VOCAB: usize = 84;

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
    let mut step = |model: &mut Gpt| {
        let (x, y) = &batches[k % batches.len()];
        k += 1;
        let loss = train_step(model, &mut opt, &schedule, options.clip, x, y).unwrap();
        lazy::mark_step();
        loss.item().unwrap()
    };
    for _ in 0..5 {
        step(&mut model);
    }
    if name == "lazy" {
        let m = lazy::metrics();
        println!(
            "B7 lazy steady state: {} buffer allocations in the last step, {} traces compiled",
            m.allocations_last_step, m.traces_compiled
        );
    }
    c.bench_function(&format!("B7/{name}"), |b| b.iter(|| step(&mut model)));
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
fn matmul_bench(c: &mut Criterion) {
    let cpu = Device::cpu();
    let rows = 12 * 64;
    let c_ = 128;
    let mut layers = Vec::new();
    for _ in 0..4 {
        layers.extend([(c_, 3 * c_), (c_, c_), (c_, 4 * c_), (4 * c_, c_)]);
    }
    layers.push((c_, VOCAB));
    let operands: Vec<_> = layers
        .iter()
        .map(|&(i, o)| {
            (
                Tensor::<f32>::full(&[rows, i], 0.5, &cpu),
                Tensor::<f32>::full(&[o, i], 0.25, &cpu),
                Tensor::<f32>::full(&[rows, o], 0.125, &cpu),
            )
        })
        .collect();
    c.bench_function("B7/matmuls", |b| {
        b.iter(|| {
            let mut outs = Vec::with_capacity(3 * operands.len());
            for (x, w, dy) in &operands {
                outs.push(matmul(x, w, false, true));
                outs.push(matmul(dy, w, false, false));
                outs.push(matmul(dy, x, true, false));
            }
            for t in &outs {
                t.wait().unwrap();
            }
        })
    });
}

fn benches(c: &mut Criterion) {
    let stream = tokens();
    step_bench(c, "lazy", &Device::lazy(&Device::cpu()), &stream);
    step_bench(c, "eager", &Device::cpu(), &stream);
    matmul_bench(c);
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
