//! `FusedElementwise`: a chain or tree of elementwise ops run as one kernel
//! that reads each input once and writes one output, created by the fusion
//! pass (never by users). The `program` attribute lists instructions of
//! three integers `[code, a, b]`: operands `a`, `b` are registers, where
//! registers `0..inputs` are the inputs and each instruction appends one
//! register; the result is the last register. Codes below
//! [`FUSED_BINARY_BASE`] are unary ops (by [`FUSED_UNARY`] index), codes
//! from [`FUSED_COMPARE_BASE`] comparisons read as numbers (by
//! [`FUSED_COMPARE`] index), the rest binary ops (by [`FUSED_BINARY`]
//! index).

use crate::attrs::AttrKind;
use crate::op::*;
use crate::{BinaryOp, UnaryOp};
use stagecraft_tensor::{element_count, DType, Error, Result, Shape, TensorMetadata};

/// Unary ops a fused program can contain, by code: all of them (a fused
/// kernel runs floats, and every unary op has a meaning over floats).
pub const FUSED_UNARY: &[UnaryOp] = UnaryOp::ALL;

/// Binary ops a fused program can contain, by code minus
/// [`FUSED_BINARY_BASE`]: all of them.
pub const FUSED_BINARY: &[BinaryOp] = BinaryOp::ALL;

/// The first binary code.
pub const FUSED_BINARY_BASE: i64 = 100;

/// Comparisons a fused program can contain, by code minus
/// [`FUSED_COMPARE_BASE`]: each gives 1 where it holds and 0 elsewhere
/// (NaN compares false), what a comparison cast to the program's float type
/// gives. The fusion pass fuses such a cast with its comparison, so a mask
/// (the relu gradient's `x > 0`) costs no kernel and no bool tensor.
pub const FUSED_COMPARE: &[CompareOp] = &[
    CompareOp::Eq,
    CompareOp::Ne,
    CompareOp::Lt,
    CompareOp::Le,
    CompareOp::Gt,
    CompareOp::Ge,
];

/// The first comparison code.
pub const FUSED_COMPARE_BASE: i64 = 200;

/// One decoded instruction of a fused program.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FusedInstr {
    /// `op(reg a)`
    Unary(UnaryOp, usize),
    /// `op(reg a, reg b)`
    Binary(BinaryOp, usize, usize),
    /// `op(reg a, reg b)` as 1 or 0
    Compare(CompareOp, usize, usize),
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
        let instr = if t[0] >= FUSED_COMPARE_BASE {
            let op = FUSED_COMPARE
                .get((t[0] - FUSED_COMPARE_BASE) as usize)
                .ok_or_else(|| Error::attribute(format!("unknown comparison code {}", t[0])))?;
            FusedInstr::Compare(*op, reg(t[1])?, reg(t[2])?)
        } else if t[0] >= FUSED_BINARY_BASE {
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

/// How a fused kernel reads one input for an output of a given shape. The
/// broadcasts it accepts are the ones a block of consecutive output
/// elements can read with a modulo or a division: a bias added to every
/// row, a per-row value spread over its row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FusedOperand {
    /// One element for the whole output.
    Scalar,
    /// The output's own shape: element `i` for output element `i`.
    Full,
    /// The output's trailing dims (leading ones broadcast): element
    /// `i % period` for output element `i`.
    Tile {
        /// Elements in one repetition.
        period: usize,
    },
    /// The output's leading dims (trailing ones broadcast): element
    /// `i / run` for output element `i`.
    Repeat {
        /// Output elements sharing one input element.
        run: usize,
    },
}

