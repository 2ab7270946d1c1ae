//! A first stagecraft program: eager ops, broadcasting, reductions, a tiny
//! MLP forward pass, and an error that names its source line.

use stagecraft::{Device, Rng, Tensor};

pub fn main() -> stagecraft::Result<()> {
    let cpu = Device::cpu();
    let x = Tensor::<f32>::from_vec(vec![1.0, -2.0, 3.0, -4.0, 5.0, -6.0], &[2, 3], &cpu)?;
    let y = (&x * 2.0 + 1.0).relu();
    println!("x =\n{x}\nrelu(2x + 1) =\n{y}");
    println!("row sums = {}", y.sum(&[-1], false));

    let mut rng = Rng::new(0);
    let w = Tensor::<f32>::rand_normal(&[3, 4], 0.0, 0.5, &mut rng, &cpu);
    let probs = x.matmul(&w).tanh().softmax(-1);
    println!("softmax(tanh(x @ w)) =\n{probs}");
    println!("argmax = {}", probs.argmax(-1, false));

    // Shape errors are found at the call and reported with this file's line.
    let bad = x.matmul(&x);
    match bad.check() {
        Err(e) => println!("as expected: {e}"),
        Ok(()) => unreachable!("[2,3] @ [2,3] is invalid"),
    }
    Ok(())
}
