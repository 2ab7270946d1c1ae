//! The three programs of the graph-program-extraction seed, written as
//! plain Rust under `#[stage]`, run, and printed as the graphs extracted
//! from them:
//!
//! - `conditional_code`: mutation and an `if` on a tensor become one `If`;
//! - `host_and_graph_communication`: a simulator on the host inside a
//!   staged training loop (`HostCall` on the host device, joined to the
//!   graph by Send/Recv);
//! - `count_until_key_pressed`: a host predicate decides when a staged
//!   loop stops (`break` lowered to loop state).
//!
//! `cargo run --release -p stagecraft --example stage_seed`

use stagecraft::{host_call, host_call_with, staged_graphs, Device, Tensor};
use std::error::Error;
use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};

fn cpu() -> Device {
    Device::cpu()
}

#[stagecraft::stage]
fn conditional_code(a: Tensor<f32>, b: Tensor<f32>, c: Tensor<f32>, d: Tensor<f32>) -> Tensor<f32> {
    let mut result = &a * &b;
    if result.sum(&[0], false).gt(&Tensor::scalar(0.0, &cpu())) {
        result = &result + &c;
    } else {
        result = &result - &d;
    }
    result
}

/// Stands in for the Atari simulator: host code, any Rust at all.
fn atari_game_simulator(observation: Vec<f32>) -> Vec<f32> {
    observation.iter().map(|o| (o * 3.0).sin()).collect()
}

#[stagecraft::stage]
fn host_and_graph_communication(values: Tensor<f32>, steps: usize) -> Tensor<f32> {
    let mut values = values;
    // A host range: unrolled into the graph, one HostCall per step.
    for _ in 0..steps {
        let x = values.tanh();
        let result = host_call(&x, atari_game_simulator);
        let y = &x * 0.5;
        values = &result + &y;
    }
    values
}

static POLLS: AtomicUsize = AtomicUsize::new(0);

/// Stands in for "was a key pressed?": true from the fourth poll on.
fn key_pressed(_: Vec<i64>) -> Vec<bool> {
    vec![POLLS.fetch_add(1, Ordering::SeqCst) >= 3]
}

#[stagecraft::stage]
fn count_until_key_pressed(start: Tensor<f32>) -> (Tensor<f32>, Tensor<i64>) {
    let mut result = start;
    let mut count = Tensor::<i64>::scalar(0, &cpu());
    while Tensor::scalar(true, &cpu()) {
        let stop = host_call_with(&count, &[], key_pressed);
        if stop {
            break;
        }
        result = (&result * 1.5).tanh();
        count = count + 1;
    }
    (result, count)
}

fn show(out: &mut dyn Write, name: &str) -> std::io::Result<()> {
    writeln!(out, "--- graphs extracted from `{name}` ---")?;
    for text in staged_graphs(name) {
        writeln!(out, "{text}")?;
    }
    Ok(())
}

/// Runs the example, printing to the standard output.
pub fn main() -> Result<(), Box<dyn Error>> {
    run(&mut std::io::stdout().lock())
}

/// The program, printing to `out` (`tests/examples.rs` runs it and checks
/// what it prints).
pub fn run(out: &mut dyn Write) -> Result<(), Box<dyn Error>> {
    let v = |values: &[f32]| Tensor::from_vec(values.to_vec(), &[values.len()], &cpu());
    let (a, b, c, d) = (
        v(&[1.0, 2.0])?,
        v(&[3.0, -4.0])?,
        v(&[10.0, 10.0])?,
        v(&[1.0, 1.0])?,
    );
    writeln!(out, "conditional_code = {}", conditional_code(a, b, c, d))?;
    show(out, "conditional_code")?;

    let trained = host_and_graph_communication(v(&[0.1, 0.2, 0.3])?, 3);
    writeln!(out, "host_and_graph_communication = {trained}")?;
    show(out, "host_and_graph_communication")?;

    let (result, count) = count_until_key_pressed(v(&[0.1])?);
    writeln!(
        out,
        "count_until_key_pressed: {count} steps, result {result}"
    )?;
    show(out, "count_until_key_pressed")?;
    Ok(())
}
