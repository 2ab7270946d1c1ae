//! Reduction kernels: sum, mean, max, min and prod over axes, arg-max and
//! arg-min, and (log-)softmax.
//!
//! A reduction views its input as `[outer, reduced, inner]` after merging
//! neighbouring axes of the same kind and dropping size-1 axes. When the
//! reduced axes are not one contiguous run (say axes 0 and 2 of NCHW), the
//! innermost reduced run is folded first into an accumulator array and the
//! next pass folds that, until no reduced axis is left: every pass is the
//! same cache-friendly `[outer, reduced, inner]` loop.
//!
//! Float sums accumulate in f64 (pairwise over long rows), so summing
//! millions of f32 values stays exact to f32 precision; integer sums and
//! products wrap, which is associative, so pass order does not matter.

use super::elementwise::{
    is_nan, map_into, nan_max, nan_min, out_meta, reusable, take, Real, CHUNK,
};
use crate::{Inputs, Kernel, KernelContext, KernelRegistry, PARALLEL_THRESHOLD};
use half::{bf16, f16};
use rayon::prelude::*;
use smallvec::{smallvec, SmallVec};
use stagecraft_ops::{reduction_axes, Attrs, OpKind, ReduceOp};
use stagecraft_tensor::{
    normalize_axis, DType, DenseHostTensor, Element, Error, Result, TensorMetadata,
};
use std::sync::Arc;

/// Rows up to this long are folded in one sweep with eight accumulators;
/// longer ones split in halves (pairwise summation, error O(log n)).
const ROW_BLOCK: usize = 2048;

/// Column folds flush a partial accumulator every this many rows, so a
/// long reduced axis is summed in two levels rather than one long chain.
const RED_BLOCK: usize = 1024;

/// Columns per parallel task in the column fold.
const COL_BLOCK: usize = 1024;

pub(crate) fn register(registry: &mut KernelRegistry) {
    use stagecraft_ops as ops;
    for op in [&ops::SUM, &ops::MEAN, &ops::MAX, &ops::MIN, &ops::PROD] {
        registry.add(op, reduce_factory);
    }
    registry.add(&ops::ARGMAX, arg_factory);
    registry.add(&ops::ARGMIN, arg_factory);
    registry.add(&ops::SOFTMAX, softmax_factory);
    registry.add(&ops::LOG_SOFTMAX, softmax_factory);
}

fn first_dtype(inputs: &[TensorMetadata]) -> Result<DType> {
    inputs
        .first()
        .map(|m| m.dtype)
        .ok_or_else(|| Error::internal("reduction without input"))
}

fn no_kernel(attrs: &Attrs<'_>, dtype: DType) -> Error {
    Error::dtype(format!("{} has no CPU kernel for {dtype}", attrs.op().name))
}

/// `(outer, n, inner)`: the products of the dims before, at and after `axis`.
fn split3(dims: &[usize], axis: usize) -> (usize, usize, usize) {
    (
        dims[..axis].iter().product(),
        dims[axis],
        dims[axis + 1..].iter().product(),
    )
}

// ---------------------------------------------------------------------------
// Sum, Mean, Max, Min, Prod.

fn reduce_factory(attrs: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    let OpKind::Reduce(op) = attrs.op().kind else {
        return Err(Error::internal(format!(
            "{} is not a reduction",
            attrs.op().name
        )));
    };
    // Kernels are cached per dtype, not per rank, so axes are resolved
    // against each call's input.
    let axes: SmallVec<[i64; 4]> = SmallVec::from_slice(attrs.ints("axes")?);
    let dtype = first_dtype(inputs)?;
    let kernel = match dtype {
        DType::F16 => Some(float_reduce::<f16>(op, axes)),
        DType::BF16 => Some(float_reduce::<bf16>(op, axes)),
        DType::F32 => Some(float_reduce::<f32>(op, axes)),
        DType::F64 => Some(float_reduce::<f64>(op, axes)),
        DType::I32 => int_reduce::<i32>(op, axes),
        DType::I64 => int_reduce::<i64>(op, axes),
        DType::Bool => None,
    };
    kernel.ok_or_else(|| no_kernel(attrs, dtype))
}

