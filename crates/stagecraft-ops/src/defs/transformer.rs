//! Transformer building blocks: embedding lookup, layer and RMS
//! normalization over the last axis, and cross-entropy fused with
//! log-softmax, each with a fused backward op.
//!
//! The normalizations and the loss are primitives rather than composites
//! of reductions and elementwise ops so that one kernel computes a row's
//! statistics and its outputs in one sweep while the row is in cache.
//! Each forward op also returns the per-row statistics its backward reads
//! (mean and reciprocal standard deviation, or the log-sum-exp) as extra
//! outputs, the way a recorded `If` returns its intermediates: the
//! backward recomputes nothing, and a caller that wants only the result
//! ignores them. Statistics of f16 and bf16 inputs are f32, the type they
//! are computed in (PyTorch keeps them in its accumulation type too).
//!
//! The backward ops (`LayerNormGrad`, `RmsNormGrad`, `CrossEntropyGrad`)
//! have gradient rules of their own, written with elementwise ops and
//! reductions over the last axis (and, for the loss, `CrossEntropyGrad`
//! itself), so second and higher derivatives exist; the forward rules also
//! take gradients flowing into the statistics outputs, which those
//! second-order rules produce.
//!
//! Optional parameters (`weight`, `bias`) are optional inputs: the ops
//! are variadic, and the bool attributes `has_weight` and `has_bias` say
//! which of the parameters follow `x`, so an absent parameter costs
//! neither memory nor arithmetic.

use super::{one, require_float, require_int, INDEX_ADD};
use crate::attrs::AttrKind;
use crate::grad::{GradBuilder, GradContext, InputGrads, G};
use crate::op::*;
use smallvec::{smallvec, SmallVec};
use stagecraft_tensor::{DType, Error, Result, Shape, TensorMetadata};

/// The dtype of the per-row statistics of a float input of `dtype`: f32
/// for f16 and bf16 (the type their rows are computed in), else `dtype`.
pub fn stats_dtype(dtype: DType) -> DType {
    match dtype {
        DType::F16 | DType::BF16 => DType::F32,
        other => other,
    }
}

// ---------------------------------------------------------------------------
// Embedding.

/// `Embedding(table: [V, D], ids: [..]) -> [.., D]`: row `ids[i]` of the
/// table for every id (i32 or i64, any shape). An id outside `[0, V)` is
/// an `Index` error of the kernel (negative ids do not count from the end,
/// as they do for `Gather`: a negative token id is a bug). The gradient
/// with respect to the table index-adds the incoming rows into zeros,
/// O(ids × D), never a one-hot product over the vocabulary.
pub static EMBEDDING: OpDef = OpDef {
    name: "Embedding",
    inputs: &["table", "ids"],
    variadic: false,
    outputs: 1,
    attrs: &[],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: embedding_meta,
    grad: Some(embedding_grad),
};

fn embedding_meta(inputs: &[TensorMetadata], _: &Attrs<'_>) -> Result<OutputMetas> {
    let (table, ids) = (&inputs[0], &inputs[1]);
    require_float("table", table)?;
    require_int("ids", ids)?;
    if table.shape.rank() != 2 {
        return Err(Error::shape(format!(
            "the table {table} must be [V, D]: one row of D values per id"
        )));
    }
    let mut shape = ids.shape.clone();
    shape.push(table.shape[1]);
    one(TensorMetadata::new(table.dtype, shape))
}

fn embedding_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let (table, ids, g) = (ctx.inputs[0], ctx.inputs[1], ctx.grad()?);
    let tm = b.meta(table);
    let count = b.meta(ids).shape.checked_numel()?;
    let flat_ids = b.reshape(ids, &[count])?;
    let rows = b.reshape(g, &[count, tm.shape[1]])?;
    let zeros = b.fill(0.0, &tm)?;
    let mut attrs = crate::OpAttrs::new();
    attrs.set_int("axis", 0);
    let dtable = b.op(&INDEX_ADD, &[zeros, flat_ids, rows], &attrs)?;
    Ok(smallvec![Some(dtable), None])
}

// ---------------------------------------------------------------------------
// Layer norm and RMS norm.

const HAS_WEIGHT: AttrSpec =
    AttrSpec::optional("has_weight", AttrKind::Bool, AttrDefault::Bool(false));
const HAS_BIAS: AttrSpec = AttrSpec::optional("has_bias", AttrKind::Bool, AttrDefault::Bool(false));
const EPS: AttrSpec = AttrSpec::optional("eps", AttrKind::Float, AttrDefault::Float(1e-5));

/// `LayerNorm(x, [weight], [bias]) -> (y, mean, rstd)` over the last axis
/// of `x: [.., D]`: `y = (x - mean)·rstd·weight + bias` with `mean` and
/// `rstd = 1/sqrt(var + eps)` (the population variance) per row, both of
/// shape `[..]` in [`stats_dtype`]. `weight` and `bias` (each `[D]`, of
/// `x`'s dtype) are present when `has_weight` / `has_bias` say so. A row
/// of no elements has NaN statistics.
pub static LAYER_NORM: OpDef = OpDef {
    name: "LayerNorm",
    inputs: &["x"],
    variadic: true,
    outputs: 3,
    attrs: &[HAS_WEIGHT, HAS_BIAS, EPS],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: layer_norm_meta,
    grad: Some(layer_norm_grad),
};

