//! Transformer kernels beyond layer norm: its gradient, RMS norm and its
//! gradient, fused attention and its gradient, and the squared norm of a
//! list of tensors. f32 only; anything else runs on the CPU.
//!
//! **Norm gradients.** `dx` takes one workgroup per row, as the forward
//! pass does. `dweight` and `dbias` sum over rows, and WGSL has no float
//! atomics, so they take two passes: workgroups of [`COLUMNS`] adjacent
//! columns sum a chunk of rows each into a `[chunks, D]` buffer of partial
//! sums (reads along a row stay contiguous across the lanes), then one
//! thread per column adds its chunks in order. The chunks are fixed by the
//! shape, so the result is the same on every run.
//!
//! **Attention**, FlashAttention's scheme on [`TILE`]² workgroups: a
//! workgroup owns a tile of queries and streams over tiles of keys,
//! computing a tile of scores through workgroup memory (like the matmul
//! kernel), rescaling its running maximum, running sum and output rows
//! with the online softmax, and adding `P·V`. No score leaves workgroup
//! memory; the output rows accumulate in the output itself (each element
//! belongs to one thread). The backward pass is FlashAttention-2's, in
//! three launches: `Δ = rowsum(dO ∘ O)` next to `L`, then `dq` by tiles of
//! queries and `dk`, `dv` by tiles of keys, each recomputing its tiles of
//! `P = exp(S − L)` instead of reading them. Split that way, no launch
//! binds more than eight storage buffers (WebGPU's guaranteed minimum).

use crate::context::Gpu;
use crate::kernels::{grid, launch, one, row_norm_launch, small, Outputs};
use crate::registry::{kernel, Accepts, GpuKernel};
use crate::shader::{self, PRELUDE, ROW_MAIN, WORKGROUP};
use smallvec::SmallVec;
use stagecraft_ops::{defs, Attrs};
use stagecraft_tensor::{DType, DeviceTensor, Result, TensorMetadata};

/// The entries of this family: f32 in, and each launch checks its outputs
/// are f32 too.
pub(crate) fn register(table: &mut Vec<GpuKernel>) {
    use Accepts::AllF32;
    table.extend([
        kernel(&defs::LAYER_NORM_GRAD, AllF32, |g, _, a, i, o| {
            f32_only(i, o, || norm_grad_launch(g, true, a, i, o))
        }),
        kernel(&defs::RMS_NORM, AllF32, |g, _, a, i, o| {
            f32_only(i, o, || rms_norm_launch(g, a, i, o))
        }),
        kernel(&defs::RMS_NORM_GRAD, AllF32, |g, _, a, i, o| {
            f32_only(i, o, || norm_grad_launch(g, false, a, i, o))
        }),
        kernel(
            &defs::SCALED_DOT_PRODUCT_ATTENTION,
            AllF32,
            |g, _, a, i, o| f32_only(i, o, || attention_launch(g, a, i, o)),
        ),
        kernel(
            &defs::SCALED_DOT_PRODUCT_ATTENTION_GRAD,
            AllF32,
            |g, _, a, i, o| f32_only(i, o, || attention_grad_launch(g, a, i, o)),
        ),
        kernel(&defs::SQUARED_NORM, AllF32, |g, _, _, i, o| {
            f32_only(i, o, || squared_norm_launch(g, i, &o[0]))
        }),
    ]);
}

/// Runs `launch` when there are inputs and outputs, all f32; `Ok(None)`
/// (the CPU) otherwise.
fn f32_only(
    inputs: &[&DeviceTensor],
    outputs: &[TensorMetadata],
    launch: impl FnOnce() -> Result<Option<Outputs>>,
) -> Result<Option<Outputs>> {
    let f32_only = inputs.iter().all(|t| t.metadata().dtype == DType::F32)
        && outputs.iter().all(|o| o.dtype == DType::F32);
    if !f32_only || inputs.is_empty() || outputs.is_empty() {
        return Ok(None);
    }
    launch()
}

/// Every size as a `u32`, or `None` when one is too large for the
/// shaders' indices (the CPU's kernel then runs).
fn words<const N: usize>(sizes: [usize; N]) -> Option<[u32; N]> {
    let mut out = [0u32; N];
    for (o, s) in out.iter_mut().zip(sizes) {
        *o = small(s)?;
    }
    Some(out)
}

fn f32_meta(dims: &[usize]) -> TensorMetadata {
    TensorMetadata::new(DType::F32, dims)
}

/// The storage-buffer declarations of a shader: f32 arrays bound in the
/// order they are added, then `params`.
#[derive(Default)]
struct Bindings {
    text: String,
    next: u32,
}

impl Bindings {
    fn add(&mut self, name: &str, access: &str) {
        self.text += &format!(
            "@group(0) @binding({}) var<storage, {access}> {name}: array<f32>;\n",
            self.next
        );
        self.next += 1;
    }

    fn read(&mut self, name: &str) {
        self.add(name, "read");
    }

    fn write(&mut self, name: &str) {
        self.add(name, "read_write");
    }

    fn finish(self) -> String {
        format!(
            "{}@group(0) @binding({}) var<storage, read> params: array<u32>;\n",
            self.text, self.next
        )
    }
}

// ---------------------------------------------------------------------------
// Norms.

/// A workgroup-wide sum of two values at once, for the 64 lanes that share
/// a row. Called in uniform control flow (it has barriers).
const ROW_SUMS: &str = r#"
const LANES: u32 = 64u;
var<workgroup> partial: array<vec2<f32>, 64>;

fn row_sums(value: vec2<f32>, lane: u32) -> vec2<f32> {
    partial[lane] = value;
    workgroupBarrier();
    for (var w = LANES / 2u; w > 0u; w = w / 2u) {
        if (lane < w) { partial[lane] = partial[lane] + partial[lane + w]; }
        workgroupBarrier();
    }
    let total = partial[0];
    workgroupBarrier();
    return total;
}
"#;

