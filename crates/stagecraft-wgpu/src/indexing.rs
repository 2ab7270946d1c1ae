//! Indexing and fused kernels: gathers and scatters, arg-reductions,
//! concatenation, one-hot, running sums, triangular masks, and fused
//! elementwise programs compiled to one shader each.
//!
//! Indices are read on the host before a launch (a download, which waits
//! for the queue): an index out of range sends the op to the CPU, whose
//! kernel reports it, so no shader here reads or writes outside a tensor.
//! i32 and i64 indices are both read as one 32-bit word, the low word of
//! an i64, which the host check makes the whole value.
//!
//! WGSL has no float atomics, and the CPU's adds are defined in the order
//! of the source: in scatter-add and index-add each output element is
//! owned by one thread, which adds its contributions in that order, so the
//! sums are the CPU's bit for bit.

use crate::context::Gpu;
use crate::kernels::{grid, launch, one, single, small, strides_of, too_large, Outputs};
use crate::registry::{kernel, rules, Accepts, GpuKernel};
use crate::shader::{Element, MAX_RANK, PRELUDE, WORKGROUP};
use stagecraft_ops::{decode_fused, defs, fused_operand, Attrs, FusedInstr, FusedOperand};
use stagecraft_tensor::{normalize_axis, DType, DeviceTensor, Result, TensorMetadata};

/// The entries of this family, each of one output. Index tensors are i32
/// or i64; the launches check the indices themselves on the host.
pub(crate) fn register(table: &mut Vec<GpuKernel>) {
    use Accepts::{AllF32, Exactly, Rule};
    use DType::{F32, I32, I64};
    table.extend([
        kernel(&defs::FUSED_ELEMENTWISE, AllF32, |g, _, a, i, o| {
            single(o, |out| fused_launch(g, a, i, out))
        }),
        kernel(&defs::GATHER, Rule(gather_dtypes), |g, _, a, i, o| {
            single(o, |out| gather_launch(g, a, i, out))
        }),
        kernel(
            &defs::GATHER_ELEMENTS,
            Rule(gather_dtypes),
            |g, _, a, i, o| single(o, |out| gather_elements_launch(g, a, i, out)),
        ),
    ]);
    // (x, indices, src): the adds are f32's.
    for dtypes in [&[F32, I32, F32], &[F32, I64, F32]] {
        table.extend([
            kernel(&defs::SCATTER_ADD, Exactly(dtypes), |g, _, a, i, o| {
                single(o, |out| scatter_add_launch(g, a, i, out))
            }),
            kernel(&defs::INDEX_ADD, Exactly(dtypes), |g, _, a, i, o| {
                single(o, |out| index_add_launch(g, a, i, out))
            }),
        ]);
    }
    for x in [&[F32], &[I32]] {
        table.extend([
            kernel(&defs::ARGMAX, Exactly(x), |g, _, a, i, o| {
                single(o, |out| arg_launch(g, true, a, i[0], out))
            }),
            kernel(&defs::ARGMIN, Exactly(x), |g, _, a, i, o| {
                single(o, |out| arg_launch(g, false, a, i[0], out))
            }),
        ]);
    }
    table.push(kernel(
        &defs::CONCAT,
        Rule(concat_dtypes),
        |g, _, a, i, o| single(o, |out| concat_launch(g, a, i, out)),
    ));
    for indices in [&[I32], &[I64]] {
        table.push(kernel(&defs::ONE_HOT, Exactly(indices), |g, _, a, i, o| {
            single(o, |out| one_hot_launch(g, a, i[0], out))
        }));
    }
    table.extend([
        kernel(&defs::CUMSUM, AllF32, |g, _, a, i, o| {
            single(o, |out| cumsum_launch(g, a, i[0], out))
        }),
        kernel(&defs::TRILU, Rule(trilu_dtypes), |g, _, a, i, o| {
            single(o, |out| trilu_launch(g, a, i[0], out))
        }),
    ]);
}

/// Gathers: elements of one or two words, indices i32 or i64.
fn gather_dtypes(dtypes: &[DType]) -> bool {
    matches!(dtypes, [x, indices] if rules::words(*x) && rules::index(*indices))
}

/// Concatenations of elements of one or two words.
fn concat_dtypes(dtypes: &[DType]) -> bool {
    !dtypes.is_empty() && dtypes.iter().all(|&d| rules::words(d))
}

/// Triangles of elements of 1, 2, 4 or 8 bytes.
fn trilu_dtypes(dtypes: &[DType]) -> bool {
    matches!(dtypes, [x] if matches!(x.size_in_bytes(), 1 | 2 | 4 | 8))
}

// ------------------------------------------------------------ shared parts

/// The entry point of a one-thread-per-item kernel: `params[0]` items,
/// `params[1]` the grid's row width in threads (see [`launch_flat`]); the
/// body sees the item as `i`.
fn flat_main(body: &str) -> String {
    format!(
        r#"
@compute @workgroup_size({WORKGROUP})
fn main(@builtin(global_invocation_id) id: vec3<u32>) {{
    let i = id.x + id.y * params[1];
    if (i >= params[0]) {{ return; }}
{body}
}}
"#
    )
}

