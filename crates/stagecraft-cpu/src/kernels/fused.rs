//! The `FusedElementwise` kernel: a block interpreter. Each block of
//! elements runs the whole program with its registers in cache, so every
//! input is read once and the output written once; every instruction is a
//! tight loop over the block with the op chosen outside the loop. Element
//! functions are the same as the separate kernels', so fused and unfused
//! results are bit-identical.

use super::elementwise::{gelu, relu, rsqrt, sigmoid, sign, Arith, Real};
use crate::kernel::{Kernel, KernelContext, KernelRegistry, Outputs};
use crate::Inputs;
use rayon::prelude::*;
use smallvec::smallvec;
use stagecraft_ops::{decode_fused, Attrs, BinaryOp, FusedInstr, UnaryOp};
use stagecraft_tensor::{DType, DenseHostTensor, Error, Result, TensorMetadata};
use std::sync::Arc;

pub(crate) fn register(registry: &mut KernelRegistry) {
    registry.add(&stagecraft_ops::FUSED_ELEMENTWISE, fused_factory);
}

/// Elements per block: registers of a few instructions stay in L1.
const BLOCK: usize = 1024;

/// An operand within one block.
#[derive(Clone, Copy)]
enum Src<'a, T> {
    Slice(&'a [T]),
    Scalar(T),
}

impl<T: Copy> Src<'_, T> {
    #[inline(always)]
    fn get(&self, i: usize) -> T {
        match self {
            Src::Slice(s) => s[i],
            Src::Scalar(v) => *v,
        }
    }
}

#[inline(always)]
fn unary_loop<T: Real>(dst: &mut [T], a: Src<'_, T>, f: impl Fn(f64) -> f64) {
    for (i, d) in dst.iter_mut().enumerate() {
        *d = T::narrow(f(a.get(i).wide()));
    }
}

#[inline(always)]
fn binary_loop<T: Copy>(dst: &mut [T], a: Src<'_, T>, b: Src<'_, T>, f: impl Fn(T, T) -> T) {
    match (a, b) {
        (Src::Slice(x), Src::Slice(y)) => {
            for ((d, &p), &q) in dst.iter_mut().zip(x).zip(y) {
                *d = f(p, q);
            }
        }
        _ => {
            for (i, d) in dst.iter_mut().enumerate() {
                *d = f(a.get(i), b.get(i));
            }
        }
    }
}

fn run_unary<T: Real>(op: UnaryOp, dst: &mut [T], a: Src<'_, T>) {
    match op {
        UnaryOp::Neg => unary_loop(dst, a, |x| -x),
        UnaryOp::Abs => unary_loop(dst, a, f64::abs),
        UnaryOp::Exp => unary_loop(dst, a, f64::exp),
        UnaryOp::Log => unary_loop(dst, a, f64::ln),
        UnaryOp::Sqrt => unary_loop(dst, a, f64::sqrt),
        UnaryOp::Rsqrt => unary_loop(dst, a, rsqrt),
        UnaryOp::Tanh => unary_loop(dst, a, f64::tanh),
        UnaryOp::Sigmoid => unary_loop(dst, a, sigmoid),
        UnaryOp::Relu => unary_loop(dst, a, relu),
        UnaryOp::Gelu => unary_loop(dst, a, gelu),
        UnaryOp::Sin => unary_loop(dst, a, f64::sin),
        UnaryOp::Cos => unary_loop(dst, a, f64::cos),
        UnaryOp::Sign => unary_loop(dst, a, sign),
        // Rejected by the op's metadata function.
        UnaryOp::Not => {}
    }
}

