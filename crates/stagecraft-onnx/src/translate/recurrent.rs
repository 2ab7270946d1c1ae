//! Recurrent ONNX ops: `RNN`, `GRU` and `LSTM` unrolled over the sequence
//! with their default activations; and of opset 27 `CausalConvWithState` (a depthwise
//! causal 1-D convolution carrying its last `K - 1` inputs as state) and
//! `LinearAttention` (the linear, gated, delta and gated-delta state
//! recurrences). Both compose stagecraft ops; `LinearAttention` is unrolled
//! over the sequence, whose length is a static dimension of the inputs,
//! so gradients and every execution mode come with the composed ops.

use super::attention::repeat_heads;
use super::shape::slice_axis;
use super::{dims, require_float, Ctx, Translate};
use crate::error::{OnnxError, Result};
use stagecraft_ops as ops;
use stagecraft_ops::OpAttrs;
use stagecraft_runtime::TensorHandle;
use stagecraft_tensor::{DType, DenseHostTensor, TensorMetadata};

pub(super) fn lookup(op_type: &str) -> Option<Translate> {
    Some(match op_type {
        "CausalConvWithState" => causal_conv_with_state as Translate,
        "LinearAttention" => linear_attention,
        "RNN" => |c| recurrence(c, Cell::Rnn),
        "GRU" => |c| recurrence(c, Cell::Gru),
        "LSTM" => |c| recurrence(c, Cell::Lstm),
        _ => return None,
    })
}

/// A zero tensor of `dtype` and `shape` on the translation's device.
fn zeros(c: &Ctx<'_>, dtype: DType, shape: &[usize]) -> Result<TensorHandle> {
    Ok(c.constant(DenseHostTensor::zeros(TensorMetadata::new(
        dtype,
        shape.to_vec(),
    ))?))
}

fn concat(c: &Ctx<'_>, xs: &[TensorHandle], axis: usize) -> Result<TensorHandle> {
    if xs.len() == 1 {
        return Ok(xs[0].clone());
    }
    let mut a = OpAttrs::new();
    a.set_int("axis", axis as i64);
    c.op1(&ops::CONCAT, xs, &a)
}

/// `x * sigmoid(x)`, computed in f32 for half-precision inputs (as the
/// op's function body does) and cast back.
fn silu(c: &Ctx<'_>, x: &TensorHandle) -> Result<TensorHandle> {
    let dt = x.dtype();
    let wide = if dt == DType::F64 { dt } else { DType::F32 };
    let xf = c.cast(x, wide)?;
    let s = c.unary(&ops::SIGMOID, &xf)?;
    let y = c.binary(&ops::MUL, &xf, &s)?;
    c.cast(&y, dt)
}

/// `CausalConvWithState(input [B, C, L], weight [C, 1, K], bias?, past_state?
/// [B, C, K-1])`: the input is prefixed with the past state (zeros when
/// absent), convolved per channel without padding, and the last `K - 1`
/// steps of the prefixed input are the present state.
fn causal_conv_with_state(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    require_float(c, &x)?;
    let w = c.input(1)?;
    let (xd, wd) = (dims(&x), dims(&w));
    if xd.len() != 3 || wd.len() != 3 {
        return Err(OnnxError::unsupported(format!(
            "CausalConvWithState on input {xd:?} and weight {wd:?} (only 1-D [B, C, L] inputs are supported)"
        )));
    }
    let (b, ch, len) = (xd[0], xd[1], xd[2]);
    let k = wd[2];
    if wd[0] != ch || wd[1] != 1 || k == 0 {
        return Err(OnnxError::invalid(format!(
            "weight {wd:?} is not a depthwise [C, 1, K] kernel for {ch} channels"
        )));
    }
    let activation = c.attr_str("activation", "none");
    if !matches!(activation.as_str(), "none" | "silu" | "swish") {
        return Err(OnnxError::unsupported(format!(
            "CausalConvWithState activation '{activation}'"
        )));
    }
    let past = match c.opt_input(3) {
        Some(p) => {
            if dims(p) != [b, ch, k - 1] {
                return Err(OnnxError::invalid(format!(
                    "past_state {:?} is not [{b}, {ch}, {}]",
                    dims(p),
                    k - 1
                )));
            }
            Some(p.clone())
        }
        None if k > 1 => Some(zeros(c, x.dtype(), &[b, ch, k - 1])?),
        None => None,
    };
    let padded = match &past {
        Some(p) if k > 1 => concat(c, &[p.clone(), x.clone()], 2)?,
        _ => x.clone(),
    };
    let total = len + k - 1;
    let x2 = c.reshape(&padded, &[b, ch, 1, total])?;
    let w2 = c.reshape(&w, &[ch, 1, 1, k])?;
    let mut attrs = OpAttrs::new();
    attrs.set_dims("stride", &[1, 1]);
    attrs.set_dims("padding", &[0, 0]);
    attrs.set_dims("dilation", &[1, 1]);
    attrs.set_int("groups", ch as i64);
    let mut y = c.op1(&ops::CONV2D, &[x2, w2], &attrs)?;
    if let Some(bias) = c.opt_input(2) {
        let bias = c.reshape(bias, &[1, ch, 1, 1])?;
        y = c.binary(&ops::ADD, &y, &bias)?;
    }
    let mut y = c.reshape(&y, &[b, ch, len])?;
    if activation != "none" {
        y = silu(c, &y)?;
    }
    let present = if k > 1 {
        slice_axis(c, &padded, 2, total - (k - 1), total)?
    } else {
        zeros(c, x.dtype(), &[b, ch, 0])?
    };
    Ok(vec![y, present])
}

