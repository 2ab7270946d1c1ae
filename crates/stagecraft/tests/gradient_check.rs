//! Gradient checks against central finite differences, in f64.
//!
//! - **Every differentiable op.** The ops come from the registry
//!   (`ALL_OPS`, those whose `OpDef::grad` is set). Each has at least one
//!   case in [`cases`]; [`every_op_with_a_gradient_rule_is_checked`] fails
//!   when an op with a rule has no case (and is not in [`EXCLUDED`], which
//!   is empty: every rule is checked), and each case is traced once to
//!   prove that the op it is filed under really runs in it. Each case's
//!   gradient is computed three ways and compared with finite differences
//!   of the eager forward pass: the tape on the eager device, the tape on
//!   the lazy device (the same rules, traced and compiled), and through
//!   `stagecraft::function` (a `Call`, differentiated at the IR level by
//!   `stagecraft_graph::autodiff`, which runs each rule over an IR
//!   builder). All cases use f64: every differentiable op supports it,
//!   except that `Cast` necessarily goes through f32 (see its case).
//! - **Second order** for every op in the list above except the ones in
//!   [`NOT_SMOOTH`] (kinks or steps, where second derivatives are zero or
//!   undefined and say nothing about the rule): the gradient of each
//!   case's `f(x)²` is differentiated again and compared with finite
//!   differences of the gradient (squaring makes the gradient depend on
//!   `x` also for linear ops, so the ops their rule emits are
//!   differentiated too).
//! - **Random compositions** (proptest) of smooth ops, including `cond` on
//!   data-dependent predicates, `while` with data-dependent trip counts,
//!   and nested `function`s; first order through the eager tape and
//!   through `function`, and second order on a share of them. Cases whose
//!   predicates sit within 1e-3 of flipping are discarded, since a finite
//!   difference across a branch switch measures the jump, not the
//!   derivative.
//!
//! Inputs stay away from kinks: `relu`/`abs`/`sign` get |x| ≥ 0.3, and
//! `maximum`/`minimum`, `max`/`min` reductions and max pooling get inputs
//! whose competing values differ by at least 0.05, far above the step
//! `h = 1e-6`. Finite differences are central differences at `h` and `h/2`
//! combined by Richardson extrapolation (see [`numeric`]); the tolerance
//! is `1e-6 · (1 + |numeric|)` per element plus the size of the
//! extrapolation's correction (an estimate of the finite difference's own
//! error, about 1e-13 for the per-op cases). The rounding error of a
//! difference quotient is about `ε·|f|/h ≈ 1e-10·|f|`.

mod common;
use common::values;
use proptest::prelude::*;
use stagecraft::distributed;
use stagecraft::layers::graph::Function;
use stagecraft::layers::ops::{self as ops, OpAttrs};
use stagecraft::layers::runtime::{self as runtime, Args, TensorHandle};
use stagecraft::layers::tensor::{HostTensor, Scalar, TensorList};
use stagecraft::{
    cond, function, grad, where_, while_loop, Conv1dOptions, Conv2dOptions, ConvTranspose2dOptions,
    CrossEntropyOptions, CumsumOptions, Device, FloatElement, Location, Pool2dOptions, Reduction,
    Rng, Tensor,
};
use std::collections::BTreeSet;
use std::sync::Arc;

type T = Tensor<f64>;
/// A scalar function of one tensor, in f64 unless `E` says otherwise (the
/// cases are built in f64 for the CPU and in f32 for the GPU).
type F<E = f64> = Arc<dyn Fn(&Tensor<E>) -> Tensor<E> + Send + Sync>;

/// Ops with a gradient rule that have no finite-difference case, with the
/// reason. Empty: every rule is checked.
const EXCLUDED: &[(&str, &str)] = &[];

/// Ops checked to first order only, and why.
const NOT_SMOOTH: &[(&str, &str)] = &[
    ("Abs", "kink at 0: the second derivative is 0 away from it"),
    ("Relu", "kink at 0"),
    ("Sign", "a step: its derivative is 0 wherever it exists"),
    ("Floor", "a step: its derivative is 0 wherever it exists"),
    ("Ceil", "a step: its derivative is 0 wherever it exists"),
    ("Round", "a step: its derivative is 0 wherever it exists"),
    ("Maximum", "piecewise: selects one operand"),
    ("Minimum", "piecewise: selects one operand"),
    ("Max", "piecewise: selects one element"),
    ("Min", "piecewise: selects one element"),
    ("MaxPool2d", "piecewise: selects one element per window"),
    (
        "Cast",
        "through f32: a finite difference of the gradient is rounding noise",
    ),
    ("LogicalNot", "bool operands: no derivative to check"),
    ("LogicalAnd", "bool operands: no derivative to check"),
    ("LogicalOr", "bool operands: no derivative to check"),
];

fn cpu() -> Device {
    Device::cpu()
}

/// `v` in the element type `E` (rounded once, for f32).
fn num<E: FloatElement>(v: f64) -> E {
    E::from_scalar(Scalar::F64(v))
}

/// `v` in the element type `E`.
fn narrow<E: FloatElement>(v: Vec<f64>) -> Vec<E> {
    v.into_iter().map(num).collect()
}

/// A tensor of values in `[lo, hi)` on `d`.
fn tensor<E: FloatElement>(dims: &[usize], seed: u64, lo: f64, hi: f64, d: &Device) -> Tensor<E> {
    let n = dims.iter().product();
    Tensor::from_vec(narrow(values(n, seed, lo, hi)), dims, d).unwrap()
}

/// Distinct values in [-1, 1) whose pairwise gaps are at least 0.05 (a
/// shuffled grid with a small jitter), for ops that pick one element.
fn spread<E: FloatElement>(dims: &[usize], seed: u64, d: &Device) -> Tensor<E> {
    let n: usize = dims.iter().product();
    let jitter = values(n, seed, 0.0, 0.02);
    let mut order: Vec<usize> = (0..n).collect();
    let keys = values(n, seed ^ 0xabcd, 0.0, 1.0);
    order.sort_by(|&a, &b| keys[a].total_cmp(&keys[b]));
    let step = 2.0 / n as f64;
    let v = (0..n)
        .map(|i| -1.0 + step * order[i] as f64 + jitter[i].min(step - 0.05).max(0.0))
        .collect();
    Tensor::from_vec(narrow(v), dims, d).unwrap()
}

/// Values with |x| in [0.3, 1), alternating in sign.
fn away_from_zero<E: FloatElement>(dims: &[usize], seed: u64, d: &Device) -> Tensor<E> {
    let n: usize = dims.iter().product();
    let v = values(n, seed, 0.3, 1.0)
        .into_iter()
        .enumerate()
        .map(|(i, v)| if i % 2 == 0 { v } else { -v })
        .collect();
    Tensor::from_vec(narrow(v), dims, d).unwrap()
}

/// `Σ w·y` with fixed weights, so every element's gradient differs.
fn weighted<E: FloatElement>(y: Tensor<E>) -> Tensor<E> {
    let w = tensor(y.dims(), 99, 0.5, 1.5, &y.device());
    (y * w).sum(&[], false)
}

/// The same values on `d`.
fn on<E: FloatElement>(x: &Tensor<E>, d: &Device) -> Tensor<E> {
    Tensor::from_vec(x.to_vec().unwrap(), x.dims(), d).unwrap()
}

/// A finite-difference derivative and a bound on its own error.
#[derive(Clone, Copy, Debug)]
struct Fd {
    value: f64,
    error: f64,
}

/// Central differences of the scalar `f` at `x` with steps `h` and `h/2`,
/// combined by Richardson extrapolation (`(4 D(h/2) - D(h)) / 3`, whose
/// truncation error is O(h⁴) instead of O(h²)). The size of that
/// correction bounds the error of the less accurate estimate it corrects,
/// so it is kept as the estimate's error: tiny for moderate curvature, but
/// large where a random composition makes the function oscillate fast
/// (`sin` of a large argument), where a plain central difference is off
/// by more than the tolerance. The error also counts rounding: `f`'s own
/// values carry a relative error (up to [`EVAL_NOISE`] for a deep
/// composition) that a difference divides by the step.
fn numeric(f: &dyn Fn(&T) -> T, x: &T, h: f64) -> Vec<Fd> {
    let base = x.to_vec().unwrap();
    (0..base.len())
        .map(|i| {
            let at = |d: f64| {
                let mut v = base.clone();
                v[i] += d;
                f(&Tensor::from_vec(v, x.dims(), &cpu()).unwrap())
                    .item()
                    .unwrap()
            };
            let mut largest = 0.0f64;
            let mut central = |h: f64| {
                let (up, down) = (at(h), at(-h));
                largest = largest.max(up.abs()).max(down.abs());
                (up - down) / (2.0 * h)
            };
            let (coarse, fine) = (central(h), central(h / 2.0));
            let correction = (fine - coarse) / 3.0;
            // A central difference with step s is off by up to
            // noise·|f|/s; the extrapolation weighs D(h/2) by 4/3 and
            // D(h) by 1/3: (4/3)·2/h + (1/3)·1/h = 3/h.
            let rounding = 3.0 * EVAL_NOISE * largest / h;
            Fd {
                value: fine + correction,
                error: correction.abs() + rounding,
            }
        })
        .collect()
}

/// The relative error assumed of a function's value (about 225 f64 ulp):
/// a second derivative's finite difference, `pow` through a Gram matrix
/// (`PowSelf, Gram, PowSelf, cos, square` at seed 960; value 27.8),
/// had about 2e-14 (implied by its difference at `h = 1e-6` being 1.6e-6
/// off, 7 % past a tolerance that counted truncation only, while the
/// difference at `h = 1e-4` agreed with the analytic value to 1e-8).
const EVAL_NOISE: f64 = 5e-14;

/// `|analytic - numeric| ≤ 1e-6 (1 + |numeric|) + the estimate's error`.
fn assert_close(what: &str, analytic: &[f64], numeric: &[Fd]) {
    assert_eq!(analytic.len(), numeric.len(), "{what}");
    for (i, (a, n)) in analytic.iter().zip(numeric).enumerate() {
        let tol = 1e-6 * (1.0 + n.value.abs()) + n.error;
        assert!(
            (a - n.value).abs() <= tol,
            "{what}: d/dx[{i}] analytic {a} vs numeric {} (± {})",
            n.value,
            n.error
        );
    }
}

