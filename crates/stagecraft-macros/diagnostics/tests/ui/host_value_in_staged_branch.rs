// A staged branch (on a Tensor<bool>) can only carry tensors: a host
// counter assigned inside it cannot become an output of the If op.
use stagecraft::{Device, Tensor};

#[stagecraft::stage]
fn count(x: Tensor<f32>) -> Tensor<f32> {
    let mut hits = 0usize;
    if x.sum(&[0], false).gt(&Tensor::scalar(0.0, &Device::cpu())) {
        hits += 1;
    }
    &x * hits as f32
}

fn main() {
    let _ = count(Tensor::ones(&[2], &Device::cpu()));
}
