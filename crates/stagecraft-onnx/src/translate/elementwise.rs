//! Elementwise ONNX ops: math, activations, comparisons, logic, `Where`,
//! `Cast`, `Clip`, the bitwise ops, and the variadic `Sum`/`Mean`/`Max`/`Min`.

use super::{require_float, Ctx, Translate};
use crate::error::{OnnxError, Result};
use crate::tensor::dtype_of;
use stagecraft_ops as ops;
use stagecraft_ops::OpDef;
use stagecraft_runtime::TensorHandle;
use stagecraft_tensor::DType;

pub(super) fn lookup(op_type: &str) -> Option<Translate> {
    Some(match op_type {
        "Neg" => |c| unary(c, &ops::NEG),
        "Abs" => |c| unary(c, &ops::ABS),
        "Exp" => |c| float_unary(c, &ops::EXP),
        "Log" => |c| float_unary(c, &ops::LOG),
        "Sqrt" => |c| float_unary(c, &ops::SQRT),
        "Tanh" => |c| float_unary(c, &ops::TANH),
        "Sigmoid" => |c| float_unary(c, &ops::SIGMOID),
        "Relu" => |c| unary(c, &ops::RELU),
        "Sin" => |c| float_unary(c, &ops::SIN),
        "Cos" => |c| float_unary(c, &ops::COS),
        "Asin" => |c| float_unary(c, &ops::ASIN),
        "Acos" => |c| float_unary(c, &ops::ACOS),
        "Atan" => |c| float_unary(c, &ops::ATAN),
        "Sign" => |c| unary(c, &ops::SIGN),
        "Not" => |c| unary(c, &ops::LOGICAL_NOT),
        "Floor" => |c| unary(c, &ops::FLOOR),
        "Ceil" => |c| unary(c, &ops::CEIL),
        "Round" => |c| unary(c, &ops::ROUND),
        "Erf" => |c| float_unary(c, &ops::ERF),
        "Reciprocal" => |c| float_unary(c, &ops::RECIPROCAL),
        "Softplus" => |c| float_unary(c, &ops::SOFTPLUS),
        "Add" => |c| binary(c, &ops::ADD),
        "Sub" => |c| binary(c, &ops::SUB),
        "Mul" => |c| binary(c, &ops::MUL),
        "Div" => |c| binary(c, &ops::DIV),
        "Pow" => pow,
        "And" => |c| binary(c, &ops::LOGICAL_AND),
        "Or" => |c| binary(c, &ops::LOGICAL_OR),
        "Xor" => |c| binary(c, &ops::NOT_EQUAL),
        "Equal" => |c| binary(c, &ops::EQUAL),
        "Less" => |c| binary(c, &ops::LESS),
        "LessOrEqual" => |c| binary(c, &ops::LESS_EQUAL),
        "Greater" => |c| binary(c, &ops::GREATER),
        "GreaterOrEqual" => |c| binary(c, &ops::GREATER_EQUAL),
        "Max" => |c| variadic(c, &ops::MAXIMUM),
        "Min" => |c| variadic(c, &ops::MINIMUM),
        "Sum" => |c| variadic(c, &ops::ADD),
        "Mean" => mean,
        "Where" => where_,
        "Cast" => cast,
        "CastLike" => cast_like,
        "BitCast" => bit_cast,
        "Clip" => clip,
        "Identity" => |c| Ok(vec![c.input(0)?]),
        "LeakyRelu" => leaky_relu,
        "PRelu" => prelu,
        "Elu" => elu,
        "Celu" => celu,
        "Selu" => selu,
        "HardSigmoid" => hard_sigmoid,
        "HardSwish" => hard_swish,
        "Softsign" => softsign,
        "ThresholdedRelu" => thresholded_relu,
        "Mish" => mish,
        "Gelu" => gelu,
        "Mod" => mod_,
        "Tan" => tan,
        "Sinh" => |c| hyperbolic(c, false),
        "Cosh" => |c| hyperbolic(c, true),
        "Asinh" => asinh,
        "Acosh" => acosh,
        "Atanh" => atanh,
        "Swish" => swish,
        "IsInf" => is_inf,
        "Shrink" => shrink,
        "BitwiseAnd" => |c| binary(c, &ops::BITWISE_AND),
        "BitwiseOr" => |c| binary(c, &ops::BITWISE_OR),
        "BitwiseXor" => |c| binary(c, &ops::BITWISE_XOR),
        "BitwiseNot" => |c| unary(c, &ops::BITWISE_NOT),
        "BitShift" => bit_shift,
        "IsNaN" => |c| {
            let x = c.input(0)?;
            Ok(vec![c.binary(&ops::NOT_EQUAL, &x, &x)?])
        },
        _ => return None,
    })
}