/// One finite-difference case: the op it is filed under, a scalar
/// function and the point.
struct Case<E: FloatElement = f64> {
    op: &'static str,
    name: String,
    f: F<E>,
    x: Tensor<E>,
    /// The finite-difference step.
    h: f64,
}

fn case<E: FloatElement>(
    op: &'static str,
    name: &str,
    x: Tensor<E>,
    f: impl Fn(&Tensor<E>) -> Tensor<E> + Send + Sync + 'static,
) -> Case<E> {
    Case {
        op,
        name: name.to_string(),
        f: Arc::new(f),
        x,
        h: 1e-6,
    }
}

/// Lists pushed and popped inside a traced function (they are not a
/// user-facing type): `x·x` and `sin x` go onto an empty list, come back
/// in reverse order, and are combined.
fn through_a_list<E: FloatElement>(x: &Tensor<E>) -> Tensor<E> {
    let location = Location::caller();
    let d = x.device();
    let run = |op: &'static ops::OpDef, args: Vec<TensorHandle>, attrs: &OpAttrs| {
        let args: Args = args.into_iter().collect();
        runtime::execute(op, d, location, args, attrs.into())
    };
    let empty = TensorHandle::available(
        d,
        HostTensor::filled(Scalar::F64(0.0), TensorList::metadata()),
    );
    let first = x * x;
    let second = x.sin();
    let none = OpAttrs::new();
    let list = run(&ops::LIST_PUSH, vec![empty, first.handle().clone()], &none)[0].clone();
    let list = run(&ops::LIST_PUSH, vec![list, second.handle().clone()], &none)[0].clone();
    let mut pop = OpAttrs::new();
    pop.set_dtype("item_dtype", E::DTYPE)
        .set_dims("item_shape", x.dims());
    let popped = run(&ops::LIST_POP, vec![list], &pop);
    let top = Tensor::<E>::try_from_handle(popped[1].clone()).unwrap();
    let popped = run(&ops::LIST_POP, vec![popped[0].clone()], &pop);
    let bottom = Tensor::<E>::try_from_handle(popped[1].clone()).unwrap();
    &top * num::<E>(2.0) + &bottom * &top
}

/// Every case, by op.
fn cases() -> Vec<Case> {
    cases_in()
}