/// Floats fold in f64 and round once at the end.
fn float_reduce<T: Real>(op: ReduceOp, axes: SmallVec<[i64; 4]>) -> Kernel {
    Arc::new(move |inputs: Inputs, ctx: &KernelContext<'_>| {
        let [x] = take(inputs)?;
        let dims = x.shape().dims();
        let axes = reduction_axes(&axes, dims.len())?;
        let src = x.as_slice::<T>()?;
        let acc = match op {
            ReduceOp::Sum | ReduceOp::Mean => {
                reduce_axes(src, dims, &axes, T::wide, 0.0, |a: f64, b: f64| a + b)
            }
            ReduceOp::Prod => reduce_axes(src, dims, &axes, T::wide, 1.0, |a: f64, b: f64| a * b),
            ReduceOp::Max => reduce_axes(src, dims, &axes, T::wide, f64::NEG_INFINITY, nan_max),
            ReduceOp::Min => reduce_axes(src, dims, &axes, T::wide, f64::INFINITY, nan_min),
        };
        let mut out = DenseHostTensor::zeros(out_meta(ctx)?.clone())?;
        let o = out.as_mut_slice::<T>()?;
        check_len(o.len(), acc.len())?;
        if op == ReduceOp::Mean {
            // 0/0 is NaN: the mean of no elements.
            let count = axes.iter().map(|&a| dims[a]).product::<usize>() as f64;
            map_into(o, &acc, |s| T::narrow(s / count));
        } else {
            map_into(o, &acc, T::narrow);
        }
        Ok(smallvec![out])
    })
}

/// Integer element types: wrapping sums and products, exact max/min.
trait IntFold: Element + Ord {
    const MIN: Self;
    const MAX: Self;
    const ZERO: Self;
    const ONE: Self;
    fn wrapping_add_(self, other: Self) -> Self;
    fn wrapping_mul_(self, other: Self) -> Self;
}

macro_rules! int_fold {
    ($t:ty) => {
        impl IntFold for $t {
            const MIN: $t = <$t>::MIN;
            const MAX: $t = <$t>::MAX;
            const ZERO: $t = 0;
            const ONE: $t = 1;
            #[inline(always)]
            fn wrapping_add_(self, o: $t) -> $t {
                self.wrapping_add(o)
            }
            #[inline(always)]
            fn wrapping_mul_(self, o: $t) -> $t {
                self.wrapping_mul(o)
            }
        }
    };
}
int_fold!(i32);
int_fold!(i64);

fn int_reduce<T: IntFold>(op: ReduceOp, axes: SmallVec<[i64; 4]>) -> Option<Kernel> {
    if op == ReduceOp::Mean {
        return None;
    }
    Some(Arc::new(move |inputs: Inputs, ctx: &KernelContext<'_>| {
        let [x] = take(inputs)?;
        let dims = x.shape().dims();
        let axes = reduction_axes(&axes, dims.len())?;
        let src = x.as_slice::<T>()?;
        let same = |v: T| v;
        let acc = match op {
            ReduceOp::Sum | ReduceOp::Mean => {
                reduce_axes(src, dims, &axes, same, T::ZERO, T::wrapping_add_)
            }
            ReduceOp::Prod => reduce_axes(src, dims, &axes, same, T::ONE, T::wrapping_mul_),
            ReduceOp::Max => reduce_axes(src, dims, &axes, same, T::MIN, Ord::max),
            ReduceOp::Min => reduce_axes(src, dims, &axes, same, T::MAX, Ord::min),
        };
        let mut out = DenseHostTensor::zeros(out_meta(ctx)?.clone())?;
        let o = out.as_mut_slice::<T>()?;
        check_len(o.len(), acc.len())?;
        o.copy_from_slice(&acc);
        Ok(smallvec![out])
    }))
}

