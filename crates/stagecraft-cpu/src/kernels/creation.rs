//! (being written)
use crate::KernelRegistry;
pub(crate) fn register(_registry: &mut KernelRegistry) {}
