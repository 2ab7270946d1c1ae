//! `embedding`, `layer_norm`, `rms_norm` and `cross_entropy` through the
//! public API: values and gradients against hand-computed ones, the same
//! bits on the eager device, the lazy device and inside `function`
//! (forward and gradients), 16-bit inputs, rows past the kernels'
//! parallel threshold, a few training steps, and a proptest of the shape
//! rules.

mod common;
use common::values;
use proptest::prelude::*;
use stagecraft::{
    bf16, f16, function, grad, lazy, CrossEntropyOptions, Device, ErrorKind, FloatElement,
    Reduction, Tensor,
};

type T = Tensor<f64>;

fn cpu() -> Device {
    Device::cpu()
}

fn f64s(v: &[f64], dims: &[usize], d: &Device) -> T {
    Tensor::from_vec(v.to_vec(), dims, d).unwrap()
}

fn i64s(v: &[i64], dims: &[usize], d: &Device) -> Tensor<i64> {
    Tensor::from_vec(v.to_vec(), dims, d).unwrap()
}

fn close(got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{got:?} vs {want:?}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "element {i}: {g} vs {w} ({got:?} vs {want:?})"
        );
    }
}

fn mean_none() -> CrossEntropyOptions {
    CrossEntropyOptions {
        ignore_index: None,
        reduction: Reduction::None,
    }
}

#[test]
fn embedding_values_and_gradient() {
    let d = cpu();
    let table = f64s(&[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], &[4, 2], &d);
    // i64 ids of rank 2, i32 ids of rank 0.
    let ids = i64s(&[3, 0, 3, 1], &[2, 2], &d);
    let rows = table.embedding(&ids);
    assert_eq!(rows.dims(), &[2, 2, 2]);
    assert_eq!(
        rows.to_vec().unwrap(),
        vec![6.0, 7.0, 0.0, 1.0, 6.0, 7.0, 2.0, 3.0]
    );
    let one = Tensor::<i32>::scalar(2, &d);
    assert_eq!(table.embedding(&one).dims(), &[2]);
    assert_eq!(table.embedding(&one).to_vec().unwrap(), vec![4.0, 5.0]);
    // The gradient adds each row's incoming gradient into the row its id
    // picked: row 3 twice, row 2 never.
    let w = f64s(
        &[1.0, 2.0, 10.0, 20.0, 100.0, 200.0, 1e3, 2e3],
        &[2, 2, 2],
        &d,
    );
    let g = grad(|t: &T| (t.embedding(&ids) * &w).sum(&[], false))(&table);
    assert_eq!(
        g.to_vec().unwrap(),
        vec![10.0, 20.0, 1e3, 2e3, 0.0, 0.0, 101.0, 202.0]
    );
}

#[test]
fn layer_norm_values_and_gradients() {
    let d = cpu();
    let x = f64s(&[1.0, 2.0, 3.0, 4.0, -2.0, 0.0, 0.0, 2.0], &[2, 4], &d);
    let w = f64s(&[1.0, 2.0, 0.5, -1.0], &[4], &d);
    let b = f64s(&[0.0, 1.0, 0.0, -1.0], &[4], &d);
    let eps = 1e-5;
    // Row 0: mean 2.5, variance 1.25; row 1: mean 0, variance 2.
    let r0 = 1.0 / (1.25f64 + eps).sqrt();
    let r1 = 1.0 / (2.0f64 + eps).sqrt();
    let xh = [
        -1.5 * r0,
        -0.5 * r0,
        0.5 * r0,
        1.5 * r0,
        -2.0 * r1,
        0.0,
        0.0,
        2.0 * r1,
    ];
    close(&x.layer_norm(None, None, eps).to_vec().unwrap(), &xh, 1e-15);
    let affine: Vec<f64> = (0..8)
        .map(|i| xh[i] * [1.0, 2.0, 0.5, -1.0][i % 4] + [0.0, 1.0, 0.0, -1.0][i % 4])
        .collect();
    close(
        &x.layer_norm(Some(&w), Some(&b), eps).to_vec().unwrap(),
        &affine,
        1e-15,
    );
    // Weight alone, bias alone.
    let scaled: Vec<f64> = (0..8)
        .map(|i| xh[i] * [1.0, 2.0, 0.5, -1.0][i % 4])
        .collect();
    close(
        &x.layer_norm(Some(&w), None, eps).to_vec().unwrap(),
        &scaled,
        1e-15,
    );
    let shifted: Vec<f64> = (0..8)
        .map(|i| xh[i] + [0.0, 1.0, 0.0, -1.0][i % 4])
        .collect();
    close(
        &x.layer_norm(None, Some(&b), eps).to_vec().unwrap(),
        &shifted,
        1e-15,
    );
    // d/dbias Σ y·k = Σ_rows k; d/dweight = Σ_rows k·xh; d/dx of a plain
    // sum is 0 (each row's outputs sum to a constant).
    let k = f64s(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], &[2, 4], &d);
    let loss = |x: &T, w: &T, b: &T| (x.layer_norm(Some(w), Some(b), eps) * &k).sum(&[], false);
    let db = grad(|b: &T| loss(&x, &w, b))(&b).to_vec().unwrap();
    assert_eq!(db, vec![6.0, 8.0, 10.0, 12.0]);
    let dw = grad(|w: &T| loss(&x, w, &b))(&w).to_vec().unwrap();
    let want: Vec<f64> = (0..4)
        .map(|j| xh[j] * (j + 1) as f64 + xh[4 + j] * (j + 5) as f64)
        .collect();
    close(&dw, &want, 1e-14);
    let ones = grad(|x: &T| x.layer_norm(None, None, eps).sum(&[], false))(&x);
    close(&ones.to_vec().unwrap(), &[0.0; 8], 1e-12);
}

