//! The lazy device: recording, live outputs, the trace cache with constant
//! promotion, diagnostics and agreement with eager execution.
//!
//! Tests here share the process-wide lazy metrics, so each one measures
//! differences of its own counters under a lock.

use stagecraft::layers::graph::NodeOp;
use stagecraft::{cond, lazy, while_loop, Device, Rng, Tensor};
use std::sync::Mutex;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn dev() -> Device {
    Device::lazy(&Device::cpu())
}

/// The seed's example: w = a + b; x = w - c; y = x + x + w; z = y + y.
#[test]
fn seed_program_traces_with_live_outputs() {
    let _g = serial();
    let d = dev();
    let a = Tensor::<f32>::scalar(10.0, &d);
    let b = Tensor::<f32>::scalar(2.0, &d);
    let c = Tensor::<f32>::scalar(3.0, &d);
    let w = &a + &b;
    let x = &w - &c;
    let y = &(&x + &x) + &w;
    let z = &y + &y;
    let text = lazy::trace_text(&z).unwrap();
    assert!(text.starts_with("lazyTrace_"), "{text}");
    let ops: Vec<&str> = text
        .lines()
        .filter_map(|l| l.split(" = ").nth(1))
        .map(|rhs| rhs.split(['[', '(']).next().unwrap())
        .collect();
    // Constants come first (leaves of the trace), then the ops in DFS order.
    assert_eq!(
        ops,
        ["Const", "Const", "Const", "Add", "Sub", "Add", "Add", "Add"],
        "{text}"
    );
    // w, x and y are alive, so they are outputs too; x + x is not.
    let last = text.lines().last().unwrap();
    assert_eq!(last.matches('%').count(), 4, "{text}");
    assert!(last.contains("live: %"), "{text}");
    drop((w, x, y));
    let text = lazy::trace_text(&z).unwrap();
    assert!(
        text.lines().last().unwrap().ends_with("live: none"),
        "{text}"
    );
    lazy::reset_metrics();
    assert_eq!(z.item().unwrap(), 60.0);
    let m = lazy::metrics();
    assert_eq!(m.materializations, 1);
    assert_eq!(m.by_value_read, 1);
    assert_eq!(m.bytes_to_host, 4);
}

#[test]
fn metadata_is_known_and_errors_point_at_the_recording_line() {
    let _g = serial();
    let d = dev();
    let before = lazy::metrics().materializations;
    let x = Tensor::<f32>::ones(&[2, 3], &d);
    let y = x.matmul(&x.transpose(0, 1)).relu();
    assert_eq!(y.dims(), &[2, 2]);
    let line = line!() + 1;
    let bad = y.matmul(&x.reshape(&[3, 2]));
    let err = bad.check().unwrap_err();
    assert_eq!(err.op(), Some("MatMul"));
    assert_eq!(err.location().unwrap().line(), line);
    assert_eq!(lazy::metrics().materializations, before, "nothing ran");
    assert_eq!(y.to_vec().unwrap(), vec![3.0; 4]);
}

/// The seed's `sum = sum + Float(i)` loop: at most two compiles, then hits.
#[test]
fn summation_loop_compiles_at_most_twice() {
    let _g = serial();
    let d = dev();
    lazy::reset_metrics();
    let mut sum = Tensor::<f32>::scalar(0.0, &d);
    let mut expected = 0.0f32;
    for i in 1..=10 {
        sum = sum + Tensor::scalar(i as f32, &d);
        expected += i as f32;
        assert_eq!(sum.item().unwrap(), expected);
    }
    let m = lazy::metrics();
    assert!(m.traces_compiled <= 2, "{m:?}");
    assert_eq!(m.materializations, 10);
    assert_eq!(m.cache_hits, 10 - m.traces_compiled);
    assert!(m.last_miss_reason.is_some());
}

