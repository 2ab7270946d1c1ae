//! `scaled_dot_product_attention` through the public API: against the f64
//! reference (values and gradients) over shapes that are not multiples of
//! the kernel's blocks, eager, lazy and `function` giving the same bits,
//! the causal alignment with more queries than keys, rows without keys,
//! the default scale, half precision, and the op staying one node in a
//! graph (its gradient another).

mod common;
use common::values;
use stagecraft::layers::cpu::reference::attention::{self as reference, Sizes};
use stagecraft::{
    function, lazy, scaled_dot_product_attention, Device, FloatElement, Gradients, Tensor,
};

/// Leading dimensions (rank 3 or 4 as the list is 1 or 2 long), then T, S,
/// D, Dv.
type Shape = (&'static [usize], usize, usize, usize, usize);

/// T = 1, S = 1, D = 1, T ≠ S both ways, sizes on both sides of the
/// kernel's blocks of 64, rank 3 and rank 4.
const SHAPES: &[Shape] = &[
    (&[1, 1], 1, 1, 1, 1),
    (&[2, 3], 1, 9, 4, 3),
    (&[2], 9, 1, 4, 3),
    (&[1, 2], 7, 7, 1, 1),
    (&[2, 2], 65, 63, 8, 5),
    (&[3], 70, 130, 16, 16),
    (&[1, 1], 150, 66, 32, 40),
];

fn dims(lead: &[usize], rows: usize, cols: usize) -> Vec<usize> {
    let mut d = lead.to_vec();
    d.extend([rows, cols]);
    d
}

fn sizes(&(lead, t, s, d, dv): &Shape) -> Sizes {
    Sizes {
        heads: lead.iter().product(),
        t,
        s,
        d,
        dv,
    }
}

/// `q`, `k`, `v` and a weight `w` shaped like the output, on `device`.
fn inputs<T: FloatElement>(
    shape: &Shape,
    device: &Device,
    to: fn(f64) -> T,
) -> ([Tensor<T>; 4], [Vec<f64>; 4]) {
    let &(lead, t, s, d, dv) = shape;
    let all = [(t, d, 1.5), (s, d, 1.5), (s, dv, 1.0), (t, dv, 1.0)];
    let mut wide: [Vec<f64>; 4] = Default::default();
    let tensors = [0, 1, 2, 3].map(|i| {
        let (rows, cols, range) = all[i];
        let shape = dims(lead, rows, cols);
        let n: usize = shape.iter().product();
        let typed: Vec<T> = values(n, 10 + i as u64, -range, range)
            .into_iter()
            .map(to)
            .collect();
        wide[i] = typed.iter().map(|x| x.to_scalar().to_f64()).collect();
        Tensor::from_vec(typed, &shape, device).unwrap()
    });
    (tensors, wide)
}

fn as_f64<T: FloatElement>(x: &Tensor<T>) -> Vec<f64> {
    x.to_vec()
        .unwrap()
        .iter()
        .map(|v| v.to_scalar().to_f64())
        .collect()
}

#[track_caller]
fn assert_close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (x, y)) in got.iter().zip(want).enumerate() {
        assert!(
            (x - y).abs() <= tol * (1.0 + y.abs()),
            "{what}[{i}]: {x} vs {y}"
        );
    }
}

/// `O`, then the gradients of `Σ w·O` for `q`, `k` and `v` through the tape.
fn forward_and_gradients<T: FloatElement>(
    [q, k, v, w]: &[Tensor<T>; 4],
    causal: bool,
    scale: Option<f64>,
) -> [Tensor<T>; 4] {
    let (q, k, v) = (q.requires_grad(), k.requires_grad(), v.requires_grad());
    let o = q.scaled_dot_product_attention(&k, &v, causal, scale);
    let grads: Gradients = (&o * w).sum(&[], false).backward().unwrap();
    [
        o.clone(),
        grads.get(&q).unwrap(),
        grads.get(&k).unwrap(),
        grads.get(&v).unwrap(),
    ]
}