#[test]
fn rms_norm_values_and_gradients() {
    let d = cpu();
    let x = f64s(&[3.0, 4.0, 0.0, 2.0, -2.0, 0.0], &[2, 3], &d);
    let w = f64s(&[1.0, 0.5, 2.0], &[3], &d);
    // Row 0: mean(x²) = 25/3; row 1: 8/3.
    let (r0, r1) = ((3.0f64 / 25.0).sqrt(), (3.0f64 / 8.0).sqrt());
    let want = [
        3.0 * r0,
        4.0 * r0 * 0.5,
        0.0,
        2.0 * r1,
        -2.0 * r1 * 0.5,
        0.0,
    ];
    close(&x.rms_norm(Some(&w), 0.0).to_vec().unwrap(), &want, 1e-15);
    // d/dx_i Σ y (no weight, eps 0) = r - r³·x_i·Σx/D.
    let g = grad(|x: &T| x.rms_norm(None, 0.0).sum(&[], false))(&x)
        .to_vec()
        .unwrap();
    let expect: Vec<f64> = (0..6)
        .map(|i| {
            let (r, s, xi) = if i < 3 {
                (r0, 7.0, [3.0, 4.0, 0.0][i])
            } else {
                (r1, 0.0, [2.0, -2.0, 0.0][i - 3])
            };
            r - r * r * r * xi * s / 3.0
        })
        .collect();
    close(&g, &expect, 1e-14);
}

