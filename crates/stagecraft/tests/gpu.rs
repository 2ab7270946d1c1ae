//! The GPU device (`gpu:0`, feature `wgpu`) against the CPU: copies, every
//! generated elementwise kernel within its measured error bound (the
//! bounds are in `docs/accuracy.md`), broadcasting, reductions, matmul,
//! softmax, the CPU fallback for ops without a GPU kernel, autodiff, and
//! the errors of mixing devices.
//!
//! The test command installs Mesa's software Vulkan driver
//! (`scripts/system-packages.sh`), so `gpu:0` is lavapipe in CI and a real GPU
//! where there is one. With the feature on and no adapter these tests fail
//! with the error that says what to install; they never pass by skipping.

use stagecraft::{Device, ErrorKind, Tensor};

/// Without the feature, `gpu:0` is an error that names it, whether parsed
/// or used.
#[cfg(not(feature = "wgpu"))]
#[test]
fn without_the_feature_the_gpu_is_an_error_naming_it() {
    let err = Device::try_gpu(0).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Device);
    assert!(err.to_string().contains("`wgpu` feature"), "{err}");
    let line = line!() + 1;
    let x = Tensor::<f32>::from_vec(vec![1.0], &[1], &Device::gpu(0));
    let err = x.and_then(|x| x.to_vec()).unwrap_err();
    assert!(err.to_string().contains("`wgpu` feature"), "{err}");
    let _ = line;
}

#[cfg(feature = "wgpu")]
#[path = "gpu/conv.rs"]
mod conv;
#[cfg(feature = "wgpu")]
#[path = "gpu/indexing.rs"]
mod indexing;
#[cfg(feature = "wgpu")]
#[path = "gpu/transformer.rs"]
mod transformer;

#[cfg(feature = "wgpu")]
mod on_the_gpu {
    use super::*;
    use stagecraft::layers::runtime as rt;
    use stagecraft::{value_and_grad, BinaryOp, DType, Rng, UnaryOp};

    /// `gpu:0`. The tests take turns: some count device copies, which
    /// are counted process-wide.
    pub(crate) fn gpu() -> (Device, std::sync::MutexGuard<'static, ()>) {
        static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
        let device = Device::try_gpu(0).unwrap_or_else(|e| panic!("the GPU tests need gpu:0: {e}"));
        (device, turn)
    }

    pub(crate) fn cpu() -> Device {
        Device::cpu()
    }

    /// Values from a seed in `[lo, hi)`.
    pub(crate) fn values(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<f32> {
        let mut rng = Rng::new(seed);
        let t = Tensor::<f32>::rand_uniform(&[n], lo as f64, hi as f64, &mut rng, &cpu());
        t.to_vec().unwrap()
    }

    pub(crate) fn assert_close(what: &str, got: &[f32], want: &[f32], rtol: f32, atol: f32) {
        assert_eq!(got.len(), want.len(), "{what}: lengths");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            let ok = (g.is_nan() && w.is_nan()) || g == w || (g - w).abs() <= atol + rtol * w.abs();
            assert!(ok, "{what}: element {i}: GPU {g}, CPU {w}");
        }
    }

    #[test]
    fn values_of_every_dtype_survive_the_round_trip_bit_for_bit() {
        let (gpu, _turn) = gpu();
        let f = Tensor::<f32>::from_vec(vec![1.5, -0.0, f32::NAN, f32::INFINITY], &[2, 2], &gpu)
            .unwrap();
        assert_eq!(f.device(), gpu);
        // Waiting reads nothing back: it works for a value in GPU memory.
        f.exp().wait().unwrap();
        let bits: Vec<u32> = f.to_vec().unwrap().iter().map(|v| v.to_bits()).collect();
        assert_eq!(
            bits,
            [1.5f32, -0.0, f32::NAN, f32::INFINITY].map(f32::to_bits)
        );
        // Sizes that are not whole 4-byte words.
        let b = Tensor::<bool>::from_vec(vec![true, false, true], &[3], &gpu).unwrap();
        assert_eq!(b.to_vec().unwrap(), vec![true, false, true]);
        let u = Tensor::<u8>::from_vec(vec![1, 2, 3, 4, 5], &[5], &gpu).unwrap();
        assert_eq!(u.to_vec().unwrap(), vec![1, 2, 3, 4, 5]);
        let h = Tensor::<stagecraft::f16>::from_vec(
            vec![stagecraft::f16::from_f32(0.5); 3],
            &[3],
            &gpu,
        )
        .unwrap();
        assert_eq!(h.to_vec().unwrap()[2].to_f32(), 0.5);
        let l = Tensor::<i64>::from_vec(vec![i64::MIN, 7], &[2], &gpu).unwrap();
        assert_eq!(l.to_vec().unwrap(), vec![i64::MIN, 7]);
        // Empty and scalar tensors.
        let e = Tensor::<f32>::from_vec(vec![], &[0, 3], &gpu).unwrap();
        assert_eq!(e.to_vec().unwrap(), Vec::<f32>::new());
        assert_eq!((&e + &e).dims(), &[0, 3]);
        assert_eq!(Tensor::scalar(2.5f32, &gpu).item().unwrap(), 2.5);
        // Explicit copies in both directions are counted.
        let copies = rt::stats().device_copies;
        let back = f.to_device(&cpu());
        assert_eq!(back.device(), cpu());
        assert_eq!(back.to_vec().unwrap()[0], 1.5);
        let again = back.to_device(&gpu);
        assert_eq!(again.to_vec().unwrap()[0], 1.5);
        assert!(rt::stats().device_copies >= copies + 2);
    }

    /// The domain and error bound of each generated unary kernel against
    /// the CPU's f64 kernel rounded to f32, as `|gpu - cpu| <= bound *
    /// max(1, |cpu|)`: twice the worst error measured on lavapipe (the
    /// table in `docs/accuracy.md`, "The GPU device"). `exp` and `expm1`
    /// lose accuracy with |x| (Vulkan allows 3 + 2|x| ulp).
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

