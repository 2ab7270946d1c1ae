//! A Cranelift code generator for fused f32 programs.
//!
//! The generated function is
//! `extern "C" fn(inputs: *const *const f32, out: *mut f32, n: usize)`:
//! `inputs[k]` points at input k's first element (one element for a rank-0
//! input, which is broadcast). It runs one loop over the elements, four at
//! a time in f32x4 vectors (`unroll` vectors per trip), then a scalar
//! tail; every intermediate stays in a machine register, so nothing but the
//! inputs and the output touches memory.
//!
//! Why f32x4 and not wider: Cranelift's x86-64 backend lowers 128-bit
//! vector types only (it exists for Wasm SIMD); with AVX present it uses
//! the VEX encodings of the same 128-bit instructions. AVX2's 8 lanes and
//! AVX-512's 16, which the interpreter's loops use, are out of reach.
//!
//! Results are bit-identical to the interpreter's: add, sub, mul, div and
//! sqrt are one IEEE operation per element either way, and relu, maximum
//! and minimum are built from compares and selects that reproduce
//! stagecraft's definitions exactly, NaNs and signed zeros included:
//! `maximum(a, b) = if a > b || a is NaN { a } else { b }` (so it is not
//! Cranelift's `fmax`, which differs on NaN payloads and on -0 vs +0).

use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::{types, AbiParam, Block, BlockArg, InstBuilder, MemFlagsData, Value};
use cranelift_codegen::isa::TargetFrontendConfig;
use cranelift_codegen::settings::{self, Configurable};
use cranelift_frontend::{FunctionBuilder, FunctionBuilderContext};
use cranelift_jit::{JITBuilder, JITModule};
use cranelift_module::{default_libcall_names, Linkage, Module};
use rayon::prelude::*;
use smallvec::SmallVec;
use stagecraft_ops::{decode_fused, BinaryOp, FusedInstr, UnaryOp};
use stagecraft_tensor::{DenseHostTensor, TensorMetadata};

/// The generated function's type.
pub type FusedFn = unsafe extern "C" fn(*const *const f32, *mut f32, usize);

/// Lanes in one f32x4 vector.
const LANES: usize = 4;

/// Code generation choices.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// Vectors computed per loop trip (1, 2, 4, ...), to spread the loop's
    /// own overhead over more elements.
    pub unroll: usize,
    /// Run Cranelift's IR verifier (on in tests; a runtime would turn it off).
    pub verify: bool,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            unroll: 2,
            verify: false,
        }
    }
}

/// A compiled program; the code lives as long as this value.
pub struct Compiled {
    // `Option` so that `Drop` can take the module to free its memory.
    module: Option<JITModule>,
    func: FusedFn,
    inputs: usize,
}

impl Drop for Compiled {
    fn drop(&mut self) {
        if let Some(module) = self.module.take() {
            // SAFETY: `func` points into this module's memory and is only
            // reachable through `self`, which is being dropped, so no call
            // can use the code after it is freed.
            unsafe { module.free_memory() };
        }
    }
}

impl Compiled {
    /// Runs the program over `n` elements.
    ///
    /// # Safety
    /// `inputs` must hold one pointer per program input; a pointer for a
    /// rank-0 input must be valid for reading one f32 and any other for
    /// reading `n`; `out` must be valid for writing `n` f32s and overlap no
    /// input.
    pub unsafe fn call(&self, inputs: &[*const f32], out: *mut f32, n: usize) {
        debug_assert_eq!(inputs.len(), self.inputs);
        // SAFETY: the code was generated for exactly this signature, and
        // the caller vouches for the pointers.
        unsafe { (self.func)(inputs.as_ptr(), out, n) }
    }
}

/// A program the code generator cannot handle.
#[derive(Debug)]
pub struct Unsupported(pub String);

impl std::fmt::Display for Unsupported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Unsupported {}

fn err(e: impl std::fmt::Display) -> Unsupported {
    Unsupported(e.to_string())
}

/// Checks that every op has a lowering here. Transcendentals (exp, tanh,
/// ...) are evaluated in f64 by the interpreter; matching those bits would
/// mean calling out to the same libm functions per element, which this
/// experiment leaves out.
fn check(program: &[FusedInstr]) -> Result<(), Unsupported> {
    for instr in program {
        let ok = match *instr {
            FusedInstr::Unary(op, _) => matches!(
                op,
                UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Sqrt | UnaryOp::Relu
            ),
            FusedInstr::Binary(op, _, _) => matches!(
                op,
                BinaryOp::Add
                    | BinaryOp::Sub
                    | BinaryOp::Mul
                    | BinaryOp::Div
                    | BinaryOp::Maximum
                    | BinaryOp::Minimum
            ),
            FusedInstr::Compare(..) => false,
        };
        if !ok {
            return Err(Unsupported(format!("no lowering for {instr:?}")));
        }
    }
    Ok(())
}

