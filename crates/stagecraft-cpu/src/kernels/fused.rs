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

static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();

/// An operand within one block.
#[derive(Clone, Copy)]
enum Src<'a, T> {
    Slice(&'a [T]),
    Scalar(T),
}

#[inline(always)]
fn unary_loop<T: Real>(dst: &mut [T], a: Src<'_, T>, f: impl Fn(f64) -> f64) {
    match a {
        Src::Slice(x) => {
            for (d, &v) in dst.iter_mut().zip(x) {
                *d = T::narrow(f(v.wide()));
            }
        }
        Src::Scalar(v) => dst.fill(T::narrow(f(v.wide()))),
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
        (Src::Slice(x), Src::Scalar(q)) => {
            for (d, &p) in dst.iter_mut().zip(x) {
                *d = f(p, q);
            }
        }
        (Src::Scalar(p), Src::Slice(y)) => {
            for (d, &q) in dst.iter_mut().zip(y) {
                *d = f(p, q);
            }
        }
        (Src::Scalar(p), Src::Scalar(q)) => dst.fill(f(p, q)),
    }
}

#[inline(always)]
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

#[inline(always)]
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

/// Where an operand lives: an input tensor, or a register slot.
#[derive(Clone, Copy, Debug)]
enum Operand {
    Input(usize),
    Slot(usize),
}

/// An instruction over physical register slots.
#[derive(Clone, Copy, Debug)]
enum Step {
    Unary(UnaryOp, Operand, usize),
    Binary(BinaryOp, Operand, Operand, usize),
}

/// Assigns register slots so that a slot is reused once its value is dead:
/// a chain of any length needs two slots, so registers stay in L1.
/// Returns the steps, the slot count and the result's slot.
fn allocate_registers(program: &[FusedInstr], inputs: usize) -> (Vec<Step>, usize, usize) {
    let n = program.len();
    let mut last_use = vec![0usize; n];
    for (i, instr) in program.iter().enumerate() {
        let reads: [Option<usize>; 2] = match *instr {
            FusedInstr::Unary(_, a) => [Some(a), None],
            FusedInstr::Binary(_, a, b) => [Some(a), Some(b)],
        };
        for r in reads.into_iter().flatten() {
            if r >= inputs {
                last_use[r - inputs] = i;
            }
        }
    }
    let mut slot_of = vec![0usize; n];
    let mut free: Vec<usize> = Vec::new();
    let mut slots = 0;
    let mut steps = Vec::with_capacity(n);
    for (i, instr) in program.iter().enumerate() {
        let dst = free.pop().unwrap_or_else(|| {
            slots += 1;
            slots - 1
        });
        let operand = |r: usize| {
            if r < inputs {
                Operand::Input(r)
            } else {
                Operand::Slot(slot_of[r - inputs])
            }
        };
        let step = match *instr {
            FusedInstr::Unary(op, a) => Step::Unary(op, operand(a), dst),
            FusedInstr::Binary(op, a, b) => Step::Binary(op, operand(a), operand(b), dst),
        };
        steps.push(step);
        slot_of[i] = dst;
        // Operands whose last reader this is free their slots for later
        // steps (not this one: a step never writes a slot it reads).
        let reads: [Option<usize>; 2] = match *instr {
            FusedInstr::Unary(_, a) => [Some(a), None],
            FusedInstr::Binary(_, a, b) => [Some(a), if b == a { None } else { Some(b) }],
        };
        for r in reads.into_iter().flatten() {
            if r >= inputs && last_use[r - inputs] == i {
                free.push(slot_of[r - inputs]);
            }
        }
    }
    (steps, slots, slot_of[n - 1])
}

/// Operand `op` within the block `start..start + n`.
fn operand<'b, T: Copy>(
    op: Operand,
    inputs: &[Src<'b, T>],
    regs: &'b [Vec<T>],
    start: usize,
    n: usize,
) -> Src<'b, T> {
    match op {
        Operand::Input(k) => match inputs[k] {
            Src::Slice(s) => Src::Slice(&s[start..start + n]),
            scalar => scalar,
        },
        Operand::Slot(r) => Src::Slice(&regs[r][..n]),
    }
}