/// Compiles (once) and dispatches a [`flat_main`] kernel over `items`
/// threads: `params` is `[items, row_width]` followed by `rest`.
fn launch_flat(
    gpu: &'static Gpu,
    source: &str,
    buffers: &[&DeviceTensor],
    items: u32,
    rest: &[u32],
) -> Result<()> {
    let pipeline = gpu.pipeline(source)?;
    let (gx, gy) = grid(items.div_ceil(WORKGROUP));
    let mut params = Vec::with_capacity(2 + rest.len());
    params.extend_from_slice(&[items, gx * WORKGROUP]);
    params.extend_from_slice(rest);
    launch(gpu, &pipeline, buffers, &params, (gx, gy, 1))
}

/// [`launch_flat`] into a fresh tensor of `out`, bound after `inputs`.
fn launch_flat_new(
    gpu: &'static Gpu,
    source: &str,
    inputs: &[&DeviceTensor],
    out: &TensorMetadata,
    items: u32,
    rest: &[u32],
) -> Result<Option<Outputs>> {
    let y = gpu.alloc(out.clone())?;
    let mut buffers = inputs.to_vec();
    buffers.push(&y);
    launch_flat(gpu, source, &buffers, items, rest)?;
    drop(buffers);
    Ok(Some(one(y)))
}

/// A [`flat_main`] kernel from `input` to `output`, both of 4-byte words,
/// with `functions` for its body.
fn words_source(functions: &str, body: &str) -> String {
    format!(
        r#"
@group(0) @binding(0) var<storage, read> input: array<u32>;
@group(0) @binding(1) var<storage, read_write> output: array<u32>;
@group(0) @binding(2) var<storage, read> params: array<u32>;
{functions}{main}"#,
        main = flat_main(body)
    )
}

/// A [`flat_main`] kernel that reads `indices` through [`pick`], and
/// `source` and `output` as arrays of `element`.
fn indexed_source(source: &str, element: &str, body: &str) -> String {
    format!(
        r#"
@group(0) @binding(0) var<storage, read> {source}: array<{element}>;
@group(0) @binding(1) var<storage, read> indices: array<u32>;
@group(0) @binding(2) var<storage, read_write> output: array<{element}>;
@group(0) @binding(3) var<storage, read> params: array<u32>;
{pick}{main}"#,
        pick = pick(),
        main = flat_main(body)
    )
}

/// The words after `[items, row_width]` of the kernels that follow `axis`
/// through the positions of an index tensor: `[size, index_words, rank,
/// axis, extra, 0]`, then `blocks`.
fn axis_params(
    [size, index_words, extra]: [u32; 3],
    rank: usize,
    axis: usize,
    blocks: &[[u32; MAX_RANK]],
) -> Vec<u32> {
    let mut rest = vec![size, index_words, rank as u32, axis as u32, extra, 0];
    for block in blocks {
        rest.extend_from_slice(block);
    }
    rest
}

/// Index `k` of `indices`, one word of `params[3]` per index (1 for i32,
/// 2 for i64, whose low word it reads).
const INDEX_AT: &str = r#"
fn index_at(k: u32) -> i32 { return bitcast<i32>(indices[k * params[3]]); }
"#;

/// [`INDEX_AT`], a negative index counted from the end of an axis of
/// `params[2]` entries (the u32 sum wraps to the right position).
fn pick() -> String {
    format!(
        r#"{INDEX_AT}
fn pick(k: u32) -> u32 {{
    let t = index_at(k);
    let u = bitcast<u32>(t);
    return select(u, u + params[2], t < 0);
}}
"#
    )
}

/// 32-bit words per element of the dtypes the word-copying kernels move.
fn element_words(dtype: DType) -> Option<u32> {
    match dtype.size_in_bytes() {
        4 => Some(1),
        8 => Some(2),
        _ => None,
    }
}

/// Words per index of an index tensor whose every index the host found in
/// `[low, high)`; `None` for an index outside (the CPU's kernel then
/// reports it) or for indices that are neither i32 nor i64. Waits for the
/// work that computes the indices.
fn checked_indices(
    gpu: &'static Gpu,
    indices: &DeviceTensor,
    low: i64,
    high: i64,
) -> Result<Option<u32>> {
    let words = match indices.metadata().dtype {
        DType::I32 => 1,
        DType::I64 => 2,
        _ => return Ok(None),
    };
    // The shaders read one word: an i64 index is its low word only within
    // i32's range.
    if low < i64::from(i32::MIN) || high > i64::from(i32::MAX) + 1 {
        return Ok(None);
    }
    let host = gpu.download(indices)?;
    let within = |i: i64| (low..high).contains(&i);
    let all_within = match words {
        1 => host
            .as_slice::<i32>()?
            .iter()
            .all(|&i| within(i64::from(i))),
        _ => host.as_slice::<i64>()?.iter().all(|&i| within(i)),
    };
    Ok(all_within.then_some(words))
}

/// `dims` as `[outer, dims[axis], inner]`.
fn split(dims: &[usize], axis: usize) -> (usize, usize, usize) {
    let outer = dims[..axis].iter().product();
    let inner = dims[axis + 1..].iter().product();
    (outer, dims[axis], inner)
}

/// Every size in `sizes` as u32, or the error for a tensor too large for
/// the shaders' u32 offsets.
fn small_all<const N: usize>(sizes: [usize; N], meta: &TensorMetadata) -> Result<[u32; N]> {
    let mut out = [0u32; N];
    for (o, &s) in out.iter_mut().zip(&sizes) {
        *o = small(s).ok_or_else(|| too_large(meta))?;
    }
    Ok(out)
}