#[test]
fn cross_entropy_values_and_gradients() {
    let d = cpu();
    let logits = f64s(&[1.0, 2.0, 3.0, 0.0, 0.0, 0.0, -1.0, 5.0, 2.0], &[3, 3], &d);
    let targets = i64s(&[2, 0, -1], &[3], &d);
    let lse0 = (1f64.exp() + 2f64.exp() + 3f64.exp()).ln();
    let lse2 = ((-1f64).exp() + 5f64.exp() + 2f64.exp()).ln();
    let ignore = CrossEntropyOptions {
        ignore_index: Some(-1),
        reduction: Reduction::None,
    };
    let per_row = logits.cross_entropy(&targets, ignore).to_vec().unwrap();
    close(&per_row, &[lse0 - 3.0, 3f64.ln(), 0.0], 1e-15);
    let mean = CrossEntropyOptions {
        ignore_index: Some(-1),
        reduction: Reduction::Mean,
    };
    let m = logits.cross_entropy(&targets, mean);
    assert_eq!(m.dims(), &[] as &[usize]);
    close(
        &[m.item().unwrap()],
        &[(lse0 - 3.0 + 3f64.ln()) / 2.0],
        1e-15,
    );
    let sum = CrossEntropyOptions {
        ignore_index: Some(-1),
        reduction: Reduction::Sum,
    };
    close(
        &[logits.cross_entropy(&targets, sum).item().unwrap()],
        &[lse0 - 3.0 + 3f64.ln()],
        1e-15,
    );
    // Without ignoring, target 2 of row 2 counts.
    let all = i64s(&[2, 0, 2], &[3], &d);
    let loss = logits
        .cross_entropy(&all, CrossEntropyOptions::default())
        .item()
        .unwrap();
    close(
        &[loss],
        &[(lse0 - 3.0 + 3f64.ln() + lse2 - 2.0) / 3.0],
        1e-15,
    );
    // The gradient of the mean: (softmax - one_hot) / 2 on counted rows,
    // 0 on the ignored one.
    let g = grad(|l: &T| l.cross_entropy(&targets, mean))(&logits)
        .to_vec()
        .unwrap();
    let p0: Vec<f64> = [1f64, 2.0, 3.0].iter().map(|v| (v - lse0).exp()).collect();
    let want = [
        p0[0] / 2.0,
        p0[1] / 2.0,
        (p0[2] - 1.0) / 2.0,
        (1.0 / 3.0 - 1.0) / 2.0,
        1.0 / 6.0,
        1.0 / 6.0,
        0.0,
        0.0,
        0.0,
    ];
    close(&g, &want, 1e-15);
    // Logits of rank 3, targets of rank 2, i32.
    let l3 = f64s(&[0.0; 12], &[2, 2, 3], &d);
    let t2 = Tensor::<i32>::from_vec(vec![0, 1, 2, 0], &[2, 2], &d).unwrap();
    let per = l3.cross_entropy(&t2, mean_none());
    assert_eq!(per.dims(), &[2, 2]);
    close(&per.to_vec().unwrap(), &[3f64.ln(); 4], 1e-15);
}

/// A small language-model step: embedding, layer norm, RMS norm, a
/// projection to the vocabulary and the loss, with gradients for every
/// parameter.
fn model(params: &[T], ids: &Tensor<i64>, targets: &Tensor<i64>) -> Vec<T> {
    let (table, ln_w, ln_b, rms_w, proj) =
        (&params[0], &params[1], &params[2], &params[3], &params[4]);
    let h = table.embedding(ids);
    let h = h.layer_norm(Some(ln_w), Some(ln_b), 1e-5);
    let h = h.rms_norm(Some(rms_w), 1e-6).tanh();
    let logits = h.matmul(proj);
    let options = CrossEntropyOptions {
        ignore_index: Some(0),
        reduction: Reduction::Mean,
    };
    vec![logits.cross_entropy(targets, options), logits]
}

fn params(d: &Device) -> Vec<T> {
    let (vocab, width) = (11, 6);
    [
        &[vocab, width][..],
        &[width],
        &[width],
        &[width],
        &[width, vocab],
    ]
    .iter()
    .enumerate()
    .map(|(i, dims)| {
        let n = dims.iter().product();
        f64s(&values(n, 40 + i as u64, -1.0, 1.0), dims, d)
    })
    .collect()
}

fn batch(d: &Device) -> (Tensor<i64>, Tensor<i64>) {
    let ids = i64s(&[1, 4, 7, 10, 3, 3, 0, 9], &[2, 4], d);
    let targets = i64s(&[4, 7, 0, 3, 3, 0, 9, 2], &[2, 4], d);
    (ids, targets)
}

/// The loss, logits and every parameter's gradient.
fn step(params: &[T], ids: &Tensor<i64>, targets: &Tensor<i64>) -> Vec<Vec<u64>> {
    let tracked: Vec<T> = params.iter().map(|p| p.requires_grad()).collect();
    let mut out = model(&tracked, ids, targets);
    let grads = out[0].backward().unwrap();
    out.extend(tracked.iter().map(|p| grads.get(p).unwrap()));
    out.iter()
        .map(|t| t.to_vec().unwrap().iter().map(|v| v.to_bits()).collect())
        .collect()
}

