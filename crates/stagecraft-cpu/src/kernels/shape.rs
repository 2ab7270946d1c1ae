//! CPU kernels of the shape and indexing ops: reshape (zero-copy),
//! transpose, broadcast, concat, slice, gather, one-hot, pad and nonzero.
//!
//! Kernels are cached per dtype, not per shape, so every shape-dependent
//! plan (resolved permutation, slice, strides) is made at call time from
//! the inputs; factories only pick the dtype-specialised function.
//!
//! Most of these ops are pure data movement. They share one strided-copy
//! routine ([`StridedView`]) that collapses axes which are contiguous in the
//! source, so that the innermost loop is a `copy_from_slice`, a `fill` or a
//! plain strided read. Transposes whose innermost output axis is strided in
//! the source use cache-blocked tiles instead.

use super::first_dtype;
use crate::numeric::broadcast_strides;
use crate::{
    with_any_type, Inputs, Kernel, KernelContext, KernelRegistry, Outputs, PARALLEL_THRESHOLD,
};
use smallvec::{smallvec, SmallVec};
use stagecraft_ops::{resolve_perm, resolve_reshape, resolve_slice, Attrs};
use stagecraft_tensor::{
    normalize_axis, DType, DenseHostTensor, Element, Error, ErrorKind, Result, Scalar, Shape,
    TensorMetadata,
};
use std::borrow::Cow;
use std::sync::Arc;

type Dims = SmallVec<[usize; 4]>;

/// Elements per parallel task: large enough to amortise a rayon fork,
/// small enough to balance two to a few dozen cores.
const CHUNK: usize = 1 << 14;

/// Side of the square tiles of the blocked transpose: 32×32 elements of
/// up to 8 bytes keep both the read and the write tile in L1.
const TILE: usize = 32;

pub(crate) fn register(registry: &mut KernelRegistry) {
    registry.add(&stagecraft_ops::RESHAPE, reshape_factory);
    registry.add(&stagecraft_ops::TRANSPOSE, transpose_factory);
    registry.add(&stagecraft_ops::BROADCAST_TO, broadcast_to_factory);
    registry.add(&stagecraft_ops::CONCAT, concat_factory);
    registry.add(&stagecraft_ops::SLICE, slice_factory);
    registry.add(&stagecraft_ops::GATHER, gather_factory);
    registry.add(&stagecraft_ops::ONE_HOT, one_hot_factory);
    registry.add(&stagecraft_ops::PAD, pad_factory);
    registry.add(&stagecraft_ops::NONZERO, nonzero_factory);
}

/// A kernel of one input and one output, dtype-specialised up front.
type OneToOne = fn(DenseHostTensor, &KernelContext<'_>) -> Result<DenseHostTensor>;

fn one_to_one(f: OneToOne) -> Kernel {
    Arc::new(
        move |inputs: Inputs, ctx: &KernelContext<'_>| -> Result<Outputs> {
            let x = inputs
                .into_iter()
                .next()
                .ok_or_else(|| Error::internal("the kernel expects one input, got none"))?;
            Ok(smallvec![f(x, ctx)?])
        },
    )
}

/// Row-major strides of `dims`.
fn row_major(dims: &[usize]) -> Dims {
    let mut strides: Dims = SmallVec::from_elem(1, dims.len());
    for i in (0..dims.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * dims[i + 1];
    }
    strides
}

/// The multi-index of row-major position `flat` in `dims`.
pub(crate) fn unravel(mut flat: usize, dims: &[usize]) -> Dims {
    let mut index: Dims = SmallVec::from_elem(0, dims.len());
    for axis in (0..dims.len()).rev() {
        if dims[axis] > 0 {
            index[axis] = flat % dims[axis];
            flat /= dims[axis];
        }
    }
    index
}

/// Runs `fill(chunk, first)` over pieces of `dst`, where `first` is the
/// position of `chunk[0]` in `dst`; in parallel above the threshold.
fn fill_chunks<T: Send>(dst: &mut [T], fill: impl Fn(&mut [T], usize) + Sync) {
    if dst.len() > PARALLEL_THRESHOLD {
        crate::pool::for_each_chunk(dst, CHUNK, |c, chunk| fill(chunk, c * CHUNK));
    } else {
        fill(dst, 0);
    }
}

/// Runs `fill(rows, first_row)` over groups of whole rows of `row_len`
/// elements; in parallel above the threshold. `row_len` must be nonzero.
fn fill_rows<T: Send>(dst: &mut [T], row_len: usize, fill: impl Fn(&mut [T], usize) + Sync) {
    if dst.len() > PARALLEL_THRESHOLD && dst.len() > row_len {
        let rows = (CHUNK / row_len).max(1);
        crate::pool::for_each_chunk(dst, rows * row_len, |c, chunk| fill(chunk, c * rows));
    } else {
        fill(dst, 0);
    }
}

/// A strided view of a source buffer: the element at multi-index `i` is
/// `src[base + Σ i[k] * strides[k]]` (a stride of 0 repeats an element).
struct StridedView {
    base: usize,
    dims: Dims,
    strides: Dims,
}

impl StridedView {
    /// The view, with size-1 axes dropped and neighbouring axes merged
    /// wherever the outer one steps exactly over the inner one, so the
    /// innermost run is as long as possible.
    fn new(base: usize, dims: &[usize], strides: &[usize]) -> StridedView {
        let mut view = StridedView {
            base,
            dims: Dims::new(),
            strides: Dims::new(),
        };
        for (&d, &s) in dims.iter().zip(strides) {
            if d == 1 {
                continue;
            }
            match (view.dims.last_mut(), view.strides.last_mut()) {
                (Some(last_d), Some(last_s)) if *last_s == s * d => {
                    *last_d *= d;
                    *last_s = s;
                }
                _ => {
                    view.dims.push(d);
                    view.strides.push(s);
                }
            }
        }
        if view.dims.is_empty() {
            view.dims.push(1);
            view.strides.push(0);
        }
        view
    }

    /// Copies the view's elements `start..start + dst.len()` (row-major)
    /// into `dst`.
    fn copy_range<T: Copy>(&self, src: &[T], dst: &mut [T], start: usize) {
        let (dims, strides) = (&self.dims[..], &self.strides[..]);
        let last = dims.len() - 1;
        let (inner, step) = (dims[last], strides[last]);
        let mut index = unravel(start, dims);
        let mut offset = self.base + index.iter().zip(strides).map(|(i, s)| i * s).sum::<usize>();
        let mut pos = 0;
        while pos < dst.len() {
            let n = (inner - index[last]).min(dst.len() - pos);
            let out = &mut dst[pos..pos + n];
            match step {
                1 => out.copy_from_slice(&src[offset..offset + n]),
                0 => out.fill(src[offset]),
                _ => {
                    for (o, v) in out.iter_mut().zip(src[offset..].iter().step_by(step)) {
                        *o = *v;
                    }
                }
            }
            pos += n;
            // Back to the start of the row, then on to the next row.
            offset -= index[last] * step;
            index[last] = 0;
            for axis in (0..last).rev() {
                index[axis] += 1;
                offset += strides[axis];
                if index[axis] < dims[axis] {
                    break;
                }
                offset -= strides[axis] * dims[axis];
                index[axis] = 0;
            }
        }
    }

