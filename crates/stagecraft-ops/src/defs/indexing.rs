//! Ops that read, accumulate or mask elements by position:
//! gather-elements (`take_along_axis`), scatter-add, index-add and the
//! triangular mask `Trilu`.
//!
//! Scatter-add and index-add are the adjoints of the two gathers, so each
//! pair's gradients are each other: the gradient of `Gather` costs
//! O(indices × row) through `IndexAdd`, never a one-hot product over the
//! whole table.

use super::{one, require_int, require_numeric, require_same_dtype};
use crate::attrs::AttrKind;
use crate::grad::{GradBuilder, GradContext, InputGrads, G};
use crate::op::*;
use smallvec::smallvec;
use stagecraft_tensor::{normalize_axis, Error, Result, TensorMetadata};

const AXIS: AttrSpec = AttrSpec::optional("axis", AttrKind::Int, AttrDefault::Int(0));

/// `out[i][j] = x[indices[i][j]][j]` along `axis` (here 0; NumPy's
/// `take_along_axis`, PyTorch's `gather`): `indices` has the rank of `x`,
/// no larger a size on the other axes, and gives the output its shape.
/// Negative indices count from the end.
pub static GATHER_ELEMENTS: OpDef = OpDef {
    name: "GatherElements",
    inputs: &["x", "indices"],
    variadic: false,
    outputs: 1,
    attrs: &[AXIS],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: gather_elements_meta,
    grad: Some(gather_elements_grad),
};

/// Checks that `indices` can address `x` element by element along `axis`:
/// the same rank, and on every other axis no more entries than `x` has.
/// Returns the resolved axis.
fn check_elementwise_indices(
    x: &TensorMetadata,
    indices: &TensorMetadata,
    axis: i64,
) -> Result<usize> {
    require_int("indices", indices)?;
    let rank = x.shape.rank();
    let axis = normalize_axis(axis as isize, rank)?;
    if indices.shape.rank() != rank {
        return Err(Error::shape(format!(
            "indices {indices} must have the rank of x {x}"
        )));
    }
    if let Some(d) = (0..rank).find(|&d| d != axis && indices.shape[d] > x.shape[d]) {
        return Err(Error::shape(format!(
            "indices {indices} are larger than x {x} on axis {d} (only axis {axis} may differ)"
        )));
    }
    Ok(axis)
}

fn gather_elements_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let (x, indices) = (&inputs[0], &inputs[1]);
    check_elementwise_indices(x, indices, attrs.int("axis")?)?;
    one(TensorMetadata::new(x.dtype, indices.shape.clone()))
}

/// `out = x; out[indices[i][j]][j] += src[i][j]` along `axis` (here 0):
/// PyTorch's `scatter_add`. `src` has the shape of `indices`, which has
/// the rank of `x` and no larger a size on the other axes. Negative
/// indices count from the end; an index out of range is an error of the
/// kernel. Additions run in row-major order of `src`, each rounded to the
/// element type (integers wrap).
pub static SCATTER_ADD: OpDef = OpDef {
    name: "ScatterAdd",
    inputs: &["x", "indices", "src"],
    variadic: false,
    outputs: 1,
    attrs: &[AXIS],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: scatter_add_meta,
    grad: Some(scatter_add_grad),
};

fn scatter_add_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let (x, indices, src) = (&inputs[0], &inputs[1], &inputs[2]);
    require_numeric("x", x)?;
    require_same_dtype(x, src)?;
    check_elementwise_indices(x, indices, attrs.int("axis")?)?;
    if src.shape != indices.shape {
        return Err(Error::shape(format!(
            "src {src} must have the shape of indices {indices}"
        )));
    }
    one(x.clone())
}

/// `out = x; out[.., indices[k], ..] += src[.., k, ..]` along `axis`:
/// PyTorch's `index_add`. `indices` is 1-D; `src` is `x` with `axis`
/// resized to the number of indices. Negative indices count from the end;
/// an index out of range is an error of the kernel. Additions run in
/// row-major order of `src`, each rounded to the element type (integers
/// wrap).
pub static INDEX_ADD: OpDef = OpDef {
    name: "IndexAdd",
    inputs: &["x", "indices", "src"],
    variadic: false,
    outputs: 1,
    attrs: &[AXIS],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: index_add_meta,
    grad: Some(index_add_grad),
};