/// Every case, by op, in the element type `E` (points on the CPU).
fn cases_in<E: FloatElement>() -> Vec<Case<E>> {
    let d = cpu();
    let mut out = Vec::new();
    let x23 = tensor(&[2, 3], 1, -1.5, 1.5, &d);
    let pos23 = tensor(&[2, 3], 2, 0.2, 1.5, &d);
    let away = away_from_zero(&[2, 3], 3, &d);
    // Unary math.
    // Inside (-1, 1), away from the arcsine's and arccosine's poles.
    let inner23 = tensor(&[2, 3], 5, -0.8, 0.8, &d);
    type Un<E> = fn(&Tensor<E>) -> Tensor<E>;
    let unary: [(&str, Un<E>, &Tensor<E>); 30] = [
        ("Neg", |x| -x, &x23),
        ("Abs", |x| x.abs(), &away),
        ("Exp", |x| x.exp(), &x23),
        ("Log", |x| x.log(), &pos23),
        ("Sqrt", |x| x.sqrt(), &pos23),
        ("Rsqrt", |x| x.rsqrt(), &pos23),
        ("Tanh", |x| x.tanh(), &x23),
        ("Sigmoid", |x| x.sigmoid(), &x23),
        ("Relu", |x| x.relu(), &away),
        ("Gelu", |x| x.gelu(), &x23),
        ("Sin", |x| x.sin(), &x23),
        ("Cos", |x| x.cos(), &x23),
        ("Asin", |x| x.asin(), &inner23),
        ("Acos", |x| x.acos(), &inner23),
        ("Atan", |x| x.atan(), &x23),
        // The rule gives no gradient: d(sign(x)·x) = sign(x).
        ("Sign", |x| x.sign() * x, &away),
        ("Print", |x| x.print("gradient_check"), &x23),
        // Steps: no gradient through them, d(floor(x)·x) = floor(x).
        ("Floor", |x| x.floor() * x, &away),
        ("Ceil", |x| x.ceil() * x, &away),
        ("Round", |x| x.round() * x, &away),
        ("Erf", |x| x.erf(), &x23),
        ("GeluTanh", |x| x.gelu_tanh(), &x23),
        ("Silu", |x| x.silu(), &x23),
        ("Softplus", |x| x.softplus(), &x23),
        ("Log1p", |x| x.log1p(), &pos23),
        ("Expm1", |x| x.expm1(), &x23),
        ("Reciprocal", |x| x.reciprocal(), &pos23),
        ("Square", |x| x.square(), &x23),
        // Composites of table ops, away from their kinks.
        ("Maximum", |x| x.leaky_relu(0.1), &away),
        ("Minimum", |x| x.elu(0.7), &away),
    ];
    for (op, f, x) in unary {
        out.push(case(op, op, x.clone(), move |x| weighted(f(x))));
    }
    // Gelu at exactly 0 takes the rule's special case.
    let with_zero = Tensor::from_vec(narrow(vec![0.0, 0.5, -0.5, 1.0]), &[4], &d).unwrap();
    out.push(case("Gelu", "Gelu at 0", with_zero, |x| weighted(x.gelu())));
    // GELU's gradient factor, given GELU's output as its second operand:
    // its rule sends the whole derivative to x.
    out.push(case("GeluDerivative", "GeluDerivative", x23.clone(), |x| {
        weighted(x.apply_binary(stagecraft::BinaryOp::GeluDerivative, &x.gelu()))
    }));
    // A recorded GELU runs as GeluWithDerivative (its first output feeds
    // the "Gelu" cases' gradients); GELU's gradient reads the second
    // output, so differentiating that gradient checks its rule.
    out.push(case(
        "GeluWithDerivative",
        "GELU's gradient",
        x23.clone(),
        |x| weighted(grad(|x: &Tensor<E>| x.gelu().sum(&[], false))(x)),
    ));

    // Broadcasting binary ops, both operands, against a row and a column.
    type Bin<E> = fn(&Tensor<E>, &Tensor<E>) -> Tensor<E>;
    let binary: [(&str, Bin<E>); 7] = [
        ("Add", |a, b| a + b),
        ("Sub", |a, b| a - b),
        ("Mul", |a, b| a * b),
        ("Div", |a, b| a / b),
        ("Pow", |a, b| a.pow(b)),
        ("Maximum", |a, b| a.maximum(b)),
        ("Minimum", |a, b| a.minimum(b)),
    ];
    for (op, f) in binary {
        for other in [&[3usize][..], &[2, 1]] {
            // Operands in [0.5, 1.0) and [1.2, 1.7) (or the reverse): no
            // ties for maximum/minimum, positive bases for pow.
            let x = tensor(&[2, 3], 4, 0.5, 1.0, &d);
            let flip = other.len() == 2;
            let (lo, hi) = if flip { (0.1, 0.4) } else { (1.2, 1.7) };
            let o = tensor(other, 5, lo, hi, &d);
            let oo = o.clone();
            out.push(case(
                op,
                &format!("{op} x, other {other:?}"),
                x.clone(),
                move |x| weighted(f(x, &on(&oo, &x.device()))),
            ));
            let xx = x.clone();
            out.push(case(op, &format!("{op} into {other:?}"), o, move |o| {
                weighted(f(&on(&xx, &o.device()), o))
            }));
        }
    }
    // Bool ops on the path of a select: their rules give no gradient, and
    // the gradient around them is still right.
    let mixed = away_from_zero(&[2, 3], 6, &d);
    out.push(case("LogicalNot", "not", mixed.clone(), |x| {
        weighted(where_(
            &x.gt(&Tensor::scalar(num(0.0), &x.device())).not(),
            x,
            &(x * x),
        ))
    }));
    out.push(case("LogicalAnd", "and", mixed.clone(), |x| {
        let z = Tensor::scalar(num(0.0), &x.device());
        let m = x.gt(&z).and(&x.lt(&Tensor::scalar(num(0.8), &x.device())));
        weighted(where_(&m, &x.sin(), &(x * num::<E>(3.0))))
    }));
    out.push(case("LogicalOr", "or", mixed.clone(), |x| {
        let m = x
            .lt(&Tensor::scalar(num(-0.5), &x.device()))
            .or(&x.gt(&Tensor::scalar(num(0.5), &x.device())));
        weighted(where_(&m, &x.exp(), &x.cos()))
    }));
    let other = tensor(&[3], 7, -1.0, 1.0, &d);
    out.push(case("Select", "where", x23.clone(), move |x| {
        let m =
            Tensor::<bool>::from_vec((0..6).map(|i| i % 3 != 1).collect(), &[2, 3], &x.device())
                .unwrap();
        weighted(where_(&m, x, &on(&other, &x.device())))
    }));
    // Cast goes through f32: inputs and step are exactly representable in
    // f32 (multiples of 2^-6, h = 2^-12 and 2^-13), so the differences are
    // exact; the gradient is the weights rounded to f32, within 6e-8.
    let grid = Tensor::from_vec(
        (0..6).map(|i| num((i as f64 - 2.5) / 64.0)).collect(),
        &[2, 3],
        &d,
    )
    .unwrap();
    let mut c = case("Cast", "f64 → f32 → f64", grid, |x| {
        weighted(x.cast::<f32>().cast::<E>())
    });
    c.h = 1.0 / 4096.0;
    out.push(c);

    // Reductions.
    let x234 = tensor(&[2, 3, 4], 8, -1.0, 1.0, &d);
    let s234 = spread(&[2, 3, 4], 9, &d);
    out.push(case("Sum", "sum all", x234.clone(), |x| {
        weighted(x.sum(&[], false))
    }));
    out.push(case("Sum", "sum axes keepdim", x234.clone(), |x| {
        weighted(x.sum(&[0, -1], true))
    }));
    out.push(case("Mean", "mean axis", x234.clone(), |x| {
        weighted(x.mean(&[1], false))
    }));
    out.push(case("Mean", "mean all keepdim", x234.clone(), |x| {
        weighted(x.mean(&[], true))
    }));
    out.push(case("Max", "max axis", s234.clone(), |x| {
        weighted(x.max(&[1], false))
    }));
    out.push(case("Max", "max all", s234.clone(), |x| {
        weighted(x.max(&[], false))
    }));
    out.push(case("Min", "min axes keepdim", s234.clone(), |x| {
        weighted(x.min(&[0, 2], true))
    }));
    out.push(case("Prod", "prod axis", pos23.clone(), |x| {
        weighted(x.prod(&[1], false))
    }));
    out.push(case("Prod", "prod all keepdim", pos23.clone(), |x| {
        weighted(x.prod(&[], true))
    }));
    out.push(case("Softmax", "softmax last", x234.clone(), |x| {
        weighted(x.softmax(-1))
    }));
    out.push(case("Softmax", "softmax middle", x234.clone(), |x| {
        weighted(x.softmax(1))
    }));
    out.push(case("LogSoftmax", "log_softmax last", x234.clone(), |x| {
        weighted(x.log_softmax(-1))
    }));
    out.push(case("LogSoftmax", "log_softmax first", x234.clone(), |x| {
        weighted(x.log_softmax(0))
    }));

    // Matmul: both operands, vectors and batches.
    let a = tensor(&[3, 4], 10, -1.0, 1.0, &d);
    let b = tensor(&[4, 2], 11, -1.0, 1.0, &d);
    let v = tensor(&[4], 12, -1.0, 1.0, &d);
    let batched = tensor(&[2, 3, 4], 13, -1.0, 1.0, &d);
    let bb = b.clone();
    out.push(case("MatMul", "matmul left", a.clone(), move |a| {
        weighted(a.matmul(&on(&bb, &a.device())))
    }));
    let aa = a.clone();
    out.push(case("MatMul", "matmul right", b.clone(), move |b| {
        weighted(on(&aa, &b.device()).matmul(b))
    }));
    let aa = a.clone();
    out.push(case("MatMul", "matrix @ vector", v.clone(), move |v| {
        weighted(on(&aa, &v.device()).matmul(v))
    }));
    let bb = b.clone();
    out.push(case("MatMul", "vector @ matrix", v.clone(), move |v| {
        weighted(v.matmul(&on(&bb, &v.device())))
    }));
    let bb = b.clone();
    out.push(case(
        "MatMul",
        "batched @ shared",
        batched.clone(),
        move |x| weighted(x.matmul(&on(&bb, &x.device()))),
    ));
    let bt = batched.clone();
    out.push(case("MatMul", "shared weight", b.clone(), move |w| {
        weighted(on(&bt, &w.device()).matmul(w))
    }));
    out.push(case("MatMul", "x @ xᵀ", a.clone(), |a| {
        weighted(a.matmul(&a.transpose(0, 1)))
    }));

    // Shape ops.
    out.push(case("Reshape", "reshape", x234.clone(), |x| {
        weighted(x.reshape(&[6, 4]).tanh())
    }));
    out.push(case("Transpose", "transpose", x234.clone(), |x| {
        weighted(x.transpose(0, 2))
    }));
    out.push(case("Transpose", "permute", x234.clone(), |x| {
        weighted(x.permute(&[1, 2, 0]))
    }));
    out.push(case(
        "BroadcastTo",
        "broadcast_to",
        tensor(&[3, 1], 14, -1.0, 1.0, &d),
        |x| weighted(x.broadcast_to(&[2, 3, 4])),
    ));
    let other = tensor(&[2, 2, 4], 15, -1.0, 1.0, &d);
    out.push(case("Concat", "concat, x twice", x234.clone(), move |x| {
        weighted(Tensor::concat(&[x, &on(&other, &x.device()), x], 1))
    }));
    out.push(case("Slice", "slice", x234.clone(), |x| {
        weighted(x.slice(&[0, 1, 0], &[2, 3, 4], &[1, 1, 1]))
    }));
    out.push(case("Slice", "strided slice", x234.clone(), |x| {
        weighted(x.slice(&[1, 0, 1], &[2, 3, 4], &[1, 2, 2]))
    }));
    out.push(case(
        "Gather",
        "gather, repeated indices",
        x234.clone(),
        |x| {
            let idx = Tensor::<i64>::from_vec(vec![2, 0, 2, 1], &[2, 2], &x.device()).unwrap();
            weighted(x.gather(1, &idx))
        },
    ));
    out.push(case("Pad", "pad", x234.clone(), |x| {
        weighted(x.pad(&[(1, 0), (0, 2), (1, 1)], 0.5))
    }));

    // The everyday shape and indexing ops: composites filed under the op
    // that carries their gradient, then the primitives.
    let other = tensor(&[2, 3, 4], 30, -1.0, 1.0, &d);
    out.push(case("Concat", "stack", x234.clone(), move |x| {
        weighted(Tensor::stack(&[x, &on(&other, &x.device()), x], 1))
    }));
    out.push(case("Slice", "split", x234.clone(), |x| {
        let parts = x.split(&[1, 3], -1);
        weighted(&parts[0] * &parts[1].sum(&[2], true))
    }));
    out.push(case("Slice", "chunk", x234.clone(), |x| {
        let parts = x.chunk(2, 1);
        weighted(Tensor::concat(&[&parts[1].exp(), &parts[0]], 1))
    }));
    out.push(case("Reshape", "flatten", x234.clone(), |x| {
        weighted(x.flatten(0, 1).tanh())
    }));
    out.push(case("BroadcastTo", "repeat", x234.clone(), |x| {
        weighted(x.repeat(&[2, 1, 3, 2]))
    }));
    out.push(case("BroadcastTo", "tile", x234.clone(), |x| {
        weighted(x.tile(&[2, 1]))
    }));
    out.push(case(
        "BroadcastTo",
        "expand",
        tensor(&[3, 1], 31, -1.0, 1.0, &d),
        |x| weighted(x.expand(&[2, -1, 4])),
    ));
    out.push(case("Cumsum", "cumsum", x234.clone(), |x| {
        weighted(x.cumsum(1))
    }));
    out.push(case(
        "Cumsum",
        "exclusive reverse cumsum",
        x234.clone(),
        |x| {
            let options = CumsumOptions {
                exclusive: true,
                reverse: true,
            };
            weighted(x.cumsum_with(-1, options))
        },
    ));
    out.push(case("Trilu", "tril", x234.clone(), |x| weighted(x.tril(0))));
    out.push(case(
        "Trilu",
        "triu below the diagonal",
        x234.clone(),
        |x| weighted(x.triu(-1)),
    ));
    // Repeated indices: the gradients of the picks add up.
    let pick = |dims: &[usize], values: &[i64], d: &Device| {
        Tensor::<i64>::from_vec(values.to_vec(), dims, d).unwrap()
    };
    out.push(case(
        "GatherElements",
        "take_along_axis, repeated indices",
        x234.clone(),
        move |x| {
            let idx = pick(
                &[2, 4, 2],
                &[2, 0, 2, 2, 1, -1, 0, 0, 1, 1, 2, 0, 0, 2, 1, 1],
                &x.device(),
            );
            weighted(x.take_along_axis(1, &idx))
        },
    ));
    let src = tensor(&[2, 2, 4], 32, -1.0, 1.0, &d);
    let scatter_idx = [0, 2, 2, 1, 2, 2, 0, -1, 1, 1, 1, 0, 0, 2, 1, 2];
    let ss = src.clone();
    out.push(case(
        "ScatterAdd",
        "scatter_add, by x",
        x234.clone(),
        move |x| {
            let idx = pick(&[2, 2, 4], &scatter_idx, &x.device());
            weighted(x.scatter_add(1, &idx, &on(&ss, &x.device())).tanh())
        },
    ));
    let base = x234.clone();
    out.push(case("ScatterAdd", "scatter_add, by src", src, move |s| {
        let idx = pick(&[2, 2, 4], &scatter_idx, &s.device());
        weighted(on(&base, &s.device()).scatter_add(1, &idx, s).tanh())
    }));
    let rows = tensor(&[2, 4, 4], 33, -1.0, 1.0, &d);
    let rr = rows.clone();
    out.push(case(
        "IndexAdd",
        "index_add, by x",
        x234.clone(),
        move |x| {
            let idx = pick(&[4], &[0, 2, 0, -1], &x.device());
            weighted(x.index_add(1, &idx, &on(&rr, &x.device())).tanh())
        },
    ));
    let base = x234.clone();
    out.push(case("IndexAdd", "index_add, by src", rows, move |s| {
        let idx = pick(&[4], &[0, 2, 0, -1], &s.device());
        weighted(on(&base, &s.device()).index_add(1, &idx, s).tanh())
    }));

    // Convolution and pooling.
    let img = tensor(&[2, 4, 6, 5], 16, -1.0, 1.0, &d);
    let filt = tensor(&[6, 2, 3, 2], 17, -0.5, 0.5, &d);
    let opts = Conv2dOptions {
        stride: [2, 1],
        padding: [1, 1],
        dilation: [1, 2],
        groups: 2,
    };
    let ff = filt.clone();
    out.push(case("Conv2d", "conv2d input", img.clone(), move |x| {
        weighted(x.conv2d(&on(&ff, &x.device()), opts))
    }));
    let ii = img.clone();
    out.push(case("Conv2d", "conv2d filter", filt.clone(), move |w| {
        weighted(on(&ii, &w.device()).conv2d(w, opts))
    }));
    let t_opts = ConvTranspose2dOptions {
        stride: [2, 1],
        padding: [1, 0],
        output_padding: [1, 0],
        dilation: [1, 2],
        groups: 2,
    };
    let t_img = tensor(&[2, 4, 3, 3], 28, -1.0, 1.0, &d);
    let t_filt = tensor(&[4, 2, 3, 2], 29, -0.5, 0.5, &d);
    let ff = t_filt.clone();
    out.push(case(
        "ConvTranspose2d",
        "conv_transpose2d input",
        t_img.clone(),
        move |x| weighted(x.conv_transpose2d(&on(&ff, &x.device()), t_opts)),
    ));
    let ii = t_img.clone();
    out.push(case(
        "ConvTranspose2d",
        "conv_transpose2d filter",
        t_filt.clone(),
        move |w| weighted(on(&ii, &w.device()).conv_transpose2d(w, t_opts)),
    ));
    let c1_opts = Conv1dOptions {
        stride: 2,
        padding: 1,
        dilation: 2,
        groups: 2,
    };
    let c1_filt = tensor(&[4, 2, 3], 30, -0.5, 0.5, &d);
    out.push(case(
        "Conv2d",
        "conv1d input",
        tensor(&[2, 4, 9], 31, -1.0, 1.0, &d),
        move |x| weighted(x.conv1d(&on(&c1_filt, &x.device()), c1_opts)),
    ));
    let pool = Pool2dOptions {
        kernel: [2, 3],
        stride: Some([2, 2]),
        padding: [1, 1],
    };
    out.push(case(
        "MaxPool2d",
        "max_pool2d",
        spread(&[1, 2, 6, 5], 18, &d),
        move |x| weighted(x.max_pool2d(pool)),
    ));
    out.push(case(
        "AvgPool2d",
        "avg_pool2d, pad counted",
        img.clone(),
        move |x| weighted(x.avg_pool2d(pool, true)),
    ));
    out.push(case(
        "AvgPool2d",
        "avg_pool2d, pad not counted",
        img.clone(),
        move |x| weighted(x.avg_pool2d(pool, false)),
    ));

    // The backward ops of convolution and average pooling have rules too
    // (second order through them): here the outer variable reaches both
    // operands of each through an inner gradient.
    let x0 = tensor(&[1, 4, 5, 4], 25, -1.0, 1.0, &d);
    let w0 = tensor(&[4, 2, 2, 3], 26, -0.5, 0.5, &d);
    let xx = x0.clone();
    out.push(case(
        "Conv2dBackpropInput",
        "∇ₓ Σ conv2d(x, w)², by w",
        w0.clone(),
        move |w| {
            let x = on(&xx, &w.device());
            let inner = |x: &Tensor<E>| {
                let y = x.conv2d(w, opts);
                (&y * &y).sum(&[], false)
            };
            weighted(grad(inner)(&x))
        },
    ));
    let ww = w0.clone();
    out.push(case(
        "Conv2dBackpropFilter",
        "∇_w Σ conv2d(x, w)², by x",
        x0.clone(),
        move |x| {
            let w = on(&ww, &x.device());
            let inner = |w: &Tensor<E>| {
                let y = x.conv2d(w, opts);
                (&y * &y).sum(&[], false)
            };
            weighted(grad(inner)(&w))
        },
    ));
    let z0 = tensor(&[1, 2, 6, 5], 27, -1.0, 1.0, &d);
    out.push(case(
        "AvgPool2dGrad",
        "∇_z Σ avg_pool(z) · avg_pool(x)², by x",
        z0.clone(),
        move |x| {
            let z = on(&z0, &x.device());
            let px = x.avg_pool2d(pool, false);
            let inner = |z: &Tensor<E>| (z.avg_pool2d(pool, false) * &px * &px).sum(&[], false);
            let g = grad(inner)(&z);
            weighted(g)
        },
    ));

    // Sorting: the values' gradient goes back through the permutation
    // (distinct values, so no tie sits within a step of flipping).
    out.push(case("Sort", "sort last, ascending", s234.clone(), |x| {
        weighted(x.sort(-1, false).0)
    }));
    out.push(case("Sort", "sort middle, descending", s234.clone(), |x| {
        weighted(x.sort(1, true).0)
    }));
    out.push(case("TopK", "topk largest, sorted", s234.clone(), |x| {
        weighted(x.topk(2, -1, true, true).0)
    }));
    out.push(case("TopK", "topk smallest, in place", s234.clone(), |x| {
        weighted(x.topk(2, 0, false, false).0)
    }));
    // The ops sorting's gradient is made of, reached through inner
    // gradients: ∇ Σ w·sort(x)³ runs ScatterAdd, and the gradient of a
    // weighted sum of that runs its adjoint GatherElements (a cube, so
    // that even this second gradient still depends on x).
    fn sort_energy<E: FloatElement>(x: &Tensor<E>) -> Tensor<E> {
        let v = x.sort(1, false).0;
        weighted(&v * &v * &v)
    }
    out.push(case(
        "ScatterAdd",
        "∇ₓ Σ w·sort(x)³",
        s234.clone(),
        |x| weighted(grad(sort_energy)(x)),
    ));
    out.push(case(
        "GatherElements",
        "∇ₓ Σ w·∇ₓ Σ w·sort(x)³",
        s234.clone(),
        |x| weighted(grad(|x: &Tensor<E>| weighted(grad(sort_energy)(x)))(x)),
    ));
    // Variance and standard deviation are composites of Mean, Sub, Mul,
    // Maximum and Sqrt: checked as wholes here.
    out.push(case(
        "Mean",
        "var axis keepdim, unbiased",
        x234.clone(),
        |x| weighted(x.var(&[1], true, 1)),
    ));
    out.push(case("Mean", "var all, population", x234.clone(), |x| {
        weighted(x.var(&[], false, 0))
    }));
    out.push(case("Sqrt", "std axes", x234.clone(), |x| {
        weighted(x.std(&[0, -1], false, 1))
    }));

    // Training ops. Each call draws the same mask: the stream restarts
    // from its seed.
    // Collectives in a group of one (their rules are what run; the
    // values across processes are checked under mpirun in tests/mpi.rs).
    for reduction in [
        distributed::Reduction::Sum,
        distributed::Reduction::Mean,
        distributed::Reduction::Max,
    ] {
        out.push(case(
            "AllReduce",
            &format!("all-reduce {}", reduction.name()),
            x234.clone(),
            move |x| weighted(distributed::all_reduce(&x.tanh(), reduction)),
        ));
        out.push(case(
            "ReduceScatter",
            &format!("reduce-scatter {}", reduction.name()),
            x234.clone(),
            move |x| weighted(distributed::reduce_scatter(&x.sin(), reduction)),
        ));
    }
    for reduction in [distributed::Reduction::Sum, distributed::Reduction::Mean] {
        out.push(case(
            "ReduceToRoot",
            &format!("reduce to root {}", reduction.name()),
            x234.clone(),
            move |x| weighted(distributed::reduce_to_root(&x.tanh(), reduction, 0)),
        ));
    }
    out.push(case("Broadcast", "broadcast from 0", x234.clone(), |x| {
        weighted(distributed::broadcast(&x.tanh(), 0))
    }));
    out.push(case("AllGather", "all-gather", x234.clone(), |x| {
        weighted(distributed::all_gather(&x.sin()))
    }));
    out.push(case("Dropout", "dropout p = 0.3", x234.clone(), |x| {
        weighted(x.dropout(0.3, &mut Rng::new(5)).tanh())
    }));
    out.push(case(
        "SquaredNorm",
        "squared norm of two tensors",
        x234.clone(),
        |x| {
            let y = x.tanh();
            Tensor::squared_norm(&[x, &y]).sin()
        },
    ));

    // Control flow and functions.
    let then_x = tensor(&[3], 20, 0.1, 1.0, &d);
    let else_x = tensor(&[3], 21, -1.0, -0.1, &d);
    let branchy = |x: &Tensor<E>| {
        let p = x
            .sum(&[0], false)
            .gt(&Tensor::scalar(num(0.0), &x.device()));
        weighted(cond(&p, || (x * x).tanh(), || x.sin() * num::<E>(3.0)))
    };
    out.push(case("If", "cond, then", then_x, branchy));
    out.push(case("If", "cond, else", else_x, branchy));
    out.push(case(
        "While",
        "while, data-dependent trips",
        tensor(&[3], 22, 0.5, 1.0, &d),
        |x| {
            let ten = Tensor::scalar(num(10.0), &x.device());
            let (y, _) = while_loop(
                (x.clone(), Tensor::<i64>::scalar(0, &x.device())),
                |(y, _)| y.sum(&[0], false).lt(&ten),
                |(y, i)| (&y * &y.sin().exp() + num::<E>(0.1), i + 1),
            );
            weighted(y)
        },
    ));
    let w = tensor(&[3], 23, 0.5, 0.9, &d);
    out.push(case(
        "While",
        "while, captured value",
        tensor(&[3], 24, 1.2, 1.5, &d),
        move |v| {
            let w = on(&w, &v.device());
            let limit = Tensor::scalar(num(10.0), &v.device());
            let y = while_loop(
                w,
                |y| y.sum(&[0], false).lt(&limit),
                |y| &y * v + num::<E>(0.2),
            );
            weighted(y)
        },
    ));
    out.push(case("Call", "function", pos23.clone(), |x| {
        let f = function(|x: Tensor<E>| (x.matmul(&x.transpose(0, 1)) + num::<E>(1.0)).log());
        weighted(f.call(x.clone()))
    }));
    out.push(case("ListPush", "list round trip", x23.clone(), |x| {
        let f = function(|x: Tensor<E>| through_a_list(&x));
        weighted(f.call(x.clone()))
    }));
    out.push(case("ListPop", "list round trip", x23.clone(), |x| {
        let f = function(|x: Tensor<E>| through_a_list(&x));
        weighted(f.call(x.clone()))
    }));

    // Transformer blocks, then their fused backward ops reached through
    // inner gradients (`Σ k·sin(y)`, so the inner gradient depends on
    // every input of the backward op): by x (the gradient of `dx` runs
    // into the forward statistics), by the weight (`dweight`'s), by the
    // bias (`dbias`'s).
    transformer_cases(&mut out);

    // Attention: the fused op by each operand (causal and not, a scale
    // given or the default, rank 4 and rank 3 with more queries than
    // keys), and its fused backward op reached through an inner gradient
    // (whose own rule, second order, is checked by differentiating that).
    let aq = tensor(&[1, 2, 3, 2], 40, -1.0, 1.0, &d);
    let ak = tensor(&[1, 2, 4, 2], 41, -1.0, 1.0, &d);
    let av = tensor(&[1, 2, 4, 3], 42, -1.0, 1.0, &d);
    let (k, v) = (ak.clone(), av.clone());
    out.push(case(
        "ScaledDotProductAttention",
        "attention by q, causal",
        aq.clone(),
        move |q| {
            let (k, v) = (on(&k, &q.device()), on(&v, &q.device()));
            weighted(q.scaled_dot_product_attention(&k, &v, true, None))
        },
    ));
    let (q, v) = (aq.clone(), av.clone());
    out.push(case(
        "ScaledDotProductAttention",
        "attention by k, scale 0.7",
        ak.clone(),
        move |k| {
            let (q, v) = (on(&q, &k.device()), on(&v, &k.device()));
            weighted(q.scaled_dot_product_attention(k, &v, false, Some(0.7)))
        },
    ));
    let (q3, k3) = (
        tensor(&[2, 5, 2], 43, -1.0, 1.0, &d),
        tensor(&[2, 3, 2], 44, -1.0, 1.0, &d),
    );
    out.push(case(
        "ScaledDotProductAttention",
        "attention by v, causal, rank 3, T > S",
        tensor(&[2, 3, 3], 45, -1.0, 1.0, &d),
        move |v| {
            let (q, k) = (on(&q3, &v.device()), on(&k3, &v.device()));
            weighted(q.scaled_dot_product_attention(&k, v, true, None))
        },
    ));
    let (q, v) = (aq.clone(), av.clone());
    out.push(case(
        "ScaledDotProductAttentionGrad",
        "∇_q Σ attention(q, k, v)², by k, causal",
        ak.clone(),
        move |k| {
            let (q, v) = (on(&q, &k.device()), on(&v, &k.device()));
            let inner = |q: &Tensor<E>| {
                let o = q.scaled_dot_product_attention(k, &v, true, None);
                (&o * &o).sum(&[], false)
            };
            let dq = grad(inner)(&q);
            weighted(dq)
        },
    ));
    // The "bthd" layout ([B, T, H, D], two heads whose rows interleave):
    // first order by q, and second order (its products transpose the
    // operands to "bhtd" and back) by v.
    let sq = tensor(&[2, 3, 2, 2], 46, -1.0, 1.0, &d);
    let sk = tensor(&[2, 4, 2, 2], 47, -1.0, 1.0, &d);
    let sv = tensor(&[2, 4, 2, 3], 48, -1.0, 1.0, &d);
    let (k, v) = (sk.clone(), sv.clone());
    out.push(case(
        "ScaledDotProductAttention",
        "attention by q, layout bthd, causal",
        sq.clone(),
        move |q| {
            let (k, v) = (on(&k, &q.device()), on(&v, &q.device()));
            weighted(q.scaled_dot_product_attention_bthd(&k, &v, true, None))
        },
    ));
    let (q, k) = (sq.clone(), sk.clone());
    out.push(case(
        "ScaledDotProductAttentionGrad",
        "∇_q Σ attention(q, k, v)², by v, layout bthd",
        sv.clone(),
        move |v| {
            let (q, k) = (on(&q, &v.device()), on(&k, &v.device()));
            let inner = |q: &Tensor<E>| {
                let o = q.scaled_dot_product_attention_bthd(&k, v, false, Some(0.8));
                (&o * &o).sum(&[], false)
            };
            let dq = grad(inner)(&q);
            weighted(dq)
        },
    ));
    out
}

