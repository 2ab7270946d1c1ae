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

use super::elementwise::{is_nan, map_into, nan_max, nan_min, reusable, Real, CHUNK};
use super::fused::{isa, Isa};
use super::{first_dtype, out_meta, split3, take};
use crate::{Inputs, Kernel, KernelContext, KernelRegistry, PARALLEL_THRESHOLD};
use half::{bf16, f16};
use smallvec::{smallvec, SmallVec};
use stagecraft_ops::{reduction_axes, Attrs, OpKind, ReduceOp};
use stagecraft_tensor::{
    element_count, normalize_axis, DType, DenseHostTensor, Element, Error, Result, TensorMetadata,
};
use std::sync::Arc;

/// Rows up to this long are folded in one sweep with [`LANES`] accumulators;
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

fn no_kernel(attrs: &Attrs<'_>, dtype: DType) -> Error {
    Error::dtype(format!("{} has no CPU kernel for {dtype}", attrs.op().name))
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
        // Integer sums and products wrap in the input's type, as the
        // elementwise ops do (cast first for a wider sum).
        DType::U8 => int_reduce::<u8>(op, axes),
        DType::I8 => int_reduce::<i8>(op, axes),
        DType::U16 => int_reduce::<u16>(op, axes),
        DType::I16 => int_reduce::<i16>(op, axes),
        DType::U32 => int_reduce::<u32>(op, axes),
        DType::U64 => int_reduce::<u64>(op, axes),
        DType::I32 => int_reduce::<i32>(op, axes),
        DType::I64 => int_reduce::<i64>(op, axes),
        DType::Bool | DType::List => None,
    };
    kernel.ok_or_else(|| no_kernel(attrs, dtype))
}

/// Floats fold in f64 and round once at the end.
fn float_reduce<T: Real>(op: ReduceOp, axes: SmallVec<[i64; 4]>) -> Kernel {
    Arc::new(move |inputs: Inputs, ctx: &KernelContext<'_>| {
        let [x] = take(inputs)?;
        let dims = x.shape().dims();
        let axes = reduction_axes(&axes, dims.len())?;
        let out = float_fold(op, x.as_slice::<T>()?, dims, &axes, out_meta(ctx)?)?;
        Ok(smallvec![out])
    })
}

