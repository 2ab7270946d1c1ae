//! Ops that move or select values: reshape, transpose, broadcast, concat,
//! slice, gather, one-hot, pad and nonzero.

use super::{one, require_int};
use crate::attrs::AttrKind;
use crate::grad::{GradBuilder, GradContext, InputGrads, G};
use crate::op::*;
use smallvec::SmallVec;
use stagecraft_tensor::{
    broadcast_shapes, normalize_axis, DType, Error, ErrorKind, Result, Shape, TensorMetadata,
};

/// The same values under a new shape; one entry of `shape` may be -1 and is
/// inferred.
pub static RESHAPE: OpDef = OpDef {
    name: "Reshape",
    inputs: &["x"],
    variadic: false,
    outputs: 1,
    attrs: &[AttrSpec::required("shape", AttrKind::Ints)],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: reshape_meta,
    grad: Some(reshape_grad),
};

/// Resolves a reshape target with at most one -1 against `numel` elements.
pub fn resolve_reshape(target: &[i64], from: &Shape) -> Result<Shape> {
    let numel = from.numel();
    let mut inferred = None;
    let mut known = 1usize;
    for (i, &d) in target.iter().enumerate() {
        match d {
            -1 if inferred.is_none() => inferred = Some(i),
            -1 => {
                return Err(Error::shape(format!(
                    "reshape target {target:?} has more than one -1"
                )))
            }
            d if d < 0 => {
                return Err(Error::shape(format!(
                    "reshape target {target:?} has a negative dimension"
                )))
            }
            d => {
                known = known
                    .checked_mul(d as usize)
                    .ok_or_else(|| Error::shape(format!("reshape target {target:?} overflows")))?
            }
        }
    }
    let mut dims: SmallVec<[usize; 4]> = target.iter().map(|&d| d.max(0) as usize).collect();
    if let Some(i) = inferred {
        if known == 0 || !numel.is_multiple_of(known) {
            return Err(Error::shape(format!(
                "cannot reshape {from} ({numel} elements) to {target:?}"
            )));
        }
        dims[i] = numel / known;
    } else if known != numel {
        return Err(Error::shape(format!(
            "cannot reshape {from} ({numel} elements) to {target:?} ({known} elements)"
        )));
    }
    Ok(Shape::new(&dims))
}

fn reshape_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let x = &inputs[0];
    one(TensorMetadata::new(
        x.dtype,
        resolve_reshape(attrs.ints("shape")?, &x.shape)?,
    ))
}

/// Permutes the axes: output axis `i` is input axis `perm[i]`.
pub static TRANSPOSE: OpDef = OpDef {
    name: "Transpose",
    inputs: &["x"],
    variadic: false,
    outputs: 1,
    attrs: &[AttrSpec::required("perm", AttrKind::Ints)],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: transpose_meta,
    grad: Some(transpose_grad),
};

/// Resolves a permutation (negative entries allowed), checking that it is
/// one.
pub fn resolve_perm(perm: &[i64], rank: usize) -> Result<SmallVec<[usize; 4]>> {
    if perm.len() != rank {
        return Err(Error::new(
            ErrorKind::Axis,
            format!(
                "permutation {perm:?} has {} entries for a tensor of rank {rank}",
                perm.len()
            ),
        ));
    }
    let mut seen: SmallVec<[bool; 4]> = SmallVec::from_elem(false, rank);
    let mut out = SmallVec::new();
    for &p in perm {
        let a = normalize_axis(p as isize, rank)?;
        if seen[a] {
            return Err(Error::new(
                ErrorKind::Axis,
                format!("{perm:?} is not a permutation"),
            ));
        }
        seen[a] = true;
        out.push(a);
    }
    Ok(out)
}

fn transpose_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let x = &inputs[0];
    let perm = resolve_perm(attrs.ints("perm")?, x.shape.rank())?;
    one(TensorMetadata::new(
        x.dtype,
        perm.iter().map(|&p| x.shape[p]).collect::<Shape>(),
    ))
}

/// Broadcasts `x` to `shape` (NumPy rules; `x` must broadcast to exactly
/// `shape`).
pub static BROADCAST_TO: OpDef = OpDef {
    name: "BroadcastTo",
    inputs: &["x"],
    variadic: false,
    outputs: 1,
    attrs: &[AttrSpec::required("shape", AttrKind::Ints)],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: broadcast_to_meta,
    grad: Some(broadcast_grad),
};