    /// Materialises the view into `dst` (which holds all its elements).
    fn copy_all<T: Copy + Send + Sync>(&self, src: &[T], dst: &mut [T]) {
        fill_chunks(dst, |chunk, start| self.copy_range(src, chunk, start));
    }
}

// ---------------------------------------------------------------- reshape

fn reshape_factory(_: &Attrs<'_>, _: &[TensorMetadata]) -> Result<Kernel> {
    Ok(one_to_one(|x, ctx| {
        let shape = resolve_reshape(ctx.attrs.ints("shape")?, x.shape())?;
        x.reshaped(shape)
    }))
}

// -------------------------------------------------------------- transpose

fn transpose_factory(_: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    Ok(one_to_one(
        with_any_type!(first_dtype(inputs)?, T => transpose::<T>),
    ))
}

/// Simplifies a transpose of `dims` by `perm` without changing the memory
/// order it produces: size-1 axes are dropped and axes that stay adjacent
/// and in order are merged. Returns the reduced input dims and the reduced
/// permutation.
fn reduce_permutation(dims: &[usize], perm: &[usize]) -> (Dims, Dims) {
    // Compact numbering of the input axes that are not size 1.
    let mut compact: SmallVec<[Option<usize>; 4]> = SmallVec::from_elem(None, dims.len());
    let mut kept = 0;
    for (axis, &d) in dims.iter().enumerate() {
        if d != 1 {
            compact[axis] = Some(kept);
            kept += 1;
        }
    }
    // Groups of compact input axes in output order: (first, last, size).
    let mut groups: SmallVec<[(usize, usize, usize); 4]> = SmallVec::new();
    for &p in perm {
        let Some(c) = compact[p] else { continue };
        match groups.last_mut() {
            Some(g) if g.1 + 1 == c => {
                g.1 = c;
                g.2 *= dims[p];
            }
            _ => groups.push((c, c, dims[p])),
        }
    }
    let mut input_order: Dims = (0..groups.len()).collect();
    input_order.sort_by_key(|&g| groups[g].0);
    let rdims: Dims = input_order.iter().map(|&g| groups[g].2).collect();
    let mut rperm: Dims = SmallVec::from_elem(0, groups.len());
    for (position, &g) in input_order.iter().enumerate() {
        rperm[g] = position;
    }
    (rdims, rperm)
}

fn transpose<T: Element>(x: DenseHostTensor, ctx: &KernelContext<'_>) -> Result<DenseHostTensor> {
    let dims = x.shape().dims();
    let perm = resolve_perm(ctx.attrs.ints("perm")?, dims.len())?;
    if perm.iter().enumerate().all(|(i, &p)| i == p) {
        return Ok(x);
    }
    let out_shape: Shape = perm.iter().map(|&p| dims[p]).collect();
    if x.numel() == 0 {
        return DenseHostTensor::zeros(TensorMetadata::new(x.dtype(), out_shape));
    }
    let (rdims, rperm) = reduce_permutation(dims, &perm);
    if rperm.iter().enumerate().all(|(i, &p)| i == p) {
        // Only size-1 axes moved: the memory order is unchanged.
        return x.reshaped(out_shape);
    }
    let in_strides = row_major(&rdims);
    let out_dims: Dims = rperm.iter().map(|&p| rdims[p]).collect();
    let src_strides: Dims = rperm.iter().map(|&p| in_strides[p]).collect();
    let mut out = DenseHostTensor::for_overwrite(TensorMetadata::new(x.dtype(), out_shape))?;
    permute(
        x.as_slice::<T>()?,
        out.as_mut_slice::<T>()?,
        &out_dims,
        &src_strides,
    );
    Ok(out)
}

/// Writes `dst[i] = src[Σ i[k] * src_strides[k]]` for every multi-index `i`
/// of `dims` (a reduced permutation: no size-1 axes, rank ≥ 2).
fn permute<T: Copy + Send + Sync>(src: &[T], dst: &mut [T], dims: &[usize], src_strides: &[usize]) {
    let last = dims.len() - 1;
    let Some(j) = src_strides
        .iter()
        .position(|&s| s == 1)
        .filter(|&j| j != last)
    else {
        // The innermost output axis is contiguous in the source (or there
        // is no unit-stride axis to block against): a plain strided copy.
        StridedView::new(0, dims, src_strides).copy_all(src, dst);
        return;
    };
    let row_len: usize = dims[1..].iter().product();
    let total_rows = dims[0];
    if dst.len() <= PARALLEL_THRESHOLD {
        transpose_tiled(src, dst, dims, src_strides, j, 0);
        return;
    }
    // Split output axis 0 into ranges; when axis 0 is the tiled axis, keep
    // whole tiles per task.
    let mut rows = (CHUNK / row_len).max(1);
    if j == 0 {
        rows = rows.div_ceil(TILE) * TILE;
    }
    let rows = rows.min(total_rows);
    crate::pool::for_each_chunk(dst, rows * row_len, |c, chunk| {
        let first = c * rows;
        let mut sub: Dims = dims.into();
        sub[0] = chunk.len() / row_len;
        transpose_tiled(src, chunk, &sub, src_strides, j, first * src_strides[0]);
    });
}

/// The blocked transpose: output axis `j` has source stride 1 and the last
/// output axis has a larger one, so the copy walks `TILE`×`TILE` tiles of
/// (axis `j`, last axis) for every index of the other axes. `base` is the
/// source offset of the first output element.
pub(crate) fn transpose_tiled<T: Copy>(
    src: &[T],
    dst: &mut [T],
    dims: &[usize],
    src_strides: &[usize],
    j: usize,
    base: usize,
) {
    let last = dims.len() - 1;
    let dst_strides = row_major(dims);
    let (na, nb) = (dims[j], dims[last]);
    let (dst_a, src_b) = (dst_strides[j], src_strides[last]);
    let outer: Dims = (0..last).filter(|&a| a != j).collect();
    let mut index: Dims = SmallVec::from_elem(0, outer.len());
    let (mut src_off, mut dst_off) = (base, 0usize);
    loop {
        for a0 in (0..na).step_by(TILE) {
            let a1 = (a0 + TILE).min(na);
            for b0 in (0..nb).step_by(TILE) {
                let b1 = (b0 + TILE).min(nb);
                for a in a0..a1 {
                    let row = &mut dst[dst_off + a * dst_a + b0..dst_off + a * dst_a + b1];
                    let column = &src[src_off + a + b0 * src_b..];
                    for (o, v) in row.iter_mut().zip(column.iter().step_by(src_b)) {
                        *o = *v;
                    }
                }
            }
        }
        // Next index of the outer axes; done when it wraps.
        let mut k = outer.len();
        loop {
            if k == 0 {
                return;
            }
            k -= 1;
            let axis = outer[k];
            index[k] += 1;
            src_off += src_strides[axis];
            dst_off += dst_strides[axis];
            if index[k] < dims[axis] {
                break;
            }
            src_off -= src_strides[axis] * dims[axis];
            dst_off -= dst_strides[axis] * dims[axis];
            index[k] = 0;
        }
    }
}

