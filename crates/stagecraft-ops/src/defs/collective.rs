//! Collectives: ops that every process of a group runs together, each on
//! its own tensor (`AllReduce`, `Broadcast`, `ReduceToRoot`, `AllGather`,
//! `ReduceScatter`), plus the split form `AllReduceStart`/`AllReduceDone`
//! that lets computation run while a reduction travels (XLA's async
//! collectives; what bucketed data-parallel gradients use).
//!
//! The group's size is an attribute (`world_size`), as in TF's collective
//! ops: shape rules are device-independent and must know it, and a kernel
//! built for another group size refuses to run. Collectives are
//! side-effecting so chains keep them in program order: every process must
//! issue the same collectives in the same order, and no pass or dataflow
//! schedule may reorder them differently on different processes.

use super::{one, require_numeric};
use crate::attrs::AttrKind;
use crate::grad::{GradBuilder, GradContext, InputGrads, G};
use crate::op::*;
use crate::OpAttrs;
use smallvec::smallvec;
use stagecraft_tensor::{DType, Error, Result, Shape, TensorMetadata};

/// How a collective combines the processes' tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reduction {
    /// Elementwise sum.
    Sum,
    /// Elementwise sum divided by the group's size.
    Mean,
    /// Elementwise maximum.
    Max,
    /// Elementwise minimum.
    Min,
}

impl Reduction {
    /// Every reduction, in attribute order.
    pub const ALL: [Reduction; 4] = [
        Reduction::Sum,
        Reduction::Mean,
        Reduction::Max,
        Reduction::Min,
    ];

    /// The attribute spelling: `sum`, `mean`, `max`, `min`.
    pub fn name(self) -> &'static str {
        match self {
            Reduction::Sum => "sum",
            Reduction::Mean => "mean",
            Reduction::Max => "max",
            Reduction::Min => "min",
        }
    }

    /// Parses the attribute spelling.
    pub fn parse(name: &str) -> Result<Reduction> {
        Reduction::ALL
            .into_iter()
            .find(|r| r.name() == name)
            .ok_or_else(|| {
                Error::attribute(format!(
                    "unknown reduction `{name}`: expected sum, mean, max or min"
                ))
            })
    }

    /// The reduction named by the op's `reduction` attribute.
    pub fn of(attrs: &Attrs<'_>) -> Result<Reduction> {
        Reduction::parse(attrs.str("reduction")?)
    }
}

const REDUCTION: AttrSpec = AttrSpec::optional("reduction", AttrKind::Str, AttrDefault::Str("sum"));
const WORLD_SIZE: AttrSpec = AttrSpec::required("world_size", AttrKind::Int);
const ROOT: AttrSpec = AttrSpec::optional("root", AttrKind::Int, AttrDefault::Int(0));

/// The group size attribute, checked.
pub fn world_size(attrs: &Attrs<'_>) -> Result<usize> {
    let n = attrs.int("world_size")?;
    if n < 1 {
        return Err(Error::attribute(format!(
            "world_size must be at least 1, got {n}"
        )));
    }
    Ok(n as usize)
}

/// The root attribute, checked against the group size.
pub fn root(attrs: &Attrs<'_>) -> Result<usize> {
    let (root, n) = (attrs.int("root")?, world_size(attrs)?);
    if root < 0 || root as usize >= n {
        return Err(Error::attribute(format!(
            "root {root} is not a rank of a group of {n}"
        )));
    }
    Ok(root as usize)
}

fn reducible(x: &TensorMetadata, attrs: &Attrs<'_>) -> Result<Reduction> {
    let reduction = Reduction::of(attrs)?;
    require_numeric("x", x)?;
    if matches!(x.dtype, DType::F16 | DType::BF16) {
        return Err(Error::dtype(format!(
            "collectives reduce f32, f64 and integer tensors; cast {x} to f32 first"
        )));
    }
    Ok(reduction)
}

fn all_reduce_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    world_size(attrs)?;
    reducible(&inputs[0], attrs)?;
    one(inputs[0].clone())
}