/// Dims or strides as a [`MAX_RANK`]-word block of `params`.
fn rank_block(values: &[usize], meta: &TensorMetadata) -> Result<[u32; MAX_RANK]> {
    let mut block = [0u32; MAX_RANK];
    for (b, &v) in block.iter_mut().zip(values) {
        *b = small(v).ok_or_else(|| too_large(meta))?;
    }
    Ok(block)
}

/// A copy of 4-byte words: the first step of the adds, which add into a
/// copy of `x`.
fn copy_source() -> String {
    words_source("", "    output[i] = input[i];")
}

/// A new tensor of `out` holding `x`'s words, for an add to add into.
fn copy_of(gpu: &'static Gpu, x: &DeviceTensor, out: &TensorMetadata) -> Result<DeviceTensor> {
    let [words] = small_all([x.metadata().shape.numel()], out)?;
    let y = gpu.alloc(out.clone())?;
    launch_flat(gpu, &copy_source(), &[x, &y], words, &[])?;
    Ok(y)
}

// ------------------------------------------------------------------ fused

/// The WGSL kernel of a `FusedElementwise` program over f32 inputs read
/// as `modes` says (one per input): one thread per output element, the
/// registers its local `let`s, each instruction the op's `wgsl()`
/// expression from its definition. Broadcast periods and runs are read
/// from `params`, so the source depends on the program and the kinds of
/// the modes alone (one compiled pipeline serves every shape). Only the
/// inputs the program reads are bound, in input order, then the output,
/// then `params`: `[count, row_width, then one word per bound input (its
/// period or run, else 0)]`. `None` when an op in the program has no WGSL
/// form, or the program is empty or reads a register it does not have.
///
/// Unary ops keep a NaN as it is (as the GPU's unary kernel does; WGSL's
/// builtins need not map NaN to NaN, the CPU's functions do); comparisons
/// give 1.0 or 0.0 and are false for NaN (`!=` true), as the CPU's fused
/// interpreter has them.
pub fn fused_shader(program: &[FusedInstr], modes: &[FusedOperand]) -> Option<String> {
    let inputs = modes.len();
    let read = registers_read(program, inputs)?;
    let mut bindings = String::new();
    let mut body = String::new();
    let mut bound = 0usize;
    for (k, mode) in modes.iter().enumerate() {
        if !read[k] {
            continue;
        }
        bindings += &format!("@group(0) @binding({bound}) var<storage, read> x{k}: array<f32>;\n");
        let at = match mode {
            FusedOperand::Scalar => "0u".to_string(),
            FusedOperand::Full => "i".to_string(),
            FusedOperand::Tile { .. } => format!("i % params[{}]", 2 + bound),
            FusedOperand::Repeat { .. } => format!("i / params[{}]", 2 + bound),
        };
        body += &format!("    let r{k} = x{k}[{at}];\n");
        bound += 1;
    }
    let mut functions = String::new();
    let mut define = |name: &str, definition: String| {
        if !functions.contains(&format!("fn {name}(")) {
            functions += &definition;
        }
    };
    for (n, instr) in program.iter().enumerate() {
        let r = inputs + n;
        let call = match *instr {
            FusedInstr::Unary(op, a) => {
                let name = format!("u_{}", op.def().name);
                // A program over floats: integer and bool ops' expressions
                // are over i32.
                let expression = op
                    .wgsl()
                    .filter(|_| Element::of(op.class()) == Element::F32)?;
                define(
                    &name,
                    format!(
                        "fn {name}(x: f32) -> f32 {{ if (sc_isnan(x)) {{ return x; }} return {expression}; }}\n"
                    ),
                );
                format!("{name}(r{a})")
            }
            FusedInstr::Binary(op, a, b) => {
                let name = format!("b_{}", op.def().name);
                let expression = op
                    .wgsl()
                    .filter(|_| Element::of(op.class()) == Element::F32)?;
                define(
                    &name,
                    format!("fn {name}(a: f32, b: f32) -> f32 {{ return {expression}; }}\n"),
                );
                format!("{name}(r{a}, r{b})")
            }
            FusedInstr::Compare(op, a, b) => {
                let name = format!("c_{op:?}");
                let expression = op.wgsl();
                define(
                    &name,
                    format!(
                        "fn {name}(a: f32, b: f32) -> f32 {{ return select(0.0, 1.0, {expression}); }}\n"
                    ),
                );
                format!("{name}(r{a}, r{b})")
            }
        };
        body += &format!("    let r{r} = {call};\n");
    }
    let result = inputs + program.len() - 1;
    body += &format!("    output[i] = r{result};");
    Some(format!(
        r#"{PRELUDE}
{bindings}@group(0) @binding({out}) var<storage, read_write> output: array<f32>;
@group(0) @binding({params}) var<storage, read> params: array<u32>;

{functions}{main}"#,
        out = bound,
        params = bound + 1,
        main = flat_main(&body)
    ))
}