// ----------------------------------------------------------- broadcast_to

fn broadcast_to_factory(_: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    Ok(one_to_one(
        with_any_type!(first_dtype(inputs)?, T => broadcast_to::<T>),
    ))
}

fn broadcast_to<T: Element>(
    x: DenseHostTensor,
    ctx: &KernelContext<'_>,
) -> Result<DenseHostTensor> {
    let target = Shape::new(&ctx.attrs.dims("shape")?);
    if x.shape() == &target {
        return Ok(x);
    }
    if target.rank() < x.shape().rank() {
        return Err(Error::shape(format!(
            "cannot broadcast {} to {target}",
            x.shape()
        )));
    }
    if target.numel() == x.numel() {
        // Only unit or leading axes were added: same values, same order.
        return x.reshaped(target);
    }
    let mut out = DenseHostTensor::for_overwrite(TensorMetadata::new(x.dtype(), target.clone()))?;
    if out.numel() > 0 {
        let strides = broadcast_strides(x.shape(), &target);
        let view = StridedView::new(0, target.dims(), &strides);
        view.copy_all(x.as_slice::<T>()?, out.as_mut_slice::<T>()?);
    }
    Ok(out)
}

// ----------------------------------------------------------------- concat

fn concat_factory(_: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    let f: fn(Inputs, &KernelContext<'_>) -> Result<DenseHostTensor> =
        with_any_type!(first_dtype(inputs)?, T => concat::<T>);
    Ok(Arc::new(
        move |inputs: Inputs, ctx: &KernelContext<'_>| -> Result<Outputs> {
            Ok(smallvec![f(inputs, ctx)?])
        },
    ))
}

fn concat<T: Element>(inputs: Inputs, ctx: &KernelContext<'_>) -> Result<DenseHostTensor> {
    let first = inputs
        .first()
        .ok_or_else(|| Error::internal("Concat needs at least one input"))?;
    let rank = first.shape().rank();
    let axis = normalize_axis(ctx.attrs.int("axis")? as isize, rank)?;
    let mut out_shape = first.shape().clone();
    out_shape.dims_mut()[axis] = 0;
    for t in &inputs {
        let same_rest = t.shape().rank() == rank
            && (0..rank).all(|d| d == axis || t.shape()[d] == first.shape()[d]);
        if !same_rest {
            return Err(Error::shape(format!(
                "cannot concatenate {} and {} on axis {axis}",
                first.shape(),
                t.shape()
            )));
        }
        out_shape.dims_mut()[axis] += t.shape()[axis];
    }
    if inputs.len() == 1 {
        return inputs
            .into_iter()
            .next()
            .ok_or_else(|| Error::internal("Concat lost its input"));
    }
    // Every element is written below.
    let mut out =
        DenseHostTensor::for_overwrite(TensorMetadata::new(first.dtype(), out_shape.clone()))?;
    if out.numel() == 0 {
        return Ok(out);
    }
    // Each output row (one index of the axes before `axis`) is the inputs'
    // matching rows, one after the other. The output is cut into chunks
    // whatever its rows, so that a concatenation of one row (channels of a
    // single image) is copied on every thread too.
    let outer: usize = out_shape.dims()[..axis].iter().product();
    let widths: SmallVec<[usize; 4]> = inputs.iter().map(|t| t.numel() / outer).collect();
    let srcs = inputs
        .iter()
        .map(|t| t.as_slice::<T>())
        .collect::<Result<SmallVec<[&[T]; 4]>>>()?;
    let row_len: usize = widths.iter().sum();
    fill_chunks(out.as_mut_slice::<T>()?, |chunk, first| {
        // The input and the position in its row where `chunk` starts.
        let (mut row, mut column) = (first / row_len, first % row_len);
        let mut input = 0;
        while column >= widths[input] {
            column -= widths[input];
            input += 1;
        }
        let mut rest = chunk;
        while !rest.is_empty() {
            let w = widths[input];
            let n = (w - column).min(rest.len());
            let (head, tail) = rest.split_at_mut(n);
            head.copy_from_slice(&srcs[input][row * w + column..][..n]);
            rest = tail;
            column += n;
            // On to the next input with values left in this row, or the
            // first of the next row.
            while column == widths[input] {
                column = 0;
                input += 1;
                if input == widths.len() {
                    input = 0;
                    row += 1;
                    if rest.is_empty() {
                        break;
                    }
                }
            }
        }
    });
    Ok(out)
}

// ------------------------------------------------------------------ slice

fn slice_factory(_: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    Ok(one_to_one(
        with_any_type!(first_dtype(inputs)?, T => slice::<T>),
    ))
}

fn slice<T: Element>(x: DenseHostTensor, ctx: &KernelContext<'_>) -> Result<DenseHostTensor> {
    let slices = resolve_slice(&ctx.attrs, x.shape())?;
    let dims = x.shape().dims();
    if slices
        .iter()
        .zip(dims)
        .all(|(s, &d)| s.start == 0 && s.len == d && (s.step == 1 || d <= 1))
    {
        return Ok(x);
    }
    let out_dims: Dims = slices.iter().map(|s| s.len).collect();
    let mut out =
        DenseHostTensor::for_overwrite(TensorMetadata::new(x.dtype(), Shape::new(&out_dims)))?;
    if out.numel() == 0 {
        return Ok(out);
    }
    let in_strides = row_major(dims);
    let base = slices
        .iter()
        .zip(&in_strides)
        .map(|(s, st)| s.start * st)
        .sum();
    // A taken axis of length 1 never steps, and a huge step times the stride
    // could overflow.
    let strides: Dims = slices
        .iter()
        .zip(&in_strides)
        .map(|(s, st)| if s.len > 1 { s.step * st } else { 0 })
        .collect();
    let view = StridedView::new(base, &out_dims, &strides);
    view.copy_all(x.as_slice::<T>()?, out.as_mut_slice::<T>()?);
    Ok(out)
}

// ----------------------------------------------------------------- gather

/// The values of an integer index tensor as i64 (borrowed when already
/// i64).
pub(crate) fn index_values(t: &DenseHostTensor) -> Result<Cow<'_, [i64]>> {
    match t.dtype() {
        DType::I64 => Ok(Cow::Borrowed(t.as_slice::<i64>()?)),
        DType::I32 => Ok(Cow::Owned(
            t.as_slice::<i32>()?.iter().map(|&i| i as i64).collect(),
        )),
        other => Err(Error::dtype(format!(
            "indices must be i32 or i64, got {other}"
        ))),
    }
}

/// The error for index `value` at flat `position` of an index tensor of
/// `shape`, outside the half-open range `[low, high)`.
pub(crate) fn index_error(
    value: i64,
    position: usize,
    shape: &Shape,
    what: &str,
    low: i64,
    high: i64,
) -> Error {
    let at: Vec<usize> = unravel(position, shape.dims()).into_vec();
    Error::new(
        ErrorKind::Index,
        format!("index {value} at position {at:?} of the indices is out of range for {what}: valid indices are [{low}, {high})"),
    )
}