/// A fresh JIT module for the host CPU (all the features it reports,
/// AVX included), optimizing for speed.
pub fn new_module(verify: bool) -> Result<JITModule, Unsupported> {
    let mut flags = settings::builder();
    flags.set("opt_level", "speed").map_err(err)?;
    flags
        .set("enable_verifier", if verify { "true" } else { "false" })
        .map_err(err)?;
    let isa = cranelift_native::builder()
        .map_err(err)?
        .finish(settings::Flags::new(flags))
        .map_err(err)?;
    Ok(JITModule::new(JITBuilder::with_isa(
        isa,
        default_libcall_names(),
    )))
}

/// Compiles `program` (decoded; registers `0..scalar.len()` are the inputs,
/// `scalar[k]` says input k is rank 0) in a fresh module.
pub fn compile(
    program: &[FusedInstr],
    scalar: &[bool],
    options: Options,
) -> Result<Compiled, Unsupported> {
    check(program)?;
    let mut module = new_module(options.verify)?;
    let config = module.target_config();
    let ptr = config.pointer_type();
    let mut ctx = module.make_context();
    for _ in 0..3 {
        ctx.func.signature.params.push(AbiParam::new(ptr));
    }
    let mut fctx = FunctionBuilderContext::new();
    build(
        FunctionBuilder::new(&mut ctx.func, &mut fctx),
        program,
        scalar,
        options.unroll.max(1),
        config,
    );
    let id = module
        .declare_function("fused", Linkage::Export, &ctx.func.signature)
        .map_err(err)?;
    // FUSED_CODEGEN_DISASM=1 prints the machine code (to judge its quality).
    let disasm = std::env::var_os("FUSED_CODEGEN_DISASM").is_some();
    ctx.set_disasm(disasm);
    module.define_function(id, &mut ctx).map_err(err)?;
    if let Some(code) = ctx.compiled_code().and_then(|c| c.vcode.as_ref()) {
        eprintln!("{code}");
    }
    module.clear_context(&mut ctx);
    module.finalize_definitions().map_err(err)?;
    let code = module.get_finalized_function(id);
    // SAFETY: `code` is the finalized (executable) body of the function
    // just defined with three pointer-sized parameters and no result in
    // the ISA's default calling convention, which is the host's C one:
    // exactly `FusedFn`.
    let func = unsafe { std::mem::transmute::<*const u8, FusedFn>(code) };
    Ok(Compiled {
        module: Some(module),
        func,
        inputs: scalar.len(),
    })
}

/// An input as the loop body sees it.
#[derive(Clone, Copy)]
enum Src {
    /// A pointer to the input's first element.
    Slice(Value),
    /// The broadcast value, as an f32 and as an f32x4, loaded once before
    /// the loop.
    Scalar { one: Value, four: Value },
}

/// Constants the ops need, made once before the loop.
#[derive(Clone, Copy)]
struct Consts {
    zero1: Value,
    zero4: Value,
}

