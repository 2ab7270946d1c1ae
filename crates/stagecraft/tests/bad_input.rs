//! Bad input never panics: every invalid call returns an error that names
//! the op and the caller's line; edge cases (empty and zero-size tensors,
//! NaN) give the documented answers.

use stagecraft::layers::ops::{self as ops, OpAttrs};
use stagecraft::layers::runtime::{self as rt, TensorHandle};
use stagecraft::layers::tensor::{DenseHostTensor, ScalarHostTensor};
use stagecraft::{
    Conv1dOptions, Conv2dOptions, ConvTranspose2dOptions, DType, Device, ErrorKind, Pool2dOptions,
    Tensor,
};

fn f32s(values: &[f32], dims: &[usize]) -> Tensor<f32> {
    Tensor::from_slice(values, dims, &Device::cpu()).unwrap()
}

/// Asserts that `t` holds an error raised by `op` on line `line` of this
/// file.
#[track_caller]
fn assert_fails<T: stagecraft::Element>(t: Tensor<T>, op: &str, line: u32) {
    let err = t.check().expect_err("expected an error");
    assert_eq!(err.op(), Some(op), "{err}");
    let loc = err.location().expect("location");
    // rustfmt may wrap a case over several lines: the op call then starts
    // a few lines above the `line!()` that follows it.
    assert!(
        loc.file().ends_with("bad_input.rs") && loc.line() <= line && loc.line() + 10 >= line,
        "{err}"
    );
    assert!(t.to_vec().is_err());
}

#[test]
fn shape_axis_and_attribute_errors() {
    let x = f32s(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
    let i = Tensor::<i64>::from_vec(vec![0, 1], &[2], &Device::cpu()).unwrap();
    let cases: Vec<(Tensor<f32>, &str, u32)> = vec![
        (x.reshape(&[4, 2]), "Reshape", line!()),
        (x.transpose(0, 2), "Transpose", line!()),
        (x.permute(&[0, 0]), "Transpose", line!()),
        (x.sum(&[2], false), "Sum", line!()),
        (x.sum(&[0, -2], false), "Sum", line!()),
        (x.mean(&[-3], true), "Mean", line!()),
        (x.softmax(2), "Softmax", line!()),
        (x.log_softmax(-3), "LogSoftmax", line!()),
        (x.broadcast_to(&[3, 3]), "BroadcastTo", line!()),
        (x.squeeze(&[0]), "Squeeze", line!()),
        (x.unsqueeze(4), "Unsqueeze", line!()),
        (x.narrow(1, 2, 5), "Slice", line!()),
        (x.slice(&[0], &[1], &[]), "Slice", line!()),
        (x.slice(&[0, 0], &[1, 1], &[1, 0]), "Slice", line!()),
        (x.index_select(2, &i), "Gather", line!()),
        (
            Tensor::concat(&[&x, &f32s(&[1.0], &[1, 1])], 0),
            "Concat",
            line!(),
        ),
        (Tensor::concat(&[&x, &x], 3), "Concat", line!()),
        (Tensor::<f32>::concat(&[], 0), "Concat", line!()),
        (x.pad(&[(1, 1)], 0.0), "Pad", line!()),
        (x.matmul(&f32s(&[1.0; 4], &[2, 2])), "MatMul", line!()),
        (x.conv2d(&x, Conv2dOptions::default()), "Conv2d", line!()),
        (
            x.reshape(&[1, 1, 2, 3]).conv2d(
                &Tensor::ones(&[1, 1, 3, 3], &Device::cpu()),
                Conv2dOptions::default(),
            ),
            "Conv2d",
            line!(),
        ),
        (
            x.reshape(&[1, 1, 2, 3]).conv2d(
                &Tensor::ones(&[1, 1, 1, 1], &Device::cpu()),
                Conv2dOptions {
                    stride: [0, 1],
                    ..Default::default()
                },
            ),
            "Conv2d",
            line!(),
        ),
        (
            x.max_pool2d(Pool2dOptions::new([2, 2])),
            "MaxPool2d",
            line!(),
        ),
        (
            x.reshape(&[1, 1, 2, 3])
                .avg_pool2d(Pool2dOptions::new([3, 3]), true),
            "AvgPool2d",
            line!(),
        ),
        (
            x.reshape(&[1, 1, 2, 3])
                .max_pool2d(Pool2dOptions::new([0, 1])),
            "MaxPool2d",
            line!(),
        ),
        (x.max(&[], false).max(&[0], false), "Max", line!()),
        (f32s(&[], &[0, 3]).max(&[0], false), "Max", line!()),
        (
            Tensor::<f32>::arange(0.0, 1.0, 0.0, &Device::cpu()),
            "Arange",
            line!(),
        ),
        (
            Tensor::<f32>::arange(0.0, f64::NAN, 1.0, &Device::cpu()),
            "Arange",
            line!(),
        ),
        (
            Tensor::<f32>::rand_uniform(
                &[2],
                1.0,
                0.0,
                &mut stagecraft::Rng::new(0),
                &Device::cpu(),
            ),
            "RandomUniform",
            line!(),
        ),
        (
            Tensor::<f32>::rand_normal(
                &[2],
                0.0,
                -1.0,
                &mut stagecraft::Rng::new(0),
                &Device::cpu(),
            ),
            "RandomNormal",
            line!(),
        ),
        (
            Tensor::<f32>::zeros(&[usize::MAX, 2], &Device::cpu()),
            "zeros",
            line!(),
        ),
        (x.argmax(5, false).cast::<f32>(), "ArgMax", line!()),
    ];
    for (t, op, line) in cases {
        assert_fails(t, op, line);
    }
}

/// The everyday shape and indexing methods check their arguments: each
/// bad call is an error naming the method (or the op it runs) and the
/// caller's line.
#[test]
fn everyday_shape_and_indexing_errors() {
    let cpu = Device::cpu();
    let x = f32s(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
    let i = Tensor::<i64>::from_vec(vec![0, 1], &[2], &cpu).unwrap();
    let i2 = Tensor::<i64>::from_vec(vec![0, 1], &[1, 2], &cpu).unwrap();
    let cases: Vec<(Tensor<f32>, &str, u32)> = vec![
        (Tensor::<f32>::stack(&[], 0), "Stack", line!()),
        (
            Tensor::stack(&[&x, &x.reshape(&[3, 2])], 0),
            "Stack",
            line!(),
        ),
        (Tensor::stack(&[&x, &x], 3), "Stack", line!()),
        (Tensor::stack(&[&x, &x], -4), "Stack", line!()),
        // Sizes that do not add up, a bad axis, zero chunks.
        (x.split(&[1, 1], 1).remove(0), "Split", line!()),
        (x.split(&[usize::MAX, 4], 1).remove(0), "Split", line!()),
        (x.split(&[2], 2).remove(0), "Split", line!()),
        (x.chunk(0, 0).remove(0), "Chunk", line!()),
        (x.chunk(2, -3).remove(0), "Chunk", line!()),
        // A zero-size tensor with a huge axis: one piece per element would
        // exhaust memory (found by the fuzzer).
        (
            Tensor::<f32>::zeros(&[0, usize::MAX / 8], &cpu)
                .chunk(usize::MAX, 1)
                .remove(0),
            "Chunk",
            line!(),
        ),
        (x.flatten(1, 0), "Flatten", line!()),
        (x.flatten(0, 2), "Flatten", line!()),
        (f32s(&[1.0], &[1]).tril(0), "Trilu", line!()),
        (Tensor::<f32>::scalar(1.0, &cpu).triu(0), "Trilu", line!()),
        (x.cumsum(2), "Cumsum", line!()),
        (x.cumsum(-3), "Cumsum", line!()),
        (x.repeat(&[2]), "Repeat", line!()),
        (x.repeat(&[usize::MAX, 1]), "Repeat", line!()),
        (x.tile(&[usize::MAX / 2, 1, 1]), "Tile", line!()),
        (x.expand(&[3]), "Expand", line!()),
        (x.expand(&[4, -1]), "Expand", line!()),
        (x.expand(&[-1, 2, 3]), "Expand", line!()),
        (x.expand(&[2, -2]), "Expand", line!()),
        // Indices of another rank, or larger than x off the axis.
        (x.take_along_axis(0, &i), "GatherElements", line!()),
        (
            x.take_along_axis(0, &i2.reshape(&[1, 2]).repeat(&[1, 2])),
            "GatherElements",
            line!(),
        ),
        (x.take_along_axis(2, &i2), "GatherElements", line!()),
        (
            x.scatter_add(0, &i2, &f32s(&[1.0, 2.0, 3.0], &[1, 3])),
            "ScatterAdd",
            line!(),
        ),
        (
            x.scatter_add(0, &i, &f32s(&[1.0, 2.0], &[2])),
            "ScatterAdd",
            line!(),
        ),
        (
            x.index_add(0, &i2, &f32s(&[1.0, 2.0, 3.0], &[1, 3])),
            "IndexAdd",
            line!(),
        ),
        (x.index_add(1, &i, &x), "IndexAdd", line!()),
        (x.index_add(-3, &i, &x), "IndexAdd", line!()),
    ];
    for (t, op, line) in cases {
        assert_fails(t, op, line);
    }
    // Out-of-range indices are errors of the kernel, when it runs.
    let far = Tensor::<i32>::from_vec(vec![0, 3], &[1, 2], &cpu).unwrap();
    let below = Tensor::<i64>::from_vec(vec![-3], &[1], &cpu).unwrap();
    let cases: Vec<(Tensor<f32>, &str, u32)> = vec![
        (x.take_along_axis(1, &far), "GatherElements", line!()),
        (
            x.scatter_add(1, &far, &f32s(&[1.0, 1.0], &[1, 2])),
            "ScatterAdd",
            line!(),
        ),
        (
            x.index_add(0, &below, &f32s(&[1.0; 3], &[1, 3])),
            "IndexAdd",
            line!(),
        ),
    ];
    for (t, op, line) in cases {
        let err = t.to_vec().unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Index, "{err}");
        assert_eq!(err.op(), Some(op), "{err}");
        let at = err.location().expect("location").line();
        assert!(at <= line && at + 10 >= line, "{err}");
    }
    // An input that already holds an error passes it on unchanged.
    let bad = x.reshape(&[7]);
    for t in [
        Tensor::stack(&[&x, &bad], 0),
        bad.split(&[7], 0).remove(0),
        bad.chunk(2, 5).remove(0),
        bad.flatten(0, 0),
        bad.expand(&[7]),
    ] {
        assert_eq!(t.check().unwrap_err().op(), Some("Reshape"));
    }
    let oh = i.one_hot::<f32>(1);
    let err = oh.to_vec().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Index, "{err}");
}

