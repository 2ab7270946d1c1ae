//! conv kernels on the GPU against the CPU: convolution (forward, both
//! gradients, transposed) and max/average pooling (forward and
//! gradients), over strides, padding, dilation, groups, odd sizes and
//! batches, with NaN where the CPU puts it. Each geometry is chosen to
//! reach one of the kernel's launch shapes: one thread per result (a few
//! channels per group), tiles of 16, 32 and 64 rows, several tiles, and
//! filter gradients long enough to be summed in splits.

use crate::on_the_gpu::{assert_close, cpu, gpu, values};
use stagecraft::layers::runtime as rt;
use stagecraft::{
    value_and_grad, Conv2dOptions, ConvTranspose2dOptions, Device, Pool2dOptions, Tensor,
};

/// The ops of this family, as `cpu_fallbacks` names them.
const OPS: &[&str] = &[
    "Conv2d",
    "Conv2dBackpropInput",
    "Conv2dBackpropFilter",
    "ConvTranspose2d",
    "MaxPool2d",
    "AvgPool2d",
    "MaxPool2dGrad",
    "AvgPool2dGrad",
];

/// Fails if an f32 op of this family ran on the CPU for want of a GPU
/// kernel (other dtypes fall back on purpose, see
/// `other_dtypes_run_on_the_cpu_with_its_answer`).
fn assert_ran_on_the_gpu() {
    let fallbacks = rt::cpu_fallbacks();
    let fell_back: Vec<&String> = fallbacks
        .iter()
        .filter(|f| OPS.iter().any(|op| f.starts_with(&format!("{op}[F32"))))
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
            if w.is_finite() {
                let d = (g - w).abs();
                self.abs = self.abs.max(d);
                self.rel = self.rel.max(d / w.abs().max(1.0));
            }
        }
    }

    fn report(&self, what: &str) {
        println!(
            "{what}: max abs {:.2e}, max |Δ|/max(1, |cpu|) {:.2e}",
            self.abs, self.rel
        );
    }
}

/// Runs `f` on the GPU and on the CPU: the values of what each returns,
/// tensor by tensor, as (GPU, CPU). The GPU's results must stay on the
/// GPU.
fn on_both(gpu: &Device, f: impl Fn(&Device) -> Vec<Tensor<f32>>) -> Vec<(Vec<f32>, Vec<f32>)> {
    let (got, want) = (f(gpu), f(&cpu()));
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(&want)
        .map(|(g, w)| {
            assert_eq!(g.device(), *gpu);
            assert_eq!(g.dims(), w.dims());
            (g.to_vec().unwrap(), w.to_vec().unwrap())
        })
        .collect()
}

/// Compares GPU and CPU values within `tol` (relative and absolute; NaN
/// only where the CPU has NaN) and adds the differences to `worst`.
fn check(what: &str, (got, want): &(Vec<f32>, Vec<f32>), tol: f32, worst: &mut Worst) {
    assert_close(what, got, want, tol, tol);
    worst.add(got, want);
}

fn tensor(v: &[f32], dims: &[usize], d: &Device) -> Tensor<f32> {
    Tensor::from_vec(v.to_vec(), dims, d).unwrap()
}

/// A convolution geometry: the image, the output channels, the kernel.
#[derive(Clone, Copy, Debug)]
struct Case {
    x: [usize; 4],
    o: usize,
    k: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
    groups: usize,
}

impl Case {
    fn options(&self) -> Conv2dOptions {
        Conv2dOptions {
            stride: self.stride,
            padding: self.padding,
            dilation: self.dilation,
            groups: self.groups,
        }
    }

    fn w(&self) -> [usize; 4] {
        [self.o, self.x[1] / self.groups, self.k[0], self.k[1]]
    }

    fn out(&self) -> [usize; 4] {
        let dim = |i: usize| {
            let span = self.dilation[i] * (self.k[i] - 1) + 1;
            (self.x[2 + i] + 2 * self.padding[i] - span) / self.stride[i] + 1
        };
        [self.x[0], self.o, dim(0), dim(1)]
    }
}