/// Emits the whole function.
fn build(
    mut b: FunctionBuilder<'_>,
    program: &[FusedInstr],
    scalar: &[bool],
    unroll: usize,
    config: TargetFrontendConfig,
) {
    let ptr = config.pointer_type();
    // Data accesses: never trap (the caller vouches for the pointers), but
    // not known to be 16-byte aligned, so loads are not folded into SSE
    // instructions that would require it.
    let data = MemFlagsData::new().with_notrap();
    let entry = b.create_block();
    let vloop = b.create_block();
    let tail_check = b.create_block();
    let tail = b.create_block();
    let exit = b.create_block();
    b.append_block_params_for_function_params(entry);
    b.append_block_param(vloop, ptr);
    b.append_block_param(tail_check, ptr);
    b.append_block_param(tail, ptr);

    b.switch_to_block(entry);
    let params = b.block_params(entry).to_vec();
    let (inputs, out, n) = (params[0], params[1], params[2]);
    let srcs: Vec<Src> = scalar
        .iter()
        .enumerate()
        .map(|(k, &is_scalar)| {
            let p = b
                .ins()
                .load(ptr, MemFlagsData::trusted(), inputs, (8 * k) as i32);
            if is_scalar {
                let one = b.ins().load(types::F32, data, p, 0);
                let four = b.ins().splat(types::F32X4, one);
                Src::Scalar { one, four }
            } else {
                Src::Slice(p)
            }
        })
        .collect();
    let zero1 = b.ins().f32const(0.0);
    let zero4 = b.ins().splat(types::F32X4, zero1);
    let consts = Consts { zero1, zero4 };
    let step = (LANES * unroll) as i64;
    // Elements the vector loop covers: n rounded down to a whole trip.
    let nvec = b.ins().band_imm_s(n, -step);
    let start = b.ins().iconst(ptr, 0);
    let has_vectors = b.ins().icmp_imm_s(IntCC::NotEqual, nvec, 0);
    branch(&mut b, has_vectors, vloop, start, tail_check, start);

    // The vector loop: `unroll` f32x4 results per trip.
    b.switch_to_block(vloop);
    let i = b.block_params(vloop)[0];
    let offset = b.ins().ishl_imm_u(i, 2);
    let dst = b.ins().iadd(out, offset);
    for u in 0..unroll {
        let disp = (16 * u) as i32;
        let result = body(&mut b, program, &srcs, consts, offset, disp, true);
        b.ins().store(data, result, dst, disp);
    }
    let next = b.ins().iadd_imm_s(i, step);
    let more = b.ins().icmp(IntCC::UnsignedLessThan, next, nvec);
    branch(&mut b, more, vloop, next, tail_check, next);

    // The scalar tail: fewer than `step` elements, one at a time.
    b.switch_to_block(tail_check);
    let i = b.block_params(tail_check)[0];
    let left = b.ins().icmp(IntCC::UnsignedLessThan, i, n);
    b.ins().brif(left, tail, &[BlockArg::Value(i)], exit, &[]);

    b.switch_to_block(tail);
    let i = b.block_params(tail)[0];
    let offset = b.ins().ishl_imm_u(i, 2);
    let result = body(&mut b, program, &srcs, consts, offset, 0, false);
    let dst = b.ins().iadd(out, offset);
    b.ins().store(data, result, dst, 0);
    let next = b.ins().iadd_imm_s(i, 1);
    b.ins().jump(tail_check, &[BlockArg::Value(next)]);

    b.switch_to_block(exit);
    b.ins().return_(&[]);
    b.seal_all_blocks();
    b.finalize(config);
}

/// `brif cond, yes(a), no(b)`.
fn branch(b: &mut FunctionBuilder<'_>, cond: Value, yes: Block, a: Value, no: Block, c: Value) {
    b.ins()
        .brif(cond, yes, &[BlockArg::Value(a)], no, &[BlockArg::Value(c)]);
}

/// Emits the program for the elements at byte `offset + disp` of every
/// tensor input, as f32x4 (`vector`) or f32, and returns the result.
fn body(
    b: &mut FunctionBuilder<'_>,
    program: &[FusedInstr],
    srcs: &[Src],
    consts: Consts,
    offset: Value,
    disp: i32,
    vector: bool,
) -> Value {
    let ty = if vector { types::F32X4 } else { types::F32 };
    let data = MemFlagsData::new().with_notrap();
    // Every register of the program as an SSA value: Cranelift's register
    // allocator decides what stays in machine registers.
    let mut regs: Vec<Value> = Vec::with_capacity(srcs.len() + program.len());
    for src in srcs {
        regs.push(match *src {
            Src::Slice(p) => {
                let addr = b.ins().iadd(p, offset);
                b.ins().load(ty, data, addr, disp)
            }
            Src::Scalar { one, four } => {
                if vector {
                    four
                } else {
                    one
                }
            }
        });
    }
    let zero = if vector { consts.zero4 } else { consts.zero1 };
    for instr in program {
        let v = match *instr {
            FusedInstr::Unary(op, a) => {
                let x = regs[a];
                match op {
                    UnaryOp::Neg => b.ins().fneg(x),
                    UnaryOp::Abs => b.ins().fabs(x),
                    UnaryOp::Sqrt => b.ins().sqrt(x),
                    // relu(x) = x if x > 0 or x is NaN, else +0: one
                    // "unordered or greater" compare.
                    UnaryOp::Relu => {
                        let keep = b.ins().fcmp(FloatCC::UnorderedOrGreaterThan, x, zero);
                        pick(b, keep, x, zero, vector)
                    }
                    _ => unreachable!("rejected by `check`"),
                }
            }
            FusedInstr::Binary(op, a, c) => {
                let (x, y) = (regs[a], regs[c]);
                match op {
                    BinaryOp::Add => b.ins().fadd(x, y),
                    BinaryOp::Sub => b.ins().fsub(x, y),
                    BinaryOp::Mul => b.ins().fmul(x, y),
                    BinaryOp::Div => b.ins().fdiv(x, y),
                    // x if x > y or x is NaN, else y (y's NaN included).
                    BinaryOp::Maximum | BinaryOp::Minimum => {
                        let cc = if op == BinaryOp::Maximum {
                            FloatCC::GreaterThan
                        } else {
                            FloatCC::LessThan
                        };
                        let wins = b.ins().fcmp(cc, x, y);
                        let nan = b.ins().fcmp(FloatCC::Unordered, x, x);
                        let keep = b.ins().bor(wins, nan);
                        pick(b, keep, x, y, vector)
                    }
                    _ => unreachable!("rejected by `check`"),
                }
            }
            FusedInstr::Compare(..) => unreachable!("rejected by `check`"),
        };
        regs.push(v);
    }
    regs[regs.len() - 1]
}