/// RMS norm over the last axis, one workgroup per row: `rstd =
/// 1/sqrt(mean(x²) + eps)`, `y = x·rstd·weight`. `params`: `[rows, width,
/// row_width_in_groups, eps (f32 bits)]`.
fn rms_norm_shader(has_weight: bool) -> String {
    let mut b = Bindings::default();
    b.read("x");
    if has_weight {
        b.read("weight");
    }
    b.write("y");
    b.write("rstd_out");
    let bindings = b.finish();
    let scale = if has_weight { " * weight[c]" } else { "" };
    format!(
        r#"{bindings}{ROW_SUMS}{ROW_MAIN}
    var squares = 0.0;
    if (live) {{
        for (var c = lane; c < width; c = c + LANES) {{
            let v = x[base + c];
            squares = squares + v * v;
        }}
    }}
    let total = row_sums(vec2<f32>(squares, 0.0), lane).x;
    let rstd = 1.0 / sqrt(total / f32(width) + bitcast<f32>(params[3]));
    if (live) {{
        for (var c = lane; c < width; c = c + LANES) {{
            y[base + c] = x[base + c] * rstd{scale};
        }}
        if (lane == 0u) {{ rstd_out[row] = rstd; }}
    }}
}}
"#
    )
}

/// `dx` of layer norm (`centered`) or RMS norm, one workgroup per row:
/// with `xh = (x − mean)·rstd` and `a = g·weight`, `dx = rstd·(a −
/// xh·mean(a·xh) − mean(a))` (RMS norm: no mean, no `mean(a)`), in the
/// CPU kernel's order. `params`: `[rows, width, row_width_in_groups]`.
fn norm_grad_rows_shader(centered: bool, has_weight: bool) -> String {
    let mut b = Bindings::default();
    b.read("g");
    b.read("x");
    if centered {
        b.read("mean");
    }
    b.read("rstd");
    if has_weight {
        b.read("weight");
    }
    b.write("dx");
    let bindings = b.finish();
    let mean = if centered { "mean[row]" } else { "0.0" };
    let a = if has_weight {
        "g[at] * weight[c]"
    } else {
        "g[at]"
    };
    let centre = if centered { " - c1" } else { "" };
    format!(
        r#"{bindings}{ROW_SUMS}{ROW_MAIN}
    var m = 0.0;
    var r = 0.0;
    if (live) {{
        m = {mean};
        r = rstd[row];
    }}
    var sums = vec2<f32>(0.0, 0.0);
    if (live) {{
        for (var c = lane; c < width; c = c + LANES) {{
            let at = base + c;
            let a = {a};
            let xh = (x[at] - m) * r;
            sums = sums + vec2<f32>(a, a * xh);
        }}
    }}
    let means = row_sums(sums, lane) / f32(width);
    let c1 = means.x;
    let c2 = means.y;
    if (live) {{
        for (var c = lane; c < width; c = c + LANES) {{
            let at = base + c;
            let a = {a};
            let xh = (x[at] - m) * r;
            dx[at] = r * ((a - xh * c2){centre});
        }}
    }}
}}
"#
    )
}

/// Columns a workgroup of the partial column sums covers.
const COLUMNS: u32 = 64;

/// At most this many chunks of rows in the partial column sums.
const MAX_CHUNKS: usize = 256;

/// At least this many rows per chunk, so that small inputs take one pass
/// worth of chunks.
const MIN_CHUNK_ROWS: usize = 16;

/// The first pass of `dweight = Σ g·xh` and `dbias = Σ g` over rows: each
/// thread sums one column over one chunk of rows into `partial[chunk,
/// column + offset]`. `params`: `[rows, width, chunk_rows, chunks,
/// column_blocks, row_width_in_groups, weight_offset, bias_offset,
/// partial_width]`.
fn norm_grad_columns_shader(centered: bool, has_weight: bool, has_bias: bool) -> String {
    let mut b = Bindings::default();
    b.read("g");
    if has_weight {
        b.read("x");
        if centered {
            b.read("mean");
        }
        b.read("rstd");
    }
    b.write("partial");
    let bindings = b.finish();
    let mean = if centered { "mean[r]" } else { "0.0" };
    let (w_step, w_store) = if has_weight {
        (
            format!("sw = sw + gv * ((x[at] - {mean}) * rstd[r]);"),
            "partial[out + params[6]] = sw;",
        )
    } else {
        (String::new(), "")
    };
    let (b_step, b_store) = if has_bias {
        ("sb = sb + gv;", "partial[out + params[7]] = sb;")
    } else {
        ("", "")
    };
    format!(
        r#"{bindings}
@compute @workgroup_size({COLUMNS})
fn main(@builtin(workgroup_id) group: vec3<u32>,
        @builtin(local_invocation_index) lane: u32) {{
    let flat = group.x + group.y * params[5];
    let blocks = params[4];
    let chunk = flat / blocks;
    let c = (flat % blocks) * {COLUMNS}u + lane;
    let width = params[1];
    if (chunk >= params[3] || c >= width) {{ return; }}
    let first = chunk * params[2];
    let last = min(first + params[2], params[0]);
    var sw = 0.0;
    var sb = 0.0;
    for (var r = first; r < last; r = r + 1u) {{
        let at = r * width + c;
        let gv = g[at];
        {w_step}
        {b_step}
    }}
    let out = chunk * params[8] + c;
    {w_store}
    {b_store}
}}
"#
    )
}

fn rms_norm_launch(
    gpu: &'static Gpu,
    attrs: &Attrs<'_>,
    inputs: &[&DeviceTensor],
    outputs: &[TensorMetadata],
) -> Result<Option<Outputs>> {
    let has_weight = attrs.bool("has_weight")?;
    if inputs.len() != 1 + has_weight as usize || outputs.len() != 2 {
        return Ok(None);
    }
    let x = inputs[0].metadata();
    let width = match x.shape.dims().last() {
        Some(&width) if width > 0 => width,
        _ => return Ok(None),
    };
    let rows = outputs[1].shape.numel();
    let Some([width32, rows32, _]) = words([width, rows, x.shape.numel()]) else {
        return Ok(None);
    };
    let eps = attrs.float("eps")? as f32;
    let source = rms_norm_shader(has_weight);
    row_norm_launch(gpu, &source, inputs, outputs, [rows32, width32], eps).map(Some)
}