/// `LayerNormGrad(g, x, mean, rstd, [weight]) -> (dx, [dweight],
/// [dbias])`: the gradient of [`LAYER_NORM`] for the incoming gradient `g`
/// of `y`, reading the forward statistics. `dweight` is output when
/// `has_weight`, `dbias` when `has_bias`; both sum over every row.
pub static LAYER_NORM_GRAD: OpDef = OpDef {
    name: "LayerNormGrad",
    inputs: &["g", "x", "mean", "rstd"],
    variadic: true,
    outputs: 3,
    attrs: &[HAS_WEIGHT, HAS_BIAS],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: layer_norm_grad_meta,
    grad: Some(layer_norm_grad_grad),
};

/// `RmsNorm(x, [weight]) -> (y, rstd)` over the last axis of `x: [.., D]`:
/// `y = x·rstd·weight` with `rstd = 1/sqrt(mean(x²) + eps)` per row, of
/// shape `[..]` in [`stats_dtype`]. `weight` (`[D]`) is present when
/// `has_weight` says so.
pub static RMS_NORM: OpDef = OpDef {
    name: "RmsNorm",
    inputs: &["x"],
    variadic: true,
    outputs: 2,
    attrs: &[HAS_WEIGHT, EPS],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: rms_norm_meta,
    grad: Some(rms_norm_grad),
};

/// `RmsNormGrad(g, x, rstd, [weight]) -> (dx, [dweight])`: the gradient
/// of [`RMS_NORM`] for the incoming gradient `g` of `y`.
pub static RMS_NORM_GRAD: OpDef = OpDef {
    name: "RmsNormGrad",
    inputs: &["g", "x", "rstd"],
    variadic: true,
    outputs: 2,
    attrs: &[HAS_WEIGHT],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: rms_norm_grad_meta,
    grad: Some(rms_norm_grad_grad),
};

/// Whether the weight and the bias are present (`has_bias` is false for
/// ops that have no bias).
fn param_flags(attrs: &Attrs<'_>) -> Result<(bool, bool)> {
    let has_bias = attrs.op().attrs.iter().any(|s| s.name == "has_bias");
    Ok((
        attrs.bool("has_weight")?,
        has_bias && attrs.bool("has_bias")?,
    ))
}

/// The size of the normalized (last) axis of `x`, which must be a float
/// tensor with at least one axis.
fn normalized_size(x: &TensorMetadata) -> Result<usize> {
    require_float("x", x)?;
    match x.shape.dims().last() {
        Some(&d) => Ok(d),
        None => Err(Error::shape(format!(
            "x {x} needs at least one axis (the last one is normalized)"
        ))),
    }
}

/// Checks that the inputs after the first `fixed` are the present
/// parameters, in order, each `[D]` of `dtype`.
fn check_params(
    inputs: &[TensorMetadata],
    fixed: usize,
    params: &[(&str, bool)],
    d: usize,
    dtype: DType,
) -> Result<()> {
    let present: SmallVec<[&str; 2]> = params
        .iter()
        .filter(|(_, on)| *on)
        .map(|(name, _)| *name)
        .collect();
    let extra = &inputs[fixed.min(inputs.len())..];
    if extra.len() != present.len() {
        let flags: Vec<String> = params
            .iter()
            .map(|(name, on)| format!("has_{name} = {on}"))
            .collect();
        return Err(Error::invalid(format!(
            "with {} the op takes {} parameter input(s) after its first {fixed} ({}), got {}",
            flags.join(", "),
            present.len(),
            if present.is_empty() {
                "none".to_string()
            } else {
                present.join(", ")
            },
            extra.len()
        )));
    }
    for (name, meta) in present.iter().zip(extra) {
        if meta.dtype != dtype || meta.shape.dims() != [d] {
            return Err(Error::shape(format!(
                "{name} {meta} must be [{d}] of {dtype}, one value per element of the normalized axis"
            )));
        }
    }
    Ok(())
}

fn check_eps(attrs: &Attrs<'_>) -> Result<()> {
    let eps = attrs.float("eps")?;
    if eps.is_finite() && eps >= 0.0 {
        Ok(())
    } else {
        Err(Error::attribute(format!(
            "eps must be finite and non-negative, got {eps}"
        )))
    }
}

/// The metadata of per-row statistics of `x`: its leading axes, in
/// [`stats_dtype`].
fn stats_meta(x: &TensorMetadata) -> TensorMetadata {
    let dims = x.shape.dims();
    TensorMetadata::new(stats_dtype(x.dtype), &dims[..dims.len() - 1])
}

/// Checks a statistics input of a backward op against `x`.
fn check_stat(name: &str, meta: &TensorMetadata, x: &TensorMetadata) -> Result<()> {
    let want = stats_meta(x);
    if meta == &want {
        Ok(())
    } else {
        Err(Error::shape(format!(
            "{name} {meta} must be {want}: one statistic per row of x {x}"
        )))
    }
}

/// Checks the incoming gradient `g` against `x`.
fn check_same(g: &TensorMetadata, x: &TensorMetadata) -> Result<()> {
    if g == x {
        Ok(())
    } else {
        Err(Error::shape(format!(
            "the gradient g {g} must have the dtype and shape of x {x}"
        )))
    }
}

