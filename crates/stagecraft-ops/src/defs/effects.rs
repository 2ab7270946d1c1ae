//! Side-effecting ops, which the runtime orders with chains.

use super::one;
use crate::attrs::AttrKind;
use crate::op::*;
use stagecraft_tensor::{Result, TensorMetadata};

/// Prints `label: value` to the runtime's print sink and passes `x` through.
pub static PRINT: OpDef = OpDef {
    name: "Print",
    inputs: &["x"],
    variadic: false,
    outputs: 1,
    attrs: &[AttrSpec::optional(
        "label",
        AttrKind::Str,
        AttrDefault::Str(""),
    )],
    kind: OpKind::Other,
    effect: Effect::SideEffecting,
    shape_kind: ShapeKind::Static,
    metadata: print_meta,
    grad: Some(|_, ctx| crate::grad::only(ctx.grad()?)),
};

fn print_meta(inputs: &[TensorMetadata], _: &Attrs<'_>) -> Result<OutputMetas> {
    one(inputs[0].clone())
}