fn mlp_step(
    w1: &Tensor<f32>,
    w2: &Tensor<f32>,
    x: &Tensor<f32>,
    labels: &Tensor<f32>,
    lr: f32,
) -> (Tensor<f32>, Tensor<f32>, Tensor<f32>) {
    let h = x.matmul(w1).relu();
    let logits = h.matmul(w2);
    let loss = -(logits.log_softmax(-1) * labels)
        .sum(&[-1], false)
        .mean(&[0], false);
    // A hand-derived gradient of the last layer; the first layer decays.
    let probs = logits.softmax(-1);
    let grad_w2 = h.transpose(0, 1).matmul(&(probs - labels)) * (1.0 / x.dims()[0] as f32);
    let w2 = w2 - &(grad_w2 * lr);
    let w1 = w1 * (1.0 - lr * 0.01);
    (w1, w2, loss)
}

/// A training loop: every step is one trace, and every step after the
/// first hits the cache; the values equal eager execution bit for bit.
#[test]
fn training_steps_are_one_cached_trace_and_match_eager() {
    let _g = serial();
    let run = |device: &Device, steps: usize| {
        let mut rng = Rng::new(5);
        let mut w1 = Tensor::<f32>::rand_normal(&[16, 32], 0.0, 0.3, &mut rng, device);
        let mut w2 = Tensor::<f32>::rand_normal(&[32, 4], 0.0, 0.3, &mut rng, device);
        lazy::mark_step();
        let mut losses = Vec::new();
        let mut compiled = Vec::new();
        for step in 0..steps {
            // Host data each step (a batch): a trace argument, not a constant.
            let batch: Vec<f32> = (0..128)
                .map(|i| (((i * 37 + step * 11) % 17) as f32 - 8.0) / 8.0)
                .collect();
            let x = Tensor::<f32>::from_vec(batch, &[8, 16], device).unwrap();
            let labels = Tensor::<f32>::from_vec(
                (0..32)
                    .map(|i| if i % 4 == step % 4 { 1.0 } else { 0.0 })
                    .collect(),
                &[8, 4],
                device,
            )
            .unwrap();
            let (a, b, loss) = mlp_step(&w1, &w2, &x, &labels, 0.1);
            w1 = a;
            w2 = b;
            lazy::mark_step();
            losses.push(loss);
            compiled.push(lazy::metrics().traces_compiled);
        }
        let losses: Vec<f32> = losses.iter().map(|l| l.item().unwrap()).collect();
        (losses, w2.to_vec().unwrap(), compiled)
    };
    let (eager_losses, eager_w2, _) = run(&Device::cpu(), 6);
    lazy::reset_metrics();
    let (lazy_losses, lazy_w2, compiled) = run(&dev(), 6);
    assert_eq!(lazy_losses, eager_losses);
    assert_eq!(lazy_w2, eager_w2);
    assert!(
        compiled[1..].iter().all(|&c| c == compiled[0]),
        "recompiled: {compiled:?}"
    );
    let m = lazy::metrics();
    assert!(m.cache_hits >= 5, "{m:?}");
    assert!(m.by_mark_step >= 6, "{m:?}");
}

#[test]
fn errors_inside_a_trace_name_the_failing_op_line() {
    let _g = serial();
    let d = dev();
    let n = Tensor::<i32>::from_vec(vec![1, 0, 2], &[3], &d).unwrap();
    let ones = Tensor::<i32>::ones(&[3], &d);
    let line = line!() + 1;
    let q = &ones / &n;
    let r = q * 2;
    let err = r.to_vec().unwrap_err();
    assert_eq!(err.op(), Some("Div"), "{err}");
    assert_eq!(err.location().unwrap().line(), line, "{err}");
}