fn broadcast_to_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let x = &inputs[0];
    let target = Shape::new(&attrs.dims("shape")?);
    if broadcast_shapes(&x.shape, &target).ok().as_ref() != Some(&target) {
        return Err(Error::shape(format!(
            "cannot broadcast {} to {target}",
            x.shape
        )));
    }
    one(TensorMetadata::new(x.dtype, target))
}

/// Joins tensors along `axis`; all other dimensions must match.
pub static CONCAT: OpDef = OpDef {
    name: "Concat",
    inputs: &["xs"],
    variadic: true,
    outputs: 1,
    attrs: &[AttrSpec::optional(
        "axis",
        AttrKind::Int,
        AttrDefault::Int(0),
    )],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: concat_meta,
    grad: Some(concat_grad),
};

fn concat_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let first = &inputs[0];
    let axis = normalize_axis(attrs.int("axis")? as isize, first.shape.rank())?;
    let mut out = first.shape.clone();
    for (i, t) in inputs.iter().enumerate().skip(1) {
        if t.dtype != first.dtype {
            return Err(Error::dtype(format!(
                "input {i} is {t} but input 0 is {first}"
            )));
        }
        let same_rest = t.shape.rank() == first.shape.rank()
            && (0..t.shape.rank()).all(|d| d == axis || t.shape[d] == first.shape[d]);
        if !same_rest {
            return Err(Error::shape(format!(
                "input {i} has shape {} but input 0 has {}: only axis {axis} may differ",
                t.shape, first.shape
            )));
        }
        let dim = &mut out.dims_mut()[axis];
        *dim = dim.checked_add(t.shape[axis]).ok_or_else(|| {
            Error::shape(format!(
                "concatenating along axis {axis} gives more than usize::MAX elements"
            ))
        })?;
    }
    out.checked_numel()?;
    one(TensorMetadata::new(first.dtype, out))
}

/// Strided slice: for each axis, elements `start, start+step, ...` before
/// `end`. Negative starts and ends count from the end; both are clamped to
/// the axis like Python slices; an end of `i64::MAX` is the end of the
/// axis however long it is. Steps must be positive.
pub static SLICE: OpDef = OpDef {
    name: "Slice",
    inputs: &["x"],
    variadic: false,
    outputs: 1,
    attrs: &[
        AttrSpec::required("starts", AttrKind::Ints),
        AttrSpec::required("ends", AttrKind::Ints),
        AttrSpec::optional("steps", AttrKind::Ints, AttrDefault::Ints(&[])),
    ],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: slice_meta,
    grad: Some(slice_grad),
};

/// A resolved slice of one axis: first index, step and count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AxisSlice {
    /// First index taken.
    pub start: usize,
    /// Distance between taken indices.
    pub step: usize,
    /// Number of indices taken.
    pub len: usize,
}

/// Resolves slice attributes against a shape.
pub fn resolve_slice(attrs: &Attrs<'_>, shape: &Shape) -> Result<SmallVec<[AxisSlice; 4]>> {
    let (starts, ends, steps) = (
        attrs.ints("starts")?,
        attrs.ints("ends")?,
        attrs.ints("steps")?,
    );
    let rank = shape.rank();
    if starts.len() != rank || ends.len() != rank || !(steps.is_empty() || steps.len() == rank) {
        return Err(Error::attribute(format!(
            "starts, ends (and steps) need one entry per axis of {shape}: got {} starts, {} ends, {} steps",
            starts.len(),
            ends.len(),
            steps.len()
        )));
    }
    (0..rank)
        .map(|i| {
            // In i128: a dimension of an empty tensor may exceed i64::MAX.
            let dim = shape[i] as i128;
            let step = if steps.is_empty() { 1 } else { steps[i] };
            if step <= 0 {
                return Err(Error::attribute(format!(
                    "slice step must be positive, got {step} on axis {i}"
                )));
            }
            let step = step as i128;
            let clamp = |v: i64| {
                let v = v as i128;
                if v < 0 {
                    (v + dim).max(0)
                } else {
                    v.min(dim)
                }
            };
            // An end of i64::MAX is "to the end of the axis", even of one
            // longer than i64 counts.
            let e = if ends[i] == i64::MAX {
                dim
            } else {
                clamp(ends[i])
            };
            let s = clamp(starts[i]);
            let len = if e > s { (e - s - 1) / step + 1 } else { 0 };
            Ok(AxisSlice {
                start: s as usize,
                step: step as usize,
                len: len as usize,
            })
        })
        .collect()
}

fn slice_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let x = &inputs[0];
    let slices = resolve_slice(attrs, &x.shape)?;
    one(TensorMetadata::new(
        x.dtype,
        slices.iter().map(|s| s.len).collect::<Shape>(),
    ))
}

