//! Memory over a long run (issue 9, point 6): 10,000 SGD steps (momentum
//! 0.9) of the 784-256-256-10 MLP on the lazy CPU device, batch size 32 (the
//! command's default is 64; 32 keeps the test within a minute on a shared
//! 2-core machine without changing what is measured: every step still runs
//! the same cached trace). Each step builds its batch from host data, as
//! training does, runs forward, backward and update, `mark_step`s and reads
//! the loss.
//!
//! After a warm-up of [`WARM_UP`] steps:
//! - no step allocates a buffer from the system (`Buffer::stats()
//!   .allocations` and the lazy metrics' `allocations_last_step` are zero
//!   for every step): every buffer comes from the pools;
//! - resident memory (`VmRSS` from `/proc/self/status`, sampled every
//!   [`SAMPLE_EVERY`] steps) stays within [`RSS_SLACK`] of its value at the
//!   end of warm-up;
//! - live buffer bytes return to the same value after every step.
//!
//! Its own binary: the allocation counters, RSS and the executor setting
//! are process-wide.
//!
//! Runs the parallel dataflow executor (forced, so that a one-core machine
//! tests it too), where the order of steps differs from run to run. Each
//! run draws its buffers from an arena filled to the executable's buffer
//! plan, an upper bound on the blocks live at once in any order. Before the
//! plan, with the shared pool alone, a rare order needed one more block than
//! any earlier run: 1 to 11 of 9,500 steps after warm-up allocated one
//! buffer each.

use stagecraft::layers::tensor::Buffer;
use stagecraft::{lazy, Device, Rng, Tensor};
use std::time::Instant;

const STEPS: usize = 10_000;
const WARM_UP: usize = 500;
const SAMPLE_EVERY: usize = 250;
const BATCH: usize = 32;
/// Allowed growth of resident memory after warm-up.
const RSS_SLACK: u64 = 4 << 20;

fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let line = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .expect("a VmRSS line");
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .expect("VmRSS in kB");
    kib * 1024
}

/// Host batches to cycle through: scaled "pixels" and one-hot labels.
fn host_batches(count: usize) -> Vec<(Vec<f32>, Vec<f32>)> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    (0..count)
        .map(|_| {
            let x: Vec<f32> = (0..BATCH * 784)
                .map(|_| (next() % 256) as f32 / 255.0 - 0.5)
                .collect();
            let mut y = vec![0.0f32; BATCH * 10];
            for row in 0..BATCH {
                y[row * 10 + (next() % 10) as usize] = 1.0;
            }
            (x, y)
        })
        .collect()
}

