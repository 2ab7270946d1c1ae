//! The GPU kernels of single ops, and [`run`], which launches them
//! through the kernel table ([`kernels`](fn@crate::kernels)). Anything
//! without a kernel runs on the CPU through the op handler's fallback
//! (with copies and a warning), so [`run`] says "no kernel" rather than
//! failing.

use crate::buffer::GpuBuffer;
use crate::context::{Gpu, Pipeline};
use crate::registry::{self, kernel, rules, Accepts, GpuKernel, Launch};
use crate::shader::{self, CastType, Combine, Element, MAX_RANK, TILE, WORKGROUP};
use smallvec::SmallVec;
use stagecraft_ops::{defs, Attrs, DTypeClass, Effect, OpDef, OpKind, ReduceOp};
use stagecraft_tensor::{DType, DeviceTensor, Error, Result, TensorMetadata};
use std::sync::Arc;

/// Output tensors of one launch.
pub type Outputs = SmallVec<[DeviceTensor; 1]>;

/// The most workgroups along one grid dimension (WebGPU's floor).
const MAX_GROUPS_PER_DIM: u32 = 65_535;

/// Runs `op` on the GPU if it has a kernel for these inputs and
/// attributes: `Ok(None)` when it has none (the caller runs it elsewhere).
/// The work is submitted, not waited for; the outputs may be read by later
/// kernels at once (the queue keeps order) and by the host through
/// [`Gpu::download`], which waits.
///
/// Which kernel runs is the table's answer for the op and the inputs'
/// dtypes ([`lookup`](crate::lookup)); before that, rules every op shares:
/// reshapes share their input's buffer, a pure op's empty results need no
/// launch, and side-effecting ops and empty inputs go to the CPU.
pub fn run(
    gpu: &'static Gpu,
    op: &'static OpDef,
    attrs: &Attrs<'_>,
    inputs: &[&DeviceTensor],
    outputs: &[TensorMetadata],
) -> Result<Option<Outputs>> {
    gpu.check_alive()?;
    // Reshapes move no data: the output shares the input's buffer.
    if std::ptr::eq(op, &defs::RESHAPE) && inputs.len() == 1 && outputs.len() == 1 {
        return share_launch(gpu, op, attrs, inputs, outputs);
    }
    if outputs.is_empty() {
        return Ok(None);
    }
    // Empty results of a pure op need no launch. Empty inputs with a
    // nonempty result (a max over nothing) go to the CPU's kernel, whose
    // answer or error is the op's.
    let pure = op.effect == Effect::Pure;
    if pure && outputs.iter().all(|o| o.shape.numel() == 0) {
        let empty: Result<Outputs> = outputs.iter().map(|o| gpu.alloc(o.clone())).collect();
        return empty.map(Some);
    }
    if !pure || inputs.iter().any(|t| t.metadata().shape.numel() == 0) {
        return Ok(None);
    }
    let dtypes: SmallVec<[DType; 4]> = inputs.iter().map(|t| t.metadata().dtype).collect();
    match registry::lookup(op, &dtypes) {
        Some(entry) => (entry.launch)(gpu, op, attrs, inputs, outputs),
        None => Ok(None),
    }
}

/// The entries of this module's kernels: the elementwise ops with a WGSL
/// form, the reductions, and the single ops below.
pub(crate) fn register(table: &mut Vec<GpuKernel>) {
    use Accepts::{AllF32, Exactly, Rule};
    use DType::{Bool, F32, I32};
    for &op in stagecraft_ops::all_ops() {
        if let Some(launch) = numeric_i32_launch(op) {
            let accepts: &'static [DType] = match op.kind {
                OpKind::Unary(_) => &[I32],
                _ => &[I32, I32],
            };
            table.push(kernel(op, Exactly(accepts), launch));
        }
        let launch: Launch = match op.kind {
            OpKind::Unary(unary) if unary.wgsl().is_some() => match Element::of(unary.class()) {
                Element::F32 => unary_entry,
                Element::I32 => {
                    table.push(kernel(op, Exactly(&[I32]), unary_i32_entry));
                    continue;
                }
                Element::PackedBool => {
                    table.push(kernel(op, Exactly(&[Bool]), bool_entry));
                    continue;
                }
            },
            OpKind::Binary(binary) if binary.wgsl().is_some() => {
                match Element::of(binary.class()) {
                    Element::F32 => binary_entry,
                    Element::I32 => {
                        table.push(kernel(op, Exactly(&[I32, I32]), binary_i32_entry));
                        continue;
                    }
                    Element::PackedBool => {
                        table.push(kernel(op, Exactly(&[Bool, Bool]), bool_entry));
                        continue;
                    }
                }
            }
            OpKind::Compare(_) => compare_entry,
            OpKind::Reduce(reduce) => {
                if reduce != ReduceOp::Mean {
                    table.push(kernel(op, Exactly(&[I32]), reduce_entry));
                }
                reduce_entry
            }
            _ => continue,
        };
        table.push(kernel(op, AllF32, launch));
    }
    for &op in stagecraft_ops::all_ops() {
        if let OpKind::Compare(_) = op.kind {
            table.push(kernel(op, Exactly(&[I32, I32]), compare_entry));
        }
    }
    table.extend([
        kernel(
            &defs::GELU_WITH_DERIVATIVE,
            AllF32,
            gelu_with_derivative_entry,
        ),
        kernel(&defs::RESHAPE, Rule(rules::any), share_launch),
        kernel(
            &defs::TRANSPOSE,
            Rule(rules::one_of_words),
            |g, _, a, i, o| copy_launch(g, Layout::Transpose, a, i, o),
        ),
        kernel(
            &defs::BROADCAST_TO,
            Rule(rules::one_of_words),
            |g, _, a, i, o| copy_launch(g, Layout::Broadcast, a, i, o),
        ),
        kernel(&defs::SLICE, Rule(rules::one_of_words), |g, _, a, i, o| {
            copy_launch(g, Layout::Slice, a, i, o)
        }),
        kernel(
            &defs::CROSS_ENTROPY,
            Exactly(&[F32, I32]),
            |g, _, a, i, o| cross_entropy_launch(g, a, i, o),
        ),
        kernel(
            &defs::CROSS_ENTROPY_GRAD,
            Exactly(&[F32, I32, F32, F32]),
            |g, _, a, i, o| match o.first() {
                Some(out) => cross_entropy_grad_launch(g, a, i, out),
                None => Ok(None),
            },
        ),
        kernel(&defs::LAYER_NORM, AllF32, |g, _, a, i, o| {
            layer_norm_launch(g, a, i, o)
        }),
        kernel(&defs::EMBEDDING, Rule(embedding_dtypes), |g, _, _, i, o| {
            single(o, |out| embedding_launch(g, i, out))
        }),
        kernel(&defs::FILL, Exactly(&[]), |g, _, a, _, o| {
            single(o, |out| fill_launch(g, a, out))
        }),
        kernel(&defs::ARANGE, Exactly(&[]), |g, _, a, _, o| {
            single(o, |out| arange_launch(g, a, out))
        }),
        kernel(&defs::PAD, Exactly(&[F32]), pad_entry),
        kernel(&defs::PAD, Exactly(&[I32]), pad_entry),
        kernel(&defs::CAST, Exactly(&[F32]), cast_entry),
        kernel(&defs::CAST, Exactly(&[I32]), cast_entry),
        kernel(&defs::CAST, Exactly(&[Bool]), cast_entry),
        kernel(&defs::CAST, Exactly(&[DType::I64]), cast_entry),
        kernel(&defs::SELECT, Rule(select_dtypes), |g, _, _, i, o| {
            single(o, |out| select_launch(g, i, out))
        }),
        kernel(&defs::MATMUL, AllF32, |g, _, a, i, o| {
            single_f32(o, |out| matmul_launch(g, a, i, out))
        }),
        kernel(&defs::SOFTMAX, AllF32, |g, _, a, i, o| {
            single_f32(o, |out| softmax_launch(g, false, a, i[0], out))
        }),
        kernel(&defs::LOG_SOFTMAX, AllF32, |g, _, a, i, o| {
            single_f32(o, |out| softmax_launch(g, true, a, i[0], out))
        }),
    ]);
}