#[allow(clippy::too_many_arguments)]
const fn case(
    x: [usize; 4],
    o: usize,
    k: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
    groups: usize,
) -> Case {
    Case {
        x,
        o,
        k,
        stride,
        padding,
        dilation,
        groups,
    }
}

/// Geometries over the kernel's launch shapes (M is the output channels
/// per group for the forward and filter products, the input channels per
/// group for the input gradient).
const CASES: &[Case] = &[
    // 8 filters: 16-row tiles; the input gradient (3 channels) a thread
    // per result; two column tiles.
    case([2, 3, 9, 7], 8, [3, 3], [1, 1], [1, 1], [1, 1], 1),
    // 40 filters (64-row tiles), uneven kernel, stride, padding and
    // dilation along one axis each.
    case([1, 4, 11, 13], 40, [3, 2], [2, 1], [2, 0], [1, 2], 1),
    // Groups of 2 channels and 2 filters, dilation with stride.
    case([3, 6, 8, 8], 6, [3, 3], [1, 2], [1, 1], [2, 1], 3),
    // Depthwise.
    case([2, 8, 10, 10], 8, [3, 3], [1, 1], [1, 1], [1, 1], 8),
    // Pointwise, 24 filters (32-row tiles), 16 channels.
    case([2, 16, 6, 5], 24, [1, 1], [1, 1], [0, 0], [1, 1], 1),
    // 70 filters over one output pixel: two row tiles, one column.
    case([1, 3, 5, 5], 70, [5, 5], [1, 1], [0, 0], [1, 1], 1),
    // A deep sum (K = 180) in many steps, 20 channels and filters.
    case([2, 20, 12, 12], 20, [3, 3], [1, 1], [1, 1], [1, 1], 1),
    // Stride as wide as the window with padding.
    case([2, 4, 7, 7], 6, [3, 3], [3, 3], [1, 1], [1, 1], 1),
    // Dilated taps reaching from padding to padding.
    case([1, 2, 4, 4], 2, [2, 2], [1, 1], [1, 1], [3, 3], 1),
    // 40 input channels: the input gradient in 64-row tiles, stride 2.
    case([1, 40, 6, 6], 4, [3, 3], [2, 2], [1, 1], [1, 1], 1),
    // Long filter gradients (K = 2048), summed in splits: tiled, then a
    // thread per result.
    case([2, 4, 32, 32], 8, [3, 3], [1, 1], [1, 1], [1, 1], 1),
    case([2, 4, 32, 32], 3, [3, 3], [1, 1], [1, 1], [1, 1], 1),
];

/// The bound of `|gpu − cpu|` (relative and absolute): twice the worst
/// measured on lavapipe, sums of up to 2048 products of values in [-1, 1]
/// added in another order than the CPU's.
const CONV_TOL: f32 = 2e-5;

#[test]
fn conv2d_matches_the_cpu() {
    let (gpu, _turn) = gpu();
    let mut worst = Worst::default();
    for (i, c) in CASES.iter().enumerate() {
        let seed = 10 * i as u64;
        let xv = values(c.x.iter().product(), seed, -1.0, 1.0);
        let wv = values(c.w().iter().product(), seed + 1, -1.0, 1.0);
        let results = on_both(&gpu, |d| {
            let (x, w) = (tensor(&xv, &c.x, d), tensor(&wv, &c.w(), d));
            let y = x.conv2d(&w, c.options());
            assert_eq!(y.dims(), c.out(), "{c:?}");
            vec![y]
        });
        check(&format!("conv2d {c:?}"), &results[0], CONV_TOL, &mut worst);
    }
    worst.report("Conv2d");
    assert_ran_on_the_gpu();
}

/// `sum(y · r)` for a fixed random `r`, so the gradient of what made `y`
/// is taken at an output gradient of distinct values.
fn weighted_sum(y: Tensor<f32>, seed: u64) -> Tensor<f32> {
    let r = values(y.dims().iter().product(), seed, -1.0, 1.0);
    let r = tensor(&r, y.dims(), &y.device());
    (&y * &r).sum(&[], false)
}

