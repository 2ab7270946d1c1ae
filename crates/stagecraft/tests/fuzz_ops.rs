//! The op-call fuzzer as a bounded proptest, so CI runs it: random op
//! calls with random shapes (empty and zero-size dimensions included),
//! dtypes and attributes on the eager and the lazy device. Every call must
//! succeed or give an error naming the op and the line of the shared
//! generator (`fuzz/src/op_calls.rs`, the same code the `eager_ops` and
//! `lazy_ops` cargo-fuzz targets run) it was called from; a panic or a
//! hang fails the test with the case's bytes.

#[path = "../../../fuzz/src/op_calls.rs"]
mod op_calls;

use proptest::prelude::*;
use std::sync::mpsc;
use std::time::Duration;

/// Longer than any case takes (a few milliseconds each), short enough
/// that a hang fails the run instead of stalling it.
const HANG: Duration = Duration::from_secs(30);

/// Runs one case on its own thread: a panic there comes back as the
/// thread's result, and a case that does not finish in time is a hang.
fn run_case(bytes: &[u8], lazy: bool) -> Result<usize, String> {
    let (tx, rx) = mpsc::channel();
    let owned = bytes.to_vec();
    std::thread::spawn(move || {
        let result = std::panic::catch_unwind(|| op_calls::run(&owned, lazy));
        let _ = tx.send(result);
    });
    match rx.recv_timeout(HANG) {
        Ok(Ok(result)) => result,
        Ok(Err(panic)) => {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Err(format!("panicked: {message}"))
        }
        Err(_) => {
            // Shrinking a hang would hang again and again: stop here.
            eprintln!("hang (lazy: {lazy}) on the bytes {bytes:?}");
            std::process::abort();
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    #[test]
    fn eager_op_calls_succeed_or_name_op_and_line(
        bytes in proptest::collection::vec(any::<u8>(), 0..256)
    ) {
        if let Err(finding) = run_case(&bytes, false) {
            prop_assert!(false, "eager: {finding}\nbytes: {bytes:?}");
        }
    }

    #[test]
    fn lazy_op_calls_succeed_or_name_op_and_line(
        bytes in proptest::collection::vec(any::<u8>(), 0..256)
    ) {
        if let Err(finding) = run_case(&bytes, true) {
            prop_assert!(false, "lazy: {finding}\nbytes: {bytes:?}");
        }
    }
}

/// Cases per test: sized so the file runs in well under a minute in the
/// test profile on a busy 2-core machine.
const CASES: u32 = 4096;

/// The generator really exercises the ops: over fixed inputs it makes op
/// calls, and both devices accept an empty input.
#[test]
fn fixed_inputs_make_op_calls() {
    assert_eq!(run_case(&[], false), Ok(0));
    assert_eq!(run_case(&[], true), Ok(0));
    let bytes: Vec<u8> = (0..=255).collect();
    for lazy in [false, true] {
        let calls = run_case(&bytes, lazy).unwrap();
        assert!(calls > 5, "{calls} calls");
    }
}

// Regressions for what the fuzzers found, one test each.

/// A `full` whose element count overflows is an error tensor; ops on it
/// used to infer their metadata from the overflowing shape and panic
/// ("attempt to multiply with overflow" in `Shape::numel`).
#[test]
fn ops_on_an_overflowing_fill_pass_its_error_on() {
    use stagecraft::{Device, Tensor};
    let cpu = Device::cpu();
    let line = line!() + 1;
    let t = Tensor::<f32>::full(&[usize::MAX, 2], 1.0, &cpu);
    for out in [t.unsqueeze(0), t.reshape(&[1]), t.squeeze(&[]), t.exp()] {
        let err = out.check().unwrap_err();
        assert_eq!(err.op(), Some("full"), "{err}");
        assert_eq!(err.location().unwrap().line(), line, "{err}");
    }
}

/// A fill whose values need more bytes than an address space holds is
/// still one value: copied to another device it stays a fill, and an op
/// that would make it dense fails naming that op, not the runtime's copy
/// (the copy used to densify the fill and name `CopyToDevice`).
#[test]
fn a_huge_fill_crosses_devices_as_one_value() {
    use stagecraft::{Device, Tensor};
    let cpu = Device::cpu();
    let lazy = Device::lazy(&cpu);
    for (from, to) in [(lazy, cpu), (cpu, lazy)] {
        let fill = Tensor::<i64>::full(&[usize::MAX, 1], 3, &from);
        let moved = fill.to_device(&to);
        assert_eq!(moved.dims(), &[usize::MAX, 1]);
        assert!(moved.check().is_ok());
        let line = line!() + 1;
        let flat = moved.reshape(&[usize::MAX]);
        let err = flat.to_vec().unwrap_err();
        assert_eq!(
            (err.op(), err.location().unwrap().line()),
            (Some("Reshape"), line)
        );

        let cond = Tensor::<bool>::scalar(true, &to);
        let zero = Tensor::<i64>::scalar(0, &to);
        let line = line!() + 1;
        let picked = cond.select(&fill, &zero);
        let err = picked.to_vec().unwrap_err();
        assert_eq!(
            (err.op(), err.location().unwrap().line()),
            (Some("Select"), line)
        );
    }
}

/// On the lazy device `nonzero` (whose shape depends on the values) used
/// to be recorded with a placeholder shape, so later ops inferred wrong
/// metadata and failed with an internal error naming no op.
#[test]
fn lazy_nonzero_has_its_real_shape_for_later_ops() {
    use stagecraft::{Device, Tensor};
    let cpu = Device::cpu();
    let lazy = Device::lazy(&cpu);
    for device in [cpu, lazy] {
        let x = Tensor::<f32>::scalar(2.0, &device);
        let nz = x.nonzero();
        assert_eq!(nz.dims(), &[1, 0]);
        let hot = nz.one_hot::<f32>(1);
        assert_eq!(hot.dims(), &[1, 0, 1]);
        assert_eq!(hot.to_vec().unwrap(), Vec::<f32>::new());
        let m = Tensor::<i64>::from_vec(vec![0, 3, 0, 5], &[2, 2], &device).unwrap();
        let coords = m.nonzero();
        assert_eq!(coords.dims(), &[2, 2]);
        assert_eq!(coords.sum(&[0], false).to_vec().unwrap(), vec![1, 2]);
    }
}

/// A zero-size tensor whose other dimensions multiply past `usize::MAX`
/// is valid (no elements); on the lazy device constant folding used to
/// panic computing its strides.
#[test]
fn zero_size_tensors_with_huge_dims_compute() {
    use stagecraft::{Device, Tensor};
    let cpu = Device::cpu();
    for device in [cpu, Device::lazy(&cpu)] {
        let t = Tensor::<f32>::full(&[0, usize::MAX, usize::MAX], 1.5, &device);
        let y = (t.exp() + 1.0).sum(&[1], true);
        assert_eq!(y.dims(), &[0, 1, usize::MAX]);
        assert_eq!(y.to_vec().unwrap(), Vec::<f32>::new());
    }
}

/// An output whose element count fits `usize` but whose bytes do not
/// (`usize::MAX` f32 values) used to reach the kernel, whose allocation
/// panicked with "capacity overflow"; it is an error of the op now.
#[test]
fn outputs_too_big_to_allocate_are_errors_of_the_op() {
    use stagecraft::{Device, Tensor};
    let cpu = Device::cpu();
    for device in [cpu, Device::lazy(&cpu)] {
        let t = Tensor::<f32>::full(&[usize::MAX], 1.0, &device);
        let line = line!() + 1;
        for out in [t.exp(), -&t, t.pad(&[(0, 0)], 0.0)] {
            let err = out.to_vec().unwrap_err();
            assert!(err.to_string().contains("isize::MAX bytes"), "{err}");
            assert_eq!(err.location().unwrap().line(), line, "{err}");
        }
        let idx = Tensor::<i64>::scalar(0, &device);
        let err = idx.one_hot::<bool>(usize::MAX).check().unwrap_err();
        assert_eq!(err.op(), Some("OneHot"), "{err}");
    }
}

/// A lazy trace served from the cache used to keep the source lines of the
/// program it was compiled for, so a kernel error in it named that
/// program's call. These two programs divide the same `i32` fill by zero
/// at different lines of the generator (`a / zero`, and `a / s` with a
/// palette scalar of 0), which record the same trace: each error must
/// name the program's own line.
#[test]
fn cached_lazy_traces_name_the_current_programs_line() {
    // rng seed; create i32, rank 1, dim 1, this device, `full` of 3; an
    // element op on value 0 that is numeric, then the division:
    let by_zero = [0, 1, 1, 0, 1, 2, 12, 2, 0, 16, 12];
    let by_scalar = [0, 1, 1, 0, 1, 2, 12, 2, 0, 16, 4, 0, 3];
    for bytes in [&by_zero[..], &by_scalar, &by_zero, &by_scalar] {
        assert_eq!(run_case(bytes, true), Ok(1), "bytes: {bytes:?}");
    }
}

/// The committed seeds of the two cargo-fuzz targets, including the inputs
/// of past crashes, replay cleanly on both devices.
#[test]
fn fuzz_seeds_replay() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds");
    let mut replayed = 0;
    for target in ["eager_ops", "lazy_ops"] {
        for entry in std::fs::read_dir(root.join(target)).unwrap() {
            let path = entry.unwrap().path();
            let bytes = std::fs::read(&path).unwrap();
            for lazy in [false, true] {
                if let Err(finding) = run_case(&bytes, lazy) {
                    panic!("{} (lazy: {lazy}): {finding}", path.display());
                }
            }
            replayed += 1;
        }
    }
    assert!(replayed >= 6, "{replayed} seeds");
}
