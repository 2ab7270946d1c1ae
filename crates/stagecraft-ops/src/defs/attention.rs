//! Scaled dot-product attention: one fused op, `softmax(q·kᵀ·scale +
//! mask)·v`, and its fused backward.
//!
//! The forward op returns, besides the attention output `O`, the
//! log-sum-exp `L` of every query row's scores: its backward recomputes
//! the probabilities of a block of scores as `exp(S − L)` from it, so
//! neither pass ever holds the `T × S` matrix of scores (see
//! `stagecraft-cpu/src/kernels/attention.rs`).
//!
//! **Causal masking** keeps key `j` for query `i` when `j ≤ i`, counted
//! from the first query and the first key (the upper-left alignment of
//! PyTorch's `is_causal`, which builds its mask as `ones(T, S).tril(0)`).
//! With more queries than keys (`T > S`), queries `S..T` see every key;
//! with fewer, keys `T..S` are seen by no query. Every query sees key 0,
//! so a row without keys happens only when there are no keys at all
//! (`S = 0`): its output is zeros and its `L` is `-∞` (an empty sum), as
//! the product of an empty softmax with an empty `v` gives in PyTorch's
//! reference formula.
//!
//! **Layouts.** With `layout = "bhtd"` (the default, PyTorch's) the
//! operands are `[B, H, T, D]`; with `"bthd"` (FlashAttention's) they are
//! `[B, T, H, D]`, what a `[B, T, H·D]` projection reshapes to without a
//! transpose, and the kernels read each head's rows in place, `H·D`
//! apart. Either way `O` has `q`'s shape with `Dv` last and `L` has `q`'s
//! shape without its last axis, and the two layouts give the same bits.

use super::{require_float, require_same_dtype, MATMUL, TRILU};
use crate::attrs::AttrKind;
use crate::grad::{GradBuilder, GradContext, InputGrads, G};
use crate::op::*;
use smallvec::{smallvec, SmallVec};
use stagecraft_tensor::{DType, Error, Result, Shape, TensorMetadata};

/// The attributes of both ops. `scale` NaN (the default) stands for
/// `1/√D`; any other value must be finite. `layout` is `"bhtd"` or
/// `"bthd"` (see the module documentation).
const ATTENTION_ATTRS: &[AttrSpec] = &[
    AttrSpec::optional("causal", AttrKind::Bool, AttrDefault::Bool(false)),
    AttrSpec::optional("scale", AttrKind::Float, AttrDefault::Float(f64::NAN)),
    AttrSpec::optional("layout", AttrKind::Str, AttrDefault::Str(HEADS_FIRST)),
];

/// The `layout` of `[B, H, T, D]` operands.
pub const HEADS_FIRST: &str = "bhtd";
/// The `layout` of `[B, T, H, D]` operands.
pub const SEQUENCE_FIRST: &str = "bthd";

/// `ScaledDotProductAttention(q, k, v) -> (O, L)`: with `q: [B, H, T, D]`,
/// `k: [B, H, S, D]` and `v: [B, H, S, Dv]` (or rank 3, `[BH, T, D]` and
/// so on; or with `layout = "bthd"`, `[B, T, H, D]` and so on), `O =
/// softmax(q·kᵀ·scale + mask)·v: [B, H, T, Dv]` and `L = log Σⱼ
/// exp(q·kᵀ·scale + mask): [B, H, T]`, the log-sum-exp of each query row
/// over the keys it sees (f32, or f64 for f64 inputs); with `"bthd"`,
/// `O: [B, T, H, Dv]` and `L: [B, T, H]`. `causal`
/// masks key `j` for query `i` when `j > i` (upper-left alignment, see the
/// module documentation); `scale` defaults to `1/√D` (1 when `D = 0`, where
/// every score is 0 whatever the scale).
pub static SCALED_DOT_PRODUCT_ATTENTION: OpDef = OpDef {
    name: "ScaledDotProductAttention",
    inputs: &["q", "k", "v"],
    variadic: false,
    outputs: 2,
    attrs: ATTENTION_ATTRS,
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: attention_meta,
    grad: Some(attention_grad),
};