/// Two threads record lazy work at once; one thread's step divides by
/// zero. Each thread's `mark_step` runs its own pending tensors (and what
/// they read), so the failure stays in the thread whose code failed: the
/// other thread's independent step succeeds, and the failing thread's error
/// names its own line. (When every thread's live tensors went into one
/// trace, the healthy thread got the other's `Div` error.)
#[test]
fn a_failing_step_on_one_thread_does_not_fail_another_threads_step() {
    let _g = serial();
    let recorded = std::sync::Barrier::new(2);
    let failed = std::sync::Barrier::new(2);
    std::thread::scope(|s| {
        let bad = s.spawn(|| {
            let d = dev();
            let zeros = Tensor::<i32>::zeros(&[4], &d);
            let ones = Tensor::<i32>::ones(&[4], &d);
            let line = line!() + 1;
            let q = &ones / &zeros;
            recorded.wait();
            lazy::mark_step();
            let err = q.to_vec().unwrap_err();
            failed.wait();
            (err, line)
        });
        let good = s.spawn(|| {
            let d = dev();
            let x = Tensor::<i32>::from_vec(vec![1, 2, 3, 4], &[4], &d).unwrap();
            let y = &x * 3 + 1;
            // Both threads' tensors are pending and live now.
            recorded.wait();
            failed.wait();
            lazy::mark_step();
            y.to_vec()
        });
        let (err, line) = bad.join().unwrap();
        assert_eq!(err.op(), Some("Div"), "{err}");
        assert_eq!(err.location().unwrap().line(), line, "{err}");
        assert_eq!(good.join().unwrap().unwrap(), vec![4, 7, 10, 13]);
    });
}

/// `a / b + 1`, recorded at the caller's line (the ops inside a
/// `#[track_caller]` function take its caller's location).
#[track_caller]
fn ratio_plus_one(a: &Tensor<i32>, b: &Tensor<i32>) -> Tensor<i32> {
    &(a / b) + 1
}

/// 32 integers (more than the runtime bakes into a trace, so the values
/// are trace arguments and recordings that differ only in them share one
/// compiled trace), all `fill` except a zero at `zero_at`, if given.
fn divisors(fill: i32, zero_at: Option<usize>, d: &Device) -> Tensor<i32> {
    let mut values = vec![fill; 32];
    if let Some(i) = zero_at {
        values[i] = 0;
    }
    Tensor::from_vec(values, &[32], d).unwrap()
}

/// The text an error naming `op` at `line` of this file starts with.
fn names(op: &str, line: u32) -> String {
    format!("{op} at {}:{line}:", file!())
}

/// A kernel error (integer division by zero) in a trace served from the
/// cache names the line of the current recording, not the line of the
/// recording the trace was compiled for.
#[test]
fn cached_trace_errors_name_the_current_callers_line() {
    let _g = serial();
    let d = dev();
    let ones = Tensor::<i32>::ones(&[32], &d);
    let first = line!() + 1;
    let r = ratio_plus_one(&ones, &divisors(3, Some(7), &d));
    let err = r.to_vec().unwrap_err();
    assert!(err.to_string().starts_with(&names("Div", first)), "{err}");

    let hits = lazy::metrics().cache_hits;
    let ones = Tensor::<i32>::ones(&[32], &d);
    let second = line!() + 1;
    let r = ratio_plus_one(&ones, &divisors(5, Some(20), &d));
    let err = r.to_vec().unwrap_err();
    assert_eq!(lazy::metrics().cache_hits, hits + 1, "the trace was cached");
    assert_eq!(err.op(), Some("Div"), "{err}");
    assert_eq!(err.location().unwrap().line(), second, "{err}");
    assert!(err.to_string().starts_with(&names("Div", second)), "{err}");

    // The cached trace still computes when nothing fails.
    let r = ratio_plus_one(&ones, &divisors(1, None, &d));
    assert_eq!(r.to_vec().unwrap(), vec![2; 32]);
}

/// An integer division whose op is recorded where the closure is written.
type Division = dyn Fn(&Tensor<i32>, &Tensor<i32>) -> Tensor<i32>;