/// Step `t` of a packed `[B, T, H·D]` input as `[B, H, rows, cols]`.
fn step(c: &Ctx<'_>, x: &TensorHandle, t: usize, shape: [usize; 4]) -> Result<TensorHandle> {
    let s = slice_axis(c, x, 1, t, t + 1)?;
    c.reshape(&s, &shape)
}

/// `LinearAttention`: the state `S [B, H_kv, d_k, d_v]` is updated per
/// step by the node's `update_rule` and read by every query head of its
/// group, `o_t = scale · q_t S_t`. Computed in f32 (f64 for f64 inputs)
/// like the op's function body.
fn linear_attention(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let (q, k, v) = (c.input(0)?, c.input(1)?, c.input(2)?);
    let dt = q.dtype();
    require_float(c, &q)?;
    let (qd, kd, vd) = (dims(&q), dims(&k), dims(&v));
    if qd.len() != 3 || kd.len() != 3 || vd.len() != 3 {
        return Err(OnnxError::unsupported(
            "LinearAttention needs 3-D packed [B, T, H·D] query, key and value",
        ));
    }
    let hq = c.attr_int("q_num_heads", 0);
    let hkv = c.attr_int("kv_num_heads", 0);
    if hq < 1 || hkv < 1 || hq % hkv != 0 {
        return Err(OnnxError::invalid(format!(
            "q_num_heads {hq} must be a positive multiple of kv_num_heads {hkv}"
        )));
    }
    let (hq, hkv) = (hq as usize, hkv as usize);
    let (b, t_len) = (qd[0], qd[1]);
    if !qd[2].is_multiple_of(hq) || !vd[2].is_multiple_of(hkv) {
        return Err(OnnxError::invalid(format!(
            "query {qd:?} or value {vd:?} does not split into the heads"
        )));
    }
    let (dk, dv) = (qd[2] / hq, vd[2] / hkv);
    if kd != [b, t_len, hkv * dk] || vd[..2] != [b, t_len] {
        return Err(OnnxError::invalid(format!(
            "key {kd:?} and value {vd:?} do not match query {qd:?}"
        )));
    }
    let rule = c.attr_str("update_rule", "gated_delta");
    let (gated, delta) = match rule.as_str() {
        "linear" => (false, false),
        "gated" => (true, false),
        "delta" => (false, true),
        "gated_delta" => (true, true),
        other => {
            return Err(OnnxError::unsupported(format!(
                "LinearAttention update_rule '{other}'"
            )))
        }
    };
    let wide = if dt == DType::F64 { dt } else { DType::F32 };
    let scale = if c.has_attr("scale") {
        c.attr_float("scale", 1.0) as f64
    } else {
        (1.0 / (dk as f32).sqrt()) as f64
    };
    let (q, k, v) = (c.cast(&q, wide)?, c.cast(&k, wide)?, c.cast(&v, wide)?);
    let decay = if gated {
        let g = c
            .opt_input(4)
            .ok_or_else(|| OnnxError::invalid(format!("update_rule '{rule}' needs decay")))?;
        let gd = dims(g);
        if gd.len() != 3 || gd[..2] != [b, t_len] || (gd[2] != hkv * dk && gd[2] != hkv) {
            return Err(OnnxError::invalid(format!(
                "decay {gd:?} is not [{b}, {t_len}, {}] or [{b}, {t_len}, {hkv}]",
                hkv * dk
            )));
        }
        Some((c.cast(g, wide)?, gd[2] / hkv))
    } else {
        None
    };
    let beta = if delta {
        let be = c
            .opt_input(5)
            .ok_or_else(|| OnnxError::invalid(format!("update_rule '{rule}' needs beta")))?;
        let bd = dims(be);
        if bd.len() != 3 || bd[..2] != [b, t_len] || (bd[2] != hkv && bd[2] != 1) {
            return Err(OnnxError::invalid(format!(
                "beta {bd:?} is not [{b}, {t_len}, {hkv}] or [{b}, {t_len}, 1]"
            )));
        }
        Some((c.cast(be, wide)?, bd[2]))
    } else {
        None
    };
    let mut state = match c.opt_input(3) {
        Some(p) => {
            if dims(p) != [b, hkv, dk, dv] {
                return Err(OnnxError::invalid(format!(
                    "past_state {:?} is not [{b}, {hkv}, {dk}, {dv}]",
                    dims(p)
                )));
            }
            c.cast(p, wide)?
        }
        None => zeros(c, wide, &[b, hkv, dk, dv])?,
    };
    let mut outputs = Vec::with_capacity(t_len);
    for t in 0..t_len {
        let q_t = step(c, &q, t, [b, hq, 1, dk])?;
        let k_col = step(c, &k, t, [b, hkv, dk, 1])?;
        let v_t = step(c, &v, t, [b, hkv, 1, dv])?;
        if let Some((g, per)) = &decay {
            let g_t = step(c, g, t, [b, hkv, *per, 1])?;
            let e = c.unary(&ops::EXP, &g_t)?;
            state = c.binary(&ops::MUL, &state, &e)?;
        }
        let write = match &beta {
            Some((be, heads)) => {
                // v_t - Sᵀk_t, the part of v_t the state does not yet
                // recall, scaled by β_t.
                let k_row = c.reshape(&k_col, &[b, hkv, 1, dk])?;
                let recalled = c.binary(&ops::MATMUL, &k_row, &state)?;
                let diff = c.binary(&ops::SUB, &v_t, &recalled)?;
                let b_t = step(c, be, t, [b, *heads, 1, 1])?;
                c.binary(&ops::MUL, &b_t, &diff)?
            }
            None => v_t,
        };
        let outer = c.binary(&ops::MATMUL, &k_col, &write)?;
        state = c.binary(&ops::ADD, &state, &outer)?;
        let read = repeat_heads(c, &state, hq / hkv)?;
        let o = c.binary(&ops::MATMUL, &q_t, &read)?;
        let o = c.with_scalar(&ops::MUL, &o, scale)?;
        outputs.push(c.reshape(&o, &[b, 1, hq * dv])?);
    }
    let out = if outputs.is_empty() {
        zeros(c, wide, &[b, 0, hq * dv])?
    } else {
        concat(c, &outputs, 1)?
    };
    Ok(vec![c.cast(&out, dt)?, c.cast(&state, dt)?])
}