/// How an input of `input` shape is read for an output of `out` shape, or
/// `None` when its broadcast is not one a fused kernel reads.
pub fn fused_operand(input: &Shape, out: &Shape) -> Option<FusedOperand> {
    if input.numel() == 1 && out.numel() > 0 {
        return Some(FusedOperand::Scalar);
    }
    if input.rank() > out.rank() {
        return None;
    }
    let mut padded = vec![1usize; out.rank() - input.rank()];
    padded.extend_from_slice(input.dims());
    let dims = out.dims();
    if padded == dims {
        return Some(FusedOperand::Full);
    }
    let rank = dims.len();
    // The first axis from which the input matches the output.
    let tile_from = (0..=rank)
        .rev()
        .take_while(|&j| j == rank || padded[j] == dims[j])
        .last()
        .unwrap_or(rank);
    if padded[..tile_from].iter().all(|&d| d == 1) {
        return Some(FusedOperand::Tile {
            period: element_count(&dims[tile_from..]),
        });
    }
    // The first axis from which the input is all ones.
    let repeat_from = (0..=rank)
        .rev()
        .take_while(|&j| j == rank || padded[j] == 1)
        .last()
        .unwrap_or(rank);
    if padded[..repeat_from] == dims[..repeat_from] {
        return Some(FusedOperand::Repeat {
            run: element_count(&dims[repeat_from..]),
        });
    }
    None
}

fn fused_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    decode_fused(attrs.ints("program")?, inputs.len())?;
    super::one(fused_output(inputs)?)
}

/// The output of a fused program over `inputs`: their common dtype and
/// broadcast shape, where every input is read in a way the kernel supports.
pub fn fused_output(inputs: &[TensorMetadata]) -> Result<TensorMetadata> {
    let dtype = inputs
        .first()
        .ok_or_else(|| Error::attribute("a fused kernel needs at least one input"))?
        .dtype;
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
        shape = stagecraft_tensor::broadcast_shapes(&shape, &m.shape)?;
    }
    if let Some(m) = inputs
        .iter()
        .find(|m| m.shape.numel() > 0 && fused_operand(&m.shape, &shape).is_none())
    {
        return Err(Error::shape(format!(
            "a fused kernel cannot broadcast {} to {shape}",
            m.shape
        )));
    }
    Ok(TensorMetadata::new(dtype, shape))
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

/// Reductions a `FusedReduce` can end in, by code.
pub const FUSED_REDUCE_OPS: &[ReduceOp] = &[
    ReduceOp::Sum,
    ReduceOp::Mean,
    ReduceOp::Max,
    ReduceOp::Min,
    ReduceOp::Prod,
];

/// The reduction a `FusedReduce`'s `reduce` attribute names.
pub fn fused_reduce_op(code: i64) -> Result<ReduceOp> {
    usize::try_from(code)
        .ok()
        .and_then(|c| FUSED_REDUCE_OPS.get(c))
        .copied()
        .ok_or_else(|| Error::attribute(format!("unknown reduction code {code}")))
}

fn fused_reduce_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    decode_fused(attrs.ints("program")?, inputs.len())?;
    let values = fused_output(inputs)?;
    let op = fused_reduce_op(attrs.int("reduce")?)?;
    let axes = super::reduction_axes(attrs.ints("axes")?, values.shape.rank())?;
    if matches!(op, ReduceOp::Max | ReduceOp::Min) && axes.iter().any(|&a| values.shape[a] == 0) {
        return Err(Error::shape(format!(
            "cannot reduce zero elements with {op:?}: {} over axes {axes:?}",
            values.shape
        )));
    }
    super::one(TensorMetadata::new(
        values.dtype,
        super::reduced_shape(&values.shape, &axes, attrs.bool("keepdim")?),
    ))
}

/// A fused elementwise program whose result is reduced in the same kernel,
/// created by the fusion pass: the elementwise values are computed block by
/// block and folded while still in cache, never written to memory. The
/// `program` is a `FusedElementwise` program; `reduce` a
/// [`FUSED_REDUCE_OPS`] code; `axes` and `keepdim` as for the reductions.
pub static FUSED_REDUCE: OpDef = OpDef {
    name: "FusedReduce",
    inputs: &["xs"],
    variadic: true,
    outputs: 1,
    attrs: &[
        AttrSpec::required("program", AttrKind::Ints),
        AttrSpec::required("reduce", AttrKind::Int),
        AttrSpec::optional("axes", AttrKind::Ints, AttrDefault::Ints(&[])),
        AttrSpec::optional("keepdim", AttrKind::Bool, AttrDefault::Bool(false)),
    ],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: fused_reduce_meta,
    grad: None,
};