fn run_binary<T: Real + Arith>(op: BinaryOp, dst: &mut [T], a: Src<'_, T>, b: Src<'_, T>) {
    match op {
        BinaryOp::Add => binary_loop(dst, a, b, T::add),
        BinaryOp::Sub => binary_loop(dst, a, b, T::sub),
        BinaryOp::Mul => binary_loop(dst, a, b, T::mul),
        BinaryOp::Div => binary_loop(dst, a, b, T::div),
        BinaryOp::Maximum => binary_loop(dst, a, b, T::maximum),
        BinaryOp::Minimum => binary_loop(dst, a, b, T::minimum),
        BinaryOp::Pow => binary_loop(dst, a, b, |x: T, y: T| T::narrow(x.wide().powf(y.wide()))),
        // Rejected by the op's metadata function.
        BinaryOp::And | BinaryOp::Or => {}
    }
}

/// Register `r` within the block `start..start + n`: an input's slice (or
/// scalar), or an earlier instruction's result.
fn operand<'b, T: Copy>(
    r: usize,
    inputs: &[Src<'b, T>],
    regs: &'b [Vec<T>],
    start: usize,
    n: usize,
) -> Src<'b, T> {
    if r < inputs.len() {
        match inputs[r] {
            Src::Slice(s) => Src::Slice(&s[start..start + n]),
            scalar => scalar,
        }
    } else {
        Src::Slice(&regs[r - inputs.len()][..n])
    }
}

/// Runs the program over elements `start..start + out.len()`.
fn run_block<T: Real + Arith>(
    program: &[FusedInstr],
    inputs: &[Src<'_, T>],
    start: usize,
    out: &mut [T],
    regs: &mut [Vec<T>],
) {
    let n = out.len();
    for (i, instr) in program.iter().enumerate() {
        let (done, rest) = regs.split_at_mut(i);
        let dst = &mut rest[0][..n];
        match *instr {
            FusedInstr::Unary(op, a) => {
                let a = operand(a, inputs, done, start, n);
                run_unary(op, dst, a)
            }
            FusedInstr::Binary(op, a, b) => {
                let (a, b) = (
                    operand(a, inputs, done, start, n),
                    operand(b, inputs, done, start, n),
                );
                run_binary(op, dst, a, b)
            }
        }
    }
    out.copy_from_slice(&regs[program.len() - 1][..n]);
}

fn fused_typed<T: Real + Arith + Send + Sync>(
    program: &[FusedInstr],
    inputs: &[DenseHostTensor],
    meta: &TensorMetadata,
) -> Result<DenseHostTensor> {
    let srcs: Vec<Src<'_, T>> = inputs
        .iter()
        .map(|t| {
            let v = t.as_slice::<T>()?;
            Ok(if t.shape().rank() == 0 {
                Src::Scalar(v[0])
            } else {
                Src::Slice(v)
            })
        })
        .collect::<Result<_>>()?;
    let mut out = DenseHostTensor::for_overwrite(meta.clone())?;
    let total = meta.shape.numel();
    let y = out.as_mut_slice::<T>()?;
    let fresh = || vec![vec![T::default(); BLOCK]; program.len()];
    if total >= crate::PARALLEL_THRESHOLD {
        y.par_chunks_mut(BLOCK * 16)
            .enumerate()
            .for_each_init(fresh, |regs, (c, chunk)| {
                for (b, block) in chunk.chunks_mut(BLOCK).enumerate() {
                    run_block(program, &srcs, c * BLOCK * 16 + b * BLOCK, block, regs);
                }
            });
    } else {
        let mut regs = fresh();
        for (b, block) in y.chunks_mut(BLOCK).enumerate() {
            run_block(program, &srcs, b * BLOCK, block, &mut regs);
        }
    }
    Ok(out)
}

fn fused_factory(attrs: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    let program = decode_fused(attrs.ints("program")?, inputs.len())?;
    let dtype = inputs[0].dtype;
    Ok(Arc::new(
        move |inputs: Inputs, ctx: &KernelContext<'_>| -> Result<Outputs> {
            let meta = &ctx.outputs[0];
            Ok(smallvec![match dtype {
                DType::F32 => fused_typed::<f32>(&program, &inputs, meta)?,
                DType::F64 => fused_typed::<f64>(&program, &inputs, meta)?,
                other => return Err(Error::internal(format!("a fused kernel for {other}"))),
            }])
        },
    ))
}