/// The cases of `Embedding`, `LayerNorm`, `RmsNorm`, `CrossEntropy` and
/// their backward ops.
fn transformer_cases<E: FloatElement>(out: &mut Vec<Case<E>>) {
    let d = cpu();
    out.push(case(
        "Embedding",
        "embedding, repeated ids",
        tensor(&[5, 3], 50, -1.0, 1.0, &d),
        |t| {
            let ids = Tensor::<i64>::from_vec(vec![4, 0, 4, 2, 2, 4], &[2, 3], &t.device());
            weighted(t.embedding(&ids.unwrap()).tanh())
        },
    ));
    let x = tensor(&[2, 3, 5], 51, -1.0, 1.0, &d);
    let w = tensor(&[5], 52, 0.5, 1.5, &d);
    let b = tensor(&[5], 53, -0.5, 0.5, &d);
    type Norm<E> = fn(&Tensor<E>, Option<&Tensor<E>>, Option<&Tensor<E>>) -> Tensor<E>;
    let norms: [(&str, &str, Norm<E>); 2] = [
        ("LayerNorm", "LayerNormGrad", |x, w, b| {
            x.layer_norm(w, b, 1e-5)
        }),
        ("RmsNorm", "RmsNormGrad", |x, w, _| x.rms_norm(w, 1e-5)),
    ];
    for (op, backward, norm) in norms {
        let bias = op == "LayerNorm";
        let (ww, bb) = (w.clone(), b.clone());
        // With every parameter the op has, and with none.
        out.push(case(op, &format!("{op} by x"), x.clone(), move |x| {
            let (w, b) = (on(&ww, &x.device()), on(&bb, &x.device()));
            weighted(norm(x, Some(&w), bias.then_some(&b)))
        }));
        out.push(case(
            op,
            &format!("{op} by x, no parameters"),
            x.clone(),
            move |x| weighted(norm(x, None, None)),
        ));
        let (xx, bb) = (x.clone(), b.clone());
        out.push(case(op, &format!("{op} by weight"), w.clone(), move |w| {
            let (x, b) = (on(&xx, &w.device()), on(&bb, &w.device()));
            weighted(norm(&x, Some(w), bias.then_some(&b)))
        }));
        if bias {
            let (xx, ww) = (x.clone(), w.clone());
            out.push(case(op, &format!("{op} by bias"), b.clone(), move |b| {
                let (x, w) = (on(&xx, &b.device()), on(&ww, &b.device()));
                weighted(norm(&x, Some(&w), Some(b)))
            }));
        }
        let inner = move |x: &Tensor<E>, w: &Tensor<E>, b: &Tensor<E>| {
            weighted(norm(x, Some(w), bias.then_some(b)).sin())
        };
        let (ww, bb) = (w.clone(), b.clone());
        out.push(case(
            backward,
            &format!("∇ₓ Σ k·sin({op}(x)), by x"),
            x.clone(),
            move |x| {
                let (w, b) = (on(&ww, &x.device()), on(&bb, &x.device()));
                let g = grad(|x: &Tensor<E>| inner(x, &w, &b))(x);
                weighted(g)
            },
        ));
        let (xx, bb) = (x.clone(), b.clone());
        out.push(case(
            backward,
            &format!("∇_w Σ k·sin({op}(x, w)), by w"),
            w.clone(),
            move |w| {
                let (x, b) = (on(&xx, &w.device()), on(&bb, &w.device()));
                let g = grad(|w: &Tensor<E>| inner(&x, w, &b))(w);
                weighted(g)
            },
        ));
        if bias {
            let (xx, ww) = (x.clone(), w.clone());
            out.push(case(
                backward,
                &format!("∇_b Σ k·sin({op}(x, w, b)), by b"),
                b.clone(),
                move |b| {
                    let (x, w) = (on(&xx, &b.device()), on(&ww, &b.device()));
                    let g = grad(|b: &Tensor<E>| inner(&x, &w, b))(b);
                    weighted(g)
                },
            ));
        }
    }
    // Cross-entropy: logits spread over ±2 so no class dominates, targets
    // of rank 2 with an ignored row.
    let logits = tensor(&[2, 3, 4], 54, -2.0, 2.0, &d);
    let targets =
        |d: &Device| Tensor::<i32>::from_vec(vec![3, 0, -1, 2, 2, 1], &[2, 3], d).unwrap();
    for reduction in [Reduction::Mean, Reduction::Sum, Reduction::None] {
        let options = CrossEntropyOptions {
            ignore_index: Some(-1),
            reduction,
        };
        out.push(case(
            "CrossEntropy",
            &format!("cross_entropy, {reduction:?}"),
            logits.clone(),
            move |x| weighted(x.cross_entropy(&targets(&x.device()), options)),
        ));
        out.push(case(
            "CrossEntropyGrad",
            &format!("∇ₓ cross_entropy, {reduction:?}"),
            logits.clone(),
            move |x| {
                let loss =
                    |x: &Tensor<E>| weighted(x.cross_entropy(&targets(&x.device()), options));
                weighted(grad(loss)(x))
            },
        ));
    }
}