fn unary(c: &Ctx<'_>, op: &'static OpDef) -> Result<Vec<TensorHandle>> {
    Ok(vec![c.unary(op, &c.input(0)?)?])
}

/// A unary op stagecraft defines on floats only; ONNX's integer variants
/// are unsupported.
fn float_unary(c: &Ctx<'_>, op: &'static OpDef) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    require_float(c, &x)?;
    Ok(vec![c.unary(op, &x)?])
}

fn binary(c: &Ctx<'_>, op: &'static OpDef) -> Result<Vec<TensorHandle>> {
    Ok(vec![c.binary(op, &c.input(0)?, &c.input(1)?)?])
}

fn bit_shift(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let op = match c.attr_str("direction", "").as_str() {
        "LEFT" => &ops::SHIFT_LEFT,
        "RIGHT" => &ops::SHIFT_RIGHT,
        other => {
            return Err(OnnxError::invalid(format!(
                "BitShift direction must be LEFT or RIGHT, got '{other}'"
            )))
        }
    };
    binary(c, op)
}

fn pow(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let (x, y) = (c.input(0)?, c.input(1)?);
    if x.dtype().is_float() {
        let y = c.cast(&y, x.dtype())?;
        return Ok(vec![c.binary(&ops::POW, &x, &y)?]);
    }
    // Integer bases: computed in f64 (exact for the results that fit) and
    // rounded back.
    let xf = c.cast(&x, DType::F64)?;
    let yf = c.cast(&y, DType::F64)?;
    let p = c.binary(&ops::POW, &xf, &yf)?;
    let r = c.unary(&ops::ROUND, &p)?;
    Ok(vec![c.cast(&r, x.dtype())?])
}

fn mod_(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let (a, b) = (c.input(0)?, c.input(1)?);
    let fmod = c.attr_int("fmod", 0) != 0;
    let float = a.dtype().is_float();
    if float && !fmod {
        return Err(OnnxError::invalid("Mod of floats needs fmod = 1"));
    }
    // The quotient truncated toward zero: integer division does that; for
    // floats sign(q) * floor(|q|).
    let q = c.binary(&ops::DIV, &a, &b)?;
    let q = if float {
        let s = c.unary(&ops::SIGN, &q)?;
        let m = c.unary(&ops::ABS, &q)?;
        let f = c.unary(&ops::FLOOR, &m)?;
        c.binary(&ops::MUL, &s, &f)?
    } else {
        q
    };
    let qb = c.binary(&ops::MUL, &q, &b)?;
    let r = c.binary(&ops::SUB, &a, &qb)?;
    if fmod {
        return Ok(vec![r]);
    }
    // Python's sign convention: the remainder takes the divisor's sign.
    let zero = c.scalar(0.0, r.dtype())?;
    let r_neg = c.binary(&ops::LESS, &r, &zero)?;
    let b_neg = c.binary(&ops::LESS, &b, &zero)?;
    let differ = c.binary(&ops::NOT_EQUAL, &r_neg, &b_neg)?;
    let nonzero = c.binary(&ops::NOT_EQUAL, &r, &zero)?;
    let fix = c.binary(&ops::LOGICAL_AND, &differ, &nonzero)?;
    let shifted = c.binary(&ops::ADD, &r, &b)?;
    Ok(vec![c.op1(
        &ops::SELECT,
        &[fix, shifted, r],
        &ops::OpAttrs::new(),
    )?])
}

