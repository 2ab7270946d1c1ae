//! Elementwise ops: unary math, broadcasting binary arithmetic, comparisons,
//! logical ops, select and cast.

use super::{one, require_same_dtype};
use crate::attrs::AttrKind;
use crate::elementwise::DTypeClass;
use crate::grad::{GradBuilder, GradContext, InputGrads, G};
use crate::op::*;
use crate::scalar::{
    erf, exp_to_narrow, expm1, float_fn, gelu, gelu_derivative, gelu_derivative_to_narrow,
    gelu_tanh, gelu_tanh_to_narrow, gelu_to_narrow, gelu_with_derivative_to_narrow, log1p, relu,
    rsqrt, sigmoid, sigmoid_to_narrow, sign, silu, silu_to_narrow, softplus, tanh_to_narrow, Num,
};
use stagecraft_tensor::{broadcast_shapes, DType, Error, Result, TensorMetadata};

/// The definition every unary op shares: one input, no attributes, the
/// dtype class and gradient rule of its table entry (none at all for an
/// integer op).
const fn unary_def(name: &'static str, op: UnaryOp) -> OpDef {
    OpDef {
        name,
        inputs: &["x"],
        variadic: false,
        outputs: 1,
        attrs: &[],
        kind: OpKind::Unary(op),
        effect: Effect::Pure,
        shape_kind: ShapeKind::Static,
        metadata: unary_meta,
        grad: if matches!(op.class(), DTypeClass::Int) {
            None
        } else {
            Some(unary_grad)
        },
    }
}

fn unary_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let x = &inputs[0];
    let OpKind::Unary(op) = attrs.op().kind else {
        return Err(Error::internal("unary_meta on a non-unary op"));
    };
    require_class(op.class(), "x", x)?;
    one(x.clone())
}

fn require_class(class: DTypeClass, role: &str, meta: &TensorMetadata) -> Result<()> {
    if class.accepts(meta.dtype) {
        Ok(())
    } else {
        Err(Error::dtype(format!(
            "{role} must be {}, got {meta}",
            class.describe()
        )))
    }
}

/// The definition every binary op shares: two broadcast inputs of one
/// dtype, no attributes.
const fn binary_def(name: &'static str, op: BinaryOp) -> OpDef {
    OpDef {
        name,
        inputs: &["a", "b"],
        variadic: false,
        outputs: 1,
        attrs: &[],
        kind: OpKind::Binary(op),
        effect: Effect::Pure,
        shape_kind: ShapeKind::Static,
        metadata: binary_meta,
        grad: if matches!(op.class(), DTypeClass::Int) {
            None
        } else {
            Some(binary_grad)
        },
    }
}

fn binary_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let (a, b) = (&inputs[0], &inputs[1]);
    let dtype = require_same_dtype(a, b)?;
    let OpKind::Binary(op) = attrs.op().kind else {
        return Err(Error::internal("binary_meta on a non-binary op"));
    };
    if !op.class().accepts(dtype) {
        return Err(Error::dtype(format!(
            "operands must be {}, got {a} and {b}",
            op.class().describe()
        )));
    }
    one(TensorMetadata::new(
        dtype,
        broadcast_shapes(&a.shape, &b.shape)?,
    ))
}

// ---------------------------------------------------------------------------
// The unary ops. To add one: an entry here, a method on `Tensor<T>`
// (`stagecraft/src/ops.rs`) and a gradient-check case; the kernels, the
// fused interpreter and the reference derive from the entry.

