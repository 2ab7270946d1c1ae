//! Reductions over axes, arg-reductions and (log-)softmax.

use super::{one, require_float, require_numeric};
use crate::attrs::AttrKind;
use crate::grad::{GradBuilder, GradContext, InputGrads};
use crate::op::*;
use smallvec::SmallVec;
use stagecraft_tensor::{normalize_axis, DType, Error, Result, Shape, TensorMetadata};

const REDUCE_ATTRS: &[AttrSpec] = &[
    AttrSpec::optional("axes", AttrKind::Ints, AttrDefault::Ints(&[])),
    AttrSpec::optional("keepdim", AttrKind::Bool, AttrDefault::Bool(false)),
];

const fn reduce(name: &'static str, op: ReduceOp) -> OpDef {
    OpDef {
        name,
        inputs: &["x"],
        variadic: false,
        outputs: 1,
        attrs: REDUCE_ATTRS,
        kind: OpKind::Reduce(op),
        effect: Effect::Pure,
        shape_kind: ShapeKind::Static,
        metadata: reduce_meta,
        grad: Some(reduce_grad),
    }
}

/// Sum over `axes` (all axes when empty).
pub static SUM: OpDef = reduce("Sum", ReduceOp::Sum);
/// Mean over `axes` (all axes when empty); NaN for zero elements.
pub static MEAN: OpDef = reduce("Mean", ReduceOp::Mean);
/// Maximum over `axes`; NaN propagates.
pub static MAX: OpDef = reduce("Max", ReduceOp::Max);
/// Minimum over `axes`; NaN propagates.
pub static MIN: OpDef = reduce("Min", ReduceOp::Min);
/// Product over `axes`.
pub static PROD: OpDef = reduce("Prod", ReduceOp::Prod);

/// Resolves reduction axes (negative allowed; empty means every axis) to a
/// sorted list, rejecting duplicates and out-of-range axes.
pub fn reduction_axes(axes: &[i64], rank: usize) -> Result<SmallVec<[usize; 4]>> {
    if axes.is_empty() {
        return Ok((0..rank).collect());
    }
    let mut out: SmallVec<[usize; 4]> = SmallVec::new();
    for &axis in axes {
        let a = normalize_axis(axis as isize, rank)?;
        if out.contains(&a) {
            return Err(Error::new(
                stagecraft_tensor::ErrorKind::Axis,
                format!("axis {axis} appears more than once in {axes:?}"),
            ));
        }
        out.push(a);
    }
    out.sort_unstable();
    Ok(out)
}

/// The shape after reducing `axes` (already resolved).
pub fn reduced_shape(shape: &Shape, axes: &[usize], keepdim: bool) -> Shape {
    shape
        .dims()
        .iter()
        .enumerate()
        .filter_map(|(i, &d)| match (axes.contains(&i), keepdim) {
            (true, true) => Some(1),
            (true, false) => None,
            (false, _) => Some(d),
        })
        .collect()
}

fn reduce_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let x = &inputs[0];
    let op = attrs.op().kind;
    if op == OpKind::Reduce(ReduceOp::Mean) {
        require_float("x", x)?;
    } else {
        require_numeric("x", x)?;
    }
    let axes = reduction_axes(attrs.ints("axes")?, x.shape.rank())?;
    if matches!(op, OpKind::Reduce(ReduceOp::Max | ReduceOp::Min))
        && axes.iter().any(|&a| x.shape[a] == 0)
    {
        return Err(Error::shape(format!(
            "cannot take the {} of zero elements: {x} reduced over axes {axes:?}",
            attrs.op().name.to_lowercase()
        )));
    }
    one(TensorMetadata::new(
        x.dtype,
        reduced_shape(&x.shape, &axes, attrs.bool("keepdim")?),
    ))
}

const ARG_ATTRS: &[AttrSpec] = &[
    AttrSpec::required("axis", AttrKind::Int),
    AttrSpec::optional("keepdim", AttrKind::Bool, AttrDefault::Bool(false)),
];