fn gather_factory(_: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    let f: fn(&DenseHostTensor, &DenseHostTensor, &KernelContext<'_>) -> Result<DenseHostTensor> =
        with_any_type!(first_dtype(inputs)?, T => gather::<T>);
    Ok(Arc::new(
        move |inputs: Inputs, ctx: &KernelContext<'_>| -> Result<Outputs> {
            match &inputs[..] {
                [x, indices] => Ok(smallvec![f(x, indices, ctx)?]),
                other => Err(Error::internal(format!(
                    "Gather expects 2 inputs, got {}",
                    other.len()
                ))),
            }
        },
    ))
}

fn gather<T: Element>(
    x: &DenseHostTensor,
    indices: &DenseHostTensor,
    ctx: &KernelContext<'_>,
) -> Result<DenseHostTensor> {
    let dims = x.shape().dims();
    let axis = normalize_axis(ctx.attrs.int("axis")? as isize, dims.len())?;
    let size = dims[axis];
    let values = index_values(indices)?;
    let signed_size = size as i64;
    let picks = values
        .iter()
        .enumerate()
        .map(|(position, &i)| {
            if (-signed_size..signed_size).contains(&i) {
                Ok(if i < 0 {
                    (i + signed_size) as usize
                } else {
                    i as usize
                })
            } else {
                let what = format!("axis {axis} of size {size}");
                Err(index_error(
                    i,
                    position,
                    indices.shape(),
                    &what,
                    -signed_size,
                    signed_size,
                ))
            }
        })
        .collect::<Result<Vec<usize>>>()?;
    let mut out_shape: Shape = dims[..axis].iter().copied().collect();
    for &d in indices.shape().dims().iter().chain(&dims[axis + 1..]) {
        out_shape.push(d);
    }
    let mut out = DenseHostTensor::for_overwrite(TensorMetadata::new(x.dtype(), out_shape))?;
    if out.numel() == 0 {
        return Ok(out);
    }
    let inner: usize = dims[axis + 1..].iter().product();
    gather_rows(
        x.as_slice::<T>()?,
        size,
        &picks,
        inner,
        out.as_mut_slice::<T>()?,
    );
    Ok(out)
}

/// Copies rows of `inner` elements: `src` viewed as `[outer, size,
/// inner]` and `dst` as `[outer, picks.len(), inner]`, output row `(o,
/// k)` is input row `(o, picks[k])`; in parallel above the threshold.
/// Every pick must be below `size`, and `dst` non-empty. The body of
/// `Gather` and of `Embedding` (one table, `outer = 1`).
pub(crate) fn gather_rows<T: Element>(
    src: &[T],
    size: usize,
    picks: &[usize],
    inner: usize,
    dst: &mut [T],
) {
    let n = picks.len();
    fill_rows(dst, inner, |chunk, first_row| {
        for (r, row) in chunk.chunks_exact_mut(inner).enumerate() {
            let (o, k) = ((first_row + r) / n, (first_row + r) % n);
            let from = (o * size + picks[k]) * inner;
            row.copy_from_slice(&src[from..from + inner]);
        }
    });
}

// ---------------------------------------------------------------- one_hot

fn one_hot_factory(attrs: &Attrs<'_>, _: &[TensorMetadata]) -> Result<Kernel> {
    Ok(one_to_one(
        with_any_type!(attrs.dtype("dtype")?, T => one_hot::<T>),
    ))
}

fn one_hot<T: Element>(
    indices: DenseHostTensor,
    ctx: &KernelContext<'_>,
) -> Result<DenseHostTensor> {
    let depth = ctx.attrs.int("depth")?;
    let width = usize::try_from(depth)
        .map_err(|_| Error::attribute(format!("depth must be non-negative, got {depth}")))?;
    let mut shape = indices.shape().clone();
    shape.push(width);
    let mut out = DenseHostTensor::zeros(TensorMetadata::new(T::DTYPE, shape))?;
    let values = index_values(&indices)?;
    let one = T::from_scalar(Scalar::Bool(true));
    let dst = out.as_mut_slice::<T>()?;
    for (position, &i) in values.iter().enumerate() {
        if !(0..depth).contains(&i) {
            return Err(index_error(
                i,
                position,
                indices.shape(),
                &format!("depth {depth}"),
                0,
                depth,
            ));
        }
        dst[position * width + i as usize] = one;
    }
    Ok(out)
}

// -------------------------------------------------------------------- pad

fn pad_factory(_: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    Ok(one_to_one(
        with_any_type!(first_dtype(inputs)?, T => pad::<T>),
    ))
}

fn pad<T: Element>(x: DenseHostTensor, ctx: &KernelContext<'_>) -> Result<DenseHostTensor> {
    let pads = ctx.attrs.dims("pads")?;
    let in_dims = x.shape().dims();
    let rank = in_dims.len();
    if pads.len() != 2 * rank {
        return Err(Error::attribute(format!(
            "pads needs 2 entries per axis of {}, got {}",
            x.shape(),
            pads.len()
        )));
    }
    if pads.iter().all(|&p| p == 0) {
        return Ok(x);
    }
    let out_dims: Dims = (0..rank)
        .map(|i| in_dims[i] + pads[2 * i] + pads[2 * i + 1])
        .collect();
    let mut out =
        DenseHostTensor::for_overwrite(TensorMetadata::new(x.dtype(), Shape::new(&out_dims)))?;
    if out.numel() == 0 {
        return Ok(out);
    }
    let value = T::from_scalar(Scalar::F64(ctx.attrs.float("value")?).cast(T::DTYPE));
    let src = x.as_slice::<T>()?;
    // Output rows along the last axis: a row either lies in the padding
    // (all `value`) or holds one input row between its before/after pads.
    let last = rank - 1;
    let (row_len, in_row_len, before) = (out_dims[last], in_dims[last], pads[2 * last]);
    let outer_dims = &out_dims[..last];
    let in_row_strides = row_major(&in_dims[..last]);
    fill_rows(out.as_mut_slice::<T>()?, row_len, |chunk, first_row| {
        let mut index = unravel(first_row, outer_dims);
        for row in chunk.chunks_exact_mut(row_len) {
            let mut in_row = Some(0usize);
            for (k, &i) in index.iter().enumerate() {
                let lo = pads[2 * k];
                in_row = in_row
                    .filter(|_| i >= lo && i < lo + in_dims[k])
                    .map(|r| r + (i - lo) * in_row_strides[k]);
            }
            match in_row {
                Some(r) if in_row_len > 0 => {
                    row[..before].fill(value);
                    row[before..before + in_row_len]
                        .copy_from_slice(&src[r * in_row_len..(r + 1) * in_row_len]);
                    row[before + in_row_len..].fill(value);
                }
                _ => row.fill(value),
            }
            for axis in (0..last).rev() {
                index[axis] += 1;
                if index[axis] < outer_dims[axis] {
                    break;
                }
                index[axis] = 0;
            }
        }
    });
    Ok(out)
}

// ---------------------------------------------------------------- nonzero

fn nonzero_factory(_: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    Ok(one_to_one(
        with_any_type!(first_dtype(inputs)?, T => nonzero::<T>),
    ))
}

