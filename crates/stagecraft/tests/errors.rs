//! Errors are values that name the op, the shapes and the caller's line.

use stagecraft::{
    cond, function, grad, lazy, stage, value_and_grad, while_loop, Device, Error, ErrorKind, Tensor,
};
use std::sync::{Arc, Mutex};

/// Asserts that `err` was raised by `op` at `line` of this file, and that
/// its message says so.
#[track_caller]
fn assert_raised_here(err: &Error, op: &str, line: u32) {
    assert_eq!(err.op(), Some(op), "{err}");
    let loc = err.location().expect("location recorded");
    assert!(loc.file().ends_with("tests/errors.rs"), "{err}");
    assert_eq!(loc.line(), line, "{err}");
    assert!(
        err.to_string().contains(&format!("errors.rs:{line}:")),
        "{err}"
    );
}

#[test]
fn invalid_matmul_names_op_shapes_and_caller_line() {
    let cpu = Device::cpu();
    let a = Tensor::<f32>::zeros(&[2, 3], &cpu);
    let b = Tensor::<f32>::zeros(&[4, 5], &cpu);
    let line = line!() + 1;
    let c = a.matmul(&b);
    // Shapes are still known for the error tensor; the error comes back at
    // once from check() and from every read.
    let err = c.check().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Shape);
    assert_eq!(err.op(), Some("MatMul"));
    let loc = err.location().expect("location recorded");
    assert!(loc.file().ends_with("tests/errors.rs"), "{loc}");
    assert_eq!(loc.line(), line);
    let text = err.to_string();
    assert!(text.contains("[2,3] @ [4,5]"), "{text}");
    assert!(text.contains(&format!("errors.rs:{line}")), "{text}");
    assert_eq!(c.to_vec().unwrap_err().to_string(), text);
    assert_eq!(c.item().unwrap_err().to_string(), text);
    assert!(format!("{c}").contains(&text));
}

#[test]
fn errors_propagate_with_the_original_location() {
    let cpu = Device::cpu();
    let x = Tensor::<f32>::ones(&[3], &cpu);
    let bad_line = line!() + 1;
    let bad = x.reshape(&[2, 2]);
    let later = (bad.exp() + 1.0).sum(&[], false);
    let err = later.to_vec().unwrap_err();
    assert_eq!(err.op(), Some("Reshape"));
    assert_eq!(err.location().unwrap().line(), bad_line);
}

#[test]
fn operator_errors_point_at_the_operator_line() {
    let cpu = Device::cpu();
    let a = Tensor::<f64>::zeros(&[2, 3], &cpu);
    let b = Tensor::<f64>::zeros(&[4], &cpu);
    let line = line!() + 1;
    let c = &a + &b;
    let err = c.check().unwrap_err();
    assert_eq!(err.op(), Some("Add"));
    assert_eq!(err.location().unwrap().line(), line);
    assert!(err.to_string().contains("[2,3] and [4]"), "{err}");
}

#[test]
fn diagnostic_handler_sees_raised_errors_with_location() {
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let sink = seen.clone();
    stagecraft::set_diagnostic_handler(Some(Arc::new(move |e: &stagecraft::Error| {
        sink.lock().unwrap().push(e.to_string());
    })));
    let cpu = Device::cpu();
    let x = Tensor::<f32>::zeros(&[2], &cpu);
    let line = line!() + 1;
    let _bad = x.softmax(5);
    stagecraft::set_diagnostic_handler(None);
    let seen = seen.lock().unwrap();
    assert!(
        seen.iter()
            .any(|m| m.starts_with("Softmax") && m.contains(&format!("errors.rs:{line}"))),
        "{seen:?}"
    );
}

#[test]
fn data_dependent_errors_are_reported_at_the_caller() {
    let cpu = Device::cpu();
    let x = Tensor::<f32>::from_vec(vec![1.0, 2.0, 3.0], &[3], &cpu).unwrap();
    let idx = Tensor::<i64>::from_vec(vec![0, 7], &[2], &cpu).unwrap();
    let line = line!() + 1;
    let g = x.index_select(0, &idx);
    let err = g.to_vec().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Index);
    assert_eq!(err.op(), Some("Gather"));
    assert_eq!(err.location().unwrap().line(), line);
    assert!(err.to_string().contains('7'), "{err}");

    let zero = Tensor::<i32>::from_vec(vec![1, 0], &[2], &cpu).unwrap();
    let q = Tensor::<i32>::from_vec(vec![4, 4], &[2], &cpu).unwrap() / zero;
    assert!(q
        .to_vec()
        .unwrap_err()
        .to_string()
        .contains("division by zero"));
}