/// `Embedding`'s table of a 4-byte dtype and its i32 or i64 ids.
fn embedding_dtypes(dtypes: &[DType]) -> bool {
    matches!(dtypes, [table, DType::I32 | DType::I64] if table.size_in_bytes() == 4)
}

/// `Select`'s bool condition and values of a 4-byte dtype.
fn select_dtypes(dtypes: &[DType]) -> bool {
    matches!(dtypes, [DType::Bool, a, b] if a.size_in_bytes() == 4 && b.size_in_bytes() == 4)
}

/// Runs `launch` on the one output of a single-output op; `Ok(None)` for
/// any other number of outputs.
pub(crate) fn single(
    outputs: &[TensorMetadata],
    launch: impl FnOnce(&TensorMetadata) -> Result<Option<Outputs>>,
) -> Result<Option<Outputs>> {
    match outputs {
        [out] => launch(out),
        _ => Ok(None),
    }
}

/// [`single`] for kernels that write f32 alone.
fn single_f32(
    outputs: &[TensorMetadata],
    launch: impl FnOnce(&TensorMetadata) -> Result<Option<Outputs>>,
) -> Result<Option<Outputs>> {
    single(outputs, |out| match out.dtype {
        DType::F32 => launch(out),
        _ => Ok(None),
    })
}

/// A reshape: the output is the input's buffer under the new shape.
fn share_launch(
    _: &'static Gpu,
    _: &'static OpDef,
    _: &Attrs<'_>,
    inputs: &[&DeviceTensor],
    outputs: &[TensorMetadata],
) -> Result<Option<Outputs>> {
    match (inputs, outputs) {
        ([x], [out]) => Ok(Some(one(x.with_metadata(out.clone())))),
        _ => Ok(None),
    }
}

/// A unary op from its WGSL expression.
fn unary_entry(
    gpu: &'static Gpu,
    op: &'static OpDef,
    _: &Attrs<'_>,
    inputs: &[&DeviceTensor],
    outputs: &[TensorMetadata],
) -> Result<Option<Outputs>> {
    let OpKind::Unary(unary) = op.kind else {
        return Ok(None);
    };
    single_f32(outputs, |out| match unary.wgsl() {
        Some(expression) => unary_launch(gpu, &shader::unary(expression), inputs[0], out),
        None => Ok(None),
    })
}

/// A binary op from its WGSL expression, over broadcast inputs.
fn binary_entry(
    gpu: &'static Gpu,
    op: &'static OpDef,
    _: &Attrs<'_>,
    inputs: &[&DeviceTensor],
    outputs: &[TensorMetadata],
) -> Result<Option<Outputs>> {
    let OpKind::Binary(binary) = op.kind else {
        return Ok(None);
    };
    single_f32(outputs, |out| match binary.wgsl() {
        Some(expression) => broadcast_launch(gpu, &shader::binary(expression), inputs, out, false),
        None => Ok(None),
    })
}

/// The i32 launch of a numeric elementwise op (one of both float and
/// integer dtypes): its `wgsl:` expression is written to read the same
/// over i32 (see `stagecraft_ops::unary_ops!`), and WGSL's i32 wraps as
/// the CPU's integer kernels do. `None` for other ops.
fn numeric_i32_launch(op: &'static OpDef) -> Option<Launch> {
    match op.kind {
        OpKind::Unary(unary) if unary.class() == DTypeClass::Numeric => {
            unary.wgsl().map(|_| unary_i32_entry as Launch)
        }
        OpKind::Binary(binary) if binary.class() == DTypeClass::Numeric => {
            binary.wgsl()?;
            Some(match std::ptr::eq(op, &defs::DIV) {
                true => divide_i32_entry,
                false => binary_i32_entry,
            })
        }
        _ => None,
    }
}

/// i32 division, where WGSL defines `a / 0` as `a` but the CPU reports a
/// zero divisor: the divisors are read on the host first (a download,
/// which waits for the queue, as indices are), and a zero sends the op to
/// the CPU, whose kernel gives the error.
fn divide_i32_entry(
    gpu: &'static Gpu,
    op: &'static OpDef,
    attrs: &Attrs<'_>,
    inputs: &[&DeviceTensor],
    outputs: &[TensorMetadata],
) -> Result<Option<Outputs>> {
    let divisors = gpu.download(inputs[1])?;
    if divisors.as_slice::<i32>()?.contains(&0) {
        return Ok(None);
    }
    binary_i32_entry(gpu, op, attrs, inputs, outputs)
}

/// A unary op over i32 from its WGSL expression.
fn unary_i32_entry(
    gpu: &'static Gpu,
    op: &'static OpDef,
    _: &Attrs<'_>,
    inputs: &[&DeviceTensor],
    outputs: &[TensorMetadata],
) -> Result<Option<Outputs>> {
    let (OpKind::Unary(unary), [out]) = (op.kind, outputs) else {
        return Ok(None);
    };
    let (Some(expression), DType::I32) = (unary.wgsl(), out.dtype) else {
        return Ok(None);
    };
    unary_launch(gpu, &shader::unary_i32(expression), inputs[0], out)
}

/// A binary op over broadcast i32s from its WGSL expression.
fn binary_i32_entry(
    gpu: &'static Gpu,
    op: &'static OpDef,
    _: &Attrs<'_>,
    inputs: &[&DeviceTensor],
    outputs: &[TensorMetadata],
) -> Result<Option<Outputs>> {
    let (OpKind::Binary(binary), [out]) = (op.kind, outputs) else {
        return Ok(None);
    };
    let (Some(expression), DType::I32) = (binary.wgsl(), out.dtype) else {
        return Ok(None);
    };
    broadcast_launch(gpu, &shader::binary_i32(expression), inputs, out, false)
}

