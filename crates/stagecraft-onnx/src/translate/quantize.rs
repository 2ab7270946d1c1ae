//! Quantization ONNX ops, composed of casts and arithmetic:
//! `QuantizeLinear`, `DequantizeLinear` (per tensor, per axis and
//! blocked), `DynamicQuantizeLinear`, `MatMulInteger`, `QLinearMatMul`,
//! `ConvInteger` and `QLinearConv`.
//!
//! Integer products are computed exactly: matrix products in i32 (what
//! ONNX's integer ops accumulate in), convolutions in f64 (every sum of
//! products of 8- and 16-bit values is an integer below 2^53, so exact).
//! Rounding is to nearest, ties to even, as ONNX quantizes. The float8 and
//! 4-bit types have no stagecraft dtype, so their cases stay unsupported
//! (their tensors are refused when read).

use super::{axis, dims, nn, Ctx, Translate};
use crate::error::{OnnxError, Result};
use crate::tensor::dtype_of;
use stagecraft_ops as ops;
use stagecraft_ops::OpAttrs;
use stagecraft_runtime::TensorHandle;
use stagecraft_tensor::DType;

pub(super) fn lookup(op_type: &str) -> Option<Translate> {
    Some(match op_type {
        "QuantizeLinear" => quantize_linear,
        "DequantizeLinear" => dequantize_linear,
        "DynamicQuantizeLinear" => dynamic_quantize_linear,
        "MatMulInteger" => matmul_integer,
        "QLinearMatMul" => qlinear_matmul,
        "ConvInteger" => conv_integer,
        "QLinearConv" => qlinear_conv,
        _ => return None,
    })
}

/// The range of a quantized integer dtype.
fn quant_range(c: &Ctx<'_>, dtype: DType) -> Result<(f64, f64)> {
    Ok(match dtype {
        DType::U8 => (0.0, 255.0),
        DType::I8 => (-128.0, 127.0),
        DType::U16 => (0.0, 65_535.0),
        DType::I16 => (-32_768.0, 32_767.0),
        other => {
            return Err(OnnxError::unsupported(format!(
                "{} to {other} (the quantized integer types are u8, i8, u16 and i16)",
                c.op_type()
            )))
        }
    })
}

/// A scale or zero point `v` shaped to broadcast against an input of dims
/// `xd`: a scalar (or a single element) as it is, a vector along `axis`
/// (per-axis quantization), or with `block > 0` a tensor of `xd`'s rank
/// whose `axis` dimension counts blocks of `block` elements, each
/// repeated over its block (blocked quantization; the last block may be
/// partial).
fn quant_param(
    c: &Ctx<'_>,
    v: &TensorHandle,
    xd: &[usize],
    axis_attr: i64,
    block: i64,
) -> Result<TensorHandle> {
    let vd = dims(v);
    let numel: usize = vd.iter().product();
    if vd.is_empty() || (numel == 1 && block <= 0) {
        return c.reshape(v, &[]);
    }
    let ax = axis(axis_attr, xd.len())?;
    if block <= 0 {
        if vd.len() != 1 || vd[0] != xd[ax] {
            return Err(OnnxError::invalid(format!(
                "{}: a per-axis scale or zero point must be a vector of {} (axis {ax} of {xd:?}), got {vd:?}",
                c.op_type(),
                xd[ax]
            )));
        }
        let mut shape = vec![1; xd.len()];
        shape[ax] = xd[ax];
        return c.reshape(v, &shape);
    }
    let block = block as usize;
    let blocks = xd[ax].div_ceil(block);
    let mut want = xd.to_vec();
    want[ax] = blocks;
    if vd != want {
        return Err(OnnxError::invalid(format!(
            "{}: a blocked scale or zero point of {xd:?} (block {block} along axis {ax}) must be {want:?}, got {vd:?}",
            c.op_type()
        )));
    }
    // [.., B, ..] -> [.., B, 1, ..] -> [.., B, block, ..] -> [.., B·block, ..].
    let mut split = want.clone();
    split.insert(ax + 1, 1);
    let y = c.reshape(v, &split)?;
    split[ax + 1] = block;
    let mut a = OpAttrs::new();
    a.set_dims("shape", &split);
    let y = c.op1(&ops::BROADCAST_TO, &[y], &a)?;
    let mut full = want;
    full[ax] = blocks * block;
    let y = c.reshape(&y, &full)?;
    if full[ax] == xd[ax] {
        return Ok(y);
    }
    let r = xd.len();
    let starts = vec![0i64; r];
    let mut ends: Vec<i64> = full.iter().map(|&d| d as i64).collect();
    ends[ax] = xd[ax] as i64;
    let mut a = OpAttrs::new();
    a.set_ints("starts", &starts);
    a.set_ints("ends", &ends);
    a.set_ints("steps", &vec![1i64; r]);
    c.op1(&ops::SLICE, &[y], &a)
}

