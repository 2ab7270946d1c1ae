//! `Sort` and `TopK` on the GPU: one workgroup per row, a bitonic sort of
//! (value, position) pairs in workgroup memory.
//!
//! The order is the ops' one definition (`stagecraft_ops::SORT`): numbers
//! ascending with NaN after every number (first when descending), `-0.0`
//! equal to `0.0`, and equal values by position, which makes the
//! (unstable) bitonic network give the stable sort's answer. Rows longer
//! than [`ROW_MAX`] run on the CPU.

use crate::context::Gpu;
use crate::kernels::{grid, launch, small, too_large, Outputs};
use crate::registry::{kernel, Accepts, GpuKernel};
use crate::shader::{prelude_of, WORKGROUP};
use stagecraft_ops::{defs, Attrs};
use stagecraft_tensor::{normalize_axis, DType, DeviceTensor, Result, TensorMetadata};

/// The longest row sorted on the GPU: its values and positions fill the
/// 16 KiB of workgroup memory every WebGPU device has.
const ROW_MAX: usize = 2048;

/// The entries of this family: f32 and i32 values, i64 positions.
pub(crate) fn register(table: &mut Vec<GpuKernel>) {
    for x in [&[DType::F32], &[DType::I32]] {
        table.extend([
            kernel(&defs::SORT, Accepts::Exactly(x), |g, _, a, i, o| {
                let descending = a.bool("descending")?;
                sort_launch(g, a, i[0], o, descending, true)
            }),
            kernel(&defs::TOP_K, Accepts::Exactly(x), |g, _, a, i, o| {
                let descending = a.bool("largest")?;
                sort_launch(g, a, i[0], o, descending, a.bool("sorted")?)
            }),
        ]);
    }
}

/// The sort of rows of `n` (at most `size`, a power of two) values of
/// `ty`, writing the first `k` of each. `params`: `[n, inner, k,
/// descending, sorted, row_width]`; a row's values lie `inner` apart, and
/// with `sorted = 0` the `k` kept are written in their original order.
fn sort_source(ty: &str, size: usize) -> String {
    let prelude = prelude_of(ty);
    format!(
        r#"{prelude}
@group(0) @binding(0) var<storage, read> input: array<{ty}>;
@group(0) @binding(1) var<storage, read_write> values: array<{ty}>;
@group(0) @binding(2) var<storage, read_write> positions: array<u32>;
@group(0) @binding(3) var<storage, read> params: array<u32>;

const SIZE: u32 = {size}u;
var<workgroup> keys: array<{ty}, SIZE>;
var<workgroup> at: array<u32, SIZE>;

// Whether slot a goes before slot b. Padding (a position past the row)
// and, in the second pass, everything goes by position.
fn before(a: u32, b: u32, by_position: bool) -> bool {{
    let pa = at[a];
    let pb = at[b];
    if (by_position || pa >= params[0] || pb >= params[0]) {{ return pa < pb; }}
    let x = keys[a];
    let y = keys[b];
    let nx = sc_isnan(x);
    let ny = sc_isnan(y);
    let descending = params[3] != 0u;
    if (nx != ny) {{ return nx == descending; }}
    if (!nx && x != y) {{ return (x < y) != descending; }}
    return pa < pb;
}}

fn bitonic(lane: u32, by_position: bool) {{
    for (var size = 2u; size <= SIZE; size = size << 1u) {{
        for (var stride = size >> 1u; stride > 0u; stride = stride >> 1u) {{
            for (var t = lane; t < SIZE / 2u; t = t + {WORKGROUP}u) {{
                let lo = 2u * stride * (t / stride) + t % stride;
                let hi = lo + stride;
                let up = (lo & size) == 0u;
                if (before(hi, lo, by_position) == up) {{
                    let key = keys[lo];
                    keys[lo] = keys[hi];
                    keys[hi] = key;
                    let p = at[lo];
                    at[lo] = at[hi];
                    at[hi] = p;
                }}
            }}
            workgroupBarrier();
        }}
    }}
}}

@compute @workgroup_size({WORKGROUP})
fn main(@builtin(workgroup_id) group: vec3<u32>,
        @builtin(local_invocation_id) local: vec3<u32>) {{
    let row = group.x + group.y * params[5];
    let n = params[0];
    let inner = params[1];
    let k = params[2];
    let base = (row / inner) * n * inner + row % inner;
    for (var j = local.x; j < SIZE; j = j + {WORKGROUP}u) {{
        at[j] = j;
        if (j < n) {{ keys[j] = input[base + j * inner]; }}
    }}
    workgroupBarrier();
    bitonic(local.x, false);
    if (params[4] == 0u) {{
        // The k kept, back in their order in the row: the rest become
        // padding, and a sort by position brings the k first.
        for (var j = local.x; j < SIZE; j = j + {WORKGROUP}u) {{
            if (j >= k) {{ at[j] = n + j; }}
        }}
        workgroupBarrier();
        bitonic(local.x, true);
    }}
    let out_base = (row / inner) * k * inner + row % inner;
    for (var j = local.x; j < k; j = j + {WORKGROUP}u) {{
        let o = out_base + j * inner;
        values[o] = keys[j];
        positions[2u * o] = at[j];
        positions[2u * o + 1u] = 0u;
    }}
}}
"#
    )
}

/// `Sort` (`k = n`) and `TopK` along the `axis` attribute.
fn sort_launch(
    gpu: &'static Gpu,
    attrs: &Attrs<'_>,
    x: &DeviceTensor,
    outputs: &[TensorMetadata],
    descending: bool,
    sorted: bool,
) -> Result<Option<Outputs>> {
    let [values_meta, positions_meta] = outputs else {
        return Ok(None);
    };
    let meta = x.metadata();
    let dims = meta.shape.dims();
    let axis = normalize_axis(attrs.int("axis")? as isize, dims.len())?;
    let n = dims[axis];
    let k = values_meta.shape.dims()[axis];
    let inner: usize = dims[axis + 1..].iter().product();
    let rows = meta.shape.numel() / n;
    if n > ROW_MAX || positions_meta.dtype != DType::I64 {
        return Ok(None);
    }
    let (Some(n32), Some(k32), Some(inner32), Some(rows32), Some(_)) = (
        small(n),
        small(k),
        small(inner),
        small(rows),
        small(2 * positions_meta.shape.numel()),
    ) else {
        return Err(too_large(meta));
    };
    let ty = match meta.dtype {
        DType::F32 => "f32",
        DType::I32 => "i32",
        _ => return Ok(None),
    };
    let pipeline = gpu.pipeline(&sort_source(ty, n.next_power_of_two().max(2)))?;
    let values = gpu.alloc(values_meta.clone())?;
    let positions = gpu.alloc(positions_meta.clone())?;
    let (gx, gy) = grid(rows32);
    let params = [
        n32,
        inner32,
        k32,
        u32::from(descending),
        u32::from(sorted),
        gx,
    ];
    launch(
        gpu,
        &pipeline,
        &[x, &values, &positions],
        &params,
        (gx, gy, 1),
    )?;
    Ok(Some([values, positions].into_iter().collect()))
}