/// `ScaledDotProductAttentionGrad(dO, q, k, v, O, L) -> (dq, dk, dv)`: the
/// gradient of [`SCALED_DOT_PRODUCT_ATTENTION`]'s output `O` for the
/// incoming gradient `dO`, from the forward inputs and outputs, with the
/// forward attributes (FlashAttention-2's backward: `P = exp(S − L)`,
/// `Δ = rowsum(dO ∘ O)`, `dS = P ∘ (dO·vᵀ − Δ)`, `dq = dS·k·scale`,
/// `dk = dSᵀ·q·scale`, `dv = Pᵀ·dO`).
pub static SCALED_DOT_PRODUCT_ATTENTION_GRAD: OpDef = OpDef {
    name: "ScaledDotProductAttentionGrad",
    inputs: &["dO", "q", "k", "v", "O", "L"],
    variadic: false,
    outputs: 3,
    attrs: ATTENTION_ATTRS,
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: attention_grad_meta,
    grad: Some(attention_grad_grad),
};

/// The sizes of an attention call, resolved from its inputs and
/// attributes: every kernel works on `heads` independent `[T, D]`,
/// `[S, D]`, `[S, Dv]` matrices, whose rows are `interleaved` heads apart.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionGeometry {
    /// The product of the leading dimensions (`B·H`, or `BH` at rank 3).
    pub heads: usize,
    /// Queries per head.
    pub t: usize,
    /// Keys (and values) per head.
    pub s: usize,
    /// The size of a query and key vector.
    pub d: usize,
    /// The size of a value vector.
    pub dv: usize,
    /// Whether key `j` is masked for query `i` when `j > i`.
    pub causal: bool,
    /// The factor of the scores, resolved from the attribute.
    pub scale: f64,
    /// How many heads' rows alternate in memory: `H` for the `"bthd"`
    /// layout (head `h` of batch element `b` is head `b·H + h`, and its
    /// row `i` of `q` starts at `((b·T + i)·H + h)·D`), 1 for `"bhtd"`
    /// (a head's rows are consecutive). `L` follows the same order.
    pub interleaved: usize,
}

impl AttentionGeometry {
    /// The number of keys query `i` sees: all of them, or with causal
    /// masking keys `0..=i`.
    pub fn keys_seen(&self, i: usize) -> usize {
        if self.causal {
            self.s.min(i.saturating_add(1))
        } else {
            self.s
        }
    }

    /// The index of head `head`'s row `i` among `rows` rows a head (`T` or
    /// `S`): the row's offset in units of its width, and its index in `L`
    /// (with `rows = T`).
    pub fn row(&self, head: usize, rows: usize, i: usize) -> usize {
        let (batch, within) = (head / self.interleaved, head % self.interleaved);
        (batch * rows + i) * self.interleaved + within
    }
}