/// Which of `inputs` input registers `program` reads; `None` for an empty
/// program or one that reads a register not yet written.
fn registers_read(program: &[FusedInstr], inputs: usize) -> Option<Vec<bool>> {
    if program.is_empty() {
        return None;
    }
    let mut read = vec![false; inputs + program.len()];
    for (n, instr) in program.iter().enumerate() {
        let (a, b) = match *instr {
            FusedInstr::Unary(_, a) => (a, a),
            FusedInstr::Binary(_, a, b) | FusedInstr::Compare(_, a, b) => (a, b),
        };
        if a >= inputs + n || b >= inputs + n {
            return None;
        }
        read[a] = true;
        read[b] = true;
    }
    read.truncate(inputs);
    Some(read)
}

fn fused_launch(
    gpu: &'static Gpu,
    attrs: &Attrs<'_>,
    inputs: &[&DeviceTensor],
    out: &TensorMetadata,
) -> Result<Option<Outputs>> {
    if out.dtype != DType::F32 || inputs.iter().any(|t| t.metadata().dtype != DType::F32) {
        return Ok(None);
    }
    let program = decode_fused(attrs.ints("program")?, inputs.len())?;
    let Some(modes) = inputs
        .iter()
        .map(|t| fused_operand(&t.metadata().shape, &out.shape))
        .collect::<Option<Vec<FusedOperand>>>()
    else {
        return Ok(None);
    };
    let Some(source) = fused_shader(&program, &modes) else {
        return Ok(None);
    };
    let Some(read) = registers_read(&program, inputs.len()) else {
        return Ok(None);
    };
    let mut buffers: Vec<&DeviceTensor> = Vec::with_capacity(inputs.len() + 1);
    let mut rest = Vec::with_capacity(inputs.len());
    for ((&t, mode), _) in inputs.iter().zip(&modes).zip(&read).filter(|(_, &r)| r) {
        buffers.push(t);
        let word = match *mode {
            FusedOperand::Tile { period } => period,
            FusedOperand::Repeat { run } => run.max(1),
            FusedOperand::Scalar | FusedOperand::Full => 0,
        };
        rest.push(small(word).ok_or_else(|| too_large(out))?);
    }
    // The inputs, the output and `params` are each a storage binding.
    let bindings = buffers.len() as u64 + 2;
    if bindings > u64::from(gpu.device.limits().max_storage_buffers_per_shader_stage) {
        return Ok(None);
    }
    let [count] = small_all([out.shape.numel()], out)?;
    launch_flat_new(gpu, &source, &buffers, out, count, &rest)
}

// ----------------------------------------------------------------- gathers

/// `Gather` over words: `x` as `[outer, size, inner]`, the output as
/// `[outer, n, inner]`. `params`: `[words, row_width, size, index_words,
/// n, inner, element_words]`.
fn gather_source() -> String {
    indexed_source(
        "x",
        "u32",
        r#"    let width = params[6];
    let e = i / width;
    let inner = params[5];
    let row = e / inner;
    let n = params[4];
    let picked = (row / n) * params[2] + pick(row % n);
    output[i] = x[(picked * inner + e % inner) * width + i % width];"#,
    )
}

fn gather_launch(
    gpu: &'static Gpu,
    attrs: &Attrs<'_>,
    inputs: &[&DeviceTensor],
    out: &TensorMetadata,
) -> Result<Option<Outputs>> {
    let (x, indices) = (inputs[0], inputs[1]);
    let Some(width) = element_words(x.metadata().dtype) else {
        return Ok(None);
    };
    let dims = x.metadata().shape.dims();
    let axis = normalize_axis(attrs.int("axis")? as isize, dims.len())?;
    let (_, size, inner) = split(dims, axis);
    let words = out.shape.numel() * width as usize;
    let x_words = x.metadata().shape.numel() * width as usize;
    let n = indices.metadata().shape.numel();
    let [words, _, size32, n, inner] = small_all([words, x_words, size, n, inner], out)?;
    let Some(index_words) = checked_indices(gpu, indices, -(size as i64), size as i64)? else {
        return Ok(None);
    };
    launch_flat_new(
        gpu,
        &gather_source(),
        &[x, indices],
        out,
        words,
        &[size32, index_words, n, inner, width],
    )
}

/// `GatherElements` over words: output element `e` (at a position of the
/// indices) reads `x` at the same position with its coordinate on `axis`
/// replaced by the index. `params`: `[words, row_width, size,
/// index_words, rank, axis, element_words, 0, index_dims[MAX_RANK],
/// x_strides[MAX_RANK]]`.
fn gather_elements_source() -> String {
    let r = MAX_RANK;
    indexed_source(
        "x",
        "u32",
        &format!(
            r#"    let width = params[6];
    let e = i / width;
    let rank = params[4];
    let axis = params[5];
    var rest = e;
    var at = 0u;
    for (var d = 0u; d < rank; d = d + 1u) {{
        let a = rank - 1u - d;
        let dim = params[8u + a];
        if (a != axis) {{ at = at + (rest % dim) * params[8u + {r}u + a]; }}
        rest = rest / dim;
    }}
    at = at + pick(e) * params[8u + {r}u + axis];
    output[i] = x[at * width + i % width];"#
        ),
    )
}

