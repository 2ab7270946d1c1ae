//! CPU kernels of the element-indexing ops (gather-elements, scatter-add,
//! index-add) and the triangular mask `Trilu`.
//!
//! The two adds validate every index before touching the output, so an
//! out-of-range index is an `Index` error of the op, never a panic or a
//! half-written result. Each addition is rounded to the element type, in
//! row-major order of the source, so results do not depend on threads; integer
//! sums wrap.

use super::shape::{index_error, index_values};
use super::{first_dtype, take};
use crate::{with_any_type, Inputs, Kernel, KernelContext, KernelRegistry, PARALLEL_THRESHOLD};
use smallvec::smallvec;
use stagecraft_ops::scalar::Num;
use stagecraft_ops::Attrs;
use stagecraft_tensor::{
    element_count, normalize_axis, DenseHostTensor, Element, Error, Result, Shape, TensorMetadata,
};
use std::sync::Arc;

pub(crate) fn register(registry: &mut KernelRegistry) {
    registry.add(&stagecraft_ops::GATHER_ELEMENTS, gather_elements_factory);
    registry.add(&stagecraft_ops::SCATTER_ADD, scatter_add_factory);
    registry.add(&stagecraft_ops::INDEX_ADD, index_add_factory);
    registry.add(&stagecraft_ops::TRILU, trilu_factory);
}

/// Row-major strides of `dims`.
fn row_major(dims: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * dims[i + 1];
    }
    strides
}

/// Resolves every index against an axis of `size` (negative ones count
/// from the end), or names the first one out of range.
fn resolve_all(indices: &DenseHostTensor, size: usize, axis: usize) -> Result<Vec<usize>> {
    let signed = size as i64;
    index_values(indices)?
        .iter()
        .enumerate()
        .map(|(position, &i)| {
            if (-signed..signed).contains(&i) {
                Ok(if i < 0 { i + signed } else { i } as usize)
            } else {
                let what = format!("axis {axis} of size {size}");
                Err(index_error(
                    i,
                    position,
                    indices.shape(),
                    &what,
                    -signed,
                    signed,
                ))
            }
        })
        .collect()
}

/// Visits every element of an index tensor of `dims` in row-major order
/// with `(position, base)`: `base` is the offset in a tensor of
/// `x_strides` of the same multi-index with its coordinate on `axis` set
/// to 0. The index tensor may be smaller than `x` on every axis.
fn walk_positions(
    dims: &[usize],
    x_strides: &[usize],
    axis: usize,
    mut visit: impl FnMut(usize, usize),
) {
    let total = element_count(dims);
    let mut index = vec![0usize; dims.len()];
    let mut base = 0usize;
    for position in 0..total {
        visit(position, base);
        for d in (0..dims.len()).rev() {
            index[d] += 1;
            let step = if d == axis { 0 } else { x_strides[d] };
            base += step;
            if index[d] < dims[d] {
                break;
            }
            base -= step * dims[d];
            index[d] = 0;
        }
    }
}

/// Picks the adding kernel for a numeric dtype; other dtypes have none
/// (the shape rule already refuses them, so this is a second guard).
/// Additions are [`Num::add`]: each sum rounded to the type once, integers
/// wrapping.
macro_rules! with_accumulate_type {
    ($dtype:expr, $attrs:expr, $T:ident => $body:expr) => {
        $crate::with_numeric_type!($dtype, $T => $body, _ => {
            return Err(Error::dtype(format!(
                "{} has no CPU kernel for {}",
                $attrs.op().name,
                $dtype
            )))
        })
    };
}

/// `x` itself when no one else holds its buffer (the add then writes in
/// place), else a copy.
fn owned_copy(x: DenseHostTensor) -> DenseHostTensor {
    if x.is_unique() {
        x
    } else {
        x.deep_copy()
    }
}

// --------------------------------------------------------- gather_elements

