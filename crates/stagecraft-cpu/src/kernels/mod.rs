//! Kernel families; each registers its ops' kernels here.

use crate::KernelRegistry;

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

pub(crate) fn register_all(registry: &mut KernelRegistry) {
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
}