fn gather_elements_launch(
    gpu: &'static Gpu,
    attrs: &Attrs<'_>,
    inputs: &[&DeviceTensor],
    out: &TensorMetadata,
) -> Result<Option<Outputs>> {
    let (x, indices) = (inputs[0], inputs[1]);
    let Some(width) = element_words(x.metadata().dtype) else {
        return Ok(None);
    };
    let dims = x.metadata().shape.dims();
    let index_dims = indices.metadata().shape.dims();
    if dims.len() > MAX_RANK {
        return Ok(None);
    }
    let axis = normalize_axis(attrs.int("axis")? as isize, dims.len())?;
    let size = dims[axis];
    let words = out.shape.numel() * width as usize;
    let x_words = x.metadata().shape.numel() * width as usize;
    let [words, _, size32] = small_all([words, x_words, size], out)?;
    let index_block = rank_block(index_dims, out)?;
    let stride_block = rank_block(&strides_of(dims), out)?;
    let Some(index_words) = checked_indices(gpu, indices, -(size as i64), size as i64)? else {
        return Ok(None);
    };
    let rest = axis_params(
        [size32, index_words, width],
        dims.len(),
        axis,
        &[index_block, stride_block],
    );
    launch_flat_new(
        gpu,
        &gather_elements_source(),
        &[x, indices],
        out,
        words,
        &rest,
    )
}

// -------------------------------------------------------------------- adds

/// `ScatterAdd`'s adds into a copy of `x`: one thread per line of the
/// indices along `axis`, which meets one line of the output and no other
/// thread's, adding `src` along it in order. `params`: `[lines,
/// row_width, size, index_words, rank, axis, along (index_dims[axis]), 0,
/// index_dims[MAX_RANK], x_strides[MAX_RANK], index_strides[MAX_RANK]]`.
fn scatter_add_source() -> String {
    let (r, r2) = (MAX_RANK, 2 * MAX_RANK);
    indexed_source(
        "src",
        "f32",
        &format!(
            r#"    let rank = params[4];
    let axis = params[5];
    var rest = i;
    var to = 0u;
    var at = 0u;
    for (var d = 0u; d < rank; d = d + 1u) {{
        let a = rank - 1u - d;
        if (a == axis) {{ continue; }}
        let dim = params[8u + a];
        let c = rest % dim;
        rest = rest / dim;
        to = to + c * params[8u + {r}u + a];
        at = at + c * params[8u + {r2}u + a];
    }}
    let x_step = params[8u + {r}u + axis];
    let step = params[8u + {r2}u + axis];
    let along = params[6];
    for (var p = 0u; p < along; p = p + 1u) {{
        let k = at + p * step;
        let t = to + pick(k) * x_step;
        output[t] = output[t] + src[k];
    }}"#
        ),
    )
}

fn scatter_add_launch(
    gpu: &'static Gpu,
    attrs: &Attrs<'_>,
    inputs: &[&DeviceTensor],
    out: &TensorMetadata,
) -> Result<Option<Outputs>> {
    let (x, indices, src) = (inputs[0], inputs[1], inputs[2]);
    if out.dtype != DType::F32 || src.metadata().dtype != DType::F32 {
        return Ok(None);
    }
    let dims = x.metadata().shape.dims();
    let index_dims = indices.metadata().shape.dims();
    if dims.len() > MAX_RANK {
        return Ok(None);
    }
    let axis = normalize_axis(attrs.int("axis")? as isize, dims.len())?;
    let size = dims[axis];
    let along = index_dims[axis];
    // No indices: nothing to add (and no line to give a thread).
    if along == 0 {
        return Ok(None);
    }
    let lines = indices.metadata().shape.numel() / along;
    let [size32, along32, lines] = small_all([size, along, lines], out)?;
    let index_block = rank_block(index_dims, out)?;
    let x_block = rank_block(&strides_of(dims), out)?;
    let step_block = rank_block(&strides_of(index_dims), out)?;
    let Some(index_words) = checked_indices(gpu, indices, -(size as i64), size as i64)? else {
        return Ok(None);
    };
    let rest = axis_params(
        [size32, index_words, along32],
        dims.len(),
        axis,
        &[index_block, x_block, step_block],
    );
    let y = copy_of(gpu, x, out)?;
    launch_flat(
        gpu,
        &scatter_add_source(),
        &[src, indices, &y],
        lines,
        &rest,
    )?;
    Ok(Some(one(y)))
}

/// `IndexAdd`'s adds into a copy of `x` (as `[outer, size, inner]`, `src`
/// as `[outer, count, inner]`): one thread per `(outer, inner)` line,
/// which alone writes that line of the output, adding slice `k` of `src`
/// for `k` in order. `params`: `[lines, row_width, size, index_words,
/// count, inner]`.
fn index_add_source() -> String {
    indexed_source(
        "src",
        "f32",
        r#"    let count = params[4];
    let inner = params[5];
    let o = i / inner;
    let c = i % inner;
    for (var k = 0u; k < count; k = k + 1u) {
        let t = (o * params[2] + pick(k)) * inner + c;
        output[t] = output[t] + src[(o * count + k) * inner + c];
    }"#,
    )
}

