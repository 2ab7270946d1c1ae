//! `sort`, `argsort`, `topk`, `var`, `std`, `conv1d` and
//! `conv_transpose2d` through the public API: values against hand-derived
//! or reference results, the same bits on the eager device, on the lazy
//! device and inside `function`, and `var`'s accuracy against the exact
//! variance.

use stagecraft::layers::cpu::reference::nn as reference;
use stagecraft::{
    function, grad, Conv1dOptions, Conv2dOptions, ConvTranspose2dOptions, Device, Tensor,
};

type T = Tensor<f32>;

/// Values in [-2, 2) from a seed (an LCG), some repeated so sorts meet ties.
fn seeded(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005) ^ 0x9e37_79b9_7f4a_7c15;
    (0..n)
        .map(|i| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let v = ((s >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0;
            if i % 5 == 0 {
                v.round()
            } else {
                v
            }
        })
        .collect()
}

/// Every new op once, on `inputs[0]: [4, 6]`, `inputs[1]: [2, 3, 9]`
/// (conv1d input), `inputs[2]: [3, 3, 3]` (its filter), `inputs[3]: [1,
/// 2, 3, 4]` (conv_transpose2d input) and `inputs[4]: [2, 3, 2, 2]` (its
/// filter).
fn program(inputs: &[T]) -> Vec<T> {
    let x = &inputs[0];
    let (values, indices) = x.sort(1, true);
    let (top, top_at) = x.topk(3, 0, false, false);
    let conv1 = inputs[1].conv1d(
        &inputs[2],
        Conv1dOptions {
            stride: 2,
            padding: 1,
            dilation: 2,
            groups: 1,
        },
    );
    let up = inputs[3].conv_transpose2d(
        &inputs[4],
        ConvTranspose2dOptions {
            stride: [2, 3],
            padding: [1, 0],
            output_padding: [1, 2],
            dilation: [1, 1],
            groups: 2,
        },
    );
    vec![
        values,
        indices.cast::<f32>(),
        x.argsort(0, false).cast::<f32>(),
        top,
        top_at.cast::<f32>(),
        x.var(&[1], true, 1),
        x.std(&[], false, 0),
        conv1,
        up,
    ]
}

fn inputs(d: &Device) -> Vec<T> {
    [
        &[4usize, 6][..],
        &[2, 3, 9],
        &[3, 3, 3],
        &[1, 2, 3, 4],
        &[2, 3, 2, 2],
    ]
    .iter()
    .enumerate()
    .map(|(i, dims)| Tensor::from_vec(seeded(dims.iter().product(), i as u64), dims, d).unwrap())
    .collect()
}

fn bits(results: &[T]) -> Vec<(Vec<usize>, Vec<u32>)> {
    results
        .iter()
        .map(|t| {
            let v = t.to_vec().unwrap();
            (t.dims().to_vec(), v.iter().map(|x| x.to_bits()).collect())
        })
        .collect()
}

#[test]
fn eager_lazy_and_function_agree_bitwise() {
    let cpu = Device::cpu();
    let eager = bits(&program(&inputs(&cpu)));
    let lazy = Device::lazy(&cpu);
    assert_eq!(bits(&program(&inputs(&lazy))), eager, "lazy");
    let staged = function(|xs: Vec<T>| program(&xs));
    assert_eq!(bits(&staged.call(inputs(&cpu))), eager, "function");
    // Again, from the caches.
    assert_eq!(bits(&staged.call(inputs(&cpu))), eager, "function, cached");
    assert_eq!(bits(&program(&inputs(&lazy))), eager, "lazy, cached");
}

#[test]
fn gradients_agree_across_modes() {
    let cpu = Device::cpu();
    let loss = |x: &Tensor<f64>| {
        let (top, _) = x.topk(2, 1, true, true);
        let s = x.sort(0, false).0;
        (&top * &top).sum(&[], false)
            + (&s * 0.5).sum(&[], false)
            + x.std(&[1], false, 1).sum(&[], false)
    };
    let x = Tensor::<f64>::from_vec(
        (0..12).map(|i| ((i * 7) % 12) as f64 * 0.3 - 1.0).collect(),
        &[3, 4],
        &cpu,
    )
    .unwrap();
    let eager = grad(loss)(&x).to_vec().unwrap();
    let lazy = Device::lazy(&cpu);
    let on_lazy = Tensor::from_vec(x.to_vec().unwrap(), &[3, 4], &lazy).unwrap();
    assert_eq!(grad(loss)(&on_lazy).to_vec().unwrap(), eager);
    let staged = function(move |x: Tensor<f64>| loss(&x));
    assert_eq!(
        grad(|x: &Tensor<f64>| staged.call(x.clone()))(&x)
            .to_vec()
            .unwrap(),
        eager
    );
}