/// `round_half_even(q) + zero_point` clamped to `dtype`'s range and cast to
/// it; `q` and `zero_point` are f64.
fn saturate_round(
    c: &Ctx<'_>,
    q: &TensorHandle,
    zero_point: Option<&TensorHandle>,
    dtype: DType,
) -> Result<TensorHandle> {
    let (lo, hi) = quant_range(c, dtype)?;
    let mut y = c.unary(&ops::ROUND, q)?;
    if let Some(zp) = zero_point {
        y = c.binary(&ops::ADD, &y, zp)?;
    }
    let y = c.with_scalar(&ops::MAXIMUM, &y, lo)?;
    let y = c.with_scalar(&ops::MINIMUM, &y, hi)?;
    c.cast(&y, dtype)
}

fn quantize_linear(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let scale = c.input(1)?;
    if !x.dtype().is_float() || !scale.dtype().is_float() {
        return Err(OnnxError::invalid(format!(
            "QuantizeLinear needs a float input and scale, got {} and {}",
            x.dtype(),
            scale.dtype()
        )));
    }
    let zp = c.opt_input(2).cloned();
    let out = match (&zp, c.has_attr("output_dtype")) {
        (Some(zp), _) => zp.dtype(),
        (None, true) => dtype_of(c.attr_int("output_dtype", 2) as i32)?,
        (None, false) => DType::U8,
    };
    quant_range(c, out)?;
    let xd = dims(&x);
    let (axis_attr, block) = (c.attr_int("axis", 1), c.attr_int("block_size", 0));
    // The quotient in the inputs' (or `precision`'s) float type, as ONNX
    // divides, then rounded in f64 (exact for any float).
    let wide = if c.has_attr("precision") {
        dtype_of(c.attr_int("precision", 1) as i32)?
    } else if x.dtype() == scale.dtype() {
        x.dtype()
    } else {
        DType::F32.max(x.dtype()).max(scale.dtype())
    };
    let s = quant_param(c, &scale, &xd, axis_attr, block)?;
    let q = c.binary(&ops::DIV, &c.cast(&x, wide)?, &c.cast(&s, wide)?)?;
    let q = c.cast(&q, DType::F64)?;
    let zp = match zp {
        Some(zp) => Some(c.cast(&quant_param(c, &zp, &xd, axis_attr, block)?, DType::F64)?),
        None => None,
    };
    Ok(vec![saturate_round(c, &q, zp.as_ref(), out)?])
}

fn dequantize_linear(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let scale = c.input(1)?;
    if !x.dtype().is_int() || !scale.dtype().is_float() {
        return Err(OnnxError::invalid(format!(
            "DequantizeLinear needs an integer input and a float scale, got {} and {}",
            x.dtype(),
            scale.dtype()
        )));
    }
    let out = if c.has_attr("output_dtype") {
        dtype_of(c.attr_int("output_dtype", 1) as i32)?
    } else {
        scale.dtype()
    };
    let xd = dims(&x);
    let (axis_attr, block) = (c.attr_int("axis", 1), c.attr_int("block_size", 0));
    // In f64: `x - zero_point` is exact, and so is its product with an f32
    // or f16 scale, so the one rounding is the cast to the output type.
    let mut d = c.cast(&x, DType::F64)?;
    if let Some(zp) = c.opt_input(2) {
        let zp = quant_param(c, zp, &xd, axis_attr, block)?;
        d = c.binary(&ops::SUB, &d, &c.cast(&zp, DType::F64)?)?;
    }
    let s = quant_param(c, &scale, &xd, axis_attr, block)?;
    let y = c.binary(&ops::MUL, &d, &c.cast(&s, DType::F64)?)?;
    Ok(vec![c.cast(&y, out)?])
}

