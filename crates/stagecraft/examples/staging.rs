//! Staged functions and functional control flow: `function`, `cond` and
//! `while_loop`, their graph text, and gradients through them.

use stagecraft::layers::graph::text;
use stagecraft::{cond, function, grad, while_loop, Device, Tensor};
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
    let one = Tensor::<f64>::scalar(1.0, &cpu);

    // Collatz steps of 27, with the branch staged as one If inside a While.
    let two = Tensor::<i64>::scalar(2, &cpu);
    let (_, steps) = while_loop(
        (
            Tensor::<i64>::scalar(27, &cpu),
            Tensor::<i64>::scalar(0, &cpu),
        ),
        |(n, _)| n.gt(&Tensor::scalar(1, &cpu)),
        |(n, k)| {
            let even = (&n - &(&(&n / &two) * &two)).eq(&Tensor::scalar(0, &cpu));
            (cond(&even, || &n / &two, || &n * 3 + 1), k + 1)
        },
    );
    writeln!(out, "Collatz steps of 27: {}", steps.item()?)?;

    // A staged function, traced once per input signature.
    let shrink = function(|x: Tensor<f64>| {
        while_loop(
            x,
            |x| x.sum(&[0], false).ge(&Tensor::scalar(1.0, &Device::cpu())),
            |x| x * 0.9,
        )
    });
    let x = Tensor::<f64>::full(&[1000], 0.194, &cpu);
    writeln!(
        out,
        "sum after the loop: {}",
        shrink.call(x.clone()).sum(&[0], false).item()?
    )?;
    if let Some(f) = shrink.traced_function(&x) {
        writeln!(out, "{}", text::print(&f))?;
    }

    // Gradients flow through cond and while_loop.
    let f = |x: &Tensor<f64>| {
        let big = x.sum(&[0], false).gt(&one);
        let y = cond(&big, || x.tanh(), || x * x);
        while_loop(
            y,
            |y| y.sum(&[0], false).lt(&Tensor::scalar(5.0, &Device::cpu())),
            |y| y * 1.5,
        )
        .sum(&[0], false)
    };
    let x = Tensor::<f64>::from_vec(vec![0.3, 0.4], &[2], &cpu)?;
    writeln!(out, "f(x) = {}, grad = {}", f(&x).item()?, grad(f)(&x))?;
    Ok(())
}
