//! Runs every program in `examples/` as part of the test suite and checks
//! the values it prints, so an example that fails, panics or starts
//! printing wrong numbers fails CI. Each example file is compiled here as a
//! module whose `pub fn run` writes what `main` would print into a buffer.
//! (`main` itself only hands `run` the standard output, so it goes unused
//! here: hence the `dead_code` allowance on each module.)

#[path = "../examples/control_flow.rs"]
#[allow(dead_code)]
mod control_flow;
#[path = "../examples/eager.rs"]
#[allow(dead_code)]
mod eager;
#[path = "../examples/function.rs"]
#[allow(dead_code)]
mod function;
#[path = "../examples/grad.rs"]
#[allow(dead_code)]
mod grad;
#[path = "../examples/lazy.rs"]
#[allow(dead_code)]
mod lazy;
#[path = "../examples/stage_collatz.rs"]
#[allow(dead_code)]
mod stage_collatz;
#[path = "../examples/stage_seed.rs"]
#[allow(dead_code)]
mod stage_seed;
#[path = "../examples/staging.rs"]
#[allow(dead_code)]
mod staging;

use stagecraft::{Device, Rng, Tensor};
use std::error::Error;
use std::io::Write;

type Example = fn(&mut dyn Write) -> Result<(), Box<dyn Error>>;

/// Everything `example` prints.
fn output_of(example: Example) -> String {
    let mut out = Vec::new();
    if let Err(e) = example(&mut out) {
        panic!(
            "the example failed: {e}\nafter printing:\n{}",
            String::from_utf8_lossy(&out)
        );
    }
    String::from_utf8(out).expect("examples print text")
}

/// The text after the first `label` in `out`, to the end.
fn after<'a>(out: &'a str, label: &str) -> &'a str {
    match out.split_once(label) {
        Some((_, rest)) => rest,
        None => panic!("`{label}` is not in the output:\n{out}"),
    }
}

/// The first `n` numbers in `text`, skipping brackets, punctuation and
/// words, so that `[10.0, 11.0]` and `10, 11` read the same.
fn numbers(text: &str, n: usize) -> Vec<f64> {
    let found: Vec<f64> = text
        .split(|c: char| c.is_whitespace() || "[](),:=;".contains(c))
        .filter_map(|token| token.parse::<f64>().ok())
        .take(n)
        .collect();
    assert_eq!(found.len(), n, "{n} numbers expected in:\n{text}");
    found
}

#[track_caller]
fn assert_close(got: &[f64], want: &[f64], tolerance: f64) {
    assert_eq!(got.len(), want.len(), "{got:?} vs {want:?}");
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() <= tolerance, "{got:?} vs {want:?}");
    }
}

/// The 1-based line of `example_source` holding `code`.
fn line_of(example_source: &str, code: &str) -> usize {
    example_source
        .lines()
        .position(|l| l.contains(code))
        .unwrap_or_else(|| panic!("`{code}` is not in the example"))
        + 1
}

#[test]
fn eager_example_prints_its_values_and_the_error_line() {
    let out = output_of(eager::run);
    assert_eq!(
        numbers(after(&out, "relu(2x + 1) =\n"), 6),
        [3.0, 0.0, 7.0, 0.0, 11.0, 0.0]
    );
    assert_eq!(numbers(after(&out, "row sums = "), 2), [10.0, 11.0]);
    let probs = numbers(after(&out, "softmax(tanh(x @ w)) =\n"), 8);
    let argmax = numbers(after(&out, "argmax = "), 2);
    for (row, chosen) in probs.chunks(4).zip(&argmax) {
        assert!((row.iter().sum::<f64>() - 1.0).abs() < 1e-6, "{row:?}");
        let best = (0..4)
            .max_by(|&i, &j| row[i].total_cmp(&row[j]))
            .expect("four columns");
        assert_eq!(*chosen, best as f64, "{row:?}");
    }
    let line = line_of(include_str!("../examples/eager.rs"), "x.matmul(&x)");
    let error = after(&out, "as expected: ");
    assert!(error.starts_with("MatMul at "), "{error}");
    assert!(
        error.contains(&format!("examples/eager.rs:{line}:")),
        "{error}"
    );
    assert!(error.contains("[2,3] @ [2,3]"), "{error}");
}

#[test]
fn lazy_example_computes_z_and_learns_the_weights() {
    let out = output_of(lazy::run);
    assert!(out.contains("z has shape [] before anything ran"), "{out}");
    assert!(after(&out, "after dropping w, x, y:\n").starts_with("lazyTrace_"));
    assert_eq!(numbers(after(&out, "\nz = "), 1), [60.0]);
    let losses: Vec<f64> = (1..=5)
        .map(|k| numbers(after(&out, &format!("step {:2}: loss ", k * 10)), 1)[0])
        .collect();
    assert!(losses.windows(2).all(|w| w[1] < w[0]), "{losses:?}");
    assert!(losses[4] < 1e-3, "{losses:?}");
    assert_close(
        &numbers(after(&out, "learned "), 4),
        &[1.0, -2.0, 0.5, 3.0],
        0.05,
    );
    assert!(out.contains("traces_compiled"), "{out}");
}