/// The dtype of the log-sum-exp output for inputs of `dtype`: f64 for
/// f64, f32 otherwise (f16 and bf16 are computed in f32).
pub fn attention_lse_dtype(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// The scale of the scores: the `scale` attribute, or `1/√D` when it is
/// left at its default (NaN), or 1 when `D = 0`.
pub fn attention_scale(attrs: &Attrs<'_>, d: usize) -> Result<f64> {
    let scale = attrs.float("scale")?;
    if scale.is_nan() {
        return Ok(if d == 0 { 1.0 } else { 1.0 / (d as f64).sqrt() });
    }
    if !scale.is_finite() {
        return Err(Error::attribute(format!(
            "scale must be finite, got {scale}"
        )));
    }
    Ok(scale)
}

/// Checks `q`, `k` and `v` against each other and resolves the sizes.
pub fn attention_geometry(
    inputs: &[TensorMetadata],
    attrs: &Attrs<'_>,
) -> Result<AttentionGeometry> {
    let (q, k, v) = (&inputs[0], &inputs[1], &inputs[2]);
    require_float("q", q)?;
    require_same_dtype(q, k)?;
    require_same_dtype(q, v)?;
    let (heads, interleaved, rows) = match attrs.str("layout")? {
        HEADS_FIRST => heads_first_sizes(q, k, v)?,
        SEQUENCE_FIRST => sequence_first_sizes(q, k, v)?,
        other => {
            return Err(Error::attribute(format!(
                "layout must be \"{HEADS_FIRST}\" or \"{SEQUENCE_FIRST}\", got \"{other}\""
            )))
        }
    };
    // Rows and widths of q, k and v.
    let [(t, d), (s, dk), (sv, dv)] = rows;
    if dk != d {
        return Err(Error::shape(format!(
            "queries and keys must have one size: q {} has D = {d}, k {} has {dk}",
            q.shape, k.shape
        )));
    }
    if sv != s {
        return Err(Error::shape(format!(
            "keys and values must be as many: k {} has S = {s}, v {} has {sv}",
            k.shape, v.shape
        )));
    }
    Ok(AttentionGeometry {
        heads,
        t,
        s,
        d,
        dv,
        causal: attrs.bool("causal")?,
        scale: attention_scale(attrs, d)?,
        interleaved,
    })
}

/// The heads, the interleave and the (rows, width) of `q`, `k` and `v`.
type Sizes = (usize, usize, [(usize, usize); 3]);

/// The `"bhtd"` layout's sizes: `[.., T, D]` after leading dimensions
/// that all three share.
fn heads_first_sizes(q: &TensorMetadata, k: &TensorMetadata, v: &TensorMetadata) -> Result<Sizes> {
    let rank = q.shape.rank();
    if !(rank == 3 || rank == 4) || k.shape.rank() != rank || v.shape.rank() != rank {
        return Err(Error::shape(format!(
            "attention needs q: [B, H, T, D], k: [B, H, S, D] and v: [B, H, S, Dv] (or all three of rank 3), got {}, {} and {}",
            q.shape, k.shape, v.shape
        )));
    }
    let lead = &q.shape.dims()[..rank - 2];
    if &k.shape.dims()[..rank - 2] != lead || &v.shape.dims()[..rank - 2] != lead {
        return Err(Error::shape(format!(
            "the leading (batch and head) dimensions of q {}, k {} and v {} differ",
            q.shape, k.shape, v.shape
        )));
    }
    let last_two = |x: &TensorMetadata| (x.shape[rank - 2], x.shape[rank - 1]);
    Ok((
        stagecraft_tensor::element_count(lead),
        1,
        [last_two(q), last_two(k), last_two(v)],
    ))
}

/// The `"bthd"` layout's sizes: `[B, rows, H, width]`, `B` and `H` shared.
fn sequence_first_sizes(
    q: &TensorMetadata,
    k: &TensorMetadata,
    v: &TensorMetadata,
) -> Result<Sizes> {
    if q.shape.rank() != 4 || k.shape.rank() != 4 || v.shape.rank() != 4 {
        return Err(Error::shape(format!(
            "attention with layout \"{SEQUENCE_FIRST}\" needs q: [B, T, H, D], k: [B, S, H, D] and v: [B, S, H, Dv], got {}, {} and {}",
            q.shape, k.shape, v.shape
        )));
    }
    let (b, h) = (q.shape[0], q.shape[2]);
    if [k, v].iter().any(|x| x.shape[0] != b || x.shape[2] != h) {
        return Err(Error::shape(format!(
            "the batch and head dimensions (first and third) of q {}, k {} and v {} differ",
            q.shape, k.shape, v.shape
        )));
    }
    let rows = |x: &TensorMetadata| (x.shape[1], x.shape[3]);
    // With no heads there are no rows to place: an interleave of 1.
    Ok((
        stagecraft_tensor::element_count(&[b, h]),
        h.max(1),
        [rows(q), rows(k), rows(v)],
    ))
}

/// The metadata of the forward outputs `(O, L)` for inputs that passed
/// [`attention_geometry`].
fn forward_outputs(q: &TensorMetadata, v: &TensorMetadata) -> OutputMetas {
    let rank = q.shape.rank();
    let mut o = q.shape.clone();
    o.dims_mut()[rank - 1] = v.shape[rank - 1];
    let l = Shape::new(&q.shape.dims()[..rank - 1]);
    smallvec![
        TensorMetadata::new(q.dtype, o),
        TensorMetadata::new(attention_lse_dtype(q.dtype), l)
    ]
}

fn attention_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    attention_geometry(inputs, attrs)?;
    Ok(forward_outputs(&inputs[0], &inputs[2]))
}