/// `LayerNormGrad(g, x, mean, rstd, [weight])` (`centered`) or
/// `RmsNormGrad(g, x, rstd, [weight])`: `dx` by rows, then `dweight` and
/// `dbias` (where asked for) by the two column passes.
fn norm_grad_launch(
    gpu: &'static Gpu,
    centered: bool,
    attrs: &Attrs<'_>,
    inputs: &[&DeviceTensor],
    outputs: &[TensorMetadata],
) -> Result<Option<Outputs>> {
    let has_weight = attrs.bool("has_weight")?;
    let has_bias = centered && attrs.bool("has_bias")?;
    let fixed = if centered { 4 } else { 3 };
    if inputs.len() != fixed + has_weight as usize
        || outputs.len() != 1 + has_weight as usize + has_bias as usize
    {
        return Ok(None);
    }
    let x = inputs[1].metadata();
    let width = match x.shape.dims().last() {
        Some(&width) if width > 0 => width,
        _ => return Ok(None),
    };
    let rows = x.shape.numel() / width;
    let chunk_rows = rows.div_ceil(MAX_CHUNKS).max(MIN_CHUNK_ROWS);
    let chunks = rows.div_ceil(chunk_rows);
    let params_wanted = has_weight as usize + has_bias as usize;
    let column_blocks = width.div_ceil(COLUMNS as usize);
    let Some([width32, rows32, _, chunk_rows32, chunks32, blocks32, groups32, partial_width]) =
        words([
            width,
            rows,
            x.shape.numel(),
            chunk_rows,
            chunks,
            column_blocks,
            column_blocks * chunks,
            params_wanted * width,
        ])
    else {
        return Ok(None);
    };
    if small(chunks * params_wanted * width).is_none() {
        return Ok(None);
    }

    let dx = gpu.alloc(outputs[0].clone())?;
    let pipeline = gpu.pipeline(&norm_grad_rows_shader(centered, has_weight))?;
    let (gx, gy) = grid(rows32);
    let mut buffers: SmallVec<[&DeviceTensor; 8]> = inputs.iter().copied().collect();
    buffers.push(&dx);
    launch(
        gpu,
        &pipeline,
        &buffers,
        &[rows32, width32, gx],
        (gx, gy, 1),
    )?;
    drop(buffers);
    let mut produced = one(dx);
    if params_wanted == 0 {
        return Ok(Some(produced));
    }

    let partial = gpu.alloc(f32_meta(&[chunks, params_wanted * width]))?;
    let pipeline = gpu.pipeline(&norm_grad_columns_shader(centered, has_weight, has_bias))?;
    let mut buffers: SmallVec<[&DeviceTensor; 8]> = smallvec::smallvec![inputs[0]];
    if has_weight {
        // x, then the statistics: every input but g and the weight.
        buffers.extend(inputs[1..fixed].iter().copied());
    }
    buffers.push(&partial);
    let (w_offset, b_offset) = (0, if has_weight { width32 } else { 0 });
    let (gx, gy) = grid(groups32);
    let params = [
        rows32,
        width32,
        chunk_rows32,
        chunks32,
        blocks32,
        gx,
        w_offset,
        b_offset,
        partial_width,
    ];
    launch(gpu, &pipeline, &buffers, &params, (gx, gy, 1))?;
    drop(buffers);

    // The second pass: each output sums its columns of every chunk.
    let pipeline = gpu.pipeline(&shader::part_sums())?;
    let (gx, gy) = grid(width32.div_ceil(WORKGROUP));
    let offsets = [(has_weight, w_offset), (has_bias, b_offset)];
    for (meta, (_, offset)) in outputs[1..]
        .iter()
        .zip(offsets.iter().filter(|(on, _)| *on))
    {
        let sums = gpu.alloc(meta.clone())?;
        let params = [width32, gx * WORKGROUP, chunks32, partial_width, *offset];
        launch(gpu, &pipeline, &[&partial, &sums], &params, (gx, gy, 1))?;
        produced.push(sums);
    }
    Ok(Some(produced))
}

// ---------------------------------------------------------------------------
// Squared norm.

/// Elements one workgroup of the squared norm's first pass sums.
const SPAN: u32 = 16 * WORKGROUP;

/// The first pass of `Σ x²`: workgroup `b` sums `x[b·SPAN ..][..SPAN]`'s
/// squares (strided over its lanes, then a tree) into `partial[offset +
/// b]`. `params`: `[count, offset, row_width_in_groups]`.
fn squared_sum_shader() -> String {
    format!(
        r#"
@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> partial: array<f32>;
@group(0) @binding(2) var<storage, read> params: array<u32>;
{TREE}
@compute @workgroup_size({WORKGROUP})
fn main(@builtin(workgroup_id) group: vec3<u32>,
        @builtin(local_invocation_index) lane: u32) {{
    let block = group.x + group.y * params[2];
    let count = params[0];
    let live = block < (count + {SPAN}u - 1u) / {SPAN}u;
    var acc = 0.0;
    if (live) {{
        let end = min(block * {SPAN}u + {SPAN}u, count);
        for (var e = block * {SPAN}u + lane; e < end; e = e + {WORKGROUP}u) {{
            let v = x[e];
            acc = acc + v * v;
        }}
    }}
    let total = tree_sum(acc, lane);
    if (live && lane == 0u) {{ partial[params[1] + block] = total; }}
}}
"#
    )
}

/// A sum over the [`WORKGROUP`] lanes of a workgroup, in uniform control
/// flow.
const TREE: &str = r#"
var<workgroup> lanes: array<f32, 256>;

fn tree_sum(value: f32, lane: u32) -> f32 {
    lanes[lane] = value;
    workgroupBarrier();
    for (var w = 128u; w > 0u; w = w / 2u) {
        if (lane < w) { lanes[lane] = lanes[lane] + lanes[lane + w]; }
        workgroupBarrier();
    }
    return lanes[0];
}
"#;

