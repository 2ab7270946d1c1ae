//! A staged `While` whose body works on [1000]-element tensors (B6)
//! allocates no fresh buffers per iteration once warm: every buffer of
//! every iteration comes from the pools. Its own binary: the allocation
//! counters are process-wide.

use stagecraft::layers::tensor::Buffer;
use stagecraft::{function, while_loop, Device, Tensor};

#[test]
fn a_warm_staged_loop_allocates_no_buffers() {
    let cpu = Device::cpu();
    let start = Tensor::<f32>::full(&[1000], 0.194, &cpu);
    let staged = function(|x: Tensor<f32>| {
        while_loop(
            x,
            |x| x.sum(&[0], false).ge(&Tensor::scalar(1.0, &Device::cpu())),
            |x| x * 0.9,
        )
    });
    let mut fresh = Vec::new();
    for _ in 0..6 {
        let before = Buffer::stats().allocations;
        let out = staged.call(start.clone());
        out.wait().unwrap();
        drop(out);
        fresh.push(Buffer::stats().allocations - before);
    }
    // 50 iterations a call, each a sum, a comparison and a product.
    let sum: f32 = staged.call(start.clone()).to_vec().unwrap().iter().sum();
    assert!(sum < 1.0 && sum * (1.0 / 0.9) >= 1.0, "sum {sum}");
    assert!(
        fresh[2..].iter().all(|&n| n == 0),
        "fresh buffer allocations per call of 50 iterations: {fresh:?}"
    );
}