fn fused_matmul_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    if inputs.len() < 2 {
        return Err(Error::attribute(
            "FusedMatMul takes a, b and the epilogue's inputs",
        ));
    }
    let (a, b) = (&inputs[0], &inputs[1]);
    if a.dtype != b.dtype {
        return Err(Error::dtype(format!(
            "matmul operands differ in dtype: {} and {}",
            a.dtype, b.dtype
        )));
    }
    let shape = super::matmul_result_shape(&a.shape, &b.shape, attrs)?;
    let product = TensorMetadata::new(a.dtype, shape);
    let mut epilogue = vec![product.clone()];
    epilogue.extend_from_slice(&inputs[2..]);
    decode_fused(attrs.ints("program")?, epilogue.len())?;
    let out = fused_output(&epilogue)?;
    if out.shape != product.shape {
        return Err(Error::shape(format!(
            "a matmul epilogue must keep the product's shape {}, got {}",
            product.shape, out.shape
        )));
    }
    super::one(out)
}

/// A matrix product followed by an elementwise epilogue (bias, activation,
/// scaling), created by the fusion pass: the epilogue runs over each block
/// of the product while it is still in cache. `program` is a
/// `FusedElementwise` program whose register 0 is the product and whose
/// registers `1..` are the inputs after `a` and `b`. The transpose flags
/// are the matmul's (see [`MATMUL`](super::MATMUL)).
pub static FUSED_MATMUL: OpDef = OpDef {
    name: "FusedMatMul",
    inputs: &["xs"],
    variadic: true,
    outputs: 1,
    attrs: &[
        AttrSpec::required("program", AttrKind::Ints),
        AttrSpec::optional("transpose_a", AttrKind::Bool, AttrDefault::Bool(false)),
        AttrSpec::optional("transpose_b", AttrKind::Bool, AttrDefault::Bool(false)),
    ],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: fused_matmul_meta,
    grad: None,
};

#[cfg(test)]
mod tests {
    use super::*;

    fn how(input: &[usize], out: &[usize]) -> Option<FusedOperand> {
        fused_operand(&Shape::new(input), &Shape::new(out))
    }

    #[test]
    fn fused_operands_cover_rows_and_columns() {
        assert_eq!(how(&[3, 4], &[3, 4]), Some(FusedOperand::Full));
        assert_eq!(how(&[], &[3, 4]), Some(FusedOperand::Scalar));
        assert_eq!(how(&[1, 1], &[3, 4]), Some(FusedOperand::Scalar));
        assert_eq!(how(&[4], &[3, 4]), Some(FusedOperand::Tile { period: 4 }));
        assert_eq!(
            how(&[1, 4], &[3, 4]),
            Some(FusedOperand::Tile { period: 4 })
        );
        assert_eq!(
            how(&[2, 5], &[7, 2, 5]),
            Some(FusedOperand::Tile { period: 10 })
        );
        assert_eq!(how(&[3, 1], &[3, 4]), Some(FusedOperand::Repeat { run: 4 }));
        assert_eq!(
            how(&[7, 1, 1], &[7, 2, 5]),
            Some(FusedOperand::Repeat { run: 10 })
        );
        // A broadcast in the middle reads neither way.
        assert_eq!(how(&[1, 2, 1], &[7, 2, 5]), None);
        assert_eq!(how(&[3, 4, 5], &[4, 5]), None);
    }

    #[test]
    fn fused_outputs_broadcast_and_refuse_what_the_kernel_cannot_read() {
        let m = |d: &[usize]| TensorMetadata::new(DType::F32, d);
        let out = fused_output(&[m(&[3, 4]), m(&[4]), m(&[3, 1])]).unwrap();
        assert_eq!(out.shape, Shape::new(&[3, 4]));
        let err = fused_output(&[m(&[7, 2, 5]), m(&[1, 2, 1])]).unwrap_err();
        assert!(err.to_string().contains("cannot broadcast"), "{err}");
        assert!(fused_output(&[m(&[3]), m(&[4])]).is_err());
    }
}