/// The second pass: one workgroup adds every partial sum into `out[0]`.
/// `params`: `[partials]`.
fn partial_total_shader() -> String {
    format!(
        r#"
@group(0) @binding(0) var<storage, read> partial: array<f32>;
@group(0) @binding(1) var<storage, read_write> out: array<f32>;
@group(0) @binding(2) var<storage, read> params: array<u32>;
{TREE}
@compute @workgroup_size({WORKGROUP})
fn main(@builtin(local_invocation_index) lane: u32) {{
    var acc = 0.0;
    for (var k = lane; k < params[0]; k = k + {WORKGROUP}u) {{
        acc = acc + partial[k];
    }}
    let total = tree_sum(acc, lane);
    if (lane == 0u) {{ out[0] = total; }}
}}
"#
    )
}

fn squared_norm_launch(
    gpu: &'static Gpu,
    inputs: &[&DeviceTensor],
    out: &TensorMetadata,
) -> Result<Option<Outputs>> {
    let mut counts = Vec::with_capacity(inputs.len());
    for x in inputs {
        match small(x.metadata().shape.numel()) {
            Some(n) => counts.push(n),
            None => return Ok(None),
        }
    }
    let blocks: Vec<u32> = counts.iter().map(|n| n.div_ceil(SPAN)).collect();
    let Some(total) = small(blocks.iter().map(|&b| b as usize).sum()) else {
        return Ok(None);
    };
    let partial = gpu.alloc(f32_meta(&[total as usize]))?;
    let pipeline = gpu.pipeline(&squared_sum_shader())?;
    let mut offset = 0;
    for ((x, &count), &b) in inputs.iter().zip(&counts).zip(&blocks) {
        let (gx, gy) = grid(b);
        launch(
            gpu,
            &pipeline,
            &[*x, &partial],
            &[count, offset, gx],
            (gx, gy, 1),
        )?;
        offset += b;
    }
    let y = gpu.alloc(out.clone())?;
    let pipeline = gpu.pipeline(&partial_total_shader())?;
    launch(gpu, &pipeline, &[&partial, &y], &[total], (1, 1, 1))?;
    Ok(Some(one(y)))
}

// ---------------------------------------------------------------------------
// Attention.

/// The side of an attention tile: queries (or keys) per workgroup, keys
/// (or queries) per step, and features per step of a dot product.
const TILE: u32 = 16;

/// What every attention shader shares: `params` is `[heads, t, s, d, dv,
/// causal, scale (f32 bits), row_width_in_groups, blocks_per_head,
/// interleaved]` (interleaved: see `AttentionGeometry`); four
/// [`TILE`]² tiles of workgroup memory; and the exponential.
fn attention_common() -> String {
    format!(
        r#"{PRELUDE}
const B: u32 = {TILE}u;
var<workgroup> tile_a: array<array<f32, {TILE}>, {TILE}>;
var<workgroup> tile_b: array<array<f32, {TILE}>, {TILE}>;
var<workgroup> tile_p: array<array<f32, {TILE}>, {TILE}>;

fn max_nan(a: f32, b: f32) -> f32 {{
    return select(select(b, a, a > b), sc_nan(), sc_isnan(a) || sc_isnan(b));
}}

// e^x as the CPU's attention kernel computes it (Cody–Waite reduction and
// the degree-7 Taylor polynomial, 0 below the smallest normal's logarithm,
// NaN for NaN), rather than a builtin whose error Vulkan lets grow with
// |x|. Attention exponentiates only scores minus a maximum or a
// log-sum-exp at least as large.
fn att_exp(x: f32) -> f32 {{
    if (sc_isnan(x)) {{ return sc_nan(); }}
    if (x < -87.33655) {{ return 0.0; }}
    let c = min(x, 88.0);
    let n = round(c * 1.4426950408889634);
    var r = fma(n, -0.6933594, c);
    r = fma(n, 2.1219444e-4, r);
    var p = 1.0 / 5040.0;
    p = fma(p, r, 1.0 / 720.0);
    p = fma(p, r, 1.0 / 120.0);
    p = fma(p, r, 1.0 / 24.0);
    p = fma(p, r, 1.0 / 6.0);
    p = fma(p, r, 0.5);
    p = fma(p, r, 1.0);
    p = fma(p, r, 1.0);
    return ldexp(p, i32(n));
}}
"#
    )
}

