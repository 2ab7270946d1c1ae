//! CPU kernel of the running sum `Cumsum`.
//!
//! The input is viewed as `[outer, n, inner]` around the scanned axis.
//! Each `(outer, inner)` column keeps one running total, in f64 for floats
//! (each output rounded once, so a long f16 or f32 scan does not drift)
//! and wrapping in the type for integers. With `inner > 1` the totals of
//! a whole row of columns advance together, reading and writing rows
//! contiguously.

use crate::{Inputs, Kernel, KernelContext, KernelRegistry, PARALLEL_THRESHOLD};
use half::{bf16, f16};
use smallvec::smallvec;
use stagecraft_ops::Attrs;
use stagecraft_tensor::{
    element_count, normalize_axis, DenseHostTensor, Element, Error, Result, TensorMetadata,
};
use std::sync::Arc;

pub(crate) fn register(registry: &mut KernelRegistry) {
    registry.add(&stagecraft_ops::CUMSUM, cumsum_factory);
}

/// How a scan accumulates an element type.
trait Scan: Element {
    /// The running total's type.
    type Total: Copy + Send + Sync;
    const ZERO: Self::Total;
    fn add(total: Self::Total, value: Self) -> Self::Total;
    fn round(total: Self::Total) -> Self;
}

macro_rules! float_scan {
    ($t:ty, $widen:expr, $narrow:expr) => {
        impl Scan for $t {
            type Total = f64;
            const ZERO: f64 = 0.0;
            #[inline]
            fn add(total: f64, value: $t) -> f64 {
                let widen: fn($t) -> f64 = $widen;
                total + widen(value)
            }
            #[inline]
            fn round(total: f64) -> $t {
                let narrow: fn(f64) -> $t = $narrow;
                narrow(total)
            }
        }
    };
}

float_scan!(f64, |v| v, |t| t);
// `as` rounds to nearest, ties to even.
float_scan!(f32, f64::from, |t| t as f32);
float_scan!(f16, f16::to_f64, f16::from_f64);
float_scan!(bf16, bf16::to_f64, bf16::from_f64);

macro_rules! int_scan {
    ($t:ty) => {
        impl Scan for $t {
            type Total = $t;
            const ZERO: $t = 0;
            #[inline]
            fn add(total: $t, value: $t) -> $t {
                total.wrapping_add(value)
            }
            #[inline]
            fn round(total: $t) -> $t {
                total
            }
        }
    };
}

int_scan!(u8);
int_scan!(i8);
int_scan!(u16);
int_scan!(i16);
int_scan!(u32);
int_scan!(u64);
int_scan!(i32);
int_scan!(i64);

/// The scan's options, decoded once per call.
#[derive(Clone, Copy)]
struct Options {
    exclusive: bool,
    reverse: bool,
}

type ScanFn = fn(DenseHostTensor, usize, Options) -> Result<DenseHostTensor>;

fn cumsum_factory(attrs: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    let dtype = inputs
        .first()
        .map(|m| m.dtype)
        .ok_or_else(|| Error::internal("Cumsum without input"))?;
    let f: ScanFn = crate::with_numeric_type!(dtype, T => cumsum::<T>, _ => {
        return Err(Error::dtype(format!(
            "{} has no CPU kernel for {dtype}",
            attrs.op().name
        )))
    });
    Ok(Arc::new(move |inputs: Inputs, ctx: &KernelContext<'_>| {
        let x = inputs
            .into_iter()
            .next()
            .ok_or_else(|| Error::internal("Cumsum expects one input"))?;
        let axis = normalize_axis(ctx.attrs.int("axis")? as isize, x.shape().rank())?;
        let options = Options {
            exclusive: ctx.attrs.bool("exclusive")?,
            reverse: ctx.attrs.bool("reverse")?,
        };
        Ok(smallvec![f(x, axis, options)?])
    }))
}

fn cumsum<T: Scan>(x: DenseHostTensor, axis: usize, options: Options) -> Result<DenseHostTensor> {
    let dims = x.shape().dims();
    let (n, inner) = (dims[axis], element_count(&dims[axis + 1..]));
    let mut out = DenseHostTensor::zeros(x.metadata().clone())?;
    if out.numel() == 0 {
        return Ok(out);
    }
    let src = x.as_slice::<T>()?;
    let block = n * inner;
    let scan_blocks = |dst: &mut [T], first: usize| {
        let mut totals = vec![T::ZERO; inner];
        for (b, out_block) in dst.chunks_exact_mut(block).enumerate() {
            let at = (first + b) * block;
            scan_block(&src[at..at + block], out_block, &mut totals, inner, options);
        }
    };
    let dst = out.as_mut_slice::<T>()?;
    if dst.len() > PARALLEL_THRESHOLD && dst.len() > block {
        let per_task = (PARALLEL_THRESHOLD / block).max(1);
        crate::pool::for_each_chunk(dst, per_task * block, |c, chunk| {
            scan_blocks(chunk, c * per_task)
        });
    } else {
        scan_blocks(dst, 0);
    }
    Ok(out)
}