fn index_add_launch(
    gpu: &'static Gpu,
    attrs: &Attrs<'_>,
    inputs: &[&DeviceTensor],
    out: &TensorMetadata,
) -> Result<Option<Outputs>> {
    let (x, indices, src) = (inputs[0], inputs[1], inputs[2]);
    if out.dtype != DType::F32 || src.metadata().dtype != DType::F32 {
        return Ok(None);
    }
    let dims = x.metadata().shape.dims();
    let axis = normalize_axis(attrs.int("axis")? as isize, dims.len())?;
    let (outer, size, inner) = split(dims, axis);
    let count = indices.metadata().shape.numel();
    let src_len = src.metadata().shape.numel();
    let [size32, count32, inner32, lines, _] =
        small_all([size, count, inner, outer * inner, src_len], out)?;
    let Some(index_words) = checked_indices(gpu, indices, -(size as i64), size as i64)? else {
        return Ok(None);
    };
    let y = copy_of(gpu, x, out)?;
    launch_flat(
        gpu,
        &index_add_source(),
        &[src, indices, &y],
        lines,
        &[size32, index_words, count32, inner32],
    )?;
    Ok(Some(one(y)))
}

// ------------------------------------------------------- arg-reductions

/// Lines at most this long take one thread each; longer ones a workgroup.
const ARG_PER_THREAD_MAX: usize = 64;

/// `ArgMax` / `ArgMin` of f32 or i32 lines (`x` as `[outer, n, inner]`)
/// into i64 positions (two words, the high one 0). As on the CPU: the
/// first best on ties, and the first NaN wins over any number. `params`:
/// `[lines, row_width (threads, or workgroups per_workgroup), n, inner]`.
fn arg_source(max: bool, element: DType, per_workgroup: bool) -> String {
    let (ty, nan) = match element {
        DType::F32 => ("f32", "sc_isnan(v)"),
        _ => ("i32", "false"),
    };
    let wins = if max { ">" } else { "<" };
    let head = format!(
        r#"{PRELUDE}
@group(0) @binding(0) var<storage, read> x: array<{ty}>;
@group(0) @binding(1) var<storage, read_write> output: array<u32>;
@group(0) @binding(2) var<storage, read> params: array<u32>;

const NONE: u32 = 0xffffffffu;

fn is_nan(v: {ty}) -> bool {{ return {nan}; }}

// Whether (v, at) replaces (best, best_at), positions NONE for nothing
// yet: a NaN over a number, the better number, the earlier of equals.
// Any grouping of the line then finds what the CPU's scan in order does.
fn replaces(best: {ty}, best_at: u32, v: {ty}, at: u32) -> bool {{
    if (at == NONE) {{ return false; }}
    if (best_at == NONE) {{ return true; }}
    let best_nan = is_nan(best);
    let v_nan = is_nan(v);
    if (best_nan || v_nan) {{ return v_nan && (!best_nan || at < best_at); }}
    if (v {wins} best) {{ return true; }}
    return v == best && at < best_at;
}}

fn line_base(line: u32) -> u32 {{
    let n = params[2];
    let inner = params[3];
    return (line / inner) * n * inner + line % inner;
}}
"#
    );
    if !per_workgroup {
        let main = flat_main(
            r#"    let n = params[2];
    let inner = params[3];
    let base = line_base(i);
    var best = x[base];
    var best_at = 0u;
    for (var r = 1u; r < n; r = r + 1u) {
        let v = x[base + r * inner];
        if (replaces(best, best_at, v, r)) {
            best = v;
            best_at = r;
        }
    }
    output[2u * i] = best_at;
    output[2u * i + 1u] = 0u;"#,
        );
        return format!("{head}{main}");
    }
    format!(
        r#"{head}
const LANES: u32 = 64u;
var<workgroup> values: array<{ty}, 64>;
var<workgroup> positions: array<u32, 64>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) group: vec3<u32>,
        @builtin(local_invocation_index) lane: u32) {{
    let line = group.x + group.y * params[1];
    let live = line < params[0];
    var best = {ty}();
    var best_at = NONE;
    if (live) {{
        let n = params[2];
        let inner = params[3];
        let base = line_base(line);
        for (var r = lane; r < n; r = r + LANES) {{
            let v = x[base + r * inner];
            if (replaces(best, best_at, v, r)) {{
                best = v;
                best_at = r;
            }}
        }}
    }}
    values[lane] = best;
    positions[lane] = best_at;
    workgroupBarrier();
    for (var w = LANES / 2u; w > 0u; w = w / 2u) {{
        if (lane < w && replaces(values[lane], positions[lane], values[lane + w], positions[lane + w])) {{
            values[lane] = values[lane + w];
            positions[lane] = positions[lane + w];
        }}
        workgroupBarrier();
    }}
    if (live && lane == 0u) {{
        output[2u * line] = positions[0];
        output[2u * line + 1u] = 0u;
    }}
}}
"#
    )
}

fn arg_launch(
    gpu: &'static Gpu,
    max: bool,
    attrs: &Attrs<'_>,
    x: &DeviceTensor,
    out: &TensorMetadata,
) -> Result<Option<Outputs>> {
    let element = x.metadata().dtype;
    if !matches!(element, DType::F32 | DType::I32) || out.dtype != DType::I64 {
        return Ok(None);
    }
    let dims = x.metadata().shape.dims();
    let axis = normalize_axis(attrs.int("axis")? as isize, dims.len())?;
    let (outer, n, inner) = split(dims, axis);
    let [lines, n32, inner32, _] =
        small_all([outer * inner, n, inner, x.metadata().shape.numel()], out)?;
    let per_workgroup = n > ARG_PER_THREAD_MAX;
    let pipeline = gpu.pipeline(&arg_source(max, element, per_workgroup))?;
    let y = gpu.alloc(out.clone())?;
    let (gx, gy, row_width) = if per_workgroup {
        let (gx, gy) = grid(lines);
        (gx, gy, gx)
    } else {
        let (gx, gy) = grid(lines.div_ceil(WORKGROUP));
        (gx, gy, gx * WORKGROUP)
    };
    launch(
        gpu,
        &pipeline,
        &[x, &y],
        &[lines, row_width, n32, inner32],
        (gx, gy, 1),
    )?;
    Ok(Some(one(y)))
}