/// The head of every attention shader's `main`: the sizes from `params`,
/// and the head and tile this workgroup owns, its first row (query or
/// key) named `tile_start`. `o_base` starts the head's rows of `o` and of
/// `dO`, which share a layout.
fn attention_main(tile_start: &str) -> String {
    format!(
        r#"
@compute @workgroup_size({TILE}, {TILE})
fn main(@builtin(workgroup_id) group: vec3<u32>,
        @builtin(local_invocation_id) local: vec3<u32>) {{
    let t = params[1];
    let s = params[2];
    let d = params[3];
    let dv = params[4];
    let causal = params[5] != 0u;
    let scale = bitcast<f32>(params[6]);
    let blocks = params[8];
    let flat = group.x + group.y * params[7];
    let live = flat < params[0] * blocks;
    let head = flat / blocks;
    let {tile_start} = (flat % blocks) * B;
    let row = local.y;
    let col = local.x;
    // Heads whose rows interleave (`H` for the "bthd" layout, else 1):
    // row `i` of this head is `ld` (or `ldv`) values after row `i - 1`.
    let per = params[9];
    let unit = head / per;
    let within = head % per;
    let ld = per * d;
    let ldv = per * dv;
    let q_base = (unit * t * per + within) * d;
    let k_base = (unit * s * per + within) * d;
    let v_base = (unit * s * per + within) * dv;
    let o_base = (unit * t * per + within) * dv;
    let l_base = unit * t * per + within;"#
    )
}

/// The forward pass: one workgroup per (head, tile of queries), thread
/// `(x, y)` = (key or value column in the tile, query in the tile).
fn attention_forward_shader() -> String {
    format!(
        r#"{common}
@group(0) @binding(0) var<storage, read> q: array<f32>;
@group(0) @binding(1) var<storage, read> k: array<f32>;
@group(0) @binding(2) var<storage, read> v: array<f32>;
@group(0) @binding(3) var<storage, read_write> o: array<f32>;
@group(0) @binding(4) var<storage, read_write> lse: array<f32>;
@group(0) @binding(5) var<storage, read> params: array<u32>;

{main}
    let i = i0 + row;
    let row_live = live && i < t;
    // Keys past the tile's last query are masked for all its queries.
    let key_end = select(0u, select(s, min(s, i0 + B), causal), live);
    var m = -sc_inf();
    var l = 0.0;
    for (var j0 = 0u; j0 < key_end; j0 = j0 + B) {{
        // Scores: the queries scaled first, as on the CPU.
        var acc = 0.0;
        for (var c0 = 0u; c0 < d; c0 = c0 + B) {{
            let c = c0 + col;
            var qv = 0.0;
            if (row_live && c < d) {{ qv = q[q_base + i * ld + c] * scale; }}
            tile_a[row][col] = qv;
            var kv = 0.0;
            if (j0 + row < s && c < d) {{ kv = k[k_base + (j0 + row) * ld + c]; }}
            tile_b[row][col] = kv;
            workgroupBarrier();
            for (var u = 0u; u < B; u = u + 1u) {{ acc = fma(tile_a[row][u], tile_b[col][u], acc); }}
            workgroupBarrier();
        }}
        let j = j0 + col;
        // Masked scores are -inf, so that the maximum skips them and their
        // probabilities are exact zeros.
        let score = select(acc, -sc_inf(), j >= s || (causal && j > i));
        tile_p[row][col] = score;
        workgroupBarrier();
        var top = -sc_inf();
        for (var u = 0u; u < B; u = u + 1u) {{ top = max_nan(top, tile_p[row][u]); }}
        let new_m = max_nan(m, top);
        // A query none of whose keys so far has a finite score keeps a
        // zero sum (exp(-inf - -inf) would be NaN).
        let base = select(new_m, 0.0, new_m == -sc_inf());
        let alpha = att_exp(m - base);
        let p = att_exp(score - base);
        workgroupBarrier();
        tile_p[row][col] = p;
        workgroupBarrier();
        var tile_sum = 0.0;
        for (var u = 0u; u < B; u = u + 1u) {{ tile_sum = tile_sum + tile_p[row][u]; }}
        l = fma(l, alpha, tile_sum);
        m = new_m;
        for (var e0 = 0u; e0 < dv; e0 = e0 + B) {{
            let e = e0 + col;
            var vv = 0.0;
            if (j0 + row < s && e < dv) {{ vv = v[v_base + (j0 + row) * ldv + e]; }}
            tile_b[row][col] = vv;
            workgroupBarrier();
            var sum = 0.0;
            for (var u = 0u; u < B; u = u + 1u) {{ sum = fma(tile_p[row][u], tile_b[u][col], sum); }}
            if (row_live && e < dv) {{
                let at = o_base + i * ldv + e;
                // The output is fresh memory until the first tile writes it.
                if (j0 == 0u) {{ o[at] = sum; }} else {{ o[at] = fma(o[at], alpha, sum); }}
            }}
            workgroupBarrier();
        }}
    }}
    if (row_live) {{
        // No key with a finite score: an empty sum of weighted values.
        let empty = l == 0.0;
        let inverse = 1.0 / l;
        for (var e = col; e < dv; e = e + B) {{
            let at = o_base + i * ldv + e;
            o[at] = select(o[at] * inverse, 0.0, empty);
        }}
        if (col == 0u) {{ lse[l_base + i * per] = select(m + log(l), -sc_inf(), empty); }}
    }}
}}
"#,
        common = attention_common(),
        main = attention_main("i0")
    )
}

/// The backward pass's row statistics: `stats[2r] = L[r]`, `stats[2r + 1]
/// = Δ[r] = Σ dO[r]·O[r]`, one thread per query row. `params`: `[rows,
/// dv, row_width]`.
fn attention_stats_shader() -> String {
    format!(
        r#"
@group(0) @binding(0) var<storage, read> d_o: array<f32>;
@group(0) @binding(1) var<storage, read> o: array<f32>;
@group(0) @binding(2) var<storage, read> lse: array<f32>;
@group(0) @binding(3) var<storage, read_write> stats: array<f32>;
@group(0) @binding(4) var<storage, read> params: array<u32>;

@compute @workgroup_size({WORKGROUP})
fn main(@builtin(global_invocation_id) id: vec3<u32>) {{
    let r = id.x + id.y * params[2];
    if (r >= params[0]) {{ return; }}
    let dv = params[1];
    var delta = 0.0;
    for (var e = 0u; e < dv; e = e + 1u) {{ delta = fma(d_o[r * dv + e], o[r * dv + e], delta); }}
    stats[2u * r] = lse[r];
    stats[2u * r + 1u] = delta;
}}
"#
    )
}

