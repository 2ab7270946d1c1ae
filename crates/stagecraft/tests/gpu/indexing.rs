//! Indexing kernels and fused elementwise programs on the GPU against the
//! CPU: gather, gather-elements, scatter-add and index-add (with negative
//! and i64 indices, their gradients through `value_and_grad`, and bad
//! indices), arg-reductions on ties and NaNs, concatenation, one-hot,
//! running sums, triangular masks of every element width, and
//! `FusedElementwise` programs of every op with a WGSL form in every
//! broadcast mode. Each test checks that its ops ran on the GPU, not
//! through the CPU fallback, and prints the worst differences it saw (the
//! figures in `docs/accuracy.md`).
//!
//! A bad index makes the GPU's kernel hand the op to the CPU's, whose
//! error it is; that run is a fallback too, so the bad-index cases come
//! last in the one test that checks those ops' fallbacks.

use crate::on_the_gpu::{assert_close, cpu, gpu, values};
use stagecraft::layers::ops::{self, OpAttrs};
use stagecraft::layers::runtime as rt;
use stagecraft::{
    value_and_grad, BinaryOp, CumsumOptions, DType, Device, Element, ErrorKind, Tensor, UnaryOp,
};

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

/// The worst `|gpu − cpu| / max(1, |cpu|)` (the measure of
/// `docs/accuracy.md`) over the values both devices computed, a NaN
/// matching only a NaN.
fn worst_error(what: &str, got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let mut worst = 0.0f32;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert_eq!(
            g.is_nan(),
            w.is_nan(),
            "{what}: element {i}: GPU {g}, CPU {w}"
        );
        if g != w && !w.is_nan() {
            worst = worst.max((g - w).abs() / w.abs().max(1.0));
        }
    }
    worst
}

fn on<T: Element>(v: &[T], dims: &[usize], d: &Device) -> Tensor<T> {
    Tensor::from_vec(v.to_vec(), dims, d).unwrap()
}

/// The same shape and the same bits (a NaN's included).
fn assert_same_bits(what: &str, got: &Tensor<f32>, want: &Tensor<f32>) {
    assert_eq!(got.dims(), want.dims(), "{what}");
    let bits =
        |t: &Tensor<f32>| -> Vec<u32> { t.to_vec().unwrap().iter().map(|v| v.to_bits()).collect() };
    assert_eq!(bits(got), bits(want), "{what}");
}

/// Indices into an axis of `size`, some negative, repeats included.
fn indices(n: usize, size: usize, seed: u64) -> Vec<i32> {
    values(n, seed, 0.0, 2.0 * size as f32)
        .iter()
        .map(|&v| (v as i32).min(2 * size as i32 - 1) - size as i32)
        .collect()
}