#[test]
fn eager_lazy_and_function_agree_bitwise() {
    let d = cpu();
    let lazy = Device::lazy(&d);
    let (ids, targets) = batch(&d);
    let eager = step(&params(&d), &ids, &targets);
    let (lazy_ids, lazy_targets) = batch(&lazy);
    for _ in 0..2 {
        assert_eq!(
            step(&params(&lazy), &lazy_ids, &lazy_targets),
            eager,
            "lazy"
        );
        lazy::mark_step();
    }
    // Inside `function`: the forward, then gradients through the `Call`
    // (its rules run over the graph, and the statistics outputs are the
    // residuals of its forward half).
    let staged = function(|(ps, ids, targets): (Vec<T>, Tensor<i64>, Tensor<i64>)| {
        model(&ps, &ids, &targets)
    });
    for _ in 0..2 {
        let out = staged.call((params(&d), ids.clone(), targets.clone()));
        let bits: Vec<Vec<u64>> = out
            .iter()
            .map(|t| t.to_vec().unwrap().iter().map(|v| v.to_bits()).collect())
            .collect();
        assert_eq!(bits[..], eager[..2], "function forward");
    }
    let ps = params(&d);
    for (k, p) in ps.iter().enumerate() {
        let g = grad(|p: &T| {
            let mut all = ps.clone();
            all[k] = p.clone();
            staged.call((all, ids.clone(), targets.clone())).remove(0)
        })(p);
        let bits: Vec<u64> = g.to_vec().unwrap().iter().map(|v| v.to_bits()).collect();
        assert_eq!(bits, eager[2 + k], "function gradient of parameter {k}");
    }
}

/// Plain SGD on the model lowers its loss: the gradients point downhill.
#[test]
fn training_steps_lower_the_loss() {
    let d = cpu();
    let (ids, targets) = batch(&d);
    let mut ps = params(&d);
    let mut losses = Vec::new();
    for _ in 0..30 {
        let tracked: Vec<T> = ps.iter().map(|p| p.requires_grad()).collect();
        let loss = model(&tracked, &ids, &targets).remove(0);
        let grads = loss.backward().unwrap();
        losses.push(loss.item().unwrap());
        ps = tracked
            .iter()
            .map(|p| p - &(grads.get(p).unwrap() * 0.5))
            .collect();
    }
    assert!(
        losses[29] < 0.5 * losses[0],
        "the loss went from {} to {}",
        losses[0],
        losses[29]
    );
}

/// Rows past the kernels' parallel threshold give the same bits eagerly,
/// lazily and in a function, forward and backward.
#[test]
fn large_rows_agree_across_modes() {
    let d = cpu();
    let (rows, width) = (70, 700);
    let make = |dev: &Device| {
        let x = Tensor::<f32>::from_vec(
            values(rows * width, 1, -3.0, 3.0)
                .iter()
                .map(|&v| v as f32)
                .collect(),
            &[rows, width],
            dev,
        )
        .unwrap();
        let w = Tensor::<f32>::from_vec(
            values(width, 2, 0.5, 1.5)
                .iter()
                .map(|&v| v as f32)
                .collect(),
            &[width],
            dev,
        )
        .unwrap();
        let t = Tensor::<i64>::from_vec(
            (0..rows as i64).map(|r| (r * 13) % width as i64).collect(),
            &[rows],
            dev,
        )
        .unwrap();
        (x, w, t)
    };
    let program = |(x, w, t): &(Tensor<f32>, Tensor<f32>, Tensor<i64>)| -> Vec<Tensor<f32>> {
        let loss = |x: &Tensor<f32>| {
            let h = x.layer_norm(Some(w), None, 1e-5).rms_norm(Some(w), 1e-6);
            h.cross_entropy(t, CrossEntropyOptions::default())
        };
        vec![loss(x), grad(loss)(x)]
    };
    let bits = |ts: Vec<Tensor<f32>>| -> Vec<Vec<u32>> {
        ts.iter()
            .map(|t| t.to_vec().unwrap().iter().map(|v| v.to_bits()).collect())
            .collect()
    };
    let eager = bits(program(&make(&d)));
    assert_eq!(bits(program(&make(&Device::lazy(&d)))), eager, "lazy");
    let staged = function(|(x, w, t): (Tensor<f32>, Tensor<f32>, Tensor<i64>)| program(&(x, w, t)));
    assert_eq!(bits(staged.call(make(&d))), eager, "function");
}

