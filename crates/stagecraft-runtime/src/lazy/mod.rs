//! Lazy tensors (the S4TF/PyTorch-XLA design): ops on a lazy device are
//! recorded, with their metadata computed at once, and run later as one
//! compiled trace on the target device.
//!
//! - A lazy tensor is concrete (an available value, `materialized` when a
//!   trace computed it) or symbolic (a recorded op output).
//! - Materialization (a value read, [`mark_step`], or the trace-length cap)
//!   collects the pending ops the requested tensors depend on, in a
//!   deterministic DFS order, turns them into a graph function, takes the
//!   compiled executable from the trace cache or compiles it, runs it, and
//!   memoizes every output it produced.
//! - Outputs are the requested tensors plus exactly the op outputs that a
//!   live user tensor still refers to, or that a pending op outside the
//!   trace reads; intermediates used only inside the trace are not outputs.
//! - The cache key is the trace's structure (ops, attributes, wiring,
//!   argument dtypes and shapes), never values. Materialized tensors are
//!   arguments; small constants are baked in until a trace differs from a
//!   cached one only in their values, which turns them into arguments
//!   (widening), so per-step scalars cost at most one extra compile.

mod trace;

pub use trace::{
    mark_step, metrics, reset_metrics, set_trace_limit, step_trace, trace_dot, trace_text,
    LazyMetrics, StepTrace, Trigger,
};
pub(crate) use trace::{materialize_handle, LazyRef};

use crate::device::Device;
use crate::handle::TensorHandle;
use crate::op_handler::{OpHandler, OpInvocation, Results};

/// The op handler of a lazy device: records ops (or, with
/// `STAGECRAFT_LAZY_EAGER=1`, runs them one by one on the target device for
/// debugging).
pub struct LazyOpHandler {
    name: String,
    target: Device,
    eager: bool,
}

impl LazyOpHandler {
    /// A handler whose traces run on `target`.
    pub fn new(target: Device) -> LazyOpHandler {
        LazyOpHandler {
            name: format!("lazy:{target}"),
            target,
            eager: std::env::var("STAGECRAFT_LAZY_EAGER").is_ok_and(|v| v == "1"),
        }
    }

    /// The device traces run on.
    pub fn target(&self) -> Device {
        self.target
    }
}

impl OpHandler for LazyOpHandler {
    fn name(&self) -> &str {
        &self.name
    }

    fn execute(&self, inv: OpInvocation<'_>) -> Results {
        // A data-dependent output shape (`Nonzero`) is known only once the
        // op has run, and every op recorded after it infers its metadata
        // from that shape: run such an op now, as the eager mode does.
        if self.eager || inv.op.shape_kind == stagecraft_ops::ShapeKind::DataDependent {
            return trace::execute_eagerly(self.target, inv);
        }
        trace::record(self.target, inv)
    }
}

/// Whether a handle lives on a lazy device.
pub fn is_lazy_handle(handle: &TensorHandle) -> bool {
    handle.device().kind() == crate::device::DeviceKind::Lazy
}