/// Appends the coordinates of the nonzero elements of `rows` (whole rows of
/// `dims`' last axis, starting at row `first_row`) to a new vector.
fn nonzero_coords<T: Element>(rows: &[T], dims: &[usize], first_row: usize) -> Vec<i64> {
    let last = dims.len() - 1;
    let row_len = dims[last];
    let mut index = unravel(first_row, &dims[..last]);
    let mut coords = Vec::new();
    for row in rows.chunks_exact(row_len) {
        for (col, &v) in row.iter().enumerate() {
            // `!=` rather than `>`: NaN is nonzero, -0.0 is zero.
            if v != T::default() {
                coords.extend(index.iter().map(|&i| i as i64));
                coords.push(col as i64);
            }
        }
        for axis in (0..last).rev() {
            index[axis] += 1;
            if index[axis] < dims[axis] {
                break;
            }
            index[axis] = 0;
        }
    }
    coords
}

fn nonzero<T: Element>(x: DenseHostTensor, _: &KernelContext<'_>) -> Result<DenseHostTensor> {
    let dims = x.shape().dims();
    let rank = dims.len();
    let src = x.as_slice::<T>()?;
    if rank == 0 {
        let count = src.iter().filter(|&&v| v != T::default()).count();
        return DenseHostTensor::zeros(TensorMetadata::new(DType::I64, [count, 0]));
    }
    if x.numel() == 0 {
        return DenseHostTensor::zeros(TensorMetadata::new(DType::I64, [0, rank]));
    }
    let row_len = dims[rank - 1];
    let coords = if src.len() > PARALLEL_THRESHOLD {
        let rows = (CHUNK / row_len).max(1);
        let mut parts: Vec<Vec<i64>> = vec![Vec::new(); src.len().div_ceil(rows * row_len)];
        let count = parts.len();
        let jobs = parts.iter_mut().zip(src.chunks(rows * row_len)).enumerate();
        crate::pool::for_each_item_init(
            jobs,
            count,
            || (),
            |(), (c, (part, chunk))| *part = nonzero_coords(chunk, dims, c * rows),
        );
        parts.concat()
    } else {
        nonzero_coords(src, dims, 0)
    };
    let count = coords.len() / rank;
    DenseHostTensor::from_slice(&coords, [count, rank])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::shape as reference;
    use proptest::prelude::*;
    use stagecraft_ops::{AxisSlice, OpAttrs, OpDef, ShapeKind};

    /// Runs `def` through the registry as the runtime would.
    fn run(
        def: &'static OpDef,
        attrs: &OpAttrs,
        inputs: Vec<DenseHostTensor>,
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
        assert_eq!(out.len(), 1);
        if def.shape_kind == ShapeKind::Static {
            assert_eq!(
                out[0].metadata(),
                &out_meta[0],
                "{} output metadata",
                def.name
            );
        } else {
            assert_eq!(out[0].dtype(), out_meta[0].dtype);
            assert_eq!(out[0].shape().rank(), out_meta[0].shape.rank());
        }
        Ok(out.remove(0))
    }

    /// A tensor of `dtype` from f64 values (cast with the `Cast` rules).
    fn tensor(dtype: DType, values: &[f64], dims: &[usize]) -> DenseHostTensor {
        let build = || -> stagecraft_tensor::Result<DenseHostTensor> {
            with_any_type!(dtype, T => {
                let v: Vec<T> = values.iter().map(|&x| T::from_scalar(Scalar::F64(x))).collect();
                DenseHostTensor::from_slice(&v, dims)
            })
        };
        build().unwrap()
    }

    fn values(t: &DenseHostTensor) -> Vec<f64> {
        (0..t.numel())
            .map(|i| t.get_scalar(i).unwrap().to_f64())
            .collect()
    }

    /// Distinct small values exact in every dtype (0/1 for bool).
    fn sample(dtype: DType, n: usize) -> Vec<f64> {
        (0..n)
            .map(|i| {
                if dtype == DType::Bool {
                    (i % 3 == 1) as u8 as f64
                } else if dtype.is_unsigned() {
                    (i % 200) as f64
                } else {
                    (i % 200) as f64 - 100.0
                }
            })
            .collect()
    }

    fn numel(dims: &[usize]) -> usize {
        dims.iter().product()
    }

    fn check_transpose(dtype: DType, dims: &[usize], perm: &[usize]) {
        if !crate::kernels::runs_in_this_build(dtype, dims) {
            return;
        }
        let x = sample(dtype, numel(dims));
        let mut a = OpAttrs::new();
        a.set_ints("perm", &perm.iter().map(|&p| p as i64).collect::<Vec<_>>());
        let out = run(
            &stagecraft_ops::TRANSPOSE,
            &a,
            vec![tensor(dtype, &x, dims)],
        )
        .unwrap();
        let (want, want_dims) = reference::transpose(&x, dims, perm);
        assert_eq!(out.shape().dims(), &want_dims[..]);
        assert_eq!(
            values(&out),
            want,
            "transpose {dims:?} by {perm:?} ({dtype})"
        );
    }

    #[test]
    fn transpose_matches_reference() {
        for dtype in DType::ALL {
            check_transpose(dtype, &[], &[]);
            check_transpose(dtype, &[3, 5], &[1, 0]);
            check_transpose(dtype, &[2, 3, 4], &[2, 0, 1]);
            check_transpose(dtype, &[0, 3], &[1, 0]);
        }
        check_transpose(DType::F32, &[1, 4, 1, 3], &[3, 2, 1, 0]);
        check_transpose(DType::F32, &[2, 3, 4, 5], &[0, 2, 1, 3]);
        check_transpose(DType::F32, &[2, 3, 4, 5], &[1, 0, 3, 2]);
        check_transpose(DType::I64, &[4, 1, 5], &[1, 0, 2]);
        // Above the parallel threshold: plain 2-D, batched, tiled on axis 0,
        // and with contiguous inner runs.
        check_transpose(DType::F32, &[301, 203], &[1, 0]);
        check_transpose(DType::F64, &[3, 130, 97], &[0, 2, 1]);
        check_transpose(DType::F16, &[70, 3, 200], &[2, 1, 0]);
        check_transpose(DType::I32, &[40, 50, 30], &[1, 0, 2]);
        check_transpose(DType::Bool, &[2, 33000], &[1, 0]);
        check_transpose(DType::F32, &[33000, 2], &[1, 0]);
    }

    #[test]
    fn transpose_shortcuts_share_buffers() {
        let x = tensor(DType::F32, &sample(DType::F32, 6), &[2, 3]);
        let mut a = OpAttrs::new();
        a.set_ints("perm", &[0, 1]);
        let same = run(&stagecraft_ops::TRANSPOSE, &a, vec![x.clone()]).unwrap();
        assert!(same.buffer().ptr_eq(x.buffer()));
        let y = tensor(DType::F32, &sample(DType::F32, 6), &[2, 1, 3]);
        a.set_ints("perm", &[1, 0, 2]);
        let moved = run(&stagecraft_ops::TRANSPOSE, &a, vec![y.clone()]).unwrap();
        assert!(moved.buffer().ptr_eq(y.buffer()));
        assert_eq!(moved.shape().dims(), &[1, 2, 3]);
    }

    #[test]
    fn permutations_reduce() {
        let (d, p) = reduce_permutation(&[2, 3, 4, 5], &[0, 2, 3, 1]);
        assert_eq!(
            (d.as_slice(), p.as_slice()),
            (&[2, 3, 20][..], &[0, 2, 1][..])
        );
        let (d, p) = reduce_permutation(&[2, 1, 4], &[2, 1, 0]);
        assert_eq!((d.as_slice(), p.as_slice()), (&[2, 4][..], &[1, 0][..]));
        let (d, p) = reduce_permutation(&[2, 1, 4], &[1, 0, 2]);
        assert_eq!((d.as_slice(), p.as_slice()), (&[8][..], &[0][..]));
    }

    #[test]
    fn reshape_is_zero_copy() {
        let x = tensor(DType::I32, &sample(DType::I32, 12), &[3, 4]);
        let mut a = OpAttrs::new();
        a.set_ints("shape", &[2, -1, 3]);
        let out = run(&stagecraft_ops::RESHAPE, &a, vec![x.clone()]).unwrap();
        assert!(out.buffer().ptr_eq(x.buffer()));
        assert_eq!(out.shape().dims(), &[2, 2, 3]);
        assert_eq!(values(&out), values(&x));
        for dtype in DType::ALL {
            a.set_ints("shape", &[]);
            let s = run(
                &stagecraft_ops::RESHAPE,
                &a,
                vec![tensor(dtype, &[1.0], &[1, 1])],
            )
            .unwrap();
            assert_eq!((s.shape().rank(), values(&s)), (0, vec![1.0]));
            a.set_ints("shape", &[5, 0]);
            let e = run(&stagecraft_ops::RESHAPE, &a, vec![tensor(dtype, &[], &[0])]).unwrap();
            assert_eq!(e.shape().dims(), &[5, 0]);
        }
    }

    fn check_broadcast(dtype: DType, dims: &[usize], target: &[usize]) {
        let x = sample(dtype, numel(dims));
        let mut a = OpAttrs::new();
        a.set_dims("shape", target);
        let out = run(
            &stagecraft_ops::BROADCAST_TO,
            &a,
            vec![tensor(dtype, &x, dims)],
        )
        .unwrap();
        assert_eq!(
            values(&out),
            reference::broadcast_to(&x, dims, target),
            "{dims:?} -> {target:?}"
        );
    }

    #[test]
    fn broadcast_to_matches_reference() {
        for dtype in DType::ALL {
            check_broadcast(dtype, &[], &[2, 3]);
            check_broadcast(dtype, &[3], &[2, 3]);
            check_broadcast(dtype, &[2, 1], &[2, 3]);
            check_broadcast(dtype, &[1, 3, 1], &[4, 3, 5]);
            check_broadcast(dtype, &[1], &[0, 4]);
            check_broadcast(dtype, &[], &[]);
        }
        check_broadcast(DType::F32, &[1, 300], &[200, 300]);
        check_broadcast(DType::F64, &[300, 1], &[300, 200]);
        check_broadcast(DType::I64, &[5, 1, 7], &[3, 5, 1000, 7]);
    }

    fn check_concat(dtype: DType, shapes: &[Vec<usize>], axis: usize) {
        let parts: Vec<(Vec<f64>, Vec<usize>)> = shapes
            .iter()
            .enumerate()
            .map(|(k, d)| (sample(dtype, numel(d) + k).split_off(k), d.clone()))
            .collect();
        let mut a = OpAttrs::new();
        a.set_int("axis", axis as i64);
        let inputs = parts.iter().map(|(v, d)| tensor(dtype, v, d)).collect();
        let out = run(&stagecraft_ops::CONCAT, &a, inputs).unwrap();
        let (want, want_dims) = reference::concat(&parts, axis);
        assert_eq!(out.shape().dims(), &want_dims[..]);
        assert_eq!(values(&out), want, "concat {shapes:?} on {axis}");
    }

    #[test]
    fn concat_matches_reference() {
        for dtype in DType::ALL {
            check_concat(dtype, &[vec![2, 1], vec![2, 0], vec![2, 4]], 1);
            check_concat(dtype, &[vec![1, 3], vec![2, 3]], 0);
            check_concat(dtype, &[vec![2, 2, 3], vec![2, 1, 3]], 1);
            check_concat(dtype, &[vec![0, 3], vec![0, 3]], 1);
            check_concat(dtype, &[vec![4]], 0);
        }
        check_concat(DType::F32, &[vec![200, 100], vec![200, 70]], 1);
        check_concat(DType::I32, &[vec![300, 100], vec![20, 100]], 0);
        check_concat(DType::F16, &[vec![40000, 1], vec![40000, 2]], 1);
        // One row (an image's channels), cut into chunks for the threads:
        // chunk edges fall inside inputs, on their borders and around
        // empty ones.
        let one_row = [
            vec![1, 20000, 2],
            vec![1, 0, 2],
            vec![1, 8192, 2],
            vec![1, 5, 2],
        ];
        check_concat(DType::F32, &one_row, 1);
        check_concat(DType::I64, &[vec![3, 16384], vec![3, 0], vec![3, 16384]], 1);
    }

    fn check_slice(dtype: DType, dims: &[usize], starts: &[i64], ends: &[i64], steps: &[i64]) {
        let x = sample(dtype, numel(dims));
        let mut a = OpAttrs::new();
        a.set_ints("starts", starts)
            .set_ints("ends", ends)
            .set_ints("steps", steps);
        let out = run(&stagecraft_ops::SLICE, &a, vec![tensor(dtype, &x, dims)]).unwrap();
        let slices =
            resolve_slice(&Attrs::new(&a, &stagecraft_ops::SLICE), &Shape::new(dims)).unwrap();
        let (want, want_dims) = reference::slice(&x, dims, &slices);
        assert_eq!(out.shape().dims(), &want_dims[..]);
        assert_eq!(
            values(&out),
            want,
            "slice {dims:?} {starts:?}..{ends:?} by {steps:?}"
        );
    }

    #[test]
    fn slice_matches_reference() {
        for dtype in DType::ALL {
            check_slice(dtype, &[6, 4], &[1, -2], &[100, 4], &[2, 1]);
            check_slice(dtype, &[6, 4], &[0, 0], &[6, 4], &[1, 3]);
            check_slice(dtype, &[], &[], &[], &[]);
            check_slice(dtype, &[3, 0], &[0, 0], &[3, 0], &[1, 1]);
            check_slice(dtype, &[5], &[4], &[2], &[1]);
        }
        check_slice(DType::F32, &[5, 7, 6], &[1, 0, 1], &[5, 7, 5], &[1, 1, 1]);
        check_slice(DType::F32, &[3, 4], &[1, 2], &[3, 4], &[1 << 62, 1 << 62]);
        check_slice(DType::F64, &[400, 300], &[3, 1], &[-3, -1], &[1, 1]);
        check_slice(DType::I64, &[400, 300], &[0, 0], &[400, 300], &[1, 2]);
    }

    #[test]
    fn full_slice_shares_the_buffer() {
        let x = tensor(DType::F32, &sample(DType::F32, 6), &[2, 3]);
        let mut a = OpAttrs::new();
        a.set_ints("starts", &[0, -3]).set_ints("ends", &[2, 9]);
        let out = run(&stagecraft_ops::SLICE, &a, vec![x.clone()]).unwrap();
        assert!(out.buffer().ptr_eq(x.buffer()));
    }

    fn check_gather(
        dtype: DType,
        idx_dtype: DType,
        dims: &[usize],
        idx: &[i64],
        idx_dims: &[usize],
        axis: usize,
    ) {
        let x = sample(dtype, numel(dims));
        let idx_f: Vec<f64> = idx.iter().map(|&i| i as f64).collect();
        let mut a = OpAttrs::new();
        a.set_int("axis", axis as i64);
        let got = run(
            &stagecraft_ops::GATHER,
            &a,
            vec![tensor(dtype, &x, dims), tensor(idx_dtype, &idx_f, idx_dims)],
        );
        match reference::gather(&x, dims, idx, idx_dims, axis) {
            Ok((want, want_dims)) => {
                let out = got.unwrap();
                assert_eq!(out.shape().dims(), &want_dims[..]);
                assert_eq!(values(&out), want, "gather {dims:?} by {idx:?} on {axis}");
            }
            Err(_) => assert_eq!(got.unwrap_err().kind(), ErrorKind::Index),
        }
    }

    #[test]
    fn gather_matches_reference() {
        for dtype in DType::ALL {
            for idx_dtype in [DType::I32, DType::I64] {
                check_gather(
                    dtype,
                    idx_dtype,
                    &[2, 5, 3],
                    &[4, 0, -1, -5, 2, 2, 1, 3],
                    &[4, 2],
                    1,
                );
                check_gather(dtype, idx_dtype, &[4], &[-2], &[], 0);
                check_gather(dtype, idx_dtype, &[4, 3], &[], &[0], 0);
                check_gather(dtype, idx_dtype, &[0, 3], &[2, 0], &[2], 1);
                check_gather(dtype, idx_dtype, &[3, 2], &[0, 1, 2], &[3], 0);
            }
        }
        let big: Vec<i64> = (0..500).map(|i| (i * 37 % 250) - 125).collect();
        check_gather(DType::F32, DType::I64, &[250, 200], &big, &[500], 0);
        check_gather(DType::F64, DType::I32, &[200, 250], &big, &[5, 100], 1);
    }

    #[test]
    fn gather_reports_bad_indices() {
        let x = tensor(DType::F32, &sample(DType::F32, 6), &[2, 3]);
        let mut a = OpAttrs::new();
        a.set_int("axis", 1);
        for (bad, idx_dtype) in [(3i64, DType::I64), (-4, DType::I32), (i64::MIN, DType::I64)] {
            let idx = tensor(idx_dtype, &[0.0, 1.0, 2.0, bad as f64], &[2, 2]);
            let err = run(&stagecraft_ops::GATHER, &a, vec![x.clone(), idx]).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Index);
            let message = err.to_string();
            assert!(message.contains(&format!("index {bad}")), "{message}");
            assert!(
                message.contains("[1, 1]") && message.contains("[-3, 3)"),
                "{message}"
            );
        }
        // No valid index along an empty axis.
        let empty = tensor(DType::F32, &[], &[2, 0]);
        let idx = tensor(DType::I32, &[0.0], &[1]);
        assert_eq!(
            run(&stagecraft_ops::GATHER, &a, vec![empty, idx])
                .unwrap_err()
                .kind(),
            ErrorKind::Index
        );
    }

    #[test]
    fn one_hot_matches_reference() {
        for dtype in DType::ALL {
            for idx_dtype in [DType::I32, DType::I64] {
                for (idx, idx_dims, depth) in [
                    (vec![0i64, 3, 1, 2, 2, 0], vec![2, 3], 4usize),
                    (vec![1], vec![], 3),
                    (vec![], vec![0], 5),
                    (vec![], vec![2, 0], 0),
                ] {
                    let mut a = OpAttrs::new();
                    a.set_int("depth", depth as i64).set_dtype("dtype", dtype);
                    let f: Vec<f64> = idx.iter().map(|&i| i as f64).collect();
                    let out = run(
                        &stagecraft_ops::ONE_HOT,
                        &a,
                        vec![tensor(idx_dtype, &f, &idx_dims)],
                    )
                    .unwrap();
                    let mut want_dims = idx_dims.clone();
                    want_dims.push(depth);
                    assert_eq!(out.shape().dims(), &want_dims[..]);
                    assert_eq!(values(&out), reference::one_hot(&idx, depth).unwrap());
                }
            }
        }
        let mut a = OpAttrs::new();
        a.set_int("depth", 3);
        for bad in [3.0, -1.0] {
            let idx = tensor(DType::I64, &[0.0, bad], &[2]);
            let err = run(&stagecraft_ops::ONE_HOT, &a, vec![idx]).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Index);
            assert!(
                err.to_string()
                    .contains(&format!("index {bad} at position [1]")),
                "{err}"
            );
            assert!(err.to_string().contains("[0, 3)"), "{err}");
        }
        a.set_int("depth", 0);
        assert_eq!(
            run(
                &stagecraft_ops::ONE_HOT,
                &a,
                vec![tensor(DType::I32, &[0.0], &[1])]
            )
            .unwrap_err()
            .kind(),
            ErrorKind::Index
        );
    }

    fn check_pad(dtype: DType, dims: &[usize], pads: &[usize], value: f64) {
        let x = sample(dtype, numel(dims));
        let mut a = OpAttrs::new();
        a.set_dims("pads", pads).set_float("value", value);
        let out = run(&stagecraft_ops::PAD, &a, vec![tensor(dtype, &x, dims)]).unwrap();
        let cast = Scalar::F64(value).cast(dtype).to_f64();
        let (want, want_dims) = reference::pad(&x, dims, pads, cast);
        assert_eq!(out.shape().dims(), &want_dims[..]);
        let got = values(&out);
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(&want) {
            assert!(
                g == w || (g.is_nan() && w.is_nan()),
                "pad {dims:?} by {pads:?}: {got:?} vs {want:?}"
            );
        }
    }

    #[test]
    fn pad_matches_reference() {
        for dtype in DType::ALL {
            check_pad(dtype, &[2, 3], &[1, 0, 2, 1], 7.5);
            check_pad(dtype, &[], &[], 1.0);
            check_pad(dtype, &[0, 2], &[1, 1, 0, 1], -2.0);
            check_pad(dtype, &[2, 0], &[0, 1, 1, 1], 3.0);
            check_pad(dtype, &[3], &[0, 0], 3.0);
            check_pad(dtype, &[2, 2, 2], &[0, 1, 1, 0, 1, 1], f64::NAN);
            check_pad(dtype, &[2], &[1, 1], f64::INFINITY);
        }
        check_pad(DType::F32, &[200, 150], &[3, 4, 5, 6], -1.0);
        check_pad(DType::I32, &[40000], &[1, 2], 9.0);
        check_pad(DType::BF16, &[50000, 1], &[0, 0, 2, 0], 0.5);
    }

    /// Leaves freed buffers of `count` f32 values filled with NaN where the
    /// next output of that size is taken from.
    fn poison_pool(count: usize) {
        let meta = TensorMetadata::new(DType::F32, [count]);
        let poisoned: Vec<DenseHostTensor> = (0..4)
            .map(|_| {
                let mut t = DenseHostTensor::for_overwrite(meta.clone()).unwrap();
                t.as_mut_slice::<f32>().unwrap().fill(f32::NAN);
                t
            })
            .collect();
        drop(poisoned);
    }

    /// The kernels that take their output without zeroing it write every
    /// element: run on buffers recycled full of NaN, they still match the
    /// reference (pad's fill and the gathered rows included).
    #[test]
    fn outputs_taken_without_zeroing_are_written_whole() {
        for (dims, out) in [(&[3usize, 5, 7][..], 105), (&[64, 48, 4], 12288)] {
            poison_pool(out);
            check_transpose(DType::F32, dims, &[2, 0, 1]);
        }
        poison_pool(2 * 5 * 6);
        check_slice(DType::F32, &[3, 5, 7], &[1, 0, 1], &[3, 5, 7], &[1, 1, 1]);
        poison_pool(62 * 38 * 4);
        check_slice(
            DType::F32,
            &[64, 48, 4],
            &[1, 2, 0],
            &[63, 40, 4],
            &[1, 1, 1],
        );
        poison_pool(12 * 384);
        check_pad(DType::F32, &[12, 128], &[0, 0, 128, 128], 0.0);
        poison_pool(6 * 40);
        check_broadcast(DType::F32, &[1, 40], &[6, 40]);
        poison_pool(4 * 30);
        check_gather(DType::F32, DType::I64, &[9, 30], &[8, 0, 3, 3], &[4], 0);
    }

    fn check_nonzero(dtype: DType, x: &[f64], dims: &[usize]) {
        let out = run(
            &stagecraft_ops::NONZERO,
            &OpAttrs::new(),
            vec![tensor(dtype, x, dims)],
        )
        .unwrap();
        let rounded = values(&tensor(dtype, x, dims));
        let (coords, count) = reference::nonzero(&rounded, dims);
        assert_eq!(out.shape().dims(), &[count, dims.len()]);
        assert_eq!(
            out.to_vec::<i64>().unwrap(),
            coords,
            "nonzero {dims:?} ({dtype})"
        );
    }

    #[test]
    fn nonzero_matches_reference() {
        for dtype in DType::ALL {
            check_nonzero(dtype, &[0.0, 2.0, 0.0, 1.0, 1.0, 0.0], &[2, 3]);
            check_nonzero(dtype, &[3.0], &[]);
            check_nonzero(dtype, &[0.0], &[]);
            check_nonzero(dtype, &[], &[3, 0]);
            check_nonzero(dtype, &[0.0, 0.0], &[2]);
            check_nonzero(dtype, &[-0.0, f64::NAN, 0.5, 0.0], &[2, 1, 2]);
        }
        let big: Vec<f64> = (0..70_000)
            .map(|i| ((i * 7919) % 13 == 0) as u8 as f64)
            .collect();
        check_nonzero(DType::F32, &big, &[7, 100, 100]);
        check_nonzero(DType::Bool, &big, &[70_000]);
    }

    // Property tests on random shapes, zero-size dimensions included.

    fn dims_strategy(max_rank: usize) -> impl Strategy<Value = Vec<usize>> {
        prop::collection::vec(0usize..5, 0..=max_rank)
    }

    fn dtype_strategy() -> impl Strategy<Value = DType> {
        prop::sample::select(DType::ALL.to_vec())
    }

    proptest! {
        #[test]
        fn prop_transpose(
            (dims, perm) in dims_strategy(5).prop_flat_map(|d| {
                let n = d.len();
                (Just(d), Just((0..n).collect::<Vec<usize>>()).prop_shuffle())
            }),
            dtype in dtype_strategy(),
        ) {
            check_transpose(dtype, &dims, &perm);
        }

        #[test]
        fn prop_broadcast_to(
            (target, keep, ones) in dims_strategy(4).prop_flat_map(|t| {
                let n = t.len();
                (Just(t), 0..=n, prop::collection::vec(any::<bool>(), n))
            }),
            dtype in dtype_strategy(),
        ) {
            let lead = target.len() - keep;
            let dims: Vec<usize> = (lead..target.len()).map(|i| if ones[i] { 1 } else { target[i] }).collect();
            check_broadcast(dtype, &dims, &target);
        }

        #[test]
        fn prop_concat(
            (dims, axis, sizes) in dims_strategy(4).prop_filter("rank >= 1", |d| !d.is_empty()).prop_flat_map(|d| {
                let n = d.len();
                (Just(d), 0..n, prop::collection::vec(0usize..4, 1..4))
            }),
            dtype in dtype_strategy(),
        ) {
            let shapes: Vec<Vec<usize>> = sizes.iter().map(|&s| { let mut d = dims.clone(); d[axis] = s; d }).collect();
            check_concat(dtype, &shapes, axis);
        }

        #[test]
        fn prop_slice(
            (dims, bounds) in dims_strategy(4).prop_flat_map(|d| {
                let n = d.len();
                (Just(d), prop::collection::vec((-6i64..6, -6i64..8, 1i64..4), n))
            }),
            dtype in dtype_strategy(),
        ) {
            let starts: Vec<i64> = bounds.iter().map(|b| b.0).collect();
            let ends: Vec<i64> = bounds.iter().map(|b| b.1).collect();
            let steps: Vec<i64> = bounds.iter().map(|b| b.2).collect();
            check_slice(dtype, &dims, &starts, &ends, &steps);
        }

        #[test]
        fn prop_gather(
            (dims, axis, idx_dims) in dims_strategy(3).prop_filter("rank >= 1", |d| !d.is_empty()).prop_flat_map(|d| {
                let n = d.len();
                (Just(d), 0..n, dims_strategy(2))
            }),
            seed in any::<u64>(),
            dtype in dtype_strategy(),
            wide in any::<bool>(),
        ) {
            // Mostly valid indices, sometimes one just out of range.
            let size = dims[axis] as i64;
            let idx: Vec<i64> = (0..numel(&idx_dims) as u64)
                .map(|k| {
                    let r = seed.wrapping_mul(k * 2 + 1).rotate_left(17) as i64;
                    if size == 0 || r % 17 == 0 { size } else { r.rem_euclid(2 * size) - size }
                })
                .collect();
            check_gather(dtype, if wide { DType::I64 } else { DType::I32 }, &dims, &idx, &idx_dims, axis);
        }

        #[test]
        fn prop_pad(
            (dims, pads) in dims_strategy(4).prop_flat_map(|d| {
                let n = d.len();
                (Just(d), prop::collection::vec(0usize..3, 2 * n))
            }),
            dtype in dtype_strategy(),
            value in -5.0f64..5.0,
        ) {
            check_pad(dtype, &dims, &pads, value);
        }
    }

    #[test]
    fn slices_resolve_like_the_reference() {
        let s = AxisSlice {
            start: 1,
            step: 2,
            len: 2,
        };
        let (out, dims) = reference::slice(&[0.0, 1.0, 2.0, 3.0, 4.0], &[5], &[s]);
        assert_eq!((out, dims), (vec![1.0, 3.0], vec![2]));
    }
}