fn attention_grad_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let (g, o, l) = (&inputs[0], &inputs[4], &inputs[5]);
    attention_geometry(&inputs[1..4], attrs)?;
    let forward = forward_outputs(&inputs[1], &inputs[3]);
    for (name, got, want) in [
        ("dO", g, &forward[0]),
        ("O", o, &forward[0]),
        ("L", l, &forward[1]),
    ] {
        if got != want {
            return Err(Error::shape(format!(
                "{name} must be {want} for these q, k and v, got {got}"
            )));
        }
    }
    Ok(smallvec![
        inputs[1].clone(),
        inputs[2].clone(),
        inputs[3].clone()
    ])
}

// ---------------------------------------------------------------------------
// Gradients.

/// The dimensions of `value` with the last one replaced by 1 (a column of
/// `[.., T]` values as `[.., T, 1]`).
fn as_column(b: &mut dyn GradBuilder, value: G) -> Result<G> {
    let mut dims = b.meta(value).shape.dims().to_vec();
    dims.push(1);
    b.reshape(value, &dims)
}

/// `x` in `dtype`, cast only when it is not already.
fn cast_to(b: &mut dyn GradBuilder, x: G, dtype: DType) -> Result<G> {
    if b.meta(x).dtype == dtype {
        Ok(x)
    } else {
        b.cast(x, dtype)
    }
}

/// `x·yᵀ` over the last two axes (batched over the leading ones).
fn times_transposed(b: &mut dyn GradBuilder, x: G, y: G) -> Result<G> {
    b.op(&MATMUL, &[x, y], &super::matmul_attrs(false, true))
}

/// `xᵀ·y` over the last two axes.
fn transposed_times(b: &mut dyn GradBuilder, x: G, y: G) -> Result<G> {
    b.op(&MATMUL, &[x, y], &super::matmul_attrs(true, false))
}

/// `x·y` over the last two axes.
fn times(b: &mut dyn GradBuilder, x: G, y: G) -> Result<G> {
    b.op(&MATMUL, &[x, y], &super::matmul_attrs(false, false))
}

/// Sums over the last axis, keeping it (as size 1).
fn row_sums(b: &mut dyn GradBuilder, x: G) -> Result<G> {
    let last = b.meta(x).shape.rank() - 1;
    b.sum(x, &[last], true)
}

/// `x + y` where either may be absent (a zero).
fn add_opt(b: &mut dyn GradBuilder, x: Option<G>, y: Option<G>) -> Result<Option<G>> {
    Ok(match (x, y) {
        (Some(x), Some(y)) => Some(b.add(x, y)?),
        (x, None) => x,
        (None, y) => y,
    })
}

/// The geometry of a recorded forward or backward op, from its `q`, `k`
/// and `v`.
fn recorded_geometry(
    b: &dyn GradBuilder,
    qkv: [G; 3],
    attrs: &Attrs<'_>,
) -> Result<AttentionGeometry> {
    let metas = qkv.map(|x| b.meta(x));
    attention_geometry(&metas, attrs)
}