#[test]
fn gathers_and_adds_match_the_cpu_with_gradients_and_bad_indices_are_index_errors() {
    let (gpu, _turn) = gpu();
    let dims = [5usize, 4, 3];
    let xv = values(60, 61, -1.0, 1.0);
    // Gather along each axis, by a 2-D index tensor, i32 and i64.
    for axis in [0isize, 1, 2, -1] {
        let size = dims[axis.rem_euclid(3) as usize];
        let iv = indices(6, size, 62 + axis.unsigned_abs() as u64);
        let i64v: Vec<i64> = iv.iter().map(|&i| i64::from(i)).collect();
        let run = |d: &Device| {
            let x = on(&xv, &dims, d);
            let a = x.gather(axis, &on(&iv, &[2, 3], d));
            let b = x.gather(axis, &on(&i64v, &[6], d));
            (a, b)
        };
        let ((ga, gb), (ca, cb)) = (run(&gpu), run(&cpu()));
        assert_eq!(ga.device(), gpu);
        assert_same_bits(&format!("gather axis {axis}"), &ga, &ca);
        assert_same_bits(&format!("gather axis {axis}, i64"), &gb, &cb);
    }
    // Gathers move words: 4-byte integers and 8-byte elements too.
    let ints: Vec<i32> = (0..60).collect();
    let longs: Vec<i64> = (0..60).map(|v| v * 3_000_000_000 - 7).collect();
    let iv = indices(4, 4, 63);
    let run = |d: &Device| {
        (
            on(&ints, &dims, d)
                .gather(1, &on(&iv, &[4], d))
                .to_vec()
                .unwrap(),
            on(&longs, &dims, d)
                .gather(2, &on(&iv[..2], &[2], d))
                .to_vec()
                .unwrap(),
            on(&longs, &dims, d)
                .take_along_axis(0, &on(&[4i32, -1, 0], &[1, 1, 3], d))
                .to_vec()
                .unwrap(),
        )
    };
    let words = run(&gpu);
    assert_eq!(words, run(&cpu()));
    assert_eq!(words.2, vec![longs[48], longs[49], longs[2]]);
    // Gather-elements along each axis, indices smaller than x off the axis.
    for (axis, index_dims) in [(0isize, [7usize, 4, 2]), (1, [3, 6, 3]), (-1, [5, 2, 4])] {
        let size = dims[axis.rem_euclid(3) as usize];
        let n: usize = index_dims.iter().product();
        let iv = indices(n, size, 64 + n as u64);
        let run = |d: &Device| on(&xv, &dims, d).take_along_axis(axis, &on(&iv, &index_dims, d));
        assert_same_bits(
            &format!("gather-elements axis {axis}"),
            &run(&gpu),
            &run(&cpu()),
        );
    }
    // Scatter-add and index-add, with repeated indices: every sum in the
    // CPU's order, so the same bits.
    for (axis, index_dims) in [(0isize, [9usize, 4, 2]), (1, [5, 7, 3]), (-1, [2, 3, 8])] {
        let size = dims[axis.rem_euclid(3) as usize];
        let n: usize = index_dims.iter().product();
        let (iv, sv) = (indices(n, size, 65 + n as u64), values(n, 66, -1.0, 1.0));
        let run = |d: &Device| {
            on(&xv, &dims, d).scatter_add(axis, &on(&iv, &index_dims, d), &on(&sv, &index_dims, d))
        };
        assert_same_bits(
            &format!("scatter-add axis {axis}"),
            &run(&gpu),
            &run(&cpu()),
        );
    }
    for axis in [0isize, 1, 2] {
        let size = dims[axis as usize];
        let mut src_dims = dims;
        src_dims[axis as usize] = 9;
        let n: usize = src_dims.iter().product();
        let iv = indices(9, size, 67 + axis as u64);
        let i64v: Vec<i64> = iv.iter().map(|&i| i64::from(i)).collect();
        let sv = values(n, 68, -1.0, 1.0);
        let run = |d: &Device| {
            let (x, s) = (on(&xv, &dims, d), on(&sv, &src_dims, d));
            (
                x.index_add(axis, &on(&iv, &[9], d), &s),
                x.index_add(axis, &on(&i64v, &[9], d), &s),
            )
        };
        let ((ga, gb), (ca, cb)) = (run(&gpu), run(&cpu()));
        assert_same_bits(&format!("index-add axis {axis}"), &ga, &ca);
        assert_same_bits(&format!("index-add axis {axis}, i64"), &gb, &cb);
    }
    // Gradients: a gather's is an index-add, a gather-elements' a
    // scatter-add, and the adds' gradients for `src` are the gathers.
    let wv = values(60, 69, 0.5, 1.5);
    let iv = indices(8, 5, 70);
    let ev = indices(60, 5, 71);
    let sv = values(8 * 12, 72, -1.0, 1.0);
    let run = |d: &Device| {
        let x = on(&xv, &dims, d);
        let w = on(&wv, &dims, d);
        let idx = on(&iv, &[8], d);
        let elements = on(&ev, &dims, d);
        let weighted = |t: Tensor<f32>| {
            (&t * &on(
                &values(t.dims().iter().product(), 73, 0.5, 1.5),
                t.dims(),
                d,
            ))
                .sum(&[], false)
        };
        let grads = [
            value_and_grad(|x: &Tensor<f32>| weighted(x.gather(0, &idx)))(&x).1,
            value_and_grad(|x: &Tensor<f32>| weighted(x.take_along_axis(0, &elements)))(&x).1,
            value_and_grad(|s: &Tensor<f32>| weighted(w.index_add(0, &idx, s)))(&on(
                &sv,
                &[8, 4, 3],
                d,
            ))
            .1,
            value_and_grad(|s: &Tensor<f32>| weighted(w.scatter_add(0, &elements, s)))(&x).1,
        ];
        grads.map(|g| (g.device(), g.to_vec().unwrap()))
    };
    let mut worst_grad = 0.0f32;
    for (k, ((gd, g), (_, c))) in run(&gpu).iter().zip(run(&cpu()).iter()).enumerate() {
        assert_eq!(*gd, gpu, "gradient {k}");
        assert_close(&format!("gradient {k}"), g, c, 1e-6, 1e-6);
        worst_grad = worst_grad.max(worst_error("gradient", g, c));
    }
    assert_ran_on_the_gpu(&["Gather", "GatherElements", "ScatterAdd", "IndexAdd"]);
    println!("gathers and adds: bit-identical; their gradients: worst {worst_grad:.2e}");

    // Bad indices (last: they fall back): the CPU kernel's Index error.
    let both = |f: &dyn Fn(&Device) -> Tensor<f32>| {
        let (g, c) = (f(&gpu).to_vec(), f(&cpu()).to_vec());
        let (ge, ce) = (g.unwrap_err(), c.unwrap_err());
        assert_eq!(ge.kind(), ErrorKind::Index, "{ge}");
        assert_eq!(ce.kind(), ErrorKind::Index, "{ce}");
    };
    both(&|d| on(&xv, &dims, d).gather(0, &on(&[0i32, 5], &[2], d)));
    both(&|d| on(&xv, &dims, d).gather(2, &on(&[-4i64], &[1], d)));
    both(&|d| on(&xv, &dims, d).take_along_axis(1, &on(&[0i32, 4], &[1, 2, 1], d)));
    both(&|d| {
        on(&xv, &dims, d).scatter_add(
            0,
            &on(&[1i32, -6], &[2, 1, 1], d),
            &on(&[1.0, 2.0], &[2, 1, 1], d),
        )
    });
    both(&|d| {
        on(&xv, &[5, 12], d).index_add(0, &on(&[7i32], &[1], d), &on(&[1.0; 12], &[1, 12], d))
    });
}