/// `f`'s gradient at `x`, through the tape on the device of `x`.
fn tape_gradient(f: &F, x: &T) -> Vec<f64> {
    let f = f.clone();
    grad(move |x: &T| f(x))(x).to_vec().unwrap()
}

/// `f`'s gradient at `x` through a staged function: the `Call`'s gradient
/// is built from the IR (the rules run over the graph builder).
fn function_gradient(f: &F, x: &T) -> Vec<f64> {
    let f = f.clone();
    let staged = Arc::new(function(move |x: T| f(&x)));
    grad(move |x: &T| staged.call(x.clone()))(x)
        .to_vec()
        .unwrap()
}

/// The text of `f` and of every library function it names.
fn printed_closure(f: &Function) -> String {
    let mut out = stagecraft::layers::graph::text::print(f);
    let mut seen = BTreeSet::new();
    let mut work: Vec<ops::FuncId> = f.nodes.iter().flat_map(|n| n.op.functions()).collect();
    while let Some(id) = work.pop() {
        if !seen.insert(id) {
            continue;
        }
        if let Some(g) = Function::lookup(id) {
            out.push_str(&stagecraft::layers::graph::text::print(&g));
            work.extend(g.nodes.iter().flat_map(|n| n.op.functions()));
        }
    }
    out
}

/// True when the graph of `f` at `x` (and the functions it calls) runs
/// `op`.
fn runs_op(f: &F, x: &T, op: &str) -> bool {
    let ff = f.clone();
    let staged = function(move |x: T| ff(&x));
    staged.call(x.clone()).wait().unwrap();
    let text = printed_closure(&staged.traced_function(x).unwrap());
    text.contains(&format!("= {op}(")) || text.contains(&format!("= {op}["))
}

fn differentiable_ops() -> BTreeSet<&'static str> {
    ops::ALL_OPS
        .iter()
        .filter(|op| op.grad.is_some())
        .map(|op| op.name)
        .collect()
}

