//! Transformer kernels on the GPU against the CPU: layer norm's gradient,
//! RMS norm and its gradient, fused attention (causal or not) and its
//! gradient, and the squared norm. Gradients go through `value_and_grad`
//! on each device. Every test checks that its ops ran on the GPU, not
//! through the CPU fallback, and prints the worst differences it saw (the
//! figures in `docs/accuracy.md`).

use crate::on_the_gpu::{assert_close, cpu, gpu, values};
use stagecraft::layers::runtime as rt;
use stagecraft::{value_and_grad, Device, Tensor};

/// Fails if any of `ops` (names as `cpu_fallbacks` lists them, without
/// the dtypes) ran on the CPU for want of a GPU kernel.
fn assert_ran_on_the_gpu(ops: &[&str]) {
    let fallbacks = rt::cpu_fallbacks();
    let fell_back: Vec<&String> = fallbacks
        .iter()
        .filter(|f| ops.iter().any(|op| f.starts_with(&format!("{op}["))))
        .collect();
    assert!(fell_back.is_empty(), "ran on the CPU: {fell_back:?}");
}

/// The worst absolute difference, and the worst `|gpu − cpu| / max(1,
/// |cpu|)` (the measure of `docs/accuracy.md`), over finite values.
#[derive(Default)]
struct Worst {
    abs: f32,
    rel: f32,
}

impl Worst {
    fn add(&mut self, got: &[f32], want: &[f32]) {
        for (&g, &w) in got.iter().zip(want) {
            if !w.is_finite() {
                continue;
            }
            let d = (g - w).abs();
            self.abs = self.abs.max(d);
            self.rel = self.rel.max(d / w.abs().max(1.0));
        }
    }

    fn report(&self, what: &str) {
        println!(
            "{what}: max abs {:.2e}, max |Δ|/max(1, |cpu|) {:.2e}",
            self.abs, self.rel
        );
    }
}

/// Compares `got` with `want` within `tol` (relative and absolute) and
/// adds the differences to `worst`.
fn check(what: &str, got: &Tensor<f32>, want: &Tensor<f32>, tol: f32, worst: &mut Worst) {
    assert_eq!(got.dims(), want.dims(), "{what}");
    let (g, w) = (got.to_vec().unwrap(), want.to_vec().unwrap());
    assert_close(what, &g, &w, tol, tol);
    worst.add(&g, &w);
}

fn on(v: &[f32], dims: &[usize], d: &Device) -> Tensor<f32> {
    Tensor::from_vec(v.to_vec(), dims, d).unwrap()
}

/// `Σ y∘r`: a loss whose gradient reaches every output with its own
/// weight (the plain sum of a normalized row has no gradient).
fn weighted_sum(y: &Tensor<f32>, r: &Tensor<f32>) -> Tensor<f32> {
    (y * r).sum(&[], false)
}

/// Shapes of norm inputs: a single element, odd widths, rows wider than
/// a workgroup's 64 lanes, more rows than one chunk of the column sums
/// (16), leading dimensions, and a single row of rank 1.
const NORM_SHAPES: &[&[usize]] = &[&[3, 1], &[40, 7], &[2, 20, 65], &[5, 300], &[130]];

