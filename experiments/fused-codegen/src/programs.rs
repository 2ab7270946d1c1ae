//! Fused programs in the encoding the fusion pass writes into the
//! `program` attribute (`[code, a, b]` triples), with the inputs they read.

use stagecraft_ops::{BinaryOp, UnaryOp, FUSED_BINARY, FUSED_BINARY_BASE, FUSED_UNARY};
use stagecraft_tensor::{DenseHostTensor, Result, Shape, TensorMetadata};

/// An input of a fused program: the shared-shape tensor or a rank-0 one.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Input {
    /// A tensor of the output's shape (the generated data of [`data`]).
    Tensor,
    /// A rank-0 tensor holding this value.
    Scalar(f32),
}

/// A program and the inputs it reads, in register order.
#[derive(Clone, Debug)]
pub struct Workload {
    pub name: &'static str,
    pub program: Vec<i64>,
    pub inputs: Vec<Input>,
}

/// The code of a unary op in the program encoding.
pub fn unary(op: UnaryOp) -> i64 {
    FUSED_UNARY
        .iter()
        .position(|u| *u == op)
        .expect("a fusible unary op") as i64
}

/// The code of a binary op in the program encoding.
pub fn binary(op: BinaryOp) -> i64 {
    FUSED_BINARY_BASE
        + FUSED_BINARY
            .iter()
            .position(|b| *b == op)
            .expect("a fusible binary op") as i64
}

/// The B3 chain `t=x*2; t=t+1; t=t*x; t=t-3; relu; t=t*0.5; t=t+x; t=t*t`
/// as the fusion pass encodes it: externals in order of first use (x and
/// the four scalar constants become registers 0..5), then one register per
/// op.
pub fn b3() -> Workload {
    use BinaryOp::*;
    let program = vec![
        binary(Mul),
        0,
        1, // r5 = x * 2
        binary(Add),
        5,
        2, // r6 = r5 + 1
        binary(Mul),
        6,
        0, // r7 = r6 * x
        binary(Sub),
        7,
        3, // r8 = r7 - 3
        unary(UnaryOp::Relu),
        8,
        0, // r9 = relu(r8)
        binary(Mul),
        9,
        4, // r10 = r9 * 0.5
        binary(Add),
        10,
        0, // r11 = r10 + x
        binary(Mul),
        11,
        11, // r12 = r11 * r11
    ];
    Workload {
        name: "b3",
        program,
        inputs: vec![
            Input::Tensor,
            Input::Scalar(2.0),
            Input::Scalar(1.0),
            Input::Scalar(3.0),
            Input::Scalar(0.5),
        ],
    }
}

/// A tree rather than a chain, with every op the code generator supports:
/// two tensors, one scalar, values reused far from where they were made.
pub fn tree() -> Workload {
    use BinaryOp::*;
    use UnaryOp::*;
    // Registers: 0 = x, 1 = y, 2 = 0.25.
    let program = vec![
        binary(Sub),
        0,
        1, // r3 = x - y
        unary(Abs),
        3,
        0, // r4 = |x - y|
        unary(Sqrt),
        4,
        0, // r5
        binary(Maximum),
        0,
        1, // r6 = max(x, y)
        binary(Minimum),
        1,
        3, // r7 = min(y, r3)
        unary(Neg),
        7,
        0, // r8
        binary(Div),
        6,
        5, // r9 = r6 / r5
        binary(Mul),
        9,
        2, // r10
        unary(Relu),
        8,
        0, // r11
        binary(Add),
        10,
        11, // r12
        binary(Maximum),
        12,
        2, // r13 = max(r12, 0.25)
        binary(Minimum),
        2,
        13, // r14 = min(0.25, r13)
        binary(Add),
        14,
        12, // r15
    ];
    Workload {
        name: "tree",
        program,
        inputs: vec![Input::Tensor, Input::Tensor, Input::Scalar(0.25)],
    }
}

/// A `len`-instruction program for compile times: a mix of add, sub, mul,
/// relu and maximum over two tensors and two scalars, each instruction
/// reading the previous result and often a register a few steps back, so
/// the code generator sees many live values at once. The mix keeps values
/// finite for the tests (each relu is followed by adding a tensor input).
pub fn long(len: usize) -> Workload {
    use BinaryOp::*;
    let inputs = 4;
    let mut program = Vec::with_capacity(3 * len);
    for i in 0..len {
        let prev = (inputs + i).saturating_sub(1) as i64;
        // A register 3..7 steps back (or an input early on).
        let far = (inputs + i).saturating_sub(3 + i % 5) as i64;
        let instr = match i % 6 {
            0 => [binary(Add), prev, far],
            1 => [binary(Mul), prev, 2 + (i % 2) as i64],
            2 => [binary(Sub), far, prev],
            3 => [unary(UnaryOp::Relu), prev, 0],
            4 => [binary(Add), prev, (i % 2) as i64],
            _ => [binary(Maximum), prev, far],
        };
        program.extend(instr);
    }
    Workload {
        name: "long",
        program,
        inputs: vec![
            Input::Tensor,
            Input::Tensor,
            Input::Scalar(0.999),
            Input::Scalar(-0.5),
        ],
    }
}

/// `n` values of the tensor input number `which`, with NaNs, signed
/// zeros and infinities among ordinary values when `specials` is set.
pub fn data(n: usize, which: usize, specials: bool) -> Vec<f32> {
    (0..n)
        .map(|i| {
            if specials {
                match (i + which) % 11 {
                    0 => return f32::NAN,
                    1 => return -0.0,
                    2 => return 0.0,
                    3 => return f32::INFINITY,
                    4 => return f32::NEG_INFINITY,
                    _ => {}
                }
            }
            ((i * (7 + which)) % 997) as f32 * 0.013 - 6.0
        })
        .collect()
}

impl Workload {
    /// The kernel inputs for `n` elements.
    pub fn tensors(&self, n: usize, specials: bool) -> Result<Vec<DenseHostTensor>> {
        self.inputs
            .iter()
            .enumerate()
            .map(|(k, input)| match input {
                Input::Tensor => DenseHostTensor::from_slice(&data(n, k, specials), [n].as_slice()),
                Input::Scalar(v) => DenseHostTensor::from_slice(&[*v], Shape::scalar()),
            })
            .collect()
    }

    /// The inputs' metadata for `n` elements.
    pub fn metas(&self, n: usize) -> Vec<TensorMetadata> {
        self.inputs
            .iter()
            .map(|input| match input {
                Input::Tensor => TensorMetadata::new(stagecraft_tensor::DType::F32, [n].as_slice()),
                Input::Scalar(_) => {
                    TensorMetadata::new(stagecraft_tensor::DType::F32, Shape::scalar())
                }
            })
            .collect()
    }

    /// Which inputs are rank 0.
    pub fn scalar_mask(&self) -> Vec<bool> {
        self.inputs
            .iter()
            .map(|i| matches!(i, Input::Scalar(_)))
            .collect()
    }
}