// ------------------------------------------------------------------ concat

/// One input of a `Concat`, copied into its columns of the output's rows
/// (all in words). `params`: `[words, row_width, width, row_len, at]`.
fn concat_source() -> String {
    words_source(
        "",
        "    output[(i / params[2]) * params[3] + params[4] + i % params[2]] = input[i];",
    )
}

/// A launch per input, each writing its own columns, so any number of
/// inputs takes one compiled shader and a storage binding each.
fn concat_launch(
    gpu: &'static Gpu,
    attrs: &Attrs<'_>,
    inputs: &[&DeviceTensor],
    out: &TensorMetadata,
) -> Result<Option<Outputs>> {
    let Some(width) = element_words(out.dtype) else {
        return Ok(None);
    };
    if let [only] = inputs {
        return Ok(Some(one((*only).clone())));
    }
    let dims = out.shape.dims();
    let axis = normalize_axis(attrs.int("axis")? as isize, dims.len())?;
    let outer: usize = dims[..axis].iter().product();
    let words = out.shape.numel() * width as usize;
    let [_, row_len] = small_all([words, words / outer], out)?;
    let source = concat_source();
    let y = gpu.alloc(out.clone())?;
    let mut at = 0u32;
    for &t in inputs {
        let [t_words] = small_all([t.metadata().shape.numel() * width as usize], out)?;
        let t_width = t_words / outer as u32;
        launch_flat(gpu, &source, &[t, &y], t_words, &[t_width, row_len, at])?;
        at += t_width;
    }
    Ok(Some(one(y)))
}

// ----------------------------------------------------------------- one-hot

/// `OneHot` into 4- or 8-byte elements: each output word is its element's
/// word of one (`one_low`, `one_high`) where the class is the index, else
/// 0. `params`: `[words, row_width, depth, index_words, element_words,
/// one_low, one_high]`.
fn one_hot_source() -> String {
    format!(
        r#"
@group(0) @binding(0) var<storage, read> indices: array<u32>;
@group(0) @binding(1) var<storage, read_write> output: array<u32>;
@group(0) @binding(2) var<storage, read> params: array<u32>;
{INDEX_AT}{main}"#,
        main = flat_main(
            r#"    let width = params[4];
    let e = i / width;
    let depth = params[2];
    let hit = bitcast<u32>(index_at(e / depth)) == e % depth;
    output[i] = select(0u, select(params[6], params[5], i % width == 0u), hit);"#
        )
    )
}

fn one_hot_launch(
    gpu: &'static Gpu,
    attrs: &Attrs<'_>,
    indices: &DeviceTensor,
    out: &TensorMetadata,
) -> Result<Option<Outputs>> {
    let one_bits: u64 = match out.dtype {
        DType::F32 => u64::from(1f32.to_bits()),
        DType::F64 => 1f64.to_bits(),
        DType::I32 | DType::U32 | DType::I64 | DType::U64 => 1,
        _ => return Ok(None),
    };
    let Some(width) = element_words(out.dtype) else {
        return Ok(None);
    };
    let depth = attrs.int("depth")?;
    let Ok(depth_usize) = usize::try_from(depth) else {
        return Ok(None);
    };
    let words = out.shape.numel() * width as usize;
    let [words, depth32] = small_all([words, depth_usize], out)?;
    let Some(index_words) = checked_indices(gpu, indices, 0, depth)? else {
        return Ok(None);
    };
    launch_flat_new(
        gpu,
        &one_hot_source(),
        &[indices],
        out,
        words,
        &[
            depth32,
            index_words,
            width,
            one_bits as u32,
            (one_bits >> 32) as u32,
        ],
    )
}

// ------------------------------------------------------------------ cumsum

/// `Cumsum` of f32 lines (`x` as `[outer, n, inner]`), one thread per
/// line. The CPU keeps the running total in f64 and rounds each output
/// once; WGSL has no f64, so the total is an unevaluated pair `hi + lo`
/// kept by Knuth's two-sum, about twice f32's precision, and each output
/// is `hi + lo` rounded once. Shader compilers may rewrite `(a + b) - a`
/// to `b` (Mesa does, and a plain f32 sum then drifts from the CPU's by
/// hundreds of ulps over 20,000 elements): every step of the two-sum is
/// multiplied by `one`, 1.0 read from `params`, which no compiler can
/// see through, and a product by 1 is exact. `params`: `[lines,
/// row_width, n, inner, exclusive, reverse, one (f32 bits)]`.
fn cumsum_source() -> String {
    format!(
        r#"{PRELUDE}
@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> output: array<f32>;
@group(0) @binding(2) var<storage, read> params: array<u32>;
{main}"#,
        main = flat_main(
            r#"    let n = params[2];
    let inner = params[3];
    let exclusive = params[4] != 0u;
    let one = bitcast<f32>(params[6]);
    let base = (i / inner) * n * inner + i % inner;
    var hi = 0.0;
    var lo = 0.0;
    for (var s = 0u; s < n; s = s + 1u) {
        let at = base + select(s, n - 1u - s, params[5] != 0u) * inner;
        let v = x[at];
        if (exclusive) { output[at] = hi + lo; }
        let t = (hi + v) * one;
        let v_part = (t - hi) * one;
        let hi_part = (t - v_part) * one;
        let error = (hi - hi_part) + (v - v_part);
        hi = t;
        // An infinite or NaN total has no rounding error to carry (its
        // error reads inf - inf).
        if (!sc_isnan(error)) { lo = lo + error; }
        if (!exclusive) { output[at] = hi + lo; }
    }"#
        )
    )
}