#[test]
fn dtype_errors_through_the_untyped_runtime() {
    // The typed API makes dtype mismatches compile errors; code below it gets
    // run-time errors from the metadata functions instead.
    let cpu = Device::cpu();
    let f = TensorHandle::available(
        cpu,
        DenseHostTensor::from_slice(&[1.0f32], [1]).unwrap().into(),
    );
    let d = TensorHandle::available(
        cpu,
        DenseHostTensor::from_slice(&[1.0f64], [1]).unwrap().into(),
    );
    let i = TensorHandle::available(
        cpu,
        DenseHostTensor::from_slice(&[1i32], [1]).unwrap().into(),
    );
    let loc = stagecraft::Location::caller();
    let none = OpAttrs::new();
    let check = |op: &'static ops::OpDef, args: Vec<TensorHandle>, attrs: &OpAttrs| {
        let out = rt::execute(op, cpu, loc, args.into_iter().collect(), attrs.into());
        let err = out[0].wait().unwrap_err();
        assert_eq!(err.op(), Some(op.name));
        assert!(
            matches!(
                err.kind(),
                ErrorKind::DType | ErrorKind::Attribute | ErrorKind::InvalidArgument
            ),
            "{err}"
        );
    };
    check(&ops::ADD, vec![f.clone(), d.clone()], &none);
    check(&ops::EXP, vec![i.clone()], &none);
    check(&ops::MATMUL, vec![f.clone(), i.clone()], &none);
    check(&ops::GATHER, vec![f.clone(), f.clone()], &none);
    check(&ops::SELECT, vec![f.clone(), f.clone(), f.clone()], &none);
    check(&ops::ADD, vec![f.clone()], &none);
    let mut wrong_kind = OpAttrs::new();
    wrong_kind.set_float("axis", 1.0);
    check(&ops::SOFTMAX, vec![f.clone()], &wrong_kind);
    let mut unknown = OpAttrs::new();
    unknown.set_int("axiz", 0);
    check(&ops::SOFTMAX, vec![f.clone()], &unknown);
    check(&ops::CAST, vec![f.clone()], &none);
    check(&ops::GATHER_ELEMENTS, vec![f.clone(), f.clone()], &none);
    check(
        &ops::SCATTER_ADD,
        vec![f.clone(), i.clone(), d.clone()],
        &none,
    );
    check(
        &ops::SCATTER_ADD,
        vec![f.clone(), f.clone(), f.clone()],
        &none,
    );
    check(
        &ops::INDEX_ADD,
        vec![f.clone(), i.clone(), d.clone()],
        &none,
    );
    check(
        &ops::INDEX_ADD,
        vec![i.clone(), f.clone(), i.clone()],
        &none,
    );
    let b = TensorHandle::available(
        cpu,
        DenseHostTensor::from_slice(&[true, false], [2])
            .unwrap()
            .into(),
    );
    check(&ops::CUMSUM, vec![b.clone()], &none);
    check(
        &ops::INDEX_ADD,
        vec![b.clone(), i.clone(), b.clone()],
        &none,
    );
    let s = TensorHandle::available(
        cpu,
        ScalarHostTensor::new(stagecraft::layers::tensor::Scalar::Bool(true), [2]).into(),
    );
    check(&ops::SUM, vec![s], &none);
    assert_eq!(DType::parse("f32"), Some(DType::F32));
}

