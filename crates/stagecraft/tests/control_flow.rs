//! Functional control flow and staged functions on the eager device:
//! results against plain Rust, nesting, errors with source lines,
//! cancellation.

use stagecraft::{cond, function, while_loop, Device, Tensor};
use std::sync::atomic::{AtomicUsize, Ordering};

fn f32s(values: &[f32]) -> Tensor<f32> {
    Tensor::from_vec(values.to_vec(), &[values.len()], &Device::cpu()).unwrap()
}

fn scalar(v: f32) -> Tensor<f32> {
    Tensor::scalar(v, &Device::cpu())
}

#[test]
fn cond_runs_the_taken_branch_with_captures() {
    let x = f32s(&[1.0, -2.0, 3.0]);
    let y = f32s(&[10.0, 20.0, 30.0]);
    for (threshold, expected) in [(0.0, vec![11.0, 18.0, 33.0]), (5.0, vec![-1.0, 2.0, -3.0])] {
        let pred = x.sum(&[0], false).gt(&scalar(threshold));
        let out = cond(&pred, || &x + &y, || -&x);
        assert_eq!(out.to_vec().unwrap(), expected, "threshold {threshold}");
    }
}

#[test]
fn cond_runs_only_the_taken_branch() {
    let cpu = Device::cpu();
    let n = Tensor::<i32>::from_vec(vec![6, 0], &[2], &cpu).unwrap();
    let ones = Tensor::<i32>::ones(&[2], &cpu);
    let take_safe = Tensor::<bool>::scalar(true, &cpu);
    // The else branch divides by zero; it must not run.
    let out = cond(&take_safe, || &ones * 2, || &ones / &n);
    assert_eq!(out.to_vec().unwrap(), vec![2, 2]);
    let take_bad = Tensor::<bool>::scalar(false, &cpu);
    let err = cond(&take_bad, || &ones * 2, || &ones / &n)
        .to_vec()
        .unwrap_err();
    assert!(err.to_string().contains("division by zero"), "{err}");
}

#[test]
fn cond_returns_tuples() {
    let x = f32s(&[1.0, 2.0]);
    let pred = Tensor::<bool>::scalar(false, &Device::cpu());
    let (a, b) = cond(&pred, || (x.clone(), &x * 2.0), || (&x * 3.0, &x + 1.0));
    assert_eq!(a.to_vec().unwrap(), vec![3.0, 6.0]);
    assert_eq!(b.to_vec().unwrap(), vec![2.0, 3.0]);
}

#[test]
fn mismatched_branches_name_both_types_and_the_line() {
    let x = f32s(&[1.0, 2.0, 3.0]);
    let pred = Tensor::<bool>::scalar(true, &Device::cpu());
    let line = line!() + 1;
    let out = cond(&pred, || x.clone(), || x.sum(&[0], true));
    let err = out.check().unwrap_err();
    let text = err.to_string();
    assert!(text.contains("f32[3]") && text.contains("f32[1]"), "{text}");
    assert_eq!(err.op(), Some("If"));
    assert_eq!(err.location().unwrap().line(), line, "{text}");
}

#[test]
fn shape_errors_inside_a_branch_point_into_the_branch() {
    let x = f32s(&[1.0, 2.0, 3.0]);
    let pred = Tensor::<bool>::scalar(true, &Device::cpu());
    let line = line!() + 1;
    let out = cond(&pred, || x.reshape(&[2, 2]), || x.reshape(&[2, 2]));
    let err = out.to_vec().unwrap_err();
    assert_eq!(err.op(), Some("Reshape"), "{err}");
    assert_eq!(err.location().unwrap().line(), line, "{err}");
}

/// The benchmark loop: `x = full(1000, 0.194); while sum(x) >= 1 { x *= 0.9 }`.
#[test]
fn while_loop_with_a_data_dependent_trip_count() {
    let cpu = Device::cpu();
    let x = Tensor::<f32>::full(&[1000], 0.194, &cpu);
    let one = scalar(1.0);
    let (out, count) = while_loop(
        (x, Tensor::<i64>::scalar(0, &cpu)),
        |(x, _)| x.sum(&[0], false).ge(&one),
        |(x, n)| (x * 0.9, n + 1),
    );
    // Plain Rust, same f32 arithmetic order per element.
    let mut v = vec![0.194f32; 1000];
    let mut steps = 0;
    while v.iter().map(|&e| e as f64).sum::<f64>() >= 1.0 {
        v.iter_mut().for_each(|e| *e *= 0.9);
        steps += 1;
    }
    assert_eq!(count.item().unwrap(), steps);
    assert_eq!(out.to_vec().unwrap(), v);
    assert!(steps > 40, "the loop ran {steps} times");
}