fn check_len(out: usize, computed: usize) -> Result<()> {
    if out == computed {
        Ok(())
    } else {
        Err(Error::internal(format!(
            "reduction computed {computed} values for an output of {out} elements"
        )))
    }
}

/// Folds `src` (of `dims`) over the sorted `axes` with `f` (associative,
/// identity `id`), converting elements with `cvt` on first read. Returns the
/// kept elements in row-major order.
fn reduce_axes<S, A, C, F>(src: &[S], dims: &[usize], axes: &[usize], cvt: C, id: A, f: F) -> Vec<A>
where
    S: Copy + Sync,
    A: Copy + Send + Sync,
    C: Fn(S) -> A + Copy + Sync,
    F: Fn(A, A) -> A + Copy + Sync,
{
    // (size, reduced) runs, size-1 axes dropped: they change no index.
    let mut groups: SmallVec<[(usize, bool); 4]> = SmallVec::new();
    for (axis, &d) in dims.iter().enumerate() {
        if d == 1 {
            continue;
        }
        let reduced = axes.contains(&axis);
        match groups.last_mut() {
            Some((size, r)) if *r == reduced => *size *= d,
            _ => groups.push((d, reduced)),
        }
    }
    let mut acc = fold_pass(src, cvt, split_last_reduced(&mut groups), id, f);
    while groups.iter().any(|&(_, r)| r) {
        acc = fold_pass(&acc, |a| a, split_last_reduced(&mut groups), id, f);
    }
    acc
}

/// `(outer, reduced, inner)` around the innermost reduced run, which is
/// removed from `groups` (its kept neighbours merge). With no reduced run
/// left the whole tensor is one pass with `reduced = 1`.
fn split_last_reduced(groups: &mut SmallVec<[(usize, bool); 4]>) -> (usize, usize, usize) {
    let Some(g) = groups.iter().rposition(|&(_, r)| r) else {
        let all = groups.iter().map(|&(d, _)| d).product();
        return (all, 1, 1);
    };
    let outer = groups[..g].iter().map(|&(d, _)| d).product();
    let inner = groups[g + 1..].iter().map(|&(d, _)| d).product();
    let red = groups[g].0;
    groups.remove(g);
    if g > 0 && g < groups.len() && !groups[g - 1].1 && !groups[g].1 {
        groups[g - 1].0 *= groups[g].0;
        groups.remove(g);
    }
    (outer, red, inner)
}

/// One `[outer, red, inner] → [outer, inner]` fold.
fn fold_pass<S, A, C, F>(
    src: &[S],
    cvt: C,
    (outer, red, inner): (usize, usize, usize),
    id: A,
    f: F,
) -> Vec<A>
where
    S: Copy + Sync,
    A: Copy + Send + Sync,
    C: Fn(S) -> A + Copy + Sync,
    F: Fn(A, A) -> A + Copy + Sync,
{
    let mut out = vec![id; outer * inner];
    if out.is_empty() {
        return out;
    }
    let parallel = outer * red * inner > PARALLEL_THRESHOLD;
    if inner == 1 {
        let row = |o: usize| fold_row(&src[o * red..(o + 1) * red], cvt, id, f, parallel);
        if parallel {
            out.par_iter_mut()
                .enumerate()
                .with_min_len((CHUNK / red.max(1)).max(1))
                .for_each(|(o, v)| *v = row(o));
        } else {
            for (o, v) in out.iter_mut().enumerate() {
                *v = row(o);
            }
        }
    } else {
        let slab = red * inner;
        let cols = |o: usize, j0: usize, acc: &mut [A]| {
            fold_cols(&src[o * slab..(o + 1) * slab], inner, j0, acc, cvt, id, f)
        };
        if parallel {
            out.par_chunks_mut(inner).enumerate().for_each(|(o, lane)| {
                lane.par_chunks_mut(COL_BLOCK)
                    .enumerate()
                    .for_each(|(c, acc)| cols(o, c * COL_BLOCK, acc));
            });
        } else {
            for (o, lane) in out.chunks_mut(inner).enumerate() {
                cols(o, 0, lane);
            }
        }
    }
    out
}