/// A logical op over bools (packed four per word) from its WGSL
/// expression over 0/1 integers, with broadcasting.
fn bool_entry(
    gpu: &'static Gpu,
    op: &'static OpDef,
    _: &Attrs<'_>,
    inputs: &[&DeviceTensor],
    outputs: &[TensorMetadata],
) -> Result<Option<Outputs>> {
    let expression = match op.kind {
        OpKind::Unary(unary) => unary.wgsl(),
        OpKind::Binary(binary) => binary.wgsl(),
        _ => None,
    };
    let (Some(expression), [out]) = (expression, outputs) else {
        return Ok(None);
    };
    if out.dtype != DType::Bool {
        return Ok(None);
    }
    let source = shader::bool_elementwise(expression, inputs.len());
    broadcast_launch(gpu, &source, inputs, out, true)
}

/// A comparison of f32s or i32s (the table's entries say which) into
/// bools.
fn compare_entry(
    gpu: &'static Gpu,
    op: &'static OpDef,
    _: &Attrs<'_>,
    inputs: &[&DeviceTensor],
    outputs: &[TensorMetadata],
) -> Result<Option<Outputs>> {
    let OpKind::Compare(compare) = op.kind else {
        return Ok(None);
    };
    let source = match inputs[0].metadata().dtype {
        DType::I32 => shader::compare_i32(compare.wgsl()),
        _ => shader::compare(compare.wgsl()),
    };
    single(outputs, |out| {
        broadcast_launch(gpu, &source, inputs, out, true)
    })
}

/// A reduction over the axes of its `axes` attribute.
fn reduce_entry(
    gpu: &'static Gpu,
    op: &'static OpDef,
    attrs: &Attrs<'_>,
    inputs: &[&DeviceTensor],
    outputs: &[TensorMetadata],
) -> Result<Option<Outputs>> {
    let OpKind::Reduce(reduce) = op.kind else {
        return Ok(None);
    };
    single(outputs, |out| {
        reduce_launch(gpu, reduce, attrs, inputs[0], out)
    })
}

/// Constant padding of f32 or i32.
fn pad_entry(
    gpu: &'static Gpu,
    _: &'static OpDef,
    attrs: &Attrs<'_>,
    inputs: &[&DeviceTensor],
    outputs: &[TensorMetadata],
) -> Result<Option<Outputs>> {
    single(outputs, |out| pad_launch(gpu, attrs, inputs[0], out))
}

/// `Arange` of f32 or i32 where every value is an integer of at most
/// 2^24 in magnitude: computed in i32 there, each is exact in f32 too, as
/// the CPU's value (computed in f64, rounded once) is. Other ranges run
/// on the CPU.
fn arange_launch(
    gpu: &'static Gpu,
    attrs: &Attrs<'_>,
    out: &TensorMetadata,
) -> Result<Option<Outputs>> {
    let ty = match out.dtype {
        DType::F32 => "f32",
        DType::I32 => "i32",
        _ => return Ok(None),
    };
    let (start, step) = (attrs.float("start")?, attrs.float("step")?);
    let last = start + out.shape.numel().saturating_sub(1) as f64 * step;
    let exact = |v: f64| v.fract() == 0.0 && v.abs() <= f64::from(1u32 << 24);
    // -0.0 + 0·step is -0.0 on the CPU for a negative step; i32 has no -0.
    let signed_zero = start == 0.0 && start.is_sign_negative() && step < 0.0;
    if !(exact(start) && exact(step) && exact(last)) || signed_zero {
        return Ok(None);
    }
    let Some(count) = small(out.shape.numel()) else {
        return Err(too_large(out));
    };
    let pipeline = gpu.pipeline(&shader::arange(ty))?;
    let y = gpu.alloc(out.clone())?;
    let (gx, gy) = grid(count.div_ceil(WORKGROUP));
    let params = [
        count,
        gx * WORKGROUP,
        start as i32 as u32,
        step as i32 as u32,
    ];
    launch(gpu, &pipeline, &[&y], &params, (gx, gy, 1))?;
    Ok(Some(one(y)))
}

/// Casts among f32, i32, bool and i64.
fn cast_entry(
    gpu: &'static Gpu,
    _: &'static OpDef,
    _: &Attrs<'_>,
    inputs: &[&DeviceTensor],
    outputs: &[TensorMetadata],
) -> Result<Option<Outputs>> {
    single(outputs, |out| cast_launch(gpu, inputs[0], out))
}

/// Whether `op` may join a fused elementwise program the GPU runs: its
/// fused form is pasted from its WGSL expression, so an op without one
/// stays a node of its own (and runs on the CPU alone, not its group).
pub fn fuses(op: &'static OpDef) -> bool {
    let float = |class| Element::of(class) == Element::F32;
    match op.kind {
        OpKind::Unary(unary) => unary.wgsl().is_some() && float(unary.class()),
        OpKind::Binary(binary) => binary.wgsl().is_some() && float(binary.class()),
        _ => true,
    }
}

pub(crate) fn one(tensor: DeviceTensor) -> Outputs {
    [tensor].into_iter().collect()
}

/// A 2-D grid of at least `groups` workgroups and its row width in groups.
pub(crate) fn grid(groups: u32) -> (u32, u32) {
    if groups <= MAX_GROUPS_PER_DIM {
        (groups.max(1), 1)
    } else {
        (MAX_GROUPS_PER_DIM, groups.div_ceil(MAX_GROUPS_PER_DIM))
    }
}

/// `usize` → `u32` for a size a shader indexes with; larger sizes run on
/// the CPU.
pub(crate) fn small(value: usize) -> Option<u32> {
    u32::try_from(value).ok()
}

/// Binds `buffers` (then `params`) in order and dispatches `groups`.
pub(crate) fn launch(
    gpu: &'static Gpu,
    pipeline: &Pipeline,
    buffers: &[&DeviceTensor],
    params: &[u32],
    groups: (u32, u32, u32),
) -> Result<()> {
    let params_bytes: Vec<u8> = params.iter().flat_map(|p| p.to_le_bytes()).collect();
    let size = std::num::NonZeroU64::new(params_bytes.len() as u64);
    gpu.record_launch(&params_bytes, |chunk, offset, pass| {
        let mut entries = Vec::with_capacity(buffers.len() + 1);
        for (slot, tensor) in buffers.iter().enumerate() {
            entries.push(wgpu::BindGroupEntry {
                binding: slot as u32,
                resource: GpuBuffer::of(tensor)?.buffer().as_entire_binding(),
            });
        }
        entries.push(wgpu::BindGroupEntry {
            binding: buffers.len() as u32,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: chunk,
                offset,
                size,
            }),
        });
        let scope = gpu.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let bind_group = gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &pipeline.layout,
            entries: &entries,
        });
        if let Some(error) = pollster::block_on(scope.pop()) {
            return Err(gpu.device_error("a kernel launch failed", error));
        }
        pass.set_pipeline(&pipeline.pipeline);
        pass.set_bind_group(0, &bind_group, &[]);
        pass.dispatch_workgroups(groups.0, groups.1, groups.2);
        Ok(())
    })
}