/// `dq = scale·dS·k` with `dS = P ∘ (dO·vᵀ − Δ)`, `P = exp(q·(scale·k)ᵀ −
/// L)`: one workgroup per (head, tile of queries), thread `(x, y)` = (key
/// or feature in the tile, query in the tile). `params` as the forward
/// pass's.
fn attention_dq_shader() -> String {
    format!(
        r#"{common}
@group(0) @binding(0) var<storage, read> d_o: array<f32>;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> k: array<f32>;
@group(0) @binding(3) var<storage, read> v: array<f32>;
@group(0) @binding(4) var<storage, read> stats: array<f32>;
@group(0) @binding(5) var<storage, read_write> dq: array<f32>;
@group(0) @binding(6) var<storage, read> params: array<u32>;

{main}
    let i = i0 + row;
    let row_live = live && i < t;
    let key_end = select(0u, select(s, min(s, i0 + B), causal), live);
    var li = 0.0;
    var delta = 0.0;
    if (row_live) {{
        li = stats[2u * (l_base + i * per)];
        delta = stats[2u * (l_base + i * per) + 1u];
    }}
    for (var j0 = 0u; j0 < key_end; j0 = j0 + B) {{
        var acc = 0.0;
        for (var c0 = 0u; c0 < d; c0 = c0 + B) {{
            let c = c0 + col;
            var qv = 0.0;
            if (row_live && c < d) {{ qv = q[q_base + i * ld + c]; }}
            tile_a[row][col] = qv;
            var kv = 0.0;
            if (j0 + row < s && c < d) {{ kv = k[k_base + (j0 + row) * ld + c] * scale; }}
            tile_b[row][col] = kv;
            workgroupBarrier();
            for (var u = 0u; u < B; u = u + 1u) {{ acc = fma(tile_a[row][u], tile_b[col][u], acc); }}
            workgroupBarrier();
        }}
        var dp = 0.0;
        for (var e0 = 0u; e0 < dv; e0 = e0 + B) {{
            let e = e0 + col;
            var gv = 0.0;
            if (row_live && e < dv) {{ gv = d_o[o_base + i * ldv + e]; }}
            tile_a[row][col] = gv;
            var vv = 0.0;
            if (j0 + row < s && e < dv) {{ vv = v[v_base + (j0 + row) * ldv + e]; }}
            tile_b[row][col] = vv;
            workgroupBarrier();
            for (var u = 0u; u < B; u = u + 1u) {{ dp = fma(tile_a[row][u], tile_b[col][u], dp); }}
            workgroupBarrier();
        }}
        let j = j0 + col;
        let masked = !row_live || j >= s || (causal && j > i);
        let p = att_exp(acc - li);
        tile_p[row][col] = select(p * (dp - delta) * scale, 0.0, masked);
        for (var c0 = 0u; c0 < d; c0 = c0 + B) {{
            let c = c0 + col;
            var kv = 0.0;
            if (j0 + row < s && c < d) {{ kv = k[k_base + (j0 + row) * ld + c]; }}
            tile_b[row][col] = kv;
            workgroupBarrier();
            var sum = 0.0;
            for (var u = 0u; u < B; u = u + 1u) {{ sum = fma(tile_p[row][u], tile_b[u][col], sum); }}
            if (row_live && c < d) {{
                let at = q_base + i * ld + c;
                if (j0 == 0u) {{ dq[at] = sum; }} else {{ dq[at] = dq[at] + sum; }}
            }}
            workgroupBarrier();
        }}
    }}
}}
"#,
        common = attention_common(),
        main = attention_main("i0")
    )
}

/// `dv = Pᵀ·dO` and `dk = scale·dSᵀ·q`: one workgroup per (head, tile of
/// keys) over the tiles of queries that see them, thread `(x, y)` =
/// (query or feature in the tile, key in the tile). `params` as the
/// forward pass's, with `blocks_per_head` counting tiles of keys.
fn attention_dkdv_shader() -> String {
    format!(
        r#"{common}
@group(0) @binding(0) var<storage, read> d_o: array<f32>;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> k: array<f32>;
@group(0) @binding(3) var<storage, read> v: array<f32>;
@group(0) @binding(4) var<storage, read> stats: array<f32>;
@group(0) @binding(5) var<storage, read_write> dk: array<f32>;
@group(0) @binding(6) var<storage, read_write> dv_out: array<f32>;
@group(0) @binding(7) var<storage, read> params: array<u32>;

{main}
    let j = j0 + row;
    let key_live = live && j < s;
    // Queries before the tile's first key see none of its keys.
    let first = select(0u, j0, causal);
    let query_end = select(0u, t, live);
    for (var i0 = first; i0 < query_end; i0 = i0 + B) {{
        let i = i0 + col;
        let query_live = i < t;
        // Scores transposed (keys by queries), with the keys scaled as in
        // the other passes.
        var acc = 0.0;
        for (var c0 = 0u; c0 < d; c0 = c0 + B) {{
            let c = c0 + col;
            var qv = 0.0;
            if (i0 + row < t && c < d) {{ qv = q[q_base + (i0 + row) * ld + c]; }}
            tile_a[row][col] = qv;
            var kv = 0.0;
            if (key_live && c < d) {{ kv = k[k_base + j * ld + c] * scale; }}
            tile_b[row][col] = kv;
            workgroupBarrier();
            for (var u = 0u; u < B; u = u + 1u) {{ acc = fma(tile_a[col][u], tile_b[row][u], acc); }}
            workgroupBarrier();
        }}
        var li = 0.0;
        var delta = 0.0;
        if (query_live) {{
            li = stats[2u * (l_base + i * per)];
            delta = stats[2u * (l_base + i * per) + 1u];
        }}
        let masked = !key_live || !query_live || (causal && j > i);
        let p = select(att_exp(acc - li), 0.0, masked);
        tile_p[row][col] = p;
        // dv += Pᵀ·dO
        for (var e0 = 0u; e0 < dv; e0 = e0 + B) {{
            let e = e0 + col;
            var gv = 0.0;
            if (i0 + row < t && e < dv) {{ gv = d_o[o_base + (i0 + row) * ldv + e]; }}
            tile_a[row][col] = gv;
            workgroupBarrier();
            var sum = 0.0;
            for (var u = 0u; u < B; u = u + 1u) {{ sum = fma(tile_p[row][u], tile_a[u][col], sum); }}
            if (key_live && e < dv) {{
                let at = v_base + j * ldv + e;
                if (i0 == first) {{ dv_out[at] = sum; }} else {{ dv_out[at] = dv_out[at] + sum; }}
            }}
            workgroupBarrier();
        }}
        // dPᵀ = v·dOᵀ
        var dp = 0.0;
        for (var e0 = 0u; e0 < dv; e0 = e0 + B) {{
            let e = e0 + col;
            var gv = 0.0;
            if (i0 + row < t && e < dv) {{ gv = d_o[o_base + (i0 + row) * ldv + e]; }}
            tile_a[row][col] = gv;
            var vv = 0.0;
            if (key_live && e < dv) {{ vv = v[v_base + j * ldv + e]; }}
            tile_b[row][col] = vv;
            workgroupBarrier();
            for (var u = 0u; u < B; u = u + 1u) {{ dp = fma(tile_a[col][u], tile_b[row][u], dp); }}
            workgroupBarrier();
        }}
        tile_p[row][col] = select(p * (dp - delta) * scale, 0.0, masked);
        // dk += dSᵀ·q
        for (var c0 = 0u; c0 < d; c0 = c0 + B) {{
            let c = c0 + col;
            var qv = 0.0;
            if (i0 + row < t && c < d) {{ qv = q[q_base + (i0 + row) * ld + c]; }}
            tile_a[row][col] = qv;
            workgroupBarrier();
            var sum = 0.0;
            for (var u = 0u; u < B; u = u + 1u) {{ sum = fma(tile_p[row][u], tile_a[u][col], sum); }}
            if (key_live && c < d) {{
                let at = k_base + j * ld + c;
                if (i0 == first) {{ dk[at] = sum; }} else {{ dk[at] = dk[at] + sum; }}
            }}
            workgroupBarrier();
        }}
    }}
    // Keys no query sees (causal, more keys than queries) get nothing.
    if (key_live && first >= query_end) {{
        for (var c = col; c < d; c = c + B) {{ dk[k_base + j * ld + c] = 0.0; }}
        for (var e = col; e < dv; e = e + B) {{ dv_out[v_base + j * ldv + e] = 0.0; }}
    }}
}}
"#,
        common = attention_common(),
        main = attention_main("j0")
    )
}