#[test]
fn sort_and_topk_values() {
    let cpu = Device::cpu();
    let x = Tensor::<f32>::from_vec(
        vec![3.0, f32::NAN, -1.0, 3.0, 0.0, -0.0, 2.0, f32::NAN],
        &[2, 4],
        &cpu,
    )
    .unwrap();
    let (v, i) = x.sort(1, false);
    let v = v.to_vec().unwrap();
    assert_eq!(&v[..3], &[-1.0, 3.0, 3.0]);
    assert!(v[3].is_nan());
    assert_eq!(i.to_vec().unwrap(), vec![2, 0, 3, 1, 0, 1, 2, 3]);
    // Descending: NaN first, equal values (0.0 and -0.0) in their order.
    let (_, i) = x.sort(-1, true);
    assert_eq!(i.to_vec().unwrap(), vec![1, 0, 3, 2, 3, 2, 0, 1]);
    let (v, i) = x.topk(2, 1, false, true);
    assert_eq!(v.to_vec().unwrap()[..2], [-1.0, 3.0]);
    assert_eq!(i.to_vec().unwrap(), vec![2, 0, 0, 1]);
    // Integers, along the first axis.
    let n = Tensor::<i64>::from_vec(vec![5, 1, 5, 0, 2, 9], &[3, 2], &cpu).unwrap();
    let (v, i) = n.topk(2, 0, true, false);
    assert_eq!(v.to_vec().unwrap(), vec![5, 1, 5, 9]);
    assert_eq!(i.to_vec().unwrap(), vec![0, 0, 1, 2]);
}

/// The gradient of sort's values lands where each value came from; a
/// `topk`'s unselected entries get zero.
#[test]
fn sort_gradients_scatter_back() {
    let cpu = Device::cpu();
    let x = Tensor::<f64>::from_vec(vec![0.3, -1.0, 2.0, 0.5], &[4], &cpu).unwrap();
    let w = Tensor::<f64>::from_vec(vec![1.0, 10.0, 100.0, 1000.0], &[4], &cpu).unwrap();
    let g = grad(|x: &Tensor<f64>| (x.sort(0, false).0 * &w).sum(&[], false))(&x);
    // Sorted order: -1.0 (1), 0.3 (0), 0.5 (3), 2.0 (2).
    assert_eq!(g.to_vec().unwrap(), vec![10.0, 1.0, 1000.0, 100.0]);
    let w2 = Tensor::<f64>::from_vec(vec![1.0, 10.0], &[2], &cpu).unwrap();
    let g = grad(|x: &Tensor<f64>| (x.topk(2, 0, true, true).0 * &w2).sum(&[], false))(&x);
    assert_eq!(g.to_vec().unwrap(), vec![0.0, 0.0, 1.0, 10.0]);
}

/// `var` of f32 values stays within 8 ulp of the exact variance of those
/// values (computed in f64 from the f32 inputs, exact to far below an f32
/// ulp), including values far from zero whose mean is rounded.
#[test]
fn var_is_accurate_for_f32() {
    let cpu = Device::cpu();
    for (offset, spread) in [(0.0f64, 1.0f64), (1e4, 0.1), (-3e5, 7.0), (1.0, 1e-3)] {
        for n in [2usize, 7, 100, 4099] {
            let raw: Vec<f32> = seeded(n, n as u64)
                .iter()
                .map(|&v| (offset + spread * v as f64) as f32)
                .collect();
            let x = Tensor::from_vec(raw.clone(), &[n], &cpu).unwrap();
            let wide: Vec<f64> = raw.iter().map(|&v| v as f64).collect();
            let mean = wide.iter().sum::<f64>() / n as f64;
            let dev: Vec<f64> = wide.iter().map(|v| v - mean).collect();
            let exact = (dev.iter().map(|d| d * d).sum::<f64>()
                - dev.iter().sum::<f64>().powi(2) / n as f64)
                / (n - 1) as f64;
            let got = x.var(&[], false, 1).item().unwrap() as f64;
            let ulp = (exact as f32).abs().max(f32::MIN_POSITIVE);
            let ulp = (f32::from_bits(ulp.to_bits() + 1) - ulp) as f64;
            assert!(
                (got - exact).abs() <= 8.0 * ulp,
                "offset {offset}, spread {spread}, n {n}: {got} vs {exact} ({} ulp)",
                (got - exact).abs() / ulp
            );
        }
    }
}

