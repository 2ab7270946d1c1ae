//! A steady-state training step on the lazy device allocates no new
//! buffers: after warm-up every buffer comes from the pools (its own binary:
//! the allocation counters and the executor setting are process-wide).

use stagecraft::layers::tensor::Buffer;
use stagecraft::{lazy, Device, Rng, Tensor};

/// Steps before the count must be zero.
const WARM_UP: usize = 2;

#[test]
fn steady_state_lazy_training_allocates_no_buffers() {
    // The parallel executor, whose order of steps varies between runs:
    // each run's buffers come from an arena filled to the executable's
    // buffer plan, which bounds the blocks live at once in any order.
    std::env::set_var("STAGECRAFT_EXECUTOR", "parallel");
    let d = Device::lazy(&Device::cpu());
    let mut rng = Rng::new(1);
    let mut w1 = Tensor::<f32>::rand_normal(&[64, 128], 0.0, 0.1, &mut rng, &d);
    let mut w2 = Tensor::<f32>::rand_normal(&[128, 10], 0.0, 0.1, &mut rng, &d);
    let x = Tensor::<f32>::rand_uniform(&[128, 64], 0.0, 1.0, &mut rng, &d);
    let y = Tensor::<f32>::from_vec(
        (0..1280)
            .map(|i| if i % 10 == (i / 10) % 10 { 1.0 } else { 0.0 })
            .collect(),
        &[128, 10],
        &d,
    )
    .unwrap();
    lazy::mark_step();
    let mut per_step = Vec::new();
    let mut metric_per_step = Vec::new();
    for _ in 0..40 {
        let before = Buffer::stats().allocations;
        let (a, b) = (w1.requires_grad(), w2.requires_grad());
        let logits = x.matmul(&a).relu().matmul(&b);
        let loss = -(logits.log_softmax(-1) * &y)
            .sum(&[-1], false)
            .mean(&[0], false);
        let grads = loss.backward().unwrap();
        w1 = &a - &(grads.get(&a).unwrap() * 0.1);
        w2 = &b - &(grads.get(&b).unwrap() * 0.1);
        lazy::mark_step();
        drop(loss);
        per_step.push(Buffer::stats().allocations - before);
        metric_per_step.push(lazy::metrics().allocations_last_step);
    }
    // The first steps record and compile the trace and fill its arena;
    // from then on nothing is allocated.
    assert!(
        per_step[WARM_UP..].iter().all(|&n| n == 0),
        "fresh buffer allocations per step: {per_step:?}"
    );
    // The lazy metrics report the same (each step is one mark_step).
    assert!(
        metric_per_step[WARM_UP..].iter().all(|&n| n == 0),
        "allocations_last_step: {metric_per_step:?}"
    );
    let m = lazy::metrics();
    assert!(m.peak_bytes >= m.live_bytes && m.live_bytes > 0, "{m:?}");
    assert!(m.buffer_pool_hits > 0, "{m:?}");
}
