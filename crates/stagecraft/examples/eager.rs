//! A first stagecraft program: eager ops, broadcasting, reductions, a tiny
//! MLP forward pass, and an error that names its source line.

use stagecraft::{Device, Rng, Tensor};
use std::error::Error;
use std::io::Write;

/// Runs the example, printing to the standard output.
pub fn main() -> Result<(), Box<dyn Error>> {
    run(&mut std::io::stdout().lock())
}

/// The program, printing to `out` (`tests/examples.rs` runs it and checks
/// what it prints).
pub fn run(out: &mut dyn Write) -> Result<(), Box<dyn Error>> {
    let cpu = Device::cpu();
    let x = Tensor::<f32>::from_vec(vec![1.0, -2.0, 3.0, -4.0, 5.0, -6.0], &[2, 3], &cpu)?;
    let y = (&x * 2.0 + 1.0).relu();
    writeln!(out, "x =\n{x}\nrelu(2x + 1) =\n{y}")?;
    writeln!(out, "row sums = {}", y.sum(&[-1], false))?;

    let mut rng = Rng::new(0);
    let w = Tensor::<f32>::rand_normal(&[3, 4], 0.0, 0.5, &mut rng, &cpu);
    let probs = x.matmul(&w).tanh().softmax(-1);
    writeln!(out, "softmax(tanh(x @ w)) =\n{probs}")?;
    writeln!(out, "argmax = {}", probs.argmax(-1, false))?;

    // Shape errors are found at the call and reported with this file's line.
    let bad = x.matmul(&x);
    match bad.check() {
        Err(e) => writeln!(out, "as expected: {e}")?,
        Ok(()) => unreachable!("[2,3] @ [2,3] is invalid"),
    }
    Ok(())
}