#[test]
fn function_example_prints_what_eager_ops_compute() {
    let out = output_of(function::run);
    // The same draws and the same layer, op by op.
    let cpu = Device::cpu();
    let mut rng = Rng::new(0);
    let w = Tensor::<f32>::rand_normal(&[3, 4], 0.0, 0.5, &mut rng, &cpu);
    let x = Tensor::<f32>::rand_uniform(&[2, 3], -1.0, 1.0, &mut rng, &cpu);
    let layer = |x: &Tensor<f32>| (x.matmul(&w) + 0.1).tanh();
    let expected = |x: &Tensor<f32>| -> Vec<f64> {
        let values = layer(x).to_vec().expect("the eager layer runs");
        values.into_iter().map(f64::from).collect()
    };
    assert_close(
        &numbers(after(&out, "layer(x, w) =\n"), 8),
        &expected(&x),
        1e-6,
    );
    assert_close(
        &numbers(after(&out, "layer(2x, w) =\n"), 8),
        &expected(&(&x * 2.0)),
        1e-6,
    );
    let graph = after(&out, "the traced function:\n");
    for op in ["MatMul", "Add", "Tanh"] {
        assert!(graph.contains(op), "{graph}");
    }
}

#[test]
fn control_flow_example_takes_the_branch_and_counts_the_halvings() {
    let out = output_of(control_flow::run);
    assert_eq!(numbers(after(&out, "|sum(x)| = "), 1), [1.0]);
    // |x|² = 6.5 drops by 4 per halving: 1.625, 0.406, 0.102, 0.025, 0.006.
    assert_eq!(
        numbers(after(&out, "after "), 4),
        [5.0, 0.015625, -0.046875, 0.0625]
    );
}

#[test]
fn grad_example_prints_the_derivatives() {
    let out = output_of(grad::run);
    // w = 0: p = 1/2, the loss is ln 2 and its gradient Xᵀ(p - y) / 2.
    assert_close(
        &numbers(after(&out, "loss "), 1),
        &[std::f64::consts::LN_2],
        1e-12,
    );
    assert_close(
        &numbers(after(&out, "its gradient "), 2),
        &[-0.5, -0.375],
        1e-12,
    );
    assert_close(
        &numbers(after(&out, "after one step w = "), 2),
        &[0.25, 0.1875],
        1e-12,
    );
    // f(x) = sum(x³) at [0.5, -1]: -0.875, f' = 3x², f'' = 6x.
    assert_eq!(numbers(after(&out, "f = "), 1), [-0.875]);
    assert_eq!(numbers(after(&out, "f' = "), 2), [0.75, 3.0]);
    assert_eq!(numbers(after(&out, "f'' = "), 2), [3.0, -6.0]);
}

#[test]
fn staging_example_counts_shrinks_and_differentiates() {
    let out = output_of(staging::run);
    assert_eq!(numbers(after(&out, "Collatz steps of 27: "), 1), [111.0]);
    // 194 · 0.9⁵⁰ ≈ 0.9998: the loop stops at the first sum under 1.
    let sum = numbers(after(&out, "sum after the loop: "), 1)[0];
    assert!(sum < 1.0 && sum / 0.9 >= 1.0, "{sum}");
    assert!(after(&out, "sum after the loop: ").contains("While"));
    // x = [0.3, 0.4]: sum(x) ≤ 1, so y = x², then ×1.5 eight times until
    // its sum reaches 5: f = 0.25 · 1.5⁸ and ∇f = 2x · 1.5⁸.
    let grown = 1.5f64.powi(8);
    assert_close(
        &numbers(after(&out, "f(x) = "), 3),
        &[0.25 * grown, 0.6 * grown, 0.8 * grown],
        1e-9,
    );
}

#[test]
fn stage_collatz_example_counts_steps_in_one_staged_loop() {
    let out = output_of(stage_collatz::run);
    for (start, steps) in [(6, 8), (7, 16), (27, 111), (97, 118), (871, 178), (9, 19)] {
        let said = after(&out, &format!("collatz({start}) takes "));
        assert_eq!(numbers(said, 1), [f64::from(steps)], "collatz({start})");
    }
    let graph = after(&out, "one trace for every start value");
    assert!(graph.contains("While") && graph.contains("If"), "{graph}");
}

#[test]
fn stage_seed_example_runs_the_three_seed_programs() {
    let out = output_of(stage_seed::run);
    // a·b = [3, -8] sums below zero: the `else` branch subtracts d.
    assert_eq!(numbers(after(&out, "conditional_code = "), 2), [2.0, -9.0]);
    // Three steps of the host simulator, computed here in f64.
    let mut values = [0.1f64, 0.2, 0.3];
    for _ in 0..3 {
        values = values.map(|v| {
            let x = v.tanh();
            (x * 3.0).sin() + x * 0.5
        });
    }
    assert_close(
        &numbers(after(&out, "host_and_graph_communication = "), 3),
        &values,
        1e-5,
    );
    // The key is "pressed" at the fourth poll: three iterations ran.
    let result = (0..3).fold(0.1f64, |r, _| (r * 1.5).tanh());
    assert_close(
        &numbers(after(&out, "count_until_key_pressed: "), 2),
        &[3.0, result],
        1e-6,
    );
    for (name, op) in [
        ("conditional_code", "If"),
        ("host_and_graph_communication", "HostCall"),
        ("count_until_key_pressed", "While"),
    ] {
        let graphs = after(&out, &format!("graphs extracted from `{name}`"));
        assert!(graphs.contains(op), "{name}: {graphs}");
    }
}