fn dynamic_quantize_linear(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    if x.dtype() != DType::F32 {
        return Err(OnnxError::invalid(format!(
            "DynamicQuantizeLinear needs an f32 input, got {}",
            x.dtype()
        )));
    }
    let reduce_all = |op: &'static ops::OpDef| -> Result<TensorHandle> {
        let mut a = OpAttrs::new();
        a.set_ints("axes", &[]);
        a.set_bool("keepdim", false);
        let r = c.op1(op, std::slice::from_ref(&x), &a)?;
        // The range always includes 0.
        c.with_scalar(
            if op == &ops::MAX {
                &ops::MAXIMUM
            } else {
                &ops::MINIMUM
            },
            &r,
            0.0,
        )
    };
    let (hi, lo) = (reduce_all(&ops::MAX)?, reduce_all(&ops::MIN)?);
    // scale = (max - min) / 255 in f32; zero_point = round(0 - min / scale)
    // saturated to u8; y = saturate(round(x / scale) + zero_point).
    let span = c.binary(&ops::SUB, &hi, &lo)?;
    let scale = c.with_scalar(&ops::DIV, &span, 255.0)?;
    let lo_q = c.binary(&ops::DIV, &lo, &scale)?;
    let zp_f = c.unary(&ops::NEG, &lo_q)?;
    let zp_f = c.cast(&zp_f, DType::F64)?;
    let zp = saturate_round(c, &zp_f, None, DType::U8)?;
    let q = c.binary(&ops::DIV, &x, &scale)?;
    let q = c.cast(&q, DType::F64)?;
    let zp_wide = c.cast(&zp, DType::F64)?;
    let y = saturate_round(c, &q, Some(&zp_wide), DType::U8)?;
    Ok(vec![y, scale, zp])
}

/// `x - zero_point` in `wide` (an integer zero point shaped by `shape`
/// first, when it is not a scalar).
fn centered(
    c: &Ctx<'_>,
    x: &TensorHandle,
    zp: Option<&TensorHandle>,
    wide: DType,
    shape: impl FnOnce(&TensorHandle) -> Result<TensorHandle>,
) -> Result<TensorHandle> {
    let xw = c.cast(x, wide)?;
    let Some(zp) = zp else {
        return Ok(xw);
    };
    let zp = if dims(zp).iter().product::<usize>() == 1 {
        c.reshape(zp, &[])?
    } else {
        shape(zp)?
    };
    c.binary(&ops::SUB, &xw, &c.cast(&zp, wide)?)
}

/// A per-row zero point of a matrix product's left operand (`[M]` for
/// `[.., M, K]`) as a column `[M, 1]`.
fn row_zero_point(c: &Ctx<'_>, zp: &TensorHandle) -> Result<TensorHandle> {
    let d = dims(zp);
    c.reshape(zp, &[d.iter().product(), 1])
}

/// `(a - a_zero_point) @ (b - b_zero_point)` in i32.
fn integer_product(
    c: &Ctx<'_>,
    a: &TensorHandle,
    a_zp: Option<&TensorHandle>,
    b: &TensorHandle,
    b_zp: Option<&TensorHandle>,
) -> Result<TensorHandle> {
    for (role, t) in [("A", a), ("B", b)] {
        if !matches!(t.dtype(), DType::U8 | DType::I8) {
            return Err(OnnxError::invalid(format!(
                "{}: {role} must be u8 or i8, got {}",
                c.op_type(),
                t.dtype()
            )));
        }
    }
    let a = centered(c, a, a_zp, DType::I32, |zp| row_zero_point(c, zp))?;
    let b = centered(c, b, b_zp, DType::I32, |zp| Ok(zp.clone()))?;
    c.op1(&ops::MATMUL, &[a, b], &OpAttrs::new())
}

fn matmul_integer(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let (a, b) = (c.input(0)?, c.input(1)?);
    Ok(vec![integer_product(
        c,
        &a,
        c.opt_input(2),
        &b,
        c.opt_input(3),
    )?])
}

/// The requantization every QLinear op ends with:
/// `saturate(round(acc · a_scale · b_scale / y_scale) + y_zero_point)`,
/// with the scales' product and quotient in their float type (as ONNX
/// forms it) and the rest in f64. `acc` is an exact integer (i32 or f64).
fn requantize(
    c: &Ctx<'_>,
    acc: &TensorHandle,
    a_scale: &TensorHandle,
    b_scale: &TensorHandle,
    y_scale: &TensorHandle,
    y_zp: Option<&TensorHandle>,
    out: DType,
) -> Result<TensorHandle> {
    let ab = c.binary(&ops::MUL, a_scale, &c.cast(b_scale, a_scale.dtype())?)?;
    let factor = c.binary(&ops::DIV, &ab, &c.cast(y_scale, a_scale.dtype())?)?;
    let acc = c.cast(acc, DType::F64)?;
    let q = c.binary(&ops::MUL, &acc, &c.cast(&factor, DType::F64)?)?;
    let zp = match y_zp {
        Some(zp) => Some(c.cast(zp, DType::F64)?),
        None => None,
    };
    saturate_round(c, &q, zp.as_ref(), out)
}

/// A scale that is a single element as a scalar; otherwise as it is.
fn scalar_if_single(c: &Ctx<'_>, v: &TensorHandle) -> Result<TensorHandle> {
    if dims(v).iter().product::<usize>() == 1 {
        c.reshape(v, &[])
    } else {
        Ok(v.clone())
    }
}

