//! Sorting along an axis: `Sort`, `TopK`, and the pair of index ops their
//! gradients are made of (`TakeAlongAxis` and its adjoint
//! `TakeAlongAxisGrad`).
//!
//! The order every op here uses: ascending numbers with NaN after every
//! number (so a descending sort puts NaN first, as NumPy and PyTorch do),
//! `-0.0` equal to `0.0`, and equal keys in their original order (stable).
//! The indices say where each output element came from, so the gradient of
//! the values is the incoming gradient put back at those indices: an
//! O(n) scatter, never a one-hot product.

use super::{one, require_float, require_int, require_numeric};
use crate::attrs::AttrKind;
use crate::grad::{GradBuilder, GradContext, InputGrads, G};
use crate::op::*;
use smallvec::smallvec;
use stagecraft_tensor::{normalize_axis, DType, Error, Result, Shape, TensorMetadata};

/// `Sort(x) -> (values, indices)`: `x` sorted along `axis` (ascending
/// unless `descending`), stable, with the i64 position along `axis` each
/// value came from.
pub static SORT: OpDef = OpDef {
    name: "Sort",
    inputs: &["x"],
    variadic: false,
    outputs: 2,
    attrs: &[
        AttrSpec::optional("axis", AttrKind::Int, AttrDefault::Int(-1)),
        AttrSpec::optional("descending", AttrKind::Bool, AttrDefault::Bool(false)),
    ],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: sort_meta,
    grad: Some(sort_grad),
};

/// `TopK(x) -> (values, indices)`: the `k` largest (or, with `largest =
/// false`, smallest) entries along `axis`, with their i64 positions. Ties
/// go to the earlier position, so the result is the first `k` entries of
/// the stable [`SORT`] in that direction; with `sorted = false` the `k`
/// entries keep the order they have in `x` instead.
pub static TOP_K: OpDef = OpDef {
    name: "TopK",
    inputs: &["x"],
    variadic: false,
    outputs: 2,
    attrs: &[
        AttrSpec::required("k", AttrKind::Int),
        AttrSpec::optional("axis", AttrKind::Int, AttrDefault::Int(-1)),
        AttrSpec::optional("largest", AttrKind::Bool, AttrDefault::Bool(true)),
        AttrSpec::optional("sorted", AttrKind::Bool, AttrDefault::Bool(true)),
    ],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: top_k_meta,
    grad: Some(sort_grad),
};

/// `TakeAlongAxis(x, indices)`: `out[.., j, ..] = x[.., indices[.., j, ..],
/// ..]` along `axis` (NumPy's `take_along_axis`). `indices` (i32 or i64)
/// has `x`'s rank and its dimensions except along `axis`; negative indices
/// count from the end, and one out of range is an error of the kernel.
pub static TAKE_ALONG_AXIS: OpDef = OpDef {
    name: "TakeAlongAxis",
    inputs: &["x", "indices"],
    variadic: false,
    outputs: 1,
    attrs: &[AttrSpec::required("axis", AttrKind::Int)],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: take_along_axis_meta,
    grad: Some(take_along_axis_grad),
};

/// `TakeAlongAxisGrad(g, indices)`: the adjoint of [`TAKE_ALONG_AXIS`],
/// a tensor of `g`'s shape with `size` entries along `axis`, zero except
/// that `g[.., j, ..]` is added at `[.., indices[.., j, ..], ..]`
/// (repeated indices add up). The gradient of `Sort` and `TopK`.
pub static TAKE_ALONG_AXIS_GRAD: OpDef = OpDef {
    name: "TakeAlongAxisGrad",
    inputs: &["g", "indices"],
    variadic: false,
    outputs: 1,
    attrs: &[
        AttrSpec::required("axis", AttrKind::Int),
        AttrSpec::required("size", AttrKind::Int),
    ],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: take_along_axis_grad_meta,
    grad: Some(take_along_axis_grad_grad),
};

fn sort_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let x = &inputs[0];
    require_numeric("x", x)?;
    normalize_axis(attrs.int("axis")? as isize, x.shape.rank())?;
    Ok(smallvec![
        x.clone(),
        TensorMetadata::new(DType::I64, x.shape.clone())
    ])
}

fn top_k_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let x = &inputs[0];
    require_numeric("x", x)?;
    let axis = normalize_axis(attrs.int("axis")? as isize, x.shape.rank())?;
    let k = attrs.int("k")?;
    let n = x.shape[axis];
    let k = usize::try_from(k).ok().filter(|&k| k <= n).ok_or_else(|| {
        Error::shape(format!(
            "k = {k} must be between 0 and the length {n} of axis {axis} of {x}"
        ))
    })?;
    let mut shape = x.shape.clone();
    shape.dims_mut()[axis] = k;
    Ok(smallvec![
        TensorMetadata::new(x.dtype, shape.clone()),
        TensorMetadata::new(DType::I64, shape)
    ])
}