/// Runs the program over elements `start..start + out.len()`.
#[inline(always)]
fn run_block<T: Real + Arith>(
    steps: &[Step],
    result: usize,
    inputs: &[Src<'_, T>],
    start: usize,
    out: &mut [T],
    regs: &mut [Vec<T>],
) {
    let n = out.len();
    for step in steps {
        let dst_slot = match *step {
            Step::Unary(_, _, d) | Step::Binary(_, _, _, d) => d,
        };
        // The destination is never an operand of its own step, so it can be
        // taken out while the operands are borrowed.
        let mut dst = std::mem::take(&mut regs[dst_slot]);
        match *step {
            Step::Unary(op, a, _) => {
                run_unary(op, &mut dst[..n], operand(a, inputs, regs, start, n))
            }
            Step::Binary(op, a, b, _) => run_binary(
                op,
                &mut dst[..n],
                operand(a, inputs, regs, start, n),
                operand(b, inputs, regs, start, n),
            ),
        }
        regs[dst_slot] = dst;
    }
    out.copy_from_slice(&regs[result][..n]);
}

/// Which instruction set the block loops are compiled for, chosen once from
/// what the CPU supports: the default build targets baseline x86-64 (SSE2,
/// 4 f32 lanes), while the machines we run on have AVX2 or AVX-512.
#[derive(Clone, Copy)]
enum Isa {
    Baseline,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

fn detect_isa() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return Isa::Avx512;
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            return Isa::Avx2;
        }
    }
    Isa::Baseline
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn run_block_avx2<T: Real + Arith>(
    steps: &[Step],
    result: usize,
    inputs: &[Src<'_, T>],
    start: usize,
    out: &mut [T],
    regs: &mut [Vec<T>],
) {
    run_block(steps, result, inputs, start, out, regs)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn run_block_avx512<T: Real + Arith>(
    steps: &[Step],
    result: usize,
    inputs: &[Src<'_, T>],
    start: usize,
    out: &mut [T],
    regs: &mut [Vec<T>],
) {
    run_block(steps, result, inputs, start, out, regs)
}

/// Runs one block with the loops compiled for `isa`. Vector widths change
/// nothing in the results: every op is one IEEE operation per element
/// either way (no reassociation, no fused multiply-add).
fn run_block_on<T: Real + Arith>(
    isa: Isa,
    steps: &[Step],
    result: usize,
    inputs: &[Src<'_, T>],
    start: usize,
    out: &mut [T],
    regs: &mut [Vec<T>],
) {
    match isa {
        Isa::Baseline => run_block(steps, result, inputs, start, out, regs),
        // SAFETY: `detect_isa` chose this variant only after the CPU
        // reported AVX2, which is all `run_block_avx2` is compiled to use.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { run_block_avx2(steps, result, inputs, start, out, regs) },
        // SAFETY: as above, for AVX-512F.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { run_block_avx512(steps, result, inputs, start, out, regs) },
    }
}

fn fused_typed<T: Real + Arith + Send + Sync>(
    program: &(Vec<Step>, usize, usize),
    inputs: &[DenseHostTensor],
    meta: &TensorMetadata,
) -> Result<DenseHostTensor> {
    let (steps, slots, result) = program;
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
    let width = BLOCK.min(total.max(1));
    let fresh = || vec![vec![T::default(); width]; *slots];
    let isa = *ISA.get_or_init(detect_isa);
    if total >= crate::PARALLEL_THRESHOLD {
        y.par_chunks_mut(BLOCK * 16)
            .enumerate()
            .for_each_init(fresh, |regs, (c, chunk)| {
                for (b, block) in chunk.chunks_mut(BLOCK).enumerate() {
                    run_block_on(
                        isa,
                        steps,
                        *result,
                        &srcs,
                        c * BLOCK * 16 + b * BLOCK,
                        block,
                        regs,
                    );
                }
            });
    } else {
        let mut regs = fresh();
        for (b, block) in y.chunks_mut(BLOCK).enumerate() {
            run_block_on(isa, steps, *result, &srcs, b * BLOCK, block, &mut regs);
        }
    }
    Ok(out)
}

fn fused_factory(attrs: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    let program = allocate_registers(
        &decode_fused(attrs.ints("program")?, inputs.len())?,
        inputs.len(),
    );
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Every instruction set this CPU has gives the baseline's bits, NaNs
    /// and signed zeros included, on a block that is not a multiple of the
    /// vector width.
    #[test]
    fn every_instruction_set_gives_the_same_bits() {
        // x: input 0, k: scalar input 1.
        let program = vec![
            FusedInstr::Binary(BinaryOp::Mul, 0, 1),
            FusedInstr::Unary(UnaryOp::Relu, 2),
            FusedInstr::Binary(BinaryOp::Sub, 3, 0),
            FusedInstr::Unary(UnaryOp::Tanh, 4),
            FusedInstr::Binary(BinaryOp::Maximum, 5, 0),
            FusedInstr::Binary(BinaryOp::Div, 6, 2),
        ];
        let program = allocate_registers(&program, 2);
        let n = 1000;
        let x: Vec<f32> = (0..n)
            .map(|i| match i % 7 {
                0 => f32::NAN,
                1 => -0.0,
                2 => f32::INFINITY,
                _ => (i as f32 - 500.0) / 37.0,
            })
            .collect();
        let inputs = [Src::Slice(&x[..]), Src::Scalar(-1.5f32)];
        let run = |isa: Isa| {
            let mut regs = vec![vec![0.0f32; n]; program.1];
            let mut out = vec![0.0f32; n];
            run_block_on(isa, &program.0, program.2, &inputs, 0, &mut out, &mut regs);
            out.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
        };
        let baseline = run(Isa::Baseline);
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                assert_eq!(run(Isa::Avx2), baseline);
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                assert_eq!(run(Isa::Avx512), baseline);
            }
        }
        assert_eq!(run(detect_isa()), baseline);
    }
}