/// Index (i64) of the largest value along `axis`; the first one on ties,
/// and a NaN counts as the largest.
pub static ARGMAX: OpDef = OpDef {
    name: "ArgMax",
    inputs: &["x"],
    variadic: false,
    outputs: 1,
    attrs: ARG_ATTRS,
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: arg_meta,
    grad: None,
};

/// Index (i64) of the smallest value along `axis`; the first one on ties,
/// and a NaN counts as the smallest.
pub static ARGMIN: OpDef = OpDef {
    name: "ArgMin",
    inputs: &["x"],
    variadic: false,
    outputs: 1,
    attrs: ARG_ATTRS,
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: arg_meta,
    grad: None,
};

fn arg_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let x = &inputs[0];
    require_numeric("x", x)?;
    let axis = normalize_axis(attrs.int("axis")? as isize, x.shape.rank())?;
    if x.shape[axis] == 0 {
        return Err(Error::shape(format!(
            "cannot take the {} over an empty axis {axis} of {x}",
            attrs.op().name
        )));
    }
    one(TensorMetadata::new(
        DType::I64,
        reduced_shape(&x.shape, &[axis], attrs.bool("keepdim")?),
    ))
}

const SOFTMAX_ATTRS: &[AttrSpec] = &[AttrSpec::optional(
    "axis",
    AttrKind::Int,
    AttrDefault::Int(-1),
)];

/// `exp(x - max) / sum(exp(x - max))` along `axis`.
pub static SOFTMAX: OpDef = OpDef {
    name: "Softmax",
    inputs: &["x"],
    variadic: false,
    outputs: 1,
    attrs: SOFTMAX_ATTRS,
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: softmax_meta,
    grad: Some(softmax_grad),
};

/// `x - max - log(sum(exp(x - max)))` along `axis`.
pub static LOG_SOFTMAX: OpDef = OpDef {
    name: "LogSoftmax",
    inputs: &["x"],
    variadic: false,
    outputs: 1,
    attrs: SOFTMAX_ATTRS,
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: softmax_meta,
    grad: Some(log_softmax_grad),
};

fn softmax_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let x = &inputs[0];
    require_float("x", x)?;
    normalize_axis(attrs.int("axis")? as isize, x.shape.rank())?;
    one(x.clone())
}

// ---------------------------------------------------------------------------
// Gradients.

/// The incoming gradient stretched back over the reduced axes of `x`.
fn spread(
    b: &mut dyn GradBuilder,
    g: crate::grad::G,
    x_shape: &Shape,
    axes: &[usize],
) -> Result<crate::grad::G> {
    let kept = reduced_shape(x_shape, axes, true);
    let g = b.reshape(g, kept.dims())?;
    b.broadcast_to(g, x_shape.dims())
}

fn reduce_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let (x, y, g) = (ctx.inputs[0], ctx.outputs[0], ctx.grad()?);
    let xm = b.meta(x);
    if !xm.dtype.is_float() {
        return Ok(smallvec::smallvec![None]);
    }
    let axes = reduction_axes(ctx.attrs.ints("axes")?, xm.shape.rank())?;
    let count: usize = axes.iter().map(|&a| xm.shape[a]).product();
    let OpKind::Reduce(op) = ctx.attrs.op().kind else {
        return Err(Error::internal("reduce_grad on a non-reduction"));
    };
    let spread_g = spread(b, g, &xm.shape, &axes)?;
    let dx = match op {
        ReduceOp::Sum => spread_g,
        ReduceOp::Mean => b.scale(spread_g, 1.0 / count.max(1) as f64)?,
        // Ties share the gradient equally.
        ReduceOp::Max | ReduceOp::Min => {
            let y_full = spread(b, y, &xm.shape, &axes)?;
            let hit = b.op(&crate::EQUAL, &[x, y_full], &crate::OpAttrs::new())?;
            let mask = b.mask(hit, xm.dtype)?;
            let ties = b.sum(mask, &axes, true)?;
            let share = b.div(mask, ties)?;
            b.mul(spread_g, share)?
        }
        // d prod / dx_i = prod / x_i (undefined where x_i = 0).
        ReduceOp::Prod => {
            let y_full = spread(b, y, &xm.shape, &axes)?;
            let d = b.div(y_full, x)?;
            b.mul(spread_g, d)?
        }
    };
    crate::grad::only(dx)
}

