//! Test support for the passes: a reference interpreter that runs a
//! function node by node with the CPU kernels, and a generator of random
//! pure elementwise functions full of repeated subexpressions and
//! constants.

use crate::{Function, NodeOp, Value};
use proptest::prelude::*;
use proptest::sample::Index;
use smallvec::SmallVec;
use stagecraft_cpu::{registry, Inputs, KernelContext};
use stagecraft_ops::{self as ops, Attrs, ControlOp, OpAttrs, OpDef, OpKind};
use stagecraft_tensor::{
    DType, DenseHostTensor, Error, HostTensor, Location, Result, Scalar, ScalarHostTensor,
    TensorMetadata,
};

pub(crate) fn loc(line: u32) -> Location {
    Location::new("t.rs", line, 1)
}

pub(crate) fn meta(dims: &[usize]) -> TensorMetadata {
    TensorMetadata::new(DType::F32, dims)
}

/// Runs `f` on `args`: every node in order, constants densified, ops by
/// their CPU kernel, `Call` by running the callee the same way. `Print` is
/// the identity here, so that tests do not write to the process-wide print
/// sink.
pub(crate) fn eval(f: &Function, args: &[HostTensor]) -> Result<Vec<HostTensor>> {
    let args: Vec<DenseHostTensor> = args
        .iter()
        .map(HostTensor::to_dense)
        .collect::<Result<_>>()?;
    let mut values: Vec<SmallVec<[DenseHostTensor; 1]>> = Vec::with_capacity(f.nodes.len());
    let get = |values: &[SmallVec<[DenseHostTensor; 1]>], v: Value| match v {
        Value::Param(i) => args[i as usize].clone(),
        Value::Output { node, output } => values[node as usize][output as usize].clone(),
    };
    for node in &f.nodes {
        let inputs: Inputs = node.inputs.iter().map(|&v| get(&values, v)).collect();
        let outputs = match &node.op {
            NodeOp::Const(t) => smallvec::smallvec![t.to_dense()?],
            NodeOp::Op(def, _) if def.name == ops::PRINT.name => inputs.into_iter().collect(),
            NodeOp::Op(def, attrs) => run_op(def, attrs, inputs, &node.outputs)?,
        };
        values.push(outputs);
    }
    Ok(f.results
        .iter()
        .map(|&v| HostTensor::Dense(get(&values, v)))
        .collect())
}

fn run_op(
    def: &'static OpDef,
    attrs: &OpAttrs,
    inputs: Inputs,
    outputs: &[TensorMetadata],
) -> Result<SmallVec<[DenseHostTensor; 1]>> {
    let attrs = Attrs::new(attrs, def);
    if let OpKind::Control(ControlOp::Call) = def.kind {
        let callee = Function::lookup(attrs.func("f")?)
            .ok_or_else(|| Error::internal("the callee is not a graph function"))?;
        let args: Vec<HostTensor> = inputs.into_iter().map(HostTensor::Dense).collect();
        return eval(&callee, &args)?
            .into_iter()
            .map(HostTensor::into_dense)
            .collect();
    }
    let metas: Vec<TensorMetadata> = inputs.iter().map(|t| t.metadata().clone()).collect();
    let factory = registry()
        .get(def)
        .ok_or_else(|| Error::internal(format!("no CPU kernel for {}", def.name)))?;
    let kernel = factory(&attrs, &metas)?;
    kernel(inputs, &KernelContext { attrs, outputs })
}

/// Each result's metadata and bytes, for bit-exact comparisons, with
/// every float NaN rewritten to one pattern.
///
/// Which NaN an operation returns when both operands are NaN (x86 keeps
/// the first, and invalid operations make a negative one) is not part of
/// Rust's float semantics: the compiler may swap the operands of `a + b`
/// or `min`, and a fused loop and a single kernel may be compiled
/// differently. Every other bit, signed zeros included, must match.
pub(crate) fn bits(values: &[HostTensor]) -> Vec<(TensorMetadata, Vec<u8>)> {
    values
        .iter()
        .map(|t| {
            let dense = t.to_dense().unwrap();
            let mut bytes = dense.buffer().bytes().to_vec();
            canonicalize_nans(dense.metadata().dtype, &mut bytes);
            (dense.metadata().clone(), bytes)
        })
        .collect()
}

/// Rewrites each NaN element of a `dtype` buffer to the positive quiet NaN.
fn canonicalize_nans(dtype: DType, bytes: &mut [u8]) {
    // (element width, exponent mask, mantissa mask, canonical quiet NaN)
    let (width, exponent, mantissa, quiet): (usize, u64, u64, u64) = match dtype {
        DType::F16 => (2, 0x7c00, 0x03ff, 0x7e00),
        DType::BF16 => (2, 0x7f80, 0x007f, 0x7fc0),
        DType::F32 => (4, 0x7f80_0000, 0x007f_ffff, 0x7fc0_0000),
        DType::F64 => (8, 0x7ff0 << 48, (1 << 52) - 1, 0x7ff8 << 48),
        _ => return,
    };
    for element in bytes.chunks_exact_mut(width) {
        let mut word = [0u8; 8];
        word[..width].copy_from_slice(element);
        let value = u64::from_le_bytes(word);
        if value & exponent == exponent && value & mantissa != 0 {
            element.copy_from_slice(&quiet.to_le_bytes()[..width]);
        }
    }
}

