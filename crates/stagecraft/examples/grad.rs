//! Gradients: the tape API (`requires_grad`, `backward`, `Gradients::get`)
//! on one training step, and the functional `grad` composed with itself
//! for a second derivative.

use stagecraft::{grad, no_grad, value_and_grad, Device, Tensor};
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

    // One step of logistic regression with the tape API.
    let x = Tensor::<f64>::from_vec(vec![1.0, 2.0, -1.0, 0.5], &[2, 2], &cpu)?;
    let labels = Tensor::<f64>::from_vec(vec![1.0, 0.0], &[2, 1], &cpu)?;
    let w = Tensor::<f64>::zeros(&[2, 1], &cpu).requires_grad();
    let p = x.matmul(&w).sigmoid();
    let loss = -(&labels * p.log() + (1.0 - &labels) * (1.0 - &p).log()).mean(&[], false);
    let grads = loss.backward()?;
    let g = grads.get(&w).expect("the loss depends on w");
    writeln!(
        out,
        "loss {} and its gradient {}",
        loss.item()?,
        g.reshape(&[2])
    )?;
    let w = no_grad(|| &w - &(g * 0.5));
    writeln!(out, "after one step w = {}", w.reshape(&[2]))?;

    // f(x) = sum(x³): f' = 3x², f'' = 6x.
    let t = Tensor::<f64>::from_vec(vec![0.5, -1.0], &[2], &cpu)?;
    let cube = |x: &Tensor<f64>| (x * x * x).sum(&[0], false);
    let (value, slope) = value_and_grad(cube)(&t);
    writeln!(out, "f = {}, f' = {slope}", value.item()?)?;
    let curvature = grad(|x: &Tensor<f64>| grad(cube)(x).sum(&[0], false))(&t);
    writeln!(out, "f'' = {curvature}")?;
    Ok(())
}