/// Every process gets the reduction of all processes' `x`.
///
/// The gradient of a sum is the sum of the gradients (each process's
/// output depends on every process's input); of a mean, their mean; of a
/// max or min, the summed gradient where this process's element was the
/// extreme one.
pub static ALL_REDUCE: OpDef = OpDef {
    name: "AllReduce",
    inputs: &["x"],
    variadic: false,
    outputs: 1,
    attrs: &[REDUCTION, WORLD_SIZE],
    kind: OpKind::Other,
    effect: Effect::SideEffecting,
    shape_kind: ShapeKind::Static,
    metadata: all_reduce_meta,
    grad: Some(all_reduce_grad),
};

fn collective(
    b: &mut dyn GradBuilder,
    def: &'static OpDef,
    x: G,
    reduction: Option<Reduction>,
    root: Option<usize>,
    world: usize,
) -> Result<G> {
    let mut attrs = OpAttrs::new();
    attrs.set_int("world_size", world as i64);
    if let Some(r) = reduction {
        attrs.set_str("reduction", r.name());
    }
    if let Some(root) = root {
        attrs.set_int("root", root as i64);
    }
    b.op(def, &[x], &attrs)
}

/// `g` where `x` equals the reduced `y`, zero elsewhere.
fn where_extreme(b: &mut dyn GradBuilder, g: G, x: G, y: G) -> Result<G> {
    let dtype = b.meta(g).dtype;
    let hit = b.op(&crate::EQUAL, &[x, y], &OpAttrs::new())?;
    let mask = b.mask(hit, dtype)?;
    b.mul(g, mask)
}

fn all_reduce_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let (g, n) = (ctx.grad()?, world_size(&ctx.attrs)?);
    let dx = match Reduction::of(&ctx.attrs)? {
        r @ (Reduction::Sum | Reduction::Mean) => collective(b, &ALL_REDUCE, g, Some(r), None, n)?,
        Reduction::Max | Reduction::Min => {
            let total = collective(b, &ALL_REDUCE, g, Some(Reduction::Sum), None, n)?;
            where_extreme(b, total, ctx.inputs[0], ctx.outputs[0])?
        }
    };
    Ok(smallvec![Some(dx)])
}

fn same_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    root(attrs)?;
    one(inputs[0].clone())
}

/// Every process gets the root's `x`.
///
/// Only the root's input reaches any output, so the gradient is the sum of
/// all processes' gradients on the root and zero elsewhere
/// (`ReduceToRoot`).
pub static BROADCAST: OpDef = OpDef {
    name: "Broadcast",
    inputs: &["x"],
    variadic: false,
    outputs: 1,
    attrs: &[ROOT, WORLD_SIZE],
    kind: OpKind::Other,
    effect: Effect::SideEffecting,
    shape_kind: ShapeKind::Static,
    metadata: same_meta,
    grad: Some(broadcast_grad),
};

fn broadcast_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let (g, n, root) = (ctx.grad()?, world_size(&ctx.attrs)?, root(&ctx.attrs)?);
    let dx = collective(b, &REDUCE_TO_ROOT, g, Some(Reduction::Sum), Some(root), n)?;
    Ok(smallvec![Some(dx)])
}

fn reduce_to_root_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    root(attrs)?;
    reducible(&inputs[0], attrs)?;
    one(inputs[0].clone())
}

/// The root gets the reduction of all processes' `x`; the others get
/// zeros of the same shape (MPI's `Reduce`).
///
/// The gradient is the root's gradient broadcast to every process (scaled
/// by `1/n` for a mean); max and min have none.
pub static REDUCE_TO_ROOT: OpDef = OpDef {
    name: "ReduceToRoot",
    inputs: &["x"],
    variadic: false,
    outputs: 1,
    attrs: &[REDUCTION, ROOT, WORLD_SIZE],
    kind: OpKind::Other,
    effect: Effect::SideEffecting,
    shape_kind: ShapeKind::Static,
    metadata: reduce_to_root_meta,
    grad: Some(reduce_to_root_grad),
};