/// f16 and bf16 rows are computed in f32 and rounded once: they match the
/// f32 results rounded to the narrow type, within a rounding.
#[test]
fn half_precision_follows_f32() {
    fn check<H: FloatElement>(to: fn(f32) -> H, back: fn(H) -> f32, ulp: f32) {
        let d = cpu();
        let raw: Vec<f32> = values(48, 9, -4.0, 4.0).iter().map(|&v| v as f32).collect();
        let narrow: Vec<H> = raw.iter().map(|&v| to(v)).collect();
        let exact: Vec<f32> = narrow.iter().map(|&v| back(v)).collect();
        let x = Tensor::<H>::from_vec(narrow, &[4, 12], &d).unwrap();
        let x32 = Tensor::<f32>::from_vec(exact, &[4, 12], &d).unwrap();
        let t = Tensor::<i32>::from_vec(vec![1, 0, 11, 5], &[4], &d).unwrap();
        let pairs = [
            (
                x.layer_norm(None, None, 1e-5),
                x32.layer_norm(None, None, 1e-5),
            ),
            (x.rms_norm(None, 1e-5), x32.rms_norm(None, 1e-5)),
            (
                x.cross_entropy(&t, mean_none()),
                x32.cross_entropy(&t, mean_none()),
            ),
        ];
        for (narrow, wide) in pairs {
            for (n, w) in narrow
                .to_vec()
                .unwrap()
                .into_iter()
                .zip(wide.to_vec().unwrap())
            {
                let n = back(n);
                assert!((n - w).abs() <= ulp * w.abs().max(1e-3), "{n} vs {w}");
            }
        }
        // Their gradients exist and are of the narrow type.
        let g = grad(|x: &Tensor<H>| {
            x.layer_norm(None, None, 1e-5)
                .cross_entropy(&t, Default::default())
        })(&x);
        assert_eq!(g.dims(), &[4, 12]);
        assert!(g.to_vec().unwrap().iter().all(|&v| back(v).is_finite()));
    }
    check::<f16>(f16::from_f32, f16::to_f32, 2f32.powi(-10));
    check::<bf16>(bf16::from_f32, bf16::to_f32, 2f32.powi(-7));
}

/// Out-of-range ids and targets are errors of the op at the caller's
/// line, on the lazy device and in a function too; the kernels check
/// them before writing anything.
#[test]
fn bad_ids_and_targets_name_the_op_and_line() {
    let eager = cpu();
    for d in [eager, Device::lazy(&eager)] {
        let table = f64s(&[0.0; 6], &[3, 2], &d);
        let logits = f64s(&[0.0; 6], &[2, 3], &d);
        let line = line!() + 1;
        let rows = table.embedding(&i64s(&[0, 3], &[2], &d));
        let err = rows.to_vec().unwrap_err();
        assert_eq!(
            (err.kind(), err.op()),
            (ErrorKind::Index, Some("Embedding")),
            "{err}"
        );
        assert_eq!(err.location().unwrap().line(), line, "{err}");
        assert!(err.to_string().contains("id 3"), "{err}");
        let line = line!() + 1;
        let loss = logits.cross_entropy(&i64s(&[1, -100], &[2], &d), Default::default());
        let err = loss.to_vec().unwrap_err();
        assert_eq!(
            (err.kind(), err.op()),
            (ErrorKind::Index, Some("CrossEntropy")),
            "{err}"
        );
        assert_eq!(err.location().unwrap().line(), line, "{err}");
        assert!(err.to_string().contains("target -100"), "{err}");
    }
    let staged = function(|(t, i): (T, Tensor<i64>)| t.embedding(&i));
    let err = staged
        .call((f64s(&[0.0; 6], &[3, 2], &cpu()), i64s(&[-1], &[1], &cpu())))
        .to_vec()
        .unwrap_err();
    assert_eq!(
        (err.kind(), err.op()),
        (ErrorKind::Index, Some("Embedding")),
        "{err}"
    );
}