#[test]
fn layer_norm_gradients_match_the_cpu() {
    let (gpu, _turn) = gpu();
    let (mut dx, mut dw, mut db) = (Worst::default(), Worst::default(), Worst::default());
    for (case, &dims) in NORM_SHAPES.iter().enumerate() {
        let n: usize = dims.iter().product();
        let width = dims[dims.len() - 1];
        let seed = 10 * case as u64;
        let (xv, rv) = (values(n, seed, -3.0, 3.0), values(n, seed + 1, -1.0, 1.0));
        let (wv, bv) = (
            values(width, seed + 2, 0.5, 1.5),
            values(width, seed + 3, -1.0, 1.0),
        );
        for (has_w, has_b) in [(false, false), (true, false), (false, true), (true, true)] {
            let what =
                |of: &str| format!("{of} of layer norm {dims:?} weight {has_w} bias {has_b}");
            // The gradients of Σ layer_norm(x, w, b)∘r with respect to x,
            // w and b (those present), on device `d`.
            let grads = |d: &Device| {
                let (x, r) = (on(&xv, dims, d), on(&rv, dims, d));
                let (w, b) = (on(&wv, &[width], d), on(&bv, &[width], d));
                let (w, b) = (has_w.then_some(w), has_b.then_some(b));
                let by_x = value_and_grad(|x: &Tensor<f32>| {
                    weighted_sum(&x.layer_norm(w.as_ref(), b.as_ref(), 1e-5), &r)
                })(&x)
                .1;
                let by_w = w.as_ref().map(|w| {
                    value_and_grad(|w: &Tensor<f32>| {
                        weighted_sum(&x.layer_norm(Some(w), b.as_ref(), 1e-5), &r)
                    })(w)
                    .1
                });
                let by_b = b.as_ref().map(|b| {
                    value_and_grad(|b: &Tensor<f32>| {
                        weighted_sum(&x.layer_norm(w.as_ref(), Some(b), 1e-5), &r)
                    })(b)
                    .1
                });
                (by_x, by_w, by_b)
            };
            let (g, c) = (grads(&gpu), grads(&cpu()));
            assert_eq!(g.0.device(), gpu);
            check(&what("dx"), &g.0, &c.0, 2e-5, &mut dx);
            if let (Some(g), Some(c)) = (&g.1, &c.1) {
                assert_eq!(g.device(), gpu);
                check(&what("dweight"), g, c, 2e-5, &mut dw);
            }
            if let (Some(g), Some(c)) = (&g.2, &c.2) {
                check(&what("dbias"), g, c, 2e-5, &mut db);
            }
        }
    }
    // A NaN in x makes its row's statistics NaN: that row of dx and all
    // of dweight are NaN, as on the CPU.
    let mut xv = values(4 * 70, 5, -2.0, 2.0);
    xv[150] = f32::NAN;
    let (rv, wv) = (values(4 * 70, 6, -1.0, 1.0), values(70, 7, 0.5, 1.5));
    let grads = |d: &Device| {
        let (x, r, w) = (
            on(&xv, &[4, 70], d),
            on(&rv, &[4, 70], d),
            on(&wv, &[70], d),
        );
        let by_x = value_and_grad(|x: &Tensor<f32>| {
            weighted_sum(&x.layer_norm(Some(&w), None, 1e-5), &r)
        })(&x)
        .1;
        let by_w =
            value_and_grad(|w: &Tensor<f32>| weighted_sum(&x.layer_norm(Some(w), None, 1e-5), &r))(
                &w,
            )
            .1;
        (by_x.to_vec().unwrap(), by_w.to_vec().unwrap())
    };
    let (g, c) = (grads(&gpu), grads(&cpu()));
    assert!(g.0[140..210].iter().all(|v| v.is_nan()));
    assert!(g.0[..140].iter().all(|v| v.is_finite()));
    assert!(g.1.iter().all(|v| v.is_nan()));
    assert_close("dx with a NaN", &g.0, &c.0, 2e-5, 2e-5);
    assert_close("dweight with a NaN", &g.1, &c.1, 2e-5, 2e-5);
    dx.report("LayerNormGrad dx");
    dw.report("LayerNormGrad dweight");
    db.report("LayerNormGrad dbias");
    assert_ran_on_the_gpu(&["LayerNorm", "LayerNormGrad"]);
}