fn unary_launch(
    gpu: &'static Gpu,
    source: &str,
    x: &DeviceTensor,
    out: &TensorMetadata,
) -> Result<Option<Outputs>> {
    let Some(count) = small(out.shape.numel()) else {
        return Err(too_large(out));
    };
    let pipeline = gpu.pipeline(source)?;
    let y = gpu.alloc(out.clone())?;
    let (gx, gy) = grid(count.div_ceil(WORKGROUP));
    launch(
        gpu,
        &pipeline,
        &[x, &y],
        &[count, gx * WORKGROUP],
        (gx, gy, 1),
    )?;
    Ok(Some(one(y)))
}

/// `GeluWithDerivative`: GELU's own expression and its derivative from
/// that value, one thread per element writing both outputs.
fn gelu_with_derivative_entry(
    gpu: &'static Gpu,
    _: &'static OpDef,
    _: &Attrs<'_>,
    inputs: &[&DeviceTensor],
    outputs: &[TensorMetadata],
) -> Result<Option<Outputs>> {
    let (Some(out), Some(gelu)) = (outputs.first(), stagecraft_ops::UnaryOp::Gelu.wgsl()) else {
        return Ok(None);
    };
    if outputs.iter().any(|o| o.dtype != DType::F32) {
        return Ok(None);
    }
    let Some(count) = small(out.shape.numel()) else {
        return Err(too_large(out));
    };
    let pipeline = gpu.pipeline(&shader::gelu_with_derivative(gelu))?;
    let (y, d) = (gpu.alloc(out.clone())?, gpu.alloc(out.clone())?);
    let (gx, gy) = grid(count.div_ceil(WORKGROUP));
    launch(
        gpu,
        &pipeline,
        &[inputs[0], &y, &d],
        &[count, gx * WORKGROUP],
        (gx, gy, 1),
    )?;
    Ok(Some([y, d].into_iter().collect()))
}

pub(crate) fn too_large(meta: &TensorMetadata) -> Error {
    Error::invalid(format!(
        "a GPU kernel indexes at most 2^32 elements; {meta} has more"
    ))
}

/// Row-major strides of `dims`.
pub(crate) fn strides_of(dims: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; dims.len()];
    for d in (0..dims.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * dims[d + 1];
    }
    strides
}

/// The strides of `input` read over `out`'s dimensions (0 along
/// dimensions it is broadcast over), aligned at the last axis.
pub(crate) fn broadcast_strides(input: &[usize], out: &[usize]) -> Vec<usize> {
    let own = strides_of(input);
    let lead = out.len() - input.len();
    (0..out.len())
        .map(|d| {
            if d < lead || input[d - lead] == 1 {
                0
            } else {
                own[d - lead]
            }
        })
        .collect()
}

/// Merges adjacent output dimensions along which every operand's strides
/// stay contiguous, and drops dimensions of size 1, so most broadcasts
/// index in one or two dimensions.
pub(crate) fn merge_dims(dims: &[usize], strides: &mut [Vec<usize>]) -> Vec<usize> {
    let mut merged: Vec<usize> = Vec::new();
    let mut merged_strides: Vec<Vec<usize>> = vec![Vec::new(); strides.len()];
    for d in 0..dims.len() {
        if dims[d] == 1 {
            continue;
        }
        let joins = !merged.is_empty()
            && strides.iter().zip(&merged_strides).all(|(s, m)| {
                let last = *m.last().expect("merged dims have strides");
                last == s[d] * dims[d]
            });
        if joins {
            let last = merged.len() - 1;
            merged[last] *= dims[d];
            for (s, m) in strides.iter().zip(merged_strides.iter_mut()) {
                *m.last_mut().expect("merged dims have strides") = s[d];
            }
        } else {
            merged.push(dims[d]);
            for (s, m) in strides.iter().zip(merged_strides.iter_mut()) {
                m.push(s[d]);
            }
        }
    }
    for (s, m) in strides.iter_mut().zip(merged_strides) {
        *s = m;
    }
    merged
}

/// An elementwise launch over broadcast inputs, each read through its own
/// strides: binary ops, comparisons (`packed`: four bool results a
/// thread) and select. `params`: `[count, row_width, rank, 0,
/// dims[MAX_RANK], then MAX_RANK strides per input]`.
fn broadcast_launch(
    gpu: &'static Gpu,
    source: &str,
    inputs: &[&DeviceTensor],
    out: &TensorMetadata,
    packed: bool,
) -> Result<Option<Outputs>> {
    let dims = out.shape.dims();
    let mut strides: Vec<Vec<usize>> = inputs
        .iter()
        .map(|t| broadcast_strides(t.metadata().shape.dims(), dims))
        .collect();
    let merged = merge_dims(dims, &mut strides);
    if merged.len() > MAX_RANK {
        return Ok(None);
    }
    let (Some(count), true) = (
        small(out.shape.numel()),
        merged
            .iter()
            .chain(strides.iter().flatten())
            .all(|&v| small(v).is_some()),
    ) else {
        return Err(too_large(out));
    };
    let pipeline = gpu.pipeline(source)?;
    let y = gpu.alloc(out.clone())?;
    let threads = if packed { count.div_ceil(4) } else { count };
    let (gx, gy) = grid(threads.div_ceil(WORKGROUP));
    let mut params = vec![0u32; 4 + (1 + inputs.len()) * MAX_RANK];
    params[..4].copy_from_slice(&[count, gx * WORKGROUP, merged.len() as u32, 0]);
    for (d, &dim) in merged.iter().enumerate() {
        params[4 + d] = dim as u32;
        for (k, s) in strides.iter().enumerate() {
            params[4 + (1 + k) * MAX_RANK + d] = s[d] as u32;
        }
    }
    let mut buffers: SmallVec<[&DeviceTensor; 4]> = inputs.iter().copied().collect();
    buffers.push(&y);
    launch(gpu, &pipeline, &buffers, &params, (gx, gy, 1))?;
    drop(buffers);
    Ok(Some(one(y)))
}

/// `Select` of 4-byte values by a bool condition.
fn select_launch(
    gpu: &'static Gpu,
    inputs: &[&DeviceTensor],
    out: &TensorMetadata,
) -> Result<Option<Outputs>> {
    if out.dtype.size_in_bytes() != 4 {
        return Ok(None);
    }
    broadcast_launch(gpu, &shader::select(), inputs, out, false)
}

/// How a strided copy reads its input.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Layout {
    /// `Transpose`: the input's strides permuted by `perm`.
    Transpose,
    /// `BroadcastTo`: stride 0 along broadcast dimensions.
    Broadcast,
    /// `Slice`: an offset and stepped strides.
    Slice,
}

/// Transposes, broadcasts and slices: one strided read per element of 4
/// or 8 bytes (narrower elements run on the CPU).
/// `x` with its dimensions permuted (`perm[i]` is the input dimension of
/// output dimension `i`), copied by the strided-copy kernel.
fn transposed(gpu: &'static Gpu, x: &DeviceTensor, perm: &[usize]) -> Result<Option<DeviceTensor>> {
    let dims = x.metadata().shape.dims();
    let out_dims: Vec<usize> = perm.iter().map(|&p| dims[p]).collect();
    let out = TensorMetadata::new(x.metadata().dtype, out_dims);
    let perm: Vec<i64> = perm.iter().map(|&p| p as i64).collect();
    let mut attrs = stagecraft_ops::OpAttrs::new();
    attrs.set_ints("perm", &perm);
    let produced = copy_launch(
        gpu,
        Layout::Transpose,
        &Attrs::new(&attrs, &defs::TRANSPOSE),
        &[x],
        &[out],
    )?;
    Ok(produced.and_then(|ys| ys.into_iter().next()))
}