/// [`eval`], then [`bits`].
pub(crate) fn run_bits(f: &Function, args: &[HostTensor]) -> Vec<(TensorMetadata, Vec<u8>)> {
    bits(&eval(f, args).unwrap_or_else(|e| panic!("{e}\n{}", crate::text::print(f))))
}

/// One step of a generated function; operands pick among the values
/// defined so far.
#[derive(Clone, Debug)]
enum Step {
    Unary(usize, Index),
    Binary(usize, Index, Index),
    /// A constant from a small pool, so equal constants are common.
    Const(usize, usize),
    /// The same op with the same operands as an earlier op step.
    Repeat(Index),
    Print(Index),
}

const UNARY: &[&OpDef] = &[
    &ops::NEG,
    &ops::ABS,
    &ops::EXP,
    &ops::TANH,
    &ops::RELU,
    &ops::SIN,
    &ops::SQRT,
];

const BINARY: &[&OpDef] = &[
    &ops::ADD,
    &ops::SUB,
    &ops::MUL,
    &ops::DIV,
    &ops::MAXIMUM,
    &ops::MINIMUM,
    &ops::POW,
];

/// Includes `-0.0`, which a broadcast scalar expands to `+0.0`, and a NaN.
const POOL: &[f32] = &[0.0, -0.0, 1.0, 2.0, -0.5, f32::NAN];

/// A constant of `POOL[value]` in one of three forms (all broadcastable
/// against the `f32[2,3]` parameters): a scalar `f32[]`, a dense `f32[3]`
/// or a dense `f32[2,3]`.
fn constant(value: usize, form: usize) -> HostTensor {
    let v = POOL[value % POOL.len()];
    match form % 3 {
        0 => ScalarHostTensor::new(Scalar::F32(v), []).into(),
        1 => DenseHostTensor::from_slice(&[v, 1.0, v], [3])
            .unwrap()
            .into(),
        _ => DenseHostTensor::from_slice(&[v, v, 2.0, v, -1.0, v], [2, 3])
            .unwrap()
            .into(),
    }
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (0..UNARY.len(), any::<Index>()).prop_map(|(op, a)| Step::Unary(op, a)),
        4 => (0..BINARY.len(), any::<Index>(), any::<Index>())
            .prop_map(|(op, a, b)| Step::Binary(op, a, b)),
        3 => (0..POOL.len(), 0..3usize).prop_map(|(v, form)| Step::Const(v, form)),
        3 => any::<Index>().prop_map(Step::Repeat),
        1 => any::<Index>().prop_map(Step::Print),
    ]
}

fn arg() -> impl Strategy<Value = f32> {
    prop_oneof![
        8 => -4.0f32..4.0,
        1 => Just(0.0f32),
        1 => Just(-0.0f32),
        1 => Just(f32::INFINITY),
    ]
}

/// A random function of one or two `f32[2,3]` parameters built from
/// elementwise ops, constants, repeated subexpressions and the odd `Print`,
/// with one to three results; and arguments for it.
pub(crate) fn pure_dag() -> impl Strategy<Value = (Function, Vec<HostTensor>)> {
    (
        1..=2usize,
        prop::collection::vec(step(), 1..16),
        prop::collection::vec(any::<Index>(), 1..=3),
        prop::collection::vec(arg(), 12),
    )
        .prop_map(|(params, steps, results, args)| {
            let f = build(params, &steps, &results);
            let args = args
                .chunks(6)
                .take(params)
                .map(|c| DenseHostTensor::from_slice(c, [2, 3]).unwrap().into())
                .collect();
            (f, args)
        })
}

fn build(params: usize, steps: &[Step], results: &[Index]) -> Function {
    let none = OpAttrs::new();
    let mut f = Function::new("random", vec![meta(&[2, 3]); params]);
    let mut values: Vec<Value> = (0..params as u32).map(Value::Param).collect();
    // The op steps taken so far, to repeat.
    let mut ops_so_far: Vec<(&'static OpDef, SmallVec<[Value; 2]>)> = Vec::new();
    let mut consts_so_far: Vec<HostTensor> = Vec::new();
    for (line, step) in steps.iter().enumerate() {
        let at = loc(line as u32 + 1);
        let (def, inputs): (&'static OpDef, SmallVec<[Value; 2]>) = match step {
            Step::Unary(op, a) => (UNARY[*op], smallvec::smallvec![*a.get(&values)]),
            Step::Binary(op, a, b) => (
                BINARY[*op],
                smallvec::smallvec![*a.get(&values), *b.get(&values)],
            ),
            Step::Print(a) => (&ops::PRINT, smallvec::smallvec![*a.get(&values)]),
            Step::Const(v, form) => {
                let c = constant(*v, *form);
                consts_so_far.push(c.clone());
                values.push(Value::node(f.add_const(c, at)));
                continue;
            }
            Step::Repeat(i) if !ops_so_far.is_empty() => i.get(&ops_so_far).clone(),
            Step::Repeat(i) if !consts_so_far.is_empty() => {
                let c = i.get(&consts_so_far).clone();
                values.push(Value::node(f.add_const(c, at)));
                continue;
            }
            Step::Repeat(_) => continue,
        };
        let node = f.add_op(def, &none, &inputs, at).unwrap();
        ops_so_far.push((def, inputs));
        values.push(Value::node(node));
    }
    f.results = results.iter().map(|i| *i.get(&values)).collect();
    crate::verify(&f).unwrap();
    f
}
