//! Lists of tensors: the stacks in which the gradient of a `While` keeps
//! what each forward iteration computed, so the reverse loop reads them
//! back instead of recomputing them. A list is a value like any other
//! (dtype `list`, rank 0, immutable), so lists flow through loops,
//! branches and traces; pushing to a list that nothing else holds reuses
//! its storage.

use crate::attrs::AttrKind;
use crate::grad::{GradBuilder, GradContext, InputGrads};
use crate::op::*;
use smallvec::smallvec;
use stagecraft_tensor::{DType, Error, Result, Shape, TensorList, TensorMetadata};

fn require_list(role: &str, meta: &TensorMetadata) -> Result<()> {
    if meta.dtype != DType::List {
        return Err(Error::dtype(format!("{role} must be a list, got {meta}")));
    }
    Ok(())
}

fn push_meta(inputs: &[TensorMetadata], _: &Attrs<'_>) -> Result<OutputMetas> {
    require_list("the first operand", &inputs[0])?;
    if inputs[1].dtype == DType::List {
        return Err(Error::dtype("lists of lists are not supported"));
    }
    super::one(TensorList::metadata().clone())
}

/// The metadata of the items a `ListPop` returns.
pub fn list_item_meta(attrs: &Attrs<'_>) -> Result<TensorMetadata> {
    let dtype = attrs.dtype("item_dtype")?;
    if dtype == DType::List {
        return Err(Error::attribute("lists of lists are not supported"));
    }
    let shape = Shape::new(&attrs.dims("item_shape")?);
    shape.checked_numel()?;
    Ok(TensorMetadata::new(dtype, shape))
}

fn pop_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    require_list("the operand", &inputs[0])?;
    Ok(smallvec![
        TensorList::metadata().clone(),
        list_item_meta(attrs)?
    ])
}

/// `ListPush(list, item)`: the list with `item` on top.
pub static LIST_PUSH: OpDef = OpDef {
    name: "ListPush",
    inputs: &["list", "item"],
    variadic: false,
    outputs: 1,
    attrs: &[],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: push_meta,
    grad: Some(push_grad),
};

/// `ListPop(list) -> (rest, item)`: the top item and the list without it.
/// Popping an empty list gives zeros of the item type: an empty list is
/// also the zero gradient of a list (see [`LIST_PUSH`]'s rule).
pub static LIST_POP: OpDef = OpDef {
    name: "ListPop",
    inputs: &["list"],
    variadic: false,
    outputs: 2,
    attrs: &[
        AttrSpec::required("item_dtype", AttrKind::DType),
        AttrSpec::required("item_shape", AttrKind::Ints),
    ],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: pop_meta,
    grad: Some(pop_grad),
};

/// Pops `item`'s gradient off the top of the list's gradient. A gradient
/// list is aligned with its list at the top, with zeros below its bottom,
/// which is why an empty list (no gradient) pops zeros.
fn push_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let item = b.meta(ctx.inputs[1]);
    let mut attrs = crate::OpAttrs::new();
    attrs
        .set_dtype("item_dtype", item.dtype)
        .set_dims("item_shape", item.shape.dims());
    let popped = b.op_multi(&LIST_POP, &[ctx.grad()?], &attrs)?;
    Ok(smallvec![Some(popped[0]), Some(popped[1])])
}

/// Pushes the item's gradient back on the rest's gradient.
fn pop_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let rest = match ctx.grads[0] {
        Some(g) => g,
        None => b.fill(0.0, TensorList::metadata())?,
    };
    let item = match ctx.grads[1] {
        Some(g) => g,
        None => {
            let meta = b.meta(ctx.outputs[1]);
            b.fill(0.0, &meta)?
        }
    };
    Ok(smallvec![Some(b.op(
        &LIST_PUSH,
        &[rest, item],
        &crate::OpAttrs::new()
    )?)])
}
