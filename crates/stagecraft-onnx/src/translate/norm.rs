//! `GroupNormalization`, and `BatchNormalization` in training mode (batch
//! statistics, and the running statistics updated by the momentum).

use super::reduce::reduce_with;
use super::{dims, require_float, Ctx, Translate};
use crate::error::{OnnxError, Result};
use stagecraft_ops as ops;
use stagecraft_runtime::TensorHandle;
use stagecraft_tensor::DType;

pub(super) fn lookup(op_type: &str) -> Option<Translate> {
    Some(match op_type {
        "GroupNormalization" => group_norm as Translate,
        _ => return None,
    })
}

/// Mean and population variance of `x` over `axes`, kept with unit
/// dimensions.
fn moments(
    c: &Ctx<'_>,
    x: &TensorHandle,
    axes: &[i64],
) -> Result<(TensorHandle, TensorHandle, TensorHandle)> {
    let mean = reduce_with(c, &ops::MEAN, x, axes, true)?;
    let centered = c.binary(&ops::SUB, x, &mean)?;
    let sq = c.binary(&ops::MUL, &centered, &centered)?;
    let var = reduce_with(c, &ops::MEAN, &sq, axes, true)?;
    Ok((mean, var, centered))
}

/// `GroupNormalization` (opset 18 takes `[G]` scale and bias, opset 21
/// `[C]`): each group of `C / G` channels is normalized over its channels
/// and spatial positions, in f32 at least (`stash_type` 1, the default).
fn group_norm(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    require_float(c, &x)?;
    let d = dims(&x);
    if d.len() < 2 {
        return Err(OnnxError::invalid(format!(
            "GroupNormalization input {d:?} is not [N, C, ...]"
        )));
    }
    let groups = c.attr_int("num_groups", 0);
    let ch = d[1];
    if groups < 1 || !ch.is_multiple_of(groups as usize) {
        return Err(OnnxError::invalid(format!(
            "num_groups {groups} does not divide {ch} channels"
        )));
    }
    let g = groups as usize;
    let eps = c.attr_float("epsilon", 1e-5) as f64;
    let dt = x.dtype();
    let wide = if dt == DType::F64 { dt } else { DType::F32 };
    let xf = c.cast(&x, wide)?;
    let xg = c.reshape(&xf, &[d[0], g, d[1..].iter().product::<usize>() / g])?;
    let (_, var, centered) = moments(c, &xg, &[2])?;
    let v = c.with_scalar(&ops::ADD, &var, eps)?;
    let rstd = c.unary(&ops::RSQRT, &v)?;
    let y = c.binary(&ops::MUL, &centered, &rstd)?;
    let y = c.cast(&c.reshape(&y, &d)?, dt)?;
    let mut pd = vec![1; d.len()];
    pd[1] = ch;
    let param = |i: usize| -> Result<TensorHandle> {
        let p = c.cast(&c.input(i)?, dt)?;
        let n = p.metadata().shape.numel();
        if n == ch {
            c.reshape(&p, &pd)
        } else if n == g {
            // Opset 18: one value per group, shared by its channels.
            let per = c.reshape(&p, &[g, 1])?;
            let mut a = stagecraft_ops::OpAttrs::new();
            a.set_dims("shape", &[g, ch / g]);
            let per = c.op1(&ops::BROADCAST_TO, &[per], &a)?;
            c.reshape(&per, &pd)
        } else {
            Err(OnnxError::invalid(format!(
                "scale or bias of {n} values for {ch} channels in {g} groups"
            )))
        }
    };
    let y = c.binary(&ops::MUL, &y, &param(1)?)?;
    Ok(vec![c.binary(&ops::ADD, &y, &param(2)?)?])
}

/// `BatchNormalization` with `training_mode = 1`: normalized by the
/// batch's mean and population variance per channel; the running mean and
/// variance outputs are `input · momentum + batch · (1 - momentum)`.
pub(super) fn batch_norm_training(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    require_float(c, &x)?;
    let d = dims(&x);
    if d.len() < 2 {
        return Err(OnnxError::invalid(format!(
            "BatchNormalization input {d:?} is not [N, C, ...]"
        )));
    }
    let ch = d[1];
    let dt = x.dtype();
    let eps = c.attr_float("epsilon", 1e-5) as f64;
    let momentum = c.attr_float("momentum", 0.9) as f64;
    let axes: Vec<i64> = (0..d.len() as i64).filter(|&a| a != 1).collect();
    let (_, var, centered) = moments(c, &x, &axes)?;
    let mean = reduce_with(c, &ops::MEAN, &x, &axes, false)?;
    let mut pd = vec![1; d.len()];
    pd[1] = ch;
    let param = |i: usize| -> Result<TensorHandle> {
        let p = c.cast(&c.input(i)?, dt)?;
        if p.metadata().shape.numel() != ch {
            return Err(OnnxError::invalid(format!(
                "input {i} has {} values for {ch} channels",
                p.metadata().shape.numel()
            )));
        }
        Ok(p)
    };
    let v = c.with_scalar(&ops::ADD, &var, eps)?;
    let rstd = c.unary(&ops::RSQRT, &v)?;
    let y = c.binary(&ops::MUL, &centered, &rstd)?;
    let y = c.binary(&ops::MUL, &y, &c.reshape(&param(1)?, &pd)?)?;
    let y = c.binary(&ops::ADD, &y, &c.reshape(&param(2)?, &pd)?)?;
    let running = |i: usize, batch: &TensorHandle| -> Result<TensorHandle> {
        let old = c.with_scalar(&ops::MUL, &param(i)?, momentum)?;
        let new = c.with_scalar(&ops::MUL, batch, 1.0 - momentum)?;
        c.binary(&ops::ADD, &old, &new)
    };
    let var = c.reshape(&var, &[ch])?;
    let out_mean = running(3, &mean)?;
    let out_var = running(4, &var)?;
    Ok(vec![y, out_mean, out_var])
}
