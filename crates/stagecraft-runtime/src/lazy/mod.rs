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
//!   argument dtypes and shapes), never values: a flat list of words in
//!   which each op is the number its (op, attributes, output metadata)
//!   got when it was recorded, so a step's lookup hashes and compares
//!   words, not attribute maps and shapes. Materialized tensors are
//!   arguments; small constants are baked in until a trace differs from a
//!   cached one only in their values, which turns them into arguments
//!   (widening), so per-step scalars cost at most one extra compile.
//! - Threads record and materialize independently: each keeps its own list
//!   of recorded ops, recording takes no lock another thread takes, and
//!   two threads run their traces at the same time. An op that two
//!   threads' traces share (a lazy tensor handed to another thread) is
//!   claimed by one trace, which runs it; the other waits for it and reads
//!   its value.
//!
//! The modules follow an op's life: `op` (a recorded op, its states and
//! claims), `record`, `collect` (a trace's ops and structure), `cache`
//! (compiled traces by structure), `materialize` (claim, run, store), plus
//! `inspect` (a trace printed without running it), `metrics`, and
//! `signature` (the numbers of recorded op signatures).

mod cache;
mod collect;
mod inspect;
mod materialize;
mod metrics;
mod op;
mod record;
mod signature;

pub use inspect::{step_trace, trace_dot, trace_text, StepTrace};
pub use materialize::mark_step;
pub(crate) use materialize::materialize_handle;
pub use metrics::{metrics, reset_metrics, LazyMetrics, Trigger};
pub(crate) use op::LazyRef;
pub use record::set_trace_limit;

use crate::device::Device;
use crate::handle::TensorHandle;
use crate::op_handler::{InputMetas, OpHandler, OpInvocation, ReadyArgs, Results};
use stagecraft_ops::{Effect, OpAttrs, OpDef, ShapeKind};
use stagecraft_tensor::Location;

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
            return record::execute_eagerly(self.target, inv);
        }
        record::record(self.target, inv)
    }

    /// Records a pure op whose arguments all live on this device and are
    /// not errors, from the caller's handles: no argument handle is cloned
    /// and no invocation built. Anything else (a side effect, an argument
    /// to copy or an error to propagate, a failing metadata function,
    /// which the full path reports) takes the full path.
    fn execute_ready<'a>(
        &self,
        op: &'static OpDef,
        device: Device,
        location: Location,
        args: ReadyArgs<'a>,
        attrs: &OpAttrs,
    ) -> std::result::Result<Results, ReadyArgs<'a>> {
        if self.eager
            || op.effect != Effect::Pure
            || op.shape_kind != ShapeKind::Static
            || args
                .iter()
                .any(|a| a.device() != device || a.resolved_error().is_some())
        {
            return Err(args);
        }
        // Pushed in place: a `collect` builds the inline array of four
        // metadata elsewhere and then moves it here (a `memmove` in a
        // profile of recording one op).
        let mut inputs = InputMetas::new();
        for arg in args.iter() {
            inputs.push(arg.metadata().clone());
        }
        let Ok(outputs) = op.infer(&inputs, attrs) else {
            return Err(args);
        };
        Ok(record::record_op(
            self.target,
            op,
            device,
            location,
            args.iter(),
            attrs,
            outputs,
        ))
    }

    /// The target's memory: a materialized value of a lazy tensor lives
    /// where its trace ran.
    fn memory(&self) -> Option<&dyn crate::op_handler::DeviceMemory> {
        self.target.handler().memory()
    }

    fn synchronize(&self) -> stagecraft_tensor::Result<()> {
        self.target.handler().synchronize()
    }
}

