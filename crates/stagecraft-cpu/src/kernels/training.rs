//! CPU kernels of the training ops: dropout, the squared norm of a
//! tensor list and Adam's one-pass update.
//!
//! All are deterministic whatever the thread count: dropout's mask is a
//! function of each element's index alone (see `creation.rs` for the
//! Philox stream), the squared norm adds fixed-size chunks' partial sums
//! in chunk order, and Adam's update is elementwise.

use super::creation::Stream;
use super::elementwise::{reusable, Real};
use super::transformer::Lane;
use super::{out_meta, take};
use crate::{with_float_type, Inputs, Kernel, KernelContext, KernelRegistry, PARALLEL_THRESHOLD};
use smallvec::smallvec;
use stagecraft_ops::Attrs;
use stagecraft_tensor::{DenseHostTensor, Error, Result, Scalar, TensorMetadata};
use std::sync::Arc;

/// Elements per parallel task and per partial sum (a multiple of four,
/// so a dropout chunk starts at a Philox block boundary).
const CHUNK: usize = 1 << 14;

pub(crate) fn register(registry: &mut KernelRegistry) {
    registry.add(&stagecraft_ops::DROPOUT, dropout_factory);
    registry.add(&stagecraft_ops::SQUARED_NORM, squared_norm_factory);
    registry.add(&stagecraft_ops::ADAM_UPDATE, adam_update_factory);
}

fn no_kernel(attrs: &Attrs<'_>, inputs: &[TensorMetadata]) -> Error {
    let dtype = inputs.first().map(|m| m.dtype.to_string());
    Error::dtype(format!(
        "{} has no CPU kernel for {}",
        attrs.op().name,
        dtype.as_deref().unwrap_or("no inputs")
    ))
}

// ---------------------------------------------------------------------------
// Dropout.

/// The keep rule of one draw: element `i` survives when the top 24 bits of
/// its Philox word reach `threshold = ⌈p·2^24⌉`, which is exactly `u ≥ p`
/// for the uniform `u = (w >> 8)·2^-24` of `RandomUniform`.
#[derive(Clone, Copy)]
pub(crate) struct KeepRule {
    threshold: u32,
    /// `1 / (1 - p)`; infinite for `p = 1`, when nothing survives.
    scale: f64,
}

impl KeepRule {
    pub(crate) fn new(p: f64) -> KeepRule {
        KeepRule {
            threshold: stagecraft_ops::dropout_threshold(p),
            scale: 1.0 / (1.0 - p),
        }
    }

    #[inline(always)]
    fn keeps(self, word: u32) -> bool {
        word >> 8 >= self.threshold
    }
}

/// `(seed, offset)` from the key tensor `[seed, offset]`.
fn key_stream(key: &DenseHostTensor) -> Result<Stream> {
    match key.as_slice::<i64>()? {
        &[seed, offset] => Stream::new(seed, offset).map_err(|_| {
            Error::attribute(format!(
                "the key's offset must be non-negative, got {offset}"
            ))
        }),
        other => Err(Error::internal(format!(
            "the dropout key holds {} values, not [seed, offset]",
            other.len()
        ))),
    }
}

fn dropout_factory(attrs: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    let dtype = super::first_dtype(inputs)?;
    with_float_type!(dtype, T => Ok(dropout_kernel::<T>()), _ => Err(no_kernel(attrs, inputs)))
}

fn dropout_kernel<T: Real>() -> Kernel {
    Arc::new(|inputs: Inputs, ctx: &KernelContext<'_>| {
        let [x, key] = take(inputs)?;
        let stream = key_stream(&key)?;
        let rule = KeepRule::new(ctx.attrs.float("p")?);
        let meta = out_meta(ctx)?;
        let mut out = if reusable(&x, meta) {
            x
        } else {
            let mut out = DenseHostTensor::for_overwrite(meta.clone())?;
            out.as_mut_slice::<T>()?.copy_from_slice(x.as_slice::<T>()?);
            out
        };
        let values = out.as_mut_slice::<T>()?;
        let apply = |index: usize, chunk: &mut [T]| {
            dropout_chunk(chunk, (index * CHUNK) as u64, &stream, rule)
        };
        if values.len() >= PARALLEL_THRESHOLD {
            crate::pool::for_each_chunk(values, CHUNK, apply);
        } else {
            apply(0, values);
        }
        Ok(smallvec![out])
    })
}

