//! The lazy device: the seed's w/x/y/z program, its trace with live outputs,
//! and a training loop whose every step is one cached trace.

use stagecraft::{lazy, no_grad, Device, Rng, Tensor};
use std::error::Error;
use std::io::Write;

/// Runs the example, printing to the standard output.
pub fn main() -> Result<(), Box<dyn Error>> {
    run(&mut std::io::stdout().lock())
}

/// The program, printing to `out` (`tests/examples.rs` runs it and checks
/// what it prints).
pub fn run(out: &mut dyn Write) -> Result<(), Box<dyn Error>> {
    let dev = Device::lazy(&Device::cpu());
    let a = Tensor::<f32>::scalar(10.0, &dev);
    let b = Tensor::<f32>::scalar(2.0, &dev);
    let c = Tensor::<f32>::scalar(3.0, &dev);
    let w = &a + &b;
    let x = &w - &c;
    let y = &(&x + &x) + &w;
    let z = &y + &y;
    writeln!(out, "z has shape {:?} before anything ran", z.dims())?;
    writeln!(out, "{}", lazy::trace_text(&z)?)?;
    drop((w, x, y));
    writeln!(out, "after dropping w, x, y:\n{}", lazy::trace_text(&z)?)?;
    writeln!(out, "z = {}", z.item()?)?;

    // A small regression trained with backward(): one trace per step.
    lazy::reset_metrics();
    let mut rng = Rng::new(0);
    let mut weights = Tensor::<f32>::rand_normal(&[4, 1], 0.0, 0.1, &mut rng, &dev);
    let inputs = Tensor::<f32>::rand_uniform(&[32, 4], -1.0, 1.0, &mut rng, &dev);
    let truth = Tensor::<f32>::from_vec(vec![1.0, -2.0, 0.5, 3.0], &[4, 1], &dev)?;
    let targets = inputs.matmul(&truth);
    lazy::mark_step();
    weights.requires_grad(); // once: the in-place update keeps the mark
    for step in 0..50 {
        let err = inputs.matmul(&weights) - &targets;
        let loss = (&err * &err).mean(&[], false);
        let grads = loss.backward()?;
        let g = grads.get(&weights).expect("weights is marked");
        no_grad(|| weights.sub_assign(&(g * 0.3)))?;
        lazy::mark_step();
        if step % 10 == 9 {
            writeln!(out, "step {:2}: loss {:.6}", step + 1, loss.item()?)?;
        }
    }
    writeln!(out, "learned {}", weights.reshape(&[4]))?;
    writeln!(out, "{:#?}", lazy::metrics())?;
    Ok(())
}