#[test]
fn empty_zero_size_and_nan_inputs() {
    let cpu = Device::cpu();
    let empty = f32s(&[], &[0, 3]);
    assert_eq!(empty.exp().dims(), &[0, 3]);
    assert_eq!((&empty + 1.0).to_vec().unwrap(), Vec::<f32>::new());
    assert_eq!(empty.sum(&[0], false).to_vec().unwrap(), vec![0.0; 3]);
    assert_eq!(empty.prod(&[0], false).to_vec().unwrap(), vec![1.0; 3]);
    assert!(empty
        .mean(&[0], false)
        .to_vec()
        .unwrap()
        .iter()
        .all(|v| v.is_nan()));
    assert_eq!(empty.sum(&[1], true).dims(), &[0, 1]);
    assert_eq!(
        empty.matmul(&Tensor::ones(&[3, 2], &cpu)).to_vec().unwrap(),
        Vec::<f32>::new()
    );
    assert_eq!(
        Tensor::<f32>::zeros(&[2, 0], &cpu)
            .matmul(&Tensor::zeros(&[0, 3], &cpu))
            .to_vec()
            .unwrap(),
        vec![0.0; 6]
    );
    assert_eq!(empty.transpose(0, 1).dims(), &[3, 0]);
    assert_eq!(
        Tensor::concat(&[&empty, &f32s(&[1.0, 2.0, 3.0], &[1, 3])], 0)
            .to_vec()
            .unwrap(),
        vec![1.0, 2.0, 3.0]
    );
    assert_eq!(empty.softmax(-1).dims(), &[0, 3]);
    assert_eq!(empty.nonzero().dims(), &[0, 2]);
    assert_eq!(empty.cumsum(0).dims(), &[0, 3]);
    assert_eq!(empty.cumsum(1).to_vec().unwrap(), Vec::<f32>::new());
    assert_eq!(empty.tril(1).dims(), &[0, 3]);
    assert_eq!(Tensor::stack(&[&empty, &empty], 2).dims(), &[0, 3, 2]);
    let halves = empty.split(&[0, 0], 0);
    assert_eq!(halves.len(), 2);
    assert_eq!(halves[1].dims(), &[0, 3]);
    let pieces = empty.chunk(4, 0);
    assert_eq!(pieces.len(), 1);
    assert_eq!(pieces[0].dims(), &[0, 3]);
    assert_eq!(empty.chunk(2, 1).len(), 2);
    assert_eq!(empty.flatten(0, -1).dims(), &[0]);
    assert_eq!(empty.repeat(&[3, 2]).dims(), &[0, 6]);
    assert_eq!(empty.expand(&[2, -1, 3]).dims(), &[2, 0, 3]);
    // No indices: nothing is added, not even into an empty axis.
    let none = Tensor::<i64>::from_vec(vec![], &[0], &cpu).unwrap();
    assert_eq!(
        empty
            .index_add(0, &none, &f32s(&[], &[0, 3]))
            .to_vec()
            .unwrap(),
        Vec::<f32>::new()
    );
    let flat = f32s(&[1.0, 2.0], &[2]);
    let no_picks = Tensor::<i64>::from_vec(vec![], &[0], &cpu).unwrap();
    assert_eq!(
        flat.scatter_add(0, &no_picks, &f32s(&[], &[0]))
            .to_vec()
            .unwrap(),
        vec![1.0, 2.0]
    );
    assert_eq!(flat.take_along_axis(0, &no_picks).dims(), &[0]);
    // A rank-0 tensor flattens to one element.
    assert_eq!(Tensor::<f32>::scalar(2.0, &cpu).flatten(0, -1).dims(), &[1]);

    let nan = f32s(&[1.0, f32::NAN, 3.0], &[3]);
    assert!(nan.max(&[], false).item().unwrap().is_nan());
    assert!(nan.sum(&[], false).item().unwrap().is_nan());
    assert_eq!(nan.argmax(0, false).item().unwrap(), 1);
    assert!(nan.softmax(0).to_vec().unwrap().iter().all(|v| v.is_nan()));
    assert_eq!(
        nan.gt(&f32s(&[0.0], &[1])).to_vec().unwrap(),
        vec![true, false, true]
    );
    assert_eq!(nan.cast::<i32>().to_vec().unwrap(), vec![1, 0, 3]);
    assert!(f32s(&[-1.0], &[1]).sqrt().item().unwrap().is_nan());
    assert_eq!(f32s(&[0.0], &[1]).log().item().unwrap(), f32::NEG_INFINITY);
    let scalar = Tensor::<f64>::scalar(2.0, &cpu);
    assert_eq!(scalar.exp().item().unwrap(), 2.0f64.exp());
    assert_eq!(scalar.sum(&[], false).dims(), &[] as &[usize]);
    assert!(scalar.sum(&[0], false).check().is_err());
}

