//! `cond` and `while_loop`: host-free control flow. Each traces its
//! closures into graph functions and emits one `If` / `While` op, so only
//! the taken branch runs and the loop never returns to the host.

use stagecraft::{cond, while_loop, Device, Tensor};
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
    let x = Tensor::<f32>::from_vec(vec![0.5, -1.5, 2.0], &[3], &cpu)?;

    // |x| summed, by branching on the sign of the sum.
    let total = x.sum(&[0], false);
    let positive = total.gt(&Tensor::scalar(0.0, &cpu));
    let magnitude = cond(&positive, || total.clone(), || -&total);
    writeln!(out, "|sum(x)| = {}", magnitude.item()?)?;

    // Halve x until its squared norm drops below 0.01, counting the steps.
    let (small, halvings) = while_loop(
        (x.clone(), Tensor::<i64>::scalar(0, &cpu)),
        |(v, _)| (v * v).sum(&[0], false).ge(&Tensor::scalar(0.01, &cpu)),
        |(v, n)| (v * 0.5, n + 1),
    );
    writeln!(out, "after {} halvings: {small}", halvings.item()?)?;
    Ok(())
}
