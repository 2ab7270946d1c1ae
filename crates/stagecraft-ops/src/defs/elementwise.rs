//! Elementwise ops: unary math, broadcasting binary arithmetic, comparisons,
//! logical ops, select and cast.

use super::{one, require_float, require_numeric, require_same_dtype};
use crate::attrs::AttrKind;
use crate::grad::{GradBuilder, GradContext, InputGrads};
use crate::op::*;
use stagecraft_tensor::{broadcast_shapes, DType, Error, Result, TensorMetadata};

const fn unary(name: &'static str, op: UnaryOp) -> OpDef {
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
        grad: Some(unary_grad),
    }
}

fn unary_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let x = &inputs[0];
    match attrs.op().kind {
        OpKind::Unary(UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Sign | UnaryOp::Relu) => {
            require_numeric("x", x)?
        }
        OpKind::Unary(UnaryOp::Not) => {
            if x.dtype != DType::Bool {
                return Err(Error::dtype(format!("x must be bool, got {x}")));
            }
        }
        _ => require_float("x", x)?,
    }
    one(x.clone())
}

/// `-x`
pub static NEG: OpDef = unary("Neg", UnaryOp::Neg);
/// `|x|`
pub static ABS: OpDef = unary("Abs", UnaryOp::Abs);
/// `e^x`
pub static EXP: OpDef = unary("Exp", UnaryOp::Exp);
/// Natural logarithm.
pub static LOG: OpDef = unary("Log", UnaryOp::Log);
/// Square root.
pub static SQRT: OpDef = unary("Sqrt", UnaryOp::Sqrt);
/// Reciprocal square root.
pub static RSQRT: OpDef = unary("Rsqrt", UnaryOp::Rsqrt);
/// Hyperbolic tangent.
pub static TANH: OpDef = unary("Tanh", UnaryOp::Tanh);
/// Logistic sigmoid.
pub static SIGMOID: OpDef = unary("Sigmoid", UnaryOp::Sigmoid);
/// Rectified linear unit.
pub static RELU: OpDef = unary("Relu", UnaryOp::Relu);
/// Gaussian error linear unit (exact erf form).
pub static GELU: OpDef = unary("Gelu", UnaryOp::Gelu);
/// Sine.
pub static SIN: OpDef = unary("Sin", UnaryOp::Sin);
/// Cosine.
pub static COS: OpDef = unary("Cos", UnaryOp::Cos);
/// Sign (-1, 0, 1).
pub static SIGN: OpDef = unary("Sign", UnaryOp::Sign);
/// Logical not of a bool tensor.
pub static LOGICAL_NOT: OpDef = unary("LogicalNot", UnaryOp::Not);

const fn binary(name: &'static str, op: BinaryOp) -> OpDef {
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
        grad: Some(binary_grad),
    }
}

fn binary_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let (a, b) = (&inputs[0], &inputs[1]);
    let dtype = require_same_dtype(a, b)?;
    match attrs.op().kind {
        OpKind::Binary(BinaryOp::And | BinaryOp::Or) => {
            if dtype != DType::Bool {
                return Err(Error::dtype(format!(
                    "operands must be bool, got {a} and {b}"
                )));
            }
        }
        OpKind::Binary(BinaryOp::Pow) => require_float("a", a)?,
        _ => require_numeric("a", a)?,
    }
    one(TensorMetadata::new(
        dtype,
        broadcast_shapes(&a.shape, &b.shape)?,
    ))
}

