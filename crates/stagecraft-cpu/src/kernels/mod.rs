//! Kernel families; each registers its ops' kernels here.

use crate::{Inputs, KernelContext, KernelRegistry};
use stagecraft_tensor::{element_count, DType, DenseHostTensor, Error, Result, TensorMetadata};

pub(crate) mod attention;
mod collective;
mod creation;
pub(crate) mod effects;
mod elementwise;
mod fused;
mod indexing;
mod linalg;
mod list;
mod nn;
mod reduce;
mod scan;
#[cfg(target_arch = "x86_64")]
mod sgemm;
mod shape;
mod sort;
mod training;
mod transformer;

/// Whether a test case of `dtype` over `dims` runs in this build: every
/// case does, except that under Miri, which interprets each kernel call
/// thousands of times slower, a case runs only with one dtype of each
/// element width (bool, bf16, f32, i64) and at most 1,000 elements. Larger
/// cases exist to cross the kernels' parallel thresholds, where the work is
/// split by safe code (`pool`) over the same loops.
#[cfg(test)]
pub(crate) fn runs_in_this_build(dtype: stagecraft_tensor::DType, dims: &[usize]) -> bool {
    use stagecraft_tensor::DType;
    let miri_sized = matches!(dtype, DType::Bool | DType::BF16 | DType::F32 | DType::I64)
        && dims.iter().product::<usize>() <= 1_000;
    !cfg!(miri) || miri_sized
}

// ---------------------------------------------------------------------------
// Helpers every kernel family uses.

/// Moves exactly `N` inputs out of `inputs` (without the heap vector a
/// conversion through `Vec` would allocate on every call). Drained in
/// place: an owning iterator would first move the whole inline array of
/// four tensors.
pub(crate) fn take<const N: usize>(mut inputs: Inputs) -> Result<[DenseHostTensor; N]> {
    let got = inputs.len();
    if got != N {
        return Err(Error::internal(format!(
            "the kernel expects {N} inputs, got {got}"
        )));
    }
    let mut inputs = inputs.drain(..);
    Ok(std::array::from_fn(|_| {
        inputs.next().expect("as many inputs as counted")
    }))
}

/// The first output's metadata.
pub(crate) fn out_meta<'a>(ctx: &KernelContext<'a>) -> Result<&'a TensorMetadata> {
    ctx.outputs
        .first()
        .ok_or_else(|| Error::internal("kernel called without output metadata"))
}

/// The dtype of the first input, which picks a kernel factory's typed loop.
pub(crate) fn first_dtype(inputs: &[TensorMetadata]) -> Result<DType> {
    inputs
        .first()
        .map(|m| m.dtype)
        .ok_or_else(|| Error::internal("the kernel factory expects at least one input"))
}

/// `(outer, n, inner)`: the products of the dims before, at and after
/// `axis`, the view every along-an-axis kernel works in.
pub(crate) fn split3(dims: &[usize], axis: usize) -> (usize, usize, usize) {
    (
        element_count(&dims[..axis]),
        dims[axis],
        element_count(&dims[axis + 1..]),
    )
}

pub(crate) fn register_all(registry: &mut KernelRegistry) {
    attention::register(registry);
    collective::register(registry);
    creation::register(registry);
    effects::register(registry);
    elementwise::register(registry);
    fused::register(registry);
    indexing::register(registry);
    linalg::register(registry);
    list::register(registry);
    nn::register(registry);
    reduce::register(registry);
    scan::register(registry);
    shape::register(registry);
    sort::register(registry);
    training::register(registry);
    transformer::register(registry);
}
