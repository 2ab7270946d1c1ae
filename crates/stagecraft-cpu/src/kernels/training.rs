//! CPU kernels of the training ops: dropout and the squared norm of a
//! tensor list.
//!
//! Both are deterministic whatever the thread count: dropout's mask is a
//! function of each element's index alone (see `creation.rs` for the
//! Philox stream), and the squared norm adds fixed-size chunks' partial
//! sums in chunk order.

use super::creation::Stream;
use super::elementwise::{reusable, Real};
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
}
