// `loop` with a `break` value cannot be staged.
use stagecraft::{Device, Tensor};

#[stagecraft::stage]
fn first(x: Tensor<f32>) -> Tensor<f32> {
    let mut y = x;
    let found = loop {
        y = &y * 0.5;
        break y.clone();
    };
    found
}

fn main() {
    let _ = first(Tensor::ones(&[2], &Device::cpu()));
}
