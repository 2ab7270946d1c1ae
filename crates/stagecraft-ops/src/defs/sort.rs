//! Sorting along an axis: `Sort` and `TopK`.
//!
//! The order every op here uses: ascending numbers with NaN after every
//! number (so a descending sort puts NaN first, as NumPy and PyTorch do),
//! `-0.0` equal to `0.0`, and equal keys in their original order (stable).
//! The indices say where each output element came from, so the gradient of
//! the values is the incoming gradient put back at those indices: an
//! O(n) `ScatterAdd` (whose own gradient is `GatherElements`), never a
//! one-hot product.

use super::{require_numeric, SCATTER_ADD};
use crate::attrs::AttrKind;
use crate::grad::{GradBuilder, GradContext, InputGrads};
use crate::op::*;
use smallvec::smallvec;
use stagecraft_tensor::{normalize_axis, DType, Error, Result, TensorMetadata};

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

// ---------------------------------------------------------------------------
// Gradients.

/// The values are `x` taken along the axis at the indices: their gradient
/// goes back to where each value came from (for `TopK`, the entries not
/// selected get zero), a scatter-add into zeros shaped like `x`. The
/// indices have no gradient.
fn sort_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let x = b.meta(ctx.inputs[0]);
    let Some(g) = ctx.grads.first().copied().flatten() else {
        return Ok(smallvec![None]);
    };
    if !x.dtype.is_float() {
        return Ok(smallvec![None]);
    }
    let axis = normalize_axis(ctx.attrs.int("axis")? as isize, x.shape.rank())?;
    let zeros = b.fill(0.0, &x)?;
    let mut attrs = crate::OpAttrs::new();
    attrs.set_int("axis", axis as i64);
    let dx = b.op(&SCATTER_ADD, &[zeros, ctx.outputs[1], g], &attrs)?;
    crate::grad::only(dx)
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

    proptest! {
        /// Sort keeps any shape; TopK replaces the axis by `k` exactly when
        /// `0 ≤ k ≤ n` and fails otherwise; ScatterAdd of TopK's values
        /// at its indices into the input has the input's shape again.
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
            let mut scatter_attrs = OpAttrs::new();
            scatter_attrs.set_int("axis", axis);
            let back = SCATTER_ADD
                .infer(&[x.clone(), top[1].clone(), top[0].clone()], &scatter_attrs)
                .unwrap();
            prop_assert_eq!(&back[0], &x);
        }
    }
}