#[test]
fn argmax_and_argmin_match_the_cpu_on_ties_and_nans() {
    let (gpu, _turn) = gpu();
    // Few distinct values, so ties are everywhere; NaNs in some lines.
    let dims = [6usize, 100];
    let mut xv: Vec<f32> = values(600, 81, -3.0, 3.0)
        .iter()
        .map(|v| v.round())
        .collect();
    for at in [5, 17, 250, 251, 260, 599] {
        xv[at] = f32::NAN;
    }
    xv[300..400].fill(f32::NEG_INFINITY);
    let iv: Vec<i32> = xv
        .iter()
        .map(|&v| if v.is_nan() { 9 } else { v as i32 })
        .collect();
    let run = |d: &Device| {
        let (x, i) = (on(&xv, &dims, d), on(&iv, &dims, d));
        let mut out = Vec::new();
        for axis in [0isize, 1, -1] {
            for keep in [false, true] {
                for t in [
                    x.argmax(axis, keep),
                    x.argmin(axis, keep),
                    i.argmax(axis, keep),
                    i.argmin(axis, keep),
                ] {
                    out.push((t.dims().to_vec(), t.device(), t.to_vec().unwrap()));
                }
            }
        }
        // A line of one element, and a rank-3 middle axis.
        let x3 = on(&xv, &[3, 20, 10], d);
        for t in [
            x3.argmax(1, false),
            x3.argmin(1, true),
            on(&xv[..3], &[3, 1], d).argmax(1, false),
        ] {
            out.push((t.dims().to_vec(), t.device(), t.to_vec().unwrap()));
        }
        out
    };
    let (g, c) = (run(&gpu), run(&cpu()));
    for (k, (g, c)) in g.iter().zip(&c).enumerate() {
        assert_eq!(g.1, gpu, "case {k}");
        assert_eq!((&g.0, &g.2), (&c.0, &c.2), "case {k}");
    }
    assert_ran_on_the_gpu(&["ArgMax", "ArgMin"]);
    println!("argmax, argmin: identical positions in {} cases", g.len());
}