/// Applies the mask to `values`, elements `first..` of the stream; `first`
/// is a multiple of four.
fn dropout_chunk<T: Real>(values: &mut [T], first: u64, stream: &Stream, rule: KeepRule) {
    for (b, group) in values.chunks_mut(4).enumerate() {
        let words = stream.block(first / 4 + b as u64);
        for (v, &w) in group.iter_mut().zip(&words) {
            *v = if rule.keeps(w) {
                T::narrow(v.wide() * rule.scale)
            } else {
                T::narrow(0.0)
            };
        }
    }
}

// ---------------------------------------------------------------------------
// SquaredNorm.

fn squared_norm_factory(attrs: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    let dtype = super::first_dtype(inputs)?;
    with_float_type!(dtype, T => Ok(squared_norm_kernel::<T>()), _ => Err(no_kernel(attrs, inputs)))
}

fn squared_norm_kernel<T: Real>() -> Kernel {
    Arc::new(|inputs: Inputs, ctx: &KernelContext<'_>| {
        let mut total = 0.0f64;
        for x in &inputs {
            total += squared_sum(x.as_slice::<T>()?);
        }
        let meta = out_meta(ctx)?;
        let out = stagecraft_tensor::ScalarHostTensor::new(
            Scalar::F64(total).cast(meta.dtype),
            meta.shape.clone(),
        );
        Ok(smallvec![out.to_dense()?])
    })
}

/// `Σ v²` in f64: fixed chunks summed with eight accumulators each, the
/// chunk sums added in order, so the result never depends on threads.
fn squared_sum<T: Real>(values: &[T]) -> f64 {
    let chunk_sum = |chunk: &[T]| {
        let mut acc = [0.0f64; 8];
        let mut groups = chunk.chunks_exact(8);
        for group in &mut groups {
            for (a, v) in acc.iter_mut().zip(group) {
                let w = v.wide();
                *a += w * w;
            }
        }
        let tail: f64 = groups.remainder().iter().map(|v| v.wide() * v.wide()).sum();
        acc.iter().sum::<f64>() + tail
    };
    if values.len() < PARALLEL_THRESHOLD {
        return values.chunks(CHUNK).map(chunk_sum).sum();
    }
    let mut partials = vec![0.0; values.len().div_ceil(CHUNK)];
    let count = partials.len();
    let jobs = partials.iter_mut().zip(values.chunks(CHUNK));
    crate::pool::for_each_item_init(
        jobs,
        count,
        || (),
        |(), (partial, chunk)| *partial = chunk_sum(chunk),
    );
    partials.iter().sum()
}

// ---------------------------------------------------------------------------
// AdamUpdate.

/// An update's constants, each rounded to the element type as
/// `stagecraft::optim` rounds them for its separate ops.
#[derive(Clone, Copy)]
struct AdamCoefs<T> {
    b1: T,
    c1: T,
    b2: T,
    c2: T,
    eps: T,
    /// Adam's L2 term; `None` for 0 (then the gradient is used as it is:
    /// `g + p * 0` would turn an infinite parameter into NaN).
    weight_decay: Option<T>,
    lr: T,
    bias1: T,
    bias2: T,
    decay: T,
}

/// One element: `(p', m', v')`, each operation rounded as the separate
/// ops round it, in the order `ADAM_UPDATE`'s documentation writes.
#[inline(always)]
fn adam_element<T: Lane>(k: &AdamCoefs<T>, p: T, g: T, m: T, v: T) -> (T, T, T) {
    let g = match k.weight_decay {
        Some(wd) => g + p * wd,
        None => g,
    };
    let m = m * k.b1 + g * k.c1;
    let v = v * k.b2 + (g * g) * k.c2;
    let direction = (m / k.bias1) / ((v / k.bias2).root() + k.eps);
    (p * k.decay - direction * k.lr, m, v)
}

