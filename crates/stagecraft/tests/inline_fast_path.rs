//! Eager ops whose inputs are ready run on the synchronous fast path
//! (`RuntimeStats::inline_runs`) and answer as the full path does: the
//! same values for each shape and attribute, the same errors naming the
//! op and the caller's line, and what the fast path leaves alone still
//! runs the full way. (Its own test binary with one test: the runtime's
//! counters are process-wide.)

use stagecraft::layers::runtime::{stats, RuntimeStats};
use stagecraft::{with_execution_mode, Device, ExecutionMode, Tensor};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

fn since(before: &RuntimeStats) -> (u64, u64, u64) {
    let now = stats();
    (
        now.inline_runs - before.inline_runs,
        now.kernel_launches - before.kernel_launches,
        now.errors_raised - before.errors_raised,
    )
}

#[test]
fn ready_ops_run_inline_with_the_full_paths_answers() {
    let cpu = Device::cpu();
    let a = Tensor::<f32>::from_vec(vec![1.0, 2.0, 3.0, 4.0], &[4], &cpu).unwrap();
    let m = Tensor::<f32>::from_vec(vec![1.0, 2.0, 3.0, 4.0], &[2, 2], &cpu).unwrap();
    let ten = Tensor::<f32>::from_vec(vec![10.0], &[1], &cpu).unwrap();

    // One op on shapes that alternate: each call is keyed by its own.
    let before = stats();
    for _ in 0..3 {
        assert_eq!((&a + &a).to_vec().unwrap(), [2.0, 4.0, 6.0, 8.0]);
        let sum = &m + &m;
        assert_eq!(sum.dims(), [2, 2]);
        assert_eq!(sum.to_vec().unwrap(), [2.0, 4.0, 6.0, 8.0]);
        assert_eq!((&a + &ten).to_vec().unwrap(), [11.0, 12.0, 13.0, 14.0]);
    }
    assert_eq!(since(&before), (9, 9, 0), "every ready add runs inline");

    // Owned operands (the kernel may reuse a buffer nobody else holds),
    // and a Rust scalar, which is a scalar host value rather than a dense
    // buffer.
    let before = stats();
    for _ in 0..2 {
        let doubled = &a * 2.0;
        let shifted = doubled + &a;
        assert_eq!(shifted.to_vec().unwrap(), [3.0, 6.0, 9.0, 12.0]);
        assert_eq!(a.to_vec().unwrap(), [1.0, 2.0, 3.0, 4.0], "kept intact");
    }
    assert_eq!(since(&before), (4, 4, 0));

    // Attributes key them too.
    let x = Tensor::<f32>::from_vec(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3], &cpu).unwrap();
    for _ in 0..2 {
        assert_eq!(x.sum(&[0], false).to_vec().unwrap(), [5.0, 7.0, 9.0]);
        assert_eq!(x.sum(&[1], false).to_vec().unwrap(), [6.0, 15.0]);
        let kept = x.sum(&[1], true);
        assert_eq!(kept.dims(), [2, 1]);
        assert_eq!(kept.to_vec().unwrap(), [6.0, 15.0]);
    }

    // A kernel's error on the fast path names the op and the caller's line,
    // the first time (prepared) and the next (found prepared).
    let i = Tensor::<i32>::from_vec(vec![1, 2], &[2], &cpu).unwrap();
    let zero = Tensor::<i32>::zeros(&[2], &cpu);
    let before = stats();
    for _ in 0..2 {
        let line = line!() + 1;
        let quotient = &i / &zero;
        let err = quotient.check().unwrap_err();
        assert_eq!(err.op(), Some("Div"), "{err}");
        assert_eq!(err.location().map(|l| l.line()), Some(line), "{err}");
        assert!(err.to_string().contains("division by zero"), "{err}");
    }
    assert_eq!(since(&before), (2, 2, 2), "raised once per call, inline");

    // What the fast path leaves to the full path.
    let before = stats();
    // Inputs that do not fit: the metadata function's error, raised.
    let bad = &a + &m;
    let err = bad.check().unwrap_err();
    assert_eq!(err.op(), Some("Add"), "{err}");
    // An input that is an error: propagated, nothing runs.
    let propagated = &bad + &bad;
    assert_eq!(propagated.check().unwrap_err().op(), Some("Add"));
    // No elements to compute (where huge dims are settled by shape).
    let empty = Tensor::<f32>::zeros(&[0, 3], &cpu);
    let doubled = &empty + &empty;
    assert_eq!(doubled.dims(), [0, 3]);
    assert!(doubled.to_vec().unwrap().is_empty());
    assert_eq!(
        since(&before),
        (0, 1, 1),
        "one error raised, the empty add's kernel run the full way"
    );
    // Async mode schedules kernels, and their outputs are pending inputs.
    let before = stats();
    let scheduled = with_execution_mode(ExecutionMode::Async, || (&a + &a) * &a);
    assert_eq!(scheduled.to_vec().unwrap(), [2.0, 8.0, 18.0, 32.0]);
    assert_eq!(
        since(&before),
        (0, 2, 0),
        "two scheduled kernels, none inline"
    );

    // An op prepared for the full path looks its kernel up once per call,
    // there, not also on the fast path.
    let kernel_hits = || cpu.handler().kernel_cache_stats().unwrap().hits;
    let before = (stats(), kernel_hits());
    let again = &empty + &empty;
    assert_eq!(again.dims(), [0, 3]);
    assert_eq!(since(&before.0), (0, 1, 0));
    assert_eq!(kernel_hits() - before.1, 1, "one lookup, on the full path");

    // The same ops run inline again afterwards.
    let before = stats();
    assert_eq!((&a + &a).to_vec().unwrap(), [2.0, 4.0, 6.0, 8.0]);
    assert_eq!(since(&before), (1, 1, 0));

    side_effects_run_inline_only_after_every_earlier_one(&a);
}