fn layer_norm_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let x = &inputs[0];
    let d = normalized_size(x)?;
    let (has_weight, has_bias) = param_flags(attrs)?;
    check_params(
        inputs,
        1,
        &[("weight", has_weight), ("bias", has_bias)],
        d,
        x.dtype,
    )?;
    check_eps(attrs)?;
    let stats = stats_meta(x);
    Ok(smallvec![x.clone(), stats.clone(), stats])
}

fn layer_norm_grad_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let (g, x) = (&inputs[0], &inputs[1]);
    let d = normalized_size(x)?;
    check_same(g, x)?;
    check_stat("mean", &inputs[2], x)?;
    check_stat("rstd", &inputs[3], x)?;
    let (has_weight, has_bias) = param_flags(attrs)?;
    check_params(inputs, 4, &[("weight", has_weight)], d, x.dtype)?;
    let param = TensorMetadata::new(x.dtype, [d]);
    let mut out: OutputMetas = smallvec![x.clone()];
    if has_weight {
        out.push(param.clone());
    }
    if has_bias {
        out.push(param);
    }
    Ok(out)
}

fn rms_norm_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let x = &inputs[0];
    let d = normalized_size(x)?;
    let (has_weight, _) = param_flags(attrs)?;
    check_params(inputs, 1, &[("weight", has_weight)], d, x.dtype)?;
    check_eps(attrs)?;
    Ok(smallvec![x.clone(), stats_meta(x)])
}

fn rms_norm_grad_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let (g, x) = (&inputs[0], &inputs[1]);
    let d = normalized_size(x)?;
    check_same(g, x)?;
    check_stat("rstd", &inputs[2], x)?;
    let (has_weight, _) = param_flags(attrs)?;
    check_params(inputs, 3, &[("weight", has_weight)], d, x.dtype)?;
    let mut out: OutputMetas = smallvec![x.clone()];
    if has_weight {
        out.push(TensorMetadata::new(x.dtype, [d]));
    }
    Ok(out)
}

// ---------------------------------------------------------------------------
// Cross-entropy.

const IGNORE_INDEX: AttrSpec =
    AttrSpec::optional("ignore_index", AttrKind::Ints, AttrDefault::Ints(&[]));
const REDUCTION: AttrSpec =
    AttrSpec::optional("reduction", AttrKind::Str, AttrDefault::Str("mean"));

/// How a loss reduces its per-row values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LossReduction {
    /// One loss per row (ignored rows give 0).
    None,
    /// The mean over the rows whose target is not ignored (NaN when there
    /// are none, as in PyTorch).
    Mean,
    /// The sum over every row (ignored rows add 0).
    Sum,
}

impl LossReduction {
    /// The attribute's text: `"none"`, `"mean"` or `"sum"`.
    pub fn as_str(self) -> &'static str {
        match self {
            LossReduction::None => "none",
            LossReduction::Mean => "mean",
            LossReduction::Sum => "sum",
        }
    }

    /// Reads the `reduction` attribute of a loss op.
    pub fn of(attrs: &Attrs<'_>) -> Result<LossReduction> {
        match attrs.str("reduction")? {
            "none" => Ok(LossReduction::None),
            "mean" => Ok(LossReduction::Mean),
            "sum" => Ok(LossReduction::Sum),
            other => Err(Error::attribute(format!(
                "reduction must be \"none\", \"mean\" or \"sum\", got {other:?}"
            ))),
        }
    }
}

/// The target value that marks a row as ignored, if any (the
/// `ignore_index` attribute: empty, or one value).
pub fn ignore_index(attrs: &Attrs<'_>) -> Result<Option<i64>> {
    match attrs.ints("ignore_index")? {
        [] => Ok(None),
        [v] => Ok(Some(*v)),
        more => Err(Error::attribute(format!(
            "ignore_index holds at most one value, got {more:?}"
        ))),
    }
}

/// `CrossEntropy(logits: [.., C], targets: [..]) -> (loss, lse)`:
/// `lse - logits[target]` per row, with `lse = log Σ exp(logits)` over
/// the classes computed after subtracting the row's maximum, so no
/// exponential overflows. Targets (i32 or i64) lie in `[0, C)` or equal
/// `ignore_index` (when that attribute holds a value); any other target
/// is an `Index` error of the kernel. An ignored row's loss is 0 and it
/// gets no gradient. `reduction` is `"none"` (loss `[..]`), `"mean"` (a
/// scalar: the sum over the rows not ignored divided by their count, NaN
/// when every row is ignored, as in PyTorch) or `"sum"` (a scalar). `lse`
/// (`[..]`, in [`stats_dtype`]) is what the backward reads.
pub static CROSS_ENTROPY: OpDef = OpDef {
    name: "CrossEntropy",
    inputs: &["logits", "targets"],
    variadic: false,
    outputs: 2,
    attrs: &[IGNORE_INDEX, REDUCTION],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: cross_entropy_meta,
    grad: Some(cross_entropy_grad),
};

