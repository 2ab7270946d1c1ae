//! `Attention` (opset 23): scaled dot-product attention over 3-D
//! `[batch, seq, heads · size]` or 4-D `[batch, heads, seq, size]` inputs,
//! with an optional boolean or additive mask, causal masking, past keys and
//! values, grouped-query heads, softcap and the `qk_matmul_output` modes,
//! composed from matmuls, a softmax and elementwise ops; and
//! `RotaryEmbedding`.

use super::shape::pad_with;
use super::{dims, Ctx, Translate};
use crate::error::{OnnxError, Result};
use stagecraft_ops as ops;
use stagecraft_ops::OpAttrs;
use stagecraft_runtime::TensorHandle;
use stagecraft_tensor::{DType, DenseHostTensor};

pub(super) fn lookup(op_type: &str) -> Option<Translate> {
    Some(match op_type {
        "Attention" => attention as Translate,
        "RotaryEmbedding" => rotary_embedding,
        _ => return None,
    })
}

/// `[B, S, H·D]` as `[B, H, S, D]`.
fn split_heads(c: &Ctx<'_>, x: &TensorHandle, heads: i64) -> Result<TensorHandle> {
    let d = dims(x);
    if heads < 1 || !d[2].is_multiple_of(heads as usize) {
        return Err(OnnxError::invalid(format!(
            "{} hidden units do not split into {heads} heads",
            d[2]
        )));
    }
    let h = heads as usize;
    let y = c.reshape(x, &[d[0], d[1], h, d[2] / h])?;
    transpose(c, &y, &[0, 2, 1, 3])
}

fn transpose(c: &Ctx<'_>, x: &TensorHandle, perm: &[i64]) -> Result<TensorHandle> {
    let mut a = OpAttrs::new();
    a.set_ints("perm", perm);
    c.op1(&ops::TRANSPOSE, std::slice::from_ref(x), &a)
}

/// Each of the `heads` of `x: [B, H, T, D]` repeated `reps` times in place.
pub(crate) fn repeat_heads(c: &Ctx<'_>, x: &TensorHandle, reps: usize) -> Result<TensorHandle> {
    if reps == 1 {
        return Ok(x.clone());
    }
    let d = dims(x);
    let y = c.reshape(x, &[d[0], d[1], 1, d[2], d[3]])?;
    let mut a = OpAttrs::new();
    a.set_dims("shape", &[d[0], d[1], reps, d[2], d[3]]);
    let y = c.op1(&ops::BROADCAST_TO, &[y], &a)?;
    c.reshape(&y, &[d[0], d[1] * reps, d[2], d[3]])
}

fn concat_seq(c: &Ctx<'_>, past: Option<&TensorHandle>, x: TensorHandle) -> Result<TensorHandle> {
    match past {
        Some(p) => {
            let mut a = OpAttrs::new();
            a.set_int("axis", 2);
            c.op1(&ops::CONCAT, &[p.clone(), x], &a)
        }
        None => Ok(x),
    }
}