crate::unary_ops! {
    /// `-x`
    Neg => NEG("Neg", Numeric) {
        eval: |x| x.neg(),
        wgsl: "-x",
        grad: |b, _, _, g| b.neg(g),
    }
    /// `|x|`
    Abs => ABS("Abs", Numeric) {
        eval: |x| x.abs(),
        wgsl: "abs(x)",
        grad: |b, x, _, g| {
            let s = b.unary(&SIGN, x)?;
            b.mul(g, s)
        },
    }
    /// `e^x`
    Exp => EXP("Exp", Float) {
        eval: |x| float_fn!(x, f64::exp, exp_to_narrow),
        wgsl: "exp(x)",
        grad: |b, _, y, g| b.mul(g, y),
    }
    /// Natural logarithm.
    Log => LOG("Log", Float) {
        eval: |x| x.via_f64(f64::ln),
        wgsl: "log(x)",
        grad: |b, x, _, g| b.div(g, x),
    }
    /// Square root.
    Sqrt => SQRT("Sqrt", Float) {
        eval: |x| x.via_f64(f64::sqrt),
        // d sqrt(x) = 1 / (2 sqrt(x))
        wgsl: "sqrt(x)",
        grad: |b, _, y, g| {
            let twice = b.scale(y, 2.0)?;
            b.div(g, twice)
        },
    }
    /// `1/sqrt(x)`
    Rsqrt => RSQRT("Rsqrt", Float) {
        eval: |x| x.via_f64(rsqrt),
        // d x^(-1/2) = -x^(-3/2) / 2 = -y^3 / 2
        wgsl: "inverseSqrt(x)",
        grad: |b, _, y, g| {
            let y2 = b.mul(y, y)?;
            let y3 = b.mul(y2, y)?;
            let d = b.scale(y3, -0.5)?;
            b.mul(g, d)
        },
    }
    /// Hyperbolic tangent.
    Tanh => TANH("Tanh", Float) {
        eval: |x| float_fn!(x, f64::tanh, tanh_to_narrow),
        wgsl: "sc_tanh(x)",
        grad: |b, x, y, g| {
            let y2 = b.mul(y, y)?;
            let one = b.scalar(1.0, b.meta(x).dtype)?;
            let d = b.sub(one, y2)?;
            b.mul(g, d)
        },
    }
    /// Logistic sigmoid, `1/(1+e^-x)`.
    Sigmoid => SIGMOID("Sigmoid", Float) {
        eval: |x| float_fn!(x, sigmoid, sigmoid_to_narrow),
        wgsl: "sc_sigmoid(x)",
        grad: |b, x, y, g| {
            let one = b.scalar(1.0, b.meta(x).dtype)?;
            let rest = b.sub(one, y)?;
            let d = b.mul(y, rest)?;
            b.mul(g, d)
        },
    }
    /// Rectified linear unit, `max(x, 0)` (NaN stays NaN).
    Relu => RELU("Relu", Numeric) {
        // Floats through f64, which quiets a NaN: the fused chains do the
        // same, so fused and unfused results keep the same bits.
        eval: |x| {
            if T::FLOAT {
                x.via_f64(relu)
            } else if x > T::ZERO {
                x
            } else {
                T::ZERO
            }
        },
        // relu(x) > 0 exactly where x > 0 (NaN compares false in both).
        // Reading the output instead of the input leaves the relu its
        // input's only user, so a staged relu joins its producer's kernel
        // (a matmul's epilogue) and the input is never kept for backward.
        wgsl: "select(0, x, x > 0 || sc_isnan(x))",
        grad: |b, x, y, g| {
            let dtype = b.meta(x).dtype;
            let zero = b.scalar(0.0, dtype)?;
            let positive = b.op(&GREATER, &[y, zero], &crate::OpAttrs::new())?;
            let m = b.mask(positive, dtype)?;
            b.mul(g, m)
        },
    }
    /// Gaussian error linear unit, exact form `x·Φ(x)`.
    Gelu => GELU("Gelu", Float) {
        eval: |x| float_fn!(x, gelu, gelu_to_narrow),
        wgsl: "0.5 * x * (1.0 + sc_erf(x * 0.70710678118654752))",
        grad: |b, x, y, g| {
            let d = b.op(&GELU_DERIVATIVE, &[x, y], &crate::OpAttrs::new())?;
            b.mul(g, d)
        },
    }
    /// Sine.
    Sin => SIN("Sin", Float) {
        eval: |x| x.via_f64(f64::sin),
        wgsl: "sc_sin(x)",
        grad: |b, x, _, g| {
            let c = b.unary(&COS, x)?;
            b.mul(g, c)
        },
    }
    /// Cosine.
    Cos => COS("Cos", Float) {
        eval: |x| x.via_f64(f64::cos),
        wgsl: "sc_cos(x)",
        grad: |b, x, _, g| {
            let s = b.unary(&SIN, x)?;
            let d = b.mul(g, s)?;
            b.neg(d)
        },
    }
    /// Arcsine, in `[-π/2, π/2]` (NaN outside `[-1, 1]`).
    Asin => ASIN("Asin", Float) {
        eval: |x| x.via_f64(f64::asin),
        // d asin(x) = 1 / sqrt(1 - x²)
        wgsl: "2.0 * sc_atan(x / (1.0 + sqrt((1.0 - x) * (1.0 + x))))",
        grad: |b, x, _, g| {
            let x2 = b.mul(x, x)?;
            let one = b.scalar(1.0, b.meta(x).dtype)?;
            let rest = b.sub(one, x2)?;
            let root = b.unary(&SQRT, rest)?;
            b.div(g, root)
        },
    }
    /// Arccosine, in `[0, π]` (NaN outside `[-1, 1]`).
    Acos => ACOS("Acos", Float) {
        eval: |x| x.via_f64(f64::acos),
        // d acos(x) = -1 / sqrt(1 - x²)
        wgsl: "2.0 * sc_atan(sqrt((1.0 - x) / (1.0 + x)))",
        grad: |b, x, _, g| {
            let x2 = b.mul(x, x)?;
            let one = b.scalar(1.0, b.meta(x).dtype)?;
            let rest = b.sub(one, x2)?;
            let root = b.unary(&SQRT, rest)?;
            let d = b.div(g, root)?;
            b.neg(d)
        },
    }
    /// Arctangent, in `(-π/2, π/2)`.
    Atan => ATAN("Atan", Float) {
        eval: |x| x.via_f64(f64::atan),
        // d atan(x) = 1 / (1 + x²)
        wgsl: "sc_atan(x)",
        grad: |b, x, _, g| {
            let x2 = b.mul(x, x)?;
            let one = b.scalar(1.0, b.meta(x).dtype)?;
            let den = b.add(one, x2)?;
            b.div(g, den)
        },
    }
    /// Sign: -1, 0 or 1 (±0 and NaN stay as they are).
    Sign => SIGN("Sign", Numeric) {
        eval: |x| {
            if T::FLOAT {
                x.via_f64(sign)
            } else if x > T::ZERO {
                T::ONE
            } else if x < T::ZERO {
                T::ZERO.sub(T::ONE)
            } else {
                T::ZERO
            }
        },
        wgsl: "select(select(x, -1, x < 0), 1, x > 0)",
        grad: none,
    }
    /// Logical not of a bool tensor.
    Not => LOGICAL_NOT("LogicalNot", Bool) {
        eval: |x| if x == T::ZERO { T::ONE } else { T::ZERO },
        wgsl: "select(0, 1, x == 0)",
        grad: none,
    }
    /// The largest integer not above `x` (integers are their own floor).
    Floor => FLOOR("Floor", Numeric) {
        eval: |x| if T::FLOAT { x.via_f64(f64::floor) } else { x },
        wgsl: "sc_floor(x)",
        grad: none,
    }
    /// The smallest integer not below `x`.
    Ceil => CEIL("Ceil", Numeric) {
        eval: |x| if T::FLOAT { x.via_f64(f64::ceil) } else { x },
        wgsl: "sc_ceil(x)",
        grad: none,
    }
    /// The nearest integer, halves to even (as NumPy and PyTorch round).
    Round => ROUND("Round", Numeric) {
        eval: |x| if T::FLOAT { x.via_f64(f64::round_ties_even) } else { x },
        wgsl: "sc_round(x)",
        grad: none,
    }
    /// The error function.
    Erf => ERF("Erf", Float) {
        eval: |x| x.via_f64(erf),
        // d erf(x) = 2/√π · e^(-x²)
        wgsl: "sc_erf(x)",
        grad: |b, x, _, g| {
            let x2 = b.mul(x, x)?;
            let e = b.neg(x2)?;
            let e = b.unary(&EXP, e)?;
            let d = b.scale(e, std::f64::consts::FRAC_2_SQRT_PI)?;
            b.mul(g, d)
        },
    }
    /// GELU's tanh approximation, `x·(1 + tanh(√(2/π)(x + 0.044715x³)))/2`.
    GeluTanh => GELU_TANH("GeluTanh", Float) {
        eval: |x| float_fn!(x, gelu_tanh, gelu_tanh_to_narrow),
        // With s = σ(2u), u = c(x + k x³): y = x s, and
        // dy/dx = s + x s (1 - s) · 2c (1 + 3k x²).
        wgsl: "x / (1.0 + exp(-1.5957691216057307 * (x + 0.044715 * x * x * x)))",
        grad: |b, x, _, g| {
            const C: f64 = 0.797_884_560_802_865_4;
            const K: f64 = 0.044_715;
            let dtype = b.meta(x).dtype;
            let one = b.scalar(1.0, dtype)?;
            let x2 = b.mul(x, x)?;
            let kx2 = b.scale(x2, K)?;
            let inner = b.add(one, kx2)?;
            let u = b.mul(x, inner)?;
            let two_u = b.scale(u, 2.0 * C)?;
            let s = b.unary(&SIGMOID, two_u)?;
            let rest = b.sub(one, s)?;
            let ds = b.mul(s, rest)?;
            let k3x2 = b.scale(x2, 3.0 * K)?;
            let du = b.add(one, k3x2)?;
            let du = b.scale(du, 2.0 * C)?;
            let t = b.mul(ds, du)?;
            let t = b.mul(x, t)?;
            let d = b.add(s, t)?;
            b.mul(g, d)
        },
    }
    /// SiLU (swish), `x·σ(x)`.
    Silu => SILU("Silu", Float) {
        eval: |x| float_fn!(x, silu, silu_to_narrow),
        // d x σ(x) = σ(x) (1 + x (1 - σ(x)))
        wgsl: "x * sc_sigmoid(x)",
        grad: |b, x, _, g| {
            let one = b.scalar(1.0, b.meta(x).dtype)?;
            let s = b.unary(&SIGMOID, x)?;
            let rest = b.sub(one, s)?;
            let t = b.mul(x, rest)?;
            let t = b.add(one, t)?;
            let d = b.mul(s, t)?;
            b.mul(g, d)
        },
    }
    /// Softplus, `ln(1 + e^x)`, without overflow.
    Softplus => SOFTPLUS("Softplus", Float) {
        eval: |x| x.via_f64(softplus),
        wgsl: "select(max(x, 0.0) + sc_log1p(exp(-abs(x))), x, sc_isnan(x))",
        grad: |b, x, _, g| {
            let s = b.unary(&SIGMOID, x)?;
            b.mul(g, s)
        },
    }
    /// `ln(1 + x)`, accurate near 0.
    Log1p => LOG1P("Log1p", Float) {
        eval: |x| x.via_f64(log1p),
        wgsl: "sc_log1p(x)",
        grad: |b, x, _, g| {
            let one = b.scalar(1.0, b.meta(x).dtype)?;
            let d = b.add(one, x)?;
            b.div(g, d)
        },
    }
    /// `e^x - 1`, accurate near 0.
    Expm1 => EXPM1("Expm1", Float) {
        eval: |x| x.via_f64(expm1),
        wgsl: "sc_expm1(x)",
        grad: |b, x, y, g| {
            let one = b.scalar(1.0, b.meta(x).dtype)?;
            let d = b.add(y, one)?;
            b.mul(g, d)
        },
    }
    /// `1/x`.
    Reciprocal => RECIPROCAL("Reciprocal", Float) {
        eval: |x| x.via_f64(|v| 1.0 / v),
        // d 1/x = -1/x² = -y²
        wgsl: "1.0 / x",
        grad: |b, _, y, g| {
            let y2 = b.mul(y, y)?;
            let d = b.mul(g, y2)?;
            b.neg(d)
        },
    }
    /// `x²` (integers wrap).
    Square => SQUARE("Square", Numeric) {
        eval: |x| x.mul(x),
        wgsl: "x * x",
        grad: |b, x, _, g| {
            let twice = b.scale(x, 2.0)?;
            b.mul(g, twice)
        },
    }
    /// Bitwise not of an integer tensor (every bit flipped).
    BitNot => BITWISE_NOT("BitwiseNot", Int) {
        eval: |x| x.bit_not(),
        wgsl: "~x",
        grad: none,
    }
}

