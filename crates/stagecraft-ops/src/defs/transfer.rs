//! `Send` and `Recv`: the two ends of a cross-device edge. Partitioning a
//! function over devices puts a `Send` in the producer's partition and a
//! `Recv` in the consumer's; at run time they meet in a rendezvous under
//! the edge's key.

use crate::attrs::AttrKind;
use crate::op::*;
use smallvec::SmallVec;
use stagecraft_tensor::{Error, Result, Shape, TensorMetadata};

fn send_meta(_: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    if attrs.str("key")?.is_empty() {
        return Err(Error::attribute("`key` must name the edge"));
    }
    Ok(SmallVec::new())
}

fn recv_meta(_: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    if attrs.str("key")?.is_empty() {
        return Err(Error::attribute("`key` must name the edge"));
    }
    let shape = Shape::new(&attrs.dims("shape")?);
    shape.checked_numel()?;
    super::one(TensorMetadata::new(attrs.dtype("dtype")?, shape))
}

/// Hands its input to the rendezvous under `key` (no outputs).
pub static SEND: OpDef = OpDef {
    name: "Send",
    inputs: &["x"],
    variadic: false,
    outputs: 0,
    attrs: &[AttrSpec::required("key", AttrKind::Str)],
    kind: OpKind::Transfer,
    effect: Effect::SideEffecting,
    shape_kind: ShapeKind::Static,
    metadata: send_meta,
    grad: None,
};

/// Waits for the value sent under `key`.
pub static RECV: OpDef = OpDef {
    name: "Recv",
    inputs: &[],
    variadic: false,
    outputs: 1,
    attrs: &[
        AttrSpec::required("key", AttrKind::Str),
        AttrSpec::required("dtype", AttrKind::DType),
        AttrSpec::required("shape", AttrKind::Ints),
    ],
    kind: OpKind::Transfer,
    effect: Effect::SideEffecting,
    shape_kind: ShapeKind::Static,
    metadata: recv_meta,
    grad: None,
};