#[test]
fn from_vec_and_item_errors() {
    let cpu = Device::cpu();
    let line = line!() + 1;
    let err = Tensor::<f32>::from_vec(vec![1.0; 5], &[2, 3], &cpu).unwrap_err();
    assert_eq!(err.location().unwrap().line(), line);
    assert!(err.to_string().contains("5 values"), "{err}");
    // Each constructor's error names the constructor the user called.
    assert_eq!(err.op(), Some("from_vec"), "{err}");
    let err = Tensor::<f32>::from_slice(&[1.0; 5], &[2, 3], &cpu).unwrap_err();
    assert_eq!(err.op(), Some("from_slice"), "{err}");
    let huge = [usize::MAX, 2];
    for (t, constructor) in [
        (Tensor::<f32>::zeros(&huge, &cpu), "zeros"),
        (Tensor::<f32>::ones(&huge, &cpu), "ones"),
        (Tensor::<f32>::full(&huge, 2.0, &cpu), "full"),
    ] {
        let err = t.check().unwrap_err();
        assert_eq!(err.op(), Some(constructor), "{err}");
    }
    let t = Tensor::<i64>::zeros(&[2], &cpu);
    assert!(t
        .item()
        .unwrap_err()
        .to_string()
        .contains("exactly one element"));
    assert_eq!(Tensor::<i64>::scalar(3, &cpu).item().unwrap(), 3);
}

// Entry points that run the user's closures: a shape error inside the
// closure names the closure's line, not one inside the library.

#[test]
fn shape_error_inside_grad_names_the_closure_line() {
    let x = Tensor::<f64>::ones(&[2, 3], &Device::cpu());
    let line = line!() + 1;
    let f = |x: &Tensor<f64>| x.matmul(x).sum(&[], false);
    let g = grad(f)(&x);
    assert_raised_here(&g.check().unwrap_err(), "MatMul", line);
}

#[test]
fn shape_error_inside_value_and_grad_names_the_closure_line() {
    let x = Tensor::<f64>::ones(&[2, 3], &Device::cpu());
    let line = line!() + 1;
    let f = |x: &Tensor<f64>| x.reshape(&[4]).sum(&[], false);
    let (value, slope) = value_and_grad(f)(&x);
    assert_raised_here(&value.check().unwrap_err(), "Reshape", line);
    assert_raised_here(&slope.check().unwrap_err(), "Reshape", line);
}

#[test]
fn grad_of_a_function_that_ignores_its_input_names_the_grad_line() {
    // The error is the differentiation's own, so it names the line that
    // asked for the gradient; before, it named a line of autodiff.rs.
    let x = Tensor::<f64>::ones(&[2], &Device::cpu());
    let line = line!() + 1;
    let g = grad(|_: &Tensor<f64>| Tensor::<f64>::scalar(1.0, &Device::cpu()))(&x);
    let err = g.check().unwrap_err();
    assert_raised_here(&err, "backward", line);
    assert!(
        err.to_string().contains("nothing to differentiate"),
        "{err}"
    );
}

#[test]
fn shape_error_inside_function_names_the_closure_line() {
    let x = Tensor::<f32>::ones(&[2, 3], &Device::cpu());
    let line = line!() + 1;
    let staged = function(|x: Tensor<f32>| x.matmul(&x).relu());
    let err = staged.call(x).check().unwrap_err();
    assert_raised_here(&err, "MatMul", line);
    assert!(err.to_string().contains("[2,3] @ [2,3]"), "{err}");
}

#[test]
fn shape_error_inside_a_cond_branch_names_the_branch_line() {
    let cpu = Device::cpu();
    let x = Tensor::<f32>::ones(&[2, 3], &cpu);
    let positive = x.sum(&[], false).gt(&Tensor::scalar(0.0, &cpu));
    let line = line!() + 1;
    let failing_branch = || x.transpose(0, 5);
    let y = cond(&positive, failing_branch, || x.clone());
    assert_raised_here(&y.check().unwrap_err(), "Transpose", line);
}

#[test]
fn shape_error_inside_a_while_loop_body_names_the_body_line() {
    let cpu = Device::cpu();
    let x = Tensor::<f32>::ones(&[2, 3], &cpu);
    let row = Tensor::<f32>::ones(&[4], &cpu);
    let line = line!() + 1;
    let failing_body = |x: Tensor<f32>| &x + &row;
    let y = while_loop(
        x,
        |x| x.sum(&[], false).lt(&Tensor::scalar(100.0, &Device::cpu())),
        failing_body,
    );
    let err = y.check().unwrap_err();
    assert_raised_here(&err, "Add", line);
    assert!(err.to_string().contains("[2,3] and [4]"), "{err}");
}