/// Sorting, variance and the new convolutions: each bad call is an error
/// naming the op (the composite `var`, `std` and `conv1d` name themselves).
#[test]
fn sorting_variance_and_convolution_errors() {
    let cpu = Device::cpu();
    let x = f32s(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
    let ones = |dims: &[usize]| Tensor::<f32>::ones(dims, &cpu);
    let image = ones(&[1, 4, 3, 3]);
    let cases: Vec<(Tensor<f32>, &str, u32)> = vec![
        (x.sort(2, false).0, "Sort", line!()),
        (x.argsort(-3, true).cast::<f32>(), "Sort", line!()),
        (x.topk(4, 1, true, true).0, "TopK", line!()),
        (x.topk(1, 5, false, true).1.cast::<f32>(), "TopK", line!()),
        (
            Tensor::<f32>::scalar(1.0, &cpu).sort(0, false).0,
            "Sort",
            line!(),
        ),
        (x.var(&[2], false, 1), "Var", line!()),
        (x.var(&[0, -2], true, 0), "Var", line!()),
        (x.std(&[-3], false, 1), "Std", line!()),
        (
            x.conv1d(&ones(&[1, 1, 1]), Default::default()),
            "Conv1d",
            line!(),
        ),
        (
            x.reshape(&[1, 2, 3])
                .conv1d(&ones(&[1, 3, 1]), Default::default()),
            "Conv1d",
            line!(),
        ),
        (
            x.reshape(&[1, 2, 3])
                .conv1d(&ones(&[1, 2, 4]), Default::default()),
            "Conv1d",
            line!(),
        ),
        (
            x.reshape(&[1, 2, 3]).conv1d(
                &ones(&[2, 1, 1]),
                Conv1dOptions {
                    groups: 0,
                    ..Default::default()
                },
            ),
            "Conv1d",
            line!(),
        ),
        (
            image.conv_transpose2d(&ones(&[3, 1, 2, 2]), Default::default()),
            "ConvTranspose2d",
            line!(),
        ),
        (
            image.conv_transpose2d(
                &ones(&[4, 1, 2, 2]),
                ConvTranspose2dOptions {
                    groups: 3,
                    ..Default::default()
                },
            ),
            "ConvTranspose2d",
            line!(),
        ),
        (
            image.conv_transpose2d(
                &ones(&[4, 1, 2, 2]),
                ConvTranspose2dOptions {
                    stride: [2, 2],
                    output_padding: [2, 0],
                    ..Default::default()
                },
            ),
            "ConvTranspose2d",
            line!(),
        ),
        (
            image.conv_transpose2d(
                &ones(&[4, 1, 1, 1]),
                ConvTranspose2dOptions {
                    padding: [2, 2],
                    ..Default::default()
                },
            ),
            "ConvTranspose2d",
            line!(),
        ),
        (
            ones(&[1, 4, 0, 3]).conv_transpose2d(&ones(&[4, 1, 2, 2]), Default::default()),
            "ConvTranspose2d",
            line!(),
        ),
        (
            x.conv_transpose2d(&ones(&[4, 1, 2, 2]), Default::default()),
            "ConvTranspose2d",
            line!(),
        ),
    ];
    for (t, op, line) in cases {
        assert_fails(t, op, line);
    }
    // An input that already failed passes its own error on.
    let failed = x.sum(&[7], false);
    let err = failed.var(&[0], false, 1).check().unwrap_err();
    assert_eq!(err.op(), Some("Sum"), "{err}");
    let err = failed
        .reshape(&[1, 1, 2])
        .conv1d(&ones(&[1, 1, 1]), Default::default())
        .check()
        .unwrap_err();
    assert_eq!(err.op(), Some("Sum"), "{err}");
}

/// The documented answers at the edges: empty axes, `k = 0`, too few
/// elements for the correction, and std's gradient at zero variance.
#[test]
fn sorting_and_variance_edge_cases() {
    let cpu = Device::cpu();
    let empty = f32s(&[], &[0, 3]);
    let (v, i) = empty.sort(0, false);
    assert_eq!((v.dims(), i.dims()), (&[0, 3][..], &[0, 3][..]));
    let (v, i) = f32s(&[1.0, 2.0], &[2]).topk(0, 0, true, true);
    assert_eq!(v.to_vec().unwrap(), Vec::<f32>::new());
    assert_eq!(i.to_vec().unwrap(), Vec::<i64>::new());
    let (v, i) = empty.topk(0, 0, true, true);
    assert_eq!((v.dims(), i.dims()), (&[0, 3][..], &[0, 3][..]));
    // Zero elements: NaN, as a mean of nothing.
    let m = empty.var(&[0], false, 1).to_vec().unwrap();
    assert!(m.len() == 3 && m.iter().all(|v| v.is_nan()), "{m:?}");
    // n ≤ correction: infinity, or NaN where the values are constant.
    let two = f32s(&[1.0, 3.0, 2.0, 2.0], &[2, 2]);
    let v = two.var(&[1], false, 2).to_vec().unwrap();
    assert!(v[0] == f32::INFINITY && v[1].is_nan(), "{v:?}");
    // The gradient of std where the variance is 0 is NaN.
    let constant = Tensor::<f64>::full(&[3], 2.0, &cpu);
    let g = stagecraft::grad(|x: &Tensor<f64>| x.std(&[], false, 1))(&constant);
    assert!(g.to_vec().unwrap().iter().all(|v| v.is_nan()));
    assert_eq!(constant.std(&[], false, 1).item().unwrap(), 0.0);
}

/// A broadcast value standing for more elements than memory holds is
/// refused when read back, not an abort (found by fuzzing).
#[test]
fn reading_back_a_huge_broadcast_value_is_an_error() {
    let huge = Tensor::<f32>::full(&[usize::MAX], 1.0, &Device::cpu());
    let err = huge.to_vec().unwrap_err();
    assert!(err.to_string().contains("does not fit in memory"), "{err}");
}

#[test]
fn a_huge_broadcast_value_in_a_lazy_trace_is_an_error() {
    let lazy = Device::lazy(&Device::cpu());
    let huge = Tensor::<f32>::full(&[usize::MAX], 1.0, &lazy);
    let line = line!() + 1;
    let y = &huge + 1.0;
    let err = y.to_vec().unwrap_err();
    assert_eq!(err.location().map(|l| l.line()), Some(line), "{err}");
    let big = Tensor::<f32>::full(&[1 << 40, 1 << 20], 2.0, &lazy);
    let err = (big * 3.0).sum(&[], false).item().unwrap_err();
    assert!(err.op().is_some(), "{err}");
}

/// Empty tensors may carry a huge dimension beside their zero one: shape
/// rules and kernels must not overflow on it.
#[test]
fn empty_tensors_with_a_huge_dimension_do_not_overflow() {
    for d in [Device::cpu(), Device::lazy(&Device::cpu())] {
        let empty = Tensor::<f32>::zeros(&[usize::MAX, 0], &d);
        let line = line!() + 1;
        let err = Tensor::concat(&[&empty, &empty], 0).to_vec().unwrap_err();
        assert_eq!(err.op(), Some("Concat"), "{err}");
        assert_eq!(err.location().map(|l| l.line()), Some(line), "{err}");
        let wide = Tensor::<f32>::zeros(&[0, usize::MAX, 2], &d);
        for s in [wide.softmax(1), wide.log_softmax(1)] {
            assert_eq!(s.to_vec().unwrap(), Vec::<f32>::new());
            assert_eq!(s.dims(), &[0, usize::MAX, 2]);
        }
    }
}

/// Found by fuzzing with `usize::MAX` in shapes that do not overflow: an
/// empty tensor's dimensions may multiply past `usize::MAX` before the zero
/// is reached, and kernels, shape rules, constant folding, fusion and the
/// buffer plan formed such products. Each case here panicked or gave a
/// wrong shape.
#[test]
fn empty_tensors_whose_other_dims_overflow_work_or_fail_cleanly() {
    for d in [Device::cpu(), Device::lazy(&Device::cpu())] {
        let x = Tensor::<f32>::zeros(&[usize::MAX, 2, 0], &d);
        // Every kept element of a reduction over no elements is the
        // identity (a mean is 0/0).
        let s = x.sum(&[0, 2], false);
        assert_eq!(s.to_vec().unwrap(), vec![0.0, 0.0]);
        let m = x.mean(&[2, 0], false).to_vec().unwrap();
        assert!(m.len() == 2 && m.iter().all(|v| v.is_nan()), "{m:?}");
        let kept = x.sum(&[0], false);
        assert_eq!(kept.dims(), &[2, 0]);
        assert_eq!(kept.to_vec().unwrap(), Vec::<f32>::new());
        // A fused chain (lazy) or a chain of kernels (eager).
        let y = ((&x * 2.0 + 1.0).exp() - &x).relu();
        assert_eq!(y.dims(), &[usize::MAX, 2, 0]);
        assert_eq!(y.to_vec().unwrap(), Vec::<f32>::new());
        // An empty batch lets the matrix dims be anything.
        let a = Tensor::<f32>::zeros(&[0, usize::MAX, 1], &d);
        let b = Tensor::<f32>::zeros(&[1, 1, 2], &d);
        let p = a.matmul(&b);
        assert_eq!(p.dims(), &[0, usize::MAX, 2]);
        assert_eq!(p.to_vec().unwrap(), Vec::<f32>::new());
        // Slicing an axis longer than i64 counts keeps all of it.
        let wide = Tensor::<f32>::zeros(&[usize::MAX, 0], &d);
        assert_eq!(wide.narrow(1, 0, 0).dims(), &[usize::MAX, 0]);
        let all = wide.slice(&[0, 0], &[i64::MAX, i64::MAX], &[]);
        assert_eq!(all.dims(), &[usize::MAX, 0]);
        let line = line!() + 1;
        let err = wide.narrow(0, usize::MAX - 1, 1).check().unwrap_err();
        assert_eq!(err.op(), Some("Slice"), "{err}");
        assert_eq!(err.location().map(|l| l.line()), Some(line), "{err}");
        // A padded spatial size that overflows is an error of the op.
        let images = Tensor::<f32>::zeros(&[0, 1, usize::MAX, 3], &d);
        let w = Tensor::<f32>::zeros(&[1, 1, 1, 1], &d);
        let padded = Conv2dOptions {
            padding: [1, 1],
            ..Conv2dOptions::default()
        };
        let line = line!() + 1;
        let err = images.conv2d(&w, padded).check().unwrap_err();
        assert_eq!(err.op(), Some("Conv2d"), "{err}");
        assert_eq!(err.location().map(|l| l.line()), Some(line), "{err}");
        let out = images.conv2d(&w, Conv2dOptions::default());
        assert_eq!(out.dims(), &[0, 1, usize::MAX, 3]);
        assert_eq!(out.to_vec().unwrap(), Vec::<f32>::new());
    }
}

/// Bytes that are not bools (anything but 0 and 1) never become `bool`
/// values through the layers' public API: reading one would be undefined
/// behaviour, so each entry point that turns bytes into typed values
/// checks them and names the caller's line.
#[test]
fn bytes_that_are_not_bools_are_refused_where_they_become_bools() {
    use stagecraft::layers::tensor::{Buffer, TensorMetadata};
    let bytes = Buffer::copy_of(&[1, 2, 0]);
    let line = line!() + 1;
    let err = bytes.typed::<bool>().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    assert!(err.message().contains("byte 1 holds 2"), "{err}");
    let loc = err.location().expect("location");
    assert!(
        loc.file().ends_with("bad_input.rs") && loc.line() == line,
        "{err}"
    );
    let mut unique = Buffer::copy_of(&[2]);
    assert!(
        unique.typed_mut::<bool>().is_err(),
        "a &mut [bool] is readable"
    );
    // Other element types take any bytes.
    assert_eq!(bytes.len(), 3);
    assert!(Buffer::copy_of(&[2, 0, 0, 0]).typed::<i32>().unwrap() == [2]);

    let meta = TensorMetadata::new(DType::Bool, [3]);
    let line = line!() + 1;
    let err = DenseHostTensor::from_buffer(meta.clone(), bytes).unwrap_err();
    assert_eq!(err.op(), Some("DenseHostTensor::from_buffer"), "{err}");
    assert!(err.message().contains("not a bool"), "{err}");
    assert_eq!(err.location().map(|l| l.line()), Some(line), "{err}");
    // The same bytes relabelled from another dtype are refused too.
    let int = DenseHostTensor::from_slice(&[0x0201_0001i32], [1]).unwrap();
    let relabelled = int.into_relabelled(TensorMetadata::new(DType::Bool, [4]));
    assert!(relabelled.is_err());

    // Valid bytes make a tensor the typed API reads as usual.
    let ok = DenseHostTensor::from_buffer(meta, Buffer::copy_of(&[1, 0, 1])).unwrap();
    let handle = TensorHandle::available(Device::cpu(), ok.into());
    let t = Tensor::<bool>::try_from_handle(handle).unwrap();
    assert_eq!(t.not().to_vec().unwrap(), vec![false, true, false]);
}

/// `embedding`, `layer_norm`, `rms_norm` and `cross_entropy`: shape,
/// attribute and dtype errors name the op and the line; out-of-range ids
/// and targets are `Index` errors of the kernel, also on the lazy device;
/// empty inputs give the documented answers.
#[test]
fn transformer_op_errors_and_edge_cases() {
    use stagecraft::{CrossEntropyOptions, Reduction};
    let cpu = Device::cpu();
    let x = f32s(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
    let w2 = f32s(&[1.0, 1.0], &[2]);
    let one = Tensor::<f32>::scalar(1.0, &cpu);
    let ids = Tensor::<i64>::from_vec(vec![0, 1], &[2], &cpu).unwrap();
    let t3 = Tensor::<i64>::from_vec(vec![0, 1, 2], &[3], &cpu).unwrap();
    let mean = CrossEntropyOptions::default();
    let cases: Vec<(Tensor<f32>, &str, u32)> = vec![
        // Parameters of the wrong size; a bad eps; no axis to normalize.
        (x.layer_norm(Some(&w2), None, 1e-5), "LayerNorm", line!()),
        (x.layer_norm(None, Some(&w2), 1e-5), "LayerNorm", line!()),
        (x.layer_norm(None, None, -1.0), "LayerNorm", line!()),
        (x.layer_norm(None, None, f64::NAN), "LayerNorm", line!()),
        (one.layer_norm(None, None, 1e-5), "LayerNorm", line!()),
        (x.rms_norm(Some(&w2), 1e-5), "RmsNorm", line!()),
        (x.rms_norm(Some(&x), 1e-5), "RmsNorm", line!()),
        (x.rms_norm(None, f64::INFINITY), "RmsNorm", line!()),
        (one.rms_norm(None, 1e-5), "RmsNorm", line!()),
        // Targets not shaped like the logits without their class axis.
        (x.cross_entropy(&t3, mean), "CrossEntropy", line!()),
        (
            x.cross_entropy(&ids.reshape(&[2, 1]), mean),
            "CrossEntropy",
            line!(),
        ),
        (
            one.cross_entropy(&Tensor::<i64>::scalar(0, &cpu), mean),
            "CrossEntropy",
            line!(),
        ),
        // A table that is not [V, D].
        (w2.embedding(&ids), "Embedding", line!()),
        (x.reshape(&[1, 2, 3]).embedding(&ids), "Embedding", line!()),
    ];
    for (t, op, line) in cases {
        assert_fails(t, op, line);
    }
    // Out-of-range ids (x has 2 rows) and targets (3 classes), the
    // ignored value aside: errors of the kernel, eagerly and lazily.
    for d in [cpu, Device::lazy(&cpu)] {
        let x = Tensor::<f32>::from_vec(vec![0.5; 6], &[2, 3], &d).unwrap();
        let far = Tensor::<i32>::from_vec(vec![0, 2], &[2], &d).unwrap();
        let negative = Tensor::<i64>::from_vec(vec![-1], &[1], &d).unwrap();
        let ignored = CrossEntropyOptions {
            ignore_index: Some(-1),
            reduction: Reduction::Sum,
        };
        let past = Tensor::<i64>::from_vec(vec![0, 3], &[2], &d).unwrap();
        let other = Tensor::<i64>::from_vec(vec![-100, -1], &[2], &d).unwrap();
        let cases: Vec<(Tensor<f32>, &str, u32)> = vec![
            (x.embedding(&far), "Embedding", line!()),
            (x.embedding(&negative), "Embedding", line!()),
            (x.cross_entropy(&past, mean), "CrossEntropy", line!()),
            (x.cross_entropy(&other, ignored), "CrossEntropy", line!()),
        ];
        for (t, op, line) in cases {
            let err = t.to_vec().unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Index, "{err}");
            assert_eq!(err.op(), Some(op), "{err}");
            let at = err.location().expect("location").line();
            assert!(at <= line && at + 10 >= line, "{err}");
        }
        // The ignored value is no error: row 1 is ignored, row 0 counts.
        let fine = Tensor::<i64>::from_vec(vec![2, -1], &[2], &d).unwrap();
        let loss = x.cross_entropy(&fine, ignored).item().unwrap();
        assert!((loss - 3f32.ln()).abs() < 1e-6, "{loss}");
    }
    // An input that already holds an error passes it on unchanged.
    let bad = x.reshape(&[7]);
    for t in [
        bad.layer_norm(None, None, 1e-5),
        bad.rms_norm(None, 1e-5),
        bad.embedding(&ids),
        bad.cross_entropy(&ids, mean),
        x.layer_norm(Some(&bad), None, 1e-5),
    ] {
        assert_eq!(t.check().unwrap_err().op(), Some("Reshape"));
    }
    // Empty inputs: no rows give empty results (a mean over no rows is
    // NaN, a sum 0); rows of no elements have NaN statistics but an empty
    // result; a table lookup by no ids is empty.
    let no_rows = f32s(&[], &[0, 4]);
    let none = Tensor::<i64>::from_vec(vec![], &[0], &cpu).unwrap();
    assert_eq!(no_rows.layer_norm(None, None, 1e-5).dims(), &[0, 4]);
    assert_eq!(
        no_rows.rms_norm(None, 1e-5).to_vec().unwrap(),
        Vec::<f32>::new()
    );
    assert!(no_rows.cross_entropy(&none, mean).item().unwrap().is_nan());
    let sum = CrossEntropyOptions {
        reduction: Reduction::Sum,
        ..Default::default()
    };
    assert_eq!(no_rows.cross_entropy(&none, sum).item().unwrap(), 0.0);
    let empty_rows = f32s(&[], &[3, 0]);
    assert_eq!(empty_rows.layer_norm(None, None, 1e-5).dims(), &[3, 0]);
    assert_eq!(no_rows.embedding(&none).dims(), &[0, 4]);
    // A NaN in a row makes that row NaN and no other.
    let nan = f32s(&[1.0, f32::NAN, 2.0, 1.0, 2.0, 3.0], &[2, 3]);
    let y = nan.layer_norm(None, None, 1e-5).to_vec().unwrap();
    assert!(y[..3].iter().all(|v| v.is_nan()) && y[3..].iter().all(|v| v.is_finite()));
}

/// Below the typed API, the metadata functions refuse wrong dtypes and
/// parameter counts of the transformer ops.
#[test]
fn transformer_dtype_errors_through_the_untyped_runtime() {
    let cpu = Device::cpu();
    let handle = |t: DenseHostTensor| TensorHandle::available(cpu, t.into());
    let f = handle(DenseHostTensor::from_slice(&[1.0f32, 2.0], [1, 2]).unwrap());
    let w = handle(DenseHostTensor::from_slice(&[1.0f32, 2.0], [2]).unwrap());
    let i = handle(DenseHostTensor::from_slice(&[1i32, 0], [1, 2]).unwrap());
    let r = handle(DenseHostTensor::from_slice(&[0i32], [1]).unwrap());
    let loc = stagecraft::Location::caller();
    let check = |op: &'static ops::OpDef, args: Vec<TensorHandle>, attrs: &OpAttrs| {
        let out = rt::execute(op, cpu, loc, args.into_iter().collect(), attrs.into());
        let err = out[0].wait().unwrap_err();
        assert_eq!(err.op(), Some(op.name), "{err}");
        assert!(
            matches!(
                err.kind(),
                ErrorKind::DType | ErrorKind::Attribute | ErrorKind::InvalidArgument
            ),
            "{err}"
        );
    };
    let none = OpAttrs::new();
    let mut weighted = OpAttrs::new();
    weighted.set_bool("has_weight", true);
    check(&ops::LAYER_NORM, vec![i.clone()], &none);
    // A weight passed but not declared, declared but not passed.
    check(&ops::LAYER_NORM, vec![f.clone(), w.clone()], &none);
    check(&ops::RMS_NORM, vec![f.clone()], &weighted);
    check(&ops::EMBEDDING, vec![f.clone(), f.clone()], &none);
    check(&ops::EMBEDDING, vec![i.clone(), r.clone()], &none);
    check(&ops::CROSS_ENTROPY, vec![f.clone(), w.clone()], &none);
    check(&ops::CROSS_ENTROPY, vec![i.clone(), r.clone()], &none);
    let mut reduction = OpAttrs::new();
    reduction.set_str("reduction", "max");
    check(&ops::CROSS_ENTROPY, vec![f.clone(), r.clone()], &reduction);
    let mut two = OpAttrs::new();
    two.set_ints("ignore_index", &[-1, -2]);
    check(&ops::CROSS_ENTROPY, vec![f.clone(), r.clone()], &two);
}