/// Checks that `indices` fits `x` for an op along `axis` (same rank, same
/// dimensions except along `axis`) and returns the resolved axis.
fn check_along_axis(
    x: &TensorMetadata,
    indices: &TensorMetadata,
    attrs: &Attrs<'_>,
) -> Result<usize> {
    require_int("indices", indices)?;
    let axis = normalize_axis(attrs.int("axis")? as isize, x.shape.rank())?;
    let fits = indices.shape.rank() == x.shape.rank()
        && (0..x.shape.rank()).all(|i| i == axis || indices.shape[i] == x.shape[i]);
    if !fits {
        return Err(Error::shape(format!(
            "indices {} must have the rank of {} and its dimensions except along axis {axis}",
            indices.shape, x.shape
        )));
    }
    Ok(axis)
}

fn take_along_axis_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let (x, indices) = (&inputs[0], &inputs[1]);
    let axis = check_along_axis(x, indices, attrs)?;
    if x.shape[axis] == 0 && indices.shape[axis] > 0 {
        return Err(Error::shape(format!(
            "cannot take entries along the empty axis {axis} of {x}"
        )));
    }
    one(TensorMetadata::new(x.dtype, indices.shape.clone()))
}

fn take_along_axis_grad_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let (g, indices) = (&inputs[0], &inputs[1]);
    require_float("g", g)?;
    let axis = check_along_axis(g, indices, attrs)?;
    if indices.shape != g.shape {
        return Err(Error::shape(format!(
            "indices {} must have the shape of the gradient {}",
            indices.shape, g.shape
        )));
    }
    let size = attrs.int("size")?;
    let size = usize::try_from(size)
        .map_err(|_| Error::attribute(format!("size must be non-negative, got {size}")))?;
    let mut shape: Shape = g.shape.clone();
    shape.dims_mut()[axis] = size;
    shape.checked_numel()?;
    one(TensorMetadata::new(g.dtype, shape))
}

// ---------------------------------------------------------------------------
// Gradients.

/// Puts `g` back at `indices` along `axis` in a tensor `size` long there.
fn put_back(b: &mut dyn GradBuilder, g: G, indices: G, axis: usize, size: usize) -> Result<G> {
    let mut attrs = crate::OpAttrs::new();
    attrs
        .set_int("axis", axis as i64)
        .set_int("size", size as i64);
    b.op(&TAKE_ALONG_AXIS_GRAD, &[g, indices], &attrs)
}

/// The values are `x` taken along the axis at the indices: their gradient
/// goes back to where each value came from (for `TopK`, the entries not
/// selected get zero). The indices have no gradient.
fn sort_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let x = b.meta(ctx.inputs[0]);
    let Some(g) = ctx.grads.first().copied().flatten() else {
        return Ok(smallvec![None]);
    };
    if !x.dtype.is_float() {
        return Ok(smallvec![None]);
    }
    let axis = normalize_axis(ctx.attrs.int("axis")? as isize, x.shape.rank())?;
    let dx = put_back(b, g, ctx.outputs[1], axis, x.shape[axis])?;
    crate::grad::only(dx)
}

fn take_along_axis_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let (x, indices, g) = (ctx.inputs[0], ctx.inputs[1], ctx.grad()?);
    let xm = b.meta(x);
    if !xm.dtype.is_float() {
        return Ok(smallvec![None, None]);
    }
    let axis = normalize_axis(ctx.attrs.int("axis")? as isize, xm.shape.rank())?;
    let dx = put_back(b, g, indices, axis, xm.shape[axis])?;
    Ok(smallvec![Some(dx), None])
}