fn copy_launch(
    gpu: &'static Gpu,
    layout: Layout,
    attrs: &Attrs<'_>,
    inputs: &[&DeviceTensor],
    outputs: &[TensorMetadata],
) -> Result<Option<Outputs>> {
    let (x, Some(out)) = (inputs[0], outputs.first()) else {
        return Ok(None);
    };
    let width: u32 = match out.dtype.size_in_bytes() {
        4 => 1,
        8 => 2,
        _ => return Ok(None),
    };
    let in_dims = x.metadata().shape.dims();
    let own = strides_of(in_dims);
    let out_dims = out.shape.dims();
    let (offset, strides): (usize, Vec<usize>) = match layout {
        Layout::Transpose => {
            let perm = defs::resolve_perm(attrs.ints("perm")?, in_dims.len())?;
            (0, perm.iter().map(|&p| own[p]).collect())
        }
        Layout::Broadcast => (0, broadcast_strides(in_dims, out_dims)),
        Layout::Slice => {
            let slices = defs::resolve_slice(attrs, &x.metadata().shape)?;
            let offset = slices.iter().zip(&own).map(|(s, st)| s.start * st).sum();
            (
                offset,
                slices.iter().zip(&own).map(|(s, st)| s.step * st).collect(),
            )
        }
    };
    let mut strides = vec![strides];
    let merged = merge_dims(out_dims, &mut strides);
    let words = out.shape.numel() * width as usize;
    if merged.len() > MAX_RANK {
        return Ok(None);
    }
    let (Some(words), Some(offset), true) = (
        small(words),
        small(offset),
        merged
            .iter()
            .chain(&strides[0])
            .all(|&v| small(v).is_some()),
    ) else {
        return Err(too_large(out));
    };
    let pipeline = gpu.pipeline(&shader::strided_copy())?;
    let y = gpu.alloc(out.clone())?;
    let (gx, gy) = grid(words.div_ceil(WORKGROUP));
    let mut params = vec![0u32; 8 + 2 * MAX_RANK];
    params[..5].copy_from_slice(&[words, gx * WORKGROUP, merged.len() as u32, offset, width]);
    for (d, &dim) in merged.iter().enumerate() {
        params[8 + d] = dim as u32;
        params[8 + MAX_RANK + d] = strides[0][d] as u32;
    }
    launch(gpu, &pipeline, &[x, &y], &params, (gx, gy, 1))?;
    Ok(Some(one(y)))
}

/// A constant of a 4-byte dtype.
fn fill_launch(
    gpu: &'static Gpu,
    attrs: &Attrs<'_>,
    out: &TensorMetadata,
) -> Result<Option<Outputs>> {
    let bits = match out.dtype {
        DType::F32 => (attrs.scalar("value")?.to_f64() as f32).to_bits(),
        DType::I32 => attrs.scalar("value")?.to_f64() as i32 as u32,
        _ => return Ok(None),
    };
    let Some(count) = small(out.shape.numel()) else {
        return Err(too_large(out));
    };
    let pipeline = gpu.pipeline(&shader::fill())?;
    let y = gpu.alloc(out.clone())?;
    let (gx, gy) = grid(count.div_ceil(WORKGROUP));
    launch(
        gpu,
        &pipeline,
        &[&y],
        &[count, gx * WORKGROUP, bits],
        (gx, gy, 1),
    )?;
    Ok(Some(one(y)))
}

/// Casts among f32, i32 and bool.
fn cast_launch(
    gpu: &'static Gpu,
    x: &DeviceTensor,
    out: &TensorMetadata,
) -> Result<Option<Outputs>> {
    let kind = |dtype: DType| match dtype {
        DType::F32 => Some(CastType::F32),
        DType::I32 => Some(CastType::I32),
        DType::Bool => Some(CastType::Bool),
        DType::I64 => Some(CastType::I64),
        _ => None,
    };
    let (Some(from), Some(to)) = (kind(x.metadata().dtype), kind(out.dtype)) else {
        return Ok(None);
    };
    if from == to {
        return Ok(Some(one(x.clone())));
    }
    let Some(count) = small(out.shape.numel()) else {
        return Err(too_large(out));
    };
    let pipeline = gpu.pipeline(&shader::cast(from, to))?;
    let y = gpu.alloc(out.clone())?;
    let threads = if to == CastType::Bool {
        count.div_ceil(4)
    } else {
        count
    };
    let (gx, gy) = grid(threads.div_ceil(WORKGROUP));
    launch(
        gpu,
        &pipeline,
        &[x, &y],
        &[count, gx * WORKGROUP],
        (gx, gy, 1),
    )?;
    Ok(Some(one(y)))
}

/// The reduced axes of a reduction's `axes` attribute (none = all).
pub(crate) fn reduced_axes(attrs: &Attrs<'_>, rank: usize) -> Result<Vec<bool>> {
    let axes = attrs.ints("axes")?;
    let mut reduced = vec![axes.is_empty(); rank];
    for &axis in axes {
        let axis = stagecraft_tensor::normalize_axis(axis as isize, rank)?;
        reduced[axis] = true;
    }
    Ok(reduced)
}

fn reduce_launch(
    gpu: &'static Gpu,
    reduce: ReduceOp,
    attrs: &Attrs<'_>,
    x: &DeviceTensor,
    out: &TensorMetadata,
) -> Result<Option<Outputs>> {
    let reduced = reduced_axes(attrs, x.metadata().shape.rank())?;
    reduce_over(gpu, reduce, &reduced, x, out)
}

