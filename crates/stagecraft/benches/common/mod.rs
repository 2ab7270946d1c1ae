//! Programs shared by the bench files.

use stagecraft::Tensor;

/// The B3 chain: t=x*2; t=t+1; t=t*x; t=t-3; relu; t=t*0.5; t=t+x; t=t*t.
pub fn b3(x: &Tensor<f32>) -> Tensor<f32> {
    let t = x * 2.0;
    let t = t + 1.0;
    let t = t * x;
    let t = t - 3.0;
    let t = t.relu();
    let t = t * 0.5;
    let t = t + x;
    &t * &t
}
