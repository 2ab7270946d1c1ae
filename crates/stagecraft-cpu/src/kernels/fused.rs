//! The `FusedElementwise` kernel: a block interpreter. Each block of
//! elements runs the whole program with its registers in cache, so every
//! input is read once and the output written once; every instruction is a
//! tight loop over the block with the op chosen outside the loop, and runs
//! of instructions that feed each other run as one chain with their values
//! in vector registers (`chain`). Element functions are the same as the
//! separate kernels', so fused and unfused results are bit-identical.

mod chain;

use super::elementwise::{Arith, BinaryEval, Map, Real, UnaryEval, Zip};
use super::linalg::{matmul_with_epilogue, GemmElement};
use super::reduce::{float_fold, Source};
use crate::kernel::{Kernel, KernelContext, KernelRegistry, Outputs};
use crate::Inputs;
use smallvec::{smallvec, SmallVec};
use stagecraft_ops::{
    decode_fused, fused_operand, fused_output, fused_reduce_op, reduction_axes, Attrs, BinaryFn,
    BinaryOp, BinaryVisitor, CompareOp, FusedInstr, FusedOperand, ReduceOp, UnaryFn, UnaryOp,
    UnaryVisitor,
};
use stagecraft_tensor::{DType, DenseHostTensor, Element, Error, Result, TensorMetadata};
use std::marker::PhantomData;
use std::sync::Arc;

pub(crate) fn register(registry: &mut KernelRegistry) {
    registry.add(&stagecraft_ops::FUSED_ELEMENTWISE, fused_factory);
    registry.add(&stagecraft_ops::FUSED_REDUCE, fused_reduce_factory);
    registry.add(&stagecraft_ops::FUSED_MATMUL, fused_matmul_factory);
}

/// Elements per block: registers of a few instructions stay in L1.
const BLOCK: usize = 1024;

/// An operand within one block.
#[derive(Clone, Copy)]
enum Src<'a, T> {
    Slice(&'a [T]),
    Scalar(T),
}