// ---------------------------------------------------------------------------
// The binary ops. To add one: an entry here, a method on `Tensor<T>` and a
// gradient-check case.

crate::binary_ops! {
    /// `a + b`
    Add => ADD("Add", Numeric) {
        eval: |a, b| a.add(b),
        wgsl: "a + b",
        grad: |_, _, _, _, g| Ok((g, g)),
    }
    /// `a - b`
    Sub => SUB("Sub", Numeric) {
        eval: |a, b| a.sub(b),
        wgsl: "a - b",
        grad: |b, _, _, _, g| Ok((g, b.neg(g)?)),
    }
    /// `a * b`
    Mul => MUL("Mul", Numeric) {
        eval: |a, b| a.mul(b),
        wgsl: "a * b",
        grad: |b, x, y, _, g| Ok((b.mul(g, y)?, b.mul(g, x)?)),
    }
    /// `a / b` (integer division truncates; an integer zero divisor is an
    /// error)
    Div => DIV("Div", Numeric) {
        eval: |a, b| a.div(b),
        wgsl: "a / b",
        zero_divisor_is_error: true,
        // d(x/y) = g/y, -g x/y^2 = -g out / y
        grad: |b, _, y, out, g| {
            let dx = b.div(g, y)?;
            let t = b.mul(dx, out)?;
            Ok((dx, b.neg(t)?))
        },
    }
    /// `a ^ b` (floating point)
    Pow => POW("Pow", Float) {
        eval: |a, b| T::from_f64(a.to_f64().powf(b.to_f64())),
        // d x^y = y x^(y-1) and x^y ln x
        wgsl: "sc_pow(a, b)",
        grad: |b, x, y, out, g| {
            let one = b.scalar(1.0, b.meta(x).dtype)?;
            let ym1 = b.sub(y, one)?;
            let p = b.op(&POW, &[x, ym1], &crate::OpAttrs::new())?;
            let d = b.mul(y, p)?;
            let dx = b.mul(g, d)?;
            let lx = b.unary(&LOG, x)?;
            let d = b.mul(out, lx)?;
            Ok((dx, b.mul(g, d)?))
        },
    }
    /// The larger of the two (NaN wins).
    Maximum => MAXIMUM("Maximum", Numeric) {
        eval: |a, b| a.maximum(b),
        wgsl: "select(select(b, a, a > b), sc_nan(), sc_isnan(a) || sc_isnan(b))",
        grad: |b, x, y, _, g| extremum_grad(b, &GREATER_EQUAL, x, y, g),
    }
    /// The smaller of the two (NaN wins).
    Minimum => MINIMUM("Minimum", Numeric) {
        eval: |a, b| a.minimum(b),
        wgsl: "select(select(b, a, a < b), sc_nan(), sc_isnan(a) || sc_isnan(b))",
        grad: |b, x, y, _, g| extremum_grad(b, &LESS_EQUAL, x, y, g),
    }
    /// GELU's derivative `Φ(a) + a·φ(a)` given `b = gelu(a)`, the factor
    /// GELU's gradient multiplies by: one elementwise op that fuses into
    /// the multiply (as a composite, selects around `b/a` and an
    /// exponential, it was four kernels and the largest non-matmul cost of
    /// a GPT's training step). Its gradient treats the pair as the
    /// function of `a` it stands for: all of it goes to `a`.
    GeluDerivative => GELU_DERIVATIVE("GeluDerivative", Float) {
        eval: |a, b| {
            let (x, y) = (a.to_f64(), b.to_f64());
            T::from_f64(if T::NARROW {
                gelu_derivative_to_narrow(x, y)
            } else {
                gelu_derivative(x, y)
            })
        },
        wgsl: "sc_gelu_derivative(a, b)",
        grad: |b, x, y, _, g| {
            let dtype = b.meta(x).dtype;
            let d = gelu_second_derivative(b, x)?;
            let gx = b.mul(g, d)?;
            let zero = b.scalar(0.0, dtype)?;
            let dims = b.meta(y).shape.dims().to_vec();
            let gy = b.broadcast_to(zero, &dims)?;
            Ok((gx, gy))
        },
    }
    /// Logical and of bool tensors.
    And => LOGICAL_AND("LogicalAnd", Bool) {
        eval: |a, b| if a != T::ZERO && b != T::ZERO { T::ONE } else { T::ZERO },
        wgsl: "select(0, 1, a != 0 && b != 0)",
        grad: none,
    }
    /// Logical or of bool tensors.
    Or => LOGICAL_OR("LogicalOr", Bool) {
        eval: |a, b| if a != T::ZERO || b != T::ZERO { T::ONE } else { T::ZERO },
        wgsl: "select(0, 1, a != 0 || b != 0)",
        grad: none,
    }
    /// Bitwise and of integer tensors.
    BitAnd => BITWISE_AND("BitwiseAnd", Int) {
        eval: |a, b| a.bit_and(b),
        wgsl: "a & b",
        grad: none,
    }
    /// Bitwise or of integer tensors.
    BitOr => BITWISE_OR("BitwiseOr", Int) {
        eval: |a, b| a.bit_or(b),
        wgsl: "a | b",
        grad: none,
    }
    /// Bitwise exclusive or of integer tensors.
    BitXor => BITWISE_XOR("BitwiseXor", Int) {
        eval: |a, b| a.bit_xor(b),
        wgsl: "a ^ b",
        grad: none,
    }
    /// `a << b` on integer tensors; an amount outside `0..bits` (the
    /// dtype's width) gives 0.
    ShiftLeft => SHIFT_LEFT("ShiftLeft", Int) {
        eval: |a, b| a.shift_left(b),
        // WGSL takes a shift amount modulo 32: out of range is chosen
        // here. (A GPU kernel runs this over i32 only.)
        wgsl: "select(0, a << u32(b), b >= 0 && b < 32)",
        grad: none,
    }
    /// `a >> b` on integer tensors: arithmetic for signed dtypes, logical
    /// for unsigned ones; an amount outside `0..bits` shifts every bit out
    /// (0, or -1 for a negative signed value).
    ShiftRight => SHIFT_RIGHT("ShiftRight", Int) {
        eval: |a, b| a.shift_right(b),
        // `a >> 31u` is what every bit shifted out leaves of the sign.
        wgsl: "select(a >> 31u, a >> u32(b), b >= 0 && b < 32)",
        grad: none,
    }
}