fn reduce_to_root_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let (g, n, root) = (ctx.grad()?, world_size(&ctx.attrs)?, root(&ctx.attrs)?);
    let spread = collective(b, &BROADCAST, g, None, Some(root), n)?;
    let dx = match Reduction::of(&ctx.attrs)? {
        Reduction::Sum => spread,
        Reduction::Mean => b.scale(spread, 1.0 / n as f64)?,
        r => {
            return Err(Error::invalid(format!(
                "ReduceToRoot with reduction {} has no gradient",
                r.name()
            )))
        }
    };
    Ok(smallvec![Some(dx)])
}

fn leading(x: &TensorMetadata, role: &str) -> Result<usize> {
    x.shape.dims().first().copied().ok_or_else(|| {
        Error::shape(format!(
            "{role} gathers and scatters along axis 0, so x needs at least one axis, got {x}"
        ))
    })
}

fn with_leading(x: &TensorMetadata, rows: usize) -> TensorMetadata {
    let mut dims = x.shape.dims().to_vec();
    dims[0] = rows;
    TensorMetadata::new(x.dtype, Shape::new(&dims))
}

fn all_gather_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let n = world_size(attrs)?;
    let x = &inputs[0];
    let rows = leading(x, "AllGather")?;
    let out = with_leading(x, rows * n);
    out.shape.checked_numel()?;
    one(out)
}

/// Every process gets all processes' `x` concatenated along axis 0, in
/// rank order. Every process's output holds every input, so the gradient
/// is the sum over processes of each one's slice (`ReduceScatter`).
pub static ALL_GATHER: OpDef = OpDef {
    name: "AllGather",
    inputs: &["x"],
    variadic: false,
    outputs: 1,
    attrs: &[WORLD_SIZE],
    kind: OpKind::Other,
    effect: Effect::SideEffecting,
    shape_kind: ShapeKind::Static,
    metadata: all_gather_meta,
    grad: Some(all_gather_grad),
};

fn all_gather_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let (g, n) = (ctx.grad()?, world_size(&ctx.attrs)?);
    let dx = collective(b, &REDUCE_SCATTER, g, Some(Reduction::Sum), None, n)?;
    Ok(smallvec![Some(dx)])
}

fn reduce_scatter_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let n = world_size(attrs)?;
    let x = &inputs[0];
    reducible(x, attrs)?;
    let rows = leading(x, "ReduceScatter")?;
    if rows % n != 0 {
        return Err(Error::shape(format!(
            "ReduceScatter splits axis 0 of {x} into {n} equal parts, but {rows} is not a multiple of {n}"
        )));
    }
    one(with_leading(x, rows / n))
}

/// Rank `r` gets part `r` (of `world_size` equal parts along axis 0) of
/// the reduction of all processes' `x`. The gradient gathers the parts'
/// gradients back (`AllGather`; over `n` for a mean; masked to the
/// extreme elements for max and min).
pub static REDUCE_SCATTER: OpDef = OpDef {
    name: "ReduceScatter",
    inputs: &["x"],
    variadic: false,
    outputs: 1,
    attrs: &[REDUCTION, WORLD_SIZE],
    kind: OpKind::Other,
    effect: Effect::SideEffecting,
    shape_kind: ShapeKind::Static,
    metadata: reduce_scatter_meta,
    grad: Some(reduce_scatter_grad),
};

fn reduce_scatter_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let (g, n) = (ctx.grad()?, world_size(&ctx.attrs)?);
    let gathered = collective(b, &ALL_GATHER, g, None, None, n)?;
    let dx = match Reduction::of(&ctx.attrs)? {
        Reduction::Sum => gathered,
        Reduction::Mean => b.scale(gathered, 1.0 / n as f64)?,
        Reduction::Max | Reduction::Min => {
            let y = collective(b, &ALL_GATHER, ctx.outputs[0], None, None, n)?;
            where_extreme(b, gathered, ctx.inputs[0], y)?
        }
    };
    Ok(smallvec![Some(dx)])
}

fn start_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    world_size(attrs)?;
    reducible(&inputs[0], attrs)?;
    one(TensorMetadata::new(DType::I64, Shape::scalar()))
}