/// A whole input, read as [`FusedOperand`] says.
#[derive(Clone, Copy)]
enum Input<'a, T> {
    Full(&'a [T]),
    Scalar(T),
    Tile(&'a [T]),
    Repeat(&'a [T], usize),
    /// Output elements `base..base + len` only (one block of a matmul's
    /// product, copied aside while the epilogue overwrites it).
    Offset(&'a [T], usize),
}

impl<'a, T: Copy> Input<'a, T> {
    fn new(values: &'a [T], how: FusedOperand) -> Input<'a, T> {
        match how {
            FusedOperand::Scalar => Input::Scalar(values[0]),
            FusedOperand::Full => Input::Full(values),
            FusedOperand::Tile { .. } => Input::Tile(values),
            FusedOperand::Repeat { run } => Input::Repeat(values, run.max(1)),
        }
    }

    /// Asks the caches for a full input's elements `start..start + n`
    /// ahead of their block. A block is one 4 KiB page of f32, and the
    /// hardware prefetchers stop at page boundaries, so without this each
    /// block's first step waited on memory for its whole input (measured
    /// on B3: most of the kernel's time was in the loads of `x`).
    fn prefetch<const HINT: i32>(&self, start: usize, n: usize) {
        if let Input::Full(v) = *self {
            let end = (start + n).min(v.len());
            let lines = v.get(start..end).unwrap_or_default();
            for line in lines.chunks((64 / std::mem::size_of::<T>()).max(1)) {
                prefetch_line::<HINT, T>(line.as_ptr());
            }
        }
    }

    /// The operand for output elements `start..start + n`: a broadcast
    /// input is first spread into `scratch` (in L1, like the registers;
    /// grown on first use, so inputs read in place cost no buffer).
    fn block<'s>(&self, start: usize, n: usize, scratch: &'s mut Vec<T>) -> Src<'s, T>
    where
        'a: 's,
        T: Default,
    {
        if let Input::Repeat(v, run) = *self {
            // A block inside one run (a channel's bias over a plane of
            // pixels) reads one value: nothing to spread.
            if run > 0 && start % run + n <= run {
                return Src::Scalar(v[start / run]);
            }
        }
        if matches!(self, Input::Tile(_) | Input::Repeat(..)) && scratch.len() < n {
            scratch.resize(n, T::default());
        }
        match *self {
            Input::Full(v) => Src::Slice(&v[start..start + n]),
            Input::Offset(v, base) => Src::Slice(&v[start - base..start - base + n]),
            Input::Scalar(v) => Src::Scalar(v),
            Input::Tile(v) => {
                let period = v.len();
                let mut filled = 0;
                let mut at = start % period;
                while filled < n {
                    let take = (period - at).min(n - filled);
                    scratch[filled..filled + take].copy_from_slice(&v[at..at + take]);
                    filled += take;
                    at = 0;
                }
                Src::Slice(&scratch[..n])
            }
            Input::Repeat(v, run) => {
                let mut filled = 0;
                while filled < n {
                    let i = start + filled;
                    let take = (run - i % run).min(n - filled);
                    scratch[filled..filled + take].fill(v[i / run]);
                    filled += take;
                }
                Src::Slice(&scratch[..n])
            }
        }
    }
}

/// Prefetch hints: into L1, or into L2 only.
#[cfg(target_arch = "x86_64")]
const TO_L1: i32 = std::arch::x86_64::_MM_HINT_T0;
#[cfg(target_arch = "x86_64")]
const TO_L2: i32 = std::arch::x86_64::_MM_HINT_T1;
#[cfg(not(target_arch = "x86_64"))]
const TO_L1: i32 = 0;
#[cfg(not(target_arch = "x86_64"))]
const TO_L2: i32 = 1;

/// Starts loading the cache line holding `at` into L1 or L2 (`HINT`).
#[inline(always)]
fn prefetch_line<const HINT: i32, T>(at: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint: it never faults and reads nothing the
    // program sees, and `at` points into a live slice anyway.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<HINT>(at as *const i8)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = at;
}

#[inline(always)]
fn unary_loop<T: Copy>(dst: &mut [T], a: Src<'_, T>, f: impl Map<T>) {
    match a {
        Src::Slice(x) => {
            for (d, &v) in dst.iter_mut().zip(x) {
                *d = f.map(v);
            }
        }
        Src::Scalar(v) => dst.fill(f.map(v)),
    }
}

#[inline(always)]
fn binary_loop<T: Copy>(dst: &mut [T], a: Src<'_, T>, b: Src<'_, T>, f: impl Zip<T>) {
    match (a, b) {
        (Src::Slice(x), Src::Slice(y)) => {
            for ((d, &p), &q) in dst.iter_mut().zip(x).zip(y) {
                *d = f.zip(p, q);
            }
        }
        (Src::Slice(x), Src::Scalar(q)) => {
            for (d, &p) in dst.iter_mut().zip(x) {
                *d = f.zip(p, q);
            }
        }
        (Src::Scalar(p), Src::Slice(y)) => {
            for (d, &q) in dst.iter_mut().zip(y) {
                *d = f.zip(p, q);
            }
        }
        (Src::Scalar(p), Src::Scalar(q)) => dst.fill(f.zip(p, q)),
    }
}

/// One unary instruction over a block: the op's own meaning from its
/// definition, the same function the eager kernel runs.
struct RunUnary<'d, 's, T> {
    dst: &'d mut [T],
    a: Src<'s, T>,
}

impl<T: Arith> UnaryVisitor for RunUnary<'_, '_, T> {
    type Output = ();
    #[inline(always)]
    fn visit<F: UnaryFn>(self) {
        unary_loop(self.dst, self.a, UnaryEval::<F>(PhantomData))
    }
}

#[inline(always)]
fn run_unary<T: Arith>(op: UnaryOp, dst: &mut [T], a: Src<'_, T>) {
    op.visit(RunUnary { dst, a })
}

/// One binary instruction over a block.
struct RunBinary<'d, 's, T> {
    dst: &'d mut [T],
    a: Src<'s, T>,
    b: Src<'s, T>,
}

impl<T: Arith> BinaryVisitor for RunBinary<'_, '_, T> {
    type Output = ();
    #[inline(always)]
    fn visit<F: BinaryFn>(self) {
        binary_loop(self.dst, self.a, self.b, BinaryEval::<F>(PhantomData))
    }
}

#[inline(always)]
fn run_binary<T: Arith>(op: BinaryOp, dst: &mut [T], a: Src<'_, T>, b: Src<'_, T>) {
    op.visit(RunBinary { dst, a, b })
}

/// 1 where `op` holds, else 0 (NaN compares false), as a comparison cast
/// to a float type gives.
#[inline(always)]
fn run_compare<T: Real + Arith>(op: CompareOp, dst: &mut [T], a: Src<'_, T>, b: Src<'_, T>) {
    let (one, zero) = (T::narrow(1.0), T::narrow(0.0));
    let number = |holds: bool| if holds { one } else { zero };
    match op {
        CompareOp::Eq => binary_loop(dst, a, b, |x: T, y: T| number(x == y)),
        CompareOp::Ne => binary_loop(dst, a, b, |x: T, y: T| number(x != y)),
        CompareOp::Lt => binary_loop(dst, a, b, |x: T, y: T| number(x < y)),
        CompareOp::Le => binary_loop(dst, a, b, |x: T, y: T| number(x <= y)),
        CompareOp::Gt => binary_loop(dst, a, b, |x: T, y: T| number(x > y)),
        CompareOp::Ge => binary_loop(dst, a, b, |x: T, y: T| number(x >= y)),
    }
}

/// Where an operand lives: an input tensor, or a register slot.
#[derive(Clone, Copy, Debug)]
enum Operand {
    Input(usize),
    Slot(usize),
}

/// An instruction over physical register slots.
#[derive(Clone, Debug)]
enum Step {
    Unary(UnaryOp, Operand, usize),
    Binary(BinaryOp, Operand, Operand, usize),
    Compare(CompareOp, Operand, Operand, usize),
    /// Instructions whose values stay in vector registers (see `chain`).
    Chain(Box<chain::Chain<Operand>>, usize),
}

impl Step {
    fn dst(&self) -> usize {
        match *self {
            Step::Unary(_, _, d)
            | Step::Binary(_, _, _, d)
            | Step::Compare(_, _, _, d)
            | Step::Chain(_, d) => d,
        }
    }
}

/// Assigns register slots so that a slot is reused once its value is dead:
/// a sequence of any length needs two slots, so registers stay in L1. With
/// `chains`, runs of instructions become [`Step::Chain`]s (see `chain`).
/// Returns the steps, the slot count and the result's slot.
fn allocate_registers(
    program: &[FusedInstr],
    inputs: usize,
    chains: bool,
) -> (Vec<Step>, usize, usize) {
    let nodes = chain::plan_nodes(program, inputs, chains);
    let reads = |node: &chain::Node| -> SmallVec<[usize; 8]> {
        match node {
            chain::Node::Single(FusedInstr::Unary(_, a)) => smallvec![*a],
            chain::Node::Single(FusedInstr::Binary(_, a, b) | FusedInstr::Compare(_, a, b)) => {
                smallvec![*a, *b]
            }
            chain::Node::Chain(c) => c.reads().collect(),
        }
    };
    // Values are program values: inputs, then instruction results.
    let mut last_use = vec![0usize; inputs + program.len()];
    for (k, (_, node)) in nodes.iter().enumerate() {
        for r in reads(node) {
            last_use[r] = k;
        }
    }
    let mut slot_of = vec![0usize; inputs + program.len()];
    let mut free: Vec<usize> = Vec::new();
    let mut slots = 0;
    let mut steps = Vec::with_capacity(nodes.len());
    for (k, (end, node)) in nodes.iter().enumerate() {
        let dst = free.pop().unwrap_or_else(|| {
            slots += 1;
            slots - 1
        });
        let operand = |r: usize| {
            if r < inputs {
                Operand::Input(r)
            } else {
                Operand::Slot(slot_of[r])
            }
        };
        let step = match node {
            chain::Node::Single(FusedInstr::Unary(op, a)) => Step::Unary(*op, operand(*a), dst),
            chain::Node::Single(FusedInstr::Binary(op, a, b)) => {
                Step::Binary(*op, operand(*a), operand(*b), dst)
            }
            chain::Node::Single(FusedInstr::Compare(op, a, b)) => {
                Step::Compare(*op, operand(*a), operand(*b), dst)
            }
            chain::Node::Chain(c) => Step::Chain(Box::new(c.map(operand)), dst),
        };
        steps.push(step);
        slot_of[inputs + end] = dst;
        // Operands whose last reader this is free their slots for later
        // steps (not this one: a step never writes a slot it reads).
        let mut read = reads(node);
        read.sort_unstable();
        read.dedup();
        for r in read {
            if r >= inputs && last_use[r] == k {
                free.push(slot_of[r]);
            }
        }
    }
    (steps, slots, slot_of[inputs + program.len() - 1])
}

/// Operand `op` within the current block.
fn operand<'b, T: Copy>(
    op: Operand,
    inputs: &[Src<'b, T>],
    regs: &'b [Vec<T>],
    n: usize,
) -> Src<'b, T> {
    match op {
        Operand::Input(k) => inputs[k],
        Operand::Slot(r) => Src::Slice(&regs[r][..n]),
    }
}

/// Per-thread working memory of a fused kernel: the register slots, one
/// block of spread values per broadcast input, and for a streamed output
/// two blocks of results on their way out (one being computed, one being
/// written; allocated by the first streamed range).
struct Scratch<T> {
    regs: Vec<Vec<T>>,
    spread: Vec<Vec<T>>,
    current: Vec<T>,
    previous: Vec<T>,
}

impl<T: Copy + Default> Scratch<T> {
    fn new(slots: usize, inputs: usize, width: usize) -> Scratch<T> {
        Scratch {
            regs: vec![vec![T::default(); width]; slots],
            spread: vec![Vec::new(); inputs],
            current: Vec::new(),
            previous: Vec::new(),
        }
    }
}

/// Outputs of at least this many bytes are written with non-temporal
/// stores: far larger than the caches, they would only evict the inputs,
/// and a normal store first reads every output line it writes.
const STREAM_BYTES: usize = 16 << 20;

/// Copies `src` into `dst`, with non-temporal stores when the CPU has
/// AVX-512 or AVX2 and `dst` is aligned for them. Callers end their writes
/// with [`stream_fence`] before another thread may read `dst`.
fn stream_copy<T: Copy>(isa: Isa, dst: &mut [T], src: &[T]) {
    let src = &src[..dst.len()];
    let bytes = std::mem::size_of_val(dst);
    let (to, from) = (dst.as_mut_ptr().cast::<u8>(), src.as_ptr().cast::<u8>());
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 if (to as usize).is_multiple_of(64) => {
            // SAFETY: `to` and `from` span `bytes` bytes of two distinct
            // slices (`dst` is borrowed mutably), `to` is 64-byte aligned
            // as `_mm512_stream_si512` needs, and the CPU reported AVX-512F.
            unsafe { stream_avx512(to, from, bytes) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 if (to as usize).is_multiple_of(32) => {
            // SAFETY: as above, with the 32-byte alignment and AVX that
            // `_mm256_stream_si256` needs (AVX-512 machines have AVX2).
            unsafe { stream_avx2(to, from, bytes) }
        }
        _ => dst.copy_from_slice(src),
    }
}

/// Orders this thread's non-temporal stores before its later stores (the
/// release that hands the output to another thread).
fn stream_fence(isa: Isa) {
    #[cfg(target_arch = "x86_64")]
    if !matches!(isa, Isa::Baseline) {
        // SAFETY: `sfence` is part of SSE, which every x86-64 CPU has.
        unsafe { std::arch::x86_64::_mm_sfence() }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
}

/// # Safety
/// `to` and `from` must be valid for `bytes` bytes and not overlap, `to`
/// 64-byte aligned, and the CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn stream_avx512(to: *mut u8, from: *const u8, bytes: usize) {
    use std::arch::x86_64::{__m512i, _mm512_loadu_si512, _mm512_stream_si512};
    let whole = bytes / 64 * 64;
    let mut i = 0;
    while i < whole {
        // SAFETY: `i + 64 <= bytes`, so both 64-byte accesses are in bounds;
        // `to + i` keeps the 64-byte alignment.
        unsafe {
            let v = _mm512_loadu_si512(from.add(i).cast::<__m512i>());
            _mm512_stream_si512(to.add(i).cast::<__m512i>(), v);
        }
        i += 64;
    }
    // SAFETY: the tail lies within both ranges.
    unsafe { std::ptr::copy_nonoverlapping(from.add(whole), to.add(whole), bytes - whole) }
}

/// # Safety
/// `to` and `from` must be valid for `bytes` bytes and not overlap, `to`
/// 32-byte aligned, and the CPU must support AVX.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn stream_avx2(to: *mut u8, from: *const u8, bytes: usize) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256};
    let whole = bytes / 32 * 32;
    let mut i = 0;
    while i < whole {
        // SAFETY: `i + 32 <= bytes`; `to + i` keeps the 32-byte alignment.
        unsafe {
            let v = _mm256_loadu_si256(from.add(i).cast::<__m256i>());
            _mm256_stream_si256(to.add(i).cast::<__m256i>(), v);
        }
        i += 32;
    }
    // SAFETY: the tail lies within both ranges.
    unsafe { std::ptr::copy_nonoverlapping(from.add(whole), to.add(whole), bytes - whole) }
}

/// Parts a chain step's block runs in, each after its own `between` call:
/// a streamed range spreads its memory traffic over a program's steps, and
/// a whole program may be one chain.
const CHAIN_PARTS: usize = 4;

/// Runs the program over output elements `start..start + out.len()`,
/// calling `between(i, phases)` before phase `i` of the program's phases
/// (a step, or a part of a chain step's block). `between` is called
/// through a pointer, once per phase: generic over it, this loop was
/// compiled once per caller and instruction set, and was half of this
/// crate's LLVM time.
#[inline(always)]
fn run_block<T: Real + Arith>(
    isa: Isa,
    steps: &[Step],
    inputs: &[Input<'_, T>],
    start: usize,
    out: &mut [T],
    scratch: &mut Scratch<T>,
    between: &mut dyn FnMut(usize, usize),
) {
    let n = out.len();
    let Scratch { regs, spread, .. } = scratch;
    let srcs: SmallVec<[Src<'_, T>; 8]> = inputs
        .iter()
        .zip(spread.iter_mut())
        .map(|(input, buffer)| input.block(start, n, buffer))
        .collect();
    let Some((last, body)) = steps.split_last() else {
        return;
    };
    let parts = |step: &Step| match step {
        Step::Chain(..) => CHAIN_PARTS,
        _ => 1,
    };
    let mut progress = Progress {
        phase: 0,
        phases: steps.iter().map(parts).sum(),
        between,
    };
    for step in body {
        // The destination is never an operand of its own step, so it can be
        // taken out while the operands are borrowed.
        let mut dst = std::mem::take(&mut regs[step.dst()]);
        run_block_step(isa, step, &mut dst[..n], (&srcs, regs), n, &mut progress);
        regs[step.dst()] = dst;
    }
    // The result goes straight to the output: no copy out of a register.
    run_block_step(isa, last, out, (&srcs, regs), n, &mut progress);
}

/// Where a block is in its program, for the callback between phases.
struct Progress<'a> {
    phase: usize,
    phases: usize,
    between: &'a mut dyn FnMut(usize, usize),
}

impl Progress<'_> {
    /// Tells the callback a phase starts, and counts it.
    fn next(&mut self) {
        (self.between)(self.phase, self.phases);
        self.phase += 1;
    }
}

/// One step of a block. A function rather than a closure in
/// [`run_block`]: a closure is compiled on its own, without the target
/// features of the `run_block_avx2`/`_avx512` it sits in, and its loops
/// then ran as scalar SSE2 code (GELU's gradient in the GPT step: 10 ns
/// an element).
#[inline(always)]
fn run_block_step<T: Real + Arith>(
    isa: Isa,
    step: &Step,
    dst: &mut [T],
    (srcs, regs): (&[Src<'_, T>], &[Vec<T>]),
    n: usize,
    progress: &mut Progress<'_>,
) {
    let Step::Chain(chain, _) = step else {
        progress.next();
        return run_step(isa, step, dst, srcs, regs, n);
    };
    run_chain_step(isa, chain, dst, (srcs, regs), CHAIN_PARTS, &mut || {
        progress.next()
    });
}

/// A chain step over its block, in `parts` ranges (see
/// [`chain::run_chain`]).
#[inline(always)]
fn run_chain_step<T: Real + Arith>(
    isa: Isa,
    chain: &chain::Chain<Operand>,
    dst: &mut [T],
    (srcs, regs): (&[Src<'_, T>], &[Vec<T>]),
    parts: usize,
    before_part: &mut dyn FnMut(),
) {
    let n = dst.len();
    let others: SmallVec<[chain::LinkSrc<'_, T>; 8]> = chain
        .links
        .iter()
        .map(|link| match link.other {
            chain::Other::None => chain::LinkSrc::None,
            chain::Other::Itself => chain::LinkSrc::Itself,
            chain::Other::Value(op) => chain::LinkSrc::Src(operand(op, srcs, regs, n)),
        })
        .collect();
    let first = operand(chain.first, srcs, regs, n);
    chain::run_chain(isa, &chain.links, (first, &others), dst, parts, before_part);
}

#[inline(always)]
fn run_step<T: Real + Arith>(
    isa: Isa,
    step: &Step,
    dst: &mut [T],
    srcs: &[Src<'_, T>],
    regs: &[Vec<T>],
    n: usize,
) {
    match *step {
        Step::Unary(op, a, _) => run_unary(op, dst, operand(a, srcs, regs, n)),
        Step::Binary(op, a, b, _) => run_binary(
            op,
            dst,
            operand(a, srcs, regs, n),
            operand(b, srcs, regs, n),
        ),
        Step::Compare(op, a, b, _) => run_compare(
            op,
            dst,
            operand(a, srcs, regs, n),
            operand(b, srcs, regs, n),
        ),
        Step::Chain(ref chain, _) => run_chain_step(isa, chain, dst, (srcs, regs), 1, &mut || {}),
    }
}

/// Which instruction set the block loops are compiled for, chosen once from
/// what the CPU supports: the default build targets baseline x86-64 (SSE2,
/// 4 f32 lanes), while the machines we run on have AVX2 or AVX-512.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Isa {
    Baseline,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

/// The instruction set the multiversioned loops run with:
/// [`crate::isa::level`], the CPU's unless `STAGECRAFT_CPU_ISA` lowers it.
pub(crate) fn isa() -> Isa {
    match crate::isa::level() {
        #[cfg(target_arch = "x86_64")]
        crate::isa::IsaLevel::Avx512 => Isa::Avx512,
        #[cfg(target_arch = "x86_64")]
        crate::isa::IsaLevel::Avx2 => Isa::Avx2,
        _ => Isa::Baseline,
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn run_block_avx2<T: Real + Arith>(
    steps: &[Step],
    inputs: &[Input<'_, T>],
    start: usize,
    out: &mut [T],
    scratch: &mut Scratch<T>,
    between: &mut dyn FnMut(usize, usize),
) {
    run_block(Isa::Avx2, steps, inputs, start, out, scratch, between)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn run_block_avx512<T: Real + Arith>(
    steps: &[Step],
    inputs: &[Input<'_, T>],
    start: usize,
    out: &mut [T],
    scratch: &mut Scratch<T>,
    between: &mut dyn FnMut(usize, usize),
) {
    run_block(Isa::Avx512, steps, inputs, start, out, scratch, between)
}

/// Runs one block with the loops compiled for `isa`. Vector widths change
/// nothing in the results: every op is one IEEE operation per element
/// either way (no reassociation, no fused multiply-add).
fn run_block_on<T: Real + Arith>(
    isa: Isa,
    steps: &[Step],
    inputs: &[Input<'_, T>],
    start: usize,
    out: &mut [T],
    scratch: &mut Scratch<T>,
    between: &mut dyn FnMut(usize, usize),
) {
    match isa {
        Isa::Baseline => run_block(isa, steps, inputs, start, out, scratch, between),
        // SAFETY: `isa` chose this variant only after the CPU
        // reported AVX2, which is all `run_block_avx2` is compiled to use.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { run_block_avx2(steps, inputs, start, out, scratch, between) },
        // SAFETY: as above, for AVX-512F.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { run_block_avx512(steps, inputs, start, out, scratch, between) },
    }
}

/// How many blocks ahead inputs are prefetched.
const PREFETCH_AHEAD: usize = 2;

/// How many blocks ahead [`Program::stream_range`] prefetches its inputs.
const STREAM_AHEAD: usize = 4;

/// Prefetches the full inputs' elements `start..start + n` into L1 or L2
/// (`HINT`; see [`Input::prefetch`]).
fn prefetch_next<const HINT: i32, T: Copy>(inputs: &[Input<'_, T>], start: usize, n: usize) {
    for input in inputs {
        input.prefetch::<HINT>(start, n);
    }
}

/// A fused program ready to run: register-allocated steps and how many
/// register slots they use.
struct Program {
    steps: Vec<Step>,
    slots: usize,
}

impl Program {
    /// The program over `inputs` registers, planned for values of `dtype`.
    fn new(program: &[i64], inputs: usize, dtype: DType) -> Result<Program> {
        let chains = dtype == DType::F32 && isa() != Isa::Baseline;
        let (steps, slots, _) = allocate_registers(&decode_fused(program, inputs)?, inputs, chains);
        Ok(Program { steps, slots })
    }

    /// The inputs as the program reads them for an output of `out` shape.
    fn inputs<'a, T: Element>(
        inputs: &'a [DenseHostTensor],
        out: &stagecraft_tensor::Shape,
    ) -> Result<SmallVec<[Input<'a, T>; 8]>> {
        inputs
            .iter()
            .map(|t| {
                let how = fused_operand(t.shape(), out).ok_or_else(|| {
                    Error::internal(format!(
                        "a fused kernel cannot broadcast {} to {out}",
                        t.shape()
                    ))
                })?;
                Ok(Input::new(t.as_slice::<T>()?, how))
            })
            .collect()
    }

    /// Runs the program over the output elements `start..start + out.len()`
    /// in blocks, on the calling thread.
    fn run_range<T: Real + Arith>(
        &self,
        isa: Isa,
        inputs: &[Input<'_, T>],
        start: usize,
        out: &mut [T],
        scratch: &mut Scratch<T>,
    ) {
        for (b, block) in out.chunks_mut(BLOCK).enumerate() {
            let at = start + b * BLOCK;
            prefetch_next::<TO_L1, T>(inputs, at + PREFETCH_AHEAD * BLOCK, BLOCK);
            run_block_on(isa, &self.steps, inputs, at, block, scratch, &mut |_, _| {});
        }
    }

    /// [`Program::run_range`] for an output far larger than the caches,
    /// which both the loads and the stores wait on memory for. Each block
    /// is computed in L1 and written with non-temporal stores, and the
    /// memory traffic is spread over the computation instead of coming in
    /// bursts: while block `b` is computed, a slice per step of block
    /// `b - 1`'s results is streamed out and a slice of block
    /// `b + STREAM_AHEAD`'s inputs prefetched into L2. In bursts (a whole
    /// block's prefetches before it, its stores after it) the core's few
    /// line-fill buffers were full during the bursts and idle during the
    /// arithmetic: B3 on one core ran at 0.68 of a plain copy's speed;
    /// spread, it runs at 0.90–0.98.
    fn stream_range<T: Real + Arith>(
        &self,
        isa: Isa,
        inputs: &[Input<'_, T>],
        start: usize,
        out: &mut [T],
        scratch: &mut Scratch<T>,
    ) {
        let mut current = std::mem::take(&mut scratch.current);
        let mut previous = std::mem::take(&mut scratch.previous);
        current.resize(BLOCK, T::default());
        previous.resize(BLOCK, T::default());
        // The first blocks have no earlier block to prefetch them.
        prefetch_next::<TO_L2, T>(inputs, start, (STREAM_AHEAD * BLOCK).min(out.len()));
        let mut finished: Option<&mut [T]> = None;
        for (b, block) in out.chunks_mut(BLOCK).enumerate() {
            let at = start + b * BLOCK;
            let ahead = at + STREAM_AHEAD * BLOCK;
            let done = &previous;
            let mut finished_block = finished.take();
            let mut between = |step: usize, steps: usize| {
                let part = BLOCK.div_ceil(steps).next_multiple_of(16);
                let slice = (step * part).min(BLOCK)..((step + 1) * part).min(BLOCK);
                prefetch_next::<TO_L2, T>(inputs, ahead + slice.start, slice.len());
                if let Some(finished) = finished_block.as_deref_mut() {
                    let slice = slice.start.min(finished.len())..slice.end.min(finished.len());
                    stream_copy(isa, &mut finished[slice.clone()], &done[slice]);
                }
            };
            let staged = &mut current[..block.len()];
            run_block_on(isa, &self.steps, inputs, at, staged, scratch, &mut between);
            std::mem::swap(&mut current, &mut previous);
            finished = Some(block);
        }
        if let Some(last) = finished {
            let n = last.len();
            stream_copy(isa, last, &previous[..n]);
        }
        stream_fence(isa);
        scratch.current = current;
        scratch.previous = previous;
    }

    fn scratch<T: Copy + Default>(&self, inputs: usize, total: usize) -> Scratch<T> {
        Scratch::new(self.slots, inputs, BLOCK.min(total.max(1)))
    }
}

fn fused_typed<T: Real + Arith + Send + Sync>(
    program: &Program,
    inputs: &[DenseHostTensor],
    meta: &TensorMetadata,
) -> Result<DenseHostTensor> {
    let srcs = Program::inputs::<T>(inputs, &meta.shape)?;
    let mut out = DenseHostTensor::for_overwrite(meta.clone())?;
    let total = meta.shape.numel();
    let y = out.as_mut_slice::<T>()?;
    let isa = isa();
    let fresh = || program.scratch::<T>(srcs.len(), total);
    if total >= crate::PARALLEL_THRESHOLD {
        let stream = std::mem::size_of_val(y) >= STREAM_BYTES;
        // A streamed range starts and ends its pipeline (see
        // `stream_range`), so it takes longer ranges.
        let chunk_len = BLOCK * if stream { 64 } else { 16 };
        crate::pool::for_each_chunk_init(y, chunk_len, fresh, |scratch, c, chunk| {
            if stream {
                program.stream_range(isa, &srcs, c * chunk_len, chunk, scratch)
            } else {
                program.run_range(isa, &srcs, c * chunk_len, chunk, scratch)
            }
        });
    } else {
        program.run_range(isa, &srcs, 0, y, &mut fresh());
    }
    Ok(out)
}

fn fused_factory(attrs: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    let dtype = inputs[0].dtype;
    let program = Program::new(attrs.ints("program")?, inputs.len(), dtype)?;
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

/// A fused program as the source of a reduction: elements are computed on
/// request, a short run at a time, into per-thread scratch memory.
struct FusedSource<'a, T> {
    program: &'a Program,
    inputs: SmallVec<[Input<'a, T>; 8]>,
    isa: Isa,
}

/// Scratch memory of a [`FusedSource`]: the program's registers and the
/// computed run.
struct FusedScratch<T> {
    registers: Scratch<T>,
    values: Vec<T>,
}

impl<T: Real + Arith + Send + Sync> Source<T> for FusedSource<'_, T> {
    type Scratch = FusedScratch<T>;

    fn scratch(&self) -> FusedScratch<T> {
        FusedScratch {
            registers: self.program.scratch(self.inputs.len(), BLOCK),
            values: Vec::new(),
        }
    }

    fn read<'s>(&'s self, scratch: &'s mut FusedScratch<T>, start: usize, len: usize) -> &'s [T] {
        if scratch.values.len() < len {
            scratch.values.resize(len, T::default());
        }
        let values = &mut scratch.values[..len];
        self.program.run_range(
            self.isa,
            &self.inputs,
            start,
            values,
            &mut scratch.registers,
        );
        values
    }
}

fn fused_reduce_typed<T: Real + Arith + Send + Sync>(
    program: &Program,
    op: ReduceOp,
    axes: &[i64],
    inputs: &[DenseHostTensor],
    meta: &TensorMetadata,
) -> Result<DenseHostTensor> {
    // Shapes come from this call's inputs: a kernel serves every shape.
    let metas: SmallVec<[TensorMetadata; 8]> =
        inputs.iter().map(|t| t.metadata().clone()).collect();
    let values = fused_output(&metas)?;
    let axes = reduction_axes(axes, values.shape.rank())?;
    let source = FusedSource {
        program,
        inputs: Program::inputs::<T>(inputs, &values.shape)?,
        isa: isa(),
    };
    float_fold(op, &source, values.shape.dims(), &axes, meta)
}

fn fused_reduce_factory(attrs: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    let dtype = fused_output(inputs)?.dtype;
    let program = Program::new(attrs.ints("program")?, inputs.len(), dtype)?;
    let op = fused_reduce_op(attrs.int("reduce")?)?;
    let axes: SmallVec<[i64; 4]> = attrs.ints("axes")?.iter().copied().collect();
    Ok(Arc::new(
        move |inputs: Inputs, ctx: &KernelContext<'_>| -> Result<Outputs> {
            let meta = &ctx.outputs[0];
            Ok(smallvec![match dtype {
                DType::F32 => fused_reduce_typed::<f32>(&program, op, &axes, &inputs, meta)?,
                DType::F64 => fused_reduce_typed::<f64>(&program, op, &axes, &inputs, meta)?,
                other => return Err(Error::internal(format!("a fused kernel for {other}"))),
            }])
        },
    ))
}

/// The smallest output whose epilogue splits across threads when its
/// product did not. Below this, forking costs about what it saves: the MLP
/// backward's 128×256 masked product took 17.8 µs split, 15.2 serial.
const EPILOGUE_PARALLEL_MIN: usize = 4 * crate::PARALLEL_THRESHOLD;

/// A matmul epilogue over the product's values in place, block by block:
/// each block is copied aside (in L1) and the program writes the block
/// back, so the product is read and written once, while in cache. `first`
/// is the index of `values[0]` in the whole product, which places the
/// broadcast inputs.
fn epilogue_in_place<T: Real + Arith + Send + Sync>(
    program: &Program,
    externals: &[Input<'_, T>],
    total: usize,
    (first, values, may_split): (usize, &mut [T], bool),
) {
    let isa = isa();
    let run = |first: usize, chunk: &mut [T], state: &mut (Scratch<T>, Vec<T>)| {
        let (scratch, aside) = state;
        for (b, block) in chunk.chunks_mut(BLOCK).enumerate() {
            let start = first + b * BLOCK;
            let n = block.len();
            aside[..n].copy_from_slice(block);
            let mut inputs: SmallVec<[Input<'_, T>; 8]> =
                smallvec![Input::Offset(&aside[..n], start)];
            inputs.extend(externals.iter().copied());
            run_block_on(
                isa,
                &program.steps,
                &inputs,
                start,
                block,
                scratch,
                &mut |_, _| {},
            );
        }
    };
    let aside = BLOCK.min(values.len().max(1));
    let fresh = || {
        (
            program.scratch::<T>(externals.len() + 1, total),
            vec![T::default(); aside],
        )
    };
    if may_split && values.len() >= EPILOGUE_PARALLEL_MIN {
        crate::pool::for_each_chunk_init(values, BLOCK * 16, fresh, |state, c, chunk| {
            run(first + c * BLOCK * 16, chunk, state)
        });
    } else {
        run(first, values, &mut fresh());
    }
}

fn fused_matmul_typed<T: Real + Arith + GemmElement + Send + Sync>(
    program: &Program,
    inputs: &[DenseHostTensor],
    meta: &TensorMetadata,
    transposes: (bool, bool),
) -> Result<DenseHostTensor> {
    let [a, b, rest @ ..] = inputs else {
        return Err(Error::internal("FusedMatMul without its operands"));
    };
    let externals = Program::inputs::<T>(rest, &meta.shape)?;
    let total = meta.shape.numel();
    // Each band of the product gets its epilogue on the thread that
    // computed it, while it is in that core's cache.
    let epilogue = |first: usize, values: &mut [T], may_split: bool| {
        epilogue_in_place(program, &externals, total, (first, values, may_split))
    };
    matmul_with_epilogue::<T>(a, b, meta, transposes, &epilogue)
}

fn fused_matmul_factory(attrs: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    // Registers: the product, then the inputs after a and b.
    let transposes = stagecraft_ops::matmul_transposes(attrs)?;
    let dtype = inputs[0].dtype;
    let program = Program::new(
        attrs.ints("program")?,
        inputs.len().saturating_sub(1),
        dtype,
    )?;
    Ok(Arc::new(
        move |inputs: Inputs, ctx: &KernelContext<'_>| -> Result<Outputs> {
            let meta = &ctx.outputs[0];
            Ok(smallvec![match dtype {
                DType::F32 => fused_matmul_typed::<f32>(&program, &inputs, meta, transposes)?,
                DType::F64 => fused_matmul_typed::<f64>(&program, &inputs, meta, transposes)?,
                other => return Err(Error::internal(format!("a fused matmul for {other}"))),
            }])
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every instruction set this CPU has, baseline first.
    fn isas_here() -> Vec<Isa> {
        let mut isas = vec![Isa::Baseline];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                isas.push(Isa::Avx2);
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                isas.push(Isa::Avx512);
            }
        }
        isas
    }

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
            // x > k as 1 or 0 (NaN: 0), times the result so far.
            FusedInstr::Compare(CompareOp::Gt, 0, 1),
            FusedInstr::Binary(BinaryOp::Mul, 7, 8),
        ];
        let program = allocate_registers(&program, 2, false);
        let n = 1000;
        let x: Vec<f32> = (0..n)
            .map(|i| match i % 7 {
                0 => f32::NAN,
                1 => -0.0,
                2 => f32::INFINITY,
                _ => (i as f32 - 500.0) / 37.0,
            })
            .collect();
        let inputs = [Input::Full(&x[..]), Input::Scalar(-1.5f32)];
        let run = |isa: Isa| {
            let mut scratch = Scratch::new(program.1, inputs.len(), n);
            let mut out = vec![0.0f32; n];
            run_block_on(
                isa,
                &program.0,
                &inputs,
                0,
                &mut out,
                &mut scratch,
                &mut |_, _| {},
            );
            out.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
        };
        let baseline = run(Isa::Baseline);
        // The comparison is exact: where x is NaN or not above k, 0 times
        // the rest (itself NaN where x is, so check a finite case).
        let at = 3; // x = (3 - 500) / 37 < -1.5
        assert_eq!(f32::from_bits(baseline[at]), 0.0);
        assert_ne!(f32::from_bits(baseline[605]), 0.0); // x = 105 / 37 > k
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                assert_eq!(run(Isa::Avx2), baseline);
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                assert_eq!(run(Isa::Avx512), baseline);
            }
        }
        assert_eq!(run(isa()), baseline);
    }

    /// A fused program's lone unary or binary step gives the bits of the
    /// op's eager kernel, for every float op of the tables, on every
    /// instruction set this CPU has, over blocks long enough for the vector
    /// loops (and a tail). The steps call each op's definition inlined into
    /// the loop compiled for the instruction set; through a function
    /// pointer, GELU ran one scalar call per element and
    /// would still pass this test: the speed is the `gpt_step` bench's
    /// `lazy-forward` row.
    #[test]
    fn each_elementwise_step_gives_its_eager_kernels_bits_on_every_instruction_set() {
        use crate::kernels::elementwise::tests::{run as eager, tensor};
        let n = if cfg!(miri) { 70 } else { 1000 };
        let xs: Vec<f64> = (0..n)
            .map(|i| match i % 11 {
                0 => f64::NAN,
                1 => -0.0,
                2 => f64::INFINITY,
                3 => f64::NEG_INFINITY,
                _ => (i as f64 - n as f64 / 2.0) / 37.0,
            })
            .collect();
        let ys: Vec<f64> = (0..n).map(|i| 0.5 + (i % 13) as f64 / 5.0).collect();
        let isas = isas_here();
        fn fused_bits<T: Real + Arith + Element>(
            isa: Isa,
            step: FusedInstr,
            inputs: &[&DenseHostTensor],
        ) -> Vec<u64> {
            let n = inputs[0].numel();
            let program = allocate_registers(&[step], inputs.len(), false);
            let slices: Vec<Input<'_, T>> = inputs
                .iter()
                .map(|t| Input::Full(t.as_slice::<T>().unwrap()))
                .collect();
            let mut scratch = Scratch::new(program.1, slices.len(), n);
            let mut out = vec![T::narrow(0.0); n];
            run_block_on(
                isa,
                &program.0,
                &slices,
                0,
                &mut out,
                &mut scratch,
                &mut |_, _| {},
            );
            out.iter()
                .map(|v| stagecraft_ops::scalar::Num::to_f64(*v).to_bits())
                .collect()
        }
        let bits = |t: &DenseHostTensor| -> Vec<u64> {
            crate::kernels::elementwise::tests::values(t)
                .iter()
                .map(|v| v.to_bits())
                .collect()
        };
        let none = stagecraft_ops::OpAttrs::new();
        for dtype in [DType::F32, DType::F64] {
            let x = tensor(dtype, &xs, &[n]);
            let y = tensor(dtype, &ys, &[n]);
            let check =
                |name: &str, step: FusedInstr, inputs: &[&DenseHostTensor], want: &[u64]| {
                    for &isa in &isas {
                        let got = match dtype {
                            DType::F32 => fused_bits::<f32>(isa, step, inputs),
                            _ => fused_bits::<f64>(isa, step, inputs),
                        };
                        // NaNs may differ in payload, never in being NaN.
                        for (i, (g, w)) in got.iter().zip(want).enumerate() {
                            let (g, w) = (f64::from_bits(*g), f64::from_bits(*w));
                            assert!(
                                g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                                "{name} {dtype} on {isa:?}: [{i}] = {g:e}, eager {w:e}"
                            );
                        }
                    }
                };
            for &op in UnaryOp::ALL {
                if !op.class().accepts(dtype) {
                    continue;
                }
                let want = bits(&eager(op.def(), vec![x.clone()], &none).unwrap());
                check(op.def().name, FusedInstr::Unary(op, 0), &[&x], &want);
            }
            for &op in BinaryOp::ALL {
                if !op.class().accepts(dtype) {
                    continue;
                }
                let want = bits(&eager(op.def(), vec![x.clone(), y.clone()], &none).unwrap());
                check(
                    op.def().name,
                    FusedInstr::Binary(op, 0, 1),
                    &[&x, &y],
                    &want,
                );
            }
        }
    }

    /// A bias over rows (tile) and a value per row (repeat) are spread
    /// correctly across block boundaries that do not line up with rows,
    /// and a row longer than a block gives blocks inside one row (read as
    /// one value) and blocks across two.
    #[test]
    fn broadcast_inputs_are_spread_per_block() {
        // 1961 elements: two blocks, misaligned; then rows of 1500.
        for (rows, cols) in [(37, 53), (3, 1500)] {
            check_broadcast_inputs(rows, cols);
        }
    }

    fn check_broadcast_inputs(rows: usize, cols: usize) {
        let x: Vec<f64> = (0..rows * cols).map(|i| i as f64 * 0.5).collect();
        let bias: Vec<f64> = (0..cols).map(|j| j as f64 * 100.0).collect();
        let per_row: Vec<f64> = (0..rows).map(|r| r as f64 * 10_000.0).collect();
        let shape = |d: &[usize]| stagecraft_tensor::Shape::new(d);
        let tensors = [
            DenseHostTensor::from_slice(&x, shape(&[rows, cols])).unwrap(),
            DenseHostTensor::from_slice(&bias, shape(&[cols])).unwrap(),
            DenseHostTensor::from_slice(&per_row, shape(&[rows, 1])).unwrap(),
        ];
        // (x + bias) - per_row
        let code = |op: BinaryOp| {
            stagecraft_ops::FUSED_BINARY_BASE
                + stagecraft_ops::FUSED_BINARY
                    .iter()
                    .position(|b| *b == op)
                    .unwrap() as i64
        };
        let program = Program::new(
            &[code(BinaryOp::Add), 0, 1, code(BinaryOp::Sub), 3, 2],
            3,
            DType::F64,
        )
        .unwrap();
        let meta = TensorMetadata::new(DType::F64, [rows, cols]);
        let out = fused_typed::<f64>(&program, &tensors, &meta).unwrap();
        let got = out.as_slice::<f64>().unwrap();
        for r in 0..rows {
            for c in 0..cols {
                let want = (x[r * cols + c] + bias[c]) - per_row[r];
                assert_eq!(got[r * cols + c], want, "row {r} col {c}");
            }
        }
    }

    /// The pipelined path for outputs beyond the caches (stores one block
    /// behind, prefetches ahead) writes exactly what the plain path does:
    /// ranges of whole and partial blocks, starting mid-input, and a whole
    /// output large enough to take it in parallel.
    #[test]
    fn streamed_ranges_equal_plain_ranges() {
        // ((x * k) + x) max 0, with k a scalar.
        let program = vec![
            FusedInstr::Binary(BinaryOp::Mul, 0, 1),
            FusedInstr::Binary(BinaryOp::Add, 2, 0),
            FusedInstr::Unary(UnaryOp::Relu, 3),
        ];
        let (steps, slots, _) = allocate_registers(&program, 2, true);
        let program = Program { steps, slots };
        // Under Miri the output stops short of the streamed size (the
        // ranges below call the streaming path directly) and the longest
        // range is shorter: still whole and partial blocks, from mid-input.
        let (n, long) = if cfg!(miri) {
            (3 * BLOCK + 17, BLOCK + 100)
        } else {
            ((STREAM_BYTES / 4) + 3 * BLOCK + 17, 7 * BLOCK + 100)
        };
        let x: Vec<f32> = (0..n).map(|i| ((i % 1013) as f32 - 400.0) / 7.0).collect();
        let inputs = [Input::Full(&x[..]), Input::Scalar(-0.75f32)];
        let isa = isa();
        let plain = |start: usize, len: usize| {
            let mut out = vec![0.0f32; len];
            let mut scratch = program.scratch::<f32>(2, len);
            program.run_range(isa, &inputs, start, &mut out, &mut scratch);
            out
        };
        for (start, len) in [(0, 1), (5, BLOCK), (BLOCK + 3, long), (0, 3 * BLOCK)] {
            let mut out = vec![f32::NAN; len];
            let mut scratch = program.scratch::<f32>(2, len);
            program.stream_range(isa, &inputs, start, &mut out, &mut scratch);
            assert_eq!(out, plain(start, len), "range {start}..+{len}");
        }
        let tensors = [
            DenseHostTensor::from_slice(&x, stagecraft_tensor::Shape::new(&[n])).unwrap(),
            DenseHostTensor::from_slice(&[-0.75f32], stagecraft_tensor::Shape::new(&[])).unwrap(),
        ];
        let meta = TensorMetadata::new(DType::F32, [n]);
        let whole = fused_typed::<f32>(&program, &tensors, &meta).unwrap();
        assert!(whole.as_slice::<f32>().unwrap() == plain(0, n).as_slice());
    }

    /// Streamed copies equal plain ones at every alignment and length,
    /// on every instruction set this CPU has.
    #[test]
    fn streamed_copies_equal_plain_copies() {
        let src: Vec<f32> = (0..1000).map(|i| i as f32 * 1.5 - 7.0).collect();
        let isas = isas_here();
        for isa in isas {
            for pick in 0..5 {
                for len in [0, 1, 15, 16, 17, 100, 977] {
                    let mut dst = vec![0.0f32; 1000];
                    // Element offsets of a 64-byte boundary and its
                    // neighbours, so the streaming paths run.
                    let aligned = (64 - dst.as_ptr() as usize % 64) % 64 / 4;
                    let offset = [0, 1, aligned, aligned + 8, aligned + 3][pick].min(1000 - len);
                    stream_copy(isa, &mut dst[offset..offset + len], &src[..len]);
                    stream_fence(isa);
                    assert_eq!(&dst[offset..offset + len], &src[..len]);
                    assert!(dst[..offset].iter().all(|&v| v == 0.0));
                    assert!(dst[offset + len..].iter().all(|&v| v == 0.0));
                }
            }
        }
    }
}