#[test]
fn nested_cond_inside_while_and_while_inside_cond() {
    let cpu = Device::cpu();
    // Collatz steps of 27 (111), with the branch as a staged cond.
    let start = Tensor::<i64>::scalar(27, &cpu);
    let two = Tensor::<i64>::scalar(2, &cpu);
    let (_, steps) = while_loop(
        (start, Tensor::<i64>::scalar(0, &cpu)),
        |(n, _)| n.gt(&Tensor::scalar(1, &cpu)),
        |(n, k)| {
            let even = (&n - &(&(&n / &two) * &two)).eq(&Tensor::scalar(0, &cpu));
            let next = cond(&even, || &n / &two, || &n * 3 + 1);
            (next, k + 1)
        },
    );
    assert_eq!(steps.item().unwrap(), 111);

    let x = f32s(&[8.0]);
    let pred = Tensor::<bool>::scalar(true, &cpu);
    let out = cond(
        &pred,
        || while_loop(x.clone(), |x| x.gt(&scalar(1.0)).reshape(&[]), |x| x * 0.5),
        || x.clone(),
    );
    assert_eq!(out.to_vec().unwrap(), vec![1.0]);
}

#[test]
fn runtime_errors_inside_a_loop_body_name_the_body_line() {
    let cpu = Device::cpu();
    let zero_at_three = Tensor::<i64>::scalar(3, &cpu);
    let line = line!() + 7;
    let out = while_loop(
        Tensor::<i64>::scalar(0, &cpu),
        |i| i.lt(&Tensor::scalar(10, &cpu)),
        |i| {
            // The quotient is discarded (times zero), but it must be computed.
            let zero = Tensor::<i64>::scalar(0, &cpu);
            &i + 1 + (Tensor::scalar(6, &cpu) / (&zero_at_three - &i)) * &zero
        },
    );
    let err = out.to_vec().unwrap_err();
    assert_eq!(err.op(), Some("Div"), "{err}");
    assert_eq!(err.location().unwrap().line(), line, "{err}");
}

#[test]
fn staged_functions_trace_once_per_signature() {
    static TRACES: AtomicUsize = AtomicUsize::new(0);
    let cpu = Device::cpu();
    let bias = f32s(&[0.5, -0.5]);
    let layer = function(|(x, w): (Tensor<f32>, Tensor<f32>)| {
        TRACES.fetch_add(1, Ordering::Relaxed);
        (x.matmul(&w) + &bias).tanh()
    });
    let w = Tensor::<f32>::from_vec(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[3, 2], &cpu).unwrap();
    for step in 0..3 {
        let x = Tensor::<f32>::full(&[4, 3], step as f32 * 0.1, &cpu);
        let eager = (x.matmul(&w) + &bias).tanh();
        let staged = layer.call((x, w.clone()));
        assert_eq!(staged.to_vec().unwrap(), eager.to_vec().unwrap());
    }
    assert_eq!(TRACES.load(Ordering::Relaxed), 1);
    let other = layer.call((Tensor::<f32>::ones(&[1, 3], &cpu), w.clone()));
    assert_eq!(other.dims(), &[1, 2]);
    assert_eq!(TRACES.load(Ordering::Relaxed), 2);
    let traced = layer
        .traced_function(&(Tensor::ones(&[1, 3], &cpu), w))
        .unwrap();
    let ops: Vec<&str> = traced.nodes.iter().map(|n| n.op.name()).collect();
    // The captured two-element bias is small and concrete: baked in.
    assert_eq!(ops, ["MatMul", "Const", "Add", "Tanh"]);
    assert_eq!(traced.params.len(), 2);
    // A large captured tensor becomes an extra parameter instead.
    let table = Tensor::<f32>::ones(&[64], &cpu);
    let lookup = function(|x: Tensor<f32>| &x + &table);
    let x = Tensor::<f32>::zeros(&[64], &cpu);
    assert_eq!(lookup.call(x.clone()).to_vec().unwrap(), vec![1.0; 64]);
    let traced = lookup.traced_function(&x).unwrap();
    assert_eq!(traced.params.len(), 2);
    assert_eq!(traced.nodes.len(), 1);
}