/// Attention: wrong ranks, mismatched batch, head, feature and key sizes,
/// a NaN or infinite scale and integer inputs are errors naming the op and
/// the caller's line; zero-size dimensions give the empty or defined
/// result (zeros for rows without keys), eagerly and through gradients.
#[test]
fn attention_errors_and_zero_size_dimensions() {
    let cpu = Device::cpu();
    let t = |dims: &[usize]| Tensor::<f32>::ones(dims, &cpu);
    let (q, k, v) = (t(&[2, 3, 5, 8]), t(&[2, 3, 7, 8]), t(&[2, 3, 7, 4]));
    let cases: Vec<(Tensor<f32>, u32)> = vec![
        (
            t(&[5, 8]).scaled_dot_product_attention(&t(&[7, 8]), &t(&[7, 4]), false, None),
            line!(),
        ),
        (
            t(&[1, 2, 3, 5, 8]).scaled_dot_product_attention(
                &t(&[1, 2, 3, 7, 8]),
                &t(&[1, 2, 3, 7, 4]),
                false,
                None,
            ),
            line!(),
        ),
        (
            q.scaled_dot_product_attention(&t(&[3, 7, 8]), &t(&[3, 7, 4]), false, None),
            line!(),
        ),
        (
            q.scaled_dot_product_attention(&t(&[1, 3, 7, 8]), &v, false, None),
            line!(),
        ),
        (
            q.scaled_dot_product_attention(&t(&[2, 4, 7, 8]), &t(&[2, 4, 7, 4]), true, None),
            line!(),
        ),
        (
            q.scaled_dot_product_attention(&t(&[2, 3, 7, 6]), &v, false, None),
            line!(),
        ),
        (
            q.scaled_dot_product_attention(&k, &t(&[2, 3, 6, 4]), false, None),
            line!(),
        ),
        (
            q.scaled_dot_product_attention(&k, &v, false, Some(f64::NAN)),
            line!(),
        ),
        (
            q.scaled_dot_product_attention(&k, &v, true, Some(f64::INFINITY)),
            line!(),
        ),
        (
            stagecraft::scaled_dot_product_attention(&q, &k, &t(&[2, 3, 8, 4]), false, None),
            line!(),
        ),
        // The "bthd" layout: rank 4 only, and batch and heads (axes 0 and
        // 2) must agree.
        (
            t(&[2, 5, 8]).scaled_dot_product_attention_bthd(
                &t(&[2, 7, 8]),
                &t(&[2, 7, 4]),
                false,
                None,
            ),
            line!(),
        ),
        (
            t(&[2, 5, 3, 8]).scaled_dot_product_attention_bthd(
                &t(&[2, 7, 4, 8]),
                &t(&[2, 7, 4, 4]),
                true,
                None,
            ),
            line!(),
        ),
        (
            t(&[2, 5, 3, 8]).scaled_dot_product_attention_bthd(
                &t(&[2, 7, 3, 8]),
                &t(&[2, 6, 3, 4]),
                true,
                None,
            ),
            line!(),
        ),
    ];
    for (out, line) in cases {
        assert_fails(out, "ScaledDotProductAttention", line);
    }
    // An unknown layout, through the untyped runtime.
    let mut attrs = OpAttrs::new();
    attrs.set_str("layout", "bhdt");
    let args: Vec<_> = [&q, &k, &v].iter().map(|x| x.handle().clone()).collect();
    let out = rt::execute(
        &ops::SCALED_DOT_PRODUCT_ATTENTION,
        cpu,
        stagecraft::Location::caller(),
        args.into_iter().collect(),
        (&attrs).into(),
    );
    let err = out[0].wait().unwrap_err();
    assert_eq!(err.op(), Some("ScaledDotProductAttention"), "{err}");
    assert!(err.to_string().contains("layout must be"), "{err}");
    // An input that failed passes its error on, whatever the scale.
    let failed = t(&[2, 3]).reshape(&[4]);
    let out = failed.scaled_dot_product_attention(&k, &v, false, Some(f64::NAN));
    assert_eq!(out.check().unwrap_err().op(), Some("Reshape"));

    // Integer inputs, through the untyped runtime (the typed method takes
    // floats only).
    let ints = TensorHandle::available(
        cpu,
        DenseHostTensor::from_slice(&[1i32; 4], [1, 2, 2])
            .unwrap()
            .into(),
    );
    let loc = stagecraft::Location::caller();
    for op in [
        &ops::SCALED_DOT_PRODUCT_ATTENTION,
        &ops::SCALED_DOT_PRODUCT_ATTENTION_GRAD,
    ] {
        let args = vec![ints.clone(); op.inputs.len()];
        let out = rt::execute(
            op,
            cpu,
            loc,
            args.into_iter().collect(),
            (&OpAttrs::new()).into(),
        );
        let err = out[0].wait().unwrap_err();
        assert_eq!(err.op(), Some(op.name), "{err}");
        assert_eq!(err.kind(), ErrorKind::DType, "{err}");
    }

    // Zero-size dimensions.
    let empty_batch = t(&[0, 3, 5, 8]).scaled_dot_product_attention(
        &t(&[0, 3, 7, 8]),
        &t(&[0, 3, 7, 4]),
        true,
        None,
    );
    assert_eq!(empty_batch.dims(), &[0, 3, 5, 4]);
    assert_eq!(empty_batch.to_vec().unwrap(), Vec::<f32>::new());
    let no_queries =
        t(&[2, 0, 8]).scaled_dot_product_attention(&t(&[2, 7, 8]), &t(&[2, 7, 4]), true, None);
    assert_eq!(no_queries.dims(), &[2, 0, 4]);
    assert_eq!(no_queries.to_vec().unwrap(), Vec::<f32>::new());
    let no_keys =
        t(&[2, 5, 8]).scaled_dot_product_attention(&t(&[2, 0, 8]), &t(&[2, 0, 4]), true, None);
    assert_eq!(no_keys.to_vec().unwrap(), vec![0.0; 40]);
    // No features: every score is 0, the output the mean of the values
    // a query sees.
    let values = f32s(&[2.0, 4.0, 9.0], &[1, 3, 1]);
    let no_features =
        t(&[1, 3, 0]).scaled_dot_product_attention(&t(&[1, 3, 0]), &values, true, None);
    assert_eq!(no_features.to_vec().unwrap(), vec![2.0, 3.0, 5.0]);
    let no_values =
        t(&[1, 3, 8]).scaled_dot_product_attention(&t(&[1, 4, 8]), &t(&[1, 4, 0]), false, None);
    assert_eq!(no_values.dims(), &[1, 3, 0]);
    // No features and no values: any number of keys, nothing to compute.
    let huge = Tensor::<f32>::zeros(&[1, usize::MAX, 0], &cpu);
    let out = t(&[1, 3, 0]).scaled_dot_product_attention(&huge, &huge, true, None);
    assert_eq!(out.dims(), &[1, 3, 0]);
    assert_eq!(out.to_vec().unwrap(), Vec::<f32>::new());
    // Gradients of zero-size cases are zero-size or zero.
    let q = t(&[2, 5, 8]).requires_grad();
    let k = t(&[2, 0, 8]).requires_grad();
    let v = t(&[2, 0, 4]).requires_grad();
    let grads = q
        .scaled_dot_product_attention(&k, &v, true, None)
        .sum(&[], false)
        .backward()
        .unwrap();
    assert_eq!(grads.get(&q).unwrap().to_vec().unwrap(), vec![0.0; 80]);
    assert_eq!(grads.get(&v).unwrap().dims(), &[2, 0, 4]);
    // The same in the "bthd" layout: no heads, no keys, no features.
    let no_heads = t(&[2, 5, 0, 8]).scaled_dot_product_attention_bthd(
        &t(&[2, 7, 0, 8]),
        &t(&[2, 7, 0, 4]),
        true,
        None,
    );
    assert_eq!(no_heads.dims(), &[2, 5, 0, 4]);
    assert_eq!(no_heads.to_vec().unwrap(), Vec::<f32>::new());
    let q = t(&[2, 5, 3, 8]).requires_grad();
    let k = t(&[2, 0, 3, 8]).requires_grad();
    let v = t(&[2, 0, 3, 4]).requires_grad();
    let o = q.scaled_dot_product_attention_bthd(&k, &v, true, None);
    assert_eq!(o.to_vec().unwrap(), vec![0.0; 120]);
    let grads = o.sum(&[], false).backward().unwrap();
    assert_eq!(grads.get(&q).unwrap().to_vec().unwrap(), vec![0.0; 240]);
    let values = f32s(&[2.0, 1.0, 4.0, 3.0, 9.0, 5.0], &[1, 3, 2, 1]);
    let no_features =
        t(&[1, 3, 2, 0]).scaled_dot_product_attention_bthd(&t(&[1, 3, 2, 0]), &values, true, None);
    assert_eq!(
        no_features.to_vec().unwrap(),
        vec![2.0, 1.0, 3.0, 2.0, 5.0, 3.0]
    );
}

/// Found by the op-call fuzzer: chunking an axis as long as a dimension
/// can be (an empty tensor's) into that many pieces asked for a vector of
/// `usize::MAX` tensors and aborted; it is an error of `Chunk` now.
#[test]
fn chunking_a_huge_axis_into_too_many_pieces_is_an_error() {
    let x = Tensor::<f32>::zeros(&[usize::MAX, 0], &Device::cpu());
    let line = line!() + 1;
    let parts = x.chunk(usize::MAX, 0);
    assert_eq!(parts.len(), 1);
    let err = parts[0].check().unwrap_err();
    assert_eq!(err.op(), Some("Chunk"), "{err}");
    assert_eq!(err.location().map(|l| l.line()), Some(line), "{err}");
    // One piece of it is the whole axis.
    let whole = x.chunk(1, 0);
    assert_eq!(whole.len(), 1);
    assert_eq!(whole[0].dims(), &[usize::MAX, 0]);
}
