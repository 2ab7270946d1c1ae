//! `function`: a closure staged into a graph function, traced once per
//! input signature and then called as one `Call` op; its graph text before
//! the runtime's passes.

use stagecraft::layers::graph::text;
use stagecraft::{function, Device, Rng, Tensor};
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
    let mut rng = Rng::new(0);
    // One dense layer with a tanh; the bias is captured from outside.
    let bias = Tensor::<f32>::full(&[4], 0.1, &cpu);
    let layer = function(move |(x, w): (Tensor<f32>, Tensor<f32>)| (x.matmul(&w) + &bias).tanh());

    let w = Tensor::<f32>::rand_normal(&[3, 4], 0.0, 0.5, &mut rng, &cpu);
    let x = Tensor::<f32>::rand_uniform(&[2, 3], -1.0, 1.0, &mut rng, &cpu);
    let y = layer.call((x.clone(), w.clone()));
    writeln!(out, "layer(x, w) =\n{y}")?;
    // A second call with the same shapes reuses the traced function.
    let y2 = layer.call((&x * 2.0, w.clone()));
    writeln!(out, "layer(2x, w) =\n{y2}")?;
    if let Some(f) = layer.traced_function(&(x, w)) {
        writeln!(out, "the traced function:\n{}", text::print(&f))?;
    }
    Ok(())
}