fn is_inf(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    require_float(c, &x)?;
    let pos = c.scalar(f64::INFINITY, x.dtype())?;
    let neg = c.scalar(f64::NEG_INFINITY, x.dtype())?;
    let is_pos = c.binary(&ops::EQUAL, &x, &pos)?;
    let is_neg = c.binary(&ops::EQUAL, &x, &neg)?;
    let (want_pos, want_neg) = (
        c.attr_int("detect_positive", 1) != 0,
        c.attr_int("detect_negative", 1) != 0,
    );
    Ok(vec![match (want_pos, want_neg) {
        (true, true) => c.binary(&ops::LOGICAL_OR, &is_pos, &is_neg)?,
        (true, false) => is_pos,
        (false, true) => is_neg,
        (false, false) => c.binary(&ops::LOGICAL_AND, &is_pos, &is_neg)?,
    }])
}

fn shrink(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let lambd = c.attr_float("lambd", 0.5) as f64;
    let bias = c.attr_float("bias", 0.0) as f64;
    let dt = x.dtype();
    let lo = c.scalar(-lambd, dt)?;
    let hi = c.scalar(lambd, dt)?;
    let zero = c.scalar(0.0, dt)?;
    let below = c.binary(&ops::LESS, &x, &lo)?;
    let above = c.binary(&ops::GREATER, &x, &hi)?;
    let plus = c.with_scalar(&ops::ADD, &x, bias)?;
    let minus = c.with_scalar(&ops::SUB, &x, bias)?;
    let a = c.op1(&ops::SELECT, &[above, minus, zero], &ops::OpAttrs::new())?;
    Ok(vec![c.op1(
        &ops::SELECT,
        &[below, plus, a],
        &ops::OpAttrs::new(),
    )?])
}

fn variadic(c: &Ctx<'_>, op: &'static OpDef) -> Result<Vec<TensorHandle>> {
    let inputs = c.inputs();
    let (first, rest) = inputs
        .split_first()
        .ok_or_else(|| OnnxError::invalid("needs at least one input"))?;
    let mut acc = first.clone();
    for x in rest {
        acc = c.binary(op, &acc, x)?;
    }
    Ok(vec![acc])
}

fn mean(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let n = c.inputs().len() as f64;
    let sum = variadic(c, &ops::ADD)?.remove(0);
    Ok(vec![c.with_scalar(&ops::DIV, &sum, n)?])
}

fn where_(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    Ok(vec![c.op1(
        &ops::SELECT,
        &[c.input(0)?, c.input(1)?, c.input(2)?],
        &ops::OpAttrs::new(),
    )?])
}

fn cast(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let to = dtype_of(c.attr_int("to", 1) as i32)?;
    Ok(vec![c.cast(&c.input(0)?, to)?])
}

fn bit_cast(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let to = dtype_of(c.attr_int("to", 1) as i32)?;
    let x = c.input(0)?;
    if x.dtype() == to {
        return Ok(vec![x]);
    }
    let mut a = ops::OpAttrs::new();
    a.set_dtype("dtype", to);
    Ok(vec![c.op1(&ops::BITCAST, &[x], &a)?])
}

fn cast_like(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let to = c.input(1)?.dtype();
    Ok(vec![c.cast(&c.input(0)?, to)?])
}

