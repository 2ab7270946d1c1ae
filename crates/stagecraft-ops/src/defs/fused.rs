//! `FusedElementwise`: a chain or tree of elementwise ops run as one kernel
//! that reads each input once and writes one output, created by the fusion
//! pass (never by users). The `program` attribute lists instructions of
//! three integers `[code, a, b]`: operands `a`, `b` are registers, where
//! registers `0..inputs` are the inputs and each instruction appends one
//! register; the result is the last register. Codes below
//! [`FUSED_BINARY_BASE`] are unary ops (by [`FUSED_UNARY`] index), the rest
//! binary ops (by [`FUSED_BINARY`] index).

use crate::attrs::AttrKind;
use crate::op::*;
use stagecraft_tensor::{DType, Error, Result, Shape, TensorMetadata};

/// Unary ops a fused program can contain, by code.
pub const FUSED_UNARY: &[UnaryOp] = &[
    UnaryOp::Neg,
    UnaryOp::Abs,
    UnaryOp::Exp,
    UnaryOp::Log,
    UnaryOp::Sqrt,
    UnaryOp::Rsqrt,
    UnaryOp::Tanh,
    UnaryOp::Sigmoid,
    UnaryOp::Relu,
    UnaryOp::Gelu,
    UnaryOp::Sin,
    UnaryOp::Cos,
    UnaryOp::Sign,
];

/// Binary ops a fused program can contain, by code minus
/// [`FUSED_BINARY_BASE`].
pub const FUSED_BINARY: &[BinaryOp] = &[
    BinaryOp::Add,
    BinaryOp::Sub,
    BinaryOp::Mul,
    BinaryOp::Div,
    BinaryOp::Pow,
    BinaryOp::Maximum,
    BinaryOp::Minimum,
];

/// The first binary code.
pub const FUSED_BINARY_BASE: i64 = 100;

/// One decoded instruction of a fused program.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FusedInstr {
    /// `op(reg a)`
    Unary(UnaryOp, usize),
    /// `op(reg a, reg b)`
    Binary(BinaryOp, usize, usize),
}

/// Decodes and checks a program over `inputs` registers.
pub fn decode_fused(program: &[i64], inputs: usize) -> Result<Vec<FusedInstr>> {
    if program.is_empty() || !program.len().is_multiple_of(3) {
        return Err(Error::attribute(
            "`program` needs one or more [code, a, b] triples",
        ));
    }
    let mut out = Vec::with_capacity(program.len() / 3);
    for (i, t) in program.chunks(3).enumerate() {
        let regs = inputs + i;
        let reg = |v: i64| -> Result<usize> {
            usize::try_from(v)
                .ok()
                .filter(|&r| r < regs)
                .ok_or_else(|| {
                    Error::attribute(format!(
                        "instruction {i} reads register {v}, only {regs} exist"
                    ))
                })
        };
        let instr = if t[0] >= FUSED_BINARY_BASE {
            let op = FUSED_BINARY
                .get((t[0] - FUSED_BINARY_BASE) as usize)
                .ok_or_else(|| Error::attribute(format!("unknown binary code {}", t[0])))?;
            FusedInstr::Binary(*op, reg(t[1])?, reg(t[2])?)
        } else {
            let op = usize::try_from(t[0])
                .ok()
                .and_then(|c| FUSED_UNARY.get(c))
                .ok_or_else(|| Error::attribute(format!("unknown unary code {}", t[0])))?;
            FusedInstr::Unary(*op, reg(t[1])?)
        };
        out.push(instr);
    }
    Ok(out)
}

fn fused_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let dtype = inputs[0].dtype;
    if !matches!(dtype, DType::F32 | DType::F64) {
        return Err(Error::dtype(format!(
            "fused kernels run f32 and f64, got {dtype}"
        )));
    }
    let mut shape = Shape::scalar();
    for m in inputs {
        if m.dtype != dtype {
            return Err(Error::dtype(format!(
                "fused inputs must share one dtype, got {dtype} and {}",
                m.dtype
            )));
        }
        if m.shape.rank() > 0 {
            if shape.rank() > 0 && shape != m.shape {
                return Err(Error::shape(format!(
                    "fused inputs must have one shape or be scalars, got {shape} and {}",
                    m.shape
                )));
            }
            shape = m.shape.clone();
        }
    }
    decode_fused(attrs.ints("program")?, inputs.len())?;
    super::one(TensorMetadata::new(dtype, shape))
}

/// Several elementwise ops as one kernel (see the module docs).
pub static FUSED_ELEMENTWISE: OpDef = OpDef {
    name: "FusedElementwise",
    inputs: &["xs"],
    variadic: true,
    outputs: 1,
    attrs: &[AttrSpec::required("program", AttrKind::Ints)],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: fused_meta,
    grad: None,
};