const fn compare(name: &'static str, op: CompareOp) -> OpDef {
    OpDef {
        name,
        inputs: &["a", "b"],
        variadic: false,
        outputs: 1,
        attrs: &[],
        kind: OpKind::Compare(op),
        effect: Effect::Pure,
        shape_kind: ShapeKind::Static,
        metadata: compare_meta,
        grad: None,
    }
}

fn compare_meta(inputs: &[TensorMetadata], _: &Attrs<'_>) -> Result<OutputMetas> {
    let (a, b) = (&inputs[0], &inputs[1]);
    require_same_dtype(a, b)?;
    one(TensorMetadata::new(
        DType::Bool,
        broadcast_shapes(&a.shape, &b.shape)?,
    ))
}

/// `a == b`
pub static EQUAL: OpDef = compare("Equal", CompareOp::Eq);
/// `a != b`
pub static NOT_EQUAL: OpDef = compare("NotEqual", CompareOp::Ne);
/// `a < b`
pub static LESS: OpDef = compare("Less", CompareOp::Lt);
/// `a <= b`
pub static LESS_EQUAL: OpDef = compare("LessEqual", CompareOp::Le);
/// `a > b`
pub static GREATER: OpDef = compare("Greater", CompareOp::Gt);
/// `a >= b`
pub static GREATER_EQUAL: OpDef = compare("GreaterEqual", CompareOp::Ge);