#[test]
fn concat_trilu_cumsum_and_one_hot_match_the_cpu() {
    let (gpu, _turn) = gpu();
    // Concat of 4- and 8-byte elements along each axis, three inputs.
    for axis in [0usize, 1, 2] {
        let shapes: Vec<Vec<usize>> = [2usize, 1, 3]
            .iter()
            .map(|&n| {
                let mut s = vec![2usize, 3, 4];
                s[axis] = n;
                s
            })
            .collect();
        let run = |d: &Device| {
            let mut floats = Vec::new();
            let mut longs = Vec::new();
            for (k, s) in shapes.iter().enumerate() {
                let n: usize = s.iter().product();
                floats.push(on(&values(n, 91 + k as u64, -1.0, 1.0), s, d));
                let v: Vec<i64> = (0..n as i64)
                    .map(|v| (v + 100 * k as i64) * 3_000_000_019)
                    .collect();
                longs.push(on(&v, s, d));
            }
            let (f, l): (Vec<&Tensor<f32>>, Vec<&Tensor<i64>>) =
                (floats.iter().collect(), longs.iter().collect());
            (
                Tensor::concat(&f, axis as isize),
                Tensor::concat(&l, axis as isize).to_vec().unwrap(),
            )
        };
        let ((gf, gl), (cf, cl)) = (run(&gpu), run(&cpu()));
        assert_same_bits(&format!("concat axis {axis}"), &gf, &cf);
        assert_eq!(gl, cl, "concat of i64, axis {axis}");
    }
    // Lower and upper triangles of every element width, batched.
    let tv = values(2 * 5 * 7, 94, -2.0, 2.0);
    let halves: Vec<stagecraft::f16> = tv.iter().map(|&v| stagecraft::f16::from_f32(v)).collect();
    let longs: Vec<i64> = tv.iter().map(|&v| (v * 1e9) as i64 * 1000).collect();
    for k in [-7i64, -2, 0, 1, 3, 100] {
        let run = |d: &Device| {
            let x = on(&tv, &[2, 5, 7], d);
            let mask = x.gt(&Tensor::scalar(0.0f32, d));
            (
                [x.tril(k).to_vec().unwrap(), x.triu(k).to_vec().unwrap()],
                [
                    mask.tril(k).to_vec().unwrap(),
                    mask.triu(k).to_vec().unwrap(),
                ],
                on(&halves, &[2, 5, 7], d).triu(k).to_vec().unwrap(),
                on(&longs, &[2, 5, 7], d).tril(k).to_vec().unwrap(),
            )
        };
        assert_eq!(run(&gpu), run(&cpu()), "trilu k {k}");
    }
    // Running sums along each axis, exclusive and reversed, and one long
    // line, whose f32 total would drift from the CPU's f64 one.
    let sv = values(4 * 6 * 5, 95, -10.0, 10.0);
    let long = values(20_000, 96, 0.0, 1.0);
    let mut worst_cumsum = 0.0f32;
    for axis in [0isize, 1, 2] {
        for (exclusive, reverse) in [(false, false), (true, false), (false, true), (true, true)] {
            let options = CumsumOptions { exclusive, reverse };
            let run = |d: &Device| {
                on(&sv, &[4, 6, 5], d)
                    .cumsum_with(axis, options)
                    .to_vec()
                    .unwrap()
            };
            let (g, c) = (run(&gpu), run(&cpu()));
            assert_close(
                &format!("cumsum axis {axis} {options:?}"),
                &g,
                &c,
                1e-6,
                1e-6,
            );
            worst_cumsum = worst_cumsum.max(worst_error("cumsum", &g, &c));
        }
    }
    let run = |d: &Device| on(&long, &[20_000], d).cumsum(0).to_vec().unwrap();
    let (g, c) = (run(&gpu), run(&cpu()));
    assert_close("cumsum of 20000", &g, &c, 2e-7, 0.0);
    let worst_long = worst_error("cumsum", &g, &c) / c[c.len() - 1].abs().max(1.0);
    // Infinities and NaNs pass as on the CPU.
    let edge = [1.0f32, f32::INFINITY, 2.0, f32::NAN, 3.0];
    let run = |d: &Device| on(&edge, &[5], d).cumsum(0).to_vec().unwrap();
    assert_close("cumsum of inf and NaN", &run(&gpu), &run(&cpu()), 0.0, 0.0);
    // Gradients of a running sum and a triangle.
    let run = |d: &Device| {
        let w = on(&values(30, 97, 0.5, 1.5), &[5, 6], d);
        let x = on(&sv[..30], &[5, 6], d);
        let (_, g) =
            value_and_grad(|x: &Tensor<f32>| (&x.cumsum(1).tril(1) * &w).sum(&[], false))(&x);
        (g.device(), g.to_vec().unwrap())
    };
    let ((gd, g), (_, c)) = (run(&gpu), run(&cpu()));
    assert_eq!(gd, gpu);
    assert_close("cumsum and tril gradient", &g, &c, 1e-6, 1e-6);
    worst_cumsum = worst_cumsum.max(worst_error("gradient", &g, &c));
    // One-hot into f32, i32 and i64, from i32 and i64 indices.
    let classes = [3i32, 0, 4, 4, 1, 2];
    let run = |d: &Device| {
        let i = on(&classes, &[2, 3], d);
        let l = on(&classes.map(i64::from), &[6], d);
        (
            i.one_hot::<f32>(5).to_vec().unwrap(),
            i.one_hot::<i32>(6).to_vec().unwrap(),
            l.one_hot::<i64>(5).to_vec().unwrap(),
            l.one_hot::<f64>(5).to_vec().unwrap(),
        )
    };
    assert_eq!(run(&gpu), run(&cpu()));
    assert_ran_on_the_gpu(&["Concat", "Trilu", "Cumsum", "OneHot"]);
    println!(
        "concat, trilu, one-hot: identical; cumsum: worst {worst_cumsum:.2e}, \
         over 20000 elements {worst_long:.2e} of the total"
    );
    // A class out of range (last: it falls back): the CPU kernel's error.
    let bad = |d: &Device| {
        on(&[1i32, 5], &[2], d)
            .one_hot::<f32>(5)
            .to_vec()
            .unwrap_err()
    };
    let (ge, ce) = (bad(&gpu), bad(&cpu()));
    assert_eq!(ge.kind(), ErrorKind::Index, "{ge}");
    assert_eq!(ge.kind(), ce.kind());
}