#[test]
fn every_op_with_a_gradient_rule_is_checked() {
    let checked: BTreeSet<&str> = cases().iter().map(|c| c.op).collect();
    let excluded: BTreeSet<&str> = EXCLUDED.iter().map(|(op, _)| *op).collect();
    let rules = differentiable_ops();
    let missing: Vec<_> = rules
        .iter()
        .filter(|op| !checked.contains(*op) && !excluded.contains(*op))
        .collect();
    assert!(
        missing.is_empty(),
        "ops with a gradient rule but no finite-difference case: {missing:?}"
    );
    let stale: Vec<_> = checked
        .union(&excluded)
        .filter(|op| !rules.contains(*op))
        .collect();
    assert!(stale.is_empty(), "cases for ops without a rule: {stale:?}");
    // Every case runs the op it is filed under.
    for c in cases() {
        assert!(
            runs_op(&c.f, &c.x, c.op),
            "case {:?} does not run {}",
            c.name,
            c.op
        );
    }
    let not_smooth: BTreeSet<&str> = NOT_SMOOTH.iter().map(|(op, _)| *op).collect();
    assert!(not_smooth.is_subset(&rules), "{not_smooth:?}");
}

#[test]
fn first_order_eager_lazy_and_function_match_finite_differences() {
    let lazy = Device::lazy(&cpu());
    for c in cases() {
        let fd = numeric(&*c.f, &c.x, c.h);
        let what = |mode: &str| format!("{} ({}), {mode}", c.name, c.op);
        assert_close(&what("eager"), &tape_gradient(&c.f, &c.x), &fd);
        assert_close(&what("lazy"), &tape_gradient(&c.f, &on(&c.x, &lazy)), &fd);
        assert_close(&what("function"), &function_gradient(&c.f, &c.x), &fd);
    }
}

/// The gradient of `f(x)²` against finite differences of it: `2 f ∇f`
/// depends on `x` also where `f` is linear, so differentiating it again
/// differentiates the ops the rule emitted, and `∇²f` (weighted by `2 f`)
/// where it is not.
fn check_second_order(c: &Case) {
    let f = c.f.clone();
    let first: F = Arc::new(move |x: &T| {
        let f = f.clone();
        weighted(grad(move |x: &T| {
            let y = f(x);
            &y * &y
        })(x))
    });
    let fd = numeric(&*first, &c.x, 1e-6);
    assert_close(
        &format!("{} ({}), second order", c.name, c.op),
        &tape_gradient(&first, &c.x),
        &fd,
    );
}

#[test]
fn second_order_of_smooth_ops_matches_finite_differences_of_the_gradient() {
    let not_smooth: BTreeSet<&str> = NOT_SMOOTH.iter().map(|(op, _)| *op).collect();
    let mut checked = BTreeSet::new();
    for c in cases() {
        if !not_smooth.contains(c.op) {
            check_second_order(&c);
            checked.insert(c.op);
        }
    }
    let want: BTreeSet<&str> = differentiable_ops()
        .into_iter()
        .filter(|op| !not_smooth.contains(op))
        .collect();
    assert_eq!(checked, want);
}