/// Starts an all-reduce of `x` and returns at once with a ticket (an i64
/// scalar) that `AllReduceDone` redeems for the result. Ops placed between
/// the two run while the reduction travels.
pub static ALL_REDUCE_START: OpDef = OpDef {
    name: "AllReduceStart",
    inputs: &["x"],
    variadic: false,
    outputs: 1,
    attrs: &[REDUCTION, WORLD_SIZE],
    kind: OpKind::Other,
    effect: Effect::SideEffecting,
    shape_kind: ShapeKind::Static,
    metadata: start_meta,
    grad: None,
};

fn done_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let ticket = &inputs[0];
    if ticket.dtype != DType::I64 || ticket.shape.rank() != 0 {
        return Err(Error::dtype(format!(
            "the ticket must be the i64 scalar AllReduceStart returned, got {ticket}"
        )));
    }
    let shape = Shape::new(&attrs.dims("shape")?);
    shape.checked_numel()?;
    one(TensorMetadata::new(attrs.dtype("dtype")?, shape))
}

/// Waits for the all-reduce `ticket` names and returns its result, whose
/// dtype and shape (those of the started `x`) are attributes so the shape
/// rule knows them.
pub static ALL_REDUCE_DONE: OpDef = OpDef {
    name: "AllReduceDone",
    inputs: &["ticket"],
    variadic: false,
    outputs: 1,
    attrs: &[
        AttrSpec::required("dtype", AttrKind::DType),
        AttrSpec::required("shape", AttrKind::Ints),
    ],
    kind: OpKind::Other,
    effect: Effect::SideEffecting,
    shape_kind: ShapeKind::Static,
    metadata: done_meta,
    grad: None,
};

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(def: &OpDef, x: TensorMetadata, attrs: &OpAttrs) -> Result<OutputMetas> {
        (def.metadata)(&[x], &Attrs::new(attrs, def))
    }

    fn f32s(dims: &[usize]) -> TensorMetadata {
        TensorMetadata::new(DType::F32, Shape::new(dims))
    }

    #[test]
    fn gather_and_scatter_scale_axis_zero() {
        let mut attrs = OpAttrs::new();
        attrs.set_int("world_size", 4);
        let out = meta(&ALL_GATHER, f32s(&[3, 2]), &attrs).unwrap();
        assert_eq!(out[0].shape.dims(), &[12, 2]);
        let out = meta(&REDUCE_SCATTER, f32s(&[8, 2]), &attrs).unwrap();
        assert_eq!(out[0].shape.dims(), &[2, 2]);
        let err = meta(&REDUCE_SCATTER, f32s(&[6, 2]), &attrs).unwrap_err();
        assert!(err.to_string().contains("not a multiple of 4"), "{err}");
        let err = meta(&ALL_GATHER, f32s(&[]), &attrs).unwrap_err();
        assert!(err.to_string().contains("at least one axis"), "{err}");
    }

    #[test]
    fn bad_attributes_are_named() {
        let mut attrs = OpAttrs::new();
        attrs.set_int("world_size", 2).set_str("reduction", "avg");
        let err = meta(&ALL_REDUCE, f32s(&[3]), &attrs).unwrap_err();
        assert!(err.to_string().contains("unknown reduction `avg`"), "{err}");
        let mut attrs = OpAttrs::new();
        attrs.set_int("world_size", 2).set_int("root", 2);
        let err = meta(&BROADCAST, f32s(&[3]), &attrs).unwrap_err();
        assert!(err.to_string().contains("root 2"), "{err}");
        let mut attrs = OpAttrs::new();
        attrs.set_int("world_size", 0);
        assert!(meta(&ALL_REDUCE, f32s(&[3]), &attrs).is_err());
        let mut attrs = OpAttrs::new();
        attrs.set_int("world_size", 2);
        let bools = TensorMetadata::new(DType::Bool, Shape::new(&[3]));
        assert!(meta(&ALL_REDUCE, bools, &attrs).is_err());
    }
}