/// Both outputs may receive gradients. `O`'s goes through the fused
/// backward op. `L`'s (it reaches `L` when the backward op is
/// differentiated, since that op reads `L`) follows from `∂Lᵢ/∂Sᵢⱼ = Pᵢⱼ`:
/// `dq = scale·dL∘(P·k)`, where `P·k` is attention with `k` as the values,
/// and `dk = scale·Pᵀ·(dL∘q)`, which is the backward op's `dv` for the
/// incoming gradient `dL∘q` and `k` as the values (its other outputs are
/// not used; with `O = 0` they cost one product each).
fn attention_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let [q, k, v] = [ctx.inputs[0], ctx.inputs[1], ctx.inputs[2]];
    if !b.meta(q).dtype.is_float() {
        return Ok(smallvec![None, None, None]);
    }
    let geometry = recorded_geometry(b, [q, k, v], &ctx.attrs)?;
    let (mut dq, mut dk, mut dv) = (None, None, None);
    if let Some(g) = ctx.grads.first().copied().flatten() {
        let (o, l) = (ctx.outputs[0], ctx.outputs[1]);
        let grads = b.op_multi(
            &SCALED_DOT_PRODUCT_ATTENTION_GRAD,
            &[g, q, k, v, o, l],
            ctx.attrs.raw(),
        )?;
        (dq, dk, dv) = (Some(grads[0]), Some(grads[1]), Some(grads[2]));
    }
    if let Some(gl) = ctx.grads.get(1).copied().flatten() {
        let dtype = b.meta(q).dtype;
        // In the inputs' dtype (L is f32 for f16 and bf16 inputs).
        let gl = cast_to(b, gl, dtype)?;
        let column = as_column(b, gl)?;
        let pk = b.op_multi(&SCALED_DOT_PRODUCT_ATTENTION, &[q, k, k], ctx.attrs.raw())?[0];
        let from_q = b.mul(column, pk)?;
        let from_q = b.scale(from_q, geometry.scale)?;
        let weighted_q = b.mul(column, q)?;
        let zeros = b.fill(0.0, &b.meta(q))?;
        let l = ctx.outputs[1];
        let back = b.op_multi(
            &SCALED_DOT_PRODUCT_ATTENTION_GRAD,
            &[weighted_q, q, k, k, zeros, l],
            ctx.attrs.raw(),
        )?;
        let from_k = b.scale(back[2], geometry.scale)?;
        dq = add_opt(b, dq, Some(from_q))?;
        dk = add_opt(b, dk, Some(from_k))?;
    }
    Ok(smallvec![dq, dk, dv])
}

/// `exp(S − L)` with the causal mask, the probabilities the forward pass
/// used, materialized (`[.., T, S]`): second order is built from ordinary
/// ops, whose own rules give third order and beyond.
fn probabilities(
    b: &mut dyn GradBuilder,
    geometry: &AttentionGeometry,
    q: G,
    k: G,
    l: G,
) -> Result<G> {
    let scores = times_transposed(b, q, k)?;
    let scores = b.scale(scores, geometry.scale)?;
    let dtype = b.meta(q).dtype;
    let l = cast_to(b, l, dtype)?;
    let l = as_column(b, l)?;
    let shifted = b.sub(scores, l)?;
    let shifted = if geometry.causal {
        // Masked scores become -∞ before the exponential, so their
        // probabilities are exact zeros (a zero mask multiplied in would
        // meet an overflowed exponential as NaN).
        let keep = b.fill(
            1.0,
            &TensorMetadata::new(DType::Bool, [geometry.t, geometry.s]),
        )?;
        let keep = b.op(&TRILU, &[keep], &crate::OpAttrs::new())?;
        let minus_infinity = b.scalar(f64::NEG_INFINITY, b.meta(q).dtype)?;
        b.op(
            &super::SELECT,
            &[keep, shifted, minus_infinity],
            &crate::OpAttrs::new(),
        )?
    } else {
        shifted
    };
    b.unary(&super::EXP, shifted)
}

