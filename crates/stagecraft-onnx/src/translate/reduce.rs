//! Reductions: the `Reduce*` family (axes as an attribute before opset 13
//! for `ReduceSum` and 18 for the others, an input after), `ArgMax`,
//! `ArgMin`, `Softmax`, `LogSoftmax`.

use super::{axis, dims, Ctx, Translate};
use crate::error::{OnnxError, Result};
use stagecraft_ops as ops;
use stagecraft_ops::{OpAttrs, OpDef};
use stagecraft_runtime::TensorHandle;

pub(super) fn lookup(op_type: &str) -> Option<Translate> {
    Some(match op_type {
        "ReduceSum" => |c| reduce(c, Kind::Sum),
        "ReduceMean" => |c| reduce(c, Kind::Mean),
        "ReduceMax" => |c| reduce(c, Kind::Max),
        "ReduceMin" => |c| reduce(c, Kind::Min),
        "ReduceProd" => |c| reduce(c, Kind::Prod),
        "ReduceL1" => |c| reduce(c, Kind::L1),
        "ReduceL2" => |c| reduce(c, Kind::L2),
        "ReduceSumSquare" => |c| reduce(c, Kind::SumSquare),
        "ReduceLogSum" => |c| reduce(c, Kind::LogSum),
        "ReduceLogSumExp" => |c| reduce(c, Kind::LogSumExp),
        "ArgMax" => |c| arg(c, &ops::ARGMAX),
        "ArgMin" => |c| arg(c, &ops::ARGMIN),
        "Softmax" => |c| softmax(c, &ops::SOFTMAX),
        "Hardmax" => hardmax,
        "LogSoftmax" => |c| softmax(c, &ops::LOG_SOFTMAX),
        _ => return None,
    })
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Sum,
    Mean,
    Max,
    Min,
    Prod,
    L1,
    L2,
    SumSquare,
    LogSum,
    LogSumExp,
}

/// Reduces `x` over `axes` (all when empty) with `op`.
pub(crate) fn reduce_with(
    c: &Ctx<'_>,
    op: &'static OpDef,
    x: &TensorHandle,
    axes: &[i64],
    keepdim: bool,
) -> Result<TensorHandle> {
    let mut attrs = OpAttrs::new();
    attrs.set_ints("axes", axes);
    attrs.set_bool("keepdim", keepdim);
    c.op1(op, std::slice::from_ref(x), &attrs)
}

fn reduce(c: &Ctx<'_>, kind: Kind) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let input_since = if kind == Kind::Sum { 13 } else { 18 };
    let axes = if c.opset < input_since {
        c.attr_ints("axes")
    } else {
        c.known_ints(1)?
    };
    let keepdim = c.attr_int("keepdims", 1) != 0;
    let axes = axes.unwrap_or_default();
    if axes.is_empty() && c.attr_int("noop_with_empty_axes", 0) != 0 {
        return Ok(vec![x]);
    }
    let rank = dims(&x).len();
    let axes: Vec<i64> = axes
        .iter()
        .map(|&a| axis(a, rank).map(|a| a as i64))
        .collect::<Result<_>>()?;
    // An empty axis list means every axis; a scalar has none to reduce.
    if rank == 0 {
        return Ok(vec![x]);
    }
    let float = x.dtype().is_float();
    let need_float = |what: &str| -> Result<()> {
        if float {
            Ok(())
        } else {
            Err(OnnxError::unsupported(format!(
                "{what} of {} tensors",
                x.dtype()
            )))
        }
    };
    let y = match kind {
        Kind::Sum => reduce_with(c, &ops::SUM, &x, &axes, keepdim)?,
        Kind::Mean => {
            need_float("ReduceMean")?;
            reduce_with(c, &ops::MEAN, &x, &axes, keepdim)?
        }
        Kind::Max | Kind::Min if x.dtype() == stagecraft_tensor::DType::Bool => {
            // The max of bools is any, the min all: reduce them as bytes.
            let op = if kind == Kind::Max {
                &ops::MAX
            } else {
                &ops::MIN
            };
            let b = c.cast(&x, stagecraft_tensor::DType::U8)?;
            let r = reduce_with(c, op, &b, &axes, keepdim)?;
            c.cast(&r, stagecraft_tensor::DType::Bool)?
        }
        Kind::Max | Kind::Min => {
            let empty = axes.iter().any(|&a| dims(&x)[a as usize] == 0)
                || axes.is_empty() && x.metadata().shape.numel() == 0;
            if empty && float {
                // Nothing to compare: the max of no values is -inf and the
                // min +inf, an empty sum (0, of the right shape) shifted.
                let s = reduce_with(c, &ops::SUM, &x, &axes, keepdim)?;
                let inf = if kind == Kind::Max {
                    f64::NEG_INFINITY
                } else {
                    f64::INFINITY
                };
                return Ok(vec![c.with_scalar(&ops::ADD, &s, inf)?]);
            }
            if empty {
                return Err(OnnxError::unsupported(format!(
                    "{} over an empty axis",
                    c.op_type()
                )));
            }
            let op = if kind == Kind::Max {
                &ops::MAX
            } else {
                &ops::MIN
            };
            reduce_with(c, op, &x, &axes, keepdim)?
        }
        Kind::Prod => reduce_with(c, &ops::PROD, &x, &axes, keepdim)?,
        Kind::L1 => {
            let a = c.unary(&ops::ABS, &x)?;
            reduce_with(c, &ops::SUM, &a, &axes, keepdim)?
        }
        Kind::L2 => {
            need_float("ReduceL2")?;
            let sq = c.binary(&ops::MUL, &x, &x)?;
            let s = reduce_with(c, &ops::SUM, &sq, &axes, keepdim)?;
            c.unary(&ops::SQRT, &s)?
        }
        Kind::SumSquare => {
            let sq = c.binary(&ops::MUL, &x, &x)?;
            reduce_with(c, &ops::SUM, &sq, &axes, keepdim)?
        }
        Kind::LogSum => {
            need_float("ReduceLogSum")?;
            let s = reduce_with(c, &ops::SUM, &x, &axes, keepdim)?;
            c.unary(&ops::LOG, &s)?
        }
        Kind::LogSumExp => {
            need_float("ReduceLogSumExp")?;
            let d = dims(&x);
            if axes.iter().any(|&a| d[a as usize] == 0)
                || axes.is_empty() && x.metadata().shape.numel() == 0
            {
                // Nothing to sum: log(0) = -inf.
                let e = c.unary(&ops::EXP, &x)?;
                let s = reduce_with(c, &ops::SUM, &e, &axes, keepdim)?;
                return Ok(vec![c.unary(&ops::LOG, &s)?]);
            }
            // log(sum(exp(x - m))) + m, with m the max, for stability.
            let m = reduce_with(c, &ops::MAX, &x, &axes, true)?;
            let shifted = c.binary(&ops::SUB, &x, &m)?;
            let e = c.unary(&ops::EXP, &shifted)?;
            let s = reduce_with(c, &ops::SUM, &e, &axes, true)?;
            let l = c.unary(&ops::LOG, &s)?;
            let y = c.binary(&ops::ADD, &l, &m)?;
            if keepdim {
                y
            } else {
                let out: Vec<usize> = dims(&y)
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| !(axes.is_empty() || axes.contains(&(*i as i64))))
                    .map(|(_, &d)| d)
                    .collect();
                c.reshape(&y, &out)?
            }
        }
    };
    Ok(vec![y])
}

