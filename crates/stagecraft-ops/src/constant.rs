//! Running ops on constants while optimizing: the graph passes fold
//! constants through this interface, so that they depend on no device
//! crate. A device's kernels implement it (the CPU's, in `stagecraft-cpu`).

use crate::{Attrs, OpDef};
use smallvec::SmallVec;
use stagecraft_tensor::{DenseHostTensor, HostTensor, TensorMetadata};

/// Evaluates ops on constant inputs at optimization time.
pub trait ConstantKernels: Sync {
    /// The device kind whose kernels these are (`cpu`): only nodes placed
    /// there, or not placed, fold, so a folded value has that device's
    /// bits.
    fn device_kind(&self) -> &str;

    /// The outputs of `op` with `attrs` on `inputs`, which must have the
    /// metadata `outputs` promises; `None` when the op has no kernel here,
    /// its kernel fails, or it disagrees with that metadata. The node then
    /// stays, and running it reports any error at its line.
    fn evaluate(
        &self,
        op: &'static OpDef,
        attrs: &Attrs<'_>,
        inputs: &[DenseHostTensor],
        outputs: &[TensorMetadata],
    ) -> Option<SmallVec<[HostTensor; 1]>>;
}