/// Selects entries of `x` along `axis` by integer `indices` (negative
/// indices count from the end); the result has shape
/// `x[..axis] ++ indices ++ x[axis+1..]`.
pub static GATHER: OpDef = OpDef {
    name: "Gather",
    inputs: &["x", "indices"],
    variadic: false,
    outputs: 1,
    attrs: &[AttrSpec::optional(
        "axis",
        AttrKind::Int,
        AttrDefault::Int(0),
    )],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: gather_meta,
    grad: Some(super::indexing::gather_grad),
};

fn gather_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let (x, idx) = (&inputs[0], &inputs[1]);
    require_int("indices", idx)?;
    let axis = normalize_axis(attrs.int("axis")? as isize, x.shape.rank())?;
    let mut out: Shape = x.shape.dims()[..axis].iter().copied().collect();
    for &d in idx.shape.dims().iter().chain(&x.shape.dims()[axis + 1..]) {
        out.push(d);
    }
    one(TensorMetadata::new(x.dtype, out))
}

/// One-hot encoding of integer `indices` into `depth` classes: the result
/// has shape `indices ++ [depth]`; an index outside `0..depth` is an error.
pub static ONE_HOT: OpDef = OpDef {
    name: "OneHot",
    inputs: &["indices"],
    variadic: false,
    outputs: 1,
    attrs: &[
        AttrSpec::required("depth", AttrKind::Int),
        AttrSpec::optional("dtype", AttrKind::DType, AttrDefault::DType(DType::F32)),
    ],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: one_hot_meta,
    grad: None,
};

fn one_hot_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let idx = &inputs[0];
    require_int("indices", idx)?;
    let depth = attrs.int("depth")?;
    if depth < 0 {
        return Err(Error::attribute(format!(
            "depth must be non-negative, got {depth}"
        )));
    }
    let mut shape = idx.shape.clone();
    shape.push(depth as usize);
    shape.checked_numel()?;
    one(TensorMetadata::new(attrs.dtype("dtype")?, shape))
}

/// Pads with a constant: `pads` holds `(before, after)` for every axis.
pub static PAD: OpDef = OpDef {
    name: "Pad",
    inputs: &["x"],
    variadic: false,
    outputs: 1,
    attrs: &[
        AttrSpec::required("pads", AttrKind::Ints),
        AttrSpec::optional("value", AttrKind::Float, AttrDefault::Float(0.0)),
    ],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: pad_meta,
    grad: Some(pad_grad),
};

fn pad_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let x = &inputs[0];
    let pads = attrs.dims("pads")?;
    if pads.len() != 2 * x.shape.rank() {
        return Err(Error::attribute(format!(
            "pads needs (before, after) for each of the {} axes of {x}, got {} entries",
            x.shape.rank(),
            pads.len()
        )));
    }
    let dims = x
        .shape
        .dims()
        .iter()
        .enumerate()
        .map(|(i, &d)| {
            d.checked_add(pads[2 * i])
                .and_then(|v| v.checked_add(pads[2 * i + 1]))
                .ok_or_else(|| {
                    Error::shape(format!("padding axis {i} of {x} overflows the size range"))
                })
        })
        .collect::<Result<Vec<usize>>>()?;
    let shape = Shape::new(&dims);
    shape.checked_numel()?;
    one(TensorMetadata::new(x.dtype, shape))
}

/// Coordinates (i64, shape `[count, rank]`) of the nonzero (true) elements
/// in row-major order. Its shape depends on the values.
pub static NONZERO: OpDef = OpDef {
    name: "Nonzero",
    inputs: &["x"],
    variadic: false,
    outputs: 1,
    attrs: &[],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::DataDependent,
    metadata: nonzero_meta,
    grad: None,
};

fn nonzero_meta(inputs: &[TensorMetadata], _: &Attrs<'_>) -> Result<OutputMetas> {
    one(TensorMetadata::new(DType::I64, [0, inputs[0].shape.rank()]))
}

// ---------------------------------------------------------------------------
// Gradients.

fn reshape_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let dims = b.meta(ctx.inputs[0]).shape;
    crate::grad::only(b.reshape(ctx.grad()?, dims.dims())?)
}

fn transpose_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let rank = b.meta(ctx.inputs[0]).shape.rank();
    let perm = resolve_perm(ctx.attrs.ints("perm")?, rank)?;
    let mut inverse: SmallVec<[usize; 4]> = SmallVec::from_elem(0, rank);
    for (i, &p) in perm.iter().enumerate() {
        inverse[p] = i;
    }
    crate::grad::only(b.transpose(ctx.grad()?, &inverse)?)
}