fn softmax_axis(ctx: &GradContext<'_>, rank: usize) -> Result<usize> {
    normalize_axis(ctx.attrs.int("axis")? as isize, rank)
}

/// dx = y (g - sum(g y, axis))
fn softmax_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let (y, g) = (ctx.outputs[0], ctx.grad()?);
    let axis = softmax_axis(ctx, b.meta(y).shape.rank())?;
    let gy = b.mul(g, y)?;
    let s = b.sum(gy, &[axis], true)?;
    let d = b.sub(g, s)?;
    crate::grad::only(b.mul(y, d)?)
}

/// dx = g - exp(y) sum(g, axis)
fn log_softmax_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let (y, g) = (ctx.outputs[0], ctx.grad()?);
    let axis = softmax_axis(ctx, b.meta(y).shape.rank())?;
    let p = b.unary(&crate::EXP, y)?;
    let s = b.sum(g, &[axis], true)?;
    let ps = b.mul(p, s)?;
    crate::grad::only(b.sub(g, ps)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::OpAttrs;

    fn m(dtype: DType, dims: &[usize]) -> TensorMetadata {
        TensorMetadata::new(dtype, dims)
    }

    #[test]
    fn reductions_resolve_axes() {
        let mut a = OpAttrs::new();
        a.set_ints("axes", &[-1, 0]).set_bool("keepdim", true);
        assert_eq!(
            SUM.infer(&[m(DType::F32, &[2, 3, 4])], &a).unwrap()[0],
            m(DType::F32, &[1, 3, 1])
        );
        a.set_bool("keepdim", false);
        assert_eq!(
            SUM.infer(&[m(DType::I32, &[2, 3, 4])], &a).unwrap()[0],
            m(DType::I32, &[3])
        );
        let all = OpAttrs::new();
        assert_eq!(
            PROD.infer(&[m(DType::F64, &[2, 3])], &all).unwrap()[0],
            m(DType::F64, &[])
        );
        a.set_ints("axes", &[0, -3]);
        assert!(SUM.infer(&[m(DType::F32, &[2, 3, 4])], &a).is_err());
        a.set_ints("axes", &[3]);
        assert!(SUM.infer(&[m(DType::F32, &[2, 3, 4])], &a).is_err());
        assert!(MEAN.infer(&[m(DType::I32, &[2])], &all).is_err());
        assert!(MAX.infer(&[m(DType::F32, &[0, 2])], &all).is_err());
        assert!(SUM.infer(&[m(DType::F32, &[0, 2])], &all).is_ok());
        assert!(SUM.infer(&[m(DType::Bool, &[2])], &all).is_err());
    }

    #[test]
    fn arg_and_softmax() {
        let mut a = OpAttrs::new();
        a.set_int("axis", -1);
        assert_eq!(
            ARGMAX.infer(&[m(DType::F32, &[2, 3])], &a).unwrap()[0],
            m(DType::I64, &[2])
        );
        assert!(ARGMAX.infer(&[m(DType::F32, &[2, 0])], &a).is_err());
        assert!(ARGMAX
            .infer(&[m(DType::F32, &[2, 3])], &OpAttrs::new())
            .is_err());
        assert!(SOFTMAX
            .infer(&[m(DType::F32, &[2, 3])], &OpAttrs::new())
            .is_ok());
        a.set_int("axis", 2);
        assert!(SOFTMAX.infer(&[m(DType::F32, &[2, 3])], &a).is_err());
        assert!(SOFTMAX
            .infer(&[m(DType::I32, &[2, 3])], &OpAttrs::new())
            .is_err());
    }
}
