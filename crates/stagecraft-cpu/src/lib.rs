//! CPU kernels: one dispatch function per op, registered against the op
//! definitions of `stagecraft-ops`.
//!
//! A kernel receives dense host inputs (owned, so it may reuse a buffer it
//! holds the last reference to) and the output metadata that the op's
//! metadata function already computed; it never re-validates shapes. The
//! [`reference`](mod@reference) module holds slow, obviously correct versions of the same
//! ops that the tests compare against.

pub mod collective;
mod kernel;
mod kernels;
pub mod numeric;
pub mod pool;
pub mod reference;

pub use kernel::{
    registry, settle_by_shape, AnyKernel, Inputs, Kernel, KernelContext, KernelFactory,
    KernelRegistry, Outputs, ValueInputs, ValueKernel, ValueKernelFactory, ValueOutputs,
};
pub use kernels::attention::{
    workspace_bytes as attention_workspace_bytes, Workspace as AttentionWorkspace,
};
pub use kernels::effects::{set_print_sink, PrintSink};

/// Below this many elements a kernel runs on the calling thread: forking
/// onto the rayon pool costs more than it saves.
pub const PARALLEL_THRESHOLD: usize = 1 << 15;