/// The domain and error bound of each unary op, as in the GPU's unary
/// kernel test: `|gpu − cpu| <= bound · max(1, |cpu|)`.
fn unary_case(op: UnaryOp) -> (f32, f32, f32) {
    let (lo, hi) = match op {
        UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Rsqrt | UnaryOp::Reciprocal => (1e-3, 100.0),
        UnaryOp::Log1p => (-0.99, 100.0),
        UnaryOp::Asin | UnaryOp::Acos => (-1.0, 1.0),
        UnaryOp::Exp | UnaryOp::Expm1 => (-80.0, 80.0),
        UnaryOp::Sin | UnaryOp::Cos => (-20.0, 20.0),
        UnaryOp::Erf | UnaryOp::Gelu | UnaryOp::GeluTanh => (-8.0, 8.0),
        _ => (-30.0, 30.0),
    };
    let bound = match op {
        UnaryOp::Exp | UnaryOp::Expm1 => 8e-6,
        UnaryOp::GeluTanh => 1e-6,
        _ => 5e-7,
    };
    (lo, hi, bound)
}

/// Runs `FusedElementwise` with `program` over `inputs` (values and
/// dims) on `d`, through the runtime: the fusion pass makes the op only
/// inside graph functions, which a GPU runs unfused.
fn fused(program: &[i64], inputs: &[(&[f32], &[usize])], d: &Device) -> (Device, Vec<f32>) {
    let mut attrs = OpAttrs::new();
    attrs.set_ints("program", program);
    let args = inputs
        .iter()
        .map(|(v, dims)| on(v, dims, d).handle().clone())
        .collect();
    let location = stagecraft::Location::caller();
    let out = rt::execute(&ops::FUSED_ELEMENTWISE, *d, location, args, (&attrs).into());
    let t = Tensor::<f32>::try_from_handle(out[0].clone()).unwrap();
    (t.device(), t.to_vec().unwrap())
}

fn unary_code(op: UnaryOp) -> i64 {
    ops::FUSED_UNARY.iter().position(|&u| u == op).unwrap() as i64
}

fn binary_code(op: BinaryOp) -> i64 {
    ops::FUSED_BINARY_BASE + ops::FUSED_BINARY.iter().position(|&b| b == op).unwrap() as i64
}

