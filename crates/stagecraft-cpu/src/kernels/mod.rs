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
}