fn cumsum_launch(
    gpu: &'static Gpu,
    attrs: &Attrs<'_>,
    x: &DeviceTensor,
    out: &TensorMetadata,
) -> Result<Option<Outputs>> {
    if out.dtype != DType::F32 {
        return Ok(None);
    }
    let dims = x.metadata().shape.dims();
    let axis = normalize_axis(attrs.int("axis")? as isize, dims.len())?;
    let (outer, n, inner) = split(dims, axis);
    let [lines, n32, inner32, _] = small_all([outer * inner, n, inner, out.shape.numel()], out)?;
    let flags = [
        attrs.bool("exclusive")? as u32,
        attrs.bool("reverse")? as u32,
    ];
    launch_flat_new(
        gpu,
        &cumsum_source(),
        &[x],
        out,
        lines,
        &[n32, inner32, flags[0], flags[1], 1f32.to_bits()],
    )
}

// ------------------------------------------------------------------- trilu

/// `Trilu` over words, for elements of 1, 2, 4 or 8 bytes: a word holds
/// `lanes` elements (1 for 4- and 8-byte ones, which span
/// `element_words` words), each kept or zeroed. Element `e` of a `[..,
/// rows, cols]` tensor is kept when `col - row <= k` (lower) or `>= k`
/// (upper). `params`: `[words, row_width, rows, cols, lanes,
/// element_words, upper, k (i32 bits, clamped to the matrix), count]`.
fn trilu_source() -> String {
    words_source(
        r#"
fn keep(e: u32) -> bool {
    let cols = params[3];
    let d = i32(e % cols) - i32((e / cols) % params[2]);
    let k = bitcast<i32>(params[7]);
    return select(d <= k, d >= k, params[6] != 0u);
}
"#,
        r#"    let lanes = params[4];
    if (lanes == 1u) {
        output[i] = select(0u, input[i], keep(i / params[5]));
        return;
    }
    let bits = 32u / lanes;
    let mask = (1u << bits) - 1u;
    var word = 0u;
    for (var j = 0u; j < lanes; j = j + 1u) {
        let e = i * lanes + j;
        if (e < params[8] && keep(e)) { word = word | (input[i] & (mask << (bits * j))); }
    }
    output[i] = word;"#,
    )
}

fn trilu_launch(
    gpu: &'static Gpu,
    attrs: &Attrs<'_>,
    x: &DeviceTensor,
    out: &TensorMetadata,
) -> Result<Option<Outputs>> {
    let bytes = out.dtype.size_in_bytes();
    let (lanes, width) = match bytes {
        1 | 2 => (4 / bytes, 1),
        4 | 8 => (1, bytes / 4),
        _ => return Ok(None),
    };
    let dims = out.shape.dims();
    let (rows, cols) = (dims[dims.len() - 2], dims[dims.len() - 1]);
    // `col - row` is taken in i32.
    if rows > i32::MAX as usize || cols > i32::MAX as usize {
        return Ok(None);
    }
    let count = out.shape.numel();
    let words = (count * bytes).div_ceil(4);
    let [words, count32, rows32, cols32] = small_all([words, count, rows, cols], out)?;
    // Beyond the matrix every `col - row` compares the same way.
    let k = attrs.int("k")?.clamp(-(rows as i64), cols as i64) as i32;
    launch_flat_new(
        gpu,
        &trilu_source(),
        &[x],
        out,
        words,
        &[
            rows32,
            cols32,
            lanes as u32,
            width as u32,
            attrs.bool("upper")? as u32,
            k as u32,
            count32,
        ],
    )
}

/// Every shader of this module (the fused kernel is built per program:
/// see [`fused_shader`]), for the test that compiles them all.
#[doc(hidden)]
pub fn every_indexing_shader() -> Vec<(&'static str, String)> {
    let mut sources = vec![
        ("copy", copy_source()),
        ("Gather", gather_source()),
        ("GatherElements", gather_elements_source()),
        ("ScatterAdd", scatter_add_source()),
        ("IndexAdd", index_add_source()),
        ("Concat", concat_source()),
        ("OneHot", one_hot_source()),
        ("Cumsum", cumsum_source()),
        ("Trilu", trilu_source()),
    ];
    for max in [true, false] {
        for element in [DType::F32, DType::I32] {
            for per_workgroup in [false, true] {
                let name = if max { "ArgMax" } else { "ArgMin" };
                sources.push((name, arg_source(max, element, per_workgroup)));
            }
        }
    }
    sources
}
