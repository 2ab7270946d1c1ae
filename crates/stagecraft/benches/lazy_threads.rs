//! Lazy recording across threads: steps per second of one thread, and of
//! two threads at once, each recording and materializing its own 100-op
//! trace on [16]-element f32 tensors per step. The tensors are so small
//! that recording, not running, dominates a step, so the ratio of the two
//! rows shows whether threads record and materialize independently (2× on
//! two free cores) or wait for each other (1×).
//!
//! Criterion reports each row's throughput in steps ("elem") per second;
//! the ratio is the two-thread row's over the one-thread row's. Run with
//! `cargo bench -p stagecraft --bench lazy_threads`.

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use stagecraft::{Device, Tensor};
use std::time::{Duration, Instant};

/// Ops recorded per step.
const OPS_PER_STEP: usize = 100;

/// One step: 100 recorded ops (mul, add, tanh and sub by turns) on
/// [16]-element tensors, then a read of the result, which materializes it.
fn step(x: &Tensor<f32>, y: &Tensor<f32>) -> Vec<f32> {
    let mut t = x.clone();
    for _ in 0..OPS_PER_STEP / 4 {
        t = (&(&t * y) + x).tanh() - y;
    }
    t.to_vec().expect("the step's trace runs")
}

/// A thread's own inputs: concrete tensors on the lazy device.
fn inputs(seed: f32) -> (Tensor<f32>, Tensor<f32>) {
    let d = Device::lazy(&Device::cpu());
    let x = Tensor::from_vec((0..16).map(|i| seed + i as f32 / 16.0).collect(), &[16], &d);
    let y = Tensor::from_vec((0..16).map(|i| 0.5 - i as f32 / 64.0).collect(), &[16], &d);
    (x.expect("16 values"), y.expect("16 values"))
}

/// Wall time for `threads` threads to run `steps` steps each, side by side.
fn run_steps(threads: usize, steps: u64) -> Duration {
    let start = Instant::now();
    std::thread::scope(|scope| {
        for t in 0..threads {
            scope.spawn(move || {
                let (x, y) = inputs(t as f32);
                for _ in 0..steps {
                    black_box(step(&x, &y));
                }
            });
        }
    });
    start.elapsed()
}

fn lazy_threads(c: &mut Criterion) {
    // Compile the trace before measuring, with both threads' inputs: the
    // inputs are small constants, baked into the first compile and
    // promoted to trace arguments when the second thread's values differ.
    // Both rows then replay that one cached trace, which computes the
    // step; warmed by one thread alone, the one-thread row would replay a
    // trace whose result was folded to a constant.
    run_steps(2, 2);
    let mut g = c.benchmark_group("lazy_100_op_steps_16_f32");
    for threads in [1, 2] {
        // One criterion iteration is one step on every thread.
        g.throughput(Throughput::Elements(threads as u64));
        g.bench_function(format!("{threads}_thread"), |b| {
            b.iter_custom(|steps| run_steps(threads, steps))
        });
    }
    g.finish();
}

criterion_group!(benches, lazy_threads);
criterion_main!(benches);
