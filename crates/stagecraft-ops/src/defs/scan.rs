//! Scans: running totals along one axis.

use super::{one, require_numeric};
use crate::attrs::AttrKind;
use crate::grad::{GradBuilder, GradContext, InputGrads};
use crate::op::*;
use smallvec::smallvec;
use stagecraft_tensor::{normalize_axis, Result, TensorMetadata};

/// Running sums along `axis`: `out[i] = x[0] + … + x[i]`. `exclusive`
/// leaves out `x[i]` itself (`out[0]` is 0); `reverse` sums from the end
/// (`out[i] = x[i] + … + x[n-1]`). Float sums are formed in f64 and each
/// output rounded once; integer sums wrap.
pub static CUMSUM: OpDef = OpDef {
    name: "Cumsum",
    inputs: &["x"],
    variadic: false,
    outputs: 1,
    attrs: &[
        AttrSpec::optional("axis", AttrKind::Int, AttrDefault::Int(0)),
        AttrSpec::optional("exclusive", AttrKind::Bool, AttrDefault::Bool(false)),
        AttrSpec::optional("reverse", AttrKind::Bool, AttrDefault::Bool(false)),
    ],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: cumsum_meta,
    grad: Some(cumsum_grad),
};

fn cumsum_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let x = &inputs[0];
    require_numeric("x", x)?;
    normalize_axis(attrs.int("axis")? as isize, x.shape.rank())?;
    one(x.clone())
}

/// `x[j]` reaches every output that sums over it: `out[i]` for `i ≥ j`
/// (`i > j` when exclusive). Summing the gradient over those is the same
/// scan run the other way, with the same exclusiveness.
fn cumsum_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let g = ctx.grad()?;
    if !b.meta(g).dtype.is_float() {
        return Ok(smallvec![None]);
    }
    let mut attrs = crate::OpAttrs::new();
    attrs
        .set_int("axis", ctx.attrs.int("axis")?)
        .set_bool("exclusive", ctx.attrs.bool("exclusive")?)
        .set_bool("reverse", !ctx.attrs.bool("reverse")?);
    crate::grad::only(b.op(&CUMSUM, &[g], &attrs)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::OpAttrs;
    use proptest::prelude::*;
    use stagecraft_tensor::DType;

    proptest! {
        /// The output is the input's metadata for any numeric dtype and an
        /// axis in range; any other axis, and bool input, is an error.
        #[test]
        fn cumsum_keeps_the_shape(
            dims in prop::collection::vec(0usize..4, 0..4),
            axis in -5i64..5,
            dtype in prop::sample::select(DType::ALL.to_vec()),
        ) {
            let x = TensorMetadata::new(dtype, dims.as_slice());
            let mut attrs = OpAttrs::new();
            attrs.set_int("axis", axis).set_bool("reverse", true);
            let out = CUMSUM.infer(std::slice::from_ref(&x), &attrs);
            let rank = dims.len() as i64;
            let valid = (-rank..rank).contains(&axis) && dtype.is_numeric();
            prop_assert_eq!(out.is_ok(), valid);
            if valid {
                prop_assert_eq!(&out.unwrap()[0], &x);
            }
        }
    }
}