/// The gradients of `sum(conv2d(x, w) · r)` for x and for w, and the
/// loss, on `d`.
fn conv2d_gradients(c: &Case, xv: &[f32], wv: &[f32], seed: u64, d: &Device) -> Vec<Tensor<f32>> {
    let (x, w) = (tensor(xv, &c.x, d), tensor(wv, &c.w(), d));
    let (loss, dx) =
        value_and_grad(|x: &Tensor<f32>| weighted_sum(x.conv2d(&w, c.options()), seed))(&x);
    let (_, dw) =
        value_and_grad(|w: &Tensor<f32>| weighted_sum(x.conv2d(w, c.options()), seed))(&w);
    vec![dx, dw, loss]
}

#[test]
fn conv2d_gradients_match_the_cpu() {
    let (gpu, _turn) = gpu();
    let (mut dx, mut dw, mut loss) = (Worst::default(), Worst::default(), Worst::default());
    for (i, c) in CASES.iter().enumerate() {
        let seed = 10 * i as u64;
        let xv = values(c.x.iter().product(), seed, -1.0, 1.0);
        let wv = values(c.w().iter().product(), seed + 1, -1.0, 1.0);
        let results = on_both(&gpu, |d| conv2d_gradients(c, &xv, &wv, seed + 2, d));
        let what = format!("conv2d {c:?}");
        check(&format!("{what}: dx"), &results[0], CONV_TOL, &mut dx);
        check(&format!("{what}: dw"), &results[1], CONV_TOL, &mut dw);
        // The loss sums every output.
        check(
            &format!("{what}: loss"),
            &results[2],
            10.0 * CONV_TOL,
            &mut loss,
        );
    }
    dx.report("Conv2dBackpropInput");
    dw.report("Conv2dBackpropFilter");
    loss.report("Conv2d loss");
    assert_ran_on_the_gpu();
}

/// NaN and infinity land where the CPU's im2col and GEMM put them: a NaN
/// in x spoils the outputs whose windows hold it; a NaN filter tap spoils
/// its whole output channel (padding taps multiply it by zero) but, in
/// the input gradient, only the input pixels that tap reaches. Both the
/// tiled kernel (8 channels) and the one-thread-per-result kernel (2
/// channels) are checked, with and without stride.
#[test]
fn conv2d_nan_lands_where_the_cpu_puts_it() {
    let (gpu, _turn) = gpu();
    let mut worst = Worst::default();
    let cases = [
        case([1, 8, 5, 5], 6, [3, 3], [1, 1], [0, 0], [1, 1], 1),
        case([2, 8, 7, 6], 6, [3, 3], [2, 2], [1, 0], [1, 1], 1),
        case([1, 2, 5, 5], 6, [3, 3], [1, 1], [0, 0], [1, 1], 1),
        case([2, 4, 7, 6], 4, [3, 2], [2, 1], [1, 1], [1, 2], 2),
    ];
    for (i, c) in cases.iter().enumerate() {
        let seed = 500 + 10 * i as u64;
        let mut xv = values(c.x.iter().product(), seed, -1.0, 1.0);
        let mut wv = values(c.w().iter().product(), seed + 1, -1.0, 1.0);
        xv[7] = f32::NAN;
        // NaN at the centre tap of filter 1's first channel, infinity at
        // the last tap of filter 0's first channel.
        let taps = c.k[0] * c.k[1];
        wv[c.w()[1] * taps + taps / 2] = f32::NAN;
        wv[taps - 1] = f32::INFINITY;
        let what = format!("NaN {c:?}");
        let clean_x = values(c.x.iter().product(), seed + 3, -1.0, 1.0);
        let clean_w = values(c.w().iter().product(), seed + 4, -1.0, 1.0);
        let results = on_both(&gpu, |d| {
            let y = tensor(&xv, &c.x, d).conv2d(&tensor(&wv, &c.w(), d), c.options());
            // The input gradient of a finite image with the NaN filter,
            // the filter gradient of a finite filter with the NaN image.
            let dx = conv2d_gradients(c, &clean_x, &wv, seed + 2, d).remove(0);
            let dw = conv2d_gradients(c, &xv, &clean_w, seed + 2, d).remove(1);
            vec![y, dx, dw]
        });
        for (k, name) in ["y", "dx", "dw"].iter().enumerate() {
            check(
                &format!("{what}: {name}"),
                &results[k],
                CONV_TOL,
                &mut worst,
            );
        }
        let dx = &results[1].1;
        assert!(
            dx.iter().any(|v| v.is_nan()) && dx.iter().any(|v| v.is_finite()),
            "{what}: the input gradient should mix NaN and finite values"
        );
    }
    worst.report("Conv2d with NaN");
    assert_ran_on_the_gpu();
}