fn broadcast_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let shape = b.meta(ctx.inputs[0]).shape;
    crate::grad::only(b.unbroadcast(ctx.grad()?, &shape)?)
}

fn slice_of(b: &mut dyn GradBuilder, g: G, axis: usize, start: usize, len: usize) -> Result<G> {
    let dims = b.meta(g).shape;
    let starts: SmallVec<[i64; 4]> = (0..dims.rank())
        .map(|a| if a == axis { start as i64 } else { 0 })
        .collect();
    let ends: SmallVec<[i64; 4]> = (0..dims.rank())
        .map(|a| {
            if a == axis {
                (start + len) as i64
            } else {
                i64::MAX
            }
        })
        .collect();
    let mut attrs = crate::OpAttrs::new();
    attrs.set_ints("starts", &starts).set_ints("ends", &ends);
    b.op(&SLICE, &[g], &attrs)
}

fn pad_axis(b: &mut dyn GradBuilder, g: G, axis: usize, before: usize, after: usize) -> Result<G> {
    let rank = b.meta(g).shape.rank();
    let pads: SmallVec<[i64; 8]> = (0..rank)
        .flat_map(|a| {
            if a == axis {
                [before as i64, after as i64]
            } else {
                [0, 0]
            }
        })
        .collect();
    let mut attrs = crate::OpAttrs::new();
    attrs.set_ints("pads", &pads);
    b.op(&PAD, &[g], &attrs)
}

fn concat_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let g = ctx.grad()?;
    let rank = b.meta(g).shape.rank();
    let axis = normalize_axis(ctx.attrs.int("axis")? as isize, rank)?;
    let mut offset = 0;
    let mut out = InputGrads::new();
    for &x in ctx.inputs {
        let len = b.meta(x).shape[axis];
        out.push(Some(slice_of(b, g, axis, offset, len)?));
        offset += len;
    }
    Ok(out)
}

/// Scatters the gradient of a strided slice back: per axis, spread the
/// taken elements `step` apart (interleaving zeros through a pad of a new
/// axis), trim, and pad to the original extent.
fn slice_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let shape = b.meta(ctx.inputs[0]).shape;
    let slices = resolve_slice(&ctx.attrs, &shape)?;
    let mut g = ctx.grad()?;
    // One pad for every axis at the end: a pad per axis copied the whole
    // gradient once per axis, most of them with nothing to add (a
    // `narrow` of a [B, T, 3C] projection paid three copies).
    let mut pads: SmallVec<[i64; 8]> = SmallVec::with_capacity(2 * shape.rank());
    for (axis, s) in slices.iter().enumerate() {
        let dim = shape[axis];
        if s.len == 0 {
            // Nothing was taken: the gradient is all zeros.
            let meta = b.meta(ctx.inputs[0]);
            return crate::grad::only(b.fill(0.0, &meta)?);
        }
        if s.step > 1 {
            let dims = b.meta(g).shape;
            let pre: usize = dims.dims()[..axis].iter().product();
            let post: usize = dims.dims()[axis + 1..].iter().product();
            let t = b.reshape(g, &[pre, s.len, 1, post])?;
            let t = pad_axis(b, t, 2, 0, s.step - 1)?;
            let t = b.reshape(t, &[pre, s.len * s.step, post])?;
            let span = (s.len - 1) * s.step + 1;
            let t = slice_of(b, t, 1, 0, span)?;
            let mut back: Vec<usize> = dims.dims().to_vec();
            back[axis] = span;
            g = b.reshape(t, &back)?;
        }
        let span = (s.len - 1) * s.step + 1;
        pads.extend([s.start as i64, (dim - s.start - span) as i64]);
    }
    if pads.iter().any(|&p| p != 0) {
        let mut attrs = crate::OpAttrs::new();
        attrs.set_ints("pads", &pads);
        g = b.op(&PAD, &[g], &attrs)?;
    }
    crate::grad::only(g)
}