/// `reduce` over the axes `reduced` marks.
fn reduce_over(
    gpu: &'static Gpu,
    reduce: ReduceOp,
    reduced: &[bool],
    x: &DeviceTensor,
    out: &TensorMetadata,
) -> Result<Option<Outputs>> {
    let dims = x.metadata().shape.dims();
    let strides = strides_of(dims);
    let (mut kept_dims, mut kept_strides) = (Vec::new(), Vec::new());
    let (mut red_dims, mut red_strides) = (Vec::new(), Vec::new());
    for d in 0..dims.len() {
        if dims[d] == 1 {
            continue;
        }
        if reduced[d] {
            red_dims.push(dims[d]);
            red_strides.push(strides[d]);
        } else {
            kept_dims.push(dims[d]);
            kept_strides.push(strides[d]);
        }
    }
    if kept_dims.len() > MAX_RANK || red_dims.len() > MAX_RANK {
        return Ok(None);
    }
    let count: usize = red_dims.iter().product();
    let outputs = out.shape.numel();
    let (Some(count), Some(outputs)) = (small(count), small(outputs)) else {
        return Err(too_large(out));
    };
    let ty = match x.metadata().dtype {
        DType::F32 => "f32",
        DType::I32 => "i32",
        _ => return Ok(None),
    };
    let float = ty == "f32";
    // Integer literals read as either type. i32 sums and products wrap,
    // as the CPU's do, and in modular arithmetic any order of the tree
    // gives the same bits.
    let (init, step, finish) = match reduce {
        ReduceOp::Sum => ("0", "return acc + x;", "acc"),
        ReduceOp::Mean if float => ("0", "return acc + x;", "acc / n"),
        ReduceOp::Prod => ("1", "return acc * x;", "acc"),
        // A NaN on either side wins, as on the CPU.
        ReduceOp::Max if float => (
            "-sc_inf()",
            "return select(select(x, acc, acc > x), sc_nan(), sc_isnan(acc) || sc_isnan(x));",
            "acc",
        ),
        ReduceOp::Min if float => (
            "sc_inf()",
            "return select(select(x, acc, acc < x), sc_nan(), sc_isnan(acc) || sc_isnan(x));",
            "acc",
        ),
        ReduceOp::Max => ("i32(-2147483648)", "return max(acc, x);", "acc"),
        ReduceOp::Min => ("2147483647", "return min(acc, x);", "acc"),
        // The CPU has no integer mean: its error is the op's.
        ReduceOp::Mean => return Ok(None),
    };
    let combine = Combine {
        ty,
        init,
        step,
        finish,
    };
    // Long reductions share a workgroup per output; short ones take a
    // thread each.
    let per_workgroup = count > 64;
    let source = if per_workgroup {
        shader::reduce_per_workgroup(&combine)
    } else {
        shader::reduce_per_thread(&combine)
    };
    let pipeline = gpu.pipeline(&source)?;
    let y = gpu.alloc(out.clone())?;
    let (gx, gy, row_width) = if per_workgroup {
        let (gx, gy) = grid(outputs);
        (gx, gy, gx)
    } else {
        let (gx, gy) = grid(outputs.div_ceil(WORKGROUP));
        (gx, gy, gx * WORKGROUP)
    };
    let mut params = vec![0u32; 8 + 4 * MAX_RANK];
    params[..5].copy_from_slice(&[
        outputs,
        count,
        kept_dims.len() as u32,
        red_dims.len() as u32,
        row_width,
    ]);
    for (d, (&dim, &stride)) in kept_dims.iter().zip(&kept_strides).enumerate() {
        params[8 + d] = dim as u32;
        params[8 + MAX_RANK + d] = stride as u32;
    }
    for (d, (&dim, &stride)) in red_dims.iter().zip(&red_strides).enumerate() {
        params[8 + 2 * MAX_RANK + d] = dim as u32;
        params[8 + 3 * MAX_RANK + d] = stride as u32;
    }
    launch(gpu, &pipeline, &[x, &y], &params, (gx, gy, 1))?;
    Ok(Some(one(y)))
}

fn softmax_launch(
    gpu: &'static Gpu,
    log: bool,
    attrs: &Attrs<'_>,
    x: &DeviceTensor,
    out: &TensorMetadata,
) -> Result<Option<Outputs>> {
    let dims = x.metadata().shape.dims();
    let axis = stagecraft_tensor::normalize_axis(attrs.int("axis")? as isize, dims.len().max(1))?;
    if dims.is_empty() {
        return Ok(None);
    }
    // Another axis: moved last by a transposing copy, and back.
    if axis + 1 != dims.len() {
        let mut perm: Vec<usize> = (0..dims.len()).filter(|&d| d != axis).collect();
        perm.push(axis);
        let mut back = vec![0; perm.len()];
        for (to, &from) in perm.iter().enumerate() {
            back[from] = to;
        }
        let Some(moved) = transposed(gpu, x, &perm)? else {
            return Ok(None);
        };
        let last = (dims.len() - 1) as i64;
        let mut last_axis = stagecraft_ops::OpAttrs::new();
        last_axis.set_int("axis", last);
        let op = if log {
            &defs::LOG_SOFTMAX
        } else {
            &defs::SOFTMAX
        };
        let moved_out = TensorMetadata::new(out.dtype, moved.metadata().shape.clone());
        let Some(ys) = softmax_launch(gpu, log, &Attrs::new(&last_axis, op), &moved, &moved_out)?
        else {
            return Ok(None);
        };
        return Ok(transposed(gpu, &ys[0], &back)?.map(one));
    }
    let width = dims[axis];
    let rows = out.shape.numel() / width;
    let (Some(width), Some(rows)) = (small(width), small(rows)) else {
        return Err(too_large(out));
    };
    let pipeline = gpu.pipeline(&shader::softmax(log))?;
    let y = gpu.alloc(out.clone())?;
    let (gx, gy) = grid(rows);
    launch(gpu, &pipeline, &[x, &y], &[rows, width, gx], (gx, gy, 1))?;
    Ok(Some(one(y)))
}

fn matmul_launch(
    gpu: &'static Gpu,
    attrs: &Attrs<'_>,
    inputs: &[&DeviceTensor],
    out: &TensorMetadata,
) -> Result<Option<Outputs>> {
    let (a, b) = (inputs[0], inputs[1]);
    let (ad, bd, od) = (
        a.metadata().shape.dims(),
        b.metadata().shape.dims(),
        out.shape.dims(),
    );
    // Vectors are matrices of one row (a) or one column (b), as the op
    // promotes them; the result drops that dimension again. (The op
    // refuses transpose flags on a vector.)
    if ad.len() < 2 || bd.len() < 2 {
        let as_matrix = |t: &DeviceTensor, dims: [usize; 2]| {
            t.with_metadata(TensorMetadata::new(t.metadata().dtype, dims))
        };
        let a2 = match ad {
            [k] => as_matrix(a, [1, *k]),
            _ => a.clone(),
        };
        let b2 = match bd {
            [k] => as_matrix(b, [*k, 1]),
            _ => b.clone(),
        };
        let mut dims = od.to_vec();
        if ad.len() == 1 {
            dims.insert(dims.len() - usize::from(bd.len() > 1), 1);
        }
        if bd.len() == 1 {
            dims.push(1);
        }
        let out2 = TensorMetadata::new(out.dtype, dims);
        let produced = matmul_launch(gpu, attrs, &[&a2, &b2], &out2)?;
        return Ok(produced.map(|ys| {
            ys.into_iter()
                .map(|y| y.with_metadata(out.clone()))
                .collect()
        }));
    }
    let (ta, tb) = (attrs.bool("transpose_a")?, attrs.bool("transpose_b")?);
    let (m, n) = (od[od.len() - 2], od[od.len() - 1]);
    let k = if ta {
        ad[ad.len() - 2]
    } else {
        ad[ad.len() - 1]
    };
    let batch: usize = od[..od.len() - 2].iter().product();
    // An operand's batch is either the output's or a single matrix shared
    // by every batch; other broadcasts run on the CPU.
    let batch_stride = |dims: &[usize], matrix: usize| -> Option<usize> {
        let own: usize = dims[..dims.len() - 2].iter().product();
        if own == 1 {
            Some(0)
        } else if dims[..dims.len() - 2] == od[..od.len() - 2] {
            Some(matrix)
        } else {
            None
        }
    };
    let (Some(sa), Some(sb)) = (batch_stride(ad, m * k), batch_stride(bd, k * n)) else {
        return Ok(None);
    };
    let sizes = [m, n, k, sa, sb, batch, out.shape.numel()];
    if sizes.iter().any(|&s| small(s).is_none()) {
        return Err(too_large(out));
    }
    let groups = (
        (n as u32).div_ceil(TILE),
        (m as u32).div_ceil(TILE),
        batch as u32,
    );
    if groups.0 > MAX_GROUPS_PER_DIM
        || groups.1 > MAX_GROUPS_PER_DIM
        || groups.2 > MAX_GROUPS_PER_DIM
    {
        return Ok(None);
    }
    if k == 0 {
        // An empty sum is zeros, which the CPU's kernel writes.
        return Ok(None);
    }
    let pipeline = gpu.pipeline(&shader::matmul())?;
    let y = gpu.alloc(out.clone())?;
    let params = [
        m as u32, n as u32, k as u32, ta as u32, tb as u32, sa as u32, sb as u32, 0,
    ];
    launch(gpu, &pipeline, &[a, b, &y], &params, groups)?;
    Ok(Some(one(y)))
}