#[test]
fn rms_norm_and_its_gradients_match_the_cpu() {
    let (gpu, _turn) = gpu();
    let (mut y, mut dx, mut dw) = (Worst::default(), Worst::default(), Worst::default());
    for (case, &dims) in NORM_SHAPES.iter().enumerate() {
        let n: usize = dims.iter().product();
        let width = dims[dims.len() - 1];
        let seed = 100 + 10 * case as u64;
        let (xv, rv) = (values(n, seed, -3.0, 3.0), values(n, seed + 1, -1.0, 1.0));
        let wv = values(width, seed + 2, 0.5, 1.5);
        for has_w in [false, true] {
            let what = |of: &str| format!("{of} of RMS norm {dims:?} weight {has_w}");
            let run = |d: &Device| {
                let (x, r) = (on(&xv, dims, d), on(&rv, dims, d));
                let w = has_w.then(|| on(&wv, &[width], d));
                let y = x.rms_norm(w.as_ref(), 1e-6);
                let by_x = value_and_grad(|x: &Tensor<f32>| {
                    weighted_sum(&x.rms_norm(w.as_ref(), 1e-6), &r)
                })(&x)
                .1;
                let by_w = w.as_ref().map(|w| {
                    value_and_grad(|w: &Tensor<f32>| weighted_sum(&x.rms_norm(Some(w), 1e-6), &r))(
                        w,
                    )
                    .1
                });
                (y, by_x, by_w)
            };
            let (g, c) = (run(&gpu), run(&cpu()));
            assert_eq!(g.0.device(), gpu);
            assert_eq!(g.1.device(), gpu);
            check(&what("y"), &g.0, &c.0, 1e-5, &mut y);
            check(&what("dx"), &g.1, &c.1, 2e-5, &mut dx);
            if let (Some(g), Some(c)) = (&g.2, &c.2) {
                check(&what("dweight"), g, c, 2e-5, &mut dw);
            }
        }
    }
    // A NaN makes its own row NaN and leaves the others alone, as on the
    // CPU.
    let mut xv = values(3 * 70, 7, -2.0, 2.0);
    xv[75] = f32::NAN;
    let run = |d: &Device| on(&xv, &[3, 70], d).rms_norm(None, 1e-6).to_vec().unwrap();
    let (g, c) = (run(&gpu), run(&cpu()));
    assert!(g[70..140].iter().all(|v| v.is_nan()));
    assert_close("RMS norm with a NaN", &g, &c, 1e-5, 1e-5);
    y.report("RmsNorm y");
    dx.report("RmsNormGrad dx");
    dw.report("RmsNormGrad dweight");
    assert_ran_on_the_gpu(&["RmsNorm", "RmsNormGrad"]);
}

/// `(q, k, v)` shapes: rank 4 with fewer queries than keys, rank 3 with
/// more, odd sizes, several tiles of 16 queries, keys and features, a
/// value width unlike the key width, and one of everything.
const ATTENTION_SHAPES: &[[&[usize]; 3]] = &[
    [&[1, 2, 5, 3], &[1, 2, 7, 3], &[1, 2, 7, 4]],
    [&[3, 37, 20], &[3, 29, 20], &[3, 29, 17]],
    [&[2, 33, 64], &[2, 33, 64], &[2, 33, 40]],
    [&[1, 1, 1], &[1, 1, 1], &[1, 1, 1]],
    [&[1, 50, 8], &[1, 70, 8], &[1, 70, 33]],
];

/// Inputs of an attention case, from its shapes.
fn attention_inputs(shapes: &[&[usize]; 3], seed: u64) -> [Vec<f32>; 4] {
    let n = |dims: &[usize]| dims.iter().product::<usize>();
    let [q, k, v] = shapes;
    let mut o = q.to_vec();
    *o.last_mut().unwrap() = v[v.len() - 1];
    [
        values(n(q), seed, -2.0, 2.0),
        values(n(k), seed + 1, -2.0, 2.0),
        values(n(v), seed + 2, -1.0, 1.0),
        values(n(&o), seed + 3, -1.0, 1.0),
    ]
}