fn gather_elements_factory(_: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    let f: fn(&DenseHostTensor, &DenseHostTensor, usize) -> Result<DenseHostTensor> =
        with_any_type!(first_dtype(inputs)?, T => gather_elements::<T>);
    Ok(Arc::new(move |inputs: Inputs, ctx: &KernelContext<'_>| {
        let [x, indices] = take(inputs)?;
        let axis = normalize_axis(ctx.attrs.int("axis")? as isize, x.shape().rank())?;
        Ok(smallvec![f(&x, &indices, axis)?])
    }))
}

fn gather_elements<T: Element>(
    x: &DenseHostTensor,
    indices: &DenseHostTensor,
    axis: usize,
) -> Result<DenseHostTensor> {
    let dims = x.shape().dims();
    let picks = resolve_all(indices, dims[axis], axis)?;
    let mut out = DenseHostTensor::zeros(TensorMetadata::new(x.dtype(), indices.shape().clone()))?;
    if out.numel() == 0 {
        return Ok(out);
    }
    let strides = row_major(dims);
    let src = x.as_slice::<T>()?;
    let dst = out.as_mut_slice::<T>()?;
    walk_positions(indices.shape().dims(), &strides, axis, |position, base| {
        dst[position] = src[base + picks[position] * strides[axis]];
    });
    Ok(out)
}

// ------------------------------------------------------------- scatter_add

fn scatter_add_factory(attrs: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    let f: fn(
        DenseHostTensor,
        &DenseHostTensor,
        &DenseHostTensor,
        usize,
    ) -> Result<DenseHostTensor> =
        with_accumulate_type!(first_dtype(inputs)?, attrs, T => scatter_add::<T>);
    Ok(Arc::new(move |inputs: Inputs, ctx: &KernelContext<'_>| {
        let [x, indices, src] = take(inputs)?;
        let axis = normalize_axis(ctx.attrs.int("axis")? as isize, x.shape().rank())?;
        Ok(smallvec![f(x, &indices, &src, axis)?])
    }))
}

fn scatter_add<T: Element + Num>(
    x: DenseHostTensor,
    indices: &DenseHostTensor,
    src: &DenseHostTensor,
    axis: usize,
) -> Result<DenseHostTensor> {
    let dims: Shape = x.shape().clone();
    let picks = resolve_all(indices, dims[axis], axis)?;
    let mut out = owned_copy(x);
    if picks.is_empty() {
        return Ok(out);
    }
    let strides = row_major(dims.dims());
    let values = src.as_slice::<T>()?;
    let dst = out.as_mut_slice::<T>()?;
    walk_positions(indices.shape().dims(), &strides, axis, |position, base| {
        let target = base + picks[position] * strides[axis];
        dst[target] = dst[target].add(values[position]);
    });
    Ok(out)
}

// --------------------------------------------------------------- index_add

fn index_add_factory(attrs: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    let f: fn(
        DenseHostTensor,
        &DenseHostTensor,
        &DenseHostTensor,
        usize,
    ) -> Result<DenseHostTensor> =
        with_accumulate_type!(first_dtype(inputs)?, attrs, T => index_add::<T>);
    Ok(Arc::new(move |inputs: Inputs, ctx: &KernelContext<'_>| {
        let [x, indices, src] = take(inputs)?;
        let axis = normalize_axis(ctx.attrs.int("axis")? as isize, x.shape().rank())?;
        Ok(smallvec![f(x, &indices, &src, axis)?])
    }))
}