fn check_against_reference<T: FloatElement>(to: fn(f64) -> T, tol: f64) {
    let cpu = Device::cpu();
    for shape in SHAPES {
        for causal in [false, true] {
            for scale in [None, Some(-0.6)] {
                let (tensors, [q, k, v, w]) = inputs(shape, &cpu, to);
                let n = sizes(shape);
                let resolved = scale.unwrap_or(1.0 / (n.d as f64).sqrt());
                let (want_o, _) = reference::attention(&q, &k, &v, n, causal, resolved);
                let (dq, dk, dv) = reference::attention_grad(&w, &q, &k, &v, n, causal, resolved);
                let got = forward_and_gradients(&tensors, causal, scale);
                let what =
                    |name: &str| format!("{name} of {shape:?}, causal {causal}, scale {scale:?}");
                assert_eq!(got[0].dims(), dims(shape.0, shape.1, shape.4).as_slice());
                for (i, (name, want)) in [("O", &want_o), ("dq", &dq), ("dk", &dk), ("dv", &dv)]
                    .into_iter()
                    .enumerate()
                {
                    assert_close(&what(name), &as_f64(&got[i]), want, tol);
                }
            }
        }
    }
}

#[test]
fn f64_values_and_gradients_match_the_reference() {
    check_against_reference::<f64>(|x| x, 1e-12);
}

#[test]
fn f32_values_and_gradients_match_the_reference() {
    check_against_reference::<f32>(|x| x as f32, 2e-5);
}

/// f16 and bf16 compute in f32 and round once: within their precision.
#[test]
fn half_precision_is_close_to_the_reference() {
    let cpu = Device::cpu();
    let shape: Shape = (&[2, 2], 70, 40, 16, 8);
    let n = sizes(&shape);
    fn case<T: FloatElement>(shape: &Shape, n: Sizes, cpu: &Device, to: fn(f64) -> T, tol: f64) {
        let (tensors, [q, k, v, w]) = inputs(shape, cpu, to);
        let scale = 0.25;
        let (want_o, _) = reference::attention(&q, &k, &v, n, true, scale);
        let (dq, dk, dv) = reference::attention_grad(&w, &q, &k, &v, n, true, scale);
        let got = forward_and_gradients(&tensors, true, Some(scale));
        for (i, want) in [&want_o, &dq, &dk, &dv].into_iter().enumerate() {
            assert_close(&format!("output {i}"), &as_f64(&got[i]), want, tol);
        }
    }
    case::<stagecraft::f16>(&shape, n, &cpu, stagecraft::f16::from_f64, 1e-2);
    case::<stagecraft::bf16>(&shape, n, &cpu, stagecraft::bf16::from_f64, 6e-2);
}

fn bits(x: &Tensor<f32>) -> Vec<u32> {
    x.to_vec().unwrap().iter().map(|v| v.to_bits()).collect()
}

/// The same kernels run in every mode, and they sum in an order fixed by
/// the shape: eager, lazy and `function` give the same bits, for the
/// output and the gradients (eager tape, lazy tape, and the IR-level
/// gradient of a `Call`).
#[test]
fn eager_lazy_and_function_agree_bitwise() {
    let cpu = Device::cpu();
    let lazy_device = Device::lazy(&cpu);
    for causal in [false, true] {
        let shape: Shape = (&[2, 3], 100, 90, 16, 24);
        let (eager, _) = inputs(&shape, &cpu, |x| x as f32);
        let want = forward_and_gradients(&eager, causal, None).map(|x| bits(&x));

        let (on_lazy, _) = inputs(&shape, &lazy_device, |x| x as f32);
        let got = forward_and_gradients(&on_lazy, causal, None);
        lazy::mark_step();
        assert_eq!(got.map(|x| bits(&x)), want, "lazy, causal {causal}");

        let staged = function(move |(q, k, v): (Tensor<f32>, Tensor<f32>, Tensor<f32>)| {
            q.scaled_dot_product_attention(&k, &v, causal, None)
        });
        let [q, k, v, w] = &eager;
        let (q, k, v) = (q.requires_grad(), k.requires_grad(), v.requires_grad());
        let o = staged.call((q.clone(), k.clone(), v.clone()));
        let grads = (&o * w).sum(&[], false).backward().unwrap();
        let got = [
            o,
            grads.get(&q).unwrap(),
            grads.get(&k).unwrap(),
            grads.get(&v).unwrap(),
        ];
        assert_eq!(got.map(|x| bits(&x)), want, "function, causal {causal}");

        // The free function is the method.
        let [q, k, v, _] = &eager;
        let free = scaled_dot_product_attention(q, k, v, causal, None);
        assert_eq!(bits(&free), want[0]);
    }
}