    #[test]
    fn every_generated_unary_kernel_is_within_its_bound_and_keeps_nans() {
        let (gpu, _turn) = gpu();
        let (mut measured, mut failures) = (Vec::new(), Vec::new());
        for &op in UnaryOp::ALL {
            if op.wgsl().is_none() || !op.class().accepts(DType::F32) {
                continue;
            }
            let (lo, hi, bound) = unary_case(op);
            let mut xs = values(4096, 11, lo, hi);
            // Small magnitudes, where cancellation would show.
            xs.extend([0.0, 1e-7, -1e-7, 1e-4, -1e-4, 0.5, -0.5]);
            xs.retain(|x| (lo..=hi).contains(x));
            xs.push(f32::NAN);
            let n = xs.len();
            let on_gpu = Tensor::from_vec(xs.clone(), &[n], &gpu)
                .unwrap()
                .apply_unary(op);
            assert_eq!(on_gpu.device(), gpu, "{op:?}");
            let got = on_gpu.to_vec().unwrap();
            let x64: Vec<f64> = xs.iter().map(|&x| x as f64).collect();
            let want: Vec<f32> = Tensor::from_vec(x64, &[n], &cpu())
                .unwrap()
                .apply_unary(op)
                .to_vec()
                .unwrap()
                .iter()
                .map(|&v| v as f32)
                .collect();
            let (mut worst, mut worst_at) = (0.0f32, 0.0f32);
            for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                if w.is_nan() {
                    assert!(
                        g.is_nan(),
                        "{op:?}({}) = {g} on the GPU, NaN on the CPU",
                        xs[i]
                    );
                    continue;
                }
                let err = if g == w {
                    0.0
                } else {
                    (g - w).abs() / w.abs().max(1.0)
                };
                if err > worst {
                    worst = err;
                    worst_at = xs[i];
                }
            }
            measured.push(format!("{op:?} {worst:.2e} at {worst_at}"));
            if worst > bound {
                failures.push(format!(
                    "{op:?}: error {worst:e} at x = {worst_at} > {bound:e}"
                ));
            }
        }
        assert!(failures.is_empty(), "{failures:#?}\nall: {measured:#?}");
        assert!(measured.len() >= 25, "{measured:?}");
        println!("worst error per op: {}", measured.join(", "));
        let fallbacks = rt::cpu_fallbacks();
        assert!(
            !fallbacks
                .iter()
                .any(|f| f.starts_with("Exp[") || f.starts_with("Tanh[")),
            "{fallbacks:?}"
        );
    }

    #[test]
    fn binary_kernels_broadcast_like_the_cpu() {
        let (gpu, _turn) = gpu();
        let shapes: &[(&[usize], &[usize])] = &[
            (&[2, 3], &[2, 3]),
            (&[2, 3], &[3]),
            (&[4, 1], &[1, 5]),
            (&[2, 3, 4], &[1, 3, 1]),
            (&[5], &[]),
            (&[], &[7]),
            (&[3, 1, 2], &[4, 1]),
            (&[1000, 33], &[33]),
            // Seven dimensions no merge shortens: the CPU's kernel runs.
            (&[2, 2, 2, 2, 2, 2, 2], &[2, 1, 2, 1, 2, 1, 2]),
        ];
        for &op in BinaryOp::ALL {
            if op.wgsl().is_none() || !op.class().accepts(DType::F32) {
                continue;
            }
            for (case, (sa, sb)) in shapes.iter().enumerate() {
                let na: usize = sa.iter().product();
                let nb: usize = sb.iter().product();
                let (lo, hi) = if matches!(op, BinaryOp::Pow) {
                    (0.1, 3.0)
                } else {
                    (-3.0, 3.0)
                };
                let (va, vb) = (values(na, 1 + case as u64, lo, hi), values(nb, 50, lo, hi));
                let on = |d: &Device| {
                    let a = Tensor::from_vec(va.clone(), sa, d).unwrap();
                    let b = Tensor::from_vec(vb.clone(), sb, d).unwrap();
                    a.apply_binary(op, &b)
                };
                let got = on(&gpu);
                let want = on(&cpu());
                assert_eq!(got.dims(), want.dims(), "{op:?} {sa:?} {sb:?}");
                assert_eq!(got.device(), gpu);
                assert_close(
                    &format!("{op:?} {sa:?} {sb:?}"),
                    &got.to_vec().unwrap(),
                    &want.to_vec().unwrap(),
                    4e-6,
                    1e-6,
                );
            }
        }
        // NaN propagates through max and min as on the CPU.
        let a = Tensor::from_vec(vec![f32::NAN, 1.0], &[2], &gpu).unwrap();
        let b = Tensor::from_vec(vec![0.0, f32::NAN], &[2], &gpu).unwrap();
        assert!(a
            .apply_binary(BinaryOp::Maximum, &b)
            .to_vec()
            .unwrap()
            .iter()
            .all(|v| v.is_nan()));
        // Pow of a negative base with an integer exponent.
        let base = Tensor::from_vec(vec![-2.0f32, -2.0, -2.0, 0.0], &[4], &gpu).unwrap();
        let exponent = Tensor::from_vec(vec![2.0f32, 3.0, 0.5, -1.0], &[4], &gpu).unwrap();
        let p = base
            .apply_binary(BinaryOp::Pow, &exponent)
            .to_vec()
            .unwrap();
        assert_eq!(&p[..2], &[4.0, -8.0]);
        assert!(p[2].is_nan() && p[3] == f32::INFINITY, "{p:?}");
        // The seven-dimensional case ran on the CPU, and said so.
        assert!(rt::cpu_fallbacks().iter().any(|f| f.starts_with("Add[")));
        // Broadcasts of six dimensions or fewer copy nothing: the GPU's
        // kernel ran.
        let a = Tensor::from_vec(values(6, 1, -1.0, 1.0), &[2, 3], &gpu).unwrap();
        let b = Tensor::from_vec(values(3, 2, -1.0, 1.0), &[3], &gpu).unwrap();
        let copies = rt::stats().device_copies;
        let c = &(&a + &b) * &b;
        assert!(c.check().is_ok());
        assert_eq!(rt::stats().device_copies, copies);
    }

    #[test]
    fn reductions_match_the_cpu_over_every_axis_set() {
        let (gpu, _turn) = gpu();
        let dims = [3usize, 70, 5];
        let n: usize = dims.iter().product();
        let v = values(n, 3, -2.0, 2.0);
        let axes_sets: &[&[isize]] = &[&[], &[0], &[1], &[2], &[-1], &[0, 2], &[0, 1], &[1, 2]];
        for keep in [false, true] {
            for axes in axes_sets {
                let run = |d: &Device| {
                    let x = Tensor::from_vec(v.clone(), &dims, d).unwrap();
                    [
                        x.sum(axes, keep),
                        x.mean(axes, keep),
                        x.max(axes, keep),
                        x.min(axes, keep),
                        (&x * 0.5f32).exp().prod(axes, keep),
                    ]
                };
                for (k, (g, c)) in run(&gpu).iter().zip(run(&cpu()).iter()).enumerate() {
                    assert_eq!(g.dims(), c.dims());
                    assert_eq!(g.device(), gpu);
                    // The GPU sums in a tree, the CPU in its own order: a
                    // product of a thousand factors drifts by n·ε.
                    let rtol = if k == 4 { 2e-4 } else { 2e-5 };
                    assert_close(
                        &format!("reduction {k} over {axes:?} keep {keep}"),
                        &g.to_vec().unwrap(),
                        &c.to_vec().unwrap(),
                        rtol,
                        2e-5,
                    );
                }
            }
        }
        // Reductions over nothing give the CPU's answer (or error).
        for d in [&gpu, &cpu()] {
            let empty = Tensor::<f32>::from_vec(vec![], &[2, 0], d).unwrap();
            assert_eq!(empty.sum(&[1], false).to_vec().unwrap(), vec![0.0, 0.0]);
        }
        let empty_max = |d: &Device| {
            let empty = Tensor::<f32>::from_vec(vec![], &[2, 0], d).unwrap();
            empty.max(&[1], false).to_vec().map_err(|e| e.kind())
        };
        assert_eq!(empty_max(&gpu), empty_max(&cpu()));
        // A NaN wins a max, as on the CPU.
        let x = Tensor::from_vec(vec![1.0, f32::NAN, 3.0], &[3], &gpu).unwrap();
        assert!(x.max(&[0], false).item().unwrap().is_nan());
    }

    #[test]
    fn matmul_matches_the_cpu_for_odd_sizes_transposes_and_batches() {
        let (gpu, _turn) = gpu();
        let cases: &[(&[usize], &[usize], bool, bool)] = &[
            (&[1, 1], &[1, 1], false, false),
            (&[17, 33], &[33, 9], false, false),
            (&[64, 48], &[48, 80], false, false),
            (&[33, 17], &[33, 9], true, false),
            (&[17, 33], &[9, 33], false, true),
            (&[33, 17], &[9, 33], true, true),
            (&[4, 5, 6], &[4, 6, 7], false, false),
            (&[4, 5, 6], &[6, 7], false, false),
            (&[5, 6], &[3, 6, 2], false, false),
            (&[6], &[6, 3], false, false),
            (&[6, 3], &[3], false, false),
            (&[6], &[6], false, false),
            (&[2, 4, 6], &[6], false, false),
            (&[6], &[2, 6, 4], false, false),
        ];
        for (sa, sb, ta, tb) in cases {
            let (na, nb) = (sa.iter().product(), sb.iter().product());
            let (va, vb) = (values(na, 7, -1.0, 1.0), values(nb, 8, -1.0, 1.0));
            let run = |d: &Device| {
                let a = Tensor::from_vec(va.clone(), sa, d).unwrap();
                let b = Tensor::from_vec(vb.clone(), sb, d).unwrap();
                match (ta, tb) {
                    (false, false) => a.matmul(&b),
                    (true, false) => a.transpose(-1, -2).matmul(&b),
                    (false, true) => a.matmul(&b.transpose(-1, -2)),
                    (true, true) => a.transpose(-1, -2).matmul(&b.transpose(-1, -2)),
                }
            };
            let copies = rt::stats().device_copies;
            let g = run(&gpu);
            // Every case runs on the GPU: a fallback to the CPU would copy.
            assert_eq!(rt::stats().device_copies - copies, 0, "{sa:?} {sb:?}");
            let c = run(&cpu());
            assert_eq!(g.dims(), c.dims(), "{sa:?} {sb:?}");
            assert_close(
                &format!("matmul {sa:?} {sb:?} {ta} {tb}"),
                &g.to_vec().unwrap(),
                &c.to_vec().unwrap(),
                1e-5,
                1e-5,
            );
        }
    }

    #[test]
    fn softmax_and_log_softmax_match_the_cpu() {
        let (gpu, _turn) = gpu();
        for dims in [&[4usize, 10][..], &[3, 2, 300], &[1, 1], &[5]] {
            let n: usize = dims.iter().product();
            let mut v = values(n, 5, -30.0, 30.0);
            v[0] = 80.0; // exp overflows without the max subtracted
            for axis in [-1isize, 0, 1]
                .into_iter()
                .filter(|&a| a < dims.len() as isize)
            {
                let run = |d: &Device| {
                    let x = Tensor::from_vec(v.clone(), dims, d).unwrap();
                    [x.softmax(axis), x.log_softmax(axis)]
                };
                let copies = rt::stats().device_copies;
                let on_gpu = run(&gpu);
                // Any axis runs on the GPU: a fallback to the CPU would copy.
                assert_eq!(rt::stats().device_copies, copies, "{dims:?} axis {axis}");
                for (g, c) in on_gpu.iter().zip(run(&cpu()).iter()) {
                    assert_close(
                        &format!("softmax {dims:?} axis {axis}"),
                        &g.to_vec().unwrap(),
                        &c.to_vec().unwrap(),
                        2e-5,
                        1e-6,
                    );
                }
            }
        }
    }

    #[test]
    fn layout_comparison_select_cast_and_fill_kernels_match_the_cpu() {
        let (gpu, _turn) = gpu();
        let v = values(2 * 3 * 4, 21, -2.0, 2.0);
        let run = |d: &Device| {
            let x = Tensor::from_vec(v.clone(), &[2, 3, 4], d).unwrap();
            let y = Tensor::from_vec(values(4, 22, -2.0, 2.0), &[4], d).unwrap();
            let mask = x.gt(&y);
            let ints = Tensor::<i64>::from_vec((0..24).collect(), &[2, 3, 4], d).unwrap();
            vec![
                x.transpose(0, 2).to_vec().unwrap(),
                x.permute(&[1, 2, 0]).to_vec().unwrap(),
                y.broadcast_to(&[3, 4]).to_vec().unwrap(),
                x.slice(&[0, 1, 1], &[2, 3, 4], &[1, 1, 2])
                    .to_vec()
                    .unwrap(),
                mask.cast::<f32>().to_vec().unwrap(),
                x.le(&y).cast::<f32>().to_vec().unwrap(),
                x.eq(&x).cast::<f32>().to_vec().unwrap(),
                mask.select(&x, &y.neg()).to_vec().unwrap(),
                (&x * 100.0f32)
                    .cast::<i32>()
                    .cast::<f32>()
                    .to_vec()
                    .unwrap(),
                mask.cast::<i32>().cast::<f32>().to_vec().unwrap(),
                Tensor::<f32>::full(&[5, 3], 1.25, d).to_vec().unwrap(),
                x.pad(&[(1, 0), (0, 2), (3, 1)], -0.5).to_vec().unwrap(),
                ints.pad(&[(0, 1), (2, 0), (0, 0)], 7.0)
                    .cast::<f32>()
                    .to_vec()
                    .unwrap(),
                ints.transpose(0, 2).cast::<f32>().to_vec().unwrap(),
            ]
        };
        let (g, c) = (run(&gpu), run(&cpu()));
        for (k, (g, c)) in g.iter().zip(&c).enumerate() {
            assert_eq!(g, c, "case {k}");
        }
        // Casts saturate and send NaN to 0, as on the CPU.
        let edge = vec![3e9f32, -3e9, f32::NAN, -2.7, 2.7, 0.0];
        let cast = |d: &Device| {
            let t = Tensor::from_vec(edge.clone(), &[6], d).unwrap();
            (
                t.cast::<i32>().to_vec().unwrap(),
                t.cast::<bool>().to_vec().unwrap(),
            )
        };
        assert_eq!(cast(&gpu), cast(&cpu()));
        let fallbacks = rt::cpu_fallbacks();
        for op in [
            "Transpose[F32]",
            "Greater[F32, F32]",
            "Select[",
            "Cast[F32]",
            "Slice[F32]",
        ] {
            assert!(
                !fallbacks.iter().any(|f| f.starts_with(op)),
                "{op}: {fallbacks:?}"
            );
        }
    }

    #[test]
    fn ops_without_a_gpu_kernel_run_on_the_cpu_and_say_so() {
        let (gpu, _turn) = gpu();
        // WGSL has no 64-bit integers: i64 arithmetic runs on the CPU.
        let x = Tensor::from_vec(vec![3i64, 1, 2], &[3], &gpu).unwrap();
        let doubled = &x + &x;
        assert_eq!(doubled.device(), gpu);
        assert_eq!(doubled.to_vec().unwrap(), vec![6, 2, 4]);
        let idx = x.argmax(0, false);
        assert_eq!(idx.device(), gpu);
        assert_eq!(idx.item().unwrap(), 0);
        let fallbacks = rt::cpu_fallbacks();
        assert!(
            fallbacks.iter().any(|f| f.starts_with("Add[I64")),
            "{fallbacks:?}"
        );
    }

    #[test]
    fn gradients_on_the_gpu_match_the_cpu() {
        let (gpu, _turn) = gpu();
        let mut rng = Rng::new(4);
        let xv = Tensor::<f32>::rand_normal(&[8, 5], 0.0, 1.0, &mut rng, &cpu())
            .to_vec()
            .unwrap();
        let wv = Tensor::<f32>::rand_normal(&[5, 3], 0.0, 1.0, &mut rng, &cpu())
            .to_vec()
            .unwrap();
        let run = |d: &Device| {
            let x = Tensor::from_vec(xv.clone(), &[8, 5], d).unwrap();
            let w = Tensor::from_vec(wv.clone(), &[5, 3], d).unwrap();
            let (loss, grads) = value_and_grad(|w: &Tensor<f32>| {
                x.matmul(w).tanh().log_softmax(-1).mean(&[], false)
            })(&w);
            (
                loss.item().unwrap(),
                grads.to_vec().unwrap(),
                grads.device(),
            )
        };
        let (gl, gg, gd) = run(&gpu);
        let (cl, cg, _) = run(&cpu());
        assert_eq!(gd, gpu);
        assert_close("loss", &[gl], &[cl], 1e-5, 1e-6);
        assert_close("gradient", &gg, &cg, 1e-4, 1e-6);
    }

    /// A staged loop: halve `x` while its sum exceeds `limit`, then
    /// branch on the sign of its first element.
    #[stagecraft::stage]
    fn staged_halving(x: Tensor<f32>, limit: Tensor<f32>) -> Tensor<f32> {
        let mut y = x;
        while y.sum(&[0], false).gt(&limit) {
            y = &y * 0.5f32;
        }
        let first = y.slice(&[0], &[1], &[1]).sum(&[0], false);
        if first.gt(&limit.neg()) {
            y.exp()
        } else {
            y.neg()
        }
    }

    #[test]
    fn functions_cond_while_and_stage_run_their_nodes_on_the_gpu() {
        let (gpu, _turn) = gpu();
        let v = vec![3.0f32, -1.0, 4.0, 1.5];
        let run = |d: &Device| {
            let x = Tensor::from_vec(v.clone(), &[4], d).unwrap();
            let limit = Tensor::scalar(1.0f32, d);
            let f = stagecraft::function(|x: Tensor<f32>| (&x * 2.0f32).tanh().sum(&[0], true));
            let called = f.call(x.clone());
            let p = x.sum(&[0], false).gt(&Tensor::scalar(3.0f32, d));
            let branched = stagecraft::cond(&p, || x.exp(), || x.neg());
            let looped = stagecraft::while_loop(
                x.clone(),
                |s| s.sum(&[0], false).gt(&limit),
                |s| s * 0.5f32,
            );
            let staged = staged_halving(x.clone(), limit.clone());
            let grad = stagecraft::grad(|x: &Tensor<f32>| {
                let p = x.sum(&[0], false).gt(&Tensor::scalar(0.0f32, &x.device()));
                stagecraft::cond(&p, || x.tanh(), || x * 3.0f32).sum(&[0], false)
            })(&x);
            [called, branched, looped, staged, grad]
        };
        let copies = rt::stats().device_copies;
        let on_gpu = run(&gpu);
        for t in &on_gpu {
            assert_eq!(t.device(), gpu);
            t.check().unwrap();
        }
        let fallbacks = rt::cpu_fallbacks();
        for op in ["Call[", "If[", "While["] {
            assert!(
                !fallbacks.iter().any(|f| f.starts_with(op)),
                "{op}: {fallbacks:?}"
            );
        }
        // Only predicates and loop conditions came back to the host.
        let read_back = rt::stats().device_copies - copies;
        assert!(read_back <= 24, "{read_back} copies");
        let on_cpu = run(&cpu());
        for (k, (g, c)) in on_gpu.iter().zip(on_cpu.iter()).enumerate() {
            assert_close(
                &format!("case {k}"),
                &g.to_vec().unwrap(),
                &c.to_vec().unwrap(),
                1e-5,
                1e-6,
            );
        }
        // The same on the lazy device over the GPU: `#[stage]`'s loop and
        // branch conditions are read back from its traces.
        let lazy = Device::lazy(&gpu);
        for (k, (g, c)) in run(&lazy).iter().zip(on_cpu.iter()).enumerate() {
            assert_eq!(g.device(), lazy);
            assert_close(
                &format!("lazy case {k}"),
                &g.to_vec().unwrap(),
                &c.to_vec().unwrap(),
                1e-5,
                1e-6,
            );
        }
    }

    #[test]
    fn cross_entropy_and_its_gradient_match_the_cpu_and_bad_targets_are_errors() {
        use stagecraft::{CrossEntropyOptions, Reduction};
        let (gpu, _turn) = gpu();
        let (rows, classes) = (6usize, 5usize);
        let lv = values(rows * classes, 31, -4.0, 4.0);
        let targets = vec![0i32, 4, 2, -100, 1, 3];
        for reduction in [Reduction::Mean, Reduction::Sum, Reduction::None] {
            for ignore in [None, Some(-100)] {
                let options = CrossEntropyOptions {
                    ignore_index: ignore,
                    reduction,
                };
                let run = |d: &Device| {
                    let logits = Tensor::from_vec(lv.clone(), &[rows, classes], d).unwrap();
                    let t = Tensor::from_vec(targets.clone(), &[rows], d).unwrap();
                    let (loss, grad) = stagecraft::value_and_grad(|l: &Tensor<f32>| {
                        l.cross_entropy(&t, options).sum(&[], false)
                    })(&logits);
                    (loss.to_vec(), grad.to_vec())
                };
                let ((gl, gg), (cl, cg)) = (run(&gpu), run(&cpu()));
                match ignore {
                    Some(_) => {
                        let what = format!("{reduction:?}");
                        assert_close(&what, &gl.unwrap(), &cl.unwrap(), 2e-6, 1e-6);
                        assert_close(&what, &gg.unwrap(), &cg.unwrap(), 2e-6, 1e-6);
                    }
                    None => {
                        // -100 is out of range: the same Index error on both.
                        let (ge, ce) = (gl.unwrap_err(), cl.unwrap_err());
                        assert_eq!(ge.kind(), ErrorKind::Index, "{ge}");
                        assert_eq!(ge.kind(), ce.kind());
                    }
                }
            }
        }
        let fallbacks = rt::cpu_fallbacks();
        assert!(
            !fallbacks.iter().any(|f| f.starts_with("CrossEntropyGrad[")),
            "{fallbacks:?}"
        );
    }

    #[test]
    fn layer_norm_and_embedding_match_the_cpu_and_bad_ids_are_errors() {
        let (gpu, _turn) = gpu();
        for width in [1usize, 7, 200] {
            let xv = values(3 * width, 41, -3.0, 3.0);
            let (wv, bv) = (values(width, 42, 0.5, 1.5), values(width, 43, -1.0, 1.0));
            let run = |d: &Device| {
                let x = Tensor::from_vec(xv.clone(), &[3, width], d).unwrap();
                let w = Tensor::from_vec(wv.clone(), &[width], d).unwrap();
                let b = Tensor::from_vec(bv.clone(), &[width], d).unwrap();
                [
                    x.layer_norm(None, None, 1e-5),
                    x.layer_norm(Some(&w), None, 1e-5),
                    x.layer_norm(None, Some(&b), 1e-5),
                    x.layer_norm(Some(&w), Some(&b), 1e-5),
                ]
            };
            for (k, (g, c)) in run(&gpu).iter().zip(run(&cpu()).iter()).enumerate() {
                assert_eq!(g.device(), gpu);
                assert_close(
                    &format!("layer norm {k}, width {width}"),
                    &g.to_vec().unwrap(),
                    &c.to_vec().unwrap(),
                    2e-5,
                    2e-5,
                );
            }
        }
        let table = values(5 * 3, 44, -1.0, 1.0);
        let run = |d: &Device, ids: Vec<i32>| {
            let t = Tensor::from_vec(table.clone(), &[5, 3], d).unwrap();
            let n = ids.len();
            t.embedding(&Tensor::from_vec(ids, &[n], d).unwrap())
                .to_vec()
        };
        let ids = vec![4, 0, 0, 3];
        assert_eq!(run(&gpu, ids.clone()).unwrap(), run(&cpu(), ids).unwrap());
        let err = run(&gpu, vec![1, 5]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Index, "{err}");
        // i64 ids (what most data loaders give) run on the GPU too: only
        // the id check reads them back, never the table or the rows.
        let run64 = |d: &Device, ids: Vec<i64>| {
            let t = Tensor::from_vec(table.clone(), &[5, 3], d).unwrap();
            let n = ids.len();
            let ids = Tensor::from_vec(ids, &[n], d).unwrap();
            let copies = rt::stats().device_copies;
            let rows = t.embedding(&ids);
            let _ = rows.wait();
            (rt::stats().device_copies - copies, rows.to_vec())
        };
        let ids = vec![4i64, 0, 2, 3, 1];
        let (copies, got) = run64(&gpu, ids.clone());
        assert_eq!(copies, 0);
        assert_eq!(got.unwrap(), run64(&cpu(), ids).1.unwrap());
        let err = run64(&gpu, vec![1, 5]).1.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Index, "{err}");
        let err = run64(&gpu, vec![-1, 0]).1.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Index, "{err}");
        let fallbacks = rt::cpu_fallbacks();
        assert!(
            !fallbacks.iter().any(|f| f.starts_with("LayerNorm[")),
            "{fallbacks:?}"
        );
    }

    /// A lazy trace over the GPU runs there as one submission of its
    /// work; a later step of the same structure hits the trace cache, and
    /// the values stay in device memory between steps.
    #[test]
    fn the_lazy_device_runs_a_trace_on_the_gpu_as_one_submission() {
        use stagecraft::lazy;
        let (gpu, _turn) = gpu();
        let device = stagecraft::layers::wgpu::Gpu::get(0).unwrap();
        let on_lazy = Device::lazy(&gpu);
        let step = |x: &Tensor<f32>, w: &Tensor<f32>| -> Tensor<f32> {
            let h = x.matmul(w).relu();
            let y = (&h * &h + 1.0).log();
            y.sum(&[1], false)
        };
        let (xs, ws) = (values(6 * 5, 41, -1.0, 1.0), values(5 * 7, 42, -1.0, 1.0));
        // The same trace on the lazy CPU first: its cached executable must
        // not serve the GPU's recording of the same structure.
        let on_lazy_cpu = Device::lazy(&cpu());
        let want = step(
            &Tensor::from_vec(xs.clone(), &[6, 5], &on_lazy_cpu).unwrap(),
            &Tensor::from_vec(ws.clone(), &[5, 7], &on_lazy_cpu).unwrap(),
        );
        lazy::mark_step();
        let want = want.to_vec().unwrap();
        let x = Tensor::from_vec(xs, &[6, 5], &on_lazy).unwrap();
        let mut w = Tensor::from_vec(ws, &[5, 7], &on_lazy).unwrap();
        lazy::reset_metrics();
        let y = step(&x, &w);
        let (before, ops_before) = (device.submissions(), rt::stats().ops_executed);
        lazy::mark_step();
        // One submission: an op sent to the CPU would have downloaded its
        // inputs, submitting what was recorded before it.
        assert_eq!(device.submissions() - before, 1, "one submission per trace");
        // MatMul, the elementwise chain fused into one GPU kernel, Sum.
        assert_eq!(rt::stats().ops_executed - ops_before, 3);
        assert_close(
            "a lazy trace on the GPU",
            &y.to_vec().unwrap(),
            &want,
            1e-5,
            1e-5,
        );
        // Steps that update `w` in device memory: the same trace, cached.
        for _ in 0..3 {
            w = &w * 0.5;
            let y = step(&x, &w);
            let before = device.submissions();
            lazy::mark_step();
            assert_eq!(device.submissions() - before, 1);
            assert!(y.to_vec().unwrap().iter().all(|v| v.is_finite()));
        }
        let m = lazy::metrics();
        assert!(m.cache_hits >= 2, "{m:?}");
    }

    /// `Device::synchronize` waits for the GPU (directly or under a lazy
    /// device), returns at once on the CPU, and is an error for a GPU the
    /// machine does not have.
    #[test]
    fn synchronize_waits_for_the_gpu_and_names_a_missing_one() {
        let (gpu, _turn) = gpu();
        let y = Tensor::<f32>::full(&[1 << 16], 0.5, &gpu) * 2.0;
        y.wait().unwrap();
        gpu.synchronize().unwrap();
        Device::lazy(&gpu).synchronize().unwrap();
        cpu().synchronize().unwrap();
        assert!(y.to_vec().unwrap().iter().all(|&v| v == 1.0));
        let missing = Device::gpu(99).synchronize().unwrap_err().to_string();
        assert!(missing.contains("gpu:99"), "{missing}");
    }

    /// Eager kernels are submitted a few at a time, not one by one; a
    /// read submits what is recorded, so it sees every launch before it.
    #[test]
    fn eager_launches_share_submissions_and_a_read_sees_them_all() {
        let (gpu, _turn) = gpu();
        let device = stagecraft::layers::wgpu::Gpu::get(0).unwrap();
        let x = Tensor::<f32>::from_vec(vec![1.0, 2.0, 3.0], &[3], &gpu).unwrap();
        gpu.synchronize().unwrap();
        let before = device.submissions();
        let mut y = x.clone();
        for _ in 0..100 {
            y = &y + &x;
        }
        let submitted = device.submissions() - before;
        assert!(
            submitted <= 100 / 8,
            "{submitted} submissions for 100 kernels"
        );
        // Three more, fewer than a submission's worth: the read submits them.
        let z = (&y * 2.0 + 1.0) - &x;
        assert_eq!(z.to_vec().unwrap(), vec![202.0, 403.0, 604.0]);
    }

    /// A lazy trace of thousands of kernels, whose launch parameters
    /// (axes, strides) differ from kernel to kernel and fill several
    /// chunks of the batch's parameter buffer: each kernel reads its own.
    #[test]
    fn a_long_lazy_trace_binds_each_kernels_own_parameters() {
        use stagecraft::lazy;
        let (gpu, _turn) = gpu();
        let device = stagecraft::layers::wgpu::Gpu::get(0).unwrap();
        let run = |d: &Device| {
            let mut y = Tensor::from_vec(values(24, 45, -1.0, 1.0), &[6, 4], d).unwrap();
            // Every step's values reach the result: the map contracts, so
            // the last `y` alone would not show a kernel that misread.
            let mut seen = y.sum(&[1], false);
            for i in 0..1500 {
                y = match i % 3 {
                    0 => &y + &(y.sum(&[0], true) * 0.001),
                    1 => &y - &(y.mean(&[1], true) * 0.5),
                    _ => y.relu() * 0.9 + 0.01,
                };
                seen = seen * 0.999 + y.sum(&[1], false);
            }
            lazy::mark_step();
            seen.to_vec().unwrap()
        };
        let want = run(&cpu());
        let before = device.submissions();
        let got = run(&Device::lazy(&gpu));
        assert_close("a long lazy trace", &got, &want, 1e-4, 1e-5);
        // One trace, one submission (and one for reading the result).
        let submissions = device.submissions() - before;
        assert!(submissions <= 3, "{submissions} submissions");
    }

    /// A host tensor a lazy GPU trace takes step after step (a dataset in
    /// memory, an input made with `from_vec`) is copied to the GPU once,
    /// not once per step; another host tensor in its place is copied.
    #[test]
    fn a_lazy_trace_on_the_gpu_copies_a_host_input_once() {
        use stagecraft::lazy;
        let (gpu, _turn) = gpu();
        let device = stagecraft::layers::wgpu::Gpu::get(0).unwrap();
        let on_lazy = Device::lazy(&gpu);
        // Past the size baked into a trace as a constant: an argument.
        let n = 1 << 16;
        let step = |x: &Tensor<f32>| ((x * 2.0 + 1.0).relu() * x).sum(&[0], false);
        let on_cpu = |xs: &[f32]| {
            step(&Tensor::from_vec(xs.to_vec(), &[n], &cpu()).unwrap())
                .to_vec()
                .unwrap()
        };
        let xs = values(n, 43, -1.0, 1.0);
        let x = Tensor::from_vec(xs.clone(), &[n], &on_lazy).unwrap();
        let first = step(&x);
        lazy::mark_step();
        assert_close(
            "first step",
            &first.to_vec().unwrap(),
            &on_cpu(&xs),
            1e-5,
            1e-4,
        );
        for _ in 0..3 {
            let before = device.uploaded_bytes();
            let y = step(&x);
            lazy::mark_step();
            assert_close("later step", &y.to_vec().unwrap(), &on_cpu(&xs), 1e-5, 1e-4);
            let copied = device.uploaded_bytes() - before;
            assert!(copied < 4 * n as u64, "{copied} bytes copied again");
        }
        let others = values(n, 44, -1.0, 1.0);
        let before = device.uploaded_bytes();
        let y = step(&Tensor::from_vec(others.clone(), &[n], &on_lazy).unwrap());
        lazy::mark_step();
        assert_close(
            "a new input",
            &y.to_vec().unwrap(),
            &on_cpu(&others),
            1e-5,
            1e-4,
        );
        assert!(device.uploaded_bytes() - before >= 4 * n as u64);
        assert!(lazy::metrics().cache_hits >= 3);
    }

    /// A lazy GPU value read early (now in device memory) and then used
    /// inside a `cond` branch stays a parameter of the branch: tracing it
    /// must not read it back to bake it.
    #[test]
    fn a_lazy_gpu_value_read_early_feeds_a_branch() {
        let (gpu, _turn) = gpu();
        let on_lazy = Device::lazy(&gpu);
        let x = Tensor::from_vec(vec![0.5f32, -1.0, 2.0], &[3], &on_lazy).unwrap();
        let y = x.exp();
        let early = y.to_vec().unwrap();
        let c = y.sum(&[], false).gt(&Tensor::scalar(0.0, &on_lazy));
        let z = stagecraft::cond(&c, || y.exp(), || y.clone());
        let want: Vec<f32> = early.iter().map(|v| v.exp()).collect();
        assert_close(
            "a branch over an early read",
            &z.to_vec().unwrap(),
            &want,
            1e-5,
            1e-6,
        );
    }

    /// Training through the lazy device on the GPU: gradients of a trace
    /// match the CPU's, and an error in a trace names the user's line.
    #[test]
    fn gradients_and_errors_of_lazy_traces_on_the_gpu() {
        let (gpu, _turn) = gpu();
        let on_lazy = Device::lazy(&gpu);
        let xs = values(4 * 3, 43, -2.0, 2.0);
        let grad_on = |device: &Device| {
            let x = Tensor::from_vec(xs.clone(), &[4, 3], device).unwrap();
            let (value, grads) =
                value_and_grad(|x: &Tensor<f32>| (x.tanh() * x).sum(&[], false))(&x);
            (value.item().unwrap(), grads.to_vec().unwrap())
        };
        let (want_value, want_grad) = grad_on(&cpu());
        let (value, grad) = grad_on(&on_lazy);
        assert_close("loss", &[value], &[want_value], 1e-5, 1e-5);
        assert_close("gradient", &grad, &want_grad, 1e-5, 1e-5);
        let a = Tensor::from_vec(vec![1.0f32; 6], &[2, 3], &on_lazy).unwrap();
        let b = Tensor::from_vec(vec![1.0f32; 6], &[2, 3], &on_lazy).unwrap();
        let line = line!() + 1;
        let bad = a.exp().matmul(&b);
        let err = bad.to_vec().unwrap_err();
        let text = err.to_string();
        assert!(text.contains("MatMul") || text.contains("matmul"), "{text}");
        assert!(text.contains(&format!("gpu.rs:{line}")), "{text}");
    }

    #[test]
    fn cancellation_stops_gpu_ops_as_it_stops_cpu_ones() {
        let (gpu, _turn) = gpu();
        let x = Tensor::from_vec(vec![1.0f32, 2.0], &[2], &gpu).unwrap();
        stagecraft::cancel_execution();
        let cancelled = x.exp().to_vec();
        stagecraft::restart();
        assert_eq!(cancelled.unwrap_err().kind(), ErrorKind::Cancelled);
        let again = x.exp().to_vec().unwrap();
        assert!((again[0] - std::f32::consts::E).abs() < 1e-6, "{again:?}");
    }

    #[test]
    fn mixing_devices_and_reading_device_memory_are_clear_errors() {
        let (gpu, _turn) = gpu();
        let g = Tensor::from_vec(vec![1.0f32, 2.0], &[2], &gpu).unwrap();
        let c = Tensor::from_vec(vec![1.0f32, 2.0], &[2], &cpu()).unwrap();
        // A CPU argument of a GPU op is copied up (counted), unless the
        // transfer guard refuses, naming the op and the line.
        let copies = rt::stats().device_copies;
        let sum = &g + &c;
        assert_eq!(sum.device(), gpu);
        assert_eq!(rt::stats().device_copies - copies, 1);
        assert_eq!(sum.to_vec().unwrap(), vec![2.0, 4.0]);
        let line = line!() + 1;
        let sum = stagecraft::transfer_guard(stagecraft::TransferGuard::Disallow, || &g + &c);
        let err = sum.check().unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Device);
        let text = err.to_string();
        assert!(text.contains("Add") && text.contains("to_device"), "{text}");
        assert!(text.contains(&format!("gpu.rs:{line}")), "{text}");
        // The runtime's own host read of a GPU handle says how to copy.
        let err = g.handle().wait().unwrap_err();
        assert!(err.to_string().contains("gpu:0"), "{err}");
        // A shape error on the GPU names the op and the line, as on the CPU.
        let m = Tensor::from_vec(vec![1.0f32; 6], &[2, 3], &gpu).unwrap();
        let line = line!() + 1;
        let bad = m.matmul(&m);
        let err = bad.to_vec().unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Shape);
        assert!(err.to_string().contains(&format!("gpu.rs:{line}")), "{err}");
        // Bad device names.
        assert!(Device::parse("gpu:x").is_err());
        assert!(Device::parse("gpu:4096")
            .unwrap_err()
            .to_string()
            .contains("adapter"));
    }

    /// The tail of a model: on `device` when given, else where it is.
    fn split_model(x: &Tensor<f32>, w: &Tensor<f32>, device: Option<Device>) -> Tensor<f32> {
        let h = x.matmul(w).relu();
        let tail = || (h.matmul(w) + 0.5f32).tanh().softmax(-1);
        let out = match device {
            Some(d) => stagecraft::with_device(&d, tail),
            None => tail(),
        };
        out.sum(&[-1], false) * 2.0f32
    }

    #[test]
    fn a_function_placed_partly_on_the_gpu_runs_as_two_partitions_joined_by_send_and_recv() {
        let (gpu, _turn) = gpu();
        let mut rng = Rng::new(4);
        let x = Tensor::<f32>::rand_normal(&[8, 16], 0.0, 1.0, &mut rng, &cpu());
        let w = Tensor::<f32>::rand_normal(&[16, 16], 0.0, 0.3, &mut rng, &cpu());
        let want = split_model(&x, &w, None).to_vec().unwrap();
        let split = stagecraft::function(move |(x, w): (Tensor<f32>, Tensor<f32>)| {
            split_model(&x, &w, Some(gpu))
        });
        let before = rt::stats().device_copies;
        let got = split.call((x.clone(), w.clone())).to_vec().unwrap();
        assert_close("split model", &got, &want, 1e-5, 1e-6);
        // h and w go to the GPU, the tail's result comes back: each edge
        // between the partitions is one Send/Recv pair, one copy.
        assert_eq!(rt::stats().device_copies - before, 3);
        let traced = split.traced_function(&(x.clone(), w.clone())).unwrap();
        let exe = rt::executor::instantiate(traced, cpu()).unwrap();
        assert_eq!(exe.partition_count(), 2);
        // Runs again from the cache, with new values.
        let x2 = &x * 0.5f32;
        let want = split_model(&x2, &w, None).to_vec().unwrap();
        let got = split.call((x2, w)).to_vec().unwrap();
        assert_close("split model, second call", &got, &want, 1e-5, 1e-6);
    }

    #[test]
    fn an_error_in_the_gpu_partition_names_its_line_and_releases_the_cpu_one() {
        let (gpu, _turn) = gpu();
        let line = line!() + 4;
        let f = stagecraft::function(move |x: Tensor<f32>| {
            let far = stagecraft::with_device(&gpu, || {
                let wide = x.reshape(&[2, 3]);
                wide.matmul(&wide).exp()
            });
            // The CPU partition waits for `far`; the GPU's error must
            // release it.
            (&x + 1.0f32).sum(&[0], false) + far.sum(&[0, 1], false)
        });
        let err = f
            .call(Tensor::<f32>::ones(&[6], &cpu()))
            .to_vec()
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Shape, "{err}");
        assert_eq!(err.op(), Some("MatMul"), "{err}");
        assert_eq!(err.location().unwrap().line(), line, "{err}");
    }

    #[test]
    fn a_function_on_the_gpu_runs_a_with_device_scope_on_the_cpu() {
        let (gpu, _turn) = gpu();
        let mut rng = Rng::new(6);
        let x = Tensor::<f32>::rand_normal(&[8, 16], 0.0, 1.0, &mut rng, &cpu());
        let w = Tensor::<f32>::rand_normal(&[16, 16], 0.0, 0.3, &mut rng, &cpu());
        let want = split_model(&x, &w, None).to_vec().unwrap();
        let on_cpu = stagecraft::function(move |(x, w): (Tensor<f32>, Tensor<f32>)| {
            split_model(&x, &w, Some(cpu()))
        });
        let (gx, gw) = (x.to_device(&gpu), w.to_device(&gpu));
        let before = rt::stats().device_copies;
        let got = on_cpu.call((gx.clone(), gw.clone()));
        assert_eq!(got.device(), gpu);
        assert_close("tail on the CPU", &got.to_vec().unwrap(), &want, 1e-5, 1e-6);
        // h and w down, the tail's result up, the result read: four.
        assert_eq!(rt::stats().device_copies - before, 4);
    }

    /// i32 arithmetic, roundings and comparisons run on the GPU with the
    /// CPU's wrapping results, broadcasting included; a division by zero
    /// goes to the CPU, which reports it.
    #[test]
    fn integer_arithmetic_and_comparisons_match_the_cpu_and_wrap() {
        let (gpu, _turn) = gpu();
        let a: Vec<i32> = vec![i32::MAX, i32::MIN, -7, 0, 5, 123_456, -1, 2];
        // -1 divides MIN (wrapping to MIN) and 3 divides -7 (truncating).
        let b: Vec<i32> = vec![1, -1, 3, 7];
        let run = |d: &Device| {
            let x = Tensor::<i32>::from_vec(a.clone(), &[2, 4], d).unwrap();
            let y = Tensor::<i32>::from_vec(b.clone(), &[4], d).unwrap();
            let ints = [
                &x + &y,
                &x - &y,
                &x * &y,
                x.neg(),
                x.abs(),
                x.square(),
                x.maximum(&y),
                x.minimum(&y),
                &x / &y,
                x.relu(),
                x.sign(),
                x.floor(),
                x.ceil(),
                x.round(),
            ];
            let bools = [x.lt(&y), x.eq(&y), x.ge(&y)];
            (ints, bools)
        };
        let copies = rt::stats().device_copies;
        let (ints, bools) = run(&gpu);
        // Nothing fell back to the CPU.
        assert_eq!(rt::stats().device_copies, copies);
        let (want_ints, want_bools) = run(&cpu());
        for (k, (g, w)) in ints.iter().zip(&want_ints).enumerate() {
            assert_eq!(g.to_vec().unwrap(), w.to_vec().unwrap(), "op {k}");
        }
        for (k, (g, w)) in bools.iter().zip(&want_bools).enumerate() {
            assert_eq!(g.to_vec().unwrap(), w.to_vec().unwrap(), "comparison {k}");
        }
        let x = Tensor::<i32>::from_vec(vec![4, 5], &[2], &gpu).unwrap();
        let zero = Tensor::<i32>::from_vec(vec![2, 0], &[2], &gpu).unwrap();
        let line = line!() + 1;
        let err = (&x / &zero).to_vec().unwrap_err();
        assert_eq!(err.op(), Some("Div"), "{err}");
        assert_eq!(err.location().unwrap().line(), line, "{err}");
    }

    /// Dropout runs on the GPU and drops the elements the CPU drops (the
    /// same Philox stream, also where the counter carries into its second
    /// word); the survivors' scaling is within one ulp of the CPU's, and
    /// the gradient is the same dropout of the incoming gradient.
    #[test]
    fn dropout_drops_what_the_cpu_drops() {
        let (gpu, _turn) = gpu();
        let xv = values(1003, 17, -3.0, 3.0);
        for (p, far) in [(0.1, false), (0.5, true), (0.9, false), (1.0, false)] {
            let stream = || {
                let mut rng = Rng::new(2024);
                if far {
                    // A draw with p = 0 moves the stream without running
                    // anything: the next draw's blocks cross 2^32.
                    let skipped = Tensor::<f32>::zeros(&[(1usize << 32) - 40], &cpu());
                    let _ = skipped.dropout(0.0, &mut rng);
                }
                rng
            };
            let run = |d: &Device| {
                let rng = stream();
                let x = Tensor::<f32>::from_vec(xv.clone(), &[17, 59], d).unwrap();
                let (y, grad) = value_and_grad(|x: &Tensor<f32>| {
                    x.dropout(p, &mut rng.clone()).square().sum(&[], false)
                })(&x);
                (y.item().unwrap(), grad.to_vec().unwrap())
            };
            let mut rng = stream();
            let mask = |d: &Device, rng: &mut Rng| {
                let x = Tensor::<f32>::from_vec(xv.clone(), &[17, 59], d).unwrap();
                x.dropout(p, rng).to_vec().unwrap()
            };
            let got = mask(&gpu, &mut rng.clone());
            let want = mask(&cpu(), &mut rng);
            for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                let ulp = (w.abs() * f32::EPSILON).max(f32::MIN_POSITIVE);
                assert!(
                    (*g == 0.0) == (*w == 0.0) && (g - w).abs() <= ulp,
                    "p = {p}, element {k}: {g} on the GPU, {w} on the CPU"
                );
            }
            let dropped = want.iter().filter(|&&v| v == 0.0).count() as f64 / 1003.0;
            assert!((dropped - p).abs() < 0.06, "p = {p}: dropped {dropped}");
            let ((gy, gg), (wy, wg)) = (run(&gpu), run(&cpu()));
            assert!((gy - wy).abs() <= 1e-4 * (1.0 + wy.abs()), "{gy} vs {wy}");
            assert_close("dropout's gradient", &gg, &wg, 1e-5, 1e-6);
        }
        let fallbacks = rt::cpu_fallbacks();
        assert!(
            !fallbacks.iter().any(|f| f.starts_with("Dropout[")),
            "{fallbacks:?}"
        );
    }

    /// Sort and top-k run on the GPU with the CPU's answer bit for bit:
    /// NaN after every number (first when descending), -0 equal to 0,
    /// ties by position, along any axis, f32 and i32; a row longer than
    /// the GPU sorts (2,048) goes to the CPU.
    #[test]
    fn sort_and_top_k_match_the_cpu() {
        let (gpu, _turn) = gpu();
        // Few distinct values, so ties are everywhere.
        let mut xv: Vec<f32> = values(6 * 37 * 5, 23, -4.0, 4.0)
            .iter()
            .map(|v| v.round() / 2.0)
            .collect();
        for (k, special) in [
            f32::NAN,
            -0.0,
            0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
        ]
        .into_iter()
        .enumerate()
        {
            xv[k * 31 + 7] = special;
        }
        let iv: Vec<i32> = xv
            .iter()
            .map(|&v| {
                if v.is_nan() {
                    7
                } else {
                    (v * 2.0).clamp(-9.0, 9.0) as i32
                }
            })
            .collect();
        let long = values(2048 * 2, 29, -1.0, 1.0);
        type Answer = (Vec<f32>, Vec<i32>, Vec<i64>);
        let run = |d: &Device| -> Vec<Answer> {
            let x = Tensor::<f32>::from_vec(xv.clone(), &[6, 37, 5], d).unwrap();
            let xi = Tensor::<i32>::from_vec(iv.clone(), &[6, 37, 5], d).unwrap();
            let mut answers = Vec::new();
            for axis in [0, 1, -1] {
                for flag in [false, true] {
                    let (v, p) = x.sort(axis, flag);
                    let (vi, pi) = xi.sort(axis, flag);
                    answers.push((
                        v.to_vec().unwrap(),
                        vi.to_vec().unwrap(),
                        p.to_vec().unwrap(),
                    ));
                    answers.push((vec![], vec![], pi.to_vec().unwrap()));
                    for sorted in [true, false] {
                        let (v, p) = x.topk(3, axis, flag, sorted);
                        let (vi, pi) = xi.topk(2, axis, flag, sorted);
                        answers.push((
                            v.to_vec().unwrap(),
                            vi.to_vec().unwrap(),
                            p.to_vec().unwrap(),
                        ));
                        answers.push((vec![], vec![], pi.to_vec().unwrap()));
                    }
                }
            }
            let l = Tensor::<f32>::from_vec(long.clone(), &[2, 2048], d).unwrap();
            let (v, p) = l.sort(-1, true);
            answers.push((v.to_vec().unwrap(), vec![], p.to_vec().unwrap()));
            answers
        };
        let got = run(&gpu);
        let fallbacks = rt::cpu_fallbacks();
        assert!(
            !fallbacks
                .iter()
                .any(|f| f.starts_with("Sort[") || f.starts_with("TopK[")),
            "{fallbacks:?}"
        );
        let want = run(&cpu());
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&g.0), bits(&w.0), "case {k}: values");
            assert_eq!((&g.1, &g.2), (&w.1, &w.2), "case {k}");
        }
        // One value past the longest row: the CPU sorts it, and says so.
        let x = Tensor::<f32>::from_vec(values(2049, 3, -1.0, 1.0), &[2049], &gpu).unwrap();
        let (v, _) = x.sort(0, false);
        let v = v.to_vec().unwrap();
        assert!(v.windows(2).all(|w| w[0] <= w[1]));
        assert!(rt::cpu_fallbacks().iter().any(|f| f.starts_with("Sort[")));
    }

    /// Casts to and from i64 (word pairs on the GPU) give the CPU's bits:
    /// i64 to f32 rounds to nearest even (ties and carries into the next
    /// power of two included), f32 to i64 truncates and saturates (NaN to
    /// 0), i64 to i32 keeps the low word.
    #[test]
    fn casts_to_and_from_i64_match_the_cpu() {
        let (gpu, _turn) = gpu();
        let mut longs: Vec<i64> = vec![
            0,
            1,
            -1,
            (1 << 24) + 1,
            (1 << 24) + 3,
            (1 << 25) + 2,
            (1 << 25) + 6,
            (1 << 40) + (1 << 16),
            (1 << 40) + (1 << 16) + 1,
            (1 << 53) - 1,
            -(1 << 53) - 1,
            (1 << 32) - 1,
            1 << 32,
            -(1 << 32),
            0x7fff_ff80_0000_0000,
            i64::MAX,
            i64::MIN,
            i64::MIN + 1,
            i64::from(i32::MAX) + 1,
            i64::from(i32::MIN) - 1,
        ];
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..300 {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            // Every magnitude: shift the random bits down by a random amount.
            longs.push((state >> (state % 61)) as i64 * if state & 1 == 0 { 1 } else { -1 });
        }
        let mut floats: Vec<f32> = vec![
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            9.223_372e18,
            -9.223_372e18,
            1e19,
            -1e19,
            3.7,
            -3.7,
            -0.5,
            4_294_967_296.0,
            -4_294_967_296.0,
            1.0995116e12,
            -2_147_483_648.0,
        ];
        floats.extend(values(200, 31, -3e12, 3e12));
        let ints: Vec<i32> = vec![0, 1, -1, i32::MAX, i32::MIN, 12345, -98765];
        let bools = vec![true, false, false, true, true];
        type Casts = (Vec<u32>, Vec<i32>, Vec<bool>, [Vec<i64>; 4]);
        let run = |d: &Device| -> Casts {
            let l = Tensor::<i64>::from_vec(longs.clone(), &[longs.len()], d).unwrap();
            let f = Tensor::<f32>::from_vec(floats.clone(), &[floats.len()], d).unwrap();
            let i = Tensor::<i32>::from_vec(ints.clone(), &[ints.len()], d).unwrap();
            let b = Tensor::<bool>::from_vec(bools.clone(), &[bools.len()], d).unwrap();
            let to_f32 = l.cast::<f32>().to_vec().unwrap();
            (
                to_f32.iter().map(|v| v.to_bits()).collect(),
                l.cast::<i32>().to_vec().unwrap(),
                l.cast::<bool>().to_vec().unwrap(),
                [
                    f.cast::<i64>().to_vec().unwrap(),
                    i.cast::<i64>().to_vec().unwrap(),
                    b.cast::<i64>().to_vec().unwrap(),
                    l.cast::<i64>().to_vec().unwrap(),
                ],
            )
        };
        let got = run(&gpu);
        let fallbacks = rt::cpu_fallbacks();
        assert!(
            !fallbacks.iter().any(|f| f.starts_with("Cast[")),
            "{fallbacks:?}"
        );
        let want = run(&cpu());
        for (k, (g, w)) in got.0.iter().zip(&want.0).enumerate() {
            let v = longs[k];
            assert_eq!(g, w, "{v} as f32: {} on the GPU", f32::from_bits(*g));
        }
        assert_eq!(got.1, want.1);
        assert_eq!(got.2, want.2);
        for (k, (g, w)) in got.3[0].iter().zip(&want.3[0]).enumerate() {
            assert_eq!(g, w, "{} as i64", floats[k]);
        }
        assert_eq!(got.3, want.3);
    }

    /// Integral aranges (a causal mask's positions) run on the GPU with
    /// the CPU's bits; others, whose values the CPU rounds from f64, run
    /// there.
    #[test]
    fn aranges_match_the_cpu() {
        let (gpu, _turn) = gpu();
        let integral = [
            (0.0, 10.0, 1.0),
            (5.0, -7.0, -3.0),
            (-0.0, 4.0, 2.0),
            (-20.0, 20.0, 7.0),
        ];
        let fractional = [(0.0, 1.0, 0.1), (-0.0, -3.0, -1.0), (0.0, 3e7, 1e6)];
        let run = |d: &Device, ranges: &[(f64, f64, f64)]| {
            let mut got = Vec::new();
            for &(start, stop, step) in ranges {
                let f = Tensor::<f32>::arange(start, stop, step, d)
                    .to_vec()
                    .unwrap();
                got.push(f.iter().map(|v| v.to_bits() as i64).collect::<Vec<_>>());
                let i = Tensor::<i32>::arange(start, stop, step, d)
                    .to_vec()
                    .unwrap();
                got.push(i.iter().map(|&v| i64::from(v)).collect());
            }
            got
        };
        assert_eq!(run(&gpu, &integral), run(&cpu(), &integral));
        let fallbacks = rt::cpu_fallbacks();
        assert!(
            !fallbacks.iter().any(|f| f.starts_with("Arange[")),
            "{fallbacks:?}"
        );
        assert_eq!(run(&gpu, &fractional), run(&cpu(), &fractional));
    }

    /// i32 sums, products, maxima and minima run on the GPU with the
    /// CPU's wrapping results, short rows a thread each and long ones a
    /// workgroup each.
    #[test]
    fn integer_reductions_match_the_cpu_and_wrap() {
        let (gpu, _turn) = gpu();
        let mut iv: Vec<i32> = values(7 * 150, 41, -3e9, 3e9)
            .iter()
            .map(|&v| v as i32)
            .collect();
        iv[5] = i32::MIN;
        iv[700] = i32::MAX;
        let small: Vec<i32> = iv.iter().map(|v| v % 5).collect();
        let run = |d: &Device| {
            let x = Tensor::<i32>::from_vec(iv.clone(), &[7, 150], d).unwrap();
            let s = Tensor::<i32>::from_vec(small.clone(), &[7, 150], d).unwrap();
            let mut got = Vec::new();
            for axes in [&[0][..], &[1], &[]] {
                got.push(x.sum(axes, false).to_vec().unwrap());
                got.push(x.max(axes, true).to_vec().unwrap());
                got.push(x.min(axes, false).to_vec().unwrap());
                got.push(s.prod(axes, false).to_vec().unwrap());
            }
            got
        };
        let got = run(&gpu);
        let fallbacks = rt::cpu_fallbacks();
        assert!(
            !fallbacks.iter().any(|f| f.ends_with("[I32]")
                && ["Sum", "Max", "Min", "Prod"]
                    .iter()
                    .any(|op| f.starts_with(op))),
            "{fallbacks:?}"
        );
        assert_eq!(got, run(&cpu()));
    }

    /// Logical ops over packed bools and bitwise ops and shifts over i32
    /// run on the GPU from their ops' own expressions, broadcasting
    /// included.
    #[test]
    fn logical_and_bitwise_ops_match_the_cpu() {
        let (gpu, _turn) = gpu();
        // 2×5 and 5: odd sizes, so packed words end part-full.
        let p = vec![
            true, false, true, true, false, false, true, false, false, true,
        ];
        let q = vec![true, true, false, false, true];
        let m: Vec<i32> = vec![0x0f0f, -1, i32::MIN, 12345, 0, 7, -8, 1 << 30, 3, 5];
        let n: Vec<i32> = vec![0x00ff, 6, -1, 0, i32::MAX];
        let run = |d: &Device| {
            let a = Tensor::<bool>::from_vec(p.clone(), &[2, 5], d).unwrap();
            let b = Tensor::<bool>::from_vec(q.clone(), &[5], d).unwrap();
            let x = Tensor::<i32>::from_vec(m.clone(), &[2, 5], d).unwrap();
            let y = Tensor::<i32>::from_vec(n.clone(), &[5], d).unwrap();
            let bools = [a.and(&b), a.or(&b), a.not(), b.and(&a).not()];
            // Shift amounts in and out of 0..32, negative ones too.
            let amounts = Tensor::<i32>::from_vec(vec![0, 31, 32, -1, 5], &[5], d).unwrap();
            let ints = [
                x.bitwise_and(&y),
                x.bitwise_or(&y),
                x.bitwise_xor(&y),
                x.bitwise_not(),
                x.shift_left(&amounts),
                x.shift_right(&amounts),
                amounts.shift_left(&x),
            ];
            (bools, ints)
        };
        let copies = rt::stats().device_copies;
        let (bools, ints) = run(&gpu);
        assert_eq!(rt::stats().device_copies, copies, "nothing fell back");
        let (want_bools, want_ints) = run(&cpu());
        for (k, (g, w)) in bools.iter().zip(&want_bools).enumerate() {
            assert_eq!(g.to_vec().unwrap(), w.to_vec().unwrap(), "logical op {k}");
        }
        for (k, (g, w)) in ints.iter().zip(&want_ints).enumerate() {
            assert_eq!(g.to_vec().unwrap(), w.to_vec().unwrap(), "bitwise op {k}");
        }
    }
}
