//! Kernel families; each registers its ops' kernels here.

use crate::KernelRegistry;

mod creation;
pub(crate) mod effects;
mod elementwise;
mod fused;
mod linalg;
mod list;
mod nn;
mod reduce;
#[cfg(target_arch = "x86_64")]
mod sgemm;
mod shape;

/// Whether a test case over `dims` runs in this build: every case does,
/// except that under Miri only cases of at most 1,000 elements run. Larger
/// ones exist to cross the kernels' parallel thresholds, where the work is
/// split by safe code (`pool`) over the same loops, and would cost Miri
/// minutes each.
#[cfg(test)]
pub(crate) fn runs_in_this_build(dims: &[usize]) -> bool {
    !cfg!(miri) || dims.iter().product::<usize>() <= 1_000
}

pub(crate) fn register_all(registry: &mut KernelRegistry) {
    creation::register(registry);
    effects::register(registry);
    elementwise::register(registry);
    fused::register(registry);
    linalg::register(registry);
    list::register(registry);
    nn::register(registry);
    reduce::register(registry);
    shape::register(registry);
}