/// The targets of a cross-entropy, checked on the host: `Some(count of
/// rows not ignored)` when every target is a class or the ignored value,
/// `None` otherwise (the CPU's kernel then reports the bad one).
fn checked_targets(
    gpu: &'static Gpu,
    targets: &DeviceTensor,
    classes: usize,
    ignore: Option<i64>,
) -> Result<Option<usize>> {
    let host = gpu.download(targets)?;
    let mut counted = 0;
    for &t in host.as_slice::<i32>()? {
        if Some(i64::from(t)) == ignore {
            continue;
        }
        if t < 0 || t as usize >= classes {
            return Ok(None);
        }
        counted += 1;
    }
    Ok(Some(counted))
}

/// The `has_ignore, ignore` words of the cross-entropy shaders (an
/// ignored value outside i32 never matches an i32 target).
fn ignore_words(ignore: Option<i64>) -> [u32; 2] {
    match ignore.map(i32::try_from) {
        Some(Ok(v)) => [1, v as u32],
        _ => [0, 0],
    }
}

fn cross_entropy_launch(
    gpu: &'static Gpu,
    attrs: &Attrs<'_>,
    inputs: &[&DeviceTensor],
    outputs: &[TensorMetadata],
) -> Result<Option<Outputs>> {
    let (logits, targets) = (inputs[0], inputs[1]);
    let dims = logits.metadata().shape.dims();
    let classes = dims[dims.len() - 1];
    let rows = targets.metadata().shape.numel();
    let ignore = defs::ignore_index(attrs)?;
    let Some(counted) = checked_targets(gpu, targets, classes, ignore)? else {
        return Ok(None);
    };
    let reduction = defs::LossReduction::of(attrs)?;
    let (Some(rows32), Some(classes32)) = (small(rows), small(classes)) else {
        return Err(too_large(logits.metadata()));
    };
    let scale: f32 = match reduction {
        defs::LossReduction::Mean if counted > 0 => 1.0 / counted as f32,
        _ => 1.0,
    };
    let row_meta = outputs[1].clone();
    let row_loss = gpu.alloc(TensorMetadata::new(DType::F32, row_meta.shape.clone()))?;
    let lse = gpu.alloc(row_meta)?;
    let pipeline = gpu.pipeline(&shader::cross_entropy_rows())?;
    let (gx, gy) = grid(rows32);
    let [has_ignore, ignored] = ignore_words(ignore);
    let params = [rows32, classes32, gx, has_ignore, ignored, scale.to_bits()];
    launch(
        gpu,
        &pipeline,
        &[logits, targets, &row_loss, &lse],
        &params,
        (gx, gy, 1),
    )?;
    let loss = match reduction {
        defs::LossReduction::None => row_loss.with_metadata(outputs[0].clone()),
        // Every row ignored: the mean is 0/0, NaN, as on the CPU.
        defs::LossReduction::Mean if counted == 0 => {
            let nan = gpu.alloc(outputs[0].clone())?;
            let pipeline = gpu.pipeline(&shader::fill())?;
            launch(
                gpu,
                &pipeline,
                &[&nan],
                &[1, WORKGROUP, f32::NAN.to_bits()],
                (1, 1, 1),
            )?;
            nan
        }
        _ => {
            let reduced = vec![true; row_loss.metadata().shape.rank()];
            match reduce_over(gpu, ReduceOp::Sum, &reduced, &row_loss, &outputs[0])? {
                Some(mut summed) => summed.remove(0),
                None => return Ok(None),
            }
        }
    };
    Ok(Some([loss, lse].into_iter().collect()))
}

fn cross_entropy_grad_launch(
    gpu: &'static Gpu,
    attrs: &Attrs<'_>,
    inputs: &[&DeviceTensor],
    out: &TensorMetadata,
) -> Result<Option<Outputs>> {
    let (logits, targets, lse, g) = (inputs[0], inputs[1], inputs[2], inputs[3]);
    let dims = logits.metadata().shape.dims();
    let classes = dims[dims.len() - 1];
    let ignore = defs::ignore_index(attrs)?;
    let Some(counted) = checked_targets(gpu, targets, classes, ignore)? else {
        return Ok(None);
    };
    let reduction = defs::LossReduction::of(attrs)?;
    let (Some(count), Some(classes32)) = (small(out.shape.numel()), small(classes)) else {
        return Err(too_large(out));
    };
    let scale: f32 = match reduction {
        defs::LossReduction::Mean if counted > 0 => 1.0 / counted as f32,
        _ => 1.0,
    };
    let scalar_g = !matches!(reduction, defs::LossReduction::None);
    let pipeline = gpu.pipeline(&shader::cross_entropy_grad())?;
    let y = gpu.alloc(out.clone())?;
    let (gx, gy) = grid(count.div_ceil(WORKGROUP));
    let [has_ignore, ignored] = ignore_words(ignore);
    let params = [
        count,
        gx * WORKGROUP,
        classes32,
        has_ignore,
        ignored,
        attrs.bool("subtract_target")? as u32,
        scalar_g as u32,
        scale.to_bits(),
    ];
    launch(
        gpu,
        &pipeline,
        &[logits, targets, lse, g, &y],
        &params,
        (gx, gy, 1),
    )?;
    Ok(Some(one(y)))
}

fn layer_norm_launch(
    gpu: &'static Gpu,
    attrs: &Attrs<'_>,
    inputs: &[&DeviceTensor],
    outputs: &[TensorMetadata],
) -> Result<Option<Outputs>> {
    let x = inputs[0];
    let dims = x.metadata().shape.dims();
    let width = dims[dims.len() - 1];
    let rows = outputs[1].shape.numel();
    // A row of no elements has NaN statistics: the CPU's kernel says so.
    if width == 0 {
        return Ok(None);
    }
    let (Some(width32), Some(rows32)) = (small(width), small(rows)) else {
        return Err(too_large(x.metadata()));
    };
    let (has_weight, has_bias) = (attrs.bool("has_weight")?, attrs.bool("has_bias")?);
    let source = shader::layer_norm(has_weight, has_bias);
    let eps = attrs.float("eps")? as f32;
    row_norm_launch(gpu, &source, inputs, outputs, [rows32, width32], eps).map(Some)
}