fn index_add_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let (x, indices, src) = (&inputs[0], &inputs[1], &inputs[2]);
    require_numeric("x", x)?;
    require_same_dtype(x, src)?;
    require_int("indices", indices)?;
    let rank = x.shape.rank();
    let axis = normalize_axis(attrs.int("axis")? as isize, rank)?;
    if indices.shape.rank() != 1 {
        return Err(Error::shape(format!("indices {indices} must be 1-D")));
    }
    let fits = src.shape.rank() == rank
        && (0..rank).all(|d| {
            let want = if d == axis {
                indices.shape[0]
            } else {
                x.shape[d]
            };
            src.shape[d] == want
        });
    if !fits {
        return Err(Error::shape(format!(
            "src {src} must be x {x} with axis {axis} of size {} (one entry per index)",
            indices.shape[0]
        )));
    }
    one(x.clone())
}

/// The lower (`upper` false) or upper triangle of the last two axes,
/// batched over the others; the rest is zero (false). Element `(i, j)` is
/// kept when `j - i <= k` (lower) or `j - i >= k` (upper), so `k` shifts
/// the diagonal up (positive) or down (negative), as in ONNX `Trilu` and
/// NumPy's `tril`/`triu`.
pub static TRILU: OpDef = OpDef {
    name: "Trilu",
    inputs: &["x"],
    variadic: false,
    outputs: 1,
    attrs: &[
        AttrSpec::optional("upper", AttrKind::Bool, AttrDefault::Bool(false)),
        AttrSpec::optional("k", AttrKind::Int, AttrDefault::Int(0)),
    ],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: trilu_meta,
    grad: Some(trilu_grad),
};

fn trilu_meta(inputs: &[TensorMetadata], _: &Attrs<'_>) -> Result<OutputMetas> {
    let x = &inputs[0];
    if x.shape.rank() < 2 {
        return Err(Error::shape(format!(
            "x {x} needs at least two axes (the matrix is the last two)"
        )));
    }
    one(x.clone())
}

// ---------------------------------------------------------------------------
// Gradients.

fn with_axis(axis: i64) -> crate::OpAttrs {
    let mut attrs = crate::OpAttrs::new();
    attrs.set_int("axis", axis);
    attrs
}

/// A zero tensor shaped like `like`.
fn zeros_like(b: &mut dyn GradBuilder, like: G) -> Result<G> {
    let meta = b.meta(like);
    b.fill(0.0, &meta)
}

/// The gradient reaches each picked element once per pick: a scatter-add
/// of the incoming gradient into zeros shaped like `x`.
fn gather_elements_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let (x, indices, g) = (ctx.inputs[0], ctx.inputs[1], ctx.grad()?);
    if !b.meta(x).dtype.is_float() {
        return Ok(smallvec![None, None]);
    }
    let zeros = zeros_like(b, x)?;
    let attrs = with_axis(ctx.attrs.int("axis")?);
    let dx = b.op(&SCATTER_ADD, &[zeros, indices, g], &attrs)?;
    Ok(smallvec![Some(dx), None])
}

/// `x` passes the gradient through; `src[i][j]` went to one place, whose
/// gradient it reads back (a gather-elements).
fn scatter_add_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let (x, indices, g) = (ctx.inputs[0], ctx.inputs[1], ctx.grad()?);
    if !b.meta(x).dtype.is_float() {
        return Ok(smallvec![None, None, None]);
    }
    let attrs = with_axis(ctx.attrs.int("axis")?);
    let dsrc = b.op(&GATHER_ELEMENTS, &[g, indices], &attrs)?;
    Ok(smallvec![Some(g), None, Some(dsrc)])
}

/// `x` passes the gradient through; slice `k` of `src` went to row
/// `indices[k]`, whose gradient it reads back (a gather).
fn index_add_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let (x, indices, g) = (ctx.inputs[0], ctx.inputs[1], ctx.grad()?);
    if !b.meta(x).dtype.is_float() {
        return Ok(smallvec![None, None, None]);
    }
    let attrs = with_axis(ctx.attrs.int("axis")?);
    let dsrc = b.op(&crate::GATHER, &[g, indices], &attrs)?;
    Ok(smallvec![Some(g), None, Some(dsrc)])
}