/// `x` viewed as `[outer, size, inner]` and `src` as `[outer, count,
/// inner]`: row `(o, k)` of `src` adds into row `(o, picks[k])`. Each row
/// is touched once per index, O(indices × row).
fn index_add<T: Element + Num>(
    x: DenseHostTensor,
    indices: &DenseHostTensor,
    src: &DenseHostTensor,
    axis: usize,
) -> Result<DenseHostTensor> {
    let dims = x.shape().dims();
    let size = dims[axis];
    let inner = element_count(&dims[axis + 1..]);
    let picks = resolve_all(indices, size, axis)?;
    let mut out = owned_copy(x);
    if picks.is_empty() || out.numel() == 0 {
        return Ok(out);
    }
    let count = picks.len();
    let values = src.as_slice::<T>()?;
    let dst = out.as_mut_slice::<T>()?;
    let add_block = |block: &mut [T], first_outer: usize| {
        for (b, table) in block.chunks_exact_mut(size * inner).enumerate() {
            let o = first_outer + b;
            for (k, &pick) in picks.iter().enumerate() {
                let from = (o * count + k) * inner;
                let row = &mut table[pick * inner..(pick + 1) * inner];
                for (d, &v) in row.iter_mut().zip(&values[from..from + inner]) {
                    *d = d.add(v);
                }
            }
        }
    };
    // Different outer indices write disjoint tables: those split across
    // threads; one table (the usual embedding gradient) runs in order.
    let table = size * inner;
    let outer = dst.len() / table;
    if outer > 1 && count * inner * outer > PARALLEL_THRESHOLD {
        let per_task = (PARALLEL_THRESHOLD / (count * inner).max(1)).max(1);
        crate::pool::for_each_chunk(dst, per_task * table, |c, block| {
            add_block(block, c * per_task)
        });
    } else {
        add_block(dst, 0);
    }
    Ok(out)
}

// ------------------------------------------------------------------- trilu

fn trilu_factory(_: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    let f: fn(&DenseHostTensor, bool, i64) -> Result<DenseHostTensor> =
        with_any_type!(first_dtype(inputs)?, T => trilu::<T>);
    Ok(Arc::new(move |inputs: Inputs, ctx: &KernelContext<'_>| {
        let [x] = take(inputs)?;
        let (upper, k) = (ctx.attrs.bool("upper")?, ctx.attrs.int("k")?);
        Ok(smallvec![f(&x, upper, k)?])
    }))
}

/// The kept columns `[from, to)` of row `i` in a matrix of `cols` columns.
fn kept_columns(i: usize, cols: usize, upper: bool, k: i64) -> (usize, usize) {
    // In i128: `i + k` may leave the range of both usize and i64.
    let edge = i as i128 + k as i128;
    let clamp = |v: i128| v.clamp(0, cols as i128) as usize;
    if upper {
        (clamp(edge), cols)
    } else {
        (0, clamp(edge + 1))
    }
}