fn clip(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let mut x = c.input(0)?;
    let (lo, hi) = if c.opset < 11 {
        let lo = c.attr_float("min", f32::MIN);
        let hi = c.attr_float("max", f32::MAX);
        (
            Some(c.scalar(lo as f64, x.dtype())?),
            Some(c.scalar(hi as f64, x.dtype())?),
        )
    } else {
        (c.opt_input(1).cloned(), c.opt_input(2).cloned())
    };
    if let Some(lo) = lo {
        x = c.binary(&ops::MAXIMUM, &x, &lo)?;
    }
    if let Some(hi) = hi {
        x = c.binary(&ops::MINIMUM, &x, &hi)?;
    }
    Ok(vec![x])
}

/// `select(x < 0, neg, x)`.
fn negative_part(c: &Ctx<'_>, x: &TensorHandle, neg: &TensorHandle) -> Result<TensorHandle> {
    let zero = c.scalar(0.0, x.dtype())?;
    let below = c.binary(&ops::LESS, x, &zero)?;
    c.op1(
        &ops::SELECT,
        &[below, neg.clone(), x.clone()],
        &ops::OpAttrs::new(),
    )
}

fn leaky_relu(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let alpha = c.attr_float("alpha", 0.01) as f64;
    let neg = c.with_scalar(&ops::MUL, &x, alpha)?;
    Ok(vec![negative_part(c, &x, &neg)?])
}

fn prelu(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let mut slope = c.input(1)?;
    let (xd, sd) = (super::dims(&x), super::dims(&slope));
    // Before opset 7 a slope of [C] applies per channel of [N, C, ...].
    if c.opset < 7 && sd.len() == 1 && xd.len() > 2 && sd[0] == xd[1] && sd[0] != 1 {
        let mut d = vec![1; xd.len() - 1];
        d[0] = sd[0];
        slope = c.reshape(&slope, &d)?;
    }
    let neg = c.binary(&ops::MUL, &x, &slope)?;
    Ok(vec![negative_part(c, &x, &neg)?])
}

fn elu(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    require_float(c, &x)?;
    let alpha = c.attr_float("alpha", 1.0) as f64;
    let em1 = c.unary(&ops::EXPM1, &x)?;
    let neg = c.with_scalar(&ops::MUL, &em1, alpha)?;
    Ok(vec![negative_part(c, &x, &neg)?])
}

fn celu(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    require_float(c, &x)?;
    let alpha = c.attr_float("alpha", 1.0) as f64;
    let scaled = c.with_scalar(&ops::DIV, &x, alpha)?;
    let em1 = c.unary(&ops::EXPM1, &scaled)?;
    let neg = c.with_scalar(&ops::MUL, &em1, alpha)?;
    Ok(vec![negative_part(c, &x, &neg)?])
}

fn selu(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    require_float(c, &x)?;
    let alpha = c.attr_float("alpha", 1.673_263_2) as f64;
    let gamma = c.attr_float("gamma", 1.050_701) as f64;
    let em1 = c.unary(&ops::EXPM1, &x)?;
    let neg = c.with_scalar(&ops::MUL, &em1, alpha)?;
    let y = negative_part(c, &x, &neg)?;
    Ok(vec![c.with_scalar(&ops::MUL, &y, gamma)?])
}

fn hard_sigmoid_of(c: &Ctx<'_>, x: &TensorHandle, alpha: f64, beta: f64) -> Result<TensorHandle> {
    let y = c.with_scalar(&ops::MUL, x, alpha)?;
    let y = c.with_scalar(&ops::ADD, &y, beta)?;
    let y = c.with_scalar(&ops::MAXIMUM, &y, 0.0)?;
    c.with_scalar(&ops::MINIMUM, &y, 1.0)
}

fn hard_sigmoid(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    require_float(c, &x)?;
    let alpha = c.attr_float("alpha", 0.2) as f64;
    let beta = c.attr_float("beta", 0.5) as f64;
    Ok(vec![hard_sigmoid_of(c, &x, alpha, beta)?])
}