/// Reduces the elements `src` yields for a tensor of `dims` over `axes`
/// into a new tensor of `meta`: the body of every float reduction, fused or
/// not, so the two give the same bits.
pub(crate) fn float_fold<T: Real, X: Source<T> + ?Sized>(
    op: ReduceOp,
    src: &X,
    dims: &[usize],
    axes: &[usize],
    meta: &TensorMetadata,
) -> Result<DenseHostTensor> {
    let acc = match op {
        ReduceOp::Sum | ReduceOp::Mean => {
            reduce_axes(src, dims, axes, T::wide, 0.0, |a: f64, b: f64| a + b)
        }
        ReduceOp::Prod => reduce_axes(src, dims, axes, T::wide, 1.0, |a: f64, b: f64| a * b),
        ReduceOp::Max => reduce_axes(src, dims, axes, T::wide, f64::NEG_INFINITY, nan_max),
        ReduceOp::Min => reduce_axes(src, dims, axes, T::wide, f64::INFINITY, nan_min),
    };
    let mut out = DenseHostTensor::for_overwrite(meta.clone())?;
    let o = out.as_mut_slice::<T>()?;
    check_len(o.len(), acc.len())?;
    if op == ReduceOp::Mean {
        // 0/0 is NaN: the mean of no elements.
        let reduced: SmallVec<[usize; 4]> = axes.iter().map(|&a| dims[a]).collect();
        let count = element_count(&reduced) as f64;
        map_into(o, &acc, |s| T::narrow(s / count));
    } else {
        map_into(o, &acc, T::narrow);
    }
    Ok(out)
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
int_fold!(u8);
int_fold!(i8);
int_fold!(u16);
int_fold!(i16);
int_fold!(u32);
int_fold!(u64);
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

/// Where a reduction reads its elements: a tensor's values, or (for a fused
/// reduction) a program computing them block by block into scratch memory.
/// Folds ask for short contiguous runs, so computed elements never leave
/// the cache, and the fold order (hence every bit of the result) is the
/// same whichever source it reads.
pub(crate) trait Source<S>: Sync {
    /// Per-thread working memory.
    type Scratch: Send;
    /// Fresh working memory for one thread.
    fn scratch(&self) -> Self::Scratch;
    /// Elements `start..start + len`.
    fn read<'s>(&'s self, scratch: &'s mut Self::Scratch, start: usize, len: usize) -> &'s [S];
    /// All the elements, where they are stored rather than computed.
    fn stored(&self) -> Option<&[S]> {
        None
    }
}

impl<S: Copy + Sync> Source<S> for [S] {
    type Scratch = ();
    fn scratch(&self) {}
    fn read<'s>(&'s self, _: &'s mut (), start: usize, len: usize) -> &'s [S] {
        &self[start..start + len]
    }
    fn stored(&self) -> Option<&[S]> {
        Some(self)
    }
}

/// A fold's kept elements: a full reduction's one value stays on the stack
/// (a loop condition's `sum(x)` runs every iteration).
pub(crate) type Folded<A> = SmallVec<[A; 2]>;

/// Rows a stored column fold adds per pass over its accumulators.
const ROWS_PER_PASS: usize = 8;

/// Folds `src` (of `dims`) over the sorted `axes` with `f` (associative,
/// identity `id`), converting elements with `cvt` on first read. Returns the
/// kept elements in row-major order.
pub(crate) fn reduce_axes<S, A, C, F, X>(
    src: &X,
    dims: &[usize],
    axes: &[usize],
    cvt: C,
    id: A,
    f: F,
) -> Folded<A>
where
    S: Copy + Sync,
    A: Copy + Send + Sync,
    C: Fn(S) -> A + Copy + Sync,
    F: Fn(A, A) -> A + Copy + Sync,
    X: Source<S> + ?Sized,
{
    if dims.contains(&0) {
        // Nothing to fold, and the dims may multiply past `usize` before
        // their zero: every kept element is the identity.
        let kept: SmallVec<[usize; 4]> = (0..dims.len())
            .filter(|a| !axes.contains(a))
            .map(|a| dims[a])
            .collect();
        return smallvec![id; element_count(&kept)];
    }
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
        acc = fold_pass(&acc[..], |a| a, split_last_reduced(&mut groups), id, f);
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
fn fold_pass<S, A, C, F, X>(
    src: &X,
    cvt: C,
    (outer, red, inner): (usize, usize, usize),
    id: A,
    f: F,
) -> Folded<A>
where
    S: Copy + Sync,
    A: Copy + Send + Sync,
    C: Fn(S) -> A + Copy + Sync,
    F: Fn(A, A) -> A + Copy + Sync,
    X: Source<S> + ?Sized,
{
    let mut out: Folded<A> = smallvec![id; outer * inner];
    if out.is_empty() {
        return out;
    }
    let fold = Fold {
        src,
        cvt,
        id,
        f,
        element: std::marker::PhantomData,
    };
    let parallel = outer * red * inner > PARALLEL_THRESHOLD;
    if inner == 1 && (1..=ROW_BLOCK).contains(&red) {
        // Short rows are read many at a time: a fused source computes each
        // read on its own, which for a row of ten costs more than folding
        // it (the MLP loss's 128×10 reduction: 12 µs one row per read,
        // 3.5 µs grouped).
        let per_read = ROW_BLOCK / red;
        let group = |scratch: &mut X::Scratch, (g, group): (usize, &mut [A])| {
            let values = src.read(scratch, g * per_read * red, group.len() * red);
            for (v, row) in group.iter_mut().zip(values.chunks_exact(red)) {
                *v = fold.leaf(row);
            }
        };
        if parallel {
            // A chunk holds several reads: one alone is too little work
            // to be worth handing to another thread.
            let reads = (CHUNK / ROW_BLOCK).max(1);
            crate::pool::for_each_chunk_init(
                &mut out,
                reads * per_read,
                || src.scratch(),
                |scratch, c, chunk| {
                    for (r, part) in chunk.chunks_mut(per_read).enumerate() {
                        group(scratch, (c * reads + r, part));
                    }
                },
            );
        } else {
            let mut scratch = src.scratch();
            out.chunks_mut(per_read)
                .enumerate()
                .for_each(|item| group(&mut scratch, item));
        }
    } else if inner == 1 {
        if parallel {
            let rows = (CHUNK / red.max(1)).max(1);
            crate::pool::for_each_chunk_init(
                &mut out,
                rows,
                || src.scratch(),
                |scratch, c, chunk| {
                    for (r, v) in chunk.iter_mut().enumerate() {
                        let o = c * rows + r;
                        *v = fold.row(scratch, o * red, red, true);
                    }
                },
            );
        } else {
            let mut scratch = src.scratch();
            for (o, v) in out.iter_mut().enumerate() {
                *v = fold.row(&mut scratch, o * red, red, false);
            }
        }
    } else {
        let slab = red * inner;
        if parallel {
            // A thread takes four neighbouring column blocks at a time: a
            // quarter of the lock round trips, and longer runs of each row.
            let span = COL_BLOCK * 4;
            let spans = out.chunks_mut(inner).enumerate().flat_map(|(o, lane)| {
                lane.chunks_mut(span)
                    .enumerate()
                    .map(move |(c, acc)| (o * slab + c * span, acc))
            });
            crate::pool::for_each_item_init(
                spans,
                outer * inner.div_ceil(span),
                || src.scratch(),
                |scratch, (start, acc)| {
                    for (b, acc) in acc.chunks_mut(COL_BLOCK).enumerate() {
                        fold.cols(scratch, start + b * COL_BLOCK, red, inner, acc);
                    }
                },
            );
        } else {
            let mut scratch = src.scratch();
            for (o, lane) in out.chunks_mut(inner).enumerate() {
                fold.cols(&mut scratch, o * slab, red, inner, lane);
            }
        }
    }
    out
}

/// Accumulators of a leaf fold. A float sum is a chain of dependent adds
/// per accumulator, four cycles each: eight (one AVX-512 register) left a
/// 1,000-element f32 sum latency-bound at 125 adds per lane, about 240 ns
/// on a 2.x GHz Xeon; 32 keep four AVX-512 (eight AVX2) registers' chains
/// in flight.
const LANES: usize = 32;

/// The leaf fold: `LANES` accumulators over the row's whole `LANES`-wide
/// chunks, the first eight of them over the whole 8-wide chunks after,
/// one more over the last few elements, then [`combine_lanes`].
#[inline(always)]
fn leaf_lanes<S, A, C, F>(row: &[S], cvt: C, id: A, f: F) -> A
where
    S: Copy,
    A: Copy,
    C: Fn(S) -> A,
    F: Fn(A, A) -> A,
{
    let mut lanes = [id; LANES];
    let mut chunks = row.chunks_exact(LANES);
    for chunk in &mut chunks {
        for (lane, &x) in lanes.iter_mut().zip(chunk) {
            *lane = f(*lane, cvt(x));
        }
    }
    let mut eights = chunks.remainder().chunks_exact(8);
    for chunk in &mut eights {
        for (lane, &x) in lanes.iter_mut().zip(chunk) {
            *lane = f(*lane, cvt(x));
        }
    }
    let mut tail = id;
    for &x in eights.remainder() {
        tail = f(tail, cvt(x));
    }
    combine_lanes(&lanes, tail, f)
}

/// Combines a leaf's accumulators pairwise (lane `i` with lane `i + width`,
/// halving the width), then the tail. Not inlined: folded into the leaf,
/// this tree made LLVM keep the accumulators two to a register (128-bit
/// vectors even on AVX-512), and the leaf ran at half speed.
#[inline(never)]
fn combine_lanes<A: Copy, F: Fn(A, A) -> A>(lanes: &[A; LANES], tail: A, f: F) -> A {
    let mut lanes = *lanes;
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            lanes[i] = f(lanes[i], lanes[i + width]);
        }
    }
    f(lanes[0], tail)
}