/// `cond ? a : b`, elementwise with broadcasting of all three.
pub static SELECT: OpDef = OpDef {
    name: "Select",
    inputs: &["cond", "a", "b"],
    variadic: false,
    outputs: 1,
    attrs: &[],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: select_meta,
    grad: Some(select_grad),
};

fn select_meta(inputs: &[TensorMetadata], _: &Attrs<'_>) -> Result<OutputMetas> {
    let (cond, a, b) = (&inputs[0], &inputs[1], &inputs[2]);
    if cond.dtype != DType::Bool {
        return Err(Error::dtype(format!("cond must be bool, got {cond}")));
    }
    let dtype = require_same_dtype(a, b)?;
    let shape = broadcast_shapes(&broadcast_shapes(&cond.shape, &a.shape)?, &b.shape)?;
    one(TensorMetadata::new(dtype, shape))
}

/// Converts to `dtype` (floats to integers truncate toward zero and
/// saturate; NaN becomes 0; nonzero becomes `true`).
pub static CAST: OpDef = OpDef {
    name: "Cast",
    inputs: &["x"],
    variadic: false,
    outputs: 1,
    attrs: &[AttrSpec::required("dtype", AttrKind::DType)],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: cast_meta,
    grad: Some(cast_grad),
};

/// Reinterprets the bytes of each element as `dtype`, which must have the
/// same width (`i32` from `f32`, `u8` from `i8` or `bool`, ...); to bool
/// only bytes that are 0 or 1. Bit patterns, so no gradient.
pub static BITCAST: OpDef = OpDef {
    name: "Bitcast",
    inputs: &["x"],
    variadic: false,
    outputs: 1,
    attrs: &[AttrSpec::required("dtype", AttrKind::DType)],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: bitcast_meta,
    grad: None,
};