/// `CrossEntropyGrad(logits, targets, lse, g) -> dlogits`: the gradient
/// of [`CROSS_ENTROPY`] for the incoming gradient `g` of its loss (of the
/// loss's shape): `(softmax(logits) - one_hot(target))·s` row by row,
/// `s` being the row's share of `g` (`g[row]`, `g` or `g / count` by
/// reduction), with `softmax = exp(logits - lse)` and no one-hot tensor
/// ever made; ignored rows get 0. With `subtract_target = false` the
/// one-hot term is left out (`softmax·s`), which the op's own gradient
/// rule uses.
pub static CROSS_ENTROPY_GRAD: OpDef = OpDef {
    name: "CrossEntropyGrad",
    inputs: &["logits", "targets", "lse", "g"],
    variadic: false,
    outputs: 1,
    attrs: &[
        IGNORE_INDEX,
        REDUCTION,
        AttrSpec::optional("subtract_target", AttrKind::Bool, AttrDefault::Bool(true)),
    ],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: cross_entropy_grad_meta,
    grad: Some(cross_entropy_grad_grad),
};

/// Checks logits and targets and returns the loss's metadata.
fn loss_meta(
    logits: &TensorMetadata,
    targets: &TensorMetadata,
    attrs: &Attrs<'_>,
) -> Result<TensorMetadata> {
    require_float("logits", logits)?;
    require_int("targets", targets)?;
    let dims = logits.shape.dims();
    if dims.is_empty() {
        return Err(Error::shape(format!(
            "logits {logits} need at least one axis (the last one holds the classes)"
        )));
    }
    let lead = &dims[..dims.len() - 1];
    if targets.shape.dims() != lead {
        return Err(Error::shape(format!(
            "targets {targets} must have the shape of logits {logits} without its last (class) axis, {:?}",
            lead
        )));
    }
    ignore_index(attrs)?;
    Ok(match LossReduction::of(attrs)? {
        LossReduction::None => TensorMetadata::new(logits.dtype, lead),
        LossReduction::Mean | LossReduction::Sum => {
            TensorMetadata::new(logits.dtype, Shape::scalar())
        }
    })
}

fn cross_entropy_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let (logits, targets) = (&inputs[0], &inputs[1]);
    let loss = loss_meta(logits, targets, attrs)?;
    Ok(smallvec![loss, stats_meta(logits)])
}

fn cross_entropy_grad_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let (logits, targets, lse, g) = (&inputs[0], &inputs[1], &inputs[2], &inputs[3]);
    let loss = loss_meta(logits, targets, attrs)?;
    check_stat("lse", lse, logits)?;
    if g != &loss {
        return Err(Error::shape(format!(
            "the gradient g {g} must have the dtype and shape of the loss, {loss}"
        )));
    }
    one(logits.clone())
}

// ---------------------------------------------------------------------------
// Gradient rules.

/// Shorthands for the rules below, which work on rows: the last axis of
/// `x` and one statistic per row.
struct Rows {
    /// The rank of `x`.
    rank: usize,
    /// The size of the last axis.
    d: usize,
    /// `x`'s dtype, which the rules compute in.
    dtype: DType,
    /// `x`'s leading axes with a trailing 1: a statistic as a column.
    column: SmallVec<[usize; 4]>,
    /// The statistics' metadata.
    stats: TensorMetadata,
}

impl Rows {
    fn of(x: &TensorMetadata) -> Rows {
        let dims = x.shape.dims();
        let mut column: SmallVec<[usize; 4]> = SmallVec::from_slice(&dims[..dims.len() - 1]);
        column.push(1);
        Rows {
            rank: dims.len(),
            d: dims[dims.len() - 1],
            dtype: x.dtype,
            column,
            stats: stats_meta(x),
        }
    }

    /// A statistic `[..]` as a column `[.., 1]` of `x`'s dtype.
    fn column(&self, b: &mut dyn GradBuilder, stat: G) -> Result<G> {
        let c = b.reshape(stat, &self.column)?;
        if b.meta(c).dtype == self.dtype {
            Ok(c)
        } else {
            b.cast(c, self.dtype)
        }
    }

    /// A column back as a statistic (the gradient of one).
    fn stat(&self, b: &mut dyn GradBuilder, column: G) -> Result<G> {
        let s = b.reshape(column, self.stats.shape.dims())?;
        if self.stats.dtype == self.dtype {
            Ok(s)
        } else {
            b.cast(s, self.stats.dtype)
        }
    }

    /// `Σ t` over the last axis, kept as a column.
    fn sum(&self, b: &mut dyn GradBuilder, t: G) -> Result<G> {
        b.sum(t, &[self.rank - 1], true)
    }

    /// The mean over the last axis, kept as a column.
    fn mean(&self, b: &mut dyn GradBuilder, t: G) -> Result<G> {
        let s = self.sum(b, t)?;
        b.scale(s, 1.0 / self.d as f64)
    }
}

/// `a + b` where either may be absent.
fn plus(b: &mut dyn GradBuilder, acc: Option<G>, t: G) -> Result<Option<G>> {
    Ok(Some(match acc {
        Some(a) => b.add(a, t)?,
        None => t,
    }))
}

/// The incoming gradient of output `k`, if one flows.
fn incoming(ctx: &GradContext<'_>, k: usize) -> Option<G> {
    ctx.grads.get(k).copied().flatten()
}

fn norm_grad_attrs(has_weight: bool, has_bias: Option<bool>) -> crate::OpAttrs {
    let mut attrs = crate::OpAttrs::new();
    attrs.set_bool("has_weight", has_weight);
    if let Some(has_bias) = has_bias {
        attrs.set_bool("has_bias", has_bias);
    }
    attrs
}