/// conv1d is the height-1 conv2d.
#[test]
fn conv1d_matches_the_reference_conv2d() {
    let cpu = Device::cpu();
    let x = Tensor::<f64>::from_vec(
        (0..2 * 4 * 11).map(|i| (i % 7) as f64 - 3.0).collect(),
        &[2, 4, 11],
        &cpu,
    )
    .unwrap();
    let w = Tensor::<f64>::from_vec(
        (0..6 * 2 * 3).map(|i| (i % 5) as f64 * 0.5 - 1.0).collect(),
        &[6, 2, 3],
        &cpu,
    )
    .unwrap();
    let options = Conv1dOptions {
        stride: 2,
        padding: 2,
        dilation: 3,
        groups: 2,
    };
    let y = x.conv1d(&w, options);
    let want = reference::conv2d(
        &x.to_vec().unwrap(),
        [2, 4, 1, 11],
        &w.to_vec().unwrap(),
        [6, 2, 1, 3],
        [1, 2],
        [0, 2],
        [1, 3],
        2,
    );
    // (11 + 4 - 3·2 - 1) / 2 + 1 = 5
    assert_eq!(y.dims(), &[2, 6, 5]);
    assert_eq!(y.to_vec().unwrap(), want);
}

/// conv_transpose2d is the adjoint of conv2d: ⟨conv2d(y, w), x⟩ =
/// ⟨y, conv_transpose2d(x, w)⟩, and it matches the direct reference.
#[test]
fn conv_transpose2d_is_the_adjoint_of_conv2d() {
    let cpu = Device::cpu();
    let x = Tensor::<f64>::from_vec(
        seeded(2 * 4 * 3 * 5, 9).iter().map(|&v| v as f64).collect(),
        &[2, 4, 3, 5],
        &cpu,
    )
    .unwrap();
    let w = Tensor::<f64>::from_vec(
        seeded(4 * 3 * 2 * 3, 10)
            .iter()
            .map(|&v| v as f64)
            .collect(),
        &[4, 3, 2, 3],
        &cpu,
    )
    .unwrap();
    let t = ConvTranspose2dOptions {
        stride: [2, 2],
        padding: [1, 0],
        output_padding: [1, 0],
        dilation: [2, 1],
        groups: 2,
    };
    let up = x.conv_transpose2d(&w, t);
    // H: (3-1)·2 - 2 + 2·1 + 1 + 1 = 6; W: (5-1)·2 + 2 + 0 + 1 = 11.
    assert_eq!(up.dims(), &[2, 6, 6, 11]);
    let (want, dims) = reference::conv_transpose2d(
        &x.to_vec().unwrap(),
        [2, 4, 3, 5],
        &w.to_vec().unwrap(),
        [4, 3, 2, 3],
        t.stride,
        t.padding,
        t.output_padding,
        t.dilation,
        t.groups,
    );
    assert_eq!(dims, up.dims());
    let got = up.to_vec().unwrap();
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() <= 1e-12 * (1.0 + w.abs()), "{g} vs {w}");
    }
    let y = Tensor::<f64>::from_vec(
        seeded(2 * 6 * 6 * 11, 11)
            .iter()
            .map(|&v| v as f64)
            .collect(),
        &[2, 6, 6, 11],
        &cpu,
    )
    .unwrap();
    let c = Conv2dOptions {
        stride: t.stride,
        padding: t.padding,
        dilation: t.dilation,
        groups: t.groups,
    };
    let lhs = (y.conv2d(&w, c) * &x).sum(&[], false).item().unwrap();
    let rhs = (&y * &up).sum(&[], false).item().unwrap();
    assert!(
        (lhs - rhs).abs() <= 1e-10 * lhs.abs().max(1.0),
        "{lhs} vs {rhs}"
    );
}
