//! Recording: an op on a lazy device becomes a pending [`LazyOp`] and
//! handles to its outputs. Each thread keeps its own list of the ops it
//! recorded (what its `mark_step` runs) and its own count towards the
//! trace-length cap, so recording touches no state another thread uses.

use super::materialize::materialize_live;
use super::metrics::{count_recorded_op, Trigger};
use super::op::{Input, Inputs, LazyOp, LazyRef};
use crate::device::Device;
use crate::handle::TensorHandle;
use crate::op_handler::{OpInvocation, Results};
use stagecraft_ops::{OpAttrs, OpDef, OutputMetas};
use stagecraft_tensor::Location;
use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

/// How many ops a thread may record between materializations of its work
/// before it materializes them on its own.
static TRACE_LIMIT: AtomicUsize = AtomicUsize::new(10_000);

/// Sets how many ops a thread may have pending before the lazy runtime
/// materializes them on its own (so a loop that never calls
/// [`mark_step`](super::mark_step) stays bounded). The cap applies to each
/// thread's own recordings.
pub fn set_trace_limit(ops: usize) {
    TRACE_LIMIT.store(ops.max(1), Ordering::Relaxed);
}

/// One thread's recordings since its last step.
#[derive(Default)]
struct Recorder {
    /// Ops this thread recorded that may still be pending; weak, so an op
    /// nobody can read any more is freed at once.
    recorded: Vec<Weak<LazyOp>>,
    /// Ops recorded since the thread last materialized its live work.
    since_step: usize,
}

thread_local! {
    static RECORDER: RefCell<Recorder> = RefCell::new(Recorder::default());
}

pub(super) fn record(target: Device, mut inv: OpInvocation<'_>) -> Results {
    // The trace orders side effects by its own execution order.
    inv.release_chain();
    let OpInvocation {
        op,
        device,
        location,
        args,
        attrs,
        outputs,
        ..
    } = inv;
    record_op(target, op, device, location, args.iter(), &attrs, outputs)
}

/// Records `op` on `args` (whose metadata gave `outputs`) and returns its
/// output handles. Arguments are borrowed: a recorded op's output is held
/// through its op, and only a concrete value's handle is kept.
pub(super) fn record_op<'h>(
    target: Device,
    op: &'static OpDef,
    device: Device,
    location: Location,
    args: impl Iterator<Item = &'h TensorHandle>,
    attrs: &OpAttrs,
    outputs: OutputMetas,
) -> Results {
    let mut inputs = Inputs::new();
    for arg in args {
        inputs.push(match arg.lazy_ref() {
            Some(r) => {
                r.op.uses[r.index as usize].fetch_add(1, Ordering::Relaxed);
                Input::Op(r.op.clone(), r.index)
            }
            None => Input::Concrete {
                handle: arg.clone(),
            },
        });
    }
    let lazy_op = Arc::new(LazyOp::new(
        op,
        attrs.freeze(),
        location,
        outputs,
        target,
        inputs,
    ));
    count_recorded_op();
    let limit = TRACE_LIMIT.load(Ordering::Relaxed);
    let over_limit = RECORDER.with(|r| {
        let mut r = r.borrow_mut();
        r.recorded.push(Arc::downgrade(&lazy_op));
        r.since_step += 1;
        r.since_step >= limit
    });
    let handle = |i: usize, meta: &stagecraft_tensor::TensorMetadata| {
        TensorHandle::lazy(
            device,
            meta.clone(),
            LazyRef {
                op: lazy_op.clone(),
                index: i as u32,
            },
        )
    };
    // One output, the common case, without a collect's growth checks.
    let results: Results = match lazy_op.outputs.as_slice() {
        [meta] => smallvec::smallvec![handle(0, meta)],
        metas => metas
            .iter()
            .enumerate()
            .map(|(i, m)| handle(i, m))
            .collect(),
    };
    if over_limit {
        materialize_live(Trigger::TraceLimit);
    }
    results
}

/// The live outputs of pending ops this thread recorded: what its
/// `mark_step` materializes (with whatever they depend on, from any
/// thread). Forgets the ops that have run or been freed, and, when
/// `starting_step`, restarts the thread's count towards the trace cap.
///
/// Only this thread's: the step barrier belongs to the thread's program. A
/// trace fails as a whole, so running every thread's pending work in one
/// trace let one thread's kernel error (say, an integer division by zero)
/// fail another thread's independent tensors, naming a line that thread
/// never ran.
pub(super) fn live_roots(starting_step: bool) -> Vec<(Arc<LazyOp>, u32)> {
    RECORDER.with(|r| {
        let mut r = r.borrow_mut();
        if starting_step {
            r.since_step = 0;
        }
        let mut roots = Vec::new();
        r.recorded.retain(|weak| {
            let Some(op) = weak.upgrade() else {
                return false;
            };
            if op.is_done() {
                return false;
            }
            for index in 0..op.outputs.len() as u32 {
                if op.is_live(index) {
                    roots.push((op.clone(), index));
                }
            }
            true
        });
        roots
    })
}

