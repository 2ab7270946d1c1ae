//! The CPU kernel contract and the registry that maps ops to kernels.

use smallvec::SmallVec;
use stagecraft_ops::{Attrs, ConstantKernels, Effect, OpDef, ShapeKind};
use stagecraft_tensor::{DenseHostTensor, HostTensor, Result, TensorMetadata};
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

/// Kernel inputs: owned, so a kernel may write into a buffer it holds the
/// last reference to (`DenseHostTensor::is_unique`).
pub type Inputs = SmallVec<[DenseHostTensor; 4]>;

/// Kernel outputs, one per op output.
pub type Outputs = SmallVec<[DenseHostTensor; 1]>;

/// What a kernel knows besides its inputs.
pub struct KernelContext<'a> {
    /// The op's attributes, with declared defaults.
    pub attrs: Attrs<'a>,
    /// The output metadata computed by the op's metadata function (for a
    /// data-dependent op, only the dtype and rank are meaningful).
    pub outputs: &'a [TensorMetadata],
}

/// A kernel instantiated for one (op, attributes, input dtypes): it may
/// capture decoded attributes and a dtype-specialised function.
pub type Kernel = Arc<dyn Fn(Inputs, &KernelContext<'_>) -> Result<Outputs> + Send + Sync>;

/// Instantiates a kernel for the given attributes and input metadata. The
/// runtime caches the result per (op, attrs, input dtypes, device).
pub type KernelFactory = fn(attrs: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel>;

/// Inputs of a value kernel: host values of any kind (dense, broadcast
/// scalar, list), as they are.
pub type ValueInputs = SmallVec<[HostTensor; 4]>;

/// Outputs of a value kernel.
pub type ValueOutputs = SmallVec<[HostTensor; 1]>;

/// A kernel over host values of any kind rather than dense buffers: for
/// ops that pass values on without reading their elements (control flow
/// hands them to functions) or whose values are not dense (lists).
pub type ValueKernel =
    Arc<dyn Fn(ValueInputs, &KernelContext<'_>) -> Result<ValueOutputs> + Send + Sync>;

/// Instantiates a value kernel.
pub type ValueKernelFactory =
    fn(attrs: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<ValueKernel>;

/// Either kind of kernel, as the runtime caches it.
#[derive(Clone)]
pub enum AnyKernel {
    /// Reads and writes dense buffers.
    Dense(Kernel),
    /// Takes host values as they are.
    Value(ValueKernel),
}

/// Maps op definitions to kernel factories.
#[derive(Default)]
pub struct KernelRegistry {
    factories: HashMap<usize, KernelFactory>,
    value_factories: HashMap<usize, ValueKernelFactory>,
}

impl KernelRegistry {
    /// Registers the kernel factory of `op`; one per op.
    pub fn add(&mut self, op: &'static OpDef, factory: KernelFactory) {
        let previous = self.factories.insert(op as *const OpDef as usize, factory);
        assert!(
            previous.is_none(),
            "two CPU kernels registered for {}",
            op.name
        );
    }

    /// The factory for `op`, if the CPU has a kernel for it.
    pub fn get(&self, op: &OpDef) -> Option<KernelFactory> {
        self.factories.get(&(op as *const OpDef as usize)).copied()
    }

    /// Registers the value-kernel factory of `op`.
    pub fn add_value(&mut self, op: &'static OpDef, factory: ValueKernelFactory) {
        let previous = self
            .value_factories
            .insert(op as *const OpDef as usize, factory);
        assert!(
            previous.is_none(),
            "two CPU value kernels registered for {}",
            op.name
        );
    }

    /// The value-kernel factory for `op`, if it has one.
    pub fn get_value(&self, op: &OpDef) -> Option<ValueKernelFactory> {
        self.value_factories
            .get(&(op as *const OpDef as usize))
            .copied()
    }
}

/// The CPU kernel registry, built on first use.
pub fn registry() -> &'static KernelRegistry {
    static REGISTRY: OnceLock<KernelRegistry> = OnceLock::new();
    REGISTRY.get_or_init(|| {
        let mut registry = KernelRegistry::default();
        crate::kernels::register_all(&mut registry);
        registry
    })
}

/// Settles, from shapes alone, the dense kernel calls whose kernels must
/// not run; `Ok(None)` means run the kernel.
///
/// An empty tensor may carry dimensions whose product overflows before the
/// zero is reached (`[usize::MAX, 2, 0]`): legal metadata, but kernels
/// compute strides and loop bounds from such products. When every output
/// is empty anyway, the empty outputs are made here and the kernel never
/// runs. (Outputs too big to address never get this far: `OpDef::infer`
/// refuses them.)
///
/// Only pure ops with statically known output shapes are settled here: a
/// side-effecting kernel runs however empty its outputs are.
pub fn settle_by_shape<'a>(
    op: &OpDef,
    inputs: impl IntoIterator<Item = &'a TensorMetadata>,
    outputs: &[TensorMetadata],
) -> Result<Option<Outputs>> {
    let all_empty = !outputs.is_empty() && outputs.iter().all(|m| m.shape.numel() == 0);
    if !all_empty || op.shape_kind != ShapeKind::Static || op.effect != Effect::Pure {
        return Ok(None);
    }
    let huge = |meta: &TensorMetadata| {
        // Room for any product a kernel forms: by an element size, or by
        // one more dimension of a few elements.
        const LIMIT: usize = (isize::MAX as usize) >> 8;
        meta.shape
            .dims()
            .iter()
            .filter(|&&d| d != 0)
            .try_fold(1usize, |acc, &d| acc.checked_mul(d).filter(|&n| n <= LIMIT))
            .is_none()
    };
    if !outputs.iter().any(huge) && !inputs.into_iter().any(huge) {
        return Ok(None);
    }
    outputs
        .iter()
        .map(|meta| DenseHostTensor::zeros(meta.clone()))
        .collect::<Result<Outputs>>()
        .map(Some)
}

/// The CPU's kernels as the graph passes' [`ConstantKernels`]: constant
/// folding runs the very kernels a CPU function would, so folding cannot
/// change a bit of what it computes.
pub struct CpuConstantKernels;

/// The CPU's constant kernels.
pub static CONSTANT_KERNELS: CpuConstantKernels = CpuConstantKernels;

impl ConstantKernels for CpuConstantKernels {
    fn device_kind(&self) -> &str {
        "cpu"
    }

    fn evaluate(
        &self,
        op: &'static OpDef,
        attrs: &Attrs<'_>,
        inputs: &[DenseHostTensor],
        outputs: &[TensorMetadata],
    ) -> Option<SmallVec<[HostTensor; 1]>> {
        // The kernel gets buffers the caller's constants share, so it never
        // takes its in-place path: the same inputs can give NaNs of another
        // sign or payload in place (IEEE arithmetic does not fix them, and
        // the two loops compile differently). Out of place is how a kernel
        // runs whenever its input has another use.
        let held: Inputs = inputs.iter().cloned().collect();
        let metas: SmallVec<[TensorMetadata; 4]> =
            held.iter().map(|t| t.metadata().clone()).collect();
        // Shapes a kernel must not see (see `settle_by_shape`) are settled
        // without it, or left for run time to report.
        if let Some(settled) = settle_by_shape(op, &metas, outputs).ok()? {
            return Some(settled.into_iter().map(HostTensor::Dense).collect());
        }
        let factory = registry().get(op)?;
        // A panicking kernel is a kernel bug, but optimizing must not be
        // where it brings the process down: the node is left for run time
        // to report.
        let produced = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let kernel = factory(attrs, &metas)?;
            kernel(
                held,
                &KernelContext {
                    attrs: *attrs,
                    outputs,
                },
            )
        }))
        .ok()?
        .ok()?;
        // The nodes downstream were inferred against the recorded metadata;
        // a kernel that disagrees with it must not be trusted to replace it.
        if produced.len() != outputs.len()
            || produced
                .iter()
                .zip(outputs)
                .any(|(t, meta)| t.metadata() != meta)
        {
            return None;
        }
        Some(produced.into_iter().map(HostTensor::Dense).collect())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_op_has_a_cpu_kernel() {
        let missing: Vec<&str> = stagecraft_ops::all_ops()
            .iter()
            // Control-flow and transfer ops are run by the graph executor.
            .filter(|op| {
                !matches!(
                    op.kind,
                    stagecraft_ops::OpKind::Control(_) | stagecraft_ops::OpKind::Transfer
                )
            })
            .filter(|op| {
                super::registry().get(op).is_none() && super::registry().get_value(op).is_none()
            })
            .map(|op| op.name)
            .collect();
        assert!(missing.is_empty(), "ops without a CPU kernel: {missing:?}");
    }

    #[test]
    fn shapes_settle_only_huge_empty_and_unaddressable_outputs() {
        use stagecraft_ops::{EXP, PRINT};
        use stagecraft_tensor::{DType, Shape, TensorMetadata};
        let meta = |dims: &[usize]| TensorMetadata::new(DType::F32, Shape::new(dims));
        let settle = |op, dims: &[usize]| super::settle_by_shape(op, &[meta(dims)], &[meta(dims)]);
        // Empty with dims multiplying past usize: made here, kernel skipped.
        let made = settle(&EXP, &[usize::MAX, 2, 0]).unwrap().unwrap();
        assert_eq!(made[0].metadata(), &meta(&[usize::MAX, 2, 0]));
        // Ordinary shapes, empty or not, run the kernel (it may still
        // check values, as gather checks indices).
        assert!(settle(&EXP, &[2, 0]).unwrap().is_none());
        assert!(settle(&EXP, &[2, 3]).unwrap().is_none());
        // More bytes than an address space holds: refused by the metadata
        // step every kernel call goes through, before settling.
        let attrs = stagecraft_ops::OpAttrs::new();
        let err = EXP.infer(&[meta(&[usize::MAX / 2])], &attrs).unwrap_err();
        assert!(err.to_string().contains("does not fit in memory"), "{err}");
        // Side effects run however empty the outputs.
        assert!(settle(&PRINT, &[usize::MAX, 2, 0]).unwrap().is_none());
    }
}