#[test]
fn attention_matches_the_cpu_causal_or_not() {
    let (gpu, _turn) = gpu();
    let mut worst = Worst::default();
    for (case, shapes) in ATTENTION_SHAPES.iter().enumerate() {
        let [qv, kv, vv, _] = attention_inputs(shapes, 200 + 10 * case as u64);
        for causal in [false, true] {
            for scale in [None, Some(-0.7)] {
                let run = |d: &Device| {
                    let q = on(&qv, shapes[0], d);
                    let (k, v) = (on(&kv, shapes[1], d), on(&vv, shapes[2], d));
                    q.scaled_dot_product_attention(&k, &v, causal, scale)
                };
                let (g, c) = (run(&gpu), run(&cpu()));
                assert_eq!(g.device(), gpu);
                let what = format!("attention {shapes:?} causal {causal} scale {scale:?}");
                check(&what, &g, &c, 2e-5, &mut worst);
            }
        }
    }
    // A NaN query makes its own row NaN and no other.
    let mut qv = values(2 * 20 * 5, 9, -1.0, 1.0);
    qv[5 * 3 + 1] = f32::NAN;
    let (kv, vv) = (
        values(2 * 20 * 5, 10, -1.0, 1.0),
        values(2 * 20 * 3, 11, -1.0, 1.0),
    );
    let run = |d: &Device| {
        let (q, k, v) = (
            on(&qv, &[2, 20, 5], d),
            on(&kv, &[2, 20, 5], d),
            on(&vv, &[2, 20, 3], d),
        );
        let o = q.scaled_dot_product_attention(&k, &v, true, None);
        o.to_vec().unwrap()
    };
    let (g, c) = (run(&gpu), run(&cpu()));
    assert!(g[9..12].iter().all(|x| x.is_nan()));
    assert_eq!(g.iter().filter(|x| x.is_nan()).count(), 3);
    assert_close("attention with a NaN query", &g, &c, 2e-5, 2e-5);
    worst.report("ScaledDotProductAttention O");
    assert_ran_on_the_gpu(&["ScaledDotProductAttention"]);
}

#[test]
fn attention_gradients_match_the_cpu() {
    let (gpu, _turn) = gpu();
    let mut worst = [Worst::default(), Worst::default(), Worst::default()];
    for (case, shapes) in ATTENTION_SHAPES.iter().enumerate() {
        let inputs = attention_inputs(shapes, 300 + 10 * case as u64);
        let [qv, kv, vv, rv] = &inputs;
        let mut out_dims = shapes[0].to_vec();
        *out_dims.last_mut().unwrap() = shapes[2][shapes[2].len() - 1];
        for causal in [false, true] {
            let scale = if causal { None } else { Some(0.6) };
            // The gradient of Σ attention(q, k, v)∘r with respect to q, k
            // and v in turn.
            let grads = |d: &Device| {
                let (q, k, v) = (
                    on(qv, shapes[0], d),
                    on(kv, shapes[1], d),
                    on(vv, shapes[2], d),
                );
                let r = on(rv, &out_dims, d);
                let loss = |q: &Tensor<f32>, k: &Tensor<f32>, v: &Tensor<f32>| {
                    weighted_sum(&q.scaled_dot_product_attention(k, v, causal, scale), &r)
                };
                by_each_operand(&q, &k, &v, loss)
            };
            let (g, c) = (grads(&gpu), grads(&cpu()));
            for (i, name) in ["dq", "dk", "dv"].iter().enumerate() {
                assert_eq!(g[i].device(), gpu);
                let what = format!("{name} of attention {shapes:?} causal {causal}");
                check(&what, &g[i], &c[i], 5e-5, &mut worst[i]);
            }
        }
    }
    for (name, w) in ["dq", "dk", "dv"].iter().zip(&worst) {
        w.report(&format!("ScaledDotProductAttentionGrad {name}"));
    }
    assert_ran_on_the_gpu(&["ScaledDotProductAttention", "ScaledDotProductAttentionGrad"]);
}

/// The gradient of `loss(q, k, v)` with respect to `q`, `k` and `v` in
/// turn.
fn by_each_operand(
    q: &Tensor<f32>,
    k: &Tensor<f32>,
    v: &Tensor<f32>,
    loss: impl Fn(&Tensor<f32>, &Tensor<f32>, &Tensor<f32>) -> Tensor<f32>,
) -> [Tensor<f32>; 3] {
    [
        value_and_grad(|q: &Tensor<f32>| loss(q, k, v))(q).1,
        value_and_grad(|k: &Tensor<f32>| loss(q, k, v))(k).1,
        value_and_grad(|v: &Tensor<f32>| loss(q, k, v))(v).1,
    ]
}