/// Scans one `[n, inner]` block: row by row, forwards or backwards, every
/// column's total advancing together.
fn scan_block<T: Scan>(
    src: &[T],
    dst: &mut [T],
    totals: &mut [T::Total],
    inner: usize,
    options: Options,
) {
    totals.fill(T::ZERO);
    let n = src.len() / inner;
    for step in 0..n {
        let row = if options.reverse { n - 1 - step } else { step };
        let (from, to) = (row * inner, (row + 1) * inner);
        let (input, output) = (&src[from..to], &mut dst[from..to]);
        for ((o, &v), total) in output.iter_mut().zip(input).zip(totals.iter_mut()) {
            if options.exclusive {
                *o = T::round(*total);
                *total = T::add(*total, v);
            } else {
                *total = T::add(*total, v);
                *o = T::round(*total);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::scan as reference;
    use crate::with_any_type;
    use proptest::prelude::*;
    use stagecraft_ops::OpAttrs;
    use stagecraft_tensor::DType;
    use stagecraft_tensor::Scalar;

    fn run(x: DenseHostTensor, attrs: &OpAttrs) -> Result<DenseHostTensor> {
        let def = &stagecraft_ops::CUMSUM;
        let metas = [x.metadata().clone()];
        let out_meta = def.infer(&metas, attrs)?;
        let factory = crate::registry().get(def).expect("kernel registered");
        let kernel = factory(&Attrs::new(attrs, def), &metas)?;
        let ctx = KernelContext {
            attrs: Attrs::new(attrs, def),
            outputs: &out_meta,
        };
        let mut out = kernel(smallvec![x], &ctx)?;
        assert_eq!(out[0].metadata(), &out_meta[0]);
        Ok(out.remove(0))
    }

    fn check(dtype: DType, dims: &[usize], axis: usize, exclusive: bool, reverse: bool) {
        let n = element_count(dims);
        let x: Vec<f64> = (0..n)
            .map(|i| {
                let v = ((i * 37) % 29) as f64 - 14.0;
                if dtype.is_float() {
                    v / 3.0
                } else {
                    v
                }
            })
            .collect();
        let t = {
            let build = || -> Result<DenseHostTensor> {
                with_any_type!(dtype, T => {
                    let v: Vec<T> = x.iter().map(|&v| T::from_scalar(Scalar::F64(v))).collect();
                    DenseHostTensor::from_slice(&v, dims)
                })
            };
            build().unwrap()
        };
        // The reference sums the values the tensor really holds.
        let held: Vec<f64> = (0..n).map(|i| t.get_scalar(i).unwrap().to_f64()).collect();
        let mut attrs = OpAttrs::new();
        attrs
            .set_int(
                "axis",
                axis as i64 - if reverse { dims.len() as i64 } else { 0 },
            )
            .set_bool("exclusive", exclusive)
            .set_bool("reverse", reverse);
        let out = run(t, &attrs).unwrap();
        let want = reference::cumsum(&held, dims, axis, exclusive, reverse);
        let got: Vec<f64> = (0..n)
            .map(|i| out.get_scalar(i).unwrap().to_f64())
            .collect();
        let rounded: Vec<f64> = want
            .iter()
            .map(|&v| Scalar::F64(v).cast(dtype).to_f64())
            .collect();
        assert_eq!(
            got, rounded,
            "cumsum {dims:?} axis {axis} exclusive {exclusive} reverse {reverse} ({dtype})"
        );
    }

    #[test]
    fn fixed_cases_match_the_reference() {
        for dtype in [
            DType::F16,
            DType::BF16,
            DType::F32,
            DType::F64,
            DType::U8,
            DType::I8,
            DType::U16,
            DType::I16,
            DType::U32,
            DType::I32,
            DType::U64,
            DType::I64,
        ] {
            for (exclusive, reverse) in [(false, false), (true, false), (false, true), (true, true)]
            {
                check(dtype, &[5], 0, exclusive, reverse);
                check(dtype, &[3, 4, 2], 1, exclusive, reverse);
                check(dtype, &[3, 4, 2], 2, exclusive, reverse);
                check(dtype, &[3, 0, 2], 0, exclusive, reverse);
            }
        }
        // Past the parallel threshold: many small blocks, and two long
        // scans (the reference sums each output from scratch: keep it
        // short enough to stay quick).
        check(DType::F32, &[400, 30, 5], 1, false, true);
        check(DType::F32, &[2, 20_000], 1, true, false);
    }

    /// Integer totals wrap in the element type, as integer `Add` does.
    #[test]
    fn small_integer_scans_wrap() {
        let x = DenseHostTensor::from_slice(&[200u8, 100, 1], [3]).unwrap();
        let out = run(x, &OpAttrs::new()).unwrap();
        assert_eq!(out.as_slice::<u8>().unwrap(), &[200, 44, 45]);
        let x = DenseHostTensor::from_slice(&[100i8, 100, -1], [3]).unwrap();
        let out = run(x, &OpAttrs::new()).unwrap();
        assert_eq!(out.as_slice::<i8>().unwrap(), &[100, -56, -57]);
    }

    /// Float totals are kept in f64: a million f32 tenths sum to within
    /// f32 rounding of the exact value, where an f32 total drifts visibly.
    #[test]
    fn long_float_scans_do_not_drift() {
        let n = 1_000_000;
        let x = DenseHostTensor::from_slice(&vec![0.1f32; n], [n]).unwrap();
        let out = run(x, &OpAttrs::new()).unwrap();
        let last = out.as_slice::<f32>().unwrap()[n - 1] as f64;
        let exact = 0.1f32 as f64 * n as f64;
        assert!((last - exact).abs() / exact < 1e-7, "{last} vs {exact}");
    }

    proptest! {
        #[test]
        fn prop_cumsum(
            dims in prop::collection::vec(0usize..5, 1..4),
            axis in 0usize..3,
            exclusive in any::<bool>(),
            reverse in any::<bool>(),
            dtype in prop::sample::select(vec![DType::F16, DType::F32, DType::F64, DType::U8, DType::I8, DType::I32, DType::I64]),
        ) {
            check(dtype, &dims, axis % dims.len(), exclusive, reverse);
        }
    }
}