fn hard_swish(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    require_float(c, &x)?;
    let h = hard_sigmoid_of(c, &x, 1.0 / 6.0, 0.5)?;
    Ok(vec![c.binary(&ops::MUL, &x, &h)?])
}

fn softsign(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    require_float(c, &x)?;
    let a = c.unary(&ops::ABS, &x)?;
    let d = c.with_scalar(&ops::ADD, &a, 1.0)?;
    Ok(vec![c.binary(&ops::DIV, &x, &d)?])
}

fn thresholded_relu(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let alpha = c.scalar(c.attr_float("alpha", 1.0) as f64, x.dtype())?;
    let zero = c.scalar(0.0, x.dtype())?;
    let above = c.binary(&ops::GREATER, &x, &alpha)?;
    Ok(vec![c.op1(
        &ops::SELECT,
        &[above, x, zero],
        &ops::OpAttrs::new(),
    )?])
}

fn mish(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    require_float(c, &x)?;
    let sp = c.unary(&ops::SOFTPLUS, &x)?;
    let t = c.unary(&ops::TANH, &sp)?;
    Ok(vec![c.binary(&ops::MUL, &x, &t)?])
}

fn gelu(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    require_float(c, &x)?;
    let op = match c.attr_str("approximate", "none").as_str() {
        "none" => &ops::GELU,
        "tanh" => &ops::GELU_TANH,
        other => {
            return Err(OnnxError::unsupported(format!(
                "Gelu approximate = {other}"
            )))
        }
    };
    Ok(vec![c.unary(op, &x)?])
}

fn tan(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    require_float(c, &x)?;
    let s = c.unary(&ops::SIN, &x)?;
    let k = c.unary(&ops::COS, &x)?;
    Ok(vec![c.binary(&ops::DIV, &s, &k)?])
}

/// `(e^x ∓ e^-x) / 2`.
fn hyperbolic(c: &Ctx<'_>, cosh: bool) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    require_float(c, &x)?;
    let e = c.unary(&ops::EXP, &x)?;
    let n = c.unary(&ops::NEG, &x)?;
    let en = c.unary(&ops::EXP, &n)?;
    let op = if cosh { &ops::ADD } else { &ops::SUB };
    let t = c.binary(op, &e, &en)?;
    Ok(vec![c.with_scalar(&ops::MUL, &t, 0.5)?])
}

/// `log(x + sqrt(x² + shift))`.
fn log_sqrt(c: &Ctx<'_>, x: &TensorHandle, shift: f64) -> Result<TensorHandle> {
    let sq = c.binary(&ops::MUL, x, x)?;
    let sh = c.with_scalar(&ops::ADD, &sq, shift)?;
    let r = c.unary(&ops::SQRT, &sh)?;
    let s = c.binary(&ops::ADD, x, &r)?;
    c.unary(&ops::LOG, &s)
}

fn asinh(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    require_float(c, &x)?;
    Ok(vec![log_sqrt(c, &x, 1.0)?])
}

fn acosh(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    require_float(c, &x)?;
    Ok(vec![log_sqrt(c, &x, -1.0)?])
}

fn atanh(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    require_float(c, &x)?;
    let one = c.scalar(1.0, x.dtype())?;
    let num = c.binary(&ops::ADD, &one, &x)?;
    let den = c.binary(&ops::SUB, &one, &x)?;
    let q = c.binary(&ops::DIV, &num, &den)?;
    let l = c.unary(&ops::LOG, &q)?;
    Ok(vec![c.with_scalar(&ops::MUL, &l, 0.5)?])
}

fn swish(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    require_float(c, &x)?;
    let alpha = c.attr_float("alpha", 1.0) as f64;
    let ax = c.with_scalar(&ops::MUL, &x, alpha)?;
    let s = c.unary(&ops::SIGMOID, &ax)?;
    Ok(vec![c.binary(&ops::MUL, &x, &s)?])
}