/// Which of `RNN`, `GRU` and `LSTM` a node is: its gate count and default
/// activations.
#[derive(Clone, Copy, PartialEq)]
enum Cell {
    Rnn,
    Gru,
    Lstm,
}

impl Cell {
    fn gates(self) -> usize {
        match self {
            Cell::Rnn => 1,
            Cell::Gru => 3,
            Cell::Lstm => 4,
        }
    }

    fn default_activations(self) -> &'static [&'static str] {
        match self {
            Cell::Rnn => &["tanh"],
            Cell::Gru => &["sigmoid", "tanh"],
            Cell::Lstm => &["sigmoid", "tanh", "tanh"],
        }
    }
}

/// The weights of one direction, split per gate: `w[g]` is `[H, I]`,
/// `r[g]` is `[H, H]`, `wb[g]` and `rb[g]` are `[H]` (absent: no bias),
/// `p` the LSTM peepholes `[i, o, f]`, each `[H]`.
struct Weights {
    w: Vec<TensorHandle>,
    r: Vec<TensorHandle>,
    wb: Vec<Option<TensorHandle>>,
    rb: Vec<Option<TensorHandle>>,
    p: Option<Vec<TensorHandle>>,
}

/// Rows `[g·h, (g+1)·h)` of direction `d` of a `[D, G·H, ...]` tensor, as
/// `[H, ...]`.
fn gate_rows(c: &Ctx<'_>, x: &TensorHandle, d: usize, g: usize, h: usize) -> Result<TensorHandle> {
    let dir = slice_axis(c, x, 0, d, d + 1)?;
    let rows = slice_axis(c, &dir, 1, g * h, (g + 1) * h)?;
    let mut shape = dims(&rows);
    shape.remove(0);
    c.reshape(&rows, &shape)
}