/// `STAGECRAFT_LAZY_EAGER=1`: run each op on the target at once and keep
/// the results as concrete lazy tensors.
pub(super) fn execute_eagerly(target: Device, mut inv: OpInvocation<'_>) -> Results {
    inv.release_chain();
    let OpInvocation {
        op,
        device,
        location,
        args,
        attrs,
        ..
    } = inv;
    let moved: crate::Args = args
        .iter()
        .map(|a| match a.wait_value() {
            Ok(v) => TensorHandle::placed(target, v.clone()),
            Err(e) => TensorHandle::error(target, a.metadata().clone(), e),
        })
        .collect();
    crate::runtime::execute(op, target, location, moved, attrs)
        .into_iter()
        .map(|h| match h.wait_value() {
            Ok(v) => TensorHandle::available_value(device, v.clone()),
            Err(e) => TensorHandle::error(device, h.metadata().clone(), e),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::tests::{lazy_device, scalar, unary};
    use super::*;

    #[test]
    fn a_thread_sees_only_the_ops_it_recorded() {
        let d = lazy_device();
        let mine = unary(&stagecraft_ops::NEG, &scalar(1.0, d));
        let theirs = std::thread::spawn(move || {
            let t = unary(&stagecraft_ops::NEG, &scalar(2.0, d));
            let roots = live_roots(false);
            (roots.len(), t)
        });
        let (their_roots, theirs) = theirs.join().unwrap();
        assert_eq!(their_roots, 1);
        let roots = live_roots(false);
        assert_eq!(roots.len(), 1);
        assert!(Arc::ptr_eq(&roots[0].0, &mine.lazy_ref().unwrap().op));
        assert!(theirs.lazy_ref().is_some());
    }

    /// A two-output op (the single-output case has a path of its own)
    /// gives one handle per output, each counted live on its own output,
    /// and both read back right.
    #[test]
    fn each_output_of_a_recorded_op_has_its_own_handle() {
        let d = lazy_device();
        let x = super::super::tests::vector(&[3.0, 1.0, 2.0], d);
        let attrs = OpAttrs::new();
        let outs = crate::runtime::execute(
            &stagecraft_ops::SORT,
            d,
            Location::caller(),
            smallvec::smallvec![x],
            (&attrs).into(),
        );
        assert_eq!(outs.len(), 2);
        let (values, indices) = (outs[0].lazy_ref().unwrap(), outs[1].lazy_ref().unwrap());
        assert!(Arc::ptr_eq(&values.op, &indices.op));
        assert_eq!((values.index, indices.index), (0, 1));
        assert!(values.op.is_live(0) && values.op.is_live(1));
        assert_eq!(values.op.live.len(), 2);
        assert_eq!(values.op.uses.len(), 2);
        let sorted = outs[0].wait().unwrap().to_dense().unwrap();
        assert_eq!(sorted.to_vec::<f32>().unwrap(), [1.0, 2.0, 3.0]);
        let order = outs[1].wait().unwrap().to_dense().unwrap();
        assert_eq!(order.to_vec::<i64>().unwrap(), [1, 2, 0]);
    }

    #[test]
    fn dropped_tensors_are_not_roots() {
        let d = lazy_device();
        let kept = unary(&stagecraft_ops::NEG, &scalar(1.0, d));
        let dropped = unary(&stagecraft_ops::EXP, &kept);
        drop(dropped);
        let roots = live_roots(false);
        assert_eq!(roots.len(), 1);
        assert!(Arc::ptr_eq(&roots[0].0, &kept.lazy_ref().unwrap().op));
    }

    /// The cap counts this thread's recordings: a thread that records past
    /// it has its work run, however much another thread has pending.
    #[test]
    fn the_trace_cap_runs_the_recording_threads_work() {
        let _serial = super::super::tests::serial();
        let d = lazy_device();
        set_trace_limit(8);
        let mut t = scalar(1.0, d);
        for _ in 0..20 {
            t = unary(&stagecraft_ops::NEG, &t);
        }
        set_trace_limit(10_000);
        // 20 records with a cap of 8: two automatic materializations ran,
        // and the 4 ops since the last one are pending.
        let roots = live_roots(false);
        assert_eq!(roots.len(), 1);
        let mut pending = 0;
        let mut op = roots[0].0.clone();
        loop {
            if op.is_done() {
                break;
            }
            pending += 1;
            let next = match op.lock().state.inputs().and_then(|i| i.first()) {
                Some(Input::Op(child, _)) => child.clone(),
                _ => break,
            };
            op = next;
        }
        assert_eq!(pending, 4);
        assert_eq!(
            t.wait()
                .unwrap()
                .to_dense()
                .unwrap()
                .to_vec::<f32>()
                .unwrap(),
            [1.0]
        );
    }
}