#[stage]
fn staged_shape_error(x: Tensor<f32>) -> Tensor<f32> {
    let total = x.sum(&[], false);
    if total.gt(&Tensor::scalar(0.0, &Device::cpu())) {
        x.softmax(3)
    } else {
        x
    }
}
/// The line of the `softmax` in `staged_shape_error`.
const STAGED_SOFTMAX_LINE: u32 = line!() - 6;

#[test]
fn shape_error_inside_a_stage_function_names_the_body_line() {
    let x = Tensor::<f32>::ones(&[2, 3], &Device::cpu());
    let err = staged_shape_error(x).check().unwrap_err();
    assert_raised_here(&err, "Softmax", STAGED_SOFTMAX_LINE);
}

// backward() and the lazy device.

#[test]
fn backward_errors_name_the_failing_line() {
    let cpu = Device::cpu();
    // Nothing tracked: the error is backward's own, at its call.
    let loss = Tensor::<f64>::ones(&[2], &cpu).sum(&[], false);
    let line = line!() + 1;
    let err = loss.backward().unwrap_err();
    assert_raised_here(&err, "backward", line);

    // A shape error in the forward pass comes back from backward as the
    // op's own error, at the op's line.
    let w = Tensor::<f64>::ones(&[2, 3], &cpu).requires_grad();
    let line = line!() + 1;
    let loss = w.matmul(&w).sum(&[], false);
    assert_raised_here(&loss.backward().unwrap_err(), "MatMul", line);

    // An op without a gradient rule names its own line.
    let w = Tensor::<f64>::ones(&[3], &cpu).requires_grad();
    let line = line!() + 1;
    let picked = w.argmax(0, false).one_hot::<f64>(3);
    let loss = (picked * &w).sum(&[], false);
    assert_raised_here(&loss.backward().unwrap_err(), "OneHot", line);
}

#[test]
fn lazy_materialization_errors_name_the_recording_line() {
    let dev = Device::lazy(&Device::cpu());
    let x = Tensor::<f32>::from_vec(vec![1.0, 2.0, 3.0], &[3], &dev).unwrap();
    let out_of_range = Tensor::<i64>::from_vec(vec![0, 7], &[2], &dev).unwrap();
    let first_line = line!() + 1;
    let first = x.index_select(0, &out_of_range);
    let err = first.to_vec().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Index);
    assert_raised_here(&err, "Gather", first_line);

    // The same trace again, recorded at another line, is served from the
    // trace cache; its error must name this recording's line.
    let compiled = lazy::metrics().traces_compiled;
    let second_line = line!() + 1;
    let second = x.index_select(0, &out_of_range);
    let err = second.to_vec().unwrap_err();
    assert_raised_here(&err, "Gather", second_line);
    assert_eq!(lazy::metrics().traces_compiled, compiled, "a cache hit");
}

/// The README's first program quotes the error it prints when saved as
/// `src/main.rs`: the line and column must be its `matmul`'s, and the
/// message the one that op gives.
#[test]
fn readme_quotes_the_first_programs_error_at_its_own_line() {
    let readme = include_str!("../../../README.md");
    let program = readme
        .split("```rust\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("README has a first program");
    let (index, matmul_line) = program
        .lines()
        .enumerate()
        .find(|(_, l)| l.contains("let bad = x.matmul(&x);"))
        .expect("the first program has the failing matmul");
    let column = matmul_line.find("matmul").expect("found above") + 1;
    let quoted = program
        .lines()
        .find_map(|l| l.split_once("// MatMul at "))
        .map(|(_, quoted)| quoted)
        .expect("the first program quotes its error");
    let place = format!("src/main.rs:{}:{column}: ", index + 1);
    assert!(
        quoted.starts_with(&place),
        "README says {quoted}, expected {place}"
    );

    let x = Tensor::<f32>::zeros(&[2, 3], &Device::cpu());
    let err = x.matmul(&x).check().unwrap_err();
    let text = err.to_string();
    let message = text
        .split_once(&format!("{}: ", err.location().unwrap()))
        .map(|(_, message)| message)
        .expect("the error names its location");
    assert_eq!(&quoted[place.len()..], message);
}