/// One recording of a trace with the same op at several lines: `ones / b`
/// by `first`, its quotient divided by `c` by `second`, and `ones / b`
/// again by `third` (CSE merges it into the first), with float work around
/// them that fusion turns into one kernel, so the compiled nodes are not
/// the recorded ones one for one.
fn divisions(
    b: &Tensor<i32>,
    c: &Tensor<i32>,
    first: &Division,
    second: &Division,
    third: &Division,
) -> Tensor<f32> {
    let d = b.device();
    let ones = Tensor::<i32>::ones(&[32], &d);
    let x = Tensor::<f32>::from_vec((0..32).map(|i| i as f32 / 32.0).collect(), &[32], &d).unwrap();
    let warm = (x.exp() + 1.0).sqrt();
    let q1 = first(&ones, b);
    let q2 = second(&q1, c);
    let again = third(&ones, b);
    ((warm * q2.cast::<f32>()) - again.cast::<f32>()).tanh() * 2.0
}

/// The same op at several lines of one trace: whichever fails is named at
/// its line in the current recording, also when fusion and CSE rewrote
/// the nodes around it and the trace came from the cache.
#[test]
fn cached_trace_errors_name_the_failing_entry_among_repeated_ops() {
    let _g = serial();
    let d = dev();
    // Compiled for a recording whose second division fails.
    let a1 = line!() + 1;
    let div1: &Division = &|a, b| a / b;
    let a2 = line!() + 1;
    let div2: &Division = &|a, b| a / b;
    let div3: &Division = &|a, b| a / b;
    let y = divisions(
        &divisors(2, None, &d),
        &divisors(2, Some(3), &d),
        div1,
        div2,
        div3,
    );
    let step = lazy::step_trace().unwrap();
    let count = |f: &stagecraft::layers::graph::Function, name: &str| {
        f.nodes
            .iter()
            .filter(|n| matches!(&n.op, NodeOp::Op(def, _) if def.name == name))
            .count()
    };
    assert_eq!(count(&step.recorded, "Div"), 3);
    assert_eq!(count(&step.optimized, "Div"), 2, "CSE merged a division");
    assert!(count(&step.optimized, "FusedElementwise") > 0, "fused");
    let err = y.to_vec().unwrap_err();
    assert!(err.to_string().starts_with(&names("Div", a2)), "{err}");
    assert!(a1 != a2);

    // Run from the cache for a recording from other lines whose first
    // division fails: its own first line, not the merged copy's, and not
    // the compiling recording's.
    let hits = lazy::metrics().cache_hits;
    let b1 = line!() + 1;
    let div1: &Division = &|a, b| a / b;
    let div2: &Division = &|a, b| a / b;
    let div3: &Division = &|a, b| a / b;
    let y = divisions(
        &divisors(2, Some(9), &d),
        &divisors(2, None, &d),
        div1,
        div2,
        div3,
    );
    let err = y.to_vec().unwrap_err();
    assert_eq!(lazy::metrics().cache_hits, hits + 1, "the trace was cached");
    assert!(err.to_string().starts_with(&names("Div", b1)), "{err}");

    // And for one whose second division fails, after a successful run.
    let y = divisions(
        &divisors(2, None, &d),
        &divisors(1, None, &d),
        div1,
        div2,
        div3,
    );
    assert_eq!(y.to_vec().unwrap().len(), 32);
    let div1: &Division = &|a, b| a / b;
    let c2 = line!() + 1;
    let div2: &Division = &|a, b| a / b;
    let div3: &Division = &|a, b| a / b;
    let y = divisions(
        &divisors(4, None, &d),
        &divisors(2, Some(31), &d),
        div1,
        div2,
        div3,
    );
    let err = y.to_vec().unwrap_err();
    assert_eq!(lazy::metrics().cache_hits, hits + 3, "the trace was cached");
    assert!(err.to_string().starts_with(&names("Div", c2)), "{err}");
}

#[test]
fn control_flow_is_recorded_not_unrolled() {
    let _g = serial();
    let run = |d: &Device| {
        let x = Tensor::<f32>::full(&[100], 0.5, d);
        let big = x.sum(&[0], false).gt(&Tensor::scalar(10.0, d));
        let y = cond(&big, || &x * 2.0, || x.clone());
        let z = while_loop(
            y,
            |y| y.sum(&[0], false).lt(&Tensor::scalar(1000.0, d)),
            |y| y * 1.5,
        );
        (z.clone(), z)
    };
    let (eager, _) = run(&Device::cpu());
    let (lazy_z, z2) = run(&dev());
    let text = lazy::trace_text(&z2).unwrap();
    assert!(text.contains("If[") && text.contains("While["), "{text}");
    assert_eq!(lazy_z.to_vec().unwrap(), eager.to_vec().unwrap());
}