/// Folds a contiguous row: eight independent accumulators (which LLVM keeps
/// in vector registers) for short rows, halves for long ones. The split
/// points depend only on the length, so the result does not depend on the
/// thread count.
fn fold_row<S, A, C, F>(row: &[S], cvt: C, id: A, f: F, parallel: bool) -> A
where
    S: Copy + Sync,
    A: Copy + Send + Sync,
    C: Fn(S) -> A + Copy + Sync,
    F: Fn(A, A) -> A + Copy + Sync,
{
    if row.len() > ROW_BLOCK {
        let (left, right) = row.split_at(row.len() / 2);
        let (a, b) = if parallel && row.len() > PARALLEL_THRESHOLD {
            rayon::join(
                || fold_row(left, cvt, id, f, true),
                || fold_row(right, cvt, id, f, true),
            )
        } else {
            (
                fold_row(left, cvt, id, f, false),
                fold_row(right, cvt, id, f, false),
            )
        };
        return f(a, b);
    }
    let mut lanes = [id; 8];
    let mut chunks = row.chunks_exact(8);
    for chunk in &mut chunks {
        for (lane, &x) in lanes.iter_mut().zip(chunk) {
            *lane = f(*lane, cvt(x));
        }
    }
    let mut tail = id;
    for &x in chunks.remainder() {
        tail = f(tail, cvt(x));
    }
    let [l0, l1, l2, l3, l4, l5, l6, l7] = lanes;
    f(f(f(f(l0, l1), f(l2, l3)), f(f(l4, l5), f(l6, l7))), tail)
}

/// Folds columns `j0..j0 + acc.len()` of a `[red, inner]` slab into `acc`
/// (which holds the identity), flushing a partial accumulator every
/// [`RED_BLOCK`] rows.
fn fold_cols<S, A, C, F>(slab: &[S], inner: usize, j0: usize, acc: &mut [A], cvt: C, id: A, f: F)
where
    S: Copy,
    A: Copy,
    C: Fn(S) -> A,
    F: Fn(A, A) -> A,
{
    let width = acc.len();
    let red = slab.len() / inner;
    let sweep = |target: &mut [A], rows: std::ops::Range<usize>| {
        for r in rows {
            let start = r * inner + j0;
            for (t, &x) in target.iter_mut().zip(&slab[start..start + width]) {
                *t = f(*t, cvt(x));
            }
        }
    };
    if red <= RED_BLOCK {
        sweep(acc, 0..red);
        return;
    }
    let mut part = vec![id; width];
    for block in (0..red).step_by(RED_BLOCK) {
        part.fill(id);
        sweep(&mut part, block..(block + RED_BLOCK).min(red));
        for (a, &p) in acc.iter_mut().zip(&part) {
            *a = f(*a, p);
        }
    }
}

// ---------------------------------------------------------------------------
// ArgMax, ArgMin.

fn arg_factory(attrs: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    let axis = attrs.int("axis")?;
    let max = attrs.op() == &stagecraft_ops::ARGMAX;
    let dtype = first_dtype(inputs)?;
    if dtype == DType::Bool {
        return Err(no_kernel(attrs, dtype));
    }
    Ok(crate::with_any_type!(dtype, T => {
        if max {
            arg_kernel::<T, _>(axis, |v: T, best: T| v > best)
        } else {
            arg_kernel::<T, _>(axis, |v: T, best: T| v < best)
        }
    }))
}