/// `if keep { x } else { y }`, lane by lane: a vector compare gives an
/// all-ones or all-zeros mask per lane, a scalar one a boolean.
fn pick(b: &mut FunctionBuilder<'_>, keep: Value, x: Value, y: Value, vector: bool) -> Value {
    if vector {
        let mask = b.ins().bitcast(
            types::F32X4,
            MemFlagsData::new().with_endianness(cranelift_codegen::ir::Endianness::Little),
            keep,
        );
        b.ins().bitselect(mask, x, y)
    } else {
        b.ins().select(keep, x, y)
    }
}

/// Elements per parallel task: the interpreter's 16 blocks of 1,024.
pub const CHUNK: usize = 1024 * 16;

/// A compiled program wrapped like the runtime's kernel: it allocates its
/// output the same way (the buffer pool) and splits work across the rayon
/// pool from the same size and in the same chunks.
pub struct JitKernel {
    pub compiled: Compiled,
    output: TensorMetadata,
}

impl JitKernel {
    /// Decodes and compiles `program` for inputs of `metas`.
    pub fn new(
        program: &[i64],
        metas: &[TensorMetadata],
        options: Options,
    ) -> Result<JitKernel, Unsupported> {
        let decoded = decode_fused(program, metas.len()).map_err(err)?;
        let scalar: Vec<bool> = metas.iter().map(|m| m.shape.rank() == 0).collect();
        let compiled = compile(&decoded, &scalar, options)?;
        let shape = metas
            .iter()
            .map(|m| m.shape.clone())
            .find(|s| s.rank() > 0)
            .unwrap_or_default();
        Ok(JitKernel {
            compiled,
            output: TensorMetadata::new(stagecraft_tensor::DType::F32, shape),
        })
    }

    /// Runs the program once into a fresh output.
    pub fn run(&self, inputs: &[DenseHostTensor]) -> stagecraft_tensor::Result<DenseHostTensor> {
        let srcs: Vec<(&[f32], bool)> = inputs
            .iter()
            .map(|t| Ok((t.as_slice::<f32>()?, t.shape().rank() == 0)))
            .collect::<stagecraft_tensor::Result<_>>()?;
        let mut out = DenseHostTensor::for_overwrite(self.output.clone())?;
        let total = self.output.shape.numel();
        let y = out.as_mut_slice::<f32>()?;
        // The bare function pointer crosses threads; `JITModule` is not
        // `Sync` (a runtime caching such kernels behind `Arc<dyn Fn + Sync>`
        // would need a wrapper that owns the code memory alone). The code
        // stays valid because `self` outlives this call.
        let func = self.compiled.func;
        let run = |start: usize, chunk: &mut [f32]| {
            let ptrs: SmallVec<[*const f32; 8]> = srcs
                .iter()
                .map(|&(s, is_scalar)| {
                    if is_scalar {
                        s.as_ptr()
                    } else {
                        s[start..start + chunk.len()].as_ptr()
                    }
                })
                .collect();
            // SAFETY: one pointer per input (the kernel was compiled for
            // these metadata); a rank-0 input has its one element, every
            // other input has the chunk's elements (the shapes match the
            // output's, checked by the slicing above); `chunk` is a
            // distinct, freshly allocated output; `func` was generated for
            // exactly this signature and its module lives in `self`.
            unsafe { func(ptrs.as_ptr(), chunk.as_mut_ptr(), chunk.len()) }
        };
        if total >= stagecraft_cpu::PARALLEL_THRESHOLD {
            y.par_chunks_mut(CHUNK)
                .enumerate()
                .for_each(|(c, chunk)| run(c * CHUNK, chunk));
        } else {
            run(0, y);
        }
        Ok(out)
    }
}