fn sigmoid(c: &Ctx<'_>, x: &TensorHandle) -> Result<TensorHandle> {
    c.unary(&ops::SIGMOID, x)
}

fn tanh(c: &Ctx<'_>, x: &TensorHandle) -> Result<TensorHandle> {
    c.unary(&ops::TANH, x)
}

/// `x · wᵀ` (+ `b`).
fn affine(
    c: &Ctx<'_>,
    x: &TensorHandle,
    w: &TensorHandle,
    b: Option<&TensorHandle>,
) -> Result<TensorHandle> {
    let mut a = OpAttrs::new();
    a.set_bool("transpose_b", true);
    let y = c.op1(&ops::MATMUL, &[x.clone(), w.clone()], &a)?;
    match b {
        Some(b) => c.binary(&ops::ADD, &y, b),
        None => Ok(y),
    }
}

fn add(c: &Ctx<'_>, a: &TensorHandle, b: &TensorHandle) -> Result<TensorHandle> {
    c.binary(&ops::ADD, a, b)
}

fn mul(c: &Ctx<'_>, a: &TensorHandle, b: &TensorHandle) -> Result<TensorHandle> {
    c.binary(&ops::MUL, a, b)
}

/// `RNN`, `GRU` and `LSTM` unrolled over the sequence (a static dimension
/// of `X`) for each direction, with the default activations only; a
/// `sequence_lens` must be known and equal to the full length (shorter
/// sequences are unsupported).
fn recurrence(c: &Ctx<'_>, cell: Cell) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    require_float(c, &x)?;
    let (w, r) = (c.input(1)?, c.input(2)?);
    let layout = c.attr_int("layout", 0);
    if !matches!(layout, 0 | 1) {
        return Err(OnnxError::invalid(format!("layout {layout}")));
    }
    let batch_first = layout == 1;
    let x = if batch_first {
        transpose(c, &x, &[1, 0, 2])?
    } else {
        x
    };
    let xd = dims(&x);
    if xd.len() != 3 {
        return Err(OnnxError::invalid(format!("X {xd:?} is not rank 3")));
    }
    let (t_len, b, input) = (xd[0], xd[1], xd[2]);
    let h = c.attr_int("hidden_size", 0);
    let wd = dims(&w);
    let gates = cell.gates();
    let h = if h > 0 {
        h as usize
    } else if wd.len() == 3 {
        wd[1] / gates
    } else {
        0
    };
    let dirs = match c.attr_str("direction", "forward").as_str() {
        "forward" | "reverse" => 1,
        "bidirectional" => 2,
        other => return Err(OnnxError::invalid(format!("direction '{other}'"))),
    };
    let reverse = c.attr_str("direction", "forward") == "reverse";
    if h == 0 || wd != [dirs, gates * h, input] || dims(&r) != [dirs, gates * h, h] {
        return Err(OnnxError::invalid(format!(
            "W {wd:?} and R {:?} do not fit {dirs} directions of {gates} gates of hidden size {h} over {input} inputs",
            dims(&r)
        )));
    }
    if let Some(names) = c
        .node
        .attribute
        .iter()
        .find(|a| a.name() == "activations")
        .map(|a| a.strings.clone())
    {
        let defaults = cell.default_activations();
        let ok = names.len() == defaults.len() * dirs
            && names.iter().enumerate().all(|(i, n)| {
                String::from_utf8_lossy(n).eq_ignore_ascii_case(defaults[i % defaults.len()])
            });
        if !ok {
            return Err(OnnxError::unsupported(format!(
                "{} with activations other than the defaults",
                c.op_type()
            )));
        }
    }
    if let Some(lens) = c.known_ints(4)? {
        if lens.iter().any(|&l| l != t_len as i64) {
            return Err(OnnxError::unsupported(format!(
                "{} with sequence_lens {lens:?} shorter than the sequence ({t_len})",
                c.op_type()
            )));
        }
    }
    if cell == Cell::Lstm && c.attr_int("input_forget", 0) != 0 {
        return Err(OnnxError::unsupported("LSTM input_forget = 1"));
    }
    let clip = if c.has_attr("clip") {
        Some(c.attr_float("clip", 0.0) as f64)
    } else {
        None
    };
    let clipped = |v: TensorHandle| -> Result<TensorHandle> {
        match clip {
            Some(k) => {
                let v = c.with_scalar(&ops::MAXIMUM, &v, -k)?;
                c.with_scalar(&ops::MINIMUM, &v, k)
            }
            None => Ok(v),
        }
    };
    let linear_before_reset = c.attr_int("linear_before_reset", 0) != 0;
    let bias = c.opt_input(3).cloned();
    if let Some(bb) = &bias {
        if dims(bb) != [dirs, 2 * gates * h] {
            return Err(OnnxError::invalid(format!(
                "B {:?} is not [{dirs}, {}]",
                dims(bb),
                2 * gates * h
            )));
        }
    }
    let state_in = |i: usize| -> Result<Option<TensorHandle>> {
        let Some(s) = c.opt_input(i) else {
            return Ok(None);
        };
        let s = if batch_first {
            transpose(c, s, &[1, 0, 2])?
        } else {
            s.clone()
        };
        if dims(&s) != [dirs, b, h] {
            return Err(OnnxError::invalid(format!(
                "initial state {:?} is not [{dirs}, {b}, {h}]",
                dims(&s)
            )));
        }
        Ok(Some(s))
    };
    let init_h = state_in(5)?;
    let init_c = if cell == Cell::Lstm {
        state_in(6)?
    } else {
        None
    };
    let peep = if cell == Cell::Lstm {
        c.opt_input(7).cloned()
    } else {
        None
    };
    if let Some(p) = &peep {
        if dims(p) != [dirs, 3 * h] {
            return Err(OnnxError::invalid(format!(
                "P {:?} is not [{dirs}, {}]",
                dims(p),
                3 * h
            )));
        }
    }
    let dt = x.dtype();
    let mut ys = Vec::new();
    let mut hs = Vec::new();
    let mut cs = Vec::new();
    for d in 0..dirs {
        let weights = Weights {
            w: (0..gates)
                .map(|g| gate_rows(c, &w, d, g, h))
                .collect::<Result<_>>()?,
            r: (0..gates)
                .map(|g| gate_rows(c, &r, d, g, h))
                .collect::<Result<_>>()?,
            wb: (0..gates)
                .map(|g| {
                    bias.as_ref()
                        .map(|bb| gate_rows(c, bb, d, g, h))
                        .transpose()
                })
                .collect::<Result<_>>()?,
            rb: (0..gates)
                .map(|g| {
                    bias.as_ref()
                        .map(|bb| gate_rows(c, bb, d, gates + g, h))
                        .transpose()
                })
                .collect::<Result<_>>()?,
            p: peep
                .as_ref()
                .map(|p| (0..3).map(|g| gate_rows(c, p, d, g, h)).collect())
                .transpose()?,
        };
        let first = |s: &Option<TensorHandle>| -> Result<TensorHandle> {
            match s {
                Some(s) => {
                    let one = slice_axis(c, s, 0, d, d + 1)?;
                    c.reshape(&one, &[b, h])
                }
                None => zeros(c, dt, &[b, h]),
            }
        };
        let mut hid = first(&init_h)?;
        let mut cel = first(&init_c)?;
        // The input's share of every gate, for all steps at once.
        let xw: Vec<TensorHandle> = (0..gates)
            .map(|g| affine(c, &x, &weights.w[g], weights.wb[g].as_ref()))
            .collect::<Result<_>>()?;
        let backward = reverse || d == 1;
        let mut outs = vec![None; t_len];
        for step_i in 0..t_len {
            let t = if backward { t_len - 1 - step_i } else { step_i };
            let xt = |g: usize| -> Result<TensorHandle> {
                let s = slice_axis(c, &xw[g], 0, t, t + 1)?;
                c.reshape(&s, &[b, h])
            };
            let hr =
                |g: usize, hv: &TensorHandle| affine(c, hv, &weights.r[g], weights.rb[g].as_ref());
            match cell {
                Cell::Rnn => {
                    let pre = add(c, &xt(0)?, &hr(0, &hid)?)?;
                    hid = tanh(c, &clipped(pre)?)?;
                }
                Cell::Gru => {
                    let z = sigmoid(c, &clipped(add(c, &xt(0)?, &hr(0, &hid)?)?)?)?;
                    let rg = sigmoid(c, &clipped(add(c, &xt(1)?, &hr(1, &hid)?)?)?)?;
                    let cand = if linear_before_reset {
                        add(c, &xt(2)?, &mul(c, &rg, &hr(2, &hid)?)?)?
                    } else {
                        add(c, &xt(2)?, &hr(2, &mul(c, &rg, &hid)?)?)?
                    };
                    let cand = tanh(c, &clipped(cand)?)?;
                    // (1 - z) ⊙ h̃ + z ⊙ h = h̃ + z ⊙ (h - h̃)
                    let diff = c.binary(&ops::SUB, &hid, &cand)?;
                    hid = add(c, &cand, &mul(c, &z, &diff)?)?;
                }
                Cell::Lstm => {
                    // Gate order in W and R: input, output, forget, cell.
                    let mut pre: Vec<TensorHandle> = (0..4)
                        .map(|g| add(c, &xt(g)?, &hr(g, &hid)?))
                        .collect::<Result<_>>()?;
                    if let Some(p) = &weights.p {
                        pre[0] = add(c, &pre[0], &mul(c, &p[0], &cel)?)?;
                        pre[2] = add(c, &pre[2], &mul(c, &p[2], &cel)?)?;
                    }
                    let i = sigmoid(c, &clipped(pre[0].clone())?)?;
                    let f = sigmoid(c, &clipped(pre[2].clone())?)?;
                    let g = tanh(c, &clipped(pre[3].clone())?)?;
                    cel = add(c, &mul(c, &f, &cel)?, &mul(c, &i, &g)?)?;
                    let mut o_pre = pre[1].clone();
                    if let Some(p) = &weights.p {
                        o_pre = add(c, &o_pre, &mul(c, &p[1], &cel)?)?;
                    }
                    let o = sigmoid(c, &clipped(o_pre)?)?;
                    hid = mul(c, &o, &tanh(c, &cel)?)?;
                }
            }
            outs[t] = Some(c.reshape(&hid, &[1, 1, b, h])?);
        }
        let outs: Vec<TensorHandle> = outs.into_iter().flatten().collect();
        if outs.is_empty() {
            return Err(OnnxError::unsupported(format!(
                "{} over an empty sequence",
                c.op_type()
            )));
        }
        ys.push(concat(c, &outs, 0)?);
        hs.push(c.reshape(&hid, &[1, b, h])?);
        cs.push(c.reshape(&cel, &[1, b, h])?);
    }
    let mut y = concat(c, &ys, 1)?;
    let mut yh = concat(c, &hs, 0)?;
    let mut yc = concat(c, &cs, 0)?;
    if batch_first {
        y = transpose(c, &y, &[2, 0, 1, 3])?;
        yh = transpose(c, &yh, &[1, 0, 2])?;
        yc = transpose(c, &yc, &[1, 0, 2])?;
    }
    let mut outs = vec![y, yh];
    if cell == Cell::Lstm {
        outs.push(yc);
    }
    Ok(outs)
}

fn transpose(c: &Ctx<'_>, x: &TensorHandle, perm: &[i64]) -> Result<TensorHandle> {
    let mut a = OpAttrs::new();
    a.set_ints("perm", perm);
    c.op1(&ops::TRANSPOSE, std::slice::from_ref(x), &a)
}