fn arg(c: &Ctx<'_>, op: &'static OpDef) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let a = axis(c.attr_int("axis", 0), dims(&x).len())?;
    let mut attrs = OpAttrs::new();
    attrs.set_int("axis", a as i64);
    attrs.set_bool("keepdim", c.attr_int("keepdims", 1) != 0);
    if c.attr_int("select_last_index", 0) == 0 {
        return Ok(vec![c.op1(op, &[x], &attrs)?]);
    }
    // The last of equal extremes: the first one along the reversed axis,
    // counted back from the end.
    let n = dims(&x)[a] as i64;
    let reversed: Vec<i64> = (0..n).rev().collect();
    let idx = c.ints_constant(&reversed)?;
    let mut g = OpAttrs::new();
    g.set_int("axis", a as i64);
    let flipped = c.op1(&ops::GATHER, &[x, idx], &g)?;
    let r = c.op1(op, &[flipped], &attrs)?;
    let last = c.scalar((n - 1) as f64, r.dtype())?;
    Ok(vec![c.binary(&ops::SUB, &last, &r)?])
}

fn softmax(c: &Ctx<'_>, op: &'static OpDef) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let d = dims(&x);
    if c.opset < 13 {
        // Before opset 13 the input is flattened to 2-D at `axis` (default
        // 1) and normalized over the second dimension.
        let a = c.attr_int("axis", 1);
        let a = if a == d.len() as i64 {
            d.len()
        } else {
            axis(a, d.len())?
        };
        let outer: usize = d[..a].iter().product();
        let inner: usize = d[a..].iter().product();
        let flat = c.reshape(&x, &[outer, inner])?;
        let mut attrs = OpAttrs::new();
        attrs.set_int("axis", 1);
        let y = c.op1(op, &[flat], &attrs)?;
        return Ok(vec![c.reshape(&y, &d)?]);
    }
    let mut attrs = OpAttrs::new();
    attrs.set_int("axis", axis(c.attr_int("axis", -1), d.len())? as i64);
    Ok(vec![c.op1(op, &[x], &attrs)?])
}

/// `[1, .., n, .., 1]`: `0..n` along `axis` of a rank-`rank` tensor.
pub(crate) fn iota_along(c: &Ctx<'_>, n: usize, axis: usize, rank: usize) -> Result<TensorHandle> {
    let values: Vec<i64> = (0..n as i64).collect();
    let mut d = vec![1; rank];
    d[axis] = n;
    let t = stagecraft_tensor::DenseHostTensor::from_slice(&values, d.as_slice())?;
    Ok(c.constant(t))
}

fn hardmax(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let d = dims(&x);
    let rank = d.len();
    if c.opset < 13 {
        // Flattened to 2-D at `axis`, like Softmax before opset 13.
        let a = c.attr_int("axis", 1);
        let a = if a == rank as i64 {
            rank
        } else {
            axis(a, rank)?
        };
        let outer: usize = d[..a].iter().product();
        let inner: usize = d[a..].iter().product();
        let flat = c.reshape(&x, &[outer, inner])?;
        let y = hardmax_axis(c, &flat, 1)?;
        return Ok(vec![c.reshape(&y, &d)?]);
    }
    let a = axis(c.attr_int("axis", -1), rank)?;
    Ok(vec![hardmax_axis(c, &x, a)?])
}

fn hardmax_axis(c: &Ctx<'_>, x: &TensorHandle, a: usize) -> Result<TensorHandle> {
    let d = dims(x);
    let mut attrs = OpAttrs::new();
    attrs.set_int("axis", a as i64);
    attrs.set_bool("keepdim", true);
    let top = c.op1(&ops::ARGMAX, std::slice::from_ref(x), &attrs)?;
    let iota = iota_along(c, d[a], a, d.len())?;
    let hit = c.binary(&ops::EQUAL, &iota, &top)?;
    c.cast(&hit, x.dtype())
}
