// The two branches of a staged `if` must have one type.
use stagecraft::{Device, Tensor};

#[stagecraft::stage]
fn pick(x: Tensor<f32>) -> Tensor<f32> {
    let positive = x.sum(&[0], false).gt(&Tensor::scalar(0.0, &Device::cpu()));
    let y = if positive { x.clone() } else { x.cast::<i64>() };
    y
}

fn main() {
    let _ = pick(Tensor::ones(&[2], &Device::cpu()));
}