/// The `"bthd"` layout (`[B, T, H, D]` operands, each head's rows `H·D`
/// apart): forward and gradients against the CPU, causal or not, with
/// one head, several, and rows past a tile of 16.
#[test]
fn sequence_first_attention_and_its_gradients_match_the_cpu() {
    let (gpu, _turn) = gpu();
    let mut worst = [(); 4].map(|_| Worst::default());
    let cases: [[&[usize]; 3]; 3] = [
        [&[2, 5, 3, 4], &[2, 7, 3, 4], &[2, 7, 3, 6]],
        [&[1, 40, 1, 8], &[1, 40, 1, 8], &[1, 40, 1, 8]],
        [&[3, 33, 4, 16], &[3, 20, 4, 16], &[3, 20, 4, 5]],
    ];
    for (case, shapes) in cases.iter().enumerate() {
        let [qv, kv, vv, rv] = &attention_inputs(shapes, 400 + 10 * case as u64);
        let mut out_dims = shapes[0].to_vec();
        out_dims[3] = shapes[2][3];
        for causal in [false, true] {
            let run = |d: &Device| {
                let (q, k, v) = (
                    on(qv, shapes[0], d),
                    on(kv, shapes[1], d),
                    on(vv, shapes[2], d),
                );
                let r = on(rv, &out_dims, d);
                let loss = |q: &Tensor<f32>, k: &Tensor<f32>, v: &Tensor<f32>| {
                    weighted_sum(&q.scaled_dot_product_attention_bthd(k, v, causal, None), &r)
                };
                let o = q.scaled_dot_product_attention_bthd(&k, &v, causal, None);
                let [by_q, by_k, by_v] = by_each_operand(&q, &k, &v, loss);
                [o, by_q, by_k, by_v]
            };
            let (g, c) = (run(&gpu), run(&cpu()));
            for (i, name) in ["O", "dq", "dk", "dv"].iter().enumerate() {
                assert_eq!(g[i].device(), gpu);
                let what = format!("{name} of bthd attention {shapes:?} causal {causal}");
                check(&what, &g[i], &c[i], 5e-5, &mut worst[i]);
            }
        }
    }
    for (name, w) in ["O", "dq", "dk", "dv"].iter().zip(&worst) {
        w.report(&format!("ScaledDotProductAttention bthd {name}"));
    }
    assert_ran_on_the_gpu(&["ScaledDotProductAttention", "ScaledDotProductAttentionGrad"]);
}

#[test]
fn squared_norm_matches_the_cpu() {
    let (gpu, _turn) = gpu();
    let mut worst = Worst::default();
    // One element, several tensors, and tensors over one workgroup's
    // span (4096 elements) and many of them.
    let lists: &[&[usize]] = &[&[1], &[15, 1, 5000], &[70_000, 4097, 3]];
    for (case, sizes) in lists.iter().enumerate() {
        let data: Vec<Vec<f32>> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| values(n, 400 + 10 * case as u64 + i as u64, -3.0, 3.0))
            .collect();
        let run = |d: &Device| {
            let tensors: Vec<Tensor<f32>> = data.iter().map(|v| on(v, &[v.len()], d)).collect();
            let refs: Vec<&Tensor<f32>> = tensors.iter().collect();
            Tensor::squared_norm(&refs)
        };
        let (g, c) = (run(&gpu), run(&cpu()));
        assert_eq!(g.device(), gpu);
        check(
            &format!("squared norm of {sizes:?}"),
            &g,
            &c,
            1e-5,
            &mut worst,
        );
    }
    // NaN wins; an infinity gives infinity.
    for (bad, nan) in [(f32::NAN, true), (f32::NEG_INFINITY, false)] {
        let run = |d: &Device| {
            let a = on(&values(5000, 1, -1.0, 1.0), &[5000], d);
            let b = on(&[1.0, bad], &[2], d);
            Tensor::squared_norm(&[&a, &b]).item().unwrap()
        };
        let (g, c) = (run(&gpu), run(&cpu()));
        assert_eq!(g.is_nan(), nan);
        assert!((g.is_nan() && c.is_nan()) || g == c, "{g} vs {c}");
    }
    worst.report("SquaredNorm");
    assert_ran_on_the_gpu(&["SquaredNorm"]);
}