/// Second order: the backward op's vector-Jacobian product, from
/// cotangents `A = d̄q`, `B = d̄k`, `C = d̄v` (any may be absent). With
/// `P = exp(S − L)`, `dP = dO·vᵀ`, `Δ = rowsum(dO∘O)`, `dS = P∘(dP − Δ)`
/// and `φ = ⟨A, dq⟩ + ⟨B, dk⟩ + ⟨C, dv⟩ = ⟨G, dS⟩ + ⟨dO·Cᵀ, P⟩` where
/// `G = scale·(A·kᵀ + q·Bᵀ)`:
///
/// - `M = P∘(G∘(dP − Δ) + dO·Cᵀ)` is `∂φ/∂S` (through `P`), and
///   `r = rowsum(G∘P)` is `−∂φ/∂Δ`;
/// - `∂φ/∂dO = (G∘P)·v − r∘O + P·C`, `∂φ/∂O = −r∘dO`,
///   `∂φ/∂v = (G∘P)ᵀ·dO`, `∂φ/∂L = −rowsum(M)`;
/// - `∂φ/∂q = scale·(M·k + dS·B)`, `∂φ/∂k = scale·(Mᵀ·q + dSᵀ·A)`.
///
/// These materialize `[.., T, S]` matrices: second derivatives of
/// attention cost the memory of the unfused formula.
///
/// With the `"bthd"` layout the operands are transposed to `"bhtd"` for
/// these products, and the gradients back.
fn attention_grad_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let inputs: [G; 6] = [0, 1, 2, 3, 4, 5].map(|i| ctx.inputs[i]);
    let grads = [0, 1, 2].map(|i| ctx.grads.get(i).copied().flatten());
    let geometry = recorded_geometry(b, [inputs[1], inputs[2], inputs[3]], &ctx.attrs)?;
    if ctx.attrs.str("layout")? == HEADS_FIRST {
        return heads_first_grad_grad(b, &geometry, inputs, grads);
    }
    // Swapping the sequence and head axes goes both ways: [B, T, H, ..]
    // and [B, H, T, ..] (`L` has no last axis, so the same perm's first
    // three entries serve it).
    let swap = |b: &mut dyn GradBuilder, x: G| {
        let perm: &[usize] = if b.meta(x).shape.rank() == 4 {
            &[0, 2, 1, 3]
        } else {
            &[0, 2, 1]
        };
        b.transpose(x, perm)
    };
    let mut swapped = inputs;
    for x in swapped.iter_mut() {
        *x = swap(b, *x)?;
    }
    let mut swapped_grads = grads;
    for x in swapped_grads.iter_mut().flatten() {
        *x = swap(b, *x)?;
    }
    let mut out = heads_first_grad_grad(b, &geometry, swapped, swapped_grads)?;
    for x in out.iter_mut().flatten() {
        *x = swap(b, *x)?;
    }
    Ok(out)
}

