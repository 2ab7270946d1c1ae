//! Which devices have a kernel for an op: one registry keyed by
//! (op, device kind, input dtypes), over the kernels each device crate
//! declares beside its code (`stagecraft-cpu`'s `register_all`,
//! `stagecraft-wgpu`'s kernel table).
//!
//! The answer here is what the handlers do: the CPU handler instantiates
//! the factory found here, and the GPU handler launches the entry of the
//! same table (`stagecraft_wgpu::run` looks it up), or runs the op on the
//! CPU with copies and a one-time warning when there is none. A third
//! device (a CUDA handler) adds a [`DeviceKernel`] variant and its
//! crate's table.

use crate::device::DeviceKind;
use stagecraft_cpu::{KernelFactory, ValueKernelFactory};
use stagecraft_ops::{OpDef, OpKind};
use stagecraft_tensor::DType;

/// A device's kernel for an op, as the registry finds it.
#[derive(Clone, Copy, Debug)]
pub enum DeviceKernel {
    /// A CPU kernel over dense buffers, instantiated per attributes and
    /// dtypes (the factory refuses dtypes the op's definition does not
    /// admit, with an error naming the op).
    Cpu(KernelFactory),
    /// A CPU kernel over host values as they are (lists, control flow's
    /// arguments).
    CpuValue(ValueKernelFactory),
    /// Control flow (`Call`, `If`, `While`): every device runs its
    /// functions' nodes with its own kernels.
    Control,
    /// A GPU kernel of `stagecraft-wgpu`'s table for these dtypes.
    #[cfg(feature = "wgpu")]
    Gpu(&'static stagecraft_wgpu::GpuKernel),
}

/// The kernel a device of `kind` runs `op` with, for inputs of `dtypes`;
/// `None` when it has none (a GPU then runs the op on the CPU). A lazy
/// device records ops and has kernels only through its target, and a
/// custom handler's kernels are its own business: both answer `None`.
pub fn kernel_for(op: &'static OpDef, kind: DeviceKind, dtypes: &[DType]) -> Option<DeviceKernel> {
    if let OpKind::Control(_) = op.kind {
        return matches!(kind, DeviceKind::Cpu | DeviceKind::Host | DeviceKind::Gpu)
            .then_some(DeviceKernel::Control);
    }
    match kind {
        // The host device runs the CPU's kernels on its own thread.
        DeviceKind::Cpu | DeviceKind::Host => {
            let registry = stagecraft_cpu::registry();
            registry
                .get(op)
                .map(DeviceKernel::Cpu)
                .or_else(|| registry.get_value(op).map(DeviceKernel::CpuValue))
        }
        #[cfg(feature = "wgpu")]
        DeviceKind::Gpu => stagecraft_wgpu::lookup(op, dtypes).map(DeviceKernel::Gpu),
        _ => {
            let _ = dtypes;
            None
        }
    }
}

/// The device kinds with a kernel for `op` at `dtypes`, of those this
/// build has (the GPU with the `wgpu` feature).
pub fn devices_with_kernel(op: &'static OpDef, dtypes: &[DType]) -> Vec<DeviceKind> {
    let kinds: &[DeviceKind] = if cfg!(feature = "wgpu") {
        &[DeviceKind::Cpu, DeviceKind::Gpu]
    } else {
        &[DeviceKind::Cpu]
    };
    kinds
        .iter()
        .copied()
        .filter(|&kind| kernel_for(op, kind, dtypes).is_some())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagecraft_ops::defs;
    use DType::F32;

    #[test]
    fn every_op_has_a_cpu_kernel_and_the_gpu_answers_by_dtype() {
        for &op in stagecraft_ops::all_ops() {
            // Transfers are the executor's steps, not kernels.
            if op.kind == OpKind::Transfer {
                continue;
            }
            assert!(
                kernel_for(op, DeviceKind::Cpu, &[F32]).is_some(),
                "{} has no CPU kernel",
                op.name
            );
        }
        assert!(kernel_for(&defs::MATMUL, DeviceKind::Lazy, &[F32, F32]).is_none());
        #[cfg(feature = "wgpu")]
        {
            use DType::I32;
            assert!(matches!(
                kernel_for(&defs::MATMUL, DeviceKind::Gpu, &[F32, F32]),
                Some(DeviceKernel::Gpu(_))
            ));
            assert!(kernel_for(&defs::MATMUL, DeviceKind::Gpu, &[I32, I32]).is_none());
            assert_eq!(
                devices_with_kernel(&defs::MATMUL, &[F32, F32]),
                [DeviceKind::Cpu, DeviceKind::Gpu]
            );
            assert_eq!(
                devices_with_kernel(&defs::MATMUL, &[I32, I32]),
                [DeviceKind::Cpu]
            );
        }
    }
}