/// The sizes of an attention call as shader words.
struct AttentionSizes {
    heads: u32,
    t: u32,
    s: u32,
    d: u32,
    dv: u32,
    causal: bool,
    scale: f32,
    interleaved: u32,
}

impl AttentionSizes {
    /// `None` for what the CPU's kernel takes: indices beyond `u32`, and
    /// empty dimensions (which do not reach here: an empty input goes to
    /// the CPU first).
    fn of(inputs: &[&DeviceTensor], attrs: &Attrs<'_>) -> Option<AttentionSizes> {
        let metas: Vec<TensorMetadata> = inputs.iter().map(|t| t.metadata().clone()).collect();
        // A bad call is the CPU kernel's to report.
        let g = stagecraft_ops::attention_geometry(&metas, attrs).ok()?;
        if [g.heads, g.t, g.s, g.d, g.dv].contains(&0) {
            return None;
        }
        let widest = g.d.max(g.dv);
        let [heads, t, s, d, dv, _, _] = words([
            g.heads,
            g.t,
            g.s,
            g.d,
            g.dv,
            g.heads.checked_mul(g.t)?.checked_mul(widest)?,
            g.heads.checked_mul(g.s)?.checked_mul(widest)?,
        ])?;
        small(2 * g.heads * g.t)?;
        Some(AttentionSizes {
            heads,
            t,
            s,
            d,
            dv,
            causal: g.causal,
            scale: g.scale as f32,
            interleaved: u32::try_from(g.interleaved).ok()?,
        })
    }

    /// The launch's `params` and grid for `rows` rows (queries or keys)
    /// a head, one workgroup per tile of them.
    fn launch_shape(&self, rows: u32) -> ([u32; 10], (u32, u32, u32)) {
        let blocks = rows.div_ceil(TILE);
        let (gx, gy) = grid(self.heads * blocks);
        let params = [
            self.heads,
            self.t,
            self.s,
            self.d,
            self.dv,
            self.causal as u32,
            self.scale.to_bits(),
            gx,
            blocks,
            self.interleaved,
        ];
        (params, (gx, gy, 1))
    }
}

fn attention_launch(
    gpu: &'static Gpu,
    attrs: &Attrs<'_>,
    inputs: &[&DeviceTensor],
    outputs: &[TensorMetadata],
) -> Result<Option<Outputs>> {
    if inputs.len() != 3 || outputs.len() != 2 {
        return Ok(None);
    }
    let Some(sizes) = AttentionSizes::of(inputs, attrs) else {
        return Ok(None);
    };
    let pipeline = gpu.pipeline(&attention_forward_shader())?;
    let o = gpu.alloc(outputs[0].clone())?;
    let lse = gpu.alloc(outputs[1].clone())?;
    let (params, groups) = sizes.launch_shape(sizes.t);
    launch(
        gpu,
        &pipeline,
        &[inputs[0], inputs[1], inputs[2], &o, &lse],
        &params,
        groups,
    )?;
    Ok(Some([o, lse].into_iter().collect()))
}

fn attention_grad_launch(
    gpu: &'static Gpu,
    attrs: &Attrs<'_>,
    inputs: &[&DeviceTensor],
    outputs: &[TensorMetadata],
) -> Result<Option<Outputs>> {
    if inputs.len() != 6 || outputs.len() != 3 {
        return Ok(None);
    }
    let [d_o, q, k, v, o, lse] = [0, 1, 2, 3, 4, 5].map(|i| inputs[i]);
    let Some(sizes) = AttentionSizes::of(&[q, k, v], attrs) else {
        return Ok(None);
    };
    let rows = sizes.heads * sizes.t;
    let stats = gpu.alloc(f32_meta(&[2 * rows as usize]))?;
    let pipeline = gpu.pipeline(&attention_stats_shader())?;
    let (gx, gy) = grid(rows.div_ceil(WORKGROUP));
    launch(
        gpu,
        &pipeline,
        &[d_o, o, lse, &stats],
        &[rows, sizes.dv, gx * WORKGROUP],
        (gx, gy, 1),
    )?;

    let dq = gpu.alloc(outputs[0].clone())?;
    let pipeline = gpu.pipeline(&attention_dq_shader())?;
    let (params, groups) = sizes.launch_shape(sizes.t);
    launch(
        gpu,
        &pipeline,
        &[d_o, q, k, v, &stats, &dq],
        &params,
        groups,
    )?;

    let dk = gpu.alloc(outputs[1].clone())?;
    let dv = gpu.alloc(outputs[2].clone())?;
    let pipeline = gpu.pipeline(&attention_dkdv_shader())?;
    let (params, groups) = sizes.launch_shape(sizes.s);
    launch(
        gpu,
        &pipeline,
        &[d_o, q, k, v, &stats, &dk, &dv],
        &params,
        groups,
    )?;
    Ok(Some([dq, dk, dv].into_iter().collect()))
}