#[test]
fn ten_thousand_lazy_mlp_steps_allocate_nothing_and_keep_memory_flat() {
    std::env::set_var("STAGECRAFT_EXECUTOR", "parallel");
    let d = Device::lazy(&Device::cpu());
    let mut rng = Rng::new(3);
    let shapes: [&[usize]; 6] = [&[784, 256], &[256], &[256, 256], &[256], &[256, 10], &[10]];
    let mut params: Vec<Tensor<f32>> = shapes
        .iter()
        .map(|dims| {
            let fan_in = dims[0] as f64;
            if dims.len() == 2 {
                Tensor::rand_normal(dims, 0.0, (2.0 / fan_in).sqrt(), &mut rng, &d)
            } else {
                Tensor::zeros(dims, &d)
            }
        })
        .collect();
    let mut velocity: Vec<Tensor<f32>> =
        shapes.iter().map(|dims| Tensor::zeros(dims, &d)).collect();
    let batches = host_batches(16);
    lazy::mark_step();

    let (lr, momentum) = (0.01f32, 0.9f32);
    let mut fresh_after_warm_up = Vec::new();
    let mut metric_after_warm_up = Vec::new();
    let mut live_after_step = Vec::new();
    let mut rss_samples = Vec::new();
    let mut losses = Vec::new();
    let start = Instant::now();
    let mut warm_up_time = None;
    for step in 0..STEPS {
        let before = Buffer::stats().allocations;
        let (xs, ys) = &batches[step % batches.len()];
        let x = Tensor::from_slice(xs, &[BATCH, 784], &d).unwrap();
        let y = Tensor::from_slice(ys, &[BATCH, 10], &d).unwrap();
        let tracked: Vec<Tensor<f32>> = params.iter().map(|p| p.requires_grad()).collect();
        let h = (x.matmul(&tracked[0]) + &tracked[1]).relu();
        let h = (h.matmul(&tracked[2]) + &tracked[3]).relu();
        let logits = h.matmul(&tracked[4]) + &tracked[5];
        let loss = -(logits.log_softmax(-1) * &y)
            .sum(&[-1], false)
            .mean(&[0], false);
        let grads = loss.backward().unwrap();
        for (i, p) in tracked.iter().enumerate() {
            let v = &velocity[i] * momentum + grads.get(p).unwrap();
            params[i] = p - &(&v * lr);
            velocity[i] = v;
        }
        lazy::mark_step();
        let value = loss.item().unwrap();
        drop((loss, grads, tracked, logits, h, x, y));
        if step % 1000 == 0 {
            losses.push(value);
        }
        if step >= WARM_UP {
            fresh_after_warm_up.push(Buffer::stats().allocations - before);
            metric_after_warm_up.push(lazy::metrics().allocations_last_step);
            live_after_step.push(Buffer::stats().live_bytes);
        }
        if step + 1 == WARM_UP {
            warm_up_time = Some(start.elapsed());
        }
        if (step + 1) % SAMPLE_EVERY == 0 && step + 1 >= WARM_UP {
            rss_samples.push(rss_bytes());
        }
    }
    let elapsed = start.elapsed();

    assert!(losses.iter().all(|l| l.is_finite()), "losses: {losses:?}");
    assert!(
        losses.last() < losses.first(),
        "training made progress: {losses:?}"
    );
    let fresh: u64 = fresh_after_warm_up.iter().sum();
    let steps_allocating = fresh_after_warm_up.iter().filter(|&&n| n > 0).count();
    let rss_base = rss_samples[0];
    let rss_max = *rss_samples.iter().max().unwrap();
    let (live_min, live_max) = (
        *live_after_step.iter().min().unwrap(),
        *live_after_step.iter().max().unwrap(),
    );
    eprintln!(
        "{STEPS} steps (batch {BATCH}) in {elapsed:?} (warm-up {WARM_UP} steps: {warm_up_time:?}); \
         after warm-up: {fresh} fresh buffer allocations in {steps_allocating} steps; \
         RSS {} KiB at warm-up, max {} KiB (+{} KiB), last {} KiB; \
         live buffer bytes after each step {live_min}..={live_max}; losses {losses:?}",
        rss_base / 1024,
        rss_max / 1024,
        (rss_max - rss_base) / 1024,
        rss_samples.last().unwrap() / 1024,
    );
    assert_eq!(
        fresh,
        0,
        "{steps_allocating} steps after warm-up allocated buffers: {:?}",
        fresh_after_warm_up
            .iter()
            .enumerate()
            .filter(|(_, &n)| n > 0)
            .map(|(i, n)| (i + WARM_UP, *n))
            .take(20)
            .collect::<Vec<_>>()
    );
    assert!(
        metric_after_warm_up.iter().all(|&n| n == 0),
        "the lazy metrics' allocations_last_step was non-zero after warm-up"
    );
    assert_eq!(
        live_min, live_max,
        "live buffer bytes after each step drift"
    );
    assert!(
        rss_max - rss_base <= RSS_SLACK,
        "resident memory grew by {} KiB after warm-up (samples: {:?} KiB)",
        (rss_max - rss_base) / 1024,
        rss_samples.iter().map(|r| r / 1024).collect::<Vec<_>>()
    );
}