/// The gradient through a norm's statistics outputs (reached only by
/// higher-order rules): `mean = Σx/D` gives `gmean/D`, and `rstd =
/// (var + eps)^(-1/2)` gives `-grstd·rstd³·c/D` with `c` the centered
/// input (`x - mean` for layer norm, whose variance does not move with the
/// mean; `x` for RMS norm).
fn stats_grad(
    b: &mut dyn GradBuilder,
    x: G,
    mean: Option<G>,
    rstd: G,
    gmean: Option<G>,
    grstd: Option<G>,
) -> Result<Option<G>> {
    let xm = b.meta(x);
    let rows = Rows::of(&xm);
    let mut dx = None;
    if let Some(gm) = gmean {
        let gm = rows.column(b, gm)?;
        let share = b.scale(gm, 1.0 / rows.d as f64)?;
        let spread = b.broadcast_to(share, xm.shape.dims())?;
        dx = plus(b, dx, spread)?;
    }
    if let Some(gr) = grstd {
        let gr = rows.column(b, gr)?;
        let r = rows.column(b, rstd)?;
        let centered = match mean {
            Some(m) => {
                let m = rows.column(b, m)?;
                b.sub(x, m)?
            }
            None => x,
        };
        let r2 = b.mul(r, r)?;
        let r3 = b.mul(r2, r)?;
        let k = b.mul(gr, r3)?;
        let t = b.mul(k, centered)?;
        let t = b.scale(t, -1.0 / rows.d as f64)?;
        dx = plus(b, dx, t)?;
    }
    Ok(dx)
}

fn layer_norm_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let (has_weight, has_bias) = param_flags(&ctx.attrs)?;
    let x = ctx.inputs[0];
    let (mean, rstd) = (ctx.outputs[1], ctx.outputs[2]);
    let mut out: InputGrads = smallvec![None; ctx.inputs.len()];
    if let Some(gy) = incoming(ctx, 0) {
        let mut args: SmallVec<[G; 5]> = smallvec![gy, x, mean, rstd];
        if has_weight {
            args.push(ctx.inputs[1]);
        }
        let grads = b.op_multi(
            &LAYER_NORM_GRAD,
            &args,
            &norm_grad_attrs(has_weight, Some(has_bias)),
        )?;
        let mut grads = grads.into_iter();
        out[0] = grads.next();
        if has_weight {
            out[1] = grads.next();
        }
        if has_bias {
            out[1 + has_weight as usize] = grads.next();
        }
    }
    let extra = stats_grad(b, x, Some(mean), rstd, incoming(ctx, 1), incoming(ctx, 2))?;
    if let Some(extra) = extra {
        out[0] = plus(b, out[0], extra)?;
    }
    Ok(out)
}

fn rms_norm_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let (has_weight, _) = param_flags(&ctx.attrs)?;
    let x = ctx.inputs[0];
    let rstd = ctx.outputs[1];
    let mut out: InputGrads = smallvec![None; ctx.inputs.len()];
    if let Some(gy) = incoming(ctx, 0) {
        let mut args: SmallVec<[G; 4]> = smallvec![gy, x, rstd];
        if has_weight {
            args.push(ctx.inputs[1]);
        }
        let grads = b.op_multi(&RMS_NORM_GRAD, &args, &norm_grad_attrs(has_weight, None))?;
        let mut grads = grads.into_iter();
        out[0] = grads.next();
        if has_weight {
            out[1] = grads.next();
        }
    }
    if let Some(extra) = stats_grad(b, x, None, rstd, None, incoming(ctx, 1))? {
        out[0] = plus(b, out[0], extra)?;
    }
    Ok(out)
}