/// `a + b`
pub static ADD: OpDef = binary("Add", BinaryOp::Add);
/// `a - b`
pub static SUB: OpDef = binary("Sub", BinaryOp::Sub);
/// `a * b`
pub static MUL: OpDef = binary("Mul", BinaryOp::Mul);
/// `a / b`
pub static DIV: OpDef = binary("Div", BinaryOp::Div);
/// `a ^ b` (floating point)
pub static POW: OpDef = binary("Pow", BinaryOp::Pow);
/// Elementwise maximum.
pub static MAXIMUM: OpDef = binary("Maximum", BinaryOp::Maximum);
/// Elementwise minimum.
pub static MINIMUM: OpDef = binary("Minimum", BinaryOp::Minimum);
/// Logical and of bool tensors.
pub static LOGICAL_AND: OpDef = binary("LogicalAnd", BinaryOp::And);
/// Logical or of bool tensors.
pub static LOGICAL_OR: OpDef = binary("LogicalOr", BinaryOp::Or);

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
    let dtype = b.meta(x).dtype;
    let OpKind::Unary(op) = ctx.attrs.op().kind else {
        return Err(Error::internal("unary_grad on a non-unary op"));
    };
    let dx = match op {
        UnaryOp::Neg => b.neg(g)?,
        UnaryOp::Abs => {
            let s = b.unary(&SIGN, x)?;
            b.mul(g, s)?
        }
        UnaryOp::Exp => b.mul(g, y)?,
        UnaryOp::Log => b.div(g, x)?,
        // d sqrt(x) = 1 / (2 sqrt(x))
        UnaryOp::Sqrt => {
            let twice = b.scale(y, 2.0)?;
            b.div(g, twice)?
        }
        // d x^(-1/2) = -x^(-3/2) / 2 = -y^3 / 2
        UnaryOp::Rsqrt => {
            let y2 = b.mul(y, y)?;
            let y3 = b.mul(y2, y)?;
            let d = b.scale(y3, -0.5)?;
            b.mul(g, d)?
        }
        UnaryOp::Tanh => {
            let y2 = b.mul(y, y)?;
            let one = b.scalar(1.0, dtype)?;
            let d = b.sub(one, y2)?;
            b.mul(g, d)?
        }
        UnaryOp::Sigmoid => {
            let one = b.scalar(1.0, dtype)?;
            let rest = b.sub(one, y)?;
            let d = b.mul(y, rest)?;
            b.mul(g, d)?
        }
        // relu(x) > 0 exactly where x > 0 (NaN compares false in both).
        // Reading the output instead of the input leaves the relu its
        // input's only user, so a staged relu joins its producer's kernel
        // (a matmul's epilogue) and the input is never kept for backward.
        UnaryOp::Relu => {
            let zero = b.scalar(0.0, dtype)?;
            let positive = b.op(&GREATER, &[y, zero], &crate::OpAttrs::new())?;
            let m = b.mask(positive, dtype)?;
            b.mul(g, m)?
        }
        // gelu(x) = x Φ(x): the derivative is Φ(x) + x φ(x), with Φ(x) read
        // back as gelu(x) / x since there is no erf op. At 0 that ratio is
        // undefined and Φ(x) is taken as 1/2 + x φ(x): exactly 1/2 there,
        // and with Φ's derivative φ(0), so the second derivative is right
        // at 0 too (a constant 1/2 would drop φ(0) from it).
        UnaryOp::Gelu => {
            let zero = b.scalar(0.0, dtype)?;
            let half = b.scalar(0.5, dtype)?;
            let at_zero = b.op(&EQUAL, &[x, zero], &crate::OpAttrs::new())?;
            let one = b.scalar(1.0, dtype)?;
            let safe_x = b.op(&SELECT, &[at_zero, one, x], &crate::OpAttrs::new())?;
            let ratio = b.div(y, safe_x)?;
            let x2 = b.mul(x, x)?;
            let e = b.scale(x2, -0.5)?;
            let e = b.unary(&EXP, e)?;
            let pdf = b.scale(e, 1.0 / (2.0 * std::f64::consts::PI).sqrt())?;
            let xpdf = b.mul(x, pdf)?;
            let near_zero = b.add(half, xpdf)?;
            let cdf = b.op(
                &SELECT,
                &[at_zero, near_zero, ratio],
                &crate::OpAttrs::new(),
            )?;
            let d = b.add(cdf, xpdf)?;
            b.mul(g, d)?
        }
        UnaryOp::Sin => {
            let c = b.unary(&COS, x)?;
            b.mul(g, c)?
        }
        UnaryOp::Cos => {
            let s = b.unary(&SIN, x)?;
            let d = b.mul(g, s)?;
            b.neg(d)?
        }
        UnaryOp::Sign | UnaryOp::Not => return Ok(smallvec::smallvec![None]),
    };
    crate::grad::only(dx)
}

fn binary_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let (x, y, out, g) = (ctx.inputs[0], ctx.inputs[1], ctx.outputs[0], ctx.grad()?);
    let (xs, ys) = (b.meta(x).shape, b.meta(y).shape);
    let dtype = b.meta(x).dtype;
    let OpKind::Binary(op) = ctx.attrs.op().kind else {
        return Err(Error::internal("binary_grad on a non-binary op"));
    };
    let (dx, dy) = match op {
        BinaryOp::Add => (g, g),
        BinaryOp::Sub => (g, b.neg(g)?),
        BinaryOp::Mul => (b.mul(g, y)?, b.mul(g, x)?),
        // d(x/y) = g/y, -g x/y^2 = -g out / y
        BinaryOp::Div => {
            let dx = b.div(g, y)?;
            let t = b.mul(dx, out)?;
            (dx, b.neg(t)?)
        }
        // d x^y = y x^(y-1) and x^y ln x
        BinaryOp::Pow => {
            let one = b.scalar(1.0, dtype)?;
            let ym1 = b.sub(y, one)?;
            let p = b.op(&POW, &[x, ym1], &crate::OpAttrs::new())?;
            let d = b.mul(y, p)?;
            let dx = b.mul(g, d)?;
            let lx = b.unary(&LOG, x)?;
            let d = b.mul(out, lx)?;
            (dx, b.mul(g, d)?)
        }
        // Ties send the gradient to the first operand.
        BinaryOp::Maximum | BinaryOp::Minimum => {
            let cmp = if op == BinaryOp::Maximum {
                &GREATER_EQUAL
            } else {
                &LESS_EQUAL
            };
            let first = b.op(cmp, &[x, y], &crate::OpAttrs::new())?;
            let zero = b.scalar(0.0, dtype)?;
            let dx = b.op(&SELECT, &[first, g, zero], &crate::OpAttrs::new())?;
            let dy = b.op(&SELECT, &[first, zero, g], &crate::OpAttrs::new())?;
            (dx, dy)
        }
        BinaryOp::And | BinaryOp::Or => return Ok(smallvec::smallvec![None, None]),
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