fn qlinear_matmul(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let (a, a_scale, a_zp) = (c.input(0)?, c.input(1)?, c.input(2)?);
    let (b, b_scale, b_zp) = (c.input(3)?, c.input(4)?, c.input(5)?);
    let (y_scale, y_zp) = (c.input(6)?, c.input(7)?);
    let acc = integer_product(c, &a, Some(&a_zp), &b, Some(&b_zp))?;
    // Per-row scales of A (`[M]`) become columns; per-column ones of B
    // (`[N]`) broadcast as they are.
    let a_scale = if dims(&a_scale).iter().product::<usize>() == 1 {
        c.reshape(&a_scale, &[])?
    } else {
        row_zero_point(c, &a_scale)?
    };
    let b_scale = scalar_if_single(c, &b_scale)?;
    let y_scale = scalar_if_single(c, &y_scale)?;
    let y_zp = scalar_if_single(c, &y_zp)?;
    Ok(vec![requantize(
        c,
        &acc,
        &a_scale,
        &b_scale,
        &y_scale,
        Some(&y_zp),
        y_zp.dtype(),
    )?])
}

/// A per-output-channel weight parameter (`[M]` for weights
/// `[M, C/group, k..]`) shaped `[M, 1, ..]` to broadcast against them.
fn per_filter(c: &Ctx<'_>, v: &TensorHandle, rank: usize) -> Result<TensorHandle> {
    let mut shape = vec![1; rank];
    shape[0] = dims(v).iter().product();
    c.reshape(v, &shape)
}

/// A per-output-channel parameter (`[M]`) shaped `[1, M, 1, ..]` to
/// broadcast against a convolution's output of `rank`.
fn per_output_channel(c: &Ctx<'_>, v: &TensorHandle, rank: usize) -> Result<TensorHandle> {
    let mut shape = vec![1; rank];
    shape[1] = dims(v).iter().product();
    c.reshape(v, &shape)
}

/// `conv(x - x_zero_point, w - w_zero_point)` with the node's convolution
/// attributes, in f64 (exact).
fn integer_conv(
    c: &Ctx<'_>,
    x: &TensorHandle,
    x_zp: Option<&TensorHandle>,
    w: &TensorHandle,
    w_zp: Option<&TensorHandle>,
) -> Result<TensorHandle> {
    for (role, t) in [("x", x), ("w", w)] {
        if !matches!(t.dtype(), DType::U8 | DType::I8) {
            return Err(OnnxError::invalid(format!(
                "{}: {role} must be u8 or i8, got {}",
                c.op_type(),
                t.dtype()
            )));
        }
    }
    let rank = dims(w).len();
    let x = centered(c, x, x_zp, DType::F64, |_| {
        Err(OnnxError::invalid(format!(
            "{}: the input's zero point must be a scalar",
            c.op_type()
        )))
    })?;
    let w = centered(c, w, w_zp, DType::F64, |zp| per_filter(c, zp, rank))?;
    nn::conv_of(c, x, w, None)
}

fn conv_integer(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let (x, w) = (c.input(0)?, c.input(1)?);
    let y = integer_conv(c, &x, c.opt_input(2), &w, c.opt_input(3))?;
    Ok(vec![c.cast(&y, DType::I32)?])
}

fn qlinear_conv(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let (x, x_scale, x_zp) = (c.input(0)?, c.input(1)?, c.input(2)?);
    let (w, w_scale, w_zp) = (c.input(3)?, c.input(4)?, c.input(5)?);
    let (y_scale, y_zp) = (c.input(6)?, c.input(7)?);
    let mut acc = integer_conv(c, &x, Some(&x_zp), &w, Some(&w_zp))?;
    let rank = dims(&acc).len();
    if let Some(bias) = c.opt_input(8) {
        let bias = per_output_channel(c, &c.cast(bias, DType::F64)?, rank)?;
        acc = c.binary(&ops::ADD, &acc, &bias)?;
    }
    let w_scale = if dims(&w_scale).iter().product::<usize>() == 1 {
        c.reshape(&w_scale, &[])?
    } else {
        per_output_channel(c, &w_scale, rank)?
    };
    let x_scale = scalar_if_single(c, &x_scale)?;
    let y_scale = scalar_if_single(c, &y_scale)?;
    let y_zp = scalar_if_single(c, &y_zp)?;
    Ok(vec![requantize(
        c,
        &acc,
        &x_scale,
        &w_scale,
        &y_scale,
        Some(&y_zp),
        y_zp.dtype(),
    )?])
}