#[test]
fn control_flow_inside_functions_matches_eager() {
    let clip = function(|x: Tensor<f32>| {
        let big = x
            .abs()
            .max(&[0], false)
            .gt(&Tensor::scalar(1.0, &Device::cpu()));
        let y = cond(&big, || &x / x.abs().max(&[0], true), || x.clone());
        while_loop(
            y,
            |y| y.sum(&[0], false).lt(&Tensor::scalar(3.0, &Device::cpu())),
            |y| y + 1.0,
        )
    });
    for input in [vec![4.0f32, -2.0], vec![0.5, 0.25]] {
        let x = f32s(&input);
        let eager = {
            let big = x.abs().max(&[0], false).gt(&scalar(1.0));
            let y = cond(&big, || &x / x.abs().max(&[0], true), || x.clone());
            while_loop(y, |y| y.sum(&[0], false).lt(&scalar(3.0)), |y| y + 1.0)
        };
        assert_eq!(clip.call(x).to_vec().unwrap(), eager.to_vec().unwrap());
    }
}

#[test]
fn reading_a_value_while_tracing_is_an_error_not_a_hang() {
    let f = function(|x: Tensor<f32>| {
        let err = x.to_vec().unwrap_err();
        assert!(err.to_string().contains("symbolic"), "{err}");
        x * 2.0
    });
    assert_eq!(f.call(f32s(&[1.0])).to_vec().unwrap(), vec![2.0]);
}

#[test]
fn wide_functions_run_in_parallel_with_the_same_results() {
    let cpu = Device::cpu();
    let a = Tensor::<f32>::rand_uniform(&[256, 256], -1.0, 1.0, &mut stagecraft::Rng::new(3), &cpu);
    let b = Tensor::<f32>::rand_uniform(&[256, 256], -1.0, 1.0, &mut stagecraft::Rng::new(4), &cpu);
    let wide = |(a, b): (Tensor<f32>, Tensor<f32>)| {
        // Four independent large branches joined at the end.
        let p = a.matmul(&b).tanh();
        let q = b.matmul(&a).sigmoid();
        let r = (&a * 2.0).exp();
        let s = (&b - 1.0).abs().sqrt();
        (&p + &q) * (&r - &s)
    };
    let eager = wide((a.clone(), b.clone())).to_vec().unwrap();
    let staged = function(wide);
    for _ in 0..5 {
        assert_eq!(staged.call((a.clone(), b.clone())).to_vec().unwrap(), eager);
    }
}

#[test]
fn an_error_in_a_parallel_run_names_the_failing_node() {
    let cpu = Device::cpu();
    let n = 1 << 15;
    let f = function(|x: Tensor<i32>| {
        let big = &x * 3;
        let line = &x - &x; // all zeros
        let bad = &big / &line;
        (&big + 1) * 2 + bad
    });
    let x = Tensor::<i32>::ones(&[n], &cpu);
    let err = f.call(x).to_vec().unwrap_err();
    assert_eq!(err.op(), Some("Div"), "{err}");
    assert!(err.to_string().contains("division by zero"), "{err}");
}

type Recursive = stagecraft::StagedFunction<
    Tensor<f32>,
    Tensor<f32>,
    Box<dyn Fn(Tensor<f32>) -> Tensor<f32> + Send + Sync>,
>;

/// A staged function may call itself on smaller shapes while it is being
/// traced (each shape is its own signature) without deadlocking.
#[test]
fn staged_functions_can_recurse_on_smaller_shapes() {
    static HALVES: std::sync::OnceLock<Recursive> = std::sync::OnceLock::new();
    let f = HALVES.get_or_init(|| {
        function(Box::new(|x: Tensor<f32>| {
            let n = x.dims()[0];
            if n == 1 {
                return x.sum(&[0], false);
            }
            let me = HALVES.get().expect("initialized before the first call");
            me.call(x.narrow(0, 0, n / 2)) + me.call(x.narrow(0, n / 2, n - n / 2))
        }))
    });
    let x = f32s(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]);
    assert_eq!(f.call(x).item().unwrap(), 36.0);
}