/// A side effect (here `Print`; collectives alike) runs inline when every
/// earlier one has run, and the full way, after them, while one is still
/// pending.
fn side_effects_run_inline_only_after_every_earlier_one(a: &Tensor<f32>) {
    let lines: Arc<Mutex<Vec<String>>> = Arc::default();
    // A print labelled `hold` blocks until the gate opens.
    let gate: Arc<(Mutex<bool>, Condvar)> = Arc::default();
    let (sink, held) = (lines.clone(), gate.clone());
    stagecraft::layers::cpu::set_print_sink(Some(Arc::new(move |line: &str| {
        if line.starts_with("hold") {
            let (open, opened) = &*held;
            let mut open = open.lock().unwrap();
            while !*open {
                open = opened.wait(open).unwrap();
            }
        }
        sink.lock().unwrap().push(line.to_string());
    })));

    let before = stats();
    for _ in 0..2 {
        assert_eq!(a.print("ready").to_vec().unwrap(), [1.0, 2.0, 3.0, 4.0]);
    }
    assert_eq!(since(&before), (2, 2, 0), "both prints inline");
    assert_eq!(lines.lock().unwrap().len(), 2);

    let held = with_execution_mode(ExecutionMode::Async, || a.print("hold"));
    let before = stats();
    std::thread::scope(|s| {
        // Long after `after` was issued, which waits for `hold` meanwhile.
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(300));
            let (open, opened) = &*gate;
            *open.lock().unwrap() = true;
            opened.notify_all();
        });
        let after = a.print("after");
        assert_eq!(after.to_vec().unwrap(), [1.0, 2.0, 3.0, 4.0]);
    });
    held.check().unwrap();
    // Both kernels ran in this span (`hold`'s on a worker), none inline.
    assert_eq!(since(&before), (0, 2, 0), "`after` waited on the full path");
    stagecraft::layers::cpu::set_print_sink(None);
    let lines = lines.lock().unwrap();
    let labels: Vec<&str> = lines.iter().map(|l| &l[..l.find(':').unwrap()]).collect();
    assert_eq!(labels, ["ready", "ready", "hold", "after"]);
}