fn attention(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let (mut q, mut k, mut v) = (c.input(0)?, c.input(1)?, c.input(2)?);
    let dt = q.dtype();
    if !dt.is_float() {
        return Err(OnnxError::unsupported(format!("Attention on {dt} tensors")));
    }
    let three_d = dims(&q).len() == 3;
    if three_d && (dims(&k).len() != 3 || dims(&v).len() != 3) {
        return Err(OnnxError::invalid("Attention needs Q, K and V of one rank"));
    }
    if three_d {
        let (qh, kvh) = (c.attr_int("q_num_heads", 0), c.attr_int("kv_num_heads", 0));
        q = split_heads(c, &q, qh)?;
        k = split_heads(c, &k, kvh)?;
        v = split_heads(c, &v, kvh)?;
    } else if dims(&q).len() != 4 || dims(&k).len() != 4 || dims(&v).len() != 4 {
        return Err(OnnxError::invalid("Attention needs 3-D or 4-D Q, K and V"));
    }
    let past_len = c.opt_input(4).map_or(0, |p| dims(p)[2]);
    let present_key = concat_seq(c, c.opt_input(4), k)?;
    let present_value = concat_seq(c, c.opt_input(5), v)?;
    let qd = dims(&q);
    let kd = dims(&present_key);
    let (sq, total) = (qd[2], kd[2]);
    let scale = if c.has_attr("scale") {
        c.attr_float("scale", 1.0) as f64
    } else {
        1.0 / (qd[3] as f64).sqrt()
    };
    // The additive bias: the mask (booleans become 0 or -inf, padded with
    // -inf to the total length), the causal mask, the padding of keys.
    let neg_inf = c.scalar(f64::NEG_INFINITY, dt)?;
    let zero = c.scalar(0.0, dt)?;
    let mut bias: Option<TensorHandle> = None;
    if let Some(m) = c.opt_input(3) {
        let m = if m.dtype() == DType::Bool {
            c.op1(
                &ops::SELECT,
                &[m.clone(), zero.clone(), neg_inf.clone()],
                &OpAttrs::new(),
            )?
        } else {
            c.cast(m, dt)?
        };
        let md = dims(&m);
        let last = *md.last().unwrap_or(&total);
        let m = if last < total {
            let before = vec![0i64; md.len()];
            let mut after = vec![0i64; md.len()];
            after[md.len() - 1] = (total - last) as i64;
            pad_with(c, &m, &before, &after, f64::NEG_INFINITY)?
        } else {
            m
        };
        bias = Some(m);
    }
    if c.attr_int("is_causal", 0) != 0 {
        let values: Vec<f64> = (0..sq * total)
            .map(|i| {
                let (row, col) = (i / total, i % total);
                if col >= past_len && col - past_len > row {
                    f64::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let t = c.constant(DenseHostTensor::from_slice(&values, [sq, total])?);
        let t = c.cast(&t, dt)?;
        bias = Some(match bias {
            Some(b) => c.binary(&ops::ADD, &b, &t)?,
            None => t,
        });
    }
    if let Some(lens) = c.known(6) {
        let lens = super::ints_of(lens)?;
        let values: Vec<f64> = lens
            .iter()
            .flat_map(|&n| {
                (0..total as i64).map(move |j| if j < n { 0.0 } else { f64::NEG_INFINITY })
            })
            .collect();
        let t = c.constant(DenseHostTensor::from_slice(
            &values,
            [lens.len(), 1, 1, total],
        )?);
        let t = c.cast(&t, dt)?;
        bias = Some(match bias {
            Some(b) => c.binary(&ops::ADD, &b, &t)?,
            None => t,
        });
    } else if c.opt_input(6).is_some() {
        return Err(OnnxError::unsupported(
            "Attention's nonpad_kv_seqlen computed while the model runs",
        ));
    }
    let (hq, hk) = (qd[1], kd[1]);
    if hq % hk != 0 {
        return Err(OnnxError::invalid(format!(
            "{hq} query heads do not group over {hk} key heads"
        )));
    }
    let key = repeat_heads(c, &present_key, hq / hk)?;
    let value = repeat_heads(c, &present_value, hq / hk)?;
    let s = scale.sqrt();
    let qs = c.with_scalar(&ops::MUL, &q, s)?;
    let ks = c.with_scalar(&ops::MUL, &key, s)?;
    let mut mm = OpAttrs::new();
    mm.set_bool("transpose_b", true);
    let mut qk = c.op1(&ops::MATMUL, &[qs, ks], &mm)?;
    let softcap = c.attr_float("softcap", 0.0) as f64;
    if softcap > 0.0 {
        let t = c.with_scalar(&ops::DIV, &qk, softcap)?;
        let t = c.unary(&ops::TANH, &t)?;
        qk = c.with_scalar(&ops::MUL, &t, softcap)?;
    }
    let with_bias = match &bias {
        Some(b) => c.binary(&ops::ADD, &qk, b)?,
        None => qk.clone(),
    };
    let mut sm = OpAttrs::new();
    sm.set_int("axis", 3);
    let p = c.op1(&ops::SOFTMAX, std::slice::from_ref(&with_bias), &sm)?;
    let qk_out = match c.attr_int("qk_matmul_output_mode", 0) {
        0 | 1 => qk,
        2 => with_bias,
        3 => p.clone(),
        m => return Err(OnnxError::invalid(format!("qk_matmul_output_mode {m}"))),
    };
    let mut y = c.op1(&ops::MATMUL, &[p, value], &OpAttrs::new())?;
    if three_d {
        let t = transpose(c, &y, &[0, 2, 1, 3])?;
        let d = dims(&t);
        y = c.reshape(&t, &[d[0], d[1], d[2] * d[3]])?;
    }
    Ok(vec![y, present_key, present_value, qk_out])
}

/// Every `step`-th element of the last axis of `x` from `start` to `end`.
fn strided_last(
    c: &Ctx<'_>,
    x: &TensorHandle,
    start: usize,
    end: usize,
    step: usize,
) -> Result<TensorHandle> {
    let d = dims(x);
    let r = d.len();
    let mut starts = vec![0i64; r];
    let mut ends: Vec<i64> = d.iter().map(|&n| n as i64).collect();
    let mut steps = vec![1i64; r];
    starts[r - 1] = start as i64;
    ends[r - 1] = end as i64;
    steps[r - 1] = step as i64;
    let mut a = OpAttrs::new();
    a.set_ints("starts", &starts);
    a.set_ints("ends", &ends);
    a.set_ints("steps", &steps);
    c.op1(&ops::SLICE, std::slice::from_ref(x), &a)
}

fn concat_last(c: &Ctx<'_>, xs: &[TensorHandle]) -> Result<TensorHandle> {
    let mut a = OpAttrs::new();
    a.set_int("axis", dims(&xs[0]).len() as i64 - 1);
    c.op1(&ops::CONCAT, xs, &a)
}

fn rotary_embedding(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let input = c.input(0)?;
    let dt = input.dtype();
    if !dt.is_float() {
        return Err(OnnxError::unsupported(format!(
            "RotaryEmbedding on {dt} tensors"
        )));
    }
    let original = dims(&input);
    // To [B, S, H, D].
    let x = match original.len() {
        4 => transpose(c, &input, &[0, 2, 1, 3])?,
        3 => {
            let heads = c.attr_int("num_heads", 0);
            if heads < 1 || !original[2].is_multiple_of(heads as usize) {
                return Err(OnnxError::invalid(format!(
                    "{} hidden units do not split into {heads} heads",
                    original[2]
                )));
            }
            let h = heads as usize;
            c.reshape(&input, &[original[0], original[1], h, original[2] / h])?
        }
        r => return Err(OnnxError::invalid(format!("RotaryEmbedding of rank {r}"))),
    };
    let d = dims(&x);
    let head = d[3];
    let rd = match c.attr_int("rotary_embedding_dim", 0) {
        0 => head,
        n if n > 0 && (n as usize) <= head && n % 2 == 0 => n as usize,
        n => return Err(OnnxError::invalid(format!("rotary_embedding_dim {n}"))),
    };
    let half = rd / 2;
    let cache = |i: usize| -> Result<TensorHandle> {
        let mut t = c.cast(&c.input(i)?, dt)?;
        if let Some(pos) = c.opt_input(3) {
            let mut g = OpAttrs::new();
            g.set_int("axis", 0);
            t = c.op1(&ops::GATHER, &[t, pos.clone()], &g)?;
        }
        let mut td = dims(&t);
        if td.last() != Some(&half) {
            return Err(OnnxError::invalid(format!(
                "the cos and sin caches' last axis must be rotary_embedding_dim / 2 = {half}"
            )));
        }
        td.insert(td.len() - 1, 1);
        c.reshape(&t, &td)
    };
    let (cos, sin) = (cache(1)?, cache(2)?);
    let interleaved = c.attr_int("interleaved", 0) != 0;
    let (x1, x2) = if interleaved {
        (
            strided_last(c, &x, 0, rd, 2)?,
            strided_last(c, &x, 1, rd, 2)?,
        )
    } else {
        (
            strided_last(c, &x, 0, half, 1)?,
            strided_last(c, &x, half, rd, 1)?,
        )
    };
    let a = c.binary(&ops::MUL, &cos, &x1)?;
    let b = c.binary(&ops::MUL, &sin, &x2)?;
    let real = c.binary(&ops::SUB, &a, &b)?;
    let a = c.binary(&ops::MUL, &sin, &x1)?;
    let b = c.binary(&ops::MUL, &cos, &x2)?;
    let imag = c.binary(&ops::ADD, &a, &b)?;
    let rotated = if interleaved {
        let mut rdims = dims(&real);
        rdims.push(1);
        let re = c.reshape(&real, &rdims)?;
        let im = c.reshape(&imag, &rdims)?;
        let pairs = concat_last(c, &[re, im])?;
        c.reshape(&pairs, &[d[0], d[1], d[2], rd])?
    } else {
        concat_last(c, &[real, imag])?
    };
    let y = if rd < head {
        let rest = strided_last(c, &x, rd, head, 1)?;
        concat_last(c, &[rotated, rest])?
    } else {
        rotated
    };
    let y = if original.len() == 3 {
        c.reshape(&y, &original)?
    } else {
        transpose(c, &y, &[0, 2, 1, 3])?
    };
    Ok(vec![y])
}
