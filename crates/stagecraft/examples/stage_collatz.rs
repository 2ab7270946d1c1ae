//! A Collatz step counter over `Tensor<i64>` written as plain Rust: the
//! `while` and the `if` on tensors become one `While` with one `If` in its
//! body, traced once and run for every start value. Also shows transfer
//! guards: implicit reads of device values are logged with their line,
//! explicit `.to_host()` copies are not.
//!
//! `cargo run --release -p stagecraft --example stage_collatz`

use stagecraft::{staged_graphs, transfer_guard, transfer_stats, Device, Tensor, TransferGuard};
use std::error::Error;
use std::io::Write;

#[stagecraft::stage]
fn collatz_steps(start: Tensor<i64>) -> Tensor<i64> {
    let one = Tensor::<i64>::scalar(1, &Device::cpu());
    let mut n = start;
    let mut steps = Tensor::<i64>::scalar(0, &Device::cpu());
    while n.gt(&one) {
        let half = &n / 2;
        if (&n - &(&half * 2)).eq(&Tensor::scalar(0, &Device::cpu())) {
            n = half;
        } else {
            n = &n * 3 + 1;
        }
        steps = steps + 1;
    }
    steps
}

/// Runs the example, printing to the standard output.
pub fn main() -> Result<(), Box<dyn Error>> {
    run(&mut std::io::stdout().lock())
}

/// The program, printing to `out` (`tests/examples.rs` runs it and checks
/// what it prints).
pub fn run(out: &mut dyn Write) -> Result<(), Box<dyn Error>> {
    let cpu = Device::cpu();
    for start in [6i64, 7, 27, 97, 871] {
        let steps = collatz_steps(Tensor::scalar(start, &cpu));
        // An explicit copy: allowed even where implicit ones are refused.
        let steps = transfer_guard(TransferGuard::Disallow, || steps.to_host().item())?;
        writeln!(out, "collatz({start}) takes {steps} steps")?;
    }
    writeln!(
        out,
        "--- the extracted graph (one trace for every start value) ---"
    )?;
    for text in staged_graphs("collatz_steps") {
        writeln!(out, "{text}")?;
    }
    // An implicit read, logged with its source line.
    let steps = transfer_guard(TransferGuard::Log, || {
        collatz_steps(Tensor::scalar(9, &cpu)).item()
    })?;
    writeln!(
        out,
        "collatz(9) takes {steps} steps; transfers so far: {:?}",
        transfer_stats()
    )?;
    Ok(())
}
