// A closure capturing a staged tensor cannot escape the staged function:
// only tensors and host values can be its results.
use stagecraft::{Device, Tensor};

#[stagecraft::stage]
fn scaler(x: Tensor<f32>) -> Box<dyn Fn() -> Tensor<f32>> {
    let y = &x * 2.0;
    Box::new(move || y.clone())
}

fn main() {
    let _ = scaler(Tensor::ones(&[2], &Device::cpu()));
}