/// A mask is linear: the gradient is the same mask of the gradient.
fn trilu_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let g = ctx.grad()?;
    if !b.meta(g).dtype.is_float() {
        return Ok(smallvec![None]);
    }
    let mut attrs = crate::OpAttrs::new();
    attrs
        .set_bool("upper", ctx.attrs.bool("upper")?)
        .set_int("k", ctx.attrs.int("k")?);
    crate::grad::only(b.op(&TRILU, &[g], &attrs)?)
}

/// The gradient of `Gather`: the incoming gradient, viewed as one slice
/// per index, is index-added into zeros shaped like `x`. It touches each
/// gathered row once, O(indices × row), where a one-hot product would
/// cost O(indices × rows × row) and a `[indices, rows]` intermediate.
pub(crate) fn gather_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let (x, indices, g) = (ctx.inputs[0], ctx.inputs[1], ctx.grad()?);
    let xm = b.meta(x);
    if !xm.dtype.is_float() {
        return Ok(smallvec![None, None]);
    }
    let axis = normalize_axis(ctx.attrs.int("axis")? as isize, xm.shape.rank())?;
    let count = b.meta(indices).shape.numel();
    let flat_indices = b.reshape(indices, &[count])?;
    // g: x[..axis] ++ indices ++ x[axis+1..] → x[..axis] ++ [count] ++ x[axis+1..]
    let mut slices = xm.shape.dims().to_vec();
    slices[axis] = count;
    let g = b.reshape(g, &slices)?;
    let zeros = b.fill(0.0, &xm)?;
    let dx = b.op(
        &INDEX_ADD,
        &[zeros, flat_indices, g],
        &with_axis(axis as i64),
    )?;
    Ok(smallvec![Some(dx), None])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::OpAttrs;
    use proptest::prelude::*;
    use stagecraft_tensor::DType;

    fn m(dtype: DType, dims: &[usize]) -> TensorMetadata {
        TensorMetadata::new(dtype, dims)
    }
    fn f(dims: &[usize]) -> TensorMetadata {
        m(DType::F32, dims)
    }
    fn i(dims: &[usize]) -> TensorMetadata {
        m(DType::I64, dims)
    }
    fn axis(a: i64) -> OpAttrs {
        let mut attrs = OpAttrs::new();
        attrs.set_int("axis", a);
        attrs
    }

    #[test]
    fn gather_elements_rules() {
        let out = GATHER_ELEMENTS.infer(&[f(&[4, 3]), i(&[6, 2])], &axis(0));
        assert_eq!(out.unwrap()[0], f(&[6, 2]));
        let out = GATHER_ELEMENTS.infer(&[f(&[4, 3]), i(&[2, 5])], &axis(-1));
        assert_eq!(out.unwrap()[0], f(&[2, 5]));
        // Larger on a non-gathered axis, another rank, float indices, a bad axis.
        assert!(GATHER_ELEMENTS
            .infer(&[f(&[4, 3]), i(&[2, 5])], &axis(0))
            .is_err());
        assert!(GATHER_ELEMENTS
            .infer(&[f(&[4, 3]), i(&[2])], &axis(0))
            .is_err());
        assert!(GATHER_ELEMENTS
            .infer(&[f(&[4, 3]), f(&[2, 3])], &axis(0))
            .is_err());
        assert!(GATHER_ELEMENTS
            .infer(&[f(&[4, 3]), i(&[2, 3])], &axis(2))
            .is_err());
    }

    #[test]
    fn scatter_add_rules() {
        let ok = SCATTER_ADD.infer(&[f(&[4, 3]), i(&[6, 2]), f(&[6, 2])], &axis(0));
        assert_eq!(ok.unwrap()[0], f(&[4, 3]));
        let bad = [
            // src not the shape of indices
            vec![f(&[4, 3]), i(&[6, 2]), f(&[6, 3])],
            // indices wider than x off the axis
            vec![f(&[4, 3]), i(&[2, 4]), f(&[2, 4])],
            // dtypes: src differs, bool x, float indices
            vec![f(&[4, 3]), i(&[2, 2]), m(DType::F64, &[2, 2])],
            vec![m(DType::Bool, &[4, 3]), i(&[2, 2]), m(DType::Bool, &[2, 2])],
            vec![f(&[4, 3]), f(&[2, 2]), f(&[2, 2])],
            // rank 0 has no axis 0
            vec![f(&[]), i(&[]), f(&[])],
        ];
        for inputs in bad {
            assert!(SCATTER_ADD.infer(&inputs, &axis(0)).is_err(), "{inputs:?}");
        }
    }

    #[test]
    fn index_add_rules() {
        let ok = INDEX_ADD.infer(&[f(&[4, 3]), i(&[5]), f(&[4, 5])], &axis(-1));
        assert_eq!(ok.unwrap()[0], f(&[4, 3]));
        let ok = INDEX_ADD.infer(&[f(&[4, 3]), i(&[0]), f(&[0, 3])], &axis(0));
        assert_eq!(ok.unwrap()[0], f(&[4, 3]));
        let bad = [
            vec![f(&[4, 3]), i(&[5, 1]), f(&[5, 3])],
            vec![f(&[4, 3]), i(&[5]), f(&[5, 2])],
            vec![f(&[4, 3]), i(&[5]), f(&[4, 3])],
            vec![f(&[4, 3]), m(DType::F32, &[2]), f(&[2, 3])],
            vec![f(&[4, 3]), i(&[2]), m(DType::I32, &[2, 3])],
        ];
        for inputs in bad {
            assert!(INDEX_ADD.infer(&inputs, &axis(0)).is_err(), "{inputs:?}");
        }
        assert!(INDEX_ADD
            .infer(&[f(&[4, 3]), i(&[2]), f(&[2, 3])], &axis(-3))
            .is_err());
    }

    #[test]
    fn trilu_rules() {
        let mut attrs = OpAttrs::new();
        attrs.set_bool("upper", true).set_int("k", -7);
        assert_eq!(
            TRILU.infer(&[m(DType::Bool, &[2, 0, 5])], &attrs).unwrap()[0],
            m(DType::Bool, &[2, 0, 5])
        );
        assert!(TRILU.infer(&[f(&[5])], &attrs).is_err());
        assert!(TRILU.infer(&[f(&[])], &attrs).is_err());
    }

    proptest! {
        /// Gather-elements and scatter-add accept the same index shapes,
        /// and their outputs are what their gradients need: the gather's
        /// has the shape of the indices (the scatter's `src`), the
        /// scatter's the shape of `x`.
        #[test]
        fn gather_and_scatter_shapes_agree(
            x in prop::collection::vec(0usize..4, 1..4),
            sizes in prop::collection::vec(0usize..6, 4),
            a in -4i64..4,
        ) {
            let index_dims: Vec<usize> = sizes[..x.len()].to_vec();
            let (xm, im) = (f(&x), i(&index_dims));
            let gathered = GATHER_ELEMENTS.infer(&[xm.clone(), im.clone()], &axis(a));
            let scattered = SCATTER_ADD.infer(&[xm.clone(), im.clone(), f(&index_dims)], &axis(a));
            prop_assert_eq!(gathered.is_ok(), scattered.is_ok());
            let rank = x.len() as i64;
            let valid = (-rank..rank).contains(&a) && {
                let axis = a.rem_euclid(rank) as usize;
                (0..x.len()).all(|d| d == axis || index_dims[d] <= x[d])
            };
            prop_assert_eq!(gathered.is_ok(), valid);
            if valid {
                prop_assert_eq!(&gathered.unwrap()[0], &f(&index_dims));
                prop_assert_eq!(&scattered.unwrap()[0], &xm);
            }
        }

        /// Index-add's output is `x`'s metadata whenever `src` is `x` with
        /// the axis resized to the index count, and an error otherwise.
        #[test]
        fn index_add_shape(
            x in prop::collection::vec(0usize..4, 1..4),
            count in 0usize..5,
            a in 0usize..3,
            off_by in 0usize..2,
        ) {
            let axis = a % x.len();
            let mut src = x.clone();
            src[axis] = count + off_by;
            let out = INDEX_ADD.infer(&[f(&x), i(&[count]), f(&src)], &axis_attr(axis));
            prop_assert_eq!(out.is_ok(), off_by == 0);
            if off_by == 0 {
                prop_assert_eq!(&out.unwrap()[0], &f(&x));
            }
        }
    }

    fn axis_attr(a: usize) -> OpAttrs {
        axis(a as i64)
    }
}