#[test]
fn fused_elementwise_programs_match_the_cpu_interpreter() {
    let (gpu, _turn) = gpu();
    let float = |class: ops::DTypeClass| class.accepts(DType::F32);
    let mut measured = Vec::new();
    // Every unary op alone, NaN included: within the unary kernel's bound.
    for &op in ops::FUSED_UNARY {
        if op.wgsl().is_none() || !float(op.class()) {
            continue;
        }
        let (lo, hi, bound) = unary_case(op);
        let mut xs = values(1000, 101, lo, hi);
        xs.extend([0.0, 1e-7, -1e-7, 0.5, -0.5, f32::NAN]);
        xs.retain(|x| x.is_nan() || (lo..=hi).contains(x));
        let input: [(&[f32], &[usize]); 1] = [(&xs, &[xs.len()])];
        let (gd, g) = fused(&[unary_code(op), 0, 0], &input, &gpu);
        let (_, c) = fused(&[unary_code(op), 0, 0], &input, &cpu());
        assert_eq!(gd, gpu, "{op:?}");
        let worst = worst_error(&format!("{op:?}"), &g, &c);
        assert!(worst <= bound, "{op:?}: {worst:e} > {bound:e}");
        measured.push(format!("{op:?} {worst:.1e}"));
    }
    assert!(measured.len() >= 25, "{measured:?}");
    // Every binary op over a broadcast row, and every comparison (1 or 0,
    // NaN false) with ties and NaNs.
    let (rows, cols) = (40usize, 13usize);
    for &op in ops::FUSED_BINARY {
        if op.wgsl().is_none() || !float(op.class()) {
            continue;
        }
        let (lo, hi) = if op == BinaryOp::Pow {
            (0.1, 3.0)
        } else {
            (-3.0, 3.0)
        };
        let (a, b) = (values(rows * cols, 102, lo, hi), values(cols, 103, lo, hi));
        let input: [(&[f32], &[usize]); 2] = [(&a, &[rows, cols]), (&b, &[cols])];
        let program = [binary_code(op), 0, 1];
        let ((_, g), (_, c)) = (
            fused(&program, &input, &gpu),
            fused(&program, &input, &cpu()),
        );
        assert_close(&format!("{op:?}"), &g, &c, 4e-6, 1e-6);
        measured.push(format!(
            "{op:?} {:.1e}",
            worst_error(&format!("{op:?}"), &g, &c)
        ));
    }
    let mut a: Vec<f32> = values(rows * cols, 104, -2.0, 2.0)
        .iter()
        .map(|v| v.round())
        .collect();
    a[3] = f32::NAN;
    let b: Vec<f32> = vec![
        0.0,
        1.0,
        f32::NAN,
        -1.0,
        2.0,
        0.0,
        1.0,
        -2.0,
        0.0,
        1.0,
        0.0,
        1.0,
        0.0,
    ];
    for k in 0..ops::FUSED_COMPARE.len() {
        let input: [(&[f32], &[usize]); 2] = [(&a, &[rows, cols]), (&b, &[cols])];
        let program = [ops::FUSED_COMPARE_BASE + k as i64, 0, 1];
        let ((_, g), (_, c)) = (
            fused(&program, &input, &gpu),
            fused(&program, &input, &cpu()),
        );
        assert_eq!(g, c, "{:?}", ops::FUSED_COMPARE[k]);
    }
    // A program over all four read modes: x (full), a bias row (tile), a
    // value per row (repeat) and a scalar, reusing registers:
    // relu((x + bias) * per_row - s) * (x > s) + tanh(x).
    let x = values(rows * cols, 105, -2.0, 2.0);
    let (bias, per_row, s) = (
        values(cols, 106, -1.0, 1.0),
        values(rows, 107, 0.5, 1.5),
        [0.25f32],
    );
    let input: [(&[f32], &[usize]); 4] = [
        (&x, &[rows, cols]),
        (&bias, &[cols]),
        (&per_row, &[rows, 1]),
        (&s, &[]),
    ];
    let gt = ops::FUSED_COMPARE_BASE
        + ops::FUSED_COMPARE
            .iter()
            .position(|c| *c == ops::CompareOp::Gt)
            .unwrap() as i64;
    let program = [
        binary_code(BinaryOp::Add),
        0,
        1,
        binary_code(BinaryOp::Mul),
        4,
        2,
        binary_code(BinaryOp::Sub),
        5,
        3,
        unary_code(UnaryOp::Relu),
        6,
        0,
        gt,
        0,
        3,
        binary_code(BinaryOp::Mul),
        7,
        8,
        unary_code(UnaryOp::Tanh),
        0,
        0,
        binary_code(BinaryOp::Add),
        9,
        10,
    ];
    let ((gd, g), (_, c)) = (
        fused(&program, &input, &gpu),
        fused(&program, &input, &cpu()),
    );
    assert_eq!(gd, gpu);
    assert_close("mixed program", &g, &c, 2e-6, 1e-6);
    measured.push(format!("mixed {:.1e}", worst_error("mixed", &g, &c)));
    assert_ran_on_the_gpu(&["FusedElementwise"]);
    println!(
        "fused, worst |Δ|/max(1, |cpu|) per op: {}",
        measured.join(", ")
    );
}