fn arg_kernel<T, B>(axis: i64, better: B) -> Kernel
where
    T: Element,
    B: Fn(T, T) -> bool + Copy + Send + Sync + 'static,
{
    Arc::new(move |inputs: Inputs, ctx: &KernelContext<'_>| {
        let [x] = take(inputs)?;
        let dims = x.shape().dims();
        let axis = normalize_axis(axis as isize, dims.len())?;
        let (_, n, inner) = split3(dims, axis);
        let mut out = DenseHostTensor::zeros(out_meta(ctx)?.clone())?;
        let o = out.as_mut_slice::<i64>()?;
        if o.is_empty() {
            return Ok(smallvec![out]);
        }
        if n == 0 {
            return Err(Error::shape(format!(
                "cannot take an arg-reduction over the empty axis {axis} of {}",
                x.metadata()
            )));
        }
        let src = x.as_slice::<T>()?;
        check_len(o.len() * n, src.len())?;
        let slab = n * inner;
        let lane = |(i, idx): (usize, &mut [i64])| {
            arg_slab(&src[i * slab..(i + 1) * slab], inner, idx, better)
        };
        if src.len() > PARALLEL_THRESHOLD {
            o.par_chunks_mut(inner)
                .enumerate()
                .with_min_len((CHUNK / slab).max(1))
                .for_each(lane);
        } else {
            o.chunks_mut(inner).enumerate().for_each(lane);
        }
        Ok(smallvec![out])
    })
}