/// [`attention_grad_grad`] for operands `[dO, q, k, v, O, L]` in the
/// `"bhtd"` layout and cotangents `[d̄q, d̄k, d̄v]`.
fn heads_first_grad_grad(
    b: &mut dyn GradBuilder,
    geometry: &AttentionGeometry,
    [g, q, k, v, o, l]: [G; 6],
    [ga, gb, gc]: [Option<G>; 3],
) -> Result<InputGrads> {
    let p = probabilities(b, geometry, q, k, l)?;
    let dp = times_transposed(b, g, v)?;
    let go = b.mul(g, o)?;
    let delta = row_sums(b, go)?;
    let centred = b.sub(dp, delta)?;
    let ds = b.mul(p, centred)?;
    // G = scale·(A·kᵀ + q·Bᵀ)
    let from_a = ga.map(|a| times_transposed(b, a, k)).transpose()?;
    let from_b = gb.map(|gb| times_transposed(b, q, gb)).transpose()?;
    let weights = match add_opt(b, from_a, from_b)? {
        Some(x) => Some(b.scale(x, geometry.scale)?),
        None => None,
    };
    let weighted_p = weights.map(|w| b.mul(w, p)).transpose()?;
    let r = weighted_p.map(|wp| row_sums(b, wp)).transpose()?;
    // M = P∘(G∘(dP − Δ) + dO·Cᵀ)
    let from_weights = weights.map(|w| b.mul(w, centred)).transpose()?;
    let from_c = gc.map(|c| times_transposed(b, g, c)).transpose()?;
    let m = match add_opt(b, from_weights, from_c)? {
        Some(h) => Some(b.mul(h, p)?),
        None => None,
    };

    let mut d_g = None;
    if let Some(wp) = weighted_p {
        let term = times(b, wp, v)?;
        d_g = add_opt(b, d_g, Some(term))?;
    }
    if let Some(r) = r {
        let ro = b.mul(r, o)?;
        let ro = b.neg(ro)?;
        d_g = add_opt(b, d_g, Some(ro))?;
    }
    if let Some(c) = gc {
        let term = times(b, p, c)?;
        d_g = add_opt(b, d_g, Some(term))?;
    }
    let d_o = match r {
        Some(r) => {
            let rg = b.mul(r, g)?;
            Some(b.neg(rg)?)
        }
        None => None,
    };
    let d_v = weighted_p
        .map(|wp| transposed_times(b, wp, g))
        .transpose()?;
    let d_l = match m {
        Some(m) => {
            let last = b.meta(m).shape.rank() - 1;
            let sums = b.sum(m, &[last], false)?;
            let sums = b.neg(sums)?;
            let l_dtype = b.meta(l).dtype;
            Some(cast_to(b, sums, l_dtype)?)
        }
        None => None,
    };
    let mut d_q = m.map(|m| times(b, m, k)).transpose()?;
    let mut d_k = m.map(|m| transposed_times(b, m, q)).transpose()?;
    if let Some(gb) = gb {
        let term = times(b, ds, gb)?;
        d_q = add_opt(b, d_q, Some(term))?;
    }
    if let Some(a) = ga {
        let term = transposed_times(b, ds, a)?;
        d_k = add_opt(b, d_k, Some(term))?;
    }
    let d_q = d_q.map(|x| b.scale(x, geometry.scale)).transpose()?;
    let d_k = d_k.map(|x| b.scale(x, geometry.scale)).transpose()?;
    let grads: SmallVec<[Option<G>; 4]> = smallvec![d_g, d_q, d_k, d_v, d_o, d_l];
    Ok(grads)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::OpAttrs;

    fn m(dtype: DType, dims: &[usize]) -> TensorMetadata {
        TensorMetadata::new(dtype, dims)
    }

    fn f(dims: &[usize]) -> TensorMetadata {
        m(DType::F32, dims)
    }

    #[test]
    fn forward_shapes_and_dtypes() {
        let a = OpAttrs::new();
        let out = SCALED_DOT_PRODUCT_ATTENTION
            .infer(&[f(&[2, 3, 5, 8]), f(&[2, 3, 7, 8]), f(&[2, 3, 7, 4])], &a)
            .unwrap();
        assert_eq!(out.as_slice(), &[f(&[2, 3, 5, 4]), f(&[2, 3, 5])]);
        let out = SCALED_DOT_PRODUCT_ATTENTION
            .infer(
                &[
                    m(DType::F64, &[6, 5, 8]),
                    m(DType::F64, &[6, 7, 8]),
                    m(DType::F64, &[6, 7, 2]),
                ],
                &a,
            )
            .unwrap();
        assert_eq!(
            out.as_slice(),
            &[m(DType::F64, &[6, 5, 2]), m(DType::F64, &[6, 5])]
        );
        // Half precision keeps its dtype; the log-sum-exp is f32.
        let h = |d: &[usize]| m(DType::BF16, d);
        let out = SCALED_DOT_PRODUCT_ATTENTION
            .infer(&[h(&[1, 2, 8]), h(&[1, 3, 8]), h(&[1, 3, 8])], &a)
            .unwrap();
        assert_eq!(out.as_slice(), &[h(&[1, 2, 8]), f(&[1, 2])]);
        // Zero-size dimensions are shapes like any other.
        let out = SCALED_DOT_PRODUCT_ATTENTION
            .infer(&[f(&[0, 2, 5, 0]), f(&[0, 2, 0, 0]), f(&[0, 2, 0, 3])], &a)
            .unwrap();
        assert_eq!(out.as_slice(), &[f(&[0, 2, 5, 3]), f(&[0, 2, 5])]);
    }

    #[test]
    fn mismatches_are_shape_and_dtype_errors() {
        let a = OpAttrs::new();
        let infer = |q: &[usize], k: &[usize], v: &[usize]| {
            SCALED_DOT_PRODUCT_ATTENTION
                .infer(&[f(q), f(k), f(v)], &a)
                .unwrap_err()
                .to_string()
        };
        assert!(infer(&[2, 5, 8], &[2, 3, 7, 8], &[2, 3, 7, 4]).contains("rank 3"));
        assert!(infer(&[5, 8], &[7, 8], &[7, 4]).contains("rank 3"));
        assert!(infer(&[2, 3, 5, 8], &[2, 4, 7, 8], &[2, 3, 7, 4]).contains("leading"));
        assert!(infer(&[2, 3, 5, 8], &[2, 3, 7, 8], &[1, 3, 7, 4]).contains("leading"));
        assert!(infer(&[2, 3, 5, 8], &[2, 3, 7, 6], &[2, 3, 7, 4]).contains("D = 8"));
        assert!(infer(&[2, 3, 5, 8], &[2, 3, 7, 8], &[2, 3, 6, 4]).contains("S = 7"));
        let ints = m(DType::I32, &[1, 2, 2]);
        let err = SCALED_DOT_PRODUCT_ATTENTION
            .infer(&[ints.clone(), ints.clone(), ints], &a)
            .unwrap_err();
        assert_eq!(err.kind(), stagecraft_tensor::ErrorKind::DType);
        let err = SCALED_DOT_PRODUCT_ATTENTION
            .infer(
                &[f(&[1, 2, 2]), m(DType::F64, &[1, 2, 2]), f(&[1, 2, 2])],
                &a,
            )
            .unwrap_err();
        assert_eq!(err.kind(), stagecraft_tensor::ErrorKind::DType);
    }

    #[test]
    fn the_scale_defaults_to_one_over_root_d() {
        let geometry = |d: usize, attrs: &OpAttrs| {
            let def = &SCALED_DOT_PRODUCT_ATTENTION;
            let metas = [f(&[1, 2, d]), f(&[1, 3, d]), f(&[1, 3, 1])];
            attention_geometry(&metas, &Attrs::new(attrs, def))
        };
        let mut a = OpAttrs::new();
        assert_eq!(geometry(16, &a).unwrap().scale, 0.25);
        assert_eq!(geometry(0, &a).unwrap().scale, 1.0);
        a.set_float("scale", -2.0).set_bool("causal", true);
        let g = geometry(16, &a).unwrap();
        assert_eq!(
            (g.scale, g.causal, g.heads, g.t, g.s, g.dv),
            (-2.0, true, 1, 2, 3, 1)
        );
        a.set_float("scale", f64::INFINITY);
        assert!(geometry(16, &a).unwrap_err().to_string().contains("finite"));
    }

    #[test]
    fn causal_rows_see_keys_from_the_upper_left() {
        let g = AttentionGeometry {
            heads: 1,
            t: 5,
            s: 3,
            d: 1,
            dv: 1,
            causal: true,
            scale: 1.0,
            interleaved: 1,
        };
        let seen: Vec<usize> = (0..5).map(|i| g.keys_seen(i)).collect();
        assert_eq!(seen, [1, 2, 3, 3, 3]);
        let all = AttentionGeometry { causal: false, ..g };
        assert_eq!(all.keys_seen(0), 3);
    }

    #[test]
    fn the_backward_checks_its_gradient_and_residuals() {
        let a = OpAttrs::new();
        let (q, k, v) = (f(&[2, 5, 8]), f(&[2, 7, 8]), f(&[2, 7, 4]));
        let (o, l) = (f(&[2, 5, 4]), f(&[2, 5]));
        let out = SCALED_DOT_PRODUCT_ATTENTION_GRAD
            .infer(
                &[
                    o.clone(),
                    q.clone(),
                    k.clone(),
                    v.clone(),
                    o.clone(),
                    l.clone(),
                ],
                &a,
            )
            .unwrap();
        assert_eq!(out.as_slice(), &[q.clone(), k.clone(), v.clone()]);
        let err = SCALED_DOT_PRODUCT_ATTENTION_GRAD
            .infer(
                &[
                    f(&[2, 5, 3]),
                    q.clone(),
                    k.clone(),
                    v.clone(),
                    o.clone(),
                    l.clone(),
                ],
                &a,
            )
            .unwrap_err();
        assert!(err.to_string().contains("dO must be"), "{err}");
        let err = SCALED_DOT_PRODUCT_ATTENTION_GRAD
            .infer(&[o.clone(), q, k, v, o, m(DType::F64, &[2, 5])], &a)
            .unwrap_err();
        assert!(err.to_string().contains("L must be"), "{err}");
    }
}