#[test]
fn conv_transpose2d_and_its_gradients_match_the_cpu() {
    let (gpu, _turn) = gpu();
    let (mut y, mut dx, mut dw) = (Worst::default(), Worst::default(), Worst::default());
    // (x, filters per group, kernel, stride, padding, output_padding,
    // dilation, groups)
    type Transposed = (
        [usize; 4],
        usize,
        [usize; 2],
        [usize; 2],
        [usize; 2],
        [usize; 2],
        [usize; 2],
        usize,
    );
    let cases: &[Transposed] = &[
        ([2, 4, 5, 4], 3, [3, 2], [2, 3], [1, 0], [1, 2], [1, 2], 2),
        ([3, 8, 7, 7], 12, [4, 4], [2, 2], [1, 1], [0, 0], [1, 1], 1),
        ([1, 3, 4, 4], 1, [1, 1], [1, 1], [0, 0], [0, 0], [1, 1], 3),
        ([2, 20, 3, 5], 24, [3, 3], [1, 2], [0, 1], [0, 1], [2, 1], 1),
    ];
    for (i, &(xd, per_group, k, stride, padding, output_padding, dilation, groups)) in
        cases.iter().enumerate()
    {
        let wd = [xd[1], per_group, k[0], k[1]];
        let seed = 900 + 10 * i as u64;
        let xv = values(xd.iter().product(), seed, -1.0, 1.0);
        let wv = values(wd.iter().product(), seed + 1, -1.0, 1.0);
        let options = ConvTranspose2dOptions {
            stride,
            padding,
            output_padding,
            dilation,
            groups,
        };
        let results = on_both(&gpu, |d| {
            let (x, w) = (tensor(&xv, &xd, d), tensor(&wv, &wd, d));
            let y = x.conv_transpose2d(&w, options);
            let (_, dx) = value_and_grad(|x: &Tensor<f32>| {
                weighted_sum(x.conv_transpose2d(&w, options), seed + 2)
            })(&x);
            let (_, dw) = value_and_grad(|w: &Tensor<f32>| {
                weighted_sum(x.conv_transpose2d(w, options), seed + 2)
            })(&w);
            vec![y, dx, dw]
        });
        let what = format!("conv_transpose2d {xd:?} {wd:?} {options:?}");
        check(&format!("{what}: y"), &results[0], CONV_TOL, &mut y);
        check(&format!("{what}: dx"), &results[1], CONV_TOL, &mut dx);
        check(&format!("{what}: dw"), &results[2], CONV_TOL, &mut dw);
    }
    y.report("ConvTranspose2d");
    dx.report("ConvTranspose2d: dx (Conv2d)");
    dw.report("ConvTranspose2d: dw (Conv2dBackpropFilter)");
    assert_ran_on_the_gpu();
}

/// Pooling geometries: (x, kernel, stride, padding).
type PoolCase = ([usize; 4], [usize; 2], Option<[usize; 2]>, [usize; 2]);

const POOLS: &[PoolCase] = &[
    ([2, 3, 7, 5], [3, 2], Some([2, 1]), [1, 1]),
    ([1, 2, 5, 5], [3, 3], Some([1, 1]), [1, 0]),
    ([2, 2, 8, 13], [3, 3], Some([2, 2]), [1, 1]),
    ([1, 1, 4, 9], [2, 5], Some([1, 3]), [0, 2]),
    ([1, 1, 1, 1], [1, 1], None, [0, 0]),
    ([3, 4, 6, 6], [2, 2], None, [0, 0]),
    ([2, 3, 3, 2], [3, 3], Some([1, 1]), [1, 1]),
];