/// Found by the second-order check: the second derivative of gelu at
/// exactly 0 was φ(0) instead of 2φ(0), because the rule took Φ(0) as a
/// constant 1/2 (fixed in `stagecraft-ops`: `1/2 + x φ(x)` there).
#[test]
fn regression_gelu_second_derivative_at_zero() {
    let x = Tensor::from_vec(vec![0.0, 0.25], &[2], &cpu()).unwrap();
    let dd = grad(|x: &T| grad(|x: &T| x.gelu().sum(&[], false))(x).sum(&[], false))(&x)
        .to_vec()
        .unwrap();
    let phi = |x: f64| (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
    // gelu'' = φ(x) (2 - x²)
    for (got, x) in dd.iter().zip([0.0, 0.25]) {
        let want = phi(x) * (2.0 - x * x);
        assert!(
            (got - want).abs() < 1e-12,
            "gelu''({x}) = {got}, want {want}"
        );
    }
}

/// A GELU recorded for a gradient keeps its derivative: the gradient
/// multiplies by `GeluWithDerivative`'s second output instead of running
/// `GeluDerivative` on `x` and `y` afterwards, and the value has plain
/// GELU's bits whether or not it is recorded (f32, whose derivative comes
/// from the same `erfc` as the value), on the eager and lazy devices.
#[test]
fn a_recorded_gelu_keeps_its_derivative() {
    let x = tensor(&[2, 3], 9, -4.0, 4.0, &cpu());
    let f = |x: &T| grad(|x: &T| x.gelu().sum(&[], false))(x);
    let staged = function(move |x: T| f(&x));
    staged.call(x.clone()).wait().unwrap();
    let text = printed_closure(&staged.traced_function(&x).unwrap());
    assert!(text.contains("= GeluWithDerivative("), "{text}");
    assert!(!text.contains("GeluDerivative("), "{text}");

    let points: Vec<f32> = (0..4001).map(|i| (i as f32 - 2000.0) / 200.0).collect();
    // The f64 forms, within 1e-14 of the exact values.
    let exact_derivative = |x: f64| ops::scalar::gelu_derivative(x, ops::scalar::gelu(x));
    for device in [cpu(), Device::lazy(&cpu())] {
        let x = Tensor::from_vec(points.clone(), &[points.len()], &device).unwrap();
        let plain = x.gelu().to_vec().unwrap();
        let (value, gradient) = stagecraft::value_and_grad(|x: &Tensor<f32>| {
            let y = x.gelu();
            let same: Vec<u32> = y.to_vec().unwrap().iter().map(|v| v.to_bits()).collect();
            let want: Vec<u32> = plain.iter().map(|v| v.to_bits()).collect();
            assert_eq!(same, want, "recorded gelu on {device:?}");
            y.sum(&[], false)
        })(&x);
        assert!(value.to_vec().unwrap()[0].is_finite());
        for (&p, &g) in points.iter().zip(&gradient.to_vec().unwrap()) {
            let want = exact_derivative(p as f64);
            // One rounding to f32 of a value within 4e-15 of the exact one,
            // measured against the size of its terms (they cancel at -0.75).
            let scale = want.abs().max(0.3);
            assert!(
                ((g as f64) - want).abs() <= scale * f32::EPSILON as f64,
                "gelu'({p}) = {g} on {device:?}, want {want}"
            );
        }
    }
}

/// Found by the second-order check: differentiating a gradient through
/// `conv2d` or `avg_pool2d` failed with "Conv2dBackpropInput has no
/// gradient rule" (the backward ops of convolution and average pooling now
/// have rules).
#[test]
fn regression_second_order_through_conv2d_and_avg_pool2d() {
    for c in cases() {
        if ["Conv2d", "AvgPool2d"].contains(&c.op) {
            check_second_order(&c);
        }
    }
}

/// Found by the finite-difference checks through `function`: a concrete
/// tensor of more than 16 elements made inside a staged function on
/// `x.device()` (the tracer) became a parameter whose handle lived on the
/// tracer device, and the `Call` failed with "an argument lives on trace
/// but the op runs on cpu:0" (fixed in `stagecraft-runtime`'s tracing: such
/// a tensor is a constant of the function).
#[test]
fn regression_a_large_tensor_made_inside_a_function_is_a_constant() {
    let x = tensor(&[4, 5], 40, -1.0, 1.0, &cpu());
    let f = |x: &T| x * &tensor(x.dims(), 41, -1.0, 1.0, &x.device());
    let staged = function(|x: T| f(&x));
    assert_eq!(
        staged.call(x.clone()).to_vec().unwrap(),
        f(&x).to_vec().unwrap()
    );
    let g = grad(|x: &T| weighted(staged.call(x.clone())))(&x);
    assert_eq!(
        g.to_vec().unwrap(),
        grad(|x: &T| weighted(f(x)))(&x).to_vec().unwrap()
    );
}

// ---------------------------------------------------------------------------
// Random compositions.

/// A smooth, shape-preserving step.
#[derive(Clone, Debug)]
enum Inner {
    /// Index into [`SMOOTH_UNARY`].
    Un(u8),
    /// `y · y`
    Square,
    /// `a · y + b`
    Affine(f64, f64),
    /// `y · w` for fixed weights `w` of `y`'s shape (seeded).
    MulW(u64),
    /// `y / (w² + 0.5)` for fixed weights.
    DivW(u64),
}

/// A step of a composition over one value `y`.
#[derive(Clone, Debug)]
enum Step {
    Inner(Inner),
    /// `(y² + 1) ^ tanh(y)`: both operands of `Pow` depend on `x`.
    PowSelf,
    /// Sum, mean or product (of `tanh(y) + 1.5`, so it stays moderate)
    /// over one axis.
    Reduce(u8, usize, bool),
    Softmax(usize),
    LogSoftmax(usize),
    /// `y @ W`, `W` fixed of shape `[last, 3]`.
    MatW(u64),
    /// `y @ yᵀ`
    Gram,
    Flatten,
    Transpose,
    /// `cond(sum(y) > threshold, then(y), else(y))`.
    Cond(f64, Vec<Inner>, Vec<Inner>),
    /// `i = 0; while i < trips && sum(y) < limit { y = body(y); i += 1 }`.
    While(i64, f64, Vec<Inner>),
    /// `stagecraft::function(body).call(y)`.
    Call(Vec<Inner>),
}

type Un = fn(&T) -> T;

const SMOOTH_UNARY: [Un; 10] = [
    |y| y.tanh(),
    |y| y.sin(),
    |y| y.cos(),
    |y| y.sigmoid(),
    |y| y.gelu(),
    |y| y.tanh().exp(),
    |y| (y * y + 1.0).log(),
    |y| (y * y + 1.0).sqrt(),
    |y| (y * y + 1.0).rsqrt(),
    |y| -y,
];

fn apply_inner(steps: &[Inner], y: T) -> T {
    steps.iter().fold(y, |y, s| match s {
        Inner::Un(i) => SMOOTH_UNARY[*i as usize % SMOOTH_UNARY.len()](&y),
        Inner::Square => &y * &y,
        Inner::Affine(a, b) => &y * *a + *b,
        Inner::MulW(seed) => {
            let w = tensor(y.dims(), *seed, -1.0, 1.0, &y.device());
            &y * &w
        }
        Inner::DivW(seed) => {
            let w = tensor(y.dims(), *seed, -1.0, 1.0, &y.device());
            &y / &(&w * &w + 0.5)
        }
    })
}

fn raw_inner() -> impl Strategy<Value = Inner> {
    prop_oneof![
        (0u8..10).prop_map(Inner::Un),
        Just(Inner::Square),
        (-1.5f64..1.5, -1.0f64..1.0).prop_map(|(a, b)| Inner::Affine(a, b)),
        (0u64..1000).prop_map(Inner::MulW),
        (0u64..1000).prop_map(Inner::DivW),
    ]
}

fn raw_step() -> impl Strategy<Value = Step> {
    let inners = || prop::collection::vec(raw_inner(), 1..4);
    prop_oneof![
        4 => raw_inner().prop_map(Step::Inner),
        1 => Just(Step::PowSelf),
        2 => (0u8..3, 0usize..3, any::<bool>()).prop_map(|(o, a, k)| Step::Reduce(o, a, k)),
        1 => (0usize..3).prop_map(Step::Softmax),
        1 => (0usize..3).prop_map(Step::LogSoftmax),
        1 => (0u64..1000).prop_map(Step::MatW),
        1 => Just(Step::Gram),
        1 => Just(Step::Flatten),
        1 => Just(Step::Transpose),
        2 => (-2.0f64..2.0, inners(), inners()).prop_map(|(t, a, b)| Step::Cond(t, a, b)),
        2 => (0i64..4, -2.0f64..6.0, inners()).prop_map(|(n, l, b)| Step::While(n, l, b)),
        1 => inners().prop_map(Step::Call),
    ]
}

/// Steps that do not fit the current rank become a `tanh`, so every
/// sequence of steps is a well-typed composition.
fn fits(step: &Step, dims: &[usize]) -> Option<Vec<usize>> {
    let rank = dims.len();
    match step {
        Step::Reduce(_, axis, keep) if rank > 0 => {
            let axis = axis % rank;
            let mut out = dims.to_vec();
            if *keep {
                out[axis] = 1;
            } else {
                out.remove(axis);
            }
            Some(out)
        }
        Step::Softmax(_) | Step::LogSoftmax(_) if rank > 0 => Some(dims.to_vec()),
        Step::MatW(_) if rank > 0 => {
            let mut out = dims[..rank - 1].to_vec();
            out.push(3);
            Some(out)
        }
        Step::Gram if rank == 2 => Some(vec![dims[0], dims[0]]),
        Step::Transpose if rank == 2 => Some(vec![dims[1], dims[0]]),
        Step::Flatten => Some(vec![dims.iter().product()]),
        Step::Inner(_) | Step::PowSelf | Step::Cond(..) | Step::While(..) | Step::Call(_) => {
            Some(dims.to_vec())
        }
        _ => None,
    }
}

fn composition() -> impl Strategy<Value = Vec<Step>> {
    prop::collection::vec(raw_step(), 1..7).prop_map(|steps| {
        let mut dims = vec![2, 3];
        steps
            .into_iter()
            .map(|s| match fits(&s, &dims) {
                Some(d) => {
                    dims = d;
                    s
                }
                None => Step::Inner(Inner::Un(0)),
            })
            .collect()
    })
}

/// Runs a composition on `x` and ends in a weighted sum of `tanh` (so the
/// loss stays moderate whatever the steps did). With `margins`, control
/// flow is plain Rust and every predicate's distance from flipping is
/// recorded; without, it is `cond` / `while_loop`.
fn compose(steps: &[Step], x: &T, mut margins: Option<&mut Vec<f64>>) -> T {
    let mut y = x.clone();
    for s in steps {
        let rank = y.rank();
        y = match s {
            Step::Inner(i) => apply_inner(std::slice::from_ref(i), y),
            Step::PowSelf => (&y * &y + 1.0).pow(&y.tanh()),
            Step::Reduce(op, axis, keep) => {
                let v = y.tanh() + 1.5;
                let axes = [(*axis % rank) as isize];
                match op {
                    0 => v.sum(&axes, *keep),
                    1 => v.mean(&axes, *keep),
                    _ => v.prod(&axes, *keep),
                }
            }
            Step::Softmax(axis) => y.softmax((*axis % rank) as isize),
            Step::LogSoftmax(axis) => y.log_softmax((*axis % rank) as isize),
            Step::MatW(seed) => {
                let w = tensor(
                    &[*y.dims().last().unwrap(), 3],
                    *seed,
                    -1.0,
                    1.0,
                    &y.device(),
                );
                y.matmul(&w)
            }
            Step::Gram => y.matmul(&y.transpose(0, 1)),
            Step::Flatten => y.reshape(&[y.numel()]),
            Step::Transpose => y.transpose(0, 1),
            Step::Cond(threshold, then_, else_) => {
                let s = y.sum(&[], false);
                let c = s.gt(&Tensor::scalar(*threshold, &y.device()));
                match margins.as_deref_mut() {
                    Some(m) => {
                        m.push((s.item().unwrap() - threshold).abs());
                        if c.item().unwrap() {
                            apply_inner(then_, y)
                        } else {
                            apply_inner(else_, y)
                        }
                    }
                    None => cond(
                        &c,
                        || apply_inner(then_, y.clone()),
                        || apply_inner(else_, y.clone()),
                    ),
                }
            }
            Step::While(trips, limit, body) => {
                let d = y.device();
                let go = |y: &T, i: &Tensor<i64>| {
                    i.lt(&Tensor::scalar(*trips, &d))
                        .and(&y.sum(&[], false).lt(&Tensor::scalar(*limit, &d)))
                };
                match margins.as_deref_mut() {
                    Some(m) => {
                        let mut i = 0;
                        while i < *trips {
                            let s = y.sum(&[], false).item().unwrap();
                            m.push((s - limit).abs());
                            if s >= *limit {
                                break;
                            }
                            y = apply_inner(body, y);
                            i += 1;
                        }
                        y
                    }
                    None => {
                        let (y, _) = while_loop(
                            (y, Tensor::<i64>::scalar(0, &d)),
                            |(y, i)| go(y, i),
                            |(y, i)| (apply_inner(body, y), i + 1),
                        );
                        y
                    }
                }
            }
            Step::Call(body) => {
                let body = body.clone();
                function(move |y: T| apply_inner(&body, y)).call(y)
            }
        };
    }
    weighted(y.tanh())
}

/// Checks a composition at a seeded point: first order (eager tape and
/// through `function`) and second order against finite differences.
/// Returns false, checking nothing, for points where a predicate is
/// within 1e-3 of flipping, the loss is not finite, or the function is so
/// ill-conditioned there that the finite differences cannot resolve it
/// (their own error estimate above 1e-4 relative).
fn check_composition(steps: &[Step], seed: u64) -> bool {
    let x = tensor(&[2, 3], seed, -1.0, 1.0, &cpu());
    let mut margins = Vec::new();
    let probe = compose(steps, &x, Some(&mut margins)).item().unwrap();
    // A finite difference across a branch switch measures the jump.
    if !probe.is_finite() || margins.iter().any(|&m| m <= 1e-3) {
        return false;
    }
    let s = steps.to_vec();
    let f: F = Arc::new(move |x: &T| compose(&s, x, None));
    // The staged and the plain-Rust control flow agree on the value.
    let value = f(&x).item().unwrap();
    assert!(
        (value - probe).abs() <= 1e-12 * (1.0 + value.abs()),
        "{value} vs {probe}"
    );
    let resolved = |fd: &[Fd]| fd.iter().all(|d| d.error <= 1e-4 * (1.0 + d.value.abs()));
    let fd = numeric(&*f, &x, 1e-6);
    if !resolved(&fd) {
        return false;
    }
    assert_close("composition, eager", &tape_gradient(&f, &x), &fd);
    assert_close("composition, function", &function_gradient(&f, &x), &fd);
    let ff = f.clone();
    let second: F = Arc::new(move |x: &T| {
        let ff = ff.clone();
        weighted(grad(move |x: &T| ff(x))(x))
    });
    let fd2 = numeric(&*second, &x, 1e-6);
    if !resolved(&fd2) {
        return false;
    }
    assert_close(
        "composition, second order",
        &tape_gradient(&second, &x),
        &fd2,
    );
    true
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]
    /// First order (eager tape and through `function`) and second order
    /// of random compositions against finite differences.
    #[test]
    fn random_compositions_match_finite_differences(
        steps in composition(),
        seed in 0u64..1000,
    ) {
        prop_assume!(check_composition(&steps, seed));
    }
}

/// Found by a long run of the composition test (7,777 cases passed
/// first): the loss oscillates fast (`sin` of a value grown by squaring in
/// a loop and by `pow`), gradients reach 1.8e3 and second derivatives
/// 8.4e8, and a plain central difference was off by 8e-3, past the
/// tolerance. Not a runtime bug: the finite differences now extrapolate
/// and carry their own error estimate (see [`numeric`]).
#[test]
fn regression_fast_oscillating_composition() {
    let steps = [
        Step::While(2, 4.911036789593805, vec![Inner::DivW(237), Inner::Square]),
        Step::PowSelf,
        Step::Call(vec![Inner::Un(1)]),
    ];
    assert!(check_composition(&steps, 594));
}

/// The composition whose second-order difference was off by rounding (see
/// [`EVAL_NOISE`]): the analytic second derivative is right.
#[test]
fn regression_second_order_difference_dominated_by_rounding() {
    let steps = [
        Step::PowSelf,
        Step::Gram,
        Step::PowSelf,
        Step::Inner(Inner::Un(2)),
        Step::Inner(Inner::Square),
    ];
    assert!(check_composition(&steps, 960));
}

// ---------------------------------------------------------------------------
// The GPU device.

/// Every case of [`cases`] once more in f32 on `gpu:0`, through the tape
/// on the eager GPU device and traced on `Device::lazy(&gpu0)`, against
/// the CPU's f64 gradient at the same point (the f32 point, so that the
/// input's rounding is no part of the error) rounded to f32. The error of
/// an element is `|gpu − cpu| / max(1, |cpu|)` (absolute below 1, relative
/// above, as in `tests/gpu.rs`), and each op's worst over its cases and
/// both modes must stay within its bound in [`on_the_gpu::BOUNDS`].
#[cfg(feature = "wgpu")]
mod on_the_gpu {
    use super::*;
    use std::collections::BTreeMap;

