//! Errors are values that name the op, the shapes and the caller's line.

use stagecraft::{Device, ErrorKind, Tensor};
use std::sync::{Arc, Mutex};

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
    let t = Tensor::<i64>::zeros(&[2], &cpu);
    assert!(t
        .item()
        .unwrap_err()
        .to_string()
        .contains("exactly one element"));
    assert_eq!(Tensor::<i64>::scalar(3, &cpu).item().unwrap(), 3);
}