fn bitcast_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let x = &inputs[0];
    let to = attrs.dtype("dtype")?;
    if x.dtype == DType::List || to == DType::List || x.dtype.size_in_bytes() != to.size_in_bytes()
    {
        return Err(Error::dtype(format!(
            "Bitcast needs dtypes of one width, got {x} to {to} ({} and {} bytes)",
            x.dtype.size_in_bytes(),
            to.size_in_bytes()
        )));
    }
    one(TensorMetadata::new(to, x.shape.clone()))
}

/// GELU and its derivative in one pass, `(x·Φ(x), Φ(x) + x·φ(x))`: the
/// form [`GELU`] is recorded in when a gradient may be asked of it
/// ([`recorded_form`]). The backward pass then multiplies by the kept
/// derivative instead of recomputing it from `x` and `y` (an exponential
/// and a division per element, which cost two thirds of the forward
/// GELU again), and `x` need not be kept for it. The first output has
/// GELU's bits exactly, so a forward pass gives the same values whether
/// or not it is recorded.
pub static GELU_WITH_DERIVATIVE: OpDef = OpDef {
    name: "GeluWithDerivative",
    inputs: &["x"],
    variadic: false,
    outputs: 2,
    attrs: &[],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: gelu_with_derivative_meta,
    grad: Some(gelu_with_derivative_grad),
};

/// What [`GELU_WITH_DERIVATIVE`] computes at one element of `T`: GELU as
/// [`GELU`] computes it, and the derivative (for f32, f16 and bf16 from the
/// same `erfc` and Gaussian factor; for f64 as [`GELU_DERIVATIVE`] does).
#[inline(always)]
pub fn gelu_with_derivative_of<T: Num>(x: T) -> (T, T) {
    let wide = x.to_f64();
    if T::NARROW {
        let (y, d) = gelu_with_derivative_to_narrow(wide);
        (T::from_f64(y), T::from_f64(d))
    } else {
        let y = gelu(wide);
        (T::from_f64(y), T::from_f64(gelu_derivative(wide, y)))
    }
}

fn gelu_with_derivative_meta(inputs: &[TensorMetadata], _: &Attrs<'_>) -> Result<OutputMetas> {
    let x = &inputs[0];
    require_class(DTypeClass::Float, "x", x)?;
    Ok(smallvec::smallvec![x.clone(), x.clone()])
}

/// `g_y·d`, plus `g_d·φ(x)·(2 - x²)` when the derivative itself is
/// differentiated (a second-order gradient).
fn gelu_with_derivative_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let (x, derivative) = (ctx.inputs[0], ctx.outputs[1]);
    let grad = |i: usize| ctx.grads.get(i).copied().flatten();
    let mut gx = match grad(0) {
        Some(g) => Some(b.mul(g, derivative)?),
        None => None,
    };
    if let Some(g) = grad(1) {
        let second = gelu_second_derivative(b, x)?;
        let part = b.mul(g, second)?;
        gx = Some(match gx {
            Some(first) => b.add(first, part)?,
            None => part,
        });
    }
    Ok(smallvec::smallvec![gx])
}