fn trilu<T: Element>(x: &DenseHostTensor, upper: bool, k: i64) -> Result<DenseHostTensor> {
    let dims = x.shape().dims();
    let (rows, cols) = (dims[dims.len() - 2], dims[dims.len() - 1]);
    let mut out = DenseHostTensor::zeros(x.metadata().clone())?;
    if out.numel() == 0 {
        return Ok(out);
    }
    let src = x.as_slice::<T>()?;
    // Each output row copies its kept run; the rest stays zero.
    let fill = |chunk: &mut [T], first_row: usize| {
        for (r, row) in chunk.chunks_exact_mut(cols).enumerate() {
            let flat_row = first_row + r;
            let (from, to) = kept_columns(flat_row % rows, cols, upper, k);
            let at = flat_row * cols;
            row[from..to].copy_from_slice(&src[at + from..at + to]);
        }
    };
    let dst = out.as_mut_slice::<T>()?;
    if dst.len() > PARALLEL_THRESHOLD {
        let rows_per_task = (PARALLEL_THRESHOLD / cols).max(1);
        crate::pool::for_each_chunk(dst, rows_per_task * cols, |c, chunk| {
            fill(chunk, c * rows_per_task)
        });
    } else {
        fill(dst, 0);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::indexing as reference;
    use proptest::prelude::*;
    use stagecraft_ops::{OpAttrs, OpDef};
    use stagecraft_tensor::DType;
    use stagecraft_tensor::{ErrorKind, Scalar};

    /// Runs `def` through the registry as the runtime would, checking the
    /// output against the promised metadata.
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
        assert_eq!(out[0].metadata(), &out_meta[0], "{} metadata", def.name);
        Ok(out.remove(0))
    }

    fn tensor(dtype: DType, values: &[f64], dims: &[usize]) -> DenseHostTensor {
        let build = || -> Result<DenseHostTensor> {
            with_any_type!(dtype, T => {
                let v: Vec<T> = values.iter().map(|&x| T::from_scalar(Scalar::F64(x))).collect();
                DenseHostTensor::from_slice(&v, dims)
            })
        };
        build().unwrap()
    }

    fn indices(dtype: DType, values: &[i64], dims: &[usize]) -> DenseHostTensor {
        match dtype {
            DType::I32 => {
                let v: Vec<i32> = values.iter().map(|&i| i as i32).collect();
                DenseHostTensor::from_slice(&v, dims).unwrap()
            }
            _ => DenseHostTensor::from_slice(values, dims).unwrap(),
        }
    }

    fn values(t: &DenseHostTensor) -> Vec<f64> {
        (0..t.numel())
            .map(|i| t.get_scalar(i).unwrap().to_f64())
            .collect()
    }

    /// Values in steps of 0.25 (exact in every float dtype, integers for
    /// the integer ones after the cast), so sums of a few stay exact or
    /// round the same way in the kernel and the reference.
    fn sample(dtype: DType, n: usize, seed: usize) -> Vec<f64> {
        (0..n)
            .map(|i| {
                let v = (i.wrapping_mul(7).wrapping_add(seed.wrapping_mul(13)) % 23) as f64 - 11.0;
                match dtype {
                    DType::Bool => (v > 0.0) as u8 as f64,
                    // Unsigned: shifted to stay in range, so the cast is exact.
                    d if d.is_unsigned() => v + 11.0,
                    d if d.is_float() => v * 0.25,
                    _ => v,
                }
            })
            .collect()
    }

    /// Rounds an f64 to `dtype`, as the kernels round each sum.
    fn rounder(dtype: DType) -> impl Fn(f64) -> f64 {
        move |v| Scalar::F64(v).cast(dtype).to_f64()
    }

    fn axis_attrs(axis: i64) -> OpAttrs {
        let mut attrs = OpAttrs::new();
        attrs.set_int("axis", axis);
        attrs
    }

    /// Index values mostly in range (negative ones too) and, when `wild`,
    /// sometimes one past either end.
    fn index_sample(n: usize, size: usize, seed: u64, wild: bool) -> Vec<i64> {
        let size = size as i64;
        (0..n as u64)
            .map(|k| {
                let r = seed.wrapping_mul(2 * k + 1).rotate_left(13) as i64;
                if size == 0 || (wild && r % 11 == 0) {
                    if r % 2 == 0 {
                        size
                    } else {
                        -size - 1
                    }
                } else {
                    r.rem_euclid(2 * size) - size
                }
            })
            .collect()
    }

    fn assert_same(what: &str, got: Result<DenseHostTensor>, want: Result<Vec<f64>>) {
        match (got, want) {
            (Ok(g), Ok(w)) => {
                let g = values(&g);
                assert_eq!(g.len(), w.len(), "{what}");
                for (a, b) in g.iter().zip(&w) {
                    assert!(
                        a == b || (a.is_nan() && b.is_nan()),
                        "{what}: {g:?} vs {w:?}"
                    );
                }
            }
            (Err(e), Err(_)) => assert_eq!(e.kind(), ErrorKind::Index, "{what}: {e}"),
            (g, w) => panic!(
                "{what}: kernel {:?}, reference {:?}",
                g.map(|t| values(&t)),
                w
            ),
        }
    }

    fn check_gather_elements(
        dtype: DType,
        dims: &[usize],
        index_dims: &[usize],
        axis: usize,
        seed: u64,
        wild: bool,
    ) {
        let x = sample(dtype, element_count(dims), seed as usize);
        let idx = index_sample(element_count(index_dims), dims[axis], seed, wild);
        for index_dtype in [DType::I32, DType::I64] {
            let got = run(
                &stagecraft_ops::GATHER_ELEMENTS,
                &axis_attrs(axis as i64),
                vec![
                    tensor(dtype, &x, dims),
                    indices(index_dtype, &idx, index_dims),
                ],
            );
            let want = reference::gather_elements(&x, dims, &idx, index_dims, axis);
            assert_same(
                &format!("gather_elements {dims:?} by {index_dims:?} on {axis}"),
                got,
                want,
            );
        }
    }

    fn check_scatter_add(
        dtype: DType,
        dims: &[usize],
        index_dims: &[usize],
        axis: usize,
        seed: u64,
        wild: bool,
    ) {
        let x = sample(dtype, element_count(dims), seed as usize);
        let src = sample(dtype, element_count(index_dims), seed as usize + 5);
        let idx = index_sample(element_count(index_dims), dims[axis], seed, wild);
        let got = run(
            &stagecraft_ops::SCATTER_ADD,
            &axis_attrs(axis as i64),
            vec![
                tensor(dtype, &x, dims),
                indices(DType::I64, &idx, index_dims),
                tensor(dtype, &src, index_dims),
            ],
        );
        let want = reference::scatter_add(&x, dims, &idx, index_dims, &src, axis, &rounder(dtype));
        assert_same(
            &format!("scatter_add {dims:?} by {index_dims:?} on {axis} ({dtype})"),
            got,
            want,
        );
    }

    fn check_index_add(
        dtype: DType,
        dims: &[usize],
        count: usize,
        axis: usize,
        seed: u64,
        wild: bool,
    ) {
        let mut src_dims = dims.to_vec();
        src_dims[axis] = count;
        let x = sample(dtype, element_count(dims), seed as usize);
        let src = sample(dtype, element_count(&src_dims), seed as usize + 3);
        let idx = index_sample(count, dims[axis], seed, wild);
        let got = run(
            &stagecraft_ops::INDEX_ADD,
            &axis_attrs(axis as i64),
            vec![
                tensor(dtype, &x, dims),
                indices(DType::I32, &idx, &[count]),
                tensor(dtype, &src, &src_dims),
            ],
        );
        let want = reference::index_add(&x, dims, &idx, &src, axis, &rounder(dtype));
        assert_same(
            &format!("index_add {dims:?} with {count} on {axis} ({dtype})"),
            got,
            want,
        );
    }

    fn check_trilu(dtype: DType, dims: &[usize], upper: bool, k: i64) {
        let x = sample(dtype, element_count(dims), 1);
        let mut attrs = OpAttrs::new();
        attrs.set_bool("upper", upper).set_int("k", k);
        let got = run(
            &stagecraft_ops::TRILU,
            &attrs,
            vec![tensor(dtype, &x, dims)],
        );
        let want = reference::trilu(&x, dims, upper, k);
        assert_same(
            &format!("trilu {dims:?} upper {upper} k {k}"),
            got,
            Ok(want),
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
            check_gather_elements(dtype, &[3, 4], &[5, 2], 0, 1, false);
            check_scatter_add(dtype, &[3, 4], &[5, 2], 0, 2, false);
            check_scatter_add(dtype, &[2, 3, 4], &[2, 6, 3], 1, 3, false);
            check_index_add(dtype, &[4, 3], 6, 0, 4, false);
            check_index_add(dtype, &[2, 4, 3], 5, 1, 5, false);
            check_trilu(dtype, &[3, 4], false, 0);
        }
        check_gather_elements(DType::Bool, &[2, 2], &[2, 2], 1, 6, false);
        check_trilu(DType::Bool, &[2, 3, 3], true, -1);
        check_trilu(DType::F32, &[2, 5, 3], true, i64::MAX);
        check_trilu(DType::F32, &[2, 5, 3], false, i64::MIN);
        // Above the parallel thresholds: many tables for index-add, many
        // rows for trilu.
        check_index_add(DType::F32, &[300, 8, 20], 12, 1, 7, false);
        check_trilu(DType::F64, &[40, 30, 40], false, 2);
    }

    #[test]
    fn out_of_range_indices_are_index_errors() {
        for dtype in [DType::F32, DType::I64] {
            check_gather_elements(dtype, &[3, 4], &[2, 4], 0, 9, true);
            check_scatter_add(dtype, &[3, 4], &[3, 4], 1, 11, true);
            check_index_add(dtype, &[3, 4], 9, 0, 13, true);
        }
        // Any index into an empty axis is out of range.
        check_index_add(DType::F32, &[0, 2], 1, 0, 1, false);
        let x = tensor(DType::F32, &[1.0; 6], &[2, 3]);
        let err = run(
            &stagecraft_ops::SCATTER_ADD,
            &axis_attrs(1),
            vec![
                x.clone(),
                indices(DType::I64, &[3], &[1, 1]),
                tensor(DType::F32, &[1.0], &[1, 1]),
            ],
        )
        .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Index);
        assert!(err.to_string().contains("index 3"), "{err}");
    }

    /// A sole owner's buffer is added into in place; a shared one is not
    /// touched.
    #[test]
    fn adds_write_in_place_only_into_unshared_buffers() {
        let x = tensor(DType::F32, &[1.0, 2.0], &[2]);
        let ptr = x.buffer().bytes().as_ptr();
        let add = |x: DenseHostTensor| {
            run(
                &stagecraft_ops::INDEX_ADD,
                &axis_attrs(0),
                vec![
                    x,
                    indices(DType::I64, &[1], &[1]),
                    tensor(DType::F32, &[5.0], &[1]),
                ],
            )
            .unwrap()
        };
        let shared = add(x.clone());
        assert_eq!(values(&x), vec![1.0, 2.0]);
        assert_eq!(values(&shared), vec![1.0, 7.0]);
        let unshared = add(x);
        assert_eq!(unshared.buffer().bytes().as_ptr(), ptr);
    }

    fn dtype_strategy() -> impl Strategy<Value = DType> {
        prop::sample::select(vec![
            DType::F16,
            DType::BF16,
            DType::F32,
            DType::F64,
            DType::I32,
            DType::I64,
        ])
    }

    /// `x` dims (rank 1 to 3, zero sizes included), an axis, and index dims
    /// no larger than `x` off the axis.
    fn gather_shapes() -> impl Strategy<Value = (Vec<usize>, usize, Vec<usize>)> {
        prop::collection::vec(0usize..4, 1..4).prop_flat_map(|dims| {
            let rank = dims.len();
            let limits: Vec<usize> = dims.clone();
            (
                Just(dims),
                0..rank,
                limits.into_iter().map(|d| 0..=d).collect::<Vec<_>>(),
                0usize..6,
            )
                .prop_map(|(dims, axis, mut index_dims, along)| {
                    index_dims[axis] = along;
                    (dims, axis, index_dims)
                })
        })
    }

    proptest! {
        #[test]
        fn prop_gather_elements((dims, axis, index_dims) in gather_shapes(), seed in any::<u64>(), wild in any::<bool>()) {
            check_gather_elements(DType::F32, &dims, &index_dims, axis, seed, wild);
        }

        #[test]
        fn prop_scatter_add((dims, axis, index_dims) in gather_shapes(), seed in any::<u64>(), wild in any::<bool>(), dtype in dtype_strategy()) {
            check_scatter_add(dtype, &dims, &index_dims, axis, seed, wild);
        }

        #[test]
        fn prop_index_add(dims in prop::collection::vec(0usize..4, 1..4), axis in 0usize..3, count in 0usize..6, seed in any::<u64>(), wild in any::<bool>(), dtype in dtype_strategy()) {
            let axis = axis % dims.len();
            check_index_add(dtype, &dims, count, axis, seed, wild);
        }

        #[test]
        fn prop_trilu(dims in prop::collection::vec(0usize..5, 2..5), upper in any::<bool>(), k in -6i64..6) {
            check_trilu(DType::F32, &dims, upper, k);
        }
    }
}