fn pad_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let shape = b.meta(ctx.inputs[0]).shape;
    let pads = ctx.attrs.ints("pads")?;
    let g = ctx.grad()?;
    // One slice over every axis (see `slice_grad`), none where nothing
    // was padded.
    if pads.iter().all(|&p| p == 0) {
        return crate::grad::only(g);
    }
    let starts: SmallVec<[i64; 4]> = (0..shape.rank()).map(|a| pads[2 * a]).collect();
    let ends: SmallVec<[i64; 4]> = (0..shape.rank())
        .map(|a| pads[2 * a] + shape[a] as i64)
        .collect();
    let mut attrs = crate::OpAttrs::new();
    attrs.set_ints("starts", &starts).set_ints("ends", &ends);
    crate::grad::only(b.op(&SLICE, &[g], &attrs)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::OpAttrs;
    use stagecraft_tensor::Scalar;

    fn m(dtype: DType, dims: &[usize]) -> TensorMetadata {
        TensorMetadata::new(dtype, dims)
    }
    fn f(dims: &[usize]) -> TensorMetadata {
        m(DType::F32, dims)
    }

    #[test]
    fn reshape_rules() {
        let mut a = OpAttrs::new();
        a.set_ints("shape", &[3, -1]);
        assert_eq!(RESHAPE.infer(&[f(&[2, 6])], &a).unwrap()[0], f(&[3, 4]));
        a.set_ints("shape", &[5, -1]);
        assert!(RESHAPE.infer(&[f(&[2, 6])], &a).is_err());
        a.set_ints("shape", &[-1, -1]);
        assert!(RESHAPE.infer(&[f(&[2, 6])], &a).is_err());
        a.set_ints("shape", &[0, -1]);
        assert!(RESHAPE.infer(&[f(&[0, 6])], &a).is_err());
        a.set_ints("shape", &[0, 3]);
        assert_eq!(RESHAPE.infer(&[f(&[3, 0])], &a).unwrap()[0], f(&[0, 3]));
    }

    #[test]
    fn transpose_broadcast_concat() {
        let mut a = OpAttrs::new();
        a.set_ints("perm", &[2, 0, -2]);
        assert_eq!(
            TRANSPOSE.infer(&[f(&[2, 3, 4])], &a).unwrap()[0],
            f(&[4, 2, 3])
        );
        a.set_ints("perm", &[0, 0, 1]);
        assert!(TRANSPOSE.infer(&[f(&[2, 3, 4])], &a).is_err());
        let mut b = OpAttrs::new();
        b.set_ints("shape", &[4, 2, 3]);
        assert!(BROADCAST_TO.infer(&[f(&[3, 1])], &b).is_err());
        assert!(BROADCAST_TO.infer(&[f(&[5, 2, 3])], &b).is_err());
        assert_eq!(
            BROADCAST_TO.infer(&[f(&[1, 3])], &b).unwrap()[0],
            f(&[4, 2, 3])
        );
        let mut c = OpAttrs::new();
        c.set_int("axis", -1);
        assert_eq!(
            CONCAT
                .infer(&[f(&[2, 1]), f(&[2, 0]), f(&[2, 4])], &c)
                .unwrap()[0],
            f(&[2, 5])
        );
        assert!(CONCAT.infer(&[f(&[2, 1]), f(&[3, 1])], &c).is_err());
        assert!(CONCAT
            .infer(&[f(&[2, 1]), m(DType::F64, &[2, 1])], &c)
            .is_err());
        assert!(CONCAT.infer(&[], &c).is_err());
    }

    #[test]
    fn slice_gather_onehot_pad() {
        let mut s = OpAttrs::new();
        s.set_ints("starts", &[1, -2])
            .set_ints("ends", &[100, 4])
            .set_ints("steps", &[2, 1]);
        assert_eq!(SLICE.infer(&[f(&[6, 4])], &s).unwrap()[0], f(&[3, 2]));
        s.set_ints("steps", &[0, 1]);
        assert!(SLICE.infer(&[f(&[6, 4])], &s).is_err());
        let mut g = OpAttrs::new();
        g.set_int("axis", 1);
        assert_eq!(
            GATHER
                .infer(&[f(&[2, 5, 3]), m(DType::I64, &[4, 2])], &g)
                .unwrap()[0],
            f(&[2, 4, 2, 3])
        );
        assert!(GATHER.infer(&[f(&[2, 5]), f(&[4])], &g).is_err());
        let mut o = OpAttrs::new();
        o.set_int("depth", 10);
        assert_eq!(
            ONE_HOT.infer(&[m(DType::I32, &[3])], &o).unwrap()[0],
            f(&[3, 10])
        );
        let mut p = OpAttrs::new();
        p.set_ints("pads", &[1, 2, 0, 3]);
        assert_eq!(PAD.infer(&[f(&[2, 2])], &p).unwrap()[0], f(&[5, 5]));
        p.set_ints("pads", &[1, 2]);
        assert!(PAD.infer(&[f(&[2, 2])], &p).is_err());
        p.set_ints("pads", &[-1, 0, 0, 0]);
        assert!(PAD.infer(&[f(&[2, 2])], &p).is_err());
        let _ = Scalar::F32(0.0);
    }
}