/// The old parameter and moments, when they are not the outputs'
/// buffers themselves.
type AdamSources<'a, T> = Option<[&'a [T]; 3]>;

/// Writes `(p', m', v')` into `p`, `m`, `v`, from `g` and either `old`
/// (shared inputs, left as they are) or the outputs' own values (updated
/// in place).
#[inline(always)]
fn adam_loop<T: Lane>(
    k: &AdamCoefs<T>,
    [p, m, v]: [&mut [T]; 3],
    old: AdamSources<'_, T>,
    g: &[T],
) {
    let outs = p.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(g);
    match old {
        None => {
            for (((p, m), v), &g) in outs {
                (*p, *m, *v) = adam_element(k, *p, g, *m, *v);
            }
        }
        Some([p0, m0, v0]) => {
            for ((((p, m), v), &g), ((&p0, &m0), &v0)) in outs.zip(p0.iter().zip(m0).zip(v0)) {
                (*p, *m, *v) = adam_element(k, p0, g, m0, v0);
            }
        }
    }
}

/// [`adam_loop`] compiled for the kernels' instruction set: the loop is
/// multiplies, adds, divisions and square roots, each one IEEE operation
/// per lane on every instruction set, so the bits do not change with it.
fn adam_loop_on<T: Lane>(
    isa: super::fused::Isa,
    k: &AdamCoefs<T>,
    outs: [&mut [T]; 3],
    old: AdamSources<'_, T>,
    g: &[T],
) {
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn avx2<T: Lane>(k: &AdamCoefs<T>, outs: [&mut [T]; 3], old: AdamSources<'_, T>, g: &[T]) {
        adam_loop(k, outs, old, g)
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    fn avx512<T: Lane>(k: &AdamCoefs<T>, outs: [&mut [T]; 3], old: AdamSources<'_, T>, g: &[T]) {
        adam_loop(k, outs, old, g)
    }
    match isa {
        super::fused::Isa::Baseline => adam_loop(k, outs, old, g),
        // SAFETY: `isa()` reported AVX2, all `avx2` is compiled to use.
        #[cfg(target_arch = "x86_64")]
        super::fused::Isa::Avx2 => unsafe { avx2(k, outs, old, g) },
        // SAFETY: as above, for AVX-512F.
        #[cfg(target_arch = "x86_64")]
        super::fused::Isa::Avx512 => unsafe { avx512(k, outs, old, g) },
    }
}

fn adam_update_factory(attrs: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    let hyper = [
        attrs.float("beta1")?,
        attrs.float("beta2")?,
        attrs.float("eps")?,
        attrs.float("weight_decay")?,
    ];
    match super::first_dtype(inputs)? {
        stagecraft_tensor::DType::F32 => Ok(adam_update_kernel::<f32>(hyper)),
        stagecraft_tensor::DType::F64 => Ok(adam_update_kernel::<f64>(hyper)),
        _ => Err(no_kernel(attrs, inputs)),
    }
}

/// The kernel for `[beta1, beta2, eps, weight_decay]`.
fn adam_update_kernel<T: Lane>(hyper: [f64; 4]) -> Kernel {
    let [beta1, beta2, eps, weight_decay] = hyper;
    Arc::new(move |inputs: Inputs, ctx: &KernelContext<'_>| {
        let [p, g, m, v, lr, bias1, bias2, decay] = take(inputs)?;
        let meta = out_meta(ctx)?;
        let scalar = |t: &DenseHostTensor| -> Result<T> {
            t.as_slice::<T>()?
                .first()
                .copied()
                .ok_or_else(|| Error::internal("AdamUpdate: a rank-0 input without its element"))
        };
        let k = AdamCoefs {
            b1: T::of(beta1),
            c1: T::of(1.0 - beta1),
            b2: T::of(beta2),
            c2: T::of(1.0 - beta2),
            eps: T::of(eps),
            weight_decay: (weight_decay != 0.0).then(|| T::of(weight_decay)),
            lr: scalar(&lr)?,
            bias1: scalar(&bias1)?,
            bias2: scalar(&bias2)?,
            decay: scalar(&decay)?,
        };
        // A lazy step's state is held by nothing else: the outputs take
        // its buffers and the update runs in place. Otherwise the old
        // values stay as they are and the outputs are fresh.
        let in_place = [&p, &m, &v].iter().all(|x| reusable(x, meta));
        let (mut p, mut m, mut v, old) = if in_place {
            (p, m, v, None)
        } else {
            let fresh = || DenseHostTensor::for_overwrite(meta.clone());
            (fresh()?, fresh()?, fresh()?, Some([p, m, v]))
        };
        let old = match &old {
            Some([p0, m0, v0]) => Some([
                p0.as_slice::<T>()?,
                m0.as_slice::<T>()?,
                v0.as_slice::<T>()?,
            ]),
            None => None,
        };
        let (ps, ms, vs, gs) = (
            p.as_mut_slice::<T>()?,
            m.as_mut_slice::<T>()?,
            v.as_mut_slice::<T>()?,
            g.as_slice::<T>()?,
        );
        let isa = super::fused::isa();
        if gs.len() > PARALLEL_THRESHOLD {
            let parts = ps
                .chunks_mut(CHUNK)
                .zip(ms.chunks_mut(CHUNK))
                .zip(vs.chunks_mut(CHUNK))
                .enumerate();
            crate::pool::for_each_item_init(
                parts,
                gs.len().div_ceil(CHUNK),
                || (),
                |(), (c, ((p, m), v))| {
                    let range = c * CHUNK..c * CHUNK + p.len();
                    let old = old.map(|o| o.map(|x| &x[range.clone()]));
                    adam_loop_on(isa, &k, [p, m, v], old, &gs[range]);
                },
            );
        } else {
            adam_loop_on(isa, &k, [ps, ms, vs], old, gs);
        }
        Ok(smallvec![p, m, v])
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::training as reference;
    use stagecraft_ops::{OpAttrs, OpDef};
    use stagecraft_tensor::{DType, Element, Shape};

    fn run(
        def: &'static OpDef,
        inputs: Vec<DenseHostTensor>,
        attrs: &OpAttrs,
    ) -> Result<DenseHostTensor> {
        let metas: Vec<TensorMetadata> = inputs.iter().map(|t| t.metadata().clone()).collect();
        let out_meta = def.infer(&metas, attrs)?;
        let factory = crate::registry().get(def).expect("kernel registered");
        let kernel = factory(&Attrs::new(attrs, def), &metas)?;
        let ctx = KernelContext {
            attrs: Attrs::new(attrs, def),
            outputs: &out_meta,
        };
        let mut out = kernel(inputs.into_iter().collect(), &ctx)?;
        assert_eq!(out[0].metadata(), &out_meta[0], "{} metadata", def.name);
        Ok(out.remove(0))
    }

    fn values(t: &DenseHostTensor) -> Vec<f64> {
        (0..t.numel())
            .map(|i| t.get_scalar(i).unwrap().to_f64())
            .collect()
    }

    fn tensor(dtype: DType, values: &[f64], dims: &[usize]) -> DenseHostTensor {
        let build = || -> Result<DenseHostTensor> {
            crate::with_any_type!(dtype, T => {
                let v: Vec<T> = values.iter().map(|&x| T::from_scalar(Scalar::F64(x))).collect();
                DenseHostTensor::from_slice(&v, dims)
            })
        };
        build().unwrap()
    }

    fn dropout(dtype: DType, x: &[f64], seed: i64, offset: i64, p: f64) -> Result<Vec<f64>> {
        let mut attrs = OpAttrs::new();
        attrs.set_float("p", p);
        let key = DenseHostTensor::from_slice(&[seed, offset], &[2usize][..]).unwrap();
        let out = run(
            &stagecraft_ops::DROPOUT,
            vec![tensor(dtype, x, &[x.len()]), key],
            &attrs,
        )?;
        Ok(values(&out))
    }

    const FLOATS: [DType; 4] = [DType::F16, DType::BF16, DType::F32, DType::F64];

    #[test]
    fn dropout_matches_the_reference_across_chunks() {
        // Long enough to be split across threads, with a ragged end.
        let n = if cfg!(miri) { 37 } else { 3 * CHUNK + 5 };
        let x: Vec<f64> = (0..n).map(|i| (i % 17) as f64 * 0.25 - 2.0).collect();
        for dtype in FLOATS {
            if !crate::kernels::runs_in_this_build(dtype, &[n]) {
                continue;
            }
            for (seed, offset, p) in [(7, 0, 0.5), (1 << 40, 12, 0.1), (3, 5, 0.0), (3, 5, 1.0)] {
                let got = dropout(dtype, &x, seed, offset, p).unwrap();
                let want = reference::dropout(&x, dtype, seed as u64, offset as u64, p);
                assert_eq!(got, want, "{dtype} seed {seed} offset {offset} p {p}");
            }
        }
    }

    #[test]
    fn dropout_keeps_about_one_minus_p_and_shifts_with_the_offset() {
        let n = if cfg!(miri) { 64 } else { 40_000 };
        let x = vec![1.0; n];
        let got = dropout(DType::F32, &x, 11, 0, 0.3).unwrap();
        let kept = got.iter().filter(|&&v| v != 0.0).count() as f64 / n as f64;
        if !cfg!(miri) {
            assert!((kept - 0.7).abs() < 0.01, "kept {kept}");
        }
        assert!(got
            .iter()
            .all(|&v| v == 0.0 || v == (1.0f64 / 0.7) as f32 as f64));
        // Offset k blocks on: the same mask from element 4k on.
        let shifted = dropout(DType::F32, &x[8..], 11, 2, 0.3).unwrap();
        assert_eq!(shifted, got[8..]);
    }

    #[test]
    fn dropout_rejects_a_negative_offset() {
        let err = dropout(DType::F32, &[1.0], 1, -3, 0.5).unwrap_err();
        assert!(err.to_string().contains("offset"), "{err}");
    }

    #[test]
    fn squared_norm_matches_the_reference() {
        let sizes: &[usize] = if cfg!(miri) {
            &[0, 3, 17]
        } else {
            &[0, 3, 17, PARALLEL_THRESHOLD + 3, 2 * CHUNK + 1]
        };
        for dtype in FLOATS {
            let inputs: Vec<Vec<f64>> = sizes
                .iter()
                .map(|&n| (0..n).map(|i| ((i * 7) % 13) as f64 * 0.5 - 3.0).collect())
                .collect();
            let tensors = inputs
                .iter()
                .map(|v| tensor(dtype, v, &[v.len()]))
                .collect();
            let got = run(&stagecraft_ops::SQUARED_NORM, tensors, &OpAttrs::new()).unwrap();
            assert_eq!(got.shape(), &Shape::scalar());
            let slices: Vec<&[f64]> = inputs.iter().map(|v| v.as_slice()).collect();
            let want = reference::squared_norm(&slices, dtype);
            assert_eq!(values(&got), vec![want], "{dtype}");
        }
    }

    /// Elementwise `op` of two tensors by the registry's own kernel.
    fn binary(
        op: stagecraft_ops::BinaryOp,
        a: &DenseHostTensor,
        b: &DenseHostTensor,
    ) -> DenseHostTensor {
        run(op.def(), vec![a.clone(), b.clone()], &OpAttrs::new()).unwrap()
    }

    /// Adam's update by the separate ops' kernels, as `stagecraft::optim`
    /// wrote it before `AdamUpdate`: `(p', m', v')`.
    fn adam_by_separate_ops(
        [p, g, m, v]: [&DenseHostTensor; 4],
        [lr, bias1, bias2, decay]: [&DenseHostTensor; 4],
        [beta1, beta2, eps, wd]: [f64; 4],
    ) -> [DenseHostTensor; 3] {
        use stagecraft_ops::{BinaryOp as B, UnaryOp};
        let dtype = p.metadata().dtype;
        let c = |x: f64| tensor(dtype, &[x], &[]);
        let g = if wd != 0.0 {
            binary(B::Add, g, &binary(B::Mul, p, &c(wd)))
        } else {
            g.clone()
        };
        let m = binary(
            B::Add,
            &binary(B::Mul, m, &c(beta1)),
            &binary(B::Mul, &g, &c(1.0 - beta1)),
        );
        let gg = binary(B::Mul, &g, &g);
        let v = binary(
            B::Add,
            &binary(B::Mul, v, &c(beta2)),
            &binary(B::Mul, &gg, &c(1.0 - beta2)),
        );
        let root = run(
            UnaryOp::Sqrt.def(),
            vec![binary(B::Div, &v, bias2)],
            &OpAttrs::new(),
        )
        .unwrap();
        let direction = binary(
            B::Div,
            &binary(B::Div, &m, bias1),
            &binary(B::Add, &root, &c(eps)),
        );
        let p = binary(
            B::Sub,
            &binary(B::Mul, p, decay),
            &binary(B::Mul, &direction, lr),
        );
        [p, m, v]
    }

    fn adam_by_kernel(
        inputs: [DenseHostTensor; 8],
        [beta1, beta2, eps, wd]: [f64; 4],
    ) -> Vec<DenseHostTensor> {
        let def = &stagecraft_ops::ADAM_UPDATE;
        let mut attrs = OpAttrs::new();
        attrs
            .set_float("beta1", beta1)
            .set_float("beta2", beta2)
            .set_float("eps", eps)
            .set_float("weight_decay", wd);
        let metas: Vec<TensorMetadata> = inputs.iter().map(|t| t.metadata().clone()).collect();
        let out_meta = def.infer(&metas, &attrs).unwrap();
        let kernel = crate::registry().get(def).unwrap()(&Attrs::new(&attrs, def), &metas).unwrap();
        let ctx = KernelContext {
            attrs: Attrs::new(&attrs, def),
            outputs: &out_meta,
        };
        kernel(inputs.into_iter().collect(), &ctx)
            .unwrap()
            .into_vec()
    }

    fn bits(t: &DenseHostTensor) -> Vec<u64> {
        match t.metadata().dtype {
            DType::F32 => t
                .as_slice::<f32>()
                .unwrap()
                .iter()
                .map(|x| u64::from(x.to_bits()))
                .collect(),
            _ => t
                .as_slice::<f64>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect(),
        }
    }

    #[test]
    fn adam_update_gives_the_separate_ops_bits() {
        // Across the parallel threshold, with a ragged end; zeros, signed
        // zeros, infinities, NaN and values whose squares overflow f32.
        let n = if cfg!(miri) { 41 } else { 2 * CHUNK + 7 };
        let special = [
            0.0,
            -0.0,
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::NAN,
            3e19,
            -2e-30,
        ];
        let value = |i: usize, salt: u64| -> f64 {
            if i % 97 < special.len() && salt == 1 {
                return special[i % 97];
            }
            let h = (i as u64 ^ salt).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 11;
            (h as f64 / (1u64 << 53) as f64 - 0.5) * 4.0
        };
        for dtype in [DType::F32, DType::F64] {
            for hyper in [[0.9, 0.99, 1e-8, 0.0], [0.8, 0.999, 1e-6, 0.1]] {
                for decay in [1.0, 0.9999] {
                    let vec = |salt| {
                        tensor(
                            dtype,
                            &(0..n).map(|i| value(i, salt)).collect::<Vec<_>>(),
                            &[n],
                        )
                    };
                    let (p, g) = (vec(1), vec(2));
                    let m = vec(3);
                    // v is a running mean of squares: non-negative.
                    let v = tensor(
                        dtype,
                        &(0..n).map(|i| value(i, 4).abs()).collect::<Vec<_>>(),
                        &[n],
                    );
                    let s = |x: f64| tensor(dtype, &[x], &[]);
                    let scalars = [
                        s(1e-3),
                        s(1.0 - 0.9f64.powi(3)),
                        s(1.0 - 0.99f64.powi(3)),
                        s(decay),
                    ];
                    let want = adam_by_separate_ops(
                        [&p, &g, &m, &v],
                        [&scalars[0], &scalars[1], &scalars[2], &scalars[3]],
                        hyper,
                    );
                    // Shared inputs (copied) and unique ones (updated in place).
                    let kept = [p.clone(), m.clone(), v.clone()];
                    let [lr, b1, b2, d] = scalars;
                    let shared = adam_by_kernel(
                        [
                            p.clone(),
                            g.clone(),
                            m.clone(),
                            v.clone(),
                            lr.clone(),
                            b1.clone(),
                            b2.clone(),
                            d.clone(),
                        ],
                        hyper,
                    );
                    let unique = adam_by_kernel([p, g, m, v, lr, b1, b2, d], hyper);
                    for k in 0..3 {
                        assert_eq!(
                            bits(&shared[k]),
                            bits(&want[k]),
                            "{dtype} {hyper:?} output {k}"
                        );
                        assert_eq!(
                            bits(&unique[k]),
                            bits(&want[k]),
                            "{dtype} {hyper:?} output {k}"
                        );
                    }
                    // The shared inputs were not written.
                    assert_ne!(bits(&kept[0]), bits(&shared[0]));
                    assert_eq!(bits(&kept[0]), bits(&vec(1)));
                }
            }
        }
    }

    #[test]
    fn adam_update_loops_agree_on_every_instruction_set() {
        let n = if cfg!(miri) { 33 } else { 1000 };
        let xs: Vec<f32> = (0..n)
            .map(|i| ((i * 37) % 101) as f32 / 13.0 - 3.0)
            .collect();
        let k = AdamCoefs {
            b1: 0.9f32,
            c1: 0.1,
            b2: 0.999,
            c2: 1.0 - 0.999f64 as f32,
            eps: 1e-8,
            weight_decay: Some(0.01),
            lr: 3e-4,
            bias1: 0.19,
            bias2: 0.002,
            decay: 0.99999,
        };
        let run_on = |isa| {
            let (mut p, mut m) = (xs.clone(), xs.iter().map(|x| x * 0.5).collect::<Vec<_>>());
            let mut v: Vec<f32> = xs.iter().map(|x| x * x).collect();
            let (p0, m0, v0) = (p.clone(), m.clone(), v.clone());
            adam_loop_on(isa, &k, [&mut p, &mut m, &mut v], None, &xs);
            // The same update into fresh outputs, the old values read apart.
            let mut fresh = [vec![0.0; n], vec![0.0; n], vec![0.0; n]];
            let [fp, fm, fv] = &mut fresh;
            adam_loop_on(isa, &k, [fp, fm, fv], Some([&p0, &m0, &v0]), &xs);
            assert_eq!([&p, &m, &v], [&fresh[0], &fresh[1], &fresh[2]], "{isa:?}");
            (p, m, v)
        };
        let baseline = run_on(super::super::fused::Isa::Baseline);
        let mut isas = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            use crate::isa::IsaLevel;
            let level = crate::isa::detected();
            if level >= IsaLevel::Avx2 {
                isas.push(super::super::fused::Isa::Avx2);
            }
            if level >= IsaLevel::Avx512 {
                isas.push(super::super::fused::Isa::Avx512);
            }
        }
        if isas.is_empty() {
            println!("skipped: this CPU (or Miri) has no AVX2 to compare with baseline");
        }
        for isa in isas {
            let got = run_on(isa);
            let same =
                |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(
                same(&got.0, &baseline.0) && same(&got.1, &baseline.1) && same(&got.2, &baseline.2),
                "{isa:?}"
            );
        }
    }
}
