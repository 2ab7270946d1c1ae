//! The lazy tensor device: put tensors on `Device::lazy(&Device::cpu())`
//! and the same program records its ops instead of running them; values
//! are computed by compiled, cached traces when you read them or call
//! [`mark_step`] at the end of a training step.
//!
//! ```
//! use stagecraft::{lazy, Device, Tensor};
//! let dev = Device::lazy(&Device::cpu());
//! let a = Tensor::<f32>::scalar(10.0, &dev);
//! let w = &a + 2.0;
//! let z = (&w - 3.0) * 2.0;
//! assert_eq!(z.dims(), &[] as &[usize]); // known without running anything
//! assert!(lazy::trace_text(&z)?.contains("Sub"));
//! assert_eq!(z.item()?, 18.0);
//! # Ok::<(), stagecraft::Error>(())
//! ```

use crate::Tensor;
use stagecraft_runtime::lazy as imp;
use stagecraft_tensor::{Element, Result};

pub use imp::{
    mark_step, metrics, reset_metrics, set_trace_limit, step_trace, LazyMetrics, StepTrace, Trigger,
};

/// The trace that materializing `t` now would run, in the lazy-tensor text
/// form (`lazyTrace_N(%0: f32[]) -> (...) { ... return (...) }`), followed
/// by a comment listing the requested and the live outputs.
pub fn trace_text<T: Element>(t: &Tensor<T>) -> Result<String> {
    imp::trace_text(t.handle())
}

/// The same trace as Graphviz DOT.
pub fn trace_dot<T: Element>(t: &Tensor<T>) -> Result<String> {
    imp::trace_dot(t.handle())
}