/// Second derivatives run through the fused backward ops' own rules
/// (and the forward rules' handling of gradients reaching the
/// statistics): against central differences of the first gradient.
#[test]
fn second_derivatives_through_the_fused_backward_ops() {
    let d = cpu();
    let x = f64s(&values(12, 5, -1.0, 1.0), &[3, 4], &d);
    let w = f64s(&[0.5, 1.0, 1.5, 2.0], &[4], &d);
    let t = i64s(&[3, 0, 2], &[3], &d);
    // ∇ₓ Σ (∇ₓ loss)²: through LayerNormGrad, RmsNormGrad and
    // CrossEntropyGrad and their own rules.
    let loss = |x: &T| {
        x.layer_norm(Some(&w), None, 1e-5)
            .rms_norm(Some(&w), 1e-5)
            .cross_entropy(&t, Default::default())
    };
    let outer = |x: &T| {
        let g = grad(loss)(x);
        (&g * &g).sum(&[], false)
    };
    let analytic = grad(outer)(&x).to_vec().unwrap();
    let h = 1e-5;
    let base = x.to_vec().unwrap();
    for i in 0..base.len() {
        let at = |delta: f64| {
            let mut v = base.clone();
            v[i] += delta;
            outer(&f64s(&v, &[3, 4], &d)).item().unwrap()
        };
        let numeric = (at(h) - at(-h)) / (2.0 * h);
        assert!(
            (analytic[i] - numeric).abs() <= 1e-6 * (1.0 + numeric.abs()),
            "element {i}: {} vs {numeric}",
            analytic[i]
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// The shapes the methods promise, and the shape errors they give, for
    /// random shapes (including zero-size ones).
    #[test]
    fn shape_rules(
        lead in prop::collection::vec(0usize..4, 0..3),
        last in 0usize..5,
        param in 0usize..6,
        ids in prop::collection::vec(0usize..3, 0..3),
        wrong_targets in any::<bool>(),
    ) {
        let d = cpu();
        let mut dims = lead.clone();
        dims.push(last);
        let n: usize = dims.iter().product();
        let x = f64s(&values(n, 3, -1.0, 1.0), &dims, &d);
        let p = f64s(&values(param, 4, 0.5, 1.5), &[param], &d);
        let fits = param == last;
        for out in [
            x.layer_norm(Some(&p), None, 1e-5),
            x.layer_norm(None, Some(&p), 1e-5),
            x.rms_norm(Some(&p), 1e-5),
        ] {
            match out.check() {
                Ok(()) => {
                    prop_assert!(fits);
                    prop_assert_eq!(out.dims(), &dims[..]);
                }
                Err(e) => {
                    prop_assert!(!fits);
                    prop_assert_eq!(e.kind(), ErrorKind::Shape);
                }
            }
        }
        let plain = x.layer_norm(None, None, 1e-5);
        prop_assert_eq!(plain.dims(), &dims[..]);
        // Targets of the leading shape (or one more axis); all 0, valid
        // whenever there is a class.
        let mut tdims = lead.clone();
        if wrong_targets {
            tdims.push(1);
        }
        let tn: usize = tdims.iter().product();
        let t = i64s(&vec![0; tn], &tdims, &d);
        for (reduction, want) in [
            (Reduction::None, lead.clone()),
            (Reduction::Mean, vec![]),
            (Reduction::Sum, vec![]),
        ] {
            let options = CrossEntropyOptions { ignore_index: None, reduction };
            let loss = x.cross_entropy(&t, options);
            if wrong_targets {
                let e = loss.check().unwrap_err();
                prop_assert_eq!((e.kind(), e.op()), (ErrorKind::Shape, Some("CrossEntropy")));
            } else {
                prop_assert_eq!(loss.dims(), &want[..]);
                prop_assert_eq!(loss.to_vec().is_ok(), last > 0 || tn == 0);
            }
        }
        // Embedding: the table is x seen as [rows, last].
        let rows = n.checked_div(last).unwrap_or(0);
        if rows > 0 {
            let table = x.reshape(&[rows, last]);
            let ids_n: usize = ids.iter().product();
            let id_values: Vec<i64> = (0..ids_n as i64).map(|k| k % rows as i64).collect();
            let picked = table.embedding(&i64s(&id_values, &ids, &d));
            let mut want = ids.clone();
            want.push(last);
            prop_assert_eq!(picked.dims(), &want[..]);
            prop_assert!(picked.to_vec().is_ok());
        }
        if dims.len() != 2 {
            let e = x.embedding(&i64s(&[0], &[1], &d)).check().unwrap_err();
            prop_assert_eq!((e.kind(), e.op()), (ErrorKind::Shape, Some("Embedding")));
        }
    }
}
