// An `if` condition in staged code is a `bool` or a `Tensor<bool>`.
use stagecraft::{Device, Tensor};

#[stagecraft::stage]
fn pick(x: Tensor<f32>) -> Tensor<f32> {
    let mut y = x.clone();
    if x.sum(&[0], false) {
        y = -&y;
    }
    y
}

fn main() {
    let _ = pick(Tensor::ones(&[2], &Device::cpu()));
}