/// GELU's second derivative, `d/dx (Φ + xφ) = 2φ + xφ' = φ·(2 - x²)`.
fn gelu_second_derivative(b: &mut dyn GradBuilder, x: G) -> Result<G> {
    let dtype = b.meta(x).dtype;
    let two = b.scalar(2.0, dtype)?;
    let x2 = b.mul(x, x)?;
    let e = b.scale(x2, -0.5)?;
    let e = b.unary(&EXP, e)?;
    let pdf = b.scale(e, 1.0 / (2.0 * std::f64::consts::PI).sqrt())?;
    let k = b.sub(two, x2)?;
    b.mul(pdf, k)
}

/// The op recorded in place of `op` when a gradient may be asked of it,
/// with the outputs after the first kept for the gradient: [`GELU`] runs
/// as [`GELU_WITH_DERIVATIVE`]. `None` for every other op.
pub fn recorded_form(op: &'static OpDef) -> Option<&'static OpDef> {
    (op == &GELU).then_some(&GELU_WITH_DERIVATIVE)
}

fn cast_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    one(TensorMetadata::new(
        attrs.dtype("dtype")?,
        inputs[0].shape.clone(),
    ))
}

// ---------------------------------------------------------------------------
// Gradients.

fn unary_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let (x, y, g) = (ctx.inputs[0], ctx.outputs[0], ctx.grad()?);
    let OpKind::Unary(op) = ctx.attrs.op().kind else {
        return Err(Error::internal("unary_grad on a non-unary op"));
    };
    Ok(smallvec::smallvec![unary_grad_rule(op, b, x, y, g)?])
}

/// Maximum's and minimum's gradient: ties send it to the first operand.
fn extremum_grad(
    b: &mut dyn GradBuilder,
    first_wins: &'static OpDef,
    x: G,
    y: G,
    g: G,
) -> Result<(G, G)> {
    let first = b.op(first_wins, &[x, y], &crate::OpAttrs::new())?;
    let zero = b.scalar(0.0, b.meta(x).dtype)?;
    let dx = b.op(&SELECT, &[first, g, zero], &crate::OpAttrs::new())?;
    let dy = b.op(&SELECT, &[first, zero, g], &crate::OpAttrs::new())?;
    Ok((dx, dy))
}

fn binary_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let (x, y, out, g) = (ctx.inputs[0], ctx.inputs[1], ctx.outputs[0], ctx.grad()?);
    let (xs, ys) = (b.meta(x).shape, b.meta(y).shape);
    let OpKind::Binary(op) = ctx.attrs.op().kind else {
        return Err(Error::internal("binary_grad on a non-binary op"));
    };
    let Some((dx, dy)) = binary_grad_rule(op, b, x, y, out, g)? else {
        return Ok(smallvec::smallvec![None, None]);
    };
    Ok(smallvec::smallvec![
        Some(b.unbroadcast(dx, &xs)?),
        Some(b.unbroadcast(dy, &ys)?)
    ])
}

fn select_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let (cond, x, y, g) = (ctx.inputs[0], ctx.inputs[1], ctx.inputs[2], ctx.grad()?);
    let zero = b.scalar(0.0, b.meta(g).dtype)?;
    let dx = b.op(&SELECT, &[cond, g, zero], &crate::OpAttrs::new())?;
    let dy = b.op(&SELECT, &[cond, zero, g], &crate::OpAttrs::new())?;
    let (xs, ys) = (b.meta(x).shape, b.meta(y).shape);
    Ok(smallvec::smallvec![
        None,
        Some(b.unbroadcast(dx, &xs)?),
        Some(b.unbroadcast(dy, &ys)?)
    ])
}