/// The second-order rule shared by both norms' backward ops. The backward
/// computes, per row, with `xh = (x - mean)·rstd` (`x·rstd` for RMS norm)
/// and `a = g·weight`,
///
/// `dx = rstd·(a - mean(a) - xh·mean(a·xh))` (RMS norm: without
/// `mean(a)`), `dweight = Σ_rows g·xh`, `dbias = Σ_rows g`,
///
/// treating `mean` and `rstd` as inputs of their own; their gradients go
/// back to the forward op, whose rule takes them through the statistics.
/// `U`, `P`, `Q` are the incoming gradients of `dx`, `dweight`, `dbias`.
/// Returns the gradients of `(g, x, mean, rstd, weight)`, `mean` absent
/// for RMS norm.
#[allow(clippy::too_many_arguments)]
fn norm_backward_grad(
    b: &mut dyn GradBuilder,
    g: G,
    x: G,
    mean: Option<G>,
    rstd: G,
    weight: Option<G>,
    u: Option<G>,
    p: Option<G>,
    q: Option<G>,
) -> Result<[Option<G>; 5]> {
    let xm = b.meta(x);
    let rows = Rows::of(&xm);
    let r = rows.column(b, rstd)?;
    let centered = match mean {
        Some(m) => {
            let m = rows.column(b, m)?;
            b.sub(x, m)?
        }
        None => x,
    };
    let xh = b.mul(centered, r)?;
    let a = match weight {
        Some(w) => b.mul(g, w)?,
        None => g,
    };
    let (mut gg, mut gxh, mut gw, mut grstd) = (None, None, None, None);
    if let Some(u) = u {
        let axh = b.mul(a, xh)?;
        let m2 = rows.mean(b, axh)?;
        let v = b.mul(u, r)?;
        let vxh = b.mul(v, xh)?;
        let mvx = rows.mean(b, vxh)?;
        // Through `a` (directly, and through mean(a) and mean(a·xh)).
        let xh_mvx = b.mul(xh, mvx)?;
        let mut ga = b.sub(v, xh_mvx)?;
        // Through xh (directly, and through mean(a·xh)).
        let v_m2 = b.mul(v, m2)?;
        let a_mvx = b.mul(a, mvx)?;
        let t = b.add(v_m2, a_mvx)?;
        let t = b.neg(t)?;
        gxh = plus(b, gxh, t)?;
        // Through the leading rstd: Σ U·(a - mean(a) - xh·mean(a·xh)).
        let xh_m2 = b.mul(xh, m2)?;
        let mut z = b.sub(a, xh_m2)?;
        if mean.is_some() {
            let mv = rows.mean(b, v)?;
            ga = b.sub(ga, mv)?;
            let m1 = rows.mean(b, a)?;
            z = b.sub(z, m1)?;
        }
        let uz = b.mul(u, z)?;
        let t = rows.sum(b, uz)?;
        grstd = plus(b, grstd, t)?;
        match weight {
            Some(w) => {
                let t = b.mul(ga, w)?;
                gg = plus(b, gg, t)?;
                let t = b.mul(ga, g)?;
                let t = b.unbroadcast(t, &Shape::new(&[rows.d]))?;
                gw = plus(b, gw, t)?;
            }
            None => gg = plus(b, gg, ga)?,
        }
    }
    if let Some(p) = p {
        let t = b.mul(p, xh)?;
        gg = plus(b, gg, t)?;
        let t = b.mul(p, g)?;
        gxh = plus(b, gxh, t)?;
    }
    if let Some(q) = q {
        let t = b.broadcast_to(q, xm.shape.dims())?;
        gg = plus(b, gg, t)?;
    }
    let (mut gx, mut gmean) = (None, None);
    if let Some(gxh) = gxh {
        let t = b.mul(gxh, r)?;
        gx = Some(t);
        if mean.is_some() {
            let s = rows.sum(b, t)?;
            let s = b.neg(s)?;
            gmean = Some(rows.stat(b, s)?);
        }
        let t = b.mul(gxh, centered)?;
        let t = rows.sum(b, t)?;
        grstd = plus(b, grstd, t)?;
    }
    let grstd = match grstd {
        Some(t) => Some(rows.stat(b, t)?),
        None => None,
    };
    Ok([gg, gx, gmean, grstd, gw])
}

fn layer_norm_grad_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let (has_weight, has_bias) = param_flags(&ctx.attrs)?;
    let i = ctx.inputs;
    let weight = has_weight.then(|| i[4]);
    let p = if has_weight { incoming(ctx, 1) } else { None };
    let q = if has_bias {
        incoming(ctx, 1 + has_weight as usize)
    } else {
        None
    };
    let [gg, gx, gmean, grstd, gw] = norm_backward_grad(
        b,
        i[0],
        i[1],
        Some(i[2]),
        i[3],
        weight,
        incoming(ctx, 0),
        p,
        q,
    )?;
    let mut out: InputGrads = smallvec![gg, gx, gmean, grstd];
    if has_weight {
        out.push(gw);
    }
    Ok(out)
}

fn rms_norm_grad_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let (has_weight, _) = param_flags(&ctx.attrs)?;
    let i = ctx.inputs;
    let weight = has_weight.then(|| i[3]);
    let p = if has_weight { incoming(ctx, 1) } else { None };
    let [gg, gx, _, grstd, gw] =
        norm_backward_grad(b, i[0], i[1], None, i[2], weight, incoming(ctx, 0), p, None)?;
    let mut out: InputGrads = smallvec![gg, gx, grstd];
    if has_weight {
        out.push(gw);
    }
    Ok(out)
}

/// The loss attributes of a `CrossEntropyGrad` called from the rules.
fn loss_grad_attrs(attrs: &Attrs<'_>, subtract_target: bool) -> Result<crate::OpAttrs> {
    let mut out = crate::OpAttrs::new();
    out.set_ints("ignore_index", attrs.ints("ignore_index")?)
        .set_str("reduction", attrs.str("reduction")?)
        .set_bool("subtract_target", subtract_target);
    Ok(out)
}

/// The loss's gradient is the fused backward; a gradient flowing into
/// `lse` (only from higher-order rules) adds `glse·softmax(logits)`.
fn cross_entropy_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let (logits, targets, lse) = (ctx.inputs[0], ctx.inputs[1], ctx.outputs[1]);
    let mut dx = None;
    if let Some(g) = incoming(ctx, 0) {
        let attrs = loss_grad_attrs(&ctx.attrs, true)?;
        dx = Some(b.op(&CROSS_ENTROPY_GRAD, &[logits, targets, lse, g], &attrs)?);
    }
    if let Some(gl) = incoming(ctx, 1) {
        let rows = Rows::of(&b.meta(logits));
        let l = rows.column(b, lse)?;
        let shifted = b.sub(logits, l)?;
        let p = b.unary(&crate::EXP, shifted)?;
        let gl = rows.column(b, gl)?;
        let t = b.mul(gl, p)?;
        dx = plus(b, dx, t)?;
    }
    Ok(smallvec![dx, None])
}