/// Writes into `idx[j]` the position along the reduced axis of the best
/// element of column `j` of an `[n, inner]` slab: the first on ties, the
/// first NaN if any (a NaN best is never replaced).
fn arg_slab<T: Copy + PartialOrd>(
    slab: &[T],
    inner: usize,
    idx: &mut [i64],
    better: impl Fn(T, T) -> bool,
) {
    if inner == 1 {
        let mut best = slab[0];
        let mut at = 0;
        if !is_nan(best) {
            for (i, &v) in slab.iter().enumerate().skip(1) {
                if is_nan(v) {
                    at = i;
                    break;
                }
                if better(v, best) {
                    best = v;
                    at = i;
                }
            }
        }
        idx[0] = at as i64;
        return;
    }
    let mut best: Vec<T> = slab[..inner].to_vec();
    idx.fill(0);
    for (r, row) in slab.chunks_exact(inner).enumerate().skip(1) {
        for ((b, i), &v) in best.iter_mut().zip(idx.iter_mut()).zip(row) {
            if !is_nan(*b) && (is_nan(v) || better(v, *b)) {
                *b = v;
                *i = r as i64;
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Softmax, LogSoftmax.

fn softmax_factory(attrs: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    let axis = attrs.int("axis")?;
    let log = attrs.op() == &stagecraft_ops::LOG_SOFTMAX;
    let dtype = first_dtype(inputs)?;
    match dtype {
        DType::F32 => Ok(softmax_kernel::<f32>(axis, log)),
        DType::F64 => Ok(softmax_kernel::<f64>(axis, log)),
        DType::F16 => Ok(softmax_via_f32::<f16>(axis, log)),
        DType::BF16 => Ok(softmax_via_f32::<bf16>(axis, log)),
        _ => Err(no_kernel(attrs, dtype)),
    }
}

/// f32 and f64 softmax, computed in the output buffer: the input's own
/// when reusable, else a copy (cheap next to the `exp`s).
fn softmax_kernel<T: Real>(axis: i64, log: bool) -> Kernel {
    Arc::new(move |inputs: Inputs, ctx: &KernelContext<'_>| {
        let [x] = take(inputs)?;
        let meta = out_meta(ctx)?;
        let axis = normalize_axis(axis as isize, x.shape().rank())?;
        let (_, n, inner) = split3(x.shape().dims(), axis);
        let mut out = if reusable(&x, meta) { x } else { x.deep_copy() };
        softmax_in_place(out.as_mut_slice::<T>()?, n, inner, log);
        Ok(smallvec![out])
    })
}

/// f16 and bf16 softmax, computed in f32 and rounded once at the end.
fn softmax_via_f32<T: Real>(axis: i64, log: bool) -> Kernel {
    Arc::new(move |inputs: Inputs, ctx: &KernelContext<'_>| {
        let [x] = take(inputs)?;
        let axis = normalize_axis(axis as isize, x.shape().rank())?;
        let (_, n, inner) = split3(x.shape().dims(), axis);
        let mut wide: Vec<f32> = vec![0.0; x.numel()];
        map_into(&mut wide, x.as_slice::<T>()?, |v| v.wide() as f32);
        softmax_in_place(&mut wide, n, inner, log);
        let mut out = DenseHostTensor::zeros(out_meta(ctx)?.clone())?;
        map_into(out.as_mut_slice::<T>()?, &wide, |v| T::narrow(v as f64));
        Ok(smallvec![out])
    })
}

/// Softmax of every `[n, inner]` slab of `data` along `n`, evaluated in f64
/// (max, `exp(x - max)` and the sum), each element rounded once. A slab
/// holding NaN or +inf has a NaN max or a NaN `inf - inf` and so comes out
/// all NaN, like PyTorch.
fn softmax_in_place<T: Real>(data: &mut [T], n: usize, inner: usize, log: bool) {
    let slab = n * inner;
    if data.is_empty() || slab == 0 {
        return;
    }
    let body = |s: &mut [T]| {
        if inner == 1 {
            softmax_row(s, log)
        } else {
            softmax_cols(s, inner, log)
        }
    };
    if data.len() > PARALLEL_THRESHOLD {
        data.par_chunks_mut(slab)
            .with_min_len((CHUNK / slab).max(1))
            .for_each(body);
    } else {
        data.chunks_mut(slab).for_each(body);
    }
}

fn softmax_row<T: Real>(row: &mut [T], log: bool) {
    let max = row
        .iter()
        .fold(f64::NEG_INFINITY, |m, &x| nan_max(m, x.wide()));
    if log {
        let sum: f64 = row.iter().map(|&x| (x.wide() - max).exp()).sum();
        let log_sum = sum.ln();
        for x in row.iter_mut() {
            *x = T::narrow(x.wide() - max - log_sum);
        }
    } else {
        let mut sum = 0.0;
        for x in row.iter_mut() {
            let e = (x.wide() - max).exp();
            sum += e;
            *x = T::narrow(e);
        }
        for x in row.iter_mut() {
            *x = T::narrow(x.wide() / sum);
        }
    }
}

fn softmax_cols<T: Real>(slab: &mut [T], inner: usize, log: bool) {
    let mut max = vec![f64::NEG_INFINITY; inner];
    for row in slab.chunks_exact(inner) {
        for (m, &x) in max.iter_mut().zip(row) {
            *m = nan_max(*m, x.wide());
        }
    }
    let mut sum = vec![0.0f64; inner];
    if log {
        for row in slab.chunks_exact(inner) {
            for ((s, &m), &x) in sum.iter_mut().zip(&max).zip(row) {
                *s += (x.wide() - m).exp();
            }
        }
        for s in sum.iter_mut() {
            *s = s.ln();
        }
        for row in slab.chunks_exact_mut(inner) {
            for ((x, &m), &ls) in row.iter_mut().zip(&max).zip(&sum) {
                *x = T::narrow(x.wide() - m - ls);
            }
        }
    } else {
        for row in slab.chunks_exact_mut(inner) {
            for ((x, &m), s) in row.iter_mut().zip(&max).zip(sum.iter_mut()) {
                let e = (x.wide() - m).exp();
                *s += e;
                *x = T::narrow(e);
            }
        }
        for row in slab.chunks_exact_mut(inner) {
            for (x, &s) in row.iter_mut().zip(&sum) {
                *x = T::narrow(x.wide() / s);
            }
        }
    }
}