/// Launches a norm of one workgroup per row (see [`shader::ROW_MAIN`]):
/// binds `inputs`, then fresh tensors of `outputs`, which it returns.
/// `params`: `[rows, width, row_width_in_groups, eps (f32 bits)]`.
pub(crate) fn row_norm_launch(
    gpu: &'static Gpu,
    source: &str,
    inputs: &[&DeviceTensor],
    outputs: &[TensorMetadata],
    [rows, width]: [u32; 2],
    eps: f32,
) -> Result<Outputs> {
    let pipeline = gpu.pipeline(source)?;
    let produced: Outputs = outputs
        .iter()
        .map(|m| gpu.alloc(m.clone()))
        .collect::<Result<_>>()?;
    let (gx, gy) = grid(rows);
    let mut buffers: SmallVec<[&DeviceTensor; 8]> = inputs.iter().copied().collect();
    buffers.extend(produced.iter());
    let params = [rows, width, gx, eps.to_bits()];
    launch(gpu, &pipeline, &buffers, &params, (gx, gy, 1))?;
    drop(buffers);
    Ok(produced)
}

fn embedding_launch(
    gpu: &'static Gpu,
    inputs: &[&DeviceTensor],
    out: &TensorMetadata,
) -> Result<Option<Outputs>> {
    let (table, ids) = (inputs[0], inputs[1]);
    let [vocabulary, width] = table.metadata().shape.dims() else {
        return Ok(None);
    };
    let host = gpu.download(ids)?;
    let in_range = |id: i64| id >= 0 && (id as u64) < *vocabulary as u64;
    // i64 ids are read by their low word, which holds any id in range.
    let (valid, id_words) = match ids.metadata().dtype {
        DType::I64 => (host.as_slice::<i64>()?.iter().all(|&id| in_range(id)), 2),
        _ => (
            host.as_slice::<i32>()?
                .iter()
                .all(|&id| in_range(id as i64)),
            1,
        ),
    };
    // A bad id: the CPU's kernel reports it.
    if !valid {
        return Ok(None);
    }
    let (Some(count), Some(width32)) = (small(out.shape.numel()), small(*width)) else {
        return Err(too_large(out));
    };
    let pipeline = gpu.pipeline(&shader::embedding())?;
    let y = gpu.alloc(out.clone())?;
    let (gx, gy) = grid(count.div_ceil(WORKGROUP));
    launch(
        gpu,
        &pipeline,
        &[table, ids, &y],
        &[count, gx * WORKGROUP, width32, id_words],
        (gx, gy, 1),
    )?;
    Ok(Some(one(y)))
}

/// Constant padding of f32 or i32 tensors of rank up to [`MAX_RANK`].
fn pad_launch(
    gpu: &'static Gpu,
    attrs: &Attrs<'_>,
    x: &DeviceTensor,
    out: &TensorMetadata,
) -> Result<Option<Outputs>> {
    let value = attrs.float("value")?;
    let bits = match out.dtype {
        DType::F32 => (value as f32).to_bits(),
        DType::I32 => value as i32 as u32,
        _ => return Ok(None),
    };
    let in_dims = x.metadata().shape.dims();
    let out_dims = out.shape.dims();
    if out_dims.len() > MAX_RANK {
        return Ok(None);
    }
    let pads = attrs.dims("pads")?;
    let strides = strides_of(in_dims);
    let Some(count) = small(out.shape.numel()) else {
        return Err(too_large(out));
    };
    let pipeline = gpu.pipeline(&shader::pad())?;
    let y = gpu.alloc(out.clone())?;
    let (gx, gy) = grid(count.div_ceil(WORKGROUP));
    let mut params = vec![0u32; 4 + 4 * MAX_RANK];
    params[..4].copy_from_slice(&[count, gx * WORKGROUP, out_dims.len() as u32, bits]);
    for d in 0..out_dims.len() {
        let words = [out_dims[d], pads[2 * d], in_dims[d], strides[d]];
        for (k, &w) in words.iter().enumerate() {
            params[4 + k * MAX_RANK + d] = small(w).ok_or_else(|| too_large(out))?;
        }
    }
    launch(gpu, &pipeline, &[x, &y], &params, (gx, gy, 1))?;
    Ok(Some(one(y)))
}

/// Shader sources compiled for tests that check generated code compiles.
#[doc(hidden)]
pub fn every_elementwise_shader() -> Vec<(&'static str, String)> {
    let mut sources = Vec::new();
    for op in stagecraft_ops::UnaryOp::ALL {
        if let Some(expression) = op.wgsl() {
            let source = shader::elementwise(expression, Element::of(op.class()), 1);
            sources.push((op.def().name, source));
        }
    }
    for op in stagecraft_ops::BinaryOp::ALL {
        if let Some(expression) = op.wgsl() {
            let source = shader::elementwise(expression, Element::of(op.class()), 2);
            sources.push((op.def().name, source));
        }
    }
    if let Some(gelu) = stagecraft_ops::UnaryOp::Gelu.wgsl() {
        let source = shader::gelu_with_derivative(gelu);
        sources.push((defs::GELU_WITH_DERIVATIVE.name, source));
    }
    for &op in stagecraft_ops::all_ops() {
        if numeric_i32_launch(op).is_none() {
            continue;
        }
        match op.kind {
            OpKind::Unary(u) => sources.push((op.name, shader::unary_i32(u.wgsl().unwrap_or("")))),
            OpKind::Binary(b) => {
                sources.push((op.name, shader::binary_i32(b.wgsl().unwrap_or(""))))
            }
            _ => {}
        }
    }
    for &op in stagecraft_ops::all_ops() {
        if let OpKind::Compare(c) = op.kind {
            sources.push((op.name, shader::compare(c.wgsl())));
            sources.push((op.name, shader::compare_i32(c.wgsl())));
        }
    }
    let types = [CastType::F32, CastType::I32, CastType::Bool, CastType::I64];
    for from in types {
        for to in types {
            if from != to {
                sources.push(("Cast", shader::cast(from, to)));
            }
        }
    }
    sources.push(("Select", shader::select()));
    sources.push(("copy", shader::strided_copy()));
    sources.push(("Fill", shader::fill()));
    sources.push(("CrossEntropy", shader::cross_entropy_rows()));
    sources.push(("Embedding", shader::embedding()));
    sources.push(("Pad", shader::pad()));
    for (w, b) in [(false, false), (true, false), (false, true), (true, true)] {
        sources.push(("LayerNorm", shader::layer_norm(w, b)));
    }
    sources.push(("CrossEntropyGrad", shader::cross_entropy_grad()));
    sources
}

/// Compiles `source` on `gpu`, for tests of the generated shaders.
#[doc(hidden)]
pub fn compile(gpu: &Gpu, source: &str) -> Result<()> {
    gpu.pipeline(source).map(|_: Arc<Pipeline>| ())
}