fn cast_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let from = b.meta(ctx.inputs[0]).dtype;
    let g = ctx.grad()?;
    if !from.is_float() || !b.meta(g).dtype.is_float() {
        return Ok(smallvec::smallvec![None]);
    }
    crate::grad::only(b.cast(g, from)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::OpAttrs;

    fn m(dtype: DType, dims: &[usize]) -> TensorMetadata {
        TensorMetadata::new(dtype, dims)
    }

    #[test]
    fn binary_broadcasts_and_checks_dtypes() {
        let none = OpAttrs::new();
        let out = ADD
            .infer(&[m(DType::F32, &[2, 1, 3]), m(DType::F32, &[4, 1])], &none)
            .unwrap();
        assert_eq!(out[0], m(DType::F32, &[2, 4, 3]));
        assert!(ADD
            .infer(&[m(DType::F32, &[2]), m(DType::F64, &[2])], &none)
            .is_err());
        assert!(ADD
            .infer(&[m(DType::F32, &[2]), m(DType::F32, &[3])], &none)
            .is_err());
        assert!(ADD
            .infer(&[m(DType::Bool, &[2]), m(DType::Bool, &[2])], &none)
            .is_err());
        assert!(POW
            .infer(&[m(DType::I32, &[2]), m(DType::I32, &[2])], &none)
            .is_err());
        assert!(LOGICAL_AND
            .infer(&[m(DType::I32, &[2]), m(DType::I32, &[2])], &none)
            .is_err());
        assert!(ADD.infer(&[m(DType::F32, &[2])], &none).is_err());
    }

    #[test]
    fn bitcast_keeps_the_width() {
        let mut to = OpAttrs::new();
        to.set_dtype("dtype", DType::I32);
        assert_eq!(
            BITCAST.infer(&[m(DType::F32, &[2, 3])], &to).unwrap()[0],
            m(DType::I32, &[2, 3])
        );
        assert!(BITCAST.infer(&[m(DType::U32, &[])], &to).is_ok());
        let e = BITCAST.infer(&[m(DType::F64, &[2])], &to).unwrap_err();
        assert!(e.to_string().contains("width"), "{e}");
        let mut to_u8 = OpAttrs::new();
        to_u8.set_dtype("dtype", DType::U8);
        assert!(BITCAST.infer(&[m(DType::Bool, &[4])], &to_u8).is_ok());
        assert!(BITCAST.infer(&[m(DType::I16, &[4])], &to_u8).is_err());
        assert!(BITCAST.grad.is_none());
    }

    #[test]
    fn bitwise_ops_take_integers_alone() {
        let none = OpAttrs::new();
        for dtype in DType::ALL {
            let pair = [m(dtype, &[2, 1]), m(dtype, &[3])];
            for op in [
                &BITWISE_AND,
                &BITWISE_OR,
                &BITWISE_XOR,
                &SHIFT_LEFT,
                &SHIFT_RIGHT,
            ] {
                let out = op.infer(&pair, &none);
                if dtype.is_int() {
                    assert_eq!(out.unwrap()[0], m(dtype, &[2, 3]));
                } else {
                    let message = out.unwrap_err().to_string();
                    assert!(message.contains("integer"), "{}: {message}", op.name);
                }
            }
            assert_eq!(
                BITWISE_NOT.infer(&[m(dtype, &[4])], &none).is_ok(),
                dtype.is_int()
            );
        }
        assert!(BITWISE_AND
            .infer(&[m(DType::U16, &[2]), m(DType::U32, &[2])], &none)
            .is_err());
        // Integer ops carry no gradient rule; the others keep theirs.
        for op in [
            &BITWISE_AND,
            &BITWISE_OR,
            &BITWISE_XOR,
            &SHIFT_LEFT,
            &SHIFT_RIGHT,
            &BITWISE_NOT,
        ] {
            assert!(op.grad.is_none(), "{}", op.name);
        }
        assert!(ADD.grad.is_some() && NEG.grad.is_some());
    }

    #[test]
    fn unary_dtype_rules() {
        let none = OpAttrs::new();
        assert!(EXP.infer(&[m(DType::I64, &[2])], &none).is_err());
        assert!(NEG.infer(&[m(DType::I64, &[2])], &none).is_ok());
        assert!(NEG.infer(&[m(DType::Bool, &[2])], &none).is_err());
        assert!(LOGICAL_NOT.infer(&[m(DType::Bool, &[0])], &none).is_ok());
        assert_eq!(
            EXP.infer(&[m(DType::BF16, &[0, 3])], &none).unwrap()[0],
            m(DType::BF16, &[0, 3])
        );
    }

    #[test]
    fn compare_select_cast() {
        let none = OpAttrs::new();
        let out = LESS
            .infer(&[m(DType::I32, &[3, 1]), m(DType::I32, &[2])], &none)
            .unwrap();
        assert_eq!(out[0], m(DType::Bool, &[3, 2]));
        let out = SELECT
            .infer(
                &[
                    m(DType::Bool, &[3, 1]),
                    m(DType::F32, &[2]),
                    m(DType::F32, &[]),
                ],
                &none,
            )
            .unwrap();
        assert_eq!(out[0], m(DType::F32, &[3, 2]));
        assert!(SELECT
            .infer(
                &[
                    m(DType::F32, &[1]),
                    m(DType::F32, &[1]),
                    m(DType::F32, &[1])
                ],
                &none
            )
            .is_err());
        assert!(CAST.infer(&[m(DType::F32, &[1])], &none).is_err());
        let mut a = OpAttrs::new();
        a.set_dtype("dtype", DType::I64);
        assert_eq!(
            CAST.infer(&[m(DType::F32, &[4])], &a).unwrap()[0],
            m(DType::I64, &[4])
        );
        let mut bad = OpAttrs::new();
        bad.set_int("dtype", 3);
        assert!(CAST.infer(&[m(DType::F32, &[4])], &bad).is_err());
        let mut unknown = OpAttrs::new();
        unknown.set_dtype("dtype", DType::I64).set_int("bogus", 1);
        assert!(CAST.infer(&[m(DType::F32, &[4])], &unknown).is_err());
    }
}