/// Whether a handle lives on a lazy device.
pub fn is_lazy_handle(handle: &TensorHandle) -> bool {
    handle.device().kind() == crate::device::DeviceKind::Lazy
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use stagecraft_ops::{OpAttrs, OpDef};
    use stagecraft_tensor::{DenseHostTensor, Location};

    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// Held by tests that change process-wide settings (the trace cap).
    pub(crate) fn serial() -> std::sync::MutexGuard<'static, ()> {
        SERIAL.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn lazy_device() -> Device {
        Device::lazy(&Device::cpu())
    }

    /// A concrete f32 scalar on `d`.
    pub(crate) fn scalar(v: f32, d: Device) -> TensorHandle {
        let value = DenseHostTensor::from_slice(&[v], [0usize; 0]).unwrap();
        TensorHandle::available(d, value.into())
    }

    /// A concrete f32 vector on `d`.
    pub(crate) fn vector(v: &[f32], d: Device) -> TensorHandle {
        let value = DenseHostTensor::from_slice(v, [v.len()]).unwrap();
        TensorHandle::available(d, value.into())
    }

    pub(crate) fn unary(op: &'static OpDef, x: &TensorHandle) -> TensorHandle {
        let attrs = OpAttrs::new();
        crate::runtime::execute(
            op,
            x.device(),
            Location::caller(),
            smallvec::smallvec![x.clone()],
            (&attrs).into(),
        )
        .remove(0)
    }

    pub(crate) fn binary(op: &'static OpDef, a: &TensorHandle, b: &TensorHandle) -> TensorHandle {
        let attrs = OpAttrs::new();
        crate::runtime::execute(
            op,
            a.device(),
            Location::caller(),
            smallvec::smallvec![a.clone(), b.clone()],
            (&attrs).into(),
        )
        .remove(0)
    }

    /// The f32 values of `h` (reading it materializes it).
    pub(crate) fn values(h: &TensorHandle) -> Vec<f32> {
        h.wait()
            .unwrap()
            .to_dense()
            .unwrap()
            .to_vec::<f32>()
            .unwrap()
    }

    /// An op on a lazy device is recorded; reading it runs its trace.
    #[test]
    fn a_lazy_device_records_and_a_read_runs_the_trace() {
        let d = lazy_device();
        let y = binary(&stagecraft_ops::ADD, &scalar(1.0, d), &scalar(2.0, d));
        assert!(is_lazy_handle(&y));
        assert!(!y.is_resolved(), "recorded, not run");
        assert_eq!(values(&y), [3.0]);
    }

    /// Recorded from borrowed handles, an op keeps a concrete argument's
    /// handle and only the op behind a recorded one; an argument that is
    /// an error, or inputs that do not fit, still get the full path's
    /// answers at once: the error propagated, or raised naming the op.
    #[test]
    fn ops_recorded_from_borrowed_handles_answer_as_the_full_path() {
        let d = lazy_device();
        let w = unary(&stagecraft_ops::NEG, &scalar(1.0, d));
        let c = vector(&[1.0, 2.0], d);
        let attrs = OpAttrs::new();
        let add = |a: &TensorHandle, b: &TensorHandle| {
            crate::runtime::execute_borrowed(
                &stagecraft_ops::ADD,
                d,
                Location::caller(),
                &[a, b],
                &attrs,
            )
            .remove(0)
        };
        let y = add(&w, &c);
        assert!(!y.is_resolved(), "recorded");
        assert_eq!((w.ref_count(), c.ref_count()), (1, 2));
        assert_eq!(values(&y), [0.0, 1.0]);

        let failed = TensorHandle::error(
            d,
            c.metadata().clone(),
            stagecraft_tensor::Error::invalid("an earlier failure"),
        );
        let propagated = add(&failed, &c);
        let err = propagated.resolved_error().expect("propagated at once");
        assert!(err.to_string().contains("an earlier failure"), "{err}");

        let misfit = add(&c, &vector(&[1.0, 2.0, 3.0], d));
        let err = misfit.resolved_error().expect("raised at once");
        assert_eq!(err.op(), Some("Add"), "{err}");
    }
}