/// One fused op forward, one fused op for its gradient: no matmul or
/// softmax appears in the traced graph of either.
#[test]
fn the_op_and_its_gradient_are_one_node_each() {
    let cpu = Device::cpu();
    let (x, _) = inputs::<f32>(&(&[1, 2], 5, 6, 4, 4), &cpu, |x| x as f32);
    let staged = function(
        |(q, k, v, w): (Tensor<f32>, Tensor<f32>, Tensor<f32>, Tensor<f32>)| {
            let grad_q = stagecraft::grad(|q: &Tensor<f32>| {
                (q.scaled_dot_product_attention(&k, &v, true, None) * &w).sum(&[], false)
            });
            grad_q(&q)
        },
    );
    let args = (x[0].clone(), x[1].clone(), x[2].clone(), x[3].clone());
    staged.call(args.clone()).wait().unwrap();
    let text = stagecraft::layers::graph::text::print(&staged.traced_function(&args).unwrap());
    let count = |op: &str| {
        text.matches(&format!("= {op}(")).count() + text.matches(&format!("= {op}[")).count()
    };
    assert_eq!(count("ScaledDotProductAttention"), 1, "{text}");
    assert_eq!(count("ScaledDotProductAttentionGrad"), 1, "{text}");
    assert_eq!(count("MatMul") + count("Softmax"), 0, "{text}");
}

/// With more queries than keys, causal masking is aligned at the upper
/// left (PyTorch's `is_causal`): query `i` sees keys `0..=i`, so queries
/// from `S` on see every key and give the unmasked result, and the first
/// query gives the first value exactly.
#[test]
fn causal_with_more_queries_than_keys_aligns_at_the_upper_left() {
    let cpu = Device::cpu();
    let (t, s) = (7, 3);
    let shape: Shape = (&[1, 1], t, s, 2, 2);
    let ([q, k, v, _], _) = inputs::<f64>(&shape, &cpu, |x| x);
    let causal = q
        .scaled_dot_product_attention(&k, &v, true, None)
        .to_vec()
        .unwrap();
    let full = q
        .scaled_dot_product_attention(&k, &v, false, None)
        .to_vec()
        .unwrap();
    assert_eq!(&causal[s * 2..], &full[s * 2..]);
    assert_eq!(&causal[..2], &v.to_vec().unwrap()[..2]);
    assert_ne!(&causal[2..4], &full[2..4]);
    // Fewer queries than keys: keys past T are seen by nobody, so they
    // can be dropped.
    let ([q, k, v, _], _) = inputs::<f64>(&(&[1, 1], 3, 7, 2, 2), &cpu, |x| x);
    let causal = q.scaled_dot_product_attention(&k, &v, true, None);
    let first = |x: &Tensor<f64>| x.narrow(2, 0, 3);
    let dropped = q.scaled_dot_product_attention(&first(&k), &first(&v), true, None);
    assert_close(
        "T < S",
        &causal.to_vec().unwrap(),
        &dropped.to_vec().unwrap(),
        1e-15,
    );
}

/// A row with no keys (only `S = 0` makes one under the upper-left
/// alignment) gives zeros, as the unfused formula's empty product does,
/// and zero gradients.
#[test]
fn rows_without_keys_give_zeros() {
    let cpu = Device::cpu();
    let q = Tensor::<f32>::ones(&[2, 3, 4], &cpu).requires_grad();
    let k = Tensor::<f32>::zeros(&[2, 0, 4], &cpu).requires_grad();
    let v = Tensor::<f32>::zeros(&[2, 0, 5], &cpu).requires_grad();
    for causal in [false, true] {
        let o = q.scaled_dot_product_attention(&k, &v, causal, None);
        assert_eq!(o.dims(), &[2, 3, 5]);
        assert_eq!(o.to_vec().unwrap(), vec![0.0; 30]);
    }
    let o = q.scaled_dot_product_attention(&k, &v, true, None);
    let grads = o.sum(&[], false).backward().unwrap();
    assert_eq!(grads.get(&q).unwrap().to_vec().unwrap(), vec![0.0; 24]);
    assert_eq!(grads.get(&k).unwrap().dims(), &[2, 0, 4]);
}

/// The default scale is `1/√D`, bit for bit.
#[test]
fn the_default_scale_is_one_over_root_d() {
    let cpu = Device::cpu();
    let ([q, k, v, _], _) = inputs::<f32>(&(&[2, 2], 20, 30, 16, 8), &cpu, |x| x as f32);
    let default = q.scaled_dot_product_attention(&k, &v, false, None);
    let explicit = q.scaled_dot_product_attention(&k, &v, false, Some(0.25));
    assert_eq!(bits(&default), bits(&explicit));
}

