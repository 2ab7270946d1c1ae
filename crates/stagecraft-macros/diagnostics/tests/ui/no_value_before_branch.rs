// A variable a staged branch assigns needs a value before the `if`.
use stagecraft::{Device, Tensor};

#[stagecraft::stage]
fn pick(x: Tensor<f32>) -> Tensor<f32> {
    let y;
    if x.sum(&[0], false).gt(&Tensor::scalar(0.0, &Device::cpu())) {
        y = &x * 2.0;
    } else {
        y = -&x;
    }
    y
}

fn main() {
    let _ = pick(Tensor::ones(&[2], &Device::cpu()));
}
