//! A staged `While` over [1000]-element tensors allocates no buffers per
//! iteration once warm: its body writes the [1000]-element state in place,
//! and its condition's two scalar outputs come from the thread's cache of
//! small blocks (its own binary: the buffer counters are process-wide).

use stagecraft::layers::tensor::Buffer;
use stagecraft::{function, while_loop, Device, Tensor};

#[test]
fn a_staged_loop_allocates_no_buffers_per_iteration() {
    let cpu = Device::cpu();
    // `while sum(x) >= 1 { x *= 0.9 }`: the staging benchmark's loop (B6).
    let staged = function(|x: Tensor<f32>| {
        while_loop(
            x,
            |x| x.sum(&[0], false).ge(&Tensor::scalar(1.0, &Device::cpu())),
            |x| x * 0.9,
        )
    });
    let run = |start: f32| {
        let x = Tensor::<f32>::full(&[1000], start, &cpu);
        let before = Buffer::stats();
        let out = staged.call(x).to_vec().unwrap();
        let after = Buffer::stats();
        let fresh = after.allocations - before.allocations;
        // Every buffer handed out: fresh ones and reused ones.
        let requests = fresh + after.pool_hits - before.pool_hits;
        ((fresh, requests), out)
    };
    // Warm-up: tracing, instantiating, and the first blocks of each size.
    run(0.194);
    run(0.194);
    // Sums of 1000·start·0.9ⁿ: 50 iterations from 0.194, 94 from 19.4.
    let (short, out) = run(0.194);
    let want = 0.194f32 * 0.9f32.powi(50);
    assert!(
        (out[0] - want).abs() <= 1e-5 * want,
        "{} against {want}",
        out[0]
    );
    let (long, out) = run(19.4);
    assert!(
        out[0] * 1000.0 < 1.0 && out[0] * 1000.0 >= 0.9 * 0.9,
        "{}",
        out[0]
    );
    // The argument is made once per call; nothing is allocated per
    // iteration, so 94 iterations allocate what 50 do.
    assert_eq!(
        short.0, long.0,
        "fresh allocations of a 50- and a 94-iteration call"
    );
    assert!(short.0 <= 2, "fresh allocations of one call: {}", short.0);
    // Per iteration, at most the condition's sum and verdict ask for a
    // buffer: the body's product is written into the state's own.
    let per_iteration = (long.1 - short.1) as f64 / 44.0;
    assert!(
        per_iteration <= 2.0,
        "buffers requested per iteration: {per_iteration} ({short:?}, {long:?})"
    );
}
