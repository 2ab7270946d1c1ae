//! Ops that create tensors from attributes alone: fill, arange and
//! counter-based random numbers.

use super::one;
use crate::attrs::AttrKind;
use crate::op::*;
use stagecraft_tensor::{DType, Error, Result, Shape, TensorMetadata};

/// A tensor of `shape` filled with `value` (the scalar's dtype is the
/// tensor's).
pub static FILL: OpDef = OpDef {
    name: "Fill",
    inputs: &[],
    variadic: false,
    outputs: 1,
    attrs: &[
        AttrSpec::required("shape", AttrKind::Ints),
        AttrSpec::required("value", AttrKind::Scalar),
    ],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: fill_meta,
    grad: None,
};

fn fill_meta(_: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let shape = Shape::new(&attrs.dims("shape")?);
    shape.checked_numel()?;
    one(TensorMetadata::new(attrs.scalar("value")?.dtype(), shape))
}

/// Evenly spaced values `start, start+step, ...` below `stop` (above, for a
/// negative step).
pub static ARANGE: OpDef = OpDef {
    name: "Arange",
    inputs: &[],
    variadic: false,
    outputs: 1,
    attrs: &[
        AttrSpec::optional("start", AttrKind::Float, AttrDefault::Float(0.0)),
        AttrSpec::required("stop", AttrKind::Float),
        AttrSpec::optional("step", AttrKind::Float, AttrDefault::Float(1.0)),
        AttrSpec::optional("dtype", AttrKind::DType, AttrDefault::DType(DType::F32)),
    ],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: arange_meta,
    grad: None,
};

/// The number of elements of an arange, or an error for a zero, NaN or
/// infinite step or bounds.
pub fn arange_len(start: f64, stop: f64, step: f64) -> Result<usize> {
    if step == 0.0 || !step.is_finite() || !start.is_finite() || !stop.is_finite() {
        return Err(Error::attribute(format!(
            "arange needs finite bounds and a finite nonzero step, got start {start}, stop {stop}, step {step}"
        )));
    }
    let n = ((stop - start) / step).ceil();
    if n > (1u64 << 40) as f64 {
        return Err(Error::attribute(format!("arange would have {n} elements")));
    }
    Ok(n.max(0.0) as usize)
}

fn arange_meta(_: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let dtype = attrs.dtype("dtype")?;
    if !dtype.is_numeric() {
        return Err(Error::dtype("arange needs a numeric dtype, not bool"));
    }
    let len = arange_len(
        attrs.float("start")?,
        attrs.float("stop")?,
        attrs.float("step")?,
    )?;
    one(TensorMetadata::new(dtype, [len]))
}

const RANDOM_ATTRS_UNIFORM: &[AttrSpec] = &[
    AttrSpec::required("shape", AttrKind::Ints),
    AttrSpec::optional("dtype", AttrKind::DType, AttrDefault::DType(DType::F32)),
    AttrSpec::required("seed", AttrKind::Int),
    AttrSpec::optional("offset", AttrKind::Int, AttrDefault::Int(0)),
    AttrSpec::optional("low", AttrKind::Float, AttrDefault::Float(0.0)),
    AttrSpec::optional("high", AttrKind::Float, AttrDefault::Float(1.0)),
];

const RANDOM_ATTRS_NORMAL: &[AttrSpec] = &[
    AttrSpec::required("shape", AttrKind::Ints),
    AttrSpec::optional("dtype", AttrKind::DType, AttrDefault::DType(DType::F32)),
    AttrSpec::required("seed", AttrKind::Int),
    AttrSpec::optional("offset", AttrKind::Int, AttrDefault::Int(0)),
    AttrSpec::optional("mean", AttrKind::Float, AttrDefault::Float(0.0)),
    AttrSpec::optional("std", AttrKind::Float, AttrDefault::Float(1.0)),
];

/// Uniform random numbers in `[low, high)`, a pure function of
/// `(seed, offset + element index)` (Philox-4x32-10), so every device and
/// mode draws the same values.
pub static RANDOM_UNIFORM: OpDef = OpDef {
    name: "RandomUniform",
    inputs: &[],
    variadic: false,
    outputs: 1,
    attrs: RANDOM_ATTRS_UNIFORM,
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: random_meta,
    grad: None,
};

/// Normal random numbers with `mean` and `std` (Box–Muller over the same
/// counter-based stream as [`RANDOM_UNIFORM`]).
pub static RANDOM_NORMAL: OpDef = OpDef {
    name: "RandomNormal",
    inputs: &[],
    variadic: false,
    outputs: 1,
    attrs: RANDOM_ATTRS_NORMAL,
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: random_meta,
    grad: None,
};

fn random_meta(_: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let dtype = attrs.dtype("dtype")?;
    if !dtype.is_float() {
        return Err(Error::dtype(format!(
            "random values need a float dtype, got {dtype}"
        )));
    }
    let shape = Shape::new(&attrs.dims("shape")?);
    shape.checked_numel()?;
    if attrs.int("offset")? < 0 {
        return Err(Error::attribute("`offset` must be non-negative"));
    }
    if attrs.op().name == "RandomUniform" {
        let (low, high) = (attrs.float("low")?, attrs.float("high")?);
        if !low.is_finite() || !high.is_finite() || low >= high {
            return Err(Error::attribute(format!(
                "need finite low < high, got [{low}, {high})"
            )));
        }
    } else {
        let std = attrs.float("std")?;
        if !std.is_finite() || std < 0.0 || !attrs.float("mean")?.is_finite() {
            return Err(Error::attribute(format!(
                "need a finite mean and std >= 0, got std {std}"
            )));
        }
    }
    one(TensorMetadata::new(dtype, shape))
}