/// Every shader this module generates, for tests that check they compile.
#[cfg(test)]
fn every_shader() -> Vec<(String, String)> {
    let mut sources = Vec::new();
    for w in [false, true] {
        sources.push((format!("RmsNorm {w}"), rms_norm_shader(w)));
        for centered in [false, true] {
            sources.push((
                format!("rows {centered} {w}"),
                norm_grad_rows_shader(centered, w),
            ));
            for b in [false, true] {
                if w || (b && centered) {
                    sources.push((
                        format!("columns {centered} {w} {b}"),
                        norm_grad_columns_shader(centered, w, b),
                    ));
                }
            }
        }
    }
    sources.push(("column sums".into(), shader::part_sums()));
    sources.push(("squared sum".into(), squared_sum_shader()));
    sources.push(("partial total".into(), partial_total_shader()));
    sources.push(("attention".into(), attention_forward_shader()));
    sources.push(("attention stats".into(), attention_stats_shader()));
    sources.push(("attention dq".into(), attention_dq_shader()));
    sources.push(("attention dk dv".into(), attention_dkdv_shader()));
    sources
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run;
    use stagecraft_ops::OpAttrs;
    use stagecraft_tensor::DenseHostTensor;

    fn gpu() -> &'static Gpu {
        Gpu::get(0).unwrap_or_else(|e| panic!("the GPU tests need gpu:0: {e}"))
    }

    #[test]
    fn every_transformer_shader_compiles() {
        let gpu = gpu();
        let shaders = every_shader();
        for (name, source) in &shaders {
            crate::compile(gpu, source).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        // Every binding is used: the pipelines' layouts come from the
        // shaders, and a binding they drop would fail the launch.
        for (name, source) in &shaders {
            let bindings = source.matches("@binding(").count();
            let names: Vec<&str> = source
                .lines()
                .filter(|l| l.contains("@binding("))
                .filter_map(|l| l.split("> ").nth(1)?.split(':').next())
                .collect();
            assert_eq!(names.len(), bindings, "{name}");
            for n in names {
                let indexed = source.match_indices(&format!("{n}[")).any(|(at, _)| {
                    let before = source[..at].chars().next_back();
                    !before.is_some_and(|c| c.is_alphanumeric() || c == '_')
                });
                assert!(indexed, "{name}: {n} is never read or written");
            }
        }
    }

    fn upload(gpu: &'static Gpu, values: &[f32], dims: &[usize]) -> DeviceTensor {
        gpu.upload(&DenseHostTensor::from_slice(values, dims).unwrap())
            .unwrap()
    }

    fn download(gpu: &Gpu, t: &DeviceTensor) -> Vec<f32> {
        gpu.download(t).unwrap().to_vec::<f32>().unwrap()
    }

    /// The column sums of a layer norm's gradient over more rows than one
    /// chunk holds (so several chunks are added) against sums in f64.
    #[test]
    fn weight_and_bias_gradients_sum_every_chunk() {
        let gpu = gpu();
        let (rows, width) = (1000usize, 70usize);
        let value = |i: usize, k: u32| (i as f32 * 0.618 + k as f32).sin() * 2.0;
        let g: Vec<f32> = (0..rows * width).map(|i| value(i, 1)).collect();
        let x: Vec<f32> = (0..rows * width).map(|i| value(i, 2)).collect();
        let mean: Vec<f32> = (0..rows).map(|r| value(r, 3) * 0.1).collect();
        let rstd: Vec<f32> = (0..rows).map(|r| 1.0 + value(r, 4).abs()).collect();
        let w: Vec<f32> = (0..width).map(|c| value(c, 5)).collect();
        let mut attrs = OpAttrs::new();
        attrs
            .set_bool("has_weight", true)
            .set_bool("has_bias", true);
        let def = &defs::LAYER_NORM_GRAD;
        let inputs = [
            upload(gpu, &g, &[rows, width]),
            upload(gpu, &x, &[rows, width]),
            upload(gpu, &mean, &[rows]),
            upload(gpu, &rstd, &[rows]),
            upload(gpu, &w, &[width]),
        ];
        let metas: Vec<TensorMetadata> = inputs.iter().map(|t| t.metadata().clone()).collect();
        let outputs = def.infer(&metas, &attrs).unwrap();
        let refs: Vec<&DeviceTensor> = inputs.iter().collect();
        let got = run(gpu, def, &Attrs::new(&attrs, def), &refs, &outputs)
            .unwrap()
            .expect("a GPU kernel");
        let (dw, db) = (download(gpu, &got[1]), download(gpu, &got[2]));
        for c in 0..width {
            let (mut want_w, mut want_b) = (0.0f64, 0.0f64);
            for r in 0..rows {
                let at = r * width + c;
                let xh = (x[at] - mean[r]) * rstd[r];
                want_w += g[at] as f64 * xh as f64;
                want_b += g[at] as f64;
            }
            let scale = rows as f64 * 4.0;
            assert!(((dw[c] as f64) - want_w).abs() < 1e-5 * scale, "dw[{c}]");
            assert!(((db[c] as f64) - want_b).abs() < 1e-5 * scale, "db[{c}]");
        }
    }

    /// Inputs the kernels do not take run on the CPU: other dtypes.
    #[test]
    fn other_dtypes_are_left_to_the_cpu() {
        let gpu = gpu();
        let x = gpu
            .upload(&DenseHostTensor::from_slice(&[1.0f64, 2.0], [1, 2]).unwrap())
            .unwrap();
        let mut attrs = OpAttrs::new();
        attrs.set_bool("has_weight", false);
        let def = &defs::RMS_NORM;
        let outputs = def.infer(&[x.metadata().clone()], &attrs).unwrap();
        let got = run(gpu, def, &Attrs::new(&attrs, def), &[&x], &outputs).unwrap();
        assert!(got.is_none());
    }
}