/// [`leaf_lanes`] compiled for `isa`, which the CPU must support (as
/// `isa()` reports).
fn leaf_on<S, A, C, F>(isa: Isa, row: &[S], cvt: C, id: A, f: F) -> A
where
    S: Copy,
    A: Copy,
    C: Fn(S) -> A,
    F: Fn(A, A) -> A,
{
    match isa {
        Isa::Baseline => leaf_lanes(row, cvt, id, f),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's `isa` is one this CPU supports.
        Isa::Avx2 => unsafe { leaf_avx2(row, cvt, id, f) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, AVX-512 F.
        Isa::Avx512 => unsafe { leaf_avx512(row, cvt, id, f) },
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn leaf_avx2<S, A, C, F>(row: &[S], cvt: C, id: A, f: F) -> A
where
    S: Copy,
    A: Copy,
    C: Fn(S) -> A,
    F: Fn(A, A) -> A,
{
    leaf_lanes(row, cvt, id, f)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn leaf_avx512<S, A, C, F>(row: &[S], cvt: C, id: A, f: F) -> A
where
    S: Copy,
    A: Copy,
    C: Fn(S) -> A,
    F: Fn(A, A) -> A,
{
    leaf_lanes(row, cvt, id, f)
}

/// A fold of a source's elements: conversion, identity and combining
/// function.
struct Fold<'x, S, X: ?Sized, C, A, F> {
    src: &'x X,
    cvt: C,
    id: A,
    f: F,
    element: std::marker::PhantomData<fn(S)>,
}

impl<S, X, C, A, F> Fold<'_, S, X, C, A, F>
where
    S: Copy + Sync,
    X: Source<S> + ?Sized,
    C: Fn(S) -> A + Copy + Sync,
    A: Copy + Send + Sync,
    F: Fn(A, A) -> A + Copy + Sync,
{
    /// Folds the contiguous run `start..start + len`: [`LANES`] independent
    /// accumulators (which LLVM keeps in vector registers) for short runs,
    /// halves for long ones. The split points depend only on the length, so
    /// the result does not depend on the thread count.
    fn row(&self, scratch: &mut X::Scratch, start: usize, len: usize, parallel: bool) -> A {
        let f = self.f;
        if len > ROW_BLOCK {
            let half = len / 2;
            let (a, b) = if parallel && len > PARALLEL_THRESHOLD {
                let (mut a, mut b) = (self.id, self.id);
                crate::pool::join(
                    &mut || a = self.row(scratch, start, half, true),
                    &mut || b = self.row(&mut self.src.scratch(), start + half, len - half, true),
                );
                (a, b)
            } else {
                (
                    self.row(scratch, start, half, false),
                    self.row(scratch, start + half, len - half, false),
                )
            };
            return f(a, b);
        }
        let row = self.src.read(scratch, start, len);
        self.leaf(row)
    }

    /// Folds a run of at most [`ROW_BLOCK`] elements in [`LANES`]
    /// independent accumulators, with the loop compiled for the CPU's
    /// instruction set. The order of the adds is the same on every
    /// instruction set, so the bits are too.
    fn leaf(&self, row: &[S]) -> A {
        leaf_on(isa(), row, self.cvt, self.id, self.f)
    }

    /// Folds `acc.len()` columns of a `[red, inner]` slab whose first
    /// column is element `start` into `acc` (which holds the identity),
    /// flushing a partial accumulator every [`RED_BLOCK`] rows.
    fn cols(
        &self,
        scratch: &mut X::Scratch,
        start: usize,
        red: usize,
        inner: usize,
        acc: &mut [A],
    ) {
        let (cvt, f) = (self.cvt, self.f);
        let width = acc.len();
        let stored = self.src.stored();
        let mut sweep = |target: &mut [A], mut rows: std::ops::Range<usize>| {
            if let Some(values) = stored {
                // Stored rows are added several per pass, in the same
                // order: one load and store of each accumulator per pass
                // instead of per row (the MLP's bias gradients, 128×256
                // over rows: 7 µs one row per pass).
                while rows.len() >= ROWS_PER_PASS {
                    let pass: [&[S]; ROWS_PER_PASS] = std::array::from_fn(|i| {
                        &values[start + (rows.start + i) * inner..][..width]
                    });
                    for (j, t) in target.iter_mut().enumerate() {
                        let mut sum = *t;
                        for row in pass {
                            sum = f(sum, cvt(row[j]));
                        }
                        *t = sum;
                    }
                    rows.start += ROWS_PER_PASS;
                }
            }
            for r in rows {
                let row = self.src.read(scratch, start + r * inner, width);
                for (t, &x) in target.iter_mut().zip(row) {
                    *t = f(*t, cvt(x));
                }
            }
        };
        if red <= RED_BLOCK {
            sweep(acc, 0..red);
            return;
        }
        let mut part = vec![self.id; width];
        for block in (0..red).step_by(RED_BLOCK) {
            part.fill(self.id);
            sweep(&mut part, block..(block + RED_BLOCK).min(red));
            for (a, &p) in acc.iter_mut().zip(&part) {
                *a = f(*a, p);
            }
        }
    }
}

// ---------------------------------------------------------------------------
// ArgMax, ArgMin.

fn arg_factory(attrs: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    let axis = attrs.int("axis")?;
    let max = attrs.op() == &stagecraft_ops::ARGMAX;
    let dtype = first_dtype(inputs)?;
    Ok(match dtype {
        DType::U8 => arg_for::<u8>(axis, max),
        DType::I8 => arg_for::<i8>(axis, max),
        DType::U16 => arg_for::<u16>(axis, max),
        DType::I16 => arg_for::<i16>(axis, max),
        DType::U32 => arg_for::<u32>(axis, max),
        DType::U64 => arg_for::<u64>(axis, max),
        DType::I32 => arg_for::<i32>(axis, max),
        DType::I64 => arg_for::<i64>(axis, max),
        DType::F16 => arg_for::<f16>(axis, max),
        DType::BF16 => arg_for::<bf16>(axis, max),
        DType::F32 => arg_for::<f32>(axis, max),
        DType::F64 => arg_for::<f64>(axis, max),
        DType::Bool | DType::List => return Err(no_kernel(attrs, dtype)),
    })
}

fn arg_for<T: Element>(axis: i64, max: bool) -> Kernel {
    if max {
        arg_kernel::<T, _>(axis, |v: T, best: T| v > best)
    } else {
        arg_kernel::<T, _>(axis, |v: T, best: T| v < best)
    }
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
            let lanes = (CHUNK / slab).max(1);
            crate::pool::for_each_chunk(o, lanes * inner, |c, chunk| {
                for (l, idx) in chunk.chunks_mut(inner).enumerate() {
                    lane((c * lanes + l, idx));
                }
            });
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
        map_into(&mut wide, x.as_slice::<T>()?, |v: T| v.wide() as f32);
        softmax_in_place(&mut wide, n, inner, log);
        let mut out = DenseHostTensor::zeros(out_meta(ctx)?.clone())?;
        map_into(out.as_mut_slice::<T>()?, &wide, |v: f32| {
            T::narrow(v as f64)
        });
        Ok(smallvec![out])
    })
}

/// Softmax of every `[n, inner]` slab of `data` along `n`, evaluated in f64
/// (max, `exp(x - max)` and the sum), each element rounded once. A slab
/// holding NaN or +inf has a NaN max or a NaN `inf - inf` and so comes out
/// all NaN, like PyTorch.
fn softmax_in_place<T: Real>(data: &mut [T], n: usize, inner: usize, log: bool) {
    // An empty tensor may have a huge dimension beside its zero one, so
    // `n * inner` is only formed once there is data (then it is at most
    // the element count).
    if data.is_empty() || n == 0 || inner == 0 {
        return;
    }
    let slab = n * inner;
    let isa = isa();
    let body = |s: &mut [T]| softmax_slab_on(isa, s, inner, log);
    if data.len() > PARALLEL_THRESHOLD {
        let slabs = (CHUNK / slab).max(1);
        crate::pool::for_each_chunk(data, slabs * slab, |_, group| {
            group.chunks_mut(slab).for_each(body)
        });
    } else {
        data.chunks_mut(slab).for_each(body);
    }
}

/// One slab's softmax with its loops compiled for `isa`: the default
/// build's SSE2 computes two f64 lanes at a time, AVX-512 eight (the
/// exponentials dominate: the MLP's 128×10 log-softmax took 10 µs on
/// SSE2). Every operation is the same IEEE operation either way, and the
/// sums keep their order, so the bits are the same.
fn softmax_slab_on<T: Real>(isa: Isa, slab: &mut [T], inner: usize, log: bool) {
    match isa {
        Isa::Baseline => softmax_slab(slab, inner, log),
        // SAFETY: `isa()` reported AVX2, all `softmax_slab_avx2` is
        // compiled to use.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { softmax_slab_avx2(slab, inner, log) },
        // SAFETY: as above, for AVX-512F.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { softmax_slab_avx512(slab, inner, log) },
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn softmax_slab_avx2<T: Real>(slab: &mut [T], inner: usize, log: bool) {
    softmax_slab(slab, inner, log)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn softmax_slab_avx512<T: Real>(slab: &mut [T], inner: usize, log: bool) {
    softmax_slab(slab, inner, log)
}

#[inline(always)]
fn softmax_slab<T: Real>(slab: &mut [T], inner: usize, log: bool) {
    if inner == 1 {
        softmax_row(slab, log)
    } else {
        softmax_cols(slab, inner, log)
    }
}

#[inline(always)]
fn softmax_row<T: Real>(row: &mut [T], log: bool) {
    let max = row
        .iter()
        .fold(f64::NEG_INFINITY, |m, &x| nan_max(m, x.wide()));
    // The exponentials of a few elements at a time go to a buffer and are
    // then summed in order: summed in the same loop, each waited on the
    // running sum, and the loop ran one element at a time.
    let mut sum = 0.0;
    let mut exps = [0.0f64; 16];
    for chunk in row.chunks_mut(exps.len()) {
        let exps = &mut exps[..chunk.len()];
        for (e, &x) in exps.iter_mut().zip(chunk.iter()) {
            *e = T::exp_wide(x.wide() - max);
        }
        for &e in exps.iter() {
            sum += e;
        }
        if !log {
            for (x, &e) in chunk.iter_mut().zip(exps.iter()) {
                *x = T::narrow(e);
            }
        }
    }
    if log {
        let log_sum = sum.ln();
        for x in row.iter_mut() {
            *x = T::narrow(x.wide() - max - log_sum);
        }
    } else {
        for x in row.iter_mut() {
            *x = T::narrow(x.wide() / sum);
        }
    }
}

#[inline(always)]
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
                *s += T::exp_wide(x.wide() - m);
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
                let e = T::exp_wide(x.wide() - m);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::elementwise::tests::{
        assert_close, assert_close_scaled, run, tensor, values, Rng,
    };
    use crate::reference::reduce as reference;
    use proptest::prelude::*;
    use stagecraft_ops::{OpAttrs, OpDef};

    const REDUCE: [(&OpDef, ReduceOp); 5] = [
        (&stagecraft_ops::SUM, ReduceOp::Sum),
        (&stagecraft_ops::MEAN, ReduceOp::Mean),
        (&stagecraft_ops::MAX, ReduceOp::Max),
        (&stagecraft_ops::MIN, ReduceOp::Min),
        (&stagecraft_ops::PROD, ReduceOp::Prod),
    ];

    const NUMERIC: [DType; 6] = [
        DType::I32,
        DType::I64,
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
    ];

    /// Shapes and axis lists, including non-contiguous axes, size-1 and
    /// zero-size dims, and sizes above the parallel threshold.
    const CASES: &[(&[usize], &[i64])] = &[
        (&[], &[]),
        (&[7], &[]),
        (&[7], &[0]),
        (&[3, 4], &[1]),
        (&[3, 4], &[0]),
        (&[3, 4], &[-1, 0]),
        (&[3, 4, 5], &[0, 2]),
        (&[2, 3, 4, 5], &[0, 2, 3]),
        (&[2, 3, 4, 5], &[1, 3]),
        (&[2, 1, 4], &[1]),
        (&[2, 1, 4], &[0, 1]),
        (&[0, 3], &[0]),
        (&[3, 0], &[1]),
        (&[0, 3], &[1]),
        (&[2, 0, 3], &[]),
        (&[70_000], &[]),
        (&[3, 40_000], &[1]),
        (&[40_000, 3], &[0]),
        (&[300, 200], &[0]),
        (&[300, 200], &[1]),
        (&[4, 3000, 5], &[1]),
        (&[5, 2500, 3], &[0, 2]),
    ];

    fn reduce_attrs(axes: &[i64], keepdim: bool) -> OpAttrs {
        let mut attrs = OpAttrs::new();
        attrs.set_ints("axes", axes).set_bool("keepdim", keepdim);
        attrs
    }

    #[test]
    fn reductions_match_the_reference() {
        let mut rng = Rng(11);
        for (def, op) in REDUCE {
            for dtype in NUMERIC {
                for &(dims, axes) in CASES {
                    for keepdim in [false, true] {
                        let attrs = reduce_attrs(axes, keepdim);
                        let meta = TensorMetadata::new(dtype, dims);
                        if def.infer(&[meta], &attrs).is_err() {
                            continue;
                        }
                        let n: usize = dims.iter().product();
                        let mut xs = rng.values(dtype, n, n < 100);
                        if op == ReduceOp::Prod {
                            // Keep products finite and integer ones exact.
                            for x in &mut xs {
                                *x = if dtype.is_int() {
                                    if *x < 0.0 {
                                        -1.0
                                    } else {
                                        1.0
                                    }
                                } else {
                                    1.0 + *x / 1000.0
                                };
                            }
                        }
                        let x = tensor(dtype, &xs, dims);
                        let xv = values(&x);
                        let got = run(def, vec![x], &attrs).unwrap();
                        let resolved = reduction_axes(axes, dims.len()).unwrap();
                        let (want, out_dims) = reference::reduce(op, &xv, dims, &resolved, keepdim);
                        assert_eq!(got.shape().dims(), out_dims.as_slice());
                        let what = format!("{} {dims:?} {axes:?} keepdim={keepdim}", def.name);
                        if dtype.is_int() {
                            assert_eq!(values(&got), want, "{what} [{dtype}]");
                            continue;
                        }
                        // Sums may cancel: compare relative to the sum of magnitudes.
                        let abs: Vec<f64> = xv.iter().map(|v| v.abs()).collect();
                        let (mut scale, _) = reference::reduce(op, &abs, dims, &resolved, keepdim);
                        if !matches!(op, ReduceOp::Sum | ReduceOp::Mean) {
                            scale.clear();
                        }
                        let want: Vec<f64> = want
                            .iter()
                            .map(|&w| crate::reference::elementwise::round_to(dtype, w))
                            .collect();
                        assert_close_scaled(dtype, &values(&got), &want, &scale, &what);
                    }
                }
            }
        }
    }

    #[test]
    fn empty_and_nan_reductions() {
        let x = tensor(DType::F32, &[], &[0, 3]);
        let axes0 = reduce_attrs(&[0], false);
        assert_eq!(
            values(&run(&stagecraft_ops::SUM, vec![x.clone()], &axes0).unwrap()),
            vec![0.0; 3]
        );
        assert_eq!(
            values(&run(&stagecraft_ops::PROD, vec![x.clone()], &axes0).unwrap()),
            vec![1.0; 3]
        );
        let mean = values(&run(&stagecraft_ops::MEAN, vec![x.clone()], &axes0).unwrap());
        assert!(mean.len() == 3 && mean.iter().all(|v| v.is_nan()));
        let all = OpAttrs::new();
        let mean_all = run(&stagecraft_ops::MEAN, vec![x], &all).unwrap();
        assert!(values(&mean_all)[0].is_nan());
        let nan = tensor(DType::F64, &[1.0, f64::NAN, 3.0, f64::NEG_INFINITY], &[4]);
        for def in [
            &stagecraft_ops::MAX,
            &stagecraft_ops::MIN,
            &stagecraft_ops::SUM,
        ] {
            assert!(
                values(&run(def, vec![nan.clone()], &all).unwrap())[0].is_nan(),
                "{}",
                def.name
            );
        }
        let inf = tensor(DType::F32, &[f64::NEG_INFINITY, f64::NEG_INFINITY], &[2]);
        assert_eq!(
            values(&run(&stagecraft_ops::MAX, vec![inf], &all).unwrap()),
            vec![f64::NEG_INFINITY]
        );
        // Integer sums wrap.
        let big = DenseHostTensor::from_slice(&[i32::MAX, 1, 1], [3]).unwrap();
        let s = run(&stagecraft_ops::SUM, vec![big], &all).unwrap();
        assert_eq!(s.to_vec::<i32>().unwrap(), vec![i32::MIN.wrapping_add(1)]);
    }

    #[test]
    fn kernels_resolve_axes_per_call() {
        // One kernel instance (cached per dtype) serves inputs of any rank.
        let attrs = reduce_attrs(&[-1], false);
        let def = &stagecraft_ops::SUM;
        let m2 = TensorMetadata::new(DType::F32, [2, 3]);
        let kernel = crate::registry().get(def).unwrap()(
            &Attrs::new(&attrs, def),
            std::slice::from_ref(&m2),
        )
        .unwrap();
        for dims in [&[2, 3][..], &[2, 2, 3][..], &[3][..]] {
            let meta = TensorMetadata::new(DType::F32, dims);
            let outputs = def.infer(&[meta], &attrs).unwrap();
            let n: usize = dims.iter().product();
            let x = tensor(DType::F32, &vec![1.0; n], dims);
            let ctx = KernelContext {
                attrs: Attrs::new(&attrs, def),
                outputs: &outputs,
            };
            let y = kernel(smallvec![x], &ctx).unwrap();
            assert_eq!(values(&y[0]), vec![3.0; n / 3]);
        }
    }

    #[test]
    fn sixteen_million_f32_values_sum_accurately() {
        let n = 1 << 24;
        let mut rng = Rng(12);
        let xs: Vec<f32> = (0..n).map(|_| rng.uniform(0.0, 1.0) as f32).collect();
        let exact: f64 = {
            // Kahan-compensated f64: far below f32 resolution.
            let (mut s, mut c) = (0.0f64, 0.0f64);
            for &x in &xs {
                let y = x as f64 - c;
                let t = s + y;
                c = (t - s) - y;
                s = t;
            }
            s
        };
        let x = DenseHostTensor::from_slice(&xs, [n]).unwrap();
        for (def, want) in [
            (&stagecraft_ops::SUM, exact),
            (&stagecraft_ops::MEAN, exact / n as f64),
        ] {
            let got = run(def, vec![x.clone()], &OpAttrs::new())
                .unwrap()
                .to_vec::<f32>()
                .unwrap()[0];
            assert_eq!(got, want as f32, "{}: got {got}, exact {want}", def.name);
        }
        // Along a long inner axis and along a long outer axis too.
        let x2 = x.reshaped([2, n / 2]).unwrap();
        let rows = run(
            &stagecraft_ops::SUM,
            vec![x2.clone()],
            &reduce_attrs(&[1], false),
        )
        .unwrap();
        let r = rows.to_vec::<f32>().unwrap();
        let half: f64 = xs[..n / 2].iter().map(|&v| v as f64).sum();
        assert!(
            ((r[0] as f64) - half).abs() <= half * 1e-7,
            "{} vs {half}",
            r[0]
        );
        let xt = x.reshaped([n / 4, 4]).unwrap();
        let cols = run(&stagecraft_ops::SUM, vec![xt], &reduce_attrs(&[0], false)).unwrap();
        let c0: f64 = xs.iter().step_by(4).map(|&v| v as f64).sum();
        assert!(((cols.to_vec::<f32>().unwrap()[0] as f64) - c0).abs() <= c0 * 1e-7);
    }

    #[test]
    fn arg_reductions_match_the_reference() {
        let mut rng = Rng(13);
        let cases: &[(&[usize], i64)] = &[
            (&[7], 0),
            (&[1], 0),
            (&[3, 4], 1),
            (&[3, 4], 0),
            (&[2, 3, 4], -2),
            (&[2, 0, 3], 2),
            (&[40_000, 2], 1),
            (&[2, 40_000], 0),
            (&[3, 30_000], 1),
        ];
        for (def, max) in [
            (&stagecraft_ops::ARGMAX, true),
            (&stagecraft_ops::ARGMIN, false),
        ] {
            for dtype in NUMERIC {
                for &(dims, axis) in cases {
                    if !crate::kernels::runs_in_this_build(dtype, dims) {
                        continue;
                    }
                    for keepdim in [false, true] {
                        let mut attrs = OpAttrs::new();
                        attrs.set_int("axis", axis).set_bool("keepdim", keepdim);
                        let n: usize = dims.iter().product();
                        // Rounded values make ties common.
                        let xs: Vec<f64> = rng
                            .values(dtype, n, true)
                            .into_iter()
                            .map(|v| if v.is_finite() { v.round() } else { v })
                            .collect();
                        let x = tensor(dtype, &xs, dims);
                        let xv = values(&x);
                        let got = run(def, vec![x], &attrs).unwrap();
                        assert_eq!(got.dtype(), DType::I64);
                        let a = normalize_axis(axis as isize, dims.len()).unwrap();
                        let (want, out_dims) = reference::arg_reduce(max, &xv, dims, a, keepdim);
                        assert_eq!(got.shape().dims(), out_dims.as_slice());
                        assert_eq!(
                            values(&got),
                            want,
                            "{} {dtype} {dims:?} axis {axis}",
                            def.name
                        );
                    }
                }
            }
        }
        let mut attrs = OpAttrs::new();
        attrs.set_int("axis", 0);
        let x = tensor(DType::F32, &[1.0, f64::NAN, 5.0, f64::NAN], &[4]);
        for def in [&stagecraft_ops::ARGMAX, &stagecraft_ops::ARGMIN] {
            assert_eq!(
                run(def, vec![x.clone()], &attrs)
                    .unwrap()
                    .to_vec::<i64>()
                    .unwrap(),
                vec![1]
            );
        }
        let ties = tensor(DType::I32, &[2.0, 7.0, 7.0, 2.0], &[4]);
        assert_eq!(
            run(&stagecraft_ops::ARGMAX, vec![ties.clone()], &attrs)
                .unwrap()
                .to_vec::<i64>()
                .unwrap(),
            vec![1]
        );
        assert_eq!(
            run(&stagecraft_ops::ARGMIN, vec![ties], &attrs)
                .unwrap()
                .to_vec::<i64>()
                .unwrap(),
            vec![0]
        );
    }

    #[test]
    fn softmax_matches_the_reference() {
        let mut rng = Rng(14);
        let cases: &[(&[usize], i64)] = &[
            (&[5], -1),
            (&[1], 0),
            (&[3, 4], -1),
            (&[3, 4], 0),
            (&[2, 3, 4], 1),
            (&[0, 3], -1),
            (&[3, 0], 0),
            (&[500, 100], -1),
            (&[100, 500], 0),
            (&[4, 3000, 5], 1),
        ];
        for (def, log) in [
            (&stagecraft_ops::SOFTMAX, false),
            (&stagecraft_ops::LOG_SOFTMAX, true),
        ] {
            for dtype in [DType::F16, DType::BF16, DType::F32, DType::F64] {
                for &(dims, axis) in cases {
                    if !crate::kernels::runs_in_this_build(dtype, dims) {
                        continue;
                    }
                    let mut attrs = OpAttrs::new();
                    attrs.set_int("axis", axis);
                    let n: usize = dims.iter().product();
                    let xs: Vec<f64> = rng
                        .values(dtype, n, false)
                        .into_iter()
                        .map(|v| v * 4.0)
                        .collect();
                    let x = tensor(dtype, &xs, dims);
                    let xv = values(&x);
                    let got = run(def, vec![x], &attrs).unwrap();
                    let a = normalize_axis(axis as isize, dims.len()).unwrap();
                    let want: Vec<f64> = reference::softmax(&xv, dims, a, log)
                        .into_iter()
                        .map(|w| crate::reference::elementwise::round_to(dtype, w))
                        .collect();
                    // Log-softmax values near 0 come from cancellation of
                    // terms as large as the inputs.
                    let scale: Vec<f64> = if log {
                        xv.iter().map(|v| v.abs() + 20.0).collect()
                    } else {
                        vec![]
                    };
                    assert_close_scaled(
                        dtype,
                        &values(&got),
                        &want,
                        &scale,
                        &format!("{} {dims:?} axis {axis}", def.name),
                    );
                }
            }
        }
    }

    /// A leaf sum adds in the order its documentation gives (lane `i`
    /// takes elements `i`, `i + 32`, … of the whole 32-wide chunks, lanes
    /// 0–7 then the whole 8-wide chunks after, one more the rest, and the
    /// lanes combine pairwise), with the same bits on every instruction
    /// set: values of mixed magnitudes, where any other order rounds
    /// differently.
    #[test]
    fn a_leaf_sum_adds_in_its_documented_order_on_every_instruction_set() {
        fn documented(row: &[f64]) -> f64 {
            let whole = row.len() / LANES * LANES;
            let eights = whole + (row.len() - whole) / 8 * 8;
            let mut lanes = [0.0; LANES];
            for (i, &x) in row[..whole].iter().enumerate() {
                lanes[i % LANES] += x;
            }
            for (i, &x) in row[whole..eights].iter().enumerate() {
                lanes[i % 8] += x;
            }
            let tail = row[eights..].iter().fold(0.0, |t, &x| t + x);
            let mut width = LANES;
            while width > 1 {
                width /= 2;
                for i in 0..width {
                    lanes[i] += lanes[i + width];
                }
            }
            lanes[0] + tail
        }
        let mut isas = vec![Isa::Baseline, isa()];
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            isas.push(Isa::Avx2);
        }
        let values: Vec<f64> = (0..2048u32)
            .map(|i| {
                let magnitude = [1e-8, 1.0, 3e7, 0.1][(i % 4) as usize];
                let sign = if i % 3 == 0 { -1.0 } else { 1.0 };
                sign * magnitude * (1.0 + f64::from(i.wrapping_mul(2654435761) % 1000) / 997.0)
            })
            .collect();
        let lengths: Vec<usize> = if cfg!(miri) {
            vec![0, 7, 8, 33, 75]
        } else {
            (0..=100).chain([1000, 1001, 2048]).collect()
        };
        let mut orders_differ = false;
        for n in lengths {
            let row = &values[..n];
            let want = documented(row);
            orders_differ |= want.to_bits() != row.iter().sum::<f64>().to_bits();
            for &isa in &isas {
                let got = leaf_on(isa, row, |x: f64| x, 0.0, |a, b| a + b);
                assert_eq!(got.to_bits(), want.to_bits(), "{isa:?}, {n} values");
            }
        }
        assert!(
            orders_differ,
            "the values do not tell summation orders apart"
        );
    }

    /// The softmax loops give the same bits whatever instruction set they
    /// are compiled for, on rows (the MLP's 10 classes) and on columns.
    #[test]
    fn softmax_gives_the_same_bits_on_every_instruction_set() {
        fn check<T: Real + std::fmt::Debug>(values: &[T], inner: usize, log: bool) {
            let run = |isa: Isa| {
                let mut slab = values.to_vec();
                softmax_slab_on(isa, &mut slab, inner, log);
                slab
            };
            let baseline = run(Isa::Baseline);
            let mut isas = vec![isa()];
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2") {
                isas.push(Isa::Avx2);
            }
            for isa in isas {
                let got = run(isa);
                let same = got
                    .iter()
                    .zip(&baseline)
                    .all(|(a, b)| a.wide().to_bits() == b.wide().to_bits());
                assert!(same, "{isa:?}, inner {inner}, log {log}");
            }
        }
        let xs: Vec<f64> = (0..1000)
            .map(|i| match i % 97 {
                0 => f64::NAN,
                1 => f64::NEG_INFINITY,
                _ => ((i * 7919) % 1000) as f64 / 37.0 - 13.0,
            })
            .collect();
        // Under Miri, narrower columns: fewer values, the same paths.
        let widest = if cfg!(miri) { 20 } else { 50 };
        for log in [false, true] {
            for inner in [1, 3, widest] {
                let f32s: Vec<f32> = xs.iter().map(|&x| x as f32).collect();
                check(&f32s[..10 * inner], inner, log);
                check(&f32s[..(20 * inner).min(1000)], inner, log);
                check(&xs[..10 * inner], inner, log);
            }
        }
    }

    #[test]
    fn softmax_handles_infinities_and_nan_like_pytorch() {
        let mut attrs = OpAttrs::new();
        attrs.set_int("axis", -1);
        let rows = [
            vec![1.0, f64::INFINITY, 2.0],
            vec![1.0, f64::NAN, 2.0],
            vec![f64::NEG_INFINITY; 3],
            vec![0.0, f64::NEG_INFINITY, 0.0],
            vec![1000.0, 0.0, -1000.0],
        ];
        let flat: Vec<f64> = rows.concat();
        for dtype in [DType::F32, DType::F64, DType::BF16] {
            for (def, log) in [
                (&stagecraft_ops::SOFTMAX, false),
                (&stagecraft_ops::LOG_SOFTMAX, true),
            ] {
                let got = values(&run(def, vec![tensor(dtype, &flat, &[5, 3])], &attrs).unwrap());
                assert!(
                    got[..9].iter().all(|v| v.is_nan()),
                    "{} {dtype}: {got:?}",
                    def.name
                );
                if log {
                    assert_close(
                        dtype,
                        &got[9..],
                        &[
                            -std::f64::consts::LN_2,
                            f64::NEG_INFINITY,
                            -std::f64::consts::LN_2,
                            0.0,
                            -1000.0,
                            -2000.0,
                        ],
                        def.name,
                    );
                } else {
                    assert_eq!(
                        &got[9..],
                        &[0.5, 0.0, 0.5, 1.0, 0.0, 0.0],
                        "{} {dtype}",
                        def.name
                    );
                }
            }
        }
    }

    #[test]
    fn softmax_reuses_a_unique_input_and_spares_a_shared_one() {
        let attrs = OpAttrs::new();
        let x = tensor(DType::F32, &[1.0, 2.0, 3.0, 4.0], &[2, 2]);
        let at = x.buffer().bytes().as_ptr() as usize;
        let y = run(&stagecraft_ops::SOFTMAX, vec![x], &attrs).unwrap();
        assert_eq!(y.buffer().bytes().as_ptr() as usize, at);
        let shared = tensor(DType::F32, &[1.0, 2.0], &[2]);
        let y = run(&stagecraft_ops::SOFTMAX, vec![shared.clone()], &attrs).unwrap();
        assert_eq!(shared.to_vec::<f32>().unwrap(), vec![1.0, 2.0]);
        let s = y.to_vec::<f32>().unwrap();
        assert!((s[0] + s[1] - 1.0).abs() < 1e-6 && s[1] > s[0]);
    }

    fn reduce_case() -> impl Strategy<Value = (Vec<usize>, Vec<i64>, bool)> {
        prop::collection::vec(0usize..5, 0..5).prop_flat_map(|dims| {
            let rank = dims.len();
            (
                Just(dims),
                prop::collection::vec(any::<bool>(), rank),
                any::<bool>(),
            )
                .prop_map(|(dims, pick, keepdim)| {
                    let axes: Vec<i64> = pick
                        .iter()
                        .enumerate()
                        .filter(|(_, &p)| p)
                        .map(|(i, _)| i as i64)
                        .collect();
                    (dims, axes, keepdim)
                })
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn random_reductions_match_the_reference((dims, axes, keepdim) in reduce_case(), seed in any::<u64>()) {
            let mut rng = Rng(seed | 1);
            let n: usize = dims.iter().product();
            let attrs = reduce_attrs(&axes, keepdim);
            let x = tensor(DType::F64, &rng.values(DType::F64, n, false), &dims);
            // -1, 0 and 1 only, so that integer products cannot overflow.
            let ints: Vec<f64> = rng.values(DType::I64, n, false).into_iter().map(|v| v % 2.0).collect();
            let i = tensor(DType::I64, &ints, &dims);
            let resolved = reduction_axes(&axes, dims.len()).unwrap();
            for (def, op) in REDUCE {
                for t in [&x, &i] {
                    let meta = t.metadata().clone();
                    if def.infer(&[meta], &attrs).is_err() {
                        continue;
                    }
                    let xv = values(t);
                    let got = run(def, vec![t.clone()], &attrs).unwrap();
                    let (want, out_dims) = reference::reduce(op, &xv, &dims, &resolved, keepdim);
                    prop_assert_eq!(got.shape().dims(), out_dims.as_slice());
                    let abs: Vec<f64> = xv.iter().map(|v| v.abs()).collect();
                    let (scale, _) = reference::reduce(ReduceOp::Sum, &abs, &dims, &resolved, keepdim);
                    assert_close_scaled(t.dtype(), &values(&got), &want, &scale, def.name);
                }
            }
        }
    }
}