/// `TakeAlongAxisGrad` is linear in `g` with adjoint `TakeAlongAxis`.
fn take_along_axis_grad_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let (indices, gg) = (ctx.inputs[1], ctx.grad()?);
    let mut attrs = crate::OpAttrs::new();
    attrs.set_int("axis", ctx.attrs.int("axis")?);
    let dg = b.op(&TAKE_ALONG_AXIS, &[gg, indices], &attrs)?;
    Ok(smallvec![Some(dg), None])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::OpAttrs;
    use proptest::prelude::*;

    fn m(dtype: DType, dims: &[usize]) -> TensorMetadata {
        TensorMetadata::new(dtype, dims)
    }

    #[test]
    fn sort_keeps_the_shape_and_adds_i64_indices() {
        let mut a = OpAttrs::new();
        a.set_int("axis", 0).set_bool("descending", true);
        let out = SORT.infer(&[m(DType::I32, &[3, 4])], &a).unwrap();
        assert_eq!(
            out.as_slice(),
            &[m(DType::I32, &[3, 4]), m(DType::I64, &[3, 4])]
        );
        assert!(SORT.infer(&[m(DType::F32, &[0, 2])], &a).is_ok());
        a.set_int("axis", 2);
        assert!(SORT.infer(&[m(DType::F32, &[3, 4])], &a).is_err());
        assert!(SORT.infer(&[m(DType::F32, &[])], &OpAttrs::new()).is_err());
        assert!(SORT
            .infer(&[m(DType::Bool, &[3])], &OpAttrs::new())
            .is_err());
    }

    #[test]
    fn top_k_checks_k_against_the_axis() {
        let mut a = OpAttrs::new();
        a.set_int("k", 2).set_int("axis", -2);
        let out = TOP_K.infer(&[m(DType::F64, &[5, 3])], &a).unwrap();
        assert_eq!(
            out.as_slice(),
            &[m(DType::F64, &[2, 3]), m(DType::I64, &[2, 3])]
        );
        a.set_int("k", 0);
        assert_eq!(
            TOP_K.infer(&[m(DType::F64, &[5, 3])], &a).unwrap()[0],
            m(DType::F64, &[0, 3])
        );
        a.set_int("k", 6);
        let err = TOP_K.infer(&[m(DType::F64, &[5, 3])], &a).unwrap_err();
        assert!(err.to_string().contains("k = 6"), "{err}");
        a.set_int("k", -1);
        assert!(TOP_K.infer(&[m(DType::F64, &[5, 3])], &a).is_err());
        assert!(TOP_K
            .infer(&[m(DType::F64, &[5, 3])], &OpAttrs::new())
            .is_err());
    }

    #[test]
    fn along_axis_ops_check_indices() {
        let mut a = OpAttrs::new();
        a.set_int("axis", 1);
        assert_eq!(
            TAKE_ALONG_AXIS
                .infer(&[m(DType::F32, &[2, 5]), m(DType::I32, &[2, 3])], &a)
                .unwrap()[0],
            m(DType::F32, &[2, 3])
        );
        for bad in [
            [m(DType::F32, &[2, 5]), m(DType::F32, &[2, 3])],
            [m(DType::F32, &[2, 5]), m(DType::I64, &[3, 3])],
            [m(DType::F32, &[2, 5]), m(DType::I64, &[2, 3, 1])],
            [m(DType::F32, &[2, 0]), m(DType::I64, &[2, 1])],
        ] {
            assert!(TAKE_ALONG_AXIS.infer(&bad, &a).is_err(), "{bad:?}");
        }
        a.set_int("size", 7);
        assert_eq!(
            TAKE_ALONG_AXIS_GRAD
                .infer(&[m(DType::F32, &[2, 3]), m(DType::I64, &[2, 3])], &a)
                .unwrap()[0],
            m(DType::F32, &[2, 7])
        );
        assert!(TAKE_ALONG_AXIS_GRAD
            .infer(&[m(DType::I32, &[2, 3]), m(DType::I64, &[2, 3])], &a)
            .is_err());
        a.set_int("size", -1);
        assert!(TAKE_ALONG_AXIS_GRAD
            .infer(&[m(DType::F32, &[2, 3]), m(DType::I64, &[2, 3])], &a)
            .is_err());
    }

    proptest! {
        /// Sort keeps any shape; TopK replaces the axis by `k` exactly when
        /// `0 ≤ k ≤ n` and fails otherwise; TakeAlongAxisGrad of TopK's
        /// indices has the input's shape again.
        #[test]
        fn shape_rules(
            dims in prop::collection::vec(0usize..5, 1..4),
            axis in -4i64..4,
            k in -1i64..6,
        ) {
            let rank = dims.len() as i64;
            let x = m(DType::F32, &dims);
            let mut a = OpAttrs::new();
            a.set_int("axis", axis);
            let valid_axis = (-rank..rank).contains(&axis);
            let sorted = SORT.infer(std::slice::from_ref(&x), &a);
            prop_assert_eq!(sorted.is_ok(), valid_axis);
            a.set_int("k", k);
            let top = TOP_K.infer(std::slice::from_ref(&x), &a);
            if !valid_axis {
                prop_assert!(top.is_err());
                return Ok(());
            }
            let ax = ((axis + rank) % rank) as usize;
            if k < 0 || k as usize > dims[ax] {
                prop_assert!(top.is_err());
                return Ok(());
            }
            let top = top.unwrap();
            let mut want = dims.clone();
            want[ax] = k as usize;
            prop_assert_eq!(top[0].shape.dims(), want.as_slice());
            prop_assert_eq!(top[1].dtype, DType::I64);
            let mut g = OpAttrs::new();
            g.set_int("axis", axis).set_int("size", dims[ax] as i64);
            let back = TAKE_ALONG_AXIS_GRAD.infer(&[top[0].clone(), top[1].clone()], &g).unwrap();
            prop_assert_eq!(&back[0], &x);
        }
    }
}