    /// One f32 ulp of 1: 2^−23.
    const ULP: f64 = f32::EPSILON as f64;

    /// Each op's bound, in units of [`ULP`] (2^−23 ≈ 1.19e−7): twice the
    /// worst error measured on lavapipe (in the comments, of eager and lazy
    /// together; `docs/accuracy.md`, "The GPU device"), rounded up to a
    /// power of two and at least 2 (an f32 result of a few roundings is
    /// that far from the rounded f64 one); 0 where the gradient is exact by
    /// construction (a copy, a selected or scattered weight, a weight times
    /// a sign or an integer) and was measured exact.
    const BOUNDS: &[(&str, u32)] = &[
        ("Abs", 0),                           // 0.00
        ("Acos", 2),                          // 0.85
        ("Add", 2),                           // 0.62
        ("AllGather", 2),                     // 0.79
        ("AllReduce", 8),                     // 2.50
        ("Asin", 2),                          // 0.85
        ("Atan", 2),                          // 1.00
        ("AvgPool2d", 2),                     // 0.50
        ("AvgPool2dGrad", 2),                 // 0.98
        ("Broadcast", 8),                     // 2.50
        ("BroadcastTo", 4),                   // 1.33
        ("Call", 2),                          // 0.98
        ("Cast", 0),                          // 0.00
        ("Ceil", 0),                          // 0.00
        ("Concat", 2),                        // 0.96
        ("Conv2d", 8),                        // 4.00
        ("Conv2dBackpropFilter", 8),          // 3.00
        ("Conv2dBackpropInput", 16),          // 7.50
        ("ConvTranspose2d", 8),               // 2.50
        ("Cos", 2),                           // 0.50
        ("CrossEntropy", 2),                  // 1.00
        ("CrossEntropyGrad", 4),              // 1.25
        ("Cumsum", 2),                        // 0.86
        ("Div", 2),                           // 0.83
        ("Dropout", 8),                       // 3.00
        ("Embedding", 4),                     // 1.70
        ("Erf", 2),                           // 0.82
        ("Exp", 4),                           // 2.00
        ("Expm1", 4),                         // 2.00
        ("Floor", 0),                         // 0.00
        ("Gather", 2),                        // 0.54
        ("GatherElements", 8),                // 2.09
        ("Gelu", 2),                          // 0.88
        ("GeluDerivative", 2),                // 1.00
        ("GeluTanh", 2),                      // 0.50
        ("GeluWithDerivative", 2),            // 1.00
        ("If", 4),                            // 1.11
        ("IndexAdd", 4),                      // 2.00
        ("LayerNorm", 16),                    // 7.59
        ("LayerNormGrad", 16),                // 8.00
        ("ListPop", 2),                       // 0.92
        ("ListPush", 2),                      // 0.92
        ("Log", 2),                           // 0.81
        ("Log1p", 2),                         // 0.50
        ("LogSoftmax", 8),                    // 2.75
        ("LogicalAnd", 2),                    // 0.98
        ("LogicalNot", 2),                    // 0.50
        ("LogicalOr", 2),                     // 0.56
        ("MatMul", 4),                        // 1.09
        ("Max", 0),                           // 0.00
        ("MaxPool2d", 2),                     // 0.99
        ("Maximum", 2),                       // 0.62
        ("Mean", 2),                          // 0.93
        ("Min", 0),                           // 0.00
        ("Minimum", 2),                       // 0.50
        ("Mul", 2),                           // 0.82
        ("Neg", 0),                           // 0.00
        ("Pad", 0),                           // 0.00
        ("Pow", 4),                           // 1.50
        ("Print", 0),                         // 0.00
        ("Prod", 2),                          // 0.68
        ("Reciprocal", 4),                    // 1.35
        ("ReduceScatter", 2),                 // 0.79
        ("ReduceToRoot", 8),                  // 2.50
        ("Relu", 0),                          // 0.00
        ("Reshape", 8),                       // 2.50
        ("RmsNorm", 8),                       // 2.29
        ("RmsNormGrad", 16),                  // 6.37
        ("Round", 0),                         // 0.00
        ("Rsqrt", 4),                         // 1.58
        ("ScaledDotProductAttention", 2),     // 0.73
        ("ScaledDotProductAttentionGrad", 2), // 0.75
        ("ScatterAdd", 4),                    // 2.00
        ("Select", 0),                        // 0.00
        ("Sigmoid", 2),                       // 0.25
        ("Sign", 0),                          // 0.00
        ("Silu", 2),                          // 0.50
        ("Sin", 2),                           // 0.81
        ("Slice", 4),                         // 1.37
        ("Softmax", 2),                       // 0.47
        ("Softplus", 2),                      // 0.50
        ("Sort", 0),                          // 0.00
        ("Sqrt", 2),                          // 0.50
        ("Square", 2),                        // 0.12
        ("SquaredNorm", 16),                  // 6.57
        ("Sub", 2),                           // 0.62
        ("Sum", 0),                           // 0.00
        ("Tanh", 2),                          // 1.00
        ("TopK", 0),                          // 0.00
        ("Transpose", 0),                     // 0.00
        ("Trilu", 0),                         // 0.00
        ("While", 8),                         // 2.64
    ];

    /// Ops left out of the comparison (their cases still run, and what
    /// they give is printed), with the failure. None now: list ops and the
    /// gradient of `while_loop` (which keeps each trip's values in a
    /// tensor list) failed on `gpu:0` until lists stayed in host memory
    /// there.
    const LEFT_OUT: &[(&str, &str)] = &[];

    /// The worst error of `got` against `want` (infinite for a NaN against
    /// a number).
    fn error(got: &[f32], want: &[f32]) -> f64 {
        assert_eq!(got.len(), want.len());
        got.iter()
            .zip(want)
            .map(|(&g, &w)| {
                if g == w || (g.is_nan() && w.is_nan()) {
                    0.0
                } else {
                    let e = ((g - w).abs() / w.abs().max(1.0)) as f64;
                    if e.is_nan() {
                        f64::INFINITY
                    } else {
                        e
                    }
                }
            })
            .fold(0.0, f64::max)
    }

    /// Each op's f32 gradient on the GPU, eager and lazy, is within its
    /// bound of the CPU's f64 gradient; the errors are printed.
    #[test]
    fn f32_gradients_on_the_gpu_match_the_cpus_f64_gradients() {
        let gpu = Device::try_gpu(0)
            .unwrap_or_else(|e| panic!("the GPU gradient check needs gpu:0: {e}"));
        let lazy_gpu = Device::lazy(&gpu);
        let (wide, narrow): (Vec<Case>, Vec<Case<f32>>) = (cases(), cases_in());
        assert_eq!(wide.len(), narrow.len());
        // Per op: the worst error of each mode, and the case it was in.
        let mut worst: BTreeMap<&str, [(f64, String); 2]> = BTreeMap::new();
        let mut failed: BTreeMap<&str, String> = BTreeMap::new();
        for (c64, c32) in wide.iter().zip(&narrow) {
            assert_eq!((c64.op, &c64.name), (c32.op, &c32.name));
            let at: Vec<f64> = c32.x.to_vec().unwrap().iter().map(|&v| v as f64).collect();
            let x64 = Tensor::from_vec(at, c32.x.dims(), &cpu()).unwrap();
            let want: Vec<f32> = tape_gradient(&c64.f, &x64)
                .iter()
                .map(|&v| v as f32)
                .collect();
            for (m, device) in [gpu, lazy_gpu].into_iter().enumerate() {
                let f = c32.f.clone();
                let got = grad(move |x: &Tensor<f32>| f(x))(&on(&c32.x, &device)).to_vec();
                let err = match got {
                    Ok(got) => error(&got, &want),
                    Err(e) => {
                        failed.insert(c32.op, format!("{} on {}: {e}", c32.name, device.name()));
                        f64::INFINITY
                    }
                };
                let slot = &mut worst.entry(c32.op).or_default()[m];
                if err > slot.0 || slot.1.is_empty() {
                    *slot = (err, c32.name.clone());
                }
            }
        }
        let bounds: BTreeMap<&str, u32> = BOUNDS.iter().copied().collect();
        let left_out: BTreeMap<&str, &str> = LEFT_OUT.iter().copied().collect();
        let mut failures = Vec::new();
        let adapter = stagecraft::layers::wgpu::Gpu::get(0).unwrap();
        println!(
            "worst error of each op's f32 gradient on gpu:0 ({}, {}) against the CPU's f64 \
             one (ulp = 2^-23; eager, lazy; bound):",
            adapter.adapter_name(),
            adapter.driver()
        );
        for (op, [(eager, eager_at), (lazy, lazy_at)]) in &worst {
            let bound = bounds.get(op).map(|&b| b as f64 * ULP);
            println!(
                "  {op:<30} {eager:.3e} ({:.2} ulp, {eager_at})  {lazy:.3e} ({:.2} ulp, {lazy_at})  \
                 bound {}",
                eager / ULP,
                lazy / ULP,
                bounds.get(op).map_or("none".into(), |b| format!("{b} ulp"))
            );
            if let Some(why) = left_out.get(op) {
                println!("    left out: {why}; now: {:?}", failed.get(op));
                continue;
            }
            match bound {
                Some(b) if eager.max(*lazy) <= b => {}
                Some(b) => failures.push(format!(
                    "{op}: {eager:e} (eager, {eager_at}), {lazy:e} (lazy, {lazy_at}) > {b:e}; {:?}",
                    failed.get(op)
                )),
                None => failures.push(format!("{op} has no bound")),
            }
        }
        let stale: Vec<_> = bounds
            .keys()
            .chain(left_out.keys())
            .filter(|op| !worst.contains_key(*op))
            .collect();
        assert!(stale.is_empty(), "bounds for ops without a case: {stale:?}");
        println!(
            "ops that ran on the CPU instead (copies): {:?}",
            stagecraft::layers::runtime::cpu_fallbacks()
        );
        assert!(failures.is_empty(), "{failures:#?}");
    }
}