/// The bound for average pooling: f32 sums of at most 15 values against
/// the CPU's f64 ones.
const POOL_TOL: f32 = 2e-6;

/// Max and average pooling and their gradients, with NaN in some
/// windows (a window's first NaN is its maximum and takes the gradient).
/// Max pooling sees the values rounded to multiples of 1/2, so windows
/// tie (the gradient goes to the first maximum in row-major order).
#[test]
fn pooling_and_its_gradients_match_the_cpu() {
    let (gpu, _turn) = gpu();
    let (mut max, mut max_grad) = (Worst::default(), Worst::default());
    let (mut avg, mut avg_grad) = (Worst::default(), Worst::default());
    for (i, &(xd, kernel, stride, padding)) in POOLS.iter().enumerate() {
        let seed = 1300 + 10 * i as u64;
        let n: usize = xd.iter().product();
        let mut raw = values(n, seed, -2.0, 2.0);
        if n > 8 {
            raw[n / 3] = f32::NAN;
            raw[n / 3 + 1] = f32::NAN;
        }
        let halves: Vec<f32> = raw.iter().map(|v| (v * 2.0).round() / 2.0).collect();
        let options = Pool2dOptions {
            kernel,
            stride,
            padding,
        };
        let what = format!("max_pool2d {xd:?} {options:?}");
        let results = on_both(&gpu, |d| {
            let x = tensor(&halves, &xd, d);
            let (_, dx) =
                value_and_grad(|x: &Tensor<f32>| weighted_sum(x.max_pool2d(options), seed + 1))(&x);
            vec![x.max_pool2d(options), dx]
        });
        // A maximum is exact, and so is the sum of the gradients routed
        // to one pixel when added in the CPU's order.
        check(&format!("{what}: y"), &results[0], 0.0, &mut max);
        check(&format!("{what}: dx"), &results[1], 0.0, &mut max_grad);
        for include_pad in [true, false] {
            let what = format!("avg_pool2d {xd:?} {options:?} count_include_pad {include_pad}");
            let results = on_both(&gpu, |d| {
                let x = tensor(&raw, &xd, d);
                let (_, dx) = value_and_grad(|x: &Tensor<f32>| {
                    weighted_sum(x.avg_pool2d(options, include_pad), seed + 1)
                })(&x);
                vec![x.avg_pool2d(options, include_pad), dx]
            });
            check(&format!("{what}: y"), &results[0], POOL_TOL, &mut avg);
            check(&format!("{what}: dx"), &results[1], POOL_TOL, &mut avg_grad);
        }
    }
    max.report("MaxPool2d");
    max_grad.report("MaxPool2dGrad");
    avg.report("AvgPool2d");
    avg_grad.report("AvgPool2dGrad");
    assert_ran_on_the_gpu();
}

/// f64 has no GPU kernel here: the CPU's runs, with its answer, and is
/// listed as a fallback.
#[test]
fn other_dtypes_run_on_the_cpu_with_its_answer() {
    let (gpu, _turn) = gpu();
    let c = CASES[0];
    let xv: Vec<f64> = values(c.x.iter().product(), 1, -1.0, 1.0)
        .iter()
        .map(|&v| v as f64)
        .collect();
    let wv: Vec<f64> = values(c.w().iter().product(), 2, -1.0, 1.0)
        .iter()
        .map(|&v| v as f64)
        .collect();
    let on = |d: &Device| {
        let x = Tensor::from_vec(xv.clone(), &c.x, d).unwrap();
        let w = Tensor::from_vec(wv.clone(), &c.w(), d).unwrap();
        let y = x.conv2d(&w, c.options());
        (y.device(), y.to_vec().unwrap())
    };
    let (device, got) = on(&gpu);
    assert_eq!(device, gpu);
    assert_eq!(got, on(&cpu()).1);
    let fallbacks = rt::cpu_fallbacks();
    assert!(
        fallbacks.iter().any(|f| f.starts_with("Conv2d[F64")),
        "{fallbacks:?}"
    );
}
