//! Random draws on the GPU: dropout's mask, from the same Philox-4×32-10
//! stream as the CPU's kernel, so a seed drops the same elements on every
//! device (the survivors' scaling rounds once in f32 here, in f64 then
//! f32 on the CPU: at most one ulp apart).

use crate::context::Gpu;
use crate::kernels::{grid, launch, one, single, small, too_large, Outputs};
use crate::registry::{kernel, Accepts, GpuKernel};
use crate::shader::WORKGROUP;
use stagecraft_ops::{defs, dropout_threshold, Attrs};
use stagecraft_tensor::{DType, DeviceTensor, Result, TensorMetadata};

/// The entries of this family.
pub(crate) fn register(table: &mut Vec<GpuKernel>) {
    table.push(kernel(
        &defs::DROPOUT,
        Accepts::Exactly(&[DType::F32, DType::I64]),
        |g, _, a, i, o| single(o, |out| dropout_launch(g, a, i, out)),
    ));
}

/// Philox-4×32-10 in WGSL (the CPU's `philox4x32_10`): WGSL has no 64-bit
/// product, so the high word of `a·b` is assembled from 16-bit halves.
const PHILOX: &str = r#"
fn mulhilo(a: u32, b: u32) -> vec2<u32> {
    let al = a & 0xffffu;
    let ah = a >> 16u;
    let bl = b & 0xffffu;
    let bh = b >> 16u;
    let low_low = al * bl;
    let low_high = al * bh;
    let high_low = ah * bl;
    let middle = (low_low >> 16u) + (low_high & 0xffffu) + (high_low & 0xffffu);
    let high = ah * bh + (low_high >> 16u) + (high_low >> 16u) + (middle >> 16u);
    return vec2<u32>(high, a * b);
}

fn philox(counter: vec4<u32>, key: vec2<u32>) -> vec4<u32> {
    var c = counter;
    var k = key;
    for (var round = 0u; round < 10u; round++) {
        if (round > 0u) { k = k + vec2<u32>(0x9E3779B9u, 0xBB67AE85u); }
        let p0 = mulhilo(0xD2511F53u, c.x);
        let p1 = mulhilo(0xCD9E8D57u, c.z);
        c = vec4<u32>(p1.x ^ c.y ^ k.x, p1.y, p0.x ^ c.w ^ k.y, p0.y);
    }
    return c;
}
"#;

/// Dropout, one thread per Philox block (four elements). `params`:
/// `[count, row_width, key_lo, key_hi, offset_lo, offset_hi, threshold,
/// scale (f32 bits)]`.
fn dropout_shader() -> String {
    format!(
        r#"{PHILOX}
@group(0) @binding(0) var<storage, read> input: array<f32>;
@group(0) @binding(1) var<storage, read_write> output: array<f32>;
@group(0) @binding(2) var<storage, read> params: array<u32>;

@compute @workgroup_size({WORKGROUP})
fn main(@builtin(global_invocation_id) id: vec3<u32>) {{
    let block = id.x + id.y * params[1];
    let first = block * 4u;
    if (first >= params[0]) {{ return; }}
    // The counter is the 128-bit sum offset + block.
    let c0 = params[4] + block;
    let carry0 = select(0u, 1u, c0 < block);
    let c1 = params[5] + carry0;
    let carry1 = select(0u, 1u, c1 < carry0);
    let words = philox(vec4<u32>(c0, c1, carry1, 0u), vec2<u32>(params[2], params[3]));
    let scale = bitcast<f32>(params[7]);
    for (var lane = 0u; lane < 4u && first + lane < params[0]; lane++) {{
        let i = first + lane;
        output[i] = select(0.0, input[i] * scale, (words[lane] >> 8u) >= params[6]);
    }}
}}
"#
    )
}

/// The key is read on the host first (a download, which waits for the
/// queue, as indices are): its seed and offset become launch parameters,
/// and a negative offset is left to the CPU, which reports it.
fn dropout_launch(
    gpu: &'static Gpu,
    attrs: &Attrs<'_>,
    inputs: &[&DeviceTensor],
    out: &TensorMetadata,
) -> Result<Option<Outputs>> {
    let Some(count) = small(out.shape.numel()) else {
        return Err(too_large(out));
    };
    let key = gpu.download(inputs[1])?;
    let &[seed, offset] = key.as_slice::<i64>()? else {
        return Ok(None);
    };
    let Ok(offset) = u64::try_from(offset) else {
        return Ok(None);
    };
    let p = attrs.float("p")?;
    let seed = seed as u64;
    let (gx, gy) = grid(count.div_ceil(4).div_ceil(WORKGROUP));
    let params = [
        count,
        gx * WORKGROUP,
        seed as u32,
        (seed >> 32) as u32,
        offset as u32,
        (offset >> 32) as u32,
        dropout_threshold(p),
        ((1.0 / (1.0 - p)) as f32).to_bits(),
    ];
    let pipeline = gpu.pipeline(&dropout_shader())?;
    let y = gpu.alloc(out.clone())?;
    launch(gpu, &pipeline, &[inputs[0], &y], &params, (gx, gy, 1))?;
    Ok(Some(one(y)))
}