/// The fused op against the same formula written with separate ops
/// (matmul, an additive mask, softmax, matmul).
#[test]
fn matches_the_unfused_formula() {
    let cpu = Device::cpu();
    let (t, s) = (80, 75);
    let ([q, k, v, _], _) = inputs::<f64>(&(&[2, 2], t, s, 12, 6), &cpu, |x| x);
    let mask: Vec<f64> = (0..t * s)
        .map(|at| {
            if at % s <= at / s {
                0.0
            } else {
                f64::NEG_INFINITY
            }
        })
        .collect();
    let mask = Tensor::from_vec(mask, &[t, s], &cpu).unwrap();
    let scores = q.matmul(&k.transpose(-2, -1)) * (1.0 / 12f64.sqrt()) + &mask;
    let unfused = scores.softmax(-1).matmul(&v);
    let fused = q.scaled_dot_product_attention(&k, &v, true, None);
    assert_close(
        "O",
        &fused.to_vec().unwrap(),
        &unfused.to_vec().unwrap(),
        1e-13,
    );
}

/// `[B, H, T, D]` as `[B, T, H, D]`.
fn sequence_first<T: FloatElement>(x: &Tensor<T>) -> Tensor<T> {
    x.transpose(1, 2)
}

/// The `"bthd"` layout (`scaled_dot_product_attention_bthd`) is the
/// default layout transposed, to the bit: the output, the gradients
/// through the fused backward, and second-order gradients (whose products
/// transpose the operands to `"bhtd"` and back), in eager, lazy and
/// `function` modes.
#[test]
fn the_sequence_first_layout_is_the_heads_first_layout_transposed() {
    let cpu = Device::cpu();
    let lazy_device = Device::lazy(&cpu);
    for causal in [false, true] {
        let shape: Shape = (&[2, 3], 70, 66, 16, 8);
        let (heads_first, _) = inputs(&shape, &cpu, |x| x as f32);
        let want = forward_and_gradients(&heads_first, causal, None).map(|x| bits(&x));
        let run = |[q, k, v, w]: &[Tensor<f32>; 4]| {
            let [q, k, v, w] = [q, k, v, w].map(sequence_first);
            let (q, k, v) = (q.requires_grad(), k.requires_grad(), v.requires_grad());
            let o = q.scaled_dot_product_attention_bthd(&k, &v, causal, None);
            assert_eq!(o.dims(), &[2, 70, 3, 8]);
            let grads = (&o * &w).sum(&[], false).backward().unwrap();
            [
                o,
                grads.get(&q).unwrap(),
                grads.get(&k).unwrap(),
                grads.get(&v).unwrap(),
            ]
            .map(|x| sequence_first(&x))
        };
        let got = run(&heads_first).map(|x| bits(&x));
        assert_eq!(got, want, "eager, causal {causal}");

        let (on_lazy, _) = inputs(&shape, &lazy_device, |x| x as f32);
        let got = run(&on_lazy);
        lazy::mark_step();
        assert_eq!(got.map(|x| bits(&x)), want, "lazy, causal {causal}");

        let staged = function(move |(q, k, v): (Tensor<f32>, Tensor<f32>, Tensor<f32>)| {
            q.scaled_dot_product_attention_bthd(&k, &v, causal, None)
        });
        let [q, k, v, _] = &heads_first;
        let o = staged.call((sequence_first(q), sequence_first(k), sequence_first(v)));
        assert_eq!(
            bits(&sequence_first(&o)),
            want[0],
            "function, causal {causal}"
        );
    }

    // Second order: the gradient of Σ (∂Σ w·O/∂q)·u for every operand.
    let shape: Shape = (&[2, 2], 6, 5, 3, 4);
    let (x, _) = inputs::<f64>(&shape, &cpu, |x| x);
    let u = x[0].clone() * -0.7;
    let second = |layout_first: bool| {
        let prep = |t: &Tensor<f64>| {
            if layout_first {
                sequence_first(t)
            } else {
                t.clone()
            }
        };
        let [q, k, v, w] = [&x[0], &x[1], &x[2], &x[3]].map(|t| prep(t).requires_grad());
        let u = prep(&u);
        let attend = |q: &Tensor<f64>| {
            if layout_first {
                q.scaled_dot_product_attention_bthd(&k, &v, true, None)
            } else {
                q.scaled_dot_product_attention(&k, &v, true, None)
            }
        };
        let inner = stagecraft::grad(|q: &Tensor<f64>| (attend(q) * &w).sum(&[], false));
        let grads = (inner(&q) * &u).sum(&[], false).backward().unwrap();
        [&q, &k, &v, &w].map(|t| {
            let g = grads.get(t).unwrap();
            let g = if layout_first { sequence_first(&g) } else { g };
            g.to_vec().unwrap()
        })
    };
    assert_eq!(second(true), second(false));
}