/// `CrossEntropyGrad` computes `o = (p - σ·onehot)·s(g)` with `p =
/// exp(logits - lse)` (`lse` an input of its own), `σ` the
/// `subtract_target` flag and `s` linear in `g`. So for an incoming `U`:
/// the logits get `U·p·s` (`p` moves with its own logit only), which is
/// `U` times the op without the one-hot term; `lse` gets minus that
/// summed over the classes; and `g` gets `U·o(1)` summed to `g`'s shape,
/// `o(1)` being the op at a gradient of ones.
fn cross_entropy_grad_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let (logits, targets, lse, g) = (ctx.inputs[0], ctx.inputs[1], ctx.inputs[2], ctx.inputs[3]);
    let u = ctx.grad()?;
    let rows = Rows::of(&b.meta(logits));
    let soft = b.op(
        &CROSS_ENTROPY_GRAD,
        &[logits, targets, lse, g],
        &loss_grad_attrs(&ctx.attrs, false)?,
    )?;
    let dlogits = b.mul(u, soft)?;
    let s = rows.sum(b, dlogits)?;
    let s = b.neg(s)?;
    let dlse = rows.stat(b, s)?;
    let gm = b.meta(g);
    let ones = b.fill(1.0, &gm)?;
    let unit = b.op(
        &CROSS_ENTROPY_GRAD,
        &[logits, targets, lse, ones],
        &loss_grad_attrs(&ctx.attrs, ctx.attrs.bool("subtract_target")?)?,
    )?;
    let per = b.mul(u, unit)?;
    let dg = match LossReduction::of(&ctx.attrs)? {
        LossReduction::None => {
            let t = rows.sum(b, per)?;
            b.reshape(t, gm.shape.dims())?
        }
        LossReduction::Mean | LossReduction::Sum => b.sum(per, &[], false)?,
    };
    Ok(smallvec![Some(dlogits), None, Some(dlse), Some(dg)])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::OpAttrs;
    use proptest::prelude::*;

    fn m(dtype: DType, dims: &[usize]) -> TensorMetadata {
        TensorMetadata::new(dtype, dims)
    }
    fn f(dims: &[usize]) -> TensorMetadata {
        m(DType::F32, dims)
    }
    fn flags(weight: bool, bias: bool) -> OpAttrs {
        let mut a = OpAttrs::new();
        a.set_bool("has_weight", weight).set_bool("has_bias", bias);
        a
    }

    #[test]
    fn embedding_rules() {
        let out = EMBEDDING.infer(&[f(&[10, 4]), m(DType::I32, &[2, 3])], &OpAttrs::new());
        assert_eq!(out.unwrap()[0], f(&[2, 3, 4]));
        let out = EMBEDDING.infer(
            &[m(DType::F64, &[10, 4]), m(DType::I64, &[])],
            &OpAttrs::new(),
        );
        assert_eq!(out.unwrap()[0], m(DType::F64, &[4]));
        let bad = [
            vec![f(&[10]), m(DType::I64, &[2])],
            vec![f(&[10, 4, 1]), m(DType::I64, &[2])],
            vec![f(&[10, 4]), f(&[2])],
            vec![m(DType::I32, &[10, 4]), m(DType::I64, &[2])],
        ];
        for inputs in bad {
            assert!(
                EMBEDDING.infer(&inputs, &OpAttrs::new()).is_err(),
                "{inputs:?}"
            );
        }
    }

    #[test]
    fn norm_rules() {
        let x = m(DType::BF16, &[2, 3, 8]);
        let w = m(DType::BF16, &[8]);
        let out = LAYER_NORM
            .infer(&[x.clone(), w.clone(), w.clone()], &flags(true, true))
            .unwrap();
        let stats = m(DType::F32, &[2, 3]);
        assert_eq!(out.as_slice(), &[x.clone(), stats.clone(), stats.clone()]);
        let out = LAYER_NORM
            .infer(std::slice::from_ref(&x), &OpAttrs::new())
            .unwrap();
        assert_eq!(out.len(), 3);
        // Too many or too few parameters, a wrong size, a wrong dtype, no
        // axis, a negative eps.
        assert!(LAYER_NORM
            .infer(&[x.clone(), w.clone()], &OpAttrs::new())
            .is_err());
        assert!(LAYER_NORM
            .infer(std::slice::from_ref(&x), &flags(true, false))
            .is_err());
        assert!(LAYER_NORM
            .infer(&[x.clone(), m(DType::BF16, &[3])], &flags(true, false))
            .is_err());
        assert!(LAYER_NORM
            .infer(&[x.clone(), m(DType::F32, &[8])], &flags(false, true))
            .is_err());
        assert!(LAYER_NORM.infer(&[f(&[])], &OpAttrs::new()).is_err());
        assert!(LAYER_NORM
            .infer(&[m(DType::I32, &[2, 3])], &OpAttrs::new())
            .is_err());
        let mut eps = OpAttrs::new();
        eps.set_float("eps", -1.0);
        assert!(LAYER_NORM.infer(&[f(&[2, 3])], &eps).is_err());
        eps.set_float("eps", f64::NAN);
        assert!(RMS_NORM.infer(&[f(&[2, 3])], &eps).is_err());

        let grads = LAYER_NORM_GRAD
            .infer(
                &[
                    x.clone(),
                    x.clone(),
                    stats.clone(),
                    stats.clone(),
                    w.clone(),
                ],
                &flags(true, true),
            )
            .unwrap();
        assert_eq!(grads.as_slice(), &[x.clone(), w.clone(), w.clone()]);
        let grads = LAYER_NORM_GRAD
            .infer(
                &[x.clone(), x.clone(), stats.clone(), stats.clone()],
                &flags(false, true),
            )
            .unwrap();
        assert_eq!(grads.as_slice(), &[x.clone(), w.clone()]);
        // Statistics in x's dtype rather than f32, or of the wrong shape.
        assert!(LAYER_NORM_GRAD
            .infer(
                &[x.clone(), x.clone(), m(DType::BF16, &[2, 3]), stats.clone()],
                &OpAttrs::new()
            )
            .is_err());
        assert!(RMS_NORM_GRAD
            .infer(
                &[x.clone(), x.clone(), m(DType::F32, &[2])],
                &OpAttrs::new()
            )
            .is_err());
        let out = RMS_NORM.infer(&[f(&[5, 0])], &OpAttrs::new()).unwrap();
        assert_eq!(out.as_slice(), &[f(&[5, 0]), f(&[5])]);
        // RMS norm has no bias.
        assert!(RMS_NORM.infer(&[f(&[5, 2])], &flags(false, true)).is_err());
    }

    #[test]
    fn cross_entropy_rules() {
        let logits = f(&[4, 10]);
        let t = m(DType::I64, &[4]);
        let out = CROSS_ENTROPY
            .infer(&[logits.clone(), t.clone()], &OpAttrs::new())
            .unwrap();
        assert_eq!(out.as_slice(), &[f(&[]), f(&[4])]);
        let mut none = OpAttrs::new();
        none.set_str("reduction", "none")
            .set_ints("ignore_index", &[-100]);
        let out = CROSS_ENTROPY
            .infer(&[f(&[2, 3, 5]), m(DType::I32, &[2, 3])], &none)
            .unwrap();
        assert_eq!(out.as_slice(), &[f(&[2, 3]), f(&[2, 3])]);
        let g = CROSS_ENTROPY_GRAD
            .infer(
                &[
                    f(&[2, 3, 5]),
                    m(DType::I32, &[2, 3]),
                    f(&[2, 3]),
                    f(&[2, 3]),
                ],
                &none,
            )
            .unwrap();
        assert_eq!(g[0], f(&[2, 3, 5]));
        let mut bad_reduction = OpAttrs::new();
        bad_reduction.set_str("reduction", "max");
        let mut two = OpAttrs::new();
        two.set_ints("ignore_index", &[0, 1]);
        for attrs in [bad_reduction, two] {
            assert!(CROSS_ENTROPY
                .infer(&[logits.clone(), t.clone()], &attrs)
                .is_err());
        }
        let bad = [
            vec![logits.clone(), m(DType::I64, &[5])],
            vec![logits.clone(), m(DType::I64, &[4, 1])],
            vec![logits.clone(), f(&[4])],
            vec![m(DType::I32, &[4, 10]), t.clone()],
            vec![f(&[]), m(DType::I64, &[])],
        ];
        for inputs in bad {
            assert!(
                CROSS_ENTROPY.infer(&inputs, &OpAttrs::new()).is_err(),
                "{inputs:?}"
            );
        }
        // The gradient of a mean loss is a scalar; lse is one per row.
        assert!(CROSS_ENTROPY_GRAD
            .infer(
                &[logits.clone(), t.clone(), f(&[4]), f(&[4])],
                &OpAttrs::new()
            )
            .is_err());
        assert!(CROSS_ENTROPY_GRAD
            .infer(
                &[logits.clone(), t.clone(), f(&[]), f(&[])],
                &OpAttrs::new()
            )
            .is_err());
    }

    proptest! {
        /// For any float input with at least one axis, the norms keep the
        /// input's metadata and give one statistic per row; the loss gives
        /// one value per row (or a scalar) and its gradient the logits'
        /// metadata.
        #[test]
        fn shapes_follow_the_rows(
            dims in prop::collection::vec(0usize..5, 1..5),
            dtype in prop::sample::select(vec![DType::F16, DType::BF16, DType::F32, DType::F64]),
            reduction in prop::sample::select(vec!["none", "mean", "sum"]),
        ) {
            let x = m(dtype, &dims);
            let lead = &dims[..dims.len() - 1];
            let stats = m(stats_dtype(dtype), lead);
            let ln = LAYER_NORM.infer(std::slice::from_ref(&x), &OpAttrs::new()).unwrap();
            prop_assert_eq!(ln.as_slice(), &[x.clone(), stats.clone(), stats.clone()]);
            let rms = RMS_NORM.infer(std::slice::from_ref(&x), &OpAttrs::new()).unwrap();
            prop_assert_eq!(rms.as_slice(), &[x.clone(), stats.clone()]);
            let mut a = OpAttrs::new();
            a.set_str("reduction", reduction);
            let targets = m(DType::I64, lead);
            let ce = CROSS_ENTROPY.infer(&[x.clone(), targets.clone()], &a).unwrap();
            let loss = if reduction == "none" { m(dtype, lead) } else { m(dtype, &[]) };
            prop_assert_eq!(ce.as_slice(), &[loss.clone(), stats.clone()]);
            let back = CROSS_ENTROPY_GRAD.infer(&[x.clone(), targets, stats, loss], &a).unwrap();
            prop_assert_eq!(back.as_slice(), &[x]);
        }
    }
}