#[test]
fn the_trace_limit_bounds_pending_work() {
    let _g = serial();
    let d = dev();
    lazy::reset_metrics();
    lazy::set_trace_limit(64);
    let mut x = Tensor::<f32>::ones(&[4], &d);
    for _ in 0..500 {
        x = x * 1.001;
    }
    lazy::set_trace_limit(10_000);
    let m = lazy::metrics();
    assert!(m.by_trace_limit >= 6, "{m:?}");
    let expected = (0..500).fold(1.0f32, |v, _| v * 1.001);
    assert_eq!(x.to_vec().unwrap(), vec![expected; 4]);
}

#[test]
fn dot_form_has_every_op() {
    let _g = serial();
    let d = dev();
    let x = Tensor::<f32>::ones(&[3], &d);
    let y = (x.exp() + 1.0).log();
    let dot = lazy::trace_dot(&y).unwrap();
    assert!(
        dot.starts_with("digraph") && dot.contains("Exp") && dot.contains("Log"),
        "{dot}"
    );
}

/// A side-effecting op recorded on the lazy device (or in a traced branch)
/// runs inside its trace; it must not hold up eager side effects.
#[test]
fn lazy_side_effects_do_not_block_eager_ones() {
    let _g = serial();
    let x = Tensor::<f32>::ones(&[2], &dev()).print("lazy");
    let p = Tensor::<bool>::scalar(true, &Device::cpu());
    let c = cond(
        &p,
        || Tensor::<f32>::ones(&[2], &Device::cpu()).print("traced"),
        || Tensor::zeros(&[2], &Device::cpu()),
    );
    let y = Tensor::<f32>::ones(&[2], &Device::cpu()).print("eager");
    assert_eq!(y.to_vec().unwrap(), vec![1.0, 1.0]);
    assert_eq!(c.to_vec().unwrap(), vec![1.0, 1.0]);
    assert_eq!(x.to_vec().unwrap(), vec![1.0, 1.0]);
}

/// A cached step's collection, key hashing and cache lookup are timed
/// apart from its kernels, each within the step's own time, and a reset
/// zeroes them.
#[test]
fn a_cached_steps_phases_are_timed_apart() {
    let _g = serial();
    let d = dev();
    let a = Tensor::<f32>::ones(&[4], &d);
    let step = || {
        let mut t = a.clone();
        for _ in 0..200 {
            t = &t + &a;
        }
        let start = std::time::Instant::now();
        lazy::mark_step();
        let wall = start.elapsed();
        (t, wall)
    };
    // The first step compiles the trace; the second finds it.
    let (first, _) = step();
    lazy::reset_metrics();
    let m = lazy::metrics();
    let zero = std::time::Duration::ZERO;
    assert_eq!(
        (m.collect_time, m.key_time, m.lookup_time, m.execute_time),
        (zero, zero, zero, zero),
        "{m:?}"
    );
    let (second, wall) = step();
    let m = lazy::metrics();
    assert_eq!((m.cache_hits, m.traces_compiled), (1, 0), "{m:?}");
    assert!(m.collect_time > zero, "{m:?}");
    assert!(m.key_time > zero, "{m:?}");
    assert!(m.lookup_time > zero, "{m:?}");
    assert!(m.execute_time > zero, "{m:?}");
    let phases = m.collect_time + m.key_time + m.lookup_time + m.execute_time;
    assert!(phases <= wall, "{phases:?} of a {wall:?} step: {m:?}");
    assert_eq!(second.to_vec().unwrap(), first.to_vec().unwrap());
    assert_eq!(second.to_vec().unwrap(), vec![201.0; 4]);
}
